//! The device: opening it over a port, the command mailbox, the event queue, DMA buffers.

use crate::dma::DmaMemory;
use crate::error::Error;
use crate::mr::ProtectionDomain;
use crate::port::Port;
use crate::qp::QpRings;
use crate::srq::SrqRings;
use ringbell_specs::cmd::{
    self, CmdHeader, CmdOpcode, CmdStatus, ObjectIn, ObjectOut, QueryDeviceOut,
};
use ringbell_specs::cqe::{owner_bit, Eqe, EventType, EQE_SIZE};
use ringbell_specs::regs;
use ringbell_specs::stats::PortStats;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::rc::Rc;
use zerocopy::{FromBytes, IntoBytes};

/// Limits and capabilities reported by QUERY_DEVICE.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceCaps {
    /// Device instance id.
    pub device_id: u32,
    /// Capability flags.
    pub caps: regs::Caps,
    /// QP contexts.
    pub max_qp: u32,
    /// CQ contexts.
    pub max_cq: u32,
    /// SRQ contexts.
    pub max_srq: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Protection domains.
    pub max_pd: u32,
    /// Largest work queue.
    pub max_qp_wr: u32,
    /// Largest CQ.
    pub max_cqe: u32,
    /// Most SGEs per WQE.
    pub max_sge: u32,
    /// Most inline bytes.
    pub max_inline: u32,
    /// Largest message.
    pub max_msg_size: u32,
    /// Largest max_rd_atomic.
    pub max_rd_atomic: u32,
    /// Most tagged buffers in a TM-SRQ (0: no tag matching).
    pub max_num_tags: u32,
    /// Largest TM-SRQ list-operation ring.
    pub max_tm_ops: u32,
    /// Largest rendezvous request the device matches.
    pub max_rndv_hdr_size: u32,
    /// Event counters (0: no counters or triggered operations).
    pub max_cntr: u32,
    /// Entries of the triggered-operation table.
    pub max_triggered: u32,
    /// Bytes of device memory (0: none; [`Device::alloc_dm`]).
    pub max_dm_size: u32,
    /// Memory windows (ABI 1.9; 0: none).
    pub max_mw: u32,
    /// Port MAC address.
    pub mac: [u8; 6],
    /// Port IPv4 address.
    pub ip: [u8; 4],
}

/// An asynchronous event read from the event queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AsyncEvent {
    /// What happened.
    pub kind: EventType,
    /// Event-specific detail (command status, doorbell error kind).
    pub subtype: u8,
    /// The object it concerns (QPN, CQN, SRQN, command token).
    pub obj: u32,
    /// Extra information (faulting IOVA, doorbell index).
    pub info: u64,
    /// Simulated device time in picoseconds.
    pub timestamp: u64,
}

const EQ_LOG: u8 = 7;
/// On a device that runs on its own, EQEs consumed before the consumer index is written
/// back (each write to a served NIC is a round trip to its server), as mlx5 keeps spare
/// EQEs and writes its EQ's index in batches: the device sees at most this many fewer free
/// entries than there are (at least 113 of the 128).
const EQ_CI_BATCH: u32 = 16;
const IOVA_BASE: u64 = 0x1_0000_0000;

/// How long a command may take, in wall time, before the device is taken as lost
/// ([`Error::CommandTimeout`]); change it with [`Device::set_command_timeout`]. Commands take
/// microseconds on the emulator and on hardware: only a hung or vanished device reaches it.
pub const DEFAULT_COMMAND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub(crate) struct DevInner {
    pub(crate) port: Box<dyn Port>,
    pub(crate) caps: DeviceCaps,
    next_iova: Cell<u64>,
    mailbox: DmaMemory,
    token: Cell<u16>,
    eq: DmaMemory,
    eq_ci: Cell<u32>,
    /// The consumer index last written to the device.
    eq_ci_told: Cell<u32>,
    /// Send/receive bookkeeping of every live QP, for completion lookup.
    pub(crate) qps: RefCell<BTreeMap<u32, Rc<QpRings>>>,
    /// Receive bookkeeping of every live SRQ.
    pub(crate) srqs: RefCell<BTreeMap<u32, Rc<SrqRings>>>,
    /// Events read from the EQ while looking for another one, oldest first.
    pub(crate) events: RefCell<std::collections::VecDeque<AsyncEvent>>,
    /// Counters whose DESTROY_CNTR was refused (still referenced); retried later.
    pub(crate) parked_cntrs: RefCell<Vec<u32>>,
    /// How long a command may take.
    command_timeout: Cell<std::time::Duration>,
    /// Why the device is taken as lost (a command timed out, or its port failed).
    lost: RefCell<Option<String>>,
    /// Caller memory mapped for this device (`hostmem`).
    pub(crate) host: crate::hostmem::HostRegions,
    /// Where the driver's own rings and doorbell records come from.
    arena: RefCell<DmaArena>,
    /// Whether the device reaches the process's memory on demand ([`Device::on_demand`]):
    /// asked of the port at the first need.
    odp: Cell<Option<bool>>,
}

/// Bytes of each arena chunk: one memory file, mapped for the device once.
const ARENA_CHUNK: usize = 1 << 20;
/// Smallest arena block (a doorbell record's 64-byte line).
const ARENA_MIN_LOG: u32 = 6;
/// Largest arena block; larger rings get memory of their own.
const ARENA_MAX_LOG: u32 = 18;

