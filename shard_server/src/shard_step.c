/* The optimizer step and clip_grad_norm on this rank's slices, host or GPU-resident, with each
 * parameter group's hyperparameters (torch.optim's param_groups); the global gradient norms
 * they share; and the Step and ClipGradNorm handlers. Frozen parameters are skipped by all of
 * it: the work runs over the runs of trained parameters (shard_model_next_run), which for a
 * model of one group without frozen parameters is the whole shard in one call, as before
 * groups existed. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/log.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"

#include "shard_cuda.h"
#include "shard_internal.h"

/* Low words of the norms' collective tags (the step number is the high word; gathers and
 * reduce-scatters use parameter indices below 2^31 and 2^31 + index). */
#define TAG_STEP_NORM 0x7fffffffu
#define TAG_CLIP_NORM 0x7ffffffeu

pshard_status_t shard_groups_from_pb(struct Pshard__OptimizerGroup *const *pb, size_t n,
                                     ps_optim_kind_t kind, shard_group_t **out, char *err,
                                     size_t errlen)
{
    *out = NULL;
    if (n == 0)
        return PSHARD_OK;
    if (n > SHARD_MAX_GROUPS)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%zu parameter groups; the limit is %d", n, SHARD_MAX_GROUPS);
    shard_group_t *g = calloc(n, sizeof(*g));
    if (!g)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const Pshard__OptimizerGroup *p = pb[i];
        g[i].cfg = (ps_optim_config_t){.kind = kind,
                                       .lr = p->lr,
                                       .momentum = p->momentum,
                                       .dampening = p->dampening,
                                       .nesterov = p->nesterov,
                                       .weight_decay = p->weight_decay,
                                       .beta1 = p->beta1,
                                       .beta2 = p->beta2,
                                       .eps = p->eps};
        g[i].frozen = p->frozen;
    }
    *out = g;
    return PSHARD_OK;
}

/* ---- this rank's part -------------------------------------------------------------------- */

/* This rank's part of the gradient norm over its trained accumulators: the sum of squares
 * (inf false; in backward, what the reduce-scatters summed) or the largest magnitude. */
static pshard_status_t local_norm(shard_model_t *m, bool inf, double *out, char *err,
                                  size_t errlen)
{
    if (m->in_backward) {
        *out = m->grad_sq;
        return PSHARD_OK;
    }
    double sq = 0.0;
    float top = 0.0f;
    size_t p = 0;
    shard_run_t run;
    while (shard_model_next_run(m, false, &p, &run)) {
        const float *g = m->grad + run.off;
        if (inf) {
            float part = 0.0f;
            if (m->dev)
                PS_CHECK(m->dev->max_abs(m->device, g, run.n, &part, err, errlen));
            else
                part = ps_max_abs(g, run.n);
            float both[2] = {top, part};
            top = ps_max_abs(both, 2);
        } else {
            double part = 0.0;
            if (m->dev)
                PS_CHECK(m->dev->sum_squares(m->device, g, PSHARD_FP32, run.n, false, 1.0f, &part,
                                             err, errlen));
            else
                part = ps_sum_squares(g, run.n);
            sq += part;
        }
    }
    *out = inf ? (double)top : sq;
    return PSHARD_OK;
}

/* The global gradient norm over every rank's trained slices. Norm 2: the square root of the
 * ranks' sums of squares all-reduced in fp32. Inf: the largest of the ranks' maxima, from an
 * all-gather of one float each (the collectives have no max reduction), NaN winning as in
 * torch. Collective: every rank calls it with the same arguments. */
