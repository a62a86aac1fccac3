/* A shard server whose RPC workers are all held by trainer operations that cannot finish (a
 * Collective that no peer joins) still answers Status and health at once, and its health says
 * it cannot serve: "pshard.ShardServer" NOT_SERVING while a call waits for a worker, SERVING
 * again once the peer joins and the operations complete; "" (liveness) stays SERVING
 * throughout, and /metrics keeps answering. A real 2-rank cluster on loopback ports.
 * argv: pshard-coordinator pshard-server. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <time.h>
#include <unistd.h>

#include "grpc/health/v1/health.pb-c.h"
#include "ps_proc.h"
#include "ps_test.h"
#include "pshard/rpc.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"

#define NCALLS 7 /* more than the server's 4 workers */
#define SCRATCH 4096
#define STATUS_BUDGET_MS 2000

static const char *coord_bin, *server_bin;

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

/* Health of service on ch within 2 s: 1 SERVING, 2 NOT_SERVING, -1 when no answer. */
static int health(ps_rpc_channel_t *ch, const char *service)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)service;
    ProtobufCMessage *resp = NULL;
    char err[256] = "";
    if (ps_rpc_unary(ch, "/grpc.health.v1.Health/Check", &req.base,
                     &grpc__health__v1__health_check_response__descriptor, &resp, 2000, 0, NULL,
                     err, sizeof(err)) != PSHARD_OK)
        return -1;
    int st = ((Grpc__Health__V1__HealthCheckResponse *)resp)->status;
    protobuf_c_message_free_unpacked(resp, NULL);
    return st;
}

/* Polls health of service until it is want or timeout_ms passes; true when it got there. */
static bool wait_health(ps_rpc_channel_t *ch, const char *service, int want, int64_t timeout_ms)
{
    int64_t end = ps_now_ns() + timeout_ms * 1000000;
    for (;;) {
        if (health(ch, service) == want)
            return true;
        if (ps_now_ns() > end)
            return false;
        sleep_ms(20);
    }
}

/* Status within timeout_ms; NULL (and the reason on stderr) otherwise. */
static Pshard__ShardStatusResponse *status(ps_rpc_channel_t *ch, int64_t timeout_ms)
{
    Pshard__ShardStatusRequest req = PSHARD__SHARD_STATUS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    char err[512] = "";
    pshard_status_t rc = ps_rpc_unary(ch, "/pshard.ShardServer/Status", &req.base,
                                      &pshard__shard_status_response__descriptor, &resp, timeout_ms,
                                      0, NULL, err, sizeof(err));
    if (rc != PSHARD_OK)
        fprintf(stderr, "  Status: %s: %s\n", pshard_status_name(rc), err);
    return (Pshard__ShardStatusResponse *)resp;
}

/* GET /metrics on 127.0.0.1:port within timeout_ms: the whole response (malloc'd, free it), or
 * NULL. */
