/* libpshard's internals shared by its files: the client and work structs, and the functions
 * each file offers the others. Not installed. */
#ifndef PSHARD_CLIENT_INTERNAL_H
#define PSHARD_CLIENT_INTERNAL_H

#define PSHARD_BUILDING_LIBRARY 1
#include "pshard/pshard.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pshard/coord_client.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/layout.h"
#include "pshard/queue.h"
#include "pshard/rpc.h"
#include "pshard/shard.pb-c.h"

#include "client_pool.h"

#define DEFAULT_SCRATCH (16u << 20)

typedef struct {
    void *base;
    size_t bytes;
    char name[64]; /* "" for a private region (remote trainers) */
    bool linked;   /* the name is in /dev/shm (while the server opens it) */
    int fd;        /* the shared-memory file, kept open to name it and map parts of it again */
    bool has_fd;
} region_t;

#define CHUNK (1u << 20)

/* A CUDA IPC handle's size (cudaIpcMemHandle_t). */
#define CLIENT_IPC_HANDLE_BYTES 64

/* Device memory of the shard server that this client opened (client_dev.c): a CUDA IPC
 * handle of one allocation (memory PSHARD_MEMORY_CUDA, base a device pointer of CUDA device
 * `device`), or the emulated device's shared-memory object standing in for it
 * (PSHARD_MEMORY_EMULATED, base a host pointer). The handle is kept to open it again after a
 * suspension (a definition). base NULL: closed; memory PSHARD_MEMORY_HOST: none. */
typedef struct {
    void *base;
    size_t bytes;
    int memory, device;
    unsigned char handle[CLIENT_IPC_HANDLE_BYTES];
    size_t handle_len;
} dev_map_t;

/* The name looks like the server's own objects: "/pshard-srv-" then letters, digits, '-'. */
bool client_srv_name_ok(const char *name);
/* Maps the object name of at least bytes bytes (a regular object of this user), read-write and
 * shared, into *base; PSHARD_OK or the error with its reason in err. */
pshard_status_t client_map_object(const char *name, size_t bytes, void **base, char *err,
                                  size_t errlen);
/* Keeps a server's device memory from its answer (the handle's len bytes, its kind "cuda" or
 * "emulated", CUDA device, size), checked, without opening it; INVALID_ARGUMENT else. */
pshard_status_t client_dev_set(dev_map_t *d, const void *handle, size_t len, const char *kind,
                               int device, uint64_t bytes, char *err, size_t errlen);
/* Opens d (a no-op when open); an emulated object's name may not be other (the server's
 * object of something else; NULL: none). */
pshard_status_t client_dev_open(dev_map_t *d, const char *other, char *err, size_t errlen);
/* Closes d's opening (the handle stays to open it again). */
void client_dev_close(dev_map_t *d);
/* Sets bytes of d's memory at p to zero (a CUDA memset, complete before it returns). */
pshard_status_t client_dev_zero(const dev_map_t *d, void *p, size_t bytes, char *err,
                                size_t errlen);

/* The shard server's fp32 shard of the model, mapped from the shared-memory object it created
 * (pshard_shard_view): master weights at master_off, gradient accumulator at grad_off and
 * the servers' optimizer state at state0_off and state1_off (0: none) and the parameters' step
 * counts at steps_off, this rank's pieces laid out
 * by layout over the shard ranks of its replica. base NULL: not mapped, and reason says why and
 * what to do instead. */
typedef struct {
    void *base;
    size_t bytes;
    size_t master_off, grad_off, state0_off, state1_off, steps_off;
    /* GPU-resident shards (DefineModelResponse.shard_device_handle): master, grad and the state
     * are at their offsets in dev (opened from the server's handle; the offsets are then
     * relative to it), and base holds only the step counts. dev.memory is PSHARD_MEMORY_HOST
     * when the arrays are in base too. */
    dev_map_t dev;
    ps_layout_t *layout;
    int rank; /* this trainer's rank among the shard ranks (HSDP: within its replica) */
    char reason[PSHARD_ERRLEN];
    /* Where a trainer's own optimizer keeps its state for a replacement (both "" when the
     * server gave no valid names) and the server's --trainer-replace-ms
     * (pshard_trainer_state_info). */
    char state_names[2][64];
    int64_t replace_ms;
} shard_map_t;

