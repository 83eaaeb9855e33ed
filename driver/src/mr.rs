//! Protection domains and memory regions.

use crate::device::{Device, DmaBuffer};
use crate::error::Error;
use ringbell_specs::cmd::{
    Access, CmdOpcode, RegMrIn, RegMrOut, ReregMrIn, REREG_ACCESS, REREG_PD, REREG_TRANSLATION,
};
use std::rc::Rc;
use zerocopy::{FromBytes, IntoBytes};

/// A protection domain: QPs, SRQs and MRs that may be used together. A clone is another
/// handle on the same PD.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    pub(crate) dev: Device,
    pub(crate) pdn: u32,
    pub(crate) obj: Rc<PdObject>,
    /// Where the rings of QPs and SRQs made in it come from (a parent domain's allocator).
    pub(crate) alloc: Option<crate::device::QueueAlloc>,
}

/// The device object behind a PD. MRs, QPs and SRQs of the PD hold it too, so the PD is
/// freed only after the last of them.
#[derive(Debug)]
pub(crate) struct PdObject {
    dev: Device,
    pub(crate) pdn: u32,
}

impl PdObject {
    pub(crate) fn new(dev: Device, pdn: u32) -> Rc<PdObject> {
        Rc::new(PdObject { dev, pdn })
    }
}

impl Drop for PdObject {
    fn drop(&mut self) {
        let _ = self.dev.inner.destroy(CmdOpcode::FreePd, self.pdn);
    }
}

impl ProtectionDomain {
    /// This PD as a parent domain (`ibv_alloc_parent_domain(3)`): another handle on the same
    /// PD whose QPs and SRQs (and CQs made with [`Device::create_cq_in`]) take their rings
    /// and doorbell records from `alloc`.
    pub fn with_allocator(&self, alloc: crate::device::QueueAlloc) -> ProtectionDomain {
        ProtectionDomain {
            alloc: Some(alloc),
            ..self.clone()
        }
    }

    /// The PD number.
    pub fn pdn(&self) -> u32 {
        self.pdn
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Registers all of `buf`, addressed by its IOVA.
    pub fn reg_mr(&self, buf: &DmaBuffer, access: Access) -> Result<MemoryRegion, Error> {
        self.reg_mr_range(buf, 0, buf.len(), access)
    }

    /// Registers `len` bytes of `buf` from `offset`.
    pub fn reg_mr_range(
        &self,
        buf: &DmaBuffer,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, Error> {
        if offset.checked_add(len).is_none_or(|e| e > buf.len()) {
            return Err(Error::OutOfBounds {
                offset,
                len,
                size: buf.len(),
            });
        }
        // IOVAs are per device: another device's buffer would alias whatever this device has
        // mapped at the same IOVA.
        if !buf.belongs_to(&self.dev) {
            return Err(Error::InvalidArgument(
                "the buffer is mapped for another device",
            ));
        }
        let addr = buf.iova() + offset as u64;
        self.reg_mr_raw(addr, len as u64, addr, access)
    }

    /// Registers `len` bytes of this process's memory at `addr` on demand (on-demand
    /// paging, `IBV_ACCESS_ON_DEMAND`), addressed by `mr_addr`: nothing is pinned, copied or
    /// moved; the device reaches whatever is mapped at those addresses when it uses them
    /// (pages the program maps afresh there included), and a page that is not mapped then
    /// fails that access (an IOMMU fault). Safe: the driver touches no memory. A device
    /// that cannot ([`Device::on_demand`]) is [`Error::Unsupported`].
    pub fn reg_odp_mr(
        &self,
        addr: usize,
        len: usize,
        mr_addr: u64,
        access: Access,
    ) -> Result<MemoryRegion, Error> {
        if !self.dev.on_demand() {
            return Err(Error::Unsupported("the device has no on-demand paging"));
        }
        let end = (addr as u64).checked_add(len as u64);
        if len == 0 || end.is_none_or(|e| e > crate::HOST_IOVA_OFFSET) {
            return Err(Error::InvalidArgument(
                "the range is empty or outside the process's address space",
            ));
        }
        let mut mr = self.reg_mr_raw(
            mr_addr,
            len as u64,
            crate::HOST_IOVA_OFFSET + addr as u64,
            access,
        )?;
        mr.odp = true;
        Ok(mr)
    }

    /// Registers `[va, va + len)` backed by IOVA `iova` without checking that anything is
    /// mapped there (for tests of the device's checks).
    pub fn reg_mr_raw(
        &self,
        va: u64,
        len: u64,
        iova: u64,
        access: Access,
    ) -> Result<MemoryRegion, Error> {
        let input = RegMrIn {
            pdn: self.pdn.into(),
            access: access.bits().into(),
            va: va.into(),
            length: len.into(),
            iova: iova.into(),
        };
        let out = self.dev.inner.command(CmdOpcode::RegMr, input.as_bytes())?;
        let o = RegMrOut::read_from_prefix(&out)
            .map(|(o, _)| o)
            .unwrap_or_default();
        Ok(self.new_region(o, va, len, access))
    }

    /// The handle of a region the device registered with keys `o`.
    pub(crate) fn new_region(
        &self,
        o: RegMrOut,
        addr: u64,
        len: u64,
        access: Access,
    ) -> MemoryRegion {
        MemoryRegion {
            host: None,
            dm: None,
            odp: false,
            deregistered: false,
            cntrs: Default::default(),
            dev: self.dev.clone(),
            _pd: self.obj.clone(),
            lkey: o.lkey.get(),
            rkey: o.rkey.get(),
            addr,
            len,
            access,
        }
    }
}

/// What a re-registration changes ([`MemoryRegion::rereg_raw`]); `None` keeps it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Rereg<'a> {
    /// The PD the region moves to.
    pub pd: Option<&'a ProtectionDomain>,
    /// The access it grants from now on.
    pub access: Option<Access>,
    /// Its new `(address, length, iova)`.
    pub range: Option<(u64, u64, u64)>,
}

/// A registered memory region.
#[derive(Debug)]
pub struct MemoryRegion {
    /// Counters bound to the MR live at least as long as it (dropped after DEREG_MR).
    cntrs: std::cell::RefCell<Vec<Rc<crate::counter::CntrObject>>>,
    pub(crate) dev: Device,
    _pd: Rc<PdObject>,
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: u64,
    access: Access,
    /// Adopted caller memory the region lies in ([`ProtectionDomain::reg_user_mr`]): given
    /// back (and unmapped from the device if it was the last user) after DEREG_MR.
    pub(crate) host: Option<crate::hostmem::AdoptedPages>,
    /// The device memory the region lies in ([`ProtectionDomain::reg_dm_mr`]): freed, if
    /// this was its last user, after DEREG_MR.
    pub(crate) dm: Option<Rc<crate::dm::DmObject>>,
    /// Registered on demand ([`ProtectionDomain::reg_odp_mr`]).
    odp: bool,
    /// DEREG_MR succeeded already ([`MemoryRegion::dereg`]).
    deregistered: bool,
}

impl MemoryRegion {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// Address of the first byte (what SGEs and remote peers use).
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// The access it grants.
    pub fn access(&self) -> Access {
        self.access
    }
    /// The number of its PD.
    pub fn pdn(&self) -> u32 {
        self._pd.pdn
    }
    /// Whether it was registered on demand ([`ProtectionDomain::reg_odp_mr`]).
    pub fn on_demand(&self) -> bool {
        self.odp
    }

