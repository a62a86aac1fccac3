/* The shard server's trainer-facing gRPC service: its method table and the handlers, which
 * translate each request into an operation of shard_ops.h (attach, define the model, gather,
 * reduce-scatter, step, clip_grad_norm, plain collectives, checkpoint, join, region reads and
 * writes) and its result into the reply; Status answers from copies. Trainer operations run one
 * at a time on worker threads (a collective blocks), never on the completion-queue thread. */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "pshard/collectives.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/shard.pb-c.h"
#include "pshard/shard_server.h"
#include "pshard/util.h"

#include "shard_cuda.h"
#include "shard_heal.h"
#include "shard_internal.h"
#include "shard_ops.h"
#include "shard_trace.h"

/* ---------------------------------------------------------------------------------------- */
/* Helpers                                                                                   */

static bool dtype_from_pb(Pshard__DType d, pshard_dtype_t *out)
{
    switch (d) {
    case PSHARD__DTYPE__FP32:
        *out = PSHARD_FP32;
        return true;
    case PSHARD__DTYPE__BF16:
        *out = PSHARD_BF16;
        return true;
    case PSHARD__DTYPE__FP16:
        *out = PSHARD_FP16;
        return true;
    case PSHARD__DTYPE__INT64:
        *out = PSHARD_INT64;
        return true;
    case PSHARD__DTYPE__FP64:
        *out = PSHARD_FP64;
        return true;
    case PSHARD__DTYPE__INT32:
        *out = PSHARD_INT32;
        return true;
    case PSHARD__DTYPE__UINT8:
        *out = PSHARD_UINT8;
        return true;
    default:
        return false;
    }
}

/* Ends a call with reply, or with rc and err. */
static void answer(ps_rpc_call_t *call, pshard_status_t rc, const char *err,
                   const ProtobufCMessage *reply)
{
    if (rc != PSHARD_OK)
        ps_rpc_call_fail(call, rc, "%s", err);
    else
        ps_rpc_call_reply(call, reply);
}

/* ---------------------------------------------------------------------------------------- */
/* Trainer RPCs                                                                              */

/* True (with the reason in err) while the rank's session belongs to a trainer that is alive:
 * the coordinator's membership holds its lease (member trainer-R). Another Attach must not take
 * the rank from it; a trainer that left, or whose lease lapsed (it died or hangs), frees it. A
 * trainer without a lease (no coordinator) can be replaced, as before. */
static bool session_held_by_live_trainer(pshard_shard_server_t *s, char *err, size_t errlen)
{
    pthread_mutex_lock(&s->mu);
    int64_t lease_ms = s->lease_ms > 0 ? s->lease_ms : 5000;
    bool held = s->session[0] && s->trainer_seen;
    if (held)
        snprintf(err, errlen,
                 "rank %d is attached to a live trainer (%s, attached %lld ms ago, its "
                 "coordinator lease is live); a second trainer cannot take it over. A restarted "
                 "trainer attaches once the old one's lease (%lld ms) has lapsed",
                 s->rank, s->trainer_name, (long long)((ps_now_ns() - s->attached_ns) / 1000000),
                 (long long)lease_ms);
    pthread_mutex_unlock(&s->mu);
    return held;
}

/* An Attach: its request, and what the reply reports, copied under op_mu (the reply goes out
 * after op_mu is released, when another Attach may have replaced the session). */
typedef struct {
    const Pshard__AttachRequest *req;
    char session[sizeof(((pshard_shard_server_t *)NULL)->session)];
    int rank, world;
    uint64_t generation;
} attach_arg_t;

/* Refuses a trainer of another rank, and a rank a live trainer holds: under op_mu, which every
 * Attach takes, so two at once cannot both pass. */
static pshard_status_t attach_check(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                    char *err, size_t errlen)
{
    const Pshard__AttachRequest *req = ((attach_arg_t *)op->arg)->req;
    if (req->coll_timeout_ms < 0 || req->coll_timeout_ms > 86400000)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "coll_timeout_ms %" PRId64 " is not in 0..86400000 (0: the server's)",
                       req->coll_timeout_ms);
    if (req->rank != pshard_comm_rank(comm))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "trainer rank %d attached to the shard server of rank %d (RANK and "
                       "PSHARD_SERVER disagree)",
                       req->rank, pshard_comm_rank(comm));
    char held[PSHARD_ERRLEN] = "";
    if (session_held_by_live_trainer(s, held, sizeof(held)))
        return ps_errf(err, errlen, PSHARD_ERR_ALREADY_EXISTS, "%s", held);
    return PSHARD_OK;
}

/* Maps the trainer's scratch region (allocates a remote trainer's), puts it in place of the
 * previous trainer's regions and begins a new session. */
