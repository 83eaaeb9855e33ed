//! The model's only window on the world.
//!
//! The emulator implements [`Env`] for each NIC it hosts: DMA through the node's IOMMU,
//! frames onto the node's link, events into the shared event queue and interrupts to the
//! driver. A mock implementation is enough to drive the model in unit tests and fuzzers.

use ringbell_specs::cqe::Cqe;
use ringbell_specs::SimTime;

/// A DMA address that no IOMMU mapping covers (or covers without the needed permission).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmaFault {
    /// The first faulting address.
    pub iova: u64,
}

/// Events the NIC schedules for itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NicEvent {
    /// A register write reaching the device after its PCIe latency.
    Mmio {
        /// BAR0 offset.
        offset: u64,
        /// Value written.
        value: u32,
    },
    /// A write-combined store (a BlueFlame WQE) reaching the device.
    MmioBlock {
        /// BAR0 offset.
        offset: u64,
        /// The bytes.
        data: Vec<u8>,
    },
    /// Execute the command in the mailbox.
    CmdExec,
    /// The send engine of a QP looks for work.
    SqProcess {
        /// The QP.
        qpn: u32,
        /// Generation of the QP context the event was scheduled for; a QP destroyed (or a
        /// device reset) since then makes the event void.
        gen: u64,
    },
    /// A posted DMA write of received data becomes visible in host memory.
    DmaWrite {
        /// Destination IOVA (checked against the IOMMU when the write was posted).
        iova: u64,
        /// The bytes.
        data: Vec<u8>,
        /// QP on whose behalf it is written, for fault reporting.
        qpn: u32,
    },
    /// The responder engine of a QP sends the responses it owes, in PSN order.
    Respond {
        /// The responder QP.
        qpn: u32,
        /// Its context generation.
        gen: u64,
    },
    /// A responder executes an atomic it accepted (its answer waits for its turn).
    AtomicExec {
        /// The responder QP.
        qpn: u32,
        /// Its context generation.
        gen: u64,
        /// PSN of the atomic.
        psn: ringbell_specs::Psn,
    },
    /// The local ACK timer of a QP expires.
    AckTimer {
        /// The QP.
        qpn: u32,
        /// Its context generation.
        gen: u64,
    },
    /// One success or error is added to a counter (a completion or arrival it counts,
    /// applied when the data it stands for is visible).
    CntrUpdate {
        /// The counter.
        cntr: u32,
        /// Its generation.
        gen: u64,
        /// Added to the success value.
        success: u64,
        /// Added to the error value.
        error: u64,
    },
    /// A completion entry is written to a CQ.
    CqeWrite {
        /// The CQ.
        cqn: u32,
        /// Generation of the CQ context (see `SqProcess::gen`).
        gen: u64,
        /// Generation of the QP the CQE reports on (0: written whatever became of the QP).
        qp_gen: u64,
        /// The entry (owner bit filled in by the CQ).
        cqe: Box<Cqe>,
    },
}

