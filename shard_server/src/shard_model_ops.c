/* The numerics of a defined model on this rank's slices (conversions for a gather, accumulation
 * or the in-backward update after a reduce-scatter, norms, clipping, the optimizer step), host or
 * GPU-resident, with the runs of the shard, the step counts and a Step's groups; see shard_model.h.
 * No collectives here: the operations that run them are shard_ops.c's. */
#include "shard_model.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/util.h"
#include "shard_cuda.h"

bool shard_model_next_run(const shard_model_t *m, bool by_group, size_t *p, shard_run_t *run)
{
    size_t i = *p;
    while (i < m->nparams &&
           (ps_layout_counts(m->layout, i)[m->rank] == 0 || m->groups[m->param_group[i]].frozen))
        i++;
    if (i >= m->nparams) {
        *p = i;
        return false;
    }
    run->group = m->param_group[i];
    run->off = ps_layout_shard_offset(m->layout, i, m->rank);
    size_t end = run->off + ps_layout_counts(m->layout, i)[m->rank];
    for (i++; i < m->nparams; i++) {
        size_t cnt = ps_layout_counts(m->layout, i)[m->rank];
        if (cnt == 0)
            continue;
        uint32_t g = m->param_group[i];
        if (m->groups[g].frozen || (by_group && g != run->group))
            break;
        /* A rank's pieces lie back to back in parameter order (layout.h). */
        assert(ps_layout_shard_offset(m->layout, i, m->rank) == end);
        end += cnt;
    }
    run->n = end - run->off;
    *p = i;
    return true;
}

void shard_groups_encode(const shard_group_t *groups, size_t n, int64_t *words)
{
    for (size_t g = 0; g < n; g++) {
        const ps_optim_config_t *c = &groups[g].cfg;
        int64_t *w = words + g * SHARD_GROUP_WORDS;
        w[0] = shard_double_word(c->lr);
        w[1] = shard_double_word(c->momentum);
        w[2] = shard_double_word(c->dampening);
        w[3] = shard_double_word(c->weight_decay);
        w[4] = shard_double_word(c->beta1);
        w[5] = shard_double_word(c->beta2);
        w[6] = shard_double_word(c->eps);
        w[7] = c->nesterov;
        w[8] = groups[g].frozen;
    }
}

void shard_groups_decode(const int64_t *words, size_t n, ps_optim_kind_t kind,
                         shard_group_t *groups)
{
    for (size_t g = 0; g < n; g++) {
        const int64_t *w = words + g * SHARD_GROUP_WORDS;
        ps_optim_config_t *c = &groups[g].cfg;
        c->kind = kind;
        c->lr = shard_word_double(w[0]);
        c->momentum = shard_word_double(w[1]);
        c->dampening = shard_word_double(w[2]);
        c->weight_decay = shard_word_double(w[3]);
        c->beta1 = shard_word_double(w[4]);
        c->beta2 = shard_word_double(w[5]);
        c->eps = shard_word_double(w[6]);
        c->nesterov = w[7] != 0;
        groups[g].frozen = w[8] != 0;
    }
}

void *shard_model_unit_stage(shard_model_t *m, size_t bytes)
{
    if (bytes > m->unit_stage_bytes) {
        void *p = shard_model_alloc_touched(bytes);
        if (!p)
            return NULL;
        shard_model_free_touched(m->unit_stage, m->unit_stage_bytes);
        m->unit_stage = p;
        m->unit_stage_bytes = bytes;
    }
    return m->unit_stage;
}

/* This rank's slice of parameter p in dt for a gather: the master weights themselves in
 * fp32, else converted into the staging buffer (on the device for GPU-resident shards). */
pshard_status_t shard_model_slice_in(shard_model_t *m, uint32_t p, pshard_dtype_t dt, void *stage,
                                     const void **out, char *err, size_t errlen)
{
    const float *mine = m->master + ps_layout_shard_offset(m->layout, p, m->rank);
    size_t cnt = ps_layout_counts(m->layout, p)[m->rank];
    *out = mine;
    if (m->dev && dt != PSHARD_FP32) {
        PS_CHECK(m->dev->convert(m->device, mine, m->stage, dt, cnt, err, errlen));
        *out = m->stage;
    } else if (dt == PSHARD_BF16) {
        ps_convert_f32_to_bf16(mine, stage, cnt);
        *out = stage;
    } else if (dt == PSHARD_FP16) {
        ps_convert_f32_to_f16(mine, stage, cnt);
        *out = stage;
    }
    return PSHARD_OK;
}

