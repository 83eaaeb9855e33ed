//! The vfio-user protocol as `ringbell-emu serve` speaks it to one client: messages framed and
//! bounded before anything is allocated, every request checked, every refusal answered with
//! an errno.
//!
//! A [`Session`] is fed the bytes and descriptors of one connection as they arrive, in pieces
//! of any size. It owns one buffer of [`MAX_MSG_SIZE`] bytes for the whole connection and
//! never asks for more than the rest of the message it is assembling ([`Session::want`]):
//! descriptors travel with the first byte of the message they belong to, so reading into the
//! next message would hand them to the wrong one. A header is checked the moment it is whole:
//! a size below the header or above [`MAX_MSG_SIZE`] cannot be framed, and is answered with
//! an error reply (EINVAL, E2BIG) before the connection is closed. Every other message is read
//! whole, so an unknown command is skipped (ENOTSUP) and the stream never loses its place.
//!
//! What the device does with a request is the [`Device`]'s business; this module checks the
//! protocol (sizes, flags, indexes, region bounds, descriptors) and answers. The errnos are
//! the ones the vfio-user specification names (EEXIST for a DMA_MAP over a mapping) and
//! otherwise those Linux VFIO gives for the same ioctl: EINVAL for a malformed or out-of-range
//! request, E2BIG for a transfer above `max_data_xfer_size`, ENOTSUP for what this device
//! does not implement, ENOENT for an unmap of nothing, ENOSPC when the mapping budget is
//! spent, ENOMEM when the server cannot map the memory.

use nix::errno::Errno;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use vfio_bindings::bindings::vfio::{
    VFIO_DEVICE_FLAGS_PCI, VFIO_DEVICE_FLAGS_RESET, VFIO_IRQ_INFO_EVENTFD, VFIO_IRQ_INFO_NORESIZE,
    VFIO_IRQ_SET_ACTION_MASK, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK,
    VFIO_IRQ_SET_DATA_BOOL, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE,
    VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_MSIX_IRQ_INDEX,
    VFIO_PCI_NUM_IRQS, VFIO_PCI_NUM_REGIONS, VFIO_REGION_INFO_CAP_SPARSE_MMAP,
    VFIO_REGION_INFO_FLAG_CAPS, VFIO_REGION_INFO_FLAG_MMAP, VFIO_REGION_INFO_FLAG_READ,
    VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_user::{Command, DmaMapFlags, DmaUnmapFlags};

/// Bytes of a message header.
pub const HEADER_SIZE: usize = 16;

/// The largest message the server takes, header included. A header that announces more is
/// refused with E2BIG and the connection is closed. The largest message a client needs is a
/// VERSION with its JSON capabilities; every other request is at most 32 bytes plus
/// [`MAX_DATA_XFER`].
pub const MAX_MSG_SIZE: usize = 4096;

/// The most bytes one REGION_READ or REGION_WRITE moves (`max_data_xfer_size` in the VERSION
/// reply): the largest access the device takes, a BlueFlame burst or all of config space.
pub const MAX_DATA_XFER: usize = 256;

/// Descriptors the server takes with one message (`max_msg_fds`): the memory file of a
/// DMA_MAP, or the eventfd of a DEVICE_SET_IRQS.
pub const MAX_MSG_FDS: usize = 1;

/// Header flags: the message type (0 command, 1 reply).
const TYPE_MASK: u32 = 0xF;
/// Header flag: a reply.
const FLAG_REPLY: u32 = 1;
/// Header flag: the sender wants no reply.
const FLAG_NO_REPLY: u32 = 1 << 4;
/// Header flag: the request failed.
const FLAG_ERROR: u32 = 1 << 5;

/// The size of region `index` (0 for the regions this device does not have).
pub fn region_size(index: u32) -> u64 {
    match index {
        VFIO_PCI_BAR0_REGION_INDEX => ringbell_specs::regs::BAR0_SIZE,
        VFIO_PCI_CONFIG_REGION_INDEX => super::CONFIG_SIZE as u64,
        _ => 0,
    }
}

/// Why the device refused a request: the errno the client gets and the reason the log gets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} ({errno})")]
pub struct Refusal {
    /// The errno of the error reply.
    pub errno: Errno,
    /// What was wrong, for the log.
    pub reason: String,
}

impl Refusal {
    /// A refusal with `errno` for `reason`.
    pub fn new(errno: Errno, reason: impl Into<String>) -> Refusal {
        Refusal {
            errno,
            reason: reason.into(),
        }
    }
}

/// The device behind a session: what a request does once the protocol has checked it.
pub trait Device {
    /// Reads `data.len()` bytes (at most [`MAX_DATA_XFER`], inside the region) at `offset`.
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> Result<(), Refusal>;
    /// Writes `data` (at most [`MAX_DATA_XFER`] bytes, inside the region) at `offset`.
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), Refusal>;
    /// Maps `len` bytes of memory file `fd` (from offset 0, read-write) at `iova`.
    fn dma_map(&mut self, fd: OwnedFd, iova: u64, len: u64) -> Result<(), Refusal>;
    /// Removes the mapping of exactly `iova + len`.
    fn dma_unmap(&mut self, iova: u64, len: u64) -> Result<(), Refusal>;
    /// Signals MSI-X vector 0 on `fd` from now on (an eventfd), or on nothing.
    fn set_irq(&mut self, fd: Option<OwnedFd>) -> Result<(), Refusal>;
    /// Resets the device.
    fn reset(&mut self) -> Result<(), Refusal>;
    /// BAR0's memory file, sent with region 0's info for the client to map its doorbells.
    fn bar_fd(&self) -> BorrowedFd<'_>;
}

