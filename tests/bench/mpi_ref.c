/* pshard-mpi-ref: the MPI reference for pshard-coll-bench. Run under mpirun, it times
 * MPI_Allgather, MPI_Reduce_scatter_block, MPI_Allreduce and MPI_Bcast over the same sizes, with
 * the same buffers (allocated once at the largest size, pre-touched), the same timing rule and
 * the same nccl-tests columns, so the two programs' rows compare line by line. */
#include <errno.h>
#include <inttypes.h>
#include <mpi.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "pshard/dtype.h"

#define PROG "pshard-mpi-ref"
#define MAX_SIZES 64

typedef enum { OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_ALL_REDUCE, OP_BROADCAST, OP_COUNT } op_t;

static const char *const op_names[OP_COUNT] = {"all_gather", "reduce_scatter", "all_reduce",
                                               "broadcast"};

typedef struct {
    size_t minbytes, maxbytes;
    long stepfactor;
    bool ops[OP_COUNT];
    pshard_dtype_t dtype;
    long warmup_iters, iters;
    int root;
    bool check;
} ref_opts_t;

/* The options, with pshard-coll-bench's letters; also the --help text. A getopt-style table of
 * its own rather than ps_config: under mpirun only short nccl-tests flags are passed, and every
 * rank parses them before it knows whether it is the one that should talk. */
static const struct {
    char letter;
    const char *arg, *def, *help;
} option_table[] = {
    {'b', "MINBYTES", "1M", "first size in bytes (suffix K, M, G = 2^10, 2^20, 2^30)"},
    {'e', "MAXBYTES", "128M", "last size in bytes"},
    {'f', "FACTOR", "2", "multiply the size by this between rows"},
    {'o', "OP", "all", "all_gather|reduce_scatter|all_reduce|broadcast|all"},
    {'d', "TYPE", "fp32", "fp32|bf16|fp16 (half types reduce with a user-defined MPI_Op)"},
    {'w', "WARMUP", "5", "untimed operations before each size"},
    {'i', "ITERS", "20", "timed operations per size"},
    {'r', "ROOT", "0", "broadcast root"},
    {'c', "0|1", "1", "verify every size's output after timing it (#wrong column)"},
};

static void usage(FILE *out)
{
    fprintf(out, "usage: mpirun -np N " PROG " [OPTIONS]\n"
                 "MPI collectives timed as pshard-coll-bench times pshard's.\n");
    for (size_t i = 0; i < sizeof(option_table) / sizeof(option_table[0]); i++)
        fprintf(out, "  -%c %-9s %s (default %s)\n", option_table[i].letter, option_table[i].arg,
                option_table[i].help, option_table[i].def);
}

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
    if (*end && strcasecmp(end, "B") != 0 && strcasecmp(end, "iB") != 0)
        return -1;
    if (v > (SIZE_MAX >> shift))
        return -1;
    *out = (size_t)(v << shift);
    return 0;
}

static int parse_long(const char *text, long lo, long hi, long *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

/* Applies one option; returns 0 or -1 with a message on stderr (rank 0 only). */
static int apply(ref_opts_t *o, char letter, const char *value, bool talk)
{
    long v = 0;
    int bad = 0;
    switch (letter) {
    case 'b':
        bad = parse_size(value, &o->minbytes);
        break;
    case 'e':
        bad = parse_size(value, &o->maxbytes);
        break;
    case 'f':
        bad = parse_long(value, 2, 1024, &o->stepfactor);
        break;
    case 'o':
        memset(o->ops, 0, sizeof(o->ops));
        bad = -1;
        for (int i = 0; i < OP_COUNT; i++) {
            if (strcmp(value, "all") == 0 || strcmp(value, op_names[i]) == 0) {
                o->ops[i] = true;
                bad = 0;
            }
        }
        break;
    case 'd':
        bad = pshard_dtype_parse(value, &o->dtype) != 0 || o->dtype == PSHARD_INT64 ? -1 : 0;
        break;
    case 'w':
        bad = parse_long(value, 0, 100000, &o->warmup_iters);
        break;
    case 'i':
        bad = parse_long(value, 1, 100000, &o->iters);
        break;
    case 'r':
        bad = parse_long(value, 0, 1 << 20, &v);
        o->root = (int)v;
        break;
    case 'c':
        bad = parse_long(value, 0, 1, &v);
        o->check = v != 0;
        break;
    default:
        bad = -1;
        break;
    }
    if (bad && talk)
        fprintf(stderr, PROG ": bad value '%s' for -%c (see -h)\n", value, letter);
    return bad ? -1 : 0;
}

/* Parses argv ("-b 1M" or "-b1M"). Returns 0, 1 for -h, or -1. */
static int parse_args(int argc, char **argv, ref_opts_t *o, bool talk)
{
    for (size_t i = 0; i < sizeof(option_table) / sizeof(option_table[0]); i++) {
        if (apply(o, option_table[i].letter, option_table[i].def, talk) != 0)
            return -1;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0)
            return 1;
        if (a[0] != '-' || a[1] == '\0') {
            if (talk)
                fprintf(stderr, PROG ": unexpected argument '%s' (see -h)\n", a);
            return -1;
        }
        const char *value = a[2] ? a + 2 : (i + 1 < argc ? argv[++i] : NULL);
        if (!value) {
            if (talk)
                fprintf(stderr, PROG ": %s needs a value\n", a);
            return -1;
        }
        if (apply(o, a[1], value, talk) != 0)
            return -1;
    }
    if (o->minbytes == 0 || o->maxbytes < o->minbytes) {
        if (talk)
            fprintf(stderr, PROG ": need 0 < MINBYTES <= MAXBYTES\n");
        return -1;
    }
    return 0;
}

