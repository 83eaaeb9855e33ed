//! Device memory (ABI 1.8) end to end: allocation, the host's window onto it, and zero-based
//! regions over it used by SENDs, receives, WRITEs, READs and atomics, in timed and in
//! functional mode.

use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig};
use ringbell_specs::cmd::CmdStatus;
use ringbell_tests::*;

fn all() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

fn status<T: std::fmt::Debug>(r: Result<T, Error>) -> CmdStatus {
    match r {
        Err(Error::Command { status, .. }) => status,
        other => panic!("expected a refused command, got {other:?}"),
    }
}

fn pair_in(functional: bool) -> Pair {
    ringbell_tests::pair_in(functional, 5, all())
}

#[test]
fn allocations_fill_the_memory_and_freed_room_is_reused() {
    let p = pair();
    let max = u64::from(p.a.dev.caps().max_dm_size);
    assert_eq!(max, 128 << 10);
    assert!(p.a.dev.caps().caps.contains(regs_caps()));
    assert_eq!(status(p.a.dev.alloc_dm(0, 0)), CmdStatus::BadSize);
    assert_eq!(status(p.a.dev.alloc_dm(max + 1, 0)), CmdStatus::BadSize);
    assert_eq!(status(p.a.dev.alloc_dm(64, 13)), CmdStatus::BadParam);
    let quarter: Vec<DeviceMemory> = (0..4)
        .map(|_| p.a.dev.alloc_dm(max / 4, 6).unwrap())
        .collect();
    assert_eq!(status(p.a.dev.alloc_dm(4, 0)), CmdStatus::Exhausted);
    let mut it = quarter.into_iter();
    let first = it.next().unwrap();
    let rest: Vec<_> = it.collect();
    drop(first);
    // The freed quarter takes two eighths, and nothing more.
    let e1 = p.a.dev.alloc_dm(max / 8, 0).unwrap();
    let e2 = p.a.dev.alloc_dm(max / 8, 0).unwrap();
    assert_eq!(status(p.a.dev.alloc_dm(4, 0)), CmdStatus::Exhausted);
    // A fresh allocation reads as zeros, whatever the last user left.
    e1.write(0, &[0xAB; 64]).unwrap();
    drop(e1);
    let e3 = p.a.dev.alloc_dm(64, 0).unwrap();
    let mut got = [0xFFu8; 64];
    e3.read(0, &mut got).unwrap();
    assert_eq!(got, [0; 64]);
    drop((rest, e2, e3));
    // Everything is free again: one allocation of the whole memory fits.
    let whole = p.a.dev.alloc_dm(max, 12).unwrap();
    assert_eq!(whole.len(), max);
}

fn regs_caps() -> ringbell_specs::regs::Caps {
    ringbell_specs::regs::Caps::DEVICE_MEMORY
}

#[test]
fn the_host_window_copies_words_and_refuses_odd_or_outside_accesses() {
    let p = pair();
    let dm = p.a.dev.alloc_dm(1000, 2).unwrap();
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 13 + 5) as u8).collect();
    dm.write(0, &data).unwrap();
    let mut got = vec![0u8; 1000];
    dm.read(0, &mut got).unwrap();
    assert_eq!(got, data);
    // Unaligned starts, bursts and words mixed: at 4, 260 bytes.
    dm.write(4, &data[..260]).unwrap();
    let mut part = vec![0u8; 260];
    dm.read(4, &mut part).unwrap();
    assert_eq!(part, &data[..260]);
    dm.read(0, &mut got[..4]).unwrap();
    assert_eq!(&got[..4], &data[..4]);
    for (off, len) in [(1u64, 4usize), (4, 3), (2, 2)] {
        assert!(matches!(
            dm.write(off, &data[..len]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            dm.read(off, &mut got[..len]),
            Err(Error::InvalidArgument(_))
        ));
    }
    for (off, len) in [(1000u64, 4usize), (996, 8), (u64::MAX - 3, 4)] {
        assert!(matches!(
            dm.write(off, &data[..len]),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            dm.read(off, &mut got[..len]),
            Err(Error::OutOfBounds { .. })
        ));
    }
}

#[test]
fn a_region_keeps_its_memory_and_checks_its_range() {
    let p = pair();
    let dm = p.a.dev.alloc_dm(256, 3).unwrap();
    assert_eq!(
        status(p.a.pd.reg_dm_mr(&dm, 0, 257, all())),
        CmdStatus::BadSize
    );
    assert_eq!(
        status(p.a.pd.reg_dm_mr(&dm, 200, 64, all())),
        CmdStatus::BadSize
    );
    assert_eq!(
        status(p.a.pd.reg_dm_mr(&dm, 0, 64, Access::REMOTE_WRITE)),
        CmdStatus::BadParam
    );
    // An empty region is allowed, as verbs allows it.
    let empty = p.a.pd.reg_dm_mr(&dm, 0, 0, all()).unwrap();
    let mr = p.a.pd.reg_dm_mr(&dm, 64, 128, all()).unwrap();
    assert_eq!((mr.addr(), mr.len()), (0, 128));
    assert!(dm.in_use());
    drop(empty);
    // Another device's memory is refused before the device sees it.
    let other = p.b.dev.alloc_dm(64, 0).unwrap();
    assert!(matches!(
        p.a.pd.reg_dm_mr(&other, 0, 64, all()),
        Err(Error::InvalidArgument(_))
    ));
    // Host memory cannot be registered where device memory begins.
    assert_eq!(
        status(
            p.a.pd
                .reg_mr_raw(0x1000, 4096, (1 << 63) - 2048, Access::LOCAL_WRITE)
        ),
        CmdStatus::BadParam
    );
    drop(mr);
    assert!(!dm.in_use());
}

