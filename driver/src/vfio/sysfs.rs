//! Pre-flight checks for kernel VFIO, read from sysfs and `/dev` before any VFIO call.
//!
//! `vfio-ioctls` reports a missing module, a device bound to the wrong driver or an IOMMU that
//! is off as one opaque ioctl or open failure. [`preflight`] looks at the same files first and
//! names the first thing that is wrong, with the command that fixes it, in the order a user
//! meets them: the address, `/dev/vfio/vfio`, the device, its driver, its IOMMU group, the
//! other devices of the group, and the group's device file. Both roots are parameters so the
//! checks run in tests against fake trees.

use super::VfioError;
use std::fs;
use std::path::{Path, PathBuf};

/// Drivers that may hold the other devices of a group without spoiling it: vfio-pci itself,
/// pci-stub (which never touches the device), and the PCIe port driver of bridges (which
/// leaves DMA to the downstream devices).
const GROUP_SAFE_DRIVERS: [&str; 3] = ["vfio-pci", "pci-stub", "pcieport"];

/// The canonical form of a PCI address: `DDDD:BB:DD.F`, lower-case hex, the domain padded to
/// at least four digits. The short form `BB:DD.F` means domain 0 (as `lspci` prints it).
pub fn canonical_address(addr: &str) -> Result<String, VfioError> {
    let bad = || {
        VfioError::Vfio(format!(
            "malformed PCI address {addr:?}: expected DDDD:BB:DD.F (hex, e.g. 0000:01:00.0) \
             or BB:DD.F"
        ))
    };
    let parts: Vec<&str> = addr.trim().split(':').collect();
    let (domain, bus, devfn) = match parts.as_slice() {
        [d, b, df] => (*d, *b, *df),
        [b, df] => ("0", *b, *df),
        _ => return Err(bad()),
    };
    let (dev, func) = devfn.split_once('.').ok_or_else(bad)?;
    let hex = |s: &str, max_len: usize| -> Result<u32, VfioError> {
        if s.is_empty() || s.len() > max_len || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(bad());
        }
        u32::from_str_radix(s, 16).map_err(|_| bad())
    };
    let domain = hex(domain, 8)?;
    let bus = hex(bus, 2)?;
    let dev = hex(dev, 2)?;
    let func = hex(func, 1)?;
    if dev > 0x1f || func > 7 {
        return Err(bad());
    }
    Ok(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// The file name a symlink points at (`.../drivers/vfio-pci` gives `vfio-pci`), or `None` if
/// there is no such link.
fn link_name(link: &Path) -> Option<String> {
    let target = fs::read_link(link).ok()?;
    Some(target.file_name()?.to_string_lossy().into_owned())
}

/// Whether the device at `dev` is a PCI-to-PCI or CardBus bridge (class 0x0604xx or 0x0607xx).
fn is_bridge(dev: &Path) -> bool {
    let Ok(class) = fs::read_to_string(dev.join("class")) else {
        return false;
    };
    let class = class.trim().trim_start_matches("0x");
    u32::from_str_radix(class, 16).is_ok_and(|c| matches!(c >> 8, 0x0604 | 0x0607))
}

/// Checks that PCI device `addr` can be opened through kernel VFIO and returns its IOMMU
/// group number; `sys_root` and `dev_root` are `/sys` and `/dev` outside tests. `addr` may be
/// in any form [`canonical_address`] accepts.
pub fn preflight(sys_root: &Path, dev_root: &Path, addr: &str) -> Result<u32, VfioError> {
    let addr = canonical_address(addr)?;

    let container = dev_root.join("vfio/vfio");
    if !container.exists() {
        return Err(VfioError::NotAvailable {
            path: container.display().to_string(),
        });
    }

    let dev = device_path(sys_root, &addr);
    if !dev.is_dir() {
        return Err(VfioError::NoDevice {
            addr,
            path: dev.display().to_string(),
        });
    }

    let driver = link_name(&dev.join("driver")).unwrap_or_else(|| "no driver".to_string());
    if driver != "vfio-pci" {
        return Err(VfioError::NotBound { addr, driver });
    }

    let Some(group_name) = link_name(&dev.join("iommu_group")) else {
        return Err(VfioError::NoIommuGroup { addr });
    };
    let group: u32 = group_name.parse().map_err(|_| {
        VfioError::Vfio(format!(
            "{} does not name an IOMMU group (it points at {group_name:?})",
            dev.join("iommu_group").display()
        ))
    })?;

    let members = sys_root.join(format!("kernel/iommu_groups/{group}/devices"));
    let entries =
        fs::read_dir(&members).map_err(|e| VfioError::io(members.display().to_string(), e))?;
    let mut others: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .filter(|(name, _)| *name != addr)
        .collect();
    // Report the same device every time when several spoil the group.
    others.sort();
    for (other, path) in others {
        let Some(driver) = link_name(&path.join("driver")) else {
            continue;
        };
        if GROUP_SAFE_DRIVERS.contains(&driver.as_str()) || is_bridge(&path) {
            continue;
        }
        return Err(VfioError::GroupNotViable {
            group,
            other,
            driver,
        });
    }

    let group_file = dev_root.join(format!("vfio/{group}"));
    let reason = if !group_file.exists() {
        Some("it does not exist (is the device bound to vfio-pci?)".to_string())
    } else {
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&group_file)
            .err()
            .map(|e| e.to_string())
    };
    if let Some(reason) = reason {
        return Err(VfioError::GroupFile {
            path: group_file.display().to_string(),
            reason,
        });
    }
    Ok(group)
}

