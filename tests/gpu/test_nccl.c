/* End-to-end tests of the nccl collectives backend. A one-rank communicator on GPU 0 runs every
 * collective (all-gather, reduce-scatter and all-reduce with sum and average, broadcast,
 * barrier; equal and per-rank counts; in place and not) on device buffers holding random
 * non-zero fp32 and bf16 data, copies the results back and checks them; then the same through
 * the grouped per-rank NCCL path (PSHARD_NCCL_FORCE_GROUPED=1), abort, and a bad device. With
 * two or more GPUs it also runs the checks with one rank per GPU (threads of this process) and
 * a deliberate desync, which must fail with PSHARD_ERR_DESYNC before any NCCL call.
 * Without a CUDA device or driver it exits 77, which CTest reports as skipped. */
#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "ps_test.h"
#include "pshard/collectives.h"
#include "pshard/dtype.h"
#include "pshard/util.h"

#define MAX_WORLD 8
#define TOKEN "gpu-test-token-0123"

static int g_devices;

/* One rank's view of a test: where it runs and how many of its checks failed. Each rank is
 * one thread, so failures are counted per rank and asserted by the main thread. */
typedef struct {
    int rank, world;
    const char *const *peers;
    unsigned seed; /* advanced identically on every rank: each check gets fresh data */
    int failures;
    bool host;   /* buffers are host memory (the communicator's host_buffers mode) */
    bool pinned; /* host buffers page-locked with pshard_host_pin */
} rank_ctx_t;

#define EXPECT(ctx, cond, ...)                                                                     \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            (ctx)->failures++;                                                                     \
            fprintf(stderr, "rank %d: %s:%d: ", (ctx)->rank, __FILE__, __LINE__);                  \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

/* ---------------------------------------------------------------------------------------- */
/* Data                                                                                      */

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Element i of rank r's input in check `seed`; never zero. fp32: random in +-[0.25, 4).
 * bf16: multiples of 1/8 in +-[1/8, 2], exact in bf16, and so are their sums over 8 ranks. */
static float input_value(pshard_dtype_t dt, unsigned seed, int rank, size_t i)
{
    uint64_t x = mix64(((uint64_t)seed << 44) ^ ((uint64_t)rank << 36) ^ (uint64_t)i);
    double sign = (x & 1) ? -1.0 : 1.0;
    if (dt == PSHARD_BF16)
        return (float)(sign * (double)(1 + (x >> 1) % 16) / 8.0);
    double u = (double)(x >> 11) / 9007199254740992.0;
    return (float)(sign * (0.25 + 3.75 * u));
}

static void put_value(pshard_dtype_t dt, void *buf, size_t i, float v)
{
    if (dt == PSHARD_FP32)
        ((float *)buf)[i] = v;
    else
        ((uint16_t *)buf)[i] = ps_f32_to_bf16(v);
}

static float get_value(pshard_dtype_t dt, const void *buf, size_t i)
{
    if (dt == PSHARD_FP32)
        return ((const float *)buf)[i];
    return ps_bf16_to_f32(((const uint16_t *)buf)[i]);
}

/* A host buffer of n elements: input_value(seed, rank, first + j) for j < n. Free with free. */
static void *host_input(pshard_dtype_t dt, unsigned seed, int rank, size_t first, size_t n)
{
    void *h = malloc(n * pshard_dtype_size(dt) + 1);
    for (size_t j = 0; j < n; j++)
        put_value(dt, h, j, input_value(dt, seed, rank, first + j));
    return h;
}

/* Sums exact in bf16 (see input_value); fp32 differs from a double sum by rounding only. A
 * buffer NCCL never wrote holds the 0xff fill, a NaN, and fails. */
static bool close_enough(pshard_dtype_t dt, double got, double want, int world)
{
    double scale = fabs(want) > 1.0 ? fabs(want) : 1.0;
    double tol = dt == PSHARD_FP32 ? 1e-5 * world * scale : scale / 64.0;
    return fabs(got - want) <= tol;
}

