/* Unit tests for the coordinator membership state machine (coord_state): leases, rendezvous,
 * ranks, generations, validation and the Join table, all driven by an injected clock. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_state.h"
#include "ps_test.h"

#define MS(x) ((int64_t)(x)*INT64_C(1000000))
#define SRV COORD_ROLE_SHARD_SERVER
#define TRN COORD_ROLE_TRAINER

/* Records every on_change call. */
#define MAX_CHANGES 64
typedef struct {
    int n;
    uint64_t generation[MAX_CHANGES];
    char reason[MAX_CHANGES][256];
} changes_t;

static void record_change(void *arg, uint64_t generation, const char *reason)
{
    changes_t *c = arg;
    if (c->n < MAX_CHANGES) {
        c->generation[c->n] = generation;
        snprintf(c->reason[c->n], sizeof(c->reason[c->n]), "%s", reason);
    }
    c->n++;
}

static changes_t changes;

static coord_state_t *make_state(int min_nodes, int max_nodes, int64_t last_call_ms)
{
    coord_state_config_t cfg = {.lease_ms = 5000,
                                .heartbeat_ms = 1000,
                                .min_nodes = min_nodes,
                                .max_nodes = max_nodes,
                                .last_call_ms = last_call_ms};
    memset(&changes, 0, sizeof(changes));
    coord_state_t *st = coord_state_create(&cfg, 0, record_change, &changes);
    CU_ASSERT_PTR_NOT_NULL_FATAL(st);
    return st;
}

/* Every lease key reg_as was given, by member id, so the join-report helpers can send the
 * reporting member's key (the tests name members by id there). */
enum { MAX_KEYED = 256 };
static struct {
    char id[COORD_ID_LEN + 1], key[COORD_KEY_LEN + 1];
} keyed[MAX_KEYED];
static size_t nkeyed;

static const char *key_of(const char *member_id)
{
    for (size_t i = 0; member_id && i < nkeyed && i < MAX_KEYED; i++)
        if (strcmp(keyed[i].id, member_id) == 0)
            return keyed[i].key;
    return NULL;
}

/* Registers a member that must succeed, with a lease key (NULL: none); returns its view. */
static coord_member_view_t reg_as(coord_state_t *st, coord_role_t role, const char *name,
                                  const char *key, int64_t now_ns)
{
    coord_member_view_t v;
    char err[256] = "";
    pshard_status_t rc = coord_state_register(st, role, name, "10.0.0.1:7000", "node-a", "cuda:0",
                                              key, now_ns, &v, err, sizeof(err));
    CU_ASSERT_EQUAL(rc, PSHARD_OK);
    if (rc == PSHARD_OK) {
        size_t at = nkeyed++ % MAX_KEYED; /* a ring: the newest registrations */
        memcpy(keyed[at].id, v.member_id, sizeof(keyed[at].id));
        memcpy(keyed[at].key, v.lease_key, sizeof(keyed[at].key));
    }
    if (rc != PSHARD_OK)
        fprintf(stderr, "register %s: %s\n", name, err);
    return v;
}

static coord_member_view_t reg(coord_state_t *st, coord_role_t role, const char *name,
                               int64_t now_ns)
{
    return reg_as(st, role, name, NULL, now_ns);
}

static int rank_of(coord_state_t *st, const coord_member_view_t *m, int64_t now_ns)
{
    coord_member_view_t v;
    char err[256] = "";
    pshard_status_t rc =
        coord_state_heartbeat(st, m->member_id, m->lease_key, now_ns, &v, err, sizeof(err));
    CU_ASSERT_EQUAL(rc, PSHARD_OK);
    return rc == PSHARD_OK ? v.rank : -2;
}

static bool last_reason_is(const char *want)
{
    if (changes.n == 0 || changes.n > MAX_CHANGES)
        return false;
    return strcmp(changes.reason[changes.n - 1], want) == 0;
}

static bool id_well_formed(const char *id)
{
    if (strlen(id) != COORD_ID_LEN)
        return false;
    for (const char *p = id; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f')))
            return false;
    return true;
}

static void test_create_rejects_bad_config(void)
{
    coord_state_config_t good = {5000, 1000, 1, 1, 0};
    coord_state_config_t bad = good;
    bad.lease_ms = 0;
    CU_ASSERT_PTR_NULL(coord_state_create(&bad, 0, NULL, NULL));
    bad = good;
    bad.heartbeat_ms = 0;
    CU_ASSERT_PTR_NULL(coord_state_create(&bad, 0, NULL, NULL));
    bad = good;
    bad.min_nodes = 0;
    CU_ASSERT_PTR_NULL(coord_state_create(&bad, 0, NULL, NULL));
    bad = good;
    bad.min_nodes = 3;
    bad.max_nodes = 2;
    CU_ASSERT_PTR_NULL(coord_state_create(&bad, 0, NULL, NULL));
    bad = good;
    bad.last_call_ms = -1;
    CU_ASSERT_PTR_NULL(coord_state_create(&bad, 0, NULL, NULL));
    CU_ASSERT_PTR_NULL(coord_state_create(NULL, 0, NULL, NULL));
    coord_state_t *st = coord_state_create(&good, 0, NULL, NULL);
    CU_ASSERT_PTR_NOT_NULL(st);
    CU_ASSERT_EQUAL(coord_state_generation(st), 1);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMING);
    coord_state_destroy(st);
    coord_state_destroy(NULL);
}

static void test_register_heartbeat_lease_expiry(void)
{
    coord_state_t *st = make_state(2, 2, 0);
    coord_member_view_t v = reg(st, SRV, "s1", MS(0));
    CU_ASSERT_TRUE(id_well_formed(v.member_id));
    CU_ASSERT_EQUAL(v.generation, 2);
    CU_ASSERT_EQUAL(v.rank, -1);
    CU_ASSERT_EQUAL(v.world_size, 0);
    CU_ASSERT_EQUAL(v.state, COORD_CLUSTER_FORMING);
    CU_ASSERT_EQUAL(v.lease_ms, 5000);
    CU_ASSERT_EQUAL(v.heartbeat_ms, 1000);
    CU_ASSERT_EQUAL(changes.n, 1);
    CU_ASSERT_EQUAL(changes.generation[0], 2);
    CU_ASSERT_TRUE(last_reason_is("member s1 registered"));

    /* A heartbeat renews the lease and never bumps the generation. */
    coord_member_view_t hb;
    char err[256] = "";
    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, v.member_id, v.lease_key, MS(3000), &hb, err, sizeof(err)),
        PSHARD_OK);
    CU_ASSERT_EQUAL(hb.generation, 2);
    CU_ASSERT_STRING_EQUAL(hb.member_id, v.member_id);
    CU_ASSERT_EQUAL(changes.n, 1);
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(8000) + 1);

    /* The old deadline (5 s) passing changes nothing; the renewed one (8 s) evicts. */
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(6000)), 0);
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(8000)), 0);
    CU_ASSERT_EQUAL(coord_state_generation(st), 2);
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(8000) + 1), 1);
    CU_ASSERT_EQUAL(coord_state_generation(st), 3);
    CU_ASSERT_TRUE(last_reason_is("member s1 lease expired"));
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), INT64_MAX);

    coord_snapshot_t *snap = coord_state_snapshot(st, MS(8001));
    CU_ASSERT_PTR_NOT_NULL_FATAL(snap);
    CU_ASSERT_EQUAL(snap->nmembers, 0);
    coord_snapshot_free(snap);

    err[0] = '\0';
    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, v.member_id, v.lease_key, MS(8002), &hb, err, sizeof(err)),
        PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, v.member_id));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "register again"));
    CU_ASSERT_EQUAL(coord_state_generation(st), 3);
    coord_state_destroy(st);
}

static void test_ids_unique_and_never_reused(void)
{
    coord_state_t *st = make_state(100, 100, 0);
    enum { N = 50 };
    char ids[N * 2][COORD_ID_LEN + 1];
    for (int i = 0; i < N; i++) {
        char name[16];
        snprintf(name, sizeof(name), "m%d", i);
        coord_member_view_t v = reg(st, SRV, name, MS(i));
        memcpy(ids[i], v.member_id, sizeof(ids[i]));
        /* Re-registering the same name (with its key) replaces it with a fresh id. */
        v = reg_as(st, SRV, name, v.lease_key, MS(i));
        memcpy(ids[N + i], v.member_id, sizeof(ids[i]));
    }
    for (int i = 0; i < 2 * N; i++) {
        CU_ASSERT_TRUE(id_well_formed(ids[i]));
        for (int j = 0; j < i; j++)
            CU_ASSERT_STRING_NOT_EQUAL(ids[i], ids[j]);
    }
    coord_state_destroy(st);
}

