//! Connection management over datagrams: listen, connect, accept, reject, disconnect, with
//! no out-of-band exchange, under loss and duplication, with many clients, both directions
//! at once, and forged or malformed messages.

use ringbell::cm::*;
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig, FaultPlan, LinkFaults};
use ringbell_specs::cmd::{GSI_QKEY, GSI_QPN};
use ringbell_specs::wire::{BthRepr, Deth, Endpoint as WireEndpoint, Opcode, PacketRepr};
use ringbell_specs::{Psn, Qpn};

/// A node: its device, a connection manager, and what its RC QPs need.
struct Node {
    cm: ConnectionManager,
    mr: MemoryRegion,
    buf: DmaBuffer,
    cq: CompletionQueue,
    pd: ProtectionDomain,
    _dev: Device,
}

fn node(f: &Fabric, n: usize) -> Node {
    let dev = Device::open(Box::new(f.port(n))).expect("open");
    let cm = ConnectionManager::new(&dev).expect("cm");
    let pd = dev.alloc_pd().unwrap();
    let buf = dev.alloc_dma(1 << 16).unwrap();
    let mr = pd
        .reg_mr(&buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let cq = dev.create_cq(256).unwrap();
    Node {
        cm,
        mr,
        buf,
        cq,
        pd,
        _dev: dev,
    }
}

fn rc_qp(n: &Node) -> QueuePair {
    let mut init = QpInit::new(&n.cq, &n.cq);
    init.max_inline = 64;
    n.pd.create_qp(&init).unwrap()
}

fn opts() -> ConnectOptions {
    ConnectOptions {
        timeout: 10,
        ..Default::default()
    }
}

/// Polls every node's CM in turn until `done` says so; accepts every connection request
/// on the way (with a fresh QP) and hands every other event to `on`. Panics after
/// `limit` rounds.
fn run(
    nodes: &mut [Node],
    limit: usize,
    mut on: impl FnMut(usize, CmEvent, &mut Vec<Node>),
    mut done: impl FnMut() -> bool,
) {
    let mut owned: Vec<Node> = Vec::new();
    let _ = &mut owned;
    for _ in 0..limit {
        if done() {
            return;
        }
        for (i, nd) in nodes.iter_mut().enumerate() {
            while let Some(e) = nd.cm.poll() {
                match e {
                    CmEvent::ConnectRequest { id, private, .. } => {
                        let qp = rc_qp(nd);
                        let mut answer = private.clone();
                        answer.reverse();
                        nd.cm.accept(id, qp, &opts(), &answer).unwrap();
                    }
                    e => on(i, e, &mut owned),
                }
            }
        }
    }
    panic!("not done after {limit} rounds");
}

/// Sends `msg` over `qp` to `rq` (posted first on `to`) and checks it lands.
fn traffic(from: &mut Node, qp: &mut QueuePair, to: &mut Node, rq: &mut QueuePair, f: &Fabric) {
    let sge = [to.mr.sge(0, 64)];
    rq.post_recv(&[RecvWr {
        wr_id: 9,
        sgl: &sge,
    }])
    .unwrap();
    qp.post_send(&[SendWr::inline(1, WrOp::Send, b"over a CM connection")])
        .unwrap();
    let mut wc = [WorkCompletion::default(); 4];
    let mut got = Vec::new();
    for _ in 0..1_000_000 {
        let k = to.cq.poll(&mut wc);
        got.extend(wc[..k].iter().filter(|w| w.opcode.is_recv()).copied());
        if !got.is_empty() {
            break;
        }
        let _ = f.step();
    }
    assert_eq!(got.len(), 1, "the message arrived");
    assert_eq!(got[0].status, WcStatus::Success);
    let mut b = [0u8; 20];
    to.buf.read(0, &mut b).unwrap();
    assert_eq!(&b, b"over a CM connection");
    let _ = from;
}

/// Client `n` (node `n`, QP the `n`-th of `qps`) WRITEs its number into node 0's buffer
/// at offset `8 n`; every WRITE completes and lands.
fn writes_land<'a>(f: &Fabric, nodes: &mut [Node], qps: impl Iterator<Item = &'a mut QueuePair>) {
    let clients = nodes.len() - 1;
    for (i, qp) in qps.enumerate() {
        let n = i + 1;
        let remote = RemoteAddr {
            addr: nodes[0].mr.addr() + n as u64 * 8,
            rkey: nodes[0].mr.rkey(),
        };
        qp.post_send(&[SendWr::inline(
            n as u64,
            WrOp::Write(remote),
            &(n as u64).to_le_bytes(),
        )])
        .unwrap();
    }
    let mut done = 0;
    let mut wc = [WorkCompletion::default(); 16];
    for _ in 0..10_000_000 {
        for nd in nodes.iter_mut().skip(1) {
            let k = nd.cq.poll_ready(&mut wc);
            for w in &wc[..k] {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
                done += 1;
            }
        }
        if done == clients || !f.step() {
            break;
        }
    }
    assert_eq!(done, clients);
    for n in 1..=clients {
        let mut v = [0u8; 8];
        nodes[0].buf.read(n * 8, &mut v).unwrap();
        assert_eq!(u64::from_le_bytes(v), n as u64);
    }
}

