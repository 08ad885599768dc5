//! Memory the providers allocate for regions themselves (`ProtectionDomain::alloc_mr`): on huge
//! pages when the system has them, on base pages otherwise.
//!
//! A region whose length is a multiple of [`HUGE_PAGE`] is mapped, in this order of preference:
//! 1. from the kernel's explicit huge-page pool (`MAP_HUGETLB`), when the administrator reserved
//!    pages (`vm.nr_hugepages`) and enough are free — the mapping is refused at once otherwise,
//!    so nothing is committed that could fault later;
//! 2. on base pages aligned to [`HUGE_PAGE`] and advised `MADV_HUGEPAGE`, so that transparent
//!    huge pages back it where they are enabled (`always` or `madvise`);
//! 3. on base pages.
//!
//! Shorter regions take base pages. `FABRIQ_HUGE_PAGES` chooses: `auto` (default, the order
//! above), `transparent` (never the explicit pool, which may be reserved for another program),
//! `off`. A device reads it once.
//!
//! Huge pages matter to a NIC (fewer translation entries, fewer IOTLB misses) and to software
//! providers (fewer TLB misses when payloads are copied); a mempool slab is exactly one.

use std::sync::OnceLock;

use rustix::mm::{madvise, mmap_anonymous, munmap, Advice, MapFlags, ProtFlags};

use crate::mr::PageKind;

/// The huge-page size the providers ask for (x86-64 and arm64 with 4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// What `FABRIQ_HUGE_PAGES` allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HugePolicy {
    /// Explicit pool first, then transparent huge pages.
    Auto,
    /// Transparent huge pages only.
    Transparent,
    /// Base pages only.
    Off,
}

impl HugePolicy {
    /// Parse a `FABRIQ_HUGE_PAGES` value; `None` for anything else.
    pub fn parse(s: &str) -> Option<HugePolicy> {
        match s.trim() {
            "" | "auto" | "on" | "1" => Some(HugePolicy::Auto),
            "transparent" | "thp" => Some(HugePolicy::Transparent),
            "off" | "0" | "no" => Some(HugePolicy::Off),
            _ => None,
        }
    }

    /// The process's policy (`FABRIQ_HUGE_PAGES`, read once; an unknown value is `Auto` with a
    /// warning).
    pub fn current() -> HugePolicy {
        static POLICY: OnceLock<HugePolicy> = OnceLock::new();
        *POLICY.get_or_init(|| match std::env::var("FABRIQ_HUGE_PAGES") {
            Err(_) => HugePolicy::Auto,
            Ok(v) => HugePolicy::parse(&v).unwrap_or_else(|| {
                tracing::warn!(value = %v, "FABRIQ_HUGE_PAGES: expected auto, transparent or off");
                HugePolicy::Auto
            }),
        })
    }
}

/// The bracketed word of a sysfs THP setting (`always [madvise] never` → `madvise`).
fn selected(setting: &str) -> Option<&str> {
    let start = setting.find('[')? + 1;
    let end = start + setting.get(start..)?.find(']')?;
    setting.get(start..end)
}

/// True when transparent huge pages back anonymous memory advised `MADV_HUGEPAGE`.
pub fn transparent_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .ok()
            .and_then(|s| selected(&s).map(|w| w == "always" || w == "madvise"))
            .unwrap_or(false)
    })
}

/// True when transparent huge pages back shared memory (memfd, tmpfs) advised
/// `MADV_HUGEPAGE`.
pub fn shmem_transparent_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
            .ok()
            .and_then(|s| {
                selected(&s).map(|w| matches!(w, "always" | "within_size" | "advise" | "force"))
            })
            .unwrap_or(false)
    })
}

/// A private anonymous mapping of `len` zeroed bytes, on huge pages where the policy and the
/// system allow (module comment). Returns the start and what backs it; release it with
/// [`unmap`] and the same `len`.
pub(crate) fn map(len: usize) -> std::io::Result<(*mut u8, PageKind)> {
    map_with(len, HugePolicy::current())
}

