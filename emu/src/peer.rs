//! One process of a two-process RDMA job against a served NIC (`ringbell-emu peer`): it
//! connects to a socket of `ringbell-emu serve` through the driver's vfio-user backend,
//! prints its endpoint line, reads the other process's line, connects an RC QP and runs
//! checked traffic. Two modes:
//! - `rc`: the initiator RDMA-WRITEs a pattern into the target's buffer, then SENDs with the
//!   iteration as immediate; the target checks the bytes the WRITE put there before it saw
//!   the SEND (RC ordering) and answers with a SEND, so the initiator may reuse the slot;
//! - `tag`: tagged messages through the software tag-matching layer over a TM-SRQ, eager and
//!   rendezvous (the NIC reads the data, then sends the FIN) alternating; the target checks
//!   every byte and answers each message with an empty tagged one.
//!
//! The line protocol on stdout: `rb-endpoint QPN PSN MAC IP ADDR RKEY`, then
//! `rb-progress N` every 16 iterations, then `rb-ok N BYTES`. Failures go to stderr, with a
//! non-zero exit.

use ringbell::tagmatch::{TagConfig, TagEvent, TagMatcher};
use ringbell::{
    Access, ConnectOptions, Device, Endpoint, QpInit, RecvWr, RemoteAddr, SendWr, VfioPort,
    WcStatus, WorkCompletion, WrOp,
};
use std::io::{BufRead, Write};
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

fn fmt_endpoint(ep: &Endpoint, addr: u64, rkey: u32) -> String {
    let mac: String = ep.mac.iter().map(|b| format!("{b:02x}")).collect();
    let ip: String = ep.ip.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "rb-endpoint {} {} {mac} {ip} {addr:#x} {rkey:#x}",
        ep.qpn, ep.psn
    )
}

fn parse_endpoint(line: &str) -> Result<(Endpoint, RemoteAddr), String> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let bad = || format!("not an endpoint line: {line:?}");
    if f.len() != 7 || f[0] != "rb-endpoint" {
        return Err(bad());
    }
    let hex = |s: &str, n: usize| -> Result<Vec<u8>, String> {
        if s.len() != 2 * n {
            return Err(bad());
        }
        (0..n)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad()))
            .collect()
    };
    let num = |s: &str| -> Result<u64, String> {
        match s.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16),
            None => s.parse(),
        }
        .map_err(|_| bad())
    };
    let mut ep = Endpoint {
        qpn: num(f[1])? as u32,
        psn: num(f[2])? as u32,
        mac: [0; 6],
        ip: [0; 4],
    };
    ep.mac.copy_from_slice(&hex(f[3], 6)?);
    ep.ip.copy_from_slice(&hex(f[4], 4)?);
    let remote = RemoteAddr {
        addr: num(f[5])?,
        rkey: num(f[6])? as u32,
    };
    Ok((ep, remote))
}

/// Runs one side: endpoint out on `out`, the peer's in from `input`. Returns the bytes
/// checked (target) or sent (initiator).
pub fn run_peer(cfg: &PeerConfig, input: impl BufRead, mut out: impl Write) -> Result<u64, String> {
    let port = VfioPort::connect(&cfg.socket).map_err(|e| e.to_string())?;
    let dev = Device::open(Box::new(port)).map_err(|e| e.to_string())?;
    let start = Instant::now();
    let mut peer_line = {
        let mut lines = input.lines();
        move || -> Result<String, String> {
            lines
                .next()
                .ok_or("the peer's endpoint line never came")?
                .map_err(|e| e.to_string())
        }
    };
    let bytes = match cfg.mode {
        Mode::Rc => rc(cfg, &dev, &mut peer_line, &mut out, start)?,
        Mode::Tag => tag(cfg, &dev, &mut peer_line, &mut out, start)?,
    };
    writeln!(out, "rb-ok {} {bytes}", cfg.count).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    Ok(bytes)
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

fn rc(
    cfg: &PeerConfig,
    dev: &Device,
    peer_line: &mut dyn FnMut() -> Result<String, String>,
    out: &mut impl Write,
    start: Instant,
) -> Result<u64, String> {
    let e = |e: ringbell::Error| e.to_string();
    let size = cfg.size.max(1) as usize;
    let pd = dev.alloc_pd().map_err(e)?;
    let buf = dev.alloc_dma(size).map_err(e)?;
    let mr = pd
        .reg_mr(&buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .map_err(e)?;
    let mut cq = dev.create_cq(64).map_err(e)?;
    let mut qp = pd.create_qp(&QpInit::new(&cq, &cq)).map_err(e)?;
    let psn = 100 + cfg.role as u32;
    say(out, &fmt_endpoint(&qp.endpoint(psn), mr.addr(), mr.rkey()))?;
    let (peer, remote) = parse_endpoint(&peer_line()?)?;
    qp.connect(&peer, psn, &ConnectOptions::default())
        .map_err(e)?;
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
    peer_line: &mut dyn FnMut() -> Result<String, String>,
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
    let (conn, ep) = tm.add_conn().map_err(e)?;
    say(out, &fmt_endpoint(&ep, 0, 0))?;
    let (peer, _) = parse_endpoint(&peer_line()?)?;
    tm.connect(conn, &peer, &ConnectOptions::default())
        .map_err(e)?;
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
    fn endpoint_lines_round_trip_and_bad_ones_are_refused() {
        let ep = Endpoint {
            qpn: 7,
            psn: 0xABCDE,
            mac: [2, 0, 0, 0, 1, 0xff],
            ip: [10, 0, 0, 2],
        };
        let line = fmt_endpoint(&ep, 0x1_0000_2000, 0x1234);
        let (back, remote) = parse_endpoint(&line).unwrap();
        assert_eq!(
            (back.qpn, back.psn, back.mac, back.ip),
            (ep.qpn, ep.psn, ep.mac, ep.ip)
        );
        assert_eq!((remote.addr, remote.rkey), (0x1_0000_2000, 0x1234));
        for bad in [
            "",
            "rb-endpoint 1 2 3",
            "rb-endpoint x 2 020000000001 0a000002 0 0",
            "rb-endpoint 1 2 0200000000 0a000002 0 0",
            "rb-endpoint 1 2 02000000000g 0a000002 0 0",
            "hello 1 2 020000000001 0a000002 0 0",
        ] {
            assert!(parse_endpoint(bad).is_err(), "{bad:?}");
        }
    }
}
