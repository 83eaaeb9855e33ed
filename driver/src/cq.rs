//! Completion queues and work completions.

use crate::device::{DevInner, Device, DmaBuffer, QueueAlloc, QueueMem, RING_ALIGN};
use crate::error::Error;
use crate::mr::ProtectionDomain;
use ringbell_specs::cmd::{
    CmdOpcode, CreateCqIn, ObjectIn, QueryCqOut, ResizeCqIn, CQ_FLAG_ARMED, CQ_FLAG_OVERFLOW,
};
use ringbell_specs::cqe::{self, owner_bit, Cqe, CqeOpcode, CqeStatus, CQE_SIZE};
use ringbell_specs::regs;
use std::rc::Rc;
use zerocopy::{FromBytes, FromZeros, IntoBytes};

/// Completion status (the libibverbs values).
pub type WcStatus = CqeStatus;
/// Completion opcode (the libibverbs values).
pub type WcOpcode = CqeOpcode;

/// One work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's id.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// Bytes received (receive side) or transferred.
    pub byte_len: u32,
    /// The local QP.
    pub qpn: u32,
    /// Immediate data, when the message carried some.
    pub imm: Option<u32>,
    /// The key of the memory window a received SEND with invalidate unbound (ABI 1.9).
    pub invalidated: Option<u32>,
    /// The message had the solicited-event bit.
    pub solicited: bool,
    /// Device timestamp of the CQE write in picoseconds (simulated time on the emulator).
    pub timestamp_ps: u64,
    /// Device detail for error completions.
    pub vendor_syndrome: u8,
    /// Tag matching: the TMH tag of a matched message (0 otherwise).
    pub tag: u64,
    /// Tag matching: the TMH app_ctx of a matched message (0 otherwise).
    pub app_ctx: u32,
    /// Tag matching: the message matched a tagged buffer.
    pub tm_match: bool,
    /// Tag matching: the tagged buffer holds the data.
    pub tm_data_valid: bool,
    /// Tag matching: the device asks software to report its unexpected count.
    pub tm_sync_req: bool,
    /// Tag matching: the device's count of unexpected messages when it wrote this.
    pub tm_hw_count: u16,
    /// The completion of a triggered transfer: its handle (`wr_id` is the one it was
    /// posted with).
    pub trigger: Option<crate::TriggerHandle>,
    /// A datagram received on a UD QP: who sent it. The first 40 bytes of the receive
    /// buffer then hold the GRH area, and `byte_len` counts them.
    pub source: Option<crate::UdSource>,
}

impl Default for WorkCompletion {
    fn default() -> Self {
        WorkCompletion {
            wr_id: 0,
            status: CqeStatus::Success,
            opcode: CqeOpcode::Send,
            byte_len: 0,
            qpn: 0,
            imm: None,
            invalidated: None,
            solicited: false,
            timestamp_ps: 0,
            vendor_syndrome: 0,
            tag: 0,
            app_ctx: 0,
            tm_match: false,
            tm_data_valid: false,
            tm_sync_req: false,
            tm_hw_count: 0,
            trigger: None,
            source: None,
        }
    }
}

/// A CQ's state as the device reports it (QUERY_CQ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CqAttr {
    /// Number of entries.
    pub entries: u32,
    /// The device's producer index (CQEs written).
    pub pi: u32,
    /// The consumer index the device last saw.
    pub ci: u32,
    /// A completion event is armed.
    pub armed: bool,
    /// A CQE was lost because the ring was full; the CQ is in error.
    pub overflow: bool,
}

/// The device object behind a CQ and its memory. QPs that report to the CQ hold it too, so
/// the CQ is destroyed (and its ring unmapped) only after the last of them.
#[derive(Debug)]
pub(crate) struct CqObject {
    dev: Device,
    cqn: u32,
    /// The ring the device writes (another one after a resize).
    ring: std::cell::RefCell<DmaBuffer>,
    db: DmaBuffer,
    /// Where its rings come from (a parent domain's allocator).
    alloc: Option<QueueAlloc>,
}

impl Drop for CqObject {
    fn drop(&mut self) {
        let _ = self.dev.inner.destroy(CmdOpcode::DestroyCq, self.cqn);
    }
}

/// A completion queue.
#[derive(Debug)]
pub struct CompletionQueue {
    obj: Rc<CqObject>,
    log: u8,
    ci: u32,
}

impl Device {
    /// Creates a CQ with at least `entries` entries (rounded up to a power of two).
    pub fn create_cq(&self, entries: u32) -> Result<CompletionQueue, Error> {
        self.create_cq_in(entries, None)
    }

