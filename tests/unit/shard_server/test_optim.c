/* Unit tests for the shard server's optimizers (shard_server/src/optim.h): 20-step trajectories
 * of SGD (plain, weight decay, momentum, dampening, nesterov), Adam (with and without L2 weight
 * decay, both lerp forms) and AdamW compared against an independent double-precision
 * implementation of torch.optim's formulas, the first-step momentum initialisation, defaults,
 * validation messages, state counts, ps_sum_squares, ps_scale and ps_max_abs.
 * With `--dump` the program instead prints its trajectories for torch_optim_check.py, which
 * replays them with real torch.optim when PyTorch is installed. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/optim.h"
#include "optim_elem.h"
#include "ps_test.h"

#define N_ELEMS 203 /* three full 64-element blocks and a tail */
#define N_STEPS 20

static uint64_t rng_state;

static double rnd_unit(void)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    rng_state = x;
    return (double)(x >> 11) / 9007199254740992.0; /* [0, 1) */
}

/* Non-zero value in ±[lo, hi). */
static float rnd_nonzero(double lo, double hi)
{
    double mag = lo + (hi - lo) * rnd_unit();
    return (float)(rnd_unit() < 0.5 ? -mag : mag);
}

/* ---- independent reference: torch.optim's documented algorithms, in double ---- */

typedef struct {
    double p[N_ELEMS], buf[N_ELEMS], m[N_ELEMS], v[N_ELEMS];
} ref_state_t;

static void ref_step(const ps_optim_config_t *cfg, double lr, int64_t t, ref_state_t *s,
                     const float *grad)
{
    for (size_t i = 0; i < N_ELEMS; i++) {
        double g = grad[i];
        if (cfg->kind == PS_OPTIM_SGD) {
            g += cfg->weight_decay * s->p[i];
            if (cfg->momentum != 0.0) {
                if (t > 1)
                    s->buf[i] = cfg->momentum * s->buf[i] + (1.0 - cfg->dampening) * g;
                else
                    s->buf[i] = g;
                g = cfg->nesterov ? g + cfg->momentum * s->buf[i] : s->buf[i];
            }
            s->p[i] -= lr * g;
            continue;
        }
        if (cfg->kind == PS_OPTIM_ADAMW)
            s->p[i] *= 1.0 - lr * cfg->weight_decay;
        else
            g += cfg->weight_decay * s->p[i];
        s->m[i] = cfg->beta1 * s->m[i] + (1.0 - cfg->beta1) * g;
        s->v[i] = cfg->beta2 * s->v[i] + (1.0 - cfg->beta2) * g * g;
        double m_hat = s->m[i] / (1.0 - pow(cfg->beta1, (double)t));
        double v_hat = s->v[i] / (1.0 - pow(cfg->beta2, (double)t));
        s->p[i] -= lr * m_hat / (sqrt(v_hat) + cfg->eps);
    }
}

/* Relative tolerance plus an absolute floor of about 10 fp32 ulps at 1.0: values that pass
 * near zero (momentum buffers, first moments, parameters crossing zero) carry the absolute
 * rounding error of the O(1) terms that cancelled in them. */
static int close_enough(double got, double want, double rel)
{
    double diff = fabs(got - want);
    return diff <= rel * fabs(want) + 1e-6;
}

/* Learning rate of step t: a schedule, so that the lr argument (not cfg->lr) is exercised. */
static double lr_at(const ps_optim_config_t *cfg, int64_t t)
{
    return cfg->lr * (1.0 - 0.02 * (double)(t - 1));
}

typedef struct {
    float param[N_ELEMS], state0[N_ELEMS], state1[N_ELEMS];
    float grads[N_STEPS][N_ELEMS];
    float init[N_ELEMS];
} trajectory_t;

