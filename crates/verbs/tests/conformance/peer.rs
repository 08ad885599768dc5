//! The peer process: a second process that opens the same device, owns a QP and memory
//! regions, and obeys a tiny request/response protocol over a TCP control socket on 127.0.0.1.
//!
//! The test side ([`Peer`]) starts the peer by re-executing the test binary so that it runs only
//! the ignored test `peer_process` with `FABRIQ_CONFORMANCE_CTRL` (control address),
//! `FABRIQ_CONFORMANCE_DEVICE` and `FABRIQ_CONFORMANCE_CONFIG` (a JSON `DeviceConfig`) set. The
//! peer connects back, and from then on every [`Request`] gets exactly one [`Reply`]. Frames are
//! one JSON document per line. Between requests the peer keeps polling its CQ (so providers
//! without a progress thread move data) and stashes the completions for [`Request::Poll`].
//!
//! Robustness: every wait on either side has a deadline; the peer exits when the control socket
//! closes or after [`PEER_IDLE_LIMIT`] without a request, and the test side kills the peer when
//! its [`Peer`] handle is dropped (also on panic), so a broken provider fails a test, never
//! hangs it or leaves processes behind.

use std::collections::{BTreeMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fabriq_verbs::{
    provider::wait_readable, AccessFlags, CompletionQueue, Context, DeviceConfig, MemoryRegion,
    ProtectionDomain, QpCaps, QpEndpoint, QpInitAttr, QpNum, QpState, QueuePair, RecvWr,
    RemoteAddr, SendFlags, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion, WrOpcode,
};
use serde::{Deserialize, Serialize};

use crate::harness::{
    drive_to_rts, fail, pump_all, Backoff, ConnectOpts, Env, Node, TestProvider, TIMEOUT,
};

/// A peer that receives no request for this long exits on its own.
pub const PEER_IDLE_LIMIT: Duration = Duration::from_secs(120);

/// Largest control frame accepted.
const MAX_FRAME: usize = 64 << 20;

/// One SGE of a peer-side request: `len` bytes at `offset` of the peer's region `mr`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct PeerSge {
    /// Region id (from [`Reply::Mr`]).
    pub mr: u32,
    /// Offset in the region.
    pub offset: usize,
    /// Length.
    pub len: u32,
}

/// A peer's registered region, as the test side sees it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct MrDesc {
    /// Region id for later requests.
    pub id: u32,
    /// Start address in the peer.
    pub addr: u64,
    /// Remote key.
    pub rkey: fabriq_verbs::Rkey,
    /// Length.
    pub len: u64,
}

impl MrDesc {
    /// The remote address of `offset` in this region.
    pub fn at(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr + offset,
            rkey: self.rkey,
        }
    }
}

/// A completion as the peer reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerWc {
    /// Request id.
    pub wr_id: u64,
    /// Status.
    pub status: WcStatus,
    /// Opcode.
    pub opcode: WcOpcode,
    /// Bytes.
    pub byte_len: u32,
    /// Immediate data.
    pub imm_data: Option<u32>,
    /// Local QP.
    pub qp_num: QpNum,
}

impl From<&WorkCompletion> for PeerWc {
    fn from(wc: &WorkCompletion) -> Self {
        PeerWc {
            wr_id: wc.wr_id,
            status: wc.status,
            opcode: wc.opcode,
            byte_len: wc.byte_len,
            imm_data: wc.imm_data,
            qp_num: wc.qp_num,
        }
    }
}

/// The operation of a peer-side send request (mirrors [`WrOpcode`]).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub enum PeerOp {
    /// SEND.
    Send,
    /// SEND_WITH_IMM.
    SendImm(u32),
    /// RDMA WRITE.
    Write(RemoteAddr),
    /// RDMA WRITE_WITH_IMM.
    WriteImm(RemoteAddr, u32),
    /// RDMA READ.
    Read(RemoteAddr),
}

/// A send request the peer posts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeerWr {
    /// Request id.
    pub wr_id: u64,
    /// Operation.
    pub op: PeerOp,
    /// Gather (or READ scatter) list.
    pub sges: Vec<PeerSge>,
    /// SIGNALED | SOLICITED flags as bits of [`SendFlags`].
    pub flags: u32,
}

