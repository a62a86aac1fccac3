/* pshardrun's options: the one table {flag, env, type, default, help} that is parsed, logged
 * and printed by --help, with torchrun's flags under torchrun's names and spellings (either
 * "--nproc-per-node" or "--nproc_per_node", "-m", "-r", "-t", a bare training script), the
 * checks of what the table cannot check, and the trainers' command line. */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/util.h"

#include "run.h"

/* clang-format off */
#define OPT(flag, env, type, def, help, field, lo, hi)                                             \
    {flag, env, type, def, help, offsetof(run_opts_t, field), lo, hi}
/* clang-format on */

/* The table's order is --help's within each group (run_groups). Environment names: pshard's
 * own first, then torchrun's PET_<FLAG>, which torchrun reads for the same flag. */
const ps_option_t run_options[] = {
    /* torchrun: worker/node size */
    OPT("nnodes", "PSHARD_NNODES,PET_NNODES", PS_OPT_STRING, "1",
        "nodes of the job, N or MIN:MAX (elastic: the job starts once MIN nodes joined and takes "
        "up to MAX, waiting --rdzv-conf last_call_timeout after MIN for more); each node runs "
        "its own pshardrun with its --node-rank",
        nnodes, 0, 0),
    OPT("nproc-per-node", "PSHARD_NPROC_PER_NODE,PET_NPROC_PER_NODE", PS_OPT_STRING, NULL,
        "shard servers and trainers on this node: a number, 'gpu' (one per GPU; "
        "CUDA_VISIBLE_DEVICES counts when set), 'cpu' (one per CPU) or 'auto' (gpu when there "
        "are GPUs, else cpu) (default: --nproc)",
        nproc_per_node, 0, 0),
    OPT("nproc", "PSHARD_NPROC", PS_OPT_INT, "1",
        "pshard's name for --nproc-per-node: a number of shard servers and trainers", nproc, 1,
        RUN_MAX_NPROC),
    /* torchrun: rendezvous */
    OPT("rdzv-backend", "PSHARD_RDZV_BACKEND,PET_RDZV_BACKEND", PS_OPT_STRING, "static",
        "rendezvous backend: pshardrun's is its coordinator, named 'pshard' (torchrun's "
        "'static' is taken as the same); c10d and etcd are refused",
        rdzv_backend, 0, 0),
    OPT("rdzv-endpoint", "PSHARD_RDZV_ENDPOINT,PET_RDZV_ENDPOINT", PS_OPT_STRING, NULL,
        "HOST:PORT of the job's coordinator: the host node (node rank 0) starts it listening "
        "there (port 0: a free one, printed as 'coordinator for N nodes on HOST:PORT'), the "
        "other nodes use it",
        rdzv_endpoint, 0, 0),
    OPT("rdzv-id", "PSHARD_JOB,PET_RDZV_ID", PS_OPT_STRING, NULL,
        "job id on the coordinator: this job's members, ranks and store keys are its own, so "
        "jobs sharing a --coordinator never meet (default: a fresh id per run with "
        "--coordinator, the coordinator's default job without)",
        rdzv_id, 0, 0),
    OPT("rdzv-conf", "PSHARD_RDZV_CONF,PET_RDZV_CONF", PS_OPT_STRING, NULL,
        "KEY=VALUE,...: join_timeout (seconds the nodes wait for each other; default 300, or "
        "--start-timeout-ms when longer), "
        "last_call_timeout (seconds to wait for more nodes once MIN joined, default 30), "
        "is_host (true: this node starts the coordinator; default: node rank 0)",
        rdzv_conf, 0, 0),
    OPT("standalone", "PSHARD_STANDALONE,PET_STANDALONE", PS_OPT_BOOL, "false",
        "one node with a coordinator of its own on a free local port; --rdzv-backend, "
        "--rdzv-endpoint and --rdzv-id are then ignored",
        standalone, 0, 0),
    /* torchrun: user-code launch */
    OPT("max-restarts", "PSHARD_MAX_RESTARTS,PET_MAX_RESTARTS", PS_OPT_INT, "0",
        "restarts allowed in all: a trainer that fails while the coordinator and every shard "
        "server run is replaced alone (see --replace-timeout-ms); any other failure stops "
        "everything and starts it again, resuming from the newest checkpoint under "
        "--checkpoint-dir (or --resume) when there is one (on one node only: across nodes such "
        "a failure ends the job); trainers see the restarts so far in PSHARD_RESTART_COUNT "
        "and TORCHELASTIC_RESTART_COUNT",
        max_restarts, 0, 1000000),
    OPT("monitor-interval", "PSHARD_MONITOR_INTERVAL,PET_MONITOR_INTERVAL", PS_OPT_STRING, "0.1",
        "seconds between two looks at the processes (exits are also seen at once, by SIGCHLD)",
        monitor_interval, 0, 0),
    OPT("start-method", "PSHARD_START_METHOD,PET_START_METHOD", PS_OPT_STRING, "spawn",
        "spawn, fork or forkserver: accepted for torchrun's sake; every trainer is a process of "
        "its own, started afresh (as spawn does)",
        start_method, 0, 0),
    OPT("event-log-handler", "PSHARD_EVENT_LOG_HANDLER,PET_EVENT_LOG_HANDLER", PS_OPT_STRING,
        "null", "only 'null': pshardrun has no torchelastic event handlers", event_log_handler, 0,
        0),
    OPT("role", "PSHARD_ROLE,PET_ROLE", PS_OPT_STRING, "default",
        "the trainers' role: their ROLE_NAME, and their output's prefix ('[ROLE N]') when not "
        "'default'",
        role, 0, 0),
    OPT("module", "PSHARD_MODULE,PET_MODULE", PS_OPT_BOOL, "false",
        "the training script is a Python module, run as 'python -m MODULE'", module, 0, 0),
    OPT("no-python", "PSHARD_NO_PYTHON,PET_NO_PYTHON", PS_OPT_BOOL, "false",
        "run the training script as a program, not with Python", no_python, 0, 0),
    OPT("run-path", "PSHARD_RUN_PATH,PET_RUN_PATH", PS_OPT_BOOL, "false",
        "refused: pshardrun has no Python interpreter of its own to run the script in", run_path, 0,
        0),
    OPT("log-dir", "PSHARD_LOG_DIR,PET_LOG_DIR", PS_OPT_STRING, NULL,
        "where --redirects and --tee write: DIR/RUNID_XXXXXX/attempt_RESTARTS/LOCAL_RANK/"
        "stdout.log and stderr.log, RUNID being --rdzv-id or 'none' (default: a new directory "
        "under TMPDIR); the run's directory is printed",
        log_dir, 0, 0),
    OPT("redirects", "PSHARD_REDIRECTS,PET_REDIRECTS", PS_OPT_STRING, "0",
        "trainers' streams sent to log files instead of the console: 0 none, 1 stdout, 2 "
        "stderr, 3 both, for every local rank, or per local rank as '0:1,1:2'",
        redirects, 0, 0),
    OPT("tee", "PSHARD_TEE,PET_TEE", PS_OPT_STRING, "0",
        "trainers' streams written to log files and to the console (values as --redirects)", tee, 0,
        0),
    OPT("local-ranks-filter", "PSHARD_LOCAL_RANKS_FILTER,PET_LOCAL_RANKS_FILTER", PS_OPT_STRING,
        NULL,
        "comma-separated local ranks whose trainers' output is shown on the console (log files "
        "keep everything); shard servers and the coordinator are always shown",
        local_ranks_filter, 0, 0),
    OPT("log-line-prefix-template",
        "PSHARD_LOG_LINE_PREFIX_TEMPLATE,PET_LOG_LINE_PREFIX_TEMPLATE,"
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
        PS_OPT_STRING, NULL,
        "the prefix of each trainer output line on the console, instead of '[trainer RANK] ': "
        "${role_name}, ${local_rank}, ${rank} and ${hostname} are replaced, $$ is a '$' (e.g. "
        "'${hostname}:${rank}: ')",
        log_line_prefix_template, 0, 0),
    OPT("duplicate-stdout-filters", "PET_DUPLICATE_STDOUT_FILTERS", PS_OPT_STRING, NULL,
        "refused: pshardrun does not copy matching lines to another file (use --tee with "
        "--log-dir and grep the files)",
        duplicate_stdout_filters, 0, 0),
    OPT("duplicate-stderr-filters", "PET_DUPLICATE_STDERR_FILTERS", PS_OPT_STRING, NULL,
        "refused: as --duplicate-stdout-filters", duplicate_stderr_filters, 0, 0),
    /* torchrun: backwards compatible with torch.distributed.launch, and the rest */
    OPT("node-rank", "PSHARD_NODE_RANK,PET_NODE_RANK", PS_OPT_INT, "0",
        "this node's rank, 0..MAX-1: its servers and trainers come after those of lower node "
        "ranks",
        node_rank, 0, RUN_MAX_NPROC - 1),
    OPT("master-addr", "PSHARD_MASTER_ADDR,PET_MASTER_ADDR", PS_OPT_STRING, NULL,
        "with --master-port and no --rdzv-endpoint: the endpoint's host (default 127.0.0.1)",
        master_addr, 0, 0),
    OPT("master-port", "PSHARD_MASTER_PORT,PET_MASTER_PORT", PS_OPT_INT, "0",
        "with --master-addr and no --rdzv-endpoint: the endpoint's port (default 29500)",
        master_port, 0, 65535),
    OPT("local-addr", "PSHARD_LOCAL_ADDR,PET_LOCAL_ADDR", PS_OPT_STRING, NULL,
        "this node's address as the others reach it: where its shard servers' rings listen "
        "(default: the address the rendezvous endpoint is reached from)",
        local_addr, 0, 0),
    OPT("logs-specs", NULL, PS_OPT_STRING, NULL,
        "refused: pshardrun loads no Python entry points (use --log-dir, --redirects, --tee)",
        logs_specs, 0, 0),
    OPT("numa-binding", NULL, PS_OPT_STRING, NULL,
        "refused: pshardrun does not bind trainers to NUMA nodes (use numactl in the command)",
        numa_binding, 0, 0),
    OPT("signals-to-handle", "PSHARD_SIGNALS_TO_HANDLE,PET_SIGNALS_TO_HANDLE", PS_OPT_STRING,
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "signals that stop the run, forwarded to the trainers: of SIGTERM, SIGINT, SIGHUP, "
        "SIGQUIT, SIGUSR1, SIGUSR2",
        signals_to_handle, 0, 0),
    OPT("shutdown-timeout",
        "PSHARD_SHUTDOWN_TIMEOUT,PET_SHUTDOWN_TIMEOUT,TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
        PS_OPT_STRING, NULL,
        "seconds to wait after SIGTERM before SIGKILL when stopping processes: --stop-grace-ms "
        "in seconds (default: --stop-grace-ms's)",
        shutdown_timeout, 0, 0),
    OPT("virtual-local-rank", "PET_VIRTUAL_LOCAL_RANK", PS_OPT_BOOL, "false",
        "refused: pshardrun does not narrow CUDA_VISIBLE_DEVICES to one GPU per trainer (pick "
        "the device with torch.cuda.set_device(LOCAL_RANK))",
        virtual_local_rank, 0, 0),
    OPT("print-completion", NULL, PS_OPT_STRING, NULL,
        "refused: pshardrun prints no shell completion script", print_completion, 0, 0),
    /* pshard: services */
    OPT("coordinator", "PSHARD_COORDINATOR", PS_OPT_STRING, NULL,
        "use this coordinator HOST:PORT instead of starting one on 127.0.0.1", coordinator, 0, 0),
    OPT("backend", "PSHARD_BACKEND", PS_OPT_STRING, "tcp", "collectives backend: tcp or nccl",
        backend, 0, 0),
    OPT("offload", "PSHARD_OFFLOAD", PS_OPT_STRING, "none", "where shards live: none or cpu",
        offload, 0, 0),
    OPT("shard-memory", "PSHARD_SHARD_MEMORY", PS_OPT_STRING, "auto",
        "where the shards live: auto (GPU memory with nccl unless --offload cpu, else host "
        "memory), host, or gpu (with tcp: every server on GPU 0, its collectives through host "
        "memory; for several ranks sharing one GPU, where NCCL allows one rank per GPU)",
        shard_memory, 0, 0),
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
    /* pshard: checkpoints and replacement */
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
    OPT("replace-timeout-ms", "PSHARD_REPLACE_TIMEOUT_MS", PS_OPT_INT, "60000",
        "with --max-restarts: the shard servers keep a failed trainer's state this long while "
        "its replacement starts (pshard-server --trainer-replace-ms); 0: no replacement, any "
        "failure restarts everything",
        replace_timeout_ms, 0, 86400000),
};

