/* The backend-independent half of the collectives: configuration and argument checks,
 * descriptors, requests and their completion, the sticky first error, and the flight recorder
 * that status output reads ("rank 2 is stuck in all_gather seq 418, waiting on rank 3"). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll_internal.h"
#include "pshard/log.h"
#include "pshard/util.h"

#define DEFAULT_TIMEOUT_MS 600000
#define DEFAULT_RECORDS 64

static bool printable_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > COLL_NAME_MAX)
        return false;
    for (size_t i = 0; i < n; i++) {
        if (s[i] <= ' ' || s[i] > '~')
            return false;
    }
    return true;
}

pshard_status_t pshard_comm_create(const pshard_comm_config_t *cfg, pshard_comm_t **out, char *err,
                                   size_t errlen)
{
    *out = NULL;
    if (cfg->world_size < 1 || cfg->world_size > 65536)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "world_size is %d; it must be 1..65536", cfg->world_size);
    if (cfg->rank < 0 || cfg->rank >= cfg->world_size)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "rank is %d; it must be 0..%d",
                       cfg->rank, cfg->world_size - 1);
    const char *name = cfg->name ? cfg->name : "default";
    if (!printable_name(name))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "communicator name must be 1..%d printable characters without spaces",
                       COLL_NAME_MAX);
    if (cfg->world_size > 1 && !cfg->peers && !cfg->coordinator)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "a communicator of %d ranks needs peers or a coordinator to bootstrap",
                       cfg->world_size);
    if (cfg->timeout_ms < 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "timeout_ms is negative");
    const coll_backend_t *backend = NULL;
    const char *bname = cfg->backend ? cfg->backend : "tcp";
    if (strcmp(bname, "tcp") == 0) {
        backend = &coll_tcp_backend;
    } else if (strcmp(bname, "nccl") == 0) {
#ifdef PSHARD_HAVE_NCCL
        backend = &coll_nccl_backend;
#else
        return ps_errf(err, errlen, PSHARD_ERR_UNIMPLEMENTED,
                       "backend nccl: this pshard was built without CUDA/NCCL");
#endif
    } else {
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "unknown backend '%s' (tcp or nccl)", bname);
    }

    pshard_comm_t *c = calloc(1, sizeof(*c));
    if (!c)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    c->rank = cfg->rank;
    c->world_size = cfg->world_size;
    ps_strlcpy(c->name, name, sizeof(c->name));
    c->generation = cfg->generation;
    c->base_timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : DEFAULT_TIMEOUT_MS;
    atomic_store(&c->timeout_ms, c->base_timeout_ms);
    c->backend = backend;
    c->host_mem = backend->host_buffers || cfg->host_buffers;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->idle_cv, NULL);
    atomic_init(&c->aborted, false);
    c->record_cap = cfg->flight_recorder_size ? cfg->flight_recorder_size : DEFAULT_RECORDS;
    c->records = calloc(c->record_cap, sizeof(*c->records));
    if (!c->records) {
        pthread_cond_destroy(&c->idle_cv);
        pthread_mutex_destroy(&c->mu);
        free(c);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    pshard_status_t rc = backend->connect(c, cfg, err, errlen);
    if (rc != PSHARD_OK) {
        free(c->records);
        pthread_cond_destroy(&c->idle_cv);
        pthread_mutex_destroy(&c->mu);
        free(c);
        return rc;
    }
    *out = c;
    return PSHARD_OK;
}

void pshard_comm_destroy(pshard_comm_t *comm)
{
    if (!comm)
        return;
    comm->backend->destroy(comm);
    free(comm->records);
    pthread_cond_destroy(&comm->idle_cv);
    pthread_mutex_destroy(&comm->mu);
    free(comm);
}

int pshard_comm_rank(const pshard_comm_t *comm)
{
    return comm->rank;
}

void pshard_comm_host_staged(pshard_comm_t *comm, uint64_t *to_device, uint64_t *to_host)
{
    *to_device = atomic_load_explicit(&comm->staged_to_device, memory_order_relaxed);
    *to_host = atomic_load_explicit(&comm->staged_to_host, memory_order_relaxed);
}

const char *pshard_comm_transport(const pshard_comm_t *comm)
{
    return comm->backend->transport ? comm->backend->transport(comm) : comm->backend->name;
}

int pshard_comm_world_size(const pshard_comm_t *comm)
{
    return comm->world_size;
}

bool pshard_comm_divert_next(pshard_comm_t *comm, uint64_t check)
{
    bool can = comm->backend->divertible && comm->backend->divertible(comm);
    pthread_mutex_lock(&comm->mu);
    comm->divert_check = can ? check : 0;
    pthread_mutex_unlock(&comm->mu);
    return can;
}

void coll_set_sticky(pshard_comm_t *comm, pshard_status_t status, const char *msg)
{
    pthread_mutex_lock(&comm->mu);
    if (comm->sticky == PSHARD_OK) {
        comm->sticky = status;
        ps_strlcpy(comm->sticky_msg, msg ? msg : pshard_status_str(status),
                   sizeof(comm->sticky_msg));
    }
    pthread_mutex_unlock(&comm->mu);
}

pshard_status_t pshard_comm_error(const pshard_comm_t *comm, char *err, size_t errlen)
{
    pshard_comm_t *c = (pshard_comm_t *)comm;
    pthread_mutex_lock(&c->mu);
    pshard_status_t st = c->sticky;
    if (st != PSHARD_OK)
        ps_errf(err, errlen, st, "%s", c->sticky_msg);
    pthread_mutex_unlock(&c->mu);
    return st;
}

void pshard_comm_set_timeout(pshard_comm_t *comm, int64_t timeout_ms)
{
    atomic_store(&comm->timeout_ms, timeout_ms > 0 ? timeout_ms : comm->base_timeout_ms);
}

void pshard_comm_abort(pshard_comm_t *comm, const char *reason)
{
    char msg[PSHARD_ERRLEN];
    snprintf(msg, sizeof(msg), "communicator aborted on rank %d: %s", comm->rank,
             reason ? reason : "no reason given");
    coll_set_sticky(comm, PSHARD_ERR_ABORTED, msg);
    atomic_store(&comm->aborted, true);
    comm->backend->abort(comm);
}

void pshard_comm_abort_status(pshard_comm_t *comm, pshard_status_t status, const char *reason)
{
    coll_set_sticky(comm, status == PSHARD_OK ? PSHARD_ERR_ABORTED : status,
                    reason ? reason : "aborted");
    atomic_store(&comm->aborted, true);
    comm->backend->abort(comm);
}

/* Frees what prepare_op allocated. */
static void coll_op_free(coll_op_t *op)
{
    if (op->counts != op->inline_counts)
        free(op->counts);
    if (op->displs != op->inline_displs)
        free(op->displs);
    coll_buf_free(&op->sbuf);
    coll_buf_free(&op->rbuf);
    free(op->temp);
}