/// What the test asks of the peer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Request {
    /// Create the CQ and QP. Reply: [`Reply::Endpoint`].
    Setup {
        /// CQ entries.
        cq_size: u32,
        /// QP queue sizes.
        caps: QpCaps,
    },
    /// Drive the QP to RTS towards `remote`. Reply: `Ok`.
    Connect {
        /// The test's QP.
        remote: QpEndpoint,
        /// Peer-side connection parameters.
        opts: ConnectOpts,
    },
    /// Move the QP to RESET. Reply: [`Reply::Endpoint`] (the endpoint to reconnect to).
    Reset,
    /// The QP's state. Reply: [`Reply::State`].
    State,
    /// Register a zeroed region (`user_memory`: memory of the peer registered with `reg_mr`,
    /// kept readable after deregistration). Reply: [`Reply::Mr`].
    RegMr {
        /// Bytes.
        len: usize,
        /// Rights.
        access: AccessFlags,
        /// Use `reg_mr` on peer-owned memory instead of `alloc_mr`.
        user_memory: bool,
    },
    /// Register a zeroed region in a second protection domain of the peer, which its QP does
    /// not belong to. Reply: [`Reply::Mr`].
    RegMrOtherPd {
        /// Bytes.
        len: usize,
        /// Rights.
        access: AccessFlags,
    },
    /// Deregister a region. Reply: `Ok`.
    DeregMr {
        /// Region id.
        id: u32,
    },
    /// Read bytes of a region. Reply: [`Reply::Bytes`].
    ReadMr {
        /// Region id.
        id: u32,
        /// Offset.
        offset: usize,
        /// Bytes.
        len: usize,
    },
    /// Write bytes into a region. Reply: `Ok`.
    WriteMr {
        /// Region id.
        id: u32,
        /// Offset.
        offset: usize,
        /// Hex-encoded bytes.
        hex: String,
    },
    /// Fill a whole region with `pattern(seed, len)`. Reply: `Ok`.
    FillPattern {
        /// Region id.
        id: u32,
        /// Pattern seed.
        seed: u8,
    },
    /// FNV-1a 64 digest of bytes of a region. Reply: [`Reply::Digest`].
    Digest {
        /// Region id.
        id: u32,
        /// Offset.
        offset: usize,
        /// Bytes.
        len: usize,
    },
    /// Spin (polling the CQ meanwhile) until the 8-byte word at `flag_offset` of region
    /// `flag_mr` reads `value`, then digest `len` bytes at `offset` of region `data_mr` at once.
    /// Reply: [`Reply::Digest`].
    WaitFlagThenDigest {
        /// Region of the flag word.
        flag_mr: u32,
        /// Offset of the 8-byte aligned flag word.
        flag_offset: usize,
        /// Value to wait for.
        value: u64,
        /// Region to digest.
        data_mr: u32,
        /// Offset to digest from.
        offset: usize,
        /// Bytes to digest.
        len: usize,
    },
    /// Post one receive. Reply: `Ok`, or `Error` if refused.
    PostRecv {
        /// Request id.
        wr_id: u64,
        /// Scatter list.
        sges: Vec<PeerSge>,
    },
    /// Post send requests in one batch. Reply: `Ok`, or `Error` if refused.
    PostSend {
        /// The batch.
        wrs: Vec<PeerWr>,
    },
    /// Wait for `count` completions (fewer on timeout). Reply: [`Reply::Completions`].
    Poll {
        /// How many.
        count: usize,
        /// Deadline, ms.
        timeout_ms: u64,
    },
    /// Run `count` FETCH_AND_ADD(+1) on `remote`, `batch` per signaled request, and report the
    /// fetched values. Reply: [`Reply::FetchAdd`].
    FetchAddLoop {
        /// The counter.
        remote: RemoteAddr,
        /// How many.
        count: u64,
        /// Requests per signaled batch.
        batch: u32,
        /// Fetched values are expected in `0..range`.
        range: u64,
    },
    /// SEND `count` messages; message `i` is [`stream_message`]`(i)`, at most `window` in
    /// flight. Reply: `Ok` once all completed successfully.
    SendStream {
        /// Messages.
        count: u32,
        /// Requests in flight.
        window: u32,
    },
    /// Take a CAS spin lock `iterations` times and increment the plain counter under it with
    /// READ + WRITE. Reply: [`Reply::CasLock`].
    CasLockLoop {
        /// The lock word (0 = free).
        lock: RemoteAddr,
        /// The plain counter.
        counter: RemoteAddr,
        /// Acquisitions.
        iterations: u32,
        /// Non-zero lock owner id.
        id: u64,
    },
    /// Destroy the QP (drop it) while the process lives on. Reply: `Ok`.
    DestroyQp,
    /// Exit cleanly. Reply: `Ok`.
    Exit,
}

/// The peer's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Reply {
    /// Done.
    Ok,
    /// The request failed.
    Error(String),
    /// The peer QP's endpoint.
    Endpoint(QpEndpoint),
    /// The QP state.
    State(QpState),
    /// A new region.
    Mr(MrDesc),
    /// Hex-encoded bytes.
    Bytes(String),
    /// A digest (see [`fnv1a`]).
    Digest(u64),
    /// Completions, oldest first.
    Completions(Vec<PeerWc>),
    /// Outcome of [`Request::FetchAddLoop`].
    FetchAdd {
        /// Hex-encoded bitmap of fetched values in `0..range`.
        bitmap: String,
        /// Values fetched twice by this peer.
        duplicates: u64,
        /// Values outside `0..range`.
        out_of_range: u64,
        /// Fetched values not above the previous one (a QP executes its atomics in order).
        non_monotonic: u64,
    },
    /// Outcome of [`Request::CasLockLoop`].
    CasLock {
        /// Failed acquisition attempts.
        contended: u64,
    },
}

/// Largest message of [`Request::SendStream`].
pub const STREAM_MAX: usize = 4096;

/// Message `i` of [`Request::SendStream`]: 1..=4096 bytes of a pattern seeded by `i`.
pub fn stream_message(i: u32) -> Vec<u8> {
    let len = 1 + (i as usize * 389) % STREAM_MAX;
    crate::harness::pattern(i as u8 ^ (i >> 8) as u8, len)
}

/// FNV-1a, 64 bits: a cheap digest to compare large regions across processes.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Encode bytes as lowercase hex.
pub fn to_hex(bytes: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(D[usize::from(b >> 4)] as char);
        s.push(D[usize::from(b & 15)] as char);
    }
    s
}