/// What the session has to send after a message: reply bytes and, with them, a descriptor.
#[derive(Debug, Default)]
pub struct Outbox {
    /// The replies, back to back (bounded: at most one per message, each a few hundred
    /// bytes).
    pub bytes: Vec<u8>,
    /// A descriptor to pass with the first byte of `bytes` (BAR0's memory file).
    pub fd: Option<i32>,
    /// The refusal of the last message, for the log.
    pub refusal: Option<Refusal>,
}

impl Outbox {
    /// Empties the outbox after it has been sent.
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.fd = None;
        self.refusal = None;
    }
}

/// What the connection does next.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Keep reading.
    Go,
    /// Send what the outbox holds, then close: the stream cannot be followed any further.
    Close(String),
}

/// A message header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    id: u16,
    command: u16,
    size: u32,
    flags: u32,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

impl Header {
    fn parse(b: &[u8]) -> Header {
        Header {
            id: u16_at(b, 0),
            command: u16_at(b, 2),
            size: u32_at(b, 4),
            flags: u32_at(b, 8),
        }
    }
}

/// Appends a reply header for `h` with `payload` bytes to follow.
fn reply_header(out: &mut Vec<u8>, h: &Header, payload: usize, flags: u32, errno: u32) {
    out.extend_from_slice(&h.id.to_le_bytes());
    out.extend_from_slice(&h.command.to_le_bytes());
    out.extend_from_slice(&((HEADER_SIZE + payload) as u32).to_le_bytes());
    out.extend_from_slice(&(FLAG_REPLY | flags).to_le_bytes());
    out.extend_from_slice(&errno.to_le_bytes());
}

fn put32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// The name of command `c` for the log, as the vfio-user specification spells it.
fn command_name(c: u16) -> String {
    let name = match Command::n(c) {
        Some(Command::Version) => "VERSION",
        Some(Command::DmaMap) => "DMA_MAP",
        Some(Command::DmaUnmap) => "DMA_UNMAP",
        Some(Command::DeviceGetInfo) => "DEVICE_GET_INFO",
        Some(Command::DeviceGetRegionInfo) => "DEVICE_GET_REGION_INFO",
        Some(Command::GetRegionIoFds) => "DEVICE_GET_REGION_IO_FDS",
        Some(Command::GetIrqInfo) => "DEVICE_GET_IRQ_INFO",
        Some(Command::SetIrqs) => "DEVICE_SET_IRQS",
        Some(Command::RegionRead) => "REGION_READ",
        Some(Command::RegionWrite) => "REGION_WRITE",
        Some(Command::DmaRead) => "DMA_READ",
        Some(Command::DmaWrite) => "DMA_WRITE",
        Some(Command::DeviceReset) => "DEVICE_RESET",
        Some(Command::UserDirtyPages) => "DIRTY_PAGES",
        Some(Command::Unknown) | None => return format!("command {c}"),
    };
    name.to_string()
}

