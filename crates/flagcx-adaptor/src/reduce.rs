//! Element-wise reduction on the host: the bit-exact rules every vendor's reduction follows.
//!
//! A reduction collective is a chain of [`ReduceStep`]s, each `dst[i] = a[i] op b[i]` over
//! `count` elements of one [`DataType`]; an average is Sum steps followed by one
//! [`ReduceStep::Average`]. The host vendor runs [`reduce_raw`] on its stream threads; the GPU
//! vendors implement the same rules in their own kernels, so results agree bit for bit:
//! - integers: Sum and Prod wrap around, Average divides truncating toward zero (in `i64` or
//!   `u64`, so `n` need not fit the element type);
//! - floats: plain IEEE operations rounded to nearest even (no FMA); Max/Min propagate NaN and
//!   order `-0 < +0`; every NaN result is written as one canonical quiet NaN with the sign clear
//!   (`f32` `0x7FC0_0000`, `f64` `0x7FF8_0000_0000_0000`, `f16` `0x7E00`, `bf16` `0x7FC0`);
//!   denormals are kept (hence [`DenormalGuard`]);
//! - `float16` and `bfloat16` are widened exactly to `f32`, combined in `f32` and rounded once.
//!
//! The kernels run in blocks of [`BLOCK`] elements copied into local aligned arrays, so any
//! alignment and `dst == a` or `dst == b` are handled alike, and the inner loops are plain
//! element-wise loops the compiler vectorizes.

// tidy: long file: the bit-exact rules every vendor's reduction follows, with the host's kernels for every type, kept in one place for vendor authors to read beside their own.

use std::fmt;
use std::marker::PhantomData;
use std::ptr;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Element types, numbered as FlagCX's `flagcxDataType_t`: Int8=0, Uint8=1, Int32=2, Uint32=3,
/// Int64=4, Uint64=5, Float16=6, Float32=7, Float64=8, Bfloat16=9.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    /// `int8` (`flagcxInt8`, 0).
    I8 = 0,
    /// `uint8` (`flagcxUint8`, 1).
    U8 = 1,
    /// `int32` (`flagcxInt32`, 2).
    I32 = 2,
    /// `uint32` (`flagcxUint32`, 3).
    U32 = 3,
    /// `int64` (`flagcxInt64`, 4).
    I64 = 4,
    /// `uint64` (`flagcxUint64`, 5).
    U64 = 5,
    /// IEEE 754 binary16 (`flagcxFloat16`, 6).
    F16 = 6,
    /// IEEE 754 binary32 (`flagcxFloat32`, 7).
    F32 = 7,
    /// IEEE 754 binary64 (`flagcxFloat64`, 8).
    F64 = 8,
    /// bfloat16, the upper half of a binary32 (`flagcxBfloat16`, 9).
    BF16 = 9,
}

impl DataType {
    /// Every element type, in FlagCX order.
    pub const ALL: [DataType; 10] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::F32,
        DataType::F64,
        DataType::BF16,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 => 1,
            DataType::F16 | DataType::BF16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// Whether this is a floating-point type (`float16`, `float32`, `float64`, `bfloat16`).
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16 | DataType::F32 | DataType::F64 | DataType::BF16
        )
    }

    /// The type numbered `v` in `flagcxDataType_t`, or `None` for an unknown number.
    pub fn from_flagcx(v: i32) -> Option<DataType> {
        usize::try_from(v)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
    }

    /// The lower-case name: `"int8"`, `"uint8"`, `"int32"`, `"uint32"`, `"int64"`, `"uint64"`,
    /// `"float16"`, `"float32"`, `"float64"`, `"bfloat16"`.
    pub const fn name(self) -> &'static str {
        match self {
            DataType::I8 => "int8",
            DataType::U8 => "uint8",
            DataType::I32 => "int32",
            DataType::U32 => "uint32",
            DataType::I64 => "int64",
            DataType::U64 => "uint64",
            DataType::F16 => "float16",
            DataType::F32 => "float32",
            DataType::F64 => "float64",
            DataType::BF16 => "bfloat16",
        }
    }

    /// `1 << (self as u16)`: this type's bit in a capability mask.
    pub const fn bit(self) -> u16 {
        1 << (self as u16)
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction operators, numbered as FlagCX's `flagcxRedOp_t`: Sum=0, Prod=1, Max=2, Min=3,
/// Avg=4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum (`flagcxSum`, 0); wraps around for integers.
    Sum = 0,
    /// Product (`flagcxProd`, 1); wraps around for integers.
    Prod = 1,
    /// Maximum (`flagcxMax`, 2); NaN if either input is NaN, `max(-0, +0) = +0`.
    Max = 2,
    /// Minimum (`flagcxMin`, 3); NaN if either input is NaN, `min(-0, +0) = -0`.
    Min = 3,
    /// Average (`flagcxAvg`, 4): Sum steps followed by one [`ReduceStep::Average`].
    Avg = 4,
}

