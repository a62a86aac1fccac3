/* One rank of a collectives test: joins a communicator through a real coordinator's store and
 * runs a scenario. Inputs come from a PRNG seeded by (case, rank), so every rank can compute
 * the reference result of every operation by itself and check its own output; exit 0 means
 * every check passed. Scenarios: correctness, big, desync, kill, abort, timeout, impostor,
 * besieged. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pshard/collectives.h"
#include "pshard/log.h"
#include "pshard/util.h"

static int g_rank, g_world, g_failures;
static const char *g_coordinator, *g_token;
static uint64_t g_generation = 1;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "rank %d: CHECK FAILED %s:%d: ", g_rank, __FILE__, __LINE__);          \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            g_failures++;                                                                          \
        }                                                                                          \
    } while (0)

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static bool is_int(pshard_dtype_t dt)
{
    return dt == PSHARD_INT64 || dt == PSHARD_INT32 || dt == PSHARD_UINT8;
}

/* Element i of rank r's input for case c, as a double exactly representable in dtype. */
static double input_value(uint64_t c, int r, size_t i, pshard_dtype_t dt)
{
    uint64_t h = mix(c * 0x9e3779b97f4a7c15ULL ^ mix((uint64_t)r + 1) ^ mix(i + 7));
    if (dt == PSHARD_INT64 || dt == PSHARD_INT32) {
        int64_t v = (int64_t)(h % 2000001) - 1000000;
        return (double)(v == 0 ? 1 : v);
    }
    if (dt == PSHARD_UINT8)
        return (double)(h % 256);
    double u = ((double)(h >> 11) + 1.0) / 9007199254740992.0; /* (0, 1] */
    if (dt == PSHARD_FP64)
        return (h & 1) ? -4.0 * u : 4.0 * u; /* all 53 bits */
    float f = (float)((h & 1) ? -u : u) * 4.0f;
    if (dt == PSHARD_BF16)
        return ps_bf16_to_f32(ps_f32_to_bf16(f));
    if (dt == PSHARD_FP16)
        return ps_f16_to_f32(ps_f32_to_f16(f));
    return f;
}

static void fill(void *buf, pshard_dtype_t dt, uint64_t c, int r, size_t first, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        double v = input_value(c, r, first + i, dt);
        switch (dt) {
        case PSHARD_FP32:
            ((float *)buf)[i] = (float)v;
            break;
        case PSHARD_BF16:
            ((uint16_t *)buf)[i] = ps_f32_to_bf16((float)v);
            break;
        case PSHARD_FP16:
            ((uint16_t *)buf)[i] = ps_f32_to_f16((float)v);
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
            ((uint8_t *)buf)[i] = (uint8_t)v;
            break;
        }
    }
}

static double get(const void *buf, pshard_dtype_t dt, size_t i)
{
    switch (dt) {
    case PSHARD_FP32:
        return ((const float *)buf)[i];
    case PSHARD_BF16:
        return ps_bf16_to_f32(((const uint16_t *)buf)[i]);
    case PSHARD_FP16:
        return ps_f16_to_f32(((const uint16_t *)buf)[i]);
    case PSHARD_INT64:
        return (double)((const int64_t *)buf)[i];
    case PSHARD_FP64:
        return ((const double *)buf)[i];
    case PSHARD_INT32:
        return (double)((const int32_t *)buf)[i];
    case PSHARD_UINT8:
        return (double)((const uint8_t *)buf)[i];
    }
    return NAN;
}

/* Checks a reduced value: fp32 within a relative 1e-5 of the exact sum (the ring's order of
 * additions differs from ours); half types rounded once from an fp32 sum, so within one unit in
 * the last place of the half type; int64 exact. */
static bool close_enough(double got, double ref, double abs_terms, pshard_dtype_t dt)
{
    double diff = fabs(got - ref);
    switch (dt) {
    case PSHARD_FP32:
        return diff <= 1e-5 * fabs(ref) + 1e-6 * abs_terms;
    case PSHARD_BF16:
        return diff <= ldexp(fabs(ref) > 1e-30 ? fabs(ref) : 1e-30, -7) + 1e-6 * abs_terms;
    case PSHARD_FP16:
        return diff <= ldexp(fabs(ref) > 6e-5 ? fabs(ref) : 6e-5, -10) + 1e-5 * abs_terms;
    case PSHARD_FP64:
        return diff <= 1e-13 * fabs(ref) + 1e-14 * abs_terms;
    case PSHARD_INT64:
    case PSHARD_INT32:
    case PSHARD_UINT8:
        return diff == 0;
    }
    return false;
}

static pshard_comm_t *make_comm(const char *name, const char *token, uint64_t generation,
                                int64_t timeout_ms, pshard_status_t *rc_out, char *err,
                                size_t errlen)
{
    /* Runs share one coordinator: the driver's run id keeps their store keys apart. */
    char full[64];
    const char *run = getenv("PSHARD_TEST_RUN");
    snprintf(full, sizeof(full), "%s-%s", name, run ? run : "0");
    pshard_comm_config_t cfg = {
        .rank = g_rank,
        .world_size = g_world,
        .backend = "tcp",
        .name = full,
        .coordinator = g_coordinator,
        .token = token,
        .generation = generation,
        .timeout_ms = timeout_ms,
        .connect_timeout_ms = 20000,
    };
    pshard_comm_t *comm = NULL;
    pshard_status_t rc = pshard_comm_create(&cfg, &comm, err, errlen);
    if (rc_out)
        *rc_out = rc;
    return rc == PSHARD_OK ? comm : NULL;
}

typedef struct {
    pshard_coll_op_t op;
    pshard_dtype_t dtype;
    pshard_reduce_t reduce;
    size_t count;
    const size_t *counts; /* v-form */
    int root;
} case_t;

/* Runs one case (or only starts it when req_out is given) and checks the output. */
typedef struct {
    case_t c;
    uint64_t id;
    size_t *counts;
    size_t total, mine;
    void *send, *recv;
    pshard_coll_req_t *req;
    /* pieces: send and recv are handed over as pieces of their own allocations (some empty),
     * which the check reads back in order */
    bool pieces;
    pshard_coll_seg_t *send_segs, *recv_segs;
    size_t n_send_segs, n_recv_segs;
    /* blocking: run with pshard_coll_run (on a same-host ring, in this thread) rather than
     * started and waited for; its outcome */
    bool blocking;
    pshard_status_t run_rc;
    char run_err[512];
} running_t;

/* Splits n elements of es bytes into pieces of separately allocated memory (a few empty ones
 * among them), copying from src when it is not NULL; returns the piece count. */
static size_t make_pieces(uint64_t id, const void *src, size_t n, size_t es,
                          pshard_coll_seg_t **out)
{
    size_t cap = 2 + n / 3 + 8, k = 0, done = 0;
    pshard_coll_seg_t *segs = calloc(cap, sizeof(*segs));
    uint64_t x = id * 0x9e3779b97f4a7c15ull + 1;
    while (done < n || k < 2) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        size_t want = x % 4 == 0 ? 0 : 1 + (size_t)(x >> 8) % (n / 3 + 7);
        if (k + 1 == cap)
            want = n - done; /* the last slot takes the rest */
        if (want > n - done)
            want = n - done;
        segs[k].count = want;
        segs[k].ptr = want ? malloc(want * es) : NULL;
        if (want && src)
            memcpy(segs[k].ptr, (const uint8_t *)src + done * es, want * es);
        done += want;
        k++;
    }
    *out = segs;
    return k;
}

