//! The conformance cases of [`DeviceAdaptor::reduce_async`]: every type the vendor claims,
//! every step, bit for bit against the host reference ([`crate::reduce::reduce_slices`]) over
//! NaNs (with payloads and signs), infinities, signed zeros, denormals, overflow and integer
//! wrap-around; at odd offsets, out of place and in place; and the refusals.

use super::{assert_err, assert_same};
use crate::reduce::{reduce_slices, DataType, ReduceOp, ReduceStep};
use crate::{AdaptorError, DeviceAdaptor, DeviceBuffer, DevicePtr, Stream};

/// Elements per case: past a kernel block and a vector width, and prime.
const COUNT: usize = 4099;

/// Bit patterns worth meeting in every type, as little-endian bytes of one element.
fn specials(t: DataType) -> Vec<Vec<u8>> {
    let w = |v: &[u64]| -> Vec<Vec<u8>> {
        v.iter()
            .map(|x| x.to_le_bytes()[..t.size()].to_vec())
            .collect()
    };
    match t {
        DataType::F32 => w(&[
            0x7FC0_0000, // NaN
            0xFFC0_0001, // NaN, sign and payload
            0x7F80_0001, // signalling NaN
            0x7F80_0000, // +Inf
            0xFF80_0000, // -Inf
            0x0000_0000, // +0
            0x8000_0000, // -0
            0x0000_0001, // smallest denormal
            0x807F_FFFF, // largest negative denormal
            0x7F7F_FFFF, // largest finite
            0x3F80_0000, // 1
        ]),
        DataType::F64 => w(&[
            0x7FF8_0000_0000_0000,
            0xFFF8_0000_0000_0001,
            0x7FF0_0000_0000_0001,
            0x7FF0_0000_0000_0000,
            0xFFF0_0000_0000_0000,
            0,
            0x8000_0000_0000_0000,
            1,
            0x800F_FFFF_FFFF_FFFF,
            0x7FEF_FFFF_FFFF_FFFF,
            0x3FF0_0000_0000_0000,
        ]),
        DataType::F16 => w(&[
            0x7E00, 0xFE01, 0x7C01, 0x7C00, 0xFC00, 0, 0x8000, 1, 0x83FF, 0x7BFF, 0x3C00,
        ]),
        DataType::BF16 => w(&[
            0x7FC0, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0, 0x8000, 1, 0x807F, 0x7F7F, 0x3F80,
        ]),
        // Integers: the extremes (wrap-around both ways), 0, ±1.
        _ => w(&[
            0,
            1,
            u64::MAX,
            1 << (8 * t.size() - 1),
            (1 << (8 * t.size() - 1)) - 1,
        ]),
    }
}

/// `COUNT` elements of `t`: specials at every fifth element, seeded pseudo-random bits
/// elsewhere (which covers every class of float, denormals included).
fn operand(t: DataType, seed: u64) -> Vec<u8> {
    let sp = specials(t);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(COUNT * t.size());
    for i in 0..COUNT {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i % 5 == 0 {
            out.extend_from_slice(&sp[(i / 5 + seed as usize) % sp.len()]);
        } else {
            out.extend_from_slice(&x.to_le_bytes()[..t.size()]);
        }
    }
    out
}

const STEPS: [ReduceStep; 6] = [
    ReduceStep::Combine(ReduceOp::Sum),
    ReduceStep::Combine(ReduceOp::Prod),
    ReduceStep::Combine(ReduceOp::Max),
    ReduceStep::Combine(ReduceOp::Min),
    ReduceStep::Average { n: 3 },
    ReduceStep::Average { n: 200 },
];