/* Sums of half types: widen to fp32, add, round once (as pshard does per step of its ring). */
static void sum_bf16(void *in, void *inout, int *len, MPI_Datatype *type)
{
    const uint16_t *a = in;
    uint16_t *b = inout;
    for (int i = 0; i < *len; i++)
        b[i] = ps_f32_to_bf16(ps_bf16_to_f32(a[i]) + ps_bf16_to_f32(b[i]));
}

static void sum_fp16(void *in, void *inout, int *len, MPI_Datatype *type)
{
    const uint16_t *a = in;
    uint16_t *b = inout;
    for (int i = 0; i < *len; i++)
        b[i] = ps_f32_to_f16(ps_f16_to_f32(a[i]) + ps_f16_to_f32(b[i]));
}

static void store_value(void *buf, pshard_dtype_t dt, size_t i, float v)
{
    if (dt == PSHARD_FP32)
        ((float *)buf)[i] = v;
    else if (dt == PSHARD_BF16)
        ((uint16_t *)buf)[i] = ps_f32_to_bf16(v);
    else
        ((uint16_t *)buf)[i] = ps_f32_to_f16(v);
}

static float load_value(const void *buf, pshard_dtype_t dt, size_t i)
{
    if (dt == PSHARD_FP32)
        return ((const float *)buf)[i];
    if (dt == PSHARD_BF16)
        return ps_bf16_to_f32(((const uint16_t *)buf)[i]);
    return ps_f16_to_f32(((const uint16_t *)buf)[i]);
}

static long long count_wrong(const void *recv, pshard_dtype_t dt, size_t first, size_t n,
                             float want)
{
    uint32_t slot[1];
    store_value(slot, dt, 0, want);
    float w = load_value(slot, dt, 0);
    long long wrong = 0;
    for (size_t i = first; i < first + n; i++)
        wrong += load_value(recv, dt, i) != w;
    return wrong;
}

static double bus_factor(op_t op, int n)
{
    if (op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER)
        return (double)(n - 1) / n;
    if (op == OP_ALL_REDUCE)
        return 2.0 * (n - 1) / n;
    return 1.0;
}

