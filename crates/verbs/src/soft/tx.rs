//! [`TxQueue`]: the bytes a QP has to send, in order, without copying request frames or large
//! payloads.
//!
//! Owns: a FIFO of segments — owned bytes (responses, appended in place), shared request
//! frames (the same `Arc` the send queue keeps for resending) and payloads left in registered
//! memory (read by the kernel when the bytes are sent, as a NIC reads a buffer) — and how much
//! of the head was sent. A stream driver calls [`TxQueue::send_to`] (one `sendmsg` over up to
//! 64 segments); a datagram driver takes whole frames through its own [`FrameSink`].
//!
//! # Unsafe
//! [`TxQueue::send_to`] hands the kernel raw `iovec`s: owned and shared segments are borrowed
//! for the call; memory segments are checked against their MR table under its read lock
//! ([`MrTable::local_view`]), which is held until `sendmsg` returned, so deregistration waits
//! and the memory cannot be freed while the kernel copies it.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use super::mr::{Dest, MemKey, MrTable};
use crate::{AccessFlags, Sge};

/// Something request frames can be transmitted into.
pub trait FrameSink {
    /// Queue one encoded request frame.
    fn push_frame(&mut self, frame: &Arc<Vec<u8>>);

    /// Whether [`FrameSink::push_memory`] keeps payloads in registered memory (a stream
    /// socket), so the requester need not gather them into the frame.
    fn takes_memory(&self) -> bool {
        false
    }

    /// Queue a request frame whose payload (`len` bytes) is still in registered memory:
    /// `head` is the frame without it (its length field already counts it), `payload` the
    /// SGEs in `table`. The default gathers the payload into a new frame; an SGE that no
    /// longer lies in a live registration is sent as zeros (the requester checked them when it
    /// chose this path; only a sink that [`FrameSink::takes_memory`] is given such frames).
    fn push_memory(
        &mut self,
        head: &Arc<Vec<u8>>,
        payload: &Arc<[Sge]>,
        len: usize,
        table: &Arc<MrTable>,
    ) {
        let mut frame = Vec::with_capacity(head.len() + len);
        frame.extend_from_slice(head);
        if table.gather(payload, &mut frame).is_err() {
            frame.resize(head.len() + len, 0);
        }
        self.push_frame(&Arc::new(frame));
    }
}

impl FrameSink for Vec<u8> {
    fn push_frame(&mut self, frame: &Arc<Vec<u8>>) {
        self.extend_from_slice(frame);
    }
}

enum Segment {
    Owned(Vec<u8>),
    Shared(Arc<Vec<u8>>),
    /// A payload in registered memory: `len` bytes over `ranges`, checked in `table` when
    /// sent.
    Memory {
        ranges: Arc<[Dest]>,
        len: usize,
        table: Arc<MrTable>,
    },
}

impl Segment {
    /// The bytes of an owned or shared segment; `None` for memory.
    fn bytes(&self) -> Option<&[u8]> {
        match self {
            Segment::Owned(v) => Some(v),
            Segment::Shared(f) => Some(f),
            Segment::Memory { .. } => None,
        }
    }

    fn len(&self) -> usize {
        match self {
            Segment::Owned(v) => v.len(),
            Segment::Shared(f) => f.len(),
            Segment::Memory { len, .. } => *len,
        }
    }
}

/// Segments (iovecs) handed to one `sendmsg`, at most.
const MAX_IOV: usize = 64;

/// Ordered output of one connection.
#[derive(Default)]
pub struct TxQueue {
    segments: VecDeque<Segment>,
    /// Bytes of the front segment already sent.
    head_sent: usize,
    /// Unsent bytes in total.
    pending: usize,
}

impl std::fmt::Debug for TxQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxQueue")
            .field("segments", &self.segments.len())
            .field("pending", &self.pending)
            .finish()
    }
}

/// Owned segments larger than this are not reused for later bytes.
const OWNED_KEEP: usize = 1 << 20;

