/* GPU-resident shard state (pshard-server --backend nccl --offload none): the operations the
 * shard server runs on its slices in device memory (conversions to the gather dtype, gradient
 * accumulation, squared norms, clipping, the optimizers), as a table with two implementations:
 *  - shard_dev_cuda(): CUDA kernels (shard_cuda.cu, built when nvcc is found, as the module
 *    libpshard_cuda_kernels.so that is opened on first use; NULL otherwise). Each call makes
 *    `device` current for the calling thread, runs on one stream of this process and returns
 *    once the work is complete on the device (the nccl backend wants complete inputs).
 *    Errors: PSHARD_ERR_CUDA with what failed in err.
 *  - shard_dev_emulated: the same operations on host memory standing in for the device
 *    (shard_cuda_emu.c), so the CPU-only test suite runs the shard server's GPU-resident code
 *    paths (PSHARD_TEST_EMULATE_DEVICE=1 with --backend tcp --offload none).
 * Both compute each element with shard_elem.h, the CPU optimizer's and conversions' own
 * element functions. Calls are serialised by the caller (the shard server's op_mu). */
#ifndef PSHARD_SHARD_CUDA_H
#define PSHARD_SHARD_CUDA_H

#include <stdbool.h>
#include <stddef.h>

#include "optim_elem.h"
#include "pshard/dtype.h"
#include "pshard/status.h"
#include "shard_shm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Device memory that another process on this host may open (the shard a trainer maps as its
 * DTensor shards): a CUDA IPC handle (cudaIpcGetMemHandle, 64 bytes) of one cudaMalloc
 * allocation, or for the emulated device the name of the shared-memory object standing in for
 * it. The trainer opens it with pshard's client (client_device.c), which must close it before
 * the server frees it (the server frees it when the model is redefined or it shuts down; a
 * trainer redefines or closes first). */
#define SHARD_DEV_HANDLE_MAX 64
typedef struct shard_dev_shared {
    void *ptr; /* device pointer (emulated: host pointer into shm) */
    size_t bytes;
    unsigned char handle[SHARD_DEV_HANDLE_MAX];
    size_t handle_len;
    shard_shm_t shm; /* emulated only: the object behind ptr */
} shard_dev_shared_t;

/* Below, "g(i)" is element i of a reduced gradient r in dt (fp32 or bf16), widened to fp32
 * and, when scaled, multiplied by scale. */
typedef struct shard_dev_ops {
    const char *name; /* "cuda" or "emulated" */
    /* Its "device" memory is host memory (emulated). That only names it (status) and keeps the
     * checkpoint's bounce buffer small; everything else, the collectives included, treats it
     * as device memory, so the emulation runs the paths a GPU runs (on tcp: staged through
     * host copies, shard_exec.c). */
    bool host_memory;
    /* bytes of zeroed device memory; free with free_mem (NULL is a no-op). */
    pshard_status_t (*alloc)(int device, size_t bytes, void **out, char *err, size_t errlen);
    void (*free_mem)(int device, void *p);
    /* Copies bytes between host and device memory in either direction. */
    pshard_status_t (*copy)(int device, void *dst, const void *src, size_t bytes, char *err,
                            size_t errlen);
    /* Sets n floats to zero. */
    pshard_status_t (*zero)(int device, float *x, size_t n, char *err, size_t errlen);
    /* dst[i] = src[i] rounded to dt (bf16 or fp16; fp32 copies), as ps_convert_f32_to_*. */
    pshard_status_t (*convert)(int device, const float *src, void *dst, pshard_dtype_t dt, size_t n,
                               char *err, size_t errlen);
    /* acc[i] += g(i). */
    pshard_status_t (*accumulate)(int device, float *acc, const void *r, pshard_dtype_t dt,
                                  size_t n, bool scaled, float scale, char *err, size_t errlen);
    /* *out = sum of g(i)^2 in double. */
    pshard_status_t (*sum_squares)(int device, const void *r, pshard_dtype_t dt, size_t n,
                                   bool scaled, float scale, double *out, char *err, size_t errlen);
    /* x[i] *= factor (clipping). */
    pshard_status_t (*scale)(int device, float *x, size_t n, float factor, char *err,
                             size_t errlen);
    /* One optimizer step on n elements with gradient g(i): SGD (state0 the momentum buffer,
     * NULL without momentum) or Adam/AdamW (state0, state1), with the step's scalars sc. */
    pshard_status_t (*optim_step)(int device, const ps_optim_scalars_t *sc, float *param,
                                  const void *r, pshard_dtype_t dt, bool scaled, float scale,
                                  float *state0, float *state1, size_t n, char *err, size_t errlen);
    /* *out = the largest |x[i]| (0 for n == 0; NaN when any is NaN), as ps_max_abs: the
     * inf-norm of clip_grad_norm. */
    pshard_status_t (*max_abs)(int device, const float *x, size_t n, float *out, char *err,
                               size_t errlen);
    /* bytes (> 0) of zeroed device memory another process on this host can open through
     * out->handle; free with free_shared (an empty one is a no-op). On error *out is empty. */
    pshard_status_t (*alloc_shared)(int device, size_t bytes, shard_dev_shared_t *out, char *err,
                                    size_t errlen);
    void (*free_shared)(int device, shard_dev_shared_t *s);
} shard_dev_ops_t;

/* The CUDA kernels: on the first call, opens libpshard_cuda_kernels.so ($PSHARD_CUDA_KERNELS
 * when set; else beside the executable, then in ../lib from it) and keeps it loaded. NULL with
 * the reason in err when pshard was built without nvcc or the module cannot be loaded; later
 * calls return the first call's outcome. Thread-safe. */
const shard_dev_ops_t *shard_dev_cuda(char *err, size_t errlen);

extern const shard_dev_ops_t shard_dev_emulated;

#ifdef __cplusplus
}
#endif
#endif
