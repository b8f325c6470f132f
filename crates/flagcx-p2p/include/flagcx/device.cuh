/*
 * flagcx/device.cuh — the device side of flagcx-rs port channels (device-initiated transfers),
 * for CUDA and HIP kernels.
 *
 * A port channel is created on the host by both ranks of a pair (Rust: Comm::port_channel);
 * its raw handle (Rust: PortChannel::raw, a PortRaw) is passed to a kernel by value as a
 * flagcx::PortChannelHandle. Device code then asks this rank's proxy thread for transfers by
 * writing triggers into a FIFO in host memory; the proxy executes them in order:
 *
 *   put(dst, dst_off, src, src_off, size)  copy size bytes from this rank's registered buffer
 *                                          `src` to the peer's registered buffer `dst`
 *                                          (buffers are indices in the lists the two ranks
 *                                          passed when creating the channel)
 *   signal()                               add one to the peer's flag once everything earlier
 *                                          in the FIFO has landed
 *   put_with_signal(...)                   both, as one trigger
 *   put_value(dst, dst_off, value)         write the 8 bytes of `value` into the peer's
 *                                          buffer `dst` at dst_off (a multiple of 8); the
 *                                          value travels in the trigger, so no buffer of
 *                                          this rank is read and, on an IPC pair, the proxy
 *                                          issues one stream write instead of a copy
 *   put_value_with_signal(...)             both, as one trigger: the fastest way to hand
 *                                          the peer a word and wake it
 *
 * A put (or put_with_signal) of 8 bytes between 8-byte-aligned addresses is sent as a value
 * put: the calling thread reads the 8 bytes when it triggers (the proxy's copy would read them
 * later; either is what "the source may not change until a flush" allows), using the table of
 * registered buffers the channel keeps beside its flag. On an H200 that is 15 us instead of
 * 27-36 us per 8 B kernel-to-kernel round trip between two processes.
 *   flush()                                return once everything earlier completed (on a
 *                                          staged pair: left this rank's buffers, which may
 *                                          be reused; a signal still follows the data)
 *   wait()                                 wait for the peer's next signal
 *
 * Every call returns 0, or a FLAGCX_PORT_* failure code: the channel was poisoned (the peer
 * died, a trigger was bad, the runtime failed, or the application gave up) and stays failed.
 * Nothing waits forever on a failed channel.
 *
 * One PortChannel object per thread that waits (each counts the signals it consumed); any
 * number of threads may put, signal and flush on one channel at once. The layout below must
 * match crates/flagcx-p2p/src/port/mod.rs (docs/architecture.md has the table).
 */
#ifndef FLAGCX_DEVICE_CUH
#define FLAGCX_DEVICE_CUH

#include <stdint.h>
#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#endif

namespace flagcx {

/* Trigger operations (bits 40..43 of a trigger's third word). */
enum : uint64_t {
  kPortPut = 1,
  kPortSignal = 2,
  kPortPutWithSignal = 3,
  kPortFlush = 4,
  kPortPutValue = 5,
  kPortPutValueWithSignal = 6,
};

/* Return codes of the device calls (also the values of the channel's status word). */
enum : int {
  FLAGCX_PORT_OK = 0,
  FLAGCX_PORT_PEER_LOST = 1,    /* the peer died or closed its communicator */
  FLAGCX_PORT_BAD_TRIGGER = 2,  /* a trigger named an unknown buffer or a range past its end */
  FLAGCX_PORT_DEVICE_ERROR = 3, /* the runtime failed a copy or a flag write */
  FLAGCX_PORT_CLOSED = 4,       /* closed, aborted, or poisoned by the application */
  FLAGCX_PORT_POISONED = 5,     /* this rank's flag holds the poison value */
  FLAGCX_PORT_OUT_OF_RANGE = 6, /* buffer index >= 1024, size >= 1 TiB, or a value put's
                                   offset not a multiple of 8: not sent */
};

/* The flag value that means "failed". */
static constexpr uint64_t kPortPoison = ~uint64_t(0);

} /* namespace flagcx */

/* The raw handle: device-visible addresses and the FIFO's depth (56 bytes, = Rust's PortRaw and
 * flagcx.h's flagcxPortChannelHandle_t, defined under the same guard by whichever header comes
 * first). */
