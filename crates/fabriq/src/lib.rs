//! fabriq: RDMA communication middleware.
//!
//! Three small interfaces over the verbs object model ([`fabriq_verbs`]): a socket-like
//! [`Channel`], request/response [`Rpc`], and one-sided remote memory ([`RemoteRegion`]); plus
//! what production needs underneath: pooled pre-registered memory, eager and rendezvous
//! protocols, connection management, seq-ack, credit flow control and run-to-completion
//! workers.
//!
//! ```no_run
//! use fabriq::{Config, Endpoint, Rpc};
//! use std::time::Duration;
//! let server = Endpoint::new(Config::default())?;
//! server.serve("echo", |req| Ok(req.to_vec()));
//! let listener = server.listen("127.0.0.1:0")?;
//! let client = Endpoint::new(Config::default())?;
//! let ch = client.connect(listener.local_addr())?;
//! ch.send(b"hello")?;
//! let rpc = Rpc::new(ch);
//! assert_eq!(rpc.call("echo", b"ping", Duration::from_secs(1))?, b"ping");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod channel;
pub mod config;
pub mod conn;
mod endpoint;
mod handle;
pub mod mempool;
mod message;
pub mod remote;
pub mod rpc;
mod worker;

pub use channel::{ChannelError, ChannelStats, Thresholds, TraceHeader};
pub use config::{Config, ConfigError, Progress};
pub use conn::{ConnConfig, ConnError, ConnManager, ConnPool, Established, PendingConn};
pub use endpoint::{Endpoint, Listener};
pub use handle::Channel;
pub use mempool::{MemPool, PoolBuf, PoolConfig, PoolError, PoolStats, RegCache};
pub use message::{Message, SendBuf};
pub use remote::{CasLock, ExposedRegion, RegionDescriptor, RemoteRegion};
pub use rpc::{json_handler, Responder, Rpc, RpcError};
pub use worker::guard::GuardStats;
pub use worker::MemoryStats;