/* reduce, gather, scatter and all_to_all: the operation the engines run instead (all_reduce,
 * all_gather, broadcast, all_gather), in *eff, with a temporary recv where the caller's does not
 * take the whole result (op->temp, op->post_*). *eff keeps a's counts pointer. */
static pshard_status_t rooted_args(pshard_comm_t *c, const pshard_coll_args_t *a, coll_op_t *op,
                                   pshard_coll_args_t *eff, char *err, size_t errlen)
{
    int n = c->world_size;
    const char *name = pshard_coll_op_name(a->op);
    if (a->op != PSHARD_COLL_ALL_TO_ALL && (a->root < 0 || a->root >= n))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s root %d is not a rank of this %d-rank communicator", name, a->root, n);
    if (a->send_segs || a->recv_segs)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s takes whole buffers, not pieces", name);
    /* The temporary buffer and the copies out of it are host memory: the caller's buffers
     * must be too (tcp; nccl in host_buffers mode, which stages them itself). */
    if (!c->host_mem || a->send_device || a->recv_device)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s on device buffers is not on the %s backend yet (use all_reduce, "
                       "all_gather or broadcast, or host_buffers)",
                       name, c->backend->name);
    if (a->counts && (a->op == PSHARD_COLL_REDUCE || a->op == PSHARD_COLL_ALL_TO_ALL))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s takes one count, not per-rank counts", name);
    if (a->op == PSHARD_COLL_ALL_TO_ALL) {
        size_t es = pshard_dtype_size(a->dtype);
        size_t nn = (size_t)n * (size_t)n;
        if (a->count > ((SIZE_MAX / 16) / es) / nn)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "all_to_all: %zu elements per block of %d ranks overflow", a->count, n);
        if (a->count > 0 && (!a->send || !a->recv))
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "all_to_all: send or recv buffer is NULL");
        /* Every rank's whole send gathered, rank-major; this rank's block of each is at
         * rank * count within it. */
        *eff = *a;
        eff->op = PSHARD_COLL_ALL_GATHER;
        eff->count = a->count * (size_t)n;
        op->temp = malloc(a->count * nn * es > 0 ? a->count * nn * es : 1);
        if (!op->temp)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY,
                           "all_to_all: out of memory for a %zu-byte temporary buffer",
                           a->count * nn * es);
        eff->recv = op->temp;
        op->post_dst = a->recv;
        op->post_off = (size_t)c->rank * a->count * es;
        op->post_len = a->count * es;
        op->post_stride = (size_t)n * a->count * es;
        op->post_blocks = (size_t)n;
        return PSHARD_OK;
    }
    size_t es = pshard_dtype_size(a->dtype);
    const size_t limit = (SIZE_MAX / 16) / es;
    size_t total = 0, mine = 0, before = 0;
    for (int i = 0; i < n && a->op != PSHARD_COLL_REDUCE; i++) {
        size_t ci = a->counts ? a->counts[i] : a->count;
        if (ci > limit || total > limit - ci)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "element counts overflow (%zu elements of %zu bytes)", ci, es);
        if (i == c->rank) {
            mine = ci;
            before = total;
        }
        total += ci;
    }
    if (a->op == PSHARD_COLL_REDUCE) {
        if (a->count > limit)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "element counts overflow (%zu elements of %zu bytes)", a->count, es);
        total = a->count;
    }
    bool root = c->rank == a->root;
    *eff = *a;
    if (a->op == PSHARD_COLL_SCATTER) {
        eff->op = PSHARD_COLL_BROADCAST;
        eff->counts = NULL;
        eff->count = total;
        if (root && total > 0 && !a->send)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "scatter: send buffer is NULL");
        if (mine > 0 && !a->recv)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "scatter: recv buffer is NULL");
        op->post_dst = a->recv;
        op->post_off = before * es;
        op->post_len = mine * es;
        op->post_blocks = 1;
    } else {
        eff->op = a->op == PSHARD_COLL_REDUCE ? PSHARD_COLL_ALL_REDUCE : PSHARD_COLL_ALL_GATHER;
        if (root)
            return PSHARD_OK; /* root's recv takes the whole result */
    }
    op->temp = malloc(total * es > 0 ? total * es : 1);
    if (!op->temp)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY,
                       "%s: out of memory for a %zu-byte temporary buffer", name, total * es);
    eff->recv = op->temp;
    return PSHARD_OK;
}

