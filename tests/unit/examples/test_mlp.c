/* Unit tests for the example MLP (examples/mlp): width parsing and parameter bookkeeping,
 * gradients against finite differences of an independent double-precision forward, init and
 * data determinism, and the --local reference trainer (loss falls, multi-rank averaging,
 * uneven schedules, clipping, output format). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "local_train.h"
#include "mlp.h"
#include "pshard/optim.h"
#include "ps_test.h"

#define MAXP (2 * MLP_MAX_LAYERS)

/* Per-parameter arrays for a shape; freed with params_free. */
typedef struct {
    size_t n;
    size_t numel[MAXP];
    float *a[MAXP];
} params_t;

static void params_alloc(params_t *p, const mlp_shape_t *s)
{
    memset(p, 0, sizeof(*p));
    p->n = mlp_num_params(s);
    for (size_t i = 0; i < p->n; i++) {
        p->numel[i] = mlp_param_numel(s, i);
        p->a[i] = calloc(p->numel[i], sizeof(float));
        CU_ASSERT_PTR_NOT_NULL_FATAL(p->a[i]);
    }
}

static void params_free(params_t *p)
{
    for (size_t i = 0; i < p->n; i++)
        free(p->a[i]);
    memset(p, 0, sizeof(*p));
}

static mlp_shape_t make_shape(const char *widths, int input, int output)
{
    mlp_shape_t s;
    CU_ASSERT_EQUAL_FATAL(mlp_parse_widths(widths, input, output, &s), 0);
    return s;
}

/* A default argument set for small local runs, printing nowhere. */
static FILE *devnull(void)
{
    static FILE *f;
    if (!f)
        f = fopen("/dev/null", "w");
    return f;
}

static mlp_local_args_t small_args(const mlp_shape_t *s, ps_optim_kind_t kind, double lr)
{
    mlp_local_args_t a;
    memset(&a, 0, sizeof(a));
    a.shape = *s;
    a.batch = 8;
    a.steps = 1;
    a.world = 1;
    a.seed = 11;
    a.data_seed = 12;
    a.task_seed = 13;
    ps_optim_defaults(kind, &a.optim);
    a.optim.lr = lr;
    a.print_every = 1;
    a.out = devnull();
    return a;
}

