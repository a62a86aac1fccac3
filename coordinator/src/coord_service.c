/* The coordinator's gRPC service: its method table and lifecycle (start, stop, and a ticker
 * thread that expires leases, forms the cluster after the last call, times out store waits and
 * ends jobs nobody uses any more), the membership handlers (Register, Heartbeat, Leave), the
 * Watch stream, Status and the metrics view. The store and ReportJoin handlers are in
 * coord_store_service.c; the jobs and their Watch events, which both use, in coord_job.c. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coord_metrics.h"
#include "coord_service.h"
#include "coord_state.h"
#include "coord_store.h"
#include "pshard/coordinator.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

#define TICK_MAX_NS (100 * 1000000LL)

/* ---------------------------------------------------------------------------------------- */
/* Conversions                                                                               */

static void view_to_pb(const coord_member_view_t *v, Pshard__MemberView *out)
{
    pshard__member_view__init(out);
    out->member_id = (char *)v->member_id;
    out->lease_key = (char *)v->lease_key; /* "" except in Register's answer */
    out->generation = v->generation;
    out->rank = v->rank;
    out->world_size = v->world_size;
    out->state = coord_cluster_state_to_pb(v->state);
    out->lease_ms = v->lease_ms;
    out->heartbeat_ms = v->heartbeat_ms;
    out->formed_generation = v->formed_generation;
    out->replaces_lost = v->replaces_lost;
}

/* ---------------------------------------------------------------------------------------- */
/* Watch                                                                                     */

static void watch_cancelled(void *arg, ps_rpc_call_t *call)
{
    pshard_coordinator_t *c = arg;
    pthread_mutex_lock(&c->mu);
    stream_entry_t *e = NULL;
    for (coord_job_t *j = c->jobs; j && !e; j = j->next)
        e = coord_take_entry_locked(&j->watchers, call);
    pthread_mutex_unlock(&c->mu);
    if (e) {
        ps_rpc_call_finish(call);
        free(e);
    }
}

static void handle_watch(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    (void)request;
    stream_entry_t *e = calloc(1, sizeof(*e));
    if (!e) {
        ps_rpc_call_fail(call, PSHARD_ERR_NO_MEMORY, "out of memory");
        return;
    }
    e->call = call;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = PSHARD_ERR_UNAVAILABLE;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j =
        c->stopping ? NULL : coord_job_of_call_locked(c, call, true, &rc, err, sizeof(err));
    if (!j) {
        pthread_mutex_unlock(&c->mu);
        free(e);
        ps_rpc_call_fail(call, rc, "%s", c->stopping ? "the coordinator is shutting down" : err);
        return;
    }
    coord_send_event_locked(j, call, 0, "current state", -1);
    e->next = j->watchers;
    j->watchers = e;
    pthread_mutex_unlock(&c->mu);
    ps_rpc_call_on_cancel(call, watch_cancelled, c);
}

/* ---------------------------------------------------------------------------------------- */
/* Membership                                                                                */

static void reply_view(ps_rpc_call_t *call, pshard_status_t rc, const coord_member_view_t *view,
                       const char *err)
{
    if (rc != PSHARD_OK) {
        ps_rpc_call_fail(call, rc, "%s", err);
        return;
    }
    Pshard__MemberView out;
    view_to_pb(view, &out);
    ps_rpc_call_reply(call, &out.base);
}

