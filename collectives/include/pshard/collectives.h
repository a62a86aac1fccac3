/* pshard collectives: one API for all-gather, reduce-scatter, all-reduce, broadcast and
 * barrier over a communicator of N ranks, with a CPU backend over TCP ("tcp": pipelined ring
 * algorithms, one poll(2) engine thread per communicator) and a GPU backend ("nccl", built when
 * CUDA and NCCL are found).
 *
 * Every operation carries a descriptor (op, sequence number, dtype, reduction, counts, root,
 * caller tag). Ranks compare descriptors before moving data: a mismatch fails the operation on
 * every rank with PSHARD_ERR_DESYNC and a message naming both ranks and both descriptors.
 * Operations time out (per communicator, default 10 minutes, per-op override) with
 * PSHARD_ERR_TIMEOUT naming the peer that did not answer; pshard_comm_abort() from any thread
 * releases every waiter with PSHARD_ERR_ABORTED. After a desync, timeout, lost peer or abort
 * the communicator is unusable (every later call fails with the first error); make a new one
 * for the next generation. */
#ifndef PSHARD_COLLECTIVES_H
#define PSHARD_COLLECTIVES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pshard/dtype.h"
#include "pshard/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pshard_comm pshard_comm_t;
typedef struct pshard_coll_req pshard_coll_req_t;

typedef enum {
    PSHARD_COLL_ALL_GATHER = 1,
    PSHARD_COLL_REDUCE_SCATTER = 2,
    PSHARD_COLL_ALL_REDUCE = 3,
    PSHARD_COLL_BROADCAST = 4,
    PSHARD_COLL_BARRIER = 5,
    PSHARD_COLL_REDUCE = 6,  /* to a root */
    PSHARD_COLL_GATHER = 7,  /* to a root */
    PSHARD_COLL_SCATTER = 8, /* from a root */
    PSHARD_COLL_ALL_TO_ALL = 9,
} pshard_coll_op_t;

/* Reductions (pshard_reduce_t, types.h): floating types reduce in fp32 (half types widened,
 * rounded once at the end), int64 in int64 (sums and products wrap modulo 2^64). MIN and MAX
 * propagate NaN as torch does. The bitwise ones are for int64 only. */

/* "sum", "avg", "product", "min", "max", "band", "bor", "bxor", or "unknown". */
const char *pshard_reduce_name(pshard_reduce_t reduce);

/* Whether reduce is defined for dtype (NULL: yes); else why not, e.g. "band is for int64
 * only". */
const char *pshard_reduce_problem(pshard_reduce_t reduce, pshard_dtype_t dtype);

/* Writes one element of dtype that leaves any value unchanged under reduce (0 for sum, avg,
 * bor and bxor; 1 for product; +Inf / the largest int64 for min; -Inf / the smallest for max;
 * all bits set for band): what a rank with nothing to contribute (a joined rank) sends. Returns
 * 0, or -1 when pshard_reduce_problem says no. */
int pshard_reduce_identity(pshard_reduce_t reduce, pshard_dtype_t dtype, void *out);

/* A piece of a buffer given in pieces (pshard_coll_args_t's send_segs / recv_segs). */
typedef struct {
    void *ptr;    /* host memory; NULL only for an empty piece */
    size_t count; /* elements */
} pshard_coll_seg_t;

#define PSHARD_COLL_MAX_SEGS 65536

/* One collective. Buffers are host memory for "tcp" and device memory for "nccl".
 *  all_gather:     send holds counts[rank] elements; recv receives sum(counts), rank-major.
 *                  In place when send == recv + offset of this rank's block.
 *  reduce_scatter: send holds sum(counts) elements, rank-major; recv receives this rank's
 *                  counts[rank] reduced elements.
 *  all_reduce:     send and recv hold `count` elements (may be the same buffer).
 *  broadcast:      root's send goes to every rank's recv (`count` elements; root may pass
 *                  send == recv).
 *  barrier:        no buffers.
 *  reduce:         like all_reduce, but only root's recv receives the result (the others may
 *                  pass recv = NULL).
 *  gather:         like all_gather, but only root's recv receives the blocks.
 *  scatter:        root's send holds sum(counts) elements, rank-major; every rank's recv
 *                  receives its counts[rank] (other ranks may pass send = NULL).
 *                  reduce, gather and scatter run as all_reduce, all_gather and broadcast into
 *                  a temporary buffer on the ranks whose recv does not take the whole result
 *                  (ring cost of those operations; memory of the whole result on those ranks);
 *                  they take whole buffers (not pieces); on the nccl backend they need
 *                  host_buffers (host memory, staged by the backend), not device buffers.
 *                  Their descriptors name the operation and root, so a rank running another
 *                  operation or root fails with PSHARD_ERR_DESYNC as for the others.
 *  all_to_all:     send holds world_size blocks of `count` elements, block k for rank k; recv
 *                  receives world_size blocks, block k from rank k (torch's
 *                  all_to_all_single with equal splits; per-rank counts are refused). It runs
 *                  as an all_gather of every rank's whole send into a temporary buffer of
 *                  world_size^2 * count elements on every rank, from which each takes its
 *                  blocks: world_size times the data of a direct exchange, for small tensors.
 * counts == NULL means every rank has `count` elements (all_gather, reduce_scatter, gather,
 * scatter); otherwise
 * counts[0..world_size) gives each rank's count (zeros allowed) and `count` is ignored.
 * Sums of bf16/fp16 accumulate in fp32 and round once at the end (round to nearest even). */
