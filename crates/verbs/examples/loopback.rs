//! Two RC queue pairs of one process connected to each other on a device of your choice, running
//! every opcode once: a quick "does this device work" check.
//!
//! ```text
//! cargo run -p fabriq-verbs --example loopback -- rxe0
//! ```

use std::time::Duration;

use fabriq_verbs::*;

fn wait(cq: &CompletionQueue, what: &str) -> Result<WorkCompletion, String> {
    let mut wc = [WorkCompletion::default(); 1];
    let n = cq
        .poll_blocking(&mut wc, Duration::from_secs(10))
        .map_err(|e| format!("{what}: poll: {e}"))?;
    if n == 0 {
        return Err(format!("{what}: no completion within 10 s"));
    }
    if wc[0].status != WcStatus::Success {
        return Err(format!("{what}: completion {:?}", wc[0]));
    }
    Ok(wc[0])
}

fn run(dev: &str) -> Result<(), String> {
    let e = |e: VerbsError| e.to_string();
    let ctx = Context::open(dev).map_err(e)?;
    println!(
        "device {} ({:?})",
        ctx.device().name,
        ctx.device().transport
    );
    println!("port {:?}", ctx.query_port(1).map_err(e)?);
    let pd = ctx.alloc_pd().map_err(e)?;
    let cq_a = ctx.create_cq(64).map_err(e)?;
    let cq_b = ctx.create_cq(64).map_err(e)?;
    let qa = pd.create_qp(&QpInitAttr::new(&cq_a)).map_err(e)?;
    let qb = pd.create_qp(&QpInitAttr::new(&cq_b)).map_err(e)?;
    let all = AccessFlags::ALL;
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    qa.connect(&eb, all).map_err(e)?;
    qb.connect(&ea, all).map_err(e)?;
    let ma = pd.alloc_mr(4096, all).map_err(e)?;
    let mb = pd.alloc_mr(4096, all).map_err(e)?;

    mb.write_at(0, &[0u8; 64]).map_err(e)?;
    qb.post_recv(&[RecvWr::new(7, &[mb.sge(0, 64).map_err(e)?])])
        .map_err(|x| x.to_string())?;
    ma.write_at(0, b"hello rdma").map_err(e)?;
    qa.post_send(&[SendWr::new(
        1,
        &[ma.sge(0, 10).map_err(e)?],
        WrOpcode::SendWithImm { imm: 42 },
    )])
    .map_err(|x| x.to_string())?;
    wait(&cq_a, "send")?;
    let r = wait(&cq_b, "recv")?;
    let mut buf = [0u8; 10];
    mb.read_at(0, &mut buf).map_err(e)?;
    if &buf != b"hello rdma" || r.imm_data != Some(42) || r.byte_len != 10 {
        return Err(format!("recv mismatch: {buf:?} {r:?}"));
    }
    println!("SEND_WITH_IMM ok");

    ma.write_at(100, b"written").map_err(e)?;
    qa.post_send(&[SendWr::new(
        2,
        &[ma.sge(100, 7).map_err(e)?],
        WrOpcode::Write {
            remote: mb.remote(200),
        },
    )])
    .map_err(|x| x.to_string())?;
    wait(&cq_a, "write")?;
    let mut w = [0u8; 7];
    mb.read_at(200, &mut w).map_err(e)?;
    if &w != b"written" {
        return Err(format!("write mismatch {w:?}"));
    }
    println!("WRITE ok");

    qa.post_send(&[SendWr::new(
        3,
        &[ma.sge(300, 7).map_err(e)?],
        WrOpcode::Read {
            remote: mb.remote(200),
        },
    )])
    .map_err(|x| x.to_string())?;
    wait(&cq_a, "read")?;
    ma.read_at(300, &mut w).map_err(e)?;
    if &w != b"written" {
        return Err(format!("read mismatch {w:?}"));
    }
    println!("READ ok");

    mb.atomic_u64(512)
        .map_err(e)?
        .store(5, std::sync::atomic::Ordering::SeqCst);
    qa.post_send(&[SendWr::new(
        4,
        &[ma.sge(520, 8).map_err(e)?],
        WrOpcode::AtomicFetchAdd {
            remote: mb.remote(512),
            add: 3,
        },
    )])
    .map_err(|x| x.to_string())?;
    wait(&cq_a, "faa")?;
    qa.post_send(&[SendWr::new(
        5,
        &[ma.sge(528, 8).map_err(e)?],
        WrOpcode::AtomicCmpSwp {
            remote: mb.remote(512),
            compare: 8,
            swap: 100,
        },
    )])
    .map_err(|x| x.to_string())?;
    wait(&cq_a, "cas")?;
    let v = mb
        .atomic_u64(512)
        .map_err(e)?
        .load(std::sync::atomic::Ordering::SeqCst);
    let old_faa = ma
        .atomic_u64(520)
        .map_err(e)?
        .load(std::sync::atomic::Ordering::SeqCst);
    let old_cas = ma
        .atomic_u64(528)
        .map_err(e)?
        .load(std::sync::atomic::Ordering::SeqCst);
    if v != 100 || old_faa != 5 || old_cas != 8 {
        return Err(format!(
            "atomics mismatch: word {v}, faa old {old_faa}, cas old {old_cas}"
        ));
    }
    println!("ATOMICS ok");

    // Wrong rkey → remote access error, memory untouched.
    let bad = RemoteAddr {
        addr: mb.addr() + 200,
        rkey: Rkey(mb.rkey().0 ^ 0x5a5a_0000),
    };
    qa.post_send(&[SendWr::new(
        6,
        &[ma.sge(0, 7).map_err(e)?],
        WrOpcode::Write { remote: bad },
    )])
    .map_err(|x| x.to_string())?;
    let mut wc = [WorkCompletion::default(); 1];
    let n = cq_a
        .poll_blocking(&mut wc, Duration::from_secs(10))
        .map_err(e)?;
    println!("bad rkey → {:?} (n={n})", wc[0].status);
    if n == 0 || wc[0].status != WcStatus::RemoteAccess {
        return Err("bad rkey did not give RemoteAccess".into());
    }
    mb.read_at(200, &mut w).map_err(e)?;
    if &w != b"written" {
        return Err("memory changed by a refused write".into());
    }
    println!("qp state after error: {:?}", qa.state());
    Ok(())
}

fn main() {
    let dev = std::env::args().nth(1).unwrap_or_else(|| "shm0".into());
    println!(
        "devices: {:?}",
        devices().map(|d| d.into_iter().map(|d| d.name).collect::<Vec<_>>())
    );
    match run(&dev) {
        Ok(()) => println!("loopback on {dev}: all ok"),
        Err(e) => {
            eprintln!("loopback on {dev}: FAILED: {e}");
            std::process::exit(1);
        }
    }
}
