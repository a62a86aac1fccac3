/* The shard server's DefineModel operation: it checks a model definition, compares it with
 * the other ranks' through the coordinator's store, fills the shards from the trainer's initial
 * values or the newest checkpoint, and only then replaces the previous model and region. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "pshard/coord_client.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"

#include "shard_cuda.h"
#include "shard_heal.h"
#include "shard_internal.h"
#include "shard_ops.h"

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

/* Compares this rank's definition (and mesh line, "mesh none" or "mesh R x S") with every
 * other rank's through the coordinator's store; rank and world are the world's. */
static pshard_status_t check_definitions(pshard_shard_server_t *s, const shard_model_t *m,
                                         const char *mesh, int rank, int world, char *err,
                                         size_t errlen)
{
    if (s->define_generation != s->comm_generation) {
        /* A new ring: nobody reads this rank's definitions of the old generation any more
         * (every rank of this ring has left that one), so they leave the store. */
        for (uint64_t a = 1; a <= s->define_attempts; a++) {
            char old[128];
            snprintf(old, sizeof(old), "pshard/model/g%" PRIu64 "/a%" PRIu64 "/rank/%d",
                     s->define_generation, a, rank);
            char derr[PSHARD_ERRLEN] = "";
            if (ps_coord_store_remove(s->coord, old, 2000, derr, sizeof(derr)) != PSHARD_OK)
                PS_DEBUG(PS_SUB_SHARD, "could not delete %s: %s", old, derr);
        }
        s->define_generation = s->comm_generation;
        s->define_attempts = 0;
    }
    uint64_t attempt = ++s->define_attempts;
    char key[128];
    snprintf(key, sizeof(key), "pshard/model/g%" PRIu64 "/a%" PRIu64 "/rank/%d", s->comm_generation,
             attempt, rank);
    size_t spec_len = strlen(m->spec_text), mesh_len = strlen(mesh);
    if (spec_len > (1u << 20))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "the model definition is too large to compare (%zu bytes)", spec_len);
    /* The mesh line first: "mesh ...\n" then the definition. */
    char *text_out = malloc(mesh_len + 1 + spec_len + 1);
    if (!text_out)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    memcpy(text_out, mesh, mesh_len);
    text_out[mesh_len] = '\n';
    memcpy(text_out + mesh_len + 1, m->spec_text, spec_len + 1);
    pshard_status_t rc =
        ps_coord_store_put(s->coord, key, text_out, mesh_len + 1 + spec_len, 10000, err, errlen);
    free(text_out);
    if (rc != PSHARD_OK)
        return rc;
    for (int r = 0; r < world; r++) {
        if (r == rank)
            continue;
        char other[128];
        snprintf(other, sizeof(other), "pshard/model/g%" PRIu64 "/a%" PRIu64 "/rank/%d",
                 s->comm_generation, attempt, r);
        const char *keys[1] = {other};
        /* Wait in short slices so that a stopping server (or an aborted ring) does not sit
         * in a store wait for the whole collective timeout. */
        int64_t limit_ms = s->cfg.coll_timeout_ms > 0 ? s->cfg.coll_timeout_ms : 600000;
        int64_t give_up = ps_now_ns() + limit_ms * 1000000;
        Pshard__StoreWaitResponse *wr = NULL;
        for (;;) {
            char werr[PSHARD_ERRLEN] = "";
            rc = ps_coord_store_await(s->coord, keys, 1, 500, &wr, werr, sizeof(werr));
            if (rc == PSHARD_OK)
                break;
            bool stopping = atomic_load(&s->stop);
            if (rc != PSHARD_ERR_TIMEOUT || stopping || ps_now_ns() > give_up) {
                ps_errf(err, errlen, rc, "rank %d never defined its model%s: %s", r,
                        stopping ? " (this server is stopping)" : "", werr);
                return rc;
            }
        }
        char *text =
            wr->n_values == 1 ? strndup((const char *)wr->values[0].data, wr->values[0].len) : NULL;
        protobuf_c_message_free_unpacked(&wr->base, NULL);
        if (!text)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        char *nl = strchr(text, '\n');
        if (!nl || (size_t)(nl - text) != mesh_len || memcmp(text, mesh, mesh_len) != 0) {
            if (nl)
                *nl = '\0';
            rc = ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                         "the device meshes differ: rank %d has %s, rank %d has %s", rank, mesh, r,
                         text);
        } else {
            rc = shard_model_compare(m, rank, nl + 1, r, err, errlen);
        }
        free(text);
        if (rc != PSHARD_OK)
            return rc;
    }
    return PSHARD_OK;
}