typedef struct {
    pshard_coll_op_t op;
    pshard_dtype_t dtype;
    pshard_reduce_t reduce; /* reduce_scatter, all_reduce */
    int root;               /* broadcast */
    const void *send;
    void *recv;
    size_t count;
    const size_t *counts; /* borrowed until the operation completes */
    uint64_t tag;         /* caller's tag, e.g. (step << 32 | parameter id); compared */
    int64_t timeout_ms;   /* 0: the communicator's default */
    const char *label;    /* optional text for the flight recorder ("step 12, fc3.weight");
                             copied; not compared */
    bool send_device;     /* on a host_buffers communicator (nccl): send / recv is device
                             memory after all, used as is (not staged). Refused on tcp */
    bool recv_device;
    /* Optional, "tcp" only: send or recv given as pieces laid end to end instead of one range
     * (e.g. the full buffers of several tensors, so that gathering them is one operation).
     * The operation reads or writes the buffer the pieces make, in order: their counts add up
     * to what send or recv holds above (all_gather send: this rank's count, recv: the total;
     * reduce_scatter the other way round; all_reduce and broadcast: count). At most
     * PSHARD_COLL_MAX_SEGS pieces; copied by pshard_coll_start; send / recv are then ignored.
     * Pieces must not overlap each other or the other buffer. */
    const pshard_coll_seg_t *send_segs;
    size_t n_send_segs;
    const pshard_coll_seg_t *recv_segs;
    size_t n_recv_segs;
} pshard_coll_args_t;

typedef struct {
    int rank;            /* 0..world_size-1 */
    int world_size;      /* >= 1 */
    const char *backend; /* "tcp" (default) or "nccl" */
    const char *name;    /* communicator name, part of store keys (default "default") */
    /* Bootstrap, one of: */
    const char *const *peers;    /* explicit data-plane addresses "host:port", one per rank; this
                                    rank listens on peers[rank] */
    const char *coordinator;     /* else: coordinator "host:port"; each rank publishes its
                                    address under a generation-scoped store key and waits for the
                                    others */
    const char *job;             /* with coordinator: the job its store keys belong to (NULL:
                                    the coordinator's default job) */
    const char *listen_host;     /* with coordinator: interface to listen on (default 127.0.0.1);
                                    port chosen by the kernel */
    const char *advertise_host;  /* host peers dial (default listen_host) */
    const char *socket_ifname;   /* with coordinator: listen on (and advertise) the IPv4 address
                                    of this network interface, e.g. "eth0" (a comma list: the
                                    first that has one), as GLOO_SOCKET_IFNAME; NULL: the
                                    environment's PSHARD_SOCKET_IFNAME; either wins over
                                    listen_host / advertise_host */
    const char *token;           /* cluster token: authenticates the handshake (HMAC challenge,
                                    never sent in clear) and the store calls; NULL = empty key */
    uint64_t generation;         /* cluster generation, stamped into handshakes and store keys */
    int64_t timeout_ms;          /* default per-operation timeout; 0 = 600000 (10 min) */
    int64_t connect_timeout_ms;  /* bootstrap and handshakes; 0 = 60000 */
    int device;                  /* nccl: CUDA device ordinal */
    bool host_buffers;           /* nccl: the caller's buffers are host memory; the backend copies
                                    them to and from device buffers it owns (grown to the largest
                                    operation, then reused). Pinned memory (pshard_host_pin) copies
                                    faster. tcp: buffers are host memory anyway; ignored */
    const volatile int *cancel;  /* optional: when *cancel becomes non-zero, a connect in
                                    progress gives up with PSHARD_ERR_CANCELLED within ~200 ms */
    size_t flight_recorder_size; /* descriptors kept for status output; 0 = 64 */
    const char *transport;       /* tcp: "auto" (the same-host transport when every rank can
                                    read every other's memory, else the sockets), "tcp" or
                                    "shm" (or a set-up error saying why not); NULL: the
                                    environment's PSHARD_TRANSPORT, else auto */
} pshard_comm_config_t;