#ifndef FLAGCX_PORT_CHANNEL_HANDLE_DEFINED
#define FLAGCX_PORT_CHANNEL_HANDLE_DEFINED
typedef struct flagcxPortChannelHandle {
  uint64_t triggers; /* first trigger slot (host memory, device-mapped); slots are 32 bytes */
  uint64_t head;     /* slots reserved (device memory) */
  uint64_t tail;     /* triggers the proxy took (host memory) */
  uint64_t flushed;  /* sequence number of the last completed flush (host memory) */
  uint64_t status;   /* 0 while healthy, else a FLAGCX_PORT_* code (host memory) */
  uint64_t flag;     /* signals received from the peer (device memory) */
  uint32_t depth;    /* trigger slots */
  uint32_t reserved;
} flagcxPortChannelHandle_t;
#endif

namespace flagcx {

typedef ::flagcxPortChannelHandle PortChannelHandle;
static_assert(sizeof(PortChannelHandle) == 56, "PortChannelHandle must match Rust's PortRaw");

/* The buffer table sits this far past `head` in the channel's device words (Rust:
 * port::TABLE_OFF - port::HEAD_OFF): this rank's buffer count n, the peer's count m, (address,
 * length) of each of ours, then 1 for each of the peer's buffers a value put may write. */
static constexpr uint64_t kTableFromHead = 128;

struct PortChannel {
  PortChannelHandle h;
  uint64_t expected; /* signals this object has waited for */
  uint64_t tail;     /* the proxy's tail as last read: no bus read while the ring has room */
  uint64_t table;    /* the buffer table's address */
  uint64_t nlocal;   /* its counts (0 and 0: no puts go as values) */
  uint64_t nremote;

  __device__ static uint64_t load(uint64_t addr) {
    return *reinterpret_cast<volatile uint64_t *>(addr);
  }

  __device__ explicit PortChannel(const PortChannelHandle &handle)
      : h(handle), expected(0), tail(0), table(handle.head + kTableFromHead),
        nlocal(load(table)), nremote(load(table + 8)) {}

  /* Whether a put of `size` bytes from (src, src_off) to (dst, dst_off) can go as a value put;
   * if so, reads the 8 bytes into *v. */
  __device__ bool inline_value(uint32_t dst, uint64_t dst_off, uint32_t src, uint64_t src_off,
                               uint64_t size, uint64_t *v) const {
    if (size != 8 || ((src_off | dst_off) & 7) != 0 || src >= nlocal || dst >= nremote) return false;
    uint64_t base = load(table + 16 + 16 * uint64_t(src));
    uint64_t len = load(table + 24 + 16 * uint64_t(src));
    uint64_t ok = load(table + 16 + 16 * nlocal + 8 * uint64_t(dst));
    if (ok == 0 || (base & 7) != 0 || len < 8 || src_off > len - 8) return false;
    *v = load(base + src_off);
    return true;
  }

  __device__ int status() const {
    uint64_t s = load(h.status);
    return s == 0 ? FLAGCX_PORT_OK : (s > 4 ? FLAGCX_PORT_DEVICE_ERROR : int(s));
  }

  /* Reserves a slot, waits while the ring is full, writes the trigger and marks it valid
   * (after a system-scope fence, so the proxy never sees the mark before the fields, nor
   * the trigger before the data the device wrote for it), then fences again to push the mark
   * out.
   * Stores the trigger's sequence number in *seq. */
  __device__ int push(uint64_t w0, uint64_t w1, uint64_t w2, uint64_t *seq) {
    uint64_t slot = atomicAdd(reinterpret_cast<unsigned long long *>(h.head), 1ull);
    uint64_t spins = 0;
    /* The tail only grows: a cached value that leaves room is safe to trust. */
    while (slot - tail >= h.depth) {
      tail = load(h.tail);
      if ((++spins & 1023) == 0) {
        int s = status();
        if (s != FLAGCX_PORT_OK) return s;
      }
    }
    volatile uint64_t *t = reinterpret_cast<volatile uint64_t *>(h.triggers + (slot % h.depth) * 32);
    t[0] = w0;
    t[1] = w1;
    t[2] = w2;
    __threadfence_system();
    t[3] = slot + 1;
    /* Sends the mark on its way: without this fence it lingered, and the proxy saw triggers
     * ~0.5 us later (pick-up round trip 3.5 us against 3.0 with it, on an H200). */
    __threadfence_system();
    *seq = slot + 1;
    return FLAGCX_PORT_OK;
  }

