//! Command execution: the mailbox is read, validated field by field and executed; every
//! failure is a status code, never a panic or an allocation sized by the guest.

use crate::cq::Cq;
use crate::env::{write_owned_entry, Env};
use crate::mem::{key_index, Mr, Pd};
use crate::nic::Nic;
use crate::qp::{check_modify, ModifyError, Qp, Srq, WorkQueue, XrcRole};
use ringbell_specs::cmd::*;
use ringbell_specs::cqe::{owner_bit, EventType, CQE_SIZE};
use zerocopy::{FromBytes, IntoBytes};

pub(crate) type Outcome = Result<Vec<u8>, CmdStatus>;

fn params<T: FromBytes>(input: &[u8]) -> Result<T, CmdStatus> {
    read_params(input).ok_or(CmdStatus::BadParam)
}

fn out<T: IntoBytes + zerocopy::Immutable>(v: &T) -> Outcome {
    Ok(v.as_bytes().to_vec())
}

/// Whether a ring of `len` bytes at `iova` stays below the top of the address space (slot
/// addresses never wrap into another mapping).
fn fits(iova: u64, len: u64) -> bool {
    iova.checked_add(len).is_some()
}

fn obj(num: u32) -> Outcome {
    out(&ObjectOut { num: num.into() })
}

impl Nic {
    pub(crate) fn exec_command(&mut self, env: &mut dyn Env) {
        let token = self.cmd_status & 0xFFFF;
        let mut mbox = [0u8; MAILBOX_SIZE];
        let mut want_event = false;
        let status = if !self.cmd_addr.is_multiple_of(256) {
            CmdStatus::BadParam
        } else if env.dma_read(self.cmd_addr, &mut mbox).is_err() {
            self.stats.iommu_faults += 1;
            CmdStatus::DmaFault
        } else {
            let hdr = CmdHeader::read_from_bytes(&mbox[..16]).unwrap_or_default();
            want_event = hdr.flags.get() & CMD_FLAG_EVENT != 0;
            let input = &mbox[IN_OFFSET..IN_OFFSET + PARAMS_SIZE];
            let r = match CmdOpcode::from_u16(hdr.opcode.get()) {
                None => Err(CmdStatus::BadOpcode),
                Some(op) => self.run(env, op, input),
            };
            let (status, output) = match r {
                Ok(o) => (CmdStatus::Ok, o),
                Err(s) => (s, Vec::new()),
            };
            let mut back = [0u8; MAILBOX_SIZE - RESULT_OFFSET];
            let res = ringbell_specs::cmd::CmdResult {
                status: status as u8,
                ..Default::default()
            };
            back[..16].copy_from_slice(res.as_bytes());
            let n = output.len().min(PARAMS_SIZE);
            back[16..16 + n].copy_from_slice(&output[..n]);
            if env
                .dma_write(self.cmd_addr + RESULT_OFFSET as u64, &back)
                .is_err()
            {
                self.stats.iommu_faults += 1;
                CmdStatus::DmaFault
            } else {
                status
            }
        };
        self.cmd_status = ((status as u32) << 16) | token;
        if want_event {
            self.post_event(env, EventType::CmdDone, status as u8, token, 0);
        }
    }

