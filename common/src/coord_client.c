/* The coordinator's client (see pshard/coord_client.h). */
#include "pshard/coord_client.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pshard/util.h"

/* What the coordinator keeps of a not-serving reason, NUL included. */
#define COORD_REASON_LEN 256

#define PS_COORD_DEFINE_(fn, Method, Req, Resp, resp, flags)                                       \
    pshard_status_t ps_coord_rpc_##fn(ps_rpc_channel_t *ch, const Pshard__##Req *request,          \
                                      Pshard__##Resp **response, int64_t timeout_ms, char *err,    \
                                      size_t errlen)                                               \
    {                                                                                              \
        ProtobufCMessage *out = NULL;                                                              \
        pshard_status_t rc = ps_rpc_unary(ch, "/pshard.Coordinator/" #Method, &request->base,      \
                                          &pshard__##resp##__descriptor, &out, timeout_ms, flags,  \
                                          NULL, err, errlen);                                      \
        if (response)                                                                              \
            *response = rc == PSHARD_OK ? (Pshard__##Resp *)out : NULL;                            \
        if (out && (rc != PSHARD_OK || !response))                                                 \
            protobuf_c_message_free_unpacked(out, NULL);                                           \
        return rc;                                                                                 \
    }
PS_COORD_UNARY(PS_COORD_DEFINE_)
#undef PS_COORD_DEFINE_

ps_rpc_stream_t *ps_coord_watch_open(ps_rpc_channel_t *ch, const Pshard__WatchRequest *request,
                                     int64_t timeout_ms, char *err, size_t errlen)
{
    return ps_rpc_stream_open(ch, "/pshard.Coordinator/Watch", &request->base, timeout_ms, err,
                              errlen);
}

pshard_status_t ps_coord_store_put(ps_rpc_channel_t *ch, const char *key, const void *value,
                                   size_t len, int64_t timeout_ms, char *err, size_t errlen)
{
    Pshard__StoreSetRequest req = PSHARD__STORE_SET_REQUEST__INIT;
    req.key = (char *)key;
    req.value.data = (uint8_t *)value;
    req.value.len = len;
    return ps_coord_rpc_store_set(ch, &req, NULL, timeout_ms, err, errlen);
}

pshard_status_t ps_coord_store_fetch(ps_rpc_channel_t *ch, const char *key, char **value,
                                     size_t *len, int64_t timeout_ms, char *err, size_t errlen)
{
    *value = NULL;
    *len = 0;
    Pshard__StoreGetRequest req = PSHARD__STORE_GET_REQUEST__INIT;
    req.key = (char *)key;
    Pshard__StoreGetResponse *resp = NULL;
    pshard_status_t rc = ps_coord_rpc_store_get(ch, &req, &resp, timeout_ms, err, errlen);
    if (rc != PSHARD_OK)
        return rc;
    char *copy = malloc(resp->value.len + 1);
    if (!copy) {
        protobuf_c_message_free_unpacked(&resp->base, NULL);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory for store key %s", key);
    }
    if (resp->value.len)
        memcpy(copy, resp->value.data, resp->value.len);
    copy[resp->value.len] = '\0';
    *value = copy;
    *len = resp->value.len;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return PSHARD_OK;
}

pshard_status_t ps_coord_store_incr(ps_rpc_channel_t *ch, const char *key, int64_t delta,
                                    int64_t *result, int64_t timeout_ms, char *err, size_t errlen)
{
    Pshard__StoreAddRequest req = PSHARD__STORE_ADD_REQUEST__INIT;
    req.key = (char *)key;
    req.delta = delta;
    Pshard__StoreAddResponse *resp = NULL;
    pshard_status_t rc = ps_coord_rpc_store_add(ch, &req, &resp, timeout_ms, err, errlen);
    if (rc == PSHARD_OK) {
        if (result)
            *result = resp->value;
        protobuf_c_message_free_unpacked(&resp->base, NULL);
    }
    return rc;
}

pshard_status_t ps_coord_store_remove(ps_rpc_channel_t *ch, const char *key, int64_t timeout_ms,
                                      char *err, size_t errlen)
{
    Pshard__StoreDeleteRequest req = PSHARD__STORE_DELETE_REQUEST__INIT;
    req.key = (char *)key;
    return ps_coord_rpc_store_delete(ch, &req, NULL, timeout_ms, err, errlen);
}

pshard_status_t ps_coord_store_await(ps_rpc_channel_t *ch, const char *const *keys, size_t n,
                                     int64_t wait_ms, Pshard__StoreWaitResponse **values, char *err,
                                     size_t errlen)
{
    Pshard__StoreWaitRequest req = PSHARD__STORE_WAIT_REQUEST__INIT;
    req.keys = (char **)keys;
    req.n_keys = n;
    req.timeout_ms = wait_ms;
    return ps_coord_rpc_store_wait(ch, &req, values, wait_ms + 5000, err, errlen);
}

struct ps_coord_lease {
    ps_coord_lease_config_t cfg;
    char *name, *address, *node, *device;
    pthread_t thread;
    bool started;
    pthread_mutex_t mu; /* guards the fields below */
    pthread_cond_t cv;
    bool stop;
    bool poked; /* ps_coord_lease_poke: heartbeat at once */
    char member_id[64], lease_key[64];
    int64_t heartbeat_ms;
    uint64_t generation;
    bool seen_generation;
    bool last_ok;
    bool wait_first; /* registered before the thread started: its first heartbeat waits */
};

/* One Register under the lease's name, with its key when it has one (taking over its own
 * earlier registration). */
static pshard_status_t lease_register(ps_coord_lease_t *l, Pshard__MemberView **view, char *err,
                                      size_t errlen)
{
    Pshard__RegisterRequest req = PSHARD__REGISTER_REQUEST__INIT;
    req.role = l->cfg.role;
    req.name = l->name;
    req.address = l->address;
    req.node = l->node;
    req.device = l->device;
    char key[64];
    pthread_mutex_lock(&l->mu);
    ps_strlcpy(key, l->lease_key, sizeof(key));
    pthread_mutex_unlock(&l->mu);
    req.lease_key = key;
    pshard_status_t rc = ps_coord_rpc_register(l->cfg.channel, &req, view, 5000, err, errlen);
    if (rc == PSHARD_OK) {
        pthread_mutex_lock(&l->mu);
        ps_strlcpy(l->member_id, (*view)->member_id, sizeof(l->member_id));
        ps_strlcpy(l->lease_key, (*view)->lease_key ? (*view)->lease_key : "",
                   sizeof(l->lease_key));
        l->heartbeat_ms = (*view)->heartbeat_ms > 0 ? (*view)->heartbeat_ms : 1000;
        pthread_mutex_unlock(&l->mu);
    }
    return rc;
}

/* Waits ms (or until stopped), calling on_wait about every 100 ms. False once stopped. */
static bool lease_wait(ps_coord_lease_t *l, int64_t ms, bool last_ok)
{
    int64_t end = ps_now_ns() + ms * 1000000;
    pthread_mutex_lock(&l->mu);
    while (!l->stop) {
        int64_t left = end - ps_now_ns();
        if (left <= 0)
            break;
        int64_t slice = left < 100000000 ? left : 100000000;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int64_t ns = ts.tv_nsec + slice;
        ts.tv_sec += ns / 1000000000;
        ts.tv_nsec = ns % 1000000000;
        pthread_cond_timedwait(&l->cv, &l->mu, &ts);
        if (l->stop)
            break;
        if (l->poked && last_ok) { /* news for the coordinator: heartbeat now */
            l->poked = false;
            break;
        }
        if (l->cfg.on_wait) {
            pthread_mutex_unlock(&l->mu);
            l->cfg.on_wait(l->cfg.ctx, last_ok);
            pthread_mutex_lock(&l->mu);
        }
    }
    bool go_on = !l->stop;
    pthread_mutex_unlock(&l->mu);
    return go_on;
}

static void *lease_main(void *arg)
{
    ps_coord_lease_t *l = arg;
    if (l->wait_first && !lease_wait(l, l->heartbeat_ms, l->last_ok))
        return NULL;
    for (;;) {
        pthread_mutex_lock(&l->mu);
        bool stop = l->stop, have_id = l->member_id[0] != '\0';
        char id[64], key[64];
        ps_strlcpy(id, l->member_id, sizeof(id));
        ps_strlcpy(key, l->lease_key, sizeof(key));
        int64_t every = l->heartbeat_ms;
        pthread_mutex_unlock(&l->mu);
        if (stop)
            break;
        char err[PSHARD_ERRLEN] = "";
        Pshard__MemberView *view = NULL;
        pshard_status_t rc;
        if (!have_id) {
            rc = lease_register(l, &view, err, sizeof(err));
        } else {
            Pshard__HeartbeatRequest req = PSHARD__HEARTBEAT_REQUEST__INIT;
            req.member_id = id;
            req.lease_key = key;
            char why[COORD_REASON_LEN] = "";
            if (l->cfg.health)
                l->cfg.health(l->cfg.ctx, why, sizeof(why));
            req.not_serving = why[0] != '\0';
            req.not_serving_reason = why;
            Pshard__StepSummary steps = PSHARD__STEP_SUMMARY__INIT;
            if (l->cfg.steps && l->cfg.steps(l->cfg.ctx, &steps))
                req.steps = &steps;
            int64_t timeout =
                l->cfg.heartbeat_timeout_ms > 0 ? l->cfg.heartbeat_timeout_ms : 2 * every;
            rc = ps_coord_rpc_heartbeat(l->cfg.channel, &req, &view, timeout, err, sizeof(err));
            if (rc == PSHARD_ERR_NOT_FOUND) {
                pthread_mutex_lock(&l->mu);
                l->member_id[0] = '\0'; /* forgotten: register again at the next attempt */
                pthread_mutex_unlock(&l->mu);
            }
        }
        ps_coord_lease_event_t ev = {.rc = rc,
                                     .err = err,
                                     .view = view,
                                     .registered = !have_id,
                                     .member_id = id,
                                     .lease_key = key};
        pthread_mutex_lock(&l->mu);
        ps_strlcpy(id, l->member_id, sizeof(id));
        ps_strlcpy(key, l->lease_key, sizeof(key));
        l->last_ok = rc == PSHARD_OK;
        if (view) {
            ev.generation_changed = !l->seen_generation || view->generation != l->generation;
            l->generation = view->generation;
            l->seen_generation = true;
        }
        pthread_mutex_unlock(&l->mu);
        int64_t wait = l->cfg.on_event ? l->cfg.on_event(l->cfg.ctx, &ev) : -1;
        if (view)
            protobuf_c_message_free_unpacked(&view->base, NULL);
        if (!lease_wait(l, wait >= 0 ? wait : every, rc == PSHARD_OK))
            break;
    }
    return NULL;
}

static void lease_free(ps_coord_lease_t *l)
{
    free(l->name);
    free(l->address);
    free(l->node);
    free(l->device);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv);
    free(l);
}

