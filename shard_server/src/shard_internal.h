/* Internals of the shard server shared by its files: the server struct, its lifecycle
 * (shard_server.c), membership side (shard_member.c: register, heartbeat, building the
 * communicator), trainer-facing service (shard_service.c), trainer regions (shard_region.c) and
 * what every communicator is made with (shard_comm.c). */
#ifndef PSHARD_SHARD_INTERNAL_H
#define PSHARD_SHARD_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "pshard/collectives.h"
#include "pshard/rpc.h"
#include "pshard/shard_server.h"
#include "shard_metrics.h"
#include "shard_model.h"
#include "shard_steps.h"

#define NMETHODS 15
#define SHM_NAME_MAX 200

typedef struct {
    void *base;
    size_t bytes;
    bool pinned;    /* page-locked for the GPU's copies (--backend nccl) */
    int pin_device; /* the CUDA device current while pinning */
    int guard;      /* a shared mapping's ps_shm_guard id + 1 (0: none) */
    char name[SHM_NAME_MAX + 2];
} shm_map_t;

/* The buffers one communicator's agreement rounds and a joined rank's shadowing reuse. */
typedef struct {
    int64_t *agree_buf; /* the records of every rank of the communicator */
    size_t agree_cap;
    void *follow_buf; /* a joined rank's receive/zero buffers for the others' ops */
    size_t follow_cap;
    /* An agreement round showed a joined rank: every operation agrees first until the join
     * ends (the same on every rank: set by the same verdict, cleared when all joined). */
    bool joined_seen;
} shard_bufs_t;

/* A process group (torch.distributed.new_group): world ranks ranks[0..size), strictly
 * increasing; this rank is group rank grank of them, or -1 when it is not a member (then there
 * is no communicator). */
typedef struct shard_pg {
    uint32_t id;
    char *key; /* a keyed group's key (NewGroupsRequest.key, owned), NULL for an agreed one */
    int size, grank;
    int *ranks;
    pshard_comm_t *comm;
    shard_bufs_t bufs;
    /* After an aborted step (a trainer replaced): the ring serial its communicator is rebuilt
     * under ("<name>~serial"), on its first use, and whether the group was a lost trainer's,
     * kept for its replacement to claim by making the keyed group again (shard_pgs_suspend). */
    uint32_t serial;
    bool orphan;
    int64_t
        timeout_ms; /* its collectives' timeout (NewGroupsRequest.timeout_ms; 0: the server's) */
} shard_pg_t;

struct pshard_shard_server {
    pshard_shard_server_config_t cfg;
    /* GPU-resident shards: their operations (shard_cuda.h: the CUDA kernels, or the host
     * emulation the tests use); NULL: shards in host memory. */
    const struct shard_dev_ops *dev;
    char *strings[16]; /* owned copies of cfg strings */
    ps_rpc_server_t *srv;
    ps_rpc_channel_t *coord;
    char advertise[300];

