/* FlagCX's data-movement collectives from C: broadcast, gather, scatter, all-gather,
 * all-to-all and all-to-allv with every root, every byte checked. */
#include "common.h"

static unsigned char val(int src, int dst, size_t i) { return (unsigned char)(src * 37 + dst * 11 + i * 7 + (i >> 8)); }

int main(void) {
  int rank = env_int("FLAGCX_RANK"), n = env_int("FLAGCX_NRANKS");
  flagcxUniqueId id;
  share_unique_id(rank, &id);
  flagcxDeviceHandle_t dev;
  CHECK(flagcxDeviceHandleInit(&dev));
  flagcxComm_t comm;
  CHECK(flagcxCommInitRank(&comm, n, &id, rank));
  flagcxStream_t stream;
  CHECK(dev->streamCreate(&stream));
  const size_t count = 12345; /* int32 elements per block */
  const size_t block = count * 4, total = block * n;
  void *a, *b;
  CHECK(dev->deviceMalloc(&a, total, flagcxMemDevice, NULL));
  CHECK(dev->deviceMalloc(&b, total, flagcxMemDevice, NULL));
  unsigned char *h = malloc(total);

  for (int root = 0; root < n; root++) {
    /* Broadcast: the root's block (val(root, -1)) everywhere. */
    for (size_t i = 0; i < block; i++) h[i] = val(root, 99, i);
    if (rank == root) CHECK(dev->deviceMemcpy(a, h, block, flagcxMemcpyHostToDevice, NULL));
    CHECK(flagcxBroadcast(a, b, count, flagcxInt32, root, comm, stream));
    CHECK(dev->streamSynchronize(stream));
    CHECK(dev->deviceMemcpy(h, b, block, flagcxMemcpyDeviceToHost, NULL));
    for (size_t i = 0; i < block; i++) EXPECT(h[i] == val(root, 99, i), "broadcast byte %zu from %d", i, root);

    /* Gather: block q at the root is val(q, root). */
    for (size_t i = 0; i < block; i++) h[i] = val(rank, root, i);
    CHECK(dev->deviceMemcpy(a, h, block, flagcxMemcpyHostToDevice, NULL));
    CHECK(flagcxGather(a, b, count, flagcxInt32, root, comm, stream));
    CHECK(dev->streamSynchronize(stream));
    if (rank == root) {
      CHECK(dev->deviceMemcpy(h, b, total, flagcxMemcpyDeviceToHost, NULL));
      for (int q = 0; q < n; q++)
        for (size_t i = 0; i < block; i++) EXPECT(h[q * block + i] == val(q, root, i), "gather block %d", q);
    }

    /* Scatter: the root's block q (val(root, q)) to rank q. */
    for (int q = 0; q < n; q++)
      for (size_t i = 0; i < block; i++) h[q * block + i] = val(root, q, i);
    if (rank == root) CHECK(dev->deviceMemcpy(a, h, total, flagcxMemcpyHostToDevice, NULL));
    CHECK(flagcxScatter(a, b, count, flagcxInt32, root, comm, stream));
    CHECK(dev->streamSynchronize(stream));
    CHECK(dev->deviceMemcpy(h, b, block, flagcxMemcpyDeviceToHost, NULL));
    for (size_t i = 0; i < block; i++) EXPECT(h[i] == val(root, rank, i), "scatter byte %zu from %d", i, root);
  }

  /* All-gather, in place: my block already sits at rank * block. */
  for (size_t i = 0; i < block; i++) h[i] = val(rank, 77, i);
  CHECK(dev->deviceMemcpy((char *)b + rank * block, h, block, flagcxMemcpyHostToDevice, NULL));
  CHECK(flagcxAllGather((char *)b + rank * block, b, count, flagcxInt32, comm, stream));
  CHECK(dev->streamSynchronize(stream));
  CHECK(dev->deviceMemcpy(h, b, total, flagcxMemcpyDeviceToHost, NULL));
  for (int q = 0; q < n; q++)
    for (size_t i = 0; i < block; i++) EXPECT(h[q * block + i] == val(q, 77, i), "all-gather block %d", q);

  /* All-to-all: my block q is val(rank, q). */
  for (int q = 0; q < n; q++)
    for (size_t i = 0; i < block; i++) h[q * block + i] = val(rank, q, i);
  CHECK(dev->deviceMemcpy(a, h, total, flagcxMemcpyHostToDevice, NULL));
  CHECK(flagcxAlltoAll(a, b, count, flagcxInt32, comm, stream));
  CHECK(dev->streamSynchronize(stream));
  CHECK(dev->deviceMemcpy(h, b, total, flagcxMemcpyDeviceToHost, NULL));
  for (int q = 0; q < n; q++)
    for (size_t i = 0; i < block; i++) EXPECT(h[q * block + i] == val(q, rank, i), "all-to-all block %d", q);
  EXPECT(flagcxAlltoAll(a, a, count, flagcxInt32, comm, stream) == flagcxInvalidArgument, "in place");

  /* All-to-allv: rank p sends (p + q + 1) * 100 elements to q, packed. */
  size_t sc[64], sd[64], rc[64], rd[64], so = 0, ro = 0;
  for (int q = 0; q < n; q++) {
    sc[q] = (size_t)(rank + q + 1) * 100; sd[q] = so; so += sc[q];
    rc[q] = (size_t)(q + rank + 1) * 100; rd[q] = ro; ro += rc[q];
  }
  EXPECT(so * 4 <= total && ro * 4 <= total, "room");
  for (int q = 0; q < n; q++)
    for (size_t i = 0; i < sc[q] * 4; i++) h[sd[q] * 4 + i] = val(rank, q, i);
  CHECK(dev->deviceMemcpy(a, h, so * 4, flagcxMemcpyHostToDevice, NULL));
  CHECK(flagcxAlltoAllv(a, sc, sd, b, rc, rd, flagcxFloat, comm, stream));
  CHECK(dev->streamSynchronize(stream));
  CHECK(dev->deviceMemcpy(h, b, ro * 4, flagcxMemcpyDeviceToHost, NULL));
  for (int q = 0; q < n; q++)
    for (size_t i = 0; i < rc[q] * 4; i++) EXPECT(h[rd[q] * 4 + i] == val(q, rank, i), "all-to-allv from %d", q);

  EXPECT(flagcxBroadcast(a, b, count, flagcxInt32, n, comm, stream) == flagcxInvalidArgument, "a bad root");
  CHECK(flagcxCommFinalize(comm));
  CHECK(flagcxCommDestroy(comm));
  CHECK(dev->deviceFree(a, flagcxMemDevice, NULL));
  CHECK(dev->deviceFree(b, flagcxMemDevice, NULL));
  CHECK(dev->streamDestroy(stream));
  CHECK(flagcxDeviceHandleFree(dev));
  free(h);
  printf("capi collectives ok: rank %d of %d\n", rank, n);
  return 0;
}
