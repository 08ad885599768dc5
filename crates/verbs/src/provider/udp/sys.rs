//! Batched socket calls std and rustix do not cover: `sendmmsg(2)` with optional UDP GSO
//! (`UDP_SEGMENT`), and `recvmmsg(2)` returning each datagram's IP TOS byte (`IP_RECVTOS`
//! ancillary data, which carries the ECN Congestion Experienced mark) and, with UDP GRO, the
//! segment size of a coalesced receive.
//!
//! Owns the provider's `unsafe` code: the two system calls over buffers this module owns, the
//! `CMSG_*` walk, and the conversions between `std::net::SocketAddr` and C socket addresses.
//! It makes no protocol decision: which datagrams to send, and what a received one means, is the
//! caller's (and, above it, fabriq-mpath's).
#![allow(unsafe_code)]

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::AsRawFd;

/// ECN codepoint Congestion Experienced, the low two bits of the TOS byte.
const ECN_CE: u8 = 0b11;
/// Messages per `sendmmsg`/`recvmmsg` call.
pub(crate) const BATCH: usize = 64;
/// Datagrams one GSO message may carry (the kernel's `UDP_MAX_SEGMENTS` is 64 or more).
pub(crate) const MAX_GSO_SEGMENTS: usize = 64;
/// Largest UDP payload one GSO message may carry.
const MAX_GSO_BYTES: usize = 65_000;
/// iovecs per `sendmmsg` call (GSO messages take one per segment).
const MAX_IOVS: usize = 4 * BATCH;

/// One datagram of a [`TxBatch`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct TxDatagram {
    /// Index of the socket (virtual path) it leaves from.
    pub sock: u16,
    /// Destination.
    pub to: SocketAddr,
    /// Its bytes: `buf[start..start + len]` of the batch.
    pub start: usize,
    pub len: usize,
}

/// Datagrams collected during one pump, sent with as few system calls as the kernel allows.
#[derive(Debug, Default)]
pub(crate) struct TxBatch {
    /// Every datagram's bytes, back to back.
    pub buf: Vec<u8>,
    /// The datagrams, in the order they were produced.
    pub msgs: Vec<TxDatagram>,
    /// Scratch: sockets in order of first use, and one socket's datagrams.
    order: Vec<u16>,
    run: Vec<TxDatagram>,
}

impl TxBatch {
    /// Queue the datagram `parts[0] ‖ parts[1]` from socket `sock` to `to`.
    pub fn push(&mut self, sock: u16, to: SocketAddr, parts: [&[u8]; 2]) {
        let start = self.buf.len();
        for p in parts {
            self.buf.extend_from_slice(p);
        }
        self.msgs.push(TxDatagram {
            sock,
            to,
            start,
            len: self.buf.len() - start,
        });
    }

    pub fn is_empty(&self) -> bool {
        self.msgs.is_empty()
    }

    pub fn clear(&mut self) {
        self.buf.clear();
        self.msgs.clear();
    }

    /// Call `f(socket, buf, datagrams)` once per socket used, in the order of each socket's
    /// first datagram; each socket's datagrams keep their order.
    pub fn for_each_socket(&mut self, mut f: impl FnMut(u16, &[u8], &[TxDatagram])) {
        self.order.clear();
        for m in &self.msgs {
            if !self.order.contains(&m.sock) {
                self.order.push(m.sock);
            }
        }
        for &sock in &self.order {
            self.run.clear();
            self.run
                .extend(self.msgs.iter().filter(|m| m.sock == sock).copied());
            f(sock, &self.buf, &self.run);
        }
    }
}

/// What [`send_batch`] did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SendOutcome {
    /// `sendmmsg` calls made.
    pub calls: u64,
    /// Datagrams the kernel accepted.
    pub sent: u64,
    /// Datagrams dropped on an error (mpath's loss recovery resends them).
    pub dropped: u64,
}

/// A C socket address large enough for IPv4 and IPv6.
#[repr(C)]
#[derive(Clone, Copy)]
union RawAddr {
    v4: libc::sockaddr_in,
    v6: libc::sockaddr_in6,
}

fn raw_addr(a: &SocketAddr) -> (RawAddr, libc::socklen_t) {
    match a {
        SocketAddr::V4(a) => (
            RawAddr {
                v4: libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from(*a.ip()).to_be(),
                    },
                    sin_zero: [0; 8],
                },
            },
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        ),
        SocketAddr::V6(a) => (
            RawAddr {
                v6: libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                },
            },
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        ),
    }
}

/// Control buffer for one `UDP_SEGMENT` or `IP_TOS`/`UDP_GRO` message set, 8-aligned.
type Cmsg = [u64; 8];