static void free_pieces(pshard_coll_seg_t *segs, size_t k)
{
    for (size_t i = 0; segs && i < k; i++)
        free(segs[i].ptr);
    free(segs);
}

static void counts_of(const case_t *c, size_t *counts, size_t *total)
{
    *total = 0;
    for (int i = 0; i < g_world; i++) {
        if (c->op == PSHARD_COLL_ALL_GATHER || c->op == PSHARD_COLL_REDUCE_SCATTER ||
            c->op == PSHARD_COLL_GATHER || c->op == PSHARD_COLL_SCATTER)
            counts[i] = c->counts ? c->counts[i] : c->count;
        else
            counts[i] = 0;
        *total += counts[i];
    }
    if (c->op == PSHARD_COLL_ALL_REDUCE || c->op == PSHARD_COLL_BROADCAST ||
        c->op == PSHARD_COLL_REDUCE)
        *total = c->count;
}

static void start_case(pshard_comm_t *comm, running_t *r)
{
    const case_t *c = &r->c;
    size_t es = pshard_dtype_size(c->dtype);
    r->counts = calloc((size_t)g_world, sizeof(size_t));
    counts_of(c, r->counts, &r->total);
    size_t offset_mine = 0;
    for (int i = 0; i < g_rank; i++)
        offset_mine += r->counts[i];
    size_t send_n = 0, recv_n = 0, send_first = 0;
    switch (c->op) {
    case PSHARD_COLL_ALL_GATHER:
        send_n = r->counts[g_rank];
        recv_n = r->total;
        send_first = offset_mine;
        break;
    case PSHARD_COLL_REDUCE_SCATTER:
        send_n = r->total;
        recv_n = r->counts[g_rank];
        break;
    case PSHARD_COLL_ALL_REDUCE:
    case PSHARD_COLL_BROADCAST:
        send_n = r->total;
        recv_n = r->total;
        break;
    case PSHARD_COLL_BARRIER:
        break;
    case PSHARD_COLL_REDUCE: /* only the root receives */
        send_n = r->total;
        recv_n = g_rank == c->root ? r->total : 0;
        break;
    case PSHARD_COLL_GATHER:
        send_n = r->counts[g_rank];
        recv_n = g_rank == c->root ? r->total : 0;
        send_first = offset_mine;
        break;
    case PSHARD_COLL_SCATTER: /* only the root sends */
        send_n = g_rank == c->root ? r->total : 0;
        recv_n = r->counts[g_rank];
        break;
    case PSHARD_COLL_ALL_TO_ALL: /* a block of count for (and from) every rank */
        send_n = recv_n = c->count * (size_t)g_world;
        break;
    }
    r->send = malloc(send_n * es + 8);
    r->recv = malloc(recv_n * es + 8);
    memset(r->recv, 0xA5, recv_n * es + 8); /* garbage, never zeros */
    /* all_gather inputs are indexed by their global position, so the gathered output is
     * checkable element by element. */
    fill(r->send, c->dtype, r->id, g_rank, send_first, send_n);
    pshard_coll_args_t a = {
        .op = c->op,
        .dtype = c->dtype,
        .reduce = c->reduce,
        .root = c->root,
        .send = send_n ? r->send : NULL,
        .recv = recv_n ? r->recv : NULL,
        .count = c->count,
        .counts = c->counts,
        .tag = r->id,
        .label = "test",
    };
    if (r->pieces && c->op != PSHARD_COLL_BARRIER) {
        if (c->op != PSHARD_COLL_BROADCAST || c->root == g_rank) {
            r->n_send_segs = make_pieces(r->id * 2, r->send, send_n, es, &r->send_segs);
            a.send_segs = r->send_segs;
            a.n_send_segs = r->n_send_segs;
        }
        r->n_recv_segs = make_pieces(r->id * 2 + 1, NULL, recv_n, es, &r->recv_segs);
        a.recv_segs = r->recv_segs;
        a.n_recv_segs = r->n_recv_segs;
    }
    if (r->blocking) {
        r->run_rc = pshard_coll_run(comm, &a, r->run_err, sizeof(r->run_err));
        return;
    }
    char err[1024] = "";
    pshard_status_t rc = pshard_coll_start(comm, &a, &r->req, err, sizeof(err));
    CHECK(rc == PSHARD_OK, "start case %" PRIu64 ": %s", r->id, err);
}

/* a (reduce) b on int64 bits, wrapping as the kernels do. */
static uint64_t reduce_i64(pshard_reduce_t reduce, uint64_t a, uint64_t b)
{
    switch (reduce) {
    case PSHARD_REDUCE_PRODUCT:
        return a * b;
    case PSHARD_REDUCE_MIN:
        return (int64_t)a < (int64_t)b ? a : b;
    case PSHARD_REDUCE_MAX:
        return (int64_t)a > (int64_t)b ? a : b;
    case PSHARD_REDUCE_BAND:
        return a & b;
    case PSHARD_REDUCE_BOR:
        return a | b;
    case PSHARD_REDUCE_BXOR:
        return a ^ b;
    default:
        return a + b;
    }
}