impl ReduceOp {
    /// Every operator, in FlagCX order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// The operator numbered `v` in `flagcxRedOp_t`, or `None` for an unknown number.
    pub fn from_flagcx(v: i32) -> Option<ReduceOp> {
        usize::try_from(v)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
    }

    /// The lower-case name: `"sum"`, `"prod"`, `"max"`, `"min"`, `"avg"`.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One step a stream runs: `dst[i] = a[i] op b[i]`, or the averaging step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceStep {
    /// Combines two inputs with Sum, Prod, Max or Min (never Avg: an average is Sum steps
    /// followed by one Average step).
    Combine(ReduceOp),
    /// `dst[i] = a[i] / n` for integer types (the wrapping sum is already done; the division
    /// truncates toward zero), and `dst[i] = a[i] * s` for floating types, where `s = 1/n`
    /// computed in `f64` and rounded (to nearest even) to the element type; for float16 and
    /// bfloat16, `a[i]` and `s` are widened to `f32`, multiplied in `f32` and the product rounded
    /// once. (For bfloat16, `s` is the `f32` value of `1/n` rounded to bfloat16.) `b` is not
    /// read. `n >= 1`.
    Average {
        /// The number of contributions summed (the rank count), at least 1.
        n: u32,
    },
}

impl ReduceStep {
    /// The step that combines two contributions for `op`: an average sums, and divides once
    /// at the end ([`ReduceStep::finishing`]).
    pub fn combining(op: ReduceOp) -> ReduceStep {
        ReduceStep::Combine(match op {
            ReduceOp::Avg => ReduceOp::Sum,
            op => op,
        })
    }

    /// The step that ends a reduction of `n` contributions for `op`, applied once to the
    /// combined value: [`ReduceStep::Average`] for an average, none otherwise.
    pub fn finishing(op: ReduceOp, n: usize) -> Option<ReduceStep> {
        (op == ReduceOp::Avg).then_some(ReduceStep::Average { n: n as u32 })
    }

    /// `Err` with a reason for `Combine(ReduceOp::Avg)` and `Average { n: 0 }`, else `Ok`.
    pub fn check(self) -> Result<(), String> {
        match self {
            ReduceStep::Combine(ReduceOp::Avg) => Err(
                "Combine(Avg) is not a step: an average is Sum steps followed by one Average step"
                    .to_string(),
            ),
            ReduceStep::Average { n: 0 } => Err("Average needs n >= 1".to_string()),
            _ => Ok(()),
        }
    }
}

/// The scale of [`ReduceStep::Average`] for floating types: `1/n` rounded to the element
/// type, widened exactly to `f64` (for float16 and bfloat16 the `f32` value they are multiplied
/// by). Device kernels take it from here, so every vendor multiplies by the same number. `None`
/// for integer types (they divide) and `n == 0`.
pub fn average_scale(dtype: DataType, n: u32) -> Option<f64> {
    if n == 0 {
        return None;
    }
    match dtype {
        DataType::F64 => Some(<f64 as Lane>::scale(n)),
        DataType::F32 => Some(f64::from(<f32 as Lane>::scale(n))),
        DataType::F16 => Some(f64::from(<f16 as Half16>::scale(n))),
        DataType::BF16 => Some(f64::from(<bf16 as Half16>::scale(n))),
        _ => None,
    }
}

/// Every [`DataType`]'s bit: a [`crate::Capabilities::reduce_types`] mask for a vendor that
/// reduces all of them.
pub const ALL_TYPES: u16 = (1 << DataType::ALL.len()) - 1;

