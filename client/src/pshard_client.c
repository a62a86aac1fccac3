/* libpshard: the trainer side. It owns two shared-memory regions that its shard server maps: a
 * scratch region for plain collectives and a model region holding every parameter's full
 * buffer (param_dtype) and gradient buffer (reduce_dtype). Requests go over gRPC; asynchronous
 * ones run in issue order on the client's worker thread. This file connects and closes a
 * client, and runs Join and the plain collectives; the model, the buffers, the work queue,
 * the regions, the RPC wrappers and the lease each have a client_*.c of their own. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/util.h"

#include "client_internal.h"

int pshard_rank(const pshard_client_t *c)
{
    return c->rank;
}

int pshard_world_size(const pshard_client_t *c)
{
    return c->world;
}

pshard_status_t pshard_client_config_from_env(pshard_client_config_t *cfg, char *err, size_t errlen)
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
    if (cfg->server && !*cfg->server)
        cfg->server = NULL;
    cfg->coordinator = getenv("PSHARD_COORDINATOR");
    if (cfg->coordinator && !*cfg->coordinator)
        cfg->coordinator = NULL;
    cfg->job = getenv("PSHARD_JOB");
    if (cfg->job && !*cfg->job)
        cfg->job = NULL;
    if (!cfg->server && !cfg->coordinator)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "neither PSHARD_SERVER (this trainer's shard server, HOST:PORT) nor "
                       "PSHARD_COORDINATOR (the coordinator that names it) is set; pshardrun "
                       "sets both");
    return PSHARD_OK;
}

pshard_status_t pshard_connect(const pshard_client_config_t *cfg, pshard_client_t **out, char *err,
                               size_t errlen)
{
    *out = NULL;
    bool have_server = cfg->server && *cfg->server;
    if (!have_server && !(cfg->coordinator && *cfg->coordinator))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "no shard server address and no coordinator to ask for it");
    pshard_client_t *c = calloc(1, sizeof(*c));
    if (!c)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    c->cfg = *cfg;
    c->cfg.server = c->cfg.coordinator = c->cfg.job = NULL; /* the caller's; copied where kept */
    if (c->cfg.timeout_ms <= 0)
        c->cfg.timeout_ms = 600000;
    if (c->cfg.connect_timeout_ms <= 0)
        c->cfg.connect_timeout_ms = 300000;
    if (c->cfg.scratch_bytes == 0)
        c->cfg.scratch_bytes = DEFAULT_SCRATCH;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->server = have_server ? strdup(cfg->server) : NULL;
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
    if (!have_server) {
        rc = client_locate_server(cfg, c->token, &c->server, err, errlen);
        if (rc != PSHARD_OK)
            goto fail;
    }
    ps_rpc_channel_config_t ccfg = {
        .target = c->server, .token = c->token, .max_message_bytes = 64 << 20};
    c->ch = ps_rpc_channel_create(&ccfg, err, errlen);
    if (!c->ch) {
        rc = PSHARD_ERR_INVALID_ARGUMENT;
        goto fail;
    }
    rc = client_region_create(&c->scratch, c->cfg.scratch_bytes, "scratch", c->cfg.remote, true,
                              false, err, errlen);
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
        rc = client_call(c, "Attach", &req.base, &pshard__attach_response__descriptor, &resp, e,
                         sizeof(e));
        if (rc == PSHARD_OK) {
            Pshard__AttachResponse *a = (Pshard__AttachResponse *)resp;
            ps_strlcpy(c->session, a->session, sizeof(c->session));
            client_region_unlink(&c->scratch);
            c->rank = a->rank;
            c->world = a->world_size;
            ps_strlcpy(c->coord_addr, a->coordinator ? a->coordinator : "", sizeof(c->coord_addr));
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
    client_lease_start(c, c->coord_addr);
    if (pthread_create(&c->worker, NULL, client_worker_main, c) != 0) {
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
    client_lease_stop(c);
    ps_rpc_channel_destroy(c->coord);
    ps_rpc_channel_destroy(c->ch);
    client_region_destroy(&c->scratch);
    client_region_destroy(&c->model);
    client_model_free(c);
    free(c->server);
    free(c->token);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
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
        return client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                           "Join is disabled (enable = false): this trainer cannot join");
    if (!c->nparams)
        return client_fail(c, PSHARD_ERR_FAILED_PRECONDITION, "define the model before joining");
    pthread_mutex_lock(&c->mu);
    client_wait_idle(c);
    client_params_reset(c);
    pthread_mutex_unlock(&c->mu);
    Pshard__JoinRequest req = PSHARD__JOIN_REQUEST__INIT;
    req.session = c->session;
    req.throw_on_early_termination = opts->throw_on_early_termination;
    ProtobufCMessage *resp = NULL;
    char err[PSHARD_ERRLEN] = "";
    char path[64] = "/pshard.ShardServer/Join";
    /* The others may train for a long time yet: no deadline of the usual size. Failures
     * reach this call through the collectives (a lost peer, a timeout). */
    pshard_status_t rc = ps_rpc_unary(c->ch, path, &req.base, &pshard__join_response__descriptor,
                                      &resp, 30LL * 24 * 3600 * 1000, 0, NULL, err, sizeof(err));
    if (rc != PSHARD_OK)
        return client_fail(c, rc, "Join: %s", err);
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

/* CollectiveRequest.op (shard.proto): collectives.h's pshard_coll_op_t numbers. */
enum {
    OP_ALL_GATHER = 1,
    OP_ALL_REDUCE = 3,
    OP_BROADCAST = 4,
    OP_BARRIER = 5,
    OP_REDUCE = 6,
    OP_GATHER = 7,
    OP_SCATTER = 8,
    OP_ALL_TO_ALL = 9,
};

/* One Collective: this rank's send_bytes at send_off in the scratch region, its recv_bytes at
 * recv_off after (both moved over the wire on the remote path). */
static pshard_status_t collective(pshard_client_t *c, uint32_t op, pshard_dtype_t dt,
                                  uint32_t reduce, int root, size_t count, size_t send_off,
                                  size_t send_bytes, size_t recv_off, size_t recv_bytes)
{
    char err[PSHARD_ERRLEN] = "";
    if (c->cfg.remote && send_bytes &&
        client_remote_write(c, PSHARD__REGION__SCRATCH, &c->scratch, send_off, send_bytes, 0, err,
                            sizeof(err)) != PSHARD_OK)
        return client_fail(c, PSHARD_ERR_RPC, "collective: %s", err);
    Pshard__CollectiveRequest req = PSHARD__COLLECTIVE_REQUEST__INIT;
    req.session = c->session;
    req.op = op;
    req.dtype = client_dtype_pb(dt);
    req.reduce = reduce;
    req.root = root;
    req.count = count;
    req.send_offset = send_off;
    req.recv_offset = recv_off;
    pshard_status_t rc =
        client_call(c, "Collective", &req.base, &pshard__collective_response__descriptor, NULL, err,
                    sizeof(err));
    if (rc == PSHARD_OK && c->cfg.remote && recv_bytes)
        rc = client_remote_read(c, PSHARD__REGION__SCRATCH, &c->scratch, recv_off, recv_bytes, err,
                                sizeof(err));
    if (rc != PSHARD_OK)
        return client_fail(c, rc, "collective: %s", err);
    return PSHARD_OK;
}

static pshard_status_t fits(pshard_client_t *c, size_t bytes)
{
    if (bytes > c->scratch.bytes)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "%zu bytes exceed the %zu-byte scratch region (PSHARD_SCRATCH_BYTES)",
                           bytes, c->scratch.bytes);
    return PSHARD_OK;
}

