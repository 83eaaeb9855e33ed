//! The vfio-user client: a ringbell NIC served by another process (such as `ringbell-emu
//! serve`) over a UNIX socket, reached through [`VfioPort::connect`].
//!
//! This module owns the client half of the vfio-user protocol: the wire messages (as
//! little-endian `zerocopy` structs), descriptor passing with `SCM_RIGHTS`, and the
//! [`UserTransport`] that turns trapped register accesses and DMA mappings into messages.
//! Connecting negotiates the version, checks that the device is a PCI ringbell NIC, maps the
//! BAR0 windows the server shares (the doorbell pages) from the memory file it sends, and
//! hands it an eventfd for MSI-X vector 0.
//!
//! Every reply is checked (reply flag, message id, command, size bounds) and every read has a
//! deadline. The server's Error flag becomes [`VfioError::Refused`]; a timeout, a malformed
//! reply or a lost connection leaves the connection broken, and every later request fails at
//! once with [`VfioError::Protocol`] (a late reply would otherwise be taken for the answer to
//! the next request).
//!
//! A server that stops answering costs each request at most the reply timeout
//! ([`DEFAULT_TIMEOUT`], or the one given to [`VfioPort::connect_with`]); the port then reports
//! its failure ([`crate::Port::failure`]) and the device's commands fail at once with
//! [`crate::Error::DeviceLost`].
//!
//! Limitations:
//! - The errno of a refusal is whatever the server sends (`ringbell-emu serve` sends the one
//!   the vfio-user specification or Linux VFIO names; other servers may send 0).
//! - One client per device: a server (like the `vfio_user` crate's) serves one connection at a
//!   time, so a second client waits in VERSION and gets [`VfioError::Timeout`].
//! - Doorbell stores land in memory shared with the server; no message tells it, so the server
//!   has to poll its mapping to notice them.
//! - If BAR0 is mappable but the server sends no memory file (the `vfio_user` crate's server
//!   only sends one along with a sparse-mmap capability), every BAR0 access is trapped.

use super::{
    check_identity, plan_windows, Bar, Transport, VfioError, VfioPort, BAR0_REGION, CONFIG_REGION,
    MSIX_IRQ,
};
use crate::port::PortError;
use nix::errno::Errno;
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::{IoSlice, IoSliceMut};
use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};
use vfio_bindings::bindings::vfio as vb;
use vmm_sys_util::eventfd::{EventFd, EFD_CLOEXEC, EFD_NONBLOCK};
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// How long [`VfioPort::connect`] waits for each reply.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest REGION_READ/REGION_WRITE this client sends, whatever the server allows.
const MAX_XFER: usize = 1 << 20;
/// The transfer size a server that names none allows (the vfio-user default).
const DEFAULT_MAX_XFER: usize = 1 << 20;
/// The payload bound of a reply with a fixed layout (and of an error reply).
const SMALL_REPLY: usize = 256;
/// The payload bound of a VERSION reply (a JSON object).
const VERSION_REPLY: usize = 16 << 10;
/// The `argsz` of the first DEVICE_GET_REGION_INFO for BAR0: room for 254 sparse areas.
const REGION_INFO_ARGSZ: usize = 4096;
/// The largest `argsz` a server may ask us to retry DEVICE_GET_REGION_INFO with.
const MAX_REGION_INFO_ARGSZ: usize = 64 << 10;
/// At most this many capabilities are walked in a region's chain.
const MAX_CAPS: usize = 16;
/// At most this many sparse-mmap areas are accepted.
const MAX_AREAS: usize = 256;
/// The most descriptors Linux passes in one message (`SCM_MAX_FD`): the receive buffer holds
/// this many so that no message is truncated (a truncated one would leak the descriptors).
pub const SCM_MAX_FD: usize = 253;
/// The smallest config space accepted: the standard PCI header.
const MIN_CONFIG_SIZE: u64 = 64;

/// Header flag: the message is a reply.
const FLAG_REPLY: u32 = 1;
/// Header flags: the message type field.
const FLAG_TYPE_MASK: u32 = 0xF;
/// Header flag: the request failed; `error` holds the errno.
const FLAG_ERROR: u32 = 1 << 5;

/// The vfio-user commands this client sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
enum Command {
    Version = 1,
    DmaMap = 2,
    DmaUnmap = 3,
    DeviceGetInfo = 4,
    DeviceGetRegionInfo = 5,
    DeviceGetIrqInfo = 7,
    DeviceSetIrqs = 8,
    RegionRead = 9,
    RegionWrite = 10,
}

impl Command {
    fn name(self) -> &'static str {
        match self {
            Command::Version => "VERSION",
            Command::DmaMap => "DMA_MAP",
            Command::DmaUnmap => "DMA_UNMAP",
            Command::DeviceGetInfo => "DEVICE_GET_INFO",
            Command::DeviceGetRegionInfo => "DEVICE_GET_REGION_INFO",
            Command::DeviceGetIrqInfo => "DEVICE_GET_IRQ_INFO",
            Command::DeviceSetIrqs => "DEVICE_SET_IRQS",
            Command::RegionRead => "REGION_READ",
            Command::RegionWrite => "REGION_WRITE",
        }
    }
}

/// The header of every message.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
struct Header {
    message_id: U16,
    command: U16,
    /// The whole message, header included.
    message_size: U32,
    flags: U32,
    error: U32,
}
const _: () = assert!(size_of::<Header>() == 16);

/// VERSION (followed by NUL-terminated JSON capabilities).
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
struct Version {
    major: U16,
    minor: U16,
}
const _: () = assert!(size_of::<Version>() == 4);

/// DMA_MAP (the memory file travels as `SCM_RIGHTS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
struct DmaMap {
    argsz: U32,
    flags: U32,
    offset: U64,
    address: U64,
    size: U64,
}
const _: () = assert!(size_of::<DmaMap>() == 32);

/// DMA_MAP flags: the device may read and write the memory.
const DMA_READ_WRITE: u32 = 0b11;

/// DMA_UNMAP.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
struct DmaUnmap {
    argsz: U32,
    flags: U32,
    address: U64,
    size: U64,
}
const _: () = assert!(size_of::<DmaUnmap>() == 24);

/// DEVICE_GET_INFO.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
struct DeviceInfo {
    argsz: U32,
    flags: U32,
    num_regions: U32,
    num_irqs: U32,
}
const _: () = assert!(size_of::<DeviceInfo>() == 16);

/// DEVICE_GET_REGION_INFO (`struct vfio_region_info`, then the capability chain).
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
struct RegionInfo {
    argsz: U32,
    flags: U32,
    index: U32,
    /// Offset of the first capability from the start of this structure (0: none).
    cap_offset: U32,
    size: U64,
    /// Where the region starts in the memory file sent with the reply.
    offset: U64,
}
const _: () = assert!(size_of::<RegionInfo>() == 32);
const _: () = assert!(size_of::<RegionInfo>() == size_of::<vb::vfio_region_info>());

/// The header of a region capability.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
struct CapHeader {
    id: U16,
    version: U16,
    /// Offset of the next capability from the start of [`RegionInfo`] (0: last).
    next: U32,
}
const _: () = assert!(size_of::<CapHeader>() == 8);

/// The sparse-mmap capability after its header (followed by `nr_areas` [`SparseArea`]s).
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
struct SparseMmap {
    nr_areas: U32,
    reserved: U32,
}
const _: () = assert!(size_of::<SparseMmap>() == 8);

/// One mappable area of a region.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
struct SparseArea {
    offset: U64,
    size: U64,
}
const _: () = assert!(size_of::<SparseArea>() == 16);

