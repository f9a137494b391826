/*
 * A fake CUDA driver (libcuda.so.1) and runtime (libcudart.so.12) for tests on
 * hosts without an NVIDIA GPU. One file, built twice by tests/fakes/build_cuda.py:
 * with -DFAKE_CUDA_DRIVER it is libcuda.so.1, with -DFAKE_CUDA_RUNTIME it is
 * libcudart.so.12. Only the entry points perfmon probes exist, with the real C
 * signatures (cuda.h / cuda_runtime_api.h of CUDA 12.x), so a uprobe sees the
 * same registers and stack as on a real host.
 *
 * Behaviour that matters to the probe, copied from the real libraries:
 *  - The runtime forwards its launches to the driver through a function pointer
 *    it looked up once (the real one asks cuGetProcAddress), so a driver entry
 *    point is entered from inside libcudart for every runtime launch.
 *  - The per-thread-default-stream variants (_ptsz) exist next to the legacy
 *    names; here they call the legacy export (through the PLT), so a probe on
 *    both sees a nested call.
 *  - cudaDeviceSynchronize waits by calling cudaStreamSynchronize: one blocking
 *    call nested in another.
 *
 * Blocking: cudaStreamSynchronize, cudaEventSynchronize and cudaMemcpy sleep
 * for the number of microseconds last given to fakeCudaSetSyncMicroseconds()
 * (a test-only export; default 0) on CLOCK_MONOTONIC, as a GPU wait would.
 * cudaMemcpy also copies host memory when given two non-NULL pointers.
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

#if defined(FAKE_CUDA_DRIVER) == defined(FAKE_CUDA_RUNTIME)
#error "build with exactly one of -DFAKE_CUDA_DRIVER or -DFAKE_CUDA_RUNTIME"
#endif

/* ---- driver API (cuda.h) ---------------------------------------------- */

typedef int CUresult; /* enum cudaError_enum */
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUlaunchAttribute_st CUlaunchAttribute;
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

typedef CUresult (*cuLaunchKernel_fn)(CUfunction, unsigned int, unsigned int, unsigned int,
                                      unsigned int, unsigned int, unsigned int, unsigned int,
                                      CUstream, void **, void **);
typedef CUresult (*cuLaunchKernelEx_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*cuGraphLaunch_fn)(CUgraphExec, CUstream);

#ifdef FAKE_CUDA_DRIVER

/* Launches seen. Each entry point validates its arguments before counting, as
 * the real driver does; that also keeps a LOCK-prefixed instruction away from
 * the first byte, where x86 uprobes refuse to go (arch/x86/kernel/uprobes.c). */
static unsigned long launches;

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                               unsigned int gridDimZ, unsigned int blockDimX,
                               unsigned int blockDimY, unsigned int blockDimZ,
                               unsigned int sharedMemBytes, CUstream hStream,
                               void **kernelParams, void **extra)
{
    (void)f; (void)sharedMemBytes; (void)hStream; (void)kernelParams; (void)extra;
    if (!gridDimX || !gridDimY || !gridDimZ || !blockDimX || !blockDimY || !blockDimZ)
        return CUDA_ERROR_INVALID_VALUE;
    __atomic_add_fetch(&launches, 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                    unsigned int gridDimZ, unsigned int blockDimX,
                                    unsigned int blockDimY, unsigned int blockDimZ,
                                    unsigned int sharedMemBytes, CUstream hStream,
                                    void **kernelParams, void **extra)
{
    CUresult rc = cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY,
                                 blockDimZ, sharedMemBytes, hStream, kernelParams, extra);
    return rc; /* not a tail call: the probe must see a caller inside libcuda */
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f,
                                 void **kernelParams, void **extra)
{
    (void)f; (void)kernelParams; (void)extra;
    if (!config || !config->gridDimX || !config->blockDimX)
        return CUDA_ERROR_INVALID_VALUE;
    __atomic_add_fetch(&launches, 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    (void)hGraphExec; (void)hStream;
    return CUDA_SUCCESS;
}

EXPORT unsigned long fakeCudaDriverLaunchCount(void)
{
    return __atomic_load_n(&launches, __ATOMIC_RELAXED);
}

#endif /* FAKE_CUDA_DRIVER */

/* ---- runtime API (cuda_runtime_api.h) ---------------------------------- */

#ifdef FAKE_CUDA_RUNTIME

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorInsufficientDriver = 35,
} cudaError_t;
enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};
typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
typedef struct cudaLaunchAttribute_st cudaLaunchAttribute;
typedef struct dim3 {
    unsigned int x, y, z;
} dim3;
typedef struct cudaLaunchConfig_st {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    cudaLaunchAttribute *attrs;
    unsigned int numAttrs;
} cudaLaunchConfig_t;