/// Send `msgs` (all leaving from `sock`) in order with `sendmmsg`. When `gso_segments > 1`,
/// runs of consecutive datagrams to the same destination, all of one size but the last, travel
/// as one GSO message (`UDP_SEGMENT`) of up to `gso_segments` datagrams: the kernel cuts it
/// into the same datagrams. The socket blocks when its buffer is full (pacing the sender to
/// its link); a message the kernel refuses is dropped and counted.
pub(crate) fn send_batch(
    sock: &UdpSocket,
    buf: &[u8],
    msgs: &[TxDatagram],
    gso_segments: usize,
) -> SendOutcome {
    let gso_segments = gso_segments.clamp(1, MAX_GSO_SEGMENTS);
    let mut out = SendOutcome::default();
    let mut i = 0;
    while i < msgs.len() {
        // SAFETY: all-zero is a valid value of these plain C structs (null pointers, zero
        // lengths); every entry used below is filled in before the call.
        let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut iovs: [libc::iovec; MAX_IOVS] = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut addrs: [RawAddr; BATCH] = unsafe { std::mem::zeroed() };
        let mut cmsgs: [Cmsg; BATCH] = [[0; 8]; BATCH];
        // Datagrams carried by each message of this chunk.
        let mut segments = [0usize; BATCH];
        // Index of each message's first iovec.
        let mut first_iov = [0usize; BATCH];
        let (mut nh, mut ni) = (0usize, 0usize);
        while nh < BATCH {
            let Some(first) = msgs.get(i) else { break };
            let mut n = 1;
            let mut bytes = first.len;
            while n < gso_segments {
                let (Some(prev), Some(next)) = (msgs.get(i + n - 1), msgs.get(i + n)) else {
                    break;
                };
                if next.to != first.to
                    || prev.len != first.len
                    || next.len > first.len
                    || next.len == 0
                    || bytes + next.len > MAX_GSO_BYTES
                {
                    break;
                }
                bytes += next.len;
                n += 1;
            }
            if ni + n > MAX_IOVS {
                break;
            }
            for (k, m) in msgs.iter().skip(i).take(n).enumerate() {
                let Some(data) = buf.get(m.start..m.start + m.len) else {
                    continue;
                };
                iovs[ni + k] = libc::iovec {
                    iov_base: data.as_ptr() as *mut libc::c_void,
                    iov_len: data.len(),
                };
            }
            let (addr, addr_len) = raw_addr(&first.to);
            addrs[nh] = addr;
            hdrs[nh].msg_hdr.msg_namelen = addr_len;
            if n > 1 {
                let size = u16::try_from(first.len).unwrap_or(u16::MAX);
                let cm = &mut cmsgs[nh];
                // SAFETY: `hdr` is a local msghdr whose control pointer and length describe
                // `cm` (64 bytes, 8-aligned, more than CMSG_SPACE(2)), so the first header and
                // its 2 data bytes lie inside `cm`.
                unsafe {
                    let mut hdr: libc::msghdr = std::mem::zeroed();
                    hdr.msg_control = cm.as_mut_ptr().cast();
                    hdr.msg_controllen = libc::CMSG_SPACE(2) as _;
                    let c = libc::CMSG_FIRSTHDR(&hdr);
                    (*c).cmsg_level = libc::SOL_UDP;
                    (*c).cmsg_type = libc::UDP_SEGMENT;
                    (*c).cmsg_len = libc::CMSG_LEN(2) as _;
                    std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), size);
                }
            }
            first_iov[nh] = ni;
            segments[nh] = n;
            nh += 1;
            ni += n;
            i += n;
        }
        // Second pass, once every array is filled: point the headers into them.
        let (iov_ptr, addr_ptr, cmsg_ptr) =
            (iovs.as_mut_ptr(), addrs.as_mut_ptr(), cmsgs.as_mut_ptr());
        for (k, h) in hdrs.iter_mut().take(nh).enumerate() {
            let h = &mut h.msg_hdr;
            // SAFETY: `k < nh <= BATCH` and `first_iov[k] + segments[k] <= ni <= MAX_IOVS`:
            // every offset stays inside its array.
            unsafe {
                h.msg_name = addr_ptr.add(k).cast();
                h.msg_iov = iov_ptr.add(first_iov[k]);
                if segments[k] > 1 {
                    h.msg_control = cmsg_ptr.add(k).cast();
                    h.msg_controllen = libc::CMSG_SPACE(2) as _;
                }
            }
            h.msg_iovlen = segments[k] as _;
        }
        let mut done = 0;
        while done < nh {
            out.calls += 1;
            // SAFETY: `hdrs[done..nh]` are filled in: each points at its `addrs` entry, its
            // `iovs` run (over `buf`, alive and unmodified for the call) and, for GSO, its
            // `cmsgs` buffer, all with their true lengths; the kernel only reads them and
            // writes `msg_len`.
            let r = unsafe {
                libc::sendmmsg(
                    sock.as_raw_fd(),
                    hdrs[done..].as_mut_ptr(),
                    (nh - done) as libc::c_uint,
                    0,
                )
            };
            if r > 0 {
                let sent = r as usize;
                out.sent += segments[done..done + sent].iter().sum::<usize>() as u64;
                done += sent;
                continue;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::trace!(%e, "udp0: datagram not sent");
            out.dropped += segments[done] as u64;
            done += 1;
        }
    }
    out
}

