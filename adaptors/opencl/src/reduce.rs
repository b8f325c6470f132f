//! The reduction step (`DeviceAdaptor::reduce_async`) as an OpenCL kernel built from source at
//! the first reduction of each adaptor, following `flagcx_adaptor::reduce`'s rules bit for
//! bit: `#pragma OPENCL FP_CONTRACT OFF` (no FMA), no `-cl-denorms-are-zero`, compares for
//! max/min, one canonical NaN, float16 through the core `vload_half`/`vstore_half_rte`,
//! bfloat16 rounded by hand, integers in 64-bit arithmetic (wrap-around by truncation).
//!
//! Which types the device can do exactly decides what the adaptor claims
//! ([`claimed_types`]): float32 and bfloat16 only where the device keeps single-precision
//! denormals (`CL_FP_DENORM`), float64 only with `cl_khr_fp64` and double denormals. Anything
//! else would give other bits than the host reference, so it is `Unsupported` instead.

use std::ffi::CString;
use std::sync::Mutex;

use cl3::types::{cl_device_id, cl_kernel, cl_mem, cl_program};
use flagcx_adaptor::reduce::{DataType, ReduceStep};
use flagcx_adaptor::{AdaptorError, Result};

use crate::{cl_error, Raw};

/// The kernel's source. `FLAGCX_FP64` is defined where the device has `cl_khr_fp64`.
const SOURCE: &str = r#"
#pragma OPENCL FP_CONTRACT OFF
#ifdef FLAGCX_FP64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif

enum { I8, U8, I32, U32, I64, U64, F16, F32, F64, BF16 };
enum { SUM, PROD, MAX, MIN, AVG };

/* `size` bytes at p as an unsigned integer (little-endian), whatever the alignment. */
ulong load_bits(__global const uchar *p, int size, int aligned) {
  if (aligned) {
    switch (size) {
      case 1: return *p;
      case 2: return *(__global const ushort *)p;
      case 4: return *(__global const uint *)p;
      default: return *(__global const ulong *)p;
    }
  }
  ulong v = 0;
  for (int k = 0; k < size; k++) v |= (ulong)p[k] << (8 * k);
  return v;
}

void store_bits(__global uchar *p, ulong v, int size, int aligned) {
  if (aligned) {
    switch (size) {
      case 1: *p = (uchar)v; return;
      case 2: *(__global ushort *)p = (ushort)v; return;
      case 4: *(__global uint *)p = (uint)v; return;
      default: *(__global ulong *)p = v; return;
    }
  }
  for (int k = 0; k < size; k++) p[k] = (uchar)(v >> (8 * k));
}

/* Sign-extends the low `size` bytes. */
long sext(ulong v, int size) {
  int shift = 64 - 8 * size;
  return ((long)(v << shift)) >> shift;
}

ulong int_step(ulong a, ulong b, int step, uint n, int size, int is_signed) {
  if (step == SUM) return a + b;
  if (step == PROD) return a * b;
  if (step == AVG) {
    if (is_signed) return (ulong)(sext(a, size) / (long)n);
    ulong mask = size == 8 ? ~0UL : ((1UL << (8 * size)) - 1);
    return (a & mask) / (ulong)n;
  }
  int a_gt;
  if (is_signed) a_gt = sext(a, size) > sext(b, size);
  else {
    ulong mask = size == 8 ? ~0UL : ((1UL << (8 * size)) - 1);
    a_gt = (a & mask) > (b & mask);
  }
  if (step == MAX) return a_gt ? a : b;
  return a_gt ? b : a;
}

float f32_step(float a, float b, int step, float s) {
  float r;
  if (step == SUM) r = a + b;
  else if (step == PROD) r = a * b;
  else if (step == AVG) r = a * s;
  else {
    if (isnan(a) || isnan(b)) return as_float(0x7FC00000u);
    if (a > b) return step == MAX ? a : b;
    if (b > a) return step == MAX ? b : a;
    int a_neg = (int)as_uint(a) < 0;
    return ((step == MAX) == a_neg) ? b : a;
  }
  return isnan(r) ? as_float(0x7FC00000u) : r;
}

