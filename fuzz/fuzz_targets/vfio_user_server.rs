//! The vfio-user server's message handling (`ringbell_emu::serve::Loopback`: the session, the
//! PCI function and the fabric code `ringbell-emu serve` runs, fed bytes without a socket):
//! arbitrary byte streams, and sequences of well-formed messages with fuzzed fields, some
//! carrying memory files, eventfds or pipes. Whatever comes, nothing panics, nothing is
//! allocated by a length the input chose, every reply is well-formed (the reply flag, a size
//! the server may send, an error reply of a bare header with a non-zero errno), each
//! well-formed request gets exactly one reply naming it, and the client never holds more DMA
//! mappings than it is allowed.

#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use ringbell_emu::serve::session::{HEADER_SIZE, MAX_DATA_XFER, MAX_MSG_SIZE};
use ringbell_emu::serve::Loopback;
use std::os::fd::OwnedFd;

/// Mappings the fuzzed client may hold (small, so that the limit is reached).
const MAX_MAPS: usize = 8;

#[derive(Arbitrary, Debug)]
enum Fd {
    None,
    /// A sealable memory file of this many pages (mod 16).
    Memory(u8),
    Eventfd,
    Pipe,
    /// Two memory files.
    Two,
}

#[derive(Arbitrary, Debug)]
enum Json {
    Empty,
    Good,
    NoNul,
    Bytes(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Msg {
    Version {
        major: u16,
        minor: u16,
        json: Json,
    },
    DmaMap {
        fd: Fd,
        argsz: u32,
        flags: u32,
        offset: u64,
        iova: u64,
        len: u64,
    },
    DmaUnmap {
        argsz: u32,
        flags: u32,
        iova: u64,
        len: u64,
    },
    GetInfo {
        argsz: u32,
    },
    RegionInfo {
        argsz: u32,
        index: u32,
    },
    IrqInfo {
        argsz: u32,
        index: u32,
    },
    SetIrqs {
        fd: Fd,
        flags: u32,
        index: u32,
        start: u32,
        count: u32,
    },
    Read {
        region: u32,
        offset: u64,
        count: u32,
    },
    Write {
        region: u32,
        offset: u64,
        data: Vec<u8>,
        count: Option<u32>,
    },
    Reset,
    Unknown {
        cmd: u16,
        body: Vec<u8>,
    },
}

#[derive(Arbitrary, Debug)]
enum Step {
    /// Raw bytes, as they come.
    Raw(Vec<u8>),
    /// A message: its id, extra header flags, a change to its size field, how it is cut
    /// into pieces.
    Message {
        id: u16,
        flags: u8,
        size_delta: i8,
        pieces: u8,
        msg: Msg,
    },
    /// Let the NIC run.
    Run(u8),
}

#[derive(Arbitrary, Debug)]
struct Input {
    /// VERSION first (well-formed), so that the other requests are reached.
    negotiate: bool,
    steps: Vec<Step>,
}

fn memory(pages: u8) -> OwnedFd {
    let len = 4096 * (1 + usize::from(pages % 16));
    let mem = ringbell::DmaMemory::new(len).expect("a memory file");
    mem.fd()
        .expect("a memory file")
        .try_clone_to_owned()
        .expect("its descriptor")
}

fn fds(kind: &Fd) -> Vec<OwnedFd> {
    match kind {
        Fd::None => Vec::new(),
        Fd::Memory(p) => vec![memory(*p)],
        Fd::Eventfd => {
            vec![
                nix::sys::eventfd::EventFd::from_flags(nix::sys::eventfd::EfdFlags::EFD_NONBLOCK)
                    .expect("an eventfd")
                    .into(),
            ]
        }
        Fd::Pipe => {
            let (r, w) = nix::unistd::pipe().expect("a pipe");
            drop(r);
            vec![w]
        }
        Fd::Two => vec![memory(0), memory(1)],
    }
}

fn header(id: u16, cmd: u16, size: u32, flags: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(64);
    h.extend_from_slice(&id.to_le_bytes());
    h.extend_from_slice(&cmd.to_le_bytes());
    h.extend_from_slice(&size.to_le_bytes());
    h.extend_from_slice(&flags.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

/// The command and payload of `msg`, with its descriptors.
fn encode(msg: &Msg) -> (u16, Vec<u8>, Vec<OwnedFd>) {
    let mut b = Vec::new();
    let w32 = |b: &mut Vec<u8>, v: u32| b.extend_from_slice(&v.to_le_bytes());
    let w64 = |b: &mut Vec<u8>, v: u64| b.extend_from_slice(&v.to_le_bytes());
    match msg {
        Msg::Version { major, minor, json } => {
            b.extend_from_slice(&major.to_le_bytes());
            b.extend_from_slice(&minor.to_le_bytes());
            match json {
                Json::Empty => {}
                Json::Good => b.extend_from_slice(b"{\"capabilities\":{\"max_msg_fds\":1}}\0"),
                Json::NoNul => b.extend_from_slice(b"{\"capabilities\":{}}"),
                Json::Bytes(v) => b.extend(v.iter().take(MAX_MSG_SIZE)),
            }
            (1, b, Vec::new())
        }
        Msg::DmaMap {
            fd,
            argsz,
            flags,
            offset,
            iova,
            len,
        } => {
            w32(&mut b, *argsz);
            w32(&mut b, *flags);
            w64(&mut b, *offset);
            w64(&mut b, *iova);
            w64(&mut b, *len);
            (2, b, fds(fd))
        }
        Msg::DmaUnmap {
            argsz,
            flags,
            iova,
            len,
        } => {
            w32(&mut b, *argsz);
            w32(&mut b, *flags);
            w64(&mut b, *iova);
            w64(&mut b, *len);
            (3, b, Vec::new())
        }
        Msg::GetInfo { argsz } => {
            w32(&mut b, *argsz);
            b.extend_from_slice(&[0; 12]);
            (4, b, Vec::new())
        }
        Msg::RegionInfo { argsz, index } => {
            w32(&mut b, *argsz);
            w32(&mut b, 0);
            w32(&mut b, *index);
            b.extend_from_slice(&[0; 20]);
            (5, b, Vec::new())
        }
        Msg::IrqInfo { argsz, index } => {
            w32(&mut b, *argsz);
            w32(&mut b, 0);
            w32(&mut b, *index);
            w32(&mut b, 0);
            (7, b, Vec::new())
        }
        Msg::SetIrqs {
            fd,
            flags,
            index,
            start,
            count,
        } => {
            for v in [20, *flags, *index, *start, *count] {
                w32(&mut b, v);
            }
            (8, b, fds(fd))
        }
        Msg::Read {
            region,
            offset,
            count,
        } => {
            w64(&mut b, *offset);
            w32(&mut b, *region);
            w32(&mut b, *count);
            (9, b, Vec::new())
        }
        Msg::Write {
            region,
            offset,
            data,
            count,
        } => {
            let data = &data[..data.len().min(2 * MAX_DATA_XFER)];
            w64(&mut b, *offset);
            w32(&mut b, *region);
            w32(&mut b, count.unwrap_or(data.len() as u32));
            b.extend_from_slice(data);
            (10, b, Vec::new())
        }
        Msg::Reset => (13, b, Vec::new()),
        Msg::Unknown { cmd, body } => (
            *cmd,
            body.iter().take(MAX_MSG_SIZE).copied().collect(),
            Vec::new(),
        ),
    }
}

/// Checks every reply in `r` and returns them as (id, command, error).
fn replies(r: &[u8]) -> Vec<(u16, u16, bool)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < r.len() {
        assert!(r.len() - at >= HEADER_SIZE, "a cut reply");
        let h = &r[at..at + HEADER_SIZE];
        let id = u16::from_le_bytes([h[0], h[1]]);
        let cmd = u16::from_le_bytes([h[2], h[3]]);
        let size = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
        let flags = u32::from_le_bytes(h[8..12].try_into().unwrap());
        let errno = u32::from_le_bytes(h[12..16].try_into().unwrap());
        assert_eq!(flags & 0xF, 1, "not a reply: flags {flags:#x}");
        assert!(
            (HEADER_SIZE..=HEADER_SIZE + 512).contains(&size),
            "a reply of {size} bytes"
        );
        assert!(at + size <= r.len(), "a reply runs past what was sent");
        let error = flags & (1 << 5) != 0;
        if error {
            assert_eq!(size, HEADER_SIZE, "an error reply with a payload");
            assert_ne!(errno, 0, "an error reply without an errno");
        } else {
            assert_eq!(errno, 0, "a success with an errno");
        }
        out.push((id, cmd, error));
        at += size;
    }
    out
}

fuzz_target!(|input: Input| {
    let mut lb = Loopback::new(MAX_MAPS).expect("a loopback server");
    let mut in_step = true;
    if input.negotiate {
        let caps = b"{\"capabilities\":{\"max_msg_fds\":1}}\0";
        let mut m = header(1, 1, (HEADER_SIZE + 4 + caps.len()) as u32, 0);
        m.extend_from_slice(&[0, 0, 1, 0]);
        m.extend_from_slice(caps);
        lb.feed(&m, Vec::new()).expect("VERSION is taken");
        assert_eq!(replies(lb.replies()), vec![(1, 1, false)]);
        lb.clear_replies();
    }
    for step in input.steps.iter().take(256) {
        let fed = match step {
            Step::Raw(bytes) => {
                // The stream may now be anywhere inside a message.
                in_step = false;
                let r = lb.feed(bytes, Vec::new());
                replies(lb.replies());
                r
            }
            Step::Run(n) => {
                lb.run(u64::from(*n) * 16);
                Ok(())
            }
            Step::Message {
                id,
                flags,
                size_delta,
                pieces,
                msg,
            } => {
                let (cmd, body, fds) = encode(msg);
                let size = (HEADER_SIZE + body.len()) as u32;
                let told = size.wrapping_add_signed(i32::from(*size_delta));
                let extra = u32::from(*flags) & !0xF;
                let mut m = header(*id, cmd, told, extra);
                m.extend_from_slice(&body);
                let chunk = m.len() / usize::from(pieces % 4 + 1) + 1;
                let mut fds = Some(fds);
                let mut r = Ok(());
                for piece in m.chunks(chunk) {
                    r = lb.feed(piece, fds.take().unwrap_or_default());
                    if r.is_err() {
                        break;
                    }
                }
                let got = replies(lb.replies());
                let plain = *size_delta == 0 && extra == 0 && in_step;
                if plain {
                    assert_eq!(got.len(), 1, "{msg:?} got {got:?}");
                    assert_eq!((got[0].0, got[0].1), (*id, cmd), "{msg:?}");
                } else if *size_delta != 0 {
                    // Whatever the server took as this message, the next ones are not known
                    // to start where the client thinks.
                    in_step = false;
                }
                r
            }
        };
        lb.clear_replies();
        assert!(
            lb.dma_mappings() <= MAX_MAPS,
            "{} mappings",
            lb.dma_mappings()
        );
        if fed.is_err() {
            break;
        }
    }
});
