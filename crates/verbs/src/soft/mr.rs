//! The memory-region table of a software provider, and every access to registered memory.
//!
//! Owns: key allocation (random, never sequential, never 0), lookup by lkey and rkey, and the
//! only code of the software transports that reads or writes registered memory. Does not own:
//! the memory itself (caller memory under [`crate::ProtectionDomain::reg_mr`]'s contract, or an
//! [`AnonMemory`] mapping the region owns).
//!
//! # Unsafe
//! Memory is touched only while the table's read lock is held and only inside a range the table
//! has just checked against a live registration. Deregistration (drop of the [`SoftMr`]) takes
//! the write lock, so it waits for in-flight accesses and, once it returns, no access can start
//! with the old keys — which is what lets `reg_mr`'s caller free the memory right after
//! dropping the region. Peers and the application may access the same memory concurrently, as
//! with a NIC; completions order those accesses.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::provider::MrOps;
use crate::{AccessFlags, Lkey, MrInfo, PageKind, Result, Rkey, Sge, VerbsError, WcStatus};

/// Why a remote access was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteError {
    /// Unknown rkey, out of bounds, or missing right: `RemoteAccess`.
    Access,
    /// Misaligned atomic or otherwise invalid request: `RemoteInvalidRequest`.
    InvalidRequest,
}

/// An atomic operation on a remote word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// Compare-and-swap.
    CmpSwap {
        /// Expected.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// Fetch-and-add (wrapping).
    FetchAdd {
        /// Addend.
        add: u64,
    },
}

#[derive(Default)]
struct Tables {
    by_lkey: HashMap<u32, MrInfo>,
    by_rkey: HashMap<u32, MrInfo>,
}

/// The registered regions of one protection domain.
#[derive(Default)]
pub struct MrTable {
    tables: RwLock<Tables>,
}

impl std::fmt::Debug for MrTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MrTable")
            .field("regions", &self.tables.read().by_lkey.len())
            .finish()
    }
}

fn random_key(taken: &HashMap<u32, MrInfo>) -> u32 {
    loop {
        let k: u32 = rand::random();
        if k != 0 && !taken.contains_key(&k) {
            return k;
        }
    }
}

impl MrTable {
    /// An empty table.
    pub fn new() -> Arc<MrTable> {
        Arc::new(MrTable::default())
    }