fn post_one(s: &mut Side, wr: SendWr<'_>) {
    s.qp.post_send(&[wr.flags(SendFlags::SIGNALED)]).unwrap();
}

fn ok(fabric: &Fabric, cq: &mut CompletionQueue, opcode: WcOpcode) -> WorkCompletion {
    let wc = wait(fabric, cq, 1)[0];
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, opcode),
        "{wc:?}"
    );
    wc
}

/// Every operation with device memory at one end or the other; the same bytes land in
/// timed and in functional mode (which hands device memory to the packet path).
fn traffic(functional: bool) {
    let mut p = pair_in(functional);
    let dm_a = p.a.dev.alloc_dm(4096, 6).unwrap();
    let dm_b = p.b.dev.alloc_dm(4096, 6).unwrap();
    let mr_a = p.a.pd.reg_dm_mr(&dm_a, 0, 4096, all()).unwrap();
    let mr_b = p.b.pd.reg_dm_mr(&dm_b, 1024, 2048, all()).unwrap();
    let data: Vec<u8> = (0..1500u32).map(|i| (i * 31 + 7) as u8).collect();

    // SEND from device memory into device memory.
    dm_a.write(0, &data).unwrap();
    let rs = [mr_b.sge(100, 1600)];
    p.b.qp.post_recv(&[RecvWr { wr_id: 1, sgl: &rs }]).unwrap();
    let ss = [mr_a.sge(0, 1500)];
    post_one(&mut p.a, SendWr::new(2, WrOp::Send, &ss));
    ok(&p.fabric, &mut p.a.cq, WcOpcode::Send);
    let r = ok(&p.fabric, &mut p.b.cq, WcOpcode::Recv);
    assert_eq!(r.byte_len, 1500);
    let mut got = vec![0u8; 1500];
    dm_b.read(1024 + 100, &mut got).unwrap();
    assert_eq!(got, data);

    // WRITE from host memory into the peer's device memory, at a zero-based address.
    p.a.buf.write(0, &data[..512]).unwrap();
    let ws = [p.a.mr.sge(0, 512)];
    let remote = RemoteAddr {
        addr: 1200,
        rkey: mr_b.rkey(),
    };
    post_one(&mut p.a, SendWr::new(3, WrOp::Write(remote), &ws));
    ok(&p.fabric, &mut p.a.cq, WcOpcode::RdmaWrite);
    let mut got = vec![0u8; 512];
    dm_b.read(1024 + 1200, &mut got).unwrap();
    assert_eq!(got, &data[..512]);

    // READ the peer's device memory into host memory.
    let rd = [p.a.mr.sge(8192, 512)];
    post_one(&mut p.a, SendWr::new(4, WrOp::Read(remote), &rd));
    ok(&p.fabric, &mut p.a.cq, WcOpcode::RdmaRead);
    let mut back = vec![0u8; 512];
    p.a.buf.read(8192, &mut back).unwrap();
    assert_eq!(back, &data[..512]);

    // Fetch-and-add on device memory, the old value returned into device memory.
    dm_b.write(1024 + 2000, &40u64.to_le_bytes()).unwrap();
    let res = [mr_a.sge(2048, 8)];
    let remote8 = RemoteAddr {
        addr: 2000,
        rkey: mr_b.rkey(),
    };
    post_one(
        &mut p.a,
        SendWr::new(
            5,
            WrOp::FetchAdd {
                remote: remote8,
                add: 2,
            },
            &res,
        ),
    );
    ok(&p.fabric, &mut p.a.cq, WcOpcode::FetchAdd);
    let mut w = [0u8; 8];
    dm_b.read(1024 + 2000, &mut w).unwrap();
    assert_eq!(u64::from_le_bytes(w), 42);
    dm_a.read(2048, &mut w).unwrap();
    assert_eq!(u64::from_le_bytes(w), 40);

    // Past the region's end: the peer refuses, nothing lands.
    let beyond = RemoteAddr {
        addr: 2048 - 4,
        rkey: mr_b.rkey(),
    };
    let s8 = [p.a.mr.sge(0, 8)];
    post_one(&mut p.a, SendWr::new(6, WrOp::Write(beyond), &s8));
    let wc = wait(&p.fabric, &mut p.a.cq, 1)[0];
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
    drop((mr_a, mr_b));
}

#[test]
fn sends_writes_reads_and_atomics_reach_device_memory() {
    traffic(false);
}

#[test]
fn functional_mode_leaves_device_memory_to_the_packet_path() {
    traffic(true);
}

#[test]
fn the_window_outside_the_memory_is_a_guest_error() {
    use ringbell_specs::regs::DM_BASE;
    let fabric = Fabric::new(FabricConfig::new(2, 1));
    let dev = Device::open(Box::new(fabric.port(0))).unwrap();
    let port = fabric.port(0);
    let errors = || fabric.nic_stats(0).guest_errors;
    let e0 = errors();
    // Before the first allocation there is no memory behind the window.
    assert_eq!(port.read32(DM_BASE), 0);
    port.write32(DM_BASE, 7);
    fabric.run_until_quiet();
    assert_eq!(errors(), e0 + 2);
    let dm = dev.alloc_dm(64, 0).unwrap();
    dm.write(0, &[1, 2, 3, 4]).unwrap();
    // The first allocation starts at device address 0: its first word, through the window.
    assert_eq!(port.read32(DM_BASE), u32::from_le_bytes([1, 2, 3, 4]));
    assert_eq!(errors(), e0 + 2);
    // Beyond the memory's size.
    let end = DM_BASE + u64::from(dev.caps().max_dm_size);
    assert_eq!(port.read32(end), 0);
    port.write32(end, 7);
    fabric.run_until_quiet();
    assert_eq!(errors(), e0 + 4);
    drop(dm);
}
