/* Ring set-up for the tcp backend: listen, publish this rank's address (through the
 * coordinator's store or an explicit peer list), connect to the next rank and accept the
 * previous one, each link authenticated by an HMAC challenge over the cluster token and stamped
 * with the generation. Blocking code with deadlines; it runs before the engine thread starts. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "coll_tcp.h"
#include "pshard/coord_client.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

static int split_host_port(const char *addr, char *host, size_t hostlen, char *port, size_t portlen)
{
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr || !colon[1])
        return -1;
    size_t hl = (size_t)(colon - addr);
    if (addr[0] == '[' && hl >= 2 && addr[hl - 1] == ']') {
        addr++;
        hl -= 2;
    }
    if (hl + 1 > hostlen || strlen(colon + 1) + 1 > portlen)
        return -1;
    memcpy(host, addr, hl);
    host[hl] = '\0';
    ps_strlcpy(port, colon + 1, portlen);
    return 0;
}

void tcp_tune_socket(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    const char *env = getenv("PSHARD_SOCKET_BUFFER");
    int64_t bytes;
    if (env && ps_parse_i64(env, 65536, 1 << 30, &bytes) == 0) {
        int b = (int)bytes;
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof(b));
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof(b));
    }
}

static int set_nonblocking(int fd, bool on)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return -1;
    return fcntl(fd, F_SETFL, on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK));
}

/* The set-up's cancel flag, per thread (set-up runs on the calling thread and its acceptor). */
static _Thread_local const volatile int *tl_cancel;

static bool cancelled(void)
{
    return tl_cancel && *tl_cancel;
}

static int remaining_ms(int64_t deadline_ns)
{
    int64_t left = (deadline_ns - ps_now_ns()) / 1000000;
    if (left < 0)
        return 0;
    return left > 1000000 ? 1000000 : (int)left;
}

/* Reads (or, sending, writes) exactly n bytes before the deadline, polling in 200 ms slices so
 * a cancelled set-up stops promptly. 0, or -1 with errno (ETIMEDOUT, ECONNRESET, ECANCELED,
 * or the system call's). */
static int io_full(int fd, void *buf, size_t n, int64_t deadline_ns, bool sending)
{
    uint8_t *p = buf;
    while (n > 0) {
        if (cancelled()) {
            errno = ECANCELED;
            return -1;
        }
        struct pollfd pfd = {fd, sending ? POLLOUT : POLLIN, 0};
        int left = remaining_ms(deadline_ns);
        int r = poll(&pfd, 1, left < 200 ? left : 200);
        if (r == 0 && left > 200)
            continue;
        if (r == 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        ssize_t done = sending ? send(fd, p, n, MSG_NOSIGNAL) : read(fd, p, n);
        if (done == 0 && !sending) {
            errno = ECONNRESET;
            return -1;
        }
        if (done < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return -1;
        }
        p += done;
        n -= (size_t)done;
    }
    return 0;
}

static int read_full(int fd, void *buf, size_t n, int64_t deadline_ns)
{
    return io_full(fd, buf, n, deadline_ns, false);
}

static int write_full(int fd, const void *buf, size_t n, int64_t deadline_ns)
{
    return io_full(fd, (void *)buf, n, deadline_ns, true);
}

static int send_frame(int fd, uint8_t type, const uint8_t *payload, size_t len, int64_t deadline)
{
    uint8_t hdr[COLL_FRAME_HEADER_SIZE];
    coll_frame_header_t h = {type, 0, (uint32_t)len, 0};
    coll_frame_header_encode(&h, hdr);
    if (write_full(fd, hdr, sizeof(hdr), deadline) != 0)
        return -1;
    return len ? write_full(fd, payload, len, deadline) : 0;
}

/* Reads one handshake frame; its payload goes to buf (cap COLL_FRAME_MAX_CONTROL). */
static pshard_status_t recv_frame(int fd, coll_frame_header_t *h, uint8_t *buf, int64_t deadline,
                                  char *err, size_t errlen)
{
    uint8_t hdr[COLL_FRAME_HEADER_SIZE];
    if (read_full(fd, hdr, sizeof(hdr), deadline) != 0)
        return ps_errf(err, errlen, errno == ETIMEDOUT ? PSHARD_ERR_TIMEOUT : PSHARD_ERR_PEER_LOST,
                       "%s", errno == ETIMEDOUT ? "timed out" : strerror(errno));
    PS_CHECK(coll_frame_header_decode(hdr, h, err, errlen));
    if (h->type == COLL_FRAME_DATA || h->len > COLL_FRAME_MAX_CONTROL)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "unexpected frame type %u during the handshake", h->type);
    if (h->len && read_full(fd, buf, h->len, deadline) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_PEER_LOST, "connection closed mid-frame");
    return PSHARD_OK;
}

