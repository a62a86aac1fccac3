/* The shard server's operations layer: the one entry every trainer operation goes through, and
 * the only code that takes op_mu. An RPC handler translates its request into a shard_op_t and
 * calls shard_op_run, which takes op_mu once, checks the session (and the model), lets the
 * operation refuse what this rank can judge alone, agrees on it with the other ranks
 * (shard_agree_active), runs it, records its statistics and releases op_mu; the handler then
 * replies from what the operation left in its arg. Dependencies run one way: handlers ->
 * operations (attach, define, regions, join, checkpoint) -> model/device. */
#ifndef PSHARD_SHARD_OPS_H
#define PSHARD_SHARD_OPS_H

#include "pshard/shard.pb-c.h"
#include "shard_internal.h"

typedef struct shard_op shard_op_t;

/* A step of an operation, under op_mu: PSHARD_OK, or the error with its message in err. */
typedef pshard_status_t (*shard_op_fn)(pshard_shard_server_t *s, pshard_comm_t *comm,
                                       shard_op_t *op, char *err, size_t errlen);

struct shard_op {
    const char *session;     /* the caller's session: must be the attached trainer's */
    bool no_session;         /* Attach: the caller has no session yet, none is checked (its
                                check decides whether it may take the rank) */
    const char *needs_model; /* non-NULL: FAILED_PRECONDITION with this message without one */
    bool agree;              /* agree on sop with the other ranks before run */
    shard_sop_t sop;         /* what the ranks agree on (check may complete it) */
    uint32_t group;          /* 0: the world; else the process group the operation runs on
                                (its communicator: check, the agreement and run get it) */
    int peer;                /* with p2p: the world rank of a send's or recv's peer; the
                                operation runs on their pair's communicator */
    bool p2p;
    bool new_model;       /* DefineModel: replaces the model, so a lost copy of the old one
                             does not refuse it */
    bool ack_abort;       /* Resync: the trainer takes note of the step aborts so far, so this
                             operation does not fail with STEP_ABORTED for them */
    int opk;              /* shard_opk_t for the statistics, or -1 for none */
    uint64_t bytes;       /* moved bytes, for the statistics (check may set it) */
    shard_op_fn check;    /* before agreeing: this rank's own refusals, which every rank
                             asked alike makes alike, so none waits (NULL: none) */
    shard_op_fn run;      /* after agreeing: the operation itself */
    int active;           /* set by the agreement: the contributing ranks */
    int64_t ckpt_request; /* set by the agreement: the newest checkpoint request */
    void *arg;            /* the operation's own request and results */
};

/* Runs op as above. Errors: UNAVAILABLE while the cluster forms or after a fatal error,
 * FAILED_PRECONDITION for another session or a missing model, and check's, the agreement's
 * (DESYNC, JOINED) or run's. Thread-safe; blocks while another operation runs. */
pshard_status_t shard_op_run(pshard_shard_server_t *s, shard_op_t *op, char *err, size_t errlen);

/* Destroys old, a communicator the cluster replaced, once no operation runs on it: call it
 * after clearing s->comm (under mu) and aborting old, which ends a collective an operation may
 * be blocked in; it waits for that operation by taking op_mu. The setup thread's only. */
void shard_ops_retire_comm(pshard_shard_server_t *s, pshard_comm_t *old);
/* The same for a ring an aborted step failed (the generation goes on): the process groups are
 * suspended (shard_pgs_suspend), to be rebuilt under serial, the new ring's serial. */
void shard_ops_retire_ring(pshard_shard_server_t *s, pshard_comm_t *old, uint32_t serial);

/* The communicator, or NULL with UNAVAILABLE and the reason in err (forming, failed). */
pshard_comm_t *shard_op_comm(pshard_shard_server_t *s, pshard_status_t *rc, char *err,
                             size_t errlen);

/* PSHARD_OK when session names the attached trainer, else FAILED_PRECONDITION saying why.
 * Call with op_mu or mu held (Attach changes the session under both). */
pshard_status_t shard_session_check(const pshard_shard_server_t *s, const char *session, char *err,
                                    size_t errlen);

/* Join (shard_join.c): this rank's trainer ran out of input; its server shadows the other
 * ranks' operations (its real slice for gathers, zeros for gradients) until every rank has
 * joined. arg is a shard_join_result_t: throw_on_early_termination in, the rest out. */
typedef struct {
    bool throw_on_early_termination;
    bool is_last_joiner;
    int last_rank;
    int64_t step;
    uint64_t shadowed;  /* operations shadowed */
    bool others_raised; /* some rank's operation was refused with JOINED (throw mode) */
} shard_join_result_t;
pshard_status_t shard_join_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                               char *err, size_t errlen);

/* NewGroups (shard_groups.c): the check validates the request's groups and encodes them for
 * the agreement (arg is a shard_new_groups_arg_t; free its words after the operation); run
 * gives them the next ids and builds the communicators of those this rank is in. A failed build
 * registers none of them, but their ids stay used on every rank. */