/* Checks the arguments against the communicator and fills op (counts, displacements,
 * buffers, descriptor). Allocates op->counts/displs and the pieces' tables. */
static pshard_status_t prepare_op(pshard_comm_t *c, const pshard_coll_args_t *a, coll_op_t *op,
                                  char *err, size_t errlen)
{
    int n = c->world_size;
    if (a->op < PSHARD_COLL_ALL_GATHER || a->op > PSHARD_COLL_ALL_TO_ALL)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown collective op %d",
                       (int)a->op);
    size_t esize = pshard_dtype_size(a->dtype);
    if (esize == 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown dtype %d", (int)a->dtype);
    /* reduce, gather, scatter: checked here, then run as the operation in eff. */
    pshard_coll_op_t user_op = a->op;
    int user_root = a->root;
    pshard_coll_args_t eff;
    if (a->op >= PSHARD_COLL_REDUCE) {
        if (a->op == PSHARD_COLL_REDUCE && pshard_reduce_problem(a->reduce, a->dtype))
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "reduce: %s",
                           pshard_reduce_problem(a->reduce, a->dtype));
        PS_CHECK(rooted_args(c, a, op, &eff, err, errlen));
        a = &eff;
    }
    bool reduces = a->op == PSHARD_COLL_REDUCE_SCATTER || a->op == PSHARD_COLL_ALL_REDUCE;
    const char *why = reduces ? pshard_reduce_problem(a->reduce, a->dtype) : NULL;
    if (why)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: %s",
                       pshard_coll_op_name(a->op), why);
    if (reduces && a->reduce >= PSHARD_REDUCE_BAND && !c->backend->bitwise)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: the %s backend has no %s (bitwise reductions)",
                       pshard_coll_op_name(a->op), c->backend->name, pshard_reduce_name(a->reduce));
    if (a->op == PSHARD_COLL_BROADCAST && (a->root < 0 || a->root >= n))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "broadcast root %d is not a rank of this %d-rank communicator", a->root, n);
    if (a->timeout_ms < 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "timeout_ms is negative");
    if ((a->send_device || a->recv_device) && c->backend->host_buffers)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: the %s backend cannot use device buffers", pshard_coll_op_name(a->op),
                       c->backend->name);
    bool per_rank = a->op == PSHARD_COLL_ALL_GATHER || a->op == PSHARD_COLL_REDUCE_SCATTER;
    if (a->counts && !per_rank)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s takes one count, not per-rank counts", pshard_coll_op_name(a->op));

    op->args = *a;
    op->args.label = NULL;
    op->args.send_segs = op->args.recv_segs = NULL; /* borrowed: op->sbuf / rbuf keep copies */
    op->args.n_send_segs = op->args.n_recv_segs = 0;
    if (n <= COLL_OP_INLINE_RANKS) {
        op->counts = op->inline_counts;
        op->displs = op->inline_displs;
    } else {
        op->counts = calloc((size_t)n, sizeof(size_t));
        op->displs = calloc((size_t)n + 1, sizeof(size_t));
    }
    if (!op->counts || !op->displs)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    size_t total = 0;
    const size_t limit = (SIZE_MAX / 16) / esize;
    for (int i = 0; i < n; i++) {
        size_t ci = 0;
        if (a->op == PSHARD_COLL_BARRIER)
            ci = 0;
        else if (per_rank)
            ci = a->counts ? a->counts[i] : a->count;
        else /* all_reduce/broadcast: the count split in near-equal chunks (all-reduce ring) */
            ci = a->count / (size_t)n + ((size_t)i < a->count % (size_t)n ? 1 : 0);
        if (ci > limit || total > limit - ci)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "element counts overflow (%zu elements of %zu bytes)", ci, esize);
        op->counts[i] = ci;
        op->displs[i] = total;
        total += ci;
    }
    op->displs[n] = total;
    op->args.counts = op->counts;
    size_t mine = per_rank ? op->counts[c->rank] : total;
    bool needs_send =
        a->op != PSHARD_COLL_BARRIER && (a->op != PSHARD_COLL_BROADCAST || a->root == c->rank);
    size_t send_elems = per_rank ? (a->op == PSHARD_COLL_ALL_GATHER ? mine : total) : total;
    size_t recv_elems = a->op == PSHARD_COLL_ALL_GATHER       ? total
                        : a->op == PSHARD_COLL_REDUCE_SCATTER ? mine
                        : a->op == PSHARD_COLL_BARRIER        ? 0
                                                              : total;
    if ((a->send_segs || a->recv_segs) && !c->backend->pieces)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: the %s backend takes whole buffers, not pieces",
                       pshard_coll_op_name(a->op), c->backend->name);
    if ((a->send_segs || a->recv_segs) && a->op == PSHARD_COLL_BARRIER)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "a barrier has no buffers");
    op->sbuf = coll_buf_flat(a->send);
    op->rbuf = coll_buf_flat(a->recv);
    if (a->send_segs && needs_send)
        PS_CHECK(coll_buf_from_segs(&op->sbuf, a->send_segs, a->n_send_segs, esize, send_elems,
                                    "send", err, errlen));
    if (a->recv_segs)
        PS_CHECK(coll_buf_from_segs(&op->rbuf, a->recv_segs, a->n_recv_segs, esize, recv_elems,
                                    "recv", err, errlen));
    if (needs_send && !a->send && !a->send_segs && send_elems > 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: send buffer is NULL",
                       pshard_coll_op_name(a->op));
    if (!a->recv && !a->recv_segs && recv_elems > 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: recv buffer is NULL",
                       pshard_coll_op_name(a->op));

    coll_desc_t *d = &op->desc;
    /* (inline_data is written before it is read: coll_inline_setup) */
    memset(d, 0, offsetof(coll_desc_t, inline_data));
    d->op = (uint8_t)user_op;
    d->dtype = (uint8_t)a->dtype;
    d->reduce = reduces ? (uint8_t)a->reduce : 0;
    bool rooted = a->op == PSHARD_COLL_BROADCAST ||
                  (user_op >= PSHARD_COLL_REDUCE && user_op != PSHARD_COLL_ALL_TO_ALL);
    d->root = rooted ? user_root : 0;
    d->tag = a->tag;
    d->total_count = total;
    d->counts_hash = coll_counts_hash(op->counts, (size_t)n);
    d->rank_count = mine;
    return PSHARD_OK;
}

