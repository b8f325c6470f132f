/* What an OpenCL enqueue costs while earlier commands of its queue wait on closed user events
 * (a stream whose joins wait for transfers that have not finished), with no flagcx code.
 * On one queue, n times, each timed (microseconds; median of each tenth of the run):
 *   gates        a user event, a barrier waiting on it, a flush: n closed gates stacked;
 *   gates-noflush the same without the flush;
 *   behind-one   one closed gate first, then n 24 B non-blocking writes, each flushed: commands
 *                queued behind a single closed gate.
 * Every gate is opened at the end of its case and the queue finished.
 * Build: cc -O2 -o ocl_stack ocl_stack.c -lOpenCL
 * Usage: ocl_stack [n]   (first platform, first device; OCL_ICD_VENDORS picks) */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

#define CHECK(x)                                                              \
    do {                                                                      \
        cl_int e_ = (x);                                                      \
        if (e_ != CL_SUCCESS) {                                               \
            fprintf(stderr, "%s:%d: %s = %d\n", __FILE__, __LINE__, #x, e_); \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void report(const char *what, double *t, int n) {
    printf("%-14s", what);
    double total = 0;
    for (int i = 0; i < n; i++) total += t[i];
    for (int k = 0; k < 10; k++) {
        int a = n * k / 10, b = n * (k + 1) / 10;
        qsort(t + a, b - a, sizeof *t, cmp);
        printf(" %7.1f", t[a + (b - a) / 2]);
    }
    printf("   total %.1f ms\n", total / 1e3);
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1000;
    cl_platform_id p;
    cl_device_id d;
    cl_int e;
    char pname[256];
    CHECK(clGetPlatformIDs(1, &p, NULL));
    CHECK(clGetPlatformInfo(p, CL_PLATFORM_NAME, sizeof pname, pname, NULL));
    CHECK(clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 1, &d, NULL));
    cl_context ctx = clCreateContext(NULL, 1, &d, NULL, NULL, &e);
    CHECK(e);
    cl_command_queue q = clCreateCommandQueue(ctx, d, 0, &e);
    CHECK(e);
    cl_mem buf = clCreateBuffer(ctx, CL_MEM_READ_WRITE, 24 * (size_t)n, NULL, &e);
    CHECK(e);
    char *src = calloc(n, 24);
    double *t = calloc(n, sizeof *t);
    cl_event *gates = calloc(n, sizeof *gates);
    printf("== %s, n = %d; medians per tenth of the run, us\n", pname, n);
    for (int flush = 1; flush >= 0; flush--) {
        for (int i = 0; i < n; i++) {
            double t0 = now_us();
            gates[i] = clCreateUserEvent(ctx, &e);
            CHECK(e);
            cl_event b;
            CHECK(clEnqueueBarrierWithWaitList(q, 1, &gates[i], &b));
            if (flush) CHECK(clFlush(q));
            t[i] = now_us() - t0;
            CHECK(clReleaseEvent(b));
        }
        report(flush ? "gates" : "gates-noflush", t, n);
        for (int i = 0; i < n; i++) {
            CHECK(clSetUserEventStatus(gates[i], CL_COMPLETE));
            CHECK(clReleaseEvent(gates[i]));
        }
        CHECK(clFinish(q));
    }
    cl_event gate = clCreateUserEvent(ctx, &e);
    CHECK(e);
    CHECK(clEnqueueBarrierWithWaitList(q, 1, &gate, NULL));
    CHECK(clFlush(q));
    for (int i = 0; i < n; i++) {
        double t0 = now_us();
        cl_event w;
        CHECK(clEnqueueWriteBuffer(q, buf, CL_FALSE, 24 * (size_t)i, 24, src + 24 * i, 0, NULL, &w));
        CHECK(clFlush(q));
        t[i] = now_us() - t0;
        CHECK(clReleaseEvent(w));
    }
    report("behind-one", t, n);
    CHECK(clSetUserEventStatus(gate, CL_COMPLETE));
    CHECK(clFinish(q));
    CHECK(clReleaseEvent(gate));
    return 0;
}
