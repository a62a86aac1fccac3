/* The nccl backend: the collectives of collectives.h on CUDA device buffers through NCCL. Each
 * communicator owns a non-blocking NCCL communicator, a dedicated non-blocking CUDA stream, one
 * engine thread that makes every NCCL call and stream query after connect, and an inner "tcp"
 * communicator named "<name>-ctl" as its control path. The control path carries the NCCL
 * unique id at connect and, before every NCCL call, a descriptor check, so ranks that disagree
 * fail with PSHARD_ERR_DESYNC before NCCL could hang or corrupt memory on mismatched calls.
 *
 * Buffer contract: inputs must be complete on the device when pshard_coll_start is called (the
 * engine's stream is non-blocking, so it does not wait for work on the caller's streams, not
 * even the legacy default stream); when a request completes successfully its outputs are
 * complete on the device.
 *
 * Precision: NCCL reduces bf16 and fp16 in the element type at every step of its ring or tree
 * (each partial sum is rounded back to 16 bits, in an order that depends on the algorithm and
 * topology), whereas the tcp backend accumulates in fp32 and rounds once. bf16/fp16 sums and
 * averages from this backend may therefore differ in the last bits from tcp's, and between
 * world sizes or machines. fp32 differs only by summation order; int64 sums are exact.
 *
 * Host buffers (pshard_comm_config_t.host_buffers): the engine copies the input to a device
 * buffer it owns on its stream before the NCCL call, waits for NCCL to finish (abortable, as
 * always), then copies the output back and waits for that copy; the device buffers grow to the
 * largest operation and are reused. Only then does the request complete, so the caller's
 * buffers are never touched afterwards, and a failed operation copies nothing back.
 *
 * Loading: NCCL and the CUDA runtime are not linked in; connect and the CUDA helpers load them
 * with dlopen on first use (coll_cuda_api.h), so a missing library fails that call with a
 * message naming the library and its package, and never stops a program that does not use
 * them from starting.
 *
 * Test hook: PSHARD_NCCL_FORCE_GROUPED=1 (read at connect) makes all-gather and reduce-scatter
 * use their grouped per-rank form even when counts are equal, so a one-GPU test covers it. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coll_cuda_api.h"
#include "coll_internal.h"
#include "pshard/log.h"
#include "pshard/util.h"

#define DEFAULT_CONNECT_TIMEOUT_MS 60000
#define POLL_MIN_NS 50000LL    /* first pause while waiting on NCCL or the stream */
#define POLL_MAX_NS 200000LL   /* longest pause: bounds the latency an abort adds */
#define INIT_POLL_NS 1000000LL /* pause while NCCL initialises (it takes a second or so) */
#define GROUP_MAX_OPS 1024     /* NCCL calls per ncclGroupStart/ncclGroupEnd */
#define FINALIZE_MAX_MS 10000  /* destroy: wait this long for ncclCommFinalize, then abort */
#define ABORT_DRAIN_MS 1000    /* after ncclCommAbort: wait this long for the stream to idle */
#define CTL_SUFFIX "-ctl"
#define UNIQUE_ID_TAG 0x6e63636c2d696400ull /* "nccl-id" */

_Static_assert(NCCL_UNIQUE_ID_BYTES % 8 == 0, "the unique id travels as int64 words");

/* ---------------------------------------------------------------------------------------- */
/* Errors                                                                                    */

/* Formats a CUDA error ("what: message (cudaErrorName)") into err; returns PSHARD_ERR_CUDA. */
static pshard_status_t cuda_errf(char *err, size_t errlen, cudaError_t rc, const char *what)
{
    return ps_errf(err, errlen, PSHARD_ERR_CUDA, "%s: %s (%s)", what,
                   coll_cu.cudaGetErrorString(rc), coll_cu.cudaGetErrorName(rc));
}

/* Formats an NCCL error with NCCL's last error text into err; returns PSHARD_ERR_NCCL. */
static pshard_status_t nccl_errf(char *err, size_t errlen, ncclResult_t rc, const char *what)
{
    const char *last = coll_cu.ncclGetLastError(NULL);
    bool have_last = last && last[0];
    return ps_errf(err, errlen, PSHARD_ERR_NCCL, "%s: %s%s%s (NCCL_DEBUG=WARN tells more)", what,
                   coll_cu.ncclGetErrorString(rc), have_last ? ": " : "", have_last ? last : "");
}

/* Calls NCCL's fn (through the loaded table) with args, returning upward with a pshard status
 * and a message naming fn in err on anything but success. */