static pshard_status_t global_norm(pshard_comm_t *comm, shard_model_t *m, bool inf,
                                   uint32_t tag_low, const char *what, double *norm, char *err,
                                   size_t errlen)
{
    double local = 0.0;
    PS_CHECK(local_norm(m, inf, &local, err, errlen));
    char label[64];
    shard_op_label(m, what, label, sizeof(label));
    uint64_t tag = ((uint64_t)m->step << 32) | tag_low;
    if (!inf) {
        float sq = (float)local;
        pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_REDUCE, .dtype = PSHARD_FP32,
                                .reduce = PSHARD_REDUCE_SUM, .send = &sq, .recv = &sq,
                                .count = 1, .tag = tag, .label = label};
        PS_CHECK(pshard_coll_run(comm, &a, err, errlen));
        *norm = sqrt((double)sq);
        return PSHARD_OK;
    }
    int world = pshard_comm_world_size(comm);
    float mine = (float)local;
    float *all = calloc((size_t)world, sizeof(float));
    if (!all)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_GATHER, .dtype = PSHARD_FP32, .send = &mine,
                            .recv = all, .count = 1, .tag = tag, .label = label};
    pshard_status_t rc = pshard_coll_run(comm, &a, err, errlen);
    if (rc == PSHARD_OK)
        *norm = (double)ps_max_abs(all, (size_t)world);
    free(all);
    return rc;
}

/* Multiplies the trained accumulators by factor (clipping). */
static pshard_status_t scale_grads(shard_model_t *m, float factor, char *err, size_t errlen)
{
    size_t p = 0;
    shard_run_t run;
    while (shard_model_next_run(m, false, &p, &run)) {
        if (m->dev)
            PS_CHECK(m->dev->scale(m->device, m->grad + run.off, run.n, factor, err, errlen));
        else
            ps_scale(m->grad + run.off, run.n, factor);
    }
    return PSHARD_OK;
}

/* One optimizer update of every trained slice from its accumulator, each run with its group's
 * hyperparameters and, with set_lr, lr instead of the group's (step m->step + 1). */
static pshard_status_t optimize_slices(shard_model_t *m, bool set_lr, double lr, char *err,
                                       size_t errlen)
{
    size_t p = 0;
    shard_run_t run;
    while (shard_model_next_run(m, true, &p, &run)) {
        const ps_optim_config_t *cfg = &m->groups[run.group].cfg;
        double run_lr = set_lr ? lr : cfg->lr;
        float *master = m->master + run.off, *grad = m->grad + run.off;
        float *s0 = m->state0 ? m->state0 + run.off : NULL;
        float *s1 = m->state1 ? m->state1 + run.off : NULL;
        if (m->dev) {
            ps_optim_scalars_t sc;
            ps_optim_step_scalars(cfg, run_lr, m->step + 1, &sc);
            PS_CHECK(m->dev->optim_step(m->device, &sc, master, grad, PSHARD_FP32, false, 1.0f,
                                        s0, s1, run.n, err, errlen));
        } else {
            ps_optim_step(cfg, run_lr, m->step + 1, master, grad, s0, s1, run.n);
        }
    }
    return PSHARD_OK;
}

/* Takes the groups a Step carries (words from the agreement) for this step and the later
 * ones. The active ranks checked them before agreeing; a joined rank checks them here. */
static pshard_status_t take_groups(shard_model_t *m, const shard_sop_t *op, char *err,
                                   size_t errlen)
{
    if (op->nwords == 0)
        return PSHARD_OK;
    size_t n = op->nwords / SHARD_GROUP_WORDS;
    shard_group_t *g = calloc(n ? n : 1, sizeof(*g));
    if (!g)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    shard_groups_decode(op->words, n, m->optim.kind, g);
    pshard_status_t rc = op->nwords % SHARD_GROUP_WORDS
                             ? ps_errf(err, errlen, PSHARD_ERR_DESYNC,
                                       "a step carried %zu group words", op->nwords)
                             : shard_model_check_groups(m, g, n, err, errlen);
    if (rc == PSHARD_OK)
        shard_model_set_groups(m, g);
    free(g);
    return rc;
}

