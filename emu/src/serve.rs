//! The emulator as a vfio-user server (`ringbell-emu serve`): each emulated NIC is a PCI
//! device that another process reaches through a UNIX socket, `DIR/nic{i}.sock`, with the
//! driver's vfio-user backend ([`ringbell::VfioPort::connect`]) — the protocol QEMU, Cloud
//! Hypervisor and SPDK speak.
//!
//! What a client sees, per node:
//! - config space (region 7): vendor 0x1de5, device 0x0001, class 0x0207 (network,
//!   InfiniBand), a 64-bit BAR0 of [`regs::BAR0_SIZE`] whose size can be probed;
//! - BAR0 (region 0): every register trapped (REGION_READ/REGION_WRITE), except the doorbell
//!   pages `[DB_BASE, DB_END)`, which the client maps (a sparse-mmap area of a memory file)
//!   and stores into without a message; the server polls the live doorbell slots;
//! - DMA_MAP of memory files (the driver's memfd buffers), checked like an IOMMU: no overlap,
//!   no zero or absurd length, no length beyond the file; the file is sealed against
//!   shrinking (`F_SEAL_SHRINK`, added by the server: a memfd made with `MFD_ALLOW_SEALING`)
//!   so that no client can make the server's mapping of it fault; a client holds at most
//!   its share of the process's mapping budget ([`mapping_budget`]);
//! - each client gets a fresh BAR0 memory file (sealed), so one that has gone cannot store
//!   into the doorbells of the next;
//! - MSI-X vector 0 through an eventfd (DEVICE_SET_IRQS; nothing else is taken), written by
//!   the node's own thread whenever the NIC raises its interrupt.
//!
//! Threads: the fabric lives on one thread (it is single-threaded by design); each node has
//! a thread that owns its socket, speaks the protocol ([`session`]) and hands every device
//! access to the fabric thread over a channel, one at a time. Nothing a client sends decides
//! an allocation or makes the fabric thread wait: messages are bounded before they are read
//! ([`session::MAX_MSG_SIZE`]), the node thread waits on its own client only, with deadlines
//! ([`ServeOptions`]), and the interrupt eventfd is written by the node thread under a
//! watchdog, so a client that makes that write block stalls nobody, itself included, for
//! more than [`IRQ_WRITE_LIMIT`]. Simulated time is kept with wall time (it never runs ahead
//! of it, and moves with it when the fabric is idle), so timers and device-clock timeouts
//! mean what they say for clients that run at their own speed; runs are therefore not
//! reproducible the way in-process runs are.
//!
//! A client that sends a malformed message gets an error reply with an errno and the server
//! logs it, naming the client (node, connection number, pid) and the reason; one that
//! disconnects, dies (even mid-transfer), stays silent or idle too long has its NIC reset and
//! its DMA mappings removed, and the node serves the next client. Other nodes never notice
//! beyond what their peers' NICs do on the wire.

pub mod session;

use crate::{Fabric, FabricConfig};
use memmap2::MmapRaw;
use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nix::sys::socket::{
    getsockopt, recvmsg, sendmsg, sockopt, ControlMessage, ControlMessageOwned, MsgFlags,
};
use ringbell::{Port, PortError};
use ringbell_specs::{regs, SimTime};
use session::{Device, Outbox, Refusal, Session, Step};
use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vfio_bindings::bindings::vfio::{VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX};

/// What a doorbell word holds until the client stores into it (and again once the server has
/// taken the store). A doorbell value equal to it is not seen: producer indices reach it
/// only after 2^32 - 1 posts.
pub const DOORBELL_IDLE: u32 = u32::MAX;

/// Bytes of config space.
pub const CONFIG_SIZE: usize = 256;

/// Most DMA mappings one client may hold, whatever the budget (the `max_dma_maps` default of
/// the vfio-user specification).
pub const MAX_DMA_MAPPINGS: usize = 65535;

/// Bytes of address space the server maps for all clients' DMA together (32 TiB of the
/// 128 TiB a process has); each of the nodes' clients may map an equal share. A memory file
/// costs no memory until touched, so without it a client could exhaust the address space
/// with few mappings, and every node's next mapping or allocation would fail.
pub const DMA_ADDRESS_SPACE: u64 = 1 << 45;

/// Mappings of the process's `vm.max_map_count` kept for the server itself (code, heap,
/// thread stacks, BAR files); the rest is shared among the nodes' clients.
pub const RESERVED_MAPPINGS: usize = 8192;

/// The longest the node thread waits in a write to a client's interrupt eventfd (one that is
/// blocking and full): after it, the eventfd is dropped.
pub const IRQ_WRITE_LIMIT: Duration = Duration::from_millis(100);

/// Refusals of one connection logged line by line; the rest are counted in the line that
/// ends the connection, so that no client can flood the log.
pub const LOGGED_REFUSALS: u64 = 64;

/// Largest trapped access (a BlueFlame burst).
const MAX_ACCESS: usize = regs::BF_STRIDE as usize;

/// Doorbell slots of a node looked at per round besides the recently rung ones (the cost of
/// a round does not grow with the number of idle queues).
const COLD_SLOTS_PER_ROUND: usize = 256;

/// Rounds without a store after which a slot is no longer looked at every round.
const HOT_ROUNDS: u32 = 4096;

/// The socket of node `node` under `dir`.
pub fn socket_path(dir: &Path, node: usize) -> PathBuf {
    dir.join(format!("nic{node}.sock"))
}

/// How the server treats slow, silent and greedy clients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeOptions {
    /// How long a new client has to send VERSION, a client to finish a message it has begun,
    /// and a client to take a reply: then it is closed.
    pub client_timeout: Duration,
    /// How long a client may send nothing (no message, no doorbell store) before it is closed.
    pub idle_timeout: Duration,
    /// Most DMA mappings a client may hold (further capped by [`mapping_budget`]).
    pub max_dma_maps: usize,
    /// Most bytes of DMA mappings a client may hold (further capped to an equal share of
    /// [`DMA_ADDRESS_SPACE`]).
    pub max_dma_bytes: u64,
}

impl Default for ServeOptions {
    fn default() -> ServeOptions {
        ServeOptions {
            client_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(600),
            max_dma_maps: MAX_DMA_MAPPINGS,
            max_dma_bytes: DMA_ADDRESS_SPACE,
        }
    }
}

/// The DMA mappings each of `nodes` clients may hold when the process may have `map_count`
/// mappings in all (`vm.max_map_count`) and a client asks for at most `wanted`: an equal share
/// of what [`RESERVED_MAPPINGS`] leaves, so that no client can take another's, and the whole
/// stays below the limit.
pub fn mapping_budget(map_count: usize, nodes: usize, wanted: usize) -> usize {
    (map_count.saturating_sub(RESERVED_MAPPINGS) / nodes.max(1))
        .min(wanted)
        .min(MAX_DMA_MAPPINGS)
}