pshard_status_t pshard_all_reduce_op(pshard_client_t *c, void *buf, size_t count,
                                     pshard_dtype_t dtype, pshard_reduce_t op)
{
    if ((unsigned)op >= PSHARD_REDUCE_COUNT)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "all_reduce: unknown reduction %d (use sum, avg, product, min, max, "
                           "band, bor or bxor)",
                           (int)op);
    size_t bytes = count * pshard_dtype_size(dtype);
    PS_CHECK(fits(c, bytes));
    memcpy(c->scratch.base, buf, bytes);
    PS_CHECK(collective(c, OP_ALL_REDUCE, dtype, (uint32_t)op, 0, count, 0, bytes, 0, bytes));
    memcpy(buf, c->scratch.base, bytes);
    return PSHARD_OK;
}

pshard_status_t pshard_all_reduce(pshard_client_t *c, void *buf, size_t count, pshard_dtype_t dtype,
                                  bool average)
{
    return pshard_all_reduce_op(c, buf, count, dtype,
                                average ? PSHARD_REDUCE_AVG : PSHARD_REDUCE_SUM);
}

pshard_status_t pshard_broadcast(pshard_client_t *c, void *buf, size_t count, pshard_dtype_t dtype,
                                 int root)
{
    size_t bytes = count * pshard_dtype_size(dtype);
    PS_CHECK(fits(c, bytes));
    if (c->rank == root)
        memcpy(c->scratch.base, buf, bytes);
    PS_CHECK(collective(c, OP_BROADCAST, dtype, 0, root, count, 0, c->rank == root ? bytes : 0, 0,
                        bytes));
    memcpy(buf, c->scratch.base, bytes);
    return PSHARD_OK;
}

