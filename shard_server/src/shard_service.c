/* The shard server's trainer-facing gRPC service and its lifecycle: the handlers translate
 * each request into an operation of shard_ops.h (attach, define the model, gather,
 * reduce-scatter, step, clip_grad_norm, plain collectives, checkpoint, join) and its result
 * into the reply; status answers from copies. Membership and the communicator live in
 * shard_member.c, the regions' streaming in shard_region.c. Trainer operations run one at a
 * time on worker threads (a collective blocks), never on the completion-queue thread. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "pshard/collectives.h"
#include "pshard/coord_client.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/metrics.h"
#include "pshard/rpc.h"
#include "pshard/shard.pb-c.h"
#include "pshard/shard_server.h"
#include "pshard/util.h"

#include "shard_cuda.h"
#include "shard_internal.h"
#include "shard_ops.h"

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
    default:
        return false;
    }
}

void shard_unmap(shm_map_t *m)
{
    if (m->pinned)
        pshard_host_unpin(m->pin_device, m->base);
    if (m->base)
        munmap(m->base, m->bytes);
    memset(m, 0, sizeof(*m));
}

/* True when this server's collectives run on the GPU (host buffers staged by the backend). */
static bool on_gpu(const pshard_shard_server_t *s)
{
    return strcmp(s->cfg.backend, "nccl") == 0;
}

void shard_pin_region(pshard_shard_server_t *s, shm_map_t *m)
{
    if (!on_gpu(s) || !m->base || m->pinned)
        return;
    char err[PSHARD_ERRLEN] = "";
    if (pshard_host_pin(s->cfg.device, m->base, m->bytes, err, sizeof(err)) == PSHARD_OK) {
        m->pinned = true;
        m->pin_device = s->cfg.device;
    } else
        PS_WARN(PS_SUB_SHARD,
                "trainer region of %zu bytes stays pageable (copies to the GPU "
                "are slower): %s",
                m->bytes, err);
}

/* Maps a trainer's shared-memory object. The name must look like "/pshard-..." (letters,
 * digits, '.', '_', '-'), name a regular object of at least `bytes` bytes. */
static pshard_status_t map_shm(const char *name, uint64_t bytes, shm_map_t *out, char *err,
                               size_t errlen)
{
    size_t n = name ? strlen(name) : 0;
    if (n < 9 || n > SHM_NAME_MAX || strncmp(name, "/pshard-", 8) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "shared-memory name must be \"/pshard-...\" (at most %d bytes)",
                       SHM_NAME_MAX);
    for (size_t i = 1; i < n; i++) {
        char ch = name[i];
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                  ch == '.' || ch == '_' || ch == '-';
        if (!ok)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "shared-memory name has an invalid character at %zu", i);
    }
    if (bytes == 0 || bytes > (1ull << 46))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "shared-memory size %" PRIu64 " is out of range", bytes);
    int fd = shm_open(name, O_RDWR | O_NOFOLLOW, 0);
    if (fd < 0)
        return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "cannot open shared memory %s: %s",
                       name, strerror(errno));
    struct stat stt;
    if (fstat(fd, &stt) != 0 || !S_ISREG(stt.st_mode) || (uint64_t)stt.st_size < bytes) {
        close(fd);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "shared memory %s is smaller than the %" PRIu64 " bytes announced", name,
                       bytes);
    }
    void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot map %s: %s", name,
                       strerror(errno));
    out->base = p;
    out->bytes = (size_t)bytes;
    ps_strlcpy(out->name, name, sizeof(out->name));
    return PSHARD_OK;
}


/* Checks [offset, offset + len) lies in the region and offset is aligned to align. */
bool shard_in_region(const shm_map_t *m, uint64_t offset, uint64_t len, size_t align)
{
    return m->base && offset <= m->bytes && len <= m->bytes - offset &&
           (align == 0 || offset % align == 0);
}

/* The flight recorder's label of an operation in the step being computed: "step 12, fc3.weight"
 * (what names a stuck collective in `pshardctl status` and the logs). */
const char *shard_op_label(const shard_model_t *m, const char *what, char *buf, size_t len)
{
    snprintf(buf, len, "step %" PRId64 ", %s", m ? m->step + 1 : 0, what);
    return buf;
}

