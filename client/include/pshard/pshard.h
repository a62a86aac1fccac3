/* libpshard: what a trainer links to train a model whose parameters live sharded across
 * pshard's shard servers, FSDP style. The trainer defines its parameters once; before using a
 * layer it gathers the full parameters (all-gather, in param_dtype) into buffers the library
 * owns, after backward it writes full gradients (in reduce_dtype) and reduce-scatters them, and
 * step() runs the optimizer on every shard. Tensors move through shared memory with the local
 * shard server; gRPC carries only the requests.
 *
 * Connection settings follow torch.distributed's env:// conventions: RANK, WORLD_SIZE,
 * LOCAL_RANK, MASTER_ADDR/MASTER_PORT, plus PSHARD_SERVER (this trainer's shard server) and
 * PSHARD_TOKEN_FILE.
 *
 * Thread safety: a pshard_client_t is used by one thread at a time, except pshard_work_wait and
 * pshard_work_test, which may run on any thread. Errors are pshard_status_t values; the last
 * error's message is kept per client (pshard_last_error). */
#ifndef PSHARD_PSHARD_H
#define PSHARD_PSHARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pshard/status.h"
#include "pshard/types.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(PSHARD_BUILDING_LIBRARY)
#define PSHARD_API __attribute__((visibility("default")))
#else
#define PSHARD_API
#endif

typedef struct pshard_client pshard_client_t;
typedef struct pshard_work pshard_work_t;

typedef struct {
    const char *server;         /* shard server "HOST:PORT" (env PSHARD_SERVER) */
    const char *token;          /* cluster token, or NULL (env PSHARD_TOKEN_FILE is read) */
    int rank;                   /* this trainer's rank (env RANK) */
    int world_size;             /* (env WORLD_SIZE); checked against the cluster */
    size_t scratch_bytes;       /* shared memory for plain collectives (default 16 MiB) */
    int64_t timeout_ms;         /* per operation (default 10 minutes) */
    int64_t connect_timeout_ms; /* waiting for the cluster to form (default 5 minutes) */
    bool remote;                /* the shard server is on another host: no shared memory, tensors
                                   stream over gRPC in 1 MiB chunks (env PSHARD_REMOTE=1) */
    const char *coordinator;    /* with server NULL: the coordinator "HOST:PORT" (env
                                   PSHARD_COORDINATOR; init_method tcp://), which names the shard
                                   server of this rank once the cluster has formed */
    const char *job;            /* the coordinator's job (env PSHARD_JOB; NULL: its default) */
    int64_t coll_timeout_ms;    /* this trainer's collective timeout (torch's
                                   init_process_group(timeout=)): its shard server aborts a
                                   collective of the world or of the model waiting longer, on
                                   every rank, naming the rank it waited for (0: the server's
                                   --coll-timeout-ms). Each call's own deadline is then at least
                                   twice this plus 10 s, so the servers' answer comes first */
} pshard_client_config_t;

/* Fills cfg from the environment (RANK, WORLD_SIZE, PSHARD_SERVER or PSHARD_COORDINATOR,
 * PSHARD_JOB, PSHARD_TOKEN_FILE, PSHARD_SCRATCH_BYTES, PSHARD_REMOTE) with defaults for the
 * rest. Strings point into the
 * environment or static storage. Returns INVALID_ARGUMENT with a message on stderr-free err for
 * malformed values. Thread-safe if the environment is not modified concurrently. */
PSHARD_API pshard_status_t pshard_client_config_from_env(pshard_client_config_t *cfg, char *err,
                                                         size_t errlen);

/* Connects to the shard server (cfg->server, or the one of cfg->rank that cfg->coordinator
 * names), waiting (up to connect_timeout_ms) for the cluster to form, and attaches a
 * shared-memory scratch region. On error *out is NULL and err holds the reason.
 * Free with pshard_close. */
PSHARD_API pshard_status_t pshard_connect(const pshard_client_config_t *cfg, pshard_client_t **out,
                                          char *err, size_t errlen);

/* init_method file://PATH: the coordinator address "HOST:PORT" a coordinator started with
 * --rdzv-file PATH wrote there, read under a shared lock. PSHARD_ERR_NOT_FOUND while the file is
 * absent or empty (the coordinator has not started yet: poll), INVALID_ARGUMENT when it holds
 * something else. */
PSHARD_API pshard_status_t pshard_rendezvous_file_read(const char *path, char *addr, size_t addrlen,
                                                       char *err, size_t errlen);

/* Closes the connection and frees the client and its shared memory. NULL is a no-op. */
PSHARD_API void pshard_close(pshard_client_t *c);

/* Leaves the cluster now, as pshard_close does (queued works run to the end; the coordinator
 * hears a clean leave, so the shard server does not evict this trainer), but keeps the
 * client's memory mapped: pointers into it (parameters, gradients, shard views) stay readable
 * and writable, holding their last values, until pshard_close. After it only pshard_close,
 * pshard_work_wait / pshard_work_test of works started before, pshard_last_error and the
 * getters may be called. Idempotent; NULL is a no-op. */
PSHARD_API void pshard_leave(pshard_client_t *c);

PSHARD_API int pshard_rank(const pshard_client_t *c);
PSHARD_API int pshard_world_size(const pshard_client_t *c);
/* The coordinator "HOST:PORT" this trainer holds its lease with ("" without one) and its job
 * there ("" for the coordinator's default job), e.g. for a store over the same coordinator.
 * Valid until pshard_close. Thread-safe. */