static void record_fill(pshard_comm_t *c, coll_op_t *op, const char *label)
{
    /* Called with c->mu held. */
    size_t slot = (c->record_head + c->nrecords) % c->record_cap;
    if (c->nrecords == c->record_cap)
        c->record_head = (c->record_head + 1) % c->record_cap;
    else
        c->nrecords++;
    pshard_coll_record_t *r = &c->records[slot];
    r->end_ns = 0;
    r->label[0] = '\0';
    r->error[0] = '\0';
    r->seq = op->desc.seq;
    r->op = (pshard_coll_op_t)op->desc.op;
    r->dtype = op->args.dtype;
    r->tag = op->args.tag;
    r->total_count = op->desc.total_count;
    r->state = PSHARD_COLL_QUEUED;
    r->start_ns = op->start_ns;
    r->waiting_on = -1;
    if (label)
        ps_strlcpy(r->label, label, sizeof(r->label));
    op->record_slot = slot;
}

/* The record of op, or NULL when it has been overwritten by newer ones. c->mu held. */
static pshard_coll_record_t *record_of(pshard_comm_t *c, const coll_op_t *op)
{
    pshard_coll_record_t *r = &c->records[op->record_slot];
    return r->seq == op->desc.seq ? r : NULL;
}

void coll_record_waiting(pshard_comm_t *comm, const coll_op_t *op, int rank)
{
    pthread_mutex_lock(&comm->mu);
    pshard_coll_record_t *r = record_of(comm, op);
    if (r) {
        if (r->state == PSHARD_COLL_QUEUED) {
            r->state = PSHARD_COLL_RUNNING;
            r->start_ns = ps_now_ns();
        }
        r->waiting_on = rank;
    }
    pthread_mutex_unlock(&comm->mu);
}