/* Checks that the snapshot lists names in this order with these ranks. */
static void expect_snapshot(coord_state_t *st, int64_t now_ns, const char *const *names,
                            const int *ranks, size_t n)
{
    coord_snapshot_t *snap = coord_state_snapshot(st, now_ns);
    CU_ASSERT_PTR_NOT_NULL_FATAL(snap);
    CU_ASSERT_EQUAL_FATAL(snap->nmembers, n);
    for (size_t i = 0; i < n; i++) {
        CU_ASSERT_STRING_EQUAL(snap->members[i].name, names[i]);
        CU_ASSERT_EQUAL(snap->members[i].rank, ranks[i]);
    }
    coord_snapshot_free(snap);
}

static void test_fixed_size_natural_order(void)
{
    static const char *const arrival[2][3] = {{"s10", "s2", "s1"}, {"s1", "s2", "s10"}};
    for (int round = 0; round < 2; round++) {
        coord_state_t *st = make_state(3, 3, 1000);
        coord_member_view_t v[3];
        v[0] = reg(st, SRV, arrival[round][0], MS(0));
        v[1] = reg(st, SRV, arrival[round][1], MS(1));
        CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMING);
        CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(5000) + 1); /* no last call */
        v[2] = reg(st, SRV, arrival[round][2], MS(2));
        /* max reached: formed at once, no last call even though last_call_ms > 0. */
        CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
        CU_ASSERT_EQUAL(v[2].state, COORD_CLUSTER_FORMED);
        CU_ASSERT_EQUAL(v[2].world_size, 3);
        CU_ASSERT_EQUAL(v[2].generation, 5); /* 1 + three registers + formed */
        CU_ASSERT_EQUAL(changes.n, 4);
        CU_ASSERT_TRUE(last_reason_is("cluster formed with 3 shard servers"));
        for (int i = 0; i < 3; i++) {
            int want = strcmp(arrival[round][i], "s1") == 0   ? 0
                       : strcmp(arrival[round][i], "s2") == 0 ? 1
                                                              : 2;
            CU_ASSERT_EQUAL(rank_of(st, &v[i], MS(3)), want);
        }
        CU_ASSERT_EQUAL(v[2].rank, round == 0 ? 0 : 2);
        static const char *const names[] = {"s1", "s2", "s10"};
        static const int ranks[] = {0, 1, 2};
        expect_snapshot(st, MS(3), names, ranks, 3);
        coord_state_destroy(st);
    }
}

static void test_last_call_forms_at_expiry(void)
{
    coord_state_t *st = make_state(2, 4, 1000);
    reg(st, SRV, "a", MS(0));
    coord_snapshot_t *snap = coord_state_snapshot(st, MS(0));
    CU_ASSERT_STRING_EQUAL(snap->awaiting, "1 more shard server (1 of min 2 registered)");
    CU_ASSERT_EQUAL(snap->last_call_remaining_ms, -1);
    coord_snapshot_free(snap);

    reg(st, SRV, "b", MS(100)); /* min reached: last call until 1100 ms */
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMING);
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(1100));
    reg(st, SRV, "c", MS(500)); /* does not restart the timer */
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(1100));

    snap = coord_state_snapshot(st, MS(900));
    CU_ASSERT_EQUAL(snap->last_call_remaining_ms, 200);
    CU_ASSERT_EQUAL(snap->shard_servers, 3);
    CU_ASSERT_STRING_EQUAL(snap->awaiting,
                           "last call: waiting up to 200 ms for up to 1 more shard server");
    coord_snapshot_free(snap);

    CU_ASSERT_EQUAL(coord_state_tick(st, MS(1100) - 1), 0);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMING);
    uint64_t gen = coord_state_generation(st);
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(1100)), 1);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
    CU_ASSERT_EQUAL(coord_state_generation(st), gen + 1);
    CU_ASSERT_TRUE(last_reason_is("cluster formed with 3 shard servers"));

    snap = coord_state_snapshot(st, MS(1100));
    CU_ASSERT_EQUAL(snap->world_size, 3);
    CU_ASSERT_EQUAL(snap->last_call_remaining_ms, -1);
    CU_ASSERT_STRING_EQUAL(snap->awaiting, "");
    coord_snapshot_free(snap);
    /* Only leases remain. */
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(5000) + 1);

    /* world_size is fixed now: a fourth server (max is 4) is a standby. */
    coord_member_view_t d = reg(st, SRV, "d", MS(1200));
    CU_ASSERT_EQUAL(d.rank, -1);
    CU_ASSERT_EQUAL(d.world_size, 3);
    CU_ASSERT_TRUE(last_reason_is("member d registered as standby"));
    coord_state_destroy(st);
}

static void test_last_call_reaching_max_forms_at_once(void)
{
    coord_state_t *st = make_state(2, 3, 1000);
    reg(st, SRV, "a", MS(0));
    reg(st, SRV, "b", MS(10));
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(1010));
    coord_member_view_t v = reg(st, SRV, "c", MS(20));
    CU_ASSERT_EQUAL(v.state, COORD_CLUSTER_FORMED);
    CU_ASSERT_EQUAL(v.world_size, 3);
    CU_ASSERT_EQUAL(v.rank, 2);
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(5000) + 1);
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(1010)), 0);
    coord_state_destroy(st);
}

static void test_last_call_zero_forms_at_min(void)
{
    coord_state_t *st = make_state(2, 4, 0);
    reg(st, SRV, "a", MS(0));
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMING);
    coord_member_view_t v = reg(st, SRV, "b", MS(1));
    CU_ASSERT_EQUAL(v.state, COORD_CLUSTER_FORMED);
    CU_ASSERT_EQUAL(v.world_size, 2);
    coord_state_destroy(st);
}

static void test_last_call_cancelled_below_min(void)
{
    coord_state_t *st = make_state(2, 4, 1000);
    reg(st, SRV, "a", MS(0));
    coord_member_view_t b = reg(st, SRV, "b", MS(0));
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(1000));
    char err[256] = "";
    CU_ASSERT_EQUAL(coord_state_leave(st, b.member_id, b.lease_key, MS(500), err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_TRUE(last_reason_is("member b left"));
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(5000) + 1);
    coord_snapshot_t *snap = coord_state_snapshot(st, MS(600));
    CU_ASSERT_EQUAL(snap->last_call_remaining_ms, -1);
    coord_snapshot_free(snap);
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(1000)), 0);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMING);

    /* Back at min: a fresh timer from that moment. */
    reg(st, SRV, "b", MS(2000));
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(3000));
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(2999)), 0);
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(3000)), 1);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
    coord_state_destroy(st);
}

static void test_last_call_eviction_below_min_cancels(void)
{
    coord_state_t *st = make_state(2, 4, 10000); /* last call longer than the lease */
    coord_member_view_t a = reg(st, SRV, "a", MS(0));
    reg(st, SRV, "b", MS(0));
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(5000) + 1);
    char err[64] = "";
    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, a.member_id, a.lease_key, MS(4000), NULL, err, sizeof(err)),
        PSHARD_OK);
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(5000) + 1), 1); /* b lapses */
    CU_ASSERT_TRUE(last_reason_is("member b lease expired"));
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(9000) + 1); /* timer gone */
    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, a.member_id, a.lease_key, MS(8000), NULL, err, sizeof(err)),
        PSHARD_OK);
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(10000)), 0);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMING);
    coord_state_destroy(st);
}

static void test_standby_beyond_max(void)
{
    coord_state_t *st = make_state(2, 2, 0);
    reg(st, SRV, "b", MS(0));
    reg(st, SRV, "a", MS(0));
    coord_member_view_t c = reg(st, SRV, "c", MS(1));
    coord_member_view_t aa = reg(st, SRV, "aa", MS(1));
    CU_ASSERT_EQUAL(c.rank, -1);
    CU_ASSERT_EQUAL(aa.rank, -1);
    CU_ASSERT_EQUAL(c.state, COORD_CLUSTER_FORMED);
    CU_ASSERT_EQUAL(c.world_size, 2);
    static const char *const names[] = {"a", "b", "aa", "c"};
    static const int ranks[] = {0, 1, -1, -1};
    expect_snapshot(st, MS(2), names, ranks, 4);
    coord_state_destroy(st);
}