/* Runs N_STEPS steps of cfg from a seeded random start; fills t. */
static void run_trajectory(const ps_optim_config_t *cfg, uint64_t seed, trajectory_t *t)
{
    rng_state = seed;
    memset(t, 0, sizeof *t);
    for (size_t i = 0; i < N_ELEMS; i++)
        t->param[i] = t->init[i] = rnd_nonzero(0.1, 2.0);
    for (int s = 0; s < N_STEPS; s++)
        for (size_t i = 0; i < N_ELEMS; i++)
            t->grads[s][i] = rnd_nonzero(0.01, 1.0);
    int nstate = ps_optim_state_count(cfg);
    for (int64_t s = 1; s <= N_STEPS; s++)
        ps_optim_step(cfg, lr_at(cfg, s), s, t->param, t->grads[s - 1],
                      nstate > 0 ? t->state0 : NULL, nstate > 1 ? t->state1 : NULL, N_ELEMS);
}

static void compare_trajectory(const ps_optim_config_t *cfg, const char *what)
{
    static trajectory_t t;
    static ref_state_t ref;
    char err[128] = "";
    CU_ASSERT_EQUAL_FATAL(ps_optim_validate(cfg, err, sizeof err), 0);
    run_trajectory(cfg, 0x1234567890abcdefull, &t);
    memset(&ref, 0, sizeof ref);
    for (size_t i = 0; i < N_ELEMS; i++)
        ref.p[i] = t.init[i];
    for (int64_t s = 1; s <= N_STEPS; s++)
        ref_step(cfg, lr_at(cfg, s), s, &ref, t.grads[s - 1]);

    int bad = 0;
    for (size_t i = 0; i < N_ELEMS; i++) {
        int ok = close_enough(t.param[i], ref.p[i], 1e-5);
        if (cfg->kind == PS_OPTIM_SGD && cfg->momentum != 0.0)
            ok &= close_enough(t.state0[i], ref.buf[i], 1e-5);
        if (cfg->kind != PS_OPTIM_SGD)
            ok &= close_enough(t.state0[i], ref.m[i], 1e-5) &&
                  close_enough(t.state1[i], ref.v[i], 1e-5);
        /* The optimizer must actually have moved the parameter. */
        ok &= t.param[i] != t.init[i];
        if (!ok && bad++ < 3)
            fprintf(stderr, "%s: element %zu: param %.9g, reference %.9g\n", what, i,
                    (double)t.param[i], ref.p[i]);
    }
    CU_ASSERT_EQUAL(bad, 0);
}

static ps_optim_config_t sgd_config(double momentum, double dampening, bool nesterov, double wd)
{
    ps_optim_config_t cfg;
    ps_optim_defaults(PS_OPTIM_SGD, &cfg);
    cfg.lr = 0.05;
    cfg.momentum = momentum;
    cfg.dampening = dampening;
    cfg.nesterov = nesterov;
    cfg.weight_decay = wd;
    return cfg;
}

static void test_sgd_plain(void)
{
    ps_optim_config_t cfg = sgd_config(0, 0, false, 0);
    compare_trajectory(&cfg, "sgd");
}

static void test_sgd_weight_decay(void)
{
    ps_optim_config_t cfg = sgd_config(0, 0, false, 0.1);
    compare_trajectory(&cfg, "sgd wd");
}

static void test_sgd_momentum(void)
{
    ps_optim_config_t cfg = sgd_config(0.9, 0, false, 0);
    compare_trajectory(&cfg, "sgd momentum");
}

static void test_sgd_dampening(void)
{
    ps_optim_config_t cfg = sgd_config(0.9, 0.3, false, 0.05);
    compare_trajectory(&cfg, "sgd dampening");
}

static void test_sgd_nesterov(void)
{
    ps_optim_config_t cfg = sgd_config(0.8, 0, true, 0.01);
    compare_trajectory(&cfg, "sgd nesterov");
}

static void test_adam(void)
{
    ps_optim_config_t cfg;
    ps_optim_defaults(PS_OPTIM_ADAM, &cfg);
    cfg.lr = 0.01;
    compare_trajectory(&cfg, "adam");
}

