/* The Open MPI side-by-side peer of `flagcx-perf -t pingpong` on the host vendor: two ranks
 * bounce a host buffer; rank 0 prints bytes, round-trip µs and one-way GB/s per size, in the
 * same columns as flagcx-perf. Build: mpicc -O2 -o mpi-pingpong pingpong.c
 * Run: mpirun -n 2 ./mpi-pingpong [min_bytes] [max_bytes]   (Open MPI uses its shared-memory
 * transport, "vader"/"sm", between two ranks of one node). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size != 2) {
        if (rank == 0) fprintf(stderr, "mpi-pingpong needs exactly 2 ranks\n");
        MPI_Finalize();
        return 1;
    }
    size_t min = argc > 1 ? strtoull(argv[1], NULL, 10) : 8;
    size_t max = argc > 2 ? strtoull(argv[2], NULL, 10) : (size_t)256 << 20;
    char *buf = malloc(max);
    memset(buf, rank + 1, max);
    if (rank == 0) printf("# mpi-pingpong | %12s %11s %10s\n", "bytes", "rtt_us", "GB/s");
    for (size_t n = min; n <= max; n *= 2) {
        int iters = n <= (1 << 20) ? 1000 : (int)((size_t)(2048u << 20) / n);
        if (iters < 10) iters = 10;
        for (int i = -10; i < iters; i++) {
            double t = 0;
            if (i == 0) { MPI_Barrier(MPI_COMM_WORLD); }
            if (rank == 0) {
                MPI_Send(buf, (int)n, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
                MPI_Recv(buf, (int)n, MPI_BYTE, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            } else {
                MPI_Recv(buf, (int)n, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                MPI_Send(buf, (int)n, MPI_BYTE, 0, 0, MPI_COMM_WORLD);
            }
            (void)t;
        }
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++) {
            if (rank == 0) {
                MPI_Send(buf, (int)n, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
                MPI_Recv(buf, (int)n, MPI_BYTE, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            } else {
                MPI_Recv(buf, (int)n, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                MPI_Send(buf, (int)n, MPI_BYTE, 0, 0, MPI_COMM_WORLD);
            }
        }
        double rtt = (MPI_Wtime() - t0) / iters;
        if (rank == 0) printf("  %12zu %11.2f %10.2f\n", n, rtt * 1e6, (double)n / (rtt / 2) / 1e9);
        if (n > max / 2) break;
    }
    free(buf);
    MPI_Finalize();
    return 0;
}
