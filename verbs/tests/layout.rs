//! The C layouts the library fills in, checked against the installed
//! `<infiniband/verbs.h>` and `<rdma/rdma_cma.h>`: a C program compiled against the header prints each struct's size
//! and the offset of each field the library or the header's inline functions touch, and the
//! Rust types must agree.

use ringbell_verbs::abi::*;
use ringbell_verbs::cma_abi::*;
use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::process::Command;

/// (C name, Rust size, fields: (C field, Rust offset)).
type Entry = (&'static str, usize, Vec<(&'static str, usize)>);

macro_rules! entry {
    ($t:ident { $($f:ident),* $(,)? }) => {
        (stringify!($t), size_of::<$t>(), vec![$((stringify!($f), offset_of!($t, $f))),*])
    };
}

fn entries() -> Vec<Entry> {
    vec![
        entry!(ibv_device {
            node_type,
            transport_type,
            name,
            dev_name,
            dev_path,
            ibdev_path
        }),
        entry!(ibv_context_ops {
            poll_cq,
            req_notify_cq,
            post_srq_recv,
            post_send,
            post_recv,
            alloc_mw,
            bind_mw,
            dealloc_mw
        }),
        entry!(ibv_context {
            device,
            ops,
            cmd_fd,
            async_fd,
            num_comp_vectors,
            mutex,
            abi_compat
        }),
        entry!(verbs_context {
            query_port,
            post_srq_ops,
            create_cq_ex,
            priv_,
            query_device_ex,
            create_qp_ex,
            create_srq_ex,
            get_srq_num,
            query_rt_values,
            sz,
            context
        }),
        entry!(ibv_device_attr {
            fw_ver,
            node_guid,
            max_mr_size,
            vendor_id,
            max_qp,
            device_cap_flags,
            max_sge,
            max_cqe,
            max_qp_rd_atom,
            atomic_cap,
            max_srq_sge,
            max_pkeys,
            phys_port_cnt
        }),
        entry!(ibv_device_attr_ex {
            orig_attr,
            comp_mask,
            completion_timestamp_mask,
            hca_core_clock,
            device_cap_flags_ex,
            tm_caps,
            phys_port_cnt_ex
        }),
        entry!(ibv_tm_caps {
            max_rndv_hdr_size,
            max_num_tags,
            flags,
            max_ops,
            max_sge
        }),
        entry!(ibv_port_attr {
            state,
            max_mtu,
            active_mtu,
            gid_tbl_len,
            port_cap_flags,
            max_msg_sz,
            pkey_tbl_len,
            active_width,
            active_speed,
            phys_state,
            link_layer,
            flags,
            port_cap_flags2
        }),
        entry!(ibv_gid_entry {
            gid,
            gid_index,
            port_num,
            gid_type,
            ndev_ifindex
        }),
        entry!(ibv_pd { context, handle }),
        entry!(ibv_mr {
            context,
            pd,
            addr,
            length,
            handle,
            lkey,
            rkey
        }),
        entry!(ibv_comp_channel {
            context,
            fd,
            refcnt
        }),
        entry!(ibv_cq {
            context,
            channel,
            cq_context,
            handle,
            cqe,
            mutex,
            cond,
            comp_events_completed,
            async_events_completed
        }),
        entry!(ibv_cq_ex {
            context,
            cq_context,
            cqe,
            comp_mask,
            status,
            wr_id,
            start_poll,
            next_poll,
            end_poll,
            read_opcode,
            read_byte_len,
            read_imm_data,
            read_wc_flags,
            read_completion_ts,
            read_tm_info,
            read_completion_wallclock_ns
        }),
        entry!(ibv_cq_init_attr_ex {
            cqe,
            cq_context,
            channel,
            comp_vector,
            wc_flags,
            comp_mask,
            flags
        }),
        entry!(ibv_wc {
            wr_id,
            status,
            opcode,
            vendor_err,
            byte_len,
            qp_num,
            src_qp,
            wc_flags,
            pkey_index
        }),
        entry!(ibv_wc_tm_info { tag, priv_ }),
        entry!(ibv_sge { addr, length, lkey }),
        entry!(ibv_send_wr {
            wr_id,
            next,
            sg_list,
            num_sge,
            opcode,
            send_flags,
            wr
        }),
        entry!(ibv_recv_wr {
            wr_id,
            next,
            sg_list,
            num_sge
        }),
        entry!(ibv_qp {
            context,
            qp_context,
            pd,
            send_cq,
            recv_cq,
            srq,
            handle,
            qp_num,
            state,
            qp_type,
            mutex,
            cond,
            events_completed
        }),
        entry!(ibv_qp_ex {
            qp_base,
            comp_mask,
            wr_id,
            wr_flags,
            wr_atomic_cmp_swp,
            wr_rdma_write,
            wr_send,
            wr_set_sge,
            wr_set_inline_data,
            wr_start,
            wr_complete,
            wr_abort,
            wr_atomic_write
        }),
        entry!(ibv_qp_cap {
            max_send_wr,
            max_recv_wr,
            max_send_sge,
            max_recv_sge,
            max_inline_data
        }),
        entry!(ibv_qp_init_attr {
            qp_context,
            send_cq,
            recv_cq,
            srq,
            cap,
            qp_type,
            sq_sig_all
        }),
        entry!(ibv_qp_init_attr_ex {
            cap,
            qp_type,
            sq_sig_all,
            comp_mask,
            pd,
            create_flags,
            send_ops_flags
        }),
        entry!(ibv_qp_attr {
            qp_state,
            cur_qp_state,
            path_mtu,
            qkey,
            rq_psn,
            sq_psn,
            dest_qp_num,
            qp_access_flags,
            cap,
            ah_attr,
            pkey_index,
            max_rd_atomic,
            max_dest_rd_atomic,
            min_rnr_timer,
            port_num,
            timeout,
            retry_cnt,
            rnr_retry,
            rate_limit
        }),
        entry!(ibv_ah_attr {
            grh,
            dlid,
            sl,
            is_global,
            port_num
        }),
        entry!(ibv_global_route {
            dgid,
            flow_label,
            sgid_index,
            hop_limit,
            traffic_class
        }),
        entry!(ibv_srq {
            context,
            srq_context,
            pd,
            handle,
            mutex,
            cond,
            events_completed
        }),
        entry!(ibv_srq_attr {
            max_wr,
            max_sge,
            srq_limit
        }),
        entry!(ibv_srq_init_attr_ex {
            srq_context,
            attr,
            comp_mask,
            srq_type,
            pd,
            xrcd,
            cq,
            tm_cap
        }),
        entry!(ibv_ops_wr {
            wr_id,
            next,
            opcode,
            flags,
            tm
        }),
        entry!(rdma_ib_addr { sgid, dgid, pkey }),
        entry!(rdma_addr {
            src_storage,
            dst_storage,
            addr
        }),
        entry!(rdma_route {
            addr,
            path_rec,
            num_paths
        }),
        entry!(rdma_event_channel { fd }),
        entry!(rdma_cm_id {
            verbs,
            channel,
            context,
            qp,
            route,
            ps,
            port_num,
            event,
            send_cq_channel,
            send_cq,
            recv_cq_channel,
            recv_cq,
            srq,
            pd,
            qp_type
        }),
        entry!(rdma_conn_param {
            private_data,
            private_data_len,
            responder_resources,
            initiator_depth,
            flow_control,
            retry_count,
            rnr_retry_count,
            srq,
            qp_num
        }),
        entry!(rdma_ud_param {
            private_data,
            private_data_len,
            ah_attr,
            qp_num,
            qkey
        }),
        entry!(rdma_cm_event {
            id,
            listen_id,
            event,
            status,
            param
        }),
        entry!(rdma_addrinfo {
            ai_flags,
            ai_family,
            ai_qp_type,
            ai_port_space,
            ai_src_len,
            ai_dst_len,
            ai_src_addr,
            ai_dst_addr,
            ai_src_canonname,
            ai_dst_canonname,
            ai_route_len,
            ai_route,
            ai_connect_len,
            ai_connect,
            ai_next
        }),
        entry!(ibv_async_event {
            element,
            event_type
        }),
    ]
}

