//! One-sided remote memory. The owner exposes a registered region ([`ExposedRegion`]) and hands
//! its [`RegionDescriptor`] to a peer (in a message, an RPC reply, a file); the peer wraps it in
//! a [`RemoteRegion`] and does RDMA `write`, `read`, `compare_and_swap` and `fetch_and_add` on it
//! through the channel's queue pair. No handler and no thread of the owner runs for these
//! operations. [`CasLock`] is a distributed spin lock built on compare-and-swap.
//!
//! Access outside the region or without the right is refused by the owner's provider: the
//! operation completes with `RemoteAccess` (which, as on any RC QP, also breaks the channel).
//! An operation the connection's end flushed or left unanswered (the owner's process gone)
//! ends as the channel does: with `PeerGone`, or the connection's failure where it is known.
//!
//! Every operation has a deadline ([`RemoteRegion::timeout`]: `Config::remote_timeout_ms`
//! unless set with [`RemoteRegion::with_timeout`]); one not complete by then ends with
//! `Timeout`, and its outcome is unknown — it may still take effect at the owner (a verbs QP
//! whose retries run out says as much). The channel goes on; a late completion is dropped.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use fabriq_verbs::{MemoryRegion, RemoteAddr, Rkey};
use tokio::sync::oneshot;

use crate::channel::ChannelError;
use crate::mempool::PoolBuf;
use crate::message::SendBuf;
use crate::worker::async_wait;
use crate::worker::reply::{self, ReplyTo};
use crate::worker::{
    direct_or_submit, now, wait_reply, Buffers, Command, OneSidedDone, OneSidedOp, OneSidedReply,
    Waited,
};
use crate::Channel;

/// What a peer needs to reach an exposed region: 24 bytes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RegionDescriptor {
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RegionDescriptor {
    /// Encoded length.
    pub const LEN: usize = 20;

    /// Encode (little endian: addr, len, rkey).
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..20].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    /// Decode; `None` unless exactly [`RegionDescriptor::LEN`] bytes.
    pub fn from_bytes(b: &[u8]) -> Option<RegionDescriptor> {
        if b.len() != Self::LEN {
            return None;
        }
        let mut a = [0u8; 8];
        let mut l = [0u8; 8];
        let mut k = [0u8; 4];
        a.copy_from_slice(b.get(..8)?);
        l.copy_from_slice(b.get(8..16)?);
        k.copy_from_slice(b.get(16..20)?);
        Some(RegionDescriptor {
            addr: u64::from_le_bytes(a),
            len: u64::from_le_bytes(l),
            rkey: u32::from_le_bytes(k),
        })
    }
}

/// A region of this process exposed to peers for one-sided access (read, write, atomics).
/// Registered on every device of its endpoint: peers on any of them reach the same bytes.
#[derive(Debug)]
pub struct ExposedRegion {
    // Registrations of the same memory on the endpoint's other devices; dropped (deregistered)
    // before `mr`, which owns the memory.
    others: Vec<(usize, MemoryRegion)>,
    mr: MemoryRegion,
    /// The protection domain of `mr` (see `domain_of`).
    domain: usize,
}

/// Identity of a protection domain, as channels report theirs.
pub(crate) fn domain_of(pd: &fabriq_verbs::ProtectionDomain) -> usize {
    std::sync::Arc::as_ptr(pd.ops()) as *const () as usize
}

impl ExposedRegion {
    pub(crate) fn new(mr: MemoryRegion, pd: &fabriq_verbs::ProtectionDomain) -> ExposedRegion {
        ExposedRegion {
            others: Vec::new(),
            mr,
            domain: domain_of(pd),
        }
    }

    /// Register the region's memory on another device's protection domain as well.
    pub(crate) fn register_on(
        &mut self,
        pd: &fabriq_verbs::ProtectionDomain,
        access: fabriq_verbs::AccessFlags,
    ) -> Result<(), ChannelError> {
        // SAFETY: the memory is `self.mr`'s, which this region owns and drops only after
        // `others` (field order), so it outlives the registration; peers may write it, which
        // is what registered memory is for (every access in this crate goes through the
        // verbs layer's bounds-checked copies and atomics).
        #[allow(unsafe_code)]
        let mr = unsafe { pd.reg_mr(self.mr.as_ptr(), self.mr.len(), access) }?;
        self.others.push((domain_of(pd), mr));
        Ok(())
    }

