//! Request/response RPC over a [`Channel`]: `call(method, request, timeout)` on the client,
//! `serve(method, handler)` on the server. Requests and responses are channel messages tagged in
//! the trace header (`wire` has the 12-byte RPC header). Handlers run to completion on the worker
//! that received the request (in caller mode: the application thread that progressed it) and
//! their reply is sent inline from there — no thread hop on the server. A call is posted by the
//! calling thread when it gets the worker's lock (a direct send, as a channel's), and the caller
//! progresses the worker while it waits for the reply; the pass that gives it the reply ends
//! there, leaving the rest of its work to the next pass. Deadlines are kept by the caller's
//! worker (its timer wheel) — and a handler's call, whose worker may be held, by the waiting
//! thread too — so a call always ends: with the reply, [`RpcError::Timeout`],
//! [`RpcError::UnknownMethod`], [`RpcError::Handler`] or [`RpcError::PeerGone`]; a blocking
//! call a handler makes on its own worker's channel fails at once
//! ([`RpcError::WouldDeadlock`]).

pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::channel::outbuf::{OutBuf, SmallBuf};
use crate::channel::proto::TraceInfo;
use crate::channel::{ChannelError, TraceFlags};
use crate::worker::async_wait;
use crate::worker::guard::GuardCounters;
use crate::worker::reply::{self, ReplyTo};
use crate::worker::shared::{holds_a_state, ChannelShared};
use crate::worker::{
    alloc_filled, direct_or_submit_settled, now, submit_on_stream, wait_call, Buffers, Call,
    CallReply, Command, EndpointShared, Waited, Worker,
};
use crate::Channel;

/// A method handler: request body in, reply body out, or an error text for the caller. Runs on a
/// worker thread: it should not block for long (it holds up that worker's other channels). A
/// handler that panics fails its call ([`RpcError::Handler`], starting [`HANDLER_PANICKED`]);
/// the worker goes on.
pub type Handler = Arc<dyn Fn(&[u8]) -> Result<Vec<u8>, String> + Send + Sync + 'static>;

/// A handler that replies later: request body in, and the [`Responder`] that sends the reply
/// when the handler (or whoever it hands the responder to) has it. Runs on a worker thread,
/// as a [`Handler`] does, and should return soon.
pub type DeferredHandler = Arc<dyn Fn(&[u8], Responder) + Send + Sync + 'static>;

/// A handler as registered: one that replies by returning, or one that replies later.
#[derive(Clone)]
pub(crate) enum Served {
    Inline(Handler),
    Deferred(DeferredHandler),
}

/// The reply still owed to one RPC request of a [`DeferredHandler`]. `Send`: hand it to another
/// thread, a task or a callback, and reply from there, once ([`Responder::reply`] or
/// [`Responder::fail`] consume it). Dropped without a reply, it answers the caller with
/// [`RpcError::Handler`] at once, so a forgotten request ends its call now rather than at the
/// caller's deadline. A reply to a caller that is gone (the channel closed, the call timed out)
/// is dropped.
pub struct Responder {
    stream: Arc<ChannelShared>,
    common: Arc<EndpointShared>,
    call_id: u64,
    trace_id: u64,
    answered: bool,
}

impl std::fmt::Debug for Responder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Responder")
            .field("call_id", &self.call_id)
            .field("answered", &self.answered)
            .finish()
    }
}

/// What a [`Responder`] dropped without a reply tells the caller.
pub const DROPPED_WITHOUT_REPLY: &str = "the handler dropped the request without replying";

/// How the text of [`RpcError::Handler`] starts when the handler panicked (the panic's message
/// follows). The panic is caught on the worker, which goes on serving.
pub const HANDLER_PANICKED: &str = "the handler panicked: ";

/// What a caller is told ([`RpcError::Handler`]) when the server had no pool memory for its
/// reply (`Config::pool_max_bytes`). With the response header it fits a reply held in place,
/// which needs none, so the caller learns at once and its place in the call window frees.
pub const NO_MEMORY: &str = "no memory";
const _: () = assert!(wire::RPC_HEADER_LEN + NO_MEMORY.len() <= crate::channel::outbuf::SMALL_MAX);