/* Equal counts (count each), or per-rank counts with the last rank empty when world > 1. */
static size_t make_counts(int world, bool per_rank, size_t count, size_t *counts, size_t *displs)
{
    size_t total = 0;
    for (int r = 0; r < world; r++) {
        counts[r] = per_rank ? (world > 1 && r == world - 1 ? 0 : 1000 + 37 * (size_t)r) : count;
        displs[r] = total;
        total += counts[r];
    }
    displs[world] = total;
    return total;
}

/* ---------------------------------------------------------------------------------------- */
/* Device helpers                                                                            */

/* The test's buffers: device memory, or host memory (pageable or pinned) when the
 * communicator runs in host_buffers mode; the same checks run on either. */
static void *dev_alloc(rank_ctx_t *c, size_t bytes)
{
    if (!bytes)
        bytes = 16;
    if (c->host) {
        void *h = malloc(bytes);
        EXPECT(c, h != NULL, "malloc(%zu)", bytes);
        if (h && c->pinned) {
            char err[256] = "";
            pshard_status_t st = pshard_host_pin(c->rank, h, bytes, err, sizeof(err));
            EXPECT(c, st == PSHARD_OK, "pshard_host_pin(%zu): %s", bytes, err);
        }
        return h;
    }
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    EXPECT(c, e == cudaSuccess, "cudaMalloc(%zu): %s", bytes, cudaGetErrorString(e));
    return e == cudaSuccess ? p : NULL;
}

static void buf_free(rank_ctx_t *c, void *p)
{
    if (!p)
        return;
    if (c->host) {
        if (c->pinned)
            pshard_host_unpin(c->rank, p);
        free(p);
        return;
    }
    cudaFree(p);
}

/* Fills with 0xff bytes (NaN in fp32 and bf16): whatever NCCL leaves unwritten fails. */
static void dev_poison(rank_ctx_t *c, void *d, size_t bytes)
{
    if (c->host) {
        memset(d, 0xff, bytes);
        return;
    }
    cudaError_t e = cudaMemset(d, 0xff, bytes);
    EXPECT(c, e == cudaSuccess, "cudaMemset: %s", cudaGetErrorString(e));
}

static void to_dev(rank_ctx_t *c, void *d, const void *h, size_t bytes)
{
    if (c->host) {
        memcpy(d, h, bytes);
        return;
    }
    cudaError_t e = cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    EXPECT(c, e == cudaSuccess, "cudaMemcpy to device: %s", cudaGetErrorString(e));
}

static void *from_dev(rank_ctx_t *c, const void *d, size_t bytes)
{
    void *h = malloc(bytes + 1);
    if (c->host) {
        memcpy(h, d, bytes);
        return h;
    }
    cudaError_t e = cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost);
    EXPECT(c, e == cudaSuccess, "cudaMemcpy from device: %s", cudaGetErrorString(e));
    return h;
}

/* The backend's contract: inputs are complete on the device before the collective starts. */
static void dev_sync(rank_ctx_t *c)
{
    if (c->host)
        return;
    cudaError_t e = cudaDeviceSynchronize();
    EXPECT(c, e == cudaSuccess, "cudaDeviceSynchronize: %s", cudaGetErrorString(e));
}

static pshard_comm_t *make_comm(rank_ctx_t *c, const char *name, int device)
{
    pshard_comm_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.rank = c->rank;
    cfg.world_size = c->world;
    cfg.backend = "nccl";
    cfg.name = name;
    cfg.peers = c->peers;
    cfg.token = TOKEN;
    cfg.generation = 7;
    cfg.timeout_ms = 60000;
    cfg.connect_timeout_ms = 60000;
    cfg.device = device;
    cfg.host_buffers = c->host;
    pshard_comm_t *comm = NULL;
    char err[1024] = "";
    pshard_status_t st = pshard_comm_create(&cfg, &comm, err, sizeof(err));
    EXPECT(c, st == PSHARD_OK && comm, "pshard_comm_create(%s, nccl, device %d): %s: %s", name,
           device, pshard_status_name(st), err);
    return st == PSHARD_OK ? comm : NULL;
}

