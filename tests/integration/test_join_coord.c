/* Integration tests of Join reporting against the real pshard-coordinator binary on an
 * ephemeral loopback port, with a cluster token: fake shard servers registered over gRPC send
 * ReportJoin, and Status, Watch, the generation and the per-method counters are checked, as
 * are bad reports (clear gRPC errors, nothing changes) and the reset when the cluster re-forms.
 * argv[1] is the coordinator binary. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_coord_client.h"
#include "ps_proc.h"
#include "ps_test.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

#define TOKEN "join-test-token-0123"
/* gRPC status codes the tests expect (grpc_status_code values). */
#define GRPC_INVALID_ARGUMENT 3
#define GRPC_NOT_FOUND 5
#define GRPC_FAILED_PRECONDITION 9
#define GRPC_UNAUTHENTICATED 16

static const char *coordinator_bin;
static char token_path[64];

typedef struct {
    pid_t pid;
    char target[64];
    ps_rpc_channel_t *ch; /* with the cluster token */
    ps_rpc_stream_t *watch;
    char id[3][64]; /* shard servers srv-0 (rank 0), srv-1 (rank 1); [2] the trainer */
} fixture_t;

static ps_rpc_channel_t *channel(const char *target, const char *token)
{
    char err[256] = "";
    ps_rpc_channel_config_t cfg = {.target = target, .token = token, .own_connection = true};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&cfg, err, sizeof(err));
    if (!ch)
        fprintf(stderr, "channel to %s: %s\n", target, err);
    return ch;
}

/* Sends one ReportJoin; returns its status, with the gRPC code and the message. */
static pshard_status_t report_join(ps_rpc_channel_t *ch, const char *member_id, int rank, int phase,
                                   int64_t step, bool throw_flag, int last_rank, int *grpc_code,
                                   char *err, size_t errlen)
{
    Pshard__JoinReport req = PSHARD__JOIN_REPORT__INIT;
    req.member_id = (char *)member_id;
    req.lease_key = (char *)ps_coord_lease_key(member_id);
    req.rank = rank;
    req.phase = (Pshard__JoinPhase)phase;
    req.step = step;
    req.throw_on_early_termination = throw_flag;
    req.last_rank = last_rank;
    ProtobufCMessage *resp = NULL;
    int code = -1;
    pshard_status_t rc =
        ps_rpc_unary(ch, "/pshard.Coordinator/ReportJoin", &req.base,
                     &pshard__join_report_response__descriptor, &resp, 5000, 0, &code, err, errlen);
    if (resp)
        protobuf_c_message_free_unpacked(resp, NULL);
    if (grpc_code)
        *grpc_code = code;
    return rc;
}

static bool report_ok(fixture_t *f, int who, int rank, int phase, int64_t step, bool throw_flag,
                      int last_rank)
{
    char err[512] = "";
    pshard_status_t rc = report_join(f->ch, f->id[who], rank, phase, step, throw_flag, last_rank,
                                     NULL, err, sizeof(err));
    if (rc != PSHARD_OK)
        fprintf(stderr, "ReportJoin rank %d phase %d: %s\n", rank, phase, err);
    return rc == PSHARD_OK;
}

/* A report that must fail with gRPC code want_code and a message containing needle. */
static void expect_refused(ps_rpc_channel_t *ch, const char *member_id, int rank, int phase,
                           int last_rank, int want_code, const char *needle)
{
    char err[512] = "";
    int code = -1;
    pshard_status_t rc =
        report_join(ch, member_id, rank, phase, 7, false, last_rank, &code, err, sizeof(err));
    CU_ASSERT(rc != PSHARD_OK);
    CU_ASSERT_EQUAL(code, want_code);
    if (code != want_code || !strstr(err, needle)) {
        fprintf(stderr, "ReportJoin(rank %d, phase %d): code %d '%s'; want code %d with '%s'\n",
                rank, phase, code, err, want_code, needle);
        CU_FAIL("refusal message");
    }
}

/* The next Watch event (within 5 s), or NULL. Free with protobuf_c_message_free_unpacked. */
static Pshard__ClusterEvent *next_event(fixture_t *f)
{
    ProtobufCMessage *msg = NULL;
    char err[256] = "";
    if (ps_rpc_stream_next(f->watch, &pshard__cluster_event__descriptor, &msg, 5000, NULL, err,
                           sizeof(err)) != PSHARD_OK ||
        !msg) {
        fprintf(stderr, "watch: %s\n", err[0] ? err : "no event");
        return NULL;
    }
    return (Pshard__ClusterEvent *)msg;
}

