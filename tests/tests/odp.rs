//! On-demand paging: a region registered on demand (`reg_odp_mr`) is the process's memory
//! as it is mapped when the NIC uses it. Nothing is pinned, copied or moved at registration;
//! pages the program maps afresh under the region are what later work reaches; a page that
//! is not mapped fails the access that needed it.

use nix::sys::mman::{mmap_anonymous, munmap, MapFlags, ProtFlags};
use ringbell::*;
use ringbell_tests::*;
use std::num::NonZeroUsize;
use std::ptr::NonNull;

const PAGE: usize = 4096;

fn write_into(p: &mut Pair, wr_id: u64, rkey: u32, addr: u64, data: &[u8]) -> WcStatus {
    p.a.buf.write(0, data).unwrap();
    let sge = [p.a.mr.sge(0, data.len() as u32)];
    let remote = RemoteAddr { addr, rkey };
    p.a.qp
        .post_send(&[SendWr::new(wr_id, WrOp::Write(remote), &sge).flags(SendFlags::SIGNALED)])
        .unwrap();
    wait(&p.fabric, &mut p.a.cq, 1)[0].status
}

/// Whether a line of /proc/self/maps covering `addr` names one of the driver's memory files.
fn backed_by_memory_file(addr: usize) -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .any(|l| {
            let (range, rest) = l.split_once(' ').unwrap();
            let (s, e) = range.split_once('-').unwrap();
            let (s, e) = (
                usize::from_str_radix(s, 16).unwrap(),
                usize::from_str_radix(e, 16).unwrap(),
            );
            s <= addr && addr < e && rest.contains("memfd:ringbell")
        })
}

#[test]
fn a_region_on_demand_follows_the_process_mappings() {
    let mut p = pair();
    assert!(p.b.dev.on_demand());
    let len = NonZeroUsize::new(3 * PAGE).unwrap();
    let prot = ProtFlags::PROT_READ | ProtFlags::PROT_WRITE;
    // SAFETY: a fresh private mapping of our own, used only through raw pointers below and
    // unmapped at the end.
    let base = unsafe { mmap_anonymous(None, len, prot, MapFlags::MAP_PRIVATE) }.unwrap();
    let at = base.as_ptr() as usize;
    let mr =
        p.b.pd
            .reg_odp_mr(
                at,
                len.get(),
                at as u64,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
            .unwrap();
    assert!(mr.on_demand());
    // Nothing was adopted: the pages are the program's own anonymous memory still.
    assert!(!backed_by_memory_file(at));
    let read = |off: usize, n: usize| -> Vec<u8> {
        // SAFETY: inside our mapping, which is mapped (checked by the callers' sequence).
        unsafe { std::slice::from_raw_parts((at + off) as *const u8, n) }.to_vec()
    };

    assert_eq!(
        write_into(&mut p, 1, mr.rkey(), at as u64 + 10, b"on demand"),
        WcStatus::Success
    );
    assert_eq!(read(10, 9), b"on demand");
    // A READ of it: the peer's local buffer gets the bytes the program wrote itself.
    // SAFETY: inside our mapping.
    unsafe { std::ptr::copy_nonoverlapping(b"mine".as_ptr(), (at + 2 * PAGE) as *mut u8, 4) };
    let sge = [p.a.mr.sge(4096, 4)];
    let remote = RemoteAddr {
        addr: (at + 2 * PAGE) as u64,
        rkey: mr.rkey(),
    };
    p.a.qp
        .post_send(&[SendWr::new(2, WrOp::Read(remote), &sge).flags(SendFlags::SIGNALED)])
        .unwrap();
    assert_eq!(wait(&p.fabric, &mut p.a.cq, 1)[0].status, WcStatus::Success);
    let mut got = [0u8; 4];
    p.a.buf.read(4096, &mut got).unwrap();
    assert_eq!(&got, b"mine");

    // New pages mapped under the region: later work reaches them.
    let mid = NonNull::new((at + PAGE) as *mut std::ffi::c_void).unwrap();
    // SAFETY: replaces the middle page of our own mapping with a fresh zeroed one.
    unsafe {
        nix::sys::mman::mmap_anonymous(
            Some(NonZeroUsize::new(at + PAGE).unwrap()),
            NonZeroUsize::new(PAGE).unwrap(),
            prot,
            MapFlags::MAP_PRIVATE | MapFlags::MAP_FIXED,
        )
    }
    .unwrap();
    assert_eq!(read(PAGE, 4), [0; 4]);
    assert_eq!(
        write_into(&mut p, 3, mr.rkey(), (at + PAGE) as u64, b"fresh"),
        WcStatus::Success
    );
    assert_eq!(read(PAGE, 5), b"fresh");

    // A page that is not mapped when the WRITE needs it fails it, and nothing crashes.
    // SAFETY: unmaps the middle page of our own mapping; nothing refers to it any more.
    unsafe { munmap(mid, PAGE) }.unwrap();
    let st = write_into(&mut p, 4, mr.rkey(), (at + PAGE) as u64, b"nowhere");
    assert_ne!(st, WcStatus::Success);
    drop(mr);
    // SAFETY: the rest of our mapping, no longer used.
    unsafe {
        munmap(base, PAGE).unwrap();
        munmap(NonNull::new((at + 2 * PAGE) as *mut _).unwrap(), PAGE).unwrap();
    }
}

#[test]
fn empty_or_impossible_ranges_are_refused() {
    let p = pair();
    assert!(matches!(
        p.a.pd.reg_odp_mr(0x1000, 0, 0x1000, Access::LOCAL_WRITE),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        p.a.pd
            .reg_odp_mr(usize::MAX - 4095, 4096, 0, Access::LOCAL_WRITE),
        Err(Error::InvalidArgument(_))
    ));
}
