/* The /metrics HTTP endpoint: one thread with its own libevent event_base serving HTTP/1.x on
 * --metrics-listen with bufferevents of its own (not evhttp, whose 2.1 version cannot bound
 * its connections). Every scrape asks the service to write its families into a fresh
 * exposition; the service's own threads are never touched, and stop wakes the loop with
 * event_active. The endpoint is unauthenticated, so it is bounded: at most MAX_CONNS
 * connections at once (more are closed at accept, leaving the process's descriptors to gRPC),
 * each closed CONN_DEADLINE_S after it was accepted whatever it sends (a client trickling a byte
 * at a time cannot hold one), one request per connection (Connection: close), headers up to
 * MAX_HEADERS_BYTES; refused connections and accept errors are logged once a minute with a
 * count. */
#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <event2/thread.h>

#include "pshard/atomic_file.h"
#include "pshard/log.h"
#include "pshard/metrics.h"
#include "pshard/util.h"

#define MAX_HEADERS_BYTES 8192
#define MAX_CONNS 32
#define CONN_DEADLINE_S 10
#define LOG_EVERY_NS (60LL * 1000000000)
#define CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

struct ps_metrics_server {
    struct event_base *base;
    struct evconnlistener *listener;
    struct event *stop_ev, *resume_ev;
    int conns;                            /* open now (the loop's thread only) */
    struct conn *open;                    /* and which */
    uint64_t refused, accept_errors;      /* since the last log line */
    int64_t refused_log_ns, error_log_ns; /* when those were last logged */
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

/* One connection: its bufferevent and the timer that ends it CONN_DEADLINE_S after accept. */
typedef struct conn {
    ps_metrics_server_t *m;
    struct bufferevent *bev;
    struct event *deadline;
    bool replied;
    struct conn *prev, *next; /* the open ones, for stop */
} conn_t;

static void conn_free(conn_t *c)
{
    c->m->conns--;
    if (c->prev)
        c->prev->next = c->next;
    else
        c->m->open = c->next;
    if (c->next)
        c->next->prev = c->prev;
    event_free(c->deadline);
    bufferevent_free(c->bev); /* closes the socket */
    free(c);
}

static void on_deadline(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    conn_free(arg);
}

/* Closes once the reply has gone out. */
static void on_written(struct bufferevent *bev, void *arg)
{
    (void)bev;
    conn_t *c = arg;
    if (c->replied)
        conn_free(c);
}

static void on_conn_event(struct bufferevent *bev, short what, void *arg)
{
    (void)bev;
    (void)what; /* EOF or an error: the peer is gone */
    conn_free(arg);
}

/* Queues the reply (no body for HEAD, but GET's Content-Length) and closes after it. */
static void reply(conn_t *c, bool head, int code, const char *reason, const char *extra,
                  const char *type, const char *body, size_t len)
{
    struct evbuffer *out = bufferevent_get_output(c->bev);
    evbuffer_add_printf(out,
                        "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nCache-Control: no-store\r\n"
                        "Content-Length: %zu\r\nConnection: close\r\n%s\r\n",
                        code, reason, type, len, extra);
    if (!head && len)
        evbuffer_add(out, body, len);
    c->replied = true;
    bufferevent_disable(c->bev, EV_READ);
    bufferevent_setcb(c->bev, NULL, on_written, on_conn_event, c);
    if (evbuffer_get_length(out) == 0)
        conn_free(c);
}

static void reply_text(conn_t *c, bool head, int code, const char *reason, const char *extra,
                       const char *msg)
{
    reply(c, head, code, reason, extra, "text/plain; charset=utf-8", msg, strlen(msg));
}

/* The request line of a request whose headers have all arrived: GET or HEAD of /metrics (a
 * query string is ignored) gets the exposition; other paths 404, other methods 405. */
static void on_request(conn_t *c, char *line)
{
    char *sp1 = strchr(line, ' ');
    char *sp2 = sp1 ? strchr(sp1 + 1, ' ') : NULL;
    if (!sp1 || !sp2 || strncmp(sp2 + 1, "HTTP/1.", 7) != 0) {
        reply_text(c, false, 400, "Bad Request", "", "not an HTTP/1.x request line\n");
        return;
    }
    *sp1 = *sp2 = '\0';
    const char *method = line, *target = sp1 + 1;
    bool get = strcmp(method, "GET") == 0, head = strcmp(method, "HEAD") == 0;
    if (!get && !head) {
        reply_text(c, false, 405, "Method Not Allowed", "Allow: GET, HEAD\r\n",
                   "only GET and HEAD\n");
        return;
    }
    size_t plen = strcspn(target, "?#");
    if (plen != 8 || strncmp(target, "/metrics", 8) != 0) {
        reply_text(c, head, 404, "Not Found", "", "not found: metrics are at /metrics\n");
        return;
    }
    ps_metrics_t *w = ps_metrics_create();
    if (!w) {
        reply_text(c, head, 500, "Internal Server Error", "", "out of memory\n");
        return;
    }
    c->m->collect(c->m->arg, w);
    const char *error = ps_metrics_error(w);
    if (error[0]) {
        /* A bug in a family, not the scraper's fault: say which, and log it once per scrape. */
        PS_ERROR(PS_SUB_MAIN, "metrics: %s", error);
        char msg[PSHARD_ERRLEN];
        snprintf(msg, sizeof(msg), "metrics error: %s\n", error);
        reply_text(c, head, 500, "Internal Server Error", "", msg);
    } else {
        size_t len;
        const char *text = ps_metrics_text(w, &len);
        reply(c, head, 200, "OK", "", CONTENT_TYPE, text, len);
    }
    ps_metrics_destroy(w);
}

/* Reads until the headers end; more than MAX_HEADERS_BYTES of them is refused (431). */
static void on_readable(struct bufferevent *bev, void *arg)
{
    conn_t *c = arg;
    struct evbuffer *in = bufferevent_get_input(bev);
    struct evbuffer_ptr end = evbuffer_search(in, "\r\n\r\n", 4, NULL);
    if (end.pos < 0) {
        if (evbuffer_get_length(in) > MAX_HEADERS_BYTES)
            reply_text(c, false, 431, "Request Header Fields Too Large", "",
                       "headers over 8 KiB\n");
        return;
    }
    if ((size_t)end.pos > MAX_HEADERS_BYTES) {
        reply_text(c, false, 431, "Request Header Fields Too Large", "", "headers over 8 KiB\n");
        return;
    }
    char line[MAX_HEADERS_BYTES + 1];
    size_t n = 0;
    char *eol = evbuffer_readln(in, &n, EVBUFFER_EOL_CRLF);
    if (!eol || n > MAX_HEADERS_BYTES) {
        free(eol);
        reply_text(c, false, 400, "Bad Request", "", "no request line\n");
        return;
    }
    memcpy(line, eol, n + 1);
    free(eol);
    evbuffer_drain(in, evbuffer_get_length(in)); /* headers and any body: not needed */
    on_request(c, line);
}

/* At most one line a minute for what keeps happening: refused connections, accept errors. */
static void log_count(uint64_t *count, int64_t *last_ns, const char *what)
{
    (*count)++;
    int64_t now = ps_now_ns();
    if (*last_ns && now - *last_ns < LOG_EVERY_NS)
        return;
    PS_WARN(PS_SUB_MAIN, "metrics: %s (%llu since the last such line)", what,
            (unsigned long long)*count);
    *count = 0;
    *last_ns = now;
}

static void on_accept(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int len,
                      void *arg)
{
    (void)l;
    (void)sa;
    (void)len;
    ps_metrics_server_t *m = arg;
    if (m->conns >= MAX_CONNS) {
        evutil_closesocket(fd);
        log_count(&m->refused, &m->refused_log_ns,
                  "connections refused: as many as allowed are open already");
        return;
    }
    conn_t *c = calloc(1, sizeof(*c));
    struct bufferevent *bev = c ? bufferevent_socket_new(m->base, fd, BEV_OPT_CLOSE_ON_FREE) : NULL;
    struct event *deadline = bev ? evtimer_new(m->base, on_deadline, c) : NULL;
    if (!deadline) {
        if (bev)
            bufferevent_free(bev);
        else
            evutil_closesocket(fd);
        free(c);
        return;
    }
    c->m = m;
    c->bev = bev;
    c->deadline = deadline;
    c->next = m->open;
    if (m->open)
        m->open->prev = c;
    m->open = c;
    m->conns++;
    struct timeval tv = {CONN_DEADLINE_S, 0};
    evtimer_add(deadline, &tv);
    bufferevent_setcb(bev, on_readable, NULL, on_conn_event, c);
    bufferevent_enable(bev, EV_READ);
}

/* Out of descriptors (or memory): the listening socket stays readable, so accepting again at
 * once would spin; pause it for a while instead. */
static void on_accept_error(struct evconnlistener *l, void *arg)
{
    ps_metrics_server_t *m = arg;
    int e = EVUTIL_SOCKET_ERROR();
    char what[160];
    snprintf(what, sizeof(what), "accept failed: %s", evutil_socket_error_to_string(e));
    log_count(&m->accept_errors, &m->error_log_ns, what);
    if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
        evconnlistener_disable(l);
        struct timeval tv = {0, 200 * 1000};
        evtimer_add(m->resume_ev, &tv);
    }
}