static pshard_status_t attach_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                  char *err, size_t errlen)
{
    attach_arg_t *a = op->arg;
    const Pshard__AttachRequest *req = a->req;
    shm_map_t m = {0};
    bool remote = !req->shm_name || !req->shm_name[0];
    PS_CHECK(remote ? shard_alloc_private(req->shm_bytes, &m, err, errlen)
                    : shard_map_shm(req->shm_name, req->shm_bytes, &m, err, errlen));
    shard_pin_region(s, &m);
    /* The previous trainer's groups; a lost trainer's keyed ones stay for its replacement to
     * make again under the ids the other members use, as do those of a lost server, which a
     * healed one keeps for its new trainer (shard_heal.c). */
    pthread_mutex_lock(&s->mu);
    bool replacing = s->replace_deadline_ns != 0 || s->heal;
    pthread_mutex_unlock(&s->mu);
    if (replacing)
        shard_pgs_hand_over(s);
    else
        shard_pgs_clear(s);
    shard_unmap(&s->scratch);
    shard_unmap(&s->model_shm);
    shard_unmap(&s->pending_model);
    s->scratch = m;
    uint8_t rnd[16];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) {
        uint64_t t = (uint64_t)ps_now_ns() ^ ((uint64_t)getpid() << 32);
        memcpy(rnd, &t, sizeof(t));
        memcpy(rnd + 8, &t, sizeof(t));
    }
    for (int i = 0; i < 16; i++)
        snprintf(a->session + 2 * i, 3, "%02x", rnd[i]);
    pthread_mutex_lock(&s->mu);
    memcpy(s->session, a->session, sizeof(a->session));
    ps_strlcpy(s->trainer_name, req->member_name ? req->member_name : "", sizeof(s->trainer_name));
    s->trainer_seen = false; /* until the coordinator shows its lease */
    s->trainer_gone = false;
    s->join_refused = false;
    s->attached_ns = ps_now_ns();
    s->session_aborts = s->ring_serial; /* a new trainer begins after them */
    shard_steps_reset(&s->steps);       /* a new trainer's steps, from its first Step on */
    atomic_store(&s->session_timeout_ms, req->coll_timeout_ms);
    pthread_mutex_unlock(&s->mu);
    shard_apply_session_timeout(s, comm);
    a->rank = pshard_comm_rank(comm);
    a->world = pshard_comm_world_size(comm);
    a->generation = s->comm_generation;
    PS_INFO(PS_SUB_SHARD, "trainer '%s' attached (%" PRIu64 " bytes of scratch)", req->trainer_name,
            req->shm_bytes);
    return PSHARD_OK;
}

static void handle_attach(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_shard_server_t *s = ctx;
    attach_arg_t a = {.req = (const Pshard__AttachRequest *)request};
    shard_op_t op = {
        .no_session = true, .opk = -1, .check = attach_check, .run = attach_run, .arg = &a};
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = shard_op_run(s, &op, err, sizeof(err));
    Pshard__AttachResponse out = PSHARD__ATTACH_RESPONSE__INIT;
    out.session = a.session;
    out.rank = a.rank;
    out.world_size = a.world;
    out.generation = a.generation;
    out.backend = (char *)s->cfg.backend;
    out.offload = (char *)s->cfg.offload;
    out.coordinator = (char *)s->cfg.coordinator;
    out.job = (char *)(s->cfg.job ? s->cfg.job : "");
    answer(call, rc, err, &out.base);
}

static void handle_define(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__DefineModelRequest *req = (const Pshard__DefineModelRequest *)request;
    shard_define_arg_t a = {.req = req, .resumed_from = ""};
    shard_op_t op = {
        .session = req->session, .new_model = true, .opk = -1, .run = shard_define_run, .arg = &a};
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = shard_op_run(ctx, &op, err, sizeof(err));
    Pshard__DefineModelResponse out = PSHARD__DEFINE_MODEL_RESPONSE__INIT;
    char fp[32];
    snprintf(fp, sizeof(fp), "%016" PRIx64, a.fingerprint);
    out.shard_elements = a.shard_numel;
    out.fingerprint = fp;
    out.step = a.step;
    out.aborted_steps = a.aborted_steps;
    out.resumed_from = a.resumed_from;
    out.shard_shm_name = a.shm_name;
    out.shard_shm_bytes = a.shm_bytes;
    out.shard_master_offset = a.master_off;
    out.shard_grad_offset = a.grad_off;
    out.shard_state0_offset = a.state0_off;
    out.shard_state1_offset = a.state1_off;
    out.shard_steps_offset = a.steps_off;
    out.shard_shared_reason = a.shared_reason;
    if (a.dev_handle_len) {
        out.shard_device_handle.data = a.dev_handle;
        out.shard_device_handle.len = a.dev_handle_len;
        out.shard_device_kind = (char *)a.dev_kind;
        out.shard_device_bytes = a.dev_bytes;
        out.shard_device = a.device;
    }
    if (a.region_handle_len) {
        out.region_device_handle.data = a.region_handle;
        out.region_device_handle.len = a.region_handle_len;
        out.region_device_kind = (char *)a.dev_kind;
        out.region_device = a.device;
    }
    out.trainer_replace_ms = a.trainer_replace_ms;
    char *names[2] = {a.state_names[0], a.state_names[1]};
    if (names[0][0] && names[1][0]) {
        out.n_trainer_state_names = 2;
        out.trainer_state_names = names;
    }
    answer(call, rc, err, &out.base);
}

/* A Gather or ReduceScatter: its tensors, and the parameter ids the ranks agree on. */
typedef struct {
    Pshard__TensorRef **tensors;
    size_t n;
    uint32_t *ids;
} tensors_arg_t;

/* Checks the tensor list of a Gather/ReduceScatter against the model and the region; a
 * reduce-scatter may not name a frozen parameter. Every rank checks its own request before the
 * agreement, so ranks that ask alike refuse alike and none waits in a collective. */
static pshard_status_t tensors_check(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                     char *err, size_t errlen)
{
    tensors_arg_t *a = op->arg;
    Pshard__TensorRef **t = a->tensors;
    pshard_dtype_t dt = op->sop.dtype;
    bool reduce = op->sop.kind == SHARD_SOP_REDUCE_SCATTER;
    shard_model_t *m = s->model;
    if (!s->model_shm.base)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "the trainer re-attached: call DefineModel again to map its model region");
    if (a->n == 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "no tensors named");
    size_t es = pshard_dtype_size(dt);
    /* The full buffers: the model's device region, else the trainer's shared memory. */
    shm_map_t dev_region = {.base = m->region_dev.ptr, .bytes = m->region_dev.bytes};
    const shm_map_t *region = m->region_dev.bytes ? &dev_region : &s->model_shm;
    for (size_t i = 0; i < a->n; i++) {
        if (t[i]->param >= m->nparams)
            return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND,
                           "unknown parameter #%u (the model has %zu)", t[i]->param, m->nparams);
        const shard_param_t *p = &m->params[t[i]->param];
        uint32_t group = m->param_group[t[i]->param];
        if (reduce && m->groups[group].frozen)
            return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                           "'%s' is frozen (parameter group %" PRIu32 ", requires_grad=False): "
                           "it is gathered but never reduce-scattered or stepped; leave it out "
                           "of the reduce-scatter",
                           p->name, group);
        if (!shard_in_region(region, t[i]->offset, (uint64_t)p->numel * es, es))
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "buffer of '%s' (%zu x %s at offset %" PRIu64
                           ") lies outside the model region of %zu bytes%s or is misaligned",
                           p->name, p->numel, pshard_dtype_name(dt), t[i]->offset, region->bytes,
                           region == &dev_region ? " (device memory)" : "");
    }
    a->ids = malloc(a->n * sizeof(uint32_t));
    if (!a->ids)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    for (size_t i = 0; i < a->n; i++) {
        a->ids[i] = t[i]->param;
        op->bytes += (uint64_t)m->params[t[i]->param].numel * es;
    }
    op->sop.nids = a->n;
    op->sop.ids = a->ids;
    return PSHARD_OK;
}

