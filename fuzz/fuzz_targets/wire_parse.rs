//! Fuzzes the RoCEv2 wire format in `ringbell_specs::wire`.
//!
//! Two properties are checked on every input:
//!
//! 1. **parse → emit → parse.** The input is fed as a frame to `parse_packet` and
//!    `compute_icrc` (and to each header parser at every offset where a header can sit).
//!    Every frame that parses is re-emitted with `PacketRepr::emit`; the re-emitted frame must
//!    parse to the same repr and payload, have `frame_len` bytes, carry the ICRC that
//!    `compute_icrc` computes, and re-emit to the same bytes.
//! 2. **emit → parse.** The same bytes are read as a structured `PacketRepr` plus payload; the
//!    emitted frame must parse back to the repr normalised the way `emit` documents (headers
//!    chosen by opcode, missing ones as zeros, pad computed, AETH fields masked), or be
//!    rejected when the repr cannot be valid (unknown opcode, TVer != 0, payload on an opcode
//!    that carries none).
//!
//! Individual header parsers must round-trip through their `emit` as well, and
//! `seal` + `parse_packet` must agree with `parse_packet_unsealed` on every input.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use ringbell_specs::wire::{
    self, compute_icrc, pad_len, parse_packet, Aeth, AethSyndrome, AtomicEth, BthRepr, Deth,
    Endpoint, Opcode, PacketRepr, Reth, WireError, AETH_LEN, ATOMIC_ETH_LEN, BTH_LEN, ETH_HDR_LEN,
    ICRC_LEN, RETH_LEN, ROCE_OUTER_LEN,
};
use ringbell_specs::{Psn, Qpn};

fuzz_target!(|data: &[u8]| {
    parse_direction(data);
    emit_direction(data);
});

