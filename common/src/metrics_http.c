/* The /metrics HTTP endpoint: one thread with its own libevent event_base and evhttp server,
 * bound to --metrics-listen. Every scrape asks the service to write its families into a fresh
 * exposition; the service's own threads are never touched, and stop wakes the loop with
 * event_active. */
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/thread.h>

#include "pshard/atomic_file.h"
#include "pshard/log.h"
#include "pshard/metrics.h"
#include "pshard/util.h"

#define MAX_HEADERS_BYTES 8192
#define MAX_BODY_BYTES 1024
#define REQUEST_TIMEOUT_S 10
#define CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

struct ps_metrics_server {
    struct event_base *base;
    struct evhttp *http;
    struct event *stop_ev;
    pthread_t thread;
    bool thread_started;
    int port;
    ps_metrics_collect_fn collect;
    void *arg;
};

static pthread_once_t evthread_once = PTHREAD_ONCE_INIT;
static int evthread_rc;

/* libevent's locking, so that another thread may event_active() our stop event. */
static void evthread_init(void)
{
    evthread_rc = evthread_use_pthreads();
}

static void reply_text(struct evhttp_request *req, int code, const char *reason, const char *text,
                       size_t len)
{
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Content-Type", code == 200 ? CONTENT_TYPE : "text/plain; charset=utf-8");
    evhttp_add_header(h, "Cache-Control", "no-store");
    if (evhttp_request_get_command(req) == EVHTTP_REQ_HEAD) {
        /* GET's Content-Length and no body (libevent 2.1 would send the body after HEAD's
         * headers, which a client then reads as the start of its next response). */
        char n[32];
        snprintf(n, sizeof(n), "%zu", len);
        evhttp_add_header(h, "Content-Length", n);
        evhttp_send_reply(req, code, reason, NULL);
        return;
    }
    struct evbuffer *body = evbuffer_new();
    if (!body) {
        evhttp_send_error(req, 500, "out of memory");
        return;
    }
    evbuffer_add(body, text, len);
    evhttp_send_reply(req, code, reason, body);
    evbuffer_free(body);
}

static void on_request(struct evhttp_request *req, void *arg)
{
    ps_metrics_server_t *m = arg;
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    if (cmd != EVHTTP_REQ_GET && cmd != EVHTTP_REQ_HEAD) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", "GET, HEAD");
        static const char msg[] = "only GET and HEAD\n";
        reply_text(req, 405, "Method Not Allowed", msg, sizeof(msg) - 1);
        return;
    }
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
    const char *path = uri ? evhttp_uri_get_path(uri) : NULL;
    if (!path || strcmp(path, "/metrics") != 0) {
        static const char msg[] = "not found: metrics are at /metrics\n";
        reply_text(req, 404, "Not Found", msg, sizeof(msg) - 1);
        return;
    }
    ps_metrics_t *w = ps_metrics_create();
    if (!w) {
        evhttp_send_error(req, 500, "out of memory");
        return;
    }
    m->collect(m->arg, w);
    const char *error = ps_metrics_error(w);
    if (error[0]) {
        /* A bug in a family, not the scraper's fault: say which, and log it once per scrape. */
        PS_ERROR(PS_SUB_MAIN, "metrics: %s", error);
        char msg[PSHARD_ERRLEN];
        int n = snprintf(msg, sizeof(msg), "metrics error: %s\n", error);
        reply_text(req, 500, "Internal Server Error", msg, n > 0 ? (size_t)n : 0);
    } else {
        size_t len;
        const char *text = ps_metrics_text(w, &len);
        reply_text(req, 200, "OK", text, len);
    }
    ps_metrics_destroy(w);
}

static void on_stop(evutil_socket_t fd, short what, void *arg)
{
    ps_metrics_server_t *m = arg;
    event_base_loopbreak(m->base);
}

static void *metrics_thread_main(void *arg)
{
    ps_metrics_server_t *m = arg;
    event_base_dispatch(m->base);
    return NULL;
}

