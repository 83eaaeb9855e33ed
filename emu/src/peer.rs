//! One process of a two-process RDMA job against a served NIC (`ringbell-emu peer`): it
//! connects to a socket of `ringbell-emu serve` through the driver's vfio-user backend,
//! connects an RC QP to the other process through connection management
//! ([`ringbell::cm`]: the target listens on a service id, the initiator connects to the
//! target NIC's IPv4 address; nothing is exchanged out of band) and runs checked traffic.
//! Two modes:
//! - `rc`: the initiator RDMA-WRITEs a pattern into the target's buffer (whose address and
//!   rkey came in the REP's private data), then SENDs with the iteration as immediate; the
//!   target checks the bytes the WRITE put there before it saw the SEND (RC ordering) and
//!   answers with a SEND, so the initiator may reuse the slot;
//! - `tag`: tagged messages through the software tag-matching layer over a TM-SRQ, eager and
//!   rendezvous (the NIC reads the data, then sends the FIN) alternating; the target checks
//!   every byte and answers each message with an empty tagged one.
//!
//! The lines on stdout: `rb-listening IP SERVICE` (target), `rb-connected IP QPN` once the
//! QP is in RTS (both), `rb-progress N` every 16 iterations, then `rb-ok N BYTES`. Failures
//! go to stderr, with a non-zero exit.

use ringbell::cm::{CmEvent, ConnectionManager, REJ_CONSUMER};
use ringbell::tagmatch::{TagConfig, TagEvent, TagMatcher};
use ringbell::{Access, QpState};
use ringbell::{
    AhAttr, ConnectOptions, Device, QpInit, QueuePair, RecvWr, RemoteAddr, SendWr, VfioPort,
    WcStatus, WorkCompletion, WrOp,
};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Which side of the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Sends the data.
    Initiator,
    /// Receives and checks it.
    Target,
}

/// The traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// RDMA WRITE then SEND with immediate, answered by a SEND.
    Rc,
    /// Tagged messages, eager and rendezvous.
    Tag,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct PeerConfig {
    /// The node's socket (`DIR/nicN.sock`).
    pub socket: PathBuf,
    /// Side.
    pub role: Role,
    /// The target NIC's IPv4 address (the initiator connects to it).
    pub peer: Option<[u8; 4]>,
    /// The service id the target listens on and the initiator connects to.
    pub service_id: u64,
    /// Traffic.
    pub mode: Mode,
    /// Iterations.
    pub count: u32,
    /// Bytes per message (rc), or of the rendezvous messages (tag; eager ones are 256 B).
    pub size: u32,
    /// Give up after this long (wall time).
    pub deadline: Duration,
    /// Give up when one wait for a completion lasts this long (wall time): the peer, or its
    /// NIC, is gone.
    pub stall: Duration,
}

/// The pattern of iteration `i`.
fn pattern(i: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| (k as u32).wrapping_mul(31).wrapping_add(i.wrapping_mul(7)) as u8)
        .collect()
}

/// The default service id of the job ("rb-peer").
pub const DEFAULT_SERVICE_ID: u64 = 0x0072_622d_7065_6572;

/// Parses a dotted IPv4 address.
pub fn parse_ip(s: &str) -> Result<[u8; 4], String> {
    let addr: std::net::Ipv4Addr = s
        .parse()
        .map_err(|_| format!("not an IPv4 address: {s:?}"))?;
    Ok(addr.octets())
}

fn fmt_ip(ip: [u8; 4]) -> String {
    std::net::Ipv4Addr::from(ip).to_string()
}

/// Runs one side. Returns the bytes checked (target) or sent (initiator).
pub fn run_peer(cfg: &PeerConfig, mut out: impl Write) -> Result<u64, String> {
    let port = VfioPort::connect(&cfg.socket).map_err(|e| e.to_string())?;
    let dev = Device::open(Box::new(port)).map_err(|e| e.to_string())?;
    let start = Instant::now();
    let bytes = match cfg.mode {
        Mode::Rc => rc(cfg, &dev, &mut out, start)?,
        Mode::Tag => tag(cfg, &dev, &mut out, start)?,
    };
    writeln!(out, "rb-ok {} {bytes}", cfg.count).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    Ok(bytes)
}

/// Connection options of the job (rendezvous needs READ credits both ways).
fn options() -> ConnectOptions {
    ConnectOptions {
        max_rd_atomic: 4,
        max_dest_rd_atomic: 4,
        ..ConnectOptions::default()
    }
}

