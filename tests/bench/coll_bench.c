/* pshard-coll-bench: nccl-tests-style bandwidth figures for pshard's tcp collectives. The
 * launcher starts a coordinator (unless given one) and forks N copies of itself in a hidden rank
 * mode (--rank R --world N --coordinator HOST:PORT); the ranks form one communicator through the
 * coordinator's store, time every size of every requested operation, and rank 0 prints one
 * nccl-tests line per size. A benchmark, not a test: it fails only when an operation fails or
 * (with --check, the default) delivers wrong data. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pshard/collectives.h"
#include "pshard/config.h"
#include "pshard/dtype.h"
#include "pshard/log.h"
#include "pshard/util.h"

#define PROG "pshard-coll-bench"
#define MAX_RANKS 64
#define MAX_SIZES 64
#define NS_PER_MS 1000000LL
#define NS_PER_S 1000000000LL
#define STARTUP_MS 20000   /* coordinator: write the port file within this */
#define STOP_GRACE_MS 5000 /* SIGTERM, then SIGKILL after this */

/* ------------------------------------------------------------------------------------------ */
/* Options                                                                                     */

typedef struct {
    int64_t nranks;        /* -n: rank processes the launcher forks */
    char *minbytes;        /* -b: first size ("1M") */
    char *maxbytes;        /* -e: last size */
    int64_t stepfactor;    /* -f: next size = size * f */
    char *op;              /* -o: all_gather|reduce_scatter|all_reduce|broadcast|all */
    char *datatype;        /* -d: fp32|bf16|fp16 */
    int64_t warmup_iters;  /* -w: untimed operations before each size */
    int64_t iters;         /* -i: timed operations per size */
    int64_t root;          /* broadcast root */
    bool check;            /* -c: verify each size's result after timing it */
    bool blocking;         /* -z: each operation waited for before the next (as MPI's calls) */
    int64_t timeout_ms;    /* per-operation timeout */
    char *coordinator;     /* use this coordinator instead of starting one */
    char *coordinator_bin; /* the pshard-coordinator to start */
    char *log;             /* log level */
    /* Hidden rank mode, set by the launcher. */
    int64_t rank;  /* -1: this is the launcher */
    int64_t world; /* ranks in the communicator */
    char *run_id;  /* keeps the store keys of concurrent runs on one coordinator apart */
} bench_opts_t;

#define OPT(flag, env, type, def, help, field, lo, hi)                                             \
    {                                                                                              \
        flag, env, type, def, help, offsetof(bench_opts_t, field), lo, hi                          \
    }

static const ps_option_t options[] = {
    OPT("nranks", "PSHARD_BENCH_NRANKS", PS_OPT_INT, "2", "-n: rank processes to fork", nranks, 1,
        MAX_RANKS),
    OPT("minbytes", "PSHARD_BENCH_MINBYTES", PS_OPT_STRING, "1M",
        "-b: first size in bytes (suffix K, M, G = 2^10, 2^20, 2^30)", minbytes, 0, 0),
    OPT("maxbytes", "PSHARD_BENCH_MAXBYTES", PS_OPT_STRING, "128M", "-e: last size in bytes",
        maxbytes, 0, 0),
    OPT("stepfactor", "PSHARD_BENCH_STEPFACTOR", PS_OPT_INT, "2",
        "-f: multiply the size by this between rows", stepfactor, 2, 1024),
    OPT("op", "PSHARD_BENCH_OP", PS_OPT_STRING, "all",
        "-o: all_gather|reduce_scatter|all_reduce|broadcast|all", op, 0, 0),
    OPT("datatype", "PSHARD_BENCH_DATATYPE", PS_OPT_STRING, "fp32", "-d: fp32|bf16|fp16", datatype,
        0, 0),
    OPT("warmup-iters", "PSHARD_BENCH_WARMUP_ITERS", PS_OPT_INT, "5",
        "-w: untimed operations before each size", warmup_iters, 0, 100000),
    OPT("iters", "PSHARD_BENCH_ITERS", PS_OPT_INT, "20", "-i: timed operations per size", iters, 1,
        100000),
    OPT("root", "PSHARD_BENCH_ROOT", PS_OPT_INT, "0", "broadcast root rank", root, 0,
        MAX_RANKS - 1),
    OPT("check", "PSHARD_BENCH_CHECK", PS_OPT_BOOL, "true",
        "-c: verify every size's output after timing it (#wrong column)", check, 0, 0),
    OPT("blocking", "PSHARD_BENCH_BLOCKING", PS_OPT_BOOL, "false",
        "-z: wait for each operation before starting the next (pshard_coll_run, as MPI's "
        "blocking calls and nccl-tests' -z 1) instead of queueing them all",
        blocking, 0, 0),
    OPT("timeout-ms", "PSHARD_BENCH_TIMEOUT_MS", PS_OPT_INT, "600000",
        "per-operation timeout (and the communicator's connect timeout)", timeout_ms, 100,
        86400000),
    OPT("coordinator", "PSHARD_BENCH_COORDINATOR", PS_OPT_STRING, NULL,
        "use the coordinator serving at HOST:PORT (no token) instead of starting one", coordinator,
        0, 0),
    OPT("coordinator-bin", "PSHARD_COORDINATOR_BIN", PS_OPT_STRING, NULL,
        "pshard-coordinator to start (default: ../../coordinator/pshard-coordinator relative to "
        "this program, then next to it)",
        coordinator_bin, 0, 0),
    OPT("log", "PSHARD_LOG", PS_OPT_STRING, "warn", "log level: error|warn|info|debug|trace", log,
        0, 0),
    OPT("rank", NULL, PS_OPT_INT, "-1", "internal: run as this rank (set by the launcher)", rank,
        -1, MAX_RANKS - 1),
    OPT("world", NULL, PS_OPT_INT, "0", "internal: ranks in the communicator (rank mode)", world, 0,
        MAX_RANKS),
    OPT("run-id", NULL, PS_OPT_STRING, NULL, "internal: communicator name suffix (rank mode)",
        run_id, 0, 0),
};