/// What the NIC needs from the machine around it.
pub trait Env {
    /// Current simulated time.
    fn now(&self) -> SimTime;
    /// Reads `buf.len()` bytes at `iova` through the IOMMU.
    fn dma_read(&mut self, iova: u64, buf: &mut [u8]) -> Result<(), DmaFault>;
    /// Writes `data` at `iova` through the IOMMU.
    fn dma_write(&mut self, iova: u64, data: &[u8]) -> Result<(), DmaFault>;
    /// Checks that `[iova, iova + len)` is mapped writable, without touching memory.
    fn dma_check(&self, iova: u64, len: usize) -> Result<(), DmaFault>;
    /// Schedules `ev` for this NIC at `at` (never earlier than now).
    fn schedule(&mut self, at: SimTime, ev: NicEvent);
    /// Puts a frame on the NIC's link; `at` is when its last bit leaves the NIC.
    fn transmit(&mut self, at: SimTime, frame: Vec<u8>);
    /// An empty byte buffer for a frame or a posted DMA write: one the environment got back
    /// (a delivered frame, [`Env::recycle`]) or, by default, a new vector.
    fn buffer(&mut self) -> Vec<u8> {
        Vec::new()
    }
    /// Gives a byte buffer the model is done with back to the environment (dropped by
    /// default).
    fn recycle(&mut self, _buf: Vec<u8>) {}
    /// Whether the environment takes frames whose two sums, the IPv4 header checksum and the
    /// ICRC, are still to be written (zeros, see `PacketRepr::emit_unsealed`). One that says
    /// so promises that every byte anyone observes (a capture, a corrupted copy, a receiver's
    /// check) is the frame as [`Env::transmit`] got it with its sums computed: it seals a
    /// frame (`wire::seal`) before it shows or changes it, and hands an untouched one to
    /// [`crate::Nic::receive_unsealed`]. False by default: frames leave sealed.
    fn defers_sums(&self) -> bool {
        false
    }
    /// Raises interrupt `vector`.
    fn interrupt(&mut self, vector: u32);
    /// Whether [`Env::trace`] records anything. The model builds no [`TraceEvent`] while this
    /// is false (the default), so tracing costs one call per stage when it is off.
    fn tracing(&self) -> bool {
        false
    }
    /// Records one stage of the simulated pipeline, for a timeline. Ignored by default;
    /// called only while [`Env::tracing`] is true. Never changes what the model does.
    fn trace(&mut self, _ev: TraceEvent) {}
    /// Whether the environment runs the functional (untimed) mode: eligible messages of an
    /// RC QP go straight to the peer's responder through [`Env::fm_deliver`], with no
    /// frames. False by default (the timed model).
    fn functional(&self) -> bool {
        false
    }
    /// Functional mode: hands a whole message to the responder of the peer NIC (see
    /// [`crate::Nic::fm_receive`]). `Some`: executed there (data placed, READ data copied
    /// into the requester's ranges, responder state and completions done), with an atomic's
    /// original value (0 for other operations); `None`: not taken, nothing changed anywhere,
    /// and the requester sends it on the packet path. The default takes nothing.
    fn fm_deliver(&mut self, _msg: &FmMsg<'_>) -> Option<u64> {
        None
    }
    /// Functional mode, on the responder's side of [`Env::fm_deliver`]: copies `len` bytes
    /// from `src_iova` in the requester's IOMMU to `iova` in this NIC's, in one copy.
    fn dma_copy_from_peer(
        &mut self,
        iova: u64,
        _src_iova: u64,
        _len: usize,
    ) -> Result<(), DmaFault> {
        Err(DmaFault { iova })
    }
    /// Functional mode, on the responder's side of [`Env::fm_deliver`] (a READ): copies `len`
    /// bytes from `iova` in this NIC's IOMMU to `peer_iova` in the requester's, in one copy.
    fn dma_copy_to_peer(
        &mut self,
        peer_iova: u64,
        _iova: u64,
        _len: usize,
    ) -> Result<(), DmaFault> {
        Err(DmaFault { iova: peer_iova })
    }
}

/// The kind of a message executed in functional mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FmOp {
    /// RDMA WRITE.
    Write,
    /// RDMA WRITE with immediate (consumes a receive WQE).
    WriteImm,
    /// SEND.
    Send,
    /// SEND with immediate.
    SendImm,
    /// RDMA READ: the responder's bytes into the requester's ranges ([`FmData::Gather`]).
    Read,
    /// Compare-and-swap of 8 bytes (`FmMsg::atomic`: swap, compare).
    CmpSwap,
    /// Fetch-and-add of 8 bytes (`FmMsg::atomic`: add).
    FetchAdd,
}