/// The checks every vendor's [`crate::DeviceAdaptor::reduce_async`] makes before it enqueues:
/// a valid step, a type in `supported` (a [`crate::Capabilities::reduce_types`] mask), a byte
/// count that fits, non-null operands and `dst` equal to or disjoint from each input. Returns
/// the bytes each operand spans (0: nothing to do, no pointer touched).
#[allow(clippy::too_many_arguments)]
pub fn check_operands(
    vendor: crate::Vendor,
    supported: u16,
    dst: crate::DevicePtr,
    a: crate::DevicePtr,
    b: crate::DevicePtr,
    count: usize,
    dtype: DataType,
    step: ReduceStep,
) -> crate::Result<usize> {
    const OP: &str = "reduce_async";
    step.check()
        .map_err(|e| crate::AdaptorError::invalid(OP, e))?;
    if supported & dtype.bit() == 0 {
        return Err(crate::AdaptorError::Unsupported { vendor, op: OP });
    }
    let bytes = count
        .checked_mul(dtype.size())
        .ok_or_else(|| crate::AdaptorError::invalid(OP, format!("{count} {dtype} overflow")))?;
    if bytes == 0 {
        return Ok(0);
    }
    let combine = matches!(step, ReduceStep::Combine(_));
    // No allocation: this check runs on every step of every reduction.
    let both = [("a", a), ("b", b)];
    let inputs = &both[..if combine { 2 } else { 1 }];
    if dst.is_null() || inputs.iter().any(|(_, p)| p.is_null()) {
        return Err(crate::AdaptorError::invalid(OP, "null operand"));
    }
    for &(name, p) in inputs {
        let disjoint =
            dst.0.saturating_add(bytes as u64) <= p.0 || p.0.saturating_add(bytes as u64) <= dst.0;
        if dst != p && !disjoint {
            return Err(crate::AdaptorError::invalid(
                OP,
                format!("dst {dst} partially overlaps {name} {p} ({bytes} bytes each)"),
            ));
        }
    }
    Ok(bytes)
}

/// Elements per block: the kernels copy this many elements of each input into local arrays.
pub const BLOCK: usize = 1024;

/// Runs `step` over `count` elements: `dst[i] = a[i] op b[i]`.
///
/// With `count == 0` no pointer is touched. For floating types the call holds a
/// [`DenormalGuard`], so denormals are kept whatever this thread's flush-to-zero state.
///
/// # Safety
/// `a` and `b` (`b` only for [`ReduceStep::Combine`]) are readable and `dst` writable for
/// `count * dtype.size()` bytes; any alignment; `dst` may be exactly equal to `a` or `b` (same
/// address), but must not partially overlap them.
///
/// # Panics
/// If `step.check()` fails.
pub unsafe fn reduce_raw(
    dst: *mut u8,
    a: *const u8,
    b: *const u8,
    count: usize,
    dtype: DataType,
    step: ReduceStep,
) {
    if let Err(why) = step.check() {
        panic!("reduce_raw: {why}");
    }
    if count == 0 {
        return;
    }
    let b = match step {
        ReduceStep::Combine(_) => Some(b),
        ReduceStep::Average { .. } => None,
    };
    let _guard = dtype.is_float().then(DenormalGuard::new);
    // SAFETY: the caller's contract for `reduce_raw` is exactly the one `run` needs.
    unsafe {
        match dtype {
            DataType::I8 => run::<i8>(dst, a, b, count, step),
            DataType::U8 => run::<u8>(dst, a, b, count, step),
            DataType::I32 => run::<i32>(dst, a, b, count, step),
            DataType::U32 => run::<u32>(dst, a, b, count, step),
            DataType::I64 => run::<i64>(dst, a, b, count, step),
            DataType::U64 => run::<u64>(dst, a, b, count, step),
            DataType::F16 => run::<f16>(dst, a, b, count, step),
            DataType::F32 => run::<f32>(dst, a, b, count, step),
            DataType::F64 => run::<f64>(dst, a, b, count, step),
            DataType::BF16 => run::<bf16>(dst, a, b, count, step),
        }
    }
}