/// Every claimed type and step, bit for bit against the host reference, out of place at odd
/// offsets and in place on either input; unclaimed types are `Unsupported`.
pub fn reductions_match_the_host_reference<A: DeviceAdaptor>(a: &A) {
    let claimed = a.capabilities().reduce_types;
    let s = Stream::new(a).expect("stream");
    let bytes = COUNT * 8 + 16;
    if claimed == 0 {
        // Checked below that every type is refused; said here so the run counts it.
        super::report_skip_reason(
            "reductions_match_the_host_reference",
            a.vendor().name(),
            "the vendor has no reduction kernels: every type is Unsupported",
        );
    }
    let (ba, bb, bd) = (
        DeviceBuffer::new(a, bytes).expect("alloc"),
        DeviceBuffer::new(a, bytes).expect("alloc"),
        DeviceBuffer::new(a, bytes).expect("alloc"),
    );
    let at = |b: &DeviceBuffer<A>, off: usize| DevicePtr(b.ptr().0 + off as u64);
    for t in DataType::ALL {
        if claimed & t.bit() == 0 {
            let step = ReduceStep::Combine(ReduceOp::Sum);
            // SAFETY: refused before anything is enqueued.
            let e = assert_err(&format!("reduce {t} (not claimed)"), unsafe {
                a.reduce_async(bd.ptr(), ba.ptr(), bb.ptr(), 1, t, step, s.handle())
            });
            assert!(
                matches!(e, AdaptorError::Unsupported { .. }),
                "reduce {t} (not claimed): {e}"
            );
            continue;
        }
        let n = COUNT * t.size();
        for (k, &step) in STEPS.iter().enumerate() {
            let (x, y) = (operand(t, 2 * k as u64 + 1), operand(t, 2 * k as u64 + 2));
            let mut want = vec![0u8; n];
            reduce_slices(&mut want, &x, &y, t, step);
            let what = format!("{t} {step:?}");
            // Out of place, each operand at its own odd offset.
            let (oa, ob, od) = (1, 3, 5);
            ba.write(oa, &x, &s).expect("write a");
            bb.write(ob, &y, &s).expect("write b");
            // SAFETY: all three ranges lie inside live buffers, disjoint; synchronized by the
            // read below before anything is dropped.
            unsafe {
                a.reduce_async(
                    at(&bd, od),
                    at(&ba, oa),
                    at(&bb, ob),
                    COUNT,
                    t,
                    step,
                    s.handle(),
                )
            }
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let mut got = vec![0u8; n];
            bd.read(od, &mut got, &s).expect("read");
            assert_same(&format!("{what} out of place"), &got, &want);
            // In place on `a`, then on `b`.
            for on_a in [true, false] {
                ba.write(0, &x, &s).expect("write a");
                bb.write(0, &y, &s).expect("write b");
                let dst = if on_a { ba.ptr() } else { bb.ptr() };
                // SAFETY: as above; `dst` equals one input exactly.
                unsafe { a.reduce_async(dst, ba.ptr(), bb.ptr(), COUNT, t, step, s.handle()) }
                    .unwrap_or_else(|e| panic!("{what} in place: {e}"));
                let mut got = vec![0u8; n];
                let b = if on_a { &ba } else { &bb };
                b.read(0, &mut got, &s).expect("read");
                assert_same(&format!("{what} in place on a={on_a}"), &got, &want);
            }
        }
    }
}

