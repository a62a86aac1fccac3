/* The optimizers of optim.h one element at a time, for the shard server's CUDA kernels
 * (shard_cuda.cu, one thread an element) and for the CPU test that checks them against
 * ps_optim_step bit for bit. The step's scalars come from ps_optim_step_scalars, computed once on
 * the host exactly as ps_optim_step computes them; each element function follows the same
 * fp32 operations in the same order as optim.c's block loops (compile CUDA with -fmad=false,
 * so that no multiply-add is fused where the CPU rounds twice). */
#ifndef PSHARD_OPTIM_ELEM_H
#define PSHARD_OPTIM_ELEM_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "pshard/optim.h"

#ifdef __CUDACC__
#define PS_OPT_HD __host__ __device__
#else
#define PS_OPT_HD
#endif

/* One step's scalars (see ps_optim_step_scalars). */
typedef struct ps_optim_scalars {
    ps_optim_kind_t kind;
    bool has_momentum;         /* SGD: a momentum buffer (state0) exists */
    float neg_lr;              /* SGD: -lr */
    float weight_decay;        /* L2 term added to the gradient (0: skipped) */
    float momentum;            /* SGD */
    float one_minus_dampening; /* SGD */
    bool first_step;           /* SGD: initialise the momentum buffer */
    bool nesterov;             /* SGD */
    float decay_factor;        /* AdamW: 1 - lr * weight_decay */
    float lerp_weight;         /* Adam(W): 1 - beta1 */
    float beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size; /* Adam(W) */
} ps_optim_scalars_t;

/* One element of SGD: p is the weight, g its gradient, buf its momentum buffer (unused without
 * momentum). */
PS_OPT_HD static inline void ps_sgd_elem(const ps_optim_scalars_t *s, float *p, float g, float *buf)
{
    float d = g;
    if (s->weight_decay != 0.0f)
        d = g + s->weight_decay * *p;
    if (!s->has_momentum) {
        *p = *p + s->neg_lr * d;
        return;
    }
    if (s->first_step)
        *buf = d;
    else
        *buf = *buf * s->momentum + s->one_minus_dampening * d;
    if (s->nesterov)
        *p = *p + s->neg_lr * (d + s->momentum * *buf);
    else
        *p = *p + s->neg_lr * *buf;
}

/* One element of Adam / AdamW: m and v are exp_avg and exp_avg_sq. */
PS_OPT_HD static inline void ps_adam_elem(const ps_optim_scalars_t *s, float *p, float g, float *m,
                                          float *v)
{
    float d = g;
    if (s->kind == PS_OPTIM_ADAMW) {
        if (s->weight_decay != 0.0f)
            *p = *p * s->decay_factor;
    } else if (s->weight_decay != 0.0f) {
        d = g + s->weight_decay * *p;
    }
    if (fabsf(s->lerp_weight) < 0.5f)
        *m = *m + s->lerp_weight * (d - *m);
    else
        *m = d - (d - *m) * (1.0f - s->lerp_weight);
    float vi = *v * s->beta2 + s->one_minus_beta2 * d * d;
    *v = vi;
    float denom = sqrtf(vi) / s->bc2_sqrt + s->eps;
    *p = *p + s->neg_step_size * *m / denom;
}

#endif