static int run_op(op_t op, const void *send, void *recv, size_t arg, MPI_Datatype type, MPI_Op sum,
                  int root)
{
    int c = (int)arg;
    switch (op) {
    case OP_ALL_GATHER:
        return MPI_Allgather(send, c, type, recv, c, type, MPI_COMM_WORLD);
    case OP_REDUCE_SCATTER:
        return MPI_Reduce_scatter_block(send, recv, c, type, sum, MPI_COMM_WORLD);
    case OP_ALL_REDUCE:
        return MPI_Allreduce(send, recv, c, type, sum, MPI_COMM_WORLD);
    default:
        /* Like pshard's broadcast: root sends from its send buffer; everyone lands in recv. */
        return MPI_Bcast(recv, c, type, root, MPI_COMM_WORLD);
    }
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank = 0, n = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    ref_opts_t o;
    memset(&o, 0, sizeof(o));
    int parsed = parse_args(argc, argv, &o, rank == 0);
    if (parsed != 0 || o.root >= n) {
        if (parsed == 1 && rank == 0)
            usage(stdout);
        else if (parsed == 0 && rank == 0)
            fprintf(stderr, PROG ": -r %d is not a rank of %d\n", o.root, n);
        MPI_Finalize();
        return parsed == 1 ? 0 : 2;
    }
    size_t es = pshard_dtype_size(o.dtype);
    size_t sizes[MAX_SIZES], nsizes = 0;
    for (size_t s = o.minbytes; s <= o.maxbytes && nsizes < MAX_SIZES;) {
        sizes[nsizes++] = s;
        if (s > SIZE_MAX / (size_t)o.stepfactor)
            break;
        s *= (size_t)o.stepfactor;
    }
    size_t maxb = sizes[nsizes - 1];
    MPI_Datatype type = o.dtype == PSHARD_FP32 ? MPI_FLOAT : MPI_UINT16_T;
    MPI_Op sum = MPI_SUM;
    if (o.dtype != PSHARD_FP32)
        MPI_Op_create(o.dtype == PSHARD_BF16 ? sum_bf16 : sum_fp16, 1, &sum);

    /* Allocated once at the largest size and touched before anything is timed. */
    uint8_t *send = malloc(maxb), *recv = malloc(maxb);
    if (!send || !recv) {
        fprintf(stderr, PROG " rank %d: out of memory for %zu-byte buffers\n", rank, maxb);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    memset(send, 0, maxb);
    memset(recv, 0, maxb);
    for (size_t i = 0; i < maxb / es; i++)
        store_value(send, o.dtype, i, (float)(rank + 1));

    if (rank == 0) {
        int len = 0;
        char version[MPI_MAX_LIBRARY_VERSION_STRING] = "";
        MPI_Get_library_version(version, &len);
        version[strcspn(version, "\n,")] = '\0';
        printf("# %s: %s, %d ranks, %s, warmup %ld, iters %ld\n", PROG, version, n,
               pshard_dtype_name(o.dtype), o.warmup_iters, o.iters);
        printf("# time: the slowest rank's (end of its last of `iters` back-to-back operations -"
               " end of the opening barrier) / iters\n");
        printf("# algbw = size / time, busbw = algbw * (n-1)/n (all_gather, reduce_scatter),"
               " * 2(n-1)/n (all_reduce), * 1 (broadcast); GB/s = 1e9 B/s\n");
        printf("#\n# %12s %12s %6s %15s %11s %12s %12s %7s\n", "size(B)", "count", "type", "op",
               "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
        fflush(stdout);
    }
    int exit_code = 0;
    double busbw_sum = 0;
    int rows = 0;
    for (int op = 0; op < OP_COUNT; op++) {
        if (!o.ops[op])
            continue;
        for (size_t si = 0; si < nsizes; si++) {
            /* Sizes as nccl-tests and pshard-coll-bench define them. */
            size_t arg, count;
            if (op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER) {
                arg = sizes[si] / (es * (size_t)n);
                count = arg * (size_t)n;
            } else {
                arg = sizes[si] / es;
                count = arg;
            }
            size_t size = count * es;
            if (arg == 0 || arg > INT32_MAX) {
                if (rank == 0)
                    printf("# %s: %zu bytes give %zu elements per rank: skipped\n", op_names[op],
                           sizes[si], arg);
                continue;
            }
            if (op == OP_BROADCAST && rank == o.root)
                memcpy(recv, send, size);
            else if (o.check)
                memset(recv, 0xff, size);
            for (long i = 0; i < o.warmup_iters; i++)
                run_op(op, send, recv, arg, type, sum, o.root);
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            for (long i = 0; i < o.iters; i++)
                run_op(op, send, recv, arg, type, sum, o.root);
            double elapsed = MPI_Wtime() - t0;
            MPI_Barrier(MPI_COMM_WORLD);
            long long wrong = 0;
            if (o.check) {
                float total = (float)n * (float)(n + 1) / 2.0f;
                if (op == OP_ALL_GATHER) {
                    for (int r = 0; r < n; r++)
                        wrong += count_wrong(recv, o.dtype, (size_t)r * arg, arg, (float)(r + 1));
                } else if (op == OP_BROADCAST) {
                    wrong = count_wrong(recv, o.dtype, 0, arg, (float)(o.root + 1));
                } else {
                    wrong = count_wrong(recv, o.dtype, 0, arg, total);
                }
            }
            double slowest = 0;
            long long wrong_total = 0;
            MPI_Reduce(&elapsed, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
            MPI_Allreduce(&wrong, &wrong_total, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
            if (wrong_total > 0)
                exit_code = 1;
            if (rank == 0) {
                double us = slowest * 1e6 / (double)o.iters;
                double algbw = (double)size / (us * 1e3);
                char wrong_s[24];
                if (o.check)
                    snprintf(wrong_s, sizeof(wrong_s), "%lld", wrong_total);
                else
                    snprintf(wrong_s, sizeof(wrong_s), "N/A");
                printf("  %12zu %12zu %6s %15s %11.2f %12.3f %12.3f %7s\n", size, count,
                       pshard_dtype_name(o.dtype), op_names[op], us, algbw,
                       algbw * bus_factor((op_t)op, n), wrong_s);
                fflush(stdout);
                busbw_sum += algbw * bus_factor((op_t)op, n);
                rows++;
            }
        }
    }
    if (rank == 0 && rows)
        printf("# Avg bus bandwidth    : %.3f GB/s\n", busbw_sum / rows);
    if (sum != MPI_SUM)
        MPI_Op_free(&sum);
    free(send);
    free(recv);
    MPI_Finalize();
    return exit_code;
}
