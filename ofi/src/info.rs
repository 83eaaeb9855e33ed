//! What the provider offers and how `fi_getinfo` hints are matched against it, in safe Rust.
//! The C boundary (`lib.rs`) reads a caller's `struct fi_info` hints into [`Hints`] and
//! writes each [`Offer`] that matches back as a `struct fi_info`.
//!
//! The rules are those every libfabric provider follows (`fi_getinfo(3)`): a hint field that
//! is zero (or UNSPEC) asks for nothing; capabilities, operation flags and orderings asked
//! for must be offered; sizes asked for must not exceed what is offered; the mode bits an
//! application sets are those it supports, and a provider whose offer needs a mode the
//! application does not support does not match. What comes back carries the capabilities
//! asked for (or every primary capability when none were) plus the secondary ones offered.

use crate::abi;
use crate::prov::{addr_from_bytes, Format};

/// The name of the provider and of its fabric.
/// Buffers one send or receive may name (`iov_limit`).
pub const IOV_LIMIT: usize = 4;
pub const PROVIDER_NAME: &str = "ringbell";
/// The libfabric API version the provider implements (`FI_VERSION(1, 17)`).
pub const API_VERSION: u32 = (1 << 16) | 17;
/// The provider's own version (`FI_VERSION(0, 1)`): shown by `fi_info`.
pub const PROVIDER_VERSION: u32 = 1;
/// The oldest API version an application may ask for (`FI_VERSION(1, 5)`).
pub const MIN_API_VERSION: u32 = (1 << 16) | 5;

/// `FI_VERSION(major, minor)`.
pub const fn fi_version(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}

// Capability bits (`fabric.h`).
pub const FI_MSG: u64 = abi::FI_MSG as u64;
pub const FI_RMA: u64 = abi::FI_RMA as u64;
pub const FI_TAGGED: u64 = abi::FI_TAGGED as u64;
pub const FI_ATOMIC: u64 = abi::FI_ATOMIC as u64;
pub const FI_READ: u64 = abi::FI_READ as u64;
pub const FI_WRITE: u64 = abi::FI_WRITE as u64;
pub const FI_RECV: u64 = abi::FI_RECV as u64;
pub const FI_SEND: u64 = abi::FI_SEND as u64;
pub const FI_REMOTE_READ: u64 = abi::FI_REMOTE_READ as u64;
pub const FI_REMOTE_WRITE: u64 = abi::FI_REMOTE_WRITE as u64;
pub const FI_DIRECTED_RECV: u64 = abi::FI_DIRECTED_RECV;
pub const FI_TRIGGER: u64 = abi::FI_TRIGGER as u64;
pub const FI_RMA_EVENT: u64 = abi::FI_RMA_EVENT;
pub const FI_LOCAL_COMM: u64 = abi::FI_LOCAL_COMM;
pub const FI_REMOTE_COMM: u64 = abi::FI_REMOTE_COMM;
pub const FI_MULTI_RECV: u64 = abi::FI_MULTI_RECV as u64;
/// Receive contexts of a scalable endpoint named by address (`fi_rx_addr`).
pub const FI_NAMED_RX_CTX: u64 = abi::FI_NAMED_RX_CTX;
/// Mode bit: local buffers must be registered (before API 1.5; `FI_MR_LOCAL` since).
pub const FI_LOCAL_MR: u64 = abi::FI_LOCAL_MR;
/// Mode bit: remote CQ data consumes a posted receive.
pub const FI_RX_CQ_DATA: u64 = abi::FI_RX_CQ_DATA;

/// Primary capabilities: an application asks for these; what it gets is what it asked for.
pub const PRIMARY_CAPS: u64 = FI_MSG
    | FI_RMA
    | FI_TAGGED
    | FI_ATOMIC
    | FI_DIRECTED_RECV
    | FI_NAMED_RX_CTX
    | FI_READ
    | FI_WRITE
    | FI_SEND
    | FI_RECV
    | FI_REMOTE_READ
    | FI_REMOTE_WRITE;
/// Secondary capabilities: offered whether or not they were asked for.
pub const SECONDARY_CAPS: u64 =
    FI_TRIGGER | FI_RMA_EVENT | FI_LOCAL_COMM | FI_REMOTE_COMM | FI_MULTI_RECV;
/// The capabilities that address a peer's registered memory.
pub const REMOTE_MEMORY_CAPS: u64 =
    FI_RMA | FI_ATOMIC | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_RMA_EVENT;
/// Secondary capabilities given only to applications that ask for them: the source
/// address of every receive (`fi_cq_readfrom`), which costs a look-up per receive.
pub const ASKED_CAPS: u64 = abi::FI_SOURCE;
/// Address vectors shared between processes by name (`FI_SHARED_AV`, a domain
/// capability too): given to applications that ask, on endpoints that use an AV.
pub const FI_SHARED_AV: u64 = abi::FI_SHARED_AV;
/// Everything the provider can do.
pub const CAPS: u64 = PRIMARY_CAPS | SECONDARY_CAPS | ASKED_CAPS | FI_SHARED_AV;
/// Transmit-side capabilities (naming a receive context is the initiator's:
/// `FI_NAMED_RX_CTX`, fi_endpoint(3)).
pub const TX_CAPS: u64 = FI_MSG
    | FI_RMA
    | FI_TAGGED
    | FI_ATOMIC
    | FI_READ
    | FI_WRITE
    | FI_SEND
    | FI_TRIGGER
    | FI_NAMED_RX_CTX;