pshard_status_t ps_coord_lease_start(const ps_coord_lease_config_t *cfg, bool register_now,
                                     ps_coord_lease_t **out, char *err, size_t errlen)
{
    *out = NULL;
    ps_coord_lease_t *l = calloc(1, sizeof(*l));
    if (!l)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    l->cfg = *cfg;
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    l->heartbeat_ms = 1000;
    l->name = strdup(cfg->name ? cfg->name : "");
    l->address = strdup(cfg->address ? cfg->address : "");
    l->node = strdup(cfg->node ? cfg->node : "");
    l->device = strdup(cfg->device ? cfg->device : "");
    if (!l->name || !l->address || !l->node || !l->device) {
        lease_free(l);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    pshard_status_t rc = PSHARD_OK;
    if (register_now) {
        Pshard__MemberView *view = NULL;
        rc = lease_register(l, &view, err, errlen);
        if (view) {
            l->generation = view->generation;
            l->seen_generation = true;
            protobuf_c_message_free_unpacked(&view->base, NULL);
        }
        if (rc != PSHARD_OK && rc != PSHARD_ERR_ALREADY_EXISTS) {
            lease_free(l);
            return rc;
        }
        l->last_ok = rc == PSHARD_OK;
        l->wait_first = true;
    }
    if (pthread_create(&l->thread, NULL, lease_main, l) != 0) {
        lease_free(l);
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot start the lease thread");
    }
    l->started = true;
    *out = l;
    return rc;
}

void ps_coord_lease_stop(ps_coord_lease_t *l)
{
    if (!l)
        return;
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    /* A heartbeat waiting on an unreachable coordinator must not hold up the exit. */
    ps_rpc_channel_cancel_calls(l->cfg.channel, "the member is leaving");
    if (l->started)
        pthread_join(l->thread, NULL);
    if (l->member_id[0] && l->last_ok) {
        Pshard__LeaveRequest lv = PSHARD__LEAVE_REQUEST__INIT;
        lv.member_id = l->member_id;
        lv.lease_key = l->lease_key;
        char err[PSHARD_ERRLEN] = "";
        ps_coord_rpc_leave(l->cfg.channel, &lv, NULL, 1000, err, sizeof(err));
    }
    lease_free(l);
}

void ps_coord_lease_poke(ps_coord_lease_t *l)
{
    if (!l)
        return;
    pthread_mutex_lock(&l->mu);
    l->poked = true;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

void ps_coord_lease_member(ps_coord_lease_t *l, char *id, size_t idlen, char *key, size_t keylen)
{
    pthread_mutex_lock(&l->mu);
    if (id)
        ps_strlcpy(id, l->member_id, idlen);
    if (key)
        ps_strlcpy(key, l->lease_key, keylen);
    pthread_mutex_unlock(&l->mu);
}