/* Starts a coordinator for a world of 2 with the token, registers srv-1, srv-0 and a trainer,
 * and opens a Watch stream past its "current state" event. */
static int start(fixture_t *f)
{
    memset(f, 0, sizeof(*f));
    const char *args[] = {"--world-size", "2",        "--lease-ms", "60000",
                          "--token-file", token_path, NULL};
    f->pid = ps_proc_start_coordinator(coordinator_bin, args, f->target, sizeof(f->target));
    if (f->pid < 0)
        return -1;
    f->ch = channel(f->target, TOKEN);
    if (!f->ch)
        return -1;
    /* Ranks follow the names' natural order, not the order of registration. */
    if (!ps_coord_register(f->ch, PSHARD__ROLE__SHARD_SERVER, "srv-1", "127.0.0.1:1", f->id[1],
                           sizeof(f->id[1])) ||
        !ps_coord_register(f->ch, PSHARD__ROLE__SHARD_SERVER, "srv-0", "127.0.0.1:1", f->id[0],
                           sizeof(f->id[0])) ||
        !ps_coord_register(f->ch, PSHARD__ROLE__TRAINER, "trn-0", "127.0.0.1:1", f->id[2],
                           sizeof(f->id[2])))
        return -1;
    Pshard__WatchRequest req = PSHARD__WATCH_REQUEST__INIT;
    char err[256] = "";
    f->watch =
        ps_rpc_stream_open(f->ch, "/pshard.Coordinator/Watch", &req.base, 60000, err, sizeof(err));
    if (!f->watch)
        return -1;
    Pshard__ClusterEvent *ev = next_event(f);
    if (!ev)
        return -1;
    bool ok = strcmp(ev->reason, "current state") == 0 &&
              ev->state == PSHARD__CLUSTER_STATE__FORMED && ev->n_joins == 0 &&
              ev->last_joiner == -1;
    protobuf_c_message_free_unpacked(&ev->base, NULL);
    return ok ? 0 : -1;
}

static int stop(fixture_t *f)
{
    ps_rpc_stream_close(f->watch);
    ps_rpc_channel_destroy(f->ch);
    return ps_proc_stop(f->pid, 10000);
}

/* Checks an event: reason, generation, the ranks and steps of its joins, and last_joiner. */
static void expect_event(Pshard__ClusterEvent *ev, const char *reason, uint64_t generation,
                         const int *ranks, const int64_t *steps, size_t n, int last_joiner)
{
    CU_ASSERT_PTR_NOT_NULL_FATAL(ev);
    CU_ASSERT_STRING_EQUAL(ev->reason, reason);
    CU_ASSERT_EQUAL(ev->generation, generation);
    CU_ASSERT_EQUAL(ev->state, PSHARD__CLUSTER_STATE__FORMED);
    CU_ASSERT_EQUAL(ev->n_members, 3);
    CU_ASSERT_EQUAL_FATAL(ev->n_joins, n);
    for (size_t i = 0; i < n; i++) {
        CU_ASSERT_EQUAL(ev->joins[i]->rank, ranks[i]);
        CU_ASSERT_EQUAL(ev->joins[i]->step, steps[i]);
    }
    CU_ASSERT_EQUAL(ev->last_joiner, last_joiner);
    protobuf_c_message_free_unpacked(&ev->base, NULL);
}

/* JOINED reports fill the table that Status shows (sorted by rank) and each pushes a "join"
 * event; ALL_JOINED clears it, records the last joiner and pushes "all joined"; the same
 * completion reported again pushes nothing; the generation never moves. */
