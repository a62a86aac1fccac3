/* Internals shared by the backend-independent layer (coll_comm.c: arguments, requests, queue,
 * flight recorder, bootstrap) and the backends (coll_tcp.c, coll_nccl.c). */
#ifndef PSHARD_COLL_INTERNAL_H
#define PSHARD_COLL_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "coll_buf.h"
#include "coll_wire.h"
#include "pshard/collectives.h"
#include "pshard/queue.h"
#include "pshard/util.h"

#define COLL_OP_INLINE_RANKS 8

/* One operation, validated and with its descriptor computed. Owned by its request. */
typedef struct coll_op {
    pshard_coll_args_t args; /* counts points at `counts` below */
    size_t *counts;          /* world_size entries, always filled (equal counts expanded) */
    size_t *displs;          /* prefix sums of counts, world_size + 1 entries */
    /* counts and displs of a communicator of up to COLL_OP_INLINE_RANKS ranks (not allocated:
     * a small operation's set-up is part of its latency) */
    size_t inline_counts[COLL_OP_INLINE_RANKS], inline_displs[COLL_OP_INLINE_RANKS + 1];
    coll_desc_t desc;
    coll_buf_t sbuf, rbuf; /* send and recv, whole or in pieces (freed with the op) */
    int64_t deadline_ns;   /* ps_now_ns clock; read it through coll_op_deadline */
    size_t record_slot;    /* index into the flight recorder ring */
    bool check_only;       /* exchange and compare the descriptor; move no data */
    int64_t start_ns;      /* when it was started (ps_now_ns), for the per-operation log line;
                              0 for one run in the caller's thread until it first waits */
    int64_t timeout_ns;
    /* reduce / gather / scatter / all_to_all run as the operation in args (all_reduce,
     * all_gather, broadcast, all_gather) with recv = temp where the caller's recv does not take
     * the whole result; on success post_blocks blocks of post_len bytes, at temp + post_off +
     * k * post_stride, go to post_dst one after another (scatter: this rank's block; all_to_all:
     * its block of every rank's send). */
    void *temp;
    void *post_dst;
    size_t post_off, post_len, post_stride, post_blocks;
} coll_op_t;

struct pshard_coll_req {
    pshard_comm_t *comm;
    coll_op_t op;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    bool sync; /* never handed to the backend: completed in coll_start's thread, before it
                  returned, so mu and cv are not used (nor initialised) */
    pshard_status_t status;
    char error[PSHARD_ERRLEN];
    bool submitted;  /* counted in comm->in_flight */
    ps_qnode_t node; /* in its backend's queue */
};

/* A backend runs operations one at a time, in order, on its own thread, and reports each
 * completion with coll_complete(). */
typedef struct {
    const char *name;
    /* Connects the backend (cfg already validated). Returns PSHARD_OK or an error with err. */
    pshard_status_t (*connect)(pshard_comm_t *comm, const pshard_comm_config_t *cfg, char *err,
                               size_t errlen);
    /* Hands a queued request to the backend (called with comm->mu NOT held). The backend
     * completes it later with coll_complete. */
    void (*submit)(pshard_comm_t *comm, pshard_coll_req_t *req);
    /* Makes every in-flight and queued request fail promptly (any thread). */
    void (*abort)(pshard_comm_t *comm);
    /* Stops threads and frees backend state; everything submitted has completed. */
    void (*destroy)(pshard_comm_t *comm);
    /* Optional: whether op runs in the caller's thread (run_here) instead of on the backend's
     * thread; blocking when the caller waits for it at once (pshard_coll_run): the backend
     * must say no otherwise, since run_here waits for the other ranks. run_here is called with
     * nothing else of the communicator in flight, and no other operation starts until it
     * returns (coll_wait_here); it returns the operation's status with its message in err. */
    bool (*here)(const pshard_comm_t *comm, const coll_op_t *op, bool blocking);
    pshard_status_t (*run_here)(pshard_comm_t *comm, coll_op_t *op, char *err, size_t errlen);
    /* Optional: whether the communicator's operations can be diverted
     * (pshard_comm_divert_next); NULL: no. */
    bool (*divertible)(const pshard_comm_t *comm);
    /* What pshard_comm_transport says (NULL: the backend's name). */
    const char *(*transport)(const pshard_comm_t *comm);
    /* Takes send / recv in pieces (pshard_coll_seg_t). */
    bool pieces;
    /* Has the bitwise reductions (band, bor, bxor); NCCL has none. */
    bool bitwise;
    /* Buffers are host memory: an operation of a one-rank communicator is then a local copy,
     * which coll_comm.c does in the caller's thread when nothing else is in flight. */
    bool host_buffers;
} coll_backend_t;