static void test_adam_weight_decay(void)
{
    ps_optim_config_t cfg;
    ps_optim_defaults(PS_OPTIM_ADAM, &cfg);
    cfg.lr = 0.01;
    cfg.weight_decay = 0.1;
    compare_trajectory(&cfg, "adam wd");
}

static void test_adam_small_beta1(void)
{
    /* 1 - beta1 >= 0.5 takes torch's other lerp form. */
    ps_optim_config_t cfg;
    ps_optim_defaults(PS_OPTIM_ADAM, &cfg);
    cfg.lr = 0.01;
    cfg.beta1 = 0.3;
    cfg.beta2 = 0.9;
    cfg.eps = 1e-6;
    compare_trajectory(&cfg, "adam beta1 0.3");
}

static void test_adamw(void)
{
    ps_optim_config_t cfg;
    ps_optim_defaults(PS_OPTIM_ADAMW, &cfg);
    cfg.lr = 0.01;
    compare_trajectory(&cfg, "adamw");
    cfg.weight_decay = 0.5;
    compare_trajectory(&cfg, "adamw wd 0.5");
}

static void test_adamw_differs_from_adam(void)
{
    /* Same weight decay, decoupled vs L2: the results must differ. */
    static trajectory_t a, w;
    ps_optim_config_t cfg;
    ps_optim_defaults(PS_OPTIM_ADAM, &cfg);
    cfg.lr = 0.01;
    cfg.weight_decay = 0.1;
    run_trajectory(&cfg, 42, &a);
    cfg.kind = PS_OPTIM_ADAMW;
    run_trajectory(&cfg, 42, &w);
    CU_ASSERT(memcmp(a.param, w.param, sizeof a.param) != 0);
}

static void test_sgd_first_step_momentum(void)
{
    /* torch initialises the buffer with the (weight-decayed) gradient itself on the first step,
     * not with (1 - dampening) times it. */
    enum { N = 70 };
    float p[N], g[N], buf[N], p0[N];
    rng_state = 7;
    for (int i = 0; i < N; i++) {
        p[i] = p0[i] = rnd_nonzero(0.1, 2.0);
        g[i] = rnd_nonzero(0.01, 1.0);
        buf[i] = 0.0f;
    }
    ps_optim_config_t cfg = sgd_config(0.9, 0.5, false, 0);
    ps_optim_step(&cfg, 0.1, 1, p, g, buf, NULL, N);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        bad += buf[i] != g[i];
        bad += p[i] != p0[i] + (float)-0.1 * g[i];
    }
    CU_ASSERT_EQUAL(bad, 0);

    /* Second step: buf = 0.9 * buf + 0.5 * g. */
    float buf1[N];
    memcpy(buf1, buf, sizeof buf);
    ps_optim_step(&cfg, 0.1, 2, p, g, buf, NULL, N);
    bad = 0;
    for (int i = 0; i < N; i++)
        bad += !close_enough(buf[i], 0.9 * buf1[i] + 0.5 * g[i], 1e-6);
    CU_ASSERT_EQUAL(bad, 0);

    /* With weight decay, the first buffer is g + wd * p. */
    for (int i = 0; i < N; i++) {
        p[i] = p0[i];
        buf[i] = 0.0f;
    }
    cfg.weight_decay = 0.25;
    ps_optim_step(&cfg, 0.1, 1, p, g, buf, NULL, N);
    bad = 0;
    for (int i = 0; i < N; i++)
        bad += buf[i] != g[i] + 0.25f * p0[i];
    CU_ASSERT_EQUAL(bad, 0);
}