    fn run(&mut self, env: &mut dyn Env, op: CmdOpcode, input: &[u8]) -> Outcome {
        match op {
            CmdOpcode::QueryDevice => self.query_device(),
            CmdOpcode::QueryPortStats => {
                let mut out = vec![0u8; ringbell_specs::stats::PortStats::SIZE];
                self.stats.encode(&mut out);
                Ok(out)
            }
            CmdOpcode::QueryQpStats => {
                let n = params::<ObjectIn>(input)?.num.get();
                let qp = self.qps.get(n).ok_or(CmdStatus::BadResource)?;
                let mut out = vec![0u8; ringbell_specs::stats::QpStats::SIZE];
                qp.stats.encode(&mut out);
                Ok(out)
            }
            CmdOpcode::QueryQpUdStats => {
                let n = params::<ObjectIn>(input)?.num.get();
                let qp = self.qps.get(n).ok_or(CmdStatus::BadResource)?;
                let mut out = vec![0u8; ringbell_specs::stats::UdStats::SIZE];
                qp.ud_stats.encode(&mut out);
                Ok(out)
            }
            CmdOpcode::AllocPd => obj(self
                .pds
                .insert_with(|_| Pd::default())
                .ok_or(CmdStatus::Exhausted)?),
            CmdOpcode::FreePd => {
                let n = params::<ObjectIn>(input)?.num.get();
                match self.pds.get(n) {
                    None => Err(CmdStatus::BadResource),
                    Some(pd) if pd.refs > 0 => Err(CmdStatus::Busy),
                    Some(_) => {
                        self.pds.remove(n);
                        Ok(Vec::new())
                    }
                }
            }
            CmdOpcode::RegMr => self.reg_mr(params(input)?),
            CmdOpcode::ReregMr => self.rereg_mr(params(input)?),
            CmdOpcode::RegDmMr => self.reg_dm_mr(params(input)?),
            CmdOpcode::AllocXrcd => obj(self
                .xrcds
                .insert_with(|_| Pd::default())
                .ok_or(CmdStatus::Exhausted)?),
            CmdOpcode::DeallocXrcd => {
                let n = params::<ObjectIn>(input)?.num.get();
                match self.xrcds.get(n) {
                    None => Err(CmdStatus::BadResource),
                    Some(x) if x.refs > 0 => Err(CmdStatus::Busy),
                    Some(_) => {
                        self.xrcds.remove(n);
                        Ok(Vec::new())
                    }
                }
            }
            CmdOpcode::CreateXrcSrq => self.create_xrc_srq(params(input)?),
            CmdOpcode::CreateFlow => obj(self.create_flow(params(input)?)?),
            CmdOpcode::SetQpRss => self.set_qp_rss(env, params(input)?).map(|()| Vec::new()),
            CmdOpcode::CreateWq => self.create_wq(params(input)?),
            CmdOpcode::AttachMcast => self.attach_mcast(params(input)?).map(|()| Vec::new()),
            CmdOpcode::DetachMcast => self.detach_mcast(params(input)?).map(|()| Vec::new()),
            CmdOpcode::ModifyWq => self.modify_wq(params(input)?).map(|()| Vec::new()),
            CmdOpcode::DestroyFlow => self
                .destroy_flow(params::<ObjectIn>(input)?.num.get())
                .map(|()| Vec::new()),
            CmdOpcode::AllocMw => self.alloc_mw(params(input)?),
            CmdOpcode::DeallocMw => self.dealloc_mw(params::<ObjectIn>(input)?.num.get()),
            CmdOpcode::AllocDm => {
                let p: AllocDmIn = params(input)?;
                let (len, log_align) = (p.length.get(), p.log_align.get());
                if self.cfg.max_dm_size == 0 {
                    return Err(CmdStatus::BadOpcode);
                }
                if len == 0 || len > u64::from(self.cfg.max_dm_size) {
                    return Err(CmdStatus::BadSize);
                }
                if log_align > DM_MAX_LOG_ALIGN {
                    return Err(CmdStatus::BadParam);
                }
                // At least 4-byte aligned: the window is reached by 32-bit accesses.
                let align = 1u64 << log_align.max(2);
                let (num, offset) = self.dm.alloc(len, align).ok_or(CmdStatus::Exhausted)?;
                out(&AllocDmOut {
                    num: num.into(),
                    offset: offset.into(),
                    ..Default::default()
                })
            }
            CmdOpcode::FreeDm => {
                let n = params::<ObjectIn>(input)?.num.get();
                match self.dm.get(n) {
                    None => Err(CmdStatus::BadResource),
                    Some(a) if a.refs > 0 => Err(CmdStatus::Busy),
                    Some(_) => {
                        self.dm.free(n);
                        Ok(Vec::new())
                    }
                }
            }
            CmdOpcode::DeregMr => {
                let key = params::<ObjectIn>(input)?.num.get();
                let idx = key_index(key);
                match self.mrs.get(idx) {
                    // Memory windows are bound to it (ABI 1.9).
                    Some(mr) if mr.key == key && mr.mw_refs > 0 => Err(CmdStatus::Busy),
                    Some(mr) if mr.key == key => {
                        let pdn = mr.pdn;
                        let cntrs = mr.cntrs;
                        if let Some(a) = self.dm.get_mut(mr.dm) {
                            a.refs = a.refs.saturating_sub(1);
                        }
                        self.mrs.remove(idx);
                        self.unbind_all(&cntrs);
                        self.pd_unref(pdn);
                        Ok(Vec::new())
                    }
                    _ => Err(CmdStatus::BadResource),
                }
            }
            CmdOpcode::CreateCq => self.create_cq(params(input)?),
            CmdOpcode::ResizeCq => self.resize_cq(env, params(input)?),
            CmdOpcode::QueryCq => {
                let n = params::<ObjectIn>(input)?.num.get();
                let cq = self.cqs.get(n).ok_or(CmdStatus::BadResource)?;
                let mut flags = 0;
                if cq.armed.is_some() {
                    flags |= CQ_FLAG_ARMED;
                }
                if cq.overflow {
                    flags |= CQ_FLAG_OVERFLOW;
                }
                out(&QueryCqOut {
                    log_size: cq.log_size,
                    flags,
                    pi: cq.pi.into(),
                    ci: cq.ci.into(),
                    ..Default::default()
                })
            }
            CmdOpcode::DestroyCq => {
                let n = params::<ObjectIn>(input)?.num.get();
                match self.cqs.get(n) {
                    None => Err(CmdStatus::BadResource),
                    Some(cq) if cq.refs > 0 => Err(CmdStatus::Busy),
                    Some(_) => {
                        self.cqs.remove(n);
                        Ok(Vec::new())
                    }
                }
            }
            CmdOpcode::CreateQp => self.create_qp(params(input)?),
            CmdOpcode::ModifyQp => {
                let m: ModifyQpIn = params(input)?;
                let qpn = m.qpn.get();
                let qp = self.qps.get(qpn).ok_or(CmdStatus::BadResource)?;
                let mask = QpAttrMask::from_bits(m.attr_mask.get()).ok_or(CmdStatus::BadParam)?;
                let to =
                    check_modify(qp, mask, &m.attr, self.cfg.max_rd_atomic).map_err(
                        |e| match e {
                            ModifyError::BadParam => CmdStatus::BadParam,
                            ModifyError::BadState => CmdStatus::BadState,
                        },
                    )?;
                self.apply_modify(env, qpn, mask, &m.attr, to);
                Ok(Vec::new())
            }
            CmdOpcode::QueryQp => {
                let n = params::<ObjectIn>(input)?.num.get();
                let qp = self.qps.get(n).ok_or(CmdStatus::BadResource)?;
                let mut a = qp.attr;
                a.state = qp.state as u8;
                a.sq_draining = (qp.state == QpState::Sqd && !qp.req.outstanding.is_empty()) as u8;
                out(&a)
            }
            CmdOpcode::DestroyQp => {
                let n = params::<ObjectIn>(input)?.num.get();
                // Flow-steering rules hold their QP, as Linux's do (EBUSY).
                if self.qps.get(n).is_some_and(|qp| qp.flows > 0) {
                    return Err(CmdStatus::Busy);
                }
                let mut qp = self.qps.remove(n).ok_or(CmdStatus::BadResource)?;
                self.release_rss(&mut qp);
                self.release_srq_wqe(env, &mut qp);
                self.unbind_all(&qp.cntrs);
                self.trig_discard_qp(n);
                self.unbind_qp_windows(n);
                if let Some(XrcRole::Tgt { xrcdn }) = qp.xrc {
                    // A target holds its XRC domain only: the PD, SRQ and CQ it last
                    // used were each request's.
                    if let Some(x) = self.xrcds.get_mut(xrcdn) {
                        x.refs = x.refs.saturating_sub(1);
                    }
                    return Ok(Vec::new());
                }
                self.pd_unref(qp.pdn);
                for c in [qp.send_cqn, qp.recv_cqn] {
                    if let Some(cq) = self.cqs.get_mut(c) {
                        cq.refs = cq.refs.saturating_sub(1);
                    }
                }
                if let Some(srq) = self.srqs.get_mut(qp.srqn) {
                    srq.refs = srq.refs.saturating_sub(1);
                }
                Ok(Vec::new())
            }
            CmdOpcode::CreateSrq => self.create_srq(params(input)?, None, None),
            CmdOpcode::CreateTmSrq => self.create_tm_srq(params(input)?),
            CmdOpcode::CreateCntr
            | CmdOpcode::DestroyCntr
            | CmdOpcode::UpdateCntr
            | CmdOpcode::QueryCntr
            | CmdOpcode::BindCntr
            | CmdOpcode::ArmCntr
            | CmdOpcode::PostTriggered
            | CmdOpcode::CancelTriggered
            | CmdOpcode::FlushTriggered => self.cntr_command(env, op, input),
            CmdOpcode::ArmSrq => {
                let a: ArmSrqIn = params(input)?;
                let srq = self
                    .srqs
                    .get_mut(a.srqn.get())
                    .ok_or(CmdStatus::BadResource)?;
                if a.limit.get() > srq.wq.size() {
                    return Err(CmdStatus::BadParam);
                }
                srq.limit = a.limit.get();
                Ok(Vec::new())
            }
            CmdOpcode::DestroySrq => {
                let n = params::<ObjectIn>(input)?.num.get();
                match self.srqs.get(n) {
                    None => Err(CmdStatus::BadResource),
                    Some(s) if s.refs > 0 => Err(CmdStatus::Busy),
                    Some(s) => {
                        let pdn = s.pdn;
                        let tm_cq = s.tm.as_ref().map(|t| t.cqn);
                        let xrc = s.xrc;
                        self.srqs.remove(n);
                        self.pd_unref(pdn);
                        let own_cq = tm_cq.or(xrc.map(|(_, c)| c));
                        if let Some(cq) = own_cq.and_then(|c| self.cqs.get_mut(c)) {
                            cq.refs = cq.refs.saturating_sub(1);
                        }
                        if let Some(x) = xrc.and_then(|(x, _)| self.xrcds.get_mut(x)) {
                            x.refs = x.refs.saturating_sub(1);
                        }
                        Ok(Vec::new())
                    }
                }
            }
        }
    }

