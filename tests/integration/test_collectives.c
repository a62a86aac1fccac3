/* Integration tests of the collectives: each case starts a real coordinator (whose store
 * bootstraps the rings) and N coll_worker processes, one per rank, and checks how each exits.
 * argv[1] is pshard-coordinator, argv[2] is coll_worker. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ps_proc.h"
#include "ps_test.h"
#include "pshard/coord_client.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

static const char *coordinator_bin, *worker_bin;
static pid_t coord_pid = -1;
static char coord_target[64];
static int last_run; /* PSHARD_TEST_RUN of the latest run_workers: part of the comm names */

/* Runs `world` workers of a scenario; fills status[] with each one's wait status. Returns -1
 * if they did not all finish within timeout_ms (then they are killed). */
static int run_workers(int world, const char *scenario, const char *arg, int *status,
                       int64_t timeout_ms)
{
    char run_s[16];
    snprintf(run_s, sizeof(run_s), "%d", ++last_run);
    setenv("PSHARD_TEST_RUN", run_s, 1);
    pid_t pids[8];
    char rank_s[8][16], world_s[16];
    snprintf(world_s, sizeof(world_s), "%d", world);
    for (int r = 0; r < world; r++) {
        snprintf(rank_s[r], sizeof(rank_s[r]), "%d", r);
        char *argv[] = {
            (char *)worker_bin,       coord_target, rank_s[r], world_s, (char *)scenario,
            (char *)(arg ? arg : ""), NULL};
        pids[r] = ps_proc_spawn(argv, NULL);
    }
    int64_t end = ps_now_ns() + timeout_ms * 1000000;
    int left = world, rc = 0;
    bool done[8] = {false};
    while (left > 0) {
        for (int r = 0; r < world; r++) {
            if (!done[r] && waitpid(pids[r], &status[r], WNOHANG) == pids[r]) {
                done[r] = true;
                left--;
            }
        }
        if (left > 0 && ps_now_ns() > end) {
            fprintf(stderr, "%s: workers did not finish in %lld ms; killing them\n", scenario,
                    (long long)timeout_ms);
            for (int r = 0; r < world; r++) {
                if (!done[r]) {
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], &status[r], 0);
                }
            }
            rc = -1;
            break;
        }
        struct timespec ts = {0, 5 * 1000000};
        nanosleep(&ts, NULL);
    }
    return rc;
}

static bool exited_ok(int st)
{
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

/* 1 if the coordinator's store holds key, 0 if it does not, -1 if it cannot say. */
static int store_holds(const char *key)
{
    char err[512] = "";
    ps_rpc_channel_config_t cfg = {.target = coord_target};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&cfg, err, sizeof(err));
    if (!ch)
        return -1;
    char *value = NULL;
    size_t len = 0;
    pshard_status_t rc = ps_coord_store_fetch(ch, key, &value, &len, 5000, err, sizeof(err));
    free(value);
    ps_rpc_channel_destroy(ch);
    return rc == PSHARD_OK ? 1 : rc == PSHARD_ERR_NOT_FOUND ? 0 : -1;
}

static void correctness(int world)
{
    int st[8];
    CU_ASSERT_FATAL(run_workers(world, "correctness", NULL, st, 120000) == 0);
    for (int r = 0; r < world; r++)
        CU_ASSERT(exited_ok(st[r]));
    /* Each rank's ring address left the store once its ring linked. */
    for (int r = 0; r < world; r++) {
        char key[128];
        snprintf(key, sizeof(key), "pshard/coll/correct-%d/g5/addr/%d", last_run, r);
        int held = store_holds(key);
        if (held != 0)
            fprintf(stderr, "store key %s: %s\n", key, held > 0 ? "still there" : "unknown");
        CU_ASSERT(held == 0);
    }
}

static void test_correct_1(void)
{
    correctness(1);
}
static void test_correct_2(void)
{
    correctness(2);
}
static void test_correct_3(void)
{
    correctness(3);
}
static void test_correct_4(void)
{
    correctness(4);
}
static void test_correct_5(void)
{
    correctness(5);
}