/// The driver's DMA arena: queue rings and doorbell records are blocks of a few large
/// memory files, each mapped for the device once, instead of a memory file and a mapping
/// each. That keeps file descriptors and mappings (and, over vfio-user, DMA_MAP messages) in
/// proportion to the memory used, not to the number of queues. Blocks are powers of two from
/// 64 bytes to 256 KiB, aligned to their size (4 KiB at most); a freed block goes to the
/// free list of its size and is zeroed when it is handed out again; a chunk whose last block
/// is freed is unmapped and closed, unless it is the one new blocks are cut from.
#[derive(Debug, Default)]
struct DmaArena {
    /// Chunks by number; `None` once released.
    chunks: Vec<Option<ArenaChunk>>,
    /// Free blocks per size class: (chunk, offset).
    free: Vec<Vec<(u32, usize)>>,
}

#[derive(Debug)]
struct ArenaChunk {
    mem: DmaMemory,
    iova: u64,
    /// Bytes cut so far.
    used: usize,
    /// Blocks handed out and not freed.
    live: usize,
}

impl DevInner {
    /// A zeroed block of at least `len` bytes from the arena, or `None` when `len` is
    /// larger than the arena's blocks.
    fn arena_alloc(&self, len: usize) -> Result<Option<(DmaMemory, u64, u32, u32)>, Error> {
        let log = len
            .max(1)
            .next_power_of_two()
            .trailing_zeros()
            .max(ARENA_MIN_LOG);
        if log > ARENA_MAX_LOG {
            return Ok(None);
        }
        let class = (log - ARENA_MIN_LOG) as usize;
        let size = 1usize << log;
        let mut a = self.arena.borrow_mut();
        if a.free.len() <= class {
            a.free.resize_with(class + 1, Vec::new);
        }
        let (chunk, off, fresh) = match a.free[class].pop() {
            Some((c, off)) => (c, off, false),
            None => {
                let align = size.min(4096);
                let last = a.chunks.len().checked_sub(1);
                let room = last
                    .and_then(|i| {
                        a.chunks[i]
                            .as_ref()
                            .map(|c| (i, c.used.next_multiple_of(align)))
                    })
                    .filter(|&(_, at)| at + size <= ARENA_CHUNK);
                match room {
                    Some((i, at)) => (i as u32, at, true),
                    None => {
                        let mem = DmaMemory::new(ARENA_CHUNK)?;
                        let iova = self.alloc_iova(ARENA_CHUNK)?;
                        self.port
                            .dma_map(file_of(&mem)?, ARENA_CHUNK as u64, iova)?;
                        a.chunks.push(Some(ArenaChunk {
                            mem,
                            iova,
                            used: 0,
                            live: 0,
                        }));
                        (a.chunks.len() as u32 - 1, 0, true)
                    }
                }
            }
        };
        let Some(c) = a.chunks.get_mut(chunk as usize).and_then(Option::as_mut) else {
            return Err(Error::Memory(
                "DMA arena: a free block of a released chunk".into(),
            ));
        };
        if fresh {
            c.used = off + size;
        }
        c.live += 1;
        let view = c
            .mem
            .view(off, size)
            .ok_or_else(|| Error::Memory("DMA arena: block outside its chunk".into()))?;
        if !fresh {
            // A reused block: the device expects zeroed rings and records.
            view.fill(0, size, 0)?;
        }
        Ok(Some((view, c.iova + off as u64, chunk, class as u32)))
    }

    /// Returns a block to the arena.
    fn arena_free(&self, chunk: u32, class: u32, off: usize) {
        let mut a = self.arena.borrow_mut();
        let a = &mut *a;
        let current = a.chunks.len().saturating_sub(1) == chunk as usize;
        let Some(c) = a.chunks.get_mut(chunk as usize).and_then(Option::as_mut) else {
            return;
        };
        c.live = c.live.saturating_sub(1);
        if c.live == 0 && !current {
            // Nothing of the chunk is in use and no new block comes from it: close it.
            for list in &mut a.free {
                list.retain(|&(n, _)| n != chunk);
            }
            if let Some(c) = a.chunks[chunk as usize].take() {
                let _ = self.port.dma_unmap(c.iova, ARENA_CHUNK as u64);
            }
            return;
        }
        if let Some(list) = a.free.get_mut(class as usize) {
            list.push((chunk, off));
        }
    }
}

impl std::fmt::Debug for DevInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("caps", &self.caps).finish()
    }
}

impl DevInner {
    /// Reserves an IOVA range for `len` bytes.
    pub(crate) fn alloc_iova(&self, len: usize) -> Result<u64, Error> {
        let iova = self.next_iova.get();
        // A guard page between mappings turns an overrun into an IOMMU fault. Adopted caller
        // memory has the IOVAs from HOST_IOVA_OFFSET on.
        let next = (len as u64)
            .checked_next_multiple_of(4096)
            .and_then(|l| iova.checked_add(l)?.checked_add(4096))
            .filter(|n| *n <= crate::hostmem::HOST_IOVA_OFFSET)
            .ok_or_else(|| Error::Memory("device address space exhausted".into()))?;
        self.next_iova.set(next);
        Ok(iova)
    }

