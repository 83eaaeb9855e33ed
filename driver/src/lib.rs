//! ringbell: a kernel-bypass RDMA verbs driver for the ringbell NIC.
//!
//! The driver reaches a device through a [`Port`] — mapped BAR0 registers, DMA mappings and
//! a progress hook — exactly as it would reach silicon: work queue entries and completions
//! live in DMA memory, doorbells are register stores. The objects follow libibverbs:
//! [`Device`], [`ProtectionDomain`], [`MemoryRegion`], [`CompletionQueue`], [`QueuePair`]
//! (reliable connected) and [`SharedReceiveQueue`]. Posting and polling allocate nothing.
//! Memory regions cover the driver's DMA buffers ([`ProtectionDomain::reg_mr`]) or memory the
//! application allocated itself ([`ProtectionDomain::reg_user_mr`], as `ibv_reg_mr`).
//!
//! ```no_run
//! # fn demo(port: Box<dyn ringbell::Port>) -> Result<(), ringbell::Error> {
//! use ringbell::*;
//! let dev = Device::open(port)?;
//! let pd = dev.alloc_pd()?;
//! let buf = dev.alloc_dma(4096)?;
//! let mr = pd.reg_mr(&buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! let cq = dev.create_cq(256)?;
//! let qp = pd.create_qp(&QpInit::new(&cq, &cq))?;
//! # let _ = (mr, qp); Ok(()) }
//! ```

pub mod cm;
pub mod collective;
mod counter;
mod cq;
mod device;
pub mod discover;
mod dm;
mod dma;
mod error;
mod fork;
mod hostmem;
mod mr;
mod mw;
mod port;
mod qp;
pub mod raw;
mod srq;
pub mod tagmatch;
pub mod tm;
mod ud;
pub mod vfio;
mod xrc;

pub use counter::{Counter, CounterInfo, CounterWait, TriggerHandle, TriggerOpts};
pub use cq::{CompletionQueue, CqAttr, WcOpcode, WcStatus, WorkCompletion};
pub use device::{
    Allocated, AsyncEvent, Device, DeviceCaps, DmaBuffer, QueueAlloc, QueueAllocator, QueueMem,
};
pub use dm::{DeviceMemory, DM_ACCESS_ALIGN};
pub use dma::DmaMemory;
pub use error::Error;
pub use hostmem::{is_mapped, HOST_IOVA_OFFSET};
pub use mr::{MemoryRegion, ProtectionDomain, Rereg, Sge};
pub use mw::{inc_rkey, MemoryWindow, MwType};
pub use port::{Port, PortError};
pub use qp::{
    ConnectOptions, Endpoint, MwBind, QpInit, QpType, QueuePair, RecvWr, RemoteAddr, SendFlags,
    SendWr, WrOp,
};
pub use ringbell_specs::cmd::{Access, CntrEvents, QpState};
pub use ringbell_specs::stats::{PortStats, QpStats, UdStats};
pub use srq::SharedReceiveQueue;
pub use ud::{AddressHandle, AhAttr, UdDest, UdSource, GRH_LEN, UD_MAX_PAYLOAD};
pub use vfio::{VfioError, VfioPort};
pub use xrc::Xrcd;
