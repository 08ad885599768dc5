//! Reliable-connected queue pairs (`ibv_qp`, type RC): the state machine, creation and modify
//! attributes, the out-of-band endpoint description, and posting.
//!
//! State machine (InfiniBand spec, §10.3, as the kernel enforces it): RESET → INIT → RTR → RTS,
//! RTS ⇄ SQD, SQE → RTS, any → RESET, any but RESET → ERROR. Every transition goes through
//! [`QpState::check_transition`]; a provider never invents its own rules. Moving to ERROR flushes every outstanding work request with
//! [`crate::WcStatus::WrFlushed`]; every posted request ends in exactly one completion (unsignaled
//! successful sends excepted, as in verbs).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::provider::QpOps;
use crate::{
    AccessFlags, CompletionQueue, PostError, RecvWr, Result, SendWr, SharedReceiveQueue, VerbsError,
};

/// A queue pair number.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct QpNum(pub u32);

/// QP states (`ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum QpState {
    /// Freshly created or reset: nothing may be posted.
    Reset,
    /// Initialised: receives may be posted, nothing is processed.
    Init,
    /// Ready to receive: connected to the remote QP; incoming requests are served.
    #[doc(alias = "RTR")]
    Rtr,
    /// Ready to send.
    #[doc(alias = "RTS")]
    Rts,
    /// Send queue drained (`IBV_QPS_SQD`): new sends are queued but not started.
    #[doc(alias = "SQD")]
    Sqd,
    /// Send queue error (`IBV_QPS_SQE`).
    #[doc(alias = "SQE")]
    Sqe,
    /// Error: every outstanding and newly posted request completes with `WrFlushed`.
    #[doc(alias = "ERR")]
    Error,
}

impl QpState {
    /// Whether the RC state machine allows `self → to`.
    pub fn can_transition_to(self, to: QpState) -> bool {
        use QpState::*;
        // The kernel's table (ib_modify_qp_is_ok): every state may go to RESET; every state but
        // RESET may go to ERROR.
        matches!(
            (self, to),
            (_, Reset)
                | (Init | Rtr | Rts | Sqd | Sqe | Error, Error)
                | (Reset, Init)
                | (Init, Init)
                | (Init, Rtr)
                | (Rtr, Rts)
                | (Rts, Rts)
                | (Rts, Sqd)
                | (Sqd, Sqd)
                | (Sqd, Rts)
                | (Sqe, Rts)
        )
    }

    /// [`QpState::can_transition_to`] as a `Result`.
    pub fn check_transition(self, to: QpState) -> Result<()> {
        if self.can_transition_to(to) {
            Ok(())
        } else {
            Err(VerbsError::IllegalTransition { from: self, to })
        }
    }

    /// Whether `post_send` is accepted (RTS, SQD, SQE queue; ERROR accepts and flushes).
    pub fn accepts_send(self) -> bool {
        matches!(
            self,
            QpState::Rts | QpState::Sqd | QpState::Sqe | QpState::Error
        )
    }

    /// Whether `post_recv` is accepted (every state but RESET; ERROR accepts and flushes).
    pub fn accepts_recv(self) -> bool {
        self != QpState::Reset
    }
}

/// Work-queue sizes of a QP (`ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QpCaps {
    /// Max outstanding send requests.
    pub max_send_wr: u32,
    /// Max outstanding receive requests (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// Max SGEs per send request.
    pub max_send_sge: u32,
    /// Max SGEs per receive request.
    pub max_recv_sge: u32,
    /// Max inline payload per send request, bytes.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        }
    }
}

/// Creation attributes (`ibv_qp_init_attr`); the QP type is always RC.
#[derive(Debug, Clone)]
pub struct QpInitAttr<'a> {
    /// CQ for send completions.
    pub send_cq: &'a CompletionQueue,
    /// CQ for receive completions (may be the same as `send_cq`).
    pub recv_cq: &'a CompletionQueue,
    /// Draw receives from this SRQ instead of a private receive queue.
    pub srq: Option<&'a SharedReceiveQueue>,
    /// Queue sizes.
    pub caps: QpCaps,
    /// If true every send request is signaled; otherwise only those with `SIGNALED`.
    pub sq_sig_all: bool,
}