static void test_join_status_and_watch(void)
{
    fixture_t f;
    CU_ASSERT_FATAL(start(&f) == 0);
    Pshard__StatusResponse *st = ps_coord_status(f.ch);
    CU_ASSERT_PTR_NOT_NULL_FATAL(st);
    uint64_t gen = st->generation;
    uint64_t formed_gen = st->formed_generation;
    CU_ASSERT_EQUAL(st->n_joins, 0);
    CU_ASSERT_EQUAL(st->last_joiner, -1);
    protobuf_c_message_free_unpacked(&st->base, NULL);

    CU_ASSERT_FATAL(report_ok(&f, 1, 1, PSHARD__JOIN_PHASE__JOINED, 40, false, 0));
    static const int r1[] = {1};
    static const int64_t s40[] = {40};
    expect_event(next_event(&f), "join", gen, r1, s40, 1, -1);
    st = ps_coord_status(f.ch);
    CU_ASSERT_PTR_NOT_NULL_FATAL(st);
    CU_ASSERT_EQUAL(st->generation, gen);
    CU_ASSERT_EQUAL_FATAL(st->n_joins, 1);
    CU_ASSERT_EQUAL(st->joins[0]->rank, 1);
    CU_ASSERT_STRING_EQUAL(st->joins[0]->member_id, f.id[1]);
    CU_ASSERT_EQUAL(st->joins[0]->step, 40);
    CU_ASSERT(st->joins[0]->joined_ms_ago >= 0 && st->joins[0]->joined_ms_ago < 60000);
    CU_ASSERT_FALSE(st->joins[0]->throw_on_early_termination);
    CU_ASSERT_EQUAL(st->last_joiner, -1);
    protobuf_c_message_free_unpacked(&st->base, NULL);

    CU_ASSERT_FATAL(report_ok(&f, 0, 0, PSHARD__JOIN_PHASE__JOINED, 41, true, 0));
    static const int r01[] = {0, 1};
    static const int64_t s41_40[] = {41, 40};
    expect_event(next_event(&f), "join", gen, r01, s41_40, 2, -1);
    st = ps_coord_status(f.ch);
    CU_ASSERT_PTR_NOT_NULL_FATAL(st);
    CU_ASSERT_EQUAL_FATAL(st->n_joins, 2);
    CU_ASSERT_EQUAL(st->joins[0]->rank, 0);
    CU_ASSERT_TRUE(st->joins[0]->throw_on_early_termination);
    CU_ASSERT_EQUAL(st->joins[1]->rank, 1);
    protobuf_c_message_free_unpacked(&st->base, NULL);

    /* A retried JOINED is not a change: no event (the next event seen is the next change). */
    CU_ASSERT_FATAL(report_ok(&f, 0, 0, PSHARD__JOIN_PHASE__JOINED, 41, true, 0));
    CU_ASSERT_FATAL(report_ok(&f, 0, 0, PSHARD__JOIN_PHASE__ALL_JOINED, 41, true, 1));
    expect_event(next_event(&f), "all joined", gen, NULL, NULL, 0, 1);
    st = ps_coord_status(f.ch);
    CU_ASSERT_PTR_NOT_NULL_FATAL(st);
    CU_ASSERT_EQUAL(st->n_joins, 0);
    CU_ASSERT_EQUAL(st->last_joiner, 1);
    CU_ASSERT_EQUAL(st->generation, gen);
    CU_ASSERT_EQUAL(st->formed_generation, formed_gen);
    protobuf_c_message_free_unpacked(&st->base, NULL);

    /* Rank 1 reports the same completion: nothing changes, nothing is pushed. */
    CU_ASSERT_FATAL(report_ok(&f, 1, 1, PSHARD__JOIN_PHASE__ALL_JOINED, 41, false, 1));
    CU_ASSERT_FATAL(report_ok(&f, 1, 1, PSHARD__JOIN_PHASE__JOINED, 90, false, 0));
    static const int64_t s90[] = {90};
    expect_event(next_event(&f), "join", gen, r1, s90, 1, -1);
    st = ps_coord_status(f.ch);
    CU_ASSERT_PTR_NOT_NULL_FATAL(st);
    CU_ASSERT_EQUAL(st->last_joiner, 1); /* until the next completion */
    CU_ASSERT_EQUAL(st->generation, gen);
    bool counted = false;
    for (size_t i = 0; i < st->n_counters; i++) {
        if (strcmp(st->counters[i]->method, "/pshard.Coordinator/ReportJoin") == 0) {
            counted = true;
            CU_ASSERT_EQUAL(st->counters[i]->calls, 6);
            CU_ASSERT_EQUAL(st->counters[i]->errors, 0);
        }
    }
    CU_ASSERT(counted);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    CU_ASSERT(stop(&f) == 0);
}

/* Bad reports get a clear gRPC error and change nothing: no event, same generation, empty
 * table. Without the cluster token the call is refused before it reaches the coordinator. */