static void handle_register(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__RegisterRequest *req = (const Pshard__RegisterRequest *)request;
    coord_role_t role = req->role == PSHARD__ROLE__SHARD_SERVER ? COORD_ROLE_SHARD_SERVER
                        : req->role == PSHARD__ROLE__TRAINER    ? COORD_ROLE_TRAINER
                                                                : COORD_ROLE_UNSPECIFIED;
    char err[PSHARD_ERRLEN] = "";
    coord_member_view_t view;
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = coord_job_of_call_locked(c, call, true, &rc, err, sizeof(err));
    size_t members = 0;
    for (coord_job_t *k = c->jobs; k; k = k->next)
        members += coord_state_member_count(k->state);
    if (j && members >= COORD_MAX_MEMBERS)
        rc = ps_errf(err, sizeof(err), PSHARD_ERR_RESOURCE_EXHAUSTED,
                     "the coordinator already has %zu members in %zu jobs; the limit is %d",
                     members, c->njobs, COORD_MAX_MEMBERS);
    else if (j)
        rc = coord_state_register(j->state, role, req->name, req->address, req->node, req->device,
                                  req->lease_key, ps_now_ns(), &view, err, sizeof(err));
    if (j)
        coord_flush_events_locked(j);
    pthread_mutex_unlock(&c->mu);
    if (rc == PSHARD_OK)
        PS_INFO(PS_SUB_COORD, "job %s: registered %s '%s' from %s as %s", j->name,
                coord_role_name(role), req->name, ps_rpc_call_peer(call), view.member_id);
    reply_view(call, rc, &view, err);
}

/* The job's slowest rank now (c->mu held). */
static void straggler_locked(coord_job_t *j, coord_straggler_t *out)
{
    size_t n;
    const coord_member_t *m = coord_state_members(j->state, &n);
    coord_straggler_find(m, n, j->c->cfg.straggler_ratio, (uint32_t)j->c->cfg.straggler_steps, out);
}

/* After a heartbeat with step figures: logs a rank that stayed slow, once, and its recovery.
 * Looks at most twice a second per job, so heartbeats of a large job do not each walk every
 * member. c->mu held. */
static void straggler_check_locked(coord_job_t *j, int64_t now)
{
    if (now - j->straggler_checked_ns < 500 * 1000000LL)
        return;
    j->straggler_checked_ns = now;
    coord_straggler_t cur;
    straggler_locked(j, &cur);
    char msg[768];
    coord_straggler_event_t ev =
        coord_straggler_watch_update(&j->straggler, &cur, (uint32_t)j->c->cfg.straggler_steps,
                                     j->c->cfg.straggler_ratio, msg, sizeof(msg));
    if (ev == COORD_STRAGGLER_SLOW)
        PS_WARN(PS_SUB_COORD, "job %s: %s", j->name, msg);
    else if (ev == COORD_STRAGGLER_RECOVERED)
        PS_INFO(PS_SUB_COORD, "job %s: %s", j->name, msg);
}

/* A heartbeat's step figures, checked (they are untrusted) into *out; out->set stays false
 * without any, or with a window of 0 steps. */
static pshard_status_t steps_from_pb(const Pshard__StepSummary *pb, coord_steps_t *out, char *err,
                                     size_t errlen)
{
    memset(out, 0, sizeof(*out));
    if (!pb)
        return PSHARD_OK;
    out->window = pb->window;
    out->steps = pb->steps;
    out->step_s = pb->step_seconds;
    out->compute_s = pb->compute_seconds;
    out->wait_s = pb->wait_seconds;
    pshard_status_t rc = coord_steps_check(out, err, errlen);
    out->set = rc == PSHARD_OK && pb->window > 0;
    return rc;
}

static void handle_heartbeat(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__HeartbeatRequest *req = (const Pshard__HeartbeatRequest *)request;
    char err[PSHARD_ERRLEN] = "";
    coord_member_view_t view;
    coord_steps_t steps;
    /* Refused whole, before the lease is renewed: a member that sends nonsense hears so. */
    pshard_status_t rc = steps_from_pb(req->steps, &steps, err, sizeof(err));
    if (rc != PSHARD_OK) {
        ps_rpc_call_fail(call, rc, "%s", err);
        return;
    }
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = coord_job_of_call_locked(c, call, false, &rc, err, sizeof(err));
    if (j) {
        int64_t now = ps_now_ns();
        rc = coord_state_heartbeat(j->state, req->member_id, req->lease_key, now, &view, err,
                                   sizeof(err));
        if (rc == PSHARD_OK) /* none: its trainer took no step yet (in this session) */
            coord_state_set_steps(j->state, req->member_id, &steps);
        if (rc == PSHARD_OK && steps.set)
            straggler_check_locked(j, now);
        const char *why = req->not_serving ? req->not_serving_reason : NULL;
        if (rc == PSHARD_OK && req->not_serving && (!why || !*why))
            why = "(no reason given)";
        if (rc == PSHARD_OK && coord_state_set_health(j->state, req->member_id, why))
            coord_cluster_health_locked(j);
    } else if (rc == PSHARD_ERR_NOT_FOUND)
        rc = coord_unknown_member(req->member_id, err, sizeof(err));
    pthread_mutex_unlock(&c->mu);
    reply_view(call, rc, &view, err);
}