    /// Number of live registrations.
    pub fn len(&self) -> usize {
        self.tables.read().by_lkey.len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Register `[addr, addr+len)` with random keys. The returned region deregisters on drop and
    /// keeps `backing` (if any) alive until then.
    ///
    /// # Safety
    /// The range must be valid, writable memory of this process that stays allocated until the
    /// returned [`SoftMr`] is dropped (the contract of [`crate::ProtectionDomain::reg_mr`]).
    pub unsafe fn register(
        self: &Arc<Self>,
        addr: u64,
        len: u64,
        access: AccessFlags,
        backing: Option<AnonMemory>,
    ) -> SoftMr {
        let mut t = self.tables.write();
        let lkey = random_key(&t.by_lkey);
        let rkey = random_key(&t.by_rkey);
        let info = MrInfo {
            addr,
            len,
            lkey: Lkey(lkey),
            rkey: Rkey(rkey),
            access,
        };
        t.by_lkey.insert(lkey, info);
        t.by_rkey.insert(rkey, info);
        SoftMr {
            info,
            table: self.clone(),
            _backing: backing,
        }
    }

    fn remove(&self, info: &MrInfo) {
        let mut t = self.tables.write();
        t.by_lkey.remove(&info.lkey.0);
        t.by_rkey.remove(&info.rkey.0);
    }

    /// The registration behind an lkey.
    pub fn by_lkey(&self, lkey: Lkey) -> Option<MrInfo> {
        self.tables.read().by_lkey.get(&lkey.0).copied()
    }

    /// The registration behind an rkey.
    pub fn by_rkey(&self, rkey: Rkey) -> Option<MrInfo> {
        self.tables.read().by_rkey.get(&rkey.0).copied()
    }

    fn check_local(t: &Tables, sges: &[Sge], need: AccessFlags) -> Result<u64, WcStatus> {
        let mut total = 0u64;
        for s in sges {
            let ok = t
                .by_lkey
                .get(&s.lkey.0)
                .is_some_and(|mr| mr.permits(s.addr, u64::from(s.length), need));
            if !ok {
                return Err(WcStatus::LocalProtection);
            }
            total += u64::from(s.length);
        }
        Ok(total)
    }

    /// Check that every SGE lies in a region of this table granting `need`; returns the total
    /// length. `Err(LocalProtection)` otherwise.
    pub fn validate_local(&self, sges: &[Sge], need: AccessFlags) -> Result<u64, WcStatus> {
        Self::check_local(&self.tables.read(), sges, need)
    }

    /// Append the bytes named by `sges` to `out`. Every SGE is checked first; on
    /// `LocalProtection` nothing is appended.
    pub fn gather(&self, sges: &[Sge], out: &mut Vec<u8>) -> Result<u64, WcStatus> {
        let t = self.tables.read();
        let total = Self::check_local(&t, sges, AccessFlags::empty())?;
        out.reserve(total as usize);
        for s in sges {
            // SAFETY: the SGE was just checked to lie inside a live registration; the read lock
            // keeps it registered (and its memory allocated) until this function returns.
            unsafe { append_raw(out, s.addr, s.length as usize) };
        }
        Ok(total)
    }

    /// Append the bytes of an INLINE request's `sges` to `out`. Verbs does not look at their
    /// lkeys, so they may name memory outside every registration: an SGE inside a region of
    /// this table is copied directly, any other is read through the kernel
    /// ([`read_own`](crate::provider::own_memory::read_own)), and one that names memory this
    /// process cannot read is `Err(LocalProtection)` rather than a fault.
    pub fn gather_inline(&self, sges: &[Sge], out: &mut Vec<u8>) -> Result<u64, WcStatus> {
        let t = self.tables.read();
        let mut total = 0u64;
        for s in sges {
            let len = u64::from(s.length);
            if len == 0 {
                continue;
            }
            let registered = t
                .by_lkey
                .get(&s.lkey.0)
                .is_some_and(|mr| mr.permits(s.addr, len, AccessFlags::empty()));
            if registered {
                // SAFETY: the SGE lies inside a live registration (checked just above); the read
                // lock keeps it registered (and its memory allocated) until this returns.
                unsafe { append_raw(out, s.addr, s.length as usize) };
            } else {
                crate::provider::own_memory::read_own(s.addr, s.length as usize, out)
                    .map_err(|_| WcStatus::LocalProtection)?;
            }
            total += len;
        }
        Ok(total)
    }

    /// Scatter `data` over `sges` in order. `LocalLength` if the SGEs hold fewer bytes than
    /// `data`; `LocalProtection` if one names memory this table does not grant LOCAL_WRITE on.
    /// On error no byte is written. Returns the bytes placed.
    pub fn scatter(&self, sges: &[Sge], data: &[u8]) -> Result<u32, WcStatus> {
        let t = self.tables.read();
        let room: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
        if room < data.len() as u64 {
            return Err(WcStatus::LocalLength);
        }
        let mut left = data;
        let mut need_check = Vec::new();
        for s in sges {
            if left.is_empty() {
                break;
            }
            let n = left.len().min(s.length as usize);
            need_check.push(Sge {
                addr: s.addr,
                length: n as u32,
                lkey: s.lkey,
            });
            left = &left[n..];
        }
        Self::check_local(&t, &need_check, AccessFlags::LOCAL_WRITE)?;
        let mut left = data;
        for s in &need_check {
            let (head, tail) = left.split_at(s.length as usize);
            // SAFETY: checked above against a live LOCAL_WRITE registration, under the read lock.
            unsafe { write_raw(s.addr, head) };
            left = tail;
        }
        u32::try_from(data.len()).map_err(|_| WcStatus::LocalLength)
    }

    fn check_remote(
        t: &Tables,
        rkey: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<(), RemoteError> {
        match t.by_rkey.get(&rkey) {
            Some(mr) if mr.permits(addr, len, need) => Ok(()),
            _ => Err(RemoteError::Access),
        }
    }

    /// Execute a peer's RDMA WRITE. Memory is untouched on error.
    pub fn remote_write(&self, rkey: u32, addr: u64, data: &[u8]) -> Result<(), RemoteError> {
        let t = self.tables.read();
        Self::check_remote(&t, rkey, addr, data.len() as u64, AccessFlags::REMOTE_WRITE)?;
        // SAFETY: range checked against a live REMOTE_WRITE registration, under the read lock.
        unsafe { write_raw(addr, data) };
        Ok(())
    }

    /// Execute a peer's RDMA READ, appending the bytes to `out`.
    pub fn remote_read(
        &self,
        rkey: u32,
        addr: u64,
        len: u32,
        out: &mut Vec<u8>,
    ) -> Result<(), RemoteError> {
        let t = self.tables.read();
        Self::check_remote(&t, rkey, addr, u64::from(len), AccessFlags::REMOTE_READ)?;
        // SAFETY: range checked against a live REMOTE_READ registration, under the read lock.
        unsafe { append_raw(out, addr, len as usize) };
        Ok(())
    }

    /// Execute a peer's atomic on the 8-byte aligned word at `addr`; returns the original value.
    pub fn remote_atomic(&self, rkey: u32, addr: u64, op: AtomicOp) -> Result<u64, RemoteError> {
        if addr % 8 != 0 {
            return Err(RemoteError::InvalidRequest);
        }
        let t = self.tables.read();
        Self::check_remote(&t, rkey, addr, 8, AccessFlags::REMOTE_ATOMIC)?;
        // SAFETY: an 8-byte aligned word inside a live registration (checked above, under the
        // read lock); every access by this provider to it is atomic.
        let word = unsafe { &*(addr as usize as *const AtomicU64) };
        Ok(match op {
            AtomicOp::CmpSwap { compare, swap } => {
                match word.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(v) | Err(v) => v,
                }
            }
            AtomicOp::FetchAdd { add } => word.fetch_add(add, Ordering::SeqCst),
        })
    }
}

/// The key a range of registered memory is named by, which decides the rights check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKey {
    /// A local key (the QP's own buffers: receives, READ results).
    Local(Lkey),
    /// A remote key (a peer's WRITE).
    Remote(Rkey),
}