PSHARD_API const char *pshard_coordinator(const pshard_client_t *c);
PSHARD_API const char *pshard_job(const pshard_client_t *c);

/* The message of the last failed call on this client ("" if none). Valid until the next call. */
PSHARD_API const char *pshard_last_error(const pshard_client_t *c);

typedef struct {
    const char *name;     /* unique, e.g. "fc1.weight" */
    int ndim;             /* 1..8 */
    const int64_t *shape; /* ndim entries */
} pshard_param_t;

typedef enum {
    PSHARD_SGD = 0,
    PSHARD_ADAM = 1,
    PSHARD_ADAMW = 2,
} pshard_optimizer_t;

/* One parameter group's hyperparameters (an entry of torch.optim's param_groups); the fields
 * the optimizer does not use are ignored. Validated by torch's rules (lr, momentum, eps,
 * weight_decay >= 0, 0 <= betas < 1, nesterov needs momentum > 0 and dampening 0). */
typedef struct pshard_optim_group {
    double lr, momentum, dampening, weight_decay, beta1, beta2, eps;
    bool nesterov;
    bool frozen; /* requires_grad=False: gathered, never reduce-scattered or stepped; its
                    parameters count in no gradient norm and never change */
} pshard_optim_group_t;

typedef struct {
    pshard_layout_t layout;      /* FSDP2 (dim 0) or FSDP1 (flat) */
    pshard_dtype_t param_dtype;  /* what gather returns: fp32, bf16, fp16 */
    pshard_dtype_t reduce_dtype; /* what gradients are reduced in: fp32, bf16 */
    pshard_optimizer_t optimizer;
    double lr, momentum, dampening, weight_decay, beta1, beta2, eps;
    bool nesterov;
    double max_grad_norm;       /* clip_grad_norm over all shards; 0 = off */
    bool init_from_rank0;       /* true: rank 0's values are used (sync_module_states);
                                   false: every trainer passes the same values */
    bool reshard_after_forward; /* true (FULL_SHARD, the default): pshard_forward_done frees
                                   the full parameters and backward gathers them again;
                                   false (SHARD_GRAD_OP): they stay until backward is done */
    int max_gathers_in_flight;  /* pshard_gather_start waits while this many gathers are
                                   issued and unfinished (FSDP's limit_all_gathers); default
                                   2, 0 = no bound */
    size_t pool_bytes;          /* shared memory for full parameters and gradients; 0 = room
                                   for all of them twice over (only what is unsharded at
                                   once is ever backed by pages) */
    bool optimizer_in_backward; /* torch's _apply_optimizer_in_backward: each shard server
                                   updates a parameter's slice as soon as its gradient is
                                   reduce-scattered and keeps no gradient accumulator (1/N
                                   of the fp32 parameters less per server). Refuses
                                   max_grad_norm > 0 and a second reduce-scatter of a
                                   parameter in one step (gradient accumulation); a
                                   parameter not reduce-scattered in a step is not updated;
                                   pshard_step ends the step and its lr applies to the next
                                   step's updates. Default false. */
    bool stable_param_buffers;  /* each parameter's full buffer has a fixed address for the
                                   model's life (pshard_param_buffer), as FSDP2 keeps an
                                   unsharded parameter's storage: a reshard gives its pages
                                   back to the kernel (they read as zeros) and the next gather
                                   writes the same addresses, so views a framework saved
                                   stay valid. pool_bytes then sizes the gradients' pool
                                   only. Default false: blocks come from the pool. */
    /* Parameter groups (torch.optim's param_groups). ngroups == 0: one group with the
     * hyperparameters above holds every parameter. Otherwise groups[0..ngroups) (at most
     * 1024; copied, only their hyperparameters are used, `optimizer` still picks the kind)
     * and param_groups[i] the group of parameter i (nparams entries, each < ngroups); the
     * fields lr..nesterov above are then unused. Both are part of the definition every rank
     * must pass alike. */
    size_t ngroups;
    const pshard_optim_group_t *groups;
    const uint32_t *param_groups;
    /* HSDP (FSDP's HYBRID_SHARD; FSDP2's 2-D mesh ("replicate", "shard")): replicate *
     * shard == world size, world rank = replica * shard + shard index. Parameters are sharded
     * over the `shard` ranks of each replica (gathers stay among them), gradients are
     * reduce-scattered there and all-reduced across the `replicate` replicas, and each replica
     * steps its copy of the shards; checkpoints are written by replica 0 and load on any mesh
     * or world size. replicate = world, shard = 1 is NO_SHARD (every server holds every
     * parameter, as DDP). Both 0 (the default): no mesh, sharded over the whole world. Part of
     * the definition every rank must pass alike. */
    int replicate, shard;
    /* The model region (every full parameter and gradient buffer) in the shard server's GPU
     * memory instead of this trainer's shared memory, for a trainer that computes on that GPU,
     * when the server keeps GPU-resident shards (--backend nccl without --offload cpu, or
     * --shard-memory gpu; with host shards, and for a remote trainer, the region stays shared
     * memory: pshard_region_memory says where it is). The server allocates it and this client
     * opens it through CUDA IPC (the emulated device's shared-memory object in the test suite),
     * so gathers land where the trainer's kernels read them and reduce-scatters read what its
     * backward wrote, with no host copy on nccl. pshard_param, pshard_grad (zeroed on the
     * device) and pshard_param_buffer then return device pointers; stable_param_buffers keeps
     * the addresses, and a reshard keeps the memory. Ordering: the server completes a gather on
     * the device before it answers; a trainer that wrote a gradient with its own kernels
     * synchronizes them before the reduce-scatter. Default false. */
    bool device_region;
} pshard_model_config_t;