pshard_status_t pshard_all_gather(pshard_client_t *c, const void *send, void *recv, size_t count,
                                  pshard_dtype_t dtype)
{
    size_t bytes = count * pshard_dtype_size(dtype);
    size_t recv_off = client_align(bytes);
    PS_CHECK(fits(c, recv_off + bytes * (size_t)c->world));
    memcpy(c->scratch.base, send, bytes);
    PS_CHECK(collective(c, OP_ALL_GATHER, dtype, 0, 0, count, 0, bytes, recv_off,
                        bytes * (size_t)c->world));
    memcpy(recv, (uint8_t *)c->scratch.base + recv_off, bytes * (size_t)c->world);
    return PSHARD_OK;
}

pshard_status_t pshard_barrier(pshard_client_t *c)
{
    return collective(c, OP_BARRIER, PSHARD_FP32, 0, 0, 0, 0, 0, 0, 0);
}

/* count elements of dtype, times mult, in bytes; an error when that overflows or the root is
 * not a rank. */
static pshard_status_t rooted_bytes(pshard_client_t *c, const char *what, size_t count,
                                    pshard_dtype_t dtype, size_t mult, int root, size_t *bytes)
{
    size_t es = pshard_dtype_size(dtype);
    if (es == 0)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "%s: unknown dtype %d", what,
                           (int)dtype);
    if (root < 0 || root >= c->world)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s: root %d is not a rank of this %d-rank job", what, root, c->world);
    if (count > SIZE_MAX / 4 / es / mult)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "%s: %zu elements are too many", what,
                           count);
    *bytes = count * es * mult;
    return PSHARD_OK;
}

pshard_status_t pshard_reduce_to(pshard_client_t *c, void *buf, size_t count, pshard_dtype_t dtype,
                                 pshard_reduce_t op, int root)
{
    size_t bytes = 0;
    PS_CHECK(rooted_bytes(c, "reduce", count, dtype, 1, root, &bytes));
    if ((unsigned)op >= PSHARD_REDUCE_COUNT)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "reduce: unknown reduction %d", (int)op);
    PS_CHECK(fits(c, bytes));
    memcpy(c->scratch.base, buf, bytes);
    bool me = c->rank == root;
    PS_CHECK(
        collective(c, OP_REDUCE, dtype, (uint32_t)op, root, count, 0, bytes, 0, me ? bytes : 0));
    if (me)
        memcpy(buf, c->scratch.base, bytes);
    return PSHARD_OK;
}

pshard_status_t pshard_gather_to(pshard_client_t *c, const void *send, void *recv, size_t count,
                                 pshard_dtype_t dtype, int root)
{
    size_t bytes = 0, all = 0;
    PS_CHECK(rooted_bytes(c, "gather", count, dtype, 1, root, &bytes));
    PS_CHECK(rooted_bytes(c, "gather", count, dtype, (size_t)c->world, root, &all));
    bool me = c->rank == root;
    size_t recv_off = client_align(bytes);
    PS_CHECK(fits(c, recv_off + (me ? all : 0)));
    if (me && all && !recv)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "gather: the root's recv is NULL");
    memcpy(c->scratch.base, send, bytes);
    PS_CHECK(collective(c, OP_GATHER, dtype, 0, root, count, 0, bytes, recv_off, me ? all : 0));
    if (me)
        memcpy(recv, (uint8_t *)c->scratch.base + recv_off, all);
    return PSHARD_OK;
}

pshard_status_t pshard_all_to_all(pshard_client_t *c, const void *send, void *recv, size_t count,
                                  pshard_dtype_t dtype)
{
    size_t all = 0;
    PS_CHECK(rooted_bytes(c, "all_to_all", count, dtype, (size_t)c->world, 0, &all));
    size_t recv_off = client_align(all);
    PS_CHECK(fits(c, recv_off + all));
    memcpy(c->scratch.base, send, all);
    PS_CHECK(collective(c, OP_ALL_TO_ALL, dtype, 0, 0, count, 0, all, recv_off, all));
    memcpy(recv, (uint8_t *)c->scratch.base + recv_off, all);
    return PSHARD_OK;
}

pshard_status_t pshard_scatter_from(pshard_client_t *c, const void *send, void *recv, size_t count,
                                    pshard_dtype_t dtype, int root)
{
    size_t bytes = 0, all = 0;
    PS_CHECK(rooted_bytes(c, "scatter", count, dtype, 1, root, &bytes));
    PS_CHECK(rooted_bytes(c, "scatter", count, dtype, (size_t)c->world, root, &all));
    bool me = c->rank == root;
    size_t recv_off = client_align(me ? all : 0);
    PS_CHECK(fits(c, recv_off + bytes));
    if (me && all && !send)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "scatter: the root's send is NULL");
    if (me)
        memcpy(c->scratch.base, send, all);
    PS_CHECK(collective(c, OP_SCATTER, dtype, 0, root, count, 0, me ? all : 0, recv_off, bytes));
    memcpy(recv, (uint8_t *)c->scratch.base + recv_off, bytes);
    return PSHARD_OK;
}
