//! Registering memory the program allocated itself (`ProtectionDomain::reg_user_mr`): heap,
//! page-aligned heap (posix_memalign), malloc's own anonymous mmap, the stack and static
//! data, moved through RDMA WRITE, READ and SEND/RECV between two emulated nodes.
//!
//! The tests run one at a time (`serial`): adoption moves whole pages, and a page of an
//! unaligned heap buffer holds bytes that another thread could write meanwhile (the
//! contract of `reg_user_mr`).

use ringbell::*;
use ringbell_tests::*;
use std::alloc::{alloc, dealloc, Layout};
use std::hint::black_box;
use std::sync::{Mutex, MutexGuard};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

/// Bigger than malloc's largest mmap threshold (32 MiB): such a buffer is an anonymous
/// mapping of its own (its data starts 16 bytes into the first page).
const MMAPPED: usize = 33 << 20;

/// A page-aligned heap buffer (`std::alloc` with 4 KiB alignment: posix_memalign), freed
/// on drop; read and written through its raw pointer only.
struct Aligned {
    ptr: *mut u8,
    layout: Layout,
}

impl Aligned {
    fn new(len: usize, fill: u8) -> Aligned {
        let layout = Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc(layout) };
        assert!(!ptr.is_null());
        // SAFETY: `len` bytes were just allocated.
        unsafe { ptr.write_bytes(fill, len) };
        Aligned { ptr, layout }
    }
    fn at(&self, off: usize) -> *mut u8 {
        self.ptr.wrapping_add(off)
    }
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.layout.size());
        let mut out = vec![0u8; len];
        // SAFETY: inside the allocation (asserted).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), out.as_mut_ptr(), len) };
        out
    }
    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.layout.size());
        // SAFETY: inside the allocation (asserted).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) };
    }
}

/// Registers `len` bytes at `ptr`, addressed by their virtual address.
///
/// # Safety
///
/// As [`ProtectionDomain::reg_user_mr`]: the memory stays mapped while the region lives.
unsafe fn reg(pd: &ProtectionDomain, ptr: *mut u8, len: usize, access: Access) -> MemoryRegion {
    // SAFETY: the caller's contract.
    unsafe { pd.reg_user_mr(ptr, len, ptr as u64, access) }.expect("reg_user_mr")
}

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 7 + seed) % 251) as u8).collect()
}

/// Posts one work request on `from` and waits for its successful completion.
fn run(p: &mut Pair, from_a: bool, wr: SendWr<'_>) {
    let side = if from_a { &mut p.a } else { &mut p.b };
    side.qp.post_send(&[wr]).unwrap();
    let wc = wait(&p.fabric, &mut side.cq, 1);
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
}

fn remote(mr: &MemoryRegion, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: mr.addr() + off,
        rkey: mr.rkey(),
    }
}