/// One received datagram (a GRO receive is split into its datagrams by the caller).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Received {
    /// Where it lies in the batch's buffer: `slot`'s bytes `..len`.
    pub slot: usize,
    pub len: usize,
    /// Sender.
    pub from: SocketAddr,
    /// The ECN field read `11` (Congestion Experienced).
    pub ce: bool,
    /// With UDP GRO, the size of each coalesced datagram (the last may be shorter); 0 when the
    /// receive holds one datagram.
    pub segment: usize,
}

/// Buffers for one `recvmmsg` call of up to [`BATCH`] datagrams.
pub(crate) struct RecvBatch {
    slot_len: usize,
    bufs: Vec<u8>,
    addrs: Vec<libc::sockaddr_storage>,
    cmsgs: Vec<Cmsg>,
    /// What the last [`RecvBatch::recv`] returned.
    pub got: Vec<Received>,
}

impl RecvBatch {
    /// Room for [`BATCH`] datagrams of up to `slot_len` bytes each.
    pub fn new(slot_len: usize) -> RecvBatch {
        RecvBatch {
            slot_len,
            bufs: vec![0; slot_len * BATCH],
            // SAFETY: all-zero is a valid sockaddr_storage.
            addrs: vec![unsafe { std::mem::zeroed() }; BATCH],
            cmsgs: vec![[0; 8]; BATCH],
            got: Vec::with_capacity(BATCH),
        }
    }

    /// The bytes of a received datagram (or GRO run).
    pub fn bytes(&self, r: &Received) -> Option<&[u8]> {
        let start = r.slot.checked_mul(self.slot_len)?;
        self.bufs.get(start..start.checked_add(r.len)?)
    }