/// The process's mapping limit (`vm.max_map_count`; the kernel's default if unreadable).
fn max_map_count() -> usize {
    std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65530)
}

/// A device access handed from a node's thread to the fabric thread.
// A write carries its bytes inline (at most a BlueFlame burst): no allocation per access.
#[allow(clippy::large_enum_variant)]
enum Req {
    Read {
        offset: u64,
    },
    Write {
        offset: u64,
        data: [u8; MAX_ACCESS],
        len: usize,
    },
    DmaMap {
        fd: OwnedFd,
        iova: u64,
        len: u64,
    },
    DmaUnmap {
        iova: u64,
        len: u64,
    },
    /// Whether the client has an interrupt eventfd (the node thread is woken for interrupts).
    Irq(bool),
    /// The BAR0 mapping for the next client (its doorbell pages are polled from now on).
    Bar(MmapRaw),
    Reset,
    /// The client went away: reclaim the node.
    Gone,
}

/// The fabric's answer: up to two numbers.
type Answer = Result<[u64; 2], Refusal>;

struct Msg {
    node: usize,
    req: Req,
    reply: SyncSender<Answer>,
}

/// How a node's device reaches the fabric.
trait Link {
    /// Runs `req` on the node's NIC.
    fn ask(&mut self, req: Req) -> Answer;
}

/// The fabric thread, over a channel.
struct Channel {
    node: usize,
    tx: Sender<Msg>,
    reply_tx: SyncSender<Answer>,
    reply_rx: Receiver<Answer>,
}

impl Link for Channel {
    fn ask(&mut self, req: Req) -> Answer {
        let stopped = || Refusal::new(Errno::EIO, "the fabric has stopped");
        self.tx
            .send(Msg {
                node: self.node,
                req,
                reply: self.reply_tx.clone(),
            })
            .map_err(|_| stopped())?;
        self.reply_rx.recv().map_err(|_| stopped())?
    }
}

/// The doorbell pages of one client, as the fabric thread looks at them.
struct Doorbells {
    /// BAR0's memory file, mapped: only the doorbell pages are used.
    bar: MmapRaw,
    /// The live doorbell slots at the last full look, in offset order.
    slots: Vec<u64>,
    /// The live slots now (reused buffer).
    next_slots: Vec<u64>,
    /// Slots stored into lately, with the rounds since their last store.
    hot: Vec<(u64, u32)>,
    /// The next slot a round looks at besides the hot ones.
    cursor: usize,
    /// Stores found in slots that were not live yet (dropped, as a NIC drops a doorbell for
    /// a queue that does not exist).
    stale: u64,
}

/// One node's state on the fabric thread.
struct NodeState {
    db: Doorbells,
    /// The client has an interrupt eventfd: wake its node thread on an interrupt.
    irq: bool,
    irqs_seen: u64,
    /// Wakes the node thread (the server's own eventfd, non-blocking).
    wake: Option<Arc<EventFd>>,
    /// Doorbell stores taken (the node thread counts them as activity).
    activity: Arc<AtomicU64>,
}

impl NodeState {
    fn new(bar: MmapRaw) -> NodeState {
        let mut st = NodeState {
            db: Doorbells {
                bar,
                slots: Vec::new(),
                next_slots: Vec::new(),
                hot: Vec::new(),
                cursor: 0,
                stale: 0,
            },
            irq: false,
            irqs_seen: 0,
            wake: None,
            activity: Arc::new(AtomicU64::new(0)),
        };
        st.db.clear();
        st
    }
}

impl Doorbells {
    /// The doorbell word at `offset`, if it is a 4-aligned offset in the doorbell pages.
    fn word(&self, offset: u64) -> Option<&AtomicU32> {
        if !(regs::DB_BASE..regs::DB_END).contains(&offset) || !offset.is_multiple_of(4) {
            return None;
        }
        // SAFETY: `offset` is a 4-aligned offset inside the doorbell pages (checked above),
        // which lie inside the BAR0_SIZE mapping that `self` keeps alive; the mapping is
        // page-aligned, so the word is aligned. The client stores into the same page through
        // its own shared mapping, so the word is only ever reached atomically here.
        Some(unsafe { &*self.bar.as_ptr().add(offset as usize).cast::<AtomicU32>() })
    }

    /// Refills every doorbell word with [`DOORBELL_IDLE`] and forgets the slots (the NIC's
    /// objects are gone, or the pages belong to a new client).
    fn clear(&mut self) {
        for off in (regs::DB_BASE..regs::DB_END).step_by(4) {
            if let Some(w) = self.word(off) {
                w.store(DOORBELL_IDLE, Ordering::Relaxed);
            }
        }
        self.slots.clear();
        self.hot.clear();
        self.cursor = 0;
    }

    /// Takes the store in `slot` (both words): the values found, [`DOORBELL_IDLE`] for none.
    fn take(&self, slot: u64) -> [u32; 2] {
        let mut v = [DOORBELL_IDLE; 2];
        for (i, off) in [slot, slot + 4].into_iter().enumerate() {
            if let Some(w) = self.word(off) {
                if w.load(Ordering::Relaxed) != DOORBELL_IDLE {
                    v[i] = w.swap(DOORBELL_IDLE, Ordering::Acquire);
                }
            }
        }
        v
    }
}

/// Runs the server: binds `DIR/nic{i}.sock` for every node of `cfg` (removing stale sockets),
/// calls `ready` once all are listening, and serves until the process ends.
pub fn serve(
    dir: &Path,
    cfg: FabricConfig,
    opts: ServeOptions,
    ready: impl FnOnce(),
) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    watchdog::install()?;
    let nodes = cfg.nodes;
    let max_dma_maps = mapping_budget(max_map_count(), nodes, opts.max_dma_maps);
    let mut states = Vec::with_capacity(nodes);
    for _ in 0..nodes {
        let (_, bar) = bar_file()?;
        let mut st = NodeState::new(bar);
        st.wake = Some(Arc::new(EventFd::from_flags(
            EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC,
        )?));
        states.push(st);
    }
    let (tx, rx) = mpsc::channel::<Msg>();
    let mut listeners = Vec::with_capacity(nodes);
    for node in 0..nodes {
        let path = socket_path(dir, node);
        if path.exists() {
            std::fs::remove_file(&path)?;
        }
        let listener = UnixListener::bind(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        listeners.push(listener);
    }
    for (node, listener) in listeners.into_iter().enumerate() {
        let (reply_tx, reply_rx) = mpsc::sync_channel(1);
        let link = Channel {
            node,
            tx: tx.clone(),
            reply_tx,
            reply_rx,
        };
        let st = &states[node];
        let wake = st.wake.clone().expect("made above");
        let activity = st.activity.clone();
        let opts = ServeOptions {
            max_dma_maps,
            max_dma_bytes: opts
                .max_dma_bytes
                .min(DMA_ADDRESS_SPACE / nodes.max(1) as u64),
            ..opts.clone()
        };
        std::thread::Builder::new()
            .name(format!("nic{node}"))
            .spawn(move || node_thread(node, listener, link, wake, activity, opts))?;
    }
    drop(tx);
    ready();
    let fabric = Fabric::new(cfg);
    fabric_loop(&fabric, &mut states, rx);
    Ok(())
}