/* GPU-resident shards: what shard_model_slice_out does on the host,
 * with the reduced slice in m->stage on the device; the same operations in the same order. */
static pshard_status_t reduce_on_device(shard_model_t *m, uint32_t p, pshard_dtype_t dt, size_t cnt,
                                        size_t off, bool all, float scale,
                                        const ps_optim_config_t *cfg, double lr, char *err,
                                        size_t errlen)
{
    if (m->in_backward) {
        bool scaled = !all || dt != PSHARD_FP32;
        double sq = 0;
        PS_CHECK(
            m->dev->sum_squares(m->device, m->stage, dt, cnt, scaled, scale, &sq, err, errlen));
        m->grad_sq += sq;
        ps_optim_scalars_t sc;
        ps_optim_step_scalars(cfg, lr, shard_model_pstep(m, p) + 1, &sc);
        PS_CHECK(m->dev->optim_step(m->device, &sc, m->master + off, m->stage, dt, scaled, scale,
                                    m->state0 ? m->state0 + off : NULL,
                                    m->state1 ? m->state1 + off : NULL, cnt, err, errlen));
        m->reduced[p] = 1;
        return PSHARD_OK;
    }
    bool scaled = dt != PSHARD_FP32 || !all;
    return m->dev->accumulate(m->device, m->grad + off, m->stage, dt, cnt, scaled, scale, err,
                              errlen);
}

/* After parameter p's reduce-scatter in dt, with this rank's reduced slice in the staging
 * buffer (an average over all ranks when active == world, else a sum over the active ones):
 * adds it, averaged over the active ranks, to the accumulator, or with optimizer_in_backward
 * applies the update at once. */
pshard_status_t shard_model_slice_out(shard_model_t *m, uint32_t p, pshard_dtype_t dt, int active,
                                      void *stage, char *err, size_t errlen)
{
    size_t cnt = ps_layout_counts(m->layout, p)[m->rank];
    size_t off = ps_layout_shard_offset(m->layout, p, m->rank);
    bool all = active == m->world && m->replicas == 1; /* the collective averaged */
    float scale = all ? 1.0f : (float)(1.0 / (double)(active > 0 ? active : 1));
    /* In backward: the parameter's group's hyperparameters, and the lr of the last Step if it
     * set one. */
    const ps_optim_config_t *cfg = &m->groups[m->param_group[p]].cfg;
    double lr = m->cur_lr_set ? m->cur_lr : cfg->lr;
    if (m->dev)
        return reduce_on_device(m, p, dt, cnt, off, all, scale, cfg, lr, err, errlen);
    if (m->in_backward) {
        /* The averaged slice, in fp32 in the staging buffer (bf16 widened in place, from the
         * end, so no element is overwritten before it is read), updates the slice now. */
        float *r = stage;
        if (dt != PSHARD_FP32) {
            const uint16_t *r16 = stage;
            for (size_t k = cnt; k-- > 0;)
                r[k] = ps_bf16_to_f32(r16[k]);
        }
        if (!all || dt != PSHARD_FP32)
            for (size_t k = 0; k < cnt; k++)
                r[k] *= scale;
        m->grad_sq += ps_sum_squares(r, cnt);
        ps_optim_step(cfg, lr, shard_model_pstep(m, p) + 1, m->master + off, r,
                      m->state0 ? m->state0 + off : NULL, m->state1 ? m->state1 + off : NULL, cnt);
        m->reduced[p] = 1;
        return PSHARD_OK;
    }
    float *g = m->grad + off;
    if (dt == PSHARD_FP32) {
        const float *r = stage;
        if (all)
            for (size_t k = 0; k < cnt; k++)
                g[k] += r[k];
        else
            for (size_t k = 0; k < cnt; k++)
                g[k] += r[k] * scale;
    } else {
        const uint16_t *r = stage;
        for (size_t k = 0; k < cnt; k++)
            g[k] += ps_bf16_to_f32(r[k]) * scale;
    }
    return PSHARD_OK;
}

/* This rank's part of the gradient norm over its trained accumulators: the sum of squares
 * (inf false; in backward, what the reduce-scatters summed) or the largest magnitude. */
