/*
 * flagcx.h: the C interface of flagcx-rs, compatible with FlagCX's header (API version 0.13)
 * for the subset below. Names, values, struct layouts and signatures follow FlagCX's, so
 * programs and plugins written for FlagCX build and link against libflagcx from flagcx-rs
 * unchanged. Written for flagcx-rs; every function is documented where it is declared.
 *
 * Conventions (as FlagCX and NCCL document them):
 * - Every function returns flagcxResult_t and never aborts the process; after a failure,
 *   flagcxGetLastError says what happened.
 * - Communication calls return once their work is enqueued on the stream; the stream sees
 *   the data when it reaches that point. One exception: where a process's streams share one
 *   work queue (CUDA_DEVICE_MAX_CONNECTIONS=1), operations of pairs that cannot copy late
 *   (staged, direct and a GPU rank's network pairs) finish before the call returns, since a
 *   stream waiting for them would hold up their copies (README, "Environment").
 * - One order per communicator: a stream waits for its operation and every operation posted
 *   before it on the communicator, on any stream. As with NCCL, do not post on one
 *   communicator from several threads at once: ranks could then wait on each other.
 * - Functions of FlagCX's header that flagcx-rs does not implement yet (suspend and resume,
 *   window registration and the one-sided calls) are exported and return flagcxNotSupported,
 *   with flagcxGetLastError naming what is missing. A reduction of a type that some rank's vendor cannot reduce exactly is
 *   flagcxNotSupported on every rank.
 */
#ifndef FLAGCX_H_
#define FLAGCX_H_

#include <stddef.h>
#include <stdint.h>

/* The FlagCX API version this header follows (0.13.0); FLAGCX_VERSION_CODE is what
 * flagcxGetVersion reports: major * 10000 + minor * 100 + patch. */
#define FLAGCX_VERSION_MAJOR 0
#define FLAGCX_VERSION_MINOR 13
#define FLAGCX_VERSION_PATCH 0
#define FLAGCX_VERSION_CODE                                                                \
  (FLAGCX_VERSION_MAJOR * 10000 + FLAGCX_VERSION_MINOR * 100 + FLAGCX_VERSION_PATCH)

