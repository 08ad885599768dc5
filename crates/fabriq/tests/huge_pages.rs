//! Pool slabs land on huge pages when the system has them.
//!
//! As root the test reserves a few pages in the kernel's explicit pool (`vm.nr_hugepages`,
//! restored afterwards) and checks that slabs of a `MemPool` on `tcp0` come from it — the
//! pool's counter, the region's `PageKind`, and the kernel's own `HugePages_Free` all agree —
//! and that the memory works. Without root (or where the kernel cannot reserve the pages) it
//! prints SKIP for that part; the transparent-huge-page and base-page cases are checked
//! everywhere. One test in its own binary: nothing else in this process takes huge pages.

use fabriq::{MemPool, PoolConfig};
use fabriq_verbs::{Context, PageKind};

const NR: &str = "/proc/sys/vm/nr_hugepages";

fn meminfo(key: &str) -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
}

fn thp_enabled() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| s.contains("[always]") || s.contains("[madvise]"))
        .unwrap_or(false)
}

/// Restores `vm.nr_hugepages` on drop.
struct Reservation(String);

impl Drop for Reservation {
    fn drop(&mut self) {
        let _ = std::fs::write(NR, &self.0);
    }
}

/// Reserve `n` more explicit huge pages; `None` (with the reason) where that is not possible.
fn reserve(n: u64) -> Result<Reservation, String> {
    let before = std::fs::read_to_string(NR).map_err(|e| format!("read {NR}: {e}"))?;
    let cur: u64 = before.trim().parse().map_err(|e| format!("{NR}: {e}"))?;
    let free_before = meminfo("HugePages_Free:").unwrap_or(0);
    std::fs::write(NR, format!("{}", cur + n)).map_err(|e| format!("write {NR}: {e}"))?;
    let guard = Reservation(before);
    let free = meminfo("HugePages_Free:").unwrap_or(0);
    if free < free_before + n {
        return Err(format!(
            "the kernel reserved only {} of {n} huge pages (memory fragmented)",
            free.saturating_sub(free_before)
        ));
    }
    Ok(guard)
}

fn pool(ctx: &Context) -> (fabriq_verbs::ProtectionDomain, MemPool) {
    let pd = ctx.alloc_pd().expect("pd");
    let pool = MemPool::new(&pd, PoolConfig::default()).expect("pool");
    (pd, pool)
}

#[test]
fn pool_slabs_take_huge_pages_where_the_system_has_them() {
    let ctx = Context::open("tcp0").expect("tcp0");
    let slab = PoolConfig::default().slab_size as u64;
    assert_eq!(slab, 2 << 20, "a slab is one huge page");

    // 1. The explicit pool, as root.
    match reserve(8) {
        Err(why) => println!("SKIP explicit huge pages: {why}"),
        Ok(_reservation) => {
            let free0 = meminfo("HugePages_Free:").expect("HugePages_Free");
            let (_pd, mut pool) = pool(&ctx);
            // 40 buffers of the largest class (64 KiB): two slabs.
            let mut bufs: Vec<_> = (0..40)
                .map(|_| pool.alloc(64 << 10).expect("alloc"))
                .collect();
            for (i, b) in bufs.iter_mut().enumerate() {
                b.fill(i as u8 + 1);
            }
            for (i, b) in bufs.iter().enumerate() {
                assert!(b.iter().all(|&x| x == i as u8 + 1), "buffer {i}");
            }
            let st = pool.stats();
            assert!(st.slabs >= 2, "{st:?}");
            assert_eq!(st.huge_page_bytes, st.slabs * slab, "{st:?}");
            let free1 = meminfo("HugePages_Free:").expect("HugePages_Free");
            assert_eq!(free0 - free1, st.slabs, "slabs come from the explicit pool");
            // A region of its own (large buffer) of a huge-page multiple, too.
            let pd = ctx.alloc_pd().expect("pd");
            let mr = pd
                .alloc_mr(4 << 20, fabriq_verbs::AccessFlags::LOCAL_WRITE)
                .expect("alloc_mr");
            assert_eq!(mr.pages(), PageKind::Explicit);
            assert_eq!(mr.addr() % (2 << 20), 0);
            drop((bufs, pool, mr));
            assert_eq!(meminfo("HugePages_Free:"), Some(free0), "pages go back");
        }
    }

    // 2. Without free explicit pages: transparent huge pages where enabled, else base pages.
    if meminfo("HugePages_Free:").unwrap_or(0) == 0 {
        let (_pd, mut pool) = pool(&ctx);
        let b = pool.alloc(4096).expect("alloc");
        let st = pool.stats();
        let want = if thp_enabled() { st.slabs * slab } else { 0 };
        assert_eq!(st.huge_page_bytes, want, "{st:?}");
        drop(b);
    } else {
        println!("SKIP transparent huge pages: the explicit pool has free pages");
    }

    // 3. Regions that are not huge-page multiples take base pages.
    let pd = ctx.alloc_pd().expect("pd");
    let mr = pd
        .alloc_mr((2 << 20) + 4096, fabriq_verbs::AccessFlags::LOCAL_WRITE)
        .expect("alloc_mr");
    assert_eq!(mr.pages(), PageKind::Base);
}