static const char *dt_name(pshard_dtype_t dt)
{
    return pshard_dtype_name(dt);
}

/* ---------------------------------------------------------------------------------------- */
/* Checks of one collective each (every rank runs the same sequence)                          */

static void check_all_gather(rank_ctx_t *c, pshard_comm_t *comm, pshard_dtype_t dt, bool per_rank,
                             bool in_place)
{
    unsigned seed = ++c->seed;
    int n = c->world, me = c->rank;
    size_t counts[MAX_WORLD], displs[MAX_WORLD + 1];
    size_t total = make_counts(n, per_rank, 4099, counts, displs);
    size_t es = pshard_dtype_size(dt);
    void *h_send = host_input(dt, seed, me, 0, counts[me]);
    char *d_recv = dev_alloc(c, total * es);
    char *d_own = in_place ? NULL : dev_alloc(c, counts[me] * es);
    if (!d_recv || (!in_place && !d_own))
        goto out;
    dev_poison(c, d_recv, total * es);
    char *d_send = in_place ? d_recv + displs[me] * es : d_own;
    to_dev(c, d_send, h_send, counts[me] * es);
    dev_sync(c);
    pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_GATHER,
                            .dtype = dt,
                            .send = d_send,
                            .recv = d_recv,
                            .count = counts[0],
                            .counts = per_rank ? counts : NULL,
                            .tag = seed,
                            .label = "test all_gather"};
    char err[1024] = "";
    pshard_status_t st = pshard_coll_run(comm, &a, err, sizeof(err));
    EXPECT(c, st == PSHARD_OK, "all_gather %s%s%s: %s: %s", dt_name(dt),
           per_rank ? " per-rank" : "", in_place ? " in place" : "", pshard_status_name(st), err);
    void *h_recv = from_dev(c, d_recv, total * es);
    int bad = 0;
    for (int r = 0; r < n; r++) {
        for (size_t j = 0; j < counts[r] && bad < 5; j++) {
            float got = get_value(dt, h_recv, displs[r] + j);
            float want = input_value(dt, seed, r, j);
            if (!(got == want)) {
                bad++;
                EXPECT(c, false, "all_gather %s%s%s: block %d element %zu is %g, want %g",
                       dt_name(dt), per_rank ? " per-rank" : "", in_place ? " in place" : "", r, j,
                       (double)got, (double)want);
            }
        }
    }
    free(h_recv);
out:
    free(h_send);
    buf_free(c, d_recv);
    buf_free(c, d_own);
}

static void check_reduce_scatter(rank_ctx_t *c, pshard_comm_t *comm, pshard_dtype_t dt,
                                 pshard_reduce_t reduce, bool per_rank)
{
    unsigned seed = ++c->seed;
    int n = c->world, me = c->rank;
    size_t counts[MAX_WORLD], displs[MAX_WORLD + 1];
    size_t total = make_counts(n, per_rank, 3001, counts, displs);
    size_t es = pshard_dtype_size(dt);
    const char *rname = reduce == PSHARD_REDUCE_AVG ? "avg" : "sum";
    void *h_send = host_input(dt, seed, me, 0, total);
    char *d_send = dev_alloc(c, total * es);
    char *d_recv = dev_alloc(c, counts[me] * es);
    if (!d_send || !d_recv)
        goto out;
    to_dev(c, d_send, h_send, total * es);
    dev_poison(c, d_recv, counts[me] * es);
    dev_sync(c);
    pshard_coll_args_t a = {.op = PSHARD_COLL_REDUCE_SCATTER,
                            .dtype = dt,
                            .reduce = reduce,
                            .send = d_send,
                            .recv = counts[me] ? d_recv : NULL,
                            .count = counts[0],
                            .counts = per_rank ? counts : NULL,
                            .tag = seed,
                            .label = "test reduce_scatter"};
    char err[1024] = "";
    pshard_status_t st = pshard_coll_run(comm, &a, err, sizeof(err));
    EXPECT(c, st == PSHARD_OK, "reduce_scatter %s %s%s: %s: %s", dt_name(dt), rname,
           per_rank ? " per-rank" : "", pshard_status_name(st), err);
    void *h_recv = from_dev(c, d_recv, counts[me] * es);
    int bad = 0;
    for (size_t i = 0; i < counts[me] && bad < 5; i++) {
        double want = 0;
        for (int r = 0; r < n; r++)
            want += input_value(dt, seed, r, displs[me] + i);
        if (reduce == PSHARD_REDUCE_AVG)
            want /= n;
        double got = get_value(dt, h_recv, i);
        if (!close_enough(dt, got, want, n)) {
            bad++;
            EXPECT(c, false, "reduce_scatter %s %s%s: element %zu is %g, want %g", dt_name(dt),
                   rname, per_rank ? " per-rank" : "", i, got, want);
        }
    }
    free(h_recv);
out:
    free(h_send);
    buf_free(c, d_send);
    buf_free(c, d_recv);
}