    struct ps_coord_lease *lease; /* registration and heartbeats (shard_member.c) */
    int64_t register_backoff_ms;  /* the lease's thread only */
    pthread_t setup_thread, watch_thread;
    bool setup_started, watch_started;
    int64_t last_contact_ns; /* last successful heartbeat (mu) */
    atomic_bool stop;
    volatile int stop_flag; /* mirrors stop for the communicator's set-up (pshard_comm_config) */
    /* The world ring's set-up gives up when set: stop, or a lost peer to heal (mu). */
    volatile int ring_cancel;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    char member_id[64];
    char lease_key[64]; /* the secret Register returned: Heartbeat/Leave/ReportJoin need it */
    int rank, world;
    uint64_t generation, formed_generation, comm_generation;
    int64_t heartbeat_ms;
    int64_t lease_ms; /* the coordinator's lease, from heartbeats (mu) */
    bool formed;
    pshard_comm_t *comm; /* set once built; replaced only by the setup thread */
    /* --trace-dir (shard_trace.c): the comm generation whose trace was written (mu), and
     * whether a failed write was logged already. */
    bool trace_written;
    uint64_t trace_generation;
    atomic_bool trace_warned;
    /* The newest trace request seen in the coordinator's store (the lease's thread only). */
    bool trace_request_known;
    int64_t trace_request_seen;
    pshard_status_t fatal;
    char fatal_msg[PSHARD_ERRLEN];
    /* Trainer replacement (--trainer-replace-ms; shard_member.c), under mu. A lost trainer's
     * server aborts the world ring with STEP_ABORTED; every server then rebuilds it under a new
     * name ("shard~N", N = ring_serial, the step aborts so far), discards the gradients of the
     * aborted step and counts it in the model. replace_deadline_ns: while a replacement is
     * awaited (0: none), when the rank gives up. comm_serial: the
     * ring_serial of the current ring. session_aborts: the step aborts the attached trainer
     * took note of (Resync) or began after; every other operation of a trainer that took
     * note of fewer fails with STEP_ABORTED (shard_op_run). */
    int64_t replace_deadline_ns;
    uint32_t ring_serial, comm_serial, session_aborts;
    char abort_msg[PSHARD_ERRLEN];
    /* Healing a lost peer from an HSDP replica (shard_heal.h), under mu. heal_rank: the lost
     * rank awaited (-1: none) since heal_started_ns, until heal_deadline_ns, lost with the ring
     * of generation heal_from_gen, for heal_cause. replaces_lost: this server took a lost
     * one's rank (MemberView.replaces_lost). heals: heals this server took part in. */
    int heal_rank;
    uint64_t heal_from_gen;
    int64_t heal_started_ns, heal_deadline_ns;
    char heal_cause[256];
    bool replaces_lost;
    uint64_t heals;
    char heal_note[320]; /* Status's heal line: the newest heal, or the one awaited */
    /* The newcomer's state from its replica until its trainer defines the model (op_mu). */
    struct shard_heal_state *heal;

    /* Trainer state, guarded by op_mu (one operation at a time). */
    pthread_mutex_t op_mu;
    char session[40];
    char trainer_name[128];             /* the attached trainer's coordinator member name (Attach's
                                           member_name; under mu) */
    bool trainer_gone;                  /* it was seen, and has left or been evicted since (mu) */
    bool trainer_seen;                  /* the coordinator's membership (Watch) holds a live trainer
                                           member of that name (mu) */
    int64_t attached_ns;                /* when the session began (mu) */
    _Atomic int64_t session_timeout_ms; /* the trainer's collective timeout (0: the server's) */
    shm_map_t scratch, model_shm;
    shm_map_t pending_model;  /* remote trainers: private model region filled before DefineModel */
    uint64_t max_model_bytes; /* --max-model-memory, or what this machine / cgroup has */
    shard_model_t *model;
    /* Definitions compared in comm generation define_generation (op_mu): each attempt
     * publishes under its own number, so a retry after a refused definition never reads a
     * peer's stale one. */
    uint64_t define_attempts, define_generation;

    /* Join, guarded by op_mu (status reads the copies under mu). */
    bool joined; /* this rank's trainer joined; Join shadows the others */
    /* Since the last completed join, a rank's operation was refused because a rank joined with
     * throw_on_early_termination (every server sees the same rounds, so all agree) (mu) */
    bool join_refused;
    int64_t joined_step;
    uint64_t shadowed_ops; /* (mu: a joined rank's group threads count theirs too) */
    /* Operations run ahead of the agreement, and those diverted to it (shard_op_run; mu). */
    uint64_t ops_ahead, ops_diverted;
    shard_bufs_t bufs; /* the world communicator's agreement and shadowing buffers */

    /* Process groups (shard_groups.c) of this session and comm generation: used under op_mu;
     * the array changes under op_mu and mu both, so the watch thread may abort them under mu. */
    struct shard_pg **pgs;
    size_t npgs;
    uint32_t next_pg_id; /* agreed: the same on every rank of the comm generation */
    /* Keyed groups' counter (made by their members only): this server's own, in the upper half
     * of the id's 16-bit counter; 0 until the generation's first keyed group. */
    uint32_t next_keyed_pg_id;
    /* Point-to-point (send / recv): pairs[peer] is the communicator of this rank and world rank
     * peer (its ranks 0 and 1 in world-rank order), built at their first send or recv and kept
     * for the comm generation (not the session: it joins two servers, not two trainers);
     * pair_epoch[peer] counts the rebuilds after a failure, in its name. Used under op_mu;
     * the array pointer changes under op_mu and mu both. world entries, or NULL. */
    struct shard_pg **pairs;
    uint32_t *pair_epoch;
    int npairs; /* their length: the world size when they were made */

