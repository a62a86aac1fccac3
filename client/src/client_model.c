/* libpshard's model: defining its parameters to the shard servers, the full buffers'
 * accessors and memory counters, optimizer steps, gradient clipping and checkpoints. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/util.h"

#include "client_internal.h"

void pshard_model_config_default(pshard_model_config_t *mc, pshard_optimizer_t optimizer)
{
    memset(mc, 0, sizeof(*mc));
    mc->layout = PSHARD_LAYOUT_FSDP2;
    mc->param_dtype = PSHARD_FP32;
    mc->reduce_dtype = PSHARD_FP32;
    mc->optimizer = optimizer;
    mc->lr = 1e-3;
    mc->beta1 = 0.9;
    mc->beta2 = 0.999;
    mc->eps = 1e-8;
    mc->weight_decay = optimizer == PSHARD_ADAMW ? 1e-2 : 0.0;
    mc->init_from_rank0 = true;
    mc->reshard_after_forward = true;
    mc->max_gathers_in_flight = 2;
    mc->ngroups = 0; /* one group from the fields above */
    mc->groups = NULL;
    mc->param_groups = NULL;
}

/* Parameter groups as protobuf messages for DefineModel and Step (copies of the values).
 * False when out of memory; pb_groups_free releases (also after a failure). */
typedef struct {
    Pshard__OptimizerGroup *msgs;
    Pshard__OptimizerGroup **ptrs;
    size_t n;
} pb_groups_t;

static void pb_groups_free(pb_groups_t *pg)
{
    free(pg->msgs);
    free(pg->ptrs);
    memset(pg, 0, sizeof(*pg));
}

static bool pb_groups_make(pb_groups_t *pg, const pshard_optim_group_t *g, size_t n)
{
    memset(pg, 0, sizeof(*pg));
    if (n == 0)
        return true;
    pg->msgs = calloc(n, sizeof(*pg->msgs));
    pg->ptrs = calloc(n, sizeof(*pg->ptrs));
    if (!pg->msgs || !pg->ptrs) {
        pb_groups_free(pg);
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        Pshard__OptimizerGroup *m = &pg->msgs[i];
        pshard__optimizer_group__init(m);
        m->lr = g[i].lr;
        m->momentum = g[i].momentum;
        m->dampening = g[i].dampening;
        m->nesterov = g[i].nesterov;
        m->weight_decay = g[i].weight_decay;
        m->beta1 = g[i].beta1;
        m->beta2 = g[i].beta2;
        m->eps = g[i].eps;
        m->frozen = g[i].frozen;
        pg->ptrs[i] = m;
    }
    pg->n = n;
    return true;
}

void client_model_free(pshard_client_t *c)
{
    client_shard_close(&c->shard);
    client_dev_close(&c->region_dev);
    c->region_dev.memory = PSHARD_MEMORY_HOST;
    free(c->numel);
    free(c->stable_off);
    c->stable_off = NULL;
    free(c->pbuf);
    free(c->gbuf);
    client_pool_destroy(c->pool);
    c->numel = NULL;
    c->pbuf = c->gbuf = NULL;
    c->pool = NULL;
    c->nparams = 0;
}

