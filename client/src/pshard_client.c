/* libpshard: the trainer side. It owns two shared-memory regions that its shard server maps: a
 * scratch region for plain collectives and a model region holding every parameter's full
 * buffer (param_dtype) and gradient buffer (reduce_dtype). Requests go over gRPC; asynchronous
 * ones run in issue order on the client's worker thread. This file connects and closes a
 * client, and runs Join and checks and issues the plain collectives (pshard_collective, on the
 * world or a process group; their request is client_coll.c's); the model, the buffers, the work
 * queue, the regions, the RPC wrappers, the lease and the process groups each have a client_*.c
 * of their own. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/shm_names.h"
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

const char *pshard_coordinator(const pshard_client_t *c)
{
    return c->coord_addr;
}

const char *pshard_job(const pshard_client_t *c)
{
    return c->job;
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
    if (cfg->coll_timeout_ms < 0 || cfg->coll_timeout_ms > 86400000)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "coll_timeout_ms %lld is not in 0..86400000 ms (0: the servers')",
                       (long long)cfg->coll_timeout_ms);
    pshard_client_t *c = calloc(1, sizeof(*c));
    if (!c)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    c->cfg = *cfg;
    c->serial = client_next_serial();
    c->cfg.server = c->cfg.coordinator = c->cfg.job = NULL; /* the caller's; copied where kept */
    if (c->cfg.timeout_ms <= 0)
        c->cfg.timeout_ms = 600000;
    if (c->cfg.coll_timeout_ms > 0 && c->cfg.timeout_ms < 2 * c->cfg.coll_timeout_ms + 10000)
        c->cfg.timeout_ms = 2 * c->cfg.coll_timeout_ms + 10000;
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
    ps_shm_sweep(PS_SHM_TRAINER, "trainer"); /* what killed trainers left in /dev/shm */
    rc = client_region_create(&c->scratch, c->cfg.scratch_bytes, "scratch", c->cfg.remote, true,
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
        req.coll_timeout_ms = c->cfg.coll_timeout_ms;
        ProtobufCMessage *resp = NULL;
        char e[1024] = "";
        /* Named from the first attempt until one succeeds (a file cannot be named again once
         * its name is gone), for the server to open it. */
        rc = client_region_link(&c->scratch, e, sizeof(e));
        if (rc == PSHARD_OK)
            rc = client_call(c, "Attach", &req.base, &pshard__attach_response__descriptor, &resp, e,
                             sizeof(e));
        if (rc == PSHARD_OK) {
            client_region_unlink(&c->scratch);
            Pshard__AttachResponse *a = (Pshard__AttachResponse *)resp;
            ps_strlcpy(c->session, a->session, sizeof(c->session));
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

void pshard_leave(pshard_client_t *c)
{
    if (!c)
        return;
    if (c->worker_started) { /* it runs what is queued first: every work ends done */
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->worker, NULL);
        c->worker_started = false;
    }
    client_lease_stop(c); /* the coordinator hears the trainer leave */
    ps_rpc_channel_destroy(c->coord);
    ps_rpc_channel_destroy(c->ch);
    c->coord = c->ch = NULL;
    client_region_unlink(&c->scratch);
    client_region_unlink(&c->model);
}

void pshard_close(pshard_client_t *c)
{
    if (!c)
        return;
    pshard_leave(c);
    client_region_destroy(&c->scratch);
    client_region_destroy(&c->model);
    client_model_free(c);
    client_stage_free_spares(c);
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
        result->others_raised = r->others_raised;
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    return PSHARD_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Plain collectives                                                                         */

/* a's layout for a rank that is group rank me of n ranks; fails (set on c) for arguments the
 * collective cannot run with. */
static pshard_status_t coll_layout(pshard_client_t *c, const pshard_collective_args_t *a,
                                   const char *what, int n, int me, coll_layout_t *l)
{
    bool p2p = a->op == PSHARD_OP_SEND || a->op == PSHARD_OP_RECV;
    bool rooted = a->op == PSHARD_OP_BROADCAST || a->op == PSHARD_OP_REDUCE ||
                  a->op == PSHARD_OP_GATHER || a->op == PSHARD_OP_SCATTER || p2p;
    bool reduces = a->op == PSHARD_OP_ALL_REDUCE || a->op == PSHARD_OP_REDUCE ||
                   a->op == PSHARD_OP_REDUCE_SCATTER;
    memset(l, 0, sizeof(*l));
    if (a->op == PSHARD_OP_BARRIER)
        return PSHARD_OK;
    size_t es = pshard_dtype_size(a->dtype);
    if (es == 0)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "%s: unknown dtype %d", what,
                           (int)a->dtype);
    if (rooted && (a->root < 0 || a->root >= n)) {
        if (a->group)
            return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                               "%s: root %d is not a rank of the %d-rank group (a group rank)",
                               what, a->root, n);
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s: root %d is not a rank of this %d-rank job", what, a->root, n);
    }
    if (p2p && a->root == me)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "%s: rank %d is this trainer's own",
                           what, a->root);
    if (reduces && (unsigned)a->reduce >= PSHARD_REDUCE_COUNT)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s: unknown reduction %d (use sum, avg, product, min, max, band, bor "
                           "or bxor)",
                           what, (int)a->reduce);
    if (a->count > SIZE_MAX / 4 / es / (size_t)n)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "%s: %zu elements are too many", what,
                           a->count);
    size_t bytes = a->count * es, all = bytes * (size_t)n;
    bool root = rooted && me == a->root;
    l->src = a->send;
    l->dst = a->recv;
    switch (a->op) {
    case PSHARD_OP_ALL_REDUCE: /* in place at offset 0 */
        l->send_bytes = l->recv_bytes = bytes;
        break;
    case PSHARD_OP_BROADCAST:
        l->send_bytes = root ? bytes : 0;
        l->recv_bytes = bytes;
        if (!l->src)
            l->src = a->recv; /* the root's send may be its recv */
        break;
    case PSHARD_OP_REDUCE:
        l->send_bytes = bytes;
        l->recv_bytes = root ? bytes : 0;
        break;
    case PSHARD_OP_ALL_GATHER:
        l->send_bytes = bytes;
        l->recv_off = client_align(bytes);
        l->recv_bytes = all;
        break;
    case PSHARD_OP_GATHER:
        l->send_bytes = bytes;
        l->recv_off = client_align(bytes);
        l->recv_bytes = root ? all : 0;
        break;
    case PSHARD_OP_SCATTER:
        l->send_bytes = root ? all : 0;
        l->recv_off = client_align(l->send_bytes);
        l->recv_bytes = bytes;
        break;
    case PSHARD_OP_ALL_TO_ALL:
        l->send_bytes = all;
        l->recv_off = client_align(all);
        l->recv_bytes = all;
        break;
    case PSHARD_OP_REDUCE_SCATTER:
        l->send_bytes = all;
        l->recv_off = client_align(all);
        l->recv_bytes = bytes;
        break;
    case PSHARD_OP_SEND:
        l->send_bytes = bytes;
        root = false;
        break;
    case PSHARD_OP_RECV:
        l->recv_bytes = bytes;
        root = false;
        break;
    case PSHARD_OP_BARRIER:
        break;
    }
    if (l->send_bytes && !l->src)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "%s: %s send buffer is NULL", what,
                           root ? "the root's" : "the");
    if (l->recv_bytes && !l->dst)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "%s: %s recv buffer is NULL", what,
                           root ? "the root's" : "the");
    size_t need =
        l->recv_off + l->recv_bytes > l->send_bytes ? l->recv_off + l->recv_bytes : l->send_bytes;
    if (need > c->scratch.bytes)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s: %zu bytes exceed the %zu-byte scratch region "
                           "(PSHARD_SCRATCH_BYTES)",
                           what, need, c->scratch.bytes);
    return PSHARD_OK;
}

