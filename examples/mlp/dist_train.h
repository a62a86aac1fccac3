/* The example MLP trained with pshard: parameters sharded across shard servers, gathered
 * before each forward, gradients reduce-scattered after backward, the optimizer stepped on the
 * shards. Prints the same lines as the --local reference (mlp_local_train) so the two can be
 * compared. */
#ifndef PSHARD_EXAMPLE_DIST_TRAIN_H
#define PSHARD_EXAMPLE_DIST_TRAIN_H

#include <stdbool.h>

#include "local_train.h"
#include "pshard/types.h"

#define MLP_MAX_SKIPS 64

typedef struct {
    mlp_local_args_t common;    /* shape, batch, steps, seeds, optimizer, clipping, printing */
    pshard_dtype_t param_dtype; /* what gathers return */
    pshard_dtype_t reduce_dtype;
    pshard_layout_t layout;
    bool reshard_after_forward; /* FULL_SHARD (true) or SHARD_GRAD_OP */
    int max_gathers_in_flight;
    bool join_enable;           /* --uneven: pshard_join's enable */
    bool join_throw;            /* --uneven: throw_on_early_termination */
    bool optimizer_in_backward; /* updates at the reduce-scatters, no accumulator */
    bool join_mid_step;         /* --uneven: join after the first gather of one more step */
    int64_t fail_at_step;       /* first attempt only: rank fail_rank exits 3 before it */
    int fail_rank;
    int64_t sleep_ms_per_step; /* rank sleep_rank (-1: every rank) sleeps this long per step */
    int sleep_rank;
    bool checkpoint_at_end;      /* pshard_checkpoint_save after the last step */
    int64_t skip[MLP_MAX_SKIPS]; /* steps (1-based) left out: a reference for aborted ones */
    size_t nskip;
    const char *init_from; /* safetensors file with the initial weights, or NULL */
} mlp_dist_args_t;

/* Connects through the environment (RANK, WORLD_SIZE, PSHARD_SERVER; pshardrun sets them),
 * trains, and on rank 0 prints "step N loss X" (X the mean of all ranks' batch losses,
 * all-reduced through pshard), "final checksum Y" and the throughput. Returns 0, 1 on a pshard
 * error (message on stderr), 2 on bad arguments. */
int mlp_dist_train(const mlp_dist_args_t *a);

#endif
