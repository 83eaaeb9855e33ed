//! The NIC: object tables, BAR0 registers, the event queue and event dispatch.

use crate::cq::Cq;
use crate::env::{trace, write_owned_entry, Env, NicEvent, Stage, TraceEvent};
use crate::mem::{Mr, Pd};
use crate::qp::{Qp, Srq};
use crate::timing::TimingProfile;
use ringbell_specs::cqe::{owner_bit, DoorbellError, Eqe, EventType, EQE_SIZE};
use ringbell_specs::regs::{self, Caps, GuestError};
use ringbell_specs::SimTime;
use zerocopy::IntoBytes;

/// CQE boxes kept for reuse at most (as many as a deep queue of completions in flight).
const CQE_POOL_MAX: usize = 256;

/// Static configuration of one NIC.
#[derive(Clone, Debug)]
pub struct NicConfig {
    /// Device instance id (`DEVICE_ID`).
    pub device_id: u32,
    /// Port MAC address.
    pub mac: [u8; 6],
    /// Port IPv4 address.
    pub ip: [u8; 4],
    /// QP contexts (QPNs 1..max_qp).
    pub max_qp: u32,
    /// CQ contexts.
    pub max_cq: u32,
    /// SRQ contexts.
    pub max_srq: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Protection domains.
    pub max_pd: u32,
    /// Largest work queue (entries / WQEBBs).
    pub max_qp_wr: u32,
    /// Largest CQ.
    pub max_cqe: u32,
    /// Largest max_rd_atomic.
    pub max_rd_atomic: u32,
    /// Largest message.
    pub max_msg_size: u32,
    /// Most tagged buffers in one TM-SRQ's matching list.
    pub max_num_tags: u32,
    /// Largest TM-SRQ list-operation ring.
    pub max_tm_ops: u32,
    /// Event counters (numbers 1..=max_cntr).
    pub max_cntr: u32,
    /// Entries of the triggered-operation table.
    pub max_triggered: u32,
    /// Bytes of device memory (`MAX_DM_SIZE`, ABI 1.8; at most [`regs::DM_MAX`], 0: none).
    pub max_dm_size: u32,
    /// Memory windows (`MAX_MW`, ABI 1.9; 0: none).
    pub max_mw: u32,
    /// Timing profile.
    pub timing: TimingProfile,
}

impl NicConfig {
    /// A NIC with the default limits for fabric node `node`.
    pub fn for_node(node: u32) -> Self {
        let n = node.wrapping_add(1);
        NicConfig {
            device_id: node,
            mac: [0x02, 0, 0, 0, (n >> 8) as u8, n as u8],
            ip: [10, 0, (n >> 8) as u8, n as u8],
            max_qp: 4096,
            max_cq: 4096,
            max_srq: 1024,
            max_mr: 16384,
            max_pd: 1024,
            max_qp_wr: 32768,
            max_cqe: 1 << 22,
            max_rd_atomic: 16,
            max_msg_size: 1 << 30,
            max_num_tags: 1024,
            max_tm_ops: 1 << 15,
            max_cntr: 4096,
            max_triggered: 2048,
            max_dm_size: 128 << 10,
            max_mw: 16384,
            timing: TimingProfile::default(),
        }
    }
}

/// Words of a send WQE whose control segment says `ds_count` (0 counts as 1 block).
fn bf_wqe_words(ds_count: u8) -> usize {
    ringbell_specs::wqe::wqebbs((ds_count as usize).clamp(1, ringbell_specs::wqe::MAX_DS)) * 16
}

/// Counters a NIC keeps about itself (the port counters of the ABI).
pub type NicStats = ringbell_specs::stats::PortStats;

/// A fixed-capacity table of objects numbered 1..=capacity.
#[derive(Debug)]
pub(crate) struct Table<T> {
    slots: Vec<Option<Box<T>>>,
    cap: u32,
    /// Numbers below this are never given out.
    min: u32,
}