/* nccl-tests spell their options with one letter; ps_config_parse knows only long flags, so
 * the short ones are rewritten to their long names before parsing ("-n 4", "-n4"). */
static const struct {
    char letter;
    const char *flag;
} short_flags[] = {
    {'n', "--nranks"}, {'b', "--minbytes"}, {'e', "--maxbytes"},     {'f', "--stepfactor"},
    {'o', "--op"},     {'d', "--datatype"}, {'w', "--warmup-iters"}, {'i', "--iters"},
    {'c', "--check"},  {'z', "--blocking"},
};

/* Returns a new argv (malloc'd array, strings borrowed from argv or static, plus "--check=0"
 * style strings malloc'd into *owned) with the short flags rewritten; NULL on a bad short flag
 * (message in err). Free the array and each of owned[0..*nowned). */
static char **expand_short_flags(int argc, char **argv, int *out_argc, char **owned, int *nowned,
                                 char *err, size_t errlen)
{
    char **out = calloc((size_t)argc * 2 + 1, sizeof(char *));
    if (!out)
        return NULL;
    int n = 0;
    *nowned = 0;
    out[n++] = argv[0];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            while (i < argc)
                out[n++] = argv[i++];
            break;
        }
        if (a[0] != '-' || a[1] == '-' || a[1] == '\0' || strcmp(a, "-h") == 0) {
            out[n++] = argv[i];
            continue;
        }
        size_t k = 0;
        while (k < PS_ARRAY_LEN(short_flags) && short_flags[k].letter != a[1])
            k++;
        if (k == PS_ARRAY_LEN(short_flags)) {
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown flag %s", a);
            free(out);
            return NULL;
        }
        const char *value = a[2] ? a + 2 : (i + 1 < argc ? argv[++i] : NULL);
        if (!value) {
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s needs a value", a);
            free(out);
            return NULL;
        }
        /* "-c 0" is a boolean: pass it as --check=0 so it is not taken for a positional. */
        size_t len = strlen(short_flags[k].flag) + strlen(value) + 2;
        char *joined = malloc(len);
        if (!joined) {
            free(out);
            return NULL;
        }
        snprintf(joined, len, "%s=%s", short_flags[k].flag, value);
        owned[(*nowned)++] = joined;
        out[n++] = joined;
    }
    out[n] = NULL;
    *out_argc = n;
    return out;
}

/* Parses "64", "1K", "16M", "1G", "2GiB" (binary multiples) into bytes; 0 or -1. */
static int parse_size(const char *text, size_t *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || end == text || text[0] == '-')
        return -1;
    unsigned shift = 0;
    switch (*end) {
    case 'k':
    case 'K':
        shift = 10;
        end++;
        break;
    case 'm':
    case 'M':
        shift = 20;
        end++;
        break;
    case 'g':
    case 'G':
        shift = 30;
        end++;
        break;
    default:
        break;
    }
    if (strcasecmp(end, "") != 0 && strcasecmp(end, "B") != 0 && strcasecmp(end, "iB") != 0)
        return -1;
    if (v > (SIZE_MAX >> shift))
        return -1;
    *out = (size_t)(v << shift);
    return 0;
}

static const pshard_coll_op_t all_ops[] = {PSHARD_COLL_ALL_GATHER, PSHARD_COLL_REDUCE_SCATTER,
                                           PSHARD_COLL_ALL_REDUCE, PSHARD_COLL_BROADCAST};

