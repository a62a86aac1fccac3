/* pshardrun: the torchrun of pshard. It starts a coordinator (unless one is named), N shard
 * servers and N trainers on this host, forwards every child's output line by line with a
 * "[role rank]" prefix, forwards SIGINT/SIGTERM/SIGHUP, and stops everything it started when
 * the trainers are done or the first of them fails. When a process fails, exactly one line on
 * stderr names the first to fail: "pshardrun: first failure: trainer 2 (pid 1234) exited with
 * status 1" (or "shard server 1 ... killed by signal 9", "coordinator ...").
 *
 * With --max-restarts, a trainer that fails while the coordinator and every shard server still
 * run is replaced alone (the servers hold the state, so nobody else restarts), and its line
 * says so instead: "pshardrun: trainer 2 exited with status 1; replacing it (restart 1 of 3);
 * ...". Any other failure stops everything and starts it again from the newest checkpoint.
 *
 * Exit status: 0 when every rank's last trainer exited 0; the failing trainer's exit status (or
 * 128+N when it was killed by signal N); 128+N when pshardrun itself got signal N; 1 when a
 * shard server or the coordinator died unexpectedly or could not be started; 2 for usage
 * errors. Trainers run with stdin from /dev/null. */
#include <dirent.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pshard/config.h"
#include "pshard/coord_client.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/shm_names.h"
#include "pshard/util.h"

#define RUN_PROG "pshardrun"
#define RUN_COORD_BIN "pshard-coordinator"
#define RUN_SERVER_BIN "pshard-server"

/* Longest line forwarded as one piece; a longer run of bytes without a newline is forwarded
 * in pieces of this size so one chatty child cannot make pshardrun grow without bound. */
#define RUN_MAX_LINE 65536
/* How often port files are looked for while waiting for servers to come up. */
#define RUN_PORT_POLL_MS 20
/* After SIGKILL, how long to wait for the kernel to let us reap before giving up. */
#define RUN_REAP_AFTER_KILL_MS 5000
/* How long to keep reading pipes after every child is gone (grandchildren may hold them). */
#define RUN_DRAIN_MS 2000
/* Multi-node: the coordinator store key under which node 0 publishes torch's MASTER_ADDR:PORT
 * of an attempt, and the least time the other nodes wait for it (torch's store timeout). */
#define RUN_TORCH_MASTER_KEY "pshardrun/master_port/"
#define RUN_TORCH_MASTER_WAIT_MS 300000

/* Options: one table, which also makes --help. */
typedef struct {
    int64_t nproc;
    char *coordinator;
    char *backend;
    char *offload;
    char *token_file;
    int64_t lease_ms;
    char *log;
    char *coordinator_bin;
    char *server_bin;
    int64_t start_timeout_ms;
    int64_t stop_grace_ms;
    char *checkpoint_dir;
    int64_t checkpoint_every;
    int64_t checkpoint_keep;
    char *resume;
    bool resume_allow_fresh;
    int64_t max_restarts;
    int64_t replace_timeout_ms;
    char *rdzv_id;
    int64_t nnodes;
    int64_t node_rank;
    int64_t nproc_per_node;
    char *rdzv_endpoint;
} run_opts_t;

/* clang-format off */
#define OPT(flag, env, type, def, help, field, lo, hi)                                             \
    {flag, env, type, def, help, offsetof(run_opts_t, field), lo, hi}
/* clang-format on */

static const ps_option_t options[] = {
    OPT("nproc", "PSHARD_NPROC", PS_OPT_INT, "1", "number of shard servers and trainers to start",
        nproc, 1, 4096),
    OPT("nproc-per-node", "PSHARD_NPROC_PER_NODE", PS_OPT_INT, "0",
        "torchrun's name for --nproc: shard servers and trainers on this node", nproc_per_node, 0,
        4096),
    OPT("nnodes", "PSHARD_NNODES", PS_OPT_INT, "1",
        "nodes of the job, each running its own pshardrun with --node-rank (a fixed number, "
        "not torchrun's MIN:MAX)",
        nnodes, 1, 4096),
    OPT("node-rank", "PSHARD_NODE_RANK", PS_OPT_INT, "0",
        "this node's rank, 0..NNODES-1: its trainers get RANK = node rank * NPROC + LOCAL_RANK",
        node_rank, 0, 4095),
    OPT("rdzv-endpoint", "PSHARD_RDZV_ENDPOINT", PS_OPT_STRING, NULL,
        "with --nnodes > 1: HOST:PORT of the job's coordinator; node rank 0 starts it listening "
        "there (port 0: a free one, printed as 'coordinator for N nodes on HOST:PORT'), the "
        "other nodes use it (torchrun's --rdzv-endpoint)",
        rdzv_endpoint, 0, 0),
    OPT("coordinator", "PSHARD_COORDINATOR", PS_OPT_STRING, NULL,
        "use this coordinator HOST:PORT instead of starting one on 127.0.0.1", coordinator, 0, 0),
    OPT("backend", "PSHARD_BACKEND", PS_OPT_STRING, "tcp", "collectives backend: tcp or nccl",
        backend, 0, 0),
    OPT("offload", "PSHARD_OFFLOAD", PS_OPT_STRING, "none", "where shards live: none or cpu",
        offload, 0, 0),
    OPT("token-file", "PSHARD_TOKEN_FILE", PS_OPT_STRING, NULL,
        "cluster token file, passed to the coordinator, servers and trainers", token_file, 0, 0),
    OPT("lease-ms", "PSHARD_LEASE_MS", PS_OPT_INT, "0",
        "member lease of the coordinator pshardrun starts (0: its default)", lease_ms, 0, 86400000),
    OPT("log", "PSHARD_LOG", PS_OPT_STRING, "warn",
        "log level of pshardrun and its children: error|warn|info|debug|trace", log, 0, 0),
    OPT("coordinator-bin", "PSHARD_COORDINATOR_BIN", PS_OPT_STRING, NULL,
        "path of pshard-coordinator (default: beside pshardrun, then PATH)", coordinator_bin, 0, 0),
    OPT("server-bin", "PSHARD_SERVER_BIN", PS_OPT_STRING, NULL,
        "path of pshard-server (default: beside pshardrun, then PATH)", server_bin, 0, 0),
    OPT("start-timeout-ms", "PSHARD_START_TIMEOUT_MS", PS_OPT_INT, "30000",
        "give up if the coordinator or a server has not written its port file by then",
        start_timeout_ms, 1, 86400000),
    OPT("stop-grace-ms", "PSHARD_STOP_GRACE_MS", PS_OPT_INT, "5000",
        "after SIGTERM, wait this long before SIGKILL", stop_grace_ms, 0, 3600000),
    OPT("checkpoint-dir", "PSHARD_CHECKPOINT_DIR", PS_OPT_STRING, NULL,
        "checkpoint root of the shard servers (default: --resume's)", checkpoint_dir, 0, 0),
    OPT("checkpoint-every", "PSHARD_CHECKPOINT_EVERY", PS_OPT_INT, "0",
        "save a checkpoint after every Kth optimizer step (0: only when asked)", checkpoint_every,
        0, INT64_MAX),
    OPT("checkpoint-keep", "PSHARD_CHECKPOINT_KEEP", PS_OPT_INT, "3",
        "committed checkpoints kept, newest first", checkpoint_keep, 1, 1000000),
    OPT("resume", "PSHARD_RESUME", PS_OPT_STRING, NULL,
        "restart from the newest committed checkpoint under this root (any world size)", resume, 0,
        0),
    OPT("resume-allow-fresh", "PSHARD_RESUME_ALLOW_FRESH", PS_OPT_BOOL, "false",
        "when every checkpoint under the root is refused (corrupt, a link, another step), "
        "start from the initial values with a warning instead of failing",
        resume_allow_fresh, 0, 0),
    OPT("rdzv-id", "PSHARD_JOB", PS_OPT_STRING, NULL,
        "job id on the coordinator (torchrun's --rdzv-id): this job's members, ranks and store "
        "keys are its own, so jobs sharing a --coordinator never meet (default: a fresh id per "
        "run with --coordinator, the coordinator's default job without)",
        rdzv_id, 0, 0),
    OPT("max-restarts", "PSHARD_MAX_RESTARTS", PS_OPT_INT, "0",
        "restarts allowed in all (torchrun's --max-restarts): a trainer that fails while the "
        "coordinator and every shard server run is replaced alone (see --replace-timeout-ms); "
        "any other failure stops everything and starts it again, resuming from the newest "
        "checkpoint under --checkpoint-dir (or --resume) when there is one; trainers see the "
        "restarts so far in PSHARD_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT",
        max_restarts, 0, 1000000),
    OPT("replace-timeout-ms", "PSHARD_REPLACE_TIMEOUT_MS", PS_OPT_INT, "60000",
        "with --max-restarts: the shard servers keep a failed trainer's state this long while "
        "its replacement starts (pshard-server --trainer-replace-ms); 0: no replacement, any "
        "failure restarts everything",
        replace_timeout_ms, 0, 86400000),
};

