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
        Server::start_with(name, nodes, &[])
    }

    /// A server with extra command-line options.
    fn start_with(name: &str, nodes: usize, extra: &[&str]) -> Server {
        let dir = std::env::temp_dir().join(format!("rb-serve-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut child = Command::new(BIN)
            .args(["serve", "--nodes", &nodes.to_string(), "--socket"])
            .arg(&dir)
            .args(extra)
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

    /// The server's resident memory now and at its peak, in KiB (`VmRSS`, `VmHWM`).
    fn rss_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.proc.0.id()))
            .expect("the server's /proc status");
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in /proc status"))
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Waits for a log line containing `what`.
    fn expect_log(&self, what: &str) -> String {
        self.expect_log_all(&[what])
    }

    /// Waits for the line that ends a connection of the client `who` names ("node N:
    /// client K").
    fn expect_end(&self, who: &str) -> String {
        self.expect_log_all(&[who, "NIC reset"])
    }

    /// Waits for the end of the connection of client `who` ("node N: client K") and gives
    /// how many messages it sent, with the line that says so.
    fn messages_of(&self, who: &str) -> (u64, String) {
        let end = self.expect_end(who);
        let messages = end
            .split("disconnected (")
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no message count in {end:?}"));
        (messages, end)
    }

    /// Waits for a log line containing all of `what`.
    fn expect_log_all(&self, what: &[&str]) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.log.recv_timeout(left) {
                Ok(l) if what.iter().all(|w| l.contains(w)) => return l,
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
    /// Its stderr, collected as it comes.
    err: std::sync::Arc<std::sync::Mutex<String>>,
    err_reader: Option<std::thread::JoinHandle<()>>,
}

impl Peer {
    /// A target (`peer: None`) or an initiator connecting to the target NIC at `peer`.
    fn spawn(socket: &Path, peer: Option<&str>, mode: &str, count: u32, size: u32) -> Peer {
        Peer::spawn_for(socket, peer, mode, count, size, 30)
    }

    fn spawn_for(
        socket: &Path,
        peer: Option<&str>,
        mode: &str,
        count: u32,
        size: u32,
        stall_s: u32,
    ) -> Peer {
        let mut cmd = Command::new(BIN);
        cmd.arg("peer").arg("--socket").arg(socket);
        match peer {
            Some(ip) => cmd.args(["--role", "initiator", "--peer", ip]),
            None => cmd.args(["--role", "target"]),
        };
        let mut child = cmd
            .args(["--mode", mode])
            .args(["--count", &count.to_string(), "--size", &size.to_string()])
            .args(["--deadline", "120", "--stall", &stall_s.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = lines_of(child.stdout.take().unwrap());
        let err = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (mut stderr, sink) = (child.stderr.take().unwrap(), err.clone());
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            sink.lock().unwrap().push_str(&s);
        });
        Peer {
            proc: Proc(child),
            lines,
            err,
            err_reader: Some(err_reader),
        }
    }

    /// The IPv4 address a target listens on (its `rb-listening` line).
    fn listening_ip(&self) -> String {
        let l = self.line("rb-listening");
        l.split_whitespace().nth(1).expect("an address").to_string()
    }

    fn line(&self, prefix: &str) -> String {
        loop {
            let l = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|e| {
                    // Give the stderr reader a moment when the process has ended.
                    std::thread::sleep(Duration::from_millis(200));
                    panic!(
                        "no {prefix:?} line from a peer ({e:?}); its stderr: {}",
                        self.err.lock().unwrap()
                    )
                });
            if l.starts_with(prefix) {
                return l;
            }
        }
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
        if let Some(r) = self.err_reader.take() {
            let _ = r.join();
        }
        let err = self.err.lock().unwrap().clone();
        (status.success(), err)
    }
}

/// Starts a target on `b` and an initiator on `a` that connects to it through connection
/// management; both report the connection.
fn pair(srv: &Server, a: usize, b: usize, mode: &str, count: u32, size: u32) -> (Peer, Peer) {
    let tgt = Peer::spawn(&srv.socket(b), None, mode, count, size);
    let ip = tgt.listening_ip();
    assert_eq!(ip, format!("10.0.0.{}", b + 1), "node {b}'s address");
    let ini = Peer::spawn(&srv.socket(a), Some(&ip), mode, count, size);
    ini.line("rb-connected");
    tgt.line("rb-connected");
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
fn a_server_of_1024_nics_serves_its_last_ones_and_refuses_more() {
    // A job of many ranks gets a NIC each from one server, up to the fabric's 1024 NICs.
    let srv = Server::start("wide", 1024);
    let tgt = Peer::spawn(&srv.socket(1023), None, "rc", 24, 4096);
    let ip = tgt.listening_ip();
    // Node i's address ends in i + 1, over two bytes: 1024 is 4 * 256.
    assert_eq!(ip, "10.0.4.0", "node 1023's address");
    let ini = Peer::spawn(&srv.socket(1000), Some(&ip), "rc", 24, 4096);
    ini.line("rb-connected");
    tgt.line("rb-connected");
    ok(ini, "initiator on NIC 1000");
    ok(tgt, "target on NIC 1023");
    drop(srv);
    let out = Command::new(BIN)
        .args(["serve", "--nodes", "1025", "--socket"])
        .arg(std::env::temp_dir().join(format!("rb-serve-{}-toomany", std::process::id())))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("1..=1024 NICs can be served"), "{err}");
}

