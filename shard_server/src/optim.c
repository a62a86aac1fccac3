/* torch.optim's SGD, Adam and AdamW on fp32 arrays (see optim.h). Each step follows torch's
 * single-tensor CPU code operation by operation, in fp32 with fp32 scalars; the scalars that
 * depend on the step (bias corrections, step size, decoupled decay factor) are computed in
 * double and rounded to fp32 once, as torch does when it passes Python floats to fp32 kernels.
 * Arrays are processed in blocks of OPT_BLOCK elements: every choice (weight decay, first
 * momentum step, nesterov, lerp form) is made once per block, outside the loops, and the loops
 * have a constant trip count over restrict pointers, which is what gcc -O2's "very cheap"
 * vectoriser needs; the remainder (< OPT_BLOCK) runs through the same loops unvectorised. */
#include "pshard/optim.h"

#include "optim_elem.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define OPT_BLOCK 64
/* Independent double accumulators in ps_sum_squares (two AVX registers' worth). */
#define SUMSQ_LANES 8

void ps_optim_defaults(ps_optim_kind_t kind, ps_optim_config_t *cfg)
{
    ps_optim_config_t d = {
        .kind = kind,
        .lr = 1e-3,
        .momentum = 0.0,
        .dampening = 0.0,
        .nesterov = false,
        .weight_decay = kind == PS_OPTIM_ADAMW ? 1e-2 : 0.0,
        .beta1 = 0.9,
        .beta2 = 0.999,
        .eps = 1e-8,
    };
    *cfg = d;
}

/* Writes a message into err (when there is room) and returns -1. */
static int invalid(char *err, size_t errlen, const char *what, double value)
{
    if (err && errlen > 0)
        snprintf(err, errlen, "%s: %g", what, value);
    return -1;
}

int ps_optim_validate(const ps_optim_config_t *cfg, char *err, size_t errlen)
{
    /* Written as !(x >= 0) so that NaN is rejected too, like torch's `not 0.0 <= x`. */
    if (!(cfg->lr >= 0.0))
        return invalid(err, errlen, "Invalid learning rate", cfg->lr);
    if (!(cfg->weight_decay >= 0.0))
        return invalid(err, errlen, "Invalid weight_decay value", cfg->weight_decay);
    switch (cfg->kind) {
    case PS_OPTIM_SGD:
        if (!(cfg->momentum >= 0.0))
            return invalid(err, errlen, "Invalid momentum value", cfg->momentum);
        if (cfg->nesterov && (cfg->momentum <= 0.0 || cfg->dampening != 0.0)) {
            if (err && errlen > 0)
                snprintf(err, errlen, "Nesterov momentum requires a momentum and zero dampening");
            return -1;
        }
        return 0;
    case PS_OPTIM_ADAM:
    case PS_OPTIM_ADAMW:
        if (!(cfg->eps >= 0.0))
            return invalid(err, errlen, "Invalid epsilon value", cfg->eps);
        if (!(cfg->beta1 >= 0.0 && cfg->beta1 < 1.0))
            return invalid(err, errlen, "Invalid beta parameter at index 0", cfg->beta1);
        if (!(cfg->beta2 >= 0.0 && cfg->beta2 < 1.0))
            return invalid(err, errlen, "Invalid beta parameter at index 1", cfg->beta2);
        return 0;
    }
    if (err && errlen > 0)
        snprintf(err, errlen, "Unknown optimizer kind %d", (int)cfg->kind);
    return -1;
}

int ps_optim_state_count(const ps_optim_config_t *cfg)
{
    if (cfg->kind == PS_OPTIM_SGD)
        return cfg->momentum != 0.0 ? 1 : 0;
    return 2;
}

/* ---- element loops: each is branch-free; callers pass len == OPT_BLOCK (vectorised after
 * inlining) or the remainder ---- */

/* d = g + wd * p (torch: grad.add(param, alpha=weight_decay)). */
static inline void add_weight_decay(float *restrict d, const float *restrict g,
                                    const float *restrict p, float wd, size_t len)
{
    for (size_t i = 0; i < len; i++)
        d[i] = g[i] + wd * p[i];
}

