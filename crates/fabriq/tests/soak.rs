//! A randomized soak of the middleware between two endpoints of one process, every feature at
//! once: client threads open channels over the pooled connections of two workers, send bursts
//! of messages of random sizes around the protocol's edges (the bytes held in place, the eager
//! threshold, the READ chunk, 1 MiB) — copied, in a filled registered buffer, or by `try_send`
//! until the back-pressure lifts — and check every echo byte for byte and in order; close
//! channels with echoes still on their way; have the echoing side close a channel after what it
//! echoed (every echo is read, then `PeerGone`); change a live connection's thresholds
//! mid-burst; send from two threads (or tasks) on one channel at once, each sender's messages
//! checked in its order; make RPC calls; run fetch-and-add on a region the server exposed and
//! write into it, reading back what was written. Any error, lost, duplicated, reordered or
//! corrupted message, or a wait past `STALL`, fails the run. The same steps run through the
//! blocking API on threads and through the async API as tasks of a multi-threaded tokio
//! runtime.
//!
//! Each case runs `FABRIQ_SOAK_SECS` seconds (default 2) with `FABRIQ_SOAK_CLIENTS` clients
//! (default 4) from seed `FABRIQ_SOAK_SEED` (default 1); other `FABRIQ_*` variables change the
//! configuration, e.g. `FABRIQ_RX_SLOTS=4 FABRIQ_STREAM_WINDOW=4` for flow control at its
//! tightest, or `FABRIQ_MAX_STREAMS=2` for streams refused past the limit (which the client
//! meets with another channel); `FABRIQ_SOAK_SERVER` (`KEY=VALUE,…`) sets the server's apart,
//! e.g. `FABRIQ_SOAK_SERVER=FABRIQ_STREAM_WINDOW=8,FABRIQ_WORKERS=3`:
//! `FABRIQ_SOAK_SECS=60 cargo test --release -p fabriq --test soak -- --nocapture`.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fabriq::{
    Channel, ChannelError, Config, Endpoint, Message, Progress, RegionDescriptor, RemoteRegion,
    Rpc, RpcError, Thresholds,
};

/// Longer than any wait of a working run, on a loaded 2-CPU machine too.
const STALL: Duration = Duration::from_secs(30);
/// A message asking the echoing side to close the channel (echoing nothing for it).
const BYE: &[u8] = b"SOAKBYE";
/// RPC method that returns the descriptor of the server's exposed region.
const REGION: &str = "region";
/// Words at the start of the exposed region: one per client.
const WORDS: u64 = 512;
/// Slices of the exposed region after the words, one per client (modulo their number), for
/// writes read back.
const SLICES: u64 = 64;
const SLICE: u64 = 16 << 10;

/// A step's outcome: what went wrong, said in words.
type Step<T> = Result<T, String>;

/// A step's error for a stream its peer refused (past its `max_streams`): the client goes on
/// with another channel, as an application would; every other error fails the run.
const REFUSED: &str = "the peer refused the stream";

/// The step's error for a failed channel operation: [`REFUSED`], or `what` and why.
fn chan_err(what: String) -> impl FnOnce(ChannelError) -> String {
    move |e| match e {
        ChannelError::StreamRefused => REFUSED.into(),
        e => format!("{what}: {e}"),
    }
}

/// [`chan_err`] for a call.
fn rpc_err(what: String) -> impl FnOnce(RpcError) -> String {
    move |e| match e {
        RpcError::Channel(e) => chan_err(what)(e),
        e => format!("{what}: {e}"),
    }
}

/// The client's calls, through the blocking API or the async one.
trait Io: Send + Sync + 'static {
    /// Run `SENDERS` senders of one channel at once — threads for the blocking API, tasks for
    /// the async one — while the caller reads; what each returns.
    async fn senders(
        &self,
        ch: &Channel,
        per: u64,
        tag: u64,
        read: impl std::future::Future<Output = Step<()>>,
    ) -> Vec<Step<()>>;
    async fn connect(&self, a: &Endpoint, addr: SocketAddr) -> Result<Channel, ChannelError>;
    /// Send `data` the way `how` picks: a copy, a filled registered buffer (no copy), or
    /// `try_send` again until the back-pressure lifts.
    async fn send(&self, ch: &Channel, data: &[u8], how: Handoff) -> Result<(), ChannelError>;
    async fn recv(&self, ch: &Channel) -> Result<Message, ChannelError>;
    async fn call(&self, rpc: &Rpc, method: &str, req: &[u8]) -> Result<Vec<u8>, RpcError>;
    async fn fetch_and_add(&self, r: &RemoteRegion, offset: u64) -> Result<u64, ChannelError>;
    async fn write(&self, r: &RemoteRegion, offset: u64, data: &[u8]) -> Result<(), ChannelError>;
    async fn read(&self, r: &RemoteRegion, offset: u64, len: u32) -> Result<Vec<u8>, ChannelError>;
}