    fn descriptor_of(mr: &MemoryRegion) -> RegionDescriptor {
        RegionDescriptor {
            addr: mr.addr(),
            len: mr.len() as u64,
            rkey: mr.rkey().0,
        }
    }

    /// The descriptor to give peers on the endpoint's (primary) device. With several devices
    /// (`auto`), use [`ExposedRegion::descriptor_for`].
    pub fn descriptor(&self) -> RegionDescriptor {
        Self::descriptor_of(&self.mr)
    }

    /// The descriptor to give the peer of `channel`: the key of the registration on the
    /// device that channel runs on.
    pub fn descriptor_for(&self, channel: &Channel) -> RegionDescriptor {
        let domain = channel.domain();
        std::iter::once((self.domain, &self.mr))
            .chain(self.others.iter().map(|(d, mr)| (*d, mr)))
            .find(|(d, _)| Some(*d) == domain)
            .map_or_else(|| self.descriptor(), |(_, mr)| Self::descriptor_of(mr))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mr.len()
    }

    /// True for an empty region.
    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }

    /// Copy bytes out (peers may be writing concurrently, as with any RDMA memory).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), ChannelError> {
        Ok(self.mr.read_at(offset, dst)?)
    }

    /// Copy bytes in.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), ChannelError> {
        Ok(self.mr.write_at(offset, src)?)
    }

    /// The aligned 64-bit word at `offset`, shared with peers' atomics.
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64, ChannelError> {
        Ok(self.mr.atomic_u64(offset)?)
    }
}

/// A peer's exposed region, reached through a channel.
#[derive(Debug, Clone)]
pub struct RemoteRegion {
    channel: Channel,
    desc: RegionDescriptor,
    timeout: Duration,
}

impl RemoteRegion {
    pub(crate) fn new(channel: Channel, desc: RegionDescriptor) -> RemoteRegion {
        let timeout = channel.endpoint().config().remote_timeout();
        RemoteRegion {
            channel,
            desc,
            timeout,
        }
    }

    /// The same region with another deadline for each operation (from its start; a sync
    /// operation made by an RPC handler ends at the handler's own bound if that comes first).
    pub fn with_timeout(mut self, timeout: Duration) -> RemoteRegion {
        self.timeout = timeout;
        self
    }

    /// How long an operation may take before it ends with [`ChannelError::Timeout`].
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The descriptor.
    pub fn descriptor(&self) -> RegionDescriptor {
        self.desc
    }

    fn remote(&self, offset: u64, len: u64, align: u64) -> Result<RemoteAddr, ChannelError> {
        let end = offset.checked_add(len);
        if end.map_or(true, |e| e > self.desc.len) {
            return Err(ChannelError::OutOfBounds {
                offset,
                len,
                region_len: self.desc.len,
            });
        }
        let addr = self.desc.addr.wrapping_add(offset);
        if addr % align != 0 {
            return Err(ChannelError::OutOfBounds {
                offset,
                len,
                region_len: self.desc.len,
            });
        }
        Ok(RemoteAddr {
            addr,
            rkey: Rkey(self.desc.rkey),
        })
    }

    /// Hand `op` to the worker, its result to go to `reply`.
    fn submit(&self, op: OneSidedOp, reply: OneSidedReply) {
        let s = self.channel.shared();
        let chan = s.id;
        let deadline = now().saturating_add(self.timeout);
        direct_or_submit(
            &s.worker,
            (op, reply),
            |g, (op, reply)| g.enqueue_one_sided(chan, op, reply, deadline),
            |(op, reply)| Command::OneSided {
                chan,
                op,
                reply,
                deadline,
            },
        );
    }