/* p = p + alpha * d (torch: param.add_(d, alpha=-lr)). */
static inline void axpy(float *restrict p, const float *restrict d, float alpha, size_t len)
{
    for (size_t i = 0; i < len; i++)
        p[i] = p[i] + alpha * d[i];
}

/* buf = d (torch: the first step clones the gradient into the momentum buffer). */
static inline void copy_buf(float *restrict buf, const float *restrict d, size_t len)
{
    for (size_t i = 0; i < len; i++)
        buf[i] = d[i];
}

/* buf = buf * momentum + (1 - dampening) * d (torch: buf.mul_(momentum).add_(d, alpha=...)). */
static inline void momentum_update(float *restrict buf, const float *restrict d, float momentum,
                                   float one_minus_dampening, size_t len)
{
    for (size_t i = 0; i < len; i++)
        buf[i] = buf[i] * momentum + one_minus_dampening * d[i];
}

/* p = p + alpha * (d + momentum * buf) (torch: d.add(buf, alpha=momentum), then the update). */
static inline void nesterov_update(float *restrict p, const float *restrict d,
                                   const float *restrict buf, float momentum, float alpha,
                                   size_t len)
{
    for (size_t i = 0; i < len; i++)
        p[i] = p[i] + alpha * (d[i] + momentum * buf[i]);
}

/* p = p * factor (torch AdamW: param.mul_(1 - lr * weight_decay)). */
static inline void scale_loop(float *restrict p, float factor, size_t len)
{
    for (size_t i = 0; i < len; i++)
        p[i] = p[i] * factor;
}

/* m = lerp(m, d, w) for |w| < 0.5 and for |w| >= 0.5, in torch's two forms. */
static inline void lerp_small(float *restrict m, const float *restrict d, float w, size_t len)
{
    for (size_t i = 0; i < len; i++)
        m[i] = m[i] + w * (d[i] - m[i]);
}

static inline void lerp_large(float *restrict m, const float *restrict d, float w, size_t len)
{
    float one_minus_w = 1.0f - w;
    for (size_t i = 0; i < len; i++)
        m[i] = d[i] - (d[i] - m[i]) * one_minus_w;
}

/* v = v * beta2 + (1 - beta2) * d * d, then
 * p = p + (-step_size) * m / (sqrt(v) / sqrt(bias_correction2) + eps)
 * (torch: exp_avg_sq.mul_(beta2).addcmul_(d, d, value=1-beta2); denom = (exp_avg_sq.sqrt() /
 * bias_correction2_sqrt).add_(eps); param.addcdiv_(exp_avg, denom, value=-step_size)). */
static inline void adam_update(float *restrict p, const float *restrict d, const float *restrict m,
                               float *restrict v, float beta2, float one_minus_beta2,
                               float bc2_sqrt, float eps, float neg_step_size, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        float vi = v[i] * beta2 + one_minus_beta2 * d[i] * d[i];
        v[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = p[i] + neg_step_size * m[i] / denom;
    }
}

/* ---- one block ---- */

typedef ps_optim_scalars_t step_scalars_t;

static inline void sgd_block(const step_scalars_t *s, float *restrict p, const float *restrict g,
                             float *restrict buf, size_t len)
{
    float scratch[OPT_BLOCK];
    const float *d = g;
    if (s->weight_decay != 0.0f) {
        add_weight_decay(scratch, g, p, s->weight_decay, len);
        d = scratch;
    }
    if (!buf) {
        axpy(p, d, s->neg_lr, len);
        return;
    }
    if (s->first_step)
        copy_buf(buf, d, len);
    else
        momentum_update(buf, d, s->momentum, s->one_minus_dampening, len);
    if (s->nesterov)
        nesterov_update(p, d, buf, s->momentum, s->neg_lr, len);
    else
        axpy(p, buf, s->neg_lr, len);
}

static inline void adam_block(const step_scalars_t *s, bool decoupled, float *restrict p,
                              const float *restrict g, float *restrict m, float *restrict v,
                              size_t len)
{
    float scratch[OPT_BLOCK];
    const float *d = g;
    if (decoupled) {
        if (s->weight_decay != 0.0f)
            scale_loop(p, s->decay_factor, len);
    } else if (s->weight_decay != 0.0f) {
        add_weight_decay(scratch, g, p, s->weight_decay, len);
        d = scratch;
    }
    if (fabsf(s->lerp_weight) < 0.5f)
        lerp_small(m, d, s->lerp_weight, len);
    else
        lerp_large(m, d, s->lerp_weight, len);
    adam_update(p, d, m, v, s->beta2, s->one_minus_beta2, s->bc2_sqrt, s->eps, s->neg_step_size,
                len);
}

