//! Unit tests of the stream worker: inline ops, shared queues.

use super::{inline_max_from, inline_ok, HostStream, Op, SharedQueue, INLINE_SMALL};
use flagcx_adaptor::WaitCondition;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

#[test]
fn copies_run_inline_at_any_size_only_with_fewer_than_two_cores_per_rank() {
    // 2 cores: two or four ranks have no core to spare; one process alone does.
    assert_eq!(inline_max_from(None, 2, 2), usize::MAX);
    assert_eq!(inline_max_from(None, 2, 4), usize::MAX);
    assert_eq!(inline_max_from(None, 2, 1), INLINE_SMALL);
    // 16 cores: up to 8 ranks have two each.
    assert_eq!(inline_max_from(None, 16, 8), INLINE_SMALL);
    assert_eq!(inline_max_from(None, 16, 9), usize::MAX);
    assert_eq!(inline_max_from(None, 3, 2), usize::MAX);
    // The variable wins either way; a value that does not parse is ignored.
    assert_eq!(inline_max_from(Some("1M"), 16, 2), 1 << 20);
    assert_eq!(inline_max_from(Some(" 0 "), 2, 4), 0);
    assert_eq!(inline_max_from(Some("lots"), 2, 4), usize::MAX);
    assert_eq!(inline_max_from(Some("lots"), 16, 2), INLINE_SMALL);
}

#[test]
fn only_copies_and_memsets_within_the_limit_qualify() {
    let copy = |n| Op::Copy { dst: 0, src: 0, n };
    assert!(inline_ok(&copy(4096), 4096));
    assert!(!inline_ok(&copy(4097), 4096));
    assert!(inline_ok(
        &Op::Memset {
            dst: 0,
            value: 0,
            n: 9 << 20
        },
        usize::MAX
    ));
    assert!(!inline_ok(
        &Op::Memset {
            dst: 0,
            value: 0,
            n: 1
        },
        0
    ));
    assert!(!inline_ok(&Op::HostFn(Box::new(|| {})), usize::MAX));
}

#[test]
fn an_inline_copy_is_done_when_push_returns_and_a_queued_one_after_synchronize() {
    let s = HostStream::spawn("flagcx-host-test".into()).expect("a stream");
    let src: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + 3) as u8).collect();
    // Both paths every run, whatever this machine's cores make the default limit.
    for (limit, inline) in [(usize::MAX, true), (0, false)] {
        let mut dst = vec![0u8; src.len()];
        let op = Op::Copy {
            dst: dst.as_mut_ptr() as u64,
            src: src.as_ptr() as u64,
            n: src.len(),
        };
        assert_eq!(inline_ok(&op, limit), inline);
        assert!(s.push_inline_up_to(op, limit));
        if inline {
            // Done on this thread before push returned: the stream has nothing of it.
            assert!(s.idle(), "an inline copy left work on the stream");
            assert!(
                dst == src,
                "the inline copy's bytes differ right after push"
            );
        }
        assert_eq!(s.synchronize(), None);
        assert!(dst == src, "the copy's bytes differ (inline: {inline})");
    }
    s.join(false);
}

/// Stream `a` waits for a word, then stream `b` copies: whether `b`'s copy ran while `a`
/// still waited. Both streams are on `queues` in turn (none: a worker each).
fn copy_runs_beside_a_wait(queues: &[SharedQueue]) -> bool {
    let turn = AtomicU64::new(0);
    let a = HostStream::create("flagcx-host-test-a".into(), queues, &turn).expect("a");
    let b = HostStream::create("flagcx-host-test-b".into(), queues, &turn).expect("b");
    let word = Box::new(AtomicU32::new(0));
    let src = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    assert!(a.push(Op::WaitValue {
        addr: &*word as *const AtomicU32 as u64,
        value: 1,
        wide: false,
        cond: WaitCondition::Geq,
    }));
    assert!(b.push(Op::Copy {
        dst: dst.as_mut_ptr() as u64,
        src: src.as_ptr() as u64,
        n: src.len(),
    }));
    let t0 = std::time::Instant::now();
    // Up to 2 s: a loaded machine may take a while to schedule the copy's worker; where the
    // copy is held (one queue) the wait below runs out, which is the expected outcome.
    while !b.idle() && t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let ran = b.idle();
    assert!(!a.idle(), "the wait passed before its word was written");
    word.store(1, Ordering::Release);
    super::ring_doorbell();
    assert_eq!(a.synchronize(), None);
    assert_eq!(b.synchronize(), None);
    assert!(dst == src, "the copy's bytes differ");
    a.join(false);
    b.join(false);
    ran
}

#[test]
fn streams_sharing_one_queue_run_in_enqueue_order_and_a_wait_holds_the_rest() {
    assert!(copy_runs_beside_a_wait(&[]), "own workers: the copy waited");
    let one = [SharedQueue::spawn("flagcx-host-test-q".into()).expect("a queue")];
    assert!(
        !copy_runs_beside_a_wait(&one),
        "one queue: the copy passed the wait"
    );
    let two = [
        SharedQueue::spawn("flagcx-host-test-q0".into()).expect("a queue"),
        SharedQueue::spawn("flagcx-host-test-q1".into()).expect("a queue"),
    ];
    assert!(copy_runs_beside_a_wait(&two), "two queues: the copy waited");
}