pshard_status_t pshard_define_model(pshard_client_t *c, const pshard_param_t *params,
                                    size_t nparams, const pshard_model_config_t *mc,
                                    const float *const *init)
{
    if (nparams == 0 || !params)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "no parameters");
    if (mc->param_dtype != PSHARD_FP32 && mc->param_dtype != PSHARD_BF16 &&
        mc->param_dtype != PSHARD_FP16)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "param_dtype must be fp32, bf16 or fp16");
    if (mc->reduce_dtype != PSHARD_FP32 && mc->reduce_dtype != PSHARD_BF16)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "reduce_dtype must be fp32 or bf16");
    if (mc->max_gathers_in_flight < 0)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "max_gathers_in_flight must be >= 0");
    if ((mc->replicate || mc->shard) &&
        (mc->replicate < 1 || mc->shard < 1 || (int64_t)mc->replicate * mc->shard != c->world))
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "an HSDP mesh of replicate %d x shard %d does not cover the %d-rank "
                           "world (their product must be it; both 0 for no mesh)",
                           mc->replicate, mc->shard, c->world);
    if (mc->ngroups > 0 && (!mc->groups || !mc->param_groups))
        return client_fail(
            c, PSHARD_ERR_INVALID_ARGUMENT,
            "ngroups is %zu but groups or param_groups is NULL (param_groups needs one "
            "group index per parameter)",
            mc->ngroups);
    bool need_init = !mc->init_from_rank0 || c->rank == 0;
    if (need_init && !init)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "initial values are required on %s",
                           mc->init_from_rank0 ? "rank 0" : "every rank");
    pthread_mutex_lock(&c->mu);
    bool idle = client_idle(c);
    pthread_mutex_unlock(&c->mu);
    if (!idle)
        return client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                           "asynchronous work is still in flight; wait for it before redefining");
    size_t *numel = calloc(nparams, sizeof(size_t));
    tensor_buf_t *pbuf = calloc(nparams, sizeof(tensor_buf_t));
    tensor_buf_t *gbuf = calloc(nparams, sizeof(tensor_buf_t));
    Pshard__ParamSpec *specs = calloc(nparams, sizeof(*specs));
    Pshard__ParamSpec **sptrs = calloc(nparams, sizeof(*sptrs));
    uint64_t *init_offsets = calloc(nparams, sizeof(uint64_t));
    client_pool_t *new_pool = NULL;
    size_t *stable_off = mc->stable_param_buffers ? calloc(nparams, sizeof(size_t)) : NULL;
    /* (a region in GPU memory is known only from DefineModel's answer: not remapped then) */
    bool remap = mc->stable_param_buffers && !c->cfg.remote;
    pshard_status_t rc = PSHARD_OK;
    if (!numel || !pbuf || !gbuf || !specs || !sptrs || !init_offsets ||
        (mc->stable_param_buffers && !stable_off)) {
        rc = client_fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    size_t ps = pshard_dtype_size(mc->param_dtype), gs = pshard_dtype_size(mc->reduce_dtype);
    size_t all_bytes = 0, init_bytes = 0, stable_bytes = 0;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (size_t i = 0; i < nparams; i++) {
        if (params[i].ndim < 1 || params[i].ndim > 8 || !params[i].shape) {
            rc = client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                             "parameter #%zu (%s): ndim must be 1..8", i,
                             params[i].name ? params[i].name : "?");
            goto out;
        }
        size_t n = 1;
        for (int d = 0; d < params[i].ndim; d++) {
            if (params[i].shape[d] <= 0 || n > (SIZE_MAX / 16) / (size_t)params[i].shape[d]) {
                rc = client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                                 "parameter #%zu (%s): dimension %d is not a positive size", i,
                                 params[i].name ? params[i].name : "?", d);
                goto out;
            }
            n *= (size_t)params[i].shape[d];
        }
        numel[i] = n;
        if (stable_off) {
            /* Blocks of a page or more take whole pages of their own, so that a reshard gives
             * all their pages back, or they can be remapped (see stable_off). */
            if (n * ps >= page) {
                stable_bytes = (stable_bytes + page - 1) / page * page;
                stable_off[i] = stable_bytes;
                stable_bytes += (n * ps + page - 1) / page * page;
                if (remap)
                    all_bytes += (n * ps + page - 1) / page * page + page;
            } else {
                stable_off[i] = stable_bytes;
                stable_bytes += client_align(n * ps);
            }
            all_bytes += client_align(n * gs);
        } else {
            all_bytes += client_align(n * ps) + client_align(n * gs);
        }
        init_offsets[i] = init_bytes;
        init_bytes = client_align(init_bytes + n * 4);
        pshard__param_spec__init(&specs[i]);
        specs[i].name = (char *)(params[i].name ? params[i].name : "");
        specs[i].n_shape = (size_t)params[i].ndim;
        specs[i].shape = (int64_t *)params[i].shape;
        sptrs[i] = &specs[i];
    }
    /* Twice what everything needs at once, so first fit cannot fail for want of a hole; it
     * costs address space only, as pages are backed when first used. */
    size_t pool = mc->pool_bytes ? client_align(mc->pool_bytes) : 2 * all_bytes;
    stable_bytes = (stable_bytes + page - 1) / page * page;
    size_t bytes = stable_bytes + pool > init_bytes ? stable_bytes + pool : init_bytes;
    new_pool = client_pool_create(stable_bytes, pool);
    if (!new_pool) {
        rc = client_fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    region_t model = {0};
    char err[PSHARD_ERRLEN] = "";
    rc = client_region_create(&model, bytes, "model", c->cfg.remote, false, err, sizeof(err));
    if (rc != PSHARD_OK) {
        client_fail(c, rc, "%s", err);
        goto out;
    }
    /* Initial values go at the start of the region (it is free until the first gather). */
    if (need_init) {
        for (size_t i = 0; i < nparams; i++) {
            if (!init[i]) {
                client_region_destroy(&model);
                rc = client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                                 "initial values of '%s' are missing", params[i].name);
                goto out;
            }
            memcpy((uint8_t *)model.base + init_offsets[i], init[i], numel[i] * 4);
        }
    }
    if (c->cfg.remote) {
        /* The server creates its copy of the region; initial values travel in chunks. */
        rc = client_remote_write(c, PSHARD__REGION__MODEL, &model, 0, need_init ? init_bytes : 0,
                                 model.bytes, err, sizeof(err));
        if (rc != PSHARD_OK) {
            client_region_destroy(&model);
            client_fail(c, rc, "uploading the model region: %s", err);
            goto out;
        }
    }
    Pshard__OptimizerConfig oc = PSHARD__OPTIMIZER_CONFIG__INIT;
    oc.kind = mc->optimizer == PSHARD_ADAM    ? PSHARD__OPTIMIZER_KIND__ADAM
              : mc->optimizer == PSHARD_ADAMW ? PSHARD__OPTIMIZER_KIND__ADAMW
                                              : PSHARD__OPTIMIZER_KIND__SGD;
    oc.lr = mc->lr;
    oc.momentum = mc->momentum;
    oc.dampening = mc->dampening;
    oc.nesterov = mc->nesterov;
    oc.weight_decay = mc->weight_decay;
    oc.beta1 = mc->beta1;
    oc.beta2 = mc->beta2;
    oc.eps = mc->eps;
    oc.max_grad_norm = mc->max_grad_norm;
    oc.in_backward = mc->optimizer_in_backward;
    Pshard__DefineModelRequest req = PSHARD__DEFINE_MODEL_REQUEST__INIT;
    req.session = c->session;
    req.n_params = nparams;
    req.params = sptrs;
    req.layout = mc->layout == PSHARD_LAYOUT_FSDP1 ? PSHARD__LAYOUT__FSDP1 : PSHARD__LAYOUT__FSDP2;
    req.optimizer = &oc;
    req.init =
        mc->init_from_rank0 ? PSHARD__INIT_MODE__INIT_FROM_RANK0 : PSHARD__INIT_MODE__INIT_LOCAL;
    req.shm_name = model.name;
    req.shm_bytes = model.bytes;
    if (need_init) {
        req.n_init_offsets = nparams;
        req.init_offsets = init_offsets;
    }
    pb_groups_t pg;
    if (!pb_groups_make(&pg, mc->groups, mc->ngroups)) {
        client_region_destroy(&model);
        rc = client_fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    req.n_groups = pg.n;
    req.groups = pg.ptrs;
    req.n_param_groups = mc->ngroups ? nparams : 0;
    req.param_groups = (uint32_t *)mc->param_groups;
    req.replicate = mc->replicate;
    req.shard = mc->shard;
    req.device_region_bytes = mc->device_region && !c->cfg.remote ? stable_bytes + pool : 0;
    ProtobufCMessage *dresp = NULL;
    rc = client_region_link(&model, err, sizeof(err)); /* named only while the server opens it */
    if (rc == PSHARD_OK) {
        /* The server frees the old model's device memory when it takes the new one: close
         * it first (and open it again if the definition is refused). */
        pthread_mutex_lock(&c->mu);
        client_shard_suspend(&c->shard);
        client_dev_close(&c->region_dev);
        pthread_mutex_unlock(&c->mu);
        rc = client_call(c, "DefineModel", &req.base, &pshard__define_model_response__descriptor,
                         &dresp, err, sizeof(err));
        if (rc != PSHARD_OK) {
            pthread_mutex_lock(&c->mu);
            client_shard_resume(&c->shard);
            if (c->region_dev.memory != PSHARD_MEMORY_HOST) {
                char why[PSHARD_ERRLEN] = "";
                if (client_dev_open(&c->region_dev, NULL, why, sizeof(why)) != PSHARD_OK)
                    PS_WARN(PS_SUB_CLIENT,
                            "cannot open the model region in the shard server's GPU memory "
                            "again after a refused definition (%s): define the model again",
                            why);
            }
            pthread_mutex_unlock(&c->mu);
        }
    }
    client_region_unlink(&model);
    pb_groups_free(&pg);
    if (rc != PSHARD_OK) {
        client_region_destroy(&model);
        client_fail(c, rc, "DefineModel: %s", err);
        goto out;
    }
    const Pshard__DefineModelResponse *dr = (const Pshard__DefineModelResponse *)dresp;
    dev_map_t region_dev = {.memory = PSHARD_MEMORY_HOST, .device = -1};
    if (req.device_region_bytes && dr->region_device_handle.len) {
        rc = client_dev_set(&region_dev, dr->region_device_handle.data,
                            dr->region_device_handle.len, dr->region_device_kind, dr->region_device,
                            stable_bytes + pool, err, sizeof(err));
        if (rc == PSHARD_OK)
            rc = client_dev_open(&region_dev, dr->shard_shm_name, err, sizeof(err));
        if (rc != PSHARD_OK) {
            protobuf_c_message_free_unpacked(dresp, NULL);
            client_region_destroy(&model);
            client_fail(c, rc, "the model region in the shard server's GPU memory: %s", err);
            goto out;
        }
    }
    int64_t model_step = ((Pshard__DefineModelResponse *)dresp)->step;
    int64_t aborted_steps = ((Pshard__DefineModelResponse *)dresp)->aborted_steps;
    shard_map_t shard;
    client_shard_open(c, (const Pshard__DefineModelResponse *)dresp, params, nparams, numel, mc,
                      &shard);
    protobuf_c_message_free_unpacked(dresp, NULL);
    /* The initial values are consumed: their pages go back (in both processes). */
    if (need_init) {
        /* Up to the end of the last page: nothing else is in use yet, and a fixed buffer in
         * that page must read as zeros until its first gather. */
        size_t end = (init_bytes + page - 1) / page * page;
        client_region_discard(&model, 0, end < model.bytes ? end : model.bytes);
    }
    pthread_mutex_lock(&c->mu);
    client_region_destroy(&c->model);
    client_dev_close(&c->region_dev);
    client_model_free(c);
    c->model = model;
    c->region_dev = region_dev;
    c->numel = numel;
    c->pbuf = pbuf;
    c->gbuf = gbuf;
    c->pool = new_pool;
    c->stable_off = stable_off;
    c->remap = remap && !region_dev.base;
    c->page = page;
    stable_off = NULL;
    numel = NULL;
    pbuf = gbuf = NULL;
    new_pool = NULL;
    c->nparams = nparams;
    c->param_dtype = mc->param_dtype;
    c->reduce_dtype = mc->reduce_dtype;
    c->reshard_after_forward = mc->reshard_after_forward;
    c->max_gathers_in_flight = mc->max_gathers_in_flight;
    c->model_step = model_step;
    c->aborted_steps = aborted_steps;
    c->shard = shard;
    c->gathers_in_flight = 0;
    memset(&c->mem, 0, sizeof(c->mem));
    c->mem.pool_bytes = pool;
    pthread_mutex_unlock(&c->mu);
out:
    free(numel);
    free(stable_off);
    free(pbuf);
    free(gbuf);
    free(specs);
    free(sptrs);
    free(init_offsets);
    client_pool_destroy(new_pool);
    return rc;
}

