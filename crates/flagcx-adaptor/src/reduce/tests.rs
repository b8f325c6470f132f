//! Unit tests of the host reduction kernels against independent expectations.

// tidy: long file: one test per rule of the reduction contract (wrap-around, NaN, signed zeros, denormals under flushing, rounding ties, averages, aliasing, alignment), each with its own expected bits.
use super::*;

const COMBINE_OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min];
const SUM: ReduceStep = ReduceStep::Combine(ReduceOp::Sum);
const PROD: ReduceStep = ReduceStep::Combine(ReduceOp::Prod);
const MAX: ReduceStep = ReduceStep::Combine(ReduceOp::Max);
const MIN: ReduceStep = ReduceStep::Combine(ReduceOp::Min);

/// Plain values that travel as native-endian bytes.
trait Bytes: Copy {
    fn put(self, out: &mut Vec<u8>);
    fn get(b: &[u8]) -> Self;
}

macro_rules! bytes_impl {
    ($($t:ty),*) => {$(
        impl Bytes for $t {
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_ne_bytes());
            }
            fn get(b: &[u8]) -> Self {
                <$t>::from_ne_bytes(b.try_into().unwrap())
            }
        }
    )*};
}

bytes_impl!(i8, u8, i32, u32, i64, u64, u16);

fn to_bytes<T: Bytes>(v: &[T]) -> Vec<u8> {
    let mut out = Vec::new();
    v.iter().for_each(|x| x.put(&mut out));
    out
}

fn from_bytes<T: Bytes>(b: &[u8]) -> Vec<T> {
    let n = std::mem::size_of::<T>();
    b.chunks_exact(n).map(T::get).collect()
}

/// `a step b` through `reduce_slices`, for values (or float bit patterns) of `dtype`.
fn reduce_typed<T: Bytes>(dtype: DataType, step: ReduceStep, a: &[T], b: &[T]) -> Vec<T> {
    assert_eq!(std::mem::size_of::<T>(), dtype.size());
    let (a, b) = (to_bytes(a), to_bytes(b));
    let mut out = vec![0xA5; a.len()];
    reduce_slices(&mut out, &a, &b, dtype, step);
    from_bytes(&out)
}

// ---------------------------------------------------------------------------------------
// The scalar reference: integers in i128, floats in f64, then rounded as the rules say.

fn canonical_nan_bytes(dtype: DataType) -> Vec<u8> {
    match dtype {
        DataType::F16 => 0x7E00u16.to_ne_bytes().to_vec(),
        DataType::BF16 => 0x7FC0u16.to_ne_bytes().to_vec(),
        DataType::F32 => 0x7FC0_0000u32.to_ne_bytes().to_vec(),
        DataType::F64 => 0x7FF8_0000_0000_0000u64.to_ne_bytes().to_vec(),
        _ => unreachable!(),
    }
}

fn int_decode(dtype: DataType, b: &[u8]) -> i128 {
    match dtype {
        DataType::I8 => i8::get(b).into(),
        DataType::U8 => u8::get(b).into(),
        DataType::I32 => i32::get(b).into(),
        DataType::U32 => u32::get(b).into(),
        DataType::I64 => i64::get(b).into(),
        DataType::U64 => u64::get(b).into(),
        _ => unreachable!(),
    }
}

/// Truncates to the element type (two's complement wrap-around).
fn int_encode(dtype: DataType, v: i128) -> Vec<u8> {
    match dtype {
        DataType::I8 => (v as i8).to_ne_bytes().to_vec(),
        DataType::U8 => (v as u8).to_ne_bytes().to_vec(),
        DataType::I32 => (v as i32).to_ne_bytes().to_vec(),
        DataType::U32 => (v as u32).to_ne_bytes().to_vec(),
        DataType::I64 => (v as i64).to_ne_bytes().to_vec(),
        DataType::U64 => (v as u64).to_ne_bytes().to_vec(),
        _ => unreachable!(),
    }
}

fn float_decode(dtype: DataType, b: &[u8]) -> f64 {
    match dtype {
        DataType::F16 => f16::from_bits(u16::get(b)).to_f64(),
        DataType::BF16 => f64::from(f32::from_bits(u32::from(u16::get(b)) << 16)),
        DataType::F32 => f64::from(f32::from_bits(u32::get(b))),
        DataType::F64 => f64::from_bits(u64::get(b)),
        _ => unreachable!(),
    }
}

