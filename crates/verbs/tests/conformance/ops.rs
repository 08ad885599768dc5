//! Every opcode of the data path against a peer process: SEND (with and without immediate data),
//! RDMA WRITE (with and without immediate), RDMA READ, CAS and FETCH_AND_ADD; SGE lists, inline
//! sends, signaled and unsignaled requests, `wr_id`/`byte_len`/opcode in completions, and the RC
//! ordering rules (a batch completes in post order; data written before a SEND is visible when
//! the SEND's receive completes).

use fabriq_verbs::{
    AccessFlags, Capabilities, Lkey, MemoryRegion, QpCaps, QpState, SendFlags, SendWr, Sge,
    WcOpcode, WcStatus, WrOpcode,
};

use crate::harness::{
    expect_wc, fail, pattern, read_mr, wait_until, Env, Node, NodeOpts, TestProvider, TestResult,
};
use crate::peer::{connected, MrDesc, Peer, PeerSetup, PeerSge};

const LOCAL_ALL: AccessFlags = AccessFlags::ALL;

fn recv_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE
}

/// Three SENDs of different sizes land in three receives, in order, with the right `wr_id`,
/// `byte_len`, opcode and no immediate data; the sender sees its `wr_id` back.
pub fn rc_send_delivers_payload_wr_id_and_byte_len<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(3 * 4096, recv_access())?;
    for i in 0..3u64 {
        let sge = PeerSge {
            mr: rmr.id,
            offset: i as usize * 4096,
            len: 4096,
        };
        peer.post_recv(0xabcd_0000 + i, &[sge])?;
    }
    let mr = node.mr(3 * 4096, LOCAL_ALL)?;
    let sizes = [1000usize, 1, 4096];
    for (i, &len) in sizes.iter().enumerate() {
        mr.write_at(i * 4096, &pattern(i as u8 + 1, len))?;
    }
    let sges: Vec<[Sge; 1]> = sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| mr.sge(i * 4096, len as u32).map(|s| [s]))
        .collect::<Result<_, _>>()?;
    let ids = [0x1234_5678_9abc_def0u64, u64::MAX, 0];
    let wrs: Vec<SendWr<'_>> = sges
        .iter()
        .zip(ids)
        .map(|(s, id)| SendWr::new(id, s, WrOpcode::Send))
        .collect();
    node.qp.post_send(&wrs)?;
    let wcs = node.cq.wait(3)?;
    for (wc, id) in wcs.iter().zip(ids) {
        expect_wc(wc, id, WcStatus::Success, "SEND")?;
        if wc.opcode != WcOpcode::Send || wc.qp_num != node.qp.qp_num() {
            return Err(fail(format!(
                "SEND completion has wrong opcode or qp_num: {wc:?}"
            )));
        }
    }
    let rwcs = peer.poll(3)?;
    for (i, wc) in rwcs.iter().enumerate() {
        if wc.wr_id != 0xabcd_0000 + i as u64
            || wc.status != WcStatus::Success
            || wc.opcode != WcOpcode::Recv
            || wc.byte_len as usize != sizes[i]
            || wc.imm_data.is_some()
        {
            return Err(fail(format!(
                "receive {i}: expected wr_id {:#x}, Recv, Success, byte_len {}, no imm; got {wc:?}",
                0xabcd_0000 + i as u64,
                sizes[i]
            )));
        }
        let got = peer.read(&rmr, i * 4096, 4096)?;
        if got[..sizes[i]] != pattern(i as u8 + 1, sizes[i])[..] {
            return Err(fail(format!(
                "receive {i}: payload differs from what was sent"
            )));
        }
        if got[sizes[i]..].iter().any(|&b| b != 0) {
            return Err(fail(format!(
                "receive {i}: bytes beyond byte_len were written"
            )));
        }
    }
    Ok(())
}

/// SEND_WITH_IMM delivers its 32-bit immediate in the receive completion.
pub fn rc_send_with_imm_delivers_immediate_data<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND | Capabilities::SEND_IMM) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(256, recv_access())?;
    peer.post_recv(
        7,
        &[PeerSge {
            mr: rmr.id,
            offset: 0,
            len: 256,
        }],
    )?;
    let mr = node.mr(256, LOCAL_ALL)?;
    mr.write_at(0, &pattern(5, 100))?;
    let s = [mr.sge(0, 100)?];
    node.qp.post_send(&[SendWr::new(
        70,
        &s,
        WrOpcode::SendWithImm { imm: 0xdead_beef },
    )])?;
    let wc = node.cq.wait(1)?[0];
    expect_wc(&wc, 70, WcStatus::Success, "SEND_WITH_IMM")?;
    if wc.opcode != WcOpcode::Send {
        return Err(fail(format!(
            "SEND_WITH_IMM completes with opcode Send, got {wc:?}"
        )));
    }
    let r = peer.poll(1)?[0];
    if r.wr_id != 7
        || r.status != WcStatus::Success
        || r.opcode != WcOpcode::Recv
        || r.imm_data != Some(0xdead_beef)
        || r.byte_len != 100
    {
        return Err(fail(format!(
            "receive of SEND_WITH_IMM: expected Recv with imm 0xdeadbeef and 100 bytes, got {r:?}"
        )));
    }
    if peer.read(&rmr, 0, 100)? != pattern(5, 100) {
        return Err(fail("SEND_WITH_IMM payload differs"));
    }
    Ok(())
}

/// A SEND with an empty SGE list consumes a receive and completes with `byte_len` 0.
pub fn rc_zero_length_send_completes<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(64, recv_access())?;
    peer.post_recv(
        1,
        &[PeerSge {
            mr: rmr.id,
            offset: 0,
            len: 64,
        }],
    )?;
    node.qp.post_send(&[SendWr::new(2, &[], WrOpcode::Send)])?;
    expect_wc(
        &node.cq.wait(1)?[0],
        2,
        WcStatus::Success,
        "zero-length SEND",
    )?;
    let r = peer.poll(1)?[0];
    if r.wr_id != 1 || r.status != WcStatus::Success || r.byte_len != 0 {
        return Err(fail(format!(
            "zero-length receive: expected Success, 0 bytes, got {r:?}"
        )));
    }
    Ok(())
}

/// RDMA WRITE places exactly the gathered bytes at the remote address, consumes no receive, and
/// completes with opcode RdmaWrite.
pub fn rc_write_places_data_in_remote_mr<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::WRITE) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let spare = peer.reg_mr(64, recv_access())?;
    peer.post_recv(
        9,
        &[PeerSge {
            mr: spare.id,
            offset: 0,
            len: 64,
        }],
    )?;
    let mr = node.mr(4096, LOCAL_ALL)?;
    mr.write_at(0, &pattern(3, 3000))?;
    let s = [mr.sge(0, 3000)?];
    node.qp.post_send(&[SendWr::new(
        11,
        &s,
        WrOpcode::Write {
            remote: rmr.at(100),
        },
    )])?;
    let wc = node.cq.wait(1)?[0];
    expect_wc(&wc, 11, WcStatus::Success, "WRITE")?;
    if wc.opcode != WcOpcode::RdmaWrite {
        return Err(fail(format!(
            "WRITE completion opcode should be RdmaWrite: {wc:?}"
        )));
    }
    let got = peer.read(&rmr, 0, 8192)?;
    let mut want = vec![0u8; 8192];
    want[100..3100].copy_from_slice(&pattern(3, 3000));
    if got != want {
        let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        return Err(fail(format!(
            "remote region after WRITE differs at byte {first}"
        )));
    }
    let extra = peer.poll_ready()?;
    if !extra.is_empty() {
        return Err(fail(format!(
            "a plain WRITE produced completions at the target: {extra:?}"
        )));
    }
    Ok(())
}