/* Checks a collective's arguments and lays it out (failures set on c). */
static pshard_status_t collective_check(pshard_client_t *c, const pshard_collective_args_t *a,
                                        coll_layout_t *l)
{
    if (!a)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "collective: no arguments");
    const char *what = client_op_name(a->op);
    if (!what)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "collective: unknown op %d (pshard_op_t)", (int)a->op);
    const pshard_group_t *g = a->group;
    if (g)
        PS_CHECK(client_group_check(c, g, what));
    return coll_layout(c, a, what, g ? g->size : c->world, g ? g->rank : c->rank, l);
}

pshard_status_t pshard_collective(pshard_client_t *c, const pshard_collective_args_t *a)
{
    coll_layout_t l;
    PS_CHECK(collective_check(c, a, &l));
    char err[PSHARD_ERRLEN] = "";
    client_run_alone_begin(c);
    /* a place in the scratch region, among the staged collectives' results not yet taken */
    pshard_work_t here = {.c = c, .kind = WORK_COLLECTIVE, .layout = l, .running = true};
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc = client_stage_place(c, &here, true);
    pthread_mutex_unlock(&c->mu);
    if (rc == PSHARD_OK)
        rc = client_collective_exec(c, a, &l, here.st_off, true, err, sizeof(err));
    else
        ps_strlcpy(err, c->last_error, sizeof(err));
    pthread_mutex_lock(&c->mu);
    client_stage_drop(c, &here);
    pthread_mutex_unlock(&c->mu);
    client_run_alone_end(c);
    if (rc != PSHARD_OK)
        return client_fail(c, rc, "%s", err);
    return PSHARD_OK;
}