/// Connects `qp` through the CM: the target listens and accepts the first request with
/// `private` as the REP's private data; the initiator connects to `cfg.peer`. Returns the
/// QP in RTS and the peer's private data.
fn cm_connect(
    cfg: &PeerConfig,
    dev: &Device,
    qp: QueuePair,
    private: &[u8],
    out: &mut impl Write,
    start: Instant,
) -> Result<(QueuePair, Vec<u8>), String> {
    let e = |e: ringbell::Error| e.to_string();
    let mut cm = ConnectionManager::new(dev).map_err(e)?;
    let mut qp = Some(qp);
    match cfg.role {
        Role::Target => {
            cm.listen(cfg.service_id).map_err(e)?;
            say(
                out,
                &format!(
                    "rb-listening {} {:#x}",
                    fmt_ip(cm.address().ip),
                    cfg.service_id
                ),
            )?;
        }
        Role::Initiator => {
            let ip = cfg.peer.ok_or("the initiator needs --peer IP")?;
            let to = AhAttr::on_fabric(ip)
                .ok_or_else(|| format!("{} is no ringbell fabric address", fmt_ip(ip)))?;
            let q = qp.take().ok_or("no QP")?;
            cm.connect(to, cfg.service_id, q, &options(), private)
                .map_err(e)?;
        }
    }
    let since = Instant::now();
    loop {
        match cm.poll() {
            Some(CmEvent::ConnectRequest { id, .. }) => match qp.take() {
                Some(q) => cm.accept(id, q, &options(), private).map_err(e)?,
                None => cm.reject(id, REJ_CONSUMER, &[]).map_err(e)?,
            },
            Some(CmEvent::Established { qp, private, .. }) => {
                say(
                    out,
                    &format!("rb-connected {} {}", fmt_ip(cm.address().ip), qp.qpn()),
                )?;
                if qp.state() != QpState::Rts {
                    return Err(format!("connected QP in {:?}", qp.state()));
                }
                return Ok((qp, private));
            }
            Some(CmEvent::Rejected { reason, .. }) => {
                return Err(format!(
                    "the peer rejected the connection (reason {reason})"
                ))
            }
            Some(CmEvent::TimedOut { .. }) => {
                return Err("the peer never answered the connection request".into())
            }
            Some(ev) => return Err(format!("unexpected {ev:?}")),
            None => check_deadline(cfg, start, since, 0)?,
        }
    }
}

fn say(out: &mut impl Write, line: &str) -> Result<(), String> {
    writeln!(out, "{line}")
        .and_then(|_| out.flush())
        .map_err(|e| e.to_string())
}

fn check_deadline(
    cfg: &PeerConfig,
    start: Instant,
    since: Instant,
    done: u32,
) -> Result<(), String> {
    if start.elapsed() > cfg.deadline {
        return Err(format!(
            "timed out after {done} of {} iterations ({:?})",
            cfg.count, cfg.deadline
        ));
    }
    if since.elapsed() > cfg.stall {
        return Err(format!(
            "stalled: nothing completed for {:?}, after {done} of {} iterations",
            cfg.stall, cfg.count
        ));
    }
    Ok(())
}