#ifdef FLAGCX_FP64
double f64_step(double a, double b, int step, double s) {
  double r;
  if (step == SUM) r = a + b;
  else if (step == PROD) r = a * b;
  else if (step == AVG) r = a * s;
  else {
    if (isnan(a) || isnan(b)) return as_double(0x7FF8000000000000UL);
    if (a > b) return step == MAX ? a : b;
    if (b > a) return step == MAX ? b : a;
    int a_neg = (long)as_ulong(a) < 0;
    return ((step == MAX) == a_neg) ? b : a;
  }
  return isnan(r) ? as_double(0x7FF8000000000000UL) : r;
}
#endif

float half_bits_to_f32(ushort h) {
  __private ushort t = h;
  return vload_half(0, (__private const half *)&t);
}

ushort f32_to_half_bits(float f) {
  if (isnan(f)) return 0x7E00;
  __private ushort t;
  vstore_half_rte(f, 0, (__private half *)&t);
  return t;
}

ushort f32_to_bf16_bits(float f) {
  if (isnan(f)) return 0x7FC0;
  uint u = as_uint(f);
  return (ushort)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* The elements work-item `get_global_id(0)` takes: strided across the grid (neighbouring
   work-items on neighbouring elements: coalesced on a GPU), or one contiguous block each
   (`blocks`, for CPU devices, which run a work-item's loop on one core). */
void span(ulong count, int blocks, ulong *first, ulong *end, ulong *stride) {
  ulong g = get_global_id(0), n = get_global_size(0);
  if (blocks) {
    ulong per = (count + n - 1) / n;
    *first = min(count, g * per);
    *end = min(count, *first + per);
    *stride = 1;
  } else {
    *first = g;
    *end = count;
    *stride = n;
  }
}

__kernel void flagcx_reduce(__global uchar *dst, ulong dst_off, __global const uchar *a,
                            ulong a_off, __global const uchar *b, ulong b_off, ulong count,
                            int dtype, int step, uint n, float s32, ulong s64_bits, int blocks) {
  const int sizes[10] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
  int size = sizes[dtype];
  __global uchar *d = dst + dst_off;
  __global const uchar *x = a + a_off;
  __global const uchar *y = b + b_off;
  int aligned = ((dst_off | a_off | b_off) & (ulong)(size - 1)) == 0;
  ulong first, end, stride;
  span(count, blocks, &first, &end, &stride);
  if (aligned) {
    /* Typed loops, one per type: the same steps as the byte-wise loop below, without a
       per-element dispatch (PoCL runs these 4-5 x faster on a CPU device). */
#define TYPED(T, EXPR)                                                                  \
  {                                                                                     \
    __global T *dd = (__global T *)d;                                                   \
    __global const T *xx = (__global const T *)x, *yy = (__global const T *)y;         \
    for (ulong i = first; i < end; i += stride) {                                       \
      T va = xx[i];                                                                     \
      T vb = step == AVG ? va : yy[i];                                                  \
      dd[i] = (EXPR);                                                                   \
    }                                                                                   \
    return;                                                                             \
  }
#define INT(T, SIGNED) TYPED(T, (T)int_step((ulong)va, (ulong)vb, step, n, sizeof(T), SIGNED))
    switch (dtype) {
      case I8: INT(char, 1)
      case U8: INT(uchar, 0)
      case I32: INT(int, 1)
      case U32: INT(uint, 0)
      case I64: INT(long, 1)
      case U64: INT(ulong, 0)
      case F32: TYPED(uint, as_uint(f32_step(as_float(va), as_float(vb), step, s32)))
      case F16:
        TYPED(ushort, f32_to_half_bits(f32_step(half_bits_to_f32(va), half_bits_to_f32(vb),
                                                step, s32)))
      case BF16:
        TYPED(ushort, f32_to_bf16_bits(f32_step(as_float((uint)va << 16),
                                                as_float((uint)vb << 16), step, s32)))
#ifdef FLAGCX_FP64
      case F64:
        TYPED(ulong, as_ulong(f64_step(as_double(va), as_double(vb), step, as_double(s64_bits))))
#endif
      default: break;
    }
#undef INT
#undef TYPED
  }
  for (ulong i = first; i < end; i += stride) {
    ulong o = i * (ulong)size;
    ulong va = load_bits(x + o, size, aligned);
    ulong vb = step == AVG ? va : load_bits(y + o, size, aligned);
    ulong r;
    if (dtype <= U64) {
      int is_signed = dtype == I8 || dtype == I32 || dtype == I64;
      r = int_step(va, vb, step, n, size, is_signed);
    } else if (dtype == F32) {
      r = as_uint(f32_step(as_float((uint)va), as_float((uint)vb), step, s32));
    } else if (dtype == F16) {
      float fa = half_bits_to_f32((ushort)va), fb = half_bits_to_f32((ushort)vb);
      r = f32_to_half_bits(f32_step(fa, fb, step, s32));
    } else if (dtype == BF16) {
      float fa = as_float((uint)va << 16), fb = as_float((uint)vb << 16);
      r = f32_to_bf16_bits(f32_step(fa, fb, step, s32));
    } else {
#ifdef FLAGCX_FP64
      r = as_ulong(f64_step(as_double(va), as_double(vb), step, as_double(s64_bits)));
#else
      r = 0;
#endif
    }
    store_bits(d + o, r, size, aligned);
  }
}

/* A fill with 64-bit offsets, for the bytes of a buffer past `FILL_RUNTIME_END`. */
__kernel void flagcx_fill(__global uchar *dst, ulong off, ulong n, uchar v, int blocks) {
  ulong first, end, stride;
  span(n, blocks, &first, &end, &stride);
  for (ulong i = first; i < end; i += stride) dst[off + i] = v;
}
"#;

/// The element types this device reduces exactly (a `Capabilities::reduce_types` mask).
pub(crate) fn claimed_types(dev: cl_device_id) -> u16 {
    let has_denorms = |param| {
        cl3::device::get_device_info(dev, param)
            .ok()
            .map(|v| match v {
                cl3::info_type::InfoType::Ulong(x) => x,
                _ => 0,
            })
            .is_some_and(|bits| bits & cl3::device::CL_FP_DENORM != 0)
    };
    // Integers and float16 (widened to float32, whose normal range holds every float16 value
    // and every result of combining two): exact on any device.
    let mut mask = DataType::ALL
        .iter()
        .filter(|t| !matches!(t, DataType::F32 | DataType::F64 | DataType::BF16))
        .fold(0u16, |m, t| m | t.bit());
    if has_denorms(cl3::device::CL_DEVICE_SINGLE_FP_CONFIG) {
        mask |= DataType::F32.bit() | DataType::BF16.bit();
    }
    if fp64(dev) && has_denorms(cl3::device::CL_DEVICE_DOUBLE_FP_CONFIG) {
        mask |= DataType::F64.bit();
    }
    mask
}

fn cpu_device(dev: cl_device_id) -> bool {
    cl3::device::get_device_info(dev, cl3::device::CL_DEVICE_TYPE).is_ok_and(|v| match v {
        cl3::info_type::InfoType::Ulong(t) => t & cl3::device::CL_DEVICE_TYPE_CPU != 0,
        _ => false,
    })
}

fn fp64(dev: cl_device_id) -> bool {
    cl3::device::get_device_data(dev, cl3::device::CL_DEVICE_EXTENSIONS)
        .map(|b| {
            String::from_utf8_lossy(&b)
                .split_whitespace()
                .any(|e| e == "cl_khr_fp64")
        })
        .unwrap_or(false)
}

/// The built kernel of one adaptor, made at its first reduction. Setting a kernel's arguments
/// and enqueueing it is not thread safe on one kernel object: both happen under the lock.
#[derive(Default)]
pub(crate) struct Reducer {
    built: Mutex<Option<std::result::Result<Built, Failed>>>,
}

/// Why the kernel could not be made: the call, the runtime's code, its name and the build log.
/// Kept, so every later reduction fails with the same typed error instead of building again.
struct Failed {
    op: &'static str,
    code: i64,
    name: String,
}

impl Failed {
    fn error(&self) -> AdaptorError {
        AdaptorError::Vendor {
            vendor: flagcx_adaptor::Vendor::OpenCl,
            op: self.op,
            code: self.code,
            name: self.name.clone(),
        }
    }

    fn from(e: AdaptorError) -> Self {
        match e {
            AdaptorError::Vendor { op, code, name, .. } => Failed { op, code, name },
            other => Failed {
                op: "clBuildProgram",
                code: -11,
                name: other.to_string(),
            },
        }
    }
}

struct Built {
    program: Raw<cl_program>,
    kernel: Raw<cl_kernel>,
    fill: Raw<cl_kernel>,
    /// A CPU device: each work-item takes one contiguous block (the kernels' `blocks`).
    /// Strided across the grid, a PoCL work-item's loop stepped 256 KiB at a time: a 32 MiB
    /// float32 sum took 101–108 ms on the 2-core VM.
    blocks: i32,
}

impl Drop for Built {
    fn drop(&mut self) {
        // SAFETY: made in `build`, released once here; no launch holds them any more (the
        // adaptor's queues were finished before its objects are dropped).
        unsafe {
            let _ = cl3::kernel::release_kernel(self.kernel.0);
            let _ = cl3::kernel::release_kernel(self.fill.0);
            let _ = cl3::program::release_program(self.program.0);
        }
    }
}

/// One operand: its buffer and the byte offset in it.
pub(crate) type Operand = (cl_mem, usize);

impl Reducer {
    /// Runs `f` on the built program (built at the first use) under the lock, which covers
    /// setting a kernel's arguments and enqueueing it.
    fn with_built<R>(
        &self,
        context: cl3::types::cl_context,
        dev: cl_device_id,
        f: impl FnOnce(&Built) -> Result<R>,
    ) -> Result<R> {
        let mut g = self.built.lock().unwrap_or_else(|e| e.into_inner());
        match g.get_or_insert_with(|| build(context, dev).map_err(Failed::from)) {
            Ok(b) => f(b),
            Err(failed) => Err(failed.error()),
        }
    }

    /// Enqueues a fill of `n` bytes at `dst` with `value` on `queue` by the program's own
    /// kernel (64-bit offsets). Returns the kernel's event.
    ///
    /// # Safety
    /// `dst` lies in a live buffer of this context with `n` bytes after it, valid until the
    /// command completes.
    pub(crate) unsafe fn enqueue_fill(
        &self,
        context: cl3::types::cl_context,
        dev: cl_device_id,
        queue: cl3::types::cl_command_queue,
        dst: Operand,
        n: usize,
        value: u8,
    ) -> Result<cl3::types::cl_event> {
        self.with_built(context, dev, |b| {
            // SAFETY: the caller's contract.
            unsafe { fill_with(b.fill.0, queue, dst, n, value, b.blocks) }
        })
    }

    /// Enqueues the step on `queue`: `dst = a op b` over `count` elements (`b` is read only
    /// for a combine step). Returns the kernel's event.
    ///
    /// # Safety
    /// The operands lie in live buffers of this context (the adaptor resolved them) and stay
    /// valid until the command completes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn enqueue(
        &self,
        context: cl3::types::cl_context,
        dev: cl_device_id,
        queue: cl3::types::cl_command_queue,
        (dst, a, b): (Operand, Operand, Operand),
        count: usize,
        dtype: DataType,
        step: ReduceStep,
    ) -> Result<cl3::types::cl_event> {
        self.with_built(context, dev, |built| {
            let k = built.kernel.0;
            let (code, n, s) = match step {
                ReduceStep::Combine(op) => (op as i32, 1u32, 0.0f64),
                ReduceStep::Average { n } => (
                    4,
                    n,
                    flagcx_adaptor::reduce::average_scale(dtype, n).unwrap_or(0.0),
                ),
            };
            let (s32, s64) = (s as f32, s.to_bits());
            let (count, dt) = (count as u64, dtype as i32);
            let offs = [dst.1 as u64, a.1 as u64, b.1 as u64];
            let mems = [dst.0, a.0, b.0];
            // Arguments in the kernel's order: (buffer, offset) x3, count, dtype, step, n, s32,
            // s64, blocks; each value's type has the size of the kernel parameter.
            // SAFETY: `k` is this program's `flagcx_reduce`, whose parameters these are.
            unsafe {
                for j in 0..3 {
                    arg(k, 2 * j as u32, &mems[j])?;
                    arg(k, 2 * j as u32 + 1, &offs[j])?;
                }
                arg(k, 6, &count)?;
                arg(k, 7, &dt)?;
                arg(k, 8, &code)?;
                arg(k, 9, &n)?;
                arg(k, 10, &s32)?;
                arg(k, 11, &s64)?;
                arg(k, 12, &built.blocks)?;
            }
            // SAFETY: the kernel's arguments are set; the caller's contract covers the memory.
            unsafe { launch(queue, k, count as usize) }
        })
    }
}

/// Enqueues the fill kernel `k`: `n` bytes at `dst` set to `value`.
///
/// # Safety
/// As [`Reducer::enqueue_fill`]; the caller holds the program's lock.
unsafe fn fill_with(
    k: cl_kernel,
    queue: cl3::types::cl_command_queue,
    dst: Operand,
    n: usize,
    value: u8,
    blocks: i32,
) -> Result<cl3::types::cl_event> {
    let (off, len) = (dst.1 as u64, n as u64);
    // SAFETY: `k` is this program's `flagcx_fill`, whose parameters these are, in order.
    unsafe {
        arg(k, 0, &dst.0)?;
        arg(k, 1, &off)?;
        arg(k, 2, &len)?;
        arg(k, 3, &value)?;
        arg(k, 4, &blocks)?;
    }
    // SAFETY: the kernel's arguments are set (under the lock, held until it is enqueued);
    // the caller's contract covers the memory.
    unsafe { launch(queue, k, n) }
}

/// Sets kernel `k`'s parameter `i` to `v`.
///
/// # Safety
/// Parameter `i` of `k` has the size of `T` (a `cl_mem` for a buffer); the caller holds the
/// program's lock, as a kernel's arguments are not thread safe.
unsafe fn arg<T>(k: cl_kernel, i: u32, v: &T) -> Result<()> {
    // SAFETY: `v` points at a `T`, which the caller's contract makes the parameter's size.
    unsafe { cl3::kernel::set_kernel_arg(k, i, std::mem::size_of::<T>(), (v as *const T).cast()) }
        .map_err(|c| cl_error("clSetKernelArg", c))
}

/// Enqueues kernel `k` over `items` elements: enough work-items to fill the device several
/// times over (at most 2^16), the kernels' loops covering the rest.
///
/// # Safety
/// `k`'s arguments are set, under the program's lock, and name memory valid until it ran.
unsafe fn launch(
    queue: cl3::types::cl_command_queue,
    k: cl_kernel,
    items: usize,
) -> Result<cl3::types::cl_event> {
    let global = items.clamp(1, 1 << 16);
    // SAFETY: the caller's contract.
    unsafe {
        cl3::command_queue::enqueue_nd_range_kernel(
            queue,
            k,
            1,
            std::ptr::null(),
            &global,
            std::ptr::null(),
            0,
            std::ptr::null(),
        )
    }
    .map_err(|c| cl_error("clEnqueueNDRangeKernel", c))
}

/// Builds the program for `dev` and makes its kernel; the build log is kept in the error.
fn build(context: cl3::types::cl_context, dev: cl_device_id) -> Result<Built> {
    let program = cl3::program::create_program_with_source(context, &[SOURCE])
        .map_err(|c| cl_error("clCreateProgramWithSource", c))?;
    let options = CString::new(if fp64(dev) { "-DFLAGCX_FP64" } else { "" })
        .map_err(|_| AdaptorError::invalid("clBuildProgram", "options"))?;
    if let Err(c) =
        cl3::program::build_program(program, &[dev], &options, None, std::ptr::null_mut())
    {
        let log =
            cl3::program::get_program_build_data(program, dev, cl3::program::CL_PROGRAM_BUILD_LOG)
                .map(|b| {
                    String::from_utf8_lossy(&b)
                        .trim_end_matches('\0')
                        .to_string()
                })
                .unwrap_or_default();
        // SAFETY: made above, used by nothing else.
        unsafe {
            let _ = cl3::program::release_program(program);
        }
        return Err(AdaptorError::Vendor {
            vendor: flagcx_adaptor::Vendor::OpenCl,
            op: "clBuildProgram",
            code: i64::from(c),
            name: format!(
                "{} (the reduction kernel; build log: {log})",
                cl3::error_codes::error_text(c)
            ),
        });
    }
    let kernels = cl3::kernel::create_kernel(program, c"flagcx_reduce").and_then(|k| {
        cl3::kernel::create_kernel(program, c"flagcx_fill")
            .inspect_err(|_| {
                // SAFETY: made just above, used by nothing else.
                unsafe {
                    let _ = cl3::kernel::release_kernel(k);
                }
            })
            .map(|f| (k, f))
    });
    match kernels {
        Ok((kernel, fill)) => Ok(Built {
            program: Raw(program),
            kernel: Raw(kernel),
            fill: Raw(fill),
            blocks: i32::from(cpu_device(dev)),
        }),
        Err(c) => {
            // SAFETY: as above.
            unsafe {
                let _ = cl3::program::release_program(program);
            }
            Err(cl_error("clCreateKernel", c))
        }
    }
}