#define NCCL_CHECK(fn, args, err, errlen)                                                          \
    do {                                                                                           \
        ncclResult_t nccl_check_rc_ = coll_cu.fn args;                                             \
        if (nccl_check_rc_ != ncclSuccess)                                                         \
            return nccl_errf((err), (errlen), nccl_check_rc_, #fn);                                \
    } while (0)

/* ---------------------------------------------------------------------------------------- */
/* State                                                                                     */

typedef struct nccl_engine {
    pshard_comm_t *comm;
    pshard_comm_t *inner; /* control path: tcp communicator "<name>-ctl" */
    int device;
    int64_t connect_timeout_ms;
    bool force_grouped; /* PSHARD_NCCL_FORCE_GROUPED=1 */

    /* Used by the engine thread only once it runs (by connect before, destroy after). */
    ncclComm_t nccl; /* NULL once aborted or destroyed */
    cudaStream_t stream;
    bool stream_created;
    int32_t *scratch;  /* device memory: the barrier's one int */
    bool failed;       /* the NCCL communicator is gone; every request fails */
    bool host_buffers; /* callers pass host memory: staged through d_send / d_recv */
    void *d_send, *d_recv;
    size_t d_send_cap, d_recv_cap;

    pthread_t thread;
    bool thread_started;
    pthread_mutex_t qmu; /* guards the queue, busy, stop and inner (for abort) */
    pthread_cond_t qcv;
    ps_queue_t queue; /* pshard_coll_req_t submitted, not yet taken (qmu) */
    bool busy;        /* the engine is running a request */
    bool stop;
} nccl_engine_t;

static nccl_engine_t *engine_of(pshard_comm_t *comm)
{
    return comm->impl;
}

static void pause_ns(int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    nanosleep(&ts, NULL);
}

/* The label the caller gave (kept in the flight recorder), or "" if overwritten. */
static void op_label(pshard_comm_t *c, const coll_op_t *op, char *buf, size_t len)
{
    buf[0] = '\0';
    pthread_mutex_lock(&c->mu);
    const pshard_coll_record_t *r = &c->records[op->record_slot];
    if (r->seq == op->desc.seq)
        ps_strlcpy(buf, r->label, len);
    pthread_mutex_unlock(&c->mu);
}

/* "all_gather seq 12 (step 3 fc1.weight) on rank 2", for messages. */
static void op_describe(const nccl_engine_t *e, const coll_op_t *op, const char *label, char *buf,
                        size_t len)
{
    snprintf(buf, len, "%s seq %" PRIu64 "%s%s%s on rank %d", pshard_coll_op_name(op->args.op),
             op->desc.seq, label[0] ? " (" : "", label, label[0] ? ")" : "", e->comm->rank);
}

/* The communicator's sticky error as this request's failure (after an abort). */
static pshard_status_t sticky_error(nccl_engine_t *e, pshard_status_t fallback, char *msg,
                                    size_t len)
{
    pshard_status_t st = pshard_comm_error(e->comm, msg, len);
    if (st != PSHARD_OK)
        return st;
    return ps_errf(msg, len, fallback, "%s", "communicator aborted");
}

/* ---------------------------------------------------------------------------------------- */
/* Failure                                                                                   */

/* Aborts the NCCL communicator (which stops its kernels) and waits a little for the stream to
 * go idle, so that no NCCL kernel still writes a caller's buffer once its request completes.
 * Engine thread (or connect/destroy while no engine thread runs). */
static void abort_nccl(nccl_engine_t *e)
{
    if (!e->nccl)
        return;
    ncclResult_t rc = coll_cu.ncclCommAbort(e->nccl);
    e->nccl = NULL;
    if (rc != ncclSuccess)
        PS_WARN(PS_SUB_COLL, "ncclCommAbort on rank %d: %s", e->comm->rank,
                coll_cu.ncclGetErrorString(rc));
    if (!e->stream_created)
        return;
    int64_t until = ps_now_ns() + (int64_t)ABORT_DRAIN_MS * 1000000;
    while (coll_cu.cudaStreamQuery(e->stream) == cudaErrorNotReady) {
        if (ps_now_ns() >= until) {
            PS_WARN(PS_SUB_COLL,
                    "rank %d: the NCCL stream is still busy %d ms after ncclCommAbort; buffers "
                    "of the failed operation may still be written",
                    e->comm->rank, ABORT_DRAIN_MS);
            break;
        }
        pause_ns(POLL_MAX_NS);
    }
}

/* Makes the communicator unusable: records the first error, aborts NCCL and the control path
 * (so peers blocked in a descriptor check learn of it). log: false when the error was already
 * logged where it started (the control path logs its own failures). Engine thread. */
static void fail_comm(nccl_engine_t *e, pshard_status_t st, const char *msg, bool log)
{
    coll_set_sticky(e->comm, st, msg);
    if (e->failed)
        return;
    e->failed = true;
    if (log)
        PS_WARN(PS_SUB_COLL, "%s", msg);
    abort_nccl(e);
    if (e->inner)
        pshard_comm_abort(e->inner, msg);
}

/* Completes a request with the communicator's first error. */
static void complete_sticky(nccl_engine_t *e, pshard_coll_req_t *req)
{
    char msg[PSHARD_ERRLEN] = "";
    pshard_status_t st = sticky_error(e, PSHARD_ERR_ABORTED, msg, sizeof(msg));
    coll_complete(req, st, msg);
}

/* ---------------------------------------------------------------------------------------- */
/* Operations                                                                                */

static ncclDataType_t nccl_dtype(pshard_dtype_t dtype)
{
    switch (dtype) {
    case PSHARD_FP32:
        return ncclFloat32;
    case PSHARD_BF16:
        return ncclBfloat16;
    case PSHARD_FP16:
        return ncclFloat16;
    case PSHARD_INT64:
        return ncclInt64;
    case PSHARD_FP64:
        return ncclFloat64;
    case PSHARD_INT32:
        return ncclInt32;
    case PSHARD_UINT8:
        return ncclUint8;
    }
    return ncclFloat32; /* unreachable: prepare_op rejected other values */
}

static ncclRedOp_t nccl_redop(pshard_reduce_t reduce)
{
    switch (reduce) {
    case PSHARD_REDUCE_AVG:
        return ncclAvg;
    case PSHARD_REDUCE_PRODUCT:
        return ncclProd;
    case PSHARD_REDUCE_MIN:
        return ncclMin;
    case PSHARD_REDUCE_MAX:
        return ncclMax;
    default:
        return ncclSum; /* sum; the bitwise ones are refused before (nccl has none) */
    }
}

/* Waits until NCCL has launched what was issued (stream == false: a non-blocking communicator
 * may still be launching when ncclGroupEnd returns ncclInProgress), or until the stream has
 * finished it (stream == true). Polls with 50..200 us pauses and checks the abort flag and the
 * request's deadline between polls. Errors: NCCL, CUDA, ABORTED, TIMEOUT, with msg. */
static pshard_status_t wait_nccl(nccl_engine_t *e, pshard_coll_req_t *req, bool stream,
                                 const char *name, char *msg, size_t len)
{
    const coll_op_t *op = &req->op;
    char what[384];
    int64_t pause = POLL_MIN_NS;
    for (;;) {
        ncclResult_t state = ncclSuccess;
        ncclResult_t rc = coll_cu.ncclCommGetAsyncError(e->nccl, &state);
        if (rc != ncclSuccess) {
            snprintf(what, sizeof(what), "%s: ncclCommGetAsyncError", name);
            return nccl_errf(msg, len, rc, what);
        }
        if (state != ncclSuccess && state != ncclInProgress) {
            snprintf(what, sizeof(what), "%s: NCCL failed asynchronously", name);
            return nccl_errf(msg, len, state, what);
        }
        if (state == ncclSuccess) {
            if (!stream)
                return PSHARD_OK;
            cudaError_t q = coll_cu.cudaStreamQuery(e->stream);
            if (q == cudaSuccess)
                return PSHARD_OK;
            if (q != cudaErrorNotReady) {
                snprintf(what, sizeof(what), "%s: the NCCL stream failed", name);
                return cuda_errf(msg, len, q, what);
            }
        }
        if (atomic_load(&e->comm->aborted))
            return sticky_error(e, PSHARD_ERR_ABORTED, msg, len);
        int64_t now = ps_now_ns();
        if (now >= op->deadline_ns) {
            int64_t timeout_ms = op->args.timeout_ms ? op->args.timeout_ms : e->comm->timeout_ms;
            return ps_errf(msg, len, PSHARD_ERR_TIMEOUT,
                           "%s timed out after %.1f s %s: every rank passed the descriptor "
                           "check, so another rank stalled or died inside NCCL, or the GPU or "
                           "network hung (NCCL does not say which rank); this rank aborted its "
                           "NCCL communicator",
                           name, (double)timeout_ms / 1e3,
                           stream ? "waiting for NCCL to finish on the GPU"
                                  : "waiting for NCCL to launch");
        }
        pause_ns(pause);
        pause = pause * 2 > POLL_MAX_NS ? POLL_MAX_NS : pause * 2;
    }
}

/* True when every rank has the same count (the plain NCCL collective applies). */
static bool counts_equal(const coll_op_t *op, int n)
{
    for (int i = 1; i < n; i++) {
        if (op->counts[i] != op->counts[0])
            return false;
    }
    return true;
}

/* Issues call i of the operation (grouped: one per rank; else the only one). Sets *what to the
 * NCCL function's name for messages. Engine thread, inside a group. */
static ncclResult_t issue_one(nccl_engine_t *e, const coll_op_t *op, bool grouped, int i,
                              const char **what)
{
    const pshard_coll_args_t *a = &op->args;
    int me = e->comm->rank, n = e->comm->world_size;
    size_t es = pshard_dtype_size(a->dtype);
    ncclDataType_t dt = nccl_dtype(a->dtype);
    const char *send = a->send;
    char *recv = a->recv;
    switch (a->op) {
    case PSHARD_COLL_ALL_GATHER: {
        if (!grouped) {
            *what = "ncclAllGather";
            return coll_cu.ncclAllGather(send, recv, op->counts[0], dt, e->nccl, e->stream);
        }
        /* v-form: rank i broadcasts its block into place; a non-root passes the block as both
         * buffers, as ncclBcast does. */
        if (op->counts[i] == 0)
            return ncclSuccess;
        *what = "ncclBroadcast (all_gather block)";
        char *block = recv + op->displs[i] * es;
        return coll_cu.ncclBroadcast(i == me ? (const void *)send : block, block, op->counts[i], dt,
                                     i, e->nccl, e->stream);
    }
    case PSHARD_COLL_REDUCE_SCATTER: {
        ncclRedOp_t red = nccl_redop(a->reduce);
        if (!grouped) {
            *what = "ncclReduceScatter";
            return coll_cu.ncclReduceScatter(send, recv, op->counts[0], dt, red, e->nccl,
                                             e->stream);
        }
        /* v-form: chunk i is reduced to its owner i; recvbuff is used on the root only. */
        if (op->counts[i] == 0)
            return ncclSuccess;
        *what = "ncclReduce (reduce_scatter chunk)";
        return coll_cu.ncclReduce(send + op->displs[i] * es, recv, op->counts[i], dt, red, i,
                                  e->nccl, e->stream);
    }
    case PSHARD_COLL_ALL_REDUCE:
        *what = "ncclAllReduce";
        return coll_cu.ncclAllReduce(send, recv, op->displs[n], dt, nccl_redop(a->reduce), e->nccl,
                                     e->stream);
    case PSHARD_COLL_BROADCAST:
        *what = "ncclBroadcast";
        return coll_cu.ncclBroadcast(me == a->root ? (const void *)send : recv, recv, op->displs[n],
                                     dt, a->root, e->nccl, e->stream);
    case PSHARD_COLL_BARRIER:
        *what = "ncclAllReduce (barrier)";
        return coll_cu.ncclAllReduce(e->scratch, e->scratch, 1, ncclInt32, ncclSum, e->nccl,
                                     e->stream);
    case PSHARD_COLL_REDUCE: /* refused before (coll_comm.c): not on nccl yet */
    case PSHARD_COLL_GATHER:
    case PSHARD_COLL_SCATTER:
    case PSHARD_COLL_ALL_TO_ALL:
        break;
    }
    *what = "unknown collective";
    return ncclInvalidArgument;
}

/* Issues the operation's NCCL calls on the engine's stream, at most GROUP_MAX_OPS to a group,
 * and waits until NCCL has launched each group. Ranks agree on every count (the descriptor
 * check compared them), so skipping empty work is the same decision on every rank. */
static pshard_status_t launch(nccl_engine_t *e, pshard_coll_req_t *req, const char *name, char *msg,
                              size_t len)
{
    const coll_op_t *op = &req->op;
    int n = e->comm->world_size;
    pshard_coll_op_t kind = op->args.op;
    if (kind != PSHARD_COLL_BARRIER && op->displs[n] == 0)
        return PSHARD_OK;
    bool per_rank = kind == PSHARD_COLL_ALL_GATHER || kind == PSHARD_COLL_REDUCE_SCATTER;
    bool grouped = per_rank && (e->force_grouped || !counts_equal(op, n));
    int ncalls = grouped ? n : 1;
    char what_buf[384];
    for (int first = 0; first < ncalls; first += GROUP_MAX_OPS) {
        int last = ncalls - first > GROUP_MAX_OPS ? first + GROUP_MAX_OPS : ncalls;
        NCCL_CHECK(ncclGroupStart, (), msg, len);
        ncclResult_t rc = ncclSuccess;
        const char *what = "ncclGroupStart";
        /* A call of a non-blocking communicator may report its state, ncclInProgress, which
         * is no error; the group's outcome comes from ncclGroupEnd and the async state. */
        for (int i = first; i < last && (rc == ncclSuccess || rc == ncclInProgress); i++)
            rc = issue_one(e, op, grouped, i, &what);
        /* The group is always closed, even after an error inside it. */
        ncclResult_t end = coll_cu.ncclGroupEnd();
        if (rc != ncclSuccess && rc != ncclInProgress) {
            snprintf(what_buf, sizeof(what_buf), "%s: %s", name, what);
            return nccl_errf(msg, len, rc, what_buf);
        }
        if (end != ncclSuccess && end != ncclInProgress) {
            snprintf(what_buf, sizeof(what_buf), "%s: ncclGroupEnd after %s", name, what);
            return nccl_errf(msg, len, end, what_buf);
        }
        PS_CHECK(wait_nccl(e, req, false, name, msg, len));
    }
    return PSHARD_OK;
}

/* Runs the descriptor check on the control path: every rank must be about to run the same
 * collective (op, dtype, reduction, root, tag, counts). Blocks until it passes or fails; an
 * abort of this communicator aborts the control path too, which releases it. The control
 * path numbers its checks itself, so the seq in its messages is not the operation's. */
static pshard_status_t check_descriptor(nccl_engine_t *e, pshard_coll_req_t *req, const char *label,
                                        const char *name, char *msg, size_t len)
{
    const coll_op_t *op = &req->op;
    int64_t left_ms = (op->deadline_ns - ps_now_ns()) / 1000000;
    if (left_ms < 1)
        left_ms = 1;
    char inner_err[PSHARD_ERRLEN] = "";
    pshard_coll_req_t *check = NULL;
    pshard_status_t st = coll_start_check(e->inner, &op->desc, label[0] ? label : NULL, left_ms,
                                          &check, inner_err, sizeof(inner_err));
    if (st == PSHARD_OK) {
        st = pshard_coll_wait(check, inner_err, sizeof(inner_err));
        pshard_coll_req_free(check);
    }
    if (st == PSHARD_OK)
        return PSHARD_OK;
    if (atomic_load(&e->comm->aborted))
        return sticky_error(e, PSHARD_ERR_ABORTED, msg, len);
    return ps_errf(msg, len, st, "%s: descriptor check on the control path failed: %s", name,
                   inner_err);
}

/* Makes *buf hold at least bytes of device memory (engine thread). */
static pshard_status_t ensure_device(void **buf, size_t *cap, size_t bytes, const char *what,
                                     char *msg, size_t len)
{
    if (*cap >= bytes)
        return PSHARD_OK;
    coll_cu.cudaFree(*buf);
    *buf = NULL;
    *cap = 0;
    cudaError_t ce = coll_cu.cudaMalloc(buf, bytes);
    if (ce != cudaSuccess) {
        *buf = NULL;
        char w[128];
        snprintf(w, sizeof(w), "nccl: cudaMalloc(%zu) for the %s staging buffer", bytes, what);
        return cuda_errf(msg, len, ce, w);
    }
    *cap = bytes;
    return PSHARD_OK;
}

/* Host-buffer mode: the bytes the operation reads from send and writes to recv on this rank
 * that need staging (none for a side the caller marked as device memory). */
static void staged_sizes(const nccl_engine_t *e, const coll_op_t *op, size_t *send_bytes,
                         size_t *recv_bytes)
{
    const pshard_coll_args_t *a = &op->args;
    int me = e->comm->rank, n = e->comm->world_size;
    size_t es = pshard_dtype_size(a->dtype);
    size_t total = op->displs[n] * es;
    *send_bytes = *recv_bytes = 0;
    switch (a->op) {
    case PSHARD_COLL_ALL_GATHER:
        *send_bytes = op->counts[me] * es;
        *recv_bytes = total;
        break;
    case PSHARD_COLL_REDUCE_SCATTER:
        *send_bytes = total;
        *recv_bytes = op->counts[me] * es;
        break;
    case PSHARD_COLL_ALL_REDUCE:
        *send_bytes = *recv_bytes = total;
        break;
    case PSHARD_COLL_BROADCAST:
        *send_bytes = me == a->root ? total : 0;
        *recv_bytes = total;
        break;
    case PSHARD_COLL_BARRIER:
    case PSHARD_COLL_REDUCE: /* refused before (coll_comm.c): not on nccl yet */
    case PSHARD_COLL_GATHER:
    case PSHARD_COLL_SCATTER:
    case PSHARD_COLL_ALL_TO_ALL:
        break;
    }
    if (a->send_device)
        *send_bytes = 0;
    if (a->recv_device)
        *recv_bytes = 0;
}

/* Host-buffer mode: copies the input to the device buffers on the engine's stream and points
 * the operation at them (the NCCL calls that follow on the same stream see the copy). In-place
 * forms need nothing special: input and output are separate device buffers. */
static pshard_status_t stage_in(nccl_engine_t *e, coll_op_t *op, size_t send_bytes,
                                size_t recv_bytes, char *msg, size_t len)
{
    PS_CHECK(
        ensure_device(&e->d_send, &e->d_send_cap, send_bytes ? send_bytes : 1, "input", msg, len));
    PS_CHECK(
        ensure_device(&e->d_recv, &e->d_recv_cap, recv_bytes ? recv_bytes : 1, "output", msg, len));
    if (send_bytes > 0) {
        cudaError_t ce = coll_cu.cudaMemcpyAsync(e->d_send, op->args.send, send_bytes,
                                                 cudaMemcpyHostToDevice, e->stream);
        if (ce != cudaSuccess)
            return cuda_errf(msg, len, ce, "nccl: copying the host input to the device");
    }
    if (!op->args.send_device)
        op->args.send = e->d_send;
    if (!op->args.recv_device)
        op->args.recv = e->d_recv;
    return PSHARD_OK;
}

/* Host-buffer mode, after NCCL finished: copies the output back to recv and waits for it. */
static pshard_status_t stage_out(nccl_engine_t *e, pshard_coll_req_t *req, void *recv,
                                 size_t recv_bytes, const char *name, char *msg, size_t len)
{
    if (recv_bytes == 0)
        return PSHARD_OK;
    cudaError_t ce =
        coll_cu.cudaMemcpyAsync(recv, e->d_recv, recv_bytes, cudaMemcpyDeviceToHost, e->stream);
    if (ce != cudaSuccess)
        return cuda_errf(msg, len, ce, "nccl: copying the output back to host memory");
    return wait_nccl(e, req, true, name, msg, len);
}

/* Runs one request: descriptor check, NCCL launch, completion on the stream. Any failure is
 * fatal for the communicator and NCCL is aborted before the request completes (the caller may
 * free its buffers then). Returns the outcome; msg holds the error. Engine thread. */
static pshard_status_t run_request(nccl_engine_t *e, pshard_coll_req_t *req, char *msg, size_t len)
{
    pshard_comm_t *c = e->comm;
    coll_op_t *op = &req->op;
    if (e->failed)
        return sticky_error(e, PSHARD_ERR_ABORTED, msg, len);
    char label[sizeof(((pshard_coll_record_t *)0)->label)];
    char name[256];
    op_label(c, op, label, sizeof(label));
    op_describe(e, op, label, name, sizeof(name));
    coll_record_waiting(c, op, -1);

    /* Staged before the descriptor check: a local failure (no device memory) then fails this
     * communicator, which aborts the control path and releases the peers waiting in their
     * check, instead of leaving them inside NCCL until the timeout. */
    bool staged = e->host_buffers && !op->check_only && op->args.op != PSHARD_COLL_BARRIER;
    const void *host_send = op->args.send;
    void *host_recv = op->args.recv;
    size_t send_bytes = 0, recv_bytes = 0;
    pshard_status_t st = PSHARD_OK;
    if (staged) {
        staged_sizes(e, op, &send_bytes, &recv_bytes);
        st = stage_in(e, op, send_bytes, recv_bytes, msg, len);
        if (st == PSHARD_OK && !op->check_only)
            atomic_fetch_add_explicit(&c->staged_to_device, send_bytes, memory_order_relaxed);
    }
    bool log = true; /* the control path logs a failed descriptor check itself */
    if (st == PSHARD_OK) {
        st = check_descriptor(e, req, label, name, msg, len);
        log = st == PSHARD_OK;
    }
    if (!op->check_only && st == PSHARD_OK) {
        st = launch(e, req, name, msg, len);
        if (st == PSHARD_OK)
            st = wait_nccl(e, req, true, name, msg, len);
        if (st == PSHARD_OK && staged)
            st = stage_out(e, req, host_recv, recv_bytes, name, msg, len);
        if (st == PSHARD_OK && staged)
            atomic_fetch_add_explicit(&c->staged_to_host, recv_bytes, memory_order_relaxed);
    }
    if (staged) {
        op->args.send = host_send;
        op->args.recv = host_recv;
    }
    if (st != PSHARD_OK)
        fail_comm(e, st, msg, log);
    return st;
}

/* ---------------------------------------------------------------------------------------- */
/* The engine                                                                                */

static pshard_coll_req_t *pop_locked(nccl_engine_t *e)
{
    return PS_QUEUE_POP(&e->queue, pshard_coll_req_t, node);
}

/* Fails every queued request with the communicator's first error. */
static void fail_queued(nccl_engine_t *e)
{
    for (;;) {
        pthread_mutex_lock(&e->qmu);
        pshard_coll_req_t *r = pop_locked(e);
        pthread_mutex_unlock(&e->qmu);
        if (!r)
            return;
        complete_sticky(e, r);
    }
}

/* Releases the NCCL communicator cleanly when it is healthy (finalize, then destroy), else
 * aborts it; then the scratch buffer and the stream. On the engine thread as it exits, or on
 * the connecting thread when no engine thread was started. */
static void release_device(nccl_engine_t *e)
{
    if (e->nccl) {
        ncclResult_t rc = coll_cu.ncclCommFinalize(e->nccl);
        ncclResult_t state = rc;
        int64_t until = ps_now_ns() + (int64_t)FINALIZE_MAX_MS * 1000000;
        while (state == ncclInProgress && ps_now_ns() < until) {
            pause_ns(INIT_POLL_NS);
            if (coll_cu.ncclCommGetAsyncError(e->nccl, &state) != ncclSuccess)
                break;
        }
        if (state == ncclSuccess) {
            rc = coll_cu.ncclCommDestroy(e->nccl);
            e->nccl = NULL;
            if (rc != ncclSuccess)
                PS_WARN(PS_SUB_COLL, "ncclCommDestroy on rank %d: %s", e->comm->rank,
                        coll_cu.ncclGetErrorString(rc));
        } else {
            PS_WARN(PS_SUB_COLL, "rank %d: ncclCommFinalize did not finish (%s); aborting",
                    e->comm->rank, coll_cu.ncclGetErrorString(state));
            abort_nccl(e);
        }
    }
    if (e->scratch) {
        coll_cu.cudaFree(e->scratch);
        e->scratch = NULL;
    }
    coll_cu.cudaFree(e->d_send);
    coll_cu.cudaFree(e->d_recv);
    e->d_send = e->d_recv = NULL;
    e->d_send_cap = e->d_recv_cap = 0;
    if (e->stream_created) {
        coll_cu.cudaStreamDestroy(e->stream);
        e->stream_created = false;
    }
}

static void *engine_main(void *arg)
{
    nccl_engine_t *e = arg;
    /* The current device is per thread. */
    cudaError_t ce = coll_cu.cudaSetDevice(e->device);
    if (ce != cudaSuccess) {
        char msg[PSHARD_ERRLEN] = "";
        char what[64];
        snprintf(what, sizeof(what), "nccl engine thread: cudaSetDevice(%d)", e->device);
        fail_comm(e, cuda_errf(msg, sizeof(msg), ce, what), msg, true);
    }
    for (;;) {
        pthread_mutex_lock(&e->qmu);
        while (!e->stop && ps_queue_empty(&e->queue) &&
               (e->failed || !atomic_load(&e->comm->aborted)))
            pthread_cond_wait(&e->qcv, &e->qmu);
        bool stop = e->stop;
        pshard_coll_req_t *r = stop ? NULL : pop_locked(e);
        e->busy = r != NULL;
        pthread_mutex_unlock(&e->qmu);
        if (!e->failed && atomic_load(&e->comm->aborted)) {
            char msg[PSHARD_ERRLEN] = "";
            pshard_status_t st = sticky_error(e, PSHARD_ERR_ABORTED, msg, sizeof(msg));
            fail_comm(e, st, msg, true);
        }
        if (r) {
            char msg[PSHARD_ERRLEN] = "";
            pshard_status_t st = run_request(e, r, msg, sizeof(msg));
            /* Not busy before the waiter wakes: a destroy right after the wait must not take
             * this finished request for one in flight. */
            pthread_mutex_lock(&e->qmu);
            e->busy = false;
            pthread_mutex_unlock(&e->qmu);
            coll_complete(r, st, st == PSHARD_OK ? NULL : msg);
            continue;
        }
        if (stop)
            break;
    }
    release_device(e);
    return NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* Connect                                                                                   */

/* Creates the control path: a tcp communicator with the same ranks, bootstrap, token and
 * generation, named "<name>-ctl" (the name shortened so that the suffix fits). */
static pshard_status_t connect_control(nccl_engine_t *e, const pshard_comm_config_t *cfg, char *err,
                                       size_t errlen)
{
    char name[COLL_NAME_MAX + 1];
    size_t keep = strlen(e->comm->name);
    size_t room = COLL_NAME_MAX - (sizeof(CTL_SUFFIX) - 1);
    if (keep > room)
        keep = room;
    memcpy(name, e->comm->name, keep);
    memcpy(name + keep, CTL_SUFFIX, sizeof(CTL_SUFFIX));
    pshard_comm_config_t icfg = *cfg;
    icfg.backend = "tcp";
    icfg.name = name;
    char inner_err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = pshard_comm_create(&icfg, &e->inner, inner_err, sizeof(inner_err));
    if (rc != PSHARD_OK)
        return ps_errf(err, errlen, rc, "nccl control path (tcp communicator %s): %s", name,
                       inner_err);
    return PSHARD_OK;
}

/* Rank 0 creates the NCCL unique id and broadcasts it over the control path (128 bytes as 16
 * int64 words from root 0), so the id needs no coordinator store key of its own and reaches
 * exactly the ranks that authenticated on this communicator's ring. */
static pshard_status_t share_unique_id(nccl_engine_t *e, ncclUniqueId *id, char *err, size_t errlen)
{
    union {
        ncclUniqueId id;
        int64_t words[NCCL_UNIQUE_ID_BYTES / 8];
    } u;
    memset(&u, 0, sizeof(u));
    if (e->comm->rank == 0)
        NCCL_CHECK(ncclGetUniqueId, (&u.id), err, errlen);
    pshard_coll_args_t a = {
        .op = PSHARD_COLL_BROADCAST,
        .dtype = PSHARD_INT64,
        .root = 0,
        .send = u.words,
        .recv = u.words,
        .count = NCCL_UNIQUE_ID_BYTES / 8,
        .tag = UNIQUE_ID_TAG,
        .timeout_ms = e->connect_timeout_ms,
        .label = "nccl unique id",
    };
    char inner_err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = pshard_coll_run(e->inner, &a, inner_err, sizeof(inner_err));
    if (rc != PSHARD_OK)
        return ps_errf(err, errlen, rc, "sharing the NCCL unique id over the control path: %s",
                       inner_err);
    *id = u.id;
    return PSHARD_OK;
}

/* Creates the non-blocking NCCL communicator and polls until it is ready, failed, or the
 * connect timeout passed (then it is aborted). */
static pshard_status_t init_nccl(nccl_engine_t *e, ncclUniqueId id, char *err, size_t errlen)
{
    int rank = e->comm->rank, n = e->comm->world_size;
    char what[128];
    snprintf(what, sizeof(what), "ncclCommInitRankConfig (rank %d of %d, device %d)", rank, n,
             e->device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t rc = coll_cu.ncclCommInitRankConfig(&e->nccl, n, id, rank, &config);
    if (rc != ncclSuccess && rc != ncclInProgress) {
        pshard_status_t st = nccl_errf(err, errlen, rc, what);
        abort_nccl(e);
        return st;
    }
    int64_t deadline = ps_now_ns() + e->connect_timeout_ms * 1000000;
    for (;;) {
        ncclResult_t state = ncclInProgress;
        rc = coll_cu.ncclCommGetAsyncError(e->nccl, &state);
        if (rc != ncclSuccess)
            state = rc;
        if (state == ncclSuccess)
            return PSHARD_OK;
        if (state != ncclInProgress) {
            pshard_status_t st = nccl_errf(err, errlen, state, what);
            abort_nccl(e);
            return st;
        }
        if (ps_now_ns() >= deadline) {
            abort_nccl(e);
            return ps_errf(err, errlen, PSHARD_ERR_TIMEOUT,
                           "%s did not finish within %" PRId64 " ms: another rank failed or "
                           "never called it, or the ranks cannot reach each other "
                           "(NCCL_DEBUG=INFO tells more)",
                           what, e->connect_timeout_ms);
        }
        pause_ns(INIT_POLL_NS);
    }
}

static void nccl_destroy(pshard_comm_t *comm);

/* Sets the calling thread's current device to cfg->device (and leaves it so), creates the
 * stream and scratch buffer, the control path, shares the unique id, initialises NCCL, and
 * starts the engine thread. Local problems are found before any rank waits on this one. */
static pshard_status_t nccl_connect(pshard_comm_t *comm, const pshard_comm_config_t *cfg, char *err,
                                    size_t errlen)
{
    /* NCCL and the CUDA runtime are loaded here, on first use, not when the program starts. */
    PS_CHECK(coll_nccl_load(err, errlen));
    nccl_engine_t *e = calloc(1, sizeof(*e));
    if (!e)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    e->comm = comm;
    e->device = cfg->device;
    e->connect_timeout_ms =
        cfg->connect_timeout_ms ? cfg->connect_timeout_ms : DEFAULT_CONNECT_TIMEOUT_MS;
    const char *force = getenv("PSHARD_NCCL_FORCE_GROUPED");
    e->force_grouped = force && strcmp(force, "1") == 0;
    e->host_buffers = cfg->host_buffers;
    pthread_mutex_init(&e->qmu, NULL);
    pthread_cond_init(&e->qcv, NULL);
    comm->impl = e;

    pshard_status_t rc = PSHARD_OK;
    char what[96];
    cudaError_t ce;
    if (cfg->device < 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "nccl: device is %d; it must be a CUDA device ordinal", cfg->device);
        goto fail;
    }
    if (cfg->connect_timeout_ms < 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "connect_timeout_ms is negative");
        goto fail;
    }
    ce = coll_cu.cudaSetDevice(cfg->device);
    if (ce != cudaSuccess) {
        snprintf(what, sizeof(what), "nccl: cudaSetDevice(%d)", cfg->device);
        rc = cuda_errf(err, errlen, ce, what);
        goto fail;
    }
    ce = coll_cu.cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking);
    if (ce != cudaSuccess) {
        rc = cuda_errf(err, errlen, ce, "nccl: cudaStreamCreateWithFlags");
        goto fail;
    }
    e->stream_created = true;
    ce = coll_cu.cudaMalloc((void **)&e->scratch, sizeof(int32_t));
    if (ce != cudaSuccess) {
        rc = cuda_errf(err, errlen, ce, "nccl: cudaMalloc (barrier scratch)");
        goto fail;
    }
    /* Ordered before every later NCCL call on the same stream; nothing to wait for here. */
    ce = coll_cu.cudaMemsetAsync(e->scratch, 0, sizeof(int32_t), e->stream);
    if (ce != cudaSuccess) {
        rc = cuda_errf(err, errlen, ce, "nccl: cudaMemsetAsync (barrier scratch)");
        goto fail;
    }
    PS_CHECK_GOTO(connect_control(e, cfg, err, errlen), rc, fail);
    ncclUniqueId id;
    PS_CHECK_GOTO(share_unique_id(e, &id, err, errlen), rc, fail);
    PS_CHECK_GOTO(init_nccl(e, id, err, errlen), rc, fail);
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "nccl: cannot start the engine thread");
        goto fail;
    }
    e->thread_started = true;
    PS_INFO(PS_SUB_COLL, "nccl communicator %s: rank %d of %d on device %d", comm->name, comm->rank,
            comm->world_size, e->device);
    return PSHARD_OK;