/* One environment variable set in a trainer; both strings borrowed. */
typedef struct {
    const char *name;
    const char *value;
} run_env_t;

typedef enum { ROLE_COORDINATOR, ROLE_SERVER, ROLE_TRAINER } run_role_t;

static const char *const role_names[] = {"coordinator", "server", "trainer"};
/* How the first-failure line names each role. */
static const char *const role_long_names[] = {"coordinator", "shard server", "trainer"};

/* One pipe from a child's stdout or stderr, with the bytes of a line not yet complete. */
typedef struct {
    int fd;     /* read end (non-blocking, close-on-exec); -1 after EOF */
    int out_fd; /* where lines go: 1 or 2 */
    char *buf;  /* pending bytes of an incomplete line; owned */
    size_t len; /* bytes in buf */
} run_stream_t;

typedef struct {
    run_role_t role;
    int rank;                 /* -1 for the coordinator */
    char label[32];           /* "trainer 3", "coordinator": used in messages */
    char who[40];             /* "trainer 3", "shard server 3": the first-failure line */
    char prefix[40];          /* "[trainer 3] ": put in front of each forwarded line */
    char port_file[PATH_MAX]; /* servers and coordinator: where the bound port appears */
    int port;                 /* from the port file once read; 0 before */
    pid_t pid;                /* 0 until started; also the id of its process group */
    bool reaped;              /* waitpid returned its status */
    int wait_status;          /* valid when reaped */
    bool signalled;           /* pshardrun asked it to stop, so its exit is expected */
    bool unjudged;            /* a trainer that failed: replace it or stop? (run_judge_trainers) */
    bool replace;             /* a trainer that failed, to be replaced (run_replace_trainers) */
    int64_t replace_restarts; /* with replace: what its replacement gets as the restart count */
    run_stream_t streams[2];  /* stdout, stderr */
} run_child_t;

typedef enum {
    STOP_NONE = 0,
    STOP_DONE,           /* every trainer exited 0 */
    STOP_TRAINER_FAILED, /* a trainer exited non-zero or was killed */
    STOP_SERVICE_DIED,   /* a server or the coordinator exited on its own */
    STOP_SIGNAL,         /* pshardrun got SIGINT/SIGTERM/SIGHUP */
    STOP_STARTUP,        /* something could not be started in time */
} run_stop_t;

/* Everything one run owns. Single-threaded: only main() touches it. */
typedef struct {
    run_opts_t *opts;
    run_child_t *children; /* coordinator (if started), servers, trainers */
    size_t nchildren;
    run_child_t *coord;        /* NULL when --coordinator names an existing one */
    run_child_t *servers;      /* nproc entries */
    run_child_t *trainers;     /* nproc entries */
    struct pollfd *pfds;       /* 1 + 2 * nchildren: the signalfd, then open streams */
    run_child_t **pfd_child;   /* for pfds[i], i >= 1: whose stream it is */
    run_stream_t **pfd_stream; /* for pfds[i], i >= 1: which stream */
    int sigfd;                 /* signalfd for SIGINT, SIGTERM, SIGHUP, SIGCHLD */
    sigset_t orig_mask;        /* restored in children */
    struct sigaction orig_sigpipe;
    run_stop_t stop; /* why we are stopping (first reason wins) */
    int stop_signal; /* for STOP_SIGNAL */
    int exit_code;   /* decided together with stop */
    bool force_kill; /* a second signal arrived: SIGKILL without grace */
    char tmpdir[PATH_MAX];
    int64_t attempt;       /* restarts so far: replacements and full restarts together */
    const char *resume;    /* what the servers get as --resume in this attempt, or NULL */
    char coord_addr[300];  /* HOST:PORT trainers and servers use */
    char job[72];          /* the job id servers get (--job), or "" for the default job */
    char master_addr[256]; /* the coordinator's host and port, as given or bound */
    int master_port;
    char torch_addr[256];  /* what trainers get as MASTER_ADDR / MASTER_PORT: where rank 0's */
    int torch_port;        /* torch TCPStore listens (env://), picked for each attempt */
    int node_rank, nnodes; /* multi-node: this node among nnodes (0 of 1 otherwise) */
    bool endpoint;         /* --rdzv-endpoint: node 0's coordinator listens on coord_addr */
    char data_host[64];    /* multi-node: the address servers' rings listen on ("": default) */
} run_t;

/* ---------------------------------------------------------------------------------------- */
/* Output forwarding                                                                        */

/* Writes all of buf to fd, retrying short writes and EINTR. Errors (a closed terminal or
 * pipe) drop the output; children keep running and their pipes keep being drained. */
static void run_write_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return;
        }
        buf += n;
        len -= (size_t)n;
    }
}

/* Forwards one line (without its newline) with the child's prefix, in one write. */
static void run_emit_line(const run_child_t *c, int out_fd, const char *line, size_t len)
{
    static char out[sizeof(((run_child_t *)0)->prefix) + RUN_MAX_LINE + 1];
    size_t plen = strlen(c->prefix);
    memcpy(out, c->prefix, plen);
    memcpy(out + plen, line, len);
    out[plen + len] = '\n';
    run_write_all(out_fd, out, plen + len + 1);
}

/* Forwards every complete line in the stream's buffer; with flush, also what is left (a
 * partial line at EOF). */
static void run_stream_emit(const run_child_t *c, run_stream_t *s, bool flush)
{
    size_t start = 0;
    for (size_t i = 0; i < s->len; i++) {
        if (s->buf[i] == '\n') {
            run_emit_line(c, s->out_fd, s->buf + start, i - start);
            start = i + 1;
        }
    }
    if (s->len - start == RUN_MAX_LINE || (flush && s->len > start)) {
        run_emit_line(c, s->out_fd, s->buf + start, s->len - start);
        start = s->len;
    }
    memmove(s->buf, s->buf + start, s->len - start);
    s->len -= start;
}

static void run_stream_close(const run_child_t *c, run_stream_t *s)
{
    if (s->fd < 0)
        return;
    run_stream_emit(c, s, true);
    close(s->fd);
    s->fd = -1;
}

/* Reads what the pipe has now (a bounded amount, so one chatty child cannot starve the
 * others) and forwards complete lines; closes the stream at EOF. */