    /// Reads the EQE at the consumer index: `None` when there is none, `Some(None)` for one
    /// of a kind this driver does not know (consumed and skipped).
    fn read_eqe(&self) -> Option<Option<AsyncEvent>> {
        let ci = self.eq_ci.get();
        let slot = (ci & ((1 << EQ_LOG) - 1)) as usize * EQE_SIZE;
        if self.eq.load_acquire(slot + EQE_SIZE - 1) != owner_bit(ci, EQ_LOG) {
            return None;
        }
        let mut b = [0u8; EQE_SIZE];
        self.eq.read(slot, &mut b).ok()?;
        let e = Eqe::read_from_bytes(&b).ok()?;
        let next = ci.wrapping_add(1);
        self.eq_ci.set(next);
        if self.port.lockstep() || next.wrapping_sub(self.eq_ci_told.get()) >= EQ_CI_BATCH {
            self.port.write32(regs::EQ_CI, next);
            self.eq_ci_told.set(next);
        }
        Some(EventType::from_u8(e.event_type).map(|kind| AsyncEvent {
            kind,
            subtype: e.subtype,
            obj: e.obj.get(),
            info: e.info.get(),
            timestamp: e.timestamp.get(),
        }))
    }

    /// Takes the oldest event that `want` accepts, reading the EQ as far as needed; the
    /// events passed over stay for [`Device::poll_event`].
    pub(crate) fn take_event(&self, want: impl Fn(&AsyncEvent) -> bool) -> Option<AsyncEvent> {
        {
            let mut q = self.events.borrow_mut();
            if let Some(i) = q.iter().position(&want) {
                return q.remove(i);
            }
        }
        while let Some(e) = self.read_eqe() {
            match e {
                Some(e) if want(&e) => return Some(e),
                Some(e) => self.events.borrow_mut().push_back(e),
                None => {}
            }
        }
        None
    }

    /// Runs a command and returns its output parameters.
    pub(crate) fn command(
        &self,
        op: CmdOpcode,
        input: &[u8],
    ) -> Result<[u8; cmd::PARAMS_SIZE], Error> {
        match self.run_command(op as u16, input)? {
            Ok(out) => Ok(out),
            Err(status) => Err(match CmdStatus::from_u8(status) {
                Some(status) => Error::Command { op, status },
                None => Error::UnknownStatus { op, status },
            }),
        }
    }

    /// Records that the device is lost (every later command fails at once) and returns the
    /// error that says so.
    fn mark_lost(&self, why: String) -> Error {
        *self.lost.borrow_mut() = Some(why.clone());
        Error::DeviceLost(why)
    }

    /// Runs the command with opcode `opcode`: the output parameters on success, the device's
    /// status byte when it refused the command, an error when the mailbox could not be used.
    fn run_command(
        &self,
        opcode: u16,
        input: &[u8],
    ) -> Result<Result<[u8; cmd::PARAMS_SIZE], u8>, Error> {
        if let Some(why) = &*self.lost.borrow() {
            return Err(Error::DeviceLost(why.clone()));
        }
        // Processes that share the device (a child of fork and its parent) take turns.
        let _turn = self.port.exclusive();
        let token = self.token.get().wrapping_add(1).max(1);
        self.token.set(token);
        let hdr = CmdHeader {
            opcode: opcode.into(),
            token: (token as u32).into(),
            ..Default::default()
        };
        let mut mbox = [0u8; cmd::MAILBOX_SIZE];
        mbox[..16].copy_from_slice(hdr.as_bytes());
        let n = input.len().min(cmd::PARAMS_SIZE);
        mbox[cmd::IN_OFFSET..cmd::IN_OFFSET + n].copy_from_slice(&input[..n]);
        self.mailbox.write(0, &mbox)?;
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        self.port.write32(regs::CMD_DOORBELL, token as u32);
        // A device run in lockstep with the caller is bounded by going idle, never by wall
        // time (same run, same result); any other gets the command timeout.
        let timeout = (!self.port.lockstep()).then(|| self.command_timeout.get());
        let start = timeout.map(|_| std::time::Instant::now());
        loop {
            let s = self.port.read32(regs::CMD_STATUS);
            if s & regs::CMD_STATUS_BUSY == 0 && (s & 0xFFFF) as u16 == token {
                break;
            }
            if !self.port.progress() {
                // A port whose connection broke reports idle: say why.
                return Err(match self.port.failure() {
                    Some(why) => self.mark_lost(why),
                    None => Error::DeviceIdle("a command"),
                });
            }
            if let (Some(timeout), Some(start)) = (timeout, start) {
                let waited = start.elapsed();
                if waited >= timeout {
                    self.mark_lost(format!(
                        "command {opcode:#06x} did not complete within {timeout:?}"
                    ));
                    return Err(Error::CommandTimeout { opcode, waited });
                }
            }
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        let mut back = [0u8; cmd::MAILBOX_SIZE - cmd::RESULT_OFFSET];
        self.mailbox.read(cmd::RESULT_OFFSET, &mut back)?;
        let status = back[0];
        if status != CmdStatus::Ok as u8 {
            return Ok(Err(status));
        }
        let mut out = [0u8; cmd::PARAMS_SIZE];
        out.copy_from_slice(&back[16..16 + cmd::PARAMS_SIZE]);
        Ok(Ok(out))
    }

    /// Runs a command that returns one object number.
    pub(crate) fn create(&self, op: CmdOpcode, input: &[u8]) -> Result<u32, Error> {
        let out = self.command(op, input)?;
        Ok(ObjectOut::read_from_prefix(&out)
            .map(|(o, _)| o.num.get())
            .unwrap_or(0))
    }

    /// Runs a command naming one object (destroy, free, dereg).
    pub(crate) fn destroy(&self, op: CmdOpcode, num: u32) -> Result<(), Error> {
        self.command(op, ObjectIn { num: num.into() }.as_bytes())
            .map(|_| ())
    }
}

/// An open device.
#[derive(Debug, Clone)]
pub struct Device {
    pub(crate) inner: Rc<DevInner>,
}

impl Device {
    /// Opens the device behind `port`: checks identity and ABI version, sets up the command
    /// mailbox and the event queue, and reads the capabilities. Commands time out after
    /// [`DEFAULT_COMMAND_TIMEOUT`].
    pub fn open(port: Box<dyn Port>) -> Result<Device, Error> {
        Device::open_with(port, DEFAULT_COMMAND_TIMEOUT)
    }

