/* The example MLP trained with pshard; see dist_train.h. */
#include "dist_train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pshard/ckpt.h"
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
    pshard_convert(src, dt, dst, PSHARD_FP32, n);
}

/* Layer l's parameters as fp32 for compute: the gathered buffers themselves in fp32, else
 * converted into the scratch buffers. */
static void layer_params(pshard_client_t *c, int l, pshard_dtype_t dt, float *wtmp, float *btmp,
                         const float **w, const float **b)
{
    size_t iw = (size_t)(2 * l), ib = iw + 1;
    if (dt == PSHARD_FP32) {
        *w = pshard_param(c, iw);
        *b = pshard_param(c, ib);
        return;
    }
    to_f32(pshard_param(c, iw), dt, wtmp, pshard_param_numel(c, iw));
    to_f32(pshard_param(c, ib), dt, btmp, pshard_param_numel(c, ib));
    *w = wtmp;
    *b = btmp;
}

/* One training step, FSDP style, one layer (an FSDP unit: weight and bias) at a time:
 * forward gathers layer l+1 while layer l computes and (FULL_SHARD) frees layer l after it;
 * backward gathers again what was freed, prefetching the layer below, and reduce-scatters
 * each layer's gradients asynchronously as soon as they are written. Returns the batch loss
 * or NAN on a pshard error. */
static pshard_status_t train_step(pshard_client_t *c, const mlp_dist_args_t *da,
                                  mlp_workspace_t *ws, const float *x, const float *y, float *wtmp,
                                  float *btmp, float *gwtmp, float *gbtmp, double *loss_out)
{
    pshard_status_t first = PSHARD_OK;
#define OK(expr)                                                                                   \
    do {                                                                                           \
        if (first == PSHARD_OK)                                                                    \
            first = (expr);                                                                        \
    } while (0)
    const mlp_shape_t *shape = &da->common.shape;
    int nl = shape->nlayers, batch = da->common.batch;
    pshard_work_t *gw[MLP_MAX_LAYERS] = {0}, *rs[MLP_MAX_LAYERS] = {0};
    size_t ids[MLP_MAX_LAYERS][2];
    for (int l = 0; l < nl; l++) {
        ids[l][0] = (size_t)(2 * l);
        ids[l][1] = (size_t)(2 * l + 1);
    }
    OK(pshard_gather_start(c, ids[0], 2, &gw[0]));
    for (int l = 0; l < nl && first == PSHARD_OK; l++) {
        OK(pshard_work_wait(gw[l]));
        gw[l] = NULL;
        if (l + 1 < nl)
            OK(pshard_gather_start(c, ids[l + 1], 2, &gw[l + 1]));
        if (first != PSHARD_OK)
            break;
        const float *w, *b;
        layer_params(c, l, da->param_dtype, wtmp, btmp, &w, &b);
        mlp_layer_forward(shape, ws, l, w, b, x, batch);
        OK(pshard_forward_done(c, ids[l], 2));
    }
    double loss = first == PSHARD_OK ? mlp_loss(shape, ws, y, batch) : NAN;
    OK(pshard_gather_start(c, ids[nl - 1], 2, &gw[nl - 1]));
    for (int l = nl - 1; l >= 0 && first == PSHARD_OK; l--) {
        OK(pshard_work_wait(gw[l]));
        gw[l] = NULL;
        if (l > 0)
            OK(pshard_gather_start(c, ids[l - 1], 2, &gw[l - 1]));
        if (first != PSHARD_OK)
            break;
        const float *w, *b;
        layer_params(c, l, da->param_dtype, wtmp, btmp, &w, &b);
        void *gw_buf = pshard_grad(c, ids[l][0]), *gb_buf = pshard_grad(c, ids[l][1]);
        if (!gw_buf || !gb_buf) {
            first = PSHARD_ERR_NO_MEMORY;
            break;
        }
        bool direct = da->reduce_dtype == PSHARD_FP32;
        mlp_layer_backward(shape, ws, l, w, x, batch, direct ? gw_buf : gwtmp,
                           direct ? gb_buf : gbtmp);
        if (!direct) {
            pshard_convert(gwtmp, PSHARD_FP32, gw_buf, da->reduce_dtype,
                           pshard_param_numel(c, ids[l][0]));
            pshard_convert(gbtmp, PSHARD_FP32, gb_buf, da->reduce_dtype,
                           pshard_param_numel(c, ids[l][1]));
        }
        OK(pshard_reshard(c, ids[l], 2));
        OK(pshard_reduce_scatter_start(c, ids[l], 2, &rs[l]));
    }
    /* Every handle is waited, even after an error, so none is leaked; the status returned is
     * the first error (pshard_last_error may hold a later one's message). */
    for (int l = 0; l < nl; l++) {
        pshard_status_t st;
        if (gw[l] && (st = pshard_work_wait(gw[l])) != PSHARD_OK && first == PSHARD_OK)
            first = st;
        if (rs[l] && (st = pshard_work_wait(rs[l])) != PSHARD_OK && first == PSHARD_OK)
            first = st;
    }
#undef OK
    *loss_out = loss;
    return first;
}

