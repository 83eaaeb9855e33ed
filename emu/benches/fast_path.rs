//! The driver's data-path cost with nothing behind the BAR: `post_send` and `poll` as real
//! hardware would see them, measured with criterion (`cargo bench -p ringbell-emu --bench
//! fast_path`; it lives with the emulator because it borrows it for set-up: the driver
//! itself never depends on the emulator).
//!
//! # What is measured
//!
//! Node 0's device is opened through [`BenchPort`], a `Port` wrapper with two modes:
//!
//! * **setup**: everything goes to the emulator (`ringbell_emu::Fabric`, node 0), so the
//!   device is opened, the CQ and the QP are created and the QP is connected to a QP on node
//!   1 by the real command interface. While it forwards, the wrapper keeps a host view of every
//!   DMA mapping and notes the input of every command, so the bench learns the CQ ring's IOVA
//!   from the CREATE_CQ the driver sent (as a device would).
//! * **bare**: switched on before anything is timed. BAR0 is a 2 MiB anonymous memory mapping
//!   (`regs::BAR0_SIZE`): `write32` is one volatile 32-bit store into it, `read32` one volatile
//!   load, `write_block` (a BlueFlame WQE) one 64-byte copy into it, `dma_map` and `dma_unmap`
//!   only bookkeeping, `progress` returns `true`. Nothing traps and no emulator code runs, so a
//!   doorbell costs what the CPU pays for the store (on write-back memory: a real BAR is mapped
//!   uncached or write-combining, where the store itself costs more, and what it costs is the
//!   platform's, not the driver's). The port's own cost, a virtual call plus a mode test, is
//!   `port_write32_bare_bar`.
//!
//! The timed code is the driver's own `QueuePair::post_send` and `CompletionQueue::poll` /
//! `poll_ready`, reached through the public API with the `Box<dyn Port>` dispatch they have
//! in production. The CPU work the device would do is done by the bench outside the timed
//! regions: it writes CQEs straight into the CQ ring (64 bytes, owner byte last, the owner bit
//! for the consumer index, `wqe_counter` naming a posted WQE), which is what the NIC's DMA
//! write would leave there.
//!
//! * `post_send/inline_write_8B_unbatched`: one 8-byte inline RDMA WRITE per call. The device
//!   has BlueFlame, so the driver copies the single WQE into the QP's BlueFlame slot.
//! * `post_send/inline_write_8B_unbatched_doorbell`: the same against a device that reports no
//!   BlueFlame (the port clears the capability in the QUERY_DEVICE answer): one 32-bit send
//!   doorbell store per call.
//! * `post_send/inline_write_8B_batch32`: 32 such WRs in one call, one doorbell (an element is
//!   one WQE).
//! * `poll/hit_1_per_call`, `poll/hit_16_per_call`: `poll` with room for 1 or 16 completions,
//!   each finding that many CQEs of live WRs (an element is one completion; the CQ doorbell is
//!   rung once per call).
//! * `poll/miss_poll_ready`, `poll/miss_poll`: an empty CQ (`poll` also calls
//!   `Port::progress` once and looks again).
//!
//! Timing uses `iter_custom`: each chunk of operations (1024 posts or WQEs, 1024 polls or 64
//! polls of 16) is timed by one pair of `Instant::now()` calls (`instant_pair`, about 49 ns on
//! this machine, so under 0.05 ns per operation), and the work that keeps the send queue from
//! overflowing runs between the chunks, outside the measurement: one CQE completing everything
//! posted (unsignaled WQEs complete implicitly), polled; for the poll benchmarks, posting the
//! WRs and writing their CQEs.

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use memmap2::{MmapMut, MmapRaw};
use ringbell::*;
use ringbell_emu::{EmuPort, Fabric, FabricConfig};
use ringbell_specs::cmd::{
    CmdHeader, CmdOpcode, CreateCqIn, CreateQpIn, QueryDeviceOut, IN_OFFSET, PARAMS_SIZE,
    RESULT_OFFSET,
};
use ringbell_specs::cqe::{owner_bit, Cqe, CqeOpcode, CQE_SIZE};
use ringbell_specs::regs;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::os::fd::BorrowedFd;
use std::rc::Rc;
use std::time::{Duration, Instant};
use zerocopy::{FromBytes, IntoBytes};