/* Lets go of what a finished request holds, not the request itself. */
static void req_release(pshard_coll_req_t *req)
{
    if (!req->sync) {
        pthread_mutex_destroy(&req->mu);
        pthread_cond_destroy(&req->cv);
    }
    coll_op_free(&req->op);
}

static void complete(pshard_coll_req_t *req, pshard_status_t status, const char *msg, bool here);

/* pshard_coll_start; blocking: the caller waits for the request at once (pshard_coll_run);
 * storage: where the request lives (pshard_coll_run's, on its stack), or NULL to allocate it. */
static pshard_status_t coll_start(pshard_comm_t *comm, const pshard_coll_args_t *args,
                                  bool blocking, pshard_coll_req_t *storage,
                                  pshard_coll_req_t **req, char *err, size_t errlen)
{
    *req = NULL;
    pshard_coll_req_t *r = storage ? storage : malloc(sizeof(*r));
    if (!r)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    /* Everything but what is written before it is read: the error text, the operation's
     * inline counts and its descriptor (prepare_op's), and mu and cv (initialised when the
     * request goes to the backend); a small operation's latency is made of such things. */
    size_t op_at = offsetof(pshard_coll_req_t, op);
    memset(r, 0, op_at + offsetof(coll_op_t, inline_counts));
    size_t after_desc = op_at + offsetof(coll_op_t, desc) + sizeof(r->op.desc);
    memset((uint8_t *)r + after_desc, 0, offsetof(pshard_coll_req_t, mu) - after_desc);
    memset(&r->done, 0, offsetof(pshard_coll_req_t, error) - offsetof(pshard_coll_req_t, done));
    memset((uint8_t *)r + offsetof(pshard_coll_req_t, error) + sizeof(r->error), 0,
           sizeof(*r) - offsetof(pshard_coll_req_t, error) - sizeof(r->error));
    r->error[0] = '\0';
    pshard_status_t rc = prepare_op(comm, args, &r->op, err, errlen);
    if (rc != PSHARD_OK) {
        coll_op_free(&r->op);
        if (!storage)
            free(r);
        return rc;
    }
    r->comm = comm;
    int64_t timeout_ms = args->timeout_ms ? args->timeout_ms : comm->timeout_ms;
    r->op.timeout_ns = timeout_ms * 1000000;

    /* An operation the backend runs in the caller's thread (only ever a blocking call) waits
     * until nothing else is in flight; the backend's thread does not start an operation while
     * one of those runs (coll_wait_here): so all run in issue order, and pshard_coll_start
     * never waits for the other ranks. Its clock starts when it first waits. */
    bool here = comm->backend->here && comm->backend->here(comm, &r->op, blocking);
    if (!here)
        coll_op_deadline(&r->op);
    pthread_mutex_lock(&comm->mu);
    while (here && (comm->here_busy || comm->in_flight > 0))
        pthread_cond_wait(&comm->idle_cv, &comm->mu);
    r->op.desc.seq = comm->next_seq++;
    if (comm->divert_check) {
        r->op.desc.divert = 1;
        r->op.desc.tag ^= comm->divert_check;
        comm->divert_check = 0;
    }
    record_fill(comm, &r->op, args->label);
    pshard_status_t sticky = comm->sticky;
    char sticky_msg[sizeof(comm->sticky_msg)];
    ps_strlcpy(sticky_msg, comm->sticky_msg, sizeof(sticky_msg));
    /* One rank, host buffers, nothing queued ahead: the operation is a copy, done here
     * rather than handed to the backend's thread and back (two wake-ups per operation). */
    bool local = sticky == PSHARD_OK && comm->world_size == 1 && comm->backend->host_buffers &&
                 comm->in_flight == 0;
    here = here && sticky == PSHARD_OK;
    if (here)
        comm->here_busy = true;
    else if (sticky == PSHARD_OK && !local) {
        r->submitted = true;
        comm->in_flight++;
    }
    pthread_mutex_unlock(&comm->mu);
    /* Handed to the backend's thread: completed there, waited for here. */
    r->sync = !r->submitted;
    if (!r->sync) {
        pthread_mutex_init(&r->mu, NULL);
        pthread_cond_init(&r->cv, NULL);
    }

    *req = r;
    if (sticky != PSHARD_OK) {
        coll_complete(r, sticky, sticky_msg);
    } else if (here) {
        char msg[PSHARD_ERRLEN];
        msg[0] = '\0';
        pshard_status_t st = comm->backend->run_here(comm, &r->op, msg, sizeof(msg));
        complete(r, st, msg, true);
    } else if (local) {
        /* A one-rank all-gather, reduce-scatter, all-reduce or broadcast copies send to
         * recv (a sum or average over one rank is the value itself); a barrier does nothing. */
        size_t nbytes =
            args->op == PSHARD_COLL_BARRIER ? 0 : r->op.displs[1] * pshard_dtype_size(args->dtype);
        if (nbytes)
            coll_buf_copy(&r->op.rbuf, 0, &r->op.sbuf, 0, nbytes);
        coll_complete(r, PSHARD_OK, NULL);
    } else {
        comm->backend->submit(comm, r);
    }
    return PSHARD_OK;
}

