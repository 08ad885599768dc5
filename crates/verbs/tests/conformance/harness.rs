//! The suite's machinery: the [`TestProvider`] trait each provider module implements, the
//! [`run`] wrapper that selects or skips a provider, and in-process helpers: [`TestCq`] (a CQ
//! whose completions are stashed while other waits drive progress), [`Node`] (context, PD, CQ,
//! QP in this process), connection helpers and bounded waits.
//!
//! Waiting never blocks on one thing alone: every wait loop of a test also polls every other
//! [`TestCq`] of that test ("pumping"), because a provider without a progress thread moves data
//! only while its CQs are polled. Completions polled that way are kept in the CQ's stash, in
//! order, for the next [`TestCq::wait`]. Every wait has a deadline ([`TIMEOUT`]) so that a broken
//! provider fails the test instead of hanging it.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::Write as _;
use std::marker::PhantomData;
use std::rc::{Rc, Weak};
use std::time::{Duration, Instant};

use fabriq_verbs::{
    AccessFlags, Capabilities, CompletionQueue, Context, DeviceAttr, DeviceConfig,
    ProtectionDomain, QpAttr, QpCaps, QpEndpoint, QpInitAttr, QpState, QueuePair, VerbsError,
    WcStatus, WorkCompletion,
};

/// How long any single wait may take before the test fails: generous, it only catches hangs.
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// Outcome of a test body: `Err` fails the test with the error's text.
pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Build an error for [`TestResult`].
pub fn fail(msg: impl Into<String>) -> Box<dyn std::error::Error> {
    msg.into().into()
}

/// A provider under test. Implemented by the `Target` type that [`crate::providers!`] stamps
/// into each provider module.
pub trait TestProvider: 'static {
    /// Module name of the provider's tests (`shm`, `tcp`, `rdma_core`).
    const MODULE: &'static str;
    /// Provider name as [`fabriq_verbs::DeviceInfo::provider`] spells it.
    const PROVIDER: &'static str;
    /// Device to open; `"*"` means the first device the provider lists.
    const DEVICE: &'static str;

    /// Settings used to open the device (in this process and in peers).
    fn device_config() -> DeviceConfig {
        DeviceConfig::default()
    }
}

/// What a test body gets: which provider and device, and the device's attributes.
pub struct Env<P: TestProvider> {
    /// `module::test`, for messages.
    pub name: String,
    /// The device being tested.
    pub device: String,
    /// Its attributes, as queried once before the body ran.
    pub attr: DeviceAttr,
    _provider: PhantomData<P>,
}

impl<P: TestProvider> Env<P> {
    /// Open the device under test (a fresh context).
    pub fn open(&self) -> Result<Context, VerbsError> {
        Context::open_with(&self.device, &P::device_config())
    }

    /// True when the device advertises every capability in `caps`; otherwise prints that the
    /// test skips and returns false.
    pub fn has(&self, caps: Capabilities) -> bool {
        if self.attr.capabilities.contains(caps) {
            return true;
        }
        self.skip(&format!(
            "device {} does not advertise {:?}",
            self.device,
            caps - self.attr.capabilities
        ));
        false
    }

    /// Print that the test (or a part of it) is skipped, bypassing the test output capture.
    pub fn skip(&self, why: &str) {
        note(&format!("SKIP {}: {why}", self.name));
    }

    /// Build a [`Node`] on a fresh context of the device under test.
    pub fn node(&self, opts: &NodeOpts) -> Result<Node, Box<dyn std::error::Error>> {
        Node::new(self.open()?, opts)
    }
}