/// One client's connection: framing, checks, replies.
pub struct Session {
    /// The message being assembled (`have` bytes of it so far).
    buf: Box<[u8; MAX_MSG_SIZE]>,
    have: usize,
    /// Descriptors that came with the message being assembled.
    fds: Vec<OwnedFd>,
    /// More descriptors came with it than are kept (they were closed).
    fds_dropped: bool,
    /// VERSION has been answered.
    negotiated: bool,
    /// `max_dma_maps` for the VERSION reply.
    max_dma_maps: usize,
    /// Messages handled and refused so far.
    messages: u64,
    refused: u64,
}

impl Session {
    /// A session for a new connection; `max_dma_maps` is what the client will be allowed.
    pub fn new(max_dma_maps: usize) -> Session {
        Session {
            buf: Box::new([0u8; MAX_MSG_SIZE]),
            have: 0,
            fds: Vec::new(),
            fds_dropped: false,
            negotiated: false,
            max_dma_maps,
            messages: 0,
            refused: 0,
        }
    }

    /// Whether VERSION has been answered.
    pub fn negotiated(&self) -> bool {
        self.negotiated
    }

    /// Whether part of a message has arrived and the rest has not.
    pub fn in_message(&self) -> bool {
        self.have > 0
    }

    /// Messages handled so far.
    pub fn messages(&self) -> u64 {
        self.messages
    }

    /// Messages refused so far.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// Where the next bytes of the connection go: the rest of the current message's header,
    /// or of its body. Never empty.
    pub fn want(&mut self) -> &mut [u8] {
        let end = if self.have < HEADER_SIZE {
            HEADER_SIZE
        } else {
            // `take` closed the connection on a size outside HEADER_SIZE..=MAX_MSG_SIZE.
            Header::parse(&self.buf[..]).size as usize
        };
        &mut self.buf[self.have..end]
    }

    /// Descriptors that arrived with the bytes about to be passed to [`Session::took`]: kept
    /// up to [`MAX_MSG_FDS`] for the current message (the rest are closed and the message
    /// will be refused).
    pub fn add_fds(&mut self, fds: impl IntoIterator<Item = OwnedFd>) {
        for fd in fds {
            if self.fds.len() < MAX_MSG_FDS {
                self.fds.push(fd);
            } else {
                self.fds_dropped = true;
            }
        }
    }

    /// Marks that descriptors came with the current message and could not all be received
    /// (the kernel closed those that did not fit): the message will be refused.
    pub fn fds_truncated(&mut self) {
        self.fds_dropped = true;
    }

    /// `n` bytes have been written into [`Session::want`]: handles the message if it is
    /// whole, appending the reply to `out`.
    pub fn took(&mut self, n: usize, dev: &mut dyn Device, out: &mut Outbox) -> Step {
        let before = self.have;
        self.have += n.min(self.want_len());
        if self.have < HEADER_SIZE {
            return Step::Go;
        }
        let h = Header::parse(&self.buf[..]);
        let size = h.size as usize;
        if before < HEADER_SIZE {
            let bad = if size < HEADER_SIZE {
                Some((
                    Errno::EINVAL,
                    format!("message size {size} is below the header's 16"),
                ))
            } else if size > MAX_MSG_SIZE {
                Some((
                    Errno::E2BIG,
                    format!("message size {size} is above the largest taken, {MAX_MSG_SIZE}"),
                ))
            } else {
                None
            };
            if let Some((errno, why)) = bad {
                let why = format!("{} #{}: {why}", command_name(h.command), h.id);
                self.error(out, &h, Refusal::new(errno, why.clone()));
                self.reset_message();
                return Step::Close(why);
            }
        }
        if self.have < size {
            return Step::Go;
        }
        self.messages += 1;
        let step = self.dispatch(h, dev, out);
        self.reset_message();
        step
    }

    fn want_len(&self) -> usize {
        if self.have < HEADER_SIZE {
            HEADER_SIZE - self.have
        } else {
            (Header::parse(&self.buf[..]).size as usize).saturating_sub(self.have)
        }
    }

    fn reset_message(&mut self) {
        self.have = 0;
        self.fds.clear();
        self.fds_dropped = false;
    }