pshard_status_t pshard_coll_start(pshard_comm_t *comm, const pshard_coll_args_t *args,
                                  pshard_coll_req_t **req, char *err, size_t errlen)
{
    return coll_start(comm, args, false, NULL, req, err, errlen);
}

pshard_status_t coll_start_check(pshard_comm_t *comm, const coll_desc_t *desc, const char *label,
                                 int64_t timeout_ms, pshard_coll_req_t **req, char *err,
                                 size_t errlen)
{
    /* A barrier-shaped request whose descriptor is the caller's. */
    pshard_coll_args_t a = {.op = PSHARD_COLL_BARRIER, .timeout_ms = timeout_ms, .label = label};
    *req = NULL;
    pshard_coll_req_t *r = calloc(1, sizeof(*r));
    if (!r)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    pshard_status_t rc = prepare_op(comm, &a, &r->op, err, errlen);
    if (rc != PSHARD_OK) {
        coll_op_free(&r->op);
        free(r);
        return rc;
    }
    r->op.desc = *desc;
    r->op.check_only = true;
    r->comm = comm;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->op.start_ns = ps_now_ns();
    r->op.deadline_ns = r->op.start_ns + (timeout_ms ? timeout_ms : comm->timeout_ms) * 1000000;
    pthread_mutex_lock(&comm->mu);
    r->op.desc.seq = comm->next_seq++;
    record_fill(comm, &r->op, label);
    pshard_status_t sticky = comm->sticky;
    char sticky_msg[sizeof(comm->sticky_msg)];
    ps_strlcpy(sticky_msg, comm->sticky_msg, sizeof(sticky_msg));
    if (sticky == PSHARD_OK) {
        r->submitted = true;
        comm->in_flight++;
    }
    pthread_mutex_unlock(&comm->mu);
    *req = r;
    if (sticky != PSHARD_OK)
        coll_complete(r, sticky, sticky_msg);
    else
        comm->backend->submit(comm, r);
    return PSHARD_OK;
}

/* On a timeout the flight recorder goes to the log (the last 8 operations, the stuck one last)
 * so that "who waited on whom" survives the process. */
static void log_flight_records(pshard_comm_t *c)
{
    pshard_coll_record_t recs[8];
    size_t n = pshard_comm_flight_records(c, recs, 8);
    for (size_t i = 0; i < n; i++) {
        char line[320];
        pshard_coll_record_format(c, &recs[i], line, sizeof(line));
        PS_ERROR(PS_SUB_COLL, "flight recorder: %s", line);
    }
}