/* FSDP2 layout, fp32 params and reductions, torch.optim's defaults for `optimizer` (SGD
 * lr 1e-3), no clipping, init from rank 0, FULL_SHARD with at most 2 gathers in flight, one
 * parameter group (ngroups 0, groups and param_groups NULL). */
PSHARD_API void pshard_model_config_default(pshard_model_config_t *mc,
                                            pshard_optimizer_t optimizer);

/* Defines the model: every trainer must pass the same parameters in the same order (a
 * mismatch is refused with a message naming the first differing parameter). init[i] holds
 * parameter i's full fp32 values: required on rank 0 with init_from_rank0 (others may pass
 * NULL), on every rank otherwise. Allocates the shared-memory buffers for full parameters and
 * gradients. */
PSHARD_API pshard_status_t pshard_define_model(pshard_client_t *c, const pshard_param_t *params,
                                               size_t nparams, const pshard_model_config_t *mc,
                                               const float *const *init);

/* Where the model region is (pshard_model_config_t.device_region): PSHARD_MEMORY_HOST (this
 * trainer's shared memory), PSHARD_MEMORY_CUDA (the shard server's GPU memory on CUDA device
 * *device; pointers are device pointers) or PSHARD_MEMORY_EMULATED (the test suite's stand-in:
 * host pointers). *device is -1 for host memory; device may be NULL. Thread-safe. */
PSHARD_API int pshard_region_memory(pshard_client_t *c, int *device);

/* Optimizer steps the model has taken: 0 for a new model, the checkpoint's step when the shard
 * servers resumed one (pshard-server --resume), so the trainer continues its data from there.
 * Not thread-safe against pshard_define_model. */
PSHARD_API int64_t pshard_model_step(const pshard_client_t *c);

/* Where the trainer's data goes on: the steps applied (pshard_model_step) plus the steps
 * aborted because a trainer was lost and replaced (pshard-server --trainer-replace-ms), as of
 * pshard_define_model or the last pshard_resync. A replacement trainer starts its data there. */
PSHARD_API int64_t pshard_resume_step(const pshard_client_t *c);

/* After an operation failed with PSHARD_ERR_STEP_ABORTED (a trainer of the job was lost and
 * is being replaced; none of the step in flight is applied on any rank): waits for what was
 * issued before (it fails too), gives back every full parameter and gradient, waits until the
 * shard servers rebuilt their ring, and sets *next_step to the step whose data comes next
 * (pshard_resume_step). Until it is called every operation fails with STEP_ABORTED. */
PSHARD_API pshard_status_t pshard_resync(pshard_client_t *c, int64_t *next_step);

/* Saves a checkpoint now, like torch.distributed.checkpoint.save: collective, every trainer
 * calls it at the same point (ranks that joined take part by themselves). Each shard server
 * writes its shard under its --checkpoint-dir, then the manifest commits the step. *step and
 * dir (may be NULL) get the step and the committed directory. Errors: FAILED_PRECONDITION
 * without a --checkpoint-dir, SYSTEM naming the file (disk full, permissions), never a damaged
 * earlier checkpoint. */
PSHARD_API pshard_status_t pshard_checkpoint_save(pshard_client_t *c, int64_t *step, char *dir,
                                                  size_t dirlen);

/* The full buffer of parameter i in param_dtype: non-NULL only while it is gathered (after
 * the gather finished, until it is resharded; the address may differ from one gather to the
 * next). NULL for a bad i or a parameter that is sharded or still being gathered. */
PSHARD_API void *pshard_param(pshard_client_t *c, size_t i);
/* The full gradient buffer of parameter i in reduce_dtype, zero-filled when first handed out;
 * the trainer writes (or accumulates into) it, then reduce-scatters it, which frees it. NULL
 * for a bad i, while its reduce-scatter runs, or when the pool is full (pshard_last_error). */
PSHARD_API void *pshard_grad(pshard_client_t *c, size_t i);
PSHARD_API size_t pshard_param_numel(const pshard_client_t *c, size_t i);
/* With stable_param_buffers: the fixed address of parameter i's full buffer (param_dtype),
 * valid from pshard_define_model until the model is redefined or the client closed; its
 * contents are the parameter's values only while it is gathered (pshard_param non-NULL), zeros
 * otherwise. NULL without stable_param_buffers or for a bad i. Thread-safe. */
PSHARD_API void *pshard_param_buffer(pshard_client_t *c, size_t i);

/* Gathers the full values of parameters ids[0..n) (n == 0: all) into buffers taken from the
 * pool. A parameter that is already gathered (or being gathered) is skipped, which is how
 * SHARD_GRAD_OP saves backward's gather; every trainer must make the same calls, or the
 * collectives report a desync naming both ranks. After pshard_step every parameter is sharded
 * again (its values changed). */
PSHARD_API pshard_status_t pshard_gather(pshard_client_t *c, const size_t *ids, size_t n);

