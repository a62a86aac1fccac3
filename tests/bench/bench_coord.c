/* pshard-bench-coord: how many heartbeats per second one coordinator sustains, and at what
 * latency, when K simulated members heartbeat in a closed loop (each sends its next heartbeat as
 * soon as the previous reply arrives, so K calls are always outstanding) or, with --rate, at a
 * fixed offered rate (open loop). It drives the load with the gRPC C core async API directly and
 * prints one table row per K. A benchmark, not a test: it prints figures and exits non-zero only
 * when a call fails or the coordinator it started misbehaves.
 *
 * Reading the closed-loop figures: with K calls always in flight, mean latency is K divided by
 * the throughput (Little's law), so at large K latency grows with K by construction; use --rate
 * to ask "what latency at this load". */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include "grpc/health/v1/health.pb-c.h"
#include "pshard/config.h"
#include "pshard/coordinator.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

#define MAX_ROUNDS 32
#define MAX_K 65536 /* the coordinator's member limit */
#define NS_PER_MS 1000000LL
#define NS_PER_S 1000000000LL

/* ------------------------------------------------------------------------------------------ */
/* Options                                                                                     */

typedef struct {
    char *k_list;          /* "10,100,1000" */
    int64_t seconds;       /* measured window per K */
    int64_t warmup_ms;     /* heartbeats before the window opens (not measured) */
    int64_t rate;          /* offered heartbeats/s over all members (open loop); 0: closed loop */
    int64_t threads;       /* client threads, each with its own completion queue */
    int64_t channels;      /* channels (TCP connections) per client thread */
    bool in_process;       /* run the coordinator inside this process instead of spawning it */
    char *coordinator_bin; /* pshard-coordinator to spawn */
    char *target;          /* benchmark an already running coordinator at HOST:PORT */
    int64_t lease_ms;      /* --lease-ms given to the coordinator */
    int64_t startup_ms;    /* deadline for the coordinator to write its port and be healthy */
    int64_t call_timeout_ms;
    char *log;
} bench_opts_t;

#define OPT(flag, env, type, def, help, field, lo, hi)                                             \
    {                                                                                              \
        flag, env, type, def, help, offsetof(bench_opts_t, field), lo, hi                          \
    }

static const ps_option_t options[] = {
    OPT("k", "PSHARD_BENCH_K", PS_OPT_STRING, "10,100,1000",
        "comma-separated numbers of simulated members, one table row each", k_list, 0, 0),
    OPT("seconds", "PSHARD_BENCH_SECONDS", PS_OPT_INT, "3", "measured window per K, in seconds",
        seconds, 1, 3600),
    OPT("warmup-ms", "PSHARD_BENCH_WARMUP_MS", PS_OPT_INT, "1000",
        "heartbeats before each measured window, in milliseconds", warmup_ms, 0, 600000),
    OPT("rate", "PSHARD_BENCH_RATE", PS_OPT_INT, "0",
        "offered heartbeats/s over all K members, each member every K/rate s (open loop); "
        "0 = closed loop, each member's next heartbeat right after its reply",
        rate, 0, 10000000),
    OPT("threads", "PSHARD_BENCH_THREADS", PS_OPT_INT, "1",
        "client threads, each with its own completion queue", threads, 1, 64),
    OPT("channels", "PSHARD_BENCH_CHANNELS", PS_OPT_INT, "4",
        "channels per client thread, each its own TCP connection", channels, 1, 256),
    OPT("in-process", "PSHARD_BENCH_IN_PROCESS", PS_OPT_BOOL, "false",
        "run the coordinator in this process (default: spawn pshard-coordinator)", in_process, 0,
        0),
    OPT("coordinator-bin", "PSHARD_COORDINATOR_BIN", PS_OPT_STRING, NULL,
        "pshard-coordinator to spawn (default: found next to this program or in its build tree)",
        coordinator_bin, 0, 0),
    OPT("target", "PSHARD_BENCH_TARGET", PS_OPT_STRING, NULL,
        "benchmark a coordinator already serving at HOST:PORT (no token, no TLS)", target, 0, 0),
    OPT("lease-ms", "PSHARD_BENCH_LEASE_MS", PS_OPT_INT, "60000",
        "lease given to the coordinator it starts, long enough that nobody is evicted", lease_ms,
        10, 86400000),
    OPT("startup-ms", "PSHARD_BENCH_STARTUP_MS", PS_OPT_INT, "20000",
        "how long the coordinator may take to write its port and report SERVING", startup_ms, 100,
        600000),
    OPT("call-timeout-ms", "PSHARD_BENCH_CALL_TIMEOUT_MS", PS_OPT_INT, "10000",
        "deadline of each call; a call past it counts as an error", call_timeout_ms, 10, 600000),
    OPT("log", "PSHARD_LOG", PS_OPT_STRING, "warn", "log level: error|warn|info|debug|trace", log,
        0, 0),
};

/* Parses "10,100,1000" into ks[]; returns the count, or -1 with a message in err. */
static int parse_k_list(const char *text, size_t *ks, size_t max, char *err, size_t errlen)
{
    int n = 0;
    const char *p = text;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        char item[32];
        int64_t k;
        if (len == 0 || len >= sizeof(item)) {
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "--k '%s': empty or overlong item",
                    text);
            return -1;
        }
        memcpy(item, p, len);
        item[len] = '\0';
        if (ps_parse_i64(item, 1, MAX_K, &k) != 0) {
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                    "--k: '%s' is not a number from 1 to %d", item, MAX_K);
            return -1;
        }
        if ((size_t)n == max) {
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "--k: at most %zu values", max);
            return -1;
        }
        ks[n++] = (size_t)k;
        if (!comma)
            return n;
        p = comma + 1;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* The coordinator under test: a spawned process, an in-process instance, or a given target    */