#[test]
fn a_client_killed_mid_transfer_is_reclaimed_and_nobody_else_notices() {
    let mut srv = Server::start("crash", 4);
    let (a, b) = pair(&srv, 0, 1, "rc", 96, 4096);
    let mut d = Peer::spawn(&srv.socket(3), None, "rc", 1_000_000, 4096);
    let ip = d.listening_ip();
    let c = Peer::spawn_for(&srv.socket(2), Some(&ip), "rc", 1_000_000, 4096, 2);
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
    let log = srv.expect_end("node 3: client");
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

/// One reply: its header fields and payload.
#[derive(Debug)]
struct Reply {
    id: u16,
    cmd: u16,
    flags: u32,
    errno: u32,
    payload: Vec<u8>,
}

/// Reads one reply.
fn read_reply(s: &mut UnixStream) -> Reply {
    let mut h = [0u8; 16];
    s.read_exact(&mut h).unwrap();
    let size = u32::from_le_bytes(h[4..8].try_into().unwrap());
    assert!((16..=4096).contains(&size), "a reply of {size} bytes");
    let mut payload = vec![0u8; size as usize - 16];
    s.read_exact(&mut payload).unwrap();
    Reply {
        id: u16::from_le_bytes([h[0], h[1]]),
        cmd: u16::from_le_bytes([h[2], h[3]]),
        flags: u32::from_le_bytes(h[8..12].try_into().unwrap()),
        errno: u32::from_le_bytes(h[12..16].try_into().unwrap()),
        payload,
    }
}

/// Reads one reply header: (id, command, flags, size).
fn reply(s: &mut UnixStream) -> (u16, u16, u32, u32) {
    let r = read_reply(s);
    (r.id, r.cmd, r.flags, 16 + r.payload.len() as u32)
}

/// Reads a reply and checks that it refuses request `id` of command `cmd` with `errno`.
fn refused(s: &mut UnixStream, id: u16, cmd: u16, errno: nix::errno::Errno) {
    let r = read_reply(s);
    assert_eq!(
        (
            r.id,
            r.cmd,
            r.flags & (REPLY | ERROR),
            r.errno,
            r.payload.len()
        ),
        (id, cmd, REPLY | ERROR, errno as u32, 0),
        "request #{id} (command {cmd}) should be refused with {errno}"
    );
}

/// Checks that the server has closed `s` (after any reply still unread).
fn closed(s: &mut UnixStream) {
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("the connection is still open: {e}"),
        }
    }
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

use nix::errno::Errno;