impl TxQueue {
    /// An empty queue.
    pub fn new() -> TxQueue {
        TxQueue::default()
    }

    /// Unsent bytes.
    pub fn len(&self) -> usize {
        self.pending
    }

    /// True when everything was sent.
    pub fn is_empty(&self) -> bool {
        self.pending == 0
    }

    /// Append owned bytes (responses) through `f`, which writes to the end of a buffer.
    pub fn append_with<R>(&mut self, f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
        let reuse = matches!(self.segments.back(), Some(Segment::Owned(_)));
        if !reuse {
            self.segments.push_back(Segment::Owned(Vec::new()));
        }
        let Some(Segment::Owned(buf)) = self.segments.back_mut() else {
            unreachable!("an owned segment was just ensured at the back");
        };
        let before = buf.len();
        let r = f(buf);
        let added = buf.len() - before;
        self.pending += added;
        if added == 0 && before == 0 {
            self.segments.pop_back();
        }
        r
    }

    /// Put `bytes` before everything queued, if nothing was sent of it yet (false otherwise,
    /// and nothing changes).
    pub fn prepend(&mut self, bytes: Vec<u8>) -> bool {
        if self.head_sent > 0 {
            return false;
        }
        self.pending += bytes.len();
        self.segments.push_front(Segment::Owned(bytes));
        true
    }

    /// Drop everything (connection closed).
    pub fn clear(&mut self) {
        self.segments.clear();
        self.head_sent = 0;
        self.pending = 0;
    }

