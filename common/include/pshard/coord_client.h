/* The coordinator's client: one typed function per method of pshard.Coordinator
 * (proto/pshard/coordinator.proto), so no component builds a method path or picks a response
 * descriptor by hand and each method is retried only where that is safe, plus the store
 * helpers every bootstrap needs. Calls go over a channel from ps_rpc_channel_create (whose
 * config names the job). Thread-safe as the channel is. */
#ifndef PSHARD_COORD_CLIENT_H
#define PSHARD_COORD_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pshard/coordinator.pb-c.h"
#include "pshard/rpc.h"

/* X(function, Method, RequestType, ResponseType, response_snake, flags) for every unary
 * method. PS_RPC_IDEMPOTENT retries on UNAVAILABLE (no connection) until the deadline. Leave,
 * ReportJoin, StoreAdd and StoreCompareSet are not retried: a retry of one that took effect
 * would do it twice. Register is: a retry after a lost reply meets the member's own live
 * lease and gets ALREADY_EXISTS, which its callers wait out. */
#define PS_COORD_UNARY(X)                                                                          \
    X(register, Register, RegisterRequest, MemberView, member_view, PS_RPC_IDEMPOTENT)             \
    X(heartbeat, Heartbeat, HeartbeatRequest, MemberView, member_view, PS_RPC_IDEMPOTENT)          \
    X(leave, Leave, LeaveRequest, LeaveResponse, leave_response, 0)                                \
    X(store_set, StoreSet, StoreSetRequest, StoreSetResponse, store_set_response,                  \
      PS_RPC_IDEMPOTENT)                                                                           \
    X(store_get, StoreGet, StoreGetRequest, StoreGetResponse, store_get_response,                  \
      PS_RPC_IDEMPOTENT)                                                                           \
    X(store_wait, StoreWait, StoreWaitRequest, StoreWaitResponse, store_wait_response,             \
      PS_RPC_IDEMPOTENT)                                                                           \
    X(store_compare_set, StoreCompareSet, StoreCompareSetRequest, StoreCompareSetResponse,         \
      store_compare_set_response, 0)                                                               \
    X(store_add, StoreAdd, StoreAddRequest, StoreAddResponse, store_add_response, 0)               \
    X(store_delete, StoreDelete, StoreDeleteRequest, StoreDeleteResponse, store_delete_response,   \
      PS_RPC_IDEMPOTENT)                                                                           \
    X(status, Status, StatusRequest, StatusResponse, status_response, PS_RPC_IDEMPOTENT)           \
    X(report_join, ReportJoin, JoinReport, JoinReportResponse, join_report_response, 0)

/* ps_coord_rpc_<function>(ch, request, &response, timeout_ms, err, errlen): one call with a
 * deadline of timeout_ms. On PSHARD_OK *response is the unpacked reply, freed with
 * protobuf_c_message_free_unpacked (response may be NULL: the reply is then dropped);
 * otherwise *response is NULL and err says why. */
#define PS_COORD_DECLARE_(fn, Method, Req, Resp, resp, flags)                                      \
    pshard_status_t ps_coord_rpc_##fn(ps_rpc_channel_t *ch, const Pshard__##Req *request,          \
                                      Pshard__##Resp **response, int64_t timeout_ms, char *err,    \
                                      size_t errlen);
PS_COORD_UNARY(PS_COORD_DECLARE_)
#undef PS_COORD_DECLARE_

/* Opens the Watch stream (timeout_ms <= 0: no deadline); read it with ps_rpc_stream_next and
 * pshard__cluster_event__descriptor. NULL with a message on a local failure. */
ps_rpc_stream_t *ps_coord_watch_open(ps_rpc_channel_t *ch, const Pshard__WatchRequest *request,
                                     int64_t timeout_ms, char *err, size_t errlen);

/* The store as torch's TCPStore offers it. Keys are C strings; values are bytes. */
pshard_status_t ps_coord_store_put(ps_rpc_channel_t *ch, const char *key, const void *value,
                                   size_t len, int64_t timeout_ms, char *err, size_t errlen);
/* *value is malloc'd (NUL-terminated one past len, for text); free() it. NOT_FOUND when the
 * key is not there. */
pshard_status_t ps_coord_store_fetch(ps_rpc_channel_t *ch, const char *key, char **value,
                                     size_t *len, int64_t timeout_ms, char *err, size_t errlen);
