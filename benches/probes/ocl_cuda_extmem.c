/* Can NVIDIA's OpenCL platform import device memory that a CUDA process exported, so that a
 * CUDA rank and an OpenCL rank exchange through device memory instead of a host ring?
 * No flagcx code. The parent (CUDA only) makes a VMM allocation with a POSIX fd handle type,
 * exports it and passes the fd over a socketpair (SCM_RIGHTS) to a child that uses OpenCL only
 * (forked before either runtime starts, as two ranks would be). The child imports it with
 * cl_khr_external_memory (CL_EXTERNAL_MEMORY_HANDLE_OPAQUE_FD_KHR), checks bytes the parent
 * wrote, writes bytes the parent checks, and times clEnqueueCopyBuffer between the import and
 * its own buffer; the parent times cuMemcpyDtoD between a cuMemAlloc buffer and the export,
 * and (for comparison) pinned host copies. Then one 32 KiB copy at a time with its event
 * polled on each side, and the two processes taking turns as a staged pair does: device->device
 * copies (into or out of the export, or of private buffers) against the host ring's D2H and
 * host->device write - what one GPU's switches between the two processes cost - at 32 KiB,
 * then the host ring at 8 KiB and 512 B and the device ring at 8 MiB (does a small copy pay
 * the switch too? does a large one?).
 * Build: nvcc -O2 -o ocl_cuda_extmem ocl_cuda_extmem.c -lcuda -lOpenCL
 * Usage: OCL_ICD_VENDORS=<dir with nvidia.icd> ocl_cuda_extmem */
#define _GNU_SOURCE
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>

#define X_HANDLE_OPAQUE_FD 0x2060
#define X_DEVICE_IMPORT_TYPES 0x204F
#define X_PLATFORM_IMPORT_TYPES 0x2044
#define X_DEVICE_HANDLE_LIST 0x2051
typedef cl_int (*acquire_fn)(cl_command_queue, cl_uint, const cl_mem *, cl_uint, const cl_event *, cl_event *);

#define CK(x) do { cl_int e_ = (x); if (e_ != CL_SUCCESS) { printf("child: %s = %d\n", #x, e_); exit(1); } } while (0)
#define CU(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_ = ""; cuGetErrorString(r_, &s_); printf("parent: %s = %d (%s)\n", #x, r_, s_); exit(1); } } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void send_fd(int s, int fd, uint64_t size) {
  char ctl[CMSG_SPACE(sizeof(int))]; memset(ctl, 0, sizeof ctl);
  struct iovec io = {&size, sizeof size};
  struct msghdr m = {0}; m.msg_iov = &io; m.msg_iovlen = 1; m.msg_control = ctl; m.msg_controllen = sizeof ctl;
  struct cmsghdr *c = CMSG_FIRSTHDR(&m); c->cmsg_level = SOL_SOCKET; c->cmsg_type = SCM_RIGHTS; c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fd, sizeof fd);
  if (sendmsg(s, &m, 0) < 0) { perror("sendmsg"); exit(1); }
}
static int recv_fd(int s, uint64_t *size) {
  char ctl[CMSG_SPACE(sizeof(int))];
  struct iovec io = {size, sizeof *size};
  struct msghdr m = {0}; m.msg_iov = &io; m.msg_iovlen = 1; m.msg_control = ctl; m.msg_controllen = sizeof ctl;
  if (recvmsg(s, &m, 0) <= 0) { perror("recvmsg"); exit(1); }
  int fd; memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&m)), sizeof fd); return fd;
}
static void tell(int s, char c) { if (write(s, &c, 1) != 1) exit(1); }
static char hear(int s) { char c = 0; if (read(s, &c, 1) != 1) { printf("peer gone\n"); exit(1); } return c; }

static const size_t sizes[] = {8u << 20, 64u << 20, 256u << 20};
/* The turn-taking variants: bytes per copy, and whether it goes through host memory. */
#define TURNS 8
static const size_t turn_bytes[TURNS] = {32768, 32768, 32768, 32768, 32768, 8192, 512, 8u << 20};
static int turn_host(int k) { return k >= 4 && k <= 6; }

