//! Discovery and device attributes: the device under test is listed by `devices()`, opens, and
//! reports sane attributes and an active port.

use fabriq_verbs::{AtomicCap, Capabilities, PortState};

use crate::harness::{fail, Env, TestProvider, TestResult};

/// `devices()` lists the device under test with its provider; it opens and its attributes and
/// port 1 are sane.
pub fn device_lists_and_opens_with_sane_attributes<P: TestProvider>(env: &Env<P>) -> TestResult {
    let list = fabriq_verbs::devices()?;
    let info = list
        .iter()
        .find(|d| d.name == env.device)
        .ok_or_else(|| fail(format!("devices() does not list {}: {list:?}", env.device)))?;
    if info.provider != P::PROVIDER {
        return Err(fail(format!(
            "{} is listed with provider {:?}, expected {:?}",
            env.device,
            info.provider,
            P::PROVIDER
        )));
    }
    let mut names: Vec<_> = list.iter().map(|d| &d.name).collect();
    names.sort();
    names.dedup();
    if names.len() != list.len() {
        return Err(fail(format!("devices() lists a name twice: {list:?}")));
    }

    let ctx = env.open()?;
    if ctx.device().name != env.device || ctx.device().provider != P::PROVIDER {
        return Err(fail(format!("opened context reports {:?}", ctx.device())));
    }
    let a = ctx.query_device();
    let checks: [(&str, bool); 9] = [
        ("max_qp_wr > 0", a.max_qp_wr > 0),
        ("max_sge > 0", a.max_sge > 0),
        ("max_cqe > 0", a.max_cqe > 0),
        ("max_qp > 0", a.max_qp > 0),
        ("max_cq > 0", a.max_cq > 0),
        ("max_mr > 0", a.max_mr > 0),
        ("max_pd > 0", a.max_pd > 0),
        ("max_mr_size > 0", a.max_mr_size > 0),
        ("phys_port_cnt >= 1", a.phys_port_cnt >= 1),
    ];
    for (what, ok) in checks {
        if !ok {
            return Err(fail(format!(
                "device attribute check failed: {what}: {a:?}"
            )));
        }
    }
    if a.capabilities.is_empty() || !a.capabilities.contains(Capabilities::SEND) {
        return Err(fail(format!(
            "capabilities must at least include SEND: {:?}",
            a.capabilities
        )));
    }
    if a.capabilities.contains(Capabilities::ATOMICS) == (a.atomic_cap == AtomicCap::None) {
        return Err(fail(format!(
            "ATOMICS capability {:?} disagrees with atomic_cap {:?}",
            a.capabilities.contains(Capabilities::ATOMICS),
            a.atomic_cap
        )));
    }
    if a.capabilities.contains(Capabilities::SRQ) && (a.max_srq == 0 || a.max_srq_wr == 0) {
        return Err(fail(format!(
            "SRQ advertised with max_srq {} / max_srq_wr {}",
            a.max_srq, a.max_srq_wr
        )));
    }
    if a.capabilities.contains(Capabilities::INLINE) && a.max_inline_data == 0 {
        return Err(fail("INLINE advertised with max_inline_data 0"));
    }
    if a.capabilities
        .contains(Capabilities::READ | Capabilities::ATOMICS)
        && (a.max_qp_rd_atom == 0 || a.max_qp_init_rd_atom == 0)
    {
        return Err(fail(format!(
            "READ/atomics advertised with max_qp_rd_atom {} / max_qp_init_rd_atom {}",
            a.max_qp_rd_atom, a.max_qp_init_rd_atom
        )));
    }
    let port = ctx.query_port(1)?;
    if port.port_num != 1 || port.state != PortState::Active {
        return Err(fail(format!("port 1 is not active: {port:?}")));
    }
    if port.active_mtu == 0 || port.active_mtu > port.max_mtu {
        return Err(fail(format!("port MTUs are not sane: {port:?}")));
    }
    if ctx.query_port(0).is_ok() {
        return Err(fail("query_port(0) succeeded; ports are 1-based"));
    }
    if ctx.query_port(a.phys_port_cnt.saturating_add(1)).is_ok() {
        return Err(fail(format!(
            "query_port({}) succeeded beyond phys_port_cnt",
            a.phys_port_cnt + 1
        )));
    }
    Ok(())
}

/// Opening the device with an option no provider knows is refused with InvalidArgument.
pub fn device_open_rejects_unknown_options<P: TestProvider>(env: &Env<P>) -> TestResult {
    let mut config = P::device_config();
    config
        .options
        .insert("fabriq-conformance-no-such-option".into(), "1".into());
    match fabriq_verbs::Context::open_with(&env.device, &config) {
        Err(fabriq_verbs::VerbsError::InvalidArgument(_)) => Ok(()),
        Err(e) => Err(fail(format!(
            "an unknown option must be InvalidArgument, got {e}"
        ))),
        Ok(_) => Err(fail("an unknown device option was silently accepted")),
    }
}

/// `alloc_mr` hands out zeroed memory with the requested rights and distinct keys per region.
pub fn mr_alloc_is_zeroed_with_distinct_keys<P: TestProvider>(env: &Env<P>) -> TestResult {
    use fabriq_verbs::AccessFlags;
    let ctx = env.open()?;
    let pd = ctx.alloc_pd()?;
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
    let mrs = (0..8)
        .map(|_| pd.alloc_mr(64 * 1024, access))
        .collect::<Result<Vec<_>, _>>()?;
    for mr in &mrs {
        if mr.len() < 64 * 1024 || mr.access() != access {
            return Err(fail(format!("region does not match the request: {mr:?}")));
        }
        let mut buf = vec![0xffu8; 64 * 1024];
        mr.read_at(0, &mut buf)?;
        if buf.iter().any(|&b| b != 0) {
            return Err(fail("alloc_mr returned memory that is not zeroed"));
        }
    }
    let mut rkeys: Vec<_> = mrs.iter().map(|m| m.rkey()).collect();
    let mut lkeys: Vec<_> = mrs.iter().map(|m| m.lkey()).collect();
    rkeys.sort();
    rkeys.dedup();
    lkeys.sort();
    lkeys.dedup();
    if rkeys.len() != mrs.len() || lkeys.len() != mrs.len() {
        return Err(fail(format!("regions share keys: {mrs:?}")));
    }
    Ok(())
}
