/* FlagCX's reductions from C: all-reduce, reduce-scatter and reduce of every integer type and
 * float32/float64 with every operator, out of place and in place, reduce with NULL recvbuff
 * off the root; values chosen so every order of combining gives the same exact result (small
 * integers), so the check needs no knowledge of the algorithm. Argument errors too. */
#include <stdint.h>

#include "common.h"

/* Rank r's element i, small enough that sums and products of up to 8 ranks are exact. */
static int64_t v(int r, size_t i) { return (int64_t)((i * 7 + (size_t)r * 3) % 5) - 2 + (r == 0 && i % 3 == 0); }

static void put(void *h, flagcxDataType_t t, size_t i, int64_t x) {
  switch (t) {
  case flagcxInt8: ((int8_t *)h)[i] = (int8_t)x; break;
  case flagcxUint8: ((uint8_t *)h)[i] = (uint8_t)x; break;
  case flagcxInt32: ((int32_t *)h)[i] = (int32_t)x; break;
  case flagcxUint32: ((uint32_t *)h)[i] = (uint32_t)x; break;
  case flagcxInt64: ((int64_t *)h)[i] = x; break;
  case flagcxUint64: ((uint64_t *)h)[i] = (uint64_t)x; break;
  case flagcxFloat32: ((float *)h)[i] = (float)x; break;
  default: ((double *)h)[i] = (double)x; break;
  }
}

static int is_float(flagcxDataType_t t) { return t == flagcxFloat32 || t == flagcxFloat64; }
static int is_unsigned(flagcxDataType_t t) { return t == flagcxUint8 || t == flagcxUint32 || t == flagcxUint64; }

/* An integer element as the type holds it: signed types sign-extended, unsigned ones as bits. */
static int64_t geti(const void *h, flagcxDataType_t t, size_t i) {
  switch (t) {
  case flagcxInt8: return ((const int8_t *)h)[i];
  case flagcxUint8: return ((const uint8_t *)h)[i];
  case flagcxInt32: return ((const int32_t *)h)[i];
  case flagcxUint32: return ((const uint32_t *)h)[i];
  case flagcxInt64: return ((const int64_t *)h)[i];
  default: return (int64_t)((const uint64_t *)h)[i];
  }
}

/* The expected element i over n ranks, as the type's bytes in out: integers wrap and average
 * by truncating division of the wrapped sum; floats are exact here (small integers), and
 * average by multiplying with 1/n rounded to the type. */
static void want(flagcxDataType_t t, flagcxRedOp_t op, int n, size_t i, unsigned char *out) {
  if (is_float(t)) {
    double acc = (double)v(0, i);
    for (int r = 1; r < n; r++) {
      double b = (double)v(r, i);
      acc = op == flagcxProd ? acc * b : op == flagcxMax ? (b > acc ? b : acc) : op == flagcxMin ? (b < acc ? b : acc) : acc + b;
    }
    if (t == flagcxFloat32) {
      float f = op == flagcxAvg ? (float)acc * (float)(1.0 / n) : (float)acc;
      memcpy(out, &f, 4);
    } else {
      double d = op == flagcxAvg ? acc * (1.0 / n) : acc;
      memcpy(out, &d, 8);
    }
    return;
  }
  unsigned char acc[8] = {0}, one[8] = {0};
  put(acc, t, 0, v(0, i));
  for (int r = 1; r < n; r++) {
    put(one, t, 0, v(r, i));
    int64_t a = geti(acc, t, 0), b = geti(one, t, 0);
    int64_t x;
    if (op == flagcxProd) x = (int64_t)((uint64_t)a * (uint64_t)b);
    else if (op == flagcxMax) x = is_unsigned(t) ? ((uint64_t)b > (uint64_t)a ? b : a) : (b > a ? b : a);
    else if (op == flagcxMin) x = is_unsigned(t) ? ((uint64_t)b < (uint64_t)a ? b : a) : (b < a ? b : a);
    else x = (int64_t)((uint64_t)a + (uint64_t)b);
    put(acc, t, 0, x);
  }
  if (op == flagcxAvg) {
    int64_t x = geti(acc, t, 0);
    put(acc, t, 0, is_unsigned(t) ? (int64_t)((uint64_t)x / (uint64_t)n) : x / n);
  }
  memcpy(out, acc, getFlagcxDataTypeSize(t));
}

