// The CUDA adaptor's kernels, launched on callers' streams:
// - `flagcx_sized_copy`: a copy whose length is read when the stream reaches it
//   (`DeviceAdaptor::memcpy_sized_async`);
// - `flagcx_copy`: a device-to-device copy by the SMs instead of a copy engine, where
//   `FLAGCX_CUDA_COPY_KERNEL` asks for it;
// - `flagcx_slot_steps`: the sides of small messages through slots both ends reach
//   (`DeviceAdaptor::stream_slot_steps`): one block per step, each a wait, a copy and writes.
//
// The shipped `stream.ptx` is this file compiled for `compute_75` with NVRTC (no GPU or nvcc
// needed: `python3 ptx.py stream.cu stream.ptx`, with the `nvidia-cuda-nvrtc-cu12` wheel from
// PyPI; nvcc's `nvcc -ptx -arch=compute_75 -o stream.ptx stream.cu` gives the same), its
// `.version` lowered to 7.0 so that drivers from CUDA 11 on load it.

typedef unsigned long long u64;

// Every thread reads the length word (one 8-byte load of memory another device or process
// wrote before whatever released this copy), then copies its share.
__device__ static void copy_bytes(unsigned char *dst, const unsigned char *src, u64 n, u64 tid,
                                  u64 stride) {
  u64 head = 0;
  if ((((u64)dst | (u64)src) & 15) == 0) {
    u64 words = n / 16;
    const uint4 *s = (const uint4 *)src;
    uint4 *d = (uint4 *)dst;
    // Four loads in flight per thread before any store: a slot in host memory is a bus
    // round trip away, and a loop of dependent load-store pairs would pay it every word.
    u64 i = tid;
    for (; i + 3 * stride < words; i += 4 * stride) {
      uint4 a = s[i], b = s[i + stride], c = s[i + 2 * stride], e = s[i + 3 * stride];
      d[i] = a;
      d[i + stride] = b;
      d[i + 2 * stride] = c;
      d[i + 3 * stride] = e;
    }
    for (; i < words; i += stride) d[i] = s[i];
    head = words * 16;
  }
  for (u64 i = head + tid; i < n; i += stride) dst[i] = src[i];
}

extern "C" __global__ void flagcx_sized_copy(unsigned char *dst, const unsigned char *src,
                                             const u64 *len_at, u64 cap) {
  u64 n = *(volatile const u64 *)len_at;
  if (n > cap) return;
  copy_bytes(dst, src, n, (u64)blockIdx.x * blockDim.x + threadIdx.x,
             (u64)gridDim.x * blockDim.x);
}

// A plain copy of `n` bytes by the SMs, grid-strided (`FLAGCX_CUDA_COPY_KERNEL`): device
// memory of this GPU, or of a peer mapped into its address space.
extern "C" __global__ void flagcx_copy(unsigned char *dst, const unsigned char *src, u64 n) {
  copy_bytes(dst, src, n, (u64)blockIdx.x * blockDim.x + threadIdx.x,
             (u64)gridDim.x * blockDim.x);
}

// One step, as `flagcx_cuda::sized::RawStep` lays it out (120 bytes).
struct SlotStep {
  u64 kind;      // 1: put, 2: take
  u64 wait_at;   // the word waited for (0: no wait)
  u64 wait_min;  // released once (int64)(word - wait_min) >= 0, as CU_STREAM_WAIT_VALUE_GEQ
  u64 src;       // put: the message; take: the slot
  u64 dst;       // put: the slot; take: the receive buffer
  u64 len;       // put: the message's bytes; take: the capacity
  u64 word0;     // put: the first word written after the bytes; take: the length word
  u64 value0;
  u64 word1;     // put: the second word written
  u64 value1;
  u64 inbox;         // the inbox's slot (0: no inbox)
  u64 inbox_len;     // its length word
  u64 inbox_status;  // its status word
  u64 done_at;       // take: the word written after the copy (0: none)
  u64 done_value;
};

