// Kernels of benches/probes/port_floor.c (no flagcx code): what a port channel's two halves
// cost on the bus, each way of doing them measured in one process.
//
//   python3 adaptors/cuda/kernels/ptx.py benches/probes/port_floor.cu /tmp/port_floor.ptx
//
// Every kernel runs one thread; out[0] = nanoseconds for `n` rounds after one warm-up round.
typedef unsigned long long u64; // (no stdint.h: NVRTC has none)
typedef unsigned int u32;

__device__ static u64 now_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ static u64 load(const u64 *p) { return *(volatile const u64 *)p; }

__device__ static void store_release_sys(u64 *p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Publishes trigger `i` into the four words at `t` (host memory) in one of these ways:
//   0  three fields, fence.sc.sys, the mark, fence.sc.sys   (device.cuh today)
//   1  three fields, fence.sc.sys, the mark                 (no trailing fence)
//   2  three fields, the mark as a release store at system scope
//   3  a GPU-scope fence (the data a put reads), then all four words carry `i`: the reader
//      waits for all four, so no system-scope ordering among them is needed
//   4  as 3, then fence.sc.sys to push the words out
//   5  the mark alone, then fence.sc.sys (the bus echo: the floor of all of these)
__device__ static void publish(u64 *t, int variant, u64 i) {
  volatile u64 *v = t;
  switch (variant) {
    case 0:
      v[0] = i; v[1] = i; v[2] = i;
      __threadfence_system();
      v[3] = i;
      __threadfence_system();
      break;
    case 1:
      v[0] = i; v[1] = i; v[2] = i;
      __threadfence_system();
      v[3] = i;
      break;
    case 2:
      v[0] = i; v[1] = i; v[2] = i;
      store_release_sys(t + 3, i);
      break;
    case 3:
      __threadfence();
      v[0] = i; v[1] = i; v[2] = i; v[3] = i;
      break;
    case 4:
      __threadfence();
      v[0] = i; v[1] = i; v[2] = i; v[3] = i;
      __threadfence_system();
      break;
    default:
      v[3] = i;
      __threadfence_system();
      break;
  }
}

// Trigger pick-up: publish trigger i, wait until the host thread has written i into `tail`.
extern "C" __global__ void pickup(u64 *trig, const u64 *tail, int variant, u32 n,
                                  u64 *out) {
  u64 t0 = 0;
  for (u64 i = 1; i <= n + 1; ++i) {
    if (i == 2) t0 = now_ns();
    publish(trig, variant, i);
    while (load(tail) != i) {
    }
  }
  out[0] = now_ns() - t0;
}

// A proxy's hop: write i into `ping` (host memory), wait until the host's stream operations
// have written i into `flag` (device memory), as a put-with-signal's receiver would; then
// check that the data word (written before the flag) holds i. out[1] = rounds where it did not.
extern "C" __global__ void echo(u64 *ping, const u64 *flag, const u64 *data,
                                u32 n, u64 *out) {
  u64 t0 = 0, stale = 0;
  for (u64 i = 1; i <= n + 1; ++i) {
    if (i == 2) t0 = now_ns();
    *(volatile u64 *)ping = i;
    __threadfence_system();
    while (load(flag) < i) {
    }
    stale += load(data) != i;
  }
  out[0] = now_ns() - t0;
  out[1] = stale;
}

// A proxy's small put as one launch: copy `n` words, then (after a system-scope fence) write
// `value` into `flag`; one block.
extern "C" __global__ void put_signal(u64 *dst, const u64 *src, u32 n, u64 *flag,
                                      u64 value) {
  for (u32 i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    *(volatile u64 *)flag = value;
  }
}