/// RDMA WRITE_WITH_IMM places the data, consumes one receive (scatter list untouched) and
/// delivers the immediate with opcode RecvRdmaWithImm and the write's length.
pub fn rc_write_with_imm_places_data_and_consumes_a_receive<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    if !env.has(Capabilities::WRITE_IMM) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let rbuf = peer.reg_mr(64, recv_access())?;
    peer.post_recv(
        21,
        &[PeerSge {
            mr: rbuf.id,
            offset: 0,
            len: 64,
        }],
    )?;
    let mr = node.mr(4096, LOCAL_ALL)?;
    mr.write_at(0, &pattern(8, 512))?;
    let s = [mr.sge(0, 512)?];
    node.qp.post_send(&[SendWr::new(
        22,
        &s,
        WrOpcode::WriteWithImm {
            remote: rmr.at(64),
            imm: 0x0102_0304,
        },
    )])?;
    let wc = node.cq.wait(1)?[0];
    expect_wc(&wc, 22, WcStatus::Success, "WRITE_WITH_IMM")?;
    if wc.opcode != WcOpcode::RdmaWrite {
        return Err(fail(format!(
            "WRITE_WITH_IMM completion opcode should be RdmaWrite: {wc:?}"
        )));
    }
    let r = peer.poll(1)?[0];
    if r.wr_id != 21
        || r.status != WcStatus::Success
        || r.opcode != WcOpcode::RecvRdmaWithImm
        || r.imm_data != Some(0x0102_0304)
        || r.byte_len != 512
    {
        return Err(fail(format!(
            "target completion of WRITE_WITH_IMM: expected RecvRdmaWithImm, imm 0x01020304, \
             byte_len 512, got {r:?}"
        )));
    }
    if peer.read(&rmr, 64, 512)? != pattern(8, 512) {
        return Err(fail("WRITE_WITH_IMM data not at the remote address"));
    }
    if peer.read(&rbuf, 0, 64)?.iter().any(|&b| b != 0) {
        return Err(fail("WRITE_WITH_IMM wrote into the receive's scatter list"));
    }
    // A zero-length WRITE_WITH_IMM is a pure notification: it still consumes a receive.
    peer.post_recv(23, &[])?;
    node.qp.post_send(&[SendWr::new(
        24,
        &[],
        WrOpcode::WriteWithImm {
            remote: rmr.at(0),
            imm: 99,
        },
    )])?;
    expect_wc(
        &node.cq.wait(1)?[0],
        24,
        WcStatus::Success,
        "zero-length WRITE_WITH_IMM",
    )?;
    let r = peer.poll(1)?[0];
    if r.wr_id != 23
        || r.status != WcStatus::Success
        || r.opcode != WcOpcode::RecvRdmaWithImm
        || r.imm_data != Some(99)
        || r.byte_len != 0
    {
        return Err(fail(format!(
            "zero-length WRITE_WITH_IMM: expected RecvRdmaWithImm, imm 99, byte_len 0, got {r:?}"
        )));
    }
    Ok(())
}

/// RDMA READ copies remote bytes into the local SGE, with opcode RdmaRead and `byte_len`.
pub fn rc_read_fetches_remote_data<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::READ) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(4096, AccessFlags::REMOTE_READ)?;
    peer.write(&rmr, 0, &pattern(4, 4096))?;
    let mr = node.mr(4096, LOCAL_ALL)?;
    let s = [mr.sge(5, 2000)?];
    node.qp
        .post_send(&[SendWr::new(31, &s, WrOpcode::Read { remote: rmr.at(10) })])?;
    let wc = node.cq.wait(1)?[0];
    expect_wc(&wc, 31, WcStatus::Success, "READ")?;
    if wc.opcode != WcOpcode::RdmaRead || wc.byte_len != 2000 {
        return Err(fail(format!(
            "READ completion: expected RdmaRead, byte_len 2000, got {wc:?}"
        )));
    }
    let got = read_mr(&mr, 0, 4096)?;
    let mut want = vec![0u8; 4096];
    want[5..2005].copy_from_slice(&pattern(4, 4096)[10..2010]);
    if got != want {
        return Err(fail(
            "local region after READ differs from the remote bytes",
        ));
    }
    Ok(())
}

/// A 1 MiB WRITE and READ-back and a 64 KiB SEND (many MTUs) arrive intact.
pub fn rc_large_write_and_read_round_trip<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::WRITE | Capabilities::READ | Capabilities::SEND) {
        return Ok(());
    }
    let len = (1usize << 20).min(env.attr.max_mr_size as usize);
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(
        len,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
    )?;
    let msg = 64 * 1024;
    let rbuf = peer.reg_mr(msg, recv_access())?;
    peer.post_recv(
        1,
        &[PeerSge {
            mr: rbuf.id,
            offset: 0,
            len: msg as u32,
        }],
    )?;
    let src = node.mr(len, LOCAL_ALL)?;
    let dst = node.mr(len, LOCAL_ALL)?;
    let data = pattern(42, len);
    src.write_at(0, &data)?;
    let ws = [src.sge(0, len as u32)?];
    let rs = [dst.sge(0, len as u32)?];
    let ss = [src.sge(7, msg as u32)?];
    node.qp.post_send(&[
        SendWr::new(1, &ws, WrOpcode::Write { remote: rmr.at(0) }),
        SendWr::new(2, &rs, WrOpcode::Read { remote: rmr.at(0) }),
        SendWr::new(3, &ss, WrOpcode::Send),
    ])?;
    let wcs = node.cq.wait(3)?;
    for (wc, id) in wcs.iter().zip(1..) {
        expect_wc(wc, id, WcStatus::Success, "large transfer")?;
    }
    if wcs[1].byte_len as usize != len {
        return Err(fail(format!(
            "READ of {len} bytes reports byte_len {}",
            wcs[1].byte_len
        )));
    }
    if read_mr(&dst, 0, len)? != data {
        return Err(fail("the region read back differs from the region written"));
    }
    if peer.read(&rmr, len - 4096, 4096)? != data[len - 4096..] {
        return Err(fail(
            "the tail of the remote region differs after the large WRITE",
        ));
    }
    let r = peer.poll(1)?[0];
    if r.status != WcStatus::Success || r.byte_len as usize != msg {
        return Err(fail(format!("64 KiB SEND: receive completion {r:?}")));
    }
    if peer.read(&rbuf, 0, msg)? != data[7..7 + msg] {
        return Err(fail("64 KiB SEND payload differs"));
    }
    Ok(())
}

/// CAS swaps only when the word equals `compare`, and always returns the original value.
pub fn rc_compare_and_swap_swaps_only_on_match<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::ATOMICS) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC)?;
    peer.write(&rmr, 8, &0x1111u64.to_ne_bytes())?;
    let mr = node.mr(64, LOCAL_ALL)?;
    mr.write_at(0, &[0xee; 16])?;
    let (s0, s1) = ([mr.sge(0, 8)?], [mr.sge(8, 8)?]);
    node.qp.post_send(&[
        SendWr::new(
            1,
            &s0,
            WrOpcode::AtomicCmpSwp {
                remote: rmr.at(8),
                compare: 0x2222,
                swap: 0x3333,
            },
        ),
        SendWr::new(
            2,
            &s1,
            WrOpcode::AtomicCmpSwp {
                remote: rmr.at(8),
                compare: 0x1111,
                swap: 0x4444,
            },
        ),
    ])?;
    let wcs = node.cq.wait(2)?;
    for (wc, id) in wcs.iter().zip(1..) {
        expect_wc(wc, id, WcStatus::Success, "CAS")?;
        if wc.opcode != WcOpcode::CompSwap || wc.byte_len != 8 {
            return Err(fail(format!(
                "CAS completion: expected CompSwap, byte_len 8: {wc:?}"
            )));
        }
    }
    let orig = mr.atomic_u64(0)?.load(std::sync::atomic::Ordering::Acquire);
    let orig2 = mr.atomic_u64(8)?.load(std::sync::atomic::Ordering::Acquire);
    if orig != 0x1111 || orig2 != 0x1111 {
        return Err(fail(format!(
            "CAS returned originals {orig:#x}, {orig2:#x}; both should be 0x1111"
        )));
    }
    let word = u64::from_ne_bytes(peer.read(&rmr, 8, 8)?.try_into().map_err(|_| fail("len"))?);
    if word != 0x4444 {
        return Err(fail(format!(
            "after a failed and a matching CAS the word is {word:#x}, expected 0x4444"
        )));
    }
    Ok(())
}

