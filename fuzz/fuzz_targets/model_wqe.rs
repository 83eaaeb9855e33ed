//! Fuzzes one `ringbell_model::Nic` behind a mock driver and a mock peer.
//!
//! The harness plays the host: a flat 1 MiB host memory at IOVA 0x10000 (every other address
//! faults), a discrete-event queue, and a minimal command helper that writes the mailbox the
//! way `driver/src/device.rs` does. Setup (parameters drawn from the first input bytes, always
//! valid): event queue, two PDs, three MRs (all access over the whole memory; remote-read-only
//! at another VA; one in the second PD), one CQ, one RC (or, for a quarter of the inputs, UC)
//! QP with a send and a receive ring,
//! moved RESET → INIT → RTR → RTS towards a fake peer (10.0.0.2, QPN 5). Then hardware tag
//! matching (ABI 1.2, after checking `TM_RC` in QUERY_DEVICE's caps): a second CQ, a TM-SRQ
//! (CREATE_TM_SRQ: untagged ring, matching list, list-operation ring) and a second RC QP on
//! it, moved to RTS towards the same peer's QPN 6.
//!
//! The rest of the input is a program of actions: raw or structured send WQEs copied into
//! either SQ ring (with a valid or arbitrary `wqe_index`), SQ/RQ doorbells with valid or
//! arbitrary producer indices (now, or later through the PCIe-latency path), receive WQEs,
//! frames from the wire to either QP (raw bytes, or valid headers built with
//! `wire::PacketRepr::emit` so they pass the ICRC, with fuzzed opcode/PSN/payload/RETH/AETH/
//! AtomicETH, optionally corrupted), CQ/EQ consumption, arming, arbitrary register accesses,
//! MODIFY_QP and arbitrary commands, reconnecting a QP. Tag matching adds: list operations
//! (ADD/DEL/SYNC built from the driver's view of the list, or raw 64-byte entries) and the
//! list-operation doorbell, untagged SRQ receives, and tagged messages to the TM QP (TMH with
//! a fuzzed opcode, tag and app_ctx, an RVH naming the peer's buffer or not, eager and
//! rendezvous sizes around `max_rndv_hdr_size`, one or several packets).
//!
//! Counters and triggered operations (ABI 1.3, after checking `TRIGGERED` in QUERY_DEVICE's
//! caps; the NIC is configured with 16 counters and a 16-entry triggered-operation table, so
//! that inputs can fill both): setup creates three counters (two in the first PD, one with and
//! one without a writeback; one in the second PD) and binds them to both QPs' events and the
//! first MR's remote accesses, so all the traffic above is counted. Actions (selector bytes
//! 240..=255) then create and destroy counters (valid and invalid PDs, flags and writeback
//! addresses), bind and unbind them to QPs and MRs (valid, foreign-PD and absent objects, any
//! events), update, query and arm them, post triggered operations of every kind (a WQE on
//! either QP, built segment by segment, taken from the send-WQE builder or raw; CNTR_ADD,
//! CNTR_SET; raw input) with fuzz-chosen thresholds around the counters' values, flags,
//! completion and trigger counters (live, destroyed, absent or of another PD), cancel and flush
//! them, access the counter MMIO window (adds, latched reads, reserved and unaligned offsets,
//! windows of absent counters), and destroy and create a QP again (its waiting operations are
//! discarded, its transfers in flight flushed, its bindings released).
//!
//! A mock peer answers the frames the NIC sends on both connections (ACKs, READ responses,
//! atomic ACKs) according to a fuzzed policy (answer, drop, RNR NAK, NAK); on the TM
//! connection it answers the hardware-rendezvous READs from its own buffer (a remote access
//! NAK outside it) and ACKs the FIN. It resumes its requests where the NIC's PSN sequence or
//! RNR NAKs tell it to.
//!
//! The event queue runs for at most `MAX_EVENTS` events per input, so no input hangs.
//!
//! Checked: nothing panics; every DMA the model issues is bounds-checked by the mock IOMMU
//! (writes land inside host memory by construction); the model never schedules an event or a
//! frame in the past; every frame the NIC transmits is a valid RoCEv2 frame from its own
//! address; at the end, once FLUSH_TRIGGERED has run for every PD that may exist, no
//! triggered operation is left in the device's table (none leaks).
#![no_main]

use libfuzzer_sys::arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use ringbell_model::sim::EventQueue;
use ringbell_model::{DmaFault, Env, Nic, NicConfig, NicEvent};
use ringbell_specs::cmd::{
    Access, ArmCntrIn, ArmSrqIn, BindCntrIn, CmdHeader, CmdOpcode, CntrEvents, CntrWriteback,
    CreateCntrIn, CreateCqIn, CreateQpIn, CreateSrqIn, CreateTmSrqIn, FlushTriggeredIn, ModifyQpIn,
    ObjectIn, ObjectOut, PostTriggeredIn, QpAttr, QpAttrMask as M, QpState, QueryDeviceOut,
    RegMrIn, ResizeCqIn, TrigFlags, TrigKind, UpdateCntrIn, CNTR_BIND_MR, CNTR_BIND_QP,
    CNTR_BIND_UNBIND, IN_OFFSET, MAILBOX_SIZE, MW_KEY_BIT, OUT_OFFSET, PARAMS_SIZE, RESULT_OFFSET,
};
use ringbell_specs::cqe::{
    owner_bit, Cqe, CqeOpcode, EventType, CQE_FLAG_TM_DATA_VALID, CQE_FLAG_TM_MATCH,
    CQE_FLAG_TRIGGERED, CQE_SIZE, EQE_SIZE,
};
use ringbell_specs::regs;
use ringbell_specs::tm::{
    Rvh, TmOpEntry, TmOpcode, Tmh, TmhOp, RVH_LEN, TMH_LEN, TM_OP_SIGNALED, TM_OP_SIZE, TM_OP_SYNC,
};
use ringbell_specs::wire::{
    self, Aeth, AethSyndrome, AtomicEth, BthRepr, Endpoint, NakCode, Opcode, PacketRepr, Reth,
};
use ringbell_specs::wqe::{
    AtomicSeg, BindSeg, CtrlSeg, DataSeg, RaddrSeg, SendOpcode, INLINE_MARK, MAX_SEND_WQE,
    RECV_LKEY_END, SEG, WQEBB,
};
use ringbell_specs::{Psn, Qpn, SimTime};
use zerocopy::{FromBytes, IntoBytes};

/// Counters and triggered operations the NIC is configured with (the defaults are 4096 and
/// 2048, more than an input can fill).
const MAX_CNTR: u32 = 16;
const MAX_TRIGGERED: u32 = 16;

/// Events processed per input, at most.
const MAX_EVENTS: u64 = 100_000;
/// Actions read from one input, at most.
const MAX_ACTIONS: usize = 512;
/// Frames the mock peer answers per input, at most; later ones are dropped. A peer that keeps
/// NAKing (PSN sequence error) or RNR-NAKing would otherwise keep the NIC retransmitting until
/// the event budget runs out, which costs throughput and teaches the fuzzer nothing new.
const MAX_PEER_ANSWERS: u64 = 2048;

/// Host memory: `MEM_SIZE` bytes at IOVA `MEM_BASE`; everything else faults.
const MEM_BASE: u64 = 0x1_0000;
const MEM_SIZE: usize = 1 << 20;
const MEM_END: u64 = MEM_BASE + MEM_SIZE as u64;

// Layout of host memory.
const MBOX: u64 = MEM_BASE;
const EQ_RING: u64 = MEM_BASE + 0x1000;
const EQ_LOG: u8 = 7; // 128 x 32 B = 4 KiB
const CQ_RING: u64 = MEM_BASE + 0x2000; // up to 128 x 64 B = 8 KiB
const CQ_DB: u64 = MEM_BASE + 0x4000;
const QP_DB: u64 = MEM_BASE + 0x4040;
const SQ_RING: u64 = MEM_BASE + 0x5000; // up to 64 x 64 B = 4 KiB
const RQ_RING: u64 = MEM_BASE + 0x6000; // up to 32 x 64 B = 2 KiB

// Tag matching: the TM-SRQ's CQ, the TM QP's SQ, the untagged SRQ ring, the list-operation
// ring and their doorbell records.
const TM_CQ_RING: u64 = MEM_BASE + 0x8000; // up to 128 x 64 B = 8 KiB
const TM_CQ_DB: u64 = MEM_BASE + 0xA000;
const TM_QP_DB: u64 = MEM_BASE + 0xA040;
const SRQ_DB: u64 = MEM_BASE + 0xA080;
const TM_SQ_RING: u64 = MEM_BASE + 0xB000; // up to 64 x 64 B = 4 KiB
const SRQ_RING: u64 = MEM_BASE + 0xC000; // up to 32 x 64 B = 2 KiB
const TM_OPS_RING: u64 = MEM_BASE + 0xD000; // up to 64 x 64 B = 4 KiB

// Counter writebacks: 16 bytes per slot, counter n in slot n % CNTR_WB_SLOTS.
const CNTR_WB: u64 = MEM_BASE + 0xE000;
const CNTR_WB_SLOTS: u32 = 64;
const DATA: u64 = MEM_BASE + 0x1_0000;
const DATA_LEN: u64 = MEM_END - DATA;
/// VA of the remote-read-only MR (backed by `DATA`).
const RO_VA: u64 = 0x4000_0000;
const RO_LEN: u64 = 0x1_0000;

const PEER_IP: [u8; 4] = [10, 0, 0, 2];
const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 2];
/// The peer's QPN of the main connection and of the tag-matching connection.
const PEER_QPN: u32 = 5;
const TM_PEER_QPN: u32 = 6;
/// The peer's send buffer a valid rendezvous header names: READs inside it are answered with
/// data, others with a remote access NAK.
const PEER_VA: u64 = 0x7F00_0000_0000;
const PEER_LEN: u64 = 1 << 20;
const PEER_RKEY: u32 = 0x00AB_CD01;

/// Index of the main QP (and its connection, CQ) and of the tag-matching one.
const MAIN: usize = 0;
const TM: usize = 1;

/// Everything on the harness's event queue.
#[derive(Debug)]
enum Ev {
    /// An event the NIC scheduled for itself (or an MMIO write in flight).
    Nic(NicEvent),
    /// A frame arriving from the peer.
    Frame(Vec<u8>),
}

/// The host side of the NIC: memory behind a trivial IOMMU, the event queue, the link.
struct Host {
    mem: Vec<u8>,
    queue: EventQueue<Ev>,
    /// Frames the NIC transmitted and the peer has not looked at yet.
    tx: Vec<(SimTime, Vec<u8>)>,
    interrupts: u64,
}

impl Host {
    /// Offset into `mem` of `[iova, iova + len)`, if the whole range is mapped.
    fn translate(iova: u64, len: usize) -> Result<usize, DmaFault> {
        if !(MEM_BASE..MEM_END).contains(&iova) {
            return Err(DmaFault { iova });
        }
        match iova.checked_add(len as u64) {
            Some(end) if end <= MEM_END => Ok((iova - MEM_BASE) as usize),
            _ => Err(DmaFault { iova: MEM_END }),
        }
    }
    fn read(&self, iova: u64, out: &mut [u8]) {
        if let Ok(off) = Self::translate(iova, out.len()) {
            out.copy_from_slice(&self.mem[off..off + out.len()]);
        }
    }
    fn write(&mut self, iova: u64, data: &[u8]) {
        let off = Self::translate(iova, data.len()).expect("harness writes outside host memory");
        self.mem[off..off + data.len()].copy_from_slice(data);
    }
    fn u32_at(&self, iova: u64) -> u32 {
        let mut b = [0u8; 4];
        self.read(iova, &mut b);
        u32::from_le_bytes(b)
    }
}

