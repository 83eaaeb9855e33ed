//! Connection management over datagrams, modelled on the IBTA CM (chapter 12): two RC QPs
//! on different devices are connected by messages between the devices' general services
//! QPs (QPN 1, Q_Key [`GSI_QKEY`]), with no out-of-band exchange.
//!
//! The active side calls [`ConnectionManager::connect`] with its QP (in RESET), the peer's
//! address and a service id; the passive side has called [`ConnectionManager::listen`] on
//! that service id. Then:
//!
//! ```text
//! active                              passive
//!  REQ (QPN, PSN, MTU, rd_atomic, private data)  ->   ConnectRequest event
//!                                                     accept(): QP to RTR
//!                  <-  REP (QPN, PSN, rd_atomic, private data)
//!  QP to RTR, RTS, RTU  ->
//!  Established event                                  QP to RTS, Established event
//! ```
//!
//! or a REJ with a reason (no listener on the service id, or the application's
//! [`ConnectionManager::reject`]). While the passive application decides, an MRA (message
//! receipt acknowledgement) tells the active side to stop repeating its REQ and wait. [`ConnectionManager::disconnect`] sends a DREQ that the
//! peer answers with a DREP; both sides see [`CmEvent::Disconnected`]. REQ, REP and DREQ are
//! repeated after a timeout that doubles each time, up to [`CmConfig::retries`] times, so
//! the protocol survives datagram loss: a lost REQ is sent again; a repeated REQ is answered
//! with the REP (or REJ) it got before; a lost RTU is made up by the repeated REP, which the
//! active side answers with another RTU. A message that does not parse, names an unknown
//! connection, or arrives in a state that does not expect it is dropped and counted
//! ([`CmStats`]).
//!
//! Time is the device clock, so that on the in-process emulator the protocol is as
//! deterministic as the rest of a run: when nothing is left to do but wait for a timer,
//! [`ConnectionManager::poll`] lets the device's idle clock run to it
//! ([`crate::Port::idle_until`]).
//!
//! Progress is by polling: the application calls [`ConnectionManager::poll`] (which also
//! drives the device) until the event it waits for arrives.

use crate::cq::CompletionQueue;
use crate::device::{Device, DmaBuffer};
use crate::error::Error;
use crate::mr::{MemoryRegion, ProtectionDomain};
use crate::qp::{ConnectOptions, Endpoint, QpInit, QpType, QueuePair, RecvWr, SendWr, WrOp};
use crate::ud::{AddressHandle, AhAttr, UdDest, GRH_LEN};
use crate::{Access, QpState, WcStatus, WorkCompletion};
use ringbell_specs::cmd::{GSI_QKEY, GSI_QPN};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;

pub use ringbell_specs::cmd::GSI_QKEY as CM_QKEY;

/// Bytes of the fixed part of every CM message.
pub const CM_HEADER_LEN: usize = 40;
/// Largest private data of a REQ (as the IBTA's REQ).
pub const MAX_REQ_PRIVATE: usize = 92;
/// Largest private data of a REP (as the IBTA's REP).
pub const MAX_REP_PRIVATE: usize = 196;
/// Largest private data of a REJ (as the IBTA's REJ).
pub const MAX_REJ_PRIVATE: usize = 148;
/// Largest private data of a SIDR REQ (as the IBTA's).
pub const MAX_SIDR_REQ_PRIVATE: usize = 216;
/// Largest private data of a SIDR REP (as the IBTA's).
pub const MAX_SIDR_REP_PRIVATE: usize = 136;
/// SIDR REP status: the QP and Q_Key are valid (IBTA "valid").
pub const SIDR_OK: u16 = 0;
/// SIDR REP status: no listener on the service id (IBTA "service ID not supported").
pub const SIDR_NO_SERVICE: u16 = 1;
/// SIDR REP status: the application refused (IBTA "rejected by the service provider").
pub const SIDR_REJECTED: u16 = 2;
/// Largest private data of RTU, DREQ and DREP.
pub const MAX_OTHER_PRIVATE: usize = 220;
/// Largest CM message.
pub const MAX_CM_MSG: usize = CM_HEADER_LEN + MAX_OTHER_PRIVATE;
/// Version byte of ringbell's CM messages.
pub const CM_VERSION: u8 = 1;

/// REJ reason: no listener on the service id (IBTA "invalid service ID").
pub const REJ_INVALID_SERVICE_ID: u16 = 8;
/// REJ reason: the application refused the request (IBTA "consumer reject").
pub const REJ_CONSUMER: u16 = 28;
/// REJ reason: the message named a connection the receiver does not know (IBTA "invalid
/// communication ID").
pub const REJ_INVALID_COMM_ID: u16 = 6;

/// The kinds of CM message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum CmKind {
    /// Connect request.
    Req = 1,
    /// Reply: the passive side accepts.
    Rep = 2,
    /// Ready to use: the active side is in RTS.
    Rtu = 3,
    /// Reject, with a reason.
    Rej = 4,
    /// Disconnect request.
    Dreq = 5,
    /// Disconnect reply.
    Drep = 6,
    /// Service id resolution request (a datagram peer asks for a UD QP).
    SidrReq = 7,
    /// Service id resolution reply: a status, and the UD QP and Q_Key.
    SidrRep = 8,
    /// Message receipt acknowledgement: the passive side has the REQ and its application
    /// is deciding; the active side stops repeating the REQ for a long while.
    Mra = 9,
}

impl CmKind {
    fn from_u8(v: u8) -> Option<CmKind> {
        Some(match v {
            1 => CmKind::Req,
            2 => CmKind::Rep,
            3 => CmKind::Rtu,
            4 => CmKind::Rej,
            5 => CmKind::Dreq,
            6 => CmKind::Drep,
            7 => CmKind::SidrReq,
            8 => CmKind::SidrRep,
            9 => CmKind::Mra,
            _ => return None,
        })
    }
    /// The most private data a message of this kind carries.
    pub fn max_private(self) -> usize {
        match self {
            CmKind::Req => MAX_REQ_PRIVATE,
            CmKind::Rep => MAX_REP_PRIVATE,
            CmKind::Rej => MAX_REJ_PRIVATE,
            CmKind::SidrReq => MAX_SIDR_REQ_PRIVATE,
            CmKind::SidrRep => MAX_SIDR_REP_PRIVATE,
            _ => MAX_OTHER_PRIVATE,
        }
    }
}

/// A CM message. On the wire (big-endian, as the IBTA's MADs):
///
/// ```text
/// 0x00  kind (u8) | version (u8) | private_len (u16)
/// 0x04  local_comm_id (u32)     the sender's id of the connection
/// 0x08  remote_comm_id (u32)    the receiver's id (0 in a REQ)
/// 0x0C  reason (u16) | path_mtu (u8) | rsvd (u8)
/// 0x10  service_id (u64)
/// 0x18  qpn (u32, 24 bits)      the sender's RC QP (REQ, REP), UD QP (SIDR REP)
/// 0x1C  psn (u32, 24 bits)      the first PSN it sends; in a SIDR REP the Q_Key (u32)
/// 0x20  responder_resources (u8) | initiator_depth (u8) | retry_cnt (u8) | rnr_retry (u8)
/// 0x24  timeout (u8) | min_rnr_timer (u8) | rsvd (u16)
/// 0x28  private data (private_len bytes)
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct CmMsg {
    /// What the message is.
    pub kind: Option<CmKind>,
    /// The sender's connection id.
    pub local_comm_id: u32,
    /// The receiver's connection id (0 in a REQ).
    pub remote_comm_id: u32,
    /// REJ: why; SIDR REP: the status.
    pub reason: u16,
    /// REQ: the path MTU code the active side wants (1..=5).
    pub path_mtu: u8,
    /// REQ: the service id.
    pub service_id: u64,
    /// REQ, REP: the sender's RC QPN.
    pub qpn: u32,
    /// REQ, REP: the PSN the sender starts with.
    pub psn: u32,
    /// SIDR REP: the Q_Key of the UD QP (in the PSN's place).
    pub qkey: u32,
    /// READs/atomics the sender serves at once as responder.
    pub responder_resources: u8,
    /// READs/atomics the sender issues at once as requester.
    pub initiator_depth: u8,
    /// REQ: transport retries.
    pub retry_cnt: u8,
    /// REQ: RNR retries.
    pub rnr_retry: u8,
    /// REQ: local ACK timeout exponent.
    pub timeout: u8,
    /// REQ, REP: the RNR timer the sender asks its peer to wait.
    pub min_rnr_timer: u8,
    /// Application data.
    pub private: Vec<u8>,
}

