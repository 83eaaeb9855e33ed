//! The ringbell emulator: NIC models on a simulated fabric.
//!
//! A [`Fabric`] holds N nodes, each a [`ringbell_model::Nic`] with host memory behind an
//! [`Iommu`], connected to one switch (or back to back) by links with serialization and
//! latency. One event queue orders everything by (time, sequence); one seed is the root of
//! every random stream. [`Fabric::port`] gives the driver an in-process [`ringbell::Port`]
//! that runs the simulation in lockstep with its caller. [`perf`] holds the perftest-style
//! runs the CLI prints, [`tmbench`] the tag-matching ones. [`serve`] runs the NICs as vfio-user devices for other
//! processes, and [`peer`] is one such process.

pub mod capture;
pub mod coll;
mod fabric;
pub mod faults;
mod iommu;
pub mod peer;
pub mod perf;
mod planned;
mod port;
pub mod profile;
pub mod scale;
mod scenario;
pub mod serve;
pub mod timeline;
pub mod tmbench;
pub mod yardstick;

pub use capture::CaptureStats;
pub use fabric::{stream_seed, Fabric, FabricConfig, FabricStats, Topology};
pub use faults::{
    FaultAction, FaultPlan, FaultRule, FaultStats, FrameKind, FrameMatch, LinkFaults,
};
pub use iommu::Iommu;
pub use planned::{open_planned_nic, PlannedNicError};
pub use port::EmuPort;
pub use scenario::{Scenario, ScenarioError};
pub use timeline::{Timeline, TimelineStats};
