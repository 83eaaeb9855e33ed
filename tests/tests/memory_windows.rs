//! Memory windows (ABI 1.9) end to end: type 1 and type 2 windows bound by work requests,
//! remote access through them (only inside the window, with its rights, and for type 2
//! only through its QP), invalidation by rebinding, by LOCAL_INV and by a received SEND
//! with invalidate, what binds refuse, and the region a bound window holds, in timed and in
//! functional mode.

use ringbell::*;
use ringbell_emu::Fabric;
use ringbell_specs::cmd::CmdStatus;
use ringbell_specs::wqe::MW_ZERO_BASED;
use ringbell_tests::*;

fn all() -> Access {
    Access::LOCAL_WRITE
        | Access::REMOTE_WRITE
        | Access::REMOTE_READ
        | Access::REMOTE_ATOMIC
        | Access::MW_BIND
}

fn pair_in(functional: bool) -> Pair {
    ringbell_tests::pair_in(functional, 9, all())
}

/// Posts one signaled request on a side and waits for its completion. The request is
/// built first, so it may borrow the side's region.
macro_rules! one {
    ($f:expr, $s:expr, $wr:expr $(,)?) => {{
        let wr = $wr;
        one_wr($f, &mut $s, wr)
    }};
}

fn one_wr(fabric: &Fabric, s: &mut Side, wr: SendWr<'_>) -> WorkCompletion {
    s.qp.post_send(&[wr.flags(SendFlags::SIGNALED)]).unwrap();
    wait(fabric, &mut s.cq, 1)[0]
}

fn bind(mw: u32, new_key: u32, mr: &MemoryRegion, off: u64, len: u64, access: u32) -> WrOp {
    WrOp::BindMw(MwBind {
        mw_key: mw,
        new_key,
        mr_key: mr.lkey(),
        addr: mr.addr() + off,
        len,
        access,
    })
}

const RW: u32 = Access::REMOTE_WRITE.bits() | Access::REMOTE_READ.bits();

fn write(p: &mut Pair, rkey: u32, addr: u64, data: &[u8]) -> WorkCompletion {
    p.b.buf.write(0, data).unwrap();
    let s = [p.b.mr.sge(0, data.len() as u32)];
    let wr = SendWr::new(7, WrOp::Write(RemoteAddr { addr, rkey }), &s);
    one!(&p.fabric, p.b, wr)
}

fn read(p: &mut Pair, rkey: u32, addr: u64, len: u32) -> (WorkCompletion, Vec<u8>) {
    let s = [p.b.mr.sge(4096, len)];
    let wr = SendWr::new(8, WrOp::Read(RemoteAddr { addr, rkey }), &s);
    let wc = one!(&p.fabric, p.b, wr);
    let mut got = vec![0u8; len as usize];
    p.b.buf.read(4096, &mut got).unwrap();
    (wc, got)
}

fn status<T: std::fmt::Debug>(r: Result<T, Error>) -> CmdStatus {
    match r {
        Err(Error::Command { status, .. }) => status,
        other => panic!("expected a refused command, got {other:?}"),
    }
}

/// A window of `kind` of A's, bound through A's QP over `[off, off + len)` of A's region
/// with `access` under its next key (type 2: tag `tag`): the window and its key. The bind
/// must succeed.
fn bound(
    p: &mut Pair,
    kind: MwType,
    tag: u8,
    off: u64,
    len: u64,
    access: u32,
) -> (MemoryWindow, u32) {
    let mw = p.a.pd.alloc_mw(kind).unwrap();
    let key = match kind {
        MwType::Type1 => inc_rkey(mw.key()),
        MwType::Type2 => (mw.key() & !0xFF) | u32::from(tag),
    };
    let wc = one!(
        &p.fabric,
        p.a,
        SendWr::new(1, bind(mw.key(), key, &p.a.mr, off, len, access), &[])
    );
    assert_eq!(
        (wc.status, wc.opcode, wc.wr_id),
        (WcStatus::Success, WcOpcode::BindMw, 1),
        "{wc:?}"
    );
    (mw, key)
}