/* Opens a shard server's cudaIpcMemHandle_t of CUDA device `device` (client_cuda_ipc.c);
 * FAILED_PRECONDITION naming what is missing when the CUDA runtime cannot be had. Close with
 * client_cuda_ipc_close. */
pshard_status_t client_cuda_ipc_open(const void *handle, size_t len, int device, void **out,
                                     char *err, size_t errlen);
void client_cuda_ipc_close(void *p);
/* Sets bytes of CUDA device memory at p (of device `device`) to zero and waits for it. */
pshard_status_t client_cuda_zero(int device, void *p, size_t bytes, char *err, size_t errlen);

typedef enum { WORK_GATHER, WORK_REDUCE_SCATTER, WORK_COLLECTIVE } work_kind_t;

/* Where one plain collective's bytes lie in the scratch region: this rank's send_bytes (copied
 * from src) at offset 0, and its recv_bytes (copied to dst) at recv_off. On the remote path
 * both also cross the wire. A rank sends and receives only what its role in the collective
 * uses. */
typedef struct {
    size_t send_bytes, recv_off, recv_bytes;
    const void *src;
    void *dst;
} coll_layout_t;

/* The bytes of the scratch region a collective laid out as l uses, from its start. */
static inline size_t coll_span(const coll_layout_t *l)
{
    size_t end = l->recv_off + l->recv_bytes;
    return end > l->send_bytes ? end : l->send_bytes;
}

/* The most works that hold a place in the scratch region at once (client_stage.c); more
 * staged collectives wait on the heap. */
#define CLIENT_STAGE_MAX 64
/* Heap copies of staged collectives kept for the next ones: fresh pages for each copy cost
 * more than the copy. At most CLIENT_SPARES of them, CLIENT_SPARE_MAX bytes in all. */
#define CLIENT_SPARES 8
#define CLIENT_SPARE_MAX ((size_t)256 << 20)

/* Where a parameter's full values or its full gradient stand in the client's pool. */
typedef enum {
    BUF_NONE = 0, /* sharded: no full buffer */
    BUF_PENDING,  /* a gather (or reduce-scatter) of it is issued and not finished */
    BUF_READY,    /* gathered (param) or handed to the trainer to write (grad) */
} buf_state_t;

typedef struct {
    buf_state_t state;
    size_t off, bytes; /* block in the model region, valid unless BUF_NONE */
} tensor_buf_t;

struct pshard_work {
    pshard_client_t *c;
    work_kind_t kind;
    size_t *ids;    /* the parameters this work really moves (skipped ones are left out) */
    uint64_t *offs; /* their blocks in the model region */
    size_t n;
    bool counted; /* holds a place among the gathers in flight */
    /* WORK_COLLECTIVE: the collective (its buffers and group the caller's) and its layout */
    pshard_collective_args_t coll;
    coll_layout_t layout;
    /* Its bytes, laid out as layout says, while it has a place: coll_span(layout) bytes at
     * st_off in the scratch region (in_scratch, listed in c->stage), or a heap copy (heap,
     * heap_cap bytes). A staged collective (pshard_collective_start_staged) has one from its
     * start (its send bytes, copied from the caller) until pshard_work_wait (its result);
     * another one only while it runs. running: the collective is using it; pinned: the caller
     * reads the result (pshard_work_wait_result). Neither may be moved. */
    bool staged, in_scratch, running, pinned;
    size_t st_off;
    uint8_t *heap;
    size_t heap_cap;
    bool done;
    pshard_status_t status;
    char error[PSHARD_ERRLEN];
    ps_qnode_t node; /* in the client's queue */
};