/// C names where they differ from bindgen's (`priv` is a Rust keyword).
fn c_field(f: &str) -> &str {
    f.strip_suffix('_').unwrap_or(f)
}

#[test]
fn layouts_match_the_installed_header() {
    let entries = entries();
    let mut src = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\n\
         #include <rdma/rdma_cma.h>\nint main(void) {\n",
    );
    for (name, _, fields) in &entries {
        src += &format!("printf(\"{name} %zu\\n\", sizeof(struct {name}));\n");
        for (f, _) in fields {
            let cf = c_field(f);
            src += &format!("printf(\"{name}.{cf} %zu\\n\", offsetof(struct {name}, {cf}));\n");
        }
    }
    src += "return 0;\n}\n";
    let dir = std::env::temp_dir().join(format!("ringbell-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let c = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&c, src).unwrap();
    let out = Command::new("cc")
        .arg(&c)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("a C compiler (cc) is needed: install gcc");
    assert!(
        out.status.success(),
        "compiling against <infiniband/verbs.h> and <rdma/rdma_cma.h> failed (install \
         libibverbs-dev and librdmacm-dev):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(&exe).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let c_values: BTreeMap<&str, usize> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    let mut checked = 0;
    for (name, size, fields) in &entries {
        assert_eq!(c_values[name], *size, "sizeof(struct {name})");
        for (f, off) in fields {
            let key = format!("{name}.{}", c_field(f));
            assert_eq!(
                c_values[key.as_str()],
                *off,
                "offsetof(struct {name}, {})",
                c_field(f)
            );
            checked += 1;
        }
    }
    assert!(checked > 200, "only {checked} fields checked");
    let _ = std::fs::remove_dir_all(&dir);
}
