//! Fuzzes the parser of connection-management messages (`ringbell::cm::CmMsg`), which reads
//! datagrams any host on the fabric may send to a device's general services QP.
//!
//! Checked on every input: `parse` never panics; a message that parses re-emits to the
//! bytes it came from (up to the end of its private data) and parses again to the same
//! message; a rejected input is rejected for the reason its bytes give.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ringbell::cm::{CmKind, CmMsg, CmParseError, CM_HEADER_LEN, CM_VERSION};

fuzz_target!(|data: &[u8]| {
    match CmMsg::parse(data) {
        Ok(m) => {
            let mut out = Vec::new();
            m.emit(&mut out);
            assert_eq!(out.len(), CM_HEADER_LEN + m.private.len());
            // Reserved bytes and the high byte of the QPN and PSN words are not kept (a
            // SIDR REP's Q_Key, in the PSN's place, is kept whole).
            let mut want = data[..out.len()].to_vec();
            want[0x0F] = 0;
            want[0x18] = 0;
            if m.kind != Some(CmKind::SidrRep) {
                want[0x1C] = 0;
            }
            want[0x26] = 0;
            want[0x27] = 0;
            want[0x28 - 2..0x28].fill(0);
            assert_eq!(out, want, "emit is not the inverse of parse");
            assert_eq!(CmMsg::parse(&out), Ok(m));
        }
        Err(CmParseError::Truncated) => {
            let plen = data
                .get(2..4)
                .map(|b| u16::from_be_bytes([b[0], b[1]]) as usize);
            assert!(data.len() < CM_HEADER_LEN || data.len() < CM_HEADER_LEN + plen.unwrap_or(0));
        }
        Err(CmParseError::UnknownKind(k)) => assert_eq!(k, data[0]),
        Err(CmParseError::BadVersion(v)) => assert!(v != CM_VERSION && v == data[1]),
        Err(CmParseError::PrivateTooLong) => {}
    }
});