static void finish_case(running_t *r)
{
    const case_t *c = &r->c;
    char err[1024] = "";
    pshard_status_t rc = r->run_rc;
    if (r->blocking)
        ps_strlcpy(err, r->run_err, sizeof(err));
    else
        rc = pshard_coll_wait(r->req, err, sizeof(err));
    CHECK(rc == PSHARD_OK, "case %" PRIu64 " (%s %s count %zu%s): %s", r->id,
          pshard_coll_op_name(c->op), pshard_dtype_name(c->dtype), r->total,
          r->blocking ? ", blocking" : "", err);
    pshard_coll_req_free(r->req);
    size_t es = pshard_dtype_size(c->dtype);
    for (size_t i = 0, at = 0; rc == PSHARD_OK && i < r->n_recv_segs; i++) {
        if (r->recv_segs[i].count)
            memcpy((uint8_t *)r->recv + at * es, r->recv_segs[i].ptr, r->recv_segs[i].count * es);
        at += r->recv_segs[i].count;
    }
    free_pieces(r->send_segs, r->n_send_segs);
    free_pieces(r->recv_segs, r->n_recv_segs);
    if (rc == PSHARD_OK) {
        size_t bad = 0, first_bad = 0;
        double got_bad = 0, ref_bad = 0;
        size_t offset_mine = 0;
        for (int i = 0; i < g_rank; i++)
            offset_mine += r->counts[i];
        bool rooted_recv = c->op == PSHARD_COLL_REDUCE || c->op == PSHARD_COLL_GATHER;
        size_t n = rooted_recv && g_rank != c->root      ? 0
                   : c->op == PSHARD_COLL_ALL_GATHER     ? r->total
                   : c->op == PSHARD_COLL_REDUCE_SCATTER ? r->counts[g_rank]
                   : c->op == PSHARD_COLL_SCATTER        ? r->counts[g_rank]
                   : c->op == PSHARD_COLL_ALL_TO_ALL     ? c->count * (size_t)g_world
                   : c->op == PSHARD_COLL_BARRIER        ? 0
                                                         : r->total;
        for (size_t i = 0; i < n; i++) {
            double got = get(r->recv, c->dtype, i), ref = 0, abs_terms = 0;
            bool ok;
            if (c->op == PSHARD_COLL_ALL_GATHER || c->op == PSHARD_COLL_GATHER) {
                /* Element i came from the rank whose block holds it. */
                int owner = 0;
                size_t acc = 0;
                while (owner < g_world - 1 && i >= acc + r->counts[owner])
                    acc += r->counts[owner++];
                ref = input_value(r->id, owner, i, c->dtype);
                ok = got == ref;
            } else if (c->op == PSHARD_COLL_BROADCAST) {
                ref = input_value(r->id, c->root, i, c->dtype);
                ok = got == ref;
            } else if (c->op == PSHARD_COLL_ALL_TO_ALL) {
                /* Block q came from rank q: its block for this rank. */
                size_t q = c->count ? i / c->count : 0, j = c->count ? i % c->count : 0;
                ref = input_value(r->id, (int)q, (size_t)g_rank * c->count + j, c->dtype);
                ok = got == ref;
            } else if (c->op == PSHARD_COLL_SCATTER) {
                /* This rank's block of the root's input. */
                ref = input_value(r->id, c->root, offset_mine + i, c->dtype);
                ok = got == ref;
            } else if (is_int(c->dtype)) {
                /* Exact, wrapping modulo 2^width as the kernels do: computed in 64 bits on
                 * the (sign- or zero-extended) values, then cut to the width. */
                size_t gi = c->op == PSHARD_COLL_REDUCE_SCATTER ? offset_mine + i : i;
                uint64_t want = (uint64_t)(int64_t)input_value(r->id, 0, gi, c->dtype);
                for (int q = 1; q < g_world; q++) {
                    uint64_t v = (uint64_t)(int64_t)input_value(r->id, q, gi, c->dtype);
                    want = reduce_i64(c->reduce, want, v);
                }
                int64_t w = c->dtype == PSHARD_INT32   ? (int64_t)(int32_t)(uint32_t)want
                            : c->dtype == PSHARD_UINT8 ? (int64_t)(uint8_t)want
                                                       : (int64_t)want;
                int64_t g = c->dtype == PSHARD_INT32   ? ((const int32_t *)r->recv)[i]
                            : c->dtype == PSHARD_UINT8 ? ((const uint8_t *)r->recv)[i]
                                                       : ((const int64_t *)r->recv)[i];
                ref = (double)w;
                ok = g == w;
            } else {
                size_t gi = c->op == PSHARD_COLL_REDUCE_SCATTER ? offset_mine + i : i;
                bool sum = c->reduce == PSHARD_REDUCE_SUM || c->reduce == PSHARD_REDUCE_AVG;
                for (int q = 0; q < g_world; q++) {
                    double v = input_value(r->id, q, gi, c->dtype);
                    ref = q == 0 || sum                        ? (sum ? ref + v : v)
                          : c->reduce == PSHARD_REDUCE_PRODUCT ? ref * v
                          : c->reduce == PSHARD_REDUCE_MIN     ? fmin(ref, v)
                                                               : fmax(ref, v);
                    abs_terms += fabs(v);
                }
                if (c->reduce == PSHARD_REDUCE_AVG) {
                    ref /= g_world;
                    abs_terms /= g_world;
                }
                if (c->reduce == PSHARD_REDUCE_PRODUCT)
                    abs_terms = fabs(ref); /* each product rounds relative to its size */
                ok = c->reduce == PSHARD_REDUCE_MIN || c->reduce == PSHARD_REDUCE_MAX
                         ? got == ref
                         : close_enough(got, ref, abs_terms, c->dtype);
            }
            if (!ok) {
                if (bad++ == 0) {
                    first_bad = i;
                    got_bad = got;
                    ref_bad = ref;
                }
            }
        }
        CHECK(bad == 0,
              "case %" PRIu64 " (%s %s %s count %zu%s): %zu wrong elements, first at %zu: got "
              "%.9g want %.9g",
              r->id, pshard_coll_op_name(c->op), pshard_dtype_name(c->dtype),
              pshard_reduce_name(c->reduce), r->total, r->pieces ? ", in pieces" : "", bad,
              first_bad, got_bad, ref_bad);
    }
    free(r->counts);
    free(r->send);
    free(r->recv);
}

/* Runs one case and checks it: every other one (by id) as a blocking call, the others
 * started and waited for, so that both ways of running an operation see every case's shape. */
static void run_case_as(pshard_comm_t *comm, const case_t *c, uint64_t id, bool pieces)
{
    running_t r = {.c = *c, .id = id, .pieces = pieces, .blocking = id % 2 == 1};
    start_case(comm, &r);
    if (r.req || r.blocking)
        finish_case(&r);
}

static void run_case(pshard_comm_t *comm, const case_t *c, uint64_t id)
{
    run_case_as(comm, c, id, false);
}