/// FETCH_AND_ADD returns the original value and adds (wrapping at 2^64).
pub fn rc_fetch_and_add_returns_original_and_adds<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::ATOMICS) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC)?;
    peer.write(&rmr, 0, &40u64.to_ne_bytes())?;
    peer.write(&rmr, 16, &(u64::MAX - 1).to_ne_bytes())?;
    let mr = node.mr(64, LOCAL_ALL)?;
    let (s0, s1, s2) = ([mr.sge(0, 8)?], [mr.sge(8, 8)?], [mr.sge(16, 8)?]);
    node.qp.post_send(&[
        SendWr::new(
            1,
            &s0,
            WrOpcode::AtomicFetchAdd {
                remote: rmr.at(0),
                add: 5,
            },
        ),
        SendWr::new(
            2,
            &s1,
            WrOpcode::AtomicFetchAdd {
                remote: rmr.at(0),
                add: 1 << 40,
            },
        ),
        SendWr::new(
            3,
            &s2,
            WrOpcode::AtomicFetchAdd {
                remote: rmr.at(16),
                add: 3,
            },
        ),
    ])?;
    let wcs = node.cq.wait(3)?;
    for (wc, id) in wcs.iter().zip(1..) {
        expect_wc(wc, id, WcStatus::Success, "FETCH_AND_ADD")?;
        if wc.opcode != WcOpcode::FetchAdd || wc.byte_len != 8 {
            return Err(fail(format!(
                "FAA completion: expected FetchAdd, byte_len 8: {wc:?}"
            )));
        }
    }
    let load = |off| {
        mr.atomic_u64(off)
            .map(|a| a.load(std::sync::atomic::Ordering::Acquire))
    };
    let got = (load(0)?, load(8)?, load(16)?);
    if got != (40, 45, u64::MAX - 1) {
        return Err(fail(format!(
            "FAA originals {got:?}, expected (40, 45, {})",
            u64::MAX - 1
        )));
    }
    let w0 = u64::from_ne_bytes(peer.read(&rmr, 0, 8)?.try_into().map_err(|_| fail("len"))?);
    let w2 = u64::from_ne_bytes(
        peer.read(&rmr, 16, 8)?
            .try_into()
            .map_err(|_| fail("len"))?,
    );
    if w0 != 45 + (1 << 40) || w2 != 1 {
        return Err(fail(format!(
            "FAA results {w0:#x}, {w2:#x}; expected {:#x}, 0x1 (wrapping)",
            45u64 + (1 << 40)
        )));
    }
    Ok(())
}

/// A SEND gathers three SGEs from two regions; the receive scatters the message over three SGEs
/// in order, filling each before the next.
pub fn rc_send_gathers_sge_list_and_receive_scatters<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    if env.attr.max_sge < 3 {
        env.skip(&format!("max_sge {} < 3", env.attr.max_sge));
        return Ok(());
    }
    let caps = QpCaps {
        max_send_sge: 3,
        max_recv_sge: 3,
        ..QpCaps::default()
    };
    let opts = NodeOpts {
        caps,
        ..NodeOpts::default()
    };
    let (node, mut peer) = connected(
        env,
        &opts,
        PeerSetup {
            caps,
            ..PeerSetup::default()
        },
    )?;
    let rmr = peer.reg_mr(4096, recv_access())?;
    let scatter = [
        PeerSge {
            mr: rmr.id,
            offset: 0,
            len: 200,
        },
        PeerSge {
            mr: rmr.id,
            offset: 1000,
            len: 100,
        },
        PeerSge {
            mr: rmr.id,
            offset: 2000,
            len: 300,
        },
    ];
    peer.post_recv(5, &scatter)?;
    let a = node.mr(4096, LOCAL_ALL)?;
    let b = node.mr(4096, LOCAL_ALL)?;
    a.write_at(0, &pattern(1, 4096))?;
    b.write_at(0, &pattern(2, 4096))?;
    let gather = [a.sge(10, 100)?, b.sge(500, 1)?, a.sge(3000, 250)?];
    let mut msg = pattern(1, 4096)[10..110].to_vec();
    msg.push(pattern(2, 4096)[500]);
    msg.extend_from_slice(&pattern(1, 4096)[3000..3250]);
    node.qp
        .post_send(&[SendWr::new(6, &gather, WrOpcode::Send)])?;
    expect_wc(&node.cq.wait(1)?[0], 6, WcStatus::Success, "gathered SEND")?;
    let r = peer.poll(1)?[0];
    if r.status != WcStatus::Success || r.byte_len != 351 {
        return Err(fail(format!(
            "scattered receive: expected Success, 351 bytes, got {r:?}"
        )));
    }
    let got = peer.read(&rmr, 0, 4096)?;
    let mut want = vec![0u8; 4096];
    want[0..200].copy_from_slice(&msg[0..200]);
    want[1000..1100].copy_from_slice(&msg[200..300]);
    want[2000..2051].copy_from_slice(&msg[300..351]);
    if got != want {
        let first = got.iter().zip(&want).position(|(x, y)| x != y).unwrap_or(0);
        return Err(fail(format!(
            "scatter/gather result differs at receive byte {first}"
        )));
    }
    Ok(())
}

/// WRITE gathers an SGE list into one remote range; READ scatters one remote range over an SGE
/// list.
pub fn rc_write_gathers_and_read_scatters_sge_lists<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::WRITE | Capabilities::READ) {
        return Ok(());
    }
    if env.attr.max_sge < 3 {
        env.skip(&format!("max_sge {} < 3", env.attr.max_sge));
        return Ok(());
    }
    let caps = QpCaps {
        max_send_sge: 3,
        max_recv_sge: 3,
        ..QpCaps::default()
    };
    let opts = NodeOpts {
        caps,
        ..NodeOpts::default()
    };
    let (node, mut peer) = connected(
        env,
        &opts,
        PeerSetup {
            caps,
            ..PeerSetup::default()
        },
    )?;
    let rmr = peer.reg_mr(
        4096,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
    )?;
    let src = node.mr(4096, LOCAL_ALL)?;
    src.write_at(0, &pattern(7, 4096))?;
    let gather = [src.sge(0, 10)?, src.sge(100, 20)?, src.sge(4000, 96)?];
    let mut msg = pattern(7, 4096)[0..10].to_vec();
    msg.extend_from_slice(&pattern(7, 4096)[100..120]);
    msg.extend_from_slice(&pattern(7, 4096)[4000..4096]);
    let dst = node.mr(4096, LOCAL_ALL)?;
    let scatter = [dst.sge(50, 26)?, dst.sge(1000, 4)?, dst.sge(2000, 96)?];
    node.qp.post_send(&[
        SendWr::new(
            1,
            &gather,
            WrOpcode::Write {
                remote: rmr.at(300),
            },
        ),
        SendWr::new(
            2,
            &scatter,
            WrOpcode::Read {
                remote: rmr.at(300),
            },
        ),
    ])?;
    let wcs = node.cq.wait(2)?;
    expect_wc(&wcs[0], 1, WcStatus::Success, "gathered WRITE")?;
    expect_wc(&wcs[1], 2, WcStatus::Success, "scattered READ")?;
    if peer.read(&rmr, 300, 126)? != msg {
        return Err(fail("gathered WRITE did not place the SGEs back to back"));
    }
    let got = read_mr(&dst, 0, 4096)?;
    let mut want = vec![0u8; 4096];
    want[50..76].copy_from_slice(&msg[0..26]);
    want[1000..1004].copy_from_slice(&msg[26..30]);
    want[2000..2096].copy_from_slice(&msg[30..126]);
    if got != want {
        return Err(fail("scattered READ did not fill the SGEs in order"));
    }
    Ok(())
}