/// B sends 16 bytes with invalidate of `key` into a receive posted on A: the send's and
/// the receive's completions.
fn send_inv(p: &mut Pair, key: u32, id: u64) -> (WorkCompletion, WorkCompletion) {
    let rs = [p.a.mr.sge(0x20000, 64)];
    p.a.qp
        .post_recv(&[RecvWr {
            wr_id: id,
            sgl: &rs,
        }])
        .unwrap();
    let ss = [p.b.mr.sge(0, 16)];
    let wc = one!(&p.fabric, p.b, SendWr::new(id, WrOp::SendInv(key), &ss));
    (wc, wait(&p.fabric, &mut p.a.cq, 1)[0])
}

fn type1(functional: bool) {
    let mut p = pair_in(functional);
    assert!(p.a.dev.caps().max_mw > 0);
    // Window: 256 bytes at offset 0x1000 of A's buffer, read and write.
    let (mw, k1) = bound(&mut p, MwType::Type1, 0, 0x1000, 256, RW);
    assert_eq!(k1 >> 8, mw.key() >> 8);
    let base = p.a.mr.addr() + 0x1000;
    let data: Vec<u8> = (0..200u32).map(|i| (i * 7 + 3) as u8).collect();
    let wc = write(&mut p, k1, base + 40, &data);
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    let mut got = vec![0u8; 200];
    p.a.buf.read(0x1000 + 40, &mut got).unwrap();
    assert_eq!(got, data);
    let (wc, back) = read(&mut p, k1, base + 40, 200);
    assert_eq!((wc.status, back), (WcStatus::Success, data.clone()));
    // Rebinding with length 0 unbinds: the key is dead.
    let k2 = inc_rkey(k1);
    let wc = one!(
        &p.fabric,
        p.a,
        SendWr::new(2, bind(k1, k2, &p.a.mr, 0, 0, 0), &[]),
    );
    assert_eq!(wc.status, WcStatus::Success);
    let wc = write(&mut p, k1, base, &data[..8]);
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
}

#[test]
fn a_type_1_window_gives_access_to_its_range_until_it_is_unbound() {
    type1(false);
    type1(true);
}

/// Accesses outside the window, beyond its rights, or through its old key are remote
/// access errors; a zero-based window is addressed from 0.
#[test]
fn a_window_limits_range_and_rights() {
    for (case, (off, len, rights)) in [
        (0, (256u64, 8u32, RW)),
        (1, (250, 8, RW)),
        (2, (0, 8, Access::REMOTE_READ.bits())),
    ] {
        let mut p = pair_in(case == 1);
        let mw = p.a.pd.alloc_mw(MwType::Type1).unwrap();
        let k = inc_rkey(mw.key());
        let wc = one!(
            &p.fabric,
            p.a,
            SendWr::new(1, bind(mw.key(), k, &p.a.mr, 0x2000, 256, rights), &[]),
        );
        assert_eq!(wc.status, WcStatus::Success);
        let at = p.a.mr.addr() + 0x2000 + off;
        let wc = write(&mut p, k, at, &[1; 8][..len as usize]);
        assert_eq!(wc.status, WcStatus::RemAccessErr, "case {case}: {wc:?}");
    }
    // Zero-based: address 16 is byte 0x2010 of the buffer.
    let mut p = pair_in(false);
    let (_mw, k) = bound(&mut p, MwType::Type1, 0, 0x2000, 64, RW | MW_ZERO_BASED);
    assert_eq!(write(&mut p, k, 16, &[9; 8]).status, WcStatus::Success);
    let mut got = [0u8; 8];
    p.a.buf.read(0x2010, &mut got).unwrap();
    assert_eq!(got, [9; 8]);
    assert_eq!(write(&mut p, k, 60, &[9; 8]).status, WcStatus::RemAccessErr);
}