/* Forms a cluster of s1, s2, s10 at time 0 and returns their views in that order. */
static coord_state_t *formed_three(coord_member_view_t v[3])
{
    coord_state_t *st = make_state(3, 3, 0);
    v[2] = reg(st, SRV, "s10", MS(0));
    v[0] = reg(st, SRV, "s1", MS(0));
    v[1] = reg(st, SRV, "s2", MS(0));
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
    return st;
}

static void test_reregister_live_keeps_rank(void)
{
    coord_member_view_t v[3];
    coord_state_t *st = formed_three(v);
    uint64_t gen = coord_state_generation(st);
    coord_member_view_t again = reg_as(st, SRV, "s2", v[1].lease_key, MS(100));
    CU_ASSERT_STRING_NOT_EQUAL(again.member_id, v[1].member_id);
    CU_ASSERT_STRING_NOT_EQUAL(again.lease_key, v[1].lease_key);
    CU_ASSERT_EQUAL(again.rank, 1);
    CU_ASSERT_EQUAL(again.state, COORD_CLUSTER_FORMED);
    CU_ASSERT_EQUAL(coord_state_generation(st), gen + 1);
    CU_ASSERT_TRUE(last_reason_is("member s2 registered (replaced) with rank 1"));

    coord_member_view_t hb;
    char err[256] = "";
    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, v[1].member_id, v[1].lease_key, MS(200), &hb, err, sizeof(err)),
        PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_EQUAL(rank_of(st, &again, MS(200)), 1);
    static const char *const names[] = {"s1", "s2", "s10"};
    static const int ranks[] = {0, 1, 2};
    expect_snapshot(st, MS(200), names, ranks, 3);
    coord_state_destroy(st);
}