impl<T> Table<T> {
    pub(crate) fn new(cap: u32) -> Self {
        Table {
            slots: Vec::new(),
            cap,
            min: 1,
        }
    }
    /// A table whose numbers start at `min` (QPNs: 0 and 1 are the management QPs of the
    /// IBTA, which RC traffic never uses and tools such as Wireshark decode as such).
    pub(crate) fn starting_at(cap: u32, min: u32) -> Self {
        let mut t = Table::new(cap);
        t.min = min.max(1);
        t.slots.resize_with((t.min - 1) as usize, || None);
        t
    }
    /// Inserts at the lowest free number.
    pub(crate) fn insert_with(&mut self, f: impl FnOnce(u32) -> T) -> Option<u32> {
        let skip = (self.min - 1) as usize;
        let free = self.slots.iter().skip(skip).position(Option::is_none);
        let idx = match free.map(|i| i + skip) {
            Some(i) => i,
            None if (self.slots.len() as u32) < self.cap => {
                self.slots.push(None);
                self.slots.len() - 1
            }
            None => return None,
        };
        let num = idx as u32 + 1;
        self.slots[idx] = Some(Box::new(f(num)));
        Some(num)
    }
    pub(crate) fn get(&self, num: u32) -> Option<&T> {
        self.slots.get((num as usize).wrapping_sub(1))?.as_deref()
    }
    pub(crate) fn get_mut(&mut self, num: u32) -> Option<&mut T> {
        self.slots
            .get_mut((num as usize).wrapping_sub(1))?
            .as_deref_mut()
    }
    pub(crate) fn remove(&mut self, num: u32) -> Option<Box<T>> {
        self.slots.get_mut((num as usize).wrapping_sub(1))?.take()
    }
    /// Every live object with its number, in number order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_deref().map(|t| (i as u32 + 1, t)))
    }
    /// Inserts under number `num`, below the table's first number too; false (and nothing
    /// inserted) if the number is taken or beyond the capacity.
    pub(crate) fn insert_at(&mut self, num: u32, t: T) -> bool {
        let idx = (num as usize).wrapping_sub(1);
        if num == 0 || num > self.cap {
            return false;
        }
        if self.slots.len() <= idx {
            self.slots.resize_with(idx + 1, || None);
        }
        if self.slots[idx].is_some() {
            return false;
        }
        self.slots[idx] = Some(Box::new(t));
        true
    }
    /// Puts an object taken with [`Table::remove`] back under its number.
    pub(crate) fn restore(&mut self, num: u32, t: Box<T>) {
        if let Some(slot) = self.slots.get_mut((num as usize).wrapping_sub(1)) {
            *slot = Some(t);
        }
    }
}

/// Event queue state.
#[derive(Debug, Default)]
pub(crate) struct EventRing {
    pub(crate) iova: u64,
    pub(crate) log_size: u8,
    pub(crate) pi: u32,
    pub(crate) ci: u32,
}

/// The NIC.
#[derive(Debug)]
pub struct Nic {
    pub(crate) cfg: NicConfig,
    pub(crate) pds: Table<Pd>,
    /// XRC domains (ABI 1.11): each counts the XRC SRQs and target QPs in it, as a PD does.
    pub(crate) xrcds: Table<Pd>,
    pub(crate) mrs: Table<Mr>,
    pub(crate) mws: Table<crate::mw::Mw>,
    pub(crate) cqs: Table<Cq>,
    pub(crate) qps: Table<Qp>,
    pub(crate) srqs: Table<Srq>,
    pub(crate) cntrs: Table<crate::counter::Counter>,
    pub(crate) trig: crate::counter::TriggerTable,
    /// Values latched by the last read of a counter's `CNTR_SUCCESS_LO`.
    pub(crate) cntr_latch: (u64, u64),
    /// The slot and size (words) of the last WQE taken from the BlueFlame area: stores past
    /// its end are padding.
    pub(crate) bf_tail: Option<(u32, usize)>,
    /// A BlueFlame slot being written with 32-bit stores: QPN, bytes, words written.
    pub(crate) bf_partial: Option<(u32, Box<[u8; regs::BF_STRIDE as usize]>, u64)>,
    pub(crate) mr_tag: u8,
    /// Source of context generations (never reset, so stale events never match).
    pub(crate) next_gen: u64,
    pub(crate) cmd_addr: u64,
    pub(crate) cmd_status: u32,
    pub(crate) eq: EventRing,
    pub(crate) dev_status: u32,
    pub(crate) last_error: u32,
    pub(crate) last_error_info: u32,
    pub(crate) clock_latch: u32,
    /// When the egress port finishes the frame it is sending.
    pub(crate) egress_free: SimTime,
    /// When the PCIe write path towards the host is free.
    pub(crate) pcie_write_free: SimTime,
    /// When the PCIe read path (DMA reads of payload) is free.
    pub(crate) pcie_read_free: SimTime,
    /// When the NIC can take its next message (the whole-NIC message-rate cap).
    pub(crate) msg_free: SimTime,
    pub(crate) stats: NicStats,
    pub(crate) scratch: Vec<u8>,
    /// Posted DMA writes ([`NicEvent::DmaWrite`]) not yet landed: functional mode waits for
    /// none (a message placed at once must not be overtaken by an older posted write).
    pub(crate) dma_pending: u64,
    /// Functional mode's reusable list of (IOVA, length) ranges a received message is
    /// scattered over.
    pub(crate) fm_dst: Vec<(u64, u32)>,
    /// Functional mode's scratch WQE: each one is decoded into it, reusing its buffers.
    pub(crate) fm_wqe: Option<Box<crate::qp::SendWqe>>,
    /// Decoded WQEs of completed work, kept so that starting a WQE reuses their buffers.
    pub(crate) wqe_pool: Vec<crate::qp::SendWqe>,
    /// Boxes of CQEs already written ([`NicEvent::CqeWrite`]), reused for the next ones
    /// (the boxes themselves are what is kept: an event carries one, not a CQE).
    #[allow(clippy::vec_box)]
    pub(crate) cqe_pool: Vec<Box<ringbell_specs::cqe::Cqe>>,
    /// The device's own memory (ABI 1.8).
    pub(crate) dm: crate::mem::DevMem,
    /// Flow-steering rules (ABI 1.12), how many are live, and the last rule's creation
    /// number.
    pub(crate) flows: Table<crate::raw::Flow>,
    pub(crate) flows_live: u32,
    pub(crate) flow_seq: u64,
    /// UD multicast attachments (ABI 1.12): (group IPv4 address, QPN).
    pub(crate) mcast: Vec<([u8; 4], u32)>,
}