struct pshard_comm {
    int rank, world_size;
    char name[COLL_NAME_MAX + 1];
    uint64_t generation;
    _Atomic int64_t timeout_ms; /* operations' default (pshard_comm_set_timeout) */
    int64_t base_timeout_ms;    /* the one it was created with */
    const coll_backend_t *backend;
    bool host_mem; /* the caller's buffers are host memory (tcp, or nccl's host_buffers) */
    void *impl;    /* backend state */

    pthread_mutex_t mu;
    uint64_t next_seq;
    pshard_status_t sticky; /* first fatal error */
    char sticky_msg[1024];
    atomic_bool aborted;

    pshard_coll_record_t *records; /* flight recorder ring */
    size_t nrecords, record_cap, record_head;
    size_t in_flight;       /* requests submitted to the backend and not completed */
    bool here_busy;         /* an operation runs in a caller's thread (backend->run_here) */
    pthread_cond_t idle_cv; /* in_flight reached 0, or here_busy was cleared */
    uint64_t divert_check;  /* nonzero: the next operation started is divertible */
    /* nccl with host buffers: the bytes its engine copied from the callers' host memory to the
     * device and back (pshard_comm_host_staged). */
    atomic_uint_least64_t staged_to_device, staged_to_host;
};

/* op's deadline. An operation run in the caller's thread reads the clock only once it has
 * to wait for another rank (the slots' spin does so after a few dozen rounds), so one that
 * never waits reads none: two clock reads were a tenth of an 8-byte all-reduce. */
static inline int64_t coll_op_deadline(coll_op_t *op)
{
    if (op->start_ns == 0) {
        op->start_ns = ps_now_ns();
        op->deadline_ns = op->start_ns + op->timeout_ns;
    }
    return op->deadline_ns;
}

/* Starts a descriptor-only operation on a tcp communicator: the ranks exchange and compare
 * `desc` (its seq is replaced by this communicator's next sequence number) exactly as a real
 * operation would, so a mismatch fails with PSHARD_ERR_DESYNC everywhere, but no data moves.
 * The nccl backend runs one before each NCCL call. label as in pshard_coll_args_t. */
pshard_status_t coll_start_check(pshard_comm_t *comm, const coll_desc_t *desc, const char *label,
                                 int64_t timeout_ms, pshard_coll_req_t **req, char *err,
                                 size_t errlen);

/* Completes a request (from the backend's thread): records the outcome in the flight recorder,
 * makes fatal errors sticky, and wakes waiters. status PSHARD_OK or an error with message. */
void coll_complete(pshard_coll_req_t *req, pshard_status_t status, const char *msg);

/* The backend's thread, before it starts a request: waits while an operation runs in a
 * caller's thread (backend->run_here), which was issued before it. */
void coll_wait_here(pshard_comm_t *comm);

/* Marks the communicator failed (first error wins) without completing anything. */
void coll_set_sticky(pshard_comm_t *comm, pshard_status_t status, const char *msg);

/* Records that the running op is blocked on `rank` (-1 when not blocked). Thread-safe. */
void coll_record_waiting(pshard_comm_t *comm, const coll_op_t *op, int rank);

extern const coll_backend_t coll_tcp_backend;
#ifdef PSHARD_HAVE_NCCL
extern const coll_backend_t coll_nccl_backend;
#endif

#endif