static void send_reject(int fd, const char *reason)
{
    uint8_t buf[COLL_FRAME_MAX_CONTROL];
    size_t n = coll_reject_encode(reason, buf, sizeof(buf));
    send_frame(fd, COLL_FRAME_REJECT, buf, n, ps_now_ns() + 1000000000LL);
}

/* The acceptor serves every connection that arrives while the ring links at once, each as a
 * small state machine on one poll loop: a stranger that connects and says nothing (or half a
 * frame) holds a slot until its own deadline, never the real previous rank's turn. Slots are
 * bounded; when all are taken the oldest is dropped for the newcomer, so a flood of stalled
 * connections costs each of them its slot, not the ring its link. */
#define HS_SLOTS 32
#define HS_MS 5000 /* to send HELLO and AUTH, from the connection's arrival */

typedef struct {
    int fd; /* -1: free */
    int64_t deadline;
    uint64_t seq; /* arrival order */
    bool authing; /* CHALLENGE sent; reading AUTH */
    size_t got;   /* bytes of the current frame read, header first */
    uint8_t hdr[COLL_FRAME_HEADER_SIZE];
    coll_frame_header_t h;
    uint8_t buf[COLL_FRAME_MAX_CONTROL];
    coll_hello_t hello;
    coll_challenge_t ch;
    char peer[96];
} hs_t;

static void hs_drop(hs_t *s, const char *why)
{
    if (why)
        PS_WARN(PS_SUB_COLL, "refused a ring connection from %s: %s", s->peer, why);
    close(s->fd);
    s->fd = -1;
}

/* Reads what has arrived of the current frame: 1 when it is complete, 0 for more to come,
 * -1 on error (reason in err). */
static int hs_read(hs_t *s, char *err, size_t errlen)
{
    for (;;) {
        if (s->got >= COLL_FRAME_HEADER_SIZE && s->got == COLL_FRAME_HEADER_SIZE + s->h.len)
            return 1;
        uint8_t *dst = s->got < COLL_FRAME_HEADER_SIZE ? s->hdr + s->got
                                                       : s->buf + (s->got - COLL_FRAME_HEADER_SIZE);
        size_t want = s->got < COLL_FRAME_HEADER_SIZE ? COLL_FRAME_HEADER_SIZE - s->got
                                                      : COLL_FRAME_HEADER_SIZE + s->h.len - s->got;
        ssize_t n = read(s->fd, dst, want);
        if (n == 0) {
            snprintf(err, errlen, "closed the connection");
            return -1;
        }
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            snprintf(err, errlen, "%s", strerror(errno));
            return -1;
        }
        s->got += (size_t)n;
        if (s->got == COLL_FRAME_HEADER_SIZE) {
            if (coll_frame_header_decode(s->hdr, &s->h, err, errlen) != PSHARD_OK)
                return -1;
            if (s->h.type == COLL_FRAME_DATA || s->h.len > COLL_FRAME_MAX_CONTROL) {
                snprintf(err, errlen, "unexpected frame type %u during the handshake", s->h.type);
                return -1;
            }
        }
    }
}

/* Sends a handshake frame without waiting: a fresh socket's send buffer holds it, and a peer
 * that has not read a few hundred bytes is not worth waiting for. */
static int hs_send(hs_t *s, uint8_t type, const uint8_t *payload, size_t len)
{
    return send_frame(s->fd, type, payload, len, ps_now_ns());
}

/* Advances one connection on a complete frame: 1 when it is the authenticated previous rank,
 * 0 to read on, -1 refused (reason in err). */
static int hs_step(tcp_t *t, hs_t *s, char *err, size_t errlen)
{
    uint8_t out[COLL_FRAME_MAX_CONTROL];
    if (!s->authing) {
        if (s->h.type != COLL_FRAME_HELLO) {
            snprintf(err, errlen, "expected HELLO, got frame type %u", s->h.type);
            return -1;
        }
        if (coll_hello_decode(s->buf, s->h.len, &s->hello, err, errlen) != PSHARD_OK)
            return -1;
        if (coll_hello_check(&s->hello, t->comm->generation, (uint32_t)t->n, (uint32_t)t->rank,
                             t->comm->name, err, errlen) != PSHARD_OK) {
            size_t n = coll_reject_encode(err, out, sizeof(out));
            hs_send(s, COLL_FRAME_REJECT, out, n);
            return -1;
        }
        coll_random_nonce(s->ch.nonce);
        coll_handshake_mac(t->key, t->keylen, 'A', &s->hello, s->ch.nonce, s->ch.mac);
        size_t n = coll_challenge_encode(&s->ch, out, sizeof(out));
        if (hs_send(s, COLL_FRAME_CHALLENGE, out, n) != 0) {
            snprintf(err, errlen, "went away");
            return -1;
        }
        s->authing = true;
        s->got = 0;
        return 0;
    }
    if (s->h.type != COLL_FRAME_AUTH) {
        snprintf(err, errlen, "expected AUTH, got frame type %u", s->h.type);
        return -1;
    }
    coll_auth_t auth;
    if (coll_auth_decode(s->buf, s->h.len, &auth, err, errlen) != PSHARD_OK)
        return -1;
    uint8_t expect[COLL_MAC_SIZE];
    coll_handshake_mac(t->key, t->keylen, 'C', &s->hello, s->ch.nonce, expect);
    if (!coll_mac_equal(expect, auth.mac)) {
        size_t n = coll_reject_encode("wrong cluster token", out, sizeof(out));
        hs_send(s, COLL_FRAME_REJECT, out, n);
        snprintf(err, errlen, "claims rank %u but does not know the cluster token",
                 s->hello.from_rank);
        return -1;
    }
    if (hs_send(s, COLL_FRAME_ACCEPT, NULL, 0) != 0) {
        snprintf(err, errlen, "went away");
        return -1;
    }
    return 1;
}

