/* The coordinator pshardrun starts (or the one it is given), and the rendezvous around it: the
 * coordinator's address, multi-node addresses, and torch's MASTER_ADDR:MASTER_PORT of each
 * attempt, which node 0 publishes in the coordinator's store for the other nodes. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "pshard/coord_client.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

#include "run.h"

/* Splits "HOST:PORT" (or "[V6]:PORT") into the run's MASTER_ADDR and MASTER_PORT.
 * Returns 0, or -1 when it is not of that form. */
int run_parse_coordinator(run_t *run, const char *addr, bool allow_port_zero)
{
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr)
        return -1;
    int64_t port;
    if (ps_parse_i64(colon + 1, allow_port_zero ? 0 : 1, 65535, &port) != 0)
        return -1;
    const char *host = addr;
    size_t hlen = (size_t)(colon - addr);
    if (hlen >= 2 && host[0] == '[' && host[hlen - 1] == ']') {
        host++;
        hlen -= 2;
    }
    if (hlen == 0 || hlen >= sizeof(run->master_addr))
        return -1;
    memcpy(run->master_addr, host, hlen);
    run->master_addr[hlen] = '\0';
    run->master_port = (int)port;
    return ps_strlcpy(run->coord_addr, addr, sizeof(run->coord_addr));
}

/* The address of this host that host:port is reached from (what a UDP socket connected there
 * is bound to: no packet is sent), into out; what names host in messages ("--rdzv-endpoint
 * host"). Returns 0, or -1 after saying why. */
static int run_route_address(const char *what, const char *host, int port, char *out, size_t outlen)
{
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_DGRAM}, *ai = NULL;
    char service[16];
    ps_snprintf(service, sizeof(service), "%d", port ? port : 9);
    int rc = getaddrinfo(host, service, &hints, &ai);
    if (rc != 0 || !ai) {
        fprintf(stderr, RUN_PROG ": %s '%s': %s\n", what, host,
                rc ? gai_strerror(rc) : "no IPv4 address");
        return -1;
    }
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in me;
    socklen_t len = sizeof(me);
    bool ok = fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
              getsockname(fd, (struct sockaddr *)&me, &len) == 0 &&
              inet_ntop(AF_INET, &me.sin_addr, out, (socklen_t)outlen);
    int e = errno;
    if (fd >= 0)
        close(fd);
    freeaddrinfo(ai);
    if (!ok)
        fprintf(stderr,
                RUN_PROG ": no route from this node to the %s %s: %s (set "
                         "PSHARD_SOCKET_IFNAME to choose the interface)\n",
                what, host, strerror(e));
    return ok ? 0 : -1;
}

/* Multi-node: the address of this host that the rendezvous endpoint is reached from, for the
 * shard servers' rings, unless PSHARD_SOCKET_IFNAME or PSHARD_DATA_HOST chooses. Returns 0, or
 * -1 after saying why. */
int run_local_address(run_t *run)
{
    const char *ifname = getenv("PSHARD_SOCKET_IFNAME"), *dh = getenv("PSHARD_DATA_HOST");
    if ((ifname && *ifname) || (dh && *dh))
        return 0; /* the servers read it themselves */
    if (run_route_address("--rdzv-endpoint host", run->master_addr, run->master_port,
                          run->data_host, sizeof(run->data_host)) != 0) {
        run->data_host[0] = '\0';
        return -1;
    }
    PS_INFO(PS_SUB_MAIN, "node %d: shard servers' rings listen on %s", run->node_rank,
            run->data_host);
    return 0;
}

