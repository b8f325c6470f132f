/* Floor of an 8 B CUDA IPC round trip between two processes on one GPU, with no flagcx code:
 * what the hardware and driver cost for each way of moving the bytes and saying so.
 * Build: cc -O2 -o ipc_floor ipc_floor.c -ldl   (no CUDA headers needed; libcuda is dlopened)
 * Modes (rank 0 is the copier unless said; flags are words in shared memory, spun on):
 *   flags        no GPU work: the two hand-offs alone
 *   sync         rank 0 copies 8 B into rank 1's buffer, cuStreamSynchronize, flag; rank 1 flags
 *                back; rank 0 copies rank 1's buffer into its own, synchronize
 *   event        the same, completion found by polling cuEventQuery
 *   event+query  and rank 1 queries its own (idle) stream before answering
 *   both         each rank copies its own message into the other's buffer (two contexts)
 *   local        rank 0 alone: a copy inside its own buffer + synchronize, twice (the in-process
 *                ceiling that flagcx-perf's pingpong compares with)
 * Second argument: the message size (default 8; the buffers are 1 GiB). */
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
typedef struct { char reserved[64]; } CUipcMemHandle;
static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuCtxCreate)(void **, unsigned, int);
static CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
static CUresult (*cuIpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned);
static CUresult (*cuStreamCreate)(void **, unsigned);
static CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, void *);
static CUresult (*cuStreamSynchronize)(void *);
static CUresult (*cuStreamQuery)(void *);
static CUresult (*cuEventCreate)(void **, unsigned);
static CUresult (*cuEventRecord)(void *, void *);
static CUresult (*cuEventQuery)(void *);
static CUresult (*cuCtxSetCurrent)(void *);

#define CK(x) do { CUresult r_ = (x); if (r_) { fprintf(stderr, "%s: %d\n", #x, r_); exit(1); } } while (0)
static void *sym(void *h, const char *n) {
  void *p = dlsym(h, n);
  if (!p) { fprintf(stderr, "missing %s\n", n); exit(1); }
  return p;
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }

struct shared { CUipcMemHandle h[2]; _Atomic int ready[2], done[2]; _Atomic long ping, pong; };
enum { FLAGS, SYNC, EVENT, EVENTQ, BOTH, LOCAL, NMODES };
static const char *names[] = {"flags", "sync", "event", "event+query", "both", "local"};

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 20000;
  size_t n = argc > 2 ? strtoull(argv[2], 0, 0) : 8, cap = (size_t)1 << 30;
  struct shared *sh = mmap(0, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset(sh, 0, sizeof *sh);
  int me = fork() == 0 ? 1 : 0;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) { fprintf(stderr, "skipped: %s\n", dlerror()); return 0; }
  cuInit = sym(lib, "cuInit"); cuDeviceGet = sym(lib, "cuDeviceGet"); cuCtxCreate = sym(lib, "cuCtxCreate_v2");
  cuMemAlloc = sym(lib, "cuMemAlloc_v2"); cuIpcGetMemHandle = sym(lib, "cuIpcGetMemHandle");
  cuIpcOpenMemHandle = sym(lib, "cuIpcOpenMemHandle_v2"); cuStreamCreate = sym(lib, "cuStreamCreate");
  cuMemcpyDtoDAsync = sym(lib, "cuMemcpyDtoDAsync_v2"); cuStreamSynchronize = sym(lib, "cuStreamSynchronize");
  cuStreamQuery = sym(lib, "cuStreamQuery"); cuEventCreate = sym(lib, "cuEventCreate");
  cuEventRecord = sym(lib, "cuEventRecord"); cuEventQuery = sym(lib, "cuEventQuery");
  cuCtxSetCurrent = sym(lib, "cuCtxSetCurrent");
  int dev; void *ctx, *s, *ev; CUdeviceptr mine, peer;
  CK(cuInit(0)); CK(cuDeviceGet(&dev, 0));
  CK(cuCtxCreate(&ctx, 1 /* CU_CTX_SCHED_SPIN */, dev));
  CK(cuMemAlloc(&mine, 2 * cap)); CK(cuStreamCreate(&s, 1)); CK(cuEventCreate(&ev, 2 /* no timing */));
  CK(cuIpcGetMemHandle(&sh->h[me], mine));
  atomic_store(&sh->ready[me], 1);
  while (!atomic_load(&sh->ready[1 - me])) ;
  CK(cuIpcOpenMemHandle(&peer, sh->h[1 - me], 1));
  for (int m = 0; m < NMODES; m++) {
    double t0 = 0;
    for (long i = 1; i <= iters + iters / 10; i++) {
      if (i == iters / 10 + 1) t0 = now();
      if (me == 0) {
        if (m == LOCAL) {
          for (int k = 0; k < 2; k++) { CK(cuMemcpyDtoDAsync(mine + cap, mine, n, s)); CK(cuStreamSynchronize(s)); }
          continue;
        }
        if (m != FLAGS) {
          CK(cuMemcpyDtoDAsync(peer, mine, n, s));
          if (m == SYNC) CK(cuStreamSynchronize(s));
          else { CK(cuEventRecord(ev, s)); while (cuEventQuery(ev)) ; }
        }
        atomic_store(&sh->ping, i);
        while (atomic_load(&sh->pong) != i) ;
        if (m != FLAGS && m != BOTH) {
          CK(cuMemcpyDtoDAsync(mine, peer, n, s));
          if (m == SYNC) CK(cuStreamSynchronize(s));
          else { CK(cuEventRecord(ev, s)); while (cuEventQuery(ev)) ; }
        }
      } else {
        if (m == LOCAL) continue;
        while (atomic_load(&sh->ping) != i) ;
        if (m == EVENTQ) CK(cuStreamQuery(s));
        if (m == BOTH) { CK(cuMemcpyDtoDAsync(peer, mine, n, s)); CK(cuEventRecord(ev, s)); while (cuEventQuery(ev)) ; }
        atomic_store(&sh->pong, i);
      }
    }
    if (me == 0) printf("%-12s %10zu B %9.2f us per round trip\n", names[m], n, (now() - t0) / iters);
    /* both ranks leave the mode together (message numbers restart at 1, never equal to the last) */
    atomic_store(&sh->done[me], m + 1);
    while (atomic_load(&sh->done[1 - me]) != m + 1) ;
  }
  if (me == 0) {
    /* What single driver calls cost on the latency path (rank 1 idle). */
    double t;
    CK(cuStreamSynchronize(s));
    t = now(); for (int i = 0; i < 100000; i++) CK(cuStreamQuery(s));
    printf("cuStreamQuery, idle stream   %6.3f us per call\n", (now() - t) / 100000);
    t = now(); for (int i = 0; i < 100000; i++) CK(cuCtxSetCurrent(ctx));
    printf("cuCtxSetCurrent, current     %6.3f us per call\n", (now() - t) / 100000);
    CK(cuEventRecord(ev, s)); CK(cuStreamSynchronize(s));
    t = now(); for (int i = 0; i < 100000; i++) CK(cuEventQuery(ev));
    printf("cuEventQuery, completed      %6.3f us per call\n", (now() - t) / 100000);
    t = now(); for (int i = 0; i < 500; i++) { CK(cuEventRecord(ev, s)); }
    printf("cuEventRecord                %6.3f us per call\n", (now() - t) / 500);
    CK(cuStreamSynchronize(s));
    t = now(); for (int i = 0; i < 500; i++) { CK(cuMemcpyDtoDAsync(mine + cap, mine, 8, s)); }
    printf("cuMemcpyDtoDAsync 8 B issue  %6.3f us per call\n", (now() - t) / 500);
    CK(cuStreamSynchronize(s));
    wait(0);
  }
  return 0;
}