typedef struct {
    tcp_t *t;
    int64_t deadline;
    int fd; /* result */
    pshard_status_t rc;
    char err[PSHARD_ERRLEN];
} acceptor_t;

/* Takes one waiting connection into a slot (when all are taken, the oldest one's). */
static void hs_admit(tcp_t *t, hs_t *slots, uint64_t *seq)
{
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    int fd = accept(t->listen_fd, (struct sockaddr *)&ss, &sl);
    if (fd < 0)
        return;
    hs_t *s = NULL;
    for (int i = 0; i < HS_SLOTS && !s; i++)
        s = slots[i].fd < 0 ? &slots[i] : NULL;
    if (!s) {
        /* The oldest that has not yet said a valid HELLO goes first. */
        for (int i = 0; i < HS_SLOTS; i++) {
            hs_t *c = &slots[i];
            if (!s || (s->authing && !c->authing) || (s->authing == c->authing && c->seq < s->seq))
                s = c;
        }
        hs_drop(s, "still not authenticated while more connections came");
    }
    memset(s, 0, offsetof(hs_t, buf));
    s->fd = fd;
    s->seq = ++*seq;
    s->deadline = ps_now_ns() + (int64_t)HS_MS * 1000000;
    ps_strlcpy(s->peer, "?", sizeof(s->peer));
    char host[64] = "", port[16] = "";
    if (getnameinfo((struct sockaddr *)&ss, sl, host, sizeof(host), port, sizeof(port),
                    NI_NUMERICHOST | NI_NUMERICSERV) == 0)
        snprintf(s->peer, sizeof(s->peer), "%s:%s", host, port);
    set_nonblocking(fd, true);
}

static void *acceptor_main(void *arg)
{
    acceptor_t *a = arg;
    tcp_t *t = a->t;
    tl_cancel = t->cancel;
    a->rc = PSHARD_ERR_TIMEOUT;
    snprintf(a->err, sizeof(a->err), "rank %d never connected to rank %d", t->prev, t->rank);
    hs_t *slots = calloc(HS_SLOTS, sizeof(*slots));
    if (!slots) {
        a->rc = PSHARD_ERR_NO_MEMORY;
        snprintf(a->err, sizeof(a->err), "out of memory");
        return NULL;
    }
    for (int i = 0; i < HS_SLOTS; i++)
        slots[i].fd = -1;
    uint64_t seq = 0;
    struct pollfd pfd[HS_SLOTS + 1];
    int who[HS_SLOTS + 1];
    while (a->fd < 0 && ps_now_ns() < a->deadline && !cancelled()) {
        int64_t wake = a->deadline, now = ps_now_ns();
        int n = 0;
        pfd[n++] = (struct pollfd){t->listen_fd, POLLIN, 0};
        for (int i = 0; i < HS_SLOTS; i++) {
            if (slots[i].fd < 0)
                continue;
            if (slots[i].deadline <= now) {
                hs_drop(&slots[i], "did not authenticate in time");
                continue;
            }
            wake = slots[i].deadline < wake ? slots[i].deadline : wake;
            who[n] = i;
            pfd[n++] = (struct pollfd){slots[i].fd, POLLIN, 0};
        }
        int ms = remaining_ms(wake);
        if (poll(pfd, (nfds_t)n, ms < 200 ? ms : 200) <= 0)
            continue;
        for (int k = 1; k < n && a->fd < 0; k++) {
            if (!pfd[k].revents)
                continue;
            hs_t *s = &slots[who[k]];
            char err[PSHARD_ERRLEN] = "";
            int r = hs_read(s, err, sizeof(err));
            if (r > 0)
                r = hs_step(t, s, err, sizeof(err));
            if (r < 0) {
                hs_drop(s, err);
            } else if (r > 0) {
                set_nonblocking(s->fd, false);
                a->fd = s->fd;
                a->rc = PSHARD_OK;
                s->fd = -1;
            }
        }
        if (a->fd < 0 && (pfd[0].revents & POLLIN))
            hs_admit(t, slots, &seq);
    }
    for (int i = 0; i < HS_SLOTS; i++) {
        if (slots[i].fd >= 0)
            hs_drop(&slots[i], NULL);
    }
    free(slots);
    return NULL;
}