/// Property 1: whatever parses re-emits to an equivalent frame.
fn parse_direction(data: &[u8]) {
    let icrc = compute_icrc(data);

    // Header parsers on their own, at the start of the input and where they sit in a frame.
    for off in [
        0,
        ROCE_OUTER_LEN,
        ROCE_OUTER_LEN + BTH_LEN,
        ROCE_OUTER_LEN + BTH_LEN + RETH_LEN,
    ] {
        let b = data.get(off..).unwrap_or(&[]);
        header_round_trips(b);
    }

    // The flow-steering view of any bytes (ABI 1.12): never panics, matches itself under
    // every mask and anything under the empty one; whatever parses as RoCE has RoCE's
    // outer headers.
    let m = ringbell_specs::cmd::FlowMatch::of_frame(data);
    let ones = ringbell_specs::cmd::FlowMatch {
        dmac: [0xFF; 6],
        smac: [0xFF; 6],
        ethertype: 0xFFFF.into(),
        src_ip: [0xFF; 16],
        dst_ip: [0xFF; 16],
        ip_proto: 0xFF,
        rsvd0: 0xFF,
        src_port: 0xFFFF.into(),
        dst_port: 0xFFFF.into(),
    };
    assert!(m.matches(&m, &ones));
    assert!(m.matches(&Default::default(), &Default::default()));
    if parse_packet(data).is_ok() {
        assert!(wire::is_rocev2(data));
    }

    // Sealing writes the two sums (IPv4 checksum, ICRC) and nothing else; the unsealed parser
    // accepts exactly what the full parser accepts once the frame is sealed, to the same
    // packet.
    let mut sealed = data.to_vec();
    wire::seal(&mut sealed);
    assert_eq!(sealed.len(), data.len());
    let unsealed = wire::parse_packet_unsealed(data);
    match (&unsealed, parse_packet(&sealed)) {
        (Ok(u), Ok(s)) => assert_eq!((u.repr, u.payload), (s.repr, s.payload)),
        (Err(_), Err(_)) => {}
        (u, s) => panic!("unsealed parse {u:?} but sealed parse {s:?}"),
    }

    let Ok(pkt) = parse_packet(data) else { return };

    // A frame that parses has a computable ICRC, equal to the stored one.
    let total = usize::from(u16::from_be_bytes([
        data[ETH_HDR_LEN + 2],
        data[ETH_HDR_LEN + 3],
    ]));
    let end = ETH_HDR_LEN + total;
    let stored = u32::from_le_bytes(data[end - ICRC_LEN..end].try_into().unwrap());
    assert_eq!(
        icrc,
        Ok(stored),
        "compute_icrc disagrees with the ICRC parse_packet accepted"
    );

    // The repr says exactly which headers the opcode has.
    let op = Opcode::from_u8(pkt.repr.bth.opcode).expect("parse_packet accepted an unknown opcode");
    assert_eq!(pkt.repr.deth.is_some(), op.has_deth());
    assert_eq!(pkt.repr.reth.is_some(), op.has_reth());
    assert_eq!(pkt.repr.aeth.is_some(), op.has_aeth());
    assert_eq!(pkt.repr.atomic_eth.is_some(), op.has_atomic_eth());
    assert_eq!(pkt.repr.atomic_ack.is_some(), op.has_atomic_ack_eth());
    assert_eq!(pkt.repr.imm.is_some(), op.has_immdt());
    assert!(pkt.payload.is_empty() || op.has_payload());
    assert_eq!(pkt.repr.bth.tver, 0);

    let mut out = Vec::new();
    pkt.repr.emit(pkt.payload, &mut out);
    assert_eq!(
        out.len(),
        pkt.repr.frame_len(pkt.payload.len()),
        "emit wrote a frame of another length than frame_len"
    );
    let again = match parse_packet(&out) {
        Ok(p) => p,
        Err(e) => panic!(
            "re-emitted frame does not parse: {e:?}\n repr {:?}\n frame {}",
            pkt.repr,
            hex(&out)
        ),
    };
    assert_eq!(
        again.repr,
        pkt.repr,
        "re-emitted frame parses to another repr\n frame {}",
        hex(&out)
    );
    assert_eq!(
        again.payload, pkt.payload,
        "re-emitted frame parses to another payload"
    );
    let stored = u32::from_le_bytes(out[out.len() - ICRC_LEN..].try_into().unwrap());
    assert_eq!(compute_icrc(&out), Ok(stored));

    // Emit is a function of the repr: a second round gives the same bytes.
    let mut out2 = Vec::new();
    again.repr.emit(again.payload, &mut out2);
    assert_eq!(out, out2, "emit(parse(emit(p))) differs from emit(p)");
}

/// Each header parser, fed `b`, must round-trip through its own `emit`.
fn header_round_trips(b: &[u8]) {
    if let Ok(bth) = BthRepr::parse(b) {
        let mut o = [0u8; BTH_LEN];
        bth.emit(&mut o);
        let back = BthRepr::parse(&o).expect("emitted BTH does not parse");
        assert_eq!(
            back,
            BthRepr {
                pad: bth.pad & 3,
                tver: bth.tver & 0xF,
                ..bth
            }
        );
    } else {
        assert!(b.len() < BTH_LEN);
    }
    if let Ok(d) = Deth::parse(b) {
        let mut o = [0u8; wire::DETH_LEN];
        d.emit(&mut o);
        let back = Deth::parse(&o).expect("emitted DETH does not parse");
        assert_eq!(back, d, "DETH parse is not the inverse of emit");
    } else {
        assert!(b.len() < wire::DETH_LEN);
    }
    if let Ok(r) = Reth::parse(b) {
        let mut o = [0u8; RETH_LEN];
        r.emit(&mut o);
        assert_eq!(
            &o[..],
            &b[..RETH_LEN],
            "RETH emit is not the inverse of parse"
        );
    } else {
        assert!(b.len() < RETH_LEN);
    }
    match Aeth::parse(b) {
        Ok(a) => {
            let mut o = [0u8; AETH_LEN];
            a.emit(&mut o);
            assert_eq!(Aeth::parse(&o), Ok(a), "AETH does not round-trip");
            assert_eq!(o[1..], b[1..AETH_LEN], "AETH MSN does not round-trip");
        }
        Err(WireError::Truncated) => assert!(b.len() < AETH_LEN),
        Err(WireError::BadSyndrome(s)) => assert!(s & 0x80 != 0 || s >> 5 == 0b010),
        Err(e) => panic!("Aeth::parse returned {e:?}"),
    }
    if let Ok(a) = AtomicEth::parse(b) {
        let mut o = [0u8; ATOMIC_ETH_LEN];
        a.emit(&mut o);
        assert_eq!(
            &o[..],
            &b[..ATOMIC_ETH_LEN],
            "AtomicETH emit is not the inverse of parse"
        );
    } else {
        assert!(b.len() < ATOMIC_ETH_LEN);
    }
}