    /// Appends an error reply for `h` and records the refusal.
    fn error(&mut self, out: &mut Outbox, h: &Header, r: Refusal) {
        self.refused += 1;
        reply_header(&mut out.bytes, h, 0, FLAG_ERROR, r.errno as i32 as u32);
        out.refusal = Some(r);
    }

    fn dispatch(&mut self, h: Header, dev: &mut dyn Device, out: &mut Outbox) -> Step {
        let size = h.size as usize;
        let mut body = [0u8; MAX_MSG_SIZE - HEADER_SIZE];
        let body = &mut body[..size - HEADER_SIZE];
        body.copy_from_slice(&self.buf[HEADER_SIZE..size]);
        let fds = std::mem::take(&mut self.fds);
        let name = command_name(h.command);
        let no_reply = h.flags & FLAG_NO_REPLY != 0;
        let close_after = !self.negotiated;
        let mark = out.bytes.len();
        let result = if h.flags & TYPE_MASK != 0 {
            Err(Refusal::new(
                Errno::EINVAL,
                format!("message type {} is not a command", h.flags & TYPE_MASK),
            ))
        } else if self.fds_dropped {
            Err(Refusal::new(
                Errno::EINVAL,
                format!("more than {MAX_MSG_FDS} descriptor(s) came with the message"),
            ))
        } else if !self.negotiated && h.command != Command::Version as u16 {
            Err(Refusal::new(Errno::EINVAL, "VERSION must come first"))
        } else {
            self.request(&h, body, fds, dev, out)
        };
        let quiet = no_reply && silenceable(h.command) && self.negotiated;
        match result {
            Ok(()) => {
                if quiet {
                    out.bytes.truncate(mark);
                    out.fd = None;
                }
                Step::Go
            }
            Err(r) => {
                out.bytes.truncate(mark);
                out.fd = None;
                let r = Refusal::new(r.errno, format!("{name} #{}: {}", h.id, r.reason));
                let why = r.reason.clone();
                if quiet {
                    self.refused += 1;
                    out.refusal = Some(r);
                } else {
                    self.error(out, &h, r);
                }
                if close_after {
                    Step::Close(why)
                } else {
                    Step::Go
                }
            }
        }
    }