#[test]
fn connect_accept_traffic_disconnect() {
    let f = Fabric::new(FabricConfig::new(2, 1));
    let mut nodes = vec![node(&f, 0), node(&f, 1)];
    nodes[1].cm.listen(0x1234).unwrap();
    assert!(nodes[1].cm.listen(0x1234).is_err(), "listening twice");
    let peer = nodes[1].cm.address();
    let qp = rc_qp(&nodes[0]);
    let id = nodes[0]
        .cm
        .connect(peer, 0x1234, qp, &opts(), b"hello from the client")
        .unwrap();
    let mut up: Vec<(usize, ConnId, QueuePair, Vec<u8>)> = Vec::new();
    let cell = std::cell::RefCell::new(&mut up);
    run(
        &mut nodes,
        100_000,
        |i, e, _| match e {
            CmEvent::Established { id, qp, private } => {
                assert_eq!(qp.state(), QpState::Rts);
                cell.borrow_mut().push((i, id, qp, private));
            }
            e => panic!("unexpected {e:?}"),
        },
        || cell.borrow().len() == 2,
    );
    up.sort_by_key(|u| u.0);
    assert_eq!(up[0].1, id);
    let mut said = b"hello from the client".to_vec();
    said.reverse();
    assert_eq!(up[0].3, said, "the REP carries the server's private data");
    let (mut c, mut s) = (up.remove(0), up.remove(0));
    let (a, b) = nodes.split_at_mut(1);
    traffic(&mut a[0], &mut c.2, &mut b[0], &mut s.2, &f);
    traffic(&mut b[0], &mut s.2, &mut a[0], &mut c.2, &f);
    // Disconnect from the client: both sides hear of it.
    nodes[0].cm.disconnect(c.1).unwrap();
    let mut gone = [false; 2];
    let g = std::cell::RefCell::new(&mut gone);
    run(
        &mut nodes,
        100_000,
        |i, e, _| match e {
            CmEvent::Disconnected { .. } => g.borrow_mut()[i] = true,
            e => panic!("unexpected {e:?}"),
        },
        || g.borrow().iter().all(|&x| x),
    );
    assert!(nodes[0].cm.disconnect(c.1).is_err(), "already closed");
}

/// Node 0 connects to node 1, which listens on `sid`; returns the connection's ids at
/// node 0 and, once the request has reached it, at node 1 (not answered yet).
fn requested(nodes: &mut [Node], sid: u64) -> (ConnId, ConnId) {
    nodes[1].cm.listen(sid).unwrap();
    let peer = nodes[1].cm.address();
    let qp = rc_qp(&nodes[0]);
    let id = nodes[0].cm.connect(peer, sid, qp, &opts(), b"req").unwrap();
    let req = nodes[1]
        .cm
        .poll_until(100_000, |e| matches!(e, CmEvent::ConnectRequest { .. }));
    let Some(CmEvent::ConnectRequest { id: rid, .. }) = req else {
        panic!("no request: {req:?}");
    };
    (id, rid)
}

