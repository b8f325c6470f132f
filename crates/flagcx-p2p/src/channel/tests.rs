//! Unit tests of the channel layout and its words.
use super::*;
use flagcx_adaptor::Vendor;

/// A channel with 64-byte eager slots and no staging ring.
fn eager_only() -> Channel {
    let geo = Geometry {
        slots: 0,
        chunk: 0,
        split: 0,
        eager: 64,
    };
    Channel::create(geo).unwrap()
}

#[test]
fn descriptors_round_trip_through_two_mappings() {
    let geo = Geometry {
        slots: 4,
        chunk: 4096,
        split: 8,
        eager: 0,
    };
    let rx = Channel::create(geo).unwrap();
    let seg = ShmSegment::open(rx.segment().fd().try_clone_to_owned().unwrap(), geo.len()).unwrap();
    let tx = Channel::open(seg, geo).unwrap();
    let h = IpcMemHandle {
        vendor: Vendor::Host,
        bytes: [7; 64],
    };
    for i in [0, 1, 63, 64, 1000] {
        let d = RecvDesc {
            size: 10 + i,
            handle: Some(h),
            offset: i * 3,
            span: Span {
                base: 0x7f00_0000_0000 + (i << 21),
                len: 4096 * (i + 1),
            },
            chunks: i % 2 == 1,
        };
        rx.write_recv_desc(i, &d);
        rx.store(Counter::RecvPosted, i + 1);
        assert_eq!(tx.load(Counter::RecvPosted), i + 1);
        assert_eq!(tx.read_recv_desc(i).unwrap(), d);
        let s = SendDesc {
            size: i,
            status: SendStatus::SizeMismatch,
            handle: (i % 2 == 0).then_some(h),
            offset: i * 5 + 1,
            // A span travels with its handle only.
            span: match i % 2 {
                0 => Span {
                    base: u64::MAX - 4096 * (i + 1),
                    len: 4096 * (i + 1),
                },
                _ => Span::default(),
            },
        };
        tx.write_send_desc(i, &s);
        assert_eq!(rx.read_send_desc(i).unwrap(), s);
    }
    // SAFETY: both point into the same live 4-slot ring.
    unsafe {
        *tx.slot(5) = 9;
        assert_eq!(*rx.slot(1), 9, "slot index wraps modulo the slot count");
    }
    assert!(geo.len() >= 4 * 4096 + 4096);
}

#[test]
fn an_unknown_send_status_is_a_protocol_error() {
    let geo = Geometry {
        slots: 0,
        chunk: 0,
        split: 0,
        eager: 0,
    };
    let ch = Channel::create(geo).unwrap();
    for (k, status) in [
        SendStatus::Ok,
        SendStatus::SizeMismatch,
        SendStatus::SenderFailed,
        SendStatus::Delivered,
    ]
    .into_iter()
    .enumerate()
    {
        assert_eq!(SendStatus::from_word(status.word()).unwrap(), status);
        let d = SendDesc {
            size: 8,
            status,
            handle: None,
            offset: 0,
            span: Span::default(),
        };
        ch.write_send_desc(k as u64, &d);
        assert_eq!(ch.read_send_desc(k as u64).unwrap(), d);
    }
    // A hostile or corrupt peer's word (bytes 8..16 of the descriptor): an unknown status,
    // and a known one naming another message.
    ch.eager_word(7).store((8 << 8) | 5, Ordering::Release);
    match ch.read_send_desc(7) {
        Err(CommError::Protocol(m)) => assert!(m.contains("send status"), "{m}"),
        other => panic!("expected a protocol error, got {other:?}"),
    }
    ch.eager_word(7)
        .store(Channel::status_word(SendStatus::Ok, 71), Ordering::Release);
    match ch.read_send_desc(7) {
        Err(CommError::Protocol(m)) => assert!(m.contains("message number 71"), "{m}"),
        other => panic!("expected a protocol error, got {other:?}"),
    }
}

/// What the stream-ordered path relies on: every use of a descriptor slot publishes a
/// larger status word (so a stream can wait with `Geq`), `published` tells this message
/// from the slot's last one, and a poisoned descriptor reads as a failed send of a size
/// no receive takes.
#[test]
fn a_put_has_landed_once_its_slot_names_it_or_a_later_message() {
    let ch = eager_only();
    ch.keep_out_of_descriptors();
    assert!(!ch.put_landed(3));
    // SAFETY: 8 readable bytes; the test owns indices 3, 67 and 131.
    unsafe { ch.post_eager(3, [1u8; 8].as_ptr(), 8) };
    assert!(ch.put_landed(3) && !ch.put_landed(67));
    // Message 67 reuses slot 3 only after message 3 was received: 3 stays landed.
    // SAFETY: as above.
    unsafe { ch.post_eager(67, [2u8; 8].as_ptr(), 8) };
    assert!(ch.put_landed(3) && ch.put_landed(67) && !ch.put_landed(131));
    // The receiver failing message 131 is not its put.
    ch.poison_send_desc(131);
    assert!(ch.published(131) && !ch.put_landed(131) && ch.put_landed(67));
}