impl Nic {
    /// A NIC in its reset state.
    pub fn new(cfg: NicConfig) -> Self {
        // QPNs run from 2 to max_qp + 1, all inside the doorbell area.
        let max_qp = cfg.max_qp.min(regs::DB_MAX_QP as u32 - 2);
        let max_cq = cfg.max_cq.min(regs::DB_MAX_CQ as u32 - 1);
        let max_srq = cfg.max_srq.min(regs::DB_MAX_SRQ as u32 - 1);
        let max_cntr = cfg.max_cntr.min(regs::CNTR_MAX as u32 - 1);
        let max_triggered = cfg.max_triggered.min(0xFFFF);
        let max_dm_size = cfg.max_dm_size.min(regs::DM_MAX as u32) & !3;
        // Window indices have 23 bits (bit 31 of a window's key marks it).
        let max_mw = cfg.max_mw.min(0x7F_FFFF);
        let cfg = NicConfig {
            max_mw,
            max_dm_size,
            max_qp,
            max_cq,
            max_srq,
            max_cntr,
            max_triggered,
            ..cfg
        };
        Nic {
            pds: Table::new(cfg.max_pd),
            xrcds: Table::new(cfg.max_pd),
            mrs: Table::new(cfg.max_mr),
            mws: Table::new(cfg.max_mw),
            cqs: Table::new(cfg.max_cq),
            qps: Table::starting_at(cfg.max_qp + 1, 2),
            srqs: Table::new(cfg.max_srq),
            cntrs: Table::new(cfg.max_cntr),
            trig: Default::default(),
            cntr_latch: (0, 0),
            bf_partial: None,
            bf_tail: None,
            cfg,
            mr_tag: 0,
            next_gen: 1,
            cmd_addr: 0,
            cmd_status: 0,
            eq: EventRing::default(),
            dev_status: regs::DEV_STATUS_READY,
            last_error: 0,
            last_error_info: 0,
            clock_latch: 0,
            egress_free: SimTime::ZERO,
            pcie_write_free: SimTime::ZERO,
            pcie_read_free: SimTime::ZERO,
            msg_free: SimTime::ZERO,
            stats: NicStats::default(),
            scratch: Vec::new(),
            dma_pending: 0,
            fm_dst: Vec::new(),
            fm_wqe: None,
            wqe_pool: Vec::new(),
            cqe_pool: Vec::new(),
            dm: crate::mem::DevMem::new(max_dm_size.into()),
            flows: Table::new(crate::raw::MAX_FLOWS),
            flows_live: 0,
            flow_seq: 0,
            mcast: Vec::new(),
        }
    }