/// Node 1 accepts request `rid` (node 0's `id`); both sides come up.
fn accept_until_up(nodes: &mut [Node], id: ConnId, rid: ConnId) {
    let sqp = rc_qp(&nodes[1]);
    nodes[1].cm.accept(rid, sqp, &opts(), b"rep").unwrap();
    let mut up = Vec::new();
    let cell = std::cell::RefCell::new(&mut up);
    run(
        nodes,
        100_000,
        |i, e, _| match e {
            CmEvent::Established { id: got, .. } => cell.borrow_mut().push((i, got)),
            e => panic!("unexpected {e:?}"),
        },
        || cell.borrow().len() == 2,
    );
    up.sort_by_key(|u| u.0);
    assert_eq!(up, [(0, id), (1, rid)]);
}

/// A request the application has not answered yet is not a timer the idle clock runs to:
/// the listener's CM polled many times (nothing else to do) keeps it, and the answer given
/// after makes the connection.
#[test]
fn a_request_waits_for_its_answer_while_the_listener_polls() {
    let f = Fabric::new(FabricConfig::new(2, 1));
    let mut nodes = vec![node(&f, 0), node(&f, 1)];
    let (id, rid) = requested(&mut nodes, 0x77);
    // The listener polls with nothing to do (the client does not poll meanwhile).
    let t0 = f.now();
    for _ in 0..50 {
        assert!(nodes[1].cm.poll().is_none());
    }
    assert!(
        f.now().ps() - t0.ps() < 1_000_000_000_000,
        "the idle clock ran to the request's end: {:?} -> {:?}",
        t0,
        f.now()
    );
    accept_until_up(&mut nodes, id, rid);
}

#[test]
fn reject_and_no_listener() {
    let f = Fabric::new(FabricConfig::new(2, 2));
    let mut nodes = [node(&f, 0), node(&f, 1)];
    nodes[1].cm.listen(5).unwrap();
    let peer = nodes[1].cm.address();
    // Nobody listens on 6.
    let q = rc_qp(&nodes[0]);
    let id6 = nodes[0].cm.connect(peer, 6, q, &opts(), &[]).unwrap();
    // The server's CM answers on its own; the application there hears nothing.
    let mut ev = None;
    for _ in 0..100_000 {
        assert!(nodes[1].cm.poll().is_none());
        ev = nodes[0].cm.poll();
        if ev.is_some() {
            break;
        }
    }
    match ev {
        Some(CmEvent::Rejected { id, reason, qp, .. }) => {
            assert_eq!((id, reason), (id6, REJ_INVALID_SERVICE_ID));
            assert_eq!(qp.expect("the QP comes back").state(), QpState::Reset);
        }
        e => panic!("{e:?}"),
    }
    // The application refuses on 5.
    let q = rc_qp(&nodes[0]);
    let id5 = nodes[0]
        .cm
        .connect(peer, 5, q, &opts(), b"let me in")
        .unwrap();
    let req = nodes[1]
        .cm
        .poll_until(100_000, |e| matches!(e, CmEvent::ConnectRequest { .. }));
    let Some(CmEvent::ConnectRequest {
        id,
        service_id,
        from,
        private,
    }) = req
    else {
        panic!("{req:?}")
    };
    assert_eq!(
        (service_id, from, &private[..]),
        (5, nodes[0].cm.address(), &b"let me in"[..])
    );
    nodes[1].cm.reject(id, REJ_CONSUMER, b"no").unwrap();
    assert!(
        nodes[1].cm.reject(id, REJ_CONSUMER, b"no").is_err(),
        "answered already"
    );
    match nodes[0]
        .cm
        .poll_until(100_000, |e| matches!(e, CmEvent::Rejected { .. }))
    {
        Some(CmEvent::Rejected {
            id,
            reason,
            private,
            ..
        }) => {
            assert_eq!((id, reason, &private[..]), (id5, REJ_CONSUMER, &b"no"[..]));
        }
        e => panic!("{e:?}"),
    }
    // A peer that does not exist: the REQ is repeated, then TimedOut.
    let ghost = AhAttr {
        mac: [2, 0, 0, 0, 0, 0x77],
        ip: [10, 9, 9, 9],
    };
    let q = rc_qp(&nodes[0]);
    nodes[0].cm.connect(ghost, 5, q, &opts(), &[]).unwrap();
    let before = nodes[0].cm.stats().repeated;
    match nodes[0]
        .cm
        .poll_until(1_000_000, |e| matches!(e, CmEvent::TimedOut { .. }))
    {
        Some(CmEvent::TimedOut { qp, .. }) => assert!(qp.is_some()),
        e => panic!("{e:?}"),
    }
    assert_eq!(
        nodes[0].cm.stats().repeated - before,
        CmConfig::default().retries as u64
    );
}