    /* Checkpoints. ckpt_requested: the newest `pshardctl checkpoint save` request seen in the
     * coordinator's store (mu); ckpt_handled: the newest one saved (op_mu). */
    int64_t ckpt_requested, ckpt_handled;

    ps_rpc_method_t methods[NMETHODS];
    char paths[NMETHODS][64];

    /* Statistics and health (shard_metrics.c): atomics, never behind op_mu. */
    int64_t started_ns;
    shard_op_stats_t op_stats[SHARD_OPK_COUNT];
    shard_steps_t steps;       /* the trainer's step, compute and wait times (shard_steps.h) */
    atomic_int region_reads;   /* ReadRegion calls running (shard_service.c) */
    atomic_int serving;        /* what "pshard.ShardServer" reports: 1 SERVING, 2 NOT */
    pthread_mutex_t health_mu; /* serializes shard_health_update's evaluate-and-set */
    char health_reason[256];   /* why NOT_SERVING, "" when serving (health_mu) */
    pthread_t monitor_thread;
    bool monitor_started;
    struct ps_metrics_server *metrics; /* --metrics-listen, or NULL */
};

/* One trainer operation as the ranks agree on it before running it (shard_join.c). */
typedef enum {
    SHARD_SOP_GATHER = 1,
    SHARD_SOP_REDUCE_SCATTER = 2,
    SHARD_SOP_STEP = 3,
    SHARD_SOP_COLLECTIVE = 4,
    SHARD_SOP_SAVE = 5,
    SHARD_SOP_CLIP = 6,
    SHARD_SOP_NEW_GROUPS = 7, /* ids: the groups, encoded (shard_groups.c) */
    SHARD_SOP_P2P = 8,        /* a send / recv on a pair's communicator: coll_op is the tag,
                                 root the sender's rank in the pair, count and dtype */
} shard_sop_kind_t;

typedef struct {
    shard_sop_kind_t kind;
    pshard_dtype_t dtype;
    size_t nids; /* gather / reduce-scatter: the parameters, in order */
    const uint32_t *ids;
    double lr; /* step: with set_lr, this step's lr for every group */
    bool set_lr;
    bool trainer_stepped; /* step: the trainer's own optimizer updated the masters (only
                             counted here; refused while a rank has joined) */
    bool set_step;        /* step: only sets the step count to step_to (a restored optimizer) */
    int64_t step_to;
    bool skip;            /* step: words end with a skip mask (shard_model_skip_words words) */
    size_t nwords;        /* step: the groups' new hyperparameters (shard_groups_encode); 0: */
    const int64_t *words; /* unchanged */
    double max_norm;      /* clip: clip_grad_norm's arguments */
    double norm_type;
    uint32_t coll_op; /* collective: pshard_coll_op_t, element count, root, reduction */
    uint64_t count;
    int root;
    uint32_t reduce; /* pshard_reduce_t (all_reduce) */
} shard_sop_t;

/* Before an operation a trainer asks for, the shard servers agree on it: each sends a
 * small record (its operation, or "joined") in one all-gather, so a rank whose trainer joined
 * learns what the others run and shadows it, and every rank learns how many trainers
 * contribute. (While nobody has joined, gathers, reduce-scatters and plain collectives skip
 * the round where the communicator can divert them: shard_op_run.) For an active rank: *active gets
 * the number of contributing ranks; errors are DESYNC (the active ranks asked for different
 * operations, naming both), JOINED (a rank joined with throw_on_early_termination, or a broadcast's
 * root joined), or the collective's own. Every rank reaches the same verdict from the same records.
 * Call with op_mu held. */
pshard_status_t shard_agree_active(pshard_shard_server_t *s, pshard_comm_t *comm,
                                   shard_bufs_t *bufs, const shard_sop_t *op, int *active,
                                   int64_t *ckpt_request, char *err, size_t errlen);

/* "step N, what" into buf (N the step being computed): a flight-recorder label. */
const char *shard_op_label(const shard_model_t *m, const char *what, char *buf, size_t len);

