/* The way torch's process groups (and FlagCX's torch plugin) call libflagcx on CUDA, checked
 * byte for byte: the client's compute stream T and the library's stream S from the device
 * table's streamCreate; before each call an event recorded on T that S waits for, after it an
 * event recorded on S that T waits for; the result read on T, never a host wait on S. Buffers
 * are carved out of one cudaMalloc segment at offsets (as torch's caching allocator hands out
 * tensors), the segment freed and allocated again between rounds, and a last round takes its
 * segment from a cudaMallocAsync pool. Inputs are written and outputs filled with a sentinel on
 * T just before each call, so a stale input or an early write shows. A fifth round maps its
 * segment through the driver's virtual memory calls (cuMemCreate, cuMemMap), as torch's
 * expandable segments do. Pool and VMM memory have no legacy CUDA IPC handle: there the
 * library must move the data another way or report an error (the round ends the job), and
 * every byte it did deliver must be right. Besides the data movers, each round runs uint8
 * all-reduce and reduce-scatter (sum, wrapping), the calls training makes most.
 *
 * Built in the GPU bundle against the CUDA runtime: cc -I<flagcx include> -I<cuda include>
 * client_cuda.c libflagcx.so -lcudart -ldl (the driver's VMM calls are looked up in
 * libcuda.so.1 at run time). Ranks from FLAGCX_RANK/FLAGCX_NRANKS, the unique id
 * through $FLAGCX_TEST_ID_FILE (common.h). Prints one line per round; exits 1 on the first
 * wrong byte or failed call. */
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include "common.h"

#define CU(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

enum op { SENDRECV, BROADCAST, ALLGATHER, ALLTOALL, GATHER, SCATTER, ALLREDUCE, REDUCESCATTER, NOPS };
static const char *op_name[NOPS] = {"sendrecv", "broadcast", "allgather", "alltoall",
                                    "gather",   "scatter",   "allreduce", "reducescatter"};
enum source { SEGMENT, POOL, VMM };
static const char *source_name[3] = {"cudaMalloc segment", "cudaMallocAsync pool",
                                     "cuMemCreate + cuMemMap"};

/* A segment mapped through the driver's virtual memory API: physical memory from cuMemCreate
 * mapped at a reserved range with read-write access for device 0 (torch's expandable
 * segments). The driver entry points come from libcuda.so.1, so the program links only the
 * runtime. */
typedef CUresult (*create_fn)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                              unsigned long long);
typedef CUresult (*granularity_fn)(size_t *, const CUmemAllocationProp *,
                                   CUmemAllocationGranularity_flags);
typedef CUresult (*reserve_fn)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*map_fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                           unsigned long long);
typedef CUresult (*access_fn)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*unmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*release_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*free_fn)(CUdeviceptr, size_t);

static void *driver_fn(const char *name) {
  static void *lib;
  if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
  void *f = lib ? dlsym(lib, name) : NULL;
  EXPECT(f != NULL, "%s from libcuda.so.1: %s", name, dlerror());
  return f;
}