static void test_parse_widths(void)
{
    mlp_shape_t s;
    CU_ASSERT_EQUAL(mlp_parse_widths("1024,512,7", 256, 64, &s), 0);
    CU_ASSERT_EQUAL(s.nlayers, 4);
    CU_ASSERT_EQUAL(s.widths[0], 256);
    CU_ASSERT_EQUAL(s.widths[1], 1024);
    CU_ASSERT_EQUAL(s.widths[2], 512);
    CU_ASSERT_EQUAL(s.widths[3], 7);
    CU_ASSERT_EQUAL(s.widths[4], 64);
    CU_ASSERT_EQUAL(mlp_parse_widths("", 3, 2, &s), 0); /* one linear layer */
    CU_ASSERT_EQUAL(s.nlayers, 1);
    CU_ASSERT_EQUAL(s.widths[1], 2);
    const char *bad[] = {"0", "-4", "4,", ",4", "4,,4", "4x", " 4", "+4", "4 ,5", "99999999999"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        CU_ASSERT_EQUAL(mlp_parse_widths(bad[i], 3, 2, &s), -1);
    CU_ASSERT_EQUAL(mlp_parse_widths("4", 0, 2, &s), -1);
    CU_ASSERT_EQUAL(mlp_parse_widths("4", 3, 0, &s), -1);
    /* MLP_MAX_LAYERS - 1 hidden widths fit; one more does not. */
    char buf[256] = "";
    size_t len = 0;
    for (int i = 0; i < MLP_MAX_LAYERS - 1; i++)
        len += (size_t)snprintf(buf + len, sizeof(buf) - len, i ? ",%d" : "%d", i + 1);
    CU_ASSERT_EQUAL(mlp_parse_widths(buf, 3, 2, &s), 0);
    CU_ASSERT_EQUAL(s.nlayers, MLP_MAX_LAYERS);
    snprintf(buf + len, sizeof(buf) - len, ",9");
    CU_ASSERT_EQUAL(mlp_parse_widths(buf, 3, 2, &s), -1);
}

static void test_param_layout(void)
{
    mlp_shape_t s = make_shape("5,6", 4, 3);
    CU_ASSERT_EQUAL(mlp_num_params(&s), 6);
    const char *names[] = {"fc0.weight", "fc0.bias",   "fc1.weight",
                           "fc1.bias",   "fc2.weight", "fc2.bias"};
    const int64_t shapes[6][2] = {{5, 4}, {5, 1}, {6, 5}, {6, 1}, {3, 6}, {3, 1}};
    for (size_t p = 0; p < 6; p++) {
        char name[32];
        mlp_param_name(&s, p, name, sizeof(name));
        CU_ASSERT_STRING_EQUAL(name, names[p]);
        int64_t shp[2];
        mlp_param_shape(&s, p, shp);
        CU_ASSERT_EQUAL(shp[0], shapes[p][0]);
        CU_ASSERT_EQUAL(shp[1], shapes[p][1]);
        CU_ASSERT_EQUAL(mlp_param_ndim(&s, p), p % 2 == 0 ? 2 : 1);
        CU_ASSERT_EQUAL(mlp_param_rows(&s, p), (size_t)shapes[p][0]);
        CU_ASSERT_EQUAL(mlp_param_numel(&s, p), (size_t)(shapes[p][0] * shapes[p][1]));
    }
    char tiny[4];
    mlp_param_name(&s, 0, tiny, sizeof(tiny));
    CU_ASSERT_STRING_EQUAL(tiny, "fc0");
}

/* Independent reference: forward in double from fp32 params, with one element optionally
 * perturbed by delta, returning the MSE loss. */
static double ref_loss(const mlp_shape_t *s, const params_t *p, const float *x, const float *y,
                       int batch, size_t pp, size_t idx, double delta)
{
    int maxw = 0;
    for (int l = 0; l <= s->nlayers; l++)
        maxw = s->widths[l] > maxw ? s->widths[l] : maxw;
    double *cur = calloc((size_t)batch * maxw, sizeof(double));
    double *nxt = calloc((size_t)batch * maxw, sizeof(double));
    for (int i = 0; i < batch * s->widths[0]; i++)
        cur[i] = x[i];
    for (int l = 0; l < s->nlayers; l++) {
        int in = s->widths[l], out = s->widths[l + 1];
        const float *w = p->a[2 * l], *b = p->a[2 * l + 1];
        for (int i = 0; i < batch; i++) {
            for (int o = 0; o < out; o++) {
                double bo = b[o] + ((pp == (size_t)(2 * l + 1) && idx == (size_t)o) ? delta : 0.0);
                double acc = bo;
                for (int k = 0; k < in; k++) {
                    size_t wi = (size_t)o * in + k;
                    double wv = w[wi] + ((pp == (size_t)(2 * l) && idx == wi) ? delta : 0.0);
                    acc += cur[(size_t)i * in + k] * wv;
                }
                nxt[(size_t)i * out + o] = (l + 1 < s->nlayers && acc < 0.0) ? 0.0 : acc;
            }
        }
        double *t = cur;
        cur = nxt;
        nxt = t;
    }
    int nout = s->widths[s->nlayers];
    double sum = 0.0;
    for (int i = 0; i < batch * nout; i++)
        sum += (cur[i] - y[i]) * (cur[i] - y[i]);
    free(cur);
    free(nxt);
    return sum / (batch * nout);
}

static void test_gradient_finite_differences(void)
{
    mlp_shape_t s = make_shape("7,6", 5, 3);
    const int batch = 4;
    params_t p, g;
    params_alloc(&p, &s);
    params_alloc(&g, &s);
    mlp_init_params(&s, 3, p.a);
    /* Biases large enough that some units are dead and some alive. */
    float x[4 * 5], y[4 * 3];
    mlp_task_t *task = mlp_task_create(&s, 9);
    CU_ASSERT_PTR_NOT_NULL_FATAL(task);
    mlp_task_batch(task, 1, 0, 0, batch, x, y);
    for (int i = 0; i < batch * 3; i++)
        y[i] += 0.5f; /* make sure the loss is far from zero */
    mlp_workspace_t *ws = mlp_workspace_create(&s, batch);
    CU_ASSERT_PTR_NOT_NULL_FATAL(ws);
    for (size_t i = 0; i < g.n; i++)
        for (size_t k = 0; k < g.numel[i]; k++)
            g.a[i][k] = 1e6f; /* must be overwritten, not accumulated into */
    double loss = mlp_forward_backward(&s, ws, (const float *const *)p.a, x, y, batch, g.a);
    double loss_nograd = mlp_forward_backward(&s, ws, (const float *const *)p.a, x, y, batch, NULL);
    double loss_ref = ref_loss(&s, &p, x, y, batch, SIZE_MAX, 0, 0.0);
    CU_ASSERT_DOUBLE_EQUAL(loss, loss_ref, 1e-6 * loss_ref);
    CU_ASSERT_EQUAL(loss, loss_nograd);

    const double h = 1e-4;
    int checked = 0, nonzero = 0, bad = 0;
    for (size_t pi = 0; pi < p.n; pi++) {
        for (size_t k = 0; k < p.numel[pi]; k++) {
            double fd = (ref_loss(&s, &p, x, y, batch, pi, k, h) -
                         ref_loss(&s, &p, x, y, batch, pi, k, -h)) /
                        (2 * h);
            double an = g.a[pi][k];
            if (fabs(an - fd) > 2e-5 + 1e-3 * fabs(fd)) {
                if (bad++ < 5)
                    fprintf(stderr, "param %zu[%zu]: analytic %.8g finite-diff %.8g\n", pi, k, an,
                            fd);
            }
            checked++;
            nonzero += fabs(fd) > 1e-4;
        }
    }
    CU_ASSERT_EQUAL(bad, 0);
    CU_ASSERT(checked == 5 * 7 + 7 + 7 * 6 + 6 + 6 * 3 + 3);
    CU_ASSERT(nonzero > checked / 2); /* the check must not pass vacuously */
    mlp_workspace_free(ws);
    mlp_task_free(task);
    params_free(&p);
    params_free(&g);
}

static void test_init_deterministic_and_bounded(void)
{
    mlp_shape_t s = make_shape("300,40", 100, 10);
    params_t a, b, c;
    params_alloc(&a, &s);
    params_alloc(&b, &s);
    params_alloc(&c, &s);
    mlp_init_params(&s, 42, a.a);
    mlp_init_params(&s, 42, b.a);
    mlp_init_params(&s, 43, c.a);
    for (size_t i = 0; i < a.n; i++) {
        CU_ASSERT_EQUAL(memcmp(a.a[i], b.a[i], a.numel[i] * sizeof(float)), 0);
        CU_ASSERT_NOT_EQUAL(memcmp(a.a[i], c.a[i], a.numel[i] * sizeof(float)), 0);
        double bound = 1.0 / sqrt((double)s.widths[i / 2]);
        double maxabs = 0.0, sum = 0.0, sq = 0.0;
        for (size_t k = 0; k < a.numel[i]; k++) {
            double v = a.a[i][k];
            maxabs = fabs(v) > maxabs ? fabs(v) : maxabs;
            sum += v;
            sq += v * v;
        }
        double n = (double)a.numel[i];
        CU_ASSERT(maxabs <= bound * (1 + 1e-6));
        /* Uniform on [-bound, bound]: mean 0, variance bound^2 / 3, extremes near the bound. */
        CU_ASSERT(maxabs > bound * (1 - 20.0 / n));
        CU_ASSERT(fabs(sum / n) < 4 * bound / sqrt(3 * n) + 1e-9);
        if (n >= 1000)
            CU_ASSERT_DOUBLE_EQUAL(sq / n, bound * bound / 3, 0.1 * bound * bound / 3);
    }
    /* fc0.weight and fc0.bias share a bound, so equal streams would show as equal values. */
    CU_ASSERT_NOT_EQUAL(memcmp(a.a[0], a.a[1], 10 * sizeof(float)), 0);
    params_free(&a);
    params_free(&b);
    params_free(&c);
}

static void test_batches_deterministic_and_distinct(void)
{
    mlp_shape_t s = make_shape("64,64", 32, 8);
    const int batch = 300; /* more than the teacher's internal chunk */
    size_t nx = (size_t)batch * 32, ny = (size_t)batch * 8;
    float *x[4], *y[4];
    for (int i = 0; i < 4; i++) {
        x[i] = malloc(nx * sizeof(float));
        y[i] = malloc(ny * sizeof(float));
    }
    mlp_task_t *t1 = mlp_task_create(&s, 5), *t2 = mlp_task_create(&s, 5);
    mlp_task_t *t3 = mlp_task_create(&s, 6);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t3);
    mlp_task_batch(t1, 7, 1, 3, batch, x[0], y[0]);
    mlp_task_batch(t2, 7, 1, 3, batch, x[1], y[1]); /* another task object, same seeds */
    CU_ASSERT_EQUAL(memcmp(x[0], x[1], nx * sizeof(float)), 0);
    CU_ASSERT_EQUAL(memcmp(y[0], y[1], ny * sizeof(float)), 0);
    mlp_task_batch(t1, 7, 2, 3, batch, x[2], y[2]); /* other rank */
    mlp_task_batch(t1, 7, 1, 4, batch, x[3], y[3]); /* other batch */
    CU_ASSERT_NOT_EQUAL(memcmp(x[0], x[2], nx * sizeof(float)), 0);
    CU_ASSERT_NOT_EQUAL(memcmp(x[0], x[3], nx * sizeof(float)), 0);
    CU_ASSERT_NOT_EQUAL(memcmp(x[2], x[3], nx * sizeof(float)), 0);
    mlp_task_batch(t1, 8, 1, 3, batch, x[2], y[2]); /* other data seed */
    CU_ASSERT_NOT_EQUAL(memcmp(x[0], x[2], nx * sizeof(float)), 0);
    /* Another teacher: same inputs, other targets. */
    mlp_task_batch(t3, 7, 1, 3, batch, x[3], y[3]);
    CU_ASSERT_EQUAL(memcmp(x[0], x[3], nx * sizeof(float)), 0);
    CU_ASSERT_NOT_EQUAL(memcmp(y[0], y[3], ny * sizeof(float)), 0);
    /* Row 0..batch of a big batch equals the same rows asked for as a smaller batch. */
    mlp_task_batch(t1, 7, 1, 3, 10, x[2], y[2]);
    CU_ASSERT_EQUAL(memcmp(x[0], x[2], 10 * 32 * sizeof(float)), 0);

    /* x ~ N(0, 1); targets of unit-ish second moment. */
    double sum = 0, sq = 0, ysq = 0;
    for (size_t i = 0; i < nx; i++) {
        sum += x[0][i];
        sq += (double)x[0][i] * x[0][i];
    }
    for (size_t i = 0; i < ny; i++) {
        CU_ASSERT_FATAL(isfinite(y[0][i]));
        ysq += (double)y[0][i] * y[0][i];
    }
    CU_ASSERT(fabs(sum / nx) < 0.05);
    CU_ASSERT_DOUBLE_EQUAL(sq / nx, 1.0, 0.05);
    CU_ASSERT(ysq / ny > 0.2 && ysq / ny < 5.0);
    mlp_task_free(t1);
    mlp_task_free(t2);
    mlp_task_free(t3);
    mlp_task_free(NULL);
    mlp_workspace_free(NULL);
    for (int i = 0; i < 4; i++) {
        free(x[i]);
        free(y[i]);
    }
}