/* Connector side: dial the next rank (retrying refused connections until the deadline) and
 * authenticate. */
static pshard_status_t connect_next(tcp_t *t, const char *addr, int64_t deadline, char *err,
                                    size_t errlen)
{
    char host[256], port[32];
    if (split_host_port(addr, host, sizeof(host), port, sizeof(port)) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "address '%s' of rank %d is not HOST:PORT", addr, t->next);
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_socktype = SOCK_STREAM;
    int gai = getaddrinfo(host, port, &hints, &res);
    if (gai != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "cannot resolve %s: %s", addr,
                       gai_strerror(gai));
    int fd = -1;
    while (ps_now_ns() < deadline && !cancelled()) {
        fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
            break;
        tcp_tune_socket(fd);
        if (connect(fd, res->ai_addr, res->ai_addrlen) == 0)
            break;
        close(fd);
        fd = -1;
        struct timespec ts = {0, 20 * 1000000};
        nanosleep(&ts, NULL);
    }
    freeaddrinfo(res);
    if (fd < 0 && cancelled())
        return ps_errf(err, errlen, PSHARD_ERR_CANCELLED, "set-up cancelled");
    if (fd < 0)
        return ps_errf(err, errlen, PSHARD_ERR_TIMEOUT, "cannot connect to rank %d at %s", t->next,
                       addr);

    coll_hello_t hello;
    memset(&hello, 0, sizeof(hello));
    hello.version = COLL_WIRE_VERSION;
    hello.generation = t->comm->generation;
    hello.world_size = (uint32_t)t->n;
    hello.from_rank = (uint32_t)t->rank;
    hello.to_rank = (uint32_t)t->next;
    coll_random_nonce(hello.nonce);
    ps_strlcpy(hello.comm_name, t->comm->name, sizeof(hello.comm_name));
    uint8_t buf[COLL_FRAME_MAX_CONTROL];
    size_t n = coll_hello_encode(&hello, buf, sizeof(buf));
    pshard_status_t rc = PSHARD_OK;
    coll_frame_header_t h;
    char reason[256];
    if (send_frame(fd, COLL_FRAME_HELLO, buf, n, deadline) != 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_PEER_LOST, "rank %d at %s closed the connection",
                     t->next, addr);
        goto out;
    }
    rc = recv_frame(fd, &h, buf, deadline, err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    if (h.type == COLL_FRAME_REJECT) {
        coll_reject_decode(buf, h.len, reason, sizeof(reason), NULL, 0);
        rc = ps_errf(err, errlen, PSHARD_ERR_PERMISSION, "rank %d at %s refused us: %s", t->next,
                     addr, reason);
        goto out;
    }
    coll_challenge_t ch;
    if (h.type != COLL_FRAME_CHALLENGE ||
        coll_challenge_decode(buf, h.len, &ch, err, errlen) != PSHARD_OK) {
        rc = ps_errf(err, errlen, PSHARD_ERR_PERMISSION, "rank %d at %s sent no valid challenge",
                     t->next, addr);
        goto out;
    }
    uint8_t expect[COLL_MAC_SIZE];
    coll_handshake_mac(t->key, t->keylen, 'A', &hello, ch.nonce, expect);
    if (!coll_mac_equal(expect, ch.mac)) {
        send_reject(fd, "you do not know the cluster token");
        rc = ps_errf(err, errlen, PSHARD_ERR_PERMISSION,
                     "the peer at %s does not know the cluster token (not rank %d of this "
                     "cluster?)",
                     addr, t->next);
        goto out;
    }
    coll_auth_t auth;
    coll_handshake_mac(t->key, t->keylen, 'C', &hello, ch.nonce, auth.mac);
    n = coll_auth_encode(&auth, buf, sizeof(buf));
    if (send_frame(fd, COLL_FRAME_AUTH, buf, n, deadline) != 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_PEER_LOST, "rank %d closed the connection", t->next);
        goto out;
    }
    rc = recv_frame(fd, &h, buf, deadline, err, errlen);
    if (rc == PSHARD_OK && h.type == COLL_FRAME_REJECT) {
        coll_reject_decode(buf, h.len, reason, sizeof(reason), NULL, 0);
        rc = ps_errf(err, errlen, PSHARD_ERR_PERMISSION, "rank %d at %s refused us: %s", t->next,
                     addr, reason);
    } else if (rc == PSHARD_OK && h.type != COLL_FRAME_ACCEPT) {
        rc = ps_errf(err, errlen, PSHARD_ERR_PERMISSION, "rank %d sent frame %u, not ACCEPT",
                     t->next, h.type);
    }
