// The CUDA adaptor's reduction step (`DeviceAdaptor::reduce_async`): `flagcx_reduce`,
// dst[i] = a[i] op b[i] over `count` elements (or the averaging step), with the rules of
// `flagcx_adaptor::reduce` bit for bit:
// - integers: sum and product wrap around; average divides the (wrapped) sum by n, truncating
//   toward zero, in 64-bit arithmetic;
// - float32/float64: IEEE operations rounded to nearest even (`__fadd_rn`, `__fmul_rn`, ...:
//   never contracted into FMA; the PTX is also built with --fmad=false), denormals kept (no
//   -ftz); max/min are compares that propagate NaN and order -0 below +0; every NaN result is
//   written as the one canonical NaN;
// - float16/bfloat16: widened exactly to float32, combined there, rounded once to nearest
//   even (float16 by `cvt.rn.f16.f32`; bfloat16 by hand, as on every vendor);
// - average of floats: multiplied by s = 1/n rounded to the element type (the host computes
//   s and passes it as float32 or float64 bits).
// 64-bit indexing throughout; operands of any alignment (byte loads where a pointer is not
// aligned to the element size).
//
// The shipped `reduce.ptx` is this file compiled for `compute_75` with NVRTC:
// `python3 ptx.py reduce.cu reduce.ptx --fmad=false` (then `.version` lowered to 7.0, as for
// stream.ptx).

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;

// The element types, numbered as flagcxDataType_t.
enum { I8 = 0, U8 = 1, I32 = 2, U32 = 3, I64 = 4, U64 = 5, F16 = 6, F32 = 7, F64 = 8, BF16 = 9 };
// The steps: Combine(op) is 0..3, the averaging step 4.
enum { SUM = 0, PROD = 1, MAX = 2, MIN = 3, AVG = 4 };

template <class T>
__device__ static T load(const unsigned char *p, bool aligned) {
  if (aligned) return *(const T *)p;
  T v;
  unsigned char *d = (unsigned char *)&v;
  for (int k = 0; k < (int)sizeof(T); k++) d[k] = p[k];
  return v;
}

template <class T>
__device__ static void store(unsigned char *p, T v, bool aligned) {
  if (aligned) {
    *(T *)p = v;
    return;
  }
  const unsigned char *s = (const unsigned char *)&v;
  for (int k = 0; k < (int)sizeof(T); k++) p[k] = s[k];
}

// ---- integers ---------------------------------------------------------------------------

template <class T, class W>
__device__ static T int_step(T a, T b, int step, u32 n) {
  switch (step) {
  case SUM: return (T)((W)a + (W)b);
  case PROD: return (T)((W)a * (W)b);
  case MAX: return a > b ? a : b;
  case MIN: return a < b ? a : b;
  default: return (T)((W)a / (W)n);
  }
}

// ---- floats -----------------------------------------------------------------------------

__device__ static float f32_canon(float x) { return x != x ? __int_as_float(0x7FC00000) : x; }
__device__ static double f64_canon(double x) {
  return x != x ? __longlong_as_double(0x7FF8000000000000LL) : x;
}

// Max and min as compares: NaN if either is NaN; equal values (only ±0 differ) by sign bit.
__device__ static float f32_step(float a, float b, int step, float s) {
  switch (step) {
  case SUM: return f32_canon(__fadd_rn(a, b));
  case PROD: return f32_canon(__fmul_rn(a, b));
  case MAX:
  case MIN: {
    if (a != a || b != b) return __int_as_float(0x7FC00000);
    if (a > b) return step == MAX ? a : b;
    if (b > a) return step == MAX ? b : a;
    bool a_neg = __float_as_int(a) < 0;
    return (step == MAX) == a_neg ? b : a;
  }
  default: return f32_canon(__fmul_rn(a, s));
  }
}

__device__ static double f64_step(double a, double b, int step, double s) {
  switch (step) {
  case SUM: return f64_canon(__dadd_rn(a, b));
  case PROD: return f64_canon(__dmul_rn(a, b));
  case MAX:
  case MIN: {
    if (a != a || b != b) return __longlong_as_double(0x7FF8000000000000LL);
    if (a > b) return step == MAX ? a : b;
    if (b > a) return step == MAX ? b : a;
    bool a_neg = __double_as_longlong(a) < 0;
    return (step == MAX) == a_neg ? b : a;
  }
  default: return f64_canon(__dmul_rn(a, s));
  }
}

__device__ static float f16_to_f32(u16 h) {
  float f;
  asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
  return f;
}

__device__ static u16 f32_to_f16(float f) {
  if (f != f) return 0x7E00;
  u16 h;
  asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
  return h;
}

__device__ static float bf16_to_f32(u16 h) { return __int_as_float((int)((u32)h << 16)); }

// Round to nearest even by hand; any NaN becomes 0x7FC0.
__device__ static u16 f32_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  u32 u = (u32)__float_as_int(f);
  return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// ---- the kernel -------------------------------------------------------------------------

// `s32` / `s64`: the float32 / float64 scale of an averaging step (1/n rounded to the element
// type, then widened to float32 for the 16-bit types).
extern "C" __global__ void flagcx_reduce(unsigned char *dst, const unsigned char *a,
                                         const unsigned char *b, u64 count, int dtype, int step,
                                         u32 n, float s32, double s64) {
  const u64 sizes[10] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
  u64 sz = sizes[dtype];
  bool al = ((((u64)dst | (u64)a | (u64)b) & (sz - 1)) == 0);
  u64 stride = (u64)gridDim.x * blockDim.x;
  // The averaging step reads only `a`; `b` may be anything then.
  bool unary = step == AVG;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    u64 o = i * sz;
    switch (dtype) {
#define INT_CASE(TAG, T, W)                                                                  \
  case TAG: {                                                                                \
    T x = load<T>(a + o, al), y = unary ? x : load<T>(b + o, al);                            \
    store<T>(dst + o, int_step<T, W>(x, y, step, n), al);                                    \
    break;                                                                                   \
  }
      INT_CASE(I8, signed char, i64)
      INT_CASE(U8, unsigned char, u64)
      INT_CASE(I32, int, i64)
      INT_CASE(U32, unsigned int, u64)
      INT_CASE(I64, i64, i64)
      INT_CASE(U64, u64, u64)
#undef INT_CASE
    case F32: {
      float x = load<float>(a + o, al), y = unary ? x : load<float>(b + o, al);
      store<float>(dst + o, f32_step(x, y, step, s32), al);
      break;
    }
    case F64: {
      double x = load<double>(a + o, al), y = unary ? x : load<double>(b + o, al);
      store<double>(dst + o, f64_step(x, y, step, s64), al);
      break;
    }
    case F16: {
      float x = f16_to_f32(load<u16>(a + o, al));
      float y = unary ? x : f16_to_f32(load<u16>(b + o, al));
      store<u16>(dst + o, f32_to_f16(f32_step(x, y, step, s32)), al);
      break;
    }
    default: {  // BF16
      float x = bf16_to_f32(load<u16>(a + o, al));
      float y = unary ? x : bf16_to_f32(load<u16>(b + o, al));
      store<u16>(dst + o, f32_to_bf16(f32_step(x, y, step, s32)), al);
      break;
    }
    }
  }
}