    /// Submit `op` and wait for its result.
    fn run(&self, op: OneSidedOp) -> Result<OneSidedDone, ChannelError> {
        let w = &self.channel.shared().worker;
        if w.held_here() {
            // A handler of this worker: the operation would be posted, and its completion
            // read, only after the handler returned. Nothing is posted.
            return Err(ChannelError::WouldDeadlock);
        }
        // The worker keeps the deadline, except for a handler's wait: the worker may be held
        // by another handler waiting for this one (see `wait_call`).
        let deadline = w.handler_deadline().map(|d| {
            std::time::Instant::now()
                .checked_add(self.timeout)
                .map_or(d, |t| d.min(t))
        });
        let (tx, rx) = reply::slot();
        self.submit(op, tx);
        match wait_reply(w, rx, deadline) {
            Waited::Got(r) => r,
            Waited::Closed => Err(ChannelError::Closed),
            Waited::Expired => Err(ChannelError::Timeout),
        }
    }

    /// [`RegionDescriptor`]'s bounds and the `u32` length of one work request.
    fn remote_span(&self, offset: u64, len: usize) -> Result<RemoteAddr, ChannelError> {
        let remote = self.remote(offset, len as u64, 1)?;
        u32::try_from(len).map_err(|_| ChannelError::MessageTooLarge {
            len: len as u64,
            max: u64::from(u32::MAX),
        })?;
        Ok(remote)
    }

    /// The worker's buffers, which the local side of an operation must be registered with.
    fn buffers(&self) -> Result<&Arc<Buffers>, ChannelError> {
        self.channel
            .shared()
            .worker
            .buffers()
            .ok_or(ChannelError::Closed)
    }

    /// A buffer the worker handed back, once read: a large one is kept for the worker's next
    /// (its registration reused), a pool one goes back to its pool.
    fn give_back(&self, buf: PoolBuf) {
        if buf.is_large() {
            if let Ok(b) = self.buffers() {
                b.returned().push(buf);
            }
        }
    }

    /// The bytes a read returned.
    fn bytes(&self, done: OneSidedDone) -> Vec<u8> {
        match done {
            OneSidedDone::Bytes(v) => v,
            OneSidedDone::Buf(b) => {
                let v = b.to_vec();
                self.give_back(b);
                v
            }
        }
    }

    /// The original word an atomic returned.
    fn word(&self, done: OneSidedDone) -> Result<u64, ChannelError> {
        let word = |s: &[u8]| {
            s.get(..8)
                .and_then(|s| <[u8; 8]>::try_from(s).ok())
                .map(u64::from_ne_bytes)
        };
        let w = match done {
            OneSidedDone::Buf(b) => {
                let w = word(&b);
                self.give_back(b);
                w
            }
            OneSidedDone::Bytes(v) => word(&v),
        };
        w.ok_or_else(|| ChannelError::Failed("atomic returned no word".into()))
    }

    /// The caller's buffer, back from a `write_buf` or `read_buf`.
    fn returned(&self, done: OneSidedDone) -> Result<SendBuf, ChannelError> {
        match done {
            OneSidedDone::Buf(b) => self.send_buf(b),
            OneSidedDone::Bytes(_) => Err(ChannelError::Failed(
                "a one-sided operation returned bytes, not the buffer it was given".into(),
            )),
        }
    }

    /// A write's buffer, done with.
    fn written(&self, done: OneSidedDone) {
        if let OneSidedDone::Buf(b) = done {
            self.give_back(b);
        }
    }

    /// `data` copied once, into a registered buffer of the calling thread's pool.
    fn write_op(&self, offset: u64, data: &[u8]) -> Result<OneSidedOp, ChannelError> {
        let remote = self.remote_span(offset, data.len())?;
        let mut buf = self.buffers()?.alloc(data.len().max(1))?;
        buf.set_len(data.len());
        buf.copy_from_slice(data);
        Ok(OneSidedOp::Write { remote, buf })
    }

    /// A buffer of [`Channel::alloc`] as the local side of an operation on `offset`.
    fn own_buf(&self, offset: u64, buf: SendBuf) -> Result<(RemoteAddr, PoolBuf), ChannelError> {
        if self.buffers()?.domain() != buf.domain {
            return Err(ChannelError::NotRegistered);
        }
        let remote = self.remote_span(offset, buf.len())?;
        Ok((remote, buf.buf))
    }

