//! XRC (ABI 1.11): XRC domains, XRC SRQs and the XRC target QP.
//!
//! An XRC domain groups XRC SRQs with the XRC target QPs that deliver to them. A sender's
//! XRC initiator QP ([`QpType::XrcIni`](crate::QpType::XrcIni), made by
//! [`ProtectionDomain::create_qp`]) is connected to one target QP, and each of its requests
//! names the SRQ that receives it ([`SendWr::xrc`](crate::SendWr::xrc)): one connection
//! serves every SRQ of the target's domain. The receive completes on the SRQ's own CQ, and
//! the SRQ's PD checks the remote keys of WRITEs, READs and atomics.

use crate::cq::CompletionQueue;
use crate::device::Device;
use crate::error::Error;
use crate::mr::ProtectionDomain;
use crate::qp::QueuePair;
use crate::srq::SharedReceiveQueue;
use ringbell_specs::cmd::CmdOpcode;
use ringbell_specs::regs;
use std::rc::Rc;

/// An XRC domain. A clone is another handle on the same domain; the device frees it when
/// the last handle, SRQ and target QP of it are gone.
#[derive(Debug, Clone)]
pub struct Xrcd {
    obj: Rc<XrcdObject>,
}

#[derive(Debug)]
struct XrcdObject {
    dev: Device,
    num: u32,
}

impl Drop for XrcdObject {
    fn drop(&mut self) {
        let _ = self.dev.inner.destroy(CmdOpcode::DeallocXrcd, self.num);
    }
}

impl Device {
    /// Allocates an XRC domain ([`Error::Unsupported`] on a device without `CAPS.XRC`).
    pub fn alloc_xrcd(&self) -> Result<Xrcd, Error> {
        if !self.caps().caps.contains(regs::Caps::XRC) {
            return Err(Error::Unsupported("XRC: the device lacks CAPS.XRC"));
        }
        let num = self.inner.create(CmdOpcode::AllocXrcd, &[])?;
        Ok(Xrcd {
            obj: Rc::new(XrcdObject {
                dev: self.clone(),
                num,
            }),
        })
    }
}

impl Xrcd {
    /// The device's number for it.
    pub fn num(&self) -> u32 {
        self.obj.num
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.obj.dev
    }

    /// Whether `other` is a handle on this same domain.
    pub fn same(&self, other: &Xrcd) -> bool {
        Rc::ptr_eq(&self.obj, &other.obj)
    }

    /// An XRC target QP of this domain, in RESET. It has no queues: connect it to the
    /// peer's initiator ([`QueuePair::connect`]) and it delivers each request to the
    /// domain's SRQ the request names.
    pub fn create_target_qp(&self) -> Result<QueuePair, Error> {
        QueuePair::xrc_target(self)
    }
}

impl ProtectionDomain {
    /// An XRC SRQ of domain `xrcd` (on this PD's device), whose receives complete on `cq`;
    /// its number is what senders name ([`SharedReceiveQueue::srqn`]).
    pub fn create_xrc_srq(
        &self,
        xrcd: &Xrcd,
        cq: &CompletionQueue,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
    ) -> Result<SharedReceiveQueue, Error> {
        if !xrcd.device().same_as(&self.dev) || !cq.belongs_to(&self.dev) {
            return Err(Error::InvalidArgument(
                "XRC domain or CQ belongs to another device",
            ));
        }
        self.create_srq_inner(max_wr, max_sge, limit, None, Some((Some(xrcd), cq)))
    }
}