typedef struct {
    pid_t pid;                        /* spawned process, or 0 */
    pshard_coordinator_t *in_process; /* or an in-process coordinator */
    char tmpdir[64];                  /* holds the port file of a spawned coordinator */
    char port_file[128];
    char target[300]; /* "127.0.0.1:PORT" */
    char bin[PATH_MAX];
} coord_t;

static bool is_executable(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

/* Finds pshard-coordinator: next to this program (installed side by side), then in the build
 * tree (tests/bench/../../coordinator), then the path CMake compiled in. */
static bool find_coordinator_bin(char *out, size_t outlen)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = '\0';
            static const char *const rel[] = {"pshard-coordinator",
                                              "../../coordinator/pshard-coordinator"};
            for (size_t i = 0; i < PS_ARRAY_LEN(rel); i++) {
                if (ps_snprintf(out, outlen, "%s/%s", exe, rel[i]) == 0 && is_executable(out))
                    return true;
            }
        }
    }
#ifdef PSHARD_BENCH_COORDINATOR_BIN
    if (ps_strlcpy(out, PSHARD_BENCH_COORDINATOR_BIN, outlen) == 0 && is_executable(out))
        return true;
#endif
    return false;
}

static void sleep_ns(int64_t ns)
{
    struct timespec ts = {ns / NS_PER_S, ns % NS_PER_S};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Reads the port the coordinator wrote (it renames a complete file into place). 0 if absent. */
static int read_port_file(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[32] = "";
    bool got = fgets(line, sizeof(line), f) != NULL;
    fclose(f);
    if (!got)
        return 0;
    line[strcspn(line, "\r\n")] = '\0';
    int64_t port;
    if (ps_parse_i64(line, 1, 65535, &port) != 0)
        return 0;
    return (int)port;
}

/* Starts the binary with --listen 127.0.0.1:0 --port-file F and polls F until the port appears
 * or the deadline passes. The child gets SIGTERM if this process dies first. */
static pshard_status_t spawn_coordinator(coord_t *co, const bench_opts_t *o, int64_t deadline_ns,
                                         char *err, size_t errlen)
{
    if (ps_strlcpy(co->tmpdir, "/tmp/pshard-bench-XXXXXX", sizeof(co->tmpdir)) != 0 ||
        !mkdtemp(co->tmpdir))
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "mkdtemp: %s", strerror(errno));
    if (ps_snprintf(co->port_file, sizeof(co->port_file), "%s/port", co->tmpdir) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "port file path too long");
    char lease[32];
    snprintf(lease, sizeof(lease), "%lld", (long long)o->lease_ms);
    /* Everything the child needs is built before fork: after it, only exec-safe calls. */
    char *argv[] = {co->bin,       "--listen",   "127.0.0.1:0", "--port-file",
                    co->port_file, "--lease-ms", lease,         "--world-size",
                    "1",           "--log",      o->log,        NULL};
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "fork: %s", strerror(errno));
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)
            _exit(127);
        /* Its "listening on" line would interleave with the table; its stderr stays. */
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) {
            dup2(devnull, STDOUT_FILENO);
            close(devnull);
        }
        execv(co->bin, argv);
        _exit(127);
    }
    co->pid = pid;
    while (ps_now_ns() < deadline_ns) {
        int status;
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid) {
            co->pid = 0;
            return ps_errf(err, errlen, PSHARD_ERR_SYSTEM,
                           "%s exited (%s %d) before writing its port file", co->bin,
                           WIFEXITED(status) ? "status" : "signal",
                           WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
        }
        int port = read_port_file(co->port_file);
        if (port > 0) {
            snprintf(co->target, sizeof(co->target), "127.0.0.1:%d", port);
            return PSHARD_OK;
        }
        sleep_ns(5 * NS_PER_MS);
    }
    return ps_errf(err, errlen, PSHARD_ERR_TIMEOUT, "%s wrote no port file within %lld ms", co->bin,
                   (long long)o->startup_ms);
}

/* Polls grpc.health.v1.Health/Check for "pshard.Coordinator" until SERVING or the deadline. */
static pshard_status_t wait_healthy(const char *target, int64_t deadline_ns, char *err,
                                    size_t errlen)
{
    ps_rpc_channel_config_t ccfg = {.target = target};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&ccfg, err, errlen);
    if (!ch)
        return PSHARD_ERR_INVALID_ARGUMENT;
    char last[256] = "no answer";
    pshard_status_t rc = PSHARD_ERR_TIMEOUT;
    while (ps_now_ns() < deadline_ns) {
        Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
        req.service = "pshard.Coordinator";
        ProtobufCMessage *resp = NULL;
        char call_err[256] = "";
        pshard_status_t st = ps_rpc_unary(ch, "/grpc.health.v1.Health/Check", &req.base,
                                          &grpc__health__v1__health_check_response__descriptor,
                                          &resp, 500, 0, NULL, call_err, sizeof(call_err));
        if (st == PSHARD_OK) {
            int serving = ((Grpc__Health__V1__HealthCheckResponse *)resp)->status;
            protobuf_c_message_free_unpacked(resp, NULL);
            if (serving == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING) {
                rc = PSHARD_OK;
                break;
            }
            snprintf(last, sizeof(last), "health status %d", serving);
        } else {
            ps_strlcpy(last, call_err, sizeof(last));
        }
        sleep_ns(10 * NS_PER_MS);
    }
    ps_rpc_channel_destroy(ch);
    if (rc != PSHARD_OK)
        ps_errf(err, errlen, rc, "%s did not report SERVING in time (last: %s)", target, last);
    return rc;
}