/// A connected pair whose node's QP asks for `inline` bytes of inline data.
fn connected_with_inline<P: TestProvider>(
    env: &Env<P>,
    inline: u32,
) -> Result<(Node, Peer), Box<dyn std::error::Error>> {
    connected(
        env,
        &NodeOpts {
            caps: QpCaps {
                max_inline_data: inline,
                ..QpCaps::default()
            },
            ..NodeOpts::default()
        },
        PeerSetup::default(),
    )
}

/// What [`inline_setup`] builds: the pair, the peer's region and the inline size asked for.
type InlineSetup = (Node, Peer, MrDesc, u32);

/// The INLINE tests' set-up, when the device has INLINE and SEND with at least `min_inline`
/// bytes of it: a connected pair whose node's QP asks for up to 64 bytes of inline data, and in
/// the peer a 4 KiB region with `access` and a 256-byte receive posted at each
/// `(wr_id, offset)` of `receives`; with the inline size asked for.
fn inline_setup<P: TestProvider>(
    env: &Env<P>,
    min_inline: u32,
    access: AccessFlags,
    receives: &[(u64, usize)],
) -> Result<Option<InlineSetup>, Box<dyn std::error::Error>> {
    if !env.has(Capabilities::INLINE | Capabilities::SEND) {
        return Ok(None);
    }
    let inline = env.attr.max_inline_data.min(64);
    if inline < min_inline {
        return Ok(None);
    }
    let (node, mut peer) = connected_with_inline(env, inline)?;
    let rmr = peer.reg_mr(4096, access)?;
    for &(id, offset) in receives {
        peer.post_recv(
            id,
            &[PeerSge {
                mr: rmr.id,
                offset,
                len: 256,
            }],
        )?;
    }
    Ok(Some((node, peer, rmr, inline)))
}

/// An INLINE send (and write) copies the payload at post time: its SGE needs no registered
/// memory, and changing the buffer right after `post_send` does not change what arrives.
pub fn rc_inline_send_copies_payload_at_post_time<P: TestProvider>(env: &Env<P>) -> TestResult {
    let write = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let Some((node, mut peer, rmr, inline)) = inline_setup(env, 0, write, &[(1, 0)])? else {
        return Ok(());
    };
    let len = inline as usize;
    let mut buf = pattern(11, len);
    let sge = [Sge {
        addr: buf.as_mut_ptr() as u64,
        length: len as u32,
        lkey: Lkey(0),
    }];
    node.qp
        .post_send(&[SendWr::new(1, &sge, WrOpcode::Send)
            .with_flags(SendFlags::SIGNALED | SendFlags::INLINE)])?;
    buf.fill(0xaa);
    let mut wants_write = false;
    if env.attr.capabilities.contains(Capabilities::WRITE) {
        buf.copy_from_slice(&pattern(12, len));
        let sge = [Sge {
            addr: buf.as_mut_ptr() as u64,
            length: len as u32,
            lkey: Lkey(0),
        }];
        node.qp.post_send(&[SendWr::new(
            2,
            &sge,
            WrOpcode::Write {
                remote: rmr.at(1024),
            },
        )
        .with_flags(SendFlags::SIGNALED | SendFlags::INLINE)])?;
        buf.fill(0x55);
        wants_write = true;
    }
    drop(buf);
    let wcs = node.cq.wait(1 + usize::from(wants_write))?;
    expect_wc(&wcs[0], 1, WcStatus::Success, "inline SEND")?;
    let r = peer.poll(1)?[0];
    if r.status != WcStatus::Success || r.byte_len != inline {
        return Err(fail(format!(
            "inline SEND receive: expected {inline} bytes, got {r:?}"
        )));
    }
    if peer.read(&rmr, 0, len)? != pattern(11, len) {
        return Err(fail(
            "inline SEND delivered the buffer as changed after post_send",
        ));
    }
    if wants_write {
        expect_wc(&wcs[1], 2, WcStatus::Success, "inline WRITE")?;
        if peer.read(&rmr, 1024, len)? != pattern(12, len) {
            return Err(fail(
                "inline WRITE delivered the buffer as changed after post_send",
            ));
        }
    }
    Ok(())
}

/// An INLINE request whose SGE names memory this process cannot read (verbs does not look at
/// an INLINE SGE's lkey, so nothing was checked at registration) is refused at post time or
/// completes with LocalProtection: a typed error, never a fault of the caller's process.
pub fn rc_inline_sge_of_unreadable_memory_is_an_error<P: TestProvider>(env: &Env<P>) -> TestResult {
    let Some((node, mut peer, _rmr, _)) =
        inline_setup(env, 8, AccessFlags::LOCAL_WRITE, &[(1, 0)])?
    else {
        return Ok(());
    };
    // The first page of the address space is never mapped (vm.mmap_min_addr).
    let sge = [Sge {
        addr: 16,
        length: 8,
        lkey: Lkey(0),
    }];
    match node
        .qp
        .post_send(&[SendWr::new(5, &sge, WrOpcode::Send)
            .with_flags(SendFlags::SIGNALED | SendFlags::INLINE)])
    {
        Err(e) if e.index == 0 => return Ok(()),
        Err(e) => return Err(fail(format!("refusal names index {}, expected 0", e.index))),
        Ok(()) => {}
    }
    let wc = node.cq.wait(1)?[0];
    expect_wc(
        &wc,
        5,
        WcStatus::LocalProtection,
        "INLINE SEND from unreadable memory",
    )?;
    if peer
        .poll_ready()?
        .iter()
        .any(|c| c.status == WcStatus::Success)
    {
        return Err(fail("the peer received a message from unreadable memory"));
    }
    Ok(())
}

