/* A shard server's model state: the layout, and for this rank's pieces of every parameter the
 * fp32 master weights, the fp32 gradient accumulator and the optimizer state, allocated once at
 * definition and reused every step. Not thread-safe: the service runs one trainer operation at
 * a time. */
#ifndef PSHARD_SHARD_MODEL_H
#define PSHARD_SHARD_MODEL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "pshard/optim.h"
#include "pshard/dtype.h"
#include "pshard/layout.h"
#include "pshard/status.h"
#include "shard_cuda.h"
#include "shard_shm.h"

#define SHARD_MAX_PARAMS 100000
/* A step's skip mask: a bit per parameter, in 64-bit words. */
#define SHARD_MAX_SKIP_WORDS ((SHARD_MAX_PARAMS + 63) / 64)
#define SHARD_MAX_DIMS 8
#define SHARD_NAME_MAX 255
#define SHARD_MAX_GROUPS 1024
#define SHARD_GROUP_WORDS 9 /* int64 words of one group in an agreement (shard_groups_encode) */

typedef struct {
    char *name;
    int ndim;
    int64_t shape[SHARD_MAX_DIMS];
    size_t numel;
} shard_param_t;

/* One parameter group, torch.optim's param_groups entry: the hyperparameters of its parameters
 * (cfg.kind is the model's) and whether they are frozen (requires_grad=False: gathered, never
 * reduce-scattered, stepped or counted in a gradient norm). */
typedef struct {
    ps_optim_config_t cfg;
    bool frozen;
} shard_group_t;

/* A run of this rank's shard, elements [off, off + n): the pieces of consecutive parameters
 * (shard_model_next_run). */
typedef struct {
    size_t off, n;
    uint32_t group; /* the group of the run's first parameter */
} shard_run_t;

typedef struct {
    int rank, world; /* this rank's place among the ranks the parameters are sharded over */
    /* HSDP (a replicate x shard mesh): shard_comm joins the `world` shard ranks of this replica
     * (gathers, reduce-scatters, norms, checkpoints), replicate_comm the ranks of this shard
     * index in each of the `replicas` replicas (the gradients' all-reduce). NULL (replicas 1):
     * no mesh, the world's communicator does it all. Owned: shard_model_free destroys them. */
    struct pshard_comm *shard_comm, *replicate_comm;
    int replicas;
    uint64_t mesh_attempt; /* the definition attempt their names carry (shard_mesh_connect) */
    ps_layout_t *layout;
    size_t nparams;
    shard_param_t *params;
    size_t shard_numel;                     /* elements this rank owns */
    float *master, *grad, *state0, *state1; /* device memory when dev is set */
    /* Host shards shared with the trainer: master (at shm_master_off), grad (at
     * shm_grad_off) and the optimizer state (state0 at shm_state0_off, state1 at
     * shm_state1_off; an offset is 0 where the array does not exist) inside one shared-memory
     * object the trainer maps (pshard_shard_view). shm.name is "" when they are private memory
     * instead, and shared_reason then says why (GPU-resident shards, a remote trainer,
     * /dev/shm full). */
    shard_shm_t shm;
    size_t shm_master_off, shm_grad_off, shm_state0_off, shm_state1_off, shm_steps_off;
    char shared_reason[PSHARD_ERRLEN];
    /* GPU-resident shards shared with the trainer: master, grad and the state in one device
     * allocation the trainer opens by its handle, at the shm_*_off offsets (relative to it);
     * shm then holds only the per-parameter step counts (at shm_steps_off). Empty (bytes 0)
     * when the device shards are private. */
    shard_dev_shared_t dev_shared;
    /* The trainer's model region in device memory (DefineModelRequest.device_region_bytes):
     * the full buffers its gathers write and its reduce-scatters read, shared with the trainer
     * by its handle. Empty (bytes 0): the region is the trainer's shared memory. */
    shard_dev_shared_t region_dev;
    /* GPU-resident shards (--backend nccl --offload none): the operations on that memory
     * (shard_cuda.h) and the CUDA device; NULL: host memory. */
    const struct shard_dev_ops *dev;
    int device;
    size_t max_piece; /* largest piece of one parameter on this rank */
    size_t max_numel; /* largest full parameter */
    void *stage;      /* max_piece fp32-sized elements: conversions, reduce output (on
                         the device too when dev is set) */
    /* The bytes the model's gathers and reduce-scatters copied from device into host memory
     * and back (shard_exec.c): on tcp with GPU-resident shards the device buffers staged
     * through host memory; on nccl the host buffers its engine staged (host shards, a model
     * region in host memory). Read by /metrics without op_mu. */
    atomic_uint_least64_t staged_to_host, staged_to_device;
    /* Where a gather or reduce-scatter of several tensors as one operation stages this rank's
     * slices with host shards, or a collective stages the device slice with GPU-resident
     * shards on tcp (shard_exec.c): host memory, grown to the largest such operation. */
    void *unit_stage;
    size_t unit_stage_bytes;
    ps_optim_config_t optim; /* the kind, and group 0's hyperparameters at definition */
    /* Parameter groups: ngroups >= 1 (one from the model-wide config when the definition gave
     * none), param_group[p] the group of parameter p; groups[g].cfg changes with Step's groups. */
    size_t ngroups;
    shard_group_t *groups;
    uint32_t *param_group;
    bool explicit_groups; /* the definition gave groups (they are in spec_text) */
    bool any_frozen;
    int nstate; /* fp32 state arrays per element (state0, state1) */
    double max_grad_norm;
    /* optimizer_in_backward: grad is NULL; each parameter's slice is updated at its
     * reduce-scatter with its group's hyperparameters and, when cur_lr_set, the lr cur_lr
     * (both set by the previous Step), reduced[p] marks the parameters reduced in this step,
     * grad_sq sums their squares for the step's gradient norm. */
    bool in_backward;
    bool cur_lr_set;
    double cur_lr;
    uint8_t *reduced;
    double grad_sq;
    int64_t step;
    int64_t aborted_steps; /* steps aborted (a trainer lost and replaced) since defined */
    /* A trainer's own optimizer (torch.optim) stepped it: its state lives in the trainer, so
     * a lost trainer cannot be replaced (mu). */
    bool trainer_optimizer;
    /* ...and its trainer said, at its last step, that it keeps that optimizer's state in the
     * object named trainer_state_names (so a replacement recovers it: mu). */
    bool trainer_state_kept;
    /* With host shards shared (shm.name set): the names a trainer's own optimizer keeps its
     * state under (DefineModelResponse.trainer_state_names), removed with the model; "" else. */
    char trainer_state_names[2][64];
    /* Per parameter, the optimizer steps that updated it (torch.optim's per-parameter "step"):
     * step, less the steps that skipped it for want of a gradient (a Step's skip mask), as
     * torch skips a parameter whose grad is None. In the shared-memory object (at
     * shm_steps_off) with host shards, so a trainer reads and restores it with the state. */
    int64_t *psteps;
    uint64_t fingerprint;
    char *spec_text; /* canonical text of the definition, compared across ranks */
    bool pinned;     /* storage page-locked by shard_model_pin, on pin_device */
    int pin_device;
} shard_model_t;