/// Round to nearest even by looking at the dropped half (a different formulation from the
/// one under test).
fn ref_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    let (hi, lo) = ((u >> 16) as u16, u & 0xFFFF);
    if lo > 0x8000 || (lo == 0x8000 && hi & 1 == 1) {
        hi + 1
    } else {
        hi
    }
}

/// Rounds an exact (or f64-rounded, which is innocuous here) result to the element type.
fn float_encode(dtype: DataType, v: f64) -> Vec<u8> {
    if v.is_nan() {
        return canonical_nan_bytes(dtype);
    }
    match dtype {
        DataType::F16 => f16::from_f32(v as f32).to_bits().to_ne_bytes().to_vec(),
        DataType::BF16 => ref_bf16(v as f32).to_ne_bytes().to_vec(),
        DataType::F32 => (v as f32).to_bits().to_ne_bytes().to_vec(),
        DataType::F64 => v.to_bits().to_ne_bytes().to_vec(),
        _ => unreachable!(),
    }
}

fn ref_float_scale(dtype: DataType, n: u32) -> f64 {
    let s = 1.0 / f64::from(n);
    match dtype {
        DataType::F16 => f16::from_f64(s).to_f64(),
        DataType::BF16 => f64::from(f32::from_bits(u32::from(ref_bf16(s as f32)) << 16)),
        DataType::F32 => f64::from(s as f32),
        DataType::F64 => s,
        _ => unreachable!(),
    }
}

fn ref_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a == b {
        if a.is_sign_negative() {
            b
        } else {
            a
        }
    } else if a > b {
        a
    } else {
        b
    }
}

fn ref_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a == b {
        if a.is_sign_negative() {
            a
        } else {
            b
        }
    } else if a < b {
        a
    } else {
        b
    }
}

fn reference(dtype: DataType, step: ReduceStep, a: &[u8], b: &[u8]) -> Vec<u8> {
    let size = dtype.size();
    let mut out = Vec::with_capacity(a.len());
    for (i, x) in a.chunks_exact(size).enumerate() {
        let y = b.get(i * size..(i + 1) * size).unwrap_or(x);
        let bytes = if dtype.is_float() {
            let (x, y) = (float_decode(dtype, x), float_decode(dtype, y));
            let v = match step {
                ReduceStep::Combine(ReduceOp::Sum) => x + y,
                ReduceStep::Combine(ReduceOp::Prod) => x * y,
                ReduceStep::Combine(ReduceOp::Max) => ref_max(x, y),
                ReduceStep::Combine(ReduceOp::Min) => ref_min(x, y),
                ReduceStep::Average { n } => x * ref_float_scale(dtype, n),
                ReduceStep::Combine(ReduceOp::Avg) => unreachable!(),
            };
            float_encode(dtype, v)
        } else {
            let (x, y) = (int_decode(dtype, x), int_decode(dtype, y));
            let v = match step {
                ReduceStep::Combine(ReduceOp::Sum) => x + y,
                ReduceStep::Combine(ReduceOp::Prod) => x.wrapping_mul(y),
                ReduceStep::Combine(ReduceOp::Max) => x.max(y),
                ReduceStep::Combine(ReduceOp::Min) => x.min(y),
                ReduceStep::Average { n } => x / i128::from(n),
                ReduceStep::Combine(ReduceOp::Avg) => unreachable!(),
            };
            int_encode(dtype, v)
        };
        out.extend_from_slice(&bytes);
    }
    out
}

// ---------------------------------------------------------------------------------------
// Random-ish inputs.

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 11
    }
}

/// Special bit patterns per float type: ±0, ±Inf, NaNs with sign and payload, signalling
/// NaN, ±smallest subnormal, largest finite, smallest normal, 1.
fn specials(dtype: DataType) -> Vec<u64> {
    match dtype {
        DataType::F16 => vec![
            0, 0x8000, 0x7C00, 0xFC00, 0xFE01, 0x7C01, 1, 0x8001, 0x7BFF, 0x0400, 0x3C00,
        ],
        DataType::BF16 => vec![
            0, 0x8000, 0x7F80, 0xFF80, 0xFFC1, 0x7F81, 1, 0x8001, 0x7F7F, 0x0080, 0x3F80,
        ],
        DataType::F32 => vec![
            0,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0xFFC0_1234,
            0x7F80_0001,
            1,
            0x8000_0001,
            0x7F7F_FFFF,
            0x0080_0000,
            0x3F80_0000,
        ],
        DataType::F64 => vec![
            0,
            1 << 63,
            0x7FF0 << 48,
            0xFFF0 << 48,
            0xFFF8_0000_0000_1234,
            0x7FF0_0000_0000_0001,
            1,
            (1 << 63) | 1,
            0x7FEF_FFFF_FFFF_FFFF,
            0x0010 << 48,
            0x3FF0 << 48,
        ],
        _ => vec![
            0,
            1,
            u64::MAX,
            1 << (dtype.size() * 8 - 1),
            (1 << (dtype.size() * 8 - 1)) - 1,
        ],
    }
}

