//! Triggered tagged SENDs into a TM-SRQ: the NIC holds an eager or rendezvous tagged message
//! until a counter fires it, and the receiving NIC matches it against its tag list as it
//! would a posted one.

use ringbell::tm::{Rvh, TmOp, Tmh, TmhOp};
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig};

struct Tm {
    fabric: Fabric,
    c_qp: QueuePair,
    c_cq: CompletionQueue,
    c_mr: MemoryRegion,
    c_buf: DmaBuffer,
    _s_qp: QueuePair,
    srq: SharedReceiveQueue,
    s_cq: CompletionQueue,
    s_mr: MemoryRegion,
    s_buf: DmaBuffer,
    c_pd: ProtectionDomain,
    _s_pd: ProtectionDomain,
    _devs: (Device, Device),
}

fn setup() -> Tm {
    let fabric = Fabric::new(FabricConfig::new(2, 5));
    let (cd, sd) = (
        Device::open(Box::new(fabric.port(0))).unwrap(),
        Device::open(Box::new(fabric.port(1))).unwrap(),
    );
    let (c_pd, s_pd) = (cd.alloc_pd().unwrap(), sd.alloc_pd().unwrap());
    let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    let (c_buf, s_buf) = (
        cd.alloc_dma(1 << 16).unwrap(),
        sd.alloc_dma(1 << 16).unwrap(),
    );
    let (c_mr, s_mr) = (
        c_pd.reg_mr(&c_buf, access).unwrap(),
        s_pd.reg_mr(&s_buf, access).unwrap(),
    );
    let (c_cq, s_cq) = (cd.create_cq(256).unwrap(), sd.create_cq(256).unwrap());
    let srq = s_pd.create_tm_srq(&s_cq, 64, 1, 64, 16).unwrap();
    let mut c_qp = c_pd.create_qp(&QpInit::new(&c_cq, &c_cq)).unwrap();
    let mut si = QpInit::new(&s_cq, &s_cq);
    si.srq = Some(&srq);
    let mut s_qp = s_pd.create_qp(&si).unwrap();
    let o = ConnectOptions::default();
    c_qp.connect(&s_qp.endpoint(10), 20, &o).unwrap();
    s_qp.connect(&c_qp.endpoint(20), 10, &o).unwrap();
    Tm {
        fabric,
        c_qp,
        c_cq,
        c_mr,
        c_buf,
        _s_qp: s_qp,
        srq,
        s_cq,
        s_mr,
        s_buf,
        c_pd,
        _s_pd: s_pd,
        _devs: (cd, sd),
    }
}

fn poll(f: &Fabric, cq: &mut CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::default(); 1];
    loop {
        if cq.poll_ready(&mut wc) == 1 {
            return wc[0];
        }
        assert!(f.step(), "fabric idle: a completion never came");
    }
}

impl Tm {
    fn add_tag(&mut self, tag: u64, len: u32) {
        let mut op = [TmOp::add(tag, tag, self.s_mr.sge(0, len), tag, !0)];
        self.srq.post_tm_ops(&mut op).unwrap();
        let wc = poll(&self.fabric, &mut self.s_cq);
        assert_eq!((wc.opcode, wc.status), (WcOpcode::TmAdd, WcStatus::Success));
    }
}

