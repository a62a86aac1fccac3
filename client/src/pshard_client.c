/* libpshard: the trainer side. It owns two shared-memory regions that its shard server maps: a
 * scratch region for plain collectives and a model region holding every parameter's full
 * buffer (param_dtype) and gradient buffer (reduce_dtype). Requests go over gRPC; asynchronous
 * ones run in issue order on the client's worker thread. */
#define PSHARD_BUILDING_LIBRARY 1
#include "pshard/pshard.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "pshard/rpc.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"

#define DEFAULT_SCRATCH (16u << 20)
#define ALIGN 64

typedef struct {
    void *base;
    size_t bytes;
    char name[64]; /* "" for a private region (remote trainers) */
} region_t;

#define CHUNK (1u << 20)

typedef enum { WORK_GATHER, WORK_REDUCE_SCATTER } work_kind_t;

struct pshard_work {
    pshard_client_t *c;
    work_kind_t kind;
    size_t *ids;
    size_t n;
    bool done;
    pshard_status_t status;
    char error[1024];
    struct pshard_work *next;
};

struct pshard_client {
    pshard_client_config_t cfg;
    char *server, *token;
    ps_rpc_channel_t *ch;
    char session[64];
    int rank, world;
    region_t scratch, model;
    char last_error[1024];

    /* Model */
    size_t nparams;
    size_t *numel;
    size_t *param_off, *grad_off; /* byte offsets in the model region */
    pshard_dtype_t param_dtype, reduce_dtype;

    /* Async worker */
    pthread_t worker;
    bool worker_started, stop;
    bool busy; /* an operation is running (on the worker or inline on the caller) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pshard_work_t *qhead, *qtail;
};

static pshard_status_t fail(pshard_client_t *c, pshard_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static pshard_status_t fail(pshard_client_t *c, pshard_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->last_error, sizeof(c->last_error), fmt, ap);
    va_end(ap);
    return st;
}

const char *pshard_last_error(const pshard_client_t *c)
{
    return c ? c->last_error : "no client";
}

int pshard_rank(const pshard_client_t *c)
{
    return c->rank;
}

int pshard_world_size(const pshard_client_t *c)
{
    return c->world;
}

/* ---------------------------------------------------------------------------------------- */
/* Shared memory                                                                             */

static pshard_status_t region_create(region_t *r, size_t bytes, const char *what, bool remote,
                                     char *err, size_t errlen)
{
    if (remote) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "cannot allocate %zu bytes",
                           bytes);
        memset(p, 0, bytes);
        r->base = p;
        r->bytes = bytes;
        r->name[0] = '\0';
        return PSHARD_OK;
    }
    uint8_t rnd[8];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd))
        memset(rnd, 0x5a, sizeof(rnd));
    snprintf(r->name, sizeof(r->name), "/pshard-%d-%s-%02x%02x%02x%02x%02x%02x", (int)getpid(),
             what, rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5]);
    int fd = shm_open(r->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "shm_open %s: %s", r->name,
                       strerror(errno));
    if (ftruncate(fd, (off_t)bytes) != 0) {
        int e = errno;
        close(fd);
        shm_unlink(r->name);
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot size %s to %zu bytes: %s",
                       r->name, bytes, strerror(e));
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(r->name);
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "mmap %s: %s", r->name, strerror(errno));
    }
    /* Touch every page now, not inside the first gather. */
    memset(p, 0, bytes);
    r->base = p;
    r->bytes = bytes;
    return PSHARD_OK;
}

static void region_destroy(region_t *r)
{
    if (r->base) {
        munmap(r->base, r->bytes);
        if (r->name[0])
            shm_unlink(r->name);
    }
    memset(r, 0, sizeof(*r));
}

/* ---------------------------------------------------------------------------------------- */
/* RPC                                                                                       */

static pshard_status_t call(pshard_client_t *c, const char *method, const ProtobufCMessage *req,
                            const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp,
                            char *err, size_t errlen)
{
    char path[96];
    snprintf(path, sizeof(path), "/pshard.ShardServer/%s", method);
    ProtobufCMessage *r = NULL;
    pshard_status_t rc =
        ps_rpc_unary(c->ch, path, req, desc, &r, c->cfg.timeout_ms, 0, NULL, err, errlen);
    if (resp)
        *resp = r;
    else if (r)
        protobuf_c_message_free_unpacked(r, NULL);
    return rc;
}