/* Mean of losses[from, to). */
static double mean(const double *v, int from, int to)
{
    double s = 0;
    for (int i = from; i < to; i++)
        s += v[i];
    return s / (to - from);
}

static void check_loss_falls(ps_optim_kind_t kind, double lr, double momentum)
{
    mlp_shape_t s = make_shape("32,32", 16, 4);
    mlp_local_args_t a = small_args(&s, kind, lr);
    a.optim.momentum = momentum;
    a.batch = 32;
    a.steps = 50;
    double losses[50];
    a.losses = losses;
    CU_ASSERT_EQUAL_FATAL(mlp_local_train(&a), 0);
    double first = mean(losses, 0, 5), last = mean(losses, 45, 50);
    if (!(last < 0.6 * first))
        fprintf(stderr, "kind %d: loss %.4f -> %.4f\n", (int)kind, first, last);
    CU_ASSERT(last < 0.6 * first);
    for (int i = 0; i < 50; i++)
        CU_ASSERT(isfinite(losses[i]));
}

static void test_loss_falls_sgd_momentum(void)
{
    check_loss_falls(PS_OPTIM_SGD, 0.05, 0.9);
}

static void test_loss_falls_adam(void)
{
    check_loss_falls(PS_OPTIM_ADAM, 3e-3, 0.0);
}