/* Starts the coordinator pshardrun owns and waits for its port. */
void run_start_coordinator(run_t *run, const char *bin)
{
    run_child_t *c = run->coord;
    ps_snprintf(c->port_file, sizeof(c->port_file), "%s/coordinator.port", run->tmpdir);
    char world[48], lease[24], heartbeat[24], last_call[24];
    long long n = (long long)run->opts->nproc;
    if (run->nnodes_min < run->nnodes)
        ps_snprintf(world, sizeof(world), "%lld:%lld", n * run->nnodes_min, n * run->nnodes);
    else
        ps_snprintf(world, sizeof(world), "%lld", n * run->nnodes);
    char *argv[20];
    int a = 0;
    argv[a++] = (char *)bin;
    argv[a++] = "--listen";
    argv[a++] = run->endpoint ? run->coord_addr : "127.0.0.1:0";
    argv[a++] = "--port-file";
    argv[a++] = c->port_file;
    /* An elastic job forms with MIN to MAX nodes' servers, torchrun's rendezvous in
     * pshard-coordinator's terms. */
    argv[a++] = run->nnodes_min < run->nnodes ? "--nnodes" : "--world-size";
    argv[a++] = world;
    if (run->last_call_ms > 0) {
        ps_snprintf(last_call, sizeof(last_call), "%lld", (long long)run->last_call_ms);
        argv[a++] = "--last-call-ms";
        argv[a++] = last_call;
    }
    argv[a++] = "--log";
    argv[a++] = run->opts->log;
    if (run->opts->lease_ms > 0) {
        /* Members heartbeat as often as the coordinator says; keep at least three beats per
         * lease so a short lease does not evict healthy members. */
        int64_t beat = run->opts->lease_ms / 3;
        if (beat > 1000)
            beat = 1000;
        if (beat < 1)
            beat = 1;
        ps_snprintf(lease, sizeof(lease), "%lld", (long long)run->opts->lease_ms);
        ps_snprintf(heartbeat, sizeof(heartbeat), "%lld", (long long)beat);
        argv[a++] = "--lease-ms";
        argv[a++] = lease;
        argv[a++] = "--heartbeat-ms";
        argv[a++] = heartbeat;
    }
    if (run->opts->token_file) {
        argv[a++] = "--token-file";
        argv[a++] = run->opts->token_file;
    }
    argv[a] = NULL;
    if (run_spawn(run, c, bin, argv, NULL, 0) != 0) {
        run_set_stop(run, STOP_STARTUP, 1);
        return;
    }
    run_wait_ports(run, c, 1);
    if (run->stop != STOP_NONE)
        return;
    if (run->endpoint) {
        /* Listening on the endpoint the other nodes were given; port 0 picked one, which they
         * learn from this line. */
        if (run->master_port == 0) {
            run->master_port = c->port;
            ps_snprintf(run->coord_addr, sizeof(run->coord_addr), "%s%s%s:%d",
                        strchr(run->master_addr, ':') ? "[" : "", run->master_addr,
                        strchr(run->master_addr, ':') ? "]" : "", c->port);
        }
        fprintf(stderr, RUN_PROG ": coordinator for %s nodes on %s\n", run->opts->nnodes,
                run->coord_addr);
        return;
    }
    ps_snprintf(run->coord_addr, sizeof(run->coord_addr), "127.0.0.1:%d", c->port);
    ps_strlcpy(run->master_addr, "127.0.0.1", sizeof(run->master_addr));
    run->master_port = c->port;
    PS_INFO(PS_SUB_MAIN, "coordinator serving on %s", run->coord_addr);
}

/* A TCP port free on host now (bound to port 0, read back, closed), for torch's TCPStore,
 * which rank 0 binds moments later as torchrun's own pick is; host NULL: every address.
 * Returns the port, or -1 after saying why. */
static int run_free_port(const char *host)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    if (host && inet_pton(AF_INET, host, &a.sin_addr) != 1)
        a.sin_addr.s_addr = htonl(INADDR_ANY);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t len = sizeof(a);
    bool ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
              getsockname(fd, (struct sockaddr *)&a, &len) == 0;
    int e = errno;
    if (fd >= 0)
        close(fd);
    if (!ok) {
        fprintf(stderr, RUN_PROG ": cannot find a free port for torch's MASTER_PORT: %s\n",
                strerror(e));
        return -1;
    }
    return ntohs(a.sin_port);
}

/* A channel to the job's coordinator for pshardrun's own store keys; NULL after saying why. */
static ps_rpc_channel_t *run_coord_channel(run_t *run)
{
    char err[PSHARD_ERRLEN] = "";
    char *token = NULL;
    if (run->opts->token_file) {
        token = ps_read_token(run->opts->token_file, err, sizeof(err));
        if (!token) {
            fprintf(stderr, RUN_PROG ": %s\n", err);
            return NULL;
        }
    }
    const char *ca = getenv("PSHARD_COORDINATOR_CA");
    ps_rpc_channel_config_t cc = {.target = run->coord_addr,
                                  .token = token,
                                  .tls_ca_file = ca && *ca ? ca : NULL,
                                  .job = run->job[0] ? run->job : NULL};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&cc, err, sizeof(err));
    free(token);
    if (!ch)
        fprintf(stderr, RUN_PROG ": cannot reach coordinator %s: %s\n", run->coord_addr, err);
    return ch;
}

