/* The operations' cores: what a gather, a reduce-scatter, a plain collective, an optimizer step
 * or clip_grad_norm does on this rank (the collectives on the model's slices, then the model's
 * math), shared by an operation and by a joined rank that shadows it. Call with op_mu held. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/dtype.h"
#include "pshard/util.h"

#include "shard_cuda.h"
#include "shard_heal.h"
#include "shard_internal.h"

/* The flight recorder's label of an operation in the step being computed: "step 12, fc3.weight"
 * (what names a stuck collective in `pshardctl status` and the logs). */
const char *shard_op_label(const shard_model_t *m, const char *what, char *buf, size_t len)
{
    snprintf(buf, len, "step %" PRId64 ", %s", m ? m->step + 1 : 0, what);
    return buf;
}

/* Low words of the norms' collective tags (the step number is the high word; gathers and
 * reduce-scatters use parameter indices below 2^31 and 2^31 + index). */
#define TAG_STEP_NORM 0x7fffffffu
#define TAG_CLIP_NORM 0x7ffffffeu

/* The communicator the model's data moves on: the shard ranks of this replica (HSDP), else
 * the world's. */
static pshard_comm_t *data_comm(const shard_model_t *m, pshard_comm_t *world)
{
    return m->shard_comm ? m->shard_comm : world;
}

/* A gradient reduce-scatter averages when every rank contributes to it alone (no joined rank,
 * no replicas to add afterwards); otherwise it sums and shard_model_slice_out divides. */
static pshard_reduce_t reduce_of(const shard_model_t *m, int active)
{
    return active == m->world && m->replicas == 1 ? PSHARD_REDUCE_AVG : PSHARD_REDUCE_SUM;
}

/* Whether comm takes device memory (nccl) rather than host memory only (tcp, through the
 * sockets or the same-host transport). */
static bool takes_device(const pshard_comm_t *comm)
{
    return strcmp(pshard_comm_transport(comm), "nccl") == 0;
}

/* This rank's send and receive sizes in bytes of the collective a on comm (a gather or a
 * reduce-scatter, by counts or count, or an in-place all-reduce). False for another. */
static bool coll_sizes(const pshard_comm_t *comm, const pshard_coll_args_t *a, size_t *send,
                       size_t *recv)
{
    int world = pshard_comm_world_size(comm);
    size_t es = pshard_dtype_size(a->dtype);
    size_t mine = a->counts ? a->counts[pshard_comm_rank(comm)] : a->count;
    size_t all = a->count * (size_t)world;
    if (a->counts) {
        all = 0;
        for (int q = 0; q < world; q++)
            all += a->counts[q];
    }
    switch (a->op) {
    case PSHARD_COLL_ALL_GATHER:
        *send = mine * es;
        *recv = all * es;
        return true;
    case PSHARD_COLL_REDUCE_SCATTER:
        *send = all * es;
        *recv = mine * es;
        return true;
    case PSHARD_COLL_ALL_REDUCE:
        *send = *recv = a->count * es;
        return true;
    default:
        return false;
    }
}

/* Runs the collective a on comm, counting in the model the bytes copied between host and
 * device memory for it (staged_to_host, staged_to_device). GPU-resident shards on a host-memory
 * backend (--shard-memory gpu with tcp: several servers sharing one GPU, where NCCL allows one
 * rank per device) go through host memory: each device buffer (this rank's slice, and with the
 * model region in device memory the full buffer; an in-place all-reduce's one) is copied into
 * m->unit_stage before the collective (what it sends) and back after it (what it receives). On
 * nccl the device buffers go to NCCL as they are, and its engine copies the host ones (CPU
 * offload's shards, a model region in host memory) to the device and back. */
