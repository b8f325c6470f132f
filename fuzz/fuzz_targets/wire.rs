//! Fuzzes everything a peer's bytes reach before admission or during setup: frame headers,
//! payload readers, peer information, unique ids and IPC handle wire forms.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= flagcx_p2p::wire::HEADER_LEN {
        let mut h = [0u8; flagcx_p2p::wire::HEADER_LEN];
        h.copy_from_slice(&data[..flagcx_p2p::wire::HEADER_LEN]);
        if let Ok((_, len)) = flagcx_p2p::wire::parse_header(&h) {
            assert!(len <= flagcx_p2p::wire::MAX_PAYLOAD);
        }
    }
    if let Ok(info) = flagcx_p2p::peer::PeerInfo::decode(data) {
        // Whatever decodes must re-encode to the same bytes.
        assert_eq!(info.encode(), data);
    }
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = s.parse::<flagcx_p2p::UniqueId>();
    }
    let _ = flagcx_adaptor::IpcMemHandle::from_wire(data);
    let mut r = flagcx_p2p::wire::Reader::new(data, "fuzz");
    while r.bytes().is_ok() {}
});
