/* A peer dies: flagcxCommGetAsyncError reports it without waiting, and flagcxCommAbort
 * returns. Rank 1 kills itself after one exchange; rank 0 then waits on a receive from it. */
#include <signal.h>
#include "common.h"

int main(void) {
  int rank = env_int("FLAGCX_RANK");
  flagcxUniqueId id;
  share_unique_id(rank, &id);
  flagcxDeviceHandle_t dev;
  CHECK(flagcxDeviceHandleInit(&dev));
  flagcxComm_t comm;
  CHECK(flagcxCommInitRank(&comm, 2, &id, rank));
  flagcxStream_t stream;
  CHECK(dev->streamCreate(&stream));
  void *buf;
  CHECK(dev->deviceMalloc(&buf, 1 << 20, flagcxMemDevice, NULL));
  CHECK(flagcxBarrier(comm, stream));
  if (rank == 1) raise(SIGKILL);
  CHECK(flagcxRecv(buf, 1 << 20, flagcxUint8, 1, comm, stream));
  flagcxResult_t async = flagcxSuccess;
  for (int i = 0; i < 10000 && async == flagcxSuccess; i++) {
    CHECK(flagcxCommGetAsyncError(comm, &async));
    usleep(1000);
  }
  EXPECT(async == flagcxRemoteError, "the peer's death as a remote error, got %d", (int)async);
  EXPECT(strstr(flagcxGetLastError(comm), "rank 1") != NULL, "%s", flagcxGetLastError(comm));
  printf("capi killed peer ok: %s\n", flagcxGetLastError(comm));
  CHECK(flagcxCommAbort(comm));
  CHECK(dev->streamSynchronize(stream));
  CHECK(dev->deviceFree(buf, flagcxMemDevice, NULL));
  CHECK(dev->streamDestroy(stream));
  CHECK(flagcxDeviceHandleFree(dev));
  return 0;
}