/// A forged CM message from node `from` to node `to`'s GSI QP, straight onto the wire.
fn forge(f: &Fabric, src: AhAttr, dst: AhAttr, msg: &[u8], to_node: usize) {
    let repr = PacketRepr {
        src: WireEndpoint {
            mac: src.mac,
            ip: src.ip,
        },
        dst: WireEndpoint {
            mac: dst.mac,
            ip: dst.ip,
        },
        udp_src_port: 0xC001,
        ip_id: 7,
        tos: 0,
        ttl: 64,
        bth: BthRepr {
            opcode: Opcode::UdSendOnly as u8,
            solicited: false,
            mig_req: false,
            pad: 0,
            tver: 0,
            pkey: 0xFFFF,
            fecn: false,
            becn: false,
            dest_qp: Qpn::from_bits(GSI_QPN),
            ack_req: false,
            psn: Psn::new(3),
        },
        deth: Some(Deth {
            qkey: GSI_QKEY,
            src_qp: Qpn::from_bits(GSI_QPN),
        }),
        reth: None,
        aeth: None,
        atomic_eth: None,
        atomic_ack: None,
        imm: None,
        xrc: None,
    };
    let mut frame = Vec::new();
    repr.emit(msg, &mut frame);
    f.inject_frame(to_node, frame);
}

#[test]
fn forged_malformed_and_unknown_messages_are_ignored() {
    let f = Fabric::new(FabricConfig::new(2, 3));
    let mut nodes = vec![node(&f, 0), node(&f, 1)];
    nodes[1].cm.listen(1).unwrap();
    let (a, b) = (nodes[0].cm.address(), nodes[1].cm.address());
    let mut m = Vec::new();
    // A REP for a REQ nobody sent, an RTU, a REJ and a DREP for unknown connections.
    for kind in [CmKind::Rep, CmKind::Rtu, CmKind::Rej, CmKind::Drep] {
        CmMsg {
            kind: Some(kind),
            local_comm_id: 99,
            remote_comm_id: 4242,
            qpn: 77,
            ..Default::default()
        }
        .emit(&mut m);
        forge(&f, a, b, &m, 1);
    }
    // Garbage, a wrong version, and a truncated message.
    forge(&f, a, b, &[0xFF; 64], 1);
    let mut v = m.clone();
    v[1] = 9;
    forge(&f, a, b, &v, 1);
    forge(&f, a, b, &m[..10], 1);
    for _ in 0..2000 {
        assert!(
            nodes[1].cm.poll().is_none(),
            "nothing reaches the application"
        );
    }
    let st = nodes[1].cm.stats();
    assert_eq!((st.received, st.ignored, st.malformed), (7, 4, 3), "{st:?}");
    assert_eq!(nodes[1].cm.connections(), 0);
    // A forged REQ from an address that exists is a request like any other; one that
    // comes twice is one request.
    CmMsg {
        kind: Some(CmKind::Req),
        local_comm_id: 5,
        service_id: 1,
        qpn: 300,
        psn: 1,
        path_mtu: 5,
        ..Default::default()
    }
    .emit(&mut m);
    forge(&f, a, b, &m, 1);
    forge(&f, a, b, &m, 1);
    let mut reqs = 0;
    for _ in 0..2000 {
        if let Some(CmEvent::ConnectRequest { .. }) = nodes[1].cm.poll() {
            reqs += 1;
        }
    }
    assert_eq!(reqs, 1);
    assert_eq!(nodes[1].cm.stats().duplicates, 1);
    // The CM still connects real clients.
    let q = rc_qp(&nodes[0]);
    nodes[0].cm.connect(b, 1, q, &opts(), &[]).unwrap();
    let mut est = 0;
    let e = std::cell::RefCell::new(&mut est);
    run(
        &mut nodes,
        100_000,
        |_, ev, _| {
            if matches!(ev, CmEvent::Established { .. }) {
                **e.borrow_mut() += 1;
            }
        },
        || **e.borrow() == 2,
    );
}

