/* Whether an OpenCL runtime copies faster when one copy is cut into parts on several queues,
 * with no flagcx code: for each size, a device buffer is written from (written) host memory and
 * read back into another, each direction finished before the next, first as one command on one
 * queue, then cut into `parts` equal pieces on as many queues (flushed together, then each
 * finished). On PoCL, whose worker threads each run one command, the parts run at once; the
 * reference for the OpenCL adaptor's split copies (adaptors/opencl/src/split.rs,
 * git show 7ff18bc:docs/performance.md, "PoCL copies in parts").
 * Build: cc -O2 -o ocl_split ocl_split.c -lOpenCL
 * Usage: ocl_split [parts] [iterations]   (first platform, first device; OCL_ICD_VENDORS picks) */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_PARTS 16

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHECK(call)                                                   \
  do {                                                                \
    cl_int e_ = (call);                                               \
    if (e_ != CL_SUCCESS) {                                           \
      fprintf(stderr, "%s failed: %d (line %d)\n", #call, e_, __LINE__); \
      exit(1);                                                        \
    }                                                                 \
  } while (0)

/* One write and one read of n bytes, each cut into k parts on queues q[0..k), in seconds. */
static double round_trip(cl_command_queue *q, int k, cl_mem b, char *src, char *dst, size_t n) {
  double t = now();
  size_t each = n / k;
  for (int dir = 0; dir < 2; dir++) {
    for (int i = 0; i < k; i++) {
      size_t off = each * i, len = i + 1 == k ? n - off : each;
      if (dir == 0)
        CHECK(clEnqueueWriteBuffer(q[i], b, CL_FALSE, off, len, src + off, 0, NULL, NULL));
      else
        CHECK(clEnqueueReadBuffer(q[i], b, CL_FALSE, off, len, dst + off, 0, NULL, NULL));
    }
    for (int i = 0; i < k; i++) CHECK(clFlush(q[i]));
    for (int i = 0; i < k; i++) CHECK(clFinish(q[i]));
  }
  return now() - t;
}

int main(int argc, char **argv) {
  int parts = argc > 1 ? atoi(argv[1]) : 2;
  int iters = argc > 2 ? atoi(argv[2]) : 20;
  if (parts < 1 || parts > MAX_PARTS || iters < 1) {
    fprintf(stderr, "usage: ocl_split [parts 1-%d] [iterations]\n", MAX_PARTS);
    return 2;
  }
  cl_platform_id p;
  cl_device_id d;
  CHECK(clGetPlatformIDs(1, &p, NULL));
  CHECK(clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 1, &d, NULL));
  cl_int e;
  cl_context c = clCreateContext(NULL, 1, &d, NULL, NULL, &e);
  CHECK(e);
  cl_command_queue q[MAX_PARTS];
  for (int i = 0; i < parts; i++) {
    q[i] = clCreateCommandQueue(c, d, 0, &e);
    CHECK(e);
  }
  static const size_t mib[] = {2, 4, 16, 32, 128};
  printf("size_MiB  one_queue_GBps  %d_parts_GBps   (per direction)\n", parts);
  for (size_t s = 0; s < sizeof mib / sizeof *mib; s++) {
    size_t n = mib[s] << 20;
    cl_mem b = clCreateBuffer(c, CL_MEM_READ_WRITE, n, NULL, &e);
    CHECK(e);
    char *src = malloc(n), *dst = malloc(n);
    if (!src || !dst) return 1;
    memset(src, 0x5A, n);
    memset(dst, 0, n);
    double best[2] = {1e9, 1e9};
    for (int it = 0; it <= iters; it++) /* the first round of each warms up */
      for (int m = 0; m < 2; m++) {
        double t = round_trip(q, m ? parts : 1, b, src, dst, n);
        if (it > 0 && t < best[m]) best[m] = t;
      }
    if (memcmp(src, dst, n) != 0) {
      fprintf(stderr, "wrong bytes at %zu MiB\n", mib[s]);
      return 1;
    }
    printf("%8zu  %14.2f  %13.2f\n", mib[s], 2 * n / best[0] / 1e9, 2 * n / best[1] / 1e9);
    free(src);
    free(dst);
    CHECK(clReleaseMemObject(b));
  }
  return 0;
}
