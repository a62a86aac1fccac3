/* Ring set-up for the tcp backend: listen, publish this rank's address (through the
 * coordinator's store or an explicit peer list), connect to the next rank and accept the
 * previous one, each link authenticated by an HMAC challenge over the cluster token and stamped
 * with the generation. Blocking code with deadlines; it runs before the engine thread starts. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "coll_tcp.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

#define STRAY_READ_MS 5000

static int split_host_port(const char *addr, char *host, size_t hostlen, char *port,
                           size_t portlen)
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

/* Acceptor side of one connection. Returns PSHARD_OK when it is the authenticated previous
 * rank; otherwise the connection was refused (reason in err). */
static pshard_status_t accept_handshake(tcp_t *t, int fd, const char *peer, char *err,
                                        size_t errlen)
{
    int64_t deadline = ps_now_ns() + (int64_t)STRAY_READ_MS * 1000000;
    uint8_t buf[COLL_FRAME_MAX_CONTROL];
    coll_frame_header_t h;
    PS_CHECK(recv_frame(fd, &h, buf, deadline, err, errlen));
    if (h.type != COLL_FRAME_HELLO)
        return ps_errf(err, errlen, PSHARD_ERR_PERMISSION, "expected HELLO, got frame type %u",
                       h.type);
    coll_hello_t hello;
    PS_CHECK(coll_hello_decode(buf, h.len, &hello, err, errlen));
    pshard_status_t rc = coll_hello_check(&hello, t->comm->generation, (uint32_t)t->n,
                                          (uint32_t)t->rank, t->comm->name, err, errlen);
    if (rc != PSHARD_OK) {
        send_reject(fd, err);
        return rc;
    }
    coll_challenge_t ch;
    coll_random_nonce(ch.nonce);
    coll_handshake_mac(t->key, t->keylen, 'A', &hello, ch.nonce, ch.mac);
    size_t n = coll_challenge_encode(&ch, buf, sizeof(buf));
    if (send_frame(fd, COLL_FRAME_CHALLENGE, buf, n, deadline) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_PEER_LOST, "%s went away", peer);
    PS_CHECK(recv_frame(fd, &h, buf, deadline, err, errlen));
    if (h.type != COLL_FRAME_AUTH)
        return ps_errf(err, errlen, PSHARD_ERR_PERMISSION, "expected AUTH, got frame type %u",
                       h.type);
    coll_auth_t auth;
    PS_CHECK(coll_auth_decode(buf, h.len, &auth, err, errlen));
    uint8_t expect[COLL_MAC_SIZE];
    coll_handshake_mac(t->key, t->keylen, 'C', &hello, ch.nonce, expect);
    if (!coll_mac_equal(expect, auth.mac)) {
        send_reject(fd, "wrong cluster token");
        return ps_errf(err, errlen, PSHARD_ERR_PERMISSION,
                       "%s claims rank %u but does not know the cluster token", peer,
                       hello.from_rank);
    }
    if (send_frame(fd, COLL_FRAME_ACCEPT, NULL, 0, deadline) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_PEER_LOST, "%s went away", peer);
    return PSHARD_OK;
}

typedef struct {
    tcp_t *t;
    int64_t deadline;
    int fd; /* result */
    pshard_status_t rc;
    char err[512];
} acceptor_t;