/// Receive-side capabilities.
pub const RX_CAPS: u64 = FI_MSG
    | FI_RMA
    | FI_TAGGED
    | FI_ATOMIC
    | FI_RECV
    | FI_REMOTE_READ
    | FI_REMOTE_WRITE
    | FI_DIRECTED_RECV
    | FI_TRIGGER
    | FI_RMA_EVENT
    | FI_MULTI_RECV
    | ASKED_CAPS;

/// Operation flags the endpoints accept (on the receive side also [`FI_MULTI_RECV`]).
pub const OP_FLAGS: u64 = (abi::FI_COMPLETION
    | abi::FI_INJECT
    | abi::FI_INJECT_COMPLETE
    | abi::FI_TRANSMIT_COMPLETE
    | abi::FI_DELIVERY_COMPLETE) as u64;
/// Message orderings kept: send after send (one RC connection per peer keeps order).
pub const MSG_ORDER: u64 = abi::FI_ORDER_SAS as u64;

/// `mr_mode` bits.
pub const FI_MR_LOCAL: i32 = abi::FI_MR_LOCAL as i32;
pub const FI_MR_VIRT_ADDR: i32 = abi::FI_MR_VIRT_ADDR as i32;
pub const FI_MR_ALLOCATED: i32 = abi::FI_MR_ALLOCATED as i32;
pub const FI_MR_PROV_KEY: i32 = abi::FI_MR_PROV_KEY as i32;
const FI_MR_BASIC: i32 = abi::fi_mr_mode_FI_MR_BASIC as i32;
const FI_MR_SCALABLE: i32 = abi::fi_mr_mode_FI_MR_SCALABLE as i32;

/// The address format of a ringbell endpoint: provider specific, a fixed binary address.
pub const ADDR_FORMAT: u32 = abi::FI_PROV_SPECIFIC | 0x5242;
/// Bytes of a ringbell endpoint address.
pub const ADDR_LEN: usize = 16;
/// The tag format: 64 usable bits, the top one set (which MPI libraries expect).
pub const MEM_TAG_FORMAT: u64 = 0xAAAA_AAAA_AAAA_AAAA;

/// An offer: one endpoint type (RDM or DGRAM) on one NIC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Offer {
    /// The NIC's name (`rb0`, ...): the domain name.
    pub domain: String,
    /// `FI_EP_RDM` or `FI_EP_DGRAM`.
    pub ep_type: abi::fi_ep_type,
    /// Capabilities.
    pub caps: u64,
    /// Modes the provider needs the application to support.
    pub mode: u64,
    /// Memory registration mode.
    pub mr_mode: i32,
    /// Threading model.
    pub threading: abi::fi_threading,
    /// Progress model (control and data).
    pub progress: abi::fi_progress,
    /// Resource management.
    pub resource_mgmt: abi::fi_resource_mgmt,
    /// Address vector type (UNSPEC: both map and table).
    pub av_type: abi::fi_av_type,
    /// Bytes of remote CQ data.
    pub cq_data_size: usize,
    /// Largest message.
    pub max_msg_size: usize,
    /// Most inline (injected) bytes.
    pub inject_size: usize,
    /// Transmit and receive queue depths.
    pub tx_size: usize,
    /// Receive queue depth.
    pub rx_size: usize,
    /// Gather/scatter entries per operation.
    pub iov_limit: usize,
    /// Transmit operation flags (what the hints asked for, after matching).
    pub tx_op_flags: u64,
    /// Receive operation flags.
    pub rx_op_flags: u64,
    /// Destination address from the hints, copied through.
    pub dest_addr: Option<Vec<u8>>,
    /// The local address (the NIC's, with no endpoint).
    pub src_addr: Option<Vec<u8>>,
    /// The address format (`ADDR_FORMAT`, or `FI_SOCKADDR_IN` for hints asking for a
    /// sockaddr format): that of `src_addr` and `dest_addr`.
    pub addr_format: u32,
    /// Endpoints take a shared transmit context (`tx_ctx_cnt` `FI_SHARED_CONTEXT`,
    /// `fi_stx_context`), as the hints asked.
    pub shared_tx: bool,
    /// Endpoints take a shared receive context (`rx_ctx_cnt` `FI_SHARED_CONTEXT`,
    /// `fi_srx_context`): untagged messages of RDM and connected endpoints only.
    pub shared_rx: bool,
    /// Transmit and receive contexts of an endpoint (`ep_attr->tx_ctx_cnt`,
    /// `rx_ctx_cnt`): 1, or as many as the hints asked of an RDM offer (a scalable
    /// endpoint, `fi_scalable_ep`), up to [`MAX_EP_CTX`].
    pub ctx_cnt: (usize, usize),
}

/// Most contexts of a scalable endpoint (`max_ep_tx_ctx`, `max_ep_rx_ctx` of an RDM offer).
pub const MAX_EP_CTX: usize = crate::prov::MAX_EP_CTX;