static void test_big(void)
{
    int st[8];
    CU_ASSERT_FATAL(run_workers(3, "big", NULL, st, 240000) == 0);
    for (int r = 0; r < 3; r++)
        CU_ASSERT(exited_ok(st[r]));
}

static void desync(const char *what)
{
    int st[8];
    CU_ASSERT_FATAL(run_workers(3, "desync", what, st, 60000) == 0);
    for (int r = 0; r < 3; r++)
        CU_ASSERT(exited_ok(st[r]));
}

static void test_divert(void)
{
    int st[8];
    CU_ASSERT_FATAL(run_workers(3, "divert", NULL, st, 60000) == 0);
    for (int r = 0; r < 3; r++)
        CU_ASSERT(exited_ok(st[r]));
}

static void test_desync_dtype(void)
{
    desync("dtype");
}
static void test_desync_count(void)
{
    desync("count");
}
static void test_desync_op(void)
{
    desync("op");
}
static void test_desync_size(void)
{
    desync("size");
}
static void test_desync_tag(void)
{
    desync("tag");
}
static void test_desync_root(void)
{
    desync("root");
}

/* PSHARD_LOG=info PSHARD_LOG_SUBSYS=coll: one line per operation on every rank (checked by the
 * workers on their own stderr). */
static void test_log_lines(void)
{
    int st[8];
    CU_ASSERT_FATAL(run_workers(3, "logline", NULL, st, 60000) == 0);
    for (int r = 0; r < 3; r++)
        CU_ASSERT(exited_ok(st[r]));
}

static void kill_case(const char *how)
{
    int st[8];
    CU_ASSERT_FATAL(run_workers(3, "kill", how, st, 60000) == 0);
    CU_ASSERT(exited_ok(st[0]));
    bool closed = strcmp(how, "closed") == 0;
    CU_ASSERT(closed ? exited_ok(st[1]) : WIFSIGNALED(st[1]) && WTERMSIG(st[1]) == SIGKILL);
    CU_ASSERT(exited_ok(st[2]));
}

static void test_kill(void)
{
    kill_case("big");
}

static void test_kill_small(void)
{
    kill_case("small");
}

static void test_closed(void)
{
    kill_case("closed");
}

static void test_abort(void)
{
    int st[8];
    CU_ASSERT_FATAL(run_workers(3, "abort", NULL, st, 60000) == 0);
    for (int r = 0; r < 3; r++)
        CU_ASSERT(exited_ok(st[r]));
}

static void test_abort_mid_frame(void)
{
    int st[8];
    CU_ASSERT_FATAL(run_workers(3, "abort", "big", st, 60000) == 0);
    for (int r = 0; r < 3; r++)
        CU_ASSERT(exited_ok(st[r]));
}

static void test_timeout(void)
{
    int st[8];
    CU_ASSERT_FATAL(run_workers(3, "timeout", NULL, st, 60000) == 0);
    for (int r = 0; r < 3; r++)
        CU_ASSERT(exited_ok(st[r]));
}

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

static void impostor(const char *what)
{
    char peers[128];
    snprintf(peers, sizeof(peers), "127.0.0.1:%d,127.0.0.1:%d", free_port(), free_port());
    setenv("PSHARD_TEST_PEERS", peers, 1);
    int st[8];
    CU_ASSERT_FATAL(run_workers(2, "impostor", what, st, 60000) == 0);
    unsetenv("PSHARD_TEST_PEERS");
    for (int r = 0; r < 2; r++)
        CU_ASSERT(exited_ok(st[r]));
}

static void test_impostor_token(void)
{
    impostor("token");
}
static void test_impostor_generation(void)
{
    impostor("generation");
}

/* Strangers that connect to rank 0's ring port and say nothing, or half a frame header,
 * before rank 1 even starts: more of them than the acceptor has handshake slots. The real
 * rank 1 must still link at once (it took 5 s per stranger when handshakes ran one at a
 * time, and 25 strangers failed the ring). */