static void check_all_reduce(rank_ctx_t *c, pshard_comm_t *comm, pshard_dtype_t dt,
                             pshard_reduce_t reduce, bool in_place, size_t count)
{
    unsigned seed = ++c->seed;
    int n = c->world, me = c->rank;
    size_t es = pshard_dtype_size(dt);
    const char *rname = reduce == PSHARD_REDUCE_AVG ? "avg" : "sum";
    void *h_send = host_input(dt, seed, me, 0, count);
    char *d_recv = dev_alloc(c, count * es);
    char *d_own = in_place ? NULL : dev_alloc(c, count * es);
    if (!d_recv || (!in_place && !d_own))
        goto out;
    char *d_send = in_place ? d_recv : d_own;
    if (!in_place)
        dev_poison(c, d_recv, count * es);
    to_dev(c, d_send, h_send, count * es);
    dev_sync(c);
    pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_REDUCE,
                            .dtype = dt,
                            .reduce = reduce,
                            .send = d_send,
                            .recv = d_recv,
                            .count = count,
                            .tag = seed,
                            .label = "test all_reduce"};
    char err[1024] = "";
    pshard_status_t st = pshard_coll_run(comm, &a, err, sizeof(err));
    EXPECT(c, st == PSHARD_OK, "all_reduce %s %s%s: %s: %s", dt_name(dt), rname,
           in_place ? " in place" : "", pshard_status_name(st), err);
    void *h_recv = from_dev(c, d_recv, count * es);
    int bad = 0;
    for (size_t i = 0; i < count && bad < 5; i++) {
        double want = 0;
        for (int r = 0; r < n; r++)
            want += input_value(dt, seed, r, i);
        if (reduce == PSHARD_REDUCE_AVG)
            want /= n;
        double got = get_value(dt, h_recv, i);
        if (!close_enough(dt, got, want, n)) {
            bad++;
            EXPECT(c, false, "all_reduce %s %s%s: element %zu is %g, want %g", dt_name(dt), rname,
                   in_place ? " in place" : "", i, got, want);
        }
    }
    free(h_recv);
out:
    free(h_send);
    buf_free(c, d_recv);
    buf_free(c, d_own);
}