/* Frees the full buffers of ids[0..n) (n == 0: all), like FSDP2's reshard(); their memory
 * goes back to the pool. A gather still in flight for one of them is FAILED_PRECONDITION. */
PSHARD_API pshard_status_t pshard_reshard(pshard_client_t *c, const size_t *ids, size_t n);

/* Call after a unit's forward: reshards ids with reshard_after_forward (FULL_SHARD), keeps
 * them for backward otherwise (SHARD_GRAD_OP). */
PSHARD_API pshard_status_t pshard_forward_done(pshard_client_t *c, const size_t *ids, size_t n);

/* Reduce-scatters the gradients of ids[0..n) (n == 0: all that were handed out by
 * pshard_grad): each shard server keeps its averaged slice, accumulated until the next step.
 * The full gradient buffers go back to the pool when it finishes. */
PSHARD_API pshard_status_t pshard_reduce_scatter(pshard_client_t *c, const size_t *ids, size_t n);

typedef struct {
    size_t pool_bytes;          /* the model region's size */
    size_t in_use_bytes;        /* full parameters and gradients held now */
    size_t peak_in_use_bytes;   /* the most held at once since pshard_define_model */
    size_t touched_bytes;       /* the pool's high-water offset in the model region (with stable
                                   buffers this counts their own pages below the pool, which
                                   are never backed: it is not resident memory) */
    uint64_t params_gathered;   /* parameters moved by gathers */
    uint64_t params_skipped;    /* parameters a gather found already gathered */
    int peak_gathers_in_flight; /* the most asynchronous gathers unfinished at once */
} pshard_memory_stats_t;

/* Memory and gather counters of this client's pool. Thread-safe. */
PSHARD_API void pshard_memory_stats(pshard_client_t *c, pshard_memory_stats_t *out);

/* Asynchronous forms: they run in issue order on the client's own thread. The ids are copied.
 * Wait on the handle (which frees it) before touching the buffers involved. A gather's buffers
 * are taken from the pool when it is issued; pshard_gather_start first waits while
 * max_gathers_in_flight gathers are unfinished. */
PSHARD_API pshard_status_t pshard_gather_start(pshard_client_t *c, const size_t *ids, size_t n,
                                               pshard_work_t **work);
PSHARD_API pshard_status_t pshard_reduce_scatter_start(pshard_client_t *c, const size_t *ids,
                                                       size_t n, pshard_work_t **work);
/* True once the work has finished (successfully or not); pshard_work_wait then returns at
 * once. Does not free the handle. False for NULL. Thread-safe. */
PSHARD_API bool pshard_work_test(pshard_work_t *work);
/* Waits for and frees a handle; returns its status (message via pshard_last_error). */
PSHARD_API pshard_status_t pshard_work_wait(pshard_work_t *work);

/* Runs the optimizer on every shard (clipping first if configured). lr < 0 keeps the
 * configured rate (each group's own); lr >= 0 is this step's rate for every parameter group
 * (the groups keep theirs for later steps). With optimizer_in_backward the updates were
 * already applied at the reduce-scatters: the step only counts them, and lr is the rate of the
 * next step's. *step (may be NULL) gets the step number after the update, *grad_norm (may be
 * NULL) the global gradient norm before clipping (frozen parameters excluded). */
PSHARD_API pshard_status_t pshard_step(pshard_client_t *c, double lr, int64_t *step,
                                       double *grad_norm);

/* pshard_step with every parameter group's hyperparameters: groups[0..ngroups) replace the
 * groups' hyperparameters for this step and the later ones (what torch's optimizer reads from
 * param_groups at every step, so lr schedulers work, also ones that change momentum or betas);
 * ngroups must be the definition's number of groups (one, the config's, when it gave none) and
 * each group's frozen flag as defined. Every trainer passes the same values (else DESYNC).
 * pshard_step(c, lr, ...) instead sets only this step's lr, for every group. Like pshard_step
 * it waits for queued asynchronous work first and makes every gathered parameter sharded
 * again. Errors: INVALID_ARGUMENT (wrong count, a value torch would refuse, frozen changed),
 * FAILED_PRECONDITION (SGD momentum for a group when no trained group had momentum at
 * definition: its buffers were not allocated), the collectives' own; the groups are copied.
 * Not thread-safe (one thread per client). */
PSHARD_API pshard_status_t pshard_step_groups(pshard_client_t *c,
                                              const pshard_optim_group_t *groups, size_t ngroups,
                                              int64_t *step, double *grad_norm);

/* This rank's fp32 shard of one parameter, in its shard server's own memory (FSDP2's
 * Shard(0) local tensor): the server keeps its master weights and gradient accumulator in a
 * shared-memory object that pshard_define_model maps into the trainer. */