/// Write a line to the real stderr, visible even when libtest captures output.
pub fn note(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Which providers the run selected: `FABRIQ_CONFORMANCE_PROVIDERS` is a comma-separated list of
/// module or provider names; unset or empty selects every provider.
fn selected(module: &str, provider: &str) -> bool {
    match std::env::var("FABRIQ_CONFORMANCE_PROVIDERS") {
        Ok(list) if !list.trim().is_empty() => list
            .split(',')
            .map(str::trim)
            .any(|p| p == module || p == provider),
        _ => true,
    }
}

/// Resolve the device name of `P` (`"*"`: the first device its provider lists).
fn resolve_device<P: TestProvider>() -> Option<String> {
    if P::DEVICE != "*" {
        return Some(P::DEVICE.to_string());
    }
    fabriq_verbs::devices()
        .ok()?
        .into_iter()
        .find(|d| d.provider == P::PROVIDER)
        .map(|d| d.name)
}

/// Print a provider-wide skip once per process (the first test of that provider to run prints
/// it for all of them), so an absent provider costs one line of output, not one per test.
fn skip_provider(module: &str, why: &str) {
    static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    if !said.iter().any(|m| m == module) {
        said.push(module.to_string());
        note(&format!("SKIP {module}::* (every {module} test): {why}"));
    }
}

/// Run one conformance body against provider `P`, or skip it (printing why) when the provider
/// is not selected or its device is absent.
pub fn run<P: TestProvider>(test: &str, body: fn(&Env<P>) -> TestResult) {
    let name = format!("{}::{test}", P::MODULE);
    if !selected(P::MODULE, P::PROVIDER) {
        skip_provider(
            P::MODULE,
            &format!(
                "provider {} not selected by FABRIQ_CONFORMANCE_PROVIDERS",
                P::PROVIDER
            ),
        );
        return;
    }
    let Some(device) = resolve_device::<P>() else {
        skip_provider(
            P::MODULE,
            &format!("provider {} lists no device on this host", P::PROVIDER),
        );
        return;
    };
    let ctx = match Context::open_with(&device, &P::device_config()) {
        Ok(ctx) => ctx,
        Err(err @ (VerbsError::NoDevice(_) | VerbsError::Unsupported { .. })) => {
            skip_provider(
                P::MODULE,
                &format!("device {device} is not available: {err}"),
            );
            return;
        }
        Err(err) => panic!("{name}: opening device {device} failed: {err}"),
    };
    let env = Env::<P> {
        name: name.clone(),
        device,
        attr: ctx.query_device(),
        _provider: PhantomData,
    };
    drop(ctx);
    if let Err(err) = body(&env) {
        panic!("{name} failed: {err}");
    }
}

// ---------------------------------------------------------------------------------------------
// Completion queues with a stash, and pumping.

thread_local! {
    /// Every pumped CQ of the test running on this thread.
    static PUMPED: RefCell<Vec<Weak<TestCq>>> = const { RefCell::new(Vec::new()) };
}

/// A CQ of this process plus the completions already polled from it but not yet consumed.
pub struct TestCq {
    /// The queue.
    pub cq: CompletionQueue,
    stash: RefCell<VecDeque<WorkCompletion>>,
    error: RefCell<Option<String>>,
}

impl TestCq {
    /// Wrap `cq`; when `pumped`, every wait of this test polls it too.
    pub fn new(cq: CompletionQueue, pumped: bool) -> Rc<TestCq> {
        let t = Rc::new(TestCq {
            cq,
            stash: RefCell::new(VecDeque::new()),
            error: RefCell::new(None),
        });
        if pumped {
            PUMPED.with(|p| p.borrow_mut().push(Rc::downgrade(&t)));
        }
        t
    }

    /// Poll once into the stash; returns how many arrived. A poll error is remembered and
    /// reported by the next [`TestCq::wait`].
    pub fn pump(&self) -> usize {
        if self.error.borrow().is_some() {
            return 0;
        }
        let mut buf = [WorkCompletion::EMPTY; 32];
        match self.cq.poll(&mut buf) {
            Ok(n) => {
                self.stash.borrow_mut().extend(buf[..n].iter().copied());
                n
            }
            Err(e) => {
                *self.error.borrow_mut() = Some(e.to_string());
                0
            }
        }
    }

    /// Wait for exactly `n` completions (more stay stashed), failing after [`TIMEOUT`].
    pub fn wait(&self, n: usize) -> Result<Vec<WorkCompletion>, Box<dyn std::error::Error>> {
        self.wait_for(n, TIMEOUT)
    }

    /// Wait for `n` completions or `timeout`.
    pub fn wait_for(
        &self,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<WorkCompletion>, Box<dyn std::error::Error>> {
        let mut backoff = Backoff::new(timeout);
        loop {
            if self.stash.borrow().len() >= n {
                return Ok(self.stash.borrow_mut().drain(..n).collect());
            }
            if let Some(e) = self.error.borrow().clone() {
                return Err(fail(format!(
                    "poll_cq failed while waiting for {n} completions: {e}"
                )));
            }
            let got = self.pump() + pump_all();
            if got == 0 && !backoff.snooze() {
                let have: Vec<_> = self.stash.borrow().iter().copied().collect();
                return Err(fail(format!(
                    "timed out after {timeout:?} waiting for {n} completions; got {}: {have:?}",
                    have.len()
                )));
            }
        }
    }

    /// Completions stashed so far (after one more poll), without waiting.
    pub fn take_ready(&self) -> Vec<WorkCompletion> {
        self.pump();
        self.stash.borrow_mut().drain(..).collect()
    }
}

/// Poll every pumped CQ of this test once; returns how many completions arrived.
pub fn pump_all() -> usize {
    let cqs: Vec<Rc<TestCq>> = PUMPED.with(|p| {
        let mut p = p.borrow_mut();
        p.retain(|w| w.strong_count() > 0);
        p.iter().filter_map(Weak::upgrade).collect()
    });
    cqs.iter().map(|c| c.pump()).sum()
}

/// A bounded wait: spin a little, then yield, then sleep in short naps, until a deadline.
pub struct Backoff {
    deadline: Instant,
    rounds: u32,
}

impl Backoff {
    /// A wait that gives up after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Backoff {
            deadline: Instant::now() + timeout,
            rounds: 0,
        }
    }

    /// Pause briefly; false once the deadline has passed.
    pub fn snooze(&mut self) -> bool {
        if Instant::now() >= self.deadline {
            return false;
        }
        self.rounds = self.rounds.saturating_add(1);
        if self.rounds < 64 {
            std::hint::spin_loop();
        } else if self.rounds < 1024 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
        true
    }
}