    fn request(
        &mut self,
        h: &Header,
        body: &[u8],
        mut fds: Vec<OwnedFd>,
        dev: &mut dyn Device,
        out: &mut Outbox,
    ) -> Result<(), Refusal> {
        let cmd = Command::n(h.command).unwrap_or(Command::Unknown);
        if !matches!(cmd, Command::DmaMap | Command::SetIrqs) && !fds.is_empty() {
            return Err(Refusal::new(
                Errno::EINVAL,
                "a descriptor came with a command that takes none",
            ));
        }
        let short = |want: usize| {
            if body.len() < want {
                Err(Refusal::new(
                    Errno::EINVAL,
                    format!("{} bytes of payload, {want} needed", body.len()),
                ))
            } else {
                Ok(())
            }
        };
        let argsz = |want: u32| {
            let a = u32_at(body, 0);
            if a < want {
                Err(Refusal::new(
                    Errno::EINVAL,
                    format!("argsz {a} is below {want}"),
                ))
            } else {
                Ok(a)
            }
        };
        match cmd {
            Command::Version => {
                short(4)?;
                self.version(h, body, out)
            }
            Command::DmaMap => {
                short(32)?;
                argsz(32)?;
                let flags = DmaMapFlags::from_bits_retain(u32_at(body, 4));
                let (offset, iova, len) = (u64_at(body, 8), u64_at(body, 16), u64_at(body, 24));
                if flags != DmaMapFlags::READ_WRITE {
                    return Err(Refusal::new(
                        if flags.bits() & !DmaMapFlags::READ_WRITE.bits() != 0 {
                            Errno::EINVAL
                        } else {
                            Errno::ENOTSUP
                        },
                        format!(
                            "{iova:#x}+{len:#x} with flags {:#x}: read-write only",
                            flags.bits()
                        ),
                    ));
                }
                if offset != 0 {
                    return Err(Refusal::new(
                        Errno::ENOTSUP,
                        format!("{iova:#x}+{len:#x} at file offset {offset:#x}: offset 0 only"),
                    ));
                }
                let Some(fd) = fds.pop() else {
                    return Err(Refusal::new(
                        Errno::ENOTSUP,
                        format!(
                            "{iova:#x}+{len:#x} without a memory file (DMA_READ/DMA_WRITE are \
                             not served)"
                        ),
                    ));
                };
                dev.dma_map(fd, iova, len)?;
                reply_header(&mut out.bytes, h, 0, 0, 0);
                Ok(())
            }
            Command::DmaUnmap => {
                short(24)?;
                let a = argsz(24)?;
                let flags = DmaUnmapFlags::from_bits_retain(u32_at(body, 4));
                let (iova, len) = (u64_at(body, 8), u64_at(body, 16));
                if !flags.is_empty() {
                    let known = DmaUnmapFlags::GET_DIRTY_PAGE_INFO | DmaUnmapFlags::UNMAP_ALL;
                    return Err(Refusal::new(
                        if known.contains(flags) {
                            Errno::ENOTSUP
                        } else {
                            Errno::EINVAL
                        },
                        format!("{iova:#x}+{len:#x} with flags {:#x}", flags.bits()),
                    ));
                }
                dev.dma_unmap(iova, len)?;
                reply_header(&mut out.bytes, h, 24, 0, 0);
                put32(&mut out.bytes, a.min(24));
                put32(&mut out.bytes, 0);
                put64(&mut out.bytes, iova);
                put64(&mut out.bytes, len);
                Ok(())
            }
            Command::DeviceGetInfo => {
                short(16)?;
                argsz(16)?;
                reply_header(&mut out.bytes, h, 16, 0, 0);
                put32(&mut out.bytes, 16);
                put32(
                    &mut out.bytes,
                    VFIO_DEVICE_FLAGS_PCI | VFIO_DEVICE_FLAGS_RESET,
                );
                put32(&mut out.bytes, VFIO_PCI_NUM_REGIONS);
                put32(&mut out.bytes, VFIO_PCI_NUM_IRQS);
                Ok(())
            }
            Command::DeviceGetRegionInfo => {
                short(32)?;
                let a = argsz(32)?;
                let index = u32_at(body, 8);
                if index >= VFIO_PCI_NUM_REGIONS {
                    return Err(Refusal::new(
                        Errno::EINVAL,
                        format!("region {index} of {VFIO_PCI_NUM_REGIONS}"),
                    ));
                }
                region_info(h, index, a, dev, out);
                Ok(())
            }
            Command::GetIrqInfo => {
                short(16)?;
                argsz(16)?;
                let index = u32_at(body, 8);
                if index >= VFIO_PCI_NUM_IRQS {
                    return Err(Refusal::new(
                        Errno::EINVAL,
                        format!("IRQ index {index} of {VFIO_PCI_NUM_IRQS}"),
                    ));
                }
                let msix = index == VFIO_PCI_MSIX_IRQ_INDEX;
                reply_header(&mut out.bytes, h, 16, 0, 0);
                put32(&mut out.bytes, 16);
                put32(
                    &mut out.bytes,
                    if msix {
                        VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_NORESIZE
                    } else {
                        0
                    },
                );
                put32(&mut out.bytes, index);
                put32(&mut out.bytes, u32::from(msix));
                Ok(())
            }
            Command::SetIrqs => {
                short(20)?;
                argsz(20)?;
                let (flags, index, start, count) = (
                    u32_at(body, 4),
                    u32_at(body, 8),
                    u32_at(body, 12),
                    u32_at(body, 16),
                );
                set_irqs(flags, index, start, count, fds, dev)?;
                reply_header(&mut out.bytes, h, 0, 0, 0);
                Ok(())
            }
            Command::RegionRead | Command::RegionWrite => {
                short(16)?;
                let write = matches!(cmd, Command::RegionWrite);
                let (offset, region, count) = (u64_at(body, 0), u32_at(body, 8), u32_at(body, 12));
                let what = format!("{count} bytes at {offset:#x} of region {region}");
                let data = &body[16..];
                if (write && data.len() != count as usize) || (!write && !data.is_empty()) {
                    return Err(Refusal::new(
                        Errno::EINVAL,
                        format!("{what}: {} bytes of data came", data.len()),
                    ));
                }
                if count as usize > MAX_DATA_XFER {
                    return Err(Refusal::new(
                        Errno::E2BIG,
                        format!("{what}: above max_data_xfer_size, {MAX_DATA_XFER}"),
                    ));
                }
                if region >= VFIO_PCI_NUM_REGIONS {
                    return Err(Refusal::new(
                        Errno::EINVAL,
                        format!("{what}: no such region"),
                    ));
                }
                let size = region_size(region);
                if count == 0 || offset.checked_add(count as u64).is_none_or(|e| e > size) {
                    return Err(Refusal::new(
                        Errno::EINVAL,
                        format!("{what}: outside the region's {size:#x} bytes"),
                    ));
                }
                let n = count as usize;
                let mut read = [0u8; MAX_DATA_XFER];
                if write {
                    dev.region_write(region, offset, data)?;
                    reply_header(&mut out.bytes, h, 16, 0, 0);
                } else {
                    dev.region_read(region, offset, &mut read[..n])?;
                    reply_header(&mut out.bytes, h, 16 + n, 0, 0);
                }
                put64(&mut out.bytes, offset);
                put32(&mut out.bytes, region);
                put32(&mut out.bytes, count);
                if !write {
                    out.bytes.extend_from_slice(&read[..n]);
                }
                Ok(())
            }
            Command::DeviceReset => {
                dev.reset()?;
                reply_header(&mut out.bytes, h, 0, 0, 0);
                Ok(())
            }
            Command::Unknown
            | Command::GetRegionIoFds
            | Command::DmaRead
            | Command::DmaWrite
            | Command::UserDirtyPages => Err(Refusal::new(
                Errno::ENOTSUP,
                "not served (its payload was skipped)",
            )),
        }
    }