static void check_broadcast(rank_ctx_t *c, pshard_comm_t *comm, pshard_dtype_t dt, int root)
{
    unsigned seed = ++c->seed;
    int me = c->rank;
    size_t count = 5003, es = pshard_dtype_size(dt);
    void *h_send = host_input(dt, seed, root, 0, count);
    char *d_recv = dev_alloc(c, count * es);
    char *d_send = me == root ? dev_alloc(c, count * es) : NULL;
    if (!d_recv || (me == root && !d_send))
        goto out;
    dev_poison(c, d_recv, count * es);
    if (me == root)
        to_dev(c, d_send, h_send, count * es);
    dev_sync(c);
    pshard_coll_args_t a = {.op = PSHARD_COLL_BROADCAST,
                            .dtype = dt,
                            .root = root,
                            .send = d_send,
                            .recv = d_recv,
                            .count = count,
                            .tag = seed,
                            .label = "test broadcast"};
    char err[1024] = "";
    pshard_status_t st = pshard_coll_run(comm, &a, err, sizeof(err));
    EXPECT(c, st == PSHARD_OK, "broadcast %s from %d: %s: %s", dt_name(dt), root,
           pshard_status_name(st), err);
    void *h_recv = from_dev(c, d_recv, count * es);
    int bad = 0;
    for (size_t i = 0; i < count && bad < 5; i++) {
        float got = get_value(dt, h_recv, i), want = get_value(dt, h_send, i);
        if (!(got == want)) {
            bad++;
            EXPECT(c, false, "broadcast %s from %d: element %zu is %g, want %g", dt_name(dt), root,
                   i, (double)got, (double)want);
        }
    }
    free(h_recv);
out:
    free(h_send);
    buf_free(c, d_recv);
    buf_free(c, d_send);
}

static void check_barrier_and_empty(rank_ctx_t *c, pshard_comm_t *comm)
{
    char err[1024] = "";
    pshard_coll_args_t b = {.op = PSHARD_COLL_BARRIER, .tag = ++c->seed, .label = "test barrier"};
    pshard_status_t st = pshard_coll_run(comm, &b, err, sizeof(err));
    EXPECT(c, st == PSHARD_OK, "barrier: %s: %s", pshard_status_name(st), err);
    /* Nothing to move: no buffers, and no NCCL call on any rank. */
    pshard_coll_args_t z = {
        .op = PSHARD_COLL_ALL_REDUCE, .dtype = PSHARD_FP32, .count = 0, .tag = ++c->seed};
    st = pshard_coll_run(comm, &z, err, sizeof(err));
    EXPECT(c, st == PSHARD_OK, "empty all_reduce: %s: %s", pshard_status_name(st), err);
    st = pshard_coll_run(comm, &b, err, sizeof(err));
    EXPECT(c, st == PSHARD_OK, "second barrier: %s: %s", pshard_status_name(st), err);

    pshard_coll_record_t recs[4];
    size_t nrec = pshard_comm_flight_records(comm, recs, 4);
    EXPECT(c, nrec == 4, "flight recorder holds %zu records, want 4", nrec);
    if (nrec > 0) {
        const pshard_coll_record_t *last = &recs[nrec - 1];
        char line[256];
        pshard_coll_record_format(comm, last, line, sizeof(line));
        EXPECT(c, last->op == PSHARD_COLL_BARRIER && last->state == PSHARD_COLL_DONE,
               "last flight record: %s", line);
    }
    EXPECT(c, pshard_comm_error(comm, err, sizeof(err)) == PSHARD_OK, "the communicator failed: %s",
           err);
}

/* Every collective in both dtypes, equal and per-rank counts, in place and not. */
static void run_all(rank_ctx_t *c, pshard_comm_t *comm)
{
    static const pshard_dtype_t dtypes[] = {PSHARD_FP32, PSHARD_BF16};
    for (size_t k = 0; k < PS_ARRAY_LEN(dtypes); k++) {
        pshard_dtype_t dt = dtypes[k];
        check_all_gather(c, comm, dt, false, false);
        check_all_gather(c, comm, dt, false, true);
        check_all_gather(c, comm, dt, true, false);
        check_all_gather(c, comm, dt, true, true);
        check_reduce_scatter(c, comm, dt, PSHARD_REDUCE_SUM, false);
        check_reduce_scatter(c, comm, dt, PSHARD_REDUCE_AVG, false);
        check_reduce_scatter(c, comm, dt, PSHARD_REDUCE_SUM, true);
        check_reduce_scatter(c, comm, dt, PSHARD_REDUCE_AVG, true);
        check_all_reduce(c, comm, dt, PSHARD_REDUCE_SUM, false, 4097);
        check_all_reduce(c, comm, dt, PSHARD_REDUCE_AVG, false, 4097);
        check_all_reduce(c, comm, dt, PSHARD_REDUCE_SUM, true, 3000017);
        check_all_reduce(c, comm, dt, PSHARD_REDUCE_AVG, true, 1021);
        for (int root = 0; root < c->world; root++)
            check_broadcast(c, comm, dt, root);
    }
    check_barrier_and_empty(c, comm);
}