/* Everything about the initial values that can be checked from the request alone, before
 * anything is allocated for the model: one offset per parameter where this rank reads initial
 * values, each inside the region of region_bytes. Definitions shard_model_create refuses
 * anyway (too many parameters, bad shapes) are left to it: it names the problem better. */
static pshard_status_t check_init_offsets(const Pshard__DefineModelRequest *req,
                                          uint64_t region_bytes, int rank, char *err, size_t errlen)
{
    bool has_data = req->init != PSHARD__INIT_MODE__INIT_FROM_RANK0 || rank == 0;
    if (!has_data || req->n_params == 0 || req->n_params > SHARD_MAX_PARAMS)
        return PSHARD_OK;
    if (req->n_init_offsets != req->n_params)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "init_offsets has %zu entries for %zu parameters", req->n_init_offsets,
                       req->n_params);
    for (size_t i = 0; i < req->n_params; i++) {
        const Pshard__ParamSpec *p = req->params[i];
        uint64_t numel = 1;
        bool valid = p->n_shape > 0 && p->n_shape <= SHARD_MAX_DIMS;
        for (size_t d = 0; d < p->n_shape && valid; d++)
            valid = p->shape[d] > 0 && (uint64_t)p->shape[d] <= (1ull << 40) &&
                    !__builtin_mul_overflow(numel, (uint64_t)p->shape[d], &numel);
        uint64_t end;
        if (valid && (__builtin_mul_overflow(numel, 4, &end) ||
                      __builtin_add_overflow(end, req->init_offsets[i], &end) ||
                      end > region_bytes || req->init_offsets[i] % 4 != 0))
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "init values of '%.255s' lie outside the model region (offset %" PRIu64
                           ", %" PRIu64 " elements, region %" PRIu64 " bytes)",
                           p->name ? p->name : "", req->init_offsets[i], numel, region_bytes);
    }
    return PSHARD_OK;
}

static pshard_status_t init_params(pshard_comm_t *comm, shard_model_t *m,
                                   const Pshard__DefineModelRequest *req, const shm_map_t *region,
                                   char *err, size_t errlen)
{
    /* check_init_offsets validated every offset this rank reads, before the model existed. */
    bool from_rank0 = req->init == PSHARD__INIT_MODE__INIT_FROM_RANK0;
    bool has_data = !from_rank0 || pshard_comm_rank(comm) == 0;
    bool bcast = from_rank0 && pshard_comm_world_size(comm) > 1;
    float *full = NULL;
    if (bcast) {
        full = malloc(m->max_numel * sizeof(float) + 1);
        if (!full)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    pshard_status_t rc = PSHARD_OK;
    for (size_t p = 0; p < m->nparams && rc == PSHARD_OK; p++) {
        size_t numel = m->params[p].numel;
        const float *src = NULL;
        if (has_data)
            src = (const float *)((uint8_t *)region->base + req->init_offsets[p]);
        if (bcast) {
            pshard_coll_args_t a = {.op = PSHARD_COLL_BROADCAST,
                                    .dtype = PSHARD_FP32,
                                    .root = 0,
                                    .send = src,
                                    .recv = full,
                                    .count = numel,
                                    .tag = ((uint64_t)1 << 63) | p,
                                    .label = m->params[p].name};
            rc = pshard_coll_run(comm, &a, err, errlen);
            src = full;
        }
        if (rc == PSHARD_OK) {
            size_t off = ps_layout_piece_offset(m->layout, p, m->rank);
            size_t cnt = ps_layout_counts(m->layout, p)[m->rank];
            float *dst = m->master + ps_layout_shard_offset(m->layout, p, m->rank);
            if (m->dev)
                rc = m->dev->copy(m->device, dst, src + off, cnt * sizeof(float), err, errlen);
            else
                memcpy(dst, src + off, cnt * sizeof(float));
        }
        /* This server is done with those trainer pages (the trainer discards them after
         * DefineModel): drop them from its own mapping now, so the definition's peak holds
         * one parameter's initial values, not all. Shared mappings only: the pages keep their
         * contents, should another parameter's offsets overlap these. Not when pinned: the
         * pages stay resident for the GPU anyway. */
        if (rc == PSHARD_OK && has_data && region->name[0] && !region->pinned) {
            size_t page = (size_t)sysconf(_SC_PAGESIZE);
            uintptr_t a0 = (uintptr_t)((const uint8_t *)region->base + req->init_offsets[p]);
            uintptr_t start = (a0 + page - 1) / page * page;
            uintptr_t end = (a0 + numel * sizeof(float)) / page * page;
            if (end > start)
                madvise((void *)start, end - start, MADV_DONTNEED);
        }
    }
    free(full);
    return rc;
}

/* The trainer's model region in m's device memory (req->device_region_bytes > 0) when m's
 * shards are GPU-resident (with host shards the region stays the trainer's shared memory, and
 * the answer carries no handle), or for the replacement of a lost trainer (kept: the model it
 * takes over) the kept model's, which must be the same size. */
static pshard_status_t region_on_device(shard_model_t *m, const Pshard__DefineModelRequest *req,
                                        const shard_model_t *kept, char *err, size_t errlen)
{
    uint64_t bytes = req->device_region_bytes;
    if (kept) {
        if (kept->region_dev.bytes == bytes || (!kept->dev && kept->region_dev.bytes == 0))
            return PSHARD_OK;
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "the replacement trainer asks for a model region of %" PRIu64
                       " bytes in GPU memory, the lost trainer's was %zu bytes: start the same "
                       "training script on the same kind of device",
                       bytes, kept->region_dev.bytes);
    }
    if (bytes == 0)
        return PSHARD_OK;
    if (!m->dev)
        return PSHARD_OK; /* host shards: the region stays the trainer's shared memory */
    if (!req->shm_name || !req->shm_name[0])
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "a trainer on another host (PSHARD_REMOTE=1) cannot open this server's GPU "
                       "memory: keep its model region in host memory");
    if (bytes > (1ull << 46))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "a model region of %" PRIu64 " bytes of GPU memory is out of range", bytes);
    return m->dev->alloc_shared(m->device, (size_t)bytes, &m->region_dev, err, errlen);
}

