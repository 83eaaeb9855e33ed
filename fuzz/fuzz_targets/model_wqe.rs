//! Fuzzes one `ringbell_model::Nic` behind a mock driver and a mock peer.
//!
//! The harness plays the host: a flat 1 MiB host memory at IOVA 0x10000 (every other address
//! faults), a discrete-event queue, and a minimal command helper that writes the mailbox the
//! way `driver/src/device.rs` does. Setup (parameters drawn from the first input bytes, always
//! valid): event queue, two PDs, three MRs (all access over the whole memory; remote-read-only
//! at another VA; one in the second PD), one CQ, one RC QP with a send and a receive ring,
//! moved RESET → INIT → RTR → RTS towards a fake peer (10.0.0.2, QPN 5).
//!
//! The rest of the input is a program of actions: raw or structured send WQEs copied into the
//! SQ ring (with a valid or arbitrary `wqe_index`), SQ/RQ doorbells with valid or arbitrary
//! producer indices (now, or later through the PCIe-latency path), receive WQEs, frames from
//! the wire (raw bytes, or valid headers addressed to the QP built with
//! `wire::PacketRepr::emit` so they pass the ICRC, with fuzzed opcode/PSN/payload/RETH/AETH/
//! AtomicETH, optionally corrupted), CQ/EQ consumption, arming, arbitrary register accesses
//! and arbitrary commands. A mock peer answers the frames the NIC sends (ACK, READ responses,
//! atomic ACKs) according to a fuzzed policy (answer, drop, RNR NAK, NAK).
//!
//! The event queue runs for at most `MAX_EVENTS` events per input, so no input hangs.
//!
//! Checked: nothing panics; every DMA the model issues is bounds-checked by the mock IOMMU
//! (writes land inside host memory by construction); the model never schedules an event or a
//! frame in the past; every frame the NIC transmits is a valid RoCEv2 frame from its own
//! address.
#![no_main]

use libfuzzer_sys::arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use ringbell_model::sim::EventQueue;
use ringbell_model::{DmaFault, Env, Nic, NicConfig, NicEvent};
use ringbell_specs::cmd::{
    Access, CmdHeader, CmdOpcode, CreateCqIn, CreateQpIn, ModifyQpIn, ObjectOut, QpAttr,
    QpAttrMask as M, QpState, RegMrIn, IN_OFFSET, MAILBOX_SIZE, OUT_OFFSET, PARAMS_SIZE,
    RESULT_OFFSET,
};
use ringbell_specs::cqe::{owner_bit, CQE_SIZE, EQE_SIZE};
use ringbell_specs::regs;
use ringbell_specs::wire::{
    self, Aeth, AethSyndrome, AtomicEth, BthRepr, Endpoint, NakCode, Opcode, PacketRepr, Reth,
};
use ringbell_specs::wqe::{
    AtomicSeg, CtrlSeg, DataSeg, RaddrSeg, SendOpcode, INLINE_MARK, MAX_SEND_WQE, RECV_LKEY_END,
    SEG, WQEBB,
};
use ringbell_specs::{Psn, Qpn, SimTime};
use zerocopy::{FromBytes, IntoBytes};

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
const DATA: u64 = MEM_BASE + 0x8000;
const DATA_LEN: u64 = MEM_END - DATA;
/// VA of the remote-read-only MR (backed by `DATA`).
const RO_VA: u64 = 0x4000_0000;
const RO_LEN: u64 = 0x1_0000;

const PEER_IP: [u8; 4] = [10, 0, 0, 2];
const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 2];
const PEER_QPN: u32 = 5;

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