out:
    if (rc != PSHARD_OK) {
        close(fd);
        return rc;
    }
    t->send_fd = fd;
    return PSHARD_OK;
}

static pshard_status_t listen_on(tcp_t *t, const char *host, const char *port, char *err,
                                 size_t errlen)
{
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    int gai = getaddrinfo(host, port, &hints, &res);
    if (gai != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "cannot resolve %s: %s", host,
                       gai_strerror(gai));
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    if (fd >= 0)
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (fd >= 0)
        tcp_tune_socket(fd);
    if (fd < 0 || bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 64) != 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        freeaddrinfo(res);
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot listen on %s:%s: %s", host, port,
                       strerror(e));
    }
    freeaddrinfo(res);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    t->listen_port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                    : ((struct sockaddr_in *)&ss)->sin_port);
    t->listen_fd = fd;
    return PSHARD_OK;
}

/* Publishes this rank's address and fetches the next rank's through the coordinator. */
static pshard_status_t exchange_via_store(tcp_t *t, const pshard_comm_config_t *cfg,
                                          const char *my_addr, char *next_addr, size_t len,
                                          int64_t deadline, char *err, size_t errlen)
{
    ps_rpc_channel_config_t ccfg = {
        .target = cfg->coordinator, .token = cfg->token, .job = cfg->job};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&ccfg, err, errlen);
    if (!ch)
        return PSHARD_ERR_INVALID_ARGUMENT;
    char key[256], next_key[256];
    snprintf(key, sizeof(key), "pshard/coll/%s/g%llu/addr/%d", t->comm->name,
             (unsigned long long)t->comm->generation, t->rank);
    snprintf(next_key, sizeof(next_key), "pshard/coll/%s/g%llu/addr/%d", t->comm->name,
             (unsigned long long)t->comm->generation, t->next);
    int64_t left_ms = (deadline - ps_now_ns()) / 1000000;
    pshard_status_t rc = ps_coord_store_put(ch, key, my_addr, strlen(my_addr),
                                            left_ms > 1 ? left_ms : 1, err, errlen);
    /* Wait in short slices so a cancelled set-up stops promptly. */
    while (rc == PSHARD_OK) {
        if (cancelled()) {
            rc = ps_errf(err, errlen, PSHARD_ERR_CANCELLED, "set-up cancelled");
            break;
        }
        left_ms = (deadline - ps_now_ns()) / 1000000;
        if (left_ms <= 0) {
            rc = ps_errf(err, errlen, PSHARD_ERR_TIMEOUT,
                         "rank %d never published its address (%s)", t->next, next_key);
            break;
        }
        const char *keys[1] = {next_key};
        Pshard__StoreWaitResponse *r = NULL;
        char werr[PSHARD_ERRLEN] = "";
        pshard_status_t wrc = ps_coord_store_await(ch, keys, 1, left_ms < 500 ? left_ms : 500, &r,
                                                   werr, sizeof(werr));
        if (wrc == PSHARD_ERR_TIMEOUT)
            continue;
        if (wrc != PSHARD_OK) {
            rc = ps_errf(err, errlen, wrc, "%s", werr);
            break;
        }
        if (r->n_values != 1 || r->values[0].len == 0 || r->values[0].len >= len) {
            rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                         "store key %s holds no usable address", next_key);
        } else {
            memcpy(next_addr, r->values[0].data, r->values[0].len);
            next_addr[r->values[0].len] = '\0';
        }
        protobuf_c_message_free_unpacked(&r->base, NULL);
        break;
    }
    ps_rpc_channel_destroy(ch);
    return rc;
}

/* Once linked, the previous rank has read this rank's address: its key leaves the store, so a
 * long job's rebuilt rings do not pile up keys; after a failed set-up too, so that a retry under
 * the same name never dials a closed port. Best effort (the job's keys go when it ends). */
static void forget_address(tcp_t *t, const pshard_comm_config_t *cfg)
{
    char err[PSHARD_ERRLEN] = "";
    ps_rpc_channel_config_t ccfg = {
        .target = cfg->coordinator, .token = cfg->token, .job = cfg->job};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&ccfg, err, sizeof(err));
    if (!ch)
        return;
    char key[256];
    snprintf(key, sizeof(key), "pshard/coll/%s/g%llu/addr/%d", t->comm->name,
             (unsigned long long)t->comm->generation, t->rank);
    if (ps_coord_store_remove(ch, key, 2000, err, sizeof(err)) != PSHARD_OK)
        PS_WARN(PS_SUB_COLL, "could not delete store key %s: %s", key, err);
    ps_rpc_channel_destroy(ch);
}