    /// Receive what `sock` holds, up to [`BATCH`] datagrams, without blocking. Returns the
    /// number of receives (0 when none is queued); truncated or non-IP ones are left out of
    /// [`RecvBatch::got`].
    pub fn recv(&mut self, sock: &UdpSocket) -> std::io::Result<usize> {
        self.got.clear();
        // SAFETY: all-zero is a valid value of these plain C structs.
        let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut iovs: [libc::iovec; BATCH] = unsafe { std::mem::zeroed() };
        let slot_len = self.slot_len;
        for (k, ((chunk, iov), (addr, cmsg))) in self
            .bufs
            .chunks_exact_mut(slot_len)
            .zip(iovs.iter_mut())
            .zip(self.addrs.iter_mut().zip(self.cmsgs.iter_mut()))
            .enumerate()
        {
            *iov = libc::iovec {
                iov_base: chunk.as_mut_ptr().cast(),
                iov_len: chunk.len(),
            };
            let h = &mut hdrs[k].msg_hdr;
            h.msg_name = (addr as *mut libc::sockaddr_storage).cast();
            h.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            h.msg_iov = iov;
            h.msg_iovlen = 1;
            h.msg_control = cmsg.as_mut_ptr().cast();
            h.msg_controllen = std::mem::size_of::<Cmsg>() as _;
        }
        let n = loop {
            // SAFETY: every header points at its own `iovs` entry (over a distinct slot of
            // `bufs`), `addrs` entry and `cmsgs` buffer, all alive and exclusively borrowed
            // for the call, with their true lengths; the kernel writes within them.
            let n = unsafe {
                libc::recvmmsg(
                    sock.as_raw_fd(),
                    hdrs.as_mut_ptr(),
                    BATCH as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            if n >= 0 {
                break n as usize;
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => continue,
                std::io::ErrorKind::WouldBlock => return Ok(0),
                _ => return Err(e),
            }
        };
        for (slot, h) in hdrs.iter().take(n).enumerate() {
            let msg = &h.msg_hdr;
            if msg.msg_flags & libc::MSG_TRUNC != 0 {
                tracing::debug!("udp0: oversized datagram dropped");
                continue;
            }
            let (mut ce, mut segment) = (false, 0usize);
            // SAFETY: the CMSG_* macros walk the control buffer the kernel filled, bounded by
            // `msg_controllen`; a header they return lies inside `cmsgs[slot]`, and the kernel
            // puts the announced data after it (one byte for IP_TOS, an int for UDP_GRO),
            // checked against `cmsg_len` before it is read.
            unsafe {
                let mut c = libc::CMSG_FIRSTHDR(msg);
                while !c.is_null() {
                    let ch = &*c;
                    let data_len =
                        (ch.cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                    if ch.cmsg_level == libc::IPPROTO_IP
                        && ch.cmsg_type == libc::IP_TOS
                        && data_len >= 1
                    {
                        ce = *libc::CMSG_DATA(c) & ECN_CE == ECN_CE;
                    } else if ch.cmsg_level == libc::SOL_UDP
                        && ch.cmsg_type == libc::UDP_GRO
                        && data_len >= std::mem::size_of::<libc::c_int>()
                    {
                        let size =
                            std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                        segment = usize::try_from(size).unwrap_or(0);
                    }
                    c = libc::CMSG_NXTHDR(msg, c);
                }
            }
            let Some(from) = self.addrs.get(slot).and_then(sockaddr_to_std) else {
                continue;
            };
            self.got.push(Received {
                slot,
                len: (h.msg_len as usize).min(slot_len),
                from,
                ce,
                segment,
            });
        }
        Ok(n)
    }
}

/// Turn UDP GRO on for `sock` (receives then may coalesce datagrams of one sender).
pub(crate) fn enable_gro(sock: &UdpSocket) -> std::io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from `&on`, a live local.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_UDP,
            libc::UDP_GRO,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn sockaddr_to_std(addr: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(addr.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in, which it is large and
            // aligned enough for.
            let a =
                unsafe { &*(addr as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for sockaddr_in6.
            let a =
                unsafe { &*(addr as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            Some(SocketAddr::V6(SocketAddrV6::new(
                a.sin6_addr.s6_addr.into(),
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (UdpSocket, UdpSocket) {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").unwrap();
        (a, b)
    }

    fn recv_all(b: &UdpSocket, rx: &mut RecvBatch, want: usize) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.len() < want {
            assert!(
                std::time::Instant::now() < deadline,
                "datagrams missing: {}",
                got.len()
            );
            rx.recv(b).unwrap();
            for r in rx.got.clone() {
                let bytes = rx.bytes(&r).unwrap();
                if r.segment == 0 {
                    got.push(bytes.to_vec());
                } else {
                    got.extend(bytes.chunks(r.segment).map(<[u8]>::to_vec));
                }
            }
            std::thread::yield_now();
        }
        got
    }

    fn batch_to(b: &UdpSocket, lens: &[usize]) -> TxBatch {
        let to = b.local_addr().unwrap();
        let mut batch = TxBatch::default();
        for (i, &len) in lens.iter().enumerate() {
            let body = vec![i as u8; len];
            batch.push(0, to, [&[0xee], &body]);
        }
        batch
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn batch_arrives_whole_and_in_order_with_and_without_gso() {
        for gso in [1, 8, MAX_GSO_SEGMENTS] {
            let (a, b) = pair();
            // A run of equal sizes, a short one ending it, and sizes that cannot join a run
            // (fewer bytes in all than a default receive buffer holds).
            let mut lens = vec![1000; 60];
            lens.extend([10, 1000, 1000, 3, 700, 700]);
            let batch = batch_to(&b, &lens);
            let out = send_batch(&a, &batch.buf, &batch.msgs, gso);
            assert_eq!(out.sent, lens.len() as u64, "gso {gso}: {out:?}");
            assert_eq!(out.dropped, 0);
            if gso > 1 {
                assert!(out.calls >= 1);
            }
            let mut rx = RecvBatch::new(2048);
            let got = recv_all(&b, &mut rx, lens.len());
            for (i, (d, &len)) in got.iter().zip(&lens).enumerate() {
                assert_eq!(d.len(), len + 1, "gso {gso} datagram {i}");
                assert_eq!(d[0], 0xee);
                assert!(
                    d[1..].iter().all(|&x| x == i as u8),
                    "gso {gso} datagram {i}"
                );
            }
            assert!(rx
                .got
                .iter()
                .all(|r| !r.ce && r.from == a.local_addr().unwrap()));
        }
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn gro_receive_reports_segment_size() {
        let (a, b) = pair();
        enable_gro(&b).unwrap();
        let lens = vec![1200; 40];
        let batch = batch_to(&b, &lens);
        let out = send_batch(&a, &batch.buf, &batch.msgs, MAX_GSO_SEGMENTS);
        assert_eq!(out.sent, 40);
        let mut rx = RecvBatch::new(65_536);
        let got = recv_all(&b, &mut rx, lens.len());
        assert_eq!(got.len(), 40);
        assert!(got.iter().all(|d| d.len() == 1201));
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn empty_socket_returns_nothing() {
        let (_a, b) = pair();
        let mut rx = RecvBatch::new(2048);
        assert_eq!(rx.recv(&b).unwrap(), 0);
        assert!(rx.got.is_empty());
    }
}