/* Remote path: copies len bytes at off of a local region to the server's, in chunks.
 * region_bytes (MODEL before DefineModel) asks the server to create its region first. */
static pshard_status_t remote_write(pshard_client_t *c, Pshard__Region region,
                                    const region_t *r, size_t off, size_t len,
                                    uint64_t region_bytes, char *err, size_t errlen)
{
    size_t done = 0;
    do {
        size_t n = len - done < CHUNK ? len - done : CHUNK;
        Pshard__RegionWriteRequest req = PSHARD__REGION_WRITE_REQUEST__INIT;
        req.session = c->session;
        req.region = region;
        req.offset = off + done;
        req.data.data = (uint8_t *)r->base + off + done;
        req.data.len = n;
        req.region_bytes = region_bytes;
        PS_CHECK(call(c, "WriteRegion", &req.base, &pshard__region_write_response__descriptor,
                      NULL, err, errlen));
        done += n;
    } while (done < len);
    return PSHARD_OK;
}

/* Remote path: fetches len bytes at off of the server's region into the local one. */
static pshard_status_t remote_read(pshard_client_t *c, Pshard__Region region, region_t *r,
                                   size_t off, size_t len, char *err, size_t errlen)
{
    Pshard__RegionReadRequest req = PSHARD__REGION_READ_REQUEST__INIT;
    req.session = c->session;
    req.region = region;
    req.offset = off;
    req.length = len;
    ps_rpc_stream_t *st = ps_rpc_stream_open(c->ch, "/pshard.ShardServer/ReadRegion", &req.base,
                                             c->cfg.timeout_ms, err, errlen);
    if (!st)
        return PSHARD_ERR_RPC;
    size_t got = 0;
    pshard_status_t rc = PSHARD_OK;
    for (;;) {
        ProtobufCMessage *msg = NULL;
        rc = ps_rpc_stream_next(st, &pshard__data_chunk__descriptor, &msg, -1, NULL, err, errlen);
        if (rc != PSHARD_OK || !msg)
            break;
        Pshard__DataChunk *ch = (Pshard__DataChunk *)msg;
        if (ch->offset < off || ch->data.len > len || ch->offset - off > len - ch->data.len) {
            rc = ps_errf(err, errlen, PSHARD_ERR_RPC, "the server sent a chunk outside the range");
        } else {
            memcpy((uint8_t *)r->base + ch->offset, ch->data.data, ch->data.len);
            got += ch->data.len;
        }
        protobuf_c_message_free_unpacked(msg, NULL);
        if (rc != PSHARD_OK)
            break;
    }
    ps_rpc_stream_close(st);
    if (rc == PSHARD_OK && got != len)
        rc = ps_errf(err, errlen, PSHARD_ERR_RPC, "the server sent %zu of %zu bytes", got, len);
    return rc;
}

pshard_status_t pshard_client_config_from_env(pshard_client_config_t *cfg, char *err,
                                              size_t errlen)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->rank = 0;
    cfg->world_size = 1;
    cfg->scratch_bytes = DEFAULT_SCRATCH;
    cfg->timeout_ms = 600000;
    cfg->connect_timeout_ms = 300000;
    int64_t v;
    const char *e = getenv("RANK");
    if (e && *e) {
        if (ps_parse_i64(e, 0, 65535, &v) != 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "RANK='%s' is not a rank", e);
        cfg->rank = (int)v;
    }
    e = getenv("WORLD_SIZE");
    if (e && *e) {
        if (ps_parse_i64(e, 1, 65536, &v) != 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "WORLD_SIZE='%s' is not a world size", e);
        cfg->world_size = (int)v;
    }
    e = getenv("PSHARD_SCRATCH_BYTES");
    if (e && *e) {
        if (ps_parse_i64(e, 4096, (int64_t)1 << 40, &v) != 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "PSHARD_SCRATCH_BYTES='%s' is not a size in bytes", e);
        cfg->scratch_bytes = (size_t)v;
    }
    e = getenv("PSHARD_REMOTE");
    cfg->remote = e && (strcmp(e, "1") == 0 || strcmp(e, "true") == 0);
    cfg->server = getenv("PSHARD_SERVER");
    if (!cfg->server || !*cfg->server)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "PSHARD_SERVER is not set (this trainer's shard server, HOST:PORT; "
                       "pshardrun sets it)");
    return PSHARD_OK;
}