fn type2(functional: bool) {
    let mut p = pair_in(functional);
    let mw = p.a.pd.alloc_mw(MwType::Type2).unwrap();
    let k = (mw.key() & !0xFF) | 0x5A;
    let wc = one!(
        &p.fabric,
        p.a,
        SendWr::new(1, bind(mw.key(), k, &p.a.mr, 0, 4096, RW), &[]),
    );
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::BindMw)
    );
    // A bound type 2 window cannot be bound again.
    let wc = one!(
        &p.fabric,
        p.a,
        SendWr::new(2, bind(k, k + 1, &p.a.mr, 0, 64, RW), &[]),
    );
    assert_eq!(wc.status, WcStatus::MwBindErr, "{wc:?}");
    // That failure took A's QP to ERR: a fresh pair for the rest.
    let mut p = pair_in(functional);
    let (_mw, k) = bound(&mut p, MwType::Type2, 0x11, 0, 4096, RW);
    assert_eq!(
        {
            let at = p.a.mr.addr() + 8;
            write(&mut p, k, at, &[5; 8]).status
        },
        WcStatus::Success
    );
    // LOCAL_INV unbinds it.
    let wc = one!(&p.fabric, p.a, SendWr::new(3, WrOp::LocalInv(k), &[]));
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::LocalInv)
    );
    assert_eq!(
        {
            let at = p.a.mr.addr() + 8;
            write(&mut p, k, at, &[5; 8]).status
        },
        WcStatus::RemAccessErr
    );

    // Bound again (another tag), then invalidated by the peer's SEND with invalidate.
    let mut p = pair_in(functional);
    let (_mw, k) = bound(&mut p, MwType::Type2, 0x22, 0, 4096, RW);
    let (wc, r) = send_inv(&mut p, k, 41);
    assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Send));
    assert_eq!(
        (r.status, r.opcode, r.byte_len),
        (WcStatus::Success, WcOpcode::Recv, 16)
    );
    assert_eq!((r.invalidated, r.imm), (Some(k), None));
    assert_eq!(
        {
            let at = p.a.mr.addr();
            write(&mut p, k, at, &[5; 8]).status
        },
        WcStatus::RemAccessErr
    );
}

#[test]
fn a_type_2_window_is_bound_once_and_invalidated_locally_or_by_the_peer() {
    type2(false);
    type2(true);
}

/// A type 2 window is reached only through the QP that bound it, and binds only regions
/// of its own PD.
#[test]
fn a_type_2_window_answers_only_its_own_qp() {
    let mut p = pair_in(false);
    // A second connection between the same two devices, A's end in the same PD.
    let (cqa, mut cqb) = (
        p.a.dev.create_cq(64).unwrap(),
        p.b.dev.create_cq(64).unwrap(),
    );
    let mut qa2 = p.a.pd.create_qp(&QpInit::new(&cqa, &cqa)).unwrap();
    let mut qb2 = p.b.pd.create_qp(&QpInit::new(&cqb, &cqb)).unwrap();
    let (ea, eb) = (qa2.endpoint(5), qb2.endpoint(6));
    qa2.connect(&eb, 5, &ConnectOptions::default()).unwrap();
    qb2.connect(&ea, 6, &ConnectOptions::default()).unwrap();
    let mw = p.a.pd.alloc_mw(MwType::Type2).unwrap();
    let k = (mw.key() & !0xFF) | 2;
    let wc = one!(
        &p.fabric,
        p.a,
        SendWr::new(1, bind(mw.key(), k, &p.a.mr, 0, 64, RW), &[])
    );
    assert_eq!(wc.status, WcStatus::Success);
    // Through the other connection: a remote access error.
    let s = [p.b.mr.sge(0, 8)];
    let at = RemoteAddr {
        addr: p.a.mr.addr(),
        rkey: k,
    };
    qb2.post_send(&[SendWr::new(2, WrOp::Write(at), &s)])
        .unwrap();
    let wc = wait(&p.fabric, &mut cqb, 1)[0];
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
    // Through its own: done.
    assert_eq!(write(&mut p, k, at.addr, &[3; 8]).status, WcStatus::Success);
    // A region of another PD of the same device cannot be bound.
    let pd2 = p.a.dev.alloc_pd().unwrap();
    let mr2 = pd2.reg_mr(&p.a.buf, all()).unwrap();
    let mw2 = p.a.pd.alloc_mw(MwType::Type2).unwrap();
    let wc = one!(
        &p.fabric,
        p.a,
        SendWr::new(3, bind(mw2.key(), mw2.key(), &mr2, 0, 64, RW), &[])
    );
    assert_eq!(wc.status, WcStatus::MwBindErr, "{wc:?}");
    drop((qa2, qb2));
}