typedef struct {
    float *master; /* this rank's fp32 master weights of the parameter (numel elements), in the
                      server's memory: writing them changes what the next gather returns */
    float *grad;   /* its fp32 gradient accumulator (the reduce-scatters' average is added
                      there), or NULL with optimizer_in_backward (there is none) */
    size_t numel;  /* elements of the parameter on this rank (0: none, the last ranks may own
                      no rows; the pointers are then not to be dereferenced) */
    size_t offset; /* index, in the full parameter flattened row-major, of the first element
                      (FSDP2: first row * row size; FSDP1 cuts anywhere) */
    float *state0; /* the shard servers' optimizer state of these elements (numel each), or
                      NULL where their optimizer keeps none: state0 is Adam's exp_avg or SGD's */
    float *state1; /* momentum buffer, state1 Adam's exp_avg_sq (torch.optim's names) */
    int64_t *step; /* the servers' optimizer steps that updated this parameter (torch.optim's
                      per-parameter "step"; a step without a gradient for it skips it): read,
                      or restored with the state, under the same rules as master */
    int memory;    /* where master, grad, state0 and state1 are: PSHARD_MEMORY_HOST (host
                      memory; step always is), PSHARD_MEMORY_CUDA (the shard server's GPU
                      memory on CUDA device `device`, opened through CUDA IPC: device
                      pointers), PSHARD_MEMORY_EMULATED (the test suite's host stand-in for
                      GPU memory: host pointers) */
    int device;    /* the CUDA device ordinal of GPU-resident shards (-1 for host memory) */
} pshard_shard_view_t;

/* pshard_shard_view_t.memory */
#define PSHARD_MEMORY_HOST 0
#define PSHARD_MEMORY_CUDA 1
#define PSHARD_MEMORY_EMULATED 2

/* Fills *out with parameter i's shard on this rank, over the shard ranks of this trainer's
 * replica with HSDP. The pointers stay valid until the model is redefined or the client
 * closed (never free them).
 * Memory ordering: the shard server writes master in a step (its optimizer: pshard_step,
 * pshard_step_groups) and when it loads a checkpoint, and grad in reduce-scatters (and zeroes
 * it after its own optimizer step); the trainer may read or write master and grad only while
 * no such operation of its own is in flight (after waiting for its Works, or after the
 * blocking call returned), and the next gather reads master. Gathers read master without
 * writing it. With a trainer-side optimizer (pshard_step_trainer) the gradients accumulate
 * until the trainer zeroes grad itself, before the first reduce-scatter that should not add
 * to them.
 * GPU-resident shards (--backend nccl without --offload cpu): the server keeps master, grad and
 * the state in one allocation of its GPU that this client opens through CUDA IPC (memory
 * PSHARD_MEMORY_CUDA), and completes each of its operations on the device before it answers;
 * a trainer that writes them with its own kernels synchronizes its stream before the next call
 * that reads them (pshard_step_trainer, a gather).
 * Errors: INVALID_ARGUMENT for a bad i; FAILED_PRECONDITION, with the reason in
 * pshard_last_error, when there is no model yet, the trainer is remote (PSHARD_REMOTE=1), the
 * server could not share the shard, or GPU-resident shards cannot be opened (no CUDA runtime
 * here); use pshard_step (the servers' optimizer) then. Thread-safe. */
PSHARD_API pshard_status_t pshard_shard_view(pshard_client_t *c, size_t i,
                                             pshard_shard_view_t *out);

/* Ends a step whose update the trainer's own optimizer (e.g. torch.optim on the tensors of
 * pshard_shard_view) already applied to the master weights in place: collective like
 * pshard_step, it waits for queued asynchronous work first, makes every gathered parameter
 * sharded again (the masters changed), and the shard servers count the step (checkpoints with
 * --checkpoint-every go by it) without running an optimizer, clipping, or zeroing the
 * gradient accumulators: the trainer owns them in this mode. *step (may be NULL) gets the step
 * number after it. Every trainer must call it at the same point (a rank calling pshard_step
 * instead is DESYNC). Errors: FAILED_PRECONDITION with no model, with optimizer_in_backward,
 * and on every rank while some rank has joined (without throw_on_early_termination): a joined
 * rank's trainer no longer steps its shard; the collectives' own. Not thread-safe. */
PSHARD_API pshard_status_t pshard_step_trainer(pshard_client_t *c, int64_t *step);

/* pshard_step_trainer for a trainer that keeps its optimizer's state where a replacement
 * recovers it: in the shared-memory objects pshard_trainer_state_info names, with the values
 * this step began from, so that a replacement keeps the step if it completed on this rank's
 * server and rolls it back if not. With it a lost trainer can be replaced (pshard-server
 * --trainer-replace-ms); after plain pshard_step_trainer it cannot, and the job fails naming
 * why. When the step fails with STEP_ABORTED it may still have completed on other ranks:
 * pshard_model_step after pshard_resync says whether it counts. Errors:
 * pshard_step_trainer's. Not thread-safe. */
PSHARD_API pshard_status_t pshard_step_trainer_kept(pshard_client_t *c, int64_t *step);

/* Where a trainer's own optimizer keeps its state for a replacement (pshard_step_trainer_kept):
 * two names of POSIX shared-memory objects ("/pshard-srv-..."), which the trainer creates
 * (mode 0600) and the shard server removes with the model, and the server's
 * --trainer-replace-ms (0: a lost trainer ends the job, so there is nothing to keep). */
typedef struct {
    char names[2][64];
    int64_t trainer_replace_ms;
} pshard_trainer_state_info_t;

/* Fills *out. Errors: FAILED_PRECONDITION (no model, or the shard is not mapped: the reason is
 * pshard_shard_view's; or the server named no objects). Thread-safe. */
PSHARD_API pshard_status_t pshard_trainer_state_info(pshard_client_t *c,
                                                     pshard_trainer_state_info_t *out);