#[test]
fn sixty_four_clients_under_loss_connect_talk_and_disconnect() {
    const CLIENTS: usize = 64;
    let mut cfg = FabricConfig::new(CLIENTS + 1, 64);
    cfg.faults = FaultPlan {
        links: LinkFaults::loss(0.05),
        ..Default::default()
    };
    let f = Fabric::new(cfg);
    let mut nodes: Vec<Node> = (0..=CLIENTS).map(|n| node(&f, n)).collect();
    nodes[0].cm.listen(0xBEEF).unwrap();
    let server = nodes[0].cm.address();
    for (n, nd) in nodes.iter_mut().enumerate().skip(1) {
        let q = rc_qp(nd);
        let tag = (n as u32).to_le_bytes();
        nd.cm.connect(server, 0xBEEF, q, &opts(), &tag).unwrap();
    }
    let mut qps: Vec<Vec<(ConnId, QueuePair)>> = (0..=CLIENTS).map(|_| Vec::new()).collect();
    let q = std::cell::RefCell::new(&mut qps);
    run(
        &mut nodes,
        2_000_000,
        |i, e, _| match e {
            CmEvent::Established { id, qp, .. } => q.borrow_mut()[i].push((id, qp)),
            e => panic!("node {i}: {e:?}"),
        },
        || {
            let q = q.borrow();
            q[0].len() == CLIENTS && q[1..].iter().all(|v| v.len() == 1)
        },
    );
    // Every client's QP is connected to a distinct server QP: a WRITE from each lands
    // in the server's buffer at the client's own offset.
    writes_land(&f, &mut nodes, qps.iter_mut().skip(1).map(|c| &mut c[0].1));
    // Every client disconnects.
    for n in 1..=CLIENTS {
        let id = qps[n][0].0;
        nodes[n].cm.disconnect(id).unwrap();
    }
    let mut closed = vec![0usize; CLIENTS + 1];
    let c = std::cell::RefCell::new(&mut closed);
    run(
        &mut nodes,
        2_000_000,
        |i, e, _| match e {
            CmEvent::Disconnected { .. } => c.borrow_mut()[i] += 1,
            e => panic!("node {i}: {e:?}"),
        },
        || {
            let c = c.borrow();
            c[0] == CLIENTS && c[1..].iter().all(|&x| x == 1)
        },
    );
    let st = nodes[0].cm.stats();
    assert!(f.fault_stats().dropped > 0, "the fabric dropped frames");
    eprintln!(
        "server CM: {st:?}; fabric drops {}",
        f.fault_stats().dropped
    );
}

#[test]
fn simultaneous_connects_both_ways_and_duplicated_frames() {
    let mut cfg = FabricConfig::new(2, 11);
    cfg.faults = FaultPlan {
        links: LinkFaults {
            duplicate_ppm: 300_000,
            drop_ppm: 50_000,
            ..Default::default()
        },
        ..Default::default()
    };
    let f = Fabric::new(cfg);
    let mut nodes = vec![node(&f, 0), node(&f, 1)];
    nodes[0].cm.listen(77).unwrap();
    nodes[1].cm.listen(77).unwrap();
    let (a, b) = (nodes[0].cm.address(), nodes[1].cm.address());
    for _ in 0..3 {
        let q0 = rc_qp(&nodes[0]);
        nodes[0].cm.connect(b, 77, q0, &opts(), b"a->b").unwrap();
        let q1 = rc_qp(&nodes[1]);
        nodes[1].cm.connect(a, 77, q1, &opts(), b"b->a").unwrap();
    }
    let mut est = [0usize; 2];
    let e = std::cell::RefCell::new(&mut est);
    run(
        &mut nodes,
        2_000_000,
        |i, ev, _| match ev {
            CmEvent::Established { qp, .. } => {
                assert_eq!(qp.state(), QpState::Rts);
                e.borrow_mut()[i] += 1
            }
            ev => panic!("node {i}: {ev:?}"),
        },
        || e.borrow().iter().all(|&x| x == 6),
    );
    assert!(nodes[0].cm.stats().duplicates + nodes[1].cm.stats().duplicates > 0);
}