/// A fresh BAR0 memory file and the server's mapping of it. Each client gets its own, so a
/// client that has gone (but kept its mapping of the doorbell pages) cannot store into the
/// next one's doorbells; no client may resize it under the server's mapping (a touch past
/// the end of a shared mapping is a SIGBUS).
fn bar_file() -> io::Result<(File, MmapRaw)> {
    let fd = memfd_create(
        c"ringbell-bar0",
        MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
    )?;
    let file = File::from(fd);
    file.set_len(regs::BAR0_SIZE)?;
    fcntl(
        file.as_raw_fd(),
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
        ),
    )?;
    let bar = MmapRaw::map_raw(&file)?;
    Ok((file, bar))
}

/// The type-0 config space of a ringbell NIC.
fn config_space() -> [u8; CONFIG_SIZE] {
    let mut c = [0u8; CONFIG_SIZE];
    c[0..2].copy_from_slice(&regs::PCI_VENDOR_ID.to_le_bytes());
    c[2..4].copy_from_slice(&regs::PCI_DEVICE_ID.to_le_bytes());
    // Class: network controller (0x02), InfiniBand (0x07); revision 1.
    c[8] = 1;
    c[0x0A] = 0x07;
    c[0x0B] = 0x02;
    // BAR0: 64-bit memory, not prefetchable.
    c[0x10] = 0b100;
    c[0x2C..0x2E].copy_from_slice(&regs::PCI_VENDOR_ID.to_le_bytes());
    c[0x2E..0x30].copy_from_slice(&regs::PCI_DEVICE_ID.to_le_bytes());
    c
}

/// A node's PCI function as one client sees it: config space here, the NIC on the fabric.
struct NodeBackend<L: Link> {
    link: L,
    config: [u8; CONFIG_SIZE],
    /// This client's BAR0 memory file.
    bar: File,
    /// The client's interrupt eventfd.
    irq: Option<OwnedFd>,
    /// DMA mappings the client holds, and the most it may.
    maps: usize,
    max_maps: usize,
    /// Bytes those mappings span, and the most they may.
    bytes: u64,
    max_bytes: u64,
}

fn einval(what: String) -> Refusal {
    Refusal::new(Errno::EINVAL, what)
}

impl<L: Link> NodeBackend<L> {
    fn new(link: L, bar: File, max_maps: usize, max_bytes: u64) -> NodeBackend<L> {
        NodeBackend {
            link,
            config: config_space(),
            bar,
            irq: None,
            maps: 0,
            max_maps,
            bytes: 0,
            max_bytes,
        }
    }

    /// Checks a BAR0 access: inside the BAR, 4 bytes aligned, or a BlueFlame burst (a
    /// multiple of 64 bytes up to 256, 64-byte aligned).
    fn check_bar(&self, offset: u64, len: usize, write: bool) -> Result<(), Refusal> {
        let end = offset.checked_add(len as u64);
        let ok = end.is_some_and(|e| e <= regs::BAR0_SIZE)
            && ((len == 4 && offset.is_multiple_of(4))
                || (write
                    && len.is_multiple_of(64)
                    && (64..=MAX_ACCESS).contains(&len)
                    && offset.is_multiple_of(64)));
        if ok {
            Ok(())
        } else {
            let dir = if write { "write" } else { "read" };
            Err(einval(format!(
                "BAR0 {dir} of {len} bytes at {offset:#x}: 4 aligned bytes, or a write of \
                 64..=256 bytes (a multiple of 64) at a 64-byte boundary"
            )))
        }
    }

    /// Checks a config-space access; the offset as an index.
    fn config_range(&self, offset: u64, len: usize) -> Result<usize, Refusal> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= CONFIG_SIZE as u64 => Ok(offset as usize),
            _ => Err(einval(format!(
                "config access of {len} bytes at {offset:#x}"
            ))),
        }
    }

    fn config_write(&mut self, offset: usize, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            let at = offset + i;
            match at {
                // Command register: memory space, bus master, interrupt disable.
                0x04 => self.config[at] = b & 0x06,
                0x05 => self.config[at] = b & 0x04,
                // BAR0 low: size probing; the low 4 bits are read-only.
                0x10 => self.config[at] = (self.config[at] & 0x0F) | (b & 0xF0),
                0x11..=0x13 => self.config[at] = *b,
                // BAR0 high dword.
                0x14..=0x17 => self.config[at] = *b,
                _ => {}
            }
        }
        // The BAR's size bits read as zero.
        let low = u32::from_le_bytes(self.config[0x10..0x14].try_into().unwrap_or([0; 4]));
        let mask = !(regs::BAR0_SIZE as u32 - 1);
        self.config[0x10..0x14].copy_from_slice(&((low & mask) | (low & 0xF)).to_le_bytes());
    }
}

impl<L: Link> Device for NodeBackend<L> {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> Result<(), Refusal> {
        match region {
            VFIO_PCI_CONFIG_REGION_INDEX => {
                let at = self.config_range(offset, data.len())?;
                data.copy_from_slice(&self.config[at..][..data.len()]);
                Ok(())
            }
            VFIO_PCI_BAR0_REGION_INDEX => {
                self.check_bar(offset, data.len(), false)?;
                let [v, _] = self.link.ask(Req::Read { offset })?;
                data.copy_from_slice(&(v as u32).to_le_bytes());
                Ok(())
            }
            _ => Err(einval(format!("read of region {region}, which is empty"))),
        }
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), Refusal> {
        match region {
            VFIO_PCI_CONFIG_REGION_INDEX => {
                let at = self.config_range(offset, data.len())?;
                self.config_write(at, data);
                Ok(())
            }
            VFIO_PCI_BAR0_REGION_INDEX => {
                self.check_bar(offset, data.len(), true)?;
                let mut buf = [0u8; MAX_ACCESS];
                buf[..data.len()].copy_from_slice(data);
                self.link
                    .ask(Req::Write {
                        offset,
                        data: buf,
                        len: data.len(),
                    })
                    .map(|_| ())
            }
            _ => Err(einval(format!("write of region {region}, which is empty"))),
        }
    }

