//! The example in README.md, kept compiling and passing.

#[test]
fn readme_write_between_two_emulated_nodes() -> Result<(), ringbell::Error> {
    use ringbell::*;
    use ringbell_emu::{Fabric, FabricConfig};

    // Two emulated NICs on a switch; the seed fixes every random choice.
    let fabric = Fabric::new(FabricConfig::new(2, 42));
    let a = Device::open(Box::new(fabric.port(0)))?;
    let b = Device::open(Box::new(fabric.port(1)))?;

    // Each side: PD, DMA buffer, MR, CQ, RC QP.
    let (pd_a, pd_b) = (a.alloc_pd()?, b.alloc_pd()?);
    let (buf_a, buf_b) = (a.alloc_dma(4096)?, b.alloc_dma(4096)?);
    let mr_a = pd_a.reg_mr(&buf_a, Access::LOCAL_WRITE)?;
    let mr_b = pd_b.reg_mr(&buf_b, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let (mut cq_a, cq_b) = (a.create_cq(16)?, b.create_cq(16)?);
    let mut qp_a = pd_a.create_qp(&QpInit::new(&cq_a, &cq_a))?;
    let mut qp_b = pd_b.create_qp(&QpInit::new(&cq_b, &cq_b))?;

    // Connect: exchange endpoints, then RESET -> INIT -> RTR -> RTS on both sides.
    let opts = ConnectOptions::default();
    let (ea, eb) = (qp_a.endpoint(1000), qp_b.endpoint(2000));
    qp_a.connect(&eb, 1000, &opts)?;
    qp_b.connect(&ea, 2000, &opts)?;

    // RDMA WRITE 13 bytes from A's buffer into B's.
    buf_a.write(0, b"hello, remote")?;
    let remote = RemoteAddr {
        addr: mr_b.addr(),
        rkey: mr_b.rkey(),
    };
    qp_a.post_send(&[SendWr::new(1, WrOp::Write(remote), &[mr_a.sge(0, 13)])])?;

    // Polling an empty CQ advances the simulation: the emulator runs in lockstep.
    let mut wc = [WorkCompletion::default(); 1];
    while cq_a.poll(&mut wc) == 0 {}
    assert_eq!(wc[0].status, WcStatus::Success);
    println!(
        "completed at {} µs of simulated time",
        wc[0].timestamp_ps as f64 / 1e6
    );

    let mut got = [0u8; 13];
    buf_b.read(0, &mut got)?;
    assert_eq!(&got, b"hello, remote");
    Ok(())
}

#[test]
fn readme_tag_matching_rendezvous() -> Result<(), ringbell::Error> {
    use ringbell::tagmatch::{TagConfig, TagEvent, TagMatcher};
    use ringbell::*;
    use ringbell_emu::{Fabric, FabricConfig};

    let fabric = Fabric::new(FabricConfig::new(2, 1));
    let (da, db) = (
        Device::open(Box::new(fabric.port(0)))?,
        Device::open(Box::new(fabric.port(1)))?,
    );
    let (mut a, mut b) = (
        TagMatcher::new(&da, TagConfig::default())?,
        TagMatcher::new(&db, TagConfig::default())?,
    );
    let ((ca, ea), (cb, eb)) = (a.add_conn()?, b.add_conn()?);
    a.connect(ca, &eb, &ConnectOptions::default())?;
    b.connect(cb, &ea, &ConnectOptions::default())?;

    // 64 KiB with tag 0x42 (rendezvous: above the 8 KiB eager limit) into a receive posted
    // for any tag 0x40..0x4f; the receive goes to the NIC's list, which matches it.
    a.user().write(0, &[7u8; 65536])?;
    b.recv(1, 0x40, !0xf, 0, 65536)?;
    a.send(2, ca, 0x42, 0, 65536)?;
    let (mut got, mut sent) = (None, None);
    while got.is_none() || sent.is_none() {
        // One call serves both matchers, and moves the fabric only when neither had work.
        TagMatcher::progress_all(&mut [&mut a, &mut b])?;
        while let Some(e) = b.next_event() {
            got = Some(e);
        }
        while let Some(e) = a.next_event() {
            sent = Some(e);
        }
    }
    assert_eq!(
        got,
        Some(TagEvent::Recv {
            id: 1,
            tag: 0x42,
            len: 65536,
            truncated: false,
            conn: cb
        })
    );
    assert_eq!(sent, Some(TagEvent::Send { id: 2 })); // after the FIN: the buffer is free
    assert_eq!(b.stats().hw_matched, 1);
    let mut data = vec![0u8; 65536];
    b.user().read(0, &mut data)?;
    assert!(data.iter().all(|&x| x == 7));
    Ok(())
}

#[test]
fn readme_triggered_write() -> Result<(), ringbell::Error> {
    use ringbell::*;
    use ringbell_emu::{Fabric, FabricConfig};

    let fabric = Fabric::new(FabricConfig::new(2, 7));
    let (a, b) = (
        Device::open(Box::new(fabric.port(0)))?,
        Device::open(Box::new(fabric.port(1)))?,
    );
    let (pd_a, pd_b) = (a.alloc_pd()?, b.alloc_pd()?);
    let (buf_a, buf_b) = (a.alloc_dma(4096)?, b.alloc_dma(4096)?);
    let mr_a = pd_a.reg_mr(&buf_a, Access::LOCAL_WRITE)?;
    let mr_b = pd_b.reg_mr(&buf_b, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let (cq_a, cq_b) = (a.create_cq(16)?, b.create_cq(16)?);
    let mut qp_a = pd_a.create_qp(&QpInit::new(&cq_a, &cq_a))?;
    let mut qp_b = pd_b.create_qp(&QpInit::new(&cq_b, &cq_b))?;
    let (ea, eb) = (qp_a.endpoint(1), qp_b.endpoint(2));
    qp_a.connect(&eb, 1, &ConnectOptions::default())?;
    qp_b.connect(&ea, 2, &ConnectOptions::default())?;

    // B counts the WRITEs that land in its MR; A holds a WRITE until its counter reaches 2.
    let (go, sent, landed) = (
        pd_a.create_counter()?,
        pd_a.create_counter()?,
        pd_b.create_counter()?,
    );
    landed.bind_mr(&mr_b, CntrEvents::REMOTE_WRITE)?;
    buf_a.write(0, b"fired by a counter")?;
    let remote = RemoteAddr {
        addr: mr_b.addr(),
        rkey: mr_b.rkey(),
    };
    let sge = [mr_a.sge(0, 18)];
    let wr = SendWr::new(9, WrOp::Write(remote), &sge);
    qp_a.post_triggered(
        &go,
        2,
        &wr,
        TriggerOpts {
            completion: Some(&sent),
            ..Default::default()
        },
    )?;
    go.add(1); // not yet
    go.add(1); // fires: no host code runs from here on
    assert_eq!(landed.wait(1, None)?, CounterWait::Reached(1));
    assert_eq!(sent.wait(1, None)?, CounterWait::Reached(1));
    let mut got = [0u8; 18];
    buf_b.read(0, &mut got)?;
    assert_eq!(&got, b"fired by a counter");
    Ok(())
}