    /// [`Device::open`] with commands (the first included) timing out after
    /// `command_timeout` of wall time.
    pub fn open_with(
        port: Box<dyn Port>,
        command_timeout: std::time::Duration,
    ) -> Result<Device, Error> {
        if let Some(why) = port.failure() {
            return Err(Error::DeviceLost(why));
        }
        if !port.lockstep() {
            crate::fork::device_elsewhere();
        }
        let magic = port.read32(regs::MAGIC);
        if magic != regs::MAGIC_VALUE {
            return Err(Error::NotADevice(magic));
        }
        let v = port.read32(regs::ABI_VERSION);
        if (v >> 16) as u16 != ringbell_specs::ABI_MAJOR {
            return Err(Error::AbiMismatch {
                found_major: (v >> 16) as u16,
                found_minor: v as u16,
                expected: ringbell_specs::ABI_MAJOR,
            });
        }
        let mailbox = DmaMemory::new(4096)?;
        let eq = DmaMemory::new((1usize << EQ_LOG) * EQE_SIZE)?;
        let inner = DevInner {
            port,
            caps: DeviceCaps {
                device_id: 0,
                caps: regs::Caps::empty(),
                max_qp: 0,
                max_cq: 0,
                max_srq: 0,
                max_mr: 0,
                max_pd: 0,
                max_qp_wr: 0,
                max_cqe: 0,
                max_sge: 0,
                max_inline: 0,
                max_msg_size: 0,
                max_rd_atomic: 0,
                max_num_tags: 0,
                max_tm_ops: 0,
                max_rndv_hdr_size: 0,
                max_cntr: 0,
                max_triggered: 0,
                max_dm_size: 0,
                max_mw: 0,
                mac: [0; 6],
                ip: [0; 4],
            },
            next_iova: Cell::new(IOVA_BASE),
            mailbox,
            token: Cell::new(0),
            eq,
            eq_ci: Cell::new(0),
            eq_ci_told: Cell::new(0),
            qps: RefCell::new(BTreeMap::new()),
            srqs: RefCell::new(BTreeMap::new()),
            events: RefCell::new(std::collections::VecDeque::new()),
            parked_cntrs: RefCell::new(Vec::new()),
            command_timeout: Cell::new(command_timeout),
            lost: RefCell::new(None),
            host: Default::default(),
            arena: Default::default(),
            odp: Cell::new(None),
        };
        let mb_iova = inner.alloc_iova(inner.mailbox.len())?;
        inner.port.dma_map(
            file_of(&inner.mailbox)?,
            inner.mailbox.len() as u64,
            mb_iova,
        )?;
        let eq_iova = inner.alloc_iova(inner.eq.len())?;
        inner
            .port
            .dma_map(file_of(&inner.eq)?, inner.eq.len() as u64, eq_iova)?;
        let p = &inner.port;
        p.write32(regs::CMD_ADDR_LO, mb_iova as u32);
        p.write32(regs::CMD_ADDR_HI, (mb_iova >> 32) as u32);
        p.write32(regs::EQ_ADDR_LO, eq_iova as u32);
        p.write32(regs::EQ_ADDR_HI, (eq_iova >> 32) as u32);
        p.write32(regs::EQ_LOG_SIZE, EQ_LOG as u32);
        let out = inner.command(CmdOpcode::QueryDevice, &[])?;
        let q = QueryDeviceOut::read_from_prefix(&out)
            .map(|(q, _)| q)
            .unwrap_or_default();
        let mut inner = inner;
        inner.caps = DeviceCaps {
            device_id: q.device_id.get(),
            caps: regs::Caps::from_bits_truncate(q.caps.get()),
            max_qp: q.max_qp.get(),
            max_cq: q.max_cq.get(),
            max_srq: q.max_srq.get(),
            max_mr: q.max_mr.get(),
            max_pd: q.max_pd.get(),
            // Completions name WQEs by a 16-bit counter: larger rings cannot be told apart.
            max_qp_wr: q.max_qp_wr.get().min(1 << 15),
            max_cqe: q.max_cqe.get(),
            max_sge: q.max_sge.get(),
            max_inline: q.max_inline.get(),
            max_msg_size: q.max_msg_size.get(),
            max_rd_atomic: q.max_rd_atomic.get(),
            max_num_tags: q.max_num_tags.get(),
            max_tm_ops: q.max_tm_ops.get(),
            max_rndv_hdr_size: q.max_rndv_hdr_size.get(),
            max_cntr: q.max_cntr.get(),
            max_triggered: q.max_triggered.get(),
            // Only a device that says it has the memory (a 1.7 device's output ends before).
            max_dm_size: if regs::Caps::from_bits_truncate(q.caps.get())
                .contains(regs::Caps::DEVICE_MEMORY)
            {
                q.max_dm_size.get().min(regs::DM_MAX as u32)
            } else {
                0
            },
            max_mw: if regs::Caps::from_bits_truncate(q.caps.get())
                .contains(regs::Caps::MEMORY_WINDOW)
            {
                q.max_mw.get()
            } else {
                0
            },
            mac: q.mac,
            ip: q.ipv4,
        };
        Ok(Device {
            inner: Rc::new(inner),
        })
    }