/* The IPv4 address (dotted) of the first interface in names ("eth0" or "eth0,ib0") that has
 * one, into out (16 bytes suffice): what socket_ifname / PSHARD_SOCKET_IFNAME resolve to.
 * INVALID_ARGUMENT naming what was asked and which interfaces have an address. */
pshard_status_t pshard_socket_ifname_address(const char *names, char *out, size_t outlen, char *err,
                                             size_t errlen);

/* Creates a communicator and connects it (blocks until every rank has joined or the connect
 * timeout passes). Errors: INVALID_ARGUMENT (bad config), TIMEOUT (a peer never came; the
 * message names it), PERMISSION (a handshake was refused), UNIMPLEMENTED (nccl not built),
 * SYSTEM. On error *out is NULL and err holds the reason. Free with pshard_comm_destroy.
 * Thread-safe with respect to other communicators. */
pshard_status_t pshard_comm_create(const pshard_comm_config_t *cfg, pshard_comm_t **out, char *err,
                                   size_t errlen);

/* Aborts (if anything is in flight) and frees. NULL is a no-op. Not concurrently with other
 * calls on the same communicator except pshard_comm_abort. */
void pshard_comm_destroy(pshard_comm_t *comm);

int pshard_comm_rank(const pshard_comm_t *comm);
int pshard_comm_world_size(const pshard_comm_t *comm);

/* How the communicator's data moves: "tcp" (the sockets), "shm" (every rank on one host reads
 * the others' memory; PSHARD_TRANSPORT=tcp|shm|auto chooses), or "nccl". Thread-safe. */
const char *pshard_comm_transport(const pshard_comm_t *comm);

/* nccl with host buffers (pshard_comm_config_t.host_buffers): the bytes comm's operations
 * copied from the callers' host memory to the device (*to_device) and back (*to_host) so far;
 * 0 for a side a caller marked as device memory, and always 0 on tcp. Thread-safe. */
void pshard_comm_host_staged(pshard_comm_t *comm, uint64_t *to_device, uint64_t *to_host);

/* Starts an operation; operations run in issue order, several may be queued. On success *req
 * is a handle to wait on and free with pshard_coll_req_free. Errors: INVALID_ARGUMENT (bad
 * arguments, checked locally before anything moves; message in err) with *req NULL. A
 * communicator that already failed still returns a request, which completes at once with the
 * first error. Thread-safe. */
pshard_status_t pshard_coll_start(pshard_comm_t *comm, const pshard_coll_args_t *args,
                                  pshard_coll_req_t **req, char *err, size_t errlen);

/* Waits for an operation. Returns its status; on failure err (may be NULL) receives the
 * message (naming peers and descriptors where it applies). Thread-safe per request. */
pshard_status_t pshard_coll_wait(pshard_coll_req_t *req, char *err, size_t errlen);

/* Non-blocking check: *done is set when the operation finished; returns its status if done. */
pshard_status_t pshard_coll_test(pshard_coll_req_t *req, bool *done, char *err, size_t errlen);

/* Frees a finished request (waits for it first if it is still running). NULL is a no-op. */
void pshard_coll_req_free(pshard_coll_req_t *req);

/* Blocking convenience: start + wait + free. On a same-host ring ("shm") the operation runs
 * in the calling thread (after everything issued before it), with no hand-off to the engine
 * thread: the lowest latency the communicator has. Thread-safe. */
pshard_status_t pshard_coll_run(pshard_comm_t *comm, const pshard_coll_args_t *args, char *err,
                                size_t errlen);

/* Divertible operations, for a layer above that agrees on what every rank runs only when it
 * must (the shard servers skip Join's agreement round while no trainer has joined). Marks the
 * next operation this process starts on comm divertible, its descriptor also comparing check
 * (a hash of what the layer above runs). When the ranks' descriptors of an operation differ
 * and every rank's is divertible, no data moves and the operation fails on every rank with
 * PSHARD_ERR_DIVERTED, leaving the communicator usable: the layer above then agrees on what to
 * run in an explicit round. A difference involving a rank whose operation is not divertible
 * is a desync as always. The mark is taken by the next pshard_coll_start or pshard_coll_run
 * (from any thread); check 0 clears it. Returns false, marking nothing, where the
 * communicator cannot divert; every rank of a communicator answers alike. A ring through the
 * sockets can (a divertible operation then sends no data before every descriptor has come
 * round and matched), and so can a same-host ring through its shared slots; the same-host
 * transport without slots (PSHARD_SHM_SLOT_BYTES=0) and nccl cannot. Thread-safe. */