    /// Changes the region in place (REREG_MR, ABI 1.6), as `ibv_rereg_mr` does: what `r`
    /// names, keeping the keys, so work posted later with them uses the new values. Nothing
    /// changes when the device refuses (a status error, `BAD_PARAM` when `r` names nothing);
    /// a PD of another device is [`Error::InvalidArgument`], and a device without the
    /// command answers `BAD_OPCODE`. Like [`ProtectionDomain::reg_mr_raw`], it checks nothing
    /// about what the new range maps: [`MemoryRegion::rereg_user`] does, for the process's
    /// memory.
    pub fn rereg_raw(&mut self, r: &Rereg<'_>) -> Result<(), Error> {
        if r.pd.is_some_and(|pd| !pd.dev.same_as(&self.dev)) {
            return Err(Error::InvalidArgument("the PD is another device's"));
        }
        let mut input = ReregMrIn {
            key: self.lkey.into(),
            ..Default::default()
        };
        let mut flags = 0;
        if let Some(pd) = r.pd {
            flags |= REREG_PD;
            input.pdn = pd.pdn.into();
        }
        if let Some(a) = r.access {
            flags |= REREG_ACCESS;
            input.access = a.bits().into();
        }
        if let Some((va, len, iova)) = r.range {
            flags |= REREG_TRANSLATION;
            (input.va, input.length, input.iova) = (va.into(), len.into(), iova.into());
        }
        input.flags = flags.into();
        self.dev
            .inner
            .command(CmdOpcode::ReregMr, input.as_bytes())?;
        if let Some(pd) = r.pd {
            self._pd = pd.obj.clone();
        }
        if let Some(a) = r.access {
            self.access = a;
        }
        if let Some((va, len, _)) = r.range {
            (self.addr, self.len) = (va, len);
        }
        Ok(())
    }
    /// Whether the region is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub(crate) fn belongs_to(&self, dev: &Device) -> bool {
        self.dev.same_as(dev)
    }
    pub(crate) fn keep(&self, c: Rc<crate::counter::CntrObject>) {
        self.cntrs.borrow_mut().push(c);
    }
    /// A scatter/gather entry for `len` bytes at `offset` into the region.
    pub fn sge(&self, offset: u64, len: u32) -> Sge {
        Sge {
            addr: self.addr.wrapping_add(offset),
            len,
            lkey: self.lkey,
        }
    }
}

impl MemoryRegion {
    /// Deregisters the region now, reporting what the device says: `BUSY` while memory
    /// windows are bound to it (ABI 1.9), and the region is then unchanged. After a success
    /// only dropping it is left (which gives back its memory). Dropping a region that is
    /// still registered deregisters it without a report.
    pub fn dereg(&mut self) -> Result<(), Error> {
        if !self.deregistered {
            self.dev.inner.destroy(CmdOpcode::DeregMr, self.lkey)?;
            self.deregistered = true;
        }
        Ok(())
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if !self.deregistered {
            let _ = self.dev.inner.destroy(CmdOpcode::DeregMr, self.lkey);
        }
    }
}

/// A scatter/gather entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Sge {
    /// Address in the MR's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Local key of the MR.
    pub lkey: u32,
}
