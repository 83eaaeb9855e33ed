//! The emulator as a vfio-user server, with real processes: `ringbell-emu serve` in one,
//! `ringbell-emu peer` clients in others (each with its own NIC), RC and tagged traffic end
//! to end, a client killed mid-transfer, and malformed protocol messages.

use ringbell::{Device, VfioPort, WcStatus, WorkCompletion};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ringbell-emu");

/// The lines a process writes to `out`, as they come.
fn lines_of(out: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// A process killed when the test ends, however it ends.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running `ringbell-emu serve` with its socket directory.
struct Server {
    proc: Proc,
    dir: PathBuf,
    log: mpsc::Receiver<String>,
}

impl Server {
    fn start(name: &str, nodes: usize) -> Server {
        let dir = std::env::temp_dir().join(format!("rb-serve-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut child = Command::new(BIN)
            .args(["serve", "--nodes", &nodes.to_string(), "--socket"])
            .arg(&dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert!(line.contains("NICs on"), "serve said {line:?}");
        let log = lines_of(child.stderr.take().unwrap());
        Server {
            proc: Proc(child),
            dir,
            log,
        }
    }

    fn socket(&self, node: usize) -> PathBuf {
        self.dir.join(format!("nic{node}.sock"))
    }

    fn alive(&mut self) -> bool {
        self.proc.0.try_wait().unwrap().is_none()
    }

    /// Waits for a log line containing `what`.
    fn expect_log(&self, what: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.log.recv_timeout(left) {
                Ok(l) if l.contains(what) => return l,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        panic!("the server never logged {what:?}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.proc.0.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A `ringbell-emu peer` process.
struct Peer {
    proc: Proc,
    lines: mpsc::Receiver<String>,
}

impl Peer {
    fn spawn(socket: &Path, role: &str, mode: &str, count: u32, size: u32) -> Peer {
        Peer::spawn_for(socket, role, mode, count, size, 30)
    }

    fn spawn_for(
        socket: &Path,
        role: &str,
        mode: &str,
        count: u32,
        size: u32,
        stall_s: u32,
    ) -> Peer {
        let mut child = Command::new(BIN)
            .arg("peer")
            .arg("--socket")
            .arg(socket)
            .args(["--role", role, "--mode", mode])
            .args(["--count", &count.to_string(), "--size", &size.to_string()])
            .args(["--deadline", "120", "--stall", &stall_s.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = lines_of(child.stdout.take().unwrap());
        Peer {
            proc: Proc(child),
            lines,
        }
    }

    fn line(&self, prefix: &str) -> String {
        loop {
            let l = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no {prefix:?} line from a peer"));
            if l.starts_with(prefix) {
                return l;
            }
        }
    }

    fn tell(&mut self, line: &str) {
        let stdin = self.proc.0.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Waits for the process to end: (success, stderr).
    fn finish(mut self) -> (bool, String) {
        let deadline = Instant::now() + Duration::from_secs(90);
        let status = loop {
            if let Some(s) = self.proc.0.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "a peer never ended");
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        let _ = self.proc.0.stderr.take().unwrap().read_to_string(&mut err);
        (status.success(), err)
    }
}

/// Starts an initiator on `a` and a target on `b` and introduces them.
fn pair(srv: &Server, a: usize, b: usize, mode: &str, count: u32, size: u32) -> (Peer, Peer) {
    let mut ini = Peer::spawn(&srv.socket(a), "initiator", mode, count, size);
    let mut tgt = Peer::spawn(&srv.socket(b), "target", mode, count, size);
    let (ea, eb) = (ini.line("rb-endpoint"), tgt.line("rb-endpoint"));
    ini.tell(&eb);
    tgt.tell(&ea);
    (ini, tgt)
}

fn ok(p: Peer, what: &str) {
    let (success, err) = p.finish();
    assert!(success, "{what} failed: {err}");
}

#[test]
fn processes_on_their_own_nics_run_rc_and_tagged_traffic() {
    let srv = Server::start("pairs", 4);
    let (a, b) = pair(&srv, 0, 1, "rc", 48, 4096);
    let (c, d) = pair(&srv, 2, 3, "tag", 24, 65536);
    for (p, what) in [
        (a, "rc initiator"),
        (b, "rc target"),
        (c, "tag initiator"),
        (d, "tag target"),
    ] {
        ok(p, what);
    }
}

#[test]
fn a_client_killed_mid_transfer_is_reclaimed_and_nobody_else_notices() {
    let mut srv = Server::start("crash", 4);
    let (a, b) = pair(&srv, 0, 1, "rc", 96, 4096);
    let mut c = Peer::spawn_for(&srv.socket(2), "initiator", "rc", 1_000_000, 4096, 2);
    let mut d = Peer::spawn(&srv.socket(3), "target", "rc", 1_000_000, 4096);
    let (ec, ed) = (c.line("rb-endpoint"), d.line("rb-endpoint"));
    c.tell(&ed);
    d.tell(&ec);
    d.line("rb-progress");
    d.proc.0.kill().unwrap();
    let _ = d.proc.0.wait();
    // The dead target's NIC is reset. Its peer either had requests in flight (they run out
    // of retries: no QP answers on the reset NIC) or waits for an answer that never comes
    // (its deadline): either way it ends, with an error.
    let (success, err) = c.finish();
    assert!(!success, "the initiator of the dead target finished");
    assert!(
        err.contains("RetryExcErr") || err.contains("stalled"),
        "initiator said: {err}"
    );
    let log = srv.expect_log("node 3: client");
    assert!(
        log.contains("NIC reset") && !log.contains(", 0 DMA mappings reclaimed"),
        "{log}"
    );
    // The other pair never noticed.
    ok(a, "rc initiator of the live pair");
    ok(b, "rc target of the live pair");
    assert!(srv.alive());
    // Nodes 2 and 3 serve new clients.
    let (c, d) = pair(&srv, 2, 3, "rc", 8, 4096);
    ok(c, "new initiator on node 2");
    ok(d, "new target on node 3");
}

/// A vfio-user header.
fn header(id: u16, command: u16, size: u32) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&id.to_le_bytes());
    h.extend_from_slice(&command.to_le_bytes());
    h.extend_from_slice(&size.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

/// Reads one reply header: (id, command, flags).
fn reply(s: &mut UnixStream) -> (u16, u16, u32, u32) {
    let mut h = [0u8; 16];
    s.read_exact(&mut h).unwrap();
    let size = u32::from_le_bytes(h[4..8].try_into().unwrap());
    let mut rest = vec![0u8; size.saturating_sub(16) as usize];
    s.read_exact(&mut rest).unwrap();
    (
        u16::from_le_bytes([h[0], h[1]]),
        u16::from_le_bytes([h[2], h[3]]),
        u32::from_le_bytes(h[8..12].try_into().unwrap()),
        size,
    )
}

const REPLY: u32 = 1;
const ERROR: u32 = 1 << 5;

fn version(s: &mut UnixStream) {
    let caps = b"{\"capabilities\":{\"max_msg_fds\":16}}\0";
    let mut m = header(1, 1, 20 + caps.len() as u32);
    m.extend_from_slice(&0u16.to_le_bytes());
    m.extend_from_slice(&1u16.to_le_bytes());
    m.extend_from_slice(caps);
    s.write_all(&m).unwrap();
    let (_, cmd, flags, _) = reply(s);
    assert_eq!((cmd, flags & (REPLY | ERROR)), (1, REPLY));
}

fn connect(path: &Path) -> UnixStream {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// A REGION_READ or REGION_WRITE of `count` bytes at `offset` of `region`.
fn region_access(s: &mut UnixStream, id: u16, write: bool, region: u32, offset: u64, count: u32) {
    let data = if write { count } else { 0 };
    let mut m = header(id, if write { 10 } else { 9 }, 32 + data);
    m.extend_from_slice(&offset.to_le_bytes());
    m.extend_from_slice(&region.to_le_bytes());
    m.extend_from_slice(&count.to_le_bytes());
    m.extend(std::iter::repeat_n(0u8, data as usize));
    s.write_all(&m).unwrap();
}

/// Sends DMA_MAP of `len` bytes of `fd` at `iova`, the file passed with SCM_RIGHTS.
fn dma_map(s: &UnixStream, id: u16, fd: std::os::fd::BorrowedFd<'_>, iova: u64, len: u64) {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use std::os::fd::AsRawFd;
    let mut m = header(id, 2, 16 + 32);
    for v in [32u32, 3] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    for v in [0u64, iova, len] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    let fds = [fd.as_raw_fd()];
    let sent = sendmsg::<()>(
        s.as_raw_fd(),
        &[std::io::IoSlice::new(&m)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .unwrap();
    assert_eq!(sent, m.len());
}

#[test]
fn malformed_messages_are_refused_and_every_node_keeps_serving() {
    let srv = Server::start("bad", 2);
    let path = srv.socket(0);

    // A VERSION too short to hold its own fields: the connection is dropped.
    let mut s = connect(&path);
    let mut m = header(1, 1, 8);
    m.extend_from_slice(&[0, 0, 1, 0]);
    s.write_all(&m).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(s.read(&mut b).unwrap(), 0, "the connection is closed");
    drop(s);
    srv.expect_log("node 0: client dropped");

    // A VERSION whose capabilities are not NUL-terminated: dropped too.
    let mut s = connect(&path);
    let mut m = header(1, 1, 24);
    m.extend_from_slice(&[0, 0, 1, 0, b'{', b'}', b'x', b'y']);
    s.write_all(&m).unwrap();
    assert_eq!(s.read(&mut b).unwrap(), 0, "the connection is closed");
    drop(s);
    srv.expect_log("node 0: client dropped");

    // A well-behaved start, then bad requests: each gets an error reply.
    let mut s = connect(&path);
    version(&mut s);
    // An unknown command.
    s.write_all(&header(2, 99, 16)).unwrap();
    let (id, _, flags, _) = reply(&mut s);
    assert_eq!((id, flags & ERROR), (2, ERROR));
    // BAR0 reads out of range, unaligned, too long; a region that does not exist.
    for (i, (region, offset, count)) in [
        (0u32, ringbell_specs::regs::BAR0_SIZE, 4u32),
        (0, 2, 4),
        (0, 0, 512),
        (5, 0, 4),
        (7, 250, 8),
    ]
    .into_iter()
    .enumerate()
    {
        let id = 10 + i as u16;
        region_access(&mut s, id, false, region, offset, count);
        let (got, cmd, flags, _) = reply(&mut s);
        assert_eq!(
            (got, cmd, flags & ERROR),
            (id, 9, ERROR),
            "read {region} {offset:#x}"
        );
    }
    // A write out of range.
    region_access(&mut s, 20, true, 0, ringbell_specs::regs::BAR0_SIZE - 2, 4);
    let (got, _, flags, _) = reply(&mut s);
    assert_eq!((got, flags & ERROR), (20, ERROR));
    // A DMA_MAP without a memory file.
    let mut m = header(21, 2, 16 + 32);
    for v in [32u32, 3] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    for v in [0u64, 0x1_0000_0000, 4096] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    s.write_all(&m).unwrap();
    let (got, cmd, flags, _) = reply(&mut s);
    assert_eq!((got, cmd, flags & ERROR), (21, 2, ERROR));
    // An unmap of nothing.
    let mut m = header(22, 3, 16 + 24);
    for v in [24u32, 0] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    for v in [0x1_0000_0000u64, 4096] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    s.write_all(&m).unwrap();
    let (got, cmd, flags, _) = reply(&mut s);
    assert_eq!((got, cmd, flags & ERROR), (22, 3, ERROR));
    // A good read still works on this connection: the magic register.
    region_access(&mut s, 23, false, 0, ringbell_specs::regs::MAGIC, 4);
    let mut h = [0u8; 16 + 16 + 4];
    s.read_exact(&mut h).unwrap();
    assert_eq!(u32::from_le_bytes(h[8..12].try_into().unwrap()) & ERROR, 0);
    assert_eq!(
        u32::from_le_bytes(h[32..36].try_into().unwrap()),
        ringbell_specs::regs::MAGIC_VALUE
    );
    // Hang up in the middle of a message.
    s.write_all(&header(24, 10, 4096)[..10]).unwrap();
    drop(s);
    srv.expect_log("node 0: client");

    // DMA_MAPs of a real memory file: overlapping, absurdly large, beyond the file,
    // unaligned, empty: each refused by the server, which keeps the good one.
    let mut s = connect(&path);
    version(&mut s);
    let mem = ringbell::DmaMemory::new(65536).unwrap();
    let base = 1u64 << 32;
    for (i, (iova, len, good)) in [
        (base, 65536u64, true),
        (base + 4096, 4096, false),
        (base - 4096, 8192, false),
        (base << 4, 1 << 40, false),
        (base << 4, 65536 + 4096, false),
        ((base << 4) + 12, 4096, false),
        (base << 4, 0, false),
        (u64::MAX - 4095, 8192, false),
        (base + 65536, 4096, true),
    ]
    .into_iter()
    .enumerate()
    {
        let id = 40 + i as u16;
        dma_map(&s, id, mem.fd(), iova, len);
        let (got, cmd, flags, _) = reply(&mut s);
        assert_eq!((got, cmd), (id, 2));
        assert_eq!(flags & ERROR == 0, good, "DMA_MAP {iova:#x}+{len:#x}");
    }
    // A memory file that cannot be sealed against shrinking: refused.
    let plain =
        nix::sys::memfd::memfd_create(c"plain", nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC)
            .unwrap();
    nix::unistd::ftruncate(&plain, 4096).unwrap();
    dma_map(&s, 60, std::os::fd::AsFd::as_fd(&plain), base << 8, 4096);
    let (got, cmd, flags, _) = reply(&mut s);
    assert_eq!((got, cmd, flags & ERROR), (60, 2, ERROR));
    drop(s);
    let log = srv.expect_log("node 0: client");
    assert!(log.contains("2 DMA mappings reclaimed"), "{log}");

    // Both NICs still carry traffic.
    let (a, b) = pair(&srv, 0, 1, "rc", 8, 4096);
    ok(a, "initiator after the bad clients");
    ok(b, "target after the bad clients");
}

/// Driver clients of NICs 0 and 1 of a server, with an RC QP connected between them and B's
/// buffer (`b_bytes`) registered for remote writes. Fields drop in declaration order.
struct Two {
    qa: ringbell::QueuePair,
    _qb: ringbell::QueuePair,
    ca: ringbell::CompletionQueue,
    _cb: ringbell::CompletionQueue,
    ma: ringbell::MemoryRegion,
    mb: ringbell::MemoryRegion,
    ba: ringbell::DmaBuffer,
    bb: ringbell::DmaBuffer,
    _pds: (ringbell::ProtectionDomain, ringbell::ProtectionDomain),
    a: Device,
    _b: Device,
}

impl Two {
    fn connect(srv: &Server, b_bytes: usize) -> Two {
        use ringbell::{Access, ConnectOptions, QpInit};
        let a = Device::open(Box::new(VfioPort::connect(srv.socket(0)).unwrap())).unwrap();
        let b = Device::open(Box::new(VfioPort::connect(srv.socket(1)).unwrap())).unwrap();
        let (pa, pb) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
        let (ba, bb) = (a.alloc_dma(4096).unwrap(), b.alloc_dma(b_bytes).unwrap());
        let ma = pa.reg_mr(&ba, Access::LOCAL_WRITE).unwrap();
        let mb = pb
            .reg_mr(&bb, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let (ca, cb) = (a.create_cq(16).unwrap(), b.create_cq(16).unwrap());
        let mut qa = pa.create_qp(&QpInit::new(&ca, &ca)).unwrap();
        let mut qb = pb.create_qp(&QpInit::new(&cb, &cb)).unwrap();
        let (ea, eb) = (qa.endpoint(1), qb.endpoint(2));
        qa.connect(&eb, 1, &ConnectOptions::default()).unwrap();
        qb.connect(&ea, 2, &ConnectOptions::default()).unwrap();
        Two {
            qa,
            _qb: qb,
            ca,
            _cb: cb,
            ma,
            mb,
            ba,
            bb,
            _pds: (pa, pb),
            a,
            _b: b,
        }
    }
}

#[test]
fn a_completion_raises_the_interrupt_eventfd() {
    use ringbell::{RemoteAddr, SendWr, WrOp};
    let srv = Server::start("irq", 2);
    let mut t = Two::connect(&srv, 4096);
    // Nothing pending: no interrupt.
    assert!(!t.a.wait_interrupt(Duration::from_millis(50)).unwrap());
    t.ca.arm(false);
    t.ba.write(0, b"wake up").unwrap();
    let remote = RemoteAddr {
        addr: t.mb.addr(),
        rkey: t.mb.rkey(),
    };
    t.qa.post_send(&[SendWr::new(9, WrOp::Write(remote), &[t.ma.sge(0, 7)])])
        .unwrap();
    assert!(t.a.wait_interrupt(Duration::from_secs(10)).unwrap());
    let mut wc = [WorkCompletion::default(); 1];
    assert_eq!(t.ca.poll_ready(&mut wc), 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (9, WcStatus::Success));
    let mut got = [0u8; 7];
    t.bb.read(0, &mut got).unwrap();
    assert_eq!(&got, b"wake up");
}

/// A size no other buffer of this test binary has.
const SHRUNK: usize = 0x31000;

/// One of this process's memory files of `len` bytes (the driver does not hand out a
/// buffer's file).
fn memory_file_of_size(len: u64) -> Option<std::fs::File> {
    std::fs::read_dir("/proc/self/fd")
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:ringbell-dma"))
        })
        .filter_map(|e| std::fs::OpenOptions::new().write(true).open(e.path()).ok())
        .find(|f| f.metadata().is_ok_and(|m| m.len() == len))
}

#[test]
fn a_client_that_shrinks_a_mapped_file_does_not_take_the_server_down() {
    use ringbell::{RemoteAddr, SendWr, WrOp};
    let mut srv = Server::start("shrink", 2);
    let mut t = Two::connect(&srv, SHRUNK);
    // Node 1's client shrinks the file it mapped for DMA behind the server's back (this
    // process never touches `bb` again), then node 0 writes into it.
    let file = memory_file_of_size(SHRUNK as u64).expect("bb's memory file");
    let _ = nix::unistd::ftruncate(&file, 0);
    t.ba.write(0, b"still here").unwrap();
    let remote = RemoteAddr {
        addr: t.mb.addr() + SHRUNK as u64 - 4096,
        rkey: t.mb.rkey(),
    };
    t.qa.post_send(&[SendWr::new(5, WrOp::Write(remote), &[t.ma.sge(0, 10)])])
        .unwrap();
    let mut wc = [WorkCompletion::default(); 1];
    let deadline = Instant::now() + Duration::from_secs(20);
    while t.ca.poll(&mut wc) == 0 {
        assert!(srv.alive(), "the server died");
        assert!(Instant::now() < deadline, "no completion");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(srv.alive(), "the server died");
    assert_eq!(wc[0].wr_id, 5);
}

#[test]
fn a_client_cannot_shrink_the_bar_file_under_the_server() {
    let mut srv = Server::start("barfile", 1);
    let client = vfio_user::Client::new(&srv.socket(0)).unwrap();
    let region = client.region(0).expect("BAR0");
    let file = region
        .file_offset
        .as_ref()
        .expect("BAR0's doorbell pages are mappable")
        .file();
    // The server reaches the doorbell pages through its own mapping of this file: shrinking
    // it must be refused, or the server's next touch of a doorbell word is a SIGBUS.
    assert!(
        nix::unistd::ftruncate(file, 0).is_err(),
        "the BAR file shrank"
    );
    drop(client);
    srv.expect_log("node 0: client");
    std::thread::sleep(Duration::from_millis(100));
    assert!(srv.alive(), "the server died");
}

#[test]
fn a_former_client_cannot_ring_the_next_clients_doorbells() {
    use std::os::unix::fs::FileExt;
    let srv = Server::start("nextclient", 1);
    let bar_file = |c: &vfio_user::Client| {
        let f = c.region(0).unwrap().file_offset.as_ref().unwrap().file();
        f.try_clone().unwrap()
    };
    let first = vfio_user::Client::new(&srv.socket(0)).unwrap();
    let old = bar_file(&first);
    drop(first);
    srv.expect_log("node 0: client");
    let second = vfio_user::Client::new(&srv.socket(0)).unwrap();
    let new = bar_file(&second);
    // The first client kept its doorbell pages (a mapping or, here, the file): its stores
    // must not reach the NIC that now serves someone else.
    let at = ringbell_specs::regs::QP_DB_BASE + 8;
    old.write_all_at(&7u32.to_le_bytes(), at).unwrap();
    let mut got = [0u8; 4];
    new.read_exact_at(&mut got, at).unwrap();
    assert_eq!(
        u32::from_le_bytes(got),
        u32::MAX,
        "the doorbell pages are shared"
    );
    drop(second);
}