typedef struct {
    const Pshard__NewGroupsRequest *req;
    uint32_t *words; /* [n, size_0, ranks_0..., size_1, ...]: the agreement's ids */
    uint32_t first_id;
} shard_new_groups_arg_t;
pshard_status_t shard_new_groups_check(pshard_shard_server_t *s, pshard_comm_t *comm,
                                       shard_op_t *op, char *err, size_t errlen);
pshard_status_t shard_new_groups_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                     char *err, size_t errlen);
/* NewGroups with a key (shard_groups.c): run without an agreement round, by the members of the
 * request's one group only. Checks the request (INVALID_ARGUMENT: not one group, bad ranks, this
 * rank not a member, the key already used in this session; RESOURCE_EXHAUSTED: too many groups),
 * refuses with JOINED when a member's trainer has joined, then builds the group's communicator
 * under a name derived from the key (blocks until every member's server builds it too, at most
 * the request's timeout_ms, else the servers' collective timeout; TIMEOUT naming the members
 * that never came when the store tells) and registers it with a local id in first_id. arg is a
 * shard_new_groups_arg_t (words unused). op_mu held. */
pshard_status_t shard_new_group_keyed_run(pshard_shard_server_t *s, pshard_comm_t *comm,
                                          shard_op_t *op, char *err, size_t errlen);

/* DefineModel (shard_define.c): checks the definition, compares it with the other ranks'
 * through the coordinator's store, takes the initial values (from rank 0, or each rank's own)
 * or the newest checkpoint (--resume), and adopts the new model and region only when all of it
 * succeeded; a refused definition leaves the previous ones in place. The replacement of a
 * lost trainer (--trainer-replace-ms) takes over the model as it is instead, alone, when it
 * defines the same one. arg is a shard_define_arg_t: req in, the rest out. */
typedef struct {
    const Pshard__DefineModelRequest *req;
    char resumed_from[4096]; /* the checkpoint --resume restored, or "" */
    uint64_t shard_numel, fingerprint;
    int64_t step, aborted_steps;
    /* The shard as shared memory (the model's shm): its name ("" when not shared, with the
     * reason), size, and where master, grad, the optimizer state (0: none) and the
     * parameters' step counts are in it. */
    char shm_name[64];
    uint64_t shm_bytes, master_off, grad_off, state0_off, state1_off, steps_off;
    char shared_reason[PSHARD_ERRLEN];
    /* GPU-resident shards shared with the trainer: the device memory's handle (handle_len 0:
     * host shards), its kind ("cuda" or "emulated"), size and CUDA device; master_off ..
     * state1_off are then offsets into it and shm_name holds only the step counts. */
    unsigned char dev_handle[SHARD_DEV_HANDLE_MAX];
    size_t dev_handle_len;
    const char *dev_kind;
    uint64_t dev_bytes;
    int32_t device;
    /* The model region in device memory (device_region_bytes): its handle (region_handle_len
     * 0: the region is the trainer's shared memory), of the kind dev_kind on device. */
    unsigned char region_handle[SHARD_DEV_HANDLE_MAX];
    size_t region_handle_len;
    /* The model's trainer_state_names and the server's --trainer-replace-ms. */
    char state_names[2][64];
    int64_t trainer_replace_ms;
} shard_define_arg_t;
pshard_status_t shard_define_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                 char *err, size_t errlen);

/* HSDP (shard_define.c): connects m's communicators over world rank wrank's replica (its
 * shard ranks, m->shard_comm) and shard index (one rank per replica, m->replicate_comm) of a
 * reps x shards mesh, named for definition attempt (which every rank numbers alike) and, after
 * the serial-th aborted step (> 0), for it too; replaces (destroys) the ones m had. Blocks until
 * the peers connect (every rank calls it alike); op_mu held. */
pshard_status_t shard_mesh_connect(pshard_shard_server_t *s, shard_model_t *m, int wrank, int reps,
                                   int shards, uint64_t attempt, uint32_t serial,
                                   uint64_t generation, char *err, size_t errlen);

/* The region operations (shard_region.c), for a trainer on another host. */

/* One chunk of a ReadRegion (at most 1 MiB): refuses an unknown or missing region and a range
 * outside it, else queues the chunk at off with ps_rpc_call_send (its status in sent, off
 * advanced when queued) or, once the whole range went out, finishes the call. arg is a
 * shard_read_chunk_t. */
typedef struct {
    ps_rpc_call_t *call;
    const Pshard__RegionReadRequest *req;
    uint64_t off;         /* the next chunk's offset within the range */
    pshard_status_t sent; /* out: ps_rpc_call_send's status for the chunk */
    bool finished;        /* out: the range was sent and the call finished */
} shard_read_chunk_t;
pshard_status_t shard_region_read_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                      char *err, size_t errlen);

/* A WriteRegion chunk (arg is the Pshard__RegionWriteRequest) copied into its region; a model
 * region with region_bytes is the private one filled before DefineModel, (re)allocated at that
 * size. Errors: INVALID_ARGUMENT (chunk too large, unknown region, outside the region),
 * FAILED_PRECONDITION (region not there yet), RESOURCE_EXHAUSTED (over --max-model-memory, or
 * no memory). */
pshard_status_t shard_region_write_run(pshard_shard_server_t *s, pshard_comm_t *comm,
                                       shard_op_t *op, char *err, size_t errlen);

#endif