static void *worker_main(void *arg);

pshard_status_t pshard_connect(const pshard_client_config_t *cfg, pshard_client_t **out,
                               char *err, size_t errlen)
{
    *out = NULL;
    if (!cfg->server || !*cfg->server)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "no shard server address");
    pshard_client_t *c = calloc(1, sizeof(*c));
    if (!c)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    c->cfg = *cfg;
    if (c->cfg.timeout_ms <= 0)
        c->cfg.timeout_ms = 600000;
    if (c->cfg.connect_timeout_ms <= 0)
        c->cfg.connect_timeout_ms = 300000;
    if (c->cfg.scratch_bytes == 0)
        c->cfg.scratch_bytes = DEFAULT_SCRATCH;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->server = strdup(cfg->server);
    pshard_status_t rc = PSHARD_OK;
    if (cfg->token) {
        c->token = strdup(cfg->token);
    } else {
        const char *tf = getenv("PSHARD_TOKEN_FILE");
        if (tf && *tf) {
            c->token = ps_read_file(tf, true, 4096, NULL, err, errlen);
            if (!c->token) {
                rc = PSHARD_ERR_INVALID_ARGUMENT;
                goto fail;
            }
        }
    }
    ps_rpc_channel_config_t ccfg = {.target = c->server, .token = c->token,
                                    .max_message_bytes = 64 << 20};
    c->ch = ps_rpc_channel_create(&ccfg, err, errlen);
    if (!c->ch) {
        rc = PSHARD_ERR_INVALID_ARGUMENT;
        goto fail;
    }
    rc = region_create(&c->scratch, c->cfg.scratch_bytes, "scratch", c->cfg.remote, err, errlen);
    if (rc != PSHARD_OK)
        goto fail;
    /* Attach, retrying while the cluster forms (UNAVAILABLE) until the connect timeout. */
    int64_t give_up = ps_now_ns() + c->cfg.connect_timeout_ms * 1000000;
    char hostname[64] = "trainer";
    gethostname(hostname, sizeof(hostname) - 1);
    char tname[128];
    snprintf(tname, sizeof(tname), "%s:%d rank %d", hostname, (int)getpid(), cfg->rank);
    for (;;) {
        Pshard__AttachRequest req = PSHARD__ATTACH_REQUEST__INIT;
        req.rank = cfg->rank;
        req.shm_name = c->scratch.name;
        req.shm_bytes = c->scratch.bytes;
        req.trainer_name = tname;
        ProtobufCMessage *resp = NULL;
        char e[1024] = "";
        rc = call(c, "Attach", &req.base, &pshard__attach_response__descriptor, &resp, e,
                  sizeof(e));
        if (rc == PSHARD_OK) {
            Pshard__AttachResponse *a = (Pshard__AttachResponse *)resp;
            ps_strlcpy(c->session, a->session, sizeof(c->session));
            c->rank = a->rank;
            c->world = a->world_size;
            protobuf_c_message_free_unpacked(resp, NULL);
            break;
        }
        if (rc != PSHARD_ERR_UNAVAILABLE || ps_now_ns() > give_up) {
            ps_errf(err, errlen, rc, "attaching to shard server %s: %s", c->server, e);
            goto fail;
        }
        struct timespec ts = {0, 50 * 1000000};
        nanosleep(&ts, NULL);
    }
    if (cfg->world_size > 0 && cfg->world_size != c->world) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "WORLD_SIZE is %d but the cluster has %d shard servers", cfg->world_size,
                     c->world);
        goto fail;
    }
    if (pthread_create(&c->worker, NULL, worker_main, c) != 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot start the client thread");
        goto fail;
    }
    c->worker_started = true;
    *out = c;
    return PSHARD_OK;