int pshard_region_memory(pshard_client_t *c, int *device)
{
    pthread_mutex_lock(&c->mu);
    int memory = c->region_dev.base ? c->region_dev.memory : PSHARD_MEMORY_HOST;
    int dev = c->region_dev.base ? c->region_dev.device : -1;
    pthread_mutex_unlock(&c->mu);
    if (device)
        *device = dev;
    return memory;
}

void *pshard_param(pshard_client_t *c, size_t i)
{
    void *p = NULL;
    pthread_mutex_lock(&c->mu);
    if (i < c->nparams && c->pbuf[i].state == BUF_READY)
        p = client_region_base(c) + (c->stable_off ? c->stable_off[i] : c->pbuf[i].off);
    pthread_mutex_unlock(&c->mu);
    return p;
}

void *pshard_grad(pshard_client_t *c, size_t i)
{
    void *p = NULL;
    bool fresh = false;
    size_t bytes = 0;
    pthread_mutex_lock(&c->mu);
    if (i >= c->nparams) {
        client_fail(c, PSHARD_ERR_NOT_FOUND, "unknown parameter #%zu", i);
    } else if (c->gbuf[i].state == BUF_PENDING) {
        client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                    "the gradient of parameter #%zu is being reduce-scattered", i);
    } else if (c->gbuf[i].state == BUF_READY) {
        p = client_region_base(c) + c->gbuf[i].off;
    } else {
        bytes = c->numel[i] * pshard_dtype_size(c->reduce_dtype);
        size_t off;
        bool got;
        /* No room: the reduce-scatters and gathers in flight give blocks back as they finish
         * (a gather waits for them alike). */
        while (!(got = client_pool_alloc(c->pool, bytes, CLIENT_POOL_ALIGN, &off)) &&
               !client_idle(c))
            pthread_cond_wait(&c->cv, &c->mu);
        if (got) {
            p = client_region_base(c) + off;
            char why[PSHARD_ERRLEN] = "";
            if (c->region_dev.memory == PSHARD_MEMORY_HOST) {
                c->gbuf[i] = (tensor_buf_t){BUF_READY, off, bytes};
                fresh = true;
            } else if (client_dev_zero(&c->region_dev, p, bytes, why, sizeof(why)) == PSHARD_OK) {
                c->gbuf[i] = (tensor_buf_t){BUF_READY, off, bytes};
            } else {
                client_pool_free(c->pool, off, bytes);
                client_fail(c, PSHARD_ERR_CUDA, "zeroing the gradient of parameter #%zu: %s", i,
                            why);
                p = NULL;
            }
        } else {
            client_fail(c, PSHARD_ERR_NO_MEMORY,
                        "the %zu-byte pool cannot fit the %zu-byte gradient of parameter #%zu (%zu "
                        "bytes in use): reshard or reduce-scatter first, or raise pool_bytes%s",
                        c->mem.pool_bytes, bytes, i, c->pool->in_use_bytes, client_pool_hint(c));
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (fresh)
        memset(p, 0, bytes);
    return p;
}

void *pshard_param_buffer(pshard_client_t *c, size_t i)
{
    void *p = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->stable_off && i < c->nparams)
        p = client_region_base(c) + c->stable_off[i];
    pthread_mutex_unlock(&c->mu);
    return p;
}