#[test]
fn malformed_messages_are_refused_with_their_errno_and_every_node_keeps_serving() {
    let srv = Server::start("bad", 2);
    let path = srv.socket(0);

    // A VERSION too short to hold its own header: refused, and the connection is closed.
    let mut s = connect(&path);
    let mut m = header(1, 1, 8);
    m.extend_from_slice(&[0, 0, 1, 0]);
    s.write_all(&m).unwrap();
    refused(&mut s, 1, 1, Errno::EINVAL);
    closed(&mut s);
    let log = srv.expect_log("node 0: client 1 (pid");
    assert!(
        log.contains("refused VERSION #1: message size 8") && log.contains("EINVAL"),
        "{log}"
    );
    srv.expect_end("node 0: client 1 ");

    // A VERSION whose capabilities are not NUL-terminated, or not JSON: refused and closed.
    for (id, caps) in [(2u16, &b"{}xy"[..]), (3, &b"{\"cap\0"[..])] {
        let mut s = connect(&path);
        let mut m = header(id, 1, 20 + caps.len() as u32);
        m.extend_from_slice(&[0, 0, 1, 0]);
        m.extend_from_slice(caps);
        s.write_all(&m).unwrap();
        refused(&mut s, id, 1, Errno::EINVAL);
        closed(&mut s);
        srv.expect_log("dropped: VERSION");
    }

    // A request before VERSION: refused and closed.
    let mut s = connect(&path);
    region_access(&mut s, 4, false, 0, ringbell_specs::regs::MAGIC, 4);
    refused(&mut s, 4, 9, Errno::EINVAL);
    closed(&mut s);
    srv.expect_log("VERSION must come first");

    // A well-behaved start, then bad requests: each gets an error reply with its errno.
    let mut s = connect(&path);
    version(&mut s);
    // An unknown command whose body holds what looks like a REGION_WRITE: the body is
    // skipped, never run, and the stream stays in step.
    let mut inner = header(77, 10, 36);
    inner.extend_from_slice(&ringbell_specs::regs::RESET.to_le_bytes());
    inner.extend_from_slice(&0u32.to_le_bytes());
    inner.extend_from_slice(&4u32.to_le_bytes());
    inner.extend_from_slice(&ringbell_specs::regs::RESET_KEY.to_le_bytes());
    assert_eq!(inner.len(), 36);
    let mut m = header(2, 99, 16 + 36);
    m.extend_from_slice(&inner);
    s.write_all(&m).unwrap();
    refused(&mut s, 2, 99, Errno::ENOTSUP);
    // A command this server does not serve.
    s.write_all(&header(3, 6, 16 + 16)).unwrap();
    s.write_all(&[0u8; 16]).unwrap();
    refused(&mut s, 3, 6, Errno::ENOTSUP);
    let log = srv.expect_log("refused command 99 #2");
    assert!(
        log.contains("node 0: client 5 (pid") && log.contains("EOPNOTSUPP"),
        "{log}"
    );
    // BAR0 reads out of range, unaligned, too long; a region that is empty or absent.
    for (i, (region, offset, count, errno)) in [
        (0u32, ringbell_specs::regs::BAR0_SIZE, 4u32, Errno::EINVAL),
        (0, 2, 4, Errno::EINVAL),
        (0, 0, 512, Errno::E2BIG),
        (0, 0, u32::MAX, Errno::E2BIG),
        (5, 0, 4, Errno::EINVAL),
        (9, 0, 4, Errno::EINVAL),
        (7, 250, 8, Errno::EINVAL),
    ]
    .into_iter()
    .enumerate()
    {
        let id = 10 + i as u16;
        region_access(&mut s, id, false, region, offset, count);
        refused(&mut s, id, 9, errno);
    }
    // A write out of range; one whose count is not what came.
    region_access(&mut s, 20, true, 0, ringbell_specs::regs::BAR0_SIZE - 2, 4);
    refused(&mut s, 20, 10, Errno::EINVAL);
    let mut m = header(21, 10, 32 + 4);
    m.extend_from_slice(&0u64.to_le_bytes());
    m.extend_from_slice(&0u32.to_le_bytes());
    m.extend_from_slice(&8u32.to_le_bytes());
    m.extend_from_slice(&[0; 4]);
    s.write_all(&m).unwrap();
    refused(&mut s, 21, 10, Errno::EINVAL);
    // A REGION_READ shorter than its fields.
    let mut m = header(22, 9, 16 + 8);
    m.extend_from_slice(&0u64.to_le_bytes());
    s.write_all(&m).unwrap();
    refused(&mut s, 22, 9, Errno::EINVAL);
    // A DMA_MAP without a memory file.
    let mut m = header(23, 2, 16 + 32);
    for v in [32u32, 3] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    for v in [0u64, 0x1_0000_0000, 4096] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    s.write_all(&m).unwrap();
    refused(&mut s, 23, 2, Errno::ENOTSUP);
    // An unmap of nothing.
    let mut m = header(24, 3, 16 + 24);
    for v in [24u32, 0] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    for v in [0x1_0000_0000u64, 4096] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    s.write_all(&m).unwrap();
    refused(&mut s, 24, 3, Errno::ENOENT);
    // A header that arrives in two pieces is read whole: the magic register.
    let mut m = header(25, 9, 32);
    m.extend_from_slice(&ringbell_specs::regs::MAGIC.to_le_bytes());
    m.extend_from_slice(&0u32.to_le_bytes());
    m.extend_from_slice(&4u32.to_le_bytes());
    s.write_all(&m[..7]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    s.write_all(&m[7..]).unwrap();
    let r = read_reply(&mut s);
    assert_eq!((r.id, r.flags & ERROR), (25, 0));
    assert_eq!(
        u32::from_le_bytes(r.payload[16..20].try_into().unwrap()),
        ringbell_specs::regs::MAGIC_VALUE
    );
    // Hang up in the middle of a message.
    s.write_all(&header(26, 10, 4096)[..10]).unwrap();
    drop(s);
    let log = srv.expect_end("node 0: client 5 ");
    assert!(log.contains("hung up in the middle of a message"), "{log}");
    assert!(log.contains("(16 messages, 14 refused"), "{log}");

    // DMA_MAPs of a real memory file: overlapping, absurdly large, beyond the file,
    // unaligned, empty: each refused by the server, which keeps the good ones.
    let mut s = connect(&path);
    version(&mut s);
    let mem = ringbell::DmaMemory::new(65536).unwrap();
    let base = 1u64 << 32;
    for (i, (iova, len, errno)) in [
        (base, 65536u64, None),
        (base + 4096, 4096, Some(Errno::EEXIST)),
        (base - 4096, 8192, Some(Errno::EEXIST)),
        (base << 4, 1 << 40, Some(Errno::EINVAL)),
        (base << 4, 65536 + 4096, Some(Errno::EINVAL)),
        ((base << 4) + 12, 4096, Some(Errno::EINVAL)),
        (base << 4, 0, Some(Errno::EINVAL)),
        (u64::MAX - 4095, 8192, Some(Errno::EINVAL)),
        (base + 65536, 4096, None),
    ]
    .into_iter()
    .enumerate()
    {
        let id = 40 + i as u16;
        dma_map(&s, id, mem.fd().unwrap(), iova, len);
        match errno {
            None => {
                let r = read_reply(&mut s);
                assert_eq!(
                    (r.id, r.cmd, r.flags & ERROR),
                    (id, 2, 0),
                    "{iova:#x}+{len:#x}"
                );
            }
            Some(e) => refused(&mut s, id, 2, e),
        }
    }
    // A memory file that cannot be sealed against shrinking: refused.
    let plain =
        nix::sys::memfd::memfd_create(c"plain", nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC)
            .unwrap();
    nix::unistd::ftruncate(&plain, 4096).unwrap();
    dma_map(&s, 60, std::os::fd::AsFd::as_fd(&plain), base << 8, 4096);
    refused(&mut s, 60, 2, Errno::EINVAL);
    drop(s);
    let log = srv.expect_end("node 0: client 6 ");
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

#[test]
fn completion_events_wrap_the_event_queue_without_a_round_trip_each() {
    // Each completion of an armed CQ is an EQE. The EQ (128 entries) wraps twice; the
    // consumer index goes back to a served NIC in batches, not one message per event.
    use ringbell::{RemoteAddr, SendFlags, SendWr, WrOp};
    use ringbell_specs::cqe::EventType;
    let srv = Server::start("eqci", 2);
    let mut t = Two::connect(&srv, 4096);
    let remote = RemoteAddr {
        addr: t.mb.addr(),
        rkey: t.mb.rkey(),
    };
    let rounds = 300u64;
    let mut wc = [WorkCompletion::default(); 1];
    for i in 0..rounds {
        t.ca.arm(false);
        t.qa.post_send(&[
            SendWr::new(i, WrOp::Write(remote), &[t.ma.sge(0, 8)]).flags(SendFlags::SIGNALED)
        ])
        .unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        let e = loop {
            if let Some(e) = t.a.poll_event() {
                break e;
            }
            assert!(Instant::now() < end, "round {i}: no completion event");
            t.a.wait_interrupt(Duration::from_millis(10)).unwrap();
        };
        assert_eq!(
            (e.kind, e.obj),
            (EventType::Completion, t.ca.cqn()),
            "round {i}"
        );
        while t.ca.poll_ready(&mut wc) == 0 {
            assert!(Instant::now() < end, "round {i}: no completion");
        }
        assert_eq!((wc[0].wr_id, wc[0].status), (i, WcStatus::Success));
    }
    drop(t);
    let (messages, end) = srv.messages_of("node 0: client 1");
    // One BlueFlame store per post and set-up (about 360 in all); the index written back
    // at every event would add 300.
    assert!(
        messages < rounds * 3 / 2,
        "{messages} messages for {rounds} events: {end}"
    );
    eprintln!("{messages} messages for {rounds} completion events");
}

#[test]
fn device_memory_works_over_vfio_user() {
    use ringbell::{Access, RemoteAddr, SendWr, WrOp};
    let srv = Server::start("dm", 2);
    let mut t = Two::connect(&srv, 4096);
    assert_eq!(t._b.caps().max_dm_size, 128 << 10);
    // A device in another process cannot reach this one's memory on demand.
    assert!(!t._b.on_demand());
    let dm = t._b.alloc_dm(2048, 6).unwrap();
    // Bursts and single words through the BAR window, each a REGION_WRITE.
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 1) as u8).collect();
    dm.write(0, &data).unwrap();
    let mut got = vec![0u8; 1000];
    dm.read(0, &mut got).unwrap();
    assert_eq!(got, data);
    let mr = t
        ._pds
        .1
        .reg_dm_mr(&dm, 1024, 1024, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    t.ba.write(0, b"into device memory").unwrap();
    let remote = RemoteAddr {
        addr: 16,
        rkey: mr.rkey(),
    };
    t.qa.post_send(&[SendWr::new(3, WrOp::Write(remote), &[t.ma.sge(0, 18)])])
        .unwrap();
    let mut wc = [WorkCompletion::default(); 1];
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while t.ca.poll(&mut wc) == 0 {
        assert!(std::time::Instant::now() < until, "no completion");
    }
    assert_eq!((wc[0].wr_id, wc[0].status), (3, WcStatus::Success));
    let mut back = [0u8; 20];
    dm.read(1024 + 16, &mut back).unwrap();
    assert_eq!(&back[..18], b"into device memory");
    assert!(dm.in_use());
    drop(mr);
    assert!(!dm.in_use());
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
    srv.expect_end("node 0: client");
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
    srv.expect_end("node 0: client");
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

/// Sends a header that announces `size` bytes, then up to `extra` bytes of filler, ignoring
/// a write the server refuses once it has closed.
fn announce(s: &mut UnixStream, id: u16, cmd: u16, size: u32, extra: usize) {
    let _ = s.write_all(&header(id, cmd, size));
    let chunk = [b'a'; 4096];
    let mut left = extra;
    while left > 0 {
        let n = left.min(chunk.len());
        if s.write_all(&chunk[..n]).is_err() {
            break;
        }
        left -= n;
    }
}

/// The attacks of a hostile client on node 0, each checked for its reply and for the
/// server's memory, while two other processes run traffic on nodes 1 and 2.
#[test]
fn hostile_messages_cost_the_server_no_memory_while_other_clients_run() {
    let srv = Server::start("hostile", 3);
    let (a, b) = pair(&srv, 1, 2, "rc", 300, 65536);
    b.line("rb-progress");
    let path = srv.socket(0);
    let (_, peak0) = srv.rss_kib();
    let peak = |what: &str| {
        let (rss, hwm) = srv.rss_kib();
        eprintln!("after {what}: server RSS {rss} KiB, peak {hwm} KiB");
        hwm
    };

    // REGION_READ of 4 GiB - 1 bytes: E2BIG, and the connection goes on.
    let mut s = connect(&path);
    version(&mut s);
    region_access(&mut s, 1, false, 0, 0, u32::MAX);
    refused(&mut s, 1, 9, Errno::E2BIG);
    peak("REGION_READ of 4 GiB - 1");
    // A REGION_READ whose message is smaller than its fields: EINVAL, and on it goes.
    announce(&mut s, 2, 9, 20, 4);
    refused(&mut s, 2, 9, Errno::EINVAL);
    // A header that announces less than itself cannot be followed: EINVAL, closed.
    announce(&mut s, 3, 9, 15, 0);
    refused(&mut s, 3, 9, Errno::EINVAL);
    closed(&mut s);

    // REGION_WRITE announcing 4 GiB, 8 MiB of it sent: E2BIG on the header, closed.
    let mut s = connect(&path);
    version(&mut s);
    announce(&mut s, 3, 10, u32::MAX, 8 << 20);
    refused(&mut s, 3, 10, Errno::E2BIG);
    closed(&mut s);
    peak("REGION_WRITE of 4 GiB");

    // VERSION announcing 64 MiB of capabilities with no NUL: E2BIG, closed, nothing read.
    let mut s = connect(&path);
    announce(&mut s, 4, 1, 64 << 20, 4 << 20);
    refused(&mut s, 4, 1, Errno::E2BIG);
    closed(&mut s);
    // One that fits but has no NUL: EINVAL, closed.
    let mut s = connect(&path);
    let mut m = header(5, 1, 4000);
    m.extend_from_slice(&[0, 0, 1, 0]);
    m.extend(std::iter::repeat_n(b'{', 4000 - 20));
    s.write_all(&m).unwrap();
    refused(&mut s, 5, 1, Errno::EINVAL);
    closed(&mut s);
    peak("VERSION of 64 MiB");

    // 5000 unknown commands of 4 KiB each (20 MB): each skipped with ENOTSUP, in step.
    let mut s = connect(&path);
    version(&mut s);
    let mut m = header(0, 200, 4096);
    m.resize(4096, 0x5A);
    for i in 0..5000u16 {
        m[0..2].copy_from_slice(&i.to_le_bytes());
        s.write_all(&m).unwrap();
        refused(&mut s, i, 200, Errno::ENOTSUP);
    }
    region_access(&mut s, 9, false, 0, ringbell_specs::regs::MAGIC, 4);
    assert_eq!(read_reply(&mut s).flags & ERROR, 0, "out of step");
    drop(s);
    peak("5000 unknown commands");
    // The log holds 65 lines of them, not 5000, and their count.
    let mut lines = 0;
    let end = loop {
        let l = srv
            .log
            .recv_timeout(Duration::from_secs(20))
            .expect("the end of client 5");
        if l.contains("node 0: client 5 ") {
            if l.contains("NIC reset") {
                break l;
            }
            lines += usize::from(l.contains("refused command 200"));
        }
    };
    assert_eq!(lines, 65, "refusal lines logged");
    assert!(end.contains("(5002 messages, 5000 refused"), "{end}");

    // 200 connections that hang up in the middle of a message.
    for i in 0..200u16 {
        let mut s = connect(&path);
        version(&mut s);
        announce(&mut s, i, 10, 4096, 1000);
    }
    let last = peak("200 half messages");

    assert!(
        last < peak0 + 16 * 1024,
        "the server's peak RSS grew from {peak0} KiB to {last} KiB"
    );
    ok(a, "initiator during the attacks");
    ok(b, "target during the attacks");
    let mut srv = srv;
    assert!(srv.alive());
}

/// A blocking eventfd filled to its limit (or a pipe) as the interrupt cannot stall the
/// fabric, the other NICs or, for more than a moment, the client's own NIC.
#[test]
fn a_full_blocking_eventfd_or_a_pipe_cannot_stall_anyone() {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    use ringbell::{RemoteAddr, SendWr, WrOp};
    use std::os::fd::AsRawFd;
    let srv = Server::start("irqfd", 5);
    let (c, d) = pair(&srv, 2, 3, "rc", 200, 4096);

    // A pipe as the interrupt descriptor: EINVAL.
    let mut s = connect(&srv.socket(4));
    version(&mut s);
    let (rd, wr) = nix::unistd::pipe().unwrap();
    let mut m = header(7, 8, 16 + 20);
    for v in [20u32, (1 << 2) | (1 << 5), 2, 0, 1] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    let fds = [wr.as_raw_fd()];
    nix::sys::socket::sendmsg::<()>(
        s.as_raw_fd(),
        &[std::io::IoSlice::new(&m)],
        &[nix::sys::socket::ControlMessage::ScmRights(&fds)],
        nix::sys::socket::MsgFlags::empty(),
        None,
    )
    .unwrap();
    refused(&mut s, 7, 8, Errno::EINVAL);
    assert!(srv
        .expect_log("refused DEVICE_SET_IRQS #7")
        .contains("not an eventfd"));
    drop((s, rd, wr));

    // Node 0's client makes its own eventfd blocking and fills it to the limit, then makes
    // its NIC interrupt.
    let mut t = Two::connect(&srv, 4096);
    let fd = t.a.port().interrupt_fd(0).unwrap();
    fcntl(fd.as_raw_fd(), FcntlArg::F_SETFL(OFlag::empty())).unwrap();
    nix::unistd::write(fd, &0xFFFF_FFFF_FFFF_FFFEu64.to_ne_bytes()).unwrap();
    t.ca.arm(false);
    t.ba.write(0, b"irq").unwrap();
    let remote = RemoteAddr {
        addr: t.mb.addr(),
        rkey: t.mb.rkey(),
    };
    t.qa.post_send(&[SendWr::new(1, WrOp::Write(remote), &[t.ma.sge(0, 3)])])
        .unwrap();
    let log = srv.expect_log("interrupt eventfd dropped");
    assert!(log.contains("node 0: client"), "{log}");
    // The completion came, and node 0 still answers commands.
    let mut wc = [WorkCompletion::default(); 1];
    let deadline = Instant::now() + Duration::from_secs(20);
    while t.ca.poll(&mut wc) == 0 {
        assert!(Instant::now() < deadline, "no completion");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::Success));
    assert!(t.a.alloc_pd().is_ok());
    ok(c, "initiator beside the full eventfd");
    ok(d, "target beside the full eventfd");
    let (rss, hwm) = srv.rss_kib();
    eprintln!("full blocking eventfd: server RSS {rss} KiB, peak {hwm} KiB");
}

/// Each client holds at most its share of DMA mappings; the next is refused with ENOSPC and
/// another NIC's client maps as usual.
#[test]
fn dma_mappings_are_bounded_per_client() {
    let srv = Server::start_with("maps", 2, &["--max-dma-maps", "64"]);
    let mut s = connect(&srv.socket(0));
    let caps = b"{\"capabilities\":{\"max_msg_fds\":1}}\0";
    let mut m = header(1, 1, 20 + caps.len() as u32);
    m.extend_from_slice(&[0, 0, 1, 0]);
    m.extend_from_slice(caps);
    s.write_all(&m).unwrap();
    let r = read_reply(&mut s);
    let json = String::from_utf8_lossy(&r.payload[4..]).to_string();
    assert!(json.contains("\"max_dma_maps\":64"), "{json}");
    let mem = ringbell::DmaMemory::new(4096).unwrap();
    for i in 0..64u16 {
        dma_map(
            &s,
            i,
            mem.fd().unwrap(),
            (1 << 32) + u64::from(i) * 8192,
            4096,
        );
        let r = read_reply(&mut s);
        assert_eq!((r.id, r.flags & ERROR), (i, 0));
    }
    dma_map(&s, 64, mem.fd().unwrap(), 1 << 40, 4096);
    refused(&mut s, 64, 2, Errno::ENOSPC);
    assert!(srv
        .expect_log("refused DMA_MAP #64")
        .contains("holds 64 DMA mappings"));
    // Node 1's client is not affected.
    let dev = Device::open(Box::new(VfioPort::connect(srv.socket(1)).unwrap())).unwrap();
    let buf = dev.alloc_dma(4096).unwrap();
    drop((buf, dev));
    drop(s);
    let log = srv.expect_end("node 0: client 1 ");
    assert!(log.contains("64 DMA mappings reclaimed"), "{log}");
    let (rss, hwm) = srv.rss_kib();
    eprintln!("65 DMA_MAPs: server RSS {rss} KiB, peak {hwm} KiB");
}

/// A client that sends nothing, half a message, or nothing more for too long is closed
/// after its timeout; it blocks nobody meanwhile, and its NIC serves the next client.
#[test]
fn silent_slow_and_idle_clients_are_closed_and_block_no_one() {
    let srv = Server::start_with("slow", 3, &["--client-timeout", "1", "--idle-timeout", "2"]);
    let (a, b) = pair(&srv, 1, 2, "rc", 200, 4096);
    let path = srv.socket(0);
    // Silent from the start.
    let mut s = connect(&path);
    let log = srv.expect_end("node 0: client 1 ");
    assert!(log.contains("closed: it sent no VERSION for 1s"), "{log}");
    closed(&mut s);
    // Half a message.
    let mut s = connect(&path);
    version(&mut s);
    s.write_all(&header(2, 9, 32)[..10]).unwrap();
    let log = srv.expect_end("node 0: client 2 ");
    assert!(
        log.contains("closed: it left a message unfinished for 1s"),
        "{log}"
    );
    closed(&mut s);
    // Idle after VERSION.
    let mut s = connect(&path);
    version(&mut s);
    let log = srv.expect_end("node 0: client 3 ");
    assert!(log.contains("closed: it was idle for 2s"), "{log}");
    closed(&mut s);
    // The NIC serves the next client, which may pause for longer than the client timeout
    // (but less than the idle timeout) between messages.
    let mut s = connect(&path);
    version(&mut s);
    region_access(&mut s, 3, false, 0, ringbell_specs::regs::MAGIC, 4);
    assert_eq!(read_reply(&mut s).flags & ERROR, 0);
    std::thread::sleep(Duration::from_millis(1500));
    region_access(&mut s, 4, false, 0, ringbell_specs::regs::MAGIC, 4);
    let r = read_reply(&mut s);
    assert_eq!(
        (r.id, r.flags & ERROR),
        (4, 0),
        "a pause was taken for a stall"
    );
    ok(a, "initiator beside the slow clients");
    ok(b, "target beside the slow clients");
    let (rss, hwm) = srv.rss_kib();
    eprintln!("silent, slow and idle clients: server RSS {rss} KiB, peak {hwm} KiB");
}

/// A client that stores into its doorbells as fast as it can does not starve the other
/// NICs' simulation.
#[test]
fn a_client_flooding_doorbells_does_not_starve_the_other_nics() {
    use ringbell::QpInit;
    use ringbell_specs::regs;
    let mut srv = Server::start("flood", 3);
    let (mut a, mut b) = pair(&srv, 1, 2, "rc", 200, 4096);
    let dev = Device::open(Box::new(VfioPort::connect(srv.socket(0)).unwrap())).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(16).unwrap();
    let qp = pd.create_qp(&QpInit::new(&cq, &cq)).unwrap();
    let cq_db = regs::CQ_DB_BASE + u64::from(cq.cqn()) * regs::DB_STRIDE;
    let qp_db = regs::QP_DB_BASE + u64::from(qp.qpn()) * regs::DB_STRIDE;
    let mut stores = 0u64;
    let done = |p: &mut Peer| p.proc.0.try_wait().unwrap().is_some();
    let deadline = Instant::now() + Duration::from_secs(90);
    while !(done(&mut a) && done(&mut b)) {
        assert!(Instant::now() < deadline, "the pair never finished");
        for i in 0..1000u32 {
            dev.port().write32(cq_db + regs::DB_CQ_CI, i);
            dev.port().write32(cq_db + regs::DB_CQ_ARM, i);
            dev.port().write32(qp_db + regs::DB_SQ, i);
            dev.port().write32(qp_db + regs::DB_RQ, i);
        }
        stores += 4000;
    }
    eprintln!("{stores} doorbell stores while the pair ran");
    ok(a, "initiator beside the flood");
    ok(b, "target beside the flood");
    assert!(srv.alive());
    assert!(
        dev.alloc_pd().is_ok(),
        "the flooding client's NIC still answers"
    );
    let (rss, hwm) = srv.rss_kib();
    eprintln!("doorbell flood: server RSS {rss} KiB, peak {hwm} KiB");
}

/// A driver whose server stops answering gets a typed error instead of hanging, and every
/// later command fails at once.
#[test]
fn a_driver_whose_server_stops_answering_fails_with_a_typed_error() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let srv = Server::start("stopped", 1);
    let port = VfioPort::connect_with(srv.socket(0), Duration::from_millis(500)).unwrap();
    let dev = Device::open(Box::new(port)).unwrap();
    assert!(dev.alloc_pd().is_ok());
    let pid = Pid::from_raw(srv.proc.0.id() as i32);
    kill(pid, Signal::SIGSTOP).unwrap();
    let r = dev.alloc_pd();
    kill(pid, Signal::SIGCONT).unwrap();
    match r {
        Err(ringbell::Error::DeviceLost(why)) => assert!(why.contains("in time"), "{why}"),
        other => panic!("{other:?}"),
    }
    // The server is back, but the connection is not: later calls fail at once.
    assert!(matches!(
        dev.port_stats(),
        Err(ringbell::Error::DeviceLost(_))
    ));
    assert!(dev.lost().is_some());
}

