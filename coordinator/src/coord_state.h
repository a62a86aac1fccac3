/* Coordinator membership state machine: members, leases, rendezvous, the cluster generation,
 * and the Join table (which ranks' trainers ran out of input). Pure logic with an injected
 * clock (every call takes now_ns), no I/O and no locks: the service serialises calls with its
 * own mutex. Not thread-safe. */
#ifndef PSHARD_COORD_STATE_H
#define PSHARD_COORD_STATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pshard/status.h"

#define COORD_NAME_MAX 253  /* like a DNS name; longer names are refused */
#define COORD_FIELD_MAX 255 /* address, node, device */
#define COORD_ID_LEN 32     /* member ids are 32 lowercase hex chars */
#define COORD_KEY_LEN 32    /* lease keys too: 16 random bytes, hex */
#define COORD_MAX_MEMBERS 65536

typedef enum {
    COORD_ROLE_UNSPECIFIED = 0,
    COORD_ROLE_SHARD_SERVER = 1,
    COORD_ROLE_TRAINER = 2,
} coord_role_t;

typedef enum {
    COORD_CLUSTER_FORMING = 1,  /* rendezvous not complete yet */
    COORD_CLUSTER_FORMED = 2,   /* ranks 0..world_size-1 assigned and all held by live members */
    COORD_CLUSTER_DEGRADED = 3, /* formed once, but a ranked shard server is gone or reports
                                   that it is not serving */
} coord_cluster_state_t;

typedef struct {
    int64_t lease_ms;     /* a member not heard from for this long is evicted */
    int64_t heartbeat_ms; /* interval members are told to heartbeat at */
    int min_nodes;        /* rendezvous: shard servers needed before last call starts */
    int max_nodes;        /* rendezvous: forms at once when this many have registered */
    int64_t last_call_ms; /* after min_nodes registered, wait this long for more (up to max) */
} coord_state_config_t;

/* A shard server's figures of its trainer's last steps, from its heartbeats (StepSummary; checked
 * by coord_steps_check before they are kept). */
typedef struct {
    bool set;        /* a heartbeat carried them */
    uint32_t window; /* steps the medians are over, 1..COORD_STEP_WINDOW */
    uint64_t steps;  /* steps measured since that server started */
    double step_s, compute_s, wait_s;
} coord_steps_t;

typedef struct {
    char member_id[COORD_ID_LEN + 1];
    char lease_key[COORD_KEY_LEN + 1]; /* the member's secret; blank in snapshots */
    coord_role_t role;
    char name[COORD_NAME_MAX + 1];
    char address[COORD_FIELD_MAX + 1];
    char node[COORD_FIELD_MAX + 1];
    char device[COORD_FIELD_MAX + 1];
    int rank;                  /* shard servers: 0..N-1 once formed, else -1; trainers: -1 */
    int64_t registered_ns;     /* when this incarnation registered */
    int64_t last_heartbeat_ns; /* last register or heartbeat */
    int64_t lease_deadline_ns; /* evicted when now_ns passes this */
    uint64_t registered_generation;
    /* A shard server that took the rank of a lost one in a cluster that had formed, while
     * another rank kept its server through the loss: the state of that rank is not on it,
     * and an HSDP replica may heal it (shard_heal.c). False when every server is new (a full
     * restart on a coordinator that outlived the job's processes). */
    bool replaces_lost;
    bool not_serving;                             /* a shard server's last heartbeat said so */
    char not_serving_reason[COORD_FIELD_MAX + 1]; /* its reason, printable ASCII */
    coord_steps_t steps;                          /* a shard server's, from its heartbeats */
} coord_member_t;

/* What a member learns from Register and Heartbeat. */
typedef struct {
    char member_id[COORD_ID_LEN + 1];
    char lease_key[COORD_KEY_LEN + 1]; /* set by register only; "" from heartbeat */
    uint64_t generation;
    int rank;       /* -1 until the cluster formed (or for standby/trainer members) */
    int world_size; /* 0 until formed */
    coord_cluster_state_t state;
    int64_t lease_ms;
    int64_t heartbeat_ms;
    uint64_t formed_generation; /* generation at which the current ranks were (re)formed: the
                                   ranks' collectives are scoped by it; 0 before forming */
    bool replaces_lost;         /* coord_member_t's */
} coord_member_view_t;

/* Join (uneven inputs): what a shard server reports about its trainer. */
typedef enum {
    COORD_JOIN_PHASE_JOINED = 1,     /* this rank's trainer has no more input */
    COORD_JOIN_PHASE_ALL_JOINED = 2, /* every rank joined; the joins returned */
} coord_join_phase_t;

