//! The kernel VFIO backend: a ringbell NIC bound to vfio-pci, reached through `vfio-ioctls`.
//!
//! [`VfioPort::open`] runs the sysfs pre-flight ([`super::sysfs::preflight`]), opens a type1
//! container and the device, maps the BAR0 windows the kernel allows (the MMAP flag and the
//! sparse-mmap capability), checks the device's identity in config space, and routes MSI-X
//! vector 0 to an eventfd. Everything else goes through `KernelTransport`: trapped register
//! accesses are `pread`/`pwrite` on the device file (bounds-checked here, so an access outside
//! a region is an error instead of a log line), and each DMA mapping is the memory file mapped
//! `MAP_SHARED` into this process and then into the IOMMU. vfio-pci maps BARs uncached, with no
//! write-combining, so BlueFlame bursts on this backend are 32-bit stores.
//!
//! The IOMMU and the device sit behind two small private traits so that the DMA bookkeeping
//! and the teardown order are tested without hardware.

use super::sysfs;
use super::{
    check_identity, plan_windows, Bar, Transport, VfioError, VfioPort, BAR0_REGION, MSIX_IRQ,
};
use crate::port::PortError;
use memmap2::MmapRaw;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;
use std::sync::Arc;
use vfio_bindings::bindings::vfio::{
    VFIO_PCI_NUM_REGIONS, VFIO_REGION_INFO_FLAG_MMAP, VFIO_REGION_INFO_FLAG_READ,
    VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioRegionInfoCap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// vfio-pci (every driver built on vfio-pci-core) places region `i` at offset `i << 40` of
/// the device file (`VFIO_PCI_OFFSET_SHIFT` in the kernel).
const VFIO_PCI_OFFSET_SHIFT: u32 = 40;

impl VfioPort {
    /// Opens the ringbell NIC at PCI address `addr` (`0000:01:00.0`, or `01:00.0` for domain
    /// 0) through kernel VFIO; the device must be bound to vfio-pci.
    pub fn open(addr: &str) -> Result<VfioPort, VfioError> {
        Self::open_at(Path::new("/sys"), Path::new("/dev"), addr)
    }

    /// [`VfioPort::open`] with the pre-flight checks reading `sys_root` and `dev_root` instead
    /// of `/sys` and `/dev`. The VFIO calls themselves always use `/dev/vfio` (vfio-ioctls
    /// opens it by that name); the device is found under `sys_root`.
    pub fn open_at(sys_root: &Path, dev_root: &Path, addr: &str) -> Result<VfioPort, VfioError> {
        let group = sysfs::preflight(sys_root, dev_root, addr)?;
        let addr = sysfs::canonical_address(addr)?;

        let container = Arc::new(VfioContainer::new(None).map_err(container_error)?);
        let device = VfioDevice::new(
            &sysfs::device_path(sys_root, &addr),
            container.clone(),
            false,
        )
        .map_err(|e| device_error(e, group))?;

        let regions = resolve_regions(|p| RegionInfo {
            flags: device.get_region_flags(p),
            size: device.get_region_size(p),
            offset: device.get_region_offset(p),
        });
        let bar0 = regions[BAR0_REGION as usize].ok_or_else(|| {
            VfioError::BadRegion(format!("{addr} has no BAR0 (vfio-pci reports it empty)"))
        })?;
        let areas: Vec<(u64, u64)> = device
            .get_region_caps(bar0.position)
            .iter()
            .filter_map(|c| match c {
                VfioRegionInfoCap::SparseMmap(s) => Some(&s.areas),
                _ => None,
            })
            .flatten()
            .filter(|a| a.size != 0)
            .map(|a| (a.offset, a.size))
            .collect();
        let windows = plan_windows(
            bar0.info.flags & VFIO_REGION_INFO_FLAG_MMAP != 0,
            bar0.info.size,
            &areas,
        )?;
        let bar = {
            // SAFETY: the descriptor is the device file owned by `device`, which stays open
            // through this block, the only place the borrow is used; the mappings made from it
            // hold their own reference to the file, so they outlive the descriptor safely.
            let device_fd = unsafe { BorrowedFd::borrow_raw(device.as_raw_fd()) };
            Bar::map(device_fd, bar0.info.offset, &windows)?
        };

        let has_msix = device
            .get_irq_info(MSIX_IRQ)
            .is_some_and(|irq| irq.count > 0);
        let mut transport = KernelTransport::new(
            Box::new(KernelDevice { device }),
            Box::new(container),
            regions.map(|r| r.map(|r| r.info)),
        );
        check_identity(&transport)?;

        let irq = if has_msix {
            let efd = EventFd::new(EFD_NONBLOCK)
                .map_err(|e| VfioError::io("creating the MSI-X eventfd", e))?;
            transport.enable_msix(&efd)?;
            Some(efd)
        } else {
            None
        };
        Ok(VfioPort::new(bar, Box::new(transport), irq))
    }
}

/// `e` and its sources, joined (a source its parent already prints is not repeated).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = c.source();
    }
    s
}