/// Send WRs the QP is created for. With the default 64 inline bytes the worst-case WQE is
/// two blocks, so the ring has 1024 blocks; an 8-byte inline WRITE takes one.
const MAX_SEND_WR: u32 = 512;
/// CQ entries.
const CQ_ENTRIES: u32 = 1024;

/// State shared between the port inside the driver and the bench.
struct Ctl {
    /// Bare mode: BAR0 is plain memory.
    bare: Cell<bool>,
    /// The plain-memory BAR0.
    bar: MmapRaw,
    /// Host views of the DMA mappings, by IOVA: (length, mapping; `None` for mappings made in
    /// bare mode, which are only recorded).
    maps: RefCell<BTreeMap<u64, (u64, Option<MmapRaw>)>>,
    /// Command mailbox IOVA, as the driver programmed it.
    mbox: Cell<u64>,
    /// Every command the driver issued: opcode, token and input parameters.
    cmds: RefCell<Vec<(u16, u32, [u8; PARAMS_SIZE])>>,
    /// Report a device without BlueFlame: clear the capability in the QUERY_DEVICE answer,
    /// so that the driver rings the send doorbell for single WQEs too.
    hide_blueflame: bool,
}

impl Ctl {
    /// Host pointer to `len` bytes at `iova`, inside one mapping made in setup mode.
    fn host(&self, iova: u64, len: usize) -> *mut u8 {
        let maps = self.maps.borrow();
        let (start, (mlen, map)) = maps.range(..=iova).next_back().expect("IOVA not mapped");
        let off = iova - start;
        assert!(off + len as u64 <= *mlen, "range outside the mapping");
        let map = map.as_ref().expect("mapped in bare mode: no host view");
        // SAFETY: off + len <= the mapping's length (checked above), so the pointer stays in
        // the live mapping, which lives as long as `self`.
        unsafe { map.as_mut_ptr().add(off as usize) }
    }

    /// Input parameters of the `n`-th command with opcode `op`.
    fn cmd_input(&self, op: CmdOpcode, n: usize) -> [u8; PARAMS_SIZE] {
        self.cmds
            .borrow()
            .iter()
            .filter(|(o, _, _)| *o == op as u16)
            .nth(n)
            .expect("command not seen")
            .2
    }
}

/// The `Port` of the measured device: the emulator in setup mode, plain memory in bare mode.
struct BenchPort {
    emu: EmuPort,
    ctl: Rc<Ctl>,
}

impl BenchPort {
    /// When `status` reports the last command, a QUERY_DEVICE, done, clears the BlueFlame
    /// capability in its answer before the driver reads it.
    fn hide_blueflame(&self, status: u32) {
        let cmds = self.ctl.cmds.borrow();
        let Some(&(op, token, _)) = cmds.last() else {
            return;
        };
        if op != CmdOpcode::QueryDevice as u16
            || status & regs::CMD_STATUS_BUSY != 0
            || status & 0xFFFF != token & 0xFFFF
        {
            return;
        }
        let at = self.ctl.mbox.get()
            + (RESULT_OFFSET + 16 + std::mem::offset_of!(QueryDeviceOut, caps)) as u64;
        let p = self.ctl.host(at, 4);
        let mut caps = [0u8; 4];
        // SAFETY: `host` checked that the 4 bytes are inside a live mapping (the mailbox);
        // the device finished the command, so nothing else writes them now.
        unsafe { std::ptr::copy_nonoverlapping(p, caps.as_mut_ptr(), 4) };
        let caps = u32::from_le_bytes(caps) & !regs::Caps::BLUEFLAME.bits();
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(caps.to_le_bytes().as_ptr(), p, 4) };
    }

    fn bar_ptr(&self, offset: u64) -> *mut u32 {
        assert!(
            offset.is_multiple_of(4) && offset < regs::BAR0_SIZE,
            "bad BAR0 offset {offset:#x}"
        );
        // SAFETY: offset < BAR0_SIZE, the length of the mapping (checked above).
        unsafe { self.ctl.bar.as_mut_ptr().add(offset as usize) as *mut u32 }
    }
}

