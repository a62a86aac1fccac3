/* The coordinator's jobs and their Watch events: finding (or making) the job a call belongs
 * to, ending unused ones, queueing and sending a job's ClusterEvents to its watchers, and the
 * protobuf conversions those events and Status share. The lower layer of the service:
 * coord_service.c and coord_store_service.c call it, and it calls neither of them. */
#include <stdlib.h>
#include <string.h>

#include "coord_service.h"
#include "coord_state.h"
#include "coord_store.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

/* Every Watch event fits in what any gRPC client receives by default (4 MiB), with room to
 * spare: a job too large for that gets its members listed up to the limit (ranked shard
 * servers first) and the count of those left out. */
#define WATCH_EVENT_MAX_BYTES ((size_t)4 * 1024 * 1024 - 64 * 1024)
#define MAX_JOBS 1024

/* ---------------------------------------------------------------------------------------- */
/* Conversions                                                                               */

Pshard__ClusterState coord_cluster_state_to_pb(coord_cluster_state_t s)
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

void coord_members_to_pb(const coord_snapshot_t *snap, int64_t now_ns, Pshard__Member *items,
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

void coord_joins_to_pb(const coord_snapshot_t *snap, int64_t now_ns, Pshard__JoinEntry *items,
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

void coord_queue_event_locked(coord_job_t *c, uint64_t generation, const char *reason,
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
    coord_queue_event_locked(j, generation, reason, -1);
}

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

void coord_send_event_locked(coord_job_t *c, ps_rpc_call_t *only, uint64_t generation,
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
        coord_members_to_pb(snap, now, items, ptrs);
        coord_joins_to_pb(snap, now, jitems, jptrs);
        Pshard__ClusterEvent ev = PSHARD__CLUSTER_EVENT__INIT;
        ev.generation = generation ? generation : snap->generation;
        ev.state = coord_cluster_state_to_pb(snap->state);
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

void coord_cluster_health_locked(coord_job_t *c)
{
    if (c == c->c->jobs) {
        bool formed = coord_state_cluster_state(c->state) == COORD_CLUSTER_FORMED;
        ps_rpc_server_set_health(c->c->srv, "pshard.Cluster", formed ? 1 : 2);
    }
}

void coord_flush_events_locked(coord_job_t *c)
{
    if (c->nevents == 0)
        return;
    for (size_t i = 0; i < c->nevents; i++) {
        if (c->watchers)
            coord_send_event_locked(c, NULL, c->events[i].generation, c->events[i].reason,
                                    c->events[i].last_joiner);
    }
    c->nevents = 0;
    coord_cluster_health_locked(c);
}

/* ---------------------------------------------------------------------------------------- */
/* Jobs                                                                                      */

coord_job_t *coord_job_create_locked(pshard_coordinator_t *c, const char *name, size_t len)
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
    coord_straggler_watch_init(&j->straggler);
    return j;
}

void coord_job_destroy(coord_job_t *j)
{
    coord_store_destroy(j->store);
    coord_state_destroy(j->state);
    free(j);
}

bool coord_job_unused(const coord_job_t *j)
{
    return !j->watchers && !j->waits && coord_state_member_count(j->state) == 0;
}

void coord_job_end_locked(pshard_coordinator_t *c, coord_job_t *j, const char *why)
{
    for (coord_job_t **pp = &c->jobs; *pp; pp = &(*pp)->next) {
        if (*pp == j) {
            *pp = j->next;
            c->njobs--;
            PS_INFO(PS_SUB_COORD, "job %s ended (%s); %zu store key%s removed", j->name, why,
                    coord_store_num_keys(j->store), coord_store_num_keys(j->store) == 1 ? "" : "s");
            coord_job_destroy(j);
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

coord_job_t *coord_job_of_call_locked(pshard_coordinator_t *c, const ps_rpc_call_t *call,
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
            if (coord_job_unused(j) && (!oldest || j->idle_since_ns < oldest->idle_since_ns))
                oldest = j;
        if (!oldest) {
            *rc = ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                          "the coordinator already serves %d jobs in use; the limit is %d",
                          (int)c->njobs, MAX_JOBS);
            return NULL;
        }
        coord_job_end_locked(c, oldest, "room for a new job");
    }
    coord_job_t *j = coord_job_create_locked(c, name, len);
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

stream_entry_t *coord_take_entry_locked(stream_entry_t **list, ps_rpc_call_t *call)
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

pshard_status_t coord_unknown_member(const char *member_id, char *err, size_t errlen)
{
    err[0] = '\0';
    return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND,
                   "unknown member id %s: it was evicted or never registered; register again",
                   member_id ? member_id : "");
}