fn random_bytes(dtype: DataType, count: usize, rng: &mut Lcg) -> Vec<u8> {
    let size = dtype.size();
    let specials = specials(dtype);
    let mut out = Vec::with_capacity(count * size);
    for _ in 0..count {
        let r = rng.next();
        let bits = match r % 8 {
            0 => specials[(r >> 3) as usize % specials.len()],
            1 | 2 => rng.next() ^ (rng.next() << 32),
            // Moderate magnitudes, so that sums and products round often.
            _ if dtype.is_float() => {
                let v = ((rng.next() % (1 << 20)) as f64 - (1 << 19) as f64) / 65536.0;
                u64::from_ne_bytes({
                    let mut b = [0; 8];
                    let e = match dtype {
                        DataType::F16 => f16::from_f64(v).to_bits().to_ne_bytes().to_vec(),
                        DataType::BF16 => ((v as f32).to_bits() >> 16).to_ne_bytes()[..2].to_vec(),
                        DataType::F32 => (v as f32).to_bits().to_ne_bytes().to_vec(),
                        _ => v.to_bits().to_ne_bytes().to_vec(),
                    };
                    b[..e.len()].copy_from_slice(&e);
                    b
                })
            }
            _ => (rng.next() % 512).wrapping_sub(256),
        };
        let bytes = bits.to_ne_bytes();
        if cfg!(target_endian = "little") {
            out.extend_from_slice(&bytes[..size]);
        } else {
            out.extend_from_slice(&bytes[8 - size..]);
        }
    }
    out
}

fn all_steps() -> Vec<ReduceStep> {
    let mut steps: Vec<ReduceStep> = COMBINE_OPS
        .iter()
        .map(|&op| ReduceStep::Combine(op))
        .collect();
    steps.extend([1, 2, 3, 7, 1000, u32::MAX].map(|n| ReduceStep::Average { n }));
    steps
}

fn assert_same(dtype: DataType, step: ReduceStep, a: &[u8], b: &[u8], got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len());
    let size = dtype.size();
    if let Some(i) =
        (0..got.len() / size).find(|i| got[i * size..][..size] != want[i * size..][..size])
    {
        let e = |s: &[u8]| s.get(i * size..(i + 1) * size).map(<[u8]>::to_vec);
        panic!(
            "{dtype} {step:?} element {i}: a {:02x?} b {:02x?} got {:02x?} want {:02x?}",
            e(a),
            e(b),
            e(got),
            e(want)
        );
    }
}

// ---------------------------------------------------------------------------------------
// Types and steps.

#[test]
fn data_type_numbering_names_and_sizes() {
    for (i, t) in DataType::ALL.iter().enumerate() {
        assert_eq!(*t as usize, i);
        assert_eq!(DataType::from_flagcx(i as i32), Some(*t));
        assert_eq!(t.bit(), 1 << i);
        assert_eq!(t.to_string(), t.name());
    }
    assert_eq!(DataType::from_flagcx(-1), None);
    assert_eq!(DataType::from_flagcx(10), None);
    let names: Vec<_> = DataType::ALL.iter().map(|t| t.name()).collect();
    assert_eq!(
        names,
        [
            "int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64",
            "bfloat16"
        ]
    );
    let sizes: Vec<_> = DataType::ALL.iter().map(|t| t.size()).collect();
    assert_eq!(sizes, [1, 1, 4, 4, 8, 8, 2, 4, 8, 2]);
    let floats: Vec<_> = DataType::ALL.iter().filter(|t| t.is_float()).collect();
    assert_eq!(
        floats,
        [
            &DataType::F16,
            &DataType::F32,
            &DataType::F64,
            &DataType::BF16
        ]
    );
}

#[test]
fn reduce_op_numbering_and_names() {
    for (i, op) in ReduceOp::ALL.iter().enumerate() {
        assert_eq!(*op as usize, i);
        assert_eq!(ReduceOp::from_flagcx(i as i32), Some(*op));
        assert_eq!(op.to_string(), op.name());
    }
    assert_eq!(ReduceOp::from_flagcx(5), None);
    assert_eq!(ReduceOp::from_flagcx(-1), None);
    let names: Vec<_> = ReduceOp::ALL.iter().map(|op| op.name()).collect();
    assert_eq!(names, ["sum", "prod", "max", "min", "avg"]);
}