static pshard_status_t coll_run_dev(shard_model_t *m, pshard_comm_t *comm, pshard_coll_args_t *a,
                                    char *err, size_t errlen)
{
    if (takes_device(comm)) {
        uint64_t d0, h0, d1, h1;
        pshard_comm_host_staged(comm, &d0, &h0);
        pshard_status_t rc = pshard_coll_run(comm, a, err, errlen);
        pshard_comm_host_staged(comm, &d1, &h1);
        atomic_fetch_add_explicit(&m->staged_to_device, d1 - d0, memory_order_relaxed);
        atomic_fetch_add_explicit(&m->staged_to_host, h1 - h0, memory_order_relaxed);
        return rc;
    }
    if (!a->send_device && !a->recv_device)
        return pshard_coll_run(comm, a, err, errlen);
    size_t sbytes = 0, rbytes = 0;
    if (!coll_sizes(comm, a, &sbytes, &rbytes))
        return ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "%s: no staging through host memory",
                       pshard_coll_op_name(a->op));
    bool in_place = a->send == a->recv;
    /* What is staged: the device send at 0, the device recv after it (64-byte aligned), or
     * both at 0 in place. */
    size_t roff = a->send_device && !in_place ? (sbytes + 63) / 64 * 64 : 0;
    size_t need = a->recv_device ? roff + rbytes : sbytes;
    uint8_t *host = shard_model_unit_stage(m, need ? need : 1);
    if (!host)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY,
                       "out of memory for %zu bytes of host staging", need);
    void *dev_recv = a->recv_device ? a->recv : NULL;
    if (a->send_device) {
        PS_CHECK(m->dev->copy(m->device, host, a->send, sbytes, err, errlen));
        atomic_fetch_add_explicit(&m->staged_to_host, sbytes, memory_order_relaxed);
        a->send = host;
    } else if (in_place && a->recv_device) {
        return ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "%s: one buffer in two memories",
                       pshard_coll_op_name(a->op));
    }
    if (dev_recv)
        a->recv = host + roff;
    a->send_device = a->recv_device = false;
    PS_CHECK(pshard_coll_run(comm, a, err, errlen));
    if (dev_recv) {
        PS_CHECK(m->dev->copy(m->device, dev_recv, host + roff, rbytes, err, errlen));
        atomic_fetch_add_explicit(&m->staged_to_device, rbytes, memory_order_relaxed);
    }
    return PSHARD_OK;
}

/* HSDP: adds the replicas' reduce-scattered slices of parameter p (count elements of dt at
 * slice, device memory when the shards are on a GPU) in place, across the replicate ranks. */
static pshard_status_t replicas_sum(shard_model_t *m, uint32_t p, pshard_dtype_t dt, void *slice,
                                    size_t count, char *err, size_t errlen)
{
    if (!m->replicate_comm)
        return PSHARD_OK;
    char label[64];
    bool dev = m->dev != NULL;
    pshard_coll_args_t a = {
        .op = PSHARD_COLL_ALL_REDUCE,
        .dtype = dt,
        .reduce = PSHARD_REDUCE_SUM,
        .send = slice,
        .recv = slice,
        .count = count,
        .send_device = dev,
        .recv_device = dev,
        .tag = ((uint64_t)m->step << 32) | (1u << 30) | p,
        .label = shard_op_label(m, m->params[p].name, label, sizeof(label)),
    };
    return coll_run_dev(m, m->replicate_comm, &a, err, errlen);
}

/* The all-gather of parameter p in dt: this rank's slice send into the full buffer recv. */
static pshard_coll_args_t gather_args(const shard_model_t *m, uint32_t p, pshard_dtype_t dt,
                                      const void *send, void *recv, bool recv_dev, char *label,
                                      size_t labellen)
{
    return (pshard_coll_args_t){
        .op = PSHARD_COLL_ALL_GATHER,
        .dtype = dt,
        .send = send,
        .send_device = m->dev != NULL,
        .recv = recv,
        .recv_device = recv_dev,
        .counts = ps_layout_counts(m->layout, p),
        .tag = ((uint64_t)m->step << 32) | p,
        .label = shard_op_label(m, m->params[p].name, label, labellen),
    };
}