/// Inline data (`SendWr::with_inline_data`: bytes of ordinary memory, no SGE) arrives ahead of
/// the SGE list's bytes, copied at post time, on SEND and on WRITE; with nothing else the
/// request is the inline data alone; a READ with inline data is refused at post time.
pub fn rc_inline_data_goes_ahead_of_the_sge_list<P: TestProvider>(env: &Env<P>) -> TestResult {
    let write = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let Some((node, mut peer, rmr, _)) = inline_setup(env, 32, write, &[(1, 0), (2, 256)])? else {
        return Ok(());
    };
    let mut head = pattern(21, 12);
    let mut body = pattern(22, 20);
    let sge = [Sge {
        addr: body.as_mut_ptr() as u64,
        length: body.len() as u32,
        lkey: Lkey(0),
    }];
    node.qp.post_send(&[SendWr::new(1, &sge, WrOpcode::Send)
        .with_flags(SendFlags::SIGNALED)
        .with_inline_data(&head)])?;
    head.fill(0xaa);
    body.fill(0xaa);
    let alone = pattern(23, 16);
    node.qp.post_send(&[SendWr::new(2, &[], WrOpcode::Send)
        .with_flags(SendFlags::SIGNALED)
        .with_inline_data(&alone)])?;
    let mut want = pattern(21, 12);
    want.extend_from_slice(&pattern(22, 20));
    let mut posted = 2;
    if env.attr.capabilities.contains(Capabilities::WRITE) {
        let data = pattern(24, 24);
        node.qp.post_send(&[SendWr::new(
            3,
            &[],
            WrOpcode::Write {
                remote: rmr.at(1024),
            },
        )
        .with_flags(SendFlags::SIGNALED)
        .with_inline_data(&data)])?;
        posted += 1;
    }
    if env.attr.capabilities.contains(Capabilities::READ) {
        let mut dst = vec![0u8; 8];
        let sge = [Sge {
            addr: dst.as_mut_ptr() as u64,
            length: 8,
            lkey: Lkey(0),
        }];
        let refused =
            node.qp
                .post_send(&[SendWr::new(4, &sge, WrOpcode::Read { remote: rmr.at(0) })
                    .with_inline_data(&[1, 2, 3])]);
        if refused.is_ok() {
            return Err(fail("a READ with inline data was accepted"));
        }
    }
    let wcs = node.cq.wait(posted)?;
    expect_wc(&wcs[0], 1, WcStatus::Success, "SEND with inline data")?;
    expect_wc(&wcs[1], 2, WcStatus::Success, "SEND of inline data alone")?;
    let r = peer.poll(2)?;
    if r[0].status != WcStatus::Success || r[0].byte_len != 32 {
        return Err(fail(format!("SEND with inline data: receive {:?}", r[0])));
    }
    if peer.read(&rmr, 0, 32)? != want {
        return Err(fail("inline data and SGE bytes did not arrive in order"));
    }
    if r[1].status != WcStatus::Success || r[1].byte_len != 16 {
        return Err(fail(format!("inline data alone: receive {:?}", r[1])));
    }
    if peer.read(&rmr, 256, 16)? != alone {
        return Err(fail("inline data alone arrived changed"));
    }
    if posted == 3 {
        expect_wc(&wcs[2], 3, WcStatus::Success, "WRITE of inline data")?;
        if peer.read(&rmr, 1024, 24)? != pattern(24, 24) {
            return Err(fail("WRITE of inline data arrived changed"));
        }
    }
    Ok(())
}

/// An INLINE request above the QP's `max_inline_data` is refused at post time, and the QP keeps
/// working.
pub fn rc_inline_above_max_inline_is_refused<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::INLINE | Capabilities::SEND) {
        return Ok(());
    }
    let inline = env.attr.max_inline_data.min(64);
    let (node, mut peer) = connected_with_inline(env, inline)?;
    let granted = node.qp.query().caps.max_inline_data;
    let rmr = peer.reg_mr(8192, recv_access())?;
    peer.post_recv(
        1,
        &[PeerSge {
            mr: rmr.id,
            offset: 0,
            len: 8192,
        }],
    )?;
    let buf = vec![1u8; granted as usize + 1];
    let sge = [Sge {
        addr: buf.as_ptr() as u64,
        length: granted + 1,
        lkey: Lkey(0),
    }];
    let flags = SendFlags::SIGNALED | SendFlags::INLINE;
    match node
        .qp
        .post_send(&[SendWr::new(1, &sge, WrOpcode::Send).with_flags(flags)])
    {
        Err(e) if e.index == 0 => {}
        Err(e) => {
            return Err(fail(format!(
                "inline refusal names index {}, expected 0",
                e.index
            )))
        }
        Ok(()) => {
            return Err(fail(format!(
                "an INLINE send of {} bytes was accepted with max_inline_data {granted}",
                granted + 1
            )))
        }
    }
    let mr = node.mr(64, LOCAL_ALL)?;
    let s = [mr.sge(0, 8)?];
    node.qp.post_send(&[SendWr::new(2, &s, WrOpcode::Send)])?;
    expect_wc(
        &node.cq.wait(1)?[0],
        2,
        WcStatus::Success,
        "SEND after refused inline",
    )?;
    let r = peer.poll(1)?[0];
    if r.status != WcStatus::Success || r.byte_len != 8 {
        return Err(fail(format!("SEND after refused inline: receive {r:?}")));
    }
    Ok(())
}

/// Requests posted without SIGNALED produce no completion on success; a later signaled one does.
pub fn rc_unsignaled_requests_complete_silently<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::WRITE) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let mr = node.mr(4096, LOCAL_ALL)?;
    mr.write_at(0, &pattern(9, 4096))?;
    let s: Vec<[Sge; 1]> = (0..4)
        .map(|i| mr.sge(i * 100, 100).map(|s| [s]))
        .collect::<Result<_, _>>()?;
    let w = |i: usize, flags| {
        SendWr::new(
            i as u64 + 1,
            &s[i],
            WrOpcode::Write {
                remote: rmr.at(i as u64 * 100),
            },
        )
        .with_flags(flags)
    };
    node.qp.post_send(&[
        w(0, SendFlags::empty()),
        w(1, SendFlags::empty()),
        w(2, SendFlags::SIGNALED),
    ])?;
    expect_wc(
        &node.cq.wait(1)?[0],
        3,
        WcStatus::Success,
        "first signaled WRITE after two unsignaled",
    )?;
    node.qp.post_send(&[w(3, SendFlags::SIGNALED)])?;
    expect_wc(
        &node.cq.wait(1)?[0],
        4,
        WcStatus::Success,
        "next completion after the unsignaled ones",
    )?;
    let stray = node.cq.take_ready();
    if !stray.is_empty() {
        return Err(fail(format!(
            "unsignaled requests produced completions: {stray:?}"
        )));
    }
    if peer.read(&rmr, 0, 400)? != pattern(9, 4096)[..400] {
        return Err(fail("the unsignaled WRITEs did not all land"));
    }
    Ok(())
}

/// With `sq_sig_all`, requests without SIGNALED complete too.
pub fn rc_sq_sig_all_signals_every_request<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::WRITE) {
        return Ok(());
    }
    let opts = NodeOpts {
        sq_sig_all: true,
        ..NodeOpts::default()
    };
    let (node, mut peer) = connected(env, &opts, PeerSetup::default())?;
    let rmr = peer.reg_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let mr = node.mr(4096, LOCAL_ALL)?;
    let s = [mr.sge(0, 16)?];
    let wrs: Vec<_> = (1..=3)
        .map(|i| {
            SendWr::new(
                i,
                &s,
                WrOpcode::Write {
                    remote: rmr.at(i * 16),
                },
            )
            .with_flags(SendFlags::empty())
        })
        .collect();
    node.qp.post_send(&wrs)?;
    let wcs = node.cq.wait(3)?;
    for (wc, id) in wcs.iter().zip(1..) {
        expect_wc(wc, id, WcStatus::Success, "sq_sig_all WRITE")?;
    }
    Ok(())
}

/// A WRITE followed by a SEND on the same QP: when the SEND's receive completes at the target,
/// the written data is already visible there. Repeated with fresh data each round.
pub fn rc_write_then_send_data_visible_at_receive_completion<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    if !env.has(Capabilities::WRITE | Capabilities::SEND) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let len = 64 * 1024;
    let rmr = peer.reg_mr(len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let rbuf = peer.reg_mr(64, recv_access())?;
    let mr = node.mr(len, LOCAL_ALL)?;
    for round in 0..5u8 {
        peer.post_recv(
            u64::from(round),
            &[PeerSge {
                mr: rbuf.id,
                offset: 0,
                len: 64,
            }],
        )?;
        let data = pattern(round.wrapping_mul(13).wrapping_add(1), len);
        mr.write_at(0, &data)?;
        let ws = [mr.sge(0, len as u32)?];
        let ss = [mr.sge(0, 8)?];
        node.qp.post_send(&[
            SendWr::new(1, &ws, WrOpcode::Write { remote: rmr.at(0) })
                .with_flags(SendFlags::empty()),
            SendWr::new(2, &ss, WrOpcode::Send),
        ])?;
        let r = peer.poll(1)?[0];
        if r.status != WcStatus::Success {
            return Err(fail(format!("round {round}: receive {r:?}")));
        }
        if peer.read(&rmr, 0, len)? != data {
            return Err(fail(format!(
                "round {round}: WRITE data not visible when the following SEND's receive completed"
            )));
        }
        expect_wc(
            &node.cq.wait(1)?[0],
            2,
            WcStatus::Success,
            "SEND after WRITE",
        )?;
    }
    Ok(())
}