/* One ring all-gather of fixed-size records during set-up: in round k this rank sends the
 * record of rank (rank - k) to next and receives the one of rank (rank - 1 - k) from prev, as
 * a frame of `type` that decode parses into slot (rank - 1 - k), which must name that rank. */
typedef size_t (*rec_encode_fn)(const void *rec, uint8_t *out, size_t cap);
typedef pshard_status_t (*rec_decode_fn)(const uint8_t *in, size_t len, void *rec, uint32_t *origin,
                                         char *err, size_t errlen);

static pshard_status_t ring_allgather(tcp_t *t, uint8_t type, void *recs, size_t rec_size,
                                      rec_encode_fn encode, rec_decode_fn decode, int64_t deadline,
                                      char *err, size_t errlen)
{
    uint8_t buf[COLL_FRAME_MAX_CONTROL];
    for (int k = 0; k < t->n - 1; k++) {
        int out_rank = (t->rank - k + t->n) % t->n, in_rank = (t->rank - 1 - k + t->n) % t->n;
        size_t len = encode((uint8_t *)recs + (size_t)out_rank * rec_size, buf, sizeof(buf));
        if (send_frame(t->send_fd, type, buf, len, deadline) != 0)
            return ps_errf(err, errlen, PSHARD_ERR_PEER_LOST,
                           "choosing the transport: cannot send to rank %d: %s", t->next,
                           strerror(errno));
        coll_frame_header_t h;
        char why[PSHARD_ERRLEN] = "";
        pshard_status_t rc = recv_frame(t->recv_fd, &h, buf, deadline, why, sizeof(why));
        uint32_t origin = UINT32_MAX;
        if (rc == PSHARD_OK && h.type != type)
            rc = ps_errf(why, sizeof(why), PSHARD_ERR_INVALID_ARGUMENT, "it sent frame type %u",
                         h.type);
        if (rc == PSHARD_OK)
            rc = decode(buf, h.len, (uint8_t *)recs + (size_t)in_rank * rec_size, &origin, why,
                        sizeof(why));
        if (rc == PSHARD_OK && origin != (uint32_t)in_rank)
            rc = ps_errf(why, sizeof(why), PSHARD_ERR_INVALID_ARGUMENT,
                         "it forwarded rank %u's record where rank %d's belongs", origin, in_rank);
        if (rc != PSHARD_OK)
            return ps_errf(err, errlen, rc, "choosing the transport: rank %d: %s", t->prev, why);
    }
    return PSHARD_OK;
}

static size_t peer_encode(const void *rec, uint8_t *out, size_t cap)
{
    return coll_peer_encode(rec, out, cap);
}

static pshard_status_t peer_decode(const uint8_t *in, size_t len, void *rec, uint32_t *origin,
                                   char *err, size_t errlen)
{
    PS_CHECK(coll_peer_decode(in, len, rec, err, errlen));
    *origin = ((coll_peer_t *)rec)->origin_rank;
    return PSHARD_OK;
}

static size_t vote_encode(const void *rec, uint8_t *out, size_t cap)
{
    return coll_done_encode(rec, out, cap);
}

static pshard_status_t vote_decode(const uint8_t *in, size_t len, void *rec, uint32_t *origin,
                                   char *err, size_t errlen)
{
    PS_CHECK(coll_done_decode(in, len, rec, err, errlen));
    *origin = ((coll_done_t *)rec)->origin_rank;
    return PSHARD_OK;
}

pshard_status_t pshard_socket_ifname_address(const char *names, char *out, size_t outlen, char *err,
                                             size_t errlen)
{
    struct ifaddrs *all = NULL;
    if (getifaddrs(&all) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot list the network interfaces: %s",
                       strerror(errno));
    pshard_status_t rc = PSHARD_ERR_INVALID_ARGUMENT;
    for (const char *p = names; *p && rc != PSHARD_OK;) {
        size_t len = strcspn(p, ",");
        for (struct ifaddrs *a = all; a && rc != PSHARD_OK; a = a->ifa_next) {
            if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET || strlen(a->ifa_name) != len ||
                strncmp(a->ifa_name, p, len) != 0)
                continue;
            const struct sockaddr_in *in = (const struct sockaddr_in *)a->ifa_addr;
            char text[INET_ADDRSTRLEN];
            if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) &&
                ps_strlcpy(out, text, outlen) == 0)
                rc = PSHARD_OK;
        }
        p += len;
        if (*p == ',')
            p++;
    }
    if (rc != PSHARD_OK) {
        /* Which interfaces have an IPv4 address: what the user can choose from. */
        char have[256] = "";
        size_t used = 0;
        for (struct ifaddrs *a = all; a && used + 1 < sizeof(have); a = a->ifa_next) {
            if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET)
                continue;
            int k =
                snprintf(have + used, sizeof(have) - used, "%s%s", used ? ", " : "", a->ifa_name);
            used += k > 0 ? (size_t)k : 0;
        }
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "socket interface '%.64s' (PSHARD_SOCKET_IFNAME): no such interface with an IPv4 "
                "address (interfaces with one: %s)",
                names, used ? have : "none");
    }
    freeifaddrs(all);
    return rc;
}

