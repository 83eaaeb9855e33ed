//! Flow steering (`ibv_create_flow(3)`) for raw packet QPs (`IBV_QPT_RAW_PACKET`), over
//! the driver's [`ringbell::raw`].
//!
//! A rule is a list of specs, each narrowing the frames it matches: Ethernet
//! (`IBV_FLOW_SPEC_ETH`: addresses and EtherType), IPv4 (`IBV_FLOW_SPEC_IPV4`, and
//! `_IPV4_EXT` with the protocol), IPv6 (`IBV_FLOW_SPEC_IPV6` with the next header), TCP and
//! UDP ports (`IBV_FLOW_SPEC_TCP`, `_UDP`). Fields are in network byte order, each with its
//! mask. An IP spec implies its EtherType, a TCP or UDP spec its protocol. What the NIC
//! cannot compare (a VLAN tag, the IPv4 TOS, TTL and flags, the IPv6 flow label, traffic
//! class and hop limit, inner headers, tunnels, actions) is `EOPNOTSUPP` when its mask is
//! not zero; rule types other than `IBV_FLOW_ATTR_NORMAL` and any flag are `EOPNOTSUPP`.

use crate::abi;
use crate::qp::RbQp;
use crate::state::{Kind, State};
use ringbell::raw::{Flow, FlowMatch, FlowRule};

/// A ringbell flow handle.
#[repr(C)]
pub(crate) struct RbFlow {
    pub flow: abi::ibv_flow,
    pub drv: Flow,
}

/// One spec of a rule, as the caller laid it out (copied at the boundary).
#[derive(Clone, Copy)]
pub(crate) enum Spec {
    Eth(abi::ibv_flow_spec_eth),
    Ipv4(abi::ibv_flow_spec_ipv4),
    Ipv4Ext(abi::ibv_flow_spec_ipv4_ext),
    Ipv6(abi::ibv_flow_spec_ipv6),
    TcpUdp(abi::ibv_flow_spec_tcp_udp),
    /// A type ringbell does not match on.
    Unsupported,
}

/// Sets `field` to `value` under `mask`, or fails when another spec already set bits of it
/// to something else.
fn set<const N: usize>(
    value: &mut [u8; N],
    mask: &mut [u8; N],
    v: &[u8; N],
    m: &[u8; N],
) -> Result<(), i32> {
    for i in 0..N {
        let both = mask[i] & m[i];
        if value[i] & both != v[i] & both {
            return Err(libc::EINVAL);
        }
        value[i] = (value[i] & mask[i]) | (v[i] & m[i]);
        mask[i] |= m[i];
    }
    Ok(())
}

/// [`set`] of a 16-bit field (a device field: a numeric value, not network order).
fn set16<T: Copy + Into<u16> + From<u16>>(
    value: &mut T,
    mask: &mut T,
    v: u16,
    m: u16,
) -> Result<(), i32> {
    let (mut vb, mut mb) = ((*value).into().to_be_bytes(), (*mask).into().to_be_bytes());
    set(&mut vb, &mut mb, &v.to_be_bytes(), &m.to_be_bytes())?;
    (*value, *mask) = (u16::from_be_bytes(vb).into(), u16::from_be_bytes(mb).into());
    Ok(())
}

/// An IPv4 spec's addresses (network order in memory), and the EtherType it implies.
fn ipv4(
    v: &mut FlowMatch,
    m: &mut FlowMatch,
    val: abi::ibv_flow_ipv4_filter,
    mask: abi::ibv_flow_ipv4_filter,
) -> Result<(), i32> {
    // An IPv4 address as the rules compare it: the last four bytes of the mapped address.
    let v4 = |a: u32| {
        let mut x = [0u8; 16];
        x[12..].copy_from_slice(&a.to_ne_bytes());
        x
    };
    set16(&mut v.ethertype, &mut m.ethertype, 0x0800, 0xFFFF)?;
    set(
        &mut v.src_ip,
        &mut m.src_ip,
        &v4(val.src_ip),
        &v4(mask.src_ip),
    )?;
    set(
        &mut v.dst_ip,
        &mut m.dst_ip,
        &v4(val.dst_ip),
        &v4(mask.dst_ip),
    )
}