impl Port for BenchPort {
    fn read32(&self, offset: u64) -> u32 {
        if self.ctl.bare.get() {
            // SAFETY: `bar_ptr` is in bounds and 4-byte aligned (the mapping is page-aligned);
            // the BAR memory is only ever accessed by this port, in this thread, and never
            // through a Rust reference.
            return u32::from_le(unsafe { self.bar_ptr(offset).read_volatile() });
        }
        let v = self.emu.read32(offset);
        if offset == regs::CMD_STATUS && self.ctl.hide_blueflame {
            self.hide_blueflame(v);
        }
        v
    }

    fn write32(&self, offset: u64, value: u32) {
        if self.ctl.bare.get() {
            // SAFETY: as in `read32`.
            unsafe { self.bar_ptr(offset).write_volatile(value.to_le()) };
            return;
        }
        match offset {
            regs::CMD_ADDR_LO => self
                .ctl
                .mbox
                .set(self.ctl.mbox.get() & !0xFFFF_FFFF | value as u64),
            regs::CMD_ADDR_HI => self
                .ctl
                .mbox
                .set(self.ctl.mbox.get() & 0xFFFF_FFFF | (value as u64) << 32),
            regs::CMD_DOORBELL => {
                let mut mb = [0u8; IN_OFFSET + PARAMS_SIZE];
                let p = self.ctl.host(self.ctl.mbox.get(), mb.len());
                // SAFETY: `host` checked that the range is inside a live mapping; `mb` is ours.
                unsafe { std::ptr::copy_nonoverlapping(p, mb.as_mut_ptr(), mb.len()) };
                let (hdr, _) = CmdHeader::read_from_prefix(&mb).unwrap();
                let mut input = [0u8; PARAMS_SIZE];
                input.copy_from_slice(&mb[IN_OFFSET..]);
                self.ctl
                    .cmds
                    .borrow_mut()
                    .push((hdr.opcode.get(), hdr.token.get(), input));
            }
            _ => {}
        }
        self.emu.write32(offset, value)
    }

    fn write_block(&self, offset: u64, data: &[u8]) {
        if self.ctl.bare.get() {
            assert!(
                offset.is_multiple_of(64)
                    && data.len() <= 256
                    && offset + data.len() as u64 <= regs::BAR0_SIZE,
                "bad BlueFlame write {offset:#x}+{}",
                data.len()
            );
            // SAFETY: the destination range is inside the BAR mapping (checked above) and
            // `data` is a separate Rust slice. A write-combining BAR takes the burst as plain
            // stores; this is one `memcpy` of the WQE.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr(),
                    self.ctl.bar.as_mut_ptr().add(offset as usize),
                    data.len(),
                )
            };
            return;
        }
        self.emu.write_block(offset, data)
    }

    fn dma_map(&self, fd: BorrowedFd<'_>, len: u64, iova: u64) -> Result<(), PortError> {
        let view = if self.ctl.bare.get() {
            None
        } else {
            self.emu.dma_map(fd, len, iova)?;
            let file = std::fs::File::from(fd.try_clone_to_owned().unwrap());
            Some(
                memmap2::MmapOptions::new()
                    .len(len as usize)
                    .map_raw(&file)
                    .map_err(|e| PortError::MapFailed(e.to_string()))?,
            )
        };
        self.ctl.maps.borrow_mut().insert(iova, (len, view));
        Ok(())
    }

    fn dma_unmap(&self, iova: u64, len: u64) -> Result<(), PortError> {
        let had_view = self
            .ctl
            .maps
            .borrow_mut()
            .remove(&iova)
            .map(|m| m.1.is_some());
        if had_view == Some(true) && !self.ctl.bare.get() {
            self.emu.dma_unmap(iova, len)?;
        }
        Ok(())
    }

    fn progress(&self) -> bool {
        if self.ctl.bare.get() {
            return true;
        }
        self.emu.progress()
    }
}

