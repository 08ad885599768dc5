//! The socket a control stream runs on: TCP, or — between two processes of one host, once the
//! connecting side has learnt where — a Unix stream socket in the abstract namespace.
//!
//! A handshake on this host costs a few loopback writes, each of which wakes the reading thread.
//! A loopback TCP write takes the whole TCP path twice (send and receive, in the writer's
//! system call): inside a cached connect on the 2-vCPU test VM a hello written over TCP took
//! 3.9 µs and over a Unix stream 1.2 µs (`docs/BENCHMARKS.md`, fourth round of 2026-12-02). The first connection to a peer always goes
//! over TCP (its address is all the connecting side knows); the peer's hello-ack names the
//! abstract socket its listener also takes control streams on (`Hello::local_control`), and
//! later control streams to that peer — the kept ones a cached connect reuses — are opened
//! there when the peer's address is one of this host's.
//!
//! Not here: framing (`wire`), the handshake's waits (`handshake`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};

/// A control stream's socket.
#[derive(Debug)]
pub(crate) enum Stream {
    /// A TCP connection (any host).
    Tcp(TcpStream),
    /// A Unix stream socket to a listener of this host.
    Local(UnixStream),
}

impl Stream {
    pub(crate) fn set_nonblocking(&self, on: bool) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(on),
            Stream::Local(s) => s.set_nonblocking(on),
        }
    }

    /// True for a Unix stream socket.
    pub(crate) fn is_local(&self) -> bool {
        matches!(self, Stream::Local(_))
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Local(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Local(s) => (&*s).write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Local(s) => s.as_fd(),
        }
    }
}

/// A listening Unix socket in the abstract namespace under a fresh random name (no file to
/// clean up; gone when the socket closes), non-blocking. `None` (logged) where none can be
/// bound: the listener then takes TCP streams only.
pub(crate) fn bind_local() -> Option<(UnixListener, String)> {
    for _ in 0..4 {
        let name = format!(
            "fabriq-ctl/{}/{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        let bound = UnixAddr::from_abstract_name(name.as_bytes())
            .and_then(|a| UnixListener::bind_addr(&a))
            .and_then(|l| l.set_nonblocking(true).map(|()| l));
        match bound {
            Ok(l) => return Some((l, name)),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
            Err(e) => {
                tracing::debug!(%e, "no local control socket: control streams over TCP only");
                return None;
            }
        }
    }
    None
}

/// Why a local control stream could not be opened.
#[derive(Debug)]
pub(crate) enum LocalConnect {
    /// Nothing listens under the name (the peer's listener is gone, or it is not on this
    /// host's network namespace): forget the name.
    Gone,
    /// The peer's listener is there but cannot take a connection now (its backlog is full):
    /// use TCP this time.
    Busy,
}

/// Connect to the abstract socket `name`, without blocking (a Unix connect completes at once or
/// not at all); the stream stays non-blocking, as every control stream.
pub(crate) fn connect_local(name: &str) -> Result<UnixStream, LocalConnect> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    if name.is_empty() || name.len() > super::wire::MAX_LOCAL_CONTROL_LEN {
        return Err(LocalConnect::Gone);
    }
    let addr = rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes())
        .map_err(|_| LocalConnect::Gone)?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|_| LocalConnect::Busy)?;
    match rustix::net::connect(&fd, &addr) {
        Ok(()) => {}
        Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => return Err(LocalConnect::Busy),
        Err(_) => return Err(LocalConnect::Gone),
    }
    Ok(UnixStream::from(fd))
}

/// The peer address a control stream accepted on the local socket reports: this host (the
/// listener's own address, loopback where it listens on every interface), port 0. It stands
/// where a TCP peer's address would (`Channel::peer_addr`, the host of a peer's QP endpoint that
/// names none, see `manager::reached_at`).
pub(crate) fn local_peer(listening: SocketAddr) -> SocketAddr {
    let ip = match listening.ip() {
        ip if ip.is_unspecified() && ip.is_ipv4() => std::net::Ipv4Addr::LOCALHOST.into(),
        ip if ip.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    SocketAddr::new(ip, 0)
}
