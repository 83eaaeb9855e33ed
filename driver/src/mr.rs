//! Protection domains and memory regions.

use crate::device::{Device, DmaBuffer};
use crate::error::Error;
use ringbell_specs::cmd::{Access, CmdOpcode, RegMrIn, RegMrOut};
use std::rc::Rc;
use zerocopy::{FromBytes, IntoBytes};

/// A protection domain: QPs, SRQs and MRs that may be used together. A clone is another
/// handle on the same PD.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    pub(crate) dev: Device,
    pub(crate) pdn: u32,
    pub(crate) obj: Rc<PdObject>,
}

/// The device object behind a PD. MRs, QPs and SRQs of the PD hold it too, so the PD is
/// freed only after the last of them.
#[derive(Debug)]
pub(crate) struct PdObject {
    dev: Device,
    pdn: u32,
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
        Ok(MemoryRegion {
            host: None,
            cntrs: Default::default(),
            dev: self.dev.clone(),
            _pd: self.obj.clone(),
            lkey: o.lkey.get(),
            rkey: o.rkey.get(),
            addr: va,
            len,
        })
    }
}

/// A registered memory region.
#[derive(Debug)]
pub struct MemoryRegion {
    /// Counters bound to the MR live at least as long as it (dropped after DEREG_MR).
    cntrs: std::cell::RefCell<Vec<Rc<crate::counter::CntrObject>>>,
    dev: Device,
    _pd: Rc<PdObject>,
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: u64,
    /// Adopted caller memory the region lies in ([`ProtectionDomain::reg_user_mr`]): given
    /// back (and unmapped from the device if it was the last user) after DEREG_MR.
    pub(crate) host: Option<crate::hostmem::AdoptedPages>,
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

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        let _ = self.dev.inner.destroy(CmdOpcode::DeregMr, self.lkey);
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