/// A connected QP on node 0 with its CQ, and what the bench needs to play the device.
struct Rig {
    ctl: Rc<Ctl>,
    // Field order is drop order: the QPs go before their CQs, the device last.
    qp: QueuePair,
    _peer_qp: QueuePair,
    cq: CompletionQueue,
    _peer_cq: CompletionQueue,
    _mr: MemoryRegion,
    dev: Device,
    _peer: Device,
    fabric: Fabric,
    remote: RemoteAddr,
    /// Host view of the CQ ring.
    cq_ring: *mut u8,
    cq_log: u8,
    /// CQEs the bench has written (the device's producer index).
    cq_pi: u32,
    /// Send-queue blocks posted (the driver's producer index, tracked by the bench).
    sq_pi: u32,
    /// Host view of the send ring, and its size in blocks.
    sq_ring: *mut u8,
    sq_blocks: u32,
    /// `sq_pi` at the last `check_posted`.
    checked_pi: u32,
}

impl Rig {
    fn new(blueflame: bool) -> Rig {
        let fabric = Fabric::new(FabricConfig::new(2, 1));
        let bar = MmapRaw::from(MmapMut::map_anon(regs::BAR0_SIZE as usize).unwrap());
        let ctl = Rc::new(Ctl {
            bare: Cell::new(false),
            bar,
            maps: RefCell::new(BTreeMap::new()),
            mbox: Cell::new(0),
            cmds: RefCell::new(Vec::new()),
            hide_blueflame: !blueflame,
        });
        let dev = Device::open(Box::new(BenchPort {
            emu: fabric.port(0),
            ctl: ctl.clone(),
        }))
        .unwrap();
        let peer = Device::open(Box::new(fabric.port(1))).unwrap();
        let (pd, peer_pd) = (dev.alloc_pd().unwrap(), peer.alloc_pd().unwrap());
        let buf = peer.alloc_dma(4096).unwrap();
        let mr = peer_pd
            .reg_mr(&buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let cq = dev.create_cq(CQ_ENTRIES).unwrap();
        let peer_cq = peer.create_cq(64).unwrap();
        let mut qp = pd
            .create_qp(&QpInit {
                max_send_wr: MAX_SEND_WR,
                ..QpInit::new(&cq, &cq)
            })
            .unwrap();
        let mut peer_qp = peer_pd.create_qp(&QpInit::new(&peer_cq, &peer_cq)).unwrap();
        let o = ConnectOptions::default();
        let (e, pe) = (qp.endpoint(1), peer_qp.endpoint(2));
        qp.connect(&pe, 1, &o).unwrap();
        peer_qp.connect(&e, 2, &o).unwrap();
        fabric.run_until_quiet();
        let (cq_in, _) =
            CreateCqIn::read_from_prefix(&ctl.cmd_input(CmdOpcode::CreateCq, 0)).unwrap();
        let (qp_in, _) =
            CreateQpIn::read_from_prefix(&ctl.cmd_input(CmdOpcode::CreateQp, 0)).unwrap();
        let cq_log = cq_in.log_size;
        assert_eq!(1u32 << cq_log, cq.capacity());
        let sq_blocks = 1u32 << qp_in.sq_log_size;
        assert_eq!(qp.sq_free(), sq_blocks);
        let cq_ring = ctl.host(cq_in.ring_iova.get(), CQE_SIZE << cq_log);
        let sq_ring = ctl.host(qp_in.sq_iova.get(), 64 * sq_blocks as usize);
        // From here on the emulator sees nothing of node 0: BAR0 is plain memory.
        ctl.bare.set(true);
        Rig {
            remote: RemoteAddr {
                addr: mr.addr(),
                rkey: mr.rkey(),
            },
            ctl,
            qp,
            _peer_qp: peer_qp,
            cq,
            _peer_cq: peer_cq,
            _mr: mr,
            dev,
            _peer: peer,
            fabric,
            cq_ring,
            cq_log,
            cq_pi: 0,
            sq_pi: 0,
            sq_ring,
            sq_blocks,
            checked_pi: 0,
        }
    }

    /// Writes the CQE the NIC would write for the send WQE at block index `counter`.
    fn push_send_cqe(&mut self, counter: u32) {
        let n = self.cq_pi;
        let cqe = Cqe {
            opcode: CqeOpcode::RdmaWrite as u8,
            wqe_counter: (counter as u16).into(),
            qpn: self.qp.qpn().into(),
            byte_len: 8.into(),
            owner: owner_bit(n, self.cq_log),
            ..Default::default()
        };
        let slot = (n & ((1 << self.cq_log) - 1)) as usize * CQE_SIZE;
        let bytes = cqe.as_bytes();
        // SAFETY: `cq_ring` is the host view of the whole CQ ring (CQE_SIZE << cq_log bytes,
        // checked in `Rig::new`) and slot + 64 is inside it. The driver reads the ring only
        // through copies and an atomic byte load, in this same thread, never while this runs.
        // The owner byte is stored last, with a release fence before it, as the device does.
        unsafe {
            let p = self.cq_ring.add(slot);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, CQE_SIZE - 1);
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            p.add(CQE_SIZE - 1).write_volatile(bytes[CQE_SIZE - 1]);
        }
        self.cq_pi = n.wrapping_add(1);
    }