/* Compares count elements of the result with the reference (element first + i). */
static void check(const char *what, const unsigned char *h, flagcxDataType_t t, flagcxRedOp_t op, int n, size_t first, size_t count) {
  size_t sz = getFlagcxDataTypeSize(t);
  unsigned char w[8];
  for (size_t i = 0; i < count; i++) {
    want(t, op, n, first + i, w);
    EXPECT(memcmp(h + i * sz, w, sz) == 0, "%s of type %d op %d: element %zu differs", what, (int)t, (int)op, i);
  }
}

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
  const size_t count = 10007; /* elements per rank: prime, past the direct algorithm's blocks for 8-byte types */
  const flagcxDataType_t types[] = {flagcxInt8, flagcxUint8, flagcxInt32, flagcxUint32,
                                    flagcxInt64, flagcxUint64, flagcxFloat32, flagcxFloat64};
  const flagcxRedOp_t ops[] = {flagcxSum, flagcxProd, flagcxMax, flagcxMin, flagcxAvg};
  void *a, *b;
  CHECK(dev->deviceMalloc(&a, count * 8 * n, flagcxMemDevice, NULL));
  CHECK(dev->deviceMalloc(&b, count * 8 * n, flagcxMemDevice, NULL));
  unsigned char *h = malloc(count * 8 * n);
  int calls = 0;
  for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++)
    for (size_t oi = 0; oi < sizeof ops / sizeof *ops; oi++) {
      flagcxDataType_t t = types[ti];
      flagcxRedOp_t op = ops[oi];
      size_t sz = getFlagcxDataTypeSize(t);
      int in_place = (ti + oi) % 2;
      /* All-reduce. */
      for (size_t i = 0; i < count; i++) put(h, t, i, v(rank, i));
      CHECK(dev->deviceMemcpy(a, h, count * sz, flagcxMemcpyHostToDevice, NULL));
      void *out = in_place ? a : b;
      CHECK(flagcxAllReduce(a, out, count, t, op, comm, stream));
      CHECK(dev->streamSynchronize(stream));
      CHECK(dev->deviceMemcpy(h, out, count * sz, flagcxMemcpyDeviceToHost, NULL));
      check("all-reduce", h, t, op, n, 0, count);
      /* Reduce-scatter: rank r gets elements r * m .. of the combined n * m. */
      size_t m = count / n + 1;
      for (size_t i = 0; i < m * n; i++) put(h, t, i, v(rank, i));
      CHECK(dev->deviceMemcpy(a, h, m * n * sz, flagcxMemcpyHostToDevice, NULL));
      out = in_place ? (char *)a + rank * m * sz : b;
      CHECK(flagcxReduceScatter(a, out, m, t, op, comm, stream));
      CHECK(dev->streamSynchronize(stream));
      CHECK(dev->deviceMemcpy(h, out, m * sz, flagcxMemcpyDeviceToHost, NULL));
      check("reduce-scatter", h, t, op, n, rank * m, m);
      /* Reduce to a root that moves with the call; NULL recvbuff off the root. */
      int root = (int)((ti * 5 + oi) % (size_t)n);
      for (size_t i = 0; i < count; i++) put(h, t, i, v(rank, i));
      CHECK(dev->deviceMemcpy(a, h, count * sz, flagcxMemcpyHostToDevice, NULL));
      out = rank == root ? (in_place ? a : b) : NULL;
      CHECK(flagcxReduce(a, out, count, t, op, root, comm, stream));
      CHECK(dev->streamSynchronize(stream));
      if (rank == root) {
        CHECK(dev->deviceMemcpy(h, out, count * sz, flagcxMemcpyDeviceToHost, NULL));
        check("reduce", h, t, op, n, 0, count);
      }
      calls += 3;
    }
  /* Argument errors: an operator that is only a marker, an unknown type, a root out of range. */
  EXPECT(flagcxAllReduce(a, b, 4, flagcxInt32, flagcxRedNoOp, comm, stream) == flagcxInvalidArgument, "flagcxRedNoOp");
  EXPECT(flagcxAllReduce(a, b, 4, (flagcxDataType_t)42, flagcxSum, comm, stream) == flagcxInvalidArgument, "type 42");
  EXPECT(flagcxReduce(a, b, 4, flagcxInt32, flagcxSum, n, comm, stream) == flagcxInvalidArgument, "root %d", n);
  /* Zero elements: nothing to do, on every rank. */
  CHECK(flagcxAllReduce(a, b, 0, flagcxFloat32, flagcxSum, comm, stream));
  CHECK(dev->streamSynchronize(stream));
  CHECK(dev->deviceFree(a, flagcxMemDevice, NULL));
  CHECK(dev->deviceFree(b, flagcxMemDevice, NULL));
  CHECK(flagcxCommDestroy(comm));
  free(h);
  printf("capi reductions ok: rank %d of %d, %d calls\n", rank, n, calls);
  return 0;
}
