//! Multi-receive buffers (`FI_MULTI_RECV`, fi_msg(3)): one buffer posted for untagged
//! receives that takes message after message, each placed right after the one before,
//! until less than the endpoint's `FI_OPT_MIN_MULTI_RECV` bytes are left; the completion
//! of the message that leaves it so carries `FI_MULTI_RECV`, and the provider has then let
//! go of the buffer.
//!
//! The NIC's receive queue (the endpoint's SRQ) takes whole receives in order, and a
//! message's length is known only once it has arrived. So a multi-receive buffer is one
//! receive WQE over the part still free (with the domain's overflow after it, as every
//! untagged receive has), and when a message has landed in it the provider posts the next
//! WQE over what is left. Receives are matched in the order they were posted: while a
//! multi-receive buffer's WQE is on the SRQ, receives posted after it (single ones and
//! other multi-receive buffers) wait in the provider, and go to the SRQ in their order
//! once the buffer is released. A message arriving between one WQE's completion and the
//! next one's posting (the provider posts it at the next progress call) finds no receive
//! and is retried by its sender (an RNR NAK, retried without limit), as on a verbs device.

use super::{msg_entry, Errno, Op, OpKind, State, EAGAIN};
use crate::abi;
use ringbell::{RecvWr, Sge, WcOpcode, WcStatus, WorkCompletion};

/// The default of `FI_OPT_MIN_MULTI_RECV`: a buffer with fewer bytes free is released.
pub const MIN_MULTI_RECV: u64 = 64;

/// Most receives waiting in the provider behind a multi-receive buffer (the SRQ's depth):
/// more are `-FI_EAGAIN`.
const HELD_MAX: usize = 1024;

/// A multi-receive buffer: where it is and how much of it messages have taken.
#[derive(Clone, Copy, Debug)]
pub(super) struct MultiRecv {
    /// The buffer's SGE, whole (its address is the application's: what completions report).
    sge: Sge,
    /// Bytes taken by the messages so far.
    used: u64,
    /// Released when fewer than this many bytes are left.
    min: u64,
}

impl MultiRecv {
    pub(super) fn new(sge: Sge, min: u64) -> MultiRecv {
        MultiRecv { sge, used: 0, min }
    }

    /// Bytes still free.
    fn left(&self) -> u64 {
        u64::from(self.sge.len) - self.used
    }

    /// The SGE of the free part.
    pub(super) fn free_sge(&self) -> Sge {
        Sge {
            addr: self.sge.addr + self.used,
            len: self.left() as u32,
            lkey: self.sge.lkey,
        }
    }
}

/// A receive posted behind a multi-receive buffer, waiting its turn: its SGEs (the overflow
/// included) and its operation.
pub(super) struct Held {
    sges: Vec<Sge>,
    op: Op,
}

impl State {
    /// Posts receive `op` over `sges` to endpoint `ep`'s SRQ, or holds it while a
    /// multi-receive buffer posted before it is in use.
    pub(super) fn rx_post(&mut self, ep: usize, sges: Vec<Sge>, op: Op) -> Result<(), Errno> {
        let e = self.ep_mut(ep)?;
        if e.multi_posted || !e.rx_held.is_empty() {
            if e.rx_held.len() >= HELD_MAX {
                return Err(EAGAIN);
            }
            e.rx_held.push_back(Held { sges, op });
            return Ok(());
        }
        self.rx_post_now(ep, sges, op).map_err(|(e, _)| e)
    }