/* The reduce-scatter of parameter p's full gradient send (dt) into this rank's slice recv: with
 * every rank contributing the collective averages (as before Join existed); with fewer, it
 * sums and shard_model_slice_out divides by the contributors. */
static pshard_coll_args_t reduce_scatter_args(const shard_model_t *m, uint32_t p, pshard_dtype_t dt,
                                              const void *send, bool send_dev, void *recv,
                                              int active, char *label, size_t labellen)
{
    return (pshard_coll_args_t){
        .op = PSHARD_COLL_REDUCE_SCATTER,
        .dtype = dt,
        .reduce = reduce_of(m, active),
        .send = send,
        .send_device = send_dev,
        .recv = recv,
        .recv_device = m->dev != NULL,
        .counts = ps_layout_counts(m->layout, p),
        .tag = ((uint64_t)m->step << 32) | (1u << 31) | p,
        .label = shard_op_label(m, m->params[p].name, label, labellen),
    };
}

/* Checked before any collective, so every rank refuses alike and none waits. */
static pshard_status_t check_reduce_again(const shard_model_t *m, uint32_t p, char *err,
                                          size_t errlen)
{
    if (m->in_backward && m->reduced[p])
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "'%s' was already reduce-scattered in step %" PRId64 ": "
                       "optimizer_in_backward applies the update at the first one, so gradient "
                       "accumulation needs optimizer_in_backward off",
                       m->params[p].name, m->step + 1);
    return PSHARD_OK;
}

pshard_status_t shard_gather_one(pshard_comm_t *comm, shard_model_t *m, uint32_t p,
                                 pshard_dtype_t dt, void *recv, bool on_dev, char *err,
                                 size_t errlen)
{
    const void *send = NULL;
    PS_CHECK(shard_model_slice_in(m, p, dt, m->stage, &send, err, errlen));
    char label[64];
    pshard_coll_args_t a = gather_args(m, p, dt, send, recv, on_dev, label, sizeof(label));
    return coll_run_dev(m, data_comm(m, comm), &a, err, errlen);
}

pshard_status_t shard_reduce_scatter_one(pshard_comm_t *comm, shard_model_t *m, uint32_t p,
                                         pshard_dtype_t dt, const void *send, bool on_dev,
                                         int active, char *err, size_t errlen)
{
    PS_CHECK(check_reduce_again(m, p, err, errlen));
    char label[64];
    pshard_coll_args_t a =
        reduce_scatter_args(m, p, dt, send, on_dev, m->stage, active, label, sizeof(label));
    PS_CHECK(coll_run_dev(m, data_comm(m, comm), &a, err, errlen));
    PS_CHECK(
        replicas_sum(m, p, dt, m->stage, ps_layout_counts(m->layout, p)[m->rank], err, errlen));
    return shard_model_slice_out(m, p, dt, active, m->stage, err, errlen);
}

/* Whether comm takes buffers in pieces (the tcp backend, through the sockets or the same-host
 * transport; not nccl). */
static bool takes_pieces(const pshard_comm_t *comm)
{
    return strcmp(pshard_comm_transport(comm), "nccl") != 0;
}

/* The gather or reduce-scatter of n parameters as one collective: each rank's block is its
 * pieces of every parameter in turn, so the pieces of the full buffers bufs[i] are listed rank
 * by rank, and this rank's slices go out from (gather: the master weights, or converted into
 * the unit stage) or come back to (reduce-scatter: the unit stage, 4 bytes an element so that
 * a bf16 slice widens in place) staging of their own. */