static void on_resume(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    ps_metrics_server_t *m = arg;
    evconnlistener_enable(m->listener);
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
    m->stop_ev = m->base ? event_new(m->base, -1, 0, on_stop, m) : NULL;
    m->resume_ev = m->base ? evtimer_new(m->base, on_resume, m) : NULL;
    if (!m->stop_ev || !m->resume_ev) {
        ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "cannot create the metrics HTTP server");
        goto fail;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV},
                    *ai = NULL;
    char portstr[16];
    snprintf(portstr, sizeof(portstr), "%d", port);
    if (getaddrinfo(host, portstr, &hints, &ai) == 0 && ai)
        m->listener = evconnlistener_new_bind(m->base, on_accept, m,
                                              LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE |
                                                  LEV_OPT_CLOSE_ON_EXEC,
                                              64, ai->ai_addr, (int)ai->ai_addrlen);
    if (ai)
        freeaddrinfo(ai);
    if (!m->listener) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "cannot listen for metrics on '%s' (bad address, or the port is in use)", listen);
        goto fail;
    }
    evconnlistener_set_error_cb(m->listener, on_accept_error);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (getsockname(evconnlistener_get_fd(m->listener), (struct sockaddr *)&ss, &sl) != 0) {
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
    while (m->open) /* the loop has stopped: what it had open goes now */
        conn_free(m->open);
    if (m->listener)
        evconnlistener_free(m->listener);
    if (m->stop_ev)
        event_free(m->stop_ev);
    if (m->resume_ev)
        event_free(m->resume_ev);
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