static void test_first_adam_step(void)
{
    /* On step 1 the bias corrections make the update lr * g / (|g| + eps') = ±lr. */
    enum { N = 5 };
    float p[N] = {1, -1, 2, 0.5f, -3}, g[N] = {0.3f, -2, 1e-3f, 5, -0.7f}, m[N] = {0}, v[N] = {0};
    ps_optim_config_t cfg;
    ps_optim_defaults(PS_OPTIM_ADAM, &cfg);
    ps_optim_step(&cfg, 1e-3, 1, p, g, m, v, N);
    const float want[N] = {1 - 1e-3f, -1 + 1e-3f, 2 - 1e-3f, 0.5f - 1e-3f, -3 + 1e-3f};
    for (int i = 0; i < N; i++)
        CU_ASSERT(close_enough(p[i], want[i], 1e-5));
}

static void test_defaults(void)
{
    ps_optim_config_t cfg;
    ps_optim_defaults(PS_OPTIM_ADAM, &cfg);
    CU_ASSERT_EQUAL(cfg.kind, PS_OPTIM_ADAM);
    CU_ASSERT_DOUBLE_EQUAL(cfg.lr, 1e-3, 0);
    CU_ASSERT_DOUBLE_EQUAL(cfg.beta1, 0.9, 0);
    CU_ASSERT_DOUBLE_EQUAL(cfg.beta2, 0.999, 0);
    CU_ASSERT_DOUBLE_EQUAL(cfg.eps, 1e-8, 0);
    CU_ASSERT_DOUBLE_EQUAL(cfg.weight_decay, 0, 0);

    ps_optim_defaults(PS_OPTIM_ADAMW, &cfg);
    CU_ASSERT_EQUAL(cfg.kind, PS_OPTIM_ADAMW);
    CU_ASSERT_DOUBLE_EQUAL(cfg.lr, 1e-3, 0);
    CU_ASSERT_DOUBLE_EQUAL(cfg.beta1, 0.9, 0);
    CU_ASSERT_DOUBLE_EQUAL(cfg.beta2, 0.999, 0);
    CU_ASSERT_DOUBLE_EQUAL(cfg.eps, 1e-8, 0);
    CU_ASSERT_DOUBLE_EQUAL(cfg.weight_decay, 1e-2, 0);

    ps_optim_defaults(PS_OPTIM_SGD, &cfg);
    CU_ASSERT_EQUAL(cfg.kind, PS_OPTIM_SGD);
    CU_ASSERT_DOUBLE_EQUAL(cfg.lr, 1e-3, 0);
    CU_ASSERT_DOUBLE_EQUAL(cfg.momentum, 0, 0);
    CU_ASSERT_DOUBLE_EQUAL(cfg.dampening, 0, 0);
    CU_ASSERT_DOUBLE_EQUAL(cfg.weight_decay, 0, 0);
    CU_ASSERT_FALSE(cfg.nesterov);

    char err[128] = "";
    for (int k = PS_OPTIM_SGD; k <= PS_OPTIM_ADAMW; k++) {
        ps_optim_defaults((ps_optim_kind_t)k, &cfg);
        CU_ASSERT_EQUAL(ps_optim_validate(&cfg, err, sizeof err), 0);
    }
}

static void expect_invalid(const ps_optim_config_t *cfg, const char *needle)
{
    char err[128] = "";
    CU_ASSERT_EQUAL(ps_optim_validate(cfg, err, sizeof err), -1);
    if (!strstr(err, needle))
        fprintf(stderr, "validate: \"%s\" does not contain \"%s\"\n", err, needle);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, needle));
}