/// Why a CM message was refused by [`CmMsg::parse`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmParseError {
    /// Shorter than its header or its private data.
    Truncated,
    /// A kind byte no message has.
    UnknownKind(u8),
    /// A version this CM does not speak.
    BadVersion(u8),
    /// More private data than the kind allows.
    PrivateTooLong,
}

fn be16(b: &[u8], o: usize) -> u16 {
    u16::from_be_bytes([b[o], b[o + 1]])
}
fn be32(b: &[u8], o: usize) -> u32 {
    u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

impl CmMsg {
    /// A message of `kind` about connection `local` (ours) / `remote` (the peer's), with
    /// every other field zero.
    fn about(kind: CmKind, local: u32, remote: u32) -> CmMsg {
        CmMsg {
            kind: Some(kind),
            local_comm_id: local,
            remote_comm_id: remote,
            ..Default::default()
        }
    }

    /// Parses a message; never panics.
    pub fn parse(b: &[u8]) -> Result<CmMsg, CmParseError> {
        if b.len() < CM_HEADER_LEN {
            return Err(CmParseError::Truncated);
        }
        let kind = CmKind::from_u8(b[0]).ok_or(CmParseError::UnknownKind(b[0]))?;
        if b[1] != CM_VERSION {
            return Err(CmParseError::BadVersion(b[1]));
        }
        let plen = usize::from(be16(b, 2));
        if plen > kind.max_private() {
            return Err(CmParseError::PrivateTooLong);
        }
        let private = b
            .get(CM_HEADER_LEN..CM_HEADER_LEN + plen)
            .ok_or(CmParseError::Truncated)?;
        let mut sid = [0u8; 8];
        sid.copy_from_slice(&b[0x10..0x18]);
        Ok(CmMsg {
            kind: Some(kind),
            local_comm_id: be32(b, 4),
            remote_comm_id: be32(b, 8),
            reason: be16(b, 0x0C),
            path_mtu: b[0x0E],
            service_id: u64::from_be_bytes(sid),
            qpn: be32(b, 0x18) & 0x00FF_FFFF,
            psn: match kind {
                CmKind::SidrRep => 0,
                _ => be32(b, 0x1C) & 0x00FF_FFFF,
            },
            qkey: match kind {
                CmKind::SidrRep => be32(b, 0x1C),
                _ => 0,
            },
            responder_resources: b[0x20],
            initiator_depth: b[0x21],
            retry_cnt: b[0x22],
            rnr_retry: b[0x23],
            timeout: b[0x24],
            min_rnr_timer: b[0x25],
            private: private.to_vec(),
        })
    }

    /// Writes the message into `out` (cleared first). The private data is cut at the
    /// kind's limit.
    pub fn emit(&self, out: &mut Vec<u8>) {
        let kind = self.kind.unwrap_or(CmKind::Rej);
        let plen = self.private.len().min(kind.max_private());
        out.clear();
        out.resize(CM_HEADER_LEN, 0);
        out[0] = kind as u8;
        out[1] = CM_VERSION;
        out[2..4].copy_from_slice(&(plen as u16).to_be_bytes());
        out[4..8].copy_from_slice(&self.local_comm_id.to_be_bytes());
        out[8..12].copy_from_slice(&self.remote_comm_id.to_be_bytes());
        out[0x0C..0x0E].copy_from_slice(&self.reason.to_be_bytes());
        out[0x0E] = self.path_mtu;
        out[0x10..0x18].copy_from_slice(&self.service_id.to_be_bytes());
        out[0x18..0x1C].copy_from_slice(&(self.qpn & 0x00FF_FFFF).to_be_bytes());
        let word = match kind {
            CmKind::SidrRep => self.qkey,
            _ => self.psn & 0x00FF_FFFF,
        };
        out[0x1C..0x20].copy_from_slice(&word.to_be_bytes());
        out[0x20] = self.responder_resources;
        out[0x21] = self.initiator_depth;
        out[0x22] = self.retry_cnt;
        out[0x23] = self.rnr_retry;
        out[0x24] = self.timeout;
        out[0x25] = self.min_rnr_timer;
        out.extend_from_slice(&self.private[..plen]);
    }
}

/// Timing of the protocol. The time-wait should outlast the repeats of the peer's messages.
#[derive(Clone, Copy, Debug)]
pub struct CmConfig {
    /// First wait for an answer, in device picoseconds; it doubles with every repeat (up
    /// to 64 times the first).
    pub timeout_ps: u64,
    /// Repeats of a REQ, REP or DREQ before giving up.
    pub retries: u32,
    /// How long the state of a finished or refused connection is kept to answer repeated
    /// messages (the IBTA's time-wait), in device picoseconds.
    pub time_wait_ps: u64,
}

impl Default for CmConfig {
    /// 4 ms first, doubling to 256 ms, 15 repeats: about 2.6 s before a peer is given up,
    /// which a loaded machine running a served device on wall time needs. On the in-process
    /// emulator an idle fabric's clock jumps to the timer, so long timeouts cost no wall time.
    fn default() -> Self {
        CmConfig {
            timeout_ps: 4_000_000_000,
            retries: 15,
            time_wait_ps: 10_000_000_000_000,
        }
    }
}

/// A connection, as this CM numbers it (its local communication id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnId(pub u32);

/// Something the application must know.
#[derive(Debug)]
pub enum CmEvent {
    /// A REQ for a service id this CM listens on: answer with
    /// [`ConnectionManager::accept`] or [`ConnectionManager::reject`].
    ConnectRequest {
        /// The connection.
        id: ConnId,
        /// The service id.
        service_id: u64,
        /// The requester's address.
        from: AhAttr,
        /// The requester's private data.
        private: Vec<u8>,
    },
    /// The connection is up and `qp` is in RTS (the active side gets its QP back here; the
    /// passive side too).
    Established {
        /// The connection.
        id: ConnId,
        /// The connected QP.
        qp: QueuePair,
        /// The peer's private data (REP on the active side, RTU on the passive side).
        private: Vec<u8>,
    },
    /// The peer refused the connection. The QP comes back as it was given.
    Rejected {
        /// The connection.
        id: ConnId,
        /// The REJ reason (for example [`REJ_INVALID_SERVICE_ID`], [`REJ_CONSUMER`]).
        reason: u16,
        /// The peer's private data.
        private: Vec<u8>,
        /// The QP, for the active side (the passive side still holds nothing).
        qp: Option<QueuePair>,
    },
    /// No answer after every repeat: the peer is unreachable or gone. The QP comes back.
    TimedOut {
        /// The connection.
        id: ConnId,
        /// The QP this CM held, if any.
        qp: Option<QueuePair>,
    },
    /// The passive side's answer to [`ConnectionManager::connect_external`]: the caller
    /// moves its QP to RTR towards `remote` and to RTS sending from `local_psn`, under
    /// `opts` (the two sides' options combined), then calls
    /// [`ConnectionManager::establish`] (or [`ConnectionManager::refuse`]).
    Replied {
        /// The connection.
        id: ConnId,
        /// The peer's QP.
        remote: Endpoint,
        /// The first PSN the caller's QP sends.
        local_psn: u32,
        /// The options to move the QP with.
        opts: ConnectOptions,
        /// The peer's private data.
        private: Vec<u8>,
    },
    /// A connection accepted with [`ConnectionManager::accept_external`] is up: the peer's
    /// RTU arrived.
    Ready {
        /// The connection.
        id: ConnId,
        /// The peer's private data.
        private: Vec<u8>,
    },
    /// A SIDR REQ for a service id this CM listens on: answer with
    /// [`ConnectionManager::sidr_answer`].
    SidrRequest {
        /// The request.
        id: ConnId,
        /// The service id.
        service_id: u64,
        /// The requester's address.
        from: AhAttr,
        /// The requester's private data.
        private: Vec<u8>,
    },
    /// The answer to [`ConnectionManager::sidr_request`]: with status [`SIDR_OK`], the
    /// peer's UD QP and Q_Key.
    SidrReply {
        /// The request.
        id: ConnId,
        /// [`SIDR_OK`], [`SIDR_NO_SERVICE`], [`SIDR_REJECTED`], ...
        status: u16,
        /// The peer's address.
        from: AhAttr,
        /// Its UD QP.
        qpn: u32,
        /// Its Q_Key.
        qkey: u32,
        /// Its private data.
        private: Vec<u8>,
    },
    /// The connection is closed (the peer's DREQ, or the DREP to ours). The application
    /// moves its QP to ERR (or RESET) itself.
    Disconnected {
        /// The connection.
        id: ConnId,
    },
}

/// Counters of the CM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmStats {
    /// Messages sent (first sends and repeats).
    pub sent: u64,
    /// Messages sent again after a timeout.
    pub repeated: u64,
    /// Messages received.
    pub received: u64,
    /// Received messages that did not parse.
    pub malformed: u64,
    /// Received messages for no known connection, or unexpected in its state.
    pub ignored: u64,
    /// Repeated messages answered from the state kept.
    pub duplicates: u64,
}