    fn pd_unref(&mut self, pdn: u32) {
        if let Some(pd) = self.pds.get_mut(pdn) {
            pd.refs = pd.refs.saturating_sub(1);
        }
    }

    fn pd_ref(&mut self, pdn: u32) -> Result<(), CmdStatus> {
        let pd = self.pds.get_mut(pdn).ok_or(CmdStatus::BadResource)?;
        pd.refs += 1;
        Ok(())
    }

    fn query_device(&self) -> Outcome {
        let c = &self.cfg;
        out(&QueryDeviceOut {
            abi_version: ringbell_specs::ABI_VERSION.into(),
            device_id: c.device_id.into(),
            caps: self.caps().bits().into(),
            max_qp: c.max_qp.into(),
            max_cq: c.max_cq.into(),
            max_srq: c.max_srq.into(),
            max_mr: c.max_mr.into(),
            max_pd: c.max_pd.into(),
            max_qp_wr: c.max_qp_wr.into(),
            max_cqe: c.max_cqe.into(),
            max_sge: (ringbell_specs::wqe::MAX_SEND_SGE as u32).into(),
            max_inline: (ringbell_specs::wqe::MAX_INLINE_WRITE as u32).into(),
            max_msg_size: c.max_msg_size.into(),
            max_rd_atomic: c.max_rd_atomic.into(),
            mac: c.mac,
            mtu_caps: 0b11_1110.into(),
            ipv4: c.ip,
            max_num_tags: c.max_num_tags.into(),
            max_tm_ops: c.max_tm_ops.into(),
            max_rndv_hdr_size: ringbell_specs::tm::MAX_RNDV_HDR_SIZE.into(),
            tm_max_sge: ringbell_specs::tm::TM_MAX_SGE.into(),
            max_cntr: c.max_cntr.into(),
            max_triggered: c.max_triggered.into(),
            max_dm_size: c.max_dm_size.into(),
            max_mw: c.max_mw.into(),
        })
    }