bool shard_session_ok(pshard_shard_server_t *s, ps_rpc_call_t *call, const char *session)
{
    char err[PSHARD_ERRLEN];
    pshard_status_t rc = shard_session_check(s, session, err, sizeof(err));
    if (rc != PSHARD_OK)
        ps_rpc_call_fail(call, rc, "%s", err);
    return rc == PSHARD_OK;
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

pshard_status_t shard_groups_from_pb(struct Pshard__OptimizerGroup *const *pb, size_t n,
                                     ps_optim_kind_t kind, shard_group_t **out, char *err,
                                     size_t errlen)
{
    *out = NULL;
    if (n == 0)
        return PSHARD_OK;
    if (n > SHARD_MAX_GROUPS)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%zu parameter groups; the limit is %d", n, SHARD_MAX_GROUPS);
    shard_group_t *g = calloc(n, sizeof(*g));
    if (!g)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const Pshard__OptimizerGroup *p = pb[i];
        g[i].cfg = (ps_optim_config_t){.kind = kind,
                                       .lr = p->lr,
                                       .momentum = p->momentum,
                                       .dampening = p->dampening,
                                       .nesterov = p->nesterov,
                                       .weight_decay = p->weight_decay,
                                       .beta1 = p->beta1,
                                       .beta2 = p->beta2,
                                       .eps = p->eps};
        g[i].frozen = p->frozen;
    }
    *out = g;
    return PSHARD_OK;
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

static void handle_attach(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_shard_server_t *s = ctx;
    const Pshard__AttachRequest *req = (const Pshard__AttachRequest *)request;
    pshard_status_t crc = PSHARD_OK;
    char cerr[PSHARD_ERRLEN] = "";
    pshard_comm_t *comm = shard_op_comm(s, &crc, cerr, sizeof(cerr));
    if (!comm) {
        ps_rpc_call_fail(call, crc, "%s", cerr);
        return;
    }
    if (req->rank != pshard_comm_rank(comm)) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                         "trainer rank %d attached to the shard server of rank %d (RANK and "
                         "PSHARD_SERVER disagree)",
                         req->rank, pshard_comm_rank(comm));
        return;
    }
    char err[PSHARD_ERRLEN] = "";
    if (session_held_by_live_trainer(s, err, sizeof(err))) {
        ps_rpc_call_fail(call, PSHARD_ERR_ALREADY_EXISTS, "%s", err);
        return;
    }
    shm_map_t m = {0};
    bool remote = !req->shm_name || !req->shm_name[0];
    pshard_status_t rc = remote ? shard_alloc_private(req->shm_bytes, &m, err, sizeof(err))
                                : map_shm(req->shm_name, req->shm_bytes, &m, err, sizeof(err));
    if (rc != PSHARD_OK) {
        ps_rpc_call_fail(call, rc, "%s", err);
        return;
    }
    shard_pin_region(s, &m);
    pthread_mutex_lock(&s->op_mu);
    /* Again under op_mu, which every Attach takes: two at once cannot both pass. */
    if (session_held_by_live_trainer(s, err, sizeof(err))) {
        pthread_mutex_unlock(&s->op_mu);
        shard_unmap(&m);
        ps_rpc_call_fail(call, PSHARD_ERR_ALREADY_EXISTS, "%s", err);
        return;
    }
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
    char session[sizeof(s->session)];
    for (int i = 0; i < 16; i++)
        snprintf(session + 2 * i, 3, "%02x", rnd[i]);
    pthread_mutex_lock(&s->mu);
    memcpy(s->session, session, sizeof(session));
    ps_strlcpy(s->trainer_name, req->member_name ? req->member_name : "",
               sizeof(s->trainer_name));
    s->trainer_seen = false; /* until the coordinator shows its lease */
    s->attached_ns = ps_now_ns();
    pthread_mutex_unlock(&s->mu);
    Pshard__AttachResponse out = PSHARD__ATTACH_RESPONSE__INIT;
    out.session = s->session;
    out.rank = pshard_comm_rank(comm);
    out.world_size = pshard_comm_world_size(comm);
    out.generation = s->comm_generation;
    out.backend = (char *)s->cfg.backend;
    out.offload = (char *)s->cfg.offload;
    out.coordinator = (char *)s->cfg.coordinator;
    out.job = (char *)(s->cfg.job ? s->cfg.job : "");
    PS_INFO(PS_SUB_SHARD, "trainer '%s' attached (%" PRIu64 " bytes of scratch)",
            req->trainer_name, req->shm_bytes);
    ps_rpc_call_reply(call, &out.base);
    pthread_mutex_unlock(&s->op_mu);
}

/* Compares this rank's definition with every other rank's through the coordinator's store. */
static pshard_status_t check_definitions(pshard_shard_server_t *s, const shard_model_t *m,
                                         char *err, size_t errlen)
{
    if (s->define_generation != s->comm_generation) {
        /* A new ring: nobody reads this rank's definitions of the old generation any more
         * (every rank of this ring has left that one), so they leave the store. */
        for (uint64_t a = 1; a <= s->define_attempts; a++) {
            char old[128];
            snprintf(old, sizeof(old), "pshard/model/g%" PRIu64 "/a%" PRIu64 "/rank/%d",
                     s->define_generation, a, m->rank);
            char derr[PSHARD_ERRLEN] = "";
            if (ps_coord_store_remove(s->coord, old, 2000, derr, sizeof(derr)) != PSHARD_OK)
                PS_DEBUG(PS_SUB_SHARD, "could not delete %s: %s", old, derr);
        }
        s->define_generation = s->comm_generation;
        s->define_attempts = 0;
    }
    uint64_t attempt = ++s->define_attempts;
    char key[128];
    snprintf(key, sizeof(key), "pshard/model/g%" PRIu64 "/a%" PRIu64 "/rank/%d",
             s->comm_generation, attempt, m->rank);
    size_t spec_len = strlen(m->spec_text);
    if (spec_len > (1u << 20))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "the model definition is too large to compare (%zu bytes)", spec_len);
    pshard_status_t rc = ps_coord_store_put(s->coord, key, m->spec_text, spec_len, 10000, err,
                                            errlen);
    if (rc != PSHARD_OK)
        return rc;
    for (int r = 0; r < m->world; r++) {
        if (r == m->rank)
            continue;
        char other[128];
        snprintf(other, sizeof(other), "pshard/model/g%" PRIu64 "/a%" PRIu64 "/rank/%d",
                 s->comm_generation, attempt, r);
        const char *keys[1] = {other};
        /* Wait in short slices so that a stopping server (or an aborted ring) does not sit
         * in a store wait for the whole collective timeout. */
        int64_t limit_ms = s->cfg.coll_timeout_ms > 0 ? s->cfg.coll_timeout_ms : 600000;
        int64_t give_up = ps_now_ns() + limit_ms * 1000000;
        Pshard__StoreWaitResponse *wr = NULL;
        for (;;) {
            char werr[PSHARD_ERRLEN] = "";
            rc = ps_coord_store_await(s->coord, keys, 1, 500, &wr, werr, sizeof(werr));
            if (rc == PSHARD_OK)
                break;
            bool stopping = atomic_load(&s->stop);
            if (rc != PSHARD_ERR_TIMEOUT || stopping || ps_now_ns() > give_up) {
                ps_errf(err, errlen, rc, "rank %d never defined its model%s: %s", r,
                        stopping ? " (this server is stopping)" : "", werr);
                return rc;
            }
        }
        char *text = wr->n_values == 1 ? strndup((const char *)wr->values[0].data,
                                                 wr->values[0].len)
                                       : NULL;
        protobuf_c_message_free_unpacked(&wr->base, NULL);
        if (!text)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        rc = shard_model_compare(m, text, r, err, errlen);
        free(text);
        if (rc != PSHARD_OK)
            return rc;
    }
    return PSHARD_OK;
}

