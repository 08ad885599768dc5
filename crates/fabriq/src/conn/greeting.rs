//! A peer's hello, read as it arrives (on a newly accepted stream or a kept control stream):
//! the listener keeps each stream whose hello is not all there yet beside its other streams and
//! reads it when it is readable, instead of waiting on it, so that a peer that connects and
//! says nothing — or part of a frame — holds up no other peer's handshake. Each is dropped at
//! its deadline.

use std::net::SocketAddr;
use std::time::Instant;

use super::handshake::Step;
use super::stream::Stream;
use super::wire::{self, DecodeError, Message, MAX_FRAME_LEN};
use super::ConnError;

/// Bytes taken from the socket per receive.
const READ: usize = 1024;
/// Most bytes a greeting may hold: a whole frame of the largest size, and a read past it.
const MAX_HELD: usize = 4 + MAX_FRAME_LEN + READ;

/// A stream whose hello the listener reads as it comes: newly accepted, or a kept control
/// stream that became readable.
pub(crate) struct Greeting {
    pub(crate) stream: Stream,
    pub(crate) peer: SocketAddr,
    /// When the listener gives up on it.
    pub(crate) deadline: Instant,
    /// A control stream kept from an earlier connection: it may start with that connection's
    /// last frames, and its peer may let it go.
    pub(crate) kept: bool,
    got: Vec<u8>,
}

/// What a read of a greeting found.
pub(crate) enum Greeted {
    /// Complete frames and nothing after them.
    Frames(Vec<Message>),
    /// Not all there yet.
    Waiting,
    /// The peer closed the stream before sending anything.
    Closed,
}

impl Greeting {
    /// A newly accepted stream.
    pub(crate) fn new(stream: Stream, peer: SocketAddr, deadline: Instant) -> Greeting {
        Greeting {
            stream,
            peer,
            deadline,
            kept: false,
            got: Vec::new(),
        }
    }

    /// A kept control stream that became readable.
    pub(crate) fn kept(stream: Stream, peer: SocketAddr, deadline: Instant) -> Greeting {
        Greeting {
            kept: true,
            ..Greeting::new(stream, peer, deadline)
        }
    }

    /// Read what arrived, without waiting (the stream is non-blocking), and see whether it is
    /// whole. `step` names the phase in errors.
    pub(crate) fn pull(&mut self, step: &Step) -> Result<Greeted, ConnError> {
        let mut buf = [0u8; READ];
        let mut closed = false;
        loop {
            match rustix::net::recv(&self.stream, &mut buf, rustix::net::RecvFlags::DONTWAIT) {
                // A reset as a close: a peer that closes with bytes of ours unread resets the
                // connection (a kept stream's peer letting it go, our `Close` unread).
                Ok((0, _)) | Err(rustix::io::Errno::CONNRESET) if self.got.is_empty() => {
                    return Ok(Greeted::Closed)
                }
                // Whole frames before it are still read (a kept stream's last `Close`): the
                // close shows again at the stream's next read.
                Ok((0, _)) | Err(rustix::io::Errno::CONNRESET) => {
                    closed = true;
                    break;
                }
                Ok((n, _)) => {
                    self.got.extend_from_slice(buf.get(..n).unwrap_or_default());
                    if self.got.len() > MAX_HELD {
                        return Err(step.decode_error(DecodeError::TooLong {
                            field: "greeting",
                            len: self.got.len(),
                            max: MAX_HELD,
                        }));
                    }
                    // A receive that did not fill the buffer took what there was: whole
                    // frames need no receive more (one that would find nothing).
                    if n < READ {
                        if let Ok(Greeted::Frames(msgs)) = frames(&self.got) {
                            return Ok(Greeted::Frames(msgs));
                        }
                    }
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => break,
                Err(e) => return Err(step.io_error(e.into())),
            }
        }
        match frames(&self.got).map_err(|e| step.decode_error(e))? {
            Greeted::Waiting if closed => Err(ConnError::PeerClosed {
                peer: self.peer,
                phase: "hello",
            }),
            read => Ok(read),
        }
    }
}

/// The frames `got` holds when it ends with a whole one.
fn frames(got: &[u8]) -> Result<Greeted, DecodeError> {
    let mut msgs = Vec::with_capacity(1);
    let mut rest = got;
    while let (Some(head), Some(after)) = (rest.get(..4), rest.get(4..)) {
        let mut prefix = [0u8; 4];
        prefix.copy_from_slice(head);
        let len = wire::frame_len(prefix)?;
        let (Some(body), Some(next)) = (after.get(..len), after.get(len..)) else {
            return Ok(Greeted::Waiting);
        };
        msgs.push(wire::decode_body(body)?);
        rest = next;
    }
    Ok(if rest.is_empty() && !msgs.is_empty() {
        Greeted::Frames(msgs)
    } else {
        Greeted::Waiting
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn framed(m: &Message) -> Vec<u8> {
        wire::encode(m)
    }

    #[test]
    fn a_frame_is_whole_only_with_its_last_byte() {
        let f = framed(&Message::Ready);
        for cut in 0..f.len() {
            assert!(matches!(frames(&f[..cut]), Ok(Greeted::Waiting)), "{cut}");
        }
        assert!(matches!(frames(&f), Ok(Greeted::Frames(m)) if m.len() == 1));
        let mut two = f.clone();
        two.extend_from_slice(&f);
        assert!(matches!(frames(&two), Ok(Greeted::Frames(m)) if m.len() == 2));
        two.push(0);
        assert!(matches!(frames(&two), Ok(Greeted::Waiting)));
    }

    #[test]
    fn an_oversized_length_is_refused_at_once() {
        let len = (MAX_FRAME_LEN as u32 + 1).to_be_bytes();
        assert!(frames(&len).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = frames(&bytes);
        }
    }
}