/* One report, as the service decoded it from the wire (strings borrowed). */
typedef struct {
    const char *member_id; /* the reporting shard server */
    const char *lease_key; /* its lease key */
    int rank;              /* the rank it says it holds */
    int phase;             /* a coord_join_phase_t; anything else is refused */
    int64_t step;          /* optimizer steps taken when it joined, >= 0 */
    bool throw_on_early_termination;
    int last_rank; /* with ALL_JOINED: the last rank to join, 0..world_size-1 */
} coord_join_report_t;

/* What a report changed, so the service knows which Watch event to push. */
typedef enum {
    COORD_JOIN_UNCHANGED = 0,  /* a repeat of what the table already says */
    COORD_JOIN_CHANGED = 1,    /* a rank's entry was added or updated: reason "join" */
    COORD_JOIN_ALL_JOINED = 2, /* the table was cleared, last joiner recorded: "all joined" */
} coord_join_change_t;

/* One rank's entry in the join table. */
typedef struct {
    int rank;
    char member_id[COORD_ID_LEN + 1]; /* the shard server that reported it */
    int64_t step;
    int64_t joined_ns; /* when the coordinator recorded it */
    bool throw_on_early_termination;
} coord_join_t;

/* A consistent copy of the whole state for Status and Watch. */
typedef struct {
    uint64_t generation;
    coord_cluster_state_t state;
    int world_size;                 /* ranks assigned when formed, else 0 */
    uint64_t formed_generation;     /* see coord_member_view_t */
    int min_nodes, max_nodes;       /* from the config */
    int shard_servers;              /* registered shard servers right now */
    int64_t last_call_remaining_ms; /* -1 when no last call is running */
    char awaiting[1024]; /* human-readable: who the rendezvous waits for, what is degraded, or "" */
    size_t nmembers;
    coord_member_t *members; /* sorted: shard servers by rank (unranked last, by name), then
                                trainers by name */
    size_t njoins;
    coord_join_t *joins; /* ranks joined now, by rank */
    int last_joiner;     /* last rank of the most recent completed join, or -1 */
} coord_snapshot_t;

/* Called on every generation bump, synchronously inside the call that caused it (so under the
 * caller's lock). reason is a short static-or-temporary string such as "member joined". */
typedef void (*coord_change_fn)(void *arg, uint64_t generation, const char *reason);

typedef struct coord_state coord_state_t;

/* Creates the state. Requires lease_ms > 0, heartbeat_ms > 0, 1 <= min_nodes <= max_nodes,
 * last_call_ms >= 0; returns NULL on a bad config or out of memory. Free with
 * coord_state_destroy. The generation starts at 1. */
coord_state_t *coord_state_create(const coord_state_config_t *cfg, int64_t now_ns,
                                  coord_change_fn on_change, void *on_change_arg);

/* Frees the state; NULL is a no-op. */
void coord_state_destroy(coord_state_t *st);

/* Registers a member. name must be 1..COORD_NAME_MAX printable ASCII bytes without spaces;
 * address/node/device at most COORD_FIELD_MAX printable bytes (may be empty); role must be
 * shard server or trainer. A member with this name whose lease is still running keeps it:
 * the call fails with PSHARD_ERR_ALREADY_EXISTS (the message says when the lease lapses)
 * unless lease_key is that member's key. Otherwise (a restarted pod, its old lease lapsed, or
 * the member re-registering itself) the old incarnation is replaced: the new one gets a new
 * member id and key and the old rank back.
 * A shard server whose name held rank r in a formed cluster that lost it also gets rank r
 * back (state returns to FORMED when every rank is held again). A shard server with a new
 * name takes the lowest vacant rank in a degraded cluster, or waits as a standby (rank -1)
 * in a full one. Bumps the generation. Errors: PSHARD_ERR_INVALID_ARGUMENT (message names
 * the field), PSHARD_ERR_RESOURCE_EXHAUSTED past COORD_MAX_MEMBERS. */
pshard_status_t coord_state_register(coord_state_t *st, coord_role_t role, const char *name,
                                     const char *address, const char *node, const char *device,
                                     const char *lease_key, int64_t now_ns,
                                     coord_member_view_t *out, char *err, size_t errlen);

/* Renews a member's lease; lease_key must be the one its Register returned. Errors:
 * PSHARD_ERR_NOT_FOUND for an unknown or evicted id (the message tells the member to register
 * again), PSHARD_ERR_INVALID_ARGUMENT for a malformed id, PSHARD_ERR_PERMISSION for a
 * missing or wrong key. Does not bump the generation. */
pshard_status_t coord_state_heartbeat(coord_state_t *st, const char *member_id,
                                      const char *lease_key, int64_t now_ns,
                                      coord_member_view_t *out, char *err, size_t errlen);

