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

#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"

#include "client_pool.h"

#define DEFAULT_SCRATCH (16u << 20)

typedef struct {
    void *base;
    size_t bytes;
    char name[64]; /* "" for a private region (remote trainers) */
    bool linked;   /* the name is still in /dev/shm (until the server has mapped it) */
    int fd;        /* the shared-memory file, kept open to map parts of it again; with has_fd */
    bool has_fd;
} region_t;

#define CHUNK (1u << 20)

typedef enum { WORK_GATHER, WORK_REDUCE_SCATTER } work_kind_t;

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
    size_t *ids;  /* the parameters this work really moves (skipped ones are left out) */
    uint64_t *offs; /* their blocks in the model region */
    size_t n;
    bool counted; /* holds a place among the gathers in flight */
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
    int64_t model_step; /* from DefineModel: > 0 after a resume */
    bool reshard_after_forward;
    int max_gathers_in_flight;
    int gathers_in_flight;
    client_pool_t *pool;        /* NULL before the first model */
    pshard_memory_stats_t mem; /* its byte counters are the pool's (pshard_memory_stats) */

    /* The trainer's lease with the coordinator: registered as role TRAINER and renewed by a
     * thread, so a trainer that dies or hangs is evicted and its peers stop waiting. */
    ps_rpc_channel_t *coord;
    char coord_addr[256];
    char job[72]; /* the job on the coordinator, from Attach ("" for the default job) */
    char member_id[64];
    char lease_key[64]; /* the secret Register returned, for Heartbeat and Leave */
    int64_t heartbeat_ms;
    pthread_t lease_thread;
    bool lease_started;
    bool lease_ok; /* the last heartbeat went through (mu); else Leave is not even tried */
    uint64_t seen_generation;
    /* Set once this trainer's own shard server is known lost (mu): every later call fails
     * at once with it instead of waiting on a server that will not answer. */
    pshard_status_t lost;
    char lost_msg[512];

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

/* A region of bytes, shared with the server unless remote; touch backs every page now (the
 * scratch region), otherwise pages are backed as they are first used (the model's pool). */
static pshard_status_t region_create(region_t *r, size_t bytes, const char *what, bool remote,
                                     bool touch, bool keep_fd, char *err, size_t errlen)
{
    if (remote) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "cannot allocate %zu bytes",
                           bytes);
        if (touch)
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
    if (p == MAP_FAILED || !keep_fd)
        close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(r->name);
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "mmap %s: %s", r->name, strerror(errno));
    }
    r->linked = true;
    r->fd = fd;
    r->has_fd = keep_fd;
    /* Touch every page now, not inside the first operation. */
    if (touch)
        memset(p, 0, bytes);
    r->base = p;
    r->bytes = bytes;
    return PSHARD_OK;
}

/* Removes the region's name once the server has mapped it: the memory lives on in both
 * mappings, and a trainer killed with -9 leaves nothing behind in /dev/shm. */
static void region_unlink(region_t *r)
{
    if (r->linked) {
        shm_unlink(r->name);
        r->linked = false;
    }
}

static void region_destroy(region_t *r)
{
    if (r->base)
        munmap(r->base, r->bytes);
    if (r->has_fd)
        close(r->fd);
    region_unlink(r);
    memset(r, 0, sizeof(*r));
}

/* ---------------------------------------------------------------------------------------- */
/* RPC                                                                                       */

/* PSHARD_OK, or the sticky loss of this trainer's shard server (message into err). */
static pshard_status_t lost_check(pshard_client_t *c, char *err, size_t errlen)
{
    pthread_mutex_lock(&c->mu);
    pshard_status_t st = c->lost;
    if (st != PSHARD_OK && err && errlen)
        snprintf(err, errlen, "%s", c->lost_msg);
    pthread_mutex_unlock(&c->mu);
    return st;
}

