/* Which driver calls block while another thread of the process sits in a copy from device
 * memory into pageable host memory, queued behind a stream wait that only the host releases
 * (the shape of a client reading a result behind a stream-ordered operation, #60).
 * Build: cc -O2 -o pageable_calls pageable_calls.c -ldl -lpthread
 * Run:   pageable_calls <mode> <call>   mode: pageable | pageable_h2d | pinned | none (what
 *        thread A does on T; PROBE_T=legacy makes T the legacy default stream)
 * Prints: "<mode> <call>: returns in X ms" or "<mode> <call>: BLOCKED (>1500 ms)". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
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
typedef void (*hostfn)(void *);
static void *lib;
static void *sym(const char *a, const char *b) {
  void *p = dlsym(lib, a);
  if (!p && b) p = dlsym(lib, b);
  if (!p) { fprintf(stderr, "no symbol %s\n", a); exit(2); }
  return p;
}
static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuDevicePrimaryCtxRetain)(void **, int);
static CUresult (*cuCtxSetCurrent)(void *);
static CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*cuMemFree)(CUdeviceptr);
static CUresult (*cuMemAllocHost)(void **, size_t);
static CUresult (*cuMemHostRegister)(void *, size_t, unsigned);
static CUresult (*cuMemHostUnregister)(void *);
static CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned);
static CUresult (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
static CUresult (*cuIpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned);
static CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
static CUresult (*cuStreamCreate)(void **, unsigned);
static CUresult (*cuStreamSynchronize)(void *);
static CUresult (*cuStreamQuery)(void *);
static CUresult (*cuEventCreate)(void **, unsigned);
static CUresult (*cuEventRecord)(void *, void *);
static CUresult (*cuEventQuery)(void *);
static CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, void *);
static CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, void *);
static CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, void *);
static CUresult (*cuStreamWaitValue32)(void *, CUdeviceptr, uint32_t, unsigned);
static CUresult (*cuStreamWriteValue32)(void *, CUdeviceptr, uint32_t, unsigned);
static CUresult (*cuLaunchHostFunc)(void *, hostfn, void *);
static CUresult (*cuPointerGetAttribute)(void *, int, CUdeviceptr);
static CUresult (*cuMemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
static CUresult (*cuModuleLoadData)(void **, const void *);
static CUresult (*cuModuleGetFunction)(void **, void *, const char *);
static CUresult (*cuLaunchKernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
static CUresult (*cuStreamWaitValue64)(void *, CUdeviceptr, uint64_t, unsigned);
static CUresult (*cuStreamWriteValue64)(void *, CUdeviceptr, uint64_t, unsigned);
static void *noop_fn;
static const char *PTX = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry noop()\n{\n ret;\n}\n";

static void load(void) {
  lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) { fprintf(stderr, "no libcuda\n"); exit(2); }
  cuInit = sym("cuInit", 0);
  cuDeviceGet = sym("cuDeviceGet", 0);
  cuDevicePrimaryCtxRetain = sym("cuDevicePrimaryCtxRetain", 0);
  cuCtxSetCurrent = sym("cuCtxSetCurrent", 0);
  cuMemAlloc = sym("cuMemAlloc_v2", 0);
  cuMemFree = sym("cuMemFree_v2", 0);
  cuMemAllocHost = sym("cuMemAllocHost_v2", 0);
  cuMemHostRegister = sym("cuMemHostRegister_v2", "cuMemHostRegister");
  cuMemHostUnregister = sym("cuMemHostUnregister", 0);
  cuMemHostGetDevicePointer = sym("cuMemHostGetDevicePointer_v2", 0);
  cuIpcGetMemHandle = sym("cuIpcGetMemHandle", 0);
  cuIpcOpenMemHandle = sym("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle");
  cuIpcCloseMemHandle = sym("cuIpcCloseMemHandle", 0);
  cuStreamCreate = sym("cuStreamCreate", 0);
  cuStreamSynchronize = sym("cuStreamSynchronize", 0);
  cuStreamQuery = sym("cuStreamQuery", 0);
  cuEventCreate = sym("cuEventCreate", 0);
  cuEventRecord = sym("cuEventRecord", 0);
  cuEventQuery = sym("cuEventQuery", 0);
  cuMemcpyDtoHAsync = sym("cuMemcpyDtoHAsync_v2", 0);
  cuMemcpyHtoDAsync = sym("cuMemcpyHtoDAsync_v2", 0);
  cuMemcpyDtoDAsync = sym("cuMemcpyDtoDAsync_v2", 0);
  cuStreamWaitValue32 = sym("cuStreamWaitValue32_v2", "cuStreamWaitValue32");
  cuStreamWriteValue32 = sym("cuStreamWriteValue32_v2", "cuStreamWriteValue32");
  cuLaunchHostFunc = sym("cuLaunchHostFunc", 0);
  cuPointerGetAttribute = sym("cuPointerGetAttribute", 0);
  cuMemGetAddressRange = sym("cuMemGetAddressRange_v2", 0);
  cuModuleLoadData = sym("cuModuleLoadData", 0);
  cuModuleGetFunction = sym("cuModuleGetFunction", 0);
  cuLaunchKernel = sym("cuLaunchKernel", 0);
  cuStreamWaitValue64 = sym("cuStreamWaitValue64_v2", "cuStreamWaitValue64");
  cuStreamWriteValue64 = sym("cuStreamWriteValue64_v2", "cuStreamWriteValue64");
}
#define CK(x) do { CUresult r_ = (x); if (r_) { fprintf(stderr, "%s: %d\n", #x, r_); exit(3); } } while (0)

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void *ctx;
static void *T, *S2;
static CUdeviceptr dbuf, dbuf2, dflag, dword2, freeme;
static volatile uint32_t *flag;
static void *pageable, *pinned, *reg_page;
static CUipcMemHandle peer_handle;
static CUdeviceptr opened_early;
static const char *mode, *call;
static atomic_int a_done, p_done;
static CUresult p_result;
static void noop(void *x) { (void)x; }

static void *thread_a(void *x) {
  (void)x;
  CK(cuCtxSetCurrent(ctx));
  if (!strcmp(mode, "pageable")) CK(cuMemcpyDtoHAsync(pageable, dbuf, 1 << 20, T));
  else if (!strcmp(mode, "pageable_h2d")) CK(cuMemcpyHtoDAsync(dbuf, pageable, 1 << 20, T));
  else if (!strcmp(mode, "pinned")) CK(cuMemcpyDtoHAsync(pinned, dbuf, 1 << 20, T));
  CK(cuStreamSynchronize(T));
  atomic_store(&a_done, 1);
  return 0;
}

static void *thread_p(void *x) {
  (void)x;
  CK(cuCtxSetCurrent(ctx));
  CUresult r = 0;
  void *e, *s;
  CUdeviceptr d;
  size_t sz;
  if (!strcmp(call, "eventquery")) { CK(cuEventCreate(&e, 2)); r = cuEventQuery(e); }
  else if (!strcmp(call, "eventrecord")) { CK(cuEventCreate(&e, 2)); r = cuEventRecord(e, S2); }
  else if (!strcmp(call, "d2d")) r = cuMemcpyDtoDAsync(dbuf2, dbuf, 4096, S2);
  else if (!strcmp(call, "d2d_ipc")) r = cuMemcpyDtoDAsync(opened_early, dbuf2, 4096, S2);
  else if (!strcmp(call, "h2d_pinned")) r = cuMemcpyHtoDAsync(dbuf2, pinned, 4096, S2);
  else if (!strcmp(call, "d2h_pinned")) r = cuMemcpyDtoHAsync(pinned, dbuf2, 4096, S2);
  else if (!strcmp(call, "writevalue")) r = cuStreamWriteValue32(S2, dword2, 7, 0);
  else if (!strcmp(call, "hostfunc")) r = cuLaunchHostFunc(S2, noop, 0);
  else if (!strcmp(call, "streamquery")) r = cuStreamQuery(S2);
  else if (!strcmp(call, "streamsync")) r = cuStreamSynchronize(S2);
  else if (!strcmp(call, "streamcreate")) r = cuStreamCreate(&s, 1);
  else if (!strcmp(call, "eventcreate")) r = cuEventCreate(&e, 2);
  else if (!strcmp(call, "ipcopen")) r = cuIpcOpenMemHandle(&d, peer_handle, 1);
  else if (!strcmp(call, "ipcclose")) r = cuIpcCloseMemHandle(opened_early);
  else if (!strcmp(call, "ipcget")) { CUipcMemHandle h; r = cuIpcGetMemHandle(&h, dbuf2); }
  else if (!strcmp(call, "hostregister")) {
    void *m = mmap(0, 8 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    memset(m, 1, 8 << 20);
    r = cuMemHostRegister(m, 8 << 20, 3);
  }
  else if (!strcmp(call, "hostunregister")) r = cuMemHostUnregister(reg_page);
  else if (!strcmp(call, "memalloc")) r = cuMemAlloc(&d, 1 << 20);
  else if (!strcmp(call, "memfree")) r = cuMemFree(freeme);
  else if (!strcmp(call, "allochost")) { void *h; r = cuMemAllocHost(&h, 1 << 20); }
  else if (!strcmp(call, "pointerattr")) { int m = 0; r = cuPointerGetAttribute(&m, 2, dbuf); }
  else if (!strcmp(call, "addrrange")) r = cuMemGetAddressRange(&d, &sz, dbuf + 16);
  else if (!strcmp(call, "d2h_pageable_s2")) r = cuMemcpyDtoHAsync(malloc(4096), dbuf2, 4096, S2);
  else if (!strcmp(call, "h2d_pageable_s2")) r = cuMemcpyHtoDAsync(dbuf2, malloc(4096), 4096, S2);
  else if (!strcmp(call, "launch")) r = cuLaunchKernel(noop_fn, 1, 1, 1, 32, 1, 1, 0, S2, 0, 0);
  else if (!strcmp(call, "waitvalue64")) r = cuStreamWaitValue64(S2, dword2, 0, 0);
  else if (!strcmp(call, "writevalue64")) r = cuStreamWriteValue64(S2, dword2, 9, 0);
  else { fprintf(stderr, "unknown call %s\n", call); exit(2); }
  p_result = r;
  atomic_store(&p_done, 1);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 3) { fprintf(stderr, "usage: probe <mode> <call>\n"); return 2; }
  mode = argv[1];
  call = argv[2];
  int tochild[2], toparent[2];
  if (pipe(tochild) || pipe(toparent)) return 2;
  pid_t pid = fork();
  load();
  int dev;
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  if (pid == 0) { /* the peer: exports an allocation, lives until told */
    CUdeviceptr p;
    CUipcMemHandle h;
    CK(cuMemAlloc(&p, 1 << 21));
    CK(cuIpcGetMemHandle(&h, p));
    CK(cuMemAlloc(&p, 1 << 21));
    CUipcMemHandle h2;
    CK(cuIpcGetMemHandle(&h2, p));
    if (write(toparent[1], &h, 64) != 64 || write(toparent[1], &h2, 64) != 64) return 2;
    char c;
    if (read(tochild[0], &c, 1) < 0) return 2;
    return 0;
  }
  CUipcMemHandle early;
  if (read(toparent[0], &early, 64) != 64 || read(toparent[0], &peer_handle, 64) != 64) return 2;
  CK(cuIpcOpenMemHandle(&opened_early, early, 1));
  void *mod;
  CK(cuModuleLoadData(&mod, PTX));
  CK(cuModuleGetFunction(&noop_fn, mod, "noop"));
  CK(cuStreamCreate(&T, 1));
  /* PROBE_T=legacy: thread A's stream is the legacy default stream (torch's current stream
   * unless the program sets another), not a stream of its own. */
  if (getenv("PROBE_T") && !strcmp(getenv("PROBE_T"), "legacy")) T = 0;
  CK(cuStreamCreate(&S2, 1));
  CK(cuMemAlloc(&dbuf, 1 << 20));
  CK(cuMemAlloc(&dbuf2, 1 << 20));
  CK(cuMemAlloc(&freeme, 1 << 20));
  CK(cuMemAllocHost(&pinned, 1 << 20));
  pageable = malloc(1 << 20);
  memset(pageable, 0, 1 << 20);
  void *page = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  reg_page = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  CK(cuMemHostRegister(page, 4096, 3));
  CK(cuMemHostRegister(reg_page, 4096, 3));
  CK(cuMemHostGetDevicePointer(&dflag, page, 0));
  dword2 = dflag + 64;
  flag = page;
  *flag = 0;
  /* T waits until the host writes the flag (GEQ 1). */
  CK(cuStreamWaitValue32(T, dflag, 1, 0));
  pthread_t a, p;
  pthread_create(&a, 0, thread_a, 0);
  usleep(200000);
  double t0 = now_ms();
  pthread_create(&p, 0, thread_p, 0);
  while (!atomic_load(&p_done) && now_ms() - t0 < 1500) usleep(200);
  if (atomic_load(&p_done))
    printf("%-8s %-16s: returns in %.2f ms (result %d)\n", mode, call, now_ms() - t0, p_result);
  else
    printf("%-8s %-16s: BLOCKED (>1500 ms)\n", mode, call);
  __atomic_store_n(flag, 1, __ATOMIC_SEQ_CST);
  double t1 = now_ms();
  while ((!atomic_load(&a_done) || !atomic_load(&p_done)) && now_ms() - t1 < 3000) usleep(200);
  if (!atomic_load(&p_done)) printf("%-8s %-16s:   still blocked 3 s after the release\n", mode, call);
  else if (now_ms() - t0 >= 1500) printf("%-8s %-16s:   returned %.1f ms after the release\n", mode, call, now_ms() - t1);
  if (write(tochild[1], "x", 1) < 0) return 2;
  waitpid(pid, 0, 0);
  fflush(stdout);
  _exit(0);
}