/// Connects `clients` clients to one server on a lossy fabric and returns the fabric's trace
/// digest and the simulated time at the end.
fn lossy_run(seed: u64, clients: usize) -> (u64, u64) {
    let mut cfg = FabricConfig::new(clients + 1, seed);
    cfg.faults = FaultPlan {
        links: LinkFaults::loss(0.05),
        ..Default::default()
    };
    let f = Fabric::new(cfg);
    let mut nodes: Vec<Node> = (0..=clients).map(|n| node(&f, n)).collect();
    nodes[0].cm.listen(9).unwrap();
    let server = nodes[0].cm.address();
    for nd in nodes.iter_mut().skip(1) {
        let q = rc_qp(nd);
        nd.cm.connect(server, 9, q, &opts(), &[]).unwrap();
    }
    let mut up = 0;
    let u = std::cell::RefCell::new(&mut up);
    run(
        &mut nodes,
        1_000_000,
        |_, e, _| {
            if matches!(e, CmEvent::Established { .. }) {
                **u.borrow_mut() += 1;
            }
        },
        || **u.borrow() == 2 * clients,
    );
    (f.trace_digest(), f.now().ps())
}

#[test]
fn connection_management_is_deterministic_under_loss() {
    let a = lossy_run(21, 8);
    assert_eq!(a, lossy_run(21, 8), "same seed, same run");
    assert_ne!(a.0, lossy_run(22, 8).0, "another seed, another run");
}

