/* Integration test of `pshardctl status` against the real pshard-coordinator with a cluster
 * token: the Join table and last joiner, and hang attribution, where pshardctl asks every
 * shard server for its own status. The shard servers are stand-ins: an in-process gRPC server
 * answering pshard.ShardServer/Status with canned flight records (and requiring the token), a
 * socket that accepts connections but never answers (a hung server), and a closed port (a dead
 * one). argv[1] is the coordinator binary, argv[2] pshardctl. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ps_coord_client.h"
#include "ps_proc.h"
#include "ps_test.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/rpc.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"

#define TOKEN "ctl-test-token-0123"

static const char *coordinator_bin;
static const char *ctl_bin;
static char workdir[64];
static char token_path[128];

/* The flight records the fake rank 0 server returns, oldest first, as the real one does: the
 * stuck line is the newest, and pshardctl must print it first. */
static char *const fake_records[] = {
    "rank 0 finished all_gather seq 411 (step 11 fc1.weight) in 0.210 ms",
    "rank 0 finished reduce_scatter seq 412 (step 11 fc1.weight) in 0.300 ms",
    "rank 0 finished all_gather seq 413 (step 12 fc1.weight) in 0.220 ms",
    "rank 0 finished all_gather seq 414 (step 12 fc2.weight) in 0.230 ms",
    "rank 0 finished all_gather seq 415 (step 12, fc3.weight) in 0.240 ms",
    "rank 0 is stuck in all_gather seq 418 (step 12, fc3.weight), waiting on rank 1 for 5.2 s",
};

static void handle_fake_status(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    (void)request;
    (void)ctx;
    Pshard__ShardStatusResponse out = PSHARD__SHARD_STATUS_RESPONSE__INIT;
    out.name = "srv-0";
    out.rank = 0;
    out.world_size = 2;
    out.generation = 7;
    out.backend = "tcp";
    out.offload = "none";
    out.placement = "cuda:0";
    out.transport = "shm";
    out.attached = true;
    out.step = 12;
    out.n_flight_records = PS_ARRAY_LEN(fake_records);
    out.flight_records = (char **)fake_records;
    /* The same as fields: the finished ones, then the stuck one. */
    Pshard__FlightRecord recs[PS_ARRAY_LEN(fake_records)], *rp[PS_ARRAY_LEN(fake_records)];
    for (size_t i = 0; i < PS_ARRAY_LEN(fake_records); i++) {
        bool stuck = i + 1 == PS_ARRAY_LEN(fake_records);
        pshard__flight_record__init(&recs[i]);
        recs[i].rank = 0;
        recs[i].op = "all_gather";
        recs[i].seq = stuck ? 418 : 411 + i;
        recs[i].state = stuck ? "running" : "done";
        recs[i].stuck = stuck;
        recs[i].waiting_on = stuck ? 1 : -1;
        recs[i].seconds = stuck ? 5.25 : 0.000125;
        recs[i].label = "step 12, fc3.weight";
        recs[i].dtype = "fp32";
        recs[i].count = 4096;
        recs[i].error = "";
        rp[i] = &recs[i];
    }
    out.n_records = PS_ARRAY_LEN(fake_records);
    out.records = rp;
    ps_rpc_call_reply(call, &out.base);
}

/* Runs pshardctl with args (NULL-terminated, after the program name) and waits up to
 * timeout_ms; stdout goes to out_path, stderr to err_path. Returns the exit code, or -1 when
 * it had to be killed; *elapsed_ms says how long it ran. */
static int run_ctl(const char *const *args, const char *out_path, const char *err_path,
                   int64_t timeout_ms, int64_t *elapsed_ms)
{
    char *argv[32];
    int n = 0;
    argv[n++] = (char *)ctl_bin;
    for (; args[n - 1] && n < 31; n++)
        argv[n] = (char *)args[n - 1];
    argv[n] = NULL;
    int64_t t0 = ps_now_ns();
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        int out = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        int err = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (out < 0 || err < 0)
            _exit(127);
        dup2(out, 1);
        dup2(err, 2);
        unsetenv("PSHARD_COORDINATOR");
        unsetenv("PSHARD_TOKEN_FILE");
        unsetenv("PSHARD_SERVER_TIMEOUT_MS");
        execv(argv[0], argv);
        _exit(127);
    }
    int status = 0;
    for (;;) {
        pid_t got = waitpid(pid, &status, WNOHANG);
        if (got == pid)
            break;
        if ((ps_now_ns() - t0) / 1000000 > timeout_ms) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            *elapsed_ms = (ps_now_ns() - t0) / 1000000;
            return -1;
        }
        struct timespec ts = {0, 10 * 1000000};
        nanosleep(&ts, NULL);
    }
    *elapsed_ms = (ps_now_ns() - t0) / 1000000;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Reads a whole file into a malloc'd string ("" when unreadable). */