/* Adds delta to the integer at key (0 if absent); *result (may be NULL) is the sum. */
pshard_status_t ps_coord_store_incr(ps_rpc_channel_t *ch, const char *key, int64_t delta,
                                    int64_t *result, int64_t timeout_ms, char *err, size_t errlen);
/* Deletes key; a key that is not there is no error (torch's delete_key returns false). */
pshard_status_t ps_coord_store_remove(ps_rpc_channel_t *ch, const char *key, int64_t timeout_ms,
                                      char *err, size_t errlen);
/* Waits until every one of keys exists, at most wait_ms on the coordinator (the call's own
 * deadline is 5 s longer): TIMEOUT when they did not all appear in time. On PSHARD_OK
 * *values (may be NULL) holds their values in the order of keys (free with
 * protobuf_c_message_free_unpacked). */
pshard_status_t ps_coord_store_await(ps_rpc_channel_t *ch, const char *const *keys, size_t n,
                                     int64_t wait_ms, Pshard__StoreWaitResponse **values, char *err,
                                     size_t errlen);

/* ---- A member's lease ------------------------------------------------------------------ */

/* What a lease reports to its owner after every attempt, on the lease's thread. */
typedef struct {
    pshard_status_t rc;             /* of the attempt (a Register or a Heartbeat) */
    const char *err;                /* its message when rc is not PSHARD_OK */
    const Pshard__MemberView *view; /* the coordinator's answer when rc is PSHARD_OK */
    bool registered;                /* the attempt was a (re-)registration */
    bool generation_changed;        /* view's generation is not the one seen before */
    const char *member_id;          /* the registration's id and secret key ("" before one) */
    const char *lease_key;
} ps_coord_lease_event_t;

typedef struct {
    ps_rpc_channel_t *channel; /* borrowed: it must outlive the lease */
    Pshard__Role role;
    const char *name, *address, *node, *device; /* copied */
    int64_t heartbeat_timeout_ms;               /* each Heartbeat's deadline; 0: twice the
                                                   coordinator's heartbeat interval */
    /* After every attempt (NULL: none): returns how long to wait before the next one, in ms
     * (< 0: the coordinator's heartbeat interval). A member the coordinator forgot (NOT_FOUND:
     * evicted, or a restarted coordinator) registers again at the next attempt, under the
     * same name and with its lease key, which keeps its rank. */
    int64_t (*on_event)(void *ctx, const ps_coord_lease_event_t *ev);
    /* Every 100 ms or so while waiting for the next attempt (NULL: none); last_ok says
     * whether the last attempt went through. */
    void (*on_wait)(void *ctx, bool last_ok);
    /* Before every Heartbeat (NULL: always serving): writes why the member cannot serve now
     * into reason (len bytes), or "" while it serves; the heartbeat carries it. */
    void (*health)(void *ctx, char *reason, size_t len);
    /* Before every Heartbeat (NULL: none): fills *out (initialised) with the member's step
     * figures and returns true, or returns false when it has none; the heartbeat carries
     * them. */
    bool (*steps)(void *ctx, Pshard__StepSummary *out);
    void *ctx;
} ps_coord_lease_config_t;

typedef struct ps_coord_lease ps_coord_lease_t;

/* Starts a lease: with register_now, registers once first (its error is returned, with the
 * lease started anyway only for ALREADY_EXISTS: a live lease still holds the name, and the
 * thread registers once it lapses); without, the thread's first attempt registers. The
 * thread then heartbeats until ps_coord_lease_stop. Free with ps_coord_lease_stop. */
pshard_status_t ps_coord_lease_start(const ps_coord_lease_config_t *cfg, bool register_now,
                                     ps_coord_lease_t **out, char *err, size_t errlen);

/* Stops the thread (an attempt in flight is cancelled) and, when the last attempt went
 * through, leaves. NULL is a no-op. */
void ps_coord_lease_stop(ps_coord_lease_t *lease);

/* Sends the next heartbeat now instead of at its time (e.g. the member's health changed); a
 * no-op while out of contact, or for NULL. Thread-safe. */
void ps_coord_lease_poke(ps_coord_lease_t *lease);

/* The member id and the secret lease key of the current registration ("" before one), e.g.
 * for ReportJoin. Thread-safe. */
void ps_coord_lease_member(ps_coord_lease_t *lease, char *id, size_t idlen, char *key,
                           size_t keylen);

#endif