static void test_evicted_rank_returns_and_reforms(void)
{
    coord_member_view_t v[3];
    coord_state_t *st = formed_three(v);
    uint64_t gen = coord_state_generation(st);
    /* The forming generation scopes the collectives; it stays put while trainers come and go. */
    CU_ASSERT_EQUAL(v[1].formed_generation, gen); /* s2 registered last and formed it */
    coord_member_view_t tr = reg(st, TRN, "t0", MS(100));
    CU_ASSERT_EQUAL(tr.formed_generation, gen);
    CU_ASSERT(tr.generation > gen);
    gen = coord_state_generation(st);
    /* s1 and s10 keep heartbeating; s2 goes silent. */
    CU_ASSERT_EQUAL(rank_of(st, &v[0], MS(4000)), 0);
    CU_ASSERT_EQUAL(rank_of(st, &v[2], MS(4000)), 2);
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(5000) + 1), 2);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_DEGRADED);
    CU_ASSERT_EQUAL(coord_state_generation(st), gen + 2);
    CU_ASSERT_STRING_EQUAL(changes.reason[changes.n - 2], "member s2 lease expired");
    CU_ASSERT_TRUE(last_reason_is("cluster degraded: rank 1 (was s2) is vacant"));

    coord_snapshot_t *snap = coord_state_snapshot(st, MS(5001));
    CU_ASSERT_EQUAL(snap->state, COORD_CLUSTER_DEGRADED);
    CU_ASSERT_EQUAL(snap->world_size, 3);
    CU_ASSERT_EQUAL(snap->shard_servers, 2);
    CU_ASSERT_STRING_EQUAL(snap->awaiting, "rank 1 (was s2)");
    coord_snapshot_free(snap);

    coord_member_view_t back = reg(st, SRV, "s2", MS(6000));
    CU_ASSERT_EQUAL(back.rank, 1);
    CU_ASSERT_EQUAL(back.world_size, 3);
    CU_ASSERT_EQUAL(back.state, COORD_CLUSTER_FORMED);
    CU_ASSERT_EQUAL(coord_state_generation(st), gen + 4);
    CU_ASSERT_STRING_EQUAL(changes.reason[changes.n - 2], "member s2 registered with rank 1");
    CU_ASSERT_PTR_NOT_NULL(strstr(changes.reason[changes.n - 1], "cluster formed again"));
    /* Re-forming moves the forming generation on: old rings are not the new one. */
    CU_ASSERT_EQUAL(coord_state_generation(st), gen + 4);
    coord_member_view_t again;
    char err[64] = "";
    CU_ASSERT_EQUAL(coord_state_heartbeat(st, back.member_id, back.lease_key, MS(6001), &again, err,
                                          sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(again.formed_generation, gen + 4);
    coord_state_destroy(st);
}

/* A launcher declares a trainer it reaped lost, by name: gone at once with the reason the
 * shard servers read; a shard server, an unknown name or a bad reason are refused. */
static void test_declare_trainer_lost(void)
{
    coord_member_view_t v[3];
    coord_state_t *st = formed_three(v);
    coord_member_view_t t = reg(st, TRN, "trainer-1", MS(10));
    uint64_t gen = coord_state_generation(st);
    char err[256] = "";
    CU_ASSERT_EQUAL(
        coord_state_declare_lost(st, "trainer-1", "exited with status 3", MS(20), err, sizeof(err)),
        PSHARD_OK);
    CU_ASSERT_TRUE(last_reason_is("member trainer-1 lost (exited with status 3)"));
    CU_ASSERT_EQUAL(coord_state_generation(st), gen + 1);
    /* Its lease is gone: the dead trainer's key no longer heartbeats. */
    coord_member_view_t again;
    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, t.member_id, t.lease_key, MS(30), &again, err, sizeof(err)),
        PSHARD_ERR_NOT_FOUND);
    err[0] = '\0'; /* ps_errf keeps the first error */
    CU_ASSERT_EQUAL(coord_state_declare_lost(st, "trainer-1", "again", MS(40), err, sizeof(err)),
                    PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "no member named \"trainer-1\""));
    reg(st, TRN, "trainer-2", MS(50));
    CU_ASSERT_EQUAL(coord_state_declare_lost(st, "trainer-2", "a\nb", MS(60), err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    char longer[256];
    memset(longer, 'x', 201);
    longer[201] = '\0';
    CU_ASSERT_EQUAL(coord_state_declare_lost(st, "trainer-2", longer, MS(60), err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(coord_state_declare_lost(st, "trainer-2", "", MS(60), err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED); /* servers untouched */
    coord_state_destroy(st);
}

/* A launcher declares a shard server it reaped lost: its rank is vacant at once (DEGRADED), and
 * the server that takes the rank again learns that the rank's state was lost with it, unlike
 * the servers that formed the cluster; a second replacement is refused. After every server
 * was lost, the new ones are not told they replace anyone. */
static void test_declare_server_lost(void)
{
    coord_member_view_t v[3];
    coord_state_t *st = formed_three(v);
    CU_ASSERT_FALSE(v[0].replaces_lost);
    char err[256] = "";
    int rank = v[1].rank;
    CU_ASSERT_EQUAL(
        coord_state_declare_lost(st, "s2", "killed by signal 9", MS(20), err, sizeof(err)),
        PSHARD_OK);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_DEGRADED);
    coord_member_view_t back = reg(st, SRV, "s2", MS(30));
    CU_ASSERT_EQUAL(back.rank, rank);
    CU_ASSERT_TRUE(back.replaces_lost);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
    /* A second replacement for the rank is refused while the first holds its lease. */
    coord_member_view_t second;
    CU_ASSERT_EQUAL(coord_state_register(st, SRV, "s2", "10.0.0.2:7000", "node-b", "cpu", NULL,
                                         MS(40), &second, err, sizeof(err)),
                    PSHARD_ERR_ALREADY_EXISTS);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "held by a live member"));
    coord_state_destroy(st);

    /* Every server lost and new ones registering (a full restart on a coordinator that
     * outlived the job): none of them can heal from anyone, so none is told it replaces. */
    st = formed_three(v);
    const char *names[3] = {"s1", "s2", "s10"};
    for (int i = 0; i < 3; i++)
        CU_ASSERT_EQUAL(coord_state_declare_lost(st, names[i], "stopped", MS(20), err, sizeof(err)),
                        PSHARD_OK);
    for (int i = 0; i < 3; i++)
        CU_ASSERT_FALSE(reg(st, SRV, names[i], MS(30 + i)).replaces_lost);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
    coord_state_destroy(st);
}

static void test_degraded_new_name_takes_lowest_vacant(void)
{
    coord_member_view_t v[3];
    coord_state_t *st = formed_three(v);
    char err[256] = "";
    CU_ASSERT_EQUAL(coord_state_leave(st, v[2].member_id, v[2].lease_key, MS(10), err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_DEGRADED);
    CU_ASSERT_STRING_EQUAL(changes.reason[changes.n - 2], "member s10 left");
    CU_ASSERT_EQUAL(coord_state_leave(st, v[1].member_id, v[1].lease_key, MS(20), err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_TRUE(last_reason_is("member s2 left")); /* already degraded: one bump */
    coord_snapshot_t *snap = coord_state_snapshot(st, MS(20));
    CU_ASSERT_STRING_EQUAL(snap->awaiting, "rank 1 (was s2), rank 2 (was s10)");
    coord_snapshot_free(snap);

    coord_member_view_t x = reg(st, SRV, "x", MS(30));
    CU_ASSERT_EQUAL(x.rank, 1);
    CU_ASSERT_EQUAL(x.state, COORD_CLUSTER_DEGRADED);
    snap = coord_state_snapshot(st, MS(30));
    CU_ASSERT_STRING_EQUAL(snap->awaiting, "rank 2 (was s10)");
    coord_snapshot_free(snap);

    /* Slot 1 now remembers x, so s2 is a new name and takes the last vacant slot. */
    coord_member_view_t s2 = reg(st, SRV, "s2", MS(40));
    CU_ASSERT_EQUAL(s2.rank, 2);
    CU_ASSERT_EQUAL(s2.state, COORD_CLUSTER_FORMED);
    /* And a full cluster turns the next new name into a standby. */
    coord_member_view_t s10 = reg(st, SRV, "s10", MS(50));
    CU_ASSERT_EQUAL(s10.rank, -1);
    /* The snapshot lists ranked servers by rank, not by name. */
    static const char *const names[] = {"s1", "x", "s2", "s10"};
    static const int ranks[] = {0, 1, 2, -1};
    expect_snapshot(st, MS(50), names, ranks, 4);

    CU_ASSERT_EQUAL(coord_state_leave(st, x.member_id, x.lease_key, MS(60), err, sizeof(err)),
                    PSHARD_OK);
    snap = coord_state_snapshot(st, MS(60));
    CU_ASSERT_STRING_EQUAL(snap->awaiting, "rank 1 (was x)");
    coord_snapshot_free(snap);
    coord_member_view_t xb = reg(st, SRV, "x", MS(70));
    CU_ASSERT_EQUAL(xb.rank, 1);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
    coord_state_destroy(st);
}

static void test_degraded_returning_names_get_their_own_ranks(void)
{
    coord_member_view_t v[3];
    coord_state_t *st = formed_three(v);
    char err[256] = "";
    CU_ASSERT_EQUAL(coord_state_leave(st, v[0].member_id, v[0].lease_key, MS(10), err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(coord_state_leave(st, v[2].member_id, v[2].lease_key, MS(10), err, sizeof(err)),
                    PSHARD_OK);
    coord_snapshot_t *snap = coord_state_snapshot(st, MS(10));
    CU_ASSERT_STRING_EQUAL(snap->awaiting, "rank 0 (was s1), rank 2 (was s10)");
    coord_snapshot_free(snap);
    /* s10 comes back first, but gets its own rank 2, not the lowest vacant 0. */
    coord_member_view_t s10 = reg(st, SRV, "s10", MS(20));
    CU_ASSERT_EQUAL(s10.rank, 2);
    CU_ASSERT_EQUAL(s10.state, COORD_CLUSTER_DEGRADED);
    coord_member_view_t s1 = reg(st, SRV, "s1", MS(30));
    CU_ASSERT_EQUAL(s1.rank, 0);
    CU_ASSERT_EQUAL(s1.state, COORD_CLUSTER_FORMED);
    CU_ASSERT_EQUAL(s1.world_size, 3);
    coord_state_destroy(st);
}

static void test_leave(void)
{
    coord_member_view_t v[3];
    coord_state_t *st = formed_three(v);
    coord_member_view_t t = reg(st, TRN, "t0", MS(0));
    CU_ASSERT_EQUAL(t.rank, -1);
    uint64_t gen = coord_state_generation(st);
    char err[256] = "";
    CU_ASSERT_EQUAL(coord_state_leave(st, t.member_id, t.lease_key, MS(1), err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(coord_state_generation(st), gen + 1);
    CU_ASSERT_TRUE(last_reason_is("member t0 left"));
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);

    CU_ASSERT_EQUAL(coord_state_leave(st, v[0].member_id, v[0].lease_key, MS(2), err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_DEGRADED);
    CU_ASSERT_EQUAL(coord_state_generation(st), gen + 3);

    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_state_leave(st, v[0].member_id, v[0].lease_key, MS(3), err, sizeof(err)),
                    PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "unknown member id"));
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_state_leave(st, "xyz", NULL, MS(3), err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(coord_state_generation(st), gen + 3);
    coord_state_destroy(st);
}

/* A shard server's own health (its heartbeat says): a ranked one not serving makes a formed
 * cluster DEGRADED, named with its reason (kept printable), without a bump; serving again
 * makes it FORMED. A trainer's or a standby's says nothing about the cluster. */
static void test_health_reports(void)
{
    coord_member_view_t v[3];
    coord_state_t *st = formed_three(v);
    uint64_t gen = coord_state_generation(st);
    CU_ASSERT_FALSE(coord_state_set_health(st, v[1].member_id, NULL)); /* serving already */
    CU_ASSERT_TRUE(coord_state_set_health(st, v[1].member_id, "ring failed\033[2J"));
    CU_ASSERT_FALSE(coord_state_set_health(st, v[1].member_id, "ring failed\033[2J"));
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_DEGRADED);
    CU_ASSERT_EQUAL(coord_state_generation(st), gen);
    coord_snapshot_t *snap = coord_state_snapshot(st, MS(1));
    CU_ASSERT_PTR_NOT_NULL_FATAL(snap);
    CU_ASSERT_EQUAL(snap->state, COORD_CLUSTER_DEGRADED);
    CU_ASSERT_PTR_NOT_NULL(strstr(snap->awaiting, "not serving: ring failed?[2J"));
    CU_ASSERT_PTR_NULL(strchr(snap->awaiting, '\033'));
    coord_snapshot_free(snap);
    CU_ASSERT_TRUE(coord_state_set_health(st, v[1].member_id, ""));
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
    coord_member_view_t t = reg(st, TRN, "t0", MS(2));
    CU_ASSERT_TRUE(coord_state_set_health(st, t.member_id, "whatever"));
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
    CU_ASSERT_FALSE(coord_state_set_health(st, "0123456789abcdef0123456789abcdef", "x"));
    coord_state_destroy(st);
}

/* The member id is public (Status and Watch show it); the lease key is the credential. A
 * stranger who knows a live member's id or name can neither renew, end nor report for its
 * lease, nor take its name (and rank) until that lease has lapsed. */
static void test_lease_key_is_the_credential(void)
{
    coord_member_view_t v[3];
    coord_state_t *st = formed_three(v);
    CU_ASSERT_EQUAL(strlen(v[1].lease_key), COORD_KEY_LEN);
    CU_ASSERT_STRING_NOT_EQUAL(v[1].lease_key, v[1].member_id);
    CU_ASSERT_STRING_NOT_EQUAL(v[1].lease_key, v[2].lease_key);
    uint64_t gen = coord_state_generation(st);
    char err[512] = "";
    coord_member_view_t out;

    /* Heartbeat and Leave with the id alone, or with another member's key: refused. */
    err[0] = '\0';
    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, v[1].member_id, NULL, MS(100), &out, err, sizeof(err)),
        PSHARD_ERR_PERMISSION);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "no lease key"));
    err[0] = '\0';
    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, v[1].member_id, v[2].lease_key, MS(100), &out, err, sizeof(err)),
        PSHARD_ERR_PERMISSION);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "wrong lease key"));
    err[0] = '\0';
    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, v[1].member_id, "short", MS(100), &out, err, sizeof(err)),
        PSHARD_ERR_PERMISSION);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_state_leave(st, v[1].member_id, "", MS(100), err, sizeof(err)),
                    PSHARD_ERR_PERMISSION);
    coord_join_report_t r = {.member_id = v[1].member_id,
                             .lease_key = v[0].lease_key,
                             .rank = 1,
                             .phase = COORD_JOIN_PHASE_JOINED,
                             .step = 1};
    coord_join_change_t change;
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_state_report_join(st, &r, MS(100), &change, err, sizeof(err)),
                    PSHARD_ERR_PERMISSION);
    CU_ASSERT_EQUAL(change, COORD_JOIN_UNCHANGED);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_state_generation(st), gen);

    /* A refused heartbeat renewed nothing: s2 (which stops heartbeating) lapses on time. */
    CU_ASSERT_EQUAL(rank_of(st, &v[0], MS(4000)), 0);
    CU_ASSERT_EQUAL(rank_of(st, &v[2], MS(4000)), 2);

    /* Its name is not for the taking while the lease runs, with no key or a wrong one. */
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_state_register(st, SRV, "s2", "10.9.9.9:1", "", "", NULL, MS(4500), &out,
                                         err, sizeof(err)),
                    PSHARD_ERR_ALREADY_EXISTS);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "lapses in 500 ms"));
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_state_register(st, SRV, "s2", "10.9.9.9:1", "", "", v[0].lease_key,
                                         MS(4500), &out, err, sizeof(err)),
                    PSHARD_ERR_ALREADY_EXISTS);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_state_generation(st), gen);
    coord_snapshot_t *snap = coord_state_snapshot(st, MS(4500));
    CU_ASSERT_EQUAL(snap->nmembers, 3);
    for (size_t i = 0; i < snap->nmembers; i++) {
        CU_ASSERT_STRING_EQUAL(snap->members[i].lease_key, ""); /* never shown */
        if (strcmp(snap->members[i].name, "s2") == 0)
            CU_ASSERT_STRING_EQUAL(snap->members[i].address, "10.0.0.1:7000");
    }
    coord_snapshot_free(snap);

    /* Once the lease has lapsed (even before a tick evicted it), a restart takes it over: the
     * lapsed one is evicted first (the others learn of the loss), and the restart replaces it. */
    coord_member_view_t back = reg(st, SRV, "s2", MS(5001));
    CU_ASSERT_EQUAL(back.rank, 1);
    CU_ASSERT_TRUE(back.replaces_lost);
    err[0] = '\0';
    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, v[1].member_id, v[1].lease_key, MS(5002), &out, err, sizeof(err)),
        PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_EQUAL(rank_of(st, &back, MS(5002)), 1);
    coord_state_destroy(st);
}

