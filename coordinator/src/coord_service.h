/* Internals of the coordinator's gRPC service shared by its files: the coordinator and job
 * structs, the jobs and their Watch events (coord_job.c), and the store and Join handlers
 * (coord_store_service.c) that the method table in coord_service.c registers. Every call
 * belongs to one job (the "pshard-job" request header, torchrun's --rdzv-id; "default" without
 * it): each job has its own membership state, generation, store, watchers and waits, so one
 * job's members never affect another's. One mutex (pshard_coordinator_t.mu) guards all jobs
 * and the lists of open streams. Calls go one way: coord_service.c and coord_store_service.c
 * use coord_job.c, coord_service.c registers coord_store_service.c's handlers. */
#ifndef PSHARD_COORD_SERVICE_H
#define PSHARD_COORD_SERVICE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "coord_state.h"
#include "coord_store.h"
#include "coord_straggler.h"
#include "pshard/coordinator.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/rpc.h"

#define MAX_PENDING_EVENTS 64
#define DEFAULT_JOB "default"
#define JOB_NAME_MAX 64

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
    coord_straggler_watch_t straggler; /* what the log said of its slowest rank */
    int64_t straggler_checked_ns;      /* when a heartbeat last looked for it */
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
/* Conversions (coord_job.c)                                                                 */

/* The protobuf form of a cluster state. */
Pshard__ClusterState coord_cluster_state_to_pb(coord_cluster_state_t s);

/* Fills members[] (caller-allocated, snap->nmembers entries) pointing into snap. */
void coord_members_to_pb(const coord_snapshot_t *snap, int64_t now_ns, Pshard__Member *items,
                         Pshard__Member **ptrs);

/* Fills joins[] (caller-allocated, snap->njoins entries) pointing into snap. */
void coord_joins_to_pb(const coord_snapshot_t *snap, int64_t now_ns, Pshard__JoinEntry *items,
                       Pshard__JoinEntry **ptrs);

/* ---------------------------------------------------------------------------------------- */
/* Watch events (coord_job.c). All under c->mu.                                              */

/* Queues one Watch event (sent by coord_flush_events_locked). Under c->mu. */
void coord_queue_event_locked(coord_job_t *c, uint64_t generation, const char *reason,
                              int last_joiner);

/* Sends one ClusterEvent with the current membership and join table to `only` (or every
 * watcher if NULL). last_joiner goes out as is (-1 unless the event is "all joined"). */
void coord_send_event_locked(coord_job_t *c, ps_rpc_call_t *only, uint64_t generation,
                             const char *reason, int last_joiner);

/* The default job's state is the readiness health status "pshard.Cluster": SERVING while
 * formed with every ranked shard server serving. */
void coord_cluster_health_locked(coord_job_t *c);

/* Pushes the changes recorded by on_state_change, then updates the health. */
void coord_flush_events_locked(coord_job_t *c);

/* ---------------------------------------------------------------------------------------- */
/* Jobs (coord_job.c)                                                                        */

/* Makes job `name` (len bytes, not linked into c->jobs) with its membership state and store;
 * NULL when out of memory or c->cfg is invalid. Free it with coord_job_destroy. */
coord_job_t *coord_job_create_locked(pshard_coordinator_t *c, const char *name, size_t len);

/* Frees a job made by coord_job_create_locked, its state and its store. */
void coord_job_destroy(coord_job_t *j);

/* A job nobody uses: no members, no open Watch, no pending StoreWait. */
bool coord_job_unused(const coord_job_t *j);

/* Ends one unused job (never the default one): its store keys go with it. */
void coord_job_end_locked(pshard_coordinator_t *c, coord_job_t *j, const char *why);

/* The job a call belongs to (its "pshard-job" header; the default job without one), made when
 * create is set and it does not exist yet. NULL with *rc and err set on a malformed name, an
 * unknown job (create unset: PSHARD_ERR_NOT_FOUND) or too many jobs. Under c->mu. */
coord_job_t *coord_job_of_call_locked(pshard_coordinator_t *c, const ps_rpc_call_t *call,
                                      bool create, pshard_status_t *rc, char *err, size_t errlen);

/* Unlinks the entry of call from list and returns it (the caller frees it); NULL if it is not
 * there. Under c->mu. */
stream_entry_t *coord_take_entry_locked(stream_entry_t **list, ps_rpc_call_t *call);

/* A member of a job the coordinator does not know (never started, or ended): register again,
 * as after an eviction. */
pshard_status_t coord_unknown_member(const char *member_id, char *err, size_t errlen);

/* ---------------------------------------------------------------------------------------- */
/* Store and Join handlers (coord_store_service.c)                                           */

/* The handlers of the store methods and ReportJoin, for the method table in coord_service.c;
 * ctx is the pshard_coordinator_t. Each takes c->mu itself and answers the call (StoreWait from
 * the store's wait callback, once its keys exist or its deadline passes). */
void coord_handle_report_join(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx);
void coord_handle_store_set(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx);
void coord_handle_store_get(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx);
void coord_handle_store_cas(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx);
void coord_handle_store_add(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx);
void coord_handle_store_delete(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx);
void coord_handle_store_wait(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx);

#endif
