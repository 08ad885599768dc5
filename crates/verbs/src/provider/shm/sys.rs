//! Thin, safe wrappers over the Linux system calls the `shm` provider needs: memfd segments and
//! their mappings, pidfds (liveness and fd duplication), eventfds, epoll, and cross-memory
//! attach (`process_vm_writev`; reads: `provider::own_memory`).
//!
//! Every call returns `io::Error` on failure; nothing here knows about verbs. The raw pointers
//! handed out by [`map_shared`] are owned by `segment`, which unmaps them.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn cvt_long(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// A new sealable memfd of `len` bytes whose size is then sealed (it can neither shrink nor
/// grow), so a process that maps it can never take SIGBUS from a later truncation.
pub(crate) fn memfd_sealed(name: &str, len: u64) -> io::Result<OwnedFd> {
    let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `cname` is a valid NUL-terminated string; flags are valid memfd flags.
    let fd = cvt(unsafe {
        libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
    })?;
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len =
        libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: plain syscall on a descriptor we own.
    cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), len) })?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: plain fcntl on a descriptor we own.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) })?;
    Ok(fd)
}

/// True when `fd` is a memfd of exactly `len` bytes that can no longer shrink.
pub(crate) fn is_sealed_memfd_of(fd: BorrowedFd<'_>, len: u64) -> io::Result<bool> {
    // SAFETY: plain fcntl on a valid descriptor.
    let seals = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) })?;
    if seals & libc::F_SEAL_SHRINK == 0 {
        return Ok(false);
    }
    // SAFETY: `st` is plain old data that fstat fills.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable stat buffer.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(u64::try_from(st.st_size).ok() == Some(len))
}

/// Map `len` bytes of `fd` shared, read-write, without swap reservation.
pub(crate) fn map_shared(fd: BorrowedFd<'_>, len: usize) -> io::Result<*mut u8> {
    // SAFETY: a fresh mapping chosen by the kernel (addr NULL); it aliases no Rust object.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_NORESERVE,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

/// Unmap a mapping made by [`map_shared`].
///
/// # Safety
/// `ptr`/`len` must be exactly a live mapping from [`map_shared`] that no reference points into.
pub(crate) unsafe fn unmap(ptr: *mut u8, len: usize) {
    // SAFETY: forwarded contract.
    unsafe {
        libc::munmap(ptr.cast(), len);
    }
}

/// Release (and zero) the pages of `[off, off+len)` of a memfd.
pub(crate) fn punch_hole(fd: BorrowedFd<'_>, off: u64, len: u64) -> io::Result<()> {
    let off =
        libc::off_t::try_from(off).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let len =
        libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: plain syscall on a valid descriptor.
    cvt(unsafe {
        libc::fallocate(
            fd.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off,
            len,
        )
    })?;
    Ok(())
}

/// A pidfd for `pid`.
pub(crate) fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; arguments are integers.
    let fd = cvt_long(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
    // SAFETY: the kernel returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Duplicate descriptor `target_fd` of the process behind `pidfd` into this process.
pub(crate) fn pidfd_getfd(pidfd: BorrowedFd<'_>, target_fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; arguments are integers.
    let fd =
        cvt_long(unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target_fd, 0) })?;
    // SAFETY: the kernel returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// True while the process behind `pidfd` runs (a pidfd turns readable when it exits).
pub(crate) fn pidfd_alive(pidfd: BorrowedFd<'_>) -> bool {
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    !(n > 0 && pfd.revents != 0)
}

/// This process's id.
pub(crate) fn getpid() -> i32 {
    std::process::id() as i32
}

/// A non-blocking, close-on-exec eventfd.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
    // SAFETY: fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Add one to an eventfd's counter (it becomes readable). Errors are ignored: a full counter is
/// already readable.
pub(crate) fn eventfd_kick(fd: BorrowedFd<'_>) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64.
    unsafe {
        libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8);
    }
}

/// Read and reset an eventfd's counter; 0 when it was not readable.
pub(crate) fn eventfd_drain(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a valid u64.
    let n = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    if n == 8 {
        return Ok(v);
    }
    let err = io::Error::last_os_error();
    if err.kind() == io::ErrorKind::WouldBlock {
        Ok(0)
    } else {
        Err(err)
    }
}