static pshard_status_t call(pshard_client_t *c, const char *method, const ProtobufCMessage *req,
                            const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp,
                            char *err, size_t errlen)
{
    char path[96];
    snprintf(path, sizeof(path), "/pshard.ShardServer/%s", method);
    ProtobufCMessage *r = NULL;
    if (lost_check(c, err, errlen) != PSHARD_OK)
        return c->lost;
    pshard_status_t rc =
        ps_rpc_unary(c->ch, path, req, desc, &r, c->cfg.timeout_ms, 0, NULL, err, errlen);
    if (rc != PSHARD_OK && lost_check(c, NULL, 0) != PSHARD_OK) {
        /* Cancelled because the server was evicted: say so, not "cancelled". */
        snprintf(err, errlen, "%s", c->lost_msg);
        rc = c->lost;
    }
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
static void model_free(pshard_client_t *c);

/* Registers this trainer with the coordinator as "trainer-RANK". */
static pshard_status_t lease_register(pshard_client_t *c, char *err, size_t errlen)
{
    char name[64], host[64] = "", device[32] = "cpu";
    snprintf(name, sizeof(name), "trainer-%d", c->rank);
    gethostname(host, sizeof(host) - 1);
    Pshard__RegisterRequest req = PSHARD__REGISTER_REQUEST__INIT;
    req.role = PSHARD__ROLE__TRAINER;
    req.name = name;
    req.address = c->server;
    req.node = host;
    req.device = device;
    char key[64];
    pthread_mutex_lock(&c->mu);
    ps_strlcpy(key, c->lease_key, sizeof(key)); /* ours from before, if any: takes over */
    pthread_mutex_unlock(&c->mu);
    req.lease_key = key;
    ProtobufCMessage *resp = NULL;
    PS_CHECK(ps_rpc_unary(c->coord, "/pshard.Coordinator/Register", &req.base,
                          &pshard__member_view__descriptor, &resp, 5000, PS_RPC_IDEMPOTENT, NULL,
                          err, errlen));
    Pshard__MemberView *v = (Pshard__MemberView *)resp;
    pthread_mutex_lock(&c->mu);
    ps_strlcpy(c->member_id, v->member_id, sizeof(c->member_id));
    ps_strlcpy(c->lease_key, v->lease_key ? v->lease_key : "", sizeof(c->lease_key));
    c->heartbeat_ms = v->heartbeat_ms > 0 ? v->heartbeat_ms : 1000;
    pthread_mutex_unlock(&c->mu);
    protobuf_c_message_free_unpacked(resp, NULL);
    return PSHARD_OK;
}

/* After an eviction: if no shard server holds this trainer's rank any more, its own server is
 * the one that was lost (dead, hung or cut off). Its collectives cannot tell this trainer, so
 * the calls waiting on it are cancelled and every later one fails with PEER_LOST. */
static void check_own_server(pshard_client_t *c)
{
    Pshard__StatusRequest req = PSHARD__STATUS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    char err[256] = "";
    if (ps_rpc_unary(c->coord, "/pshard.Coordinator/Status", &req.base,
                     &pshard__status_response__descriptor, &resp, 2000, 0, NULL, err,
                     sizeof(err)) != PSHARD_OK)
        return;
    const Pshard__StatusResponse *st = (const Pshard__StatusResponse *)resp;
    bool held = false;
    for (size_t i = 0; i < st->n_members; i++)
        if (st->members[i]->role == PSHARD__ROLE__SHARD_SERVER && st->members[i]->rank == c->rank)
            held = true;
    protobuf_c_message_free_unpacked(resp, NULL);
    if (held)
        return;
    pthread_mutex_lock(&c->mu);
    if (c->lost == PSHARD_OK) {
        c->lost = PSHARD_ERR_PEER_LOST;
        snprintf(c->lost_msg, sizeof(c->lost_msg),
                 "rank %d's own shard server (%s) was evicted by the coordinator: it died, "
                 "hangs or is cut off",
                 c->rank, c->server);
    }
    pthread_mutex_unlock(&c->mu);
    PS_ERROR(PS_SUB_CLIENT, "%s", c->lost_msg);
    ps_rpc_channel_cancel_calls(c->ch, c->lost_msg);
}

/* Renews the lease every heartbeat_ms; registers again when the coordinator forgot this
 * trainer (it restarted). Failures are only logged: the lease is what they cost. */
static void *lease_main(void *arg)
{
    pshard_client_t *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        /* The condition variable is shared with the operations: wake-ups for them do not
         * count as the heartbeat's turn. */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int64_t ns = ts.tv_nsec + (c->heartbeat_ms % 1000) * 1000000;
        ts.tv_sec += c->heartbeat_ms / 1000 + ns / 1000000000;
        ts.tv_nsec = ns % 1000000000;
        while (!c->stop && pthread_cond_timedwait(&c->cv, &c->mu, &ts) != ETIMEDOUT) {
        }
        if (c->stop)
            break;
        char id[64], key[64];
        ps_strlcpy(id, c->member_id, sizeof(id));
        ps_strlcpy(key, c->lease_key, sizeof(key));
        pthread_mutex_unlock(&c->mu);
        char err[512] = "";
        pshard_status_t rc;
        if (!id[0]) {
            rc = lease_register(c, err, sizeof(err));
        } else {
            Pshard__HeartbeatRequest req = PSHARD__HEARTBEAT_REQUEST__INIT;
            req.member_id = id;
            req.lease_key = key;
            ProtobufCMessage *resp = NULL;
            rc = ps_rpc_unary(c->coord, "/pshard.Coordinator/Heartbeat", &req.base,
                              &pshard__member_view__descriptor, &resp, 2000, 0, NULL, err,
                              sizeof(err));
            if (resp) {
                Pshard__MemberView *v = (Pshard__MemberView *)resp;
                bool changed = v->generation != c->seen_generation;
                bool degraded = v->state == PSHARD__CLUSTER_STATE__DEGRADED;
                c->seen_generation = v->generation;
                protobuf_c_message_free_unpacked(resp, NULL);
                if (changed && degraded)
                    check_own_server(c);
            }
            if (rc == PSHARD_ERR_NOT_FOUND) {
                pthread_mutex_lock(&c->mu);
                c->member_id[0] = '\0'; /* register again on the next round */
                pthread_mutex_unlock(&c->mu);
            }
        }
        if (rc != PSHARD_OK)
            PS_WARN(PS_SUB_CLIENT, "trainer lease with %s: %s", c->coord_addr, err);
        pthread_mutex_lock(&c->mu);
        c->lease_ok = rc == PSHARD_OK;
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Starts the trainer's lease (best effort: without a coordinator address or when it cannot
 * be reached, training works, only a lost trainer is then found by the collectives'
 * timeout). PSHARD_COORDINATOR overrides the address the shard server reported. */
static void lease_start(pshard_client_t *c, const char *reported)
{
    const char *env = getenv("PSHARD_COORDINATOR");
    const char *addr = env && *env ? env : reported;
    if (!addr || !*addr)
        return;
    ps_strlcpy(c->coord_addr, addr, sizeof(c->coord_addr));
    const char *ca = getenv("PSHARD_COORDINATOR_CA");
    ps_rpc_channel_config_t cc = {.target = c->coord_addr, .token = c->token,
                                  .tls_ca_file = ca && *ca ? ca : NULL,
                                  .job = c->job[0] ? c->job : NULL,
                                  .max_message_bytes = 64 << 20}; /* a large job's Status */
    char err[512] = "";
    c->coord = ps_rpc_channel_create(&cc, err, sizeof(err));
    pshard_status_t rc = c->coord ? lease_register(c, err, sizeof(err)) : PSHARD_ERR_UNAVAILABLE;
    if (rc == PSHARD_ERR_ALREADY_EXISTS) {
        /* A previous incarnation of this rank (a restarted trainer) still holds the name:
         * the lease thread registers once that lease has lapsed. */
        PS_WARN(PS_SUB_CLIENT, "trainer lease with %s: %s; registering when it lapses",
                c->coord_addr, err);
        c->heartbeat_ms = 1000;
    } else if (rc != PSHARD_OK) {
        PS_WARN(PS_SUB_CLIENT, "cannot register the trainer with coordinator %s: %s; a lost "
                               "trainer will only be noticed by the collectives' timeout",
                c->coord_addr, err);
        return;
    }
    c->lease_ok = rc == PSHARD_OK;
    if (pthread_create(&c->lease_thread, NULL, lease_main, c) == 0)
        c->lease_started = true;
}

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
            c->token = ps_read_token(tf, err, errlen); /* PSHARD_TOKEN_FILE */
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
    rc = region_create(&c->scratch, c->cfg.scratch_bytes, "scratch", c->cfg.remote, true, false,
                       err, errlen);
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
        char member[32];
        snprintf(member, sizeof(member), "trainer-%d", cfg->rank); /* as lease_register names it */
        req.member_name = member;
        ProtobufCMessage *resp = NULL;
        char e[1024] = "";
        rc = call(c, "Attach", &req.base, &pshard__attach_response__descriptor, &resp, e,
                  sizeof(e));
        if (rc == PSHARD_OK) {
            Pshard__AttachResponse *a = (Pshard__AttachResponse *)resp;
            ps_strlcpy(c->session, a->session, sizeof(c->session));
            region_unlink(&c->scratch);
            c->rank = a->rank;
            c->world = a->world_size;
            ps_strlcpy(c->coord_addr, a->coordinator ? a->coordinator : "",
                       sizeof(c->coord_addr));
            ps_strlcpy(c->job, a->job ? a->job : "", sizeof(c->job));
            protobuf_c_message_free_unpacked(resp, NULL);
            break;
        }
        /* ALREADY_EXISTS: the previous trainer of this rank (one that was restarted) still
         * holds the session until its lease lapses. */
        if ((rc != PSHARD_ERR_UNAVAILABLE && rc != PSHARD_ERR_ALREADY_EXISTS) ||
            ps_now_ns() > give_up) {
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
    lease_start(c, c->coord_addr);
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
    if (c->lease_started) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        /* A heartbeat waiting on an unreachable coordinator must not hold up the exit. */
        ps_rpc_channel_cancel_calls(c->coord, "the trainer is closing");
        pthread_join(c->lease_thread, NULL);
    }
    if (c->coord && c->member_id[0] && c->lease_ok) {
        Pshard__LeaveRequest lv = PSHARD__LEAVE_REQUEST__INIT;
        lv.member_id = c->member_id;
        lv.lease_key = c->lease_key;
        ProtobufCMessage *resp = NULL;
        char err[256] = "";
        if (ps_rpc_unary(c->coord, "/pshard.Coordinator/Leave", &lv.base,
                         &pshard__leave_response__descriptor, &resp, 1000, 0, NULL, err,
                         sizeof(err)) == PSHARD_OK)
            protobuf_c_message_free_unpacked(resp, NULL);
    }
    ps_rpc_channel_destroy(c->coord);
    ps_rpc_channel_destroy(c->ch);
    region_destroy(&c->scratch);
    region_destroy(&c->model);
    model_free(c);
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
    mc->reshard_after_forward = true;
    mc->max_gathers_in_flight = 2;
    mc->ngroups = 0; /* one group from the fields above */
    mc->groups = NULL;
    mc->param_groups = NULL;
}