/// The QP of a connection being set up: held (and moved) by the CM, or the caller's, who
/// moves it itself (the `*_external` calls, as librdmacm moves QPs for the kernel's CM).
#[derive(Debug)]
enum Held {
    Qp(Box<QueuePair>),
    Caller,
}

impl Held {
    fn into_qp(self) -> Option<QueuePair> {
        match self {
            Held::Qp(qp) => Some(*qp),
            Held::Caller => None,
        }
    }
}

#[derive(Debug)]
enum State {
    /// Active: REQ sent, waiting for REP or REJ.
    ReqSent {
        qp: Held,
        qpn: u32,
        opts: ConnectOptions,
    },
    /// Active, the caller's QP: REP received, waiting for the caller to move its QP.
    RepRcvd,
    /// Passive: REQ received, waiting for the application.
    ReqRcvd { req: CmMsg },
    /// Passive: REP sent, QP in RTR (or RTS, the caller's), waiting for RTU.
    RepSent { qp: Held, opts: ConnectOptions },
    /// Active: SIDR REQ sent, waiting for the SIDR REP.
    SidrSent,
    /// Passive: SIDR REQ received, waiting for the application.
    SidrRcvd,
    /// Connected (both sides): repeats of REP are answered with RTU.
    Established,
    /// DREQ sent, waiting for DREP.
    DreqSent,
    /// Closed or refused: kept for a while to answer repeats with `answer`.
    TimeWait,
}

#[derive(Debug)]
struct Conn {
    state: State,
    peer: AhAttr,
    remote_comm_id: u32,
    /// The message to repeat on a timeout, or to answer a repeat of the peer's message with.
    last: Vec<u8>,
    /// When the timer fires (device picoseconds), if it runs.
    deadline: Option<u64>,
    repeats: u32,
    /// For TimeWait: when to forget the connection.
    forget_at: u64,
    /// Active, REQ sent: the peer's MRA came. The repeat timer is then the long wait for
    /// the application at the other end, which an idle clock is not run to.
    acked: bool,
}

const RECV_SLOTS: usize = 128;
/// How far the clock of a device that runs on its own may be ahead of the host's time
/// since it was read (a served NIC's never runs ahead but for 100 µs while it drains a
/// departed client's last posts); a margin of ten times that.
const CLOCK_LEAD_PS: u64 = 1_000_000_000;
const SEND_SLOTS: usize = 128;
const SLOT: usize = 512;

/// The connection manager of one device. See the module documentation.
#[derive(Debug)]
pub struct ConnectionManager {
    gsi: QueuePair,
    cq: CompletionQueue,
    mr: MemoryRegion,
    buf: DmaBuffer,
    pd: ProtectionDomain,
    dev: Device,
    cfg: CmConfig,
    ahs: BTreeMap<AhAttr, AddressHandle>,
    listening: BTreeSet<u64>,
    conns: BTreeMap<u32, Conn>,
    /// (peer, peer's comm id) of connections this side is passive for.
    by_remote: BTreeMap<(AhAttr, u32), u32>,
    next_id: u32,
    free_send: Vec<usize>,
    events: VecDeque<CmEvent>,
    stats: CmStats,
    scratch: Vec<u8>,
    /// On a device that runs on its own: when (host time) its clock was last read, and
    /// what it read (see [`ConnectionManager::clock_if_due`]).
    clock_seen: Option<(Instant, u64)>,
}

impl ConnectionManager {
    /// Opens the CM of `dev`: creates its general services QP (QPN 1) and buffers.
    /// Fails if the device has no UD support or its QPN 1 is taken (another CM).
    pub fn new(dev: &Device) -> Result<ConnectionManager, Error> {
        ConnectionManager::with_config(dev, CmConfig::default())
    }

    /// [`ConnectionManager::new`] with explicit timing.
    pub fn with_config(dev: &Device, cfg: CmConfig) -> Result<ConnectionManager, Error> {
        let pd = dev.alloc_pd()?;
        let cq = dev.create_cq((RECV_SLOTS + SEND_SLOTS) as u32)?;
        let buf = dev.alloc_dma((RECV_SLOTS + SEND_SLOTS) * SLOT)?;
        let mr = pd.reg_mr(&buf, Access::LOCAL_WRITE)?;
        let mut init = QpInit::new(&cq, &cq);
        init.qp_type = QpType::Gsi;
        init.max_send_wr = SEND_SLOTS as u32;
        init.max_recv_wr = RECV_SLOTS as u32;
        init.max_send_sge = 1;
        init.max_recv_sge = 1;
        init.max_inline = 0;
        let mut gsi = pd.create_qp(&init)?;
        if gsi.qpn() != GSI_QPN {
            return Err(Error::InvalidArgument(
                "the device gave the GSI QP another QPN",
            ));
        }
        gsi.ud_ready(GSI_QKEY, 0)?;
        let mut cm = ConnectionManager {
            gsi,
            cq,
            mr,
            buf,
            pd,
            dev: dev.clone(),
            cfg,
            ahs: BTreeMap::new(),
            listening: BTreeSet::new(),
            conns: BTreeMap::new(),
            by_remote: BTreeMap::new(),
            next_id: 1,
            free_send: (RECV_SLOTS..RECV_SLOTS + SEND_SLOTS).rev().collect(),
            events: VecDeque::new(),
            stats: CmStats::default(),
            scratch: Vec::with_capacity(MAX_CM_MSG),
            clock_seen: None,
        };
        for slot in 0..RECV_SLOTS {
            cm.post_recv_slot(slot)?;
        }
        Ok(cm)
    }

    /// This device's address, as peers connect to it.
    pub fn address(&self) -> AhAttr {
        self.dev.ah_attr()
    }

    /// The counters.
    pub fn stats(&self) -> CmStats {
        self.stats
    }

    /// Connections this CM still keeps state for (in progress, established, or in
    /// time-wait).
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Accepts REQs for `service_id` from now on. Listening twice is `InvalidArgument`.
    pub fn listen(&mut self, service_id: u64) -> Result<(), Error> {
        if !self.listening.insert(service_id) {
            return Err(Error::InvalidArgument(
                "already listening on this service id",
            ));
        }
        Ok(())
    }

    /// Stops accepting REQs for `service_id` (later ones are rejected with
    /// [`REJ_INVALID_SERVICE_ID`]).
    pub fn unlisten(&mut self, service_id: u64) {
        self.listening.remove(&service_id);
    }

    /// Starts connecting `qp` (an RC QP in RESET, of this device) to the listener on
    /// `service_id` at `peer`. The answer comes as an event with the returned id:
    /// [`CmEvent::Established`], [`CmEvent::Rejected`] or [`CmEvent::TimedOut`], each of
    /// which gives the QP back.
    pub fn connect(
        &mut self,
        peer: AhAttr,
        service_id: u64,
        qp: QueuePair,
        opts: &ConnectOptions,
        private: &[u8],
    ) -> Result<ConnId, Error> {
        if !qp.belongs_to(&self.dev) {
            return Err(Error::InvalidArgument("the QP belongs to another device"));
        }
        if qp.state() != QpState::Reset {
            return Err(Error::InvalidState {
                qpn: qp.qpn(),
                state: qp.state(),
            });
        }
        let qpn = qp.qpn();
        self.start_connect(peer, service_id, Held::Qp(Box::new(qp)), qpn, opts, private)
    }