struct pshard_client {
    pshard_client_config_t cfg;
    char *server, *token;
    ps_rpc_channel_t *ch;
    char session[64];
    uint64_t serial; /* this client's number among the process's clients (client_group.c) */
    int rank, world;
    region_t scratch, model;
    char last_error[PSHARD_ERRLEN];

    /* Model. The model region is a pool: full parameters and gradients get a block when they
     * are gathered or handed out and give it back when resharded or reduce-scattered, so only
     * what is unsharded at once is ever backed by memory. Guarded by mu. */
    size_t nparams;
    size_t *numel;
    tensor_buf_t *pbuf, *gbuf;
    /* stable_param_buffers: the fixed block of each parameter's full values, before the pool;
     * NULL otherwise. With shared memory, a parameter of a page or more is remapped: while
     * gathered, its fixed addresses show a block of the pool (mmap MAP_FIXED of that part of
     * the region's file), and when resharded they show its own never-written pages again, so
     * its pool pages are reused by the next gather without page faults or zeroing. */
    size_t *stable_off;
    bool remap;
    size_t page;
    pshard_dtype_t param_dtype, reduce_dtype;
    int64_t model_step;    /* from DefineModel: > 0 after a resume */
    int64_t aborted_steps; /* from DefineModel or Resync: steps aborted (a trainer replaced) */
    shard_map_t shard;     /* the server's shard, mapped (client_shard.c) */
    /* The model region in the server's GPU memory (pshard_model_config_t.device_region): the
     * full buffers are at their pool offsets in region_dev.base, and model holds only what the
     * definition carried (the initial values). memory PSHARD_MEMORY_HOST: they are in model. */
    dev_map_t region_dev;
    bool reshard_after_forward;
    int max_gathers_in_flight;
    int gathers_in_flight;
    client_pool_t *pool;       /* NULL before the first model */
    pshard_memory_stats_t mem; /* its byte counters are the pool's (pshard_memory_stats) */

    /* The trainer's lease with the coordinator: registered as role TRAINER and renewed by a
     * thread, so a trainer that dies or hangs is evicted and its peers stop waiting. */
    ps_rpc_channel_t *coord;
    char coord_addr[256];
    char job[72];            /* the job on the coordinator, from Attach ("" for the default job) */
    ps_coord_lease_t *lease; /* NULL without a coordinator */
    /* Set once this trainer's own shard server is known lost (mu): every later call fails
     * at once with it instead of waiting on a server that will not answer. */
    pshard_status_t lost;
    char lost_msg[PSHARD_ERRLEN];

    /* Async worker */
    pthread_t worker;
    bool worker_started, stop;
    bool busy; /* an operation is running (on the worker or inline on the caller) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ps_queue_t queue; /* pshard_work_t issued, not yet taken by the worker (mu) */

    /* The scratch region's places (client_stage.c; mu): the works holding a range of it,
     * ordered by offset, and spare heap copies. */
    pshard_work_t *stage[CLIENT_STAGE_MAX];
    size_t nstage;
    void *spare[CLIENT_SPARES];
    size_t spare_bytes[CLIENT_SPARES];
};

/* A process group's handle (client_group.c): the id NewGroups gave it, the world ranks it
 * holds in group-rank order, and the client it was made on (serial and session), so a handle
 * of another or a closed client is refused instead of naming another session's group. */
struct pshard_group {
    uint32_t id;            /* CollectiveRequest.group */
    int rank;               /* this trainer's group rank, -1 when it is not a member */
    int size;               /* the number of ranks */
    uint64_t client_serial; /* pshard_client_t.serial of the client that made it */
    char session[64];       /* that client's session */
    int ranks[];            /* size world ranks, strictly increasing */
};

/* Holding c->mu: nothing is queued or running. */
/* Where the model region's full buffers are: the server's GPU memory (device_region), else
 * the shared memory. Under mu. */
static inline uint8_t *client_region_base(const pshard_client_t *c)
{
    return c->region_dev.base ? (uint8_t *)c->region_dev.base : (uint8_t *)c->model.base;
}