/// Decode lowercase or uppercase hex.
pub fn from_hex(s: &str) -> Result<Vec<u8>, String> {
    fn nib(c: u8) -> Result<u8, String> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(format!("bad hex digit {c:#x}")),
        }
    }
    let s = s.as_bytes();
    if s.len() % 2 != 0 {
        return Err("odd hex length".into());
    }
    s.chunks(2)
        .map(|p| Ok(nib(p[0])? << 4 | nib(p[1])?))
        .collect()
}

/// Newline-delimited JSON framing over a non-blocking stream.
struct Framed {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Framed {
    fn new(stream: TcpStream) -> std::io::Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        Ok(Framed {
            stream,
            buf: Vec::new(),
        })
    }

    fn send<T: Serialize>(&mut self, msg: &T) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
        line.push(b'\n');
        let mut rest = &line[..];
        let mut backoff = Backoff::new(TIMEOUT);
        while !rest.is_empty() {
            match self.stream.write(rest) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if !backoff.snooze() {
                        return Err(ErrorKind::TimedOut.into());
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// One complete frame if available now; `Err(UnexpectedEof)` once the other side closed.
    fn try_recv<T: for<'de> Deserialize<'de>>(&mut self) -> std::io::Result<Option<T>> {
        loop {
            if let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                let msg = serde_json::from_slice(&line[..pos])
                    .map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))?;
                return Ok(Some(msg));
            }
            if self.buf.len() > MAX_FRAME {
                return Err(std::io::Error::new(
                    ErrorKind::InvalidData,
                    "frame too large",
                ));
            }
            let mut chunk = [0u8; 64 * 1024];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Wait up to `timeout` for the socket to become readable.
    fn wait_readable(&self, timeout: Duration) {
        let _ = wait_readable(self.stream.as_fd(), Some(timeout));
    }
}

// ---------------------------------------------------------------------------------------------
// Test side.

/// A running peer process and its control connection. Dropping it kills the process.
pub struct Peer {
    child: Child,
    ctrl: Framed,
    /// The peer QP's endpoint.
    pub endpoint: QpEndpoint,
    name: String,
}

/// How the peer's QP is built.
#[derive(Debug, Clone, Copy)]
pub struct PeerSetup {
    /// CQ entries.
    pub cq_size: u32,
    /// QP queue sizes.
    pub caps: QpCaps,
}

impl Default for PeerSetup {
    fn default() -> Self {
        PeerSetup {
            cq_size: 256,
            caps: QpCaps::default(),
        }
    }
}

impl Peer {
    /// Start a peer process on the device under test and create its CQ and QP.
    pub fn spawn<P: TestProvider>(
        env: &Env<P>,
        setup: PeerSetup,
    ) -> Result<Peer, Box<dyn std::error::Error>> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .args([
                "peer_process",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("FABRIQ_CONFORMANCE_CTRL", addr.to_string())
            .env("FABRIQ_CONFORMANCE_DEVICE", &env.device)
            .env(
                "FABRIQ_CONFORMANCE_CONFIG",
                serde_json::to_string(&P::device_config())?,
            )
            .env("FABRIQ_CONFORMANCE_PEER_NAME", &env.name)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()?;
        listener.set_nonblocking(true)?;
        let mut backoff = Backoff::new(TIMEOUT);
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if let Some(status) = child.try_wait()? {
                        return Err(fail(format!("peer process exited at start: {status}")));
                    }
                    if !backoff.snooze() {
                        let _ = child.kill();
                        let _ = child.wait();
                        return Err(fail("peer process did not connect back in time"));
                    }
                }
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(e.into());
                }
            }
        };
        let mut peer = Peer {
            child,
            ctrl: Framed::new(stream)?,
            endpoint: QpEndpoint {
                provider: String::new(),
                device: String::new(),
                address: String::new(),
                qp_num: QpNum(0),
                psn: 0,
                lid: 0,
                gid: [0; 16],
                mtu: 0,
                extra: BTreeMap::new(),
            },
            name: env.name.clone(),
        };
        match peer.call(&Request::Setup {
            cq_size: setup.cq_size,
            caps: setup.caps,
        })? {
            Reply::Endpoint(ep) => peer.endpoint = ep,
            other => return Err(fail(format!("peer setup: unexpected reply {other:?}"))),
        }
        Ok(peer)
    }

    /// Send a request without waiting for its reply (pair with [`Peer::reply`]).
    pub fn send(&mut self, req: &Request) -> Result<(), Box<dyn std::error::Error>> {
        self.ctrl
            .send(req)
            .map_err(|e| fail(format!("{}: sending {req:?} to peer: {e}", self.name)))
    }

    /// Wait for the next reply, pumping this test's CQs meanwhile. `Reply::Error` becomes `Err`.
    pub fn reply(&mut self) -> Result<Reply, Box<dyn std::error::Error>> {
        self.reply_within(TIMEOUT * 3)
    }

    /// [`Peer::reply`] with an explicit deadline.
    pub fn reply_within(&mut self, timeout: Duration) -> Result<Reply, Box<dyn std::error::Error>> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.ctrl.try_recv::<Reply>() {
                Ok(Some(Reply::Error(e))) => return Err(fail(format!("peer: {e}"))),
                Ok(Some(r)) => return Ok(r),
                Ok(None) => {}
                Err(e) => {
                    let status = self.child.try_wait().ok().flatten();
                    return Err(fail(format!(
                        "control connection to peer lost ({e}); peer exit status: {status:?}"
                    )));
                }
            }
            if Instant::now() >= deadline {
                return Err(fail(format!("peer did not answer within {timeout:?}")));
            }
            if pump_all() == 0 {
                self.ctrl.wait_readable(Duration::from_millis(1));
            }
        }
    }

    /// Send a request and wait for its reply.
    pub fn call(&mut self, req: &Request) -> Result<Reply, Box<dyn std::error::Error>> {
        self.send(req)?;
        self.reply()
    }

    /// Send a request whose reply must be `Ok`.
    pub fn call_ok(&mut self, req: &Request) -> Result<(), Box<dyn std::error::Error>> {
        match self.call(req)? {
            Reply::Ok => Ok(()),
            other => Err(fail(format!("{req:?}: unexpected reply {other:?}"))),
        }
    }

    /// Connect the peer's QP and `node`'s QP to each other, both sides at once.
    pub fn connect(
        &mut self,
        node: &Node,
        local: &ConnectOpts,
        remote: &ConnectOpts,
    ) -> Result<(), Box<dyn std::error::Error>> {
        self.send(&Request::Connect {
            remote: node.qp.endpoint(),
            opts: *remote,
        })?;
        drive_to_rts(&node.qp, &self.endpoint, local)
            .map_err(|e| fail(format!("connecting the local QP to the peer: {e}")))?;
        match self.reply()? {
            Reply::Ok => Ok(()),
            other => Err(fail(format!("peer connect: unexpected reply {other:?}"))),
        }
    }

    /// Register a region in the peer.
    pub fn reg_mr(
        &mut self,
        len: usize,
        access: AccessFlags,
    ) -> Result<MrDesc, Box<dyn std::error::Error>> {
        self.reg(len, access, false)
    }

    /// Register a region in the peer, from `alloc_mr` or (`user_memory`) from `reg_mr`.
    pub fn reg(
        &mut self,
        len: usize,
        access: AccessFlags,
        user_memory: bool,
    ) -> Result<MrDesc, Box<dyn std::error::Error>> {
        match self.call(&Request::RegMr {
            len,
            access,
            user_memory,
        })? {
            Reply::Mr(d) => Ok(d),
            other => Err(fail(format!("reg_mr: unexpected reply {other:?}"))),
        }
    }

    /// Read `len` bytes at `offset` of peer region `mr`.
    pub fn read(
        &mut self,
        mr: &MrDesc,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
        match self.call(&Request::ReadMr {
            id: mr.id,
            offset,
            len,
        })? {
            Reply::Bytes(h) => Ok(from_hex(&h)?),
            other => Err(fail(format!("read: unexpected reply {other:?}"))),
        }
    }

    /// Write `data` at `offset` of peer region `mr`.
    pub fn write(
        &mut self,
        mr: &MrDesc,
        offset: usize,
        data: &[u8],
    ) -> Result<(), Box<dyn std::error::Error>> {
        self.call_ok(&Request::WriteMr {
            id: mr.id,
            offset,
            hex: to_hex(data),
        })
    }

    /// Post one receive scattering into `sges`.
    pub fn post_recv(
        &mut self,
        wr_id: u64,
        sges: &[PeerSge],
    ) -> Result<(), Box<dyn std::error::Error>> {
        self.call_ok(&Request::PostRecv {
            wr_id,
            sges: sges.to_vec(),
        })
    }

    /// Digest of `len` bytes at `offset` of peer region `mr`.
    pub fn digest(
        &mut self,
        mr: &MrDesc,
        offset: usize,
        len: usize,
    ) -> Result<u64, Box<dyn std::error::Error>> {
        match self.call(&Request::Digest {
            id: mr.id,
            offset,
            len,
        })? {
            Reply::Digest(d) => Ok(d),
            other => Err(fail(format!("digest: unexpected reply {other:?}"))),
        }
    }

    /// Have the peer post a batch of send requests.
    pub fn post_send(&mut self, wrs: &[PeerWr]) -> Result<(), Box<dyn std::error::Error>> {
        self.call_ok(&Request::PostSend { wrs: wrs.to_vec() })
    }

    /// Wait for exactly `count` completions at the peer.
    pub fn poll(&mut self, count: usize) -> Result<Vec<PeerWc>, Box<dyn std::error::Error>> {
        match self.call(&Request::Poll {
            count,
            timeout_ms: TIMEOUT.as_millis() as u64,
        })? {
            Reply::Completions(v) if v.len() == count => Ok(v),
            Reply::Completions(v) => Err(fail(format!(
                "peer got {} of {count} completions within {TIMEOUT:?}: {v:?}",
                v.len()
            ))),
            other => Err(fail(format!("poll: unexpected reply {other:?}"))),
        }
    }

    /// Completions the peer has now, without waiting.
    pub fn poll_ready(&mut self) -> Result<Vec<PeerWc>, Box<dyn std::error::Error>> {
        match self.call(&Request::Poll {
            count: usize::MAX,
            timeout_ms: 0,
        })? {
            Reply::Completions(v) => Ok(v),
            other => Err(fail(format!("poll: unexpected reply {other:?}"))),
        }
    }

    /// The peer QP's state.
    pub fn state(&mut self) -> Result<QpState, Box<dyn std::error::Error>> {
        match self.call(&Request::State)? {
            Reply::State(s) => Ok(s),
            other => Err(fail(format!("state: unexpected reply {other:?}"))),
        }
    }

    /// Kill the peer process abruptly (SIGKILL) and reap it.
    pub fn kill(&mut self) -> Result<(), Box<dyn std::error::Error>> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// Peer side.