static pshard_status_t coord_start(coord_t *co, const bench_opts_t *o, char *err, size_t errlen)
{
    int64_t deadline = ps_now_ns() + o->startup_ms * NS_PER_MS;
    if (o->target) {
        if (ps_strlcpy(co->target, o->target, sizeof(co->target)) != 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "--target is too long");
    } else if (o->in_process) {
        pshard_coordinator_config_t cfg = {
            .listen = "127.0.0.1:0",
            .min_nodes = 1,
            .max_nodes = 1,
            .last_call_ms = 30000,
            .lease_ms = o->lease_ms,
            .heartbeat_ms = 1000,
            .max_message_bytes = 4 << 20,
            .store_wait_default_ms = 300000,
            .worker_threads = 4,
        };
        co->in_process = pshard_coordinator_start(&cfg, err, errlen);
        if (!co->in_process)
            return PSHARD_ERR_SYSTEM;
        snprintf(co->target, sizeof(co->target), "127.0.0.1:%d",
                 pshard_coordinator_port(co->in_process));
    } else {
        if (o->coordinator_bin) {
            if (ps_strlcpy(co->bin, o->coordinator_bin, sizeof(co->bin)) != 0 ||
                !is_executable(co->bin))
                return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                               "--coordinator-bin %s is not an executable file",
                               o->coordinator_bin);
        } else if (!find_coordinator_bin(co->bin, sizeof(co->bin))) {
            return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND,
                           "cannot find pshard-coordinator next to this program or in its build "
                           "tree; give --coordinator-bin PATH or --in-process");
        }
        char real[PATH_MAX];
        if (realpath(co->bin, real))
            ps_strlcpy(co->bin, real, sizeof(co->bin));
        PS_CHECK(spawn_coordinator(co, o, deadline, err, errlen));
    }
    return wait_healthy(co->target, deadline, err, errlen);
}

/* Stops what coord_start started: SIGTERM to a spawned coordinator, then waits up to 15 s for
 * it (SIGKILL after that). Returns false when it did not exit cleanly with status 0. */
static bool coord_stop(coord_t *co)
{
    bool clean = true;
    if (co->in_process) {
        pshard_coordinator_stop(co->in_process);
        co->in_process = NULL;
    }
    if (co->pid > 0) {
        kill(co->pid, SIGTERM);
        int64_t give_up = ps_now_ns() + 15 * NS_PER_S;
        int status = 0;
        pid_t w = 0;
        while ((w = waitpid(co->pid, &status, WNOHANG)) == 0 && ps_now_ns() < give_up)
            sleep_ns(5 * NS_PER_MS);
        if (w == 0) {
            fprintf(stderr,
                    "pshard-bench-coord: coordinator pid %d ignored SIGTERM for 15 s; "
                    "killing it\n",
                    (int)co->pid);
            kill(co->pid, SIGKILL);
            waitpid(co->pid, &status, 0);
            clean = false;
        } else if (w == co->pid && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
            fprintf(stderr, "pshard-bench-coord: coordinator pid %d ended with %s %d\n",
                    (int)co->pid, WIFEXITED(status) ? "status" : "signal",
                    WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
            clean = false;
        }
        co->pid = 0;
    }
    if (co->port_file[0])
        unlink(co->port_file);
    if (co->tmpdir[0])
        rmdir(co->tmpdir);
    return clean;
}

/* CPU seconds (user + system) a spawned coordinator has used so far, from /proc; -1 if unknown. */
static double child_cpu_seconds(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* Fields after the parenthesised command name: state is field 3, utime 14, stime 15. */
    char *p = strrchr(buf, ')');
    if (!p)
        return -1;
    unsigned long long utime = 0, stime = 0;
    if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime, &stime) != 2)
        return -1;
    return (double)(utime + stime) / (double)sysconf(_SC_CLK_TCK);
}