/* Whether --skip-steps leaves out step n (1-based). */
static bool skipped(const mlp_dist_args_t *da, int64_t n)
{
    for (size_t i = 0; i < da->nskip; i++)
        if (da->skip[i] == n)
            return true;
    return false;
}

int mlp_dist_train(const mlp_dist_args_t *da)
{
    const mlp_local_args_t *a = &da->common;
    FILE *out = a->out ? a->out : stdout;
    pshard_client_config_t cfg;
    char err[PSHARD_ERRLEN] = "";
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
    size_t np = mlp_num_params(shape), max_numel = 0;
    for (size_t p = 0; p < np; p++)
        if (mlp_param_numel(shape, p) > max_numel)
            max_numel = mlp_param_numel(shape, p);
    pshard_param_t *params = calloc(np, sizeof(*params));
    int64_t(*shapes)[2] = calloc(np, sizeof(*shapes));
    char(*names)[64] = calloc(np, sizeof(*names));
    float **init = calloc(np, sizeof(float *));
    /* fp32 scratch for one layer: parameters converted from param_dtype, gradients before
     * their conversion to reduce_dtype. */
    float *tmp[4] = {0};
    for (int k = 0; k < 4; k++)
        tmp[k] = malloc(max_numel * sizeof(float));
    float *x = malloc((size_t)a->batch * (size_t)shape->widths[0] * sizeof(float));
    float *y = malloc((size_t)a->batch * (size_t)shape->widths[shape->nlayers] * sizeof(float));
    mlp_workspace_t *ws = mlp_workspace_create(shape, a->batch);
    mlp_task_t *task = mlp_task_create(shape, a->task_seed);
    int rc = 1;
    if (!params || !shapes || !names || !init || !tmp[0] || !tmp[1] || !tmp[2] || !tmp[3] || !x ||
        !y || !ws || !task) {
        fprintf(stderr, "pshard-mlp: out of memory\n");
        goto out;
    }
    for (size_t p = 0; p < np; p++) {
        mlp_param_name(shape, p, names[p], sizeof(names[p]));
        mlp_param_shape(shape, p, shapes[p]);
        params[p] = (pshard_param_t){names[p], mlp_param_ndim(shape, p), shapes[p]};
        if (rank == 0 && !(init[p] = calloc(mlp_param_numel(shape, p), sizeof(float)))) {
            fprintf(stderr, "pshard-mlp: out of memory\n");
            goto out;
        }
    }
    /* Rank 0's initial values are the model's (sync_module_states); they match --local's.
     * --init-from imports them from a safetensors file instead (e.g. a full export). */
    if (rank == 0)
        mlp_init_params(shape, a->seed, init);
    if (rank == 0 && da->init_from) {
        for (size_t p = 0; p < np; p++) {
            char e[512] = "";
            if (ps_safetensors_read(da->init_from, names[p], params[p].ndim, params[p].shape,
                                    init[p], e, sizeof(e)) != PSHARD_OK) {
                fprintf(stderr, "pshard-mlp: --init-from %s: %s\n", da->init_from, e);
                rc = 2;
                goto out;
            }
        }
    }
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
    mc.reshard_after_forward = da->reshard_after_forward;
    mc.max_gathers_in_flight = da->max_gathers_in_flight;
    mc.optimizer_in_backward = da->optimizer_in_backward;
    if (pshard_define_model(c, params, np, &mc, rank == 0 ? (const float *const *)init : NULL) !=
        PSHARD_OK) {
        fprintf(stderr, "pshard-mlp: rank %d: %s\n", rank, pshard_last_error(c));
        goto out;
    }
    for (size_t p = 0; p < np; p++) {
        free(init[p]);
        init[p] = NULL;
    }
    /* With --uneven rank r has steps + r batches, then joins (PyTorch's Join): the last rank
     * has the most steps, so it prints the loss lines. */
    int64_t my_steps = a->steps + (a->uneven ? rank : 0);
    int printer = a->uneven ? world - 1 : 0;
    int64_t t0 = 0, done_steps = 0;
    /* After --resume the servers hold the checkpoint's step: the data continues from there; a
     * replacement trainer's continues after the steps applied and aborted so far. */
    int64_t first = pshard_resume_step(c);
    if (first > 0 && rank == printer)
        fprintf(out, "resumed at step %lld\n", (long long)first);
    if (first > 0)
        fprintf(stderr, "pshard-mlp: rank %d: resuming at step %lld\n", rank, (long long)first + 1);
    const char *attempt = getenv("PSHARD_RESTART_COUNT");
    bool first_attempt = !attempt || !*attempt || strcmp(attempt, "0") == 0;
    for (int64_t s = first; s < my_steps; s++) {
        if (s == first + 1)
            t0 = ps_now_ns(); /* the first step includes connection warm-up */
        if (da->fail_at_step == s + 1 && rank == da->fail_rank && first_attempt) {
            fprintf(stderr, "pshard-mlp: rank %d: exiting before step %lld (--fail-at-step)\n",
                    rank, (long long)s + 1);
            fflush(out);
            _exit(3); /* like a crash: no goodbye to the shard server */
        }
        if (skipped(da, s + 1))
            continue;
        mlp_task_batch(task, a->data_seed, rank, s, a->batch, x, y);
        if (da->sleep_ms_per_step > 0 && (da->sleep_rank < 0 || da->sleep_rank == rank)) {
            /* A straggler (pshardctl status names it): time outside pshard, like slow data. */
            struct timespec ts = {da->sleep_ms_per_step / 1000,
                                  (da->sleep_ms_per_step % 1000) * 1000000L};
            while (nanosleep(&ts, &ts) != 0)
                ;
        }
        double l = NAN;
        pshard_status_t st = train_step(c, da, ws, x, y, tmp[0], tmp[1], tmp[2], tmp[3], &l);
        if (st == PSHARD_OK)
            st = pshard_step(c, -1, NULL, NULL);
        bool stepped = st == PSHARD_OK;
        float loss = (float)l;
        if (st == PSHARD_OK)
            st = pshard_all_reduce(c, &loss, 1, PSHARD_FP32, true);
        if (st == PSHARD_ERR_STEP_ABORTED) {
            /* A trainer of the job was lost: this step (or, when the optimizer step went
             * through, the next one, whose loss all-reduce it was) is not applied on any rank.
             * Go on where the servers say, as the replacement will. */
            char why[PSHARD_ERRLEN];
            snprintf(why, sizeof(why), "%s", pshard_last_error(c));
            int64_t next = 0;
            if (pshard_resync(c, &next) != PSHARD_OK)
                goto pshard_error;
            for (int64_t k = s + (stepped ? 1 : 0); k < next; k++)
                fprintf(stderr, "pshard-mlp: rank %d: step %lld aborted: %s\n", rank,
                        (long long)k + 1, why);
            fprintf(stderr, "pshard-mlp: rank %d: going on at step %lld\n", rank,
                    (long long)next + 1);
            done_steps += stepped;
            s = next - 1;
            continue;
        }
        if (st == PSHARD_ERR_JOINED && da->join_throw) {
            /* Another rank ran out with throw_on_early_termination: stop and join too. */
            fprintf(stderr, "pshard-mlp: rank %d: stopping at step %lld: %s\n", rank,
                    (long long)s + 1, pshard_last_error(c));
            break;
        }
        if (st != PSHARD_OK)
            goto pshard_error;
        if (!isfinite(loss)) {
            /* Every rank has the same mean, so all stop here: nothing goes on training (and
             * exits 0) on weights that are no longer numbers. */
            fprintf(stderr,
                    "pshard-mlp: rank %d: the mean loss is %g at step %lld: training diverged "
                    "(is --lr too high?) or its data was corrupted; stopping\n",
                    rank, (double)loss, (long long)s + 1);
            goto out;
        }
        done_steps++;
        int64_t n = s + 1;
        bool print = a->print_every > 0 && (n == 1 || n % a->print_every == 0 || n == my_steps);
        if (rank == printer && print) {
            fprintf(out, "step %lld loss %.9g\n", (long long)n, (double)loss);
            fflush(out); /* progress as it happens, also into a file or a pipe */
        }
    }
    if (a->uneven && da->join_mid_step && done_steps == my_steps - first) {
        /* One more step begun and abandoned: its first layer gathered (with the others' same
         * gather), then the join; that step is averaged over the others. */
        static const size_t layer0[2] = {0, 1};
        if (pshard_gather(c, layer0, 2) != PSHARD_OK)
            goto pshard_error;
    }
    if (a->uneven) {
        pshard_join_options_t jo;
        pshard_join_options_default(&jo);
        jo.enable = da->join_enable;
        jo.throw_on_early_termination = da->join_throw;
        pshard_join_result_t jr;
        if (pshard_join(c, &jo, &jr) != PSHARD_OK)
            goto pshard_error;
        fprintf(out,
                "rank %d joined after %lld steps: %s (last rank to join: %d, %llu "
                "operations shadowed for the others)\n",
                rank, (long long)done_steps, jr.is_last_joiner ? "last joiner" : "not last",
                jr.last_rank, (unsigned long long)jr.shadowed_ops);
    }
    int64_t timed = done_steps - 1;
    if (da->checkpoint_at_end) {
        int64_t cstep = 0;
        char cdir[4096] = "";
        if (pshard_checkpoint_save(c, &cstep, cdir, sizeof(cdir)) != PSHARD_OK)
            goto pshard_error;
        if (rank == 0)
            fprintf(out, "checkpoint: step %lld in %s\n", (long long)cstep, cdir);
    }
    double ms = timed > 0 ? (double)(ps_now_ns() - t0) / 1e6 / (double)timed : 0;
    pshard_memory_stats_t mem;
    pshard_memory_stats(c, &mem);
    double checksum = 0;
    FILE *dump = rank == 0 && a->dump_weights ? fopen(a->dump_weights, "wb") : NULL;
    if (rank == 0 && a->dump_weights && !dump) {
        fprintf(stderr, "pshard-mlp: cannot write %s\n", a->dump_weights);
        goto out;
    }
    /* One parameter at a time (gather, read, reshard), so the checksum holds no more than
     * training did, like summon_full_params on one module after another. */
    for (size_t p = 0; p < np; p++) {
        size_t n = mlp_param_numel(shape, p);
        if (pshard_gather(c, &p, 1) != PSHARD_OK)
            goto pshard_error;
        to_f32(pshard_param(c, p), da->param_dtype, tmp[0], n);
        if (pshard_reshard(c, &p, 1) != PSHARD_OK)
            goto pshard_error;
        for (size_t i = 0; i < n; i++)
            checksum += tmp[0][i];
        if (dump && fwrite(tmp[0], sizeof(float), n, dump) != n) {
            fclose(dump);
            fprintf(stderr, "pshard-mlp: cannot write %s\n", a->dump_weights);
            goto out;
        }
    }
    if (dump && fclose(dump) != 0) {
        fprintf(stderr, "pshard-mlp: cannot write %s\n", a->dump_weights);
        goto out;
    }
    if (rank == 0) {
        fprintf(out, "final checksum %.17g\n", checksum);
        if (timed > 0 && !a->uneven)
            fprintf(out, "throughput %.1f samples/s, %.2f ms/step (%d ranks x batch %d)\n",
                    (double)world * a->batch * 1000.0 / ms, ms, world, a->batch);
        fprintf(out,
                "memory: at most %.2f MiB of full parameters and gradients held at once (%s, "
                "%llu parameter gathers skipped)\n",
                (double)mem.peak_in_use_bytes / 1048576.0,
                da->reshard_after_forward ? "FULL_SHARD" : "SHARD_GRAD_OP",
                (unsigned long long)mem.params_skipped);
    }
    rc = 0;
    goto out;
pshard_error:
    fprintf(stderr, "pshard-mlp: rank %d: %s\n", rank, pshard_last_error(c));
    rc = 1;
out:
    if (init)
        for (size_t p = 0; p < np; p++)
            free(init[p]);
    free(init);
    for (int k = 0; k < 4; k++)
        free(tmp[k]);
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
