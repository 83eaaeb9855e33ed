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
//!   so that no client can make the server's mapping of it fault;
//! - each client gets a fresh BAR0 memory file (sealed), so one that has gone cannot store
//!   into the doorbells of the next;
//! - MSI-X vector 0 through an eventfd (DEVICE_SET_IRQS), written whenever the NIC raises
//!   its interrupt.
//!
//! Threads: the fabric lives on one thread (it is single-threaded by design); each node has
//! a thread that owns its socket, speaks the protocol through the `vfio_user` crate and hands
//! every device access to the fabric thread over a channel. Simulated time is kept with wall
//! time (it never runs ahead of it, and moves with it when the fabric is idle), so timers and
//! device-clock timeouts mean what they say for clients that run at their own speed; runs are
//! therefore not reproducible the way in-process runs are.
//!
//! A client that sends a malformed message gets the protocol's error reply (the crate sends
//! errno 0 for device-level refusals) and the server logs it; one that disconnects or dies,
//! even mid-transfer, has its NIC reset and its DMA mappings removed, and the node serves the
//! next client. Other nodes never notice beyond what their peers' NICs do on the wire.

use crate::{Fabric, FabricConfig};
use memmap2::MmapRaw;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use ringbell::Port;
use ringbell_specs::{regs, SimTime};
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::time::{Duration, Instant};
use vfio_bindings::bindings::vfio::{
    vfio_region_info, vfio_region_sparse_mmap_area, VFIO_IRQ_INFO_EVENTFD,
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE,
    VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_MSIX_IRQ_INDEX,
    VFIO_PCI_NUM_IRQS, VFIO_PCI_NUM_REGIONS, VFIO_REGION_INFO_FLAG_MMAP,
    VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_user::{DmaMapFlags, DmaUnmapFlags, IrqInfo, ServerBackend, ServerRegion, SparseArea};

/// What a doorbell word holds until the client stores into it (and again once the server has
/// taken the store). A doorbell value equal to it is not seen: producer indices reach it
/// only after 2^32 - 1 posts.
pub const DOORBELL_IDLE: u32 = u32::MAX;

/// Bytes of config space.
pub const CONFIG_SIZE: usize = 256;

/// Most DMA mappings one client may hold (each is a mapping in the server's address space).
pub const MAX_DMA_MAPPINGS: usize = 65536;

/// Largest trapped access (a BlueFlame burst).
const MAX_ACCESS: usize = regs::BF_STRIDE as usize;

/// The socket of node `node` under `dir`.
pub fn socket_path(dir: &Path, node: usize) -> PathBuf {
    dir.join(format!("nic{node}.sock"))
}

/// A device access handed from a node's thread to the fabric thread.
enum Req {
    Read {
        offset: u64,
        len: usize,
    },
    Write {
        offset: u64,
        data: Vec<u8>,
    },
    DmaMap {
        fd: File,
        iova: u64,
        len: u64,
    },
    DmaUnmap {
        iova: u64,
        len: u64,
    },
    Irq(Option<File>),
    /// The BAR0 mapping for the next client (its doorbell pages are polled from now on).
    Bar(MmapRaw),
    Reset,
    /// The client went away: reclaim the node.
    Gone,
}

type Reply = Result<Vec<u8>, String>;

struct Msg {
    node: usize,
    req: Req,
    reply: SyncSender<Reply>,
}

/// One node's state on the fabric thread.
struct NodeState {
    /// BAR0's memory file, mapped: only the doorbell pages are used.
    bar: MmapRaw,
    irq: Option<File>,
    irqs_seen: u64,
    /// The live doorbell slots at the last look, in offset order.
    slots: Vec<u64>,
    /// The live slots now (reused buffer).
    next_slots: Vec<u64>,
    /// Stores found in slots that were not live yet (dropped, as a NIC drops a doorbell for
    /// a queue that does not exist).
    stale: u64,
}

impl NodeState {
    fn new(bar: MmapRaw) -> NodeState {
        let st = NodeState {
            bar,
            irq: None,
            irqs_seen: 0,
            slots: Vec::new(),
            next_slots: Vec::new(),
            stale: 0,
        };
        st.clear_doorbells();
        st
    }

    /// The doorbell word at `offset`, if it is a 4-aligned offset in the doorbell pages.
    fn doorbell(&self, offset: u64) -> Option<&AtomicU32> {
        if !(regs::DB_BASE..regs::DB_END).contains(&offset) || !offset.is_multiple_of(4) {
            return None;
        }
        // SAFETY: `offset` is a 4-aligned offset inside the doorbell pages (checked above),
        // which lie inside the BAR0_SIZE mapping that `self` keeps alive; the mapping is
        // page-aligned, so the word is aligned. The client stores into the same page through
        // its own shared mapping, so the word is only ever reached atomically here.
        Some(unsafe { &*self.bar.as_ptr().add(offset as usize).cast::<AtomicU32>() })
    }

    /// Refills every doorbell word with [`DOORBELL_IDLE`].
    fn clear_doorbells(&self) {
        for off in (regs::DB_BASE..regs::DB_END).step_by(4) {
            if let Some(w) = self.doorbell(off) {
                w.store(DOORBELL_IDLE, Ordering::Relaxed);
            }
        }
    }
}

/// Runs the server: binds `DIR/nic{i}.sock` for every node of `cfg` (removing stale sockets),
/// calls `ready` once all are listening, and serves until the process ends.
pub fn serve(dir: &Path, cfg: FabricConfig, ready: impl FnOnce()) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let nodes = cfg.nodes;
    let mut states = Vec::with_capacity(nodes);
    let mut bar_files = Vec::with_capacity(nodes);
    for _ in 0..nodes {
        let (file, bar) = bar_file()?;
        states.push(NodeState::new(bar));
        bar_files.push(file);
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
    for (node, (listener, file)) in listeners.into_iter().zip(bar_files).enumerate() {
        let tx = tx.clone();
        std::thread::Builder::new()
            .name(format!("nic{node}"))
            .spawn(move || node_thread(node, listener, file, tx))?;
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

fn irqs() -> Vec<IrqInfo> {
    (0..VFIO_PCI_NUM_IRQS)
        .map(|index| IrqInfo {
            index,
            flags: if index == VFIO_PCI_MSIX_IRQ_INDEX {
                VFIO_IRQ_INFO_EVENTFD
            } else {
                0
            },
            count: u32::from(index == VFIO_PCI_MSIX_IRQ_INDEX),
        })
        .collect()
}

fn regions(bar_fd: i32) -> Vec<ServerRegion> {
    (0..VFIO_PCI_NUM_REGIONS)
        .map(|index| {
            let (flags, size) = match index {
                VFIO_PCI_BAR0_REGION_INDEX => (
                    VFIO_REGION_INFO_FLAG_READ
                        | VFIO_REGION_INFO_FLAG_WRITE
                        | VFIO_REGION_INFO_FLAG_MMAP,
                    regs::BAR0_SIZE,
                ),
                VFIO_PCI_CONFIG_REGION_INDEX => (
                    VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE,
                    CONFIG_SIZE as u64,
                ),
                _ => (0, 0),
            };
            let bar = index == VFIO_PCI_BAR0_REGION_INDEX;
            ServerRegion {
                region_info: vfio_region_info {
                    argsz: std::mem::size_of::<vfio_region_info>() as u32,
                    flags,
                    index,
                    cap_offset: 0,
                    size,
                    offset: 0,
                },
                sparse_areas: if bar {
                    vec![SparseArea {
                        area: vfio_region_sparse_mmap_area {
                            offset: regs::DB_BASE,
                            size: regs::DB_END - regs::DB_BASE,
                        },
                    }]
                } else {
                    Vec::new()
                },
                mmap_fd: bar.then_some(bar_fd),
            }
        })
        .collect()
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

/// A node's side of the protocol: config space here, everything else on the fabric thread.
struct NodeBackend {
    node: usize,
    tx: Sender<Msg>,
    config: [u8; CONFIG_SIZE],
    /// Accesses refused since the client connected (for the log).
    refused: u64,
}

impl NodeBackend {
    fn ask(&self, req: Req) -> io::Result<Vec<u8>> {
        let (reply, rx) = mpsc::sync_channel(1);
        self.tx
            .send(Msg {
                node: self.node,
                req,
                reply,
            })
            .map_err(|_| io::Error::other("the fabric has stopped"))?;
        rx.recv()
            .map_err(|_| io::Error::other("the fabric has stopped"))?
            .map_err(io::Error::other)
    }

    fn refuse(&mut self, what: String) -> io::Error {
        self.refused += 1;
        eprintln!("ringbell-emu serve: node {}: refused {what}", self.node);
        io::Error::new(io::ErrorKind::InvalidInput, what)
    }

    /// Checks a BAR0 access: inside the BAR, 4 bytes aligned, or a BlueFlame burst (a
    /// multiple of 64 bytes up to 256, 64-byte aligned).
    fn check_bar(&mut self, offset: u64, len: usize, write: bool) -> io::Result<()> {
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
            Err(self.refuse(format!("BAR0 {dir} of {len} bytes at {offset:#x}")))
        }
    }

    /// Checks a config-space access; the offset as an index.
    fn config_range(&mut self, what: &str, offset: u64, len: usize) -> io::Result<usize> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= CONFIG_SIZE as u64 => Ok(offset as usize),
            _ => Err(self.refuse(format!("config {what} of {len} bytes at {offset:#x}"))),
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

impl ServerBackend for NodeBackend {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        match region {
            VFIO_PCI_CONFIG_REGION_INDEX => {
                let at = self.config_range("read", offset, data.len())?;
                data.copy_from_slice(&self.config[at..][..data.len()]);
                Ok(())
            }
            VFIO_PCI_BAR0_REGION_INDEX => {
                self.check_bar(offset, data.len(), false)?;
                let v = self.ask(Req::Read {
                    offset,
                    len: data.len(),
                })?;
                data.copy_from_slice(&v);
                Ok(())
            }
            _ => Err(self.refuse(format!("read of region {region}"))),
        }
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        match region {
            VFIO_PCI_CONFIG_REGION_INDEX => {
                let at = self.config_range("write", offset, data.len())?;
                self.config_write(at, data);
                Ok(())
            }
            VFIO_PCI_BAR0_REGION_INDEX => {
                self.check_bar(offset, data.len(), true)?;
                self.ask(Req::Write {
                    offset,
                    data: data.to_vec(),
                })
                .map(|_| ())
            }
            _ => Err(self.refuse(format!("write of region {region}"))),
        }
    }

    fn dma_map(
        &mut self,
        flags: DmaMapFlags,
        offset: u64,
        address: u64,
        size: u64,
        fd: Option<File>,
    ) -> io::Result<()> {
        let Some(fd) = fd else {
            return Err(self.refuse(format!(
                "DMA_MAP {address:#x}+{size:#x} without a memory file"
            )));
        };
        if offset != 0 || !flags.contains(DmaMapFlags::READ_WRITE) {
            return Err(self.refuse(format!(
                "DMA_MAP {address:#x}+{size:#x} at file offset {offset:#x}, flags {:#x} (offset \
                 0 and read-write only)",
                flags.bits()
            )));
        }
        if let Err(e) = seal_against_shrinking(&fd) {
            return Err(self.refuse(format!("DMA_MAP {address:#x}+{size:#x}: {e}")));
        }
        self.ask(Req::DmaMap {
            fd,
            iova: address,
            len: size,
        })
        .map(|_| ())
        .map_err(|e| self.refuse(format!("DMA_MAP {address:#x}+{size:#x}: {e}")))
    }

    fn dma_unmap(&mut self, flags: DmaUnmapFlags, address: u64, size: u64) -> io::Result<()> {
        if !flags.is_empty() {
            return Err(self.refuse(format!("DMA_UNMAP with flags {:#x}", flags.bits())));
        }
        self.ask(Req::DmaUnmap {
            iova: address,
            len: size,
        })
        .map(|_| ())
        .map_err(|e| self.refuse(format!("DMA_UNMAP {address:#x}+{size:#x}: {e}")))
    }

    fn reset(&mut self) -> io::Result<()> {
        self.ask(Req::Reset).map(|_| ())
    }

    fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        mut fds: Vec<File>,
    ) -> io::Result<()> {
        let trigger = flags & VFIO_IRQ_SET_ACTION_TRIGGER != 0;
        if index != VFIO_PCI_MSIX_IRQ_INDEX || !trigger || start != 0 || count > 1 {
            return Err(self.refuse(format!(
                "SET_IRQS index {index} flags {flags:#x} start {start} count {count} (MSI-X \
                 vector 0 only)"
            )));
        }
        let fd = if flags & VFIO_IRQ_SET_DATA_EVENTFD != 0 && count == 1 {
            if fds.len() != 1 {
                return Err(self.refuse(format!("SET_IRQS with {} descriptors", fds.len())));
            }
            fds.pop()
        } else if flags & VFIO_IRQ_SET_DATA_NONE != 0 {
            None
        } else {
            return Err(self.refuse(format!("SET_IRQS flags {flags:#x}")));
        };
        self.ask(Req::Irq(fd)).map(|_| ())
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

/// Serves node `node`'s socket forever, one client at a time, each with its own BAR0 file
/// (`file` for the first).
fn node_thread(node: usize, listener: UnixListener, mut file: File, tx: Sender<Msg>) {
    loop {
        let mut be = NodeBackend {
            node,
            tx: tx.clone(),
            config: config_space(),
            refused: 0,
        };
        // One server per client, all on the same listening socket: the crate fixes the
        // BAR's memory file when a server is made.
        let server = match listener.as_fd().try_clone_to_owned() {
            Ok(fd) => vfio_user::Server::from_owned_fd(fd, true, irqs(), regions(file.as_raw_fd())),
            Err(e) => {
                eprintln!("ringbell-emu serve: node {node}: cannot serve: {e}");
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| server.run(&mut be)));
        drop(server);
        if let Ok(Err(vfio_user::Error::SocketAccept(e))) = &r {
            // Nobody connected (out of descriptors, say): nothing to reclaim; wait a little.
            eprintln!("ringbell-emu serve: node {node}: accept failed: {e}");
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let how = match r {
            Ok(Ok(())) => "disconnected".to_string(),
            Ok(Err(e)) => format!("dropped: {e}"),
            Err(_) => "dropped: malformed message".to_string(),
        };
        let reclaimed = be.ask(Req::Gone);
        // The next client gets a new BAR file; the old one is dropped by the fabric thread
        // once it has switched (the client that had it may keep its mapping: nobody reads it).
        match bar_file() {
            Ok((next, bar)) => {
                if be.ask(Req::Bar(bar)).is_err() {
                    return;
                }
                file = next;
            }
            Err(e) => eprintln!(
                "ringbell-emu serve: node {node}: no new BAR0 file ({e}); the next client \
                 shares the last one"
            ),
        }
        let mut err = io::stderr().lock();
        let _ = match reclaimed {
            Ok(v) => writeln!(
                err,
                "ringbell-emu serve: node {node}: client {how} ({} refused requests, {} \
                 doorbell stores before their queue existed); NIC reset, {} DMA mappings \
                 reclaimed",
                be.refused,
                word(&v, 1),
                word(&v, 0),
            ),
            Err(_) => return,
        };
    }
}

/// The `i`th little-endian u64 of a reply (0 if it is short).
fn word(v: &[u8], i: usize) -> u64 {
    v.get(8 * i..8 * i + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

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
                    handle(fabric, states, m);
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
        for node in 0..states.len() {
            busy |= poll_doorbells(fabric, states, node);
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
                if let Some(f) = &st.irq {
                    let _ = (&*f).write(&1u64.to_ne_bytes());
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
                handle(fabric, states, m);
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

/// Feeds every store found in node `node`'s live doorbell slots to its NIC; `true` if any.
fn poll_doorbells(fabric: &Fabric, states: &mut [NodeState], node: usize) -> bool {
    let st = &mut states[node];
    let mut slots = std::mem::take(&mut st.next_slots);
    fabric.doorbell_slots(node, &mut slots);
    let port = fabric.port(node);
    let mut any = false;
    for &slot in &slots {
        // A slot that has just come alive can only hold stores made before its queue
        // existed: the client learns of a new queue through a trapped read of the command
        // status, and every trapped access is preceded by a look here.
        let fresh = st.slots.binary_search(&slot).is_err();
        for off in [slot, slot + 4] {
            let Some(w) = st.doorbell(off) else {
                continue;
            };
            if w.load(Ordering::Relaxed) == DOORBELL_IDLE {
                continue;
            }
            let v = w.swap(DOORBELL_IDLE, Ordering::Acquire);
            if v == DOORBELL_IDLE {
                continue;
            }
            if fresh {
                st.stale += 1;
            } else {
                port.write32(off, v);
                any = true;
            }
        }
    }
    st.next_slots = std::mem::replace(&mut st.slots, slots);
    any
}

fn handle(fabric: &Fabric, states: &mut [NodeState], m: Msg) {
    let node = m.node;
    // A client's doorbell stores come before its later trapped accesses.
    poll_doorbells(fabric, states, node);
    let port = fabric.port(node);
    let reply = match m.req {
        Req::Read { offset, len } => {
            debug_assert_eq!(len, 4);
            Ok(port.read32(offset).to_le_bytes().to_vec())
        }
        Req::Write { offset, data } => {
            if data.len() == 4 {
                port.write32(
                    offset,
                    u32::from_le_bytes([data[0], data[1], data[2], data[3]]),
                );
            } else {
                port.write_block(offset, &data);
            }
            Ok(Vec::new())
        }
        Req::DmaMap { .. } if fabric.dma_mappings(node) >= MAX_DMA_MAPPINGS => Err(format!(
            "the node holds {MAX_DMA_MAPPINGS} DMA mappings, the most it takes"
        )),
        Req::DmaMap { fd, iova, len } => port
            .dma_map(fd.as_fd(), len, iova)
            .map(|_| Vec::new())
            .map_err(|e| e.to_string()),
        Req::DmaUnmap { iova, len } => port
            .dma_unmap(iova, len)
            .map(|_| Vec::new())
            .map_err(|e| e.to_string()),
        Req::Irq(fd) => {
            states[node].irq = fd;
            Ok(Vec::new())
        }
        Req::Bar(bar) => {
            let st = &mut states[node];
            st.bar = bar;
            st.clear_doorbells();
            Ok(Vec::new())
        }
        Req::Reset => {
            port.write32(regs::RESET, regs::RESET_KEY);
            states[node].clear_doorbells();
            Ok(Vec::new())
        }
        Req::Gone => {
            let n = fabric.reclaim_node(node);
            let st = &mut states[node];
            st.irq = None;
            st.clear_doorbells();
            let stale = std::mem::take(&mut st.stale);
            Ok([(n as u64).to_le_bytes(), stale.to_le_bytes()].concat())
        }
    };
    let _ = m.reply.send(reply);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_space_names_the_nic_and_sizes_bar0() {
        let (tx, _rx) = mpsc::channel();
        let mut be = NodeBackend {
            node: 0,
            tx,
            config: config_space(),
            refused: 0,
        };
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
        // Out of range and other regions are refused, nothing changes.
        assert!(be
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, 254, &mut bar)
            .is_err());
        assert!(be.region_write(3, 0, &[0; 4]).is_err());
        assert!(be.check_bar(regs::BAR0_SIZE - 2, 4, false).is_err());
        assert!(be.check_bar(2, 4, true).is_err());
        assert!(be.check_bar(regs::BF_BASE, 128, false).is_err());
        assert!(be.check_bar(regs::BF_BASE, 128, true).is_ok());
        assert!(be.check_bar(regs::BF_BASE + 32, 64, true).is_err());
        assert!(be.check_bar(u64::MAX - 1, 4, true).is_err());
        assert_eq!(be.refused, 7);
    }

    #[test]
    fn stores_into_a_slot_before_its_queue_exists_are_dropped() {
        use ringbell::{Device, QpInit};
        let fabric = Fabric::new(FabricConfig::new(1, 1));
        let (_file, bar) = bar_file().unwrap();
        let mut states = vec![NodeState::new(bar)];
        let dev = Device::open(Box::new(fabric.port(0))).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(16).unwrap();
        // The first QP will be number 2: a store into its send doorbell before it exists.
        let sq_db = regs::QP_DB_BASE + 2 * regs::DB_STRIDE + regs::DB_SQ;
        let word = |st: &NodeState| st.doorbell(sq_db).unwrap().load(Ordering::Relaxed);
        states[0]
            .doorbell(sq_db)
            .unwrap()
            .store(5, Ordering::Relaxed);
        assert!(!poll_doorbells(&fabric, &mut states, 0));
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
        assert!(!poll_doorbells(&fabric, &mut states, 0));
        assert_eq!((word(&states[0]), states[0].stale), (DOORBELL_IDLE, 1));
        fabric.run_until_quiet();
        assert_eq!(guest_errors(), errors);
        // A store now is a doorbell: an empty ring rung to 0 is a no-op the NIC takes.
        states[0]
            .doorbell(sq_db)
            .unwrap()
            .store(0, Ordering::Relaxed);
        assert!(poll_doorbells(&fabric, &mut states, 0));
        assert_eq!(word(&states[0]), DOORBELL_IDLE);
        assert_eq!(states[0].stale, 1);
    }
}
