/* The coordinator's gRPC service: handlers that translate between protobuf messages and the
 * membership state, the Join table and the store, a Watch stream of cluster changes, deferred
 * StoreWait replies, and a ticker thread that expires leases, forms the cluster after the last
 * call and times out store waits. One mutex guards the state, the store and the lists of open
 * streams. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coord_state.h"
#include "coord_store.h"
#include "pshard/coordinator.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

#define MAX_PENDING_EVENTS 64
#define WAIT_MAX_MS (24LL * 3600 * 1000)
#define TICK_MAX_NS (100 * 1000000LL)

typedef struct stream_entry {
    struct stream_entry *next;
    ps_rpc_call_t *call;
    uint64_t wait_id; /* store waits only */
} stream_entry_t;

typedef struct {
    uint64_t generation;
    char reason[160];
    int last_joiner; /* ClusterEvent.last_joiner: set for "all joined", else -1 */
} pending_event_t;

struct pshard_coordinator {
    pshard_coordinator_config_t cfg;
    ps_rpc_server_t *srv;
    int64_t started_ns;

    pthread_mutex_t mu;
    pthread_cond_t tick_cv;
    coord_state_t *state;
    coord_store_t *store;
    stream_entry_t *watchers;
    stream_entry_t *waits;
    pending_event_t events[MAX_PENDING_EVENTS];
    size_t nevents;
    bool stopping;
    bool ticker_started;
    pthread_t ticker;
    ps_rpc_method_t methods[11]; /* borrowed by the server for its whole life */
    char paths[11][64];
};

/* ---------------------------------------------------------------------------------------- */
/* Conversions                                                                               */

static Pshard__ClusterState state_to_pb(coord_cluster_state_t s)
{
    switch (s) {
    case COORD_CLUSTER_FORMING:
        return PSHARD__CLUSTER_STATE__FORMING;
    case COORD_CLUSTER_FORMED:
        return PSHARD__CLUSTER_STATE__FORMED;
    case COORD_CLUSTER_DEGRADED:
        return PSHARD__CLUSTER_STATE__DEGRADED;
    }
    return PSHARD__CLUSTER_STATE__CLUSTER_STATE_UNSPECIFIED;
}

static void view_to_pb(const coord_member_view_t *v, Pshard__MemberView *out)
{
    pshard__member_view__init(out);
    out->member_id = (char *)v->member_id;
    out->lease_key = (char *)v->lease_key; /* "" except in Register's answer */
    out->generation = v->generation;
    out->rank = v->rank;
    out->world_size = v->world_size;
    out->state = state_to_pb(v->state);
    out->lease_ms = v->lease_ms;
    out->heartbeat_ms = v->heartbeat_ms;
    out->formed_generation = v->formed_generation;
}

/* Fills members[] (caller-allocated, snap->nmembers entries) pointing into snap. */
static void members_to_pb(const coord_snapshot_t *snap, int64_t now_ns, Pshard__Member *items,
                          Pshard__Member **ptrs)
{
    for (size_t i = 0; i < snap->nmembers; i++) {
        const coord_member_t *m = &snap->members[i];
        Pshard__Member *pm = &items[i];
        pshard__member__init(pm);
        pm->member_id = (char *)m->member_id;
        pm->role = m->role == COORD_ROLE_SHARD_SERVER ? PSHARD__ROLE__SHARD_SERVER
                                                      : PSHARD__ROLE__TRAINER;
        pm->name = (char *)m->name;
        pm->rank = m->rank;
        pm->address = (char *)m->address;
        pm->node = (char *)m->node;
        pm->device = (char *)m->device;
        int64_t left = (m->lease_deadline_ns - now_ns) / 1000000;
        pm->lease_remaining_ms = left > 0 ? left : 0;
        pm->last_heartbeat_ms_ago = (now_ns - m->last_heartbeat_ns) / 1000000;
        pm->registered_generation = m->registered_generation;
        ptrs[i] = pm;
    }
}

