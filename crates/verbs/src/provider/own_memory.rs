//! Reading memory by address through the kernel (`process_vm_readv`), so that an address
//! that cannot be read is an error, never a fault: the private memory of another process (shm),
//! and memory of this process that only a raw address names, with nothing vouching for it (the
//! SGEs of an INLINE request, which verbs lets name memory outside every registration), which
//! the providers turn into a completion or a post error.

use std::io;

/// Append the `len` bytes at `addr` of this process to `out`; an error (and `out` unchanged)
/// when any of them cannot be read.
pub(crate) fn read_own(addr: u64, len: usize, out: &mut Vec<u8>) -> io::Result<()> {
    out.reserve(len);
    let start = out.len();
    vm_read(
        std::process::id() as i32,
        addr,
        out.spare_capacity_mut().as_mut_ptr().cast(),
        len,
    )?;
    // SAFETY: `vm_read` wrote all `len` bytes after `start` (it returns `Ok` only then), inside
    // the capacity reserved above.
    unsafe { out.set_len(start + len) };
    Ok(())
}

/// Copy `len` bytes from address `src` of process `pid` (this one or another) to local `dst`,
/// which must be writable for `len` bytes.
pub(crate) fn vm_read(pid: i32, src: u64, dst: *mut u8, len: usize) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let local = libc::iovec {
            iov_base: dst.wrapping_add(done).cast(),
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (src as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: `local` covers writable memory of this process (the caller's `dst`); the
        // kernel checks `remote` against the mappings of `pid` and reports EFAULT rather than
        // touching anything unmapped or unreadable.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        done += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::read_own;

    #[test]
    fn reads_readable_memory_and_refuses_the_rest() {
        let src: Vec<u8> = (0..=255u8).collect();
        let mut out = vec![9u8];
        read_own(src.as_ptr() as u64 + 10, 100, &mut out).unwrap();
        assert_eq!(out[0], 9);
        assert_eq!(&out[1..], &src[10..110]);
        // The first page is never mapped (vm.mmap_min_addr).
        assert!(read_own(16, 8, &mut out).is_err());
        assert_eq!(out.len(), 101, "nothing appended on failure");
        read_own(0, 0, &mut out).unwrap();
        assert_eq!(out.len(), 101);
    }
}