static void handle_leave(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__LeaveRequest *req = (const Pshard__LeaveRequest *)request;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = PSHARD_OK;
    uint64_t gen = 0;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = coord_job_of_call_locked(c, call, false, &rc, err, sizeof(err));
    bool lost = req->lost && req->lost[0], named = req->name && req->name[0];
    if (j && lost != named) {
        rc = ps_errf(err, sizeof(err), PSHARD_ERR_INVALID_ARGUMENT,
                     "name and lost go together (a launcher declaring a trainer lost); a member "
                     "leaving by itself sets member_id and lease_key");
    } else if (j && lost) {
        rc =
            coord_state_declare_lost(j->state, req->name, req->lost, ps_now_ns(), err, sizeof(err));
        if (rc == PSHARD_OK)
            PS_WARN(PS_SUB_COORD, "member %s declared lost: %s", req->name, req->lost);
        gen = coord_state_generation(j->state);
        coord_flush_events_locked(j);
    } else if (j) {
        rc = coord_state_leave(j->state, req->member_id, req->lease_key, ps_now_ns(), err,
                               sizeof(err));
        gen = coord_state_generation(j->state);
        coord_flush_events_locked(j);
    } else if (rc == PSHARD_ERR_NOT_FOUND) {
        rc = lost ? ps_errf(err, sizeof(err), PSHARD_ERR_NOT_FOUND,
                            "no member named \"%.64s\" (its job has no members)", req->name)
                  : coord_unknown_member(req->member_id, err, sizeof(err));
    }
    pthread_mutex_unlock(&c->mu);
    if (rc != PSHARD_OK) {
        ps_rpc_call_fail(call, rc, "%s", err);
        return;
    }
    Pshard__LeaveResponse out = PSHARD__LEAVE_RESPONSE__INIT;
    out.generation = gen;
    ps_rpc_call_reply(call, &out.base);
}

/* ---------------------------------------------------------------------------------------- */
/* Status                                                                                    */

typedef struct {
    Pshard__MethodCounter *items;
    Pshard__MethodCounter **ptrs;
    size_t n, cap;
} counters_t;

static void collect_counter(void *arg, const char *path, uint64_t calls, uint64_t errors)
{
    counters_t *cs = arg;
    if (cs->n == cs->cap)
        return;
    Pshard__MethodCounter *m = &cs->items[cs->n];
    pshard__method_counter__init(m);
    m->method = (char *)path;
    m->calls = calls;
    m->errors = errors;
    cs->ptrs[cs->n++] = m;
}

/* Fills one JobSummary for Status. Under c->mu. */
static void job_summary_locked(const coord_job_t *j, int64_t now, Pshard__JobSummary *out)
{
    pshard__job_summary__init(out);
    out->job = (char *)j->name; /* jobs live until the ticker ends them, under c->mu: see below */
    out->state = coord_cluster_state_to_pb(coord_state_cluster_state(j->state));
    out->generation = coord_state_generation(j->state);
    out->world_size = coord_state_world_size(j->state);
    out->members = (uint32_t)coord_state_member_count(j->state);
    out->store_keys = coord_store_num_keys(j->store);
    out->idle_ms = coord_job_unused(j) ? (now - j->idle_since_ns) / 1000000 : 0;
}