static void test_validate(void)
{
    ps_optim_config_t cfg;
    ps_optim_defaults(PS_OPTIM_SGD, &cfg);
    cfg.lr = -0.1;
    expect_invalid(&cfg, "Invalid learning rate: -0.1");
    cfg.lr = NAN;
    expect_invalid(&cfg, "Invalid learning rate");

    ps_optim_defaults(PS_OPTIM_SGD, &cfg);
    cfg.momentum = -0.5;
    expect_invalid(&cfg, "Invalid momentum value: -0.5");
    cfg.momentum = 0;
    cfg.weight_decay = -1;
    expect_invalid(&cfg, "Invalid weight_decay value: -1");
    cfg.weight_decay = 0;
    cfg.nesterov = true;
    expect_invalid(&cfg, "Nesterov momentum requires a momentum and zero dampening");
    cfg.momentum = 0.9;
    cfg.dampening = 0.1;
    expect_invalid(&cfg, "Nesterov momentum requires a momentum and zero dampening");
    cfg.dampening = 0;
    CU_ASSERT_EQUAL(ps_optim_validate(&cfg, NULL, 0), 0);

    ps_optim_defaults(PS_OPTIM_ADAM, &cfg);
    cfg.beta1 = 1.0;
    expect_invalid(&cfg, "Invalid beta parameter at index 0: 1");
    cfg.beta1 = -0.1;
    expect_invalid(&cfg, "Invalid beta parameter at index 0");
    cfg.beta1 = 0.9;
    cfg.beta2 = 1.5;
    expect_invalid(&cfg, "Invalid beta parameter at index 1: 1.5");
    cfg.beta2 = 0.999;
    cfg.eps = -1e-8;
    expect_invalid(&cfg, "Invalid epsilon value");
    ps_optim_defaults(PS_OPTIM_ADAMW, &cfg);
    cfg.weight_decay = -0.01;
    expect_invalid(&cfg, "Invalid weight_decay value");
    ps_optim_defaults(PS_OPTIM_ADAMW, &cfg);
    cfg.beta1 = 0.0; /* torch accepts 0 <= beta < 1 */
    CU_ASSERT_EQUAL(ps_optim_validate(&cfg, NULL, 0), 0);

    cfg.kind = (ps_optim_kind_t)9;
    expect_invalid(&cfg, "kind");
    /* A failing call with no buffer only returns -1. */
    CU_ASSERT_EQUAL(ps_optim_validate(&cfg, NULL, 0), -1);
}

static void test_state_count(void)
{
    ps_optim_config_t cfg = sgd_config(0, 0, false, 0.1);
    CU_ASSERT_EQUAL(ps_optim_state_count(&cfg), 0);
    cfg.momentum = 0.5;
    CU_ASSERT_EQUAL(ps_optim_state_count(&cfg), 1);
    ps_optim_defaults(PS_OPTIM_ADAM, &cfg);
    CU_ASSERT_EQUAL(ps_optim_state_count(&cfg), 2);
    ps_optim_defaults(PS_OPTIM_ADAMW, &cfg);
    CU_ASSERT_EQUAL(ps_optim_state_count(&cfg), 2);
}

/* The inf norm's largest magnitude: signs ignored, -0 is 0, infinities count, a NaN wins
 * wherever it is (as torch's abs().max()), and no elements give 0. */
static void test_max_abs(void)
{
    float x[9] = {0.5f, -3.25f, 2.0f, -0.0f, 1e-30f, 3.0f, -1.0f, 0.25f, 2.5f};
    CU_ASSERT(ps_max_abs(x, 9) == 3.25f);
    CU_ASSERT(ps_max_abs(x, 1) == 0.5f);
    CU_ASSERT(ps_max_abs(x, 0) == 0.0f);
    float z[2] = {-0.0f, 0.0f};
    float zm = ps_max_abs(z, 2);
    CU_ASSERT(zm == 0.0f && !signbit(zm));
    x[6] = -INFINITY;
    CU_ASSERT(isinf(ps_max_abs(x, 9)) && ps_max_abs(x, 9) > 0);
    x[8] = NAN;
    CU_ASSERT(isnan(ps_max_abs(x, 9)));
    x[6] = -1.0f;
    x[8] = 2.5f;
    x[0] = -NAN;
    CU_ASSERT(isnan(ps_max_abs(x, 9)));
}