    /// How long a command may take before the device is taken as lost.
    pub fn command_timeout(&self) -> std::time::Duration {
        self.inner.command_timeout.get()
    }

    /// Sets how long a command may take (wall time) before [`Error::CommandTimeout`]; after
    /// one, every command fails at once with [`Error::DeviceLost`].
    pub fn set_command_timeout(&self, timeout: std::time::Duration) {
        self.inner.command_timeout.set(timeout);
    }

    /// Why the device is taken as lost, if it is: an earlier command timed out or its port
    /// failed. Commands then fail at once.
    pub fn lost(&self) -> Option<String> {
        self.inner.lost.borrow().clone()
    }

    /// Capabilities and limits.
    pub fn caps(&self) -> &DeviceCaps {
        &self.inner.caps
    }

    /// Whether the device reaches this process's memory on demand (on-demand paging, as
    /// `IBV_ACCESS_ON_DEMAND` regions need): a device in this process does
    /// ([`Port::map_process`]), hardware and a served emulator do not. The first call opens
    /// the device's window onto the process.
    pub fn on_demand(&self) -> bool {
        if let Some(v) = self.inner.odp.get() {
            return v;
        }
        let v = self.inner.port.map_process().is_ok();
        self.inner.odp.set(Some(v));
        v
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain, Error> {
        let pdn = self.inner.create(CmdOpcode::AllocPd, &[])?;
        Ok(ProtectionDomain {
            dev: self.clone(),
            pdn,
            obj: crate::mr::PdObject::new(self.clone(), pdn),
            alloc: None,
        })
    }

    /// Allocates `len` bytes of DMA memory (rounded up to 4 KiB) mapped for the device: a
    /// memory file and a device mapping of its own.
    pub fn alloc_dma(&self, len: usize) -> Result<DmaBuffer, Error> {
        let mem = DmaMemory::new(len)?;
        let iova = self.inner.alloc_iova(mem.len())?;
        self.inner
            .port
            .dma_map(file_of(&mem)?, mem.len() as u64, iova)?;
        Ok(DmaBuffer {
            dev: self.clone(),
            mem,
            iova,
            arena: None,
            caller: None,
        })
    }

    /// Allocates at least `len` zeroed bytes for memory of the driver's own (a ring, a
    /// doorbell record, a tag matcher's ring of send headers), from the device's DMA arena
    /// (or, above 256 KiB, as [`Device::alloc_dma`] does).
    pub(crate) fn alloc_ring(&self, len: usize) -> Result<DmaBuffer, Error> {
        match self.inner.arena_alloc(len)? {
            Some((mem, iova, chunk, class)) => Ok(DmaBuffer {
                dev: self.clone(),
                mem,
                iova,
                arena: Some((chunk, class)),
                caller: None,
            }),
            None => self.alloc_dma(len),
        }
    }

    /// Memory for a queue's ring or doorbell record of `len` bytes: from `alloc` (a parent
    /// domain's allocator) when there is one and it gives memory, otherwise the driver's
    /// own ([`Device::alloc_ring`]). The caller's memory is checked (aligned to `align`, a
    /// power of two; its pages mapped and writable), adopted for the device in place
    /// (`hostmem`), zeroed, and given back to the allocator when the buffer is dropped.
    /// Errors: [`Error::Memory`] when the allocator has none; [`Error::InvalidArgument`]
    /// for a misaligned pointer; [`Error::BadAddress`] for memory that cannot be adopted,
    /// except huge pages (`MAP_HUGETLB`), which no memory file of normal pages can replace:
    /// they go back to the allocator and the queue takes the driver's own memory.
    /// Memory the driver could not use goes back to the allocator at once.
    pub(crate) fn alloc_queue_mem(
        &self,
        len: usize,
        align: usize,
        kind: QueueMem,
        alloc: Option<&QueueAlloc>,
    ) -> Result<DmaBuffer, Error> {
        let Some(a) = alloc else {
            return self.alloc_ring(len);
        };
        let p = match a.0.alloc(len, align, kind) {
            Allocated::Failed => {
                return Err(Error::Memory("the queue allocator gave no memory".into()))
            }
            Allocated::UseDefault => return self.alloc_ring(len),
            Allocated::At(p) => p,
        };
        if p.as_ptr() as usize & (align - 1) != 0 {
            a.0.free(p, kind);
            return Err(Error::InvalidArgument(
                "the queue allocator's memory is not aligned as asked",
            ));
        }
        // SAFETY: the allocator's contract (`QueueAllocator`): `len` bytes at `p` that the
        // caller owns and keeps mapped until they are given back through `free`, which the
        // buffer does only after the device's mapping of them is gone.
        let pages = match unsafe { crate::hostmem::adopt_queue(self, p.as_ptr(), len) } {
            Ok(pages) => pages,
            // Huge pages cannot be adopted: the queue takes the driver's own memory, and
            // the allocator has its memory back at once (the program sees its queue work
            // as with any allocator).
            Err(Error::BadAddress { reason, .. })
                if reason.starts_with(crate::hostmem::HUGE_PAGES) =>
            {
                a.0.free(p, kind);
                return self.alloc_ring(len);
            }
            Err(e) => {
                a.0.free(p, kind);
                return Err(e);
            }
        };
        // SAFETY: as above; nothing else in the driver uses these bytes.
        let mem = unsafe { DmaMemory::caller(p.as_ptr(), len) };
        // Made before the zeroing, so that any failure gives the memory back (its drop).
        let buf = DmaBuffer {
            dev: self.clone(),
            mem,
            iova: crate::hostmem::iova(p.as_ptr() as usize),
            arena: None,
            caller: Some(CallerMem {
                alloc: a.clone(),
                ptr: p,
                kind,
                pages: Some(pages),
            }),
        };
        buf.fill(0, len, 0)?;
        Ok(buf)
    }

    /// Memory files and device mappings the driver holds for its own rings: (arena chunks,
    /// blocks in use).
    pub fn arena_usage(&self) -> (usize, usize) {
        let a = self.inner.arena.borrow();
        let live = a.chunks.iter().flatten();
        (live.clone().count(), live.map(|c| c.live).sum())
    }

    /// The device clock (simulated picoseconds on the emulator).
    pub fn clock_ps(&self) -> u64 {
        let lo = self.inner.port.read32(regs::CLOCK_LO) as u64;
        let hi = self.inner.port.read32(regs::CLOCK_HI) as u64;
        hi << 32 | lo
    }

    /// Waits up to `timeout` of wall time for the device's interrupt (MSI-X vector 0: an
    /// event queue entry, or an event of an armed CQ) and clears it: `Ok(true)` when it
    /// fired, `Ok(false)` on timeout. [`Error::NoInterrupt`] on a port without interrupts
    /// (the in-process emulator, driven by polling).
    pub fn wait_interrupt(&self, timeout: std::time::Duration) -> Result<bool, Error> {
        let fd = self.inner.port.interrupt_fd(0).ok_or(Error::NoInterrupt)?;
        if !crate::vfio::wait_readable(fd, timeout).map_err(|e| Error::Interrupt(e.to_string()))? {
            return Ok(false);
        }
        let mut count = [0u8; 8];
        // Clears the eventfd counter (a non-blocking read; another waiter may have won).
        let _ = nix::unistd::read(fd.as_raw_fd(), &mut count);
        Ok(true)
    }

    /// Lets the device make progress once (see [`Port::progress`]).
    pub fn progress(&self) -> bool {
        self.inner.port.progress()
    }

    /// The port counters (frames, drops, ICRC errors, NAKs sent, ...).
    pub fn port_stats(&self) -> Result<PortStats, Error> {
        let out = self.inner.command(CmdOpcode::QueryPortStats, &[])?;
        Ok(PortStats::decode(&out))
    }

    /// Reads the next asynchronous event, if one is waiting.
    pub fn poll_event(&self) -> Option<AsyncEvent> {
        if let Some(e) = self.inner.events.borrow_mut().pop_front() {
            return Some(e);
        }
        loop {
            match self.inner.read_eqe()? {
                Some(e) => return Some(e),
                None => continue,
            }
        }
    }

    /// Testing hook: runs a command with any opcode and input bytes (at most 112 are used)
    /// and returns its output parameters. A refusal is [`Error::Command`] for opcodes this
    /// driver knows and [`Error::RawCommand`] for others. Conformance suites use it to send
    /// the device malformed commands the typed API cannot express; not for applications.
    #[doc(hidden)]
    pub fn raw_command(&self, opcode: u16, input: &[u8]) -> Result<[u8; cmd::PARAMS_SIZE], Error> {
        if let Some(op) = CmdOpcode::from_u16(opcode) {
            return self.inner.command(op, input);
        }
        self.inner
            .run_command(opcode, input)?
            .map_err(|status| Error::RawCommand { opcode, status })
    }

    /// Whether `other` is a handle to this same open device.
    pub fn same_as(&self, other: &Device) -> bool {
        Rc::ptr_eq(&self.inner, &other.inner)
    }

    /// The port (for tools that poke registers directly).
    pub fn port(&self) -> &dyn Port {
        &*self.inner.port
    }
}

/// The memory file of memory the driver made ([`DmaMemory::new`]).
fn file_of(mem: &DmaMemory) -> Result<std::os::fd::BorrowedFd<'_>, Error> {
    mem.fd()
        .ok_or_else(|| Error::Memory("no memory file: the caller's memory".into()))
}

/// The alignment rings are asked of a [`QueueAllocator`] (a page, as rdma-core's providers
/// ask; the device needs 64 bytes).
pub(crate) const RING_ALIGN: usize = 4096;

/// What memory a [`QueueAllocator`] is asked for (`ibv_alloc_parent_domain(3)`'s resource
/// types).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueMem {
    /// A QP's send or receive ring.
    Qp,
    /// A CQ's ring.
    Cq,
    /// An SRQ's ring.
    Srq,
    /// A queue's doorbell record.
    Doorbell,
}