static int scenario_correctness(bool big)
{
    char err[1024] = "";
    pshard_comm_t *comm =
        make_comm(big ? "big" : "correct", g_token, g_generation, 60000, NULL, err, sizeof(err));
    if (!comm) {
        fprintf(stderr, "rank %d: comm: %s\n", g_rank, err);
        return 1;
    }
    /* PSHARD_EXPECT_TRANSPORT: how a ring of several ranks must have chosen to move data. */
    const char *want = getenv("PSHARD_EXPECT_TRANSPORT");
    if (want && *want && g_world > 1)
        CHECK(strcmp(pshard_comm_transport(comm), want) == 0, "transport %s, expected %s",
              pshard_comm_transport(comm), want);
    uint64_t id = 1000;
    if (big) {
        /* 64 MiB of fp32 per operation, and bf16 reduce-scatter (window and rounds). */
        size_t n32 = (64u << 20) / 4;
        case_t cs[] = {
            {PSHARD_COLL_ALL_GATHER, PSHARD_FP32, PSHARD_REDUCE_SUM, n32 / (size_t)g_world, NULL,
             0},
            {PSHARD_COLL_REDUCE_SCATTER, PSHARD_FP32, PSHARD_REDUCE_SUM, n32 / (size_t)g_world,
             NULL, 0},
            {PSHARD_COLL_ALL_REDUCE, PSHARD_FP32, PSHARD_REDUCE_AVG, n32, NULL, 0},
            {PSHARD_COLL_REDUCE_SCATTER, PSHARD_BF16, PSHARD_REDUCE_SUM, n32 / (size_t)g_world + 3,
             NULL, 0},
        };
        for (size_t i = 0; i < PS_ARRAY_LEN(cs); i++)
            run_case(comm, &cs[i], id++);
    } else {
        static const size_t sizes[] = {0, 1, 2, 3, 7, 13, 97, 1021, 65537};
        static const pshard_dtype_t dtypes[] = {PSHARD_FP32,  PSHARD_BF16, PSHARD_FP16,
                                                PSHARD_INT64, PSHARD_FP64, PSHARD_INT32,
                                                PSHARD_UINT8};
        for (size_t d = 0; d < PS_ARRAY_LEN(dtypes); d++) {
            for (size_t s = 0; s < PS_ARRAY_LEN(sizes); s++) {
                size_t n = sizes[s];
                pshard_dtype_t dt = dtypes[d];
                case_t ag = {PSHARD_COLL_ALL_GATHER, dt, PSHARD_REDUCE_SUM, n, NULL, 0};
                case_t rs = {PSHARD_COLL_REDUCE_SCATTER, dt, PSHARD_REDUCE_SUM, n, NULL, 0};
                case_t ar = {PSHARD_COLL_ALL_REDUCE,
                             dt,
                             is_int(dt) ? PSHARD_REDUCE_SUM : PSHARD_REDUCE_AVG,
                             n,
                             NULL,
                             0};
                case_t bc = {PSHARD_COLL_BROADCAST,     dt, PSHARD_REDUCE_SUM, n, NULL,
                             (int)(s % (size_t)g_world)};
                run_case(comm, &ag, id++);
                run_case(comm, &rs, id++);
                run_case(comm, &ar, id++);
                run_case(comm, &bc, id++);
            }
        }
        /* v-forms with empty ranks: rank i has (i * 37) % 5 == 0 ? 0 : 11 * i + 3 elements. */
        size_t *vc = calloc((size_t)g_world, sizeof(size_t));
        for (int i = 0; i < g_world; i++)
            vc[i] = (i % 2 == 1) ? 0 : (size_t)(11 * i + 3);
        for (size_t d = 0; d < PS_ARRAY_LEN(dtypes); d++) {
            case_t agv = {PSHARD_COLL_ALL_GATHER, dtypes[d], PSHARD_REDUCE_SUM, 0, vc, 0};
            case_t rsv = {PSHARD_COLL_REDUCE_SCATTER, dtypes[d], PSHARD_REDUCE_SUM, 0, vc, 0};
            run_case(comm, &agv, id++);
            run_case(comm, &rsv, id++);
        }
        /* Buffers in pieces (some empty), every op and dtype, even and v counts. */
        static const size_t piece_sizes[] = {0, 1, 13, 1021, 65537};
        for (size_t d = 0; d < PS_ARRAY_LEN(dtypes); d++) {
            pshard_dtype_t dt = dtypes[d];
            for (size_t s = 0; s < PS_ARRAY_LEN(piece_sizes); s++) {
                size_t n = piece_sizes[s];
                case_t cs[] = {
                    {PSHARD_COLL_ALL_GATHER, dt, PSHARD_REDUCE_SUM, n, NULL, 0},
                    {PSHARD_COLL_REDUCE_SCATTER, dt, PSHARD_REDUCE_SUM, n, NULL, 0},
                    {PSHARD_COLL_ALL_REDUCE, dt, is_int(dt) ? PSHARD_REDUCE_SUM : PSHARD_REDUCE_AVG,
                     n, NULL, 0},
                    {PSHARD_COLL_BROADCAST, dt, PSHARD_REDUCE_SUM, n, NULL,
                     (int)((s + 1) % (size_t)g_world)},
                };
                for (size_t k = 0; k < PS_ARRAY_LEN(cs); k++)
                    run_case_as(comm, &cs[k], id++, true);
            }
            case_t agv = {PSHARD_COLL_ALL_GATHER, dt, PSHARD_REDUCE_SUM, 0, vc, 0};
            case_t rsv = {PSHARD_COLL_REDUCE_SCATTER, dt, PSHARD_REDUCE_SUM, 0, vc, 0};
            run_case_as(comm, &agv, id++, true);
            run_case_as(comm, &rsv, id++, true);
        }
        /* The other reductions: product, min, max for every dtype, the bitwise ones for int64;
         * all_reduce and reduce_scatter, contiguous and in pieces. */
        static const size_t op_sizes[] = {0, 1, 13, 1021, 65537};
        for (size_t d = 0; d < PS_ARRAY_LEN(dtypes); d++) {
            pshard_dtype_t dt = dtypes[d];
            for (int red = PSHARD_REDUCE_PRODUCT; red < PSHARD_REDUCE_COUNT; red++) {
                if (pshard_reduce_problem((pshard_reduce_t)red, dt))
                    continue;
                for (size_t s = 0; s < PS_ARRAY_LEN(op_sizes); s++) {
                    size_t n = op_sizes[s];
                    case_t ar = {PSHARD_COLL_ALL_REDUCE, dt, (pshard_reduce_t)red, n, NULL, 0};
                    case_t rs = {PSHARD_COLL_REDUCE_SCATTER, dt, (pshard_reduce_t)red, n, NULL, 0};
                    run_case_as(comm, &ar, id++, s % 2 == 1);
                    run_case_as(comm, &rs, id++, s % 2 == 0);
                }
            }
        }
        /* reduce, gather and scatter to and from every root, even and v counts. */
        for (size_t d = 0; d < PS_ARRAY_LEN(dtypes); d++) {
            pshard_dtype_t dt = dtypes[d];
            for (size_t s = 0; s < PS_ARRAY_LEN(op_sizes); s++) {
                for (int root = 0; root < g_world; root++) {
                    size_t n = op_sizes[s];
                    case_t cs[] = {
                        {PSHARD_COLL_REDUCE, dt, is_int(dt) ? PSHARD_REDUCE_MAX : PSHARD_REDUCE_AVG,
                         n, NULL, root},
                        {PSHARD_COLL_GATHER, dt, PSHARD_REDUCE_SUM, n, NULL, root},
                        {PSHARD_COLL_SCATTER, dt, PSHARD_REDUCE_SUM, n, NULL, root},
                    };
                    for (size_t k = 0; k < PS_ARRAY_LEN(cs); k++)
                        run_case(comm, &cs[k], id++);
                }
            }
            for (size_t s = 0; s < PS_ARRAY_LEN(op_sizes); s++) {
                case_t aa = {PSHARD_COLL_ALL_TO_ALL, dt, PSHARD_REDUCE_SUM, op_sizes[s], NULL, 0};
                run_case(comm, &aa, id++);
            }
            case_t gv = {PSHARD_COLL_GATHER, dt, PSHARD_REDUCE_SUM, 0, vc, g_world - 1};
            case_t sv = {PSHARD_COLL_SCATTER, dt, PSHARD_REDUCE_SUM, 0, vc, 0};
            run_case(comm, &gv, id++);
            run_case(comm, &sv, id++);
        }
        /* A bitwise reduction of floats is refused locally. */
        pshard_coll_args_t band = {.op = PSHARD_COLL_ALL_REDUCE,
                                   .dtype = PSHARD_FP32,
                                   .reduce = PSHARD_REDUCE_BAND,
                                   .count = 1,
                                   .send = &(float){1},
                                   .recv = &(float){0}};
        pshard_coll_req_t *band_req = NULL;
        err[0] = '\0';
        CHECK(pshard_coll_start(comm, &band, &band_req, err, sizeof(err)) ==
                      PSHARD_ERR_INVALID_ARGUMENT &&
                  strstr(err, "band is for integer dtypes only"),
              "band of fp32: %s", err);
        /* Many asynchronous operations in flight, completed in issue order. */
        running_t inflight[24];
        for (int i = 0; i < 24; i++) {
            case_t c = {(pshard_coll_op_t)(1 + i % 4), (pshard_dtype_t)(i % PSHARD_DTYPE_COUNT),
                        PSHARD_REDUCE_SUM,
                        /* every third one too big for the same-host slots: queued on the
                           engine, with the small ones waiting their turn behind it */
                        (size_t)(i % 3 == 2 ? 20000 + 17 * i : 1000 + 17 * i), NULL, i % g_world};
            inflight[i] = (running_t){.c = c, .id = id++};
            start_case(comm, &inflight[i]);
        }
        for (int i = 0; i < 24; i++)
            if (inflight[i].req)
                finish_case(&inflight[i]);
        free(vc);
        /* A barrier completes. */
        pshard_coll_args_t b = {.op = PSHARD_COLL_BARRIER};
        CHECK(pshard_coll_run(comm, &b, err, sizeof(err)) == PSHARD_OK, "barrier: %s", err);
        /* Bad arguments are refused locally without breaking the communicator. */
        pshard_coll_args_t bad = {
            .op = PSHARD_COLL_BROADCAST, .dtype = PSHARD_FP32, .root = 99, .count = 1};
        pshard_coll_req_t *req = NULL;
        err[0] = '\0';
        CHECK(pshard_coll_start(comm, &bad, &req, err, sizeof(err)) ==
                      PSHARD_ERR_INVALID_ARGUMENT &&
                  strstr(err, "root"),
              "bad root accepted: %s", err);
        case_t after = {PSHARD_COLL_ALL_REDUCE, PSHARD_FP32, PSHARD_REDUCE_SUM, 5, NULL, 0};
        run_case(comm, &after, id++);
        /* The flight recorder holds the recent operations. */
        pshard_coll_record_t recs[8];
        size_t nr = pshard_comm_flight_records(comm, recs, 8);
        CHECK(nr == 8 && recs[7].state == PSHARD_COLL_DONE, "flight recorder: %zu records", nr);
    }
    pshard_comm_destroy(comm);
    if (g_failures == 0)
        printf("rank %d: correctness%s passed\n", g_rank, big ? " (big)" : "");
    return g_failures ? 1 : 0;
}

