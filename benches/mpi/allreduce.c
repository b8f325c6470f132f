/* The Open MPI side-by-side peer of `flagcx-perf -t allreduce` on the host vendor:
 * MPI_Allreduce (MPI_SUM) of host buffers of float32 or int32; rank 0 prints bytes, µs per
 * call and bus GB/s (2(n-1)/n of the buffer per second, nccl-tests' factor).
 * Build: mpicc -O2 -o mpi-allreduce allreduce.c
 * Run: mpirun -n 2 ./mpi-allreduce [min_bytes] [max_bytes] [float|int] */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  size_t min = argc > 1 ? strtoull(argv[1], NULL, 10) : 8;
  size_t max = argc > 2 ? strtoull(argv[2], NULL, 10) : (size_t)256 << 20;
  int is_int = argc > 3 && strcmp(argv[3], "int") == 0;
  MPI_Datatype t = is_int ? MPI_INT : MPI_FLOAT;
  char *send = malloc(max), *recv = malloc(max);
  for (size_t i = 0; i < max / 4; i++) {
    if (is_int)
      ((int *)send)[i] = (int)(i % 1000) + rank;
    else
      ((float *)send)[i] = (float)(i % 1000) * 0.5f + (float)rank;
  }
  memset(recv, 0, max);
  if (rank == 0) printf("# mpi-allreduce %d ranks %s | %12s %11s %10s\n", n, is_int ? "int32" : "float32", "bytes", "time_us", "busbw");
  for (size_t size = min; size <= max; size *= 16) {
    int count = (int)(size / 4);
    int iters = size <= (1 << 20) ? 1000 : (int)((size_t)(2048u << 20) / size);
    if (iters < 5) iters = 5;
    double t0 = 0;
    for (int i = -5; i < iters; i++) {
      if (i == 0) {
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
      }
      MPI_Allreduce(send, recv, count, t, MPI_SUM, MPI_COMM_WORLD);
    }
    double el = (MPI_Wtime() - t0) / iters;
    if (rank == 0)
      printf("  %12zu %11.2f %10.2f\n", size, el * 1e6, (double)size / el / 1e9 * 2.0 * (n - 1) / n);
  }
  free(send);
  free(recv);
  MPI_Finalize();
  return 0;
}