/* Multi-node, other than node 0: waits for node 0's MASTER_ADDR:PORT of this attempt in the
 * coordinator's store (in short waits, so that signals and dying children are seen), up to
 * --rdzv-conf join_timeout, or else the larger of --start-timeout-ms and torch's store timeout.
 * Returns 0, or -1 after saying why. */
static int run_await_torch_master(run_t *run, ps_rpc_channel_t *ch, const char *key)
{
    int64_t wait_ms = run->join_timeout_ms > 0 ? run->join_timeout_ms
                      : run->opts->start_timeout_ms > RUN_TORCH_MASTER_WAIT_MS
                          ? run->opts->start_timeout_ms
                          : RUN_TORCH_MASTER_WAIT_MS;
    int64_t deadline = ps_now_ns() + wait_ms * 1000000;
    char err[PSHARD_ERRLEN] = "";
    for (;;) {
        run_pump(run, ps_now_ns());
        if (run->stop != STOP_NONE)
            return -1;
        Pshard__StoreWaitResponse *values = NULL;
        pshard_status_t rc = ps_coord_store_await(ch, &key, 1, 1000, &values, err, sizeof(err));
        if (rc == PSHARD_OK) {
            bool ok = values->n_values == 1 && values->values[0].len > 0 &&
                      values->values[0].len < sizeof(run->torch_addr);
            char text[sizeof(run->torch_addr)] = "";
            if (ok) {
                memcpy(text, values->values[0].data, values->values[0].len);
                text[values->values[0].len] = '\0';
            }
            protobuf_c_message_free_unpacked(&values->base, NULL);
            char *colon = strrchr(text, ':');
            int64_t port = 0;
            if (!ok || !colon || colon == text || ps_parse_i64(colon + 1, 1, 65535, &port) != 0) {
                fprintf(stderr,
                        RUN_PROG ": node 0 published '%s' as torch's MASTER_ADDR:PORT "
                                 "(key %s); expected HOST:PORT\n",
                        text, key);
                return -1;
            }
            *colon = '\0';
            ps_strlcpy(run->torch_addr, text, sizeof(run->torch_addr));
            run->torch_port = (int)port;
            return 0;
        }
        if (rc != PSHARD_ERR_TIMEOUT && rc != PSHARD_ERR_UNAVAILABLE) {
            fprintf(stderr, RUN_PROG ": waiting for node 0's MASTER_PORT (key %s on %s): %s\n", key,
                    run->coord_addr, err);
            return -1;
        }
        if (ps_now_ns() >= deadline) {
            fprintf(stderr,
                    RUN_PROG ": node 0 did not publish torch's MASTER_ADDR:PORT (key %s on "
                             "coordinator %s) within %lld ms: is node 0's pshardrun running "
                             "with the same --rdzv-endpoint/--coordinator and --rdzv-id? (%s)\n",
                    key, run->coord_addr, (long long)wait_ms, err);
            return -1;
        }
    }
}

/* Chooses what trainers get as MASTER_ADDR and MASTER_PORT for this attempt: a port where rank
 * 0's torch can host its TCPStore (env://), as torchrun does, never the gRPC coordinator. One
 * node: a free port on 127.0.0.1. Several: node 0 (the node of rank 0) picks a free port and
 * publishes its address as the other nodes reach it (the rendezvous endpoint's host, or the address
 * it reaches the coordinator from) in the coordinator's store, where the other nodes wait for it.
 * On failure stops the run (STOP_STARTUP) after saying why. */
