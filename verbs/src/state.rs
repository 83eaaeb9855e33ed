//! The library's one lock and what it guards: the NICs, where they come from, and which
//! C pointers name ringbell objects.
//!
//! The driver's objects are single-threaded (`Rc`, `Cell`); C programs may call from any
//! thread. Every call into the library therefore takes one process-wide lock before it
//! touches a driver object, and no driver object or `Rc` is ever reached without it.

use crate::abi;
use ringbell::Device;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard, OnceLock};

pub use ringbell::discover::{DEFAULT_NICS, DEFAULT_SEED, ENV_NICS, ENV_SEED, ENV_SERVE};

/// One ringbell NIC as libibverbs shows it.
pub(crate) struct Nic {
    /// `rb{i}`.
    pub name: String,
    /// The open device, shared by every context on the NIC (opened at the first
    /// `ibv_open_device`, kept until the process ends).
    pub dev: Option<Device>,
    /// The `struct ibv_device` handed to programs (leaked: device pointers stay valid for
    /// the life of the process, as libibverbs' do).
    pub ibdev: *mut abi::ibv_device,
}

/// What kind of object a pointer names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Context,
    Pd,
    Mr,
    Cq,
    Qp,
    Srq,
    Channel,
    Ah,
    Td,
    Dm,
    Mw,
    Xrcd,
    Flow,
    Wq,
    IndTable,
}

/// Whose object a pointer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owner {
    /// A live ringbell object of this kind.
    Ours(Kind),
    /// A ringbell object already destroyed (a second destroy, or use after destroy).
    Dead,
    /// Not ringbell's: libibverbs' own (or garbage, which libibverbs would not check).
    Foreign,
}

/// Everything behind the lock.
pub(crate) struct State {
    pub nics: Vec<Nic>,
    pub fabric: Option<ringbell_emu::Fabric>,
    /// Where the NICs are (the environment's choice).
    pub plan: ringbell::discover::NicPlan,
    /// Live objects by address.
    live: BTreeMap<usize, Kind>,
    /// Addresses of destroyed objects not reused since.
    dead: BTreeSet<usize>,
    /// Device lists handed out: our array -> libibverbs' own list (0: none).
    pub lists: BTreeMap<usize, usize>,
    /// CQs by (NIC, CQN), QPs by (NIC, QPN), SRQs by (NIC, SRQN): events name objects by
    /// number.
    pub cqs: BTreeMap<(usize, u32), usize>,
    pub qps: BTreeMap<(usize, u32), usize>,
    pub srqs: BTreeMap<(usize, u32), usize>,
    /// Contexts by NIC, for events that concern a device.
    pub contexts: BTreeMap<usize, Vec<usize>>,
    /// RDMA-CM's ids, channels and connections.
    pub cma: crate::cma::Cma,
}

/// The guarded state.
struct Locked(State);

// SAFETY: `State` holds single-threaded driver handles (`Rc`, `Cell`) and raw pointers to
// objects this library allocated. It is reachable only through the process-wide mutex in
// `lock`, so at most one thread touches any of it at a time, and nothing inside escapes a
// guard's lifetime (entry points copy plain values out before unlocking).
unsafe impl Send for Locked {}

static STATE: OnceLock<Mutex<Locked>> = OnceLock::new();

/// The state, locked. A poisoned lock (a panic caught at an entry point) is taken over: the
/// state is consistent between calls.
pub(crate) fn lock() -> StateGuard {
    let m = STATE.get_or_init(|| Mutex::new(Locked(State::from_env())));
    StateGuard(m.lock().unwrap_or_else(|e| e.into_inner()))
}

/// A held lock.
pub(crate) struct StateGuard(MutexGuard<'static, Locked>);

impl std::ops::Deref for StateGuard {
    type Target = State;
    fn deref(&self) -> &State {
        &self.0 .0
    }
}
impl std::ops::DerefMut for StateGuard {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.0 .0
    }
}

impl State {
    fn from_env() -> State {
        let plan = ringbell::discover::NicPlan::from_env();
        let nics = (0..plan.nics.len())
            .map(|i| {
                let name = ringbell::discover::NicPlan::name(i);
                Nic {
                    ibdev: crate::device::new_ibv_device(&name),
                    name,
                    dev: None,
                }
            })
            .collect();
        State {
            nics,
            fabric: None,
            plan,
            live: BTreeMap::new(),
            dead: BTreeSet::new(),
            lists: BTreeMap::new(),
            cqs: BTreeMap::new(),
            qps: BTreeMap::new(),
            srqs: BTreeMap::new(),
            contexts: BTreeMap::new(),
            cma: Default::default(),
        }
    }

    /// Whose object `p` is.
    pub fn owner(&self, p: usize) -> Owner {
        if let Some(k) = self.live.get(&p) {
            Owner::Ours(*k)
        } else if self.dead.contains(&p) {
            Owner::Dead
        } else {
            Owner::Foreign
        }
    }

    /// Records a new object.
    pub fn add(&mut self, p: usize, kind: Kind) {
        self.dead.remove(&p);
        self.live.insert(p, kind);
    }

    /// Records an object destroyed.
    pub fn remove(&mut self, p: usize) {
        if self.live.remove(&p).is_some() {
            self.dead.insert(p);
        }
    }

    /// Live objects of `kind`.
    pub fn live_of(&self, kind: Kind) -> Vec<usize> {
        self.live
            .iter()
            .filter(|(_, k)| **k == kind)
            .map(|(p, _)| *p)
            .collect()
    }

    /// The NIC whose `struct ibv_device` is `p`.
    pub fn nic_of_ibdev(&self, p: *const abi::ibv_device) -> Option<usize> {
        self.nics.iter().position(|n| std::ptr::eq(n.ibdev, p))
    }

    /// The open device of NIC `i`, opening it first if needed.
    pub fn device(&mut self, i: usize) -> Result<Device, i32> {
        if let Some(d) = &self.nics[i].dev {
            return Ok(d.clone());
        }
        let dev = ringbell_emu::open_planned_nic(&self.plan, i, &mut self.fabric).map_err(|e| {
            eprintln!("ringbell-verbs: {}: {e}", self.nics[i].name);
            match e {
                ringbell_emu::PlannedNicError::Open(e) => crate::errno_of(&e),
                _ => libc::ENODEV,
            }
        })?;
        self.nics[i].dev = Some(dev.clone());
        Ok(dev)
    }
}