/// REGION_READ and REGION_WRITE (a write, and a read's reply, carry `count` bytes after it).
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
struct RegionAccess {
    offset: U64,
    region: U32,
    count: U32,
}
const _: () = assert!(size_of::<RegionAccess>() == 16);

/// DEVICE_GET_IRQ_INFO.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
struct IrqInfo {
    argsz: U32,
    flags: U32,
    index: U32,
    count: U32,
}
const _: () = assert!(size_of::<IrqInfo>() == 16);

/// DEVICE_SET_IRQS (the eventfds travel as `SCM_RIGHTS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
struct IrqSet {
    argsz: U32,
    flags: U32,
    index: U32,
    start: U32,
    count: U32,
}
const _: () = assert!(size_of::<IrqSet>() == 20);

/// A reply's payload (after the header) and the descriptors that came with it.
struct Reply {
    payload: Vec<u8>,
    fds: Vec<OwnedFd>,
}

/// The socket and what the client knows about it.
#[derive(Debug)]
struct Conn {
    stream: UnixStream,
    next_id: u16,
    timeout: Duration,
    /// The most bytes one REGION_READ/REGION_WRITE may carry.
    max_xfer: usize,
    /// Why the connection can no longer be used, once it cannot.
    broken: Option<String>,
    /// The control-message buffer for `recvmsg` (capacity for [`SCM_MAX_FD`] descriptors).
    cmsg: Vec<u8>,
}

impl Conn {
    /// Sends one request and reads its reply; errors other than `Refused` leave the stream
    /// out of step (the caller marks the connection broken).
    fn exchange(
        &mut self,
        cmd: Command,
        parts: &[&[u8]],
        fd: Option<BorrowedFd<'_>>,
        max_payload: usize,
    ) -> Result<Reply, VfioError> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let len = size_of::<Header>() + parts.iter().map(|p| p.len()).sum::<usize>();
        let size = u32::try_from(len)
            .map_err(|_| VfioError::Protocol(format!("{} of {len} bytes", cmd.name())))?;
        let header = Header {
            message_id: U16::new(id),
            command: U16::new(cmd as u16),
            message_size: U32::new(size),
            flags: U32::new(0),
            error: U32::new(0),
        };
        let mut msg = Vec::with_capacity(len);
        msg.extend_from_slice(header.as_bytes());
        for p in parts {
            msg.extend_from_slice(p);
        }
        self.send(cmd, &msg, fd)?;