fail:
    pshard_close(c);
    return rc;
}

void pshard_close(pshard_client_t *c)
{
    if (!c)
        return;
    if (c->worker_started) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->worker, NULL);
    }
    ps_rpc_channel_destroy(c->ch);
    region_destroy(&c->scratch);
    region_destroy(&c->model);
    free(c->numel);
    free(c->param_off);
    free(c->grad_off);
    free(c->server);
    free(c->token);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
}

/* ---------------------------------------------------------------------------------------- */
/* Model                                                                                     */

void pshard_model_config_default(pshard_model_config_t *mc, pshard_optimizer_t optimizer)
{
    memset(mc, 0, sizeof(*mc));
    mc->layout = PSHARD_LAYOUT_FSDP2;
    mc->param_dtype = PSHARD_FP32;
    mc->reduce_dtype = PSHARD_FP32;
    mc->optimizer = optimizer;
    mc->lr = 1e-3;
    mc->beta1 = 0.9;
    mc->beta2 = 0.999;
    mc->eps = 1e-8;
    mc->weight_decay = optimizer == PSHARD_ADAMW ? 1e-2 : 0.0;
    mc->init_from_rank0 = true;
}

static size_t align_up(size_t x)
{
    return (x + ALIGN - 1) / ALIGN * ALIGN;
}

