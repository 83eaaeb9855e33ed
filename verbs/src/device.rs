//! Devices and contexts: what `ibv_get_device_list`, `ibv_open_device` and the query verbs
//! show of a ringbell NIC.

use crate::abi;
use crate::state::{Kind, State};
use ringbell::{Device, DeviceCaps};
use std::collections::VecDeque;
use std::os::raw::c_int;

/// PCI vendor id of a ringbell NIC (what `ibv_devinfo` prints as vendor_id).
pub const VENDOR_ID: u32 = 0x1de5;
/// Part id.
pub const VENDOR_PART_ID: u32 = 0x0001;
/// Firmware version string.
pub const FW_VER: &str = "1.0.0 (ringbell)";

/// Writes `s` into a fixed C string field, NUL-terminated and truncated to fit.
pub(crate) fn set_cstr(field: &mut [core::ffi::c_char], s: &str) {
    field.fill(0);
    let room = field.len().saturating_sub(1);
    for (d, b) in field.iter_mut().zip(s.bytes().take(room)) {
        *d = b as core::ffi::c_char;
    }
}

/// A new `struct ibv_device` for NIC `name` (never freed).
pub(crate) fn new_ibv_device(name: &str) -> *mut abi::ibv_device {
    let mut d = abi::ibv_device {
        node_type: abi::ibv_node_type_IBV_NODE_CA,
        transport_type: abi::ibv_transport_type_IBV_TRANSPORT_IB,
        ..Default::default()
    };
    set_cstr(&mut d.name, name);
    set_cstr(&mut d.dev_name, &format!("uverbs-{name}"));
    set_cstr(
        &mut d.dev_path,
        &format!("/sys/class/infiniband_verbs/uverbs-{name}"),
    );
    set_cstr(&mut d.ibdev_path, &format!("/sys/class/infiniband/{name}"));
    // libibverbs allocates every device as its private `struct verbs_device` (712 bytes:
    // `ops` at 664, then a refcount, a list entry, `sysfs` and `core_support`), and
    // provider libraries read `ops` of any device handed to them to tell whether it is
    // theirs. Ours is the same size, with those private fields zero.
    let p = Box::into_raw(Box::new(VerbsDevice {
        device: d,
        private: [0; VERBS_DEVICE_PRIVATE / 8],
    }));
    p as *mut abi::ibv_device
}

/// Bytes of libibverbs' `struct verbs_device` after its `struct ibv_device`.
const VERBS_DEVICE_PRIVATE: usize = 712 - std::mem::size_of::<abi::ibv_device>();

/// A device as libibverbs lays one out.
#[repr(C)]
struct VerbsDevice {
    device: abi::ibv_device,
    private: [u64; VERBS_DEVICE_PRIVATE / 8],
}

/// The node GUID of a NIC: the EUI-64 of its MAC address, in network byte order.
pub(crate) fn guid_of(caps: &DeviceCaps) -> u64 {
    eui64(caps.mac)
}

/// The EUI-64 of a MAC address, in network byte order.
fn eui64(m: [u8; 6]) -> u64 {
    u64::from_be_bytes([m[0] ^ 2, m[1], m[2], 0xff, 0xfe, m[3], m[4], m[5]]).to_be()
}

/// The port's one GID: the RoCEv2 GID of the NIC's IPv4 address (`::ffff:a.b.c.d`).
pub(crate) fn gid_of(caps: &DeviceCaps) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&caps.ip);
    g
}

/// The MAC address a GID names on a ringbell fabric, or `None` for a GID that names no
/// ringbell port: the GID carries the IPv4 address, and the fabric's address plan
/// ([`ringbell::AhAttr::on_fabric`]) gives the MAC.
pub(crate) fn mac_of_gid(gid: &[u8; 16]) -> Option<([u8; 6], [u8; 4])> {
    if gid[..10] != [0; 10] || gid[10] != 0xff || gid[11] != 0xff {
        return None;
    }
    let ip = [gid[12], gid[13], gid[14], gid[15]];
    let a = ringbell::AhAttr::on_fabric(ip).or_else(|| ringbell::AhAttr::multicast(ip))?;
    Some((a.mac, a.ip))
}