/* Parameter groups as protobuf messages for DefineModel and Step (copies of the values).
 * False when out of memory; pb_groups_free releases (also after a failure). */
typedef struct {
    Pshard__OptimizerGroup *msgs;
    Pshard__OptimizerGroup **ptrs;
    size_t n;
} pb_groups_t;

static void pb_groups_free(pb_groups_t *pg)
{
    free(pg->msgs);
    free(pg->ptrs);
    memset(pg, 0, sizeof(*pg));
}

static bool pb_groups_make(pb_groups_t *pg, const pshard_optim_group_t *g, size_t n)
{
    memset(pg, 0, sizeof(*pg));
    if (n == 0)
        return true;
    pg->msgs = calloc(n, sizeof(*pg->msgs));
    pg->ptrs = calloc(n, sizeof(*pg->ptrs));
    if (!pg->msgs || !pg->ptrs) {
        pb_groups_free(pg);
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        Pshard__OptimizerGroup *m = &pg->msgs[i];
        pshard__optimizer_group__init(m);
        m->lr = g[i].lr;
        m->momentum = g[i].momentum;
        m->dampening = g[i].dampening;
        m->nesterov = g[i].nesterov;
        m->weight_decay = g[i].weight_decay;
        m->beta1 = g[i].beta1;
        m->beta2 = g[i].beta2;
        m->eps = g[i].eps;
        m->frozen = g[i].frozen;
        pg->ptrs[i] = m;
    }
    pg->n = n;
    return true;
}

static size_t align_up(size_t x)
{
    return (x + CLIENT_POOL_ALIGN - 1) / CLIENT_POOL_ALIGN * CLIENT_POOL_ALIGN;
}

/* ---- buffer states (callers hold c->mu) ------------------------------------------------- */

static void buf_release(pshard_client_t *c, tensor_buf_t *b)
{
    if (b->state != BUF_NONE)
        client_pool_free(c->pool, b->off, b->bytes);
    b->state = BUF_NONE;
}

static void region_discard(region_t *r, size_t off, size_t len);

static size_t page_up(const pshard_client_t *c, size_t x)
{
    return (x + c->page - 1) / c->page * c->page;
}

/* Whether parameter i's fixed addresses are remapped to pool blocks (see stable_off). */
static bool param_remapped(const pshard_client_t *c, size_t i)
{
    return c->remap && c->numel[i] * pshard_dtype_size(c->param_dtype) >= c->page;
}

/* Points the len bytes at parameter i's fixed address at the region's file from file_off. */
static bool param_map(pshard_client_t *c, size_t i, size_t file_off, size_t len, bool populate)
{
    void *want = (uint8_t *)c->model.base + c->stable_off[i];
    void *p = mmap(want, len, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0), c->model.fd,
                   (off_t)file_off);
    return p == want;
}

