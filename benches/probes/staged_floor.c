/* Floor of the staged transport between two processes on one GPU, with no flagcx code: rank 0
 * sends N bytes to rank 1 through a ring of pinned shared host memory (device->host copies of
 * chunks into slots, host->device copies out of them, both pipelined), rank 1 sends them back
 * the same way; printed as a ratio to the in-process pinned copy ceiling that flagcx-perf uses
 * (the slower of device->host and host->device, copies back to back, one synchronize).
 * Build: cc -O2 -o staged_floor staged_floor.c -ldl   (libcuda is dlopened)
 * Usage: staged_floor [iterations] [bytes] [chunk bytes...]   (ring: 8 slots of the chunk) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuCtxCreate)(void **, unsigned, int);
static CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*cuMemHostRegister)(void *, size_t, unsigned);
static CUresult (*cuStreamCreate)(void **, unsigned);
static CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, void *);
static CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, void *);
static CUresult (*cuStreamSynchronize)(void *);
static CUresult (*cuEventCreate)(void **, unsigned);
static CUresult (*cuEventRecord)(void *, void *);
static CUresult (*cuEventQuery)(void *);

#define CK(x) do { CUresult r_ = (x); if (r_) { fprintf(stderr, "%s: %d\n", #x, r_); exit(1); } } while (0)
static void *sym(void *h, const char *n) {
  void *p = dlsym(h, n);
  if (!p) { fprintf(stderr, "missing %s\n", n); exit(1); }
  return p;
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }

#define SLOTS 8
struct ring { _Atomic long tail, head; };  /* chunks published by the sender, drained by the receiver */
struct shared { struct ring ring[2]; _Atomic int phase[2]; };
static struct shared *sh;
static char *slots[2];  /* per direction: SLOTS chunks of pinned shared memory */
static void *stream, *ev[SLOTS];

/* Direction d: the sender copies device->slots, the receiver slots->device; chunks of c. */
static void send_msg(int d, CUdeviceptr src, size_t n, size_t c) {
  struct ring *r = &sh->ring[d];
  long base = atomic_load(&r->tail), issued = base, done = base;
  long chunks = (long)((n + c - 1) / c);
  while (done < base + chunks) {
    while (issued < base + chunks && issued - atomic_load(&r->head) < SLOTS) {
      size_t off = (size_t)(issued - base) * c, len = n - off < c ? n - off : c;
      CK(cuMemcpyDtoHAsync(slots[d] + (issued % SLOTS) * c, src + off, len, stream));
      CK(cuEventRecord(ev[issued % SLOTS], stream));
      issued++;
    }
    while (done < issued && cuEventQuery(ev[done % SLOTS]) == 0) atomic_store(&r->tail, ++done);
  }
}
static void recv_msg(int d, CUdeviceptr dst, size_t n, size_t c) {
  struct ring *r = &sh->ring[d];
  long base = atomic_load(&r->head), issued = base, done = base;
  long chunks = (long)((n + c - 1) / c);
  while (done < base + chunks) {
    while (issued < base + chunks && issued < atomic_load(&r->tail)) {
      size_t off = (size_t)(issued - base) * c, len = n - off < c ? n - off : c;
      CK(cuMemcpyHtoDAsync(dst + off, slots[d] + (issued % SLOTS) * c, len, stream));
      CK(cuEventRecord(ev[issued % SLOTS], stream));
      issued++;
    }
    while (done < issued && cuEventQuery(ev[done % SLOTS]) == 0) atomic_store(&r->head, ++done);
  }
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 20;
  size_t n = argc > 2 ? strtoull(argv[2], 0, 0) : 64 << 20, maxc = 16 << 20;
  sh = mmap(0, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  for (int d = 0; d < 2; d++)
    slots[d] = mmap(0, SLOTS * maxc, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  int me = fork() == 0 ? 1 : 0;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) { fprintf(stderr, "skipped: %s\n", dlerror()); return 0; }
  cuInit = sym(lib, "cuInit"); cuDeviceGet = sym(lib, "cuDeviceGet"); cuCtxCreate = sym(lib, "cuCtxCreate_v2");
  cuMemAlloc = sym(lib, "cuMemAlloc_v2"); cuMemHostRegister = sym(lib, "cuMemHostRegister_v2");
  cuStreamCreate = sym(lib, "cuStreamCreate"); cuMemcpyDtoHAsync = sym(lib, "cuMemcpyDtoHAsync_v2");
  cuMemcpyHtoDAsync = sym(lib, "cuMemcpyHtoDAsync_v2"); cuStreamSynchronize = sym(lib, "cuStreamSynchronize");
  cuEventCreate = sym(lib, "cuEventCreate"); cuEventRecord = sym(lib, "cuEventRecord"); cuEventQuery = sym(lib, "cuEventQuery");
  int dev; void *ctx; CUdeviceptr buf;
  CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuCtxCreate(&ctx, 1 /* spin */, dev));
  CK(cuMemAlloc(&buf, n)); CK(cuStreamCreate(&stream, 1));
  for (int i = 0; i < SLOTS; i++) CK(cuEventCreate(&ev[i], 2));
  for (int d = 0; d < 2; d++) CK(cuMemHostRegister(slots[d], SLOTS * maxc, 0));
  double ceil = 0;
  if (me == 0) {
    /* The ceiling, as flagcx-perf measures it. */
    char *host = slots[0];
    size_t c = n < SLOTS * maxc ? n : SLOTS * maxc;
    double t = now();
    for (int i = 0; i < iters; i++) CK(cuMemcpyDtoHAsync(host, buf, c, stream));
    CK(cuStreamSynchronize(stream));
    double d2h = (now() - t) / iters * (double)n / c;
    t = now();
    for (int i = 0; i < iters; i++) CK(cuMemcpyHtoDAsync(buf, host, c, stream));
    CK(cuStreamSynchronize(stream));
    double h2d = (now() - t) / iters * (double)n / c;
    ceil = d2h > h2d ? d2h : h2d;
    printf("%zu B: pinned ceiling %.1f us (d2h %.1f, h2d %.1f)\n", n, ceil, d2h, h2d);
    fflush(stdout);
    atomic_store(&sh->phase[0], 1);
  } else {
    while (atomic_load(&sh->phase[0]) != 1) ;
  }
  int argi = 3;
  size_t chunks[] = {1 << 20, 4 << 20, 8 << 20, 16 << 20};
  int nc = argc > 3 ? argc - 3 : 4;
  for (int k = 0; k < nc; k++) {
    size_t c = argc > 3 ? strtoull(argv[argi + k], 0, 0) : chunks[k];
    if (c > maxc) c = maxc;
    double t0 = 0;
    for (int i = 0; i < iters + 3; i++) {
      if (i == 3) t0 = now();
      if (me == 0) { send_msg(0, buf, n, c); recv_msg(1, buf, n, c); }
      else { recv_msg(0, buf, n, c); send_msg(1, buf, n, c); }
    }
    if (me == 0) {
      double rt = (now() - t0) / iters;
      printf("%zu B, %zu B chunks: round trip %.1f us, one way %.1f GB/s, ratio %.3f\n", n, c, rt,
             n / (rt / 2) / 1e3, 2 * ceil / rt);
      fflush(stdout);
    }
  }
  if (me == 0) wait(0);
  return 0;
}
