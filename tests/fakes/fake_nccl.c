/*
 * A fake libnccl.so.2 for tests on hosts without GPUs: the collectives perfmon
 * probes, with the real signatures and enums of nccl.h (NCCL 2.32), built by
 * tests/fakes/build_cuda.py.
 *
 * As in the real library:
 *  - every ncclX is exported (weak) together with a pncclX alias at the same
 *    address (NCCL's NCCL_API macro: the "p" names are the profiling
 *    interface), so a probe that attached both would count each call twice;
 *  - NCCL launches its own kernels through the driver (it links the CUDA runtime
 *    statically, so its launches reach libcuda.so.1's cuLaunchKernel from
 *    inside libnccl): one kernel per collective called outside a group, one
 *    per ncclGroupStart/ncclGroupEnd pair however many calls it holds;
 *  - a NULL communicator, an unknown datatype or reduction op is
 *    ncclInvalidArgument, and nothing is launched.
 *
 * ncclCommInitAll hands out dummy communicators; no data moves.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>

#define EXPORT __attribute__((visibility("default")))
/* NCCL_API of nccl's sources: the public name is WEAK, its "p" twin a GLOBAL
 * alias at the same address. The linker then stores one .dynstr string,
 * "pncclAllReduce", and points ncclAllReduce's name into its middle, as in the
 * real libnccl.so.2. */
#define NCCL_API(ret, func, ...)                                                   \
    EXPORT __attribute__((weak)) ret func(__VA_ARGS__);                            \
    EXPORT __attribute__((alias(#func))) ret p##func(__VA_ARGS__);                 \
    EXPORT __attribute__((weak)) ret func(__VA_ARGS__)

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
} ncclResult_t;

typedef enum {
    ncclInt8 = 0, ncclChar = 0,
    ncclUint8 = 1,
    ncclInt32 = 2, ncclInt = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6, ncclHalf = 6,
    ncclFloat32 = 7, ncclFloat = 7,
    ncclFloat64 = 8, ncclDouble = 8,
    ncclBfloat16 = 9,
    ncclFloat8e4m3 = 10,
    ncclFloat8e5m2 = 11,
    ncclNumTypes = 12,
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4,
               ncclNumOps = 5 } ncclRedOp_t;

typedef struct ncclCollConfig_v23200 ncclCollConfig_t; /* opaque here: NULL = defaults */
typedef struct ncclComm {
    int rank;
    int nranks;
} *ncclComm_t;
typedef struct CUstream_st *cudaStream_t;

typedef int (*cuLaunchKernel_fn)(void *, unsigned int, unsigned int, unsigned int, unsigned int,
                                 unsigned int, unsigned int, unsigned int, void *, void **,
                                 void **);

static pthread_once_t driver_once = PTHREAD_ONCE_INIT;
static cuLaunchKernel_fn drv_launch;
static __thread int group_depth;
static __thread int group_pending;

static void load_driver(void)
{
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (drv)
        drv_launch = (cuLaunchKernel_fn)dlsym(drv, "cuLaunchKernel");
}

static ncclResult_t launch_kernel(cudaStream_t stream)
{
    pthread_once(&driver_once, load_driver);
    if (!drv_launch)
        return ncclUnhandledCudaError;
    /* One block of 512 threads, like a small ring kernel; no arguments. */
    int rc = drv_launch(NULL, 1, 1, 1, 512, 1, 1, 0, stream, NULL, NULL);
    return rc == 0 ? ncclSuccess : ncclUnhandledCudaError;
}

static ncclResult_t enqueue(ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
    if (!comm || (unsigned)datatype >= ncclNumTypes)
        return ncclInvalidArgument;
    if (group_depth > 0) {
        group_pending = 1;
        return ncclSuccess;
    }
    return launch_kernel(stream);
}

static int bad_op(ncclRedOp_t op)
{
    return (unsigned)op >= ncclNumOps;
}

NCCL_API(ncclResult_t, ncclCommInitAll, ncclComm_t *comms, int ndev, const int *devlist)
{
    (void)devlist;
    if (!comms || ndev <= 0)
        return ncclInvalidArgument;
    for (int i = 0; i < ndev; i++) {
        comms[i] = calloc(1, sizeof(struct ncclComm));
        if (!comms[i])
            return ncclSystemError;
        comms[i]->rank = i;
        comms[i]->nranks = ndev;
    }
    return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclCommDestroy, ncclComm_t comm)
{
    free(comm);
    return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclGroupStart, void)
{
    group_depth++;
    return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclGroupEnd, void)
{
    if (group_depth == 0)
        return ncclInvalidUsage;
    if (--group_depth > 0 || !group_pending)
        return ncclSuccess;
    group_pending = 0;
    return launch_kernel(NULL);
}

NCCL_API(ncclResult_t, ncclAllReduce, const void *sendbuff, void *recvbuff, size_t count,
         ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)count;
    return bad_op(op) ? ncclInvalidArgument : enqueue(datatype, comm, stream);
}

NCCL_API(ncclResult_t, ncclReduceScatter, const void *sendbuff, void *recvbuff,
         size_t recvcount, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
         cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)recvcount;
    return bad_op(op) ? ncclInvalidArgument : enqueue(datatype, comm, stream);
}

