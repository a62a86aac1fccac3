/* The operations of GPU-resident shards (shard_server/src/shard_cuda.h) against the CPU code
 * they mirror, bit for bit: conversions to bf16/fp16 (NaN, Inf, subnormals, ties included),
 * gradient accumulation from fp32 and bf16 with and without scaling, scaling, zeroing, the
 * optimizers over several steps (SGD plain/momentum/nesterov, Adam, AdamW with weight decay)
 * the squared norm (to 1e-12 relative: the summation order may differ) and the largest
 * magnitude (clip_grad_norm's inf norm: exactly ps_max_abs, NaN propagating).
 * usage: unit_shard_dev emulated|cuda. "emulated" (a unit test) checks the host emulation,
 * which runs the kernels' element functions; "cuda" (the gpu test gpu_kernels) checks the CUDA
 * kernels on device 0 and exits 77 (skipped) without a CUDA device or without nvcc's kernels. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/optim.h"
#include "optim_elem.h"
#include "ps_test.h"
#include "pshard/collectives.h"
#include "pshard/dtype.h"
#include "shard_cuda.h"

#define N 100003 /* not a multiple of the block size */

static uint64_t rng = 88172645463325252ull;
static const shard_dev_ops_t *D; /* the implementation under test */

static uint32_t next_u32(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

/* Random floats: mostly ordinary values, some specials and fp16/bf16 ties and subnormals. */
static float any_float(void)
{
    uint32_t k = next_u32() % 16;
    uint32_t bits = next_u32();
    float f;
    if (k == 0) {
        memcpy(&f, &bits, sizeof(f)); /* any bit pattern: NaNs, Infs, subnormals */
        return f;
    }
    if (k == 1)
        bits = (bits & 0xffff0000u) | 0x8000u; /* a bf16 tie */
    else
        return ((float)(int32_t)(bits % 2000001u) - 1000000.0f) * 1e-5f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static float plain_float(double lo, double hi)
{
    double u = (double)next_u32() / 4294967296.0;
    double v = lo + (hi - lo) * u;
    return (float)(next_u32() & 1 ? v : -v);
}

static void *dev_copy_of(const void *h, size_t bytes)
{
    void *d = NULL;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(D->alloc(0, bytes, &d, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL_FATAL(D->copy(0, d, h, bytes, err, sizeof(err)), PSHARD_OK);
    return d;
}

static void to_host(void *h, const void *d, size_t bytes)
{
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(D->copy(0, h, d, bytes, err, sizeof(err)), PSHARD_OK);
}

static size_t count_diff(const void *a, const void *b, size_t n, size_t es)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += memcmp((const char *)a + i * es, (const char *)b + i * es, es) != 0;
    return bad;
}

static void test_convert(void)
{
    static float x[N];
    static uint16_t want[N], got[N];
    for (size_t i = 0; i < N; i++)
        x[i] = any_float();
    void *dx = dev_copy_of(x, sizeof(x));
    void *dy = NULL;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(D->alloc(0, sizeof(got), &dy, err, sizeof(err)), PSHARD_OK);
    for (int k = 0; k < 2; k++) {
        pshard_dtype_t dt = k == 0 ? PSHARD_BF16 : PSHARD_FP16;
        if (dt == PSHARD_BF16)
            ps_convert_f32_to_bf16(x, want, N);
        else
            ps_convert_f32_to_f16(x, want, N);
        CU_ASSERT_EQUAL(D->convert(0, dx, dy, dt, N, err, sizeof(err)), PSHARD_OK);
        to_host(got, dy, sizeof(got));
        size_t bad = count_diff(want, got, N, 2);
        if (bad)
            fprintf(stderr, "%s: %zu of %d elements differ from the CPU\n", pshard_dtype_name(dt),
                    bad, N);
        CU_ASSERT_EQUAL(bad, 0);
    }
    D->free_mem(0, dx);
    D->free_mem(0, dy);
}

static void test_accumulate_scale_zero(void)
{
    static float acc[N], want[N], got[N], r[N];
    static uint16_t r16[N];
    for (size_t i = 0; i < N; i++) {
        acc[i] = plain_float(0.0, 3.0);
        r[i] = plain_float(0.0, 3.0);
    }
    ps_convert_f32_to_bf16(r, r16, N);
    char err[256] = "";
    for (int k = 0; k < 3; k++) {
        pshard_dtype_t dt = k == 2 ? PSHARD_BF16 : PSHARD_FP32;
        bool scaled = k != 0;
        float scale = 1.0f / 3.0f;
        for (size_t i = 0; i < N; i++) {
            float v = dt == PSHARD_BF16 ? ps_bf16_to_f32(r16[i]) : r[i];
            want[i] = acc[i] + (scaled ? v * scale : v);
        }
        float *da = dev_copy_of(acc, sizeof(acc));
        void *dr = dt == PSHARD_BF16 ? dev_copy_of(r16, sizeof(r16)) : dev_copy_of(r, sizeof(r));
        CU_ASSERT_EQUAL(D->accumulate(0, da, dr, dt, N, scaled, scale, err, sizeof(err)),
                        PSHARD_OK);
        to_host(got, da, sizeof(got));
        CU_ASSERT_EQUAL(count_diff(want, got, N, 4), 0);
        double sq = 0, want_sq = 0;
        for (size_t i = 0; i < N; i++) {
            float v = dt == PSHARD_BF16 ? ps_bf16_to_f32(r16[i]) : r[i];
            v = scaled ? v * scale : v;
            want_sq += (double)v * v;
        }
        CU_ASSERT_EQUAL(D->sum_squares(0, dr, dt, N, scaled, scale, &sq, err, sizeof(err)),
                        PSHARD_OK);
        CU_ASSERT(fabs(sq - want_sq) <= 1e-12 * want_sq);
        if (k == 0) {
            memcpy(want, got, sizeof(want));
            ps_scale(want, N, 0.37f);
            CU_ASSERT_EQUAL(D->scale(0, da, N, 0.37f, err, sizeof(err)), PSHARD_OK);
            to_host(got, da, sizeof(got));
            CU_ASSERT_EQUAL(count_diff(want, got, N, 4), 0);
            CU_ASSERT_EQUAL(D->zero(0, da, N, err, sizeof(err)), PSHARD_OK);
            to_host(got, da, sizeof(got));
            size_t nonzero = 0;
            for (size_t i = 0; i < N; i++)
                nonzero += got[i] != 0.0f;
            CU_ASSERT_EQUAL(nonzero, 0);
        }
        D->free_mem(0, da);
        D->free_mem(0, dr);
    }
}

/* The inf norm's largest |x|: equal to ps_max_abs on ordinary values, on values with an
 * infinity, with a NaN (which wins, as in torch), and 0 for no elements. */
static void test_max_abs(void)
{
    static float x[N];
    for (size_t i = 0; i < N; i++)
        x[i] = plain_float(0.0, 3.0);
    x[N / 3] = -7.5f; /* the largest magnitude is a negative value */
    char err[256] = "";
    for (int k = 0; k < 3; k++) {
        if (k == 1)
            x[N - 1] = -INFINITY;
        if (k == 2)
            x[17] = NAN;
        float want = ps_max_abs(x, N), got = -1.0f;
        float *dx = dev_copy_of(x, sizeof(x));
        CU_ASSERT_EQUAL(D->max_abs(0, dx, N, &got, err, sizeof(err)), PSHARD_OK);
        CU_ASSERT(memcmp(&want, &got, sizeof(got)) == 0);
        CU_ASSERT(k == 0 ? want == 7.5f : k == 1 ? isinf(want) : isnan(want));
        CU_ASSERT_EQUAL(D->max_abs(0, dx, 0, &got, err, sizeof(err)), PSHARD_OK);
        CU_ASSERT(got == 0.0f);
        D->free_mem(0, dx);
    }
}

/* Five steps of cfg on the CPU (ps_optim_step) and on the GPU; every array equal. */
static void optim_case(const ps_optim_config_t *cfg, const char *what)
{
    static float p[N], g[N], s0[N], s1[N], gp[N], gs0[N], gs1[N];
    for (size_t i = 0; i < N; i++) {
        p[i] = plain_float(0.1, 2.0);
        s0[i] = s1[i] = 0.0f;
    }
    float *dp = dev_copy_of(p, sizeof(p));
    float *ds0 = dev_copy_of(s0, sizeof(s0));
    float *ds1 = dev_copy_of(s1, sizeof(s1));
    int nstate = ps_optim_state_count(cfg);
    char err[256] = "";
    for (int64_t step = 1; step <= 5; step++) {
        for (size_t i = 0; i < N; i++)
            g[i] = plain_float(0.01, 1.0);
        double lr = cfg->lr * (1.0 - 0.1 * (double)step);
        ps_optim_step(cfg, lr, step, p, g, nstate > 0 ? s0 : NULL, nstate > 1 ? s1 : NULL, N);
        void *dg = dev_copy_of(g, sizeof(g));
        ps_optim_scalars_t sc;
        ps_optim_step_scalars(cfg, lr, step, &sc);
        CU_ASSERT_EQUAL(D->optim_step(0, &sc, dp, dg, PSHARD_FP32, false, 1.0f,
                                      nstate > 0 ? ds0 : NULL, nstate > 1 ? ds1 : NULL, N, err,
                                      sizeof(err)),
                        PSHARD_OK);
        D->free_mem(0, dg);
    }
    to_host(gp, dp, sizeof(gp));
    to_host(gs0, ds0, sizeof(gs0));
    to_host(gs1, ds1, sizeof(gs1));
    size_t bad = count_diff(p, gp, N, 4) + (nstate > 0 ? count_diff(s0, gs0, N, 4) : 0) +
                 (nstate > 1 ? count_diff(s1, gs1, N, 4) : 0);
    if (bad)
        fprintf(stderr, "%s: %zu values differ from the CPU\n", what, bad);
    CU_ASSERT_EQUAL(bad, 0);
    D->free_mem(0, dp);
    D->free_mem(0, ds0);
    D->free_mem(0, ds1);
}

static void test_optimizers(void)
{
    ps_optim_config_t cfg;
    ps_optim_defaults(PS_OPTIM_SGD, &cfg);
    cfg.lr = 0.05;
    optim_case(&cfg, "sgd");
    cfg.momentum = 0.9;
    cfg.dampening = 0.1;
    cfg.weight_decay = 0.01;
    optim_case(&cfg, "sgd momentum");
    cfg.dampening = 0;
    cfg.nesterov = true;
    optim_case(&cfg, "sgd nesterov");
    ps_optim_defaults(PS_OPTIM_ADAM, &cfg);
    cfg.lr = 0.01;
    cfg.weight_decay = 0.1;
    optim_case(&cfg, "adam");
    ps_optim_defaults(PS_OPTIM_ADAMW, &cfg);
    cfg.lr = 0.01;
    optim_case(&cfg, "adamw");
}

int main(int argc, char **argv)
{
    bool cuda = argc > 1 && strcmp(argv[1], "cuda") == 0;
    if (!cuda && !(argc > 1 && strcmp(argv[1], "emulated") == 0)) {
        fprintf(stderr, "usage: %s emulated|cuda\n", argv[0]);
        return 2;
    }
    char err[PSHARD_ERRLEN] = "";
    D = cuda ? shard_dev_cuda(err, sizeof(err)) : &shard_dev_emulated;
    if (cuda && (!D || pshard_cuda_check_device(0, err, sizeof(err)) != PSHARD_OK)) {
        printf("no CUDA device or no kernels: skipping the shard kernels test (%s)\n", err);
        return 77;
    }
    static const ps_test_case_t cases[] = {
        {"convert", test_convert},
        {"accumulate_scale_zero", test_accumulate_scale_zero},
        {"optimizers", test_optimizers},
        {"max_abs", test_max_abs},
        {NULL, NULL},
    };
    return ps_test_main(cuda ? "gpu_kernels" : "shard_dev_emulated", cases);
}
