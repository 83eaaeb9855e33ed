//! Device connections through VFIO: the kernel's vfio-pci ([`VfioPort::open`]) and vfio-user
//! ([`VfioPort::connect`], a device served by another process such as `ringbell-emu serve`).
//!
//! Both reach a PCI device the same way, so they share one [`VfioPort`]: BAR0 windows the
//! device lets us map are reached by volatile loads and stores ([`Bar`]); every other register
//! access is trapped, that is handed to the [`Transport`] (a `pread`/`pwrite` on the kernel's
//! device file, a REGION_READ/REGION_WRITE message on vfio-user); DMA mappings go through the
//! transport too (the IOMMU, or a DMA_MAP message carrying the memory file); MSI-X vector 0
//! is an eventfd ([`Port::interrupt_fd`]).

pub mod kernel;
mod shared_lock;
pub use shared_lock::{SharedGuard, SharedLock};
pub mod sysfs;
pub mod user;

use crate::port::{Port, PortError};
use memmap2::MmapRaw;
use ringbell_specs::regs;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{fence, Ordering};
use std::time::Duration;

/// Why a VFIO or vfio-user device could not be opened or used.
#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    /// The kernel has no VFIO (no `/dev/vfio/vfio`).
    #[error(
        "VFIO is not available: {path} is missing (kernel without CONFIG_VFIO, or the vfio-pci \
         module is not loaded: `modprobe vfio-pci`)"
    )]
    NotAvailable {
        /// The path that was looked for.
        path: String,
    },
    /// No PCI device at this address.
    #[error("no PCI device {addr} ({path} is missing)")]
    NoDevice {
        /// The PCI address asked for.
        addr: String,
        /// The sysfs path looked at.
        path: String,
    },
    /// The device is bound to another driver (or none).
    #[error(
        "PCI device {addr} is bound to {driver}, not vfio-pci: \
         `echo vfio-pci > /sys/bus/pci/devices/{addr}/driver_override`, unbind it from its \
         driver, then `echo {addr} > /sys/bus/pci/drivers_probe`"
    )]
    NotBound {
        /// The PCI address.
        addr: String,
        /// The driver it is bound to (`no driver` if none).
        driver: String,
    },
    /// The device has no IOMMU group: the IOMMU is off.
    #[error(
        "PCI device {addr} has no IOMMU group: enable the IOMMU (intel_iommu=on or amd_iommu=on \
         on the kernel command line)"
    )]
    NoIommuGroup {
        /// The PCI address.
        addr: String,
    },
    /// Another device of the group is bound to a host driver, so the group cannot be used.
    #[error(
        "IOMMU group {group} is not viable: {other} is bound to {driver}; bind every device of \
         the group to vfio-pci (or unbind it)"
    )]
    GroupNotViable {
        /// The group number.
        group: u32,
        /// The device that spoils it.
        other: String,
        /// Its driver.
        driver: String,
    },
    /// The group's device file is missing or not accessible.
    #[error("cannot open {path}: {reason} (check its owner and mode, and `ulimit -l` for DMA)")]
    GroupFile {
        /// The `/dev/vfio/N` path.
        path: String,
        /// The system's reason.
        reason: String,
    },
    /// The device is not a ringbell NIC.
    #[error("PCI device {vendor:04x}:{device:04x} is not a ringbell NIC")]
    NotRingbell {
        /// Vendor ID read from config space.
        vendor: u16,
        /// Device ID read from config space.
        device: u16,
    },
    /// A region or capability the device reported makes no sense.
    #[error("bad region: {0}")]
    BadRegion(String),
    /// The VFIO layer refused an operation.
    #[error("VFIO: {0}")]
    Vfio(String),
    /// The vfio-user server broke the protocol, or the connection failed.
    #[error("vfio-user: {0}")]
    Protocol(String),
    /// The vfio-user server answered a request with an error.
    #[error("vfio-user server refused {command}: errno {errno}")]
    Refused {
        /// The command refused.
        command: &'static str,
        /// The errno the server sent (0 when it gave none).
        errno: u32,
    },
    /// The vfio-user server did not answer in time.
    #[error("vfio-user: no reply to {0} in time")]
    Timeout(&'static str),
    /// An I/O error.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl VfioError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> VfioError {
        VfioError::Io {
            context: context.into(),
            source,
        }
    }
}