static void *acceptor_main(void *arg)
{
    acceptor_t *a = arg;
    tcp_t *t = a->t;
    tl_cancel = t->cancel;
    a->rc = PSHARD_ERR_TIMEOUT;
    snprintf(a->err, sizeof(a->err), "rank %d never connected to rank %d", t->prev, t->rank);
    while (ps_now_ns() < a->deadline && !cancelled()) {
        struct pollfd pfd = {t->listen_fd, POLLIN, 0};
        int r = poll(&pfd, 1, remaining_ms(a->deadline) < 200 ? remaining_ms(a->deadline) : 200);
        if (r <= 0)
            continue;
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        int fd = accept(t->listen_fd, (struct sockaddr *)&ss, &sl);
        if (fd < 0)
            continue;
        char peer[96] = "?";
        char host[64] = "", port[16] = "";
        if (getnameinfo((struct sockaddr *)&ss, sl, host, sizeof(host), port, sizeof(port),
                        NI_NUMERICHOST | NI_NUMERICSERV) == 0)
            snprintf(peer, sizeof(peer), "%s:%s", host, port);
        set_nonblocking(fd, false);
        char err[512] = "";
        if (accept_handshake(t, fd, peer, err, sizeof(err)) == PSHARD_OK) {
            a->fd = fd;
            a->rc = PSHARD_OK;
            return NULL;
        }
        PS_WARN(PS_SUB_COLL, "refused a ring connection from %s: %s", peer, err);
        close(fd);
    }
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
        return ps_errf(err, errlen, PSHARD_ERR_TIMEOUT, "cannot connect to rank %d at %s",
                       t->next, addr);

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
        rc = ps_errf(err, errlen, PSHARD_ERR_PERMISSION, "rank %d at %s refused us: %s",
                     t->next, addr, reason);
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
        rc = ps_errf(err, errlen, PSHARD_ERR_PERMISSION, "rank %d at %s refused us: %s",
                     t->next, addr, reason);
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
    ps_rpc_channel_config_t ccfg = {.target = cfg->coordinator, .token = cfg->token,
                                    .job = cfg->job};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&ccfg, err, errlen);
    if (!ch)
        return PSHARD_ERR_INVALID_ARGUMENT;
    char key[256], next_key[256];
    snprintf(key, sizeof(key), "pshard/coll/%s/g%llu/addr/%d", t->comm->name,
             (unsigned long long)t->comm->generation, t->rank);
    snprintf(next_key, sizeof(next_key), "pshard/coll/%s/g%llu/addr/%d", t->comm->name,
             (unsigned long long)t->comm->generation, t->next);
    Pshard__StoreSetRequest set = PSHARD__STORE_SET_REQUEST__INIT;
    set.key = key;
    set.value.data = (uint8_t *)my_addr;
    set.value.len = strlen(my_addr);
    ProtobufCMessage *resp = NULL;
    int64_t left_ms = (deadline - ps_now_ns()) / 1000000;
    pshard_status_t rc = ps_rpc_unary(ch, "/pshard.Coordinator/StoreSet", &set.base,
                                      &pshard__store_set_response__descriptor, &resp,
                                      left_ms > 1 ? left_ms : 1, PS_RPC_IDEMPOTENT, NULL, err,
                                      errlen);
    if (resp)
        protobuf_c_message_free_unpacked(resp, NULL);
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
        Pshard__StoreWaitRequest w = PSHARD__STORE_WAIT_REQUEST__INIT;
        char *keys[1] = {next_key};
        w.n_keys = 1;
        w.keys = keys;
        w.timeout_ms = left_ms < 500 ? left_ms : 500;
        resp = NULL;
        char werr[512] = "";
        pshard_status_t wrc = ps_rpc_unary(ch, "/pshard.Coordinator/StoreWait", &w.base,
                                           &pshard__store_wait_response__descriptor, &resp,
                                           w.timeout_ms + 5000, PS_RPC_IDEMPOTENT, NULL, werr,
                                           sizeof(werr));
        if (wrc == PSHARD_ERR_TIMEOUT)
            continue;
        if (wrc != PSHARD_OK) {
            rc = ps_errf(err, errlen, wrc, "%s", werr);
            break;
        }
        Pshard__StoreWaitResponse *r = (Pshard__StoreWaitResponse *)resp;
        if (r->n_values != 1 || r->values[0].len == 0 || r->values[0].len >= len) {
            rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                         "store key %s holds no usable address", next_key);
        } else {
            memcpy(next_addr, r->values[0].data, r->values[0].len);
            next_addr[r->values[0].len] = '\0';
        }
        protobuf_c_message_free_unpacked(resp, NULL);
        break;
    }
    ps_rpc_channel_destroy(ch);
    return rc;
}

pshard_status_t tcp_connect_ring(tcp_t *t, const pshard_comm_config_t *cfg, char *err,
                                 size_t errlen)
{
    int64_t connect_ms = cfg->connect_timeout_ms > 0 ? cfg->connect_timeout_ms : 60000;
    t->cancel = cfg->cancel;
    tl_cancel = cfg->cancel;
    int64_t deadline = ps_now_ns() + connect_ms * 1000000;
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
        PS_CHECK(listen_on(t, lh, "0", err, errlen));
        const char *adv = cfg->advertise_host ? cfg->advertise_host : lh;
        snprintf(my_addr, sizeof(my_addr), "%s:%d", adv, t->listen_port);
        pshard_status_t rc = exchange_via_store(t, cfg, my_addr, next_addr, sizeof(next_addr),
                                                deadline, err, errlen);
        if (rc != PSHARD_OK)
            return rc;
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
    return PSHARD_OK;
}