    fn dma_map(&mut self, fd: OwnedFd, iova: u64, len: u64) -> Result<(), Refusal> {
        let what = format!("{iova:#x}+{len:#x}");
        if len == 0
            || len > crate::iommu::MAX_MAPPING
            || iova.checked_add(len).is_none()
            || !iova.is_multiple_of(4096)
        {
            return Err(einval(format!(
                "{what}: empty, wrapping, above {:#x} bytes or at an IOVA that is not \
                 page-aligned",
                crate::iommu::MAX_MAPPING
            )));
        }
        if self.maps >= self.max_maps {
            return Err(Refusal::new(
                Errno::ENOSPC,
                format!(
                    "{what}: the client holds {} DMA mappings, the most it may",
                    self.maps
                ),
            ));
        }
        if len > self.max_bytes - self.bytes {
            return Err(Refusal::new(
                Errno::ENOSPC,
                format!(
                    "{what}: the client's mappings span {:#x} bytes, the most they may is {:#x}",
                    self.bytes, self.max_bytes
                ),
            ));
        }
        let file = File::from(fd);
        // Sealed before its size is read: the size cannot shrink after the check, and a
        // descriptor that is no memory file fails here at once (F_ADD_SEALS works only on
        // shmem) instead of a stat that a file the client serves itself could block.
        seal_against_shrinking(&file).map_err(|e| einval(format!("{what}: {e}")))?;
        match file.metadata() {
            Ok(m) if m.is_file() && m.len() >= len => {}
            Ok(m) => {
                return Err(einval(format!(
                    "{what}: the memory file holds {} bytes",
                    m.len()
                )))
            }
            Err(e) => return Err(einval(format!("{what}: the memory file: {e}"))),
        }
        self.link.ask(Req::DmaMap {
            fd: file.into(),
            iova,
            len,
        })?;
        self.maps += 1;
        self.bytes += len;
        Ok(())
    }

    fn dma_unmap(&mut self, iova: u64, len: u64) -> Result<(), Refusal> {
        self.link.ask(Req::DmaUnmap { iova, len })?;
        // An unmap matches one mapping exactly (its IOVA and length).
        self.maps = self.maps.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(len);
        Ok(())
    }

    fn set_irq(&mut self, fd: Option<OwnedFd>) -> Result<(), Refusal> {
        let on = fd.is_some();
        self.irq = fd;
        self.link.ask(Req::Irq(on)).map(|_| ())
    }

    fn reset(&mut self) -> Result<(), Refusal> {
        self.link.ask(Req::Reset).map(|_| ())
    }

    fn bar_fd(&self) -> BorrowedFd<'_> {
        self.bar.as_fd()
    }
}

/// Keeps a client from shrinking a memory file it has mapped for DMA: the server maps the
/// file too, and a touch past the end of a shared mapping is a SIGBUS that would take every
/// node down. The file must carry `F_SEAL_SHRINK`, added here if it takes seals (a memfd
/// created with `MFD_ALLOW_SEALING`, as the driver's are); other files are refused.
fn seal_against_shrinking(file: &File) -> Result<(), String> {
    let fd = file.as_raw_fd();
    let seals = fcntl(fd, FcntlArg::F_GET_SEALS)
        .map_err(|e| format!("the memory file takes no seals ({e}): only a memfd is mapped"))?;
    if SealFlag::from_bits_truncate(seals).contains(SealFlag::F_SEAL_SHRINK) {
        return Ok(());
    }
    fcntl(fd, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK))
        .map(|_| ())
        .map_err(|e| {
            format!(
                "the memory file cannot be sealed against shrinking ({e}): create it with \
                 MFD_ALLOW_SEALING"
            )
        })
}

/// Writes to a client's interrupt eventfd from a node thread, never for longer than
/// [`IRQ_WRITE_LIMIT`]: a one-shot timer of the thread's own sends it a signal whose handler
/// does nothing, which ends a `write(2)` that blocks (a blocking eventfd at its limit) with
/// EINTR.
mod watchdog {
    use super::IRQ_WRITE_LIMIT;
    use nix::errno::Errno;
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigEvent, SigHandler, SigSet};
    use nix::sys::signal::{SigevNotify, Signal};
    use nix::sys::time::TimeSpec;
    use nix::sys::timer::{Expiration, Timer, TimerSetTimeFlags};
    use nix::time::ClockId;
    use std::os::fd::BorrowedFd;

    /// The signal the timer sends.
    const SIGNAL: Signal = Signal::SIGUSR2;

    extern "C" fn interrupted(_: nix::libc::c_int) {}

    /// Installs the signal's handler (without `SA_RESTART`, so a blocked write returns).
    pub fn install() -> std::io::Result<()> {
        let action = SigAction::new(
            SigHandler::Handler(interrupted),
            SaFlags::empty(),
            SigSet::empty(),
        );
        // SAFETY: the handler does nothing at all, so it is async-signal-safe; replacing the
        // default action (terminate) of a signal the server does not otherwise use.
        unsafe { sigaction(SIGNAL, &action) }?;
        Ok(())
    }

    /// A node thread's timer.
    pub struct Watchdog(Timer);

    impl Watchdog {
        /// A timer that signals the calling thread.
        pub fn new() -> std::io::Result<Watchdog> {
            let ev = SigEvent::new(SigevNotify::SigevThreadId {
                signal: SIGNAL,
                thread_id: nix::unistd::gettid().as_raw(),
                si_value: 0,
            });
            Ok(Watchdog(Timer::new(ClockId::CLOCK_MONOTONIC, ev)?))
        }

        /// Adds 1 to eventfd `fd`: `Ok` when written, or when the counter is full and the
        /// descriptor non-blocking (the eventfd is readable anyway); an error when the write
        /// failed or blocked for [`IRQ_WRITE_LIMIT`].
        pub fn signal(&mut self, fd: BorrowedFd<'_>) -> Result<(), String> {
            let limit = TimeSpec::from_duration(IRQ_WRITE_LIMIT);
            self.0
                .set(Expiration::OneShot(limit), TimerSetTimeFlags::empty())
                .map_err(|e| format!("arming the watchdog: {e}"))?;
            let r = nix::unistd::write(fd, &1u64.to_ne_bytes());
            let _ = self.0.set(
                Expiration::OneShot(TimeSpec::new(0, 0)),
                TimerSetTimeFlags::empty(),
            );
            match r {
                Ok(_) | Err(Errno::EAGAIN) => Ok(()),
                Err(Errno::EINTR) => Err(format!(
                    "the interrupt eventfd blocked a write for {IRQ_WRITE_LIMIT:?} (blocking and \
                     full)"
                )),
                Err(e) => Err(format!("writing the interrupt eventfd: {e}")),
            }
        }
    }
}