pshard_status_t pshard_define_model(pshard_client_t *c, const pshard_param_t *params,
                                    size_t nparams, const pshard_model_config_t *mc,
                                    const float *const *init)
{
    if (nparams == 0 || !params)
        return fail(c, PSHARD_ERR_INVALID_ARGUMENT, "no parameters");
    if (mc->param_dtype != PSHARD_FP32 && mc->param_dtype != PSHARD_BF16 &&
        mc->param_dtype != PSHARD_FP16)
        return fail(c, PSHARD_ERR_INVALID_ARGUMENT, "param_dtype must be fp32, bf16 or fp16");
    if (mc->reduce_dtype != PSHARD_FP32 && mc->reduce_dtype != PSHARD_BF16)
        return fail(c, PSHARD_ERR_INVALID_ARGUMENT, "reduce_dtype must be fp32 or bf16");
    bool need_init = !mc->init_from_rank0 || c->rank == 0;
    if (need_init && !init)
        return fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                    "initial values are required on %s", mc->init_from_rank0 ? "rank 0"
                                                                             : "every rank");
    size_t *numel = calloc(nparams, sizeof(size_t));
    size_t *poff = calloc(nparams, sizeof(size_t));
    size_t *goff = calloc(nparams, sizeof(size_t));
    Pshard__ParamSpec *specs = calloc(nparams, sizeof(*specs));
    Pshard__ParamSpec **sptrs = calloc(nparams, sizeof(*sptrs));
    uint64_t *init_offsets = calloc(nparams, sizeof(uint64_t));
    pshard_status_t rc = PSHARD_OK;
    if (!numel || !poff || !goff || !specs || !sptrs || !init_offsets) {
        rc = fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    size_t ps = pshard_dtype_size(mc->param_dtype), gs = pshard_dtype_size(mc->reduce_dtype);
    size_t off = 0, init_bytes = 0;
    for (size_t i = 0; i < nparams; i++) {
        if (params[i].ndim < 1 || params[i].ndim > 8 || !params[i].shape) {
            rc = fail(c, PSHARD_ERR_INVALID_ARGUMENT, "parameter #%zu (%s): ndim must be 1..8",
                      i, params[i].name ? params[i].name : "?");
            goto out;
        }
        size_t n = 1;
        for (int d = 0; d < params[i].ndim; d++) {
            if (params[i].shape[d] <= 0 || n > (SIZE_MAX / 16) / (size_t)params[i].shape[d]) {
                rc = fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                          "parameter #%zu (%s): dimension %d is not a positive size", i,
                          params[i].name ? params[i].name : "?", d);
                goto out;
            }
            n *= (size_t)params[i].shape[d];
        }
        numel[i] = n;
        poff[i] = off;
        off = align_up(off + n * ps);
        init_offsets[i] = init_bytes;
        init_bytes = align_up(init_bytes + n * 4);
        pshard__param_spec__init(&specs[i]);
        specs[i].name = (char *)(params[i].name ? params[i].name : "");
        specs[i].n_shape = (size_t)params[i].ndim;
        specs[i].shape = (int64_t *)params[i].shape;
        sptrs[i] = &specs[i];
    }
    for (size_t i = 0; i < nparams; i++) {
        goff[i] = off;
        off = align_up(off + numel[i] * gs);
    }
    size_t bytes = off > init_bytes ? off : init_bytes;
    region_t model = {0};
    char err[1024] = "";
    rc = region_create(&model, bytes, "model", c->cfg.remote, err, sizeof(err));
    if (rc != PSHARD_OK) {
        fail(c, rc, "%s", err);
        goto out;
    }
    /* Initial values go at the start of the region (it is free until the first gather). */
    if (need_init) {
        for (size_t i = 0; i < nparams; i++) {
            if (!init[i]) {
                region_destroy(&model);
                rc = fail(c, PSHARD_ERR_INVALID_ARGUMENT, "initial values of '%s' are missing",
                          params[i].name);
                goto out;
            }
            memcpy((uint8_t *)model.base + init_offsets[i], init[i], numel[i] * 4);
        }
    }
    if (c->cfg.remote) {
        /* The server creates its copy of the region; initial values travel in chunks. */
        rc = remote_write(c, PSHARD__REGION__MODEL, &model, 0, need_init ? init_bytes : 0,
                          model.bytes, err, sizeof(err));
        if (rc != PSHARD_OK) {
            region_destroy(&model);
            fail(c, rc, "uploading the model region: %s", err);
            goto out;
        }
    }
    Pshard__OptimizerConfig oc = PSHARD__OPTIMIZER_CONFIG__INIT;
    oc.kind = mc->optimizer == PSHARD_ADAM    ? PSHARD__OPTIMIZER_KIND__ADAM
              : mc->optimizer == PSHARD_ADAMW ? PSHARD__OPTIMIZER_KIND__ADAMW
                                              : PSHARD__OPTIMIZER_KIND__SGD;
    oc.lr = mc->lr;
    oc.momentum = mc->momentum;
    oc.dampening = mc->dampening;
    oc.nesterov = mc->nesterov;
    oc.weight_decay = mc->weight_decay;
    oc.beta1 = mc->beta1;
    oc.beta2 = mc->beta2;
    oc.eps = mc->eps;
    oc.max_grad_norm = mc->max_grad_norm;
    Pshard__DefineModelRequest req = PSHARD__DEFINE_MODEL_REQUEST__INIT;
    req.session = c->session;
    req.n_params = nparams;
    req.params = sptrs;
    req.layout = mc->layout == PSHARD_LAYOUT_FSDP1 ? PSHARD__LAYOUT__FSDP1 : PSHARD__LAYOUT__FSDP2;
    req.optimizer = &oc;
    req.init = mc->init_from_rank0 ? PSHARD__INIT_MODE__INIT_FROM_RANK0
                                   : PSHARD__INIT_MODE__INIT_LOCAL;
    req.shm_name = model.name;
    req.shm_bytes = model.bytes;
    if (need_init) {
        req.n_init_offsets = nparams;
        req.init_offsets = init_offsets;
    }
    rc = call(c, "DefineModel", &req.base, &pshard__define_model_response__descriptor, NULL, err,
              sizeof(err));
    if (rc != PSHARD_OK) {
        region_destroy(&model);
        fail(c, rc, "DefineModel: %s", err);
        goto out;
    }
    memset(model.base, 0, model.bytes); /* the init values are consumed */
    region_destroy(&c->model);
    c->model = model;
    free(c->numel);
    free(c->param_off);
    free(c->grad_off);
    c->numel = numel;
    c->param_off = poff;
    c->grad_off = goff;
    numel = poff = goff = NULL;
    c->nparams = nparams;
    c->param_dtype = mc->param_dtype;
    c->reduce_dtype = mc->reduce_dtype;