static void test_join_bad_reports(void)
{
    fixture_t f;
    CU_ASSERT_FATAL(start(&f) == 0);
    Pshard__StatusResponse *st = ps_coord_status(f.ch);
    CU_ASSERT_PTR_NOT_NULL_FATAL(st);
    uint64_t gen = st->generation;
    protobuf_c_message_free_unpacked(&st->base, NULL);
    const int joined = PSHARD__JOIN_PHASE__JOINED, all = PSHARD__JOIN_PHASE__ALL_JOINED;

    expect_refused(f.ch, "0123456789abcdef0123456789abcdef", 0, joined, 0, GRPC_NOT_FOUND,
                   "unknown member id 0123456789abcdef0123456789abcdef");
    expect_refused(f.ch, "not-an-id", 0, joined, 0, GRPC_INVALID_ARGUMENT,
                   "member id must be 32 lowercase hex characters");
    expect_refused(f.ch, "", 0, joined, 0, GRPC_INVALID_ARGUMENT, "member id is empty");
    expect_refused(f.ch, f.id[2], 0, joined, 0, GRPC_INVALID_ARGUMENT, "is a trainer");
    expect_refused(f.ch, f.id[0], 1, joined, 0, GRPC_INVALID_ARGUMENT,
                   "holds rank 0, but reported a join for rank 1");
    expect_refused(f.ch, f.id[0], 0, 0, 0, GRPC_INVALID_ARGUMENT,
                   "join phase must be JOINED (1) or ALL_JOINED (2), got 0");
    expect_refused(f.ch, f.id[0], 0, 5, 0, GRPC_INVALID_ARGUMENT, "got 5");
    expect_refused(f.ch, f.id[0], 0, all, 2, GRPC_INVALID_ARGUMENT,
                   "last_rank 2 of an ALL_JOINED report is outside 0..1");
    expect_refused(f.ch, f.id[0], 0, all, -1, GRPC_INVALID_ARGUMENT, "last_rank -1");

    ps_rpc_channel_t *anon = channel(f.target, NULL);
    ps_rpc_channel_t *wrong = channel(f.target, "not-the-token");
    CU_ASSERT_PTR_NOT_NULL_FATAL(anon);
    CU_ASSERT_PTR_NOT_NULL_FATAL(wrong);
    expect_refused(anon, f.id[0], 0, joined, 0, GRPC_UNAUTHENTICATED, "cluster token");
    expect_refused(wrong, f.id[0], 0, joined, 0, GRPC_UNAUTHENTICATED, "cluster token");
    ps_rpc_channel_destroy(anon);
    ps_rpc_channel_destroy(wrong);

    /* A shard server that joins after the cluster formed is a standby with no rank. */
    char standby[64];
    CU_ASSERT_FATAL(ps_coord_register(f.ch, PSHARD__ROLE__SHARD_SERVER, "srv-2", "127.0.0.1:1",
                                      standby, sizeof(standby)));
    Pshard__ClusterEvent *ev = next_event(&f); /* its registration bumps the generation */
    CU_ASSERT_PTR_NOT_NULL_FATAL(ev);
    CU_ASSERT(strstr(ev->reason, "srv-2") != NULL);
    gen = ev->generation;
    protobuf_c_message_free_unpacked(&ev->base, NULL);
    expect_refused(f.ch, standby, -1, joined, 0, GRPC_FAILED_PRECONDITION, "standby");

    /* Nothing was pushed for the refusals: the next event is this valid report. */
    CU_ASSERT_FATAL(report_ok(&f, 0, 0, joined, 3, false, 0));
    ev = next_event(&f);
    CU_ASSERT_PTR_NOT_NULL_FATAL(ev);
    CU_ASSERT_STRING_EQUAL(ev->reason, "join");
    CU_ASSERT_EQUAL(ev->generation, gen);
    CU_ASSERT_EQUAL(ev->n_joins, 1);
    protobuf_c_message_free_unpacked(&ev->base, NULL);

    st = ps_coord_status(f.ch);
    CU_ASSERT_PTR_NOT_NULL_FATAL(st);
    CU_ASSERT_EQUAL(st->generation, gen);
    CU_ASSERT_EQUAL(st->n_joins, 1);
    CU_ASSERT_EQUAL(st->last_joiner, -1);
    for (size_t i = 0; i < st->n_counters; i++) {
        if (strcmp(st->counters[i]->method, "/pshard.Coordinator/ReportJoin") == 0) {
            /* The 10 refused by the coordinator and the valid one; calls refused for the
             * token may or may not be counted by the runtime. */
            CU_ASSERT(st->counters[i]->calls >= 11);
            CU_ASSERT(st->counters[i]->errors >= 10);
        }
    }
    protobuf_c_message_free_unpacked(&st->base, NULL);
    CU_ASSERT(stop(&f) == 0);
}

/* The table and the last joiner are reset when the cluster re-forms (its ranks restart); a
 * rank leaving (degraded) keeps them until then. */