    /// [`Device::create_cq`] for a parent domain (`ibv_create_cq_ex` with
    /// `IBV_CQ_INIT_ATTR_MASK_PD`): the ring and doorbell record (and the rings of later
    /// resizes) come from `pd`'s allocator, if it has one.
    pub fn create_cq_in(
        &self,
        entries: u32,
        pd: Option<&ProtectionDomain>,
    ) -> Result<CompletionQueue, Error> {
        if entries == 0 || entries > self.caps().max_cqe {
            return Err(Error::InvalidArgument("CQ size is 0 or beyond max_cqe"));
        }
        if pd.is_some_and(|p| !p.dev.same_as(self)) {
            return Err(Error::InvalidArgument("a PD of another device"));
        }
        let alloc = pd.and_then(|p| p.alloc.clone());
        let log = entries.next_power_of_two().trailing_zeros() as u8;
        let log = log.max(1);
        let len = (1usize << log) * CQE_SIZE;
        let ring = self.alloc_queue_mem(len, RING_ALIGN, QueueMem::Cq, alloc.as_ref())?;
        let db = self.alloc_queue_mem(64, 64, QueueMem::Doorbell, alloc.as_ref())?;
        let input = CreateCqIn {
            log_size: log,
            ring_iova: ring.iova().into(),
            db_iova: db.iova().into(),
            ..Default::default()
        };
        let cqn = self.inner.create(CmdOpcode::CreateCq, input.as_bytes())?;
        Ok(CompletionQueue {
            obj: Rc::new(CqObject {
                dev: self.clone(),
                cqn,
                ring: std::cell::RefCell::new(ring),
                db,
                alloc,
            }),
            log,
            ci: 0,
        })
    }
}

impl CompletionQueue {
    /// The CQ number.
    pub fn cqn(&self) -> u32 {
        self.obj.cqn
    }

    /// Number of entries.
    pub fn capacity(&self) -> u32 {
        1 << self.log
    }

    /// A handle that keeps the CQ alive (held by the QPs that use it).
    pub(crate) fn keepalive(&self) -> Rc<CqObject> {
        self.obj.clone()
    }

    fn inner(&self) -> &Rc<DevInner> {
        &self.obj.dev.inner
    }

    /// Whether this CQ lives on `dev` (CQ numbers are per device).
    pub(crate) fn belongs_to(&self, dev: &Device) -> bool {
        Rc::ptr_eq(&self.obj.dev.inner, &dev.inner)
    }

    /// Reads the CQ's state from the device, including whether it overflowed.
    pub fn query(&self) -> Result<CqAttr, Error> {
        let out = self.inner().command(
            CmdOpcode::QueryCq,
            ObjectIn {
                num: self.obj.cqn.into(),
            }
            .as_bytes(),
        )?;
        let q = QueryCqOut::read_from_prefix(&out)
            .map(|(q, _)| q)
            .unwrap_or_default();
        Ok(CqAttr {
            entries: 1u32 << q.log_size.min(31),
            pi: q.pi.get(),
            ci: q.ci.get(),
            armed: q.flags & CQ_FLAG_ARMED != 0,
            overflow: q.flags & CQ_FLAG_OVERFLOW != 0,
        })
    }

    /// Reads completions into `out` and returns how many. When none is ready, the device is
    /// given one chance to progress (on the emulator: one simulation step) and the CQ is
    /// checked once more. Allocates nothing.
    pub fn poll(&mut self, out: &mut [WorkCompletion]) -> usize {
        let mut n = self.poll_ready(out);
        if n == 0 && !out.is_empty() {
            self.obj.dev.inner.port.progress();
            n = self.poll_ready(out);
        }
        n
    }

    /// Whether the CQ's device runs in lockstep with its caller ([`crate::Port::lockstep`]):
    /// a poll that finds nothing must give it its turn, or it never moves.
    pub fn lockstep(&self) -> bool {
        self.obj.dev.inner.port.lockstep()
    }

    /// Reads completions that are already in the ring, without progressing the device.
    pub fn poll_ready(&mut self, out: &mut [WorkCompletion]) -> usize {
        let mut n = 0;
        let mut consumed = false;
        let ring = self.obj.ring.borrow();
        while n < out.len() {
            let slot = (self.ci & ((1 << self.log) - 1)) as usize * CQE_SIZE;
            // Acquire on the owner byte orders the reads of the entry after it.
            if ring.mem().load_acquire(slot + CQE_SIZE - 1) != owner_bit(self.ci, self.log) {
                break;
            }
            // One copy, straight into the entry's type: copying into a byte array and then
            // into a `Cqe` made narrower stores that the field loads could not forward from.
            let mut c = Cqe::new_zeroed();
            if ring.read(slot, c.as_mut_bytes()).is_err() {
                break;
            }
            self.ci = self.ci.wrapping_add(1);
            consumed = true;
            // A completion for no live work request (a QP reset or destroyed since) is dropped.
            if let Some(wc) = self.translate(&c) {
                out[n] = wc;
                n += 1;
            }
        }
        if consumed {
            self.obj.db.mem().store_u32_release(0, self.ci);
            self.inner().port.write32(
                regs::CQ_DB_BASE + self.obj.cqn as u64 * regs::DB_STRIDE + regs::DB_CQ_CI,
                self.ci,
            );
        }
        n
    }

