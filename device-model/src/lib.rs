//! The ringbell NIC as a pure, deterministic state machine in simulated time.
//!
//! A [`Nic`] owns every device-side object (PDs, MRs, CQs, QPs, SRQs, the command interface
//! and the event queue) and reacts to three kinds of input: register accesses
//! ([`Nic::mmio_read`], [`Nic::mmio_write`]), frames from the wire ([`Nic::receive`]) and its
//! own scheduled events ([`Nic::handle`]). Everything it does to the outside world goes
//! through the [`Env`] trait: DMA through an IOMMU-checked port, frames to the link, events
//! to schedule, interrupts. The model has no threads, no I/O, no clock and no randomness;
//! the same inputs give the same outputs, bit for bit.
#![forbid(unsafe_code)]

mod cmd;
mod counter;
mod cq;
mod env;
mod functional;
mod mem;
mod mw;
mod nic;
mod qp;
mod raw;
mod requester;
mod responder;
pub mod sim;
pub mod timing;
mod tm;

pub use env::{DmaFault, Env, FmData, FmMsg, FmOp, NicEvent, Stage, TraceEvent};
pub use nic::{Nic, NicConfig, NicStats};
pub use qp::QpStats;
pub use timing::TimingProfile;