size_t pshard_param_numel(const pshard_client_t *c, size_t i)
{
    return i < c->nparams ? c->numel[i] : 0;
}

void pshard_memory_stats(pshard_client_t *c, pshard_memory_stats_t *out)
{
    pthread_mutex_lock(&c->mu);
    *out = c->mem;
    if (c->pool) {
        out->in_use_bytes = c->pool->in_use_bytes;
        out->peak_in_use_bytes = c->pool->peak_in_use_bytes;
        out->touched_bytes = c->pool->touched_bytes;
    }
    pthread_mutex_unlock(&c->mu);
}

/* What pshard_step, pshard_step_groups, pshard_step_trainer and pshard_set_step share: one
 * Step with this step's lr (set_lr), every group's hyperparameters (groups, ngroups > 0), or
 * none of them for a step the trainer's own optimizer took (trainer_stepped 1; 2: and the
 * trainer keeps that optimizer's state for a replacement) or one that sets the count
 * (set_step_to >= 0). */
static pshard_status_t step_request(pshard_client_t *c, bool set_lr, double lr,
                                    const pshard_optim_group_t *groups, size_t ngroups,
                                    int trainer_stepped, int64_t set_step_to, const uint8_t *skip,
                                    size_t skip_bytes, int64_t *step, double *grad_norm)
{
    Pshard__StepRequest req = PSHARD__STEP_REQUEST__INIT;
    req.session = c->session;
    req.skip.data = (uint8_t *)skip;
    req.skip.len = skip ? skip_bytes : 0;
    req.trainer_stepped = trainer_stepped != 0;
    req.trainer_state_kept = trainer_stepped == 2;
    if (set_step_to >= 0) {
        req.set_step = true;
        req.set_step_to = set_step_to;
    }
    if (set_lr) {
        req.lr = lr;
        req.set_lr = true;
    }
    pb_groups_t pg;
    if (!pb_groups_make(&pg, groups, ngroups))
        return client_fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
    req.n_groups = pg.n;
    req.groups = pg.ptrs;
    ProtobufCMessage *resp = NULL;
    char err[PSHARD_ERRLEN] = "";
    /* Reductions issued before the step are part of it, so it waits for them. The step
     * changes every parameter: full copies are stale from here on (FSDP reshards after
     * backward anyway). */
    pthread_mutex_lock(&c->mu);
    client_wait_idle(c);
    client_params_reset(c);
    pthread_mutex_unlock(&c->mu);
    pshard_status_t rc = client_call(c, "Step", &req.base, &pshard__step_response__descriptor,
                                     &resp, err, sizeof(err));
    pb_groups_free(&pg);
    if (rc != PSHARD_OK)
        return client_fail(c, rc, "Step: %s", err);
    Pshard__StepResponse *r = (Pshard__StepResponse *)resp;
    if (step)
        *step = r->step;
    if (grad_norm)
        *grad_norm = r->grad_norm;
    protobuf_c_message_free_unpacked(resp, NULL);
    return PSHARD_OK;
}