    /// Up to `max` slices covering the unsent bytes, in order, up to the first payload left in
    /// registered memory (those are sent by [`TxQueue::send_to`] only).
    pub fn io_slices<'a>(&'a self, out: &mut Vec<IoSlice<'a>>, max: usize) {
        for (i, seg) in self.segments.iter().enumerate().take(max) {
            let Some(b) = seg.bytes() else {
                return;
            };
            let b = if i == 0 {
                b.get(self.head_sent..).unwrap_or(&[])
            } else {
                b
            };
            if !b.is_empty() {
                out.push(IoSlice::new(b));
            }
        }
    }

    /// One non-blocking `sendmsg` (`MSG_NOSIGNAL`) of the unsent bytes to the stream socket
    /// `fd`, over up to 64 segments, payloads straight from registered memory; the bytes the
    /// kernel took are consumed. An error when the head is a payload whose memory was
    /// deregistered since it was posted (the request can no longer be sent).
    pub fn send_to(&mut self, fd: BorrowedFd<'_>) -> std::io::Result<usize> {
        let empty = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        let mut iov = [empty; MAX_IOV];
        let mut n_iov = 0;
        // Memory segments of the first table met are sent under its read lock; a memory
        // segment of another table ends the batch.
        let table = self.segments.iter().find_map(|s| match s {
            Segment::Memory { table, .. } => Some(table.clone()),
            _ => None,
        });
        let view = table.as_ref().map(|t| t.local_view());
        let mut skip = self.head_sent;
        'segments: for seg in &self.segments {
            match seg {
                Segment::Owned(_) | Segment::Shared(_) => {
                    let b = seg.bytes().unwrap_or(&[]);
                    let b = b.get(skip..).unwrap_or(&[]);
                    skip = 0;
                    if !b.is_empty() {
                        if let Some(slot) = iov.get_mut(n_iov) {
                            *slot = libc::iovec {
                                iov_base: b.as_ptr() as *mut libc::c_void,
                                iov_len: b.len(),
                            };
                            n_iov += 1;
                        }
                    }
                }
                Segment::Memory {
                    ranges, table: t, ..
                } => {
                    let (Some(view), Some(first)) = (&view, &table) else {
                        break;
                    };
                    if !Arc::ptr_eq(t, first) {
                        break;
                    }
                    for r in ranges.iter() {
                        let l = r.len as usize;
                        if skip >= l {
                            skip -= l;
                            continue;
                        }
                        if !view.permits(r) {
                            if n_iov == 0 {
                                return Err(std::io::Error::other(
                                    "the registered memory of a request being sent was deregistered",
                                ));
                            }
                            break 'segments;
                        }
                        let Some(slot) = iov.get_mut(n_iov) else {
                            break 'segments;
                        };
                        *slot = libc::iovec {
                            iov_base: (r.addr as usize + skip) as *mut libc::c_void,
                            iov_len: l - skip,
                        };
                        n_iov += 1;
                        skip = 0;
                    }
                }
            }
            if n_iov == MAX_IOV {
                break;
            }
        }
        if n_iov == 0 {
            return Ok(0);
        }
        // SAFETY: an all-zero `msghdr` is a valid value (null name and control, no flags).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = n_iov as _;
        // SAFETY: the first `n_iov` iovecs point either into owned/shared segments borrowed
        // from `self` for the whole call, or into registered ranges `view` permitted; `view`
        // holds the table's read lock until after `sendmsg` returned, so those ranges stay
        // registered and allocated while the kernel reads them. The kernel only reads them.
        let sent = unsafe {
            libc::sendmsg(
                fd.as_raw_fd(),
                &msg,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        drop(view);
        if sent < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let sent = sent as usize;
        self.consume(sent);
        Ok(sent)
    }

    /// `n` bytes were sent.
    pub fn consume(&mut self, mut n: usize) {
        self.pending = self.pending.saturating_sub(n);
        while n > 0 {
            let Some(front) = self.segments.front() else {
                break;
            };
            let left = front.len() - self.head_sent;
            if n < left {
                self.head_sent += n;
                return;
            }
            n -= left;
            self.head_sent = 0;
            self.segments.pop_front();
        }
        // Drop fully sent empty owned segments left at the front.
        while let Some(front) = self.segments.front() {
            if front.len() > self.head_sent {
                break;
            }
            self.segments.pop_front();
            self.head_sent = 0;
        }
        if self.segments.is_empty() {
            self.head_sent = 0;
        }
    }

    /// Queue `len` bytes of registered memory over `ranges` of `table` (checked again, with
    /// their keys and rights, each time bytes are sent).
    pub fn push_ranges(&mut self, ranges: Arc<[Dest]>, len: usize, table: &Arc<MrTable>) {
        if len > 0 {
            self.pending += len;
            self.segments.push_back(Segment::Memory {
                ranges,
                len,
                table: table.clone(),
            });
        }
    }

    /// Give back memory after a burst.
    pub fn shrink(&mut self) {
        if self.segments.is_empty() {
            self.segments.shrink_to(8);
        }
        if let Some(Segment::Owned(v)) = self.segments.back_mut() {
            if v.is_empty() && v.capacity() > OWNED_KEEP {
                *v = Vec::new();
            }
        }
    }
}

impl FrameSink for TxQueue {
    fn push_frame(&mut self, frame: &Arc<Vec<u8>>) {
        if frame.is_empty() {
            return;
        }
        self.pending += frame.len();
        self.segments.push_back(Segment::Shared(frame.clone()));
    }

    fn takes_memory(&self) -> bool {
        true
    }