/// Our error for a container that would not open.
fn container_error(e: vfio_ioctls::VfioError) -> VfioError {
    match e {
        vfio_ioctls::VfioError::OpenContainer(e) if e.kind() == io::ErrorKind::NotFound => {
            VfioError::NotAvailable {
                path: "/dev/vfio/vfio".into(),
            }
        }
        vfio_ioctls::VfioError::OpenContainer(e) => VfioError::GroupFile {
            path: "/dev/vfio/vfio".into(),
            reason: e.to_string(),
        },
        e => VfioError::Vfio(chain(&e)),
    }
}

/// Our error for a device that would not open (its group is `group`).
fn device_error(e: vfio_ioctls::VfioError, group: u32) -> VfioError {
    match e {
        vfio_ioctls::VfioError::OpenGroup(e, id) => VfioError::GroupFile {
            path: format!("/dev/vfio/{id}"),
            reason: e.to_string(),
        },
        vfio_ioctls::VfioError::GroupViable => VfioError::Vfio(format!(
            "IOMMU group {group} is not viable: another process or container holds it, or a \
             device of the group is bound to a host driver"
        )),
        e => VfioError::Vfio(chain(&e)),
    }
}

/// What the kernel reports for one region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RegionInfo {
    /// `VFIO_REGION_INFO_FLAG_*`.
    flags: u32,
    /// Size in bytes.
    size: u64,
    /// Where it starts in the device file.
    offset: u64,
}

/// A region and its position in vfio-ioctls' list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Located {
    /// The position to pass to vfio-ioctls' `get_region_*`.
    position: u32,
    /// What the kernel reported.
    info: RegionInfo,
}

/// The PCI regions (index 0 to 8) from vfio-ioctls' region list, read through `at(position)`.
///
/// vfio-ioctls keeps the regions in a `Vec` and indexes it by position, not by region index:
/// a region whose info ioctl failed is left out and shifts every later one (the VGA region,
/// 8, is left out on purpose on most devices). vfio-pci puts region `i` at offset `i << 40`
/// of the device file, so region `i` is the entry at position `i` or before whose offset says
/// so. Regions that are absent or empty (an unimplemented BAR) are `None`.
fn resolve_regions(
    at: impl Fn(u32) -> RegionInfo,
) -> [Option<Located>; VFIO_PCI_NUM_REGIONS as usize] {
    let mut out = [None; VFIO_PCI_NUM_REGIONS as usize];
    for (index, slot) in out.iter_mut().enumerate() {
        let want = (index as u64) << VFIO_PCI_OFFSET_SHIFT;
        *slot = (0..=index as u32)
            .rev()
            .map(|p| (p, at(p)))
            .find(|(_, r)| r.offset == want)
            .filter(|(_, r)| r.size != 0)
            .map(|(position, info)| Located { position, info });
    }
    out
}

/// The device side of the backend: reads and writes at offsets of the device file, and MSI-X.
trait DeviceOps {
    /// Reads `data.len()` bytes at `at` of the device file.
    fn read(&self, at: u64, data: &mut [u8]) -> io::Result<()>;
    /// Writes `data` at `at` of the device file.
    fn write(&self, at: u64, data: &[u8]) -> io::Result<()>;
    /// Routes MSI-X vector 0 to `efd`.
    fn enable_msix(&self, efd: &EventFd) -> io::Result<()>;
    /// Stops MSI-X.
    fn disable_msix(&self) -> io::Result<()>;
}