/* One collective per tensor, in order, into or from the trainer's buffers. */
static pshard_status_t tensors_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                   char *err, size_t errlen)
{
    tensors_arg_t *a = op->arg;
    void **bufs = malloc(a->n * sizeof(void *));
    if (!bufs)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    const shard_model_t *m = s->model;
    bool on_dev = m->region_dev.bytes > 0;
    uint8_t *base = on_dev ? m->region_dev.ptr : s->model_shm.base;
    for (size_t i = 0; i < a->n; i++)
        bufs[i] = base + a->tensors[i]->offset;
    pshard_status_t rc =
        shard_tensors_run(comm, s->model, op->sop.kind == SHARD_SOP_GATHER, a->ids, bufs, on_dev,
                          a->n, op->sop.dtype, op->active, err, errlen);
    free(bufs);
    return rc;
}

/* What Gather and ReduceScatter share: the dtype, then the operation. */
static void tensor_op(pshard_shard_server_t *s, ps_rpc_call_t *call, bool gather,
                      const char *session, Pshard__TensorRef **tensors, size_t n,
                      Pshard__DType dtype_pb, const ProtobufCMessage *reply)
{
    pshard_dtype_t dt;
    bool dt_ok = dtype_from_pb(dtype_pb, &dt) &&
                 (gather ? (dt == PSHARD_FP32 || dt == PSHARD_BF16 || dt == PSHARD_FP16)
                         : (dt == PSHARD_FP32 || dt == PSHARD_BF16));
    if (!dt_ok) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                         gather ? "param dtype must be fp32, bf16 or fp16"
                                : "reduce dtype must be fp32 or bf16");
        return;
    }
    tensors_arg_t a = {.tensors = tensors, .n = n};
    shard_op_t op = {
        .session = session,
        .needs_model = "no model is defined; call DefineModel first",
        .agree = true,
        .sop = {.kind = gather ? SHARD_SOP_GATHER : SHARD_SOP_REDUCE_SCATTER, .dtype = dt},
        .opk = gather ? SHARD_OPK_GATHER : SHARD_OPK_REDUCE_SCATTER,
        .check = tensors_check,
        .run = tensors_run,
        .arg = &a,
    };
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = shard_op_run(s, &op, err, sizeof(err));
    free(a.ids);
    answer(call, rc, err, reply);
}

static void handle_gather(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__GatherRequest *req = (const Pshard__GatherRequest *)request;
    Pshard__GatherResponse out = PSHARD__GATHER_RESPONSE__INIT;
    tensor_op(ctx, call, true, req->session, req->tensors, req->n_tensors, req->dtype, &out.base);
}

static void handle_reduce_scatter(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__ReduceScatterRequest *req = (const Pshard__ReduceScatterRequest *)request;
    Pshard__ReduceScatterResponse out = PSHARD__REDUCE_SCATTER_RESPONSE__INIT;
    tensor_op(ctx, call, false, req->session, req->tensors, req->n_tensors, req->dtype, &out.base);
}

/* A plain collective's buffers lie in the scratch region (checked under op_mu: a
 * re-attach replaces the region). */
static pshard_status_t collective_check(pshard_shard_server_t *s, pshard_comm_t *comm,
                                        shard_op_t *op, char *err, size_t errlen)
{
    const Pshard__CollectiveRequest *req = op->arg;
    size_t es = pshard_dtype_size(op->sop.dtype);
    int world = pshard_comm_world_size(comm);
    bool rooted = req->op == PSHARD_COLL_BROADCAST ||
                  (req->op >= PSHARD_COLL_REDUCE && req->op != PSHARD_COLL_ALL_TO_ALL);
    if (rooted && (req->root < 0 || req->root >= world))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s root %d is not a rank of this %d-rank cluster",
                       pshard_coll_op_name((pshard_coll_op_t)req->op), req->root, world);
    bool root = pshard_comm_rank(comm) == req->root;
    uint64_t send_bytes = req->count * es, recv_bytes = send_bytes;
    if (req->op == PSHARD_COLL_ALL_GATHER || (req->op == PSHARD_COLL_GATHER && root))
        recv_bytes = send_bytes * (uint64_t)world; /* count is per rank */
    else if (req->op == PSHARD_COLL_GATHER || req->op == PSHARD_COLL_REDUCE)
        recv_bytes = root ? send_bytes : 0; /* only the root receives */
    if (req->op == PSHARD_COLL_SCATTER)
        send_bytes = root ? send_bytes * (uint64_t)world : 0; /* only the root sends */
    if (req->op == PSHARD_COLL_REDUCE_SCATTER) /* count is per rank: a block for each */
        send_bytes *= (uint64_t)world;
    if (req->op == PSHARD_COLL_ALL_TO_ALL) /* count is per block, a block for every rank */
        send_bytes = recv_bytes = send_bytes * (uint64_t)world;
    if (req->count > (1ull << 40) ||
        !shard_in_region(&s->scratch, req->send_offset, send_bytes, es) ||
        !shard_in_region(&s->scratch, req->recv_offset, recv_bytes, es))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "buffers (%" PRIu64 " elements at offsets %" PRIu64 " and %" PRIu64
                       ") lie outside the %zu-byte scratch region or are misaligned",
                       req->count, req->send_offset, req->recv_offset, s->scratch.bytes);
    op->bytes = req->op == PSHARD_COLL_BARRIER ? 0 : send_bytes;
    return PSHARD_OK;
}

