//! Request/response RPC over a [`Channel`]: `call(method, request, timeout)` on the client,
//! `serve(method, handler)` on the server. Requests and responses are channel messages tagged in
//! the trace header (`wire` has the 12-byte RPC header). Handlers run to completion on the worker
//! that received the request (in caller mode: the application thread that progressed it) and
//! their reply is sent inline from there — no thread hop on the server. A call is posted by the
//! calling thread when it gets the worker's lock (a direct send, as a channel's), and the caller
//! progresses the worker while it waits for the reply; the pass that gives it the reply ends
//! there, leaving the rest of its work to the next pass. Deadlines are kept by the caller's
//! worker (its timer wheel), so a call always ends: with the reply, [`RpcError::Timeout`],
//! [`RpcError::UnknownMethod`] or [`RpcError::PeerGone`].

pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::channel::ChannelError;
use crate::worker::{
    alloc_filled, direct_or_submit_settled, now, wait_call, Call, Command, Worker,
};
use crate::Channel;

/// A method handler: request body in, reply body out, or an error text for the caller. Runs on a
/// worker thread: it should not block for long (it holds up that worker's other channels).
pub type Handler = Arc<dyn Fn(&[u8]) -> Result<Vec<u8>, String> + Send + Sync + 'static>;

/// Where the reply of a submitted call arrives.
type ReplyRx = oneshot::Receiver<Result<Vec<u8>, RpcError>>;

/// Errors of an RPC call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// No reply before the deadline.
    #[error("RPC timed out")]
    Timeout,
    /// The server has no handler for the method.
    #[error("unknown RPC method ({0})")]
    UnknownMethod(String),
    /// The server's handler failed.
    #[error("RPC handler failed: {0}")]
    Handler(String),
    /// The peer went away before replying.
    #[error("RPC peer gone")]
    PeerGone,
    /// A request or reply could not be (de)serialised.
    #[error("RPC serialisation: {0}")]
    Serde(String),
    /// The channel failed.
    #[error(transparent)]
    Channel(#[from] ChannelError),
}

/// The client side of RPC over one channel. Cheap to clone; usable from many threads at once.
#[derive(Clone, Debug)]
pub struct Rpc {
    channel: Channel,
    default_timeout: Duration,
}

impl Rpc {
    /// RPC over `channel`, with the endpoint's default deadline.
    pub fn new(channel: Channel) -> Rpc {
        let default_timeout = channel.endpoint().config().rpc_timeout();
        Rpc {
            channel,
            default_timeout,
        }
    }

    /// The channel underneath.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Register a handler for `method` on this side's endpoint (requests arriving on any of its
    /// channels are served).
    pub fn serve<F>(&self, method: &str, handler: F)
    where
        F: Fn(&[u8]) -> Result<Vec<u8>, String> + Send + Sync + 'static,
    {
        self.channel.endpoint().serve(method, handler);
    }

    fn submit(
        &self,
        method: &str,
        request: &[u8],
        timeout: Duration,
    ) -> Result<(u64, ReplyRx), RpcError> {
        let shared = self.channel.shared();
        if let Some(f) = shared.failure() {
            return Err(match f.to_error() {
                ChannelError::PeerGone => RpcError::PeerGone,
                e => RpcError::Channel(e),
            });
        }
        let w = &shared.worker;
        let call_id = w.next_call_id();
        let head = wire::encode_request_header(call_id, wire::method_id(method));
        let buffers = w.buffers().ok_or(RpcError::PeerGone)?;
        let buf = alloc_filled(buffers, &[&head, request])
            .map_err(|e| RpcError::Channel(ChannelError::Pool(e)))?;
        let (tx, rx) = oneshot::channel();
        let call = Call {
            chan: shared.id,
            call_id,
            buf,
            deadline: now().saturating_add(timeout),
            reply: tx,
        };
        direct_or_submit_settled(w, call, Worker::enqueue_call, |c| {
            Command::Call(Box::new(c))
        });
        Ok((call_id, rx))
    }

    /// Call `method` and wait for the reply, at most `timeout`. Blocking: from async code use
    /// [`Rpc::call_async`].
    pub fn call(
        &self,
        method: &str,
        request: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, RpcError> {
        let (call_id, rx) = self.submit(method, request, timeout)?;
        wait_call(&self.channel.shared().worker, rx, call_id).unwrap_or(Err(RpcError::PeerGone))
    }

    /// [`Rpc::call`] with the endpoint's default deadline.
    pub fn call_default(&self, method: &str, request: &[u8]) -> Result<Vec<u8>, RpcError> {
        self.call(method, request, self.default_timeout)
    }

    /// Call from async code.
    pub async fn call_async(
        &self,
        method: &str,
        request: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, RpcError> {
        let (_, rx) = self.submit(method, request, timeout)?;
        rx.await.unwrap_or(Err(RpcError::PeerGone))
    }

    /// Call with JSON-serialised request and reply.
    pub fn call_json<Req, Resp>(
        &self,
        method: &str,
        request: &Req,
        timeout: Duration,
    ) -> Result<Resp, RpcError>
    where
        Req: serde::Serialize,
        Resp: serde::de::DeserializeOwned,
    {
        let body = serde_json::to_vec(request).map_err(|e| RpcError::Serde(e.to_string()))?;
        let reply = self.call(method, &body, timeout)?;
        serde_json::from_slice(&reply).map_err(|e| RpcError::Serde(e.to_string()))
    }
}

/// Wrap a typed JSON handler as a byte handler.
pub fn json_handler<Req, Resp, F>(
    f: F,
) -> impl Fn(&[u8]) -> Result<Vec<u8>, String> + Send + Sync + 'static
where
    Req: serde::de::DeserializeOwned,
    Resp: serde::Serialize,
    F: Fn(Req) -> Result<Resp, String> + Send + Sync + 'static,
{
    move |body: &[u8]| {
        let req: Req = serde_json::from_slice(body).map_err(|e| format!("bad request: {e}"))?;
        let resp = f(req)?;
        serde_json::to_vec(&resp).map_err(|e| format!("bad reply: {e}"))
    }
}
