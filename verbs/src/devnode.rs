//! The device nodes of ringbell NICs, for programs that look for them before they use a
//! device.
//!
//! The kernel's uverbs driver gives every RDMA device a character device,
//! `/dev/infiniband/uverbsN`, and some libraries check it before they open the device: UCX
//! uses a device only when `/dev/infiniband/<dev_name>` is a character device it may read
//! and write (`stat(2)` and `access(2)`), and never opens it. A ringbell NIC `i` has the
//! `dev_name` `uverbs-rb{i}`. When that node exists (made by root, as the README shows),
//! the system's answer stands. When it does not, this library answers for it as the node of
//! an uverbs device would be answered: a character device, readable and writable. Every
//! other path, and every other error, is the system's answer unchanged.

use std::ffi::CStr;
use std::sync::OnceLock;

/// Where the nodes are, and the prefix of a ringbell NIC's node name.
const NODE_PREFIX: &[u8] = b"/dev/infiniband/uverbs-rb";
/// The uverbs character devices' major number, and the minor of the first one.
const UVERBS_MAJOR: u32 = 231;
const UVERBS_MINOR_BASE: u32 = 192;

/// The NIC whose node `path` names, when it is a NIC of this process's plan.
pub(crate) fn nic_of_node(path: &[u8]) -> Option<usize> {
    let digits = path.strip_prefix(NODE_PREFIX)?;
    if digits.is_empty() || digits.len() > 4 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let i: usize = std::str::from_utf8(digits).ok()?.parse().ok()?;
    // "rb01" is not NIC 1's name.
    if digits.len() > 1 && digits[0] == b'0' {
        return None;
    }
    static NICS: OnceLock<usize> = OnceLock::new();
    let n = *NICS.get_or_init(|| ringbell::discover::NicPlan::from_env().nics.len());
    (i < n).then_some(i)
}

/// What `stat(2)` says of NIC `i`'s node: a character device, readable and writable by all,
/// with the uverbs major number.
pub(crate) fn node_stat(i: usize, st: &mut libc::stat) {
    // SAFETY: `libc::stat` is plain data; all zeros is a valid value.
    *st = unsafe { std::mem::zeroed() };
    st.st_mode = libc::S_IFCHR | 0o666;
    st.st_nlink = 1;
    st.st_rdev = libc::makedev(UVERBS_MAJOR, UVERBS_MINOR_BASE + i as u32);
    st.st_blksize = 4096;
}

/// The system's definition of a libc function this library also defines (`RTLD_NEXT`).
fn next(name: &CStr, cell: &OnceLock<usize>) -> usize {
    *cell.get_or_init(|| {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name.
        unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) as usize }
    })
}

/// `stat(2)`: the system's answer, or for a missing node of a ringbell NIC, a character
/// device.
///
/// # Safety
/// As `stat(2)`: `path` a C string, `buf` writable.
#[no_mangle]
pub unsafe extern "C" fn stat(path: *const libc::c_char, buf: *mut libc::stat) -> libc::c_int {
    static REAL: OnceLock<usize> = OnceLock::new();
    let real = next(c"stat", &REAL);
    let r = if real == 0 {
        crate::set_errno(libc::ENOSYS);
        -1
    } else {
        // SAFETY: libc's `stat`, with the caller's arguments unchanged.
        let f: unsafe extern "C" fn(*const libc::c_char, *mut libc::stat) -> libc::c_int =
            unsafe { std::mem::transmute(real) };
        // SAFETY: the caller's arguments, as `stat(2)` takes them.
        unsafe { f(path, buf) }
    };
    if buf.is_null() {
        return r;
    }
    // SAFETY: the caller's C string.
    match unsafe { missing_node(r, path) } {
        Some(i) => {
            // SAFETY: the caller's non-null output buffer.
            node_stat(i, unsafe { &mut *buf });
            0
        }
        None => r,
    }
}

/// `access(2)`: the system's answer, or for a missing node of a ringbell NIC, granted
/// (reading and writing, not executing).
///
/// # Safety
/// As `access(2)`: `path` a C string.
#[no_mangle]
pub unsafe extern "C" fn access(path: *const libc::c_char, mode: libc::c_int) -> libc::c_int {
    static REAL: OnceLock<usize> = OnceLock::new();
    let real = next(c"access", &REAL);
    let r = if real == 0 {
        crate::set_errno(libc::ENOSYS);
        -1
    } else {
        // SAFETY: libc's `access`, with the caller's arguments unchanged.
        let f: unsafe extern "C" fn(*const libc::c_char, libc::c_int) -> libc::c_int =
            unsafe { std::mem::transmute(real) };
        // SAFETY: the caller's arguments, as `access(2)` takes them.
        unsafe { f(path, mode) }
    };
    // SAFETY: the caller's C string.
    match unsafe { missing_node(r, path) } {
        Some(_) if mode & libc::X_OK == 0 => 0,
        Some(_) => {
            crate::set_errno(libc::EACCES);
            -1
        }
        None => r,
    }
}

/// The NIC whose node `path` names, when the system's call just failed on it with ENOENT
/// (`r` its result, `errno` still its error): the node this library answers for.
///
/// # Safety
/// `path` is NULL or a C string.
unsafe fn missing_node(r: libc::c_int, path: *const libc::c_char) -> Option<usize> {
    let enoent = std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOENT);
    if r == 0 || !enoent || path.is_null() {
        return None;
    }
    // SAFETY: a non-null C string, as the caller promises.
    nic_of_node(unsafe { CStr::from_ptr(path) }.to_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_nodes_of_the_plan_s_nics_are_answered_for() {
        // The default plan: two in-process NICs.
        assert_eq!(nic_of_node(b"/dev/infiniband/uverbs-rb0"), Some(0));
        assert_eq!(nic_of_node(b"/dev/infiniband/uverbs-rb1"), Some(1));
        for p in [
            &b"/dev/infiniband/uverbs-rb2"[..],
            b"/dev/infiniband/uverbs-rb",
            b"/dev/infiniband/uverbs-rb01",
            b"/dev/infiniband/uverbs-rb1x",
            b"/dev/infiniband/uverbs0",
            b"/dev/infiniband/uverbs-rb99999",
            b"/tmp/uverbs-rb0",
        ] {
            assert_eq!(nic_of_node(p), None, "{}", String::from_utf8_lossy(p));
        }
        // SAFETY: plain data; all zeros is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        node_stat(1, &mut st);
        assert_eq!(st.st_mode & libc::S_IFMT, libc::S_IFCHR);
        assert_eq!(st.st_mode & 0o777, 0o666);
        assert_eq!(libc::major(st.st_rdev), 231);
        assert_eq!(libc::minor(st.st_rdev), 193);
    }
}
