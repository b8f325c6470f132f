/* What joining an OpenCL queue to host state costs the runtime by itself, with no flagcx code.
 * A stream join on OpenCL is a marker, then a barrier on a user event (the gate) that a host
 * thread opens once the marker completed, then the marker an event record adds. This probe
 * times, on one device (median and 90th percentile of the iterations, microseconds):
 *   idle       an 8 B blocking write on an idle queue (the floor of every eager copy);
 *   marker     a marker enqueued on an idle queue and flushed, until polling sees it complete;
 *   callback   the same marker, until a clSetEventCallback callback on it has run;
 *   gate       from opening the gate of a join (its marker already complete) until polling
 *              sees the join's trailing marker complete (what stream_query waits for);
 *   gate+same  from opening the gate until an 8 B blocking write enqueued behind the join on
 *              the same queue returns;
 *   gate+other from opening the gate until an 8 B blocking write on a second queue of the
 *              context returns (the join still pending on the first);
 *   closed+other an 8 B blocking write on the second queue while the first holds a join whose
 *              gate stays closed (what a proxy thread's copy costs while callers' streams
 *              wait for it).
 * Build: cc -O2 -o ocl_join ocl_join.c -lOpenCL -lpthread
 * Usage: ocl_join [iterations]   (first platform, first device; OCL_ICD_VENDORS picks) */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <stdatomic.h>
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
            fprintf(stderr, "%s:%d: %s = %d\n", __FILE__, __LINE__, #x, e_);       \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

static int complete(cl_event e) {
    cl_int s;
    CHECK(clGetEventInfo(e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof s, &s, NULL));
    if (s < 0) {
        fprintf(stderr, "event failed: %d\n", s);
        exit(1);
    }
    return s == CL_COMPLETE;
}

static void spin_until(cl_event e) {
    while (!complete(e)) {
    }
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void report(const char *what, double *t, int n) {
    qsort(t, n, sizeof *t, cmp);
    printf("%-11s median %8.1f us   p90 %8.1f us\n", what, t[n / 2], t[n * 9 / 10]);
}

static atomic_int fired;
static double fired_at;
static void CL_CALLBACK on_complete(cl_event e, cl_int status, void *user) {
    (void)e;
    (void)status;
    (void)user;
    fired_at = now_us();
    atomic_store(&fired, 1);
}

/* A join on `q`: marker, barrier on a fresh gate, trailing marker; flushed. */
static void join(cl_context ctx, cl_command_queue q, cl_event *marker, cl_event *gate,
                 cl_event *tail) {
    cl_int e;
    *gate = clCreateUserEvent(ctx, &e);
    CHECK(e);
    CHECK(clEnqueueMarkerWithWaitList(q, 0, NULL, marker));
    CHECK(clEnqueueBarrierWithWaitList(q, 1, gate, NULL));
    CHECK(clEnqueueMarkerWithWaitList(q, 0, NULL, tail));
    CHECK(clFlush(q));
    spin_until(*marker);
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1000;
    cl_platform_id plat;
    cl_device_id dev;
    CHECK(clGetPlatformIDs(1, &plat, NULL));
    CHECK(clGetDeviceIDs(plat, CL_DEVICE_TYPE_ALL, 1, &dev, NULL));
    char pname[256], dname[256];
    CHECK(clGetPlatformInfo(plat, CL_PLATFORM_NAME, sizeof pname, pname, NULL));
    CHECK(clGetDeviceInfo(dev, CL_DEVICE_NAME, sizeof dname, dname, NULL));
    printf("== %s / %s, %d iterations\n", pname, dname, n);
    cl_int e;
    cl_context ctx = clCreateContext(NULL, 1, &dev, NULL, NULL, &e);
    CHECK(e);
    cl_command_queue q = clCreateCommandQueue(ctx, dev, 0, &e);
    CHECK(e);
    cl_command_queue q2 = clCreateCommandQueue(ctx, dev, 0, &e);
    CHECK(e);
    cl_mem buf = clCreateBuffer(ctx, CL_MEM_READ_WRITE, 4096, NULL, &e);
    CHECK(e);
    unsigned long long word = 42;
    double *t = malloc(sizeof(double) * n);
    for (int i = 0; i < 100; i++)
        CHECK(clEnqueueWriteBuffer(q, buf, CL_TRUE, 0, 8, &word, 0, NULL, NULL));

    for (int i = 0; i < n; i++) {
        double t0 = now_us();
        CHECK(clEnqueueWriteBuffer(q, buf, CL_TRUE, 0, 8, &word, 0, NULL, NULL));
        t[i] = now_us() - t0;
    }
    report("idle", t, n);

    for (int i = 0; i < n; i++) {
        cl_event m;
        double t0 = now_us();
        CHECK(clEnqueueMarkerWithWaitList(q, 0, NULL, &m));
        CHECK(clFlush(q));
        spin_until(m);
        t[i] = now_us() - t0;
        CHECK(clReleaseEvent(m));
    }
    report("marker", t, n);

    for (int i = 0; i < n; i++) {
        cl_event m;
        atomic_store(&fired, 0);
        double t0 = now_us();
        CHECK(clEnqueueMarkerWithWaitList(q, 0, NULL, &m));
        CHECK(clSetEventCallback(m, CL_COMPLETE, on_complete, NULL));
        CHECK(clFlush(q));
        while (!atomic_load(&fired)) {
        }
        t[i] = fired_at - t0;
        CHECK(clReleaseEvent(m));
    }
    report("callback", t, n);

    for (int i = 0; i < n; i++) {
        cl_event m, g, tail;
        join(ctx, q, &m, &g, &tail);
        double t0 = now_us();
        CHECK(clSetUserEventStatus(g, CL_COMPLETE));
        spin_until(tail);
        t[i] = now_us() - t0;
        CHECK(clReleaseEvent(m));
        CHECK(clReleaseEvent(g));
        CHECK(clReleaseEvent(tail));
    }
    report("gate", t, n);

    for (int i = 0; i < n; i++) {
        cl_event m, g, tail;
        join(ctx, q, &m, &g, &tail);
        double t0 = now_us();
        CHECK(clSetUserEventStatus(g, CL_COMPLETE));
        CHECK(clEnqueueWriteBuffer(q, buf, CL_TRUE, 0, 8, &word, 0, NULL, NULL));
        t[i] = now_us() - t0;
        CHECK(clReleaseEvent(m));
        CHECK(clReleaseEvent(g));
        CHECK(clReleaseEvent(tail));
    }
    report("gate+same", t, n);

    for (int i = 0; i < n; i++) {
        cl_event m, g, tail;
        join(ctx, q, &m, &g, &tail);
        double t0 = now_us();
        CHECK(clSetUserEventStatus(g, CL_COMPLETE));
        CHECK(clEnqueueWriteBuffer(q2, buf, CL_TRUE, 0, 8, &word, 0, NULL, NULL));
        t[i] = now_us() - t0;
        CHECK(clFinish(q));
        CHECK(clReleaseEvent(m));
        CHECK(clReleaseEvent(g));
        CHECK(clReleaseEvent(tail));
    }
    report("gate+other", t, n);

    for (int i = 0; i < n; i++) {
        cl_event m, g, tail;
        join(ctx, q, &m, &g, &tail);
        double t0 = now_us();
        CHECK(clEnqueueWriteBuffer(q2, buf, CL_TRUE, 0, 8, &word, 0, NULL, NULL));
        t[i] = now_us() - t0;
        CHECK(clSetUserEventStatus(g, CL_COMPLETE));
        CHECK(clFinish(q));
        CHECK(clReleaseEvent(m));
        CHECK(clReleaseEvent(g));
        CHECK(clReleaseEvent(tail));
    }
    report("closed+other", t, n);

    CHECK(clFinish(q));
    CHECK(clFinish(q2));
    free(t);
    return 0;
}