/// What a VFIO flavour provides besides the mapped windows: trapped region access, DMA
/// mappings, and teardown.
pub trait Transport {
    /// Reads `data.len()` bytes at `offset` of region `region` (BAR0 is 0, config space 7).
    fn region_read(&self, region: u32, offset: u64, data: &mut [u8]) -> Result<(), VfioError>;
    /// Writes `data` at `offset` of region `region`.
    fn region_write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), VfioError>;
    /// Maps `len` bytes of memory file `fd` (from offset 0) at `iova` for device DMA.
    fn dma_map(&self, fd: BorrowedFd<'_>, len: u64, iova: u64) -> Result<(), PortError>;
    /// Removes the mapping at `iova`.
    fn dma_unmap(&self, iova: u64, len: u64) -> Result<(), PortError>;
    /// Lets the device progress while the driver waits (a real device needs nothing);
    /// `false` once it never can (the connection to it is gone).
    fn idle(&self) -> bool {
        std::hint::spin_loop();
        true
    }
    /// Stops the device's interrupts and DMA before the BAR windows are unmapped (called
    /// once, when the port drops).
    fn shutdown(&mut self) {}
    /// Why the transport can no longer reach the device, or `None` while it can.
    fn broken(&self) -> Option<String> {
        None
    }
}

/// The PCI region index of BAR0.
pub const BAR0_REGION: u32 = vfio_bindings::bindings::vfio::VFIO_PCI_BAR0_REGION_INDEX;
/// The PCI region index of config space.
pub const CONFIG_REGION: u32 = vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;
/// The IRQ index of MSI-X.
pub const MSIX_IRQ: u32 = vfio_bindings::bindings::vfio::VFIO_PCI_MSIX_IRQ_INDEX;

/// The windows of a region that may be mapped, from what the device reports: `mmap` (the
/// region's MMAP flag), its size, and its sparse-mmap areas (`(offset, len)`, empty when the
/// capability is absent). Without the flag nothing is mapped; with it and no areas the whole
/// region is. Areas must be page-aligned, inside the region and disjoint; they are returned
/// sorted.
pub fn plan_windows(
    mmap: bool,
    size: u64,
    areas: &[(u64, u64)],
) -> Result<Vec<(u64, u64)>, VfioError> {
    if !mmap || size == 0 {
        return Ok(Vec::new());
    }
    if areas.is_empty() {
        return Ok(vec![(0, size)]);
    }
    let mut v = areas.to_vec();
    v.sort_unstable();
    let mut end_prev = 0;
    for &(off, len) in &v {
        let end = off.checked_add(len).filter(|e| *e <= size);
        let Some(end) = end else {
            return Err(VfioError::BadRegion(format!(
                "sparse area {off:#x}+{len:#x} outside a region of {size:#x} bytes"
            )));
        };
        if len == 0 || !off.is_multiple_of(4096) || !len.is_multiple_of(4096) {
            return Err(VfioError::BadRegion(format!(
                "sparse area {off:#x}+{len:#x} is empty or not page-aligned"
            )));
        }
        if off < end_prev {
            return Err(VfioError::BadRegion(format!(
                "sparse area {off:#x}+{len:#x} overlaps the one before it"
            )));
        }
        end_prev = end;
    }
    Ok(v)
}

#[derive(Debug)]
struct Window {
    offset: u64,
    len: u64,
    map: MmapRaw,
}

/// BAR0 as far as it is mapped: the windows reached by volatile loads and stores. An access
/// outside them is the transport's.
#[derive(Debug, Default)]
pub struct Bar {
    windows: Vec<Window>,
}

impl Bar {
    /// Maps `windows` (from [`plan_windows`]) of a region that starts at `file_offset` in
    /// `file` (the device file on kernel VFIO, the region's memory file on vfio-user).
    pub fn map(
        file: BorrowedFd<'_>,
        file_offset: u64,
        windows: &[(u64, u64)],
    ) -> Result<Bar, VfioError> {
        let mut bar = Bar::default();
        for &(offset, len) in windows {
            let at = file_offset.checked_add(offset).ok_or_else(|| {
                VfioError::BadRegion(format!("window {offset:#x} past the file's end"))
            })?;
            let map = memmap2::MmapOptions::new()
                .offset(at)
                .len(len as usize)
                .map_raw(file.as_raw_fd())
                .map_err(|e| VfioError::io(format!("mmap of BAR0 window {offset:#x}"), e))?;
            bar.windows.push(Window { offset, len, map });
        }
        Ok(bar)
    }