static void run_stream_read(const run_child_t *c, run_stream_t *s)
{
    for (int round = 0; round < 16; round++) {
        if (!s->buf) {
            s->buf = malloc(RUN_MAX_LINE);
            if (!s->buf) {
                /* Without a buffer the output cannot be forwarded; stop reading rather than
                 * spin, and the child gets SIGPIPE or EPIPE on its next write. */
                close(s->fd);
                s->fd = -1;
                return;
            }
        }
        ssize_t n = read(s->fd, s->buf + s->len, RUN_MAX_LINE - s->len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return;
            run_stream_close(c, s);
            return;
        }
        if (n == 0) {
            run_stream_close(c, s);
            return;
        }
        s->len += (size_t)n;
        run_stream_emit(c, s, false);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Children                                                                                 */

static void run_child_init(run_child_t *c, run_role_t role, int rank)
{
    memset(c, 0, sizeof(*c));
    c->role = role;
    c->rank = rank;
    if (role == ROLE_COORDINATOR) {
        ps_snprintf(c->label, sizeof(c->label), "%s", role_names[role]);
        ps_snprintf(c->who, sizeof(c->who), "%s", role_long_names[role]);
        ps_snprintf(c->prefix, sizeof(c->prefix), "[%s] ", role_names[role]);
    } else {
        ps_snprintf(c->label, sizeof(c->label), "%s %d", role_names[role], rank);
        ps_snprintf(c->who, sizeof(c->who), "%s %d", role_long_names[role], rank);
        ps_snprintf(c->prefix, sizeof(c->prefix), "[%s %d] ", role_names[role], rank);
    }
    for (int k = 0; k < 2; k++) {
        c->streams[k].fd = -1;
        c->streams[k].out_fd = k + 1;
    }
}

/* True while the child or anything left in its process group may still be running. */
static bool run_child_alive(const run_child_t *c)
{
    if (c->pid <= 0)
        return false;
    if (!c->reaped)
        return true;
    return kill(-c->pid, 0) == 0;
}

/* Sends sig to the child's process group (which catches the shell's children too), or to the
 * child itself if it moved out of its group. */
static void run_child_signal(run_child_t *c, int sig)
{
    if (c->pid <= 0)
        return;
    c->signalled = true;
    if (kill(-c->pid, sig) != 0 && !c->reaped)
        kill(c->pid, sig);
}

/* Names the signals pshardrun sends or handles; others by number. The result is either a
 * literal or buf. */
static const char *run_signame(int sig, char *buf, size_t len)
{
    switch (sig) {
    case SIGINT:
        return "SIGINT";
    case SIGTERM:
        return "SIGTERM";
    case SIGHUP:
        return "SIGHUP";
    case SIGKILL:
        return "SIGKILL";
    default:
        ps_snprintf(buf, len, "signal %d", sig);
        return buf;
    }
}

/* Describes a wait status: "exited with status 3" or "killed by signal 9", with the signal's
 * description ("killed by signal 9 (Killed)") when signal_text is true. The first-failure
 * line leaves it out so that its form stays fixed for scripts. */
static void run_describe_status(int status, bool signal_text, char *buf, size_t len)
{
    if (WIFEXITED(status))
        ps_snprintf(buf, len, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status) && signal_text)
        ps_snprintf(buf, len, "killed by signal %d (%s)", WTERMSIG(status),
                    strsignal(WTERMSIG(status)));
    else if (WIFSIGNALED(status))
        ps_snprintf(buf, len, "killed by signal %d", WTERMSIG(status));
    else
        ps_snprintf(buf, len, "ended with wait status 0x%x", (unsigned)status);
}

/* Prints the one line that names the first process to fail. Called only where the stop
 * reason is first set, so it prints at most once per run. */
static void run_report_first_failure(const run_child_t *c, const char *what)
{
    fprintf(stderr, RUN_PROG ": first failure: %s (pid %d) %s\n", c->who, (int)c->pid, what);
}

/* Records the first reason to stop; later reasons are ignored. */
static void run_set_stop(run_t *run, run_stop_t why, int exit_code)
{
    if (run->stop != STOP_NONE)
        return;
    run->stop = why;
    run->exit_code = exit_code;
}

/* Forwards what the child's pipes hold now: a failed child's last words (often the reason)
 * come before the line about it. */
static void run_child_read_now(run_child_t *c)
{
    for (int k = 0; k < 2; k++) {
        if (c->streams[k].fd >= 0)
            run_stream_read(c, &c->streams[k]);
    }
}

/* Takes note of one reaped child: a service that died on its own is the first failure unless
 * something else already is; a failed trainer is judged once every child that ended by now is
 * reaped (run_judge_trainers), so that a server lost at the same time is seen first. */
static void run_on_exit(run_t *run, run_child_t *c, int status)
{
    c->reaped = true;
    c->wait_status = status;
    char what[96];
    run_describe_status(status, true, what, sizeof(what));
    PS_INFO(PS_SUB_MAIN, "%s (pid %d) %s", c->label, (int)c->pid, what);
    if (run->stop != STOP_NONE)
        return;
    if (c->role == ROLE_TRAINER) {
        c->unjudged = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        return;
    }
    if (!c->signalled) {
        run_child_read_now(c);
        char failure[96];
        run_describe_status(status, false, failure, sizeof(failure));
        run_report_first_failure(c, failure);
        run_set_stop(run, STOP_SERVICE_DIED, 1);
    }
}

/* True when a failed trainer can be replaced alone: replacement is on, a restart is left, and
 * every service pshardrun started still runs (their state is what the replacement needs). */
static bool run_can_replace(const run_t *run)
{
    const run_opts_t *o = run->opts;
    if (o->max_restarts == 0 || o->replace_timeout_ms == 0 || run->attempt >= o->max_restarts)
        return false;
    if (run->coord && run->coord->reaped)
        return false;
    for (int r = 0; r < (int)o->nproc; r++) {
        if (run->servers[r].reaped)
            return false;
    }
    return true;
}

/* Decides for each trainer that failed since the last call: replace it alone (one restart
 * used, one line saying so; run_replace_trainers starts the replacement), or, when that is not
 * possible, stop the run as the first failure. Does nothing but forget them when the run is
 * already stopping, e.g. because a server ended in the same round of reaping. */
static void run_judge_trainers(run_t *run)
{
    for (int r = 0; r < (int)run->opts->nproc; r++) {
        run_child_t *c = &run->trainers[r];
        if (!c->unjudged)
            continue;
        c->unjudged = false;
        if (run->stop != STOP_NONE)
            continue;
        run_child_read_now(c);
        char failure[96];
        run_describe_status(c->wait_status, false, failure, sizeof(failure));
        if (run_can_replace(run)) {
            c->replace = true;
            c->replace_restarts = ++run->attempt;
            fprintf(stderr,
                    RUN_PROG ": %s %s; replacing it (restart %lld of %lld); the other ranks "
                             "and the shard servers keep running\n",
                    c->label, failure, (long long)run->attempt, (long long)run->opts->max_restarts);
            continue;
        }
        int status = c->wait_status;
        run_report_first_failure(c, failure);
        run_set_stop(run, STOP_TRAINER_FAILED,
                     WIFEXITED(status)     ? WEXITSTATUS(status)
                     : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                           : 1);
    }
}

/* Reaps every child that has ended, ours or orphans handed to us as subreaper, then judges
 * the trainers that failed. */
static void run_reap(run_t *run)
{
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) {
            if (pid < 0 && errno == EINTR)
                continue;
            break;
        }
        run_child_t *c = NULL;
        for (size_t i = 0; i < run->nchildren; i++) {
            if (run->children[i].pid == pid && !run->children[i].reaped) {
                c = &run->children[i];
                break;
            }
        }
        if (c)
            run_on_exit(run, c, status);
        else
            PS_DEBUG(PS_SUB_MAIN, "reaped orphaned descendant pid %d", (int)pid);
    }
    run_judge_trainers(run);
}

/* What a signal to pshardrun does: the first one stops the run (forwarding it to the
 * trainers); the next one while stopping skips the grace periods. */
