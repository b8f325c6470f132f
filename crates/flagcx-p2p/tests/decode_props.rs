//! Property tests of everything that decodes bytes from a peer: frames, the hello, peer
//! information, the connect frame, the TCP table, unique ids, channel descriptors. Arbitrary input must give a typed error, never a panic, and
//! what we encode must decode to itself. `cargo xtask fuzz` runs these with many more cases.

use flagcx_adaptor::{Capabilities, IpcMemHandle, Vendor};
use flagcx_p2p::bootstrap::{decode_table, encode_table, Hello};
use flagcx_p2p::channel::{
    Channel, ConnectMsg, Geometry, RecvDesc, SendDesc, Span, RECV_DESC_BYTES, SEND_DESC_BYTES,
};
use flagcx_p2p::config::{HostDirect, IpcCopier};
use flagcx_p2p::peer::PeerInfo;
use flagcx_p2p::wire::{self, Reader, Tag, MAX_PAYLOAD};
use flagcx_p2p::{CommError, UniqueId};
use proptest::prelude::*;

fn vendor() -> impl Strategy<Value = Vendor> {
    prop_oneof![
        Just(Vendor::Host),
        Just(Vendor::Cuda),
        Just(Vendor::Hip),
        Just(Vendor::OpenCl)
    ]
}

fn peer_info() -> impl Strategy<Value = PeerInfo> {
    (
        0usize..1 << 20,
        vendor(),
        0usize..64,
        proptest::option::of("[0-9a-f:.]{0,16}".prop_filter("non-empty", |s| !s.is_empty())),
        ".{0,40}",
        any::<u32>(),
        any::<[bool; 14]>(),
        (any::<bool>(), 0u8..3, 0u8..3, 0u8..3),
        (0u8..3, any::<bool>()),
    )
        .prop_map(
            |(
                rank,
                vendor,
                device,
                pci_bus_id,
                host_id,
                pid,
                c,
                (p2p_disable, copier, direct, streamed),
                (late, shares_queue),
            )| {
                PeerInfo {
                    rank,
                    vendor,
                    device,
                    pci_bus_id,
                    host_id,
                    pid,
                    caps: Capabilities {
                        ipc_bytes: c[0],
                        ipc_fd: c[1],
                        host_register: c[2],
                        peer_access: c[3],
                        host_functions: c[4],
                        stream_mem_ops: c[5],
                        stream_mem_ops_64: c[6],
                        capture_mode: c[7],
                        host_addressable: c[8],
                        host_pin: c[9],
                        sized_copy: c[10],
                        host_gates: c[11],
                        concurrent_processes: c[12],
                        ipc_fd_foreign: c[13],
                        reduce_types: if c[0] {
                            flagcx_adaptor::reduce::ALL_TYPES
                        } else {
                            0
                        },
                    },
                    p2p_disable,
                    ipc_copier: IpcCopier::from_code(copier).expect("0..3 are codes"),
                    host_direct: HostDirect::from_code(direct).expect("0..3 are codes"),
                    streamed: HostDirect::from_code(streamed).expect("0..3 are codes"),
                    late_copy: HostDirect::from_code(late).expect("0..3 are codes"),
                    shares_queue,
                }
            },
        )
}

/// The protocol error's message, or a failure naming what came back instead.
fn protocol_message<T: std::fmt::Debug>(r: Result<T, CommError>) -> Result<String, TestCaseError> {
    match r {
        Err(CommError::Protocol(m)) => Ok(m),
        other => Err(TestCaseError::fail(format!(
            "expected a protocol error, got {other:?}"
        ))),
    }
}

/// Byte offsets of `PeerInfo::encode`'s fixed fields from the end: the capability bits, the
/// reduction types, the staged flag, the copier code, the host-direct code, the stream-order
/// code, the late-copy code and the shared-queue flag close the frame.
const CAPS_FROM_END: usize = 14;
const TYPES_FROM_END: usize = 10;
const P2P_FROM_END: usize = 6;
const COPIER_FROM_END: usize = 5;
const DIRECT_FROM_END: usize = 4;
const STREAMED_FROM_END: usize = 3;
const LATE_FROM_END: usize = 2;
const SHARES_QUEUE_FROM_END: usize = 1;
/// The vendor code follows the rank.
const VENDOR_AT: usize = 4;