/* ---------------------------------------------------------------------------------------- */
/* One rank on GPU 0                                                                          */

static const char *const one_peer[] = {"127.0.0.1:0"};

static void test_world1_collectives(void)
{
    rank_ctx_t c = {.rank = 0, .world = 1, .peers = one_peer};
    pshard_comm_t *comm = make_comm(&c, "gpu-w1", 0);
    if (comm) {
        CU_ASSERT_EQUAL(pshard_comm_rank(comm), 0);
        CU_ASSERT_EQUAL(pshard_comm_world_size(comm), 1);
        run_all(&c, comm);
    }
    pshard_comm_destroy(comm);
    CU_ASSERT_EQUAL(c.failures, 0);
}

static void test_world1_grouped_path(void)
{
    setenv("PSHARD_NCCL_FORCE_GROUPED", "1", 1);
    rank_ctx_t c = {.rank = 0, .world = 1, .peers = one_peer, .seed = 1000};
    pshard_comm_t *comm = make_comm(&c, "gpu-w1-grouped", 0);
    unsetenv("PSHARD_NCCL_FORCE_GROUPED");
    if (comm)
        run_all(&c, comm);
    pshard_comm_destroy(comm);
    CU_ASSERT_EQUAL(c.failures, 0);
}

/* reduce, gather, scatter and all_to_all (composed of all_reduce, all_gather and broadcast
 * into a temporary host buffer) on a host_buffers communicator of one rank: each gives back
 * the input; on device buffers they are a clear INVALID_ARGUMENT. */
static void check_rooted_host(rank_ctx_t *c, pshard_comm_t *comm)
{
    enum { N = 37 };
    float in[N], out[N];
    for (int i = 0; i < N; i++)
        in[i] = (float)(i * 3 + 1);
    const pshard_coll_op_t ops[] = {PSHARD_COLL_REDUCE, PSHARD_COLL_GATHER, PSHARD_COLL_SCATTER,
                                    PSHARD_COLL_ALL_TO_ALL};
    for (size_t k = 0; k < PS_ARRAY_LEN(ops); k++) {
        memset(out, 0xff, sizeof(out));
        pshard_coll_args_t a = {.op = ops[k],
                                .dtype = PSHARD_FP32,
                                .reduce = PSHARD_REDUCE_MAX,
                                .send = in,
                                .recv = out,
                                .count = N};
        char err[256] = "";
        pshard_status_t st = pshard_coll_run(comm, &a, err, sizeof(err));
        EXPECT(c, st == PSHARD_OK && memcmp(in, out, sizeof(in)) == 0, "%s on host buffers: %s",
               pshard_coll_op_name(ops[k]), err);
        a.send_device = true;
        err[0] = '\0';
        st = pshard_coll_run(comm, &a, err, sizeof(err));
        EXPECT(c, st == PSHARD_ERR_INVALID_ARGUMENT && strstr(err, "device buffers"),
               "%s on device buffers: %s", pshard_coll_op_name(ops[k]), err);
    }
}

/* host_buffers: the same checks on host memory, which the backend stages through device
 * buffers of its own; pageable and pinned. */
static void test_world1_host_buffers(void)
{
    for (int pinned = 0; pinned < 2; pinned++) {
        rank_ctx_t c = {.rank = 0,
                        .world = 1,
                        .peers = one_peer,
                        .seed = 4000u + 500u * pinned,
                        .host = true,
                        .pinned = pinned};
        pshard_comm_t *comm = make_comm(&c, pinned ? "gpu-w1-pinned" : "gpu-w1-host", 0);
        if (comm) {
            run_all(&c, comm);
            check_rooted_host(&c, comm);
        }
        pshard_comm_destroy(comm);
        CU_ASSERT_EQUAL(c.failures, 0);
    }
}