/* Builds the model from parameter names and shapes (copied). Validates everything a trainer
 * sends (names 1..255 printable bytes, 1..8 positive dims, element counts without overflow, at
 * most SHARD_MAX_PARAMS parameters, unique names, the optimizer config, no clipping with
 * in_backward, and the groups: see below); errors are INVALID_ARGUMENT with a message naming
 * the parameter or group. ngroups == 0: one group of optim's hyperparameters holds every
 * parameter (groups and param_groups unused, nparam_groups must be 0); otherwise at most
 * SHARD_MAX_GROUPS groups (copied; their cfg.kind is taken from optim, whose hyperparameters
 * are then unused), each valid by torch's rules, and nparam_groups == nparams indices below
 * ngroups. SGD momentum state exists when some group that is not frozen has momentum != 0.
 * Allocates and pre-touches storage: host memory when dev is NULL, else zeroed memory of dev
 * (shard_cuda.h) on CUDA device `device` (GPU-resident shards; errors then may be CUDA).
 * Host master weights, accumulator and optimizer state go into one new shared-memory object
 * (m->shm) unless
 * no_share is non-NULL (the reason they are not shared, copied into m->shared_reason); when
 * the object cannot be made (e.g. /dev/shm is full) they are private memory and the reason
 * says so: the definition does not fail for it.
 * max_bytes > 0: a model whose state on this rank (shard sections, staging, and one full
 * parameter for the initial broadcast) would need more is refused with RESOURCE_EXHAUSTED
 * before anything of that size is allocated. Free with shard_model_free. */
pshard_status_t shard_model_create(
    int rank, int world, pshard_layout_t layout, size_t nparams, const char *const *names,
    const int64_t *const *shapes, const size_t *ndims, const ps_optim_config_t *optim,
    const shard_group_t *groups, size_t ngroups, const uint32_t *param_groups, size_t nparam_groups,
    double max_grad_norm, bool in_backward, const struct shard_dev_ops *dev, int device,
    uint64_t max_bytes, const char *no_share, shard_model_t **out, char *err, size_t errlen);
void shard_model_free(shard_model_t *m);

/* Page-locks the storage (master, accumulator, state, staging buffer) for DMA to a GPU
 * (--backend nccl --offload cpu); shard_model_free unpins it. All or nothing: on failure
 * nothing stays pinned and err says why. */
pshard_status_t shard_model_pin(shard_model_t *m, int device, char *err, size_t errlen);

/* Zeroed host memory of n bytes with its pages backed now; NULL: out of memory. */
void *shard_model_alloc_touched(size_t n);
/* Unmaps what shard_model_alloc_touched(n) returned, given the same n; NULL does nothing. */
void shard_model_free_touched(void *p, size_t n);

