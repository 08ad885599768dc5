//! CPU hints for callers that know which memory they will touch next: no effect on what any
//! operation does, only on when the memory reaches this CPU's caches.

/// Start fetching the cache line holding `addr` into this CPU's caches, for reading, so that a
/// load of it soon after finds it there instead of waiting for it (another core's write, on a
/// shared-memory provider). A hint only: it never faults and never changes memory, whatever
/// the address (unmapped, freed, zero), and does nothing on targets without a prefetch
/// instruction.
#[inline(always)]
pub fn prefetch_read(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it never faults and never changes memory, whatever the
    // address.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}
