//! Fuzzes what an rsocket of the verbs library reads from its peer besides the stream's
//! bytes (`ringbell_verbs::rsocket_wire`): the connection's private data, the immediate
//! data of a message, a remote IO mapping's notice and a datagram's header.
//!
//! Checked on every input: no parser panics; what parses re-emits to what it came from;
//! an accepted notice's end fits 64 bits and `covers` agrees with plain arithmetic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ringbell_verbs::rsocket_wire::{
    dgram_header, imm, parse_dgram_header, parse_imm, parse_private, private, Notice, DGRAM_HEADER,
    NOTICE_LEN,
};

fuzz_target!(|data: &[u8]| {
    if let Some(c) = parse_private(data) {
        assert!(c > 0);
        // (The reserved bytes are not kept.)
        let p = private(c);
        assert_eq!((p[0], &p[4..8]), (data[0], &data[4..8]));
    }
    if let Some(port) = parse_dgram_header(data) {
        let h = dgram_header(port);
        assert_eq!((h[0], &h[2..4]), (data[0], &data[2..4]));
        assert!(data.len() >= DGRAM_HEADER);
    }
    if data.len() >= 4 {
        let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        let (kind, credits) = parse_imm(v);
        assert!(credits <= 0xFFFF);
        assert_eq!(parse_imm(imm(kind, credits)), (kind, credits));
    }
    match Notice::parse(data) {
        Some(n) => {
            assert_eq!(data.len(), NOTICE_LEN);
            assert_eq!(n.emit()[..], data[..]);
            let end = n.offset.checked_add(n.len).expect("the end fits");
            // Any range the rest of the input names: covered exactly when inside.
            let (o, l) = (n.offset.wrapping_add(u64::from(data[0])), u64::from(data[1]));
            let inside = o >= n.offset && o.checked_add(l).is_some_and(|e| e <= end);
            assert_eq!(n.covers(o, l), inside);
        }
        None => assert!(
            data.len() != NOTICE_LEN || {
                let w = |i: usize| u64::from_le_bytes(data[i..i + 8].try_into().unwrap());
                w(0).checked_add(w(16)).is_none() || w(8).checked_add(w(16)).is_none()
            }
        ),
    }
});