    /// The configuration the NIC was built with (limits clamped to the ABI).
    pub fn config(&self) -> &NicConfig {
        &self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> &NicStats {
        &self.stats
    }

    /// Triggered operations waiting in the table (none leak: fired, cancelled and flushed
    /// ones leave it).
    pub fn triggered_in_use(&self) -> u32 {
        self.trig.in_use()
    }

    /// The timing profile.
    pub fn timing(&self) -> &TimingProfile {
        &self.cfg.timing
    }

    /// The BAR0 offsets of the doorbell slots ([`regs::DB_STRIDE`] bytes each) of every live
    /// QP, SRQ and CQ, in offset order: where a host that maps the doorbell pages can have
    /// stored something (an out-of-process server polls exactly these).
    pub fn doorbell_slots(&self, out: &mut Vec<u64>) {
        out.clear();
        let slot = |base: u64, num: u32| base + num as u64 * regs::DB_STRIDE;
        out.extend(self.qps.iter().map(|(n, _)| slot(regs::QP_DB_BASE, n)));
        out.extend(self.srqs.iter().map(|(n, _)| slot(regs::SRQ_DB_BASE, n)));
        out.extend(self.cqs.iter().map(|(n, _)| slot(regs::CQ_DB_BASE, n)));
        out.retain(|o| *o < regs::DB_END);
    }

    /// Capabilities reported in `CAPS`.
    pub fn caps(&self) -> Caps {
        Caps::RC
            | Caps::SRQ
            | Caps::ATOMICS
            | Caps::INLINE
            | Caps::CQE_TIMESTAMP
            | Caps::COUNTERS
            | Caps::TM_RC
            | Caps::TRIGGERED
            | Caps::BLUEFLAME
            | Caps::UD
            | Caps::REREG_MR
            | Caps::UC
            | Caps::RESIZE_CQ
            | Caps::ATOMIC_WRITE
            | Caps::XRC
            | Caps::RAW_PACKET
            | Caps::UD_MCAST
            | if self.cfg.max_dm_size > 0 {
                Caps::DEVICE_MEMORY
            } else {
                Caps::empty()
            }
            | if self.cfg.max_mw > 0 {
                Caps::MEMORY_WINDOW
            } else {
                Caps::empty()
            }
    }

    /// A 32-bit register read. Never fails: unknown offsets read 0 and are counted.
    pub fn mmio_read(&mut self, now: SimTime, offset: u64) -> u32 {
        let c = &self.cfg;
        match offset {
            regs::MAGIC => regs::MAGIC_VALUE,
            regs::ABI_VERSION => ringbell_specs::ABI_VERSION,
            regs::DEVICE_ID => c.device_id,
            regs::CAPS => self.caps().bits(),
            regs::MAX_QP => c.max_qp,
            regs::MAX_CQ => c.max_cq,
            regs::MAX_SRQ => c.max_srq,
            regs::MAX_MR => c.max_mr,
            regs::MAX_MW => c.max_mw,
            regs::MAX_PD => c.max_pd,
            regs::MAX_QP_WR => c.max_qp_wr,
            regs::MAX_CQE => c.max_cqe,
            regs::MAX_SGE => ringbell_specs::wqe::MAX_SEND_SGE as u32,
            regs::MAX_INLINE => ringbell_specs::wqe::MAX_INLINE_WRITE as u32,
            regs::MAX_WQE_SIZE => ringbell_specs::wqe::MAX_SEND_WQE as u32,
            regs::MTU_CAPS => 0b11_1110,
            regs::TS_TICK_PS => 1,
            regs::MAX_MSG_SIZE => c.max_msg_size,
            regs::MAX_RD_ATOMIC => c.max_rd_atomic,
            regs::MAX_CNTR => c.max_cntr,
            regs::MAX_TRIGGERED => c.max_triggered,
            regs::MAX_DM_SIZE => c.max_dm_size,
            o if (regs::DM_BASE..regs::DM_END).contains(&o) && o.is_multiple_of(4) => {
                let a = o - regs::DM_BASE;
                match self.dm.load(a) {
                    Some(v) => v,
                    None => {
                        self.guest_error(GuestError::BadOffset, o as u32);
                        0
                    }
                }
            }
            o if (regs::CNTR_BASE..regs::CNTR_END).contains(&o) && o.is_multiple_of(4) => {
                match self.cntr_mmio_read(o) {
                    Some(v) => v,
                    None => {
                        self.guest_error(GuestError::BadOffset, o as u32);
                        0
                    }
                }
            }
            regs::CMD_ADDR_LO => self.cmd_addr as u32,
            regs::CMD_ADDR_HI => (self.cmd_addr >> 32) as u32,
            regs::CMD_STATUS => self.cmd_status,
            regs::EQ_ADDR_LO => self.eq.iova as u32,
            regs::EQ_ADDR_HI => (self.eq.iova >> 32) as u32,
            regs::EQ_LOG_SIZE => self.eq.log_size as u32,
            regs::EQ_CI => self.eq.ci,
            regs::DEV_STATUS => self.dev_status,
            regs::GUEST_ERRORS => self.stats.guest_errors as u32,
            regs::LAST_ERROR => self.last_error,
            regs::LAST_ERROR_INFO => self.last_error_info,
            regs::CLOCK_LO => {
                self.clock_latch = (now.ps() >> 32) as u32;
                now.ps() as u32
            }
            regs::CLOCK_HI => self.clock_latch,
            regs::MAC_LO => u32::from_le_bytes([c.mac[0], c.mac[1], c.mac[2], c.mac[3]]),
            regs::MAC_HI => u32::from_le_bytes([c.mac[4], c.mac[5], 0, 0]),
            regs::IPV4_ADDR => u32::from_le_bytes(c.ip),
            _ => {
                if regs::register_at(offset).is_none()
                    && !(regs::DB_BASE..regs::DB_END).contains(&offset)
                {
                    self.guest_error(GuestError::BadOffset, offset as u32);
                }
                0
            }
        }
    }

    /// A 32-bit register write, applied at `env.now()`.
    pub fn mmio_write(&mut self, env: &mut dyn Env, offset: u64, value: u32) {
        if !offset.is_multiple_of(4) {
            self.guest_error(GuestError::BadOffset, offset as u32);
            return;
        }
        if (regs::DB_BASE..regs::DB_END).contains(&offset) {
            self.doorbell(env, offset, value);
            return;
        }
        if (regs::BF_BASE..regs::BF_END).contains(&offset) {
            self.bf_word(env, offset, value);
            return;
        }
        if (regs::DM_BASE..regs::DM_END).contains(&offset) {
            if !self.dm.store(offset - regs::DM_BASE, &value.to_le_bytes()) {
                self.guest_error(GuestError::BadOffset, offset as u32);
            }
            return;
        }
        if (regs::CNTR_BASE..regs::CNTR_END).contains(&offset) {
            if !self.cntr_mmio_write(env, offset, value) {
                self.guest_error(GuestError::BadOffset, offset as u32);
            }
            return;
        }
        match offset {
            regs::CMD_ADDR_LO => self.cmd_addr = (self.cmd_addr & !0xFFFF_FFFF) | value as u64,
            regs::CMD_ADDR_HI => {
                self.cmd_addr = (self.cmd_addr & 0xFFFF_FFFF) | ((value as u64) << 32)
            }
            regs::CMD_DOORBELL => {
                if self.cmd_status & regs::CMD_STATUS_BUSY != 0 {
                    self.guest_error(GuestError::CommandBusy, value);
                } else {
                    self.cmd_status = regs::CMD_STATUS_BUSY | (value & 0xFFFF);
                    // The firmware looks at the opcode first: a resize takes longer.
                    let mut op = [0u8; 2];
                    let resize = self.cmd_addr.is_multiple_of(256)
                        && env.dma_read(self.cmd_addr, &mut op).is_ok()
                        && u16::from_le_bytes(op)
                            == ringbell_specs::cmd::CmdOpcode::ResizeCq as u16;
                    let t = &self.cfg.timing;
                    let exec = if resize {
                        t.cmd_resize_cq_ps
                    } else {
                        t.cmd_exec_ps
                    };
                    let at = env.now() + SimTime(exec);
                    let now = env.now();
                    trace(env, || {
                        TraceEvent::new(Stage::Command, now, at).obj(value & 0xFFFF)
                    });
                    env.schedule(at, NicEvent::CmdExec);
                }
            }
            regs::EQ_ADDR_LO => self.eq.iova = (self.eq.iova & !0xFFFF_FFFF) | value as u64,
            regs::EQ_ADDR_HI => {
                self.eq.iova = (self.eq.iova & 0xFFFF_FFFF) | ((value as u64) << 32)
            }
            regs::EQ_LOG_SIZE => {
                self.eq.log_size = value.min(20) as u8;
                self.eq.pi = 0;
                self.eq.ci = 0;
                self.dev_status &= !regs::DEV_STATUS_EQ_OVERFLOW;
            }
            regs::EQ_CI => self.eq.ci = value,
            regs::RESET => {
                if value == regs::RESET_KEY {
                    self.reset();
                }
            }
            _ => {
                let e = match regs::register_at(offset) {
                    Some(_) => GuestError::ReadOnly,
                    None => GuestError::BadOffset,
                };
                self.guest_error(e, offset as u32);
            }
        }
    }

    /// A write-combined store at `offset`. In the BlueFlame area, a burst that starts at a
    /// slot and holds the whole WQE (by its own `ds_count`) is the WQE, and the bytes after it
    /// are padding; any other burst counts as the 32-bit stores it is made of, so a WQE may
    /// also arrive in several bursts (a CPU's write-combining buffer holds 64 bytes), in any
    /// order. Elsewhere a burst is its 32-bit stores.
    pub fn mmio_write_block(&mut self, env: &mut dyn Env, offset: u64, data: &[u8]) {
        let at_slot = (regs::BF_BASE..regs::BF_END).contains(&offset)
            && offset.is_multiple_of(regs::BF_STRIDE)
            && data.len() as u64 <= regs::BF_STRIDE;
        if at_slot {
            let words = bf_wqe_words(data.get(4).copied().unwrap_or(0));
            if data.len() >= words * 4 {
                let qpn = ((offset - regs::BF_BASE) / regs::BF_STRIDE) as u32;
                self.bf_partial = None;
                self.bf_tail = Some((qpn, words));
                self.bf_write(env, qpn, &data[..words * 4]);
                return;
            }
        }
        for (i, w) in data.chunks_exact(4).enumerate() {
            let v = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            self.mmio_write(env, offset.wrapping_add(4 * i as u64), v);
        }
    }

    /// A 32-bit store into a BlueFlame slot: collected until every word of the WQE (its
    /// size from the control segment's `ds_count`) is written, in any order, then taken as
    /// one BlueFlame write. A store to another slot first drops an incomplete one (counted as
    /// a guest error). After a WQE is taken, stores to its slot past its end are padding and
    /// are ignored, until a store lands inside the WQE's size again.
    fn bf_word(&mut self, env: &mut dyn Env, offset: u64, value: u32) {
        let rel = offset - regs::BF_BASE;
        let qpn = (rel / regs::BF_STRIDE) as u32;
        let word = ((rel % regs::BF_STRIDE) / 4) as usize;
        match self.bf_tail {
            Some((q, end)) if q == qpn && word >= end && self.bf_partial.is_none() => return,
            _ => self.bf_tail = None,
        }
        let (slot, mut bytes, mut mask) =
            self.bf_partial
                .take()
                .unwrap_or((qpn, Box::new([0; regs::BF_STRIDE as usize]), 0));
        if slot != qpn {
            self.guest_error(GuestError::BadOffset, offset as u32);
            bytes.fill(0);
            mask = 0;
        }
        bytes[word * 4..word * 4 + 4].copy_from_slice(&value.to_le_bytes());
        mask |= 1 << word;
        // Word 1 holds ds_count: the WQE's blocks, each 16 words.
        let words = if mask & 2 != 0 {
            bf_wqe_words(bytes[4])
        } else {
            64
        };
        let need = if words >= 64 {
            u64::MAX
        } else {
            (1u64 << words) - 1
        };
        if mask & need == need {
            self.bf_tail = Some((qpn, words));
            self.bf_write(env, qpn, &bytes[..words * 4]);
        } else {
            self.bf_partial = Some((qpn, bytes, mask));
        }
    }

    fn reset(&mut self) {
        let cfg = self.cfg.clone();
        let stats = std::mem::take(&mut self.stats);
        let (next_gen, dma_pending) = (self.next_gen, self.dma_pending);
        *self = Nic::new(cfg);
        self.stats = stats;
        self.next_gen = next_gen;
        // Writes posted before the reset still land (their events are not voided).
        self.dma_pending = dma_pending;
    }

    /// Handles an event this NIC scheduled.
    pub fn handle(&mut self, env: &mut dyn Env, ev: NicEvent) {
        match ev {
            NicEvent::Mmio { offset, value } => self.mmio_write(env, offset, value),
            NicEvent::MmioBlock { offset, data } => {
                self.mmio_write_block(env, offset, &data);
                env.recycle(data);
            }
            // A reset since the doorbell cancels the command.
            NicEvent::CmdExec if self.cmd_status & regs::CMD_STATUS_BUSY != 0 => {
                self.exec_command(env)
            }
            NicEvent::CmdExec => {}
            NicEvent::SqProcess { qpn, gen } if self.qps.get(qpn).is_some_and(|q| q.gen == gen) => {
                self.sq_process(env, qpn)
            }
            NicEvent::CqeWrite {
                cqn,
                gen,
                qp_gen,
                cqe,
            } if self.cqs.get(cqn).is_some_and(|c| c.gen == gen)
                && (qp_gen == 0
                    || self.qps.get(cqe.qpn.get()).is_some_and(|q| q.gen == qp_gen)) =>
            {
                let counted = crate::counter::counts_as_recv(&cqe);
                let (qpn, ok) = (cqe.qpn.get(), cqe.status == 0);
                self.write_cqe(env, cqn, *cqe);
                if self.cqe_pool.len() < CQE_POOL_MAX {
                    self.cqe_pool.push(cqe);
                }
                if counted {
                    if let Some(c) = self.qps.get(qpn).map(|q| q.cntrs) {
                        let now = env.now();
                        self.qp_count(env, &c, ringbell_specs::cmd::CntrEvents::RECV, ok, now);
                    }
                }
            }
            NicEvent::CntrUpdate {
                cntr,
                gen,
                success,
                error,
            } => {
                if self.cntrs.get(cntr).is_some_and(|c| c.gen == gen) {
                    self.cntr_apply(env, cntr, (success, false), (error, false));
                }
            }
            NicEvent::DmaWrite { iova, data, qpn } => {
                self.dma_pending = self.dma_pending.saturating_sub(1);
                if let Err(f) = self.dm.write(env, iova, &data) {
                    // Unmapped since the write was posted.
                    self.iommu_fault(env, qpn, f.iova);
                }
                env.recycle(data);
            }
            NicEvent::Respond { qpn, gen } if self.qps.get(qpn).is_some_and(|q| q.gen == gen) => {
                self.respond(env, qpn)
            }
            NicEvent::AtomicExec { qpn, gen, psn }
                if self.qps.get(qpn).is_some_and(|q| q.gen == gen) =>
            {
                self.atomic_exec(env, qpn, psn)
            }
            NicEvent::AckTimer { qpn, gen } if self.qps.get(qpn).is_some_and(|q| q.gen == gen) => {
                self.ack_timer(env, qpn)
            }
            // Work for a context destroyed (or reset) after it was scheduled.
            NicEvent::SqProcess { .. }
            | NicEvent::CqeWrite { .. }
            | NicEvent::Respond { .. }
            | NicEvent::AtomicExec { .. }
            | NicEvent::AckTimer { .. } => {}
        }
    }

    fn doorbell(&mut self, env: &mut dyn Env, offset: u64, value: u32) {
        let (base, obj_off) = if offset >= regs::CQ_DB_BASE {
            (regs::CQ_DB_BASE, offset - regs::CQ_DB_BASE)
        } else if offset >= regs::SRQ_DB_BASE {
            (regs::SRQ_DB_BASE, offset - regs::SRQ_DB_BASE)
        } else {
            (regs::QP_DB_BASE, offset - regs::QP_DB_BASE)
        };
        let num = (obj_off / regs::DB_STRIDE) as u32;
        let which = obj_off % regs::DB_STRIDE;
        match base {
            regs::CQ_DB_BASE => self.cq_doorbell(env, num, which, value),
            regs::SRQ_DB_BASE => self.srq_doorbell(env, num, which, value),
            _ => self.qp_doorbell(env, num, which, value),
        }
    }

    pub(crate) fn doorbell_error(
        &mut self,
        env: &mut dyn Env,
        num: u32,
        why: DoorbellError,
        index: u32,
    ) {
        let code = match why {
            DoorbellError::NoSuchObject => GuestError::BadDoorbellObject,
            _ => GuestError::BadDoorbellIndex,
        };
        self.guest_error(code, num);
        self.post_event(env, EventType::DoorbellError, why as u8, num, index as u64);
    }

    pub(crate) fn guest_error(&mut self, e: GuestError, info: u32) {
        self.stats.guest_errors += 1;
        self.last_error = e as u32;
        self.last_error_info = info;
    }

    pub(crate) fn iommu_fault(&mut self, env: &mut dyn Env, qpn: u32, iova: u64) {
        self.stats.iommu_faults += 1;
        self.post_event(env, EventType::IommuFault, 0, qpn, iova);
    }

    /// Writes an EQE and raises interrupt 0. Lost (and counted) if the EQ is off or full.
    pub(crate) fn post_event(
        &mut self,
        env: &mut dyn Env,
        ty: EventType,
        subtype: u8,
        obj: u32,
        info: u64,
    ) {
        let eq = &mut self.eq;
        if eq.log_size == 0 {
            self.stats.eqes_lost += 1;
            return;
        }
        let size = 1u32 << eq.log_size;
        if eq.pi.wrapping_sub(eq.ci) >= size {
            self.stats.eqes_lost += 1;
            self.dev_status |= regs::DEV_STATUS_EQ_OVERFLOW;
            return;
        }
        let eqe = Eqe {
            event_type: ty as u8,
            subtype,
            obj: obj.into(),
            info: info.into(),
            timestamp: env.now().ps().into(),
            owner: owner_bit(eq.pi, eq.log_size),
            ..Default::default()
        };
        let at = eq
            .iova
            .wrapping_add(((eq.pi & (size - 1)) as u64) * EQE_SIZE as u64);
        match write_owned_entry(env, at, eqe.as_bytes()) {
            Ok(()) => {
                eq.pi = eq.pi.wrapping_add(1);
                self.stats.eqes += 1;
                let now = env.now();
                trace(env, || {
                    TraceEvent::at(Stage::AsyncEvent, now)
                        .qpn(obj)
                        .op(ty as u8)
                        .status(subtype)
                });
                env.interrupt(0);
            }
            Err(_) => {
                // The EQ itself is unreachable: nothing can report it but the status register.
                self.stats.eqes_lost += 1;
                self.stats.iommu_faults += 1;
                self.dev_status |= regs::DEV_STATUS_EQ_OVERFLOW;
            }
        }
    }

    /// A generation number no context has had.
    pub(crate) fn fresh_gen(&mut self) -> u64 {
        self.next_gen += 1;
        self.next_gen
    }

    /// When the egress link can start a frame ready at `ready`, and when it finishes.
    pub(crate) fn reserve_egress(&mut self, ready: SimTime, frame_len: usize) -> SimTime {
        let start = ready.max(self.egress_free);
        let done = start + SimTime(self.cfg.timing.serialize_ps(frame_len));
        self.egress_free = done;
        done
    }

    /// When a DMA read of `len` payload bytes issued at `ready` has the data in the NIC,
    /// behind the reads before it on the shared PCIe read path.
    pub(crate) fn reserve_pcie_read(&mut self, ready: SimTime, len: usize) -> SimTime {
        let start = ready.max(self.pcie_read_free);
        let done = start + SimTime(self.cfg.timing.pcie_read_ps(len));
        self.pcie_read_free = done;
        done
    }

    /// The earliest the NIC takes a new message arriving at `ready`: messages of all QPs
    /// share the NIC's message rate.
    pub(crate) fn reserve_msg(&mut self, ready: SimTime) -> SimTime {
        let start = ready.max(self.msg_free);
        self.msg_free = start + SimTime(self.cfg.timing.nic_msg_ps);
        start
    }

    /// When a DMA write of `len` bytes issued at `ready` is visible to the host.
    pub(crate) fn reserve_pcie_write(&mut self, ready: SimTime, len: usize) -> SimTime {
        let start = ready.max(self.pcie_write_free);
        let done = start + SimTime(self.cfg.timing.pcie_write_ps(len));
        self.pcie_write_free = done;
        done + SimTime(self.cfg.timing.dma_write_visible_ps)
    }

    /// Posts a DMA write of `data` (already checked against the IOMMU) issued at `ready`; it
    /// lands after the PCIe transfer and posting delay. Writes land in the order posted.
    pub(crate) fn post_dma_write(
        &mut self,
        env: &mut dyn Env,
        ready: SimTime,
        iova: u64,
        data: &[u8],
        qpn: u32,
    ) {
        let start = ready.max(self.pcie_write_free);
        let at = self.reserve_pcie_write(ready, data.len());
        if env.tracing() {
            let done = self.pcie_write_free;
            let ev = |s, a, b| TraceEvent::new(s, a, b).qpn(qpn).bytes(data.len());
            env.trace(ev(Stage::DmaWrite, start, done));
            env.trace(ev(Stage::Visible, done, at));
        }
        self.dma_pending += 1;
        let mut buf = env.buffer();
        buf.clear();
        buf.extend_from_slice(data);
        env.schedule(
            at,
            NicEvent::DmaWrite {
                iova,
                data: buf,
                qpn,
            },
        );
    }

    /// The earliest a read of host memory issued at `ready` sees every write posted so far.
    pub(crate) fn after_posted_writes(&self, ready: SimTime) -> SimTime {
        ready.max(self.pcie_write_free + SimTime(self.cfg.timing.dma_write_visible_ps))
    }

    /// Sends a frame built in `frame`, ready at `ready`.
    pub(crate) fn send_frame(&mut self, env: &mut dyn Env, ready: SimTime, frame: Vec<u8>) {
        let done = self.reserve_egress(ready, frame.len());
        self.stats.tx_frames += 1;
        env.transmit(done, frame);
    }
}