static void handle_status(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    (void)request;
    int64_t now = ps_now_ns();
    char err[PSHARD_ERRLEN] = "", jobname[JOB_NAME_MAX + 1] = DEFAULT_JOB;
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = coord_job_of_call_locked(c, call, false, &rc, err, sizeof(err));
    if (!j && rc != PSHARD_ERR_NOT_FOUND) {
        pthread_mutex_unlock(&c->mu);
        ps_rpc_call_fail(call, rc, "%s", err);
        return;
    }
    /* A job that does not exist (yet, or any more) shows as an empty forming one. */
    coord_snapshot_t *snap = j ? coord_state_snapshot(j->state, now) : calloc(1, sizeof(*snap));
    if (snap && !j) {
        size_t len = 0;
        const char *name = ps_rpc_call_header(call, PS_RPC_JOB_HEADER, &len);
        snprintf(jobname, sizeof(jobname), "%.*s", (int)len, name ? name : "");
        snap->state = COORD_CLUSTER_FORMING;
        snap->min_nodes = c->cfg.min_nodes;
        snap->max_nodes = c->cfg.max_nodes;
        snap->last_call_remaining_ms = -1;
        snap->last_joiner = -1;
        snprintf(snap->awaiting, sizeof(snap->awaiting), "job %s: no member has registered",
                 jobname);
    } else if (j) {
        ps_strlcpy(jobname, j->name, sizeof(jobname));
    }
    size_t keys = j ? coord_store_num_keys(j->store) : 0;
    size_t waiters = j ? coord_store_num_waiters(j->store) : 0;
    size_t njobs = c->njobs;
    Pshard__JobSummary *jitems_all = calloc(njobs + 1, sizeof(*jitems_all));
    Pshard__JobSummary **jptrs_all = calloc(njobs + 1, sizeof(*jptrs_all));
    char(*jnames)[JOB_NAME_MAX + 1] = calloc(njobs + 1, sizeof(*jnames));
    if (jitems_all && jptrs_all && jnames) {
        size_t i = 0;
        for (coord_job_t *k = c->jobs; k && i < njobs; k = k->next, i++) {
            job_summary_locked(k, now, &jitems_all[i]);
            ps_strlcpy(jnames[i], k->name, sizeof(jnames[i])); /* the reply goes out unlocked */
            jitems_all[i].job = jnames[i];
            jptrs_all[i] = &jitems_all[i];
        }
    }
    pthread_mutex_unlock(&c->mu);
    counters_t cs = {0};
    cs.cap = 64;
    cs.items = calloc(cs.cap, sizeof(*cs.items));
    cs.ptrs = calloc(cs.cap, sizeof(*cs.ptrs));
    Pshard__Member *items = snap ? calloc(snap->nmembers + 1, sizeof(*items)) : NULL;
    Pshard__Member **ptrs = snap ? calloc(snap->nmembers + 1, sizeof(*ptrs)) : NULL;
    Pshard__JoinEntry *jitems = snap ? calloc(snap->njoins + 1, sizeof(*jitems)) : NULL;
    Pshard__JoinEntry **jptrs = snap ? calloc(snap->njoins + 1, sizeof(*jptrs)) : NULL;
    Pshard__StepSummary *sitems = snap ? calloc(snap->nmembers + 1, sizeof(*sitems)) : NULL;
    if (!snap || !cs.items || !cs.ptrs || !items || !ptrs || !jitems || !jptrs || !jitems_all ||
        !jptrs_all || !jnames || !sitems) {
        ps_rpc_call_fail(call, PSHARD_ERR_NO_MEMORY, "out of memory building status");
    } else {
        ps_rpc_server_counters(c->srv, collect_counter, &cs);
        coord_members_to_pb(snap, now, items, ptrs);
        coord_joins_to_pb(snap, now, jitems, jptrs);
        for (size_t i = 0; i < snap->nmembers; i++) {
            const coord_steps_t *st = &snap->members[i].steps;
            if (!st->set)
                continue;
            pshard__step_summary__init(&sitems[i]);
            sitems[i].window = st->window;
            sitems[i].steps = st->steps;
            sitems[i].step_seconds = st->step_s;
            sitems[i].compute_seconds = st->compute_s;
            sitems[i].wait_seconds = st->wait_s;
            items[i].steps = &sitems[i];
        }
        coord_straggler_t slow;
        coord_straggler_find(snap->members, snap->nmembers, c->cfg.straggler_ratio,
                             (uint32_t)c->cfg.straggler_steps, &slow);
        Pshard__Straggler straggler = PSHARD__STRAGGLER__INIT;
        straggler.rank = slow.rank;
        straggler.name = slow.name;
        straggler.ratio = slow.ratio;
        straggler.compute_seconds = slow.compute_s;
        straggler.median_compute_seconds = slow.median_s;
        straggler.window = slow.window;
        straggler.ranks = slow.ranks;
        straggler.threshold = c->cfg.straggler_ratio;
        straggler.slow = slow.slow;
        Pshard__StatusResponse out = PSHARD__STATUS_RESPONSE__INIT;
        out.version = PSHARD_VERSION_STRING;
        out.generation = snap->generation;
        out.state = coord_cluster_state_to_pb(snap->state);
        out.world_size = snap->world_size;
        out.min_nodes = snap->min_nodes;
        out.max_nodes = snap->max_nodes;
        out.awaiting = snap->awaiting;
        out.last_call_remaining_ms = snap->last_call_remaining_ms;
        out.n_members = snap->nmembers;
        out.members = ptrs;
        out.n_counters = cs.n;
        out.counters = cs.ptrs;
        out.uptime_ms = (now - c->started_ns) / 1000000;
        out.store_keys = keys;
        out.store_waiters = waiters;
        out.lease_ms = c->cfg.lease_ms;
        out.heartbeat_ms = c->cfg.heartbeat_ms;
        out.formed_generation = snap->formed_generation;
        out.n_joins = snap->njoins;
        out.joins = jptrs;
        out.last_joiner = snap->last_joiner;
        out.job = jobname;
        out.n_jobs = njobs;
        out.jobs = jptrs_all;
        out.job_linger_ms = c->cfg.job_linger_ms;
        out.straggler = &straggler;
        ps_rpc_call_reply(call, &out.base);
    }
    free(jitems_all);
    free(jptrs_all);
    free(jnames);
    free(items);
    free(ptrs);
    free(jitems);
    free(jptrs);
    free(sitems);
    free(cs.items);
    free(cs.ptrs);
    coord_snapshot_free(snap);
}