static void run_on_signal(run_t *run, int sig)
{
    char name[32];
    if (run->stop == STOP_NONE) {
        fprintf(stderr, RUN_PROG ": got %s; stopping trainers, servers and coordinator\n",
                run_signame(sig, name, sizeof(name)));
        run->stop_signal = sig;
        run_set_stop(run, STOP_SIGNAL, 128 + sig);
        return;
    }
    if (!run->force_kill) {
        fprintf(stderr, RUN_PROG ": got %s while stopping; killing everything now\n",
                run_signame(sig, name, sizeof(name)));
        run->force_kill = true;
    }
}

/* Waits up to deadline_ns (monotonic) for output, signals or exits, and handles what came.
 * Returns early after any event. */
static void run_pump(run_t *run, int64_t deadline_ns)
{
    nfds_t n = 0;
    run->pfds[n++] = (struct pollfd){.fd = run->sigfd, .events = POLLIN};
    for (size_t i = 0; i < run->nchildren; i++) {
        for (int k = 0; k < 2; k++) {
            run_stream_t *s = &run->children[i].streams[k];
            if (s->fd < 0)
                continue;
            run->pfd_child[n] = &run->children[i];
            run->pfd_stream[n] = s;
            run->pfds[n++] = (struct pollfd){.fd = s->fd, .events = POLLIN};
        }
    }
    int64_t wait_ms = (deadline_ns - ps_now_ns()) / 1000000;
    if (wait_ms < 0)
        wait_ms = 0;
    if (wait_ms > 1000)
        wait_ms = 1000; /* reaping does not depend on SIGCHLD alone */
    int rc = poll(run->pfds, n, (int)wait_ms);
    if (rc > 0) {
        if (run->pfds[0].revents) {
            struct signalfd_siginfo si;
            while (read(run->sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
                if (si.ssi_signo != SIGCHLD)
                    run_on_signal(run, (int)si.ssi_signo);
            }
        }
        for (nfds_t j = 1; j < n; j++) {
            if (run->pfds[j].revents && run->pfd_stream[j]->fd >= 0)
                run_stream_read(run->pfd_child[j], run->pfd_stream[j]);
        }
    }
    run_reap(run);
}

/* Starts one child with its stdout and stderr on new pipes, in its own process group, with
 * stdin from /dev/null. `path` is executed as is (execv) for services and looked up on PATH
 * (execvp) for trainers. `env` (nenv entries, may be NULL) is set in the child only.
 * A child that cannot exec prints why on its stderr and exits 127, which the normal exit
 * handling reports. Returns 0, or -1 with a message printed when fork or pipe fail. */
static int run_spawn(run_t *run, run_child_t *c, const char *path, char *const argv[],
                     const run_env_t *env, size_t nenv)
{
    int fds[2][2] = {{-1, -1}, {-1, -1}};
    for (int k = 0; k < 2; k++) {
        if (pipe2(fds[k], O_CLOEXEC) != 0) {
            fprintf(stderr, RUN_PROG ": cannot create a pipe for %s: %s\n", c->label,
                    strerror(errno));
            goto fail;
        }
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, RUN_PROG ": cannot fork %s: %s\n", c->label, strerror(errno));
        goto fail;
    }
    if (pid == 0) {
        /* Child. pshardrun is single-threaded, so the libc calls below are safe after fork. */
        setpgid(0, 0);
        /* If pshardrun is killed outright, the child is told to stop too. */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)
            _exit(1);
        sigaction(SIGPIPE, &run->orig_sigpipe, NULL);
        sigprocmask(SIG_SETMASK, &run->orig_mask, NULL);
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0 && devnull != 0) {
            dup2(devnull, 0);
            close(devnull);
        }
        if (dup2(fds[0][1], 1) < 0 || dup2(fds[1][1], 2) < 0)
            _exit(127);
        for (size_t i = 0; i < nenv; i++)
            setenv(env[i].name, env[i].value, 1);
        if (c->role == ROLE_TRAINER)
            execvp(path, argv);
        else
            execv(path, argv);
        dprintf(2, RUN_PROG ": cannot execute '%s': %s\n", path, strerror(errno));
        _exit(127);
    }
    /* Parent: make the group now too, so a signal sent before the child runs finds it. */
    setpgid(pid, pid);
    c->pid = pid;
    for (int k = 0; k < 2; k++) {
        close(fds[k][1]);
        c->streams[k].fd = fds[k][0];
        fcntl(fds[k][0], F_SETFL, fcntl(fds[k][0], F_GETFL) | O_NONBLOCK);
    }
    PS_INFO(PS_SUB_MAIN, "started %s (pid %d): %s", c->label, (int)pid, path);
    return 0;
fail:
    for (int k = 0; k < 2; k++) {
        for (int e = 0; e < 2; e++) {
            if (fds[k][e] >= 0)
                close(fds[k][e]);
        }
    }
    return -1;
}

/* Reads a port file if it is there (it is written with a rename, so whole or absent).
 * Returns the port, or 0 when it is not there yet or does not hold a port. */
static int run_read_port_file(const char *path)
{
    char buf[32];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    buf[strcspn(buf, "\r\n ")] = '\0';
    int64_t port;
    if (ps_parse_i64(buf, 1, 65535, &port) != 0)
        return 0;
    return (int)port;
}

/* Waits until every child in [first, first+count) has written its port file, the run is
 * stopping, or the start timeout passes (which stops the run with a message). */
static void run_wait_ports(run_t *run, run_child_t *first, size_t count)
{
    int64_t deadline = ps_now_ns() + run->opts->start_timeout_ms * 1000000;
    for (;;) {
        if (run->stop != STOP_NONE)
            return;
        run_child_t *missing = NULL;
        for (size_t i = 0; i < count; i++) {
            if (first[i].port == 0)
                first[i].port = run_read_port_file(first[i].port_file);
            if (first[i].port == 0 && !missing)
                missing = &first[i];
        }
        if (!missing)
            return;
        int64_t now = ps_now_ns();
        if (now >= deadline) {
            char what[96];
            ps_snprintf(what, sizeof(what), "did not write its port file within %lld ms",
                        (long long)run->opts->start_timeout_ms);
            run_report_first_failure(missing, what);
            run_set_stop(run, STOP_STARTUP, 1);
            return;
        }
        int64_t next = now + (int64_t)RUN_PORT_POLL_MS * 1000000;
        run_pump(run, next < deadline ? next : deadline);
    }
}

/* Stops every child of one role that is still running, or only the child `only` when it is
 * not NULL: sends sig to its process group, waits up to the grace period, then SIGKILLs what is
 * left and waits for it to be reaped. */
static void run_stop_role(run_t *run, run_role_t role, const run_child_t *only, int sig)
{
    char name[32];
    const char *signame = run_signame(sig, name, sizeof(name));
    bool any = false;
    for (size_t i = 0; i < run->nchildren; i++) {
        run_child_t *c = &run->children[i];
        if (only && c != only)
            continue;
        if (c->role == role && run_child_alive(c)) {
            PS_DEBUG(PS_SUB_MAIN, "sending %s to %s (pid %d)", signame, c->label, (int)c->pid);
            run_child_signal(c, sig);
            any = true;
        }
    }
    if (!any)
        return;
    int64_t deadline = ps_now_ns() + run->opts->stop_grace_ms * 1000000;
    bool killed = false;
    for (;;) {
        bool alive = false;
        for (size_t i = 0; i < run->nchildren && !alive; i++)
            alive = (!only || &run->children[i] == only) && run->children[i].role == role &&
                    run_child_alive(&run->children[i]);
        if (!alive)
            return;
        int64_t now = ps_now_ns();
        if (!killed && (run->force_kill || now >= deadline)) {
            for (size_t i = 0; i < run->nchildren; i++) {
                run_child_t *c = &run->children[i];
                if (only && c != only)
                    continue;
                if (c->role == role && run_child_alive(c)) {
                    if (!run->force_kill)
                        fprintf(stderr,
                                RUN_PROG ": %s%s (pid %d) still running %lld ms after %s; "
                                         "sending SIGKILL\n",
                                c->reaped ? "processes left behind by " : "", c->label, (int)c->pid,
                                (long long)run->opts->stop_grace_ms, signame);
                    run_child_signal(c, SIGKILL);
                }
            }
            killed = true;
            deadline = now + (int64_t)RUN_REAP_AFTER_KILL_MS * 1000000;
        } else if (killed && now >= deadline) {
            fprintf(stderr, RUN_PROG ": some %s processes did not end after SIGKILL\n",
                    role_names[role]);
            return;
        }
        int64_t next = now + 50 * 1000000LL;
        run_pump(run, next < deadline ? next : deadline);
    }
}