    /// The mapped windows as `(offset, len)`.
    pub fn windows(&self) -> Vec<(u64, u64)> {
        self.windows.iter().map(|w| (w.offset, w.len)).collect()
    }

    /// The address of the `len` bytes (whole 32-bit registers) at `offset` if one window
    /// holds them all.
    fn span(&self, offset: u64, len: usize) -> Option<*mut u32> {
        if !offset.is_multiple_of(4) || len == 0 || !len.is_multiple_of(4) {
            return None;
        }
        let end = offset.checked_add(len as u64)?;
        let w = self
            .windows
            .iter()
            .find(|w| offset >= w.offset && end <= w.offset + w.len)?;
        // SAFETY: `offset - w.offset + len <= w.len`, the window's length, so the span stays
        // inside the live mapping; it is 4-byte aligned because the window is page-aligned.
        Some(unsafe { w.map.as_mut_ptr().add((offset - w.offset) as usize) }.cast())
    }

    /// Reads the register at `offset`, or `None` if no window holds it.
    pub fn read32(&self, offset: u64) -> Option<u32> {
        let p = self.span(offset, 4)?;
        // SAFETY: `p` is an aligned register inside a live mapping of the device (see `reg`);
        // MMIO is only ever reached by volatile accesses.
        Some(u32::from_le(unsafe { p.read_volatile() }))
    }

    /// Writes the register at `offset` after every earlier store; `false` if no window holds it.
    pub fn write32(&self, offset: u64, value: u32) -> bool {
        let Some(p) = self.span(offset, 4) else {
            return false;
        };
        // Earlier stores to DMA memory (WQEs, doorbell records) are visible before this one.
        fence(Ordering::SeqCst);
        // SAFETY: as in `read32`.
        unsafe { p.write_volatile(value.to_le()) };
        true
    }

    /// Writes `data` (whole 32-bit words) at `offset` in address order, after every earlier
    /// store and with one fence for the burst; `false` if no one window holds it all.
    pub fn write_block(&self, offset: u64, data: &[u8]) -> bool {
        let Some(p) = self.span(offset, data.len()) else {
            return false;
        };
        fence(Ordering::SeqCst);
        for (i, w) in data.chunks_exact(4).enumerate() {
            let v = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            // SAFETY: word `i` is inside the span that `span` checked for all of `data`;
            // MMIO is only ever reached by volatile accesses.
            unsafe { p.add(i).write_volatile(v.to_le()) };
        }
        true
    }
}

/// A driver's connection to a PCI device through VFIO or vfio-user: the [`Port`] both share.
pub struct VfioPort {
    bar: Bar,
    transport: Box<dyn Transport>,
    /// Serializes the commands of this process and the children it forks, which share the
    /// device (and its mailbox) with it.
    commands: Option<SharedLock>,
    irq: Option<vmm_sys_util::eventfd::EventFd>,
    /// Trapped accesses that failed (kept for diagnosis: a `Port` cannot return an error).
    errors: std::cell::Cell<u64>,
}

impl std::fmt::Debug for VfioPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioPort")
            .field("windows", &self.bar.windows())
            .field("interrupts", &self.irq.is_some())
            .field("errors", &self.errors.get())
            .finish()
    }
}

impl VfioPort {
    /// A port over `transport`, with BAR0 windows `bar` and MSI-X vector 0 signalled on `irq`.
    pub fn new(
        bar: Bar,
        transport: Box<dyn Transport>,
        irq: Option<vmm_sys_util::eventfd::EventFd>,
    ) -> VfioPort {
        VfioPort {
            commands: SharedLock::new(),
            bar,
            transport,
            irq,
            errors: std::cell::Cell::new(0),
        }
    }

    /// Trapped register accesses that failed so far (each read as all-ones, as a PCI read
    /// that fails does, or a write dropped).
    pub fn access_errors(&self) -> u64 {
        self.errors.get()
    }