impl Env for Host {
    fn now(&self) -> SimTime {
        self.queue.now()
    }
    fn dma_read(&mut self, iova: u64, buf: &mut [u8]) -> Result<(), DmaFault> {
        let off = Self::translate(iova, buf.len())?;
        buf.copy_from_slice(&self.mem[off..off + buf.len()]);
        Ok(())
    }
    fn dma_write(&mut self, iova: u64, data: &[u8]) -> Result<(), DmaFault> {
        let off = Self::translate(iova, data.len())?;
        // By construction of `translate`; a failure here is a harness bug.
        assert!(off + data.len() <= self.mem.len());
        self.mem[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn dma_check(&self, iova: u64, len: usize) -> Result<(), DmaFault> {
        Self::translate(iova, len).map(|_| ())
    }
    fn schedule(&mut self, at: SimTime, ev: NicEvent) {
        let now = self.queue.now();
        assert!(at >= now, "model scheduled {ev:?} at {at} before now {now}");
        self.queue.push(at, Ev::Nic(ev));
    }
    fn transmit(&mut self, at: SimTime, frame: Vec<u8>) {
        let now = self.queue.now();
        assert!(
            at >= now,
            "model transmitted a frame at {at} before now {now}"
        );
        self.tx.push((at, frame));
    }
    fn interrupt(&mut self, _vector: u32) {
        self.interrupts += 1;
    }
}

/// What the mock peer does with the next frame it would answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PeerAction {
    Answer,
    Drop,
    RnrNak,
    Nak,
}

/// The peer's side of one connection.
struct Conn {
    /// The peer's QPN and the NIC's.
    peer_qpn: u32,
    nic_qpn: u32,
    msn: u32,
    /// Next PSN the NIC's responder expects from the peer (the peer's send PSN).
    next_psn: Psn,
    /// PSN of the last request the NIC sent (what responses refer to).
    last_req_psn: Psn,
    /// Path MTU in bytes.
    mtu: u32,
}

/// The fake remote end of both connections.
struct Peer {
    /// Two bits per answer, cycled: see [`PeerAction`].
    policy: u8,
    counter: u32,
    conns: [Conn; 2],
    /// Answers given so far, by [`PeerAction`] (for the debug summary).
    answers: [u64; 4],
    /// READs of the peer's rendezvous buffer answered with data, FINs seen (debug summary).
    rndv_reads: u64,
    fins: u64,
}

impl Peer {
    fn next_action(&mut self) -> PeerAction {
        if self.answers.iter().sum::<u64>() >= MAX_PEER_ANSWERS {
            return PeerAction::Drop;
        }
        let shift = (self.counter % 4) * 2;
        self.counter = self.counter.wrapping_add(1);
        let a = (self.policy >> shift) & 3;
        self.answers[a as usize] += 1;
        match a {
            0 => PeerAction::Answer,
            1 => PeerAction::Drop,
            2 => PeerAction::RnrNak,
            _ => PeerAction::Nak,
        }
    }
}

/// The mock driver's view of a send queue.
struct SendQueue {
    qpn: u32,
    ring: u64,
    log: u8,
    /// Doorbell record: receive PI, then send PI.
    db_rec: u64,
    pi: u32,
}

/// The mock driver's view of a CQ.
struct CompQueue {
    cqn: u32,
    ring: u64,
    db_rec: u64,
    log: u8,
    ci: u32,
}

/// A tagged buffer the mock driver believes is in the matching list.
#[derive(Clone, Copy, Debug)]
struct Tagged {
    handle: u32,
    tag: u64,
    mask: u64,
    len: u32,
}

/// The mock driver's view of the TM-SRQ.
struct TmDriver {
    srqn: u32,
    srq_log: u8,
    srq_log_stride: u8,
    srq_pi: u32,
    ops_log: u8,
    ops_pi: u32,
    num_tags: u32,
    max_rndv: u32,
    /// ADDed and neither DELeted nor consumed, as far as the driver knows.
    listed: Vec<Tagged>,
    /// Handles recently deleted or consumed (for stale DELs).
    stale: Vec<u32>,
    /// Unexpected tagged messages polled (software's count).
    unexpected: u32,
    /// `tm_hw_cnt` of the last TM completion polled.
    hw_cnt: u16,
    /// Debug summary: list operations and tagged messages sent, TM completions by opcode
    /// (ADD, DEL, SYNC, RECV, NO_TAG), matched ones, failed ones.
    ops_posted: u64,
    msgs: u64,
    cqes: [u64; 5],
    matched: u64,
    failed: u64,
}

impl TmDriver {
    fn forget(&mut self, handle: u32) {
        if let Some(i) = self.listed.iter().position(|t| t.handle == handle) {
            self.listed.swap_remove(i);
        }
        if self.stale.len() >= 16 {
            self.stale.remove(0);
        }
        self.stale.push(handle);
    }
}

/// The mock driver's view of the counters and triggered operations.
struct CntrDriver {
    /// The two PDs of the setup.
    pds: [u32; 2],
    /// Highest PDN seen allocated (setup or a raw ALLOC_PD), for the final flush.
    max_pdn: u32,
    /// Counters the driver believes exist.
    live: Vec<u32>,
    /// Handles POST_TRIGGERED returned (the operation may have fired since).
    handles: Vec<u32>,
    max_cntr: u32,
    /// Debug summary: counter commands by status (0..=9, 10 = other, 11 = unfinished),
    /// triggered operations posted (OK), triggered CQEs polled, COUNTER events seen.
    statuses: [u64; 12],
    posted: u64,
    trig_cqes: u64,
    cntr_events: u64,
    mmio: u64,
}

struct Harness {
    nic: Nic,
    host: Host,
    peer: Peer,
    steps: u64,
    token: u16,
    keys: [u32; 3],
    nic_ip: [u8; 4],
    nic_mac: [u8; 6],
    /// The mock driver's queues, indexed by [`MAIN`] and [`TM`].
    sqs: [SendQueue; 2],
    cqs: [CompQueue; 2],
    rq_pi: u32,
    rq_log: u8,
    rq_log_stride: u8,
    eq_ci: u32,
    tm: TmDriver,
    cntr: CntrDriver,
    /// How each QP was created (to create it again).
    qp_in: [CreateQpIn; 2],
}

/// The UC transition masks (ABI.md 19.2) in place of the RC ones of a connect step.
fn uc_mask(m: M) -> M {
    m - (M::MAX_DEST_RD_ATOMIC
        | M::MIN_RNR_TIMER
        | M::TIMEOUT
        | M::RETRY_CNT
        | M::RNR_RETRY
        | M::MAX_QP_RD_ATOMIC)
}

/// The attributes one connection is brought up with.
#[derive(Clone, Copy)]
struct ConnAttrs {
    path_mtu: u8,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    min_rnr_timer: u8,
    timeout: u8,
    sq_psn: u32,
    rq_psn: u32,
}

/// The path MTU, QP limits, PSNs and ring sizes used for one run.
struct Params {
    main: ConnAttrs,
    sq_log: u8,
    rq_log: u8,
    rq_log_stride: u8,
    cq_log: u8,
    peer_policy: u8,
    tm: ConnAttrs,
    tm_sq_log: u8,
    tm_cq_log: u8,
    srq_log: u8,
    srq_log_stride: u8,
    ops_log: u8,
    num_tags: u32,
    /// Which CQs the TM-SRQ and the TM QP use (bit 0: TM QP send CQ is the TM CQ; 2: the
    /// TM-SRQ shares the main CQ).
    cq_mode: u8,
    /// The main QP is UC (ABI 1.7) instead of RC: the wire frames, WQEs and commands of the
    /// program then meet the UC paths (the mock peer still answers as an RC peer, whose
    /// ACKs the UC QP drops as another transport's).
    main_uc: bool,
}

fn byte(u: &mut Unstructured<'_>) -> u8 {
    u.arbitrary().unwrap_or(0)
}
fn u16_(u: &mut Unstructured<'_>) -> u16 {
    u.arbitrary().unwrap_or(0)
}
fn u32_(u: &mut Unstructured<'_>) -> u32 {
    u.arbitrary().unwrap_or(0)
}
fn u64_(u: &mut Unstructured<'_>) -> u64 {
    u.arbitrary().unwrap_or(0)
}
fn range(u: &mut Unstructured<'_>, lo: u32, hi: u32) -> u32 {
    if hi <= lo {
        return lo;
    }
    u.int_in_range(lo..=hi).unwrap_or(lo)
}
fn flag(u: &mut Unstructured<'_>) -> bool {
    byte(u) & 1 != 0
}

impl ConnAttrs {
    fn read(u: &mut Unstructured<'_>) -> ConnAttrs {
        ConnAttrs {
            path_mtu: range(u, 1, 5) as u8,
            max_rd_atomic: range(u, 0, 16) as u8,
            max_dest_rd_atomic: range(u, 0, 16) as u8,
            retry_cnt: range(u, 0, 7) as u8,
            rnr_retry: range(u, 0, 7) as u8,
            min_rnr_timer: range(u, 0, 31) as u8,
            timeout: range(u, 0, 31) as u8,
            sq_psn: u32_(u) & Psn::MASK,
            rq_psn: u32_(u) & Psn::MASK,
        }
    }
}

impl Params {
    fn read(u: &mut Unstructured<'_>) -> Params {
        Params {
            main: ConnAttrs::read(u),
            sq_log: range(u, 1, 6) as u8,
            rq_log: range(u, 1, 5) as u8,
            rq_log_stride: range(u, 4, 6) as u8,
            cq_log: range(u, 1, 7) as u8,
            peer_policy: byte(u),
            tm: ConnAttrs::read(u),
            tm_sq_log: range(u, 1, 6) as u8,
            tm_cq_log: range(u, 1, 7) as u8,
            srq_log: range(u, 1, 5) as u8,
            srq_log_stride: range(u, 4, 6) as u8,
            ops_log: range(u, 1, 6) as u8,
            num_tags: if byte(u) < 224 {
                range(u, 1, 16)
            } else {
                range(u, 1, 1024)
            },
            cq_mode: byte(u) % 4,
            main_uc: byte(u) >= 192,
        }
    }
}

impl Harness {
    fn new(p: &Params) -> Harness {
        let mut cfg = NicConfig::for_node(0);
        // Small counter and triggered-operation tables, so that an input can fill them
        // (EXHAUSTED) and reuse their slots (handle generations).
        cfg.max_cntr = MAX_CNTR;
        cfg.max_triggered = MAX_TRIGGERED;
        let (nic_ip, nic_mac) = (cfg.ip, cfg.mac);
        let conn = |peer_qpn: u32, a: &ConnAttrs| Conn {
            peer_qpn,
            nic_qpn: 0,
            msn: 0,
            next_psn: Psn::new(a.rq_psn),
            last_req_psn: Psn::new(a.sq_psn),
            mtu: ringbell_specs::cmd::mtu_bytes(a.path_mtu).unwrap_or(256),
        };
        let mut h = Harness {
            nic: Nic::new(cfg),
            host: Host {
                mem: vec![0; MEM_SIZE],
                queue: EventQueue::new(),
                tx: Vec::new(),
                interrupts: 0,
            },
            peer: Peer {
                policy: p.peer_policy,
                counter: 0,
                conns: [conn(PEER_QPN, &p.main), conn(TM_PEER_QPN, &p.tm)],
                answers: [0; 4],
                rndv_reads: 0,
                fins: 0,
            },
            steps: 0,
            token: 0,
            keys: [0; 3],
            nic_ip,
            nic_mac,
            sqs: [
                SendQueue {
                    qpn: 0,
                    ring: SQ_RING,
                    log: p.sq_log,
                    db_rec: QP_DB,
                    pi: 0,
                },
                SendQueue {
                    qpn: 0,
                    ring: TM_SQ_RING,
                    log: p.tm_sq_log,
                    db_rec: TM_QP_DB,
                    pi: 0,
                },
            ],
            cqs: [
                CompQueue {
                    cqn: 0,
                    ring: CQ_RING,
                    db_rec: CQ_DB,
                    log: p.cq_log,
                    ci: 0,
                },
                CompQueue {
                    cqn: 0,
                    ring: TM_CQ_RING,
                    db_rec: TM_CQ_DB,
                    log: p.tm_cq_log,
                    ci: 0,
                },
            ],
            rq_pi: 0,
            rq_log: p.rq_log,
            rq_log_stride: p.rq_log_stride,
            eq_ci: 0,
            tm: TmDriver {
                srqn: 0,
                srq_log: p.srq_log,
                srq_log_stride: p.srq_log_stride,
                srq_pi: 0,
                ops_log: p.ops_log,
                ops_pi: 0,
                num_tags: p.num_tags,
                max_rndv: 0,
                listed: Vec::new(),
                stale: Vec::new(),
                unexpected: 0,
                hw_cnt: 0,
                ops_posted: 0,
                msgs: 0,
                cqes: [0; 5],
                matched: 0,
                failed: 0,
            },
            cntr: CntrDriver {
                pds: [0; 2],
                max_pdn: 0,
                live: Vec::new(),
                handles: Vec::new(),
                max_cntr: 0,
                statuses: [0; 12],
                posted: 0,
                trig_cqes: 0,
                cntr_events: 0,
                mmio: 0,
            },
            qp_in: [CreateQpIn::default(); 2],
        };
        h.setup(p);
        h
    }

    fn mmio_write(&mut self, offset: u64, value: u32) {
        self.nic.mmio_write(&mut self.host, offset, value);
    }

    fn mmio_read(&mut self, offset: u64) -> u32 {
        let now = self.host.queue.now();
        self.nic.mmio_read(now, offset)
    }

    /// Processes one event; `false` when none is left or the budget is spent.
    fn step(&mut self) -> bool {
        if self.steps >= MAX_EVENTS {
            return false;
        }
        let Some((_, ev)) = self.host.queue.pop() else {
            return false;
        };
        self.steps += 1;
        match ev {
            Ev::Nic(e) => self.nic.handle(&mut self.host, e),
            Ev::Frame(f) => self.nic.receive(&mut self.host, &f),
        }
        self.drain_tx();
        true
    }

    fn run(&mut self, n: u64) {
        for _ in 0..n {
            if !self.step() {
                break;
            }
        }
    }

    /// Runs a command the way the driver does (`flags`: header flags, e.g. `CMD_FLAG_EVENT`).
    /// `None` if it never finished.
    fn command(&mut self, op: u16, input: &[u8], flags: u16) -> Option<(u8, [u8; PARAMS_SIZE])> {
        self.token = self.token.wrapping_add(1).max(1);
        let token = self.token;
        let hdr = CmdHeader {
            opcode: op.into(),
            flags: flags.into(),
            token: (token as u32).into(),
            ..Default::default()
        };
        let mut mbox = [0u8; MAILBOX_SIZE];
        mbox[..16].copy_from_slice(hdr.as_bytes());
        let n = input.len().min(PARAMS_SIZE);
        mbox[IN_OFFSET..IN_OFFSET + n].copy_from_slice(&input[..n]);
        self.host.write(MBOX, &mbox);
        self.mmio_write(regs::CMD_DOORBELL, token as u32);
        loop {
            let s = self.mmio_read(regs::CMD_STATUS);
            if s & regs::CMD_STATUS_BUSY == 0 && (s & 0xFFFF) as u16 == token {
                break;
            }
            if !self.step() {
                return None;
            }
        }
        let mut status = [0u8; 1];
        self.host.read(MBOX + RESULT_OFFSET as u64, &mut status);
        let mut out = [0u8; PARAMS_SIZE];
        self.host.read(MBOX + OUT_OFFSET as u64, &mut out);
        if op == CmdOpcode::AllocPd as u16 && status[0] == 0 {
            let pdn = u32::from_le_bytes([out[0], out[1], out[2], out[3]]);
            self.cntr.max_pdn = self.cntr.max_pdn.max(pdn);
        }
        Some((status[0], out))
    }

    /// A setup command that must succeed.
    fn must(&mut self, op: CmdOpcode, input: &[u8]) -> [u8; PARAMS_SIZE] {
        match self.command(op as u16, input, 0) {
            Some((0, out)) => out,
            other => panic!("harness setup: {op:?} failed: {:?}", other.map(|o| o.0)),
        }
    }

    fn must_create(&mut self, op: CmdOpcode, input: &[u8]) -> u32 {
        let out = self.must(op, input);
        ObjectOut::read_from_prefix(&out)
            .map(|(o, _)| o.num.get())
            .unwrap_or(0)
    }