/* Fills ops[] from --op; returns how many, or 0 for an unknown name. */
static size_t parse_ops(const char *text, pshard_coll_op_t *ops)
{
    if (strcmp(text, "all") == 0) {
        memcpy(ops, all_ops, sizeof(all_ops));
        return PS_ARRAY_LEN(all_ops);
    }
    for (size_t i = 0; i < PS_ARRAY_LEN(all_ops); i++) {
        if (strcmp(text, pshard_coll_op_name(all_ops[i])) == 0) {
            ops[0] = all_ops[i];
            return 1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Rank mode                                                                                   */

/* Element values: rank r's input is r + 1 everywhere, so every expected output is a small
 * integer (at most 64 * 65 / 2 = 2080). Reductions round once from an fp32 sum, so the reference
 * is that integer rounded to the dtype (bf16 holds integers exactly only up to 256). */
static void store_value(void *buf, pshard_dtype_t dt, size_t i, float v)
{
    switch (dt) {
    case PSHARD_FP32:
        ((float *)buf)[i] = v;
        break;
    case PSHARD_BF16:
        ((uint16_t *)buf)[i] = ps_f32_to_bf16(v);
        break;
    case PSHARD_FP16:
        ((uint16_t *)buf)[i] = ps_f32_to_f16(v);
        break;
    case PSHARD_INT64:
        ((int64_t *)buf)[i] = (int64_t)v;
        break;
    case PSHARD_FP64:
        ((double *)buf)[i] = v;
        break;
    case PSHARD_INT32:
        ((int32_t *)buf)[i] = (int32_t)v;
        break;
    case PSHARD_UINT8:
        ((uint8_t *)buf)[i] = (uint8_t)v; /* small worlds only: wraps past 255 */
        break;
    }
}

static float load_value(const void *buf, pshard_dtype_t dt, size_t i)
{
    switch (dt) {
    case PSHARD_FP32:
        return ((const float *)buf)[i];
    case PSHARD_BF16:
        return ps_bf16_to_f32(((const uint16_t *)buf)[i]);
    case PSHARD_FP16:
        return ps_f16_to_f32(((const uint16_t *)buf)[i]);
    case PSHARD_INT64:
        return (float)((const int64_t *)buf)[i];
    case PSHARD_FP64:
        return (float)((const double *)buf)[i];
    case PSHARD_INT32:
        return (float)((const int32_t *)buf)[i];
    case PSHARD_UINT8:
        return (float)((const uint8_t *)buf)[i];
    }
    return 0;
}

/* Counts the elements of recv[first, first + n) that differ from `want`. */
static int64_t count_wrong(const void *recv, pshard_dtype_t dt, size_t first, size_t n, float want)
{
    int64_t wrong = 0;
    uint64_t slot[1];
    store_value(slot, dt, 0, want);
    float w = load_value(slot, dt, 0);
    for (size_t i = first; i < first + n; i++)
        wrong += load_value(recv, dt, i) != w;
    return wrong;
}

typedef struct {
    size_t size;  /* bytes as nccl-tests define them for the op */
    size_t count; /* elements in those bytes */
    size_t arg;   /* pshard_coll_args_t.count */
} geometry_t;

/* Sizes per nccl-tests: all_gather's size is its output (per-rank count = size / n elements),
 * reduce_scatter's its input (n blocks of count), all_reduce's and broadcast's the buffer.
 * Sizes are rounded down to whole elements and, for the blocked ops, whole blocks. */
static geometry_t geometry(pshard_coll_op_t op, size_t bytes, size_t es, int n)
{
    geometry_t g = {0, 0, 0};
    if (op == PSHARD_COLL_ALL_GATHER || op == PSHARD_COLL_REDUCE_SCATTER) {
        g.arg = bytes / (es * (size_t)n);
        g.count = g.arg * (size_t)n;
    } else {
        g.arg = bytes / es;
        g.count = g.arg;
    }
    g.size = g.count * es;
    return g;
}

/* busbw / algbw: the fraction of the data each rank's link carries, as nccl-tests define it. */
static double bus_factor(pshard_coll_op_t op, int n)
{
    switch (op) {
    case PSHARD_COLL_ALL_GATHER:
    case PSHARD_COLL_REDUCE_SCATTER:
        return (double)(n - 1) / n;
    case PSHARD_COLL_ALL_REDUCE:
        return 2.0 * (n - 1) / n;
    default:
        return 1.0;
    }
}

static pshard_status_t barrier(pshard_comm_t *comm, char *err, size_t errlen)
{
    pshard_coll_args_t a = {.op = PSHARD_COLL_BARRIER, .label = "bench barrier"};
    return pshard_coll_run(comm, &a, err, errlen);
}

/* Issues `iters` operations back to back (all queued before the first wait, as nccl-tests
 * enqueue theirs on a stream) and waits for every one; blocking: each waited for before the
 * next is issued. */
static pshard_status_t run_iters(pshard_comm_t *comm, const pshard_coll_args_t *a, int64_t iters,
                                 bool blocking, pshard_coll_req_t **reqs, char *err, size_t errlen)
{
    pshard_status_t rc = PSHARD_OK;
    for (int64_t i = 0; blocking && i < iters && rc == PSHARD_OK; i++)
        rc = pshard_coll_run(comm, a, err, errlen);
    if (blocking)
        return rc;
    int64_t started = 0;
    for (; started < iters; started++) {
        rc = pshard_coll_start(comm, a, &reqs[started], err, errlen);
        if (rc != PSHARD_OK)
            break;
    }
    for (int64_t i = 0; i < started; i++) {
        pshard_status_t w = pshard_coll_wait(reqs[i], rc == PSHARD_OK ? err : NULL, errlen);
        if (rc == PSHARD_OK)
            rc = w;
        pshard_coll_req_free(reqs[i]);
    }
    return rc;
}

static int rank_main(const bench_opts_t *o, pshard_dtype_t dt, const pshard_coll_op_t *ops,
                     size_t nops, const size_t *sizes, size_t nsizes)
{
    int rank = (int)o->rank, n = (int)o->world;
    char err[1024] = "";
    char name[64];
    snprintf(name, sizeof(name), "coll-bench-%s", o->run_id ? o->run_id : "0");
    ps_log_set_rank(rank);
    pshard_comm_config_t cfg = {
        .rank = rank,
        .world_size = n,
        .backend = "tcp",
        .name = name,
        .coordinator = o->coordinator,
        .generation = 1,
        .timeout_ms = o->timeout_ms,
        .connect_timeout_ms = o->timeout_ms < 60000 ? o->timeout_ms : 60000,
    };
    pshard_comm_t *comm = NULL;
    size_t es = pshard_dtype_size(dt);
    size_t maxb = sizes[nsizes - 1];
    uint8_t *send = NULL, *recv = NULL;
    pshard_coll_req_t **reqs = NULL;
    int exit_code = 1;
    bool any_wrong = false;
    double busbw_sum = 0;
    int busbw_rows = 0;

    /* Every buffer is allocated once at the largest size and touched now, so page faults are
     * not timed. */
    send = malloc(maxb ? maxb : 1);
    recv = malloc(maxb ? maxb : 1);
    reqs = calloc((size_t)(o->iters > o->warmup_iters ? o->iters : o->warmup_iters) + 1,
                  sizeof(*reqs));
    if (!send || !recv || !reqs) {
        fprintf(stderr, PROG " rank %d: out of memory for %zu-byte buffers\n", rank, maxb);
        goto out;
    }
    memset(send, 0, maxb);
    memset(recv, 0, maxb);
    for (size_t i = 0; i < maxb / es; i++)
        store_value(send, dt, i, (float)(rank + 1));

    pshard_status_t rc = pshard_comm_create(&cfg, &comm, err, sizeof(err));
    if (rc != PSHARD_OK) {
        fprintf(stderr, PROG " rank %d: cannot join the communicator: %s: %s\n", rank,
                pshard_status_name(rc), err);
        goto out;
    }
    if (rank == 0) {
        printf("# %s: tcp backend, %d ranks (one process each), %s, warmup %lld, iters %lld%s\n",
               PROG, n, pshard_dtype_name(dt), (long long)o->warmup_iters, (long long)o->iters,
               getenv("PSHARD_SOCKET_BUFFER") ? ", PSHARD_SOCKET_BUFFER set" : "");
        printf("# time: the slowest rank's (end of its last of `iters` back-to-back operations -"
               " end of the opening barrier) / iters\n");
        printf("# algbw = size / time, busbw = algbw * (n-1)/n (all_gather, reduce_scatter),"
               " * 2(n-1)/n (all_reduce), * 1 (broadcast); GB/s = 1e9 B/s\n");
        printf("#\n# %12s %12s %6s %15s %11s %12s %12s %7s\n", "size(B)", "count", "type", "op",
               "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
        fflush(stdout);
    }

    for (size_t oi = 0; oi < nops; oi++) {
        pshard_coll_op_t op = ops[oi];
        for (size_t si = 0; si < nsizes; si++) {
            geometry_t g = geometry(op, sizes[si], es, n);
            if (g.arg == 0) {
                if (rank == 0)
                    printf("# %s: %zu bytes hold no %s element per rank: skipped\n",
                           pshard_coll_op_name(op), sizes[si], pshard_dtype_name(dt));
                continue;
            }
            pshard_coll_args_t a = {
                .op = op,
                .dtype = dt,
                .reduce = PSHARD_REDUCE_SUM,
                .root = (int)o->root,
                .send = send,
                .recv = recv,
                .count = g.arg,
                .tag = ((uint64_t)op << 48) | si,
            };
            /* Poisoned so a result the timed operations did not write fails the check. */
            if (o->check)
                memset(recv, 0xff, g.size);
            rc = run_iters(comm, &a, o->warmup_iters, o->blocking, reqs, err, sizeof(err));
            if (rc == PSHARD_OK)
                rc = barrier(comm, err, sizeof(err));
            int64_t t0 = ps_now_ns();
            if (rc == PSHARD_OK)
                rc = run_iters(comm, &a, o->iters, o->blocking, reqs, err, sizeof(err));
            int64_t elapsed = ps_now_ns() - t0;
            /* The closing barrier keeps this size's traffic out of the next size's timing; it
             * is not timed itself. Each rank's time is exchanged (an int64 all_gather) and the
             * slowest one reported, which is what a caller waiting for every rank sees. */
            if (rc == PSHARD_OK)
                rc = barrier(comm, err, sizeof(err));
            if (rc != PSHARD_OK) {
                fprintf(stderr, PROG " rank %d: %s of %zu bytes failed: %s: %s\n", rank,
                        pshard_coll_op_name(op), g.size, pshard_status_name(rc), err);
                goto out;
            }
            int64_t wrong = -1;
            if (o->check) {
                float sum = (float)n * (float)(n + 1) / 2.0f;
                switch (op) {
                case PSHARD_COLL_ALL_GATHER:
                    wrong = 0;
                    for (int r = 0; r < n; r++)
                        wrong += count_wrong(recv, dt, (size_t)r * g.arg, g.arg, (float)(r + 1));
                    break;
                case PSHARD_COLL_REDUCE_SCATTER:
                case PSHARD_COLL_ALL_REDUCE:
                    wrong = count_wrong(recv, dt, 0, g.arg, sum);
                    break;
                default:
                    wrong = count_wrong(recv, dt, 0, g.arg, (float)(o->root + 1));
                    break;
                }
            }
            int64_t mine[2] = {elapsed, wrong}, all[2 * MAX_RANKS];
            pshard_coll_args_t ga = {.op = PSHARD_COLL_ALL_GATHER,
                                     .dtype = PSHARD_INT64,
                                     .count = 2,
                                     .send = mine,
                                     .recv = all,
                                     .label = "bench times"};
            rc = pshard_coll_run(comm, &ga, err, sizeof(err));
            if (rc != PSHARD_OK) {
                fprintf(stderr, PROG " rank %d: exchanging times failed: %s: %s\n", rank,
                        pshard_status_name(rc), err);
                goto out;
            }
            int64_t slowest = 0, wrong_total = 0;
            for (int r = 0; r < n; r++) {
                slowest = all[2 * r] > slowest ? all[2 * r] : slowest;
                wrong_total += all[2 * r + 1] > 0 ? all[2 * r + 1] : 0;
            }
            if (wrong > 0)
                fprintf(stderr, PROG " rank %d: %s of %zu bytes: %" PRId64 " wrong elements\n",
                        rank, pshard_coll_op_name(op), g.size, wrong);
            if (rank == 0) {
                double us = (double)slowest / 1e3 / (double)o->iters;
                double algbw = (double)g.size / (us * 1e3); /* bytes per ns = GB/s */
                double busbw = algbw * bus_factor(op, n);
                char wrong_s[24];
                if (o->check)
                    snprintf(wrong_s, sizeof(wrong_s), "%" PRId64, wrong_total);
                else
                    ps_strlcpy(wrong_s, "N/A", sizeof(wrong_s));
                printf("  %12zu %12zu %6s %15s %11.2f %12.3f %12.3f %7s\n", g.size, g.count,
                       pshard_dtype_name(dt), pshard_coll_op_name(op), us, algbw, busbw, wrong_s);
                fflush(stdout);
                busbw_sum += busbw;
                busbw_rows++;
            }
            if (wrong_total > 0)
                any_wrong = true; /* remembered; the run goes on so every row is printed */
        }
    }
    if (rank == 0 && busbw_rows)
        printf("# Avg bus bandwidth    : %.3f GB/s\n", busbw_sum / busbw_rows);
    fflush(stdout);
    exit_code = any_wrong ? 1 : 0;
out:
    pshard_comm_destroy(comm);
    free(reqs);
    free(send);
    free(recv);
    return exit_code;
}

/* ------------------------------------------------------------------------------------------ */
/* Launcher                                                                                    */

static volatile sig_atomic_t g_signal;

static void on_signal(int sig)
{
    g_signal = sig;
}

static void sleep_ms(int64_t ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * NS_PER_MS};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR && !g_signal) {
    }
}

static bool is_executable(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

/* This program's own path (for re-executing itself as the ranks). */
static bool self_exe(char *out, size_t len)
{
    ssize_t n = readlink("/proc/self/exe", out, len - 1);
    if (n <= 0 || (size_t)n >= len - 1)
        return false;
    out[n] = '\0';
    return true;
}

/* pshard-coordinator in the build tree (tests/bench/../../coordinator), then beside us. */
static bool find_coordinator_bin(const char *exe, char *out, size_t len)
{
    char dir[PATH_MAX];
    if (ps_strlcpy(dir, exe, sizeof(dir)) != 0)
        return false;
    char *slash = strrchr(dir, '/');
    if (!slash)
        return false;
    *slash = '\0';
    static const char *const rel[] = {"../../coordinator/pshard-coordinator", "pshard-coordinator"};
    for (size_t i = 0; i < PS_ARRAY_LEN(rel); i++) {
        if (ps_snprintf(out, len, "%s/%s", dir, rel[i]) == 0 && is_executable(out)) {
            char real[PATH_MAX];
            if (realpath(out, real))
                ps_strlcpy(out, real, len);
            return true;
        }
    }
    return false;
}

/* Forks and execs argv; the child dies with us (PR_SET_PDEATHSIG) so a SIGKILLed launcher
 * leaves nothing behind. stdout goes to /dev/null when quiet. Returns the PID or -1. */
static pid_t spawn(char *const argv[], bool quiet, int death_signal)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    prctl(PR_SET_PDEATHSIG, death_signal);
    if (getppid() != parent)
        _exit(127);
    if (quiet) {
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) {
            dup2(devnull, STDOUT_FILENO);
            close(devnull);
        }
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    execv(argv[0], argv);
    _exit(127);
}

/* SIGTERM, wait up to STOP_GRACE_MS, then SIGKILL. Returns the wait status, or -1 if it had to
 * be killed. */
static int stop_child(pid_t pid)
{
    int status = 0;
    kill(pid, SIGTERM);
    int64_t give_up = ps_now_ns() + STOP_GRACE_MS * NS_PER_MS;
    while (ps_now_ns() < give_up) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid || (w < 0 && errno == ECHILD))
            return status;
        struct timespec ts = {0, 5 * NS_PER_MS};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1;
}

typedef struct {
    pid_t pid;
    char tmpdir[64];
    char port_file[96];
    char target[64];
} coord_t;

static int read_port_file(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[32] = "";
    bool got = fgets(line, sizeof(line), f) != NULL;
    fclose(f);
    line[strcspn(line, "\r\n")] = '\0';
    int64_t port;
    if (!got || ps_parse_i64(line, 1, 65535, &port) != 0)
        return 0;
    return (int)port;
}

/* Starts bin on 127.0.0.1:0 and waits for its port file. */
static pshard_status_t coord_start(coord_t *co, const char *bin, const char *log, char *err,
                                   size_t errlen)
{
    if (ps_strlcpy(co->tmpdir, "/tmp/pshard-coll-bench-XXXXXX", sizeof(co->tmpdir)) != 0 ||
        !mkdtemp(co->tmpdir)) {
        co->tmpdir[0] = '\0';
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "mkdtemp: %s", strerror(errno));
    }
    snprintf(co->port_file, sizeof(co->port_file), "%s/port", co->tmpdir);
    char *argv[] = {(char *)bin,   "--listen", "127.0.0.1:0", "--port-file",
                    co->port_file, "--log",    (char *)log,   NULL};
    co->pid = spawn(argv, true, SIGTERM);
    if (co->pid < 0) {
        co->pid = 0;
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "fork: %s", strerror(errno));
    }
    int64_t deadline = ps_now_ns() + STARTUP_MS * NS_PER_MS;
    while (ps_now_ns() < deadline && !g_signal) {
        int status;
        if (waitpid(co->pid, &status, WNOHANG) == co->pid) {
            co->pid = 0;
            return ps_errf(err, errlen, PSHARD_ERR_SYSTEM,
                           "%s exited (%s %d) before writing its port file", bin,
                           WIFEXITED(status) ? "status" : "signal",
                           WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
        }
        int port = read_port_file(co->port_file);
        if (port > 0) {
            snprintf(co->target, sizeof(co->target), "127.0.0.1:%d", port);
            /* Removed at once, so even a SIGKILLed launcher leaves no file behind. */
            unlink(co->port_file);
            rmdir(co->tmpdir);
            co->port_file[0] = co->tmpdir[0] = '\0';
            return PSHARD_OK;
        }
        sleep_ms(5);
    }
    if (g_signal)
        return ps_errf(err, errlen, PSHARD_ERR_ABORTED, "interrupted by signal %d", (int)g_signal);
    return ps_errf(err, errlen, PSHARD_ERR_TIMEOUT, "%s wrote no port file within %d ms", bin,
                   STARTUP_MS);
}