void run_choose_torch_master(run_t *run)
{
    if (run->nnodes <= 1) {
        ps_strlcpy(run->torch_addr, "127.0.0.1", sizeof(run->torch_addr));
        run->torch_port = run_free_port("127.0.0.1");
        if (run->torch_port < 0)
            run_set_stop(run, STOP_STARTUP, 1);
        return;
    }
    char key[64];
    ps_snprintf(key, sizeof(key), RUN_TORCH_MASTER_KEY "%lld", (long long)run->attempt);
    ps_rpc_channel_t *ch = run_coord_channel(run);
    int rc = ch ? 0 : -1;
    if (rc == 0 && run->rank_base == 0) {
        if (run->endpoint)
            rc = ps_strlcpy(run->torch_addr, run->master_addr, sizeof(run->torch_addr));
        else
            rc = run_route_address("coordinator host", run->master_addr, run->master_port,
                                   run->torch_addr, sizeof(run->torch_addr));
        run->torch_port = rc == 0 ? run_free_port(NULL) : -1;
        rc = run->torch_port > 0 ? 0 : -1;
        char value[300], err[PSHARD_ERRLEN] = "";
        if (rc == 0) {
            bool v6 = strchr(run->torch_addr, ':') != NULL;
            ps_snprintf(value, sizeof(value), "%s%s%s:%d", v6 ? "[" : "", run->torch_addr,
                        v6 ? "]" : "", run->torch_port);
            if (ps_coord_store_put(ch, key, value, strlen(value), 30000, err, sizeof(err)) !=
                PSHARD_OK) {
                fprintf(stderr, RUN_PROG ": cannot publish torch's MASTER_ADDR:PORT on %s: %s\n",
                        run->coord_addr, err);
                rc = -1;
            }
        }
    } else if (rc == 0) {
        rc = run_await_torch_master(run, ch, key);
        /* A bracketed IPv6 address as published: torch wants it bare. */
        size_t n = strlen(run->torch_addr);
        if (rc == 0 && n >= 2 && run->torch_addr[0] == '[' && run->torch_addr[n - 1] == ']') {
            memmove(run->torch_addr, run->torch_addr + 1, n - 2);
            run->torch_addr[n - 2] = '\0';
        }
    }
    ps_rpc_channel_destroy(ch);
    if (rc != 0)
        run_set_stop(run, STOP_STARTUP, 1);
    else
        PS_INFO(PS_SUB_MAIN, "torch's MASTER_ADDR:MASTER_PORT for attempt %lld: %s:%d",
                (long long)run->attempt, run->torch_addr, run->torch_port);
}

/* The job's Status once it has formed: each local server's rank by its name. Returns 1 when
 * every rank is known (run->rank_base and run->world set), 0 while the job forms, -1 after
 * saying why it never will for this node. */
static int run_ranks_from_status(run_t *run, const Pshard__StatusResponse *st)
{
    int n = (int)run->opts->nproc;
    if (st->formed_generation == 0 || st->world_size <= 0)
        return 0;
    int base = -1;
    for (int r = 0; r < n; r++) {
        int rank = -1;
        for (size_t i = 0; i < st->n_members; i++) {
            const Pshard__Member *m = st->members[i];
            if (m->role == PSHARD__ROLE__SHARD_SERVER && m->name &&
                strcmp(m->name, run->servers[r].name) == 0)
                rank = m->rank;
        }
        if (rank < 0) {
            fprintf(stderr,
                    RUN_PROG ": the job formed with %d shard servers without this node's "
                             "server %s: a node that comes after an elastic --nnodes %s job "
                             "started does not join it\n",
                    st->world_size, run->servers[r].name, run->opts->nnodes);
            return -1;
        }
        if (r == 0)
            base = rank;
        if (rank != base + r || base % n != 0) {
            fprintf(stderr,
                    RUN_PROG ": this node's shard servers got ranks out of order (server %s "
                             "has rank %d, the first %d): is another node using node rank %d?\n",
                    run->servers[r].name, rank, base, run->node_rank);
            return -1;
        }
    }
    /* The coordinator's answer is checked, not trusted: every trainer's RANK must be below
     * WORLD_SIZE, and GROUP_WORLD_SIZE is whole nodes. */
    if (base + n > st->world_size || st->world_size % n != 0) {
        fprintf(stderr,
                RUN_PROG ": the job formed with %d shard servers, which is not whole nodes of %d "
                         "holding ranks %d..%d: does every node give the same --nproc-per-node?\n",
                st->world_size, n, base, base + n - 1);
        return -1;
    }
    run->rank_base = base;
    run->world = st->world_size;
    return 1;
}