static void test_trainers_and_names_per_role(void)
{
    coord_state_t *st = make_state(2, 2, 0);
    coord_member_view_t tb = reg(st, TRN, "t10", MS(0));
    reg(st, TRN, "t2", MS(0));
    CU_ASSERT_TRUE(last_reason_is("member t2 registered as trainer"));
    /* Trainers do not count toward the rendezvous. */
    reg(st, SRV, "t10", MS(0)); /* same name, other role: both exist */
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMING);
    reg(st, SRV, "s1", MS(0));
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
    CU_ASSERT_EQUAL(rank_of(st, &tb, MS(1)), -1);
    static const char *const names[] = {"s1", "t10", "t2", "t10"};
    static const int ranks[] = {0, 1, -1, -1};
    expect_snapshot(st, MS(1), names, ranks, 4);
    coord_snapshot_t *snap = coord_state_snapshot(st, MS(1));
    CU_ASSERT_EQUAL(snap->members[0].role, SRV);
    CU_ASSERT_EQUAL(snap->members[1].role, SRV);
    CU_ASSERT_EQUAL(snap->members[2].role, TRN);
    CU_ASSERT_EQUAL(snap->members[3].role, TRN);
    CU_ASSERT_EQUAL(snap->shard_servers, 2);
    coord_snapshot_free(snap);

    /* Re-registering trainer t10 (with its key) replaces only the trainer. */
    coord_member_view_t tb2 = reg_as(st, TRN, "t10", tb.lease_key, MS(2));
    char err[256] = "";
    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, tb.member_id, tb.lease_key, MS(3), NULL, err, sizeof(err)),
        PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_EQUAL(rank_of(st, &tb2, MS(3)), -1);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
    snap = coord_state_snapshot(st, MS(3));
    CU_ASSERT_EQUAL(snap->nmembers, 4);
    coord_snapshot_free(snap);
    coord_state_destroy(st);
}

/* Expects a register to fail with INVALID_ARGUMENT and a message containing want. */
static void expect_register_error(coord_state_t *st, coord_role_t role, const char *name,
                                  const char *address, const char *want)
{
    char err[512] = "";
    coord_member_view_t v;
    pshard_status_t rc = coord_state_register(st, role, name, address, "node", "dev", NULL, MS(0),
                                              &v, err, sizeof(err));
    CU_ASSERT_EQUAL(rc, PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, want));
    if (!strstr(err, want))
        fprintf(stderr, "got \"%s\", want \"%s\"\n", err, want);
}

static void test_validation(void)
{
    coord_state_t *st = make_state(2, 2, 0);
    char long_name[COORD_NAME_MAX + 2];
    memset(long_name, 'n', sizeof(long_name));
    long_name[COORD_NAME_MAX + 1] = '\0'; /* 254 bytes */
    char long_addr[COORD_FIELD_MAX + 2];
    memset(long_addr, 'a', sizeof(long_addr));
    long_addr[COORD_FIELD_MAX + 1] = '\0';

    expect_register_error(st, SRV, "", "", "name is empty");
    expect_register_error(st, SRV, NULL, "", "name is empty");
    expect_register_error(st, SRV, long_name, "", "name is 254 bytes; the limit is 253");
    expect_register_error(st, SRV, "abc\x01x", "",
                          "name contains a non-printable or space byte at offset 3");
    expect_register_error(st, SRV, "a b", "", "non-printable or space byte at offset 1");
    expect_register_error(st, SRV, "caf\xc3\xa9", "", "at offset 3");
    expect_register_error(st, COORD_ROLE_UNSPECIFIED, "ok", "",
                          "role must be shard_server or trainer");
    expect_register_error(st, (coord_role_t)7, "ok", "", "role must be shard_server or trainer");
    expect_register_error(st, SRV, "ok", long_addr, "address is 256 bytes; the limit is 255");
    expect_register_error(st, SRV, "ok", "10.0.0.1\n", "address contains a non-printable byte");
    CU_ASSERT_EQUAL(coord_state_generation(st), 1);
    CU_ASSERT_EQUAL(changes.n, 0);

    /* The limits themselves are fine; fields may be empty or NULL. */
    long_name[COORD_NAME_MAX] = '\0';
    long_addr[COORD_FIELD_MAX] = '\0';
    coord_member_view_t v;
    char err[256] = "";
    CU_ASSERT_EQUAL(coord_state_register(st, SRV, long_name, long_addr, NULL, "", NULL, MS(0), &v,
                                         err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(coord_state_register(st, TRN, "t", "host with spaces:1", "", NULL, NULL, MS(0),
                                         &v, err, sizeof(err)),
                    PSHARD_OK);

    static const char *const bad_ids[] = {
        "",
        "abc",
        "0123456789ABCDEF0123456789abcdef",  /* uppercase */
        "0123456789abcdef0123456789abcdeg",  /* not hex */
        "0123456789abcdef0123456789abcdef0", /* 33 chars */
        "0123456789abcdef0123456789abcde",   /* 31 chars */
    };
    for (size_t i = 0; i < sizeof(bad_ids) / sizeof(bad_ids[0]); i++) {
        err[0] = '\0';
        CU_ASSERT_EQUAL(coord_state_heartbeat(st, bad_ids[i], NULL, MS(1), NULL, err, sizeof(err)),
                        PSHARD_ERR_INVALID_ARGUMENT);
        CU_ASSERT_PTR_NOT_NULL(strstr(err, "member id"));
    }
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_state_heartbeat(st, NULL, NULL, MS(1), NULL, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_state_heartbeat(st, "0123456789abcdef0123456789abcdef", NULL, MS(1), NULL,
                                          err, sizeof(err)),
                    PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "unknown member id 0123456789abcdef0123456789abcdef"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "evicted or never registered; register again"));
    coord_state_destroy(st);
}

static void test_next_deadline(void)
{
    coord_state_t *st = make_state(2, 4, 3000);
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), INT64_MAX);
    coord_member_view_t a = reg(st, SRV, "a", MS(1000));
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(6000) + 1);
    reg(st, TRN, "t", MS(500));
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(5500) + 1);
    reg(st, SRV, "b", MS(2000)); /* last call until 5000 ms, earlier than any lease */
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(5000));
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(5000)), 1); /* formed */
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(5500) + 1);
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(5500) + 1), 1); /* trainer t lapses */
    CU_ASSERT_TRUE(last_reason_is("member t lease expired"));
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(6000) + 1);
    char err[64] = "";
    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, a.member_id, a.lease_key, MS(6000), NULL, err, sizeof(err)),
        PSHARD_OK);
    CU_ASSERT_EQUAL(coord_state_next_deadline_ns(st), MS(7000) + 1); /* b's lease */
    coord_state_destroy(st);
}