static double self_cpu_seconds(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

/* ------------------------------------------------------------------------------------------ */
/* Load: simulated members on client threads                                                  */

typedef enum { CALL_REGISTER, CALL_HEARTBEAT, CALL_LEAVE } call_kind_t;

struct client;

/* One simulated member and its one in-flight call. The member is the completion-queue tag; its
 * call state is released only after that call's completion has been dequeued. */
typedef struct {
    call_kind_t kind; /* the call in flight */
    struct client *owner;
    grpc_channel *channel; /* borrowed from owner */
    size_t index;          /* 0..K-1 */
    bool registered;
    bool busy;       /* a heartbeat is in flight (paced mode) */
    int64_t owed_ns; /* paced mode: the slot it missed while busy, or 0 */
    char member_id[64], lease_key[64];
    grpc_slice id_request; /* packed HeartbeatRequest, once registered */

    grpc_call *call;
    grpc_byte_buffer *send_bb, *recv_bb;
    grpc_metadata_array initial_md, trailing_md;
    grpc_status_code status;
    grpc_slice details;
    int64_t started_ns;
} member_t;

/* One client thread's state: its completion queue and channels live across rounds; a round
 * assigns it members and collects its latencies. Only the thread running a phase touches it;
 * phases are handed over by pthread_create/pthread_join. */
typedef struct client {
    grpc_completion_queue *cq;
    grpc_channel **channels;
    size_t nchannels;
    const bench_opts_t *opts;

    member_t *members;
    size_t nmembers;
    call_kind_t phase;
    int64_t measure_start_ns, measure_end_ns; /* heartbeat phase: the window */
    int64_t spacing_ns; /* paced mode: time between this thread's slots; 0 = closed loop */
    int64_t first_slot_ns;
    char round_tag[48]; /* makes member names unique per round */

    int64_t *lat_ns; /* latencies of heartbeats completed inside the window */
    size_t nlat, cap_lat;
    uint64_t measured; /* heartbeats completed OK inside the window */
    uint64_t lost_samples;
    uint64_t late_slots; /* paced mode: slots dropped because the member was still waiting */
    uint64_t errors;
    char first_error[256];
    pthread_t thread;
    bool thread_started;
} client_t;

static grpc_slice g_path_register, g_path_heartbeat, g_path_leave;

static void record_error(client_t *cl, const char *what, const member_t *m, const char *detail)
{
    cl->errors++;
    if (!cl->first_error[0])
        snprintf(cl->first_error, sizeof(cl->first_error), "%s of member %zu: %s", what, m->index,
                 detail);
}

static grpc_slice pack_slice(const ProtobufCMessage *msg)
{
    size_t len = protobuf_c_message_get_packed_size(msg);
    grpc_slice s = grpc_slice_malloc(len);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    return s;
}

/* Starts the member's unary call (request bytes are referenced, not consumed). Returns false,
 * with the error recorded, if the core refused the batch. */
static bool start_call(member_t *m, call_kind_t kind, grpc_slice request, int64_t now_ns)
{
    client_t *cl = m->owner;
    const grpc_slice *path = kind == CALL_REGISTER    ? &g_path_register
                             : kind == CALL_HEARTBEAT ? &g_path_heartbeat
                                                      : &g_path_leave;
    m->kind = kind;
    m->started_ns = now_ns;
    gpr_timespec deadline =
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                     gpr_time_from_millis(cl->opts->call_timeout_ms, GPR_TIMESPAN));
    m->call = grpc_channel_create_call(m->channel, NULL, GRPC_PROPAGATE_DEFAULTS, cl->cq, *path,
                                       NULL, deadline, NULL);
    m->send_bb = grpc_raw_byte_buffer_create(&request, 1);
    m->recv_bb = NULL;
    grpc_metadata_array_init(&m->initial_md);
    grpc_metadata_array_init(&m->trailing_md);
    m->status = GRPC_STATUS_UNKNOWN;
    m->details = grpc_empty_slice();

    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = m->send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &m->initial_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &m->recv_bb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &m->trailing_md;
    ops[5].data.recv_status_on_client.status = &m->status;
    ops[5].data.recv_status_on_client.status_details = &m->details;
    grpc_call_error e = grpc_call_start_batch(m->call, ops, PS_ARRAY_LEN(ops), m, NULL);
    if (e != GRPC_CALL_OK) {
        char msg[64];
        snprintf(msg, sizeof(msg), "grpc_call_start_batch failed: %d", (int)e);
        record_error(cl, "starting a call", m, msg);
        grpc_byte_buffer_destroy(m->send_bb);
        m->send_bb = NULL;
        grpc_metadata_array_destroy(&m->initial_md);
        grpc_metadata_array_destroy(&m->trailing_md);
        grpc_call_unref(m->call);
        m->call = NULL;
        return false;
    }
    return true;
}

/* Releases what start_call allocated, after the call's completion was dequeued. */
static void end_call(member_t *m)
{
    if (m->recv_bb)
        grpc_byte_buffer_destroy(m->recv_bb);
    m->recv_bb = NULL;
    grpc_byte_buffer_destroy(m->send_bb);
    m->send_bb = NULL;
    grpc_slice_unref(m->details);
    grpc_metadata_array_destroy(&m->initial_md);
    grpc_metadata_array_destroy(&m->trailing_md);
    grpc_call_unref(m->call);
    m->call = NULL;
}

/* Checks the finished call's status; on failure records the error and returns false. */
static bool call_ok(member_t *m)
{
    static const char *const names[] = {"Register", "Heartbeat", "Leave"};
    if (m->status == GRPC_STATUS_OK && m->recv_bb)
        return true;
    char msg[200];
    if (m->status == GRPC_STATUS_OK)
        snprintf(msg, sizeof(msg), "OK status but no reply message");
    else
        snprintf(msg, sizeof(msg), "gRPC status %d: %.*s", (int)m->status,
                 (int)GRPC_SLICE_LENGTH(m->details),
                 (const char *)GRPC_SLICE_START_PTR(m->details));
    record_error(m->owner, names[m->kind], m, msg);
    return false;
}