impl<'a> QpInitAttr<'a> {
    /// Default caps, one CQ for both queues, no SRQ, selective signaling.
    pub fn new(cq: &'a CompletionQueue) -> Self {
        QpInitAttr {
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            caps: QpCaps::default(),
            sq_sig_all: false,
        }
    }
}

/// Everything a peer needs to connect its QP to ours, exchanged out of band (the role of
/// `rdma_cm` private data or a TCP side channel). Serialisable; see [`crate::oob`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QpEndpoint {
    /// Provider (`shm`, `tcp`, `udp`, `rdma-core`); connecting across providers is refused.
    pub provider: String,
    /// Device name on the owning host.
    pub device: String,
    /// Where the provider reaches this QP (socket address, host/process id, ...).
    pub address: String,
    /// QP number.
    pub qp_num: QpNum,
    /// Initial packet sequence number of the QP's next connection (its RTS starts sending
    /// there, the peer's RTR expects it). Random, and drawn anew at every RESET on providers
    /// with sequence numbers on the wire (0 on shm, which has none): read the endpoint after
    /// RESET to reconnect a reused QP.
    pub psn: u32,
    /// InfiniBand LID (0 on Ethernet and software).
    pub lid: u16,
    /// GID (RoCE), zeros elsewhere.
    pub gid: [u8; 16],
    /// Path MTU, bytes.
    pub mtu: u32,
    /// Provider-specific extras.
    pub extra: BTreeMap<String, String>,
}

impl QpEndpoint {
    /// Largest encoded endpoint accepted from a peer.
    pub const MAX_ENCODED_LEN: usize = 4096;

    /// Encode for the wire.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decode an endpoint received from a peer; malformed or oversized input is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<QpEndpoint> {
        if bytes.len() > Self::MAX_ENCODED_LEN {
            return Err(VerbsError::Protocol(format!(
                "endpoint of {} bytes exceeds {}",
                bytes.len(),
                Self::MAX_ENCODED_LEN
            )));
        }
        serde_json::from_slice(bytes)
            .map_err(|e| VerbsError::Protocol(format!("malformed endpoint: {e}")))
    }
}

/// Attributes of a state transition (`ibv_modify_qp`): the target state plus the fields that
/// transition takes. Fields left `None` keep their value.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QpAttr {
    /// Target state (`None`: change attributes only, where the state allows).
    pub state: Option<QpState>,
    /// INIT: rights peers get on this QP (REMOTE_WRITE/READ/ATOMIC).
    pub access: Option<AccessFlags>,
    /// INIT: port number.
    pub port: Option<u8>,
    /// RTR: the remote QP to connect to.
    pub remote: Option<QpEndpoint>,
    /// RTR: expected receive PSN.
    pub rq_psn: Option<u32>,
    /// RTR: min RNR NAK timer code (verbs 5-bit encoding, see [`rnr_timer`]).
    pub min_rnr_timer: Option<u8>,
    /// RTR: max outstanding READ/atomic as target.
    pub max_dest_rd_atomic: Option<u8>,
    /// RTR: this QP reaches RTR before its peer, and the peer's RTR is given this QP's
    /// endpoint as read after this RTR ([`crate::QueuePair::endpoint`]) — a promise of the
    /// application, such as a connection manager that answers with the endpoint after its
    /// RTR (see [`QpAttr::before_peer`]). A provider may then settle at this RTR what would
    /// otherwise wait for both ends; one with nothing to settle ignores it. A peer whose
    /// endpoint says it was first too makes the RTR fail (`InvalidArgument`).
    pub rtr_before_peer: bool,
    /// RTS: send PSN.
    pub sq_psn: Option<u32>,
    /// RTS: local ACK timeout code: 4.096 µs × 2^timeout (0 = infinite), see [`ack_timeout`].
    pub timeout: Option<u8>,
    /// RTS: transport retries before `RetryExceeded` (0..=7).
    pub retry_cnt: Option<u8>,
    /// RTS: RNR retries before `RnrRetryExceeded` (0..=7, 7 = forever).
    pub rnr_retry: Option<u8>,
    /// RTS: max outstanding READ/atomic as initiator.
    pub max_rd_atomic: Option<u8>,
}