/* Everything about the initial values that can be checked from the request alone, before
 * anything is allocated for the model: one offset per parameter where this rank reads initial
 * values, each inside the region of region_bytes. Definitions shard_model_create refuses
 * anyway (too many parameters, bad shapes) are left to it: it names the problem better. */
static pshard_status_t check_init_offsets(const Pshard__DefineModelRequest *req,
                                          uint64_t region_bytes, int rank, char *err,
                                          size_t errlen)
{
    bool has_data = req->init != PSHARD__INIT_MODE__INIT_FROM_RANK0 || rank == 0;
    if (!has_data || req->n_params == 0 || req->n_params > SHARD_MAX_PARAMS)
        return PSHARD_OK;
    if (req->n_init_offsets != req->n_params)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "init_offsets has %zu entries for %zu parameters", req->n_init_offsets,
                       req->n_params);
    for (size_t i = 0; i < req->n_params; i++) {
        const Pshard__ParamSpec *p = req->params[i];
        uint64_t numel = 1;
        bool valid = p->n_shape > 0 && p->n_shape <= SHARD_MAX_DIMS;
        for (size_t d = 0; d < p->n_shape && valid; d++)
            valid = p->shape[d] > 0 && (uint64_t)p->shape[d] <= (1ull << 40) &&
                    !__builtin_mul_overflow(numel, (uint64_t)p->shape[d], &numel);
        uint64_t end;
        if (valid && (__builtin_mul_overflow(numel, 4, &end) ||
                      __builtin_add_overflow(end, req->init_offsets[i], &end) ||
                      end > region_bytes || req->init_offsets[i] % 4 != 0))
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "init values of '%.255s' lie outside the model region (offset %" PRIu64
                           ", %" PRIu64 " elements, region %" PRIu64 " bytes)",
                           p->name ? p->name : "", req->init_offsets[i], numel, region_bytes);
    }
    return PSHARD_OK;
}