/// What a bind refuses: a region without MW_BIND, a range beyond the region, write rights
/// over a region without LOCAL_WRITE, a type 1 window named by a stale key. Each is
/// MW_BIND_ERR and leaves the window as it was.
#[test]
fn binds_that_break_the_rules_fail_with_mw_bind_err() {
    let cases: [(&str, Access, u64, u64, u32, bool); 4] = [
        ("no MW_BIND", all() - Access::MW_BIND, 0, 64, RW, false),
        ("beyond", all(), BUF as u64 - 32, 64, RW, false),
        (
            "write without LOCAL_WRITE",
            Access::MW_BIND | Access::REMOTE_READ,
            0,
            64,
            RW,
            false,
        ),
        ("stale key", all(), 0, 64, RW, true),
    ];
    for (what, access, off, len, rights, stale) in cases {
        let mut p = pair_in(false);
        let mut mr = p.a.pd.reg_mr(&p.a.buf, access).unwrap();
        let mw = p.a.pd.alloc_mw(MwType::Type1).unwrap();
        let cur = if stale { inc_rkey(mw.key()) } else { mw.key() };
        let wc = one!(
            &p.fabric,
            p.a,
            SendWr::new(1, bind(cur, inc_rkey(cur), &mr, off, len, rights), &[]),
        );
        assert_eq!(wc.status, WcStatus::MwBindErr, "{what}: {wc:?}");
        assert_eq!(wc.opcode, WcOpcode::BindMw, "{what}");
        // Nothing was bound: the region deregisters at once.
        assert!(mr.dereg().is_ok(), "{what}");
    }
}

/// A bound window holds its region: DEREG_MR is BUSY until the window is unbound or
/// deallocated, and destroying the QP of a type 2 window unbinds it.
#[test]
fn a_bound_window_holds_its_region() {
    let mut p = pair_in(false);
    let mut mr = p.a.pd.reg_mr(&p.a.buf, all()).unwrap();
    let mw = p.a.pd.alloc_mw(MwType::Type1).unwrap();
    let k = inc_rkey(mw.key());
    let wc = one!(
        &p.fabric,
        p.a,
        SendWr::new(1, bind(mw.key(), k, &mr, 0, 64, RW), &[]),
    );
    assert_eq!(wc.status, WcStatus::Success);
    let e = mr.dereg().unwrap_err();
    assert!(
        matches!(
            e,
            Error::Command {
                status: CmdStatus::Busy,
                ..
            }
        ),
        "{e:?}"
    );
    drop(mw);
    assert!(mr.dereg().is_ok());

    let mut mr = p.a.pd.reg_mr(&p.a.buf, all()).unwrap();
    let mw = p.a.pd.alloc_mw(MwType::Type2).unwrap();
    let wc = one!(
        &p.fabric,
        p.a,
        SendWr::new(2, bind(mw.key(), mw.key(), &mr, 0, 64, RW), &[]),
    );
    assert_eq!(wc.status, WcStatus::Success);
    assert!(mr.dereg().is_err());
    // Destroying the QP it was bound through unbinds it.
    let Pair { a, b, fabric } = p;
    drop(a.qp);
    assert!(mr.dereg().is_ok());
    drop((mw, b, fabric));
}

/// A SEND with invalidate naming a key the receiver may not invalidate is an invalid
/// request: the sender sees REM_INV_REQ_ERR, the receive completes with LOC_PROT_ERR.
#[test]
fn a_send_with_a_bad_invalidate_key_is_refused() {
    let mut p = pair_in(false);
    // A type 1 window cannot be invalidated by a SEND.
    let (_mw, k) = bound(&mut p, MwType::Type1, 0, 0, 64, RW);
    let (wc, r) = send_inv(&mut p, k, 41);
    assert_eq!(wc.status, WcStatus::RemInvReqErr, "{wc:?}");
    assert_eq!(r.status, WcStatus::LocProtErr, "{r:?}");
}

/// A window's key is a remote key only: as an lkey it is a local protection error.
#[test]
fn a_window_key_is_not_an_lkey() {
    let mut p = pair_in(false);
    let (_mw, k) = bound(&mut p, MwType::Type1, 0, 0, 64, RW);
    let s = [Sge {
        addr: p.a.mr.addr(),
        len: 8,
        lkey: k,
    }];
    let wr = SendWr::new(
        2,
        WrOp::Write(RemoteAddr {
            addr: p.b.mr.addr(),
            rkey: p.b.mr.rkey(),
        }),
        &s,
    );
    let wc = one!(&p.fabric, p.a, wr);
    assert_eq!(wc.status, WcStatus::LocProtErr, "{wc:?}");
}

