/* shard_cuda.h for builds without nvcc: every call says GPU-resident shards are not built. */
#include "shard_cuda.h"

#include "pshard/util.h"

bool shard_cuda_available(void)
{
    return false;
}

static pshard_status_t not_built(char *err, size_t errlen)
{
    return ps_errf(err, errlen, PSHARD_ERR_UNIMPLEMENTED,
                   "GPU-resident shards: this pshard was built without nvcc (CUDA kernels)");
}

pshard_status_t shard_cuda_alloc(int device, size_t bytes, void **out, char *err, size_t errlen)
{
    *out = NULL;
    return not_built(err, errlen);
}

void shard_cuda_free(int device, void *p) {}

pshard_status_t shard_cuda_copy(int device, void *dst, const void *src, size_t bytes, char *err,
                                size_t errlen)
{
    return not_built(err, errlen);
}

pshard_status_t shard_cuda_zero(int device, float *x, size_t n, char *err, size_t errlen)
{
    return not_built(err, errlen);
}

pshard_status_t shard_cuda_convert(int device, const float *src, void *dst, pshard_dtype_t dt,
                                   size_t n, char *err, size_t errlen)
{
    return not_built(err, errlen);
}

pshard_status_t shard_cuda_accumulate(int device, float *acc, const void *r, pshard_dtype_t dt,
                                      size_t n, bool scaled, float scale, char *err, size_t errlen)
{
    return not_built(err, errlen);
}

pshard_status_t shard_cuda_sum_squares(int device, const void *r, pshard_dtype_t dt, size_t n,
                                       bool scaled, float scale, double *out, char *err,
                                       size_t errlen)
{
    *out = 0.0;
    return not_built(err, errlen);
}

pshard_status_t shard_cuda_scale(int device, float *x, size_t n, float factor, char *err,
                                 size_t errlen)
{
    return not_built(err, errlen);
}

pshard_status_t shard_cuda_optim_step(int device, const ps_optim_scalars_t *sc, float *param,
                                      const void *r, pshard_dtype_t dt, bool scaled, float scale,
                                      float *state0, float *state1, size_t n, char *err,
                                      size_t errlen)
{
    return not_built(err, errlen);
}