/// A range of registered memory that data arriving in pieces is placed into; every access
/// re-checks it against the live registrations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dest {
    /// The key naming the range.
    pub key: MemKey,
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Rights the registration must grant.
    pub need: AccessFlags,
}

impl Dest {
    /// The first `len` bytes of a local scatter list as destinations needing LOCAL_WRITE;
    /// `None` when the list holds fewer than `len` bytes.
    pub fn local_scatter(sges: &[Sge], len: u64) -> Option<Vec<Dest>> {
        let mut dests = Vec::with_capacity(sges.len());
        let mut left = len;
        for s in sges {
            if left == 0 {
                break;
            }
            let n = left.min(u64::from(s.length));
            dests.push(Dest {
                key: MemKey::Local(s.lkey),
                addr: s.addr,
                len: n,
                need: AccessFlags::LOCAL_WRITE,
            });
            left -= n;
        }
        (left == 0).then_some(dests)
    }
}

impl MrTable {
    fn dest_ok(t: &Tables, key: MemKey, addr: u64, len: u64, need: AccessFlags) -> bool {
        let mr = match key {
            MemKey::Local(k) => t.by_lkey.get(&k.0),
            MemKey::Remote(k) => t.by_rkey.get(&k.0),
        };
        mr.is_some_and(|mr| mr.permits(addr, len, need))
    }

