/* GPU-resident shard state (pshard-server --backend nccl --offload none): device memory and the
 * kernels the shard server runs on its slices: conversions to the gather dtype, gradient
 * accumulation, squared norms, clipping and the optimizers (optim_elem.h, the same fp32
 * operations as the CPU's optim.c). Every call makes `device` current for the calling thread,
 * runs on one stream of this process and returns once the work is complete on the device (the
 * nccl backend wants complete inputs). Errors: PSHARD_ERR_CUDA with what failed in err;
 * PSHARD_ERR_UNIMPLEMENTED when pshard was built without nvcc (shard_cuda_available() false).
 * Calls are serialised by the caller (the shard server's op_mu). */
#ifndef PSHARD_SHARD_CUDA_H
#define PSHARD_SHARD_CUDA_H

#include <stdbool.h>
#include <stddef.h>

#include "optim_elem.h"
#include "pshard/dtype.h"
#include "pshard/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* True when this build has the kernels (nvcc was found). */
bool shard_cuda_available(void);

/* bytes of zeroed device memory; free with shard_cuda_free (NULL is a no-op). */
pshard_status_t shard_cuda_alloc(int device, size_t bytes, void **out, char *err, size_t errlen);
void shard_cuda_free(int device, void *p);

/* Copies bytes between host and device memory in either direction (unified addressing). */
pshard_status_t shard_cuda_copy(int device, void *dst, const void *src, size_t bytes, char *err,
                                size_t errlen);

/* Sets n floats to zero. */
pshard_status_t shard_cuda_zero(int device, float *x, size_t n, char *err, size_t errlen);

/* dst[i] = src[i] rounded to dt (bf16 or fp16; fp32 copies), as ps_convert_f32_to_*. */
pshard_status_t shard_cuda_convert(int device, const float *src, void *dst, pshard_dtype_t dt,
                                   size_t n, char *err, size_t errlen);

/* The value of element i of a reduced gradient r in dt (fp32 or bf16), widened to fp32 and,
 * when scaled, multiplied by scale: below, "g(i)". */

/* acc[i] += g(i). */
pshard_status_t shard_cuda_accumulate(int device, float *acc, const void *r, pshard_dtype_t dt,
                                      size_t n, bool scaled, float scale, char *err, size_t errlen);

/* *out = sum of g(i)^2 in double. */
pshard_status_t shard_cuda_sum_squares(int device, const void *r, pshard_dtype_t dt, size_t n,
                                       bool scaled, float scale, double *out, char *err,
                                       size_t errlen);

/* x[i] *= factor (clipping). */
pshard_status_t shard_cuda_scale(int device, float *x, size_t n, float factor, char *err,
                                 size_t errlen);

/* One optimizer step on n elements with gradient g(i): SGD (state0 the momentum buffer, NULL
 * without momentum) or Adam/AdamW (state0, state1), with the step's scalars sc. */
pshard_status_t shard_cuda_optim_step(int device, const ps_optim_scalars_t *sc, float *param,
                                      const void *r, pshard_dtype_t dt, bool scaled, float scale,
                                      float *state0, float *state1, size_t n, char *err,
                                      size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
