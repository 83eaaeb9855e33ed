//! Completion queues: the ring, the owner bit, overflow detection and arming.

use crate::env::{trace, write_owned_entry, Env, Stage, TraceEvent};
use crate::nic::Nic;
use ringbell_specs::cmd::QpState;
use ringbell_specs::cqe::{owner_bit, Cqe, EventType, CQE_SIZE};
use ringbell_specs::regs;
use zerocopy::IntoBytes;

/// A completion queue.
#[derive(Debug)]
pub(crate) struct Cq {
    pub(crate) ring_iova: u64,
    pub(crate) db_iova: u64,
    pub(crate) log_size: u8,
    pub(crate) pi: u32,
    /// Last consumer index the driver reported (doorbell or record).
    pub(crate) ci: u32,
    pub(crate) armed: Option<bool>,
    pub(crate) overflow: bool,
    pub(crate) refs: u32,
    /// Context generation, see [`crate::NicEvent::CqeWrite`].
    pub(crate) gen: u64,
}

impl Nic {
    pub(crate) fn cq_doorbell(&mut self, env: &mut dyn Env, cqn: u32, which: u64, value: u32) {
        let Some(cq) = self.cqs.get_mut(cqn) else {
            self.doorbell_error(
                env,
                cqn,
                ringbell_specs::cqe::DoorbellError::NoSuchObject,
                value,
            );
            return;
        };
        match which {
            regs::DB_CQ_CI => {
                if value.wrapping_sub(cq.ci) as i32 >= 0 && cq.pi.wrapping_sub(value) as i32 >= 0 {
                    cq.ci = value;
                } else {
                    self.doorbell_error(
                        env,
                        cqn,
                        ringbell_specs::cqe::DoorbellError::IndexOutOfRange,
                        value,
                    );
                }
            }
            _ => {
                cq.armed = Some(value & regs::CQ_ARM_SOLICITED != 0);
                // Arming with completions already waiting fires at once: CQEs past the
                // later of the arm's CI and the CI last learned. A device that takes
                // doorbells from a page it polls (a served NIC) can see a CI the driver
                // wrote after this arm before the arm itself; the arm's CI is then behind,
                // and the CQEs past the newer CI still wait.
                let arm_ci = value & !regs::CQ_ARM_SOLICITED;
                let ci = if arm_ci.wrapping_sub(cq.ci) as i32 >= 0 {
                    arm_ci
                } else {
                    cq.ci
                };
                if value & regs::CQ_ARM_SOLICITED == 0 && cq.pi.wrapping_sub(ci) as i32 > 0 {
                    cq.armed = None;
                    self.post_event(env, EventType::Completion, 0, cqn, 0);
                }
            }
        }
    }

    /// Writes `cqe` to CQ `cqn`: owner bit last; overflow raises CQ_ERROR and loses the CQE.
    pub(crate) fn write_cqe(&mut self, env: &mut dyn Env, cqn: u32, mut cqe: Cqe) {
        let Some(cq) = self.cqs.get_mut(cqn) else {
            return;
        };
        if cq.overflow {
            return;
        }
        let size = 1u32 << cq.log_size;
        if cq.pi.wrapping_sub(cq.ci) >= size {
            // Re-read the consumer index record before declaring overflow.
            let mut rec = [0u8; 4];
            if env.dma_read(cq.db_iova, &mut rec).is_ok() {
                let ci = u32::from_le_bytes(rec);
                if cq.pi.wrapping_sub(ci) <= size {
                    cq.ci = ci;
                }
            }
        }
        if cq.pi.wrapping_sub(cq.ci) >= size {
            cq.overflow = true;
            self.post_event(env, EventType::CqError, 0, cqn, 0);
            // rc-transport.md §5.5 / §3.11 class G: the CQ is unusable from now on, so every
            // QP that reports to it goes to ERR (QP_FATAL: not tied to a WQE) rather than go
            // on working without completions. Their flush CQEs to this CQ are lost with it.
            let hit: Vec<u32> = self
                .qps
                .iter()
                .filter(|(_, q)| {
                    (q.send_cqn == cqn || q.recv_cqn == cqn)
                        && !matches!(q.state, QpState::Reset | QpState::Err)
                })
                .map(|(n, _)| n)
                .collect();
            for qpn in hit {
                self.post_event(env, EventType::QpFatal, 0, qpn, 0);
                self.flush_qp(env, qpn);
            }
            return;
        }
        let slot = cq
            .ring_iova
            .wrapping_add(((cq.pi & (size - 1)) as u64) * CQE_SIZE as u64);
        cqe.owner = owner_bit(cq.pi, cq.log_size);
        cqe.timestamp = env.now().ps().into();
        let solicited = cqe.flags & ringbell_specs::cqe::CQE_FLAG_SOLICITED != 0 || cqe.status != 0;
        if let Err(f) = write_owned_entry(env, slot, cqe.as_bytes()) {
            self.iommu_fault(env, cqe.qpn.get(), f.iova);
            return;
        }
        let Some(cq) = self.cqs.get_mut(cqn) else {
            return;
        };
        cq.pi = cq.pi.wrapping_add(1);
        self.stats.cqes += 1;
        let now = env.now();
        trace(env, || {
            TraceEvent::at(Stage::CqeWrite, now)
                .qpn(cqe.qpn.get())
                .obj(cqn)
                .psn(cqe.wqe_counter.get() as u32)
                .op(cqe.opcode)
                .status(cqe.status)
                .bytes(cqe.byte_len.get() as usize)
        });
        let fire = match cq.armed {
            Some(only_solicited) => !only_solicited || solicited,
            None => false,
        };
        if fire {
            cq.armed = None;
            self.post_event(env, EventType::Completion, 0, cqn, 0);
        }
    }
}