/* Stops what coord_start started; false when it did not exit cleanly with status 0. */
static bool coord_stop(coord_t *co)
{
    bool clean = true;
    if (co->pid > 0) {
        int st = stop_child(co->pid);
        if (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, PROG ": coordinator pid %d did not exit cleanly on SIGTERM\n",
                    (int)co->pid);
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

/* The rank's argv: this program, every option's effective value as --flag=value (so the ranks
 * see exactly what the launcher parsed), then the hidden rank-mode flags. Strings are written
 * into arena (capacity len). Returns false if it does not fit. */
static bool rank_argv(const char *exe, const bench_opts_t *o, int rank, const char *target,
                      const char *run_id, char **argv, size_t max_args, char *arena, size_t len)
{
    size_t used = 0, na = 0;
    argv[na++] = (char *)exe;
    for (size_t i = 0; i < PS_ARRAY_LEN(options); i++) {
        const ps_option_t *opt = &options[i];
        const char *flag = opt->flag;
        if (strcmp(flag, "nranks") == 0 || strcmp(flag, "coordinator-bin") == 0 ||
            strcmp(flag, "coordinator") == 0 || strcmp(flag, "rank") == 0 ||
            strcmp(flag, "world") == 0 || strcmp(flag, "run-id") == 0)
            continue;
        const char *field = (const char *)o + opt->offset;
        char value[256];
        if (opt->type == PS_OPT_STRING) {
            const char *s = *(char *const *)field;
            if (!s)
                continue;
            if (ps_strlcpy(value, s, sizeof(value)) != 0)
                return false;
        } else if (opt->type == PS_OPT_INT) {
            snprintf(value, sizeof(value), "%lld", (long long)*(const int64_t *)field);
        } else {
            ps_strlcpy(value, *(const bool *)field ? "true" : "false", sizeof(value));
        }
        int w = snprintf(arena + used, len - used, "--%s=%s", flag, value);
        if (w < 0 || (size_t)w >= len - used || na + 1 >= max_args)
            return false;
        argv[na++] = arena + used;
        used += (size_t)w + 1;
    }
    int w = snprintf(arena + used, len - used, "--rank=%d", rank);
    if (w < 0 || (size_t)w >= len - used)
        return false;
    argv[na++] = arena + used;
    used += (size_t)w + 1;
    w = snprintf(arena + used, len - used, "--world=%lld", (long long)o->nranks);
    if (w < 0 || (size_t)w >= len - used)
        return false;
    argv[na++] = arena + used;
    used += (size_t)w + 1;
    w = snprintf(arena + used, len - used, "--coordinator=%s", target);
    if (w < 0 || (size_t)w >= len - used)
        return false;
    argv[na++] = arena + used;
    used += (size_t)w + 1;
    w = snprintf(arena + used, len - used, "--run-id=%s", run_id);
    if (w < 0 || (size_t)w >= len - used || na + 1 >= max_args)
        return false;
    argv[na++] = arena + used;
    argv[na] = NULL;
    return true;
}

static void describe_status(int st, char *buf, size_t len)
{
    if (WIFEXITED(st))
        snprintf(buf, len, "exit status %d", WEXITSTATUS(st));
    else if (WIFSIGNALED(st))
        snprintf(buf, len, "signal %d", WTERMSIG(st));
    else
        snprintf(buf, len, "wait status %d", st);
}

/* Starts the coordinator (unless --coordinator) and the ranks, waits for every rank, and
 * stops what it started by PID on every path: a failed rank makes it stop the others, a
 * SIGINT/SIGTERM/SIGHUP stops everything. Returns the exit code. */
static int launcher_main(const bench_opts_t *o)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);

    char err[512] = "";
    int exit_code = 1;
    coord_t co;
    memset(&co, 0, sizeof(co));
    pid_t pids[MAX_RANKS];
    bool done[MAX_RANKS];
    int n = (int)o->nranks, left = 0;
    for (int r = 0; r < MAX_RANKS; r++) {
        pids[r] = -1;
        done[r] = true;
    }
    char exe[PATH_MAX], bin[PATH_MAX];
    const char *target = o->coordinator;

    if (!self_exe(exe, sizeof(exe))) {
        fprintf(stderr, PROG ": cannot find its own executable: %s\n", strerror(errno));
        return 1;
    }
    if (!target) {
        if (o->coordinator_bin) {
            if (ps_strlcpy(bin, o->coordinator_bin, sizeof(bin)) != 0 || !is_executable(bin)) {
                fprintf(stderr, PROG ": --coordinator-bin %s is not an executable file\n",
                        o->coordinator_bin);
                return 2;
            }
        } else if (!find_coordinator_bin(exe, bin, sizeof(bin))) {
            fprintf(stderr,
                    PROG ": cannot find pshard-coordinator at ../../coordinator/ or next to %s; "
                         "give --coordinator-bin PATH or --coordinator HOST:PORT\n",
                    exe);
            return 2;
        }
        if (coord_start(&co, bin, o->log, err, sizeof(err)) != PSHARD_OK) {
            fprintf(stderr, PROG ": %s\n", err);
            goto out;
        }
        target = co.target;
    }

    char run_id[32];
    snprintf(run_id, sizeof(run_id), "%d-%lld", (int)getpid(), (long long)(ps_wall_ms() % 100000));
    for (int r = 0; r < n; r++) {
        char *argv[64];
        char arena[4096];
        if (!rank_argv(exe, o, r, target, run_id, argv, PS_ARRAY_LEN(argv), arena, sizeof(arena))) {
            fprintf(stderr, PROG ": options too long to pass to the ranks\n");
            goto stop_ranks;
        }
        pids[r] = spawn(argv, false, SIGKILL);
        if (pids[r] < 0) {
            fprintf(stderr, PROG ": fork: %s\n", strerror(errno));
            goto stop_ranks;
        }
        done[r] = false;
        left++;
    }

    exit_code = 0;
    while (left > 0 && !g_signal) {
        bool progressed = false;
        for (int r = 0; r < n; r++) {
            int st;
            if (done[r] || waitpid(pids[r], &st, WNOHANG) != pids[r])
                continue;
            done[r] = true;
            left--;
            progressed = true;
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                char what[64];
                describe_status(st, what, sizeof(what));
                fprintf(stderr, PROG ": rank %d (pid %d) ended with %s%s\n", r, (int)pids[r], what,
                        left ? "; stopping the other ranks" : "");
                exit_code = 1;
                goto stop_ranks;
            }
        }
        if (!progressed)
            sleep_ms(10);
    }
    if (g_signal) {
        fprintf(stderr, PROG ": signal %d: stopping the ranks and the coordinator\n",
                (int)g_signal);
        exit_code = 128 + (int)g_signal;
    }