impl Offer {
    /// The default offer for NIC `domain`, before any hints.
    pub fn for_nic(domain: &str) -> Offer {
        Offer {
            domain: domain.to_string(),
            ep_type: abi::fi_ep_type_FI_EP_RDM,
            caps: CAPS,
            mode: 0,
            mr_mode: FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY,
            threading: abi::fi_threading_FI_THREAD_SAFE,
            progress: abi::fi_progress_FI_PROGRESS_MANUAL,
            resource_mgmt: abi::fi_resource_mgmt_FI_RM_ENABLED,
            av_type: abi::fi_av_type_FI_AV_UNSPEC,
            cq_data_size: 4,
            max_msg_size: 1 << 30,
            inject_size: INJECT_SIZE,
            tx_size: 1024,
            rx_size: 1024,
            iov_limit: IOV_LIMIT,
            tx_op_flags: 0,
            rx_op_flags: 0,
            dest_addr: None,
            src_addr: None,
            addr_format: ADDR_FORMAT,
            shared_tx: false,
            shared_rx: false,
            ctx_cnt: (1, 1),
        }
    }
}

impl Offer {
    /// The datagram offer for NIC `domain`: unreliable, unconnected messages over one UD QP
    /// per endpoint (`FI_EP_DGRAM`), each at most one packet ([`DGRAM_MAX_MSG`] bytes).
    /// Untagged messages only, no ordering promised, and no `FI_MSG_PREFIX`: the provider
    /// gives every receive the room the NIC's 40-byte GRH area takes.
    pub fn dgram_for_nic(domain: &str) -> Offer {
        Offer {
            ep_type: abi::fi_ep_type_FI_EP_DGRAM,
            caps: DGRAM_CAPS,
            max_msg_size: DGRAM_MAX_MSG,
            ..Offer::for_nic(domain)
        }
    }

    /// The connected offer for NIC `domain` (`FI_EP_MSG`): messages, RMA and atomics over
    /// one RC connection per endpoint, made through a passive endpoint's event queue
    /// (fi_cm(3)); tagged messages over a second one.
    pub fn msg_for_nic(domain: &str) -> Offer {
        Offer {
            ep_type: abi::fi_ep_type_FI_EP_MSG,
            caps: MSG_EP_CAPS,
            ..Offer::for_nic(domain)
        }
    }

    /// Message orderings kept.
    pub fn msg_order(&self) -> u64 {
        if self.ep_type == abi::fi_ep_type_FI_EP_DGRAM {
            0
        } else {
            MSG_ORDER
        }
    }
}

/// What a connected endpoint can do (remote accesses counted: `FI_RMA_EVENT`; tagged
/// messages over a channel of their own).
pub const MSG_EP_CAPS: u64 = FI_MSG
    | FI_TAGGED
    | FI_RMA
    | FI_ATOMIC
    | FI_READ
    | FI_WRITE
    | FI_SEND
    | FI_RECV
    | FI_REMOTE_READ
    | FI_REMOTE_WRITE
    | FI_RMA_EVENT
    | FI_LOCAL_COMM
    | FI_REMOTE_COMM
    | FI_MULTI_RECV;
/// What a datagram endpoint can do.
pub const DGRAM_CAPS: u64 =
    FI_MSG | FI_SEND | FI_RECV | FI_LOCAL_COMM | FI_REMOTE_COMM | ASKED_CAPS | FI_SHARED_AV;
/// Largest datagram: one packet at the fabric's path MTU (`ringbell::UD_MAX_PAYLOAD`).
pub const DGRAM_MAX_MSG: usize = 4096;

/// Most inline (injected) bytes: the ABI's limit for a SEND WQE (`wqe::MAX_INLINE_SEND`).
pub const INJECT_SIZE: usize = 236;

/// Transmit or receive attributes an application asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueHints {
    pub caps: u64,
    pub mode: u64,
    pub op_flags: u64,
    pub msg_order: u64,
    pub inject_size: usize,
    pub size: usize,
    pub iov_limit: usize,
}

/// What a caller's `fi_info` hints ask for; zero fields ask for nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hints {
    pub caps: u64,
    /// The domain's capabilities asked for (`domain_attr->caps`).
    pub domain_caps: u64,
    /// The modes the application supports (`None`: the hints gave no `fi_info`, so every
    /// mode is supported).
    pub mode: Option<u64>,
    pub addr_format: u32,
    pub dest_addr: Option<Vec<u8>>,
    /// The source address of the hints (either format).
    pub src_addr: Option<Vec<u8>>,
    /// The hints' `handle` (a passive endpoint's fid, whose address an endpoint may take).
    pub handle: usize,
    pub ep_type: abi::fi_ep_type,
    pub protocol: u32,
    pub max_msg_size: usize,
    pub mem_tag_format: u64,
    /// The endpoint's transmit and receive contexts asked for (`ep_attr->tx_ctx_cnt`,
    /// `rx_ctx_cnt`): 0 or 1, or `FI_SHARED_CONTEXT` (shared contexts) or more (a scalable
    /// endpoint), which no offer has.
    pub ctx_cnt: (usize, usize),
    pub tx: Option<QueueHints>,
    pub rx: Option<QueueHints>,
    pub domain_name: Option<String>,
    pub threading: abi::fi_threading,
    pub control_progress: abi::fi_progress,
    pub data_progress: abi::fi_progress,
    pub resource_mgmt: abi::fi_resource_mgmt,
    pub av_type: abi::fi_av_type,
    /// `Some` when the hints had a domain attribute (then 0 means "no mode supported").
    pub mr_mode: Option<i32>,
    pub cq_data_size: usize,
    pub fabric_name: Option<String>,
    pub prov_name: Option<String>,
}