  __device__ int trigger(uint64_t op, uint32_t dst, uint64_t dst_off, uint32_t src, uint64_t src_off,
                         uint64_t size, uint64_t *seq) {
    if (dst >= 1024 || src >= 1024 || size >= (uint64_t(1) << 40)) return FLAGCX_PORT_OUT_OF_RANGE;
    uint64_t w2 = size | op << 40 | uint64_t(src) << 44 | uint64_t(dst) << 54;
    return push(src_off, dst_off, w2, seq);
  }

  /* Copies size bytes from this rank's buffer src (at src_off) to the peer's buffer dst. */
  __device__ int put(uint32_t dst, uint64_t dst_off, uint32_t src, uint64_t src_off, uint64_t size) {
    uint64_t seq, v;
    if (inline_value(dst, dst_off, src, src_off, size, &v))
      return trigger_value(kPortPutValue, dst, dst_off, v, &seq);
    return trigger(kPortPut, dst, dst_off, src, src_off, size, &seq);
  }

  /* One signal to the peer, after everything earlier in the FIFO. */
  __device__ int signal() {
    uint64_t seq;
    return trigger(kPortSignal, 0, 0, 0, 0, 0, &seq);
  }

  /* put, then signal, as one trigger. */
  __device__ int put_with_signal(uint32_t dst, uint64_t dst_off, uint32_t src, uint64_t src_off,
                                 uint64_t size) {
    uint64_t seq, v;
    if (inline_value(dst, dst_off, src, src_off, size, &v))
      return trigger_value(kPortPutValueWithSignal, dst, dst_off, v, &seq);
    return trigger(kPortPutWithSignal, dst, dst_off, src, src_off, size, &seq);
  }

  /* Writes the 8 bytes of `value` into the peer's buffer dst at dst_off (a multiple of 8). */
  __device__ int put_value(uint32_t dst, uint64_t dst_off, uint64_t value) {
    uint64_t seq;
    if (dst_off % 8 != 0) return FLAGCX_PORT_OUT_OF_RANGE;
    return trigger_value(kPortPutValue, dst, dst_off, value, &seq);
  }

  /* put_value, then signal, as one trigger. */
  __device__ int put_value_with_signal(uint32_t dst, uint64_t dst_off, uint64_t value) {
    uint64_t seq;
    if (dst_off % 8 != 0) return FLAGCX_PORT_OUT_OF_RANGE;
    return trigger_value(kPortPutValueWithSignal, dst, dst_off, value, &seq);
  }

  /* A value put's trigger: the value where a put has its source offset, size 8. */
  __device__ int trigger_value(uint64_t op, uint32_t dst, uint64_t dst_off, uint64_t value,
                               uint64_t *seq) {
    if (dst >= 1024) return FLAGCX_PORT_OUT_OF_RANGE;
    return push(value, dst_off, uint64_t(8) | op << 40 | uint64_t(dst) << 54, seq);
  }

  /* Returns once everything earlier in the FIFO completed (puts landed at the peer). */
  __device__ int flush() {
    uint64_t seq;
    int r = trigger(kPortFlush, 0, 0, 0, 0, 0, &seq);
    if (r != FLAGCX_PORT_OK) return r;
    uint64_t spins = 0;
    while (load(h.flushed) < seq) {
      if ((++spins & 1023) == 0) {
        int s = status();
        if (s != FLAGCX_PORT_OK) return s;
      }
    }
    return FLAGCX_PORT_OK;
  }

  /* Waits for the peer's next signal; the data it put before that signal is then visible. */
  __device__ int wait() {
    uint64_t want = expected + 1;
    uint64_t spins = 0;
    for (;;) {
      uint64_t v = load(h.flag);
      if (v == kPortPoison) return FLAGCX_PORT_POISONED;
      if (v >= want) break;
      if ((++spins & 1023) == 0) {
        int s = status();
        if (s != FLAGCX_PORT_OK) return s;
      }
    }
    expected = want;
    __threadfence_system();
    return FLAGCX_PORT_OK;
  }
};

} /* namespace flagcx */

#endif /* FLAGCX_DEVICE_CUH */