/* PSHARD_LOG=info PSHARD_LOG_SUBSYS=coll: one line per operation, in each rank's call order,
 * as NCCL_DEBUG_SUBSYS=COLL prints (op, communicator, seq, dtype, counts, root, tag, ranks,
 * outcome, time). */
static void log_op(pshard_comm_t *c, const pshard_coll_req_t *req, pshard_status_t status,
                   const char *msg)
{
    char what[256];
    coll_desc_format(&req->op.desc, what, sizeof(what));
    double ms = req->op.start_ns ? (double)(ps_now_ns() - req->op.start_ns) / 1e6 : 0;
    PS_INFO(
        PS_SUB_COLL, "coll %s (communicator %s generation %llu, rank %d of %d%s): %s%s in %.3f ms",
        what, c->name, (unsigned long long)c->generation, c->rank, c->world_size,
        req->op.check_only ? ", descriptor check" : "", status == PSHARD_OK ? "done" : "FAILED: ",
        status == PSHARD_OK ? "" : (msg ? msg : pshard_status_str(status)), ms);
}

void coll_wait_here(pshard_comm_t *comm)
{
    pthread_mutex_lock(&comm->mu);
    while (comm->here_busy)
        pthread_cond_wait(&comm->idle_cv, &comm->mu);
    pthread_mutex_unlock(&comm->mu);
}

void coll_complete(pshard_coll_req_t *req, pshard_status_t status, const char *msg)
{
    complete(req, status, msg, false);
}

/* As coll_complete; here: req ran in the caller's thread (backend->run_here), whose mark is
 * cleared in the same hold of the communicator's lock that records the outcome. */
static void complete(pshard_coll_req_t *req, pshard_status_t status, const char *msg, bool here)
{
    pshard_comm_t *c = req->comm;
    if (ps_log_named(PS_LOG_INFO, PS_SUB_COLL))
        log_op(c, req, status, msg);
    if (status == PSHARD_ERR_TIMEOUT)
        log_flight_records(c);
    if (status != PSHARD_OK && status != PSHARD_ERR_DIVERTED)
        coll_set_sticky(c, status, msg);
    pthread_mutex_lock(&c->mu);
    if (req->submitted) {
        req->submitted = false;
        if (--c->in_flight == 0)
            pthread_cond_broadcast(&c->idle_cv);
    }
    if (here) {
        c->here_busy = false;
        pthread_cond_broadcast(&c->idle_cv);
    }
    pshard_coll_record_t *r = record_of(c, &req->op);
    if (r) {
        r->state = status == PSHARD_OK ? PSHARD_COLL_DONE : PSHARD_COLL_FAILED;
        /* (an operation that never waited has no clock reading: "in 0.000 ms") */
        if (!r->start_ns)
            r->start_ns = req->op.start_ns;
        r->end_ns = req->op.start_ns ? ps_now_ns() : r->start_ns;
        /* A failure keeps the peer it was blocked on: a trace of a timeout names it. */
        if (status == PSHARD_OK)
            r->waiting_on = -1;
        if (status != PSHARD_OK)
            ps_strlcpy(r->error, msg ? msg : pshard_status_str(status), sizeof(r->error));
    }
    pthread_mutex_unlock(&c->mu);
    for (size_t k = 0; status == PSHARD_OK && req->op.post_len && k < req->op.post_blocks; k++)
        memcpy((uint8_t *)req->op.post_dst + k * req->op.post_len,
               (const uint8_t *)req->op.temp + req->op.post_off + k * req->op.post_stride,
               req->op.post_len);
    if (!req->sync)
        pthread_mutex_lock(&req->mu);
    req->status = status;
    if (status != PSHARD_OK)
        ps_strlcpy(req->error, msg ? msg : pshard_status_str(status), sizeof(req->error));
    req->done = true;
    if (!req->sync) {
        pthread_cond_broadcast(&req->cv);
        pthread_mutex_unlock(&req->mu);
    }
}

pshard_status_t pshard_coll_wait(pshard_coll_req_t *req, char *err, size_t errlen)
{
    if (req->sync) { /* done before pshard_coll_start returned */
        if (req->status != PSHARD_OK)
            ps_errf(err, errlen, req->status, "%s", req->error);
        return req->status;
    }
    pthread_mutex_lock(&req->mu);
    while (!req->done)
        pthread_cond_wait(&req->cv, &req->mu);
    pshard_status_t st = req->status;
    if (st != PSHARD_OK)
        ps_errf(err, errlen, st, "%s", req->error);
    pthread_mutex_unlock(&req->mu);
    return st;
}