static void test_sum_squares_and_scale(void)
{
    enum { N = 1001 };
    static float x[N];
    rng_state = 99;
    double want = 0.0;
    for (int i = 0; i < N; i++) {
        x[i] = rnd_nonzero(1e-3, 10.0);
        want += (double)x[i] * (double)x[i];
    }
    CU_ASSERT(close_enough(ps_sum_squares(x, N), want, 1e-12));
    /* Values whose squares overflow fp32 are fine in the double accumulator. */
    float big[3] = {3e20f, -4e20f, 0.0f};
    CU_ASSERT(close_enough(ps_sum_squares(big, 3), 25e40, 1e-6));
    CU_ASSERT_DOUBLE_EQUAL(ps_sum_squares(x, 0), 0.0, 0.0);
    float small[7] = {1, 2, 3, 4, 5, 6, 7};
    CU_ASSERT_DOUBLE_EQUAL(ps_sum_squares(small, 7), 140.0, 0.0);

    static float y[N];
    memcpy(y, x, sizeof x);
    ps_scale(y, N, 0.25f);
    int bad = 0;
    for (int i = 0; i < N; i++)
        bad += y[i] != x[i] * 0.25f;
    CU_ASSERT_EQUAL(bad, 0);
    ps_scale(y, 0, 3.0f);
    CU_ASSERT(y[0] == x[0] * 0.25f);
}

/* The element functions the CUDA kernels run (optim_elem.h) give exactly ps_optim_step's bits
 * over a 20-step trajectory, for every optimizer variant (both lerp forms, weight decay, first
 * momentum step, nesterov). */
static void elem_trajectory(const ps_optim_config_t *cfg, const char *what)
{
    static trajectory_t t;
    run_trajectory(cfg, 0xfeedfacecafebeefull, &t);
    static float p[N_ELEMS], s0[N_ELEMS], s1[N_ELEMS];
    memcpy(p, t.init, sizeof p);
    memset(s0, 0, sizeof s0);
    memset(s1, 0, sizeof s1);
    for (int64_t step = 1; step <= N_STEPS; step++) {
        ps_optim_scalars_t sc;
        ps_optim_step_scalars(cfg, lr_at(cfg, step), step, &sc);
        for (size_t i = 0; i < N_ELEMS; i++) {
            if (cfg->kind == PS_OPTIM_SGD)
                ps_sgd_elem(&sc, &p[i], t.grads[step - 1][i], &s0[i]);
            else
                ps_adam_elem(&sc, &p[i], t.grads[step - 1][i], &s0[i], &s1[i]);
        }
    }
    int bad = 0;
    int nstate = ps_optim_state_count(cfg);
    for (size_t i = 0; i < N_ELEMS; i++) {
        bool same = memcmp(&p[i], &t.param[i], sizeof(float)) == 0 &&
                    (nstate < 1 || memcmp(&s0[i], &t.state0[i], sizeof(float)) == 0) &&
                    (nstate < 2 || memcmp(&s1[i], &t.state1[i], sizeof(float)) == 0);
        if (!same && bad++ < 3)
            fprintf(stderr, "%s: element %zu: element function %.9g, ps_optim_step %.9g\n", what, i,
                    (double)p[i], (double)t.param[i]);
    }
    CU_ASSERT_EQUAL(bad, 0);
}