/// Why an offer does not match.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoMatch {
    EpType,
    Caps,
    Mode,
    AddrFormat,
    Domain,
    Fabric,
    Provider,
    Version,
    Threading,
    Progress,
    ResourceMgmt,
    AvType,
    CqData,
    MrMode,
    Protocol,
    MsgSize,
    TagFormat,
    Tx,
    Rx,
    Contexts,
}

fn threading_rank(t: abi::fi_threading) -> u32 {
    match t {
        abi::fi_threading_FI_THREAD_SAFE => 1,
        abi::fi_threading_FI_THREAD_FID => 2,
        abi::fi_threading_FI_THREAD_ENDPOINT => 3,
        abi::fi_threading_FI_THREAD_COMPLETION => 4,
        abi::fi_threading_FI_THREAD_DOMAIN => 5,
        _ => 6,
    }
}

fn progress_rank(p: abi::fi_progress) -> u32 {
    match p {
        abi::fi_progress_FI_PROGRESS_AUTO => 1,
        abi::fi_progress_FI_PROGRESS_MANUAL => 2,
        _ => 3,
    }
}

fn rm_rank(r: abi::fi_resource_mgmt) -> u32 {
    match r {
        abi::fi_resource_mgmt_FI_RM_ENABLED => 1,
        abi::fi_resource_mgmt_FI_RM_DISABLED => 2,
        _ => 3,
    }
}

/// Bits of a tag format: the position of the highest set bit, plus one.
fn tag_bits(format: u64) -> u32 {
    64 - format.leading_zeros()
}