static void test_snapshot_content(void)
{
    coord_state_t *st = make_state(3, 3, 0);
    coord_member_view_t v;
    char err[256] = "";
    CU_ASSERT_EQUAL(coord_state_register(st, SRV, "srv-b", "10.0.0.2:7000", "node-2", "cuda:1",
                                         NULL, MS(100), &v, err, sizeof(err)),
                    PSHARD_OK);
    reg(st, TRN, "trainer-0", MS(150));

    coord_snapshot_t *snap = coord_state_snapshot(st, MS(200));
    CU_ASSERT_PTR_NOT_NULL_FATAL(snap);
    CU_ASSERT_EQUAL(snap->generation, 3);
    CU_ASSERT_EQUAL(snap->state, COORD_CLUSTER_FORMING);
    CU_ASSERT_EQUAL(snap->world_size, 0);
    CU_ASSERT_EQUAL(snap->min_nodes, 3);
    CU_ASSERT_EQUAL(snap->max_nodes, 3);
    CU_ASSERT_EQUAL(snap->shard_servers, 1);
    CU_ASSERT_EQUAL(snap->last_call_remaining_ms, -1);
    CU_ASSERT_STRING_EQUAL(snap->awaiting, "2 more shard servers (1 of min 3 registered)");
    CU_ASSERT_EQUAL_FATAL(snap->nmembers, 2);
    const coord_member_t *m = &snap->members[0];
    CU_ASSERT_STRING_EQUAL(m->member_id, v.member_id);
    CU_ASSERT_EQUAL(m->role, SRV);
    CU_ASSERT_STRING_EQUAL(m->name, "srv-b");
    CU_ASSERT_STRING_EQUAL(m->address, "10.0.0.2:7000");
    CU_ASSERT_STRING_EQUAL(m->node, "node-2");
    CU_ASSERT_STRING_EQUAL(m->device, "cuda:1");
    CU_ASSERT_EQUAL(m->rank, -1);
    CU_ASSERT_EQUAL(m->registered_ns, MS(100));
    CU_ASSERT_EQUAL(m->last_heartbeat_ns, MS(100));
    CU_ASSERT_EQUAL(m->lease_deadline_ns, MS(5100));
    CU_ASSERT_EQUAL(m->registered_generation, 2);
    CU_ASSERT_STRING_EQUAL(snap->members[1].name, "trainer-0");
    CU_ASSERT_EQUAL(snap->members[1].registered_generation, 3);
    coord_snapshot_free(snap);
    coord_snapshot_free(NULL);

    CU_ASSERT_EQUAL(
        coord_state_heartbeat(st, v.member_id, v.lease_key, MS(900), NULL, err, sizeof(err)),
        PSHARD_OK);
    snap = coord_state_snapshot(st, MS(900));
    CU_ASSERT_EQUAL(snap->members[0].last_heartbeat_ns, MS(900));
    CU_ASSERT_EQUAL(snap->members[0].lease_deadline_ns, MS(5900));
    CU_ASSERT_EQUAL(snap->members[0].registered_ns, MS(100));
    coord_snapshot_free(snap);

    reg(st, SRV, "srv-a", MS(1000));
    reg(st, SRV, "srv-10", MS(1000));
    snap = coord_state_snapshot(st, MS(1000));
    CU_ASSERT_EQUAL(snap->state, COORD_CLUSTER_FORMED);
    CU_ASSERT_EQUAL(snap->world_size, 3);
    CU_ASSERT_STRING_EQUAL(snap->awaiting, "");
    CU_ASSERT_STRING_EQUAL(snap->members[0].name, "srv-10"); /* natural order: '1' < 'a' */
    CU_ASSERT_STRING_EQUAL(snap->members[1].name, "srv-a");
    CU_ASSERT_STRING_EQUAL(snap->members[2].name, "srv-b");
    CU_ASSERT_STRING_EQUAL(snap->members[3].name, "trainer-0");
    coord_snapshot_free(snap);
    coord_state_destroy(st);
}

static void test_names(void)
{
    CU_ASSERT_STRING_EQUAL(coord_role_name(SRV), "shard_server");
    CU_ASSERT_STRING_EQUAL(coord_role_name(TRN), "trainer");
    CU_ASSERT_STRING_EQUAL(coord_cluster_state_name(COORD_CLUSTER_FORMING), "forming");
    CU_ASSERT_STRING_EQUAL(coord_cluster_state_name(COORD_CLUSTER_FORMED), "formed");
    CU_ASSERT_STRING_EQUAL(coord_cluster_state_name(COORD_CLUSTER_DEGRADED), "degraded");
}

/* Many members with interleaved removals keep the id index consistent: every live id is
 * found, every removed one is not. */
static void test_many_members_index(void)
{
    enum { N = 3000 };
    coord_state_t *st = make_state(N + 1, N + 1, 0);
    static char ids[N][COORD_ID_LEN + 1], keys[N][COORD_KEY_LEN + 1];
    for (int i = 0; i < N; i++) {
        char name[16];
        snprintf(name, sizeof(name), "m%d", i);
        coord_member_view_t v = reg(st, i % 2 ? TRN : SRV, name, MS(0));
        memcpy(ids[i], v.member_id, sizeof(ids[i]));
        memcpy(keys[i], v.lease_key, sizeof(keys[i]));
    }
    char err[256];
    for (int i = 0; i < N; i += 3) {
        err[0] = '\0';
        CU_ASSERT_EQUAL(coord_state_leave(st, ids[i], keys[i], MS(1), err, sizeof(err)), PSHARD_OK);
    }
    /* Members 1, 4, 7, ... heartbeat; the rest lapse at once. */
    int ok = 0, missing = 0;
    for (int round = 0; round < 5; round++) {
        for (int i = 0; i < N; i++) {
            if (i % 3 == 2)
                continue;
            err[0] = '\0';
            pshard_status_t rc =
                coord_state_heartbeat(st, ids[i], keys[i], MS(1000), NULL, err, sizeof(err));
            if (i % 3 == 0)
                missing += rc == PSHARD_ERR_NOT_FOUND;
            else
                ok += rc == PSHARD_OK;
        }
    }
    CU_ASSERT_EQUAL(ok, 5 * (N / 3));
    CU_ASSERT_EQUAL(missing, 5 * (N / 3));
    CU_ASSERT_EQUAL(coord_state_tick(st, MS(5000) + 1), N / 3);
    coord_snapshot_t *snap = coord_state_snapshot(st, MS(5001));
    CU_ASSERT_EQUAL(snap->nmembers, (size_t)(N / 3));
    coord_snapshot_free(snap);
    for (int i = 0; i < N; i++) {
        err[0] = '\0';
        pshard_status_t rc =
            coord_state_heartbeat(st, ids[i], keys[i], MS(5002), NULL, err, sizeof(err));
        CU_ASSERT_EQUAL(rc, i % 3 == 1 ? PSHARD_OK : PSHARD_ERR_NOT_FOUND);
    }
    coord_state_destroy(st);
}

/* ---- Join table ------------------------------------------------------------------------- */