/// How a message is handed to the channel.
#[derive(Debug, Clone, Copy)]
enum Handoff {
    /// `send`: the channel copies it.
    Copy,
    /// `alloc`, fill, `send_buf`: no copy.
    Buf,
    /// `try_send`, again while `WouldBlock`.
    Try,
}

/// A registered buffer of the channel's endpoint holding `data`.
fn filled(ch: &Channel, data: &[u8]) -> Result<fabriq::SendBuf, ChannelError> {
    let mut buf = ch.alloc(data.len())?;
    buf.copy_from_slice(data);
    Ok(buf)
}

/// The blocking API (on a thread of its own; its futures never wait).
struct Blocking;

impl Io for Blocking {
    async fn senders(
        &self,
        ch: &Channel,
        per: u64,
        tag: u64,
        read: impl std::future::Future<Output = Step<()>>,
    ) -> Vec<Step<()>> {
        std::thread::scope(|sc| {
            let senders: Vec<_> = (0..SENDERS)
                .map(|sender| {
                    sc.spawn(move || {
                        for n in 0..per {
                            ch.send_timeout(&shared_payload(tag, sender, n), STALL)
                                .map_err(chan_err(format!("sender {sender}, {n} of {tag:#x}")))?;
                        }
                        Ok(())
                    })
                })
                .collect();
            // The reading future never waits: its blocking receives return or time out.
            let mut all = vec![futures_now(read)];
            all.extend(
                senders
                    .into_iter()
                    .map(|h| h.join().expect("a sender panicked")),
            );
            all
        })
    }
    async fn connect(&self, a: &Endpoint, addr: SocketAddr) -> Result<Channel, ChannelError> {
        a.connect(addr)
    }
    async fn send(&self, ch: &Channel, data: &[u8], how: Handoff) -> Result<(), ChannelError> {
        match how {
            Handoff::Copy => ch.send_timeout(data, STALL),
            Handoff::Buf => ch.send_buf_timeout(filled(ch, data)?, STALL),
            Handoff::Try => {
                let t0 = Instant::now();
                loop {
                    match ch.try_send(data) {
                        Err(ChannelError::WouldBlock) if t0.elapsed() < STALL => {
                            std::thread::yield_now()
                        }
                        Err(ChannelError::WouldBlock) => return Err(ChannelError::Timeout),
                        r => return r,
                    }
                }
            }
        }
    }
    async fn recv(&self, ch: &Channel) -> Result<Message, ChannelError> {
        ch.recv_timeout(STALL)
    }
    async fn call(&self, rpc: &Rpc, method: &str, req: &[u8]) -> Result<Vec<u8>, RpcError> {
        rpc.call(method, req, STALL)
    }
    async fn fetch_and_add(&self, r: &RemoteRegion, offset: u64) -> Result<u64, ChannelError> {
        r.fetch_and_add(offset, 1)
    }
    async fn write(&self, r: &RemoteRegion, offset: u64, data: &[u8]) -> Result<(), ChannelError> {
        r.write(offset, data)
    }
    async fn read(&self, r: &RemoteRegion, offset: u64, len: u32) -> Result<Vec<u8>, ChannelError> {
        r.read(offset, len)
    }
}

/// The async API, each wait bounded by `STALL`.
struct Async;

async fn bounded<T, E>(
    f: impl std::future::Future<Output = Result<T, E>>,
    timeout: E,
) -> Result<T, E> {
    tokio::time::timeout(STALL, f).await.unwrap_or(Err(timeout))
}

