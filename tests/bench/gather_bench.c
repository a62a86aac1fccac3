/* pshard-gather-bench: how fast pshard_gather delivers a parameter's full fp32 values into the
 * trainer's buffer, next to memcpy of the same bytes between two pre-touched buffers of this
 * process, timed in the same loop. It is a trainer: run it under pshardrun (one shard server
 * per rank), e.g. `pshardrun --nproc 1 -- pshard-gather-bench`. Rank 0 prints one row per
 * size. A benchmark, not a test: it fails only when a gather fails or delivers wrong values. */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "pshard/config.h"
#include "pshard/log.h"
#include "pshard/pshard.h"
#include "pshard/util.h"

#define PROG "pshard-gather-bench"
#define MAX_SIZES 16
#define ROW_WIDTH 1024 /* elements per row of each benchmark parameter */

typedef struct {
    char *sizes;    /* comma-separated parameter sizes in bytes ("4K,16M,128M") */
    int64_t warmup; /* untimed gathers (and copies) per size */
    int64_t iters;  /* timed gathers (and copies) per size */
    char *log;
} bench_opts_t;

#define OPT(flag, env, type, def, help, field, lo, hi)                                             \
    {                                                                                              \
        flag, env, type, def, help, offsetof(bench_opts_t, field), lo, hi                          \
    }

static const ps_option_t options[] = {
    OPT("sizes", "PSHARD_BENCH_SIZES", PS_OPT_STRING, "4K,16M,128M",
        "parameter sizes in bytes, comma-separated (suffix K, M, G = 2^10, 2^20, 2^30); each "
        "is one fp32 parameter of ROWS x 1024 (a single row unless a whole number of rows)",
        sizes, 0, 0),
    OPT("warmup", "PSHARD_BENCH_WARMUP", PS_OPT_INT, "3", "untimed iterations per size", warmup, 0,
        1000000),
    OPT("iters", "PSHARD_BENCH_ITERS", PS_OPT_INT, "20", "timed iterations per size", iters, 1,
        1000000),
    OPT("log", "PSHARD_LOG", PS_OPT_STRING, "warn", "log level: error|warn|info|debug|trace", log,
        0, 0),
};

/* Parses "64", "4K", "16M", "1G" (binary multiples, optional "B"/"iB") into bytes; 0 or -1. */
static int parse_size(const char *text, size_t *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || end == text || text[0] == '-')
        return -1;
    unsigned shift = 0;
    if (*end == 'k' || *end == 'K')
        shift = 10;
    else if (*end == 'm' || *end == 'M')
        shift = 20;
    else if (*end == 'g' || *end == 'G')
        shift = 30;
    if (shift)
        end++;
    if (strcasecmp(end, "") != 0 && strcasecmp(end, "B") != 0 && strcasecmp(end, "iB") != 0)
        return -1;
    if (v == 0 || v > (SIZE_MAX >> shift) / 2)
        return -1;
    *out = (size_t)(v << shift);
    return 0;
}

/* Splits --sizes into sizes[] (at most MAX_SIZES, each a multiple of 4 bytes); returns the
 * count or 0 after printing why. */
static size_t parse_sizes(const char *text, size_t *sizes)
{
    size_t n = 0;
    for (const char *p = text; *p;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        char tok[64];
        if (len == 0 || len >= sizeof(tok) || n == MAX_SIZES) {
            fprintf(stderr, PROG ": --sizes '%s' is not a list of at most %d sizes\n", text,
                    MAX_SIZES);
            return 0;
        }
        memcpy(tok, p, len);
        tok[len] = '\0';
        if (parse_size(tok, &sizes[n]) != 0 || sizes[n] % 4 != 0) {
            fprintf(stderr, PROG ": --sizes: '%s' is not a size in bytes (a multiple of 4)\n", tok);
            return 0;
        }
        n++;
        p += len + (comma ? 1 : 0);
    }
    if (n == 0)
        fprintf(stderr, PROG ": --sizes names no size\n");
    return n;
}

