/* Floor of a port channel's two halves on one GPU, with no flagcx code (#23's targets):
 *
 *   pickup  a kernel publishes a 32-byte trigger into host memory in one of six ways
 *           (port_floor.cu's `publish`); a spinning host thread takes it and writes the tail
 *           back; the kernel waits for the tail. Microseconds per round trip.
 *   echo    a kernel writes a word into host memory; a host thread sees it and issues stream
 *           operations that deliver 8 bytes of data and a flag into device memory, in one of
 *           five ways; the kernel waits for the flag: a proxy's hop of an 8 B put-with-signal,
 *           less the peer's link. Microseconds per round trip, and the host's time to issue.
 *
 * Build and run (no CUDA headers needed at run time; libcuda is dlopened):
 *   python3 adaptors/cuda/kernels/ptx.py benches/probes/port_floor.cu port_floor.ptx
 *   cc -O2 -I<cuda include> -o port_floor benches/probes/port_floor.c -ldl -lpthread
 *   ./port_floor port_floor.ptx [rounds per measure, default 20000]
 */
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static CUresult (*pInit)(unsigned);
static CUresult (*pDeviceGet)(CUdevice *, int);
static CUresult (*pCtxCreate)(CUcontext *, unsigned, CUdevice);
static CUresult (*pCtxSetCurrent)(CUcontext);
static CUresult (*pModuleLoadData)(CUmodule *, const void *);
static CUresult (*pModuleGetFunction)(CUfunction *, CUmodule, const char *);
static CUresult (*pLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 unsigned, CUstream, void **, void **);
static CUresult (*pMemHostAlloc)(void **, size_t, unsigned);
static CUresult (*pMemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned);
static CUresult (*pMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*pMemsetD8)(CUdeviceptr, unsigned char, size_t);
static CUresult (*pMemcpyDtoH)(void *, CUdeviceptr, size_t);
static CUresult (*pMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
static CUresult (*pMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*pMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
static CUresult (*pStreamCreate)(CUstream *, unsigned);
static CUresult (*pStreamSynchronize)(CUstream);
static CUresult (*pStreamWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned);
static CUresult (*pStreamBatchMemOp)(CUstream, unsigned, CUstreamBatchMemOpParams *, unsigned);

#define CK(x)                                                   \
  do {                                                          \
    CUresult r_ = (x);                                          \
    if (r_) {                                                   \
      fprintf(stderr, "%s: CUDA error %d\n", #x, (int)r_);      \
      exit(1);                                                  \
    }                                                           \
  } while (0)

static void *sym(void *h, const char *a, const char *b) {
  void *p = dlsym(h, a);
  if (!p && b) p = dlsym(h, b);
  if (!p) {
    fprintf(stderr, "libcuda has no %s\n", a);
    exit(1);
  }
  return p;
}

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static unsigned n_rounds;
static CUcontext ctx;
static CUstream ops;
static volatile uint64_t *trig, *tail, *ping, *staged;
static CUdeviceptr dflag, ddst, dsrc;
static int variant;
static CUfunction fput;
static double issue_us;

/* Spins until `cond` holds; gives up (the kernel then never finishes: exit) after 10 s. */
#define SPIN_UNTIL(cond)                                               \
  do {                                                                 \
    double t0_ = now_us();                                             \
    for (unsigned long s_ = 1; !(cond); ++s_)                          \
      if ((s_ & 0xfffff) == 0 && now_us() - t0_ > 10e6) {              \
        fprintf(stderr, "timed out waiting for the kernel\n");         \
        exit(1);                                                       \
      }                                                                \
  } while (0)

static void *pickup_host(void *arg) {
  (void)arg;
  for (uint64_t i = 1; i <= n_rounds + 1; ++i) {
    if (variant == 3 || variant == 4) {
      SPIN_UNTIL(trig[0] == i && trig[1] == i && trig[2] == i && trig[3] == i);
    } else {
      SPIN_UNTIL(trig[3] == i);
      atomic_thread_fence(memory_order_acquire);
      if (variant != 5 && (trig[0] != i || trig[1] != i || trig[2] != i)) {
        fprintf(stderr, "variant %d: trigger %lu seen before its fields\n", variant, (unsigned long)i);
        exit(1);
      }
    }
    atomic_thread_fence(memory_order_release);
    *tail = i;
  }
  return NULL;
}

static void *echo_host(void *arg) {
  (void)arg;
  CK(pCtxSetCurrent(ctx));
  double issued = 0;
  for (uint64_t i = 1; i <= n_rounds + 1; ++i) {
    SPIN_UNTIL(*ping == i);
    double t0 = now_us();
    CUstreamBatchMemOpParams p[2];
    switch (variant) {
      case 0: /* the proxy today: a device copy, then a stream write of the flag */
        CK(pStreamWriteValue64(ops, dsrc, i, 0)); /* (the source: untimed below) */
        t0 = now_us();
        CK(pMemcpyDtoDAsync(ddst, dsrc, 8, ops));
        CK(pStreamWriteValue64(ops, dflag, i, 0));
        break;
      case 1: /* the data inline: one batch of two stream writes */
        memset(p, 0, sizeof p);
        p[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
        p[0].writeValue.address = ddst;
        p[0].writeValue.value64 = i;
        p[1].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
        p[1].writeValue.address = dflag;
        p[1].writeValue.value64 = i;
        CK(pStreamBatchMemOp(ops, 2, p, 0));
        break;
      case 2: /* two separate stream writes */
        CK(pStreamWriteValue64(ops, ddst, i, 0));
        CK(pStreamWriteValue64(ops, dflag, i, 0));
        break;
      case 3: /* a copy from pinned host memory, then the flag */
        *staged = i;
        CK(pMemcpyHtoDAsync(ddst, (const void *)staged, 8, ops));
        CK(pStreamWriteValue64(ops, dflag, i, 0));
        break;
      case 5: { /* one kernel launch: copy, fence, flag */
        CK(pStreamWriteValue64(ops, dsrc, i, 0)); /* (the source: untimed) */
        t0 = now_us();
        CUdeviceptr d = ddst, sp = dsrc, f = dflag;
        unsigned words = 1;
        uint64_t v = i;
        void *args[] = {&d, &sp, &words, &f, &v};
        CK(pLaunchKernel(fput, 1, 1, 1, 32, 1, 1, 0, ops, args, NULL));
        break;
      }
      case 6: /* the unified copy call, then the flag */
        CK(pStreamWriteValue64(ops, dsrc, i, 0));
        t0 = now_us();
        CK(pMemcpyAsync(ddst, dsrc, 8, ops));
        CK(pStreamWriteValue64(ops, dflag, i, 0));
        break;
      default: /* the flag alone: the floor of a stream-operation hop */
        CK(pStreamWriteValue64(ops, dflag, i, 0));
        break;
    }
    if (i > 1) issued += now_us() - t0;
  }
  issue_us = issued / n_rounds;
  return NULL;
}

static double run(CUfunction f, void **params, CUstream k, void *(*host)(void *), CUdeviceptr out) {
  pthread_t th;
  pthread_create(&th, NULL, host, NULL);
  CK(pLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, k, params, NULL));
  CK(pStreamSynchronize(k));
  pthread_join(th, NULL);
  CK(pStreamSynchronize(ops));
  uint64_t o[2] = {0, 0};
  CK(pMemcpyDtoH(o, out, 16));
  if (o[1]) printf("(%s variant %d: the data word was stale in %lu of %u rounds)\n",
                   host == echo_host ? "echo" : "pickup", variant, (unsigned long)o[1], n_rounds + 1);
  return o[0] / 1e3 / n_rounds;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s port_floor.ptx [rounds]\n", argv[0]);
    return 2;
  }
  n_rounds = argc > 2 ? (unsigned)atoi(argv[2]) : 20000;
  FILE *fp = fopen(argv[1], "rb");
  if (!fp) {
    perror(argv[1]);
    return 1;
  }
  static char ptx[1 << 20];
  size_t len = fread(ptx, 1, sizeof ptx - 1, fp);
  fclose(fp);
  ptx[len] = 0;
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) {
    fprintf(stderr, "skipped: no libcuda.so.1\n");
    return 0;
  }
  pInit = sym(h, "cuInit", 0);
  pDeviceGet = sym(h, "cuDeviceGet", 0);
  pCtxCreate = sym(h, "cuCtxCreate_v2", 0);
  pCtxSetCurrent = sym(h, "cuCtxSetCurrent", 0);
  pModuleLoadData = sym(h, "cuModuleLoadData", 0);
  pModuleGetFunction = sym(h, "cuModuleGetFunction", 0);
  pLaunchKernel = sym(h, "cuLaunchKernel", 0);
  pMemHostAlloc = sym(h, "cuMemHostAlloc", 0);
  pMemHostGetDevicePointer = sym(h, "cuMemHostGetDevicePointer_v2", 0);
  pMemAlloc = sym(h, "cuMemAlloc_v2", 0);
  pMemsetD8 = sym(h, "cuMemsetD8_v2", 0);
  pMemcpyDtoH = sym(h, "cuMemcpyDtoH_v2", 0);
  pMemcpyDtoDAsync = sym(h, "cuMemcpyDtoDAsync_v2", 0);
  pMemcpyHtoDAsync = sym(h, "cuMemcpyHtoDAsync_v2", 0);
  pMemcpyAsync = sym(h, "cuMemcpyAsync", 0);
  pStreamCreate = sym(h, "cuStreamCreate", 0);
  pStreamSynchronize = sym(h, "cuStreamSynchronize", 0);
  pStreamWriteValue64 = sym(h, "cuStreamWriteValue64_v2", "cuStreamWriteValue64");
  pStreamBatchMemOp = sym(h, "cuStreamBatchMemOp_v2", "cuStreamBatchMemOp");

  CUdevice dev;
  CUmodule mod;
  CUfunction fpick, fecho;
  CUstream k;
  CK(pInit(0));
  CK(pDeviceGet(&dev, 0));
  CK(pCtxCreate(&ctx, 0, dev));
  CK(pModuleLoadData(&mod, ptx));
  CK(pModuleGetFunction(&fpick, mod, "pickup"));
  CK(pModuleGetFunction(&fecho, mod, "echo"));
  CK(pModuleGetFunction(&fput, mod, "put_signal"));
  CK(pStreamCreate(&k, CU_STREAM_NON_BLOCKING));
  CK(pStreamCreate(&ops, CU_STREAM_NON_BLOCKING));
  void *page;
  CK(pMemHostAlloc(&page, 4096, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  memset(page, 0, 4096);
  CUdeviceptr dpage, dmem, dout;
  CK(pMemHostGetDevicePointer(&dpage, page, 0));
  trig = (volatile uint64_t *)page;
  tail = (volatile uint64_t *)((char *)page + 512);
  ping = (volatile uint64_t *)((char *)page + 1024);
  staged = (volatile uint64_t *)((char *)page + 1536);
  CK(pMemAlloc(&dmem, 4096));
  CK(pMemAlloc(&dout, 64));
  dflag = dmem;
  ddst = dmem + 256;
  dsrc = dmem + 512;
  CUdeviceptr dtrig = dpage, dtail = dpage + 512, dping = dpage + 1024;

  static const char *pick_names[] = {
      "fields, fence.sc.sys, mark, fence.sc.sys (device.cuh)",
      "fields, fence.sc.sys, mark",
      "fields, mark as st.release.sys",
      "fence.gpu, four tagged words",
      "fence.gpu, four tagged words, fence.sc.sys",
      "the mark alone, fence.sc.sys (bus echo)",
  };
  static const char *echo_names[] = {
      "device copy + stream write (the proxy today)",
      "one batch of two stream writes (data inline)",
      "two stream writes",
      "copy from pinned host + stream write",
      "one stream write (the flag alone)",
      "one kernel launch: copy, fence, flag",
      "cuMemcpyAsync + stream write",
  };
  enum { ROUNDS = 3 };
  double pick[6][ROUNDS], echo[7][ROUNDS], issue[7][ROUNDS];
  for (int r = 0; r < ROUNDS; ++r) {
    for (variant = 0; variant < 6; ++variant) {
      memset(page, 0, 2048);
      CK(pMemsetD8(dout, 0, 64));
      void *params[] = {&dtrig, &dtail, &variant, &n_rounds, &dout};
      pick[variant][r] = run(fpick, params, k, pickup_host, dout);
    }
    for (variant = 0; variant < 7; ++variant) {
      memset(page, 0, 2048);
      CK(pMemsetD8(dmem, 0, 4096));
      CK(pMemsetD8(dout, 0, 64));
      void *params[] = {&dping, &dflag, &ddst, &n_rounds, &dout};
      echo[variant][r] = run(fecho, params, k, echo_host, dout);
      issue[variant][r] = issue_us;
    }
  }
  printf("port_floor: %u rounds per measure, %d alternating rounds (min / median / max)\n", n_rounds,
         ROUNDS);
  printf("| trigger pick-up, round trip | us |\n|---|---|\n");
  for (int v = 0; v < 6; ++v) {
    qsort(pick[v], ROUNDS, sizeof(double), cmp);
    printf("| %s | %.2f / %.2f / %.2f |\n", pick_names[v], pick[v][0], pick[v][1], pick[v][2]);
  }
  printf("| proxy hop: kernel -> host -> stream ops -> kernel | us per round trip | host issue us |\n|---|---|---|\n");
  for (int v = 0; v < 7; ++v) {
    qsort(echo[v], ROUNDS, sizeof(double), cmp);
    qsort(issue[v], ROUNDS, sizeof(double), cmp);
    printf("| %s | %.2f / %.2f / %.2f | %.2f |\n", echo_names[v], echo[v][0], echo[v][1], echo[v][2],
           issue[v][1]);
  }
  return 0;
}