/* Tells this rank's shard server that a training step ends now, and what the trainer processed
 * in it: tokens and samples (each at most 2^53; 0 when not counted) add to the server's
 * pshard_step_tokens_total and pshard_step_samples_total. The server times each step between
 * two marks, splitting it into the time the trainer spent in pshard's calls and the rest
 * (compute), and the coordinator compares the ranks (pshardctl status names the slowest).
 * Without marks the server ends a step at each pshard_step or pshard_step_trainer; once a
 * trainer marked a step, only its marks count, so calling both counts each step once. Call it
 * at the same point of every step (after the optimizer). Not collective; it waits for nothing
 * queued. Errors: INVALID_ARGUMENT (a count over 2^53), FAILED_PRECONDITION (not attached),
 * the RPC's. Not thread-safe (one thread per client). */
PSHARD_API pshard_status_t pshard_report_step(pshard_client_t *c, uint64_t tokens,
                                              uint64_t samples);

/* pshard_step_groups, leaving alone the parameters no rank had a gradient for in this step
 * (torch.optim skips a parameter whose grad is None): skip holds one bit per parameter of the
 * definition (bit p % 8 of byte p / 8), skip_bytes = ceil(nparams / 8), no bit set past the
 * last parameter (0 bytes: none skipped). A skipped parameter keeps its values, optimizer state
 * and own step count (pshard_shard_view's step). Every trainer passes the same mask (else
 * DESYNC). Errors: pshard_step_groups', and INVALID_ARGUMENT for a mask of the wrong size. */
PSHARD_API pshard_status_t pshard_step_groups_skip(pshard_client_t *c,
                                                   const pshard_optim_group_t *groups,
                                                   size_t ngroups, const uint8_t *skip,
                                                   size_t skip_bytes, int64_t *step,
                                                   double *grad_norm);

/* Sets the shard servers' step count to step (>= 0) and changes nothing else: what loading
 * the servers' optimizer state (through pshard_shard_view's state arrays) ends with, so that
 * Adam's bias correction and the checkpoint schedule go on from the saved step. Collective
 * like pshard_step (waits for queued work first; every trainer passes the same step, else
 * DESYNC). Errors: FAILED_PRECONDITION with no model, INVALID_ARGUMENT for a negative step or
 * one above 2^53, the collectives' own. Not thread-safe. */
PSHARD_API pshard_status_t pshard_set_step(pshard_client_t *c, int64_t step);

/* torch.nn.utils.clip_grad_norm_ on the shard servers, after backward and before the step:
 * *total_norm (may be NULL) gets the fp32 norm of every rank's accumulated gradients (frozen
 * parameters excluded) of type norm_type, 2.0 or INFINITY; with max_norm > 0 the accumulators
 * are then multiplied by min(1, max_norm / (total_norm + 1e-6)) in fp32, as torch does;
 * max_norm == 0 only computes the norm. Collective: every trainer calls it at the same point
 * (ranks that joined take part by themselves). Waits for queued asynchronous reduce-scatters
 * first. Errors: INVALID_ARGUMENT (another norm_type, max_norm < 0 or NaN),
 * FAILED_PRECONDITION (no model, or optimizer_in_backward, which keeps no accumulator), the
 * collectives' own. Not thread-safe (one thread per client). */
PSHARD_API pshard_status_t pshard_clip_grad_norm(pshard_client_t *c, double max_norm,
                                                 double norm_type, double *total_norm);

typedef struct {
    bool enable;                     /* false: Join is off and pshard_join is an error (torch's
                                        Join(enable=False)) */
    bool throw_on_early_termination; /* the others' next operation fails with PSHARD_ERR_JOINED
                                        naming this rank, instead of being shadowed */
} pshard_join_options_t;

typedef struct {
    bool is_last_joiner;   /* this trainer was the last to join (the post hook's argument) */
    int last_rank;         /* the rank that joined last */
    int64_t step;          /* optimizer steps taken when everyone had joined */
    uint64_t shadowed_ops; /* operations this rank's server ran for the others meanwhile */
    bool others_raised;    /* throw_on_early_termination: another rank's operation failed with
                              PSHARD_ERR_JOINED before every rank joined (torch's Join raises
                              on this rank too then) */
} pshard_join_result_t;

/* enable = true, throw_on_early_termination = false. */
PSHARD_API void pshard_join_options_default(pshard_join_options_t *o);

/* Join for uneven inputs, as PyTorch's Join: this trainer has no more input. Its shard server
 * keeps taking part in every gather, reduce-scatter, step and collective the other trainers
 * run (its real slice for gathers, zeros for gradients and collectives; gradients and averages
 * are over the trainers that contributed), and the call returns once every trainer has joined,
 * filling *result (may be NULL). Afterwards all ranks are active again (e.g. for a final
 * gather). Waits for asynchronous work first; a joined trainer's full parameters are resharded.
 * Errors: FAILED_PRECONDITION with enable = false or before pshard_define_model; the
 * collectives' own (PEER_LOST, TIMEOUT) if a rank is lost meanwhile. A trainer that gets
 * PSHARD_ERR_JOINED (another rank joined with throw_on_early_termination) should join too. */
PSHARD_API pshard_status_t pshard_join(pshard_client_t *c, const pshard_join_options_t *opts,
                                       pshard_join_result_t *result);

