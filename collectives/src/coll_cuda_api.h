/* The CUDA runtime and NCCL as the nccl backend sees them: a table of function pointers filled
 * by dlopen + dlsym on first use, so that no pshard program needs libcudart or libnccl to start
 * and a CPU machine without them runs the tcp and shm backends. nccl.h and cuda_runtime_api.h
 * still give the types and constants at compile time; each pointer has the type of the function
 * it stands for (__typeof__), so a prototype cannot drift from the header's. */
#ifndef PSHARD_COLL_CUDA_API_H
#define PSHARD_COLL_CUDA_API_H

#include <stddef.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "pshard/status.h"

/* X(function): every CUDA runtime function the nccl backend and the CUDA helpers call. */
#define COLL_CUDART_FUNCS(X)                                                                       \
    X(cudaGetErrorString)                                                                          \
    X(cudaGetErrorName)                                                                            \
    X(cudaGetDeviceCount)                                                                          \
    X(cudaSetDevice)                                                                               \
    X(cudaStreamCreateWithFlags)                                                                   \
    X(cudaStreamDestroy)                                                                           \
    X(cudaStreamQuery)                                                                             \
    X(cudaMalloc)                                                                                  \
    X(cudaFree)                                                                                    \
    X(cudaMemcpyAsync)                                                                             \
    X(cudaMemsetAsync)                                                                             \
    X(cudaHostRegister)                                                                            \
    X(cudaHostUnregister)

/* X(function): every NCCL function the nccl backend calls. */
#define COLL_NCCL_FUNCS(X)                                                                         \
    X(ncclGetErrorString)                                                                          \
    X(ncclGetLastError)                                                                            \
    X(ncclGetUniqueId)                                                                             \
    X(ncclCommInitRankConfig)                                                                      \
    X(ncclCommGetAsyncError)                                                                       \
    X(ncclCommFinalize)                                                                            \
    X(ncclCommDestroy)                                                                             \
    X(ncclCommAbort)                                                                               \
    X(ncclGroupStart)                                                                              \
    X(ncclGroupEnd)                                                                                \
    X(ncclAllGather)                                                                               \
    X(ncclReduceScatter)                                                                           \
    X(ncclAllReduce)                                                                               \
    X(ncclBroadcast)                                                                               \
    X(ncclReduce)

#define COLL_CUDA_API_FIELD_(fn) __typeof__(&fn) fn;
typedef struct coll_cuda_api {
    COLL_CUDART_FUNCS(COLL_CUDA_API_FIELD_)
    COLL_NCCL_FUNCS(COLL_CUDA_API_FIELD_)
} coll_cuda_api_t;
#undef COLL_CUDA_API_FIELD_

/* The table. Its CUDA runtime entries are valid once coll_cudart_load returned PSHARD_OK, its
 * NCCL entries once coll_nccl_load did; they never change afterwards (the libraries are never
 * unloaded), so any thread may read them then. */
extern coll_cuda_api_t coll_cu;

/* Loads the CUDA runtime (libcudart.so.<major> of the CUDA that pshard was built with) on the
 * first call and fills the table's CUDA entries; later calls return the first call's outcome.
 * Search: $PSHARD_CUDART_LIBRARY alone when set (a path or name, for tests); else the SONAME
 * through the dynamic linker (LD_LIBRARY_PATH, ld.so.cache), then the directory the build found
 * it in. Errors: PSHARD_ERR_CUDA with err saying which library is missing and which package
 * provides it, or which function an older library lacks. Thread-safe. */
pshard_status_t coll_cudart_load(char *err, size_t errlen);

/* coll_cudart_load, then NCCL (libnccl.so.<major>) the same way ($PSHARD_NCCL_LIBRARY) into
 * the table's NCCL entries. Errors: those of coll_cudart_load, or PSHARD_ERR_NCCL as above.
 * Thread-safe. */
pshard_status_t coll_nccl_load(char *err, size_t errlen);

#endif