    fn setup(&mut self, p: &Params) {
        self.mmio_write(regs::CMD_ADDR_LO, MBOX as u32);
        self.mmio_write(regs::CMD_ADDR_HI, (MBOX >> 32) as u32);
        self.mmio_write(regs::EQ_ADDR_LO, EQ_RING as u32);
        self.mmio_write(regs::EQ_ADDR_HI, (EQ_RING >> 32) as u32);
        self.mmio_write(regs::EQ_LOG_SIZE, EQ_LOG as u32);
        let out = self.must(CmdOpcode::QueryDevice, &[]);
        let dev: QueryDeviceOut = QueryDeviceOut::read_from_prefix(&out)
            .map(|(d, _)| d)
            .unwrap_or_default();
        let caps = regs::Caps::from_bits_truncate(dev.caps.get());
        assert!(
            caps.contains(regs::Caps::TM_RC),
            "harness setup: QUERY_DEVICE reports no TM_RC ({caps:?})"
        );
        assert!(
            dev.max_num_tags.get() >= 1 && dev.max_tm_ops.get() >= 2,
            "harness setup: no room for tag matching ({dev:?})"
        );
        self.tm.num_tags = self.tm.num_tags.min(dev.max_num_tags.get());
        self.tm.max_rndv = dev.max_rndv_hdr_size.get();
        while (1u32 << self.tm.ops_log) > dev.max_tm_ops.get() {
            self.tm.ops_log -= 1;
        }
        let pd = self.must_create(CmdOpcode::AllocPd, &[]);
        let pd2 = self.must_create(CmdOpcode::AllocPd, &[]);
        self.cntr.pds = [pd, pd2];
        let all = Access::LOCAL_WRITE
            | Access::REMOTE_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_ATOMIC;
        let mrs = [
            RegMrIn {
                pdn: pd.into(),
                access: all.bits().into(),
                va: MEM_BASE.into(),
                length: (MEM_SIZE as u64).into(),
                iova: MEM_BASE.into(),
            },
            RegMrIn {
                pdn: pd.into(),
                access: Access::REMOTE_READ.bits().into(),
                va: RO_VA.into(),
                length: RO_LEN.into(),
                iova: DATA.into(),
            },
            RegMrIn {
                pdn: pd2.into(),
                access: all.bits().into(),
                va: DATA.into(),
                length: DATA_LEN.into(),
                iova: DATA.into(),
            },
        ];
        for (i, mr) in mrs.iter().enumerate() {
            let out = self.must(CmdOpcode::RegMr, mr.as_bytes());
            self.keys[i] = u32::from_le_bytes(out[..4].try_into().unwrap());
        }
        for k in [MAIN, TM] {
            let cq = CreateCqIn {
                log_size: self.cqs[k].log,
                ring_iova: self.cqs[k].ring.into(),
                db_iova: self.cqs[k].db_rec.into(),
                ..Default::default()
            };
            self.cqs[k].cqn = self.must_create(CmdOpcode::CreateCq, cq.as_bytes());
        }
        let cqn = self.cqs[MAIN].cqn;
        let qp = CreateQpIn {
            pdn: pd.into(),
            send_cqn: cqn.into(),
            recv_cqn: cqn.into(),
            sq_log_size: p.sq_log,
            rq_log_size: p.rq_log,
            rq_log_stride: p.rq_log_stride,
            sq_iova: SQ_RING.into(),
            rq_iova: RQ_RING.into(),
            db_iova: QP_DB.into(),
            qp_type: if p.main_uc {
                ringbell_specs::cmd::QP_TYPE_UC
            } else {
                ringbell_specs::cmd::QP_TYPE_RC
            },
            ..Default::default()
        };
        self.sqs[MAIN].qpn = self.must_create(CmdOpcode::CreateQp, qp.as_bytes());
        self.qp_in[MAIN] = qp;
        // The TM-SRQ, the way driver/src/srq.rs and driver/src/tm.rs create one.
        let tm_cqn = self.cqs[TM].cqn;
        let srq_cqn = if p.cq_mode == 2 { cqn } else { tm_cqn };
        let srq = CreateTmSrqIn {
            srq: CreateSrqIn {
                pdn: pd.into(),
                log_size: p.srq_log,
                log_stride: p.srq_log_stride,
                ring_iova: SRQ_RING.into(),
                db_iova: SRQ_DB.into(),
                ..Default::default()
            },
            cqn: srq_cqn.into(),
            max_num_tags: self.tm.num_tags.into(),
            ops_log_size: self.tm.ops_log,
            ops_iova: TM_OPS_RING.into(),
            ..Default::default()
        };
        self.tm.srqn = self.must_create(CmdOpcode::CreateTmSrq, srq.as_bytes());
        let qp = CreateQpIn {
            pdn: pd.into(),
            send_cqn: if p.cq_mode & 1 != 0 { tm_cqn } else { cqn }.into(),
            recv_cqn: tm_cqn.into(),
            srqn: self.tm.srqn.into(),
            sq_log_size: p.tm_sq_log,
            sq_iova: TM_SQ_RING.into(),
            db_iova: TM_QP_DB.into(),
            ..Default::default()
        };
        self.sqs[TM].qpn = self.must_create(CmdOpcode::CreateQp, qp.as_bytes());
        self.qp_in[TM] = qp;
        for c in [MAIN, TM] {
            self.peer.conns[c].nic_qpn = self.sqs[c].qpn;
        }
        self.connect(MAIN, &p.main, true);
        self.connect(TM, &p.tm, true);
        self.setup_counters(&dev);
        // Consume the command-completion events so the EQ starts empty.
        self.consume_eq();
    }

    /// Counters (ABI 1.3): C1 (first PD, writeback) counts every event of the main QP; C2
    /// (first PD, no writeback) the TM QP's SEND, RECV, READ and WRITE and the remote
    /// accesses through the first MR; C3 (second PD, writeback) nothing yet.
    fn setup_counters(&mut self, dev: &QueryDeviceOut) {
        let caps = regs::Caps::from_bits_truncate(dev.caps.get());
        assert!(
            caps.contains(regs::Caps::TRIGGERED),
            "harness setup: QUERY_DEVICE reports no TRIGGERED ({caps:?})"
        );
        self.cntr.max_cntr = dev.max_cntr.get();
        assert!(
            self.cntr.max_cntr >= 3 && dev.max_triggered.get() >= 1,
            "harness setup: no room for counters ({dev:?})"
        );
        let [pd, pd2] = self.cntr.pds;
        for (pdn, wb) in [(pd, true), (pd, false), (pd2, true)] {
            let n = self.cntr.live.len() as u32 + 1;
            let c = CreateCntrIn {
                pdn: pdn.into(),
                wb_iova: if wb { Self::wb_slot(n) } else { 0 }.into(),
                ..Default::default()
            };
            let n = self.must_create(CmdOpcode::CreateCntr, c.as_bytes());
            self.cntr.live.push(n);
        }
        let (c1, c2) = (self.cntr.live[0], self.cntr.live[1]);
        let binds = [
            (c1, CNTR_BIND_QP, self.sqs[MAIN].qpn, CntrEvents::all()),
            (
                c2,
                CNTR_BIND_QP,
                self.sqs[TM].qpn,
                CntrEvents::SEND | CntrEvents::RECV | CntrEvents::READ | CntrEvents::WRITE,
            ),
            (
                c2,
                CNTR_BIND_MR,
                self.keys[0],
                CntrEvents::REMOTE_READ | CntrEvents::REMOTE_WRITE,
            ),
        ];
        for (cntr, kind, obj, events) in binds {
            let b = BindCntrIn {
                cntr: cntr.into(),
                kind,
                obj: obj.into(),
                events: events.bits().into(),
                ..Default::default()
            };
            self.must(CmdOpcode::BindCntr, b.as_bytes());
        }
    }

    /// Sends MODIFY_QP; the status (`None`: the command never finished).
    fn modify(&mut self, qpn: u32, mask: M, attr: QpAttr, flags: u16) -> Option<u8> {
        let m = ModifyQpIn {
            qpn: qpn.into(),
            attr_mask: mask.bits().into(),
            attr,
        };
        self.command(CmdOpcode::ModifyQp as u16, m.as_bytes(), flags)
            .map(|(s, _)| s)
    }

    /// Moves QP `q` INIT → RTR → RTS towards its peer (from RESET first unless `setup`, where
    /// every step must succeed). On success both ends start over.
    fn connect(&mut self, q: usize, a: &ConnAttrs, setup: bool) -> bool {
        let qpn = self.sqs[q].qpn;
        let all = Access::LOCAL_WRITE
            | Access::REMOTE_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_ATOMIC;
        let reset = QpAttr {
            state: QpState::Reset as u8,
            ..Default::default()
        };
        let init = QpAttr {
            state: QpState::Init as u8,
            access: all.bits().into(),
            ..Default::default()
        };
        let rtr = QpAttr {
            state: QpState::Rtr as u8,
            path_mtu: a.path_mtu,
            dest_qpn: self.peer.conns[q].peer_qpn.into(),
            rq_psn: a.rq_psn.into(),
            max_dest_rd_atomic: a.max_dest_rd_atomic,
            min_rnr_timer: a.min_rnr_timer,
            dest_mac: PEER_MAC,
            dest_ip: PEER_IP,
            ..Default::default()
        };
        let rts = QpAttr {
            state: QpState::Rts as u8,
            timeout: a.timeout,
            retry_cnt: a.retry_cnt,
            rnr_retry: a.rnr_retry,
            sq_psn: a.sq_psn.into(),
            max_rd_atomic: a.max_rd_atomic,
            ..Default::default()
        };
        let mut steps = vec![
            (M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, init),
            (
                M::STATE
                    | M::AV
                    | M::PATH_MTU
                    | M::DEST_QPN
                    | M::RQ_PSN
                    | M::MAX_DEST_RD_ATOMIC
                    | M::MIN_RNR_TIMER,
                rtr,
            ),
            (
                M::STATE
                    | M::TIMEOUT
                    | M::RETRY_CNT
                    | M::RNR_RETRY
                    | M::SQ_PSN
                    | M::MAX_QP_RD_ATOMIC,
                rts,
            ),
        ];
        if !setup {
            steps.insert(0, (M::STATE, reset));
        }
        let uc = self.qp_in[q].qp_type == ringbell_specs::cmd::QP_TYPE_UC;
        for (mask, attr) in steps {
            let mask = if uc { uc_mask(mask) } else { mask };
            let status = self.modify(qpn, mask, attr, 0);
            if setup && status != Some(0) {
                panic!("harness setup: MODIFY_QP {mask:?} of QP {qpn} failed: {status:?}");
            }
            if status != Some(0) {
                return false;
            }
        }
        self.sqs[q].pi = 0;
        if q == MAIN {
            self.rq_pi = 0;
        }
        let c = &mut self.peer.conns[q];
        c.next_psn = Psn::new(a.rq_psn);
        c.last_req_psn = Psn::new(a.sq_psn);
        c.mtu = ringbell_specs::cmd::mtu_bytes(a.path_mtu).unwrap_or(256);
        c.msn = 0;
        true
    }

    // ---- the mock peer ----------------------------------------------------------------

    /// Looks at every frame the NIC sent; the peer answers some of them.
    fn drain_tx(&mut self) {
        if self.host.tx.is_empty() {
            return;
        }
        let tx = std::mem::take(&mut self.host.tx);
        for (at, frame) in &tx {
            let pkt = match wire::parse_packet(frame) {
                Ok(p) => p,
                Err(e) => panic!(
                    "the NIC transmitted a malformed frame ({e:?}): {}",
                    hex(frame)
                ),
            };
            assert_eq!(
                pkt.repr.src.ip, self.nic_ip,
                "the NIC transmitted a frame from another IPv4 address"
            );
            assert_eq!(
                pkt.repr.src.mac, self.nic_mac,
                "the NIC transmitted a frame from another MAC"
            );
            let dest = pkt.repr.bth.dest_qp.get();
            let Some(c) = self.peer.conns.iter().position(|c| c.peer_qpn == dest) else {
                continue;
            };
            if pkt.repr.dst.ip != PEER_IP {
                continue;
            }
            let Some(op) = Opcode::from_u8(pkt.repr.bth.opcode) else {
                continue;
            };
            let psn = pkt.repr.bth.psn;
            if op.is_response() {
                // The NIC's responder answering the peer. A PSN sequence NAK names the PSN
                // it expects and an RNR NAK the request it did not take: the peer's next
                // requests start there, as a real requester's retransmission would.
                if let Some(
                    AethSyndrome::Nak(NakCode::PsnSequenceError) | AethSyndrome::RnrNak { .. },
                ) = pkt.repr.aeth.map(|a| a.syndrome)
                {
                    self.peer.conns[c].next_psn = psn;
                }
                continue;
            }
            if c == TM
                && op == Opcode::SendOnly
                && pkt.payload.len() == TMH_LEN + RVH_LEN
                && pkt.payload[0] == TmhOp::Fin as u8
            {
                self.peer.fins += 1;
            }
            self.peer.conns[c].last_req_psn = psn;
            if !(pkt.repr.bth.ack_req || op == Opcode::ReadRequest || op.is_atomic()) {
                continue;
            }
            let arrive = *at + SimTime(500_000);
            match self.peer.next_action() {
                PeerAction::Drop => {}
                PeerAction::RnrNak => {
                    self.peer_ack(c, arrive, psn, AethSyndrome::RnrNak { timer: 1 })
                }
                PeerAction::Nak => {
                    let code = match psn.get() % 4 {
                        0 => NakCode::PsnSequenceError,
                        1 => NakCode::InvalidRequest,
                        2 => NakCode::RemoteAccessError,
                        _ => NakCode::RemoteOperationalError,
                    };
                    self.peer_ack(c, arrive, psn, AethSyndrome::Nak(code));
                }
                PeerAction::Answer => match op {
                    Opcode::ReadRequest => {
                        let (va, rkey, len) =
                            pkt.repr.reth.map_or((0, 0, 0), |r| (r.va, r.rkey, r.len));
                        // On the TM connection the peer serves only its own send buffer
                        // (what a rendezvous names).
                        let inside = rkey == PEER_RKEY
                            && va >= PEER_VA
                            && va
                                .checked_add(len as u64)
                                .is_some_and(|end| end <= PEER_VA + PEER_LEN);
                        if c == TM && !inside {
                            let nak = AethSyndrome::Nak(NakCode::RemoteAccessError);
                            self.peer_ack(c, arrive, psn, nak);
                        } else {
                            if c == TM {
                                self.peer.rndv_reads += 1;
                            }
                            self.peer_read_response(c, arrive, psn, len);
                        }
                    }
                    Opcode::CompareSwap | Opcode::FetchAdd => {
                        let conn = &mut self.peer.conns[c];
                        conn.msn = conn.msn.wrapping_add(1);
                        let msn = conn.msn;
                        let mut r = self.peer_repr(c, Opcode::AtomicAcknowledge, psn);
                        r.aeth = Some(Aeth {
                            syndrome: AethSyndrome::Ack { credits: 0x1F },
                            msn: msn & 0xFF_FFFF,
                        });
                        r.atomic_ack = Some(0x1122_3344_5566_7788 ^ psn.get() as u64);
                        self.send_from_peer(arrive, &r, &[]);
                    }
                    _ => {
                        let conn = &mut self.peer.conns[c];
                        conn.msn = conn.msn.wrapping_add(1);
                        self.peer_ack(c, arrive, psn, AethSyndrome::Ack { credits: 0x1F });
                    }
                },
            }
        }
        // Hand the buffer back to avoid re-allocating it every step.
        let mut tx = tx;
        tx.clear();
        if self.host.tx.is_empty() {
            self.host.tx = tx;
        }
    }

    /// A packet from the peer on connection `c`.
    fn peer_repr(&self, c: usize, opcode: Opcode, psn: Psn) -> PacketRepr {
        let conn = &self.peer.conns[c];
        // A peer of a UC QP sends its SENDs and WRITEs with the UC opcodes.
        let opcode = match opcode.to_uc() {
            Some(uc) if self.qp_in[c].qp_type == ringbell_specs::cmd::QP_TYPE_UC => uc,
            _ => opcode,
        };
        PacketRepr {
            src: Endpoint {
                mac: PEER_MAC,
                ip: PEER_IP,
            },
            dst: Endpoint {
                mac: self.nic_mac,
                ip: self.nic_ip,
            },
            udp_src_port: wire::udp_src_port(
                Qpn::from_bits(conn.peer_qpn),
                Qpn::from_bits(conn.nic_qpn),
            ),
            ip_id: psn.get() as u16,
            tos: 0,
            ttl: 64,
            bth: BthRepr {
                opcode: opcode as u8,
                solicited: false,
                mig_req: false,
                pad: 0,
                tver: 0,
                pkey: wire::DEFAULT_PKEY,
                fecn: false,
                becn: false,
                dest_qp: Qpn::from_bits(conn.nic_qpn),
                ack_req: false,
                psn,
            },
            deth: None,
            reth: None,
            aeth: None,
            atomic_eth: None,
            xrc: None,
            atomic_ack: None,
            imm: None,
        }
    }

    fn peer_ack(&mut self, c: usize, at: SimTime, psn: Psn, syndrome: AethSyndrome) {
        let mut r = self.peer_repr(c, Opcode::Acknowledge, psn);
        r.aeth = Some(Aeth {
            syndrome,
            msn: self.peer.conns[c].msn & 0xFF_FFFF,
        });
        self.send_from_peer(at, &r, &[]);
    }