#ifdef __cplusplus
extern "C" {
#endif

/* Result codes. */
typedef enum {
  flagcxSuccess = 0,
  flagcxUnhandledDeviceError = 1, /* the device runtime failed (its code is in the last error) */
  flagcxSystemError = 2,          /* a system call, socket or shared memory failed */
  flagcxInternalError = 3,        /* a bug in flagcx-rs */
  flagcxInvalidArgument = 4,      /* a bad pointer, count, rank or handle */
  flagcxInvalidUsage = 5,         /* a call out of order, mismatched sizes, an aborted communicator */
  flagcxRemoteError = 6,          /* a peer failed, timed out or went away */
  flagcxInProgress = 7,           /* not finished yet */
  flagcxUnhandledCCLError = 8,    /* an underlying communication library failed */
  flagcxNotSupported = 9,         /* not implemented (yet) on this build or vendor */
  flagcxNumResults = 10
} flagcxResult_t;

/* Element types; counts in communication calls are elements of these. */
typedef enum {
  flagcxInt8 = 0,
  flagcxChar = 0,
  flagcxUint8 = 1,
  flagcxInt32 = 2,
  flagcxInt = 2,
  flagcxUint32 = 3,
  flagcxInt64 = 4,
  flagcxUint64 = 5,
  flagcxFloat16 = 6,
  flagcxHalf = 6,
  flagcxFloat32 = 7,
  flagcxFloat = 7,
  flagcxFloat64 = 8,
  flagcxDouble = 8,
  flagcxBfloat16 = 9,
  flagcxNumTypes = 10
} flagcxDataType_t;

/* Reduction operations. Avg sums, then divides by the rank count (integers truncate toward
 * zero; floats multiply by 1/nranks rounded to the element type). flagcxRedNoOp and the
 * values past it are FlagCX's markers, not operations (flagcxInvalidArgument). */
typedef enum { flagcxNumRedOps_dummy = 5 } flagcxRedOp_dummy_t;
typedef enum {
  flagcxSum = 0,
  flagcxProd = 1,
  flagcxMax = 2,
  flagcxMin = 3,
  flagcxAvg = 4,
  flagcxRedNoOp = 5,
  flagcxNumRedOps = 5,
  flagcxMaxRedOp = 0x7fffffff >> (32 - 8 * sizeof(flagcxRedOp_dummy_t))
} flagcxRedOp_t;

/* The kinds of communication call, as FlagCX numbers them (plugins key plans and caches by
 * them; no call of this library takes one). */
typedef enum {
  flagcxCommOpSend = 0,
  flagcxCommOpRecv = 1,
  flagcxCommOpBroadcast = 2,
  flagcxCommOpGather = 3,
  flagcxCommOpScatter = 4,
  flagcxCommOpReduce = 5,
  flagcxCommOpAllReduce = 6,
  flagcxCommOpAllGather = 7,
  flagcxCommOpReduceScatter = 8,
  flagcxCommOpAlltoAll = 9,
  flagcxCommOpAlltoAllv = 10,
  flagcxCommNoOp = 11,
  flagcxNumCommOps = 12
} flagcxCommOp_t;

/* Direction of deviceMemcpy. */
typedef enum {
  flagcxMemcpyHostToDevice = 0,
  flagcxMemcpyDeviceToHost = 1,
  flagcxMemcpyDeviceToDevice = 2
} flagcxMemcpyType_t;

/* Kind of memory for deviceMalloc, deviceFree and deviceMemset. */
typedef enum {
  flagcxMemHost = 0, /* pinned host memory, mapped for the device */
  flagcxMemDevice = 1,
  flagcxMemManaged = 2 /* not supported by flagcx-rs */
} flagcxMemType_t;

/* Event flavours for eventCreate. */
typedef enum {
  flagcxEventDefault = 0,
  flagcxEventDisableTiming = 1
} flagcxEventType_t;

/* Vendor numbers of FlagCX's plugins (no call of this library takes one). */
typedef enum {
  FLAGCX_VENDOR_NVIDIA = 0,
  FLAGCX_VENDOR_ILUVATAR_COREX = 1,
  FLAGCX_VENDOR_MLU = 2,
  FLAGCX_VENDOR_METAX = 3
} flagcxVendorType;

/* Allocators for flagcxMemAlloc and buffer registration. */
typedef enum {
  flagcxMemCCL = 0,  /* device memory that IPC can share */
  flagcxMemSHMEM = 1 /* device memory that file-descriptor IPC can share as well */
} flagcxMemAllocator_t;

/* The job's identity: made by one rank with flagcxGetUniqueId, handed to the others by the
 * application (MPI_Bcast, a file, a key-value store). 256 opaque bytes. */
#define FLAGCX_UNIQUE_ID_BYTES 256
typedef struct {
  char internal[FLAGCX_UNIQUE_ID_BYTES];
} flagcxUniqueId;
typedef flagcxUniqueId *flagcxUniqueId_t;

/* Opaque handles. A flagcxStream_t points to a struct whose first field is the vendor's
 * native stream (a CUstream on NVIDIA, a hipStream_t on AMD), as FlagCX's plugins expect. */
typedef struct flagcxComm *flagcxComm_t;
typedef struct flagcxStream *flagcxStream_t;
typedef struct flagcxEvent *flagcxEvent_t;
typedef struct flagcxIpcMemHandle *flagcxIpcMemHandle_t;
/* Window handles of FlagCX's symmetric and one-sided API; opaque, and never made by this
 * library (window registration is flagcxNotSupported). */
struct flagcxInnerWindow;
typedef struct flagcxInnerWindow *flagcxInnerWindow_t;
struct flagcxSymWindow;
typedef struct flagcxSymWindow *flagcxSymWindow_t;
struct flagcxWindow;
typedef struct flagcxWindow *flagcxWindow_t;

/* A kernel launch's context for FlagCX's device functions: the stream it runs on, the event
 * to record, and its argument list (no call of this library takes one). */
typedef struct {
  flagcxStream_t stream;
  flagcxEvent_t event;
  void **argList;
} flagcxFuncArgs;

/* The device runtime of the vendor FLAGCX_VENDOR names (host, cuda, hip, opencl), else the
 * first compiled-in vendor with a device. A NULL stream means the synchronous form. */
struct flagcxDeviceHandle {
  /* Waits for all work of the current device. */
  flagcxResult_t (*deviceSynchronize)(void);
  /* Copies size bytes; enqueued on stream, or finished on return when stream is NULL. */
  flagcxResult_t (*deviceMemcpy)(void *dst, void *src, size_t size, flagcxMemcpyType_t type,
                                 flagcxStream_t stream);
  /* Sets size bytes to value: device memory through the device (on stream, or synchronously),
   * host memory with a plain memset. */
  flagcxResult_t (*deviceMemset)(void *ptr, int value, size_t size, flagcxMemType_t type,
                                 flagcxStream_t stream);
  /* Allocates size bytes of device or pinned host memory (flagcxMemManaged: NotSupported);
   * the memory is usable once the call returns. */
  flagcxResult_t (*deviceMalloc)(void **ptr, size_t size, flagcxMemType_t type,
                                 flagcxStream_t stream);
  /* Frees what deviceMalloc returned, after the work on stream (if any) finished. */
  flagcxResult_t (*deviceFree)(void *ptr, flagcxMemType_t type, flagcxStream_t stream);
  /* Makes dev the calling thread's current device. */
  flagcxResult_t (*setDevice)(int dev);
  /* The calling thread's current device. */
  flagcxResult_t (*getDevice)(int *dev);
  /* How many devices the vendor has. */
  flagcxResult_t (*getDeviceCount)(int *count);
  /* Writes the vendor's name ("host", "cuda", "hip", "opencl"), NUL-terminated, at most 128
   * bytes. */
  flagcxResult_t (*getVendor)(char *vendor);
  /* The device address of pinned host memory (the same address where the vendor has unified
   * addressing; NotSupported elsewhere). */
  flagcxResult_t (*hostGetDevicePointer)(void **pDevice, void *pHost);
  /* Creates a stream on the current device. */
  flagcxResult_t (*streamCreate)(flagcxStream_t *stream);
  /* Destroys a stream streamCreate made (its work still completes). */
  flagcxResult_t (*streamDestroy)(flagcxStream_t stream);
  /* Wraps a native stream (e.g. a CUstream from PyTorch) without owning it. */
  flagcxResult_t (*streamCopy)(flagcxStream_t *newStream, void *oldStream);
  /* Forgets a wrapper streamCopy made; the native stream lives on. */
  flagcxResult_t (*streamFree)(flagcxStream_t stream);
  /* Waits until the stream's work finished. */
  flagcxResult_t (*streamSynchronize)(flagcxStream_t stream);
  /* flagcxSuccess when the stream is idle, flagcxInProgress while work remains. */
  flagcxResult_t (*streamQuery)(flagcxStream_t stream);
  /* Makes later work on stream wait for event's last recording. */
  flagcxResult_t (*streamWaitEvent)(flagcxStream_t stream, flagcxEvent_t event);
  /* Creates an event. */
  flagcxResult_t (*eventCreate)(flagcxEvent_t *event, flagcxEventType_t eventType);
  /* Destroys an event. */
  flagcxResult_t (*eventDestroy)(flagcxEvent_t event);
  /* Records the event at the current end of stream. */
  flagcxResult_t (*eventRecord)(flagcxEvent_t event, flagcxStream_t stream);
  /* Waits for the event's last recording. */
  flagcxResult_t (*eventSynchronize)(flagcxEvent_t event);
  /* flagcxSuccess when the event's last recording completed, flagcxInProgress otherwise. */
  flagcxResult_t (*eventQuery)(flagcxEvent_t event);
  /* Milliseconds between two completed recordings. */
  flagcxResult_t (*eventElapsedTime)(float *ms, flagcxEvent_t start, flagcxEvent_t end);
  /* Allocates an IPC handle; *size is its length in bytes, to copy between processes. */
  flagcxResult_t (*ipcMemHandleCreate)(flagcxIpcMemHandle_t *handle, size_t *size);
  /* Fills the handle for the device allocation holding devPtr. */
  flagcxResult_t (*ipcMemHandleGet)(flagcxIpcMemHandle_t handle, void *devPtr);
  /* Maps another process's allocation named by handle; *devPtr is its base here. */
  flagcxResult_t (*ipcMemHandleOpen)(flagcxIpcMemHandle_t handle, void **devPtr);
  /* Unmaps what ipcMemHandleOpen mapped. */
  flagcxResult_t (*ipcMemHandleClose)(void *devPtr);
  /* Frees a handle ipcMemHandleCreate allocated. */
  flagcxResult_t (*ipcMemHandleFree)(flagcxIpcMemHandle_t handle);
};
typedef struct flagcxDeviceHandle *flagcxDeviceHandle_t;

/* Allocates the device function table. */
flagcxResult_t flagcxDeviceHandleInit(flagcxDeviceHandle_t *handle);
/* Frees the table. */
flagcxResult_t flagcxDeviceHandleFree(flagcxDeviceHandle_t handle);

/* A unique id, a communicator and a device table together, as FlagCX's tests use them. */
struct flagcxHandlerGroup {
  flagcxUniqueId_t uniqueId;
  flagcxComm_t comm;
  flagcxDeviceHandle_t devHandle;
};
typedef struct flagcxHandlerGroup *flagcxHandlerGroup_t;

/* Allocates a handler group: uniqueId allocated (not yet filled), comm NULL, devHandle made
 * by flagcxDeviceHandleInit. */
flagcxResult_t flagcxHandleInit(flagcxHandlerGroup_t *handler);
/* Frees a handler group (not its communicator: destroy that first). */
flagcxResult_t flagcxHandleFree(flagcxHandlerGroup_t handler);

/* Bytes of one element of dtype (0 for an unknown type). */
size_t getFlagcxDataTypeSize(flagcxDataType_t dtype);

/* The API version: major * 10000 + minor * 100 + patch (1300 for 0.13). */
flagcxResult_t flagcxGetVersion(int *version);

/* Makes a new job id (a fresh random secret) in *uniqueId. */
flagcxResult_t flagcxGetUniqueId(flagcxUniqueId_t uniqueId);

/* Joins the job commId as rank of nranks on the calling thread's current device; returns
 * once every rank joined (or FLAGCX_BOOTSTRAP_TIMEOUT_MS passed). */
flagcxResult_t flagcxCommInitRank(flagcxComm_t *comm, int nranks, flagcxUniqueId_t commId,
                                  int rank);
/* Waits for every operation this rank issued on comm to finish. */
flagcxResult_t flagcxCommFinalize(flagcxComm_t comm);
/* Frees the communicator (operations still pending fail). */
flagcxResult_t flagcxCommDestroy(flagcxComm_t comm);
/* Aborts: pending operations fail, waiting streams are released, peers are told; then frees
 * the communicator. */
flagcxResult_t flagcxCommAbort(flagcxComm_t comm);
/* The first asynchronous failure (a lost or hung peer, a device error) in *asyncError, or
 * flagcxSuccess; never waits. */
flagcxResult_t flagcxCommGetAsyncError(flagcxComm_t comm, flagcxResult_t *asyncError);
/* Ranks in the job. */
flagcxResult_t flagcxCommCount(const flagcxComm_t comm, int *count);
/* This rank. */
flagcxResult_t flagcxCommUserRank(const flagcxComm_t comm, int *rank);
/* The device this rank uses. */
flagcxResult_t flagcxCommGetDeviceNumber(const flagcxComm_t comm, int *device);
/* *isHomo = 1 when every rank uses the same vendor, else 0 (always written). */
flagcxResult_t flagcxIsHomoComm(flagcxComm_t comm, int *isHomo);
/* A static description of a result code. */
const char *flagcxGetErrorString(flagcxResult_t result);
/* What the last failed call said: comm's last error, or with NULL the calling thread's. */
const char *flagcxGetLastError(flagcxComm_t comm);

/* Starts a group: sends and receives until flagcxGroupEnd progress together (a bidirectional
 * exchange must be grouped). Groups nest; the outermost end submits. A group belongs to the
 * calling thread, as NCCL's do: other threads' calls meanwhile are not part of it. */
flagcxResult_t flagcxGroupStart(flagcxComm_t comm);
/* Ends a group and enqueues its operations; small messages between ranks with eager slots are
 * moved before it returns (it may wait up to FLAGCX_SPIN_US for the group's eager receives). */
flagcxResult_t flagcxGroupEnd(flagcxComm_t comm);
/* Sends count elements to peer, ordered on stream. */
flagcxResult_t flagcxSend(const void *sendbuff, size_t count, flagcxDataType_t datatype,
                          int peer, flagcxComm_t comm, flagcxStream_t stream);
/* Receives count elements from peer, ordered on stream; a larger message from the peer is an
 * error on both sides, never an overrun. */
flagcxResult_t flagcxRecv(void *recvbuff, size_t count, flagcxDataType_t datatype, int peer,
                          flagcxComm_t comm, flagcxStream_t stream);
/* Returns once every rank reached it; stream is ordered after it. */
flagcxResult_t flagcxBarrier(flagcxComm_t comm, flagcxStream_t stream);

/* Allocates size bytes of device memory on the current device for communication. */
flagcxResult_t flagcxMemAlloc(void **ptr, size_t size, flagcxMemAllocator_t allocator
#ifdef __cplusplus
                              = flagcxMemCCL
#endif
);
/* Frees what flagcxMemAlloc returned. */
flagcxResult_t flagcxMemFree(void *ptr, flagcxMemAllocator_t allocator
#ifdef __cplusplus
                             = flagcxMemCCL
#endif
);
/* Registers size bytes at buff (device memory of comm's device) for communication; *handle
 * is what flagcxCommDeregister takes. */
flagcxResult_t flagcxCommRegister(const flagcxComm_t comm, void *buff, size_t size,
                                  void **handle, flagcxMemAllocator_t allocator
#ifdef __cplusplus
                                  = flagcxMemCCL
#endif
);
/* Releases a registration. */
flagcxResult_t flagcxCommDeregister(const flagcxComm_t comm, void *handle,
                                    flagcxMemAllocator_t allocator
#ifdef __cplusplus
                                    = flagcxMemCCL
#endif
);

/* winFlags of flagcxCommWindowRegister: a plain window, or one for symmetric collectives. */
#define FLAGCX_WIN_DEFAULT 0x00
#define FLAGCX_WIN_COLL_SYMMETRIC 0x01

/* Registers size bytes at buff as a window for symmetric and one-sided operations, *win its
 * handle (not supported: flagcxNotSupported, *win untouched). */
flagcxResult_t flagcxCommWindowRegister(flagcxComm_t comm, void *buff, size_t size,
                                        flagcxWindow_t *win, int winFlags,
                                        flagcxMemAllocator_t allocator
#ifdef __cplusplus
                                        = flagcxMemCCL
#endif
);
/* Releases a window flagcxCommWindowRegister made (not supported: flagcxNotSupported). */
flagcxResult_t flagcxCommWindowDeregister(flagcxComm_t comm, flagcxWindow_t win,
                                          flagcxMemAllocator_t allocator
#ifdef __cplusplus
                                          = flagcxMemCCL
#endif
);
/* Registers size bytes at buff with every rank for flagcxGet and flagcxPut; collective (not
 * supported: flagcxNotSupported). */
flagcxResult_t flagcxOneSideRegister(flagcxComm_t comm, void *buff, size_t size);

/* ---- port channels: device-initiated transfers (a flagcx-rs extension) ---------------------
 * Kernels put data into the peer's registered buffers, signal it and wait for its signals
 * through flagcx/device.cuh, without returning to the host. */

/* What a kernel needs to drive a port channel: pass it by value as flagcx::PortChannelHandle
 * (flagcx/device.cuh defines the same struct under the same guard). */
#ifndef FLAGCX_PORT_CHANNEL_HANDLE_DEFINED
#define FLAGCX_PORT_CHANNEL_HANDLE_DEFINED
typedef struct flagcxPortChannelHandle {
  uint64_t triggers; /* first trigger slot (host memory the device reaches) */
  uint64_t head;     /* slots reserved (device memory) */
  uint64_t tail;     /* triggers the proxy took */
  uint64_t flushed;  /* sequence number of the last completed flush */
  uint64_t status;   /* 0 while healthy, else a failure code */
  uint64_t flag;     /* signals received from the peer (device memory) */
  uint32_t depth;    /* trigger slots */
  uint32_t reserved;
} flagcxPortChannelHandle_t;
#endif
typedef struct flagcxPortChannel *flagcxPortChannel_t;

/* Creates a port channel with peer. Both ranks call it, in the same order as their other
 * channels with that peer, each naming nhandles registrations from flagcxCommRegister; triggers
 * name buffers by their index in these lists. depth is the trigger FIFO's slot count (1 to
 * 65536). On a same-vendor IPC pair puts are one copy into the peer's buffer; on a staged pair
 * of one host (different vendors, or FLAGCX_P2P_DISABLE=1) they go through shared-memory
 * lanes, where a flush means the sources may be reused. Needs host registration and 64-bit
 * stream memory operations on both ranks' vendors, and both ranks on one host: else
 * flagcxNotSupported. *device_handle receives what kernels take. */
flagcxResult_t flagcxPortChannelCreate(const flagcxComm_t comm, int peer, void *const *handles,
                                       int nhandles, int depth, flagcxPortChannel_t *channel,
                                       flagcxPortChannelHandle_t *device_handle);
/* Fails the channel on purpose: every kernel waiting on it, on both ranks, is released with a
 * failure code (for a peer that hangs without dying). */
flagcxResult_t flagcxPortChannelPoison(flagcxPortChannel_t channel);
/* flagcxSuccess while the channel is healthy; else the code of its failure (the peer died, a
 * bad trigger, a runtime error, poisoned), with flagcxGetLastError(NULL) saying which. */
flagcxResult_t flagcxPortChannelCheck(flagcxPortChannel_t channel);
/* Closes and frees the channel. Both ranks call it after every kernel using it ended; returns
 * the channel's failure if it had one. */
flagcxResult_t flagcxPortChannelClose(flagcxPortChannel_t channel);

/* Reduce: every rank's count elements combined with op into the root's recvbuff (in place when
 * the root passes sendbuff == recvbuff; recvbuff may be NULL off the root). Enqueued on stream;
 * a type some rank's vendor cannot reduce is flagcxNotSupported on every rank. */
flagcxResult_t flagcxReduce(const void *sendbuff, void *recvbuff, size_t count,
                            flagcxDataType_t datatype, flagcxRedOp_t op, int root,
                            flagcxComm_t comm, flagcxStream_t stream);
/* Gather: every rank's count elements into the root's recvbuff at rank * count (in place when
 * sendbuff == recvbuff + rank * count; recvbuff may be NULL off the root). Enqueued on stream. */
flagcxResult_t flagcxGather(const void *sendbuff, void *recvbuff, size_t count,
                            flagcxDataType_t datatype, int root, flagcxComm_t comm,
                            flagcxStream_t stream);
/* Scatter: block q of the root's sendbuff (count elements at q * count) into rank q's recvbuff
 * (in place when recvbuff == sendbuff + rank * count; sendbuff may be NULL off the root). */
flagcxResult_t flagcxScatter(const void *sendbuff, void *recvbuff, size_t count,
                             flagcxDataType_t datatype, int root, flagcxComm_t comm,
                             flagcxStream_t stream);
/* Broadcast: count elements of the root's sendbuff into every rank's recvbuff (in place when
 * the root passes sendbuff == recvbuff). */
flagcxResult_t flagcxBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                               flagcxDataType_t datatype, int root, flagcxComm_t comm,
                               flagcxStream_t stream);
