//! `--api async`: the client's latency loops through the middleware's async API, awaited on a
//! current-thread tokio runtime — what a tokio application's task pays, beside the blocking
//! calls of the same run's `--api sync`. The exchanges and their checks are those of the
//! blocking loops; every await is bounded by [`STALL`].

use std::future::Future;
use std::time::Instant;

use fabriq::{Channel, RemoteRegion, Rpc};

use super::{chan_err, payload, rpc_err, ClientPlan, Latencies, ECHO};
use crate::cmd::perf::error::{PerfError, Result};
use crate::cmd::perf::report::{LatencyKind, RunResult};
use crate::cmd::perf::{TestKind, STALL};

/// One run of `plan.test` at `size`.
pub(super) fn run(
    plan: &ClientPlan,
    ch: &Channel,
    rpc: &Rpc,
    region: Option<&RemoteRegion>,
    size: u32,
) -> Result<RunResult> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| PerfError::Unsupported(format!("a tokio runtime: {e}")))?;
    let (iters, warmup) = (plan.iters, plan.warmup);
    rt.block_on(async {
        match (plan.test, region) {
            (TestKind::SendLat, _) => send_lat(ch, size, iters, warmup).await,
            (TestKind::RpcLat, _) => rpc_lat(rpc, size, iters, warmup).await,
            (TestKind::ReadLat, Some(r)) => read_lat(r, size, iters, warmup).await,
            (TestKind::AtomicLat, Some(r)) => atomic_lat(r, iters, warmup).await,
            (other, _) => Err(PerfError::Unsupported(format!(
                "{} has no async form (--api async: send_lat, rpc_lat, read_lat, atomic_lat)",
                other.name()
            ))),
        }
    })
}

/// `fut`, or a stall error after [`STALL`].
async fn bounded<T>(what: &'static str, fut: impl Future<Output = T>) -> Result<T> {
    tokio::time::timeout(STALL, fut)
        .await
        .map_err(|_| PerfError::Protocol(format!("{what}: nothing for {STALL:?}")))
}

async fn send_lat(ch: &Channel, size: u32, iters: u64, warmup: u64) -> Result<RunResult> {
    let buf = payload(size);
    let mut lat = Latencies::new(warmup)?;
    for i in 0..warmup + iters {
        let t0 = Instant::now();
        bounded("send_lat: send a ping", ch.send_async(&buf))
            .await?
            .map_err(chan_err("send_lat: send a ping"))?;
        let m = bounded("send_lat: wait for the pong", ch.recv_async())
            .await?
            .map_err(chan_err("send_lat: wait for the pong"))?;
        lat.add(i, t0.elapsed(), m[..] == buf[..]);
    }
    Ok(lat.finish(size, LatencyKind::OneWay))
}

async fn rpc_lat(rpc: &Rpc, size: u32, iters: u64, warmup: u64) -> Result<RunResult> {
    let buf = payload(size);
    let mut lat = Latencies::new(warmup)?;
    for i in 0..warmup + iters {
        let t0 = Instant::now();
        let reply = rpc
            .call_async(ECHO, &buf, STALL)
            .await
            .map_err(rpc_err("rpc_lat: call echo"))?;
        lat.add(i, t0.elapsed(), reply == buf);
    }
    Ok(lat.finish(size, LatencyKind::RoundTrip))
}

async fn read_lat(region: &RemoteRegion, size: u32, iters: u64, warmup: u64) -> Result<RunResult> {
    let mut want = payload(size);
    want.iter_mut().take(8).for_each(|b| *b = 0);
    let mut lat = Latencies::new(warmup)?;
    for i in 0..warmup + iters {
        let t0 = Instant::now();
        let got = region
            .read_async(0, size)
            .await
            .map_err(chan_err("read_lat: read the server's region"))?;
        lat.add(i, t0.elapsed(), got == want);
    }
    Ok(lat.finish(size, LatencyKind::RoundTrip))
}

async fn atomic_lat(region: &RemoteRegion, iters: u64, warmup: u64) -> Result<RunResult> {
    let mut expected = 0u64;
    let mut lat = Latencies::new(warmup)?;
    for i in 0..warmup + iters {
        let t0 = Instant::now();
        let before = region
            .fetch_and_add_async(0, 1)
            .await
            .map_err(chan_err("atomic_lat: fetch-and-add on the server's word"))?;
        lat.add(i, t0.elapsed(), before == expected);
        expected = before.wrapping_add(1);
    }
    Ok(lat.finish(8, LatencyKind::RoundTrip))
}