static void test_world1_abort(void)
{
    rank_ctx_t c = {.rank = 0, .world = 1, .peers = one_peer, .seed = 2000};
    pshard_comm_t *comm = make_comm(&c, "gpu-w1-abort", 0);
    if (!comm) {
        CU_FAIL("no communicator");
        return;
    }
    check_all_reduce(&c, comm, PSHARD_FP32, PSHARD_REDUCE_SUM, false, 1024);
    CU_ASSERT_EQUAL(c.failures, 0);

    /* A large operation, aborted while queued or running: it ends well or ABORTED, promptly. */
    size_t count = (size_t)1 << 26;
    float *d_buf = dev_alloc(&c, count * sizeof(float));
    if (d_buf) {
        dev_poison(&c, d_buf, count * sizeof(float));
        dev_sync(&c);
        pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_REDUCE,
                                .dtype = PSHARD_FP32,
                                .send = d_buf,
                                .recv = d_buf,
                                .count = count,
                                .tag = 1};
        pshard_coll_req_t *req = NULL;
        char err[1024] = "";
        CU_ASSERT_EQUAL_FATAL(pshard_coll_start(comm, &a, &req, err, sizeof(err)), PSHARD_OK);
        int64_t t0 = ps_now_ns();
        pshard_comm_abort(comm, "test abort");
        pshard_status_t st = pshard_coll_wait(req, err, sizeof(err));
        double waited_s = (double)(ps_now_ns() - t0) / 1e9;
        pshard_coll_req_free(req);
        CU_ASSERT(st == PSHARD_OK || st == PSHARD_ERR_ABORTED);
        CU_ASSERT(waited_s < 5.0);
        printf("  aborted operation ended with %s after %.3f s\n", pshard_status_name(st),
               waited_s);
    }
    buf_free(&c, d_buf);

    /* Everything after the abort fails with the first error, naming the reason. */
    char err[1024] = "";
    pshard_coll_args_t b = {.op = PSHARD_COLL_BARRIER};
    pshard_status_t st = pshard_coll_run(comm, &b, err, sizeof(err));
    CU_ASSERT_EQUAL(st, PSHARD_ERR_ABORTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "test abort"));
    err[0] = '\0';
    CU_ASSERT_EQUAL(pshard_comm_error(comm, err, sizeof(err)), PSHARD_ERR_ABORTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "test abort"));
    pshard_comm_destroy(comm);
    CU_ASSERT_EQUAL(c.failures, 0);
}

static void test_bad_device(void)
{
    pshard_comm_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.world_size = 1;
    cfg.backend = "nccl";
    cfg.name = "gpu-bad-device";
    cfg.peers = one_peer;
    cfg.device = g_devices; /* one past the last */
    pshard_comm_t *comm = NULL;
    char err[1024] = "";
    pshard_status_t st = pshard_comm_create(&cfg, &comm, err, sizeof(err));
    CU_ASSERT_EQUAL(st, PSHARD_ERR_CUDA);
    CU_ASSERT_PTR_NULL(comm);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "cudaSetDevice"));
    cfg.device = -1;
    err[0] = '\0';
    st = pshard_comm_create(&cfg, &comm, err, sizeof(err));
    CU_ASSERT_EQUAL(st, PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NULL(comm);
}

/* ---------------------------------------------------------------------------------------- */
/* One rank per GPU (two or more GPUs)                                                        */

typedef struct {
    rank_ctx_t ctx;
    const char *scenario;
    const char *name;
} rank_thread_t;