    /// Completes everything posted so far with one CQE (unsignaled WQEs complete implicitly)
    /// and polls it, so the send queue is empty again.
    fn drain(&mut self) {
        if self.qp.sq_free() == self.sq_blocks {
            return;
        }
        self.push_send_cqe(self.sq_pi.wrapping_sub(1));
        let mut wc = [WorkCompletion::default(); 1];
        assert_eq!(self.cq.poll_ready(&mut wc), 1);
        assert_eq!(wc[0].status, WcStatus::Success);
        assert_eq!(self.qp.sq_free(), self.sq_blocks);
    }

    /// The value of the QP's send doorbell register in the plain-memory BAR.
    fn sq_doorbell(&self) -> u32 {
        self.dev
            .port()
            .read32(regs::QP_DB_BASE + self.qp.qpn() as u64 * regs::DB_STRIDE + regs::DB_SQ)
    }

    /// Checks that the last WQE posted is an inline 8-byte WRITE at the right index and that
    /// the device was told: the send doorbell shows the producer index, or (one WQE posted
    /// alone) the QP's BlueFlame slot holds that WQE (not timed).
    fn check_posted(&mut self, blueflame: bool) {
        if self.sq_pi == self.checked_pi {
            return; // the benchmark was filtered out
        }
        self.checked_pi = self.sq_pi;
        let last = self.sq_pi.wrapping_sub(1);
        let mut wqe = [0u8; 64];
        // SAFETY: the block is inside the send ring's host view (sq_blocks * 64 bytes).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.sq_ring
                    .add((last & (self.sq_blocks - 1)) as usize * 64),
                wqe.as_mut_ptr(),
                64,
            )
        };
        assert_eq!(wqe[0], 0x03, "opcode WRITE");
        assert_eq!(
            u16::from_le_bytes([wqe[2], wqe[3]]),
            last as u16,
            "wqe_index"
        );
        assert_eq!(wqe[4], 3, "ds_count: ctrl + raddr + inline");
        assert_eq!(&wqe[36..44], &7u64.to_le_bytes(), "inline payload");
        if blueflame {
            let slot = regs::BF_BASE + self.qp.qpn() as u64 * regs::BF_STRIDE;
            for (i, w) in wqe.chunks_exact(4).enumerate() {
                let got = self.dev.port().read32(slot + 4 * i as u64);
                assert_eq!(
                    got.to_le_bytes(),
                    [w[0], w[1], w[2], w[3]],
                    "BlueFlame word {i}"
                );
            }
        } else {
            assert_eq!(self.sq_doorbell(), self.sq_pi);
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // Back to the emulator so the destroy commands of the drop find a device.
        self.ctl.bare.set(false);
        self.fabric.run_until_quiet();
    }
}

