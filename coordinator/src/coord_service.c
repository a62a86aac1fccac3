/* The coordinator's gRPC service: handlers that translate between protobuf messages and the
 * membership state, the Join table and the store, a Watch stream of cluster changes, deferred
 * StoreWait replies, and a ticker thread that expires leases, forms the cluster after the last
 * call, times out store waits and ends jobs nobody uses any more. Every call belongs to one
 * job (the "pshard-job" request header, torchrun's --rdzv-id; "default" without it): each job
 * has its own membership state, generation, store, watchers and waits, so one job's members
 * never affect another's. One mutex guards all jobs and the lists of open streams. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coord_metrics.h"
#include "coord_state.h"
#include "coord_store.h"
#include "pshard/coordinator.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

#define MAX_PENDING_EVENTS 64
/* Every Watch event fits in what any gRPC client receives by default (4 MiB), with room to
 * spare: a job too large for that gets its members listed up to the limit (ranked shard
 * servers first) and the count of those left out. */
#define WATCH_EVENT_MAX_BYTES ((size_t)4 * 1024 * 1024 - 64 * 1024)
#define DEFAULT_JOB "default"
#define JOB_NAME_MAX 64
#define MAX_JOBS 1024
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

/* One job: its own membership, store and streams. */
typedef struct coord_job {
    struct coord_job *next;
    pshard_coordinator_t *c;
    char name[JOB_NAME_MAX + 1];
    coord_state_t *state;
    coord_store_t *store;
    stream_entry_t *watchers;
    stream_entry_t *waits;
    pending_event_t events[MAX_PENDING_EVENTS];
    size_t nevents;
    int64_t idle_since_ns; /* when it was last seen unused (no members, watchers or waits) */
} coord_job_t;

struct pshard_coordinator {
    pshard_coordinator_config_t cfg;
    ps_rpc_server_t *srv;
    int64_t started_ns;

