/* The example MLP: shape bookkeeping, torch.nn.Linear-style deterministic init, forward and
 * backward through cblas_sgemm, and the synthetic teacher task with its per-(rank, batch) data.
 * Every random number comes from splitmix64 streams keyed by a tuple of seeds, so any process
 * rebuilds the same values. */
#include "mlp.h"

#include <assert.h>
#include <cblas.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Largest width mlp_parse_widths accepts; keeps widths * batch products far from overflow. */
#define MLP_MAX_WIDTH (1 << 20)

/* Rows the teacher forwards at a time, so mlp_task_batch never allocates. */
#define MLP_TASK_CHUNK 256

#define MLP_TWO_PI 6.283185307179586476925286766559

/* ---- random numbers ---------------------------------------------------------------------- */

/* splitmix64 (Steele, Lea, Flood 2014): advances *state and returns the next output. */
static uint64_t splitmix64_next(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Hashes key into the running seed h, so (a, b, c) tuples give unrelated streams. */
static uint64_t seed_mix(uint64_t h, uint64_t key)
{
    uint64_t s = h ^ (key * 0xD1B54A32D192ED03ull);
    return splitmix64_next(&s);
}

/* Uniform in [0, 1) with 53 random bits. */
static double rng_uniform(uint64_t *state)
{
    return (double)(splitmix64_next(state) >> 11) * 0x1.0p-53;
}

/* Fills out[0..n) with uniform values in [-bound, bound]. */
static void fill_uniform(uint64_t stream_seed, float bound, float *out, size_t n)
{
    uint64_t state = stream_seed;
    for (size_t i = 0; i < n; i++)
        out[i] = (float)((2.0 * rng_uniform(&state) - 1.0) * bound);
}

/* Fills out[0..n) with N(0, 1) values by the Box-Muller transform (both outputs used). */
static void fill_normal(uint64_t stream_seed, float *out, size_t n)
{
    uint64_t state = stream_seed;
    for (size_t i = 0; i < n; i += 2) {
        double u1 = 1.0 - rng_uniform(&state); /* (0, 1]: log stays finite */
        double u2 = rng_uniform(&state);
        double r = sqrt(-2.0 * log(u1));
        out[i] = (float)(r * cos(MLP_TWO_PI * u2));
        if (i + 1 < n)
            out[i + 1] = (float)(r * sin(MLP_TWO_PI * u2));
    }
}

/* Domain tags keep the streams of different purposes apart even with equal seeds. */
enum { TAG_INIT = 1, TAG_TEACHER = 2, TAG_DATA = 3 };

/* ---- shape ------------------------------------------------------------------------------- */

int mlp_parse_widths(const char *text, int input, int output, mlp_shape_t *shape)
{
    if (!text || !shape || input < 1 || input > MLP_MAX_WIDTH || output < 1 ||
        output > MLP_MAX_WIDTH)
        return -1;
    mlp_shape_t s;
    memset(&s, 0, sizeof(s));
    s.widths[0] = input;
    int hidden = 0;
    const char *p = text;
    /* An empty list means no hidden layer: a single linear map from input to output. */
    while (*p != '\0') {
        if (hidden + 1 >= MLP_MAX_LAYERS)
            return -1;
        if (*p < '0' || *p > '9')
            return -1; /* strtol would also take signs and spaces */
        char *end = NULL;
        errno = 0;
        long w = strtol(p, &end, 10);
        if (errno != 0 || end == p || w < 1 || w > MLP_MAX_WIDTH)
            return -1;
        s.widths[++hidden] = (int)w;
        if (*end == ',') {
            p = end + 1;
            if (*p == '\0')
                return -1; /* trailing comma */
        } else if (*end == '\0') {
            p = end;
        } else {
            return -1;
        }
    }
    s.nlayers = hidden + 1;
    s.widths[s.nlayers] = output;
    *shape = s;
    return 0;
}

size_t mlp_num_params(const mlp_shape_t *shape)
{
    return 2 * (size_t)shape->nlayers;
}

void mlp_param_name(const mlp_shape_t *shape, size_t p, char *buf, size_t len)
{
    assert(p < mlp_num_params(shape));
    if (len == 0)
        return;
    /* snprintf truncates safely; names are at most "fc15.weight". */
    snprintf(buf, len, "fc%zu.%s", p / 2, (p % 2 == 0) ? "weight" : "bias");
}

size_t mlp_param_numel(const mlp_shape_t *shape, size_t p)
{
    assert(p < mlp_num_params(shape));
    size_t l = p / 2;
    size_t rows = (size_t)shape->widths[l + 1];
    return (p % 2 == 0) ? rows * (size_t)shape->widths[l] : rows;
}

size_t mlp_param_rows(const mlp_shape_t *shape, size_t p)
{
    assert(p < mlp_num_params(shape));
    return (size_t)shape->widths[p / 2 + 1];
}

int mlp_param_ndim(const mlp_shape_t *shape, size_t p)
{
    assert(p < mlp_num_params(shape));
    return (p % 2 == 0) ? 2 : 1;
}

/* Entries past ndim are set to 1, so out[0] * out[1] is always the element count. */
void mlp_param_shape(const mlp_shape_t *shape, size_t p, int64_t out[2])
{
    assert(p < mlp_num_params(shape));
    size_t l = p / 2;
    out[0] = shape->widths[l + 1];
    out[1] = (p % 2 == 0) ? shape->widths[l] : 1;
}

/* ---- init -------------------------------------------------------------------------------- */

/* kaiming_uniform_(a=sqrt(5)) gives bound gain*sqrt(3/fan_in) with gain = sqrt(2/(1+5)), which
 * is 1/sqrt(fan_in); torch's Linear bias bound is also 1/sqrt(fan_in). */
void mlp_init_params(const mlp_shape_t *shape, uint64_t seed, float *const *params)
{
    uint64_t base = seed_mix(seed_mix(0, TAG_INIT), seed);
    for (size_t p = 0; p < mlp_num_params(shape); p++) {
        float bound = (float)(1.0 / sqrt((double)shape->widths[p / 2]));
        fill_uniform(seed_mix(base, p), bound, params[p], mlp_param_numel(shape, p));
    }
}

/* ---- forward / backward ------------------------------------------------------------------ */

struct mlp_workspace {
    mlp_shape_t shape;
    int max_batch;
    float *act[MLP_MAX_LAYERS + 1]; /* act[l], l >= 1: output of layer l-1 (after ReLU) */
    float *delta[2];                /* ping-pong d(loss)/d(pre-activation), batch x max width */
    int cur;                        /* which delta holds the current layer's */
};

mlp_workspace_t *mlp_workspace_create(const mlp_shape_t *shape, int max_batch)
{
    if (!shape || shape->nlayers < 1 || shape->nlayers > MLP_MAX_LAYERS || max_batch < 1)
        return NULL;
    mlp_workspace_t *ws = calloc(1, sizeof(*ws));
    if (!ws)
        return NULL;
    ws->shape = *shape;
    ws->max_batch = max_batch;
    size_t max_width = 0;
    for (int l = 0; l <= shape->nlayers; l++)
        if ((size_t)shape->widths[l] > max_width)
            max_width = (size_t)shape->widths[l];
    for (int l = 1; l <= shape->nlayers; l++) {
        ws->act[l] = malloc((size_t)max_batch * (size_t)shape->widths[l] * sizeof(float));
        if (!ws->act[l])
            goto fail;
    }
    for (int i = 0; i < 2; i++) {
        ws->delta[i] = malloc((size_t)max_batch * max_width * sizeof(float));
        if (!ws->delta[i])
            goto fail;
    }
    return ws;
fail:
    mlp_workspace_free(ws);
    return NULL;
}

void mlp_workspace_free(mlp_workspace_t *ws)
{
    if (!ws)
        return;
    for (int l = 0; l <= MLP_MAX_LAYERS; l++)
        free(ws->act[l]);
    free(ws->delta[0]);
    free(ws->delta[1]);
    free(ws);
}

void mlp_layer_forward(const mlp_shape_t *shape, mlp_workspace_t *ws, int l, const float *w,
                       const float *b, const float *x, int batch)
{
    int n_in = shape->widths[l], n_out = shape->widths[l + 1];
    const float *in = l == 0 ? x : ws->act[l];
    float *out = ws->act[l + 1];
    /* Seed every row with the bias, then out += in * W^T in one sgemm. */
    for (int i = 0; i < batch; i++)
        memcpy(out + (size_t)i * n_out, b, (size_t)n_out * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, n_out, n_in, 1.0f, in, n_in, w,
                n_in, 1.0f, out, n_out);
    if (l + 1 < shape->nlayers) {
        size_t n = (size_t)batch * (size_t)n_out;
        for (size_t i = 0; i < n; i++)
            out[i] = out[i] > 0.0f ? out[i] : 0.0f;
    }
}

double mlp_loss(const mlp_shape_t *shape, mlp_workspace_t *ws, const float *y, int batch)
{
    int nl = shape->nlayers;
    size_t n = (size_t)batch * (size_t)shape->widths[nl];
    const float *out = ws->act[nl];
    /* MSE = mean (out - y)^2; its gradient w.r.t. out is 2 (out - y) / n. */
    double sum = 0.0;
    float *delta = ws->delta[0];
    float scale = (float)(2.0 / (double)n);
    for (size_t i = 0; i < n; i++) {
        float diff = out[i] - y[i];
        sum += (double)diff * (double)diff;
        delta[i] = diff * scale;
    }
    ws->cur = 0;
    return sum / (double)n;
}

void mlp_layer_backward(const mlp_shape_t *shape, mlp_workspace_t *ws, int l, const float *w,
                        const float *x, int batch, float *gw, float *gb)
{
    int li = shape->widths[l], lo = shape->widths[l + 1];
    const float *in = (l == 0) ? x : ws->act[l];
    const float *dz = ws->delta[ws->cur];
    /* dW = dZ^T [lo x batch] * in [batch x li] */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, lo, li, batch, 1.0f, dz, lo, in, li, 0.0f,
                gw, li);
    memcpy(gb, dz, (size_t)lo * sizeof(float));
    for (int i = 1; i < batch; i++) {
        const float *row = dz + (size_t)i * lo;
        for (int j = 0; j < lo; j++)
            gb[j] += row[j];
    }
    if (l == 0)
        return; /* the input needs no gradient */
    /* dA = dZ [batch x lo] * W [lo x li], then through the ReLU that produced act[l]. */
    float *da = ws->delta[1 - ws->cur];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, li, lo, 1.0f, dz, lo, w, li, 0.0f,
                da, li);
    const float *a = ws->act[l];
    size_t m = (size_t)batch * (size_t)li;
    for (size_t i = 0; i < m; i++)
        if (!(a[i] > 0.0f))
            da[i] = 0.0f;
    ws->cur = 1 - ws->cur;
}