/* The operations' cores (shard_exec.c), shared by the trainer operations and a joined rank
 * shadowing them (op_mu held). shard_gather_one all-gathers parameter p in dt into recv (full
 * size; device memory of the model's device when on_dev: the model's device region);
 * shard_reduce_scatter_one reduce-scatters the full gradient send (dt; device memory when
 * on_dev) and adds this rank's
 * slice, averaged over active contributors, to the accumulator; shard_run_step (shard_exec.c)
 * takes the step op's groups, clips and runs the optimizer on every trained slice, each with
 * its group's hyperparameters (a trainer_stepped step only counts the step: the trainer's
 * optimizer updated the masters, and the accumulators stay as they are); shard_run_clip
 * (shard_exec.c) is clip_grad_norm: the global norm of the trained accumulators (norm_type 2 or
 * inf) into *total_norm, and with max_norm > 0 their scaling; shard_run_collective runs a plain
 * collective (an average is over the active ranks). */
pshard_status_t shard_gather_one(pshard_comm_t *comm, shard_model_t *m, uint32_t p,
                                 pshard_dtype_t dt, void *recv, bool on_dev, char *err,
                                 size_t errlen);
pshard_status_t shard_reduce_scatter_one(pshard_comm_t *comm, shard_model_t *m, uint32_t p,
                                         pshard_dtype_t dt, const void *send, bool on_dev,
                                         int active, char *err, size_t errlen);
/* Gathers (gather) or reduce-scatters the n parameters ids, each into or from its full buffer
 * bufs[i] (device memory when on_dev: the model's device region; the same buffer for several
 * ids is allowed: a joined rank's scratch): one
 * collective for all of them on host shards over tcp (their pieces end to end), else one per
 * parameter as shard_gather_one / shard_reduce_scatter_one. Every rank must pass the same ids
 * in the same order. Errors: the collective's, the model's. */
pshard_status_t shard_tensors_run(pshard_comm_t *comm, shard_model_t *m, bool gather,
                                  const uint32_t *ids, void *const *bufs, bool on_dev, size_t n,
                                  pshard_dtype_t dt, int active, char *err, size_t errlen);
pshard_status_t shard_run_step(pshard_shard_server_t *s, pshard_comm_t *comm, shard_model_t *m,
                               const shard_sop_t *op, int64_t ckpt_request, double *norm, char *err,
                               size_t errlen);
pshard_status_t shard_run_clip(pshard_comm_t *comm, shard_model_t *m, double max_norm,
                               double norm_type, double *total_norm, char *err, size_t errlen);

/* Parameter groups from a DefineModel or Step request (n entries, kind the model's) into *out
 * (NULL for n == 0; free it; shard_define.c). Copies only: shard_model_create and
 * shard_model_check_groups validate. Errors: INVALID_ARGUMENT over SHARD_MAX_GROUPS, NO_MEMORY. */
struct Pshard__OptimizerGroup;
pshard_status_t shard_groups_from_pb(struct Pshard__OptimizerGroup *const *pb, size_t n,
                                     ps_optim_kind_t kind, shard_group_t **out, char *err,
                                     size_t errlen);

pshard_status_t shard_run_collective(pshard_comm_t *comm, const shard_sop_t *op, const void *send,
                                     void *recv, int active, char *err, size_t errlen);

/* Checkpoints (shard_ckpt.c), collective: every rank calls them at the same point.
 * shard_ckpt_save writes this rank's shard of m at step m->step under cfg.checkpoint_dir and,
 * once every rank's is written, rank 0 commits the manifest; dir gets the step directory.
 * Errors name the file and the rank; the previous checkpoints are never touched.
 * shard_ckpt_load restores m, freshly created (its gradients are still zero), (master weights,
 * optimizer state, step) from the newest committed checkpoint under root, saved with any world
 * size and layout, after verifying every file's checksum; *restored is false (and m untouched)
 * when root holds none. */
pshard_status_t shard_ckpt_save(pshard_shard_server_t *s, pshard_comm_t *comm, shard_model_t *m,
                                char *dir, size_t dirlen, char *err, size_t errlen);
pshard_status_t shard_ckpt_load(pshard_shard_server_t *s, pshard_comm_t *comm, shard_model_t *m,
                                const char *root, bool *restored, char *dir, size_t dirlen,
                                char *err, size_t errlen);

/* After an optimizer step: saves when checkpoint_every says so or a `pshardctl checkpoint
 * save` request (the agreed ckpt_request) is pending, and answers that request in the store. */