/* Computes rank r's gradient and loss on batch b from params p into g. */
static double rank_grad(const mlp_shape_t *s, const mlp_local_args_t *a, const params_t *p, int r,
                        int64_t b, params_t *g)
{
    mlp_task_t *task = mlp_task_create(s, a->task_seed);
    mlp_workspace_t *ws = mlp_workspace_create(s, a->batch);
    float *x = malloc((size_t)a->batch * s->widths[0] * sizeof(float));
    float *y = malloc((size_t)a->batch * s->widths[s->nlayers] * sizeof(float));
    mlp_task_batch(task, a->data_seed, r, b, a->batch, x, y);
    double loss = mlp_forward_backward(s, ws, (const float *const *)p->a, x, y, a->batch, g->a);
    free(x);
    free(y);
    mlp_workspace_free(ws);
    mlp_task_free(task);
    return loss;
}

/* One plain SGD step on p with the mean of the given ranks' gradients on batch b, optionally
 * clipped to max_norm. Returns the mean loss. */
static double manual_step(const mlp_shape_t *s, const mlp_local_args_t *a, params_t *p,
                          const int *ranks, int nranks, int64_t b, double max_norm)
{
    params_t g, sum;
    params_alloc(&g, s);
    params_alloc(&sum, s);
    double loss = 0;
    for (int i = 0; i < nranks; i++) {
        loss += rank_grad(s, a, p, ranks[i], b, &g);
        for (size_t pi = 0; pi < g.n; pi++)
            for (size_t k = 0; k < g.numel[pi]; k++)
                sum.a[pi][k] += g.a[pi][k];
    }
    double sq = 0;
    for (size_t pi = 0; pi < g.n; pi++)
        for (size_t k = 0; k < g.numel[pi]; k++) {
            sum.a[pi][k] /= (float)nranks;
            sq += (double)sum.a[pi][k] * sum.a[pi][k];
        }
    double coef = 1.0;
    if (max_norm > 0 && max_norm / (sqrt(sq) + 1e-6) < 1.0)
        coef = max_norm / (sqrt(sq) + 1e-6);
    for (size_t pi = 0; pi < g.n; pi++)
        for (size_t k = 0; k < g.numel[pi]; k++)
            p->a[pi][k] -= (float)(a->optim.lr * coef * sum.a[pi][k]);
    params_free(&g);
    params_free(&sum);
    return loss / nranks;
}