    fn reg_mr(&mut self, p: RegMrIn) -> Outcome {
        let access = mr_access(p.access.get())?;
        let (va, len, iova) = mr_range(p.va.get(), p.length.get(), p.iova.get())?;
        self.new_mr(p.pdn.get(), access, (va, len, iova), 0)
    }

    /// REG_DM_MR: `length` bytes (0 allowed, as for verbs) of a device-memory allocation
    /// from `offset`, zero-based, translated into the device-memory aperture.
    fn reg_dm_mr(&mut self, p: RegDmMrIn) -> Outcome {
        if self.cfg.max_dm_size == 0 {
            return Err(CmdStatus::BadOpcode);
        }
        let access = mr_access(p.access.get())?;
        let dm = p.dm.get();
        let a = *self.dm.get(dm).ok_or(CmdStatus::BadResource)?;
        let (off, len) = (p.offset.get(), p.length.get());
        if off.checked_add(len).is_none_or(|e| e > a.len) {
            return Err(CmdStatus::BadSize);
        }
        let iova = crate::mem::DM_APERTURE + a.offset + off;
        let out = self.new_mr(p.pdn.get(), access, (0, len, iova), dm)?;
        if let Some(a) = self.dm.get_mut(dm) {
            a.refs += 1;
        }
        Ok(out)
    }

