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

#define SRV_PREFIX "/pshard-srv-"

/* An fp32 array of span bytes at off lies inside an object of bytes bytes, aligned. */
static bool array_fits(uint64_t off, size_t span, uint64_t bytes)
{
    return off % sizeof(float) == 0 && off <= bytes && span <= bytes - off;
}

/* The name looks like the server's own objects: "/pshard-srv-" then letters, digits, '-'. */
static bool name_ok(const char *name)
{
    size_t n = strlen(name), plen = strlen(SRV_PREFIX);
    if (n <= plen || n >= 64 || strncmp(name, SRV_PREFIX, plen) != 0)
        return false;
    for (size_t i = plen; i < n; i++) {
        char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '-'))
            return false;
    }
    return true;
}

/* Maps the object name of at least bytes bytes, read-write and shared; PSHARD_OK or the error
 * with its reason in err. */
static pshard_status_t map_object(const char *name, size_t bytes, void **base, char *err,
                                  size_t errlen)
{
    int fd = shm_open(name, O_RDWR | O_NOFOLLOW, 0);
    if (fd < 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot open %s: %s", name, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
        (uint64_t)st.st_size < bytes) {
        close(fd);
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM,
                       "%s is not a %zu-byte shared-memory object of this user", name, bytes);
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "mmap %s: %s", name, strerror(e));
    *base = p;
    return PSHARD_OK;
}

/* Opens the GPU-resident shard from out's handle (out->memory, device, dev_bytes and
 * dev_handle set): a CUDA IPC handle, or the emulated device's shared-memory object (a name
 * like the server's own objects, not the step counts' object steps_name). */
static pshard_status_t map_device(shard_map_t *out, const char *steps_name, char *err,
                                  size_t errlen)
{
    if (out->memory == PSHARD_MEMORY_CUDA)
        return client_cuda_ipc_open(out->dev_handle, out->dev_handle_len, out->device,
                                    &out->dev_base, err, errlen);
    char name[64];
    if (out->dev_handle_len >= sizeof(name))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "an emulated device handle of %zu bytes", out->dev_handle_len);
    memcpy(name, out->dev_handle, out->dev_handle_len);
    name[out->dev_handle_len] = '\0';
    if (!name_ok(name) || strcmp(name, steps_name) == 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "the emulated device memory's name is not one of the server's objects");
    return map_object(name, out->dev_bytes, &out->dev_base, err, errlen);
}

/* The server's GPU-resident shard from its DefineModel answer: kept (to open it again after a
 * suspension) and opened. */
static pshard_status_t open_device(const Pshard__DefineModelResponse *r, shard_map_t *out,
                                   char *err, size_t errlen)
{
    size_t len = r->shard_device_handle.len;
    if (r->shard_device < 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "CUDA device %d is not one",
                       (int)r->shard_device);
    if (len > sizeof(out->dev_handle))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "a device memory handle of %zu bytes", len);
    memcpy(out->dev_handle, r->shard_device_handle.data, len);
    out->dev_handle_len = len;
    out->dev_bytes = (size_t)r->shard_device_bytes;
    out->device = r->shard_device;
    out->memory =
        strcmp(r->shard_device_kind, "cuda") == 0 ? PSHARD_MEMORY_CUDA : PSHARD_MEMORY_EMULATED;
    return map_device(out, r->shard_shm_name, err, errlen);
}

/* Closes the GPU-resident mapping only. */
static void unmap_device(shard_map_t *s)
{
    if (s->memory == PSHARD_MEMORY_CUDA)
        client_cuda_ipc_close(s->dev_base);
    else if (s->dev_base)
        munmap(s->dev_base, s->dev_bytes);
    s->dev_base = NULL;
}

void client_shard_suspend(shard_map_t *s)
{
    if (s->base && s->dev_base)
        unmap_device(s);
}

void client_shard_resume(shard_map_t *s)
{
    if (!s->base || s->dev_base || s->memory == PSHARD_MEMORY_HOST)
        return;
    char why[PSHARD_ERRLEN] = "";
    if (map_device(s, "", why, sizeof(why)) != PSHARD_OK) {
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
    if (r->shard_elements != elems || !fits || !name_ok(name)) {
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
    rc = map_object(name, (size_t)r->shard_shm_bytes, &out->base, why, sizeof(why));
    if (rc == PSHARD_OK && on_dev) {
        rc = open_device(r, out, why, sizeof(why));
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
    if (r->n_trainer_state_names == 2 && name_ok(r->trainer_state_names[0]) &&
        name_ok(r->trainer_state_names[1]) &&
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
    unmap_device(s);
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
    } else if (s->memory != PSHARD_MEMORY_HOST && !s->dev_base) {
        rc = client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                         "the model is being defined again: its shard is closed until then");
    } else {
        size_t at = ps_layout_shard_offset(s->layout, i, s->rank);
        uint8_t *base = s->dev_base ? s->dev_base : s->base;
        out->master = (float *)(base + s->master_off) + at;
        out->grad = s->grad_off ? (float *)(base + s->grad_off) + at : NULL;
        out->state0 = s->state0_off ? (float *)(base + s->state0_off) + at : NULL;
        out->state1 = s->state1_off ? (float *)(base + s->state1_off) + at : NULL;
        out->step = (int64_t *)(void *)((uint8_t *)s->base + s->steps_off) + i;
        out->memory = s->memory;
        out->device = s->dev_base ? s->device : -1;
        out->numel = ps_layout_counts(s->layout, i)[s->rank];
        out->offset = ps_layout_piece_offset(s->layout, i, s->rank);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}