    /// [`ConnectionManager::connect`] for a QP the caller moves itself (QP number `qpn`
    /// of this device, in RESET or INIT): the passive side's answer comes as
    /// [`CmEvent::Replied`], and the connection is up once the caller has called
    /// [`ConnectionManager::establish`]; or [`CmEvent::Rejected`] or
    /// [`CmEvent::TimedOut`] (without a QP).
    pub fn connect_external(
        &mut self,
        peer: AhAttr,
        service_id: u64,
        qpn: u32,
        opts: &ConnectOptions,
        private: &[u8],
    ) -> Result<ConnId, Error> {
        self.start_connect(peer, service_id, Held::Caller, qpn, opts, private)
    }

    fn start_connect(
        &mut self,
        peer: AhAttr,
        service_id: u64,
        qp: Held,
        qpn: u32,
        opts: &ConnectOptions,
        private: &[u8],
    ) -> Result<ConnId, Error> {
        if private.len() > MAX_REQ_PRIVATE {
            return Err(Error::InvalidArgument(
                "REQ private data is at most 92 bytes",
            ));
        }
        if !(1..=5).contains(&opts.path_mtu) {
            return Err(Error::InvalidArgument("path_mtu is 1..=5"));
        }
        self.ah(peer)?;
        let id = self.fresh_id();
        let req = CmMsg {
            kind: Some(CmKind::Req),
            local_comm_id: id,
            remote_comm_id: 0,
            path_mtu: opts.path_mtu,
            service_id,
            qpn,
            psn: start_psn(id, qpn),
            responder_resources: opts.max_dest_rd_atomic,
            initiator_depth: opts.max_rd_atomic,
            retry_cnt: opts.retry_cnt,
            rnr_retry: opts.rnr_retry,
            timeout: opts.timeout,
            min_rnr_timer: opts.min_rnr_timer,
            private: private.to_vec(),
            ..Default::default()
        };
        let state = State::ReqSent {
            qp,
            qpn,
            opts: *opts,
        };
        self.open(id, Conn::new(state, peer, 0), &req)
    }

    /// Opens connection `id` (`conn`) with its first message `m`, repeated until answered.
    fn open(&mut self, id: u32, mut conn: Conn, m: &CmMsg) -> Result<ConnId, Error> {
        m.emit(&mut conn.last);
        self.send_and_arm(&mut conn)?;
        self.conns.insert(id, conn);
        Ok(ConnId(id))
    }

    /// Accepts the connection request `id` ([`CmEvent::ConnectRequest`]) with `qp` (an RC
    /// QP in RESET, of this device): the QP moves to RTR and the REP goes out. The
    /// connection is up at [`CmEvent::Established`] (the QP serves requests from now on).
    pub fn accept(
        &mut self,
        id: ConnId,
        qp: QueuePair,
        opts: &ConnectOptions,
        private: &[u8],
    ) -> Result<(), Error> {
        if !qp.belongs_to(&self.dev) || qp.state() != QpState::Reset {
            return Err(Error::InvalidArgument(
                "accept needs an RC QP of this device in RESET",
            ));
        }
        let qpn = qp.qpn();
        self.answer(id, Held::Qp(Box::new(qp)), qpn, opts, private)
    }

    /// [`ConnectionManager::accept`] for a QP the caller has moved itself (QP number
    /// `qpn`): to RTR towards the requester and to RTS, as [`ConnectionManager::request`]
    /// and [`first_psn`] give them; then the REP goes out. The connection is up at
    /// [`CmEvent::Ready`].
    pub fn accept_external(
        &mut self,
        id: ConnId,
        qpn: u32,
        opts: &ConnectOptions,
        private: &[u8],
    ) -> Result<(), Error> {
        self.answer(id, Held::Caller, qpn, opts, private)
    }

    /// The READ/atomic depths of the connection request `id` (a
    /// [`CmEvent::ConnectRequest`] not answered yet): the requester's initiator depth and
    /// responder resources.
    pub fn request_depths(&self, id: ConnId) -> Option<(u8, u8)> {
        match &self.conns.get(&id.0)?.state {
            State::ReqRcvd { req } => Some((req.initiator_depth, req.responder_resources)),
            _ => None,
        }
    }

    /// The connection request `id` (a [`CmEvent::ConnectRequest`] not answered yet):
    /// the requester's QP and the options both sides agree on.
    pub fn request(&self, id: ConnId, opts: &ConnectOptions) -> Option<(Endpoint, ConnectOptions)> {
        let conn = self.conns.get(&id.0)?;
        let State::ReqRcvd { req } = &conn.state else {
            return None;
        };
        Some((
            Endpoint {
                qpn: req.qpn,
                psn: req.psn,
                mac: conn.peer.mac,
                ip: conn.peer.ip,
            },
            ConnectOptions {
                path_mtu: opts.path_mtu.min(req.path_mtu).max(1),
                max_rd_atomic: opts.max_rd_atomic.min(req.responder_resources),
                ..*opts
            },
        ))
    }

    /// Checks the request `id`, moves `qp` to RTR if the CM holds it (the caller has moved
    /// its own), and sends the REP naming QP `qpn`.
    fn answer(
        &mut self,
        id: ConnId,
        mut qp: Held,
        qpn: u32,
        opts: &ConnectOptions,
        private: &[u8],
    ) -> Result<(), Error> {
        let Some(conn) = self.conns.get(&id.0) else {
            return Err(Error::InvalidArgument("no such connection request"));
        };
        let State::ReqRcvd { req } = &conn.state else {
            return Err(Error::InvalidArgument(
                "the connection is not awaiting an answer",
            ));
        };
        if private.len() > MAX_REP_PRIVATE {
            return Err(Error::InvalidArgument(
                "REP private data is at most 196 bytes",
            ));
        }
        let req = req.clone();
        let (remote, mine) = self.request(id, opts).expect("checked above");
        if let Held::Qp(q) = &mut qp {
            q.to_rtr(&remote, &mine)?;
        }
        let rep = CmMsg {
            kind: Some(CmKind::Rep),
            local_comm_id: id.0,
            remote_comm_id: req.local_comm_id,
            path_mtu: mine.path_mtu,
            service_id: req.service_id,
            qpn,
            psn: start_psn(id.0, qpn),
            responder_resources: mine.max_dest_rd_atomic,
            initiator_depth: mine.max_rd_atomic,
            min_rnr_timer: mine.min_rnr_timer,
            private: private.to_vec(),
            ..Default::default()
        };
        let mut conn = self.conns.remove(&id.0).expect("checked above");
        rep.emit(&mut conn.last);
        conn.state = State::RepSent { qp, opts: mine };
        conn.repeats = 0;
        let r = self.send_and_arm(&mut conn);
        self.conns.insert(id.0, conn);
        r
    }

    /// Refuses the connection request `id` with `reason` (for example [`REJ_CONSUMER`]).
    pub fn reject(&mut self, id: ConnId, reason: u16, private: &[u8]) -> Result<(), Error> {
        let Some(conn) = self.conns.get(&id.0) else {
            return Err(Error::InvalidArgument("no such connection request"));
        };
        let State::ReqRcvd { req } = &conn.state else {
            return Err(Error::InvalidArgument(
                "the connection is not awaiting an answer",
            ));
        };
        if private.len() > MAX_REJ_PRIVATE {
            return Err(Error::InvalidArgument(
                "REJ private data is at most 148 bytes",
            ));
        }
        let rej = CmMsg {
            kind: Some(CmKind::Rej),
            local_comm_id: id.0,
            remote_comm_id: req.local_comm_id,
            reason,
            private: private.to_vec(),
            ..Default::default()
        };
        let mut conn = self.conns.remove(&id.0).expect("checked above");
        let to = conn.peer;
        let r = self.last_word(&mut conn, to, &rej);
        self.conns.insert(id.0, conn);
        r
    }