const size_t run_noptions = PS_ARRAY_LEN(run_options);

/* --help's groups: torchrun's, in torchrun's order, then pshard's own. Each group runs from its
 * first flag up to the next group's first flag in run_options. */
static const struct {
    const char *first; /* the group's first flag in run_options */
    const char *title;
} run_groups[] = {
    {"nnodes", "worker/node size"},
    {"rdzv-backend", "rendezvous"},
    {"max-restarts", "user-code launch"},
    {"node-rank", "backwards compatible with torch.distributed.launch, and the rest"},
    {"coordinator", "pshard: services"},
    {"checkpoint-dir", "pshard: checkpoints and replacement"},
};

/* torchrun's one-letter flags. */
static const struct {
    char letter;
    const char *flag;
} run_short_flags[] = {{'m', "module"}, {'r', "redirects"}, {'t', "tee"}};

/* Flags that torchrun spells with an underscore too; pshardrun takes every flag either way,
 * and --help shows the underscore spelling of these, as torchrun's does. */
static const char *const run_torch_flags[] = {
    "nnodes",
    "nproc-per-node",
    "rdzv-backend",
    "rdzv-endpoint",
    "rdzv-id",
    "rdzv-conf",
    "standalone",
    "max-restarts",
    "monitor-interval",
    "start-method",
    "event-log-handler",
    "role",
    "module",
    "no-python",
    "run-path",
    "log-dir",
    "redirects",
    "tee",
    "local-ranks-filter",
    "log-line-prefix-template",
    "duplicate-stdout-filters",
    "duplicate-stderr-filters",
    "node-rank",
    "master-addr",
    "master-port",
    "local-addr",
    "logs-specs",
    "numa-binding",
    "signals-to-handle",
    "shutdown-timeout",
    "virtual-local-rank",
    "print-completion",
};