/* Register's reply carries the member id every later call names. */
static void on_registered(member_t *m)
{
    grpc_byte_buffer_reader reader;
    Pshard__MemberView *view = NULL;
    if (grpc_byte_buffer_reader_init(&reader, m->recv_bb)) {
        grpc_slice s = grpc_byte_buffer_reader_readall(&reader);
        grpc_byte_buffer_reader_destroy(&reader);
        view = pshard__member_view__unpack(NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
        grpc_slice_unref(s);
    }
    if (!view || !view->member_id || !view->member_id[0] ||
        ps_strlcpy(m->member_id, view->member_id, sizeof(m->member_id)) != 0 ||
        ps_strlcpy(m->lease_key, view->lease_key ? view->lease_key : "", sizeof(m->lease_key)) !=
            0) {
        record_error(m->owner, "Register", m, "reply is not a MemberView with a member id");
    } else {
        Pshard__HeartbeatRequest req = PSHARD__HEARTBEAT_REQUEST__INIT;
        req.member_id = m->member_id;
        req.lease_key = m->lease_key;
        m->id_request = pack_slice(&req.base);
        m->registered = true;
    }
    if (view)
        pshard__member_view__free_unpacked(view, NULL);
}

static void record_latency(client_t *cl, int64_t ns)
{
    if (cl->nlat == cl->cap_lat) {
        size_t cap = cl->cap_lat ? cl->cap_lat * 2 : 65536;
        int64_t *p = realloc(cl->lat_ns, cap * sizeof(*p));
        if (!p) {
            cl->lost_samples++;
            return;
        }
        cl->lat_ns = p;
        cl->cap_lat = cap;
    }
    cl->lat_ns[cl->nlat++] = ns;
}

/* Dequeues the next completion, waiting at most until the monotonic instant until_ns (ps_now_ns
 * clock). NULL on timeout. */
static member_t *next_completion(client_t *cl, int64_t until_ns)
{
    int64_t wait_ns = until_ns - ps_now_ns();
    if (wait_ns < 0)
        wait_ns = 0;
    gpr_timespec deadline =
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_nanos(wait_ns, GPR_TIMESPAN));
    grpc_event ev = grpc_completion_queue_next(cl->cq, deadline, NULL);
    /* GRPC_QUEUE_SHUTDOWN cannot happen: the queue is shut down only after the last phase. */
    return ev.type == GRPC_OP_COMPLETE ? ev.tag : NULL;
}

/* Handles a finished call: checks it, remembers a registered member id, forgets a left one,
 * and records a heartbeat's latency (from started_ns) when it completed inside the window. */
static void complete_call(client_t *cl, member_t *m, int64_t now_ns)
{
    bool ok = call_ok(m);
    if (ok && m->kind == CALL_REGISTER)
        on_registered(m);
    if (ok && m->kind == CALL_LEAVE) {
        m->registered = false;
        grpc_slice_unref(m->id_request);
    }
    if (ok && m->kind == CALL_HEARTBEAT && now_ns >= cl->measure_start_ns &&
        now_ns < cl->measure_end_ns) {
        cl->measured++;
        record_latency(cl, now_ns - m->started_ns);
    }
    end_call(m);
    m->busy = false;
}

/* Closed loop: each member sends its next heartbeat as soon as the previous reply arrives. */
static void heartbeat_closed_loop(client_t *cl)
{
    size_t in_flight = 0;
    int64_t now = ps_now_ns();
    for (size_t i = 0; i < cl->nmembers; i++) {
        member_t *m = &cl->members[i];
        if (m->registered && start_call(m, CALL_HEARTBEAT, m->id_request, now))
            in_flight++;
    }
    while (in_flight > 0) {
        member_t *m = next_completion(cl, ps_now_ns() + NS_PER_S);
        if (!m)
            continue;
        now = ps_now_ns();
        complete_call(cl, m, now);
        if (now >= cl->measure_end_ns || !start_call(m, CALL_HEARTBEAT, m->id_request, now))
            in_flight--;
    }
}

/* Open loop (--rate): member slots come round every spacing_ns in turn, so each member is due
 * every nmembers * spacing_ns. A member still waiting for its previous reply when its slot
 * comes sends as soon as that reply arrives; a second slot missed meanwhile is dropped and
 * counted as late. Latency is measured from the scheduled slot, not from the actual send, so
 * a backlog shows up in the figures instead of hiding (no coordinated omission). */
static void heartbeat_paced(client_t *cl)
{
    size_t in_flight = 0, cursor = 0;
    int64_t next_slot = cl->first_slot_ns;
    for (;;) {
        int64_t now = ps_now_ns();
        while (cl->nmembers > 0 && next_slot <= now && next_slot < cl->measure_end_ns) {
            member_t *m = &cl->members[cursor];
            cursor = (cursor + 1) % cl->nmembers;
            if (!m->registered) {
                /* Its Register failed (already counted): its slots stay empty. */
            } else if (!m->busy) {
                if (start_call(m, CALL_HEARTBEAT, m->id_request, next_slot)) {
                    m->busy = true;
                    in_flight++;
                }
            } else if (m->owed_ns == 0) {
                m->owed_ns = next_slot;
            } else {
                cl->late_slots++;
            }
            next_slot += cl->spacing_ns;
        }
        bool schedule_done = cl->nmembers == 0 || next_slot >= cl->measure_end_ns;
        if (in_flight == 0 && schedule_done)
            break;
        member_t *m = next_completion(cl, schedule_done ? now + NS_PER_S : next_slot);
        if (!m)
            continue;
        now = ps_now_ns();
        complete_call(cl, m, now);
        in_flight--;
        int64_t owed = m->owed_ns;
        m->owed_ns = 0;
        if (owed && now < cl->measure_end_ns &&
            start_call(m, CALL_HEARTBEAT, m->id_request, owed)) {
            m->busy = true;
            in_flight++;
        }
    }
}