    fn new_mr(&mut self, pdn: u32, access: Access, range: (u64, u64, u64), dm: u32) -> Outcome {
        let (va, len, iova) = range;
        if self.pds.get(pdn).is_none() {
            return Err(CmdStatus::BadResource);
        }
        self.mr_tag = self.mr_tag.wrapping_add(1);
        let tag = self.mr_tag;
        let idx = self
            .mrs
            .insert_with(|idx| Mr {
                pdn,
                key: (idx << 8) | tag as u32,
                access,
                va,
                len,
                iova,
                dm,
                cntrs: Default::default(),
                mw_refs: 0,
            })
            .ok_or(CmdStatus::Exhausted)?;
        // Key index must fit 24 bits.
        if idx > 0x00FF_FFFF {
            self.mrs.remove(idx);
            return Err(CmdStatus::Exhausted);
        }
        self.pd_ref(pdn)?;
        let key = (idx << 8) | tag as u32;
        out(&RegMrOut {
            lkey: key.into(),
            rkey: key.into(),
        })
    }

    /// REREG_MR: every check first, then every change, so a refused command changes
    /// nothing. The keys stay the region's.
    fn rereg_mr(&mut self, p: ReregMrIn) -> Outcome {
        let (key, flags) = (p.key.get(), p.flags.get());
        let mr = match self.mrs.get(key_index(key)) {
            Some(mr) if mr.key == key => mr,
            _ => return Err(CmdStatus::BadResource),
        };
        // A region of device memory keeps its translation, PD and rights.
        if mr.dm != 0 {
            return Err(CmdStatus::BadParam);
        }
        // Windows bound to it keep it as it is (ABI 1.9).
        if mr.mw_refs > 0 {
            return Err(CmdStatus::Busy);
        }
        let all = REREG_TRANSLATION | REREG_PD | REREG_ACCESS;
        if flags == 0 || flags & !all != 0 {
            return Err(CmdStatus::BadParam);
        }
        let access = if flags & REREG_ACCESS != 0 {
            mr_access(p.access.get())?
        } else {
            mr.access
        };
        let (va, len, iova) = if flags & REREG_TRANSLATION != 0 {
            mr_range(p.va.get(), p.length.get(), p.iova.get())?
        } else {
            (mr.va, mr.len, mr.iova)
        };
        let (old_pdn, pdn) = (
            mr.pdn,
            if flags & REREG_PD != 0 {
                p.pdn.get()
            } else {
                mr.pdn
            },
        );
        if self.pds.get(pdn).is_none() {
            return Err(CmdStatus::BadResource);
        }
        if pdn != old_pdn {
            self.pd_ref(pdn)?;
            self.pd_unref(old_pdn);
        }
        if let Some(mr) = self.mrs.get_mut(key_index(key)) {
            mr.pdn = pdn;
            mr.access = access;
            (mr.va, mr.len, mr.iova) = (va, len, iova);
        }
        Ok(Vec::new())
    }

    /// A CQ ring as CREATE_CQ and RESIZE_CQ check it: `2^log_size` entries, 1..=30 and at
    /// most MAX_CQE (`BAD_SIZE`); 64-byte aligned and inside the IOVA space (`BAD_PARAM`).
    /// Returns the number of entries.
    fn cq_ring(&self, log_size: u8, ring_iova: u64) -> Result<u64, CmdStatus> {
        let size = 1u64 << log_size.min(40);
        if log_size == 0 || log_size > 30 || size > self.cfg.max_cqe as u64 {
            return Err(CmdStatus::BadSize);
        }
        if !ring_iova.is_multiple_of(64) || !fits(ring_iova, size * CQE_SIZE as u64) {
            return Err(CmdStatus::BadParam);
        }
        Ok(size)
    }

    fn create_cq(&mut self, p: CreateCqIn) -> Outcome {
        self.cq_ring(p.log_size, p.ring_iova.get())?;
        if !p.db_iova.get().is_multiple_of(8) || p.eq_vector.get() != 0 {
            return Err(CmdStatus::BadParam);
        }
        let gen = self.fresh_gen();
        let n = self
            .cqs
            .insert_with(|_| Cq {
                gen,
                ring_iova: p.ring_iova.get(),
                db_iova: p.db_iova.get(),
                log_size: p.log_size,
                pi: 0,
                ci: 0,
                armed: None,
                overflow: false,
                refs: 0,
            })
            .ok_or(CmdStatus::Exhausted)?;
        obj(n)
    }