    /// True when every destination lies in a live registration granting its rights.
    pub fn check_dests(&self, dests: &[Dest]) -> bool {
        let t = self.tables.read();
        dests
            .iter()
            .all(|d| Self::dest_ok(&t, d.key, d.addr, d.len, d.need))
    }

    /// Copy `data` to `[addr, addr + data.len())`, which must lie in a live registration
    /// named by `key` granting `need`. False (nothing written) otherwise.
    pub fn put(&self, key: MemKey, addr: u64, data: &[u8], need: AccessFlags) -> bool {
        let t = self.tables.read();
        if !Self::dest_ok(&t, key, addr, data.len() as u64, need) {
            return false;
        }
        // SAFETY: the range was just checked against a live registration granting `need`,
        // under the read lock, which is held until the copy is done.
        unsafe { write_raw(addr, data) };
        true
    }

    /// Receive up to `len` bytes from the stream socket `fd` straight into registered memory
    /// at `addr` (one `recv`, non-blocking). `None` when the range does not lie in a live
    /// registration named by `key` granting `need` (nothing is read then).
    pub fn recv_into(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        key: MemKey,
        addr: u64,
        len: usize,
        need: AccessFlags,
    ) -> Option<std::io::Result<usize>> {
        use std::os::fd::AsRawFd;
        let t = self.tables.read();
        if !Self::dest_ok(&t, key, addr, len as u64, need) {
            return None;
        }
        // SAFETY: `[addr, addr + len)` was just checked to lie in a live registration granting
        // `need` (LOCAL_WRITE or REMOTE_WRITE); the read lock keeps it registered, and so
        // allocated, until the kernel has copied into it and `recv` returned. The memory is
        // only written through this raw pointer (no Rust reference to it is formed), as a NIC
        // writes it.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                addr as usize as *mut libc::c_void,
                len,
                libc::MSG_DONTWAIT,
            )
        };
        Some(if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        })
    }

    /// Hold the read lock to send from registered memory: while the returned view lives, a
    /// range it [`LocalView::permits`] stays registered and allocated.
    pub fn local_view(&self) -> LocalView<'_> {
        LocalView {
            t: self.tables.read(),
        }
    }
}

/// The table's registrations, held still (see [`MrTable::local_view`]).
pub struct LocalView<'a> {
    t: parking_lot::RwLockReadGuard<'a, Tables>,
}

impl LocalView<'_> {
    /// True when the range lies in a live registration of its key granting its rights.
    pub fn permits(&self, d: &Dest) -> bool {
        MrTable::dest_ok(&self.t, d.key, d.addr, d.len, d.need)
    }
}

/// Append `len` bytes at `addr` to `out`.
///
/// # Safety
/// `[addr, addr+len)` must be readable memory of this process for the duration of the call.
pub unsafe fn append_raw(out: &mut Vec<u8>, addr: u64, len: usize) {
    out.reserve(len);
    let old = out.len();
    // SAFETY: `reserve` made room for `len` more bytes; the caller guarantees the source is
    // readable; the regions cannot overlap (`out` owns its buffer).
    unsafe {
        std::ptr::copy_nonoverlapping(addr as usize as *const u8, out.as_mut_ptr().add(old), len);
        out.set_len(old + len);
    }
}

/// Copy `data` to `addr`.
///
/// # Safety
/// `[addr, addr+data.len())` must be writable memory of this process for the duration of the
/// call.
unsafe fn write_raw(addr: u64, data: &[u8]) {
    // SAFETY: forwarded contract; `data` is a Rust slice and cannot alias registered memory
    // that we are writing through a raw pointer in a way the compiler relies on.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as usize as *mut u8, data.len()) }
}

/// Zeroed, page-aligned anonymous memory owned by a region (`alloc_mr`): on huge pages when
/// its length is a multiple of one and the system has them (`provider::pages`).
pub struct AnonMemory {
    ptr: *mut u8,
    len: usize,
    pages: PageKind,
}

