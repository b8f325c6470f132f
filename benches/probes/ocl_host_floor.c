/* What a host<->OpenCL ping-pong of large messages costs the OpenCL runtime by itself, with no
 * flagcx code: a host buffer in a memfd mapping (as a host-vendor rank's memory is) and a device
 * buffer, both written before anything is timed (never-written memory reads as the zero page
 * and copies faster than any real message). For each size it times
 *   write   clEnqueueWriteBuffer host -> device, then clFinish (one copy at a time),
 *   read    clEnqueueReadBuffer device -> host, then clFinish,
 *   round   a write and then a read, each finished: what one round trip of the direct path
 *           asks of the OpenCL rank,
 * and prints the ratio flagcx-perf would print for that round trip: (bytes / (round / 2)) over
 * the slower of write and read. The reference for host<->OpenCL bandwidth in
 * the measurement journal (git show 7ff18bc:docs/performance.md); run it in the same sitting as flagcx-perf.
 * Build: cc -O2 -o ocl_host_floor ocl_host_floor.c -lOpenCL
 * Usage: ocl_host_floor [iterations]   (first platform, first device; OCL_ICD_VENDORS picks) */
#define _GNU_SOURCE
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

#define CHECK(x)                                                                    \
    do {                                                                            \
        cl_int e_ = (x);                                                            \
        if (e_ != CL_SUCCESS) {                                                     \
            fprintf(stderr, "%s failed: %d\n", #x, e_);                             \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

static cl_command_queue q;
static cl_mem dev;
static char *host;

static void copy(int write, size_t n) {
    if (write)
        CHECK(clEnqueueWriteBuffer(q, dev, CL_FALSE, 0, n, host, 0, NULL, NULL));
    else
        CHECK(clEnqueueReadBuffer(q, dev, CL_FALSE, 0, n, host, 0, NULL, NULL));
    CHECK(clFinish(q));
}

/* Seconds per repetition of `what` (0: write, 1: read, 2: write then read), after one untimed. */
static double timed(int what, size_t n, int iters) {
    for (int i = -1; i < iters; i++) {
        if (i == 0) {
            double t0 = now_s();
            for (int j = 0; j < iters; j++) {
                if (what != 1) copy(1, n);
                if (what != 0) copy(0, n);
            }
            return (now_s() - t0) / iters;
        }
        if (what != 1) copy(1, n);
        if (what != 0) copy(0, n);
    }
    return 0;
}

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 20;
    const size_t max = (size_t)128 << 20;
    cl_platform_id p;
    cl_device_id d;
    cl_int err;
    CHECK(clGetPlatformIDs(1, &p, NULL));
    CHECK(clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 1, &d, NULL));
    cl_context c = clCreateContext(NULL, 1, &d, NULL, NULL, &err);
    CHECK(err);
    q = clCreateCommandQueue(c, d, 0, &err);
    CHECK(err);
    dev = clCreateBuffer(c, CL_MEM_READ_WRITE, max, NULL, &err);
    CHECK(err);
    int fd = memfd_create("ocl_host_floor", 0);
    if (fd < 0 || ftruncate(fd, max) != 0) {
        perror("memfd");
        return 1;
    }
    host = mmap(NULL, max, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (host == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memset(host, 0x5A, max);
    copy(1, max); /* the device buffer holds written data too */
    printf("# ocl_host_floor | %d iterations, GB/s (round: per direction)\n", iters);
    printf("# %10s %10s %10s %10s %8s\n", "bytes", "write", "read", "round", "ratio");
    for (size_t n = (size_t)16 << 20; n <= max; n *= 2) {
        double w = timed(0, n, iters), r = timed(1, n, iters), rt = timed(2, n, iters);
        double slower = w > r ? w : r;
        printf("  %10zu %10.2f %10.2f %10.2f %8.3f\n", n, n / w / 1e9, n / r / 1e9,
               n / (rt / 2) / 1e9, slower / (rt / 2));
    }
    return 0;
}
