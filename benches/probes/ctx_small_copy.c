/* Why small copies between two processes on one GPU are slow, with no flagcx code: two
 * processes (two CUDA contexts) on device 0; process A times a device->host copy of `s` bytes
 * into pinned memory followed by a stream synchronize, while process B is
 *   idle      - has a context and nothing queued;
 *   waiting   - has a cuStreamWaitValue32 queued on a pinned host word, unmet (what a stream
 *               joined to a communicator's watermark looks like between messages);
 *   pingpong  - A and B take turns: each copies `s` bytes device->host and synchronizes, then
 *               hands over through shared memory (a staged eager round trip's copies).
 * Sizes 8 B to 64 KiB. Prints µs per copy (idle, waiting) and per round trip (pingpong).
 * `pageable` copies to or from malloc'd memory instead of pinned; `h2d` copies host->device;
 * `d2d` copies device->device (within one allocation); `mapped` copies host->device as a
 * device->device copy from the pinned buffer's device alias; `pad` copies host->device as 32 KiB
 * into a device scratch buffer, then `s` bytes device->device into place; `batch-h2d` and
 * `batch-d2d` are those copies through cuMemcpyBatchAsync with the hint
 * CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE (CUDA 12.8+); `2d-h2d` through cuMemcpy2DAsync;
 * `wv` writes the bytes into device memory as 64-bit stream write-value operations (one
 * cuStreamBatchMemOp of s/8 writes; sizes up to 512 B).
 * Build: cc -O2 -o ctx_small_copy ctx_small_copy.c -I/usr/local/cuda/include -lcuda
 * Usage: ctx_small_copy [iterations] [pinned|pageable] [d2h|h2d|d2d|mapped|pad] */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CK(x)                                                                   \
    do {                                                                        \
        CUresult r_ = (x);                                                      \
        if (r_ != CUDA_SUCCESS) {                                               \
            fprintf(stderr, "%s:%d %s failed: %d\n", __FILE__, __LINE__, #x, r_); \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* Shared between the two processes. */
struct shared {
    volatile int phase;  /* what B should do: 0 idle, 1 waiting, 2 pingpong, 3 exit */
    volatile int ready;  /* B acknowledges the phase */
    volatile uint64_t turn; /* pingpong: odd = B's turn */
    volatile size_t size;
};

static const size_t SIZES[] = {8, 4096, 16384, 32768, 65536};
#define NSIZES (sizeof SIZES / sizeof SIZES[0])

static int pageable;
static const char *how = "d2h";

/* One copy through cuMemcpyBatchAsync, hinted to stay off the SMs. */
static void batch_copy(CUdeviceptr dst, CUdeviceptr src, size_t n, int src_host, CUstream s) {
    CUmemcpyAttributes a;
    memset(&a, 0, sizeof a);
    a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    a.srcLocHint.type = src_host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
    a.dstLocHint.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.flags = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE;
    size_t idx = 0;
#if CUDA_VERSION >= 13000
    CK(cuMemcpyBatchAsync(&dst, &src, &n, 1, &a, &idx, 1, s));
#else
    size_t fail = 0;
    CK(cuMemcpyBatchAsync(&dst, &src, &n, 1, &a, &idx, 1, &fail, s));
#endif
}

/* One copy of `n` bytes the chosen way, then a synchronize. */
static void copy_sync(CUstream s, CUdeviceptr d, void *h, size_t n) {
    if (!strcmp(how, "h2d")) {
        CK(cuMemcpyHtoDAsync(d, h, n, s));
    } else if (!strcmp(how, "d2d")) {
        CK(cuMemcpyDtoDAsync(d, d + (512 << 10), n, s));
    } else if (!strcmp(how, "mapped")) {
        CUdeviceptr a;
        CK(cuMemHostGetDevicePointer(&a, h, 0));
        CK(cuMemcpyDtoDAsync(d, a, n, s));
    } else if (!strcmp(how, "pad")) {
        CK(cuMemcpyHtoDAsync(d + (512 << 10), h, 32768, s));
        CK(cuMemcpyDtoDAsync(d, d + (512 << 10), n, s));
    } else if (!strcmp(how, "wv")) {
        CUstreamBatchMemOpParams p[64];
        size_t k = (n + 7) / 8;
        if (k > 64) k = 64;
        memset(p, 0, sizeof p);
        for (size_t i = 0; i < k; ++i) {
            p[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
            p[i].writeValue.address = d + 8 * i;
            p[i].writeValue.value64 = ((uint64_t *)h)[i];
            p[i].writeValue.flags = 0;
        }
        CK(cuStreamBatchMemOp(s, (unsigned)k, p, 0));
    } else if (!strcmp(how, "batch-h2d")) {
        batch_copy(d, (CUdeviceptr)h, n, 1, s);
    } else if (!strcmp(how, "batch-d2d")) {
        batch_copy(d, d + (512 << 10), n, 0, s);
    } else if (!strcmp(how, "2d-h2d")) {
        CUDA_MEMCPY2D c;
        memset(&c, 0, sizeof c);
        c.srcMemoryType = CU_MEMORYTYPE_HOST;
        c.srcHost = h;
        c.srcPitch = n;
        c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
        c.dstDevice = d;
        c.dstPitch = n;
        c.WidthInBytes = n;
        c.Height = 1;
        CK(cuMemcpy2DAsync(&c, s));
    } else {
        CK(cuMemcpyDtoHAsync(h, d, n, s));
    }
    CK(cuStreamSynchronize(s));
}

static void spin_until(volatile int *p, int v) {
    while (*p != v) {
    }
}

static void setup(CUcontext *ctx, CUstream *s, CUdeviceptr *d, void **h) {
    CUdevice dev;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(ctx, dev));
    CK(cuCtxSetCurrent(*ctx));
    CK(cuStreamCreate(s, CU_STREAM_NON_BLOCKING));
    CK(cuMemAlloc(d, 1 << 20));
    CK(cuMemHostAlloc(h, 1 << 20, CU_MEMHOSTALLOC_DEVICEMAP));
}

/* Where the timed copies go: the pinned buffer, or a malloc'd one. */
static void *copy_buffer(void *pinned) {
    if (!pageable) return pinned;
    void *p = malloc(1 << 20);
    memset(p, 1, 1 << 20);
    return p;
}

static void proc_b(struct shared *sh, int iters) {
    CUcontext ctx;
    CUstream s;
    CUdeviceptr d;
    void *h;
    setup(&ctx, &s, &d, &h);
    void *buf = copy_buffer(h);
    volatile uint32_t *word = (volatile uint32_t *)h + 4096;
    CUdeviceptr dword;
    CK(cuMemHostGetDevicePointer(&dword, (void *)word, 0));
    int phase = -1;
    for (;;) {
        while (sh->phase == phase) {
        }
        phase = sh->phase;
        if (phase == 3) break;
        if (phase == 1) {
            *word = 0;
            CK(cuStreamWaitValue32(s, dword, 1, CU_STREAM_WAIT_VALUE_GEQ));
            sh->ready = phase;
            while (sh->phase == 1) {
            }
            *word = 1; /* release the wait before the next phase */
            CK(cuStreamSynchronize(s));
            phase = -1;
            continue;
        }
        sh->ready = phase;
        if (phase == 2) {
            for (int i = 0; i < iters; ++i) {
                while ((sh->turn & 1) == 0) {
                }
                copy_sync(s, d, buf, sh->size);
                sh->turn++;
            }
        }
    }
}

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 1000;
    pageable = argc > 2 && strcmp(argv[2], "pageable") == 0;
    if (argc > 3) how = argv[3];
    struct shared *sh = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    sh->phase = -1;
    sh->ready = -1;
    pid_t b = fork();
    if (b == 0) {
        proc_b(sh, iters);
        return 0;
    }
    CUcontext ctx;
    CUstream s;
    CUdeviceptr d;
    void *h;
    setup(&ctx, &s, &d, &h);
    void *buf = copy_buffer(h);
    printf("# %s memory, %s\n", pageable ? "pageable" : "pinned", how);
    printf("%8s %10s %10s %12s   (A: copy + synchronize, us; B: another context)\n",
           "bytes", "B idle", "B waiting", "pingpong rtt");
    for (size_t k = 0; k < NSIZES; ++k) {
        size_t n = SIZES[k];
        double r[3];
        for (int phase = 0; phase < 3; ++phase) {
            sh->size = n;
            sh->turn = 0;
            sh->phase = phase;
            spin_until(&sh->ready, phase);
            double t0 = now_us();
            for (int i = 0; i < iters; ++i) {
                copy_sync(s, d, buf, n);
                if (phase == 2) {
                    sh->turn++;
                    while (sh->turn & 1) {
                    }
                }
            }
            r[phase] = (now_us() - t0) / iters;
            sh->phase = 10 + phase; /* B leaves the phase */
            sh->ready = -1;
        }
        printf("%8zu %10.2f %10.2f %12.2f\n", n, r[0], r[1], r[2]);
    }
    sh->phase = 3;
    waitpid(b, NULL, 0);
    return 0;
}