pshard_status_t shard_model_local_norm(shard_model_t *m, bool inf, double *out, char *err,
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

/* Multiplies the trained accumulators by factor (clipping). */
pshard_status_t shard_model_scale_grads(shard_model_t *m, float factor, char *err, size_t errlen)
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

size_t shard_model_skip_words(const shard_model_t *m)
{
    return (m->nparams + 63) / 64;
}

void shard_model_set_step(shard_model_t *m, int64_t step)
{
    m->step = step;
    for (size_t p = 0; p < m->nparams; p++)
        m->psteps[p] = step;
}

int64_t shard_model_pstep(const shard_model_t *m, size_t p)
{
    int64_t v = m->psteps[p];
    return v < 0 ? 0 : v > m->step ? m->step : v;
}

/* Parameter p is updated in this step: trained, and not in the skip mask. */
static bool updated(const shard_model_t *m, const uint64_t *skip, size_t p)
{
    return !m->groups[m->param_group[p]].frozen && !(skip && (skip[p / 64] >> (p % 64) & 1));
}

/* One optimizer update of the trained slices from their accumulators, in runs of consecutive
 * parameters of one group at one step: each with its group's hyperparameters (with set_lr,
 * lr instead of the group's) at its own step psteps[p] + 1; the skipped ones keep their
 * values, state and count. */
pshard_status_t shard_model_optimize(shard_model_t *m, bool set_lr, double lr, const uint64_t *skip,
                                     char *err, size_t errlen)
{
    for (size_t p = 0; p < m->nparams;) {
        size_t cnt = ps_layout_counts(m->layout, p)[m->rank];
        if (cnt == 0 || !updated(m, skip, p)) {
            p++;
            continue;
        }
        uint32_t g = m->param_group[p];
        int64_t at = shard_model_pstep(m, p);
        size_t off = ps_layout_shard_offset(m->layout, p, m->rank), n = cnt, q = p + 1;
        for (; q < m->nparams; q++) {
            size_t c = ps_layout_counts(m->layout, q)[m->rank];
            if (c == 0)
                continue;
            if (!updated(m, skip, q) || m->param_group[q] != g || shard_model_pstep(m, q) != at)
                break;
            n += c; /* a rank's pieces lie back to back in parameter order (layout.h) */
        }
        const ps_optim_config_t *cfg = &m->groups[g].cfg;
        double run_lr = set_lr ? lr : cfg->lr;
        float *master = m->master + off, *grad = m->grad + off;
        float *s0 = m->state0 ? m->state0 + off : NULL;
        float *s1 = m->state1 ? m->state1 + off : NULL;
        if (m->dev) {
            ps_optim_scalars_t sc;
            ps_optim_step_scalars(cfg, run_lr, at + 1, &sc);
            PS_CHECK(m->dev->optim_step(m->device, &sc, master, grad, PSHARD_FP32, false, 1.0f, s0,
                                        s1, n, err, errlen));
        } else {
            ps_optim_step(cfg, run_lr, at + 1, master, grad, s0, s1, n);
        }
        p = q;
    }
    for (size_t p = 0; p < m->nparams; p++)
        if (updated(m, skip, p))
            m->psteps[p] = shard_model_pstep(m, p) + 1;
    return PSHARD_OK;
}

pshard_status_t shard_model_take_groups(shard_model_t *m, const int64_t *words, size_t nwords,
                                        char *err, size_t errlen)
{
    if (nwords == 0)
        return PSHARD_OK;
    size_t n = nwords / SHARD_GROUP_WORDS;
    shard_group_t *g = calloc(n ? n : 1, sizeof(*g));
    if (!g)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    shard_groups_decode(words, n, m->optim.kind, g);
    pshard_status_t rc =
        nwords % SHARD_GROUP_WORDS
            ? ps_errf(err, errlen, PSHARD_ERR_DESYNC, "a step carried %zu group words", nwords)
            : shard_model_check_groups(m, g, n, err, errlen);
    if (rc == PSHARD_OK)
        shard_model_set_groups(m, g);
    free(g);
    return rc;
}

pshard_status_t shard_model_zero_grads(shard_model_t *m, char *err, size_t errlen)
{
    if (m->dev)
        return m->dev->zero(m->device, m->grad, m->shard_numel, err, errlen);
    memset(m->grad, 0, m->shard_numel * sizeof(float));
    return PSHARD_OK;
}