proptest! {
    #[test]
    fn headers_round_trip(tag in 1u32..=10, len in 0usize..=MAX_PAYLOAD) {
        // Every tag the wire has (1..=10; the test of `Tag::from_u32` below pins the set).
        let tag = Tag::from_u32(tag).unwrap();
        let h = wire::header(tag, len).unwrap();
        prop_assert_eq!(wire::parse_header(&h).unwrap(), (tag, len));
    }

    #[test]
    fn headers_reject_an_unknown_tag_exactly(tag in any::<u32>().prop_filter("unknown", |t| Tag::from_u32(*t).is_none()), len in 0usize..=MAX_PAYLOAD) {
        let mut h = wire::header(Tag::Barrier, len).unwrap();
        h[..4].copy_from_slice(&tag.to_le_bytes());
        let m = protocol_message(wire::parse_header(&h))?;
        prop_assert_eq!(m, format!("unknown tag {tag}"));
    }

    #[test]
    fn headers_reject_an_oversized_length_exactly(tag in 1u32..=10, len in (MAX_PAYLOAD as u32 + 1)..=u32::MAX) {
        let mut h = wire::header(Tag::from_u32(tag).unwrap(), 0).unwrap();
        h[4..].copy_from_slice(&len.to_le_bytes());
        let m = protocol_message(wire::parse_header(&h))?;
        prop_assert!(m.starts_with(&format!("frame claims {len} bytes")), "{}", m);
    }

    #[test]
    fn peer_info_round_trips(info in peer_info()) {
        prop_assert_eq!(PeerInfo::decode(&info.encode()).unwrap(), info);
    }

    /// A valid frame with one field made invalid is refused, with that field named.
    #[test]
    fn peer_info_names_the_one_bad_field(info in peer_info(), field in 0usize..10, junk in any::<u8>()) {
        let mut b = info.encode();
        let n = b.len();
        let expected = match field {
            0 => {
                let v = if Vendor::from_code(junk).is_none() { junk } else { 0 };
                b[VENDOR_AT] = v;
                format!("peer info: unknown vendor code {v}")
            }
            1 => {
                let bits = u32::from_le_bytes(b[n - CAPS_FROM_END..n - CAPS_FROM_END + 4].try_into().unwrap())
                    | (1 << (14 + junk as u32 % 18));
                b[n - CAPS_FROM_END..n - CAPS_FROM_END + 4].copy_from_slice(&bits.to_le_bytes());
                format!("peer info: unknown capability bits {bits:#x}")
            }
            2 => {
                let x = junk.max(2);
                b[n - P2P_FROM_END] = x;
                format!("peer info: flag {x}")
            }
            3 => {
                let x = junk.max(3);
                b[n - COPIER_FROM_END] = x;
                format!("peer info: unknown IPC copier code {x}")
            }
            4 => {
                let x = junk.max(3);
                b[n - DIRECT_FROM_END] = x;
                format!("peer info: unknown host-direct code {x}")
            }
            5 => {
                let x = junk.max(3);
                b[n - STREAMED_FROM_END] = x;
                format!("peer info: unknown stream-order code {x}")
            }
            6 => {
                let x = junk.max(3);
                b[n - LATE_FROM_END] = x;
                format!("peer info: unknown late-copy code {x}")
            }
            7 => {
                let x = junk.max(2);
                b[n - SHARES_QUEUE_FROM_END] = x;
                format!("peer info: flag {x}")
            }
            8 => {
                let types = u32::from_le_bytes(b[n - TYPES_FROM_END..n - TYPES_FROM_END + 4].try_into().unwrap())
                    | (1 << (10 + junk as u32 % 22));
                b[n - TYPES_FROM_END..n - TYPES_FROM_END + 4].copy_from_slice(&types.to_le_bytes());
                format!("peer info: unknown reduction types {types:#x}")
            }
            _ => {
                b.push(junk);
                "peer info: 1 trailing bytes".to_string()
            }
        };
        let m = protocol_message(PeerInfo::decode(&b))?;
        prop_assert_eq!(m, expected);
    }

    /// The PCI bus id's length prefix claims more bytes than the frame holds.
    #[test]
    fn peer_info_refuses_a_string_longer_than_the_frame(info in peer_info(), extra in 1u32..1 << 20) {
        let mut b = info.encode();
        let at = 9; // rank (4), vendor (1), device (4), then the bus id's length
        let len = u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let claim = len + b.len() as u32 + extra;
        b[at..at + 4].copy_from_slice(&claim.to_le_bytes());
        let m = protocol_message(PeerInfo::decode(&b))?;
        prop_assert!(m.starts_with("peer info: truncated"), "{}", m);
    }

    #[test]
    fn peer_info_rejects_every_truncation(info in peer_info(), cut in any::<proptest::sample::Index>()) {
        // A cut anywhere in the encoding, its tail included (not only the first 64 bytes).
        let b = info.encode();
        let cut = cut.index(b.len());
        let m = protocol_message(PeerInfo::decode(&b[..cut]))?;
        prop_assert!(m.starts_with("peer info: truncated"), "{}", m);
    }

    #[test]
    fn reader_sequences_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64), ops in proptest::collection::vec(0u8..5, 0..12)) {
        let mut r = Reader::new(&bytes, "prop");
        for op in ops {
            let _ = match op {
                0 => r.u8().map(|_| ()),
                1 => r.u32().map(|_| ()),
                2 => r.u64().map(|_| ()),
                3 => r.bytes().map(|_| ()),
                _ => r.str().map(|_| ()),
            };
        }
        let _ = r.end();
    }

    #[test]
    fn unique_ids_round_trip(name in any::<[u8; 16]>(), secret in any::<[u8; 16]>()) {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let s = format!("fx1-{}-{}", hex(&name), hex(&secret));
        let id: UniqueId = s.parse().unwrap();
        prop_assert_eq!(id.to_string(), s.clone());
        // Upper case and surrounding blanks are accepted too.
        let loud: UniqueId = format!("  {}\n", s.to_ascii_uppercase().replacen("FX1", "fx1", 1)).parse().unwrap();
        prop_assert_eq!(loud.to_string(), s);
    }

    /// A valid id with one character replaced by a non-hex one is refused, naming the part.
    #[test]
    fn unique_ids_name_the_bad_part(id in any::<[u8; 32]>(), at in 0usize..64, bad in "[g-zG-Z_+ ./]") {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let mut s = format!("fx1-{}-{}", hex(&id[..16]), hex(&id[16..]));
        // Characters 4..36 are the name, 37..69 the secret.
        let pos = if at < 32 { 4 + at } else { 37 + (at - 32) };
        s.replace_range(pos..pos + 1, &bad);
        let want = if at < 32 { "bad name part" } else { "bad secret part" };
        match s.parse::<UniqueId>() {
            Err(CommError::Config { name, value, reason }) => {
                prop_assert_eq!(name, "FLAGCX_UNIQUE_ID");
                prop_assert_eq!(value, s);
                prop_assert_eq!(reason, want);
            }
            other => prop_assert!(false, "{:?}", other),
        }
    }

    #[test]
    fn ipc_handles_decode_safely(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
        // Arbitrary bytes (almost never a valid handle) decode to an error, never a panic.
        if let Ok(h) = IpcMemHandle::from_wire(&bytes) {
            prop_assert_eq!(h.to_wire().to_vec(), bytes);
        }
    }

    #[test]
    fn ipc_handles_round_trip(
        code in 0u8..8,
        payload in proptest::collection::vec(any::<u8>(), flagcx_adaptor::IPC_HANDLE_BYTES),
        cut in 0usize..(flagcx_adaptor::IPC_HANDLE_BYTES + 2),
    ) {
        // A well-formed wire form (a vendor code, then the handle's bytes) round-trips in every
        // case, not in the 1-in-thousands a random vector happens to be well formed; an
        // unknown vendor code or a cut one is an error.
        let mut wire = vec![code];
        wire.extend_from_slice(&payload);
        match (Vendor::from_code(code), IpcMemHandle::from_wire(&wire)) {
            (Some(v), Ok(h)) => {
                prop_assert_eq!(h.vendor, v);
                prop_assert_eq!(h.to_wire().to_vec(), wire.clone());
            }
            (None, Err(_)) => {}
            (known, got) => prop_assert!(false, "code {code}: vendor {known:?}, decoded {got:?}"),
        }
        if cut < wire.len() {
            prop_assert!(IpcMemHandle::from_wire(&wire[..cut]).is_err());
        }
    }

    #[test]
    fn receive_descriptors_from_garbage_memory_are_errors_not_panics(
        garbage in proptest::collection::vec(any::<u8>(), 128),
        size in any::<u64>(),
        offset in any::<u64>(),
        chunks in any::<bool>(),
        handle in proptest::option::of(proptest::array::uniform32(any::<u8>())),
        (base, len) in (any::<u64>(), any::<u64>()),
    ) {
        let ch = Channel::create(Geometry {
            slots: 0,
            chunk: 0,
            split: 0,
            eager: 0,
        }).unwrap();
        // A well-formed descriptor round-trips...
        // (A span travels with a handle only.)
        let handle = handle.map(|b| {
            let mut bytes = [0u8; flagcx_adaptor::IPC_HANDLE_BYTES];
            bytes[..32].copy_from_slice(&b);
            IpcMemHandle { vendor: Vendor::Cuda, bytes }
        });
        let span = match handle {
            Some(_) => Span { base, len },
            None => Span::default(),
        };
        let d = RecvDesc { size, handle, offset, span, chunks };
        ch.write_recv_desc(3, &d);
        prop_assert_eq!(ch.read_recv_desc(3).unwrap(), d);
        // ...and arbitrary bytes in its place (a corrupt or hostile peer) never panic.
        let base = ch.segment().as_ptr();
        // SAFETY: the receive descriptors start at 4096 in the live mapping; slot 5 is 128 bytes.
        unsafe { std::ptr::copy_nonoverlapping(garbage.as_ptr(), base.add(4096 + 5 * 128), 128) };
        let _ = ch.read_recv_desc(5);
    }
}

