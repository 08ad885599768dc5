//! Work completions: what a [`crate::CompletionQueue`] hands back for each finished work request.

use crate::qp::QpNum;

/// Completion status, with the verbs names (`IBV_WC_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum WcStatus {
    /// The work request completed successfully.
    Success,
    /// A receive buffer was too small for the incoming message (`IBV_WC_LOC_LEN_ERR`).
    LocalLength,
    /// Local QP operation error (`IBV_WC_LOC_QP_OP_ERR`).
    LocalQpOperation,
    /// An SGE referenced memory outside its MR or with the wrong lkey/access (`IBV_WC_LOC_PROT_ERR`).
    LocalProtection,
    /// The request was flushed because the QP entered the error state (`IBV_WC_WR_FLUSH_ERR`).
    WrFlushed,
    /// Bad memory window bind (`IBV_WC_MW_BIND_ERR`).
    MemoryWindowBind,
    /// The remote side had a bad response (`IBV_WC_BAD_RESP_ERR`).
    BadResponse,
    /// Local access error (`IBV_WC_LOC_ACCESS_ERR`).
    LocalAccess,
    /// Invalid request at the responder (unsupported opcode, bad length, misaligned atomic)
    /// (`IBV_WC_REM_INV_REQ_ERR`).
    RemoteInvalidRequest,
    /// Remote access error: bad rkey, out of bounds, missing access flag (`IBV_WC_REM_ACCESS_ERR`).
    RemoteAccess,
    /// The responder could not complete the operation (`IBV_WC_REM_OP_ERR`).
    RemoteOperation,
    /// Transport retry counter exceeded: the peer did not answer (`IBV_WC_RETRY_EXC_ERR`).
    RetryExceeded,
    /// RNR retry counter exceeded: the peer had no receive posted (`IBV_WC_RNR_RETRY_EXC_ERR`).
    RnrRetryExceeded,
    /// Remote aborted (`IBV_WC_REM_ABORT_ERR`).
    RemoteAborted,
    /// Fatal error (`IBV_WC_FATAL_ERR`).
    Fatal,
    /// Any other status, with the provider's raw code.
    General(u32),
}

impl WcStatus {
    /// True for [`WcStatus::Success`].
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }
}

/// Which operation completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum WcOpcode {
    /// SEND or SEND_WITH_IMM.
    Send,
    /// RDMA_WRITE or RDMA_WRITE_WITH_IMM (initiator side).
    RdmaWrite,
    /// RDMA_READ.
    RdmaRead,
    /// ATOMIC_CMP_AND_SWP.
    CompSwap,
    /// ATOMIC_FETCH_AND_ADD.
    FetchAdd,
    /// A receive consumed by a SEND.
    Recv,
    /// A receive consumed by an RDMA_WRITE_WITH_IMM (payload went to the write target).
    RecvRdmaWithImm,
}

/// One completed work request (`struct ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The `wr_id` given when the request was posted.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed. For flushed receives this is [`WcOpcode::Recv`].
    pub opcode: WcOpcode,
    /// Bytes transferred (receives: bytes placed; READ: bytes read; atomics: 8).
    pub byte_len: u32,
    /// Immediate data carried by SEND_WITH_IMM / RDMA_WRITE_WITH_IMM, if any.
    pub imm_data: Option<u32>,
    /// The local QP the request belonged to.
    pub qp_num: QpNum,
    /// For receives: the sending QP.
    pub src_qp: QpNum,
    /// Provider-specific detail for errors (0 if none).
    pub vendor_err: u32,
}

impl WorkCompletion {
    /// A completion with zeroed fields, useful to size a `poll` buffer.
    pub const EMPTY: WorkCompletion = WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm_data: None,
        qp_num: QpNum(0),
        src_qp: QpNum(0),
        vendor_err: 0,
    };
}

impl Default for WorkCompletion {
    fn default() -> Self {
        Self::EMPTY
    }
}