/* Runs one phase for this thread's members: every member's Register (or Leave) once, or
 * heartbeats until the measured window closes. Returns when none of its calls is in flight.
 * Every call has a deadline, so this always ends. */
static void *client_phase_main(void *arg)
{
    client_t *cl = arg;
    if (cl->phase == CALL_HEARTBEAT) {
        if (cl->spacing_ns > 0)
            heartbeat_paced(cl);
        else
            heartbeat_closed_loop(cl);
        return NULL;
    }
    size_t in_flight = 0;
    int64_t now = ps_now_ns();
    for (size_t i = 0; i < cl->nmembers; i++) {
        member_t *m = &cl->members[i];
        bool started = false;
        if (cl->phase == CALL_REGISTER) {
            char name[96], address[48];
            snprintf(name, sizeof(name), "bench-%s-%zu", cl->round_tag, m->index);
            snprintf(address, sizeof(address), "127.0.0.1:%zu", 20000 + m->index);
            Pshard__RegisterRequest req = PSHARD__REGISTER_REQUEST__INIT;
            req.role = PSHARD__ROLE__SHARD_SERVER;
            req.name = name;
            req.address = address;
            req.node = "bench";
            req.device = "cpu";
            grpc_slice s = pack_slice(&req.base);
            started = start_call(m, CALL_REGISTER, s, now);
            grpc_slice_unref(s);
        } else if (m->registered) {
            /* A LeaveRequest has the same wire form as a HeartbeatRequest: {member_id = 1,
             * lease_key = 2}. */
            started = start_call(m, CALL_LEAVE, m->id_request, now);
        }
        if (started)
            in_flight++;
    }
    while (in_flight > 0) {
        member_t *m = next_completion(cl, ps_now_ns() + NS_PER_S);
        if (m) {
            complete_call(cl, m, ps_now_ns());
            in_flight--;
        }
    }
    return NULL;
}

/* Starts `phase` on every client thread. A thread that cannot be created runs its phase right
 * here instead (slower to start, same calls). */
static void start_phase(client_t *clients, size_t nclients, call_kind_t phase)
{
    for (size_t t = 0; t < nclients; t++) {
        clients[t].phase = phase;
        clients[t].thread_started =
            pthread_create(&clients[t].thread, NULL, client_phase_main, &clients[t]) == 0;
        if (!clients[t].thread_started)
            client_phase_main(&clients[t]);
    }
}

static void join_phase(client_t *clients, size_t nclients)
{
    for (size_t t = 0; t < nclients; t++) {
        if (clients[t].thread_started)
            pthread_join(clients[t].thread, NULL);
        clients[t].thread_started = false;
    }
}