static pshard_status_t tensors_fused(pshard_comm_t *comm, shard_model_t *m, bool gather,
                                     const uint32_t *ids, void *const *bufs, size_t n,
                                     pshard_dtype_t dt, int active, char *err, size_t errlen)
{
    int world = m->world, r = m->rank;
    size_t es = pshard_dtype_size(dt);
    size_t *counts = calloc((size_t)world, sizeof(size_t));
    size_t *stage_at = calloc(n, sizeof(size_t)); /* each slice's byte offset in unit_stage */
    pshard_coll_seg_t *full = calloc((size_t)world * n, sizeof(*full));
    pshard_coll_seg_t *mine = calloc(n, sizeof(*mine));
    pshard_status_t rc = PSHARD_OK;
    if (!counts || !stage_at || !full || !mine) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    size_t stage_bytes = 0;
    for (size_t i = 0; i < n; i++) {
        stage_at[i] = stage_bytes;
        stage_bytes += ps_layout_counts(m->layout, ids[i])[r] * (gather ? es : 4);
    }
    uint8_t *stage = NULL;
    if (!gather || dt != PSHARD_FP32) {
        stage = shard_model_unit_stage(m, stage_bytes ? stage_bytes : 1);
        if (!stage) {
            rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY,
                         "out of memory for %zu bytes of staging", stage_bytes);
            goto out;
        }
    }
    for (int q = 0; q < world; q++) {
        for (size_t i = 0; i < n; i++) {
            uint32_t p = ids[i];
            size_t cnt = ps_layout_counts(m->layout, p)[q];
            counts[q] += cnt;
            full[(size_t)q * n + i] = (pshard_coll_seg_t){
                (uint8_t *)bufs[i] + ps_layout_piece_offset(m->layout, p, q) * es, cnt};
        }
    }
    for (size_t i = 0; i < n && rc == PSHARD_OK; i++) {
        uint32_t p = ids[i];
        mine[i].count = ps_layout_counts(m->layout, p)[r];
        if (!gather) {
            mine[i].ptr = stage + stage_at[i];
        } else {
            const void *send = NULL;
            rc = shard_model_slice_in(m, p, dt, stage ? stage + stage_at[i] : NULL, &send, err,
                                      errlen);
            mine[i].ptr = (void *)send;
        }
    }
    char label[64];
    if (rc == PSHARD_OK) {
        ps_snprintf(label, sizeof(label), "step %" PRId64 ", %zu tensors from %s", m->step + 1, n,
                    m->params[ids[0]].name);
        pshard_coll_args_t a = {
            .op = gather ? PSHARD_COLL_ALL_GATHER : PSHARD_COLL_REDUCE_SCATTER,
            .dtype = dt,
            .reduce = reduce_of(m, active),
            .counts = counts,
            .tag = ((uint64_t)m->step << 32) | (gather ? 0 : 1u << 31) | ids[0],
            .label = label,
            .send_segs = gather ? mine : full,
            .n_send_segs = gather ? n : (size_t)world * n,
            .recv_segs = gather ? full : mine,
            .n_recv_segs = gather ? (size_t)world * n : n,
        };
        rc = pshard_coll_run(data_comm(m, comm), &a, err, errlen);
    }
    if (rc == PSHARD_OK && !gather && dt == PSHARD_FP32)
        /* fp32 fills its 4-byte slots: the slices lie end to end, one all-reduce adds them */
        rc = replicas_sum(m, ids[0], dt, stage, stage_bytes / 4, err, errlen);
    for (size_t i = 0; i < n && rc == PSHARD_OK && !gather && dt != PSHARD_FP32; i++)
        rc = replicas_sum(m, ids[i], dt, stage + stage_at[i], mine[i].count, err, errlen);
    for (size_t i = 0; i < n && rc == PSHARD_OK && !gather; i++)
        rc = shard_model_slice_out(m, ids[i], dt, active, stage + stage_at[i], err, errlen);
out:
    free(counts);
    free(stage_at);
    free(full);
    free(mine);
    return rc;
}

