// The CUDA adaptor's one kernel: a copy whose length is read when the stream reaches it
// (`DeviceAdaptor::memcpy_sized_async`). The shipped `sized_copy.ptx` is this file compiled
// with `nvcc -ptx -arch=compute_75` (CUDA 13.0), its `.version` lowered to 7.0 so that drivers
// from CUDA 11 on load it; rebuild it on a GPU host with `cargo xtask bundle`'s nvcc line
// below if this file changes.
//
//   nvcc -ptx -arch=compute_75 -o sized_copy.ptx sized_copy.cu
//
// Every thread reads the length word (one 8-byte load of memory another device or process
// wrote before the stream's preceding wait released this kernel), then copies its share:
// 16-byte words where both pointers are 16-byte aligned, bytes otherwise.

extern "C" __global__ void flagcx_sized_copy(unsigned char *dst, const unsigned char *src,
                                             const unsigned long long *len_at,
                                             unsigned long long cap) {
  unsigned long long n = *(volatile const unsigned long long *)len_at;
  if (n > cap) return;
  unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long head = 0;
  if ((((unsigned long long)dst | (unsigned long long)src) & 15) == 0) {
    unsigned long long words = n / 16;
    const uint4 *s = (const uint4 *)src;
    uint4 *d = (uint4 *)dst;
    for (unsigned long long i = tid; i < words; i += stride) d[i] = s[i];
    head = words * 16;
  }
  for (unsigned long long i = head + tid; i < n; i += stride) dst[i] = src[i];
}
