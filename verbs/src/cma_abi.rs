//! The C types of rdma-core 44's `<rdma/rdma_cma.h>` that programs and the library share,
//! written out by hand from the header (the unions of socket addresses as their widest
//! member). `tests/layout.rs` compiles a C program against the installed header and
//! compares every size and offset.
#![allow(non_camel_case_types, missing_docs)]

use crate::abi::{
    ibv_ah_attr, ibv_comp_channel, ibv_context, ibv_cq, ibv_gid, ibv_pd, ibv_qp, ibv_srq,
};
use core::ffi::{c_char, c_int, c_void};

pub const RDMA_CM_EVENT_ADDR_RESOLVED: u32 = 0;
pub const RDMA_CM_EVENT_ADDR_ERROR: u32 = 1;
pub const RDMA_CM_EVENT_ROUTE_RESOLVED: u32 = 2;
pub const RDMA_CM_EVENT_ROUTE_ERROR: u32 = 3;
pub const RDMA_CM_EVENT_CONNECT_REQUEST: u32 = 4;
pub const RDMA_CM_EVENT_CONNECT_RESPONSE: u32 = 5;
pub const RDMA_CM_EVENT_CONNECT_ERROR: u32 = 6;
pub const RDMA_CM_EVENT_UNREACHABLE: u32 = 7;
pub const RDMA_CM_EVENT_REJECTED: u32 = 8;
pub const RDMA_CM_EVENT_ESTABLISHED: u32 = 9;
pub const RDMA_CM_EVENT_DISCONNECTED: u32 = 10;
pub const RDMA_CM_EVENT_DEVICE_REMOVAL: u32 = 11;
pub const RDMA_CM_EVENT_MULTICAST_JOIN: u32 = 12;
pub const RDMA_CM_EVENT_MULTICAST_ERROR: u32 = 13;
pub const RDMA_CM_EVENT_ADDR_CHANGE: u32 = 14;
pub const RDMA_CM_EVENT_TIMEWAIT_EXIT: u32 = 15;

pub const RDMA_PS_IPOIB: u32 = 0x0002;
pub const RDMA_PS_TCP: u32 = 0x0106;
pub const RDMA_PS_UDP: u32 = 0x0111;
pub const RDMA_PS_IB: u32 = 0x013F;

pub const RAI_PASSIVE: c_int = 1;
pub const RAI_NUMERICHOST: c_int = 2;
pub const RAI_NOROUTE: c_int = 4;
pub const RAI_FAMILY: c_int = 8;

pub const RDMA_OPTION_ID: c_int = 0;
pub const RDMA_OPTION_IB: c_int = 1;
pub const RDMA_OPTION_ID_TOS: c_int = 0;
pub const RDMA_OPTION_ID_REUSEADDR: c_int = 1;
pub const RDMA_OPTION_ID_AFONLY: c_int = 2;
pub const RDMA_OPTION_ID_ACK_TIMEOUT: c_int = 3;
pub const RDMA_OPTION_IB_PATH: c_int = 1;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_ib_addr {
    pub sgid: ibv_gid,
    pub dgid: ibv_gid,
    pub pkey: u16,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_addr {
    /// The union of `src_addr`, `src_sin`, `src_sin6` and `src_storage` (a
    /// `sockaddr_storage`: 128 bytes, aligned as a `long`).
    pub src_storage: [u64; 16],
    /// The union of `dst_addr`, `dst_sin`, `dst_sin6` and `dst_storage`.
    pub dst_storage: [u64; 16],
    /// The union `addr`, whose one member is `ibaddr`.
    pub addr: rdma_ib_addr,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_route {
    pub addr: rdma_addr,
    pub path_rec: *mut c_void,
    pub num_paths: c_int,
}

#[repr(C)]
pub struct rdma_event_channel {
    pub fd: c_int,
}

#[repr(C)]
pub struct rdma_cm_id {
    pub verbs: *mut ibv_context,
    pub channel: *mut rdma_event_channel,
    pub context: *mut c_void,
    pub qp: *mut ibv_qp,
    pub route: rdma_route,
    pub ps: u32,
    pub port_num: u8,
    pub event: *mut rdma_cm_event,
    pub send_cq_channel: *mut ibv_comp_channel,
    pub send_cq: *mut ibv_cq,
    pub recv_cq_channel: *mut ibv_comp_channel,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub pd: *mut ibv_pd,
    pub qp_type: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_conn_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub qp_num: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_ud_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub ah_attr: ibv_ah_attr,
    pub qp_num: u32,
    pub qkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union rdma_cm_event_param {
    pub conn: rdma_conn_param,
    pub ud: rdma_ud_param,
}

#[repr(C)]
pub struct rdma_cm_event {
    pub id: *mut rdma_cm_id,
    pub listen_id: *mut rdma_cm_id,
    pub event: u32,
    pub status: c_int,
    pub param: rdma_cm_event_param,
}

#[repr(C)]
pub struct rdma_addrinfo {
    pub ai_flags: c_int,
    pub ai_family: c_int,
    pub ai_qp_type: c_int,
    pub ai_port_space: c_int,
    pub ai_src_len: libc::socklen_t,
    pub ai_dst_len: libc::socklen_t,
    pub ai_src_addr: *mut libc::sockaddr,
    pub ai_dst_addr: *mut libc::sockaddr,
    pub ai_src_canonname: *mut c_char,
    pub ai_dst_canonname: *mut c_char,
    pub ai_route_len: usize,
    pub ai_route: *mut c_void,
    pub ai_connect_len: usize,
    pub ai_connect: *mut c_void,
    pub ai_next: *mut rdma_addrinfo,
}

const _: () = {
    assert!(core::mem::size_of::<rdma_ib_addr>() == 40);
    assert!(core::mem::size_of::<rdma_addr>() == 296);
    assert!(core::mem::size_of::<rdma_route>() == 312);
    assert!(core::mem::size_of::<rdma_cm_id>() == 416);
    assert!(core::mem::offset_of!(rdma_cm_id, ps) == 344);
    assert!(core::mem::offset_of!(rdma_cm_id, event) == 352);
    assert!(core::mem::size_of::<rdma_conn_param>() == 24);
    assert!(core::mem::size_of::<rdma_ud_param>() == 56);
    assert!(core::mem::size_of::<rdma_cm_event>() == 80);
    assert!(core::mem::size_of::<rdma_addrinfo>() == 96);
};
