//! The bindgen layouts this crate relies on match the installed libfabric headers: a C
//! program compiled against them prints each size and offset, and the Rust side compares.

use ringbell_fi::abi;
use std::mem::{offset_of, size_of};
use std::process::Command;

macro_rules! fields {
    ($($t:ident { $($f:ident),* })*) => {
        vec![$(
            (stringify!($t), None, size_of::<abi::$t>()),
            $((stringify!($t), Some(stringify!($f)), offset_of!(abi::$t, $f)),)*
        )*]
    };
}

#[test]
fn sizes_and_offsets_match_the_installed_headers() {
    let rust = fields! {
        fi_info { next, caps, mode, addr_format, src_addrlen, dest_addrlen, src_addr, dest_addr,
                  handle, tx_attr, rx_attr, ep_attr, domain_attr, fabric_attr, nic }
        fi_tx_attr { caps, mode, op_flags, msg_order, comp_order, inject_size, size, iov_limit,
                     rma_iov_limit, tclass }
        fi_rx_attr { caps, mode, op_flags, msg_order, comp_order, total_buffered_recv, size,
                     iov_limit }
        fi_ep_attr { type_, protocol, protocol_version, max_msg_size, msg_prefix_size,
                     mem_tag_format, tx_ctx_cnt, rx_ctx_cnt, auth_key_size, auth_key }
        fi_domain_attr { domain, name, threading, control_progress, data_progress, resource_mgmt,
                         av_type, mr_mode, mr_key_size, cq_data_size, cq_cnt, ep_cnt, tx_ctx_cnt,
                         rx_ctx_cnt, max_ep_tx_ctx, max_ep_rx_ctx, max_ep_stx_ctx, max_ep_srx_ctx,
                         cntr_cnt, mr_iov_limit, caps, mode, auth_key, auth_key_size,
                         max_err_data, mr_cnt, tclass }
        fi_fabric_attr { fabric, name, prov_name, prov_version, api_version }
        fid { fclass, context, ops }
        fi_ops { size, close, bind, control, ops_open, tostr, ops_set }
        fid_fabric { fid, ops, api_version }
        fi_ops_fabric { size, domain, passive_ep, eq_open, wait_open, trywait, domain2 }
        fi_provider { version, fi_version, context, name, getinfo, fabric, cleanup }
    };
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <rdma/fabric.h>\n\
         #include <rdma/providers/fi_prov.h>\nint main(void) {\n",
    );
    for (t, f, _) in &rust {
        match f {
            None => c += &format!("printf(\"%zu\\n\", sizeof(struct {t}));\n"),
            Some(f) => {
                let f = if *f == "type_" { "type" } else { f };
                c += &format!("printf(\"%zu\\n\", offsetof(struct {t}, {f}));\n");
            }
        }
    }
    c += "return 0; }\n";
    let dir = std::env::temp_dir().join(format!("ringbell-fi-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("layout.c"), dir.join("layout"));
    std::fs::write(&src, c).unwrap();
    let cc = Command::new("gcc")
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("gcc is missing (.ci/run installs it)");
    assert!(
        cc.status.success(),
        "compiling against <rdma/fabric.h> failed (install libfabric-dev): {}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = Command::new(&exe).output().unwrap();
    let c_values: Vec<usize> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(c_values.len(), rust.len());
    for ((t, f, r), c) in rust.iter().zip(&c_values) {
        assert_eq!(r, c, "{t} {}", f.unwrap_or("(size)"));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