/// True when `fd` is an eventfd.
pub(crate) fn is_eventfd(fd: BorrowedFd<'_>) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map(|p| p.to_string_lossy().contains("eventfd"))
        .unwrap_or(false)
}

/// A close-on-exec epoll instance.
pub(crate) fn epoll_create() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
    // SAFETY: fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Watch `fd` for readability, tagging events with `data`.
pub(crate) fn epoll_add(epfd: BorrowedFd<'_>, fd: BorrowedFd<'_>, data: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: data,
    };
    // SAFETY: valid descriptors and a valid event struct.
    cvt(unsafe {
        libc::epoll_ctl(
            epfd.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            fd.as_raw_fd(),
            &mut ev,
        )
    })?;
    Ok(())
}

/// Stop watching `fd`.
pub(crate) fn epoll_del(epfd: BorrowedFd<'_>, fd: BorrowedFd<'_>) {
    // SAFETY: valid descriptors; a null event is allowed for DEL.
    unsafe {
        libc::epoll_ctl(
            epfd.as_raw_fd(),
            libc::EPOLL_CTL_DEL,
            fd.as_raw_fd(),
            std::ptr::null_mut(),
        );
    }
}

/// Wait for events; returns the tags of the ready descriptors (at most 16).
pub(crate) fn epoll_wait(
    epfd: BorrowedFd<'_>,
    timeout_ms: i32,
    out: &mut Vec<u64>,
) -> io::Result<()> {
    const N: usize = 16;
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; N];
    // SAFETY: `evs` is a valid buffer of N events.
    let n = unsafe { libc::epoll_wait(epfd.as_raw_fd(), evs.as_mut_ptr(), N as i32, timeout_ms) };
    out.clear();
    if n < 0 {
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::Interrupted {
            return Ok(());
        }
        return Err(err);
    }
    for ev in evs.iter().take(n as usize) {
        let tag = ev.u64;
        out.push(tag);
    }
    Ok(())
}

/// Copy `len` bytes from local `src` to address `dst` of process `pid`.
pub(crate) fn vm_write(pid: i32, src: *const u8, dst: u64, len: usize) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let local = libc::iovec {
            iov_base: src.wrapping_add(done) as *mut libc::c_void,
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (dst as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: the kernel checks both address ranges; it never touches memory it cannot
        // reach and reports EFAULT instead. `local` covers readable memory of this process.
        let n = unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
        done += n as usize;
    }
    Ok(())
}

/// This boot's id: two processes share memory only if they run under the same kernel boot.
pub(crate) fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-boot".to_string())
}

/// This thread's id.
pub(crate) fn gettid() -> u32 {
    // SAFETY: plain syscall without arguments.
    unsafe { libc::gettid() as u32 }
}

/// Initialise a process-shared robust mutex in place.
///
/// # Safety
/// `m` must point to writable, suitably aligned memory for a `pthread_mutex_t` that no thread
/// uses yet.
pub(crate) unsafe fn robust_mutex_init(m: *mut libc::pthread_mutex_t) -> io::Result<()> {
    // SAFETY: `attr` is initialised by pthread_mutexattr_init before any other use; `m` is
    // valid per the contract.
    unsafe {
        let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
        let r = libc::pthread_mutexattr_init(&mut attr);
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
        libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
        let r = libc::pthread_mutex_init(m, &attr);
        libc::pthread_mutexattr_destroy(&mut attr);
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
    }
    Ok(())
}

/// Lock a robust mutex (recovering it if a previous owner died).
///
/// # Safety
/// `m` must be a mutex initialised by [`robust_mutex_init`] that stays mapped while locked.
pub(crate) unsafe fn robust_mutex_lock(m: *mut libc::pthread_mutex_t) -> io::Result<()> {
    // SAFETY: forwarded contract.
    let r = unsafe { libc::pthread_mutex_lock(m) };
    match r {
        0 => Ok(()),
        libc::EOWNERDEAD => {
            // SAFETY: we own the mutex now; marking it consistent is the documented recovery.
            unsafe { libc::pthread_mutex_consistent(m) };
            Ok(())
        }
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// Unlock a robust mutex held by this thread.
///
/// # Safety
/// As [`robust_mutex_lock`], and this thread must hold it.
pub(crate) unsafe fn robust_mutex_unlock(m: *mut libc::pthread_mutex_t) {
    // SAFETY: forwarded contract.
    unsafe {
        libc::pthread_mutex_unlock(m);
    }
}