/// What the caller of a call is told ([`RpcError::Handler`]) when the handler's reply is above
/// the connection's largest message (`Config::max_message_len`): the reply cannot go.
pub const REPLY_TOO_LARGE: &str = "too large";
const _: () =
    assert!(wire::RPC_HEADER_LEN + REPLY_TOO_LARGE.len() <= crate::channel::outbuf::SMALL_MAX);

/// A reply ready to queue ([`reply_buf`]): `buf`, the reply itself or the one held in place
/// that tells the caller why not; `refused`, why the handler's reply could not go (its
/// handler is told).
pub(crate) struct ReplyBuf {
    pub(crate) buf: Option<OutBuf>,
    pub(crate) refused: Option<ChannelError>,
}

/// The reply to call `call_id` (`status`, `body`), or — above `max_len` (the connection's
/// largest message), or without pool memory for it (counted in `guard`) — why not, and the
/// reply that says [`REPLY_TOO_LARGE`] or [`NO_MEMORY`], held in place (no pool memory).
pub(crate) fn reply_buf(
    buffers: &Buffers,
    guard: &GuardCounters,
    call_id: u64,
    status: wire::Status,
    body: &[u8],
    max_len: u64,
) -> ReplyBuf {
    let held = |what: &str| {
        let head = wire::encode_response_header(call_id, wire::Status::HandlerError);
        SmallBuf::from_parts(&[&head, what.as_bytes()]).map(OutBuf::Small)
    };
    let len = (wire::RPC_HEADER_LEN + body.len()) as u64;
    if len > max_len {
        tracing::warn!(len, max_len, "an RPC reply above the largest message");
        return ReplyBuf {
            buf: held(REPLY_TOO_LARGE),
            refused: Some(ChannelError::MessageTooLarge { len, max: max_len }),
        };
    }
    let head = wire::encode_response_header(call_id, status);
    match alloc_filled(buffers, &[&head, body]) {
        Ok(buf) => ReplyBuf {
            buf: Some(buf),
            refused: None,
        },
        Err(e) => {
            tracing::warn!(%e, "no memory for an RPC reply");
            guard.reply_without_memory();
            ReplyBuf {
                buf: held(NO_MEMORY),
                refused: Some(ChannelError::Pool(e)),
            }
        }
    }
}

impl Responder {
    pub(crate) fn new(
        stream: Arc<ChannelShared>,
        common: Arc<EndpointShared>,
        call_id: u64,
        trace_id: u64,
    ) -> Responder {
        Responder {
            stream,
            common,
            call_id,
            trace_id,
            answered: false,
        }
    }

    /// Send `body` as the call's reply. `Err` when the reply could not be queued: above the
    /// connection's largest message (the caller gets [`RpcError::Handler`] with
    /// [`REPLY_TOO_LARGE`]), no pool memory for it (with [`NO_MEMORY`]), or the endpoint
    /// stopped.
    pub fn reply(mut self, body: &[u8]) -> Result<(), ChannelError> {
        self.answered = true;
        self.send(wire::Status::Ok, body)
    }

    /// Fail the call: the caller gets [`RpcError::Handler`] with `message`.
    pub fn fail(mut self, message: &str) -> Result<(), ChannelError> {
        self.answered = true;
        self.send(wire::Status::HandlerError, message.as_bytes())
    }