/* Fills joins[] (caller-allocated, snap->njoins entries) pointing into snap. */
static void joins_to_pb(const coord_snapshot_t *snap, int64_t now_ns, Pshard__JoinEntry *items,
                        Pshard__JoinEntry **ptrs)
{
    for (size_t i = 0; i < snap->njoins; i++) {
        const coord_join_t *j = &snap->joins[i];
        Pshard__JoinEntry *pj = &items[i];
        pshard__join_entry__init(pj);
        pj->rank = j->rank;
        pj->member_id = (char *)j->member_id;
        pj->step = j->step;
        int64_t ago = (now_ns - j->joined_ns) / 1000000;
        pj->joined_ms_ago = ago > 0 ? ago : 0;
        pj->throw_on_early_termination = j->throw_on_early_termination;
        ptrs[i] = pj;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Watch                                                                                     */

/* Queues one Watch event (sent by flush_events_locked). Under c->mu. */
static void queue_event_locked(pshard_coordinator_t *c, uint64_t generation, const char *reason,
                               int last_joiner)
{
    if (c->nevents == MAX_PENDING_EVENTS) {
        /* Coalesce: the newest event carries the full membership anyway. */
        memmove(&c->events[0], &c->events[1], sizeof(c->events[0]) * (MAX_PENDING_EVENTS - 1));
        c->nevents--;
    }
    pending_event_t *e = &c->events[c->nevents++];
    e->generation = generation;
    ps_strlcpy(e->reason, reason ? reason : "", sizeof(e->reason));
    e->last_joiner = last_joiner;
}

/* The state's change callback: runs inside the state call that bumped the generation, so
 * under c->mu. */
static void on_state_change(void *arg, uint64_t generation, const char *reason)
{
    pshard_coordinator_t *c = arg;
    PS_INFO(PS_SUB_COORD, "generation %llu: %s", (unsigned long long)generation, reason);
    queue_event_locked(c, generation, reason, -1);
}

/* Sends one ClusterEvent with the current membership and join table to `only` (or every
 * watcher if NULL). last_joiner goes out as is (-1 unless the event is "all joined"). */
static void send_event_locked(pshard_coordinator_t *c, ps_rpc_call_t *only, uint64_t generation,
                              const char *reason, int last_joiner)
{
    int64_t now = ps_now_ns();
    coord_snapshot_t *snap = coord_state_snapshot(c->state, now);
    if (!snap)
        return;
    Pshard__Member *items = calloc(snap->nmembers + 1, sizeof(*items));
    Pshard__Member **ptrs = calloc(snap->nmembers + 1, sizeof(*ptrs));
    Pshard__JoinEntry *jitems = calloc(snap->njoins + 1, sizeof(*jitems));
    Pshard__JoinEntry **jptrs = calloc(snap->njoins + 1, sizeof(*jptrs));
    if (items && ptrs && jitems && jptrs) {
        members_to_pb(snap, now, items, ptrs);
        joins_to_pb(snap, now, jitems, jptrs);
        Pshard__ClusterEvent ev = PSHARD__CLUSTER_EVENT__INIT;
        ev.generation = generation ? generation : snap->generation;
        ev.state = state_to_pb(snap->state);
        ev.reason = (char *)reason;
        ev.world_size = snap->world_size;
        ev.n_members = snap->nmembers;
        ev.members = ptrs;
        ev.n_joins = snap->njoins;
        ev.joins = jptrs;
        ev.last_joiner = last_joiner;
        if (only) {
            ps_rpc_call_send(only, &ev.base);
        } else {
            /* Packed once for every watcher. One that has not read what is queued for it
             * already is dropped, told to watch again (its first event is the whole current
             * state), instead of growing the coordinator without bound. */
            ps_rpc_packed_t *packed = ps_rpc_pack(&ev.base);
            for (stream_entry_t **pp = &c->watchers; packed && *pp;) {
                stream_entry_t *w = *pp;
                if (ps_rpc_call_send_packed(w->call, packed) == PSHARD_ERR_RESOURCE_EXHAUSTED) {
                    *pp = w->next;
                    PS_WARN(PS_SUB_COORD, "dropping a Watch from %s: it does not read its "
                            "events", ps_rpc_call_peer(w->call));
                    ps_rpc_call_fail(w->call, PSHARD_ERR_RESOURCE_EXHAUSTED,
                                     "this Watch fell too far behind (it does not read its "
                                     "events); watch again for the current state");
                    free(w);
                    continue;
                }
                pp = &w->next;
            }
            ps_rpc_packed_free(packed);
        }
    }
    free(items);
    free(ptrs);
    free(jitems);
    free(jptrs);
    coord_snapshot_free(snap);
}

/* Pushes the changes recorded by on_state_change and updates the readiness health status. */
static void flush_events_locked(pshard_coordinator_t *c)
{
    if (c->nevents == 0)
        return;
    for (size_t i = 0; i < c->nevents; i++) {
        if (c->watchers)
            send_event_locked(c, NULL, c->events[i].generation, c->events[i].reason,
                              c->events[i].last_joiner);
    }
    c->nevents = 0;
    bool formed = coord_state_cluster_state(c->state) == COORD_CLUSTER_FORMED;
    ps_rpc_server_set_health(c->srv, "pshard.Cluster", formed ? 1 : 2);
}

static stream_entry_t *take_entry_locked(stream_entry_t **list, ps_rpc_call_t *call)
{
    for (stream_entry_t **pp = list; *pp; pp = &(*pp)->next) {
        if ((*pp)->call == call) {
            stream_entry_t *e = *pp;
            *pp = e->next;
            return e;
        }
    }
    return NULL;
}

static void watch_cancelled(void *arg, ps_rpc_call_t *call)
{
    pshard_coordinator_t *c = arg;
    pthread_mutex_lock(&c->mu);
    stream_entry_t *e = take_entry_locked(&c->watchers, call);
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
    pthread_mutex_lock(&c->mu);
    if (c->stopping) {
        pthread_mutex_unlock(&c->mu);
        free(e);
        ps_rpc_call_fail(call, PSHARD_ERR_UNAVAILABLE, "the coordinator is shutting down");
        return;
    }
    send_event_locked(c, call, 0, "current state", -1);
    e->next = c->watchers;
    c->watchers = e;
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
                        : req->role == PSHARD__ROLE__TRAINER  ? COORD_ROLE_TRAINER
                                                              : COORD_ROLE_UNSPECIFIED;
    char err[512] = "";
    coord_member_view_t view;
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc = coord_state_register(c->state, role, req->name, req->address, req->node,
                                              req->device, req->lease_key, ps_now_ns(), &view, err,
                                              sizeof(err));
    flush_events_locked(c);
    pthread_mutex_unlock(&c->mu);
    if (rc == PSHARD_OK)
        PS_INFO(PS_SUB_COORD, "registered %s '%s' from %s as %s", coord_role_name(role),
                req->name, ps_rpc_call_peer(call), view.member_id);
    reply_view(call, rc, &view, err);
}

static void handle_heartbeat(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__HeartbeatRequest *req = (const Pshard__HeartbeatRequest *)request;
    char err[512] = "";
    coord_member_view_t view;
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc =
        coord_state_heartbeat(c->state, req->member_id, req->lease_key, ps_now_ns(), &view, err,
                              sizeof(err));
    pthread_mutex_unlock(&c->mu);
    reply_view(call, rc, &view, err);
}

static void handle_leave(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__LeaveRequest *req = (const Pshard__LeaveRequest *)request;
    char err[512] = "";
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc = coord_state_leave(c->state, req->member_id, req->lease_key, ps_now_ns(),
                                           err, sizeof(err));
    uint64_t gen = coord_state_generation(c->state);
    flush_events_locked(c);
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
/* Join                                                                                      */

/* ReportJoin: a shard server reports its trainer's join (JOINED) or the end of a join
 * (ALL_JOINED). The generation stays; a change is pushed on Watch with reason "join" or
 * "all joined". Errors come from coord_state_report_join. */
static void handle_report_join(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__JoinReport *req = (const Pshard__JoinReport *)request;
    coord_join_report_t report = {
        .member_id = req->member_id,
        .lease_key = req->lease_key,
        .rank = req->rank,
        .phase = req->phase == PSHARD__JOIN_PHASE__JOINED       ? COORD_JOIN_PHASE_JOINED
                 : req->phase == PSHARD__JOIN_PHASE__ALL_JOINED ? COORD_JOIN_PHASE_ALL_JOINED
                                                                : (int)req->phase,
        .step = req->step,
        .throw_on_early_termination = req->throw_on_early_termination,
        .last_rank = req->last_rank,
    };
    char err[512] = "";
    coord_join_change_t change = COORD_JOIN_UNCHANGED;
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc =
        coord_state_report_join(c->state, &report, ps_now_ns(), &change, err, sizeof(err));
    if (change != COORD_JOIN_UNCHANGED) {
        bool all = change == COORD_JOIN_ALL_JOINED;
        queue_event_locked(c, coord_state_generation(c->state), all ? "all joined" : "join",
                           all ? coord_state_last_joiner(c->state) : -1);
    }
    flush_events_locked(c);
    pthread_mutex_unlock(&c->mu);
    if (rc != PSHARD_OK) {
        PS_INFO(PS_SUB_COORD, "join report from %s refused: %s", ps_rpc_call_peer(call), err);
        ps_rpc_call_fail(call, rc, "%s", err);
        return;
    }
    Pshard__JoinReportResponse out = PSHARD__JOIN_REPORT_RESPONSE__INIT;
    ps_rpc_call_reply(call, &out.base);
}

/* ---------------------------------------------------------------------------------------- */
/* Store                                                                                     */

static void handle_store_set(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__StoreSetRequest *req = (const Pshard__StoreSetRequest *)request;
    char err[512] = "";
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc = coord_store_set(c->store, req->key, req->value.data, req->value.len, err,
                                         sizeof(err));
    pthread_mutex_unlock(&c->mu);
    if (rc != PSHARD_OK) {
        ps_rpc_call_fail(call, rc, "%s", err);
        return;
    }
    Pshard__StoreSetResponse out = PSHARD__STORE_SET_RESPONSE__INIT;
    ps_rpc_call_reply(call, &out.base);
}

static void handle_store_get(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__StoreGetRequest *req = (const Pshard__StoreGetRequest *)request;
    char err[512] = "";
    const uint8_t *value = NULL;
    size_t len = 0;
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc = coord_store_get(c->store, req->key, &value, &len, err, sizeof(err));
    if (rc == PSHARD_OK) {
        /* Reply under the lock: the value points into the store. */
        Pshard__StoreGetResponse out = PSHARD__STORE_GET_RESPONSE__INIT;
        out.value.data = (uint8_t *)value;
        out.value.len = len;
        ps_rpc_call_reply(call, &out.base);
    }
    pthread_mutex_unlock(&c->mu);
    if (rc != PSHARD_OK)
        ps_rpc_call_fail(call, rc, "%s", err);
}

static void handle_store_cas(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__StoreCompareSetRequest *req = (const Pshard__StoreCompareSetRequest *)request;
    char err[512] = "";
    const uint8_t *value = NULL;
    size_t len = 0;
    int swapped = 0;
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc = coord_store_compare_set(c->store, req->key, req->expected.data,
                                                 req->expected.len, req->desired.data,
                                                 req->desired.len, &swapped, &value, &len, err,
                                                 sizeof(err));
    if (rc == PSHARD_OK) {
        Pshard__StoreCompareSetResponse out = PSHARD__STORE_COMPARE_SET_RESPONSE__INIT;
        out.swapped = swapped != 0;
        out.value.data = (uint8_t *)value;
        out.value.len = len;
        ps_rpc_call_reply(call, &out.base);
    }
    pthread_mutex_unlock(&c->mu);
    if (rc != PSHARD_OK)
        ps_rpc_call_fail(call, rc, "%s", err);
}

static void handle_store_add(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__StoreAddRequest *req = (const Pshard__StoreAddRequest *)request;
    char err[512] = "";
    int64_t result = 0;
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc = coord_store_add(c->store, req->key, req->delta, &result, err, sizeof(err));
    pthread_mutex_unlock(&c->mu);
    if (rc != PSHARD_OK) {
        ps_rpc_call_fail(call, rc, "%s", err);
        return;
    }
    Pshard__StoreAddResponse out = PSHARD__STORE_ADD_RESPONSE__INIT;
    out.value = result;
    ps_rpc_call_reply(call, &out.base);
}

/* Runs under c->mu, from whichever store call completed the wait. */
static void store_wait_done(void *arg, pshard_status_t status, const uint8_t *const *values,
                            const size_t *lens, size_t nkeys, const char *missing)
{
    stream_entry_t *e = arg;
    ps_rpc_call_t *call = e->call;
    pshard_coordinator_t *c = (pshard_coordinator_t *)e->next; /* see handle_store_wait */
    stream_entry_t *mine = take_entry_locked(&c->waits, call);
    free(mine);
    if (status == PSHARD_OK) {
        ProtobufCBinaryData *vals = calloc(nkeys ? nkeys : 1, sizeof(*vals));
        if (!vals) {
            ps_rpc_call_fail(call, PSHARD_ERR_NO_MEMORY, "out of memory");
        } else {
            for (size_t i = 0; i < nkeys; i++) {
                vals[i].data = (uint8_t *)values[i];
                vals[i].len = lens[i];
            }
            Pshard__StoreWaitResponse out = PSHARD__STORE_WAIT_RESPONSE__INIT;
            out.n_values = nkeys;
            out.values = vals;
            ps_rpc_call_reply(call, &out.base);
            free(vals);
        }
    } else if (status == PSHARD_ERR_TIMEOUT) {
        ps_rpc_call_fail(call, PSHARD_ERR_TIMEOUT, "store wait timed out; key '%s' is still absent",
                         missing ? missing : "?");
    } else {
        ps_rpc_call_fail(call, c->stopping ? PSHARD_ERR_UNAVAILABLE : PSHARD_ERR_CANCELLED,
                         c->stopping ? "the coordinator is shutting down" : "store wait cancelled");
    }
    free(e);
}

static void store_wait_cancelled(void *arg, ps_rpc_call_t *call)
{
    pshard_coordinator_t *c = arg;
    pthread_mutex_lock(&c->mu);
    for (stream_entry_t *w = c->waits; w; w = w->next) {
        if (w->call == call) {
            /* Fires store_wait_done with CANCELLED, which unlinks and finishes the call. */
            coord_store_cancel_wait(c->store, w->wait_id);
            break;
        }
    }
    pthread_mutex_unlock(&c->mu);
}

static void handle_store_wait(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__StoreWaitRequest *req = (const Pshard__StoreWaitRequest *)request;
    if (req->timeout_ms < 0 || req->timeout_ms > WAIT_MAX_MS) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                         "timeout_ms is %lld; it must be 0 (server default) to %lld",
                         (long long)req->timeout_ms, (long long)WAIT_MAX_MS);
        return;
    }
    int64_t now = ps_now_ns();
    int64_t timeout_ms = req->timeout_ms ? req->timeout_ms : c->cfg.store_wait_default_ms;
    int64_t deadline = now + timeout_ms * 1000000;
    int64_t call_deadline = ps_rpc_call_deadline_ns(call);
    if (call_deadline < deadline)
        deadline = call_deadline;

    /* The completion context: `call` plus the coordinator smuggled in `next` until the entry
     * is linked into c->waits (a separate entry, so the list never aliases the context). */
    stream_entry_t *done_ctx = calloc(1, sizeof(*done_ctx));
    stream_entry_t *entry = calloc(1, sizeof(*entry));
    if (!done_ctx || !entry) {
        free(done_ctx);
        free(entry);
        ps_rpc_call_fail(call, PSHARD_ERR_NO_MEMORY, "out of memory");
        return;
    }
    done_ctx->call = call;
    done_ctx->next = (stream_entry_t *)c;
    entry->call = call;
    char err[512] = "";
    pthread_mutex_lock(&c->mu);
    if (c->stopping) {
        pthread_mutex_unlock(&c->mu);
        free(done_ctx);
        free(entry);
        ps_rpc_call_fail(call, PSHARD_ERR_UNAVAILABLE, "the coordinator is shutting down");
        return;
    }
    /* Link first: the callback may run inside coord_store_wait when the keys already exist. */
    entry->next = c->waits;
    c->waits = entry;
    pshard_status_t rc =
        coord_store_wait(c->store, (const char *const *)req->keys, req->n_keys, deadline,
                         store_wait_done, done_ctx, &entry->wait_id, err, sizeof(err));
    if (rc != PSHARD_OK) {
        free(take_entry_locked(&c->waits, call));
        free(done_ctx);
    } else {
        pthread_cond_signal(&c->tick_cv);
    }
    pthread_mutex_unlock(&c->mu);
    if (rc != PSHARD_OK) {
        ps_rpc_call_fail(call, rc, "%s", err);
        return;
    }
    ps_rpc_call_on_cancel(call, store_wait_cancelled, c);
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

static void handle_status(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    (void)request;
    int64_t now = ps_now_ns();
    pthread_mutex_lock(&c->mu);
    coord_snapshot_t *snap = coord_state_snapshot(c->state, now);
    size_t keys = coord_store_num_keys(c->store);
    size_t waiters = coord_store_num_waiters(c->store);
    pthread_mutex_unlock(&c->mu);
    counters_t cs = {0};
    cs.cap = 64;
    cs.items = calloc(cs.cap, sizeof(*cs.items));
    cs.ptrs = calloc(cs.cap, sizeof(*cs.ptrs));
    Pshard__Member *items = snap ? calloc(snap->nmembers + 1, sizeof(*items)) : NULL;
    Pshard__Member **ptrs = snap ? calloc(snap->nmembers + 1, sizeof(*ptrs)) : NULL;
    Pshard__JoinEntry *jitems = snap ? calloc(snap->njoins + 1, sizeof(*jitems)) : NULL;
    Pshard__JoinEntry **jptrs = snap ? calloc(snap->njoins + 1, sizeof(*jptrs)) : NULL;
    if (!snap || !cs.items || !cs.ptrs || !items || !ptrs || !jitems || !jptrs) {
        ps_rpc_call_fail(call, PSHARD_ERR_NO_MEMORY, "out of memory building status");
    } else {
        ps_rpc_server_counters(c->srv, collect_counter, &cs);
        members_to_pb(snap, now, items, ptrs);
        joins_to_pb(snap, now, jitems, jptrs);
        Pshard__StatusResponse out = PSHARD__STATUS_RESPONSE__INIT;
        out.version = PSHARD_VERSION_STRING;
        out.generation = snap->generation;
        out.state = state_to_pb(snap->state);
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
        ps_rpc_call_reply(call, &out.base);
    }
    free(items);
    free(ptrs);
    free(jitems);
    free(jptrs);
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
        coord_state_tick(c->state, now);
        coord_store_tick(c->store, now);
        flush_events_locked(c);
        int64_t next = coord_state_next_deadline_ns(c->state);
        int64_t next_store = coord_store_next_deadline_ns(c->store);
        if (next_store < next)
            next = next_store;
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
    stream_entry_t *watchers = c->watchers;
    c->watchers = NULL;
    while (c->waits)
        coord_store_cancel_wait(c->store, c->waits->wait_id);
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

pshard_coordinator_t *pshard_coordinator_start(const pshard_coordinator_config_t *cfg,
                                               char *err, size_t errlen)
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

    coord_state_config_t scfg = {cfg->lease_ms, cfg->heartbeat_ms, cfg->min_nodes, cfg->max_nodes,
                                 cfg->last_call_ms};
    c->state = coord_state_create(&scfg, c->started_ns, on_state_change, c);
    c->store = coord_store_create();
    if (!c->state || !c->store) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "invalid coordinator settings (lease %lld ms, heartbeat %lld ms, nodes %d:%d, "
                "last call %lld ms)",
                (long long)cfg->lease_ms, (long long)cfg->heartbeat_ms, cfg->min_nodes,
                cfg->max_nodes, (long long)cfg->last_call_ms);
        pshard_coordinator_stop(c);
        return NULL;
    }
    c->nevents = 0;

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
        {"StoreSet", &pshard__store_set_request__descriptor, handle_store_set, PS_RPC_INLINE},
        {"StoreGet", &pshard__store_get_request__descriptor, handle_store_get, PS_RPC_INLINE},
        {"StoreWait", &pshard__store_wait_request__descriptor, handle_store_wait, PS_RPC_INLINE},
        {"StoreCompareSet", &pshard__store_compare_set_request__descriptor, handle_store_cas,
         PS_RPC_INLINE},
        {"StoreAdd", &pshard__store_add_request__descriptor, handle_store_add, PS_RPC_INLINE},
        {"ReportJoin", &pshard__join_report__descriptor, handle_report_join, PS_RPC_INLINE},
        /* Status builds a large message: keep it off the completion-queue thread. */
        {"Status", &pshard__status_request__descriptor, handle_status, 0},
    };
    _Static_assert(PS_ARRAY_LEN(table) == PS_ARRAY_LEN(((pshard_coordinator_t *)0)->methods),
                   "method table size");
    for (size_t i = 0; i < PS_ARRAY_LEN(table); i++) {
        c->methods[i] = (ps_rpc_method_t){
            method_path(table[i].name, c->paths[i], sizeof(c->paths[i])), table[i].desc,
            table[i].fn, table[i].flags, c};
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
    flush_events_locked(c);
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
    coord_store_destroy(c->store);
    coord_state_destroy(c->state);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->tick_cv);
    free(c);
}
