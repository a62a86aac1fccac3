/* grpc.health.v1.Health: Check answers the status of a service name ("" is the whole
 * server), Watch streams every change of it. Kubernetes' native gRPC probes and grpcurl use
 * this; it needs no cluster token. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "pshard/log.h"
#include "pshard/util.h"
#include "rpc_internal.h"

#define HEALTH_SERVING GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
#define HEALTH_NOT_SERVING GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING
#define HEALTH_UNKNOWN_SERVICE                                                                     \
    GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN
#define HEALTH_SERVICE_MAX 256

typedef struct health_entry {
    struct health_entry *next;
    char *service;
    int status;
} health_entry_t;

typedef struct watcher {
    struct watcher *next;
    ps_rpc_call_t *call;
    char *service;
    int last_sent;
} watcher_t;

struct ps_health {
    pthread_mutex_t mu;
    health_entry_t *entries;
    watcher_t *watchers;
    bool shut;
};

ps_health_t *ps_health_create(void)
{
    ps_health_t *h = calloc(1, sizeof(*h));
    if (!h)
        return NULL;
    pthread_mutex_init(&h->mu, NULL);
    return h;
}

void ps_health_destroy(ps_health_t *h)
{
    if (!h)
        return;
    for (health_entry_t *e = h->entries; e;) {
        health_entry_t *next = e->next;
        free(e->service);
        free(e);
        e = next;
    }
    /* Watchers are finished by ps_health_shutdown; anything left is a bug, but free it. */
    for (watcher_t *w = h->watchers; w;) {
        watcher_t *next = w->next;
        free(w->service);
        free(w);
        w = next;
    }
    pthread_mutex_destroy(&h->mu);
    free(h);
}

static health_entry_t *find_locked(ps_health_t *h, const char *service)
{
    for (health_entry_t *e = h->entries; e; e = e->next) {
        if (strcmp(e->service, service) == 0)
            return e;
    }
    return NULL;
}

static void send_status(ps_rpc_call_t *call, int status)
{
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = status;
    ps_rpc_call_send(call, &resp.base);
}

static void notify_locked(ps_health_t *h, const char *service, int status)
{
    for (watcher_t *w = h->watchers; w; w = w->next) {
        if (strcmp(w->service, service) == 0 && w->last_sent != status) {
            w->last_sent = status;
            send_status(w->call, status);
        }
    }
}

void ps_health_set(ps_health_t *h, const char *service, int status)
{
    pthread_mutex_lock(&h->mu);
    if (h->shut) {
        pthread_mutex_unlock(&h->mu);
        return;
    }
    health_entry_t *e = find_locked(h, service);
    if (!e) {
        e = calloc(1, sizeof(*e));
        if (!e || !(e->service = strdup(service))) {
            free(e);
            pthread_mutex_unlock(&h->mu);
            PS_ERROR(PS_SUB_RPC, "health: out of memory");
            return;
        }
        e->next = h->entries;
        h->entries = e;
    }
    if (e->status != status) {
        e->status = status;
        notify_locked(h, service, status);
    }
    pthread_mutex_unlock(&h->mu);
}

void ps_health_shutdown(ps_health_t *h)
{
    pthread_mutex_lock(&h->mu);
    h->shut = true;
    for (health_entry_t *e = h->entries; e; e = e->next) {
        e->status = HEALTH_NOT_SERVING;
        notify_locked(h, e->service, HEALTH_NOT_SERVING);
    }
    watcher_t *list = h->watchers;
    h->watchers = NULL;
    pthread_mutex_unlock(&h->mu);
    while (list) {
        watcher_t *next = list->next;
        ps_rpc_call_finish(list->call);
        free(list->service);
        free(list);
        list = next;
    }
}

static const char *checked_service(ps_rpc_call_t *call, const ProtobufCMessage *request)
{
    const Grpc__Health__V1__HealthCheckRequest *req =
        (const Grpc__Health__V1__HealthCheckRequest *)request;
    const char *service = req->service ? req->service : "";
    if (strlen(service) > HEALTH_SERVICE_MAX) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                         "service name is %zu bytes; the limit is %d", strlen(service),
                         HEALTH_SERVICE_MAX);
        return NULL;
    }
    return service;
}

static void health_check(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    ps_health_t *h = ctx;
    const char *service = checked_service(call, request);
    if (!service)
        return;
    pthread_mutex_lock(&h->mu);
    health_entry_t *e = find_locked(h, service);
    int status = e ? e->status : -1;
    pthread_mutex_unlock(&h->mu);
    if (status < 0) {
        ps_rpc_call_fail(call, PSHARD_ERR_NOT_FOUND, "unknown service '%s'", service);
        return;
    }
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = status;
    ps_rpc_call_reply(call, &resp.base);
}

static void watch_cancelled(void *arg, ps_rpc_call_t *call)
{
    ps_health_t *h = arg;
    pthread_mutex_lock(&h->mu);
    watcher_t **pp = &h->watchers;
    watcher_t *found = NULL;
    while (*pp) {
        if ((*pp)->call == call) {
            found = *pp;
            *pp = found->next;
            break;
        }
        pp = &(*pp)->next;
    }
    pthread_mutex_unlock(&h->mu);
    if (found) {
        ps_rpc_call_finish(call);
        free(found->service);
        free(found);
    }
}

static void health_watch(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    ps_health_t *h = ctx;
    const char *service = checked_service(call, request);
    if (!service)
        return;
    watcher_t *w = calloc(1, sizeof(*w));
    if (!w || !(w->service = strdup(service))) {
        free(w);
        ps_rpc_call_fail(call, PSHARD_ERR_NO_MEMORY, "out of memory");
        return;
    }
    w->call = call;
    pthread_mutex_lock(&h->mu);
    if (h->shut) {
        pthread_mutex_unlock(&h->mu);
        free(w->service);
        free(w);
        send_status(call, HEALTH_NOT_SERVING);
        ps_rpc_call_finish(call);
        return;
    }
    health_entry_t *e = find_locked(h, service);
    w->last_sent = e ? e->status : HEALTH_UNKNOWN_SERVICE;
    send_status(call, w->last_sent);
    w->next = h->watchers;
    h->watchers = w;
    pthread_mutex_unlock(&h->mu);
    ps_rpc_call_on_cancel(call, watch_cancelled, h);
}

void ps_health_methods(ps_health_t *h, ps_rpc_method_t out[2])
{
    out[0] = (ps_rpc_method_t){"/grpc.health.v1.Health/Check",
                               &grpc__health__v1__health_check_request__descriptor, health_check,
                               PS_RPC_INLINE | PS_RPC_OPEN, h};
    out[1] = (ps_rpc_method_t){"/grpc.health.v1.Health/Watch",
                               &grpc__health__v1__health_check_request__descriptor, health_watch,
                               PS_RPC_STREAM | PS_RPC_INLINE | PS_RPC_OPEN, h};
}