/* ---------------------------------------------------------------------------------------- */
/* Parsing                                                                                  */

static void run_usage(FILE *out);

/* The option of run_options named name[0..len) (dashes, not underscores), or NULL. */
static const ps_option_t *run_option_find(const char *name, size_t len)
{
    for (size_t i = 0; i < run_noptions; i++) {
        if (strlen(run_options[i].flag) == len && strncmp(run_options[i].flag, name, len) == 0)
            return &run_options[i];
    }
    return NULL;
}

/* Levenshtein distance between a[0..alen) and b, ignoring case, in O(len(b)) memory;
 * names longer than 64 bytes count as far from everything. */
static size_t run_edit_distance(const char *a, size_t alen, const char *b)
{
    size_t blen = strlen(b);
    if (alen > 64 || blen > 64)
        return SIZE_MAX;
    size_t row[65];
    for (size_t j = 0; j <= blen; j++)
        row[j] = j;
    for (size_t i = 1; i <= alen; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= blen; j++) {
            size_t up = row[j];
            size_t cost =
                tolower((unsigned char)a[i - 1]) == tolower((unsigned char)b[j - 1]) ? 0 : 1;
            size_t best = diag + cost;
            if (row[j] + 1 < best)
                best = row[j] + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[blen];
}

/* The known flag nearest to name[0..len) (without dashes, underscores made dashes): one that
 * name begins (an abbreviation) first, else the least edit distance; never NULL. */
static const char *run_nearest_flag(const char *name, size_t len)
{
    static const char *const extra[] = {"help", "version"};
    const char *best = "help";
    size_t best_d = SIZE_MAX;
    for (size_t i = 0; i < run_noptions + PS_ARRAY_LEN(extra); i++) {
        const char *flag = i < run_noptions ? run_options[i].flag : extra[i - run_noptions];
        size_t d =
            len > 0 && strncmp(flag, name, len) == 0 ? 0 : run_edit_distance(name, len, flag);
        if (d < best_d) {
            best_d = d;
            best = flag;
        }
    }
    return best;
}

/* Prints "unknown flag GIVEN; did you mean --NEAREST?" and returns 2. name[0..len) is GIVEN's
 * name with dashes for underscores. */
static int run_unknown_flag(const char *given, const char *name, size_t len)
{
    fprintf(stderr, RUN_PROG ": unknown flag %s; did you mean --%s? (see --help)\n", given,
            run_nearest_flag(name, len));
    return 2;
}

/* Appends "--FLAG" or "--FLAG=VALUE" (value NULL: the former) to out. Returns 0, or -1 without
 * memory. */
static int run_push_flag(char **out, int *n, const char *flag, const char *value)
{
    size_t len = strlen(flag) + (value ? strlen(value) + 1 : 0) + 3;
    char *s = malloc(len);
    if (!s)
        return -1;
    if (value)
        ps_snprintf(s, len, "--%s=%s", flag, value);
    else
        ps_snprintf(s, len, "--%s", flag);
    out[(*n)++] = s;
    return 0;
}

/* Rewrites one option of torchrun's or pshard's spelling, at argv[*i], as "--FLAG[=VALUE]" in
 * out (taking the next word as the value where the flag needs one, as torchrun does), and
 * advances *i past what it used. Returns 0, or 2 after saying why (an unknown flag names the
 * nearest known one), or -1 without memory. */
static int run_normalize_one(int argc, char **argv, int *i, char **out, int *n)
{
    const char *arg = argv[*i];
    char name[128];
    const char *value = NULL;
    const ps_option_t *opt = NULL;
    if (arg[1] == '-') {
        const char *eq = strchr(arg + 2, '=');
        size_t len = eq ? (size_t)(eq - arg - 2) : strlen(arg + 2);
        if (len == 0 || len >= sizeof(name))
            return run_unknown_flag(arg, arg + 2, len >= sizeof(name) ? sizeof(name) - 1 : len);
        memcpy(name, arg + 2, len);
        name[len] = '\0';
        for (char *p = name; *p; p++)
            if (*p == '_')
                *p = '-';
        value = eq ? eq + 1 : NULL;
        opt = run_option_find(name, len);
        if (!opt && len > 3 && strncmp(name, "no-", 3) == 0) {
            /* --no-FLAG turns a boolean off (ps_config_parse checks it takes no value). */
            const ps_option_t *neg = run_option_find(name + 3, len - 3);
            if (neg && neg->type == PS_OPT_BOOL)
                return run_push_flag(out, n, name, value);
        }
        if (!opt)
            return run_unknown_flag(arg, name, len);
    } else {
        for (size_t k = 0; k < PS_ARRAY_LEN(run_short_flags) && !opt; k++) {
            if (arg[1] == run_short_flags[k].letter)
                opt = run_option_find(run_short_flags[k].flag, strlen(run_short_flags[k].flag));
        }
        if (!opt) {
            /* "-nproc_per_node": likely a long flag with one dash. */
            size_t len = strlen(arg + 1);
            if (len >= sizeof(name))
                len = sizeof(name) - 1;
            memcpy(name, arg + 1, len);
            name[len] = '\0';
            for (char *p = name; *p; p++)
                if (*p == '_')
                    *p = '-';
            return run_unknown_flag(arg, name, len);
        }
        if (arg[2] != '\0') {
            /* "-r3" or "-r=3", as argparse takes them. */
            value = arg[2] == '=' ? arg + 3 : arg + 2;
            if (opt->type == PS_OPT_BOOL) {
                fprintf(stderr, RUN_PROG ": -%c (--%s) takes no value: '%s'\n", arg[1], opt->flag,
                        arg);
                return 2;
            }
        }
    }
    if (!value && opt->type != PS_OPT_BOOL) {
        const char *next = *i + 1 < argc ? argv[*i + 1] : NULL;
        if (!next || strncmp(next, "--", 2) == 0) {
            fprintf(stderr, RUN_PROG ": %s needs a value (see --help)\n", arg);
            return 2;
        }
        value = next;
        (*i)++;
    }
    return run_push_flag(out, n, opt->flag, value);
}

int run_parse_args(int argc, char **argv, run_opts_t *o, ps_config_result_t *res, int *cmd,
                   bool *dashdash)
{
    int rc = -1, n = 0;
    *cmd = argc;
    *dashdash = false;
    char **norm = calloc((size_t)argc + 2, sizeof(*norm));
    if (!norm) {
        fprintf(stderr, RUN_PROG ": out of memory\n");
        return 2;
    }
    norm[n++] = NULL; /* argv[0]: ps_config_parse skips it */
    bool help = false, version = false;
    for (int i = 1; i < argc && rc == -1; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--") == 0) {
            *cmd = i + 1;
            *dashdash = true;
            break;
        }
        if (arg[0] != '-' || arg[1] == '\0') {
            *cmd = i; /* the training script; what follows is its own */
            break;
        }
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            help = true;
            break;
        }
        if (strcmp(arg, "--version") == 0) {
            version = true;
            break;
        }
        int r = run_normalize_one(argc, argv, &i, norm, &n);
        if (r < 0) {
            fprintf(stderr, RUN_PROG ": out of memory\n");
            rc = 2;
        } else if (r > 0) {
            rc = r;
        }
    }
    if (rc == -1 && (help || version)) {
        if (help)
            run_usage(stdout);
        else
            printf(RUN_PROG " %s\n", PSHARD_VERSION_STRING);
        rc = 0;
    }
    if (rc == -1) {
        char err[PSHARD_ERRLEN] = "";
        if (ps_config_parse(run_options, run_noptions, n, norm, o, res, err, sizeof(err)) !=
            PSHARD_OK) {
            fprintf(stderr, RUN_PROG ": %s (see --help)\n", err);
            rc = 2;
        }
    }
    for (int k = 1; k < n; k++)
        free(norm[k]);
    free(norm);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* --help                                                                                   */