#define FLAGCX_SLOT_STEPS 16
struct SlotSteps {
  SlotStep s[FLAGCX_SLOT_STEPS];
};

// A put's bytes into the slot (and its inbox, if any) by the whole block, fenced, then thread
// 0's words, each fenced after the one before: the inbox's length and status words first (the
// take polls them: two fences sooner than behind the slot's), then the slot's size and status
// words. Every read of `src` comes before any word, so a sender may complete once it sees the
// slot's status word (the engine does, with no event); the receiving engine reads the slot's
// words only once they are there (`published`), even where the take already finished.
__device__ static void publish(const SlotStep &st) {
  const unsigned char *src = (const unsigned char *)st.src;
  copy_bytes((unsigned char *)st.dst, src, st.len, threadIdx.x, blockDim.x);
  if (st.inbox != 0) copy_bytes((unsigned char *)st.inbox, src, st.len, threadIdx.x, blockDim.x);
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    if (st.inbox != 0) {
      *(volatile u64 *)st.inbox_len = st.len;
      __threadfence_system();
      *(volatile u64 *)st.inbox_status = st.value1;
      __threadfence_system();
    }
    *(volatile u64 *)st.word0 = st.value0;
    __threadfence_system();
    *(volatile u64 *)st.word1 = st.value1;
  }
}

// Block `b` runs step `b`. Thread 0 waits, then a fence orders the block's later loads after
// the word it saw; a put's bytes are fenced (system scope: the peer may be another device or
// the host) before thread 0 writes the words, and the words are fenced from each other.
//
// With an inbox (`SlotInbox`: the receiving device's memory), a put copies the bytes there
// too, before any word, and writes the inbox's words before the slot's; a take polls the
// inbox's status word (local memory: no bus round trip) and every 64th time the slot's (which
// is how a message is failed or released without its putter), and takes from whichever shows
// the message first.
__device__ static void slot_step(const SlotStep &st) {
  __shared__ int from_inbox;
  if (st.kind == 2) {
    if (threadIdx.x == 0) {
      const volatile u64 *slot_word = (const volatile u64 *)st.wait_at;
      const volatile u64 *inbox_word = (const volatile u64 *)st.inbox_status;
      int inbox = 0;
      for (unsigned spins = 0; slot_word != 0; spins++) {
        if (inbox_word != 0 && (long long)(*inbox_word - st.wait_min) >= 0) {
          inbox = 1;
          break;
        }
        if ((inbox_word == 0 || spins % 64 == 63) &&
            (long long)(*slot_word - st.wait_min) >= 0)
          break;
      }
      __threadfence_system();
      from_inbox = inbox;
    }
    __syncthreads();
    const u64 *len_at = (const u64 *)(from_inbox ? st.inbox_len : st.word0);
    const unsigned char *src = (const unsigned char *)(from_inbox ? st.inbox : st.src);
    u64 n = *(volatile const u64 *)len_at;
    if (n <= st.len) copy_bytes((unsigned char *)st.dst, src, n, threadIdx.x, blockDim.x);
    if (st.done_at != 0) {
      // Every thread's share of the copy is visible before thread 0's word.
      __threadfence_system();
      __syncthreads();
      if (threadIdx.x == 0) *(volatile u64 *)st.done_at = st.done_value;
    }
    return;
  }
  if (threadIdx.x == 0 && st.wait_at != 0) {
    const volatile u64 *w = (const volatile u64 *)st.wait_at;
    while ((long long)(*w - st.wait_min) < 0) {
    }
    __threadfence_system();
  }
  __syncthreads();
  publish(st);
}

extern "C" __global__ void flagcx_slot_steps(SlotSteps steps) { slot_step(steps.s[blockIdx.x]); }

// The same for a call of one step: 120 bytes of parameters instead of 1920 (a launch's
// parameters travel in the driver's command stream).
extern "C" __global__ void flagcx_slot_step(SlotStep step) { slot_step(step); }