void ps_optim_step_scalars(const ps_optim_config_t *cfg, double lr, int64_t step,
                           ps_optim_scalars_t *s)
{
    memset(s, 0, sizeof(*s));
    s->kind = cfg->kind;
    s->weight_decay = (float)cfg->weight_decay;
    if (cfg->kind == PS_OPTIM_SGD) {
        s->has_momentum = cfg->momentum != 0.0;
        s->neg_lr = (float)-lr;
        s->momentum = (float)cfg->momentum;
        s->one_minus_dampening = (float)(1.0 - cfg->dampening);
        s->first_step = step == 1;
        s->nesterov = cfg->nesterov;
        return;
    }
    double bias_correction1 = 1.0 - pow(cfg->beta1, (double)step);
    double bias_correction2 = 1.0 - pow(cfg->beta2, (double)step);
    s->decay_factor = (float)(1.0 - lr * cfg->weight_decay);
    s->lerp_weight = (float)(1.0 - cfg->beta1);
    s->beta2 = (float)cfg->beta2;
    s->one_minus_beta2 = (float)(1.0 - cfg->beta2);
    s->bc2_sqrt = (float)sqrt(bias_correction2);
    s->eps = (float)cfg->eps;
    s->neg_step_size = (float)-(lr / bias_correction1);
}

void ps_optim_step(const ps_optim_config_t *cfg, double lr, int64_t step, float *param,
                   const float *grad, float *state0, float *state1, size_t n)
{
    assert(step >= 1);
    step_scalars_t s;
    ps_optim_step_scalars(cfg, lr, step, &s);
    size_t full = n - n % OPT_BLOCK;

    if (cfg->kind == PS_OPTIM_SGD) {
        float *buf = s.has_momentum ? state0 : NULL;
        assert(!s.has_momentum || state0);
        for (size_t i = 0; i < full; i += OPT_BLOCK)
            sgd_block(&s, param + i, grad + i, buf ? buf + i : NULL, OPT_BLOCK);
        if (full < n)
            sgd_block(&s, param + full, grad + full, buf ? buf + full : NULL, n - full);
        return;
    }

    assert(state0 && state1);
    bool decoupled = cfg->kind == PS_OPTIM_ADAMW;
    for (size_t i = 0; i < full; i += OPT_BLOCK)
        adam_block(&s, decoupled, param + i, grad + i, state0 + i, state1 + i, OPT_BLOCK);
    if (full < n)
        adam_block(&s, decoupled, param + full, grad + full, state0 + full, state1 + full,
                   n - full);
}

double ps_sum_squares(const float *x, size_t n)
{
    /* SUMSQ_LANES independent sums (each in order), so the loop vectorises without reordering
     * any single sum; they are added at the end. */
    double acc[SUMSQ_LANES] = {0};
    size_t full = n - n % SUMSQ_LANES;
    for (size_t i = 0; i < full; i += SUMSQ_LANES)
        for (size_t j = 0; j < SUMSQ_LANES; j++)
            acc[j] += (double)x[i + j] * (double)x[i + j];
    double total = 0.0;
    for (size_t i = full; i < n; i++)
        total += (double)x[i] * (double)x[i];
    for (size_t j = 0; j < SUMSQ_LANES; j++)
        total += acc[j];
    return total;
}

float ps_max_abs(const float *x, size_t n)
{
    uint32_t top = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], sizeof(bits));
        bits &= 0x7fffffffu;
        if (bits > top)
            top = bits;
    }
    float out;
    memcpy(&out, &top, sizeof(out));
    return out;
}

void ps_scale(float *x, size_t n, float scale)
{
    size_t full = n - n % OPT_BLOCK;
    for (size_t i = 0; i < full; i += OPT_BLOCK)
        scale_loop(x + i, scale, OPT_BLOCK);
    if (full < n)
        scale_loop(x + full, scale, n - full);
}