/// Where a functional message's payload is.
#[derive(Clone, Copy, Debug)]
pub enum FmData<'a> {
    /// Inline bytes, carried in the WQE.
    Inline(&'a [u8]),
    /// (IOVA, length) ranges in the requester's IOMMU, checked and in message order.
    Gather(&'a [(u64, u32)]),
}

/// A whole RC message handed from a requester to its peer's responder in functional mode.
#[derive(Clone, Copy, Debug)]
pub struct FmMsg<'a> {
    /// Destination MAC (the QP's address vector): which NIC.
    pub dst_mac: [u8; 6],
    /// Destination IP, as the packets would carry it.
    pub dst_ip: [u8; 4],
    /// Source IP (the requester's).
    pub src_ip: [u8; 4],
    /// Destination QP.
    pub dst_qpn: u32,
    /// The operation.
    pub op: FmOp,
    /// PSN of the message's first packet.
    pub psn: ringbell_specs::Psn,
    /// PSNs it takes (packets at the path MTU).
    pub npsn: u32,
    /// The requester's path MTU (the responder checks packet sizes against its own).
    pub mtu: u32,
    /// Remote address and key (WRITE).
    pub raddr: u64,
    /// Remote key (WRITE).
    pub rkey: u32,
    /// Immediate data (`*Imm`).
    pub imm: u32,
    /// The last packet would carry the solicited-event bit.
    pub solicited: bool,
    /// Message length.
    pub len: u64,
    /// The payload (SEND, WRITE), or where READ data goes in the requester's memory.
    pub data: FmData<'a>,
    /// An atomic's operands: (swap or add, compare).
    pub atomic: (u64, u64),
}

/// A stage of a message's life, as reported to [`Env::trace`]. The `Host*`, `MmioPost` and
/// `*Flight` stages are recorded by the emulator (the host and the wire are not the NIC's);
/// the model reports the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// The CPU stores a doorbell (`obj`: BAR0 offset; `qpn` for a QP doorbell).
    HostDoorbell,
    /// The CPU copies a WQE into a BlueFlame slot (`qpn`, `bytes`).
    HostBlueFlame,
    /// The CPU stores to another register (`obj`: BAR0 offset).
    HostRegWrite,
    /// A posted MMIO write crosses PCIe to the NIC (`obj`: BAR0 offset).
    MmioPost,
    /// The send engine fetches a WQE from host memory (`qpn`, `psn`: WQE index, `op`: send
    /// opcode, `bytes`: message length).
    WqeFetch,
    /// The send engine takes a WQE written through BlueFlame: no fetch (instant).
    BlueFlameWqe,
    /// The first bytes of a gathered payload come in from host memory.
    PayloadFetch,
    /// The WQE waits for the whole-NIC message rate.
    MsgRateWait,
    /// The send engine prepares the first packet of a WQE.
    TxBuild,
    /// Payload bytes of one packet cross PCIe into the NIC (`psn`, `bytes`).
    PayloadRead,
    /// A frame is serialized onto the link (`qpn`: sending QP, `psn`, `op`: BTH opcode,
    /// `bytes`: frame length).
    Serialize,
    /// A frame crosses PHY/MAC and the cable (`obj`: destination node, `qpn`: destination
    /// QP, `status`: 0 delivered, 1 dropped, 2 lost to link-down, 3 unroutable, 4 delivered
    /// late, twice or corrupted by fault injection).
    Flight,
    /// As [`Stage::Flight`], through the switch: two hops and the cut-through latency (plus
    /// any wait for the switch's egress port).
    SwitchedFlight,
    /// The receiving NIC checks a frame (`qpn`: receiving QP, `psn`, `op`, `bytes`).
    Rx,
    /// Tag matching walks the TM-SRQ list (`obj`: SRQ, `bytes`: entries compared).
    TagMatch,
    /// A READ or atomic waits for the writes accepted before it to land.
    RespWait,
    /// The responder fetches READ data and sets up the response.
    ReadRespSetup,
    /// The responder reads an atomic's operand.
    AtomicFetch,
    /// Received data crosses PCIe to host memory (`bytes`).
    DmaWrite,
    /// Written data becomes visible to a polling host.
    Visible,
    /// A CQE crosses PCIe to host memory (`obj`: CQ).
    CqeDma,
    /// The CQE becomes visible to a polling host (`obj`: CQ).
    CqeVisible,
    /// The CQE is held behind the data it reports on (`obj`: CQ).
    CqeOrder,
    /// A CQE is written (instant; `obj`: CQ, `psn`: WQE counter, `op`: CQE opcode, `status`).
    CqeWrite,
    /// A command executes (`obj`: command opcode).
    Command,
    /// A counter changes (instant; `obj`: counter, `psn`: its success value (low 32 bits),
    /// `bytes`: its error value).
    CounterUpdate,
    /// A triggered transfer is dispatched to its QP (`obj`: trigger handle).
    TriggerDispatch,
    /// An event queue entry is written (instant; `obj`: event type, `qpn`: its object).
    AsyncEvent,
    /// Go-back-N from `psn` (instant).
    Retry,
    /// The local ACK timer expired (instant).
    AckTimeout,
    /// The requester waits out an RNR NAK.
    RnrWait,
}