impl Io for Async {
    async fn senders(
        &self,
        ch: &Channel,
        per: u64,
        tag: u64,
        read: impl std::future::Future<Output = Step<()>>,
    ) -> Vec<Step<()>> {
        let senders: Vec<_> = (0..SENDERS)
            .map(|sender| {
                let ch = ch.clone();
                tokio::spawn(async move {
                    for n in 0..per {
                        bounded(
                            ch.send_async(&shared_payload(tag, sender, n)),
                            ChannelError::Timeout,
                        )
                        .await
                        .map_err(chan_err(format!("sender {sender}, {n} of {tag:#x}")))?;
                    }
                    Ok(())
                })
            })
            .collect();
        let mut all = vec![read.await];
        for h in senders {
            all.push(h.await.expect("a sender task panicked"));
        }
        all
    }
    async fn connect(&self, a: &Endpoint, addr: SocketAddr) -> Result<Channel, ChannelError> {
        bounded(a.connect_async(addr), ChannelError::Timeout).await
    }
    async fn send(&self, ch: &Channel, data: &[u8], how: Handoff) -> Result<(), ChannelError> {
        match how {
            Handoff::Copy => bounded(ch.send_async(data), ChannelError::Timeout).await,
            Handoff::Buf => {
                let buf = filled(ch, data)?;
                bounded(ch.send_buf_async(buf), ChannelError::Timeout).await
            }
            Handoff::Try => {
                let t0 = Instant::now();
                loop {
                    match ch.try_send(data) {
                        Err(ChannelError::WouldBlock) if t0.elapsed() < STALL => {
                            tokio::task::yield_now().await
                        }
                        Err(ChannelError::WouldBlock) => return Err(ChannelError::Timeout),
                        r => return r,
                    }
                }
            }
        }
    }
    async fn recv(&self, ch: &Channel) -> Result<Message, ChannelError> {
        bounded(ch.recv_async(), ChannelError::Timeout).await
    }
    async fn call(&self, rpc: &Rpc, method: &str, req: &[u8]) -> Result<Vec<u8>, RpcError> {
        rpc.call_async(method, req, STALL).await
    }
    async fn fetch_and_add(&self, r: &RemoteRegion, offset: u64) -> Result<u64, ChannelError> {
        r.fetch_and_add_async(offset, 1).await
    }
    async fn write(&self, r: &RemoteRegion, offset: u64, data: &[u8]) -> Result<(), ChannelError> {
        r.write_async(offset, data).await
    }
    async fn read(&self, r: &RemoteRegion, offset: u64, len: u32) -> Result<Vec<u8>, ChannelError> {
        r.read_async(offset, len).await
    }
}

/// xorshift64*: a small generator, seeded per thread, so that a seed replays a run's choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A size at one of the protocol's edges (± 2), a small one, or any up to 2 MiB.
fn size(rng: &mut Rng, eager: usize) -> usize {
    let edges = [0usize, 24, eager, 64 << 10, 1 << 20];
    match rng.below(4) {
        0 => rng.below(2 << 20) as usize,
        1 => rng.below(64) as usize,
        _ => (edges[rng.below(edges.len() as u64) as usize] + rng.below(5) as usize)
            .saturating_sub(2),
    }
}

/// The bytes of message `n` of stream `tag`: a misplaced or truncated message never matches.
fn payload(tag: u64, n: u64, len: usize) -> Vec<u8> {
    let seed = tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ n.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (0..len)
        .map(|i| (seed >> ((i % 8) * 8)) as u8 ^ (i as u8).wrapping_mul(31) ^ len as u8)
        .collect()
}

/// Senders of one channel in the shared-channel step.
const SENDERS: u64 = 2;

/// Message `n` of sender `sender` on a shared channel: the sender and `n` in its first 16
/// bytes, then [`payload`]'s bytes; 16 bytes to 80 KiB long, as (`tag`, `sender`, `n`) say.
fn shared_payload(tag: u64, sender: u64, n: u64) -> Vec<u8> {
    let mut rng = Rng((tag ^ sender.wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ n) | 1);
    let len = 16 + rng.below(80 << 10) as usize;
    let mut v = sender.to_le_bytes().to_vec();
    v.extend_from_slice(&n.to_le_bytes());
    v.extend(payload(tag ^ sender, n, len - 16));
    v
}

/// A waker for futures that never wait.
struct NeverWoken;

impl std::task::Wake for NeverWoken {
    fn wake(self: Arc<Self>) {}
}

/// The output of a future that never waits (the blocking API's).
fn futures_now<T>(f: impl std::future::Future<Output = T>) -> T {
    let waker = std::task::Waker::from(Arc::new(NeverWoken));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("a blocking step waited"),
    }
}