pshard_status_t shard_ckpt_after_step(pshard_shard_server_t *s, pshard_comm_t *comm,
                                      shard_model_t *m, int64_t ckpt_request, char *err,
                                      size_t errlen);

/* A communicator's pieces (shard_comm.c). shard_comm_config gives the configuration of a
 * communicator of this server's (the world's "shard", a process group's, a pair's, an HSDP
 * mesh's): its settings from the server's flags, this rank and world of it. shard_bufs_free
 * frees a communicator's agreement and shadowing buffers. */
void shard_comm_config(const pshard_shard_server_t *s, pshard_comm_config_t *cc, const char *name,
                       int rank, int world, uint64_t generation);
void shard_bufs_free(shard_bufs_t *b);

/* Process groups (shard_groups.c). shard_pgs_clear destroys every group (op_mu held; the
 * groups' communicators are aborted first, so nothing waits in them). shard_pgs_abort fails
 * the collectives of every group that holds world rank lost (-1: every group), and those of an
 * HSDP model's mesh, with status and msg; any thread. shard_pg_find gives the group id of this
 * session, or NULL with the error (INVALID_ARGUMENT for an id never made, UNAVAILABLE for one of an
 * earlier session or generation, FAILED_PRECONDITION when this rank is not a member); op_mu held.
 * A group suspended by an aborted step is rebuilt first (blocking until every member's server
 * rebuilds it, at most the collective timeout).
 */
void shard_pgs_clear(pshard_shard_server_t *s);
/* After an aborted step: every group's communicator (aborted already) is destroyed, the group
 * kept under its id, and rebuilt under ring serial serial on its first use (shard_pg_find);
 * op_mu held. shard_pgs_hand_over, at a replacement trainer's Attach (op_mu held), keeps the
 * lost trainer's keyed groups as orphans its replacement claims by making them again (a keyed
 * NewGroups with the same key and ranks) and destroys the others. */
void shard_pgs_suspend(pshard_shard_server_t *s, uint32_t serial);
void shard_pgs_hand_over(pshard_shard_server_t *s);
/* A lost server's replacement (shard_heal.c, op_mu held): keeps the keyed group id (key, world
 * ranks, strictly increasing, holding this rank) that its predecessor was in as an orphan that
 * its trainer claims by making the group again, rebuilt under serial on first use. A group of
 * that id or key already kept is left as it is. */
pshard_status_t shard_pg_adopt_orphan(pshard_shard_server_t *s, uint32_t id, const char *key,
                                      const int *ranks, int size, uint32_t serial,
                                      int64_t timeout_ms, char *err, size_t errlen);
void shard_pgs_abort(pshard_shard_server_t *s, int lost, pshard_status_t status, const char *msg);
/* One line on a group this rank is in, for Status: "group ID (ranks 0, 2): rank 1 of 2 over
 * shm; " and its newest flight record. */
void shard_pg_describe(const shard_pg_t *g, char *buf, size_t len);
/* The pair communicator of this rank and world rank peer (shard_groups.c), built on first
 * use (blocks until peer's server builds it too, at most timeout_ms; a peer whose trainer has
 * joined is refused at once with JOINED), or rebuilt after it failed. NULL with the error.
 * op_mu held. shard_pairs_clear destroys them all (op_mu held, or at shutdown). */
shard_pg_t *shard_pair_get(pshard_shard_server_t *s, pshard_comm_t *world, int peer,
                           int64_t timeout_ms, pshard_status_t *rc, char *err, size_t errlen);
void shard_pairs_clear(pshard_shard_server_t *s);
/* Marks (joined) or unmarks this rank's trainer as joined in the coordinator's store, where a
 * peer that wants to build a pair with it looks first. Best effort. */
void shard_pairs_mark_joined(pshard_shard_server_t *s, int rank, bool joined);

shard_pg_t *shard_pg_find(pshard_shard_server_t *s, uint32_t id, pshard_status_t *rc, char *err,
                          size_t errlen);

/* Records the first fatal background error, wakes waiters and logs it. Thread-safe. */
void shard_set_fatal(pshard_shard_server_t *s, pshard_status_t st, const char *msg);

/* Fails the world ring's collectives with st and msg, if it is there and has not failed yet
 * (true then); under mu, since the setup thread retires a ring only after taking it from
 * s->comm under mu. Any thread but the setup thread. */
bool shard_abort_ring(pshard_shard_server_t *s, pshard_status_t st, const char *msg);