/* ---------------------------------------------------------------------------------------- */
/* Lifecycle                                                                                 */

static void *ticker_main(void *arg)
{
    pshard_coordinator_t *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->stopping) {
        int64_t now = ps_now_ns();
        int64_t next = INT64_MAX;
        for (coord_job_t *j = c->jobs, *after; j; j = after) {
            after = j->next;
            coord_state_tick(j->state, now);
            coord_store_tick(j->store, now);
            coord_flush_events_locked(j);
            if (!coord_job_unused(j)) {
                j->idle_since_ns = now;
            } else if (j != c->jobs && now - j->idle_since_ns >= c->cfg.job_linger_ms * 1000000) {
                coord_job_end_locked(c, j, "unused");
                continue;
            }
            int64_t t = coord_state_next_deadline_ns(j->state);
            int64_t ts = coord_store_next_deadline_ns(j->store);
            if (ts < t)
                t = ts;
            if (t < next)
                next = t;
        }
        if (next > now + TICK_MAX_NS)
            next = now + TICK_MAX_NS;
        if (next <= now)
            continue;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t wake = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec + (next - now);
        ts.tv_sec = wake / 1000000000;
        ts.tv_nsec = wake % 1000000000;
        pthread_cond_timedwait(&c->tick_cv, &c->mu, &ts);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Runs when the gRPC server starts shutting down: end every stream and wait we hold. */
static void on_server_shutdown(void *arg)
{
    pshard_coordinator_t *c = arg;
    pthread_mutex_lock(&c->mu);
    c->stopping = true;
    pthread_cond_broadcast(&c->tick_cv);
    stream_entry_t *watchers = NULL;
    for (coord_job_t *j = c->jobs; j; j = j->next) {
        while (j->watchers) {
            stream_entry_t *w = j->watchers;
            j->watchers = w->next;
            w->next = watchers;
            watchers = w;
        }
        while (j->waits)
            coord_store_cancel_wait(j->store, j->waits->wait_id);
    }
    pthread_mutex_unlock(&c->mu);
    while (watchers) {
        stream_entry_t *next = watchers->next;
        ps_rpc_call_finish(watchers->call);
        free(watchers);
        watchers = next;
    }
}

static const char *method_path(const char *name, char *buf, size_t len)
{
    snprintf(buf, len, "/pshard.Coordinator/%s", name);
    return buf;
}

int pshard_coordinator_port(const pshard_coordinator_t *c)
{
    return ps_rpc_server_port(c->srv);
}

pshard_coordinator_t *pshard_coordinator_start(const pshard_coordinator_config_t *cfg, char *err,
                                               size_t errlen)
{
    pshard_coordinator_t *c = calloc(1, sizeof(*c));
    if (!c) {
        ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        return NULL;
    }
    c->cfg = *cfg;
    if (c->cfg.store_wait_default_ms <= 0)
        c->cfg.store_wait_default_ms = 300000;
    c->started_ns = ps_now_ns();
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->tick_cv, &ca);
    pthread_condattr_destroy(&ca);

    if (c->cfg.job_linger_ms <= 0)
        c->cfg.job_linger_ms = 300000;
    if (!(c->cfg.straggler_ratio > 1) || !isfinite(c->cfg.straggler_ratio))
        c->cfg.straggler_ratio = 1.5;
    if (c->cfg.straggler_steps <= 0)
        c->cfg.straggler_steps = 10;
    c->jobs = coord_job_create_locked(c, DEFAULT_JOB, strlen(DEFAULT_JOB));
    c->njobs = c->jobs ? 1 : 0;
    if (!c->jobs) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "invalid coordinator settings (lease %lld ms, heartbeat %lld ms, nodes %d:%d, "
                "last call %lld ms)",
                (long long)cfg->lease_ms, (long long)cfg->heartbeat_ms, cfg->min_nodes,
                cfg->max_nodes, (long long)cfg->last_call_ms);
        pshard_coordinator_stop(c);
        return NULL;
    }

    ps_rpc_server_config_t rcfg = {
        .listen = cfg->listen,
        .tls_cert_file = cfg->tls_cert_file,
        .tls_key_file = cfg->tls_key_file,
        .tls_client_ca_file = cfg->tls_client_ca_file,
        .token = cfg->token,
        .max_message_bytes = cfg->max_message_bytes,
        .worker_threads = cfg->worker_threads,
        .cq_threads = 1,
    };
    c->srv = ps_rpc_server_create(&rcfg, err, errlen);
    if (!c->srv) {
        pshard_coordinator_stop(c);
        return NULL;
    }
    static const struct {
        const char *name;
        const ProtobufCMessageDescriptor *desc;
        ps_rpc_handler_fn fn;
        unsigned flags;
    } table[] = {
        {"Register", &pshard__register_request__descriptor, handle_register, PS_RPC_INLINE},
        {"Heartbeat", &pshard__heartbeat_request__descriptor, handle_heartbeat, PS_RPC_INLINE},
        {"Leave", &pshard__leave_request__descriptor, handle_leave, PS_RPC_INLINE},
        {"Watch", &pshard__watch_request__descriptor, handle_watch, PS_RPC_STREAM | PS_RPC_INLINE},
        {"StoreSet", &pshard__store_set_request__descriptor, coord_handle_store_set, PS_RPC_INLINE},
        {"StoreGet", &pshard__store_get_request__descriptor, coord_handle_store_get, PS_RPC_INLINE},
        {"StoreWait", &pshard__store_wait_request__descriptor, coord_handle_store_wait,
         PS_RPC_INLINE},
        {"StoreCompareSet", &pshard__store_compare_set_request__descriptor, coord_handle_store_cas,
         PS_RPC_INLINE},
        {"StoreAdd", &pshard__store_add_request__descriptor, coord_handle_store_add, PS_RPC_INLINE},
        {"StoreDelete", &pshard__store_delete_request__descriptor, coord_handle_store_delete,
         PS_RPC_INLINE},
        {"ReportJoin", &pshard__join_report__descriptor, coord_handle_report_join, PS_RPC_INLINE},
        /* Status builds a large message: keep it off the completion-queue thread. */
        {"Status", &pshard__status_request__descriptor, handle_status, 0},
    };
    _Static_assert(PS_ARRAY_LEN(table) == PS_ARRAY_LEN(((pshard_coordinator_t *)0)->methods),
                   "method table size");
    for (size_t i = 0; i < PS_ARRAY_LEN(table); i++) {
        c->methods[i] =
            (ps_rpc_method_t){method_path(table[i].name, c->paths[i], sizeof(c->paths[i])),
                              table[i].desc, table[i].fn, table[i].flags, c};
    }
    ps_rpc_server_add_methods(c->srv, c->methods, PS_ARRAY_LEN(table));
    ps_rpc_server_set_shutdown_hook(c->srv, on_server_shutdown, c);
    if (ps_rpc_server_start(c->srv) < 0) {
        ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot start the gRPC server");
        pshard_coordinator_stop(c);
        return NULL;
    }
    ps_rpc_server_set_health(c->srv, "pshard.Coordinator", 1);
    ps_rpc_server_set_health(c->srv, "pshard.Cluster", 2);
    pthread_mutex_lock(&c->mu);
    coord_flush_events_locked(c->jobs);
    pthread_mutex_unlock(&c->mu);
    if (pthread_create(&c->ticker, NULL, ticker_main, c) == 0)
        c->ticker_started = true;
    return c;
}