/// Memory of the peer registered with `reg_mr`: page-aligned, zeroed, freed on drop (after the
/// region that names it).
struct UserBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl UserBuf {
    fn new(len: usize) -> Result<UserBuf, String> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096)
            .map_err(|e| format!("layout: {e}"))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err("out of memory".into());
        }
        Ok(UserBuf { ptr, layout })
    }

    /// Copy bytes out. Only called when no region names this memory any more, or after the
    /// completions that wrote it were seen, like any verbs consumer.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        match offset.checked_add(dst.len()) {
            Some(end) if end <= self.layout.size() => {}
            _ => return Err("read outside buffer".into()),
        }
        // SAFETY: the range is inside the allocation (checked above), which lives until drop.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

impl Drop for UserBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout and freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// A peer region. Field order matters: the MR is dropped before the memory it names.
struct PeerMr {
    mr: Option<MemoryRegion>,
    user: Option<UserBuf>,
}

struct PeerState {
    ctx: Context,
    pd: ProtectionDomain,
    cq: Option<CompletionQueue>,
    qp: Option<QueuePair>,
    mrs: BTreeMap<u32, PeerMr>,
    next_mr: u32,
    other_pd: Option<ProtectionDomain>,
    stash: VecDeque<WorkCompletion>,
    cq_error: Option<String>,
}