/// Times `chunk(rig, n)` for chunks of at most `max` operations until `iters` have run,
/// calling `prepare(rig, n)` untimed before each chunk.
fn timed_chunks(
    rig: &mut Rig,
    iters: u64,
    max: u64,
    mut prepare: impl FnMut(&mut Rig, u64),
    mut chunk: impl FnMut(&mut Rig, u64),
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(max);
        prepare(rig, n);
        let t = Instant::now();
        chunk(rig, n);
        total += t.elapsed();
        left -= n;
    }
    total
}

const PAYLOAD: [u8; 8] = 7u64.to_le_bytes();

/// One 8-byte inline WRITE per `post_send` call, unsignaled (the one CQE of `drain`
/// completes a whole chunk).
fn unbatched(g: &mut criterion::BenchmarkGroup<'_, WallTime>, name: &str, blueflame: bool) {
    let mut rig = Rig::new(blueflame);
    assert_eq!(
        rig.dev.caps().caps.contains(regs::Caps::BLUEFLAME),
        blueflame
    );
    let op = WrOp::Write(rig.remote);
    g.throughput(Throughput::Elements(1));
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let max = rig.sq_blocks as u64;
            timed_chunks(
                &mut rig,
                iters,
                max,
                |r, _| r.drain(),
                |r, n| {
                    for i in 0..n {
                        let wr = [SendWr::inline(i, op, &PAYLOAD).flags(SendFlags::empty())];
                        r.qp.post_send(black_box(&wr)).unwrap();
                    }
                    r.sq_pi = r.sq_pi.wrapping_add(n as u32);
                },
            )
        })
    });
    rig.check_posted(blueflame);
}

fn post_send(c: &mut Criterion) {
    let mut g = c.benchmark_group("post_send");
    // The WQE goes to the QP's BlueFlame slot: a 64-byte copy into the BAR.
    unbatched(&mut g, "inline_write_8B_unbatched", true);
    // A device without BlueFlame: the WQE stays in the ring, one 32-bit doorbell store.
    unbatched(&mut g, "inline_write_8B_unbatched_doorbell", false);

    // 32 WRs in one call, one doorbell; an element is one WQE.
    let mut rig = Rig::new(true);
    let op = WrOp::Write(rig.remote);
    const BATCH: usize = 32;
    let wrs: [SendWr<'_>; BATCH] = std::array::from_fn(|i| {
        SendWr::inline(i as u64, op, &PAYLOAD).flags(if i == BATCH - 1 {
            SendFlags::SIGNALED
        } else {
            SendFlags::empty()
        })
    });
    g.throughput(Throughput::Elements(BATCH as u64));
    g.bench_function("inline_write_8B_batch32", |b| {
        b.iter_custom(|iters| {
            let max = (rig.sq_blocks as usize / BATCH) as u64;
            timed_chunks(
                &mut rig,
                iters,
                max,
                |r, _| r.drain(),
                |r, n| {
                    for _ in 0..n {
                        r.qp.post_send(black_box(&wrs)).unwrap();
                    }
                    r.sq_pi = r.sq_pi.wrapping_add((n as usize * BATCH) as u32);
                },
            )
        })
    });
    rig.check_posted(false);
    g.finish();

    // The doorbell alone: one `write32` through the `Box<dyn Port>` to the plain BAR.
    let db = regs::QP_DB_BASE + rig.qp.qpn() as u64 * regs::DB_STRIDE + regs::DB_SQ;
    let v = rig.sq_pi;
    c.bench_function("port_write32_bare_bar", |b| {
        b.iter(|| rig.dev.port().write32(black_box(db), black_box(v)))
    });
    drop(rig);
}