/// The IOMMU side of the backend.
trait Iommu {
    /// Maps `len` bytes at `vaddr` of this process at `iova` for device DMA.
    ///
    /// # Safety
    ///
    /// `vaddr..vaddr + len` must stay mapped until after [`Iommu::unmap`] of this range (or
    /// the end of the IOMMU), and no Rust reference to that memory may exist while the device
    /// can reach it.
    unsafe fn map(&self, iova: u64, len: u64, vaddr: *mut u8) -> io::Result<()>;
    /// Removes the mapping at `iova`.
    fn unmap(&self, iova: u64, len: u64) -> io::Result<()>;
    /// Told after the process mapping behind a removed mapping is gone (its munmap); a real
    /// IOMMU has nothing to do.
    fn released(&self, _iova: u64, _len: u64) {}
}

/// The container, shared with the device (which drops its share first).
impl Iommu for Arc<VfioContainer> {
    unsafe fn map(&self, iova: u64, len: u64, vaddr: *mut u8) -> io::Result<()> {
        let len = usize::try_from(len).map_err(io::Error::other)?;
        // SAFETY: the caller keeps the memory mapped and unreferenced as long as the device
        // can reach it, which is what `vfio_dma_map` requires.
        unsafe { self.vfio_dma_map(iova, len, vaddr) }.map_err(|e| io::Error::other(chain(&e)))
    }

    fn unmap(&self, iova: u64, len: u64) -> io::Result<()> {
        let len = usize::try_from(len).map_err(io::Error::other)?;
        self.vfio_dma_unmap(iova, len)
            .map_err(|e| io::Error::other(chain(&e)))
    }
}

/// A vfio-pci device opened by vfio-ioctls.
struct KernelDevice {
    device: VfioDevice,
}

impl KernelDevice {
    /// The device file, borrowed.
    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor belongs to `self.device`, which keeps it open for as long as
        // `self` lives, and the borrow is tied to `&self`.
        unsafe { BorrowedFd::borrow_raw(self.device.as_raw_fd()) }
    }
}

