//! Memory registration: access flags, keys, and the [`MemoryRegion`] handle (`ibv_mr`).
//!
//! A region is memory a provider may read or write on behalf of local work requests (named by
//! `lkey`) and of peers (named by `rkey`). Remote keys are random, not sequential, so a peer
//! cannot guess another region's key. Dropping (or [`MemoryRegion::deregister`]ing) the handle
//! invalidates both keys at once: a later access with the old rkey completes with
//! `RemoteAccess` and touches no memory.
//!
//! Memory comes either from the caller ([`crate::ProtectionDomain::reg_mr`], unsafe: the caller
//! keeps it alive) or from the provider ([`crate::ProtectionDomain::alloc_mr`]), which places it
//! where the provider moves bytes fastest (for `shm`: a shared memory segment peers map).

use std::sync::atomic::AtomicU64;

use crate::provider::MrOps;
use crate::{RemoteAddr, Result, Sge, VerbsError};

bitflags::bitflags! {
    /// Access rights of a memory region or QP (`IBV_ACCESS_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
    pub struct AccessFlags: u32 {
        /// The local provider may write the region (receives, READ results, atomic results).
        const LOCAL_WRITE = 1 << 0;
        /// Peers may RDMA WRITE into the region. Requires LOCAL_WRITE.
        const REMOTE_WRITE = 1 << 1;
        /// Peers may RDMA READ the region.
        const REMOTE_READ = 1 << 2;
        /// Peers may run atomics on the region. Requires LOCAL_WRITE.
        const REMOTE_ATOMIC = 1 << 3;
    }
}

impl AccessFlags {
    /// Every right.
    pub const ALL: AccessFlags = AccessFlags::all();

    /// Verbs rule: remote write or atomic access needs local write.
    pub fn validate(self) -> Result<()> {
        if self.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
            && !self.contains(AccessFlags::LOCAL_WRITE)
        {
            return Err(VerbsError::InvalidArgument(
                "REMOTE_WRITE and REMOTE_ATOMIC require LOCAL_WRITE".into(),
            ));
        }
        Ok(())
    }
}

/// Local key of a memory region: names it in local SGEs.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct Lkey(pub u32);

/// Remote key of a memory region: names it in a peer's one-sided operations.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct Rkey(pub u32);

/// The identity and bounds of a registered region, as the provider's MR table keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrInfo {
    /// Start virtual address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Local key.
    pub lkey: Lkey,
    /// Remote key.
    pub rkey: Rkey,
    /// Rights granted at registration.
    pub access: AccessFlags,
}

/// What backs a region's memory (see `provider::pages`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum PageKind {
    /// Base pages (4 KiB), or memory the caller brought.
    #[default]
    Base,
    /// Aligned to huge pages and advised `MADV_HUGEPAGE`, with transparent huge pages enabled
    /// on the system: the kernel backs it with huge pages where it can.
    Transparent,
    /// Huge pages from the kernel's explicit pool (`MAP_HUGETLB`), reserved at allocation.
    Explicit,
}

impl PageKind {
    /// True for either kind of huge page.
    pub fn is_huge(self) -> bool {
        self != PageKind::Base
    }
}

impl MrInfo {
    /// True when `[addr, addr+len)` lies inside the region (a zero-length access at any address
    /// inside or at the end of the region counts as inside).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        addr >= self.addr && end <= self.addr.saturating_add(self.len)
    }

    /// True when the range is inside the region *and* the region grants every right in `need`.
    pub fn permits(&self, addr: u64, len: u64, need: AccessFlags) -> bool {
        self.access.contains(need) && self.contains(addr, len)
    }
}

/// A registered memory region (`ibv_mr`). Not `Clone`: dropping it deregisters the region and
/// invalidates its keys at once. Share it behind an `Arc` if several owners need it.
pub struct MemoryRegion {
    pub(crate) ops: Box<dyn MrOps>,
    pub(crate) info: MrInfo,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.info.addr))
            .field("len", &self.info.len)
            .field("lkey", &self.info.lkey)
            .field("rkey", &self.info.rkey)
            .field("access", &self.info.access)
            .finish()
    }
}