/// How one client's connection ended.
struct Ending {
    how: String,
}

/// Serves node `node`'s socket forever, one client at a time, each with its own BAR0 file.
fn node_thread(
    node: usize,
    listener: UnixListener,
    mut link: Channel,
    wake: Arc<EventFd>,
    activity: Arc<AtomicU64>,
    opts: ServeOptions,
) {
    let mut watchdog = match watchdog::Watchdog::new() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("ringbell-emu serve: node {node}: no interrupt watchdog ({e}); not serving");
            return;
        }
    };
    let mut serial = 0u64;
    loop {
        // A fresh BAR0 file first: a client is only taken once it has one of its own.
        let (file, bar) = match bar_file() {
            Ok(b) => b,
            Err(e) => {
                eprintln!(
                    "ringbell-emu serve: node {node}: no BAR0 file for the next client ({e}); \
                     retrying in a second"
                );
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        if link.ask(Req::Bar(bar)).is_err() {
            return;
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                eprintln!("ringbell-emu serve: node {node}: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        serial += 1;
        let pid = getsockopt(&stream, sockopt::PeerCredentials)
            .map(|c| c.pid().to_string())
            .unwrap_or_else(|_| "?".into());
        let who = format!("ringbell-emu serve: node {node}: client {serial} (pid {pid})");
        let mut be = NodeBackend::new(link, file, opts.max_dma_maps, opts.max_dma_bytes);
        let mut session = Session::new(opts.max_dma_maps);
        let end = serve_client(
            &stream,
            &mut session,
            &mut be,
            &wake,
            &activity,
            &opts,
            &mut watchdog,
            &who,
        );
        drop(stream);
        link = be.link;
        let reclaimed = link.ask(Req::Gone);
        let Ok([maps, stale]) = reclaimed else {
            return;
        };
        eprintln!(
            "{who} {} ({} messages, {} refused, {stale} doorbell stores before their queue \
             existed); NIC reset, {maps} DMA mappings reclaimed",
            end.how,
            session.messages(),
            session.refused(),
        );
    }
}

/// Waits at most `left` for one of `fds` to be ready (a signal ends the wait early).
fn wait(fds: &mut [PollFd<'_>], left: Duration) -> io::Result<()> {
    let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
    match poll(fds, PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)) {
        Ok(_) | Err(Errno::EINTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Speaks the protocol with one client until it goes, is closed or breaks it.
#[allow(clippy::too_many_arguments)]
fn serve_client(
    stream: &UnixStream,
    session: &mut Session,
    be: &mut NodeBackend<Channel>,
    wake: &EventFd,
    activity: &AtomicU64,
    opts: &ServeOptions,
    watchdog: &mut watchdog::Watchdog,
    who: &str,
) -> Ending {
    let end = |how: String| Ending { how };
    if let Err(e) = stream.set_nonblocking(true) {
        return end(format!("dropped: {e}"));
    }
    let raw = stream.as_raw_fd();
    let connected = Instant::now();
    let mut last = connected;
    let mut seen = activity.load(Ordering::Relaxed);
    let mut started: Option<Instant> = None;
    let mut out = Outbox::default();
    // Room for as many descriptors as Linux passes in one message (SCM_MAX_FD): a smaller
    // buffer truncates the control message, and the descriptors installed before the cut
    // could not be taken (nix gives no iterator then) and would leak.
    let mut cmsg = nix::cmsg_space!([RawFd; ringbell::vfio::user::SCM_MAX_FD]);
    loop {
        let now = Instant::now();
        let (deadline, late) = if !session.negotiated() {
            (connected + opts.client_timeout, "sent no VERSION")
        } else if let Some(t) = started {
            (t + opts.client_timeout, "left a message unfinished")
        } else {
            (last + opts.idle_timeout, "was idle")
        };
        if now >= deadline {
            let a = activity.load(Ordering::Relaxed);
            if started.is_none() && session.negotiated() && a != seen {
                // Doorbell stores count as activity.
                seen = a;
                last = now;
                continue;
            }
            let limit = if started.is_none() && session.negotiated() {
                opts.idle_timeout
            } else {
                opts.client_timeout
            };
            return end(format!("closed: it {late} for {limit:?}"));
        }
        let (sock_ready, woken) = {
            let mut fds = [
                PollFd::new(stream.as_fd(), PollFlags::POLLIN),
                PollFd::new(wake.as_fd(), PollFlags::POLLIN),
            ];
            if let Err(e) = wait(&mut fds, deadline - now) {
                return end(format!("dropped: poll: {e}"));
            }
            let ready = |f: &PollFd<'_>| f.revents().is_some_and(|r| !r.is_empty());
            (ready(&fds[0]), ready(&fds[1]))
        };
        if woken {
            let _ = wake.read();
            if let Some(fd) = &be.irq {
                if let Err(e) = watchdog.signal(fd.as_fd()) {
                    eprintln!("{who}: interrupt eventfd dropped: {e}");
                    be.irq = None;
                    let _ = be.link.ask(Req::Irq(false));
                }
            }
        }
        if !sock_ready {
            continue;
        }
        let (n, fds, truncated) = {
            let want = session.want();
            let mut iov = [IoSliceMut::new(want)];
            cmsg.clear();
            match recvmsg::<()>(
                raw,
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(m) => {
                    let mut fds = Vec::new();
                    if let Ok(it) = m.cmsgs() {
                        for c in it {
                            if let ControlMessageOwned::ScmRights(v) = c {
                                fds.extend(v);
                            }
                        }
                    }
                    (m.bytes, fds, m.flags.contains(MsgFlags::MSG_CTRUNC))
                }
                Err(Errno::EAGAIN | Errno::EINTR) => continue,
                Err(e) => return end(format!("dropped: {e}")),
            }
        };
        // SAFETY: each descriptor arrived with SCM_RIGHTS in this message and is owned by
        // nothing else in this process.
        let fds: Vec<OwnedFd> = fds
            .into_iter()
            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
            .collect();
        if n == 0 {
            let how = if session.in_message() {
                "hung up in the middle of a message"
            } else {
                "disconnected"
            };
            return end(how.into());
        }
        session.add_fds(fds);
        if truncated {
            session.fds_truncated();
        }
        if started.is_none() {
            // Not `now`: that was before the wait, which may have been long.
            started = Some(Instant::now());
        }
        let step = session.took(n, be, &mut out);
        if !session.in_message() {
            started = None;
            last = Instant::now();
        }
        if let Some(r) = &out.refusal {
            match session.refused() {
                n if n <= LOGGED_REFUSALS => eprintln!("{who}: refused {} ({})", r.reason, r.errno),
                n if n == LOGGED_REFUSALS + 1 => eprintln!(
                    "{who}: refused {} ({}); its further refusals are only counted",
                    r.reason, r.errno
                ),
                _ => {}
            }
        }
        if let Err(e) = send_all(stream, &out, opts.client_timeout) {
            return end(format!("dropped: its reply could not be sent ({e})"));
        }
        out.clear();
        if let Step::Close(why) = step {
            return end(format!("dropped: {why}"));
        }
    }
}

/// Sends what `out` holds, its descriptor with the first byte, waiting at most `limit` for
/// the client to make room.
fn send_all(stream: &UnixStream, out: &Outbox, limit: Duration) -> io::Result<()> {
    let deadline = Instant::now() + limit;
    let mut sent = 0;
    while sent < out.bytes.len() {
        let fds: Vec<RawFd> = out.fd.into_iter().collect();
        let rights = [ControlMessage::ScmRights(&fds)];
        let cmsgs: &[ControlMessage<'_>] = if sent == 0 && !fds.is_empty() {
            &rights
        } else {
            &[]
        };
        match sendmsg::<()>(
            stream.as_raw_fd(),
            &[IoSlice::new(&out.bytes[sent..])],
            cmsgs,
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => sent += n,
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the client took no reply for {limit:?}"),
                    ));
                }
                let mut fds = [PollFd::new(stream.as_fd(), PollFlags::POLLOUT)];
                wait(&mut fds, left)?;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// How long the fabric runs on for a client that went, before its NIC is reset (enough for
/// the NIC to fetch and send what the client posted last).
const GONE_DRAIN: SimTime = SimTime(100_000_000);
/// The most events that run takes (the fabric thread's other work waits meanwhile).
const GONE_DRAIN_EVENTS: u32 = 1 << 16;

/// The fabric thread: requests, doorbells, events paced by wall time, interrupts.
fn fabric_loop(fabric: &Fabric, states: &mut [NodeState], rx: Receiver<Msg>) {
    let start = Instant::now();
    let mut idle_rounds = 0u32;
    loop {
        let mut busy = false;
        loop {
            match rx.try_recv() {
                Ok(m) => {
                    busy = true;
                    let a = handle(fabric, states, m.node, m.req);
                    let _ = m.reply.send(a);
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
        for node in 0..states.len() {
            busy |= poll_doorbells(fabric, states, node, false);
        }
        let wall = SimTime(start.elapsed().as_nanos() as u64 * 1000);
        let mut ran = 0;
        while ran < 4096 && fabric.next_event_at().is_some_and(|t| t <= wall) {
            fabric.step();
            ran += 1;
        }
        busy |= ran > 0;
        if ran < 4096 {
            fabric.advance_to(wall);
        }
        for (node, st) in states.iter_mut().enumerate() {
            let n = fabric.interrupts(node);
            if n != st.irqs_seen {
                st.irqs_seen = n;
                if st.irq {
                    if let Some(w) = &st.wake {
                        // The server's own non-blocking eventfd: never waits.
                        let _ = w.write(1);
                    }
                }
            }
        }
        if busy {
            idle_rounds = 0;
            continue;
        }
        idle_rounds = idle_rounds.saturating_add(1);
        if idle_rounds < 64 {
            std::thread::yield_now();
            continue;
        }
        // Idle: sleep until a request, the next event or the next doorbell poll.
        let until_event = fabric.next_event_at().map(|t| {
            let now = start.elapsed().as_nanos() as u64 * 1000;
            Duration::from_nanos(t.ps().saturating_sub(now) / 1000)
        });
        // Long idle (a second or so): look at the doorbells less often, to spare the CPU.
        let poll = if idle_rounds > 20_000 {
            IDLE_POLL_SLOW
        } else {
            IDLE_POLL
        };
        let nap = until_event.map_or(poll, |d| d.min(poll));
        match rx.recv_timeout(nap) {
            Ok(m) => {
                idle_rounds = 0;
                let a = handle(fabric, states, m.node, m.req);
                let _ = m.reply.send(a);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// How often an idle server looks at the doorbell pages.
const IDLE_POLL: Duration = Duration::from_micros(50);
/// How often it looks after a second or so of idleness.
const IDLE_POLL_SLOW: Duration = Duration::from_millis(1);

/// Feeds the stores found in node `node`'s doorbell slots to its NIC; `true` if any.
///
/// A `full` look (before every trapped access of the node's client) learns the live slots
/// from the NIC and looks at all of them. Any other round looks at the slots rung lately and
/// at [`COLD_SLOTS_PER_ROUND`] more, in turn: its cost does not grow with the number of idle
/// queues, and a store into an idle queue is seen within `live slots / 256` rounds.
fn poll_doorbells(fabric: &Fabric, states: &mut [NodeState], node: usize, full: bool) -> bool {
    let st = &mut states[node];
    let db = &mut st.db;
    let port = fabric.port(node);
    let mut rung = 0u64;
    let mut ring = |db: &Doorbells, slot: u64| {
        let v = db.take(slot);
        for (i, v) in v.into_iter().enumerate() {
            if v != DOORBELL_IDLE {
                port.write32(slot + 4 * i as u64, v);
                rung += 1;
            }
        }
        v != [DOORBELL_IDLE; 2]
    };
    if full {
        let mut slots = std::mem::take(&mut db.next_slots);
        fabric.doorbell_slots(node, &mut slots);
        for &slot in &slots {
            // A slot that has just come alive can only hold stores made before its queue
            // existed: the client learns of a new queue through a trapped read of the
            // command status, and every trapped access is preceded by a full look.
            if db.slots.binary_search(&slot).is_err() {
                if db.take(slot) != [DOORBELL_IDLE; 2] {
                    db.stale += 1;
                }
                continue;
            }
            if ring(db, slot) && !db.hot.iter().any(|(s, _)| *s == slot) {
                db.hot.push((slot, 0));
            }
        }
        db.next_slots = std::mem::replace(&mut db.slots, slots);
        let live = &db.slots;
        db.hot.retain(|(s, _)| live.binary_search(s).is_ok());
    } else {
        let mut i = 0;
        while i < db.hot.len() {
            let slot = db.hot[i].0;
            if ring(db, slot) {
                db.hot[i].1 = 0;
            } else {
                db.hot[i].1 += 1;
                if db.hot[i].1 > HOT_ROUNDS {
                    db.hot.swap_remove(i);
                    continue;
                }
            }
            i += 1;
        }
        let n = db.slots.len();
        for _ in 0..n.min(COLD_SLOTS_PER_ROUND) {
            db.cursor = if db.cursor + 1 >= n { 0 } else { db.cursor + 1 };
            let slot = db.slots[db.cursor];
            if ring(db, slot) && !db.hot.iter().any(|(s, _)| *s == slot) {
                db.hot.push((slot, 0));
            }
        }
    }
    if rung > 0 {
        st.activity.fetch_add(rung, Ordering::Relaxed);
    }
    rung > 0
}

/// Runs one request of node `node`'s client on the fabric thread.
fn handle(fabric: &Fabric, states: &mut [NodeState], node: usize, req: Req) -> Answer {
    // A client's doorbell stores come before its later trapped accesses.
    poll_doorbells(fabric, states, node, true);
    let port = fabric.port(node);
    match req {
        Req::Read { offset } => Ok([u64::from(port.read32(offset)), 0]),
        Req::Write { offset, data, len } => {
            let data = &data[..len.min(MAX_ACCESS)];
            if let &[a, b, c, d] = data {
                port.write32(offset, u32::from_le_bytes([a, b, c, d]));
            } else {
                port.write_block(offset, data);
            }
            Ok([0, 0])
        }
        Req::DmaMap { fd, iova, len } => match port.dma_map(fd.as_fd(), len, iova) {
            Ok(()) => Ok([0, 0]),
            Err(PortError::Overlap { .. }) => Err(Refusal::new(
                Errno::EEXIST,
                format!("{iova:#x}+{len:#x} overlaps a mapping"),
            )),
            Err(e) => Err(Refusal::new(
                Errno::ENOMEM,
                format!("{iova:#x}+{len:#x}: {e}"),
            )),
        },
        Req::DmaUnmap { iova, len } => port
            .dma_unmap(iova, len)
            .map(|_| [0, 0])
            .map_err(|e| Refusal::new(Errno::ENOENT, e.to_string())),
        Req::Irq(on) => {
            states[node].irq = on;
            Ok([0, 0])
        }
        Req::Bar(bar) => {
            let db = &mut states[node].db;
            db.bar = bar;
            db.clear();
            Ok([0, 0])
        }
        Req::Reset => {
            port.write32(regs::RESET, regs::RESET_KEY);
            states[node].db.clear();
            Ok([0, 0])
        }
        Req::Gone => {
            // What the client posted before it went still goes out, as a NIC that had its
            // doorbell sends it whatever becomes of the process: its last doorbell stores
            // are taken, and the fabric runs on (at most GONE_DRAIN of simulated time, a
            // little ahead of the wall clock) before its NIC is reset. A datagram sent just
            // before `exit` reaches its peer.
            poll_doorbells(fabric, states, node, true);
            let until = fabric.now() + GONE_DRAIN;
            let mut ran = 0;
            while ran < GONE_DRAIN_EVENTS && fabric.next_event_at().is_some_and(|t| t <= until) {
                fabric.step();
                ran += 1;
            }
            let n = fabric.reclaim_node(node);
            let st = &mut states[node];
            st.irq = false;
            st.db.clear();
            let stale = std::mem::take(&mut st.db.stale);
            Ok([n as u64, stale])
        }
    }
}

/// The server's message handling for one NIC in this process, without sockets or threads:
/// a [`Session`] over the same device and fabric code the server runs, fed bytes directly.
/// For fuzzing and tests.
#[doc(hidden)]
pub struct Loopback {
    session: Session,
    be: NodeBackend<Direct>,
    out: Outbox,
    replies: Vec<u8>,
}

/// A link that runs requests on an in-process fabric.
struct Direct {
    fabric: Fabric,
    states: Vec<NodeState>,
}

impl Link for Direct {
    fn ask(&mut self, req: Req) -> Answer {
        handle(&self.fabric, &mut self.states, 0, req)
    }
}

impl Loopback {
    /// One NIC, a fresh BAR0 file, a client allowed `max_dma_maps` mappings.
    pub fn new(max_dma_maps: usize) -> io::Result<Loopback> {
        let (file, bar) = bar_file()?;
        let direct = Direct {
            fabric: Fabric::new(FabricConfig::new(1, 1)),
            states: vec![NodeState::new(bar)],
        };
        Ok(Loopback {
            session: Session::new(max_dma_maps),
            be: NodeBackend::new(direct, file, max_dma_maps, DMA_ADDRESS_SPACE),
            out: Outbox::default(),
            replies: Vec::new(),
        })
    }

    /// Feeds `bytes` as they would arrive, `fds` with the first of them; the server's
    /// replies are appended to [`Loopback::replies`]. `Err` with the reason once the server
    /// closes the connection (the rest of `bytes` is not read).
    pub fn feed(&mut self, bytes: &[u8], fds: Vec<OwnedFd>) -> Result<(), String> {
        let mut rest = bytes;
        let mut fds = Some(fds);
        while !rest.is_empty() {
            let want = self.session.want();
            let n = want.len().min(rest.len());
            want[..n].copy_from_slice(&rest[..n]);
            rest = &rest[n..];
            if let Some(f) = fds.take() {
                self.session.add_fds(f);
            }
            let step = self.session.took(n, &mut self.be, &mut self.out);
            self.replies.extend_from_slice(&self.out.bytes);
            self.out.clear();
            if let Step::Close(why) = step {
                return Err(why);
            }
        }
        Ok(())
    }

    /// Every reply so far, back to back.
    pub fn replies(&self) -> &[u8] {
        &self.replies
    }

    /// Forgets the replies read so far.
    pub fn clear_replies(&mut self) {
        self.replies.clear();
    }

    /// Lets the NIC run up to `events` events.
    pub fn run(&mut self, events: u64) {
        self.be.link.fabric.run_until_idle(events);
    }

    /// DMA mappings the NIC holds.
    pub fn dma_mappings(&self) -> usize {
        self.be.link.fabric.dma_mappings(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend whose link answers nothing (config space and checks only).
    struct Nothing;

    impl Link for Nothing {
        fn ask(&mut self, _: Req) -> Answer {
            Err(Refusal::new(Errno::EIO, "no fabric"))
        }
    }

    /// A backend whose link carries out every request (the fabric's own checks aside).
    struct Accept;

    impl Link for Accept {
        fn ask(&mut self, _: Req) -> Answer {
            Ok([0, 0])
        }
    }

    #[test]
    fn dma_mappings_are_bounded_in_bytes_and_only_memory_files_are_taken() {
        let mapped = |len: u64| -> OwnedFd {
            let fd = memfd_create(c"dma", MemFdCreateFlag::MFD_ALLOW_SEALING).unwrap();
            let f = File::from(fd);
            f.set_len(len).unwrap();
            f.into()
        };
        let (file, _) = bar_file().unwrap();
        let mut be = NodeBackend::new(Accept, file, 100, 2 << 20);
        be.dma_map(mapped(1 << 20), 0x10000, 1 << 20).unwrap();
        be.dma_map(mapped(1 << 20), 0x200000, 1 << 20).unwrap();
        let e = be.dma_map(mapped(4096), 0x400000, 4096).unwrap_err();
        assert_eq!(e.errno, Errno::ENOSPC, "{}", e.reason);
        be.dma_unmap(0x10000, 1 << 20).unwrap();
        be.dma_map(mapped(4096), 0x400000, 4096).unwrap();
        // A pipe is no memory file: refused before anything reads its size.
        let (r, _w) = nix::unistd::pipe().unwrap();
        assert_eq!(
            be.dma_map(r, 0x800000, 4096).unwrap_err().errno,
            Errno::EINVAL
        );
        assert_eq!(be.maps, 2);
    }

    #[test]
    fn config_space_names_the_nic_and_sizes_bar0() {
        let (file, _) = bar_file().unwrap();
        let mut be = NodeBackend::new(Nothing, file, 4, DMA_ADDRESS_SPACE);
        let mut id = [0u8; 4];
        be.region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut id)
            .unwrap();
        assert_eq!(id, [0xe5, 0x1d, 0x01, 0x00]);
        // Size probing: all ones in, the size mask out.
        be.region_write(VFIO_PCI_CONFIG_REGION_INDEX, 0x10, &[0xFF; 4])
            .unwrap();
        let mut bar = [0u8; 4];
        be.region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0x10, &mut bar)
            .unwrap();
        let v = u32::from_le_bytes(bar);
        assert_eq!(v & !0xF, !(regs::BAR0_SIZE as u32 - 1));
        assert_eq!(v & 0xF, 0b100, "64-bit memory BAR");
        // Out of range and other regions are refused with EINVAL, nothing changes.
        let e = be
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, 254, &mut bar)
            .unwrap_err();
        assert_eq!(e.errno, Errno::EINVAL);
        assert_eq!(
            be.region_write(3, 0, &[0; 4]).unwrap_err().errno,
            Errno::EINVAL
        );
        assert!(be.check_bar(regs::BAR0_SIZE - 2, 4, false).is_err());
        assert!(be.check_bar(2, 4, true).is_err());
        assert!(be.check_bar(regs::BF_BASE, 128, false).is_err());
        assert!(be.check_bar(regs::BF_BASE, 128, true).is_ok());
        assert!(be.check_bar(regs::BF_BASE + 32, 64, true).is_err());
        assert!(be.check_bar(u64::MAX - 1, 4, true).is_err());
    }

    #[test]
    fn the_mapping_budget_is_shared_below_the_process_limit() {
        assert_eq!(mapping_budget(65530, 4, MAX_DMA_MAPPINGS), 14334);
        assert_eq!(mapping_budget(65530, 1, 100), 100);
        assert_eq!(mapping_budget(1 << 30, 1, usize::MAX), MAX_DMA_MAPPINGS);
        assert_eq!(
            mapping_budget(4096, 2, 100),
            0,
            "nothing beyond the reserve"
        );
        for nodes in 1..=1024 {
            assert!(nodes * mapping_budget(65530, nodes, usize::MAX) + RESERVED_MAPPINGS <= 65530);
        }
    }

    #[test]
    fn stores_into_a_slot_before_its_queue_exists_are_dropped() {
        use ringbell::{Device as Dev, QpInit};
        let fabric = Fabric::new(FabricConfig::new(1, 1));
        let (_file, bar) = bar_file().unwrap();
        let mut states = vec![NodeState::new(bar)];
        let dev = Dev::open(Box::new(fabric.port(0))).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(16).unwrap();
        // The first QP will be number 2: a store into its send doorbell before it exists.
        let sq_db = regs::QP_DB_BASE + 2 * regs::DB_STRIDE + regs::DB_SQ;
        let word = |st: &NodeState| st.db.word(sq_db).unwrap().load(Ordering::Relaxed);
        states[0]
            .db
            .word(sq_db)
            .unwrap()
            .store(5, Ordering::Relaxed);
        assert!(!poll_doorbells(&fabric, &mut states, 0, true));
        assert_eq!(
            word(&states[0]),
            5,
            "a slot that is not live is not looked at"
        );
        let qp = pd.create_qp(&QpInit::new(&cq, &cq)).unwrap();
        assert_eq!(qp.qpn(), 2);
        let guest_errors = || fabric.port(0).read32(regs::GUEST_ERRORS);
        let errors = guest_errors();
        // The slot comes alive: the old store is dropped, not rung.
        assert!(!poll_doorbells(&fabric, &mut states, 0, true));
        assert_eq!((word(&states[0]), states[0].db.stale), (DOORBELL_IDLE, 1));
        fabric.run_until_quiet();
        assert_eq!(guest_errors(), errors);
        // A store now is a doorbell, seen by an ordinary round: an empty ring rung to 0 is a
        // no-op the NIC takes.
        states[0]
            .db
            .word(sq_db)
            .unwrap()
            .store(0, Ordering::Relaxed);
        assert!(poll_doorbells(&fabric, &mut states, 0, false));
        assert_eq!(word(&states[0]), DOORBELL_IDLE);
        assert_eq!(states[0].db.stale, 1);
        assert_eq!(states[0].activity.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_round_looks_at_a_bounded_number_of_idle_slots() {
        use ringbell::Device as Dev;
        let fabric = Fabric::new(FabricConfig::new(1, 1));
        let (_file, bar) = bar_file().unwrap();
        let mut states = vec![NodeState::new(bar)];
        let dev = Dev::open(Box::new(fabric.port(0))).unwrap();
        let cqs: Vec<_> = (0..600).map(|_| dev.create_cq(4).unwrap()).collect();
        assert!(!poll_doorbells(&fabric, &mut states, 0, true));
        let live = states[0].db.slots.len();
        assert!(live >= 600, "{live} live slots");
        // A CQ doorbell (consumer index 0: a no-op) in the last CQ's slot: an ordinary round
        // looks at 256 idle slots, so it is found within live / 256 rounds, not in the first.
        let last = *states[0].db.slots.last().unwrap();
        states[0].db.word(last).unwrap().store(0, Ordering::Relaxed);
        let mut rounds = 1;
        while !poll_doorbells(&fabric, &mut states, 0, false) {
            rounds += 1;
            assert!(rounds <= live.div_ceil(COLD_SLOTS_PER_ROUND), "never seen");
        }
        assert!(rounds > 1, "every slot was looked at in one round");
        // Now it is hot: the next store is seen in the next round.
        assert_eq!(states[0].db.hot.len(), 1);
        states[0].db.word(last).unwrap().store(0, Ordering::Relaxed);
        assert!(poll_doorbells(&fabric, &mut states, 0, false));
        drop(cqs);
    }
}
