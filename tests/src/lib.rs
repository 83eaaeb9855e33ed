//! Shared set-up for the end-to-end suites: emulated fabrics with connected QP pairs driven
//! through the real driver.

use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig, FaultPlan, LinkFaults};

/// One side of a connection: device, PD, CQ, QP and a registered buffer.
#[derive(Debug)]
pub struct Side {
    /// The QP (declared first so it is destroyed before its CQ).
    pub qp: QueuePair,
    /// Registered buffer.
    pub mr: MemoryRegion,
    /// The buffer.
    pub buf: DmaBuffer,
    /// Send and receive CQ.
    pub cq: CompletionQueue,
    /// Protection domain.
    pub pd: ProtectionDomain,
    /// The device.
    pub dev: Device,
}

/// Two connected nodes.
#[derive(Debug)]
pub struct Pair {
    /// Node 0.
    pub a: Side,
    /// Node 1.
    pub b: Side,
    /// The fabric.
    pub fabric: Fabric,
}

/// Buffer size of each side.
pub const BUF: usize = 1 << 20;

/// Opens a side on `node`.
pub fn side(fabric: &Fabric, node: usize, access: Access) -> Side {
    side_of(fabric, node, access, QpType::Rc)
}

/// Opens a side on `node` whose QP has transport `qp_type`.
pub fn side_of(fabric: &Fabric, node: usize, access: Access, qp_type: QpType) -> Side {
    let dev = Device::open(Box::new(fabric.port(node))).expect("open device");
    let pd = dev.alloc_pd().expect("pd");
    let buf = dev.alloc_dma(BUF).expect("dma");
    let mr = pd.reg_mr(&buf, access).expect("mr");
    let cq = dev.create_cq(1024).expect("cq");
    let mut init = QpInit::new(&cq, &cq);
    init.max_send_wr = 256;
    init.max_recv_wr = 256;
    init.max_inline = 220;
    init.qp_type = qp_type;
    let qp = pd.create_qp(&init).expect("qp");
    Side {
        qp,
        mr,
        buf,
        cq,
        pd,
        dev,
    }
}

/// Connects two sides with `opts`.
pub fn connect(a: &mut Side, b: &mut Side, opts: &ConnectOptions) {
    let (ea, eb) = (a.qp.endpoint(100), b.qp.endpoint(9000));
    a.qp.connect(&eb, 100, opts).expect("connect a");
    b.qp.connect(&ea, 9000, opts).expect("connect b");
}

/// Two nodes with full access, connected at path MTU `mtu` (code 1..5).
pub fn pair_with(nodes: usize, mtu: u8, seed: u64) -> Pair {
    let fabric = Fabric::new(FabricConfig::new(nodes, seed));
    let all =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let mut a = side(&fabric, 0, all);
    let mut b = side(&fabric, 1, all);
    connect(
        &mut a,
        &mut b,
        &ConnectOptions {
            path_mtu: mtu,
            ..Default::default()
        },
    );
    Pair { a, b, fabric }
}

/// Two nodes whose buffers are registered with `access`, connected with the default
/// options, on a fabric of seed `seed`, timed or in functional mode.
pub fn pair_in(functional: bool, seed: u64, access: Access) -> Pair {
    let mut cfg = FabricConfig::new(2, seed);
    cfg.functional = functional;
    let fabric = Fabric::new(cfg);
    let mut a = side(&fabric, 0, access);
    let mut b = side(&fabric, 1, access);
    connect(&mut a, &mut b, &ConnectOptions::default());
    Pair { a, b, fabric }
}

/// The default pair: 2 nodes, MTU 4096, seed 1.
pub fn pair() -> Pair {
    pair_with(2, 5, 1)
}

/// Polls `cq` until `n` completions arrived, stepping the fabric; panics if the fabric goes
/// idle first (a lost completion).
pub fn wait(fabric: &Fabric, cq: &mut CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut wc = [WorkCompletion::default(); 16];
    while out.len() < n {
        let k = cq.poll_ready(&mut wc[..(n - out.len()).min(16)]);
        if k == 0 && !fabric.step() {
            panic!("fabric idle with {} of {n} completions: {out:?}", out.len());
        }
        out.extend_from_slice(&wc[..k]);
    }
    out
}

/// Runs the fabric to idle and returns every completion left in `cq`.
pub fn drain(fabric: &Fabric, cq: &mut CompletionQueue) -> Vec<WorkCompletion> {
    settle(fabric);
    poll_all(cq)
}

/// Every completion already in `cq` (the device is not stepped).
pub fn poll_all(cq: &mut CompletionQueue) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut wc = [WorkCompletion::default(); 16];
    loop {
        let k = cq.poll_ready(&mut wc);
        if k == 0 {
            return out;
        }
        out.extend_from_slice(&wc[..k]);
    }
}

/// Links that lose, duplicate, hold back (up to 2 µs) and corrupt frames at these rates
/// (parts per million), never down: the faults of the property tests.
pub fn lossy_links(
    drop_ppm: u32,
    duplicate_ppm: u32,
    reorder_ppm: u32,
    corrupt_ppm: u32,
) -> ringbell_emu::LinkFaults {
    ringbell_emu::LinkFaults {
        drop_ppm,
        duplicate_ppm,
        reorder_ppm,
        reorder_delay: ringbell_specs::SimTime(2_000_000),
        corrupt_ppm,
        down: Vec::new(),
    }
}

/// Byte `i` of message `m` of a property-test run with `seed`: every message's bytes differ
/// from every other's, so a byte in the wrong place shows.
pub fn message_byte(seed: u64, m: usize, i: usize) -> u8 {
    let x = (m as u64 + 1)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((i as u64).wrapping_mul(0x2545_F491))
        .wrapping_add(seed);
    (x >> 29) as u8
}

/// Runs the fabric until nothing is pending.
pub fn settle(f: &Fabric) {
    f.run_until_idle(u64::MAX);
}

/// Runs the fabric to idle and returns (wr_id, status) of every completion left in `cq`.
pub fn outcomes(fabric: &Fabric, cq: &mut CompletionQueue) -> Vec<(u64, WcStatus)> {
    drain(fabric, cq)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect()
}

/// Receive requests with ids 0, 1, ... for single-SGE lists.
pub fn recv_wrs(sgls: &[[Sge; 1]]) -> Vec<RecvWr<'_>> {
    sgls.iter()
        .enumerate()
        .map(|(i, s)| RecvWr {
            wr_id: i as u64,
            sgl: s,
        })
        .collect()
}

/// Faults on every link for the property tests over a lossy fabric: each frame dropped or
/// duplicated with probability `ppm` (parts per million), held back up to 3 µs with half
/// that, and a bit flipped with a quarter of it.
pub fn lossy(ppm: u32) -> FaultPlan {
    FaultPlan {
        links: LinkFaults {
            drop_ppm: ppm,
            duplicate_ppm: ppm,
            reorder_ppm: ppm / 2,
            reorder_delay: ringbell_specs::SimTime(3_000_000),
            corrupt_ppm: ppm / 4,
            down: vec![],
        },
        ..Default::default()
    }
}
