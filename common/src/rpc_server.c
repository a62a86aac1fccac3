/* The gRPC server loop: creating the server and its listening port, the method table, the
 * completion-queue threads that take each event to its call (rpc_call.c runs the call's life),
 * accepting new calls, the worker pool, and shutdown in gRPC's order: shutdown_and_notify,
 * cancel all calls, drain, shut the queue down, drain to GRPC_QUEUE_SHUTDOWN, destroy. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include "pshard/log.h"
#include "pshard/queue.h"
#include "pshard/rpc.h"
#include "pshard/util.h"
#include "rpc_call.h"
#include "rpc_internal.h"

#define REQUESTS_OUTSTANDING 16
/* Requests kept outstanding per registered method (see method_entry_t.registered). */
#define REGISTERED_OUTSTANDING 2

static void request_new_call(ps_rpc_server_t *srv);
static void request_registered_call(ps_rpc_server_t *srv, method_entry_t *e);

/* --------------------------------------------------------------------------------------- */
/* Accepting calls, the completion-queue threads and the worker pool                        */

static void *worker_main(void *arg)
{
    ps_rpc_server_t *srv = arg;
    ps_qnode_t *n;
    while ((n = ps_workq_take(&srv->work)) != NULL) {
        ps_rpc_call_t *c = PS_CONTAINER_OF(n, ps_rpc_call_t, work_node);
        atomic_fetch_add(&srv->work_busy, 1);
        ProtobufCMessage *req = c->pending_req;
        c->pending_req = NULL;
        rpc_call_run_handler(c, req);
        atomic_fetch_sub(&srv->work_busy, 1);
    }
    return NULL;
}

static method_entry_t *find_method(ps_rpc_server_t *srv, const grpc_slice path)
{
    for (size_t i = 0; i < srv->nmethods; i++) {
        if (grpc_slice_str_cmp(path, srv->methods[i].m.path) == 0)
            return &srv->methods[i];
    }
    return NULL;
}

/* Checks "authorization: Bearer TOKEN" against the cluster token in constant time. */
static bool token_ok(ps_rpc_server_t *srv, const grpc_metadata_array *md)
{
    static const char prefix[] = "Bearer ";
    for (size_t i = 0; i < md->count; i++) {
        if (grpc_slice_str_cmp(md->metadata[i].key, "authorization") != 0)
            continue;
        const uint8_t *v = GRPC_SLICE_START_PTR(md->metadata[i].value);
        size_t n = GRPC_SLICE_LENGTH(md->metadata[i].value);
        if (n < sizeof(prefix) - 1 || memcmp(v, prefix, sizeof(prefix) - 1) != 0)
            return false;
        return ps_const_time_eq(v + sizeof(prefix) - 1, n - (sizeof(prefix) - 1), srv->token,
                                srv->token_len);
    }
    return false;
}

static void read_identity(ps_rpc_call_t *c)
{
    grpc_auth_context *ac = grpc_call_auth_context(c->call);
    if (!ac)
        return;
    if (grpc_auth_context_peer_is_authenticated(ac)) {
        grpc_auth_property_iterator it = grpc_auth_context_peer_identity(ac);
        const grpc_auth_property *p = grpc_auth_property_iterator_next(&it);
        if (p && p->value)
            c->identity = strndup(p->value, p->value_length);
    }
    grpc_auth_context_release(ac);
}