/* True when torchrun also spells flag with underscores. */
static bool run_is_torch_flag(const char *flag)
{
    for (size_t i = 0; i < PS_ARRAY_LEN(run_torch_flags); i++) {
        if (strcmp(run_torch_flags[i], flag) == 0)
            return true;
    }
    return false;
}

/* Prints text from column indent, wrapped before column 100, then a newline. */
static void run_usage_wrapped(FILE *out, const char *text, int indent)
{
    const int width = 100 - indent;
    while (*text) {
        int len = (int)strlen(text);
        if (len > width) {
            len = width;
            while (len > 0 && text[len] != ' ')
                len--;
            if (len == 0)
                len = width;
        }
        fprintf(out, "%*s%.*s\n", indent, "", len, text);
        text += len;
        while (*text == ' ')
            text++;
    }
}

/* One option's entry: its spellings and value on one line, then its help, environment and
 * default below. */
static void run_usage_option(FILE *out, const ps_option_t *opt)
{
    char left[200] = "", meta[64] = "";
    for (size_t k = 0; k < PS_ARRAY_LEN(run_short_flags); k++) {
        if (strcmp(run_short_flags[k].flag, opt->flag) == 0)
            ps_snprintf(left, sizeof(left), "-%c, ", run_short_flags[k].letter);
    }
    size_t at = strlen(left);
    ps_snprintf(left + at, sizeof(left) - at, "--%s", opt->flag);
    if (run_is_torch_flag(opt->flag) && strchr(opt->flag, '-')) {
        at = strlen(left);
        ps_snprintf(left + at, sizeof(left) - at, ", --%s", opt->flag);
        for (char *p = left + at + 4; *p; p++)
            if (*p == '-')
                *p = '_';
    }
    if (opt->type != PS_OPT_BOOL) {
        size_t k = 0;
        for (const char *p = opt->flag; *p && k + 1 < sizeof(meta); p++, k++)
            meta[k] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
        meta[k] = '\0';
        at = strlen(left);
        ps_snprintf(left + at, sizeof(left) - at, " %s", meta);
    }
    fprintf(out, "  %s\n", left);
    char more[600], env[128] = "";
    if (opt->env) {
        /* "PSHARD_NNODES/PET_NNODES": the names tried in order */
        ps_strlcpy(env, opt->env, sizeof(env));
        for (char *p = env; *p; p++)
            if (*p == ',')
                *p = '/';
    }
    ps_snprintf(more, sizeof(more), "%s%s%s%s%s%s%s%s", opt->help,
                opt->env || opt->default_value ? " [" : "", opt->env ? "env " : "", env,
                opt->env && opt->default_value ? "; " : "", opt->default_value ? "default " : "",
                opt->default_value ? opt->default_value : "",
                opt->env || opt->default_value ? "]" : "");
    run_usage_wrapped(out, more, 8);
}

/* Prints pshardrun's usage on out, grouped as torchrun's is. */
static void run_usage(FILE *out)
{
    fprintf(out, "usage: " RUN_PROG " [-h] [OPTIONS] training_script [training_script_args ...]\n"
                 "       " RUN_PROG " [OPTIONS] -- CMD [ARGS ...]\n\n");
    run_usage_wrapped(
        out,
        "pshard's torchrun: starts a coordinator (unless one is named or another node starts "
        "it), NPROC shard servers and NPROC trainers, each trainer with torchrun's environment "
        "(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_NAME, MASTER_ADDR, "
        "MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...) plus PSHARD_COORDINATOR and "
        "PSHARD_SERVER, forwards their output line by line with a '[trainer N] ' prefix, and "
        "stops them all when the trainers finish or one fails. MASTER_ADDR:MASTER_PORT is where "
        "rank 0's torch hosts its TCPStore for env:// (a free port picked for each attempt; "
        "across nodes node 0 picks it and the others learn it through the coordinator's store); "
        "PSHARD_COORDINATOR is pshard's gRPC coordinator. With --max-restarts, a failed trainer "
        "is replaced alone while the coordinator and the servers run, and any other failure "
        "restarts them all. Exits 0 when every rank's last trainer exited 0, with the failing "
        "trainer's status when no restart is left, 128+N after signal N, 1 when a server or the "
        "coordinator fails, 2 on usage errors.",
        0);
    fprintf(out, "\npositional arguments:\n  training_script\n");
    run_usage_wrapped(
        out,
        "the trainer: a Python script run with the current Python, as torchrun does ('python3 "
        "-u SCRIPT'; the current Python is $PYTHON_EXEC when set, else the python3 beside "
        "pshardrun's own executable, as in a virtual environment's bin/, else python3 on "
        "PATH), a module with -m, or a program with --no-python",
        8);
    fprintf(out, "  training_script_args\n");
    run_usage_wrapped(out, "the trainer's own arguments, passed as they are", 8);
    fprintf(out, "  -- CMD [ARGS ...]\n");
    run_usage_wrapped(out,
                      "pshard's form: CMD runs as it is (found on PATH), without Python unless "
                      "-m is given",
                      8);
    size_t g = 0;
    for (size_t i = 0; i < run_noptions; i++) {
        if (g < PS_ARRAY_LEN(run_groups) && strcmp(run_options[i].flag, run_groups[g].first) == 0)
            fprintf(out, "\n%s:\n", run_groups[g++].title);
        run_usage_option(out, &run_options[i]);
    }
    fprintf(out, "\noptions:\n  -h, --help\n");
    run_usage_wrapped(out, "show this help and exit", 8);
    fprintf(out, "  --version\n");
    run_usage_wrapped(out, "show the version and exit", 8);
    fprintf(out, "\nEvery flag may be spelled with underscores (--nproc_per_node); an unknown "
                 "one is an error naming the nearest known one.\n");
}

/* ---------------------------------------------------------------------------------------- */
/* Checks                                                                                   */

/* Prints "pshardrun: MESSAGE" and returns 2 (a usage error). */
static int run_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int run_usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs(RUN_PROG ": ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 2;
}

