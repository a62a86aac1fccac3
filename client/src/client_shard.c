/* libpshard's view of its shard server's memory: the shared-memory object in which the server
 * keeps this rank's fp32 master weights and gradient accumulator, mapped after DefineModel, and
 * each parameter's piece of it (pshard_shard_view), which a trainer-side optimizer updates in
 * place (pshard_step_trainer counts the step). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/util.h"

#include "client_internal.h"

/* An fp32 array of span bytes at off lies inside an object of bytes bytes, aligned. */
static bool array_fits(uint64_t off, size_t span, uint64_t bytes)
{
    return off % sizeof(float) == 0 && off <= bytes && span <= bytes - off;
}

void client_shard_suspend(shard_map_t *s)
{
    if (s->base && s->dev.base)
        client_dev_close(&s->dev);
}

void client_shard_resume(shard_map_t *s)
{
    if (!s->base || s->dev.base || s->dev.memory == PSHARD_MEMORY_HOST)
        return;
    char why[PSHARD_ERRLEN] = "";
    if (client_dev_open(&s->dev, NULL, why, sizeof(why)) != PSHARD_OK) {
        munmap(s->base, s->bytes);
        s->base = NULL;
        ps_snprintf(s->reason, sizeof(s->reason),
                    "cannot open the shard server's GPU-resident shard again after a refused "
                    "definition (%s); define the model again",
                    why);
    }
}

void client_shard_open(pshard_client_t *c, const Pshard__DefineModelResponse *r,
                       const pshard_param_t *params, size_t nparams, const size_t *numel,
                       const pshard_model_config_t *mc, shard_map_t *out)
{
    memset(out, 0, sizeof(*out));
    if (c->cfg.remote) {
        ps_strlcpy(out->reason,
                   "this trainer is remote (PSHARD_REMOTE=1): it cannot map its shard server's "
                   "memory; step with the shard servers' optimizer (pshard_step)",
                   sizeof(out->reason));
        return;
    }
    const char *name = r->shard_shm_name ? r->shard_shm_name : "";
    if (!name[0]) {
        ps_snprintf(out->reason, sizeof(out->reason),
                    "the shard server does not share the shard: %s",
                    r->shard_shared_reason && r->shard_shared_reason[0]
                        ? r->shard_shared_reason
                        : "it did not say why (an older pshard-server?); step with the shard "
                          "servers' optimizer (pshard_step)");
        return;
    }
    /* The layout over the shard ranks: the whole world, or HSDP's shard ranks of a replica
     * (world rank = replica * shard + shard index, as the servers shard). */
    int shards = mc->shard > 0 ? mc->shard : c->world;
    size_t *rows = calloc(nparams, sizeof(size_t));
    char why[PSHARD_ERRLEN] = "";
    if (!rows) {
        ps_strlcpy(out->reason, "out of memory", sizeof(out->reason));
        return;
    }
    for (size_t i = 0; i < nparams; i++)
        rows[i] = (size_t)params[i].shape[0];
    pshard_status_t rc = ps_layout_create(
        mc->layout == PSHARD_LAYOUT_FSDP1 ? PSHARD_LAYOUT_FSDP1 : PSHARD_LAYOUT_FSDP2, shards,
        nparams, numel, rows, &out->layout, why, sizeof(why));
    free(rows);
    if (rc != PSHARD_OK) {
        ps_snprintf(out->reason, sizeof(out->reason), "the shard's layout: %s", why);
        return;
    }
    out->rank = c->rank % shards;
    size_t elems = ps_layout_shard_numel(out->layout, out->rank);
    size_t span = elems * sizeof(float);
    /* GPU-resident shards: the arrays are in the device allocation, the steps in the object. */
    const char *kind = r->shard_device_kind ? r->shard_device_kind : "";
    bool on_dev = r->shard_device_handle.len > 0;
    uint64_t arrays = on_dev ? r->shard_device_bytes : r->shard_shm_bytes;
    bool fits = array_fits(r->shard_master_offset, span, arrays) &&
                (r->shard_grad_offset == 0 || array_fits(r->shard_grad_offset, span, arrays)) &&
                (r->shard_state0_offset == 0 || array_fits(r->shard_state0_offset, span, arrays)) &&
                (r->shard_state1_offset == 0 || array_fits(r->shard_state1_offset, span, arrays)) &&
                (on_dev || r->shard_steps_offset != 0) &&
                r->shard_steps_offset % sizeof(int64_t) == 0 &&
                array_fits(r->shard_steps_offset, nparams * sizeof(int64_t), r->shard_shm_bytes) &&
                (!on_dev || strcmp(kind, "cuda") == 0 || strcmp(kind, "emulated") == 0);
    if (r->shard_elements != elems || !fits || !client_srv_name_ok(name)) {
        ps_snprintf(out->reason, sizeof(out->reason),
                    "the shard server announced a shard this client cannot place (%llu elements "
                    "where the layout gives rank %d of %d %zu, object %.64s of %llu bytes%s%.16s); "
                    "step with the shard servers' optimizer (pshard_step)",
                    (unsigned long long)r->shard_elements, out->rank, shards, elems, name,
                    (unsigned long long)r->shard_shm_bytes, on_dev ? ", device memory " : "",
                    on_dev ? kind : "");
        ps_layout_destroy(out->layout);
        out->layout = NULL;
        return;
    }
    rc = client_map_object(name, (size_t)r->shard_shm_bytes, &out->base, why, sizeof(why));
    if (rc == PSHARD_OK && on_dev) {
        rc = client_dev_set(&out->dev, r->shard_device_handle.data, r->shard_device_handle.len,
                            kind, r->shard_device, r->shard_device_bytes, why, sizeof(why));
        if (rc == PSHARD_OK)
            rc = client_dev_open(&out->dev, name, why, sizeof(why));
        if (rc != PSHARD_OK) {
            munmap(out->base, (size_t)r->shard_shm_bytes);
            out->base = NULL;
        }
    }
    if (rc != PSHARD_OK) {
        ps_snprintf(out->reason, sizeof(out->reason),
                    "cannot map the shard server's %s (%s); step with the shard servers' "
                    "optimizer (pshard_step)",
                    on_dev ? "GPU-resident shard" : "shared memory", why);
        ps_layout_destroy(out->layout);
        out->layout = NULL;
        return;
    }
    out->bytes = (size_t)r->shard_shm_bytes;
    out->master_off = (size_t)r->shard_master_offset;
    out->grad_off = (size_t)r->shard_grad_offset;
    out->state0_off = (size_t)r->shard_state0_offset;
    out->state1_off = (size_t)r->shard_state1_offset;
    out->steps_off = (size_t)r->shard_steps_offset;
    out->replace_ms = r->trainer_replace_ms > 0 ? r->trainer_replace_ms : 0;
    if (r->n_trainer_state_names == 2 && client_srv_name_ok(r->trainer_state_names[0]) &&
        client_srv_name_ok(r->trainer_state_names[1]) &&
        strcmp(r->trainer_state_names[0], r->trainer_state_names[1]) != 0 &&
        strcmp(r->trainer_state_names[0], name) != 0 &&
        strcmp(r->trainer_state_names[1], name) != 0) {
        ps_strlcpy(out->state_names[0], r->trainer_state_names[0], sizeof(out->state_names[0]));
        ps_strlcpy(out->state_names[1], r->trainer_state_names[1], sizeof(out->state_names[1]));
    }
}