/* Sends one join report; returns its status and stores what it changed in *change. */
static pshard_status_t report(coord_state_t *st, const char *member_id, int rank, int phase,
                              int64_t step, bool throw_flag, int last_rank, int64_t now_ns,
                              coord_join_change_t *change, char *err, size_t errlen)
{
    coord_join_report_t r = {.member_id = member_id,
                             .lease_key = key_of(member_id),
                             .rank = rank,
                             .phase = phase,
                             .step = step,
                             .throw_on_early_termination = throw_flag,
                             .last_rank = last_rank};
    return coord_state_report_join(st, &r, now_ns, change, err, errlen);
}

/* A report that must succeed; returns what it changed. */
static coord_join_change_t report_ok(coord_state_t *st, const char *member_id, int rank, int phase,
                                     int64_t step, bool throw_flag, int last_rank, int64_t now_ns)
{
    char err[256] = "";
    coord_join_change_t change = (coord_join_change_t)-1;
    pshard_status_t rc = report(st, member_id, rank, phase, step, throw_flag, last_rank, now_ns,
                                &change, err, sizeof(err));
    CU_ASSERT_EQUAL(rc, PSHARD_OK);
    if (rc != PSHARD_OK)
        fprintf(stderr, "join report rank %d: %s\n", rank, err);
    return change;
}

/* A report that must fail with want and a message containing needle; nothing may change. */
static void expect_report_error(coord_state_t *st, const char *member_id, int rank, int phase,
                                int64_t step, int last_rank, pshard_status_t want,
                                const char *needle)
{
    char err[256] = "";
    coord_join_change_t change = (coord_join_change_t)-1;
    pshard_status_t rc = report(st, member_id, rank, phase, step, false, last_rank, MS(1), &change,
                                err, sizeof(err));
    CU_ASSERT_EQUAL(rc, want);
    CU_ASSERT_EQUAL(change, COORD_JOIN_UNCHANGED);
    if (!strstr(err, needle)) {
        fprintf(stderr, "join report error '%s' lacks '%s'\n", err, needle);
        CU_FAIL("error message");
    }
}

/* Checks the snapshot's join table: n entries with these ranks and steps, and last_joiner. */
static void expect_joins(coord_state_t *st, const int *ranks, const int64_t *steps, size_t n,
                         int last_joiner)
{
    coord_snapshot_t *snap = coord_state_snapshot(st, MS(1000));
    CU_ASSERT_PTR_NOT_NULL_FATAL(snap);
    CU_ASSERT_EQUAL(snap->njoins, n);
    for (size_t i = 0; i < n && i < snap->njoins; i++) {
        CU_ASSERT_EQUAL(snap->joins[i].rank, ranks[i]);
        CU_ASSERT_EQUAL(snap->joins[i].step, steps[i]);
    }
    CU_ASSERT_EQUAL(snap->last_joiner, last_joiner);
    coord_snapshot_free(snap);
}

enum { JOINED = COORD_JOIN_PHASE_JOINED, ALL = COORD_JOIN_PHASE_ALL_JOINED };

/* JOINED adds a rank's entry (sorted by rank in the snapshot), a repeat changes nothing, a
 * different step or flag updates it; none of it bumps the generation or calls on_change. */
static void test_join_add_update(void)
{
    coord_member_view_t v[3];
    coord_state_t *st = formed_three(v);
    reg(st, TRN, "t0", MS(0));
    uint64_t gen = coord_state_generation(st);
    int nchanges = changes.n;
    expect_joins(st, NULL, NULL, 0, -1);
    CU_ASSERT_EQUAL(coord_state_last_joiner(st), -1);

    CU_ASSERT_EQUAL(report_ok(st, v[2].member_id, 2, JOINED, 40, false, 0, MS(100)),
                    COORD_JOIN_CHANGED);
    coord_snapshot_t *snap = coord_state_snapshot(st, MS(150));
    CU_ASSERT_PTR_NOT_NULL_FATAL(snap);
    CU_ASSERT_EQUAL_FATAL(snap->njoins, 1);
    CU_ASSERT_EQUAL(snap->joins[0].rank, 2);
    CU_ASSERT_STRING_EQUAL(snap->joins[0].member_id, v[2].member_id);
    CU_ASSERT_EQUAL(snap->joins[0].step, 40);
    CU_ASSERT_EQUAL(snap->joins[0].joined_ns, MS(100));
    CU_ASSERT_FALSE(snap->joins[0].throw_on_early_termination);
    coord_snapshot_free(snap);

    /* A retried report is not a change and keeps the original time. */
    CU_ASSERT_EQUAL(report_ok(st, v[2].member_id, 2, JOINED, 40, false, 0, MS(200)),
                    COORD_JOIN_UNCHANGED);
    snap = coord_state_snapshot(st, MS(250));
    CU_ASSERT_EQUAL(snap->joins[0].joined_ns, MS(100));
    coord_snapshot_free(snap);

    CU_ASSERT_EQUAL(report_ok(st, v[0].member_id, 0, JOINED, 42, true, 0, MS(300)),
                    COORD_JOIN_CHANGED);
    static const int ranks02[] = {0, 2};
    static const int64_t steps02[] = {42, 40};
    expect_joins(st, ranks02, steps02, 2, -1);
    snap = coord_state_snapshot(st, MS(300));
    CU_ASSERT_TRUE(snap->joins[0].throw_on_early_termination);
    coord_snapshot_free(snap);

    /* A new step (or flag) for a rank already joined updates its entry in place. */
    CU_ASSERT_EQUAL(report_ok(st, v[2].member_id, 2, JOINED, 41, false, 0, MS(400)),
                    COORD_JOIN_CHANGED);
    static const int64_t steps02b[] = {42, 41};
    expect_joins(st, ranks02, steps02b, 2, -1);
    CU_ASSERT_EQUAL(report_ok(st, v[2].member_id, 2, JOINED, 41, true, 0, MS(500)),
                    COORD_JOIN_CHANGED);
    expect_joins(st, ranks02, steps02b, 2, -1);

    CU_ASSERT_EQUAL(coord_state_generation(st), gen);
    CU_ASSERT_EQUAL(changes.n, nchanges);
    coord_state_destroy(st);
}

/* ALL_JOINED clears the table and records the last joiner; the same completion reported by
 * another rank changes nothing; the next round fills the table again. */
static void test_join_all_joined(void)
{
    coord_member_view_t v[3];
    coord_state_t *st = formed_three(v);
    uint64_t gen = coord_state_generation(st);
    int nchanges = changes.n;
    for (int r = 0; r < 3; r++)
        CU_ASSERT_EQUAL(report_ok(st, v[r].member_id, r, JOINED, 10 + r, false, 0, MS(r)),
                        COORD_JOIN_CHANGED);
    static const int ranks[] = {0, 1, 2};
    static const int64_t steps[] = {10, 11, 12};
    expect_joins(st, ranks, steps, 3, -1);

    CU_ASSERT_EQUAL(report_ok(st, v[1].member_id, 1, ALL, 12, false, 2, MS(10)),
                    COORD_JOIN_ALL_JOINED);
    expect_joins(st, NULL, NULL, 0, 2);
    CU_ASSERT_EQUAL(coord_state_last_joiner(st), 2);
    /* The other ranks report the same completion. */
    CU_ASSERT_EQUAL(report_ok(st, v[0].member_id, 0, ALL, 12, false, 2, MS(11)),
                    COORD_JOIN_UNCHANGED);
    CU_ASSERT_EQUAL(report_ok(st, v[2].member_id, 2, ALL, 12, false, 2, MS(12)),
                    COORD_JOIN_UNCHANGED);
    expect_joins(st, NULL, NULL, 0, 2);

    /* A second round: the last joiner stays until that round completes. */
    CU_ASSERT_EQUAL(report_ok(st, v[2].member_id, 2, JOINED, 30, false, 0, MS(20)),
                    COORD_JOIN_CHANGED);
    static const int r2[] = {2};
    static const int64_t s30[] = {30};
    expect_joins(st, r2, s30, 1, 2);
    CU_ASSERT_EQUAL(report_ok(st, v[2].member_id, 2, ALL, 31, false, 0, MS(30)),
                    COORD_JOIN_ALL_JOINED);
    expect_joins(st, NULL, NULL, 0, 0);

    CU_ASSERT_EQUAL(coord_state_generation(st), gen);
    CU_ASSERT_EQUAL(changes.n, nchanges);
    coord_state_destroy(st);
}

/* The table and the last joiner are reset when the cluster re-forms (ranks restart); losing a
 * rank alone (degraded) keeps them. */