static void on_new(ps_rpc_call_t *c, bool success)
{
    ps_rpc_server_t *srv = c->srv;
    if (!success) {
        /* Shutdown: the pending request will never carry a call. */
        rpc_call_unref(c);
        return;
    }
    pthread_mutex_lock(&srv->mu);
    bool shutting = srv->shutting_down;
    pthread_mutex_unlock(&srv->mu);
    method_entry_t *reg = c->registered;
    if (!shutting) {
        if (reg)
            request_registered_call(srv, reg);
        else
            request_new_call(srv);
    }

    c->path = reg ? strdup(reg->m.path)
                  : strndup((const char *)GRPC_SLICE_START_PTR(c->details.method),
                            GRPC_SLICE_LENGTH(c->details.method));
    c->peer = grpc_call_get_peer(c->call);
    rpc_call_acct_get(c);
    gpr_timespec deadline = reg ? c->reg_deadline : c->details.deadline;
    if (gpr_time_cmp(deadline, gpr_inf_future(deadline.clock_type)) != 0) {
        gpr_timespec now = gpr_now(deadline.clock_type);
        gpr_timespec left = gpr_time_sub(deadline, now);
        int64_t left_ns = (int64_t)left.tv_sec * 1000000000 + left.tv_nsec;
        c->deadline_ns = ps_now_ns() + left_ns;
    }
    read_identity(c);

    pthread_mutex_lock(&c->mu);
    grpc_op close_op;
    memset(&close_op, 0, sizeof(close_op));
    close_op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    close_op.data.recv_close_on_server.cancelled = &c->close_cancelled;
    rpc_call_start_batch_locked(c, &close_op, 1, &c->t_close);
    pthread_mutex_unlock(&c->mu);

    c->method = reg ? reg : find_method(srv, c->details.method);
    if (!c->method) {
        char msg[PSHARD_ERRLEN];
        snprintf(msg, sizeof(msg), "unknown method %s", c->path ? c->path : "?");
        PS_DEBUG(PS_SUB_RPC, "%s (from %s)", msg, c->peer ? c->peer : "?");
        rpc_call_finalize(c, GRPC_STATUS_UNIMPLEMENTED, msg, NULL);
        return;
    }
    if (srv->token && !(c->method->m.flags & PS_RPC_OPEN) && !token_ok(srv, &c->md)) {
        atomic_fetch_add(&c->method->calls, 1);
        PS_INFO(PS_SUB_RPC, "%s from %s refused: missing or wrong cluster token", c->path,
                c->peer ? c->peer : "?");
        rpc_call_finalize(c, GRPC_STATUS_UNAUTHENTICATED,
                          "missing or wrong cluster token (send 'authorization: Bearer <token>')",
                          NULL);
        return;
    }
    if (reg) {
        /* The request came with the call. A unary reply carries the headers with the status;
         * a stream sends them now, as the generic path does with its receive. */
        grpc_byte_buffer *bb = c->recv_bb;
        c->recv_bb = NULL;
        if (reg->m.flags & PS_RPC_STREAM) {
            pthread_mutex_lock(&c->mu);
            grpc_op op;
            memset(&op, 0, sizeof(op));
            op.op = GRPC_OP_SEND_INITIAL_METADATA;
            c->initial_md_sent = true;
            rpc_call_start_batch_locked(c, &op, 1, &c->t_final);
            pthread_mutex_unlock(&c->mu);
        }
        rpc_call_take_request(c, bb);
        return;
    }
    pthread_mutex_lock(&c->mu);
    rpc_call_start_recv_locked(c);
    pthread_mutex_unlock(&c->mu);
}

static void *cq_thread_main(void *arg)
{
    ps_rpc_server_t *srv = arg;
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            return NULL;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        rpc_tag_t *tag = ev.tag;
        switch (tag->kind) {
        case TAG_NEW:
            on_new(tag->call, ev.success != 0);
            break;
        case TAG_RECV:
            rpc_call_on_recv(tag->call, ev.success != 0);
            break;
        case TAG_SEND:
            rpc_call_on_send(tag->call, ev.success != 0);
            break;
        case TAG_CLOSE:
            rpc_call_on_close(tag->call);
            break;
        case TAG_FINAL:
            rpc_call_unref(tag->call);
            break;
        case TAG_SHUTDOWN:
            pthread_mutex_lock(&srv->mu);
            srv->shutdown_notified = true;
            pthread_cond_broadcast(&srv->cv);
            pthread_mutex_unlock(&srv->mu);
            break;
        }
    }
}

static void request_new_call(ps_rpc_server_t *srv)
{
    ps_rpc_call_t *c = rpc_call_alloc(srv);
    if (!c) {
        PS_ERROR(PS_SUB_RPC, "out of memory accepting calls");
        return;
    }
    grpc_call_error e = grpc_server_request_call(srv->server, &c->call, &c->details, &c->md,
                                                 srv->cq, srv->cq, &c->t_new);
    if (e != GRPC_CALL_OK) {
        PS_ERROR(PS_SUB_RPC, "grpc_server_request_call failed: %d", (int)e);
        rpc_call_unref(c);
    }
}

static void request_registered_call(ps_rpc_server_t *srv, method_entry_t *e)
{
    ps_rpc_call_t *c = rpc_call_alloc(srv);
    if (!c) {
        PS_ERROR(PS_SUB_RPC, "out of memory accepting calls");
        return;
    }
    c->registered = e;
    grpc_call_error err =
        grpc_server_request_registered_call(srv->server, e->registered, &c->call, &c->reg_deadline,
                                            &c->md, &c->recv_bb, srv->cq, srv->cq, &c->t_new);
    if (err != GRPC_CALL_OK) {
        PS_ERROR(PS_SUB_RPC, "grpc_server_request_registered_call(%s) failed: %d", e->m.path,
                 (int)err);
        rpc_call_unref(c);
    }
}