proptest! {
    #[test]
    fn hellos_round_trip_and_garbage_is_an_error(
        version in any::<u32>(), rank in any::<u32>(), nranks in any::<u32>(),
        secret in proptest::collection::vec(any::<u8>(), 0..40),
        place in proptest::option::of((".{0,20}", any::<u16>())),
        garbage in proptest::collection::vec(any::<u8>(), 0..120),
        cut in any::<proptest::sample::Index>(),
    ) {
        let tcp = place.is_some();
        let h = Hello { version, rank, nranks, secret, place };
        let bytes = h.encode();
        prop_assert_eq!(Hello::decode(&bytes, tcp).unwrap(), h);
        // Every strict prefix is short, and one byte more is trailing: both errors.
        let at = cut.index(bytes.len());
        prop_assert!(Hello::decode(&bytes[..at], tcp).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        prop_assert!(Hello::decode(&longer, tcp).is_err());
        let _ = Hello::decode(&garbage, tcp);
        let _ = Hello::decode(&garbage, !tcp);
    }

    #[test]
    fn connect_frames_round_trip_and_garbage_is_an_error(
        staged in any::<bool>(), slots in any::<u32>(), chunk in any::<u32>(),
        split in any::<u16>(), eager in any::<u16>(), len in any::<u64>(),
        offered in 0u8..3, ring_len in any::<u64>(),
        garbage in proptest::collection::vec(any::<u8>(), 0..80),
        cut in any::<proptest::sample::Index>(),
    ) {
        let geo = Geometry {
            slots: slots as usize,
            chunk: chunk as usize,
            split: split as usize,
            eager: eager as usize,
        };
        let c = ConnectMsg { staged, geo, len, offered, ring_len };
        let bytes = c.encode();
        prop_assert_eq!(ConnectMsg::decode(&bytes).unwrap(), c);
        prop_assert!(ConnectMsg::decode(&bytes[..cut.index(bytes.len())]).is_err());
        if let Ok(d) = ConnectMsg::decode(&garbage) {
            prop_assert_eq!(d.encode(), garbage);
        }
    }

    #[test]
    fn tables_round_trip_and_garbage_is_an_error(
        hosts in proptest::collection::vec((".{0,12}", any::<[u8; 4]>(), any::<u16>()), 0..6),
        garbage in proptest::collection::vec(any::<u8>(), 0..120),
        n in 0usize..1 << 20,
    ) {
        let table: Vec<(String, std::net::SocketAddr)> = hosts
            .into_iter()
            .map(|(h, ip, port)| (h, std::net::SocketAddr::from((ip, port))))
            .collect();
        let bytes = encode_table(&table);
        prop_assert_eq!(decode_table(&bytes, table.len()).unwrap(), table.clone());
        // A table of another size than the job's is refused, whichever way it is off.
        prop_assert!(decode_table(&bytes, table.len() + 1).is_err());
        if !table.is_empty() {
            prop_assert!(decode_table(&bytes, table.len() - 1).is_err());
        }
        // A huge claimed job size must not allocate for it, nor panic.
        let _ = decode_table(&garbage, n);
    }

    #[test]
    fn descriptors_from_bytes_are_errors_not_panics(
        recv in proptest::array::uniform32(any::<u8>()),
        send in proptest::array::uniform32(any::<u8>()),
        i in any::<u64>(),
    ) {
        // The fields live in the first line; the rest is zeros or the same pattern again.
        let mut r = [0u8; RECV_DESC_BYTES];
        let mut s = [0u8; SEND_DESC_BYTES];
        for (k, b) in r.iter_mut().enumerate() {
            *b = recv[k % 32];
        }
        for (k, b) in s.iter_mut().enumerate() {
            *b = send[k % 32];
        }
        let _ = RecvDesc::decode(&r);
        let _ = SendDesc::decode(&s, i);
    }
}

#[test]
fn tags_round_trip() {
    for t in [
        Tag::Hello,
        Tag::HelloAck,
        Tag::PeerInfo,
        Tag::Connect,
        Tag::Barrier,
        Tag::Table,
        Tag::NetAddress,
        Tag::Port,
        Tag::Inbox,
        Tag::DevRing,
    ] {
        assert_eq!(Tag::from_u32(t as u32), Some(t));
    }
    assert_eq!(Tag::from_u32(0), None);
    assert_eq!(Tag::from_u32(11), None);
}