static void test_stalled_strangers(void)
{
    int p0 = free_port(), p1 = free_port();
    char peers[128];
    snprintf(peers, sizeof(peers), "127.0.0.1:%d,127.0.0.1:%d", p0, p1);
    setenv("PSHARD_TEST_PEERS", peers, 1);
    setenv("PSHARD_TEST_RUN", "besieged", 1);
    enum { STRANGERS = 40 };
    int fds[STRANGERS];
    int nfd = 0;
    char *argv0[] = {(char *)worker_bin, coord_target, "0", "2", "besieged", "15000", NULL};
    pid_t w0 = ps_proc_spawn(argv0, NULL);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)p0),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int64_t end = ps_now_ns() + 10 * 1000000000LL;
    while (nfd < STRANGERS && ps_now_ns() < end) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0) {
            if (nfd % 4 == 3) /* half a frame header, then silence */
                (void)!write(fd, "\x01\x00\x00\x00\x00\x00\x00\x00", 8);
            fds[nfd++] = fd;
            continue;
        }
        if (fd >= 0)
            close(fd);
        struct timespec ts = {0, 10 * 1000000}; /* rank 0 is not listening yet */
        nanosleep(&ts, NULL);
    }
    CU_ASSERT(nfd == STRANGERS);
    char *argv1[] = {(char *)worker_bin, coord_target, "1", "2", "besieged", "15000", NULL};
    pid_t w1 = ps_proc_spawn(argv1, NULL);
    int st[2] = {-1, -1};
    pid_t pids[2] = {w0, w1};
    end = ps_now_ns() + 30 * 1000000000LL;
    for (int r = 0; r < 2; r++) {
        while (waitpid(pids[r], &st[r], WNOHANG) == 0 && ps_now_ns() < end) {
            struct timespec ts = {0, 5 * 1000000};
            nanosleep(&ts, NULL);
        }
        if (ps_now_ns() >= end && kill(pids[r], SIGKILL) == 0)
            waitpid(pids[r], &st[r], 0);
        CU_ASSERT(exited_ok(st[r]));
    }
    for (int i = 0; i < nfd; i++)
        close(fds[i]);
    unsetenv("PSHARD_TEST_PEERS");
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s PSHARD-COORDINATOR COLL-WORKER\n", argv[0]);
        return 2;
    }
    coordinator_bin = argv[1];
    worker_bin = argv[2];
    signal(SIGPIPE, SIG_IGN);
    const char *args[] = {"--store-wait-ms", "60000", NULL};
    coord_pid =
        ps_proc_start_coordinator(coordinator_bin, args, coord_target, sizeof(coord_target));
    if (coord_pid < 0)
        return 1;
    static const ps_test_case_t cases[] = {
        {"correctness, 1 rank", test_correct_1},
        {"correctness, 2 ranks", test_correct_2},
        {"correctness, 3 ranks", test_correct_3},
        {"correctness, 4 ranks", test_correct_4},
        {"correctness, 5 ranks", test_correct_5},
        {"64 MiB operations, 3 ranks", test_big},
        {"desync: dtype", test_desync_dtype},
        {"desync: count", test_desync_count},
        {"desync: op", test_desync_op},
        {"desync: tag", test_desync_tag},
        {"desync: one rank's operation too big for the slots", test_desync_size},
        {"desync: reduce roots differ", test_desync_root},
        {"divertible operations (pshard_comm_divert_next)", test_divert},
        {"PSHARD_LOG_SUBSYS=coll: a line per operation", test_log_lines},
        {"kill -9 a rank mid-operation", test_kill},
        {"kill -9 a rank before a small operation", test_kill_small},
        {"a rank closes the communicator before a small operation", test_closed},
        {"abort from another thread", test_abort},
        {"abort in the middle of a DATA frame", test_abort_mid_frame},
        {"timeout names the silent rank", test_timeout},
        {"wrong token refused", test_impostor_token},
        {"stale generation refused", test_impostor_generation},
        {"stalled strangers do not keep the real peer out", test_stalled_strangers},
        {NULL, NULL},
    };
    int rc = ps_test_main("collectives_integration", cases);
    ps_proc_stop(coord_pid, 10000);
    return rc;
}