    fn peer_read_response(&mut self, c: usize, at: SimTime, first: Psn, len: u32) {
        let conn = &mut self.peer.conns[c];
        let mtu = conn.mtu;
        // Cap the work per READ: a longer one is answered only in part (and never completes).
        let n = len.div_ceil(mtu).clamp(1, 64);
        conn.msn = conn.msn.wrapping_add(1);
        let msn = conn.msn;
        let full = len.div_ceil(mtu).max(1);
        let mut payload = Vec::new();
        for i in 0..n {
            let opcode = match (i == 0, i + 1 == full) {
                (true, true) => Opcode::ReadResponseOnly,
                (true, false) => Opcode::ReadResponseFirst,
                (false, false) => Opcode::ReadResponseMiddle,
                (false, true) => Opcode::ReadResponseLast,
            };
            let plen = (len - i * mtu).min(mtu) as usize;
            payload.clear();
            payload.extend((0..plen).map(|k| (k as u8) ^ (i as u8)));
            let mut r = self.peer_repr(c, opcode, first.add(i));
            if opcode.has_aeth() {
                r.aeth = Some(Aeth {
                    syndrome: AethSyndrome::Ack { credits: 0x1F },
                    msn: msn & 0xFF_FFFF,
                });
            }
            self.send_from_peer(at + SimTime(i as u64 * 30_000), &r, &payload);
        }
    }

    fn send_from_peer(&mut self, at: SimTime, r: &PacketRepr, payload: &[u8]) {
        let mut frame = Vec::with_capacity(r.frame_len(payload.len()));
        r.emit(payload, &mut frame);
        self.host.queue.push(at, Ev::Frame(frame));
    }

    // ---- the mock driver ----------------------------------------------------------------

    /// Which QP (and connection) an action is about: mostly the main one.
    fn pick_qp(u: &mut Unstructured<'_>) -> usize {
        if byte(u) < 176 {
            MAIN
        } else {
            TM
        }
    }

    fn sq_slot(&self, q: usize, index: u32) -> u64 {
        let sq = &self.sqs[q];
        sq.ring + (index & ((1 << sq.log) - 1)) as u64 * WQEBB as u64
    }

    /// Copies a WQE of whole blocks into SQ `q` at the driver's producer index.
    fn put_wqe(&mut self, q: usize, wqe: &[u8]) {
        for (b, chunk) in wqe.chunks(WQEBB).enumerate() {
            let mut block = [0u8; WQEBB];
            block[..chunk.len()].copy_from_slice(chunk);
            let at = self.sq_slot(q, self.sqs[q].pi.wrapping_add(b as u32));
            self.host.write(at, &block);
        }
        let sq = &mut self.sqs[q];
        sq.pi = sq.pi.wrapping_add(wqe.len().div_ceil(WQEBB).max(1) as u32);
    }

    fn pick_key(&self, u: &mut Unstructured<'_>) -> u32 {
        match byte(u) % 8 {
            0..=3 => self.keys[0],
            4 => self.keys[1],
            5 => self.keys[2],
            6 => 0,
            // A key that may be one of the first memory windows' (ABI 1.9).
            _ if flag(u) => MW_KEY_BIT | range(u, 1, 4) << 8 | byte(u) as u32,
            _ => u32_(u),
        }
    }

    fn pick_addr(&self, u: &mut Unstructured<'_>) -> u64 {
        match byte(u) % 8 {
            // Into the data area of the all-access MR.
            0..=3 => DATA + (u32_(u) as u64 % DATA_LEN),
            // Small offsets into the data area (aligned, for atomics).
            4 => DATA + (byte(u) as u64) * 8,
            // The read-only MR's VA.
            5 => RO_VA + (u16_(u) as u64 % RO_LEN),
            // Close to the end of host memory.
            6 => MEM_END - (u16_(u) as u64 % 0x2000),
            _ => u64_(u),
        }
    }

    /// A length for connection `c` (around its path MTU).
    fn pick_len(&self, u: &mut Unstructured<'_>, c: usize) -> u32 {
        let mtu = self.peer.conns[c].mtu;
        match byte(u) % 8 {
            0..=2 => byte(u) as u32,
            3 => 8,
            4 => range(u, 0, 3 * mtu + 1),
            5 => mtu,
            6 => range(u, 0, 0x2_0000),
            _ => u32_(u),
        }
    }

    /// A send WQE for SQ `q` built segment by segment, mostly valid.
    fn build_wqe(&self, u: &mut Unstructured<'_>, q: usize) -> Vec<u8> {
        let opcode = if byte(u) < 240 {
            range(u, 1, 11) as u8
        } else {
            byte(u)
        };
        let op = SendOpcode::from_u8(opcode);
        let flags = if byte(u) < 240 {
            byte(u) & 0xF
        } else {
            byte(u)
        };
        let mut segs: Vec<u8> = Vec::with_capacity(MAX_SEND_WQE);
        segs.extend_from_slice(&[0u8; SEG]); // control segment, filled in below
        if op.is_none_or(|o| o.has_raddr()) {
            let r = RaddrSeg {
                raddr: self.pick_addr(u).into(),
                rkey: self.pick_key(u).into(),
                ..Default::default()
            };
            segs.extend_from_slice(r.as_bytes());
        }
        if op == Some(SendOpcode::BindMw) {
            // A bind of one of the first windows over some of a region (ABI 1.9).
            let mw = MW_KEY_BIT | range(u, 1, 4) << 8 | byte(u) as u32;
            let b = BindSeg {
                addr: self.pick_addr(u).into(),
                length: u64::from(self.pick_len(u, q)).into(),
                mw_key: mw.into(),
                new_key: if flag(u) {
                    (mw & !0xFF) | byte(u) as u32
                } else {
                    u32_(u)
                }
                .into(),
                mr_key: self.pick_key(u).into(),
                access: if flag(u) {
                    u32::from(byte(u) & 0x2E)
                } else {
                    u32_(u)
                }
                .into(),
            };
            segs.extend_from_slice(b.as_bytes());
        }
        if op.is_some_and(|o| o.is_atomic()) {
            let a = AtomicSeg {
                swap_add: u64_(u).into(),
                compare: u64_(u).into(),
            };
            segs.extend_from_slice(a.as_bytes());
        }
        if flags & 0x8 != 0 {
            // Inline: a 4-byte header with the mark, then the data, padded to a segment.
            let room = MAX_SEND_WQE - segs.len() - 4;
            let n = range(u, 0, room as u32) as usize;
            let bc = if byte(u) < 240 {
                n as u32 | INLINE_MARK
            } else {
                u32_(u)
            };
            segs.extend_from_slice(&bc.to_le_bytes());
            let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
            let take = u.bytes(n.min(u.len())).unwrap_or(&[]);
            let mut data = data;
            data[..take.len()].copy_from_slice(take);
            segs.extend_from_slice(&data);
            segs.resize(segs.len().next_multiple_of(SEG), 0);
        } else {
            let room = (MAX_SEND_WQE - segs.len()) / SEG;
            let is_atomic = op.is_some_and(|o| o.is_atomic());
            let n = if is_atomic && byte(u) < 200 {
                1
            } else {
                range(u, 0, room as u32) as usize
            };
            for _ in 0..n {
                let len = if is_atomic && byte(u) < 200 {
                    8
                } else {
                    self.pick_len(u, q)
                };
                let d = DataSeg {
                    byte_count: len.into(),
                    lkey: self.pick_key(u).into(),
                    addr: self.pick_addr(u).into(),
                };
                segs.extend_from_slice(d.as_bytes());
            }
        }
        let mut ds = (segs.len() / SEG) as u8;
        if byte(u) >= 248 {
            ds = byte(u);
        }
        let wqe_index = if byte(u) < 240 {
            self.sqs[q].pi as u16
        } else {
            u16_(u)
        };
        let ctrl = CtrlSeg {
            opcode,
            flags,
            wqe_index: wqe_index.into(),
            ds_count: ds,
            imm: u32_(u).into(),
            ..Default::default()
        };
        segs[..SEG].copy_from_slice(ctrl.as_bytes());
        segs
    }

    /// Action: put a send WQE into an SQ ring.
    fn act_sq_wqe(&mut self, u: &mut Unstructured<'_>) {
        let q = Self::pick_qp(u);
        let mode = byte(u) % 4;
        if mode == 3 {
            let wqe = self.build_wqe(u, q);
            self.put_wqe(q, &wqe);
            return;
        }
        // Raw blocks from the input.
        let nbb = range(u, 1, 4) as usize;
        let mut wqe = vec![0u8; nbb * WQEBB];
        let take = u.bytes((nbb * WQEBB).min(u.len())).unwrap_or(&[]);
        wqe[..take.len()].copy_from_slice(take);
        if mode >= 1 {
            // Keep the wqe_index valid.
            wqe[2..4].copy_from_slice(&(self.sqs[q].pi as u16).to_le_bytes());
        }
        if mode == 2 {
            // Keep the opcode known, the flags defined and the segment count consistent.
            wqe[0] = wqe[0] % 7 + 1;
            wqe[1] &= 0xF;
            wqe[4] = (wqe[4] as usize % (nbb * 4)) as u8 + 1;
        }
        self.put_wqe(q, &wqe);
    }

    /// Action: ring an SQ doorbell.
    fn act_sq_doorbell(&mut self, u: &mut Unstructured<'_>) {
        let q = Self::pick_qp(u);
        let pi = self.sqs[q].pi;
        let value = match byte(u) % 8 {
            0..=4 => pi,
            5 => pi.wrapping_add((byte(u) as i8) as u32),
            _ => u32_(u),
        };
        let offset = regs::QP_DB_BASE + self.sqs[q].qpn as u64 * regs::DB_STRIDE + regs::DB_SQ;
        self.doorbell(u, offset, value);
        // Also keep the doorbell record up to date, as the driver does.
        let rec = pi.to_le_bytes();
        self.host.write(self.sqs[q].db_rec + 4, &rec);
    }

    /// Writes a doorbell now, or sends it on its way through the PCIe posting latency.
    fn doorbell(&mut self, u: &mut Unstructured<'_>, offset: u64, value: u32) {
        if flag(u) {
            self.mmio_write(offset, value);
        } else {
            let at = self.host.queue.now() + SimTime(240_000 + byte(u) as u64 * 1000);
            self.host
                .queue
                .push(at, Ev::Nic(NicEvent::Mmio { offset, value }));
        }
    }

    /// A receive WQE of `stride` bytes: raw bytes, or SGEs (lengths around connection `c`'s
    /// MTU) ended by the end mark when they do not fill it.
    fn recv_wqe(&self, u: &mut Unstructured<'_>, stride: usize, c: usize) -> Vec<u8> {
        let mut wqe = vec![0u8; stride];
        if byte(u) < 40 {
            let take = u.bytes(stride.min(u.len())).unwrap_or(&[]);
            wqe[..take.len()].copy_from_slice(take);
        } else {
            let n = range(u, 0, (stride / SEG) as u32) as usize;
            for i in 0..n {
                let d = DataSeg {
                    byte_count: self.pick_len(u, c).into(),
                    lkey: self.pick_key(u).into(),
                    addr: self.pick_addr(u).into(),
                };
                wqe[i * SEG..(i + 1) * SEG].copy_from_slice(d.as_bytes());
            }
            if n < stride / SEG {
                let end = DataSeg {
                    lkey: RECV_LKEY_END.into(),
                    ..Default::default()
                };
                wqe[n * SEG..(n + 1) * SEG].copy_from_slice(end.as_bytes());
            }
        }
        wqe
    }

    /// Action: post a receive WQE (and usually ring the RQ doorbell).
    fn act_recv(&mut self, u: &mut Unstructured<'_>) {
        let stride = 1usize << self.rq_log_stride;
        let wqe = self.recv_wqe(u, stride, MAIN);
        let size = 1u32 << self.rq_log;
        let at = RQ_RING + (self.rq_pi & (size - 1)) as u64 * stride as u64;
        self.host.write(at, &wqe);
        self.rq_pi = self.rq_pi.wrapping_add(1);
        self.host.write(QP_DB, &self.rq_pi.to_le_bytes());
        let value = match byte(u) % 8 {
            0..=5 => self.rq_pi,
            6 => return, // post without a doorbell (a later one covers it)
            _ => u32_(u),
        };
        let offset = regs::QP_DB_BASE + self.sqs[MAIN].qpn as u64 * regs::DB_STRIDE + regs::DB_RQ;
        self.doorbell(u, offset, value);
    }

    /// Action: post an untagged receive WQE to the TM-SRQ (and usually ring its doorbell).
    fn act_srq_recv(&mut self, u: &mut Unstructured<'_>) {
        let stride = 1usize << self.tm.srq_log_stride;
        let wqe = self.recv_wqe(u, stride, TM);
        let size = 1u32 << self.tm.srq_log;
        let at = SRQ_RING + (self.tm.srq_pi & (size - 1)) as u64 * stride as u64;
        self.host.write(at, &wqe);
        self.tm.srq_pi = self.tm.srq_pi.wrapping_add(1);
        self.host.write(SRQ_DB, &self.tm.srq_pi.to_le_bytes());
        let value = match byte(u) % 8 {
            0..=5 => self.tm.srq_pi,
            6 => return,
            _ => u32_(u),
        };
        let offset = regs::SRQ_DB_BASE + self.tm.srqn as u64 * regs::DB_STRIDE;
        self.doorbell(u, offset, value);
    }

