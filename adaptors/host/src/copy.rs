//! Host-vendor copies: large ones split across a pool of threads, and those larger than the
//! last-level cache can hold written with streaming (non-temporal) stores.
//!
//! Every copy a host-vendor stream runs comes here ([`copy_bytes`]): a transfer between two
//! host ranks, a staged or direct pair's side on this vendor, a collective's own-block copy.
//! A plain `memcpy` of a buffer far larger than the cache first reads every destination line
//! into the cache (to own it) and later writes it back: three memory passes for two. Streaming
//! stores skip that read. On a 2-core EPYC VM with a 32 MiB L3, one thread copied 64 MiB at
//! 8.3 GB/s with `memcpy` and 15.2 with streaming stores, 512 MiB at 11.3 and 17.2 — while an
//! 8 MiB copy, which stays in the cache, ran at 23.7 against 20.4, hence the threshold
//! ([`streaming_min`]).

/// Copies of at least this many bytes are split across threads (below, the fork-join costs
/// more than it saves). On the 16-core H200 host, four host ranks' all-to-all of 1 MiB blocks
/// took 330–528 µs per call copying each block on one thread and 695–997 µs splitting it in 4;
/// a 2 MiB ping-pong took 222 µs split and 454 µs not.
const PAR_MIN: usize = 2 << 20;
/// The smallest piece of a split copy.
const PAR_PIECE: usize = 512 << 10;
/// At most this many pieces: a few cores reach most of a socket's memory bandwidth, and more
/// threads than free cores make every split copy wait for its slowest, preempted piece.
const PAR_MAX: usize = 8;

/// Thread-name prefix of the copy pool (tests tell its threads from leaked ones by it).
pub const COPY_THREAD_PREFIX: &str = "flagcx-copy";

/// The most threads the copy pool starts by default (`FLAGCX_HOST_COPY_THREADS` may ask for
/// more, up to the core count).
pub const COPY_THREADS_DEFAULT_MAX: usize = PAR_MAX;

/// Overrides the copy pool's size ([`copy_threads`]): a whole number, 0 or 1 for none.
pub const COPY_THREADS_ENV: &str = "FLAGCX_HOST_COPY_THREADS";

/// How many threads split a large copy, for `ranks` processes on this machine (1: unknown):
/// `FLAGCX_HOST_COPY_THREADS` if it is a number (at most the core count); else, below 8 cores
/// none, with the ranks known (`flagcx-run` announces them) the cores per rank, at most
/// [`PAR_MAX`], and otherwise a quarter of the cores, at most 4 — the rest belong to the ranks'
/// other threads. Fewer than 2: no pool.
///
/// On the 16-core H200 host, two ranks: 8 threads against 4 took a 32 MiB host ping-pong from
/// 20 to 41.6 GB/s and a CUDA + host all-gather of 1 GiB from 16–17 to 19–25 GB/s bus bandwidth.
fn copy_threads(cores: usize, ranks: usize, env: Option<&str>) -> usize {
    match env.and_then(|v| v.trim().parse::<usize>().ok()) {
        Some(n) => n.min(cores),
        None if cores < 8 => 0,
        None if ranks > 1 => (cores / ranks).min(PAR_MAX),
        None => (cores / 4).min(4),
    }
}