#[test]
fn step_check_refuses_combine_avg_and_average_of_zero() {
    assert!(ReduceStep::Combine(ReduceOp::Avg).check().is_err());
    assert!(ReduceStep::Average { n: 0 }.check().is_err());
    assert!(ReduceStep::Average { n: 1 }.check().is_ok());
    for op in COMBINE_OPS {
        assert!(ReduceStep::Combine(op).check().is_ok());
    }
}

#[test]
fn an_average_sums_then_divides_once_and_other_ops_finish_as_they_combine() {
    assert_eq!(
        ReduceStep::combining(ReduceOp::Avg),
        ReduceStep::Combine(ReduceOp::Sum)
    );
    assert_eq!(
        ReduceStep::finishing(ReduceOp::Avg, 3),
        Some(ReduceStep::Average { n: 3 })
    );
    for op in COMBINE_OPS {
        assert_eq!(ReduceStep::combining(op), ReduceStep::Combine(op));
        assert_eq!(ReduceStep::finishing(op, 3), None);
        assert!(ReduceStep::combining(op).check().is_ok());
    }
}

#[test]
#[should_panic(expected = "Combine(Avg)")]
fn reduce_panics_on_combine_avg() {
    reduce_typed(
        DataType::I32,
        ReduceStep::Combine(ReduceOp::Avg),
        &[1i32],
        &[2],
    );
}

#[test]
#[should_panic(expected = "differ in length")]
fn reduce_slices_panics_on_length_mismatch() {
    reduce_slices(&mut [0; 4], &[0; 4], &[0; 8], DataType::F32, SUM);
}

// ---------------------------------------------------------------------------------------
// Integers.

#[test]
fn integers_wrap_around() {
    assert_eq!(
        reduce_typed(DataType::I8, SUM, &[127i8, -128], &[1, -1]),
        [-128, 127]
    );
    assert_eq!(
        reduce_typed(DataType::I8, PROD, &[-128i8, 16], &[-1, 16]),
        [-128, 0]
    );
    assert_eq!(
        reduce_typed(DataType::U8, PROD, &[200u8, 16], &[2, 17]),
        [144, 16]
    );
    assert_eq!(reduce_typed(DataType::U8, SUM, &[255u8], &[1]), [0]);
    assert_eq!(
        reduce_typed(DataType::I32, SUM, &[i32::MAX], &[1]),
        [i32::MIN]
    );
    assert_eq!(
        reduce_typed(DataType::U32, PROD, &[u32::MAX], &[2]),
        [u32::MAX - 1]
    );
    assert_eq!(
        reduce_typed(DataType::I64, SUM, &[i64::MIN], &[-1]),
        [i64::MAX]
    );
    assert_eq!(
        reduce_typed(DataType::I64, PROD, &[i64::MIN], &[-1]),
        [i64::MIN]
    );
    assert_eq!(
        reduce_typed(DataType::U64, PROD, &[u64::MAX], &[u64::MAX]),
        [1]
    );
    assert_eq!(reduce_typed(DataType::U64, SUM, &[u64::MAX], &[2]), [1]);
}

#[test]
fn integer_max_min_respect_signedness() {
    assert_eq!(
        reduce_typed(DataType::I8, MAX, &[-1i8, -128], &[1, 127]),
        [1, 127]
    );
    assert_eq!(
        reduce_typed(DataType::I8, MIN, &[-1i8, -128], &[1, 127]),
        [-1, -128]
    );
    assert_eq!(
        reduce_typed(DataType::U8, MAX, &[255u8, 0], &[1, 0]),
        [255, 0]
    );
    assert_eq!(reduce_typed(DataType::U32, MIN, &[u32::MAX], &[7]), [7]);
    assert_eq!(
        reduce_typed(DataType::I64, MAX, &[i64::MIN], &[i64::MAX]),
        [i64::MAX]
    );
    assert_eq!(
        reduce_typed(DataType::U64, MAX, &[1u64 << 63], &[1]),
        [1 << 63]
    );
}

