// Example kernels driving a flagcx-rs port channel (include/flagcx/device.cuh), loaded as PTX
// by examples/port_pingpong.rs. Build the PTX (no other flags are needed; the driver compiles
// it for the GPU it finds):
//
//   nvcc -ptx -arch=compute_75 -I crates/flagcx-p2p/include \
//        -o examples/port/port_kernels.ptx examples/port/port_kernels.cu
//
// The shipped PTX was built without a GPU or nvcc: NVRTC 12.4 from PyPI
// (nvidia-cuda-nvrtc-cu12), with -I crates/flagcx-p2p/include and a directory holding a
// stdint.h of typedefs (NVRTC has none), its .version lowered to 7.0 for older drivers, and
// checked with `ptxas -arch=sm_90` (adaptors/cuda/kernels/ptx.py does the same for the
// adaptor's kernels).
//
// Every kernel runs one thread and writes out[0] = nanoseconds of its timed part, out[1] = the
// first failure code (0: none).
#include <flagcx/device.cuh>

__device__ static uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Ping-pong between the two ranks of the channel: `first` puts `bytes` from its buffer 0 into
// the peer's buffer 1 with a signal, then waits for the answer; the other answers. `warm`
// rounds, then `iters` timed ones. `seen` is how many signals this rank consumed before.
extern "C" __global__ void port_pingpong(flagcx::PortChannelHandle h, int first, uint32_t warm,
                                         uint32_t iters, uint64_t bytes, uint64_t seen,
                                         uint64_t *out) {
  flagcx::PortChannel ch(h);
  ch.expected = seen;
  int r = 0;
  uint64_t t0 = 0;
  for (uint32_t i = 0; i < warm + iters && r == 0; ++i) {
    if (i == warm) t0 = now_ns();
    if (first) {
      r = ch.put_with_signal(1, 0, 0, 0, bytes);
      if (r == 0) r = ch.wait();
    } else {
      r = ch.wait();
      if (r == 0) r = ch.put_with_signal(1, 0, 0, 0, bytes);
    }
  }
  out[0] = now_ns() - t0;
  out[1] = r;
}

// The same ping-pong with put_value_with_signal: round i's value travels in the trigger (no
// buffer is read) into the peer's buffer 1 at offset 0; each side checks the value it waited
// for, read from `mine` (its own buffer 1). out[2] = values that were not the expected one.
__device__ static uint64_t round_value(uint32_t i, int from_first) {
  return 0x5eed000000000000ull ^ (uint64_t(i) << 1 | uint64_t(from_first ? 0 : 1));
}

extern "C" __global__ void port_pingpong_value(flagcx::PortChannelHandle h, int first, uint32_t warm,
                                               uint32_t iters, uint64_t seen, const uint64_t *mine,
                                               uint64_t *out) {
  flagcx::PortChannel ch(h);
  ch.expected = seen;
  int r = 0;
  uint64_t t0 = 0, wrong = 0;
  for (uint32_t i = 0; i < warm + iters && r == 0; ++i) {
    if (i == warm) t0 = now_ns();
    if (first) {
      r = ch.put_value_with_signal(1, 0, round_value(i, 1));
      if (r == 0) r = ch.wait();
      if (r == 0 && flagcx::PortChannel::load(uint64_t(mine)) != round_value(i, 0)) ++wrong;
    } else {
      r = ch.wait();
      if (r == 0 && flagcx::PortChannel::load(uint64_t(mine)) != round_value(i, 1)) ++wrong;
      if (r == 0) r = ch.put_value_with_signal(1, 0, round_value(i, 0));
    }
  }
  out[0] = now_ns() - t0;
  out[1] = r;
  out[2] = wrong;
}

// `n` flushes back to back: each is a trigger the proxy must take and answer through the
// control block, so the time per flush bounds trigger pick-up from above.
extern "C" __global__ void port_flushes(flagcx::PortChannelHandle h, uint32_t n, uint64_t *out) {
  flagcx::PortChannel ch(h);
  int r = ch.flush();  // warm-up
  uint64_t t0 = now_ns();
  for (uint32_t i = 0; i < n && r == 0; ++i) r = ch.flush();
  out[0] = now_ns() - t0;
  out[1] = r;
}

// `n` puts of `bytes` each (buffer 0 here -> buffer 1 there), a flush, then one signal.
extern "C" __global__ void port_puts(flagcx::PortChannelHandle h, uint32_t n, uint64_t bytes,
                                     uint64_t *out) {
  flagcx::PortChannel ch(h);
  int r = 0;
  uint64_t t0 = now_ns();
  for (uint32_t i = 0; i < n && r == 0; ++i) r = ch.put(1, 0, 0, 0, bytes);
  if (r == 0) r = ch.flush();
  out[0] = now_ns() - t0;
  if (r == 0) r = ch.signal();
  out[1] = r;
}

// `n` empty puts, each waited for until the proxy took it (`tail` passed it): the time per
// trigger is the device's write, the proxy's pick-up and the tail's way back over the bus.
extern "C" __global__ void port_pickups(flagcx::PortChannelHandle h, uint32_t n, uint64_t *out) {
  flagcx::PortChannel ch(h);
  uint64_t seq = 0, t0 = 0;
  int r = 0;
  for (uint32_t i = 0; i <= n && r == 0; ++i) {
    if (i == 1) t0 = now_ns();  // the first one warms up
    r = ch.trigger(flagcx::kPortPut, 1, 0, 0, 0, 0, &seq);
    for (uint32_t spins = 1; r == 0 && flagcx::PortChannel::load(h.tail) < seq; ++spins) {
      if ((spins & 1023) == 0) r = ch.status();
    }
  }
  out[0] = now_ns() - t0;
  out[1] = r;
}

// The bus alone, for comparison with port_pickups: `n` times, write i into `ping` (host
// memory) and wait until a CPU thread spinning on it has copied it into `pong`.
extern "C" __global__ void bus_echo(uint64_t ping, uint64_t pong, uint32_t n, uint64_t *out) {
  uint64_t t0 = 0;
  for (uint32_t i = 1; i <= n + 1; ++i) {
    if (i == 2) t0 = now_ns();  // the first one warms up
    *reinterpret_cast<volatile uint64_t *>(ping) = i;
    __threadfence_system();
    while (flagcx::PortChannel::load(pong) != i) {
    }
  }
  out[0] = now_ns() - t0;
  out[1] = 0;
}