    /// Asks the CM at `peer` for the UD QP behind `service_id` (service id resolution):
    /// [`CmEvent::SidrReply`] answers, or [`CmEvent::TimedOut`] when nothing does.
    pub fn sidr_request(
        &mut self,
        peer: AhAttr,
        service_id: u64,
        private: &[u8],
    ) -> Result<ConnId, Error> {
        if private.len() > MAX_SIDR_REQ_PRIVATE {
            return Err(Error::InvalidArgument(
                "SIDR REQ private data is at most 216 bytes",
            ));
        }
        self.ah(peer)?;
        let id = self.fresh_id();
        let req = CmMsg {
            service_id,
            private: private.to_vec(),
            ..CmMsg::about(CmKind::SidrReq, id, 0)
        };
        self.open(id, Conn::new(State::SidrSent, peer, 0), &req)
    }

    /// Answers the SIDR request `id` ([`CmEvent::SidrRequest`]) with `status` and, for
    /// [`SIDR_OK`], UD QP `qpn` and its `qkey`. A repeat of the request gets the same answer.
    pub fn sidr_answer(
        &mut self,
        id: ConnId,
        status: u16,
        qpn: u32,
        qkey: u32,
        private: &[u8],
    ) -> Result<(), Error> {
        let Some(conn) = self.conns.get(&id.0) else {
            return Err(Error::InvalidArgument("no such SIDR request"));
        };
        if !matches!(conn.state, State::SidrRcvd) {
            return Err(Error::InvalidArgument("the request awaits no answer"));
        }
        if private.len() > MAX_SIDR_REP_PRIVATE {
            return Err(Error::InvalidArgument(
                "SIDR REP private data is at most 136 bytes",
            ));
        }
        let mut conn = self.conns.remove(&id.0).expect("checked above");
        let rep = CmMsg {
            reason: status,
            qpn,
            qkey,
            private: private.to_vec(),
            ..CmMsg::about(CmKind::SidrRep, id.0, conn.remote_comm_id)
        };
        let to = conn.peer;
        let r = self.last_word(&mut conn, to, &rep);
        self.conns.insert(id.0, conn);
        r
    }

    /// Completes [`ConnectionManager::connect_external`] once the caller has moved its QP
    /// as [`CmEvent::Replied`] said: the RTU goes out and the connection is up.
    pub fn establish(&mut self, id: ConnId) -> Result<(), Error> {
        let Some(conn) = self.conns.get_mut(&id.0) else {
            return Err(Error::InvalidArgument("no such connection"));
        };
        if !matches!(conn.state, State::RepRcvd) {
            return Err(Error::InvalidArgument("the connection awaits no RTU"));
        }
        let rtu = CmMsg::about(CmKind::Rtu, id.0, conn.remote_comm_id);
        rtu.emit(&mut conn.last);
        conn.state = State::Established;
        conn.deadline = None;
        let (peer, last) = (conn.peer, conn.last.clone());
        self.send(peer, &last)
    }

    /// Refuses the REP of a [`CmEvent::Replied`] connection (the caller could not move
    /// its QP): a REJ goes to the peer.
    pub fn refuse(&mut self, id: ConnId) -> Result<(), Error> {
        let Some(mut conn) = self.conns.remove(&id.0) else {
            return Err(Error::InvalidArgument("no such connection"));
        };
        if !matches!(conn.state, State::RepRcvd) {
            self.conns.insert(id.0, conn);
            return Err(Error::InvalidArgument("the connection awaits no RTU"));
        }
        let rej = CmMsg {
            reason: REJ_CONSUMER,
            ..CmMsg::about(CmKind::Rej, id.0, conn.remote_comm_id)
        };
        let to = conn.peer;
        let r = self.last_word(&mut conn, to, &rej);
        self.conns.insert(id.0, conn);
        r
    }

    /// Forgets connection `id` at once, whatever its state, without a word to the peer
    /// (its owner is gone; the peer's timers end its side). A QP the CM held is dropped.
    pub fn forget(&mut self, id: ConnId) {
        if let Some(c) = self.conns.remove(&id.0) {
            self.by_remote.remove(&(c.peer, c.remote_comm_id));
        }
        self.events.retain(|e| e.id() != id);
    }

    /// Closes the established connection `id`: a DREQ goes to the peer, and
    /// [`CmEvent::Disconnected`] follows its DREP (or the timeout). The QP is the
    /// application's to move to ERR.
    pub fn disconnect(&mut self, id: ConnId) -> Result<(), Error> {
        let Some(mut conn) = self.conns.remove(&id.0) else {
            return Err(Error::InvalidArgument("no such connection"));
        };
        if !matches!(conn.state, State::Established | State::RepSent { .. }) {
            self.conns.insert(id.0, conn);
            return Err(Error::InvalidArgument("the connection is not established"));
        }
        let dreq = CmMsg::about(CmKind::Dreq, id.0, conn.remote_comm_id);
        dreq.emit(&mut conn.last);
        conn.state = State::DreqSent;
        conn.repeats = 0;
        let r = self.send_and_arm(&mut conn);
        self.conns.insert(id.0, conn);
        r
    }

    /// Drives the device and the protocol once and returns the next event, if any: reads
    /// the CM messages that arrived, fires due timers, and when nothing is left but waiting
    /// lets an idle device's clock run to the next timer.
    pub fn poll(&mut self) -> Option<CmEvent> {
        self.poll_with(true)
    }

    /// As [`ConnectionManager::poll`], for a caller that paces its own calls: on a device
    /// that runs on its own (a served or VFIO NIC) it never waits for the device, where
    /// `poll` lets it run (about 20 µs on a served NIC) when nothing came; on the in-process
    /// emulator, which moves only when stepped, it is `poll`.
    pub fn poll_nowait(&mut self) -> Option<CmEvent> {
        let lockstep = self.dev.port().lockstep();
        self.poll_with(lockstep)
    }

    fn poll_with(&mut self, let_run: bool) -> Option<CmEvent> {
        if let Some(e) = self.events.pop_front() {
            return Some(e);
        }
        let mut wc = [WorkCompletion::default(); 16];
        // Not let run: the device runs on its own, and what is in the ring is all there is.
        let n = match let_run {
            true => self.cq.poll(&mut wc),
            false => self.cq.poll_ready(&mut wc),
        };
        for w in &wc[..n] {
            self.completion(w);
        }
        // The clock is read only when a timer may be due: on a served NIC each read of it is
        // a round trip to the server.
        let first = self.conns.values().filter_map(Conn::wakeup).min();
        let now = first.and_then(|t| self.clock_if_due(t));
        if let Some(now) = now {
            self.fire_timers(now);
        }
        let now = now.unwrap_or(0);
        if n == 0 && self.events.is_empty() && let_run && !self.dev.progress() {
            // Idle: nothing will arrive before the next timer. A request waiting for the
            // application's answer is not waiting for a timer: its end is never run to,
            // or an application that polls before it answers would find it dropped. Nor
            // is the end of a time-wait, which only forgets: run to, it would end the
            // time-wait before the peers whose repeats it is there to answer (other CMs
            // of the same fabric, whose timers the clock does not know) have sent them.
            let timers = self
                .conns
                .values()
                .filter(|c| {
                    !c.acked
                        && !matches!(
                            c.state,
                            State::ReqRcvd { .. } | State::SidrRcvd | State::TimeWait
                        )
                })
                .filter_map(Conn::wakeup);
            if let Some(t) = timers.min() {
                if t > now {
                    self.dev.port().idle_until(t);
                }
            }
        }
        self.events.pop_front()
    }

    /// The device clock, read unless the timer due first (at `first`) cannot be due yet.
    /// A device that runs on its own (hardware, a served NIC) keeps its clock with the
    /// host's, never more than [`CLOCK_LEAD_PS`] ahead of it, so from the last reading and
    /// the host time since, a timer still far off needs no reading; a lockstep device's
    /// clock moves only when stepped, and is always read.
    fn clock_if_due(&mut self, first: u64) -> Option<u64> {
        if !self.dev.port().lockstep() {
            if let Some((at, ps)) = self.clock_seen {
                let since = u64::try_from(at.elapsed().as_nanos()).unwrap_or(u64::MAX);
                let most = ps
                    .saturating_add(since.saturating_mul(1000))
                    .saturating_add(CLOCK_LEAD_PS);
                if most < first {
                    return None;
                }
            }
        }
        let now = self.dev.clock_ps();
        self.clock_seen = Some((Instant::now(), now));
        Some(now)
    }

