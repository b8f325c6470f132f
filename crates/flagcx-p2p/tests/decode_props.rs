//! Property tests of everything that decodes bytes from a peer: frames, peer information,
//! unique ids, channel descriptors. Arbitrary input must give a typed error, never a panic, and
//! what we encode must decode to itself. `cargo xtask fuzz` runs these with many more cases.

use flagcx_adaptor::{Capabilities, IpcMemHandle, Vendor};
use flagcx_p2p::channel::{Channel, Geometry, RecvDesc};
use flagcx_p2p::config::{HostDirect, IpcCopier};
use flagcx_p2p::peer::PeerInfo;
use flagcx_p2p::wire::{self, Reader, Tag, HEADER_LEN, MAX_PAYLOAD};
use flagcx_p2p::UniqueId;
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
        any::<[bool; 9]>(),
        (any::<bool>(), 0u8..3, 0u8..3),
    )
        .prop_map(
            |(rank, vendor, device, pci_bus_id, host_id, pid, c, (p2p_disable, copier, direct))| {
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
                    },
                    p2p_disable,
                    ipc_copier: IpcCopier::from_code(copier).expect("0..3 are codes"),
                    host_direct: HostDirect::from_code(direct).expect("0..3 are codes"),
                }
            },
        )
}

proptest! {
    #[test]
    fn headers_never_panic_and_bound_lengths(bytes in any::<[u8; HEADER_LEN]>()) {
        if let Ok((tag, len)) = wire::parse_header(&bytes) {
            prop_assert!(len <= MAX_PAYLOAD);
            prop_assert_eq!(wire::header(tag, len).unwrap(), bytes);
        }
    }

    #[test]
    fn peer_info_round_trips(info in peer_info()) {
        prop_assert_eq!(PeerInfo::decode(&info.encode()).unwrap(), info);
    }

    #[test]
    fn peer_info_rejects_garbage_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = PeerInfo::decode(&bytes);
    }

    #[test]
    fn peer_info_rejects_every_truncation(info in peer_info(), cut in 0usize..64) {
        let b = info.encode();
        let cut = cut.min(b.len().saturating_sub(1));
        prop_assert!(PeerInfo::decode(&b[..cut]).is_err());
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
    fn unique_ids_parse_strictly(s in ".{0,80}") {
        if let Ok(id) = s.parse::<UniqueId>() {
            prop_assert_eq!(id.to_string(), s.trim().to_ascii_lowercase());
        }
    }

    #[test]
    fn ipc_handles_decode_safely(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
        if let Ok(h) = IpcMemHandle::from_wire(&bytes) {
            prop_assert_eq!(h.to_wire().to_vec(), bytes);
        }
    }

    #[test]
    fn receive_descriptors_from_garbage_memory_are_errors_not_panics(
        garbage in proptest::collection::vec(any::<u8>(), 128),
        size in any::<u64>(),
        offset in any::<u64>(),
        chunks in any::<bool>(),
    ) {
        let ch = Channel::create(Geometry {
            slots: 0,
            chunk: 0,
            eager: 0,
        }).unwrap();
        // A well-formed descriptor round-trips...
        let d = RecvDesc { size, handle: None, offset, chunks };
        ch.write_recv_desc(3, &d);
        prop_assert_eq!(ch.read_recv_desc(3).unwrap(), d);
        // ...and arbitrary bytes in its place (a corrupt or hostile peer) never panic.
        let base = ch.segment().as_ptr();
        // SAFETY: the receive descriptors start at 4096 in the live mapping; slot 5 is 128 bytes.
        unsafe { std::ptr::copy_nonoverlapping(garbage.as_ptr(), base.add(4096 + 5 * 128), 128) };
        let _ = ch.read_recv_desc(5);
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
    ] {
        assert_eq!(Tag::from_u32(t as u32), Some(t));
    }
    assert_eq!(Tag::from_u32(0), None);
}