    fn push_memory(
        &mut self,
        head: &Arc<Vec<u8>>,
        payload: &Arc<[Sge]>,
        len: usize,
        table: &Arc<MrTable>,
    ) {
        self.push_frame(head);
        let ranges: Arc<[Dest]> = payload
            .iter()
            .map(|s| Dest {
                key: MemKey::Local(s.lkey),
                addr: s.addr,
                len: u64::from(s.length),
                need: AccessFlags::empty(),
            })
            .collect();
        self.push_ranges(ranges, len, table);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(q: &mut TxQueue, step: usize) -> Vec<u8> {
        let mut out = Vec::new();
        while !q.is_empty() {
            let mut sl = Vec::new();
            q.io_slices(&mut sl, 3);
            let mut take = step;
            let mut n = 0;
            for s in &sl {
                let k = take.min(s.len());
                out.extend_from_slice(&s[..k]);
                n += k;
                take -= k;
                if take == 0 {
                    break;
                }
            }
            q.consume(n);
        }
        out
    }

    #[test]
    fn keeps_order_across_owned_and_shared_segments_and_partial_writes() {
        for step in [1, 2, 3, 5, 7, 100] {
            let mut q = TxQueue::new();
            q.append_with(|b| b.extend_from_slice(b"ab"));
            q.push_frame(&Arc::new(b"cde".to_vec()));
            q.append_with(|b| b.extend_from_slice(b"f"));
            q.append_with(|b| b.extend_from_slice(b"g"));
            q.push_frame(&Arc::new(b"hij".to_vec()));
            q.push_frame(&Arc::new(Vec::new()));
            assert_eq!(q.len(), 10);
            let mut got = Vec::new();
            // Bytes appended while the head is partially sent stay behind it.
            let mut sl = Vec::new();
            q.io_slices(&mut sl, 8);
            drop(sl);
            q.consume(1);
            got.push(b'a');
            q.append_with(|b| b.extend_from_slice(b"k"));
            got.extend(drain(&mut q, step));
            assert_eq!(got, b"abcdefghijk", "step {step}");
            assert!(q.is_empty());
        }
    }
}

#[cfg(test)]
mod send_tests {
    use super::*;
    use crate::provider::MrOps;
    use crate::soft::mr::SoftMr;
    use crate::AccessFlags;
    use std::io::Read;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    /// Frames and payloads in registered memory leave in order through partial `sendmsg`s,
    /// and a payload whose region was deregistered is refused instead of read.
    #[test]
    fn send_to_streams_owned_shared_and_memory_segments_in_order() {
        let table = MrTable::new();
        let len = 300_000;
        let mr = SoftMr::alloc(&table, len, AccessFlags::ALL).unwrap();
        let info = mr.info();
        let pattern: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        table
            .scatter(
                &[Sge {
                    addr: info.addr,
                    length: len as u32,
                    lkey: info.lkey,
                }],
                &pattern,
            )
            .unwrap();
        let sge = |o: usize, l: usize| Sge {
            addr: info.addr + o as u64,
            length: l as u32,
            lkey: info.lkey,
        };
        let pieces = [(1, 100_000), (150_007, 50_000), (200_013, 99_000)];
        let payload: Arc<[Sge]> = pieces.iter().map(|&(o, l)| sge(o, l)).collect();
        let payload_len: usize = pieces.iter().map(|p| p.1).sum();
        let mut expect = Vec::new();
        let mut q = TxQueue::new();
        for round in 0..3u8 {
            let head = Arc::new(vec![round; 20]);
            q.push_memory(&head, &payload, payload_len, &table);
            q.append_with(|b| b.extend_from_slice(&[0xee, round]));
            expect.extend_from_slice(&head);
            for &(o, l) in &pieces {
                expect.extend_from_slice(&pattern[o..o + l]);
            }
            expect.extend_from_slice(&[0xee, round]);
        }
        assert_eq!(q.len(), expect.len());
        let (tx, mut rx) = UnixStream::pair().unwrap();
        tx.set_nonblocking(true).unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            rx.read_to_end(&mut got).unwrap();
            got
        });
        let mut calls = 0;
        while !q.is_empty() {
            match q.send_to(tx.as_fd()) {
                Ok(_) => calls += 1,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        drop(tx);
        let got = reader.join().unwrap();
        assert!(calls > 1, "the socket buffer should force partial sends");
        assert_eq!(got.len(), expect.len());
        assert!(got == expect, "bytes out of order");

        let (tx, _rx) = UnixStream::pair().unwrap();
        let mut q = TxQueue::new();
        q.push_memory(&Arc::new(vec![1; 4]), &payload, payload_len, &table);
        drop(mr);
        assert_eq!(
            q.send_to(tx.as_fd()).unwrap(),
            4,
            "the head goes, not the gone payload"
        );
        assert!(q.send_to(tx.as_fd()).is_err());
        assert_eq!(q.len(), payload_len);
    }
}