/// A structured packet read from the fuzz input.
#[derive(Debug, Arbitrary)]
struct Input<'a> {
    src_mac: [u8; 6],
    src_ip: [u8; 4],
    dst_mac: [u8; 6],
    dst_ip: [u8; 4],
    udp_src_port: u16,
    ip_id: u16,
    tos: u8,
    ttl: u8,
    opcode: u8,
    bth_bits: u8,
    tver: u8,
    pkey: u16,
    dest_qp: u32,
    psn: u32,
    deth: Option<(u32, u32)>,
    reth: Option<(u64, u32, u32)>,
    aeth: Option<(u8, u32)>,
    atomic_eth: Option<(u64, u32, u64, u64)>,
    atomic_ack: Option<u64>,
    imm: Option<u32>,
    /// XRC (ABI 1.11): the SRQ number of an RC opcode's XRC twin.
    xrc: Option<u32>,
    payload: &'a [u8],
}

/// Property 2: whatever `emit` writes parses back to the normalised repr (or is rejected for
/// a reason the repr explains).
fn emit_direction(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(inp) = Input::arbitrary(&mut u) else {
        return;
    };
    // Small TVer values (mostly 0) so the valid path is the common one.
    let tver = if inp.tver < 0xF0 { 0 } else { inp.tver & 0x1F };
    // Mostly RC opcodes, some UD ones (0x64, 0x65), a few unknown.
    let opcode = match inp.opcode {
        0..=0xCF => inp.opcode % 0x15,
        0xD0..=0xDF => 0x64 + (inp.opcode & 1),
        _ => inp.opcode,
    };
    let aeth = inp.aeth.map(|(s, msn)| Aeth {
        syndrome: AethSyndrome::from_u8(s).unwrap_or(AethSyndrome::Ack { credits: s & 0x1F }),
        msn,
    });
    let repr = PacketRepr {
        src: Endpoint {
            mac: inp.src_mac,
            ip: inp.src_ip,
        },
        dst: Endpoint {
            mac: inp.dst_mac,
            ip: inp.dst_ip,
        },
        udp_src_port: inp.udp_src_port,
        ip_id: inp.ip_id,
        tos: inp.tos,
        ttl: inp.ttl,
        bth: BthRepr {
            opcode,
            solicited: inp.bth_bits & 1 != 0,
            mig_req: inp.bth_bits & 2 != 0,
            pad: inp.bth_bits >> 2,
            tver,
            pkey: inp.pkey,
            fecn: inp.bth_bits & 0x40 != 0,
            becn: inp.bth_bits & 0x80 != 0,
            dest_qp: Qpn::from_bits(inp.dest_qp),
            ack_req: inp.bth_bits & 0x20 != 0,
            psn: Psn::new(inp.psn),
        },
        deth: inp.deth.map(|(qkey, src)| Deth {
            qkey,
            src_qp: Qpn::from_bits(src),
        }),
        reth: inp.reth.map(|(va, rkey, len)| Reth { va, rkey, len }),
        aeth,
        atomic_eth: inp
            .atomic_eth
            .map(|(va, rkey, swap_add, compare)| AtomicEth {
                va,
                rkey,
                swap_add,
                compare,
            }),
        atomic_ack: inp.atomic_ack,
        imm: inp.imm,
        // XRC is RC's: a UC or UD opcode has no XRC twin.
        xrc: inp
            .xrc
            .filter(|_| Opcode::from_u8(opcode).is_some_and(|o| !o.is_uc() && !o.is_ud())),
    };
    let payload = inp.payload;
    let mut out = vec![0xAA; 3]; // emit appends: start from a non-empty buffer
    repr.emit(payload, &mut out);
    assert_eq!(
        &out[..3],
        &[0xAA; 3],
        "emit touched bytes before the end of the buffer"
    );
    let frame = &out[3..];
    assert_eq!(frame.len(), repr.frame_len(payload.len()));
    // The ICRC emit writes is the one compute_icrc computes.
    let stored = u32::from_le_bytes(frame[frame.len() - ICRC_LEN..].try_into().unwrap());
    assert_eq!(
        compute_icrc(frame),
        Ok(stored),
        "emit wrote an ICRC compute_icrc disagrees with"
    );

    let parsed = parse_packet(frame);
    let Some(op) = Opcode::from_u8(opcode) else {
        let want = if tver & 0xF != 0 {
            WireError::BadTver
        } else {
            WireError::UnknownOpcode(opcode)
        };
        assert_eq!(parsed.err(), Some(want));
        return;
    };
    if tver & 0xF != 0 {
        assert_eq!(parsed.err(), Some(WireError::BadTver));
        return;
    }
    if !payload.is_empty() && !op.has_payload() {
        assert_eq!(parsed.err(), Some(WireError::UnexpectedPayload));
        return;
    }
    let want = PacketRepr {
        bth: BthRepr {
            pad: pad_len(payload.len()),
            tver: 0,
            ..repr.bth
        },
        deth: op.has_deth().then(|| repr.deth.unwrap_or_default()),
        reth: op.has_reth().then(|| repr.reth.unwrap_or_default()),
        aeth: op.has_aeth().then(|| {
            let a = repr.aeth.unwrap_or(Aeth {
                syndrome: AethSyndrome::Ack { credits: 0 },
                msn: 0,
            });
            Aeth {
                syndrome: AethSyndrome::from_u8(a.syndrome.to_u8()).unwrap(),
                msn: a.msn & 0x00FF_FFFF,
            }
        }),
        atomic_eth: op
            .has_atomic_eth()
            .then(|| repr.atomic_eth.unwrap_or_default()),
        atomic_ack: op
            .has_atomic_ack_eth()
            .then(|| repr.atomic_ack.unwrap_or(0)),
        imm: op.has_immdt().then(|| repr.imm.unwrap_or(0)),
        // A request's XRCETH holds 24 bits; a response has none.
        xrc: repr
            .xrc
            .map(|n| if op.is_request() { n & 0x00FF_FFFF } else { 0 }),
        ..repr
    };
    match parsed {
        Ok(p) => {
            assert_eq!(
                p.repr,
                want,
                "emit→parse changed the repr\n frame {}",
                hex(frame)
            );
            assert_eq!(p.payload, payload, "emit→parse changed the payload");
        }
        Err(e) => panic!(
            "emitted frame does not parse: {e:?}\n repr {repr:?}\n frame {}",
            hex(frame)
        ),
    }
    // The sanity of the helper the model uses for flow entropy: never panics, symmetric.
    let (a, b) = (repr.bth.dest_qp, Qpn::from_bits(inp.psn));
    assert_eq!(wire::udp_src_port(a, b), wire::udp_src_port(b, a));
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