pshard_status_t pshard_step(pshard_client_t *c, double lr, int64_t *step, double *grad_norm)
{
    return step_request(c, lr >= 0, lr, NULL, 0, 0, -1, NULL, 0, step, grad_norm);
}

pshard_status_t pshard_step_trainer(pshard_client_t *c, int64_t *step)
{
    if (!c->nparams)
        return client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                           "no model is defined: call pshard_define_model first");
    return step_request(c, false, 0.0, NULL, 0, 1, -1, NULL, 0, step, NULL);
}

pshard_status_t pshard_step_trainer_kept(pshard_client_t *c, int64_t *step)
{
    if (!c->nparams)
        return client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                           "no model is defined: call pshard_define_model first");
    return step_request(c, false, 0.0, NULL, 0, 2, -1, NULL, 0, step, NULL);
}

pshard_status_t pshard_report_step(pshard_client_t *c, uint64_t tokens, uint64_t samples)
{
    if (tokens > ((uint64_t)1 << 53) || samples > ((uint64_t)1 << 53))
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "a step reports at most 2^53 tokens and samples (got %llu, %llu)",
                           (unsigned long long)tokens, (unsigned long long)samples);
    Pshard__MarkStepRequest req = PSHARD__MARK_STEP_REQUEST__INIT;
    req.session = c->session;
    req.tokens = tokens;
    req.samples = samples;
    ProtobufCMessage *resp = NULL;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = client_call(
        c, "MarkStep", &req.base, &pshard__mark_step_response__descriptor, &resp, err, sizeof(err));
    if (rc != PSHARD_OK)
        return client_fail(c, rc, "MarkStep: %s", err);
    protobuf_c_message_free_unpacked(resp, NULL);
    return PSHARD_OK;
}