NCCL_API(ncclResult_t, ncclAllGather, const void *sendbuff, void *recvbuff, size_t sendcount,
         ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)sendcount;
    return enqueue(datatype, comm, stream);
}

NCCL_API(ncclResult_t, ncclBroadcast, const void *sendbuff, void *recvbuff, size_t count,
         ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)count;
    if (comm && (root < 0 || root >= comm->nranks))
        return ncclInvalidArgument;
    return enqueue(datatype, comm, stream);
}

NCCL_API(ncclResult_t, ncclReduce, const void *sendbuff, void *recvbuff, size_t count,
         ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
         cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)count;
    if (bad_op(op) || (comm && (root < 0 || root >= comm->nranks)))
        return ncclInvalidArgument;
    return enqueue(datatype, comm, stream);
}

NCCL_API(ncclResult_t, ncclSend, const void *sendbuff, size_t count, ncclDataType_t datatype,
         int peer, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)count; (void)peer;
    return enqueue(datatype, comm, stream);
}

NCCL_API(ncclResult_t, ncclRecv, void *recvbuff, size_t count, ncclDataType_t datatype,
         int peer, ncclComm_t comm, cudaStream_t stream)
{
    (void)recvbuff; (void)count; (void)peer;
    return enqueue(datatype, comm, stream);
}

/* NCCL 2.28+ */
NCCL_API(ncclResult_t, ncclAlltoAll, const void *sendbuff, void *recvbuff, size_t count,
         ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)count;
    return enqueue(datatype, comm, stream);
}

NCCL_API(ncclResult_t, ncclGather, const void *sendbuff, void *recvbuff, size_t count,
         ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)count;
    if (comm && (root < 0 || root >= comm->nranks))
        return ncclInvalidArgument;
    return enqueue(datatype, comm, stream);
}

NCCL_API(ncclResult_t, ncclScatter, const void *sendbuff, void *recvbuff, size_t count,
         ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)count;
    if (comm && (root < 0 || root >= comm->nranks))
        return ncclInvalidArgument;
    return enqueue(datatype, comm, stream);
}

/* NCCL 2.32: the per-call-config twin, its own code as in the real library
 * (it does not call ncclAllReduce). */
NCCL_API(ncclResult_t, ncclAllReduceConfig, const void *sendbuff, void *recvbuff, size_t count,
         ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream,
         const ncclCollConfig_t *config)
{
    (void)sendbuff; (void)recvbuff; (void)count; (void)config;
    return bad_op(op) ? ncclInvalidArgument : enqueue(datatype, comm, stream);
}