/* With the same-host transport chosen: rank 0 makes the slots' segment and says which of its
 * fds holds it, the others open it, and every rank votes; the fast path is on when all could
 * (else every rank goes without it, saying why in the log). Errors: the ring's. */
static pshard_status_t share_slots(tcp_t *t, const coll_peer_t *recs, int64_t deadline, char *err,
                                   size_t errlen)
{
    coll_done_t *vals = calloc((size_t)t->n, sizeof(*vals));
    if (!vals)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    char why[PSHARD_ERRLEN] = "";
    int fd = -1;
    if (t->rank == 0)
        t->slots = coll_slots_create(t->n, t->probe, &fd, why, sizeof(why));
    for (int q = 0; q < t->n; q++)
        vals[q].origin_rank = (uint32_t)q;
    vals[t->rank].value = t->slots ? (uint32_t)fd + 1 : 0;
    pshard_status_t rc = ring_allgather(t, COLL_FRAME_DONE, vals, sizeof(*vals), vote_encode,
                                        vote_decode, deadline, err, errlen);
    uint32_t fd0 = vals[0].value;
    if (rc == PSHARD_OK && t->rank != 0 && fd0 != 0 && fd0 <= (uint32_t)INT_MAX)
        t->slots = coll_slots_attach(t->n, t->rank, (pid_t)recs[0].pid, (int)(fd0 - 1),
                                     recs[0].probe, why, sizeof(why));
    for (int q = 0; q < t->n; q++)
        vals[q].value = 0;
    vals[t->rank].value = t->slots != NULL;
    if (rc == PSHARD_OK)
        rc = ring_allgather(t, COLL_FRAME_DONE, vals, sizeof(*vals), vote_encode, vote_decode,
                            deadline, err, errlen);
    bool all = rc == PSHARD_OK;
    for (int q = 0; q < t->n; q++)
        all = all && vals[q].value;
    coll_slots_setup_done(t->slots);
    if (!all) {
        coll_slots_destroy(t->slots);
        t->slots = NULL;
    }
    if (rc == PSHARD_OK)
        PS_INFO(PS_SUB_COLL, "ring %s: rank %d %s%s%s", t->comm->name, t->rank,
                all ? "runs its operations through the same-host slots"
                    : "runs its operations through the engine, the slots not shared",
                why[0] ? ": " : "", why);
    free(vals);
    return rc;
}

pshard_status_t tcp_choose_transport(tcp_t *t, coll_transport_t mode, int64_t deadline, char *err,
                                     size_t errlen)
{
    coll_peer_t *recs = calloc((size_t)t->n, sizeof(*recs));
    coll_done_t *votes = calloc((size_t)t->n, sizeof(*votes));
    if (!recs || !votes) {
        free(recs);
        free(votes);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    coll_random_nonce(t->probe);
    coll_shm_self((uint32_t)t->rank, t->probe, &recs[t->rank]);
    pshard_status_t rc = ring_allgather(t, COLL_FRAME_PEER, recs, sizeof(*recs), peer_encode,
                                        peer_decode, deadline, err, errlen);
    char why[PSHARD_ERRLEN] = "PSHARD_TRANSPORT=tcp";
    bool mine = mode != COLL_TRANSPORT_TCP;
    for (int q = 0; rc == PSHARD_OK && mine && q < t->n; q++)
        if (q != t->rank)
            mine = coll_shm_can_read(&recs[t->rank], &recs[q], why, sizeof(why));
    votes[t->rank] = (coll_done_t){(uint32_t)t->rank, mine};
    if (rc == PSHARD_OK)
        rc = ring_allgather(t, COLL_FRAME_DONE, votes, sizeof(*votes), vote_encode, vote_decode,
                            deadline, err, errlen);
    int refuser = -1;
    for (int q = 0; rc == PSHARD_OK && q < t->n && refuser < 0; q++)
        if (!votes[q].value)
            refuser = q;
    if (rc == PSHARD_OK && refuser < 0) {
        t->shm = coll_shm_create(t->n, t->rank, recs);
        if (!t->shm)
            rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        if (rc == PSHARD_OK)
            rc = share_slots(t, recs, deadline, err, errlen);
    } else if (rc == PSHARD_OK && mode == COLL_TRANSPORT_SHM) {
        rc = refuser == t->rank
                 ? ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                           "PSHARD_TRANSPORT=shm, but %s (use tcp or auto)", why)
                 : ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                           "PSHARD_TRANSPORT=shm, but rank %d cannot read every other rank's "
                           "memory (its log says why; use tcp or auto)",
                           refuser);
    }
    if (rc == PSHARD_OK)
        PS_INFO(PS_SUB_COLL, "ring %s generation %llu: rank %d moves data %s%s%s", t->comm->name,
                (unsigned long long)t->comm->generation, t->rank,
                t->shm ? "by reading the others' memory (same host)" : "through the sockets",
                t->shm || refuser != t->rank ? "" : ": ", t->shm || refuser != t->rank ? "" : why);
    free(recs);
    free(votes);
    return rc;
}