    /// Posts `op` to the SRQ now; on failure gives it back.
    fn rx_post_now(&mut self, ep: usize, sges: Vec<Sge>, op: Op) -> Result<(), (Errno, Box<Held>)> {
        let Ok(e) = self.ep_mut(ep) else {
            return Err((abi::FI_EOPBADSTATE, Box::new(Held { sges, op })));
        };
        let wr_id = e.next_wr;
        let Some(srq) = e.srq.as_mut() else {
            return Err((abi::FI_EOPBADSTATE, Box::new(Held { sges, op })));
        };
        if srq.post_recv(&[RecvWr { wr_id, sgl: &sges }]).is_err() {
            return Err((EAGAIN, Box::new(Held { sges, op })));
        }
        e.next_wr += 1;
        if matches!(op.kind, OpKind::Multi(_)) {
            e.multi_posted = true;
        }
        e.ops.insert(wr_id, op);
        Ok(())
    }

    /// Posts the receives held behind a released multi-receive buffer, in order, up to and
    /// including the next multi-receive buffer; what the SRQ cannot take now waits for the
    /// next progress call.
    pub(super) fn rx_drain(&mut self, ep: usize) {
        loop {
            let held = match self.ep_mut(ep) {
                Ok(e) if !e.multi_posted => e.rx_held.pop_front(),
                _ => None,
            };
            let Some(h) = held else { return };
            if let Err((_, h)) = self.rx_post_now(ep, h.sges, h.op) {
                if let Ok(e) = self.ep_mut(ep) {
                    e.rx_held.push_front(*h);
                }
                return;
            }
        }
    }

    /// A multi-receive buffer's WQE completed: the message's completion (with
    /// `FI_MULTI_RECV` when the buffer is released), then the next WQE over what is left,
    /// or the receives held behind it.
    pub(super) fn on_multi_wc(
        &mut self,
        ep: usize,
        mut op: Op,
        mut m: MultiRecv,
        w: &WorkCompletion,
    ) {
        let Ok(e) = self.ep_mut(ep) else { return };
        let (rxcq, sink) = (e.rxcq, e.sink);
        let ok = w.status == WcStatus::Success;
        let remote_write = ok && w.opcode == WcOpcode::RecvRdmaWithImm;
        let mut flags = abi::FI_RECV as u64 | abi::FI_MSG as u64;
        let (len, cut, at) = if remote_write {
            // fi_writedata's remote CQ data consumed the WQE; the buffer took nothing.
            flags =
                abi::FI_RMA as u64 | abi::FI_REMOTE_WRITE as u64 | abi::FI_REMOTE_CQ_DATA as u64;
            (0, 0, 0)
        } else if ok {
            let received = u64::from(w.byte_len);
            let cut = received.saturating_sub(m.left());
            let at = m.sge.addr + m.used;
            m.used += received - cut;
            if w.imm.is_some() {
                flags |= abi::FI_REMOTE_CQ_DATA as u64;
            }
            (received - cut, cut, at)
        } else {
            (0, 0, 0)
        };
        // A failed WQE, a truncated message (nothing more fits) or too little room left (none
        // at all, with a minimum of 0): the buffer is released.
        let released = !ok || cut > 0 || m.left() < m.min.max(1);
        if released && !remote_write {
            flags |= abi::FI_MULTI_RECV as u64;
        }
        self.count(ep, flags, ok && cut == 0);
        if !ok || cut > 0 || op.report || released {
            let mut en = msg_entry(op.ctx, flags, (len, at), cut, w);
            if !remote_write {
                en.src = self.conn_source(ep, w.qpn);
            }
            self.push(rxcq, en);
        }
        if let Ok(e) = self.ep_mut(ep) {
            e.multi_posted = false;
        }
        match (released, sink) {
            (false, Some(sink)) => {
                let sges = vec![m.free_sge(), sink];
                op.kind = OpKind::Multi(m);
                // Every receive posted before it has been taken (the SRQ is FIFO) and the
                // ones after it are held: the free part goes first again (or first among
                // the held ones, for the next progress, if the SRQ cannot take it now).
                if let Err((_, h)) = self.rx_post_now(ep, sges, op) {
                    if let Ok(e) = self.ep_mut(ep) {
                        e.rx_held.push_front(*h);
                    }
                }
            }
            _ => self.rx_drain(ep),
        }
    }
}