    /// Requests a completion event (the device's interrupt) for the next CM message this
    /// manager sends or receives, so that a process may sleep until one arrives.
    pub fn arm(&self) {
        self.cq.arm(false);
    }

    /// Calls [`ConnectionManager::poll`] until `pred` accepts an event (returned) or
    /// `max_polls` polls have passed (`None`). Events `pred` refuses are dropped.
    pub fn poll_until(
        &mut self,
        max_polls: usize,
        mut pred: impl FnMut(&CmEvent) -> bool,
    ) -> Option<CmEvent> {
        for _ in 0..max_polls {
            if let Some(e) = self.poll() {
                if pred(&e) {
                    return Some(e);
                }
            }
        }
        None
    }

    fn fresh_id(&mut self) -> u32 {
        loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1).max(1);
            if !self.conns.contains_key(&id) {
                return id;
            }
        }
    }

    fn ah(&mut self, peer: AhAttr) -> Result<&AddressHandle, Error> {
        if !self.ahs.contains_key(&peer) {
            let ah = self.pd.create_ah(&peer)?;
            self.ahs.insert(peer, ah);
        }
        Ok(&self.ahs[&peer])
    }

    fn post_recv_slot(&mut self, slot: usize) -> Result<(), Error> {
        let sge = [self.mr.sge((slot * SLOT) as u64, SLOT as u32)];
        self.gsi.post_recv(&[RecvWr {
            wr_id: slot as u64,
            sgl: &sge,
        }])
    }

    /// Sends `msg` to the CM at `peer` (the GSI QP, Q_Key GSI_QKEY).
    fn send(&mut self, peer: AhAttr, msg: &[u8]) -> Result<(), Error> {
        let Some(slot) = self.free_send.pop() else {
            // Every send buffer is in flight: this one is lost, as on a congested link;
            // the timers repeat what matters.
            return Ok(());
        };
        self.buf.write(slot * SLOT, msg)?;
        let sge = [self.mr.sge((slot * SLOT) as u64, msg.len() as u32)];
        self.ah(peer)?;
        let dest = UdDest {
            ah: &self.ahs[&peer],
            qpn: GSI_QPN,
            qkey: GSI_QKEY,
        };
        let r = self
            .gsi
            .post_send(&[SendWr::new(slot as u64, WrOp::Send, &sge).to(dest)]);
        match r {
            Ok(()) => self.stats.sent += 1,
            Err(_) => self.free_send.push(slot),
        }
        r
    }

    fn send_and_arm(&mut self, conn: &mut Conn) -> Result<(), Error> {
        let msg = std::mem::take(&mut conn.last);
        let r = self.send(conn.peer, &msg);
        conn.last = msg;
        conn.deadline = Some(self.dev.clock_ps() + self.backoff(conn.repeats));
        r
    }

    fn backoff(&self, repeats: u32) -> u64 {
        self.cfg.timeout_ps << repeats.min(6)
    }

    /// Sends `m` to `to` as the connection's last word (kept to answer repeats) and lets
    /// the connection wait out its time-wait.
    fn last_word(&mut self, conn: &mut Conn, to: AhAttr, m: &CmMsg) -> Result<(), Error> {
        m.emit(&mut conn.last);
        let r = self.send(to, &conn.last);
        self.time_wait(conn);
        r
    }

    fn time_wait(&self, conn: &mut Conn) {
        conn.state = State::TimeWait;
        conn.deadline = None;
        conn.forget_at = self.dev.clock_ps() + self.cfg.time_wait_ps;
    }

    fn completion(&mut self, w: &WorkCompletion) {
        let slot = w.wr_id as usize;
        if !w.opcode.is_recv() {
            if (RECV_SLOTS..RECV_SLOTS + SEND_SLOTS).contains(&slot) {
                self.free_send.push(slot);
            }
            return;
        }
        if slot >= RECV_SLOTS {
            return;
        }
        if w.status == WcStatus::Success {
            if let Some(src) = w.source {
                let len = (w.byte_len as usize)
                    .saturating_sub(GRH_LEN)
                    .min(SLOT - GRH_LEN);
                let mut b = std::mem::take(&mut self.scratch);
                b.resize(len, 0);
                if self.buf.read(slot * SLOT + GRH_LEN, &mut b).is_ok() {
                    self.stats.received += 1;
                    match CmMsg::parse(&b) {
                        Ok(m) => self.message(src.ah_attr(), m),
                        Err(_) => self.stats.malformed += 1,
                    }
                }
                self.scratch = b;
            }
        }
        // A flushed or failed receive is not reposted (the GSI QP is in error then).
        if w.status == WcStatus::Success {
            let _ = self.post_recv_slot(slot);
        }
    }

    fn message(&mut self, from: AhAttr, m: CmMsg) {
        match m.kind {
            Some(CmKind::Req) => self.on_req(from, m),
            Some(CmKind::Rep) => self.on_rep(from, m),
            Some(CmKind::Rtu) => self.on_rtu(from, m),
            Some(CmKind::Rej) => self.on_rej(from, m),
            Some(CmKind::Dreq) => self.on_dreq(from, m),
            Some(CmKind::Drep) => self.on_drep(from, m),
            Some(CmKind::SidrReq) => self.on_sidr_req(from, m),
            Some(CmKind::SidrRep) => self.on_sidr_rep(from, m),
            Some(CmKind::Mra) => self.on_mra(from, m),
            None => self.stats.malformed += 1,
        }
    }

    /// The connection `m` names, if it came from that connection's peer; otherwise the
    /// message is counted as ignored.
    fn conn_of(&mut self, from: AhAttr, m: &CmMsg) -> Option<u32> {
        let known = self.conns.get(&m.remote_comm_id).is_some_and(|c| {
            c.peer == from && (c.remote_comm_id == 0 || c.remote_comm_id == m.local_comm_id)
        });
        if !known {
            self.stats.ignored += 1;
        }
        known.then_some(m.remote_comm_id)
    }

    /// Whether a request (REQ or SIDR REQ) is a repeat of one already known; if so it is
    /// answered with what was said, if anything was said yet.
    fn repeated_request(&mut self, from: AhAttr, m: &CmMsg) -> bool {
        let Some(&id) = self.by_remote.get(&(from, m.local_comm_id)) else {
            return false;
        };
        self.stats.duplicates += 1;
        if let Some(c) = self.conns.get(&id) {
            if !c.last.is_empty() {
                let (peer, last) = (c.peer, c.last.clone());
                let _ = self.send(peer, &last);
            }
        }
        true
    }

    /// A fresh id for request `m` from `from` (registered to recognise its repeats), or
    /// `None` for a repeat (answered already).
    fn new_request(&mut self, from: AhAttr, m: &CmMsg) -> Option<u32> {
        if self.repeated_request(from, m) {
            return None;
        }
        let id = self.fresh_id();
        self.by_remote.insert((from, m.local_comm_id), id);
        Some(id)
    }

    fn on_req(&mut self, from: AhAttr, m: CmMsg) {
        let Some(id) = self.new_request(from, &m) else {
            return;
        };
        let mut conn = Conn::new(State::TimeWait, from, m.local_comm_id);
        if !self.listening.contains(&m.service_id) || !(1..=5).contains(&m.path_mtu) {
            let rej = CmMsg {
                reason: REJ_INVALID_SERVICE_ID,
                ..CmMsg::about(CmKind::Rej, id, m.local_comm_id)
            };
            let _ = self.last_word(&mut conn, from, &rej);
            self.conns.insert(id, conn);
            return;
        }
        self.events.push_back(CmEvent::ConnectRequest {
            id: ConnId(id),
            service_id: m.service_id,
            from,
            private: m.private.clone(),
        });
        // The application answers when it will: an MRA tells the requester to wait (a
        // repeat of the REQ gets it again).
        CmMsg::about(CmKind::Mra, id, m.local_comm_id).emit(&mut conn.last);
        let _ = self.send(from, &conn.last);
        conn.state = State::ReqRcvd { req: m };
        // The application has a while to answer; then the request is dropped.
        conn.forget_at = self.dev.clock_ps() + self.cfg.time_wait_ps;
        self.conns.insert(id, conn);
    }

    fn on_sidr_req(&mut self, from: AhAttr, m: CmMsg) {
        let Some(id) = self.new_request(from, &m) else {
            return;
        };
        let mut conn = Conn::new(State::SidrRcvd, from, m.local_comm_id);
        conn.forget_at = self.dev.clock_ps() + self.cfg.time_wait_ps;
        if !self.listening.contains(&m.service_id) {
            let rep = CmMsg {
                reason: SIDR_NO_SERVICE,
                ..CmMsg::about(CmKind::SidrRep, id, m.local_comm_id)
            };
            let _ = self.last_word(&mut conn, from, &rep);
        } else {
            self.events.push_back(CmEvent::SidrRequest {
                id: ConnId(id),
                service_id: m.service_id,
                from,
                private: m.private,
            });
        }
        self.conns.insert(id, conn);
    }

    fn on_mra(&mut self, from: AhAttr, m: CmMsg) {
        let Some(id) = self.conn_of(from, &m) else {
            return;
        };
        let now = self.dev.clock_ps();
        let wait = self.cfg.time_wait_ps;
        let conn = self.conns.get_mut(&id).expect("conn_of found it");
        if matches!(conn.state, State::ReqSent { .. }) {
            conn.remote_comm_id = m.local_comm_id;
            conn.acked = true;
            conn.repeats = 0;
            conn.deadline = Some(now + wait);
        } else {
            self.stats.duplicates += 1;
        }
    }

    fn on_sidr_rep(&mut self, from: AhAttr, m: CmMsg) {
        let Some(id) = self.conn_of(from, &m) else {
            return;
        };
        let mut conn = self.conns.remove(&id).expect("conn_of found it");
        if matches!(conn.state, State::SidrSent) {
            conn.last.clear();
            conn.remote_comm_id = m.local_comm_id;
            self.time_wait(&mut conn);
            self.events.push_back(CmEvent::SidrReply {
                id: ConnId(id),
                status: m.reason,
                from,
                qpn: m.qpn,
                qkey: m.qkey,
                private: m.private,
            });
        } else {
            self.stats.duplicates += 1;
        }
        self.conns.insert(id, conn);
    }

    fn on_rep(&mut self, from: AhAttr, m: CmMsg) {
        let Some(id) = self.conn_of(from, &m) else {
            return;
        };
        let mut conn = self.conns.remove(&id).expect("conn_of found it");
        match std::mem::replace(&mut conn.state, State::TimeWait) {
            State::ReqSent {
                qp: Held::Caller,
                qpn,
                opts,
            } => {
                conn.remote_comm_id = m.local_comm_id;
                conn.state = State::RepRcvd;
                conn.deadline = None;
                self.events.push_back(CmEvent::Replied {
                    id: ConnId(id),
                    remote: Endpoint {
                        qpn: m.qpn,
                        psn: m.psn,
                        mac: from.mac,
                        ip: from.ip,
                    },
                    local_psn: start_psn(id, qpn),
                    opts: ConnectOptions {
                        path_mtu: opts.path_mtu.min(m.path_mtu).max(1),
                        max_rd_atomic: opts.max_rd_atomic.min(m.responder_resources),
                        ..opts
                    },
                    private: m.private,
                });
            }
            State::ReqSent {
                qp: Held::Qp(mut qp),
                opts,
                ..
            } => {
                let mine = ConnectOptions {
                    path_mtu: opts.path_mtu.min(m.path_mtu).max(1),
                    max_rd_atomic: opts.max_rd_atomic.min(m.responder_resources),
                    ..opts
                };
                let remote = Endpoint {
                    qpn: m.qpn,
                    psn: m.psn,
                    mac: from.mac,
                    ip: from.ip,
                };
                let psn = start_psn(id, qp.qpn());
                let up = qp
                    .to_rtr(&remote, &mine)
                    .and_then(|()| qp.to_rts(psn, &mine));
                conn.remote_comm_id = m.local_comm_id;
                if up.is_err() {
                    // The QP could not take the peer's parameters: refuse, give it back.
                    let rej = CmMsg {
                        reason: REJ_CONSUMER,
                        ..CmMsg::about(CmKind::Rej, id, m.local_comm_id)
                    };
                    let _ = self.last_word(&mut conn, from, &rej);
                    self.events.push_back(CmEvent::Rejected {
                        id: ConnId(id),
                        reason: REJ_CONSUMER,
                        private: Vec::new(),
                        qp: Some(*qp),
                    });
                } else {
                    let rtu = CmMsg::about(CmKind::Rtu, id, m.local_comm_id);
                    rtu.emit(&mut conn.last);
                    let _ = self.send(from, &conn.last);
                    conn.state = State::Established;
                    conn.deadline = None;
                    self.events.push_back(CmEvent::Established {
                        id: ConnId(id),
                        qp: *qp,
                        private: m.private,
                    });
                }
            }
            s @ (State::Established | State::DreqSent | State::TimeWait) => {
                // Our RTU (or REJ) was lost: say it again. A DREQ in flight is repeated by
                // its own timer.
                self.stats.duplicates += 1;
                if !matches!(s, State::DreqSent) {
                    let last = conn.last.clone();
                    let _ = self.send(from, &last);
                }
                conn.state = s;
            }
            State::RepRcvd => {
                // The caller is moving its QP: its RTU follows.
                self.stats.duplicates += 1;
                conn.state = State::RepRcvd;
            }
            s => {
                self.stats.ignored += 1;
                conn.state = s;
            }
        }
        self.conns.insert(id, conn);
    }

    fn on_rtu(&mut self, from: AhAttr, m: CmMsg) {
        let Some(id) = self.conn_of(from, &m) else {
            return;
        };
        let mut conn = self.conns.remove(&id).expect("conn_of found it");
        match std::mem::replace(&mut conn.state, State::Established) {
            State::RepSent {
                qp: Held::Caller, ..
            } => {
                conn.deadline = None;
                self.events.push_back(CmEvent::Ready {
                    id: ConnId(id),
                    private: m.private,
                });
            }
            State::RepSent {
                qp: Held::Qp(mut qp),
                opts,
            } => {
                let psn = start_psn(id, qp.qpn());
                match qp.to_rts(psn, &opts) {
                    Ok(()) => {
                        conn.deadline = None;
                        self.events.push_back(CmEvent::Established {
                            id: ConnId(id),
                            qp: *qp,
                            private: m.private,
                        });
                    }
                    Err(_) => {
                        self.time_wait(&mut conn);
                        self.events.push_back(CmEvent::TimedOut {
                            id: ConnId(id),
                            qp: Some(*qp),
                        });
                    }
                }
            }
            s => {
                self.stats.duplicates += 1;
                conn.state = s;
            }
        }
        self.conns.insert(id, conn);
    }

    fn on_rej(&mut self, from: AhAttr, m: CmMsg) {
        let Some(id) = self.conn_of(from, &m) else {
            return;
        };
        let mut conn = self.conns.remove(&id).expect("conn_of found it");
        match std::mem::replace(&mut conn.state, State::TimeWait) {
            State::ReqSent { qp, .. } | State::RepSent { qp, .. } => {
                conn.last.clear();
                self.time_wait(&mut conn);
                self.events.push_back(CmEvent::Rejected {
                    id: ConnId(id),
                    reason: m.reason,
                    private: m.private,
                    qp: qp.into_qp(),
                });
            }
            State::RepRcvd => {
                conn.last.clear();
                self.time_wait(&mut conn);
                self.events.push_back(CmEvent::Rejected {
                    id: ConnId(id),
                    reason: m.reason,
                    private: m.private,
                    qp: None,
                });
            }
            s => {
                self.stats.ignored += 1;
                conn.state = s;
            }
        }
        self.conns.insert(id, conn);
    }

    fn on_dreq(&mut self, from: AhAttr, m: CmMsg) {
        let Some(id) = self.conn_of(from, &m) else {
            // Already forgotten, or never known: a DREP closes the peer's side anyway.
            let drep = CmMsg::about(CmKind::Drep, m.remote_comm_id, m.local_comm_id);
            let mut b = Vec::new();
            drep.emit(&mut b);
            let _ = self.send(from, &b);
            return;
        };
        let mut conn = self.conns.remove(&id).expect("conn_of found it");
        let drep = CmMsg::about(CmKind::Drep, id, m.local_comm_id);
        match std::mem::replace(&mut conn.state, State::TimeWait) {
            State::Established | State::RepSent { .. } | State::DreqSent => {
                self.events
                    .push_back(CmEvent::Disconnected { id: ConnId(id) });
            }
            State::TimeWait => self.stats.duplicates += 1,
            s => {
                conn.state = s;
                self.stats.ignored += 1;
                self.conns.insert(id, conn);
                return;
            }
        }
        let _ = self.last_word(&mut conn, from, &drep);
        self.conns.insert(id, conn);
    }

    fn on_drep(&mut self, from: AhAttr, m: CmMsg) {
        let Some(id) = self.conn_of(from, &m) else {
            return;
        };
        let mut conn = self.conns.remove(&id).expect("conn_of found it");
        if matches!(conn.state, State::DreqSent) {
            conn.last.clear();
            self.time_wait(&mut conn);
            self.events
                .push_back(CmEvent::Disconnected { id: ConnId(id) });
        } else {
            self.stats.duplicates += 1;
        }
        self.conns.insert(id, conn);
    }

    fn fire_timers(&mut self, now: u64) {
        let due: Vec<u32> = self
            .conns
            .iter()
            .filter(|(_, c)| c.wakeup().is_some_and(|t| t <= now))
            .map(|(&id, _)| id)
            .collect();
        for id in due {
            let Some(mut conn) = self.conns.remove(&id) else {
                continue;
            };
            if matches!(
                conn.state,
                State::TimeWait | State::ReqRcvd { .. } | State::SidrRcvd
            ) {
                // Forgotten (an unanswered request is dropped with it).
                self.by_remote.remove(&(conn.peer, conn.remote_comm_id));
                continue;
            }
            if conn.repeats >= self.cfg.retries {
                let ev = match std::mem::replace(&mut conn.state, State::TimeWait) {
                    State::ReqSent { qp, .. } | State::RepSent { qp, .. } => CmEvent::TimedOut {
                        id: ConnId(id),
                        qp: qp.into_qp(),
                    },
                    State::SidrSent => CmEvent::TimedOut {
                        id: ConnId(id),
                        qp: None,
                    },
                    _ => CmEvent::Disconnected { id: ConnId(id) },
                };
                self.events.push_back(ev);
                self.time_wait(&mut conn);
                self.conns.insert(id, conn);
                continue;
            }
            // (An MRA's long wait is over: repeats as before, until another MRA.)
            conn.acked = false;
            conn.repeats += 1;
            self.stats.repeated += 1;
            let _ = self.send_and_arm(&mut conn);
            self.conns.insert(id, conn);
        }
    }
}