static pshard_status_t collective_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                      char *err, size_t errlen)
{
    const Pshard__CollectiveRequest *req = op->arg;
    uint8_t *base = s->scratch.base;
    return shard_run_collective(comm, &op->sop, base + req->send_offset, base + req->recv_offset,
                                op->active, err, errlen);
}

/* CollectiveRequest.op of a send and a recv (shard.proto): point-to-point, on the pair's
 * communicator, not collectives.h operations. */
enum { P2P_SEND = 10, P2P_RECV = 11 };

/* A send's or recv's buffer lies in the scratch region. */
static pshard_status_t p2p_check(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                 char *err, size_t errlen)
{
    const Pshard__CollectiveRequest *req = op->arg;
    /* comm is the pair's (ranks 0 and 1 in world-rank order): both ends record the sender's
     * rank in it. */
    int mine = pshard_comm_rank(comm);
    op->sop.root = req->op == P2P_SEND ? mine : 1 - mine;
    size_t es = pshard_dtype_size(op->sop.dtype);
    bool send = req->op == P2P_SEND;
    uint64_t off = send ? req->send_offset : req->recv_offset;
    if (req->count > (1ull << 40) || !shard_in_region(&s->scratch, off, req->count * es, es))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s buffer (%" PRIu64 " elements at offset %" PRIu64
                       ") lies outside the %zu-byte scratch region or is misaligned",
                       send ? "send" : "recv", req->count, off, s->scratch.bytes);
    op->bytes = req->count * es;
    return PSHARD_OK;
}

/* The data: a broadcast on the pair's communicator from the sender. */
static pshard_status_t p2p_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                               char *err, size_t errlen)
{
    const Pshard__CollectiveRequest *req = op->arg;
    uint8_t *buf =
        (uint8_t *)s->scratch.base + (req->op == P2P_SEND ? req->send_offset : req->recv_offset);
    pshard_coll_args_t a = {.op = PSHARD_COLL_BROADCAST,
                            .dtype = op->sop.dtype,
                            .root = op->sop.root,
                            .send = buf,
                            .recv = buf,
                            .count = req->count,
                            .tag = req->tag,
                            .label = req->op == P2P_SEND ? "send" : "recv"};
    return pshard_coll_run(comm, &a, err, errlen);
}

/* send / recv with world rank req->root (its peer), matched in each pair's issue order; the
 * tags and counts must agree (else DESYNC naming both). */
static void handle_p2p(ps_rpc_call_t *call, const Pshard__CollectiveRequest *req,
                       pshard_shard_server_t *s, pshard_dtype_t dt)
{
    shard_op_t op = {
        .session = req->session,
        .agree = true,
        .p2p = true,
        .peer = req->root,
        /* Both ends encode the same record: the sender's rank in the pair (p2p_check), the
         * tag, the count and the dtype. */
        .sop = {.kind = SHARD_SOP_P2P, .dtype = dt, .coll_op = req->tag, .count = req->count},
        .opk = -1,
        .check = p2p_check,
        .run = p2p_run,
        .arg = (void *)req,
    };
    char err[PSHARD_ERRLEN] = "";
    Pshard__CollectiveResponse out = PSHARD__COLLECTIVE_RESPONSE__INIT;
    answer(call, shard_op_run(s, &op, err, sizeof(err)), err, &out.base);
}

static void handle_collective(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__CollectiveRequest *req = (const Pshard__CollectiveRequest *)request;
    pshard_dtype_t dt;
    if (!dtype_from_pb(req->dtype, &dt)) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT, "unknown dtype %d", (int)req->dtype);
        return;
    }
    if (req->op == P2P_SEND || req->op == P2P_RECV) {
        if (req->group) {
            ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                             "send and recv take the peer's world rank, not a group (group %u)",
                             req->group);
            return;
        }
        handle_p2p(call, req, ctx, dt);
        return;
    }
    if (req->op != PSHARD_COLL_ALL_GATHER && req->op != PSHARD_COLL_ALL_REDUCE &&
        req->op != PSHARD_COLL_REDUCE_SCATTER && req->op != PSHARD_COLL_BROADCAST &&
        req->op != PSHARD_COLL_BARRIER && req->op != PSHARD_COLL_REDUCE &&
        req->op != PSHARD_COLL_GATHER && req->op != PSHARD_COLL_SCATTER &&
        req->op != PSHARD_COLL_ALL_TO_ALL) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                         "op %u is not one of all_gather (1), reduce_scatter (2), all_reduce (3), "
                         "broadcast (4), "
                         "barrier (5), reduce (6), gather (7), scatter (8), all_to_all (9), send "
                         "(10), recv (11)",
                         req->op);
        return;
    }
    bool reduces = req->op == PSHARD_COLL_ALL_REDUCE || req->op == PSHARD_COLL_REDUCE ||
                   req->op == PSHARD_COLL_REDUCE_SCATTER;
    const char *why = reduces ? pshard_reduce_problem((pshard_reduce_t)req->reduce, dt) : NULL;
    if (why) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT, "%s reduce %u: %s",
                         pshard_coll_op_name((pshard_coll_op_t)req->op), req->reduce, why);
        return;
    }
    shard_op_t op = {
        .session = req->session,
        .agree = true,
        .group = req->group,
        .sop = {.kind = SHARD_SOP_COLLECTIVE,
                .dtype = dt,
                .coll_op = req->op,
                .count = req->count,
                .root = req->root,
                /* Only all_reduce and reduce reduce: others carry sum, whatever was sent. */
                .reduce = reduces ? req->reduce : 0},
        .opk = shard_opk_of_coll(req->op),
        .check = collective_check,
        .run = collective_run,
        .arg = (void *)req,
    };
    char err[PSHARD_ERRLEN] = "";
    Pshard__CollectiveResponse out = PSHARD__COLLECTIVE_RESPONSE__INIT;
    answer(call, shard_op_run(ctx, &op, err, sizeof(err)), err, &out.base);
}

