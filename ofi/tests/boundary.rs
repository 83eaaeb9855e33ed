//! The provider's C entry points called directly, as libfabric calls them: the structure
//! `fi_prov_ini` returns, `getinfo` with no hints, with hints, with bad pointers, and a
//! fabric opened and closed.

use ringbell_fi::{abi, fi_prov_ini, info};
use std::ffi::{c_void, CStr};
use std::ptr::{null, null_mut};

fn domains(mut i: *mut abi::fi_info) -> Vec<String> {
    let mut out = Vec::new();
    while !i.is_null() {
        // SAFETY: a list the provider built.
        unsafe {
            out.push(
                CStr::from_ptr((*(*i).domain_attr).name)
                    .to_string_lossy()
                    .into_owned(),
            );
            i = (*i).next;
        }
    }
    out
}

#[test]
fn getinfo_and_fabric_through_the_provider_structure() {
    std::env::remove_var("RINGBELL_SERVE");
    std::env::set_var("RINGBELL_NICS", "2");
    let p = fi_prov_ini();
    assert_eq!(p, fi_prov_ini(), "one provider structure");
    // SAFETY: the provider structure lives for the process.
    let prov = unsafe { &*p };
    // SAFETY: a NUL-terminated static name.
    let name = unsafe { CStr::from_ptr(prov.name) };
    assert_eq!(name.to_str(), Ok("ringbell"));
    assert_eq!(prov.fi_version, info::API_VERSION);
    let getinfo = prov.getinfo.unwrap();
    let v = info::API_VERSION;

    // SAFETY: the calls below pass valid or NULL pointers, as libfabric may.
    unsafe {
        assert_eq!(
            getinfo(v, null(), null(), 0, null(), null_mut()),
            -(abi::FI_EINVAL as i32)
        );
        let mut out = null_mut();
        assert_eq!(getinfo(v, null(), null(), 0, null(), &mut out), 0);
        // Per NIC its RDM offer, its datagram one and its connected one.
        assert_eq!(domains(out), ["rb0", "rb0", "rb0", "rb1", "rb1", "rb1"]);
        ringbell_fi::free_info(out);
        // A utility provider looking for a core provider to layer on (libfabric passes
        // OFI_CORE_PROV_ONLY, bit 59) gets no datagram or connected offer.
        let mut out = null_mut();
        assert_eq!(getinfo(v, null(), null(), 1 << 59, null(), &mut out), 0);
        assert_eq!(domains(out), ["rb0", "rb1"]);
        ringbell_fi::free_info(out);

        // Hints: RDM, tagged, domain rb1, a destination address to copy through.
        let mut ep = abi::fi_ep_attr {
            type_: abi::fi_ep_type_FI_EP_RDM,
            ..Default::default()
        };
        let name = c"rb1";
        let mut dom = abi::fi_domain_attr {
            name: name.as_ptr() as *mut _,
            mr_mode: 0,
            ..Default::default()
        };
        let mut dest = [7u8; 16];
        let hints = abi::fi_info {
            caps: info::FI_TAGGED,
            ep_attr: &mut ep,
            domain_attr: &mut dom,
            dest_addr: dest.as_mut_ptr() as *mut c_void,
            dest_addrlen: dest.len(),
            ..Default::default()
        };
        let mut out = null_mut();
        assert_eq!(getinfo(v, null(), null(), 0, &hints, &mut out), 0);
        assert_eq!(domains(out), ["rb1"]);
        assert_eq!((*out).dest_addrlen, 16);
        assert_eq!(
            std::slice::from_raw_parts((*out).dest_addr as *const u8, 16),
            &dest
        );
        assert_eq!(
            (*(*out).domain_attr).mr_mode,
            0,
            "mr_mode 0 asked: no FI_MR_LOCAL"
        );
        assert_eq!((*out).caps & info::PRIMARY_CAPS, info::FI_TAGGED);

        // A fabric from that info opens and closes.
        let mut fabric = null_mut();
        assert_eq!(
            (prov.fabric.unwrap())((*out).fabric_attr, &mut fabric, null_mut()),
            0
        );
        let fid = &mut (*fabric).fid;
        assert_eq!(fid.fclass, abi::FI_CLASS_FABRIC as usize);
        let ops = &*(*fabric).ops;
        // Its domain is on the in-process fabric the provider hosts.
        let mut dom: *mut abi::fid_domain = null_mut();
        assert_eq!((ops.domain.unwrap())(fabric, out, &mut dom, null_mut()), 0);
        assert_eq!((*dom).fid.fclass, abi::FI_CLASS_DOMAIN as usize);
        assert_eq!(((*(*dom).fid.ops).close.unwrap())(&mut (*dom).fid), 0);
        assert_eq!(((*fid.ops).close.unwrap())(fid), 0);
        ringbell_fi::free_info(out);

        // Another fabric's name, and NULL attributes.
        let mut attr = abi::fi_fabric_attr {
            name: c"tcp".as_ptr() as *mut _,
            ..Default::default()
        };
        let mut f2 = null_mut();
        assert_eq!(
            (prov.fabric.unwrap())(&mut attr, &mut f2, null_mut()),
            -(abi::FI_ENODATA as i32)
        );
        assert_eq!(
            (prov.fabric.unwrap())(null_mut(), &mut f2, null_mut()),
            -(abi::FI_EINVAL as i32)
        );

        // An API version the provider does not implement.
        let mut out = null_mut();
        assert_eq!(
            getinfo(info::fi_version(1, 99), null(), null(), 0, null(), &mut out),
            -(abi::FI_ENODATA as i32)
        );
    }
}