pshard_status_t pshard_set_step(pshard_client_t *c, int64_t step)
{
    if (!c->nparams)
        return client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                           "no model is defined: call pshard_define_model first");
    if (step < 0)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "step count %lld is negative",
                           (long long)step);
    return step_request(c, false, 0.0, NULL, 0, 0, step, NULL, 0, NULL, NULL);
}

pshard_status_t pshard_step_groups(pshard_client_t *c, const pshard_optim_group_t *groups,
                                   size_t ngroups, int64_t *step, double *grad_norm)
{
    if (ngroups == 0 || !groups)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "pshard_step_groups needs every group's hyperparameters (ngroups >= 1)");
    return step_request(c, false, 0.0, groups, ngroups, 0, -1, NULL, 0, step, grad_norm);
}

pshard_status_t pshard_step_groups_skip(pshard_client_t *c, const pshard_optim_group_t *groups,
                                        size_t ngroups, const uint8_t *skip, size_t skip_bytes,
                                        int64_t *step, double *grad_norm)
{
    if (ngroups == 0 || !groups)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "pshard_step_groups_skip needs every group's hyperparameters "
                           "(ngroups >= 1)");
    if (skip_bytes > 0 && !skip)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "a skip mask of %zu bytes is NULL",
                           skip_bytes);
    return step_request(c, false, 0.0, groups, ngroups, 0, -1, skip, skip_bytes, step, grad_norm);
}