static grpc_channel *make_channel(const char *target)
{
    grpc_arg args[1];
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL; /* a TCP connection per channel */
    args[0].value.integer = 1;
    grpc_channel_args chargs = {PS_ARRAY_LEN(args), args};
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    grpc_channel *ch = grpc_channel_create(target, creds, &chargs);
    grpc_channel_credentials_release(creds);
    return ch;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile (per mille: 500 is p50) of sorted v[0..n-1], n > 0, in ms. */
static double percentile_ms(const int64_t *v, size_t n, size_t per_mille)
{
    size_t rank = (per_mille * n + 999) / 1000;
    if (rank < 1)
        rank = 1;
    if (rank > n)
        rank = n;
    return (double)v[rank - 1] / 1e6;
}

/* Sleeps until the monotonic instant t_ns (a schedule, not a synchronisation). */
static void sleep_until(int64_t t_ns)
{
    int64_t now = ps_now_ns();
    if (t_ns > now)
        sleep_ns(t_ns - now);
}

typedef struct {
    uint64_t calls, errors, lost_samples, late_slots;
    double seconds, rate, p50_ms, p99_ms, max_ms;
    double register_ms;
    double client_cpu, coord_cpu; /* cores busy during the window; coord_cpu < 0 if unknown */
    char first_error[256];
} round_result_t;

/* One table row: register K members, heartbeat through warmup and the window, leave. */
static void run_round(client_t *clients, size_t nclients, size_t k, const bench_opts_t *o,
                      const coord_t *co, round_result_t *r)
{
    memset(r, 0, sizeof(*r));
    member_t *members = calloc(k, sizeof(*members));
    if (!members) {
        r->errors = 1;
        snprintf(r->first_error, sizeof(r->first_error), "out of memory for %zu members", k);
        return;
    }
    /* The members are split into one contiguous slice per thread, so each thread owns its
     * slice; within a thread, members take the thread's channels in turn. */
    size_t per = k / nclients, extra = k % nclients, next = 0;
    for (size_t t = 0; t < nclients; t++) {
        client_t *cl = &clients[t];
        cl->members = &members[next];
        cl->nmembers = per + (t < extra ? 1 : 0);
        for (size_t j = 0; j < cl->nmembers; j++) {
            member_t *m = &cl->members[j];
            m->owner = cl;
            m->index = next + j;
            m->channel = cl->channels[j % cl->nchannels];
        }
        next += cl->nmembers;
        snprintf(cl->round_tag, sizeof(cl->round_tag), "%d-k%zu", (int)getpid(), k);
        cl->nlat = 0;
        cl->measured = cl->errors = cl->lost_samples = cl->late_slots = 0;
        cl->first_error[0] = '\0';
        cl->measure_start_ns = cl->measure_end_ns = 0;
    }

    int64_t t0 = ps_now_ns();
    start_phase(clients, nclients, CALL_REGISTER);
    join_phase(clients, nclients);
    r->register_ms = (double)(ps_now_ns() - t0) / 1e6;

    int64_t phase_start = ps_now_ns();
    int64_t start = phase_start + o->warmup_ms * NS_PER_MS;
    int64_t end = start + o->seconds * NS_PER_S;
    for (size_t t = 0; t < nclients; t++) {
        client_t *cl = &clients[t];
        cl->measure_start_ns = start;
        cl->measure_end_ns = end;
        cl->spacing_ns = 0;
        if (o->rate > 0 && cl->nmembers > 0) {
            /* This thread's share of the rate is nmembers/k of it. */
            double spacing = 1e9 * (double)k / ((double)o->rate * (double)cl->nmembers);
            cl->spacing_ns = spacing < 1 ? 1 : (int64_t)spacing;
        }
        /* Threads' slots interleave instead of coinciding. */
        cl->first_slot_ns = phase_start + cl->spacing_ns * (int64_t)t / (int64_t)nclients;
    }
    /* The phase runs on the client threads; this thread samples CPU at the window's edges. */
    start_phase(clients, nclients, CALL_HEARTBEAT);
    sleep_until(start);
    double self0 = self_cpu_seconds();
    double child0 = co->pid > 0 ? child_cpu_seconds(co->pid) : -1;
    sleep_until(end);
    double self1 = self_cpu_seconds();
    double child1 = co->pid > 0 ? child_cpu_seconds(co->pid) : -1;
    join_phase(clients, nclients);
    double window_s = (double)(end - start) / 1e9;
    r->client_cpu = (self1 - self0) / window_s;
    r->coord_cpu = child0 >= 0 && child1 >= 0 ? (child1 - child0) / window_s : -1;

    start_phase(clients, nclients, CALL_LEAVE);
    join_phase(clients, nclients);

    size_t total = 0;
    for (size_t t = 0; t < nclients; t++)
        total += clients[t].nlat;
    int64_t *all = calloc(total ? total : 1, sizeof(*all));
    size_t filled = 0;
    if (!all)
        r->lost_samples += total; /* the row then shows zero latencies, and says why */
    for (size_t t = 0; t < nclients; t++) {
        client_t *cl = &clients[t];
        r->calls += cl->measured;
        r->errors += cl->errors;
        r->lost_samples += cl->lost_samples;
        r->late_slots += cl->late_slots;
        if (!r->first_error[0] && cl->first_error[0])
            ps_strlcpy(r->first_error, cl->first_error, sizeof(r->first_error));
        if (all && cl->nlat)
            memcpy(all + filled, cl->lat_ns, cl->nlat * sizeof(*all));
        filled += cl->nlat;
    }
    r->seconds = window_s;
    r->rate = (double)r->calls / window_s;
    if (all && total > 0) {
        qsort(all, total, sizeof(*all), cmp_i64);
        r->p50_ms = percentile_ms(all, total, 500);
        r->p99_ms = percentile_ms(all, total, 990);
        r->max_ms = (double)all[total - 1] / 1e6;
    }
    free(all);
    for (size_t i = 0; i < k; i++) {
        if (members[i].registered)
            grpc_slice_unref(members[i].id_request); /* its Leave failed */
    }
    for (size_t t = 0; t < nclients; t++) {
        clients[t].members = NULL;
        clients[t].nmembers = 0;
    }
    free(members);
}

/* ------------------------------------------------------------------------------------------ */

int main(int argc, char **argv)
{
    ps_log_init("bench");
    bench_opts_t o;
    memset(&o, 0, sizeof(o));
    ps_config_result_t res;
    char err[512] = "";
    int exit_code = 0;
    coord_t co;
    memset(&co, 0, sizeof(co));
    client_t *clients = NULL;
    size_t nclients = 0;
    bool grpc_up = false;
    size_t ks[MAX_ROUNDS];
    int nk = 0;

    if (ps_config_parse(options, PS_ARRAY_LEN(options), argc, argv, &o, &res, err, sizeof(err)) !=
        PSHARD_OK) {
        fprintf(stderr, "pshard-bench-coord: %s (see --help)\n", err);
        exit_code = 2;
        goto out;
    }
    if (res.help) {
        ps_config_usage(stdout, "pshard-bench-coord", "[OPTIONS]",
                        "Measures coordinator heartbeat throughput and latency: K simulated "
                        "members heartbeat against one coordinator, in a closed loop or at "
                        "--rate; prints heartbeats/s and p50/p99/max latency per K.",
                        options, PS_ARRAY_LEN(options));
        goto out;
    }
    if (res.version) {
        printf("pshard-bench-coord %s\n", PSHARD_VERSION_STRING);
        goto out;
    }
    if (res.first_positional < argc) {
        fprintf(stderr, "pshard-bench-coord: unexpected argument '%s' (see --help)\n",
                argv[res.first_positional]);
        exit_code = 2;
        goto out;
    }
    ps_log_level_t level;
    if (!ps_log_parse_level(o.log, &level)) {
        fprintf(stderr, "pshard-bench-coord: --log '%s' is not error|warn|info|debug|trace\n",
                o.log);
        exit_code = 2;
        goto out;
    }
    ps_log_set_level(level);
    nk = parse_k_list(o.k_list, ks, MAX_ROUNDS, err, sizeof(err));
    if (nk < 0) {
        fprintf(stderr, "pshard-bench-coord: %s\n", err);
        exit_code = 2;
        goto out;
    }
    if (o.target && o.in_process) {
        fprintf(stderr, "pshard-bench-coord: --target and --in-process exclude each other\n");
        exit_code = 2;
        goto out;
    }
    ps_config_log(options, PS_ARRAY_LEN(options), &o, &res);

    /* Spawn before this process has any gRPC threads, so fork() copies a single thread. */
    if (coord_start(&co, &o, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "pshard-bench-coord: %s\n", err);
        exit_code = 1;
        goto out;
    }

    grpc_init();
    grpc_up = true;
    g_path_register = grpc_slice_from_static_string("/pshard.Coordinator/Register");
    g_path_heartbeat = grpc_slice_from_static_string("/pshard.Coordinator/Heartbeat");
    g_path_leave = grpc_slice_from_static_string("/pshard.Coordinator/Leave");
    nclients = (size_t)o.threads;
    clients = calloc(nclients, sizeof(*clients));
    if (!clients) {
        fprintf(stderr, "pshard-bench-coord: out of memory\n");
        exit_code = 1;
        goto out;
    }
    for (size_t t = 0; t < nclients; t++) {
        client_t *cl = &clients[t];
        cl->opts = &o;
        cl->cq = grpc_completion_queue_create_for_next(NULL);
        cl->channels = calloc((size_t)o.channels, sizeof(*cl->channels));
        if (!cl->channels) {
            fprintf(stderr, "pshard-bench-coord: out of memory\n");
            exit_code = 1;
            goto out;
        }
        for (size_t c = 0; c < (size_t)o.channels; c++) {
            cl->channels[c] = make_channel(co.target);
            if (!cl->channels[c]) {
                fprintf(stderr, "pshard-bench-coord: cannot create a channel to %s\n", co.target);
                exit_code = 1;
                goto out;
            }
            cl->nchannels++;
        }
    }

    char load[96];
    if (o.rate > 0)
        snprintf(load, sizeof(load), "open loop at %lld heartbeats/s offered", (long long)o.rate);
    else
        snprintf(load, sizeof(load), "closed loop (K calls always in flight)");
    printf("# pshard-bench-coord: coordinator %s (%s); %s; %lld client thread(s) x %lld "
           "channel(s); warmup %lld ms, window %lld s; %ld CPUs online\n",
           co.target,
           o.target       ? "given target"
           : o.in_process ? "in-process"
                          : co.bin,
           load, (long long)o.threads, (long long)o.channels, (long long)o.warmup_ms,
           (long long)o.seconds, sysconf(_SC_NPROCESSORS_ONLN));
    printf("%6s %9s %8s %13s %8s %8s %8s %7s\n", "K", "calls", "seconds", "heartbeats/s", "p50_ms",
           "p99_ms", "max_ms", "errors");
    fflush(stdout);
    round_result_t results[MAX_ROUNDS];
    for (int i = 0; i < nk; i++) {
        round_result_t *r = &results[i];
        run_round(clients, nclients, ks[i], &o, &co, r);
        printf("%6zu %9llu %8.2f %13.0f %8.3f %8.3f %8.3f %7llu\n", ks[i],
               (unsigned long long)r->calls, r->seconds, r->rate, r->p50_ms, r->p99_ms, r->max_ms,
               (unsigned long long)r->errors);
        fflush(stdout);
        if (r->errors)
            fprintf(stderr, "pshard-bench-coord: K=%zu: %llu failed call(s); first: %s\n", ks[i],
                    (unsigned long long)r->errors, r->first_error);
        if (r->late_slots)
            fprintf(stderr,
                    "pshard-bench-coord: K=%zu: %llu heartbeat slot(s) dropped: the member was "
                    "still waiting for a reply (offered rate not sustained)\n",
                    ks[i], (unsigned long long)r->late_slots);
        if (r->lost_samples)
            fprintf(stderr, "pshard-bench-coord: K=%zu: %llu latency samples lost (no memory)\n",
                    ks[i], (unsigned long long)r->lost_samples);
        if (r->errors || r->calls == 0)
            exit_code = 1;
    }
    /* Where the time went: cores busy during each window (the machine has this many CPUs). */
    for (int i = 0; i < nk; i++) {
        const round_result_t *r = &results[i];
        if (r->coord_cpu >= 0)
            printf("# K=%zu: register %.0f ms; CPU during window: bench %.2f cores, coordinator "
                   "%.2f cores\n",
                   ks[i], r->register_ms, r->client_cpu, r->coord_cpu);
        else
            printf("# K=%zu: register %.0f ms; CPU during window: this process %.2f cores\n", ks[i],
                   r->register_ms, r->client_cpu);
    }
    fflush(stdout);

out:
    if (clients) {
        for (size_t t = 0; t < nclients; t++) {
            client_t *cl = &clients[t];
            for (size_t c = 0; c < cl->nchannels; c++)
                grpc_channel_destroy(cl->channels[c]);
            free(cl->channels);
            if (cl->cq) {
                grpc_completion_queue_shutdown(cl->cq);
                while (grpc_completion_queue_next(cl->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL)
                           .type != GRPC_QUEUE_SHUTDOWN) {
                }
                grpc_completion_queue_destroy(cl->cq);
            }
            free(cl->lat_ns);
        }
        free(clients);
    }
    if (grpc_up)
        grpc_shutdown();
    if (!coord_stop(&co) && exit_code == 0)
        exit_code = 1;
    ps_config_free(options, PS_ARRAY_LEN(options), &o);
    return exit_code;
}
