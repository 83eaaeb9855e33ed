//! Device memory (ABI 1.8): memory on the NIC itself, allocated with ALLOC_DM, read and
//! written by the host through the BAR0 window at `regs::DM_BASE`, and registered as
//! zero-based memory regions (REG_DM_MR) that work requests and remote peers use like any
//! other: `ibv_alloc_dm(3)`.

use crate::device::Device;
use crate::error::Error;
use crate::mr::{MemoryRegion, ProtectionDomain};
use ringbell_specs::cmd::{Access, AllocDmIn, AllocDmOut, CmdOpcode, RegDmMrIn, RegMrOut};
use ringbell_specs::regs;
use std::rc::Rc;
use zerocopy::{FromBytes, IntoBytes};

/// A device-memory allocation. Regions registered over it keep it: the device frees it
/// when the last of them and this handle are gone.
#[derive(Debug)]
pub struct DeviceMemory {
    pub(crate) obj: Rc<DmObject>,
}

#[derive(Debug)]
pub(crate) struct DmObject {
    dev: Device,
    num: u32,
    /// Where it starts in device memory.
    offset: u64,
    len: u64,
}

impl Drop for DmObject {
    fn drop(&mut self) {
        let _ = self.dev.inner.destroy(CmdOpcode::FreeDm, self.num);
    }
}

/// The host's accesses to device memory are 32-bit: offsets and lengths are multiples of 4.
pub const DM_ACCESS_ALIGN: u64 = 4;

impl Device {
    /// Allocates `len` bytes of device memory whose device address is a multiple of
    /// `1 << log_align` (at most `cmd::DM_MAX_LOG_ALIGN`). The bytes start zeroed. A device
    /// without device memory is [`Error::Unsupported`]; one without room left refuses with
    /// `EXHAUSTED`, a length of 0 or above `max_dm_size` with `BAD_SIZE`.
    pub fn alloc_dm(&self, len: u64, log_align: u32) -> Result<DeviceMemory, Error> {
        if self.caps().max_dm_size == 0 {
            return Err(Error::Unsupported("the device has no device memory"));
        }
        let input = AllocDmIn {
            length: len.into(),
            log_align: log_align.into(),
            ..Default::default()
        };
        let out = self.inner.command(CmdOpcode::AllocDm, input.as_bytes())?;
        let o = AllocDmOut::read_from_prefix(&out)
            .map(|(o, _)| o)
            .unwrap_or_default();
        Ok(DeviceMemory {
            obj: Rc::new(DmObject {
                dev: self.clone(),
                num: o.num.get(),
                offset: o.offset.get(),
                len,
            }),
        })
    }
}

impl DeviceMemory {
    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.obj.len
    }

    /// Whether it is empty (never: the device allocates at least a byte).
    pub fn is_empty(&self) -> bool {
        self.obj.len == 0
    }

    /// The device's number for it.
    pub fn num(&self) -> u32 {
        self.obj.num
    }

    /// Whether memory regions are registered over it.
    pub fn in_use(&self) -> bool {
        Rc::strong_count(&self.obj) > 1
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.obj.dev
    }

    /// Checks a host access of `len` bytes at `offset`, in this order: inside the
    /// allocation ([`Error::OutOfBounds`]), both multiples of [`DM_ACCESS_ALIGN`]
    /// ([`Error::InvalidArgument`]). Returns the BAR0 offset of its first byte.
    pub fn window(&self, offset: u64, len: usize) -> Result<u64, Error> {
        if offset
            .checked_add(len as u64)
            .is_none_or(|e| e > self.obj.len)
        {
            return Err(Error::OutOfBounds {
                offset: offset as usize,
                len,
                size: self.obj.len as usize,
            });
        }
        if !offset.is_multiple_of(DM_ACCESS_ALIGN) || !(len as u64).is_multiple_of(DM_ACCESS_ALIGN)
        {
            return Err(Error::InvalidArgument(
                "device memory is accessed in 4-byte words",
            ));
        }
        Ok(regs::DM_BASE + self.obj.offset + offset)
    }

    /// Copies `data` into the allocation at `offset` (`ibv_memcpy_to_dm`): 32-bit stores,
    /// and write-combined bursts where 64-byte-aligned runs allow.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        let mut at = self.window(offset, data.len())?;
        let port = &self.obj.dev.inner.port;
        let mut rest = data;
        while !rest.is_empty() {
            let run = if at.is_multiple_of(64) {
                (rest.len() / 64 * 64).min(256)
            } else {
                0
            };
            if run > 0 {
                port.write_block(at, &rest[..run]);
                at += run as u64;
                rest = &rest[run..];
            } else {
                let w = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
                port.write32(at, w);
                at += 4;
                rest = &rest[4..];
            }
        }
        Ok(())
    }

    /// Copies `out.len()` bytes from the allocation at `offset` (`ibv_memcpy_from_dm`);
    /// the loads see every earlier store.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        let at = self.window(offset, out.len())?;
        let port = &self.obj.dev.inner.port;
        for (i, w) in out.chunks_exact_mut(4).enumerate() {
            w.copy_from_slice(&port.read32(at + 4 * i as u64).to_le_bytes());
        }
        Ok(())
    }
}

impl ProtectionDomain {
    /// Registers `len` bytes of `dm` from `offset` as a zero-based region (`ibv_reg_dm_mr`):
    /// SGEs and peers address it from 0. A length of 0 is allowed. The region keeps `dm`.
    pub fn reg_dm_mr(
        &self,
        dm: &DeviceMemory,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<MemoryRegion, Error> {
        if !dm.obj.dev.same_as(&self.dev) {
            return Err(Error::InvalidArgument(
                "the device memory is another device's",
            ));
        }
        let input = RegDmMrIn {
            pdn: self.pdn.into(),
            access: access.bits().into(),
            dm: dm.obj.num.into(),
            offset: offset.into(),
            length: len.into(),
            ..Default::default()
        };
        let out = self
            .dev
            .inner
            .command(CmdOpcode::RegDmMr, input.as_bytes())?;
        let o = RegMrOut::read_from_prefix(&out)
            .map(|(o, _)| o)
            .unwrap_or_default();
        let mut mr = self.new_region(o, 0, len, access);
        mr.dm = Some(dm.obj.clone());
        Ok(mr)
    }
}