/* All-reduce: every rank's count elements combined element by element with op into every
 * rank's recvbuff (in place when sendbuff == recvbuff); every rank gets the same bits. */
flagcxResult_t flagcxAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                               flagcxDataType_t datatype, flagcxRedOp_t op, flagcxComm_t comm,
                               flagcxStream_t stream);
/* Reduce-scatter: the ranks' nranks * recvcount elements combined with op; rank q receives
 * elements q * recvcount .. of the result (in place when recvbuff == sendbuff + rank *
 * recvcount). */
flagcxResult_t flagcxReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                   flagcxDataType_t datatype, flagcxRedOp_t op,
                                   flagcxComm_t comm, flagcxStream_t stream);
/* All-gather: every rank's sendcount elements into every recvbuff at rank * sendcount (in
 * place when sendbuff == recvbuff + rank * sendcount). */
flagcxResult_t flagcxAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                               flagcxDataType_t datatype, flagcxComm_t comm,
                               flagcxStream_t stream);
/* All-to-all: block q of sendbuff (count elements at q * count) into rank q's recvbuff at
 * rank * count. The buffers must be distinct (in place: flagcxInvalidArgument). */
flagcxResult_t flagcxAlltoAll(const void *sendbuff, void *recvbuff, size_t count,
                              flagcxDataType_t datatype, flagcxComm_t comm,
                              flagcxStream_t stream);