/// Poll `cond` (pumping every CQ) until it holds or [`TIMEOUT`] passes.
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) -> TestResult {
    let mut backoff = Backoff::new(TIMEOUT);
    loop {
        if cond() {
            return Ok(());
        }
        pump_all();
        if !backoff.snooze() {
            return Err(fail(format!(
                "timed out after {TIMEOUT:?} waiting until {what}"
            )));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Nodes: one QP and its objects in this process.

/// How to build a [`Node`].
#[derive(Clone)]
pub struct NodeOpts {
    /// CQ entries requested.
    pub cq_size: u32,
    /// Queue sizes.
    pub caps: QpCaps,
    /// Signal every send request.
    pub sq_sig_all: bool,
    /// Whether waits of this test poll the node's CQ.
    pub pumped: bool,
}

impl Default for NodeOpts {
    fn default() -> Self {
        NodeOpts {
            cq_size: 256,
            caps: QpCaps::default(),
            sq_sig_all: false,
            pumped: true,
        }
    }
}

/// A PD, CQ (used for both queues) and one QP in this process (the PD keeps the device open).
pub struct Node {
    /// Protection domain of the QP and of every MR made through [`Node::mr`].
    pub pd: ProtectionDomain,
    /// Send and receive CQ.
    pub cq: Rc<TestCq>,
    /// The queue pair (RESET until connected).
    pub qp: QueuePair,
}

impl Node {
    /// Build on `ctx`.
    pub fn new(ctx: Context, opts: &NodeOpts) -> Result<Node, Box<dyn std::error::Error>> {
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(opts.cq_size)?;
        let mut init = QpInitAttr::new(&cq);
        init.caps = opts.caps;
        init.sq_sig_all = opts.sq_sig_all;
        let qp = pd.create_qp(&init)?;
        Ok(Node {
            cq: TestCq::new(cq.clone(), opts.pumped),
            pd,
            qp,
        })
    }

    /// Allocate a zeroed provider region of `len` bytes.
    pub fn mr(
        &self,
        len: usize,
        access: AccessFlags,
    ) -> Result<fabriq_verbs::MemoryRegion, VerbsError> {
        self.pd.alloc_mr(len, access)
    }
}

/// Connection parameters of one side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConnectOpts {
    /// Rights granted to the peer on this QP.
    pub access: AccessFlags,
    /// RNR NAK timer code this side advertises as responder.
    pub min_rnr_timer: u8,
    /// RNR retries as requester (7 = forever).
    pub rnr_retry: u8,
    /// ACK timeout code as requester.
    pub timeout: u8,
    /// Transport retries as requester.
    pub retry_cnt: u8,
}

impl Default for ConnectOpts {
    fn default() -> Self {
        ConnectOpts {
            access: AccessFlags::ALL,
            min_rnr_timer: 1,
            rnr_retry: 7,
            timeout: 14,
            // Not 7: rxe treats retry_cnt 7 as "retry forever" (see QpAttr::rts).
            retry_cnt: 6,
        }
    }
}

/// Drive `qp` from RESET (or INIT) through INIT → RTR → RTS towards `remote`.
pub fn drive_to_rts(
    qp: &QueuePair,
    remote: &QpEndpoint,
    o: &ConnectOpts,
) -> Result<(), VerbsError> {
    drive_to_rtr(qp, remote, o)?;
    qp.modify(
        &QpAttr::rts()
            .with_rnr_retry(o.rnr_retry)
            .with_timeout(o.timeout, o.retry_cnt),
    )
}

/// Drive `qp` from RESET (or INIT) through INIT → RTR towards `remote`.
pub fn drive_to_rtr(
    qp: &QueuePair,
    remote: &QpEndpoint,
    o: &ConnectOpts,
) -> Result<(), VerbsError> {
    if qp.state() == QpState::Reset {
        qp.modify(&QpAttr::init(o.access))?;
    }
    qp.modify(&QpAttr::rtr(remote.clone()).with_min_rnr_timer(o.min_rnr_timer))
}

/// Connect two QPs of this process to each other. Both sides are driven at the same time (a
/// provider may block in RTR until its peer shows up), with a deadline.
pub fn connect_pair(
    a: &QueuePair,
    b: &QueuePair,
    oa: &ConnectOpts,
    ob: &ConnectOpts,
) -> TestResult {
    let (ea, eb) = (a.endpoint(), b.endpoint());
    let (tx, rx) = std::sync::mpsc::channel();
    let b2 = b.clone();
    let ob2 = *ob;
    std::thread::spawn(move || {
        let _ = tx.send(drive_to_rts(&b2, &ea, &ob2).map_err(|e| e.to_string()));
    });
    drive_to_rts(a, &eb, oa).map_err(|e| fail(format!("connecting QP a: {e}")))?;
    let mut backoff = Backoff::new(TIMEOUT);
    loop {
        match rx.try_recv() {
            Ok(r) => return r.map_err(|e| fail(format!("connecting QP b: {e}"))),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                return Err(fail("connecting QP b: thread died"))
            }
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
        }
        pump_all();
        if !backoff.snooze() {
            return Err(fail("timed out connecting QP b"));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Assertions and data.

/// Fail unless `wc` has `status` (and, for `Success`, the expected `wr_id`).
pub fn expect_wc(wc: &WorkCompletion, wr_id: u64, status: WcStatus, what: &str) -> TestResult {
    if wc.wr_id != wr_id || wc.status != status {
        return Err(fail(format!(
            "{what}: expected completion wr_id {wr_id} with {status:?}, got {wc:?}"
        )));
    }
    Ok(())
}

/// A deterministic byte pattern: different `seed`s give different bytes at every offset.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(31)
                .wrapping_add(u32::from(seed) * 97 + 7) as u8
        })
        .collect()
}

/// Read a region of this process into a vector.
pub fn read_mr(
    mr: &fabriq_verbs::MemoryRegion,
    offset: usize,
    len: usize,
) -> Result<Vec<u8>, VerbsError> {
    let mut v = vec![0u8; len];
    mr.read_at(offset, &mut v)?;
    Ok(v)
}