    pthread_mutex_t mu;
    pthread_cond_t tick_cv;
    coord_job_t *jobs; /* the default job first, always there */
    size_t njobs;
    coord_store_usage_t store_usage; /* every job's store counts against one limit */
    bool stopping;
    bool ticker_started;
    pthread_t ticker;
    ps_rpc_method_t methods[12]; /* borrowed by the server for its whole life */
    char paths[12][64];
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
        pm->role =
            m->role == COORD_ROLE_SHARD_SERVER ? PSHARD__ROLE__SHARD_SERVER : PSHARD__ROLE__TRAINER;
        pm->name = (char *)m->name;
        pm->rank = m->rank;
        pm->address = (char *)m->address;
        pm->node = (char *)m->node;
        pm->device = (char *)m->device;
        int64_t left = (m->lease_deadline_ns - now_ns) / 1000000;
        pm->lease_remaining_ms = left > 0 ? left : 0;
        pm->last_heartbeat_ms_ago = (now_ns - m->last_heartbeat_ns) / 1000000;
        pm->registered_generation = m->registered_generation;
        pm->not_serving = m->not_serving;
        pm->not_serving_reason = (char *)m->not_serving_reason;
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
static void queue_event_locked(coord_job_t *c, uint64_t generation, const char *reason,
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
    coord_job_t *j = arg;
    PS_INFO(PS_SUB_COORD, "job %s generation %llu: %s", j->name, (unsigned long long)generation,
            reason);
    queue_event_locked(j, generation, reason, -1);
}

/* Sends one ClusterEvent with the current membership and join table to `only` (or every
 * watcher if NULL). last_joiner goes out as is (-1 unless the event is "all joined"). */
static size_t varint_bytes(size_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* How many of ev's members fit in WATCH_EVENT_MAX_BYTES with everything else it carries. */
static size_t members_that_fit(Pshard__ClusterEvent *ev)
{
    size_t all = ev->n_members;
    ev->n_members = 0;
    size_t size = protobuf_c_message_get_packed_size(&ev->base);
    ev->n_members = all;
    size_t n = 0;
    for (; n < all; n++) {
        size_t m = protobuf_c_message_get_packed_size(&ev->members[n]->base);
        size += 1 + varint_bytes(m) + m; /* tag of field 5, length, the member */
        if (size > WATCH_EVENT_MAX_BYTES)
            break;
    }
    return n;
}

static void send_event_locked(coord_job_t *c, ps_rpc_call_t *only, uint64_t generation,
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
        size_t fit = members_that_fit(&ev);
        if (fit < ev.n_members) {
            ev.members_omitted = (uint32_t)(ev.n_members - fit);
            ev.n_members = fit;
        }
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
                    PS_WARN(PS_SUB_COORD,
                            "dropping a Watch from %s: it does not read its "
                            "events",
                            ps_rpc_call_peer(w->call));
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

/* The default job's state is the readiness health status "pshard.Cluster": SERVING while
 * formed with every ranked shard server serving. */
static void cluster_health_locked(coord_job_t *c)
{
    if (c == c->c->jobs) {
        bool formed = coord_state_cluster_state(c->state) == COORD_CLUSTER_FORMED;
        ps_rpc_server_set_health(c->c->srv, "pshard.Cluster", formed ? 1 : 2);
    }
}

/* Pushes the changes recorded by on_state_change, then updates the health. */
static void flush_events_locked(coord_job_t *c)
{
    if (c->nevents == 0)
        return;
    for (size_t i = 0; i < c->nevents; i++) {
        if (c->watchers)
            send_event_locked(c, NULL, c->events[i].generation, c->events[i].reason,
                              c->events[i].last_joiner);
    }
    c->nevents = 0;
    cluster_health_locked(c);
}

/* ---------------------------------------------------------------------------------------- */
/* Jobs                                                                                      */

static coord_job_t *job_create_locked(pshard_coordinator_t *c, const char *name, size_t len)
{
    coord_job_t *j = calloc(1, sizeof(*j));
    if (!j)
        return NULL;
    j->c = c;
    memcpy(j->name, name, len);
    j->name[len] = '\0';
    coord_state_config_t scfg = {c->cfg.lease_ms, c->cfg.heartbeat_ms, c->cfg.min_nodes,
                                 c->cfg.max_nodes, c->cfg.last_call_ms};
    j->state = coord_state_create(&scfg, ps_now_ns(), on_state_change, j);
    j->store = coord_store_create_shared(&c->store_usage);
    if (!j->state || !j->store) {
        coord_state_destroy(j->state);
        coord_store_destroy(j->store);
        free(j);
        return NULL;
    }
    j->idle_since_ns = ps_now_ns();
    return j;
}

static void job_destroy(coord_job_t *j)
{
    coord_store_destroy(j->store);
    coord_state_destroy(j->state);
    free(j);
}

/* A job nobody uses: no members, no open Watch, no pending StoreWait. */
static bool job_unused(const coord_job_t *j)
{
    return !j->watchers && !j->waits && coord_state_member_count(j->state) == 0;
}

/* Ends one unused job (never the default one): its store keys go with it. */
static void job_end_locked(pshard_coordinator_t *c, coord_job_t *j, const char *why)
{
    for (coord_job_t **pp = &c->jobs; *pp; pp = &(*pp)->next) {
        if (*pp == j) {
            *pp = j->next;
            c->njobs--;
            PS_INFO(PS_SUB_COORD, "job %s ended (%s); %zu store key%s removed", j->name, why,
                    coord_store_num_keys(j->store), coord_store_num_keys(j->store) == 1 ? "" : "s");
            job_destroy(j);
            return;
        }
    }
}

static bool job_name_ok(const char *name, size_t len)
{
    if (len == 0 || len > JOB_NAME_MAX)
        return false;
    for (size_t i = 0; i < len; i++) {
        char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '-' || ch == '_' || ch == '.'))
            return false;
    }
    return true;
}

/* The job a call belongs to (its "pshard-job" header; the default job without one), made when
 * create is set and it does not exist yet. NULL with *rc and err set on a malformed name, an
 * unknown job (create unset: PSHARD_ERR_NOT_FOUND) or too many jobs. Under c->mu. */
static coord_job_t *job_of_call_locked(pshard_coordinator_t *c, const ps_rpc_call_t *call,
                                       bool create, pshard_status_t *rc, char *err, size_t errlen)
{
    size_t len = 0;
    const char *name = ps_rpc_call_header(call, PS_RPC_JOB_HEADER, &len);
    if (!name) {
        name = DEFAULT_JOB;
        len = strlen(DEFAULT_JOB);
    }
    if (!job_name_ok(name, len)) {
        *rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                      "job id in the '%s' header must be 1 to %d of A-Z a-z 0-9 . _ - (got %zu "
                      "bytes)",
                      PS_RPC_JOB_HEADER, JOB_NAME_MAX, len);
        return NULL;
    }
    for (coord_job_t *j = c->jobs; j; j = j->next)
        if (strlen(j->name) == len && memcmp(j->name, name, len) == 0)
            return j;
    if (!create) {
        *rc = ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "job %.*s has no members and no keys",
                      (int)len, name);
        return NULL;
    }
    if (c->njobs >= MAX_JOBS) {
        /* Make room by ending the unused job idle longest, if there is one. */
        coord_job_t *oldest = NULL;
        for (coord_job_t *j = c->jobs->next; j; j = j->next)
            if (job_unused(j) && (!oldest || j->idle_since_ns < oldest->idle_since_ns))
                oldest = j;
        if (!oldest) {
            *rc = ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                          "the coordinator already serves %d jobs in use; the limit is %d",
                          (int)c->njobs, MAX_JOBS);
            return NULL;
        }
        job_end_locked(c, oldest, "room for a new job");
    }
    coord_job_t *j = job_create_locked(c, name, len);
    if (!j) {
        *rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory making job %.*s", (int)len,
                      name);
        return NULL;
    }
    /* After the default job, which stays first. */
    j->next = c->jobs->next;
    c->jobs->next = j;
    c->njobs++;
    PS_INFO(PS_SUB_COORD, "job %s started", j->name);
    return j;
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
    stream_entry_t *e = NULL;
    for (coord_job_t *j = c->jobs; j && !e; j = j->next)
        e = take_entry_locked(&j->watchers, call);
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
    coord_job_t *j = c->stopping ? NULL : job_of_call_locked(c, call, true, &rc, err, sizeof(err));
    if (!j) {
        pthread_mutex_unlock(&c->mu);
        free(e);
        ps_rpc_call_fail(call, rc, "%s", c->stopping ? "the coordinator is shutting down" : err);
        return;
    }
    send_event_locked(j, call, 0, "current state", -1);
    e->next = j->watchers;
    j->watchers = e;
    pthread_mutex_unlock(&c->mu);
    ps_rpc_call_on_cancel(call, watch_cancelled, c);
}