static void handle_new_groups(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__NewGroupsRequest *req = (const Pshard__NewGroupsRequest *)request;
    shard_new_groups_arg_t a = {.req = req};
    /* With a key only the group's members call: no agreement round on the world. */
    bool keyed = req->key && req->key[0];
    shard_op_t op = {
        .session = req->session,
        .agree = !keyed,
        .sop = {.kind = SHARD_SOP_NEW_GROUPS},
        .opk = -1,
        .check = keyed ? NULL : shard_new_groups_check,
        .run = keyed ? shard_new_group_keyed_run : shard_new_groups_run,
        .arg = &a,
    };
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = shard_op_run(ctx, &op, err, sizeof(err));
    free(a.words);
    uint32_t *ids = rc == PSHARD_OK ? calloc(req->n_groups, sizeof(uint32_t)) : NULL;
    if (rc == PSHARD_OK && !ids)
        rc = ps_errf(err, sizeof(err), PSHARD_ERR_NO_MEMORY, "out of memory");
    Pshard__NewGroupsResponse out = PSHARD__NEW_GROUPS_RESPONSE__INIT;
    for (size_t i = 0; ids && i < req->n_groups; i++)
        ids[i] = a.first_id + (uint32_t)i;
    out.ids = ids;
    out.n_ids = ids ? req->n_groups : 0;
    answer(call, rc, err, &out.base);
    free(ids);
}

/* A Step: its request; the groups it carries, encoded for the agreement; the results. */
typedef struct {
    const Pshard__StepRequest *req;
    int64_t *words;
    int64_t step;
    double norm;
} step_arg_t;

/* A Step's skip mask: ceil(nparams / 8) bytes, no bit past the last parameter. */
static pshard_status_t skip_check(const shard_model_t *m, const uint8_t *bits, size_t len,
                                  char *err, size_t errlen)
{
    size_t want = (m->nparams + 7) / 8;
    if (len != want)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "a skip mask of %zu bytes for a model of %zu parameters (it takes %zu)", len,
                       m->nparams, want);
    if (m->nparams % 8 != 0 && (bits[len - 1] >> (m->nparams % 8)) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "the skip mask names a parameter past the model's %zu", m->nparams);
    return PSHARD_OK;
}

/* Checks a Step's lr and groups and encodes the groups for the agreement. Nothing has run
 * yet, so every rank refuses alike. */
static pshard_status_t step_check(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                  char *err, size_t errlen)
{
    step_arg_t *a = op->arg;
    const Pshard__StepRequest *req = a->req;
    if (req->set_lr && req->n_groups > 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "a step carries either groups (each with its lr) or lr, not both");
    if (req->trainer_state_kept && !req->trainer_stepped)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "trainer_state_kept goes with a step of the trainer's own optimizer only");
    if (req->skip.len > 0 && (req->set_step || req->trainer_stepped))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "a skip mask goes with a step of the shard servers' optimizer only");
    if (req->set_step) {
        if (req->set_lr || req->n_groups > 0 || req->trainer_stepped)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "a step that sets the step count carries nothing else");
        if (req->set_step_to < 0 || req->set_step_to > ((int64_t)1 << 53))
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "step count %" PRId64 " is not in 0 .. 2^53", req->set_step_to);
        op->sop.set_step = true;
        op->sop.step_to = req->set_step_to;
        return PSHARD_OK;
    }
    if (req->trainer_stepped) {
        if (req->set_lr || req->n_groups > 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "a step taken by the trainer's own optimizer carries no lr or groups "
                           "(its optimizer has them)");
        if (s->model->in_backward)
            return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                           "with optimizer_in_backward the shard servers update each parameter "
                           "at its reduce-scatter, so a trainer's own optimizer would update it "
                           "twice; define the model without optimizer_in_backward to step with "
                           "the trainer's optimizer (pshard_step_trainer)");
        op->sop.trainer_stepped = true;
        /* Whether a replacement could recover this trainer's optimizer (on_cluster_event). */
        pthread_mutex_lock(&s->mu);
        s->model->trainer_state_kept = req->trainer_state_kept;
        pthread_mutex_unlock(&s->mu);
        return PSHARD_OK;
    }
    if (req->set_lr && (!(req->lr >= 0) || !isfinite(req->lr)))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "learning rate %g is not >= 0",
                       req->lr);
    op->sop.set_lr = req->set_lr;
    op->sop.lr = req->set_lr ? req->lr : 0.0;
    size_t nskip = 0;
    if (req->skip.len > 0) {
        PS_CHECK(skip_check(s->model, req->skip.data, req->skip.len, err, errlen));
        nskip = shard_model_skip_words(s->model);
    }
    if (req->n_groups == 0 && nskip == 0)
        return PSHARD_OK;
    shard_group_t *g = NULL;
    pshard_status_t rc = PSHARD_OK;
    if (req->n_groups > 0) {
        rc =
            shard_groups_from_pb(req->groups, req->n_groups, s->model->optim.kind, &g, err, errlen);
        if (rc == PSHARD_OK)
            rc = shard_model_check_groups(s->model, g, req->n_groups, err, errlen);
    }
    size_t ngw = req->n_groups * SHARD_GROUP_WORDS;
    if (rc == PSHARD_OK) {
        a->words = calloc(ngw + nskip, sizeof(int64_t));
        if (a->words) {
            if (req->n_groups > 0)
                shard_groups_encode(g, req->n_groups, a->words);
            /* The mask's bytes as little-endian words after the groups'. */
            uint64_t *mask = (uint64_t *)(a->words + ngw);
            for (size_t i = 0; i < req->skip.len; i++)
                mask[i / 8] |= (uint64_t)req->skip.data[i] << (8 * (i % 8));
        } else {
            rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        }
    }
    free(g);
    op->sop.nwords = ngw + nskip;
    op->sop.words = a->words;
    op->sop.skip = nskip > 0;
    return rc;
}