/// A ringbell context: libibverbs' extended context (whose `context` member is what
/// programs hold) and the library's own state after it.
#[repr(C)]
pub(crate) struct RbContext {
    pub vctx: abi::verbs_context,
    /// The NIC.
    pub nic: usize,
    pub dev: Device,
    /// Async events waiting for `ibv_get_async_event`.
    pub events: VecDeque<abi::ibv_async_event>,
    /// Real time (ns since the Unix epoch) at the device's time zero, taken when the
    /// context opened: a completion's wall-clock time is this plus its device time
    /// (`IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK`).
    pub wall_offset_ns: u64,
}

impl RbContext {
    /// The `struct ibv_context *` programs use.
    pub fn ibv(&mut self) -> *mut abi::ibv_context {
        &mut self.vctx.context
    }
}

/// Opens a context on NIC `nic`: libibverbs' layout with every op filled in.
pub(crate) fn open(st: &mut State, nic: usize) -> Result<*mut abi::ibv_context, i32> {
    open_with(st, nic, None)
}

/// The inode (device, number) of descriptor `fd`, if it is open.
pub(crate) fn inode_of(fd: c_int) -> Option<(u64, u64)> {
    // SAFETY: `struct stat` is plain integers; all zeroes is a valid value.
    let mut sb: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat into a live struct; a bad descriptor only fails.
    (unsafe { libc::fstat(fd, &mut sb) } == 0).then_some((sb.st_dev, sb.st_ino))
}

/// `ibv_import_device`: a new context on the NIC of the live context whose `cmd_fd` the
/// program duplicated into `cmd_fd`, sharing that context's objects by handle
/// (`ibv_import_pd`, `ibv_import_mr`, `ibv_import_dm`). The new context owns `cmd_fd` and
/// closes it. `Ok(None)`: no context of this process has that descriptor (not ours). The
/// context's own descriptor, not a duplicate, is EINVAL (both would close it).
pub(crate) fn import(st: &mut State, cmd_fd: c_int) -> Result<Option<*mut abi::ibv_context>, i32> {
    let Some(ino) = inode_of(cmd_fd) else {
        return Err(libc::EBADF);
    };
    let found = st.contexts.iter().find_map(|(&nic, v)| {
        v.iter().find_map(|&p| {
            // SAFETY: the registry lists live contexts, under the lock.
            let fd = unsafe { ctx(p as *mut abi::ibv_context) }
                .vctx
                .context
                .cmd_fd;
            (inode_of(fd) == Some(ino)).then_some((nic, fd))
        })
    });
    match found {
        None => Ok(None),
        Some((_, fd)) if fd == cmd_fd => Err(libc::EINVAL),
        Some((nic, _)) => open_with(st, nic, Some(cmd_fd)).map(Some),
    }
}

