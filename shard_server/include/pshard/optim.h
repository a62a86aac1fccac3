/* Optimizers applied by a shard server to its slice of each parameter, with the formulas and
 * defaults of torch.optim (SGD with momentum/dampening/nesterov/weight decay, Adam with L2
 * weight decay, AdamW with decoupled weight decay), on fp32 master weights and fp32 state.
 * Pure functions over arrays: thread-safe, no allocation. */
#ifndef PSHARD_OPTIM_H
#define PSHARD_OPTIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    PS_OPTIM_SGD = 0,
    PS_OPTIM_ADAM = 1,
    PS_OPTIM_ADAMW = 2,
} ps_optim_kind_t;

typedef struct {
    ps_optim_kind_t kind;
    double lr;           /* default: SGD 1e-3 (torch has no default; we pick 1e-3), Adam(W) 1e-3 */
    double momentum;     /* SGD, default 0 */
    double dampening;    /* SGD, default 0 */
    bool nesterov;       /* SGD, default false (needs momentum > 0 and dampening == 0) */
    double weight_decay; /* SGD/Adam default 0, AdamW default 1e-2 */
    double beta1, beta2; /* Adam(W), default 0.9, 0.999 */
    double eps;          /* Adam(W), default 1e-8 */
} ps_optim_config_t;

/* Fills torch's defaults for kind. */
void ps_optim_defaults(ps_optim_kind_t kind, ps_optim_config_t *cfg);

/* Checks a config the way torch does (lr >= 0, momentum >= 0, 0 <= beta < 1, eps >= 0,
 * weight_decay >= 0, nesterov requires momentum > 0 and dampening == 0). Returns 0, or -1 with
 * a message in err. */
int ps_optim_validate(const ps_optim_config_t *cfg, char *err, size_t errlen);

/* Number of fp32 state arrays per element: SGD 1 when momentum != 0 else 0; Adam(W) 2. */
int ps_optim_state_count(const ps_optim_config_t *cfg);

/* One optimizer step over n elements. step is the 1-based step count after this update (Adam
 * bias correction; SGD uses step == 1 to initialise the momentum buffer with the gradient, as
 * torch does on the first step). lr overrides cfg->lr (per-step schedules). state0/state1 are
 * the state arrays (NULL when the kind needs fewer), zero-initialised before the first step. */
void ps_optim_step(const ps_optim_config_t *cfg, double lr, int64_t step, float *param,
                   const float *grad, float *state0, float *state1, size_t n);

/* The scalars of one step (lr overriding cfg->lr, step 1-based), as ps_optim_step computes
 * them: for the element functions of optim_elem.h. */
struct ps_optim_scalars;
void ps_optim_step_scalars(const ps_optim_config_t *cfg, double lr, int64_t step,
                           struct ps_optim_scalars *out);

/* Sum of squares of n fp32 values, accumulated in double (for clip_grad_norm). */
double ps_sum_squares(const float *x, size_t n);

/* The largest |x[i]| of n fp32 values (0 for n == 0), NaN when any is NaN, as torch's
 * abs().max() (for clip_grad_norm with norm_type inf). Compared as the bits of |x[i]|, which
 * order like the values and put NaN above infinity; the CUDA kernel does the same. */
float ps_max_abs(const float *x, size_t n);

/* x[i] *= scale. */
void ps_scale(float *x, size_t n, float scale);

#endif