/* Takes the block for parameter i's full values: its fixed block with stable_param_buffers
 * (for a remapped parameter, a pool block mapped at its fixed address), else one from the
 * pool. 1: taken; 0: the pool is full; -1: failed (the error is set). */
static int param_take(pshard_client_t *c, size_t i, size_t bytes, size_t *off)
{
    if (!c->stable_off)
        return client_pool_alloc(c->pool, bytes, CLIENT_POOL_ALIGN, off) ? 1 : 0;
    if (param_remapped(c, i)) {
        size_t len = page_up(c, bytes);
        if (!client_pool_alloc(c->pool, len, c->page, off))
            return 0;
        if (!param_map(c, i, *off, len, true)) {
            int e = errno;
            /* Whatever the failed call left at the fixed address, put its own pages back
             * before the block can go to another parameter. */
            if (param_map(c, i, c->stable_off[i], len, false))
                client_pool_free(c->pool, *off, len);
            fail(c, PSHARD_ERR_NO_MEMORY, "cannot map parameter #%zu's %zu-byte block: %s", i,
                 len, strerror(e));
            return -1;
        }
        return 1;
    }
    *off = c->stable_off[i];
    client_pool_hold(c->pool, bytes);
    return 1;
}

/* Reshards parameter i: its block goes back to the pool, or with stable_param_buffers its
 * addresses stay valid and read as zeros until the next gather writes them again (a remapped
 * parameter's show its own unwritten pages again, its pool block is kept backed for the next
 * gather; another one's pages go back to the kernel). */
static void param_release(pshard_client_t *c, size_t i)
{
    tensor_buf_t *b = &c->pbuf[i];
    if (b->state != BUF_NONE && c->stable_off && param_remapped(c, i)) {
        size_t len = page_up(c, b->bytes);
        if (param_map(c, i, c->stable_off[i], len, false))
            client_pool_free(c->pool, b->off, len);
        else /* still shown at the fixed address: never hand it to another parameter */
            PS_WARN(PS_SUB_CLIENT,
                    "cannot map parameter #%zu's own pages back (%s): its %zu-byte pool block "
                    "stays out of the pool",
                    i, strerror(errno), len);
        b->state = BUF_NONE;
    } else if (b->state != BUF_NONE && c->stable_off) {
        client_pool_unhold(c->pool, b->bytes);
        /* A block of a page or more owns whole pages, its last one included. */
        region_discard(&c->model, b->off, b->bytes >= c->page ? page_up(c, b->bytes) : b->bytes);
        b->state = BUF_NONE;
    }
    buf_release(c, b);
}

/* Frees every full parameter and gradient (a new model, or parameters stale after a step). */
static void pool_reset_params(pshard_client_t *c)
{
    for (size_t i = 0; i < c->nparams; i++)
        if (c->pbuf[i].state == BUF_READY)
            param_release(c, i);
}

static void model_free(pshard_client_t *c)
{
    free(c->numel);
    free(c->stable_off);
    c->stable_off = NULL;
    free(c->pbuf);
    free(c->gbuf);
    client_pool_destroy(c->pool);
    c->numel = NULL;
    c->pbuf = c->gbuf = NULL;
    c->pool = NULL;
    c->nparams = 0;
}

/* Gives the pages of [off, off + len) of the model region back to the kernel: MADV_REMOVE
 * punches a hole in the shared-memory file, so neither process keeps them. */