/// Safe wrapper for tests and references: `out = a op b` over byte slices.
///
/// # Panics
/// Unless `out` and `a` have the same length, a multiple of `dtype.size()`, and `b` too for
/// [`ReduceStep::Combine`] (an Average step ignores `b`, which may then be empty); or if
/// `step.check()` fails. It is a test helper.
pub fn reduce_slices(out: &mut [u8], a: &[u8], b: &[u8], dtype: DataType, step: ReduceStep) {
    assert_eq!(
        out.len(),
        a.len(),
        "reduce_slices: out and a differ in length"
    );
    if matches!(step, ReduceStep::Combine(_)) {
        assert_eq!(a.len(), b.len(), "reduce_slices: a and b differ in length");
    }
    assert_eq!(
        a.len() % dtype.size(),
        0,
        "reduce_slices: length is not a multiple of {dtype}"
    );
    // SAFETY: the slices are valid for their lengths (checked equal above, `b` only where it is
    // read), and `out` is a unique borrow, so it overlaps neither input.
    unsafe {
        reduce_raw(
            out.as_mut_ptr(),
            a.as_ptr(),
            b.as_ptr(),
            a.len() / dtype.size(),
            dtype,
            step,
        )
    }
}

/// Runs `step` for element type `E` (the step is valid and `count > 0`).
///
/// # Safety
/// As [`reduce_raw`], with `b` `Some` exactly for Combine steps.
unsafe fn run<E: Element>(
    dst: *mut u8,
    a: *const u8,
    b: Option<*const u8>,
    count: usize,
    step: ReduceStep,
) {
    let mut s = E::scratch();
    let s = &mut s;
    macro_rules! combine {
        ($f:ident) => {
            // SAFETY: forwarded from the caller.
            unsafe { blocks::<E>(dst, a, b, count, |x, y| E::combine(s, x, y, E::Lane::$f)) }
        };
    }
    match step {
        ReduceStep::Combine(ReduceOp::Sum) => combine!(add),
        ReduceStep::Combine(ReduceOp::Prod) => combine!(mul),
        ReduceStep::Combine(ReduceOp::Max) => combine!(max),
        ReduceStep::Combine(ReduceOp::Min) => combine!(min),
        ReduceStep::Combine(ReduceOp::Avg) => unreachable!("checked by reduce_raw"),
        ReduceStep::Average { n } => {
            let scale = E::avg_scale(n);
            // SAFETY: forwarded from the caller.
            unsafe { blocks::<E>(dst, a, None, count, |x, _| E::map(s, x, |v| v.avg(scale))) }
        }
    }
}

/// The block loop: copies up to [`BLOCK`] elements of `a` (and `b`) into local arrays, runs
/// `kernel(a_block, b_block)` (which leaves the result in `a_block`), and copies the result out.
///
/// # Safety
/// `a` and `b` (if `Some`) readable and `dst` writable for `count * size_of::<E>()` bytes, any
/// alignment; `dst` equal to or disjoint from each input. `E` is valid for any bit pattern.
#[inline(always)]
unsafe fn blocks<E: Copy + Default>(
    dst: *mut u8,
    a: *const u8,
    b: Option<*const u8>,
    count: usize,
    kernel: impl FnMut(&mut [E], &[E]),
) {
    // A small reduction (a small all-reduce's one step) gets small local arrays: initializing
    // two full blocks was a tenth of an 8-byte all-reduce's time on two host ranks.
    // SAFETY: the caller's contract, passed on.
    unsafe {
        if count <= SMALL_BLOCK {
            blocks_of::<E, SMALL_BLOCK>(dst, a, b, count, kernel)
        } else {
            blocks_of::<E, BLOCK>(dst, a, b, count, kernel)
        }
    }
}

/// Elements per block of a reduction that fits one small block.
const SMALL_BLOCK: usize = 64;

/// [`blocks`] with local arrays of `N` elements.
///
/// # Safety
/// As [`blocks`].
#[inline(always)]
unsafe fn blocks_of<E: Copy + Default, const N: usize>(
    dst: *mut u8,
    a: *const u8,
    b: Option<*const u8>,
    count: usize,
    mut kernel: impl FnMut(&mut [E], &[E]),
) {
    let size = std::mem::size_of::<E>();
    let mut xa = [E::default(); N];
    let mut xb = [E::default(); N];
    let mut done = 0;
    while done < count {
        let n = N.min(count - done);
        let (off, bytes) = (done * size, n * size);
        // SAFETY: `off + bytes <= count * size`, inside the caller's ranges; the locals are
        // `N * size >= bytes` long and distinct from caller memory; `E` accepts any bits.
        unsafe { ptr::copy_nonoverlapping(a.add(off), xa.as_mut_ptr().cast::<u8>(), bytes) };
        if let Some(b) = b {
            // SAFETY: as for `a`.
            unsafe { ptr::copy_nonoverlapping(b.add(off), xb.as_mut_ptr().cast::<u8>(), bytes) };
        }
        kernel(&mut xa[..n], &xb[..n]);
        // SAFETY: as above; this block of `a` and `b` was read before `dst` is written, and
        // `dst` only equals or misses the inputs, so no later block's input is clobbered.
        unsafe { ptr::copy_nonoverlapping(xa.as_ptr().cast::<u8>(), dst.add(off), bytes) };
        done += n;
    }
}

