//! The conformance case of [`DeviceAdaptor::stream_slot_steps`]: small messages through slots
//! in registered host memory, as stream-ordered pairs use it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{assert_err, assert_same, filled, SharedMapping};
use crate::{DeviceAdaptor, DeviceBuffer, DevicePtr, SlotInbox, SlotStep, Stream};

/// Slots of 8 KiB after one page of words.
const SLOT: usize = 8192;
const SLOTS: usize = 3;

/// A take enqueued before its message waits for it, and a put for its free-slot word, both
/// released later from other streams or the host; several puts, then several takes, of odd
/// sizes at odd offsets per call; a message longer than its take's capacity moves nothing and
/// leaves the buffer as it was (and still writes its done word); takes that name an inbox get
/// their message whether the put wrote the inbox or only the slot; a misaligned word is
/// refused. Vendors without 64-bit stream
/// memory operations, sized copies or host registration say `Unsupported`.
pub fn slot_steps_move_messages<A: DeviceAdaptor>(a: &A) {
    let caps = a.capabilities();
    let map = SharedMapping::new(4096 + SLOTS * SLOT);
    let s = Stream::new(a).expect("stream");
    let s2 = Stream::new(a).expect("stream");
    let dst = DeviceBuffer::new(a, SLOTS * SLOT + 64).expect("alloc");
    let src = DeviceBuffer::new(a, SLOTS * SLOT + 64).expect("alloc");
    if !(caps.stream_mem_ops_64 && caps.sized_copy && caps.host_register) {
        let take = SlotStep::Take {
            wait: (src.ptr(), 1),
            slot: src.ptr(),
            len_at: src.ptr(),
            dst: dst.ptr(),
            cap: 8,
            inbox: None,
            done: None,
        };
        // SAFETY: refused before anything is enqueued (every address is device memory).
        let e = assert_err("stream_slot_steps", unsafe {
            a.stream_slot_steps(s.handle(), &[take])
        });
        assert!(e.is_unsupported(), "{e}");
        return;
    }
    // SAFETY: `map` outlives the unregister at the end.
    let base = unsafe { a.host_register(map.ptr, map.len) }.expect("host_register");
    let at = |off: usize| DevicePtr(base.0 + off as u64);
    // Per slot: its status word, size word, free-slot word and done word.
    let word = |slot: usize, w: usize| 64 * slot + 8 * w;
    let host_word = |off: usize| {
        // SAFETY: an aligned word of the live mapping.
        unsafe { &*(map.ptr.add(off) as *const AtomicU64) }
    };
    let slot_off = |i: usize| 4096 + i * SLOT;
    let data = filled(SLOTS * SLOT + 64, 57);
    src.write(0, &data, &s).expect("write");
    let put_to =
        |i: usize, soff: usize, n: usize, wait: Option<u64>, status: u64, inbox| SlotStep::Put {
            wait: wait.map(|min| (at(word(i, 2)), min)),
            src: DevicePtr(src.ptr().0 + soff as u64),
            len: n,
            slot_host: {
                // SAFETY: slot `i` lies within the mapping.
                unsafe { map.ptr.add(slot_off(i)) }
            },
            slot: at(slot_off(i)),
            writes: [(at(word(i, 1)), n as u64), (at(word(i, 0)), status)],
            inbox,
        };
    let put = |i, soff, n, wait, status| put_to(i, soff, n, wait, status, None);
    let take_from = |i: usize, doff: usize, cap: usize, status: u64, inbox| SlotStep::Take {
        wait: (at(word(i, 0)), status),
        slot: at(slot_off(i)),
        len_at: at(word(i, 1)),
        dst: DevicePtr(dst.ptr().0 + doff as u64),
        cap,
        inbox,
        // What a taker completes on: one more than the status it waited for.
        done: Some((at(word(i, 3)), status + 1)),
    };
    let take = |i, doff, cap, status| take_from(i, doff, cap, status, None);
    let read = |s: &Stream<A>| {
        let mut got = vec![0u8; SLOTS * SLOT + 64];
        dst.read(0, &mut got, s).expect("read");
        got
    };

    // 1. The take first; then a put whose free-slot word the host writes last.
    dst.fill(0xEE, &s).expect("fill");
    s.synchronize().expect("sync");
    // SAFETY: every address is in the registered mapping or the live buffers, all
    // synchronized before they go; the take's capacity and the put's length fit the slot.
    unsafe { a.stream_slot_steps(s.handle(), &[take(0, 3, SLOT - 16, 0x100)]) }.expect("take");
    std::thread::sleep(Duration::from_millis(2));
    assert!(!s.query().expect("query"), "a take ran before its message");
    // SAFETY: as above.
    unsafe { a.stream_slot_steps(s2.handle(), &[put(0, 5, 4109, Some(7), 0x100)]) }.expect("put");
    std::thread::sleep(Duration::from_millis(2));
    assert!(
        !s2.query().expect("query"),
        "a put ran before its slot was free"
    );
    assert_eq!(
        host_word(word(0, 0)).load(Ordering::Acquire),
        0,
        "status early"
    );
    assert_eq!(
        host_word(word(0, 3)).load(Ordering::Acquire),
        0,
        "a take wrote its done word before its message came"
    );
    host_word(word(0, 2)).store(7, Ordering::Release);
    s2.synchronize().expect("sync");
    s.synchronize().expect("sync");
    assert_eq!(
        host_word(word(0, 1)).load(Ordering::Acquire),
        4109,
        "size word"
    );
    assert_eq!(
        host_word(word(0, 0)).load(Ordering::Acquire),
        0x100,
        "status word"
    );
    let mut want = vec![0xEEu8; SLOTS * SLOT + 64];
    want[3..3 + 4109].copy_from_slice(&data[5..5 + 4109]);
    assert_same("a take released by its put", &read(&s), &want);
    assert_eq!(
        host_word(word(0, 3)).load(Ordering::Acquire),
        0x101,
        "done word"
    );

    // 2. Three puts in one call, three takes in another: words, a ragged tail, bytes only;
    // the third message is longer than its take's capacity.
    dst.fill(0x11, &s).expect("fill");
    s.synchronize().expect("sync");
    let (status, sizes) = (
        0x200,
        [(0usize, 0usize, SLOT), (16, 4096, 777), (1, 9000, 1000)],
    );
    let takes: Vec<SlotStep> = sizes
        .iter()
        .enumerate()
        .map(|(i, &(doff, _, n))| take(i, i * SLOT + doff, if i == 2 { n - 1 } else { n }, status))
        .collect();
    // SAFETY: as above.
    unsafe { a.stream_slot_steps(s.handle(), &takes) }.expect("takes");
    let puts: Vec<SlotStep> = sizes
        .iter()
        .enumerate()
        .map(|(i, &(_, soff, n))| put(i, soff, n, None, status))
        .collect();
    // SAFETY: as above.
    unsafe { a.stream_slot_steps(s2.handle(), &puts) }.expect("puts");
    s2.synchronize().expect("sync");
    s.synchronize().expect("sync");
    let mut want = vec![0x11u8; SLOTS * SLOT + 64];
    for (i, &(doff, soff, n)) in sizes.iter().enumerate().take(2) {
        want[i * SLOT + doff..i * SLOT + doff + n].copy_from_slice(&data[soff..soff + n]);
    }
    assert_same(
        "three messages, the last too long for its take",
        &read(&s),
        &want,
    );
    for i in 0..SLOTS {
        assert_eq!(
            host_word(word(i, 3)).load(Ordering::Acquire),
            0x201,
            "done word of take {i} (the last one copied nothing)"
        );
    }

    // 3. With inboxes in device memory (slot `i`'s words at 64 i, its copy at 4096 + i SLOT):
    // a put and a take that both name it; then a take that names it released by a put that
    // does not (steps in order never write an inbox), through the slot's status word.
    let inboxes = DeviceBuffer::new(a, 4096 + SLOTS * SLOT).expect("alloc");
    inboxes.fill(0, &s).expect("fill");
    let inbox = |i: usize| {
        let at = |off: usize| DevicePtr(inboxes.ptr().0 + off as u64);
        Some(SlotInbox {
            slot: at(4096 + i * SLOT),
            len_at: at(64 * i + 8),
            status: at(64 * i),
        })
    };
    dst.fill(0x22, &s).expect("fill");
    s.synchronize().expect("sync");
    let (n0, n1) = (4109usize, 777usize);
    // SAFETY: as above; the inboxes are live device memory, synchronized below.
    unsafe {
        a.stream_slot_steps(s.handle(), &[take_from(0, 0, n0, 0x300, inbox(0))])
            .expect("take");
        a.stream_slot_steps(s2.handle(), &[put_to(0, 5, n0, None, 0x300, inbox(0))])
            .expect("put");
        a.stream_slot_steps(s.handle(), &[take_from(1, SLOT, n1, 0x300, inbox(1))])
            .expect("take");
        crate::slot_steps_in_order(a, s2.handle(), &[put_to(1, 9, n1, None, 0x300, inbox(1))])
            .expect("put in order");
    }
    s2.synchronize().expect("sync");
    s.synchronize().expect("sync");
    let mut want = vec![0x22u8; SLOTS * SLOT + 64];
    want[..n0].copy_from_slice(&data[5..5 + n0]);
    want[SLOT..SLOT + n1].copy_from_slice(&data[9..9 + n1]);
    assert_same("messages with inboxes", &read(&s), &want);

    // 4. A misaligned word is refused.
    let mut bad = take(0, 0, 8, 1);
    if let SlotStep::Take { len_at, .. } = &mut bad {
        len_at.0 += 4;
    }
    // SAFETY: refused before anything is enqueued.
    assert_err("misaligned length word", unsafe {
        a.stream_slot_steps(s.handle(), &[bad])
    });
    // A null done word is refused too (its wait is already met, so a vendor that finds out
    // only at the write leaves nothing waiting).
    let mut null_done = take(0, 0, 8, 0x100);
    if let SlotStep::Take { done, .. } = &mut null_done {
        *done = Some((DevicePtr::NULL, 1));
    }
    // SAFETY: as above; the wait is met (slot 0's status is 0x300 since step 3), and its
    // message is longer than the take's 8 bytes: nothing is copied.
    assert_err("null done word", unsafe {
        a.stream_slot_steps(s.handle(), &[null_done])
    });
    s.synchronize().expect("sync");
    s2.synchronize().expect("sync");
    // SAFETY: nothing runs on the mapping any more.
    unsafe { a.host_unregister(map.ptr) }.expect("host_unregister");
}