#[test]
fn a_take_s_word_sits_past_the_receive_descriptor_and_survives_its_rewrite() {
    let ch = eager_only();
    let word = |i: u64| {
        // SAFETY: the taken word is an aligned u64 inside the live mapping.
        unsafe { &*(ch.segment().as_ptr().add(ch.recv_taken_offset(i)) as *const AtomicU64) }
    };
    assert!(!ch.taken(5));
    let d = RecvDesc {
        size: u64::MAX,
        handle: None,
        offset: u64::MAX,
        span: Span::default(),
        chunks: true,
    };
    ch.write_recv_desc(5, &d);
    assert!(!ch.taken(5), "announcing a receive is not taking it");
    word(5).store(6, Ordering::Release);
    ch.write_recv_desc(69, &d);
    assert!(
        ch.taken(5) && !ch.taken(69),
        "the receive descriptor's rewrite kept it"
    );
    word(69).store(70, Ordering::Release);
    assert!(ch.taken(5) && ch.taken(69) && !ch.taken(133));
    assert_eq!(ch.read_recv_desc(5).unwrap().size, u64::MAX);
}

#[test]
fn status_words_grow_per_slot_and_poison_reads_as_a_failed_send() {
    let ch = eager_only();
    ch.keep_out_of_descriptors();
    let mut last = 0;
    for i in [3u64, 67, 131] {
        assert!(!ch.published(i));
        let status =
            [SendStatus::Ok, SendStatus::Eager, SendStatus::SizeMismatch][(i / 64) as usize];
        let w = Channel::status_word(status, i);
        assert!(w > last && (w >> 8) == i + 1, "{w:#x} after {last:#x}");
        last = w;
        // SAFETY: 8 readable bytes; the test owns index `i`.
        unsafe { ch.post_eager(i, [7u8; 8].as_ptr(), 8) };
        assert!(ch.published(i) && !ch.published(i + 64));
    }
    // Out of the descriptor: the slot holds the bytes.
    // SAFETY: eager slot 131 % 64 lies in the mapping.
    let first = unsafe { *ch.segment().as_ptr().add(ch.eager_slot_offset(131)) };
    assert_eq!(first, 7);
    ch.poison_send_desc(195);
    assert!(ch.published(195));
    let sd = ch.read_send_desc(195).unwrap();
    assert_eq!((sd.status, sd.size), (SendStatus::SenderFailed, u64::MAX));
    assert_eq!(ch.send_status_offset(195), ch.send_size_offset(195) + 8);
}

#[test]
fn eager_slots_carry_messages_beside_the_ring() {
    let geo = Geometry {
        slots: 2,
        chunk: 4096,
        split: 8,
        eager: 100,
    };
    let rx = Channel::create(geo).unwrap();
    let seg = ShmSegment::open(rx.segment().fd().try_clone_to_owned().unwrap(), geo.len()).unwrap();
    let tx = Channel::open(seg, geo).unwrap();
    // The lane does not overlap the descriptors or the ring.
    assert!(geo.ring() >= geo.lane() + 64 * 100);
    assert!(geo.lane() >= geo.send_descs() + 64 * DESC_BYTES);
    // Slot `i` is free once the receiver finished message `i - 64`.
    assert!(tx.window_open(63) && !tx.window_open(64));
    for i in [0u64, 1, 63, 64, 130] {
        rx.store(Counter::RecvDone, i.saturating_sub(63));
        assert!(tx.window_open(i), "window at {i}");
        assert!(!tx.window_open(i + 64), "window past {i}");
        // Sizes on both sides of the inline limit.
        let len = [1, 48, 49, 100, 0][(i % 5) as usize];
        let msg: Vec<u8> = (0..len).map(|j| (i as usize + j) as u8).collect();
        // SAFETY: `msg` is readable and fits a slot; the test owns every index.
        unsafe { tx.post_eager(i, msg.as_ptr(), msg.len()) };
        // SAFETY: the ring slot is ours; writing it must not disturb the lane.
        unsafe { std::ptr::write_bytes(rx.slot(i), 0xFF, 4096) };
        assert_eq!(rx.load(Counter::SendPosted), i + 1);
        let sd = rx.read_send_desc(i).unwrap();
        assert_eq!((sd.size, sd.status), (msg.len() as u64, SendStatus::Eager));
        assert_eq!(rx.eager_arrived(i), Some(sd));
        // The slot's next use (message i + 64) is not there yet; neither is the one before.
        assert_eq!(rx.eager_arrived(i + 64), None);
        assert!(
            rx.read_send_desc(i + 64).is_err(),
            "a stale eager descriptor"
        );
        let mut got = vec![0u8; 100];
        // SAFETY: `got` holds 100 >= sd.size bytes.
        let n = unsafe { rx.take_eager(i, &sd, got.as_mut_ptr()) }.unwrap();
        assert_eq!(&got[..n], &msg[..]);
        rx.store(Counter::RecvDone, i + 1);
    }
    // A zero-byte message may come from, and go to, a null pointer.
    // SAFETY: zero bytes; the test owns index 150 (its window is open: RecvDone is 131).
    unsafe { tx.post_eager(150, std::ptr::null(), 0) };
    let sd = rx.eager_arrived(150).expect("published");
    // SAFETY: zero bytes.
    let n = unsafe { rx.take_eager(150, &sd, std::ptr::null_mut()) };
    assert_eq!(n.unwrap(), 0);
    let forged = SendDesc {
        size: 101,
        status: SendStatus::Eager,
        handle: None,
        offset: 0,
        span: Span::default(),
    };
    let mut got = vec![0u8; 101];
    // SAFETY: `got` is large enough; the size check fails first anyway.
    let e = unsafe { rx.take_eager(0, &forged, got.as_mut_ptr()) }.unwrap_err();
    assert!(matches!(e, CommError::Protocol(_)), "{e}");
}