/// [`open`], with the command descriptor given (an import) or made here.
fn open_with(
    st: &mut State,
    nic: usize,
    cmd_fd: Option<c_int>,
) -> Result<*mut abi::ibv_context, i32> {
    let dev = st.device(nic)?;
    let async_fd = crate::events::new_eventfd()?;
    // A descriptor of its own (a memory file: its inode is unique), so that programs that
    // dup or pass `cmd_fd` get a real descriptor and `ibv_import_device` can recognise it.
    // SAFETY: plain syscall with a NUL-terminated name; the descriptor is the context's.
    let cmd_fd = cmd_fd.unwrap_or_else(|| unsafe {
        libc::memfd_create(c"ringbell-verbs-cmd".as_ptr(), libc::MFD_CLOEXEC)
    });
    if cmd_fd < 0 {
        // SAFETY: the eventfd just made, not handed out.
        unsafe { libc::close(async_fd) };
        return Err(libc::EMFILE);
    }
    let mut vctx = abi::verbs_context {
        sz: std::mem::size_of::<abi::verbs_context>(),
        ..Default::default()
    };
    crate::ops::fill(&mut vctx);
    vctx.context.device = st.nics[nic].ibdev;
    vctx.context.cmd_fd = cmd_fd;
    vctx.context.async_fd = async_fd;
    vctx.context.num_comp_vectors = 1;
    vctx.context.abi_compat = usize::MAX as *mut _;
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let wall_offset_ns = now_ns.saturating_sub(dev.clock_ps() / 1000);
    let ctx = Box::into_raw(Box::new(RbContext {
        vctx,
        nic,
        dev,
        events: VecDeque::new(),
        wall_offset_ns,
    }));
    // SAFETY: `ctx` was just allocated; its mutex is initialised in place, where it stays.
    unsafe {
        libc::pthread_mutex_init(
            &mut (*ctx).vctx.context.mutex as *mut _ as *mut _,
            std::ptr::null(),
        )
    };
    // SAFETY: as above; the address of the member is what programs get.
    let p = unsafe { (*ctx).ibv() };
    st.add(p as usize, Kind::Context);
    st.contexts.entry(nic).or_default().push(p as usize);
    Ok(p)
}

/// The context behind `p` (a pointer [`State::owner`] said is a live context).
///
/// # Safety
/// `p` must be a live ringbell context and the state lock held.
pub(crate) unsafe fn ctx<'a>(p: *mut abi::ibv_context) -> &'a mut RbContext {
    let off = std::mem::offset_of!(abi::verbs_context, context);
    // SAFETY: every ringbell context is the `context` member of the `verbs_context` at the
    // start of an `RbContext` (`open`), so stepping back by its offset is in bounds.
    unsafe { &mut *((p as *mut u8).sub(off) as *mut RbContext) }
}