    fn send_buf(&self, buf: PoolBuf) -> Result<SendBuf, ChannelError> {
        Ok(SendBuf {
            buf,
            domain: self.buffers()?.domain(),
        })
    }

    fn read_op(&self, offset: u64, len: u32) -> Result<OneSidedOp, ChannelError> {
        let remote = self.remote(offset, u64::from(len), 1)?;
        Ok(OneSidedOp::Read {
            remote,
            len,
            into: None,
        })
    }

    fn read_buf_op(&self, offset: u64, buf: SendBuf) -> Result<OneSidedOp, ChannelError> {
        let (remote, buf) = self.own_buf(offset, buf)?;
        Ok(OneSidedOp::Read {
            remote,
            len: buf.len() as u32,
            into: Some(buf),
        })
    }

    fn write_buf_op(&self, offset: u64, buf: SendBuf) -> Result<OneSidedOp, ChannelError> {
        let (remote, buf) = self.own_buf(offset, buf)?;
        Ok(OneSidedOp::Write { remote, buf })
    }

    /// RDMA WRITE `data` at `offset` (copied once, into registered memory; see
    /// [`RemoteRegion::write_buf`] for none).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), ChannelError> {
        let op = self.write_op(offset, data)?;
        self.run(op).map(|d| self.written(d))
    }

    /// RDMA WRITE the bytes of `buf` (from [`Channel::alloc`] on any channel of this
    /// endpoint's device) at `offset`, without a copy; `buf` comes back for the next
    /// operation. [`ChannelError::NotRegistered`] for a buffer of another endpoint or device.
    /// Should the operation fail (or time out), the buffer is not returned: the device may
    /// still be reading it, and it goes back to its pool once the operation is over.
    pub fn write_buf(&self, offset: u64, buf: SendBuf) -> Result<SendBuf, ChannelError> {
        let op = self.write_buf_op(offset, buf)?;
        self.returned(self.run(op)?)
    }

    /// RDMA READ `len` bytes at `offset`.
    pub fn read(&self, offset: u64, len: u32) -> Result<Vec<u8>, ChannelError> {
        let op = self.read_op(offset, len)?;
        Ok(self.bytes(self.run(op)?))
    }

    /// RDMA READ `buf.len()` bytes at `offset` straight into `buf` (from [`Channel::alloc`],
    /// as for [`RemoteRegion::write_buf`]), and hand it back filled: no copy, no allocation.
    pub fn read_buf(&self, offset: u64, buf: SendBuf) -> Result<SendBuf, ChannelError> {
        let op = self.read_buf_op(offset, buf)?;
        self.returned(self.run(op)?)
    }

    /// Atomic compare-and-swap of the aligned word at `offset`; returns the value found (the
    /// swap happened if it equals `compare`).
    pub fn compare_and_swap(
        &self,
        offset: u64,
        compare: u64,
        swap: u64,
    ) -> Result<u64, ChannelError> {
        let remote = self.remote(offset, 8, 8)?;
        self.word(self.run(OneSidedOp::CompareSwap {
            remote,
            compare,
            swap,
        })?)
    }

    /// Atomic fetch-and-add on the aligned word at `offset`; returns the value before.
    pub fn fetch_and_add(&self, offset: u64, add: u64) -> Result<u64, ChannelError> {
        let remote = self.remote(offset, 8, 8)?;
        self.word(self.run(OneSidedOp::FetchAdd { remote, add })?)
    }

    /// Wait for an operation submitted from async code.
    async fn done(&self, op: OneSidedOp) -> Result<OneSidedDone, ChannelError> {
        let (tx, rx) = oneshot::channel();
        self.submit(op, ReplyTo::Task(tx));
        async_wait::answer(&self.channel.shared().worker, rx)
            .await
            .unwrap_or(Err(ChannelError::Closed))
    }

    /// [`RemoteRegion::write`] from async code.
    pub async fn write_async(&self, offset: u64, data: &[u8]) -> Result<(), ChannelError> {
        let op = self.write_op(offset, data)?;
        self.done(op).await.map(|d| self.written(d))
    }

    /// [`RemoteRegion::write_buf`] from async code.
    pub async fn write_buf_async(
        &self,
        offset: u64,
        buf: SendBuf,
    ) -> Result<SendBuf, ChannelError> {
        let op = self.write_buf_op(offset, buf)?;
        self.returned(self.done(op).await?)
    }

    /// [`RemoteRegion::read`] from async code.
    pub async fn read_async(&self, offset: u64, len: u32) -> Result<Vec<u8>, ChannelError> {
        let op = self.read_op(offset, len)?;
        Ok(self.bytes(self.done(op).await?))
    }

    /// [`RemoteRegion::read_buf`] from async code.
    pub async fn read_buf_async(&self, offset: u64, buf: SendBuf) -> Result<SendBuf, ChannelError> {
        let op = self.read_buf_op(offset, buf)?;
        self.returned(self.done(op).await?)
    }

    /// [`RemoteRegion::compare_and_swap`] from async code.
    pub async fn compare_and_swap_async(
        &self,
        offset: u64,
        compare: u64,
        swap: u64,
    ) -> Result<u64, ChannelError> {
        let remote = self.remote(offset, 8, 8)?;
        let op = OneSidedOp::CompareSwap {
            remote,
            compare,
            swap,
        };
        self.word(self.done(op).await?)
    }

    /// [`RemoteRegion::fetch_and_add`] from async code.
    pub async fn fetch_and_add_async(&self, offset: u64, add: u64) -> Result<u64, ChannelError> {
        let remote = self.remote(offset, 8, 8)?;
        self.word(self.done(OneSidedOp::FetchAdd { remote, add }).await?)
    }
}

