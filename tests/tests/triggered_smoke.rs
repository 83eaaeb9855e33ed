use ringbell::*;
use ringbell_tests::*;

#[test]
fn smoke() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    let done = p.a.pd.create_counter().unwrap();
    p.a.buf.write(0, b"triggered!").unwrap();
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 64,
        rkey: p.b.mr.rkey(),
    };
    let sge = [p.a.mr.sge(0, 10)];
    let h =
        p.a.qp
            .post_triggered(
                &c,
                2,
                &SendWr::new(42, WrOp::Write(remote), &sge),
                TriggerOpts {
                    completion: Some(&done),
                    signaled: true,
                    ..Default::default()
                },
            )
            .unwrap();
    settle(&p.fabric);
    assert_eq!(done.get(), (0, 0));
    assert_eq!(c.query().unwrap().pending, 1);
    c.add(1);
    settle(&p.fabric);
    assert_eq!(done.get(), (0, 0));
    c.add(1);
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!(wc[0].wr_id, 42);
    assert_eq!(wc[0].trigger, Some(h));
    settle(&p.fabric);
    assert_eq!(done.get(), (1, 0));
    assert_eq!(done.read(), (1, 0));
    let mut got = [0u8; 10];
    p.b.buf.read(64, &mut got).unwrap();
    assert_eq!(&got, b"triggered!");
    assert!(p.a.dev.cancel_triggered(h).is_err());
    match done.wait(1, None).unwrap() {
        CounterWait::Reached(1) => {}
        w => panic!("{w:?}"),
    }
}