/// Matches `hints` (asked with API `version`) against `offer`; the offer as the caller gets
/// it, or why not.
pub fn match_offer(version: u32, hints: &Hints, offer: &Offer) -> Result<Offer, NoMatch> {
    if !(MIN_API_VERSION..=API_VERSION).contains(&version) {
        return Err(NoMatch::Version);
    }
    if let Some(p) = &hints.prov_name {
        if !p.split(';').any(|n| n == PROVIDER_NAME) {
            return Err(NoMatch::Provider);
        }
    }
    if hints
        .fabric_name
        .as_deref()
        .is_some_and(|f| f != PROVIDER_NAME)
    {
        return Err(NoMatch::Fabric);
    }
    if hints
        .domain_name
        .as_deref()
        .is_some_and(|d| d != offer.domain)
    {
        return Err(NoMatch::Domain);
    }
    if hints.ep_type != abi::fi_ep_type_FI_EP_UNSPEC && hints.ep_type != offer.ep_type {
        return Err(NoMatch::EpType);
    }
    if hints.caps & !offer.caps != 0 {
        return Err(NoMatch::Caps);
    }
    // A domain offers local and remote communication, and named AVs shared between
    // processes where its endpoints use AVs.
    if hints.domain_caps & !(FI_LOCAL_COMM | FI_REMOTE_COMM | (offer.caps & FI_SHARED_AV)) != 0 {
        return Err(NoMatch::Caps);
    }
    if !ADDR_FORMATS.contains(&hints.addr_format) {
        return Err(NoMatch::AddrFormat);
    }
    if hints.protocol != 0 && hints.protocol != abi::FI_PROTO_UNSPEC {
        return Err(NoMatch::Protocol);
    }
    if hints.max_msg_size > offer.max_msg_size {
        return Err(NoMatch::MsgSize);
    }
    // One transmit and one receive context per endpoint (fi_endpoint(3)), either of
    // which may be a shared one (FI_SHARED_CONTEXT, SIZE_MAX: fi_stx_context,
    // fi_srx_context); or, on an RDM endpoint, up to MAX_EP_CTX of each (a scalable
    // endpoint, fi_scalable_ep).
    let shared_tx = hints.ctx_cnt.0 == usize::MAX;
    let shared_rx = hints.ctx_cnt.1 == usize::MAX;
    let most = if offer.ep_type == abi::fi_ep_type_FI_EP_RDM {
        MAX_EP_CTX
    } else {
        1
    };
    if (hints.ctx_cnt.0 > most && !shared_tx) || (hints.ctx_cnt.1 > most && !shared_rx) {
        return Err(NoMatch::Contexts);
    }
    // A scalable endpoint's contexts are its own, not shared ones.
    if (shared_tx && hints.ctx_cnt.1 > 1 && !shared_rx)
        || (shared_rx && hints.ctx_cnt.0 > 1 && !shared_tx)
    {
        return Err(NoMatch::Contexts);
    }
    // A shared receive context takes untagged messages (its endpoints share one receive
    // queue, not a tag matcher), of RDM, connected or datagram endpoints (whose UD QPs
    // then take their receives from its SRQ). Its completions do not name their senders
    // (FI_SOURCE).
    if shared_rx && (hints.caps & PRIMARY_CAPS & FI_TAGGED != 0 || hints.caps & ASKED_CAPS != 0) {
        return Err(NoMatch::Contexts);
    }
    if hints.caps & FI_TAGGED != 0
        && hints.mem_tag_format != 0
        && tag_bits(hints.mem_tag_format) > tag_bits(MEM_TAG_FORMAT)
    {
        return Err(NoMatch::TagFormat);
    }
    if hints.threading != 0 && threading_rank(hints.threading) < threading_rank(offer.threading) {
        return Err(NoMatch::Threading);
    }
    for p in [hints.control_progress, hints.data_progress] {
        if p != 0 && progress_rank(p) < progress_rank(offer.progress) {
            return Err(NoMatch::Progress);
        }
    }
    if hints.resource_mgmt != 0 && rm_rank(hints.resource_mgmt) < rm_rank(offer.resource_mgmt) {
        return Err(NoMatch::ResourceMgmt);
    }
    if hints.av_type != 0 && offer.av_type != 0 && hints.av_type != offer.av_type {
        return Err(NoMatch::AvType);
    }
    if hints.cq_data_size > offer.cq_data_size {
        return Err(NoMatch::CqData);
    }
    let mut out = offer.clone();
    out.shared_tx = shared_tx;
    out.shared_rx = shared_rx;
    out.ctx_cnt = (hints.ctx_cnt.0.max(1), hints.ctx_cnt.1.max(1));
    // Memory registration: without FI_MR_LOCAL in the hints the provider registers (or
    // copies) local buffers itself, and drops the bits the application does not handle.
    if let Some(m) = hints.mr_mode {
        if m & (FI_MR_BASIC | FI_MR_SCALABLE) != 0 {
            return Err(NoMatch::MrMode);
        }
        // (FI_LOCAL_MR, the mode bit of the same meaning, is for API versions before 1.5,
        // which this provider does not offer.) The remote-access bits (virtual addresses,
        // provider keys, allocated memory) are kept where the application handles them,
        // with FI_MR_LOCAL or without: an application reads FI_MR_VIRT_ADDR in the info to
        // know that remote addresses are virtual ones, not offsets into the region
        // (fi_domain(3)), as Open MPI's ofi BTL does.
        out.mr_mode = offer.mr_mode & m;
    }
    if let Some(app) = hints.mode {
        if out.mode & !app != 0 {
            return Err(NoMatch::Mode);
        }
    }
    // Remote CQ data of an RMA write consumes a posted receive at the target: the
    // FI_RX_CQ_DATA mode, asked of every application that supports it (without it, the
    // offer stands and such a write still needs a receive posted; README).
    if offer.caps & FI_RMA != 0 && hints.mode.is_none_or(|app| app & FI_RX_CQ_DATA != 0) {
        out.mode |= FI_RX_CQ_DATA;
    }
    let queue = |q: &Option<QueueHints>, caps: u64, flags: u64, size: usize| -> Result<u64, ()> {
        let Some(q) = q else { return Ok(0) };
        if q.caps & !caps != 0
            || q.op_flags & !flags != 0
            || q.msg_order & !offer.msg_order() != 0
            || q.inject_size > offer.inject_size
            || q.size > size
            || q.iov_limit > offer.iov_limit
        {
            return Err(());
        }
        Ok(q.op_flags)
    };
    out.tx_op_flags = queue(&hints.tx, offer.caps & TX_CAPS, OP_FLAGS, offer.tx_size)
        .map_err(|()| NoMatch::Tx)?;
    let rx_flags = OP_FLAGS | (offer.caps & FI_MULTI_RECV);
    out.rx_op_flags = queue(&hints.rx, offer.caps & RX_CAPS, rx_flags, offer.rx_size)
        .map_err(|()| NoMatch::Rx)?;
    if let Some(t) = hints.tx.filter(|t| t.inject_size != 0) {
        out.inject_size = t.inject_size;
    }
    if hints.threading != 0 {
        out.threading = hints.threading;
    }
    if hints.av_type != 0 {
        out.av_type = hints.av_type;
    }
    let primary = if hints.caps & PRIMARY_CAPS != 0 {
        hints.caps & PRIMARY_CAPS
    } else {
        offer.caps & PRIMARY_CAPS
    };
    out.caps = primary
        | (offer.caps & SECONDARY_CAPS)
        | (hints.caps & SECONDARY_CAPS)
        | (hints.caps & ASKED_CAPS)
        | ((hints.caps | hints.domain_caps) & FI_SHARED_AV);
    if shared_rx {
        out.caps &= !FI_TAGGED;
    }
    // Remote memory is addressed by virtual address and the provider's key: an application
    // that handles neither (its mr_mode lacks FI_MR_VIRT_ADDR or FI_MR_PROV_KEY) gets no
    // RMA or atomics, and is refused if it asked for them (fi_domain(3), fi_mr(3)).
    if hints
        .mr_mode
        .is_some_and(|m| m & (FI_MR_VIRT_ADDR | FI_MR_PROV_KEY) != FI_MR_VIRT_ADDR | FI_MR_PROV_KEY)
    {
        if hints.caps & REMOTE_MEMORY_CAPS != 0 {
            return Err(NoMatch::MrMode);
        }
        out.caps &= !REMOTE_MEMORY_CAPS;
    }
    // The format asked for: FI_SOCKADDR (any socket address) gets the concrete one the
    // provider has, FI_SOCKADDR_IN (fi_getinfo(3)); the offer's addresses in it.
    let format = Format::of(hints.addr_format);
    if hints.addr_format != abi::FI_FORMAT_UNSPEC {
        out.addr_format = format.addr_format();
        for a in [&mut out.src_addr, &mut out.dest_addr]
            .into_iter()
            .flatten()
        {
            if let Some(x) = addr_from_bytes(a) {
                *a = format.out(&x).to_vec();
            }
        }
    }
    // The hints' destination, in the offer's format when it is an address of either.
    if let Some(d) = &hints.dest_addr {
        let f = Format::of(out.addr_format);
        out.dest_addr = Some(addr_from_bytes(d).map_or_else(|| d.clone(), |a| f.out(&a).to_vec()));
    }
    Ok(out)
}