out:
    free(numel);
    free(poff);
    free(goff);
    free(specs);
    free(sptrs);
    free(init_offsets);
    return rc;
}

void *pshard_param(pshard_client_t *c, size_t i)
{
    return i < c->nparams ? (uint8_t *)c->model.base + c->param_off[i] : NULL;
}

void *pshard_grad(pshard_client_t *c, size_t i)
{
    return i < c->nparams ? (uint8_t *)c->model.base + c->grad_off[i] : NULL;
}

size_t pshard_param_numel(const pshard_client_t *c, size_t i)
{
    return i < c->nparams ? c->numel[i] : 0;
}

static Pshard__DType dtype_pb(pshard_dtype_t d)
{
    switch (d) {
    case PSHARD_BF16:
        return PSHARD__DTYPE__BF16;
    case PSHARD_FP16:
        return PSHARD__DTYPE__FP16;
    case PSHARD_INT64:
        return PSHARD__DTYPE__INT64;
    default:
        return PSHARD__DTYPE__FP32;
    }
}

/* One Gather or ReduceScatter request for ids (n == 0: all parameters). */
static pshard_status_t run_tensor_op(pshard_client_t *c, work_kind_t kind, const size_t *ids,
                                     size_t n, char *err, size_t errlen)
{
    if (!c->nparams)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION, "no model is defined");
    size_t count = n ? n : c->nparams;
    Pshard__TensorRef *refs = calloc(count, sizeof(*refs));
    Pshard__TensorRef **ptrs = calloc(count, sizeof(*ptrs));
    if (!refs || !ptrs) {
        free(refs);
        free(ptrs);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    pshard_status_t rc = PSHARD_OK;
    for (size_t k = 0; k < count; k++) {
        size_t i = n ? ids[k] : k;
        if (i >= c->nparams) {
            rc = ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "unknown parameter #%zu", i);
            break;
        }
        pshard__tensor_ref__init(&refs[k]);
        refs[k].param = (uint32_t)i;
        refs[k].offset = kind == WORK_GATHER ? c->param_off[i] : c->grad_off[i];
        ptrs[k] = &refs[k];
    }
    size_t ps = pshard_dtype_size(c->param_dtype), gs = pshard_dtype_size(c->reduce_dtype);
    if (rc == PSHARD_OK && c->cfg.remote && kind == WORK_REDUCE_SCATTER) {
        for (size_t k = 0; k < count && rc == PSHARD_OK; k++)
            rc = remote_write(c, PSHARD__REGION__MODEL, &c->model, refs[k].offset,
                              c->numel[refs[k].param] * gs, 0, err, errlen);
    }
    if (rc == PSHARD_OK) {
        if (kind == WORK_GATHER) {
            Pshard__GatherRequest req = PSHARD__GATHER_REQUEST__INIT;
            req.session = c->session;
            req.n_tensors = count;
            req.tensors = ptrs;
            req.dtype = dtype_pb(c->param_dtype);
            rc = call(c, "Gather", &req.base, &pshard__gather_response__descriptor, NULL, err,
                      errlen);
        } else {
            Pshard__ReduceScatterRequest req = PSHARD__REDUCE_SCATTER_REQUEST__INIT;
            req.session = c->session;
            req.n_tensors = count;
            req.tensors = ptrs;
            req.dtype = dtype_pb(c->reduce_dtype);
            rc = call(c, "ReduceScatter", &req.base, &pshard__reduce_scatter_response__descriptor,
                      NULL, err, errlen);
        }
    }
    if (rc == PSHARD_OK && c->cfg.remote && kind == WORK_GATHER) {
        for (size_t k = 0; k < count && rc == PSHARD_OK; k++)
            rc = remote_read(c, PSHARD__REGION__MODEL, &c->model, refs[k].offset,
                             c->numel[refs[k].param] * ps, err, errlen);
    }
    free(refs);
    free(ptrs);
    return rc;
}