/// Closes a context. Objects the program did not destroy go with it, as the kernel
/// releases them when a process closes its device file: QPs, SRQs, memory windows, MRs, AHs,
/// CQs, channels and PDs, in that order.
pub(crate) fn close(st: &mut State, c: &mut RbContext) -> i32 {
    let me: *mut RbContext = c;
    // Flow rules before the QPs they hold.
    for p in st.live_of(Kind::Flow) {
        // SAFETY: the registry lists live objects of this kind, allocated as this type;
        // the lock is held.
        let o = unsafe { &mut *(p as *mut crate::flow::RbFlow) };
        if std::ptr::eq(o.flow.context, c.ibv()) {
            crate::flow::destroy(st, o);
        }
    }
    for p in st.live_of(Kind::Qp) {
        // SAFETY: the registry lists live objects of this kind, allocated as this type;
        // the lock is held.
        let o = unsafe { &mut *(p as *mut crate::qp::RbQp) };
        if o.ctx == me {
            crate::qp::destroy(st, o);
        }
    }
    // Indirection tables once their RSS QPs are gone, then their WQs.
    for p in st.live_of(Kind::IndTable) {
        // SAFETY: the registry lists live objects of this kind, allocated as this type;
        // the lock is held.
        let o = unsafe { &mut *(p as *mut crate::wq::RbIndTable) };
        if o.ctx == me {
            crate::wq::destroy_table(st, o);
        }
    }
    for p in st.live_of(Kind::Wq) {
        // SAFETY: the registry lists live objects of this kind, allocated as this type;
        // the lock is held.
        let o = unsafe { &mut *(p as *mut crate::wq::RbWq) };
        if o.ctx == me {
            crate::wq::destroy(st, o);
        }
    }
    for p in st.live_of(Kind::Srq) {
        // SAFETY: the registry lists live objects of this kind, allocated as this type;
        // the lock is held.
        let o = unsafe { &mut *(p as *mut crate::srq::RbSrq) };
        if o.ctx == me {
            crate::srq::destroy(st, o);
        }
    }
    // XRC domains once their SRQs and target QPs are gone.
    for p in st.live_of(Kind::Xrcd) {
        // SAFETY: the registry lists live objects of this kind, allocated as this type;
        // the lock is held.
        let o = unsafe { &mut *(p as *mut crate::xrc::RbXrcd) };
        if o.ctx == me {
            crate::xrc::close(st, o);
        }
    }
    // Windows before the regions they are bound to.
    for p in st.live_of(Kind::Mw) {
        // SAFETY: the registry lists live objects of this kind, allocated as this type;
        // the lock is held.
        let o = unsafe { &mut *(p as *mut crate::mw::RbMw) };
        if std::ptr::eq(o.mw.context, c.ibv()) {
            crate::mw::dealloc(st, o);
        }
    }
    for p in st.live_of(Kind::Mr) {
        // SAFETY: the registry lists live objects of this kind, allocated as this type;
        // the lock is held.
        let o = unsafe { &mut *(p as *mut crate::pd::RbMr) };
        // SAFETY: an MR's PD outlives it.
        if unsafe { (*o.pd).ctx } == me {
            crate::pd::dereg(st, o);
        }
    }
    for p in st.live_of(Kind::Ah) {
        // SAFETY: the registry lists live objects of this kind, allocated as this type;
        // the lock is held.
        let o = unsafe { &mut *(p as *mut crate::ah::RbAh) };
        // SAFETY: an AH's PD outlives it.
        if unsafe { (*o.pd).ctx } == me {
            crate::ah::destroy(st, o);
        }
    }
    for p in st.live_of(Kind::Cq) {
        // SAFETY: the registry lists live objects of this kind, allocated as this type;
        // the lock is held.
        let o = unsafe { &mut *(p as *mut crate::cq::RbCq) };
        if o.ctx == me {
            crate::cq::destroy(st, o);
        }
    }
    for p in st.live_of(Kind::Channel) {
        // SAFETY: the registry lists live objects of this kind, allocated as this type;
        // the lock is held.
        let o = unsafe { &mut *(p as *mut crate::cq::RbChannel) };
        if o.ctx == me {
            crate::cq::destroy_channel(st, o);
        }
    }
    // Parent domains before the PDs they stand for, thread domains after them.
    for parents in [true, false] {
        for p in st.live_of(Kind::Pd) {
            // SAFETY: the registry lists live objects of this kind, allocated as this type;
            // the lock is held.
            let o = unsafe { &mut *(p as *mut crate::pd::RbPd) };
            if o.ctx == me && o.parent.is_some() == parents {
                crate::pd::dealloc(st, o);
            }
        }
    }
    for p in st.live_of(Kind::Td) {
        // SAFETY: as above.
        let o = unsafe { &mut *(p as *mut crate::pd::RbTd) };
        if o.ctx == me {
            crate::pd::dealloc_td(st, o);
        }
    }
    // Device memory last: its regions went with their PDs.
    for p in st.live_of(Kind::Dm) {
        // SAFETY: as above.
        let o = unsafe { &mut *(p as *mut crate::dm::RbDm) };
        if std::ptr::eq(o.dm.context, c.ibv()) {
            crate::dm::free(st, o);
        }
    }
    let p = c.ibv() as usize;
    st.remove(p);
    if let Some(v) = st.contexts.get_mut(&c.nic) {
        v.retain(|&x| x != p);
    }
    // SAFETY: the descriptors `open` made; nothing else owns them.
    unsafe {
        libc::close(c.vctx.context.async_fd);
        libc::close(c.vctx.context.cmd_fd);
    }
    // SAFETY: `c` is the `RbContext` `open` boxed; it was removed from the registry above,
    // so no other call reaches it after this.
    drop(unsafe { Box::from_raw(c as *mut RbContext) });
    0
}