    /// A frame with valid headers addressed to QP `c`, fuzzed fields.
    fn build_frame(&mut self, u: &mut Unstructured<'_>, c: usize) -> Vec<u8> {
        let opcode = match byte(u) {
            0..=229 => range(u, 0, 0x14) as u8,
            // ATOMIC WRITE (ABI 1.10).
            230..=239 => Opcode::AtomicWrite as u8,
            _ => byte(u),
        };
        let op = Opcode::from_u8(opcode);
        let is_response = op.is_some_and(|o| o.is_response());
        let (next_psn, last_req_psn, mtu) = {
            let conn = &self.peer.conns[c];
            (conn.next_psn, conn.last_req_psn, conn.mtu)
        };
        let psn = match byte(u) % 8 {
            0..=3 if !is_response => next_psn,
            0..=3 => last_req_psn,
            4 | 5 => {
                let base = if is_response { last_req_psn } else { next_psn };
                base.add((byte(u) as i8) as u32)
            }
            _ => Psn::new(u32_(u)),
        };
        let mut r = self.peer_repr(c, Opcode::SendOnly, psn);
        // To a UC QP, mostly the UC form of the operation (else the RC one it drops).
        r.bth.opcode = match op.and_then(Opcode::to_uc) {
            Some(uc) if self.qp_in[c].qp_type == ringbell_specs::cmd::QP_TYPE_UC && flag(u) => {
                uc.to_u8()
            }
            _ => opcode,
        };
        r.bth.ack_req = flag(u);
        r.bth.solicited = flag(u);
        match byte(u) % 16 {
            0 => r.src.ip = [u32_(u) as u8, 0, 0, 2],
            1 => r.dst.ip = [10, 0, 0, byte(u)],
            2 => r.bth.dest_qp = Qpn::from_bits(u32_(u)),
            3 => r.bth.pkey = u16_(u),
            _ => {}
        }
        if op.is_some_and(|o| o.has_reth()) || byte(u) < 16 {
            r.reth = Some(Reth {
                va: self.pick_addr(u),
                rkey: self.pick_key(u),
                len: self.pick_len(u, c),
            });
        }
        if op.is_some_and(|o| o.has_aeth()) {
            let s = byte(u);
            let syndrome =
                AethSyndrome::from_u8(s).unwrap_or(AethSyndrome::Ack { credits: s & 0x1F });
            r.aeth = Some(Aeth {
                syndrome,
                msn: u32_(u),
            });
        }
        if op.is_some_and(|o| o.has_atomic_eth()) {
            let mut va = self.pick_addr(u);
            if byte(u) < 200 {
                va &= !7;
            }
            r.atomic_eth = Some(AtomicEth {
                va,
                rkey: self.pick_key(u),
                swap_add: u64_(u),
                compare: u64_(u),
            });
        }
        if op.is_some_and(|o| o.has_atomic_ack_eth()) {
            r.atomic_ack = Some(u64_(u));
        }
        if op.is_some_and(|o| o.has_immdt()) {
            r.imm = Some(u32_(u));
        }
        let mtu = mtu as usize;
        let plen = match byte(u) % 8 {
            0 | 1 => 0,
            2 | 3 => mtu,
            4 => range(u, 0, mtu as u32) as usize,
            5 => range(u, 0, 64) as usize,
            _ => range(u, 0, 4200) as usize,
        };
        let seed = byte(u);
        let mut payload: Vec<u8> = (0..plen)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect();
        let take = u.bytes(plen.min(16).min(u.len())).unwrap_or(&[]);
        payload[..take.len()].copy_from_slice(take);
        // An in-sequence request moves the peer's PSN on.
        if op.is_some_and(|o| o.is_request()) && psn == next_psn {
            let n = if op == Some(Opcode::ReadRequest) {
                r.reth.map_or(1, |x| x.len.div_ceil(mtu as u32).max(1))
            } else {
                1
            };
            self.peer.conns[c].next_psn = psn.add(n);
        }
        let mut frame = Vec::with_capacity(r.frame_len(payload.len()));
        r.emit(&payload, &mut frame);
        Self::damage(u, &mut frame);
        frame
    }

    /// Sometimes corrupts one byte of a frame (the ICRC or a header check then rejects it)
    /// or adds Ethernet padding.
    fn damage(u: &mut Unstructured<'_>, frame: &mut Vec<u8>) {
        if byte(u) >= 248 && !frame.is_empty() {
            let pos = u16_(u) as usize % frame.len();
            frame[pos] ^= byte(u) | 1;
        }
        if byte(u) >= 248 {
            frame.resize(frame.len() + byte(u) as usize % 64, 0);
        }
    }

    /// Action: a frame arrives from the wire.
    fn act_frame(&mut self, u: &mut Unstructured<'_>) {
        let frame = if byte(u) < 32 {
            let n = range(u, 0, 1600) as usize;
            u.bytes(n.min(u.len())).unwrap_or(&[]).to_vec()
        } else {
            let c = Self::pick_qp(u);
            self.build_frame(u, c)
        };
        self.deliver(u, vec![frame]);
    }

    /// Frames arrive now one after the other, or later spread out in time.
    fn deliver(&mut self, u: &mut Unstructured<'_>, frames: Vec<Vec<u8>>) {
        if flag(u) {
            for f in frames {
                self.nic.receive(&mut self.host, &f);
                self.drain_tx();
            }
        } else {
            let at = self.host.queue.now() + SimTime(byte(u) as u64 * 10_000);
            let gap = byte(u) as u64 * 2_000;
            for (i, f) in frames.into_iter().enumerate() {
                self.host
                    .queue
                    .push(at + SimTime(i as u64 * gap), Ev::Frame(f));
            }
        }
    }

    // ---- tag matching -------------------------------------------------------------------

    /// A tag for a message: one an entry of the list matches (exactly or through its mask),
    /// a small one (collisions), or any.
    fn pick_tag(&self, u: &mut Unstructured<'_>) -> u64 {
        let sel = byte(u) % 8;
        if sel < 4 && !self.tm.listed.is_empty() {
            let t = self.tm.listed[byte(u) as usize % self.tm.listed.len()];
            return if sel < 2 {
                t.tag
            } else {
                t.tag ^ (u64_(u) & !t.mask)
            };
        }
        match sel {
            4 | 5 => byte(u) as u64 % 16,
            _ => u64_(u),
        }
    }

    /// A rendezvous header: mostly the peer's buffer with a length that fits a listed
    /// buffer, sometimes too long, outside the peer's buffer, or a NIC MR.
    fn pick_rvh(&self, u: &mut Unstructured<'_>) -> Rvh {
        let mtu = self.peer.conns[TM].mtu;
        let listed_len = if self.tm.listed.is_empty() {
            None
        } else {
            Some(self.tm.listed[byte(u) as usize % self.tm.listed.len()].len)
        };
        let len = match (byte(u) % 8, listed_len) {
            (0 | 1, Some(l)) => l.saturating_sub(range(u, 0, 16)),
            (2, Some(l)) => l.saturating_add(range(u, 1, 64)),
            (0..=3, _) => range(u, 0, 64),
            (4, _) => range(u, 0, 4 * mtu),
            (5, _) => 0,
            (6, _) => self.pick_len(u, TM),
            _ => u32_(u),
        };
        let (va, rkey) = match byte(u) % 8 {
            0..=4 => {
                let room = PEER_LEN.saturating_sub(len as u64);
                (PEER_VA + u32_(u) as u64 % (room + 1), PEER_RKEY)
            }
            // Crossing the end of the peer's buffer.
            5 => (PEER_VA + PEER_LEN - (u16_(u) as u64 % 0x1000), PEER_RKEY),
            6 => (self.pick_addr(u), self.pick_key(u)),
            _ => (u64_(u), u32_(u)),
        };
        Rvh { va, rkey, len }
    }

    /// An unexpected count for a list operation: software's, the hardware's last reported
    /// one, nearby or any.
    fn pick_count(&self, u: &mut Unstructured<'_>) -> u32 {
        match byte(u) % 8 {
            0..=3 => self.tm.unexpected,
            4 | 5 => self.tm.hw_cnt as u32,
            6 => self.tm.unexpected.wrapping_add((byte(u) as i8) as u32),
            _ => u32_(u),
        }
    }

    /// A list-operation entry at the driver's producer index of the operation ring.
    fn build_tm_op(&mut self, u: &mut Unstructured<'_>) -> [u8; TM_OP_SIZE] {
        let index = self.tm.ops_pi as u16;
        let kind = byte(u) % 16;
        if kind >= 14 {
            // Raw bytes, with a valid index or not.
            let mut raw = [0u8; TM_OP_SIZE];
            let take = u.bytes(TM_OP_SIZE.min(u.len())).unwrap_or(&[]);
            raw[..take.len()].copy_from_slice(take);
            if kind == 14 {
                raw[2..4].copy_from_slice(&index.to_le_bytes());
            }
            return raw;
        }
        let mut e = TmOpEntry {
            index: index.into(),
            ..Default::default()
        };
        // The driver asks for a completion of every ADD and DEL; SYNCs only sometimes.
        let mut flags = if kind <= 9 || flag(u) {
            TM_OP_SIGNALED
        } else {
            0
        };
        let tags = self.tm.num_tags;
        match kind {
            0..=6 => {
                let handle = match byte(u) % 8 {
                    // One the driver believes free (if any is).
                    0..=3 => {
                        let start = range(u, 0, tags - 1);
                        (0..tags)
                            .map(|i| (start + i) % tags)
                            .find(|h| self.tm.listed.iter().all(|t| t.handle != *h))
                            .unwrap_or(start)
                    }
                    4 | 5 => range(u, 0, tags - 1),
                    6 => tags,
                    _ => u32_(u),
                };
                let tag = match byte(u) % 4 {
                    0 | 1 => byte(u) as u64 % 16,
                    2 if !self.tm.listed.is_empty() => {
                        self.tm.listed[byte(u) as usize % self.tm.listed.len()].tag
                    }
                    _ => u64_(u),
                };
                let mask = match byte(u) % 8 {
                    0..=3 => u64::MAX,
                    4 => 0,
                    5 => 0xF,
                    6 => !0xF,
                    _ => u64_(u),
                };
                let mtu = self.peer.conns[TM].mtu;
                let len = match byte(u) % 8 {
                    0 | 1 => range(u, 0, 64),
                    2 => 0,
                    3 => range(u, 0, 4 * mtu),
                    4 => mtu,
                    5 => range(u, 0, 0x1_0000),
                    6 => self.pick_len(u, TM),
                    _ => u32_(u),
                };
                let (addr, lkey) = (self.pick_addr(u), self.pick_key(u));
                e.opcode = TmOpcode::Add as u8;
                e.handle = handle.into();
                e.tag = tag.into();
                e.mask = mask.into();
                e.addr = addr.into();
                e.lkey = lkey.into();
                e.len = len.into();
                if handle < tags && self.tm.listed.iter().all(|t| t.handle != handle) {
                    self.tm.listed.push(Tagged {
                        handle,
                        tag,
                        mask,
                        len,
                    });
                }
            }
            7..=9 => {
                let handle = match byte(u) % 8 {
                    0..=3 if !self.tm.listed.is_empty() => {
                        self.tm.listed[byte(u) as usize % self.tm.listed.len()].handle
                    }
                    4 if !self.tm.stale.is_empty() => {
                        self.tm.stale[byte(u) as usize % self.tm.stale.len()]
                    }
                    0..=5 => range(u, 0, tags - 1),
                    6 => tags,
                    _ => u32_(u),
                };
                e.opcode = TmOpcode::Del as u8;
                e.handle = handle.into();
                self.tm.forget(handle);
            }
            10 | 11 => {
                e.opcode = TmOpcode::Sync as u8;
                if byte(u) < 192 {
                    flags |= TM_OP_SYNC;
                }
            }
            // Not written yet (opcode 0): the device must stop there.
            12 => {}
            _ => e.opcode = byte(u),
        }
        if flags & TM_OP_SYNC != 0 || byte(u) < 48 {
            flags |= TM_OP_SYNC;
            e.unexpected_cnt = self.pick_count(u).into();
        }
        e.flags = if byte(u) >= 248 { byte(u) } else { flags };
        if byte(u) >= 248 {
            e.index = u16_(u).into();
        }
        let mut raw = [0u8; TM_OP_SIZE];
        raw.copy_from_slice(e.as_bytes());
        raw
    }

    /// Action: post one to four list operations and usually ring the list-operation doorbell.
    fn act_tm_ops(&mut self, u: &mut Unstructured<'_>) {
        let n = range(u, 1, 4);
        let size = 1u32 << self.tm.ops_log;
        for _ in 0..n {
            let entry = self.build_tm_op(u);
            let at = TM_OPS_RING + (self.tm.ops_pi & (size - 1)) as u64 * TM_OP_SIZE as u64;
            self.host.write(at, &entry);
            self.tm.ops_pi = self.tm.ops_pi.wrapping_add(1);
            self.tm.ops_posted += 1;
        }
        if byte(u) % 8 < 6 {
            self.tm_ops_doorbell(u);
        }
    }

    /// Action: the list-operation doorbell (at SRQ doorbell + 4) with a valid or arbitrary
    /// producer index, sometimes for another SRQ or at the untagged ring's doorbell.
    fn tm_ops_doorbell(&mut self, u: &mut Unstructured<'_>) {
        let pi = self.tm.ops_pi;
        let value = match byte(u) % 8 {
            0..=4 => pi,
            5 => pi.wrapping_add((byte(u) as i8) as u32),
            6 => pi.wrapping_add(1 << self.tm.ops_log),
            _ => u32_(u),
        };
        let srqn = match byte(u) {
            0..=239 => self.tm.srqn,
            240..=247 => self.tm.srqn + 1,
            _ => u32_(u) % regs::DB_MAX_SRQ as u32,
        };
        let which = if byte(u) < 240 {
            regs::DB_SRQ_TM_OPS
        } else {
            0
        };
        let offset = regs::SRQ_DB_BASE + srqn as u64 * regs::DB_STRIDE + which;
        self.doorbell(u, offset, value);
    }