static int child(int s) {
  uint64_t size; int fd = recv_fd(s, &size);
  cl_platform_id plats[8]; cl_uint np = 0; CK(clGetPlatformIDs(8, plats, &np));
  cl_platform_id plat = 0; cl_device_id dev = 0;
  for (cl_uint p = 0; p < np && !plat; p++) {
    char name[256]; clGetPlatformInfo(plats[p], CL_PLATFORM_NAME, sizeof name, name, NULL);
    cl_uint nd = 0;
    if (strstr(name, "NVIDIA") && clGetDeviceIDs(plats[p], CL_DEVICE_TYPE_GPU, 1, &dev, &nd) == CL_SUCCESS && nd) plat = plats[p];
  }
  if (!plat) { printf("child: no NVIDIA OpenCL platform\n"); tell(s, 'n'); return 1; }
  char ver[256], ext[8192] = "";
  clGetDeviceInfo(dev, CL_DEVICE_VERSION, sizeof ver, ver, NULL);
  clGetDeviceInfo(dev, CL_DEVICE_EXTENSIONS, sizeof ext, ext, NULL);
  printf("child: %s; external extensions:", ver);
  for (char *t = strtok(ext, " "); t; t = strtok(NULL, " ")) if (strstr(t, "external")) printf(" %s", t);
  cl_uint types[8]; size_t tl = 0;
  cl_int te = clGetDeviceInfo(dev, X_DEVICE_IMPORT_TYPES, sizeof types, types, &tl);
  printf("\nchild: device import handle types (err %d):", te);
  for (size_t i = 0; te == CL_SUCCESS && i < tl / sizeof(cl_uint); i++) printf(" 0x%x", types[i]);
  printf("\n");
  cl_int e; cl_context ctx = clCreateContext(NULL, 1, &dev, NULL, NULL, &e); CK(e);
  cl_command_queue q = clCreateCommandQueueWithProperties(ctx, dev, NULL, &e); CK(e);
  cl_mem_properties props[] = {X_HANDLE_OPAQUE_FD, (cl_mem_properties)fd, X_DEVICE_HANDLE_LIST, (cl_mem_properties)dev, 0, 0};
  cl_mem imp = clCreateBufferWithProperties(ctx, props, CL_MEM_READ_WRITE, size, NULL, &e);
  if (e != CL_SUCCESS) {
    cl_mem_properties p2[] = {X_HANDLE_OPAQUE_FD, (cl_mem_properties)fd, 0};
    imp = clCreateBufferWithProperties(ctx, p2, CL_MEM_READ_WRITE, size, NULL, &e);
    printf("child: import with a device list failed; without: %d\n", e);
  }
  if (e != CL_SUCCESS) { printf("child: IMPORT FAILED %d\n", e); tell(s, 'n'); return 1; }
  acquire_fn acq = (acquire_fn)clGetExtensionFunctionAddressForPlatform(plat, "clEnqueueAcquireExternalMemObjectsKHR");
  acquire_fn rel = (acquire_fn)clGetExtensionFunctionAddressForPlatform(plat, "clEnqueueReleaseExternalMemObjectsKHR");
  printf("child: imported %llu bytes; acquire %s\n", (unsigned long long)size, acq ? "present" : "absent");
  if (acq) CK(acq(q, 1, &imp, 0, NULL, NULL));
  tell(s, 'y');
  /* Parent wrote byte i = (i*7+1) in the first 1 MiB. */
  hear(s);
  size_t chk = 1u << 20; unsigned char *h = malloc(chk);
  CK(clEnqueueReadBuffer(q, imp, CL_TRUE, 0, chk, h, 0, NULL, NULL));
  size_t bad = 0; for (size_t i = 0; i < chk; i++) bad += h[i] != (unsigned char)(i * 7 + 1);
  printf("child: read the parent's bytes through the import: %zu wrong of %zu\n", bad, chk);
  for (size_t i = 0; i < chk; i++) h[i] = (unsigned char)(i * 13 + 5);
  CK(clEnqueueWriteBuffer(q, imp, CL_TRUE, chk, chk, h, 0, NULL, NULL));
  tell(s, 'w');
  hear(s); /* parent checked */
  cl_mem own = clCreateBuffer(ctx, CL_MEM_READ_WRITE, size, NULL, &e); CK(e);
  for (int k = 0; k < 3; k++) {
    size_t sz = sizes[k]; if (sz > size) break;
    int it = 20;
    CK(clEnqueueCopyBuffer(q, imp, own, 0, 0, sz, 0, NULL, NULL)); CK(clFinish(q));
    double t = now();
    for (int i = 0; i < it; i++) CK(clEnqueueCopyBuffer(q, imp, own, 0, 0, sz, 0, NULL, NULL));
    CK(clFinish(q)); double a = (now() - t) / it;
    t = now();
    for (int i = 0; i < it; i++) CK(clEnqueueCopyBuffer(q, own, imp, 0, 0, sz, 0, NULL, NULL));
    CK(clFinish(q)); double b = (now() - t) / it;
    printf("child: %4zu MiB  import->own %7.1f GB/s  own->import %7.1f GB/s\n", sz >> 20, sz / a / 1e9, sz / b / 1e9);
  }
  /* One 32 KiB copy at a time, completion seen by polling its event (as the p2p engine does),
     on the queue that acquired the import, on a fresh queue that did not, and between two
     buffers of this process: what one staged chunk costs this side. */
  cl_command_queue q2 = clCreateCommandQueueWithProperties(ctx, dev, NULL, &e); CK(e);
  cl_mem own2 = clCreateBuffer(ctx, CL_MEM_READ_WRITE, 1u << 20, NULL, &e); CK(e);
  struct { const char *what; cl_command_queue q; cl_mem src; } polls[] = {
    {"import->own, acquiring queue", q, imp}, {"import->own, other queue", q2, imp},
    {"own->own, other queue", q2, own2}};
  for (int k = 0; k < 3; k++) {
    double t = now(), worst = 0;
    for (int i = 0; i < 200; i++) {
      double t1 = now(); cl_event ev;
      CK(clEnqueueCopyBuffer(polls[k].q, polls[k].src, own, 0, 0, 32768, 0, NULL, &ev)); CK(clFlush(polls[k].q));
      cl_int st = 1; while (st != CL_COMPLETE) CK(clGetEventInfo(ev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL));
      clReleaseEvent(ev); if (now() - t1 > worst) worst = now() - t1;
    }
    printf("child: 32 KiB copy, event polled, %-30s %7.1f us (worst %.1f)\n", polls[k].what, (now() - t) / 200 * 1e6, worst * 1e6);
  }
  /* 8 B copy + finish round trip, the small-message cost on this side. */
  double t = now();
  for (int i = 0; i < 1000; i++) { CK(clEnqueueCopyBuffer(q, imp, own, 0, 0, 8, 0, NULL, NULL)); CK(clFinish(q)); }
  printf("child: 8 B CopyBuffer + clFinish %.1f us\n", (now() - t) / 1000 * 1e6);
  /* Taking turns with the parent, as a staged pair does: it copies 32 KiB into the export,
     then this side copies it out (each polling its event, a socket byte between turns);
     then the same through pinned host memory (the parent's D2H into a shared mapping, this
     side's write from it). */
  void *hostbuf = NULL; { uint64_t dummy; int hfd = recv_fd(s, &dummy);
    hostbuf = mmap(NULL, 1u << 20, PROT_READ | PROT_WRITE, MAP_SHARED, hfd, 0); }
  cl_mem pin = clCreateBuffer(ctx, CL_MEM_USE_HOST_PTR, 1u << 20, hostbuf, &e); CK(e);
  void *pm = clEnqueueMapBuffer(q, pin, CL_TRUE, CL_MAP_READ | CL_MAP_WRITE, 0, 1u << 20, 0, NULL, NULL, &e); CK(e);
  (void)pm;
  tell(s, 'r');
  for (int k = 0; k < TURNS; k++) {
    cl_command_queue qq = k == 1 ? q : q2;
    for (int i = 0; i < 300; i++) {
      hear(s); cl_event ev;
      if (turn_host(k)) CK(clEnqueueWriteBuffer(qq, own, CL_FALSE, 0, turn_bytes[k], hostbuf, 0, NULL, &ev));
      else CK(clEnqueueCopyBuffer(qq, k == 2 ? own2 : imp, own, 0, 0, turn_bytes[k], 0, NULL, &ev));
      CK(clFlush(qq));
      cl_int st = 1; while (st != CL_COMPLETE) CK(clGetEventInfo(ev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL));
      clReleaseEvent(ev); tell(s, 'k');
    }
  }
  if (rel) CK(rel(q, 1, &imp, 0, NULL, NULL));
  CK(clFinish(q));
  clReleaseMemObject(imp); clReleaseMemObject(own);
  tell(s, 'd');
  return 0;
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  int sv[2]; if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) return 1;
  pid_t pid = fork();
  if (pid == 0) { close(sv[0]); return child(sv[1]); }
  close(sv[1]); int s = sv[0];
  CU(cuInit(0)); CUdevice d; CU(cuDeviceGet(&d, 0)); CUcontext ctx; CU(cuDevicePrimaryCtxRetain(&ctx, d)); CU(cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0; CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  size_t size = ((256u << 20) + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle hd; CU(cuMemCreate(&hd, size, &prop, 0));
  CUdeviceptr va; CU(cuMemAddressReserve(&va, size, 0, 0, 0)); CU(cuMemMap(va, size, 0, hd, 0));
  CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CU(cuMemSetAccess(va, size, &acc, 1));
  int fd = -1; CU(cuMemExportToShareableHandle(&fd, hd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  send_fd(s, fd, size);
  if (hear(s) != 'y') { printf("parent: the child could not import\n"); waitpid(pid, NULL, 0); return 1; }
  size_t chk = 1u << 20; unsigned char *h = malloc(chk);
  for (size_t i = 0; i < chk; i++) h[i] = (unsigned char)(i * 7 + 1);
  CU(cuMemcpyHtoD(va, h, chk)); CU(cuCtxSynchronize());
  tell(s, 'r');
  hear(s);
  CU(cuMemcpyDtoH(h, va + chk, chk));
  size_t bad = 0; for (size_t i = 0; i < chk; i++) bad += h[i] != (unsigned char)(i * 13 + 5);
  printf("parent: read the child's bytes in its export: %zu wrong of %zu\n", bad, chk);
  /* The parent's copies into and out of the export while the child is idle. */
  CUdeviceptr own; CU(cuMemAlloc(&own, size));
  void *pin; CU(cuMemHostAlloc(&pin, size, 0));
  CUstream st; CU(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  for (int k = 0; k < 3; k++) {
    size_t sz = sizes[k]; int it = 20;
    CU(cuMemcpyDtoDAsync(va, own, sz, st)); CU(cuStreamSynchronize(st));
    double t = now();
    for (int i = 0; i < it; i++) CU(cuMemcpyDtoDAsync(va, own, sz, st));
    CU(cuStreamSynchronize(st)); double a = (now() - t) / it;
    t = now();
    for (int i = 0; i < it; i++) CU(cuMemcpyDtoHAsync(pin, own, sz, st));
    CU(cuStreamSynchronize(st)); double b = (now() - t) / it;
    printf("parent: %4zu MiB  own->export %7.1f GB/s  (pinned D2H %6.1f GB/s)\n", sz >> 20, sz / a / 1e9, sz / b / 1e9);
  }
  /* One 32 KiB copy into the export at a time, completion by polling its event. */
  CUevent ev; CU(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  for (int k = 0; k < 2; k++) {
    double t = now();
    for (int i = 0; i < 200; i++) {
      CU(cuMemcpyDtoDAsync(k ? own + (64u << 20) : va, own, 32768, st)); CU(cuEventRecord(ev, st));
      while (cuEventQuery(ev) == CUDA_ERROR_NOT_READY) {}
    }
    printf("parent: 32 KiB copy, event polled, %-20s %7.1f us\n", k ? "own->own" : "own->export", (now() - t) / 200 * 1e6);
  }
  tell(s, 'b');
  { int hfd = memfd_create("ring", 0); if (ftruncate(hfd, 1u << 20)) return 1;
    void *hp = mmap(NULL, 1u << 20, PROT_READ | PROT_WRITE, MAP_SHARED, hfd, 0);
    CU(cuMemHostRegister(hp, 1u << 20, 0)); send_fd(s, hfd, 1u << 20); hear(s);
    const char *names[TURNS] = {"device ring (D2D | CopyBuffer)", "the same, OpenCL on its acquiring queue",
      "only CUDA touches the export", "only OpenCL touches the export", "host ring (D2H | WriteBuffer)",
      "host ring", "host ring", "device ring"};
    for (int k = 0; k < TURNS; k++) {
      double t = now();
      for (int i = 0; i < 300; i++) {
        if (turn_host(k)) CU(cuMemcpyDtoHAsync(hp, own, turn_bytes[k], st));
        else CU(cuMemcpyDtoDAsync(k == 3 ? own + (64u << 20) : va, own, turn_bytes[k], st));
        CU(cuEventRecord(ev, st)); while (cuEventQuery(ev) == CUDA_ERROR_NOT_READY) {}
        tell(s, 'g'); hear(s);
      }
      printf("parent: %7zu B taking turns, %-40s %7.1f us per round\n", turn_bytes[k], names[k], (now() - t) / 300 * 1e6);
    }
  }
  hear(s);
  waitpid(pid, NULL, 0);
  return 0;
}
