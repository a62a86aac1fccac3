/* Integration tests against the real pshard-coordinator binary on an ephemeral loopback port:
 * membership with lease expiry, Watch, store waits released by another client, rendezvous,
 * rank recovery by name, and graceful shutdown with open streams. argv[1] is the binary. */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ps_coord_client.h"
#include "ps_proc.h"
#include "ps_test.h"
#include "pshard/coord_client.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

static const char *coordinator_bin;

typedef struct {
    pid_t pid;
    char target[64];
    ps_rpc_channel_t *ch;
} fixture_t;

static int start(fixture_t *f, const char *const *args)
{
    memset(f, 0, sizeof(*f));
    f->pid = ps_proc_start_coordinator(coordinator_bin, args, f->target, sizeof(f->target));
    if (f->pid < 0)
        return -1;
    char err[256] = "";
    ps_rpc_channel_config_t cfg = {.target = f->target, .own_connection = true};
    f->ch = ps_rpc_channel_create(&cfg, err, sizeof(err));
    return f->ch ? 0 : -1;
}

static int stop(fixture_t *f)
{
    ps_rpc_channel_destroy(f->ch);
    f->ch = NULL;
    return ps_proc_stop(f->pid, 10000);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

static pshard_status_t do_register_key(ps_rpc_channel_t *ch, Pshard__Role role, const char *name,
                                       const char *key, Pshard__MemberView **view, char *err,
                                       size_t errlen)
{
    Pshard__RegisterRequest req = PSHARD__REGISTER_REQUEST__INIT;
    req.role = role;
    req.name = (char *)name;
    req.address = "127.0.0.1:1";
    req.lease_key = (char *)(key ? key : "");
    return ps_coord_rpc_register(ch, &req, view, 5000, err, errlen);
}

static pshard_status_t do_register(ps_rpc_channel_t *ch, Pshard__Role role, const char *name,
                                   Pshard__MemberView **view)
{
    char err[256] = "";
    return do_register_key(ch, role, name, NULL, view, err, sizeof(err));
}

/* Heartbeats as the member `v` describes (its id and lease key); key overrides the key when
 * not NULL. */
static pshard_status_t do_heartbeat_key(ps_rpc_channel_t *ch, const Pshard__MemberView *v,
                                        const char *key, char *err, size_t errlen)
{
    Pshard__HeartbeatRequest req = PSHARD__HEARTBEAT_REQUEST__INIT;
    req.member_id = v->member_id;
    req.lease_key = (char *)(key ? key : v->lease_key);
    return ps_coord_rpc_heartbeat(ch, &req, NULL, 5000, err, errlen);
}

static pshard_status_t do_heartbeat(ps_rpc_channel_t *ch, const Pshard__MemberView *v, char *err,
                                    size_t errlen)
{
    return do_heartbeat_key(ch, v, NULL, err, errlen);
}

static const Pshard__Member *find_member(const Pshard__StatusResponse *st, const char *name)
{
    for (size_t i = 0; i < st->n_members; i++) {
        if (strcmp(st->members[i]->name, name) == 0)
            return st->members[i];
    }
    return NULL;
}

/* Heartbeats as v with the step figures (window, compute median) of a shard server. */
static pshard_status_t do_heartbeat_steps(ps_rpc_channel_t *ch, const Pshard__MemberView *v,
                                          uint32_t window, double compute, double wait, char *err,
                                          size_t errlen)
{
    Pshard__HeartbeatRequest req = PSHARD__HEARTBEAT_REQUEST__INIT;
    Pshard__StepSummary steps = PSHARD__STEP_SUMMARY__INIT;
    steps.window = window;
    steps.steps = 100;
    steps.step_seconds = 0.3;
    steps.compute_seconds = compute;
    steps.wait_seconds = wait;
    req.member_id = v->member_id;
    req.lease_key = v->lease_key;
    req.steps = &steps;
    return ps_coord_rpc_heartbeat(ch, &req, NULL, 5000, err, errlen);
}

/* Who is slow: step figures ride on heartbeats (untrusted: nonsense is refused, naming the
 * field), Status carries each rank's and names the slowest against the median of medians. */
static void test_straggler_status(void)
{
    fixture_t f;
    const char *args[] = {"--world-size", "3", "--straggler-ratio", "1.5", "--straggler-steps",
                          "10",           NULL};
    CU_ASSERT_FATAL(start(&f, args) == 0);
    Pshard__MemberView *v[3] = {NULL};
    const char *names[3] = {"s0", "s1", "s2"};
    for (int i = 0; i < 3; i++)
        CU_ASSERT_FATAL(do_register(f.ch, PSHARD__ROLE__SHARD_SERVER, names[i], &v[i]) ==
                        PSHARD_OK);
    char err[256] = "";
    CU_ASSERT_EQUAL(do_heartbeat_steps(f.ch, v[0], 50, NAN, 0, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "compute_seconds"));
    err[0] = '\0';
    CU_ASSERT_EQUAL(do_heartbeat_steps(f.ch, v[0], 50, 0.1, -1, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "wait_seconds"));
    err[0] = '\0';
    CU_ASSERT_EQUAL(do_heartbeat_steps(f.ch, v[0], 51, 0.1, 0, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "window 51"));
    err[0] = '\0';
    CU_ASSERT_EQUAL(do_heartbeat_steps(f.ch, v[0], 0, INFINITY, 0, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    /* Ranks 0 and 1 compute 0.1 s a step, the member holding rank 2 0.25 s. */
    Pshard__StatusResponse *st = ps_coord_status(f.ch);
    CU_ASSERT_FATAL(st != NULL);
    const double compute[3] = {0.1, 0.1, 0.25};
    for (int i = 0; i < 3; i++) {
        const Pshard__Member *m = find_member(st, names[i]);
        CU_ASSERT_FATAL(m != NULL);
        double c = compute[m->rank];
        CU_ASSERT_EQUAL(do_heartbeat_steps(f.ch, v[i], 50, c, 0.3 - c, err, sizeof(err)),
                        PSHARD_OK);
    }
    protobuf_c_message_free_unpacked(&st->base, NULL);
    st = ps_coord_status(f.ch);
    CU_ASSERT_FATAL(st != NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(st->straggler);
    CU_ASSERT_EQUAL(st->straggler->rank, 2);
    CU_ASSERT_DOUBLE_EQUAL(st->straggler->ratio, 2.5, 1e-9);
    CU_ASSERT_DOUBLE_EQUAL(st->straggler->median_compute_seconds, 0.1, 1e-12);
    CU_ASSERT_EQUAL(st->straggler->ranks, 3);
    CU_ASSERT_TRUE(st->straggler->slow);
    CU_ASSERT_DOUBLE_EQUAL(st->straggler->threshold, 1.5, 1e-12);
    for (size_t i = 0; i < st->n_members; i++) {
        CU_ASSERT_PTR_NOT_NULL_FATAL(st->members[i]->steps);
        CU_ASSERT_EQUAL(st->members[i]->steps->window, 50);
    }
    protobuf_c_message_free_unpacked(&st->base, NULL);
    /* A heartbeat without figures (a new trainer session) drops that rank's. */
    for (int i = 0; i < 3; i++)
        CU_ASSERT_EQUAL(do_heartbeat(f.ch, v[i], err, sizeof(err)), PSHARD_OK);
    st = ps_coord_status(f.ch);
    CU_ASSERT_FATAL(st != NULL);
    CU_ASSERT_EQUAL(st->straggler->rank, -1);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    for (int i = 0; i < 3; i++)
        protobuf_c_message_free_unpacked(&v[i]->base, NULL);
    CU_ASSERT(stop(&f) == 0);
}

/* A member that stops heartbeating is evicted after its lease; the generation moves on, and
 * its heartbeat is refused with NOT_FOUND. One that keeps heartbeating stays. */
static void test_lease_expiry(void)
{
    fixture_t f;
    const char *args[] = {"--lease-ms", "400", "--heartbeat-ms", "100", "--world-size", "2", NULL};
    CU_ASSERT_FATAL(start(&f, args) == 0);
    Pshard__MemberView *a = NULL, *b = NULL;
    CU_ASSERT_FATAL(do_register(f.ch, PSHARD__ROLE__SHARD_SERVER, "alive", &a) == PSHARD_OK);
    CU_ASSERT_FATAL(do_register(f.ch, PSHARD__ROLE__TRAINER, "silent", &b) == PSHARD_OK);
    uint64_t gen_before = b->generation;
    char err[256] = "";
    /* Heartbeat "alive" every 100 ms until "silent" is gone (or 5 s pass). */
    bool evicted = false;
    uint64_t gen_after = 0;
    for (int i = 0; i < 50 && !evicted; i++) {
        CU_ASSERT(do_heartbeat(f.ch, a, err, sizeof(err)) == PSHARD_OK);
        Pshard__StatusResponse *st = ps_coord_status(f.ch);
        CU_ASSERT_FATAL(st != NULL);
        evicted = find_member(st, "silent") == NULL;
        CU_ASSERT(find_member(st, "alive") != NULL);
        gen_after = st->generation;
        protobuf_c_message_free_unpacked(&st->base, NULL);
        sleep_ms(100);
    }
    CU_ASSERT(evicted);
    CU_ASSERT(gen_after > gen_before);
    err[0] = '\0';
    CU_ASSERT(do_heartbeat(f.ch, b, err, sizeof(err)) == PSHARD_ERR_NOT_FOUND);
    CU_ASSERT(strstr(err, "register again") != NULL);
    protobuf_c_message_free_unpacked(&a->base, NULL);
    protobuf_c_message_free_unpacked(&b->base, NULL);
    CU_ASSERT(stop(&f) == 0);
}

/* Watch delivers the current state first, then an event with a higher generation that lists a
 * member registered from another connection. */
static void test_watch_sees_generation(void)
{
    fixture_t f;
    const char *args[] = {"--world-size", "3", NULL};
    CU_ASSERT_FATAL(start(&f, args) == 0);
    Pshard__WatchRequest req = PSHARD__WATCH_REQUEST__INIT;
    char err[256] = "";
    ps_rpc_stream_t *st =
        ps_rpc_stream_open(f.ch, "/pshard.Coordinator/Watch", &req.base, 10000, err, sizeof(err));
    CU_ASSERT_FATAL(st != NULL);
    ProtobufCMessage *msg = NULL;
    CU_ASSERT_FATAL(ps_rpc_stream_next(st, &pshard__cluster_event__descriptor, &msg, 5000, NULL,
                                       err, sizeof(err)) == PSHARD_OK);
    CU_ASSERT_FATAL(msg != NULL);
    Pshard__ClusterEvent *first = (Pshard__ClusterEvent *)msg;
    uint64_t gen0 = first->generation;
    CU_ASSERT(first->n_members == 0);
    CU_ASSERT(first->state == PSHARD__CLUSTER_STATE__FORMING);
    protobuf_c_message_free_unpacked(msg, NULL);

    ps_rpc_channel_config_t cfg = {.target = f.target, .own_connection = true};
    ps_rpc_channel_t *other = ps_rpc_channel_create(&cfg, err, sizeof(err));
    Pshard__MemberView *v = NULL;
    CU_ASSERT_FATAL(do_register(other, PSHARD__ROLE__SHARD_SERVER, "watched-1", &v) == PSHARD_OK);
    CU_ASSERT_FATAL(ps_rpc_stream_next(st, &pshard__cluster_event__descriptor, &msg, 5000, NULL,
                                       err, sizeof(err)) == PSHARD_OK);
    CU_ASSERT_FATAL(msg != NULL);
    Pshard__ClusterEvent *ev = (Pshard__ClusterEvent *)msg;
    CU_ASSERT(ev->generation > gen0);
    CU_ASSERT(ev->generation == v->generation);
    CU_ASSERT(ev->n_members == 1 && strcmp(ev->members[0]->name, "watched-1") == 0);
    CU_ASSERT(strstr(ev->reason, "watched-1") != NULL);
    protobuf_c_message_free_unpacked(msg, NULL);
    protobuf_c_message_free_unpacked(&v->base, NULL);
    ps_rpc_stream_close(st);
    ps_rpc_channel_destroy(other);
    CU_ASSERT(stop(&f) == 0);
}

/* A job whose member list packs to more than what a client receives (4 MiB: 4,300 members
 * with the longest fields make ~4.7 MB) still has a Watch: its events list the members that
 * fit, ranked shard servers first, and count the others. Before, every watcher's stream failed
 * on each event (message larger than the receiver's limit), and evictions never arrived. */
static void test_watch_event_fits_the_limit(void)
{
    fixture_t f;
    const char *args[] = {"--world-size", "1", "--lease-ms", "600000", NULL};
    CU_ASSERT_FATAL(start(&f, args) == 0);
    enum { N = 4300 };
    char name[254], field[256];
    memset(field, 'f', 255);
    field[255] = '\0';
    int registered = 0;
    for (int i = 0; i < N; i++) {
        memset(name, 'n', 253);
        name[253] = '\0';
        snprintf(name, sizeof(name), "trainer-%06d", i);
        name[strlen(name)] = 'n'; /* keep it 253 bytes long */
        name[253] = '\0';
        Pshard__RegisterRequest req = PSHARD__REGISTER_REQUEST__INIT;
        req.role = PSHARD__ROLE__TRAINER;
        req.name = name;
        req.address = field;
        req.node = field;
        req.device = field;
        ProtobufCMessage *resp = NULL;
        char err[256] = "";
        if (ps_rpc_unary(f.ch, "/pshard.Coordinator/Register", &req.base,
                         &pshard__member_view__descriptor, &resp, 5000, 0, NULL, err,
                         sizeof(err)) == PSHARD_OK)
            registered++;
        else
            fprintf(stderr, "register %d: %s\n", i, err);
        if (resp)
            protobuf_c_message_free_unpacked(resp, NULL);
    }
    CU_ASSERT_EQUAL_FATAL(registered, N);
    /* A watcher with the default 4 MiB receive limit. */
    char err[256] = "";
    ps_rpc_channel_config_t cfg = {.target = f.target, .own_connection = true};
    ps_rpc_channel_t *small = ps_rpc_channel_create(&cfg, err, sizeof(err));
    CU_ASSERT_FATAL(small != NULL);
    Pshard__WatchRequest wreq = PSHARD__WATCH_REQUEST__INIT;
    ps_rpc_stream_t *st =
        ps_rpc_stream_open(small, "/pshard.Coordinator/Watch", &wreq.base, 30000, err, sizeof(err));
    CU_ASSERT_FATAL(st != NULL);
    ProtobufCMessage *msg = NULL;
    pshard_status_t rc = ps_rpc_stream_next(st, &pshard__cluster_event__descriptor, &msg, 10000,
                                            NULL, err, sizeof(err));
    CU_ASSERT_EQUAL(rc, PSHARD_OK);
    if (rc != PSHARD_OK)
        fprintf(stderr, "first Watch event: %s\n", err);
    CU_ASSERT_FATAL(msg != NULL);
    Pshard__ClusterEvent *ev = (Pshard__ClusterEvent *)msg;
    CU_ASSERT(ev->members_omitted > 0);
    CU_ASSERT_EQUAL(ev->n_members + ev->members_omitted, (size_t)N);
    CU_ASSERT(protobuf_c_message_get_packed_size(msg) <= 4u * 1024 * 1024);
    protobuf_c_message_free_unpacked(msg, NULL);
    /* The next change arrives too, and a ranked shard server heads the list. */
    Pshard__MemberView *v = NULL;
    CU_ASSERT_FATAL(do_register(f.ch, PSHARD__ROLE__SHARD_SERVER, "srv", &v) == PSHARD_OK);
    protobuf_c_message_free_unpacked(&v->base, NULL);
    bool seen = false;
    for (int i = 0; i < 5 && !seen; i++) {
        msg = NULL;
        rc = ps_rpc_stream_next(st, &pshard__cluster_event__descriptor, &msg, 10000, NULL, err,
                                sizeof(err));
        CU_ASSERT_EQUAL_FATAL(rc, PSHARD_OK);
        ev = (Pshard__ClusterEvent *)msg;
        if (ev->state == PSHARD__CLUSTER_STATE__FORMED) {
            seen = true;
            CU_ASSERT(ev->n_members > 0 && strcmp(ev->members[0]->name, "srv") == 0 &&
                      ev->members[0]->rank == 0);
            CU_ASSERT_EQUAL(ev->n_members + ev->members_omitted, (size_t)N + 1);
        }
        protobuf_c_message_free_unpacked(msg, NULL);
    }
    CU_ASSERT(seen);
    ps_rpc_stream_close(st);
    ps_rpc_channel_destroy(small);
    CU_ASSERT(stop(&f) == 0);
}

typedef struct {
    const char *target;
    pshard_status_t rc;
    char value[64];
    char err[256];
} waiter_t;

static void *wait_thread(void *arg)
{
    waiter_t *w = arg;
    ps_rpc_channel_config_t cfg = {.target = w->target, .own_connection = true};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&cfg, w->err, sizeof(w->err));
    if (!ch) {
        w->rc = PSHARD_ERR_INTERNAL;
        return NULL;
    }
    const char *keys[] = {"peer/0", "peer/1"};
    Pshard__StoreWaitResponse *r = NULL;
    w->rc = ps_coord_store_await(ch, keys, 2, 20000, &r, w->err, sizeof(w->err));
    if (w->rc == PSHARD_OK) {
        if (r->n_values == 2)
            snprintf(w->value, sizeof(w->value), "%.*s|%.*s", (int)r->values[0].len,
                     (const char *)r->values[0].data, (int)r->values[1].len,
                     (const char *)r->values[1].data);
        protobuf_c_message_free_unpacked(&r->base, NULL);
    }
    ps_rpc_channel_destroy(ch);
    return NULL;
}

static pshard_status_t store_set(ps_rpc_channel_t *ch, const char *key, const char *value)
{
    char err[256] = "";
    return ps_coord_store_put(ch, key, value, strlen(value), 5000, err, sizeof(err));
}

/* Waits until Status reports `n` pending store waits. */
static bool wait_for_waiters(ps_rpc_channel_t *ch, uint64_t n)
{
    for (int i = 0; i < 500; i++) {
        Pshard__StatusResponse *st = ps_coord_status(ch);
        bool ok = st && st->store_waiters == n;
        if (st)
            protobuf_c_message_free_unpacked(&st->base, NULL);
        if (ok)
            return true;
        sleep_ms(10);
    }
    return false;
}

/* A StoreWait blocked in one client is released by StoreSets from another, with the values in
 * the order of the keys. */
static void test_store_wait_released(void)
{
    fixture_t f;
    CU_ASSERT_FATAL(start(&f, NULL) == 0);
    waiter_t w = {.target = f.target, .rc = PSHARD_ERR_INTERNAL};
    pthread_t t;
    pthread_create(&t, NULL, wait_thread, &w);
    CU_ASSERT_FATAL(wait_for_waiters(f.ch, 1));
    CU_ASSERT(store_set(f.ch, "peer/1", "10.0.0.2:7000") == PSHARD_OK);
    /* One key is not enough: the wait is still pending. */
    CU_ASSERT(wait_for_waiters(f.ch, 1));
    CU_ASSERT(store_set(f.ch, "peer/0", "10.0.0.1:7000") == PSHARD_OK);
    pthread_join(t, NULL);
    CU_ASSERT_EQUAL(w.rc, PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(w.value, "10.0.0.1:7000|10.0.0.2:7000");
    CU_ASSERT(wait_for_waiters(f.ch, 0));
    CU_ASSERT(stop(&f) == 0);
}

/* The coordinator client's store helpers: a value comes back whole and NUL-terminated, adds
 * sum, deleting a key twice is no error, a fetch of a missing key is NOT_FOUND, and a wait
 * for a missing key times out. */
static void test_store_helpers(void)
{
    fixture_t f;
    CU_ASSERT_FATAL(start(&f, NULL) == 0);
    char err[256] = "", *value = NULL;
    size_t len = 0;
    static const char bytes[] = {'a', 0, 'b'};
    CU_ASSERT_EQUAL(ps_coord_store_put(f.ch, "k", bytes, sizeof(bytes), 5000, err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL_FATAL(ps_coord_store_fetch(f.ch, "k", &value, &len, 5000, err, sizeof(err)),
                          PSHARD_OK);
    CU_ASSERT(len == 3 && memcmp(value, bytes, 3) == 0 && value[3] == '\0');
    free(value);
    int64_t sum = 0;
    CU_ASSERT_EQUAL(ps_coord_store_incr(f.ch, "n", 5, &sum, 5000, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(ps_coord_store_incr(f.ch, "n", -2, &sum, 5000, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(sum, 3);
    CU_ASSERT_EQUAL(ps_coord_store_remove(f.ch, "k", 5000, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(ps_coord_store_remove(f.ch, "k", 5000, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(ps_coord_store_fetch(f.ch, "k", &value, &len, 5000, err, sizeof(err)),
                    PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_PTR_NULL(value);
    const char *keys[] = {"n", "absent"};
    Pshard__StoreWaitResponse *r = NULL;
    CU_ASSERT_EQUAL(ps_coord_store_await(f.ch, keys, 2, 200, &r, err, sizeof(err)),
                    PSHARD_ERR_TIMEOUT);
    CU_ASSERT_PTR_NULL(r);
    CU_ASSERT_EQUAL(ps_coord_store_await(f.ch, keys, 1, 200, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT(r && r->n_values == 1 && r->values[0].len > 0);
    if (r)
        protobuf_c_message_free_unpacked(&r->base, NULL);
    CU_ASSERT(stop(&f) == 0);
}

static int member_rank(const Pshard__StatusResponse *st, const char *name)
{
    const Pshard__Member *m = find_member(st, name);
    return m ? m->rank : -100;
}

/* --nnodes 2:3 with a last call: two servers start the last call, the cluster forms when it
 * expires; ranks follow the natural order of names; a later server is a standby. */
static void test_rendezvous_min_max(void)
{
    fixture_t f;
    const char *args[] = {"--nnodes", "2:3", "--last-call-ms", "300", NULL};
    CU_ASSERT_FATAL(start(&f, args) == 0);
    Pshard__MemberView *v = NULL;
    CU_ASSERT(do_register(f.ch, PSHARD__ROLE__SHARD_SERVER, "node-10", &v) == PSHARD_OK);
    protobuf_c_message_free_unpacked(&v->base, NULL);
    CU_ASSERT(do_register(f.ch, PSHARD__ROLE__SHARD_SERVER, "node-2", &v) == PSHARD_OK);
    CU_ASSERT(v->state == PSHARD__CLUSTER_STATE__FORMING);
    CU_ASSERT(v->rank == -1);
    protobuf_c_message_free_unpacked(&v->base, NULL);
    Pshard__StatusResponse *st = ps_coord_status(f.ch);
    CU_ASSERT_FATAL(st != NULL);
    CU_ASSERT(st->state == PSHARD__CLUSTER_STATE__FORMING);
    CU_ASSERT(st->last_call_remaining_ms >= 0);
    CU_ASSERT(strlen(st->awaiting) > 0);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    /* Heartbeats keep them alive while we poll for the cluster to form. */
    bool formed = false;
    for (int i = 0; i < 300 && !formed; i++) {
        st = ps_coord_status(f.ch);
        CU_ASSERT_FATAL(st != NULL);
        formed = st->state == PSHARD__CLUSTER_STATE__FORMED;
        if (formed) {
            CU_ASSERT_EQUAL(st->world_size, 2);
            CU_ASSERT_EQUAL(member_rank(st, "node-2"), 0);
            CU_ASSERT_EQUAL(member_rank(st, "node-10"), 1);
        }
        protobuf_c_message_free_unpacked(&st->base, NULL);
        sleep_ms(10);
    }
    CU_ASSERT(formed);
    CU_ASSERT(do_register(f.ch, PSHARD__ROLE__SHARD_SERVER, "node-3", &v) == PSHARD_OK);
    CU_ASSERT_EQUAL(v->rank, -1);
    CU_ASSERT_EQUAL(v->world_size, 2);
    protobuf_c_message_free_unpacked(&v->base, NULL);
    CU_ASSERT(stop(&f) == 0);
}

/* A restarted member (same name, new incarnation) gets its old rank back, and the old
 * incarnation's id is no longer accepted. */
static void test_reregister_keeps_rank(void)
{
    fixture_t f;
    const char *args[] = {"--world-size", "3", NULL};
    CU_ASSERT_FATAL(start(&f, args) == 0);
    const char *names[] = {"pshard-server-10", "pshard-server-2", "pshard-server-1"};
    Pshard__MemberView *v[3];
    for (int i = 0; i < 3; i++)
        CU_ASSERT_FATAL(do_register(f.ch, PSHARD__ROLE__SHARD_SERVER, names[i], &v[i]) ==
                        PSHARD_OK);
    CU_ASSERT_EQUAL(v[2]->state, PSHARD__CLUSTER_STATE__FORMED);
    Pshard__StatusResponse *st = ps_coord_status(f.ch);
    CU_ASSERT_FATAL(st != NULL);
    CU_ASSERT_EQUAL(member_rank(st, "pshard-server-1"), 0);
    CU_ASSERT_EQUAL(member_rank(st, "pshard-server-2"), 1);
    CU_ASSERT_EQUAL(member_rank(st, "pshard-server-10"), 2);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    /* Its id is public (Status shows it) but is no credential: a heartbeat without the key,
     * or with another member's, is refused, and a Register under its live name by anyone
     * without its key is refused too, leaving rank 1 where it is. */
    char err[256] = "";
    CU_ASSERT_EQUAL(do_heartbeat_key(f.ch, v[1], "", err, sizeof(err)), PSHARD_ERR_PERMISSION);
    CU_ASSERT(strstr(err, "no lease key") != NULL);
    err[0] = '\0';
    CU_ASSERT_EQUAL(do_heartbeat_key(f.ch, v[1], v[0]->lease_key, err, sizeof(err)),
                    PSHARD_ERR_PERMISSION);
    Pshard__MemberView *again = NULL;
    err[0] = '\0';
    CU_ASSERT_EQUAL(do_register_key(f.ch, PSHARD__ROLE__SHARD_SERVER, "pshard-server-2", NULL,
                                    &again, err, sizeof(err)),
                    PSHARD_ERR_ALREADY_EXISTS);
    CU_ASSERT(strstr(err, "held by a live member") != NULL);
    st = ps_coord_status(f.ch);
    CU_ASSERT_FATAL(st != NULL);
    CU_ASSERT_EQUAL(st->state, PSHARD__CLUSTER_STATE__FORMED);
    const Pshard__Member *m = find_member(st, "pshard-server-2");
    CU_ASSERT(m && strcmp(m->member_id, v[1]->member_id) == 0);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    /* The member itself (with its key) re-registers: a new incarnation, same rank. */
    err[0] = '\0';
    CU_ASSERT_FATAL(do_register_key(f.ch, PSHARD__ROLE__SHARD_SERVER, "pshard-server-2",
                                    v[1]->lease_key, &again, err, sizeof(err)) == PSHARD_OK);
    CU_ASSERT_EQUAL(again->rank, 1);
    CU_ASSERT(strcmp(again->member_id, v[1]->member_id) != 0);
    CU_ASSERT(again->generation > v[2]->generation);
    CU_ASSERT_EQUAL(do_heartbeat(f.ch, v[1], err, sizeof(err)), PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_EQUAL(do_heartbeat(f.ch, again, err, sizeof(err)), PSHARD_OK);
    protobuf_c_message_free_unpacked(&again->base, NULL);
    for (int i = 0; i < 3; i++)
        protobuf_c_message_free_unpacked(&v[i]->base, NULL);
    CU_ASSERT(stop(&f) == 0);
}

/* SIGTERM with an open Watch stream and a pending StoreWait: both clients get an error
 * promptly, and the process exits 0. */
static void test_graceful_shutdown(void)
{
    fixture_t f;
    CU_ASSERT_FATAL(start(&f, NULL) == 0);
    Pshard__WatchRequest req = PSHARD__WATCH_REQUEST__INIT;
    char err[256] = "";
    ps_rpc_stream_t *st =
        ps_rpc_stream_open(f.ch, "/pshard.Coordinator/Watch", &req.base, 0, err, sizeof(err));
    CU_ASSERT_FATAL(st != NULL);
    ProtobufCMessage *msg = NULL;
    CU_ASSERT(ps_rpc_stream_next(st, &pshard__cluster_event__descriptor, &msg, 5000, NULL, err,
                                 sizeof(err)) == PSHARD_OK);
    if (msg)
        protobuf_c_message_free_unpacked(msg, NULL);
    waiter_t w = {.target = f.target, .rc = PSHARD_ERR_INTERNAL};
    pthread_t t;
    pthread_create(&t, NULL, wait_thread, &w);
    CU_ASSERT_FATAL(wait_for_waiters(f.ch, 1));
    int64_t t0 = ps_now_ns();
    int code = ps_proc_stop(f.pid, 10000);
    CU_ASSERT_EQUAL(code, 0);
    CU_ASSERT((ps_now_ns() - t0) < 5000000000LL);
    pthread_join(t, NULL);
    CU_ASSERT(w.rc != PSHARD_OK);
    /* The watch stream ends (with OK or an error), it does not hang. */
    pshard_status_t rc = ps_rpc_stream_next(st, &pshard__cluster_event__descriptor, &msg, 5000,
                                            NULL, err, sizeof(err));
    CU_ASSERT(rc != PSHARD_ERR_TIMEOUT);
    if (rc == PSHARD_OK && msg)
        protobuf_c_message_free_unpacked(msg, NULL);
    ps_rpc_stream_close(st);
    ps_rpc_channel_destroy(f.ch);
}

typedef struct {
    char target[64];
    pshard_status_t rc;
    int64_t elapsed_ms;
} retry_t;

static void *retry_thread(void *arg)
{
    retry_t *r = arg;
    char err[256] = "";
    ps_rpc_channel_config_t cfg = {.target = r->target, .own_connection = true};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&cfg, err, sizeof(err));
    Pshard__StatusRequest req = PSHARD__STATUS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    int64_t t0 = ps_now_ns();
    r->rc = ps_rpc_unary(ch, "/pshard.Coordinator/Status", &req.base,
                         &pshard__status_response__descriptor, &resp, 10000, PS_RPC_IDEMPOTENT,
                         NULL, err, sizeof(err));
    r->elapsed_ms = (ps_now_ns() - t0) / 1000000;
    if (resp)
        protobuf_c_message_free_unpacked(resp, NULL);
    ps_rpc_channel_destroy(ch);
    return NULL;
}

/* An idempotent call made while the coordinator is down retries with backoff and succeeds once
 * it comes up; a non-idempotent call fails at once with UNAVAILABLE. */
static void test_idempotent_retry(void)
{
    /* Pick a free port, release it, and start the coordinator on it a little later. */
    int port = -1;
    {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t len = sizeof(a);
        if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
            getsockname(fd, (struct sockaddr *)&a, &len) == 0)
            port = ntohs(a.sin_port);
        close(fd);
    }
    CU_ASSERT_FATAL(port > 0);
    retry_t r = {.rc = PSHARD_ERR_INTERNAL};
    snprintf(r.target, sizeof(r.target), "127.0.0.1:%d", port);

    char err[256] = "";
    ps_rpc_channel_config_t cfg = {.target = r.target, .own_connection = true};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&cfg, err, sizeof(err));
    Pshard__StoreAddRequest add = PSHARD__STORE_ADD_REQUEST__INIT;
    add.key = "k";
    ProtobufCMessage *resp = NULL;
    CU_ASSERT_EQUAL(ps_rpc_unary(ch, "/pshard.Coordinator/StoreAdd", &add.base,
                                 &pshard__store_add_response__descriptor, &resp, 2000, 0, NULL, err,
                                 sizeof(err)),
                    PSHARD_ERR_UNAVAILABLE);
    ps_rpc_channel_destroy(ch);

    pthread_t t;
    pthread_create(&t, NULL, retry_thread, &r);
    sleep_ms(300); /* let the first attempts fail; this is the scenario, not a wait for readiness */
    char listen[64], port_file[] = "/tmp/pshard-retry-XXXXXX";
    int pfd = mkstemp(port_file);
    close(pfd);
    unlink(port_file);
    snprintf(listen, sizeof(listen), "127.0.0.1:%d", port);
    char *argv[] = {(char *)coordinator_bin, "--listen", listen, "--port-file", port_file, NULL};
    pid_t pid = ps_proc_spawn(argv, "/dev/null");
    pthread_join(t, NULL);
    CU_ASSERT_EQUAL(r.rc, PSHARD_OK);
    CU_ASSERT(r.elapsed_ms >= 250);
    CU_ASSERT_EQUAL(ps_proc_stop(pid, 10000), 0);
    unlink(port_file);
}

/* Bad flags exit 2 with a message; --version exits 0. */
static void test_bad_flags(void)
{
    char *bad[] = {(char *)coordinator_bin, "--lease-ms", "abc", NULL};
    pid_t pid = ps_proc_spawn(bad, "/dev/null");
    int status = 0;
    waitpid(pid, &status, 0);
    CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 2);
    char *bad2[] = {(char *)coordinator_bin, "--nnodes", "3:2", NULL};
    pid = ps_proc_spawn(bad2, "/dev/null");
    waitpid(pid, &status, 0);
    CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 2);
    char *ver[] = {(char *)coordinator_bin, "--version", NULL};
    pid = ps_proc_spawn(ver, "/dev/null");
    waitpid(pid, &status, 0);
    CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* Tokens a cluster must not run with: the coordinator refuses them at start (exit 2), saying
 * what is wrong and how to make one. */
static void test_bad_tokens(void)
{
    static const struct {
        const char *text;
        size_t len;
        const char *why;
    } cases[] = {
        {"REPLACE-ME-with-a-random-token-see-README-Deploy\n", 49, "placeholder"},
        {"x\n", 2, "shorter than 16 bytes"},
        {"0123456789abcde\n", 16, "shorter than 16 bytes"},
        {"a token with spaces in it\n", 26, "cannot send"},
        {"0123456789abcdef\x01xyz\n", 21, "cannot send"},
        {"0123456789abcdef\xc3\xa9xyz", 21, "cannot send"},
        {"abc\0"
         "0123456789abcdefgh\n",
         23, "NUL byte"},
        {"\n\n", 2, "empty"},
    };
    char dir[] = "/tmp/pshard-token-test-XXXXXX";
    CU_ASSERT_PTR_NOT_NULL_FATAL(mkdtemp(dir));
    char tok[64], log[64];
    snprintf(tok, sizeof(tok), "%s/token", dir);
    snprintf(log, sizeof(log), "%s/log", dir);
    for (size_t i = 0; i < PS_ARRAY_LEN(cases); i++) {
        FILE *f = fopen(tok, "wb");
        CU_ASSERT_PTR_NOT_NULL_FATAL(f);
        CU_ASSERT_EQUAL(fwrite(cases[i].text, 1, cases[i].len, f), cases[i].len);
        fclose(f);
        char *argv[] = {(char *)coordinator_bin, "--listen", "127.0.0.1:0",
                        "--token-file",          tok,        NULL};
        pid_t pid = ps_proc_spawn(argv, log);
        int status = 0;
        waitpid(pid, &status, 0);
        CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 2);
        char err[256] = "";
        char *out = ps_read_file(log, false, 1 << 16, NULL, err, sizeof(err));
        bool named = out && strstr(out, cases[i].why) && strstr(out, "head -c 32 /dev/urandom");
        if (!named)
            fprintf(stderr, "\n  token case %zu: %s\n", i, out ? out : err);
        CU_ASSERT(named);
        free(out);
    }
    /* A FIFO as the token file is refused at once, not waited on. */
    unlink(tok);
    CU_ASSERT_EQUAL_FATAL(mkfifo(tok, 0600), 0);
    char *fargv[] = {(char *)coordinator_bin, "--listen", "127.0.0.1:0", "--token-file", tok, NULL};
    pid_t pid = ps_proc_spawn(fargv, log);
    int status = 0;
    for (int i = 0; i < 500 && waitpid(pid, &status, WNOHANG) == 0; i++) {
        struct timespec ts = {0, 20 * 1000000};
        nanosleep(&ts, NULL);
    }
    if (waitpid(pid, &status, WNOHANG) == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        CU_FAIL("the coordinator waited on a FIFO token file");
    } else {
        CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 2);
    }
    char *out = ps_read_file(log, false, 1 << 16, NULL, NULL, 0);
    CU_ASSERT(out && strstr(out, "not a regular file"));
    free(out);
    unlink(tok);
    unlink(log);
    rmdir(dir);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH-TO-pshard-coordinator\n", argv[0]);
        return 2;
    }
    coordinator_bin = argv[1];
    signal(SIGPIPE, SIG_IGN);
    static const ps_test_case_t cases[] = {
        {"lease expiry evicts a silent member", test_lease_expiry},
        {"step figures on heartbeats name the slowest rank", test_straggler_status},
        {"watch sees a new generation", test_watch_sees_generation},
        {"watch events of a huge job fit the receive limit", test_watch_event_fits_the_limit},
        {"store wait released by another client", test_store_wait_released},
        {"the coordinator client's store helpers", test_store_helpers},
        {"rendezvous min:max with last call", test_rendezvous_min_max},
        {"re-register keeps the rank", test_reregister_keeps_rank},
        {"graceful shutdown with open streams", test_graceful_shutdown},
        {"idempotent calls retry while unavailable", test_idempotent_retry},
        {"bad flags exit 2", test_bad_flags},
        {"placeholder, short and unsendable tokens are refused", test_bad_tokens},
        {NULL, NULL},
    };
    return ps_test_main("coordinator_integration", cases);
}
