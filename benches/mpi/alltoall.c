/* The Open MPI side-by-side peer of `flagcx-perf -t alltoall` on the host vendor: MPI_Alltoall
 * of host buffers; rank 0 prints the whole buffer's bytes (nranks blocks, as flagcx-perf and
 * nccl-tests count it), µs per call and bus GB/s ((n-1)/n of the buffer per second).
 * Build: mpicc -O2 -o mpi-alltoall alltoall.c
 * Run: mpirun -n 4 ./mpi-alltoall [min_bytes] [max_bytes] */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  size_t min = argc > 1 ? strtoull(argv[1], NULL, 10) : 4096;
  size_t max = argc > 2 ? strtoull(argv[2], NULL, 10) : (size_t)256 << 20;
  char *send = malloc(max), *recv = malloc(max);
  memset(send, rank + 1, max);
  memset(recv, 0, max);
  if (rank == 0) printf("# mpi-alltoall %d ranks | %12s %11s %10s\n", n, "bytes", "time_us", "busbw");
  for (size_t size = min; size <= max; size *= 4) {
    size_t block = size / n;
    int iters = size <= (1 << 20) ? 200 : (int)((size_t)(1024u << 20) / size);
    if (iters < 5) iters = 5;
    double t0 = 0;
    for (int i = -5; i < iters; i++) {
      if (i == 0) {
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
      }
      MPI_Alltoall(send, (int)block, MPI_BYTE, recv, (int)block, MPI_BYTE, MPI_COMM_WORLD);
    }
    double t = (MPI_Wtime() - t0) / iters;
    if (rank == 0)
      printf("  %12zu %11.2f %10.2f\n", size, t * 1e6, (double)size / t / 1e9 * (n - 1) / n);
  }
  free(send);
  free(recv);
  MPI_Finalize();
  return 0;
}
