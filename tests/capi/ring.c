/* A ring through FlagCX's C API, the way FlagCX's own tests use it: the unique id from rank
 * 0, the device table for memory and streams, grouped send/recv to the neighbours, every byte
 * checked; then a barrier, groups per thread, a bad peer, a NULL communicator, an
 * unimplemented collective and mismatched sizes, each with its error code. */
#include "common.h"
#include <pthread.h>

/* Another thread cannot end this thread's group: groups are per thread. */
static void *end_anothers_group(void *comm) {
  flagcxResult_t r = flagcxGroupEnd((flagcxComm_t)comm);
  return (void *)(long)r;
}

int main(void) {
  int rank = env_int("FLAGCX_RANK"), nranks = env_int("FLAGCX_NRANKS");
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  flagcxUniqueId id;
  share_unique_id(rank, &id);

  flagcxDeviceHandle_t dev;
  CHECK(flagcxDeviceHandleInit(&dev));
  char vendor[128];
  CHECK(dev->getVendor(vendor));
  int ndev = 0, cur = -1;
  CHECK(dev->getDeviceCount(&ndev));
  CHECK(dev->getDevice(&cur));
  EXPECT(ndev >= 1 && cur >= 0 && cur < ndev, "device %d of %d", cur, ndev);

  flagcxComm_t comm;
  CHECK(flagcxCommInitRank(&comm, nranks, &id, rank));
  int n = -1, me = -1, homo = -1, devno = -1, version = 0;
  CHECK(flagcxCommCount(comm, &n));
  CHECK(flagcxCommUserRank(comm, &me));
  CHECK(flagcxIsHomoComm(comm, &homo));
  CHECK(flagcxCommGetDeviceNumber(comm, &devno));
  CHECK(flagcxGetVersion(&version));
  EXPECT(n == nranks && me == rank && (homo == 0 || homo == 1) && devno == cur && version == 1300,
         "count %d rank %d homo %d device %d version %d", n, me, homo, devno, version);

  flagcxStream_t stream;
  CHECK(dev->streamCreate(&stream));
  /* An odd count of floats: 1 MiB + 3 elements. */
  size_t count = (1u << 18) + 3, bytes = count * getFlagcxDataTypeSize(flagcxFloat);
  EXPECT(getFlagcxDataTypeSize(flagcxFloat) == 4 && getFlagcxDataTypeSize(flagcxBfloat16) == 2,
         "type sizes");
  void *sendbuf, *recvbuf;
  CHECK(dev->deviceMalloc(&sendbuf, bytes, flagcxMemDevice, NULL));
  CHECK(dev->deviceMalloc(&recvbuf, bytes, flagcxMemDevice, NULL));
  unsigned char *host;
  CHECK(dev->deviceMalloc((void **)&host, bytes, flagcxMemHost, NULL));
  for (size_t i = 0; i < bytes; i++) host[i] = pattern(rank, i);
  CHECK(dev->deviceMemcpy(sendbuf, host, bytes, flagcxMemcpyHostToDevice, stream));
  CHECK(dev->deviceMemset(recvbuf, 0, bytes, flagcxMemDevice, stream));

  for (int round = 0; round < 3; round++) {
    CHECK(flagcxGroupStart(comm));
    CHECK(flagcxGroupStart(comm)); /* groups nest */
    CHECK(flagcxSend(sendbuf, count, flagcxFloat, next, comm, stream));
    CHECK(flagcxRecv(recvbuf, count, flagcxFloat, prev, comm, stream));
    CHECK(flagcxGroupEnd(comm));
    CHECK(flagcxGroupEnd(comm));
  }
  /* The host buffer is reused: the stream must be past its copy out of it first. */
  CHECK(dev->streamSynchronize(stream));
  CHECK(dev->deviceMemset(host, 0, bytes, flagcxMemHost, NULL));
  CHECK(dev->deviceMemcpy(host, recvbuf, bytes, flagcxMemcpyDeviceToHost, stream));
  CHECK(dev->streamSynchronize(stream));
  for (size_t i = 0; i < bytes; i++)
    EXPECT(host[i] == pattern(prev, i), "byte %zu from rank %d is %u", i, prev, host[i]);
  EXPECT(dev->streamQuery(stream) == flagcxSuccess, "an idle stream");

  /* An empty group, a barrier, events around nothing. */
  CHECK(flagcxGroupStart(comm));
  pthread_t other;
  void *ended = NULL;
  EXPECT(pthread_create(&other, NULL, end_anothers_group, comm) == 0, "pthread_create");
  EXPECT(pthread_join(other, &ended) == 0, "pthread_join");
  EXPECT((long)ended == flagcxInvalidUsage, "another thread ended this thread's group: %ld",
         (long)ended);
  CHECK(flagcxGroupEnd(comm));
  CHECK(flagcxBarrier(comm, stream));
  flagcxEvent_t ev;
  CHECK(dev->eventCreate(&ev, flagcxEventDefault));
  CHECK(dev->eventRecord(ev, stream));
  CHECK(dev->eventSynchronize(ev));
  EXPECT(dev->eventQuery(ev) == flagcxSuccess, "a completed event");
  CHECK(dev->streamWaitEvent(stream, ev));
  CHECK(dev->eventDestroy(ev));

  /* Errors: codes, never a crash; the last error says what happened. */
  EXPECT(flagcxSend(sendbuf, count, flagcxFloat, nranks, comm, stream) == flagcxInvalidArgument,
         "a peer out of range");
  EXPECT(strstr(flagcxGetLastError(comm), "out of range") != NULL, "%s", flagcxGetLastError(comm));
  EXPECT(flagcxSend(sendbuf, count, (flagcxDataType_t)42, next, comm, stream) == flagcxInvalidArgument,
         "an unknown type");
  EXPECT(flagcxCommCount(NULL, &n) == flagcxInvalidArgument, "a NULL communicator");
  EXPECT(flagcxGroupEnd(comm) == flagcxInvalidUsage, "an end without a start");
  EXPECT(flagcxAllReduce(sendbuf, recvbuf, count, flagcxFloat, flagcxRedNoOp, comm, stream) ==
             flagcxInvalidArgument, "a marker instead of a reduction operator");
  EXPECT(flagcxCommSuspend(comm) == flagcxNotSupported, "suspending is not there yet");
  EXPECT(strstr(flagcxGetLastError(NULL), "not implemented") != NULL, "%s", flagcxGetLastError(NULL));
  EXPECT(dev->deviceMalloc(&sendbuf, 16, flagcxMemManaged, NULL) == flagcxNotSupported,
         "managed memory");

  /* Mismatched sizes (ranks 0 and 1 only): a larger send than the receive fails on both
   * sides, and the receive buffer keeps what it had. */
  CHECK(flagcxCommFinalize(comm));
  if (rank < 2 && nranks >= 2) {
    int peer = 1 - rank;
    CHECK(dev->deviceMemset(recvbuf, 0x5a, bytes, flagcxMemDevice, NULL));
    if (rank == 0)
      CHECK(flagcxSend(sendbuf, count, flagcxFloat, peer, comm, stream));
    else
      CHECK(flagcxRecv(recvbuf, count - 1, flagcxFloat, peer, comm, stream));
    flagcxResult_t r = flagcxCommFinalize(comm);
    EXPECT(r == flagcxInvalidUsage, "a size mismatch fails with InvalidUsage, got %d: %s", (int)r,
           flagcxGetLastError(comm));
    EXPECT(strstr(flagcxGetLastError(comm), "size mismatch") != NULL, "%s", flagcxGetLastError(comm));
    CHECK(dev->deviceMemcpy(host, recvbuf, bytes, flagcxMemcpyDeviceToHost, NULL));
    for (size_t i = 0; i < bytes; i++) EXPECT(host[i] == 0x5a, "byte %zu was overwritten", i);
  }
  CHECK(flagcxBarrier(comm, stream));

  flagcxResult_t async;
  CHECK(flagcxCommGetAsyncError(comm, &async));
  EXPECT(async == flagcxSuccess, "no asynchronous failure, got %d", (int)async);
  CHECK(flagcxCommDestroy(comm));
  CHECK(dev->streamDestroy(stream));
  CHECK(dev->deviceFree(host, flagcxMemHost, NULL));
  CHECK(dev->deviceFree(recvbuf, flagcxMemDevice, NULL));
  CHECK(dev->deviceFree(sendbuf, flagcxMemDevice, NULL));
  CHECK(flagcxDeviceHandleFree(dev));
  printf("capi ring ok: rank %d of %d on %s device %d\n", rank, nranks, vendor, cur);
  return 0;
}