/* Every rank runs an all_reduce; the last rank uses a different dtype (or count, or op), and
 * every rank must fail with DESYNC naming both sides. */
static int scenario_desync(const char *what)
{
    char err[1024] = "";
    pshard_comm_t *comm = make_comm("desync", g_token, g_generation, 20000, NULL, err, sizeof(err));
    if (!comm) {
        fprintf(stderr, "rank %d: comm: %s\n", g_rank, err);
        return 1;
    }
    /* One good operation first. */
    case_t ok = {PSHARD_COLL_ALL_REDUCE, PSHARD_FP32, PSHARD_REDUCE_SUM, 1000, NULL, 0};
    run_case(comm, &ok, 1);
    bool odd = g_rank == g_world - 1;
    static float buf[100000];
    for (int i = 0; i < 100000; i++)
        buf[i] = 1.0f + (float)i;
    pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_REDUCE,
                            .dtype = PSHARD_FP32,
                            .count = 1000,
                            .send = buf,
                            .recv = buf,
                            .tag = 7};
    if (odd && strcmp(what, "dtype") == 0)
        a.dtype = PSHARD_BF16;
    else if (odd && strcmp(what, "count") == 0)
        a.count = 1001;
    else if (odd && strcmp(what, "size") == 0)
        a.count = 100000; /* through the engine on a same-host ring, where the others use the
                             slots: each side must still see the other's descriptor */
    else if (odd && strcmp(what, "op") == 0)
        a.op = PSHARD_COLL_BROADCAST;
    else if (odd && strcmp(what, "tag") == 0)
        a.tag = 8;
    if (strcmp(what, "root") == 0) { /* a reduce to rank 0, but the last rank names rank 1 */
        a.op = PSHARD_COLL_REDUCE;
        a.root = odd ? 1 : 0;
    }
    err[0] = '\0';
    int64_t t0 = ps_now_ns();
    pshard_status_t rc = pshard_coll_run(comm, &a, err, sizeof(err));
    double secs = (double)(ps_now_ns() - t0) / 1e9;
    CHECK(rc == PSHARD_ERR_DESYNC, "expected DESYNC, got %s: %s", pshard_status_name(rc), err);
    char r_last[32];
    snprintf(r_last, sizeof(r_last), "rank %d", g_world - 1);
    bool root_case = strcmp(what, "root") == 0;
    CHECK(strstr(err, "desync") && strstr(err, r_last) &&
              strstr(err, root_case ? "reduce" : "all_reduce") &&
              (!root_case || (strstr(err, "root 0") && strstr(err, "root 1"))),
          "message does not name both sides: %s", err);
    CHECK(secs < 10, "desync took %.1f s", secs);
    /* The communicator stays failed. */
    char err2[1024] = "";
    CHECK(pshard_coll_run(comm, &a, err2, sizeof(err2)) == PSHARD_ERR_DESYNC,
          "second call after desync: %s", err2);
    printf("rank %d: desync(%s) -> %s\n", g_rank, what, err);
    pshard_comm_destroy(comm);
    return g_failures ? 1 : 0;
}

/* An in-place all_reduce (sum) of n fp32 on every rank, each rank's values rank + i, marked
 * divertible with check (0: not marked); blocking or started and waited for. */
static pshard_status_t divert_op(pshard_comm_t *comm, float *buf, size_t n, uint64_t check,
                                 bool blocking, char *err, size_t errlen)
{
    for (size_t i = 0; i < n; i++)
        buf[i] = (float)g_rank + (float)(i % 1000);
    pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_REDUCE,
                            .dtype = PSHARD_FP32,
                            .reduce = PSHARD_REDUCE_SUM,
                            .count = n,
                            .send = buf,
                            .recv = buf,
                            .tag = 3};
    if (check)
        pshard_comm_divert_next(comm, check);
    if (blocking)
        return pshard_coll_run(comm, &a, err, errlen);
    pshard_coll_req_t *req = NULL;
    pshard_status_t rc = pshard_coll_start(comm, &a, &req, err, errlen);
    if (rc == PSHARD_OK)
        rc = pshard_coll_wait(req, err, errlen);
    pshard_coll_req_free(req);
    return rc;
}

/* Whether buf holds what divert_op's sum gives (summed: true) or this rank's own values. */
static bool divert_holds(const float *buf, size_t n, bool summed)
{
    float ranks = (float)(g_world * (g_world - 1)) / 2.0f;
    for (size_t i = 0; i < n; i++) {
        float own = (float)g_rank + (float)(i % 1000);
        float want = summed ? ranks + (float)g_world * (float)(i % 1000) : own;
        if (buf[i] != want)
            return false;
    }
    return true;
}

/* pshard_comm_divert_next: where the ring can divert (the slots, the sockets), divertible
 * operations with the same check run as usual; a different check on the last rank diverts the
 * operation on every rank (DIVERTED, no data moved, the communicator usable), small or big,
 * blocking or queued, as does another divertible operation altogether; a difference with an
 * operation that is not divertible stays a desync. Elsewhere nothing can be marked. */