pshard_status_t shard_run_step(pshard_shard_server_t *s, pshard_comm_t *comm, shard_model_t *m,
                               const shard_sop_t *op, int64_t ckpt_request, double *norm_out,
                               char *err, size_t errlen)
{
    PS_CHECK(take_groups(m, op, err, errlen));
    /* The global gradient norm, what the step reports and max_grad_norm clips by. */
    double norm = 0.0;
    PS_CHECK(global_norm(comm, m, false, TAG_STEP_NORM, "grad norm", &norm, err, errlen));
    if (m->in_backward) {
        /* The updates were applied at the reduce-scatters (a parameter without one this step
         * is left alone, as torch skips a None grad); lr is for the next step's. */
        pthread_mutex_lock(&s->mu);
        m->step++;
        pthread_mutex_unlock(&s->mu);
        m->cur_lr_set = op->set_lr;
        m->cur_lr = op->lr;
        m->grad_sq = 0;
        memset(m->reduced, 0, m->nparams);
        *norm_out = norm;
        return shard_ckpt_after_step(s, comm, m, ckpt_request, err, errlen);
    }
    if (m->max_grad_norm > 0) {
        double coef = m->max_grad_norm / (norm + 1e-6);
        if (coef < 1.0)
            PS_CHECK(scale_grads(m, (float)coef, err, errlen));
    }
    PS_CHECK(optimize_slices(m, op->set_lr, op->lr, err, errlen));
    pthread_mutex_lock(&s->mu);
    m->step++;
    pthread_mutex_unlock(&s->mu);
    if (m->dev)
        PS_CHECK(m->dev->zero(m->device, m->grad, m->shard_numel, err, errlen));
    else
        memset(m->grad, 0, m->shard_numel * sizeof(float));
    *norm_out = norm;
    return shard_ckpt_after_step(s, comm, m, ckpt_request, err, errlen);
}

pshard_status_t shard_run_clip(pshard_comm_t *comm, shard_model_t *m, double max_norm,
                               double norm_type, double *total_norm, char *err, size_t errlen)
{
    double norm = 0.0;
    PS_CHECK(global_norm(comm, m, isinf(norm_type), TAG_CLIP_NORM, "clip_grad_norm", &norm, err,
                         errlen));
    float total = (float)norm; /* torch's total_norm is an fp32 tensor */
    if (max_norm > 0) {
        /* torch: clip_coef = max_norm / (total_norm + 1e-6) on fp32 tensors, which Tensor's
         * __rtruediv__ computes as (total_norm + 1e-6).reciprocal() * max_norm, then
         * clamp(max=1.0) and grads *= clip_coef. A coefficient of 1 changes nothing; NaN
         * (a NaN or infinite norm) makes the gradients NaN, as in torch. */
        float denom = total + 1e-6f;
        float coef = (1.0f / denom) * (float)max_norm;
        if (!(coef >= 1.0f))
            PS_CHECK(scale_grads(m, coef, err, errlen));
    }
    *total_norm = (double)total;
    return PSHARD_OK;
}

/* ---- handlers ---------------------------------------------------------------------------- */

/* Runs an agreed step or clip for the handlers below (op_mu held); fails the call or leaves
 * *norm set. */
static bool agree_and_run(pshard_shard_server_t *s, ps_rpc_call_t *call, pshard_comm_t *comm,
                          const shard_sop_t *sop, double *norm)
{
    char err[1024] = "";
    int active = 0;
    int64_t ckpt_request = 0;
    int64_t start_ns = ps_now_ns();
    pshard_status_t rc =
        shard_agree_active(s, comm, sop, &active, &ckpt_request, err, sizeof(err));
    if (rc == PSHARD_OK)
        rc = sop->kind == SHARD_SOP_STEP
                 ? shard_run_step(s, comm, s->model, sop, ckpt_request, norm, err, sizeof(err))
                 : shard_run_clip(comm, s->model, sop->max_norm, sop->norm_type, norm, err,
                                  sizeof(err));
    shard_stats_record(s, sop->kind == SHARD_SOP_STEP ? SHARD_OPK_STEP : SHARD_OPK_CLIP_GRAD_NORM,
                       start_ns, 0, rc == PSHARD_OK);
    if (rc != PSHARD_OK)
        ps_rpc_call_fail(call, rc, "%s", err);
    return rc == PSHARD_OK;
}