static void test_join_cleared_on_reform(void)
{
    coord_member_view_t v[3];
    coord_state_t *st = formed_three(v);
    CU_ASSERT_EQUAL(report_ok(st, v[0].member_id, 0, JOINED, 5, false, 0, MS(1)),
                    COORD_JOIN_CHANGED);
    CU_ASSERT_EQUAL(report_ok(st, v[0].member_id, 0, ALL, 5, false, 0, MS(2)),
                    COORD_JOIN_ALL_JOINED);
    CU_ASSERT_EQUAL(report_ok(st, v[0].member_id, 0, JOINED, 9, false, 0, MS(3)),
                    COORD_JOIN_CHANGED);
    CU_ASSERT_EQUAL(report_ok(st, v[2].member_id, 2, JOINED, 9, false, 0, MS(3)),
                    COORD_JOIN_CHANGED);
    static const int ranks[] = {0, 2};
    static const int64_t steps[] = {9, 9};
    expect_joins(st, ranks, steps, 2, 0);

    coord_snapshot_t *snap = coord_state_snapshot(st, MS(4));
    uint64_t formed_gen = snap->formed_generation;
    coord_snapshot_free(snap);
    char err[256] = "";
    CU_ASSERT_EQUAL(coord_state_leave(st, v[1].member_id, v[1].lease_key, MS(5), err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_DEGRADED);
    expect_joins(st, ranks, steps, 2, 0);
    /* The old incarnation cannot report any more. */
    expect_report_error(st, v[1].member_id, 1, JOINED, 9, 0, PSHARD_ERR_NOT_FOUND,
                        "unknown member id");

    coord_member_view_t back = reg(st, SRV, "s2", MS(6));
    CU_ASSERT_EQUAL(back.rank, 1);
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
    snap = coord_state_snapshot(st, MS(7));
    CU_ASSERT_NOT_EQUAL(snap->formed_generation, formed_gen);
    coord_snapshot_free(snap);
    expect_joins(st, NULL, NULL, 0, -1);
    CU_ASSERT_EQUAL(coord_state_last_joiner(st), -1);
    /* The new incarnation reports like any other. */
    CU_ASSERT_EQUAL(report_ok(st, back.member_id, 1, JOINED, 1, false, 0, MS(8)),
                    COORD_JOIN_CHANGED);
    coord_state_destroy(st);
}

/* Bad reports are refused with a message that says why, and change nothing. */
static void test_join_refused(void)
{
    coord_state_t *st = make_state(2, 2, 0);
    coord_member_view_t a = reg(st, SRV, "a", MS(0));
    /* Not formed yet: no ranks. */
    expect_report_error(st, a.member_id, 0, JOINED, 1, 0, PSHARD_ERR_FAILED_PRECONDITION,
                        "the cluster is still forming");
    coord_member_view_t b = reg(st, SRV, "b", MS(0));
    CU_ASSERT_EQUAL(coord_state_cluster_state(st), COORD_CLUSTER_FORMED);
    coord_member_view_t standby = reg(st, SRV, "c", MS(0));
    CU_ASSERT_EQUAL(standby.rank, -1);
    coord_member_view_t t = reg(st, TRN, "t", MS(0));
    uint64_t gen = coord_state_generation(st);
    int nchanges = changes.n;

    expect_report_error(st, standby.member_id, -1, JOINED, 1, 0, PSHARD_ERR_FAILED_PRECONDITION,
                        "it is a standby");
    expect_report_error(st, t.member_id, 0, JOINED, 1, 0, PSHARD_ERR_INVALID_ARGUMENT,
                        "is a trainer");
    expect_report_error(st, a.member_id, 1, JOINED, 1, 0, PSHARD_ERR_INVALID_ARGUMENT,
                        "holds rank 0, but reported a join for rank 1");
    expect_report_error(st, b.member_id, 7, JOINED, 1, 0, PSHARD_ERR_INVALID_ARGUMENT,
                        "holds rank 1, but reported a join for rank 7");
    expect_report_error(st, a.member_id, 0, 0, 1, 0, PSHARD_ERR_INVALID_ARGUMENT,
                        "join phase must be JOINED (1) or ALL_JOINED (2), got 0");
    expect_report_error(st, a.member_id, 0, 3, 1, 0, PSHARD_ERR_INVALID_ARGUMENT, "got 3");
    expect_report_error(st, a.member_id, 0, -1, 1, 0, PSHARD_ERR_INVALID_ARGUMENT, "got -1");
    expect_report_error(st, a.member_id, 0, JOINED, -5, 0, PSHARD_ERR_INVALID_ARGUMENT,
                        "join step is -5");
    expect_report_error(st, "", 0, JOINED, 1, 0, PSHARD_ERR_INVALID_ARGUMENT, "member id is empty");
    expect_report_error(st, NULL, 0, JOINED, 1, 0, PSHARD_ERR_INVALID_ARGUMENT,
                        "member id is empty");
    expect_report_error(st, "abc", 0, JOINED, 1, 0, PSHARD_ERR_INVALID_ARGUMENT,
                        "member id must be 32 lowercase hex characters");
    expect_report_error(st, "0123456789abcdef0123456789abcdef", 0, JOINED, 1, 0,
                        PSHARD_ERR_NOT_FOUND, "unknown member id 0123456789abcdef0123456789abcdef");
    expect_report_error(st, a.member_id, 0, ALL, 1, -1, PSHARD_ERR_INVALID_ARGUMENT,
                        "last_rank -1 of an ALL_JOINED report is outside 0..1");
    expect_report_error(st, a.member_id, 0, ALL, 1, 2, PSHARD_ERR_INVALID_ARGUMENT, "last_rank 2");
    expect_joins(st, NULL, NULL, 0, -1);
    CU_ASSERT_EQUAL(coord_state_generation(st), gen);
    CU_ASSERT_EQUAL(changes.n, nchanges);
    CU_ASSERT_STRING_EQUAL(coord_join_phase_name(COORD_JOIN_PHASE_JOINED), "joined");
    CU_ASSERT_STRING_EQUAL(coord_join_phase_name(COORD_JOIN_PHASE_ALL_JOINED), "all_joined");
    CU_ASSERT_STRING_EQUAL(coord_join_phase_name(9), "unspecified");
    coord_state_destroy(st);
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"create rejects a bad config", test_create_rejects_bad_config},
        {"register, heartbeat, lease expiry", test_register_heartbeat_lease_expiry},
        {"member ids unique and never reused", test_ids_unique_and_never_reused},
        {"fixed size forms at N in natural order", test_fixed_size_natural_order},
        {"last call forms at expiry", test_last_call_forms_at_expiry},
        {"last call: reaching max forms at once", test_last_call_reaching_max_forms_at_once},
        {"last_call_ms 0 forms at min", test_last_call_zero_forms_at_min},
        {"last call cancelled below min (leave)", test_last_call_cancelled_below_min},
        {"last call cancelled below min (eviction)", test_last_call_eviction_below_min_cancels},
        {"standby beyond max", test_standby_beyond_max},
        {"re-register live member keeps rank", test_reregister_live_keeps_rank},
        {"lease key is the credential, not the member id", test_lease_key_is_the_credential},
        {"evicted rank returns and cluster re-forms", test_evicted_rank_returns_and_reforms},
        {"degraded: new name takes lowest vacant rank", test_degraded_new_name_takes_lowest_vacant},
        {"degraded: returning names get their own ranks",
         test_degraded_returning_names_get_their_own_ranks},
        {"leave", test_leave},
        {"health reports: not serving is degraded", test_health_reports},
        {"trainers; names unique per role", test_trainers_and_names_per_role},
        {"validation errors", test_validation},
        {"next deadline", test_next_deadline},
        {"snapshot content and order", test_snapshot_content},
        {"role and state names", test_names},
        {"id index with many members", test_many_members_index},
        {"a launcher declares a trainer lost", test_declare_trainer_lost},
        {"a launcher declares a shard server lost", test_declare_server_lost},
        {"join: add and update entries", test_join_add_update},
        {"join: all joined clears, records the last joiner", test_join_all_joined},
        {"join: table reset when the cluster re-forms", test_join_cleared_on_reform},
        {"join: bad reports refused", test_join_refused},
        {NULL, NULL},
    };
    return ps_test_main("coord_state", cases);
}