/* The replacement of a lost trainer defined candidate: when it is the model this server kept
 * (the same definition, so the same fingerprint), the new trainer takes it over as it is,
 * with its region in place of the lost trainer's, and no other rank takes part; another model
 * is refused. */
static pshard_status_t take_over(pshard_shard_server_t *s, const shard_model_t *candidate,
                                 shm_map_t *region, char *err, size_t errlen)
{
    shard_model_t *kept = s->model;
    if (candidate->fingerprint != kept->fingerprint)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "rank %d's replacement trainer defines another model (fingerprint "
                       "%016" PRIx64 ") than the lost trainer's (%016" PRIx64
                       "), whose state this server keeps: start the same training script",
                       s->rank, candidate->fingerprint, kept->fingerprint);
    shard_unmap(&s->model_shm);
    s->model_shm = *region;
    memset(region, 0, sizeof(*region));
    pthread_mutex_lock(&s->mu);
    int64_t waited_ms =
        s->cfg.trainer_replace_ms - (s->replace_deadline_ns - ps_now_ns()) / 1000000;
    s->replace_deadline_ns = 0;
    pthread_mutex_unlock(&s->mu);
    PS_WARN(PS_SUB_SHARD,
            "rank %d's replacement trainer took over the model at step %" PRId64 " (%" PRId64
            " step%s aborted so far) %lld ms after its predecessor was lost",
            s->rank, kept->step, kept->aborted_steps, kept->aborted_steps == 1 ? "" : "s",
            (long long)waited_ms);
    return PSHARD_OK;
}