pshard_status_t pshard_trainer_state_info(pshard_client_t *c, pshard_trainer_state_info_t *out)
{
    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc = PSHARD_OK;
    const shard_map_t *s = &c->shard;
    if (!c->nparams) {
        rc = client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                         "no model is defined: call pshard_define_model first");
    } else if (!s->base) {
        rc = client_fail(c, PSHARD_ERR_FAILED_PRECONDITION, "%s", s->reason);
    } else if (!s->state_names[0][0]) {
        rc = client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                         "the shard server named no object for a trainer optimizer's state (an "
                         "older pshard-server?)");
    } else {
        out->trainer_replace_ms = s->replace_ms;
        for (int i = 0; i < 2; i++)
            ps_strlcpy(out->names[i], s->state_names[i], sizeof(out->names[i]));
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void client_shard_close(shard_map_t *s)
{
    if (s->base)
        munmap(s->base, s->bytes);
    client_dev_close(&s->dev);
    ps_layout_destroy(s->layout);
    memset(s, 0, sizeof(*s));
}

pshard_status_t pshard_shard_view(pshard_client_t *c, size_t i, pshard_shard_view_t *out)
{
    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc = PSHARD_OK;
    const shard_map_t *s = &c->shard;
    if (!c->nparams) {
        rc = client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                         "no model is defined: call pshard_define_model first");
    } else if (i >= c->nparams) {
        rc = client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "parameter #%zu: the model has %zu", i,
                         c->nparams);
    } else if (!s->base) {
        rc = client_fail(c, PSHARD_ERR_FAILED_PRECONDITION, "%s", s->reason);
    } else if (s->dev.memory != PSHARD_MEMORY_HOST && !s->dev.base) {
        rc = client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                         "the model is being defined again: its shard is closed until then");
    } else {
        size_t at = ps_layout_shard_offset(s->layout, i, s->rank);
        uint8_t *base = s->dev.base ? s->dev.base : s->base;
        out->master = (float *)(base + s->master_off) + at;
        out->grad = s->grad_off ? (float *)(base + s->grad_off) + at : NULL;
        out->state0 = s->state0_off ? (float *)(base + s->state0_off) + at : NULL;
        out->state1 = s->state1_off ? (float *)(base + s->state1_off) + at : NULL;
        out->step = (int64_t *)(void *)((uint8_t *)s->base + s->steps_off) + i;
        out->memory = s->dev.memory;
        out->device = s->dev.base ? s->dev.device : -1;
        out->numel = ps_layout_counts(s->layout, i)[s->rank];
        out->offset = ps_layout_piece_offset(s->layout, i, s->rank);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}