#[test]
fn integer_average_truncates_toward_zero() {
    let a = [-100i8, -7, 7, 127, -128];
    let z = [0i8; 5];
    let avg = |n| ReduceStep::Average { n };
    assert_eq!(reduce_typed(DataType::I8, avg(200), &a, &z), [0; 5]);
    assert_eq!(
        reduce_typed(DataType::I8, avg(2), &a, &z),
        [-50, -3, 3, 63, -64]
    );
    assert_eq!(reduce_typed(DataType::I8, avg(1), &a, &z), a);
    assert_eq!(
        reduce_typed(DataType::U8, avg(2), &[255u8, 7], &[0; 2]),
        [127, 3]
    );
    assert_eq!(reduce_typed(DataType::U8, avg(300), &[255u8], &[0]), [0]);
    assert_eq!(
        reduce_typed(DataType::I32, avg(2), &[-7i32, i32::MIN], &[0; 2]),
        [-3, -(1 << 30)]
    );
    assert_eq!(
        reduce_typed(DataType::U32, avg(u32::MAX), &[u32::MAX, 5], &[0; 2]),
        [1, 0]
    );
    assert_eq!(
        reduce_typed(DataType::I64, avg(3), &[i64::MIN, -7, i64::MAX], &[0; 3]),
        [-3074457345618258602, -2, 3074457345618258602]
    );
    assert_eq!(
        reduce_typed(DataType::U64, avg(2), &[u64::MAX], &[0]),
        [u64::MAX >> 1]
    );
    assert_eq!(
        reduce_typed(DataType::U64, avg(u32::MAX), &[u64::MAX], &[0]),
        [(1 << 32) + 1]
    );
}

// ---------------------------------------------------------------------------------------
// float32 and float64.

const F32_ONE: u32 = 0x3F80_0000;
const F32_INF: u32 = 0x7F80_0000;

#[test]
fn f32_nan_propagates_as_the_canonical_nan() {
    // A negative NaN with payload, a signalling NaN, in either position.
    let a = [
        0xFFC0_1234u32,
        F32_ONE,
        0x7F80_0001,
        F32_ONE,
        F32_INF,
        0xFFC0_0000,
    ];
    let b = [
        F32_ONE,
        0xFFC0_1234,
        F32_ONE,
        0xFF80_0001,
        0x7FC0_0000,
        0xFF80_0000,
    ];
    for step in [SUM, PROD, MAX, MIN, ReduceStep::Average { n: 3 }] {
        let got = reduce_typed(DataType::F32, step, &a, &b);
        let want = if step == (ReduceStep::Average { n: 3 }) {
            // Average reads only `a`.
            vec![
                0x7FC0_0000,
                0x3EAA_AAAB,
                0x7FC0_0000,
                0x3EAA_AAAB,
                F32_INF,
                0x7FC0_0000,
            ]
        } else {
            vec![0x7FC0_0000; 6]
        };
        assert_eq!(got, want, "{step:?}");
    }
}

#[test]
fn f64_nan_propagates_as_the_canonical_nan() {
    let nan = 0x7FF8_0000_0000_0000u64;
    let one = 1.0f64.to_bits();
    let a = [0xFFF8_0000_0000_1234u64, one, 0x7FF0_0000_0000_0001];
    let b = [one, 0xFFF0_0000_0000_0002, one];
    for step in [SUM, PROD, MAX, MIN] {
        assert_eq!(
            reduce_typed(DataType::F64, step, &a, &b),
            [nan; 3],
            "{step:?}"
        );
    }
}

#[test]
fn max_min_of_signed_zeros() {
    let (p, n) = (0u32, 0x8000_0000u32);
    assert_eq!(
        reduce_typed(DataType::F32, MAX, &[n, p, n, p], &[p, n, n, p]),
        [p, p, n, p]
    );
    assert_eq!(
        reduce_typed(DataType::F32, MIN, &[n, p, n, p], &[p, n, n, p]),
        [n, n, n, p]
    );
    let (p, n) = (0u64, 1u64 << 63);
    assert_eq!(reduce_typed(DataType::F64, MAX, &[n, p], &[p, n]), [p, p]);
    assert_eq!(reduce_typed(DataType::F64, MIN, &[n, p], &[p, n]), [n, n]);
    for t in [DataType::F16, DataType::BF16] {
        let (p, n) = (0u16, 0x8000u16);
        assert_eq!(reduce_typed(t, MAX, &[n, p], &[p, n]), [p, p], "{t}");
        assert_eq!(reduce_typed(t, MIN, &[n, p], &[p, n]), [n, n], "{t}");
    }
}