#define DRV(x)                                                                             \
  do {                                                                                     \
    CUresult e_ = (x);                                                                     \
    EXPECT(e_ == CUDA_SUCCESS, "%s -> CUresult %d", #x, (int)e_);                          \
  } while (0)

struct vmm {
  CUmemGenericAllocationHandle handle;
  CUdeviceptr ptr;
  size_t len;
};

static unsigned char *vmm_alloc(struct vmm *v, size_t want) {
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t gran = 0;
  DRV(((granularity_fn)driver_fn("cuMemGetAllocationGranularity"))(
      &gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  v->len = (want + gran - 1) / gran * gran;
  DRV(((create_fn)driver_fn("cuMemCreate"))(&v->handle, v->len, &prop, 0));
  DRV(((reserve_fn)driver_fn("cuMemAddressReserve"))(&v->ptr, v->len, 0, 0, 0));
  DRV(((map_fn)driver_fn("cuMemMap"))(v->ptr, v->len, 0, v->handle, 0));
  CUmemAccessDesc access = {0};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  DRV(((access_fn)driver_fn("cuMemSetAccess"))(v->ptr, v->len, &access, 1));
  return (unsigned char *)(uintptr_t)v->ptr;
}

static void vmm_free(struct vmm *v) {
  DRV(((unmap_fn)driver_fn("cuMemUnmap"))(v->ptr, v->len));
  DRV(((release_fn)driver_fn("cuMemRelease"))(v->handle));
  DRV(((free_fn)driver_fn("cuMemAddressFree"))(v->ptr, v->len));
}

/* Byte i of the block rank src contributes for rank dst in call tag. */
static unsigned char byte_of(int src, int dst, unsigned tag, size_t i) {
  unsigned long long x = (unsigned long long)(src + 1) * 0x9E3779B97F4A7C15ull +
                         (unsigned long long)(dst + 7) * 0xBF58476D1CE4E5B9ull +
                         (unsigned long long)tag * 0x94D049BB133111EBull + i;
  return (unsigned char)(x ^ (x >> 29) ^ (x >> 47));
}

int main(void) {
  int me = env_int("FLAGCX_RANK"), n = env_int("FLAGCX_NRANKS");
  flagcxDeviceHandle_t dev;
  CHECK(flagcxDeviceHandleInit(&dev));
  CHECK(dev->setDevice(0));
  CU(cudaSetDevice(0));
  flagcxUniqueId id;
  share_unique_id(me, &id);
  flagcxComm_t comm;
  CHECK(flagcxCommInitRank(&comm, n, &id, me));
  flagcxStream_t S;
  CHECK(dev->streamCreate(&S));
  cudaStream_t s = *(cudaStream_t *)S, T;
  CU(cudaStreamCreateWithFlags(&T, cudaStreamNonBlocking));
  cudaEvent_t before, after;
  CU(cudaEventCreateWithFlags(&before, cudaEventDisableTiming));
  CU(cudaEventCreateWithFlags(&after, cudaEventDisableTiming));
  const size_t lens[2] = {4100, (1u << 20) + 12};
  const size_t offsets[3] = {0, (3u << 20) + 517, 6u << 20};
  size_t seg_len = offsets[2] + 2 * (size_t)n * lens[1] + 8192;
  unsigned char *send = malloc((size_t)n * lens[1]), *want = malloc((size_t)n * lens[1]);
  unsigned char *got;
  CU(cudaMallocHost((void **)&got, (size_t)n * lens[1]));
  cudaMemPool_t pool;
  CU(cudaDeviceGetDefaultMemPool(&pool, 0));
  for (int round = 0; round < 5; round++) {
    enum source src = round == 3 ? POOL : round == 4 ? VMM : SEGMENT;
    int pooled = src != SEGMENT;
    unsigned char *seg;
    struct vmm v;
    if (src == POOL) {
      CU(cudaMallocAsync((void **)&seg, seg_len, T));
      CU(cudaStreamSynchronize(T));
    } else if (src == VMM) {
      seg = vmm_alloc(&v, seg_len);
    } else {
      CU(cudaMalloc((void **)&seg, seg_len));
    }
    int calls = 0;
    for (int k = 0; k < 3; k++)
      for (int l = 0; l < 2; l++)
        for (int o = 0; o < NOPS; o++) {
          size_t len = lens[l];
          unsigned tag = (unsigned)((round * 100 + k * 10 + o) * 4 + l);
          int root = (int)(tag % (unsigned)n), next = (me + 1) % n, prev = (me + n - 1) % n;
          unsigned char *in = seg + offsets[k], *out = in + (size_t)n * len + 4096;
          for (int q = 0; q < n; q++)
            for (size_t i = 0; i < len; i++) send[q * len + i] = byte_of(me, q, tag, i);
          size_t out_len = (o == ALLGATHER || o == ALLTOALL || o == GATHER) ? n * len : len;
          size_t in_len = (o == ALLTOALL || o == SCATTER || o == REDUCESCATTER) ? (size_t)n * len : len;
          int check = o != GATHER || me == root;
          for (size_t i = 0; i < out_len; i++) {
            size_t q = i / len, j = i % len;
            switch (o) {
            case SENDRECV: want[i] = byte_of(prev, 0, tag, j); break;
            case BROADCAST: want[i] = byte_of(root, 0, tag, j); break;
            case ALLGATHER: case GATHER: want[i] = byte_of((int)q, 0, tag, j); break;
            case ALLTOALL: want[i] = byte_of((int)q, me, tag, j); break;
            case SCATTER: want[i] = byte_of(root, me, tag, j); break;
            case ALLREDUCE: case REDUCESCATTER: {
              /* All-reduce: byte i summed over the ranks; reduce-scatter: byte i of block `me`
               * of every rank's input, summed. uint8 sums wrap. */
              size_t at = o == ALLREDUCE ? i : (size_t)me * len + i;
              unsigned char sum = 0;
              for (int r = 0; r < n; r++) sum += byte_of(r, (int)(at / len), tag, at % len);
              want[i] = sum;
              break;
            }
            }
          }
          CU(cudaMemcpyAsync(in, send, in_len, cudaMemcpyHostToDevice, T));
          CU(cudaMemsetAsync(out, 0xEE, out_len, T));
          CU(cudaEventRecord(before, T));
          CU(cudaStreamWaitEvent(s, before, 0));
          switch (o) {
          case SENDRECV:
            CHECK(flagcxGroupStart(comm));
            CHECK(flagcxSend(in, len, flagcxUint8, next, comm, S));
            CHECK(flagcxRecv(out, len, flagcxUint8, prev, comm, S));
            CHECK(flagcxGroupEnd(comm));
            break;
          case BROADCAST: CHECK(flagcxBroadcast(in, out, len, flagcxUint8, root, comm, S)); break;
          case ALLGATHER: CHECK(flagcxAllGather(in, out, len, flagcxUint8, comm, S)); break;
          case ALLTOALL: CHECK(flagcxAlltoAll(in, out, len, flagcxUint8, comm, S)); break;
          case GATHER: CHECK(flagcxGather(in, out, len, flagcxUint8, root, comm, S)); break;
          case SCATTER: CHECK(flagcxScatter(in, out, len, flagcxUint8, root, comm, S)); break;
          case ALLREDUCE: CHECK(flagcxAllReduce(in, out, len, flagcxUint8, flagcxSum, comm, S)); break;
          case REDUCESCATTER:
            CHECK(flagcxReduceScatter(in, out, len, flagcxUint8, flagcxSum, comm, S));
            break;
          }
          CU(cudaEventRecord(after, s));
          CU(cudaStreamWaitEvent(T, after, 0));
          CU(cudaMemcpyAsync(got, out, out_len, cudaMemcpyDeviceToHost, T));
          CU(cudaStreamSynchronize(T));
          flagcxResult_t async = flagcxSuccess;
          CHECK(flagcxCommGetAsyncError(comm, &async));
          if (async != flagcxSuccess && pooled) {
            /* Pool and VMM memory have no legacy CUDA IPC handle: where the library cannot move
             * them another way it must say so (an asynchronous error naming
             * cuIpcGetMemHandle), never hand back stale data quietly. The pair is retired after
             * it, so the job ends here. */
            printf("client_cuda: rank %d, round %d (%s): %s of %zu B reported error %d: %s\n", me,
                   round, source_name[src], op_name[o], len, (int)async, flagcxGetLastError(comm));
            fflush(stdout);
            _exit(0);
          }
          EXPECT(async == flagcxSuccess, "rank %d round %d: %s of %zu B at offset %zu: async error %d: %s",
                 me, round, op_name[o], len, offsets[k], (int)async, flagcxGetLastError(comm));
          if (check) {
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < out_len; i++)
              if (got[i] != want[i] && bad++ == 0) first = i;
            EXPECT(bad == 0,
                   "rank %d round %d (%s): %s of %zu B at offset %zu (root %d): %zu of %zu bytes "
                   "wrong, first [%zu] = %#x want %#x (sentinel 0xee)",
                   me, round, source_name[src], op_name[o], len, offsets[k], root, bad,
                   out_len, first, got[first], want[first]);
          }
          calls++;
        }
    CU(cudaStreamSynchronize(T));
    CHECK(dev->streamSynchronize(S));
    if (src == POOL) {
      CU(cudaFreeAsync(seg, T));
      CU(cudaStreamSynchronize(T));
    } else if (src == VMM) {
      vmm_free(&v);
    } else {
      CU(cudaFree(seg));
    }
    printf("client_cuda: rank %d of %d, round %d (%s): %d calls, every byte right\n", me, n,
           round, source_name[src], calls);
    fflush(stdout);
  }
  CHECK(flagcxCommDestroy(comm));
  return 0;
}