pub(crate) fn map_with(len: usize, policy: HugePolicy) -> std::io::Result<(*mut u8, PageKind)> {
    let rw = ProtFlags::READ | ProtFlags::WRITE;
    let huge_len = len >= HUGE_PAGE && len % HUGE_PAGE == 0;
    if huge_len && policy == HugePolicy::Auto {
        let flags = MapFlags::PRIVATE | MapFlags::HUGETLB;
        // SAFETY: a fresh private anonymous mapping at an address the kernel chooses aliases no
        // existing memory. Refused (ENOMEM) unless the pool has the pages: they are reserved now.
        let explicit = unsafe { mmap_anonymous(std::ptr::null_mut(), len, rw, flags) };
        if let Ok(p) = explicit {
            return Ok((p.cast(), PageKind::Explicit));
        }
    }
    if !huge_len || policy == HugePolicy::Off {
        // SAFETY: as above.
        let p = unsafe { mmap_anonymous(std::ptr::null_mut(), len, rw, MapFlags::PRIVATE) }?;
        return Ok((p.cast(), PageKind::Base));
    }
    // Base pages aligned to a huge page: map one huge page more, trim both ends.
    let over = len + HUGE_PAGE;
    // SAFETY: as above.
    let raw = unsafe { mmap_anonymous(std::ptr::null_mut(), over, rw, MapFlags::PRIVATE) }?;
    let start = raw as usize;
    let aligned = start.next_multiple_of(HUGE_PAGE);
    let head = aligned - start;
    let tail = over - head - len;
    // SAFETY: both ranges lie inside the mapping made above and outside `[aligned, aligned +
    // len)`, which is what this function hands out; nothing refers to them.
    unsafe {
        if head > 0 {
            munmap(raw, head)?;
        }
        if tail > 0 {
            munmap((aligned + len) as *mut std::ffi::c_void, tail)?;
        }
    }
    let p = aligned as *mut std::ffi::c_void;
    // SAFETY: advice on a range this function owns; it changes how pages are backed, never
    // their contents.
    let advised = unsafe { madvise(p, len, Advice::LinuxHugepage) }.is_ok();
    let kind = if advised && transparent_enabled() {
        PageKind::Transparent
    } else {
        PageKind::Base
    };
    Ok((p.cast(), kind))
}

/// Release a mapping from [`map`].
///
/// # Safety
/// `ptr` and `len` must be a mapping [`map`] returned, not used after this call.
pub(crate) unsafe fn unmap(ptr: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    let _ = unsafe { munmap(ptr.cast(), len) };
}

/// Advise `MADV_HUGEPAGE` on part of a shared mapping (the shm provider's segment heap);
/// true when the system will back it with huge pages. Alignment is the caller's.
pub(crate) fn advise_shared(ptr: *mut u8, len: usize) -> bool {
    if HugePolicy::current() == HugePolicy::Off || len == 0 {
        return false;
    }
    // SAFETY: advice only; it changes how the pages are backed, never their contents.
    let advised = unsafe { madvise(ptr.cast(), len, Advice::LinuxHugepage) }.is_ok();
    advised && shmem_transparent_enabled()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_settings_parse() {
        assert_eq!(selected("always [madvise] never\n"), Some("madvise"));
        assert_eq!(selected("[always] madvise never"), Some("always"));
        assert_eq!(
            selected("always within_size advise [never] deny force"),
            Some("never")
        );
        assert_eq!(selected("no brackets"), None);
        assert_eq!(selected("[unclosed"), None);
    }

    #[test]
    fn policies_parse() {
        assert_eq!(HugePolicy::parse("auto"), Some(HugePolicy::Auto));
        assert_eq!(HugePolicy::parse(" off "), Some(HugePolicy::Off));
        assert_eq!(
            HugePolicy::parse("transparent"),
            Some(HugePolicy::Transparent)
        );
        assert_eq!(HugePolicy::parse("sometimes"), None);
    }

    fn check(len: usize, policy: HugePolicy) -> PageKind {
        let (p, kind) = map_with(len, policy).expect("map");
        assert!(!p.is_null());
        if kind != PageKind::Base {
            assert_eq!(
                p as usize % HUGE_PAGE,
                0,
                "{kind:?} mapping not huge-page aligned"
            );
        }
        // The memory is there, zeroed and writable end to end.
        // SAFETY: `p` maps `len` bytes this test owns.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p, len) };
        assert!(bytes.iter().step_by(4096).all(|&b| b == 0));
        bytes[0] = 1;
        bytes[len - 1] = 2;
        // SAFETY: mapped above with `len`, not used after.
        unsafe { unmap(p, len) };
        kind
    }

    #[test]
    fn short_or_odd_regions_take_base_pages() {
        assert_eq!(check(4096, HugePolicy::Auto), PageKind::Base);
        assert_eq!(check(HUGE_PAGE + 4096, HugePolicy::Auto), PageKind::Base);
        assert_eq!(check(HUGE_PAGE, HugePolicy::Off), PageKind::Base);
    }

    #[test]
    fn huge_page_multiples_take_transparent_pages_where_enabled() {
        let want = if transparent_enabled() {
            PageKind::Transparent
        } else {
            PageKind::Base
        };
        assert_eq!(check(2 * HUGE_PAGE, HugePolicy::Transparent), want);
        // Auto takes the explicit pool when it has pages (another test may hold them).
        let auto = check(2 * HUGE_PAGE, HugePolicy::Auto);
        assert!(auto == PageKind::Explicit || auto == want, "{auto:?}");
    }
}