fn poll(c: &mut Criterion) {
    let mut rig = Rig::new(true);
    let op = WrOp::Write(rig.remote);
    let mut g = c.benchmark_group("poll");
    // Before each chunk (untimed): post `n` signaled WRITEs in batches and write one CQE per
    // WQE, in order, so that each poll finds a CQE for a live WR.
    let fill = |r: &mut Rig, n: u64| {
        r.drain();
        let base = r.sq_pi;
        let mut left = n as u32;
        while left > 0 {
            let k = left.min(32);
            let start = r.sq_pi;
            let wrs: [SendWr<'_>; 32] =
                std::array::from_fn(|i| SendWr::inline((start + i as u32) as u64, op, &PAYLOAD));
            r.qp.post_send(&wrs[..k as usize]).unwrap();
            r.sq_pi = r.sq_pi.wrapping_add(k);
            left -= k;
        }
        for i in 0..n as u32 {
            r.push_send_cqe(base.wrapping_add(i));
        }
    };
    let mut sum = 0u64;
    let mut expect = 0u64;
    for per_call in [1usize, 16] {
        g.throughput(Throughput::Elements(per_call as u64));
        g.bench_function(format!("hit_{per_call}_per_call"), |b| {
            b.iter_custom(|iters| {
                let per_chunk = (CQ_ENTRIES.min(rig.sq_blocks) as usize / per_call) as u64;
                timed_chunks(
                    &mut rig,
                    iters,
                    per_chunk,
                    |r, n| {
                        let first = r.sq_pi as u64;
                        fill(r, n * per_call as u64);
                        let last = r.sq_pi as u64;
                        expect = expect.wrapping_add((first..last).sum::<u64>());
                    },
                    |r, n| {
                        let mut wc = [WorkCompletion::default(); 16];
                        for _ in 0..n {
                            let got = r.cq.poll(&mut wc[..per_call]);
                            debug_assert_eq!(got, per_call);
                            for w in &wc[..got] {
                                sum = sum.wrapping_add(black_box(w.wr_id));
                            }
                        }
                    },
                )
            })
        });
        assert_eq!(sum, expect, "every CQE returned its WR's wr_id");
    }

    // Empty CQ.
    let mut wc = [WorkCompletion::default(); 1];
    rig.drain();
    g.throughput(Throughput::Elements(1));
    g.bench_function("miss_poll_ready", |b| {
        b.iter(|| assert_eq!(rig.cq.poll_ready(black_box(&mut wc)), 0))
    });
    g.bench_function("miss_poll", |b| {
        b.iter(|| assert_eq!(rig.cq.poll(black_box(&mut wc)), 0))
    });
    g.finish();
    drop(rig);
}

/// Not a benchmark: the cost of the timer calls that bracket each timed chunk.
fn timer_overhead(c: &mut Criterion) {
    c.bench_function("instant_pair", |b| {
        b.iter(|| black_box(Instant::now().elapsed()))
    });
}

/// The yardsticks of this run (memcpy and pointer chase), printed before the benchmarks so
/// that their wall-clock figures can be given as ratios comparable across machines.
fn yardsticks(_c: &mut Criterion) {
    println!(
        "{}",
        ringbell_emu::yardstick::Yardstick::measure().describe()
    );
}

criterion_group!(benches, yardsticks, post_send, poll, timer_overhead);
criterion_main!(benches);