/// The IP protocol (IPv4) or next header (IPv6).
fn proto(v: &mut FlowMatch, m: &mut FlowMatch, val: u8, mask: u8) -> Result<(), i32> {
    set(
        std::array::from_mut(&mut v.ip_proto),
        std::array::from_mut(&mut m.ip_proto),
        &[val],
        &[mask],
    )
}

/// The rule an `ibv_flow_attr` and its specs describe.
pub(crate) fn rule_of(attr: &abi::ibv_flow_attr, specs: &[Spec]) -> Result<FlowRule, i32> {
    if attr.comp_mask != 0 || attr.port != 1 {
        return Err(libc::EINVAL);
    }
    if attr.type_ != abi::ibv_flow_attr_type_IBV_FLOW_ATTR_NORMAL || attr.flags != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    let mut r = FlowRule {
        priority: attr.priority,
        ..Default::default()
    };
    let (v, m) = (&mut r.value, &mut r.mask);
    for s in specs {
        match *s {
            Spec::Eth(e) => {
                if e.mask.vlan_tag != 0 {
                    return Err(libc::EOPNOTSUPP);
                }
                set(&mut v.dmac, &mut m.dmac, &e.val.dst_mac, &e.mask.dst_mac)?;
                set(&mut v.smac, &mut m.smac, &e.val.src_mac, &e.mask.src_mac)?;
                set16(
                    &mut v.ethertype,
                    &mut m.ethertype,
                    u16::from_be(e.val.ether_type),
                    u16::from_be(e.mask.ether_type),
                )?;
            }
            Spec::Ipv4(ip) => ipv4(v, m, ip.val, ip.mask)?,
            Spec::Ipv4Ext(ip) => {
                if ip.mask.tos != 0 || ip.mask.ttl != 0 || ip.mask.flags != 0 {
                    return Err(libc::EOPNOTSUPP);
                }
                let addrs = |f: abi::ibv_flow_ipv4_ext_filter| abi::ibv_flow_ipv4_filter {
                    src_ip: f.src_ip,
                    dst_ip: f.dst_ip,
                };
                ipv4(v, m, addrs(ip.val), addrs(ip.mask))?;
                proto(v, m, ip.val.proto, ip.mask.proto)?;
            }
            Spec::Ipv6(ip) => {
                if ip.mask.flow_label != 0 || ip.mask.traffic_class != 0 || ip.mask.hop_limit != 0 {
                    return Err(libc::EOPNOTSUPP);
                }
                set16(&mut v.ethertype, &mut m.ethertype, 0x86DD, 0xFFFF)?;
                set(
                    &mut v.src_ip,
                    &mut m.src_ip,
                    &ip.val.src_ip,
                    &ip.mask.src_ip,
                )?;
                set(
                    &mut v.dst_ip,
                    &mut m.dst_ip,
                    &ip.val.dst_ip,
                    &ip.mask.dst_ip,
                )?;
                proto(v, m, ip.val.next_hdr, ip.mask.next_hdr)?;
            }
            Spec::TcpUdp(p) => {
                let tcp = p.type_ == abi::ibv_flow_spec_type_IBV_FLOW_SPEC_TCP;
                proto(v, m, if tcp { 6 } else { 17 }, 0xFF)?;
                let (val, mask) = (p.val, p.mask);
                set16(
                    &mut v.src_port,
                    &mut m.src_port,
                    u16::from_be(val.src_port),
                    u16::from_be(mask.src_port),
                )?;
                set16(
                    &mut v.dst_port,
                    &mut m.dst_port,
                    u16::from_be(val.dst_port),
                    u16::from_be(mask.dst_port),
                )?;
            }
            Spec::Unsupported => return Err(libc::EOPNOTSUPP),
        }
    }
    Ok(r)
}