    /// Moves the CQ to a ring of at least `entries` entries (rounded up to a power of two,
    /// two at least; the same size is a no-op), keeping the completions not yet polled, in
    /// order: RESIZE_CQ (ABI 1.7). Refused: 0 or more than `max_cqe` entries
    /// ([`Error::InvalidArgument`]); fewer entries than completions waiting, or a CQ that
    /// overflowed ([`Error::Command`] `BAD_SIZE` / `BAD_STATE`); a device without
    /// `CAPS.RESIZE_CQ` answers `BAD_OPCODE`. On an error the CQ is as it was.
    pub fn resize(&mut self, entries: u32) -> Result<(), Error> {
        let dev = &self.obj.dev;
        if entries == 0 || entries > dev.caps().max_cqe {
            return Err(Error::InvalidArgument("CQ size is 0 or beyond max_cqe"));
        }
        let log = (entries.next_power_of_two().trailing_zeros() as u8).max(1);
        if log == self.log {
            return Ok(());
        }
        let len = (1usize << log) * CQE_SIZE;
        let ring = dev.alloc_queue_mem(len, RING_ALIGN, QueueMem::Cq, self.obj.alloc.as_ref())?;
        let input = ResizeCqIn {
            cqn: self.obj.cqn.into(),
            log_size: log,
            ci: self.ci.into(),
            ring_iova: ring.iova().into(),
            ..Default::default()
        };
        self.inner()
            .command(CmdOpcode::ResizeCq, input.as_bytes())?;
        // The device writes the new ring only from now on: the old one can go.
        drop(self.obj.ring.replace(ring));
        self.log = log;
        self.ci = 0;
        // The device cleared the record's consumer index as it switched (ABI 1.7); the
        // driver's own copy says the same.
        self.obj.db.mem().store_u32_release(0, 0);
        Ok(())
    }

    /// Requests a completion event for the next CQE (or the next solicited one).
    pub fn arm(&self, solicited_only: bool) {
        let v = self.ci
            | if solicited_only {
                regs::CQ_ARM_SOLICITED
            } else {
                0
            };
        self.inner().port.write32(
            regs::CQ_DB_BASE + self.obj.cqn as u64 * regs::DB_STRIDE + regs::DB_CQ_ARM,
            v,
        );
    }

    fn translate(&self, c: &Cqe) -> Option<WorkCompletion> {
        let opcode = CqeOpcode::from_u8(c.opcode).unwrap_or(CqeOpcode::Send);
        let status = CqeStatus::from_u8(c.status).unwrap_or(CqeStatus::GeneralErr);
        let qpn = c.qpn.get();
        let counter = c.wqe_counter.get();
        let tm = matches!(
            opcode,
            CqeOpcode::TmAdd
                | CqeOpcode::TmDel
                | CqeOpcode::TmSync
                | CqeOpcode::TmRecv
                | CqeOpcode::TmNoTag
        );
        let triggered = c.flags & cqe::CQE_FLAG_TRIGGERED != 0;
        let wr_id = if triggered {
            // Held by the device, not in the send queue's ring.
            c.tm_tag.get()
        } else if c.flags & cqe::CQE_FLAG_SRQ != 0 {
            self.inner()
                .srqs
                .borrow()
                .get(&c.srqn.get())?
                .complete(counter)?
        } else if tm {
            crate::tm::tm_completion(
                self.inner().srqs.borrow().get(&c.srqn.get())?,
                c,
                opcode,
                status,
            )?
        } else {
            let qps = self.inner().qps.borrow();
            let q = qps.get(&qpn)?;
            if q.before_reset(c.timestamp.get()) {
                return None;
            }
            if opcode.is_recv() {
                q.complete_recv(counter)?
            } else {
                q.complete_send(counter)?
            }
        };
        Some(WorkCompletion {
            wr_id,
            status,
            opcode,
            byte_len: c.byte_len.get(),
            qpn,
            imm: (c.flags & cqe::CQE_FLAG_IMM != 0).then(|| c.imm.get()),
            invalidated: (c.ext_flags & cqe::CQE_EXT_FLAG_INV != 0).then(|| c.imm.get()),
            solicited: c.flags & cqe::CQE_FLAG_SOLICITED != 0,
            timestamp_ps: c.timestamp.get(),
            vendor_syndrome: c.vendor_syndrome,
            tag: if triggered { 0 } else { c.tm_tag.get() },
            app_ctx: c.tm_app_ctx.get(),
            tm_match: c.flags & cqe::CQE_FLAG_TM_MATCH != 0,
            tm_data_valid: c.flags & cqe::CQE_FLAG_TM_DATA_VALID != 0,
            tm_sync_req: c.flags & cqe::CQE_FLAG_TM_SYNC_REQ != 0,
            tm_hw_count: if tm { c.tm_hw_cnt.get() } else { 0 },
            trigger: triggered.then(|| crate::TriggerHandle(c.tm_handle.get())),
            source: (c.flags & cqe::CQE_FLAG_UD != 0).then(|| crate::UdSource {
                qpn: c.ud_src_qpn(),
                mac: c.src_mac,
                ip: c.src_ip,
            }),
        })
    }
}
