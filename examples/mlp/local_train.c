/* The --local reference trainer of pshard-mlp: one process plays every rank, averages their
 * gradients, clips and applies the shard server's optimizer kernels to whole parameters. */
#include "local_train.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/log.h"
#include "pshard/util.h"

#define MLP_MAX_PARAMS (2 * MLP_MAX_LAYERS)

/* Everything one run owns; freed by local_free. */
typedef struct {
    size_t nparams;
    size_t numel[MLP_MAX_PARAMS];
    float *param[MLP_MAX_PARAMS];
    float *grad[MLP_MAX_PARAMS];      /* the average over contributing ranks */
    float *rank_grad[MLP_MAX_PARAMS]; /* one rank's gradient, added into grad */
    float *state0[MLP_MAX_PARAMS];
    float *state1[MLP_MAX_PARAMS];
    float *x, *y;
    mlp_workspace_t *ws;
    mlp_task_t *task;
} local_run_t;

static void local_free(local_run_t *run)
{
    for (size_t p = 0; p < MLP_MAX_PARAMS; p++) {
        free(run->param[p]);
        free(run->grad[p]);
        free(run->rank_grad[p]);
        free(run->state0[p]);
        free(run->state1[p]);
    }
    free(run->x);
    free(run->y);
    mlp_workspace_free(run->ws);
    mlp_task_free(run->task);
}

/* Returns 0 or -1 when memory ran out (the caller frees what was allocated). */
static int local_alloc(local_run_t *run, const mlp_local_args_t *a)
{
    const mlp_shape_t *shape = &a->shape;
    int nstate = ps_optim_state_count(&a->optim);
    run->nparams = mlp_num_params(shape);
    for (size_t p = 0; p < run->nparams; p++) {
        size_t n = mlp_param_numel(shape, p);
        run->numel[p] = n;
        run->param[p] = malloc(n * sizeof(float));
        run->grad[p] = malloc(n * sizeof(float));
        if (!run->param[p] || !run->grad[p])
            return -1;
        if (a->world > 1 && !(run->rank_grad[p] = malloc(n * sizeof(float))))
            return -1;
        if (nstate >= 1 && !(run->state0[p] = calloc(n, sizeof(float))))
            return -1;
        if (nstate >= 2 && !(run->state1[p] = calloc(n, sizeof(float))))
            return -1;
    }
    run->x = malloc((size_t)a->batch * (size_t)shape->widths[0] * sizeof(float));
    run->y = malloc((size_t)a->batch * (size_t)shape->widths[shape->nlayers] * sizeof(float));
    run->ws = mlp_workspace_create(shape, a->batch);
    run->task = mlp_task_create(shape, a->task_seed);
    if (!run->x || !run->y || !run->ws || !run->task)
        return -1;
    return 0;
}

/* Checks the arguments; returns 0 or -1 after printing why on stderr. */
static int local_validate(const mlp_local_args_t *a)
{
    const mlp_shape_t *s = &a->shape;
    char err[PSHARD_ERRLEN] = "";
    if (s->nlayers < 1 || s->nlayers > MLP_MAX_LAYERS) {
        fprintf(stderr, "mlp_local_train: %d layers (need 1..%d)\n", s->nlayers, MLP_MAX_LAYERS);
        return -1;
    }
    for (int l = 0; l <= s->nlayers; l++) {
        if (s->widths[l] < 1) {
            fprintf(stderr, "mlp_local_train: width %d of layer boundary %d\n", s->widths[l], l);
            return -1;
        }
    }
    if (a->batch < 1 || a->steps < 0 || a->world < 1 || a->print_every < 0 ||
        !(a->max_grad_norm >= 0.0)) {
        fprintf(stderr,
                "mlp_local_train: bad batch %d, steps %lld, world %d, print_every %lld or "
                "max_grad_norm %g\n",
                a->batch, (long long)a->steps, a->world, (long long)a->print_every,
                a->max_grad_norm);
        return -1;
    }
    if (ps_optim_validate(&a->optim, err, sizeof(err)) != 0) {
        fprintf(stderr, "mlp_local_train: %s\n", err);
        return -1;
    }
    return 0;
}

