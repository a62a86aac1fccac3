/* shard_dev_emulated (shard_cuda.h): the GPU-resident shard operations on host memory standing
 * in for device memory, one loop over shard_elem.h's element functions per operation, exactly
 * what each CUDA kernel's threads compute. For the CPU-only test suite: with it the shard
 * server's GPU-resident code paths (device accumulator and optimizer, checkpoints through the
 * bounce buffer, initial values copied in) run and are compared with the host path. */
#include <stdlib.h>
#include <string.h>

#include "pshard/util.h"
#include "shard_cuda.h"
#include "shard_elem.h"

static pshard_status_t emu_alloc(int device, size_t bytes, void **out, char *err, size_t errlen)
{
    *out = calloc(1, bytes ? bytes : 16);
    if (!*out)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY,
                       "emulated device %d: cannot allocate %zu bytes", device, bytes);
    return PSHARD_OK;
}

static void emu_free(int device, void *p)
{
    free(p);
}

static pshard_status_t emu_copy(int device, void *dst, const void *src, size_t bytes, char *err,
                                size_t errlen)
{
    if (bytes)
        memmove(dst, src, bytes);
    return PSHARD_OK;
}

static pshard_status_t emu_zero(int device, float *x, size_t n, char *err, size_t errlen)
{
    memset(x, 0, n * sizeof(float));
    return PSHARD_OK;
}

static pshard_status_t emu_convert(int device, const float *src, void *dst, pshard_dtype_t dt,
                                   size_t n, char *err, size_t errlen)
{
    for (size_t i = 0; i < n; i++)
        shard_convert_at(src, dst, dt, i);
    return PSHARD_OK;
}

static pshard_status_t emu_accumulate(int device, float *acc, const void *r, pshard_dtype_t dt,
                                      size_t n, bool scaled, float scale, char *err, size_t errlen)
{
    for (size_t i = 0; i < n; i++)
        acc[i] += shard_grad_at(r, dt, i, scaled, scale);
    return PSHARD_OK;
}

static pshard_status_t emu_sum_squares(int device, const void *r, pshard_dtype_t dt, size_t n,
                                       bool scaled, float scale, double *out, char *err,
                                       size_t errlen)
{
    double acc = 0.0;
    for (size_t i = 0; i < n; i++) {
        double v = (double)shard_grad_at(r, dt, i, scaled, scale);
        acc += v * v;
    }
    *out = acc;
    return PSHARD_OK;
}

static pshard_status_t emu_scale(int device, float *x, size_t n, float factor, char *err,
                                 size_t errlen)
{
    for (size_t i = 0; i < n; i++)
        x[i] = x[i] * factor;
    return PSHARD_OK;
}

static pshard_status_t emu_optim_step(int device, const ps_optim_scalars_t *sc, float *param,
                                      const void *r, pshard_dtype_t dt, bool scaled, float scale,
                                      float *state0, float *state1, size_t n, char *err,
                                      size_t errlen)
{
    for (size_t i = 0; i < n; i++)
        shard_optim_at(sc, param, r, dt, scaled, scale, state0, state1, i);
    return PSHARD_OK;
}

static pshard_status_t emu_max_abs(int device, const float *x, size_t n, float *out, char *err,
                                   size_t errlen)
{
    uint32_t top = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t bits = shard_abs_bits_at(x, i);
        top = bits > top ? bits : top;
    }
    *out = f32_from_bits(top);
    return PSHARD_OK;
}

/* Shared "device" memory: a shared-memory object (shard_shm.h's, swept when a server dies), its
 * name the handle the trainer opens, as a CUDA IPC handle stands for a cudaMalloc. */
static pshard_status_t emu_alloc_shared(int device, size_t bytes, shard_dev_shared_t *out,
                                        char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    char why[PSHARD_ERRLEN] = "";
    if (shard_shm_create(bytes, (size_t)-1, &out->shm, why, sizeof(why)) != PSHARD_OK)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY,
                       "emulated device %d: cannot allocate %zu shared bytes: %s", device, bytes,
                       why);
    out->ptr = out->shm.base;
    out->bytes = bytes;
    out->handle_len = strlen(out->shm.name);
    memcpy(out->handle, out->shm.name, out->handle_len);
    return PSHARD_OK;
}

static void emu_free_shared(int device, shard_dev_shared_t *s)
{
    (void)device;
    shard_shm_destroy(&s->shm);
    memset(s, 0, sizeof(*s));
}

const shard_dev_ops_t shard_dev_emulated = {
    .name = "emulated",
    .host_memory = true,
    .alloc = emu_alloc,
    .free_mem = emu_free,
    .copy = emu_copy,
    .zero = emu_zero,
    .convert = emu_convert,
    .accumulate = emu_accumulate,
    .sum_squares = emu_sum_squares,
    .scale = emu_scale,
    .optim_step = emu_optim_step,
    .max_abs = emu_max_abs,
    .alloc_shared = emu_alloc_shared,
    .free_shared = emu_free_shared,
};