impl CmEvent {
    /// The connection the event concerns.
    pub fn id(&self) -> ConnId {
        match self {
            CmEvent::ConnectRequest { id, .. }
            | CmEvent::Established { id, .. }
            | CmEvent::Rejected { id, .. }
            | CmEvent::TimedOut { id, .. }
            | CmEvent::Replied { id, .. }
            | CmEvent::Ready { id, .. }
            | CmEvent::SidrRequest { id, .. }
            | CmEvent::SidrReply { id, .. }
            | CmEvent::Disconnected { id } => *id,
        }
    }
}

impl Conn {
    /// A connection in `state` with `peer` (whose id for it is `remote_comm_id`, 0 until
    /// known), no message and no timer yet.
    fn new(state: State, peer: AhAttr, remote_comm_id: u32) -> Conn {
        Conn {
            state,
            peer,
            remote_comm_id,
            last: Vec::new(),
            deadline: None,
            repeats: 0,
            forget_at: 0,
            acked: false,
        }
    }

    /// When this connection needs attention: its retry timer, or the end of its time-wait.
    fn wakeup(&self) -> Option<u64> {
        match self.state {
            State::TimeWait | State::ReqRcvd { .. } | State::SidrRcvd => Some(self.forget_at),
            _ => self.deadline,
        }
    }
}