/* clip_grad_norm_: scales every gradient by max_norm / (total_norm + 1e-6) when that is < 1. */
static void clip_grads(local_run_t *run, double max_norm)
{
    double sq = 0.0;
    for (size_t p = 0; p < run->nparams; p++)
        sq += ps_sum_squares(run->grad[p], run->numel[p]);
    double coef = max_norm / (sqrt(sq) + 1e-6);
    if (coef < 1.0)
        for (size_t p = 0; p < run->nparams; p++)
            ps_scale(run->grad[p], run->numel[p], (float)coef);
}

/* Runs one step s: every contributing rank's gradient averaged into run->grad. Returns the
 * mean loss of the contributing ranks. */
static double local_grads(local_run_t *run, const mlp_local_args_t *a, int64_t s)
{
    const float *const *params = (const float *const *)run->param;
    int contributors = 0;
    double loss_sum = 0.0;
    for (int r = 0; r < a->world; r++) {
        if (s >= a->steps + (a->uneven ? r : 0))
            continue;
        mlp_task_batch(run->task, a->data_seed, r, s, a->batch, run->x, run->y);
        /* The first contributor writes the sum directly; later ones add theirs. */
        float *const *dst = contributors == 0 ? run->grad : run->rank_grad;
        loss_sum += mlp_forward_backward(&a->shape, run->ws, params, run->x, run->y, a->batch, dst);
        if (contributors > 0) {
            for (size_t p = 0; p < run->nparams; p++) {
                float *g = run->grad[p];
                const float *rg = run->rank_grad[p];
                for (size_t i = 0; i < run->numel[p]; i++)
                    g[i] += rg[i];
            }
        }
        contributors++;
    }
    if (contributors > 1)
        for (size_t p = 0; p < run->nparams; p++)
            ps_scale(run->grad[p], run->numel[p], (float)(1.0 / contributors));
    return loss_sum / contributors;
}

int mlp_local_train(const mlp_local_args_t *a)
{
    if (local_validate(a) != 0)
        return 2;
    FILE *out = a->out ? a->out : stdout;
    local_run_t run;
    memset(&run, 0, sizeof(run));
    int rc = 0;
    if (local_alloc(&run, a) != 0) {
        fprintf(stderr, "mlp_local_train: out of memory\n");
        rc = 1;
        goto out;
    }
    mlp_init_params(&a->shape, a->seed, run.param);

    int64_t total = a->steps + (a->uneven ? a->world - 1 : 0);
    int64_t start_ns = ps_now_ns();
    for (int64_t s = 0; s < total; s++) {
        double loss = local_grads(&run, a, s);
        if (a->max_grad_norm > 0.0)
            clip_grads(&run, a->max_grad_norm);
        for (size_t p = 0; p < run.nparams; p++)
            ps_optim_step(&a->optim, a->optim.lr, s + 1, run.param[p], run.grad[p], run.state0[p],
                          run.state1[p], run.numel[p]);
        if (a->losses)
            a->losses[s] = loss;
        if (a->print_every > 0 && (s == 0 || (s + 1) % a->print_every == 0 || s + 1 == total))
            fprintf(out, "step %lld loss %.9g\n", (long long)(s + 1), loss);
    }
    int64_t elapsed_ns = ps_now_ns() - start_ns;
    PS_INFO(PS_SUB_MAIN, "local: %lld steps in %.3f ms (%.3f ms/step)", (long long)total,
            elapsed_ns / 1e6, total > 0 ? elapsed_ns / 1e6 / (double)total : 0.0);

    double checksum = 0.0;
    for (size_t p = 0; p < run.nparams; p++) {
        for (size_t i = 0; i < run.numel[p]; i++)
            checksum += run.param[p][i];
        if (a->params_out)
            memcpy(a->params_out[p], run.param[p], run.numel[p] * sizeof(float));
    }
    fprintf(out, "final checksum %.17g\n", checksum);
    fflush(out);
    if (a->dump_weights &&
        mlp_dump_weights(a->dump_weights, &a->shape, (const float *const *)run.param) != 0)
        rc = 1;
out:
    local_free(&run);
    return rc;
}