/// `ibv_query_device`.
pub(crate) fn query_device(caps: &DeviceCaps, a: &mut abi::ibv_device_attr) {
    *a = abi::ibv_device_attr::default();
    set_cstr(&mut a.fw_ver, FW_VER);
    a.node_guid = guid_of(caps);
    a.sys_image_guid = a.node_guid;
    // REG_MR takes up to 2^47 bytes (ABI 1.8): a process's whole address space.
    a.max_mr_size = 1 << 47;
    a.page_size_cap = 0xffff_f000;
    a.vendor_id = VENDOR_ID;
    a.vendor_part_id = VENDOR_PART_ID;
    a.hw_ver = 1;
    let i = |v: u32| v.min(i32::MAX as u32) as i32;
    a.max_qp = i(caps.max_qp);
    a.max_qp_wr = i(caps.max_qp_wr);
    a.device_cap_flags = abi::ibv_device_cap_flags_IBV_DEVICE_RC_RNR_NAK_GEN
        | abi::ibv_device_cap_flags_IBV_DEVICE_CURR_QP_STATE_MOD
        | abi::ibv_device_cap_flags_IBV_DEVICE_PORT_ACTIVE_EVENT
        | abi::ibv_device_cap_flags_IBV_DEVICE_SYS_IMAGE_GUID
        | abi::ibv_device_cap_flags_IBV_DEVICE_N_NOTIFY_CQ
        | if caps.max_mw > 0 {
            abi::ibv_device_cap_flags_IBV_DEVICE_MEM_WINDOW
                | abi::ibv_device_cap_flags_IBV_DEVICE_MEM_WINDOW_TYPE_2B
        } else {
            0
        }
        | if caps.caps.contains(ringbell_specs::regs::Caps::XRC) {
            abi::ibv_device_cap_flags_IBV_DEVICE_XRC
        } else {
            0
        };
    a.max_mw = i(caps.max_mw);
    a.max_sge = i(caps.max_sge);
    a.max_sge_rd = i(caps.max_sge);
    a.max_cq = i(caps.max_cq);
    a.max_cqe = i(caps.max_cqe);
    a.max_mr = i(caps.max_mr);
    a.max_pd = i(caps.max_pd);
    // Address handles are the library's own objects (the destination is copied into each
    // UD send), bounded only by memory.
    a.max_ah = i32::MAX;
    a.max_qp_rd_atom = i(caps.max_rd_atomic);
    a.max_res_rd_atom = i(caps.max_rd_atomic.saturating_mul(caps.max_qp));
    a.max_qp_init_rd_atom = i(caps.max_rd_atomic);
    a.atomic_cap = abi::ibv_atomic_cap_IBV_ATOMIC_HCA;
    a.max_srq = i(caps.max_srq);
    a.max_srq_wr = i(caps.max_qp_wr);
    a.max_srq_sge = i(caps.max_sge.min(32));
    // Multicast attachments (ABI 24.6): one total bounds the groups and each group's QPs.
    if caps.caps.contains(ringbell_specs::regs::Caps::UD_MCAST) {
        let m = i(ringbell_specs::cmd::MAX_MCAST_ATTACH);
        (
            a.max_mcast_grp,
            a.max_mcast_qp_attach,
            a.max_total_mcast_qp_attach,
        ) = (m, m, m);
    }
    a.max_pkeys = 1;
    a.local_ca_ack_delay = 16;
    a.phys_port_cnt = 1;
}