static unsigned int sync_us;
static pthread_once_t driver_once = PTHREAD_ONCE_INIT;
static cuLaunchKernel_fn drv_launch;
static cuLaunchKernelEx_fn drv_launch_ex;
static cuGraphLaunch_fn drv_graph_launch;

/* The real runtime dlopens the driver by soname on first use; a process that
 * already loaded libcuda.so.1 (by any path) gets that copy back. */
static void load_driver(void)
{
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!drv)
        return;
    drv_launch = (cuLaunchKernel_fn)dlsym(drv, "cuLaunchKernel");
    drv_launch_ex = (cuLaunchKernelEx_fn)dlsym(drv, "cuLaunchKernelEx");
    drv_graph_launch = (cuGraphLaunch_fn)dlsym(drv, "cuGraphLaunch");
}

static int driver_ready(void)
{
    pthread_once(&driver_once, load_driver);
    return drv_launch && drv_launch_ex && drv_graph_launch;
}

static cudaError_t from_driver(CUresult rc)
{
    return rc == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

static void block_for_gpu(void)
{
    unsigned int us = __atomic_load_n(&sync_us, __ATOMIC_RELAXED);
    if (!us)
        return;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += us / 1000000;
    until.tv_nsec += (long)(us % 1000000) * 1000;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR)
        ;
}

EXPORT void fakeCudaSetSyncMicroseconds(unsigned int microseconds)
{
    __atomic_store_n(&sync_us, microseconds, __ATOMIC_RELAXED);
}

EXPORT cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                    size_t sharedMem, cudaStream_t stream)
{
    if (!driver_ready())
        return cudaErrorInsufficientDriver;
    CUresult rc = drv_launch((CUfunction)(void *)func, gridDim.x, gridDim.y, gridDim.z,
                             blockDim.x, blockDim.y, blockDim.z, (unsigned int)sharedMem,
                             stream, args, NULL);
    return from_driver(rc);
}

EXPORT cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3 gridDim, dim3 blockDim,
                                         void **args, size_t sharedMem, cudaStream_t stream)
{
    cudaError_t rc = cudaLaunchKernel(func, gridDim, blockDim, args, sharedMem, stream);
    return rc;
}

EXPORT cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func,
                                       void **args)
{
    if (!config)
        return cudaErrorInvalidValue;
    if (!driver_ready())
        return cudaErrorInsufficientDriver;
    CUlaunchConfig drv = {
        config->gridDim.x, config->gridDim.y, config->gridDim.z,
        config->blockDim.x, config->blockDim.y, config->blockDim.z,
        (unsigned int)config->dynamicSmemBytes, config->stream, NULL, 0,
    };
    return from_driver(drv_launch_ex(&drv, (CUfunction)(void *)func, args, NULL));
}

EXPORT cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream)
{
    if (!driver_ready())
        return cudaErrorInsufficientDriver;
    return from_driver(drv_graph_launch(graphExec, stream));
}

EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
    (void)stream;
    block_for_gpu();
    return cudaSuccess;
}

EXPORT cudaError_t cudaDeviceSynchronize(void)
{
    cudaError_t rc = cudaStreamSynchronize(NULL);
    return rc;
}

EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t event)
{
    (void)event;
    block_for_gpu();
    return cudaSuccess;
}

EXPORT cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
    if (kind > cudaMemcpyDefault)
        return cudaErrorInvalidValue;
    if (dst && src && count)
        memmove(dst, src, count);
    block_for_gpu();
    return cudaSuccess;
}

#endif /* FAKE_CUDA_RUNTIME */
