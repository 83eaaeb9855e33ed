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
    /// Raises interrupt `vector`.
    fn interrupt(&mut self, vector: u32);
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