/// The sysfs directory of PCI device `addr` (already canonical) under `sys_root`.
pub fn device_path(sys_root: &Path, addr: &str) -> PathBuf {
    sys_root.join("bus/pci/devices").join(addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::sync::atomic::{AtomicU32, Ordering};

    const ADDR: &str = "0000:01:00.0";

    /// A fake `/sys` + `/dev` in a fresh temp directory, removed on drop.
    struct Tree {
        root: PathBuf,
    }

    impl Tree {
        /// A tree where `ADDR` is fully usable: bound to vfio-pci, in group 5, with
        /// `/dev/vfio/{vfio,5}`.
        fn good() -> Tree {
            static N: AtomicU32 = AtomicU32::new(0);
            let root = std::env::temp_dir().join(format!(
                "ringbell-sysfs-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&root);
            fs::create_dir_all(root.join("sys/bus/pci/drivers")).unwrap();
            fs::create_dir_all(root.join("dev/vfio")).unwrap();
            let t = Tree { root };
            t.device(ADDR, Some("vfio-pci"), Some(5), "0x020000");
            fs::write(t.root.join("dev/vfio/vfio"), b"").unwrap();
            fs::write(t.root.join("dev/vfio/5"), b"").unwrap();
            t
        }

        fn sys(&self) -> PathBuf {
            self.root.join("sys")
        }

        fn dev(&self) -> PathBuf {
            self.root.join("dev")
        }

        /// Adds a device the way sysfs lays it out: the real directory under
        /// `devices/pci0000:00`, a link from `bus/pci/devices`, a `driver` link into
        /// `bus/pci/drivers`, and an `iommu_group` link with the group's back link.
        fn device(&self, addr: &str, driver: Option<&str>, group: Option<u32>, class: &str) {
            let sys = self.sys();
            let real = sys.join("devices/pci0000:00").join(addr);
            fs::create_dir_all(&real).unwrap();
            fs::write(real.join("class"), format!("{class}\n")).unwrap();
            fs::create_dir_all(sys.join("bus/pci/devices")).unwrap();
            symlink(&real, sys.join("bus/pci/devices").join(addr)).unwrap();
            if let Some(d) = driver {
                let dir = sys.join("bus/pci/drivers").join(d);
                fs::create_dir_all(&dir).unwrap();
                symlink(&dir, real.join("driver")).unwrap();
            }
            if let Some(g) = group {
                let gdir = sys.join(format!("kernel/iommu_groups/{g}"));
                fs::create_dir_all(gdir.join("devices")).unwrap();
                symlink(&gdir, real.join("iommu_group")).unwrap();
                symlink(&real, gdir.join("devices").join(addr)).unwrap();
            }
        }

        fn real(&self, addr: &str) -> PathBuf {
            self.sys().join("devices/pci0000:00").join(addr)
        }

        fn preflight(&self, addr: &str) -> Result<u32, VfioError> {
            preflight(&self.sys(), &self.dev(), addr)
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.root);
        }
    }

    #[test]
    fn addresses_are_canonicalised() {
        assert_eq!(canonical_address("0000:01:00.0").unwrap(), "0000:01:00.0");
        assert_eq!(canonical_address("0000:AF:1F.7").unwrap(), "0000:af:1f.7");
        assert_eq!(canonical_address("3b:00.1").unwrap(), "0000:3b:00.1");
        assert_eq!(canonical_address("10000:00:02.0").unwrap(), "10000:00:02.0");
        assert_eq!(canonical_address(" 1:2:3.4 ").unwrap(), "0001:02:03.4");
        for bad in [
            "",
            "01:00",
            "0000:01:00",
            "0000:01:00.8",
            "0000:01:20.0",
            "0000:001:00.0",
            "0000:01:00.0.1",
            "g000:01:00.0",
            "0:0:0:00.0",
            "0000:01:+1.0",
            "123456789:00:00.0",
        ] {
            assert!(
                matches!(canonical_address(bad), Err(VfioError::Vfio(m)) if m.contains("malformed")),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_usable_device_gives_its_group() {
        let t = Tree::good();
        // Group mates that do not spoil the group: another vfio-pci function, a pci-stub
        // one, one with no driver, a bridge on pcieport and a bridge on some other driver.
        for (addr, driver) in [
            ("0000:01:00.1", Some("vfio-pci")),
            ("0000:01:00.2", Some("pci-stub")),
            ("0000:01:00.3", None),
        ] {
            t.device(addr, driver, Some(5), "0x020000");
        }
        t.device("0000:00:01.0", Some("pcieport"), Some(5), "0x060400");
        t.device("0000:00:01.1", Some("shpchp"), Some(5), "0x060400");
        assert_eq!(t.preflight(ADDR).unwrap(), 5);
        assert_eq!(t.preflight("01:00.0").unwrap(), 5);
    }

    #[test]
    fn a_malformed_address_is_named() {
        let t = Tree::good();
        let e = t.preflight("01:00:00:0").unwrap_err();
        assert!(
            matches!(&e, VfioError::Vfio(m) if m.contains("01:00:00:0")),
            "{e}"
        );
    }

    #[test]
    fn no_container_means_vfio_is_not_available() {
        let t = Tree::good();
        fs::remove_file(t.dev().join("vfio/vfio")).unwrap();
        match t.preflight(ADDR) {
            Err(VfioError::NotAvailable { path }) => assert!(path.ends_with("vfio/vfio")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_absent_device_is_named() {
        let t = Tree::good();
        match t.preflight("0000:02:00.0") {
            Err(VfioError::NoDevice { addr, path }) => {
                assert_eq!(addr, "0000:02:00.0");
                assert!(path.ends_with("bus/pci/devices/0000:02:00.0"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_device_on_another_driver_is_not_bound() {
        let t = Tree::good();
        t.device("0000:02:00.0", Some("ixgbe"), Some(6), "0x020000");
        match t.preflight("0000:02:00.0") {
            Err(e @ VfioError::NotBound { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("ixgbe"), "{msg}");
                assert!(msg.contains("driver_override"), "{msg}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_device_without_a_driver_is_not_bound() {
        let t = Tree::good();
        t.device("0000:02:00.0", None, Some(6), "0x020000");
        match t.preflight("0000:02:00.0") {
            Err(VfioError::NotBound { driver, .. }) => assert_eq!(driver, "no driver"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn no_iommu_group_means_the_iommu_is_off() {
        let t = Tree::good();
        t.device("0000:02:00.0", Some("vfio-pci"), None, "0x020000");
        match t.preflight("0000:02:00.0") {
            Err(VfioError::NoIommuGroup { addr }) => assert_eq!(addr, "0000:02:00.0"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_group_mate_on_a_host_driver_spoils_the_group() {
        let t = Tree::good();
        t.device("0000:01:00.2", None, Some(5), "0x020000");
        t.device("0000:01:00.1", Some("ixgbe"), Some(5), "0x020000");
        match t.preflight(ADDR) {
            Err(VfioError::GroupNotViable {
                group,
                other,
                driver,
            }) => {
                assert_eq!(group, 5);
                assert_eq!(other, "0000:01:00.1");
                assert_eq!(driver, "ixgbe");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_missing_group_file_is_named() {
        let t = Tree::good();
        fs::remove_file(t.dev().join("vfio/5")).unwrap();
        match t.preflight(ADDR) {
            Err(VfioError::GroupFile { path, reason }) => {
                assert!(path.ends_with("vfio/5"), "{path}");
                assert!(reason.contains("does not exist"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_group_file_that_cannot_be_opened_read_write_is_named() {
        let t = Tree::good();
        // A directory cannot be opened for writing, even by root (the tests may run as root,
        // which a mode of 0 would not stop).
        fs::remove_file(t.dev().join("vfio/5")).unwrap();
        fs::create_dir(t.dev().join("vfio/5")).unwrap();
        match t.preflight(ADDR) {
            Err(VfioError::GroupFile { path, reason }) => {
                assert!(path.ends_with("vfio/5"), "{path}");
                assert!(!reason.contains("does not exist"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_group_link_must_name_a_number() {
        let t = Tree::good();
        let real = t.real(ADDR);
        fs::remove_file(real.join("iommu_group")).unwrap();
        symlink(
            t.sys().join("kernel/iommu_groups/x"),
            real.join("iommu_group"),
        )
        .unwrap();
        assert!(matches!(t.preflight(ADDR), Err(VfioError::Vfio(_))));
    }
}