static pshard_status_t step_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                char *err, size_t errlen)
{
    step_arg_t *a = op->arg;
    pshard_status_t rc =
        shard_run_step(s, comm, s->model, &op->sop, op->ckpt_request, &a->norm, err, errlen);
    a->step = s->model->step;
    return rc;
}

static void handle_step(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__StepRequest *req = (const Pshard__StepRequest *)request;
    step_arg_t a = {.req = req};
    shard_op_t op = {.session = req->session,
                     .needs_model = "no model is defined",
                     .agree = true,
                     .sop = {.kind = SHARD_SOP_STEP},
                     .opk = SHARD_OPK_STEP,
                     .check = step_check,
                     .run = step_run,
                     .arg = &a};
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = shard_op_run(ctx, &op, err, sizeof(err));
    free(a.words);
    /* A step boundary (shard_steps.h), for the server's optimizer and a trainer's own alike;
     * a Step that only restores the count ends no step. */
    if (rc == PSHARD_OK && !req->set_step) {
        pshard_shard_server_t *s = ctx;
        shard_steps_boundary(&s->steps, ps_now_ns(), false, 0, 0);
    }
    Pshard__StepResponse out = PSHARD__STEP_RESPONSE__INIT;
    out.step = a.step;
    out.grad_norm = a.norm;
    answer(call, rc, err, &out.base);
}

/* clip_grad_norm's arguments, refused before anything runs (every rank asked alike refuses
 * alike). */
static pshard_status_t clip_check(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                  char *err, size_t errlen)
{
    if (s->model->in_backward)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "clip_grad_norm needs the accumulated gradients, but "
                       "optimizer_in_backward applies each update at its reduce-scatter and "
                       "keeps none (turn optimizer_in_backward off to clip)");
    if (op->sop.norm_type != 2.0 && !(isinf(op->sop.norm_type) && op->sop.norm_type > 0))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "norm_type %g is not supported: clip_grad_norm takes 2.0 or inf",
                       op->sop.norm_type);
    if (!(op->sop.max_norm >= 0))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "max_norm %g must be >= 0 (0 only computes the norm)", op->sop.max_norm);
    return PSHARD_OK;
}

static pshard_status_t clip_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                char *err, size_t errlen)
{
    return shard_run_clip(comm, s->model, op->sop.max_norm, op->sop.norm_type, op->arg, err,
                          errlen);
}

static void handle_clip_grad_norm(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__ClipGradNormRequest *req = (const Pshard__ClipGradNormRequest *)request;
    double norm = 0;
    shard_op_t op = {
        .session = req->session,
        .needs_model = "no model is defined",
        .agree = true,
        .sop = {.kind = SHARD_SOP_CLIP, .max_norm = req->max_norm, .norm_type = req->norm_type},
        .opk = SHARD_OPK_CLIP_GRAD_NORM,
        .check = clip_check,
        .run = clip_run,
        .arg = &norm};
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = shard_op_run(ctx, &op, err, sizeof(err));
    Pshard__ClipGradNormResponse out = PSHARD__CLIP_GRAD_NORM_RESPONSE__INIT;
    out.total_norm = norm;
    answer(call, rc, err, &out.base);
}

/* A checkpoint save: where it went and at which step. */
typedef struct {
    char dir[PATH_MAX];
    int64_t step;
} save_arg_t;

static pshard_status_t save_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                char *err, size_t errlen)
{
    save_arg_t *a = op->arg;
    pshard_status_t rc = shard_ckpt_save(s, comm, s->model, a->dir, sizeof(a->dir), err, errlen);
    a->step = s->model->step;
    return rc;
}

static void handle_checkpoint(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__CheckpointRequest *req = (const Pshard__CheckpointRequest *)request;
    save_arg_t a = {.dir = ""};
    shard_op_t op = {.session = req->session,
                     .needs_model = "no model is defined",
                     .agree = true,
                     .sop = {.kind = SHARD_SOP_SAVE},
                     .opk = -1,
                     .run = save_run,
                     .arg = &a};
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = shard_op_run(ctx, &op, err, sizeof(err));
    Pshard__CheckpointResponse out = PSHARD__CHECKPOINT_RESPONSE__INIT;
    out.step = a.step;
    out.dir = a.dir;
    answer(call, rc, err, &out.base);
}

/* Join: this rank shadows the others' operations until all have joined (shard_join_run). */
static void handle_join(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__JoinRequest *req = (const Pshard__JoinRequest *)request;
    shard_join_result_t r = {.throw_on_early_termination = req->throw_on_early_termination};
    shard_op_t op = {.session = req->session,
                     .needs_model = "define the model before joining",
                     .opk = -1,
                     .run = shard_join_run,
                     .arg = &r};
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = shard_op_run(ctx, &op, err, sizeof(err));
    Pshard__JoinResponse out = PSHARD__JOIN_RESPONSE__INIT;
    out.is_last_joiner = r.is_last_joiner;
    out.last_rank = r.last_rank;
    out.step = r.step;
    out.shadowed_ops = r.shadowed;
    out.others_raised = r.others_raised;
    answer(call, rc, err, &out.base);
}

/* ReadRegion: a client that reads nothing this long is dropped. */
#define READ_STALL_NS (60LL * 1000000000LL)