/// A batch mixing every advertised opcode completes in post order with the matching opcodes; a
/// READ or atomic after a WRITE to the same address sees the written value.
pub fn rc_batch_completes_in_post_order<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND | Capabilities::WRITE | Capabilities::READ) {
        return Ok(());
    }
    let caps = env.attr.capabilities;
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(4096, AccessFlags::ALL)?;
    let rbuf = peer.reg_mr(1024, recv_access())?;
    for i in 0..4 {
        peer.post_recv(
            100 + i,
            &[PeerSge {
                mr: rbuf.id,
                offset: i as usize * 256,
                len: 256,
            }],
        )?;
    }
    let mr = node.mr(4096, LOCAL_ALL)?;
    mr.write_at(0, &pattern(21, 1024))?;
    mr.write_at(1024, &7u64.to_ne_bytes())?;
    let s = |off: usize, len: u32| mr.sge(off, len).map(|s| [s]);
    let (w1, r1, w8, f1, c1, sd, w2, r2) = (
        s(0, 512)?,
        s(2048, 512)?,
        s(1024, 8)?,
        s(3000, 8)?,
        s(3008, 8)?,
        s(0, 32)?,
        s(512, 256)?,
        s(2600, 256)?,
    );
    let mut wrs = vec![
        SendWr::new(0, &w1, WrOpcode::Write { remote: rmr.at(0) }),
        SendWr::new(1, &r1, WrOpcode::Read { remote: rmr.at(0) }),
        SendWr::new(2, &sd, WrOpcode::Send),
    ];
    if caps.contains(Capabilities::ATOMICS) {
        wrs.push(SendWr::new(
            3,
            &w8,
            WrOpcode::Write {
                remote: rmr.at(1024),
            },
        ));
        wrs.push(SendWr::new(
            4,
            &f1,
            WrOpcode::AtomicFetchAdd {
                remote: rmr.at(1024),
                add: 1,
            },
        ));
        wrs.push(SendWr::new(
            5,
            &c1,
            WrOpcode::AtomicCmpSwp {
                remote: rmr.at(1024),
                compare: 8,
                swap: 100,
            },
        ));
    }
    if caps.contains(Capabilities::SEND_IMM) {
        wrs.push(SendWr::new(6, &sd, WrOpcode::SendWithImm { imm: 6 }));
    }
    if caps.contains(Capabilities::WRITE_IMM) {
        wrs.push(SendWr::new(
            7,
            &w2,
            WrOpcode::WriteWithImm {
                remote: rmr.at(2048),
                imm: 7,
            },
        ));
    }
    wrs.push(SendWr::new(
        8,
        &r2,
        WrOpcode::Read {
            remote: rmr.at(2048),
        },
    ));
    wrs.push(SendWr::new(9, &sd, WrOpcode::Send));
    node.qp.post_send(&wrs)?;
    let wcs = node.cq.wait(wrs.len())?;
    for (wc, wr) in wcs.iter().zip(&wrs) {
        if wc.wr_id != wr.wr_id
            || wc.status != WcStatus::Success
            || wc.opcode != wr.opcode.wc_opcode()
        {
            return Err(fail(format!(
                "batch completions out of order or wrong: expected wr_id {} {:?} Success, got {wc:?}; all: {wcs:?}",
                wr.wr_id,
                wr.opcode.wc_opcode()
            )));
        }
    }
    if read_mr(&mr, 2048, 512)? != pattern(21, 512) {
        return Err(fail(
            "a READ after a WRITE to the same address did not see the written data",
        ));
    }
    if caps.contains(Capabilities::ATOMICS) {
        let load = |off| {
            mr.atomic_u64(off)
                .map(|a| a.load(std::sync::atomic::Ordering::Acquire))
        };
        if (load(3000)?, load(3008)?) != (7, 8) {
            return Err(fail(format!(
                "atomics after a WRITE saw {:?}, expected (7, 8)",
                (load(3000)?, load(3008)?)
            )));
        }
    }
    if caps.contains(Capabilities::WRITE_IMM)
        && read_mr(&mr, 2600, 256)? != pattern(21, 1024)[512..768]
    {
        return Err(fail(
            "a READ after a WRITE_WITH_IMM did not see the written data",
        ));
    }
    let recvs = wrs
        .iter()
        .filter(|w| {
            matches!(
                w.opcode,
                WrOpcode::Send | WrOpcode::SendWithImm { .. } | WrOpcode::WriteWithImm { .. }
            )
        })
        .count();
    let r = peer.poll(recvs)?;
    for (i, wc) in r.iter().enumerate() {
        if wc.wr_id != 100 + i as u64 || wc.status != WcStatus::Success {
            return Err(fail(format!("target receives out of order: {r:?}")));
        }
    }
    Ok(())
}

/// A SEND whose SGE names a wrong lkey is refused at post time or completes with
/// LocalProtection; nothing reaches the peer as a successful message.
pub fn rc_bad_local_lkey_is_local_protection_error<P: TestProvider>(env: &Env<P>) -> TestResult {
    expect_local_protection(env, |node| {
        let mr = node.mr(256, LOCAL_ALL)?;
        let mut bad = mr.sge(0, 64)?;
        bad.lkey = Lkey(mr.lkey().0 ^ 0x00ff_ff00);
        Ok((bad, mr))
    })
}

/// A SEND whose SGE names a region of another protection domain than the QP's is refused at
/// post time or completes with LocalProtection.
pub fn rc_local_sge_of_another_pd_is_local_protection_error<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    expect_local_protection(env, |node| {
        let other_pd = node.pd.context().alloc_pd()?;
        let foreign = other_pd.alloc_mr(256, LOCAL_ALL)?;
        Ok((foreign.sge(0, 64)?, foreign))
    })
}

/// Post a SEND from the SGE `make` builds (the region it returns is kept alive meanwhile) and
/// expect a refusal or a LocalProtection completion.
fn expect_local_protection<P: TestProvider>(
    env: &Env<P>,
    make: impl FnOnce(&Node) -> Result<(Sge, MemoryRegion), Box<dyn std::error::Error>>,
) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rbuf = peer.reg_mr(256, recv_access())?;
    peer.post_recv(
        1,
        &[PeerSge {
            mr: rbuf.id,
            offset: 0,
            len: 256,
        }],
    )?;
    let (bad, _keep) = make(&node)?;
    let sge = [bad];
    match node.qp.post_send(&[SendWr::new(3, &sge, WrOpcode::Send)]) {
        Err(e) if e.index == 0 => return Ok(()),
        Err(e) => return Err(fail(format!("refusal names index {}, expected 0", e.index))),
        Ok(()) => {}
    }
    let wc = node.cq.wait(1)?[0];
    // A bad lkey is a local protection error; some devices (rxe) report it as a local QP
    // operation error, which verbs also allows for a malformed work request.
    if wc.status != WcStatus::LocalQpOperation {
        expect_wc(
            &wc,
            3,
            WcStatus::LocalProtection,
            "SEND from an SGE the QP may not use",
        )?;
    }
    wait_until("the QP enters ERROR after a local protection error", || {
        node.qp.state() == QpState::Error
    })?;
    let r = peer.poll_ready()?;
    if r.iter().any(|wc| wc.status == WcStatus::Success) {
        return Err(fail(format!(
            "the peer received a message from an SGE the QP may not use: {r:?}"
        )));
    }
    Ok(())
}

