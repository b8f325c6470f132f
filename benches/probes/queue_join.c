/* Can a stream waiting on a host word (cuStreamWaitValue32: a flagcx stream join) hold up a
 * copy that a second stream of the same process enqueues after it?
 *
 * No flagcx code. For every variant: stream A waits for a word in pinned host memory; stream B
 * (the proxy's copy stream in flagcx) then copies 4 MiB and records an event; the host polls
 * that event for up to 300 ms, then writes the word so that A goes on. "ran" means the copy
 * finished while A waited; "HELD" means it did not: B's work queued behind A's wait in one
 * hardware queue, which in flagcx is a join waiting for the copy it holds up.
 *
 * Variants: B at the default or the greatest priority, B created right after A or after k other
 * streams (streams take the process's CUDA_DEVICE_MAX_CONNECTIONS queues in turn), and B in a
 * second context of the same device. Run it with CUDA_DEVICE_MAX_CONNECTIONS=1, unset (8) and
 * 32. Build: cc -O2 -I/usr/local/cuda/include queue_join.c -ldl -o queue_join
 */
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define FN(name, ...) static CUresult (*p_##name)(__VA_ARGS__)
FN(cuInit, unsigned);
FN(cuDeviceGet, CUdevice *, int);
FN(cuDevicePrimaryCtxRetain, CUcontext *, CUdevice);
FN(cuCtxCreate_v2, CUcontext *, unsigned, CUdevice);
FN(cuCtxSetCurrent, CUcontext);
FN(cuCtxSynchronize, void);
FN(cuCtxGetStreamPriorityRange, int *, int *);
FN(cuStreamCreateWithPriority, CUstream *, unsigned, int);
FN(cuStreamDestroy_v2, CUstream);
FN(cuMemAlloc_v2, CUdeviceptr *, size_t);
FN(cuMemHostAlloc, void **, size_t, unsigned);
FN(cuMemHostGetDevicePointer_v2, CUdeviceptr *, void *, unsigned);
FN(cuStreamWaitValue32_v2, CUstream, CUdeviceptr, uint32_t, unsigned);
FN(cuMemcpyDtoDAsync_v2, CUdeviceptr, CUdeviceptr, size_t, CUstream);
FN(cuEventCreate, CUevent *, unsigned);
FN(cuEventRecord, CUevent, CUstream);
FN(cuEventQuery, CUevent);
FN(cuMemsetD8_v2, CUdeviceptr, unsigned char, size_t);
FN(cuMemcpyDtoH_v2, void *, CUdeviceptr, size_t);
FN(cuStreamWaitEvent, CUstream, CUevent, unsigned);
FN(cuStreamSynchronize, CUstream);

#define CK(call)                                                                    \
  do {                                                                              \
    CUresult r_ = (call);                                                           \
    if (r_ != CUDA_SUCCESS) { fprintf(stderr, "%s: %d\n", #call, r_); exit(1); }    \
  } while (0)

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static volatile uint32_t *word;
static CUdeviceptr word_dev;
static uint32_t value;
static int lo, hi;
static CUcontext primary;

/* One trial: A (at `prio_a`) waits, B (created after `others` streams, at `prio`, in `ctx`)
 * copies. */
static void trial(const char *name, int others, int prio_a, int prio, CUcontext ctx, CUdeviceptr to, CUdeviceptr from) {
  CUstream a, b, extra[64];
  CUevent done;
  value++;
  CK(p_cuCtxSetCurrent(primary));
  CK(p_cuStreamCreateWithPriority(&a, CU_STREAM_NON_BLOCKING, prio_a));
  for (int i = 0; i < others; i++) CK(p_cuStreamCreateWithPriority(&extra[i], CU_STREAM_NON_BLOCKING, lo));
  CK(p_cuCtxSetCurrent(ctx));
  CK(p_cuStreamCreateWithPriority(&b, CU_STREAM_NON_BLOCKING, prio));
  CK(p_cuEventCreate(&done, CU_EVENT_DISABLE_TIMING));
  CK(p_cuStreamWaitValue32_v2(a, word_dev, value, CU_STREAM_WAIT_VALUE_GEQ));
  CK(p_cuMemcpyDtoDAsync_v2(to, from, 4 << 20, b));
  CK(p_cuEventRecord(done, b));
  double t0 = now_ms(), t;
  CUresult r;
  while ((r = p_cuEventQuery(done)) == CUDA_ERROR_NOT_READY && (t = now_ms()) - t0 < 300) {}
  printf("%-44s %s (%.3f ms)\n", name, r == CUDA_SUCCESS ? "ran" : "HELD", now_ms() - t0);
  *word = value;
  __sync_synchronize();
  CK(p_cuCtxSynchronize());
  CK(p_cuCtxSetCurrent(primary));
  CK(p_cuCtxSynchronize());
  CK(p_cuStreamDestroy_v2(b));
  CK(p_cuStreamDestroy_v2(a));
  for (int i = 0; i < others; i++) CK(p_cuStreamDestroy_v2(extra[i]));
}

int main(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) { puts("skipped: libcuda.so.1 not found"); return 0; }
#define LOAD(name) p_##name = dlsym(h, #name); if (!p_##name) { printf("no %s\n", #name); return 1; }
  LOAD(cuInit) LOAD(cuDeviceGet) LOAD(cuDevicePrimaryCtxRetain) LOAD(cuCtxCreate_v2)
  LOAD(cuCtxSetCurrent) LOAD(cuCtxSynchronize) LOAD(cuCtxGetStreamPriorityRange)
  LOAD(cuStreamCreateWithPriority) LOAD(cuStreamDestroy_v2) LOAD(cuMemAlloc_v2) LOAD(cuMemHostAlloc)
  LOAD(cuMemHostGetDevicePointer_v2) LOAD(cuStreamWaitValue32_v2) LOAD(cuMemcpyDtoDAsync_v2)
  LOAD(cuEventCreate) LOAD(cuEventRecord) LOAD(cuEventQuery)
  LOAD(cuMemsetD8_v2) LOAD(cuMemcpyDtoH_v2) LOAD(cuStreamWaitEvent) LOAD(cuStreamSynchronize)
  CUdevice dev;
  CUcontext second;
  void *host;
  CK(p_cuInit(0));
  CK(p_cuDeviceGet(&dev, 0));
  CK(p_cuDevicePrimaryCtxRetain(&primary, dev));
  CK(p_cuCtxSetCurrent(primary));
  CK(p_cuCtxGetStreamPriorityRange(&lo, &hi));
  CK(p_cuMemHostAlloc(&host, 4096, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  word = host;
  *word = 0;
  CK(p_cuMemHostGetDevicePointer_v2(&word_dev, host, 0));
  CUdeviceptr src, dst;
  CK(p_cuMemAlloc_v2(&src, 4 << 20));
  CK(p_cuMemAlloc_v2(&dst, 4 << 20));
  CK(p_cuCtxCreate_v2(&second, 0, dev));
  CUdeviceptr src2, dst2;
  CK(p_cuMemAlloc_v2(&src2, 4 << 20));
  CK(p_cuMemAlloc_v2(&dst2, 4 << 20));
  CK(p_cuCtxSetCurrent(primary));
  const char *env = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  printf("CUDA_DEVICE_MAX_CONNECTIONS=%s, priorities %d (least) .. %d (greatest)\n", env ? env : "(unset)", lo, hi);
  char name[96];
  for (int k = 0; k <= 16; k++) {
    snprintf(name, sizeof name, "B after %2d more streams, default priority", k);
    trial(name, k, lo, lo, primary, dst, src);
  }
  for (int k = 0; k <= 16; k += 4) {
    snprintf(name, sizeof name, "B after %2d more streams, greatest priority", k);
    trial(name, k, lo, hi, primary, dst, src);
  }
  trial("A and B at the greatest priority", 0, hi, hi, primary, dst, src);
  trial("A at the greatest, B at the default priority", 0, hi, lo, primary, dst, src);
  trial("B in a second context of the device", 0, lo, lo, second, dst2, src2);
  trial("B in a second context, greatest priority", 0, lo, hi, second, dst2, src2);
  /* Can a second context's stream copy between the primary context's allocations, after an
   * event of a primary stream? (What moving the proxy's copies there would need.) */
  {
    static unsigned char out[4 << 20];
    CUstream p, q;
    CUevent ready;
    CK(p_cuCtxSetCurrent(primary));
    CK(p_cuMemsetD8_v2(src, 0x5a, 4 << 20));
    CK(p_cuMemsetD8_v2(dst, 0, 4 << 20));
    /* The memsets run on the legacy stream, which the non-blocking stream below does not wait
     * for: without this the copy could read `src` before it was set (4 MiB "wrong" on one H200
     * with 8 queues, 2026-12-05). */
    CK(p_cuCtxSynchronize());
    CK(p_cuStreamCreateWithPriority(&p, CU_STREAM_NON_BLOCKING, lo));
    CK(p_cuEventCreate(&ready, CU_EVENT_DISABLE_TIMING));
    CK(p_cuEventRecord(ready, p));
    CK(p_cuCtxSetCurrent(second));
    CK(p_cuStreamCreateWithPriority(&q, CU_STREAM_NON_BLOCKING, lo));
    CUresult w = p_cuStreamWaitEvent(q, ready, 0);
    CUresult c = p_cuMemcpyDtoDAsync_v2(dst, src, 4 << 20, q);
    CUresult y = p_cuStreamSynchronize(q);
    CK(p_cuCtxSetCurrent(primary));
    CK(p_cuMemcpyDtoH_v2(out, dst, 4 << 20));
    size_t bad = 0;
    for (size_t i = 0; i < sizeof out; i++) bad += out[i] != 0x5a;
    printf("second context copies the primary's buffers after its event: wait %d, copy %d, sync %d, %zu wrong bytes\n", w, c, y, bad);
  }
  return 0;
}