static pshard_status_t init_params(pshard_comm_t *comm, shard_model_t *m,
                                   const Pshard__DefineModelRequest *req, const shm_map_t *region,
                                   char *err, size_t errlen)
{
    /* check_init_offsets validated every offset this rank reads, before the model existed. */
    bool from_rank0 = req->init == PSHARD__INIT_MODE__INIT_FROM_RANK0;
    bool has_data = !from_rank0 || m->rank == 0;
    float *full = NULL;
    if (from_rank0 && m->world > 1) {
        full = malloc(m->max_numel * sizeof(float) + 1);
        if (!full)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    pshard_status_t rc = PSHARD_OK;
    for (size_t p = 0; p < m->nparams && rc == PSHARD_OK; p++) {
        size_t numel = m->params[p].numel;
        const float *src = NULL;
        if (has_data)
            src = (const float *)((uint8_t *)region->base + req->init_offsets[p]);
        if (from_rank0 && m->world > 1) {
            pshard_coll_args_t a = {.op = PSHARD_COLL_BROADCAST, .dtype = PSHARD_FP32, .root = 0,
                                    .send = src, .recv = full, .count = numel,
                                    .tag = ((uint64_t)1 << 63) | p, .label = m->params[p].name};
            rc = pshard_coll_run(comm, &a, err, errlen);
            src = full;
        }
        if (rc == PSHARD_OK) {
            size_t off = ps_layout_piece_offset(m->layout, p, m->rank);
            size_t cnt = ps_layout_counts(m->layout, p)[m->rank];
            float *dst = m->master + ps_layout_shard_offset(m->layout, p, m->rank);
            if (m->dev)
                rc = m->dev->copy(m->device, dst, src + off, cnt * sizeof(float), err, errlen);
            else
                memcpy(dst, src + off, cnt * sizeof(float));
        }
        /* This server is done with those trainer pages (the trainer discards them after
         * DefineModel): drop them from its own mapping now, so the definition's peak holds
         * one parameter's initial values, not all. Shared mappings only: the pages keep their
         * contents, should another parameter's offsets overlap these. Not when pinned: the
         * pages stay resident for the GPU anyway. */
        if (rc == PSHARD_OK && has_data && region->name[0] && !region->pinned) {
            size_t page = (size_t)sysconf(_SC_PAGESIZE);
            uintptr_t a0 = (uintptr_t)((const uint8_t *)region->base + req->init_offsets[p]);
            uintptr_t start = (a0 + page - 1) / page * page;
            uintptr_t end = (a0 + numel * sizeof(float)) / page * page;
            if (end > start)
                madvise((void *)start, end - start, MADV_DONTNEED);
        }
    }
    free(full);
    return rc;
}

/* A DefineModel: its request, and what the reply reports. */
typedef struct {
    const Pshard__DefineModelRequest *req;
    char resumed_from[4096];
    uint64_t shard_numel, fingerprint;
    int64_t step;
} define_arg_t;

/* Defines (or redefines) the model: checks everything this rank can alone, compares the
 * definition with the other ranks' through the store, takes the initial values (from rank 0,
 * or each rank's own) or the newest checkpoint, and adopts the new model and region only when
 * all of it succeeded. */
static pshard_status_t define_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                  char *err, size_t errlen)
{
    define_arg_t *a = op->arg;
    const Pshard__DefineModelRequest *req = a->req;
    char *resumed_from = a->resumed_from;
    pshard_status_t rc = PSHARD_OK;
    size_t n = req->n_params;
    const char **names = calloc(n ? n : 1, sizeof(char *));
    const int64_t **shapes = calloc(n ? n : 1, sizeof(int64_t *));
    size_t *ndims = calloc(n ? n : 1, sizeof(size_t));
    shard_model_t *m = NULL;
    shard_group_t *groups = NULL;
    shm_map_t region = {0};
    if (!names || !shapes || !ndims) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        names[i] = req->params[i]->name;
        shapes[i] = req->params[i]->shape;
        ndims[i] = req->params[i]->n_shape;
    }
    ps_optim_config_t oc;
    const Pshard__OptimizerConfig *po = req->optimizer;
    ps_optim_kind_t kind = !po                                        ? PS_OPTIM_SGD
                           : po->kind == PSHARD__OPTIMIZER_KIND__ADAM  ? PS_OPTIM_ADAM
                           : po->kind == PSHARD__OPTIMIZER_KIND__ADAMW ? PS_OPTIM_ADAMW
                                                                       : PS_OPTIM_SGD;
    if (po && po->kind != PSHARD__OPTIMIZER_KIND__SGD && po->kind != PSHARD__OPTIMIZER_KIND__ADAM &&
        po->kind != PSHARD__OPTIMIZER_KIND__ADAMW) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown optimizer %d",
                     (int)po->kind);
        goto out;
    }
    ps_optim_defaults(kind, &oc);
    if (po) {
        oc.lr = po->lr;
        oc.momentum = po->momentum;
        oc.dampening = po->dampening;
        oc.nesterov = po->nesterov;
        oc.weight_decay = po->weight_decay;
        if (kind != PS_OPTIM_SGD) {
            oc.beta1 = po->beta1;
            oc.beta2 = po->beta2;
            oc.eps = po->eps;
        }
    }
    pshard_layout_t layout = req->layout == PSHARD__LAYOUT__FSDP1 ? PSHARD_LAYOUT_FSDP1
                                                                  : PSHARD_LAYOUT_FSDP2;
    if (req->layout != PSHARD__LAYOUT__FSDP1 && req->layout != PSHARD__LAYOUT__FSDP2) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown layout %d",
                     (int)req->layout);
        goto out;
    }
    if (req->init != PSHARD__INIT_MODE__INIT_FROM_RANK0 &&
        req->init != PSHARD__INIT_MODE__INIT_LOCAL) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown init mode %d",
                     (int)req->init);
        goto out;
    }
    rc = shard_region_size_ok(s, req->shm_bytes, err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    /* Map the region before allocating shard state, and adopt both only when everything
     * succeeded: a refused definition leaves the previous model and region in place. */
    if (!req->shm_name || !req->shm_name[0]) {
        /* A remote trainer: the region its WriteRegion calls filled (at least sized). */
        if (!s->pending_model.base || s->pending_model.bytes != req->shm_bytes) {
            rc = ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                         "no %" PRIu64 "-byte model region was written (remote trainers send "
                         "WriteRegion with region_bytes first)",
                         req->shm_bytes);
            goto out;
        }
        region = s->pending_model;
        memset(&s->pending_model, 0, sizeof(s->pending_model));
    } else {
        rc = map_shm(req->shm_name, req->shm_bytes, &region, err, errlen);
        if (rc != PSHARD_OK)
            goto out;
    }
    rc = check_init_offsets(req, region.bytes, pshard_comm_rank(comm), err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    rc = shard_groups_from_pb(req->groups, req->n_groups, kind, &groups, err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    rc = shard_model_create(pshard_comm_rank(comm), pshard_comm_world_size(comm), layout, n, names,
                            shapes, ndims, &oc, groups, req->n_groups, req->param_groups,
                            req->n_param_groups, po ? po->max_grad_norm : 0,
                            po && po->in_backward, s->dev, s->cfg.device, s->max_model_bytes, &m,
                            err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    rc = check_definitions(s, m, err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    if (on_gpu(s)) {
        shard_pin_region(s, &region);
        if (shard_model_pin(m, s->cfg.device, err, errlen) != PSHARD_OK)
            PS_WARN(PS_SUB_SHARD, "shard state stays pageable (copies to the GPU are slower): %s",
                    err);
    }
    rc = init_params(comm, m, req, &region, err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    /* --resume: the newest committed checkpoint replaces the initial values (collective). */
    if (s->cfg.resume && *s->cfg.resume) {
        bool restored = false;
        rc = shard_ckpt_load(s, comm, m, s->cfg.resume, &restored, resumed_from,
                             sizeof(a->resumed_from), err, errlen);
        if (rc != PSHARD_OK)
            goto out;
    }
    shard_unmap(&s->model_shm);
    s->model_shm = region;
    memset(&region, 0, sizeof(region));
    /* Status reads the model under s->mu without waiting for trainer operations. */
    pthread_mutex_lock(&s->mu);
    shard_model_t *old = s->model;
    s->model = m;
    pthread_mutex_unlock(&s->mu);
    shard_model_free(old);
    PS_INFO(PS_SUB_SHARD, "model defined: %zu parameters, %zu elements on this rank (%s)", n,
            m->shard_numel, layout == PSHARD_LAYOUT_FSDP2 ? "fsdp2" : "fsdp1");
    m = NULL;
out:
    shard_unmap(&region);
    shard_model_free(m);
    free(groups);
    free(names);
    free(shapes);
    free(ndims);
    if (rc == PSHARD_OK) {
        a->fingerprint = s->model->fingerprint;
        a->shard_numel = s->model->shard_numel;
        a->step = s->model->step;
    }
    return rc;
}

static void handle_define(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__DefineModelRequest *req = (const Pshard__DefineModelRequest *)request;
    define_arg_t a = {.req = req, .resumed_from = ""};
    shard_op_t op = {.session = req->session, .opk = -1, .run = define_run, .arg = &a};
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = shard_op_run(ctx, &op, err, sizeof(err));
    Pshard__DefineModelResponse out = PSHARD__DEFINE_MODEL_RESPONSE__INIT;
    char fp[32];
    snprintf(fp, sizeof(fp), "%016" PRIx64, a.fingerprint);
    out.shard_elements = a.shard_numel;
    out.fingerprint = fp;
    out.step = a.step;
    out.resumed_from = a.resumed_from;
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
static pshard_status_t tensors_check(pshard_shard_server_t *s, pshard_comm_t *comm,
                                     shard_op_t *op, char *err, size_t errlen)
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
        if (!shard_in_region(&s->model_shm, t[i]->offset, (uint64_t)p->numel * es, es))
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "buffer of '%s' (%zu x %s at offset %" PRIu64
                           ") lies outside the model region of %zu bytes or is misaligned",
                           p->name, p->numel, pshard_dtype_name(dt), t[i]->offset,
                           s->model_shm.bytes);
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
static pshard_status_t tensors_run(pshard_shard_server_t *s, pshard_comm_t *comm,
                                   shard_op_t *op, char *err, size_t errlen)
{
    tensors_arg_t *a = op->arg;
    shard_model_t *m = s->model;
    for (size_t i = 0; i < a->n; i++) {
        uint8_t *buf = (uint8_t *)s->model_shm.base + a->tensors[i]->offset;
        uint32_t p = a->tensors[i]->param;
        PS_CHECK(op->sop.kind == SHARD_SOP_GATHER
                     ? shard_gather_one(comm, m, p, op->sop.dtype, buf, err, errlen)
                     : shard_reduce_scatter_one(comm, m, p, op->sop.dtype, buf, op->active, err,
                                                errlen));
    }
    return PSHARD_OK;
}

/* What Gather and ReduceScatter share: the dtype, then the operation. */
static void tensor_op(pshard_shard_server_t *s, ps_rpc_call_t *call, bool gather,
                      const char *session, Pshard__TensorRef **tensors, size_t n,
                      Pshard__DType dtype_pb, const ProtobufCMessage *reply)
{
    pshard_dtype_t dt;
    bool dt_ok = dtype_from_pb(dtype_pb, &dt) &&
                 (gather ? dt != PSHARD_INT64 : (dt == PSHARD_FP32 || dt == PSHARD_BF16));
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
    tensor_op(ctx, call, false, req->session, req->tensors, req->n_tensors, req->dtype,
              &out.base);
}

/* A plain collective's buffers lie in the scratch region (checked under op_mu: a
 * re-attach replaces the region). */
static pshard_status_t collective_check(pshard_shard_server_t *s, pshard_comm_t *comm,
                                        shard_op_t *op, char *err, size_t errlen)
{
    const Pshard__CollectiveRequest *req = op->arg;
    size_t es = pshard_dtype_size(op->sop.dtype);
    uint64_t send_bytes = req->count * es;
    uint64_t recv_bytes = req->op == PSHARD_COLL_ALL_GATHER
                              ? send_bytes * (uint64_t)pshard_comm_world_size(comm)
                              : send_bytes;
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

static pshard_status_t collective_run(pshard_shard_server_t *s, pshard_comm_t *comm,
                                      shard_op_t *op, char *err, size_t errlen)
{
    const Pshard__CollectiveRequest *req = op->arg;
    uint8_t *base = s->scratch.base;
    return shard_run_collective(comm, &op->sop, base + req->send_offset,
                                base + req->recv_offset, op->active, err, errlen);
}

static void handle_collective(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const Pshard__CollectiveRequest *req = (const Pshard__CollectiveRequest *)request;
    pshard_dtype_t dt;
    if (!dtype_from_pb(req->dtype, &dt)) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT, "unknown dtype %d", (int)req->dtype);
        return;
    }
    if (req->op != PSHARD_COLL_ALL_GATHER && req->op != PSHARD_COLL_ALL_REDUCE &&
        req->op != PSHARD_COLL_BROADCAST && req->op != PSHARD_COLL_BARRIER) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                         "op %u is not one of all_gather (1), all_reduce (3), broadcast (4), "
                         "barrier (5)",
                         req->op);
        return;
    }
    shard_op_t op = {
        .session = req->session,
        .agree = true,
        .sop = {.kind = SHARD_SOP_COLLECTIVE, .dtype = dt, .coll_op = req->op,
                .count = req->count, .root = req->root, .average = req->reduce != 0},
        .opk = shard_opk_of_coll(req->op),
        .check = collective_check,
        .run = collective_run,
        .arg = (void *)req,
    };
    char err[PSHARD_ERRLEN] = "";
    Pshard__CollectiveResponse out = PSHARD__COLLECTIVE_RESPONSE__INIT;
    answer(call, shard_op_run(ctx, &op, err, sizeof(err)), err, &out.base);
}

/* A Step: its request; the groups it carries, encoded for the agreement; the results. */
typedef struct {
    const Pshard__StepRequest *req;
    int64_t *words;
    int64_t step;
    double norm;
} step_arg_t;

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
    if (req->set_lr && (!(req->lr >= 0) || !isfinite(req->lr)))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "learning rate %g is not >= 0", req->lr);
    op->sop.set_lr = req->set_lr;
    op->sop.lr = req->set_lr ? req->lr : 0.0;
    if (req->n_groups == 0)
        return PSHARD_OK;
    shard_group_t *g = NULL;
    pshard_status_t rc = shard_groups_from_pb(req->groups, req->n_groups, s->model->optim.kind,
                                              &g, err, errlen);
    if (rc == PSHARD_OK)
        rc = shard_model_check_groups(s->model, g, req->n_groups, err, errlen);
    if (rc == PSHARD_OK) {
        a->words = malloc(req->n_groups * SHARD_GROUP_WORDS * sizeof(int64_t));
        if (a->words)
            shard_groups_encode(g, req->n_groups, a->words);
        else
            rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    free(g);
    op->sop.nwords = req->n_groups * SHARD_GROUP_WORDS;
    op->sop.words = a->words;
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

static void handle_clip_grad_norm(ps_rpc_call_t *call, const ProtobufCMessage *request,
                                  void *ctx)
{
    const Pshard__ClipGradNormRequest *req = (const Pshard__ClipGradNormRequest *)request;
    double norm = 0;
    shard_op_t op = {.session = req->session,
                     .needs_model = "no model is defined",
                     .agree = true,
                     .sop = {.kind = SHARD_SOP_CLIP, .max_norm = req->max_norm,
                             .norm_type = req->norm_type},
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
    answer(call, rc, err, &out.base);
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
        ps_strlcpy(placement, on_gpu(s) ? "host, pinned" : "host", sizeof(placement));
    out.placement = placement;
    char *lines[32];
    char buf[32][256];
    size_t nl = 0;
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
    if (comm) {
        pshard_coll_record_t recs[32];
        size_t n = pshard_comm_flight_records(comm, recs, 32);
        for (size_t i = 0; i < n; i++) {
            pshard_coll_record_format(comm, &recs[i], buf[nl], sizeof(buf[nl]));
            lines[nl] = buf[nl];
            nl++;
        }
    }
    out.n_flight_records = nl;
    out.flight_records = lines;
    shard_model_t *m = s->model;
    out.attached = s->session[0] != 0;
    if (m) {
        out.params = (uint32_t)m->nparams;
        out.shard_elements = m->shard_numel;
        out.step = m->step;
        out.layout = ps_layout_kind(m->layout) == PSHARD_LAYOUT_FSDP2 ? "fsdp2" : "fsdp1";
        out.state_bytes = shard_model_state_bytes(m);
    }
    ps_rpc_call_reply(call, &out.base);
    pthread_mutex_unlock(&s->mu);
}

/* ---------------------------------------------------------------------------------------- */
/* Lifecycle                                                                                 */

static const char *own(pshard_shard_server_t *s, int slot, const char *v)
{
    s->strings[slot] = v ? strdup(v) : NULL;
    return s->strings[slot];
}

int pshard_shard_server_port(const pshard_shard_server_t *s)
{
    return ps_rpc_server_port(s->srv);
}

int pshard_shard_server_metrics_port(const pshard_shard_server_t *s)
{
    return s->metrics ? ps_metrics_server_port(s->metrics) : 0;
}

pshard_status_t pshard_shard_server_error(const pshard_shard_server_t *s, char *err,
                                          size_t errlen)
{
    pshard_shard_server_t *m = (pshard_shard_server_t *)s;
    pthread_mutex_lock(&m->mu);
    pshard_status_t st = m->fatal;
    if (st != PSHARD_OK)
        ps_errf(err, errlen, st, "%s", m->fatal_msg);
    pthread_mutex_unlock(&m->mu);
    return st;
}

/* What one model may take by default: the machine's memory, or the cgroup v2 limit of this
 * process (a container's) when that is smaller. 0 when neither is known (no cap). */
static uint64_t machine_memory(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    uint64_t mem = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    FILE *f = fopen("/sys/fs/cgroup/memory.max", "re");
    if (f) {
        unsigned long long lim;
        if (fscanf(f, "%llu", &lim) == 1 && lim > 0 && (mem == 0 || lim < mem))
            mem = lim; /* "max" (no limit) does not parse */
        fclose(f);
    }
    return mem;
}

pshard_shard_server_t *pshard_shard_server_start(const pshard_shard_server_config_t *cfg,
                                                 char *err, size_t errlen)
{
    if (!cfg->coordinator || !cfg->listen || !cfg->name) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "a shard server needs --coordinator, --listen and --name");
        return NULL;
    }
    const char *backend = cfg->backend ? cfg->backend : "tcp";
    const char *offload = cfg->offload ? cfg->offload : "none";
    if (strcmp(backend, "tcp") != 0 && strcmp(backend, "nccl") != 0) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "--backend must be tcp or nccl");
        return NULL;
    }
    if (strcmp(offload, "none") != 0 && strcmp(offload, "cpu") != 0) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "--offload must be none or cpu");
        return NULL;
    }
    bool emulate = getenv("PSHARD_TEST_EMULATE_DEVICE") &&
                   strcmp(getenv("PSHARD_TEST_EMULATE_DEVICE"), "1") == 0;
    if (strcmp(backend, "nccl") == 0 && strcmp(offload, "cpu") != 0 && !shard_dev_cuda()) {
        ps_errf(err, errlen, PSHARD_ERR_UNIMPLEMENTED,
                "--backend nccl with --offload none keeps shards and optimizer state in GPU "
                "memory, but this pshard-server was built without nvcc (no CUDA kernels); run "
                "--backend nccl --offload cpu (slices and optimizer state in pinned host "
                "memory, collectives on the GPU through NCCL, like FSDP's CPUOffload)");
        return NULL;
    }
    if (strcmp(backend, "nccl") == 0 &&
        pshard_cuda_check_device(cfg->device, err, errlen) != PSHARD_OK) {
        size_t used = strlen(err);
        if (used + 1 < errlen)
            snprintf(err + used, errlen - used, " (--backend nccl needs a GPU; --device %d)",
                     cfg->device);
        return NULL;
    }
    pshard_shard_server_t *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->cfg = *cfg;
    s->cfg.coordinator = own(s, 0, cfg->coordinator);
    s->cfg.listen = own(s, 1, cfg->listen);
    s->cfg.advertise = own(s, 2, cfg->advertise);
    s->cfg.name = own(s, 3, cfg->name);
    s->cfg.node = own(s, 4, cfg->node);
    s->cfg.backend = own(s, 5, backend);
    s->cfg.offload = own(s, 6, offload);
    /* Shards in GPU memory: nccl without --offload cpu; the tests' host emulation of it: tcp
     * without --offload cpu and PSHARD_TEST_EMULATE_DEVICE=1 (see shard_cuda.h). */
    if (strcmp(offload, "cpu") != 0)
        s->dev = strcmp(backend, "nccl") == 0 ? shard_dev_cuda()
                 : emulate                    ? &shard_dev_emulated
                                              : NULL;
    if (s->dev && s->dev->host_memory)
        PS_WARN(PS_SUB_SHARD, "PSHARD_TEST_EMULATE_DEVICE=1: shards in host memory standing in "
                              "for GPU memory (a test mode)");
    s->cfg.data_host = own(s, 7, cfg->data_host);
    s->cfg.token = own(s, 8, cfg->token);
    s->cfg.checkpoint_dir = own(s, 9, cfg->checkpoint_dir);
    s->cfg.resume = own(s, 10, cfg->resume);
    s->cfg.job = own(s, 11, cfg->job);
    s->max_model_bytes = cfg->max_model_memory > 0 ? (uint64_t)cfg->max_model_memory
                                                   : machine_memory();
    if (s->cfg.checkpoint_keep <= 0)
        s->cfg.checkpoint_keep = 3;
    s->rank = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_mutex_init(&s->op_mu, NULL);
    pthread_mutex_init(&s->health_mu, NULL);
    atomic_init(&s->stop, false);
    atomic_init(&s->serving, 2);
    atomic_init(&s->region_reads, 0);
    s->started_ns = ps_now_ns();

    ps_rpc_server_config_t rcfg = {
        .listen = cfg->listen,
        .tls_cert_file = cfg->tls_cert_file,
        .tls_key_file = cfg->tls_key_file,
        .tls_client_ca_file = cfg->tls_client_ca_file,
        .token = cfg->token,
        .max_message_bytes = cfg->max_message_bytes,
        .worker_threads = 4,
        .cq_threads = 1,
    };
    s->srv = ps_rpc_server_create(&rcfg, err, errlen);
    if (!s->srv) {
        pshard_shard_server_stop(s);
        return NULL;
    }
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
        {"ReadRegion", &pshard__region_read_request__descriptor, shard_handle_read_region},
        {"WriteRegion", &pshard__region_write_request__descriptor, shard_handle_write_region},
        {"Join", &pshard__join_request__descriptor, handle_join},
        {"Checkpoint", &pshard__checkpoint_request__descriptor, handle_checkpoint},
        {"ClipGradNorm", &pshard__clip_grad_norm_request__descriptor,
         handle_clip_grad_norm},
    };
    for (size_t i = 0; i < NMETHODS; i++) {
        snprintf(s->paths[i], sizeof(s->paths[i]), "/pshard.ShardServer/%s", table[i].name);
        /* Status must answer while trainer operations hold every worker: inline. */
        unsigned flags = table[i].fn == shard_handle_read_region ? PS_RPC_STREAM
                         : table[i].fn == handle_status          ? PS_RPC_INLINE
                                                                 : 0;
        s->methods[i] = (ps_rpc_method_t){s->paths[i], table[i].desc, table[i].fn, flags, s};
    }
    ps_rpc_server_add_methods(s->srv, s->methods, NMETHODS);
    if (ps_rpc_server_start(s->srv) < 0) {
        ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot start the gRPC server");
        pshard_shard_server_stop(s);
        return NULL;
    }
    ps_rpc_server_set_health(s->srv, "pshard.ShardServer", 2);
    /* Advertise HOST:PORT with the port actually bound. */
    char host[256];
    ps_strlcpy(host, cfg->advertise ? cfg->advertise : cfg->listen, sizeof(host));
    char *colon = strrchr(host, ':');
    if (colon)
        *colon = '\0';
    if (strcmp(host, "0.0.0.0") == 0 || host[0] == '\0')
        ps_strlcpy(host, "127.0.0.1", sizeof(host));
    snprintf(s->advertise, sizeof(s->advertise), "%s:%d", host, ps_rpc_server_port(s->srv));

    ps_rpc_channel_config_t ccfg = {.target = cfg->coordinator,
                                    .token = cfg->token,
                                    .tls_ca_file = cfg->coord_tls_ca_file,
                                    .job = cfg->job,
                                    /* Status of a large job is larger than 4 MiB */
                                    .max_message_bytes = 64 << 20};
    s->coord = ps_rpc_channel_create(&ccfg, err, errlen);
    if (!s->coord) {
        pshard_shard_server_stop(s);
        return NULL;
    }
    if (shard_lease_start(s, err, errlen) != PSHARD_OK) {
        pshard_shard_server_stop(s);
        return NULL;
    }
    if (pthread_create(&s->setup_thread, NULL, shard_setup_main, s) == 0)
        s->setup_started = true;
    if (pthread_create(&s->watch_thread, NULL, shard_watch_main, s) == 0)
        s->watch_started = true;
    if (pthread_create(&s->monitor_thread, NULL, shard_monitor_main, s) == 0)
        s->monitor_started = true;
    if (cfg->metrics_listen && *cfg->metrics_listen) {
        s->metrics = ps_metrics_server_start(cfg->metrics_listen, shard_metrics_collect, s, err,
                                             errlen);
        if (!s->metrics) {
            pshard_shard_server_stop(s);
            return NULL;
        }
    }
    return s;
}

