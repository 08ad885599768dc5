//! Work requests: scatter/gather elements, send-queue requests (`ibv_send_wr`) and receive-queue
//! requests (`ibv_recv_wr`).
//!
//! Addresses are plain `u64` virtual addresses as in verbs: an SGE names memory inside a
//! registered [`crate::MemoryRegion`] by (addr, length, lkey); a remote operation names the peer's
//! memory by (addr, rkey). Providers check every SGE against the MR table before touching memory.

use crate::mr::{Lkey, Rkey};

/// A scatter/gather element (`struct ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start virtual address, inside the MR named by `lkey`.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// The local key of the MR that holds this memory.
    pub lkey: Lkey,
}

/// Remote memory named by address and remote key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemoteAddr {
    /// Virtual address in the peer's registered region.
    pub addr: u64,
    /// The peer MR's remote key.
    pub rkey: Rkey,
}

/// The operation of a send-queue work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WrOpcode {
    /// Two-sided SEND: consumes one receive at the peer.
    Send,
    /// SEND carrying 32 bits of immediate data.
    SendWithImm {
        /// Immediate data delivered in the peer's receive completion.
        imm: u32,
    },
    /// One-sided RDMA WRITE of the SGE list into remote memory.
    Write {
        /// Destination.
        remote: RemoteAddr,
    },
    /// RDMA WRITE that also consumes a receive at the peer and delivers `imm`.
    WriteWithImm {
        /// Destination.
        remote: RemoteAddr,
        /// Immediate data delivered in the peer's receive completion.
        imm: u32,
    },
    /// One-sided RDMA READ of remote memory into the SGE list.
    Read {
        /// Source.
        remote: RemoteAddr,
    },
    /// 64-bit compare-and-swap on an 8-byte aligned remote word; the original value is written to
    /// the single 8-byte SGE.
    AtomicCmpSwp {
        /// The 8-byte aligned remote word.
        remote: RemoteAddr,
        /// Value expected.
        compare: u64,
        /// Value stored if the word equals `compare`.
        swap: u64,
    },
    /// 64-bit fetch-and-add on an 8-byte aligned remote word; the original value is written to
    /// the single 8-byte SGE.
    AtomicFetchAdd {
        /// The 8-byte aligned remote word.
        remote: RemoteAddr,
        /// Added (wrapping) to the word.
        add: u64,
    },
}

impl WrOpcode {
    /// The remote address this operation targets, if it is one-sided.
    pub fn remote(&self) -> Option<RemoteAddr> {
        match *self {
            WrOpcode::Send | WrOpcode::SendWithImm { .. } => None,
            WrOpcode::Write { remote }
            | WrOpcode::WriteWithImm { remote, .. }
            | WrOpcode::Read { remote }
            | WrOpcode::AtomicCmpSwp { remote, .. }
            | WrOpcode::AtomicFetchAdd { remote, .. } => Some(remote),
        }
    }

    /// True for the two atomics.
    pub fn is_atomic(&self) -> bool {
        matches!(
            self,
            WrOpcode::AtomicCmpSwp { .. } | WrOpcode::AtomicFetchAdd { .. }
        )
    }

    /// True for the opcodes that send a payload from the initiator (SEND and WRITE, with or
    /// without immediate): the only ones that may be INLINE.
    pub fn carries_payload(&self) -> bool {
        matches!(
            self,
            WrOpcode::Send
                | WrOpcode::SendWithImm { .. }
                | WrOpcode::Write { .. }
                | WrOpcode::WriteWithImm { .. }
        )
    }