pshard_status_t shard_tensors_run(pshard_comm_t *comm, shard_model_t *m, bool gather,
                                  const uint32_t *ids, void *const *bufs, bool on_dev, size_t n,
                                  pshard_dtype_t dt, int active, char *err, size_t errlen)
{
    if (n == 0)
        return PSHARD_OK; /* nothing to move (a handler refuses an empty request first) */
    if (!gather) {
        for (size_t i = 0; i < n; i++)
            PS_CHECK(check_reduce_again(m, ids[i], err, errlen));
    }
    if (!m->dev && !on_dev && takes_pieces(data_comm(m, comm)))
        return tensors_fused(comm, m, gather, ids, bufs, n, dt, active, err, errlen);
    /* GPU-resident shards (one device staging buffer) and nccl: a collective per tensor. */
    for (size_t i = 0; i < n; i++)
        PS_CHECK(gather ? shard_gather_one(comm, m, ids[i], dt, bufs[i], on_dev, err, errlen)
                        : shard_reduce_scatter_one(comm, m, ids[i], dt, bufs[i], on_dev, active,
                                                   err, errlen));
    return PSHARD_OK;
}

pshard_status_t shard_run_collective(pshard_comm_t *comm, const shard_sop_t *op, const void *send,
                                     void *recv, int active, char *err, size_t errlen)
{
    int world = pshard_comm_world_size(comm);
    bool avg = op->reduce == PSHARD_REDUCE_AVG;
    bool reduces = op->coll_op == PSHARD_COLL_ALL_REDUCE || op->coll_op == PSHARD_COLL_REDUCE ||
                   op->coll_op == PSHARD_COLL_REDUCE_SCATTER;
    /* (avg exists for the floating types only: the collectives refuse it for integers) */
    bool partial_avg = avg && reduces && active < world &&
                       (op->dtype == PSHARD_FP32 || op->dtype == PSHARD_BF16 ||
                        op->dtype == PSHARD_FP16 || op->dtype == PSHARD_FP64);
    pshard_coll_args_t a = {.op = (pshard_coll_op_t)op->coll_op,
                            .dtype = op->dtype,
                            .reduce = partial_avg ? PSHARD_REDUCE_SUM : (pshard_reduce_t)op->reduce,
                            .root = op->root,
                            .send = send,
                            .recv = recv,
                            .count = op->count,
                            .label = "trainer collective"};
    PS_CHECK(pshard_coll_run(comm, &a, err, errlen));
    /* (a reduce's result is the root's alone: the others' recv was not written) */
    if (partial_avg && (op->coll_op != PSHARD_COLL_REDUCE || pshard_comm_rank(comm) == op->root)) {
        /* Joined ranks added zeros: the mean is over the ranks that contributed. */
        double inv64 = 1.0 / (double)(active > 0 ? active : 1);
        float inv = (float)inv64;
        if (op->dtype == PSHARD_FP64) {
            double *v = recv;
            for (uint64_t k = 0; k < op->count; k++)
                v[k] *= inv64;
        } else if (op->dtype == PSHARD_FP32) {
            float *v = recv;
            for (uint64_t k = 0; k < op->count; k++)
                v[k] *= inv;
        } else {
            uint16_t *v = recv;
            for (uint64_t k = 0; k < op->count; k++) {
                float f = op->dtype == PSHARD_BF16 ? ps_bf16_to_f32(v[k]) : ps_f16_to_f32(v[k]);
                f *= inv;
                if (op->dtype == PSHARD_BF16)
                    ps_convert_f32_to_bf16(&f, &v[k], 1);
                else
                    ps_convert_f32_to_f16(&f, &v[k], 1);
            }
        }
    }
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
    /* HSDP: the replicas hold the same accumulators, so the shard ranks of one replica have
     * every element once. */
    comm = data_comm(m, comm);
    double local = 0.0;
    PS_CHECK(shard_model_local_norm(m, inf, &local, err, errlen));
    char label[64];
    shard_op_label(m, what, label, sizeof(label));
    uint64_t tag = ((uint64_t)m->step << 32) | tag_low;
    if (!inf) {
        float sq = (float)local;
        pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_REDUCE,
                                .dtype = PSHARD_FP32,
                                .reduce = PSHARD_REDUCE_SUM,
                                .send = &sq,
                                .recv = &sq,
                                .count = 1,
                                .tag = tag,
                                .label = label};
        PS_CHECK(pshard_coll_run(comm, &a, err, errlen));
        *norm = sqrt((double)sq);
        return PSHARD_OK;
    }
    int world = pshard_comm_world_size(comm);
    float mine = (float)local;
    float *all = calloc((size_t)world, sizeof(float));
    if (!all)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_GATHER,
                            .dtype = PSHARD_FP32,
                            .send = &mine,
                            .recv = all,
                            .count = 1,
                            .tag = tag,
                            .label = label};
    pshard_status_t rc = pshard_coll_run(comm, &a, err, errlen);
    if (rc == PSHARD_OK)
        *norm = (double)ps_max_abs(all, (size_t)world);
    free(all);
    return rc;
}

