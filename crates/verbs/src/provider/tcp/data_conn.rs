//! A QP pair's data connection, with the address of the end that opened it.
//!
//! Owns: the socket and that address, read once when the connection is made (free from
//! `accept`; one `getsockname` at `connect`), so that the connects that reuse a kept
//! connection name it ([`super::qp::KEPT_FROM_KEY`]) and recognise it without a system call.
//! Derefs to the `TcpStream`: everything else uses it as one.

use std::net::{SocketAddr, TcpStream};
use std::ops::Deref;
use std::os::fd::{AsFd, BorrowedFd};

#[derive(Debug)]
pub(super) struct DataConn {
    stream: TcpStream,
    opener: Option<SocketAddr>,
}

impl DataConn {
    /// A connection this context accepted from `peer` (the opening end's address).
    pub fn accepted(stream: TcpStream, peer: SocketAddr) -> DataConn {
        DataConn {
            stream,
            opener: Some(peer),
        }
    }

    /// A connection this context opened (`None` for the address if the socket cannot say:
    /// the connection is then never named as kept, and its next use writes a HELLO).
    pub fn opened(stream: TcpStream) -> DataConn {
        let opener = stream.local_addr().ok();
        DataConn { stream, opener }
    }

    /// The address of the end that opened the connection (its local address there, the
    /// peer's here on an accepted one).
    pub fn opener(&self) -> Option<SocketAddr> {
        self.opener
    }
}

impl Deref for DataConn {
    type Target = TcpStream;

    fn deref(&self) -> &TcpStream {
        &self.stream
    }
}

impl AsFd for DataConn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}