static void test_element_functions(void)
{
    ps_optim_config_t cfg = sgd_config(0, 0, false, 0);
    elem_trajectory(&cfg, "sgd");
    cfg = sgd_config(0, 0, false, 0.05);
    elem_trajectory(&cfg, "sgd wd");
    cfg = sgd_config(0.9, 0.3, false, 0.05);
    elem_trajectory(&cfg, "sgd momentum dampening wd");
    cfg = sgd_config(0.8, 0, true, 0.01);
    elem_trajectory(&cfg, "sgd nesterov");
    for (int kind = PS_OPTIM_ADAM; kind <= PS_OPTIM_ADAMW; kind++) {
        ps_optim_defaults((ps_optim_kind_t)kind, &cfg);
        cfg.lr = 0.01;
        elem_trajectory(&cfg, kind == PS_OPTIM_ADAM ? "adam" : "adamw");
        cfg.weight_decay = 0.1;
        elem_trajectory(&cfg, kind == PS_OPTIM_ADAM ? "adam wd" : "adamw wd");
        cfg.beta1 = 0.3; /* 1 - beta1 >= 0.5: the other lerp form */
        elem_trajectory(&cfg, kind == PS_OPTIM_ADAM ? "adam small beta1" : "adamw small beta1");
    }
}

/* ---- --dump: trajectories for torch_optim_check.py ---- */

static void dump_floats(const char *tag, const float *x, size_t n)
{
    printf("%s", tag);
    for (size_t i = 0; i < n; i++)
        printf(" %a", (double)x[i]);
    printf("\n");
}

static void dump_case(const char *name, const ps_optim_config_t *cfg)
{
    static trajectory_t t;
    run_trajectory(cfg, 0x1234567890abcdefull, &t);
    printf("case %s %d %a %a %a %d %a %a %a %a %d %d\n", name, (int)cfg->kind, cfg->lr,
           cfg->momentum, cfg->dampening, cfg->nesterov ? 1 : 0, cfg->weight_decay, cfg->beta1,
           cfg->beta2, cfg->eps, N_ELEMS, N_STEPS);
    for (int64_t s = 1; s <= N_STEPS; s++)
        printf("lr %a\n", lr_at(cfg, s));
    dump_floats("init", t.init, N_ELEMS);
    for (int s = 0; s < N_STEPS; s++)
        dump_floats("grad", t.grads[s], N_ELEMS);
    dump_floats("final", t.param, N_ELEMS);
}

static int dump_all(void)
{
    ps_optim_config_t cfg = sgd_config(0, 0, false, 0);
    dump_case("sgd", &cfg);
    cfg = sgd_config(0.9, 0.3, false, 0.05);
    dump_case("sgd_momentum_dampening_wd", &cfg);
    cfg = sgd_config(0.8, 0, true, 0.01);
    dump_case("sgd_nesterov", &cfg);
    ps_optim_defaults(PS_OPTIM_ADAM, &cfg);
    cfg.lr = 0.01;
    cfg.weight_decay = 0.1;
    dump_case("adam_wd", &cfg);
    cfg.beta1 = 0.3;
    cfg.beta2 = 0.9;
    dump_case("adam_small_beta1", &cfg);
    ps_optim_defaults(PS_OPTIM_ADAMW, &cfg);
    cfg.lr = 0.01;
    dump_case("adamw", &cfg);
    return fflush(stdout) == 0 ? 0 : 1;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--dump") == 0)
        return dump_all();
    static const ps_test_case_t cases[] = {
        {"sgd_plain", test_sgd_plain},
        {"sgd_weight_decay", test_sgd_weight_decay},
        {"sgd_momentum", test_sgd_momentum},
        {"sgd_dampening", test_sgd_dampening},
        {"sgd_nesterov", test_sgd_nesterov},
        {"sgd_first_step_momentum", test_sgd_first_step_momentum},
        {"adam", test_adam},
        {"adam_weight_decay", test_adam_weight_decay},
        {"adam_small_beta1", test_adam_small_beta1},
        {"adamw", test_adamw},
        {"adamw_differs_from_adam", test_adamw_differs_from_adam},
        {"first_adam_step", test_first_adam_step},
        {"defaults", test_defaults},
        {"validate", test_validate},
        {"state_count", test_state_count},
        {"sum_squares_and_scale", test_sum_squares_and_scale},
        {"max_abs", test_max_abs},
        {"element_functions", test_element_functions},
        {NULL, NULL},
    };
    return ps_test_main("shard_optim", cases);
}
