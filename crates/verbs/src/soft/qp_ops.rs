//! The verbs [`QpOps`] of every software QP, written once over [`SoftQpDriver`]: what a
//! provider's QP does with its [`QpCore`] is the same everywhere (state, query, receives,
//! the INIT → RTR dispatch); the provider supplies the lock around the core, how it connects,
//! and how the core's output reaches the peer after a transition or a post.

use std::any::Any;

use super::qp::QpCore;
use crate::provider::QpOps;
use crate::{PostError, QpAttr, QpEndpoint, QpInfo, QpNum, QpState, RecvWr, Result, SendWr};

/// A provider's QP around a [`QpCore`].
pub(crate) trait SoftQpDriver: Send + Sync + 'static {
    /// The endpoint the QP advertises (its number included).
    fn advertised(&self) -> &QpEndpoint;
    /// The endpoint as a peer should get it now: [`SoftQpDriver::advertised`] with the core's
    /// current initial PSN (drawn anew at every RESET), plus what else the provider changes
    /// over the QP's life (the tcp provider: its incarnation).
    fn current_endpoint(&self) -> QpEndpoint {
        let mut ep = self.advertised().clone();
        ep.psn = self.with_core(|core| core.initial_psn());
        ep
    }
    /// Run `f` on the core under the QP's lock.
    fn with_core<R>(&self, f: impl FnOnce(&mut QpCore) -> R) -> R;
    /// INIT → RTR: check the remote endpoint, connect, and apply the transition.
    fn modify_rtr(&self, attr: &QpAttr) -> Result<()>;
    /// Any other transition: apply it to the core and react to its outcome.
    fn transition(&self, attr: &QpAttr) -> Result<()>;
    /// Hand send requests to the core and send what it allows.
    fn send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError>;
}

impl<T: SoftQpDriver> QpOps for T {
    fn qp_num(&self) -> QpNum {
        self.advertised().qp_num
    }

    fn state(&self) -> QpState {
        self.with_core(|core| core.state())
    }

    fn query(&self) -> QpInfo {
        self.with_core(|core| core.query())
    }

    fn endpoint(&self) -> QpEndpoint {
        self.current_endpoint()
    }

    fn provider(&self) -> std::borrow::Cow<'static, str> {
        self.advertised().provider.clone().into()
    }

    fn modify(&self, attr: &QpAttr) -> Result<()> {
        if attr.state == Some(QpState::Rtr) && self.state() == QpState::Init {
            return self.modify_rtr(attr);
        }
        self.transition(attr)
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        self.send(wrs)
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        self.with_core(|core| core.post_recv(wrs))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
