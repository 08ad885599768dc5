//! Out-of-band endpoint exchange over TCP: the smallest control plane that lets two processes
//! swap [`QpEndpoint`]s before driving their QPs to RTS. Frames are a 4-byte big-endian length
//! followed by the encoded endpoint; lengths above [`QpEndpoint::MAX_ENCODED_LEN`] are refused.
//! The middleware's connection manager has a richer, versioned handshake; this one is for tools
//! and tests.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::{QpEndpoint, Result, VerbsError};

/// Send ours, then read theirs, on a connected stream.
pub fn exchange(stream: &mut TcpStream, local: &QpEndpoint) -> Result<QpEndpoint> {
    write_endpoint(stream, local)?;
    read_endpoint(stream)
}

/// Write one endpoint frame.
pub fn write_endpoint(stream: &mut impl Write, ep: &QpEndpoint) -> Result<()> {
    let bytes = ep.to_bytes();
    let len = u32::try_from(bytes.len())
        .map_err(|_| VerbsError::InvalidArgument("endpoint too large".into()))?;
    stream
        .write_all(&len.to_be_bytes())
        .and_then(|_| stream.write_all(&bytes))
        .and_then(|_| stream.flush())
        .map_err(|e| VerbsError::io("send endpoint", e))
}

/// Read one endpoint frame.
pub fn read_endpoint(stream: &mut impl Read) -> Result<QpEndpoint> {
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .map_err(|e| VerbsError::io("read endpoint length", e))?;
    let len = u32::from_be_bytes(len) as usize;
    if len > QpEndpoint::MAX_ENCODED_LEN {
        return Err(VerbsError::Protocol(format!(
            "endpoint frame of {len} bytes exceeds {}",
            QpEndpoint::MAX_ENCODED_LEN
        )));
    }
    let mut buf = vec![0u8; len];
    stream
        .read_exact(&mut buf)
        .map_err(|e| VerbsError::io("read endpoint", e))?;
    QpEndpoint::from_bytes(&buf)
}

/// Accept one peer on `listener` and exchange endpoints with it.
pub fn accept_exchange(listener: &TcpListener, local: &QpEndpoint) -> Result<QpEndpoint> {
    let (mut s, _) = listener
        .accept()
        .map_err(|e| VerbsError::io("accept endpoint exchange", e))?;
    s.set_nodelay(true).ok();
    exchange(&mut s, local)
}

/// Connect to `addr` (retrying until `timeout`) and exchange endpoints.
pub fn connect_exchange(
    addr: impl ToSocketAddrs,
    local: &QpEndpoint,
    timeout: Duration,
) -> Result<QpEndpoint> {
    let deadline = std::time::Instant::now() + timeout;
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| VerbsError::io("resolve endpoint exchange address", e))?
        .collect();
    loop {
        let mut last = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, Duration::from_millis(500)) {
                Ok(mut s) => {
                    s.set_nodelay(true).ok();
                    s.set_read_timeout(Some(timeout)).ok();
                    return exchange(&mut s, local);
                }
                Err(e) => last = Some(e),
            }
        }
        if std::time::Instant::now() >= deadline {
            return Err(VerbsError::Connect(format!(
                "endpoint exchange with {addrs:?}: {}",
                last.map(|e| e.to_string())
                    .unwrap_or_else(|| "no address".into())
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
