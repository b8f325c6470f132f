//! Fuzzes everything a peer's bytes reach before admission, during setup or in a channel:
//! frame headers, payload readers, the hello, peer information, the connect frame, the TCP
//! table, unique ids, IPC handle wire forms and rendezvous descriptors.
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
    for tcp in [false, true] {
        if let Ok(h) = flagcx_p2p::bootstrap::Hello::decode(data, tcp) {
            assert_eq!(flagcx_p2p::bootstrap::Hello::decode(&h.encode(), tcp).unwrap(), h);
        }
    }
    if let Ok(c) = flagcx_p2p::channel::ConnectMsg::decode(data) {
        assert_eq!(c.encode(), data);
    }
    let n = data.first().map_or(0, |&b| b as usize);
    if let Ok(t) = flagcx_p2p::bootstrap::decode_table(data.get(1..).unwrap_or_default(), n) {
        assert_eq!(t.len(), n);
    }
    if let Some(b) = data.first_chunk::<{ flagcx_p2p::channel::RECV_DESC_BYTES }>() {
        let _ = flagcx_p2p::channel::RecvDesc::decode(b);
    }
    if let Some(b) = data.first_chunk::<{ flagcx_p2p::channel::SEND_DESC_BYTES }>() {
        let _ = flagcx_p2p::channel::SendDesc::decode(b, n as u64);
    }
    let mut r = flagcx_p2p::wire::Reader::new(data, "fuzz");
    while r.bytes().is_ok() {}
});