/// Entry point of the peer process (see the module docs). Returns at once when the process is
/// not a peer.
pub fn peer_main() {
    let Ok(ctrl) = std::env::var("FABRIQ_CONFORMANCE_CTRL") else {
        return;
    };
    let name = std::env::var("FABRIQ_CONFORMANCE_PEER_NAME").unwrap_or_default();
    if let Err(e) = serve(&ctrl) {
        crate::harness::note(&format!("conformance peer of {name}: {e}"));
        std::process::exit(2);
    }
    std::process::exit(0);
}

fn serve(ctrl: &str) -> Result<(), String> {
    let device = std::env::var("FABRIQ_CONFORMANCE_DEVICE").map_err(|e| e.to_string())?;
    let config: DeviceConfig = match std::env::var("FABRIQ_CONFORMANCE_CONFIG") {
        Ok(s) => serde_json::from_str(&s).map_err(|e| e.to_string())?,
        Err(_) => DeviceConfig::default(),
    };
    let stream = TcpStream::connect(ctrl).map_err(|e| format!("connect {ctrl}: {e}"))?;
    let mut framed = Framed::new(stream).map_err(|e| e.to_string())?;
    let ctx = Context::open_with(&device, &config).map_err(|e| format!("open {device}: {e}"))?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let mut st = PeerState {
        ctx,
        pd,
        cq: None,
        qp: None,
        mrs: BTreeMap::new(),
        next_mr: 1,
        other_pd: None,
        stash: VecDeque::new(),
        cq_error: None,
    };
    let mut last_request = Instant::now();
    loop {
        let req = match framed.try_recv::<Request>() {
            Ok(Some(r)) => r,
            Ok(None) => {
                if last_request.elapsed() > PEER_IDLE_LIMIT {
                    return Err("no request for too long; exiting".into());
                }
                if st.pump() == 0 {
                    framed.wait_readable(Duration::from_millis(1));
                }
                continue;
            }
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(format!("control socket: {e}")),
        };
        last_request = Instant::now();
        let exit = matches!(req, Request::Exit);
        let reply = st.handle(req).unwrap_or_else(Reply::Error);
        framed.send(&reply).map_err(|e| format!("reply: {e}"))?;
        if exit {
            return Ok(());
        }
    }
}

impl PeerState {
    fn qp(&self) -> Result<&QueuePair, String> {
        self.qp
            .as_ref()
            .ok_or_else(|| "no QP: send Setup first".to_string())
    }

    fn mr(&self, id: u32) -> Result<&PeerMr, String> {
        self.mrs.get(&id).ok_or_else(|| format!("no region {id}"))
    }

    fn live_mr(&self, id: u32) -> Result<&MemoryRegion, String> {
        self.mr(id)?
            .mr
            .as_ref()
            .ok_or_else(|| format!("region {id} was deregistered"))
    }

    /// Poll the CQ once into the stash.
    fn pump(&mut self) -> usize {
        let Some(cq) = &self.cq else { return 0 };
        if self.cq_error.is_some() {
            return 0;
        }
        let mut buf = [WorkCompletion::EMPTY; 32];
        match cq.poll(&mut buf) {
            Ok(n) => {
                self.stash.extend(buf[..n].iter().copied());
                n
            }
            Err(e) => {
                self.cq_error = Some(e.to_string());
                0
            }
        }
    }

    /// Wait for one completion (for the loops that drive their own requests).
    fn next_wc(&mut self) -> Result<WorkCompletion, String> {
        let mut backoff = Backoff::new(TIMEOUT);
        loop {
            if let Some(wc) = self.stash.pop_front() {
                return Ok(wc);
            }
            if let Some(e) = &self.cq_error {
                return Err(format!("poll_cq: {e}"));
            }
            if self.pump() == 0 && !backoff.snooze() {
                return Err(format!("no completion within {TIMEOUT:?}"));
            }
        }
    }