/* Checks a Step's lr and groups and encodes the groups into *words (freed by the caller);
 * fails the call otherwise. Nothing has run yet, so every rank refuses alike. */
static bool step_request_ok(ps_rpc_call_t *call, const shard_model_t *m,
                            const Pshard__StepRequest *req, int64_t **words)
{
    *words = NULL;
    if (req->set_lr && req->n_groups > 0) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                         "a step carries either groups (each with its lr) or lr, not both");
        return false;
    }
    if (req->set_lr && (!(req->lr >= 0) || !isfinite(req->lr))) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT, "learning rate %g is not >= 0",
                         req->lr);
        return false;
    }
    if (req->n_groups == 0)
        return true;
    char err[512] = "";
    shard_group_t *g = NULL;
    pshard_status_t rc =
        shard_groups_from_pb(req->groups, req->n_groups, m->optim.kind, &g, err, sizeof(err));
    if (rc == PSHARD_OK)
        rc = shard_model_check_groups(m, g, req->n_groups, err, sizeof(err));
    if (rc == PSHARD_OK) {
        *words = malloc(req->n_groups * SHARD_GROUP_WORDS * sizeof(int64_t));
        if (*words)
            shard_groups_encode(g, req->n_groups, *words);
        else
            rc = ps_errf(err, sizeof(err), PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    free(g);
    if (rc != PSHARD_OK)
        ps_rpc_call_fail(call, rc, "%s", err);
    return rc == PSHARD_OK;
}

void shard_handle_step(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_shard_server_t *s = ctx;
    const Pshard__StepRequest *req = (const Pshard__StepRequest *)request;
    pshard_comm_t *comm = shard_op_begin(s, call, req->session, "no model is defined");
    if (!comm)
        return;
    int64_t *words = NULL;
    double norm = 0;
    if (step_request_ok(call, s->model, req, &words)) {
        shard_sop_t sop = {.kind = SHARD_SOP_STEP,
                           .set_lr = req->set_lr,
                           .lr = req->set_lr ? req->lr : 0.0,
                           .nwords = req->n_groups * SHARD_GROUP_WORDS,
                           .words = words};
        if (agree_and_run(s, call, comm, &sop, &norm)) {
            Pshard__StepResponse out = PSHARD__STEP_RESPONSE__INIT;
            out.step = s->model->step;
            out.grad_norm = norm;
            ps_rpc_call_reply(call, &out.base);
        }
    }
    free(words);
    pthread_mutex_unlock(&s->op_mu);
}

void shard_handle_clip_grad_norm(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_shard_server_t *s = ctx;
    const Pshard__ClipGradNormRequest *req = (const Pshard__ClipGradNormRequest *)request;
    pshard_comm_t *comm = shard_op_begin(s, call, req->session, "no model is defined");
    if (!comm)
        return;
    double norm = 0;
    /* Refused before anything runs, so every rank that asks alike refuses alike. */
    if (s->model->in_backward) {
        ps_rpc_call_fail(call, PSHARD_ERR_FAILED_PRECONDITION,
                         "clip_grad_norm needs the accumulated gradients, but "
                         "optimizer_in_backward applies each update at its reduce-scatter and "
                         "keeps none (turn optimizer_in_backward off to clip)");
    } else if (req->norm_type != 2.0 && !(isinf(req->norm_type) && req->norm_type > 0)) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                         "norm_type %g is not supported: clip_grad_norm takes 2.0 or inf",
                         req->norm_type);
    } else if (!(req->max_norm >= 0)) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                         "max_norm %g must be >= 0 (0 only computes the norm)", req->max_norm);
    } else {
        shard_sop_t sop = {.kind = SHARD_SOP_CLIP, .max_norm = req->max_norm,
                           .norm_type = req->norm_type};
        if (agree_and_run(s, call, comm, &sop, &norm)) {
            Pshard__ClipGradNormResponse out = PSHARD__CLIP_GRAD_NORM_RESPONSE__INIT;
            out.total_norm = norm;
            ps_rpc_call_reply(call, &out.base);
        }
    }
    pthread_mutex_unlock(&s->op_mu);
}