/* GPUs this process may use, as torch.cuda.device_count() would count them without CUDA:
 * CUDA_VISIBLE_DEVICES's entries when it is set (up to the first empty or "-1" one, where CUDA
 * stops), else the NVIDIA driver's GPUs in /proc/driver/nvidia/gpus; 0 without a driver. */
static int run_count_gpus(void)
{
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    if (visible) {
        int n = 0;
        for (const char *p = visible; *p;) {
            size_t len = strcspn(p, ",");
            if (len == 0 || (len == 2 && strncmp(p, "-1", 2) == 0))
                break;
            n++;
            p += len;
            if (*p == ',')
                p++;
        }
        return n;
    }
    DIR *d = opendir("/proc/driver/nvidia/gpus");
    if (!d)
        return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] != '.')
            n++;
    }
    closedir(d);
    return n;
}

/* --nproc-per-node: a number, or torchrun's gpu, cpu or auto, into o->nproc (which --nproc
 * set, and which must then agree). Returns 0 or 2 after saying why. */
static int run_resolve_nproc(run_opts_t *o)
{
    const char *v = o->nproc_per_node;
    if (!v)
        return 0;
    int64_t n = 0;
    if (ps_parse_i64(v, 1, RUN_MAX_NPROC, &n) == 0) {
        /* a number */
    } else if (strcmp(v, "gpu") == 0 || strcmp(v, "auto") == 0) {
        n = run_count_gpus();
        if (n == 0 && strcmp(v, "gpu") == 0)
            return run_usage_error("--nproc-per-node gpu: no GPU found (CUDA_VISIBLE_DEVICES, "
                                   "/proc/driver/nvidia/gpus)");
        if (n == 0) {
            long cpus = sysconf(_SC_NPROCESSORS_ONLN);
            n = cpus > 0 ? cpus : 1;
        }
    } else if (strcmp(v, "cpu") == 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        n = cpus > 0 ? cpus : 1;
    } else {
        return run_usage_error("--nproc-per-node '%s' is not a number from 1 to %d, gpu, cpu or "
                               "auto",
                               v, RUN_MAX_NPROC);
    }
    if (n > RUN_MAX_NPROC)
        n = RUN_MAX_NPROC;
    if (o->nproc != 1 && o->nproc != n)
        return run_usage_error("--nproc %lld and --nproc-per-node %s (%lld) differ: give one",
                               (long long)o->nproc, v, (long long)n);
    if (!isdigit((unsigned char)v[0]))
        fprintf(stderr, RUN_PROG ": --nproc-per-node %s: %lld per node\n", v, (long long)n);
    o->nproc = n;
    return 0;
}

/* --nnodes "N" or "MIN:MAX" into run->nnodes_min and run->nnodes (the maximum). Returns 0 or 2
 * after saying why. */
static int run_parse_nnodes(run_t *run, const char *text)
{
    const char *colon = strchr(text, ':');
    int64_t lo = 0, hi = 0;
    bool ok;
    if (colon) {
        char first[24];
        size_t len = (size_t)(colon - text);
        ok = len > 0 && len < sizeof(first);
        if (ok) {
            memcpy(first, text, len);
            first[len] = '\0';
            ok = ps_parse_i64(first, 1, RUN_MAX_NPROC, &lo) == 0 &&
                 ps_parse_i64(colon + 1, 1, RUN_MAX_NPROC, &hi) == 0 && lo <= hi;
        }
    } else {
        ok = ps_parse_i64(text, 1, RUN_MAX_NPROC, &lo) == 0;
        hi = lo;
    }
    if (!ok)
        return run_usage_error("--nnodes '%s' is not N or MIN:MAX with 1 <= MIN <= MAX <= %d", text,
                               RUN_MAX_NPROC);
    run->nnodes_min = (int)lo;
    run->nnodes = (int)hi;
    return 0;
}

/* torchrun's Std spec of --redirects or --tee: "0".."3" for every local rank, or
 * "LOCAL_RANK:STD,..." for some (the rest get 0), into out[0..nproc). Returns 0 or 2 after
 * saying why. */
static int run_parse_std(const char *flag, const char *text, int nproc, unsigned char *out)
{
    int64_t v = 0;
    if (ps_parse_i64(text, 0, 3, &v) == 0) {
        memset(out, (int)v, (size_t)nproc);
        return 0;
    }
    memset(out, 0, (size_t)nproc);
    bool seen[RUN_MAX_NPROC] = {false};
    for (const char *p = text;;) {
        size_t len = strcspn(p, ",");
        char item[48];
        if (len == 0 || len >= sizeof(item))
            return run_usage_error("--%s '%s' is not 0-3 or LOCAL_RANK:0-3,... (e.g. 0:1,1:2)",
                                   flag, text);
        memcpy(item, p, len);
        item[len] = '\0';
        char *colon = strchr(item, ':');
        int64_t rank = 0;
        if (!colon)
            return run_usage_error("--%s '%s': '%s' is not LOCAL_RANK:0-3", flag, text, item);
        *colon = '\0';
        if (ps_parse_i64(item, 0, INT64_MAX, &rank) != 0 || ps_parse_i64(colon + 1, 0, 3, &v) != 0)
            return run_usage_error("--%s '%s': '%s:%s' is not LOCAL_RANK:0-3", flag, text, item,
                                   colon + 1);
        if (rank >= nproc)
            return run_usage_error("--%s '%s': local rank %lld is not below --nproc-per-node %d",
                                   flag, text, (long long)rank, nproc);
        if (seen[rank])
            return run_usage_error("--%s '%s': local rank %lld given twice", flag, text,
                                   (long long)rank);
        seen[rank] = true;
        out[rank] = (unsigned char)v;
        p += len;
        if (*p == '\0')
            return 0;
        p++;
    }
}

/* --local-ranks-filter "0,2": every other local rank's trainer output is hidden. Returns 0 or
 * 2 after saying why. */
static int run_parse_filter(const char *text, int nproc, bool *hidden)
{
    for (int r = 0; r < nproc; r++)
        hidden[r] = true;
    for (const char *p = text;;) {
        size_t len = strcspn(p, ",");
        char item[24];
        int64_t rank = 0;
        bool ok = len > 0 && len < sizeof(item);
        if (ok) {
            memcpy(item, p, len);
            item[len] = '\0';
            ok = ps_parse_i64(item, 0, INT64_MAX, &rank) == 0;
        }
        if (!ok)
            return run_usage_error("--local-ranks-filter '%s' is not a comma-separated list of "
                                   "local ranks (e.g. 0,1,2)",
                                   text);
        if (rank >= nproc)
            return run_usage_error("--local-ranks-filter '%s': local rank %lld is not below "
                                   "--nproc-per-node %d",
                                   text, (long long)rank, nproc);
        hidden[rank] = false;
        p += len;
        if (*p == '\0')
            return 0;
        p++;
    }
}

/* Seconds as a decimal ("0.1", "30") into milliseconds, rounded up, within (0, max_s] ([0, max_s]
 * with zero_ok). Returns 0, or -1 when it is not such a number. */