#[test]
fn write_from_the_heap_into_an_aligned_buffer_and_read_back_into_the_stack() {
    let _serial = serial();
    let mut p = pair();
    let maps = (p.fabric.dma_mappings(0), p.fabric.dma_mappings(1));
    // Node 0: an unaligned malloc'd source, its pages shared with the bytes around it.
    let want = pattern(20000, 3);
    let mut src = want.clone();
    let (off, len) = (1234, 9000);
    // SAFETY: `src` outlives the region and is not reallocated meanwhile.
    let mr_src = unsafe { reg(&p.a.pd, src.as_mut_ptr().add(off), len, Access::LOCAL_WRITE) };
    assert_eq!(mr_src.addr(), src.as_ptr() as u64 + off as u64);
    assert_eq!(
        black_box(&src),
        &want,
        "the registration changed the program's bytes"
    );
    // Node 1: page-aligned, holding bytes before the registration.
    let dst = Aligned::new(4 * 4096, 0xEE);
    // SAFETY: `dst` outlives the region.
    let mr_dst = unsafe { reg(&p.b.pd, dst.at(100), 12000, ALL) };
    assert_eq!(dst.read(0, 4 * 4096), vec![0xEE; 4 * 4096]);
    assert_eq!(p.fabric.dma_mappings(0), maps.0 + 1);
    assert_eq!(p.fabric.dma_mappings(1), maps.1 + 1);

    let sge = [mr_src.sge(0, len as u32)];
    run(
        &mut p,
        true,
        SendWr::new(1, WrOp::Write(remote(&mr_dst, 50)), &sge),
    );
    let got = dst.read(0, 4 * 4096);
    assert_eq!(got[..150], [0xEE; 150]);
    assert_eq!(got[150..150 + len], want[off..off + len]);
    assert!(got[150 + len..].iter().all(|&b| b == 0xEE));

    // READ part of it back into an array on this test's stack.
    let mut back = [0u8; 4000];
    // SAFETY: `back` lives until the end of the test, after the region.
    let mr_back = unsafe { reg(&p.a.pd, back.as_mut_ptr(), back.len(), Access::LOCAL_WRITE) };
    let sge = [mr_back.sge(0, 4000)];
    run(
        &mut p,
        true,
        SendWr::new(2, WrOp::Read(remote(&mr_dst, 50 + 1000)), &sge),
    );
    assert_eq!(black_box(&back)[..], want[off + 1000..off + 5000]);

    // The bytes around the registered ones are the program's as before, and writable.
    assert_eq!(black_box(&src), &want);
    src[0] = 1;
    src[off - 1] = 2;
    src[off + len] = 3;
    src[19999] = 4;
    let mut expect = want.clone();
    (expect[0], expect[off - 1], expect[off + len], expect[19999]) = (1, 2, 3, 4);
    assert_eq!(black_box(&src), &expect);
    back[3999] = 9;
    assert_eq!(black_box(&back)[3999], 9);
    dst.write(0, b"mine");
    assert_eq!(dst.read(0, 4), b"mine");

    drop((mr_src, mr_back, mr_dst));
    assert_eq!(p.fabric.dma_mappings(0), maps.0);
    assert_eq!(p.fabric.dma_mappings(1), maps.1);
}

/// A constant in read-only static data.
static GREETING: [u8; 5000] = {
    let mut a = [0u8; 5000];
    let mut i = 0;
    while i < a.len() {
        a[i] = (i % 253) as u8 ^ 0x3C;
        i += 1;
    }
    a
};

#[test]
fn send_from_static_data_into_a_receive_in_anonymous_mmap_memory() {
    let _serial = serial();
    let mut p = pair();
    let maps = p.fabric.dma_mappings(1);
    // Node 1: a receive buffer in malloc's own anonymous mapping, with old contents.
    let mut big = vec![0u8; MMAPPED];
    let at = 100_000;
    big[at - 10..at + 6000].fill(0x11);
    // SAFETY: `big` outlives the region and is not reallocated meanwhile.
    let mr_recv = unsafe { reg(&p.b.pd, big.as_mut_ptr().add(at), 6000, ALL) };
    // Node 0: the data to send is a read-only static: registered without write access.
    let src = GREETING.as_ptr() as *mut u8;
    // SAFETY: static data lives forever; the region never lets the device write it.
    let mr_src = unsafe { reg(&p.a.pd, src, GREETING.len(), Access::empty()) };
    // SAFETY: refused before anything moves.
    let r = unsafe { p.a.pd.reg_user_mr(src, 10, src as u64, Access::LOCAL_WRITE) };
    assert!(matches!(r, Err(Error::BadAddress { .. })), "{r:?}");

    p.b.qp
        .post_recv(&[RecvWr {
            wr_id: 5,
            sgl: &[mr_recv.sge(0, 6000)],
        }])
        .unwrap();
    let sge = [mr_src.sge(0, 5000)];
    run(&mut p, true, SendWr::new(6, WrOp::Send, &sge));
    let wc = wait(&p.fabric, &mut p.b.cq, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (5, WcStatus::Success));
    assert_eq!(wc[0].byte_len, 5000);
    let big = black_box(big);
    assert_eq!(big[at..at + 5000], GREETING[..]);
    assert_eq!(big[at - 10..at], [0x11; 10]);
    assert_eq!(big[at + 5000..at + 6000], [0x11; 1000]);
    assert!(big[..at - 10].iter().all(|&b| b == 0));
    assert_eq!(GREETING[4999], (4999 % 253) as u8 ^ 0x3C);
    drop((mr_recv, mr_src));
    assert_eq!(p.fabric.dma_mappings(1), maps);
}