/// ALLOC_MW checks its type; DEALLOC_MW its key.
#[test]
fn alloc_mw_checks_its_input() {
    let p = pair();
    let input = ringbell_specs::cmd::AllocMwIn {
        pdn: p.a.pd.pdn().into(),
        mw_type: 3.into(),
    };
    let r = p.a.dev.raw_command(
        ringbell_specs::cmd::CmdOpcode::AllocMw as u16,
        zerocopy::IntoBytes::as_bytes(&input),
    );
    assert_eq!(status(r), CmdStatus::BadParam);
    let input = ringbell_specs::cmd::AllocMwIn {
        pdn: 999.into(),
        mw_type: 1.into(),
    };
    let r = p.a.dev.raw_command(
        ringbell_specs::cmd::CmdOpcode::AllocMw as u16,
        zerocopy::IntoBytes::as_bytes(&input),
    );
    assert_eq!(status(r), CmdStatus::BadResource);
    let r = p.a.dev.raw_command(
        ringbell_specs::cmd::CmdOpcode::DeallocMw as u16,
        &p.a.mr.lkey().to_le_bytes(),
    );
    assert_eq!(status(r), CmdStatus::BadResource);
}

/// What the reference model knows of a window.
#[derive(Clone, Copy, Debug)]
struct RefWin {
    type2: bool,
    key: u32,
    /// Bound: offset in the region, length, rights, zero-based.
    bound: Option<(u64, u64, u32, bool)>,
}

/// One step of a script against a type 1 and a type 2 window of A's.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// Bind window `w` (0: type 1, 1: type 2) over `[off, off + len)` of A's region.
    Bind {
        w: usize,
        off: u64,
        len: u64,
        rights: u32,
        zero_based: bool,
    },
    /// LOCAL_INV of window `w`'s key, from A.
    LocalInv { w: usize },
    /// A SEND from B invalidating window `w`'s key.
    SendInv { w: usize },
    /// B writes `len` bytes at `at` (in the window's addresses) through window `w`.
    Write { w: usize, at: u64, len: u32 },
    /// B reads `len` bytes at `at` through window `w`.
    Read { w: usize, at: u64, len: u32 },
    /// Both QPs are destroyed and a new connection made.
    Reconnect,
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    let rights = prop_oneof![
        Just(RW),
        Just(Access::REMOTE_WRITE.bits()),
        Just(Access::REMOTE_READ.bits()),
        Just(0u32)
    ];
    prop_oneof![
        3 => (0..2usize, 0..8192u64, prop_oneof![Just(0u64), 1..512u64], rights, any::<bool>())
            .prop_map(|(w, off, len, rights, zero_based)| Step::Bind { w, off, len, rights, zero_based }),
        1 => (0..2usize).prop_map(|w| Step::LocalInv { w }),
        1 => (0..2usize).prop_map(|w| Step::SendInv { w }),
        4 => (0..2usize, 0..600u64, 1..64u32).prop_map(|(w, at, len)| Step::Write { w, at, len }),
        2 => (0..2usize, 0..600u64, 1..64u32).prop_map(|(w, at, len)| Step::Read { w, at, len }),
        1 => Just(Step::Reconnect),
    ]
}