    fn sge(&self, s: &PeerSge) -> Result<Sge, String> {
        self.live_mr(s.mr)?
            .sge(s.offset, s.len)
            .map_err(|e| e.to_string())
    }

    fn keep(&mut self, mr: MemoryRegion, user: Option<UserBuf>) -> MrDesc {
        let id = self.next_mr;
        self.next_mr += 1;
        let desc = MrDesc {
            id,
            addr: mr.addr(),
            rkey: mr.rkey(),
            len: mr.len() as u64,
        };
        self.mrs.insert(id, PeerMr { mr: Some(mr), user });
        desc
    }

    fn handle(&mut self, req: Request) -> Result<Reply, String> {
        match req {
            Request::Setup { cq_size, caps } => {
                let cq = self.ctx.create_cq(cq_size).map_err(|e| e.to_string())?;
                let mut init = QpInitAttr::new(&cq);
                init.caps = caps;
                let qp = self.pd.create_qp(&init).map_err(|e| e.to_string())?;
                let ep = qp.endpoint();
                self.cq = Some(cq);
                self.qp = Some(qp);
                Ok(Reply::Endpoint(ep))
            }
            Request::Connect { remote, opts } => {
                drive_to_rts(self.qp()?, &remote, &opts).map_err(|e| e.to_string())?;
                Ok(Reply::Ok)
            }
            Request::Reset => {
                let qp = self.qp()?;
                qp.modify(&fabriq_verbs::QpAttr::reset())
                    .map_err(|e| e.to_string())?;
                Ok(Reply::Endpoint(qp.endpoint()))
            }
            Request::State => Ok(Reply::State(self.qp()?.state())),
            Request::RegMr {
                len,
                access,
                user_memory,
            } => {
                let (mr, user) = if user_memory {
                    let buf = UserBuf::new(len)?;
                    // SAFETY: `buf` is writable memory of this process of at least `len`
                    // bytes; it is stored next to the region and dropped after it.
                    let mr = unsafe { self.pd.reg_mr(buf.ptr, len, access) }
                        .map_err(|e| e.to_string())?;
                    (mr, Some(buf))
                } else {
                    (
                        self.pd.alloc_mr(len, access).map_err(|e| e.to_string())?,
                        None,
                    )
                };
                Ok(Reply::Mr(self.keep(mr, user)))
            }
            Request::RegMrOtherPd { len, access } => {
                if self.other_pd.is_none() {
                    self.other_pd = Some(self.ctx.alloc_pd().map_err(|e| e.to_string())?);
                }
                let pd = self.other_pd.as_ref().ok_or("no second PD")?;
                let mr = pd.alloc_mr(len, access).map_err(|e| e.to_string())?;
                Ok(Reply::Mr(self.keep(mr, None)))
            }
            Request::DeregMr { id } => {
                let m = self
                    .mrs
                    .get_mut(&id)
                    .ok_or_else(|| format!("no region {id}"))?;
                let mr = m.mr.take().ok_or("already deregistered")?;
                mr.deregister();
                if m.user.is_none() {
                    self.mrs.remove(&id);
                }
                Ok(Reply::Ok)
            }
            Request::ReadMr { id, offset, len } => {
                let m = self.mr(id)?;
                let mut out = vec![0u8; len];
                match (&m.mr, &m.user) {
                    (Some(mr), _) => mr.read_at(offset, &mut out).map_err(|e| e.to_string())?,
                    (None, Some(buf)) => buf.read(offset, &mut out)?,
                    (None, None) => return Err(format!("region {id} was deregistered")),
                }
                Ok(Reply::Bytes(to_hex(&out)))
            }
            Request::FillPattern { id, seed } => {
                let mr = self.live_mr(id)?;
                mr.write_at(0, &crate::harness::pattern(seed, mr.len()))
                    .map_err(|e| e.to_string())?;
                Ok(Reply::Ok)
            }
            Request::WaitFlagThenDigest {
                flag_mr,
                flag_offset,
                value,
                data_mr,
                offset,
                len,
            } => {
                let mut backoff = Backoff::new(TIMEOUT);
                loop {
                    let flag = self
                        .live_mr(flag_mr)?
                        .atomic_u64(flag_offset)
                        .map_err(|e| e.to_string())?
                        .load(std::sync::atomic::Ordering::Acquire);
                    if flag == value {
                        break;
                    }
                    if self.pump() == 0 && !backoff.snooze() {
                        return Err(format!("flag never became {value} (last {flag})"));
                    }
                }
                let mut out = vec![0u8; len];
                self.live_mr(data_mr)?
                    .read_at(offset, &mut out)
                    .map_err(|e| e.to_string())?;
                Ok(Reply::Digest(fnv1a(&out)))
            }
            Request::Digest { id, offset, len } => {
                let mut out = vec![0u8; len];
                self.live_mr(id)?
                    .read_at(offset, &mut out)
                    .map_err(|e| e.to_string())?;
                Ok(Reply::Digest(fnv1a(&out)))
            }
            Request::WriteMr { id, offset, hex } => {
                let data = from_hex(&hex)?;
                self.live_mr(id)?
                    .write_at(offset, &data)
                    .map_err(|e| e.to_string())?;
                Ok(Reply::Ok)
            }
            Request::PostRecv { wr_id, sges } => {
                let list = sges
                    .iter()
                    .map(|s| self.sge(s))
                    .collect::<Result<Vec<_>, _>>()?;
                self.qp()?
                    .post_recv(&[RecvWr::new(wr_id, &list)])
                    .map_err(|e| e.to_string())?;
                Ok(Reply::Ok)
            }
            Request::PostSend { wrs } => {
                let lists = wrs
                    .iter()
                    .map(|w| {
                        w.sges
                            .iter()
                            .map(|s| self.sge(s))
                            .collect::<Result<Vec<_>, _>>()
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let batch: Vec<SendWr<'_>> = wrs
                    .iter()
                    .zip(&lists)
                    .map(|(w, list)| {
                        let opcode = match w.op {
                            PeerOp::Send => WrOpcode::Send,
                            PeerOp::SendImm(imm) => WrOpcode::SendWithImm { imm },
                            PeerOp::Write(remote) => WrOpcode::Write { remote },
                            PeerOp::WriteImm(remote, imm) => WrOpcode::WriteWithImm { remote, imm },
                            PeerOp::Read(remote) => WrOpcode::Read { remote },
                        };
                        SendWr::new(w.wr_id, list, opcode)
                            .with_flags(SendFlags::from_bits_truncate(w.flags))
                    })
                    .collect();
                self.qp()?.post_send(&batch).map_err(|e| e.to_string())?;
                Ok(Reply::Ok)
            }
            Request::Poll { count, timeout_ms } => {
                let mut backoff = Backoff::new(Duration::from_millis(timeout_ms));
                loop {
                    self.pump();
                    if self.stash.len() >= count || self.cq_error.is_some() || !backoff.snooze() {
                        break;
                    }
                }
                if let Some(e) = &self.cq_error {
                    return Err(format!("poll_cq: {e}"));
                }
                let n = count.min(self.stash.len());
                Ok(Reply::Completions(
                    self.stash.drain(..n).map(|wc| PeerWc::from(&wc)).collect(),
                ))
            }
            Request::FetchAddLoop {
                remote,
                count,
                batch,
                range,
            } => self.fetch_add_loop(remote, count, batch, range),
            Request::SendStream { count, window } => self.send_stream(count, window),
            Request::CasLockLoop {
                lock,
                counter,
                iterations,
                id,
            } => self.cas_lock_loop(lock, counter, iterations, id),
            Request::DestroyQp => {
                self.qp.take().ok_or("no QP to destroy")?;
                Ok(Reply::Ok)
            }
            Request::Exit => Ok(Reply::Ok),
        }
    }

    fn fetch_add_loop(
        &mut self,
        remote: RemoteAddr,
        count: u64,
        batch: u32,
        range: u64,
    ) -> Result<Reply, String> {
        const WINDOW: u64 = 2;
        let batch = u64::from(batch.max(1));
        let results = self
            .pd
            .alloc_mr((WINDOW * batch * 8) as usize, AccessFlags::LOCAL_WRITE)
            .map_err(|e| e.to_string())?;
        let qp = self.qp()?.clone();
        let mut bitmap = vec![0u8; range.div_ceil(8) as usize];
        let (mut duplicates, mut out_of_range, mut non_monotonic) = (0u64, 0u64, 0u64);
        let mut last: Option<u64> = None;
        let batches = count.div_ceil(batch);
        let size_of = |b: u64| batch.min(count - b * batch);
        let post = |b: u64| -> Result<(), String> {
            let n = size_of(b);
            let slot = (b % WINDOW) * batch;
            let sges: Vec<[Sge; 1]> = (0..n)
                .map(|i| results.sge(((slot + i) * 8) as usize, 8).map(|s| [s]))
                .collect::<Result<_, _>>()
                .map_err(|e| e.to_string())?;
            let wrs: Vec<SendWr<'_>> = sges
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let flags = if i as u64 + 1 == n {
                        SendFlags::SIGNALED
                    } else {
                        SendFlags::empty()
                    };
                    SendWr::new(b, s, WrOpcode::AtomicFetchAdd { remote, add: 1 }).with_flags(flags)
                })
                .collect();
            qp.post_send(&wrs)
                .map_err(|e| format!("post FETCH_AND_ADD batch {b}: {e}"))
        };
        let mut posted = 0;
        while posted < batches.min(WINDOW) {
            post(posted)?;
            posted += 1;
        }
        for b in 0..batches {
            let wc = self.next_wc()?;
            if wc.wr_id != b || wc.status != WcStatus::Success {
                return Err(format!(
                    "FETCH_AND_ADD batch {b}: unexpected completion {wc:?}"
                ));
            }
            let slot = (b % WINDOW) * batch;
            for i in 0..size_of(b) {
                let mut v = [0u8; 8];
                results
                    .read_at(((slot + i) * 8) as usize, &mut v)
                    .map_err(|e| e.to_string())?;
                let v = u64::from_ne_bytes(v);
                if last.is_some_and(|l| v <= l) {
                    non_monotonic += 1;
                }
                last = Some(v);
                if v >= range {
                    out_of_range += 1;
                    continue;
                }
                let (byte, bit) = ((v / 8) as usize, 1u8 << (v % 8));
                if bitmap[byte] & bit != 0 {
                    duplicates += 1;
                }
                bitmap[byte] |= bit;
            }
            if posted < batches {
                post(posted)?;
                posted += 1;
            }
        }
        Ok(Reply::FetchAdd {
            bitmap: to_hex(&bitmap),
            duplicates,
            out_of_range,
            non_monotonic,
        })
    }

