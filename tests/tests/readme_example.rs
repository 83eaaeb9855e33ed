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