/// The address formats hints may ask for: none in particular, the provider's own, and
/// the IPv4 socket address (`FI_SOCKADDR`: a socket address of the provider's choosing).
pub const ADDR_FORMATS: [u32; 4] = [
    abi::FI_FORMAT_UNSPEC,
    ADDR_FORMAT,
    abi::FI_SOCKADDR,
    abi::FI_SOCKADDR_IN,
];

#[cfg(test)]
mod tests {
    use super::*;

    const V: u32 = API_VERSION;

    fn rb0() -> Offer {
        Offer::for_nic("rb0")
    }

    #[test]
    fn no_hints_get_everything() {
        let o = match_offer(V, &Hints::default(), &rb0()).unwrap();
        // Everything but what is given only to those who ask (FI_SOURCE, FI_SHARED_AV).
        assert_eq!(o.caps, CAPS & !ASKED_CAPS & !FI_SHARED_AV);
        assert_eq!(o.mr_mode, rb0().mr_mode);
        let asked = Hints {
            caps: FI_MSG | ASKED_CAPS,
            ..Default::default()
        };
        let o = match_offer(V, &asked, &rb0()).unwrap();
        assert_eq!(o.caps & ASKED_CAPS, ASKED_CAPS);
    }

    #[test]
    fn connected_endpoints_offer_tagged_messages_to_those_that_ask() {
        let msg = Offer::msg_for_nic("rb0");
        let h = |caps| Hints {
            caps,
            ep_type: abi::fi_ep_type_FI_EP_MSG,
            ..Default::default()
        };
        let o = match_offer(V, &h(FI_MSG | FI_TAGGED), &msg).unwrap();
        assert_eq!(o.caps & (FI_MSG | FI_TAGGED), FI_MSG | FI_TAGGED);
        assert_eq!(
            match_offer(V, &h(FI_MSG), &msg).unwrap().caps & FI_TAGGED,
            0
        );
    }

    #[test]
    fn shared_avs_are_offered_where_endpoints_use_avs() {
        for (offer, has) in [
            (rb0(), true),
            (Offer::dgram_for_nic("rb0"), true),
            (Offer::msg_for_nic("rb0"), false),
        ] {
            for (caps, domain_caps) in [(FI_MSG | FI_SHARED_AV, 0), (0, FI_SHARED_AV)] {
                let h = Hints {
                    caps,
                    domain_caps,
                    ..Default::default()
                };
                match match_offer(V, &h, &offer) {
                    Ok(o) => assert!(has && o.caps & FI_SHARED_AV != 0),
                    Err(e) => assert!(!has && e == NoMatch::Caps),
                }
            }
        }
    }

    #[test]
    fn shared_contexts_and_scalable_rdm_endpoints_are_offered() {
        for offer in [
            rb0(),
            Offer::dgram_for_nic("rb0"),
            Offer::msg_for_nic("rb0"),
        ] {
            let h = |ctx: (usize, usize)| {
                match_offer(
                    V,
                    &Hints {
                        ctx_cnt: ctx,
                        ..Default::default()
                    },
                    &offer,
                )
            };
            assert!(h((0, 0)).is_ok() && h((1, 1)).is_ok());
            assert!(!h((1, 1)).unwrap().shared_tx);
            // A shared transmit context is offered (as the hints asked), nothing more.
            assert!(h((usize::MAX, 0)).unwrap().shared_tx);
            assert!(h((usize::MAX, 1)).unwrap().shared_tx);
            // Several contexts: a scalable endpoint, RDM only, up to MAX_EP_CTX of each.
            let rdm = offer.ep_type == abi::fi_ep_type_FI_EP_RDM;
            for ctx in [(2, 1), (1, 4), (MAX_EP_CTX, MAX_EP_CTX)] {
                match h(ctx) {
                    Ok(o) => {
                        assert!(rdm, "{ctx:?}");
                        assert_eq!(o.ctx_cnt, (ctx.0.max(1), ctx.1), "{ctx:?}");
                    }
                    Err(e) => assert!(!rdm && e == NoMatch::Contexts, "{ctx:?}"),
                }
            }
            // More than MAX_EP_CTX, or several contexts beside a shared one.
            for ctx in [
                (MAX_EP_CTX + 1, 1),
                (1, MAX_EP_CTX + 1),
                (usize::MAX, 2),
                (2, usize::MAX),
            ] {
                assert_eq!(h(ctx), Err(NoMatch::Contexts), "{ctx:?}");
            }
            assert_eq!(h((0, 0)).unwrap().ctx_cnt, (1, 1));
            assert_eq!(
                h((0, 0)).unwrap().caps & FI_NAMED_RX_CTX != 0,
                rdm,
                "named receive contexts are an RDM capability"
            );
            // A shared receive context: untagged messages, on every endpoint type.
            for ctx in [(0, usize::MAX), (usize::MAX, usize::MAX)] {
                let o = h(ctx).unwrap();
                assert!(o.shared_rx && o.caps & FI_TAGGED == 0, "{ctx:?}");
            }
        }
    }