/// Refusals: a partial overlap, `Combine(Avg)`, `Average { n: 0 }`, a null operand and a
/// foreign pointer are `InvalidArgument`/typed errors before anything is enqueued; zero
/// elements are accepted and touch nothing.
pub fn reduction_operands_are_checked<A: DeviceAdaptor>(a: &A) {
    let claimed = a.capabilities().reduce_types;
    let Some(t) = DataType::ALL.into_iter().find(|t| claimed & t.bit() != 0) else {
        return; // the Unsupported answers are checked by the case above
    };
    let s = Stream::new(a).expect("stream");
    let b = DeviceBuffer::new(a, 4096).expect("alloc");
    let (p, sum) = (b.ptr(), ReduceStep::Combine(ReduceOp::Sum));
    let h = s.handle();
    let invalid = |what: &str, r: crate::Result<()>| {
        let e = assert_err(what, r);
        assert!(
            matches!(e, AdaptorError::InvalidArgument { .. }),
            "{what}: {e}"
        );
    };
    // SAFETY: every call below is refused before anything is enqueued, or has zero elements.
    unsafe {
        let half = DevicePtr(p.0 + 8);
        invalid(
            "partial overlap of dst and a",
            a.reduce_async(half, p, DevicePtr(p.0 + 2048), 64, t, sum, h),
        );
        invalid(
            "partial overlap of dst and b",
            a.reduce_async(half, DevicePtr(p.0 + 2048), p, 64, t, sum, h),
        );
        let avg = ReduceStep::Combine(ReduceOp::Avg);
        invalid("Combine(Avg)", a.reduce_async(p, p, p, 4, t, avg, h));
        let zero = ReduceStep::Average { n: 0 };
        invalid("Average of 0", a.reduce_async(p, p, p, 4, t, zero, h));
        invalid(
            "a null operand",
            a.reduce_async(p, DevicePtr(0), p, 4, t, sum, h),
        );
        assert_err(
            "a foreign pointer",
            a.reduce_async(p, DevicePtr(0x10), p, 4, t, sum, h),
        );
        a.reduce_async(DevicePtr(0), DevicePtr(0), DevicePtr(0), 0, t, sum, h)
            .expect("zero elements");
    }
    s.synchronize().expect("synchronize");
}

/// Counts past 2^31 (64-bit indexing): `uint8` sum of 2^31 + 5 elements in place, checked at
/// the start, around element 2^31 and at the end. Skipped (counted) where the device has no
/// room for two 2 GiB buffers or the vendor does not reduce `uint8`.
pub fn reductions_past_2_pow_31_elements<A: DeviceAdaptor>(a: &A) {
    const TEST: &str = "reductions_past_2_pow_31_elements";
    let count = (1usize << 31) + 5;
    let vendor = a.vendor().name();
    if a.capabilities().reduce_types & DataType::U8.bit() == 0 {
        super::report_skip_reason(TEST, vendor, "the vendor does not reduce uint8");
        return;
    }
    let props = a.properties(a.device()).ok();
    if props.as_ref().is_some_and(|p| p.pci_bus_id.is_none()) && !a.capabilities().host_addressable
    {
        // PoCL's CPU device: a kernel over 2^31 bytes ran for minutes on the 2-core machine.
        // The host vendor runs the case on the same CPU in seconds; GPUs run it in the bundle.
        super::report_skip_reason(
            TEST,
            vendor,
            "a CPU device behind a GPU-style runtime (no PCI device): 2^31 elements take minutes",
        );
        return;
    }
    let room = props.map_or(0, |p| p.total_memory);
    if room < 3 * count as u64 {
        super::report_skip_reason(TEST, vendor, "less than 6 GiB of device memory");
        return;
    }
    let (x, y) = match (DeviceBuffer::new(a, count), DeviceBuffer::new(a, count)) {
        (Ok(x), Ok(y)) => (x, y),
        (Err(e), _) | (_, Err(e)) => {
            super::report_skip_reason(TEST, vendor, &format!("two 2 GiB buffers: {e}"));
            return;
        }
    };
    let s = Stream::new(a).expect("stream");
    x.fill(1, &s).expect("fill");
    y.fill(2, &s).expect("fill");
    let sum = ReduceStep::Combine(ReduceOp::Sum);
    // SAFETY: both buffers hold `count` bytes and outlive the reads below (which synchronize).
    unsafe {
        a.reduce_async(
            x.ptr(),
            x.ptr(),
            y.ptr(),
            count,
            DataType::U8,
            sum,
            s.handle(),
        )
    }
    .expect("reduce 2^31 + 5 elements");
    for at in [0, (1usize << 31) - 64, count - 64] {
        let mut got = [0u8; 64];
        x.read(at, &mut got, &s).expect("read");
        assert!(
            got.iter().all(|&v| v == 3),
            "elements {at}..{}: {got:?}",
            at + 64
        );
    }
}