/* "HOST:PORT" or "[V6]:PORT" into host and port; -1 when it is neither. */
static int split_listen(const char *listen, char *host, size_t hostlen, int *port)
{
    const char *colon = strrchr(listen, ':');
    if (!colon || colon == listen)
        return -1;
    int64_t p;
    if (ps_parse_i64(colon + 1, 0, 65535, &p) != 0)
        return -1;
    const char *h = listen;
    size_t n = (size_t)(colon - listen);
    if (h[0] == '[') {
        if (n < 2 || h[n - 1] != ']')
            return -1;
        h++;
        n -= 2;
    }
    if (n == 0 || n >= hostlen)
        return -1;
    memcpy(host, h, n);
    host[n] = '\0';
    *port = (int)p;
    return 0;
}

ps_metrics_server_t *ps_metrics_server_start(const char *listen, ps_metrics_collect_fn collect,
                                             void *arg, char *err, size_t errlen)
{
    char host[256];
    int port = 0;
    if (!listen || split_listen(listen, host, sizeof(host), &port) != 0) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "--metrics-listen '%s' is not HOST:PORT",
                listen ? listen : "");
        return NULL;
    }
    pthread_once(&evthread_once, evthread_init);
    if (evthread_rc != 0) {
        ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "libevent has no pthreads support");
        return NULL;
    }
    ps_metrics_server_t *m = calloc(1, sizeof(*m));
    if (!m) {
        ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        return NULL;
    }
    m->collect = collect;
    m->arg = arg;
    m->base = event_base_new();
    m->http = m->base ? evhttp_new(m->base) : NULL;
    m->stop_ev = m->base ? event_new(m->base, -1, 0, on_stop, m) : NULL;
    if (!m->http || !m->stop_ev) {
        ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "cannot create the metrics HTTP server");
        goto fail;
    }
    evhttp_set_max_headers_size(m->http, MAX_HEADERS_BYTES);
    evhttp_set_max_body_size(m->http, MAX_BODY_BYTES);
    evhttp_set_timeout(m->http, REQUEST_TIMEOUT_S);
    /* Let every method reach on_request, which answers 405 with Allow for all but GET/HEAD. */
    evhttp_set_allowed_methods(m->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                            EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE |
                                            EVHTTP_REQ_OPTIONS | EVHTTP_REQ_TRACE |
                                            EVHTTP_REQ_CONNECT | EVHTTP_REQ_PATCH);
    evhttp_set_gencb(m->http, on_request, m);
    struct evhttp_bound_socket *bs =
        evhttp_bind_socket_with_handle(m->http, host, (ev_uint16_t)port);
    if (!bs) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "cannot listen for metrics on '%s' (bad address, or the port is in use)", listen);
        goto fail;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (getsockname(evhttp_bound_socket_get_fd(bs), (struct sockaddr *)&ss, &sl) != 0) {
        ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "getsockname: %s", strerror(errno));
        goto fail;
    }
    m->port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                       : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    if (pthread_create(&m->thread, NULL, metrics_thread_main, m) != 0) {
        ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot start the metrics thread");
        goto fail;
    }
    m->thread_started = true;
    PS_INFO(PS_SUB_MAIN, "metrics on http://%s:%d/metrics", host, m->port);
    return m;

fail:
    ps_metrics_server_stop(m);
    return NULL;
}

int ps_metrics_server_port(const ps_metrics_server_t *m)
{
    return m->port;
}

void ps_metrics_server_stop(ps_metrics_server_t *m)
{
    if (!m)
        return;
    if (m->thread_started) {
        event_active(m->stop_ev, EV_READ, 0);
        pthread_join(m->thread, NULL);
    }
    if (m->stop_ev)
        event_free(m->stop_ev);
    if (m->http)
        evhttp_free(m->http);
    if (m->base)
        event_base_free(m->base);
    free(m);
}

int ps_announce_metrics(const char *prog, const char *listen, int port, const char *port_file)
{
    char err[PATH_MAX + 128] = "";
    if (port_file && ps_write_port_file(port_file, port, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "%s: --metrics-port-file: %s\n", prog, err);
        return -1;
    }
    char host[256];
    int unused;
    if (split_listen(listen, host, sizeof(host), &unused) != 0)
        ps_strlcpy(host, "?", sizeof(host));
    bool v6 = strchr(host, ':') != NULL;
    printf("metrics on http://%s%s%s:%d/metrics\n", v6 ? "[" : "", host, v6 ? "]" : "", port);
    fflush(stdout);
    return 0;
}