/* The value element i of parameter p starts with (exact in fp32). */
static float init_value(size_t p, size_t i)
{
    return (float)((i * 7 + p * 131) % 65521) - 32760.0f;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Sorts v[0..n) and returns its median. */
static int64_t median(int64_t *v, size_t n)
{
    qsort(v, n, sizeof(*v), cmp_i64);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static double gbps(size_t bytes, int64_t ns)
{
    return ns > 0 ? (double)bytes / (double)ns : 0.0; /* bytes per ns == GB/s (1e9 B/s) */
}

/* Defines one fp32 parameter per size (rows x ROW_WIDTH, or 1 x n below one row), gathers each
 * `warmup + iters` times alternating with a memcpy of the same bytes, checks the gathered
 * values and prints rank 0's row. Returns the exit status. */
static int run(pshard_client_t *c, const size_t *sizes, size_t nsizes, const bench_opts_t *o)
{
    int rank = pshard_rank(c), world = pshard_world_size(c);
    pshard_param_t params[MAX_SIZES];
    int64_t shapes[MAX_SIZES][2];
    char names[MAX_SIZES][32];
    float *init[MAX_SIZES] = {0};
    int64_t *gather_ns = calloc((size_t)o->iters, sizeof(int64_t));
    int64_t *copy_ns = calloc((size_t)o->iters, sizeof(int64_t));
    uint8_t *src = NULL, *dst = NULL;
    int rc = 1;
    size_t max_bytes = 0;
    for (size_t p = 0; p < nsizes; p++) {
        size_t numel = sizes[p] / 4;
        bool whole_rows = numel >= ROW_WIDTH && numel % ROW_WIDTH == 0;
        shapes[p][0] = whole_rows ? (int64_t)(numel / ROW_WIDTH) : 1;
        shapes[p][1] = whole_rows ? ROW_WIDTH : (int64_t)numel;
        snprintf(names[p], sizeof(names[p]), "bench.p%zu", p);
        params[p] = (pshard_param_t){names[p], 2, shapes[p]};
        if (sizes[p] > max_bytes)
            max_bytes = sizes[p];
    }
    if (!gather_ns || !copy_ns)
        goto oom;
    /* Rank 0 supplies the values (init_from_rank0), as a trainer with sync_module_states. */
    if (rank == 0) {
        for (size_t p = 0; p < nsizes; p++) {
            size_t numel = sizes[p] / 4;
            if (!(init[p] = malloc(sizes[p])))
                goto oom;
            for (size_t i = 0; i < numel; i++)
                init[p][i] = init_value(p, i);
        }
    }
    pshard_model_config_t mc;
    pshard_model_config_default(&mc, PSHARD_SGD);
    if (pshard_define_model(c, params, nsizes, &mc,
                            rank == 0 ? (const float *const *)init : NULL) != PSHARD_OK) {
        fprintf(stderr, PROG ": rank %d: define model: %s\n", rank, pshard_last_error(c));
        goto out;
    }
    /* The memcpy reference: both buffers touched first, so no page fault is timed. */
    src = malloc(max_bytes);
    dst = malloc(max_bytes);
    if (!src || !dst)
        goto oom;
    memset(src, 0x3c, max_bytes);
    memset(dst, 0, max_bytes);

    if (rank == 0) {
        printf("# %s: %d rank(s), one fp32 parameter per row, %lld warm-up + %lld timed "
               "iterations, medians; GB/s = 1e9 B/s of full parameter bytes delivered\n",
               PROG, world, (long long)o->warmup, (long long)o->iters);
        printf("%5s %12s %11s %11s %11s %11s %8s %11s %11s\n", "world", "size(B)", "gather_ms",
               "gather_GB/s", "memcpy_ms", "memcpy_GB/s", "ratio", "best_gath", "best_memcpy");
        fflush(stdout);
    }
    for (size_t p = 0; p < nsizes; p++) {
        size_t id = p, bytes = sizes[p];
        for (int64_t k = 0; k < o->warmup + o->iters; k++) {
            /* A gathered parameter is not gathered again; freeing it first makes every
             * iteration a real gather into the same (pooled) buffer. */
            if (k > 0 && pshard_reshard(c, &id, 1) != PSHARD_OK) {
                fprintf(stderr, PROG ": rank %d: reshard: %s\n", rank, pshard_last_error(c));
                goto out;
            }
            int64_t t0 = ps_now_ns();
            if (pshard_gather(c, &id, 1) != PSHARD_OK) {
                fprintf(stderr, PROG ": rank %d: gather of %zu bytes: %s\n", rank, bytes,
                        pshard_last_error(c));
                goto out;
            }
            int64_t t1 = ps_now_ns();
            memcpy(dst, src, bytes);
            int64_t t2 = ps_now_ns();
            /* Keep the copy observable so it cannot be dropped. */
            if (dst[bytes - 1] != 0x3c)
                abort();
            if (k >= o->warmup) {
                gather_ns[k - o->warmup] = t1 - t0;
                copy_ns[k - o->warmup] = t2 - t1;
            }
        }
        const float *got = pshard_param(c, id);
        for (size_t i = 0; i < bytes / 4; i++) {
            if (got[i] != init_value(p, i)) {
                fprintf(stderr, PROG ": rank %d: gathered element %zu of %zu bytes is %g, not %g\n",
                        rank, i, bytes, (double)got[i], (double)init_value(p, i));
                goto out;
            }
        }
        /* median() sorts, so element 0 is then the fastest iteration. */
        int64_t g = median(gather_ns, (size_t)o->iters), m = median(copy_ns, (size_t)o->iters);
        if (rank == 0) {
            printf("%5d %12zu %11.3f %11.2f %11.3f %11.2f %8.2f %11.2f %11.2f\n", world, bytes,
                   (double)g / 1e6, gbps(bytes, g), (double)m / 1e6, gbps(bytes, m),
                   m > 0 ? gbps(bytes, g) / gbps(bytes, m) : 0.0, gbps(bytes, gather_ns[0]),
                   gbps(bytes, copy_ns[0]));
            fflush(stdout);
        }
    }
    rc = 0;
    goto out;
oom:
    fprintf(stderr, PROG ": rank %d: out of memory\n", rank);
out:
    for (size_t p = 0; p < nsizes; p++)
        free(init[p]);
    free(gather_ns);
    free(copy_ns);
    free(src);
    free(dst);
    return rc;
}

int main(int argc, char **argv)
{
    ps_log_init("bench");
    bench_opts_t o;
    ps_config_result_t res;
    char err[1024] = "";
    int exit_code = 0;
    pshard_client_t *c = NULL;
    size_t sizes[MAX_SIZES], nsizes = 0;
    if (ps_config_parse(options, PS_ARRAY_LEN(options), argc, argv, &o, &res, err, sizeof(err)) !=
        PSHARD_OK) {
        fprintf(stderr, PROG ": %s (see --help)\n", err);
        exit_code = 2;
        goto out;
    }
    if (res.help) {
        ps_config_usage(stdout, PROG, "[OPTIONS]   (run it under pshardrun)",
                        "Gathers one big fp32 parameter per size through the shard servers and "
                        "compares the bytes delivered per second with memcpy in this process.",
                        options, PS_ARRAY_LEN(options));
        goto out;
    }
    if (res.version) {
        printf(PROG " %s\n", PSHARD_VERSION_STRING);
        goto out;
    }
    ps_log_level_t level;
    if (!ps_log_parse_level(o.log, &level)) {
        fprintf(stderr, PROG ": --log '%s' is not error|warn|info|debug|trace\n", o.log);
        exit_code = 2;
        goto out;
    }
    ps_log_set_level(level);
    ps_config_log(options, PS_ARRAY_LEN(options), &o, &res);
    if (!(nsizes = parse_sizes(o.sizes, sizes))) {
        exit_code = 2;
        goto out;
    }
    pshard_client_config_t cfg;
    if (pshard_client_config_from_env(&cfg, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, PROG ": %s\n", err);
        exit_code = 2;
        goto out;
    }
    if (pshard_connect(&cfg, &c, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, PROG ": %s\n", err);
        exit_code = 1;
        goto out;
    }
    exit_code = run(c, sizes, nsizes, &o);
out:
    pshard_close(c);
    ps_config_free(options, PS_ARRAY_LEN(options), &o);
    return exit_code;
}