/// `at` as a file offset.
fn file_offset(at: u64) -> io::Result<i64> {
    i64::try_from(at).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

impl DeviceOps for KernelDevice {
    fn read(&self, at: u64, mut data: &mut [u8]) -> io::Result<()> {
        let mut at = at;
        while !data.is_empty() {
            match nix::sys::uio::pread(self.fd(), data, file_offset(at)?) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    data = &mut data[n..];
                    at += n as u64;
                }
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn write(&self, at: u64, mut data: &[u8]) -> io::Result<()> {
        let mut at = at;
        while !data.is_empty() {
            match nix::sys::uio::pwrite(self.fd(), data, file_offset(at)?) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    data = &data[n..];
                    at += n as u64;
                }
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn enable_msix(&self, efd: &EventFd) -> io::Result<()> {
        self.device
            .enable_msix(vec![efd])
            .map_err(|e| io::Error::other(chain(&e)))
    }

    fn disable_msix(&self) -> io::Result<()> {
        self.device
            .disable_msix()
            .map_err(|e| io::Error::other(chain(&e)))
    }
}

/// One DMA mapping: the memory file mapped into this process, kept until the IOMMU no longer
/// points at it.
struct DmaMapping {
    len: u64,
    _map: MmapRaw,
}

/// The kernel VFIO [`Transport`]: trapped accesses on the device file, DMA through the
/// container's IOMMU, and the teardown in the order the kernel needs.
struct KernelTransport {
    // Field order is drop order after `Drop::drop`: the device (its file, then its group)
    // before the container.
    device: Box<dyn DeviceOps>,
    iommu: Box<dyn Iommu>,
    regions: [Option<RegionInfo>; VFIO_PCI_NUM_REGIONS as usize],
    dma: RefCell<BTreeMap<u64, DmaMapping>>,
    msix: bool,
}

impl KernelTransport {
    /// A transport over `device` and `iommu`, with the regions by PCI region index.
    fn new(
        device: Box<dyn DeviceOps>,
        iommu: Box<dyn Iommu>,
        regions: [Option<RegionInfo>; VFIO_PCI_NUM_REGIONS as usize],
    ) -> KernelTransport {
        KernelTransport {
            device,
            iommu,
            regions,
            dma: RefCell::new(BTreeMap::new()),
            msix: false,
        }
    }

    /// Routes MSI-X vector 0 to `efd`; teardown will stop it.
    fn enable_msix(&mut self, efd: &EventFd) -> Result<(), VfioError> {
        self.device
            .enable_msix(efd)
            .map_err(|e| VfioError::Vfio(format!("enabling MSI-X: {e}")))?;
        self.msix = true;
        Ok(())
    }

    /// The file offset of `len` bytes at `offset` of region `region`, if the region exists,
    /// allows the access and holds the range.
    fn locate(&self, region: u32, offset: u64, len: usize, write: bool) -> Result<u64, VfioError> {
        let r = self
            .regions
            .get(region as usize)
            .copied()
            .flatten()
            .ok_or_else(|| VfioError::BadRegion(format!("the device has no region {region}")))?;
        let (flag, what) = if write {
            (VFIO_REGION_INFO_FLAG_WRITE, "written")
        } else {
            (VFIO_REGION_INFO_FLAG_READ, "read")
        };
        if r.flags & flag == 0 {
            return Err(VfioError::BadRegion(format!(
                "region {region} cannot be {what}"
            )));
        }
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > r.size)
        {
            return Err(VfioError::BadRegion(format!(
                "access {offset:#x}+{len:#x} outside region {region} of {:#x} bytes",
                r.size
            )));
        }
        Ok(r.offset + offset)
    }

    /// Stops MSI-X, removes every DMA mapping from the IOMMU, then unmaps them from this
    /// process. The device and the container close after this, when the fields drop.
    fn shutdown(&mut self) {
        // Errors cannot be reported from a drop; the kernel cleans up what is left when the
        // device file and the container close.
        if self.msix {
            let _ = self.device.disable_msix();
            self.msix = false;
        }
        let mappings = std::mem::take(self.dma.get_mut());
        for (&iova, m) in &mappings {
            let _ = self.iommu.unmap(iova, m.len);
        }
        for (iova, m) in mappings {
            let len = m.len;
            drop(m);
            self.iommu.released(iova, len);
        }
    }
}

impl Drop for KernelTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The granule of DMA mappings: the driver's buffers are whole 4 KiB pages, the smallest
/// page an IOMMU maps (a kernel with larger pages refuses smaller mappings itself).
const DMA_PAGE: u64 = 4096;

impl Transport for KernelTransport {
    fn shutdown(&mut self) {
        KernelTransport::shutdown(self);
    }

    fn region_read(&self, region: u32, offset: u64, data: &mut [u8]) -> Result<(), VfioError> {
        let at = self.locate(region, offset, data.len(), false)?;
        self.device.read(at, data).map_err(|e| {
            VfioError::io(
                format!(
                    "reading {:#x} bytes at {offset:#x} of region {region}",
                    data.len()
                ),
                e,
            )
        })
    }

    fn region_write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), VfioError> {
        let at = self.locate(region, offset, data.len(), true)?;
        self.device.write(at, data).map_err(|e| {
            VfioError::io(
                format!(
                    "writing {:#x} bytes at {offset:#x} of region {region}",
                    data.len()
                ),
                e,
            )
        })
    }

    fn dma_map(&self, fd: BorrowedFd<'_>, len: u64, iova: u64) -> Result<(), PortError> {
        let page = DMA_PAGE;
        if len == 0 || !len.is_multiple_of(page) || !iova.is_multiple_of(page) {
            return Err(PortError::MapFailed(format!(
                "IOVA {iova:#x} and length {len:#x} must be non-zero multiples of the page \
                 size ({page:#x})"
            )));
        }
        let Some(end) = iova.checked_add(len) else {
            return Err(PortError::MapFailed(format!(
                "IOVA range {iova:#x}+{len:#x} wraps"
            )));
        };
        let mut dma = self.dma.borrow_mut();
        // Mappings are disjoint, so only the last one starting below `end` can reach `iova`.
        if let Some((&start, m)) = dma.range(..end).next_back() {
            if start + m.len > iova {
                return Err(PortError::Overlap { iova, len });
            }
        }
        let file = std::fs::File::from(
            fd.try_clone_to_owned()
                .map_err(|e| PortError::MapFailed(format!("duplicating the memory file: {e}")))?,
        );
        let file_len = file
            .metadata()
            .map_err(|e| PortError::MapFailed(format!("reading the memory file's size: {e}")))?
            .len();
        if file_len < len {
            return Err(PortError::MapFailed(format!(
                "the memory file holds {file_len:#x} bytes, fewer than the {len:#x} to map"
            )));
        }
        let map_len = usize::try_from(len)
            .map_err(|_| PortError::MapFailed(format!("length {len:#x} too large")))?;
        let map = memmap2::MmapOptions::new()
            .len(map_len)
            .map_raw(&file)
            .map_err(|e| PortError::MapFailed(format!("mmap of the memory file: {e}")))?;
        // SAFETY: `map` is a live MAP_SHARED mapping of `len` bytes; it moves into the table
        // below and is only dropped after the IOMMU unmaps `iova` (in `dma_unmap` or
        // `shutdown`), or right here if the IOMMU refuses it. This code never makes a Rust
        // reference into it.
        unsafe { self.iommu.map(iova, len, map.as_mut_ptr()) }
            .map_err(|e| PortError::MapFailed(format!("IOMMU map of {iova:#x}+{len:#x}: {e}")))?;
        dma.insert(iova, DmaMapping { len, _map: map });
        Ok(())
    }

    fn dma_unmap(&self, iova: u64, len: u64) -> Result<(), PortError> {
        let mut dma = self.dma.borrow_mut();
        if dma.get(&iova).is_none_or(|m| m.len != len) {
            return Err(PortError::NotMapped { iova, len });
        }
        // A mapping the IOMMU will not remove stays in the table: the device may still reach it.
        self.iommu
            .unmap(iova, len)
            .map_err(|e| PortError::MapFailed(format!("IOMMU unmap of {iova:#x}+{len:#x}: {e}")))?;
        drop(dma.remove(&iova));
        self.iommu.released(iova, len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::port::Port;
    use crate::vfio::CONFIG_REGION;
    use crate::DmaMemory;
    use ringbell_specs::regs;
    use std::cell::RefCell;
    use std::rc::Rc;

    type Log = Rc<RefCell<Vec<String>>>;

    const RW: u32 = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
    const CONFIG_AT: u64 = (CONFIG_REGION as u64) << VFIO_PCI_OFFSET_SHIFT;

    /// A device file made of a 4 KiB BAR0 at 0 and 256 bytes of config space at `7 << 40`.
    struct FakeDevice {
        log: Log,
        bar0: RefCell<Vec<u8>>,
        config: RefCell<Vec<u8>>,
    }

    impl FakeDevice {
        fn new(log: &Log, vendor: u16, device: u16) -> FakeDevice {
            let mut config = vec![0u8; 256];
            config[..2].copy_from_slice(&vendor.to_le_bytes());
            config[2..4].copy_from_slice(&device.to_le_bytes());
            FakeDevice {
                log: log.clone(),
                bar0: RefCell::new(vec![0; 0x1000]),
                config: RefCell::new(config),
            }
        }

        fn space(&self, at: u64) -> (&RefCell<Vec<u8>>, usize) {
            if at >= CONFIG_AT {
                (&self.config, (at - CONFIG_AT) as usize)
            } else {
                (&self.bar0, at as usize)
            }
        }
    }

    impl DeviceOps for FakeDevice {
        fn read(&self, at: u64, data: &mut [u8]) -> io::Result<()> {
            let (space, o) = self.space(at);
            data.copy_from_slice(&space.borrow()[o..o + data.len()]);
            Ok(())
        }
        fn write(&self, at: u64, data: &[u8]) -> io::Result<()> {
            let (space, o) = self.space(at);
            space.borrow_mut()[o..o + data.len()].copy_from_slice(data);
            Ok(())
        }
        fn enable_msix(&self, _: &EventFd) -> io::Result<()> {
            self.log.borrow_mut().push("msix on".into());
            Ok(())
        }
        fn disable_msix(&self) -> io::Result<()> {
            self.log.borrow_mut().push("msix off".into());
            Ok(())
        }
    }

    impl Drop for FakeDevice {
        fn drop(&mut self) {
            self.log.borrow_mut().push("device closed".into());
        }
    }

    /// An IOMMU that records what it is asked, can be told to refuse, and checks at each
    /// unmap that the process mapping is still there and is the memory file.
    struct FakeIommu {
        log: Log,
        vaddrs: RefCell<BTreeMap<u64, usize>>,
        refuse: Rc<std::cell::Cell<bool>>,
    }

    impl Iommu for FakeIommu {
        unsafe fn map(&self, iova: u64, len: u64, vaddr: *mut u8) -> io::Result<()> {
            if self.refuse.get() {
                return Err(io::Error::other("refused"));
            }
            self.vaddrs.borrow_mut().insert(iova, vaddr as usize);
            self.log
                .borrow_mut()
                .push(format!("map {iova:#x}+{len:#x}"));
            Ok(())
        }
        fn unmap(&self, iova: u64, len: u64) -> io::Result<()> {
            let vaddr = self
                .vaddrs
                .borrow_mut()
                .remove(&iova)
                .expect("unmap of a mapped iova");
            // SAFETY: the transport keeps the process mapping until after this call (the
            // property under test: if it did not, this read would fault and fail the test).
            let first = unsafe { (vaddr as *const u8).read_volatile() };
            self.log
                .borrow_mut()
                .push(format!("unmap {iova:#x}+{len:#x} (first byte {first:#x})"));
            Ok(())
        }
        fn released(&self, iova: u64, len: u64) {
            self.log
                .borrow_mut()
                .push(format!("munmap {iova:#x}+{len:#x}"));
        }
    }

    impl Drop for FakeIommu {
        fn drop(&mut self) {
            self.log.borrow_mut().push("container closed".into());
        }
    }

    fn regions() -> [Option<RegionInfo>; VFIO_PCI_NUM_REGIONS as usize] {
        let mut r = [None; VFIO_PCI_NUM_REGIONS as usize];
        r[BAR0_REGION as usize] = Some(RegionInfo {
            flags: RW | VFIO_REGION_INFO_FLAG_MMAP,
            size: 0x1000,
            offset: 0,
        });
        // Read-only config space, so that the write check has something to refuse.
        r[CONFIG_REGION as usize] = Some(RegionInfo {
            flags: VFIO_REGION_INFO_FLAG_READ,
            size: 256,
            offset: CONFIG_AT,
        });
        r
    }

    type Refuse = Rc<std::cell::Cell<bool>>;

    fn transport(vendor: u16, device: u16) -> (KernelTransport, Log, Refuse) {
        let log = Log::default();
        let refuse = Refuse::default();
        let iommu = Box::new(FakeIommu {
            log: log.clone(),
            vaddrs: RefCell::default(),
            refuse: refuse.clone(),
        });
        let t = KernelTransport::new(
            Box::new(FakeDevice::new(&log, vendor, device)),
            iommu,
            regions(),
        );
        (t, log, refuse)
    }

    fn ringbell() -> (KernelTransport, Log, Refuse) {
        transport(regs::PCI_VENDOR_ID, regs::PCI_DEVICE_ID)
    }

    /// A memory file of `len` bytes whose first byte is `mark`.
    fn memory(len: usize, mark: u8) -> DmaMemory {
        let m = DmaMemory::new(len).unwrap();
        m.write(0, &[mark]).unwrap();
        m
    }

    #[test]
    fn regions_are_found_by_offset_not_by_position() {
        let info = |index: u64, size: u64| RegionInfo {
            flags: RW,
            size,
            offset: index << VFIO_PCI_OFFSET_SHIFT,
        };
        // As vfio-ioctls would hold them: BAR0..BAR5, ROM, config; VGA left out.
        let full: Vec<RegionInfo> = (0..8).map(|i| info(i, 0x1000)).collect();
        let lookup = |list: Vec<RegionInfo>| {
            move |p: u32| {
                list.get(p as usize).copied().unwrap_or(RegionInfo {
                    flags: 0,
                    size: 0,
                    offset: 0,
                })
            }
        };
        let r = resolve_regions(lookup(full.clone()));
        assert_eq!(r[0].unwrap().position, 0);
        assert_eq!(r[7].unwrap().position, 7);
        assert_eq!(r[7].unwrap().info.offset, CONFIG_AT);
        assert!(r[8].is_none());
        // BAR2's info failed: everything after it moved down by one.
        let mut shifted = full.clone();
        shifted.remove(2);
        let r = resolve_regions(lookup(shifted));
        assert!(r[2].is_none());
        assert_eq!(r[3].unwrap().position, 2);
        assert_eq!(r[7].unwrap().position, 6);
        assert_eq!(r[7].unwrap().info.offset, CONFIG_AT);
        // An unimplemented BAR (size 0) and an empty list give no region.
        let mut empty_bar1 = full;
        empty_bar1[1].size = 0;
        assert!(resolve_regions(lookup(empty_bar1))[1].is_none());
        assert!(resolve_regions(lookup(Vec::new()))
            .iter()
            .all(Option::is_none));
    }

    #[test]
    fn trapped_accesses_are_bounds_checked() {
        let (t, _, _) = ringbell();
        t.region_write(BAR0_REGION, 0xFFC, &[1, 2, 3, 4]).unwrap();
        let mut b = [0u8; 4];
        t.region_read(BAR0_REGION, 0xFFC, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4]);
        let bad = |r: Result<(), VfioError>| matches!(r, Err(VfioError::BadRegion(_)));
        assert!(bad(t.region_read(BAR0_REGION, 0xFFD, &mut b)));
        assert!(bad(t.region_write(BAR0_REGION, 0x1000, &b)));
        assert!(bad(t.region_read(BAR0_REGION, u64::MAX - 1, &mut b)));
        assert!(bad(t.region_read(1, 0, &mut b)));
        assert!(bad(t.region_read(99, 0, &mut b)));
        assert!(bad(t.region_write(CONFIG_REGION, 0, &b)));
        t.region_read(CONFIG_REGION, 252, &mut b).unwrap();
        assert!(bad(t.region_read(CONFIG_REGION, 253, &mut b)));
    }

    #[test]
    fn identity_is_read_from_config_space() {
        let (t, _, _) = ringbell();
        check_identity(&t).unwrap();
        let (t, _, _) = transport(0x8086, 0x1572);
        match check_identity(&t) {
            Err(VfioError::NotRingbell { vendor, device }) => {
                assert_eq!((vendor, device), (0x8086, 0x1572));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn dma_sizes_and_alignment_are_checked() {
        let (t, log, _) = ringbell();
        let mem = memory(0x4000, 0);
        let page = DMA_PAGE;
        for (len, iova) in [
            (0, 0x1_0000_0000),
            (page / 2, 0x1_0000_0000),
            (page + 1, 0x1_0000_0000),
            (page, 0x1_0000_0800),
            (page, u64::MAX - page + 1),
        ] {
            assert!(
                matches!(
                    t.dma_map(mem.fd().unwrap(), len, iova),
                    Err(PortError::MapFailed(_))
                ),
                "{len:#x} at {iova:#x}"
            );
        }
        assert!(log.borrow().is_empty(), "{:?}", log.borrow());
    }

    #[test]
    fn dma_of_more_than_the_file_holds_is_refused() {
        let (t, log, _) = ringbell();
        let page = DMA_PAGE as usize;
        let mem = memory(page, 0);
        match t.dma_map(mem.fd().unwrap(), 2 * page as u64, 0x1_0000_0000) {
            Err(PortError::MapFailed(m)) => assert!(m.contains("fewer"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(log.borrow().is_empty());
    }

    #[test]
    fn dma_overlaps_are_refused_and_neighbours_allowed() {
        let (t, _, _) = ringbell();
        let p = DMA_PAGE;
        let mem = memory(4 * p as usize, 0);
        let base = 0x1_0000_0000;
        t.dma_map(mem.fd().unwrap(), 2 * p, base + 2 * p).unwrap();
        for (len, iova) in [
            (2 * p, base + 2 * p),
            (p, base + 3 * p),
            (2 * p, base + p),
            (4 * p, base),
            (p, base + 2 * p),
        ] {
            assert!(
                matches!(
                    t.dma_map(mem.fd().unwrap(), len, iova),
                    Err(PortError::Overlap { iova: i, len: l }) if i == iova && l == len
                ),
                "{len:#x} at {iova:#x}"
            );
        }
        // Right below and right above are fine.
        t.dma_map(mem.fd().unwrap(), 2 * p, base).unwrap();
        t.dma_map(mem.fd().unwrap(), p, base + 4 * p).unwrap();
        assert_eq!(t.dma.borrow().len(), 3);
    }

    #[test]
    fn dma_unmap_needs_an_exact_mapping_and_frees_the_range() {
        let (t, log, _) = ringbell();
        let p = DMA_PAGE;
        let mem = memory(2 * p as usize, 0x5A);
        let iova = 0x1_0000_0000;
        assert!(matches!(
            t.dma_unmap(iova, p),
            Err(PortError::NotMapped { iova: i, len }) if i == iova && len == p
        ));
        t.dma_map(mem.fd().unwrap(), 2 * p, iova).unwrap();
        // Same start, other length; inside it; another start: all unknown.
        for (i, l) in [(iova, p), (iova + p, p), (iova + 2 * p, 2 * p)] {
            assert!(
                matches!(t.dma_unmap(i, l), Err(PortError::NotMapped { .. })),
                "{l:#x} at {i:#x}"
            );
        }
        t.dma_unmap(iova, 2 * p).unwrap();
        assert!(matches!(
            t.dma_unmap(iova, 2 * p),
            Err(PortError::NotMapped { .. })
        ));
        // The range is free again.
        t.dma_map(mem.fd().unwrap(), p, iova + p).unwrap();
        assert_eq!(
            *log.borrow(),
            vec![
                format!("map {iova:#x}+{:#x}", 2 * p),
                format!("unmap {iova:#x}+{:#x} (first byte 0x5a)", 2 * p),
                format!("munmap {iova:#x}+{:#x}", 2 * p),
                format!("map {:#x}+{p:#x}", iova + p),
            ]
        );
    }

    #[test]
    fn a_mapping_the_iommu_refuses_is_not_kept() {
        let (t, _, refuse) = ringbell();
        let p = DMA_PAGE;
        let mem = memory(p as usize, 0);
        refuse.set(true);
        assert!(matches!(
            t.dma_map(mem.fd().unwrap(), p, 0x1_0000_0000),
            Err(PortError::MapFailed(m)) if m.contains("refused")
        ));
        assert!(t.dma.borrow().is_empty());
        refuse.set(false);
        t.dma_map(mem.fd().unwrap(), p, 0x1_0000_0000).unwrap();
    }

    #[test]
    fn teardown_stops_msix_then_unmaps_dma_then_closes_device_then_container() {
        let (mut t, log, _) = ringbell();
        let p = DMA_PAGE;
        let a = memory(p as usize, 0xA1);
        let b = memory(2 * p as usize, 0xB2);
        let efd = EventFd::new(EFD_NONBLOCK).unwrap();
        t.enable_msix(&efd).unwrap();
        // Through the port, as the driver does it.
        let port = VfioPort::new(Bar::default(), Box::new(t), Some(efd));
        port.dma_map(b.fd().unwrap(), 2 * p, 0x2_0000_0000).unwrap();
        port.dma_map(a.fd().unwrap(), p, 0x1_0000_0000).unwrap();
        drop(port);
        assert_eq!(
            *log.borrow(),
            vec![
                "msix on".to_string(),
                format!("map 0x200000000+{:#x}", 2 * p),
                format!("map 0x100000000+{p:#x}"),
                "msix off".into(),
                format!("unmap 0x100000000+{p:#x} (first byte 0xa1)"),
                format!("unmap 0x200000000+{:#x} (first byte 0xb2)", 2 * p),
                format!("munmap 0x100000000+{p:#x}"),
                format!("munmap 0x200000000+{:#x}", 2 * p),
                "device closed".into(),
                "container closed".into(),
            ]
        );
    }

    #[test]
    fn open_on_this_machine_fails_clearly() {
        let r = VfioPort::open("0000:00:01.0");
        if !Path::new("/dev/vfio/vfio").exists() {
            match r {
                Err(e @ VfioError::NotAvailable { .. }) => {
                    assert!(e.to_string().contains("/dev/vfio/vfio"), "{e}");
                }
                other => panic!("expected NotAvailable, got {other:?}"),
            }
        } else {
            // With VFIO present the answer depends on the machine: any diagnosis, or a port
            // if a ringbell NIC really sits there. Either way, no panic.
            match r {
                Ok(port) => drop(port),
                Err(e) => assert!(!e.to_string().is_empty()),
            }
        }
        // A malformed address is refused before anything is looked at.
        assert!(matches!(
            VfioPort::open("not-an-address"),
            Err(VfioError::Vfio(m)) if m.contains("malformed")
        ));
    }
}