/// The sender of `what_a_client_posts_just_before_it_exits_still_goes_out`, in a process of
/// its own (this test binary run again): on the NIC at `socket`, a UD SEND of `LAST_WORDS`
/// to QP `qpn` of 10.0.0.2, posted, and the process gone at once (no destroy, no completion
/// awaited, as a program that sends its last datagram and returns from `main`).
fn send_and_exit(spec: &str) -> ! {
    use ringbell::{AhAttr, QpInit, QpType, SendWr, UdDest, WrOp};
    let (socket, qpn) = spec.split_once(' ').expect("socket and QPN");
    let qpn: u32 = qpn.parse().expect("a QPN");
    let a = Device::open(Box::new(VfioPort::connect(socket).unwrap())).unwrap();
    let pd = a.alloc_pd().unwrap();
    let cq = a.create_cq(16).unwrap();
    let mut init = QpInit::new(&cq, &cq);
    init.qp_type = QpType::Ud;
    init.max_inline = LAST_WORDS.len() as u32;
    let mut qp = pd.create_qp(&init).unwrap();
    qp.ud_ready(EXIT_QKEY, 0).unwrap();
    let ah = pd
        .create_ah(&AhAttr::on_fabric([10, 0, 0, 2]).unwrap())
        .unwrap();
    let to = UdDest {
        ah: &ah,
        qpn,
        qkey: EXIT_QKEY,
    };
    qp.post_send(&[SendWr::inline(1, WrOp::Send, LAST_WORDS).to(to)])
        .unwrap();
    // Ends the process at once (exit(3): no destructor of this frame runs, nothing is
    // destroyed or awaited); the connection closes with it.
    std::process::exit(0)
}