/// A distributed spin lock on one 64-bit word of a remote region: 0 = free, otherwise the
/// holder's id. Acquire is compare-and-swap(0 → id) with bounded exponential back-off; release is
/// compare-and-swap(id → 0), which also detects a release by a non-holder.
#[derive(Debug, Clone)]
pub struct CasLock {
    region: RemoteRegion,
    offset: u64,
    id: u64,
}

impl CasLock {
    /// A lock on the word at `offset`, taken under `id` (non-zero, unique per contender).
    pub fn new(region: RemoteRegion, offset: u64, id: u64) -> Result<CasLock, ChannelError> {
        if id == 0 {
            return Err(ChannelError::InvalidConfig("lock id 0 means free".into()));
        }
        region.remote(offset, 8, 8)?;
        Ok(CasLock { region, offset, id })
    }

    /// The region the lock word lives in (for data protected by the lock).
    pub fn region(&self) -> &RemoteRegion {
        &self.region
    }

    /// Try once; true if acquired.
    pub fn try_lock(&self) -> Result<bool, ChannelError> {
        Ok(self.region.compare_and_swap(self.offset, 0, self.id)? == 0)
    }

    /// Spin until acquired; returns the attempts it took.
    pub fn lock(&self) -> Result<u64, ChannelError> {
        let mut attempts = 1;
        let mut backoff = 1u32;
        while !self.try_lock()? {
            attempts += 1;
            for _ in 0..backoff {
                std::hint::spin_loop();
            }
            if backoff >= 1024 {
                std::thread::yield_now();
            } else {
                backoff *= 2;
            }
        }
        Ok(attempts)
    }

    /// Release; errors if this id did not hold the lock.
    pub fn unlock(&self) -> Result<(), ChannelError> {
        let found = self.region.compare_and_swap(self.offset, self.id, 0)?;
        if found != self.id {
            return Err(ChannelError::Failed(format!(
                "unlock by {} but the lock word held {found}",
                self.id
            )));
        }
        Ok(())
    }

    /// Spin until acquired or `timeout` passes.
    pub fn lock_timeout(&self, timeout: Duration) -> Result<bool, ChannelError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if self.try_lock()? {
                return Ok(true);
            }
            if std::time::Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::yield_now();
        }
    }
}