/// The type arithmetic happens in: the integer types, `f32` and `f64`.
trait Lane: Copy + Default {
    /// What an Average step multiplies or divides by.
    type Scale: Copy;
    /// The Average parameter for `n` when this is also the storage type.
    fn scale(n: u32) -> Self::Scale;
    fn add(self, b: Self) -> Self;
    fn mul(self, b: Self) -> Self;
    fn max(self, b: Self) -> Self;
    fn min(self, b: Self) -> Self;
    fn avg(self, s: Self::Scale) -> Self;
}

macro_rules! int_lane {
    ($($t:ty => $scale:ty),* $(,)?) => {$(
        impl Lane for $t {
            type Scale = $scale;
            #[inline(always)]
            fn scale(n: u32) -> $scale {
                <$scale>::from(n)
            }
            #[inline(always)]
            fn add(self, b: Self) -> Self {
                self.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(self, b: Self) -> Self {
                self.wrapping_mul(b)
            }
            #[inline(always)]
            fn max(self, b: Self) -> Self {
                if self > b { self } else { b }
            }
            #[inline(always)]
            fn min(self, b: Self) -> Self {
                if self < b { self } else { b }
            }
            #[inline(always)]
            fn avg(self, n: $scale) -> Self {
                // `n >= 1`, so the quotient lies between 0 and `self`: it fits `Self`, and the
                // cast truncates toward zero (for `f64`, see below).
                (<$scale>::from(self) / n) as $t
            }
        }
    )*};
}

// 64-bit integers divide as `i64`/`u64`. Narrower ones divide in `f64`, which vectorizes and is
// exact after truncation: with `|x| < 2^53` and `1 <= n < 2^32` both are exact, and the rounded
// quotient is off by at most `|x| / n * 2^-53 < 1 / n`, while a non-integer `x / n` lies at
// least `1 / n` from every integer, so truncation sees the same integer part as `i64` division.
int_lane!(i8 => f64, u8 => f64, i32 => f64, u32 => f64, i64 => i64, u64 => u64);

macro_rules! float_lane {
    ($($t:ident: $nan:expr),* $(,)?) => {$(
        impl Lane for $t {
            type Scale = $t;
            #[inline(always)]
            fn scale(n: u32) -> $t {
                (1.0f64 / f64::from(n)) as $t
            }
            #[inline(always)]
            fn add(self, b: Self) -> Self {
                canonical_nan!($t, $nan, self + b)
            }
            #[inline(always)]
            fn mul(self, b: Self) -> Self {
                canonical_nan!($t, $nan, self * b)
            }
            #[inline(always)]
            fn max(self, b: Self) -> Self {
                // Equal values (also -0 and +0): the one with the sign bit clear.
                let r = if self > b {
                    self
                } else if b > self {
                    b
                } else {
                    $t::from_bits(self.to_bits() & b.to_bits())
                };
                if self.is_nan() | b.is_nan() { $t::from_bits($nan) } else { r }
            }
            #[inline(always)]
            fn min(self, b: Self) -> Self {
                // Equal values (also -0 and +0): the one with the sign bit set.
                let r = if self < b {
                    self
                } else if b < self {
                    b
                } else {
                    $t::from_bits(self.to_bits() | b.to_bits())
                };
                if self.is_nan() | b.is_nan() { $t::from_bits($nan) } else { r }
            }
            #[inline(always)]
            fn avg(self, s: $t) -> Self {
                canonical_nan!($t, $nan, self * s)
            }
        }
    )*};
}

/// `$x`, with any NaN replaced by the canonical one.
macro_rules! canonical_nan {
    ($t:ident, $nan:expr, $x:expr) => {{
        let x: $t = $x;
        if x.is_nan() {
            $t::from_bits($nan)
        } else {
            x
        }
    }};
}

float_lane!(f32: F32_NAN, f64: F64_NAN);

const F32_NAN: u32 = 0x7FC0_0000;
const F64_NAN: u64 = 0x7FF8_0000_0000_0000;
const F16_NAN: u16 = 0x7E00;
const BF16_NAN: u16 = 0x7FC0;

/// A storage type: how a block of elements is computed (directly, or widened to `f32`).
trait Element: Copy + Default {
    type Lane: Lane;
    /// Local arrays a block needs besides the two input blocks.
    type Scratch;
    fn scratch() -> Self::Scratch;
    /// The Average parameter for `n`, rounded as this storage type requires.
    fn avg_scale(n: u32) -> <Self::Lane as Lane>::Scale;
    /// `x[i] = f(x[i], y[i])`; the slices have equal length, at most [`BLOCK`].
    fn combine<F: Fn(Self::Lane, Self::Lane) -> Self::Lane>(
        s: &mut Self::Scratch,
        x: &mut [Self],
        y: &[Self],
        f: F,
    );
    /// `x[i] = f(x[i])`; at most [`BLOCK`] elements.
    fn map<F: Fn(Self::Lane) -> Self::Lane>(s: &mut Self::Scratch, x: &mut [Self], f: F);
}

macro_rules! native_element {
    ($($t:ty),* $(,)?) => {$(
        impl Element for $t {
            type Lane = $t;
            type Scratch = ();
            fn scratch() {}
            fn avg_scale(n: u32) -> <$t as Lane>::Scale {
                <$t as Lane>::scale(n)
            }
            #[inline(always)]
            fn combine<F: Fn($t, $t) -> $t>(_: &mut (), x: &mut [$t], y: &[$t], f: F) {
                for (p, q) in x.iter_mut().zip(y) {
                    *p = f(*p, *q);
                }
            }
            #[inline(always)]
            fn map<F: Fn($t) -> $t>(_: &mut (), x: &mut [$t], f: F) {
                for p in x.iter_mut() {
                    *p = f(*p);
                }
            }
        }
    )*};
}

native_element!(i8, u8, i32, u32, i64, u64, f32, f64);

/// A 16-bit float stored as bits and computed in `f32`.
trait Half16: Copy + Default {
    /// Exact widening of `src` into `dst` (equal lengths).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Rounds `src` to nearest even into `dst` (equal lengths), NaN as the canonical NaN.
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// `1/n` in `f64`, rounded to this type, as `f32`.
    fn scale(n: u32) -> f32;
}

impl Half16 for f16 {
    #[inline(always)]
    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
        for h in dst.iter_mut() {
            // Any NaN (the f32 lanes are canonical already) becomes the canonical f16 NaN.
            if h.to_bits() & 0x7FFF > 0x7C00 {
                *h = f16::from_bits(F16_NAN);
            }
        }
    }
    fn scale(n: u32) -> f32 {
        f16::from_f64(1.0 / f64::from(n)).to_f32()
    }
}