void pshard_coordinator_stop(pshard_coordinator_t *c)
{
    if (!c)
        return;
    /* The server's shutdown hook (on_server_shutdown) ends our streams and waits. */
    ps_rpc_server_destroy(c->srv);
    pthread_mutex_lock(&c->mu);
    c->stopping = true;
    pthread_cond_broadcast(&c->tick_cv);
    pthread_mutex_unlock(&c->mu);
    if (c->ticker_started)
        pthread_join(c->ticker, NULL);
    while (c->jobs) {
        coord_job_t *j = c->jobs;
        c->jobs = j->next;
        coord_job_destroy(j);
    }
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->tick_cv);
    free(c);
}

/* ---------------------------------------------------------------------------------------- */
/* Metrics (coord_metrics.h)                                                                 */

void coord_service_metrics_view(pshard_coordinator_t *c,
                                void (*fn)(void *arg, const coord_metrics_view_t *view), void *arg)
{
    coord_metrics_view_t v = {0};
    v.now_ns = ps_now_ns();
    v.started_ns = c->started_ns;
    v.lease_ms = c->cfg.lease_ms;
    v.straggler_ratio = c->cfg.straggler_ratio;
    v.straggler_steps = (uint32_t)c->cfg.straggler_steps;
    v.srv = c->srv;
    pthread_mutex_lock(&c->mu);
    coord_metrics_job_t *jobs = calloc(c->njobs ? c->njobs : 1, sizeof(*jobs));
    size_t n = 0;
    for (coord_job_t *j = c->jobs; j && jobs && n < c->njobs; j = j->next, n++) {
        ps_strlcpy(jobs[n].job, j->name, sizeof(jobs[n].job));
        jobs[n].snap = coord_state_snapshot(j->state, v.now_ns);
        jobs[n].store_keys = coord_store_num_keys(j->store);
        jobs[n].store_waiters = coord_store_num_waiters(j->store);
    }
    pthread_mutex_unlock(&c->mu);
    v.jobs = jobs;
    v.njobs = jobs ? n : 0;
    fn(arg, &v);
    for (size_t i = 0; i < v.njobs; i++)
        coord_snapshot_free((coord_snapshot_t *)jobs[i].snap);
    free(jobs);
}