stop_ranks:
    for (int r = 0; r < n && left > 0; r++) {
        if (pids[r] > 0 && !done[r]) {
            stop_child(pids[r]);
            done[r] = true;
            left--;
        }
    }
out:
    if (!coord_stop(&co) && exit_code == 0)
        exit_code = 1;
    return exit_code;
}

/* ------------------------------------------------------------------------------------------ */

int main(int argc, char **argv)
{
    ps_log_init("bench");
    bench_opts_t o;
    memset(&o, 0, sizeof(o));
    ps_config_result_t res;
    char err[512] = "";
    int exit_code = 2;
    char **owned = calloc((size_t)argc + 1, sizeof(char *));
    int nowned = 0, xargc = 0;
    char **xargv =
        owned ? expand_short_flags(argc, argv, &xargc, owned, &nowned, err, sizeof(err)) : NULL;
    pshard_coll_op_t ops[PS_ARRAY_LEN(all_ops)];
    size_t nops = 0, sizes[MAX_SIZES], nsizes = 0, minb = 0, maxb = 0;
    pshard_dtype_t dt = PSHARD_FP32;

    if (!xargv) {
        fprintf(stderr, PROG ": %s (see --help)\n", err[0] ? err : "out of memory");
        goto out;
    }
    if (ps_config_parse(options, PS_ARRAY_LEN(options), xargc, xargv, &o, &res, err, sizeof(err)) !=
        PSHARD_OK) {
        fprintf(stderr, PROG ": %s (see --help)\n", err);
        goto out;
    }
    if (res.help) {
        ps_config_usage(stdout, PROG,
                        "[-n RANKS] [-b MINBYTES] [-e MAXBYTES] [-f FACTOR] [-o OP] [-d TYPE] "
                        "[-w WARMUP] [-i ITERS] [-c 0|1] [OPTIONS]",
                        "Bandwidth of pshard's tcp collectives in the nccl-tests format: starts a "
                        "coordinator and RANKS processes on this host, and prints size, count, "
                        "type, op, time, algbw and busbw for every size of every operation.",
                        options, PS_ARRAY_LEN(options));
        exit_code = 0;
        goto out;
    }
    if (res.version) {
        printf(PROG " %s\n", PSHARD_VERSION_STRING);
        exit_code = 0;
        goto out;
    }
    if (res.first_positional < xargc) {
        fprintf(stderr, PROG ": unexpected argument '%s' (see --help)\n",
                xargv[res.first_positional]);
        goto out;
    }
    ps_log_level_t level;
    if (!ps_log_parse_level(o.log, &level)) {
        fprintf(stderr, PROG ": --log '%s' is not error|warn|info|debug|trace\n", o.log);
        goto out;
    }
    ps_log_set_level(level);
    nops = parse_ops(o.op, ops);
    if (nops == 0) {
        fprintf(stderr,
                PROG ": -o '%s' is not all_gather|reduce_scatter|all_reduce|broadcast|all\n", o.op);
        goto out;
    }
    if (pshard_dtype_parse(o.datatype, &dt) != 0 || dt == PSHARD_INT64) {
        fprintf(stderr, PROG ": -d '%s' is not fp32|bf16|fp16\n", o.datatype);
        goto out;
    }
    if (parse_size(o.minbytes, &minb) != 0 || parse_size(o.maxbytes, &maxb) != 0 || minb == 0 ||
        maxb < minb) {
        fprintf(stderr, PROG ": -b '%s' and -e '%s' must be sizes with 0 < MINBYTES <= MAXBYTES\n",
                o.minbytes, o.maxbytes);
        goto out;
    }
    for (size_t s = minb; s <= maxb && nsizes < MAX_SIZES;) {
        sizes[nsizes++] = s;
        if (s > SIZE_MAX / (size_t)o.stepfactor)
            break;
        s *= (size_t)o.stepfactor;
    }
    ps_config_log(options, PS_ARRAY_LEN(options), &o, &res);

    if (o.rank >= 0) {
        if (o.world < 1 || o.rank >= o.world || !o.coordinator || o.root >= o.world) {
            fprintf(stderr, PROG ": rank mode needs --rank < --world, --root < --world and "
                                 "--coordinator\n");
            goto out;
        }
        exit_code = rank_main(&o, dt, ops, nops, sizes, nsizes);
    } else {
        if (o.root >= o.nranks) {
            fprintf(stderr, PROG ": --root %lld is not a rank of %lld\n", (long long)o.root,
                    (long long)o.nranks);
            goto out;
        }
        exit_code = launcher_main(&o);
    }
out:
    ps_config_free(options, PS_ARRAY_LEN(options), &o);
    for (int i = 0; i < nowned; i++)
        free(owned[i]);
    free(owned);
    free(xargv);
    return exit_code;
}
