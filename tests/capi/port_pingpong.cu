/* Port channels from CUDA C++ through the C ABI: two ranks' kernels ping-pong with
 * put_with_signal and wait (flagcx/device.cuh), every byte of the last message checked. Built
 * on the GPU host by the bundle's port.sh with nvcc, linked with libflagcx. */
#include "common.h"

#include <cuda_runtime.h>
#include <flagcx/device.cuh>

#define CUDA_CHECK(call)                                                                   \
  do {                                                                                     \
    cudaError_t e_ = (call);                                                               \
    EXPECT(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                    \
  } while (0)

/* `first` puts `bytes` of its buffer 0 into the peer's buffer 1 with a signal and waits for
 * the answer; the other answers. out[0]: ns for `iters` rounds, out[1]: failure code. */
__global__ void pingpong(flagcx::PortChannelHandle h, int first, unsigned iters,
                         unsigned long long bytes, unsigned long long *out) {
  flagcx::PortChannel ch(h);
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  int r = 0;
  for (unsigned i = 0; i < iters && r == 0; ++i) {
    if (first) {
      r = ch.put_with_signal(1, 0, 0, 0, bytes);
      if (r == 0) r = ch.wait();
    } else {
      r = ch.wait();
      if (r == 0) r = ch.put_with_signal(1, 0, 0, 0, bytes);
    }
  }
  if (r == 0) r = ch.flush();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  out[0] = t1 - t0;
  out[1] = (unsigned long long)r;
}

int main(void) {
  int rank = env_int("FLAGCX_RANK"), nranks = env_int("FLAGCX_NRANKS");
  EXPECT(nranks == 2, "two ranks, not %d", nranks);
  flagcxUniqueId id;
  share_unique_id(rank, &id);
  flagcxDeviceHandle_t dev;
  CHECK(flagcxDeviceHandleInit(&dev));
  flagcxComm_t comm;
  CHECK(flagcxCommInitRank(&comm, nranks, &id, rank));

  const size_t bytes = 4096;
  void *src, *dst, *regs[2];
  CHECK(dev->deviceMalloc(&src, bytes, flagcxMemDevice, NULL));
  CHECK(dev->deviceMalloc(&dst, bytes, flagcxMemDevice, NULL));
  unsigned char host[4096];
  for (size_t i = 0; i < bytes; i++) host[i] = (unsigned char)(i * 13 + rank);
  CUDA_CHECK(cudaMemcpy(src, host, bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(dst, 0, bytes));
  CHECK(flagcxCommRegister(comm, src, bytes, &regs[0], flagcxMemCCL));
  CHECK(flagcxCommRegister(comm, dst, bytes, &regs[1], flagcxMemCCL));
  flagcxPortChannel_t ch;
  flagcxPortChannelHandle_t h;
  CHECK(flagcxPortChannelCreate(comm, 1 - rank, regs, 2, 64, &ch, &h));

  unsigned long long *out;
  CUDA_CHECK(cudaMalloc(&out, 16));
  const unsigned iters = 20; /* two ranks on one GPU take turns: milliseconds per round */
  pingpong<<<1, 1>>>(h, rank == 0, iters, bytes, out);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());
  unsigned long long res[2];
  CUDA_CHECK(cudaMemcpy(res, out, sizeof res, cudaMemcpyDeviceToHost));
  EXPECT(res[1] == 0, "the kernel failed with port code %llu", res[1]);
  CUDA_CHECK(cudaMemcpy(host, dst, bytes, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < bytes; i++)
    EXPECT(host[i] == (unsigned char)(i * 13 + (1 - rank)), "byte %zu: %u", i, host[i]);
  CHECK(flagcxPortChannelCheck(ch));
  CHECK(flagcxPortChannelClose(ch));
  CHECK(flagcxCommDeregister(comm, regs[0], flagcxMemCCL));
  CHECK(flagcxCommDeregister(comm, regs[1], flagcxMemCCL));
  CUDA_CHECK(cudaFree(out));
  CHECK(dev->deviceFree(src, flagcxMemDevice, NULL));
  CHECK(dev->deviceFree(dst, flagcxMemDevice, NULL));
  CHECK(flagcxCommDestroy(comm));
  printf("capi port pingpong ok: rank %d, %u rounds of %zu bytes, %.1f us per round trip\n", rank,
         iters, bytes, res[0] / 1e3 / iters);
  return 0;
}