    fn send_stream(&mut self, count: u32, window: u32) -> Result<Reply, String> {
        let window = window.max(1);
        let src = self
            .pd
            .alloc_mr(window as usize * STREAM_MAX, AccessFlags::LOCAL_WRITE)
            .map_err(|e| e.to_string())?;
        let qp = self.qp()?.clone();
        let post = |i: u32| -> Result<(), String> {
            let msg = stream_message(i);
            let off = (i % window) as usize * STREAM_MAX;
            src.write_at(off, &msg).map_err(|e| e.to_string())?;
            let s = [src.sge(off, msg.len() as u32).map_err(|e| e.to_string())?];
            qp.post_send(&[SendWr::new(u64::from(i), &s, WrOpcode::Send)])
                .map_err(|e| format!("post SEND {i}: {e}"))
        };
        let mut posted = 0;
        while posted < count.min(window) {
            post(posted)?;
            posted += 1;
        }
        for i in 0..count {
            let wc = self.next_wc()?;
            if wc.wr_id != u64::from(i) || wc.status != WcStatus::Success {
                return Err(format!("stream SEND {i}: unexpected completion {wc:?}"));
            }
            if posted < count {
                post(posted)?;
                posted += 1;
            }
        }
        Ok(Reply::Ok)
    }

    fn cas_lock_loop(
        &mut self,
        lock: RemoteAddr,
        counter: RemoteAddr,
        iterations: u32,
        id: u64,
    ) -> Result<Reply, String> {
        let scratch = self
            .pd
            .alloc_mr(64, AccessFlags::LOCAL_WRITE)
            .map_err(|e| e.to_string())?;
        let qp = self.qp()?.clone();
        let s = |off: usize| scratch.sge(off, 8).map_err(|e| e.to_string());
        let (acq, val, rel) = ([s(0)?], [s(8)?], [s(16)?]);
        let load = |off: usize| -> Result<u64, String> {
            let mut v = [0u8; 8];
            scratch.read_at(off, &mut v).map_err(|e| e.to_string())?;
            Ok(u64::from_ne_bytes(v))
        };
        let mut contended = 0u64;
        for it in 0..iterations {
            loop {
                let wr = SendWr::new(
                    1,
                    &acq,
                    WrOpcode::AtomicCmpSwp {
                        remote: lock,
                        compare: 0,
                        swap: id,
                    },
                );
                qp.post_send(&[wr]).map_err(|e| format!("post CAS: {e}"))?;
                let wc = self.next_wc()?;
                if wc.wr_id != 1 || wc.status != WcStatus::Success {
                    return Err(format!("acquire {it}: unexpected completion {wc:?}"));
                }
                if load(0)? == 0 {
                    break;
                }
                contended += 1;
                if contended % 16 == 0 {
                    std::thread::yield_now();
                }
            }
            qp.post_send(&[SendWr::new(2, &val, WrOpcode::Read { remote: counter })])
                .map_err(|e| format!("post READ: {e}"))?;
            let wc = self.next_wc()?;
            if wc.wr_id != 2 || wc.status != WcStatus::Success {
                return Err(format!("read counter {it}: unexpected completion {wc:?}"));
            }
            let next = load(8)?.wrapping_add(1);
            scratch
                .write_at(8, &next.to_ne_bytes())
                .map_err(|e| e.to_string())?;
            let wrs = [
                SendWr::new(3, &val, WrOpcode::Write { remote: counter })
                    .with_flags(SendFlags::empty()),
                SendWr::new(
                    4,
                    &rel,
                    WrOpcode::AtomicCmpSwp {
                        remote: lock,
                        compare: id,
                        swap: 0,
                    },
                ),
            ];
            qp.post_send(&wrs)
                .map_err(|e| format!("post WRITE+release: {e}"))?;
            let wc = self.next_wc()?;
            if wc.wr_id != 4 || wc.status != WcStatus::Success {
                return Err(format!(
                    "write + release {it}: unexpected completion {wc:?}"
                ));
            }
            let owner = load(16)?;
            if owner != id {
                return Err(format!(
                    "release {it}: the lock word held {owner}, not our id {id}: mutual exclusion broken"
                ));
            }
        }
        Ok(Reply::CasLock { contended })
    }
}

/// A [`Node`] of this process connected to a fresh peer process, default parameters.
pub fn connected<P: TestProvider>(
    env: &Env<P>,
    node: &crate::harness::NodeOpts,
    setup: PeerSetup,
) -> Result<(Node, Peer), Box<dyn std::error::Error>> {
    connected_with(
        env,
        node,
        setup,
        &ConnectOpts::default(),
        &ConnectOpts::default(),
    )
}

/// A [`Node`] of this process connected to a fresh peer process.
pub fn connected_with<P: TestProvider>(
    env: &Env<P>,
    node: &crate::harness::NodeOpts,
    setup: PeerSetup,
    local: &ConnectOpts,
    remote: &ConnectOpts,
) -> Result<(Node, Peer), Box<dyn std::error::Error>> {
    let n = env.node(node)?;
    let mut p = Peer::spawn(env, setup)?;
    p.connect(&n, local, remote)?;
    Ok((n, p))
}