static void region_discard(region_t *r, size_t off, size_t len)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t start = (off + page - 1) / page * page, end = (off + len) / page * page;
    if (end > start)
        madvise((uint8_t *)r->base + start, end - start,
                r->name[0] ? MADV_REMOVE : MADV_DONTNEED);
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
    if (mc->max_gathers_in_flight < 0)
        return fail(c, PSHARD_ERR_INVALID_ARGUMENT, "max_gathers_in_flight must be >= 0");
    if (mc->ngroups > 0 && (!mc->groups || !mc->param_groups))
        return fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                    "ngroups is %zu but groups or param_groups is NULL (param_groups needs one "
                    "group index per parameter)",
                    mc->ngroups);
    bool need_init = !mc->init_from_rank0 || c->rank == 0;
    if (need_init && !init)
        return fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                    "initial values are required on %s", mc->init_from_rank0 ? "rank 0"
                                                                             : "every rank");
    pthread_mutex_lock(&c->mu);
    bool idle = !c->qhead && !c->busy;
    pthread_mutex_unlock(&c->mu);
    if (!idle)
        return fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                    "asynchronous work is still in flight; wait for it before redefining");
    size_t *numel = calloc(nparams, sizeof(size_t));
    tensor_buf_t *pbuf = calloc(nparams, sizeof(tensor_buf_t));
    tensor_buf_t *gbuf = calloc(nparams, sizeof(tensor_buf_t));
    Pshard__ParamSpec *specs = calloc(nparams, sizeof(*specs));
    Pshard__ParamSpec **sptrs = calloc(nparams, sizeof(*sptrs));
    uint64_t *init_offsets = calloc(nparams, sizeof(uint64_t));
    client_pool_t *new_pool = NULL;
    size_t *stable_off = mc->stable_param_buffers ? calloc(nparams, sizeof(size_t)) : NULL;
    bool remap = mc->stable_param_buffers && !c->cfg.remote;
    pshard_status_t rc = PSHARD_OK;
    if (!numel || !pbuf || !gbuf || !specs || !sptrs || !init_offsets ||
        (mc->stable_param_buffers && !stable_off)) {
        rc = fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    size_t ps = pshard_dtype_size(mc->param_dtype), gs = pshard_dtype_size(mc->reduce_dtype);
    size_t all_bytes = 0, init_bytes = 0, stable_bytes = 0;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
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
        if (stable_off) {
            /* Blocks of a page or more take whole pages of their own, so that a reshard gives
             * all their pages back, or they can be remapped (see stable_off). */
            if (n * ps >= page) {
                stable_bytes = (stable_bytes + page - 1) / page * page;
                stable_off[i] = stable_bytes;
                stable_bytes += (n * ps + page - 1) / page * page;
                if (remap)
                    all_bytes += (n * ps + page - 1) / page * page + page;
            } else {
                stable_off[i] = stable_bytes;
                stable_bytes += align_up(n * ps);
            }
            all_bytes += align_up(n * gs);
        } else {
            all_bytes += align_up(n * ps) + align_up(n * gs);
        }
        init_offsets[i] = init_bytes;
        init_bytes = align_up(init_bytes + n * 4);
        pshard__param_spec__init(&specs[i]);
        specs[i].name = (char *)(params[i].name ? params[i].name : "");
        specs[i].n_shape = (size_t)params[i].ndim;
        specs[i].shape = (int64_t *)params[i].shape;
        sptrs[i] = &specs[i];
    }
    /* Twice what everything needs at once, so first fit cannot fail for want of a hole; it
     * costs address space only, as pages are backed when first used. */
    size_t pool = mc->pool_bytes ? align_up(mc->pool_bytes) : 2 * all_bytes;
    stable_bytes = (stable_bytes + page - 1) / page * page;
    size_t bytes = stable_bytes + pool > init_bytes ? stable_bytes + pool : init_bytes;
    new_pool = client_pool_create(stable_bytes, pool);
    if (!new_pool) {
        rc = fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    region_t model = {0};
    char err[1024] = "";
    rc = region_create(&model, bytes, "model", c->cfg.remote, false, remap, err, sizeof(err));
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
    oc.in_backward = mc->optimizer_in_backward;
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
    pb_groups_t pg;
    if (!pb_groups_make(&pg, mc->groups, mc->ngroups)) {
        region_destroy(&model);
        rc = fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    req.n_groups = pg.n;
    req.groups = pg.ptrs;
    req.n_param_groups = mc->ngroups ? nparams : 0;
    req.param_groups = (uint32_t *)mc->param_groups;
    ProtobufCMessage *dresp = NULL;
    rc = call(c, "DefineModel", &req.base, &pshard__define_model_response__descriptor, &dresp,
              err, sizeof(err));
    pb_groups_free(&pg);
    if (rc != PSHARD_OK) {
        region_destroy(&model);
        fail(c, rc, "DefineModel: %s", err);
        goto out;
    }
    int64_t model_step = ((Pshard__DefineModelResponse *)dresp)->step;
    protobuf_c_message_free_unpacked(dresp, NULL);
    region_unlink(&model);
    /* The initial values are consumed: their pages go back (in both processes). */
    if (need_init) {
        /* Up to the end of the last page: nothing else is in use yet, and a fixed buffer in
         * that page must read as zeros until its first gather. */
        size_t end = (init_bytes + page - 1) / page * page;
        region_discard(&model, 0, end < model.bytes ? end : model.bytes);
    }
    pthread_mutex_lock(&c->mu);
    region_destroy(&c->model);
    model_free(c);
    c->model = model;
    c->numel = numel;
    c->pbuf = pbuf;
    c->gbuf = gbuf;
    c->pool = new_pool;
    c->stable_off = stable_off;
    c->remap = remap;
    c->page = page;
    stable_off = NULL;
    numel = NULL;
    pbuf = gbuf = NULL;
    new_pool = NULL;
    c->nparams = nparams;
    c->param_dtype = mc->param_dtype;
    c->reduce_dtype = mc->reduce_dtype;
    c->reshard_after_forward = mc->reshard_after_forward;
    c->max_gathers_in_flight = mc->max_gathers_in_flight;
    c->model_step = model_step;
    c->gathers_in_flight = 0;
    memset(&c->mem, 0, sizeof(c->mem));
    c->mem.pool_bytes = pool;
    pthread_mutex_unlock(&c->mu);
out:
    free(numel);
    free(stable_off);
    free(pbuf);
    free(gbuf);
    free(specs);
    free(sptrs);
    free(init_offsets);
    client_pool_destroy(new_pool);
    return rc;
}

void *pshard_param(pshard_client_t *c, size_t i)
{
    void *p = NULL;
    pthread_mutex_lock(&c->mu);
    if (i < c->nparams && c->pbuf[i].state == BUF_READY)
        p = (uint8_t *)c->model.base + (c->stable_off ? c->stable_off[i] : c->pbuf[i].off);
    pthread_mutex_unlock(&c->mu);
    return p;
}

void *pshard_grad(pshard_client_t *c, size_t i)
{
    void *p = NULL;
    bool fresh = false;
    size_t bytes = 0;
    pthread_mutex_lock(&c->mu);
    if (i >= c->nparams) {
        fail(c, PSHARD_ERR_NOT_FOUND, "unknown parameter #%zu", i);
    } else if (c->gbuf[i].state == BUF_PENDING) {
        fail(c, PSHARD_ERR_FAILED_PRECONDITION,
             "the gradient of parameter #%zu is being reduce-scattered", i);
    } else if (c->gbuf[i].state == BUF_READY) {
        p = (uint8_t *)c->model.base + c->gbuf[i].off;
    } else {
        bytes = c->numel[i] * pshard_dtype_size(c->reduce_dtype);
        size_t off;
        if (client_pool_alloc(c->pool, bytes, CLIENT_POOL_ALIGN, &off)) {
            c->gbuf[i] = (tensor_buf_t){BUF_READY, off, bytes};
            p = (uint8_t *)c->model.base + off;
            fresh = true;
        } else {
            fail(c, PSHARD_ERR_NO_MEMORY,
                 "the %zu-byte pool cannot fit the %zu-byte gradient of parameter #%zu (%zu "
                 "bytes in use): reshard or reduce-scatter first, or raise pool_bytes",
                 c->mem.pool_bytes, bytes, i, c->pool->in_use_bytes);
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (fresh)
        memset(p, 0, bytes);
    return p;
}

void *pshard_param_buffer(pshard_client_t *c, size_t i)
{
    void *p = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->stable_off && i < c->nparams)
        p = (uint8_t *)c->model.base + c->stable_off[i];
    pthread_mutex_unlock(&c->mu);
    return p;
}

size_t pshard_param_numel(const pshard_client_t *c, size_t i)
{
    return i < c->nparams ? c->numel[i] : 0;
}

void pshard_memory_stats(pshard_client_t *c, pshard_memory_stats_t *out)
{
    pthread_mutex_lock(&c->mu);
    *out = c->mem;
    if (c->pool) {
        out->in_use_bytes = c->pool->in_use_bytes;
        out->peak_in_use_bytes = c->pool->peak_in_use_bytes;
        out->touched_bytes = c->pool->touched_bytes;
    }
    pthread_mutex_unlock(&c->mu);
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

/* One Gather or ReduceScatter request for the blocks picked when the work was issued. */
static pshard_status_t run_tensor_op(pshard_client_t *c, work_kind_t kind, const size_t *ids,
                                     const uint64_t *offs, size_t count, char *err,
                                     size_t errlen)
{
    if (count == 0)
        return PSHARD_OK;
    Pshard__TensorRef *refs = calloc(count, sizeof(*refs));
    Pshard__TensorRef **ptrs = calloc(count, sizeof(*ptrs));
    if (!refs || !ptrs) {
        free(refs);
        free(ptrs);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    pshard_status_t rc = PSHARD_OK;
    for (size_t k = 0; k < count; k++) {
        pshard__tensor_ref__init(&refs[k]);
        refs[k].param = (uint32_t)ids[k];
        refs[k].offset = offs[k];
        ptrs[k] = &refs[k];
    }
    size_t ps = pshard_dtype_size(c->param_dtype), gs = pshard_dtype_size(c->reduce_dtype);
    if (c->cfg.remote && kind == WORK_REDUCE_SCATTER) {
        for (size_t k = 0; k < count && rc == PSHARD_OK; k++)
            rc = remote_write(c, PSHARD__REGION__MODEL, &c->model, refs[k].offset,
                              c->numel[ids[k]] * gs, 0, err, errlen);
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
                             c->numel[ids[k]] * ps, err, errlen);
    }
    free(refs);
    free(ptrs);
    return rc;
}

/* Publishes the end of a work's transfer (holding c->mu): gathered parameters become
 * readable, or are freed again on failure; reduce-scattered gradients go back to the pool. */
static void finish_buffers(pshard_client_t *c, pshard_work_t *w, pshard_status_t rc)
{
    for (size_t k = 0; k < w->n; k++) {
        size_t i = w->ids[k];
        if (w->kind == WORK_GATHER) {
            if (rc == PSHARD_OK)
                c->pbuf[i].state = BUF_READY;
            else
                param_release(c, i);
        } else {
            buf_release(c, &c->gbuf[i]);
        }
    }
    if (w->kind == WORK_GATHER && w->counted) {
        c->gathers_in_flight--;
        w->counted = false;
    }
}

/* Picks the parameters a work moves and their blocks, on the caller's thread (holding
 * c->mu): a gather skips what is gathered or being gathered and takes blocks from the pool,
 * waiting for unfinished work to return blocks when it is full; a reduce-scatter takes the
 * gradients handed out by pshard_grad. On error nothing is taken. */
static pshard_status_t claim_buffers(pshard_client_t *c, pshard_work_t *w, const size_t *ids,
                                     size_t n)
{
    size_t count = n ? n : c->nparams;
    w->ids = malloc((count ? count : 1) * sizeof(size_t));
    w->offs = malloc((count ? count : 1) * sizeof(uint64_t));
    if (!w->ids || !w->offs)
        return fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
    w->n = 0;
    for (size_t k = 0; k < count; k++) {
        size_t i = n ? ids[k] : k;
        if (i >= c->nparams) {
            finish_buffers(c, w, PSHARD_ERR_ABORTED);
            w->n = 0;
            return fail(c, PSHARD_ERR_NOT_FOUND, "unknown parameter #%zu (the model has %zu)", i,
                        c->nparams);
        }
        if (w->kind == WORK_GATHER) {
            if (c->pbuf[i].state != BUF_NONE) {
                c->mem.params_skipped++;
                continue;
            }
            size_t bytes = c->numel[i] * pshard_dtype_size(c->param_dtype), off;
            int took;
            while ((took = param_take(c, i, bytes, &off)) == 0) {
                if (!c->qhead && !c->busy) {
                    size_t in_use = c->pool->in_use_bytes;
                    finish_buffers(c, w, PSHARD_ERR_ABORTED);
                    w->n = 0;
                    return fail(c, PSHARD_ERR_NO_MEMORY,
                                "the %zu-byte pool cannot fit the %zu-byte parameter #%zu "
                                "(%zu bytes in use): reshard or reduce-scatter first, or raise "
                                "pool_bytes",
                                c->mem.pool_bytes, bytes, i, in_use);
                }
                pthread_cond_wait(&c->cv, &c->mu);
            }
            if (took < 0) {
                char why[sizeof(c->last_error)];
                ps_strlcpy(why, c->last_error, sizeof(why));
                finish_buffers(c, w, PSHARD_ERR_ABORTED);
                w->n = 0;
                return fail(c, PSHARD_ERR_NO_MEMORY, "%s", why);
            }
            c->pbuf[i] = (tensor_buf_t){BUF_PENDING, off, bytes};
            c->mem.params_gathered++;
        } else {
            if (c->gbuf[i].state != BUF_READY) {
                if (!n)
                    continue; /* "all": the gradients handed out */
                finish_buffers(c, w, PSHARD_ERR_ABORTED);
                w->n = 0;
                return fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                            c->gbuf[i].state == BUF_PENDING
                                ? "the gradient of parameter #%zu is already being "
                                  "reduce-scattered"
                                : "the gradient of parameter #%zu was never written "
                                  "(pshard_grad hands out its buffer)",
                            i);
            }
            c->gbuf[i].state = BUF_PENDING;
        }
        w->offs[w->n] = w->kind == WORK_GATHER ? c->pbuf[i].off : c->gbuf[i].off;
        w->ids[w->n++] = i;
    }
    return PSHARD_OK;
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
        pshard_status_t rc =
            run_tensor_op(c, w->kind, w->ids, w->offs, w->n, err, sizeof(err));
        pthread_mutex_lock(&c->mu);
        finish_buffers(c, w, rc);
        c->busy = false;
        w->status = rc;
        ps_strlcpy(w->error, err, sizeof(w->error));
        w->done = true;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
}

static void work_free(pshard_work_t *w)
{
    if (w) {
        free(w->ids);
        free(w->offs);
        free(w);
    }
}

static pshard_status_t start_work(pshard_client_t *c, work_kind_t kind, const size_t *ids,
                                  size_t n, pshard_work_t **out)
{
    *out = NULL;
    if (!c->nparams)
        return fail(c, PSHARD_ERR_FAILED_PRECONDITION, "no model is defined");
    pshard_work_t *w = calloc(1, sizeof(*w));
    if (!w)
        return fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
    w->kind = kind;
    w->c = c;
    pthread_mutex_lock(&c->mu);
    if (kind == WORK_GATHER) {
        while (c->max_gathers_in_flight > 0 && c->gathers_in_flight >= c->max_gathers_in_flight)
            pthread_cond_wait(&c->cv, &c->mu);
    }
    pshard_status_t rc = claim_buffers(c, w, ids, n);
    if (rc != PSHARD_OK) {
        pthread_mutex_unlock(&c->mu);
        work_free(w);
        return rc;
    }
    if (w->n == 0) {
        w->done = true; /* nothing to move: complete at once */
    } else {
        if (kind == WORK_GATHER) {
            w->counted = true;
            if (++c->gathers_in_flight > c->mem.peak_gathers_in_flight)
                c->mem.peak_gathers_in_flight = c->gathers_in_flight;
        }
        if (c->qtail)
            c->qtail->next = w;
        else
            c->qhead = w;
        c->qtail = w;
        pthread_cond_broadcast(&c->cv);
    }
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
    work_free(w);
    return rc;
}

bool pshard_work_test(pshard_work_t *w)
{
    if (!w)
        return false;
    pthread_mutex_lock(&w->c->mu);
    bool done = w->done;
    pthread_mutex_unlock(&w->c->mu);
    return done;
}

/* A blocking operation runs on the caller's thread once everything issued before it finished:
 * handing it to the worker and waiting would only add two thread wake-ups. */
static pshard_status_t run_inline(pshard_client_t *c, work_kind_t kind, const size_t *ids,
                                  size_t n)
{
    if (!c->nparams)
        return fail(c, PSHARD_ERR_FAILED_PRECONDITION, "no model is defined");
    pshard_work_t w = {.c = c, .kind = kind};
    pthread_mutex_lock(&c->mu);
    while (c->qhead || c->busy)
        pthread_cond_wait(&c->cv, &c->mu);
    pshard_status_t rc = claim_buffers(c, &w, ids, n);
    if (rc != PSHARD_OK) {
        pthread_mutex_unlock(&c->mu);
        free(w.ids);
        free(w.offs);
        return rc;
    }
    c->busy = true;
    pthread_mutex_unlock(&c->mu);
    char err[1024] = "";
    rc = run_tensor_op(c, kind, w.ids, w.offs, w.n, err, sizeof(err));
    pthread_mutex_lock(&c->mu);
    finish_buffers(c, &w, rc);
    c->busy = false;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    free(w.ids);
    free(w.offs);
    if (rc != PSHARD_OK)
        fail(c, rc, "%s", err);
    return rc;
}

pshard_status_t pshard_gather(pshard_client_t *c, const size_t *ids, size_t n)
{
    /* Parameters an earlier gather brought in need nothing: return without queueing behind
     * the reduce-scatters in flight (backward gathers a unit it prefetched while the unit
     * after it is being reduced). */
    pthread_mutex_lock(&c->mu);
    bool all_ready = c->nparams > 0;
    for (size_t k = 0; k < (n ? n : c->nparams) && all_ready; k++) {
        size_t i = n ? ids[k] : k;
        all_ready = i < c->nparams && c->pbuf[i].state == BUF_READY;
    }
    if (all_ready)
        c->mem.params_skipped += n ? n : c->nparams;
    pthread_mutex_unlock(&c->mu);
    return all_ready ? PSHARD_OK : run_inline(c, WORK_GATHER, ids, n);
}

pshard_status_t pshard_reduce_scatter(pshard_client_t *c, const size_t *ids, size_t n)
{
    return run_inline(c, WORK_REDUCE_SCATTER, ids, n);
}

pshard_status_t pshard_reshard(pshard_client_t *c, const size_t *ids, size_t n)
{
    pthread_mutex_lock(&c->mu);
    size_t count = n ? n : c->nparams;
    pshard_status_t rc = PSHARD_OK;
    for (size_t k = 0; k < count && rc == PSHARD_OK; k++) {
        size_t i = n ? ids[k] : k;
        if (i >= c->nparams)
            rc = fail(c, PSHARD_ERR_NOT_FOUND, "unknown parameter #%zu (the model has %zu)", i,
                      c->nparams);
        else if (c->pbuf[i].state == BUF_PENDING)
            rc = fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                      "parameter #%zu is still being gathered: wait for its gather first", i);
    }
    if (rc == PSHARD_OK)
        for (size_t k = 0; k < count; k++)
            param_release(c, n ? ids[k] : k);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

pshard_status_t pshard_forward_done(pshard_client_t *c, const size_t *ids, size_t n)
{
    return c->reshard_after_forward ? pshard_reshard(c, ids, n) : PSHARD_OK;
}

/* What pshard_step and pshard_step_groups share: one Step with this step's lr (set_lr) or
 * every group's hyperparameters (groups, ngroups > 0). */
static pshard_status_t step_request(pshard_client_t *c, bool set_lr, double lr,
                                    const pshard_optim_group_t *groups, size_t ngroups,
                                    int64_t *step, double *grad_norm)
{
    Pshard__StepRequest req = PSHARD__STEP_REQUEST__INIT;
    req.session = c->session;
    if (set_lr) {
        req.lr = lr;
        req.set_lr = true;
    }
    pb_groups_t pg;
    if (!pb_groups_make(&pg, groups, ngroups))
        return fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
    req.n_groups = pg.n;
    req.groups = pg.ptrs;
    ProtobufCMessage *resp = NULL;
    char err[1024] = "";
    /* Reductions issued before the step are part of it, so it waits for them. The step
     * changes every parameter: full copies are stale from here on (FSDP reshards after
     * backward anyway). */
    pthread_mutex_lock(&c->mu);
    while (c->qhead || c->busy)
        pthread_cond_wait(&c->cv, &c->mu);
    pool_reset_params(c);
    pthread_mutex_unlock(&c->mu);
    pshard_status_t rc =
        call(c, "Step", &req.base, &pshard__step_response__descriptor, &resp, err, sizeof(err));
    pb_groups_free(&pg);
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

pshard_status_t pshard_step(pshard_client_t *c, double lr, int64_t *step, double *grad_norm)
{
    return step_request(c, lr >= 0, lr, NULL, 0, step, grad_norm);
}

pshard_status_t pshard_step_groups(pshard_client_t *c, const pshard_optim_group_t *groups,
                                   size_t ngroups, int64_t *step, double *grad_norm)
{
    if (ngroups == 0 || !groups)
        return fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                    "pshard_step_groups needs every group's hyperparameters (ngroups >= 1)");
    return step_request(c, false, 0.0, groups, ngroups, step, grad_norm);
}

pshard_status_t pshard_clip_grad_norm(pshard_client_t *c, double max_norm, double norm_type,
                                      double *total_norm)
{
    if (!c->nparams)
        return fail(c, PSHARD_ERR_FAILED_PRECONDITION, "no model is defined");
    /* The reduce-scatters issued before are part of the gradients it clips. */
    pthread_mutex_lock(&c->mu);
    while (c->qhead || c->busy)
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    Pshard__ClipGradNormRequest req = PSHARD__CLIP_GRAD_NORM_REQUEST__INIT;
    req.session = c->session;
    req.max_norm = max_norm;
    req.norm_type = norm_type;
    ProtobufCMessage *resp = NULL;
    char err[1024] = "";
    pshard_status_t rc = call(c, "ClipGradNorm", &req.base,
                              &pshard__clip_grad_norm_response__descriptor, &resp, err,
                              sizeof(err));
    if (rc != PSHARD_OK)
        return fail(c, rc, "ClipGradNorm: %s", err);
    if (total_norm)
        *total_norm = ((const Pshard__ClipGradNormResponse *)resp)->total_norm;
    protobuf_c_message_free_unpacked(resp, NULL);
    return PSHARD_OK;
}

int64_t pshard_model_step(const pshard_client_t *c)
{
    return c->model_step;
}

pshard_status_t pshard_checkpoint_save(pshard_client_t *c, int64_t *step, char *dir,
                                       size_t dirlen)
{
    if (!c->nparams)
        return fail(c, PSHARD_ERR_FAILED_PRECONDITION, "no model is defined");
    pthread_mutex_lock(&c->mu);
    while (c->qhead || c->busy)
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    Pshard__CheckpointRequest req = PSHARD__CHECKPOINT_REQUEST__INIT;
    req.session = c->session;
    ProtobufCMessage *resp = NULL;
    char err[1024] = "";
    pshard_status_t rc = call(c, "Checkpoint", &req.base, &pshard__checkpoint_response__descriptor,
                              &resp, err, sizeof(err));
    if (rc != PSHARD_OK)
        return fail(c, rc, "Checkpoint: %s", err);
    const Pshard__CheckpointResponse *r = (const Pshard__CheckpointResponse *)resp;
    if (step)
        *step = r->step;
    if (dir && dirlen)
        ps_strlcpy(dir, r->dir ? r->dir : "", dirlen);
    protobuf_c_message_free_unpacked(resp, NULL);
    return PSHARD_OK;
}

void pshard_join_options_default(pshard_join_options_t *o)
{
    o->enable = true;
    o->throw_on_early_termination = false;
}

pshard_status_t pshard_join(pshard_client_t *c, const pshard_join_options_t *opts,
                            pshard_join_result_t *result)
{
    pshard_join_options_t def;
    if (!opts) {
        pshard_join_options_default(&def);
        opts = &def;
    }
    if (!opts->enable)
        return fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                    "Join is disabled (enable = false): this trainer cannot join");
    if (!c->nparams)
        return fail(c, PSHARD_ERR_FAILED_PRECONDITION, "define the model before joining");
    pthread_mutex_lock(&c->mu);
    while (c->qhead || c->busy)
        pthread_cond_wait(&c->cv, &c->mu);
    pool_reset_params(c);
    pthread_mutex_unlock(&c->mu);
    Pshard__JoinRequest req = PSHARD__JOIN_REQUEST__INIT;
    req.session = c->session;
    req.throw_on_early_termination = opts->throw_on_early_termination;
    ProtobufCMessage *resp = NULL;
    char err[1024] = "";
    char path[64] = "/pshard.ShardServer/Join";
    /* The others may train for a long time yet: no deadline of the usual size. Failures
     * reach this call through the collectives (a lost peer, a timeout). */
    pshard_status_t rc = ps_rpc_unary(c->ch, path, &req.base, &pshard__join_response__descriptor,
                                      &resp, 30LL * 24 * 3600 * 1000, 0, NULL, err, sizeof(err));
    if (rc != PSHARD_OK)
        return fail(c, rc, "Join: %s", err);
    Pshard__JoinResponse *r = (Pshard__JoinResponse *)resp;
    if (result) {
        result->is_last_joiner = r->is_last_joiner;
        result->last_rank = r->last_rank;
        result->step = r->step;
        result->shadowed_ops = r->shadowed_ops;
    }
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