    /// The mapped BAR0 windows, `(offset, len)`.
    pub fn mapped_windows(&self) -> Vec<(u64, u64)> {
        self.bar.windows()
    }
}

impl Drop for VfioPort {
    fn drop(&mut self) {
        // Interrupts and DMA stop first; the BAR windows, then the device, close after.
        self.transport.shutdown();
    }
}

/// Waits up to `timeout` for `fd` to become readable.
pub(crate) fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> std::io::Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let ms = left.as_millis().min(i32::MAX as u128) as i32;
        let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
        match poll(
            &mut fds,
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
        ) {
            Ok(n) => return Ok(n > 0),
            // A signal: wait for what is left of the time.
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

impl Port for VfioPort {
    fn read32(&self, offset: u64) -> u32 {
        if let Some(v) = self.bar.read32(offset) {
            return v;
        }
        let mut b = [0xFFu8; 4];
        if self
            .transport
            .region_read(BAR0_REGION, offset, &mut b)
            .is_err()
        {
            self.errors.set(self.errors.get() + 1);
            return u32::MAX;
        }
        u32::from_le_bytes(b)
    }

    fn write32(&self, offset: u64, value: u32) {
        if self.bar.write32(offset, value) {
            return;
        }
        fence(Ordering::SeqCst);
        if self
            .transport
            .region_write(BAR0_REGION, offset, &value.to_le_bytes())
            .is_err()
        {
            self.errors.set(self.errors.get() + 1);
        }
    }

    fn write_block(&self, offset: u64, data: &[u8]) {
        if self.bar.write_block(offset, data) {
            return;
        }
        fence(Ordering::SeqCst);
        if self
            .transport
            .region_write(BAR0_REGION, offset, data)
            .is_err()
        {
            self.errors.set(self.errors.get() + 1);
        }
    }

    fn dma_map(&self, fd: BorrowedFd<'_>, len: u64, iova: u64) -> Result<(), PortError> {
        self.transport.dma_map(fd, len, iova)
    }

    fn dma_unmap(&self, iova: u64, len: u64) -> Result<(), PortError> {
        self.transport.dma_unmap(iova, len)
    }

    fn progress(&self) -> bool {
        self.transport.idle()
    }

    fn failure(&self) -> Option<String> {
        self.transport.broken()
    }

    fn exclusive(&self) -> Option<SharedGuard<'_>> {
        self.commands.as_ref().map(SharedLock::lock)
    }

    fn interrupt_fd(&self, vector: u32) -> Option<BorrowedFd<'_>> {
        let e = self.irq.as_ref().filter(|_| vector == 0)?;
        // SAFETY: the descriptor belongs to `self.irq`, which outlives the returned borrow
        // (it is tied to `&self`) and is never closed while `self` lives.
        Some(unsafe { BorrowedFd::borrow_raw(e.as_raw_fd()) })
    }
}