/// Accesses that touch the first and last bytes of a region succeed: a WRITE ending exactly at
/// the end, a READ of the first and of the last 100 bytes, FETCH_AND_ADD on the last word.
pub fn rc_access_at_the_region_edges_succeeds<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::WRITE | Capabilities::READ | Capabilities::ATOMICS) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(4096, AccessFlags::ALL)?;
    let len = rmr.len;
    let mr = node.mr(4096, LOCAL_ALL)?;
    mr.write_at(0, &pattern(17, 100))?;
    let (w, r1, r2, f) = (
        [mr.sge(0, 100)?],
        [mr.sge(1000, 100)?],
        [mr.sge(2000, 100)?],
        [mr.sge(3000, 8)?],
    );
    peer.write(&rmr, 0, &pattern(18, 100))?;
    node.qp.post_send(&[
        SendWr::new(
            1,
            &w,
            WrOpcode::Write {
                remote: rmr.at(len - 100),
            },
        ),
        SendWr::new(2, &r1, WrOpcode::Read { remote: rmr.at(0) }),
        SendWr::new(
            3,
            &r2,
            WrOpcode::Read {
                remote: rmr.at(len - 100),
            },
        ),
        SendWr::new(
            4,
            &f,
            WrOpcode::AtomicFetchAdd {
                remote: rmr.at(len - 8),
                add: 1,
            },
        ),
    ])?;
    let wcs = node.cq.wait(4)?;
    for (wc, id) in wcs.iter().zip(1..) {
        expect_wc(wc, id, WcStatus::Success, "access at a region edge")?;
    }
    if read_mr(&mr, 1000, 100)? != pattern(18, 100) || read_mr(&mr, 2000, 100)? != pattern(17, 100)
    {
        return Err(fail("READs at the region edges returned the wrong bytes"));
    }
    let mut last = pattern(17, 100)[92..100].to_vec();
    let old = u64::from_ne_bytes(last.clone().try_into().map_err(|_| fail("len"))?);
    if mr
        .atomic_u64(3000)?
        .load(std::sync::atomic::Ordering::Acquire)
        != old
    {
        return Err(fail(
            "FETCH_AND_ADD on the last word returned the wrong original",
        ));
    }
    last.copy_from_slice(&old.wrapping_add(1).to_ne_bytes());
    if peer.read(&rmr, len as usize - 8, 8)? != last {
        return Err(fail("FETCH_AND_ADD on the last word did not add"));
    }
    Ok(())
}

/// A batch whose middle request is refused at post time (an INLINE payload over the limit):
/// `PostError::index` names it, the request before it was posted and completes, the one after
/// it was not posted.
pub fn rc_partially_posted_batch_completes_the_posted_prefix<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    if !env.has(Capabilities::WRITE | Capabilities::INLINE) {
        return Ok(());
    }
    let inline = env.attr.max_inline_data.min(64);
    let caps = QpCaps {
        max_inline_data: inline,
        ..QpCaps::default()
    };
    let opts = NodeOpts {
        caps,
        ..NodeOpts::default()
    };
    let (node, mut peer) = connected(env, &opts, PeerSetup::default())?;
    let granted = node.qp.query().caps.max_inline_data;
    let rmr = peer.reg_mr(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let mr = node.mr(8192, LOCAL_ALL)?;
    mr.write_at(0, &pattern(4, 8192))?;
    let ok = [mr.sge(0, 32)?];
    let big = [mr.sge(0, granted + 1)?];
    let wrs = [
        SendWr::new(1, &ok, WrOpcode::Write { remote: rmr.at(0) }),
        SendWr::new(
            2,
            &big,
            WrOpcode::Write {
                remote: rmr.at(1024),
            },
        )
        .with_flags(SendFlags::SIGNALED | SendFlags::INLINE),
        SendWr::new(
            3,
            &ok,
            WrOpcode::Write {
                remote: rmr.at(4096),
            },
        ),
    ];
    match node.qp.post_send(&wrs) {
        Err(e) if e.index == 1 => {}
        other => {
            return Err(fail(format!(
                "a batch whose second request is over max_inline_data {granted}: expected a \
                 PostError at index 1, got {other:?}"
            )))
        }
    }
    expect_wc(
        &node.cq.wait(1)?[0],
        1,
        WcStatus::Success,
        "the posted prefix",
    )?;
    node.qp.post_send(&[SendWr::new(
        4,
        &ok,
        WrOpcode::Write {
            remote: rmr.at(6000),
        },
    )])?;
    expect_wc(
        &node.cq.wait(1)?[0],
        4,
        WcStatus::Success,
        "the next request after the refusal",
    )?;
    if peer.read(&rmr, 4096, 32)?.iter().any(|&b| b != 0) {
        return Err(fail("the request after the refused one was executed"));
    }
    if peer.read(&rmr, 0, 32)? != pattern(4, 32) {
        return Err(fail("the request before the refused one did not land"));
    }
    Ok(())
}

/// WRITE into and READ from a peer region registered with `reg_mr` over the peer's own memory
/// (not `alloc_mr`): remote access works on user memory too. Skipped when the provider refuses
/// `reg_mr`.
pub fn rc_write_and_read_user_memory_region<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::WRITE | Capabilities::READ) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = match peer.reg(8192, AccessFlags::ALL, true) {
        Ok(d) => d,
        Err(e) => {
            env.skip(&format!("reg_mr of peer memory refused: {e}"));
            return Ok(());
        }
    };
    let mr = node.mr(8192, LOCAL_ALL)?;
    mr.write_at(0, &pattern(27, 3000))?;
    peer.write(&rmr, 5000, &pattern(28, 1000))?;
    let (w, r) = ([mr.sge(0, 3000)?], [mr.sge(4000, 1000)?]);
    node.qp.post_send(&[
        SendWr::new(
            1,
            &w,
            WrOpcode::Write {
                remote: rmr.at(100),
            },
        ),
        SendWr::new(
            2,
            &r,
            WrOpcode::Read {
                remote: rmr.at(5000),
            },
        ),
    ])?;
    let wcs = node.cq.wait(2)?;
    expect_wc(&wcs[0], 1, WcStatus::Success, "WRITE into user memory")?;
    expect_wc(&wcs[1], 2, WcStatus::Success, "READ from user memory")?;
    if peer.read(&rmr, 100, 3000)? != pattern(27, 3000) {
        return Err(fail(
            "WRITE into a reg_mr region did not reach the peer's memory",
        ));
    }
    if read_mr(&mr, 4000, 1000)? != pattern(28, 1000) {
        return Err(fail(
            "READ from a reg_mr region did not return the peer's memory",
        ));
    }
    Ok(())
}