/// The process-wide pool that splits large copies ([`copy_threads`]; none below 8 cores by
/// default), started on the first large copy and kept for the process's life (a fixed cost,
/// not a per-stream one). Its own pool, so it neither waits behind nor oversubscribes the
/// application's rayon work.
fn copy_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let cores = flagcx_adaptor::spin::cores_from_env();
        let threads = copy_threads(
            cores,
            flagcx_adaptor::spin::ranks_from_env(),
            std::env::var(COPY_THREADS_ENV).ok().as_deref(),
        );
        if threads < 2 {
            return None;
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("{COPY_THREAD_PREFIX}-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Copies `n` bytes from `src` to `dst`. Large copies between disjoint ranges are split across
/// the copy pool (one core's memcpy reaches 6–14 GB/s, well below memory bandwidth);
/// overlapping ones run as one `memmove`, as a device copy within one buffer may overlap.
///
/// # Safety
/// Both ranges are valid for `n` bytes for the whole call.
pub(crate) unsafe fn copy_bytes(dst: u64, src: u64, n: usize) {
    // SAFETY: the caller's contract.
    unsafe { copy_on(pool_for(n), dst, src, n, n >= streaming_min()) }
}

/// The copy pool for work of `bytes` bytes: none below [`PAR_MIN`].
fn pool_for(bytes: usize) -> Option<&'static rayon::ThreadPool> {
    if bytes >= PAR_MIN {
        copy_pool()
    } else {
        None
    }
}

/// Runs `piece(first, len)` over `0..units` (units of `unit_bytes` bytes) in disjoint pieces
/// that cover it once, and returns when every piece finished: on `pool` in up to one piece per
/// thread, each at least [`PAR_PIECE`] bytes where the work allows and a multiple of 64 units
/// but the last; on this thread in one piece without a pool or below 128 units.
fn split(
    pool: Option<&rayon::ThreadPool>,
    units: usize,
    unit_bytes: usize,
    piece: impl Fn(usize, usize) + Sync,
) {
    let Some(pool) = pool.filter(|_| units >= 2 * 64) else {
        piece(0, units);
        return;
    };
    let pieces = (units * unit_bytes / PAR_PIECE).clamp(2, pool.current_num_threads().max(2));
    let step = units.div_ceil(pieces).next_multiple_of(64);
    use rayon::prelude::*;
    pool.install(|| {
        (0..pieces).into_par_iter().for_each(|i| {
            let first = i * step;
            if first < units {
                piece(first, step.min(units - first))
            }
        })
    });
}

/// [`copy_bytes`] on a given pool (`None`: one thread), with streaming stores or not (only
/// between disjoint ranges).
///
/// # Safety
/// As for [`copy_bytes`].
unsafe fn copy_on(pool: Option<&rayon::ThreadPool>, dst: u64, src: u64, n: usize, streaming: bool) {
    let disjoint = dst.abs_diff(src) >= n as u64;
    let piece = |off: usize, len: usize| {
        let (d, s) = (
            (dst as usize + off) as *mut u8,
            (src as usize + off) as *const u8,
        );
        if streaming {
            // SAFETY: as below for `copy_nonoverlapping`.
            unsafe { copy_streaming(d, s, len) }
        } else {
            // SAFETY: the callers keep `off + len <= n` on disjoint ranges valid for the call.
            unsafe { std::ptr::copy_nonoverlapping(s, d, len) }
        }
    };
    if !disjoint {
        // SAFETY: the caller's contract; `copy` allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
        return;
    }
    // Each piece lies inside both ranges, the pieces are disjoint, and the ranges do not
    // overlap (checked above); `split` returns only after every piece finished, so the ranges
    // stay valid throughout.
    split(pool, n, 1, piece);
}

/// A reduction step over `count` elements (`dst[i] = a[i] op b[i]`), split across the copy
/// pool from [`PAR_MIN`] bytes as large copies are: one core combines float32 at about a third
/// of what the socket's memory moves (a CUDA + host all-reduce of 128 MiB on the 16-core H100
/// host was bound by the host rank's one-thread combining of 64 MiB, 32 ms).
///
/// # Safety
/// As [`flagcx_adaptor::reduce::reduce_raw`], and `step` is valid (the adaptor checked it).
pub(crate) unsafe fn reduce_split(
    dst: u64,
    a: u64,
    b: u64,
    count: usize,
    dtype: flagcx_adaptor::DataType,
    step: flagcx_adaptor::ReduceStep,
) {
    let pool = pool_for(count.saturating_mul(dtype.size()));
    // SAFETY: the caller's contract.
    unsafe { reduce_on(pool, dst, a, b, count, dtype, step) }
}

/// [`reduce_split`] on a given pool (`None`: this thread).
///
/// # Safety
/// As [`reduce_split`].
unsafe fn reduce_on(
    pool: Option<&rayon::ThreadPool>,
    dst: u64,
    a: u64,
    b: u64,
    count: usize,
    dtype: flagcx_adaptor::DataType,
    step: flagcx_adaptor::ReduceStep,
) {
    let sz = dtype.size();
    // Element `first`'s address in each operand.
    let piece = |first: usize, n: usize| {
        let at = |p: u64| (p as usize + first * sz) as *mut u8;
        // SAFETY: `first + n <= count`, so the piece lies inside each operand; `dst` equals an
        // input or is disjoint from it, and so is each piece from the others' pieces.
        unsafe { flagcx_adaptor::reduce::reduce_raw(at(dst), at(a), at(b), n, dtype, step) }
    };
    // Disjoint pieces, together the whole range; `split` returns only after every piece
    // finished, so the operands stay valid throughout.
    split(pool, count, sz, piece);
}

/// Sets the size from which host-vendor copies use streaming stores: a byte count (`512K`,
/// `16M`, `1G` suffixes allowed; `0`: every copy) or `off`. Unset: below 8 cores 64 KiB, or a
/// thirty-second of the last-level cache where it holds 64 MiB or more; else half the
/// last-level cache (16 MiB where the machine does not report it).
pub const STREAMING_MIN_ENV: &str = "FLAGCX_HOST_COPY_NT_MIN";

/// Copies of at least this many bytes (between disjoint ranges) use streaming stores:
/// `FLAGCX_HOST_COPY_NT_MIN` if it parses; else from 64 KiB below 8 cores (from a thirty-second
/// of a last-level cache of 64 MiB or more: [`SMALL_HOST_LARGE_LLC`]), and from half the
/// last-level cache (16 MiB where the machine does not say) with more — a copy that size
/// moves as much as the cache holds, so its destination would not stay there anyway. Below it
/// a large cache pays off even where a probe of repeated copies says otherwise: on the H200
/// host (16 cores, 300 MiB of L3 reported), 8 threads copied 64 MiB at 50.5 GB/s plain and
/// 63.6 streaming, yet a host ping-pong of 32–64 MiB (whose next copy reads what the last one
/// wrote) ran at 32–57 GB/s plain and 37–43 streaming; at 128–256 MiB streaming won (35–43
/// against 24–38). On the 2-core development VM (32 MiB of L3 reported as shared by both
/// cores) the other process's reads of a plain copy's destination were what cost: host
/// ping-pong round trips of 128 KiB / 512 KiB / 2 MiB / 8 MiB took 24–78 / 71–270 / 164–1054 /
/// 1124–3497 µs plain and 15–16 / 42–43 / 179–190 / 741–816 streaming from 64 KiB, four
/// alternating rounds; four ranks' all-to-all of 4 / 16 MiB 372–390 / 3520–4181 µs against
/// 260–270 / 1950–2013 (below 64 KiB streaming stores lost: 8 and 32 KiB round trips 17–21 and
/// 44–59 µs plain, 21–22 and 57–62 streaming).
fn streaming_min() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| {
        streaming_min_from(
            std::env::var(STREAMING_MIN_ENV).ok().as_deref(),
            last_level_cache(),
            flagcx_adaptor::spin::cores_from_env(),
        )
    })
}