/* PSHARD_OK once a model is defined and everything issued before it has finished. */
static pshard_status_t model_drained(pshard_client_t *c)
{
    if (!c->nparams)
        return client_fail(c, PSHARD_ERR_FAILED_PRECONDITION, "no model is defined");
    pthread_mutex_lock(&c->mu);
    client_wait_idle(c);
    pthread_mutex_unlock(&c->mu);
    return PSHARD_OK;
}

pshard_status_t pshard_clip_grad_norm(pshard_client_t *c, double max_norm, double norm_type,
                                      double *total_norm)
{
    /* The reduce-scatters issued before are part of the gradients it clips. */
    PS_CHECK(model_drained(c));
    Pshard__ClipGradNormRequest req = PSHARD__CLIP_GRAD_NORM_REQUEST__INIT;
    req.session = c->session;
    req.max_norm = max_norm;
    req.norm_type = norm_type;
    ProtobufCMessage *resp = NULL;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc =
        client_call(c, "ClipGradNorm", &req.base, &pshard__clip_grad_norm_response__descriptor,
                    &resp, err, sizeof(err));
    if (rc != PSHARD_OK)
        return client_fail(c, rc, "ClipGradNorm: %s", err);
    if (total_norm)
        *total_norm = ((const Pshard__ClipGradNormResponse *)resp)->total_norm;
    protobuf_c_message_free_unpacked(resp, NULL);
    return PSHARD_OK;
}

int64_t pshard_model_step(const pshard_client_t *c)
{
    return c->model_step;
}

int64_t pshard_resume_step(const pshard_client_t *c)
{
    return c->model_step + c->aborted_steps;
}

pshard_status_t pshard_resync(pshard_client_t *c, int64_t *next_step)
{
    if (!c->nparams)
        return client_fail(c, PSHARD_ERR_FAILED_PRECONDITION, "resync: no model is defined");
    /* What was issued before fails too (the server refuses it until the Resync); then nothing
     * of the aborted step is held: full parameters and gradients go back to the pool. */
    pthread_mutex_lock(&c->mu);
    client_wait_idle(c);
    client_params_reset(c);
    for (size_t i = 0; i < c->nparams; i++)
        client_buf_release(c, &c->gbuf[i]);
    pthread_mutex_unlock(&c->mu);
    Pshard__ResyncRequest req = PSHARD__RESYNC_REQUEST__INIT;
    req.session = c->session;
    ProtobufCMessage *resp = NULL;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc = client_call(c, "Resync", &req.base, &pshard__resync_response__descriptor,
                                     &resp, err, sizeof(err));
    if (rc != PSHARD_OK)
        return client_fail(c, rc, "Resync: %s", err);
    const Pshard__ResyncResponse *r = (const Pshard__ResyncResponse *)resp;
    c->model_step = r->step;
    c->aborted_steps = r->aborted_steps;
    protobuf_c_message_free_unpacked(resp, NULL);
    if (next_step)
        *next_step = c->model_step + c->aborted_steps;
    return PSHARD_OK;
}

pshard_status_t pshard_checkpoint_save(pshard_client_t *c, int64_t *step, char *dir, size_t dirlen)
{
    PS_CHECK(model_drained(c));
    Pshard__CheckpointRequest req = PSHARD__CHECKPOINT_REQUEST__INIT;
    req.session = c->session;
    ProtobufCMessage *resp = NULL;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc =
        client_call(c, "Checkpoint", &req.base, &pshard__checkpoint_response__descriptor, &resp,
                    err, sizeof(err));
    if (rc != PSHARD_OK)
        return client_fail(c, rc, "Checkpoint: %s", err);
    const Pshard__CheckpointResponse *r = (const Pshard__CheckpointResponse *)resp;
    if (step)
        *step = r->step;
    if (dir && dirlen)
        ps_strlcpy(dir, r->dir ? r->dir : "", dirlen);
    protobuf_c_message_free_unpacked(resp, NULL);
    return PSHARD_OK;
}