/* Chunks go out at the pace the client reads them (a bounded send queue), each one operation
 * (shard_region_read_run), which checks again that the session and the range are still valid;
 * a client that reads nothing for READ_STALL_NS is dropped. */
static void read_region(pshard_shard_server_t *s, ps_rpc_call_t *call,
                        const Pshard__RegionReadRequest *req)
{
    int64_t deadline = ps_rpc_call_deadline_ns(call);
    shard_read_chunk_t a = {.call = call, .req = req};
    shard_op_t op = {.session = req->session, .opk = -1, .run = shard_region_read_run, .arg = &a};
    /* wait: the last chunk was queued, or refused for want of room */
    for (bool wait = false;; wait = true) {
        if (wait) {
            int64_t until = ps_now_ns() + READ_STALL_NS;
            pshard_status_t w =
                ps_rpc_call_wait_writable(call, until < deadline ? until : deadline);
            if (w == PSHARD_ERR_TIMEOUT) {
                ps_rpc_call_fail(call, PSHARD_ERR_RESOURCE_EXHAUSTED,
                                 "ReadRegion: the client read nothing for %lld s",
                                 (long long)(READ_STALL_NS / 1000000000LL));
                return;
            }
            if (w != PSHARD_OK) {
                ps_rpc_call_finish(call); /* the client went away: end the call */
                return;
            }
        }
        char err[PSHARD_ERRLEN] = "";
        a.sent = PSHARD_OK;
        pshard_status_t rc = shard_op_run(s, &op, err, sizeof(err));
        if (rc != PSHARD_OK) {
            ps_rpc_call_fail(call, rc, "%s", err); /* a new session since the first chunk, say */
            return;
        }
        if (a.finished)
            return;
        /* Its connection's (or the server's) send budget is full for now: wait for room and
         * send this chunk again. */
        if (a.sent == PSHARD_ERR_RESOURCE_EXHAUSTED)
            continue;
        if (a.sent == PSHARD_ERR_CANCELLED) {
            ps_rpc_call_finish(call);
            return;
        }
        if (a.sent != PSHARD_OK) {
            ps_rpc_call_fail(call, a.sent, "ReadRegion: cannot queue a chunk");
            return;
        }
    }
}

/* A ReadRegion waits for its reader while it holds a worker of the RPC pool: so that slow or
 * stalled readers cannot take every worker from the trainer's operations, at most all but two
 * of them read regions at once (at least one). */
static void handle_read_region(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_shard_server_t *s = ctx;
    ps_rpc_load_t load;
    ps_rpc_server_load(s->srv, &load);
    int limit = load.workers > 2 ? load.workers - 2 : 1;
    int now = atomic_fetch_add(&s->region_reads, 1);
    if (now >= limit) {
        atomic_fetch_sub(&s->region_reads, 1);
        ps_rpc_call_fail(call, PSHARD_ERR_RESOURCE_EXHAUSTED,
                         "ReadRegion: %d region reads are in progress, the most this server "
                         "runs at once (its other workers stay for trainer operations); retry "
                         "when one has finished",
                         now);
        return;
    }
    read_region(s, call, (const Pshard__RegionReadRequest *)request);
    atomic_fetch_sub(&s->region_reads, 1);
}

static void handle_write_region(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__RegionWriteRequest *req = (const Pshard__RegionWriteRequest *)request;
    shard_op_t op = {
        .session = req->session, .opk = -1, .run = shard_region_write_run, .arg = (void *)req};
    char err[PSHARD_ERRLEN] = "";
    Pshard__RegionWriteResponse out = PSHARD__REGION_WRITE_RESPONSE__INIT;
    answer(call, shard_op_run(ctx, &op, err, sizeof(err)), err, &out.base);
}

/* Status runs inline on the completion-queue thread (PS_RPC_INLINE), so it answers even when
 * every worker is held by a trainer operation blocked in a collective: it reads copies under
 * s->mu, which is only ever held briefly, and never takes op_mu. */
static void handle_status(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_shard_server_t *s = ctx;
    (void)request;
    Pshard__ShardStatusResponse out = PSHARD__SHARD_STATUS_RESPONSE__INIT;
    out.name = (char *)s->cfg.name;
    out.backend = (char *)s->cfg.backend;
    out.offload = (char *)s->cfg.offload;
    char placement[32];
    if (s->dev)
        snprintf(placement, sizeof(placement), "%s:%d",
                 s->dev->host_memory ? "emulated-cuda" : "cuda", s->cfg.device);
    else
        ps_strlcpy(placement, shard_on_gpu(s) ? "host, pinned" : "host", sizeof(placement));
    out.placement = placement;
    shard_flight_t flight = {.n = 0}, *fl = &flight;
    /* One hold of s->mu for the whole snapshot: the setup thread swaps s->comm under it before
     * it destroys an old ring, so the flight records are read from a live communicator. */
    pthread_mutex_lock(&s->mu);
    pshard_comm_t *comm = s->comm;
    out.rank = s->rank;
    out.world_size = s->world;
    out.generation = s->comm_generation;
    out.joined = s->joined;
    out.joined_step = s->joined_step;
    out.shadowed_ops = s->shadowed_ops;
    out.ops_ahead = s->ops_ahead;
    out.ops_diverted = s->ops_diverted;
    out.heal = s->heal_note;
    out.transport = comm ? (char *)pshard_comm_transport(comm) : "";
    if (comm)
        shard_flight_read(comm, fl);
    out.n_flight_records = fl->n;
    out.flight_records = fl->lines;
    out.n_records = fl->n;
    out.records = fl->records;
    char *glines[32];
    char gbuf[32][320];
    size_t ng = 0;
    for (size_t i = 0; i < s->npgs && ng < 32; i++) {
        if (!s->pgs[i]->comm)
            continue;
        shard_pg_describe(s->pgs[i], gbuf[ng], sizeof(gbuf[ng]));
        glines[ng] = gbuf[ng];
        ng++;
    }
    out.n_groups = ng;
    out.groups = glines;
    shard_model_t *m = s->model;
    out.attached = s->session[0] != 0 && !s->trainer_gone;
    if (m) {
        out.params = (uint32_t)m->nparams;
        out.shard_elements = m->shard_numel;
        out.step = m->step;
        out.layout = ps_layout_kind(m->layout) == PSHARD_LAYOUT_FSDP2 ? "fsdp2" : "fsdp1";
        out.state_bytes = shard_model_state_bytes(m);
        out.device_staged_to_host = atomic_load(&m->staged_to_host);
        out.device_staged_to_device = atomic_load(&m->staged_to_device);
    }
    ps_rpc_call_reply(call, &out.base);
    pthread_mutex_unlock(&s->mu);
}