/// [`streaming_min`] for a variable's value, a last-level cache size and a core count.
fn streaming_min_from(env: Option<&str>, llc: Option<usize>, cores: usize) -> usize {
    if let Some(v) = env.map(str::trim) {
        if v.eq_ignore_ascii_case("off") {
            return usize::MAX;
        }
        if let Some(n) = parse_size(v) {
            return n;
        }
    }
    match (cores < 8, llc) {
        (true, Some(c)) if c >= SMALL_HOST_LARGE_LLC => c / 32,
        (true, _) => 64 << 10,
        (false, c) => c.map_or(16 << 20, |c| c / 2),
    }
}

/// From this much last-level cache, a host with fewer than 8 cores keeps plain copies up to a
/// thirty-second of it (15 MiB of a 480 MiB cache) instead of streaming from 64 KiB. Measured
/// on two 2-core VMs: with 32 MiB reported, streaming from 64 KiB won (the figures at
/// [`streaming_min`]); with 480 MiB (2026-12-05, two alternating rounds, µs) host ping-pong
/// round trips of 128 KiB / 512 KiB / 2 MiB / 8 MiB took 26–29 / 59–66 / 293–296 / 1326–1331
/// plain and 45–49 / 144–155 / 468–478 / 1767–1833 streaming (Open MPI in the same sitting
/// 38 / 136 / 425 / 1635), while from 32 MiB streaming won or tied (32 MiB 7138–7428 against
/// 7563–7660 plain), and four ranks' all-to-all of 64 MiB (16 MiB blocks) took 18309–19455
/// streaming against 23068–26601 plain. The boundary lies somewhere between the two caches.
const SMALL_HOST_LARGE_LLC: usize = 64 << 20;

/// A byte count with an optional K/M/G suffix (powers of two).
pub(crate) fn parse_size(v: &str) -> Option<usize> {
    let (num, shift) = match v.as_bytes().last()? {
        b'k' | b'K' => (&v[..v.len() - 1], 10),
        b'm' | b'M' => (&v[..v.len() - 1], 20),
        b'g' | b'G' => (&v[..v.len() - 1], 30),
        _ => (v, 0),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(1 << shift)
}

/// The largest cache CPU 0 reports (Linux sysfs), in bytes.
fn last_level_cache() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("size")).ok())
        .filter_map(|s| parse_size(s.trim()))
        .max()
}