bool pshard_comm_divert_next(pshard_comm_t *comm, uint64_t check);

/* Sets the default timeout of the operations started from now on (timeout_ms 0: the one the
 * communicator was created with), e.g. a trainer's own init_process_group(timeout=...).
 * Thread-safe. */
void pshard_comm_set_timeout(pshard_comm_t *comm, int64_t timeout_ms);

/* Aborts from any thread: every in-flight and queued operation fails with PSHARD_ERR_ABORTED
 * (message includes reason) within 100 ms, and the communicator stays unusable. */
void pshard_comm_abort(pshard_comm_t *comm, const char *reason);
/* As pshard_comm_abort, but waiters (here and, through the ring, on the other ranks) fail with
 * status and exactly the message reason: for an owner that knows why the ring must stop, e.g.
 * PSHARD_ERR_PEER_LOST "rank 2's shard server was evicted". Thread-safe. */
void pshard_comm_abort_status(pshard_comm_t *comm, pshard_status_t status, const char *reason);

/* The communicator's first (sticky) error, or PSHARD_OK. */
pshard_status_t pshard_comm_error(const pshard_comm_t *comm, char *err, size_t errlen);

/* Flight recorder: the last descriptors, oldest first. */
typedef enum {
    PSHARD_COLL_QUEUED = 0,
    PSHARD_COLL_RUNNING = 1,
    PSHARD_COLL_DONE = 2,
    PSHARD_COLL_FAILED = 3,
} pshard_coll_state_t;

typedef struct {
    uint64_t seq;
    pshard_coll_op_t op;
    pshard_dtype_t dtype;
    uint64_t tag;
    uint64_t total_count; /* elements across ranks */
    pshard_coll_state_t state;
    int64_t start_ns, end_ns; /* ps_now_ns clock; end 0 while running */
    int waiting_on;           /* rank this one is blocked on while running, or was blocked on
                                 when it failed (FAILED), else -1 */
    char label[64];
    char error[160]; /* first error, for FAILED */
} pshard_coll_record_t;

/* Copies up to max records into out (oldest first); returns how many. Thread-safe. */
size_t pshard_comm_flight_records(pshard_comm_t *comm, pshard_coll_record_t *out, size_t max);

/* Formats one record as a line such as
 * "rank 2 is stuck in all_gather seq 418 (step 12, fc3.weight), waiting on rank 3 for 5.2 s". */
void pshard_coll_record_format(const pshard_comm_t *comm, const pshard_coll_record_t *rec,
                               char *buf, size_t len);

const char *pshard_coll_op_name(pshard_coll_op_t op);

/* CUDA helpers for owners of host buffers used with the nccl backend (host_buffers). All
 * return PSHARD_ERR_UNIMPLEMENTED with a message when pshard was built without CUDA/NCCL.
 * pshard_nccl_load: loads NCCL and the CUDA runtime, which pshard opens at run time (dlopen)
 * on first use rather than linking them, so that a program checks for them at start; the nccl
 * backend's connect does the same. Errors: PSHARD_ERR_CUDA or PSHARD_ERR_NCCL with a message
 * naming the missing library (libcudart.so.<major>, libnccl.so.<major>) and the package that
 * provides it; $PSHARD_CUDART_LIBRARY / $PSHARD_NCCL_LIBRARY, when set, name the only file
 * tried (tests use them to stand for a machine without the library).
 * pshard_cuda_check_device: PSHARD_OK when device is a usable CUDA device ordinal, else
 * PSHARD_ERR_CUDA naming what is missing (no driver, no device, ordinal out of range), so a
 * program can refuse at start instead of failing later.
 * pshard_host_pin: page-locks [p, p + bytes) (cudaHostRegister, portable to every device) so
 * that copies to and from the device run by DMA; pshard_host_unpin undoes it (before the
 * memory is unmapped or freed). Both make `device` the calling thread's current device, so
 * that no context is created on another GPU. Thread-safe. */
pshard_status_t pshard_nccl_load(char *err, size_t errlen);
pshard_status_t pshard_cuda_check_device(int device, char *err, size_t errlen);
pshard_status_t pshard_host_pin(int device, void *p, size_t bytes, char *err, size_t errlen);
void pshard_host_unpin(int device, void *p);

#ifdef __cplusplus
}
#endif
#endif