/* MarkStep: the trainer ends a step itself (shard_steps.h). Inline (no worker, no op_mu): it
 * only reads the clock, and must not wait behind the trainer's own queued operations. */
static void handle_mark_step(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_shard_server_t *s = ctx;
    const Pshard__MarkStepRequest *req = (const Pshard__MarkStepRequest *)request;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = PSHARD_OK;
    /* Counters that add them must not wrap: 2^53 per step is beyond any real batch. */
    if (req->tokens > ((uint64_t)1 << 53) || req->samples > ((uint64_t)1 << 53))
        rc = ps_errf(err, sizeof(err), PSHARD_ERR_INVALID_ARGUMENT,
                     "a step reports at most 2^53 tokens and samples (got %" PRIu64
                     " tokens, %" PRIu64 " samples)",
                     req->tokens, req->samples);
    pthread_mutex_lock(&s->mu); /* (attach_run writes the session under mu too) */
    if (rc == PSHARD_OK)
        rc = shard_session_check(s, req->session, err, sizeof(err));
    pthread_mutex_unlock(&s->mu);
    Pshard__MarkStepResponse out = PSHARD__MARK_STEP_RESPONSE__INIT;
    if (rc == PSHARD_OK) {
        shard_steps_boundary(&s->steps, ps_now_ns(), true, req->tokens, req->samples);
        shard_step_summary_t sum;
        shard_steps_summary(&s->steps, &sum);
        out.steps = sum.steps;
    }
    answer(call, rc, err, &out.base);
}

/* Resync: the trainer takes note of the step aborts so far (its operations failed with
 * STEP_ABORTED), once the ring is rebuilt (shard_op_run waits for it), and learns where
 * training goes on: the steps applied and the steps aborted. */
typedef struct {
    int64_t step, aborted;
} resync_arg_t;

static pshard_status_t resync_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                  char *err, size_t errlen)
{
    (void)comm, (void)err, (void)errlen;
    resync_arg_t *a = op->arg;
    pthread_mutex_lock(&s->mu);
    a->step = s->model->step;
    a->aborted = s->model->aborted_steps;
    pthread_mutex_unlock(&s->mu);
    return PSHARD_OK;
}

static void handle_resync(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__ResyncRequest *req = (const Pshard__ResyncRequest *)request;
    resync_arg_t a = {0};
    shard_op_t op = {.session = req->session,
                     .ack_abort = true,
                     .needs_model = "no model is defined: nothing to resync",
                     .opk = -1,
                     .run = resync_run,
                     .arg = &a};
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = shard_op_run(ctx, &op, err, sizeof(err));
    Pshard__ResyncResponse out = PSHARD__RESYNC_RESPONSE__INIT;
    out.step = a.step;
    out.aborted_steps = a.aborted;
    answer(call, rc, err, &out.base);
}

/* ---------------------------------------------------------------------------------------- */
/* The method table                                                                          */

void shard_service_add_methods(pshard_shard_server_t *s)
{
    static const struct {
        const char *name;
        const ProtobufCMessageDescriptor *desc;
        ps_rpc_handler_fn fn;
    } table[NMETHODS] = {
        {"Attach", &pshard__attach_request__descriptor, handle_attach},
        {"DefineModel", &pshard__define_model_request__descriptor, handle_define},
        {"Gather", &pshard__gather_request__descriptor, handle_gather},
        {"ReduceScatter", &pshard__reduce_scatter_request__descriptor, handle_reduce_scatter},
        {"Step", &pshard__step_request__descriptor, handle_step},
        {"Collective", &pshard__collective_request__descriptor, handle_collective},
        {"Status", &pshard__shard_status_request__descriptor, handle_status},
        {"ReadRegion", &pshard__region_read_request__descriptor, handle_read_region},
        {"WriteRegion", &pshard__region_write_request__descriptor, handle_write_region},
        {"Join", &pshard__join_request__descriptor, handle_join},
        {"Checkpoint", &pshard__checkpoint_request__descriptor, handle_checkpoint},
        {"ClipGradNorm", &pshard__clip_grad_norm_request__descriptor, handle_clip_grad_norm},
        {"NewGroups", &pshard__new_groups_request__descriptor, handle_new_groups},
        {"MarkStep", &pshard__mark_step_request__descriptor, handle_mark_step},
        {"Resync", &pshard__resync_request__descriptor, handle_resync},
    };
    for (size_t i = 0; i < NMETHODS; i++) {
        snprintf(s->paths[i], sizeof(s->paths[i]), "/pshard.ShardServer/%s", table[i].name);
        /* Status must answer while trainer operations hold every worker: inline. */
        unsigned flags = table[i].fn == handle_read_region ? PS_RPC_STREAM
                         : table[i].fn == handle_status || table[i].fn == handle_mark_step
                             ? PS_RPC_INLINE
                             : 0;
        s->methods[i] = (ps_rpc_method_t){s->paths[i], table[i].desc, table[i].fn, flags, s};
    }
    ps_rpc_server_add_methods(s->srv, s->methods, NMETHODS);
}