double mlp_forward_backward(const mlp_shape_t *shape, mlp_workspace_t *ws,
                            const float *const *params, const float *x, const float *y, int batch,
                            float *const *grads)
{
    assert(batch >= 1 && batch <= ws->max_batch);
    assert(shape->nlayers == ws->shape.nlayers);
    if (batch < 1 || batch > ws->max_batch)
        return NAN;
    int nl = shape->nlayers;
    for (int l = 0; l < nl; l++)
        mlp_layer_forward(shape, ws, l, params[2 * l], params[2 * l + 1], x, batch);
    double loss = mlp_loss(shape, ws, y, batch);
    if (!grads)
        return loss;
    for (int l = nl - 1; l >= 0; l--)
        mlp_layer_backward(shape, ws, l, params[2 * l], x, batch, grads[2 * l], grads[2 * l + 1]);
    return loss;
}

int mlp_dump_weights(const char *path, const mlp_shape_t *shape, const float *const *params)
{
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    bool ok = true;
    for (size_t p = 0; p < mlp_num_params(shape) && ok; p++)
        ok = fwrite(params[p], sizeof(float), mlp_param_numel(shape, p), f) ==
             mlp_param_numel(shape, p);
    if (fclose(f) != 0 || !ok) {
        fprintf(stderr, "cannot write %s\n", path);
        return -1;
    }
    return 0;
}