pshard_status_t tcp_connect_ring(tcp_t *t, const pshard_comm_config_t *cfg, char *err,
                                 size_t errlen)
{
    int64_t connect_ms = cfg->connect_timeout_ms > 0 ? cfg->connect_timeout_ms : 60000;
    t->cancel = cfg->cancel;
    tl_cancel = cfg->cancel;
    int64_t deadline = ps_now_ns() + connect_ms * 1000000;
    coll_transport_t mode;
    /* A wrong transport is said before anything connects. */
    PS_CHECK(coll_transport_parse(cfg->transport, &mode, err, errlen));
    char host[256], port[32], my_addr[300], next_addr[300];
    if (cfg->peers) {
        for (int i = 0; i < t->n; i++) {
            if (!cfg->peers[i] ||
                split_host_port(cfg->peers[i], host, sizeof(host), port, sizeof(port)) != 0)
                return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                               "peers[%d] is not HOST:PORT", i);
        }
        split_host_port(cfg->peers[t->rank], host, sizeof(host), port, sizeof(port));
        PS_CHECK(listen_on(t, host, port, err, errlen));
        ps_strlcpy(next_addr, cfg->peers[t->next], sizeof(next_addr));
    } else {
        const char *lh = cfg->listen_host ? cfg->listen_host : "127.0.0.1";
        const char *adv = cfg->advertise_host;
        const char *ifname =
            cfg->socket_ifname ? cfg->socket_ifname : getenv("PSHARD_SOCKET_IFNAME");
        char if_addr[INET_ADDRSTRLEN];
        if (ifname && *ifname) {
            PS_CHECK(pshard_socket_ifname_address(ifname, if_addr, sizeof(if_addr), err, errlen));
            lh = adv = if_addr;
        }
        PS_CHECK(listen_on(t, lh, "0", err, errlen));
        if (!adv)
            adv = lh;
        snprintf(my_addr, sizeof(my_addr), "%s:%d", adv, t->listen_port);
        pshard_status_t rc = exchange_via_store(t, cfg, my_addr, next_addr, sizeof(next_addr),
                                                deadline, err, errlen);
        if (rc != PSHARD_OK) {
            forget_address(t, cfg); /* see below */
            return rc;
        }
    }

    acceptor_t acc = {.t = t, .deadline = deadline, .fd = -1};
    pthread_t th;
    if (pthread_create(&th, NULL, acceptor_main, &acc) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot start the acceptor thread");
    pshard_status_t rc = connect_next(t, next_addr, deadline, err, errlen);
    pthread_join(th, NULL);
    tl_cancel = NULL;
    close(t->listen_fd);
    t->listen_fd = -1;
    /* Linked or failed, nobody may dial this address again (its listener is closed): a set-up
     * retried under the same name must not find it (a peer dialling it would retry a refused
     * port until the deadline). */
    if (!cfg->peers)
        forget_address(t, cfg);
    if (rc != PSHARD_OK) {
        if (acc.fd >= 0)
            close(acc.fd);
        return rc;
    }
    if (acc.rc != PSHARD_OK) {
        close(t->send_fd);
        t->send_fd = -1;
        return ps_errf(err, errlen, acc.rc, "%s", acc.err);
    }
    t->recv_fd = acc.fd;
    set_nonblocking(t->send_fd, true);
    set_nonblocking(t->recv_fd, true);
    PS_INFO(PS_SUB_COLL, "ring %s generation %llu: rank %d linked to %d (%s) and from %d",
            t->comm->name, (unsigned long long)t->comm->generation, t->rank, t->next, next_addr,
            t->prev);
    return tcp_choose_transport(t, mode, deadline, err, errlen);
}