static char *http_get(int port, const char *path, int64_t timeout_ms)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return NULL;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    char req[256];
    int n = snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0 || write(fd, req, (size_t)n) != n) {
        close(fd);
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    int64_t end = ps_now_ns() + timeout_ms * 1000000;
    while (buf) {
        int64_t left = (end - ps_now_ns()) / 1000000;
        struct pollfd p = {fd, POLLIN, 0};
        if (left <= 0 || poll(&p, 1, (int)left) != 1) {
            free(buf);
            buf = NULL;
            break;
        }
        if (len + 4096 > cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
        ssize_t r = read(fd, buf + len, cap - len - 1);
        if (r <= 0)
            break;
        len += (size_t)r;
    }
    close(fd);
    if (buf)
        buf[len] = '\0';
    return buf;
}

/* ---------------------------------------------------------------------------------------- */

typedef struct {
    pid_t coord, servers[2];
    char dir[64];
    char addr[2][64];
    int metrics_port[2];
    ps_rpc_channel_t *ch[2];
    int rank_of[2];
} cluster_t;

static cluster_t cl;
static bool cl_ok;

static bool cluster_start(void)
{
    memset(&cl, 0, sizeof(cl));
    cl.servers[0] = cl.servers[1] = -1;
    const char *cargs[] = {"--world-size", "2", NULL};
    char target[64];
    cl.coord = ps_proc_start_coordinator(coord_bin, cargs, target, sizeof(target));
    if (cl.coord < 0)
        return false;
    ps_strlcpy(cl.dir, "/tmp/pshard-shard-busy-XXXXXX", sizeof(cl.dir));
    if (!mkdtemp(cl.dir))
        return false;
    for (int r = 0; r < 2; r++) {
        char name[32], port_file[128], mport_file[128], log[128];
        snprintf(name, sizeof(name), "busy-%d", r);
        snprintf(port_file, sizeof(port_file), "%s/server-%d.port", cl.dir, r);
        snprintf(mport_file, sizeof(mport_file), "%s/server-%d.metrics-port", cl.dir, r);
        snprintf(log, sizeof(log), "%s/server-%d.log", cl.dir, r);
        char *argv[] = {(char *)server_bin,
                        "--coordinator",
                        target,
                        "--name",
                        name,
                        "--port-file",
                        port_file,
                        "--metrics-listen",
                        "127.0.0.1:0",
                        "--metrics-port-file",
                        mport_file,
                        "--coll-timeout-ms",
                        "120000",
                        "--log",
                        "info",
                        NULL};
        cl.servers[r] = ps_proc_spawn(argv, log);
    }
    for (int r = 0; r < 2; r++) {
        char port_file[128], mport_file[128];
        snprintf(port_file, sizeof(port_file), "%s/server-%d.port", cl.dir, r);
        snprintf(mport_file, sizeof(mport_file), "%s/server-%d.metrics-port", cl.dir, r);
        int port = ps_proc_wait_port_file(port_file, cl.servers[r], 15000);
        cl.metrics_port[r] = ps_proc_wait_port_file(mport_file, cl.servers[r], 1000);
        if (port < 0 || cl.metrics_port[r] < 0) {
            fprintf(stderr, "server %d did not start (logs in %s)\n", r, cl.dir);
            return false;
        }
        snprintf(cl.addr[r], sizeof(cl.addr[r]), "127.0.0.1:%d", port);
        char err[256] = "";
        ps_rpc_channel_config_t cfg = {.target = cl.addr[r], .own_connection = true};
        cl.ch[r] = ps_rpc_channel_create(&cfg, err, sizeof(err));
        if (!cl.ch[r])
            return false;
    }
    for (int r = 0; r < 2; r++) {
        if (!wait_health(cl.ch[r], "pshard.ShardServer", 1, 60000)) {
            fprintf(stderr, "server %d never became SERVING (logs in %s)\n", r, cl.dir);
            return false;
        }
        Pshard__ShardStatusResponse *st = status(cl.ch[r], 5000);
        if (!st)
            return false;
        cl.rank_of[r] = st->rank;
        protobuf_c_message_free_unpacked(&st->base, NULL);
    }
    return cl.rank_of[0] != cl.rank_of[1];
}

static bool cluster_stop(void)
{
    bool ok = true;
    for (int r = 0; r < 2; r++) {
        if (cl.ch[r])
            ps_rpc_channel_destroy(cl.ch[r]);
        cl.ch[r] = NULL;
        if (cl.servers[r] > 0) {
            int code = ps_proc_stop(cl.servers[r], 15000);
            if (code != 0) {
                fprintf(stderr, "server %d exited with %d (logs in %s)\n", r, code, cl.dir);
                ok = false;
            }
        }
        cl.servers[r] = -1;
    }
    if (cl.coord > 0)
        ps_proc_stop(cl.coord, 10000);
    cl.coord = -1;
    if (ok && cl.dir[0]) {
        const char *files[] = {"log", "port", "metrics-port"};
        for (int r = 0; r < 2; r++) {
            for (size_t i = 0; i < PS_ARRAY_LEN(files); i++) {
                char p[160];
                snprintf(p, sizeof(p), "%s/server-%d.%s", cl.dir, r, files[i]);
                unlink(p);
            }
        }
        rmdir(cl.dir);
    }
    return ok;
}

/* A trainer: its scratch region in shared memory and its session. */
typedef struct {
    char shm[64];
    void *base;
    char session[64];
} trainer_t;

static bool trainer_attach(trainer_t *t, int idx)
{
    snprintf(t->shm, sizeof(t->shm), "/pshard-test-busy-%d-%d", (int)getpid(), idx);
    int fd = shm_open(t->shm, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || ftruncate(fd, SCRATCH) != 0) {
        if (fd >= 0)
            close(fd);
        return false;
    }
    t->base = mmap(NULL, SCRATCH, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (t->base == MAP_FAILED)
        return false;
    Pshard__AttachRequest req = PSHARD__ATTACH_REQUEST__INIT;
    req.rank = cl.rank_of[idx];
    req.shm_name = t->shm;
    req.shm_bytes = SCRATCH;
    req.trainer_name = "test_shard_busy";
    ProtobufCMessage *resp = NULL;
    char err[512] = "";
    if (ps_rpc_unary(cl.ch[idx], "/pshard.ShardServer/Attach", &req.base,
                     &pshard__attach_response__descriptor, &resp, 10000, 0, NULL, err,
                     sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "  Attach: %s\n", err);
        return false;
    }
    ps_strlcpy(t->session, ((Pshard__AttachResponse *)resp)->session, sizeof(t->session));
    protobuf_c_message_free_unpacked(resp, NULL);
    return true;
}

static void trainer_free(trainer_t *t)
{
    if (t->base && t->base != MAP_FAILED)
        munmap(t->base, SCRATCH);
    if (t->shm[0])
        shm_unlink(t->shm);
    memset(t, 0, sizeof(*t));
}

/* One all-reduce of 4 fp32 values in the scratch region, on its own thread. */
typedef struct {
    pthread_t thread;
    ps_rpc_channel_t *ch;
    const char *session;
    pshard_status_t rc;
    char err[512];
} coll_call_t;

static void *coll_main(void *arg)
{
    coll_call_t *c = arg;
    Pshard__CollectiveRequest req = PSHARD__COLLECTIVE_REQUEST__INIT;
    req.session = (char *)c->session;
    req.op = 3; /* all_reduce */
    req.dtype = PSHARD__DTYPE__FP32;
    req.count = 4;
    req.send_offset = 0;
    req.recv_offset = 64;
    ProtobufCMessage *resp = NULL;
    c->rc = ps_rpc_unary(c->ch, "/pshard.ShardServer/Collective", &req.base,
                         &pshard__collective_response__descriptor, &resp, 90000, 0, NULL, c->err,
                         sizeof(c->err));
    if (resp)
        protobuf_c_message_free_unpacked(resp, NULL);
    return NULL;
}

static void start_calls(coll_call_t *calls, ps_rpc_channel_t *ch, const char *session)
{
    for (int i = 0; i < NCALLS; i++) {
        calls[i].ch = ch;
        calls[i].session = session;
        calls[i].rc = PSHARD_ERR_INTERNAL;
        pthread_create(&calls[i].thread, NULL, coll_main, &calls[i]);
    }
}

static void test_status_and_health_while_pool_is_stuck(void)
{
    CU_ASSERT_FATAL(cl_ok);
    trainer_t a = {0}, b = {0};
    CU_ASSERT_FATAL(trainer_attach(&a, 0));
    /* Rank of server 0 only: its first Collective waits in the agreement for a peer that never
     * comes; the rest wait for op_mu, then for a worker. */
    coll_call_t on_a[NCALLS];
    start_calls(on_a, cl.ch[0], a.session);

    /* The rule: NOT_SERVING once a call has waited for a worker for a second. Every probe
     * answers within its own 2 s deadline (health returns -1 otherwise). */
    bool not_serving = wait_health(cl.ch[0], "pshard.ShardServer", 2, 15000);
    CU_ASSERT(not_serving);
    if (!not_serving)
        fprintf(stderr, "  server 0 never reported NOT_SERVING with its workers stuck\n");
    CU_ASSERT_EQUAL(health(cl.ch[0], ""), 1);                   /* liveness: the process serves */
    CU_ASSERT_EQUAL(health(cl.ch[1], "pshard.ShardServer"), 1); /* its peer is not stuck */

    /* Status answers within ~2 s, and says what is stuck. */
    for (int i = 0; i < 3; i++) {
        int64_t t0 = ps_now_ns();
        Pshard__ShardStatusResponse *st = status(cl.ch[0], STATUS_BUDGET_MS);
        double ms = (double)(ps_now_ns() - t0) / 1e6;
        CU_ASSERT_PTR_NOT_NULL(st);
        CU_ASSERT(ms < STATUS_BUDGET_MS);
        fprintf(stderr, "  Status with every worker stuck: %.1f ms\n", ms);
        if (st) {
            CU_ASSERT(st->attached);
            CU_ASSERT(st->n_flight_records >= 1);
            protobuf_c_message_free_unpacked(&st->base, NULL);
        }
    }
    /* /metrics keeps answering and agrees. */
    int64_t t0 = ps_now_ns();
    char *text = http_get(cl.metrics_port[0], "/metrics", STATUS_BUDGET_MS);
    CU_ASSERT_PTR_NOT_NULL(text);
    fprintf(stderr, "  /metrics with every worker stuck: %.1f ms\n",
            (double)(ps_now_ns() - t0) / 1e6);
    if (text) {
        CU_ASSERT(strncmp(text, "HTTP/1.1 200", 12) == 0 || strncmp(text, "HTTP/1.0 200", 12) == 0);
        CU_ASSERT(strstr(text, "\npshard_shard_serving 0\n") != NULL);
        CU_ASSERT(strstr(text, "\npshard_rpc_workers_busy 4\n") != NULL);
        free(text);
    }

    /* The peer's trainer runs the same collectives: everything completes, and server 0 serves
     * again. */
    CU_ASSERT_FATAL(trainer_attach(&b, 1));
    coll_call_t on_b[NCALLS];
    start_calls(on_b, cl.ch[1], b.session);
    for (int i = 0; i < NCALLS; i++) {
        pthread_join(on_a[i].thread, NULL);
        pthread_join(on_b[i].thread, NULL);
        if (on_a[i].rc != PSHARD_OK || on_b[i].rc != PSHARD_OK)
            fprintf(stderr, "  collective %d: %s / %s: %s%s\n", i, pshard_status_name(on_a[i].rc),
                    pshard_status_name(on_b[i].rc), on_a[i].err, on_b[i].err);
        CU_ASSERT_EQUAL(on_a[i].rc, PSHARD_OK);
        CU_ASSERT_EQUAL(on_b[i].rc, PSHARD_OK);
    }
    bool serving = wait_health(cl.ch[0], "pshard.ShardServer", 1, 10000);
    CU_ASSERT(serving);
    if (!serving)
        fprintf(stderr, "  server 0 did not report SERVING again\n");
    text = http_get(cl.metrics_port[0], "/metrics", STATUS_BUDGET_MS);
    CU_ASSERT_PTR_NOT_NULL(text);
    if (text) {
        char want[64];
        snprintf(want, sizeof(want), "\npshard_shard_ops_total{op=\"all_reduce\"} %d\n", NCALLS);
        CU_ASSERT(strstr(text, want) != NULL);
        free(text);
    }
    trainer_free(&a);
    trainer_free(&b);
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    if (argc < 3) {
        fprintf(stderr, "usage: %s COORDINATOR SERVER\n", argv[0]);
        return 2;
    }
    coord_bin = argv[1];
    server_bin = argv[2];
    cl_ok = cluster_start();
    if (!cl_ok)
        fprintf(stderr, "the 2-rank cluster did not start (logs in %s)\n", cl.dir);
    static const ps_test_case_t cases[] = {
        {"Status, health and /metrics answer while every worker is stuck; health says so",
         test_status_and_health_while_pool_is_stuck},
        {NULL, NULL},
    };
    int rc = ps_test_main("shard_busy", cases);
    if (!cluster_stop()) {
        fprintf(stderr, "the shard servers did not stop cleanly\n");
        rc = 1;
    }
    return rc;
}