/* Compares this model's definition text with another rank's and, when they differ, writes a
 * message naming the first differing parameter (and both world ranks, my_rank this one's) into
 * err and returns FAILED_PRECONDITION. */
pshard_status_t shard_model_compare(const shard_model_t *m, int my_rank, const char *other_text,
                                    int other_rank, char *err, size_t errlen);

/* Bytes of master + gradient accumulator (none in backward mode) + optimizer state. */
size_t shard_model_state_bytes(const shard_model_t *m);

/* The next run of trained (not frozen) parameters in this rank's shard, starting the search at
 * parameter *p (0 for the first call; advanced past the run): with by_group, a maximal
 * sequence of consecutive parameters of one group, else of consecutive trained parameters
 * (a model without frozen parameters is then one run, the whole shard). Parameters with no
 * elements on this rank neither end nor start a run. False when there is none left. */
bool shard_model_next_run(const shard_model_t *m, bool by_group, size_t *p, shard_run_t *run);

/* Words of a Step's skip mask for m: one bit per parameter. */
size_t shard_model_skip_words(const shard_model_t *m);

/* Sets the step count and every parameter's to step (a restored optimizer state). */
void shard_model_set_step(shard_model_t *m, int64_t step);

/* Parameter p's own step count, psteps[p] kept within 0..step (a trainer may write it through
 * the shared memory when it restores an optimizer state). */
int64_t shard_model_pstep(const shard_model_t *m, size_t p);

/* Checks n groups from a Step against m: n == m->ngroups, each valid for m's optimizer kind by
 * torch's rules (INVALID_ARGUMENT naming the group), frozen as at definition, SGD momentum
 * only where the state was allocated at definition (FAILED_PRECONDITION). */
pshard_status_t shard_model_check_groups(const shard_model_t *m, const shard_group_t *groups,
                                         size_t n, char *err, size_t errlen);

/* Replaces every group's hyperparameters with those of groups (m->ngroups entries, checked by
 * shard_model_check_groups). */
void shard_model_set_groups(shard_model_t *m, const shard_group_t *groups);

/* A double's bits as an int64 word of an agreement's payload, and back. */
static inline int64_t shard_double_word(double v)
{
    int64_t w;
    memcpy(&w, &v, sizeof(w));
    return w;
}

static inline double shard_word_double(int64_t w)
{
    double v;
    memcpy(&v, &w, sizeof(v));
    return v;
}

/* The groups as SHARD_GROUP_WORDS int64 words each (an agreement's payload), and back (kind
 * from the model). */
void shard_groups_encode(const shard_group_t *groups, size_t n, int64_t *words);
void shard_groups_decode(const int64_t *words, size_t n, ps_optim_kind_t kind,
                         shard_group_t *groups);

/* The model's numerics on this rank's slices (host, or GPU-resident through m->dev). Errors are
 * the device's. shard_model_slice_in: this rank's slice of parameter p in dt, for a gather
 * (*out is the master weights in fp32, else stage: m->stage, or with host shards a place in
 * m->unit_stage). shard_model_slice_out: after p's reduce-scatter in dt with the
 * reduced slice in stage (m->stage on a device), accumulates it
 * averaged over the active ranks, or with optimizer_in_backward applies the update.
 * shard_model_local_norm: this rank's part of the gradient norm of the trained accumulators,
 * the sum of squares (inf false) or the largest magnitude. shard_model_scale_grads multiplies
 * them by factor; shard_model_optimize runs one optimizer update of every trained slice
 * but those of the parameters whose bit is set in skip (NULL: none; bit p % 64 of word p / 64),
 * each at its own step (psteps[p] + 1, then counted; with set_lr, lr for every group);
 * shard_model_take_groups takes a Step's groups (nwords words from the agreement, checked against
 * the model); shard_model_zero_grads zeroes the accumulators. */
pshard_status_t shard_model_slice_in(shard_model_t *m, uint32_t p, pshard_dtype_t dt, void *stage,
                                     const void **out, char *err, size_t errlen);
pshard_status_t shard_model_slice_out(shard_model_t *m, uint32_t p, pshard_dtype_t dt, int active,
                                      void *stage, char *err, size_t errlen);
/* Host shards: m->unit_stage grown to at least bytes; NULL when out of memory. */
void *shard_model_unit_stage(shard_model_t *m, size_t bytes);
pshard_status_t shard_model_local_norm(shard_model_t *m, bool inf, double *out, char *err,
                                       size_t errlen);
pshard_status_t shard_model_scale_grads(shard_model_t *m, float factor, char *err, size_t errlen);
pshard_status_t shard_model_optimize(shard_model_t *m, bool set_lr, double lr, const uint64_t *skip,
                                     char *err, size_t errlen);
pshard_status_t shard_model_take_groups(shard_model_t *m, const int64_t *words, size_t nwords,
                                        char *err, size_t errlen);
pshard_status_t shard_model_zero_grads(shard_model_t *m, char *err, size_t errlen);

#endif