static void test_join_reset_on_reform(void)
{
    fixture_t f;
    CU_ASSERT_FATAL(start(&f) == 0);
    CU_ASSERT_FATAL(report_ok(&f, 0, 0, PSHARD__JOIN_PHASE__JOINED, 5, false, 0));
    CU_ASSERT_FATAL(report_ok(&f, 0, 0, PSHARD__JOIN_PHASE__ALL_JOINED, 5, false, 0));
    CU_ASSERT_FATAL(report_ok(&f, 1, 1, PSHARD__JOIN_PHASE__JOINED, 8, false, 0));
    Pshard__StatusResponse *st = ps_coord_status(f.ch);
    CU_ASSERT_PTR_NOT_NULL_FATAL(st);
    uint64_t formed_gen = st->formed_generation;
    CU_ASSERT_EQUAL(st->n_joins, 1);
    CU_ASSERT_EQUAL(st->last_joiner, 0);
    protobuf_c_message_free_unpacked(&st->base, NULL);

    Pshard__LeaveRequest lv = PSHARD__LEAVE_REQUEST__INIT;
    lv.member_id = f.id[0];
    lv.lease_key = (char *)ps_coord_lease_key(f.id[0]);
    ProtobufCMessage *resp = NULL;
    char err[256] = "";
    CU_ASSERT_FATAL(ps_rpc_unary(f.ch, "/pshard.Coordinator/Leave", &lv.base,
                                 &pshard__leave_response__descriptor, &resp, 5000, 0, NULL, err,
                                 sizeof(err)) == PSHARD_OK);
    protobuf_c_message_free_unpacked(resp, NULL);
    st = ps_coord_status(f.ch);
    CU_ASSERT_PTR_NOT_NULL_FATAL(st);
    CU_ASSERT_EQUAL(st->state, PSHARD__CLUSTER_STATE__DEGRADED);
    CU_ASSERT_EQUAL(st->n_joins, 1);
    CU_ASSERT_EQUAL(st->last_joiner, 0);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    expect_refused(f.ch, f.id[0], 0, PSHARD__JOIN_PHASE__JOINED, 0, GRPC_NOT_FOUND,
                   "unknown member id");

    /* srv-0 comes back: rank 0 again, the cluster re-forms, the join state starts afresh. */
    CU_ASSERT_FATAL(ps_coord_register(f.ch, PSHARD__ROLE__SHARD_SERVER, "srv-0", "127.0.0.1:1",
                                      f.id[0], sizeof(f.id[0])));
    st = ps_coord_status(f.ch);
    CU_ASSERT_PTR_NOT_NULL_FATAL(st);
    CU_ASSERT_EQUAL(st->state, PSHARD__CLUSTER_STATE__FORMED);
    CU_ASSERT(st->formed_generation > formed_gen);
    CU_ASSERT_EQUAL(st->n_joins, 0);
    CU_ASSERT_EQUAL(st->last_joiner, -1);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    /* The Watch stream saw the re-forming with the empty table. */
    bool reformed = false;
    for (int i = 0; i < 10 && !reformed; i++) {
        Pshard__ClusterEvent *ev = next_event(&f);
        CU_ASSERT_PTR_NOT_NULL_FATAL(ev);
        if (strstr(ev->reason, "formed again")) {
            reformed = true;
            CU_ASSERT_EQUAL(ev->n_joins, 0);
            CU_ASSERT_EQUAL(ev->last_joiner, -1);
        }
        protobuf_c_message_free_unpacked(&ev->base, NULL);
    }
    CU_ASSERT(reformed);
    CU_ASSERT(report_ok(&f, 0, 0, PSHARD__JOIN_PHASE__JOINED, 1, false, 0));
    CU_ASSERT(stop(&f) == 0);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH-TO-pshard-coordinator\n", argv[0]);
        return 2;
    }
    coordinator_bin = argv[1];
    signal(SIGPIPE, SIG_IGN);
    ps_strlcpy(token_path, "/tmp/pshard-join-token-XXXXXX", sizeof(token_path));
    int fd = mkstemp(token_path);
    if (fd < 0 || write(fd, TOKEN "\n", sizeof(TOKEN)) != (ssize_t)sizeof(TOKEN)) {
        perror("token file");
        return 2;
    }
    close(fd);
    static const ps_test_case_t cases[] = {
        {"join reports in Status and Watch, generation unchanged", test_join_status_and_watch},
        {"bad join reports refused with clear errors", test_join_bad_reports},
        {"join table reset when the cluster re-forms", test_join_reset_on_reform},
        {NULL, NULL},
    };
    int rc = ps_test_main("join_coordinator", cases);
    unlink(token_path);
    return rc;
}