static void *rank_main(void *arg)
{
    rank_thread_t *t = arg;
    rank_ctx_t *c = &t->ctx;
    cudaSetDevice(c->rank);
    pshard_comm_t *comm = make_comm(c, t->name, c->rank);
    if (!comm)
        return NULL;
    if (strcmp(t->scenario, "all") == 0 || strcmp(t->scenario, "all-host") == 0) {
        run_all(c, comm);
    } else {
        /* desync: rank 0 reduces one element fewer than the others. */
        size_t count = c->rank == 0 ? 100 : 101;
        float *d = dev_alloc(c, 101 * sizeof(float));
        pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_REDUCE,
                                .dtype = PSHARD_FP32,
                                .send = d,
                                .recv = d,
                                .count = count,
                                .tag = 5,
                                .timeout_ms = 30000,
                                .label = "desync test"};
        char err[1024] = "";
        int64_t t0 = ps_now_ns();
        pshard_status_t st = pshard_coll_run(comm, &a, err, sizeof(err));
        EXPECT(c, st == PSHARD_ERR_DESYNC, "desync: got %s (%s), want PSHARD_ERR_DESYNC",
               pshard_status_name(st), err);
        EXPECT(c, ps_now_ns() - t0 < 20000000000LL, "desync took %.1f s",
               (double)(ps_now_ns() - t0) / 1e9);
        EXPECT(c, pshard_comm_error(comm, err, sizeof(err)) == PSHARD_ERR_DESYNC,
               "the desync is not sticky");
        buf_free(c, d);
    }
    pshard_comm_destroy(comm);
    return NULL;
}

/* A loopback port free right now (the tcp control path listens on it). */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(sa);
    int port = -1;
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
        getsockname(fd, (struct sockaddr *)&sa, &len) == 0)
        port = ntohs(sa.sin_port);
    close(fd);
    return port;
}

static void run_multi(const char *scenario, const char *name)
{
    int world = g_devices < MAX_WORLD ? g_devices : MAX_WORLD;
    char addr[MAX_WORLD][32];
    const char *peers[MAX_WORLD];
    for (int r = 0; r < world; r++) {
        int port = free_port();
        CU_ASSERT_FATAL(port > 0);
        snprintf(addr[r], sizeof(addr[r]), "127.0.0.1:%d", port);
        peers[r] = addr[r];
    }
    rank_thread_t threads[MAX_WORLD];
    pthread_t tids[MAX_WORLD];
    for (int r = 0; r < world; r++) {
        threads[r] = (rank_thread_t){
            .ctx = {.rank = r,
                    .world = world,
                    .peers = peers,
                    .seed = 3000,
                    .host = strcmp(scenario, "all-host") == 0},
            .scenario = scenario,
            .name = name,
        };
        CU_ASSERT_EQUAL_FATAL(pthread_create(&tids[r], NULL, rank_main, &threads[r]), 0);
    }
    int failures = 0;
    for (int r = 0; r < world; r++) {
        pthread_join(tids[r], NULL);
        failures += threads[r].ctx.failures;
    }
    CU_ASSERT_EQUAL(failures, 0);
}

static void test_multi_gpu_collectives(void)
{
    if (g_devices < 2) {
        printf("  (one GPU: the one-rank-per-GPU checks are skipped) ");
        return;
    }
    run_multi("all", "gpu-multi");
    run_multi("all-host", "gpu-multi-host");
}

static void test_multi_gpu_desync(void)
{
    if (g_devices < 2) {
        printf("  (one GPU: the desync check is skipped) ");
        return;
    }
    run_multi("desync", "gpu-desync");
}

int main(void)
{
    cudaError_t e = cudaGetDeviceCount(&g_devices);
    if (e != cudaSuccess || g_devices < 1) {
        printf("no CUDA device: skipping NCCL test (%s)\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found 0 devices");
        return 77;
    }
    printf("%d CUDA device(s)\n", g_devices);
    static const ps_test_case_t cases[] = {
        {"world1_collectives", test_world1_collectives},
        {"world1_grouped_path", test_world1_grouped_path},
        {"world1_host_buffers", test_world1_host_buffers},
        {"world1_abort", test_world1_abort},
        {"bad_device", test_bad_device},
        {"multi_gpu_collectives", test_multi_gpu_collectives},
        {"multi_gpu_desync", test_multi_gpu_desync},
        {NULL, NULL},
    };
    return ps_test_main("gpu_nccl", cases);
}