impl Stage {
    /// Every stage, in declaration order.
    pub const ALL: &'static [Stage] = &[
        Stage::HostDoorbell,
        Stage::HostBlueFlame,
        Stage::HostRegWrite,
        Stage::MmioPost,
        Stage::WqeFetch,
        Stage::BlueFlameWqe,
        Stage::PayloadFetch,
        Stage::MsgRateWait,
        Stage::TxBuild,
        Stage::PayloadRead,
        Stage::Serialize,
        Stage::Flight,
        Stage::SwitchedFlight,
        Stage::Rx,
        Stage::TagMatch,
        Stage::RespWait,
        Stage::ReadRespSetup,
        Stage::AtomicFetch,
        Stage::DmaWrite,
        Stage::Visible,
        Stage::CqeDma,
        Stage::CqeVisible,
        Stage::CqeOrder,
        Stage::CqeWrite,
        Stage::Command,
        Stage::CounterUpdate,
        Stage::TriggerDispatch,
        Stage::AsyncEvent,
        Stage::Retry,
        Stage::AckTimeout,
        Stage::RnrWait,
    ];

    /// A short lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Stage::HostDoorbell => "host doorbell store",
            Stage::HostBlueFlame => "host BlueFlame store",
            Stage::HostRegWrite => "host register store",
            Stage::MmioPost => "PCIe posted write",
            Stage::WqeFetch => "WQE fetch",
            Stage::BlueFlameWqe => "WQE from BlueFlame",
            Stage::PayloadFetch => "payload fetch",
            Stage::MsgRateWait => "message-rate wait",
            Stage::TxBuild => "packet build",
            Stage::PayloadRead => "payload PCIe read",
            Stage::Serialize => "serialization",
            Stage::Flight => "PHY/MAC + cable",
            Stage::SwitchedFlight => "PHY/MAC + cable + switch",
            Stage::Rx => "receive checks",
            Stage::TagMatch => "tag matching",
            Stage::RespWait => "wait for earlier writes",
            Stage::ReadRespSetup => "READ fetch + response set-up",
            Stage::AtomicFetch => "atomic operand fetch",
            Stage::DmaWrite => "payload DMA write",
            Stage::Visible => "payload visible",
            Stage::CqeDma => "CQE DMA write",
            Stage::CqeVisible => "CQE visible",
            Stage::CqeOrder => "CQE behind data",
            Stage::CqeWrite => "CQE written",
            Stage::Command => "command",
            Stage::CounterUpdate => "counter update",
            Stage::TriggerDispatch => "triggered dispatch",
            Stage::AsyncEvent => "async event",
            Stage::Retry => "retry",
            Stage::AckTimeout => "ACK timeout",
            Stage::RnrWait => "RNR wait",
        }
    }

    /// The timing parameters ([`crate::TimingProfile::FIELDS`]) the stage's duration comes
    /// from; empty for instants and waits on another resource.
    pub fn cost(self) -> &'static [&'static str] {
        match self {
            Stage::HostDoorbell | Stage::HostRegWrite => &["host_doorbell_ps"],
            Stage::HostBlueFlame => &["host_post_wqe_ps", "host_doorbell_ps"],
            Stage::MmioPost => &["mmio_post_ps"],
            Stage::WqeFetch | Stage::PayloadFetch | Stage::AtomicFetch => &["dma_read_rtt_ps"],
            Stage::MsgRateWait => &["nic_msg_ps"],
            Stage::TxBuild => &["nic_tx_wqe_ps"],
            Stage::PayloadRead => &["pcie_read_bytes_per_us"],
            Stage::Serialize => &["link_bits_per_us", "link_frame_overhead_bytes"],
            Stage::Flight => &["link_phy_mac_ps", "link_prop_ps"],
            Stage::SwitchedFlight => &["link_phy_mac_ps", "link_prop_ps", "switch_cut_through_ps"],
            Stage::Rx => &["nic_rx_pkt_ps"],
            Stage::TagMatch => &["tm_match_fixed_ps", "tm_match_per_entry_ps"],
            Stage::RespWait => &["pcie_write_bytes_per_us", "dma_write_visible_ps"],
            Stage::ReadRespSetup => &["dma_read_rtt_ps", "nic_read_resp_extra_ps"],
            Stage::DmaWrite | Stage::CqeDma => &["pcie_write_bytes_per_us"],
            Stage::Visible | Stage::CqeVisible => &["dma_write_visible_ps"],
            Stage::CqeOrder => &["nic_cqe_after_data_ps"],
            Stage::Command => &["cmd_exec_ps", "cmd_resize_cq_ps"],
            Stage::TriggerDispatch => &["trig_dispatch_ps"],
            Stage::BlueFlameWqe
            | Stage::CqeWrite
            | Stage::CounterUpdate
            | Stage::AsyncEvent
            | Stage::Retry
            | Stage::AckTimeout
            | Stage::RnrWait => &[],
        }
    }
}