    #[test]
    fn the_datagram_offer_takes_untagged_messages_of_one_packet() {
        let dg = Offer::dgram_for_nic("rb0");
        let h = |f: &dyn Fn(&mut Hints)| {
            let mut h = Hints::default();
            f(&mut h);
            match_offer(V, &h, &dg)
        };
        let o = h(&|h| h.ep_type = abi::fi_ep_type_FI_EP_DGRAM).unwrap();
        assert_eq!(o.ep_type, abi::fi_ep_type_FI_EP_DGRAM);
        assert_eq!(o.caps, DGRAM_CAPS & !ASKED_CAPS & !FI_SHARED_AV);
        assert_eq!(o.max_msg_size, DGRAM_MAX_MSG);
        assert_eq!(o.msg_order(), 0);
        // No mode asked of the application: no prefix, and no FI_RX_CQ_DATA (no RMA).
        assert_eq!(o.mode, 0);
        assert_eq!(
            h(&|h| h.ep_type = abi::fi_ep_type_FI_EP_RDM),
            Err(NoMatch::EpType)
        );
        for caps in [FI_TAGGED, FI_RMA, FI_ATOMIC, FI_TRIGGER, FI_MULTI_RECV] {
            assert_eq!(
                h(&|h| h.caps = FI_MSG | caps),
                Err(NoMatch::Caps),
                "{caps:#x}"
            );
        }
        assert_eq!(
            h(&|h| h.max_msg_size = DGRAM_MAX_MSG + 1),
            Err(NoMatch::MsgSize)
        );
        assert!(h(&|h| h.max_msg_size = DGRAM_MAX_MSG).is_ok());
        let q = |order: u64, flags: u64| {
            Some(QueueHints {
                msg_order: order,
                op_flags: flags,
                ..Default::default()
            })
        };
        assert_eq!(
            h(&|h| h.tx = q(abi::FI_ORDER_SAS as u64, 0)),
            Err(NoMatch::Tx)
        );
        assert_eq!(h(&|h| h.rx = q(0, FI_MULTI_RECV)), Err(NoMatch::Rx));
        assert!(h(&|h| h.rx = q(0, abi::FI_COMPLETION as u64)).is_ok());
        // An application that handles a prefix gets none.
        assert_eq!(
            h(&|h| h.mode = Some(abi::FI_MSG_PREFIX | abi::FI_CONTEXT))
                .unwrap()
                .mode,
            0
        );
    }

    #[test]
    fn endpoint_types_versions_names_and_formats() {
        let h = |f: &dyn Fn(&mut Hints)| {
            let mut h = Hints::default();
            f(&mut h);
            match_offer(V, &h, &rb0())
        };
        assert_eq!(
            h(&|h| h.ep_type = abi::fi_ep_type_FI_EP_MSG),
            Err(NoMatch::EpType)
        );
        assert_eq!(
            h(&|h| h.ep_type = abi::fi_ep_type_FI_EP_DGRAM),
            Err(NoMatch::EpType)
        );
        assert!(h(&|h| h.ep_type = abi::fi_ep_type_FI_EP_RDM).is_ok());
        assert_eq!(
            match_offer(fi_version(1, 18), &Hints::default(), &rb0()),
            Err(NoMatch::Version)
        );
        assert_eq!(
            match_offer(fi_version(1, 4), &Hints::default(), &rb0()),
            Err(NoMatch::Version)
        );
        assert!(match_offer(fi_version(1, 5), &Hints::default(), &rb0()).is_ok());
        assert_eq!(
            h(&|h| h.domain_name = Some("rb1".into())),
            Err(NoMatch::Domain)
        );
        assert!(h(&|h| h.domain_name = Some("rb0".into())).is_ok());
        assert_eq!(
            h(&|h| h.fabric_name = Some("tcp".into())),
            Err(NoMatch::Fabric)
        );
        assert_eq!(
            h(&|h| h.prov_name = Some("tcp".into())),
            Err(NoMatch::Provider)
        );
        assert!(h(&|h| h.prov_name = Some("ringbell".into())).is_ok());
        for f in [abi::FI_SOCKADDR_IN6, abi::FI_SOCKADDR_IB, abi::FI_ADDR_STR] {
            assert_eq!(h(&|h| h.addr_format = f), Err(NoMatch::AddrFormat), "{f}");
        }
        assert!(h(&|h| h.addr_format = ADDR_FORMAT).is_ok());
        assert!(h(&|h| h.addr_format = abi::FI_SOCKADDR_IN).is_ok());
        assert_eq!(
            h(&|h| h.caps = FI_TAGGED | abi::FI_MULTICAST as u64),
            Err(NoMatch::Caps)
        );
        assert_eq!(
            h(&|h| h.control_progress = abi::fi_progress_FI_PROGRESS_AUTO),
            Err(NoMatch::Progress)
        );
        assert!(h(&|h| h.data_progress = abi::fi_progress_FI_PROGRESS_MANUAL).is_ok());
        assert_eq!(h(&|h| h.cq_data_size = 8), Err(NoMatch::CqData));
        assert_eq!(
            h(&|h| h.tx = Some(QueueHints {
                inject_size: 4096,
                ..Default::default()
            })),
            Err(NoMatch::Tx)
        );
        assert_eq!(
            h(&|h| h.rx = Some(QueueHints {
                msg_order: abi::FI_ORDER_RAW as u64,
                ..Default::default()
            })),
            Err(NoMatch::Rx)
        );
    }

