/* A shard server's model state: the layout, and for this rank's pieces of every parameter the
 * fp32 master weights, the fp32 gradient accumulator and the optimizer state, allocated once at
 * definition and reused every step. Not thread-safe: the service runs one trainer operation at
 * a time. */
#ifndef PSHARD_SHARD_MODEL_H
#define PSHARD_SHARD_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "optim.h"
#include "pshard/dtype.h"
#include "pshard/layout.h"
#include "pshard/status.h"

#define SHARD_MAX_PARAMS 100000
#define SHARD_MAX_DIMS 8
#define SHARD_NAME_MAX 255

typedef struct {
    char *name;
    int ndim;
    int64_t shape[SHARD_MAX_DIMS];
    size_t numel;
} shard_param_t;

typedef struct {
    int rank, world;
    ps_layout_t *layout;
    size_t nparams;
    shard_param_t *params;
    size_t shard_numel; /* elements this rank owns */
    float *master, *grad, *state0, *state1; /* device memory when dev is set */
    /* GPU-resident shards (--backend nccl --offload none): the operations on that memory
     * (shard_cuda.h) and the CUDA device; NULL: host memory. */
    const struct shard_dev_ops *dev;
    int device;
    size_t max_piece;   /* largest piece of one parameter on this rank */
    size_t max_numel;   /* largest full parameter */
    void *stage;        /* max_piece fp32-sized elements: conversions, reduce output (on
                           the device too when dev is set) */
    ps_optim_config_t optim;
    double max_grad_norm;
    /* optimizer_in_backward: grad is NULL; each parameter's slice is updated at its
     * reduce-scatter with cur_lr (set by the previous Step), reduced[p] marks the parameters
     * reduced in this step, grad_sq sums their squares for the step's gradient norm. */
    bool in_backward;
    double cur_lr;
    uint8_t *reduced;
    double grad_sq;
    int64_t step;
    uint64_t fingerprint;
    char *spec_text;    /* canonical text of the definition, compared across ranks */
    bool pinned;        /* storage page-locked by shard_model_pin, on pin_device */
    int pin_device;
} shard_model_t;

/* Builds the model from parameter names and shapes (copied). Validates everything a trainer
 * sends (names 1..255 printable bytes, 1..8 positive dims, element counts without overflow, at
 * most SHARD_MAX_PARAMS parameters, unique names, the optimizer config, no clipping with
 * in_backward); errors are
 * INVALID_ARGUMENT with a message naming the parameter. Allocates and pre-touches storage:
 * host memory when dev is NULL, else zeroed memory of dev (shard_cuda.h) on CUDA device
 * `device` (GPU-resident shards; errors then may be CUDA). Free with shard_model_free. */
pshard_status_t shard_model_create(int rank, int world, pshard_layout_t layout, size_t nparams,
                                   const char *const *names, const int64_t *const *shapes,
                                   const size_t *ndims, const ps_optim_config_t *optim,
                                   double max_grad_norm, bool in_backward,
                                   const struct shard_dev_ops *dev, int device, shard_model_t **out,
                                   char *err, size_t errlen);
void shard_model_free(shard_model_t *m);

/* Page-locks the storage (master, accumulator, state, staging buffer) for DMA to a GPU
 * (--backend nccl --offload cpu); shard_model_free unpins it. All or nothing: on failure
 * nothing stays pinned and err says why. */
pshard_status_t shard_model_pin(shard_model_t *m, int device, char *err, size_t errlen);

/* Compares this model's definition text with another rank's and, when they differ, writes a
 * message naming the first differing parameter into err and returns FAILED_PRECONDITION. */
pshard_status_t shard_model_compare(const shard_model_t *m, const char *other_text,
                                    int other_rank, char *err, size_t errlen);

/* Bytes of master + gradient accumulator (none in backward mode) + optimizer state. */
size_t shard_model_state_bytes(const shard_model_t *m);

#endif