static char *slurp(const char *path)
{
    char err[128];
    char *s = ps_read_file(path, false, 1 << 20, NULL, err, sizeof(err));
    return s ? s : strdup("");
}

/* The line that starts with prefix, copied into buf; false when there is none. */
static bool find_line(const char *text, const char *prefix, char *buf, size_t len)
{
    size_t plen = strlen(prefix);
    for (const char *p = text; p && *p;) {
        const char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) : strlen(p);
        if (n >= plen && strncmp(p, prefix, plen) == 0) {
            ps_snprintf(buf, len, "%.*s", (int)n, p);
            return true;
        }
        p = nl ? nl + 1 : NULL;
    }
    return false;
}

/* Checks that text contains needle; prints the text when it does not. */
static void expect_contains(const char *text, const char *needle)
{
    if (!strstr(text, needle)) {
        fprintf(stderr, "missing '%s' in:\n%s\n", needle, text);
        CU_FAIL("output content");
    }
}

static bool report_join(ps_rpc_channel_t *ch, const char *id, int rank, int phase, int64_t step,
                        bool throw_flag, int last_rank)
{
    Pshard__JoinReport req = PSHARD__JOIN_REPORT__INIT;
    req.member_id = (char *)id;
    req.lease_key = (char *)ps_coord_lease_key(id);
    req.rank = rank;
    req.phase = (Pshard__JoinPhase)phase;
    req.step = step;
    req.throw_on_early_termination = throw_flag;
    req.last_rank = last_rank;
    ProtobufCMessage *resp = NULL;
    char err[256] = "";
    pshard_status_t rc = ps_rpc_unary(ch, "/pshard.Coordinator/ReportJoin", &req.base,
                                      &pshard__join_report_response__descriptor, &resp, 5000, 0,
                                      NULL, err, sizeof(err));
    if (resp)
        protobuf_c_message_free_unpacked(resp, NULL);
    if (rc != PSHARD_OK)
        fprintf(stderr, "ReportJoin: %s\n", err);
    return rc == PSHARD_OK;
}

/* A loopback TCP socket bound to a free port: listening (accepts connections into the
 * backlog, never answers) or closed right away (nothing listens). Returns the fd or -1 and
 * the port in *port. */
static int loopback_socket(bool listening, int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0 || (listening && listen(fd, 16) != 0)) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    *port = ntohs(a.sin_port);
    if (!listening) {
        close(fd);
        return 0;
    }
    return fd;
}