/* Plain collectives on the trainer's own buffers, through its shard server (as
 * torch.distributed offers; while some trainers have joined, their ranks add zeros and an
 * average is over the others): all_reduce in place, broadcast in place from root, all_gather of
 * count elements per rank into recv (world_size * count), barrier. */
PSHARD_API pshard_status_t pshard_all_reduce(pshard_client_t *c, void *buf, size_t count,
                                             pshard_dtype_t dtype, bool average);
/* all_reduce with any reduction (types.h; torch.distributed.ReduceOp's numbers): sum, avg,
 * product, min, max for every dtype, band / bor / bxor for int64 (an INVALID_ARGUMENT error
 * otherwise, and from the nccl backend, which has no bitwise reductions). A joined rank
 * contributes the reduction's identity (0, 1, +Inf, -Inf, all ones), so it changes nothing. */
PSHARD_API pshard_status_t pshard_all_reduce_op(pshard_client_t *c, void *buf, size_t count,
                                                pshard_dtype_t dtype, pshard_reduce_t op);
PSHARD_API pshard_status_t pshard_broadcast(pshard_client_t *c, void *buf, size_t count,
                                            pshard_dtype_t dtype, int root);
PSHARD_API pshard_status_t pshard_all_gather(pshard_client_t *c, const void *send, void *recv,
                                             size_t count, pshard_dtype_t dtype);
PSHARD_API pshard_status_t pshard_barrier(pshard_client_t *c);
/* To and from a root (torch.distributed's reduce, gather, scatter): reduce_to leaves the
 * reduction of every rank's buf in root's buf (the others' buf is unchanged); gather_to puts
 * every rank's count elements into root's recv (world_size * count, rank-major; the others may
 * pass recv = NULL); scatter_from gives each rank its count elements of root's send (world_size *
 * count; the others may pass send = NULL). Ranks that joined take part with their identity
 * (reduce) or zeros. */
PSHARD_API pshard_status_t pshard_reduce_to(pshard_client_t *c, void *buf, size_t count,
                                            pshard_dtype_t dtype, pshard_reduce_t op, int root);
PSHARD_API pshard_status_t pshard_gather_to(pshard_client_t *c, const void *send, void *recv,
                                            size_t count, pshard_dtype_t dtype, int root);
/* all_to_all: send holds world_size blocks of count elements, block k for rank k; recv gets
 * world_size blocks, block k from rank k (torch's all_to_all_single with equal splits). A
 * joined rank sends zeros. */
PSHARD_API pshard_status_t pshard_all_to_all(pshard_client_t *c, const void *send, void *recv,
                                             size_t count, pshard_dtype_t dtype);
PSHARD_API pshard_status_t pshard_scatter_from(pshard_client_t *c, const void *send, void *recv,
                                               size_t count, pshard_dtype_t dtype, int root);

/* ---- Process groups (torch.distributed.new_group) ---- */

typedef struct pshard_group pshard_group_t;

/* Makes ngroups process groups at once (torch's new_group, new_subgroups_by_enumeration, or a
 * device mesh dimension's groups): group i holds the world ranks ranks[off_i .. off_i +
 * sizes[i]) where off_i is the sum of the sizes before it, strictly increasing (group rank k is
 * the k-th of them, as torch orders them). Collective: every trainer calls it with the same
 * groups in the same order (else DESYNC naming both); the members of each group build its
 * communicator on their shard servers. timeout_ms (0: the servers' collective timeout) bounds
 * each of the group's collectives. out[0..ngroups) receive handles on every rank, also for the
 * groups it is not in (pshard_group_rank says -1). Groups last until pshard_client_close or
 * until the cluster re-forms (their collectives then fail with UNAVAILABLE). At most 64 groups
 * per call and 1024 per session. Errors: INVALID_ARGUMENT (a rank out of range, repeated or out
 * of order, an empty group), JOINED (a rank has joined: groups are made while every trainer is
 * active), RESOURCE_EXHAUSTED, the collectives' own. */
PSHARD_API pshard_status_t pshard_new_groups(pshard_client_t *c, const int *ranks,
                                             const size_t *sizes, size_t ngroups,
                                             int64_t timeout_ms, pshard_group_t **out);
/* One group: pshard_new_groups with ngroups 1. */
PSHARD_API pshard_status_t pshard_new_group(pshard_client_t *c, const int *ranks, size_t n,
                                            int64_t timeout_ms, pshard_group_t **out);
/* Makes the process group keyed key, of the world ranks ranks[0..n) (strictly increasing), as
 * torch's new_group does it: only the group's members call, each with the same key (torch's
 * group_name; any non-empty string of at most 1024 bytes) and ranks, and nobody else takes
 * part; members may make their groups in different orders so long as no two of them wait on
 * each other. The members' shard servers build the group's communicator, each waiting at most
 * timeout_ms (0: the servers' collective timeout) for the others; timeout_ms also bounds each
 * of the group's collectives, as with pshard_new_groups. Like every operation it reaches the
 * shard server after everything this client issued before it (blocks until the queued
 * asynchronous work has finished). On success *out is a handle to free with
 * pshard_group_free; the group lasts until the session ends or the cluster re-forms, and counts
 * towards the 1024 groups a session may have. Errors (*out NULL): INVALID_ARGUMENT (a NULL or
 * empty key, a key too long, a rank out of range, repeated or out of order, this trainer not a
 * member, the key already made in this session), JOINED (a member's trainer has joined),
 * TIMEOUT (a member never came: the message names the group, its ranks and, where the store
 * tells, the missing ranks), RESOURCE_EXHAUSTED, and the RPC's. Thread-safe as the client's
 * other operations are. */