static void *worker_main(void *arg)
{
    pshard_client_t *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        while ((!c->qhead || c->busy) && !c->stop)
            pthread_cond_wait(&c->cv, &c->mu);
        pshard_work_t *w = c->qhead;
        if (!w) {
            pthread_mutex_unlock(&c->mu);
            return NULL;
        }
        c->qhead = w->next;
        if (!c->qhead)
            c->qtail = NULL;
        c->busy = true;
        pthread_mutex_unlock(&c->mu);
        char err[1024] = "";
        pshard_status_t rc = run_tensor_op(c, w->kind, w->ids, w->n, err, sizeof(err));
        pthread_mutex_lock(&c->mu);
        c->busy = false;
        w->status = rc;
        ps_strlcpy(w->error, err, sizeof(w->error));
        w->done = true;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
}

static pshard_status_t start_work(pshard_client_t *c, work_kind_t kind, const size_t *ids,
                                  size_t n, pshard_work_t **out)
{
    *out = NULL;
    pshard_work_t *w = calloc(1, sizeof(*w));
    if (!w || (n && !(w->ids = malloc(n * sizeof(size_t))))) {
        free(w);
        return fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    if (n)
        memcpy(w->ids, ids, n * sizeof(size_t));
    w->n = n;
    w->kind = kind;
    w->c = c;
    pthread_mutex_lock(&c->mu);
    if (c->qtail)
        c->qtail->next = w;
    else
        c->qhead = w;
    c->qtail = w;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    *out = w;
    return PSHARD_OK;
}

pshard_status_t pshard_gather_start(pshard_client_t *c, const size_t *ids, size_t n,
                                    pshard_work_t **work)
{
    return start_work(c, WORK_GATHER, ids, n, work);
}

pshard_status_t pshard_reduce_scatter_start(pshard_client_t *c, const size_t *ids, size_t n,
                                            pshard_work_t **work)
{
    return start_work(c, WORK_REDUCE_SCATTER, ids, n, work);
}

pshard_status_t pshard_work_wait(pshard_work_t *w)
{
    if (!w)
        return PSHARD_ERR_INVALID_ARGUMENT;
    pshard_client_t *c = w->c;
    pthread_mutex_lock(&c->mu);
    while (!w->done)
        pthread_cond_wait(&c->cv, &c->mu);
    pshard_status_t rc = w->status;
    if (rc != PSHARD_OK)
        ps_strlcpy(c->last_error, w->error, sizeof(c->last_error));
    pthread_mutex_unlock(&c->mu);
    free(w->ids);
    free(w);
    return rc;
}

/* A blocking operation runs on the caller's thread once everything issued before it finished:
 * handing it to the worker and waiting would only add two thread wake-ups. */
static pshard_status_t run_inline(pshard_client_t *c, work_kind_t kind, const size_t *ids,
                                  size_t n)
{
    pthread_mutex_lock(&c->mu);
    while (c->qhead || c->busy)
        pthread_cond_wait(&c->cv, &c->mu);
    c->busy = true;
    pthread_mutex_unlock(&c->mu);
    char err[1024] = "";
    pshard_status_t rc = run_tensor_op(c, kind, ids, n, err, sizeof(err));
    pthread_mutex_lock(&c->mu);
    c->busy = false;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (rc != PSHARD_OK)
        fail(c, rc, "%s", err);
    return rc;
}

pshard_status_t pshard_gather(pshard_client_t *c, const size_t *ids, size_t n)
{
    return run_inline(c, WORK_GATHER, ids, n);
}

pshard_status_t pshard_reduce_scatter(pshard_client_t *c, const size_t *ids, size_t n)
{
    return run_inline(c, WORK_REDUCE_SCATTER, ids, n);
}

pshard_status_t pshard_step(pshard_client_t *c, double lr, int64_t *step, double *grad_norm)
{
    Pshard__StepRequest req = PSHARD__STEP_REQUEST__INIT;
    req.session = c->session;
    if (lr >= 0) {
        req.lr = lr;
        req.set_lr = true;
    }
    ProtobufCMessage *resp = NULL;
    char err[1024] = "";
    pshard_status_t rc =
        call(c, "Step", &req.base, &pshard__step_response__descriptor, &resp, err, sizeof(err));
    if (rc != PSHARD_OK)
        return fail(c, rc, "Step: %s", err);
    Pshard__StepResponse *r = (Pshard__StepResponse *)resp;
    if (step)
        *step = r->step;
    if (grad_norm)
        *grad_norm = r->grad_norm;
    protobuf_c_message_free_unpacked(resp, NULL);
    return PSHARD_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Plain collectives                                                                         */

static pshard_status_t collective(pshard_client_t *c, uint32_t op, pshard_dtype_t dt,
                                  bool average, int root, size_t count, size_t send_off,
                                  size_t recv_off, size_t recv_bytes)
{
    char err[1024] = "";
    size_t send_bytes = count * pshard_dtype_size(dt);
    if (c->cfg.remote && send_bytes &&
        remote_write(c, PSHARD__REGION__SCRATCH, &c->scratch, send_off, send_bytes, 0, err,
                     sizeof(err)) != PSHARD_OK)
        return fail(c, PSHARD_ERR_RPC, "collective: %s", err);
    Pshard__CollectiveRequest req = PSHARD__COLLECTIVE_REQUEST__INIT;
    req.session = c->session;
    req.op = op;
    req.dtype = dtype_pb(dt);
    req.reduce = average ? 1 : 0;
    req.root = root;
    req.count = count;
    req.send_offset = send_off;
    req.recv_offset = recv_off;
    pshard_status_t rc = call(c, "Collective", &req.base, &pshard__collective_response__descriptor,
                              NULL, err, sizeof(err));
    if (rc == PSHARD_OK && c->cfg.remote && recv_bytes)
        rc = remote_read(c, PSHARD__REGION__SCRATCH, &c->scratch, recv_off, recv_bytes, err,
                         sizeof(err));
    if (rc != PSHARD_OK)
        return fail(c, rc, "collective: %s", err);
    return PSHARD_OK;
}

static pshard_status_t fits(pshard_client_t *c, size_t bytes)
{
    if (bytes > c->scratch.bytes)
        return fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                    "%zu bytes exceed the %zu-byte scratch region (PSHARD_SCRATCH_BYTES)", bytes,
                    c->scratch.bytes);
    return PSHARD_OK;
}

pshard_status_t pshard_all_reduce(pshard_client_t *c, void *buf, size_t count,
                                  pshard_dtype_t dtype, bool average)
{
    size_t bytes = count * pshard_dtype_size(dtype);
    PS_CHECK(fits(c, bytes));
    memcpy(c->scratch.base, buf, bytes);
    PS_CHECK(collective(c, 3, dtype, average, 0, count, 0, 0, bytes));
    memcpy(buf, c->scratch.base, bytes);
    return PSHARD_OK;
}

pshard_status_t pshard_broadcast(pshard_client_t *c, void *buf, size_t count,
                                 pshard_dtype_t dtype, int root)
{
    size_t bytes = count * pshard_dtype_size(dtype);
    PS_CHECK(fits(c, bytes));
    if (c->rank == root)
        memcpy(c->scratch.base, buf, bytes);
    PS_CHECK(collective(c, 4, dtype, false, root, count, 0, 0, bytes));
    memcpy(buf, c->scratch.base, bytes);
    return PSHARD_OK;
}

pshard_status_t pshard_all_gather(pshard_client_t *c, const void *send, void *recv, size_t count,
                                  pshard_dtype_t dtype)
{
    size_t bytes = count * pshard_dtype_size(dtype);
    size_t recv_off = align_up(bytes);
    PS_CHECK(fits(c, recv_off + bytes * (size_t)c->world));
    memcpy(c->scratch.base, send, bytes);
    PS_CHECK(collective(c, 1, dtype, false, 0, count, 0, recv_off, bytes * (size_t)c->world));
    memcpy(recv, (uint8_t *)c->scratch.base + recv_off, bytes * (size_t)c->world);
    return PSHARD_OK;
}

pshard_status_t pshard_barrier(pshard_client_t *c)
{
    return collective(c, 5, PSHARD_FP32, false, 0, 0, 0, 0, 0);
}