/// Several senders on one channel at once while this client reads the echoes: each sender's
/// messages come back whole and in its order (the senders' interleaving is free).
async fn shared(io: &impl Io, ch: Channel, rng: &mut Rng, tag: u64, counts: &Counts) -> Step<()> {
    let per = 1 + rng.below(32);
    let read = async {
        let mut next = [0u64; SENDERS as usize];
        for _ in 0..SENDERS * per {
            let m = io
                .recv(&ch)
                .await
                .map_err(chan_err(format!("shared echo of {tag:#x}")))?;
            let word = |at: usize| {
                m.get(at..at + 8)
                    .and_then(|b| <[u8; 8]>::try_from(b).ok())
                    .map(u64::from_le_bytes)
            };
            let (Some(sender), Some(n)) = (word(0), word(8)) else {
                return Err(format!("shared echo of {tag:#x}: {} bytes", m.len()));
            };
            let Some(want) = next.get_mut(sender as usize) else {
                return Err(format!("shared echo of {tag:#x}: sender {sender}"));
            };
            if n != *want || m[..] != shared_payload(tag, sender, n)[..] {
                return Err(format!(
                    "shared echo of {tag:#x}: sender {sender}'s {n} where {want} was next, \
                     or other bytes"
                ));
            }
            *want += 1;
            counts.echoes.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    };
    for r in io.senders(&ch, per, tag, read).await {
        r?;
    }
    counts.shared.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

#[derive(Default)]
struct Counts {
    channels: AtomicU64,
    echoes: AtomicU64,
    calls: AtomicU64,
    atomics: AtomicU64,
    early_closes: AtomicU64,
    peer_closes: AtomicU64,
    threshold_changes: AtomicU64,
    refused: AtomicU64,
    shared: AtomicU64,
    writes: AtomicU64,
}

/// The accepting side of one channel: echo every message until the peer closes, a `BYE`
/// arrives (drop the channel) or the run stops.
fn echo(ch: Channel, stop: &AtomicBool) -> Step<()> {
    loop {
        match ch.recv_timeout(Duration::from_millis(100)) {
            Ok(m) if m[..] == *BYE => return Ok(()),
            Ok(m) => match ch.send_timeout(&m, STALL) {
                Ok(()) | Err(ChannelError::PeerGone | ChannelError::Closed) => {}
                Err(e) => return Err(format!("echo: send: {e}")),
            },
            Err(ChannelError::Timeout) if !stop.load(Ordering::Relaxed) => {}
            Err(ChannelError::Timeout | ChannelError::PeerGone | ChannelError::Closed) => {
                return Ok(())
            }
            Err(e) => return Err(format!("echo: recv: {e}")),
        }
    }
}

/// Read echo `n` of stream `tag` and check it.
async fn check(
    io: &impl Io,
    ch: &Channel,
    tag: u64,
    n: u64,
    len: usize,
    counts: &Counts,
) -> Step<()> {
    let m = io
        .recv(ch)
        .await
        .map_err(chan_err(format!("echo {n} of {tag:#x}")))?;
    if m.len() != len || m[..] != payload(tag, n, len)[..] {
        return Err(format!(
            "echo {n} of {tag:#x}: {} bytes where {len} were sent, or other bytes",
            m.len()
        ));
    }
    counts.echoes.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// One-sided steps on the server's region: fetch-and-add on this client's word (each add sees
/// the one before), and writes of random bytes into this client's slice read back whole.
async fn one_sided(
    io: &impl Io,
    ch: Channel,
    rng: &mut Rng,
    word: u64,
    counts: &Counts,
) -> Step<()> {
    let desc = io
        .call(&Rpc::new(ch.clone()), REGION, &[])
        .await
        .map_err(rpc_err("region call".into()))?;
    let desc = RegionDescriptor::from_bytes(&desc).ok_or("region: not a descriptor")?;
    let region = ch.remote_region(desc);
    let mut last: Option<u64> = None;
    for _ in 0..1 + rng.below(64) {
        let before = io
            .fetch_and_add(&region, 8 * word)
            .await
            .map_err(chan_err("fetch_and_add".into()))?;
        if last.is_some_and(|l| before != l + 1) {
            return Err(format!("fetch_and_add returned {before} after {last:?}"));
        }
        last = Some(before);
        counts.atomics.fetch_add(1, Ordering::Relaxed);
    }
    let slice = 8 * WORDS + (word % SLICES) * SLICE;
    for i in 0..1 + rng.below(16) {
        let len = 1 + rng.below(SLICE);
        let at = slice + rng.below(SLICE - len + 1);
        let data = payload(word, i, len as usize);
        io.write(&region, at, &data)
            .await
            .map_err(chan_err(format!("write of {len} bytes at {at}")))?;
        let got = io
            .read(&region, at, len as u32)
            .await
            .map_err(chan_err(format!("read of {len} bytes at {at}")))?;
        if got != data {
            return Err(format!("read of {len} bytes at {at}: not what was written"));
        }
        counts.writes.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

async fn calls(
    io: &impl Io,
    ch: Channel,
    rng: &mut Rng,
    tag: u64,
    eager: usize,
    counts: &Counts,
) -> Step<()> {
    let rpc = Rpc::new(ch);
    for i in 0..1 + rng.below(32) {
        let req = payload(tag, i, size(rng, eager).min(256 << 10));
        let got = io
            .call(&rpc, "echo", &req)
            .await
            .map_err(rpc_err(format!("call {i} of {tag:#x}")))?;
        if got != req {
            return Err(format!("call {i} of {tag:#x}: the reply differs"));
        }
        counts.calls.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// One burst of messages on a new channel, its echoes checked; the channel then ends one of
/// three ways: every echo read, closed with echoes on their way, or closed by the peer.
async fn burst(
    io: &impl Io,
    a: &Endpoint,
    ch: Channel,
    rng: &mut Rng,
    tag: u64,
    window: u32,
    counts: &Counts,
) -> Step<()> {
    let cfg = a.config();
    let eager = cfg.eager_max.unwrap_or(4096) as usize;
    let n = 1 + rng.below(64);
    // Messages out before the first echo is read: at most half the stream window (the smaller
    // end's, which the connection uses), or both ends could wait for the other to read (as
    // with any flow-controlled stream).
    if ch.stream_window() != window {
        return Err(format!(
            "{tag:#x}: a stream window of {} where the ends agree on {window}",
            ch.stream_window()
        ));
    }
    let depth = 1 + rng.below(16.min(u64::from(window) / 2));
    let read_all = rng.below(5) != 0;
    let peer_closes = read_all && rng.below(4) == 0;
    let change_at = (rng.below(4) == 0).then(|| rng.below(n));
    let mut lens = VecDeque::new();
    let mut read = 0u64;
    for i in 0..n {
        if change_at == Some(i) {
            ch.set_thresholds(Thresholds {
                eager_max: [256, 1024, 2048, 4096][rng.below(4) as usize],
                chunk_size: [4096, 16 << 10, 64 << 10, 256 << 10][rng.below(4) as usize],
                reads_in_flight: 1 + rng.below(16) as u32,
            });
            counts.threshold_changes.fetch_add(1, Ordering::Relaxed);
        }
        let len = size(rng, eager);
        let how = [Handoff::Copy, Handoff::Copy, Handoff::Buf, Handoff::Try][rng.below(4) as usize];
        io.send(&ch, &payload(tag, i, len), how)
            .await
            .map_err(chan_err(format!("send {i} of {tag:#x}")))?;
        lens.push_back(len);
        while lens.len() as u64 >= depth {
            check(io, &ch, tag, read, lens.pop_front().unwrap_or(0), counts).await?;
            read += 1;
        }
    }
    if !read_all {
        counts.early_closes.fetch_add(1, Ordering::Relaxed);
        return Ok(());
    }
    if peer_closes {
        io.send(&ch, BYE, Handoff::Copy)
            .await
            .map_err(chan_err(format!("bye of {tag:#x}")))?;
    }
    while let Some(len) = lens.pop_front() {
        check(io, &ch, tag, read, len, counts).await?;
        read += 1;
    }
    if peer_closes {
        // Every echo was read: the next receive reports the close.
        match io.recv(&ch).await {
            Err(ChannelError::PeerGone) => {}
            Err(ChannelError::StreamRefused) => return Err(REFUSED.into()),
            other => {
                return Err(format!(
                    "after the peer closed {tag:#x}: {:?} instead of PeerGone",
                    other.map(|m| m.len())
                ))
            }
        }
        counts.peer_closes.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// What every client of a run shares.
#[derive(Clone, Copy)]
struct Plan {
    /// The server's listening address.
    addr: SocketAddr,
    /// When clients start no more steps.
    until: Instant,
    /// The stream window connections use: the smaller of the two ends'.
    window: u32,
}

async fn client(io: impl Io, a: Endpoint, plan: Plan, seed: u64, counts: Arc<Counts>) -> Step<()> {
    let (io, a, counts) = (&io, &a, &*counts);
    let Plan {
        addr,
        until,
        window,
    } = plan;
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let eager = a.config().eager_max.unwrap_or(4096) as usize;
    let mut tag = seed << 32;
    // Every kind of step first, however short the run; then at random.
    let mut kinds = [0, 1, 3, 8].into_iter();
    loop {
        let kind = match kinds.next() {
            Some(k) => k,
            None if Instant::now() < until => rng.below(9),
            None => return Ok(()),
        };
        tag += 1;
        let ch = io
            .connect(a, addr)
            .await
            .map_err(chan_err("connect".into()))?;
        counts.channels.fetch_add(1, Ordering::Relaxed);
        let step = match kind {
            0 => one_sided(io, ch, &mut rng, seed % WORDS, counts).await,
            8 => shared(io, ch, &mut rng, tag, counts).await,
            1 | 2 => calls(io, ch, &mut rng, tag, eager, counts).await,
            _ => burst(io, a, ch, &mut rng, tag, window, counts).await,
        };
        match step {
            Err(e) if e == REFUSED => {
                counts.refused.fetch_add(1, Ordering::Relaxed);
            }
            step => step?,
        }
    }
}

/// An endpoint's configuration: `FABRIQ_*` variables, over them `overrides` (`KEY=VALUE`
/// separated by commas), two workers unless either names `FABRIQ_WORKERS`.
fn config(device: &str, progress: Progress, overrides: &str) -> Config {
    let overrides: std::collections::HashMap<&str, &str> = overrides
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .collect();
    let get = |k: &str| {
        overrides
            .get(k)
            .map(|v| v.to_string())
            .or_else(|| std::env::var(k).ok())
    };
    let workers = get("FABRIQ_WORKERS").is_none();
    let mut cfg = Config::default()
        .with_env_vars(get)
        .expect("FABRIQ_* configuration");
    cfg.device = device.into();
    cfg.progress = progress;
    if workers {
        cfg.workers = 2;
    }
    cfg
}

/// One soak at a time: each loads every CPU of a small machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Through which API the clients run.
#[derive(Debug, Clone, Copy)]
enum Api {
    /// Blocking calls, one thread per client.
    Blocking,
    /// Async calls, one task per client on a two-thread runtime.
    Async,
}

/// One soak on `device` in `progress` mode through `api`, with `FABRIQ_SOAK_CLIENTS` clients
/// (default 4).
fn soak(device: &str, progress: Progress, api: Api) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let secs: u64 =
        std::env::var("FABRIQ_SOAK_SECS").map_or(2, |s| s.parse().expect("FABRIQ_SOAK_SECS"));
    let seed: u64 =
        std::env::var("FABRIQ_SOAK_SEED").map_or(1, |s| s.parse().expect("FABRIQ_SOAK_SEED"));
    let clients: u64 = std::env::var("FABRIQ_SOAK_CLIENTS")
        .map_or(4, |s| s.parse().expect("FABRIQ_SOAK_CLIENTS"))
        .clamp(1, WORDS);
    let a = Endpoint::new(config(device, progress, "")).expect("client endpoint");
    let server = std::env::var("FABRIQ_SOAK_SERVER").unwrap_or_default();
    let b = Endpoint::new(config(device, progress, &server)).expect("server endpoint");
    b.serve("echo", |req| Ok(req.to_vec()));
    let exposed = b
        .expose((8 * WORDS + SLICES * SLICE) as usize)
        .expect("expose");
    let desc = exposed.descriptor().to_bytes().to_vec();
    b.serve(REGION, move |_| Ok(desc.clone()));
    let listener = b.listen("127.0.0.1:0").expect("listen");
    let addr = listener.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let acceptor = {
        let (stop, errors) = (Arc::clone(&stop), Arc::clone(&errors));
        std::thread::spawn(move || {
            let mut echoes = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match listener.accept_timeout(Duration::from_millis(100)) {
                    Ok(ch) => {
                        let (stop, errors) = (Arc::clone(&stop), Arc::clone(&errors));
                        echoes.push(std::thread::spawn(move || {
                            if let Err(e) = echo(ch, &stop) {
                                errors.lock().expect("errors").push(e);
                            }
                        }));
                        echoes.retain(|h: &std::thread::JoinHandle<()>| !h.is_finished());
                    }
                    Err(ChannelError::Timeout) => {}
                    Err(e) => errors.lock().expect("errors").push(format!("accept: {e}")),
                }
            }
            for h in echoes {
                h.join().expect("an echo thread panicked");
            }
        })
    };
    let counts = Arc::new(Counts::default());
    let plan = Plan {
        addr,
        until: Instant::now() + Duration::from_secs(secs),
        window: a.config().stream_window.min(b.config().stream_window),
    };
    let seeds = (0..clients).map(|t| seed * WORDS + t);
    let mut failed: Vec<String> = match api {
        Api::Blocking => seeds
            .map(|seed| {
                let (a, counts) = (a.clone(), Arc::clone(&counts));
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("runtime");
                    rt.block_on(client(Blocking, a, plan, seed, counts))
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .filter_map(|c| c.join().expect("a client thread panicked").err())
            .collect(),
        Api::Async => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            let tasks: Vec<_> = seeds
                .map(|seed| rt.spawn(client(Async, a.clone(), plan, seed, Arc::clone(&counts))))
                .collect();
            rt.block_on(async {
                let mut failed = Vec::new();
                for t in tasks {
                    if let Err(e) = t.await.expect("a client task panicked") {
                        failed.push(e);
                    }
                }
                failed
            })
        }
    };
    stop.store(true, Ordering::Relaxed);
    acceptor.join().expect("the acceptor panicked");
    failed.extend(errors.lock().expect("errors").drain(..));
    // Every channel is gone: so is every connection of the client's pool, once its close
    // lingered (a connection kept by a channel that leaked would stay).
    let t0 = Instant::now();
    while a.pool_stats().live > 0 && t0.elapsed() < STALL {
        std::thread::sleep(Duration::from_millis(10));
    }
    if a.pool_stats().live > 0 {
        failed.push(format!(
            "{} pooled connections live after every channel was dropped",
            a.pool_stats().live
        ));
    }
    let c = |v: &AtomicU64| v.load(Ordering::Relaxed);
    println!(
        "{device} {progress:?} {api:?}, {secs} s, seed {seed}: {} channels, {} echoes, {} \
         calls, {} fetch-and-adds, {} writes read back, {} closed early, {} closed by the \
         peer, {} threshold changes, {} refused, {} shared by {SENDERS} senders",
        c(&counts.channels),
        c(&counts.echoes),
        c(&counts.calls),
        c(&counts.atomics),
        c(&counts.writes),
        c(&counts.early_closes),
        c(&counts.peer_closes),
        c(&counts.threshold_changes),
        c(&counts.refused),
        c(&counts.shared),
    );
    assert!(
        failed.is_empty(),
        "{device} {progress:?} seed {seed}: {failed:#?}"
    );
    // Every kind of step ran (a run too short for them would prove nothing) — each client's
    // first steps are one of each, unless a refused stream cut one short.
    let refused = c(&counts.refused) > 0;
    for (what, v) in [
        ("echoes", &counts.echoes),
        ("calls", &counts.calls),
        ("fetch-and-adds", &counts.atomics),
        ("writes read back", &counts.writes),
        ("shared channels", &counts.shared),
    ] {
        assert!(
            refused || c(v) > 0,
            "{device} {progress:?} {api:?}: no {what} in {secs} s"
        );
    }
    drop(exposed);
}

/// One test per device, progress mode and API.
macro_rules! soak_cases {
    ($($name:ident: $device:literal, $progress:ident, $api:ident;)*) => {
        $(
            #[test]
            fn $name() {
                soak($device, Progress::$progress, Api::$api);
            }
        )*
    };
}

soak_cases! {
    soak_shm_thread_mode: "shm0", Thread, Blocking;
    soak_shm_caller_mode: "shm0", Caller, Blocking;
    soak_tcp_thread_mode: "tcp0", Thread, Blocking;
    soak_tcp_caller_mode: "tcp0", Caller, Blocking;
    soak_async_shm_thread_mode: "shm0", Thread, Async;
    soak_async_shm_caller_mode: "shm0", Caller, Async;
    soak_async_tcp_thread_mode: "tcp0", Thread, Async;
    soak_async_tcp_caller_mode: "tcp0", Caller, Async;
}