static int scenario_divert(void)
{
    char err[1024] = "";
    pshard_comm_t *comm = make_comm("divert", g_token, g_generation, 20000, NULL, err, sizeof(err));
    if (!comm) {
        fprintf(stderr, "rank %d: comm: %s\n", g_rank, err);
        return 1;
    }
    const char *slot_env = getenv("PSHARD_SHM_SLOT_BYTES");
    const char *transport = pshard_comm_transport(comm);
    bool slots = strcmp(transport, "shm") == 0 && !(slot_env && strcmp(slot_env, "0") == 0);
    bool want = slots || strcmp(transport, "tcp") == 0;
    bool can = pshard_comm_divert_next(comm, 0);
    CHECK(can == want, "divertible: %d on a ring over %s%s", can, transport,
          strcmp(transport, "shm") == 0 ? (slots ? " with slots" : " without slots") : "");
    bool odd = g_rank == g_world - 1;
    static float buf[100000];
    static const size_t sizes[] = {8, 3000, 100000}; /* the mail, a slot, the peers' memory */
    for (size_t k = 0; can && k < PS_ARRAY_LEN(sizes); k++) {
        size_t n = sizes[k];
        bool blocking = k != 1;
        /* the same check: runs */
        pshard_status_t rc = divert_op(comm, buf, n, 0x1234, blocking, err, sizeof(err));
        CHECK(rc == PSHARD_OK && divert_holds(buf, n, true), "%zu alike: %s: %s", n,
              pshard_status_name(rc), err);
        /* another check on the last rank: diverted everywhere, nothing moved */
        err[0] = '\0';
        rc = divert_op(comm, buf, n, odd ? 0x5678 : 0x1234, blocking, err, sizeof(err));
        CHECK(rc == PSHARD_ERR_DIVERTED && strstr(err, "diverted") && divert_holds(buf, n, false),
              "%zu, another check: %s: %s", n, pshard_status_name(rc), err);
        if (k == 0 && g_rank == 0)
            printf("rank 0: %s\n", err);
        /* another divertible operation (what an agreement round is): diverted as well */
        int64_t rec[16] = {g_rank}, recs[16 * 16];
        pshard_coll_args_t ag = {.op = PSHARD_COLL_ALL_GATHER,
                                 .dtype = PSHARD_INT64,
                                 .send = rec,
                                 .recv = recs,
                                 .count = 16,
                                 .tag = 9};
        if (odd) {
            pshard_comm_divert_next(comm, 0x9999);
            rc = pshard_coll_run(comm, &ag, err, sizeof(err));
        } else {
            rc = divert_op(comm, buf, n, 0x1234, blocking, err, sizeof(err));
            CHECK(divert_holds(buf, n, false), "%zu: the buffer changed", n);
        }
        CHECK(rc == PSHARD_ERR_DIVERTED, "%zu against an all_gather: %s: %s", n,
              pshard_status_name(rc), err);
        /* and the communicator goes on, unmarked */
        rc = divert_op(comm, buf, n, 0, !blocking, err, sizeof(err));
        CHECK(rc == PSHARD_OK && divert_holds(buf, n, true), "%zu after: %s: %s", n,
              pshard_status_name(rc), err);
    }
    if (can) {
        /* a divertible operation against one that is not: a desync, the communicator failed */
        pshard_status_t rc = divert_op(comm, buf, 8, odd ? 0 : 0x1234, true, err, sizeof(err));
        CHECK(rc == PSHARD_ERR_DESYNC, "marked against unmarked: %s: %s", pshard_status_name(rc),
              err);
        CHECK(pshard_comm_error(comm, NULL, 0) == PSHARD_ERR_DESYNC, "the desync is not sticky");
    }
    printf("rank %d: divert (%s) %s\n", g_rank, pshard_comm_transport(comm),
           can ? "checked" : "not available, as expected");
    pshard_comm_destroy(comm);
    return g_failures ? 1 : 0;
}

/* Rank 1 kills itself (SIGKILL) in the middle of a large all_reduce (small: before an
 * all_reduce of 8 bytes, which a same-host ring runs through its slots; closed: it destroys the
 * communicator instead and stays alive a while); the others must fail with PEER_LOST naming
 * rank 1, promptly. */
static int scenario_kill(const char *how)
{
    char err[1024] = "";
    pshard_comm_t *comm = make_comm("kill", g_token, g_generation, 30000, NULL, err, sizeof(err));
    if (!comm) {
        fprintf(stderr, "rank %d: comm: %s\n", g_rank, err);
        return 1;
    }
    bool closed = strcmp(how, "closed") == 0;
    if (closed || strcmp(how, "small") == 0) {
        double v[1] = {1.0};
        pshard_coll_args_t a = {
            .op = PSHARD_COLL_ALL_REDUCE, .dtype = PSHARD_FP64, .count = 1, .send = v, .recv = v};
        CHECK(pshard_coll_run(comm, &a, err, sizeof(err)) == PSHARD_OK, "first all_reduce: %s",
              err);
        if (g_rank == 1) {
            struct timespec ts = {0, 100 * 1000000};
            nanosleep(&ts, NULL);
            if (!closed)
                raise(SIGKILL);
            pshard_comm_destroy(comm);
            ts.tv_sec = 2;
            nanosleep(&ts, NULL);
            return 0;
        }
        int64_t t0 = ps_now_ns();
        pshard_status_t rc = pshard_coll_run(comm, &a, err, sizeof(err));
        double secs = (double)(ps_now_ns() - t0) / 1e9;
        CHECK(rc == PSHARD_ERR_PEER_LOST, "expected PEER_LOST, got %s: %s", pshard_status_name(rc),
              err);
        CHECK(strstr(err, "rank 1") != NULL, "message does not name rank 1: %s", err);
        CHECK(secs < 10, "took %.1f s to notice", secs);
        printf("rank %d: %s -> %s after %.3f s\n", g_rank, how, err, secs);
        pshard_comm_destroy(comm);
        return g_failures ? 1 : 0;
    }
    size_t n = 16u << 20;
    float *buf = calloc(n, sizeof(float));
    for (size_t i = 0; i < n; i++)
        buf[i] = 1.0f;
    pshard_coll_args_t a = {
        .op = PSHARD_COLL_ALL_REDUCE, .dtype = PSHARD_FP32, .count = n, .send = buf, .recv = buf};
    pshard_coll_req_t *req = NULL;
    pshard_coll_start(comm, &a, &req, err, sizeof(err));
    if (g_rank == 1) {
        struct timespec ts = {0, 20 * 1000000};
        nanosleep(&ts, NULL);
        raise(SIGKILL);
    }
    int64_t t0 = ps_now_ns();
    pshard_status_t rc = pshard_coll_wait(req, err, sizeof(err));
    double secs = (double)(ps_now_ns() - t0) / 1e9;
    pshard_coll_req_free(req);
    CHECK(rc == PSHARD_ERR_PEER_LOST, "expected PEER_LOST, got %s: %s", pshard_status_name(rc),
          err);
    CHECK(strstr(err, "rank 1") != NULL, "message does not name rank 1: %s", err);
    CHECK(secs < 10, "took %.1f s to notice", secs);
    printf("rank %d: kill -> %s after %.3f s\n", g_rank, err, secs);
    free(buf);
    pshard_comm_destroy(comm);
    return g_failures ? 1 : 0;
}