/* --------------------------------------------------------------------------------------- */
/* Server lifecycle                                                                         */

static grpc_server_credentials *server_credentials(const ps_rpc_server_config_t *cfg, char *err,
                                                   size_t errlen)
{
    if (!cfg->tls_cert_file && !cfg->tls_key_file && !cfg->tls_client_ca_file)
        return grpc_insecure_server_credentials_create();
    if (!cfg->tls_cert_file || !cfg->tls_key_file) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "TLS needs both a certificate (--tls-cert) and a key (--tls-key)");
        return NULL;
    }
    char *cert = ps_read_file(cfg->tls_cert_file, false, 1 << 20, NULL, err, errlen);
    char *key = cert ? ps_read_file(cfg->tls_key_file, false, 1 << 20, NULL, err, errlen) : NULL;
    char *ca = NULL;
    if (key && cfg->tls_client_ca_file)
        ca = ps_read_file(cfg->tls_client_ca_file, false, 1 << 20, NULL, err, errlen);
    grpc_server_credentials *creds = NULL;
    if (cert && key && (ca || !cfg->tls_client_ca_file)) {
        grpc_ssl_pem_key_cert_pair pair = {key, cert};
        creds = grpc_ssl_server_credentials_create_ex(
            ca, &pair, 1,
            ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
               : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
            NULL);
        if (!creds)
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                    "could not build TLS credentials from %s and %s", cfg->tls_cert_file,
                    cfg->tls_key_file);
    }
    free(cert);
    free(key);
    free(ca);
    return creds;
}

static pshard_status_t add_method(ps_rpc_server_t *srv, const ps_rpc_method_t *m)
{
    for (size_t i = 0; i < srv->nmethods; i++) {
        if (strcmp(srv->methods[i].m.path, m->path) == 0)
            return PSHARD_ERR_INVALID_ARGUMENT;
    }
    if (srv->nmethods == srv->cap_methods) {
        size_t cap = srv->cap_methods ? srv->cap_methods * 2 : 16;
        method_entry_t *p = realloc(srv->methods, cap * sizeof(*p));
        if (!p)
            return PSHARD_ERR_NO_MEMORY;
        srv->methods = p;
        srv->cap_methods = cap;
    }
    method_entry_t *e = &srv->methods[srv->nmethods++];
    e->m = *m;
    e->registered = NULL; /* set at start, for the methods that are registered */
    atomic_init(&e->calls, 0);
    atomic_init(&e->errors, 0);
    return PSHARD_OK;
}

ps_rpc_server_t *ps_rpc_server_create(const ps_rpc_server_config_t *cfg, char *err, size_t errlen)
{
    ps_rpc_server_t *srv = calloc(1, sizeof(*srv));
    if (!srv) {
        ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        return NULL;
    }
    grpc_init();
    pthread_mutex_init(&srv->mu, NULL);
    pthread_cond_init(&srv->cv, NULL);
    ps_workq_init(&srv->work);
    pthread_mutex_init(&srv->acct_mu, NULL);
    srv->shutdown_tag = (rpc_tag_t){TAG_SHUTDOWN, NULL};
    srv->max_message_bytes = cfg->max_message_bytes > 0 ? cfg->max_message_bytes : (4 << 20);
    srv->max_stream_queue =
        cfg->max_stream_queue_bytes > 0 ? (size_t)cfg->max_stream_queue_bytes : (8u << 20);
    srv->max_conn_queue = cfg->max_conn_queue_bytes > 0 ? (size_t)cfg->max_conn_queue_bytes
                                                        : 4 * srv->max_stream_queue;
    srv->max_total_queue = cfg->max_total_queue_bytes > 0 ? (size_t)cfg->max_total_queue_bytes
                                                          : 32 * srv->max_stream_queue;
    srv->n_workers = cfg->worker_threads > 0 ? cfg->worker_threads : 4;
    srv->n_cq_threads = cfg->cq_threads > 0 ? cfg->cq_threads : 1;
    if (cfg->token && *cfg->token) {
        const char *why = ps_token_problem(cfg->token, strlen(cfg->token));
        if (why) {
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "the cluster token %s; %s", why,
                    PS_TOKEN_HOWTO);
            goto fail;
        }
        srv->token = strdup(cfg->token);
        srv->token_len = strlen(cfg->token);
    }

    grpc_arg args[4];
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = (int)srv->max_message_bytes;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[1].value.integer = -1;
    /* Let clients keep idle connections alive with pings (members heartbeat for hours). */
    args[2].type = GRPC_ARG_INTEGER;
    args[2].key = GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS;
    args[2].value.integer = 1000;
    args[3].type = GRPC_ARG_INTEGER;
    args[3].key = GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS;
    args[3].value.integer = 1;
    grpc_channel_args chargs = {PS_ARRAY_LEN(args), args};
    srv->server = grpc_server_create(&chargs, NULL);
    srv->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(srv->server, srv->cq, NULL);

    grpc_server_credentials *creds = server_credentials(cfg, err, errlen);
    if (!creds)
        goto fail;
    srv->port = grpc_server_add_http2_port(srv->server, cfg->listen, creds);
    grpc_server_credentials_release(creds);
    if (srv->port <= 0) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "cannot listen on '%s' (bad address, or the port is in use)", cfg->listen);
        goto fail;
    }

    srv->health = ps_health_create();
    srv->reflection = ps_reflection_create(ps_descriptor_set, ps_descriptor_set_len, err, errlen);
    if (!srv->health || !srv->reflection)
        goto fail;
    ps_health_methods(srv->health, &srv->builtin[0]);
    ps_reflection_methods(srv->reflection, &srv->builtin[2]);
    for (size_t i = 0; i < 4; i++) {
        if (add_method(srv, &srv->builtin[i]) != PSHARD_OK) {
            ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
            goto fail;
        }
    }
    return srv;