/* ---------------------------------------------------------------------------------------- */
/* Membership                                                                                */

/* A member of a job the coordinator does not know (never started, or ended): register again,
 * as after an eviction. */
static pshard_status_t unknown_member(const char *member_id, char *err, size_t errlen)
{
    err[0] = '\0';
    return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND,
                   "unknown member id %s: it was evicted or never registered; register again",
                   member_id ? member_id : "");
}

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
    coord_job_t *j = job_of_call_locked(c, call, true, &rc, err, sizeof(err));
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
        flush_events_locked(j);
    pthread_mutex_unlock(&c->mu);
    if (rc == PSHARD_OK)
        PS_INFO(PS_SUB_COORD, "job %s: registered %s '%s' from %s as %s", j->name,
                coord_role_name(role), req->name, ps_rpc_call_peer(call), view.member_id);
    reply_view(call, rc, &view, err);
}

static void handle_heartbeat(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__HeartbeatRequest *req = (const Pshard__HeartbeatRequest *)request;
    char err[PSHARD_ERRLEN] = "";
    coord_member_view_t view;
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = job_of_call_locked(c, call, false, &rc, err, sizeof(err));
    if (j) {
        rc = coord_state_heartbeat(j->state, req->member_id, req->lease_key, ps_now_ns(), &view,
                                   err, sizeof(err));
        const char *why = req->not_serving ? req->not_serving_reason : NULL;
        if (rc == PSHARD_OK && req->not_serving && (!why || !*why))
            why = "(no reason given)";
        if (rc == PSHARD_OK && coord_state_set_health(j->state, req->member_id, why))
            cluster_health_locked(j);
    } else if (rc == PSHARD_ERR_NOT_FOUND)
        rc = unknown_member(req->member_id, err, sizeof(err));
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
    coord_job_t *j = job_of_call_locked(c, call, false, &rc, err, sizeof(err));
    if (j) {
        rc = coord_state_leave(j->state, req->member_id, req->lease_key, ps_now_ns(), err,
                               sizeof(err));
        gen = coord_state_generation(j->state);
        flush_events_locked(j);
    } else if (rc == PSHARD_ERR_NOT_FOUND) {
        rc = unknown_member(req->member_id, err, sizeof(err));
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
    char err[PSHARD_ERRLEN] = "";
    coord_join_change_t change = COORD_JOIN_UNCHANGED;
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = job_of_call_locked(c, call, false, &rc, err, sizeof(err));
    if (j)
        rc = coord_state_report_join(j->state, &report, ps_now_ns(), &change, err, sizeof(err));
    else if (rc == PSHARD_ERR_NOT_FOUND)
        rc = unknown_member(req->member_id, err, sizeof(err));
    if (j && change != COORD_JOIN_UNCHANGED) {
        bool all = change == COORD_JOIN_ALL_JOINED;
        queue_event_locked(j, coord_state_generation(j->state), all ? "all joined" : "join",
                           all ? coord_state_last_joiner(j->state) : -1);
    }
    if (j)
        flush_events_locked(j);
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
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = job_of_call_locked(c, call, true, &rc, err, sizeof(err));
    if (j)
        rc = coord_store_set(j->store, req->key, req->value.data, req->value.len, err, sizeof(err));
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
    char err[PSHARD_ERRLEN] = "";
    const uint8_t *value = NULL;
    size_t len = 0;
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = job_of_call_locked(c, call, false, &rc, err, sizeof(err));
    if (j)
        rc = coord_store_get(j->store, req->key, &value, &len, err, sizeof(err));
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
    char err[PSHARD_ERRLEN] = "";
    const uint8_t *value = NULL;
    size_t len = 0;
    int swapped = 0;
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = job_of_call_locked(c, call, true, &rc, err, sizeof(err));
    if (j)
        rc = coord_store_compare_set(j->store, req->key, req->expected.data, req->expected.len,
                                     req->desired.data, req->desired.len, &swapped, &value, &len,
                                     err, sizeof(err));
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
    char err[PSHARD_ERRLEN] = "";
    int64_t result = 0;
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = job_of_call_locked(c, call, true, &rc, err, sizeof(err));
    if (j)
        rc = coord_store_add(j->store, req->key, req->delta, &result, err, sizeof(err));
    pthread_mutex_unlock(&c->mu);
    if (rc != PSHARD_OK) {
        ps_rpc_call_fail(call, rc, "%s", err);
        return;
    }
    Pshard__StoreAddResponse out = PSHARD__STORE_ADD_RESPONSE__INIT;
    out.value = result;
    ps_rpc_call_reply(call, &out.base);
}

static void handle_store_delete(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__StoreDeleteRequest *req = (const Pshard__StoreDeleteRequest *)request;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = job_of_call_locked(c, call, false, &rc, err, sizeof(err));
    if (j)
        rc = coord_store_delete(j->store, req->key, err, sizeof(err));
    pthread_mutex_unlock(&c->mu);
    if (rc != PSHARD_OK && rc != PSHARD_ERR_NOT_FOUND) {
        ps_rpc_call_fail(call, rc, "%s", err);
        return;
    }
    Pshard__StoreDeleteResponse out = PSHARD__STORE_DELETE_RESPONSE__INIT;
    out.deleted = rc == PSHARD_OK;
    ps_rpc_call_reply(call, &out.base);
}

/* Runs under c->mu, from whichever store call completed the wait. */
static void store_wait_done(void *arg, pshard_status_t status, const uint8_t *const *values,
                            const size_t *lens, size_t nkeys, const char *missing)
{
    stream_entry_t *e = arg;
    ps_rpc_call_t *call = e->call;
    coord_job_t *j = (coord_job_t *)e->next; /* see handle_store_wait */
    pshard_coordinator_t *c = j->c;
    stream_entry_t *mine = take_entry_locked(&j->waits, call);
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
    for (coord_job_t *j = c->jobs; j; j = j->next) {
        for (stream_entry_t *w = j->waits; w; w = w->next) {
            if (w->call == call) {
                /* Fires store_wait_done with CANCELLED, which unlinks and finishes the call. */
                coord_store_cancel_wait(j->store, w->wait_id);
                goto out;
            }
        }
    }
out:
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

    /* The completion context: `call` plus its job smuggled in `next` (the entry linked into
     * the job's waits is a separate one, so the list never aliases the context). */
    stream_entry_t *done_ctx = calloc(1, sizeof(*done_ctx));
    stream_entry_t *entry = calloc(1, sizeof(*entry));
    if (!done_ctx || !entry) {
        free(done_ctx);
        free(entry);
        ps_rpc_call_fail(call, PSHARD_ERR_NO_MEMORY, "out of memory");
        return;
    }
    done_ctx->call = call;
    entry->call = call;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = PSHARD_ERR_UNAVAILABLE;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = c->stopping ? NULL : job_of_call_locked(c, call, true, &rc, err, sizeof(err));
    if (!j) {
        pthread_mutex_unlock(&c->mu);
        free(done_ctx);
        free(entry);
        ps_rpc_call_fail(call, rc, "%s", c->stopping ? "the coordinator is shutting down" : err);
        return;
    }
    done_ctx->next = (stream_entry_t *)j;
    /* Link first: the callback may run inside coord_store_wait when the keys already exist. */
    entry->next = j->waits;
    j->waits = entry;
    rc = coord_store_wait(j->store, (const char *const *)req->keys, req->n_keys, deadline,
                          store_wait_done, done_ctx, &entry->wait_id, err, sizeof(err));
    if (rc != PSHARD_OK) {
        free(take_entry_locked(&j->waits, call));
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

/* Fills one JobSummary for Status. Under c->mu. */
static void job_summary_locked(const coord_job_t *j, int64_t now, Pshard__JobSummary *out)
{
    pshard__job_summary__init(out);
    out->job = (char *)j->name; /* jobs live until the ticker ends them, under c->mu: see below */
    out->state = state_to_pb(coord_state_cluster_state(j->state));
    out->generation = coord_state_generation(j->state);
    out->world_size = coord_state_world_size(j->state);
    out->members = (uint32_t)coord_state_member_count(j->state);
    out->store_keys = coord_store_num_keys(j->store);
    out->idle_ms = job_unused(j) ? (now - j->idle_since_ns) / 1000000 : 0;
}

static void handle_status(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    (void)request;
    int64_t now = ps_now_ns();
    char err[PSHARD_ERRLEN] = "", jobname[JOB_NAME_MAX + 1] = DEFAULT_JOB;
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = job_of_call_locked(c, call, false, &rc, err, sizeof(err));
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
    if (!snap || !cs.items || !cs.ptrs || !items || !ptrs || !jitems || !jptrs || !jitems_all ||
        !jptrs_all || !jnames) {
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
        out.job = jobname;
        out.n_jobs = njobs;
        out.jobs = jptrs_all;
        out.job_linger_ms = c->cfg.job_linger_ms;
        ps_rpc_call_reply(call, &out.base);
    }
    free(jitems_all);
    free(jptrs_all);
    free(jnames);
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
        int64_t next = INT64_MAX;
        for (coord_job_t *j = c->jobs, *after; j; j = after) {
            after = j->next;
            coord_state_tick(j->state, now);
            coord_store_tick(j->store, now);
            flush_events_locked(j);
            if (!job_unused(j)) {
                j->idle_since_ns = now;
            } else if (j != c->jobs && now - j->idle_since_ns >= c->cfg.job_linger_ms * 1000000) {
                job_end_locked(c, j, "unused");
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
    c->jobs = job_create_locked(c, DEFAULT_JOB, strlen(DEFAULT_JOB));
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
        {"StoreSet", &pshard__store_set_request__descriptor, handle_store_set, PS_RPC_INLINE},
        {"StoreGet", &pshard__store_get_request__descriptor, handle_store_get, PS_RPC_INLINE},
        {"StoreWait", &pshard__store_wait_request__descriptor, handle_store_wait, PS_RPC_INLINE},
        {"StoreCompareSet", &pshard__store_compare_set_request__descriptor, handle_store_cas,
         PS_RPC_INLINE},
        {"StoreAdd", &pshard__store_add_request__descriptor, handle_store_add, PS_RPC_INLINE},
        {"StoreDelete", &pshard__store_delete_request__descriptor, handle_store_delete,
         PS_RPC_INLINE},
        {"ReportJoin", &pshard__join_report__descriptor, handle_report_join, PS_RPC_INLINE},
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
    flush_events_locked(c->jobs);
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
        job_destroy(j);
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