/// The fake remote end of the connection.
struct Peer {
    /// Two bits per answer, cycled: see [`PeerAction`].
    policy: u8,
    counter: u32,
    msn: u32,
    /// Next PSN the NIC's responder expects from the peer (the peer's send PSN).
    next_psn: Psn,
    /// PSN of the last request the NIC sent (what responses refer to).
    last_req_psn: Psn,
    /// Path MTU in bytes.
    mtu: u32,
    /// Answers given so far, by [`PeerAction`] (for the debug summary).
    answers: [u64; 4],
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

/// The values setup produced.
struct Objects {
    qpn: u32,
    cqn: u32,
    keys: [u32; 3],
    sq_log: u8,
    rq_log: u8,
    rq_log_stride: u8,
    cq_log: u8,
}

struct Harness {
    nic: Nic,
    host: Host,
    peer: Peer,
    steps: u64,
    token: u16,
    obj: Objects,
    nic_ip: [u8; 4],
    nic_mac: [u8; 6],
    /// The mock driver's producer indices and consumer indices.
    sq_pi: u32,
    rq_pi: u32,
    cq_ci: u32,
    eq_ci: u32,
}

/// The path MTU, QP limits and PSNs used for one run.
struct Params {
    path_mtu: u8,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    min_rnr_timer: u8,
    timeout: u8,
    sq_psn: u32,
    rq_psn: u32,
    sq_log: u8,
    rq_log: u8,
    rq_log_stride: u8,
    cq_log: u8,
    peer_policy: u8,
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
    u.int_in_range(lo..=hi).unwrap_or(lo)
}
fn flag(u: &mut Unstructured<'_>) -> bool {
    byte(u) & 1 != 0
}

impl Params {
    fn read(u: &mut Unstructured<'_>) -> Params {
        Params {
            path_mtu: range(u, 1, 5) as u8,
            max_rd_atomic: range(u, 0, 16) as u8,
            max_dest_rd_atomic: range(u, 0, 16) as u8,
            retry_cnt: range(u, 0, 7) as u8,
            rnr_retry: range(u, 0, 7) as u8,
            min_rnr_timer: range(u, 0, 31) as u8,
            timeout: range(u, 0, 31) as u8,
            sq_psn: u32_(u) & Psn::MASK,
            rq_psn: u32_(u) & Psn::MASK,
            sq_log: range(u, 1, 6) as u8,
            rq_log: range(u, 1, 5) as u8,
            rq_log_stride: range(u, 4, 6) as u8,
            cq_log: range(u, 1, 7) as u8,
            peer_policy: byte(u),
        }
    }
}

impl Harness {
    fn new(p: &Params) -> Harness {
        let cfg = NicConfig::for_node(0);
        let (nic_ip, nic_mac) = (cfg.ip, cfg.mac);
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
                msn: 0,
                next_psn: Psn::new(p.rq_psn),
                last_req_psn: Psn::new(p.sq_psn),
                mtu: ringbell_specs::cmd::mtu_bytes(p.path_mtu).unwrap_or(256),
                answers: [0; 4],
            },
            steps: 0,
            token: 0,
            obj: Objects {
                qpn: 0,
                cqn: 0,
                keys: [0; 3],
                sq_log: p.sq_log,
                rq_log: p.rq_log,
                rq_log_stride: p.rq_log_stride,
                cq_log: p.cq_log,
            },
            nic_ip,
            nic_mac,
            sq_pi: 0,
            rq_pi: 0,
            cq_ci: 0,
            eq_ci: 0,
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
        self.must(CmdOpcode::QueryDevice, &[]);
        let pd = self.must_create(CmdOpcode::AllocPd, &[]);
        let pd2 = self.must_create(CmdOpcode::AllocPd, &[]);
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
            self.obj.keys[i] = u32::from_le_bytes(out[..4].try_into().unwrap());
        }
        let cq = CreateCqIn {
            log_size: p.cq_log,
            ring_iova: CQ_RING.into(),
            db_iova: CQ_DB.into(),
            ..Default::default()
        };
        self.obj.cqn = self.must_create(CmdOpcode::CreateCq, cq.as_bytes());
        let qp = CreateQpIn {
            pdn: pd.into(),
            send_cqn: self.obj.cqn.into(),
            recv_cqn: self.obj.cqn.into(),
            sq_log_size: p.sq_log,
            rq_log_size: p.rq_log,
            rq_log_stride: p.rq_log_stride,
            sq_iova: SQ_RING.into(),
            rq_iova: RQ_RING.into(),
            db_iova: QP_DB.into(),
            ..Default::default()
        };
        self.obj.qpn = self.must_create(CmdOpcode::CreateQp, qp.as_bytes());
        let qpn = self.obj.qpn;
        let init = QpAttr {
            state: QpState::Init as u8,
            access: all.bits().into(),
            ..Default::default()
        };
        self.modify_must(
            qpn,
            M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
            init,
        );
        let rtr = QpAttr {
            state: QpState::Rtr as u8,
            path_mtu: p.path_mtu,
            dest_qpn: PEER_QPN.into(),
            rq_psn: p.rq_psn.into(),
            max_dest_rd_atomic: p.max_dest_rd_atomic,
            min_rnr_timer: p.min_rnr_timer,
            dest_mac: PEER_MAC,
            dest_ip: PEER_IP,
            ..Default::default()
        };
        self.modify_must(
            qpn,
            M::STATE
                | M::AV
                | M::PATH_MTU
                | M::DEST_QPN
                | M::RQ_PSN
                | M::MAX_DEST_RD_ATOMIC
                | M::MIN_RNR_TIMER,
            rtr,
        );
        let rts = QpAttr {
            state: QpState::Rts as u8,
            timeout: p.timeout,
            retry_cnt: p.retry_cnt,
            rnr_retry: p.rnr_retry,
            sq_psn: p.sq_psn.into(),
            max_rd_atomic: p.max_rd_atomic,
            ..Default::default()
        };
        self.modify_must(
            qpn,
            M::STATE | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
            rts,
        );
        // Consume the command-completion events so the EQ starts empty.
        self.consume_eq();
    }

    fn modify_must(&mut self, qpn: u32, mask: M, attr: QpAttr) {
        let m = ModifyQpIn {
            qpn: qpn.into(),
            attr_mask: mask.bits().into(),
            attr,
        };
        self.must(CmdOpcode::ModifyQp, m.as_bytes());
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
            if pkt.repr.dst.ip != PEER_IP || pkt.repr.bth.dest_qp.get() != PEER_QPN {
                continue;
            }
            let Some(op) = Opcode::from_u8(pkt.repr.bth.opcode) else {
                continue;
            };
            if op.is_response() {
                continue; // the NIC's responder answering the peer: nothing to do
            }
            let psn = pkt.repr.bth.psn;
            self.peer.last_req_psn = psn;
            if !(pkt.repr.bth.ack_req || op == Opcode::ReadRequest || op.is_atomic()) {
                continue;
            }
            let arrive = *at + SimTime(500_000);
            match self.peer.next_action() {
                PeerAction::Drop => {}
                PeerAction::RnrNak => self.peer_ack(arrive, psn, AethSyndrome::RnrNak { timer: 1 }),
                PeerAction::Nak => {
                    let code = match psn.get() % 4 {
                        0 => NakCode::PsnSequenceError,
                        1 => NakCode::InvalidRequest,
                        2 => NakCode::RemoteAccessError,
                        _ => NakCode::RemoteOperationalError,
                    };
                    self.peer_ack(arrive, psn, AethSyndrome::Nak(code));
                }
                PeerAction::Answer => match op {
                    Opcode::ReadRequest => {
                        let len = pkt.repr.reth.map_or(0, |r| r.len);
                        self.peer_read_response(arrive, psn, len);
                    }
                    Opcode::CompareSwap | Opcode::FetchAdd => {
                        self.peer.msn = self.peer.msn.wrapping_add(1);
                        let mut r = self.peer_repr(Opcode::AtomicAcknowledge, psn);
                        r.aeth = Some(Aeth {
                            syndrome: AethSyndrome::Ack { credits: 0x1F },
                            msn: self.peer.msn & 0xFF_FFFF,
                        });
                        r.atomic_ack = Some(0x1122_3344_5566_7788 ^ psn.get() as u64);
                        self.send_from_peer(arrive, &r, &[]);
                    }
                    _ => {
                        self.peer.msn = self.peer.msn.wrapping_add(1);
                        self.peer_ack(arrive, psn, AethSyndrome::Ack { credits: 0x1F });
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

    fn peer_repr(&self, opcode: Opcode, psn: Psn) -> PacketRepr {
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
                Qpn::from_bits(PEER_QPN),
                Qpn::from_bits(self.obj.qpn),
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
                dest_qp: Qpn::from_bits(self.obj.qpn),
                ack_req: false,
                psn,
            },
            reth: None,
            aeth: None,
            atomic_eth: None,
            atomic_ack: None,
            imm: None,
        }
    }

    fn peer_ack(&mut self, at: SimTime, psn: Psn, syndrome: AethSyndrome) {
        let mut r = self.peer_repr(Opcode::Acknowledge, psn);
        r.aeth = Some(Aeth {
            syndrome,
            msn: self.peer.msn & 0xFF_FFFF,
        });
        self.send_from_peer(at, &r, &[]);
    }

    fn peer_read_response(&mut self, at: SimTime, first: Psn, len: u32) {
        let mtu = self.peer.mtu;
        // Cap the work per READ: a longer one is answered only in part (and never completes).
        let n = len.div_ceil(mtu).clamp(1, 64);
        self.peer.msn = self.peer.msn.wrapping_add(1);
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
            let mut r = self.peer_repr(opcode, first.add(i));
            if opcode.has_aeth() {
                r.aeth = Some(Aeth {
                    syndrome: AethSyndrome::Ack { credits: 0x1F },
                    msn: self.peer.msn & 0xFF_FFFF,
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

    fn sq_size(&self) -> u32 {
        1 << self.obj.sq_log
    }

    fn sq_slot(&self, index: u32) -> u64 {
        SQ_RING + (index & (self.sq_size() - 1)) as u64 * WQEBB as u64
    }

    /// Copies a WQE of whole blocks into the ring at the driver's producer index.
    fn put_wqe(&mut self, wqe: &[u8]) {
        for (b, chunk) in wqe.chunks(WQEBB).enumerate() {
            let mut block = [0u8; WQEBB];
            block[..chunk.len()].copy_from_slice(chunk);
            let at = self.sq_slot(self.sq_pi.wrapping_add(b as u32));
            self.host.write(at, &block);
        }
        self.sq_pi = self
            .sq_pi
            .wrapping_add(wqe.len().div_ceil(WQEBB).max(1) as u32);
    }

    fn pick_key(&self, u: &mut Unstructured<'_>) -> u32 {
        match byte(u) % 8 {
            0..=3 => self.obj.keys[0],
            4 => self.obj.keys[1],
            5 => self.obj.keys[2],
            6 => 0,
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

    fn pick_len(&self, u: &mut Unstructured<'_>) -> u32 {
        match byte(u) % 8 {
            0..=2 => byte(u) as u32,
            3 => 8,
            4 => range(u, 0, 3 * self.peer.mtu + 1),
            5 => self.peer.mtu,
            6 => range(u, 0, 0x2_0000),
            _ => u32_(u),
        }
    }

    /// A send WQE built segment by segment, mostly valid.
    fn build_wqe(&self, u: &mut Unstructured<'_>) -> Vec<u8> {
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
                    self.pick_len(u)
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
            self.sq_pi as u16
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

    /// Action: put a send WQE into the SQ ring.
    fn act_sq_wqe(&mut self, u: &mut Unstructured<'_>) {
        let mode = byte(u) % 4;
        if mode == 3 {
            let wqe = self.build_wqe(u);
            self.put_wqe(&wqe);
            return;
        }
        // Raw blocks from the input.
        let nbb = range(u, 1, 4) as usize;
        let mut wqe = vec![0u8; nbb * WQEBB];
        let take = u.bytes((nbb * WQEBB).min(u.len())).unwrap_or(&[]);
        wqe[..take.len()].copy_from_slice(take);
        if mode >= 1 {
            // Keep the wqe_index valid.
            wqe[2..4].copy_from_slice(&(self.sq_pi as u16).to_le_bytes());
        }
        if mode == 2 {
            // Keep the opcode known, the flags defined and the segment count consistent.
            wqe[0] = wqe[0] % 7 + 1;
            wqe[1] &= 0xF;
            wqe[4] = (wqe[4] as usize % (nbb * 4)) as u8 + 1;
        }
        self.put_wqe(&wqe);
    }

    /// Action: ring the SQ doorbell.
    fn act_sq_doorbell(&mut self, u: &mut Unstructured<'_>) {
        let value = match byte(u) % 8 {
            0..=4 => self.sq_pi,
            5 => self.sq_pi.wrapping_add((byte(u) as i8) as u32),
            _ => u32_(u),
        };
        let offset = regs::QP_DB_BASE + self.obj.qpn as u64 * regs::DB_STRIDE + regs::DB_SQ;
        self.doorbell(u, offset, value);
        // Also keep the doorbell record up to date, as the driver does.
        let rec = self.sq_pi.to_le_bytes();
        self.host.write(QP_DB + 4, &rec);
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

    /// Action: post a receive WQE (and usually ring the RQ doorbell).
    fn act_recv(&mut self, u: &mut Unstructured<'_>) {
        let stride = 1usize << self.obj.rq_log_stride;
        let mut wqe = vec![0u8; stride];
        if byte(u) < 40 {
            let take = u.bytes(stride.min(u.len())).unwrap_or(&[]);
            wqe[..take.len()].copy_from_slice(take);
        } else {
            let n = range(u, 0, (stride / SEG) as u32) as usize;
            for i in 0..n {
                let d = DataSeg {
                    byte_count: self.pick_len(u).into(),
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
        let size = 1u32 << self.obj.rq_log;
        let at = RQ_RING + (self.rq_pi & (size - 1)) as u64 * stride as u64;
        self.host.write(at, &wqe);
        self.rq_pi = self.rq_pi.wrapping_add(1);
        self.host.write(QP_DB, &self.rq_pi.to_le_bytes());
        let value = match byte(u) % 8 {
            0..=5 => self.rq_pi,
            6 => return, // post without a doorbell (a later one covers it)
            _ => u32_(u),
        };
        let offset = regs::QP_DB_BASE + self.obj.qpn as u64 * regs::DB_STRIDE + regs::DB_RQ;
        self.doorbell(u, offset, value);
    }

    /// A frame with valid headers addressed to the QP, fuzzed fields.
    fn build_frame(&mut self, u: &mut Unstructured<'_>) -> Vec<u8> {
        let opcode = if byte(u) < 240 {
            range(u, 0, 0x14) as u8
        } else {
            byte(u)
        };
        let op = Opcode::from_u8(opcode);
        let is_response = op.is_some_and(|o| o.is_response());
        let psn = match byte(u) % 8 {
            0..=3 if !is_response => self.peer.next_psn,
            0..=3 => self.peer.last_req_psn,
            4 | 5 => {
                let base = if is_response {
                    self.peer.last_req_psn
                } else {
                    self.peer.next_psn
                };
                base.add((byte(u) as i8) as u32)
            }
            _ => Psn::new(u32_(u)),
        };
        let mut r = self.peer_repr(Opcode::SendOnly, psn);
        r.bth.opcode = opcode;
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
                len: self.pick_len(u),
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
        let mtu = self.peer.mtu as usize;
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
        if op.is_some_and(|o| o.is_request()) && psn == self.peer.next_psn {
            let n = if op == Some(Opcode::ReadRequest) {
                r.reth.map_or(1, |x| x.len.div_ceil(self.peer.mtu).max(1))
            } else {
                1
            };
            self.peer.next_psn = psn.add(n);
        }
        let mut frame = Vec::with_capacity(r.frame_len(payload.len()));
        r.emit(&payload, &mut frame);
        // Sometimes corrupt one byte (the ICRC or a header check then rejects it).
        if byte(u) >= 248 && !frame.is_empty() {
            let pos = u16_(u) as usize % frame.len();
            frame[pos] ^= byte(u) | 1;
        }
        // Sometimes trailing Ethernet padding.
        if byte(u) >= 248 {
            frame.resize(frame.len() + byte(u) as usize % 64, 0);
        }
        frame
    }

    /// Action: a frame arrives from the wire.
    fn act_frame(&mut self, u: &mut Unstructured<'_>) {
        let frame = if byte(u) < 32 {
            let n = range(u, 0, 1600) as usize;
            u.bytes(n.min(u.len())).unwrap_or(&[]).to_vec()
        } else {
            self.build_frame(u)
        };
        if flag(u) {
            self.nic.receive(&mut self.host, &frame);
            self.drain_tx();
        } else {
            let at = self.host.queue.now() + SimTime(byte(u) as u64 * 10_000);
            self.host.queue.push(at, Ev::Frame(frame));
        }
    }

    /// Polls the CQ like a driver and reports the consumer index (record and/or doorbell).
    fn act_cq(&mut self, u: &mut Unstructured<'_>) {
        let log = self.obj.cq_log;
        let size = 1u32 << log;
        let mut polled = 0;
        let limit = range(u, 0, size);
        while polled < limit {
            let slot = CQ_RING + (self.cq_ci & (size - 1)) as u64 * CQE_SIZE as u64;
            let mut owner = [0u8; 1];
            self.host.read(slot + CQE_SIZE as u64 - 1, &mut owner);
            if owner[0] != owner_bit(self.cq_ci, log) {
                break;
            }
            self.cq_ci = self.cq_ci.wrapping_add(1);
            polled += 1;
        }
        self.host.write(CQ_DB, &self.cq_ci.to_le_bytes());
        let base = regs::CQ_DB_BASE + self.obj.cqn as u64 * regs::DB_STRIDE;
        match byte(u) % 8 {
            0..=2 => self.doorbell(u, base + regs::DB_CQ_CI, self.cq_ci),
            3 => self.doorbell(u, base + regs::DB_CQ_ARM, self.cq_ci),
            4 => self.doorbell(
                u,
                base + regs::DB_CQ_ARM,
                self.cq_ci | regs::CQ_ARM_SOLICITED,
            ),
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
            self.eq_ci = self.eq_ci.wrapping_add(1);
        }
        self.mmio_write(regs::EQ_CI, self.eq_ci);
    }

    /// Action: a MODIFY_QP with fuzzed mask and attributes, or any command from raw bytes.
    fn act_command(&mut self, u: &mut Unstructured<'_>) {
        if byte(u) < 160 {
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
                attr.dest_qpn = PEER_QPN.into();
                attr.dest_ip = PEER_IP;
                attr.dest_mac = PEER_MAC;
            }
            let qpn = if byte(u) < 240 { self.obj.qpn } else { u32_(u) };
            let m = ModifyQpIn {
                qpn: qpn.into(),
                attr_mask: mask.bits().into(),
                attr,
            };
            let _ = self.command(CmdOpcode::ModifyQp as u16, m.as_bytes(), u16_(u) & 3);
            // After a successful RESET/INIT the rings start over at 0 on both sides.
            let state = self.query_state();
            if state == Some(QpState::Reset as u8) {
                self.sq_pi = 0;
                self.rq_pi = 0;
            }
        } else {
            const OPS: [u16; 16] = [
                0x01, 0x10, 0x11, 0x20, 0x21, 0x30, 0x31, 0x32, 0x40, 0x41, 0x42, 0x43, 0x50, 0x51,
                0x52, 0x99,
            ];
            let op = OPS[byte(u) as usize % OPS.len()];
            let mut input = [0u8; PARAMS_SIZE];
            let take = u.bytes(PARAMS_SIZE.min(u.len())).unwrap_or(&[]);
            input[..take.len()].copy_from_slice(take);
            let _ = self.command(op, &input, u16_(u));
        }
        self.consume_eq();
    }

    fn query_state(&mut self) -> Option<u8> {
        let qpn = self.obj.qpn.to_le_bytes();
        match self.command(CmdOpcode::QueryQp as u16, &qpn, 0) {
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
        match byte(&mut u) % 16 {
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
            _ => {
                if byte(&mut u) < 128 {
                    h.act_mmio(&mut u);
                } else {
                    h.peer.policy = byte(&mut u);
                }
            }
        }
    }
    // Let everything in flight finish (bounded).
    while h.step() {
        if h.steps.is_multiple_of(1024) {
            h.consume_eq();
        }
    }
    // With RINGBELL_FUZZ_DEBUG set, print what the input reached (to judge a corpus).
    if debug_enabled() {
        eprintln!(
            "actions={actions} events={} sq_pi={} rq_pi={} cq_ci={} eq_ci={} irqs={} cq_db_rec={} \
             rnr_retry={} retry_cnt={} peer_answer={} peer_drop={} peer_rnr_nak={} peer_nak={} {:?}",
            h.steps,
            h.sq_pi,
            h.rq_pi,
            h.cq_ci,
            h.eq_ci,
            h.host.interrupts,
            h.host.u32_at(CQ_DB),
            params.rnr_retry,
            params.retry_cnt,
            h.peer.answers[0],
            h.peer.answers[1],
            h.peer.answers[2],
            h.peer.answers[3],
            h.nic.stats()
        );
    }
});

fn debug_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("RINGBELL_FUZZ_DEBUG").is_some())
}