/// Late copies' claims (`Channel::claim`): two threads, each on its own mapping, claim 20 000
/// messages in order, racing; for every message exactly one side comes first. Every 100
/// messages both meet at a barrier, and the block's first message is left to one side, taking
/// turns, so each side comes first at least that often whatever the scheduling.
#[test]
fn every_late_claim_has_exactly_one_first_side() {
    let geo = Geometry {
        slots: 0,
        chunk: 0,
        split: 0,
        eager: 0,
    };
    let rx = Channel::create(geo).unwrap();
    let seg = ShmSegment::open(rx.segment().fd().try_clone_to_owned().unwrap(), geo.len()).unwrap();
    let tx = Channel::open(seg, geo).unwrap();
    const N: u64 = 20_000;
    const BLOCK: u64 = 100;
    let meet = std::sync::Barrier::new(2);
    let run = |ch: &Channel, sender: bool| {
        (0..N)
            .map(|i| {
                if i % BLOCK == 0 {
                    meet.wait();
                    // The other side leads this block: let its claim of `i` land first.
                    if (i / BLOCK % 2 == 0) != sender {
                        while ch.load(Counter::Claim) >> 1 <= i {
                            std::hint::spin_loop();
                        }
                    }
                }
                ch.claim(i, sender)
            })
            .collect::<Vec<bool>>()
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| run(&tx, true));
        let b = s.spawn(|| run(&rx, false));
        (a.join().unwrap(), b.join().unwrap())
    });
    for i in 0..N as usize {
        assert!(
            a[i] ^ b[i],
            "message {i}: sender first {}, receiver first {}",
            a[i],
            b[i]
        );
    }
    let firsts = |v: &[bool]| v.iter().filter(|&&f| f).count() as u64;
    assert!(firsts(&a) >= N / BLOCK / 2 && firsts(&b) >= N / BLOCK / 2);
    // The word holds the last first claim: message N − 1's, by whichever side it was.
    let last = (N << 1) | a[N as usize - 1] as u64;
    assert_eq!(tx.load(Counter::Claim), last);
}

/// Late-copy words sit past the taken word in the receive descriptor, each on its own 8 bytes,
/// and survive the descriptor's rewrite (the peer's fields and the words never overlap).
#[test]
fn late_words_sit_past_the_taken_word_and_survive_a_descriptor_rewrite() {
    let ch = eager_only();
    let words = [
        LateWord::Ready,
        LateWord::Done,
        LateWord::SendBytes,
        LateWord::RecvBytes,
        LateWord::Passed,
        LateWord::Copied,
    ];
    for i in [0u64, 5, 63, 64, 130] {
        let offsets: Vec<usize> = words.iter().map(|&w| ch.late_offset(i, w)).collect();
        assert_eq!(offsets[0], ch.recv_taken_offset(i) + 8);
        assert!(offsets.windows(2).all(|w| w[1] == w[0] + 8));
        for (n, &w) in words.iter().enumerate() {
            ch.late_word(i, w).store(1000 + n as u64, Ordering::Relaxed);
        }
        let d = RecvDesc {
            size: 1 << 40,
            handle: None,
            offset: 77,
            span: Span::default(),
            chunks: true,
        };
        ch.write_recv_desc(i, &d);
        assert_eq!(ch.read_recv_desc(i).unwrap(), d);
        for (n, &w) in words.iter().enumerate() {
            assert_eq!(ch.late_word(i, w).load(Ordering::Relaxed), 1000 + n as u64);
        }
    }
}

#[test]
fn spans_overlap_only_where_both_are_known_and_share_a_byte() {
    let s = |base, len| Span { base, len };
    assert!(s(100, 10).overlaps(&s(109, 1)));
    assert!(s(109, 1).overlaps(&s(100, 10)));
    assert!(s(100, 10).overlaps(&s(50, 100)));
    assert!(!s(100, 10).overlaps(&s(110, 10)), "adjacent");
    assert!(!s(110, 10).overlaps(&s(100, 10)), "adjacent");
    assert!(!s(100, 0).overlaps(&s(100, 10)), "unknown");
    assert!(!s(0, 0).overlaps(&s(0, 0)));
    assert!(
        s(u64::MAX - 5, 10).overlaps(&s(u64::MAX - 1, 1)),
        "no wrap at the top"
    );
}