    /// The completion opcode this request produces on the send CQ.
    pub fn wc_opcode(&self) -> crate::WcOpcode {
        use crate::WcOpcode;
        match self {
            WrOpcode::Send | WrOpcode::SendWithImm { .. } => WcOpcode::Send,
            WrOpcode::Write { .. } | WrOpcode::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            WrOpcode::Read { .. } => WcOpcode::RdmaRead,
            WrOpcode::AtomicCmpSwp { .. } => WcOpcode::CompSwap,
            WrOpcode::AtomicFetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }
}

bitflags::bitflags! {
    /// Flags of a send-queue work request (`IBV_SEND_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SendFlags: u32 {
        /// Generate a completion for this request even if the QP was created with
        /// `sq_sig_all = false`.
        const SIGNALED = 1 << 0;
        /// Copy the payload at post time; the SGEs' lkeys are not checked and the buffers may be
        /// reused as soon as `post_send` returns. Limited to `max_inline_data`. An SGE may name
        /// memory outside every registration: the provider then reads it through the kernel,
        /// and memory this process cannot read is a `LocalProtection` completion or a post
        /// error, never a fault.
        const INLINE = 1 << 1;
        /// Wait for earlier READs and atomics to complete before starting this one.
        const FENCE = 1 << 2;
        /// Ask the peer to raise a solicited event for this message.
        const SOLICITED = 1 << 3;
        /// Multi-path transports: apply this request at the target only after every earlier
        /// request of this QP is complete there (MP-RDMA's synchronise flag). Providers whose
        /// transport never reorders satisfy it trivially.
        const SYNCHRONISE = 1 << 4;
    }
}

/// A send-queue work request (`struct ibv_send_wr`), posted with
/// [`crate::QueuePair::post_send`].
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Local memory: gathered from for SEND/WRITE, scattered into for READ, one 8-byte SGE for
    /// the atomics' original value.
    pub sg_list: &'a [Sge],
    /// The operation.
    pub opcode: WrOpcode,
    /// Signaled, inline, fence, solicited, synchronise.
    pub flags: SendFlags,
    /// Bytes sent before the SGE list's, copied at post time from ordinary memory (no memory
    /// region): set by [`SendWr::with_inline_data`], which makes the request INLINE. Empty for
    /// none.
    pub inline_data: &'a [u8],
}

impl<'a> SendWr<'a> {
    /// A signaled request with the given id, SGEs and opcode.
    pub fn new(wr_id: u64, sg_list: &'a [Sge], opcode: WrOpcode) -> Self {
        SendWr {
            wr_id,
            sg_list,
            opcode,
            flags: SendFlags::SIGNALED,
            inline_data: &[],
        }
    }

    /// Send `data` ahead of the SGE list's bytes, copied at post time (a header built on the
    /// stack, say, with no memory region to write it into first): the request becomes INLINE,
    /// so the whole payload must fit `max_inline_data`. For SEND and WRITE (with or without
    /// immediate); other opcodes refuse it.
    pub fn with_inline_data(mut self, data: &'a [u8]) -> Self {
        self.inline_data = data;
        self.flags |= SendFlags::INLINE;
        self
    }

    /// Replace the flags (a request with inline data stays INLINE).
    pub fn with_flags(mut self, flags: SendFlags) -> Self {
        self.flags = flags;
        if !self.inline_data.is_empty() {
            self.flags |= SendFlags::INLINE;
        }
        self
    }

    /// True when the payload is copied at post time: INLINE, or inline data.
    pub fn is_inline(&self) -> bool {
        self.flags.contains(SendFlags::INLINE) || !self.inline_data.is_empty()
    }

    /// Total bytes of the payload: the inline data and the SGE list's.
    pub fn total_len(&self) -> u64 {
        self.inline_data.len() as u64
            + self
                .sg_list
                .iter()
                .map(|s| u64::from(s.length))
                .sum::<u64>()
    }
}

/// A receive-queue work request (`struct ibv_recv_wr`), posted with
/// [`crate::QueuePair::post_recv`] or [`crate::SharedReceiveQueue::post_recv`].
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND's payload is scattered, in order.
    pub sg_list: &'a [Sge],
}

impl<'a> RecvWr<'a> {
    /// A receive request.
    pub fn new(wr_id: u64, sg_list: &'a [Sge]) -> Self {
        RecvWr { wr_id, sg_list }
    }
}

/// Error of a batch post: the index of the first request that was not posted, and why.
/// Requests before `index` were posted and will complete.
#[derive(Debug, thiserror::Error)]
#[error("work request {index} of the batch was not posted: {source}")]
pub struct PostError {
    /// Index of the first rejected request in the batch.
    pub index: usize,
    /// The reason.
    #[source]
    pub source: crate::VerbsError,
}
