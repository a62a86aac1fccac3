/* The single-process reference trainer: trains the example MLP on the union of `world` ranks'
 * batches exactly as the distributed trainer should (gradients averaged over the ranks that
 * still have data, optional global-norm clipping, the shard server's optimizer kernels), so the
 * two can be compared line by line. */
#ifndef PSHARD_EXAMPLE_LOCAL_TRAIN_H
#define PSHARD_EXAMPLE_LOCAL_TRAIN_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "mlp.h"
#include "pshard/optim.h"

typedef struct {
    mlp_shape_t shape;       /* the model (mlp_parse_widths) */
    int batch;               /* rows per rank per step, >= 1 */
    int64_t steps;           /* batches per rank (rank r has steps + r with uneven), >= 0 */
    int world;               /* ranks whose batches are combined each step, >= 1 */
    bool uneven;             /* rank r has steps + r batches instead of steps */
    uint64_t seed;           /* student init (mlp_init_params) */
    uint64_t data_seed;      /* inputs (mlp_task_batch) */
    uint64_t task_seed;      /* teacher (mlp_task_create) */
    ps_optim_config_t optim; /* optimizer; its lr is used for every step */
    double max_grad_norm;    /* clip_grad_norm_ max_norm; 0 = no clipping */
    int64_t print_every;     /* print steps 1, N, 2N, ... and the last; 0 = none */
    FILE *out;               /* where the lines go; NULL = stdout */
    /* Optional results for tests; NULL to skip. */
    double *losses;           /* [steps + (uneven ? world - 1 : 0)] per-step mean loss */
    float *const *params_out; /* [mlp_num_params] arrays receiving the final parameters */
    const char *dump_weights; /* file receiving the final parameters as raw little-endian fp32,
                                 in definition order; NULL = none */
} mlp_local_args_t;

/* Trains as described above and prints "step N loss X" (N from 1; X with "%.9g", the mean of
 * the contributing ranks' batch losses before that step's update) for the first step, every
 * print_every-th step and the last one, then "final checksum Y" (the sum of all final
 * parameters in double, "%.17g"). The schedule runs steps + (uneven ? world - 1 : 0) steps; at
 * step s (from 0) rank r contributes batch s when s < steps + (uneven ? r : 0). Allocates
 * everything once before the first step. Returns 0 on success, 2 for invalid arguments and 1
 * when memory ran out (both with a message on stderr). Reentrant; a->out is not locked. */
int mlp_local_train(const mlp_local_args_t *a);

#endif