/// Rounds `x` to the nearest bfloat16, ties to even; any NaN becomes `0x7FC0`.
#[inline(always)]
fn f32_to_bf16_bits(x: f32) -> u16 {
    if x.is_nan() {
        BF16_NAN
    } else {
        let u = x.to_bits();
        // No overflow: the largest non-NaN `u` is 0xFF80_0000 (-Inf).
        ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) as u16
    }
}

impl Half16 for bf16 {
    #[inline(always)]
    fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [bf16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(f32_to_bf16_bits(*s));
        }
    }
    fn scale(n: u32) -> f32 {
        let s = (1.0f64 / f64::from(n)) as f32;
        f32::from_bits(u32::from(f32_to_bf16_bits(s)) << 16)
    }
}

impl<H: Half16> Element for H {
    type Lane = f32;
    type Scratch = ([f32; BLOCK], [f32; BLOCK]);
    fn scratch() -> Self::Scratch {
        ([0.0; BLOCK], [0.0; BLOCK])
    }
    fn avg_scale(n: u32) -> f32 {
        H::scale(n)
    }
    #[inline(always)]
    fn combine<F: Fn(f32, f32) -> f32>(s: &mut Self::Scratch, x: &mut [H], y: &[H], f: F) {
        let (wx, wy) = (&mut s.0[..x.len()], &mut s.1[..y.len()]);
        H::widen(x, wx);
        H::widen(y, wy);
        for (p, q) in wx.iter_mut().zip(wy.iter()) {
            *p = f(*p, *q);
        }
        H::narrow(wx, x);
    }
    #[inline(always)]
    fn map<F: Fn(f32) -> f32>(s: &mut Self::Scratch, x: &mut [H], f: F) {
        let wx = &mut s.0[..x.len()];
        H::widen(x, wx);
        for p in wx.iter_mut() {
            *p = f(*p);
        }
        H::narrow(wx, x);
    }
}