/* All-to-all with per-rank counts and displacements (elements, nranks entries each):
 * sendcounts[q] elements at sendbuff + sdispls[q] go to rank q, which receives recvcounts[me]
 * at recvbuff + rdispls[me]. */
flagcxResult_t flagcxAlltoAllv(const void *sendbuff, size_t *sendcounts, size_t *sdispls,
                               void *recvbuff, size_t *recvcounts, size_t *rdispls,
                               flagcxDataType_t datatype, flagcxComm_t comm,
                               flagcxStream_t stream);
/* Suspends or resumes a communicator (not supported). */
flagcxResult_t flagcxCommSuspend(flagcxComm_t comm);
flagcxResult_t flagcxCommResume(flagcxComm_t comm);

/* ---- one-sided operations (FlagCX's RDMA API; none supported by flagcx-rs yet) ----------- */

/* Registers size bytes at buff as the signal buffer of one-sided operations; ptrType says
 * whether it is device or pinned host memory. Collective (not supported). */
flagcxResult_t flagcxOneSideSignalRegister(const flagcxComm_t comm, void *buff, size_t size,
                                           int ptrType);
/* Registers size bytes of pinned host memory at buff as the staging buffer of one-sided
 * value puts. Collective (not supported). */
flagcxResult_t flagcxOneSideStagingRegister(const flagcxComm_t comm, void *buff, size_t size);
/* Releases the staging buffer's registration (not supported). */
flagcxResult_t flagcxOneSideStagingDeregister(const flagcxComm_t comm);
/* Reads size bytes of peer's registration srcMrIdx at srcOffset into this rank's registration
 * dstMrIdx at dstOffset (not supported). */