#[test]
fn a_triggered_eager_tagged_send_is_matched_by_the_receiving_nic() {
    let mut t = setup();
    t.add_tag(0x77, 1024);
    let tmh = Tmh {
        opcode: TmhOp::Eager as u8,
        app_ctx: 5,
        tag: 0x77,
    };
    t.c_buf.write(0, &tmh.to_bytes()).unwrap();
    t.c_buf.write(64, &[0xAB; 100]).unwrap();
    let (go, sent) = (
        t.c_pd.create_counter().unwrap(),
        t.c_pd.create_counter().unwrap(),
    );
    // Header and payload in two SGEs; the payload is read when the send fires.
    let sgl = [t.c_mr.sge(0, 16), t.c_mr.sge(64, 100)];
    t.c_qp
        .post_triggered(
            &go,
            1,
            &SendWr::new(3, WrOp::Send, &sgl),
            TriggerOpts {
                completion: Some(&sent),
                signaled: true,
                ..Default::default()
            },
        )
        .unwrap();
    t.c_buf.write(64, &[0xCD; 100]).unwrap();
    t.fabric.run_until_idle(100_000);
    assert_eq!(sent.get(), (0, 0), "nothing before the trigger");
    go.add(1);
    let wc = poll(&t.fabric, &mut t.s_cq);
    assert_eq!(
        (
            wc.opcode,
            wc.wr_id,
            wc.tag,
            wc.app_ctx,
            wc.tm_match,
            wc.tm_data_valid,
            wc.byte_len
        ),
        (WcOpcode::TmRecv, 0x77, 0x77, 5, true, true, 100),
        "{wc:?}"
    );
    let mut got = [0u8; 100];
    t.s_buf.read(0, &mut got).unwrap();
    assert_eq!(got, [0xCD; 100]);
    let s = poll(&t.fabric, &mut t.c_cq);
    assert_eq!(
        (s.wr_id, s.status, s.opcode),
        (3, WcStatus::Success, WcOpcode::Send)
    );
    assert!(s.trigger.is_some());
    assert_eq!(sent.wait(1, None).unwrap(), CounterWait::Reached(1));
}

#[test]
fn a_triggered_rendezvous_is_read_by_the_receiving_nic_and_finished() {
    let mut t = setup();
    t.add_tag(0x99, 8192);
    let data: Vec<u8> = (0..8000u32).map(|i| (i * 13) as u8).collect();
    t.c_buf.write(4096, &data).unwrap();
    let tmh = Tmh {
        opcode: TmhOp::Rndv as u8,
        app_ctx: 9,
        tag: 0x99,
    };
    let rvh = Rvh {
        va: t.c_mr.addr() + 4096,
        rkey: t.c_mr.rkey(),
        len: 8000,
    };
    t.c_buf.write(0, &tmh.to_bytes()).unwrap();
    t.c_buf.write(16, &rvh.to_bytes()).unwrap();
    // The FIN lands in a receive of the sender's own.
    let fin = [t.c_mr.sge(32768, 64)];
    t.c_qp
        .post_recv(&[RecvWr {
            wr_id: 50,
            sgl: &fin,
        }])
        .unwrap();
    let (go, sent) = (
        t.c_pd.create_counter().unwrap(),
        t.c_pd.create_counter().unwrap(),
    );
    let sgl = [t.c_mr.sge(0, 64)];
    t.c_qp
        .post_triggered(
            &go,
            2,
            &SendWr::new(4, WrOp::Send, &sgl),
            TriggerOpts {
                completion: Some(&sent),
                ..Default::default()
            },
        )
        .unwrap();
    go.add_wide(1, 1).unwrap(); // success + error reach 2
    let wc = poll(&t.fabric, &mut t.s_cq);
    assert_eq!(
        (wc.opcode, wc.wr_id, wc.tag, wc.tm_match, wc.tm_data_valid),
        (WcOpcode::TmRecv, 0x99, 0x99, true, false),
        "{wc:?}"
    );
    let done = poll(&t.fabric, &mut t.s_cq);
    assert_eq!(
        (done.opcode, done.tm_data_valid, done.byte_len),
        (WcOpcode::TmRecv, true, 8000)
    );
    let mut got = vec![0u8; 8000];
    t.s_buf.read(0, &mut got).unwrap();
    assert_eq!(got, data);
    let f = poll(&t.fabric, &mut t.c_cq);
    assert_eq!((f.wr_id, f.opcode), (50, WcOpcode::Recv), "the FIN: {f:?}");
    // Not signaled: the send completes silently, counted once.
    assert_eq!(sent.wait(1, None).unwrap(), CounterWait::Reached(1));
    t.fabric.run_until_idle(100_000);
    let mut wc = [WorkCompletion::default(); 4];
    assert_eq!(t.c_cq.poll_ready(&mut wc), 0);
}