pshard_status_t pshard_coll_test(pshard_coll_req_t *req, bool *done, char *err, size_t errlen)
{
    if (req->sync) {
        *done = true;
        return pshard_coll_wait(req, err, errlen);
    }
    pthread_mutex_lock(&req->mu);
    *done = req->done;
    pshard_status_t st = req->done ? req->status : PSHARD_OK;
    if (req->done && st != PSHARD_OK)
        ps_errf(err, errlen, st, "%s", req->error);
    pthread_mutex_unlock(&req->mu);
    return st;
}

void pshard_coll_req_free(pshard_coll_req_t *req)
{
    if (!req)
        return;
    pshard_coll_wait(req, NULL, 0);
    req_release(req);
    free(req);
}

pshard_status_t pshard_coll_run(pshard_comm_t *comm, const pshard_coll_args_t *args, char *err,
                                size_t errlen)
{
    pshard_coll_req_t storage, *req = NULL;
    pshard_status_t rc = coll_start(comm, args, true, &storage, &req, err, errlen);
    if (rc != PSHARD_OK)
        return rc;
    rc = pshard_coll_wait(req, err, errlen);
    req_release(req);
    return rc;
}

size_t pshard_comm_flight_records(pshard_comm_t *comm, pshard_coll_record_t *out, size_t max)
{
    pthread_mutex_lock(&comm->mu);
    size_t n = comm->nrecords < max ? comm->nrecords : max;
    size_t skip = comm->nrecords - n;
    for (size_t i = 0; i < n; i++)
        out[i] = comm->records[(comm->record_head + skip + i) % comm->record_cap];
    pthread_mutex_unlock(&comm->mu);
    return n;
}

void pshard_coll_record_format(const pshard_comm_t *comm, const pshard_coll_record_t *rec,
                               char *buf, size_t len)
{
    char label[96] = "";
    if (rec->label[0])
        snprintf(label, sizeof(label), " (%s)", rec->label);
    int64_t now = ps_now_ns();
    const char *op = pshard_coll_op_name(rec->op);
    switch (rec->state) {
    case PSHARD_COLL_QUEUED:
        snprintf(buf, len, "rank %d has %s seq %" PRIu64 "%s queued", comm->rank, op, rec->seq,
                 label);
        break;
    case PSHARD_COLL_RUNNING:
        if (rec->waiting_on >= 0)
            snprintf(buf, len,
                     "rank %d is stuck in %s seq %" PRIu64 "%s, waiting on rank %d for %.1f s",
                     comm->rank, op, rec->seq, label, rec->waiting_on,
                     (double)(now - rec->start_ns) / 1e9);
        else
            snprintf(buf, len, "rank %d is running %s seq %" PRIu64 "%s for %.1f s", comm->rank, op,
                     rec->seq, label, (double)(now - rec->start_ns) / 1e9);
        break;
    case PSHARD_COLL_DONE:
        snprintf(buf, len, "rank %d finished %s seq %" PRIu64 "%s in %.3f ms", comm->rank, op,
                 rec->seq, label, (double)(rec->end_ns - rec->start_ns) / 1e6);
        break;
    case PSHARD_COLL_FAILED:
        snprintf(buf, len, "rank %d failed %s seq %" PRIu64 "%s: %s", comm->rank, op, rec->seq,
                 label, rec->error);
        break;
    }
}

#ifndef PSHARD_HAVE_NCCL
/* Without CUDA the helpers of collectives.h only explain why they cannot help. */
pshard_status_t pshard_nccl_load(char *err, size_t errlen)
{
    return ps_errf(err, errlen, PSHARD_ERR_UNIMPLEMENTED,
                   "backend nccl: this pshard was built without CUDA/NCCL");
}

pshard_status_t pshard_cuda_check_device(int device, char *err, size_t errlen)
{
    return ps_errf(err, errlen, PSHARD_ERR_UNIMPLEMENTED,
                   "CUDA device %d: this pshard was built without CUDA/NCCL", device);
}

pshard_status_t pshard_host_pin(int device, void *p, size_t bytes, char *err, size_t errlen)
{
    (void)device;
    (void)p;
    (void)bytes;
    return ps_errf(err, errlen, PSHARD_ERR_UNIMPLEMENTED,
                   "pinning host memory: this pshard was built without CUDA/NCCL");
}

void pshard_host_unpin(int device, void *p)
{
    (void)device;
    (void)p;
}
#endif