/* Records what a member's heartbeat said of its own health (call after coord_state_heartbeat
 * succeeded for member_id): reason NULL or "" while it serves, else why not (untrusted: kept
 * as printable ASCII, at most COORD_FIELD_MAX bytes). A ranked shard server that is not
 * serving makes a formed cluster report DEGRADED (coord_state_cluster_state, snapshots, with
 * the reason in awaiting) until it serves again; the generation and the ranks do not change.
 * Returns true when the member's health changed. */
bool coord_state_set_health(coord_state_t *st, const char *member_id, const char *reason);

/* Keeps what a member's heartbeat said of its trainer's steps (call after
 * coord_state_heartbeat succeeded for member_id, with figures coord_steps_check accepted).
 * Nothing else changes. */
void coord_state_set_steps(coord_state_t *st, const char *member_id, const coord_steps_t *steps);

/* The live members, unordered, borrowed until the next call that changes the state. */
const coord_member_t *coord_state_members(const coord_state_t *st, size_t *n);

/* Removes a member at its own request (lease_key as for heartbeat); bumps the generation. A
 * ranked shard server leaving a formed cluster makes it DEGRADED. Errors: as heartbeat's. */
pshard_status_t coord_state_leave(coord_state_t *st, const char *member_id, const char *lease_key,
                                  int64_t now_ns, char *err, size_t errlen);

/* Removes the member named name (a trainer, or a shard server), declared lost by its launcher
 * (why: printable, at most 200 bytes); bumps the generation with the reason "member NAME lost
 * (WHY)"; a ranked shard server's rank becomes vacant (DEGRADED) at once instead of after its
 * lease. Errors: NOT_FOUND (no such member), INVALID_ARGUMENT (why). */
pshard_status_t coord_state_declare_lost(coord_state_t *st, const char *name, const char *why,
                                         int64_t now_ns, char *err, size_t errlen);

/* Advances time: evicts members whose lease lapsed (one bump per eviction, reason names the
 * member), forms the cluster when the last call expires. Returns how many changes happened. */
int coord_state_tick(coord_state_t *st, int64_t now_ns);

/* The earliest time at which coord_state_tick could change something (next lease deadline or
 * last-call expiry), or INT64_MAX when nothing is pending. */
int64_t coord_state_next_deadline_ns(const coord_state_t *st);

/* Records a Join report from a shard server. JOINED adds or updates the rank's entry;
 * ALL_JOINED clears the table and records last_rank as the last joiner (a repeat from another
 * rank, with the table already empty and the same last rank, changes nothing). Reports never
 * bump the generation and never call on_change; *change (required) tells the caller whether
 * to push a Watch event. The table and the last joiner are reset whenever the cluster
 * (re)forms, since every rank restarts its training then.
 * Errors (nothing changes): PSHARD_ERR_PERMISSION for a missing or wrong lease key;
 * PSHARD_ERR_INVALID_ARGUMENT for a malformed member id, a phase
 * other than JOINED/ALL_JOINED, a negative step, a trainer reporting, a rank that is not the
 * member's own, or a last_rank outside 0..world_size-1; PSHARD_ERR_NOT_FOUND for an unknown
 * member id; PSHARD_ERR_FAILED_PRECONDITION for a shard server that holds no rank (the
 * cluster is forming, or it is a standby). The message in err says which. */
pshard_status_t coord_state_report_join(coord_state_t *st, const coord_join_report_t *report,
                                        int64_t now_ns, coord_join_change_t *change, char *err,
                                        size_t errlen);

/* The last rank of the most recent completed join, or -1 when none since the cluster formed. */
int coord_state_last_joiner(const coord_state_t *st);

uint64_t coord_state_generation(const coord_state_t *st);
size_t coord_state_member_count(const coord_state_t *st);
int coord_state_world_size(const coord_state_t *st); /* 0 until formed */
/* The state to report: DEGRADED also while the cluster is formed but a ranked shard server
 * reports it is not serving. */
coord_cluster_state_t coord_state_cluster_state(const coord_state_t *st);

/* Returns a malloc'd snapshot (free with coord_snapshot_free), or NULL when out of memory. */
coord_snapshot_t *coord_state_snapshot(const coord_state_t *st, int64_t now_ns);
void coord_snapshot_free(coord_snapshot_t *snap);

/* Names for status output: "shard_server", "trainer"; "forming", "formed", "degraded". */
const char *coord_role_name(coord_role_t role);
const char *coord_cluster_state_name(coord_cluster_state_t state);
/* "joined", "all_joined"; "unspecified" for anything else. */
const char *coord_join_phase_name(int phase);

#endif