    /// Action: a tagged message (or something that looks like one) to the TM QP, in one or
    /// several packets.
    fn act_tm_message(&mut self, u: &mut Unstructured<'_>) {
        let opcode = match byte(u) % 16 {
            0..=6 => TmhOp::Eager as u8,
            7..=11 => TmhOp::Rndv as u8,
            12 => TmhOp::NoTag as u8,
            13 => TmhOp::Fin as u8,
            _ => byte(u),
        };
        let tmh = Tmh {
            opcode,
            app_ctx: u32_(u),
            tag: self.pick_tag(u),
        };
        let mut payload = tmh.to_bytes().to_vec();
        let rndv = opcode == TmhOp::Rndv as u8;
        if rndv || byte(u) < 16 {
            payload.extend_from_slice(&self.pick_rvh(u).to_bytes());
        }
        let mtu = self.peer.conns[TM].mtu;
        let max = self.tm.max_rndv;
        let hdrs = (TMH_LEN + RVH_LEN) as u32;
        let len = if rndv {
            match byte(u) % 8 {
                0..=3 => range(u, hdrs, max),
                4 => max,
                5 => range(u, max + 1, max + 16),
                6 => range(u, 0, hdrs - 1),
                _ => range(u, 0, 3 * mtu),
            }
        } else {
            match byte(u) % 8 {
                0 | 1 => range(u, TMH_LEN as u32, max),
                2 => TMH_LEN as u32,
                3 => range(u, 0, TMH_LEN as u32 - 1),
                4 => mtu,
                5 => range(u, mtu - 16, mtu + 16),
                _ => range(u, 0, 4 * mtu),
            }
        } as usize;
        // User bytes after the headers: a pattern, the first few from the input.
        let hdr = payload.len().min(len);
        let seed = byte(u);
        payload.resize(len, 0);
        for (i, b) in payload[hdr..].iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(13) ^ seed;
        }
        let take = u.bytes((len - hdr).min(16).min(u.len())).unwrap_or(&[]);
        payload[hdr..hdr + take.len()].copy_from_slice(take);
        // Packets of one MTU, the last one shorter.
        let chunks: Vec<&[u8]> = if payload.is_empty() {
            vec![&[]]
        } else {
            payload.chunks(mtu as usize).collect()
        };
        let n = chunks.len() as u32;
        let next = self.peer.conns[TM].next_psn;
        let first = match byte(u) % 8 {
            0..=5 => next,
            6 => next.add((byte(u) as i8) as u32),
            _ => Psn::new(u32_(u)),
        };
        if first == next {
            self.peer.conns[TM].next_psn = next.add(n);
        }
        let imm = (byte(u) < 32).then(|| u32_(u));
        let solicited = flag(u);
        let ack_every = byte(u) < 32;
        let mut frames = Vec::with_capacity(chunks.len());
        for (i, chunk) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let op = match (i == 0, last, imm.is_some()) {
                (true, true, false) => Opcode::SendOnly,
                (true, true, true) => Opcode::SendOnlyImm,
                (true, false, _) => Opcode::SendFirst,
                (false, false, _) => Opcode::SendMiddle,
                (false, true, false) => Opcode::SendLast,
                (false, true, true) => Opcode::SendLastImm,
            };
            let mut r = self.peer_repr(TM, op, first.add(i as u32));
            r.bth.ack_req = last || ack_every;
            r.bth.solicited = last && solicited;
            if last {
                r.imm = imm;
            }
            let mut frame = Vec::with_capacity(r.frame_len(chunk.len()));
            r.emit(chunk, &mut frame);
            Self::damage(u, &mut frame);
            frames.push(frame);
        }
        // Sometimes a packet is lost, duplicated or overtaken.
        if frames.len() > 1 {
            let n = frames.len();
            let i = byte(u) as usize % n;
            match byte(u) % 16 {
                0 => {
                    frames.remove(i);
                }
                1 => frames.insert(i, frames[i].clone()),
                2 => frames.swap(i, (i + 1) % n),
                _ => {}
            }
        }
        self.tm.msgs += 1;
        self.deliver(u, frames);
    }

    /// Reads what a polled CQE tells the driver about the matching list.
    fn note_cqe(&mut self, cqe: &Cqe) {
        if cqe.flags & CQE_FLAG_TRIGGERED != 0 {
            self.cntr.trig_cqes += 1;
            return;
        }
        let Some(op) = CqeOpcode::from_u8(cqe.opcode) else {
            return;
        };
        let t = &mut self.tm;
        let i = match op {
            CqeOpcode::TmAdd => 0,
            CqeOpcode::TmDel => 1,
            CqeOpcode::TmSync => 2,
            CqeOpcode::TmRecv => 3,
            CqeOpcode::TmNoTag => 4,
            _ => return,
        };
        t.cqes[i] += 1;
        t.hw_cnt = cqe.tm_hw_cnt.get();
        let ok = cqe.status == 0;
        if !ok {
            t.failed += 1;
        }
        let handle = cqe.tm_handle.get();
        match op {
            CqeOpcode::TmAdd if !ok => t.forget(handle),
            CqeOpcode::TmRecv if cqe.flags & (CQE_FLAG_TM_MATCH | CQE_FLAG_TM_DATA_VALID) != 0 => {
                if cqe.flags & CQE_FLAG_TM_MATCH != 0 {
                    t.matched += 1;
                }
                t.forget(handle);
            }
            CqeOpcode::TmRecv => t.unexpected = t.unexpected.wrapping_add(1),
            _ => {}
        }
    }

    /// Polls up to `limit` CQEs of CQ `k` like a driver (noting TM completions).
    fn poll_cq(&mut self, k: usize, limit: u32) {
        let (ring, log) = (self.cqs[k].ring, self.cqs[k].log);
        let size = 1u32 << log;
        for _ in 0..limit.min(size) {
            let ci = self.cqs[k].ci;
            let slot = ring + (ci & (size - 1)) as u64 * CQE_SIZE as u64;
            let mut raw = [0u8; CQE_SIZE];
            self.host.read(slot, &mut raw);
            if raw[CQE_SIZE - 1] != owner_bit(ci, log) {
                break;
            }
            if let Ok(cqe) = Cqe::read_from_bytes(&raw) {
                self.note_cqe(&cqe);
            }
            self.cqs[k].ci = ci.wrapping_add(1);
        }
    }

    /// Polls a CQ like a driver and reports the consumer index (record and/or doorbell).
    fn act_cq(&mut self, u: &mut Unstructured<'_>) {
        let k = if flag(u) { MAIN } else { TM };
        let (log, db_rec, cqn) = (self.cqs[k].log, self.cqs[k].db_rec, self.cqs[k].cqn);
        let limit = range(u, 0, 1 << log);
        self.poll_cq(k, limit);
        let ci = self.cqs[k].ci;
        self.host.write(db_rec, &ci.to_le_bytes());
        let base = regs::CQ_DB_BASE + cqn as u64 * regs::DB_STRIDE;
        match byte(u) % 8 {
            0..=2 => self.doorbell(u, base + regs::DB_CQ_CI, ci),
            3 => self.doorbell(u, base + regs::DB_CQ_ARM, ci),
            4 => self.doorbell(u, base + regs::DB_CQ_ARM, ci | regs::CQ_ARM_SOLICITED),
            5 => {
                let v = u32_(u);
                let which = if flag(u) {
                    regs::DB_CQ_CI
                } else {
                    regs::DB_CQ_ARM
                };
                self.doorbell(u, base + which, v)
            }
            _ => {} // record only
        }
    }

    /// Polls the EQ like a driver and writes EQ_CI.
    fn consume_eq(&mut self) {
        let size = 1u32 << EQ_LOG;
        for _ in 0..size {
            let slot = EQ_RING + (self.eq_ci & (size - 1)) as u64 * EQE_SIZE as u64;
            let mut owner = [0u8; 1];
            self.host.read(slot + EQE_SIZE as u64 - 1, &mut owner);
            if owner[0] != owner_bit(self.eq_ci, EQ_LOG) {
                break;
            }
            let mut ty = [0u8; 1];
            self.host.read(slot, &mut ty);
            if ty[0] == EventType::Counter as u8 {
                self.cntr.cntr_events += 1;
            }
            self.eq_ci = self.eq_ci.wrapping_add(1);
        }
        self.mmio_write(regs::EQ_CI, self.eq_ci);
    }

    /// Action: a MODIFY_QP with fuzzed mask and attributes, a tag-matching command, or any
    /// command from raw bytes.
    fn act_command(&mut self, u: &mut Unstructured<'_>) {
        let sel = byte(u);
        if sel < 160 {
            let q = Self::pick_qp(u);
            let to = if byte(u) < 200 {
                range(u, 0, 6) as u8
            } else {
                byte(u)
            };
            let mut mask = match byte(u) % 4 {
                0 => M::STATE,
                1 => M::STATE | M::ACCESS_FLAGS | M::MIN_RNR_TIMER,
                2 => M::from_bits_truncate(u32_(u)) | M::STATE,
                _ => M::from_bits_retain(u32_(u)),
            };
            if to == QpState::Init as u8 && byte(u) < 128 {
                mask |= M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS;
            }
            let mut raw = [0u8; 48];
            let take = u.bytes(48.min(u.len())).unwrap_or(&[]);
            raw[..take.len()].copy_from_slice(take);
            let mut attr = QpAttr::read_from_bytes(&raw).unwrap_or_default();
            attr.state = to;
            if byte(u) < 200 {
                // Keep the bulk of the attributes in range so the modify can succeed.
                attr.path_mtu = attr.path_mtu % 5 + 1;
                attr.timeout %= 32;
                attr.retry_cnt %= 8;
                attr.rnr_retry %= 8;
                attr.min_rnr_timer %= 32;
                attr.max_rd_atomic %= 17;
                attr.max_dest_rd_atomic %= 17;
                attr.pkey_index = 0.into();
                attr.access = (attr.access.get() & 0xF).into();
                attr.dest_qpn = self.peer.conns[q].peer_qpn.into();
                attr.dest_ip = PEER_IP;
                attr.dest_mac = PEER_MAC;
            }
            let own = self.sqs[q].qpn;
            let qpn = if byte(u) < 240 { own } else { u32_(u) };
            let status = self.modify(qpn, mask, attr, u16_(u) & 3);
            if status == Some(0) && qpn == own {
                // The peer follows what the QP was told.
                let conn = &mut self.peer.conns[q];
                if mask.contains(M::RQ_PSN) {
                    conn.next_psn = Psn::new(attr.rq_psn.get());
                }
                if mask.contains(M::SQ_PSN) {
                    conn.last_req_psn = Psn::new(attr.sq_psn.get());
                }
                if mask.contains(M::PATH_MTU) {
                    conn.mtu = ringbell_specs::cmd::mtu_bytes(attr.path_mtu).unwrap_or(conn.mtu);
                }
            }
            // After a successful RESET/INIT the rings start over at 0 on both sides.
            let state = self.query_state(own);
            if state == Some(QpState::Reset as u8) {
                self.sqs[q].pi = 0;
                if q == MAIN {
                    self.rq_pi = 0;
                }
            }
        } else if sel < 192 {
            self.tm_command(u);
        } else {
            const OPS: [u16; 36] = [
                0x01, 0x02, 0x10, 0x11, 0x20, 0x21, 0x22, 0x23, 0x24, 0x25, 0x26, 0x27, 0x30, 0x31,
                0x32, 0x33, 0x40, 0x41, 0x42, 0x43, 0x44, 0x46, 0x47, 0x48, 0x49, 0x4A, 0x50, 0x51,
                0x52, 0x53, 0x54, 0x55, 0x56, 0x70, 0x71, 0x99,
            ];
            let op = OPS[byte(u) as usize % OPS.len()];
            let mut input = [0u8; PARAMS_SIZE];
            let take = u.bytes(PARAMS_SIZE.min(u.len())).unwrap_or(&[]);
            input[..take.len()].copy_from_slice(take);
            if op == CmdOpcode::AllocDm as u16 && byte(u) < 192 {
                // Device memory of a size that fits (the rest fuzzed: alignment, reserved).
                let len = u64::from(range(u, 1, 70_000));
                input[..8].copy_from_slice(&len.to_le_bytes());
            }
            if op == CmdOpcode::CreateQp as u16 && byte(u) < 96 {
                // An XRC initiator or target (ABI 1.11) in one of the first domains, or a raw
                // packet QP (ABI 1.12), the rest fuzzed.
                input[0x13] = [8, 9, 10][byte(u) as usize % 3];
                input[0x14..0x18].copy_from_slice(&range(u, 1, 3).to_le_bytes());
            }
            if op == CmdOpcode::CreateFlow as u16 && byte(u) < 192 {
                // A rule for one of the first QPs (a raw packet QP the fuzzer made, or one
                // of the harness's, refused), reserved fields clear: the frames delivered
                // after it that are not RoCE go through it.
                input[..4].copy_from_slice(&range(u, 2, 8).to_le_bytes());
                input[6..8].fill(0);
                input[0x08 + 0x2F] = 0;
                input[0x3C + 0x2F] = 0;
            }
            if (op == CmdOpcode::AttachMcast as u16 || op == CmdOpcode::DetachMcast as u16)
                && byte(u) < 192
            {
                // One of the first QPs and a group of 239.0.0.0/24 (a UD QP the fuzzer
                // made, or not), reserved field clear.
                input[..4].copy_from_slice(&range(u, 2, 8).to_le_bytes());
                input[4..8].fill(0);
                input[8..18].fill(0);
                input[18..20].fill(0xFF);
                input[20..24].copy_from_slice(&[239, 0, 0, byte(u) & 3]);
            }
            if op == CmdOpcode::CreateWq as u16 && byte(u) < 192 {
                // A receive WQ on one of the harness's PDs and CQs, ring and sizes fuzzed.
                input[..4].copy_from_slice(&self.cntr.pds[0].to_le_bytes());
                input[0x20..0x24].copy_from_slice(&self.cqs[MAIN].cqn.to_le_bytes());
                input[0x24..0x28].fill(0);
            }
            if op == CmdOpcode::ModifyWq as u16 && byte(u) < 192 {
                input[..4].copy_from_slice(&range(u, 1, 4).to_le_bytes());
                input[4] = range(u, 0, 3) as u8;
            }
            if op == CmdOpcode::SetQpRss as u16 && byte(u) < 192 {
                // A table of the first SRQ numbers (WQs or not) in the data area, for one of
                // the first QPs, hash fields, key and sizes fuzzed.
                let log = range(u, 0, 3);
                let at = DATA + 0x8000;
                for i in 0..1u64 << log {
                    self.host
                        .write(at + 4 * i, &range(u, 1, 4).to_le_bytes());
                }
                input[..4].copy_from_slice(&range(u, 2, 8).to_le_bytes());
                input[8] = log as u8;
                input[9] = range(u, 0, 40) as u8;
                input[0x0A..0x10].fill(0);
                input[0x10..0x18].copy_from_slice(&at.to_le_bytes());
            }
            if op == CmdOpcode::CreateXrcSrq as u16 && byte(u) < 192 {
                // An XRC SRQ of one of the first domains on one of the harness's CQs and
                // PDs, ring and sizes fuzzed.
                input[..4].copy_from_slice(&self.cntr.pds[0].to_le_bytes());
                input[0x20..0x24].copy_from_slice(&range(u, 1, 3).to_le_bytes());
                input[0x24..0x28].copy_from_slice(&self.cqs[MAIN].cqn.to_le_bytes());
            }
            if op == CmdOpcode::AllocMw as u16 && byte(u) < 192 {
                // A window of type 1 or 2 in one of the harness's PDs (ABI 1.9).
                input[..4].copy_from_slice(&self.cntr.pds[0].to_le_bytes());
                input[4..8].copy_from_slice(&range(u, 1, 2).to_le_bytes());
            }
            if op == CmdOpcode::RegDmMr as u16 && byte(u) < 192 {
                // A region over one of the first allocations, in one of the harness's PDs.
                input[..4].copy_from_slice(&self.cntr.pds[0].to_le_bytes());
                input[8..12].copy_from_slice(&range(u, 1, 4).to_le_bytes());
            }
            if op == CmdOpcode::ReregMr as u16 && byte(u) < 192 {
                // REREG_MR of a live region (its key), with fuzzed flags and values: the
                // traffic that follows runs against whatever the region became.
                let key = self.keys[byte(u) as usize % self.keys.len()];
                input[..4].copy_from_slice(&key.to_le_bytes());
            }
            if op == CmdOpcode::ResizeCq as u16 && byte(u) < 192 {
                // RESIZE_CQ of a live CQ from the harness's consumer index, into its own
                // ring's area (up to 128 entries): the waiting CQEs move, perhaps over each
                // other when the ring is not at a lap start; on success the harness follows.
                let k = if flag(u) { MAIN } else { TM };
                let c = &self.cqs[k];
                let log = range(u, 1, 7) as u8;
                let r = ResizeCqIn {
                    cqn: c.cqn.into(),
                    log_size: log,
                    ci: c.ci.into(),
                    ring_iova: c.ring.into(),
                    ..Default::default()
                };
                if let Some((0, _)) = self.command(op, r.as_bytes(), u16_(u)) {
                    let c = &mut self.cqs[k];
                    (c.log, c.ci) = (log, 0);
                    let db = c.db_rec;
                    self.host.write(db, &0u32.to_le_bytes());
                }
            } else {
                let _ = self.command(op, &input, u16_(u));
            }
        }
        self.consume_eq();
    }

    /// A command about tag matching: ARM_SRQ, CREATE_TM_SRQ with mostly valid parameters,
    /// DESTROY_SRQ of the TM-SRQ (busy while its QP lives), or a query.
    fn tm_command(&mut self, u: &mut Unstructured<'_>) {
        let srqn = if byte(u) < 224 { self.tm.srqn } else { u32_(u) };
        match byte(u) % 4 {
            0 => {
                let a = ArmSrqIn {
                    srqn: srqn.into(),
                    limit: range(u, 0, (1 << self.tm.srq_log) + 1).into(),
                };
                let _ = self.command(CmdOpcode::ArmSrq as u16, a.as_bytes(), 0);
            }
            1 => {
                let max_tags = self.nic.config().max_num_tags;
                let max_ops = self.nic.config().max_tm_ops;
                let addr = |u: &mut Unstructured<'_>, align: u64| match byte(u) % 8 {
                    0..=5 => DATA + (u32_(u) as u64 % DATA_LEN) / align * align,
                    6 => u64::MAX - (u16_(u) as u64),
                    _ => u64_(u),
                };
                let input = CreateTmSrqIn {
                    srq: CreateSrqIn {
                        pdn: range(u, 0, 3).into(),
                        log_size: range(u, 0, 6) as u8,
                        log_stride: range(u, 3, 10) as u8,
                        limit: range(u, 0, 64).into(),
                        ring_iova: addr(u, 16).into(),
                        db_iova: addr(u, 4).into(),
                        ..Default::default()
                    },
                    cqn: match byte(u) % 4 {
                        0 | 1 => self.cqs[TM].cqn,
                        2 => self.cqs[MAIN].cqn,
                        _ => u32_(u),
                    }
                    .into(),
                    max_num_tags: match byte(u) % 8 {
                        0..=4 => range(u, 1, 64),
                        5 => max_tags,
                        6 => max_tags + 1,
                        _ => u32_(u),
                    }
                    .into(),
                    ops_log_size: match byte(u) % 8 {
                        0..=5 => range(u, 1, 8) as u8,
                        6 => (max_ops.max(1).ilog2() + 1) as u8,
                        _ => byte(u),
                    },
                    ops_iova: addr(u, 64).into(),
                    ..Default::default()
                };
                let mut bytes = input.as_bytes().to_vec();
                if byte(u) >= 240 {
                    // Reserved bytes set.
                    let i = byte(u) as usize % bytes.len();
                    bytes[i] ^= byte(u);
                }
                let _ = self.command(CmdOpcode::CreateTmSrq as u16, &bytes, 0);
            }
            2 => {
                let o = ObjectIn { num: srqn.into() };
                let _ = self.command(CmdOpcode::DestroySrq as u16, o.as_bytes(), 0);
            }
            _ => {
                let (op, num) = match byte(u) % 3 {
                    0 => (CmdOpcode::QueryQp, self.sqs[TM].qpn),
                    1 => (CmdOpcode::QueryQpStats, self.sqs[TM].qpn),
                    _ => (CmdOpcode::QueryCq, self.cqs[TM].cqn),
                };
                let o = ObjectIn { num: num.into() };
                let _ = self.command(op as u16, o.as_bytes(), 0);
            }
        }
    }

    /// Action: bring a QP back up (RESET → INIT → RTR → RTS) with fresh valid attributes;
    /// after a fatal error, the only way its connection carries traffic again.
    fn act_reconnect(&mut self, u: &mut Unstructured<'_>) {
        let q = Self::pick_qp(u);
        let a = ConnAttrs::read(u);
        self.connect(q, &a, false);
        self.consume_eq();
    }

    fn query_state(&mut self, qpn: u32) -> Option<u8> {
        match self.command(CmdOpcode::QueryQp as u16, &qpn.to_le_bytes(), 0) {
            Some((0, out)) => Some(out[0]),
            _ => None,
        }
    }

    /// Action: an arbitrary register access.
    fn act_mmio(&mut self, u: &mut Unstructured<'_>) {
        let offset = match byte(u) % 4 {
            0 => regs::REGISTERS[byte(u) as usize % regs::REGISTERS.len()].offset,
            1 => regs::DB_BASE + (u32_(u) as u64 % (regs::DB_END - regs::DB_BASE)),
            2 => u32_(u) as u64 % regs::BAR0_SIZE,
            _ => u64_(u),
        };
        if flag(u) {
            let _ = self.mmio_read(offset);
        } else {
            let value = u32_(u);
            // Resetting the device ends every useful path; keep it rare.
            if offset == regs::RESET && value == regs::RESET_KEY && byte(u) < 250 {
                return;
            }
            self.doorbell(u, offset, value);
        }
    }

    // ---- counters and triggered operations (ABI 1.3) -------------------------------------

    /// The writeback address the driver gives counter `n`.
    fn wb_slot(n: u32) -> u64 {
        CNTR_WB + (n % CNTR_WB_SLOTS) as u64 * 16
    }

    /// Runs a counter command, noting its status for the debug summary.
    fn cntr_cmd(&mut self, op: u16, input: &[u8]) -> Option<(u8, [u8; PARAMS_SIZE])> {
        let r = self.command(op, input, 0);
        let i = match r {
            Some((s, _)) => (s as usize).min(10),
            None => 11,
        };
        self.cntr.statuses[i] += 1;
        r
    }

    /// A counter number: a live one, 0, a small one (maybe destroyed, maybe never created),
    /// the last one the device has, or any.
    fn pick_cntr(&self, u: &mut Unstructured<'_>) -> u32 {
        let live = &self.cntr.live;
        match byte(u) % 16 {
            0..=10 if !live.is_empty() => live[byte(u) as usize % live.len()],
            11 => 0,
            12 | 13 => range(u, 1, 8),
            14 => self.cntr.max_cntr + (byte(u) % 2) as u32,
            _ => u32_(u),
        }
    }

    /// The driver's idea of counter `n`'s values: its writeback, if the driver gave it one.
    fn cntr_values(&self, n: u32) -> (u64, u64) {
        let mut b = [0u8; 16];
        self.host.read(Self::wb_slot(n), &mut b);
        let v = CntrWriteback::read_from_bytes(&b).unwrap_or_default();
        (v.success.get(), v.error.get())
    }

    /// A threshold for counter `n`: around its current values (reached, just above), small,
    /// huge or any.
    fn pick_threshold(&self, u: &mut Unstructured<'_>, n: u32) -> u64 {
        let (s, e) = self.cntr_values(n);
        match byte(u) % 8 {
            0 | 1 => s.wrapping_add(e).wrapping_add(range(u, 0, 3) as u64),
            2 => s.wrapping_add(range(u, 0, 2) as u64),
            3 => s.wrapping_add(e).saturating_sub(range(u, 0, 2) as u64),
            4 => 0,
            5 => range(u, 0, 16) as u64,
            6 => u64::MAX - (byte(u) % 4) as u64,
            _ => u64_(u),
        }
    }

    /// The QPN of a triggered operation: either QP, none, or any.
    fn pick_qpn(&self, u: &mut Unstructured<'_>) -> u32 {
        match byte(u) % 16 {
            0..=8 => self.sqs[MAIN].qpn,
            9..=12 => self.sqs[TM].qpn,
            13 => 0,
            14 => self.sqs[TM].qpn + 1,
            _ => u32_(u),
        }
    }

    /// The one-block send WQE of a triggered transfer: built segment by segment (mostly
    /// valid), the first block of a send-queue WQE, or raw bytes.
    fn build_trig_body(&self, u: &mut Unstructured<'_>, c: usize) -> [u8; WQEBB] {
        let mut body = [0u8; WQEBB];
        let mode = byte(u) % 8;
        if mode >= 6 {
            let take = u.bytes(WQEBB.min(u.len())).unwrap_or(&[]);
            body[..take.len()].copy_from_slice(take);
            if mode == 6 {
                // Known opcode, defined flags, a segment count that fits.
                body[0] = body[0] % 7 + 1;
                body[1] &= 0xF;
                body[4] = body[4] % 4 + 1;
            }
            return body;
        }
        if mode == 5 {
            let w = self.build_wqe(u, c);
            let n = w.len().min(WQEBB);
            body[..n].copy_from_slice(&w[..n]);
            return body;
        }
        let opcode = if byte(u) < 240 {
            range(u, 1, 7) as u8
        } else {
            byte(u)
        };
        let op = SendOpcode::from_u8(opcode);
        let flags = if byte(u) < 240 {
            byte(u) & 0xF
        } else {
            byte(u)
        };
        let mut segs: Vec<u8> = Vec::with_capacity(WQEBB);
        segs.extend_from_slice(&[0u8; SEG]);
        if op.is_none_or(|o| o.has_raddr()) || byte(u) >= 250 {
            let r = RaddrSeg {
                raddr: self.pick_addr(u).into(),
                rkey: self.pick_key(u).into(),
                ..Default::default()
            };
            segs.extend_from_slice(r.as_bytes());
        }
        let is_atomic = op.is_some_and(|o| o.is_atomic());
        if is_atomic {
            let a = AtomicSeg {
                swap_add: u64_(u).into(),
                compare: u64_(u).into(),
            };
            segs.extend_from_slice(a.as_bytes());
        }
        if flags & 0x8 != 0 && segs.len() + 4 <= WQEBB {
            let room = WQEBB - segs.len() - 4;
            let n = range(u, 0, room as u32 + 2) as usize;
            let bc = if byte(u) < 240 {
                n as u32 | INLINE_MARK
            } else {
                u32_(u)
            };
            segs.extend_from_slice(&bc.to_le_bytes());
            let take = u.bytes(n.min(room).min(u.len())).unwrap_or(&[]);
            segs.extend_from_slice(take);
            segs.resize(segs.len().next_multiple_of(SEG), 0);
        } else {
            let room = (WQEBB - segs.len()) / SEG;
            let n = if is_atomic && byte(u) < 220 {
                1
            } else {
                range(u, 0, room as u32) as usize
            };
            for _ in 0..n {
                let len = if is_atomic && byte(u) < 220 {
                    8
                } else {
                    self.pick_len(u, c)
                };
                let mut addr = self.pick_addr(u);
                if is_atomic && byte(u) < 200 {
                    addr &= !7;
                }
                let d = DataSeg {
                    byte_count: len.into(),
                    lkey: self.pick_key(u).into(),
                    addr: addr.into(),
                };
                segs.extend_from_slice(d.as_bytes());
            }
        }
        segs.truncate(WQEBB);
        let mut ds = (segs.len() / SEG) as u8;
        if byte(u) >= 248 {
            ds = byte(u);
        }
        let ctrl = CtrlSeg {
            opcode,
            flags,
            wqe_index: u16_(u).into(),
            ds_count: ds,
            imm: u32_(u).into(),
            ..Default::default()
        };
        segs[..SEG].copy_from_slice(ctrl.as_bytes());
        body[..segs.len()].copy_from_slice(&segs);
        body
    }

    /// Posts a triggered operation and remembers its handle.
    fn post_triggered(&mut self, t: &PostTriggeredIn) {
        if let Some((0, out)) = self.cntr_cmd(CmdOpcode::PostTriggered as u16, t.as_bytes()) {
            let h = u32::from_le_bytes([out[0], out[1], out[2], out[3]]);
            self.cntr.posted += 1;
            if self.cntr.handles.len() >= 64 {
                self.cntr.handles.remove(0);
            }
            self.cntr.handles.push(h);
        }
    }

    /// Action: a triggered data transfer on either QP (or none).
    fn act_post_wqe(&mut self, u: &mut Unstructured<'_>) {
        let trig = self.pick_cntr(u);
        let threshold = self.pick_threshold(u, trig);
        let qpn = self.pick_qpn(u);
        let c = if qpn == self.sqs[TM].qpn { TM } else { MAIN };
        let mut flags = if byte(u) < 240 {
            byte(u) & 0x7
        } else {
            byte(u)
        };
        let body = self.build_trig_body(u, c);
        let is_atomic =
            body[0] == SendOpcode::CmpSwap as u8 || body[0] == SendOpcode::FetchAdd as u8;
        if is_atomic && byte(u) < 64 {
            flags |= TrigFlags::OPERAND_FROM_MEM.bits();
        }
        let comp = if byte(u) < 128 { 0 } else { self.pick_cntr(u) };
        let mut operand_addr = self.pick_addr(u);
        if byte(u) < 224 {
            operand_addr &= !7;
        }
        let mut t = PostTriggeredIn {
            trig_cntr: trig.into(),
            comp_cntr: comp.into(),
            threshold: threshold.into(),
            kind: if byte(u) < 248 {
                TrigKind::Wqe as u8
            } else {
                byte(u)
            },
            flags,
            target: qpn.into(),
            wr_id: u64_(u).into(),
            operand_addr: operand_addr.into(),
            operand_lkey: self.pick_key(u).into(),
            ..Default::default()
        };
        t.set_body(&body);
        self.post_triggered(&t);
    }

    /// Action: a triggered CNTR_ADD or CNTR_SET (sometimes with fields that do not belong).
    fn act_post_cntr_op(&mut self, u: &mut Unstructured<'_>) {
        let trig = self.pick_cntr(u);
        let threshold = self.pick_threshold(u, trig);
        let target = self.pick_cntr(u);
        let kind = match byte(u) % 16 {
            0..=8 => TrigKind::CntrAdd as u8,
            9..=14 => TrigKind::CntrSet as u8,
            _ => byte(u),
        };
        let flags = match byte(u) % 8 {
            0..=3 => 0,
            4 | 5 => TrigFlags::SUCCESS_ONLY.bits(),
            _ => byte(u),
        };
        let comp = if byte(u) < 240 { 0 } else { self.pick_cntr(u) };
        let small = |u: &mut Unstructured<'_>| match byte(u) % 8 {
            0..=4 => range(u, 0, 4) as u64,
            5 => u64::MAX - range(u, 0, 3) as u64,
            _ => u64_(u),
        };
        let v = CntrWriteback {
            success: small(u).into(),
            error: small(u).into(),
        };
        let mut t = PostTriggeredIn {
            trig_cntr: trig.into(),
            comp_cntr: comp.into(),
            threshold: threshold.into(),
            kind,
            flags,
            target: target.into(),
            ..Default::default()
        };
        t.set_body(v.as_bytes());
        self.post_triggered(&t);
    }

    /// Action: a POST_TRIGGERED from raw input bytes, the trigger counter and kind mostly
    /// valid.
    fn act_post_raw(&mut self, u: &mut Unstructured<'_>) {
        let mut raw = [0u8; PARAMS_SIZE];
        let take = u.bytes(PARAMS_SIZE.min(u.len())).unwrap_or(&[]);
        raw[..take.len()].copy_from_slice(take);
        let mut t = PostTriggeredIn::read_from_bytes(&raw).unwrap_or_default();
        if byte(u) < 192 {
            t.trig_cntr = self.pick_cntr(u).into();
            t.kind %= 3;
            t.flags &= 7;
        }
        if t.kind == TrigKind::Wqe as u8 && byte(u) < 128 {
            t.target = self.pick_qpn(u).into();
        }
        self.post_triggered(&t);
    }

    /// Action: UPDATE_CNTR with small, wrapping or arbitrary values.
    fn act_update_cntr(&mut self, u: &mut Unstructured<'_>) {
        let cntr = self.pick_cntr(u);
        let flags = if byte(u) < 240 {
            byte(u) as u32 % 4
        } else {
            u32_(u)
        };
        let value = |u: &mut Unstructured<'_>| match byte(u) % 8 {
            0..=4 => range(u, 0, 4) as u64,
            5 => u64::MAX - range(u, 0, 2) as u64,
            _ => u64_(u),
        };
        let up = UpdateCntrIn {
            cntr: cntr.into(),
            flags: flags.into(),
            success: value(u).into(),
            error: value(u).into(),
        };
        let _ = self.cntr_cmd(CmdOpcode::UpdateCntr as u16, up.as_bytes());
    }

    /// Action: BIND_CNTR of a QP or MR (own, other PD, absent), bind or unbind, any events.
    fn act_bind_cntr(&mut self, u: &mut Unstructured<'_>) {
        let cntr = self.pick_cntr(u);
        let kind = match byte(u) % 16 {
            0..=7 => CNTR_BIND_QP,
            8..=14 => CNTR_BIND_MR,
            _ => byte(u),
        };
        let obj = if kind == CNTR_BIND_MR || (kind != CNTR_BIND_QP && flag(u)) {
            self.pick_key(u)
        } else {
            self.pick_qpn(u)
        };
        let flags = match byte(u) % 8 {
            0..=4 => 0,
            5 | 6 => CNTR_BIND_UNBIND,
            _ => byte(u),
        };
        let events = match byte(u) % 8 {
            0..=2 => 1u32 << (byte(u) % 6),
            3 => (CntrEvents::REMOTE_READ | CntrEvents::REMOTE_WRITE).bits(),
            4 => CntrEvents::all().bits(),
            5 => byte(u) as u32 & 0x3F,
            6 => 0,
            _ => u32_(u),
        };
        let b = BindCntrIn {
            cntr: cntr.into(),
            kind,
            flags,
            obj: obj.into(),
            events: events.into(),
            ..Default::default()
        };
        let _ = self.cntr_cmd(CmdOpcode::BindCntr as u16, b.as_bytes());
    }

    /// Action: ARM_CNTR around the counter's values.
    fn act_arm_cntr(&mut self, u: &mut Unstructured<'_>) {
        let cntr = self.pick_cntr(u);
        let a = ArmCntrIn {
            cntr: cntr.into(),
            threshold: self.pick_threshold(u, cntr).into(),
            ..Default::default()
        };
        let _ = self.cntr_cmd(CmdOpcode::ArmCntr as u16, a.as_bytes());
    }

    /// Action: CREATE_CNTR in either PD (or none), with a writeback slot, none, or a bad
    /// address.
    fn act_create_cntr(&mut self, u: &mut Unstructured<'_>) {
        let [pd, pd2] = self.cntr.pds;
        let pdn = match byte(u) % 8 {
            0..=4 => pd,
            5 => pd2,
            6 => 0,
            _ => range(u, 0, 8),
        };
        let flags = if byte(u) < 240 { 0 } else { u32_(u) };
        // The number the device will most likely give it: the lowest free one.
        let next = (1..).find(|n| !self.cntr.live.contains(n)).unwrap_or(1);
        let wb = match byte(u) % 8 {
            0..=3 => Self::wb_slot(next),
            4 => 0,
            5 => Self::wb_slot(next) + 8,
            6 => MEM_END - 8,
            _ => u64_(u),
        };
        let c = CreateCntrIn {
            pdn: pdn.into(),
            flags: flags.into(),
            wb_iova: wb.into(),
        };
        if let Some((0, out)) = self.cntr_cmd(CmdOpcode::CreateCntr as u16, c.as_bytes()) {
            let n = u32::from_le_bytes([out[0], out[1], out[2], out[3]]);
            if !self.cntr.live.contains(&n) {
                self.cntr.live.push(n);
            }
        }
    }

    /// Action: DESTROY_CNTR (busy while bound or named by an operation).
    fn act_destroy_cntr(&mut self, u: &mut Unstructured<'_>) {
        let n = self.pick_cntr(u);
        let o = ObjectIn { num: n.into() };
        if let Some((0, _)) = self.cntr_cmd(CmdOpcode::DestroyCntr as u16, o.as_bytes()) {
            self.cntr.live.retain(|&c| c != n);
        }
    }

    /// Action: CANCEL_TRIGGERED of a handle the driver got (waiting or fired), a nearby
    /// one, or any.
    fn act_cancel(&mut self, u: &mut Unstructured<'_>) {
        let hs = &self.cntr.handles;
        let h = match byte(u) % 8 {
            0..=4 if !hs.is_empty() => hs[byte(u) as usize % hs.len()],
            5 if !hs.is_empty() => hs[byte(u) as usize % hs.len()].wrapping_add(1 << 16),
            6 => range(u, 0, 8),
            _ => u32_(u),
        };
        let o = ObjectIn { num: h.into() };
        let _ = self.cntr_cmd(CmdOpcode::CancelTriggered as u16, o.as_bytes());
    }

    /// Action: FLUSH_TRIGGERED of a PD (all, or one counter's).
    fn act_flush(&mut self, u: &mut Unstructured<'_>) {
        let [pd, pd2] = self.cntr.pds;
        let pdn = match byte(u) % 8 {
            0..=4 => pd,
            5 => pd2,
            6 => 0,
            _ => u32_(u),
        };
        let cntr = if flag(u) { 0 } else { self.pick_cntr(u) };
        let f = FlushTriggeredIn {
            pdn: pdn.into(),
            cntr: cntr.into(),
        };
        let _ = self.cntr_cmd(CmdOpcode::FlushTriggered as u16, f.as_bytes());
    }

    /// Action: QUERY_CNTR, or a counter command (0x60..=0x68, or just past) from raw bytes.
    fn act_cntr_raw(&mut self, u: &mut Unstructured<'_>) {
        if flag(u) {
            let o = ObjectIn {
                num: self.pick_cntr(u).into(),
            };
            let _ = self.cntr_cmd(CmdOpcode::QueryCntr as u16, o.as_bytes());
            return;
        }
        let op = 0x60 + (byte(u) % 10) as u16;
        let mut input = [0u8; PARAMS_SIZE];
        let take = u.bytes(PARAMS_SIZE.min(u.len())).unwrap_or(&[]);
        input[..take.len()].copy_from_slice(take);
        if byte(u) < 128 {
            // Name a real counter (or, for CANCEL, a real handle) in the first word.
            let first = if op == CmdOpcode::CancelTriggered as u16 && !self.cntr.handles.is_empty()
            {
                self.cntr.handles[byte(u) as usize % self.cntr.handles.len()]
            } else {
                self.pick_cntr(u)
            };
            input[..4].copy_from_slice(&first.to_le_bytes());
        }
        let _ = self.cntr_cmd(op, &input);
    }

    /// Action: an access to the counter area: an add (now or through the PCIe latency), a
    /// latched read of all four registers, or one access at any offset of a window.
    fn act_cntr_mmio(&mut self, u: &mut Unstructured<'_>) {
        self.cntr.mmio += 1;
        let n = self.pick_cntr(u) as u64 % regs::CNTR_MAX;
        let window = regs::CNTR_BASE + n * regs::CNTR_STRIDE;
        match byte(u) % 8 {
            0..=2 => {
                let reg = if flag(u) {
                    regs::CNTR_ADD_SUCCESS
                } else {
                    regs::CNTR_ADD_ERROR
                };
                let value = match byte(u) % 4 {
                    0 | 1 => range(u, 0, 4),
                    2 => u32::MAX,
                    _ => u32_(u),
                };
                self.doorbell(u, window + reg, value);
            }
            3 | 4 => {
                for reg in [
                    regs::CNTR_SUCCESS_LO,
                    regs::CNTR_SUCCESS_HI,
                    regs::CNTR_ERROR_LO,
                    regs::CNTR_ERROR_HI,
                ] {
                    let _ = self.mmio_read(window + reg);
                }
            }
            _ => {
                let offset = if flag(u) {
                    window + (byte(u) as u64 % regs::CNTR_STRIDE)
                } else {
                    regs::CNTR_BASE + u32_(u) as u64 % (regs::CNTR_END - regs::CNTR_BASE)
                };
                if flag(u) {
                    let _ = self.mmio_read(offset);
                } else {
                    let value = u32_(u);
                    self.doorbell(u, offset, value);
                }
            }
        }
    }

    /// Action: DESTROY_QP of either QP (its waiting triggered operations are discarded, its
    /// transfers in flight flushed, its bindings released), then CREATE_QP as at setup (the
    /// lowest free QPN: the same one, unless a raw command took it), a connect towards the
    /// same peer QP with fresh attributes, and sometimes the setup's binding again.
    fn act_recreate_qp(&mut self, u: &mut Unstructured<'_>) {
        let q = Self::pick_qp(u);
        let o = ObjectIn {
            num: self.sqs[q].qpn.into(),
        };
        let destroyed = self.cntr_cmd(CmdOpcode::DestroyQp as u16, o.as_bytes());
        if destroyed.map(|r| r.0) != Some(0) {
            return;
        }
        let input = self.qp_in[q];
        let Some((0, out)) = self.command(CmdOpcode::CreateQp as u16, input.as_bytes(), 0) else {
            return;
        };
        let qpn = u32::from_le_bytes([out[0], out[1], out[2], out[3]]);
        self.sqs[q].qpn = qpn;
        self.peer.conns[q].nic_qpn = qpn;
        self.sqs[q].pi = 0;
        if q == MAIN {
            self.rq_pi = 0;
        }
        let a = ConnAttrs::read(u);
        self.connect(q, &a, false);
        if flag(u) {
            if let Some(&c) = self.cntr.live.first() {
                let events = if q == MAIN {
                    CntrEvents::all()
                } else {
                    CntrEvents::SEND | CntrEvents::RECV | CntrEvents::READ | CntrEvents::WRITE
                };
                let b = BindCntrIn {
                    cntr: c.into(),
                    kind: CNTR_BIND_QP,
                    obj: qpn.into(),
                    events: events.bits().into(),
                    ..Default::default()
                };
                let _ = self.cntr_cmd(CmdOpcode::BindCntr as u16, b.as_bytes());
            }
        }
    }

    /// Action (selector bytes 240..=255): one of the counter actions.
    fn act_counter(&mut self, u: &mut Unstructured<'_>, which: u8) {
        match which {
            0..=2 => self.act_post_wqe(u),
            3 => self.act_post_cntr_op(u),
            4 => self.act_post_raw(u),
            5 => self.act_update_cntr(u),
            6 | 7 => self.act_cntr_mmio(u),
            8 => self.act_bind_cntr(u),
            9 => self.act_arm_cntr(u),
            10 => self.act_create_cntr(u),
            11 => self.act_destroy_cntr(u),
            12 => self.act_cancel(u),
            13 => self.act_flush(u),
            14 => self.act_cntr_raw(u),
            _ => self.act_recreate_qp(u),
        }
        self.consume_eq();
    }

    /// End of input: FLUSH_TRIGGERED for every PD that may exist; then nothing may be left
    /// in the device's table of waiting operations. The mailbox address is programmed again
    /// first (an input may have overwritten `CMD_ADDR`). Skipped if a command does not finish
    /// (the event budget is spent) or does not execute (the status in `CMD_STATUS` is
    /// neither OK nor BAD_RESOURCE, the answer for a PD that does not exist).
    fn check_no_waiting_ops(&mut self) {
        self.mmio_write(regs::CMD_ADDR_LO, MBOX as u32);
        self.mmio_write(regs::CMD_ADDR_HI, (MBOX >> 32) as u32);
        for pdn in 1..=self.cntr.max_pdn {
            let f = FlushTriggeredIn {
                pdn: pdn.into(),
                cntr: 0.into(),
            };
            if self
                .command(CmdOpcode::FlushTriggered as u16, f.as_bytes(), 0)
                .is_none()
            {
                return;
            }
            // The harness zeroes the result area with the input, so only CMD_STATUS tells
            // whether the device executed the command at all.
            let status = (self.mmio_read(regs::CMD_STATUS) >> 16) & 0xFF;
            if status != 0 && status != 3 {
                return;
            }
        }
        let left = self.nic.triggered_in_use();
        assert_eq!(
            left, 0,
            "{left} triggered operations left after flushing PDs 1..={}",
            self.cntr.max_pdn
        );
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let params = Params::read(&mut u);
    let mut h = Harness::new(&params);
    let mut actions = 0;
    while !u.is_empty() && actions < MAX_ACTIONS {
        actions += 1;
        let sel = byte(&mut u);
        if sel >= 240 {
            h.act_counter(&mut u, sel - 240);
            continue;
        }
        match sel % 24 {
            0..=2 => h.act_sq_wqe(&mut u),
            3 | 4 => h.act_sq_doorbell(&mut u),
            5 | 6 => h.act_recv(&mut u),
            7..=9 => h.act_frame(&mut u),
            10 | 11 => {
                let n = byte(&mut u) as u64 * 4;
                h.run(n);
            }
            12 => h.act_cq(&mut u),
            13 => h.consume_eq(),
            14 => h.act_command(&mut u),
            15 => {
                if byte(&mut u) < 128 {
                    h.act_mmio(&mut u);
                } else {
                    h.peer.policy = byte(&mut u);
                }
            }
            16 | 17 => h.act_tm_ops(&mut u),
            18 => h.tm_ops_doorbell(&mut u),
            19 => h.act_srq_recv(&mut u),
            20 | 21 => h.act_tm_message(&mut u),
            22 => h.act_reconnect(&mut u),
            _ => h.act_cq(&mut u),
        }
    }
    // Let everything in flight finish (bounded).
    while h.step() {
        if h.steps.is_multiple_of(1024) {
            h.consume_eq();
        }
    }
    h.check_no_waiting_ops();
    // With RINGBELL_FUZZ_DEBUG set, print what the input reached (to judge a corpus).
    if debug_enabled() {
        // What is left in the CQs counts too.
        h.poll_cq(MAIN, u32::MAX);
        h.poll_cq(TM, u32::MAX);
        let t = &h.tm;
        eprintln!(
            "actions={actions} events={} sq_pi={} tm_sq_pi={} rq_pi={} cq_ci={} tm_cq_ci={} \
             eq_ci={} irqs={} cq_db_rec={} rnr_retry={} retry_cnt={} peer_answer={} \
             peer_drop={} peer_rnr_nak={} peer_nak={} tm_ops={} tm_msgs={} srq_pi={} \
             tm_add={} tm_del={} tm_sync={} tm_recv={} tm_notag={} tm_matched={} \
             tm_unexpected={} tm_failed={} rndv_reads={} fins={} cntrs={} trig_posted={} \
             trig_cqes={} cntr_events={} cntr_mmio={} cntr_status={:?} {:?}",
            h.steps,
            h.sqs[MAIN].pi,
            h.sqs[TM].pi,
            h.rq_pi,
            h.cqs[MAIN].ci,
            h.cqs[TM].ci,
            h.eq_ci,
            h.host.interrupts,
            h.host.u32_at(CQ_DB),
            params.main.rnr_retry,
            params.main.retry_cnt,
            h.peer.answers[0],
            h.peer.answers[1],
            h.peer.answers[2],
            h.peer.answers[3],
            t.ops_posted,
            t.msgs,
            t.srq_pi,
            t.cqes[0],
            t.cqes[1],
            t.cqes[2],
            t.cqes[3],
            t.cqes[4],
            t.matched,
            t.unexpected,
            t.failed,
            h.peer.rndv_reads,
            h.peer.fins,
            h.cntr.live.len(),
            h.cntr.posted,
            h.cntr.trig_cqes,
            h.cntr.cntr_events,
            h.cntr.mmio,
            h.cntr.statuses,
            h.nic.stats()
        );
    }
});

fn debug_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("RINGBELL_FUZZ_DEBUG").is_some())
}