pshard_status_t shard_run_step(pshard_shard_server_t *s, pshard_comm_t *comm, shard_model_t *m,
                               const shard_sop_t *op, int64_t ckpt_request, double *norm_out,
                               char *err, size_t errlen)
{
    if (op->set_step) {
        /* A restored optimizer state: the count goes on from its step (Adam's bias
         * correction, the checkpoint schedule); nothing else changes. */
        pthread_mutex_lock(&s->mu);
        shard_model_set_step(m, op->step_to);
        pthread_mutex_unlock(&s->mu);
        *norm_out = 0.0;
        return PSHARD_OK;
    }
    if (op->trainer_stepped) {
        /* The trainer's optimizer updated the masters through the shared memory: nothing to
         * compute, clip or zero (the trainer owns the accumulators' lifetime then), only the
         * count, which checkpoints and a resume go by. */
        pthread_mutex_lock(&s->mu);
        shard_model_set_step(m, m->step + 1); /* (its parameters' counts are its own) */
        bool first = !m->trainer_optimizer;
        m->trainer_optimizer = true;
        pthread_mutex_unlock(&s->mu);
        if (first) /* its state is the trainers': a lost server can no longer heal */
            shard_heal_capable(s);
        *norm_out = 0.0;
        return shard_ckpt_after_step(s, comm, m, ckpt_request, err, errlen);
    }
    /* The words: the groups' hyperparameters (if any), then the skip mask (if any). */
    size_t nskip = op->skip ? shard_model_skip_words(m) : 0;
    if (nskip > op->nwords || (op->nwords - nskip) % SHARD_GROUP_WORDS != 0)
        return ps_errf(err, errlen, PSHARD_ERR_DESYNC,
                       "a step's words (%zu) are not groups and a skip mask of %zu", op->nwords,
                       nskip);
    size_t ngroup_words = op->nwords - nskip;
    const uint64_t *skip = op->skip ? (const uint64_t *)(op->words + ngroup_words) : NULL;
    PS_CHECK(shard_model_take_groups(m, op->words, ngroup_words, err, errlen));
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
        for (size_t p = 0; p < m->nparams; p++)
            m->psteps[p] = shard_model_pstep(m, p) + m->reduced[p];
        memset(m->reduced, 0, m->nparams);
        *norm_out = norm;
        return shard_ckpt_after_step(s, comm, m, ckpt_request, err, errlen);
    }
    if (m->max_grad_norm > 0) {
        double coef = m->max_grad_norm / (norm + 1e-6);
        if (coef < 1.0)
            PS_CHECK(shard_model_scale_grads(m, (float)coef, err, errlen));
    }
    PS_CHECK(shard_model_optimize(m, op->set_lr, op->lr, skip, err, errlen));
    pthread_mutex_lock(&s->mu);
    m->step++;
    pthread_mutex_unlock(&s->mu);
    PS_CHECK(shard_model_zero_grads(m, err, errlen));
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
            PS_CHECK(shard_model_scale_grads(m, coef, err, errlen));
    }
    *total_norm = (double)total;
    return PSHARD_OK;
}