    /// RESIZE_CQ: every check first; then the unpolled CQEs are copied one by one from the old
    /// ring to the new one from slot 0, with the new ring's owner bits; only when every copy
    /// succeeded does the CQ switch rings (a refused command changes nothing but the new
    /// ring's bytes, which are the driver's).
    fn resize_cq(&mut self, env: &mut dyn Env, p: ResizeCqIn) -> Outcome {
        let cqn = p.cqn.get();
        self.cqs.get(cqn).ok_or(CmdStatus::BadResource)?;
        let size = self.cq_ring(p.log_size, p.ring_iova.get())?;
        let cq = self.cqs.get(cqn).ok_or(CmdStatus::BadResource)?;
        if cq.overflow {
            return Err(CmdStatus::BadState);
        }
        let ci = p.ci.get();
        // Between what the device last saw polled and what it wrote.
        if (ci.wrapping_sub(cq.ci) as i32) < 0 || (cq.pi.wrapping_sub(ci) as i32) < 0 {
            return Err(CmdStatus::BadParam);
        }
        let n = cq.pi.wrapping_sub(ci);
        if n as u64 > size {
            return Err(CmdStatus::BadSize);
        }
        let (old_iova, old_mask, db) = (cq.ring_iova, (1u32 << cq.log_size) - 1, cq.db_iova);
        let mut e = [0u8; CQE_SIZE];
        for i in 0..n {
            let slot = ci.wrapping_add(i) & old_mask;
            let from = old_iova.wrapping_add(slot as u64 * CQE_SIZE as u64);
            let to = p.ring_iova.get().wrapping_add(i as u64 * CQE_SIZE as u64);
            let copied = env.dma_read(from, &mut e).and_then(|()| {
                e[CQE_SIZE - 1] = owner_bit(i, p.log_size);
                write_owned_entry(env, to, &e)
            });
            if let Err(f) = copied {
                self.iommu_fault(env, 0, f.iova);
                return Err(CmdStatus::DmaFault);
            }
        }
        // The record's consumer index is the old ring's: it would read as valid for the new
        // one (the device re-reads it before declaring overflow) until the driver rewrote
        // it. The device clears it as it switches.
        if let Err(f) = env.dma_write(db, &0u32.to_le_bytes()) {
            self.iommu_fault(env, 0, f.iova);
            return Err(CmdStatus::DmaFault);
        }
        let cq = self.cqs.get_mut(cqn).ok_or(CmdStatus::BadResource)?;
        cq.ring_iova = p.ring_iova.get();
        cq.log_size = p.log_size;
        cq.pi = n;
        cq.ci = 0;
        Ok(Vec::new())
    }