PSHARD_API pshard_status_t pshard_new_group_keyed(pshard_client_t *c, const char *key,
                                                  const int *ranks, size_t n, int64_t timeout_ms,
                                                  pshard_group_t **out);
/* This trainer's rank in g, or -1 when it is not a member (or g is NULL). */
PSHARD_API int pshard_group_rank(const pshard_group_t *g);
PSHARD_API int pshard_group_size(const pshard_group_t *g);
/* The world rank of group rank k, or -1 when k is out of range. */
PSHARD_API int pshard_group_global_rank(const pshard_group_t *g, int k);
/* Frees the handle (the servers keep the group until the session ends). NULL is a no-op. */
PSHARD_API void pshard_group_free(pshard_group_t *g);

/* ---- Every plain collective through one entry ---- */

/* collectives.h's numbers, which shard.proto's CollectiveRequest.op carries. */
typedef enum {
    PSHARD_OP_ALL_GATHER = 1,
    PSHARD_OP_REDUCE_SCATTER = 2,
    PSHARD_OP_ALL_REDUCE = 3,
    PSHARD_OP_BROADCAST = 4,
    PSHARD_OP_BARRIER = 5,
    PSHARD_OP_REDUCE = 6,
    PSHARD_OP_GATHER = 7,
    PSHARD_OP_SCATTER = 8,
    PSHARD_OP_ALL_TO_ALL = 9,
    PSHARD_OP_SEND = 10, /* point-to-point: to root */
    PSHARD_OP_RECV = 11, /* from root */
} pshard_op_t;

/* One collective on group (NULL: every rank), with n the group's size and root a group rank:
 *  all_gather: send count elements, recv n * count;  reduce_scatter: send n * count (block k
 *  for group rank k), recv count (the reduction of every rank's block for this rank);
 *  all_reduce: send and recv count (may be
 *  the same buffer);  broadcast: recv count, root's send (may be recv);  barrier: nothing;
 *  reduce: send count, root's recv count;  gather: send count, root's recv n * count;
 *  scatter: root's send n * count, recv count;  all_to_all: send and recv n * count.
 * Buffers a rank does not use may be NULL. */
typedef struct {
    pshard_op_t op;
    const pshard_group_t *group;
    const void *send;
    void *recv;
    size_t count;
    pshard_dtype_t dtype;
    pshard_reduce_t reduce; /* all_reduce, reduce */
    int root;               /* broadcast, reduce, gather, scatter; send / recv: the peer */
    uint32_t tag;           /* send / recv: must be the peer's */
} pshard_collective_args_t;

/* send: send count elements to root; recv: receive count into recv from root (root a rank of
 * group, or of the world). Each pair of ranks matches its sends and recvs in issue order (like
 * NCCL's, a rank's point-to-point operations run one after another: two ranks that both send
 * first get DESYNC, so an exchange orders them, e.g. even ranks send first); the counts, dtypes and
 * tags must agree (else DESYNC naming both). A peer whose trainer has joined: JOINED. The first
 * send or recv between two ranks connects their servers (until the other side arrives). */

/* Runs one collective as above (the functions above are this with group NULL). Errors:
 * INVALID_ARGUMENT (bad arguments, over the scratch region), FAILED_PRECONDITION (this trainer
 * is not in the group), UNAVAILABLE (a group of an earlier session or generation), the
 * collectives' own. Not thread-safe (one thread per client). */
PSHARD_API pshard_status_t pshard_collective(pshard_client_t *c, const pshard_collective_args_t *a);

/* pshard_collective, asynchronous (torch's async_op=True): checks the arguments at once (the
 * same errors), then queues the collective on the client's thread behind everything issued
 * before it (gathers, reduce-scatters, other collectives), so every rank's server still sees
 * the operations in issue order. The buffers and the group must stay valid, and send
 * unchanged, until pshard_work_wait returns (its status is the collective's); recv is written
 * when the work completes. */
PSHARD_API pshard_status_t pshard_collective_start(pshard_client_t *c,
                                                   const pshard_collective_args_t *a,
                                                   pshard_work_t **work);

/* pshard_collective_start that is done with the caller's buffers when it returns (torch's Work
 * lets the caller resize or free its tensors meanwhile): send is copied into the client's
 * scratch region before it returns (onto the heap while that is full) and recv is never
 * written; the result waits with the work until pshard_work_wait frees it. Read it with
 * pshard_work_wait_result. The bytes move as often as with pshard_collective. */
PSHARD_API pshard_status_t pshard_collective_start_staged(pshard_client_t *c,
                                                          const pshard_collective_args_t *a,
                                                          pshard_work_t **work);

/* Waits for a work without freeing it; returns its status. For a successful staged collective
 * that receives, *result points at its recv bytes (*bytes of them), readable until
 * pshard_work_wait frees the work, which the caller does soon after: meanwhile those bytes
 * hold their place and other collectives may wait for room. Else *result is NULL and *bytes 0.
 * Thread-safe as pshard_work_wait. */
PSHARD_API pshard_status_t pshard_work_wait_result(pshard_work_t *work, const void **result,
                                                   size_t *bytes);

#ifdef __cplusplus
}
#endif
#endif