/* The whole scenario: see the file comment. */
static void test_status_joins_and_servers(void)
{
    char err[256] = "";
    const char *cargs[] = {"--world-size", "2",        "--lease-ms", "60000",
                           "--token-file", token_path, NULL};
    char target[64];
    pid_t coord = ps_proc_start_coordinator(coordinator_bin, cargs, target, sizeof(target));
    CU_ASSERT_FATAL(coord > 0);
    ps_rpc_channel_config_t ccfg = {.target = target, .token = TOKEN, .own_connection = true};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&ccfg, err, sizeof(err));
    CU_ASSERT_PTR_NOT_NULL_FATAL(ch);

    /* Rank 0: a fake server that answers (only with the token). */
    ps_rpc_server_config_t scfg = {.listen = "127.0.0.1:0", .token = TOKEN};
    ps_rpc_server_t *fake = ps_rpc_server_create(&scfg, err, sizeof(err));
    CU_ASSERT_PTR_NOT_NULL_FATAL(fake);
    static const ps_rpc_method_t methods[] = {
        {"/pshard.ShardServer/Status", &pshard__shard_status_request__descriptor,
         handle_fake_status, PS_RPC_INLINE, NULL},
    };
    CU_ASSERT_FATAL(ps_rpc_server_add_methods(fake, methods, 1) == PSHARD_OK);
    int fake_port = ps_rpc_server_start(fake);
    CU_ASSERT_FATAL(fake_port > 0);
    /* Rank 1: hung. A standby: dead. */
    int hung_port = 0, dead_port = 0;
    int hung_fd = loopback_socket(true, &hung_port);
    CU_ASSERT_FATAL(hung_fd >= 0);
    CU_ASSERT_FATAL(loopback_socket(false, &dead_port) == 0);
    char addr0[64], addr1[64], addr2[64];
    snprintf(addr0, sizeof(addr0), "127.0.0.1:%d", fake_port);
    snprintf(addr1, sizeof(addr1), "127.0.0.1:%d", hung_port);
    snprintf(addr2, sizeof(addr2), "127.0.0.1:%d", dead_port);
    char id0[64], id1[64], id2[64], idt[64];
    CU_ASSERT_FATAL(
        ps_coord_register(ch, PSHARD__ROLE__SHARD_SERVER, "srv-0", addr0, id0, sizeof(id0)));
    CU_ASSERT_FATAL(
        ps_coord_register(ch, PSHARD__ROLE__SHARD_SERVER, "srv-1", addr1, id1, sizeof(id1)));
    CU_ASSERT_FATAL(
        ps_coord_register(ch, PSHARD__ROLE__SHARD_SERVER, "srv-2", addr2, id2, sizeof(id2)));
    CU_ASSERT_FATAL(ps_coord_register(ch, PSHARD__ROLE__TRAINER, "trn-0", "", idt, sizeof(idt)));
    CU_ASSERT_FATAL(report_join(ch, id1, 1, PSHARD__JOIN_PHASE__JOINED, 40, true, 0));

    char out_path[192], err_path[192];
    snprintf(out_path, sizeof(out_path), "%s/out", workdir);
    snprintf(err_path, sizeof(err_path), "%s/err", workdir);
    int64_t elapsed = 0;

    /* Tables: joins, then each server, the hung one within its 2 s deadline. */
    const char *status_args[] = {"--coordinator", target,   "--token-file",
                                 token_path,      "status", NULL};
    int rc = run_ctl(status_args, out_path, err_path, 20000, &elapsed);
    CU_ASSERT_EQUAL(rc, 0);
    CU_ASSERT(elapsed < 10000);
    char *out = slurp(out_path);
    char line[512];
    expect_contains(out, "joins        1 of 2 ranks joined\n");
    CU_ASSERT(find_line(out, "  1 ", line, sizeof(line)) && strstr(line, " 40 ") &&
              strstr(line, " s  yes"));
    expect_contains(out, "last joiner  none\n");
    expect_contains(out, "shard servers (Status of each, 2000 ms deadline)\n");
    char want[512];
    snprintf(want, sizeof(want),
             "rank 0 (%s): step 12, attached, generation 7, tcp, shards in cuda:0, data over shm\n"
             "    rank 0 is stuck in all_gather seq 418 (step 12, fc3.weight), waiting on rank 1 "
             "for 5.2 s\n"
             "    rank 0 finished all_gather seq 413 (step 12 fc1.weight) in 0.220 ms\n"
             "    rank 0 finished all_gather seq 414 (step 12 fc2.weight) in 0.230 ms\n"
             "    rank 0 finished all_gather seq 415 (step 12, fc3.weight) in 0.240 ms\n",
             addr0);
    expect_contains(out, want); /* stuck first, then the newest three; older ones left out */
    CU_ASSERT(strstr(out, "seq 411") == NULL);
    snprintf(want, sizeof(want), "rank 1 (%s): unreachable: ", addr1);
    expect_contains(out, want);
    snprintf(want, sizeof(want), "standby srv-2 (%s): unreachable: ", addr2);
    expect_contains(out, want);
    CU_ASSERT(strstr(out, "trn-0): ") == NULL); /* trainers are not asked */
    free(out);

    /* JSON: the same facts, for scripts. */
    const char *json_args[] = {"--coordinator", target, "--token-file", token_path, "--json",
                               "status",        NULL};
    rc = run_ctl(json_args, out_path, err_path, 20000, &elapsed);
    CU_ASSERT_EQUAL(rc, 0);
    out = slurp(out_path);
    snprintf(want, sizeof(want),
             "\"joins\":[{\"rank\":1,\"member_id\":\"%s\",\"step\":40,\"joined_ms_ago\":", id1);
    expect_contains(out, want);
    expect_contains(out, ",\"throw_on_early_termination\":true}],\"last_joiner\":-1,\"servers\":[");
    snprintf(want, sizeof(want),
             "{\"rank\":0,\"name\":\"srv-0\",\"address\":\"%s\",\"reachable\":true,"
             "\"server_rank\":0,\"world_size\":2,\"step\":12,\"attached\":true,\"generation\":7,"
             "\"backend\":\"tcp\",\"placement\":\"cuda:0\",\"transport\":\"shm\",\"stuck\":[{"
             "\"rank\":0,\"op\":\"all_gather\",\"seq\":418,\"state\":\"running\",\"stuck\":true,"
             "\"waiting_on\":1,\"seconds\":5.25,\"label\":\"step 12, fc3.weight\",\"dtype\":"
             "\"fp32\",\"count\":4096,\"error\":\"\",\"tag\":0,\"start_time\":0.0,"
             "\"end_time\":0.0}],\"flight_records\":[{\"rank\":0,",
             addr0);
    expect_contains(out, want);
    snprintf(
        want, sizeof(want),
        "{\"rank\":1,\"name\":\"srv-1\",\"address\":\"%s\",\"reachable\":false,\"error\":", addr1);
    expect_contains(out, want);
    snprintf(want, sizeof(want),
             "{\"rank\":-1,\"name\":\"srv-2\",\"address\":\"%s\",\"reachable\":false,", addr2);
    expect_contains(out, want);
    free(out);
    /* And it parses, where a Python is at hand. */
    if (access("/usr/bin/python3", X_OK) == 0) {
        char cmd[512];
        snprintf(cmd, sizeof(cmd),
                 "/usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); "
                 "assert len(d[\"servers\"]) == 3 and d[\"joins\"][0][\"step\"] == 40; "
                 "f = d[\"servers\"][0][\"flight_records\"]; "
                 "assert len(f) == 6 and f[0][\"seq\"] == 411 and not f[0][\"stuck\"]' %s",
                 out_path);
        CU_ASSERT_EQUAL(system(cmd), 0);
    }

    /* All joined: the table empties and the last joiner shows. */
    CU_ASSERT_FATAL(report_join(ch, id0, 0, PSHARD__JOIN_PHASE__JOINED, 41, false, 0));
    CU_ASSERT_FATAL(report_join(ch, id0, 0, PSHARD__JOIN_PHASE__ALL_JOINED, 41, false, 0));
    /* Global options after the command, as git and kubectl take them, and "=value" too. */
    const char *quick_args[] = {"status",   "--coordinator",         target, "--token-file",
                                token_path, "--server-timeout-ms=0", NULL};
    rc = run_ctl(quick_args, out_path, err_path, 20000, &elapsed);
    CU_ASSERT_EQUAL(rc, 0);
    out = slurp(out_path);
    expect_contains(out, "joins        none\n");
    expect_contains(out, "last joiner  rank 0\n");
    CU_ASSERT(strstr(out, "shard servers (") == NULL); /* --server-timeout-ms 0: not asked */
    free(out);

    const char *late_json[] = {"--coordinator",       target,     "status",
                               "--token-file",        token_path, "--json",
                               "--server-timeout-ms", "0",        NULL};
    rc = run_ctl(late_json, out_path, err_path, 20000, &elapsed);
    CU_ASSERT_EQUAL(rc, 0);
    out = slurp(out_path);
    expect_contains(out, "\"last_joiner\":0");
    free(out);
    /* An unknown option is named. */
    const char *bogus[] = {"--coordinator", target, "--token-file", token_path, "status",
                           "--bogus",       NULL};
    rc = run_ctl(bogus, out_path, err_path, 20000, &elapsed);
    CU_ASSERT_EQUAL(rc, 2);
    char *berr = slurp(err_path);
    expect_contains(berr, "status: unknown option '--bogus'");
    free(berr);

    /* Without the token the coordinator refuses: exit 2 with the reason on stderr. */
    const char *anon_args[] = {"--coordinator", target, "status", NULL};
    rc = run_ctl(anon_args, out_path, err_path, 20000, &elapsed);
    CU_ASSERT_EQUAL(rc, 2);
    char *errs = slurp(err_path);
    expect_contains(errs, "cluster token");
    free(errs);

    close(hung_fd);
    ps_rpc_server_destroy(fake);
    ps_rpc_channel_destroy(ch);
    CU_ASSERT(ps_proc_stop(coord, 10000) == 0);
}

