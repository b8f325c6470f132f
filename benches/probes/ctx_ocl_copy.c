/* Small operations of a CUDA process and an OpenCL process (NVIDIA's platform) taking turns
 * on one GPU, with no flagcx code: what bounds a CUDA<->OpenCL small-message exchange there.
 * Process A (CUDA) and process B (OpenCL) alternate through shared memory; each turn is one
 * 8-byte operation and a wait for it:
 *   A: `d2h` (device->host copy), `wv` (a 64-bit stream value write into device memory);
 *   B: `write` (blocking clEnqueueWriteBuffer), `read` (blocking clEnqueueReadBuffer),
 *      `fill` (clEnqueueFillBuffer with the 8 bytes as its pattern, then clFinish).
 * Prints µs per round trip for every pairing, and each operation alone.
 * Build: nvcc -O2 -o ctx_ocl_copy ctx_ocl_copy.c -lcuda -lOpenCL
 * Usage: OCL_ICD_VENDORS=<dir with nvidia.icd> ctx_ocl_copy [iterations] */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CK(x)                                                                     \
    do {                                                                          \
        CUresult r_ = (x);                                                        \
        if (r_ != CUDA_SUCCESS) {                                                 \
            fprintf(stderr, "%s:%d %s failed: %d\n", __FILE__, __LINE__, #x, r_);   \
            exit(1);                                                              \
        }                                                                         \
    } while (0)
#define CL(x)                                                                     \
    do {                                                                          \
        cl_int e_ = (x);                                                          \
        if (e_ != CL_SUCCESS) {                                                   \
            fprintf(stderr, "%s:%d %s failed: %d\n", __FILE__, __LINE__, #x, e_);   \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

struct shared {
    volatile int a_op, b_op; /* -1: stop; else the operation index */
    volatile int go;         /* a round's number; both start on it */
    volatile int b_ready;
    volatile uint64_t turn;  /* odd: B's turn */
    volatile int alone;      /* 1: A alone, 2: B alone, 0: take turns */
    volatile double b_alone_us;
};

static const char *A_OPS[] = {"d2h", "wv"};
static const char *B_OPS[] = {"write", "read", "fill"};

static void proc_b(struct shared *sh, int iters) {
    cl_platform_id p[8];
    cl_uint np = 0;
    CL(clGetPlatformIDs(8, p, &np));
    cl_device_id d = 0;
    for (cl_uint i = 0; i < np && !d; ++i)
        if (clGetDeviceIDs(p[i], CL_DEVICE_TYPE_GPU, 1, &d, NULL) != CL_SUCCESS) d = 0;
    if (!d) {
        fprintf(stderr, "no OpenCL GPU\n");
        exit(1);
    }
    cl_int err;
    cl_context c = clCreateContext(NULL, 1, &d, NULL, NULL, &err);
    CL(err);
    cl_command_queue q = clCreateCommandQueue(c, d, 0, &err);
    CL(err);
    cl_mem b = clCreateBuffer(c, CL_MEM_READ_WRITE, 4096, NULL, &err);
    CL(err);
    uint64_t host = 42;
    int round = 0;
    for (;;) {
        while (sh->go == round) {
        }
        round = sh->go;
        int op = sh->b_op;
        if (op < 0) break;
        sh->b_ready = round;
        int n = sh->alone == 1 ? 0 : iters;
        double t0 = now_us();
        for (int i = 0; i < n; ++i) {
            if (sh->alone == 0)
                while ((sh->turn & 1) == 0) {
                }
            if (op == 0) {
                CL(clEnqueueWriteBuffer(q, b, CL_TRUE, 0, 8, &host, 0, NULL, NULL));
            } else if (op == 1) {
                CL(clEnqueueReadBuffer(q, b, CL_TRUE, 0, 8, &host, 0, NULL, NULL));
            } else {
                CL(clEnqueueFillBuffer(q, b, &host, 8, 0, 8, 0, NULL, NULL));
                CL(clFinish(q));
            }
            if (sh->alone == 0) sh->turn++;
        }
        if (sh->alone == 2) sh->b_alone_us = (now_us() - t0) / iters;
        sh->b_ready = -round;
    }
}

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 1000;
    struct shared *sh = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    memset((void *)sh, 0, sizeof *sh);
    pid_t child = fork();
    if (child == 0) {
        proc_b(sh, iters);
        return 0;
    }
    CUcontext ctx;
    CUdevice dev;
    CUstream s;
    CUdeviceptr d;
    void *h;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CK(cuMemAlloc(&d, 4096));
    CK(cuMemHostAlloc(&h, 4096, 0));
    int round = 0;
    /* One round: A's op `ao` (or none) against B's op `bo` (or none). */
#define ROUND(ao, bo, mode, out)                                                   \
    do {                                                                          \
        sh->a_op = (ao);                                                          \
        sh->b_op = (bo);                                                          \
        sh->alone = (mode);                                                       \
        sh->turn = 0;                                                             \
        sh->go = ++round;                                                         \
        while (sh->b_ready != round && sh->b_ready != -round) {                   \
        }                                                                         \
        double t0 = now_us();                                                     \
        int n = (mode) == 2 ? 0 : iters;                                          \
        for (int i = 0; i < n; ++i) {                                             \
            if ((ao) == 0)                                                        \
                CK(cuMemcpyDtoHAsync(h, d, 8, s));                                \
            else                                                                  \
                CK(cuStreamWriteValue64(s, d, (cuuint64_t)i, 0));                 \
            CK(cuStreamSynchronize(s));                                           \
            if ((mode) == 0) {                                                    \
                sh->turn++;                                                       \
                while (sh->turn & 1) {                                            \
                }                                                                 \
            }                                                                     \
        }                                                                         \
        while (sh->b_ready != -round) {                                           \
        }                                                                         \
        out = (mode) == 2 ? sh->b_alone_us : (now_us() - t0) / iters;             \
    } while (0)
    double r;
    printf("# one GPU: a CUDA process and an OpenCL process, 8-byte operations, us\n");
    for (int a = 0; a < 2; ++a) {
        ROUND(a, 0, 1, r);
        printf("CUDA %-5s alone            %8.2f\n", A_OPS[a], r);
    }
    for (int b = 0; b < 3; ++b) {
        ROUND(0, b, 2, r);
        printf("OpenCL %-5s alone          %8.2f\n", B_OPS[b], r);
    }
    for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 3; ++b) {
            ROUND(a, b, 0, r);
            printf("CUDA %-5s <-> OpenCL %-5s %8.2f  (round trip)\n", A_OPS[a], B_OPS[b], r);
        }
    sh->b_op = -1;
    sh->go = ++round;
    waitpid(child, NULL, 0);
    return 0;
}