/// The floating-point control register of this CPU: its type, the flush-to-zero and
/// denormals-are-zero bits, and access.
#[cfg(target_arch = "x86_64")]
mod fpenv {
    /// MXCSR.
    pub(super) type State = u32;
    /// MXCSR FTZ (bit 15) and DAZ (bit 6).
    pub(super) const FLUSH_BITS: State = (1 << 15) | (1 << 6);

    pub(super) fn read() -> State {
        let mut v: State = 0;
        // SAFETY: `stmxcsr` stores the 4-byte MXCSR into `v`, a valid local.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut v, options(nostack, preserves_flags));
        }
        v
    }

    pub(super) fn write(v: State) {
        // SAFETY: `ldmxcsr` loads MXCSR from `v`, a valid local; callers only clear FTZ/DAZ
        // or restore a value read before, so no reserved bit is set.
        unsafe {
            std::arch::asm!("ldmxcsr [{}]", in(reg) &v, options(nostack, preserves_flags, readonly));
        }
    }
}

/// The floating-point control register of this CPU: its type, the flush-to-zero and
/// denormals-are-zero bits, and access.
#[cfg(target_arch = "aarch64")]
mod fpenv {
    /// FPCR.
    pub(super) type State = u64;
    /// FPCR FZ (bit 24).
    pub(super) const FLUSH_BITS: State = 1 << 24;

    pub(super) fn read() -> State {
        let v: State;
        // SAFETY: reading FPCR has no side effect.
        unsafe {
            std::arch::asm!("mrs {}, fpcr", out(reg) v, options(nomem, nostack, preserves_flags));
        }
        v
    }

    pub(super) fn write(v: State) {
        // SAFETY: callers only clear FZ or restore a value read before.
        unsafe {
            std::arch::asm!("msr fpcr, {}", in(reg) v, options(nomem, nostack, preserves_flags));
        }
    }
}

/// No flush-to-zero control on this target: the guard does nothing.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
mod fpenv {
    pub(super) type State = u32;
    pub(super) const FLUSH_BITS: State = 0;
    pub(super) fn read() -> State {
        0
    }
    pub(super) fn write(_: State) {}
}

/// Clears flush-to-zero and denormals-are-zero for the current thread while it lives and
/// restores the previous state on drop (x86_64: MXCSR bits FTZ=15 and DAZ=6 via
/// `stmxcsr`/`ldmxcsr`; aarch64: FPCR bit FZ=24 via `mrs`/`msr`; other targets: no-op).
/// Another library in the process may have set these flags.
///
/// The guard is neither `Send` nor `Sync`: it must drop on the thread that made it.
#[must_use = "the flags are restored when the guard drops"]
pub struct DenormalGuard {
    /// The state before, where the guard changed it.
    saved: Option<fpenv::State>,
    _thread: PhantomData<*const ()>,
}

impl DenormalGuard {
    /// Clears the flush-to-zero bits of this thread (writing the register only if one is set).
    pub fn new() -> Self {
        let prev = fpenv::read();
        let saved = if prev & fpenv::FLUSH_BITS != 0 {
            fpenv::write(prev & !fpenv::FLUSH_BITS);
            Some(prev)
        } else {
            None
        };
        DenormalGuard {
            saved,
            _thread: PhantomData,
        }
    }
}

impl Default for DenormalGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for DenormalGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.saved {
            fpenv::write(prev);
        }
    }
}

impl fmt::Debug for DenormalGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DenormalGuard")
            .field("changed", &self.saved.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests;