/// Copies `len` bytes from `src` to `dst` with streaming stores: the destination's lines are
/// written to memory without being read into the cache first.
///
/// # Safety
/// `src` is readable and `dst` writable for `len` bytes, and the two ranges do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    const LINE: usize = 64;
    let head = ((dst as usize).wrapping_neg() % LINE).min(len);
    // SAFETY: the first `head <= len` bytes of both ranges (the caller's contract).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut off = head;
    while len - off >= LINE {
        // SAFETY: `off + 64 <= len`, so the four 16-byte loads and stores stay inside the
        // ranges; `dst + off` is 64-byte aligned (the head brought it there), and
        // `_mm_stream_si128` needs 16; the loads need no alignment; SSE2 is part of x86_64.
        unsafe {
            let s = src.add(off).cast::<__m128i>();
            let d = dst.add(off).cast::<__m128i>();
            let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
            let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        off += LINE;
    }
    // SAFETY: the last `len - off` bytes of both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(off), dst.add(off), len - off) };
    // Streaming stores are weakly ordered, even against a later release store: fence them, so
    // that whoever learns of the copy's end (the stream's completion) sees every byte.
    // SAFETY: a fence, no memory access; SSE is part of x86_64.
    unsafe { _mm_sfence() };
}

/// Elsewhere, a plain copy.
///
/// # Safety
/// As above.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