static int run_parse_seconds(const char *text, double max_s, bool zero_ok, int64_t *ms)
{
    char *end = NULL;
    errno = 0;
    double s = strtod(text, &end);
    /* NaN fails both comparisons; infinities fail one. */
    if (errno != 0 || end == text || *end != '\0' ||
        !((s > 0 || (zero_ok && s == 0)) && s <= max_s) || isspace((unsigned char)text[0]))
        return -1;
    *ms = (int64_t)(s * 1000.0);
    if ((double)*ms < s * 1000.0)
        (*ms)++;
    return 0;
}

/* --rdzv-conf "KEY=VALUE,...": the keys torchrun's rendezvous takes that mean something to
 * pshardrun's; any other key is refused. Sets *is_host when is_host is given (left alone
 * otherwise). Returns 0 or 2 after saying why. */
static int run_parse_rdzv_conf(run_t *run, const char *text, int *is_host)
{
    for (const char *p = text; *p;) {
        size_t len = strcspn(p, ",");
        char item[128];
        if (len == 0 || len >= sizeof(item))
            return run_usage_error("--rdzv-conf '%s' is not KEY=VALUE,...", text);
        memcpy(item, p, len);
        item[len] = '\0';
        char *eq = strchr(item, '=');
        if (!eq)
            return run_usage_error("--rdzv-conf '%s': '%s' is not KEY=VALUE", text, item);
        *eq = '\0';
        const char *key = item, *value = eq + 1;
        int64_t ms = 0;
        if (strcmp(key, "join_timeout") == 0 || strcmp(key, "last_call_timeout") == 0) {
            if (run_parse_seconds(value, 86400, false, &ms) != 0)
                return run_usage_error("--rdzv-conf %s=%s is not a number of seconds (up to a "
                                       "day)",
                                       key, value);
            if (key[0] == 'j')
                run->join_timeout_ms = ms;
            else
                run->last_call_ms = ms;
        } else if (strcmp(key, "is_host") == 0) {
            if (strcmp(value, "true") == 0 || strcmp(value, "1") == 0)
                *is_host = 1;
            else if (strcmp(value, "false") == 0 || strcmp(value, "0") == 0)
                *is_host = 0;
            else
                return run_usage_error("--rdzv-conf is_host=%s is not true or false", value);
        } else {
            return run_usage_error("--rdzv-conf key '%s' is not one pshardrun takes: "
                                   "join_timeout, last_call_timeout, is_host",
                                   key);
        }
        p += len;
        if (*p == ',')
            p++;
    }
    return 0;
}

/* --signals-to-handle "SIGTERM,SIGINT,...": into run->handled. Returns 0 or 2 after saying
 * why. */
static int run_parse_signals(run_t *run, const char *text)
{
    static const struct {
        const char *name;
        int sig;
    } known[] = {{"SIGTERM", SIGTERM}, {"SIGINT", SIGINT},   {"SIGHUP", SIGHUP},
                 {"SIGQUIT", SIGQUIT}, {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}};
    sigemptyset(&run->handled);
    for (const char *p = text;;) {
        size_t len = strcspn(p, ",");
        while (len > 0 && *p == ' ') {
            p++;
            len--;
        }
        size_t k = 0;
        for (; k < PS_ARRAY_LEN(known); k++) {
            if (strlen(known[k].name) == len && strncmp(known[k].name, p, len) == 0)
                break;
        }
        if (k == PS_ARRAY_LEN(known))
            return run_usage_error("--signals-to-handle '%s': '%.*s' is not one of SIGTERM, "
                                   "SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2",
                                   text, (int)len, p);
        sigaddset(&run->handled, known[k].sig);
        p += len;
        if (*p == '\0')
            return 0;
        p++;
    }
}

/* A name for output prefixes and ROLE_NAME: 1 to 32 of A-Z a-z 0-9 . _ - */
static bool run_is_name(const char *s, size_t max)
{
    size_t len = strlen(s);
    bool ok = len >= 1 && len <= max;
    for (size_t i = 0; ok && i < len; i++)
        ok = isalnum((unsigned char)s[i]) || strchr("._-", s[i]);
    return ok;
}

/* torchrun's flags that pshardrun cannot honour, refused with what to do instead; and the
 * ones it takes but that change nothing here, checked. Returns 0 or 2. */
static int run_check_torch_only(const run_opts_t *o)
{
    if (o->run_path)
        return run_usage_error("--run-path runs the script inside torchrun's own Python, and "
                               "pshardrun has none: leave it out (the script runs with python3 "
                               "as without it)");
    if (o->logs_specs)
        return run_usage_error("--logs-specs '%s': pshardrun loads no torchrun.logs_specs entry "
                               "points; use --log-dir, --redirects and --tee",
                               o->logs_specs);
    if (o->numa_binding)
        return run_usage_error("--numa-binding '%s': pshardrun does not bind trainers to NUMA "
                               "nodes; run the trainer under numactl instead",
                               o->numa_binding);
    /* torchrun's empty filter list duplicates nothing, so an empty one is taken. */
    bool dup_out = o->duplicate_stdout_filters && *o->duplicate_stdout_filters;
    bool dup_err = o->duplicate_stderr_filters && *o->duplicate_stderr_filters;
    if (dup_out || dup_err)
        return run_usage_error("--duplicate-%s-filters: pshardrun does not copy matching lines "
                               "to another file; give --tee 3 --log-dir DIR and grep the files "
                               "(LOG_DIR/RUNID_XXXXXX/attempt_K/LOCAL_RANK/stdout.log, "
                               "stderr.log)",
                               dup_out ? "stdout" : "stderr");
    if (o->virtual_local_rank)
        return run_usage_error("--virtual-local-rank: pshardrun leaves CUDA_VISIBLE_DEVICES and "
                               "LOCAL_RANK as they are; leave it out and pick the trainer's GPU "
                               "with torch.cuda.set_device(LOCAL_RANK)");
    if (o->print_completion)
        return run_usage_error("--print-completion %s: pshardrun prints no shell completion "
                               "script; --help lists its flags",
                               o->print_completion);
    if (strcmp(o->event_log_handler, "null") != 0)
        return run_usage_error("--event-log-handler '%s': pshardrun has no torchelastic event "
                               "handlers; only 'null' is taken",
                               o->event_log_handler);
    if (strcmp(o->start_method, "spawn") != 0 && strcmp(o->start_method, "fork") != 0 &&
        strcmp(o->start_method, "forkserver") != 0)
        return run_usage_error("--start-method '%s' is not spawn, fork or forkserver",
                               o->start_method);
    if (!o->standalone && strcmp(o->rdzv_backend, "pshard") != 0 &&
        strcmp(o->rdzv_backend, "static") != 0)
        return run_usage_error("--rdzv-backend '%s': pshardrun's rendezvous is its own "
                               "coordinator (pshard-coordinator at --rdzv-endpoint); give "
                               "--rdzv-backend pshard (torchrun's default, static, means the "
                               "same here)",
                               o->rdzv_backend);
    if (!run_is_name(o->role, 32))
        return run_usage_error("--role '%s' must be 1 to 32 of A-Z a-z 0-9 . _ -", o->role);
    if (o->module && o->no_python)
        return run_usage_error("give -m/--module or --no-python, not both (a module runs with "
                               "Python)");
    return 0;
}

