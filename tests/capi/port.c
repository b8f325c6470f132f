/* Port channels from C on host ranks, whose device memory is this process's memory: the test
 * drives the trigger FIFO itself (the protocol of flagcx/device.cuh, in C11 atomics) — a put
 * with a signal, checked byte for byte, an acknowledgement, then a poisoned channel that
 * releases the peer's wait; and the calls' argument errors. */
#include "common.h"

#include <sched.h>
#include <time.h>

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Reserves a slot, waits for room, writes the trigger and marks it valid; its sequence number. */
static uint64_t push(const flagcxPortChannelHandle_t *h, uint64_t w0, uint64_t w1, uint64_t w2) {
  uint64_t slot = __atomic_fetch_add((uint64_t *)(uintptr_t)h->head, 1, __ATOMIC_ACQ_REL);
  double t0 = now_s();
  while (slot - __atomic_load_n((uint64_t *)(uintptr_t)h->tail, __ATOMIC_ACQUIRE) >= h->depth) {
    EXPECT(now_s() - t0 < 20, "the proxy never took slot %llu", (unsigned long long)slot);
    sched_yield();
  }
  uint64_t *t = (uint64_t *)(uintptr_t)(h->triggers + (slot % h->depth) * 32);
  t[0] = w0;
  t[1] = w1;
  t[2] = w2;
  __atomic_store_n(&t[3], slot + 1, __ATOMIC_RELEASE);
  return slot + 1;
}

/* Waits until the flag reaches want (or holds the poison value); returns it. */
static uint64_t wait_flag(const flagcxPortChannelHandle_t *h, uint64_t want) {
  double t0 = now_s();
  for (;;) {
    uint64_t v = __atomic_load_n((uint64_t *)(uintptr_t)h->flag, __ATOMIC_ACQUIRE);
    if (v >= want) return v;
    EXPECT(now_s() - t0 < 20, "flag stayed %llu, waiting for %llu", (unsigned long long)v,
           (unsigned long long)want);
    sched_yield();
  }
}

int main(void) {
  int rank = env_int("FLAGCX_RANK"), nranks = env_int("FLAGCX_NRANKS");
  EXPECT(nranks == 2, "two ranks, not %d", nranks);
  int peer = 1 - rank;
  flagcxUniqueId id;
  share_unique_id(rank, &id);
  flagcxDeviceHandle_t dev;
  CHECK(flagcxDeviceHandleInit(&dev));
  flagcxComm_t comm;
  CHECK(flagcxCommInitRank(&comm, nranks, &id, rank));

  enum { BYTES = 4096 };
  void *src, *dst, *regs[2];
  CHECK(dev->deviceMalloc(&src, BYTES, flagcxMemDevice, NULL));
  CHECK(dev->deviceMalloc(&dst, BYTES, flagcxMemDevice, NULL));
  CHECK(flagcxCommRegister(comm, src, BYTES, &regs[0], flagcxMemCCL));
  CHECK(flagcxCommRegister(comm, dst, BYTES, &regs[1], flagcxMemCCL));
  memset(dst, 0, BYTES);

  flagcxPortChannel_t ch;
  flagcxPortChannelHandle_t h;
  EXPECT(flagcxPortChannelCreate(comm, rank, (void *const *)regs, 2, 4, &ch, &h) ==
             flagcxInvalidArgument,
         "a channel with this rank itself");
  EXPECT(flagcxPortChannelCreate(comm, peer, (void *const *)regs, 2, -1, &ch, &h) ==
             flagcxInvalidArgument,
         "a negative depth");
  EXPECT(flagcxPortChannelCreate(comm, peer, NULL, 2, 4, &ch, &h) == flagcxInvalidArgument,
         "a NULL handle list");
  EXPECT(flagcxPortChannelCreate(comm, peer, (void *const *)regs, 2, 4, NULL, &h) ==
             flagcxInvalidArgument,
         "a NULL channel pointer");
  CHECK(flagcxPortChannelCreate(comm, peer, (void *const *)regs, 2, 4, &ch, &h));
  EXPECT(h.depth == 4 && h.reserved == 0 && h.triggers && h.head && h.tail && h.flushed &&
             h.status && h.flag,
         "device handle fields");

  /* Buffer 0 is each rank's src, buffer 1 its dst. */
  unsigned char *s = src, *d = dst;
  for (int i = 0; i < BYTES; i++) s[i] = (unsigned char)(i * 7 + rank);
  const uint64_t put_with_signal = (uint64_t)BYTES | 3ull << 40 | 0ull << 44 | 1ull << 54;
  const uint64_t signal = 2ull << 40;
  if (rank == 0) {
    push(&h, 0, 0, put_with_signal);
    wait_flag(&h, 1); /* the acknowledgement */
  } else {
    wait_flag(&h, 1);
    for (int i = 0; i < BYTES; i++)
      EXPECT(d[i] == (unsigned char)(i * 7 + peer), "byte %d: %u", i, d[i]);
    push(&h, 0, 0, signal);
  }
  CHECK(flagcxPortChannelCheck(ch));

  /* Rank 0 gives up on the channel: rank 1's flag turns to poison. */
  if (rank == 0) {
    CHECK(flagcxPortChannelPoison(ch));
    EXPECT(flagcxPortChannelCheck(ch) != flagcxSuccess, "a poisoned channel checks healthy");
    EXPECT(flagcxPortChannelClose(ch) != flagcxSuccess, "closing a poisoned channel succeeds");
  } else {
    EXPECT(wait_flag(&h, 2) == UINT64_MAX, "rank 1's flag is not poisoned");
    CHECK(flagcxPortChannelClose(ch));
  }
  EXPECT(flagcxPortChannelClose(NULL) == flagcxInvalidArgument, "closing NULL");

  CHECK(flagcxCommDeregister(comm, regs[0], flagcxMemCCL));
  CHECK(flagcxCommDeregister(comm, regs[1], flagcxMemCCL));
  CHECK(dev->deviceFree(src, flagcxMemDevice, NULL));
  CHECK(dev->deviceFree(dst, flagcxMemDevice, NULL));
  CHECK(flagcxCommDestroy(comm));
  printf("capi port ok: rank %d\n", rank);
  return 0;
}