// SAFETY: the mapping is plain process memory owned by this value; it is accessed through raw
// pointers under the MR table's rules from any thread, and unmapped once, in Drop.
unsafe impl Send for AnonMemory {}
// SAFETY: as above; `&AnonMemory` only exposes the address.
unsafe impl Sync for AnonMemory {}

impl AnonMemory {
    /// Map `len` zeroed bytes.
    pub fn new(len: usize) -> Result<AnonMemory> {
        if len == 0 {
            return Err(VerbsError::InvalidArgument("zero-length mapping".into()));
        }
        let (ptr, pages) = crate::provider::pages::map(len)
            .map_err(|e| VerbsError::io(format!("mmap {len} bytes"), e))?;
        Ok(AnonMemory { ptr, len, pages })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ptr as usize as u64
    }

    /// Length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (zero-length mappings are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What backs the mapping.
    pub fn pages(&self) -> PageKind {
        self.pages
    }
}

impl Drop for AnonMemory {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping created in `new`, unmapped only here; the
        // owning region was removed from its table first, so no access is in flight.
        unsafe { crate::provider::pages::unmap(self.ptr, self.len) };
    }
}

/// A registered region of a software provider. Dropping it deregisters at once.
pub struct SoftMr {
    info: MrInfo,
    table: Arc<MrTable>,
    // Dropped after `Drop::drop` removed the keys (fields drop after the body).
    _backing: Option<AnonMemory>,
}

impl SoftMr {
    /// Allocate zeroed page-aligned memory and register it in `table`.
    pub fn alloc(table: &Arc<MrTable>, len: usize, access: AccessFlags) -> Result<SoftMr> {
        let mem = AnonMemory::new(len)?;
        let (addr, len) = (mem.addr(), mem.len() as u64);
        // SAFETY: the mapping is valid, writable, and owned by the region, which drops it only
        // after deregistering.
        Ok(unsafe { table.register(addr, len, access, Some(mem)) })
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        self.table.remove(&self.info);
    }
}