/// Memory for queues from the caller: a parent domain's allocator
/// (`ibv_alloc_parent_domain(3)`), used through [`ProtectionDomain::with_allocator`].
///
/// # Safety
///
/// Memory that `alloc` returns is memory of this process that the implementor owns: `size`
/// bytes, mapped readable and writable (private anonymous or heap memory, not a shared
/// mapping of a file) and not used for anything else until the driver gives it back
/// through `free`. The driver adopts its pages for the device in place, as
/// [`ProtectionDomain::reg_user_mr`] does (the same limitations).
pub unsafe trait QueueAllocator {
    /// `size` bytes aligned to `align` (a power of two) for `kind`.
    fn alloc(&self, size: usize, align: usize, kind: QueueMem) -> Allocated;
    /// Takes back memory `alloc` gave.
    fn free(&self, ptr: NonNull<u8>, kind: QueueMem);
}

/// What a [`QueueAllocator`] gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocated {
    /// Memory at this address.
    At(NonNull<u8>),
    /// Nothing: the driver should use its own memory (`IBV_ALLOCATOR_USE_DEFAULT`).
    UseDefault,
    /// Nothing to give (a NULL return): the queue is not made.
    Failed,
}

/// A shared [`QueueAllocator`].
#[derive(Clone)]
pub struct QueueAlloc(pub Rc<dyn QueueAllocator>);