#[test]
fn overlapping_registrations_share_pages_and_either_can_go_first() {
    let _serial = serial();
    for first in 0..2 {
        let mut p = pair_with(2, 5, 10 + first);
        let maps = p.fabric.dma_mappings(1);
        let buf = Aligned::new(10 * 4096, 0);
        // Pages 0..3, then pages 2..8: m1's pages stay as they are (nothing moves under
        // work in flight), pages 3..8 are adopted beside them, and m2 uses both mappings.
        // SAFETY: `buf` outlives the regions.
        let m1 = unsafe { reg(&p.b.pd, buf.at(1000), 10000, ALL) };
        assert_eq!(p.fabric.dma_mappings(1), maps + 1);
        // SAFETY: as above.
        let m2 = unsafe { reg(&p.b.pd, buf.at(9000), 20000, ALL) };
        assert_eq!(
            p.fabric.dma_mappings(1),
            maps + 2,
            "the new pages beside m1's"
        );
        // Sharing a page with m2, no byte: no new mapping.
        // SAFETY: as above.
        let m3 = unsafe { reg(&p.b.pd, buf.at(29500), 100, ALL) };
        assert_eq!(p.fabric.dma_mappings(1), maps + 2);

        let data = pattern(12000, first as usize);
        p.a.buf.write(0, &data).unwrap();
        let mrs = [&m1, &m2, &m3];
        let write = |p: &mut Pair, wr_id: u64, mr: usize, off: u64, len: u32| {
            let sge = [p.a.mr.sge(0, len)];
            let wr = SendWr::new(wr_id, WrOp::Write(remote(mrs[mr], off)), &sge);
            run(p, true, wr);
        };
        // Across the old boundary, through each region.
        write(&mut p, 1, 0, 7000, 3000); // bytes 8000..11000
        write(&mut p, 2, 1, 5000, 12000); // bytes 14000..26000
        write(&mut p, 3, 2, 0, 100); // bytes 29500..29600
        assert_eq!(buf.read(8000, 3000), data[..3000]);
        assert_eq!(buf.read(14000, 12000), data);
        assert_eq!(buf.read(29500, 100), data[..100]);
        assert_eq!(buf.read(11000, 3000), vec![0; 3000]);
        // Across the two mappings, one WRITE and one READ through m2: bytes 11000..13600.
        write(&mut p, 5, 1, 2000, 2600);
        assert_eq!(buf.read(11000, 2600), data[..2600]);
        let back = [p.a.mr.sge(65536, 2600)];
        run(
            &mut p,
            true,
            SendWr::new(6, WrOp::Read(remote(&m2, 2000)), &back),
        );
        let mut got = vec![0u8; 2600];
        p.a.buf.read(65536, &mut got).unwrap();
        assert_eq!(got, data[..2600]);
        buf.write(11000, &[0; 3000]);
        drop(m3);

        let (gone, kept, k) = if first == 0 { (m1, m2, 1) } else { (m2, m1, 0) };
        drop(gone);
        // m2 alone still uses both mappings; m1 alone its own.
        assert_eq!(p.fabric.dma_mappings(1), maps + 1 + k);
        buf.write(0, &[0; 40960]);
        let sge = [p.a.mr.sge(100, 500)];
        let off = if k == 0 { 9000 } else { 100 };
        run(
            &mut p,
            true,
            SendWr::new(4, WrOp::Write(remote(&kept, off)), &sge),
        );
        let at = kept.addr() as usize - buf.ptr as usize + off as usize;
        assert_eq!(buf.read(at, 500), data[100..600]);
        assert!(buf.read(0, at).iter().all(|&b| b == 0));
        drop(kept);
        assert_eq!(
            p.fabric.dma_mappings(1),
            maps,
            "the mapping outlived its regions"
        );
    }
}