        let deadline = Instant::now() + self.timeout;
        let mut fds = Vec::new();
        let mut raw = [0u8; size_of::<Header>()];
        self.recv_exact(cmd, &mut raw, deadline, &mut fds)?;
        let reply = Header::read_from_bytes(&raw)
            .map_err(|_| VfioError::Protocol("a header that is not 16 bytes".into()))?;
        let flags = reply.flags.get();
        if flags & FLAG_TYPE_MASK != FLAG_REPLY {
            return Err(VfioError::Protocol(format!(
                "answer to {} is not a reply (flags {flags:#x})",
                cmd.name()
            )));
        }
        if reply.message_id.get() != id || reply.command.get() != cmd as u16 {
            return Err(VfioError::Protocol(format!(
                "reply to {} #{id} names command {} #{}",
                cmd.name(),
                reply.command.get(),
                reply.message_id.get()
            )));
        }
        let size = reply.message_size.get() as usize;
        let payload_len = size
            .checked_sub(size_of::<Header>())
            .filter(|n| *n <= max_payload)
            .ok_or_else(|| {
                VfioError::Protocol(format!(
                    "reply to {} has a size of {size} bytes (at most {} expected)",
                    cmd.name(),
                    max_payload + size_of::<Header>()
                ))
            })?;
        let mut payload = vec![0u8; payload_len];
        self.recv_exact(cmd, &mut payload, deadline, &mut fds)?;
        if flags & FLAG_ERROR != 0 {
            // The descriptors that came with it (if any) are closed here.
            return Err(VfioError::Refused {
                command: cmd.name(),
                errno: reply.error.get(),
            });
        }
        Ok(Reply { payload, fds })
    }

    /// Writes all of `msg`, with `fd` attached to its first byte.
    fn send(
        &mut self,
        cmd: Command,
        msg: &[u8],
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<(), VfioError> {
        let raw = self.stream.as_raw_fd();
        let fds: Vec<RawFd> = fd.iter().map(|f| f.as_raw_fd()).collect();
        let mut sent = 0;
        while sent < msg.len() {
            let iov = [IoSlice::new(&msg[sent..])];
            let rights = [ControlMessage::ScmRights(&fds)];
            // The descriptor goes with the first piece only.
            let cmsgs: &[ControlMessage<'_>] = if sent == 0 && !fds.is_empty() {
                &rights
            } else {
                &[]
            };
            match sendmsg::<()>(raw, &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
                Ok(0) => {
                    return Err(VfioError::Protocol(format!(
                        "the server stopped taking {}",
                        cmd.name()
                    )))
                }
                Ok(n) => sent += n,
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => return Err(VfioError::Timeout(cmd.name())),
                Err(e) => {
                    return Err(VfioError::io(
                        format!("vfio-user: sending {}", cmd.name()),
                        e.into(),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Fills `buf` from the socket by `deadline`, keeping every descriptor that arrives.
    fn recv_exact(
        &mut self,
        cmd: Command,
        buf: &mut [u8],
        deadline: Instant,
        fds: &mut Vec<OwnedFd>,
    ) -> Result<(), VfioError> {
        let raw = self.stream.as_raw_fd();
        let mut filled = 0;
        while filled < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(VfioError::Timeout(cmd.name()));
            }
            self.stream
                .set_read_timeout(Some(left))
                .map_err(|e| VfioError::io("vfio-user: setting the read timeout", e))?;
            self.cmsg.clear();
            let mut iov = [IoSliceMut::new(&mut buf[filled..])];
            let received = recvmsg::<()>(
                raw,
                &mut iov,
                Some(&mut self.cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            );
            let (n, got, truncated) = match received {
                Ok(m) => {
                    let mut got = Vec::new();
                    let truncated = match m.cmsgs() {
                        Ok(it) => {
                            for c in it {
                                if let ControlMessageOwned::ScmRights(v) = c {
                                    got.extend(v);
                                }
                            }
                            false
                        }
                        Err(_) => true,
                    };
                    (m.bytes, got, truncated)
                }
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return Err(VfioError::Timeout(cmd.name())),
                Err(e) => {
                    return Err(VfioError::io(
                        format!("vfio-user: reading the reply to {}", cmd.name()),
                        e.into(),
                    ))
                }
            };
            for fd in got {
                // SAFETY: `recvmsg` just installed this descriptor in our table from an
                // SCM_RIGHTS message; nothing else refers to it, so it is ours to own (and
                // to close on drop).
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
            if truncated {
                return Err(VfioError::Protocol(format!(
                    "the reply to {} carried too many descriptors",
                    cmd.name()
                )));
            }
            if n == 0 {
                return Err(VfioError::Protocol(format!(
                    "the server closed the connection during {}",
                    cmd.name()
                )));
            }
            filled += n;
        }
        Ok(())
    }
}

/// The vfio-user [`Transport`]: trapped region accesses and DMA mappings as messages on the
/// socket, one request at a time (a port is used from one thread).
#[derive(Debug)]
pub struct UserTransport {
    conn: RefCell<Conn>,
    /// Serializes the exchanges of this process and the children it forks, which share the
    /// socket with it (a request and its reply go together).
    turns: Option<super::SharedLock>,
    /// The DMA mappings the server accepted: IOVA to length.
    maps: RefCell<BTreeMap<u64, u64>>,
}

/// What a region's DEVICE_GET_REGION_INFO told.
struct Region {
    info: RegionInfo,
    areas: Vec<(u64, u64)>,
    fd: Option<OwnedFd>,
}

impl UserTransport {
    /// A transport over a connected `stream`, waiting at most `timeout` for each reply (it
    /// sends nothing yet: see [`UserTransport::negotiate`]).
    pub fn new(stream: UnixStream, timeout: Duration) -> Result<UserTransport, VfioError> {
        let timeout = timeout.max(Duration::from_millis(1));
        stream
            .set_write_timeout(Some(timeout))
            .map_err(|e| VfioError::io("vfio-user: setting the write timeout", e))?;
        Ok(UserTransport {
            conn: RefCell::new(Conn {
                stream,
                next_id: 0,
                timeout,
                max_xfer: DEFAULT_MAX_XFER,
                broken: None,
                cmsg: nix::cmsg_space!([RawFd; SCM_MAX_FD]),
            }),
            maps: RefCell::new(BTreeMap::new()),
            turns: super::SharedLock::new(),
        })
    }

    /// Negotiates the protocol version and capabilities (VERSION); the first message.
    pub fn negotiate(&self) -> Result<(), VfioError> {
        let caps = format!(
            "{{\"capabilities\":{{\"max_msg_fds\":1,\"max_data_xfer_size\":{MAX_XFER}}}}}\0"
        );
        let version = Version {
            major: U16::new(0),
            minor: U16::new(1),
        };
        let reply = self.call(
            Command::Version,
            &[version.as_bytes(), caps.as_bytes()],
            None,
            VERSION_REPLY,
        )?;
        let Ok((v, json)) = Version::read_from_prefix(&reply.payload) else {
            return Err(self.violation(Command::Version, "too short"));
        };
        if v.major.get() != 0 {
            return Err(self.violation(
                Command::Version,
                format!("unsupported version {}.{}", v.major.get(), v.minor.get()),
            ));
        }
        let json = json.split(|b| *b == 0).next().unwrap_or_default();
        let json = String::from_utf8_lossy(json);
        let max_xfer = match json_uint(&json, "max_data_xfer_size") {
            None => DEFAULT_MAX_XFER,
            Some(0) => {
                return Err(self.violation(Command::Version, "max_data_xfer_size is 0"));
            }
            Some(n) => usize::try_from(n).unwrap_or(MAX_XFER).min(MAX_XFER),
        };
        self.conn.borrow_mut().max_xfer = max_xfer;
        Ok(())
    }

    /// The most bytes one REGION_READ or REGION_WRITE carries (the server's limit, capped);
    /// longer accesses are split.
    pub fn max_data_xfer_size(&self) -> usize {
        self.conn.borrow().max_xfer
    }

    /// Sends a request and reads its reply; any failure but a refusal breaks the connection.
    fn call(
        &self,
        cmd: Command,
        parts: &[&[u8]],
        fd: Option<BorrowedFd<'_>>,
        max_payload: usize,
    ) -> Result<Reply, VfioError> {
        let _turn = self.turns.as_ref().map(super::SharedLock::lock);
        let mut conn = self.conn.borrow_mut();
        if let Some(why) = &conn.broken {
            return Err(VfioError::Protocol(format!(
                "the connection is unusable after an earlier failure ({why}); cannot send {}",
                cmd.name()
            )));
        }
        let result = conn.exchange(cmd, parts, fd, max_payload);
        if let Err(e) = &result {
            if !matches!(e, VfioError::Refused { .. }) {
                conn.broken = Some(e.to_string());
            }
        }
        result
    }

    /// Records a malformed reply to `cmd`: the connection is broken from now on.
    fn violation(&self, cmd: Command, what: impl std::fmt::Display) -> VfioError {
        let msg = format!("bad reply to {}: {what}", cmd.name());
        self.conn.borrow_mut().broken = Some(msg.clone());
        VfioError::Protocol(msg)
    }

    /// DEVICE_GET_INFO: the device's flags, number of regions and number of IRQ indexes.
    fn device_info(&self) -> Result<DeviceInfo, VfioError> {
        let req = DeviceInfo {
            argsz: U32::new(size_of::<DeviceInfo>() as u32),
            flags: U32::new(0),
            num_regions: U32::new(0),
            num_irqs: U32::new(0),
        };
        let reply = self.call(Command::DeviceGetInfo, &[req.as_bytes()], None, SMALL_REPLY)?;
        DeviceInfo::read_from_prefix(&reply.payload)
            .map(|(info, _)| info)
            .map_err(|_| self.violation(Command::DeviceGetInfo, "too short"))
    }

    /// DEVICE_GET_REGION_INFO for region `index`, asking with `argsz` (room for the
    /// capability chain), and once more if the server says it needs more room.
    fn region(&self, index: u32, argsz: usize) -> Result<Region, VfioError> {
        let cmd = Command::DeviceGetRegionInfo;
        let mut argsz = argsz.max(size_of::<RegionInfo>());
        let mut retried = false;
        loop {
            let req = RegionInfo {
                argsz: U32::new(argsz as u32),
                flags: U32::new(0),
                index: U32::new(index),
                cap_offset: U32::new(0),
                size: U64::new(0),
                offset: U64::new(0),
            };
            let mut reply = self.call(cmd, &[req.as_bytes()], None, MAX_REGION_INFO_ARGSZ)?;
            let Ok((info, _)) = RegionInfo::read_from_prefix(&reply.payload) else {
                return Err(self.violation(cmd, "too short"));
            };
            if info.index.get() != index {
                return Err(self.violation(
                    cmd,
                    format!("asked for region {index}, got {}", info.index.get()),
                ));
            }
            let wanted = info.argsz.get() as usize;
            let has_caps = info.flags.get() & vb::VFIO_REGION_INFO_FLAG_CAPS != 0;
            if has_caps && wanted > reply.payload.len() {
                // The capabilities did not fit in what we offered: ask once more with room
                // for them, within reason.
                if !retried && wanted > argsz && wanted <= MAX_REGION_INFO_ARGSZ {
                    retried = true;
                    argsz = wanted;
                    continue;
                }
                return Err(VfioError::BadRegion(format!(
                    "region {index}: the server wants {wanted} bytes for its capabilities \
                     and sent {}",
                    reply.payload.len()
                )));
            }
            let areas = if has_caps && reply.payload.len() > size_of::<RegionInfo>() {
                sparse_areas(&reply.payload, &info)?
            } else {
                Vec::new()
            };
            // One memory file at most is meaningful; any other descriptor is closed.
            let fd = (!reply.fds.is_empty()).then(|| reply.fds.swap_remove(0));
            return Ok(Region { info, areas, fd });
        }
    }

    /// DEVICE_GET_IRQ_INFO and DEVICE_SET_IRQS: an eventfd for MSI-X vector 0, or `None` if
    /// the device has no eventfd-signalled MSI-X.
    fn msix_eventfd(&self, num_irqs: u32) -> Result<Option<EventFd>, VfioError> {
        if num_irqs <= MSIX_IRQ {
            return Ok(None);
        }
        let cmd = Command::DeviceGetIrqInfo;
        let req = IrqInfo {
            argsz: U32::new(size_of::<IrqInfo>() as u32),
            flags: U32::new(0),
            index: U32::new(MSIX_IRQ),
            count: U32::new(0),
        };
        let reply = match self.call(cmd, &[req.as_bytes()], None, SMALL_REPLY) {
            Ok(r) => r,
            Err(VfioError::Refused { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let Ok((info, _)) = IrqInfo::read_from_prefix(&reply.payload) else {
            return Err(self.violation(cmd, "too short"));
        };
        if info.index.get() != MSIX_IRQ {
            return Err(self.violation(
                cmd,
                format!("asked for IRQ index {MSIX_IRQ}, got {}", info.index.get()),
            ));
        }
        if info.count.get() == 0 || info.flags.get() & vb::VFIO_IRQ_INFO_EVENTFD == 0 {
            return Ok(None);
        }
        let efd = EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC)
            .map_err(|e| VfioError::io("creating an eventfd", e))?;
        let set = IrqSet {
            argsz: U32::new(size_of::<IrqSet>() as u32),
            flags: U32::new(vb::VFIO_IRQ_SET_DATA_EVENTFD | vb::VFIO_IRQ_SET_ACTION_TRIGGER),
            index: U32::new(MSIX_IRQ),
            start: U32::new(0),
            count: U32::new(1),
        };
        // SAFETY: the descriptor belongs to `efd`, which lives until after the call returns.
        let fd = unsafe { BorrowedFd::borrow_raw(efd.as_raw_fd()) };
        self.call(
            Command::DeviceSetIrqs,
            &[set.as_bytes()],
            Some(fd),
            SMALL_REPLY,
        )?;
        Ok(Some(efd))
    }
}

impl Transport for UserTransport {
    fn region_read(&self, region: u32, offset: u64, data: &mut [u8]) -> Result<(), VfioError> {
        let cmd = Command::RegionRead;
        let max = self.max_data_xfer_size();
        let mut at = offset;
        for chunk in data.chunks_mut(max) {
            let req = RegionAccess {
                offset: U64::new(at),
                region: U32::new(region),
                count: U32::new(chunk.len() as u32),
            };
            let reply = self.call(
                cmd,
                &[req.as_bytes()],
                None,
                size_of::<RegionAccess>() + chunk.len(),
            )?;
            match RegionAccess::read_from_prefix(&reply.payload) {
                Ok((echo, bytes))
                    if echo.region.get() == region
                        && echo.offset.get() == at
                        && echo.count.get() as usize == chunk.len()
                        && bytes.len() == chunk.len() =>
                {
                    chunk.copy_from_slice(bytes);
                }
                _ => {
                    return Err(self.violation(
                        cmd,
                        format!(
                            "{} bytes do not answer {} bytes at {at:#x} of region {region}",
                            reply.payload.len(),
                            chunk.len()
                        ),
                    ))
                }
            }
            at = at.wrapping_add(chunk.len() as u64);
        }
        Ok(())
    }

    fn region_write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), VfioError> {
        let cmd = Command::RegionWrite;
        let max = self.max_data_xfer_size();
        let mut at = offset;
        for chunk in data.chunks(max) {
            let req = RegionAccess {
                offset: U64::new(at),
                region: U32::new(region),
                count: U32::new(chunk.len() as u32),
            };
            let reply = self.call(cmd, &[req.as_bytes(), chunk], None, SMALL_REPLY)?;
            match RegionAccess::read_from_prefix(&reply.payload) {
                Ok((echo, _))
                    if echo.region.get() == region
                        && echo.offset.get() == at
                        && echo.count.get() as usize == chunk.len() => {}
                _ => {
                    return Err(self.violation(
                        cmd,
                        format!("it does not echo {} bytes at {at:#x}", chunk.len()),
                    ))
                }
            }
            at = at.wrapping_add(chunk.len() as u64);
        }
        Ok(())
    }

    fn dma_map(&self, fd: BorrowedFd<'_>, len: u64, iova: u64) -> Result<(), PortError> {
        let Some(end) = iova.checked_add(len).filter(|_| len > 0) else {
            return Err(PortError::MapFailed(format!(
                "IOVA range {iova:#x}+{len:#x} is empty or wraps"
            )));
        };
        let overlaps = self
            .maps
            .borrow()
            .range(..end)
            .next_back()
            .is_some_and(|(&start, &l)| start + l > iova);
        if overlaps {
            return Err(PortError::Overlap { iova, len });
        }
        let req = DmaMap {
            argsz: U32::new(size_of::<DmaMap>() as u32),
            flags: U32::new(DMA_READ_WRITE),
            offset: U64::new(0),
            address: U64::new(iova),
            size: U64::new(len),
        };
        match self.call(Command::DmaMap, &[req.as_bytes()], Some(fd), SMALL_REPLY) {
            Ok(_) => {
                self.maps.borrow_mut().insert(iova, len);
                Ok(())
            }
            Err(VfioError::Refused { errno, .. }) => Err(PortError::MapFailed(format!(
                "the vfio-user server refused DMA_MAP of {iova:#x}+{len:#x} (errno {errno})"
            ))),
            Err(e) => Err(PortError::MapFailed(e.to_string())),
        }
    }

    fn dma_unmap(&self, iova: u64, len: u64) -> Result<(), PortError> {
        if self.maps.borrow().get(&iova) != Some(&len) {
            return Err(PortError::NotMapped { iova, len });
        }
        let req = DmaUnmap {
            argsz: U32::new(size_of::<DmaUnmap>() as u32),
            flags: U32::new(0),
            address: U64::new(iova),
            size: U64::new(len),
        };
        match self.call(Command::DmaUnmap, &[req.as_bytes()], None, SMALL_REPLY) {
            Ok(_) => {
                self.maps.borrow_mut().remove(&iova);
                Ok(())
            }
            Err(e) => Err(PortError::MapFailed(format!(
                "DMA_UNMAP of {iova:#x}+{len:#x}: {e}"
            ))),
        }
    }

    /// Why the connection is unusable, once it is.
    fn broken(&self) -> Option<String> {
        self.conn.borrow().broken.clone()
    }

    /// Sleeps about 20 µs: the device is another process (often on the same few cores) that
    /// needs the CPU to make progress, so spinning here would only slow it down. `false` once
    /// the connection is broken: nothing the server does can reach this client any more.
    fn idle(&self) -> bool {
        if self.conn.borrow().broken.is_some() {
            return false;
        }
        std::thread::sleep(Duration::from_micros(20));
        true
    }
}

/// The sparse-mmap areas in a DEVICE_GET_REGION_INFO reply `payload` (which starts with
/// `info`), walking its capability chain defensively: offsets must stay inside the reply and
/// strictly increase (so there is no loop), and the chain and the area count are bounded.
fn sparse_areas(payload: &[u8], info: &RegionInfo) -> Result<Vec<(u64, u64)>, VfioError> {
    let index = info.index.get();
    let bad = |what: String| VfioError::BadRegion(format!("region {index}: {what}"));
    let mut areas = Vec::new();
    let mut next = info.cap_offset.get() as usize;
    let mut prev = 0;
    for _ in 0..MAX_CAPS {
        if next == 0 {
            return Ok(areas);
        }
        if next < size_of::<RegionInfo>() || next <= prev {
            return Err(bad(format!("capability offset {next:#x} goes backwards")));
        }
        let Some(Ok((cap, rest))) = payload.get(next..).map(CapHeader::read_from_prefix) else {
            return Err(bad(format!(
                "capability at {next:#x} is outside the {} bytes sent",
                payload.len()
            )));
        };
        if u32::from(cap.id.get()) == vb::VFIO_REGION_INFO_CAP_SPARSE_MMAP {
            let Ok((sparse, rest)) = SparseMmap::read_from_prefix(rest) else {
                return Err(bad(format!(
                    "sparse-mmap capability at {next:#x} is cut off"
                )));
            };
            let n = sparse.nr_areas.get() as usize;
            if areas.len() + n > MAX_AREAS {
                return Err(bad(format!("{n} sparse-mmap areas is too many")));
            }
            let Ok((list, _)) = <[SparseArea]>::ref_from_prefix_with_elems(rest, n) else {
                return Err(bad(format!(
                    "{n} sparse-mmap areas do not fit in the reply"
                )));
            };
            areas.extend(list.iter().map(|a| (a.offset.get(), a.size.get())));
        }
        prev = next;
        next = cap.next.get() as usize;
    }
    if next == 0 {
        Ok(areas)
    } else {
        Err(bad(format!("more than {MAX_CAPS} capabilities")))
    }
}

/// The BAR0 windows that a DEVICE_GET_REGION_INFO reply `payload` (the region info, then its
/// capability chain) lets a client map, as [`plan_windows`] gives them: nothing without the
/// MMAP flag, the sparse-mmap areas when there are any, else the whole region. Every
/// malformed reply is an error, never a panic (the `vfio_region_info` fuzz target).
pub fn mappable_windows(payload: &[u8]) -> Result<Vec<(u64, u64)>, VfioError> {
    let Ok((info, _)) = RegionInfo::read_from_prefix(payload) else {
        return Err(VfioError::BadRegion(format!(
            "a region info of {} bytes is too short",
            payload.len()
        )));
    };
    let has_caps = info.flags.get() & vb::VFIO_REGION_INFO_FLAG_CAPS != 0;
    let areas = if has_caps && payload.len() > size_of::<RegionInfo>() {
        sparse_areas(payload, &info)?
    } else {
        Vec::new()
    };
    let mmap = info.flags.get() & vb::VFIO_REGION_INFO_FLAG_MMAP != 0;
    plan_windows(mmap, info.size.get(), &areas)
}

/// The unsigned integer value of `"key"` in a small JSON text, if it is there.
fn json_uint(json: &str, key: &str) -> Option<u64> {
    let quoted = format!("\"{key}\"");
    let at = json.find(&quoted)? + quoted.len();
    let rest = json[at..].trim_start().strip_prefix(':')?.trim_start();
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

impl VfioPort {
    /// Connects to the vfio-user server at `path` (waiting up to 5 s for each reply).
    pub fn connect(path: impl AsRef<Path>) -> Result<VfioPort, VfioError> {
        VfioPort::connect_with(path, DEFAULT_TIMEOUT)
    }

    /// Connects to the vfio-user server at `path`, waiting up to `timeout` for each reply.
    pub fn connect_with(path: impl AsRef<Path>, timeout: Duration) -> Result<VfioPort, VfioError> {
        let path = path.as_ref();
        let stream = UnixStream::connect(path).map_err(|e| {
            VfioError::io(
                format!("connecting to vfio-user socket {}", path.display()),
                e,
            )
        })?;
        let t = UserTransport::new(stream, timeout)?;
        t.negotiate()?;

        let dev = t.device_info()?;
        if dev.flags.get() & vb::VFIO_DEVICE_FLAGS_PCI == 0 {
            return Err(VfioError::Vfio(format!(
                "the vfio-user device is not a PCI device (flags {:#x})",
                dev.flags.get()
            )));
        }
        if dev.num_regions.get() <= CONFIG_REGION {
            return Err(VfioError::BadRegion(format!(
                "the device has {} regions, so no config space",
                dev.num_regions.get()
            )));
        }

        let bar0 = t.region(BAR0_REGION, REGION_INFO_ARGSZ)?;
        let rw = vb::VFIO_REGION_INFO_FLAG_READ | vb::VFIO_REGION_INFO_FLAG_WRITE;
        if bar0.info.size.get() == 0 || bar0.info.flags.get() & rw != rw {
            return Err(VfioError::BadRegion(format!(
                "BAR0 of {:#x} bytes with flags {:#x} is not a readable and writable BAR",
                bar0.info.size.get(),
                bar0.info.flags.get()
            )));
        }
        let config = t.region(CONFIG_REGION, size_of::<RegionInfo>())?;
        if config.info.size.get() < MIN_CONFIG_SIZE {
            return Err(VfioError::BadRegion(format!(
                "config space of {} bytes",
                config.info.size.get()
            )));
        }
        check_identity(&t)?;

        let bar = match &bar0.fd {
            Some(fd) => {
                let mmap = bar0.info.flags.get() & vb::VFIO_REGION_INFO_FLAG_MMAP != 0;
                let windows = plan_windows(mmap, bar0.info.size.get(), &bar0.areas)?;
                Bar::map(fd.as_fd(), bar0.info.offset.get(), &windows)?
            }
            None => Bar::default(),
        };
        // The mapping keeps the memory; the descriptor is no longer needed.
        drop(bar0);

        let irq = t.msix_eventfd(dev.num_irqs.get())?;
        Ok(VfioPort::new(bar, Box::new(t), irq))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::port::Port;
    use crate::vfio::wait_readable;
    use crate::DmaMemory;
    use ringbell_specs::regs;
    use std::fs::File;
    use std::io::{Read, Write};
    use std::os::unix::fs::FileExt;
    use std::os::unix::net::UnixListener;
    use std::path::PathBuf;
    use std::sync::{mpsc, Arc, Mutex};
    use std::thread::JoinHandle;
    use vfio_user::{DmaMapFlags, DmaUnmapFlags, Server, ServerBackend, ServerRegion};

    /// A trapped register whose write makes the fake device store the value at offset 0 of
    /// the latest DMA mapping (an outside-the-doorbells offset).
    const KICK: u64 = 0x100;
    const DOORBELL: u64 = regs::DB_BASE + 8;
    const IOVA: u64 = 0x1_0000_0000;

    fn sock_path(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!(
            "ringbell-vfio-user-{}-{name}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&p);
        p
    }

    /// What the fake device saw.
    #[derive(Default)]
    struct Seen {
        /// (region, offset, bytes, is a write)
        accesses: Vec<(u32, u64, Vec<u8>, bool)>,
        /// (flags, file offset, iova, size, memory file)
        maps: Vec<(DmaMapFlags, u64, u64, u64, File)>,
        unmaps: Vec<(u64, u64)>,
        /// (index, flags, start, count, eventfds)
        irqs: Vec<(u32, u32, u32, u32, Vec<File>)>,
    }

    struct Backend {
        bar: File,
        config: Vec<u8>,
        seen: Arc<Mutex<Seen>>,
    }

    fn refused(what: &str) -> std::io::Error {
        std::io::Error::other(what.to_string())
    }

    impl ServerBackend for Backend {
        fn region_read(
            &mut self,
            region: u32,
            offset: u64,
            data: &mut [u8],
        ) -> std::io::Result<()> {
            let end = offset
                .checked_add(data.len() as u64)
                .ok_or(refused("wraps"))?;
            match region {
                BAR0_REGION if end <= regs::BAR0_SIZE => self.bar.read_exact_at(data, offset)?,
                CONFIG_REGION if end <= self.config.len() as u64 => {
                    data.copy_from_slice(&self.config[offset as usize..end as usize])
                }
                _ => return Err(refused("outside the region")),
            }
            let mut seen = self.seen.lock().unwrap();
            seen.accesses.push((region, offset, data.to_vec(), false));
            Ok(())
        }

        fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> std::io::Result<()> {
            let end = offset
                .checked_add(data.len() as u64)
                .ok_or(refused("wraps"))?;
            if region != BAR0_REGION || end > regs::BAR0_SIZE {
                return Err(refused("not writable"));
            }
            let mut seen = self.seen.lock().unwrap();
            seen.accesses.push((region, offset, data.to_vec(), true));
            if offset == KICK {
                let (.., file) = seen.maps.last().ok_or(refused("no DMA mapping"))?;
                file.write_all_at(data, 0)?;
            } else {
                self.bar.write_all_at(data, offset)?;
            }
            Ok(())
        }

        fn dma_map(
            &mut self,
            flags: DmaMapFlags,
            offset: u64,
            address: u64,
            size: u64,
            fd: Option<File>,
        ) -> std::io::Result<()> {
            let file = fd.ok_or(refused("no memory file"))?;
            if offset + size > file.metadata()?.len() {
                return Err(refused("beyond the memory file"));
            }
            let mut seen = self.seen.lock().unwrap();
            seen.maps.push((flags, offset, address, size, file));
            Ok(())
        }

        fn dma_unmap(&mut self, _: DmaUnmapFlags, address: u64, size: u64) -> std::io::Result<()> {
            let mut seen = self.seen.lock().unwrap();
            let at = seen
                .maps
                .iter()
                .position(|m| m.2 == address && m.3 == size)
                .ok_or(refused("not mapped"))?;
            seen.maps.remove(at);
            seen.unmaps.push((address, size));
            Ok(())
        }

        fn reset(&mut self) -> std::io::Result<()> {
            Ok(())
        }

        fn set_irqs(
            &mut self,
            index: u32,
            flags: u32,
            start: u32,
            count: u32,
            fds: Vec<File>,
        ) -> std::io::Result<()> {
            let mut seen = self.seen.lock().unwrap();
            seen.irqs.push((index, flags, start, count, fds));
            Ok(())
        }
    }

    /// A fake ringbell NIC served on a thread (one client).
    struct Fake {
        path: PathBuf,
        /// BAR0's memory, as the server shares it.
        bar: DmaMemory,
        seen: Arc<Mutex<Seen>>,
        server: JoinHandle<Result<(), String>>,
    }

    impl Fake {
        fn start(name: &str, vendor: u16) -> Fake {
            let path = sock_path(name);
            let bar = DmaMemory::new(regs::BAR0_SIZE as usize).unwrap();
            let mut config = vec![0u8; 256];
            config[0..2].copy_from_slice(&vendor.to_le_bytes());
            config[2..4].copy_from_slice(&regs::PCI_DEVICE_ID.to_le_bytes());
            let seen = Arc::new(Mutex::new(Seen::default()));
            let backend = Backend {
                bar: File::from(bar.fd().unwrap().try_clone_to_owned().unwrap()),
                config,
                seen: seen.clone(),
            };
            let rw = vb::VFIO_REGION_INFO_FLAG_READ | vb::VFIO_REGION_INFO_FLAG_WRITE;
            let regions = (0..vb::VFIO_PCI_NUM_REGIONS)
                .map(|index| {
                    let (flags, size) = match index {
                        BAR0_REGION => (rw | vb::VFIO_REGION_INFO_FLAG_MMAP, regs::BAR0_SIZE),
                        CONFIG_REGION => (rw, 256),
                        _ => (0, 0),
                    };
                    let bar0 = index == BAR0_REGION;
                    ServerRegion {
                        region_info: vb::vfio_region_info {
                            argsz: size_of::<vb::vfio_region_info>() as u32,
                            flags,
                            index,
                            cap_offset: 0,
                            size,
                            offset: 0,
                        },
                        sparse_areas: if bar0 {
                            vec![vfio_user::SparseArea {
                                area: vb::vfio_region_sparse_mmap_area {
                                    offset: regs::DB_BASE,
                                    size: regs::DB_END - regs::DB_BASE,
                                },
                            }]
                        } else {
                            Vec::new()
                        },
                        mmap_fd: bar0.then(|| backend.bar.as_raw_fd()),
                    }
                })
                .collect();
            let irqs = (0..vb::VFIO_PCI_NUM_IRQS)
                .map(|index| vfio_user::IrqInfo {
                    index,
                    flags: if index == MSIX_IRQ {
                        vb::VFIO_IRQ_INFO_EVENTFD
                    } else {
                        0
                    },
                    count: u32::from(index == MSIX_IRQ),
                })
                .collect();
            let server = Server::new(&path, false, irqs, regions).unwrap();
            let server = std::thread::spawn(move || {
                let mut backend = backend;
                server.run(&mut backend).map_err(|e| e.to_string())
            });
            Fake {
                path,
                bar,
                seen,
                server,
            }
        }

        /// Waits for the server to see the client go.
        fn finish(self) {
            assert_eq!(self.server.join().unwrap(), Ok(()));
        }
    }

    fn read_u32(mem: &DmaMemory, offset: usize) -> u32 {
        let mut b = [0u8; 4];
        mem.read(offset, &mut b).unwrap();
        u32::from_le_bytes(b)
    }

    #[test]
    fn connect_checks_identity_and_maps_the_doorbells() {
        let fake = Fake::start("connect", regs::PCI_VENDOR_ID);
        let port = VfioPort::connect(&fake.path).unwrap();
        assert_eq!(
            port.mapped_windows(),
            vec![(regs::DB_BASE, regs::DB_END - regs::DB_BASE)]
        );
        {
            let seen = fake.seen.lock().unwrap();
            // Only the identity check reached a region.
            assert_eq!(seen.accesses.len(), 1);
            assert_eq!(seen.accesses[0].0, CONFIG_REGION);
            assert_eq!(seen.irqs.len(), 1);
            let (index, flags, start, count, fds) = &seen.irqs[0];
            assert_eq!((*index, *start, *count, fds.len()), (MSIX_IRQ, 0, 1, 1));
            assert_eq!(
                *flags,
                vb::VFIO_IRQ_SET_DATA_EVENTFD | vb::VFIO_IRQ_SET_ACTION_TRIGGER
            );
        }
        drop(port);
        fake.finish();
    }

    #[test]
    fn trapped_register_accesses_reach_the_backend() {
        let fake = Fake::start("trapped", regs::PCI_VENDOR_ID);
        let port = VfioPort::connect(&fake.path).unwrap();
        fake.seen.lock().unwrap().accesses.clear();

        port.write32(0x40, 0xA5A5_0001);
        assert_eq!(read_u32(&fake.bar, 0x40), 0xA5A5_0001);
        assert_eq!(port.read32(0x40), 0xA5A5_0001);
        port.write_block(0x200, &[0x5A; 64]);
        let mut blk = [0u8; 64];
        fake.bar.read(0x200, &mut blk).unwrap();
        assert_eq!(blk, [0x5A; 64]);
        {
            let seen = fake.seen.lock().unwrap();
            assert_eq!(
                seen.accesses,
                vec![
                    (
                        BAR0_REGION,
                        0x40,
                        0xA5A5_0001u32.to_le_bytes().to_vec(),
                        true
                    ),
                    (
                        BAR0_REGION,
                        0x40,
                        0xA5A5_0001u32.to_le_bytes().to_vec(),
                        false
                    ),
                    (BAR0_REGION, 0x200, vec![0x5A; 64], true),
                ]
            );
        }
        // A read the device refuses reads as all-ones; the connection stays usable.
        assert_eq!(port.read32(regs::BAR0_SIZE), u32::MAX);
        assert_eq!(port.access_errors(), 1);
        assert_eq!(port.read32(0x40), 0xA5A5_0001);
        assert_eq!(port.access_errors(), 1);
        drop(port);
        fake.finish();
    }

    #[test]
    fn a_doorbell_store_lands_in_shared_memory_without_a_message() {
        let fake = Fake::start("doorbell", regs::PCI_VENDOR_ID);
        let port = VfioPort::connect(&fake.path).unwrap();
        let before = fake.seen.lock().unwrap().accesses.len();
        port.write32(DOORBELL, 0x0000_BEEF);
        assert_eq!(read_u32(&fake.bar, DOORBELL as usize), 0x0000_BEEF);
        assert_eq!(fake.seen.lock().unwrap().accesses.len(), before);
        drop(port);
        fake.finish();
    }

    #[test]
    fn dma_map_hands_the_server_a_working_memory_file() {
        let fake = Fake::start("dma", regs::PCI_VENDOR_ID);
        let port = VfioPort::connect(&fake.path).unwrap();
        let mem = DmaMemory::new(0x10000).unwrap();
        port.dma_map(mem.fd().unwrap(), 0x10000, IOVA).unwrap();
        {
            let seen = fake.seen.lock().unwrap();
            let (flags, offset, iova, size, _) = &seen.maps[0];
            assert_eq!(
                (*flags, *offset, *iova, *size),
                (DmaMapFlags::READ_WRITE, 0, IOVA, 0x10000)
            );
        }
        // The device writes into the memory through the file it received.
        port.write32(KICK, 0x1234_5678);
        assert_eq!(read_u32(&mem, 0), 0x1234_5678);

        port.dma_unmap(IOVA, 0x10000).unwrap();
        assert_eq!(fake.seen.lock().unwrap().unmaps, vec![(IOVA, 0x10000)]);
        assert!(matches!(
            port.dma_unmap(IOVA, 0x10000),
            Err(PortError::NotMapped { .. })
        ));
        drop(port);
        fake.finish();
    }

    #[test]
    fn dma_map_errors_are_reported() {
        let fake = Fake::start("dma-errors", regs::PCI_VENDOR_ID);
        let port = VfioPort::connect(&fake.path).unwrap();
        let mem = DmaMemory::new(0x10000).unwrap();

        // The server refuses a mapping beyond the file; nothing is recorded locally.
        let huge = port.dma_map(mem.fd().unwrap(), 1 << 40, IOVA);
        assert!(matches!(huge, Err(PortError::MapFailed(_))), "{huge:?}");
        port.dma_map(mem.fd().unwrap(), 0x10000, IOVA).unwrap();

        // Overlaps and unknown unmaps are caught before anything is sent.
        for (iova, len) in [
            (IOVA, 0x1000),
            (IOVA + 0xF000, 0x2000),
            (IOVA - 0x1000, 0x2000),
        ] {
            let r = port.dma_map(mem.fd().unwrap(), len, iova);
            assert!(
                matches!(r, Err(PortError::Overlap { iova: i, len: l }) if i == iova && l == len),
                "{r:?}"
            );
        }
        port.dma_map(mem.fd().unwrap(), 0x1000, IOVA + 0x10000)
            .unwrap();
        for (iova, len) in [(IOVA + 0x20000, 0x1000), (IOVA, 0x1000)] {
            let r = port.dma_unmap(iova, len);
            assert!(matches!(r, Err(PortError::NotMapped { .. })), "{r:?}");
        }
        {
            let seen = fake.seen.lock().unwrap();
            assert_eq!(seen.maps.len(), 2);
            assert!(seen.unmaps.is_empty());
        }
        drop(port);
        fake.finish();
    }

    #[test]
    fn the_eventfd_reaches_the_server_and_wakes_the_port() {
        let fake = Fake::start("irq", regs::PCI_VENDOR_ID);
        let port = VfioPort::connect(&fake.path).unwrap();
        let fd = port.interrupt_fd(0).unwrap();
        assert!(port.interrupt_fd(1).is_none());
        assert!(!wait_readable(fd, Duration::from_millis(10)).unwrap());
        {
            let mut seen = fake.seen.lock().unwrap();
            let efd = &mut seen.irqs[0].4[0];
            efd.write_all(&1u64.to_ne_bytes()).unwrap();
        }
        assert!(wait_readable(fd, Duration::from_secs(5)).unwrap());
        drop(port);
        fake.finish();
    }

    #[test]
    fn region_info_is_asked_again_with_room_for_the_capabilities() {
        let fake = Fake::start("retry", regs::PCI_VENDOR_ID);
        let t =
            UserTransport::new(UnixStream::connect(&fake.path).unwrap(), DEFAULT_TIMEOUT).unwrap();
        t.negotiate().unwrap();
        assert_eq!(t.max_data_xfer_size(), 1 << 20);
        // Offered no room at first, the client asks again and gets the areas and the file.
        let bar0 = t.region(BAR0_REGION, size_of::<RegionInfo>()).unwrap();
        assert_eq!(
            bar0.areas,
            vec![(regs::DB_BASE, regs::DB_END - regs::DB_BASE)]
        );
        assert!(bar0.fd.is_some());
        assert_eq!(bar0.info.size.get(), regs::BAR0_SIZE);
        // A region index the server does not have is refused with EINVAL.
        let r = t.region(vb::VFIO_PCI_NUM_REGIONS, size_of::<RegionInfo>());
        assert!(
            matches!(
                r,
                Err(VfioError::Refused {
                    command: "DEVICE_GET_REGION_INFO",
                    errno: 22
                })
            ),
            "{:?}",
            r.err()
        );
        drop(t);
        fake.finish();
    }

    #[test]
    fn a_wrong_vendor_is_not_ringbell() {
        let fake = Fake::start("vendor", 0x8086);
        let r = VfioPort::connect(&fake.path);
        assert!(
            matches!(
                r,
                Err(VfioError::NotRingbell { vendor: 0x8086, device }) if device == regs::PCI_DEVICE_ID
            ),
            "{r:?}"
        );
        fake.finish();
    }

    #[test]
    fn a_silent_server_times_out() {
        let path = sock_path("silent");
        let listener = UnixListener::bind(&path).unwrap();
        let (done, hold) = mpsc::channel::<()>();
        let server = std::thread::spawn(move || {
            let (_stream, _) = listener.accept().unwrap();
            let _ = hold.recv_timeout(Duration::from_secs(10));
        });
        let start = Instant::now();
        let r = VfioPort::connect_with(&path, Duration::from_millis(200));
        let took = start.elapsed();
        assert!(matches!(r, Err(VfioError::Timeout("VERSION"))), "{r:?}");
        assert!(took >= Duration::from_millis(150), "{took:?}");
        assert!(took < Duration::from_secs(2), "{took:?}");
        done.send(()).unwrap();
        server.join().unwrap();
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_reply_with_the_wrong_message_id_is_a_protocol_error() {
        let path = sock_path("wrong-id");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut raw = [0u8; 16];
            stream.read_exact(&mut raw).unwrap();
            let req = Header::read_from_bytes(&raw).unwrap();
            let mut rest = vec![0u8; req.message_size.get() as usize - 16];
            stream.read_exact(&mut rest).unwrap();
            let json = b"{\"capabilities\":{}}\0";
            let reply = Header {
                message_id: U16::new(req.message_id.get().wrapping_add(1)),
                command: req.command,
                message_size: U32::new((16 + 4 + json.len()) as u32),
                flags: U32::new(FLAG_REPLY),
                error: U32::new(0),
            };
            let mut msg = reply.as_bytes().to_vec();
            msg.extend_from_slice(&[0, 0, 0, 0]);
            msg.extend_from_slice(json);
            // The client may hang up as soon as it has read the header.
            let _ = stream.write_all(&msg);
            // Hold the connection until the client goes.
            let _ = stream.read(&mut raw);
        });
        let r = VfioPort::connect_with(&path, Duration::from_secs(2));
        assert!(
            matches!(&r, Err(VfioError::Protocol(m)) if m.contains("VERSION #0")),
            "{r:?}"
        );
        server.join().unwrap();
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_port_whose_server_is_gone_stops_progressing() {
        use crate::port::Port;
        let (a, b) = UnixStream::pair().unwrap();
        let t = UserTransport::new(a, Duration::from_millis(200)).unwrap();
        let port = VfioPort::new(Bar::default(), Box::new(t), None);
        assert!(port.progress(), "a live connection may progress");
        assert_eq!(port.failure(), None);
        // The server dies: the next trapped access fails, and a driver waiting on the device
        // (a command, a destroy in a drop) must be told instead of spinning forever.
        drop(b);
        assert_eq!(port.read32(regs::CMD_STATUS), u32::MAX);
        assert!(!port.progress(), "a dead server cannot progress");
        let why = port.failure().expect("the port says why");
        assert!(why.contains("REGION_READ"), "{why}");
    }

    #[test]
    fn the_connection_is_broken_after_a_timeout() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let t = UserTransport::new(a, Duration::from_millis(200)).unwrap();
        let mut data = [0u8; 4];
        let r = t.region_read(BAR0_REGION, 0, &mut data);
        assert!(matches!(r, Err(VfioError::Timeout("REGION_READ"))), "{r:?}");
        // The request went out; a late reply must not be taken for the next answer.
        let mut raw = [0u8; 32];
        b.read_exact(&mut raw).unwrap();
        b.write_all(&raw).unwrap();
        let start = Instant::now();
        let r = t.region_read(BAR0_REGION, 0, &mut data);
        assert!(matches!(r, Err(VfioError::Protocol(_))), "{r:?}");
        assert!(start.elapsed() < Duration::from_millis(150));
        let mem = DmaMemory::new(4096).unwrap();
        let r = t.dma_map(mem.fd().unwrap(), 4096, 0);
        assert!(matches!(r, Err(PortError::MapFailed(_))), "{r:?}");
    }

    #[test]
    fn wire_layouts_are_little_endian() {
        let h = Header {
            message_id: U16::new(0x0102),
            command: U16::new(Command::RegionRead as u16),
            message_size: U32::new(32),
            flags: U32::new(FLAG_REPLY | FLAG_ERROR),
            error: U32::new(22),
        };
        assert_eq!(
            h.as_bytes(),
            [2, 1, 9, 0, 32, 0, 0, 0, 0x21, 0, 0, 0, 22, 0, 0, 0]
        );
        let a = RegionAccess {
            offset: U64::new(0x1000),
            region: U32::new(7),
            count: U32::new(4),
        };
        assert_eq!(
            a.as_bytes(),
            [0, 0x10, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 4, 0, 0, 0]
        );
    }

    #[test]
    fn server_capabilities_are_read_from_the_json() {
        let json = r#"{"capabilities":{"max_msg_fds":1,"max_data_xfer_size": 4096,"migration":{"pgsize":4096}}}"#;
        assert_eq!(json_uint(json, "max_data_xfer_size"), Some(4096));
        assert_eq!(json_uint(json, "max_msg_fds"), Some(1));
        assert_eq!(json_uint(json, "absent"), None);
        assert_eq!(
            json_uint(r#"{"max_data_xfer_size":"x"}"#, "max_data_xfer_size"),
            None
        );
    }

    /// A region-info reply: the info, then capabilities at the given offsets.
    fn region_reply(cap_offset: u32, caps: &[(usize, Vec<u8>)]) -> (Vec<u8>, RegionInfo) {
        let end = caps.iter().map(|(at, c)| at + c.len()).max().unwrap_or(32);
        let mut buf = vec![0u8; end.max(32)];
        let info = RegionInfo {
            argsz: U32::new(buf.len() as u32),
            flags: U32::new(vb::VFIO_REGION_INFO_FLAG_CAPS),
            index: U32::new(0),
            cap_offset: U32::new(cap_offset),
            size: U64::new(regs::BAR0_SIZE),
            offset: U64::new(0),
        };
        buf[..32].copy_from_slice(info.as_bytes());
        for (at, c) in caps {
            buf[*at..at + c.len()].copy_from_slice(c);
        }
        (buf, info)
    }

    fn cap(id: u16, next: u32, areas: Option<(u32, &[(u64, u64)])>) -> Vec<u8> {
        let mut v = CapHeader {
            id: U16::new(id),
            version: U16::new(1),
            next: U32::new(next),
        }
        .as_bytes()
        .to_vec();
        if let Some((n, list)) = areas {
            v.extend_from_slice(
                SparseMmap {
                    nr_areas: U32::new(n),
                    reserved: U32::new(0),
                }
                .as_bytes(),
            );
            for &(offset, size) in list {
                v.extend_from_slice(
                    SparseArea {
                        offset: U64::new(offset),
                        size: U64::new(size),
                    }
                    .as_bytes(),
                );
            }
        }
        v
    }

    #[test]
    fn the_capability_chain_is_walked_defensively() {
        let sparse = vb::VFIO_REGION_INFO_CAP_SPARSE_MMAP as u16;
        let areas: &[(u64, u64)] = &[(0x10000, 0x1000), (0x20000, 0x2000)];
        // An unknown capability, then the sparse one.
        let (buf, info) = region_reply(
            32,
            &[
                (32, cap(99, 48, None)),
                (48, cap(sparse, 0, Some((2, areas)))),
            ],
        );
        assert_eq!(sparse_areas(&buf, &info).unwrap(), areas.to_vec());

        let bad_chains = [
            // Points at itself.
            region_reply(32, &[(32, cap(sparse, 32, Some((0, &[]))))]),
            // Goes backwards.
            region_reply(48, &[(32, cap(99, 0, None)), (48, cap(99, 32, None))]),
            // Starts inside the region info.
            region_reply(8, &[(32, cap(99, 0, None))]),
            // Points past the reply.
            region_reply(32, &[(32, cap(99, 4096, None))]),
            // More areas than were sent.
            region_reply(32, &[(32, cap(sparse, 0, Some((3, areas))))]),
            // An absurd number of areas.
            region_reply(32, &[(32, cap(sparse, 0, Some((u32::MAX, areas))))]),
        ];
        for (buf, info) in &bad_chains {
            let r = sparse_areas(buf, info);
            assert!(matches!(r, Err(VfioError::BadRegion(_))), "{r:?}");
            let r = mappable_windows(buf);
            assert!(matches!(r, Err(VfioError::BadRegion(_))), "{r:?}");
        }
        // The whole reply: the MMAP flag decides, the areas limit.
        let (mut buf, _) = region_reply(32, &[(32, cap(sparse, 0, Some((2, areas))))]);
        assert_eq!(mappable_windows(&buf).unwrap(), vec![]);
        let flags = vb::VFIO_REGION_INFO_FLAG_CAPS | vb::VFIO_REGION_INFO_FLAG_MMAP;
        buf[4..8].copy_from_slice(&flags.to_le_bytes());
        assert_eq!(mappable_windows(&buf).unwrap(), areas.to_vec());
        buf[4..8].copy_from_slice(&vb::VFIO_REGION_INFO_FLAG_MMAP.to_le_bytes());
        assert_eq!(mappable_windows(&buf).unwrap(), vec![(0, regs::BAR0_SIZE)]);
        assert!(mappable_windows(&buf[..31]).is_err());
        // A chain longer than the bound.
        let caps: Vec<_> = (0..=MAX_CAPS)
            .map(|i| (32 + 8 * i, cap(99, (32 + 8 * (i + 1)) as u32, None)))
            .collect();
        let (buf, info) = region_reply(32, &caps);
        assert!(matches!(
            sparse_areas(&buf, &info),
            Err(VfioError::BadRegion(_))
        ));
    }
}