/// `ibv_create_flow` on `qp`, with the specs read at the boundary.
pub(crate) fn create(
    st: &mut State,
    qp: &mut RbQp,
    attr: &abi::ibv_flow_attr,
    specs: &[Spec],
) -> Result<*mut abi::ibv_flow, i32> {
    // Linux steers to UD and raw packet QPs; ringbell to raw packet QPs (UD: unsupported).
    match qp.qpx.qp_base.qp_type {
        abi::ibv_qp_type_IBV_QPT_RAW_PACKET => {}
        abi::ibv_qp_type_IBV_QPT_UD => return Err(libc::EOPNOTSUPP),
        _ => return Err(libc::EINVAL),
    }
    let rule = rule_of(attr, specs)?;
    let drv = qp.drv.create_flow(&rule).map_err(|e| crate::errno_of(&e))?;
    let p = Box::into_raw(Box::new(RbFlow {
        flow: abi::ibv_flow {
            comp_mask: 0,
            context: qp.qpx.qp_base.context,
            handle: drv.num(),
        },
        drv,
    }));
    st.add(p as usize, Kind::Flow);
    Ok(p as *mut abi::ibv_flow)
}

/// `ibv_destroy_flow`.
pub(crate) fn destroy(st: &mut State, f: &mut RbFlow) -> i32 {
    let p = f as *mut RbFlow;
    st.remove(p as usize);
    // SAFETY: the `RbFlow` `create` boxed, now out of the registry.
    drop(unsafe { Box::from_raw(p) });
    0
}

/// `ibv_attach_mcast`. A UD QP joins the group of an IPv4-mapped group address
/// (`::ffff:224.0.0.0/100`; RoCEv2's form of a group; any other GID is EINVAL) and receives
/// the datagrams sent to it (QPN `0xFFFFFF`). A raw packet QP receives the frames to the
/// multicast MAC address in the last six bytes of the GID (as mlx4 and mlx5 attach raw
/// Ethernet QPs, and perftest's `--raw_mcast` builds its group; an address that is not
/// multicast is EINVAL), through a rule of its own. Attaching a group twice is harmless.
/// Other QP types: EOPNOTSUPP.
pub(crate) fn attach_mcast(qp: &mut RbQp, gid: [u8; 16]) -> i32 {
    match qp.qpx.qp_base.qp_type {
        abi::ibv_qp_type_IBV_QPT_RAW_PACKET => {
            if qp.mcast.iter().any(|(g, _)| *g == gid) {
                return 0;
            }
            let mut mac = [0u8; 6];
            mac.copy_from_slice(&gid[10..]);
            if mac[0] & 1 == 0 {
                return libc::EINVAL;
            }
            match qp.drv.create_flow(&FlowRule::default().dst_mac(mac)) {
                Ok(f) => {
                    qp.mcast.push((gid, f));
                    0
                }
                Err(e) => crate::errno_of(&e),
            }
        }
        abi::ibv_qp_type_IBV_QPT_UD => {
            if ringbell_specs::cmd::mcast_group(&gid).is_none() {
                return libc::EINVAL;
            }
            crate::qp::post_result(qp.drv.attach_mcast(gid))
        }
        _ => libc::EOPNOTSUPP,
    }
}

/// `ibv_detach_mcast`: EINVAL for a group the QP is not attached to.
pub(crate) fn detach_mcast(qp: &mut RbQp, gid: [u8; 16]) -> i32 {
    if qp.qpx.qp_base.qp_type == abi::ibv_qp_type_IBV_QPT_UD {
        return crate::qp::post_result(qp.drv.detach_mcast(gid));
    }
    match qp.mcast.iter().position(|(g, _)| *g == gid) {
        Some(i) => {
            qp.mcast.remove(i);
            0
        }
        None => libc::EINVAL,
    }
}