/* Kills and reaps whatever descendants are left that escaped their process groups (they were
 * handed to pshardrun, the subreaper, when their parents ended). Bounded in time. */
static void run_sweep(run_t *run)
{
    char path[64];
    ps_snprintf(path, sizeof(path), "/proc/self/task/%d/children", (int)getpid());
    int64_t deadline = ps_now_ns() + (int64_t)RUN_REAP_AFTER_KILL_MS * 1000000;
    for (;;) {
        run_reap(run);
        FILE *f = fopen(path, "re");
        bool any = false;
        if (f) {
            long pid;
            while (fscanf(f, "%ld", &pid) == 1) {
                PS_DEBUG(PS_SUB_MAIN, "killing leftover descendant pid %ld", pid);
                kill((pid_t)pid, SIGKILL);
                any = true;
            }
            fclose(f);
        } else {
            /* No /proc children list: wait for what waitpid still knows about. */
            any = waitpid(-1, NULL, WNOHANG) == 0;
        }
        if (!any || ps_now_ns() >= deadline)
            return;
        run_pump(run, ps_now_ns() + 20 * 1000000LL);
    }
}

/* Forwards what is still buffered in the pipes (bounded in time), then closes them. */
static void run_drain(run_t *run)
{
    int64_t deadline = ps_now_ns() + (int64_t)RUN_DRAIN_MS * 1000000;
    for (;;) {
        bool open_any = false;
        for (size_t i = 0; i < run->nchildren && !open_any; i++)
            open_any = run->children[i].streams[0].fd >= 0 || run->children[i].streams[1].fd >= 0;
        if (!open_any || ps_now_ns() >= deadline)
            break;
        run_pump(run, deadline);
    }
    for (size_t i = 0; i < run->nchildren; i++) {
        for (int k = 0; k < 2; k++) {
            run_stream_close(&run->children[i], &run->children[i].streams[k]);
            free(run->children[i].streams[k].buf);
            run->children[i].streams[k].buf = NULL;
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Setup                                                                                    */

/* True when path names an executable regular file. */
static bool run_is_executable(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

/* Finds a pshard binary: the flag's path, then the build tree layout beside pshardrun
 * (<exe dir>/../<subdir>/<name>), then the installed layout (<exe dir>/<name>), then PATH.
 * Returns a malloc'd path (caller frees), or NULL after printing what was tried. */
static char *run_find_binary(const char *flag_value, const char *flag, const char *subdir,
                             const char *name)
{
    if (flag_value) {
        if (run_is_executable(flag_value))
            return strdup(flag_value);
        fprintf(stderr, RUN_PROG ": --%s %s: not an executable file\n", flag, flag_value);
        return NULL;
    }
    char exe[PATH_MAX], cand[PATH_MAX + 64], dir[PATH_MAX] = "";
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = '\0';
            ps_strlcpy(dir, exe, sizeof(dir));
        }
    }
    if (dir[0]) {
        if (ps_snprintf(cand, sizeof(cand), "%s/../%s/%s", dir, subdir, name) == 0 &&
            run_is_executable(cand))
            return realpath(cand, NULL);
        if (ps_snprintf(cand, sizeof(cand), "%s/%s", dir, name) == 0 && run_is_executable(cand))
            return strdup(cand);
    }
    const char *p = getenv("PATH");
    while (p && *p) {
        size_t len = strcspn(p, ":");
        if (len > 0 && ps_snprintf(cand, sizeof(cand), "%.*s/%s", (int)len, p, name) == 0 &&
            run_is_executable(cand))
            return strdup(cand);
        p += len;
        if (*p == ':')
            p++;
    }
    fprintf(stderr,
            RUN_PROG ": cannot find %s: not at %s/../%s/%s, not at %s/%s, not on PATH; "
                     "pass --%s\n",
            name, dir[0] ? dir : "?", subdir, name, dir[0] ? dir : "?", name, flag);
    return NULL;
}

/* Splits "HOST:PORT" (or "[V6]:PORT") into the run's MASTER_ADDR and MASTER_PORT.
 * Returns 0, or -1 when it is not of that form. */
static int run_parse_coordinator(run_t *run, const char *addr, bool allow_port_zero)
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
static int run_local_address(run_t *run)
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

/* Removes the run's temporary directory and the port files in it. */
static void run_remove_tmpdir(const char *tmpdir)
{
    if (!tmpdir[0])
        return;
    DIR *d = opendir(tmpdir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
                unlinkat(dirfd(d), e->d_name, 0);
        }
        closedir(d);
    }
    if (rmdir(tmpdir) != 0)
        PS_WARN(PS_SUB_MAIN, "cannot remove %s: %s", tmpdir, strerror(errno));
}

/* Starts the coordinator pshardrun owns and waits for its port. */
static void run_start_coordinator(run_t *run, const char *bin)
{
    run_child_t *c = run->coord;
    ps_snprintf(c->port_file, sizeof(c->port_file), "%s/coordinator.port", run->tmpdir);
    char world[24], lease[24], heartbeat[24];
    ps_snprintf(world, sizeof(world), "%lld", (long long)run->opts->nproc * run->nnodes);
    char *argv[20];
    int a = 0;
    argv[a++] = (char *)bin;
    argv[a++] = "--listen";
    argv[a++] = run->endpoint ? run->coord_addr : "127.0.0.1:0";
    argv[a++] = "--port-file";
    argv[a++] = c->port_file;
    argv[a++] = "--world-size";
    argv[a++] = world;
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
        fprintf(stderr, RUN_PROG ": coordinator for %d nodes on %s\n", run->nnodes,
                run->coord_addr);
        return;
    }
    ps_snprintf(run->coord_addr, sizeof(run->coord_addr), "127.0.0.1:%d", c->port);
    ps_strlcpy(run->master_addr, "127.0.0.1", sizeof(run->master_addr));
    run->master_port = c->port;
    PS_INFO(PS_SUB_MAIN, "coordinator serving on %s", run->coord_addr);
}