impl std::fmt::Debug for QueueAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QueueAlloc")
    }
}

/// The caller's memory under a [`DmaBuffer`]: given back on drop, after the device's
/// mapping of its pages (`pages`) is released.
#[derive(Debug)]
struct CallerMem {
    alloc: QueueAlloc,
    ptr: NonNull<u8>,
    kind: QueueMem,
    pages: Option<crate::hostmem::AdoptedPages>,
}

/// DMA memory mapped for this device at [`DmaBuffer::iova`]; unmapped on drop.
#[derive(Debug)]
pub struct DmaBuffer {
    dev: Device,
    mem: DmaMemory,
    iova: u64,
    /// An arena block: (chunk, size class).
    arena: Option<(u32, u32)>,
    /// The caller's memory (a parent domain's allocator), adopted.
    caller: Option<CallerMem>,
}

impl DmaBuffer {
    /// The device address of byte 0.
    pub fn iova(&self) -> u64 {
        self.iova
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mem.len()
    }
    /// Whether the buffer is empty (never).
    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }
    /// Copies `data` in at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), Error> {
        self.mem.write(offset, data)
    }
    /// Copies bytes at `offset` out.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), Error> {
        self.mem.read(offset, out)
    }
    /// Fills a range with one byte.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<(), Error> {
        self.mem.fill(offset, len, byte)
    }
    /// Reads the byte at `offset` with acquire ordering (to poll for data the device writes).
    pub fn load_acquire(&self, offset: usize) -> Result<u8, Error> {
        if offset >= self.mem.len() {
            return Err(Error::OutOfBounds {
                offset,
                len: 1,
                size: self.mem.len(),
            });
        }
        Ok(self.mem.load_acquire(offset))
    }
    pub(crate) fn mem(&self) -> &DmaMemory {
        &self.mem
    }
    /// Whether this buffer is mapped for `dev` (IOVAs are per device).
    pub(crate) fn belongs_to(&self, dev: &Device) -> bool {
        Rc::ptr_eq(&self.dev.inner, &dev.inner)
    }
    /// Reads a little-endian u64 at `offset`.
    pub fn read_u64(&self, offset: usize) -> Result<u64, Error> {
        let mut b = [0u8; 8];
        self.mem.read(offset, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
}

impl Drop for DmaBuffer {
    fn drop(&mut self) {
        if let Some(mut c) = self.caller.take() {
            // The device's mapping first, then the memory back to its owner.
            drop(c.pages.take());
            c.alloc.0.free(c.ptr, c.kind);
            return;
        }
        match self.arena {
            Some((chunk, class)) => self
                .dev
                .inner
                .arena_free(chunk, class, self.mem.file_offset()),
            None => {
                let _ = self
                    .dev
                    .inner
                    .port
                    .dma_unmap(self.iova, self.mem.len() as u64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::BorrowedFd;
    use std::time::Duration;

    /// A device that completes every command with status OK and zero outputs (the mailbox is
    /// never written) until `hang` is set; then it stays busy, though every register still
    /// answers.
    #[derive(Default)]
    struct Hanging {
        hang: Rc<Cell<bool>>,
        token: Cell<u32>,
        status_reads: Rc<Cell<u64>>,
    }

    impl Port for Hanging {
        fn read32(&self, offset: u64) -> u32 {
            match offset {
                regs::MAGIC => regs::MAGIC_VALUE,
                regs::ABI_VERSION => ringbell_specs::ABI_VERSION,
                regs::CMD_STATUS => {
                    self.status_reads.set(self.status_reads.get() + 1);
                    if self.hang.get() {
                        regs::CMD_STATUS_BUSY
                    } else {
                        self.token.get()
                    }
                }
                _ => 0,
            }
        }
        fn write32(&self, offset: u64, value: u32) {
            if offset == regs::CMD_DOORBELL {
                self.token.set(value);
            }
        }
        fn dma_map(&self, _: BorrowedFd<'_>, _: u64, _: u64) -> Result<(), PortError> {
            Ok(())
        }
        fn dma_unmap(&self, _: u64, _: u64) -> Result<(), PortError> {
            Ok(())
        }
        fn progress(&self) -> bool {
            true
        }
    }

    use crate::port::PortError;

    #[test]
    fn arena_blocks_are_sized_aligned_reused_zeroed_and_chunks_released() {
        let dev = Device::open_with(Box::new(Hanging::default()), Duration::from_secs(1)).unwrap();
        let a = dev.alloc_ring(100).unwrap();
        assert_eq!(a.len(), 128, "a power of two, at least 64");
        assert_eq!(a.iova() % 128, 0);
        assert_eq!(dev.alloc_ring(1).unwrap().len(), 64);
        let big = dev.alloc_ring(512 << 10).unwrap();
        assert_eq!(big.len(), 512 << 10, "above 256 KiB: memory of its own");
        assert_eq!(
            dev.arena_usage().1,
            1,
            "the 64-byte block went back when dropped"
        );
        a.write(0, &[0xAB; 128]).unwrap();
        let iova = a.iova();
        drop(a);
        let b = dev.alloc_ring(120).unwrap();
        assert_eq!(b.iova(), iova, "the freed block is reused");
        assert_eq!(b.read_u64(0).unwrap(), 0, "and handed out zeroed");
        assert_eq!(b.read_u64(120).unwrap(), 0);
        // Fill more than a chunk with 64 KiB blocks, then free them all: only the chunk new
        // blocks come from stays.
        let many: Vec<_> = (0..40).map(|_| dev.alloc_ring(64 << 10).unwrap()).collect();
        let (chunks, live) = dev.arena_usage();
        assert!(chunks >= 3, "{chunks}");
        assert_eq!(live, 41);
        assert!(many.windows(2).all(|w| w[0].iova() != w[1].iova()));
        drop(many);
        drop(b);
        assert_eq!(dev.arena_usage(), (1, 0));
        drop(big);
    }

    #[test]
    fn a_command_that_never_completes_times_out_and_later_ones_fail_at_once() {
        let port = Hanging::default();
        let (hang, reads) = (port.hang.clone(), port.status_reads.clone());
        let dev = Device::open_with(Box::new(port), Duration::from_millis(50)).unwrap();
        assert_eq!(dev.command_timeout(), Duration::from_millis(50));
        assert!(dev.alloc_pd().is_ok());
        assert!(dev.lost().is_none());
        hang.set(true);
        match dev.alloc_pd() {
            Err(Error::CommandTimeout { opcode, waited }) => {
                assert_eq!(opcode, CmdOpcode::AllocPd as u16);
                assert!(waited >= Duration::from_millis(50), "{waited:?}");
            }
            other => panic!("{other:?}"),
        }
        // The device is lost: the next command does not touch it.
        let before = reads.get();
        assert!(matches!(dev.alloc_pd(), Err(Error::DeviceLost(_))));
        assert!(matches!(dev.port_stats(), Err(Error::DeviceLost(_))));
        assert_eq!(reads.get(), before, "a lost device was asked again");
        assert!(dev.lost().unwrap().contains("did not complete"));
    }

    #[test]
    fn the_first_command_times_out_too() {
        let port = Hanging::default();
        port.hang.set(true);
        let r = Device::open_with(Box::new(port), Duration::from_millis(20));
        assert!(matches!(r, Err(Error::CommandTimeout { .. })), "{r:?}");
    }

    /// A port whose connection has failed.
    struct Broken;

    impl Port for Broken {
        fn read32(&self, _: u64) -> u32 {
            u32::MAX
        }
        fn write32(&self, _: u64, _: u32) {}
        fn dma_map(&self, _: BorrowedFd<'_>, _: u64, _: u64) -> Result<(), PortError> {
            Err(PortError::MapFailed("gone".into()))
        }
        fn dma_unmap(&self, _: u64, _: u64) -> Result<(), PortError> {
            Ok(())
        }
        fn progress(&self) -> bool {
            false
        }
        fn failure(&self) -> Option<String> {
            Some("the server closed the connection".into())
        }
    }

    #[test]
    fn a_port_that_has_failed_is_a_lost_device() {
        let r = Device::open(Box::new(Broken));
        match r {
            Err(Error::DeviceLost(why)) => assert!(why.contains("closed"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
