//! Opening the NICs of a [`NicPlan`] (the environment's choice of served or in-process NICs)
//! for the libraries unmodified programs load (`libringbell_verbs.so`, `libringbell_fi.so`):
//! a served NIC through vfio-user, or a node of the in-process fabric, made on first use.

use crate::{Fabric, FabricConfig};
use ringbell::discover::{NicPlan, NicSource};
use ringbell::{Device, VfioPort};

/// Why a planned NIC did not open.
#[derive(Debug)]
pub enum PlannedNicError {
    /// The plan has no NIC with that index.
    NoSuchNic,
    /// The served NIC's socket could not be reached.
    Connect(String),
    /// The device refused to open.
    Open(ringbell::Error),
}

impl std::fmt::Display for PlannedNicError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlannedNicError::NoSuchNic => f.write_str("no such NIC"),
            PlannedNicError::Connect(e) => write!(f, "connecting: {e}"),
            PlannedNicError::Open(e) => write!(f, "opening: {e}"),
        }
    }
}

/// Opens NIC `i` of `plan`. The in-process fabric (`plan.nics.len()` nodes, `plan.seed`) is
/// made in `fabric` when its first NIC opens and shared by the others.
pub fn open_planned_nic(
    plan: &NicPlan,
    i: usize,
    fabric: &mut Option<Fabric>,
) -> Result<Device, PlannedNicError> {
    match plan.nics.get(i).ok_or(PlannedNicError::NoSuchNic)? {
        NicSource::Served(path) => {
            let port = VfioPort::connect(path)
                .map_err(|e| PlannedNicError::Connect(format!("{}: {e}", path.display())))?;
            Device::open(Box::new(port)).map_err(PlannedNicError::Open)
        }
        NicSource::InProcess(node) => {
            let fabric = fabric
                .get_or_insert_with(|| Fabric::new(FabricConfig::new(plan.nics.len(), plan.seed)));
            Device::open(Box::new(fabric.port(*node))).map_err(PlannedNicError::Open)
        }
    }
}