#[cfg(test)]
mod tests {
    /// Split across a pool or on one thread, in place or not, the same bits.
    #[test]
    fn split_reductions_match_one_thread() {
        use flagcx_adaptor::{DataType, ReduceOp, ReduceStep};
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("pool");
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut bytes = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect()
        };
        for (dtype, step) in [
            (DataType::F32, ReduceStep::Combine(ReduceOp::Sum)),
            (DataType::BF16, ReduceStep::Combine(ReduceOp::Max)),
            (DataType::I8, ReduceStep::Combine(ReduceOp::Prod)),
            (DataType::F64, ReduceStep::Average { n: 3 }),
        ] {
            for count in [1usize, 2, 63, 64, 65, 129, 1000, (1 << 20) + 3] {
                let n = count * dtype.size();
                let (a, b) = (bytes(n), bytes(n));
                let (mut one, mut split, mut inplace) = (vec![0u8; n], vec![0u8; n], a.clone());
                let (pa, pb) = (a.as_ptr() as u64, b.as_ptr() as u64);
                let out = |v: &mut Vec<u8>| v.as_mut_ptr() as u64;
                // SAFETY: every buffer holds `count` elements; the outputs are written through
                // their own mutable pointers, and `inplace` is both output and first input.
                unsafe {
                    super::reduce_on(None, out(&mut one), pa, pb, count, dtype, step);
                    super::reduce_on(Some(&pool), out(&mut split), pa, pb, count, dtype, step);
                    let ip = out(&mut inplace);
                    super::reduce_on(Some(&pool), ip, ip, pb, count, dtype, step);
                }
                assert!(one == split, "{dtype} {step:?} {count}: split differs");
                assert!(one == inplace, "{dtype} {step:?} {count}: in place differs");
            }
        }
    }

    use super::{copy_on, copy_threads, streaming_min_from};

    #[test]
    fn copy_threads_follow_the_cores_per_rank_and_obey_the_variable() {
        // Ranks unknown: a quarter of the cores, at most 4.
        assert_eq!(copy_threads(2, 1, None), 0);
        assert_eq!(copy_threads(8, 1, None), 2);
        assert_eq!(copy_threads(16, 1, None), 4);
        assert_eq!(copy_threads(128, 1, None), 4);
        // Ranks known: the cores per rank, at most 8; none below 8 cores.
        assert_eq!(copy_threads(16, 2, None), 8);
        assert_eq!(copy_threads(16, 4, None), 4);
        assert_eq!(copy_threads(16, 8, None), 2);
        assert_eq!(copy_threads(16, 16, None), 1);
        assert_eq!(copy_threads(4, 2, None), 0);
        assert_eq!(copy_threads(128, 8, None), 8);
        // The variable wins, up to the core count.
        assert_eq!(copy_threads(16, 2, Some("8")), 8);
        assert_eq!(copy_threads(16, 2, Some(" 0 ")), 0);
        assert_eq!(copy_threads(4, 2, Some("64")), 4);
        assert_eq!(copy_threads(16, 1, Some("many")), 4);
    }

    /// A pool of its own, so the split path runs even where the machine gets no copy pool.
    fn pool() -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap()
    }

    /// Copies through the split path (the pool) or the one-thread path, with plain stores.
    unsafe fn copy_bytes(dst: u64, src: u64, n: usize) {
        let p = pool();
        // SAFETY: the caller's contract.
        unsafe { copy_on(Some(&p), dst, src, n, false) }
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn split_copies_move_every_byte() {
        // Around the split threshold, uneven piece counts, and a size that is no multiple of 64.
        for n in [0, 1, (256 << 10) - 1, 256 << 10, (3 << 20) + 17, 9 << 20] {
            let src = pattern(n);
            let mut dst = vec![0u8; n];
            // SAFETY: both vectors hold `n` bytes and outlive the call.
            unsafe { copy_bytes(dst.as_mut_ptr() as u64, src.as_ptr() as u64, n) };
            assert!(dst == src, "{n} bytes");
        }
    }

    #[test]
    fn overlapping_copies_behave_like_memmove() {
        let n = 4 << 20;
        let orig = pattern(n + 4096);
        for (from, to) in [(0usize, 4096usize), (4096, 0), (100, 101)] {
            let mut buf = orig.clone();
            let base = buf.as_mut_ptr() as u64;
            // SAFETY: both ranges lie inside `buf` (`n + 4096` bytes).
            unsafe { copy_bytes(base + to as u64, base + from as u64, n) };
            assert!(buf[to..to + n] == orig[from..from + n], "{from} -> {to}");
        }
    }

    #[test]
    fn streaming_copies_move_every_byte_at_any_alignment() {
        let p = pool();
        let len = (3 << 20) + 200;
        let src = pattern(len);
        for (s_off, d_off) in [(0usize, 0usize), (1, 0), (0, 1), (13, 63), (64, 17)] {
            for n in [0usize, 1, 63, 64, 65, 127, 4099, (1 << 20) + 17, 3 << 20] {
                for pool in [None, Some(&p)] {
                    let mut dst = vec![0u8; n + 128];
                    let at = dst.as_mut_ptr() as u64 + d_off as u64;
                    let from = src.as_ptr() as u64 + s_off as u64;
                    // SAFETY: `s_off + n <= len` and `d_off + n <= n + 128`; distinct vectors.
                    unsafe { copy_on(pool, at, from, n, true) };
                    let case = format!(
                        "{n} bytes, src +{s_off}, dst +{d_off}, pool {}",
                        pool.is_some()
                    );
                    assert!(dst[d_off..d_off + n] == src[s_off..s_off + n], "{case}");
                    assert!(dst[..d_off].iter().all(|&b| b == 0), "{case}: wrote before");
                    assert!(
                        dst[d_off + n..].iter().all(|&b| b == 0),
                        "{case}: wrote after"
                    );
                }
            }
        }
    }

    #[test]
    fn streaming_is_never_used_for_an_overlapping_copy() {
        let n = 4 << 20;
        let orig = pattern(n + 64);
        let mut buf = orig.clone();
        let base = buf.as_mut_ptr() as u64;
        // SAFETY: both ranges lie inside `buf`.
        unsafe { copy_on(None, base + 64, base, n, true) };
        assert!(buf[64..64 + n] == orig[..n]);
    }

    #[test]
    fn the_streaming_threshold_follows_cores_and_cache_unless_the_variable_says() {
        assert_eq!(streaming_min_from(None, Some(32 << 20), 16), 16 << 20);
        assert_eq!(streaming_min_from(None, None, 8), 16 << 20);
        assert_eq!(streaming_min_from(None, Some(32 << 20), 2), 64 << 10);
        assert_eq!(streaming_min_from(None, None, 7), 64 << 10);
        // A small host with a large cache keeps plain copies to a thirty-second of it.
        assert_eq!(streaming_min_from(None, Some(480 << 20), 2), 15 << 20);
        assert_eq!(streaming_min_from(None, Some(64 << 20), 7), 2 << 20);
        assert_eq!(streaming_min_from(None, Some(63 << 20), 2), 64 << 10);
        assert_eq!(streaming_min_from(None, Some(480 << 20), 16), 240 << 20);
        assert_eq!(
            streaming_min_from(Some("off"), Some(32 << 20), 2),
            usize::MAX
        );
        assert_eq!(streaming_min_from(Some(" OFF "), None, 16), usize::MAX);
        assert_eq!(streaming_min_from(Some("0"), Some(32 << 20), 16), 0);
        assert_eq!(streaming_min_from(Some("512K"), None, 2), 512 << 10);
        assert_eq!(streaming_min_from(Some("4m"), None, 16), 4 << 20);
        assert_eq!(streaming_min_from(Some("1G"), None, 16), 1 << 30);
        assert_eq!(streaming_min_from(Some("lots"), Some(8 << 20), 16), 4 << 20);
        assert_eq!(streaming_min_from(Some("lots"), Some(8 << 20), 2), 64 << 10);
        assert_eq!(super::parse_size("32768K"), Some(32 << 20));
        assert_eq!(super::parse_size(""), None);
    }
}