    fn create_qp(&mut self, p: CreateQpIn) -> Outcome {
        if p.qp_type == QP_TYPE_XRC_TGT {
            return self.create_xrc_tgt(p);
        }
        let pdn = p.pdn.get();
        if self.pds.get(pdn).is_none() {
            return Err(CmdStatus::BadResource);
        }
        let (scq, rcq, srqn) = (p.send_cqn.get(), p.recv_cqn.get(), p.srqn.get());
        if self.cqs.get(scq).is_none() || self.cqs.get(rcq).is_none() {
            return Err(CmdStatus::BadResource);
        }
        if srqn != 0 {
            let srq = self.srqs.get(srqn).ok_or(CmdStatus::BadResource)?;
            if srq.pdn != pdn {
                return Err(CmdStatus::BadPd);
            }
            // An XRC SRQ is reached through XRC targets only.
            if srq.xrc.is_some() {
                return Err(CmdStatus::BadParam);
            }
        }
        let raw = p.qp_type == QP_TYPE_RAW_PACKET;
        let (ud, gsi, uc) = match p.qp_type {
            QP_TYPE_RC | QP_TYPE_XRC_INI | QP_TYPE_RAW_PACKET => (false, false, false),
            QP_TYPE_UC => (false, false, true),
            QP_TYPE_UD => (true, false, false),
            QP_TYPE_GSI => (true, true, false),
            _ => return Err(CmdStatus::BadParam),
        };
        // An XRC initiator only sends: no receive queue, no SRQ.
        let ini = p.qp_type == QP_TYPE_XRC_INI;
        if ini && srqn != 0 {
            return Err(CmdStatus::BadParam);
        }
        // Tag matching is an RC offload: a UC or UD QP takes an ordinary SRQ only.
        if (ud || uc || raw) && self.srqs.get(srqn).is_some_and(|s| s.tm.is_some()) {
            return Err(CmdStatus::BadParam);
        }
        let max = self.cfg.max_qp_wr as u64;
        let sq_ok = p.sq_log_size >= 1 && p.sq_log_size <= 24 && (1u64 << p.sq_log_size) <= max;
        let no_rq = srqn != 0 || ini;
        let rq_ok =
            no_rq || (p.rq_log_size >= 1 && p.rq_log_size <= 24 && (1u64 << p.rq_log_size) <= max);
        let stride_ok = no_rq || (4..=9).contains(&p.rq_log_stride);
        if !sq_ok || !rq_ok || !stride_ok {
            return Err(CmdStatus::BadSize);
        }
        if !p.sq_iova.get().is_multiple_of(64)
            || (!no_rq && !p.rq_iova.get().is_multiple_of(16))
            || !p.db_iova.get().is_multiple_of(8)
            || !fits(p.sq_iova.get(), 64 << p.sq_log_size)
            || (!no_rq && !fits(p.rq_iova.get(), 1 << (p.rq_log_size + p.rq_log_stride)))
        {
            return Err(CmdStatus::BadParam);
        }
        let gen = self.fresh_gen();
        let make = |qpn| Qp {
            gen,
            qpn,
            pdn,
            state: QpState::Reset,
            send_cqn: scq,
            recv_cqn: rcq,
            srqn,
            sq: WorkQueue {
                iova: p.sq_iova.get(),
                log_size: p.sq_log_size,
                log_stride: 6,
                pi: 0,
                ci: 0,
            },
            rq: WorkQueue {
                iova: p.rq_iova.get(),
                log_size: if no_rq { 0 } else { p.rq_log_size },
                log_stride: p.rq_log_stride,
                pi: 0,
                ci: 0,
            },
            fetch: 0,
            // A UD QP has no path: its datagrams may be as long as the port MTU (4096).
            attr: QpAttr {
                path_mtu: if ud || raw { 5 } else { 1 },
                ..Default::default()
            },
            req: Default::default(),
            resp: Default::default(),
            stats: Default::default(),
            ud,
            uc,
            xrc: ini.then_some(XrcRole::Ini),
            raw,
            flows: 0,
            rss: None,
            ud_stats: Default::default(),
            cntrs: Default::default(),
        };
        let n = if gsi {
            // QPN 1, once per device.
            match self.qps.insert_at(GSI_QPN, make(GSI_QPN)) {
                true => GSI_QPN,
                false => return Err(CmdStatus::Exhausted),
            }
        } else {
            self.qps.insert_with(make).ok_or(CmdStatus::Exhausted)?
        };
        let _ = self.pd_ref(pdn);
        for c in [scq, rcq] {
            if let Some(cq) = self.cqs.get_mut(c) {
                cq.refs += 1;
            }
        }
        if let Some(srq) = self.srqs.get_mut(srqn) {
            srq.refs += 1;
        }
        obj(n)
    }

    fn create_tm_srq(&mut self, p: CreateTmSrqIn) -> Outcome {
        let (cqn, tags, log_ops, ops_iova) = (
            p.cqn.get(),
            p.max_num_tags.get(),
            p.ops_log_size,
            p.ops_iova.get(),
        );
        if self.cqs.get(cqn).is_none() {
            return Err(CmdStatus::BadResource);
        }
        if tags == 0
            || tags > self.cfg.max_num_tags
            || log_ops == 0
            || log_ops > 24
            || (1u64 << log_ops) > self.cfg.max_tm_ops as u64
        {
            return Err(CmdStatus::BadSize);
        }
        if !ops_iova.is_multiple_of(64) || !fits(ops_iova, 64 << log_ops) {
            return Err(CmdStatus::BadParam);
        }
        let tm = crate::tm::TmState::new(
            cqn,
            tags,
            WorkQueue {
                iova: ops_iova,
                log_size: log_ops,
                log_stride: 6,
                pi: 0,
                ci: 0,
            },
        );
        let n = self.create_srq(p.srq, Some(Box::new(tm)), None)?;
        if let Some(cq) = self.cqs.get_mut(cqn) {
            cq.refs += 1;
        }
        Ok(n)
    }

