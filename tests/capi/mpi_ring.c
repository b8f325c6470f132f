/* The unique id travels by MPI_Bcast, as FlagCX's tests do it; then a ring with every byte
 * checked. Build with mpicc, run with mpirun -n 2 (or more). */
#include <mpi.h>
#include "common.h"

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, nranks;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  flagcxUniqueId id;
  if (rank == 0) CHECK(flagcxGetUniqueId(&id));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  flagcxHandlerGroup_t handler;
  CHECK(flagcxHandleInit(&handler));
  flagcxDeviceHandle_t dev = handler->devHandle;
  CHECK(flagcxCommInitRank(&handler->comm, nranks, &id, rank));
  flagcxComm_t comm = handler->comm;
  flagcxStream_t stream;
  CHECK(dev->streamCreate(&stream));
  size_t count = 100003;
  void *s, *r;
  unsigned char *host = malloc(count * 8);
  CHECK(dev->deviceMalloc(&s, count * 8, flagcxMemDevice, NULL));
  CHECK(dev->deviceMalloc(&r, count * 8, flagcxMemDevice, NULL));
  for (size_t i = 0; i < count * 8; i++) host[i] = pattern(rank, i);
  CHECK(dev->deviceMemcpy(s, host, count * 8, flagcxMemcpyHostToDevice, NULL));
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  CHECK(flagcxGroupStart(comm));
  CHECK(flagcxSend(s, count, flagcxDouble, next, comm, stream));
  CHECK(flagcxRecv(r, count, flagcxDouble, prev, comm, stream));
  CHECK(flagcxGroupEnd(comm));
  CHECK(dev->streamSynchronize(stream));
  CHECK(dev->deviceMemcpy(host, r, count * 8, flagcxMemcpyDeviceToHost, NULL));
  for (size_t i = 0; i < count * 8; i++)
    EXPECT(host[i] == pattern(prev, i), "byte %zu from rank %d", i, prev);
  CHECK(flagcxCommDestroy(comm));
  CHECK(dev->streamDestroy(stream));
  CHECK(dev->deviceFree(s, flagcxMemDevice, NULL));
  CHECK(dev->deviceFree(r, flagcxMemDevice, NULL));
  CHECK(flagcxHandleFree(handler));
  free(host);
  printf("capi mpi ring ok: rank %d of %d\n", rank, nranks);
  MPI_Finalize();
  return 0;
}
