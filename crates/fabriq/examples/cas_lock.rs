//! A distributed lock by remote compare-and-swap.
//!
//! One endpoint owns a small exposed region holding a lock word (offset 0) and a counter
//! (offset 8). Several contenders, each with its own endpoint and channel, take the lock with
//! RDMA compare-and-swap, increment the counter with a plain RDMA read + write while holding it,
//! and release. The owner runs no code per acquisition. The final counter equals the number of
//! acquisitions only if the lock excluded.
//!
//! Run: `cargo run --release -p fabriq --example cas_lock [contenders] [acquisitions]`
//! (device from `FABRIQ_DEVICE`, default auto).

use std::time::{Duration, Instant};

use fabriq::{CasLock, Config, Endpoint, RegionDescriptor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let contenders: u64 = args.next().map_or(Ok(2), |a| a.parse())?;
    let acquisitions: u64 = args.next().map_or(Ok(10_000), |a| a.parse())?;
    let config = Config::from_env()?;

    let owner = Endpoint::new(config.clone())?;
    let region = owner.expose(64)?;
    let listener = owner.listen("127.0.0.1:0")?;
    let addr = listener.local_addr();
    println!(
        "owner on {} ({}), {contenders} contenders × {acquisitions}",
        addr,
        owner.device()
    );

    let start = Instant::now();
    let threads: Vec<_> = (1..=contenders)
        .map(|id| {
            let config = config.clone();
            std::thread::spawn(move || -> Result<(), fabriq::ChannelError> {
                let ep = Endpoint::new(config)?;
                let ch = ep.connect(addr)?;
                let desc = RegionDescriptor::from_bytes(&ch.recv_timeout(Duration::from_secs(10))?)
                    .ok_or(fabriq::ChannelError::Closed)?;
                let lock = CasLock::new(ch.remote_region(desc), 0, id)?;
                for _ in 0..acquisitions {
                    lock.lock()?;
                    let r = lock.region();
                    let mut word = [0u8; 8];
                    word.copy_from_slice(&r.read(8, 8)?);
                    r.write(8, &(u64::from_le_bytes(word) + 1).to_le_bytes())?;
                    lock.unlock()?;
                }
                Ok(())
            })
        })
        .collect();
    let mut channels = Vec::new();
    for _ in 0..contenders {
        let ch = listener.accept_timeout(Duration::from_secs(10))?;
        ch.send(&region.descriptor().to_bytes())?;
        channels.push(ch);
    }
    for t in threads {
        t.join().map_err(|_| "contender panicked")??;
    }
    let counter = region
        .atomic_u64(8)?
        .load(std::sync::atomic::Ordering::SeqCst);
    let total = contenders * acquisitions;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "counter = {counter} (expected {total}); {:.0} acquisitions/s",
        total as f64 / secs
    );
    if counter != total {
        return Err("mutual exclusion violated".into());
    }
    Ok(())
}