    fn version(&mut self, h: &Header, body: &[u8], out: &mut Outbox) -> Result<(), Refusal> {
        if self.negotiated {
            return Err(Refusal::new(Errno::EINVAL, "a second VERSION"));
        }
        let (major, minor) = (u16_at(body, 0), u16_at(body, 2));
        if major != 0 {
            return Err(Refusal::new(
                Errno::ENOTSUP,
                format!("version {major}.{minor}: only major 0 is spoken"),
            ));
        }
        let json = &body[4..];
        if !json.is_empty() {
            let Some((&0, text)) = json.split_last() else {
                return Err(Refusal::new(
                    Errno::EINVAL,
                    "the capabilities are not NUL-terminated",
                ));
            };
            match serde_json::from_slice::<serde_json::Value>(text) {
                Ok(v) if v.is_object() => {}
                _ => {
                    return Err(Refusal::new(
                        Errno::EINVAL,
                        "the capabilities are not a JSON object",
                    ))
                }
            }
        }
        let caps = format!(
            "{{\"capabilities\":{{\"max_msg_fds\":{MAX_MSG_FDS},\"max_data_xfer_size\":\
             {MAX_DATA_XFER},\"max_dma_maps\":{},\"pgsizes\":4096}}}}\0",
            self.max_dma_maps
        );
        reply_header(&mut out.bytes, h, 4 + caps.len(), 0, 0);
        out.bytes.extend_from_slice(&0u16.to_le_bytes());
        // Version 0.0 is what the server speaks: at most the client's minor.
        out.bytes.extend_from_slice(&0u16.to_le_bytes());
        out.bytes.extend_from_slice(caps.as_bytes());
        self.negotiated = true;
        Ok(())
    }
}

/// Whether command `c` may be sent without asking for a reply (one that returns nothing).
fn silenceable(c: u16) -> bool {
    [
        Command::DmaMap,
        Command::DmaUnmap,
        Command::SetIrqs,
        Command::RegionWrite,
        Command::DeviceReset,
    ]
    .iter()
    .any(|k| *k as u16 == c)
}