/* ---- task -------------------------------------------------------------------------------- */

struct mlp_task {
    mlp_shape_t shape;
    float *params[2 * MLP_MAX_LAYERS];
    mlp_workspace_t *ws;
};

/* The teacher uses He-uniform weights (variance 2/fan_in) on the ReLU layers and variance
 * 1/fan_in on the last, with zero biases, so for x ~ N(0, 1) each hidden pre-activation has
 * second moment about 2 and every target about 1 (torch's default init would shrink it ~6x per
 * layer and leave almost nothing to learn). */
mlp_task_t *mlp_task_create(const mlp_shape_t *shape, uint64_t task_seed)
{
    if (!shape || shape->nlayers < 1 || shape->nlayers > MLP_MAX_LAYERS)
        return NULL;
    mlp_task_t *task = calloc(1, sizeof(*task));
    if (!task)
        return NULL;
    task->shape = *shape;
    uint64_t base = seed_mix(seed_mix(0, TAG_TEACHER), task_seed);
    for (size_t p = 0; p < mlp_num_params(shape); p++) {
        size_t numel = mlp_param_numel(shape, p);
        task->params[p] = calloc(numel, sizeof(float));
        if (!task->params[p])
            goto fail;
        if (p % 2 == 0) {
            int l = (int)(p / 2);
            double gain2 = (l + 1 < shape->nlayers) ? 2.0 : 1.0;
            float bound = (float)sqrt(3.0 * gain2 / (double)shape->widths[l]);
            fill_uniform(seed_mix(base, p), bound, task->params[p], numel);
        }
    }
    task->ws = mlp_workspace_create(shape, MLP_TASK_CHUNK);
    if (!task->ws)
        goto fail;
    return task;
fail:
    mlp_task_free(task);
    return NULL;
}