/* Starts every shard server and waits for all their ports. */
static void run_start_servers(run_t *run, const char *bin)
{
    for (int r = 0; r < (int)run->opts->nproc && run->stop == STOP_NONE; r++) {
        run_child_t *c = &run->servers[r];
        ps_snprintf(c->port_file, sizeof(c->port_file), "%s/server-%d.port", run->tmpdir, r);
        char name[64], device[24], every[24], keep[24], replace_ms[24];
        /* The coordinator ranks servers by name (natural order): across nodes the names sort
         * by node rank, then local rank, so server K * NPROC + r is this node's r-th. */
        if (run->nnodes > 1)
            ps_snprintf(name, sizeof(name), "pshardrun-node%d-%d", run->node_rank, r);
        else
            ps_snprintf(name, sizeof(name), "pshardrun-%d-%d", (int)getpid(), r);
        ps_snprintf(device, sizeof(device), "%d", r);
        ps_snprintf(every, sizeof(every), "%lld", (long long)run->opts->checkpoint_every);
        ps_snprintf(keep, sizeof(keep), "%lld", (long long)run->opts->checkpoint_keep);
        char *argv[40];
        int a = 0;
        argv[a++] = (char *)bin;
        argv[a++] = "--coordinator";
        argv[a++] = run->coord_addr;
        argv[a++] = "--listen";
        argv[a++] = "127.0.0.1:0";
        argv[a++] = "--port-file";
        argv[a++] = c->port_file;
        argv[a++] = "--name";
        argv[a++] = name;
        if (run->job[0]) {
            argv[a++] = "--job";
            argv[a++] = run->job;
        }
        if (run->data_host[0]) {
            argv[a++] = "--data-host";
            argv[a++] = run->data_host;
        }
        argv[a++] = "--backend";
        argv[a++] = run->opts->backend;
        argv[a++] = "--offload";
        argv[a++] = run->opts->offload;
        argv[a++] = "--log";
        argv[a++] = run->opts->log;
        if (strcmp(run->opts->backend, "nccl") == 0) {
            argv[a++] = "--device"; /* one GPU per server, like LOCAL_RANK for trainers */
            argv[a++] = device;
        }
        if (run->opts->token_file) {
            argv[a++] = "--token-file";
            argv[a++] = run->opts->token_file;
        }
        if (run->opts->checkpoint_dir) {
            argv[a++] = "--checkpoint-dir";
            argv[a++] = run->opts->checkpoint_dir;
        }
        if (run->resume) {
            argv[a++] = "--resume";
            argv[a++] = (char *)run->resume;
            if (run->opts->resume_allow_fresh)
                argv[a++] = "--resume-allow-fresh";
        }
        argv[a++] = "--checkpoint-every";
        argv[a++] = every;
        argv[a++] = "--checkpoint-keep";
        argv[a++] = keep;
        if (run->opts->max_restarts > 0 && run->opts->replace_timeout_ms > 0) {
            /* Only where a trainer may be replaced: a lost trainer's state is kept for its
             * replacement instead of being given up. */
            ps_snprintf(replace_ms, sizeof(replace_ms), "%lld",
                        (long long)run->opts->replace_timeout_ms);
            argv[a++] = "--trainer-replace-ms";
            argv[a++] = replace_ms;
        }
        argv[a] = NULL;
        if (run_spawn(run, c, bin, argv, NULL, 0) != 0)
            run_set_stop(run, STOP_STARTUP, 1);
    }
    if (run->stop == STOP_NONE)
        run_wait_ports(run, run->servers, (size_t)run->opts->nproc);
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
 * the larger of --start-timeout-ms and torch's store timeout. Returns 0, or -1 after saying
 * why. */
static int run_await_torch_master(run_t *run, ps_rpc_channel_t *ch, const char *key)
{
    int64_t wait_ms = run->opts->start_timeout_ms > RUN_TORCH_MASTER_WAIT_MS
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
 * node: a free port on 127.0.0.1. Several: node 0 picks a free port and publishes its address
 * as the other nodes reach it (the rendezvous endpoint's host, or the address it reaches the
 * coordinator from) in the coordinator's store, where the other nodes wait for it. On failure
 * stops the run (STOP_STARTUP) after saying why. */
static void run_choose_torch_master(run_t *run)
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
    if (rc == 0 && run->node_rank == 0) {
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

/* Starts rank r's trainer with the torchrun environment plus pshard's own variables, which
 * tell it the restarts so far. Stops the run (STOP_STARTUP) when it cannot be started. */
static void run_start_trainer(run_t *run, int r, char *const argv[], int64_t restarts)
{
    int n = (int)run->opts->nproc;
    char rank[16], local_rank[16], world[16], local_world[16], group_rank[16], group_world[16],
        mport[16], server[64], attempt[24], max_restarts[24];
    ps_snprintf(attempt, sizeof(attempt), "%lld", (long long)restarts);
    ps_snprintf(max_restarts, sizeof(max_restarts), "%lld", (long long)run->opts->max_restarts);
    ps_snprintf(rank, sizeof(rank), "%d", run->node_rank * n + r);
    ps_snprintf(local_rank, sizeof(local_rank), "%d", r);
    ps_snprintf(world, sizeof(world), "%d", n * run->nnodes);
    ps_snprintf(local_world, sizeof(local_world), "%d", n);
    ps_snprintf(group_rank, sizeof(group_rank), "%d", run->node_rank);
    ps_snprintf(group_world, sizeof(group_world), "%d", run->nnodes);
    ps_snprintf(mport, sizeof(mport), "%d", run->torch_port);
    ps_snprintf(server, sizeof(server), "127.0.0.1:%d", run->servers[r].port);
    const run_env_t env[] = {
        {"RANK", rank},
        {"LOCAL_RANK", local_rank},
        {"WORLD_SIZE", world},
        {"LOCAL_WORLD_SIZE", local_world},
        {"GROUP_RANK", group_rank},
        {"GROUP_WORLD_SIZE", group_world},
        {"ROLE_RANK", rank},
        {"ROLE_WORLD_SIZE", world},
        {"MASTER_ADDR", run->torch_addr},
        {"MASTER_PORT", mport},
        {"PSHARD_COORDINATOR", run->coord_addr},
        {"PSHARD_SERVER", server},
        {"PSHARD_LOG", run->opts->log},
        {"PSHARD_JOB", run->job},
        {"TORCHELASTIC_RUN_ID", run->job[0] ? run->job : "none"},
        {"PSHARD_RESTART_COUNT", attempt},
        {"TORCHELASTIC_RESTART_COUNT", attempt},
        {"TORCHELASTIC_MAX_RESTARTS", max_restarts},
        {"PSHARD_TOKEN_FILE", run->opts->token_file}, /* last: dropped when NULL */
    };
    size_t nenv = PS_ARRAY_LEN(env) - (run->opts->token_file ? 0 : 1);
    if (run_spawn(run, &run->trainers[r], argv[0], argv, env, nenv) != 0)
        run_set_stop(run, STOP_STARTUP, 1);
}

/* Starts every trainer of an attempt. */
static void run_start_trainers(run_t *run, char *const argv[])
{
    for (int r = 0; r < (int)run->opts->nproc && run->stop == STOP_NONE; r++)
        run_start_trainer(run, r, argv, run->attempt);
}

/* Starts a new trainer for each rank whose trainer failed and was judged replaceable
 * (run_judge_trainers), with the same command and environment but the restart count; the
 * other trainers, the servers and the coordinator are not touched. What is left of the failed
 * trainer's process group is stopped first and its pipes are drained and closed, so the new
 * one starts clean. Stops when the run is stopping (a replacement then no longer matters). */
static void run_replace_trainers(run_t *run, char *const argv[])
{
    for (int r = 0; r < (int)run->opts->nproc && run->stop == STOP_NONE; r++) {
        run_child_t *c = &run->trainers[r];
        if (!c->replace)
            continue;
        run_stop_role(run, ROLE_TRAINER, c, SIGTERM);
        if (run->stop != STOP_NONE)
            return;
        run_child_read_now(c);
        for (int k = 0; k < 2; k++) {
            run_stream_close(c, &c->streams[k]);
            free(c->streams[k].buf);
        }
        int64_t restarts = c->replace_restarts;
        run_child_init(c, ROLE_TRAINER, c->rank);
        run_start_trainer(run, r, argv, restarts);
    }
}

/* After a failure, with restarts left: every process is gone; clears what the last attempt
 * left (children, port files, the stop reason) so the next one starts like the first, from the
 * newest checkpoint when there is a checkpoint root. */
static void run_restart(run_t *run)
{
    run->attempt++;
    const char *root = run->opts->resume ? run->opts->resume : run->opts->checkpoint_dir;
    run->resume = root;
    char from[PATH_MAX + 64];
    if (root)
        ps_snprintf(from, sizeof(from), "resuming from the newest checkpoint in %s", root);
    else
        ps_snprintf(from, sizeof(from), "from step 0 (no --checkpoint-dir to resume from)");
    fprintf(stderr, RUN_PROG ": restart %lld of %lld: starting %s again, %s\n",
            (long long)run->attempt, (long long)run->opts->max_restarts,
            run->coord ? "the coordinator, shard servers and trainers"
                       : "the shard servers and trainers",
            from);
    for (size_t i = 0; i < run->nchildren; i++) {
        run_child_t *c = &run->children[i];
        if (c->port_file[0])
            unlink(c->port_file);
        run_child_init(c, c->role, c->rank);
    }
    run->stop = STOP_NONE;
    run->stop_signal = 0;
    run->exit_code = 0;
}

/* Checks option values the config table cannot. Returns 0, or 2 after printing why. */
static int run_check_opts(run_t *run, run_opts_t *o)
{
    ps_log_level_t level;
    if (!ps_log_parse_level(o->log, &level)) {
        fprintf(stderr, RUN_PROG ": --log '%s' is not error|warn|info|debug|trace\n", o->log);
        return 2;
    }
    ps_log_set_level(level);
    if (strcmp(o->backend, "tcp") != 0 && strcmp(o->backend, "nccl") != 0) {
        fprintf(stderr, RUN_PROG ": --backend '%s' is not tcp or nccl\n", o->backend);
        return 2;
    }
    if (strcmp(o->offload, "none") != 0 && strcmp(o->offload, "cpu") != 0) {
        fprintf(stderr, RUN_PROG ": --offload '%s' is not none or cpu\n", o->offload);
        return 2;
    }
    if (o->token_file && access(o->token_file, R_OK) != 0) {
        fprintf(stderr, RUN_PROG ": --token-file %s: %s\n", o->token_file, strerror(errno));
        return 2;
    }
    run->nnodes = (int)o->nnodes;
    run->node_rank = (int)o->node_rank;
    if (o->nproc_per_node > 0) {
        if (o->nproc != 1 && o->nproc != o->nproc_per_node) {
            fprintf(stderr, RUN_PROG ": --nproc %lld and --nproc-per-node %lld differ: give one\n",
                    (long long)o->nproc, (long long)o->nproc_per_node);
            return 2;
        }
        o->nproc = o->nproc_per_node;
    }
    if (o->node_rank >= o->nnodes) {
        fprintf(stderr, RUN_PROG ": --node-rank %lld is not below --nnodes %lld\n",
                (long long)o->node_rank, (long long)o->nnodes);
        return 2;
    }
    if (o->nnodes > 1 && !o->rdzv_endpoint && !o->coordinator) {
        fprintf(stderr,
                RUN_PROG ": --nnodes %lld needs --rdzv-endpoint HOST:PORT (where node "
                         "rank 0 starts the coordinator) or --coordinator\n",
                (long long)o->nnodes);
        return 2;
    }
    if (o->nnodes > 1 && o->max_restarts > 0) {
        fprintf(stderr, RUN_PROG ": --max-restarts with --nnodes > 1 is not supported yet (a "
                                 "restart is not coordinated across nodes)\n");
        return 2;
    }
    if (o->nnodes > 1 && o->coordinator && !o->rdzv_id) {
        /* Each node would make up a job id of its own, and the nodes would never meet. */
        fprintf(stderr,
                RUN_PROG ": --nnodes %lld with --coordinator needs --rdzv-id (the same "
                         "on every node)\n",
                (long long)o->nnodes);
        return 2;
    }
    if (o->rdzv_endpoint && o->coordinator) {
        fprintf(stderr, RUN_PROG ": give --rdzv-endpoint or --coordinator, not both\n");
        return 2;
    }
    if (o->rdzv_endpoint && o->nproc * o->nnodes > 65536) {
        fprintf(stderr, RUN_PROG ": %lld nodes of %lld are more than 65536 ranks\n",
                (long long)o->nnodes, (long long)o->nproc);
        return 2;
    }
    if (o->rdzv_endpoint) {
        if (run_parse_coordinator(run, o->rdzv_endpoint, o->node_rank == 0) != 0) {
            fprintf(stderr, RUN_PROG ": --rdzv-endpoint '%s' is not HOST:PORT\n", o->rdzv_endpoint);
            return 2;
        }
        run->endpoint = o->node_rank == 0;
        if (o->nnodes > 1 && run_local_address(run) != 0)
            return 2;
    }
    if (o->coordinator && run_parse_coordinator(run, o->coordinator, false) != 0) {
        fprintf(stderr, RUN_PROG ": --coordinator '%s' is not HOST:PORT\n", o->coordinator);
        return 2;
    }
    if (o->coordinator && o->lease_ms > 0)
        fprintf(stderr, RUN_PROG ": --lease-ms is ignored with --coordinator (the running "
                                 "coordinator's lease applies)\n");
    if (o->rdzv_id) {
        size_t len = strlen(o->rdzv_id);
        bool ok = len >= 1 && len <= 64;
        for (size_t i = 0; ok && i < len; i++)
            ok = isalnum((unsigned char)o->rdzv_id[i]) || strchr("._-", o->rdzv_id[i]);
        if (!ok) {
            fprintf(stderr, RUN_PROG ": --rdzv-id '%s' must be 1 to 64 of A-Z a-z 0-9 . _ -\n",
                    o->rdzv_id);
            return 2;
        }
        ps_strlcpy(run->job, o->rdzv_id, sizeof(run->job));
    } else if (o->coordinator) {
        /* A coordinator others may use too: a job of our own, never one that ran before. */
        char host[64] = "host";
        gethostname(host, sizeof(host) - 1);
        host[sizeof(host) - 1] = '\0';
        for (char *h = host; *h; h++)
            if (!isalnum((unsigned char)*h) && *h != '-')
                *h = '-';
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ps_snprintf(run->job, sizeof(run->job), "pshardrun-%.24s-%d-%llx", host, (int)getpid(),
                    (unsigned long long)ts.tv_sec * 1000000ull +
                        (unsigned long long)ts.tv_nsec / 1000);
    }
    if (run->job[0] && !o->rdzv_id)
        fprintf(stderr, RUN_PROG ": job %s on coordinator %s (pshardctl --job %s status)\n",
                run->job, o->coordinator, run->job);
    return 0;
}

/* Blocks the signals pshardrun handles and routes them to a signalfd; makes pshardrun the
 * subreaper of its descendants. Returns 0 or -1 after printing why. */
static int run_setup_signals(run_t *run)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &set, &run->orig_mask) != 0)
        return -1;
    run->sigfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (run->sigfd < 0) {
        fprintf(stderr, RUN_PROG ": signalfd: %s\n", strerror(errno));
        return -1;
    }
    /* A closed stdout must not kill pshardrun while children still need reaping. */
    struct sigaction ign = {.sa_handler = SIG_IGN};
    sigemptyset(&ign.sa_mask);
    sigaction(SIGPIPE, &ign, &run->orig_sigpipe);
    /* Orphaned grandchildren come to us instead of init, so none outlives the run. */
    if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0)
        PS_WARN(PS_SUB_MAIN, "PR_SET_CHILD_SUBREAPER: %s", strerror(errno));
    return 0;
}