/// Checks that config space names a ringbell NIC.
pub(crate) fn check_identity(t: &dyn Transport) -> Result<(), VfioError> {
    let mut id = [0u8; 4];
    t.region_read(CONFIG_REGION, 0, &mut id)?;
    let vendor = u16::from_le_bytes([id[0], id[1]]);
    let device = u16::from_le_bytes([id[2], id[3]]);
    if vendor != regs::PCI_VENDOR_ID || device != regs::PCI_DEVICE_ID {
        return Err(VfioError::NotRingbell { vendor, device });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DmaMemory;
    use std::cell::RefCell;
    use std::rc::Rc;

    #[test]
    fn windows_follow_the_mmap_flag_and_sparse_areas() {
        assert_eq!(plan_windows(false, 1 << 21, &[]).unwrap(), vec![]);
        assert_eq!(plan_windows(true, 0, &[]).unwrap(), vec![]);
        assert_eq!(
            plan_windows(true, 1 << 21, &[]).unwrap(),
            vec![(0, 1 << 21)]
        );
        assert_eq!(
            plan_windows(true, 1 << 21, &[(0x20000, 0x1000), (0x10000, 0x1000)]).unwrap(),
            vec![(0x10000, 0x1000), (0x20000, 0x1000)]
        );
        for bad in [
            vec![(0x1F_F000, 0x2000)],
            vec![(u64::MAX - 0xFFF, 0x1000)],
            vec![(0x10000, 0)],
            vec![(0x10010, 0x1000)],
            vec![(0x10000, 0x2000), (0x11000, 0x1000)],
        ] {
            assert!(
                matches!(
                    plan_windows(true, 1 << 21, &bad),
                    Err(VfioError::BadRegion(_))
                ),
                "{bad:x?}"
            );
        }
    }

    /// A transport that records trapped accesses into a plain buffer.
    type Log = Rc<RefCell<Vec<(u64, Vec<u8>)>>>;

    #[derive(Default)]
    struct Recorder {
        log: Log,
        regs: RefCell<Vec<u8>>,
    }

    impl Transport for Recorder {
        fn region_read(&self, region: u32, offset: u64, data: &mut [u8]) -> Result<(), VfioError> {
            let regs = self.regs.borrow();
            let o = offset as usize;
            if region != BAR0_REGION || o + data.len() > regs.len() {
                return Err(VfioError::Refused {
                    command: "REGION_READ",
                    errno: 22,
                });
            }
            data.copy_from_slice(&regs[o..o + data.len()]);
            Ok(())
        }
        fn region_write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), VfioError> {
            assert_eq!(region, BAR0_REGION);
            self.log.borrow_mut().push((offset, data.to_vec()));
            Ok(())
        }
        fn dma_map(&self, _: BorrowedFd<'_>, _: u64, _: u64) -> Result<(), PortError> {
            Ok(())
        }
        fn dma_unmap(&self, _: u64, _: u64) -> Result<(), PortError> {
            Ok(())
        }
    }

    #[test]
    fn mapped_windows_take_loads_and_stores_and_the_rest_is_trapped() {
        // A file-backed "BAR" of 64 KiB with one mapped page at 0x4000.
        let file = DmaMemory::new(0x10000).unwrap();
        let windows = plan_windows(true, 0x10000, &[(0x4000, 0x1000)]).unwrap();
        let bar = Bar::map(file.fd().unwrap(), 0, &windows).unwrap();
        let rec = Box::new(Recorder {
            regs: RefCell::new((0..64u8).collect()),
            ..Default::default()
        });
        let log = rec.log.clone();
        let port = VfioPort::new(bar, rec, None);
        assert_eq!(port.mapped_windows(), vec![(0x4000, 0x1000)]);

        port.write32(0x4008, 0xDEAD_BEEF);
        let mut b = [0u8; 4];
        file.read(0x4008, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0xDEAD_BEEF);
        assert_eq!(port.read32(0x4008), 0xDEAD_BEEF);
        // The window's last register is mapped; the next is trapped.
        port.write32(0x4FFC, 7);
        port.write32(0x5000, 9);
        port.write_block(0x100, &[0xAB; 64]);
        port.write_block(0x4040, &[0xCD; 64]);
        file.read(0x4FFC, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), 7);
        let mut blk = [0u8; 64];
        file.read(0x4040, &mut blk).unwrap();
        assert_eq!(blk, [0xCD; 64]);
        let log = log.borrow().clone();
        assert_eq!(
            log,
            vec![
                (0x5000, 9u32.to_le_bytes().to_vec()),
                (0x100, vec![0xAB; 64])
            ]
        );
        // A trapped read, and one the transport refuses: all-ones and counted.
        assert_eq!(port.read32(4), u32::from_le_bytes([4, 5, 6, 7]));
        assert_eq!(port.access_errors(), 0);
        assert_eq!(port.read32(0x8000), u32::MAX);
        assert_eq!(port.access_errors(), 1);
        assert!(port.interrupt_fd(0).is_none());
    }

    #[test]
    fn the_interrupt_is_an_eventfd() {
        let efd = vmm_sys_util::eventfd::EventFd::new(libc_nonblock()).unwrap();
        let raise = efd.try_clone().unwrap();
        let port = VfioPort::new(Bar::default(), Box::<Recorder>::default(), Some(efd));
        assert!(port.interrupt_fd(1).is_none());
        let fd = port.interrupt_fd(0).unwrap();
        assert!(!wait_readable(fd, Duration::from_millis(10)).unwrap());
        raise.write(1).unwrap();
        assert!(wait_readable(fd, Duration::from_millis(1000)).unwrap());
    }

    fn libc_nonblock() -> i32 {
        nix::fcntl::OFlag::O_NONBLOCK.bits()
    }
}
