/* One element of each GPU-resident shard operation, shared by the CUDA kernels (shard_cuda.cu,
 * one thread an element) and their host emulation (shard_cuda_emu.c, one loop), so that the
 * emulation that the CPU-only test suite runs is the kernels' own arithmetic. */
#ifndef PSHARD_SHARD_ELEM_H
#define PSHARD_SHARD_ELEM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "optim_elem.h"
#include "pshard/dtype.h"
#include "pshard/dtype_bits.h"

/* Element i of a reduced gradient r in dt (fp32 or bf16), widened to fp32 and, when scaled,
 * multiplied by scale. */
PS_HD static inline float shard_grad_at(const void *r, pshard_dtype_t dt, size_t i, bool scaled,
                                        float scale)
{
    float v = dt == PSHARD_BF16 ? f32_from_bits(bf16_to_f32_bits(((const uint16_t *)r)[i]))
                                : ((const float *)r)[i];
    return scaled ? v * scale : v;
}

/* The bits of |x[i]|: unsigned integers that order like the magnitudes, NaN above infinity (the
 * inf-norm's maximum is taken over them, so a NaN propagates as in torch). */
PS_HD static inline uint32_t shard_abs_bits_at(const float *x, size_t i)
{
    return f32_bits(x[i]) & 0x7fffffffu;
}

/* dst[i] = src[i] in dt (bf16/fp16 rounded to nearest even; fp32 copied). */
PS_HD static inline void shard_convert_at(const float *src, void *dst, pshard_dtype_t dt, size_t i)
{
    uint32_t bits = f32_bits(src[i]);
    if (dt == PSHARD_BF16)
        ((uint16_t *)dst)[i] = f32_to_bf16_bits(bits);
    else if (dt == PSHARD_FP16)
        ((uint16_t *)dst)[i] = f32_to_f16_bits(bits);
    else
        ((float *)dst)[i] = src[i];
}

/* One optimizer step of element i with gradient shard_grad_at(r, ...). */
PS_HD static inline void shard_optim_at(const ps_optim_scalars_t *sc, float *p, const void *r,
                                        pshard_dtype_t dt, bool scaled, float scale, float *s0,
                                        float *s1, size_t i)
{
    float g = shard_grad_at(r, dt, i, scaled, scale);
    if (sc->kind == PS_OPTIM_SGD) {
        float unused = 0.0f;
        ps_sgd_elem(sc, &p[i], g, sc->has_momentum ? &s0[i] : &unused);
    } else {
        ps_adam_elem(sc, &p[i], g, &s0[i], &s1[i]);
    }
}

#endif