impl MemoryRegion {
    /// Build the handle from a provider's region. For provider implementations.
    pub fn from_ops(ops: Box<dyn MrOps>) -> Self {
        let info = ops.info();
        MemoryRegion { ops, info }
    }

    /// Provider-side object, for downcasting inside a provider.
    pub fn ops(&self) -> &dyn MrOps {
        &*self.ops
    }

    /// Identity and bounds.
    pub fn info(&self) -> MrInfo {
        self.info
    }

    /// What backs the region: huge pages when the provider allocated it
    /// (`ProtectionDomain::alloc_mr`) and the system has them, base pages otherwise.
    pub fn pages(&self) -> PageKind {
        self.ops.pages()
    }
    /// Start virtual address.
    pub fn addr(&self) -> u64 {
        self.info.addr
    }
    /// Start as a pointer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.info.addr as usize as *mut u8
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.info.len as usize
    }
    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.info.len == 0
    }
    /// Local key.
    pub fn lkey(&self) -> Lkey {
        self.info.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> Rkey {
        self.info.rkey
    }
    /// Rights granted.
    pub fn access(&self) -> AccessFlags {
        self.info.access
    }

    /// An SGE for `len` bytes at `offset`; errors if it leaves the region.
    pub fn sge(&self, offset: usize, len: u32) -> Result<Sge> {
        self.check_range(offset, len as usize)?;
        Ok(Sge {
            addr: self.info.addr + offset as u64,
            length: len,
            lkey: self.info.lkey,
        })
    }

    /// The whole region as one SGE (regions above 4 GiB are clipped to `u32::MAX`).
    pub fn full_sge(&self) -> Sge {
        Sge {
            addr: self.info.addr,
            length: u32::try_from(self.info.len).unwrap_or(u32::MAX),
            lkey: self.info.lkey,
        }
    }

    /// What a peer needs to reach `offset` of this region.
    pub fn remote(&self, offset: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.info.addr + offset as u64,
            rkey: self.info.rkey,
        }
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end as u64 <= self.info.len => Ok(()),
            _ => Err(VerbsError::InvalidArgument(format!(
                "range {offset}+{len} outside region of {} bytes",
                self.info.len
            ))),
        }
    }

    /// Copy bytes out of the region. Peers may write the region concurrently (that is what RDMA
    /// is); synchronise through completions as with verbs.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        // SAFETY: the range was checked to lie inside the registered region, which stays mapped
        // while `self` lives (provider-owned memory, or caller memory under reg_mr's contract).
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    /// Copy bytes into the region.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        // SAFETY: as in `read_at`; the region is writable memory owned by this process.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.as_ptr().add(offset), src.len());
        }
        Ok(())
    }

    /// The 8-byte aligned word at `offset` as an atomic, to share it with peers' RDMA atomics.
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64> {
        self.check_range(offset, 8)?;
        let ptr = self.info.addr as usize + offset;
        if ptr % 8 != 0 {
            return Err(VerbsError::InvalidArgument(format!(
                "offset {offset} is not 8-byte aligned"
            )));
        }
        // SAFETY: in bounds and aligned (checked above); the memory lives as long as `self`, and
        // every access to it by providers is atomic or a plain copy, as with a NIC.
        Ok(unsafe { &*(ptr as *const AtomicU64) })
    }

    /// View the region as a byte slice.
    ///
    /// # Safety
    /// No peer or local work request may write the region while the slice is alive.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: in bounds by construction; the caller guarantees no concurrent writes.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }

    /// View the region as a mutable byte slice.
    ///
    /// # Safety
    /// No peer or local work request may access the region while the slice is alive, and no
    /// other slice of it may exist.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: in bounds by construction; the caller guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len()) }
    }

    /// Deregister now (same as dropping).
    pub fn deregister(self) {
        drop(self)
    }
}