void pshard_shard_server_stop(pshard_shard_server_t *s)
{
    if (!s)
        return;
    atomic_store(&s->stop, true);
    s->stop_flag = 1;
    pthread_mutex_lock(&s->mu);
    pthread_cond_broadcast(&s->cv);
    pshard_comm_t *comm = s->comm;
    pthread_mutex_unlock(&s->mu);
    /* Release a trainer operation blocked in a collective before joining anything. */
    if (comm)
        pshard_comm_abort(comm, "shard server stopping");
    if (s->setup_started)
        pthread_join(s->setup_thread, NULL);
    /* Ends the heartbeats and leaves the job. */
    ps_coord_lease_stop(s->lease);
    s->lease = NULL;
    if (s->watch_started)
        pthread_join(s->watch_thread, NULL);
    if (s->monitor_started)
        pthread_join(s->monitor_thread, NULL);
    /* Scrapes read the RPC server's counters: end them first. */
    ps_metrics_server_stop(s->metrics);
    ps_rpc_server_destroy(s->srv);
    ps_rpc_channel_destroy(s->coord);
    pshard_comm_destroy(s->comm);
    shard_unmap(&s->scratch);
    shard_unmap(&s->model_shm);
    shard_unmap(&s->pending_model);
    shard_model_free(s->model);
    shard_join_free(s);
    for (size_t i = 0; i < 16; i++)
        free(s->strings[i]);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->op_mu);
    pthread_mutex_destroy(&s->health_mu);
    free(s);
}