/* Asserts every element of a and b agrees to a few fp32 ulps of the update. */
static void assert_params_close(const params_t *a, const params_t *b, double tol)
{
    int bad = 0;
    for (size_t pi = 0; pi < a->n; pi++)
        for (size_t k = 0; k < a->numel[pi]; k++)
            if (fabs((double)a->a[pi][k] - b->a[pi][k]) > tol)
                if (bad++ < 3)
                    fprintf(stderr, "param %zu[%zu]: %.9g vs %.9g\n", pi, k, a->a[pi][k],
                            b->a[pi][k]);
    CU_ASSERT_EQUAL(bad, 0);
}

static void test_world2_averages_grads(void)
{
    mlp_shape_t s = make_shape("16,12", 10, 3);
    mlp_local_args_t a = small_args(&s, PS_OPTIM_SGD, 0.5);
    a.world = 2;
    a.steps = 2;
    double losses[2];
    params_t got, want;
    params_alloc(&got, &s);
    params_alloc(&want, &s);
    a.losses = losses;
    a.params_out = got.a;
    CU_ASSERT_EQUAL_FATAL(mlp_local_train(&a), 0);

    mlp_init_params(&s, a.seed, want.a);
    const int both[] = {0, 1};
    double l0 = manual_step(&s, &a, &want, both, 2, 0, 0);
    double l1 = manual_step(&s, &a, &want, both, 2, 1, 0);
    CU_ASSERT_DOUBLE_EQUAL(losses[0], l0, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(losses[1], l1, 1e-6 * l1);
    assert_params_close(&got, &want, 1e-6);

    /* A single rank's gradient differs from the average: the test can tell them apart. */
    params_t one;
    params_alloc(&one, &s);
    mlp_init_params(&s, a.seed, one.a);
    const int r0[] = {0};
    manual_step(&s, &a, &one, r0, 1, 0, 0);
    manual_step(&s, &a, &one, r0, 1, 1, 0);
    double diff = 0;
    for (size_t pi = 0; pi < one.n; pi++)
        for (size_t k = 0; k < one.numel[pi]; k++)
            diff = fmax(diff, fabs((double)one.a[pi][k] - got.a[pi][k]));
    CU_ASSERT(diff > 1e-4);
    params_free(&one);
    params_free(&got);
    params_free(&want);
}

static void test_clip_grad_norm(void)
{
    mlp_shape_t s = make_shape("16,12", 10, 3);
    mlp_local_args_t a = small_args(&s, PS_OPTIM_SGD, 0.5);
    a.world = 2;
    a.steps = 2;
    a.max_grad_norm = 0.05; /* well below the gradient norm here, so clipping is active */
    params_t got, want, unclipped;
    params_alloc(&got, &s);
    params_alloc(&want, &s);
    params_alloc(&unclipped, &s);
    a.params_out = got.a;
    CU_ASSERT_EQUAL_FATAL(mlp_local_train(&a), 0);
    mlp_init_params(&s, a.seed, want.a);
    const int both[] = {0, 1};
    manual_step(&s, &a, &want, both, 2, 0, a.max_grad_norm);
    manual_step(&s, &a, &want, both, 2, 1, a.max_grad_norm);
    assert_params_close(&got, &want, 1e-6);
    mlp_init_params(&s, a.seed, unclipped.a);
    manual_step(&s, &a, &unclipped, both, 2, 0, 0);
    double diff = 0;
    for (size_t k = 0; k < got.numel[0]; k++)
        diff = fmax(diff, fabs((double)unclipped.a[0][k] - got.a[0][k]));
    CU_ASSERT(diff > 1e-4);
    /* A huge max_norm is the same as no clipping. */
    a.max_grad_norm = 1e9;
    CU_ASSERT_EQUAL_FATAL(mlp_local_train(&a), 0);
    mlp_init_params(&s, a.seed, want.a);
    manual_step(&s, &a, &want, both, 2, 0, 0);
    manual_step(&s, &a, &want, both, 2, 1, 0);
    assert_params_close(&got, &want, 1e-6);
    params_free(&got);
    params_free(&want);
    params_free(&unclipped);
}

static void test_uneven_schedule(void)
{
    mlp_shape_t s = make_shape("16,12", 10, 3);
    mlp_local_args_t a = small_args(&s, PS_OPTIM_SGD, 0.5);
    a.world = 3;
    a.steps = 2;
    a.uneven = true; /* rank 0: 2 batches, rank 1: 3, rank 2: 4 */
    double losses[4];
    params_t got, want;
    params_alloc(&got, &s);
    params_alloc(&want, &s);
    a.losses = losses;
    a.params_out = got.a;
    CU_ASSERT_EQUAL_FATAL(mlp_local_train(&a), 0);

    mlp_init_params(&s, a.seed, want.a);
    const int all[] = {0, 1, 2}, last2[] = {1, 2}, last1[] = {2};
    double l[4];
    l[0] = manual_step(&s, &a, &want, all, 3, 0, 0);
    l[1] = manual_step(&s, &a, &want, all, 3, 1, 0);
    l[2] = manual_step(&s, &a, &want, last2, 2, 2, 0);
    l[3] = manual_step(&s, &a, &want, last1, 1, 3, 0);
    /* Step 0 is bit-identical; later steps see parameters that may differ by an ulp (the
     * trainer multiplies by 1/n where this test divides by n). */
    CU_ASSERT_DOUBLE_EQUAL(losses[0], l[0], 1e-12);
    for (int i = 1; i < 4; i++) {
        if (fabs(losses[i] - l[i]) > 1e-6 * l[i])
            fprintf(stderr, "step %d: loss %.12g, manual %.12g\n", i, losses[i], l[i]);
        CU_ASSERT_DOUBLE_EQUAL(losses[i], l[i], 1e-6 * l[i]);
    }
    assert_params_close(&got, &want, 1e-6);

    /* Averaging over all three ranks (or dividing by world) at the tail would differ. */
    params_t wrong;
    params_alloc(&wrong, &s);
    mlp_init_params(&s, a.seed, wrong.a);
    manual_step(&s, &a, &wrong, all, 3, 0, 0);
    manual_step(&s, &a, &wrong, all, 3, 1, 0);
    manual_step(&s, &a, &wrong, all, 3, 2, 0);
    manual_step(&s, &a, &wrong, all, 3, 3, 0);
    double diff = 0;
    for (size_t pi = 0; pi < got.n; pi++)
        for (size_t k = 0; k < got.numel[pi]; k++)
            diff = fmax(diff, fabs((double)wrong.a[pi][k] - got.a[pi][k]));
    CU_ASSERT(diff > 1e-4);
    params_free(&wrong);
    params_free(&got);
    params_free(&want);
}

static void test_output_format(void)
{
    mlp_shape_t s = make_shape("8", 4, 2);
    mlp_local_args_t a = small_args(&s, PS_OPTIM_ADAMW, 1e-2);
    a.steps = 7;
    a.print_every = 3;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    params_t got;
    params_alloc(&got, &s);
    double losses[7];
    a.out = f;
    a.losses = losses;
    a.params_out = got.a;
    CU_ASSERT_EQUAL(mlp_local_train(&a), 0);
    fclose(f);
    /* Steps 1, 3, 6 and the last (7), then the checksum. */
    int steps[8], n = 0;
    char *line = buf;
    double checksum = NAN;
    while (line && *line) {
        char *nl = strchr(line, '\n');
        CU_ASSERT_PTR_NOT_NULL_FATAL(nl);
        *nl = '\0';
        int step;
        double loss;
        char tail;
        if (sscanf(line, "step %d loss %lf%c", &step, &loss, &tail) == 2) {
            CU_ASSERT_FATAL(n < 8);
            CU_ASSERT_DOUBLE_EQUAL(loss, losses[step - 1], 1e-8 * fabs(loss));
            steps[n++] = step;
        } else {
            CU_ASSERT_EQUAL(sscanf(line, "final checksum %lf%c", &checksum, &tail), 1);
            CU_ASSERT_PTR_NULL(strchr(nl + 1, '\n')); /* the last line */
        }
        line = nl + 1;
    }
    CU_ASSERT_EQUAL_FATAL(n, 4);
    CU_ASSERT_EQUAL(steps[0], 1);
    CU_ASSERT_EQUAL(steps[1], 3);
    CU_ASSERT_EQUAL(steps[2], 6);
    CU_ASSERT_EQUAL(steps[3], 7);
    double sum = 0;
    for (size_t pi = 0; pi < got.n; pi++)
        for (size_t k = 0; k < got.numel[pi]; k++)
            sum += got.a[pi][k];
    CU_ASSERT_EQUAL(checksum, sum); /* "%.17g" round-trips a double exactly */
    free(buf);
    params_free(&got);
}

static void test_invalid_args(void)
{
    mlp_shape_t s = make_shape("8", 4, 2);
    mlp_local_args_t a = small_args(&s, PS_OPTIM_SGD, 0.1);
    a.batch = 0;
    CU_ASSERT_EQUAL(mlp_local_train(&a), 2);
    a = small_args(&s, PS_OPTIM_SGD, 0.1);
    a.world = 0;
    CU_ASSERT_EQUAL(mlp_local_train(&a), 2);
    a = small_args(&s, PS_OPTIM_SGD, -1.0);
    CU_ASSERT_EQUAL(mlp_local_train(&a), 2);
    a = small_args(&s, PS_OPTIM_SGD, 0.1);
    a.shape.nlayers = 0;
    CU_ASSERT_EQUAL(mlp_local_train(&a), 2);
    CU_ASSERT_PTR_NULL(mlp_workspace_create(&s, 0));
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"parse_widths", test_parse_widths},
        {"param_layout", test_param_layout},
        {"gradient_finite_differences", test_gradient_finite_differences},
        {"init_deterministic_and_bounded", test_init_deterministic_and_bounded},
        {"batches_deterministic_and_distinct", test_batches_deterministic_and_distinct},
        {"loss_falls_sgd_momentum", test_loss_falls_sgd_momentum},
        {"loss_falls_adam", test_loss_falls_adam},
        {"world2_averages_grads", test_world2_averages_grads},
        {"clip_grad_norm", test_clip_grad_norm},
        {"uneven_schedule", test_uneven_schedule},
        {"output_format", test_output_format},
        {"invalid_args", test_invalid_args},
        {NULL, NULL},
    };
    return ps_test_main("examples_mlp", cases);
}