/// Connections whose QPs the caller moves (`connect_external`, `accept_external`, as the
/// verbs library's RDMA-CM moves them): 16 clients under 10 % loss, every one announced
/// once on each side (`Replied` once at the client however often the REP comes, `Ready`
/// once at the server), then traffic over each; and a REP the client refuses reaches the
/// server as a consumer reject.
#[test]
fn connections_the_caller_moves_its_qps_for() {
    const CLIENTS: usize = 16;
    let mut cfg = FabricConfig::new(CLIENTS + 1, 9);
    cfg.faults = FaultPlan {
        links: LinkFaults::loss(0.1),
        ..Default::default()
    };
    let f = Fabric::new(cfg);
    let mut nodes: Vec<Node> = (0..=CLIENTS).map(|n| node(&f, n)).collect();
    nodes[0].cm.listen(0x0106_1C06).unwrap();
    let server = nodes[0].cm.address();
    let mut client_qps: Vec<Option<(ConnId, QueuePair)>> = vec![None];
    for nd in nodes.iter_mut().skip(1) {
        let q = rc_qp(nd);
        let id = nd
            .cm
            .connect_external(server, 0x0106_1C06, q.qpn(), &opts(), b"moved by me")
            .unwrap();
        // Nothing to establish before the REP.
        assert!(nd.cm.establish(id).is_err());
        client_qps.push(Some((id, q)));
    }
    let mut server_qps: Vec<(ConnId, QueuePair)> = Vec::new();
    let (mut replied, mut ready) = (0usize, 0usize);
    for _ in 0..2_000_000 {
        if replied == CLIENTS && ready == CLIENTS {
            break;
        }
        for i in 0..nodes.len() {
            while let Some(e) = nodes[i].cm.poll() {
                match e {
                    CmEvent::ConnectRequest { id, private, .. } => {
                        assert_eq!(i, 0);
                        assert_eq!(private, b"moved by me");
                        let mut q = rc_qp(&nodes[0]);
                        let (remote, mine) = nodes[0].cm.request(id, &opts()).unwrap();
                        q.to_rtr(&remote, &mine).unwrap();
                        q.to_rts(first_psn(id, q.qpn()), &mine).unwrap();
                        let qpn = q.qpn();
                        nodes[0]
                            .cm
                            .accept_external(id, qpn, &opts(), b"rep")
                            .unwrap();
                        server_qps.push((id, q));
                    }
                    CmEvent::Replied {
                        id,
                        remote,
                        local_psn,
                        opts: o,
                        private,
                    } => {
                        assert_eq!(&private, b"rep");
                        let (cid, q) = client_qps[i].as_mut().expect("a client");
                        assert_eq!(*cid, id);
                        q.to_rtr(&remote, &o).unwrap();
                        q.to_rts(local_psn, &o).unwrap();
                        nodes[i].cm.establish(id).unwrap();
                        replied += 1;
                    }
                    CmEvent::Ready { id, .. } => {
                        assert_eq!(i, 0);
                        assert!(server_qps.iter().any(|(s, _)| *s == id));
                        ready += 1;
                    }
                    e => panic!("node {i}: {e:?}"),
                }
            }
        }
        let _ = f.step();
    }
    assert_eq!((replied, ready), (CLIENTS, CLIENTS));
    assert!(f.fault_stats().dropped > 0, "the fabric dropped frames");
    // Every client WRITEs its number into the server's buffer at its own offset.
    writes_land(
        &f,
        &mut nodes,
        client_qps
            .iter_mut()
            .skip(1)
            .map(|c| &mut c.as_mut().unwrap().1),
    );

    // A REP the client cannot take: refused, and the server hears a consumer reject.
    let q = rc_qp(&nodes[1]);
    let id = nodes[1]
        .cm
        .connect_external(server, 0x0106_1C06, q.qpn(), &opts(), b"again")
        .unwrap();
    let mut rejected = None;
    for _ in 0..2_000_000 {
        if rejected.is_some() {
            break;
        }
        while let Some(e) = nodes[0].cm.poll() {
            match e {
                CmEvent::ConnectRequest { id: sid, .. } => {
                    let mut sq = rc_qp(&nodes[0]);
                    let (remote, mine) = nodes[0].cm.request(sid, &opts()).unwrap();
                    assert_eq!(
                        nodes[0].cm.request_depths(sid),
                        Some((opts().max_rd_atomic, opts().max_dest_rd_atomic))
                    );
                    sq.to_rtr(&remote, &mine).unwrap();
                    sq.to_rts(first_psn(sid, sq.qpn()), &mine).unwrap();
                    let qpn = sq.qpn();
                    nodes[0].cm.accept_external(sid, qpn, &opts(), &[]).unwrap();
                    server_qps.push((sid, sq));
                }
                CmEvent::Rejected { reason, qp, .. } => {
                    assert!(qp.is_none(), "the caller's QP is not the CM's to give back");
                    rejected = Some(reason);
                }
                e => panic!("server: {e:?}"),
            }
        }
        while let Some(e) = nodes[1].cm.poll() {
            match e {
                CmEvent::Replied { id: rid, .. } => {
                    assert_eq!(rid, id);
                    nodes[1].cm.refuse(rid).unwrap();
                    assert!(nodes[1].cm.establish(rid).is_err(), "refused");
                }
                e => panic!("client: {e:?}"),
            }
        }
        let _ = f.step();
    }
    assert_eq!(rejected, Some(REJ_CONSUMER));
    drop(q);
}