fail:
    nccl_destroy(comm);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Backend entry points                                                                      */

static void nccl_submit(pshard_comm_t *comm, pshard_coll_req_t *req)
{
    nccl_engine_t *e = engine_of(comm);
    pthread_mutex_lock(&e->qmu);
    ps_queue_push(&e->queue, &req->node);
    pthread_cond_signal(&e->qcv);
    pthread_mutex_unlock(&e->qmu);
}

/* Any thread. Makes no NCCL call: it aborts the control path (which releases a descriptor
 * check in progress) and wakes the engine, which aborts NCCL within one poll pause. */
static void nccl_abort(pshard_comm_t *comm)
{
    nccl_engine_t *e = engine_of(comm);
    char msg[PSHARD_ERRLEN] = "";
    if (pshard_comm_error(comm, msg, sizeof(msg)) == PSHARD_OK)
        ps_strlcpy(msg, "communicator aborted", sizeof(msg));
    pthread_mutex_lock(&e->qmu);
    if (e->inner)
        pshard_comm_abort(e->inner, msg);
    pthread_cond_broadcast(&e->qcv);
    pthread_mutex_unlock(&e->qmu);
}

static void nccl_destroy(pshard_comm_t *comm)
{
    nccl_engine_t *e = engine_of(comm);
    if (!e)
        return;
    if (e->thread_started) {
        pthread_mutex_lock(&e->qmu);
        bool pending = !ps_queue_empty(&e->queue) || e->busy;
        pthread_mutex_unlock(&e->qmu);
        if (pending) {
            /* Anything still queued or running fails rather than hangs. */
            coll_set_sticky(comm, PSHARD_ERR_ABORTED, "communicator destroyed");
            atomic_store(&comm->aborted, true);
            nccl_abort(comm);
        }
        pthread_mutex_lock(&e->qmu);
        e->stop = true;
        pthread_cond_broadcast(&e->qcv);
        pthread_mutex_unlock(&e->qmu);
        pthread_join(e->thread, NULL);
        fail_queued(e);
    } else {
        release_device(e);
    }
    pthread_mutex_lock(&e->qmu);
    pshard_comm_t *inner = e->inner;
    e->inner = NULL;
    pthread_mutex_unlock(&e->qmu);
    pshard_comm_destroy(inner);
    pthread_cond_destroy(&e->qcv);
    pthread_mutex_destroy(&e->qmu);
    free(e);
    comm->impl = NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* CUDA helpers of collectives.h                                                             */

pshard_status_t pshard_nccl_load(char *err, size_t errlen)
{
    return coll_nccl_load(err, errlen);
}

pshard_status_t pshard_cuda_check_device(int device, char *err, size_t errlen)
{
    PS_CHECK(coll_cudart_load(err, errlen));
    int n = 0;
    cudaError_t ce = coll_cu.cudaGetDeviceCount(&n);
    if (ce != cudaSuccess)
        return cuda_errf(err, errlen, ce, "no usable CUDA device: cudaGetDeviceCount");
    if (device < 0 || device >= n)
        return ps_errf(err, errlen, PSHARD_ERR_CUDA,
                       "CUDA device %d does not exist: this machine has %d (0..%d)", device, n,
                       n - 1);
    return PSHARD_OK;
}

pshard_status_t pshard_host_pin(int device, void *p, size_t bytes, char *err, size_t errlen)
{
    if (!p || bytes == 0)
        return PSHARD_OK;
    PS_CHECK(coll_cudart_load(err, errlen));
    cudaError_t ce = coll_cu.cudaSetDevice(device);
    if (ce != cudaSuccess) {
        char what[64];
        snprintf(what, sizeof(what), "cudaSetDevice(%d)", device);
        return cuda_errf(err, errlen, ce, what);
    }
    ce = coll_cu.cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (ce != cudaSuccess) {
        char what[96];
        snprintf(what, sizeof(what), "cudaHostRegister(%zu bytes)", bytes);
        return cuda_errf(err, errlen, ce, what);
    }
    return PSHARD_OK;
}

void pshard_host_unpin(int device, void *p)
{
    char err[PSHARD_ERRLEN];
    /* Loaded already when p was pinned; the check keeps a stray call from a NULL pointer. */
    if (p && coll_cudart_load(err, sizeof(err)) == PSHARD_OK &&
        coll_cu.cudaSetDevice(device) == cudaSuccess)
        coll_cu.cudaHostUnregister(p);
}

const coll_backend_t coll_nccl_backend = {
    .name = "nccl",
    .connect = nccl_connect,
    .submit = nccl_submit,
    .abort = nccl_abort,
    .destroy = nccl_destroy,
};
