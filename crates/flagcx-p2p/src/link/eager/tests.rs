//! The eager path's pieces that need no second process: value writes, receive budgets.

use flagcx_host::HostAdaptor;

use super::*;
use crate::channel::Geometry;

#[test]
fn value_writes_only_for_small_aligned_messages_on_a_shared_device() {
    let gpu = Capabilities {
        stream_mem_ops: true,
        stream_mem_ops_64: true,
        ..Default::default()
    };
    let at = |a| DevicePtr(a);
    assert_eq!(value_words(gpu, at(256), 8, true), Some(8));
    assert_eq!(value_words(gpu, at(256), 64, true), Some(8));
    assert_eq!(value_words(gpu, at(260), 8, true), Some(4), "4-aligned");
    assert_eq!(value_words(gpu, at(256), 12, true), Some(4), "odd words");
    assert_eq!(
        value_words(gpu, at(260), 128, true),
        None,
        "many 4-byte words"
    );
    assert_eq!(
        value_words(gpu, at(256), 8, false),
        None,
        "device not shared"
    );
    assert_eq!(value_words(gpu, at(256), 512, true), Some(8));
    assert_eq!(value_words(gpu, at(256), 520, true), None, "too large");
    assert_eq!(value_words(gpu, at(256), 0, true), None);
    assert_eq!(value_words(gpu, at(256), 6, true), None, "not whole words");
    assert_eq!(value_words(gpu, at(258), 8, true), None, "unaligned");
    let only32 = Capabilities {
        stream_mem_ops: true,
        ..Default::default()
    };
    assert_eq!(value_words(only32, at(256), 8, true), Some(4));
    assert_eq!(value_words(Capabilities::default(), at(256), 8, true), None);
    let host = Capabilities {
        host_addressable: true,
        ..gpu
    };
    assert_eq!(value_words(host, at(256), 8, true), None, "the CPU copies");
}

#[test]
fn value_writes_land_every_byte_and_nothing_around_them() {
    let a = HostAdaptor::open(0).unwrap();
    let s = a.stream_create().unwrap();
    let buf = a.mem_alloc(1024).unwrap();
    for word in [8usize, 4] {
        for len in (word..=VALUE_WRITES_MAX).step_by(word) {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + len + word) as u8).collect();
            let off = 64;
            // SAFETY: `buf` holds 1024 bytes, the range `off..off + len` lies inside it and
            // is `word`-aligned; the stream is synchronized before the bytes are read.
            unsafe {
                a.memset_async(buf, 0xEE, 1024, s).unwrap();
                write_words(&a, DevicePtr(buf.0 + off as u64), &data, word, s).unwrap();
                a.stream_synchronize(s).unwrap();
            }
            let mut got = vec![0u8; 1024];
            // SAFETY: `buf` holds 1024 bytes; the stream is idle.
            unsafe {
                a.memcpy_d2h_async(got.as_mut_ptr(), buf, 1024, s).unwrap();
                a.stream_synchronize(s).unwrap();
            }
            assert_eq!(&got[off..off + len], &data[..], "word {word}, {len} bytes");
            assert!(
                got[..off].iter().all(|&b| b == 0xEE),
                "before, {word}/{len}"
            );
            assert!(
                got[off + len..].iter().all(|&b| b == 0xEE),
                "after, {word}/{len}"
            );
        }
    }
    // SAFETY: allocated above, nothing in flight.
    unsafe { a.mem_free(buf).unwrap() };
    a.stream_destroy(s).unwrap();
}

fn link() -> EagerLink {
    let geo = Geometry {
        slots: 1,
        chunk: 4096,
        split: 8,
        eager: 64,
    };
    EagerLink {
        out: Arc::new(Channel::create(geo).unwrap()),
        inc: Arc::new(Channel::create(geo).unwrap()),
        send_max: 64,
        recv_max: 64,
        freed: AtomicU64::new(0),
        addressable: false,
        shares_device: false,
        waited_ns: AtomicU64::new(0),
    }
}

#[test]
fn receives_wait_longer_for_a_slow_pair_and_for_a_running_copy() {
    let l = link();
    let spin = Duration::from_micros(50);
    assert_eq!(l.recv_budget(spin, 0), spin, "no history: the spin time");
    assert_eq!(
        l.recv_budget(Duration::ZERO, 0),
        Duration::ZERO,
        "spin 0: no wait"
    );
    // Receives that waited 10 µs keep the spin time; ones that waited 100 µs triple it.
    for _ in 0..64 {
        l.note_wait(Duration::from_micros(10));
    }
    assert_eq!(l.recv_budget(spin, 0), spin);
    for _ in 0..64 {
        l.note_wait(Duration::from_micros(100));
    }
    let b = l.recv_budget(spin, 0);
    assert!(
        b > Duration::from_micros(280) && b <= Duration::from_micros(300),
        "{b:?}"
    );
    // Never past the cap, however slow.
    for _ in 0..64 {
        l.note_wait(Duration::from_secs(1));
    }
    assert_eq!(l.recv_budget(spin, 0), ACTIVE_PEER_WAIT);
    // The peer copying message 5 out of its device: its receive waits for the copy too,
    // the next one's does not.
    l.inc.store(Counter::Issued, 6);
    assert_eq!(l.recv_budget(spin, 5), ACTIVE_PEER_WAIT + RUNNING_COPY_WAIT);
    assert_eq!(l.recv_budget(spin, 6), ACTIVE_PEER_WAIT);
}

#[test]
fn a_receive_sees_a_message_sent_through_the_handshake_and_a_full_window() {
    let l = link();
    let (mut polls, mut other_at) = (0u32, None);
    // Nothing sent: not yet, however long it looks.
    for _ in 0..200 {
        assert!(matches!(l.probe(3, &mut polls), Arrival::NotYet));
    }
    // The peer handed message 4 to its proxy (message 3 came eagerly, published before):
    // message 3 is eager, and a look at message 4 says "the proxy's" within 64 looks.
    // SAFETY: 8 bytes at a live array into eager slot 3 of our own channel.
    unsafe { l.inc.post_eager(3, [7u8; 8].as_ptr(), 8) };
    l.inc.store(Counter::Handshake, 5);
    assert!(matches!(l.probe(3, &mut polls), Arrival::Eager(sd) if sd.size == 8));
    for i in 0..64 {
        if let Arrival::Other = l.probe(4, &mut polls) {
            other_at = Some(i);
            break;
        }
    }
    assert!(other_at.is_some(), "message 4 never showed as the proxy's");
    assert!(matches!(l.probe(5, &mut polls), Arrival::NotYet));
    // Sends: the window shuts once 64 are not yet taken.
    assert!(l.window_open(63));
    assert!(!l.window_open(64));
    l.out.store(Counter::RecvDone, 1);
    assert!(l.window_open(64));
}