const LAST_WORDS: &[u8] = b"sent just before exit";
const EXIT_QKEY: u32 = 0x1234;

#[test]
fn what_a_client_posts_just_before_it_exits_still_goes_out() {
    use ringbell::{Access, QpInit, QpType, RecvWr};
    if let Ok(spec) = std::env::var("RINGBELL_TEST_SEND_AND_EXIT") {
        send_and_exit(&spec);
    }
    let srv = Server::start("exit", 2);
    for round in 0..10 {
        let b = Device::open(Box::new(VfioPort::connect(srv.socket(1)).unwrap())).unwrap();
        let pd = b.alloc_pd().unwrap();
        let buf = b.alloc_dma(4096).unwrap();
        let mr = pd.reg_mr(&buf, Access::LOCAL_WRITE).unwrap();
        let mut cq = b.create_cq(16).unwrap();
        let mut init = QpInit::new(&cq, &cq);
        init.qp_type = QpType::Ud;
        let mut qp = pd.create_qp(&init).unwrap();
        qp.ud_ready(EXIT_QKEY, 0).unwrap();
        qp.post_recv(&[RecvWr {
            wr_id: 7,
            sgl: &[mr.sge(0, 4096)],
        }])
        .unwrap();
        let status = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "what_a_client_posts_just_before_it_exits_still_goes_out",
                "--nocapture",
            ])
            .env(
                "RINGBELL_TEST_SEND_AND_EXIT",
                format!("{} {}", srv.socket(0).display(), qp.qpn()),
            )
            .status()
            .unwrap();
        assert!(
            status.success(),
            "round {round}: the sender failed: {status}"
        );
        let mut wc = [WorkCompletion::default(); 1];
        let end = Instant::now() + Duration::from_secs(10);
        while cq.poll(&mut wc) == 0 {
            assert!(
                Instant::now() < end,
                "round {round}: the datagram posted before the sender's exit never came"
            );
        }
        assert_eq!((wc[0].wr_id, wc[0].status), (7, WcStatus::Success));
        let n = LAST_WORDS.len();
        assert_eq!(wc[0].byte_len as usize, ringbell::GRH_LEN + n);
        let mut got = vec![0u8; n];
        buf.read(ringbell::GRH_LEN, &mut got).unwrap();
        assert_eq!(got, LAST_WORDS, "round {round}");
    }
}