#[test]
fn f32_infinities() {
    let (inf, ninf, nan) = (F32_INF, 0xFF80_0000u32, 0x7FC0_0000u32);
    assert_eq!(
        reduce_typed(
            DataType::F32,
            SUM,
            &[inf, inf, ninf],
            &[ninf, F32_ONE, ninf]
        ),
        [nan, inf, ninf]
    );
    assert_eq!(
        reduce_typed(DataType::F32, PROD, &[inf, ninf], &[0, ninf]),
        [nan, inf]
    );
    assert_eq!(
        reduce_typed(DataType::F32, MAX, &[ninf, inf, inf], &[F32_ONE, ninf, nan]),
        [F32_ONE, inf, nan]
    );
    assert_eq!(
        reduce_typed(
            DataType::F32,
            MIN,
            &[ninf, inf, 0x7FC0_0001],
            &[F32_ONE, ninf, ninf]
        ),
        [ninf, ninf, nan]
    );
}

#[test]
fn float_overflow_gives_infinity() {
    let max = f32::MAX.to_bits();
    let nmax = (-f32::MAX).to_bits();
    assert_eq!(
        reduce_typed(DataType::F32, SUM, &[max, nmax], &[max, nmax]),
        [F32_INF, 0xFF80_0000]
    );
    assert_eq!(
        reduce_typed(DataType::F32, PROD, &[max], &[0x4000_0000]),
        [F32_INF]
    );
    let max = f64::MAX.to_bits();
    assert_eq!(
        reduce_typed(DataType::F64, SUM, &[max], &[max]),
        [f64::INFINITY.to_bits()]
    );
    // float16: 65504 + 65504, and 65504 + 16 = 65520, the tie between 65504 (odd) and Inf.
    assert_eq!(
        reduce_typed(
            DataType::F16,
            SUM,
            &[0x7BFFu16, 0x7BFF, 0x7BFF],
            &[0x7BFF, 0x4C00, 0x4BFF]
        ),
        [0x7C00, 0x7C00, 0x7BFF]
    );
}