pshard_status_t pshard_collective_start(pshard_client_t *c, const pshard_collective_args_t *a,
                                        pshard_work_t **work)
{
    if (!work)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "collective: work is NULL");
    *work = NULL;
    coll_layout_t l;
    PS_CHECK(collective_check(c, a, &l));
    return client_work_queue_collective(c, a, &l, false, work);
}

pshard_status_t pshard_collective_start_staged(pshard_client_t *c,
                                               const pshard_collective_args_t *a,
                                               pshard_work_t **work)
{
    if (!work)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "collective: work is NULL");
    *work = NULL;
    coll_layout_t l;
    PS_CHECK(collective_check(c, a, &l));
    return client_work_queue_collective(c, a, &l, true, work);
}

/* The world's collectives of the API before process groups: pshard_collective with group
 * NULL (in place where they take one buffer). */

pshard_status_t pshard_all_reduce_op(pshard_client_t *c, void *buf, size_t count,
                                     pshard_dtype_t dtype, pshard_reduce_t op)
{
    pshard_collective_args_t a = {.op = PSHARD_OP_ALL_REDUCE,
                                  .send = buf,
                                  .recv = buf,
                                  .count = count,
                                  .dtype = dtype,
                                  .reduce = op};
    return pshard_collective(c, &a);
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
    pshard_collective_args_t a = {.op = PSHARD_OP_BROADCAST,
                                  .send = buf,
                                  .recv = buf,
                                  .count = count,
                                  .dtype = dtype,
                                  .root = root};
    return pshard_collective(c, &a);
}

pshard_status_t pshard_all_gather(pshard_client_t *c, const void *send, void *recv, size_t count,
                                  pshard_dtype_t dtype)
{
    pshard_collective_args_t a = {
        .op = PSHARD_OP_ALL_GATHER, .send = send, .recv = recv, .count = count, .dtype = dtype};
    return pshard_collective(c, &a);
}

pshard_status_t pshard_barrier(pshard_client_t *c)
{
    pshard_collective_args_t a = {.op = PSHARD_OP_BARRIER};
    return pshard_collective(c, &a);
}

pshard_status_t pshard_reduce_to(pshard_client_t *c, void *buf, size_t count, pshard_dtype_t dtype,
                                 pshard_reduce_t op, int root)
{
    pshard_collective_args_t a = {.op = PSHARD_OP_REDUCE,
                                  .send = buf,
                                  .recv = buf,
                                  .count = count,
                                  .dtype = dtype,
                                  .reduce = op,
                                  .root = root};
    return pshard_collective(c, &a);
}

pshard_status_t pshard_gather_to(pshard_client_t *c, const void *send, void *recv, size_t count,
                                 pshard_dtype_t dtype, int root)
{
    pshard_collective_args_t a = {.op = PSHARD_OP_GATHER,
                                  .send = send,
                                  .recv = recv,
                                  .count = count,
                                  .dtype = dtype,
                                  .root = root};
    return pshard_collective(c, &a);
}

pshard_status_t pshard_all_to_all(pshard_client_t *c, const void *send, void *recv, size_t count,
                                  pshard_dtype_t dtype)
{
    pshard_collective_args_t a = {
        .op = PSHARD_OP_ALL_TO_ALL, .send = send, .recv = recv, .count = count, .dtype = dtype};
    return pshard_collective(c, &a);
}

pshard_status_t pshard_scatter_from(pshard_client_t *c, const void *send, void *recv, size_t count,
                                    pshard_dtype_t dtype, int root)
{
    pshard_collective_args_t a = {.op = PSHARD_OP_SCATTER,
                                  .send = send,
                                  .recv = recv,
                                  .count = count,
                                  .dtype = dtype,
                                  .root = root};
    return pshard_collective(c, &a);
}