impl QpAttr {
    /// RESET → INIT with the given remote-access rights on port 1.
    pub fn init(access: AccessFlags) -> Self {
        QpAttr {
            state: Some(QpState::Init),
            access: Some(access),
            port: Some(1),
            ..Default::default()
        }
    }
    /// INIT → RTR towards `remote`.
    pub fn rtr(remote: QpEndpoint) -> Self {
        QpAttr {
            state: Some(QpState::Rtr),
            rq_psn: Some(remote.psn),
            remote: Some(remote),
            min_rnr_timer: Some(12),
            max_dest_rd_atomic: Some(16),
            ..Default::default()
        }
    }
    /// RTR, marked as reached before the peer's ([`QpAttr::rtr_before_peer`]). On `tcp0` the
    /// peer then opens the data connection, or takes the one kept from the pair's last use
    /// without a greeting on it.
    pub fn before_peer(mut self) -> Self {
        self.rtr_before_peer = true;
        self
    }
    /// RTR → RTS with common defaults (timeout 14 ≈ 67 ms, retry 6, rnr_retry 7 = forever).
    ///
    /// `retry_cnt` is 6, not the spec's maximum of 7: the kernel's soft-RoCE (rxe) treats 7 as
    /// "retry forever", which would hide a dead peer.
    pub fn rts() -> Self {
        QpAttr {
            state: Some(QpState::Rts),
            timeout: Some(14),
            retry_cnt: Some(6),
            rnr_retry: Some(7),
            max_rd_atomic: Some(16),
            ..Default::default()
        }
    }
    /// Any → ERROR.
    pub fn error() -> Self {
        QpAttr {
            state: Some(QpState::Error),
            ..Default::default()
        }
    }
    /// Any → RESET.
    pub fn reset() -> Self {
        QpAttr {
            state: Some(QpState::Reset),
            ..Default::default()
        }
    }
    /// Set the RNR retry count (builder style).
    pub fn with_rnr_retry(mut self, n: u8) -> Self {
        self.rnr_retry = Some(n);
        self
    }
    /// Set the min RNR timer code (builder style).
    pub fn with_min_rnr_timer(mut self, code: u8) -> Self {
        self.min_rnr_timer = Some(code);
        self
    }
    /// Set the ACK timeout code and retry count (builder style).
    pub fn with_timeout(mut self, timeout: u8, retry_cnt: u8) -> Self {
        self.timeout = Some(timeout);
        self.retry_cnt = Some(retry_cnt);
        self
    }
}

/// A snapshot of a QP's attributes (`ibv_query_qp`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpInfo {
    /// QP number.
    pub qp_num: QpNum,
    /// Current state.
    pub state: QpState,
    /// Queue sizes actually granted.
    pub caps: QpCaps,
    /// Remote-access rights.
    pub access: AccessFlags,
    /// RNR retry count in force.
    pub rnr_retry: u8,
    /// Min RNR timer code in force.
    pub min_rnr_timer: u8,
    /// ACK timeout code in force.
    pub timeout: u8,
    /// Retry count in force.
    pub retry_cnt: u8,
    /// The connected peer, once RTR.
    pub remote: Option<QpEndpoint>,
}