void mlp_task_free(mlp_task_t *task)
{
    if (!task)
        return;
    for (size_t p = 0; p < 2 * MLP_MAX_LAYERS; p++)
        free(task->params[p]);
    mlp_workspace_free(task->ws);
    free(task);
}

void mlp_task_batch(mlp_task_t *task, uint64_t data_seed, int rank, int64_t b, int batch, float *x,
                    float *y)
{
    const mlp_shape_t *shape = &task->shape;
    int n_in = shape->widths[0], n_out = shape->widths[shape->nlayers];
    uint64_t h = seed_mix(seed_mix(seed_mix(0, TAG_DATA), data_seed), (uint64_t)(int64_t)rank);
    fill_normal(seed_mix(h, (uint64_t)b), x, (size_t)batch * (size_t)n_in);
    for (int row = 0; row < batch; row += MLP_TASK_CHUNK) {
        int rows = batch - row < MLP_TASK_CHUNK ? batch - row : MLP_TASK_CHUNK;
        for (int l = 0; l < shape->nlayers; l++)
            mlp_layer_forward(shape, task->ws, l, task->params[2 * l], task->params[2 * l + 1],
                              x + (size_t)row * n_in, rows);
        const float *out = task->ws->act[shape->nlayers];
        memcpy(y + (size_t)row * n_out, out, (size_t)rows * (size_t)n_out * sizeof(float));
    }
}