void run_learn_ranks(run_t *run)
{
    int n = (int)run->opts->nproc;
    if (run->nnodes_min == run->nnodes) {
        run->rank_base = run->node_rank * n;
        run->world = n * run->nnodes;
        return;
    }
    ps_rpc_channel_t *ch = run_coord_channel(run);
    if (!ch) {
        run_set_stop(run, STOP_STARTUP, 1);
        return;
    }
    int64_t wait_ms = run->join_timeout_ms > 0 ? run->join_timeout_ms
                      : run->opts->start_timeout_ms > RUN_TORCH_MASTER_WAIT_MS
                          ? run->opts->start_timeout_ms
                          : RUN_TORCH_MASTER_WAIT_MS;
    int64_t deadline = ps_now_ns() + wait_ms * 1000000;
    char err[PSHARD_ERRLEN] = "not asked yet";
    int got = 0;
    while (got == 0 && run->stop == STOP_NONE) {
        Pshard__StatusRequest req = PSHARD__STATUS_REQUEST__INIT;
        Pshard__StatusResponse *st = NULL;
        pshard_status_t rc = ps_coord_rpc_status(ch, &req, &st, 5000, err, sizeof(err));
        if (rc == PSHARD_OK) {
            got = run_ranks_from_status(run, st);
            if (got == 0)
                ps_snprintf(err, sizeof(err), "%s",
                            st->awaiting && *st->awaiting ? st->awaiting
                                                          : "the job has not formed");
            protobuf_c_message_free_unpacked(&st->base, NULL);
        }
        if (got == 0 && ps_now_ns() >= deadline) {
            fprintf(stderr,
                    RUN_PROG ": the job did not form with --nnodes %s within %lld ms (%s)\n",
                    run->opts->nnodes, (long long)wait_ms, err);
            got = -1;
        }
        if (got == 0)
            run_pump(run, ps_now_ns() + 100 * 1000000LL);
    }
    ps_rpc_channel_destroy(ch);
    if (got != 1) {
        run_set_stop(run, STOP_STARTUP, 1);
        return;
    }
    for (int r = 0; r < n; r++) {
        run_child_relabel(&run->servers[r], run->rank_base + r);
        run_child_relabel(&run->trainers[r], run->rank_base + r);
    }
    fprintf(stderr, RUN_PROG ": node %d joined the job as ranks %d..%d of %d\n", run->node_rank,
            run->rank_base, run->rank_base + n - 1, run->world);
}

void run_declare_lost(run_t *run, const char *name, const char *why)
{
    if (!run->coord_addr[0])
        return;
    ps_rpc_channel_t *ch = run_coord_channel(run);
    if (!ch)
        return;
    char err[PSHARD_ERRLEN] = "";
    Pshard__LeaveRequest req = PSHARD__LEAVE_REQUEST__INIT;
    req.name = (char *)name;
    req.lost = (char *)why;
    pshard_status_t rc = ps_coord_rpc_leave(ch, &req, NULL, 2000, err, sizeof(err));
    /* NOT_FOUND: its lease lapsed already, or it never registered; nothing to hurry. */
    if (rc != PSHARD_OK && rc != PSHARD_ERR_NOT_FOUND)
        fprintf(stderr, RUN_PROG ": could not tell the coordinator that %s is lost: %s\n", name,
                err);
    ps_rpc_channel_destroy(ch);
}

int run_store_get(run_t *run, const char *key, char **value)
{
    *value = NULL;
    ps_rpc_channel_t *ch = run_coord_channel(run);
    if (!ch)
        return -1;
    char err[PSHARD_ERRLEN] = "";
    size_t len = 0;
    pshard_status_t rc = ps_coord_store_fetch(ch, key, value, &len, 2000, err, sizeof(err));
    ps_rpc_channel_destroy(ch);
    if (rc == PSHARD_OK)
        return 1;
    if (rc == PSHARD_ERR_NOT_FOUND)
        return 0;
    fprintf(stderr, RUN_PROG ": cannot read store key %s on coordinator %s: %s\n", key,
            run->coord_addr, err);
    return -1;
}