impl MrOps for SoftMr {
    fn info(&self) -> MrInfo {
        self.info
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn pages(&self) -> PageKind {
        self._backing
            .as_ref()
            .map_or(PageKind::Base, AnonMemory::pages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table_with(len: usize, access: AccessFlags) -> (Arc<MrTable>, SoftMr) {
        let t = MrTable::new();
        let mr = SoftMr::alloc(&t, len, access).unwrap();
        (t, mr)
    }

    #[test]
    fn alloc_is_zeroed_page_aligned_with_random_distinct_keys() {
        let t = MrTable::new();
        let a = SoftMr::alloc(&t, 100, AccessFlags::ALL).unwrap();
        let b = SoftMr::alloc(&t, 100, AccessFlags::ALL).unwrap();
        assert_eq!(a.info.addr % 4096, 0);
        let mut out = Vec::new();
        t.gather(
            &[Sge {
                addr: a.info.addr,
                length: 100,
                lkey: a.info.lkey,
            }],
            &mut out,
        )
        .unwrap();
        assert_eq!(out, vec![0u8; 100]);
        assert_ne!(a.info.lkey, b.info.lkey);
        assert_ne!(a.info.rkey, b.info.rkey);
        // Keys are not consecutive (a sequential allocator would give k, k+1).
        let keys: Vec<u32> = (0..8)
            .map(|_| SoftMr::alloc(&t, 8, AccessFlags::ALL).unwrap().info.rkey.0)
            .collect();
        assert!(keys.windows(2).any(|w| w[1].wrapping_sub(w[0]) != 1));
    }

    #[test]
    fn drop_deregisters_at_once() {
        let (t, mr) = table_with(64, AccessFlags::ALL);
        let info = mr.info;
        assert!(t.by_rkey(info.rkey).is_some());
        drop(mr);
        assert!(t.by_rkey(info.rkey).is_none());
        assert!(t.by_lkey(info.lkey).is_none());
        assert_eq!(
            t.remote_write(info.rkey.0, info.addr, b"x"),
            Err(RemoteError::Access)
        );
    }

    #[test]
    fn remote_write_checks_rkey_bounds_and_rights() {
        let (t, mr) = table_with(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ);
        let i = mr.info;
        assert_eq!(
            t.remote_write(i.rkey.0, i.addr, b"abc"),
            Err(RemoteError::Access)
        );
        let (t, mr) = table_with(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        let i = mr.info;
        assert_eq!(
            t.remote_write(i.rkey.0, i.addr + 62, b"abc"),
            Err(RemoteError::Access)
        );
        assert_eq!(
            t.remote_write(i.rkey.0 ^ 1, i.addr, b"abc"),
            Err(RemoteError::Access)
        );
        let mut out = Vec::new();
        t.gather(
            &[Sge {
                addr: i.addr,
                length: 64,
                lkey: i.lkey,
            }],
            &mut out,
        )
        .unwrap();
        assert!(out.iter().all(|&b| b == 0), "memory touched on error");
        t.remote_write(i.rkey.0, i.addr + 61, b"abc").unwrap();
        assert_eq!(
            t.remote_read(i.rkey.0, i.addr, 4, &mut out),
            Err(RemoteError::Access)
        );
    }

    #[test]
    fn atomics_need_alignment_and_right() {
        let (t, mr) = table_with(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC);
        let i = mr.info;
        let add = AtomicOp::FetchAdd { add: 5 };
        assert_eq!(
            t.remote_atomic(i.rkey.0, i.addr + 4, add),
            Err(RemoteError::InvalidRequest)
        );
        assert_eq!(t.remote_atomic(i.rkey.0, i.addr + 8, add), Ok(0));
        assert_eq!(t.remote_atomic(i.rkey.0, i.addr + 8, add), Ok(5));
        let cas = AtomicOp::CmpSwap {
            compare: 10,
            swap: 1,
        };
        assert_eq!(t.remote_atomic(i.rkey.0, i.addr + 8, cas), Ok(10));
        assert_eq!(t.remote_atomic(i.rkey.0, i.addr + 8, cas), Ok(1));
        assert_eq!(
            t.remote_atomic(i.rkey.0, i.addr + 64, add),
            Err(RemoteError::Access)
        );
        let (t2, mr2) = table_with(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        assert_eq!(
            t2.remote_atomic(mr2.info.rkey.0, mr2.info.addr, add),
            Err(RemoteError::Access)
        );
    }

    #[test]
    fn scatter_reports_length_and_protection_errors_without_writing() {
        let (t, mr) = table_with(64, AccessFlags::LOCAL_WRITE);
        let i = mr.info;
        let s = |off: u64, len: u32| Sge {
            addr: i.addr + off,
            length: len,
            lkey: i.lkey,
        };
        assert_eq!(
            t.scatter(&[s(0, 2), s(8, 2)], b"hello"),
            Err(WcStatus::LocalLength)
        );
        let bad = Sge {
            lkey: Lkey(i.lkey.0 ^ 0x55),
            ..s(8, 8)
        };
        assert_eq!(
            t.scatter(&[s(0, 2), bad], b"hello"),
            Err(WcStatus::LocalProtection)
        );
        let mut out = Vec::new();
        t.gather(&[s(0, 16)], &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 0));
        assert_eq!(t.scatter(&[s(0, 2), s(8, 8)], b"hello"), Ok(5));
        out.clear();
        t.gather(&[s(0, 2), s(8, 3)], &mut out).unwrap();
        assert_eq!(out, b"hello");
        let (t2, ro) = table_with(64, AccessFlags::REMOTE_READ);
        assert_eq!(
            t2.scatter(&[ro.info.full()], b"x"),
            Err(WcStatus::LocalProtection)
        );
    }

    impl MrInfo {
        fn full(&self) -> Sge {
            Sge {
                addr: self.addr,
                length: self.len as u32,
                lkey: self.lkey,
            }
        }
    }
}