typedef struct {
    pshard_comm_t *comm;
    int64_t abort_ns;
} aborter_t;

static void *abort_thread(void *arg)
{
    aborter_t *a = arg;
    struct timespec ts = {0, 300 * 1000000};
    nanosleep(&ts, NULL);
    a->abort_ns = ps_now_ns();
    pshard_comm_abort(a->comm, "test abort");
    return NULL;
}

/* Rank 0 waits in an all_gather its peers never join; another thread aborts after 300 ms; the
 * waiter must return ABORTED long before the operation's 30 s timeout (within 5 s of the
 * abort: a bound a busy machine under the sanitizers keeps; the release time is printed).
 * Peers wait for rank 0's notice. */
static int scenario_abort(bool big)
{
    char err[1024] = "";
    pshard_comm_t *comm = make_comm("abort", g_token, g_generation, 30000, NULL, err, sizeof(err));
    if (!comm) {
        fprintf(stderr, "rank %d: comm: %s\n", g_rank, err);
        return 1;
    }
    /* big: 64 MiB per rank, so rank 0 is blocked in the middle of a DATA frame when it aborts
     * (its peers are not reading yet); the rest of that frame is padded and the abort notice
     * must still arrive intact. */
    /* Not big: 4 KiB a rank, more than a descriptor carries, so the late ranks' all-gather
     * needs rank 0's data after its descriptor and must see its abort (a few bytes would
     * travel in the descriptors, and a late rank could complete before the notice came). */
    size_t count = big ? (16u << 20) : 1024;
    float *in = calloc(count, sizeof(float));
    float *out = calloc(count * (size_t)g_world, sizeof(float));
    if (!in || !out)
        return 1;
    if (g_rank == 0) {
        aborter_t ab = {comm, 0};
        pthread_t t;
        pthread_create(&t, NULL, abort_thread, &ab);
        pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_GATHER,
                                .dtype = PSHARD_FP32,
                                .count = count,
                                .send = in,
                                .recv = out};
        pshard_status_t rc = pshard_coll_run(comm, &a, err, sizeof(err));
        int64_t released = ps_now_ns();
        pthread_join(t, NULL);
        double ms = (double)(released - ab.abort_ns) / 1e6;
        CHECK(rc == PSHARD_ERR_ABORTED, "expected ABORTED, got %s: %s", pshard_status_name(rc),
              err);
        CHECK(ms < 5000, "waiter released %.1f ms after abort (the timeout is 30 s)", ms);
        printf("rank 0: abort released the waiter after %.2f ms: %s\n", ms, err);
    } else {
        /* Join late: by then rank 0 has aborted and told the ring. */
        struct timespec ts = {0, 600 * 1000000};
        nanosleep(&ts, NULL);
        pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_GATHER,
                                .dtype = PSHARD_FP32,
                                .count = count,
                                .send = in,
                                .recv = out};
        pshard_status_t rc = pshard_coll_run(comm, &a, err, sizeof(err));
        CHECK(rc == PSHARD_ERR_ABORTED, "peer expected ABORTED, got %s: %s", pshard_status_name(rc),
              err);
        CHECK(strstr(err, "rank 0") != NULL, "peer message does not name rank 0: %s", err);
    }
    pshard_comm_destroy(comm);
    free(in);
    free(out);
    return g_failures ? 1 : 0;
}

/* The last rank never calls the collective: everyone else times out naming who they wait on. */
static int scenario_timeout(void)
{
    char err[1024] = "";
    pshard_comm_t *comm =
        make_comm("timeout", g_token, g_generation, 30000, NULL, err, sizeof(err));
    if (!comm) {
        fprintf(stderr, "rank %d: comm: %s\n", g_rank, err);
        return 1;
    }
    float in[4] = {1, 2, 3, 4}, out[64];
    int silent = g_world - 1;
    if (g_rank != silent) {
        pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_GATHER,
                                .dtype = PSHARD_FP32,
                                .count = 4,
                                .send = in,
                                .recv = out,
                                .timeout_ms = 500};
        int64_t t0 = ps_now_ns();
        pshard_status_t rc = pshard_coll_run(comm, &a, err, sizeof(err));
        double secs = (double)(ps_now_ns() - t0) / 1e9;
        /* The rank right after the silent one times out itself; the others may first hear of
         * it from a peer's notice: either way the silent rank is named. */
        char who[32];
        snprintf(who, sizeof(who), "rank %d", silent);
        CHECK(rc == PSHARD_ERR_TIMEOUT, "expected TIMEOUT, got %s: %s", pshard_status_name(rc),
              err);
        CHECK(strstr(err, who) != NULL, "message does not name %s: %s", who, err);
        CHECK(secs < 5, "took %.1f s", secs);
        printf("rank %d: timeout -> %s\n", g_rank, err);
    } else {
        struct timespec ts = {2, 0};
        nanosleep(&ts, NULL);
    }
    pshard_comm_destroy(comm);
    return g_failures ? 1 : 0;
}

/* Rank 1 uses a wrong token (or an old generation): both links to it must be refused. */
static int scenario_impostor(const char *what)
{
    char err[1024] = "";
    const char *token = g_token;
    uint64_t gen = g_generation;
    if (g_rank == 1 && strcmp(what, "token") == 0)
        token = "not-the-cluster-token";
    if (g_rank == 1 && strcmp(what, "generation") == 0)
        gen = g_generation - 1;
    pshard_status_t rc = PSHARD_OK;
    /* Explicit peers (PSHARD_TEST_PEERS="host:port,host:port"): the impostor dials the real
     * ring directly, as a stray or stale process would. */
    const char *env = getenv("PSHARD_TEST_PEERS");
    char peers_buf[256];
    const char *peers[2] = {NULL, NULL};
    if (!env || ps_strlcpy(peers_buf, env, sizeof(peers_buf)) != 0 || g_world != 2)
        return 2;
    char *comma = strchr(peers_buf, ',');
    if (!comma)
        return 2;
    *comma = '\0';
    peers[0] = peers_buf;
    peers[1] = comma + 1;
    pshard_comm_config_t cfg = {
        .rank = g_rank,
        .world_size = g_world,
        .name = "impostor",
        .peers = peers,
        .token = token,
        .generation = gen,
        .connect_timeout_ms = 3000,
    };
    pshard_comm_t *comm = NULL;
    rc = pshard_comm_create(&cfg, &comm, err, sizeof(err));
    CHECK(rc != PSHARD_OK, "rank %d joined a ring with an impostor", g_rank);
    printf("rank %d: impostor(%s) -> %s: %s\n", g_rank, what, pshard_status_name(rc), err);
    CHECK(rc == PSHARD_ERR_PERMISSION, "expected PERMISSION, got %s", pshard_status_name(rc));
    if (strcmp(what, "generation") == 0)
        CHECK(strstr(err, "generation") != NULL, "message does not mention the generation: %s",
              err);
    else
        CHECK(strstr(err, "token") != NULL, "message does not mention the token: %s", err);
    pshard_comm_destroy(comm);
    return g_failures ? 1 : 0;
}

/* Explicit peers as in scenario_impostor, everyone genuine: the ring must link within
 * link_ms although the test keeps stalled strangers connected to rank 0's port, then an
 * all-reduce must give the right sum. */