/// DEVICE_GET_REGION_INFO of region `index`, for a client that takes `argsz` bytes.
fn region_info(h: &Header, index: u32, argsz: u32, dev: &dyn Device, out: &mut Outbox) {
    let bar = index == VFIO_PCI_BAR0_REGION_INDEX;
    let size = region_size(index);
    let rw = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
    let mut flags = if size == 0 { 0 } else { rw };
    // BAR0's sparse-mmap capability: the cap header, the area count, one area.
    let caps_len = if bar { 8 + 8 + 16 } else { 0 };
    let full = 32 + caps_len as u32;
    let with_caps = bar && argsz >= full;
    if bar {
        flags |= VFIO_REGION_INFO_FLAG_MMAP | VFIO_REGION_INFO_FLAG_CAPS;
    }
    reply_header(
        &mut out.bytes,
        h,
        32 + if with_caps { caps_len } else { 0 },
        0,
        0,
    );
    put32(&mut out.bytes, full);
    put32(&mut out.bytes, flags);
    put32(&mut out.bytes, index);
    put32(&mut out.bytes, if with_caps { 32 } else { 0 });
    put64(&mut out.bytes, size);
    put64(&mut out.bytes, 0);
    if with_caps {
        out.bytes
            .extend_from_slice(&(VFIO_REGION_INFO_CAP_SPARSE_MMAP as u16).to_le_bytes());
        out.bytes.extend_from_slice(&1u16.to_le_bytes());
        put32(&mut out.bytes, 0);
        put32(&mut out.bytes, 1);
        put32(&mut out.bytes, 0);
        put64(&mut out.bytes, ringbell_specs::regs::DB_BASE);
        put64(
            &mut out.bytes,
            ringbell_specs::regs::DB_END - ringbell_specs::regs::DB_BASE,
        );
    }
    if bar {
        out.fd = Some(dev.bar_fd().as_raw_fd());
    }
}

/// DEVICE_SET_IRQS: MSI-X vector 0 only, through an eventfd or none.
fn set_irqs(
    flags: u32,
    index: u32,
    start: u32,
    count: u32,
    mut fds: Vec<OwnedFd>,
    dev: &mut dyn Device,
) -> Result<(), Refusal> {
    let what = format!("index {index} flags {flags:#x} start {start} count {count}");
    let data =
        flags & (VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_DATA_BOOL | VFIO_IRQ_SET_DATA_EVENTFD);
    let action = flags
        & (VFIO_IRQ_SET_ACTION_MASK | VFIO_IRQ_SET_ACTION_UNMASK | VFIO_IRQ_SET_ACTION_TRIGGER);
    if data.count_ones() != 1 || action.count_ones() != 1 || flags & !(data | action) != 0 {
        return Err(Refusal::new(
            Errno::EINVAL,
            format!("{what}: one data and one action flag"),
        ));
    }
    if index >= VFIO_PCI_NUM_IRQS {
        return Err(Refusal::new(
            Errno::EINVAL,
            format!("{what}: no such index"),
        ));
    }
    let vectors = u32::from(index == VFIO_PCI_MSIX_IRQ_INDEX);
    if start.checked_add(count).is_none_or(|e| e > vectors) {
        return Err(Refusal::new(
            Errno::EINVAL,
            format!("{what}: the index has {vectors} vector(s)"),
        ));
    }
    if action != VFIO_IRQ_SET_ACTION_TRIGGER || data == VFIO_IRQ_SET_DATA_BOOL {
        return Err(Refusal::new(
            Errno::ENOTSUP,
            format!("{what}: only TRIGGER with NONE or EVENTFD"),
        ));
    }
    if data == VFIO_IRQ_SET_DATA_NONE {
        if count != 0 {
            return Err(Refusal::new(
                Errno::ENOTSUP,
                format!("{what}: a client-triggered interrupt"),
            ));
        }
        if !fds.is_empty() {
            return Err(Refusal::new(
                Errno::EINVAL,
                format!("{what}: a descriptor came"),
            ));
        }
        return dev.set_irq(None);
    }
    match (count, fds.len()) {
        (_, 0) => dev.set_irq(None),
        (1, 1) => {
            let fd = fds.pop().expect("one descriptor");
            if !is_eventfd(fd.as_fd()) {
                return Err(Refusal::new(
                    Errno::EINVAL,
                    format!("{what}: the descriptor is not an eventfd"),
                ));
            }
            dev.set_irq(Some(fd))
        }
        (c, n) => Err(Refusal::new(
            Errno::EINVAL,
            format!("{what}: {n} descriptor(s) for {c} vector(s)"),
        )),
    }
}

/// Whether `fd` is an eventfd (a pipe, socket or file could block or grow on a write).
pub fn is_eventfd(fd: BorrowedFd<'_>) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|t| t.as_os_str() == "anon_inode:[eventfd]")
}