/* --json is JSON whatever the bytes: a store value that is not UTF-8 comes back as
 * value_base64 (it used to be written raw, which no JSON parser takes), one that is stays
 * text, and a member name with a quote and a backslash still gives output that parses (the
 * coordinator refuses names with other than printable ASCII). */
static void test_json_of_any_bytes(void)
{
    const char *cargs[] = {"--world-size", "1", "--token-file", token_path, NULL};
    char target[64], err[256] = "";
    pid_t coord = ps_proc_start_coordinator(coordinator_bin, cargs, target, sizeof(target));
    CU_ASSERT_FATAL(coord > 0);
    ps_rpc_channel_config_t ccfg = {.target = target, .token = TOKEN, .own_connection = true};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&ccfg, err, sizeof(err));
    CU_ASSERT_PTR_NOT_NULL_FATAL(ch);
    char out_path[160], err_path[160];
    snprintf(out_path, sizeof(out_path), "%s/out", workdir);
    snprintf(err_path, sizeof(err_path), "%s/err", workdir);
    int64_t elapsed = 0;

    const char *set_raw[] = {"--coordinator", target, "--token-file", token_path, "store",
                             "set",           "raw",  "\xff\xfe",     NULL};
    CU_ASSERT_EQUAL(run_ctl(set_raw, out_path, err_path, 20000, &elapsed), 0);
    const char *get_raw[] = {"--coordinator", target, "--token-file", token_path, "--json",
                             "store",         "get",  "raw",          NULL};
    CU_ASSERT_EQUAL(run_ctl(get_raw, out_path, err_path, 20000, &elapsed), 0);
    char *out = slurp(out_path);
    expect_contains(out, "{\"key\":\"raw\",\"value_base64\":\"//4=\"}\n");
    free(out);

    const char *set_text[] = {"--coordinator", target, "--token-file",       token_path, "store",
                              "set",           "text", "h\xc3\xa9 \"said\"", NULL};
    CU_ASSERT_EQUAL(run_ctl(set_text, out_path, err_path, 20000, &elapsed), 0);
    const char *get_text[] = {"--coordinator", target, "--token-file", token_path, "--json",
                              "store",         "get",  "text",         NULL};
    CU_ASSERT_EQUAL(run_ctl(get_text, out_path, err_path, 20000, &elapsed), 0);
    out = slurp(out_path);
    expect_contains(out, "{\"key\":\"text\",\"value\":\"h\xc3\xa9 \\\"said\\\"\"}\n");
    free(out);

    char id[64] = "";
    CU_ASSERT_FATAL(ps_coord_register(ch, PSHARD__ROLE__SHARD_SERVER, "srv-\"q\\", "127.0.0.1:1",
                                      id, sizeof(id)));
    const char *status[] = {"--coordinator", target, "--token-file", token_path, "--json",
                            "members",       NULL};
    CU_ASSERT_EQUAL(run_ctl(status, out_path, err_path, 20000, &elapsed), 0);
    out = slurp(out_path);
    expect_contains(out, "\"name\":\"srv-\\\"q\\\\\"");
    free(out);
    if (access("/usr/bin/python3", X_OK) == 0) {
        char cmd[512];
        snprintf(cmd, sizeof(cmd),
                 "/usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); "
                 "assert d[0][\"name\"] == chr(34).join([\"srv-\", \"q\"]) + chr(92)' %s",
                 out_path);
        CU_ASSERT_EQUAL(system(cmd), 0);
    }
    ps_rpc_channel_destroy(ch);
    CU_ASSERT(ps_proc_stop(coord, 10000) == 0);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s PATH-TO-pshard-coordinator PATH-TO-pshardctl\n", argv[0]);
        return 2;
    }
    coordinator_bin = argv[1];
    ctl_bin = argv[2];
    signal(SIGPIPE, SIG_IGN);
    ps_strlcpy(workdir, "/tmp/pshard-ctl-XXXXXX", sizeof(workdir));
    if (!mkdtemp(workdir)) {
        perror("mkdtemp");
        return 2;
    }
    snprintf(token_path, sizeof(token_path), "%s/token", workdir);
    FILE *f = fopen(token_path, "w");
    if (!f || fputs(TOKEN "\n", f) < 0 || fclose(f) != 0) {
        perror("token file");
        return 2;
    }
    static const ps_test_case_t cases[] = {
        {"status shows joins and asks every shard server", test_status_joins_and_servers},
        {"--json is JSON whatever the bytes", test_json_of_any_bytes},
        {NULL, NULL},
    };
    int rc = ps_test_main("ctl_status", cases);
    char path[192];
    const char *names[] = {"token", "out", "err"};
    for (size_t i = 0; i < PS_ARRAY_LEN(names); i++) {
        snprintf(path, sizeof(path), "%s/%s", workdir, names[i]);
        unlink(path);
    }
    rmdir(workdir);
    return rc;
}