fail:
    ps_rpc_server_destroy(srv);
    return NULL;
}

pshard_status_t ps_rpc_server_add_methods(ps_rpc_server_t *srv, const ps_rpc_method_t *methods,
                                          size_t n)
{
    if (srv->started)
        return PSHARD_ERR_INVALID_ARGUMENT;
    for (size_t i = 0; i < n; i++)
        PS_CHECK(add_method(srv, &methods[i]));
    return PSHARD_OK;
}

void ps_rpc_server_set_shutdown_hook(ps_rpc_server_t *srv, void (*fn)(void *arg), void *arg)
{
    srv->shutdown_hook = fn;
    srv->shutdown_hook_arg = arg;
}

/* Every distinct "pkg.Service" among the method paths goes to reflection's list_services. */
static void register_service_names(ps_rpc_server_t *srv)
{
    for (size_t i = 0; i < srv->nmethods; i++) {
        const char *p = srv->methods[i].m.path + 1;
        const char *slash = strchr(p, '/');
        if (!slash)
            continue;
        size_t len = (size_t)(slash - p);
        bool seen = false;
        for (size_t j = 0; j < i && !seen; j++) {
            const char *q = srv->methods[j].m.path + 1;
            seen = strncmp(p, q, len) == 0 && q[len] == '/';
        }
        if (!seen) {
            char name[256];
            snprintf(name, sizeof(name), "%.*s", (int)len, p);
            ps_reflection_add_service(srv->reflection, name);
        }
    }
}

