/* The example MLP trained with pshard; see dist_train.h. */
#include "dist_train.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/log.h"
#include "pshard/pshard.h"
#include "pshard/util.h"

static pshard_optimizer_t optimizer_of(ps_optim_kind_t k)
{
    return k == PS_OPTIM_ADAM ? PSHARD_ADAM : k == PS_OPTIM_ADAMW ? PSHARD_ADAMW : PSHARD_SGD;
}

/* Copies a gathered parameter (param dtype) into fp32 for compute. */
static void to_f32(const void *src, pshard_dtype_t dt, float *dst, size_t n)
{
    if (dt == PSHARD_FP32)
        memcpy(dst, src, n * sizeof(float));
    else if (dt == PSHARD_BF16)
        ps_convert_bf16_to_f32(src, dst, n);
    else
        ps_convert_f16_to_f32(src, dst, n);
}

int mlp_dist_train(const mlp_dist_args_t *da)
{
    const mlp_local_args_t *a = &da->common;
    if (a->uneven) {
        fprintf(stderr, "pshard-mlp: --uneven needs Join support in the shard servers, which is "
                        "not built yet; use --local --uneven for the reference\n");
        return 2;
    }
    FILE *out = a->out ? a->out : stdout;
    pshard_client_config_t cfg;
    char err[1024] = "";
    if (pshard_client_config_from_env(&cfg, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "pshard-mlp: %s\n", err);
        return 2;
    }
    pshard_client_t *c = NULL;
    if (pshard_connect(&cfg, &c, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "pshard-mlp: %s\n", err);
        return 1;
    }
    int rank = pshard_rank(c), world = pshard_world_size(c);
    const mlp_shape_t *shape = &a->shape;
    size_t np = mlp_num_params(shape);
    pshard_param_t *params = calloc(np, sizeof(*params));
    int64_t(*shapes)[2] = calloc(np, sizeof(*shapes));
    char(*names)[64] = calloc(np, sizeof(*names));
    float **w = calloc(np, sizeof(float *)), **g = calloc(np, sizeof(float *));
    float *x = malloc((size_t)a->batch * (size_t)shape->widths[0] * sizeof(float));
    float *y = malloc((size_t)a->batch * (size_t)shape->widths[shape->nlayers] * sizeof(float));
    mlp_workspace_t *ws = mlp_workspace_create(shape, a->batch);
    mlp_task_t *task = mlp_task_create(shape, a->task_seed);
    int rc = 1;
    if (!params || !shapes || !names || !w || !g || !x || !y || !ws || !task) {
        fprintf(stderr, "pshard-mlp: out of memory\n");
        goto out;
    }
    for (size_t p = 0; p < np; p++) {
        mlp_param_name(shape, p, names[p], sizeof(names[p]));
        mlp_param_shape(shape, p, shapes[p]);
        params[p] = (pshard_param_t){names[p], mlp_param_ndim(shape, p), shapes[p]};
        w[p] = calloc(mlp_param_numel(shape, p), sizeof(float));
        g[p] = calloc(mlp_param_numel(shape, p), sizeof(float));
        if (!w[p] || !g[p]) {
            fprintf(stderr, "pshard-mlp: out of memory\n");
            goto out;
        }
    }
    /* Rank 0's initial values are the model's (sync_module_states); they match --local's. */
    mlp_init_params(shape, a->seed, w);
    pshard_model_config_t mc;
    pshard_model_config_default(&mc, optimizer_of(a->optim.kind));
    mc.layout = da->layout;
    mc.param_dtype = da->param_dtype;
    mc.reduce_dtype = da->reduce_dtype;
    mc.lr = a->optim.lr;
    mc.momentum = a->optim.momentum;
    mc.dampening = a->optim.dampening;
    mc.nesterov = a->optim.nesterov;
    mc.weight_decay = a->optim.weight_decay;
    mc.beta1 = a->optim.beta1;
    mc.beta2 = a->optim.beta2;
    mc.eps = a->optim.eps;
    mc.max_grad_norm = a->max_grad_norm;
    mc.init_from_rank0 = true;
    if (pshard_define_model(c, params, np, &mc, rank == 0 ? (const float *const *)w : NULL) !=
        PSHARD_OK) {
        fprintf(stderr, "pshard-mlp: rank %d: %s\n", rank, pshard_last_error(c));
        goto out;
    }
    int64_t t0 = 0;
    for (int64_t s = 0; s < a->steps; s++) {
        if (s == 1)
            t0 = ps_now_ns(); /* the first step includes connection warm-up */
        if (pshard_gather(c, NULL, 0) != PSHARD_OK)
            goto pshard_error;
        for (size_t p = 0; p < np; p++)
            to_f32(pshard_param(c, p), da->param_dtype, w[p], mlp_param_numel(shape, p));
        mlp_task_batch(task, a->data_seed, rank, s, a->batch, x, y);
        float loss = (float)mlp_forward_backward(shape, ws, (const float *const *)w, x, y,
                                                 a->batch, g);
        for (size_t p = 0; p < np; p++) {
            void *dst = pshard_grad(c, p);
            size_t n = mlp_param_numel(shape, p);
            if (da->reduce_dtype == PSHARD_FP32)
                memcpy(dst, g[p], n * sizeof(float));
            else
                ps_convert_f32_to_bf16(g[p], dst, n);
        }
        if (pshard_reduce_scatter(c, NULL, 0) != PSHARD_OK)
            goto pshard_error;
        if (pshard_step(c, -1, NULL, NULL) != PSHARD_OK)
            goto pshard_error;
        if (pshard_all_reduce(c, &loss, 1, PSHARD_FP32, true) != PSHARD_OK)
            goto pshard_error;
        int64_t n = s + 1;
        bool print = a->print_every > 0 &&
                     (n == 1 || n % a->print_every == 0 || n == a->steps);
        if (rank == 0 && print)
            fprintf(out, "step %lld loss %.9g\n", (long long)n, (double)loss);
    }
    double ms = a->steps > 1 ? (double)(ps_now_ns() - t0) / 1e6 / (double)(a->steps - 1) : 0;
    if (pshard_gather(c, NULL, 0) != PSHARD_OK)
        goto pshard_error;
    double checksum = 0;
    for (size_t p = 0; p < np; p++) {
        to_f32(pshard_param(c, p), da->param_dtype, w[p], mlp_param_numel(shape, p));
        for (size_t i = 0; i < mlp_param_numel(shape, p); i++)
            checksum += w[p][i];
    }
    if (rank == 0) {
        fprintf(out, "final checksum %.17g\n", checksum);
        if (a->steps > 1)
            fprintf(out, "throughput %.1f samples/s, %.2f ms/step (%d ranks x batch %d)\n",
                    (double)world * a->batch * 1000.0 / ms, ms, world, a->batch);
    }
    rc = 0;
    goto out;
pshard_error:
    fprintf(stderr, "pshard-mlp: rank %d: %s\n", rank, pshard_last_error(c));
    rc = 1;
out:
    if (w)
        for (size_t p = 0; p < np; p++)
            free(w[p]);
    if (g)
        for (size_t p = 0; p < np; p++)
            free(g[p]);
    free(w);
    free(g);
    free(params);
    free(shapes);
    free(names);
    free(x);
    free(y);
    mlp_workspace_free(ws);
    mlp_task_free(task);
    pshard_close(c);
    return rc;
}