static int scenario_besieged(const char *link_ms)
{
    const char *env = getenv("PSHARD_TEST_PEERS");
    char peers_buf[256], err[1024] = "";
    const char *peers[2] = {NULL, NULL};
    int64_t limit = 0;
    if (!env || ps_strlcpy(peers_buf, env, sizeof(peers_buf)) != 0 || g_world != 2 ||
        ps_parse_i64(link_ms, 1, 600000, &limit) != 0)
        return 2;
    char *comma = strchr(peers_buf, ',');
    if (!comma)
        return 2;
    *comma = '\0';
    peers[0] = peers_buf;
    peers[1] = comma + 1;
    pshard_comm_config_t cfg = {
        .rank = g_rank,
        .world_size = g_world,
        .name = "besieged",
        .peers = peers,
        .token = g_token,
        .generation = g_generation,
        .connect_timeout_ms = limit,
    };
    pshard_comm_t *comm = NULL;
    int64_t t0 = ps_now_ns();
    pshard_status_t rc = pshard_comm_create(&cfg, &comm, err, sizeof(err));
    double ms = (double)(ps_now_ns() - t0) / 1e6;
    CHECK(rc == PSHARD_OK, "rank %d could not link in %lld ms: %s", g_rank, (long long)limit, err);
    if (rc != PSHARD_OK)
        return 1;
    printf("rank %d: linked in %.0f ms\n", g_rank, ms);
    float v[4] = {1, 2, 3, (float)g_rank}, sum[4] = {0};
    pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_REDUCE,
                            .dtype = PSHARD_FP32,
                            .count = 4,
                            .reduce = PSHARD_REDUCE_SUM,
                            .send = v,
                            .recv = sum,
                            .timeout_ms = 10000};
    rc = pshard_coll_run(comm, &a, err, sizeof(err));
    CHECK(rc == PSHARD_OK && sum[0] == 2 && sum[3] == 1, "all-reduce: %s (%g %g)",
          pshard_status_name(rc), sum[0], sum[3]);
    pshard_comm_destroy(comm);
    return g_failures ? 1 : 0;
}

/* Runs an all_reduce, a reduce and a barrier with stderr going to a file, first with
 * PSHARD_LOG=info alone (no per-operation lines), then with PSHARD_LOG_SUBSYS=coll (one line
 * each, in call order, naming op, seq, dtype, count, root and the communicator). */
static int scenario_logline(void)
{
    char err[1024] = "";
    pshard_comm_t *comm =
        make_comm("logline", g_token, g_generation, 20000, NULL, err, sizeof(err));
    if (!comm) {
        fprintf(stderr, "rank %d: comm: %s\n", g_rank, err);
        return 1;
    }
    char path[] = "/tmp/pshard-logline-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp: %s", strerror(errno));
    if (fd < 0)
        return 1;
    unlink(path);
    int saved = dup(2);
    fflush(stderr);
    dup2(fd, 2);
    float buf[37] = {0};
    for (int round = 0; round < 2; round++) {
        setenv("PSHARD_LOG", "info", 1);
        if (round == 0)
            unsetenv("PSHARD_LOG_SUBSYS");
        else
            setenv("PSHARD_LOG_SUBSYS", "coll", 1);
        ps_log_init("logline");
        if (round == 1) /* the first round's lines end before this mark */
            (void)!write(2, "--- named ---\n", 14);
        pshard_coll_args_t ar = {.op = PSHARD_COLL_ALL_REDUCE,
                                 .dtype = PSHARD_FP32,
                                 .count = 37,
                                 .send = buf,
                                 .recv = buf,
                                 .tag = 0x51};
        pshard_coll_args_t rd = ar;
        rd.op = PSHARD_COLL_REDUCE;
        rd.root = g_world - 1;
        rd.reduce = PSHARD_REDUCE_MAX;
        pshard_coll_args_t b = {.op = PSHARD_COLL_BARRIER};
        CHECK(pshard_coll_run(comm, &ar, err, sizeof(err)) == PSHARD_OK &&
                  pshard_coll_run(comm, &rd, err, sizeof(err)) == PSHARD_OK &&
                  pshard_coll_run(comm, &b, err, sizeof(err)) == PSHARD_OK,
              "operations: %s", err);
    }
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    ps_log_set_level(PS_LOG_WARN);
    char text[8192] = "";
    ssize_t n = pread(fd, text, sizeof(text) - 1, 0);
    close(fd);
    text[n > 0 ? n : 0] = '\0';
    const char *mark = strstr(text, "--- named ---");
    CHECK(mark != NULL, "no mark in the log:\n%s", text);
    if (mark) {
        CHECK(strstr(text, "coll ") == NULL || strstr(text, "coll ") > mark,
              "per-operation lines without PSHARD_LOG_SUBSYS=coll:\n%s", text);
        char want[3][96];
        snprintf(want[0], sizeof(want[0]), "coll all_reduce seq %d fp32 sum tag 0x51 total 37", 3);
        snprintf(want[1], sizeof(want[1]), "coll reduce seq %d fp32 max root %d tag 0x51", 4,
                 g_world - 1);
        snprintf(want[2], sizeof(want[2]), "coll barrier seq %d", 5);
        const char *at = mark;
        for (int i = 0; i < 3; i++) {
            const char *p = strstr(at, want[i]);
            CHECK(p != NULL, "no line '%s' (in order) in:\n%s", want[i], mark);
            if (p)
                at = p;
        }
        CHECK(strstr(mark, "communicator logline") && strstr(mark, "done in"),
              "lines lack the communicator or the outcome:\n%s", mark);
    }
    pshard_comm_destroy(comm);
    return g_failures ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s COORDINATOR RANK WORLD SCENARIO [ARG] [TOKEN]\n", argv[0]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    g_coordinator = argv[1];
    int64_t v;
    if (ps_parse_i64(argv[2], 0, 1024, &v) != 0)
        return 2;
    g_rank = (int)v;
    if (ps_parse_i64(argv[3], 1, 1024, &v) != 0)
        return 2;
    g_world = (int)v;
    const char *scenario = argv[4];
    const char *arg = argc > 5 ? argv[5] : "";
    g_token = argc > 6 ? argv[6] : "test-token";
    g_generation = 5;
    if (strcmp(scenario, "correctness") == 0)
        return scenario_correctness(false);
    if (strcmp(scenario, "big") == 0)
        return scenario_correctness(true);
    if (strcmp(scenario, "desync") == 0)
        return scenario_desync(arg);
    if (strcmp(scenario, "divert") == 0)
        return scenario_divert();
    if (strcmp(scenario, "kill") == 0)
        return scenario_kill(arg);
    if (strcmp(scenario, "abort") == 0)
        return scenario_abort(strcmp(arg, "big") == 0);
    if (strcmp(scenario, "timeout") == 0)
        return scenario_timeout();
    if (strcmp(scenario, "impostor") == 0)
        return scenario_impostor(arg);
    if (strcmp(scenario, "besieged") == 0)
        return scenario_besieged(arg);
    if (strcmp(scenario, "logline") == 0)
        return scenario_logline();
    fprintf(stderr, "unknown scenario %s\n", scenario);
    return 2;
}
