//! Every RC operation end to end through the driver and the emulated NIC.

use ringbell::*;
use ringbell_tests::*;

#[test]
fn write_lands_and_completes() {
    let mut p = pair();
    p.a.buf.write(0, b"hello, ringbell").unwrap();
    let remote = RemoteAddr { addr: p.b.mr.addr() + 100, rkey: p.b.mr.rkey() };
    let sge = [p.a.mr.sge(0, 15)];
    p.a.qp.post_send(&[SendWr::new(7, WrOp::Write(remote), &sge)]).unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
    assert_eq!(wc[0].wr_id, 7);
    assert_eq!(wc[0].opcode, WcOpcode::RdmaWrite);
    let mut got = [0u8; 15];
    p.b.buf.read(100, &mut got).unwrap();
    assert_eq!(&got, b"hello, ringbell");
}