/// Drops both QPs (so type 2 windows bound through A's are unbound) and connects new ones.
fn reconnect(p: &mut Pair, wins: &mut [RefWin; 2]) {
    let make = |s: &Side| {
        let mut init = QpInit::new(&s.cq, &s.cq);
        init.max_send_wr = 64;
        init.max_recv_wr = 64;
        s.pd.create_qp(&init).unwrap()
    };
    let (qa, qb) = (make(&p.a), make(&p.b));
    drop(std::mem::replace(&mut p.a.qp, qa));
    drop(std::mem::replace(&mut p.b.qp, qb));
    connect(&mut p.a, &mut p.b, &ConnectOptions::default());
    settle(&p.fabric);
    let _ = (poll_all(&mut p.a.cq), poll_all(&mut p.b.cq));
    for w in wins.iter_mut().filter(|w| w.type2) {
        w.bound = None;
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 40, ..Default::default() })]

    /// Scripts of binds, invalidations, remote accesses and reconnections against a
    /// reference model of the two windows: every completion status, every byte written and
    /// read, and the state of each window (bound or not, and under which key) agree with it.
    #[test]
    fn windows_follow_the_reference_model(
        script in proptest::collection::vec(step(), 1..24),
        functional in proptest::prelude::any::<bool>(),
    ) {
        let mut p = pair_in(functional);
        let mws = [
            p.a.pd.alloc_mw(MwType::Type1).unwrap(),
            p.a.pd.alloc_mw(MwType::Type2).unwrap(),
        ];
        let mut wins = [
            RefWin { type2: false, key: mws[0].key(), bound: None },
            RefWin { type2: true, key: mws[1].key(), bound: None },
        ];
        let base = p.a.mr.addr();
        let mut n = 0u64;
        for s in script {
            n += 1;
            match s {
                Step::Bind { w, off, len, rights, zero_based } => {
                    let r = wins[w];
                    let new_key = inc_rkey(r.key);
                    let access = rights | if zero_based { MW_ZERO_BASED } else { 0 };
                    let op = bind(r.key, new_key, &p.a.mr, off, len, access);
                    let wc = one!(&p.fabric, p.a, SendWr::new(n, op, &[]));
                    if r.type2 && r.bound.is_some() {
                        proptest::prop_assert_eq!(wc.status, WcStatus::MwBindErr);
                        reconnect(&mut p, &mut wins);
                    } else {
                        proptest::prop_assert_eq!(wc.status, WcStatus::Success);
                        wins[w].key = new_key;
                        wins[w].bound = (len > 0).then_some((off, len, rights, zero_based));
                    }
                }
                Step::LocalInv { w } => {
                    let r = wins[w];
                    let wc = one!(&p.fabric, p.a, SendWr::new(n, WrOp::LocalInv(r.key), &[]));
                    if r.type2 && r.bound.is_some() {
                        proptest::prop_assert_eq!(wc.status, WcStatus::Success);
                        wins[w].bound = None;
                    } else {
                        proptest::prop_assert_eq!(wc.status, WcStatus::MwBindErr);
                        reconnect(&mut p, &mut wins);
                    }
                }
                Step::SendInv { w } => {
                    let r = wins[w];
                    let (wc, rc) = send_inv(&mut p, r.key, n);
                    if r.type2 && r.bound.is_some() {
                        proptest::prop_assert_eq!(wc.status, WcStatus::Success);
                        proptest::prop_assert_eq!((rc.status, rc.invalidated), (WcStatus::Success, Some(r.key)));
                        wins[w].bound = None;
                    } else {
                        proptest::prop_assert_eq!(wc.status, WcStatus::RemInvReqErr);
                        proptest::prop_assert_eq!(rc.status, WcStatus::LocProtErr);
                        reconnect(&mut p, &mut wins);
                    }
                }
                Step::Write { w, at, len } | Step::Read { w, at, len } => {
                    let r = wins[w];
                    let is_write = matches!(s, Step::Write { .. });
                    let need = if is_write { Access::REMOTE_WRITE } else { Access::REMOTE_READ };
                    // Where the access lands in A's buffer, if the window allows it.
                    let ok = r.bound.and_then(|(off, wlen, rights, _)| {
                        (rights & need.bits() != 0 && at + u64::from(len) <= wlen).then_some(off + at)
                    });
                    let addr = match r.bound {
                        Some((off, _, _, false)) => base + off + at,
                        _ => at,
                    };
                    let data: Vec<u8> = (0..len).map(|i| (n as u32 * 31 + i) as u8).collect();
                    let (wc, got) = if is_write {
                        (write(&mut p, r.key, addr, &data), Vec::new())
                    } else {
                        read(&mut p, r.key, addr, len)
                    };
                    match ok {
                        Some(o) => {
                            proptest::prop_assert_eq!(wc.status, WcStatus::Success);
                            let mut mem = vec![0u8; len as usize];
                            p.a.buf.read(o as usize, &mut mem).unwrap();
                            if is_write {
                                proptest::prop_assert_eq!(mem, data);
                            } else {
                                proptest::prop_assert_eq!(mem, got);
                            }
                        }
                        None => {
                            proptest::prop_assert_eq!(wc.status, WcStatus::RemAccessErr);
                            reconnect(&mut p, &mut wins);
                        }
                    }
                }
                Step::Reconnect => reconnect(&mut p, &mut wins),
            }
        }
        drop(mws);
    }
}