/// The RNR NAK timer for a verbs 5-bit code (IB spec table 45): 0 = 655.36 ms, 1 = 0.01 ms, …,
/// 31 = 491.52 ms.
pub fn rnr_timer(code: u8) -> Duration {
    const US_X100: [u32; 32] = [
        65536, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
        1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152,
    ];
    let v = US_X100[(code & 31) as usize];
    Duration::from_nanos(u64::from(v) * 10_000)
}

/// The local ACK timeout for a verbs timeout code: 4.096 µs × 2^code; `None` (infinite) for 0.
pub fn ack_timeout(code: u8) -> Option<Duration> {
    if code == 0 {
        return None;
    }
    Some(Duration::from_nanos(4096u64 << u32::from(code.min(31))))
}

/// A random 24-bit packet sequence number: a new QP's initial PSN.
pub(crate) fn random_psn() -> u32 {
    rand::random::<u32>() & 0x00ff_ffff
}

/// The initial PSN a QP takes at RESET: random, and differing from the one it had (`old`) in
/// its low 16 bits, so that its next connection cannot start where the previous one did, nor
/// carry the previous one's generation on the udp provider (those bits).
pub(crate) fn next_psn(old: u32) -> u32 {
    loop {
        let psn = random_psn();
        if psn & 0xffff != old & 0xffff {
            return psn;
        }
    }
}

/// An RC queue pair. Cheap to clone; clones are the same QP. Thread-safe like `ibv_qp`.
#[derive(Clone)]
pub struct QueuePair {
    pub(crate) ops: Arc<dyn QpOps>,
    qp_num: QpNum,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp_num)
            .field("state", &self.ops.state())
            .finish()
    }
}

impl QueuePair {
    /// Wrap a provider's QP. For provider implementations.
    pub fn from_ops(ops: Arc<dyn QpOps>) -> Self {
        let qp_num = ops.qp_num();
        QueuePair { ops, qp_num }
    }

    /// Provider-side object.
    pub fn ops(&self) -> &Arc<dyn QpOps> {
        &self.ops
    }

    /// QP number.
    pub fn qp_num(&self) -> QpNum {
        self.qp_num
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        self.ops.state()
    }

    /// Attributes (`ibv_query_qp`).
    pub fn query(&self) -> QpInfo {
        self.ops.query()
    }

    /// What a peer needs to connect to this QP. Read it after RESET to reconnect a reused QP;
    /// read after RTR, it may also carry what that RTR settled for the peer's (see
    /// [`QpAttr::rtr_before_peer`]).
    pub fn endpoint(&self) -> QpEndpoint {
        self.ops.endpoint()
    }

    /// Change state and/or attributes (`ibv_modify_qp`). Illegal transitions are refused with
    /// [`VerbsError::IllegalTransition`] and leave the QP unchanged.
    pub fn modify(&self, attr: &QpAttr) -> Result<()> {
        if let Some(to) = attr.state {
            self.ops.state().check_transition(to)?;
        }
        if let Some(remote) = &attr.remote {
            let mine = self.ops.provider();
            if remote.provider != mine {
                return Err(VerbsError::InvalidArgument(format!(
                    "cannot connect a {mine} QP to a {} QP",
                    remote.provider
                )));
            }
        }
        self.ops.modify(attr)
    }

    /// Drive RESET/INIT → INIT → RTR → RTS towards `remote`, granting `access` to the peer, with
    /// the default timers of [`QpAttr::rtr`] and [`QpAttr::rts`].
    pub fn connect(&self, remote: &QpEndpoint, access: AccessFlags) -> Result<()> {
        if self.state() == QpState::Reset {
            self.modify(&QpAttr::init(access))?;
        }
        self.modify(&QpAttr::rtr(remote.clone()))?;
        self.modify(&QpAttr::rts())
    }

    /// Post send-queue requests (`ibv_post_send`). On error, requests before
    /// [`PostError::index`] were posted.
    #[inline]
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        self.ops.post_send(wrs)
    }

    /// Post receive requests (`ibv_post_recv`).
    #[inline]
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        self.ops.post_recv(wrs)
    }
}
