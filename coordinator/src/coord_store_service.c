/* The coordinator's store and Join handlers: the key/value store methods (StoreSet, StoreGet,
 * StoreCompareSet, StoreAdd, StoreDelete, and StoreWait with its deferred replies) and
 * ReportJoin, translating between protobuf messages and a job's store (coord_store.c) and Join
 * table (coord_state.c). They find their job, and push Join changes on Watch, through
 * coord_job.c; the method table that registers them is in coord_service.c. */
#include <pthread.h>
#include <stdlib.h>

#include "coord_service.h"
#include "coord_state.h"
#include "coord_store.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

#define WAIT_MAX_MS (24LL * 3600 * 1000)

/* ---------------------------------------------------------------------------------------- */
/* Join                                                                                      */

/* ReportJoin: a shard server reports its trainer's join (JOINED) or the end of a join
 * (ALL_JOINED). The generation stays; a change is pushed on Watch with reason "join" or
 * "all joined". Errors come from coord_state_report_join. */
void coord_handle_report_join(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
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
    coord_job_t *j = coord_job_of_call_locked(c, call, false, &rc, err, sizeof(err));
    if (j)
        rc = coord_state_report_join(j->state, &report, ps_now_ns(), &change, err, sizeof(err));
    else if (rc == PSHARD_ERR_NOT_FOUND)
        rc = coord_unknown_member(req->member_id, err, sizeof(err));
    if (j && change != COORD_JOIN_UNCHANGED) {
        bool all = change == COORD_JOIN_ALL_JOINED;
        coord_queue_event_locked(j, coord_state_generation(j->state), all ? "all joined" : "join",
                                 all ? coord_state_last_joiner(j->state) : -1);
    }
    if (j)
        coord_flush_events_locked(j);
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

void coord_handle_store_set(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__StoreSetRequest *req = (const Pshard__StoreSetRequest *)request;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = coord_job_of_call_locked(c, call, true, &rc, err, sizeof(err));
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

void coord_handle_store_get(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__StoreGetRequest *req = (const Pshard__StoreGetRequest *)request;
    char err[PSHARD_ERRLEN] = "";
    const uint8_t *value = NULL;
    size_t len = 0;
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = coord_job_of_call_locked(c, call, false, &rc, err, sizeof(err));
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

void coord_handle_store_cas(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__StoreCompareSetRequest *req = (const Pshard__StoreCompareSetRequest *)request;
    char err[PSHARD_ERRLEN] = "";
    const uint8_t *value = NULL;
    size_t len = 0;
    int swapped = 0;
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = coord_job_of_call_locked(c, call, true, &rc, err, sizeof(err));
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

void coord_handle_store_add(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__StoreAddRequest *req = (const Pshard__StoreAddRequest *)request;
    char err[PSHARD_ERRLEN] = "";
    int64_t result = 0;
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = coord_job_of_call_locked(c, call, true, &rc, err, sizeof(err));
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

void coord_handle_store_delete(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_coordinator_t *c = ctx;
    const Pshard__StoreDeleteRequest *req = (const Pshard__StoreDeleteRequest *)request;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&c->mu);
    coord_job_t *j = coord_job_of_call_locked(c, call, false, &rc, err, sizeof(err));
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
    coord_job_t *j = (coord_job_t *)e->next; /* see coord_handle_store_wait */
    pshard_coordinator_t *c = j->c;
    stream_entry_t *mine = coord_take_entry_locked(&j->waits, call);
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

void coord_handle_store_wait(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
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
    coord_job_t *j =
        c->stopping ? NULL : coord_job_of_call_locked(c, call, true, &rc, err, sizeof(err));
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
        free(coord_take_entry_locked(&j->waits, call));
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