#[test]
fn unmapped_memory_and_empty_or_wrapping_ranges_are_refused() {
    let _serial = serial();
    let p = pair();
    let maps = p.fabric.dma_mappings(0);
    let pd = &p.a.pd;
    let heap = Aligned::new(8192, 0x42);
    let cases: [(*mut u8, usize, u64); 3] = [
        (heap.at(0), 0, 0),
        ((usize::MAX - 10) as *mut u8, 20, 0),
        (heap.at(0), 10, u64::MAX - 4),
    ];
    for (ptr, len, addr) in cases {
        // SAFETY: refused before anything moves.
        let r = unsafe { pd.reg_user_mr(ptr, len, addr, ALL) };
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    }
    // Page 1 is never mapped (below mmap_min_addr).
    // SAFETY: refused before anything moves.
    let r = unsafe { pd.reg_user_mr(0x1000 as *mut u8, 64, 0x1000, ALL) };
    match r {
        Err(Error::BadAddress { addr, len, reason }) => {
            assert_eq!((addr, len), (0x1000, 64));
            assert!(reason.contains("not mapped"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // From a live buffer on into a hole somewhere above it: refused, the buffer untouched.
    // SAFETY: refused before anything moves.
    let r = unsafe { pd.reg_user_mr(heap.at(0), 1 << 40, heap.ptr as u64, ALL) };
    assert!(matches!(r, Err(Error::BadAddress { .. })), "{r:?}");
    assert_eq!(heap.read(0, 8192), vec![0x42; 8192]);
    heap.write(8191, &[1]);
    assert_eq!(heap.read(8191, 1), [1]);
    assert_eq!(p.fabric.dma_mappings(0), maps);
}

/// The same over the vfio-user server (run in this process): the memory file crosses the
/// socket, and the server maps it at an IOVA above 2^47.
#[test]
fn adopted_memory_over_vfio_user() {
    use ringbell_emu::serve::{serve, socket_path, ServeOptions};
    use ringbell_emu::FabricConfig;
    use std::time::{Duration, Instant};
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("rb-hostmem-{}", std::process::id()));
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dir.clone();
    std::thread::spawn(move || {
        let r = serve(&d, FabricConfig::new(2, 5), ServeOptions::default(), || {
            let _ = tx.send(());
        });
        panic!("the server stopped: {r:?}");
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("server ready");
    let open = |node| {
        Device::open(Box::new(
            VfioPort::connect(socket_path(&dir, node)).unwrap(),
        ))
    };
    let (a, b) = (open(0).unwrap(), open(1).unwrap());
    let (pa, pb) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    // Page-aligned: the server's threads write the heap meanwhile, never these pages.
    let (src, dst) = (Aligned::new(3 * 4096, 0), Aligned::new(3 * 4096, 0xEE));
    let data = pattern(10000, 9);
    src.write(500, &data);
    // SAFETY: the buffers outlive the regions.
    let ma = unsafe { reg(&pa, src.at(500), 10000, Access::LOCAL_WRITE) };
    // SAFETY: as above.
    let mb = unsafe { reg(&pb, dst.at(0), 3 * 4096, ALL) };
    let (mut ca, cb) = (a.create_cq(16).unwrap(), b.create_cq(16).unwrap());
    let mut qa = pa.create_qp(&QpInit::new(&ca, &ca)).unwrap();
    let mut qb = pb.create_qp(&QpInit::new(&cb, &cb)).unwrap();
    let (ea, eb) = (qa.endpoint(1), qb.endpoint(2));
    qa.connect(&eb, 1, &ConnectOptions::default()).unwrap();
    qb.connect(&ea, 2, &ConnectOptions::default()).unwrap();
    let sge = [ma.sge(0, 10000)];
    qa.post_send(&[SendWr::new(1, WrOp::Write(remote(&mb, 2000)), &sge)])
        .unwrap();
    let mut wc = [WorkCompletion::default(); 1];
    let deadline = Instant::now() + Duration::from_secs(20);
    while ca.poll(&mut wc) == 0 {
        assert!(Instant::now() < deadline, "no completion");
        std::thread::yield_now();
    }
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
    assert_eq!(dst.read(2000, 10000), data);
    assert_eq!(dst.read(0, 2000), vec![0xEE; 2000]);
    assert_eq!(
        dst.read(12000, 3 * 4096 - 12000),
        vec![0xEE; 3 * 4096 - 12000]
    );
    drop((qa, qb, ma, mb));
    let _ = std::fs::remove_dir_all(&dir);
}
