//! Memory windows (ABI 1.9, `ibv_alloc_mw(3)`, `ibv_bind_mw(3)`): remote keys of their own
//! over part of a memory region, bound and invalidated by work requests
//! ([`WrOp::BindMw`](crate::WrOp::BindMw), [`WrOp::LocalInv`](crate::WrOp::LocalInv),
//! [`WrOp::SendInv`](crate::WrOp::SendInv)).

use crate::error::Error;
use crate::mr::{PdObject, ProtectionDomain};
use ringbell_specs::cmd::{AllocMwIn, CmdOpcode, ObjectOut, MW_TYPE_1, MW_TYPE_2};
use ringbell_specs::regs;
use std::rc::Rc;
use zerocopy::{FromBytes, IntoBytes};

/// The two kinds of memory window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MwType {
    /// Bound through any QP of its PD; unbound by binding it again with length 0.
    Type1,
    /// Bound to the QP that binds it, which alone reaches memory through it; binding needs
    /// it unbound; LOCAL_INV or a received SEND with invalidate unbinds it.
    Type2,
}

/// A memory window. Dropping it deallocates it (unbinding it if it is bound).
#[derive(Debug)]
pub struct MemoryWindow {
    dev: crate::Device,
    _pd: Rc<PdObject>,
    key: u32,
    kind: MwType,
}

impl ProtectionDomain {
    /// Allocates an unbound memory window of `kind` (ALLOC_MW). A device without windows
    /// is [`Error::Unsupported`].
    pub fn alloc_mw(&self, kind: MwType) -> Result<MemoryWindow, Error> {
        if !self.dev.caps().caps.contains(regs::Caps::MEMORY_WINDOW) {
            return Err(Error::Unsupported("the device has no memory windows"));
        }
        let input = AllocMwIn {
            pdn: self.pdn.into(),
            mw_type: match kind {
                MwType::Type1 => MW_TYPE_1,
                MwType::Type2 => MW_TYPE_2,
            }
            .into(),
        };
        let out = self
            .dev
            .inner
            .command(CmdOpcode::AllocMw, input.as_bytes())?;
        let key = ObjectOut::read_from_prefix(&out)
            .map(|(o, _)| o.num.get())
            .unwrap_or_default();
        Ok(MemoryWindow {
            dev: self.dev.clone(),
            _pd: self.obj.clone(),
            key,
            kind,
        })
    }
}

impl MemoryWindow {
    /// The key the device gave it. A bind gives the window the key its request names,
    /// which keeps this key's index (bits 31:8) and chooses the low 8 bits.
    pub fn key(&self) -> u32 {
        self.key
    }

    /// Its type.
    pub fn kind(&self) -> MwType {
        self.kind
    }

    /// The number of its PD.
    pub fn pdn(&self) -> u32 {
        self._pd.pdn
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        let _ = self.dev.inner.destroy(CmdOpcode::DeallocMw, self.key);
    }
}

/// The next key of a window: the same index, the low 8 bits one more (`ibv_inc_rkey`).
pub fn inc_rkey(key: u32) -> u32 {
    (key & !0xFF) | (key.wrapping_add(1) & 0xFF)
}