    #[test]
    fn caps_are_trimmed_to_what_was_asked_plus_the_secondary_ones() {
        let h = Hints {
            caps: FI_TAGGED | FI_DIRECTED_RECV,
            ..Default::default()
        };
        let o = match_offer(V, &h, &rb0()).unwrap();
        assert_eq!(o.caps, FI_TAGGED | FI_DIRECTED_RECV | SECONDARY_CAPS);
    }

    #[test]
    fn mpi_style_hints_get_no_local_registration() {
        // mr_mode 0 and the FI_CONTEXT modes only, as Open MPI's ofi MTL asks.
        let h = Hints {
            caps: FI_TAGGED | FI_DIRECTED_RECV | FI_LOCAL_COMM | FI_REMOTE_COMM,
            mode: Some(abi::FI_CONTEXT | abi::FI_CONTEXT2),
            ep_type: abi::fi_ep_type_FI_EP_RDM,
            mr_mode: Some(0),
            cq_data_size: 4,
            threading: abi::fi_threading_FI_THREAD_DOMAIN,
            resource_mgmt: abi::fi_resource_mgmt_FI_RM_ENABLED,
            av_type: abi::fi_av_type_FI_AV_MAP,
            mem_tag_format: MEM_TAG_FORMAT,
            ..Default::default()
        };
        let o = match_offer(fi_version(1, 5), &h, &rb0()).unwrap();
        assert_eq!(o.mr_mode, 0);
        assert_eq!(o.av_type, abi::fi_av_type_FI_AV_MAP);
        assert_eq!(o.threading, abi::fi_threading_FI_THREAD_DOMAIN);
        // fi_pingpong's: FI_MR_LOCAL and the remote-key bits.
        let h = Hints {
            mr_mode: Some(FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_VIRT_ADDR),
            ..Default::default()
        };
        let o = match_offer(V, &h, &rb0()).unwrap();
        assert_eq!(
            o.mr_mode,
            FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_VIRT_ADDR
        );
        // Open MPI's ofi BTL: the remote-key bits without FI_MR_LOCAL. The info keeps
        // FI_MR_VIRT_ADDR, which tells it remote addresses are virtual, not offsets.
        let h = Hints {
            caps: FI_RMA | FI_ATOMIC,
            mr_mode: Some(FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_VIRT_ADDR),
            ..Default::default()
        };
        let o = match_offer(V, &h, &rb0()).unwrap();
        assert_eq!(
            o.mr_mode,
            FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_VIRT_ADDR
        );
        assert_eq!(o.caps & (FI_RMA | FI_ATOMIC), FI_RMA | FI_ATOMIC);
        let h = Hints {
            mr_mode: Some(FI_MR_BASIC),
            ..Default::default()
        };
        assert_eq!(match_offer(V, &h, &rb0()), Err(NoMatch::MrMode));
    }

    #[test]
    fn a_longer_tag_format_than_64_bits_cannot_exist_and_destination_is_copied() {
        let h = Hints {
            caps: FI_TAGGED,
            mem_tag_format: u64::MAX,
            dest_addr: Some(vec![1, 2, 3]),
            ..Default::default()
        };
        let o = match_offer(V, &h, &rb0()).unwrap();
        assert_eq!(o.dest_addr, Some(vec![1, 2, 3]));
    }

    #[test]
    fn sockaddr_hints_get_sockaddr_in_offers_with_their_addresses_converted() {
        use crate::prov::{make_addr, sockaddr_in};
        let mut offer = rb0();
        offer.src_addr = Some(make_addr([10, 0, 0, 1], 9228).to_vec());
        offer.dest_addr = Some(make_addr([127, 0, 0, 1], 4000).to_vec());
        for f in [abi::FI_SOCKADDR, abi::FI_SOCKADDR_IN] {
            let h = Hints {
                addr_format: f,
                ..Default::default()
            };
            let o = match_offer(V, &h, &offer).unwrap();
            // FI_SOCKADDR gets the concrete format the provider has.
            assert_eq!(o.addr_format, abi::FI_SOCKADDR_IN);
            assert_eq!(o.src_addr, Some(sockaddr_in([10, 0, 0, 1], 9228).to_vec()));
            assert_eq!(
                o.dest_addr,
                Some(sockaddr_in([127, 0, 0, 1], 4000).to_vec())
            );
        }
        // The default stays the provider's own format, addresses untouched.
        for f in [abi::FI_FORMAT_UNSPEC, ADDR_FORMAT] {
            let h = Hints {
                addr_format: f,
                ..Default::default()
            };
            let o = match_offer(V, &h, &offer).unwrap();
            assert_eq!(o.addr_format, ADDR_FORMAT);
            assert_eq!(o.src_addr, offer.src_addr);
            assert_eq!(o.dest_addr, offer.dest_addr);
        }
        // A destination in the hints, in either format, comes back in the offer's.
        let h = Hints {
            addr_format: abi::FI_SOCKADDR_IN,
            dest_addr: Some(make_addr([10, 0, 0, 2], 77).to_vec()),
            ..Default::default()
        };
        let o = match_offer(V, &h, &rb0()).unwrap();
        assert_eq!(o.dest_addr, Some(sockaddr_in([10, 0, 0, 2], 77).to_vec()));
        let h = Hints {
            dest_addr: Some(sockaddr_in([10, 0, 0, 2], 77).to_vec()),
            ..Default::default()
        };
        let o = match_offer(V, &h, &rb0()).unwrap();
        assert_eq!(o.dest_addr, Some(make_addr([10, 0, 0, 2], 77).to_vec()));
    }
}