/// `ibv_query_device_ex`: the classic attributes, the completion clock and the
/// tag-matching capabilities. Only the first `size` bytes of `a` are written.
pub(crate) fn query_device_ex(caps: &DeviceCaps, odp: bool, a: &mut abi::ibv_device_attr_ex) {
    *a = abi::ibv_device_attr_ex::default();
    query_device(caps, &mut a.orig_attr);
    // Completion timestamps are in device picoseconds.
    a.completion_timestamp_mask = u64::MAX;
    a.hca_core_clock = 1_000_000_000; // kHz: one tick per picosecond
    a.device_cap_flags_ex = u64::from(a.orig_attr.device_cap_flags);
    if caps.max_num_tags > 0 {
        a.tm_caps = abi::ibv_tm_caps {
            max_rndv_hdr_size: caps.max_rndv_hdr_size,
            max_num_tags: caps.max_num_tags,
            flags: abi::ibv_tm_cap_flags_IBV_TM_CAP_RC,
            max_ops: caps.max_tm_ops,
            max_sge: 1,
        };
    }
    a.phys_port_cnt_ex = 1;
    // RSS over receive WQs, for raw packet QPs: Toeplitz over IP addresses and ports.
    a.rss_caps = abi::ibv_rss_caps {
        supported_qpts: 1 << abi::ibv_qp_type_IBV_QPT_RAW_PACKET,
        max_rwq_indirection_tables: caps.max_qp,
        max_rwq_indirection_table_size: 1 << ringbell::raw::RSS_MAX_LOG_SIZE,
        rx_hash_fields_mask: (1 << 8) - 1,
        rx_hash_function: abi::ibv_rx_hash_function_flags_IBV_RX_HASH_FUNC_TOEPLITZ as u8,
    };
    a.max_wq_type_rq = caps.max_srq;
    a.max_dm_size = u64::from(caps.max_dm_size);
    if odp {
        // On-demand paging (a NIC in this process): every operation of RC, UC, UD and XRC,
        // SRQ receives of RC and XRC, and implicit (whole address space) regions.
        let all = abi::ibv_odp_transport_cap_bits_IBV_ODP_SUPPORT_SEND
            | abi::ibv_odp_transport_cap_bits_IBV_ODP_SUPPORT_RECV;
        a.odp_caps.general_caps = u64::from(
            abi::ibv_odp_general_caps_IBV_ODP_SUPPORT
                | abi::ibv_odp_general_caps_IBV_ODP_SUPPORT_IMPLICIT,
        );
        a.odp_caps.per_transport_caps.rc_odp_caps = all
            | abi::ibv_odp_transport_cap_bits_IBV_ODP_SUPPORT_WRITE
            | abi::ibv_odp_transport_cap_bits_IBV_ODP_SUPPORT_READ
            | abi::ibv_odp_transport_cap_bits_IBV_ODP_SUPPORT_ATOMIC
            | abi::ibv_odp_transport_cap_bits_IBV_ODP_SUPPORT_SRQ_RECV;
        a.odp_caps.per_transport_caps.uc_odp_caps =
            all | abi::ibv_odp_transport_cap_bits_IBV_ODP_SUPPORT_WRITE;
        a.odp_caps.per_transport_caps.ud_odp_caps = all;
        // XRC is RC on the wire, with its receives from XRC SRQs.
        a.xrc_odp_caps = a.odp_caps.per_transport_caps.rc_odp_caps;
    }
}

/// Entries of the port's GID table: the RoCEv2 GID of the NIC's address at index 0, and an
/// empty entry (a RoCE port's table has room for more addresses than it has).
pub(crate) const GID_TABLE_LEN: u32 = 2;

/// `ibv_query_port` for port 1.
pub(crate) fn query_port(caps: &DeviceCaps, a: &mut abi::ibv_port_attr) {
    *a = abi::ibv_port_attr {
        state: abi::ibv_port_state_IBV_PORT_ACTIVE,
        max_mtu: abi::ibv_mtu_IBV_MTU_4096,
        active_mtu: abi::ibv_mtu_IBV_MTU_4096,
        gid_tbl_len: GID_TABLE_LEN as i32,
        port_cap_flags: abi::ibv_port_cap_flags_IBV_PORT_CM_SUP,
        max_msg_sz: caps.max_msg_size,
        pkey_tbl_len: 1,
        max_vl_num: 1,
        active_width: 2,  // 4X
        active_speed: 32, // EDR: 25 Gb/s a lane
        phys_state: 5,    // LinkUp
        link_layer: abi::IBV_LINK_LAYER_ETHERNET as u8,
        ..Default::default()
    };
}

/// `ibv_get_device_index` of NIC 0 (far from the small indices the kernel gives real
/// devices).
pub(crate) const INDEX_BASE: i32 = 0x1000;

/// The node GUID NIC `i` will have, known before it is opened (the fabric's address plan).
pub(crate) fn guid_of_node(i: usize) -> u64 {
    let n = i as u32 + 1;
    eui64([0x02, 0, 0, 0, (n >> 8) as u8, n as u8])
}