/* With mu held: waits on cv at most ms milliseconds (the waiters re-check their condition,
 * the deadline and stop after each wake). */
void shard_cv_wait(pshard_shard_server_t *s, int64_t ms);

/* Fault injection for the crash-safety tests: PSHARD_FAULT_INJECT=NAME:STEP kills this process
 * (SIGKILL, no clean-up, as a crash would) when it reaches point NAME at STEP (a checkpoint's
 * "ckpt-..." points while saving STEP, "heal-send" while a heal source sends its state at
 * STEP). */
void shard_fault_point(const char *name, int64_t step);

/* Starts the server's lease with the coordinator (s->lease): its thread registers (again
 * under the same name when evicted, which gives the old rank back) and heartbeats, adopting
 * the coordinator's view of the cluster. Stopped, with a Leave, by ps_coord_lease_stop. */
pshard_status_t shard_lease_start(pshard_shard_server_t *s, char *err, size_t errlen);

/* Sets the attached trainer's collective timeout (session_timeout_ms, 0: the server's) on comm
 * (the world ring, or NULL) and on the model's HSDP rings. */
void shard_apply_session_timeout(pshard_shard_server_t *s, pshard_comm_t *comm);

/* Thread body (arg is the server): building (and, when the cluster re-forms, rebuilding) the
 * communicator. Returns once s->stop is set. */
void *shard_setup_main(void *arg);

/* Thread body: follows the coordinator's Watch stream and, when it evicts a member (a shard
 * server or a trainer whose lease lapsed), fails this rank's collectives at once with
 * PSHARD_ERR_PEER_LOST naming it, so no trainer waits for a peer that is gone. Returns once
 * s->stop is set. */
void *shard_watch_main(void *arg);

/* Fills s->methods with the trainer-facing service's methods (shard_service.c) and adds them
 * to s->srv, before it starts. */
void shard_service_add_methods(pshard_shard_server_t *s);

/* Trainer regions (shard_region.c). The server's own regions change only in operations (op_mu
 * held) and at shutdown. */

/* Maps a trainer's shared-memory object into *out. The name must look like "/pshard-..."
 * (letters, digits, '.', '_', '-') and name a regular object of at least bytes bytes. Errors:
 * INVALID_ARGUMENT (name, size), NOT_FOUND (no such object), SYSTEM (mmap). Free with
 * shard_unmap. */
pshard_status_t shard_map_shm(const char *name, uint64_t bytes, shm_map_t *out, char *err,
                              size_t errlen);

/* Anonymous memory of bytes for a remote trainer's region into *out. Errors: INVALID_ARGUMENT
 * (size out of range), RESOURCE_EXHAUSTED (mmap). Free with shard_unmap. */
pshard_status_t shard_alloc_private(uint64_t bytes, shm_map_t *out, char *err, size_t errlen);

/* Unmaps a region (shared or private; unpinned first) and clears it; an empty one is a
 * no-op. */
void shard_unmap(shm_map_t *m);

/* True when this server's collectives run on the GPU (--backend nccl: host buffers staged by
 * the backend). */
bool shard_on_gpu(const pshard_shard_server_t *s);

/* --backend nccl: page-locks a trainer region so the collectives' copies between it and the
 * GPU run by DMA; a failure only costs speed and is logged. No-op for tcp. */
void shard_pin_region(pshard_shard_server_t *s, shm_map_t *m);

/* PSHARD_OK, or FAILED_PRECONDITION naming the first shared memory of this server's trainer
 * (its regions; with model_too the model's own object) that another process shrank while it
 * was mapped: what the server wrote there or read from there since is not what the trainer
 * sees. Sticky until the memory is unmapped (a new Attach, a new model). */
pshard_status_t shard_shm_check(const pshard_shard_server_t *s, bool model_too, char *err,
                                size_t errlen);

/* True when [offset, offset + len) lies inside m and offset is a multiple of align (0: any). */
bool shard_in_region(const shm_map_t *m, uint64_t offset, uint64_t len, size_t align);

/* PSHARD_OK when a model region of bytes fits this server's --max-model-memory, else
 * RESOURCE_EXHAUSTED saying so. */
pshard_status_t shard_region_size_ok(const pshard_shard_server_t *s, uint64_t bytes, char *err,
                                     size_t errlen);

#endif