flagcxResult_t flagcxGet(flagcxComm_t comm, int peer, size_t srcOffset, size_t dstOffset,
                         size_t size, int srcMrIdx, int dstMrIdx);
/* Writes size bytes of this rank's registration srcMrIdx at srcOffset into peer's
 * registration dstMrIdx at dstOffset (not supported). */
flagcxResult_t flagcxPut(flagcxComm_t comm, int peer, size_t srcOffset, size_t dstOffset,
                         size_t size, int srcMrIdx, int dstMrIdx);
/* count flagcxPut transfers to peer at once, entry i from the i-th element of each array
 * (not supported). */
flagcxResult_t flagcxBatchPut(flagcxComm_t comm, int peer, const size_t *srcOffsets,
                              const size_t *dstOffsets, const size_t *sizes,
                              const int *srcMrIdxs, const int *dstMrIdxs, size_t count);
/* Writes count elements at localbuff into peer's window peerWin at byte peerWinOffset, then
 * signals peer; ordered on stream. flags must be 0 (not supported). */
flagcxResult_t flagcxPutSignal(const void *localbuff, size_t count, flagcxDataType_t datatype,
                               int peer, flagcxWindow_t peerWin, size_t peerWinOffset,
                               unsigned int flags, flagcxComm_t comm, flagcxStream_t stream);
/* Signals peer without data, ordered on stream; flags must be 0 (not supported). */
flagcxResult_t flagcxSignal(int peer, unsigned int flags, flagcxComm_t comm,
                            flagcxStream_t stream);

/* One entry of flagcxWaitSignal: wait until peer's opCnt signals arrived. */
typedef struct {
  uint64_t opCnt;
  int peer;
} flagcxWaitSignalDesc_t;

/* Makes stream wait for the nDesc entries of signalDescs (signalDescs may be NULL when nDesc
 * is 0) (not supported). */
flagcxResult_t flagcxWaitSignal(int nDesc, const flagcxWaitSignalDesc_t *signalDescs,
                                flagcxComm_t comm, flagcxStream_t stream);
/* The count of completed one-sided operations of comm in *count (not supported). */
flagcxResult_t flagcxReadCounter(flagcxComm_t comm, uint64_t *count);
/* Waits until comm's count of completed one-sided operations reaches target (not
 * supported). */
flagcxResult_t flagcxWaitCounter(flagcxComm_t comm, uint64_t target);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLAGCX_H_ */