int main(int argc, char **argv)
{
    ps_log_init(RUN_PROG);
    run_opts_t o;
    memset(&o, 0, sizeof(o));
    ps_config_result_t res;
    char err[PSHARD_ERRLEN] = "";
    char *coord_bin = NULL, *server_bin = NULL;
    run_t run;
    memset(&run, 0, sizeof(run));
    run.sigfd = -1;
    run.opts = &o;
    int exit_code = 0;

    if (ps_config_parse(options, PS_ARRAY_LEN(options), argc, argv, &o, &res, err, sizeof(err)) !=
        PSHARD_OK) {
        fprintf(stderr, RUN_PROG ": %s (see --help)\n", err);
        exit_code = 2;
        goto out;
    }
    if (res.help) {
        ps_config_usage(
            stdout, RUN_PROG, "[OPTIONS] -- CMD [ARGS...]",
            "Starts a coordinator (unless --coordinator names one), NPROC shard "
            "servers and NPROC trainers running CMD with RANK, LOCAL_RANK, "
            "WORLD_SIZE, MASTER_ADDR, MASTER_PORT, PSHARD_COORDINATOR and "
            "PSHARD_SERVER set, and stops them all when the trainers finish or one "
            "fails. MASTER_ADDR:MASTER_PORT is where rank 0's torch hosts its "
            "TCPStore for init_process_group's env:// (a free port picked for each "
            "attempt; with --nnodes > 1 node 0 picks it and the other nodes learn it "
            "through the coordinator's store), while PSHARD_COORDINATOR is pshard's "
            "gRPC coordinator. With --max-restarts, a failed trainer is replaced alone "
            "while the coordinator and the servers run, and any other failure restarts "
            "them all. Exits 0 when every rank's last trainer exited 0, with the failing "
            "trainer's status when no restart is left, 128+N after signal N, 1 when a "
            "server or the coordinator fails, 2 on usage errors.",
            options, PS_ARRAY_LEN(options));
        goto out;
    }
    if (res.version) {
        printf(RUN_PROG " %s\n", PSHARD_VERSION_STRING);
        goto out;
    }
    int cmd = res.first_positional;
    if (cmd >= argc || cmd < 2 || strcmp(argv[cmd - 1], "--") != 0) {
        if (cmd < argc)
            fprintf(stderr,
                    RUN_PROG ": unexpected argument '%s'; the trainer command goes after '--' "
                             "(see --help)\n",
                    argv[cmd]);
        else
            fprintf(stderr, RUN_PROG ": no trainer command; usage: " RUN_PROG
                                     " [OPTIONS] -- CMD [ARGS...] (see --help)\n");
        exit_code = 2;
        goto out;
    }
    exit_code = run_check_opts(&run, &o);
    if (exit_code != 0)
        goto out;
    ps_config_log(options, PS_ARRAY_LEN(options), &o, &res);

    /* A path given by flag that is not executable is a usage error (2); a binary the search
     * does not find is an installation problem (1). */
    server_bin = run_find_binary(o.server_bin, "server-bin", "shard_server", RUN_SERVER_BIN);
    if (!server_bin) {
        exit_code = o.server_bin ? 2 : 1;
        goto out;
    }
    /* A coordinator of its own unless one is named, or another node starts it. */
    bool own_coord = !o.coordinator && (!o.rdzv_endpoint || o.node_rank == 0);
    if (own_coord) {
        coord_bin =
            run_find_binary(o.coordinator_bin, "coordinator-bin", "coordinator", RUN_COORD_BIN);
        if (!coord_bin) {
            exit_code = o.coordinator_bin ? 2 : 1;
            goto out;
        }
    }

    size_t n = (size_t)o.nproc;
    run.nchildren = (own_coord ? 1 : 0) + 2 * n;
    run.children = calloc(run.nchildren, sizeof(*run.children));
    run.pfds = calloc(1 + 2 * run.nchildren, sizeof(*run.pfds));
    run.pfd_child = calloc(1 + 2 * run.nchildren, sizeof(*run.pfd_child));
    run.pfd_stream = calloc(1 + 2 * run.nchildren, sizeof(*run.pfd_stream));
    if (!run.children || !run.pfds || !run.pfd_child || !run.pfd_stream) {
        fprintf(stderr, RUN_PROG ": out of memory for %zu processes\n", run.nchildren);
        exit_code = 1;
        goto out;
    }
    size_t at = 0;
    if (own_coord) {
        run.coord = &run.children[at];
        run_child_init(&run.children[at++], ROLE_COORDINATOR, -1);
    }
    /* Labelled with their global ranks ("[trainer 5]" on node 1 of 4-process nodes). */
    int base = run.node_rank * (int)n;
    run.servers = &run.children[at];
    for (size_t r = 0; r < n; r++)
        run_child_init(&run.children[at++], ROLE_SERVER, base + (int)r);
    run.trainers = &run.children[at];
    for (size_t r = 0; r < n; r++)
        run_child_init(&run.children[at++], ROLE_TRAINER, base + (int)r);

    if (run_setup_signals(&run) != 0) {
        exit_code = 1;
        goto out;
    }
    const char *tmp = getenv("TMPDIR");
    if (ps_snprintf(run.tmpdir, sizeof(run.tmpdir), "%s/pshardrun-XXXXXX",
                    tmp && *tmp ? tmp : "/tmp") != 0 ||
        !mkdtemp(run.tmpdir)) {
        fprintf(stderr, RUN_PROG ": cannot create a temporary directory: %s\n", strerror(errno));
        run.tmpdir[0] = '\0';
        exit_code = 1;
        goto out;
    }

    run.resume = o.resume;
    for (;;) {
        if (run.coord)
            run_start_coordinator(&run, coord_bin);
        if (run.stop == STOP_NONE)
            run_start_servers(&run, server_bin);
        if (run.stop == STOP_NONE)
            run_choose_torch_master(&run);
        if (run.stop == STOP_NONE)
            run_start_trainers(&run, &argv[cmd]);
        while (run.stop == STOP_NONE) {
            run_replace_trainers(&run, &argv[cmd]);
            if (run.stop != STOP_NONE)
                break;
            /* Done when each rank's latest trainer exited 0 (a failed one is being replaced
             * or has stopped the run). */
            bool all_done = true;
            for (size_t r = 0; r < n && all_done; r++) {
                const run_child_t *t = &run.trainers[r];
                all_done = t->reaped && !t->replace && WIFEXITED(t->wait_status) &&
                           WEXITSTATUS(t->wait_status) == 0;
            }
            if (all_done) {
                run_set_stop(&run, STOP_DONE, 0);
                break;
            }
            run_pump(&run, ps_now_ns() + 1000 * 1000000LL);
        }

        /* Stop in dependency order: trainers first (with the signal pshardrun got, if any),
         * then the servers (which leave the cluster), then the coordinator. */
        run_stop_role(&run, ROLE_TRAINER, NULL,
                      run.stop == STOP_SIGNAL ? run.stop_signal : SIGTERM);
        run_stop_role(&run, ROLE_SERVER, NULL, SIGTERM);
        run_stop_role(&run, ROLE_COORDINATOR, NULL, SIGTERM);
        run_sweep(&run);
        run_drain(&run);
        /* What the killed ones left in /dev/shm (a trainer stopped inside an Attach or a
         * DefineModel, a server killed): their PIDs are gone now. */
        ps_shm_sweep(PS_SHM_TRAINER, "trainer");
        ps_shm_sweep(PS_SHM_SERVER, "shard server");
        bool failed = run.stop == STOP_TRAINER_FAILED || run.stop == STOP_SERVICE_DIED;
        if (!failed || run.attempt >= o.max_restarts)
            break;
        run_restart(&run);
    }
    exit_code = run.exit_code;
    if (run.stop == STOP_DONE) {
        for (size_t i = 0; i < run.nchildren; i++) {
            const run_child_t *c = &run.children[i];
            if (c->role != ROLE_TRAINER && c->reaped &&
                !(WIFEXITED(c->wait_status) && WEXITSTATUS(c->wait_status) == 0)) {
                char what[96];
                run_describe_status(c->wait_status, true, what, sizeof(what));
                PS_WARN(PS_SUB_MAIN, "%s (pid %d) %s while stopping", c->label, (int)c->pid, what);
            }
        }
    }

out:
    if (run.sigfd >= 0)
        close(run.sigfd);
    run_remove_tmpdir(run.tmpdir);
    free(run.children);
    free(run.pfds);
    free(run.pfd_child);
    free(run.pfd_stream);
    free(coord_bin);
    free(server_bin);
    ps_config_free(options, PS_ARRAY_LEN(options), &o);
    return exit_code;
}