#[test]
fn a_connection_manager_waiting_on_a_timer_does_not_read_the_clock_at_every_poll() {
    // Each read of a served NIC's clock is two messages to the server. A CM whose only
    // timer is a second away needs no reading until then, however often it is polled.
    use ringbell::cm::{CmConfig, ConnectionManager};
    use ringbell::{AhAttr, ConnectOptions, QpInit};
    let srv = Server::start("cmclock", 2);
    let dev = Device::open(Box::new(VfioPort::connect(srv.socket(0)).unwrap())).unwrap();
    let cfg = CmConfig {
        timeout_ps: 1_000_000_000_000,
        ..CmConfig::default()
    };
    let mut cm = ConnectionManager::with_config(&dev, cfg).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(16).unwrap();
    let qp = pd.create_qp(&QpInit::new(&cq, &cq)).unwrap();
    // NIC 1 has no CM: the REQ goes unanswered, and its repeat is the only timer.
    let peer = AhAttr::on_fabric([10, 0, 0, 2]).unwrap();
    cm.connect(peer, 7, qp, &ConnectOptions::default(), &[])
        .unwrap();
    let polls = 5000;
    let start = Instant::now();
    for _ in 0..polls {
        assert!(cm.poll_nowait().is_none());
    }
    let took = start.elapsed();
    drop(cm);
    drop(pd);
    drop(cq);
    drop(dev);
    let (messages, end) = srv.messages_of("node 0: client 1");
    // Set-up and teardown take a few dozen messages; a clock read per poll would be 10,000.
    // Polls that ran past the timer (a slow machine) read it until it fires again 2 s on.
    assert!(
        messages < 1000,
        "{messages} messages for {polls} polls in {took:?}: {end}"
    );
}
