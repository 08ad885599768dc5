//! Socket calls std and rustix do not cover: receiving a datagram together with its IP TOS
//! byte (`IP_RECVTOS` ancillary data), which carries the ECN Congestion Experienced mark.
//!
//! Owns the one `unsafe` block of this provider (a `recvmsg(2)` call over buffers it owns).
#![allow(unsafe_code)]

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::AsRawFd;

/// One received datagram.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Received {
    /// Bytes written to the buffer.
    pub len: usize,
    /// Sender.
    pub from: SocketAddr,
    /// The ECN field read `11` (Congestion Experienced).
    pub ce: bool,
}

/// ECN codepoint Congestion Experienced, the low two bits of the TOS byte.
const ECN_CE: u8 = 0b11;

/// Receive one datagram without blocking. `Ok(None)` when none is queued.
pub(crate) fn recv_with_tos(sock: &UdpSocket, buf: &mut [u8]) -> std::io::Result<Option<Received>> {
    // SAFETY: all-zero is a valid value of these plain C structs.
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut cmsg = [0u64; 8]; // 64 bytes, 8-aligned: room for one IP_TOS message
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: as above.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&mut addr as *mut libc::sockaddr_storage).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cmsg) as _;
    let n = loop {
        // SAFETY: `msg` points at `addr`, `iov` (over `buf`) and `cmsg`, all live and exclusively
        // borrowed for the call, with their true lengths; the kernel writes within them.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    };
    let mut ce = false;
    // SAFETY: the CMSG_* macros walk the control buffer the kernel filled, bounded by
    // `msg_controllen`; a header they return lies inside `cmsg`, and for IP_TOS the kernel puts
    // at least one data byte after it.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            let h = &*c;
            if h.cmsg_level == libc::IPPROTO_IP
                && h.cmsg_type == libc::IP_TOS
                && h.cmsg_len as usize > libc::CMSG_LEN(0) as usize
            {
                let tos = *libc::CMSG_DATA(c);
                ce = tos & ECN_CE == ECN_CE;
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let from = sockaddr_to_std(&addr).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "datagram from a non-IP address",
        )
    })?;
    Ok(Some(Received {
        len: n.min(buf.len()),
        from,
        ce,
    }))
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