/// One stage of the simulated pipeline on one NIC: what, when (`start..end`; equal for an
/// instant), and the node-local objects it concerns. Which fields are meaningful depends on
/// the [`Stage`]; the others are 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    /// The stage.
    pub stage: Stage,
    /// When it starts.
    pub start: SimTime,
    /// When it ends.
    pub end: SimTime,
    /// The local QP.
    pub qpn: u32,
    /// Another object: CQ, counter, BAR0 offset, node, ... (see [`Stage`]).
    pub obj: u32,
    /// The packet's PSN, or a WQE index.
    pub psn: u32,
    /// An opcode: BTH, send WQE, CQE or event type (see [`Stage`]).
    pub op: u8,
    /// A status: CQE status, or a frame's fate.
    pub status: u8,
    /// Bytes moved.
    pub bytes: u32,
}

impl TraceEvent {
    /// A `stage` from `start` to `end`, every object field 0.
    pub fn new(stage: Stage, start: SimTime, end: SimTime) -> Self {
        TraceEvent {
            stage,
            start,
            end,
            qpn: 0,
            obj: 0,
            psn: 0,
            op: 0,
            status: 0,
            bytes: 0,
        }
    }
    /// An instant `stage` at `at`.
    pub fn at(stage: Stage, at: SimTime) -> Self {
        Self::new(stage, at, at)
    }
    /// With the local QP.
    pub fn qpn(mut self, qpn: u32) -> Self {
        self.qpn = qpn;
        self
    }
    /// With the other object.
    pub fn obj(mut self, obj: u32) -> Self {
        self.obj = obj;
        self
    }
    /// With the PSN or WQE index.
    pub fn psn(mut self, psn: u32) -> Self {
        self.psn = psn;
        self
    }
    /// With the opcode.
    pub fn op(mut self, op: u8) -> Self {
        self.op = op;
        self
    }
    /// With the status.
    pub fn status(mut self, status: u8) -> Self {
        self.status = status;
        self
    }
    /// With the byte count.
    pub fn bytes(mut self, bytes: usize) -> Self {
        self.bytes = bytes.min(u32::MAX as usize) as u32;
        self
    }
}

/// Reports the event `f` builds, if `env` is tracing (nothing is built otherwise).
#[inline]
pub(crate) fn trace(env: &mut dyn Env, f: impl FnOnce() -> TraceEvent) {
    if env.tracing() {
        let ev = f();
        env.trace(ev);
    }
}

/// Writes a ring entry whose last byte is its owner bit: the body first, the owner byte
/// last, so a driver that sees the new owner bit sees the whole entry.
pub(crate) fn write_owned_entry(env: &mut dyn Env, at: u64, entry: &[u8]) -> Result<(), DmaFault> {
    let Some((owner, body)) = entry.split_last() else {
        return Ok(());
    };
    env.dma_write(at, body)?;
    env.dma_write(
        at.wrapping_add(body.len() as u64),
        std::slice::from_ref(owner),
    )
}