#[test]
fn denormals_are_kept() {
    // Smallest subnormals: doubled, and subtracted to zero.
    assert_eq!(
        reduce_typed(DataType::F32, SUM, &[1u32, 0x8000_0001], &[1, 1]),
        [2, 0]
    );
    assert_eq!(reduce_typed(DataType::F32, MAX, &[1u32], &[0]), [1]);
    assert_eq!(reduce_typed(DataType::F64, SUM, &[1u64], &[1]), [2]);
    assert_eq!(
        reduce_typed(DataType::F16, SUM, &[1u16, 0x03FF], &[1, 1]),
        [2, 0x0400]
    );
    assert_eq!(reduce_typed(DataType::BF16, SUM, &[1u16], &[1]), [2]);
    // Normal times small gives a subnormal.
    let half_min = (f32::MIN_POSITIVE / 2.0).to_bits();
    assert_eq!(
        reduce_typed(
            DataType::F32,
            PROD,
            &[f32::MIN_POSITIVE.to_bits()],
            &[0x3F00_0000]
        ),
        [half_min]
    );
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[test]
fn denormals_are_kept_under_flush_to_zero() {
    let before = fpenv::read();
    fpenv::write(before | fpenv::FLUSH_BITS);
    let tiny = std::hint::black_box(f32::from_bits(1));
    let flushed = (tiny + tiny).to_bits();
    let f32_out = reduce_typed(DataType::F32, SUM, &[1u32], &[1]);
    let f16_out = reduce_typed(DataType::F16, SUM, &[1u16], &[1]);
    let bf16_out = reduce_typed(DataType::BF16, SUM, &[1u16], &[1]);
    let f64_out = reduce_typed(DataType::F64, SUM, &[1u64], &[1]);
    let during = fpenv::read();
    fpenv::write(before);
    assert_eq!(
        flushed, 0,
        "the flags did not flush: the test proves nothing"
    );
    assert_eq!(
        during,
        before | fpenv::FLUSH_BITS,
        "the guard did not restore the flags"
    );
    assert_eq!(
        (f32_out, f16_out, bf16_out, f64_out),
        (vec![2], vec![2], vec![2], vec![2])
    );
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[test]
fn denormal_guard_clears_and_restores() {
    let before = fpenv::read();
    fpenv::write(before | fpenv::FLUSH_BITS);
    let inside = {
        let _guard = DenormalGuard::new();
        fpenv::read()
    };
    let after = fpenv::read();
    fpenv::write(before);
    assert_eq!(inside & fpenv::FLUSH_BITS, 0);
    assert_eq!(inside, (before | fpenv::FLUSH_BITS) & !fpenv::FLUSH_BITS);
    assert_eq!(after, before | fpenv::FLUSH_BITS);
    // With the flags clear already, the guard changes nothing.
    let clear = fpenv::read();
    drop(DenormalGuard::default());
    assert_eq!(fpenv::read(), clear);
}

// ---------------------------------------------------------------------------------------
// float16 and bfloat16 rounding.

#[test]
fn f16_rounds_half_to_even() {
    // 1 + 2^-11 is the tie between 1 (even) and 1 + 2^-10; (1 + 2^-10) + 2^-11 the tie
    // between 0x3C01 and 0x3C02 (even); just above a tie rounds up.
    let got = reduce_typed(
        DataType::F16,
        SUM,
        &[0x3C00u16, 0x3C01, 0x3C00],
        &[0x1000, 0x1000, 0x1001],
    );
    assert_eq!(got, [0x3C00, 0x3C02, 0x3C01]);
    // NaNs of any sign and payload come out as 0x7E00.
    let got = reduce_typed(
        DataType::F16,
        MAX,
        &[0xFE01u16, 0x3C00, 0x7C01],
        &[0x3C00, 0xFC01, 0x3C00],
    );
    assert_eq!(got, [0x7E00; 3]);
    assert_eq!(
        reduce_typed(DataType::F16, SUM, &[0x7C00u16], &[0xFC00]),
        [0x7E00]
    );
}

#[test]
fn bf16_rounds_half_to_even_and_overflows_to_infinity() {
    // 1 + 2^-8 is the tie between 1 (0x3F80, even) and 0x3F81; 0x3F81 + 2^-8 rounds to 0x3F82.
    let got = reduce_typed(
        DataType::BF16,
        SUM,
        &[0x3F80u16, 0x3F81, 0x3F80],
        &[0x3B80, 0x3B80, 0x3B81],
    );
    assert_eq!(got, [0x3F80, 0x3F82, 0x3F81]);
    let got = reduce_typed(
        DataType::BF16,
        SUM,
        &[0x7F7Fu16, 0xFF7F, 0x7F7F],
        &[0x7F7F, 0xFF7F, 0x7380],
    );
    assert_eq!(got, [0x7F80, 0xFF80, 0x7F7F]);
    let got = reduce_typed(
        DataType::BF16,
        MIN,
        &[0xFFC1u16, 0x3F80, 0x7F80],
        &[0x3F80, 0x7F81, 0xFF80],
    );
    assert_eq!(got, [0x7FC0, 0x7FC0, 0xFF80]);
}

// ---------------------------------------------------------------------------------------
// Average, every type.

#[test]
fn float_average_multiplies_by_the_rounded_reciprocal() {
    let avg3 = ReduceStep::Average { n: 3 };
    // 3 * 0x3EAAAAAB = 1.0000000298 -> 1.0.
    let got = reduce_typed(DataType::F32, avg3, &[0x4040_0000u32, F32_ONE, 0], &[0; 3]);
    assert_eq!(got, [F32_ONE, 0x3EAA_AAAB, 0]);
    let got = reduce_typed(
        DataType::F64,
        avg3,
        &[3.0f64.to_bits(), 1.0f64.to_bits()],
        &[0; 2],
    );
    assert_eq!(got, [1.0f64.to_bits(), 0x3FD5_5555_5555_5555]);
    // float16: s = 0x3555; 3 * s = 1 - 2^-12, the tie between 0x3BFF and 0x3C00 (even).
    assert_eq!(
        reduce_typed(DataType::F16, avg3, &[0x4200u16, 0x3C00], &[0; 2]),
        [0x3C00, 0x3555]
    );
    // bfloat16: s = 0x3EAB (0x3EAAAAAB rounded up); 3 * s = 1 + 2^-9 -> 1.
    assert_eq!(
        reduce_typed(DataType::BF16, avg3, &[0x4040u16, 0x3F80], &[0; 2]),
        [0x3F80, 0x3EAB]
    );
    // n = 1 is the identity but for NaN; a huge n underflows float16's scale to 0.
    let one = ReduceStep::Average { n: 1 };
    assert_eq!(
        reduce_typed(DataType::F32, one, &[0x0000_0001u32, 0xFFC0_0001], &[0; 2]),
        [1, 0x7FC0_0000]
    );
    let big = ReduceStep::Average { n: u32::MAX };
    assert_eq!(reduce_typed(DataType::F16, big, &[0x7BFFu16], &[0]), [0]);
    // Average ignores `b` entirely, which may then be empty.
    let mut out = [0u8; 4];
    reduce_slices(
        &mut out,
        &2.0f32.to_ne_bytes(),
        &[],
        DataType::F32,
        ReduceStep::Average { n: 2 },
    );
    assert_eq!(f32::from_ne_bytes(out), 1.0);
}

#[test]
fn average_every_type_matches_reference() {
    let mut rng = Lcg(7);
    for dtype in DataType::ALL {
        for n in [1, 2, 3, 5, 8, 200, 1000, 65537, u32::MAX] {
            let step = ReduceStep::Average { n };
            let a = random_bytes(dtype, 3000, &mut rng);
            let mut out = vec![0; a.len()];
            reduce_slices(&mut out, &a, &[], dtype, step);
            assert_same(dtype, step, &a, &[], &out, &reference(dtype, step, &a, &[]));
        }
    }
}

// ---------------------------------------------------------------------------------------
// Whole buffers: the scalar reference, aliasing, alignment, counts.

#[test]
fn all_types_and_steps_match_scalar_reference() {
    let mut rng = Lcg(0x5EED);
    for dtype in DataType::ALL {
        for step in all_steps() {
            let a = random_bytes(dtype, 4099, &mut rng);
            let b = random_bytes(dtype, 4099, &mut rng);
            let mut out = vec![0; a.len()];
            reduce_slices(&mut out, &a, &b, dtype, step);
            assert_same(dtype, step, &a, &b, &out, &reference(dtype, step, &a, &b));
        }
    }
}

#[test]
fn counts_across_block_edges() {
    let mut rng = Lcg(42);
    for dtype in DataType::ALL {
        for step in [SUM, MAX, MIN, ReduceStep::Average { n: 3 }] {
            for count in [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 4099] {
                let a = random_bytes(dtype, count, &mut rng);
                let b = random_bytes(dtype, count, &mut rng);
                let mut out = vec![0; a.len()];
                reduce_slices(&mut out, &a, &b, dtype, step);
                assert_same(dtype, step, &a, &b, &out, &reference(dtype, step, &a, &b));
            }
        }
    }
}

#[test]
fn count_zero_touches_nothing() {
    let dangling = std::ptr::NonNull::<u64>::dangling().as_ptr().cast::<u8>();
    for dtype in DataType::ALL {
        // SAFETY: with count 0 nothing is read or written.
        unsafe { reduce_raw(dangling, dangling, dangling, 0, dtype, SUM) };
    }
}

#[test]
fn dst_may_alias_either_input() {
    let mut rng = Lcg(99);
    for dtype in DataType::ALL {
        for step in [SUM, PROD, MAX, MIN, ReduceStep::Average { n: 3 }] {
            let count = 4099;
            let a = random_bytes(dtype, count, &mut rng);
            let b = random_bytes(dtype, count, &mut rng);
            let want = reference(dtype, step, &a, &b);

            let (mut buf, other) = (a.clone(), b.clone());
            let p = buf.as_mut_ptr();
            // SAFETY: both buffers hold `count` elements; dst is exactly `a`.
            unsafe { reduce_raw(p, p, other.as_ptr(), count, dtype, step) };
            assert_same(dtype, step, &a, &b, &buf, &want);

            if matches!(step, ReduceStep::Combine(_)) {
                let (mut buf, other) = (b.clone(), a.clone());
                let p = buf.as_mut_ptr();
                // SAFETY: both buffers hold `count` elements; dst is exactly `b`.
                unsafe { reduce_raw(p, other.as_ptr(), p, count, dtype, step) };
                assert_same(dtype, step, &a, &b, &buf, &want);
            }
        }
    }
}

#[test]
fn unaligned_pointers() {
    let mut rng = Lcg(1234);
    for dtype in DataType::ALL {
        for step in [SUM, MIN, ReduceStep::Average { n: 7 }] {
            let count = BLOCK + 1;
            let a = random_bytes(dtype, count, &mut rng);
            let b = random_bytes(dtype, count, &mut rng);
            let want = reference(dtype, step, &a, &b);
            let bytes = a.len();
            let (mut sa, mut sb, mut sd) = (
                vec![0u8; bytes + 8],
                vec![0u8; bytes + 8],
                vec![0xEEu8; bytes + 8],
            );
            sa[1..=bytes].copy_from_slice(&a);
            sb[3..3 + bytes].copy_from_slice(&b);
            // SAFETY: each buffer holds `bytes` bytes from its offset on.
            unsafe {
                reduce_raw(
                    sd.as_mut_ptr().add(5),
                    sa.as_ptr().add(1),
                    sb.as_ptr().add(3),
                    count,
                    dtype,
                    step,
                )
            };
            assert_same(dtype, step, &a, &b, &sd[5..5 + bytes], &want);
            assert!(
                sd[..5].iter().chain(&sd[5 + bytes..]).all(|&x| x == 0xEE),
                "wrote outside dst"
            );
        }
    }
}