/* The index of flag in run_options; the flag is one of the table's. */
static size_t run_option_index(const char *flag)
{
    size_t i = 0;
    while (i < run_noptions && strcmp(run_options[i].flag, flag) != 0)
        i++;
    return i;
}

/* --shutdown-timeout, torchrun's name for --stop-grace-ms in seconds, into o->stop_grace_ms;
 * both given (and differing) is an error. Returns 0 or 2 after saying why. */
static int run_resolve_shutdown_timeout(run_opts_t *o, const ps_config_result_t *res)
{
    if (!o->shutdown_timeout)
        return 0;
    int64_t ms = 0;
    if (run_parse_seconds(o->shutdown_timeout, 3600, true, &ms) != 0)
        return run_usage_error("--shutdown-timeout '%s' is not a number of seconds from 0 to "
                               "3600 (e.g. 30)",
                               o->shutdown_timeout);
    if (res->source[run_option_index("stop-grace-ms")] != PS_SRC_DEFAULT && o->stop_grace_ms != ms)
        return run_usage_error("--shutdown-timeout %s and --stop-grace-ms %lld differ: give one",
                               o->shutdown_timeout, (long long)o->stop_grace_ms);
    o->stop_grace_ms = ms;
    return 0;
}

/* --log-line-prefix-template: its names known, and its longest expansion (the widest ranks)
 * within a prefix. Returns 0 or 2 after saying why. */
static int run_check_prefix_template(const run_opts_t *o)
{
    if (!o->log_line_prefix_template || !*o->log_line_prefix_template)
        return 0; /* torchrun's default, "": the usual prefix */
    char host[256] = "", out[RUN_MAX_PREFIX], bad[64] = "";
    gethostname(host, sizeof(host) - 1);
    int r = run_format_prefix(o->log_line_prefix_template, o->role, host, INT_MAX, INT_MAX, out,
                              sizeof(out), bad, sizeof(bad));
    if (r == -2)
        return run_usage_error("--log-line-prefix-template '%s': '%s' is not one of ${role_name}, "
                               "${local_rank}, ${rank}, ${hostname} (a '$' is '$$')",
                               o->log_line_prefix_template, bad);
    if (r != 0)
        return run_usage_error("--log-line-prefix-template '%s' may expand to more than %d bytes",
                               o->log_line_prefix_template, RUN_MAX_PREFIX - 1);
    return 0;
}