pshard_status_t shard_define_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                 char *err, size_t errlen)
{
    shard_define_arg_t *a = op->arg;
    const Pshard__DefineModelRequest *req = a->req;
    char *resumed_from = a->resumed_from;
    pshard_status_t rc = PSHARD_OK;
    size_t n = req->n_params;
    const char **names = calloc(n ? n : 1, sizeof(char *));
    const int64_t **shapes = calloc(n ? n : 1, sizeof(int64_t *));
    size_t *ndims = calloc(n ? n : 1, sizeof(size_t));
    shard_model_t *m = NULL;
    shard_group_t *groups = NULL;
    shm_map_t region = {0};
    if (!names || !shapes || !ndims) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        names[i] = req->params[i]->name;
        shapes[i] = req->params[i]->shape;
        ndims[i] = req->params[i]->n_shape;
    }
    ps_optim_config_t oc;
    const Pshard__OptimizerConfig *po = req->optimizer;
    ps_optim_kind_t kind = !po                                         ? PS_OPTIM_SGD
                           : po->kind == PSHARD__OPTIMIZER_KIND__ADAM  ? PS_OPTIM_ADAM
                           : po->kind == PSHARD__OPTIMIZER_KIND__ADAMW ? PS_OPTIM_ADAMW
                                                                       : PS_OPTIM_SGD;
    if (po && po->kind != PSHARD__OPTIMIZER_KIND__SGD && po->kind != PSHARD__OPTIMIZER_KIND__ADAM &&
        po->kind != PSHARD__OPTIMIZER_KIND__ADAMW) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown optimizer %d",
                     (int)po->kind);
        goto out;
    }
    ps_optim_defaults(kind, &oc);
    if (po) {
        oc.lr = po->lr;
        oc.momentum = po->momentum;
        oc.dampening = po->dampening;
        oc.nesterov = po->nesterov;
        oc.weight_decay = po->weight_decay;
        if (kind != PS_OPTIM_SGD) {
            oc.beta1 = po->beta1;
            oc.beta2 = po->beta2;
            oc.eps = po->eps;
        }
    }
    pshard_layout_t layout =
        req->layout == PSHARD__LAYOUT__FSDP1 ? PSHARD_LAYOUT_FSDP1 : PSHARD_LAYOUT_FSDP2;
    if (req->layout != PSHARD__LAYOUT__FSDP1 && req->layout != PSHARD__LAYOUT__FSDP2) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown layout %d",
                     (int)req->layout);
        goto out;
    }
    if (req->init != PSHARD__INIT_MODE__INIT_FROM_RANK0 &&
        req->init != PSHARD__INIT_MODE__INIT_LOCAL) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown init mode %d",
                     (int)req->init);
        goto out;
    }
    rc = shard_region_size_ok(s, req->shm_bytes, err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    /* Map the region before allocating shard state, and adopt both only when everything
     * succeeded: a refused definition leaves the previous model and region in place. */
    if (!req->shm_name || !req->shm_name[0]) {
        /* A remote trainer: the region its WriteRegion calls filled (at least sized). */
        if (!s->pending_model.base || s->pending_model.bytes != req->shm_bytes) {
            rc = ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                         "no %" PRIu64 "-byte model region was written (remote trainers send "
                         "WriteRegion with region_bytes first)",
                         req->shm_bytes);
            goto out;
        }
        region = s->pending_model;
        memset(&s->pending_model, 0, sizeof(s->pending_model));
    } else {
        rc = shard_map_shm(req->shm_name, req->shm_bytes, &region, err, errlen);
        if (rc != PSHARD_OK)
            goto out;
    }
    rc = check_init_offsets(req, region.bytes, pshard_comm_rank(comm), err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    rc = shard_groups_from_pb(req->groups, req->n_groups, kind, &groups, err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    int wrank = pshard_comm_rank(comm), world = pshard_comm_world_size(comm);
    int reps = req->replicate, shards = req->shard;
    bool mesh = reps != 0 || shards != 0;
    if (mesh && (reps < 1 || shards < 1 || (int64_t)reps * shards != world)) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "a (replicate %d, shard %d) mesh does not cover this %d-rank world (their "
                     "product must be it)",
                     reps, shards, world);
        goto out;
    }
    if (!mesh) {
        reps = 1;
        shards = world;
    }
    char mesh_line[64];
    snprintf(mesh_line, sizeof(mesh_line), "mesh %d x %d", reps, shards);
    /* Who could map the shard: not a trainer on another host, not GPU memory. */
    const char *no_share =
        !req->shm_name || !req->shm_name[0]
            ? "the trainer is on another host (PSHARD_REMOTE=1) and cannot map its shard "
              "server's memory; step with the shard servers' optimizer (pshard_step)"
            : NULL;
    rc = shard_model_create(wrank % shards, shards, layout, n, names, shapes, ndims, &oc, groups,
                            req->n_groups, req->param_groups, req->n_param_groups,
                            po ? po->max_grad_norm : 0, po && po->in_backward, s->dev,
                            s->cfg.device, s->max_model_bytes, no_share, &m, err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    pthread_mutex_lock(&s->mu);
    bool replacing = s->replace_deadline_ns != 0 && s->model;
    pthread_mutex_unlock(&s->mu);
    rc = region_on_device(m, req, replacing ? s->model : NULL, err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    if (replacing) {
        rc = take_over(s, m, &region, err, errlen);
        goto out;
    }
    if (s->heal) {
        /* This server replaces a lost one: the shard comes from its replica, not from initial
         * values or a checkpoint, and the other ranks, training on, define nothing. */
        rc = shard_heal_adopt(s, m, reps, shards, err, errlen);
        if (rc != PSHARD_OK)
            goto out;
        goto adopt;
    }
    rc = check_definitions(s, m, mesh_line, wrank, world, err, errlen);
    if (rc == PSHARD_OK && reps > 1)
        rc = shard_mesh_connect(s, m, wrank, reps, shards, s->define_attempts, 0,
                                s->comm_generation, err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    if (shard_on_gpu(s)) {
        shard_pin_region(s, &region);
        if (shard_model_pin(m, s->cfg.device, err, errlen) != PSHARD_OK)
            PS_WARN(PS_SUB_SHARD, "shard state stays pageable (copies to the GPU are slower): %s",
                    err);
    }
    rc = init_params(comm, m, req, &region, err, errlen);
    if (rc != PSHARD_OK)
        goto out;
    /* --resume: the newest committed checkpoint replaces the initial values (collective). */
    if (s->cfg.resume && *s->cfg.resume) {
        bool restored = false;
        rc = shard_ckpt_load(s, comm, m, s->cfg.resume, &restored, resumed_from,
                             sizeof(a->resumed_from), err, errlen);
        if (rc != PSHARD_OK)
            goto out;
    }
adopt:
    shard_unmap(&s->model_shm);
    s->model_shm = region;
    memset(&region, 0, sizeof(region));
    /* Status reads the model under s->mu without waiting for trainer operations. */
    pthread_mutex_lock(&s->mu);
    shard_model_t *old = s->model;
    s->model = m;
    pthread_mutex_unlock(&s->mu);
    shard_model_free(old);
    shard_heal_capable(s);
    PS_INFO(PS_SUB_SHARD, "model defined: %zu parameters, %zu elements on this rank (%s, %s)", n,
            m->shard_numel, layout == PSHARD_LAYOUT_FSDP2 ? "fsdp2" : "fsdp1", mesh_line);
    m = NULL;
out:
    shard_unmap(&region);
    shard_model_free(m);
    free(groups);
    free(names);
    free(shapes);
    free(ndims);
    if (rc == PSHARD_OK) {
        a->fingerprint = s->model->fingerprint;
        a->shard_numel = s->model->shard_numel;
        a->step = s->model->step;
        a->aborted_steps = s->model->aborted_steps;
        const shard_model_t *mm = s->model;
        ps_strlcpy(a->shm_name, mm->shm.name, sizeof(a->shm_name));
        a->shm_bytes = mm->shm.bytes;
        a->master_off = mm->shm_master_off;
        a->grad_off = mm->shm_grad_off;
        a->state0_off = mm->shm_state0_off;
        a->state1_off = mm->shm_state1_off;
        a->steps_off = mm->shm_steps_off;
        ps_strlcpy(a->shared_reason, mm->shared_reason, sizeof(a->shared_reason));
        if (mm->dev_shared.bytes) {
            memcpy(a->dev_handle, mm->dev_shared.handle, mm->dev_shared.handle_len);
            a->dev_handle_len = mm->dev_shared.handle_len;
            a->dev_kind = mm->dev->name;
            a->dev_bytes = mm->dev_shared.bytes;
            a->device = mm->device;
        }
        if (mm->region_dev.bytes) {
            memcpy(a->region_handle, mm->region_dev.handle, mm->region_dev.handle_len);
            a->region_handle_len = mm->region_dev.handle_len;
            a->dev_kind = mm->dev->name;
            a->device = mm->device;
        }
        for (int i = 0; i < 2; i++)
            ps_strlcpy(a->state_names[i], mm->trainer_state_names[i], sizeof(a->state_names[i]));
        a->trainer_replace_ms = s->cfg.trainer_replace_ms;
    }
    return rc;
}