/// Service id resolution (SIDR) under loss: each of eight clients learns the server's UD
/// QP and Q_Key once, however often its request or the reply is lost or repeated; a
/// refused request and a service id nobody listens on come back with their statuses.
#[test]
fn service_id_resolution_under_loss() {
    const CLIENTS: usize = 8;
    let mut cfg = FabricConfig::new(CLIENTS + 1, 5);
    cfg.faults = FaultPlan {
        links: LinkFaults::loss(0.2),
        ..Default::default()
    };
    let f = Fabric::new(cfg);
    let mut nodes: Vec<Node> = (0..=CLIENTS).map(|n| node(&f, n)).collect();
    nodes[0].cm.listen(0x0111_0007).unwrap();
    let server = nodes[0].cm.address();
    let mut asked = vec![None];
    for (n, nd) in nodes.iter_mut().enumerate().skip(1) {
        // Client 1 asks for a service nobody offers; client 2 is refused.
        let sid = if n == 1 { 0x0111_0008 } else { 0x0111_0007 };
        let private = [n as u8; 4];
        asked.push(Some(nd.cm.sidr_request(server, sid, &private).unwrap()));
    }
    // (status, QPN, Q_Key, private data) of each client's replies.
    type Reply = (u16, u32, u32, Vec<u8>);
    let mut replies: Vec<Vec<Reply>> = vec![Vec::new(); CLIENTS + 1];
    let mut requests = 0;
    for _ in 0..2_000_000 {
        if replies.iter().skip(1).all(|r| !r.is_empty()) {
            break;
        }
        for i in 0..nodes.len() {
            while let Some(e) = nodes[i].cm.poll() {
                match e {
                    CmEvent::SidrRequest {
                        id,
                        service_id,
                        private,
                        ..
                    } => {
                        assert_eq!((i, service_id), (0, 0x0111_0007));
                        requests += 1;
                        let n = private[0];
                        let status = if n == 2 { SIDR_REJECTED } else { SIDR_OK };
                        nodes[0]
                            .cm
                            .sidr_answer(id, status, 0x100 + u32::from(n), 0x0123_4567, &[n])
                            .unwrap();
                        assert!(
                            nodes[0].cm.sidr_answer(id, SIDR_OK, 1, 1, &[]).is_err(),
                            "answered once"
                        );
                    }
                    CmEvent::SidrReply {
                        id,
                        status,
                        from,
                        qpn,
                        qkey,
                        private,
                    } => {
                        assert_eq!(Some(id), asked[i]);
                        assert_eq!(from, server);
                        replies[i].push((status, qpn, qkey, private));
                    }
                    e => panic!("node {i}: {e:?}"),
                }
            }
        }
        let _ = f.step();
    }
    assert!(f.fault_stats().dropped > 0, "the fabric dropped frames");
    // Every request reached the application once (repeats are answered from the state
    // kept), and every client heard once.
    assert_eq!(requests, CLIENTS - 1);
    for (n, r) in replies.iter().enumerate().skip(1) {
        assert_eq!(r.len(), 1, "client {n}: {r:?}");
        let (status, qpn, qkey, private) = &r[0];
        match n {
            1 => assert_eq!(*status, SIDR_NO_SERVICE),
            2 => assert_eq!((*status, private.as_slice()), (SIDR_REJECTED, &[2u8][..])),
            _ => assert_eq!(
                (*status, *qpn, *qkey, private.as_slice()),
                (SIDR_OK, 0x100 + n as u32, 0x0123_4567, &[n as u8][..])
            ),
        }
    }
}

/// While the listener's application decides, the requester polls on and on (an idle
/// in-process clock would run to every repeat of its REQ): the listener's MRA makes it
/// wait instead of giving up, and the answer, when it comes, connects both.
#[test]
fn an_mra_keeps_the_requester_waiting_for_a_slow_answer() {
    let f = Fabric::new(FabricConfig::new(2, 1));
    let mut nodes = vec![node(&f, 0), node(&f, 1)];
    let (id, rid) = requested(&mut nodes, 0x78);
    // The requester polls far longer than its 15 repeats would take: no event (before
    // MRAs it timed out here).
    for _ in 0..5_000 {
        if let Some(e) = nodes[0].cm.poll() {
            panic!("the requester gave up: {e:?}");
        }
    }
    let before = nodes[0].cm.stats().repeated;
    accept_until_up(&mut nodes, id, rid);
    assert_eq!(before, 0, "the MRA stopped the REQ's repeats");
}
