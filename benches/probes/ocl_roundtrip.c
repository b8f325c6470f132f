/* What one small copy costs an OpenCL runtime by itself, with no flagcx code: an 8-byte write
 * to a device buffer, waited for three ways (a blocking write, a non-blocking write and
 * clFinish, a non-blocking write and polling its event), then a write and a read back to back
 * (what an eager round trip asks of an OpenCL rank). The reference for host<->OpenCL
 * small-message latency in the measurement journal (git show 7ff18bc:docs/performance.md); run it in the same sitting as flagcx-perf.
 * Build: cc -O2 -o ocl_roundtrip ocl_roundtrip.c -lOpenCL
 * Usage: ocl_roundtrip [iterations]   (first platform, first device; OCL_ICD_VENDORS picks) */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

#define CHECK(x)                                                                    \
    do {                                                                            \
        cl_int e_ = (x);                                                            \
        if (e_ != CL_SUCCESS) {                                                     \
            fprintf(stderr, "%s failed: %d\n", #x, e_);                             \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 2000;
    cl_platform_id p;
    cl_device_id d;
    cl_int err;
    CHECK(clGetPlatformIDs(1, &p, NULL));
    CHECK(clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 1, &d, NULL));
    cl_context c = clCreateContext(NULL, 1, &d, NULL, NULL, &err);
    CHECK(err);
    cl_command_queue q = clCreateCommandQueue(c, d, 0, &err);
    CHECK(err);
    cl_mem b = clCreateBuffer(c, CL_MEM_READ_WRITE, 4096, NULL, &err);
    CHECK(err);
    char h[8] = {0};
    printf("# ocl_roundtrip | 8 B, µs per operation, %d iterations\n", n);
    printf("# %14s %14s %14s %14s\n", "blocking", "write+finish", "write+poll", "write+read");
    for (int round = 0; round < 3; round++) {
        double t0 = now_us();
        for (int i = 0; i < n; i++) CHECK(clEnqueueWriteBuffer(q, b, CL_TRUE, 0, 8, h, 0, NULL, NULL));
        double t1 = now_us();
        for (int i = 0; i < n; i++) {
            CHECK(clEnqueueWriteBuffer(q, b, CL_FALSE, 0, 8, h, 0, NULL, NULL));
            CHECK(clFinish(q));
        }
        double t2 = now_us();
        for (int i = 0; i < n; i++) {
            cl_event e;
            cl_int s = CL_QUEUED;
            CHECK(clEnqueueWriteBuffer(q, b, CL_FALSE, 0, 8, h, 0, NULL, &e));
            CHECK(clFlush(q));
            while (s != CL_COMPLETE) {
                CHECK(clGetEventInfo(e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof s, &s, NULL));
                if (s < 0) { fprintf(stderr, "write failed: %d\n", s); return 1; }
            }
            CHECK(clReleaseEvent(e));
        }
        double t3 = now_us();
        for (int i = 0; i < n; i++) {
            CHECK(clEnqueueWriteBuffer(q, b, CL_TRUE, 0, 8, h, 0, NULL, NULL));
            CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, 8, h, 0, NULL, NULL));
        }
        double t4 = now_us();
        printf("  %14.2f %14.2f %14.2f %14.2f\n", (t1 - t0) / n, (t2 - t1) / n, (t3 - t2) / n,
               (t4 - t3) / n);
    }
    clReleaseMemObject(b);
    clReleaseCommandQueue(q);
    clReleaseContext(c);
    return 0;
}