int ps_rpc_server_start(ps_rpc_server_t *srv)
{
    if (srv->started)
        return srv->port;
    register_service_names(srv);
    for (size_t i = 0; i < srv->nmethods; i++) {
        method_entry_t *e = &srv->methods[i];
        if (!(e->m.flags & PS_RPC_BIDI))
            e->registered = grpc_server_register_method(
                srv->server, e->m.path, NULL, GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    }
    grpc_server_start(srv->server);
    srv->started = true;
    srv->cq_threads = calloc((size_t)srv->n_cq_threads, sizeof(pthread_t));
    srv->workers = calloc((size_t)srv->n_workers, sizeof(pthread_t));
    if (!srv->cq_threads || !srv->workers)
        return -1;
    for (int i = 0; i < srv->n_cq_threads; i++)
        pthread_create(&srv->cq_threads[i], NULL, cq_thread_main, srv);
    for (int i = 0; i < srv->n_workers; i++)
        pthread_create(&srv->workers[i], NULL, worker_main, srv);
    for (int i = 0; i < REQUESTS_OUTSTANDING; i++)
        request_new_call(srv);
    for (size_t i = 0; i < srv->nmethods; i++) {
        for (int k = 0; k < REGISTERED_OUTSTANDING && srv->methods[i].registered; k++)
            request_registered_call(srv, &srv->methods[i]);
    }
    ps_health_set(srv->health, "", 1);
    return srv->port;
}

int ps_rpc_server_port(const ps_rpc_server_t *srv)
{
    return srv->port;
}

void ps_rpc_server_set_health(ps_rpc_server_t *srv, const char *service, int status)
{
    ps_health_set(srv->health, service, status);
}

void ps_rpc_server_counters(ps_rpc_server_t *srv,
                            void (*fn)(void *arg, const char *path, uint64_t calls,
                                       uint64_t errors),
                            void *arg)
{
    for (size_t i = 0; i < srv->nmethods; i++)
        fn(arg, srv->methods[i].m.path, atomic_load(&srv->methods[i].calls),
           atomic_load(&srv->methods[i].errors));
}

void ps_rpc_server_load(ps_rpc_server_t *srv, ps_rpc_load_t *out)
{
    int64_t now = ps_now_ns();
    out->workers = srv->n_workers;
    out->busy = atomic_load(&srv->work_busy);
    pthread_mutex_lock(&srv->work.mu);
    out->queued = srv->work.q.len;
    const ps_rpc_call_t *oldest = PS_QUEUE_PEEK(&srv->work.q, ps_rpc_call_t, work_node);
    out->oldest_wait_ns = oldest ? now - oldest->queued_ns : 0;
    pthread_mutex_unlock(&srv->work.mu);
    pthread_mutex_lock(&srv->acct_mu);
    out->send_queued_bytes = srv->queued_total;
    out->send_queued_peak_bytes = srv->queued_peak;
    pthread_mutex_unlock(&srv->acct_mu);
}

void ps_rpc_server_shutdown(ps_rpc_server_t *srv)
{
    pthread_mutex_lock(&srv->mu);
    if (!srv->started || srv->shutting_down) {
        while (srv->started && !srv->shutdown_complete)
            pthread_cond_wait(&srv->cv, &srv->mu);
        pthread_mutex_unlock(&srv->mu);
        return;
    }
    srv->shutting_down = true;
    pthread_mutex_unlock(&srv->mu);

    ps_health_shutdown(srv->health);
    grpc_server_shutdown_and_notify(srv->server, srv->cq, &srv->shutdown_tag);
    grpc_server_cancel_all_calls(srv->server);
    if (srv->shutdown_hook)
        srv->shutdown_hook(srv->shutdown_hook_arg);

    /* Wait for the core's shutdown notice and for every call struct to be released. A service
     * that never finishes a call it holds would block us; give up after 10 s and say so. */
    int64_t give_up_ns = ps_now_ns() + 10 * 1000000000LL;
    pthread_mutex_lock(&srv->mu);
    while (!srv->shutdown_notified || srv->nlive > 0) {
        struct timespec ts = rpc_realtime_in(50 * 1000000LL);
        pthread_cond_timedwait(&srv->cv, &srv->mu, &ts);
        if (ps_now_ns() > give_up_ns) {
            PS_ERROR(PS_SUB_RPC, "shutdown: %zu calls were never finished; exiting anyway",
                     srv->nlive);
            break;
        }
    }
    pthread_mutex_unlock(&srv->mu);

    ps_workq_close(&srv->work);
    for (int i = 0; i < srv->n_workers; i++)
        pthread_join(srv->workers[i], NULL);

    grpc_completion_queue_shutdown(srv->cq);
    for (int i = 0; i < srv->n_cq_threads; i++)
        pthread_join(srv->cq_threads[i], NULL);

    pthread_mutex_lock(&srv->mu);
    srv->shutdown_complete = true;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
}

void ps_rpc_server_destroy(ps_rpc_server_t *srv)
{
    if (!srv)
        return;
    if (srv->started) {
        ps_rpc_server_shutdown(srv);
    } else if (srv->cq) {
        /* Never started: no calls exist; drain the queue to its shutdown event. */
        grpc_completion_queue_shutdown(srv->cq);
        while (grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN) {
        }
    }
    if (srv->server)
        grpc_server_destroy(srv->server);
    if (srv->cq)
        grpc_completion_queue_destroy(srv->cq);
    ps_health_destroy(srv->health);
    ps_reflection_destroy(srv->reflection);
    free(srv->methods);
    free(srv->cq_threads);
    free(srv->workers);
    free(srv->token);
    pthread_mutex_destroy(&srv->mu);
    pthread_cond_destroy(&srv->cv);
    ps_workq_destroy(&srv->work);
    pthread_mutex_destroy(&srv->acct_mu);
    free(srv);
    grpc_shutdown();
}

void ps_rpc_block_signals(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
}

int ps_rpc_wait_for_signal(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    int sig = 0;
    while (sigwait(&set, &sig) != 0) {
    }
    return sig;
}