int run_check_opts(run_t *run, run_opts_t *o, const ps_config_result_t *res)
{
    ps_log_level_t level;
    if (!ps_log_parse_level(o->log, &level))
        return run_usage_error("--log '%s' is not error|warn|info|debug|trace", o->log);
    ps_log_set_level(level);
    if (strcmp(o->backend, "tcp") != 0 && strcmp(o->backend, "nccl") != 0)
        return run_usage_error("--backend '%s' is not tcp or nccl", o->backend);
    if (strcmp(o->offload, "none") != 0 && strcmp(o->offload, "cpu") != 0)
        return run_usage_error("--offload '%s' is not none or cpu", o->offload);
    if (strcmp(o->shard_memory, "auto") != 0 && strcmp(o->shard_memory, "host") != 0 &&
        strcmp(o->shard_memory, "gpu") != 0)
        return run_usage_error("--shard-memory '%s' is not auto, host or gpu", o->shard_memory);
    if (strcmp(o->shard_memory, "gpu") == 0 && strcmp(o->offload, "cpu") == 0)
        return run_usage_error("--shard-memory gpu and --offload cpu: the shards are in GPU "
                               "memory or in host memory, give one");
    if (o->token_file && access(o->token_file, R_OK) != 0)
        return run_usage_error("--token-file %s: %s", o->token_file, strerror(errno));
    if (run_check_torch_only(o) != 0 || run_resolve_nproc(o) != 0 ||
        run_parse_nnodes(run, o->nnodes) != 0 ||
        run_parse_signals(run, o->signals_to_handle) != 0 ||
        run_resolve_shutdown_timeout(o, res) != 0 || run_check_prefix_template(o) != 0)
        return 2;
    if (run_parse_seconds(o->monitor_interval, 3600, false, &run->monitor_ms) != 0)
        return run_usage_error("--monitor-interval '%s' is not a number of seconds from 0 to "
                               "3600 (e.g. 0.1)",
                               o->monitor_interval);
    int nproc = (int)o->nproc;
    if (run_parse_std("redirects", o->redirects, nproc, run->redirects) != 0 ||
        run_parse_std("tee", o->tee, nproc, run->tee) != 0)
        return 2;
    if (o->local_ranks_filter && run_parse_filter(o->local_ranks_filter, nproc, run->hidden) != 0)
        return 2;
    int is_host = -1;
    if (o->rdzv_conf && run_parse_rdzv_conf(run, o->rdzv_conf, &is_host) != 0)
        return 2;

    if (o->standalone) {
        /* torchrun's --standalone: one node, its own rendezvous on a free local port; the
         * rendezvous flags are replaced, which is said, not done in silence. */
        if (run->nnodes != 1)
            return run_usage_error("--standalone is one node; --nnodes is %s", o->nnodes);
        if (o->coordinator)
            return run_usage_error("--standalone starts a coordinator of its own; drop "
                                   "--coordinator %s",
                                   o->coordinator);
        bool backend = strcmp(o->rdzv_backend, "static") != 0;
        if (backend || o->rdzv_endpoint || o->rdzv_id || o->master_addr || o->master_port)
            fprintf(stderr,
                    RUN_PROG ": --standalone: ignoring%s%s%s%s%s%s%s%s (a coordinator of its own "
                             "on 127.0.0.1, a job of its own)\n",
                    backend ? " --rdzv-backend " : "", backend ? o->rdzv_backend : "",
                    o->rdzv_endpoint ? " --rdzv-endpoint " : "",
                    o->rdzv_endpoint ? o->rdzv_endpoint : "", o->rdzv_id ? " --rdzv-id " : "",
                    o->rdzv_id ? o->rdzv_id : "", o->master_addr ? " --master-addr" : "",
                    o->master_port ? " --master-port" : "");
        free(o->rdzv_endpoint);
        free(o->rdzv_id);
        free(o->master_addr);
        o->rdzv_endpoint = o->rdzv_id = o->master_addr = NULL;
        o->master_port = 0;
    }
    if ((o->master_addr || o->master_port > 0) && (o->rdzv_endpoint || o->coordinator))
        /* torchrun ignores them beside another rendezvous; pshardrun says so instead. */
        return run_usage_error("--master-addr/--master-port name the endpoint, as --%s does: "
                               "give one of them",
                               o->rdzv_endpoint ? "rdzv-endpoint" : "coordinator");
    if (o->master_addr || o->master_port > 0) {
        /* torch.distributed.launch's way to name the endpoint. */
        const char *host = o->master_addr ? o->master_addr : "127.0.0.1";
        int port = o->master_port > 0 ? (int)o->master_port : 29500;
        size_t len = strlen(host) + 16;
        o->rdzv_endpoint = malloc(len);
        if (!o->rdzv_endpoint)
            return run_usage_error("out of memory");
        bool v6 = strchr(host, ':') && host[0] != '[';
        ps_snprintf(o->rdzv_endpoint, len, "%s%s%s:%d", v6 ? "[" : "", host, v6 ? "]" : "", port);
    }

    run->node_rank = (int)o->node_rank;
    if (o->node_rank >= run->nnodes)
        return run_usage_error("--node-rank %lld is not below --nnodes %s", (long long)o->node_rank,
                               o->nnodes);
    if (run->nnodes > 1 && !o->rdzv_endpoint && !o->coordinator)
        return run_usage_error("--nnodes %s needs --rdzv-endpoint HOST:PORT (where node rank 0 "
                               "starts the coordinator) or --coordinator",
                               o->nnodes);
    if (run->nnodes_min < run->nnodes && o->coordinator)
        return run_usage_error("--nnodes %s (elastic) needs --rdzv-endpoint: the coordinator "
                               "pshardrun starts there waits for MIN to MAX nodes",
                               o->nnodes);
    if (run->nnodes > 1 && o->max_restarts > 0 && o->replace_timeout_ms == 0)
        return run_usage_error("--max-restarts with --nnodes %s replaces failed trainers alone, "
                               "which --replace-timeout-ms 0 turns off: a full restart is not "
                               "coordinated across nodes yet",
                               o->nnodes);
    if (run->nnodes > 1 && o->coordinator && !o->rdzv_id)
        /* Each node would make up a job id of its own, and the nodes would never meet. */
        return run_usage_error("--nnodes %s with --coordinator needs --rdzv-id (the same on every "
                               "node)",
                               o->nnodes);
    if (o->rdzv_endpoint && o->coordinator)
        return run_usage_error("give --rdzv-endpoint or --coordinator, not both");
    if (o->rdzv_endpoint && o->nproc * run->nnodes > 65536)
        return run_usage_error("%d nodes of %lld are more than 65536 ranks", run->nnodes,
                               (long long)o->nproc);
    run->host = is_host >= 0 ? is_host == 1 : o->node_rank == 0;
    if (is_host >= 0 && !o->rdzv_endpoint)
        return run_usage_error("--rdzv-conf is_host needs --rdzv-endpoint");
    if (o->local_addr) {
        /* A host name or IPv4 address, or an IPv6 one (hex digits, ':', '.', a %zone). */
        size_t len = strlen(o->local_addr);
        bool v6 = strchr(o->local_addr, ':') && len < sizeof(run->data_host) &&
                  strspn(o->local_addr, "0123456789abcdefABCDEF:.%") == len;
        if (!run_is_name(o->local_addr, sizeof(run->data_host) - 1) && !v6)
            return run_usage_error("--local-addr '%s' is not a host name or address",
                                   o->local_addr);
        ps_strlcpy(run->data_host, o->local_addr, sizeof(run->data_host));
    }
    if (o->rdzv_endpoint) {
        if (run_parse_coordinator(run, o->rdzv_endpoint, run->host) != 0)
            return run_usage_error("--rdzv-endpoint '%s' is not HOST:PORT", o->rdzv_endpoint);
        run->endpoint = run->host;
        if (run->nnodes > 1 && !o->local_addr && run_local_address(run) != 0)
            return 2;
    }
    if (o->coordinator && run_parse_coordinator(run, o->coordinator, false) != 0)
        return run_usage_error("--coordinator '%s' is not HOST:PORT", o->coordinator);
    if (o->coordinator && o->lease_ms > 0)
        fprintf(stderr, RUN_PROG ": --lease-ms is ignored with --coordinator (the running "
                                 "coordinator's lease applies)\n");
    if (o->rdzv_id) {
        if (!run_is_name(o->rdzv_id, 64))
            return run_usage_error("--rdzv-id '%s' must be 1 to 64 of A-Z a-z 0-9 . _ -",
                                   o->rdzv_id);
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

/* ---------------------------------------------------------------------------------------- */
/* The trainers' command                                                                    */

/* True when path names an executable regular file. */
static bool run_is_program(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

/* "The current Python" for a bare script or -m, as torchrun's is its own interpreter:
 * $PYTHON_EXEC when set (torchrun's override), else python3 beside pshardrun's executable (a
 * virtual environment's bin/, where the wheel installs pshardrun), else python3 on PATH.
 * Into run->python; returns 0, or 2 after saying why. */
static int run_find_python(run_t *run)
{
    const char *exec = getenv("PYTHON_EXEC");
    if (exec && *exec) {
        if (strchr(exec, '/') && !run_is_program(exec))
            return run_usage_error("PYTHON_EXEC=%s is not an executable file", exec);
        if (ps_strlcpy(run->python, exec, sizeof(run->python)) != 0)
            return run_usage_error("PYTHON_EXEC is too long");
        return 0;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = '\0';
            if (ps_snprintf(run->python, sizeof(run->python), "%s/python3", exe) == 0 &&
                run_is_program(run->python))
                return 0;
        }
    }
    const char *p = getenv("PATH");
    while (p && *p) {
        size_t len = strcspn(p, ":");
        if (len > 0 &&
            ps_snprintf(run->python, sizeof(run->python), "%.*s/python3", (int)len, p) == 0 &&
            run_is_program(run->python))
            return 0;
        p += len;
        if (*p == ':')
            p++;
    }
    run->python[0] = '\0';
    return run_usage_error("no python3 to run the training script with: none beside pshardrun "
                           "(%s) and none on PATH; set PYTHON_EXEC, or give --no-python to run "
                           "it as a program",
                           n > 0 ? exe : "?");
}

int run_build_command(run_t *run, int argc, char **argv, int first, bool dashdash)
{
    const run_opts_t *o = run->opts;
    if (first >= argc) {
        if (dashdash)
            return run_usage_error("no trainer command after '--'; usage: " RUN_PROG
                                   " [OPTIONS] training_script [ARGS...] (see --help)");
        return run_usage_error("no trainer command; usage: " RUN_PROG " [OPTIONS] "
                               "training_script [ARGS...], or " RUN_PROG
                               " [OPTIONS] -- CMD [ARGS...] (see --help)");
    }
    /* After "--" the command runs as it is, as it always has; a bare script runs with Python
     * as under torchrun, unless --no-python; -m runs a module with Python either way. */
    bool python = o->module || (!dashdash && !o->no_python);
    size_t n = (size_t)(argc - first), at = 0;
    run->cmd = calloc(n + 4, sizeof(*run->cmd));
    if (!run->cmd)
        return run_usage_error("out of memory");
    if (python) {
        if (run_find_python(run) != 0)
            return 2;
        run->cmd[at++] = run->python;
        run->cmd[at++] = "-u";
        if (o->module)
            run->cmd[at++] = "-m";
    }
    for (int i = first; i < argc; i++)
        run->cmd[at++] = argv[i];
    run->cmd[at] = NULL;
    if (python)
        PS_INFO(PS_SUB_MAIN, "trainers run %s -u %s%s", run->python, o->module ? "-m " : "",
                argv[first]);
    return 0;
}