/* What a "the pool cannot fit" error adds: how pshard.torch sizes a pool in GPU memory. */
static inline const char *client_pool_hint(const pshard_client_t *c)
{
    return c->region_dev.base ? " (the model region is the shard server's GPU memory: "
                                "pshard.torch sizes it by PSHARD_DEVICE_POOL_BYTES)"
                              : "";
}

static inline bool client_idle(const pshard_client_t *c)
{
    return ps_queue_empty(&c->queue) && !c->busy;
}

/* Holding c->mu: waits until everything issued before has finished. */
static inline void client_wait_idle(pshard_client_t *c)
{
    while (!client_idle(c))
        pthread_cond_wait(&c->cv, &c->mu);
}

/* An operation that must reach the server after everything issued before it (a plain
 * collective, NewGroups): waits until the queued gathers and reduce-scatters finished and holds
 * the worker off until client_run_alone_end, so every rank's server sees its trainer's
 * operations in issue order (else a collective could overtake a queued reduce-scatter on one
 * rank only: a desync). */
static inline void client_run_alone_begin(pshard_client_t *c)
{
    pthread_mutex_lock(&c->mu);
    client_wait_idle(c);
    c->busy = true;
    pthread_mutex_unlock(&c->mu);
}

static inline void client_run_alone_end(pshard_client_t *c)
{
    pthread_mutex_lock(&c->mu);
    c->busy = false;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* Queues a checked collective behind the work issued before it (client_work.c). */
pshard_status_t client_work_queue_collective(pshard_client_t *c, const pshard_collective_args_t *a,
                                             const coll_layout_t *l, bool staged,
                                             pshard_work_t **out);

/* client_coll.c: torch.distributed's name of op (for messages), or NULL when op is none of
 * them. */
const char *client_op_name(pshard_op_t op);

/* client_coll.c: runs one plain collective laid out as l at offset base of the scratch region
 * (pshard_collective's request; the caller holds the worker off or is the worker, and holds
 * that place). copy: the send bytes are copied there from l->src first and the result to
 * l->dst after; else they are there already and the result stays. PSHARD_OK, or the error
 * with its message in err. */
pshard_status_t client_collective_exec(pshard_client_t *c, const pshard_collective_args_t *a,
                                       const coll_layout_t *l, size_t base, bool copy, char *err,
                                       size_t errlen);

/* client_stage.c, all holding c->mu. A place for w's bytes (coll_span of its layout) in the
 * scratch region. wait: moves other works' bytes to the heap where none is free (waiting for
 * pinned ones to be read), so it fails only without memory for that (NO_MEMORY, set on c);
 * else PSHARD_ERR_UNAVAILABLE at once (not set on c) when no range is free. */
pshard_status_t client_stage_place(pshard_client_t *c, pshard_work_t *w, bool wait);
/* Gives up w's place (range or heap copy), waking whoever waits for room. */
void client_stage_drop(pshard_client_t *c, pshard_work_t *w);
/* A heap buffer of at least bytes for w (a spare if one fits), or NULL. */
bool client_stage_heap(pshard_client_t *c, pshard_work_t *w, size_t bytes);
/* Gives up w's heap copy (kept as a spare, or freed). */
void client_stage_drop_heap(pshard_client_t *c, pshard_work_t *w);
/* Frees the spare heap copies (pshard_close). */
void client_stage_free_spares(pshard_client_t *c);

static inline size_t client_align(size_t x)
{
    return (x + CLIENT_POOL_ALIGN - 1) / CLIENT_POOL_ALIGN * CLIENT_POOL_ALIGN;
}

/* client_rpc.c: sets the client's last error message and returns st. */
pshard_status_t client_fail(pshard_client_t *c, pshard_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* client_region.c: the shared-memory regions the shard server maps (private ones for remote
 * trainers). A shared region is an unnamed file in /dev/shm (where it can be: O_TMPFILE) whose
 * name "/pshard-trn-PID-NS-HEX" exists only from client_region_link until
 * client_region_unlink, around the calls that have the server open it (once unlinked it cannot
 * be named again); what a killed trainer leaves there is swept by the next pshard process
 * (pshard/shm_names.h). */
pshard_status_t client_region_create(region_t *r, size_t bytes, const char *what, bool remote,
                                     bool touch, char *err, size_t errlen);
pshard_status_t client_region_link(region_t *r, char *err, size_t errlen);
void client_region_unlink(region_t *r);
void client_region_destroy(region_t *r);
void client_region_discard(region_t *r, size_t off, size_t len);

/* client_rpc.c: calls to this trainer's shard server (failing at once once it is known lost),
 * and the remote path's chunked copies of region bytes. */
pshard_status_t client_call(pshard_client_t *c, const char *method, const ProtobufCMessage *req,
                            const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp,
                            char *err, size_t errlen);
pshard_status_t client_remote_write(pshard_client_t *c, Pshard__Region region, const region_t *r,
                                    size_t off, size_t len, uint64_t region_bytes, char *err,
                                    size_t errlen);
pshard_status_t client_remote_read(pshard_client_t *c, Pshard__Region region, region_t *r,
                                   size_t off, size_t len, char *err, size_t errlen);
Pshard__DType client_dtype_pb(pshard_dtype_t d);

/* client_lease.c: the trainer's lease with the coordinator, renewed by a thread of its own. */
void client_lease_start(pshard_client_t *c, const char *reported);
void client_lease_stop(pshard_client_t *c);

/* client_buffers.c: full parameter and gradient buffers in the pool (callers hold c->mu). */
void client_buf_release(pshard_client_t *c, tensor_buf_t *b);
int client_param_take(pshard_client_t *c, size_t i, size_t bytes, size_t *off);
void client_param_release(pshard_client_t *c, size_t i);
void client_params_reset(pshard_client_t *c);

/* client_model.c: the model's definition, its buffers' accessors, steps and checkpoints. */
void client_model_free(pshard_client_t *c);

/* client_shard.c: maps the shard a DefineModel response r announces for the model of nparams
 * parameters (params, numel) defined with mc (its layout and HSDP mesh). Never fails: when the
 * shard cannot be mapped (remote trainer, GPU-resident shards, a mapping error), out->base is
 * NULL and out->reason says why and what to do instead. client_shard_close unmaps it (an empty
 * one is a no-op). */
void client_shard_open(pshard_client_t *c, const Pshard__DefineModelResponse *r,
                       const pshard_param_t *params, size_t nparams, const size_t *numel,
                       const pshard_model_config_t *mc, shard_map_t *out);
void client_shard_close(shard_map_t *s);
/* A redefinition frees the server's current shard once the new model is in place, and CUDA
 * forbids freeing memory another process still has open (cudaIpcCloseMemHandle first): the
 * GPU-resident mapping is closed before DefineModel (suspend) and, when the definition is
 * refused and the old model stays, opened again (resume; when that fails the view is gone, and
 * its reason says so). No-ops for host shards. */
void client_shard_suspend(shard_map_t *s);
void client_shard_resume(shard_map_t *s);

/* client_group.c: a serial number for a new client (never 0, unique within the process). */
uint64_t client_next_serial(void);
/* client_group.c: PSHARD_OK when g (not NULL) may be used on c, else the error, set on c,
 * saying why: made by another client (UNAVAILABLE) or not holding this trainer
 * (FAILED_PRECONDITION). what names the operation. */
pshard_status_t client_group_check(pshard_client_t *c, const pshard_group_t *g, const char *what);

/* client_work.c: the worker thread that runs asynchronous gathers and reduce-scatters in issue
 * order. */
void *client_worker_main(void *arg);

/* client_locate.c: the address of cfg->rank's shard server, from cfg->coordinator's Status
 * once the cluster has formed (polled until connect_timeout_ms). *server is malloc'd. */
pshard_status_t client_locate_server(const pshard_client_config_t *cfg, const char *token,
                                     char **server, char *err, size_t errlen);

#endif