    /// CREATE_QP of an XRC target (ABI 1.11): no PD, CQ, queue or doorbell of its own (each
    /// request's XRC SRQ gives those), only its XRC domain.
    fn create_xrc_tgt(&mut self, p: CreateQpIn) -> Outcome {
        let xrcdn = p.xrcdn.get();
        if self.xrcds.get(xrcdn).is_none() {
            return Err(CmdStatus::BadResource);
        }
        let gen = self.fresh_gen();
        let none = WorkQueue {
            iova: 0,
            log_size: 0,
            log_stride: 6,
            pi: 0,
            ci: 0,
        };
        let n = self
            .qps
            .insert_with(|qpn| Qp {
                gen,
                qpn,
                pdn: 0,
                state: QpState::Reset,
                send_cqn: 0,
                recv_cqn: 0,
                srqn: 0,
                sq: none.clone(),
                rq: none,
                fetch: 0,
                attr: QpAttr {
                    path_mtu: 1,
                    ..Default::default()
                },
                req: Default::default(),
                resp: Default::default(),
                stats: Default::default(),
                ud: false,
                uc: false,
                xrc: Some(XrcRole::Tgt { xrcdn }),
                raw: false,
                flows: 0,
                rss: None,
                ud_stats: Default::default(),
                cntrs: Default::default(),
            })
            .ok_or(CmdStatus::Exhausted)?;
        if let Some(x) = self.xrcds.get_mut(xrcdn) {
            x.refs += 1;
        }
        obj(n)
    }

    /// CREATE_XRC_SRQ (ABI 1.11): an SRQ of an XRC domain, completing on its own CQ.
    fn create_xrc_srq(&mut self, p: CreateXrcSrqIn) -> Outcome {
        let (xrcdn, cqn) = (p.xrcdn.get(), p.cqn.get());
        if self.xrcds.get(xrcdn).is_none() || self.cqs.get(cqn).is_none() {
            return Err(CmdStatus::BadResource);
        }
        let n = self.create_srq(p.srq, None, Some((xrcdn, cqn)))?;
        if let Some(cq) = self.cqs.get_mut(cqn) {
            cq.refs += 1;
        }
        if let Some(x) = self.xrcds.get_mut(xrcdn) {
            x.refs += 1;
        }
        Ok(n)
    }

    pub(crate) fn create_srq(
        &mut self,
        p: CreateSrqIn,
        tm: Option<Box<crate::tm::TmState>>,
        xrc: Option<(u32, u32)>,
    ) -> Outcome {
        let pdn = p.pdn.get();
        if self.pds.get(pdn).is_none() {
            return Err(CmdStatus::BadResource);
        }
        if p.log_size == 0
            || p.log_size > 24
            || (1u64 << p.log_size) > self.cfg.max_qp_wr as u64
            || !(4..=9).contains(&p.log_stride)
        {
            return Err(CmdStatus::BadSize);
        }
        if !p.ring_iova.get().is_multiple_of(16)
            || !p.db_iova.get().is_multiple_of(4)
            || p.limit.get() > (1 << p.log_size)
            || !fits(p.ring_iova.get(), 1 << (p.log_size + p.log_stride))
        {
            return Err(CmdStatus::BadParam);
        }
        let n = self
            .srqs
            .insert_with(|_| Srq {
                pdn,
                xrc,
                wq: WorkQueue {
                    iova: p.ring_iova.get(),
                    log_size: p.log_size,
                    log_stride: p.log_stride,
                    pi: 0,
                    ci: 0,
                },
                limit: p.limit.get(),
                refs: 0,
                tm,
                wq_state: ringbell_specs::cmd::WQ_STATE_READY,
            })
            .ok_or(CmdStatus::Exhausted)?;
        let _ = self.pd_ref(pdn);
        obj(n)
    }
}

/// A region's access bits as REG_MR and REREG_MR check them: known bits only, and remote
/// write or atomic access only with local write.
fn mr_access(bits: u32) -> Result<Access, CmdStatus> {
    let access = Access::from_bits(bits).ok_or(CmdStatus::BadParam)?;
    if access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
        && !access.contains(Access::LOCAL_WRITE)
    {
        return Err(CmdStatus::BadParam);
    }
    Ok(access)
}

/// A region's range as REG_MR and REREG_MR check it: 1 byte to 2^47 bytes (a process's
/// whole address space, for on-demand regions; 1 TiB before ABI 1.8), neither end past 2^64
/// (`BAD_SIZE`); the IOVA range below 2^63, where device memory begins (`BAD_PARAM`, ABI 1.8).
fn mr_range(va: u64, len: u64, iova: u64) -> Result<(u64, u64, u64), CmdStatus> {
    if len == 0
        || len > (1 << 47)
        || va.checked_add(len).is_none()
        || iova.checked_add(len).is_none()
    {
        return Err(CmdStatus::BadSize);
    }
    if iova + len > crate::mem::DM_APERTURE {
        return Err(CmdStatus::BadParam);
    }
    Ok((va, len, iova))
}