fn rc(cfg: &PeerConfig, dev: &Device, out: &mut impl Write, start: Instant) -> Result<u64, String> {
    let e = |e: ringbell::Error| e.to_string();
    let size = cfg.size.max(1) as usize;
    let pd = dev.alloc_pd().map_err(e)?;
    let buf = dev.alloc_dma(size).map_err(e)?;
    let mr = pd
        .reg_mr(&buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .map_err(e)?;
    let mut cq = dev.create_cq(64).map_err(e)?;
    let qp = pd.create_qp(&QpInit::new(&cq, &cq)).map_err(e)?;
    // The target's buffer travels in the REP: address then rkey, little-endian.
    let mut mine = mr.addr().to_le_bytes().to_vec();
    mine.extend_from_slice(&mr.rkey().to_le_bytes());
    let (mut qp, theirs) = cm_connect(cfg, dev, qp, &mine, out, start)?;
    let remote = match (cfg.role, theirs.get(..12)) {
        (Role::Initiator, Some(b)) => RemoteAddr {
            addr: u64::from_le_bytes(b[..8].try_into().unwrap_or_default()),
            rkey: u32::from_le_bytes(b[8..12].try_into().unwrap_or_default()),
        },
        (Role::Initiator, None) => return Err("the REP carried no buffer".into()),
        (Role::Target, _) => RemoteAddr::default(),
    };
    let mut wc = [WorkCompletion::default(); 4];
    let mut wait =
        |cq: &mut ringbell::CompletionQueue, done: u32| -> Result<WorkCompletion, String> {
            let since = Instant::now();
            loop {
                if cq.poll(&mut wc[..1]) == 1 {
                    if wc[0].status != WcStatus::Success {
                        return Err(format!(
                            "work request {} completed with {:?}",
                            wc[0].wr_id, wc[0].status
                        ));
                    }
                    return Ok(wc[0]);
                }
                check_deadline(cfg, start, since, done)?;
            }
        };
    let mut bytes = 0u64;
    let recv = |qp: &mut ringbell::QueuePair, i: u32| {
        qp.post_recv(&[RecvWr {
            wr_id: i as u64,
            sgl: &[],
        }])
    };
    if cfg.role == Role::Target && cfg.count > 0 {
        recv(&mut qp, 0).map_err(e)?;
    }
    for i in 0..cfg.count {
        // The initiator waits for each answer before it overwrites the slot.
        if cfg.role == Role::Initiator {
            recv(&mut qp, i).map_err(e)?;
            buf.write(0, &pattern(i, size)).map_err(e)?;
            let sge = [mr.sge(0, size as u32)];
            qp.post_send(&[
                SendWr::new(1, WrOp::Write(remote), &sge),
                SendWr::new(2, WrOp::SendImm(i), &[]),
            ])
            .map_err(e)?;
            let mut got = 0;
            while got < 3 {
                wait(&mut cq, i)?;
                got += 1;
            }
            bytes += size as u64;
        } else {
            let c = wait(&mut cq, i)?;
            if c.imm != Some(i) {
                return Err(format!("SEND {:?} arrived as iteration {i}", c.imm));
            }
            let mut got = vec![0u8; size];
            buf.read(0, &mut got).map_err(e)?;
            if got != pattern(i, size) {
                return Err(format!("iteration {i}: the WRITE's bytes are wrong"));
            }
            bytes += size as u64;
            // The next receive is there before the answer lets the initiator go on.
            if i + 1 < cfg.count {
                recv(&mut qp, i + 1).map_err(e)?;
            }
            qp.post_send(&[SendWr::new(3, WrOp::SendImm(i), &[])])
                .map_err(e)?;
            wait(&mut cq, i)?;
        }
        if (i + 1) % 16 == 0 {
            say(out, &format!("rb-progress {}", i + 1))?;
        }
    }
    Ok(bytes)
}

/// Bytes of an eager tagged message.
const EAGER: u32 = 256;

fn tag(
    cfg: &PeerConfig,
    dev: &Device,
    out: &mut impl Write,
    start: Instant,
) -> Result<u64, String> {
    let e = |e: ringbell::Error| e.to_string();
    let big = cfg.size.max(EAGER + 1);
    let mut tm = TagMatcher::new(
        dev,
        TagConfig {
            user_bytes: big as usize,
            ..TagConfig::default()
        },
    )
    .map_err(e)?;
    let qp = tm.create_conn_qp().map_err(e)?;
    let (qp, _) = cm_connect(cfg, dev, qp, &[], out, start)?;
    let conn = tm.add_connected(qp).map_err(e)?;
    let len_of = |i: u32| if i.is_multiple_of(2) { EAGER } else { big };
    let next_event = |tm: &mut TagMatcher, done: u32| -> Result<TagEvent, String> {
        let since = Instant::now();
        loop {
            if let Some(ev) = tm.next_event() {
                if let TagEvent::Failed { id, status } = ev {
                    return Err(format!("tagged operation {id} failed: {status:?}"));
                }
                return Ok(ev);
            }
            tm.progress().map_err(e)?;
            check_deadline(cfg, start, since, done)?;
        }
    };
    let mut bytes = 0u64;
    for i in 0..cfg.count {
        let len = len_of(i);
        let tag = 0x7a00_0000_0000 | i as u64;
        if cfg.role == Role::Initiator {
            tm.user().write(0, &pattern(i, len as usize)).map_err(e)?;
            tm.recv(2 * i as u64 + 1, tag, u64::MAX, 0, 0).map_err(e)?;
            tm.send(2 * i as u64, conn, tag, 0, len).map_err(e)?;
            // Both the send's completion and the answer.
            for _ in 0..2 {
                next_event(&mut tm, i)?;
            }
        } else {
            tm.recv(i as u64, tag, u64::MAX, 0, len).map_err(e)?;
            match next_event(&mut tm, i)? {
                TagEvent::Recv {
                    len: got,
                    truncated: false,
                    ..
                } if got == len => {}
                other => return Err(format!("iteration {i}: {other:?}")),
            }
            let mut got = vec![0u8; len as usize];
            tm.user().read(0, &mut got).map_err(e)?;
            if got != pattern(i, len as usize) {
                return Err(format!(
                    "iteration {i}: the tagged message's bytes are wrong"
                ));
            }
            tm.send(1 << 40 | i as u64, conn, tag, 0, 0).map_err(e)?;
            next_event(&mut tm, i)?;
        }
        bytes += len as u64;
        if (i + 1) % 16 == 0 {
            say(out, &format!("rb-progress {}", i + 1))?;
        }
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ip_addresses_parse_and_bad_ones_are_refused() {
        assert_eq!(parse_ip("10.0.0.2"), Ok([10, 0, 0, 2]));
        assert_eq!(fmt_ip([10, 0, 1, 7]), "10.0.1.7");
        for bad in ["", "10.0.0", "10.0.0.256", "ten.0.0.1", "10.0.0.1 "] {
            assert!(parse_ip(bad).is_err(), "{bad:?}");
        }
    }
}