    /// Queue the response on the request's stream, as a handler's inline reply is: outside the
    /// stream's send window (the caller's request already holds its place).
    fn send(&self, status: wire::Status, body: &[u8]) -> Result<(), ChannelError> {
        let s = &self.stream;
        let buffers = s.worker.buffers().ok_or(ChannelError::Closed)?;
        let guard = &self.common.guard;
        // The caller is told, and the handler too.
        let ReplyBuf { buf, refused } =
            reply_buf(buffers, guard, self.call_id, status, body, s.max_len);
        let Some(buf) = buf else {
            return Err(refused.unwrap_or(ChannelError::Closed));
        };
        s.count_in(buf.len() as u64);
        let trace = TraceInfo {
            trace_id: self.trace_id,
            flags: TraceFlags(TraceFlags::RPC_RESPONSE),
            stream: 0,
            stream_credits: 0,
        };
        submit_on_stream(s, buf, trace);
        refused.map_or(Ok(()), Err)
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        if !self.answered {
            let _ = self.send(wire::Status::HandlerError, DROPPED_WITHOUT_REPLY.as_bytes());
        }
    }
}

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
    /// A blocking [`Rpc::call`] from a handler on a channel of the handler's own worker: the
    /// worker sends the request and reads the reply only after the handler returns, so the
    /// call could never be answered. Nothing was sent. Serve the method with
    /// [`Rpc::serve_deferred`] and make the call with [`Rpc::call_async`] instead.
    #[error("blocking RPC call from a handler on its own worker's channel (nothing sent; use serve_deferred and call_async)")]
    WouldDeadlock,
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

    /// Register a handler for `method` that replies later, through its [`Responder`]; see
    /// [`crate::Endpoint::serve_deferred`].
    pub fn serve_deferred<F>(&self, method: &str, handler: F)
    where
        F: Fn(&[u8], Responder) + Send + Sync + 'static,
    {
        self.channel.endpoint().serve_deferred(method, handler);
    }

    /// Register an async handler for `method`, its futures run on `runtime`; see
    /// [`crate::Endpoint::serve_async`].
    pub fn serve_async<F, Fut>(&self, method: &str, runtime: tokio::runtime::Handle, handler: F)
    where
        F: Fn(Vec<u8>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Vec<u8>, String>> + Send + 'static,
    {
        self.channel
            .endpoint()
            .serve_async(method, runtime, handler);
    }

    /// Send a call of `method`, its reply to go to `reply`; the call's id.
    fn submit(
        &self,
        method: &str,
        request: &[u8],
        timeout: Duration,
        reply: CallReply,
    ) -> Result<u64, RpcError> {
        let shared = self.channel.shared();
        if let Some(f) = shared.failure() {
            return Err(f.to_rpc_error());
        }
        let len = (wire::RPC_HEADER_LEN + request.len()) as u64;
        if len > shared.max_len {
            return Err(RpcError::Channel(ChannelError::MessageTooLarge {
                len,
                max: shared.max_len,
            }));
        }
        let w = &shared.worker;
        let call_id = w.next_call_id();
        let head = wire::encode_request_header(call_id, wire::method_id(method));
        let buffers = w.buffers().ok_or(RpcError::PeerGone)?;
        let buf = alloc_filled(buffers, &[&head, request])
            .map_err(|e| RpcError::Channel(ChannelError::Pool(e)))?;
        let call = Call {
            chan: shared.id,
            call_id,
            buf,
            deadline: now().saturating_add(timeout),
            reply,
        };
        direct_or_submit_settled(w, call, Worker::enqueue_call, |c| {
            Command::Call(Box::new(c))
        });
        Ok(call_id)
    }

    /// Call `method` and wait for the reply, at most `timeout`. Blocking: from async code use
    /// [`Rpc::call_async`]. A channel keeps at most its stream window
    /// ([`crate::Config::stream_window`]) of calls out; a call beyond it waits, within its
    /// `timeout`, for a reply of the channel's earlier calls.
    pub fn call(
        &self,
        method: &str,
        request: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, RpcError> {
        let w = &self.channel.shared().worker;
        if w.held_here() {
            // This thread runs a pass of the worker the call needs: the request would go out,
            // and its reply be read, only after the handler returned.
            return Err(RpcError::WouldDeadlock);
        }
        // A handler's call keeps its deadline itself (see `wait_call`).
        // (A deadline past the clock's range is none.)
        let deadline = holds_a_state()
            .then(|| std::time::Instant::now().checked_add(timeout))
            .flatten();
        let (tx, rx) = reply::slot();
        let call_id = self.submit(method, request, timeout, tx)?;
        match wait_call(w, rx, call_id, deadline) {
            Waited::Got(r) => r,
            Waited::Closed => Err(RpcError::PeerGone),
            Waited::Expired => Err(RpcError::Timeout),
        }
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
        let (tx, rx) = oneshot::channel();
        self.submit(method, request, timeout, ReplyTo::Task(tx))?;
        async_wait::answer(&self.channel.shared().worker, rx)
            .await
            .unwrap_or(Err(RpcError::PeerGone))
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