/// The first PSN QP `qpn` sends on connection `id` (see
/// [`ConnectionManager::accept_external`]).
pub fn first_psn(id: ConnId, qpn: u32) -> u32 {
    start_psn(id.0, qpn)
}

/// The first PSN a QP sends on connection `id`: spread over the PSN space, the same for
/// every repeat of a message.
fn start_psn(id: u32, qpn: u32) -> u32 {
    (id.wrapping_mul(0x9E37_79B1) ^ qpn.wrapping_mul(0x85EB_CA6B)) & 0x00FF_FFFF
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn emit_parse_round_trip(
            kind in 1u8..=9,
            ids in (any::<u32>(), any::<u32>()),
            reason in any::<u16>(),
            sid in any::<u64>(),
            (qpn, psn) in (0u32..1 << 24, 0u32..1 << 24),
            bytes in any::<[u8; 7]>(),
            qkey in any::<u32>(),
            private in proptest::collection::vec(any::<u8>(), 0..=92),
        ) {
            // A SIDR REP carries a Q_Key where the others carry a PSN.
            let sidr_rep = CmKind::from_u8(kind) == Some(CmKind::SidrRep);
            let (psn, qkey) = if sidr_rep { (0, qkey) } else { (psn, 0) };
            let m = CmMsg {
                kind: CmKind::from_u8(kind),
                local_comm_id: ids.0,
                remote_comm_id: ids.1,
                reason,
                path_mtu: bytes[0],
                service_id: sid,
                qpn,
                psn,
                qkey,
                responder_resources: bytes[1],
                initiator_depth: bytes[2],
                retry_cnt: bytes[3],
                rnr_retry: bytes[4],
                timeout: bytes[5],
                min_rnr_timer: bytes[6],
                private,
            };
            let mut b = Vec::new();
            m.emit(&mut b);
            prop_assert_eq!(b.len(), CM_HEADER_LEN + m.private.len());
            prop_assert_eq!(CmMsg::parse(&b), Ok(m));
        }

        #[test]
        fn parse_never_panics(b in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = CmMsg::parse(&b);
        }
    }

    #[test]
    fn parse_rejects_what_is_malformed() {
        let mut b = Vec::new();
        CmMsg {
            kind: Some(CmKind::Rep),
            private: vec![1; 10],
            ..Default::default()
        }
        .emit(&mut b);
        assert_eq!(
            CmMsg::parse(&b[..CM_HEADER_LEN - 1]),
            Err(CmParseError::Truncated)
        );
        assert_eq!(
            CmMsg::parse(&b[..b.len() - 1]),
            Err(CmParseError::Truncated)
        );
        let mut k = b.clone();
        k[0] = 10;
        assert_eq!(CmMsg::parse(&k), Err(CmParseError::UnknownKind(10)));
        let mut v = b.clone();
        v[1] = 2;
        assert_eq!(CmMsg::parse(&v), Err(CmParseError::BadVersion(2)));
        let mut l = b.clone();
        l[2..4].copy_from_slice(&(MAX_REP_PRIVATE as u16 + 1).to_be_bytes());
        l.resize(CM_HEADER_LEN + MAX_REP_PRIVATE + 1, 0);
        assert_eq!(CmMsg::parse(&l), Err(CmParseError::PrivateTooLong));
        // Bytes after the private data are ignored.
        let mut t = b.clone();
        t.extend_from_slice(&[0xEE; 5]);
        assert_eq!(CmMsg::parse(&t).map(|m| m.private), Ok(vec![1; 10]));
    }

    #[test]
    fn start_psns_differ_and_fit() {
        let a = start_psn(1, 2);
        let b = start_psn(2, 2);
        assert_ne!(a, b);
        assert!(a <= 0x00FF_FFFF && b <= 0x00FF_FFFF);
    }
}