/// The reverse direction: the peer process SENDs (with and without immediate), WRITEs,
/// WRITE_WITH_IMMs and READs against this process; the receives, immediates, `byte_len`s and
/// memory of this process show exactly that.
pub fn rc_peer_initiated_operations_reach_this_process<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    use crate::peer::{PeerOp, PeerWr};
    let need = Capabilities::SEND
        | Capabilities::SEND_IMM
        | Capabilities::WRITE
        | Capabilities::WRITE_IMM
        | Capabilities::READ;
    if !env.has(need) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let target = node.mr(8192, LOCAL_ALL)?;
    target.write_at(6000, &pattern(44, 500))?;
    let rbufs = node.mr(4096, LOCAL_ALL)?;
    let rs: Vec<[Sge; 1]> = (0..3)
        .map(|i| rbufs.sge(i * 1024, 1024).map(|s| [s]))
        .collect::<Result<_, _>>()?;
    let recvs: Vec<fabriq_verbs::RecvWr<'_>> = rs
        .iter()
        .enumerate()
        .map(|(i, s)| fabriq_verbs::RecvWr::new(50 + i as u64, s))
        .collect();
    node.qp.post_recv(&recvs)?;
    let src = peer.reg_mr(4096, AccessFlags::LOCAL_WRITE)?;
    peer.write(&src, 0, &pattern(41, 4096))?;
    let sge = |offset, len| PeerSge {
        mr: src.id,
        offset,
        len,
    };
    let at = |offset: usize| target.remote(offset);
    let signaled = SendFlags::SIGNALED.bits();
    let wr = |wr_id, op, sges| PeerWr {
        wr_id,
        op,
        sges,
        flags: signaled,
    };
    peer.post_send(&[
        wr(1, PeerOp::Send, vec![sge(0, 700)]),
        wr(
            2,
            PeerOp::Write(at(100)),
            vec![sge(1000, 300), sge(2000, 200)],
        ),
        wr(3, PeerOp::SendImm(0xfeed), vec![sge(3000, 10)]),
        wr(4, PeerOp::WriteImm(at(4000), 0xbeef), vec![sge(100, 64)]),
        wr(5, PeerOp::Read(at(6000)), vec![sge(3500, 500)]),
    ])?;
    let done = peer.poll(5)?;
    for (wc, id) in done.iter().zip(1..) {
        if wc.wr_id != id || wc.status != WcStatus::Success {
            return Err(fail(format!("peer-side completions: {done:?}")));
        }
    }
    let got = node.cq.wait(3)?;
    let want = [
        (50, WcOpcode::Recv, 700, None),
        (51, WcOpcode::Recv, 10, Some(0xfeed)),
        (52, WcOpcode::RecvRdmaWithImm, 64, Some(0xbeef)),
    ];
    for (wc, (id, op, len, imm)) in got.iter().zip(want) {
        if wc.wr_id != id
            || wc.status != WcStatus::Success
            || wc.opcode != op
            || wc.byte_len != len
            || wc.imm_data != imm
            || wc.qp_num != node.qp.qp_num()
        {
            return Err(fail(format!(
                "receive {id}: expected {op:?}, {len} bytes, imm {imm:?}; got {wc:?}"
            )));
        }
    }
    let p = pattern(41, 4096);
    if read_mr(&rbufs, 0, 700)? != p[..700] || read_mr(&rbufs, 1024, 10)? != p[3000..3010] {
        return Err(fail("the peer's SENDs delivered the wrong bytes"));
    }
    let mut gathered = p[1000..1300].to_vec();
    gathered.extend_from_slice(&p[2000..2200]);
    if read_mr(&target, 100, 500)? != gathered || read_mr(&target, 4000, 64)? != p[100..164] {
        return Err(fail(
            "the peer's WRITEs placed the wrong bytes in this process",
        ));
    }
    if peer.read(&src, 3500, 500)? != pattern(44, 500) {
        return Err(fail(
            "the peer's READ of this process returned the wrong bytes",
        ));
    }
    Ok(())
}

/// A send or receive with more SGEs than the QP was created for is refused at post time.
pub fn rc_too_many_sges_are_refused<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    let caps = QpCaps {
        max_send_sge: 1,
        max_recv_sge: 1,
        ..QpCaps::default()
    };
    let opts = NodeOpts {
        caps,
        ..NodeOpts::default()
    };
    let (node, _peer) = connected(env, &opts, PeerSetup::default())?;
    let granted = node.qp.query().caps;
    let mr = node.mr(64 * 1024, LOCAL_ALL)?;
    let send_sges: Vec<Sge> = (0..=granted.max_send_sge as usize)
        .map(|i| mr.sge(i * 16, 16))
        .collect::<Result<_, _>>()?;
    let recv_sges: Vec<Sge> = (0..=granted.max_recv_sge as usize)
        .map(|i| mr.sge(32 * 1024 + i * 16, 16))
        .collect::<Result<_, _>>()?;
    if let Ok(()) = node
        .qp
        .post_send(&[SendWr::new(1, &send_sges, WrOpcode::Send)])
    {
        return Err(fail(format!(
            "a SEND with {} SGEs was accepted with max_send_sge {}",
            send_sges.len(),
            granted.max_send_sge
        )));
    }
    if let Ok(()) = node
        .qp
        .post_recv(&[fabriq_verbs::RecvWr::new(2, &recv_sges)])
    {
        return Err(fail(format!(
            "a receive with {} SGEs was accepted with max_recv_sge {}",
            recv_sges.len(),
            granted.max_recv_sge
        )));
    }
    Ok(())
}

/// Where the provider advertises SYNCHRONISE: sixteen WRITEs of 64 KiB, then an 8-byte flag
/// WRITE with SYNCHRONISE; a peer spinning on the flag in memory finds every earlier byte in
/// place the moment the flag appears. Five rounds with fresh data.
pub fn rc_synchronise_write_lands_after_earlier_writes<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    use crate::peer::{fnv1a, Reply, Request};
    if !env.has(Capabilities::WRITE | Capabilities::SYNCHRONISE) {
        return Ok(());
    }
    const CHUNK: usize = 64 * 1024;
    const CHUNKS: usize = 16;
    const LEN: usize = CHUNK * CHUNKS;
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let data = peer.reg_mr(LEN, access)?;
    let flag = peer.reg_mr(64, access)?;
    let src = node.mr(LEN + 64, LOCAL_ALL)?;
    for round in 1..=5u8 {
        let bytes = pattern(round.wrapping_mul(7), LEN);
        src.write_at(0, &bytes)?;
        src.write_at(LEN, &u64::from(round).to_ne_bytes())?;
        peer.send(&Request::WaitFlagThenDigest {
            flag_mr: flag.id,
            flag_offset: 0,
            value: u64::from(round),
            data_mr: data.id,
            offset: 0,
            len: LEN,
        })?;
        let sges: Vec<[Sge; 1]> = (0..CHUNKS)
            .map(|i| src.sge(i * CHUNK, CHUNK as u32).map(|s| [s]))
            .collect::<Result<_, _>>()?;
        let flag_sge = [src.sge(LEN, 8)?];
        let mut wrs: Vec<SendWr<'_>> = sges
            .iter()
            .enumerate()
            .map(|(i, s)| {
                SendWr::new(
                    i as u64,
                    s,
                    WrOpcode::Write {
                        remote: data.at((i * CHUNK) as u64),
                    },
                )
                .with_flags(SendFlags::empty())
            })
            .collect();
        wrs.push(
            SendWr::new(99, &flag_sge, WrOpcode::Write { remote: flag.at(0) })
                .with_flags(SendFlags::SIGNALED | SendFlags::SYNCHRONISE),
        );
        node.qp.post_send(&wrs)?;
        let digest = match peer.reply()? {
            Reply::Digest(d) => d,
            other => return Err(fail(format!("peer: {other:?}"))),
        };
        expect_wc(
            &node.cq.wait(1)?[0],
            99,
            WcStatus::Success,
            "SYNCHRONISE flag WRITE",
        )?;
        if digest != fnv1a(&bytes) {
            return Err(fail(format!(
                "round {round}: the flag written with SYNCHRONISE was visible before the data \
                 written ahead of it"
            )));
        }
    }
    Ok(())
}
