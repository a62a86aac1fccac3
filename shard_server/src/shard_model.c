/* A shard server's model state: the definition (checked, laid out, compared across ranks), the
 * storage of this rank's shards (host, shared or GPU-resident) and the parameter groups; see
 * shard_model.h. The numerics on the slices are shard_model_ops.c's. */
#include "shard_model.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "pshard/collectives.h"
#include "pshard/log.h"
#include "pshard/shm_names.h"
#include "pshard/util.h"
#include "shard_cuda.h"

#define HUGE_PAGE (2u << 20)
#define SMALL_PAGE 4096u
/* Arrays from this size on come from huge pages: rounding up to one wastes under 1/16. */
#define HUGE_FROM (32u << 20)

/* The mapped length of an array of n bytes: whole huge pages for a large array, whole small
 * pages for a smaller one (a few MiB rounded up to 2 MiB, all of it touched, would waste up to
 * half: 5.6 MiB of the 4x256 example's 26 MiB of state). */
static size_t touched_len(size_t n)
{
    size_t page = n >= HUGE_FROM ? HUGE_PAGE : SMALL_PAGE;
    return ((n ? n : 1) + page - 1) / page * page;
}

/* Zeroed memory whose pages are backed now, not at the first step or checkpoint load, from
 * transparent huge pages where the kernel allows (512x fewer page faults for state arrays of
 * hundreds of MiB). malloc + memset would not do: the compiler turns that into calloc, which
 * leaves the pages untouched. Free with shard_model_free_touched and the same n. */
void *shard_model_alloc_touched(size_t n)
{
    size_t len = touched_len(n);
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    if (len >= HUGE_FROM)
        madvise(p, len, MADV_HUGEPAGE);
    memset(p, 0, len);
    return p;
}

void shard_model_free_touched(void *p, size_t n)
{
    if (p)
        munmap(p, touched_len(n));
}

/* The storage arrays and their mapped lengths, for pinning (NULL entries are absent). */
static size_t storage(shard_model_t *m, void **ptrs, size_t *lens)
{
    size_t bytes = m->shard_numel * sizeof(float);
    void *all[5] = {m->master, m->grad, m->state0, m->state1, m->stage};
    size_t sizes[5] = {bytes, bytes, bytes, bytes, m->max_piece * 4};
    size_t n = 0;
    for (size_t i = 0; i < 5; i++) {
        if (all[i]) {
            ptrs[n] = all[i];
            lens[n++] = touched_len(sizes[i]);
        }
    }
    return n;
}

pshard_status_t shard_model_pin(shard_model_t *m, int device, char *err, size_t errlen)
{
    if (m->dev)
        return PSHARD_OK; /* nothing of it is in host memory */
    void *ptrs[5];
    size_t lens[5];
    size_t n = storage(m, ptrs, lens);
    for (size_t i = 0; i < n; i++) {
        pshard_status_t rc = pshard_host_pin(device, ptrs[i], lens[i], err, errlen);
        if (rc != PSHARD_OK) {
            while (i-- > 0)
                pshard_host_unpin(device, ptrs[i]);
            return rc;
        }
    }
    m->pinned = true;
    m->pin_device = device;
    return PSHARD_OK;
}

void shard_model_free(shard_model_t *m)
{
    if (!m)
        return;
    pshard_comm_destroy(m->shard_comm);
    pshard_comm_destroy(m->replicate_comm);
    if (m->pinned) {
        void *ptrs[5];
        size_t lens[5];
        size_t n = storage(m, ptrs, lens);
        for (size_t i = 0; i < n; i++)
            pshard_host_unpin(m->pin_device, ptrs[i]);
    }
    if (m->params) {
        for (size_t i = 0; i < m->nparams; i++)
            free(m->params[i].name);
        free(m->params);
    }
    ps_layout_destroy(m->layout);
    size_t bytes = m->shard_numel * sizeof(float);
    if (m->shm.base) {
        /* The trainer's optimizer state, if its trainer made one (else ENOENT). */
        for (int i = 0; i < 2; i++)
            if (m->trainer_state_names[i][0] && shm_unlink(m->trainer_state_names[i]) != 0 &&
                errno != ENOENT)
                PS_WARN(PS_SUB_SHARD, "cannot remove %s: %s", m->trainer_state_names[i],
                        strerror(errno));
    }
    if (m->dev) {
        if (m->region_dev.bytes)
            m->dev->free_shared(m->device, &m->region_dev);
        if (m->dev_shared.bytes) {
            m->dev->free_shared(m->device, &m->dev_shared); /* master, grad and the state */
            m->dev->free_mem(m->device, m->stage);
        } else {
            void *arrays[5] = {m->master, m->grad, m->state0, m->state1, m->stage};
            for (int i = 0; i < 5; i++)
                m->dev->free_mem(m->device, arrays[i]);
        }
        if (m->shm.base)
            shard_shm_destroy(&m->shm); /* the step counts */
        else
            free(m->psteps);
    } else {
        if (m->shm.base) {
            shard_shm_destroy(&m->shm); /* master, grad and the state */
        } else {
            shard_model_free_touched(m->master, bytes);
            shard_model_free_touched(m->grad, bytes);
            shard_model_free_touched(m->state0, bytes);
            shard_model_free_touched(m->state1, bytes);
            free(m->psteps);
        }
        shard_model_free_touched(m->stage, m->max_piece * 4);
        shard_model_free_touched(m->unit_stage, m->unit_stage_bytes);
    }
    free(m->reduced);
    free(m->spec_text);
    free(m->groups);
    free(m->param_group);
    free(m);
}

/* Lays master, (without in_backward) grad and the nstate optimizer state arrays out in base,
 * each span bytes from the last (master at 0), with their offsets; returns where they end. */
static size_t place_arrays(shard_model_t *m, void *base, size_t span, bool in_backward, int nstate)
{
    float **arrays[3] = {&m->grad, &m->state0, &m->state1};
    size_t *offs[3] = {&m->shm_grad_off, &m->shm_state0_off, &m->shm_state1_off};
    bool made[3] = {!in_backward, nstate >= 1, nstate >= 2};
    m->master = base;
    m->shm_master_off = 0;
    size_t at = span;
    for (int i = 0; i < 3; i++) {
        if (!made[i])
            continue;
        *offs[i] = at;
        *arrays[i] = (float *)((uint8_t *)base + at);
        at += span;
    }
    return at;
}

/* Names for the object a trainer's own optimizer keeps its state in (none when they cannot be
 * made). */
static void name_trainer_state(shard_model_t *m)
{
    if (ps_shm_name(PS_SHM_SERVER, m->trainer_state_names[0], 64) != 0 ||
        ps_shm_name(PS_SHM_SERVER, m->trainer_state_names[1], 64) != 0)
        m->trainer_state_names[0][0] = m->trainer_state_names[1][0] = '\0';
}

/* Host storage the trainer can map: master, (without in_backward) grad and the nstate
 * optimizer state arrays in one new shared-memory object, each array at the start of its own
 * touched_len span, so pinning and huge pages work on them as on shard_model_alloc_touched's.
 * When no_share is set, or the object cannot be made, m->shm stays empty and m->shared_reason
 * says why (the caller allocates privately). */
static void alloc_shared(shard_model_t *m, size_t bytes, bool in_backward, int nstate,
                         const char *no_share)
{
    if (no_share) {
        ps_strlcpy(m->shared_reason, no_share, sizeof(m->shared_reason));
        return;
    }
    size_t span = touched_len(bytes), total = span * (size_t)(1 + !in_backward + nstate);
    total += touched_len(m->nparams * sizeof(int64_t)); /* psteps */
    char why[PSHARD_ERRLEN] = "";
    if (shard_shm_create(total, HUGE_FROM, &m->shm, why, sizeof(why)) != PSHARD_OK) {
        PS_WARN(PS_SUB_SHARD, "the shard stays private to this server: %s", why);
        ps_snprintf(m->shared_reason, sizeof(m->shared_reason),
                    "the shard server could not put the shard in shared memory (%s); step with the "
                    "shard servers' optimizer (pshard_step) or give /dev/shm more room",
                    why);
        return;
    }
    name_trainer_state(m);
    size_t at = place_arrays(m, m->shm.base, span, in_backward, nstate);
    m->shm_steps_off = at;
    m->psteps = (int64_t *)((uint8_t *)m->shm.base + at);
}

/* GPU-resident storage shared with the trainer: master, grad and the state arrays in one
 * shareable device allocation (each at a 256-byte aligned offset, as cudaMalloc aligns), the
 * step counts and the names for the trainer's optimizer state in a small host object. false,
 * with m->shared_reason saying why, when either cannot be made (the caller allocates
 * privately). */
static bool alloc_device_shared(shard_model_t *m, size_t bytes, bool in_backward, int nstate)
{
    size_t span = (bytes + 255) & ~(size_t)255, total = span * (size_t)(1 + !in_backward + nstate);
    char why[PSHARD_ERRLEN] = "";
    if (!m->dev->alloc_shared) {
        ps_strlcpy(why, "this device cannot share its memory", sizeof(why));
    } else if (m->dev->alloc_shared(m->device, total, &m->dev_shared, why, sizeof(why)) ==
               PSHARD_OK) {
        if (shard_shm_create(touched_len(m->nparams * sizeof(int64_t)), HUGE_FROM, &m->shm, why,
                             sizeof(why)) == PSHARD_OK) {
            place_arrays(m, m->dev_shared.ptr, span, in_backward, nstate);
            m->shm_steps_off = 0;
            m->psteps = m->shm.base;
            name_trainer_state(m);
            return true;
        }
        m->dev->free_shared(m->device, &m->dev_shared);
    }
    PS_WARN(PS_SUB_SHARD, "the GPU-resident shard stays private to this server: %s", why);
    ps_snprintf(m->shared_reason, sizeof(m->shared_reason),
                "the shard server could not share its GPU-resident shard (%s); step with the "
                "shard servers' optimizer (pshard_step) or start them with --offload cpu",
                why);
    return false;
}

/* GPU-resident storage: the same arrays in zeroed device memory. */
static pshard_status_t alloc_on_device(shard_model_t *m, size_t bytes, bool in_backward, int nstate,
                                       char *err, size_t errlen)
{
    void *p = NULL;
    PS_CHECK(m->dev->alloc(m->device, bytes, &p, err, errlen));
    m->master = p;
    if (!in_backward) {
        PS_CHECK(m->dev->alloc(m->device, bytes, &p, err, errlen));
        m->grad = p;
    }
    if (nstate >= 1) {
        PS_CHECK(m->dev->alloc(m->device, bytes, &p, err, errlen));
        m->state0 = p;
    }
    if (nstate >= 2) {
        PS_CHECK(m->dev->alloc(m->device, bytes, &p, err, errlen));
        m->state1 = p;
    }
    return m->dev->alloc(m->device, m->max_piece * 4, &m->stage, err, errlen);
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Appends one parameter's canonical line to a growing text buffer. */
static int append(char **buf, size_t *len, size_t *cap, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int append(char **buf, size_t *len, size_t *cap, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(*buf + *len, *cap - *len, fmt, ap);
        va_end(ap);
        if (n < 0)
            return -1;
        if ((size_t)n < *cap - *len) {
            *len += (size_t)n;
            return 0;
        }
        size_t ncap = *cap * 2 + (size_t)n;
        char *p = realloc(*buf, ncap);
        if (!p)
            return -1;
        *buf = p;
        *cap = ncap;
    }
}

/* Validates one group's hyperparameters for kind by torch's rules; errors name the group. */
static pshard_status_t check_group(ps_optim_kind_t kind, const shard_group_t *g, size_t index,
                                   char *err, size_t errlen)
{
    ps_optim_config_t cfg = g->cfg;
    cfg.kind = kind;
    char why[PSHARD_ERRLEN] = "";
    if (ps_optim_validate(&cfg, why, sizeof(why)) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "group %zu: %s", index, why);
    return PSHARD_OK;
}

/* The model's groups: the given ones (kind from optim) or one from optim; each parameter's
 * group; whether any is frozen; how many state arrays the optimizer needs (SGD: one when a
 * trained group has momentum). Errors are INVALID_ARGUMENT naming the group or parameter. */
static pshard_status_t setup_groups(shard_model_t *m, const ps_optim_config_t *optim,
                                    const shard_group_t *groups, size_t ngroups,
                                    const uint32_t *param_groups, size_t nparam_groups, char *err,
                                    size_t errlen)
{
    m->ngroups = ngroups ? ngroups : 1;
    m->explicit_groups = ngroups > 0;
    m->groups = calloc(m->ngroups, sizeof(*m->groups));
    m->param_group = calloc(m->nparams, sizeof(*m->param_group));
    if (!m->groups || !m->param_group)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    if (ngroups == 0) {
        m->groups[0].cfg = *optim;
    } else {
        if (nparam_groups != m->nparams)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "param_groups has %zu entries for %zu parameters (one group index "
                           "per parameter)",
                           nparam_groups, m->nparams);
        for (size_t g = 0; g < ngroups; g++) {
            PS_CHECK(check_group(optim->kind, &groups[g], g, err, errlen));
            m->groups[g] = groups[g];
            m->groups[g].cfg.kind = optim->kind;
            m->any_frozen = m->any_frozen || groups[g].frozen;
        }
        for (size_t p = 0; p < m->nparams; p++) {
            if (param_groups[p] >= ngroups)
                return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                               "parameter '%s' is assigned to group %" PRIu32
                               ", but there are %zu groups",
                               m->params[p].name, param_groups[p], ngroups);
            m->param_group[p] = param_groups[p];
        }
    }
    m->optim = m->groups[0].cfg;
    m->nstate = optim->kind == PS_OPTIM_SGD ? 0 : 2;
    for (size_t g = 0; g < m->ngroups && optim->kind == PS_OPTIM_SGD; g++)
        if (!m->groups[g].frozen && m->groups[g].cfg.momentum != 0.0)
            m->nstate = 1;
    return PSHARD_OK;
}

/* Group g's line of the definition text (explicit groups only). */
static int append_group(char **buf, size_t *len, size_t *cap, const shard_group_t *g, size_t i)
{
    const ps_optim_config_t *c = &g->cfg;
    return append(buf, len, cap,
                  "group %zu lr %.17g momentum %.17g dampening %.17g nesterov %d weight_decay "
                  "%.17g betas %.17g %.17g eps %.17g%s\n",
                  i, c->lr, c->momentum, c->dampening, (int)c->nesterov, c->weight_decay, c->beta1,
                  c->beta2, c->eps, g->frozen ? " frozen" : "");
}

static void format_param(const shard_param_t *p, char *buf, size_t len)
{
    size_t off = 0;
    int n = snprintf(buf, len, "%s [", p->name);
    off = n > 0 ? (size_t)n : 0;
    for (int d = 0; d < p->ndim && off < len; d++) {
        n = snprintf(buf + off, len - off, "%s%" PRId64, d ? ", " : "", p->shape[d]);
        off += n > 0 ? (size_t)n : 0;
    }
    if (off < len)
        snprintf(buf + off, len - off, "]");
}

pshard_status_t shard_model_create(
    int rank, int world, pshard_layout_t layout, size_t nparams, const char *const *names,
    const int64_t *const *shapes, const size_t *ndims, const ps_optim_config_t *optim,
    const shard_group_t *groups, size_t ngroups, const uint32_t *param_groups, size_t nparam_groups,
    double max_grad_norm, bool in_backward, const struct shard_dev_ops *dev, int device,
    uint64_t max_bytes, const char *no_share, shard_model_t **out, char *err, size_t errlen)
{
    *out = NULL;
    if (nparams == 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "the model has no parameters");
    if (nparams > SHARD_MAX_PARAMS)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "the model has %zu parameters; the limit is %d", nparams, SHARD_MAX_PARAMS);
    if (layout != PSHARD_LAYOUT_FSDP2 && layout != PSHARD_LAYOUT_FSDP1)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown layout %d", (int)layout);
    if (ngroups == 0 && nparam_groups != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "param_groups has %zu entries, but no groups are defined", nparam_groups);
    if (ngroups > SHARD_MAX_GROUPS)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%zu parameter groups; the limit is %d", ngroups, SHARD_MAX_GROUPS);
    /* With groups, only the kind of the model-wide config is used (setup_groups checks them). */
    if (ngroups == 0 && ps_optim_validate(optim, err, errlen) != 0)
        return PSHARD_ERR_INVALID_ARGUMENT;
    if (!(max_grad_norm >= 0))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "max_grad_norm must be >= 0 (0 disables clipping)");
    if (in_backward && max_grad_norm > 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "optimizer_in_backward updates each parameter at its reduce-scatter, "
                       "before the global gradient norm is known: it cannot clip (set "
                       "max_grad_norm to 0, or turn optimizer_in_backward off)");
    shard_model_t *m = calloc(1, sizeof(*m));
    if (!m)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    m->rank = rank;
    m->world = world;
    m->replicas = 1;
    m->optim = *optim;
    m->max_grad_norm = max_grad_norm;
    m->in_backward = in_backward;
    m->nparams = nparams;
    m->params = calloc(nparams, sizeof(*m->params));
    size_t *numel = calloc(nparams, sizeof(size_t));
    size_t *rows = calloc(nparams, sizeof(size_t));
    const char **sorted = calloc(nparams, sizeof(char *));
    pshard_status_t rc = PSHARD_OK;
    if (!m->params || !numel || !rows || !sorted) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < nparams; i++) {
        const char *name = names[i] ? names[i] : "";
        size_t nl = strlen(name);
        if (nl == 0 || nl > SHARD_NAME_MAX) {
            rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                         "parameter #%zu: the name must be 1..%d bytes", i, SHARD_NAME_MAX);
            goto fail;
        }
        for (size_t k = 0; k < nl; k++) {
            if (name[k] <= ' ' || name[k] > '~') {
                rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                             "parameter #%zu: the name has a space or non-printable byte at %zu", i,
                             k);
                goto fail;
            }
        }
        if (ndims[i] < 1 || ndims[i] > SHARD_MAX_DIMS) {
            rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                         "parameter '%s' has %zu dimensions; 1..%d are supported", name, ndims[i],
                         SHARD_MAX_DIMS);
            goto fail;
        }
        shard_param_t *p = &m->params[i];
        p->name = strdup(name);
        if (!p->name) {
            rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
            goto fail;
        }
        p->ndim = (int)ndims[i];
        size_t n = 1;
        for (int d = 0; d < p->ndim; d++) {
            int64_t dim = shapes[i][d];
            if (dim <= 0 || (uint64_t)dim > (1ull << 40) || n > (SIZE_MAX / 64) / (size_t)dim) {
                rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                             "parameter '%s': dimension %d is %" PRId64
                             " (must be positive and the tensor must fit in memory)",
                             name, d, dim);
                goto fail;
            }
            p->shape[d] = dim;
            n *= (size_t)dim;
        }
        p->numel = n;
        numel[i] = n;
        rows[i] = (size_t)p->shape[0];
        sorted[i] = p->name;
        if (n > m->max_numel)
            m->max_numel = n;
    }
    rc = setup_groups(m, optim, groups, ngroups, param_groups, nparam_groups, err, errlen);
    if (rc != PSHARD_OK)
        goto fail;
    qsort(sorted, nparams, sizeof(char *), cmp_names);
    for (size_t i = 1; i < nparams; i++) {
        if (strcmp(sorted[i - 1], sorted[i]) == 0) {
            rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                         "parameter name '%s' is used twice", sorted[i]);
            goto fail;
        }
    }
    rc = ps_layout_create(layout, world, nparams, numel, rows, &m->layout, err, errlen);
    if (rc != PSHARD_OK)
        goto fail;
    m->shard_numel = ps_layout_shard_numel(m->layout, rank);
    for (size_t i = 0; i < nparams; i++) {
        size_t piece = ps_layout_counts(m->layout, i)[rank];
        if (piece > m->max_piece)
            m->max_piece = piece;
    }
    size_t bytes = m->shard_numel * sizeof(float);
    int nstate = m->nstate;
    /* What the definition will hold on this rank, checked before any of it is allocated. */
    uint64_t need = 0, sections = (uint64_t)(1 + !in_backward + nstate);
    if (__builtin_mul_overflow((uint64_t)bytes, sections, &need) ||
        __builtin_add_overflow(need, (uint64_t)m->max_piece * 4, &need) ||
        __builtin_add_overflow(need, (uint64_t)m->max_numel * 4, &need))
        need = UINT64_MAX;
    if (max_bytes > 0 && need > max_bytes) {
        rc = ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                     "this model needs %.1f MiB of shard state on rank %d; this shard server may "
                     "use %.1f MiB for one (--max-model-memory)",
                     (double)need / 1048576.0, rank, (double)max_bytes / 1048576.0);
        goto fail;
    }
    /* In-backward updates need no accumulator, only a flag per parameter and step. */
    if (in_backward)
        m->reduced = calloc(nparams, 1);
    if (dev) {
        m->dev = dev;
        m->device = device;
        if (no_share)
            ps_strlcpy(m->shared_reason, no_share, sizeof(m->shared_reason));
        if (!no_share && alloc_device_shared(m, bytes, in_backward, nstate)) {
            rc = m->dev->alloc(m->device, m->max_piece * 4, &m->stage, err, errlen);
        } else {
            rc = alloc_on_device(m, bytes, in_backward, nstate, err, errlen);
            m->psteps = calloc(nparams, sizeof(int64_t));
        }
        if (rc != PSHARD_OK)
            goto fail;
    } else {
        alloc_shared(m, bytes, in_backward, nstate, no_share);
        if (!m->shm.base) {
            m->master = shard_model_alloc_touched(bytes);
            if (!in_backward)
                m->grad = shard_model_alloc_touched(bytes);
            if (nstate >= 1)
                m->state0 = shard_model_alloc_touched(bytes);
            if (nstate >= 2)
                m->state1 = shard_model_alloc_touched(bytes);
            m->psteps = calloc(nparams, sizeof(int64_t));
        }
        m->stage = shard_model_alloc_touched(m->max_piece * 4); /* widest staged type: fp32 */
    }
    if (!m->master || (in_backward ? !m->reduced : !m->grad) || (nstate >= 1 && !m->state0) ||
        (nstate >= 2 && !m->state1) || !m->stage || !m->psteps) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "cannot allocate %zu bytes of shard state",
                     bytes * (size_t)(1 + !in_backward + nstate));
        goto fail;
    }

    /* The canonical definition text: compared across ranks, hashed for the fingerprint. */
    size_t cap = 256, len = 0;
    m->spec_text = malloc(cap);
    if (!m->spec_text ||
        append(&m->spec_text, &len, &cap, "layout %s world %d optimizer %d%s",
               layout == PSHARD_LAYOUT_FSDP2 ? "fsdp2" : "fsdp1", world, (int)optim->kind,
               in_backward ? " in_backward" : "") != 0 ||
        (m->explicit_groups && append(&m->spec_text, &len, &cap, " groups %zu", m->ngroups) != 0) ||
        append(&m->spec_text, &len, &cap, "\n") != 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < nparams; i++) {
        char line[600];
        format_param(&m->params[i], line, sizeof(line));
        char group[32] = "";
        if (m->explicit_groups)
            snprintf(group, sizeof(group), " group %" PRIu32, m->param_group[i]);
        if (append(&m->spec_text, &len, &cap, "%s%s\n", line, group) != 0) {
            rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
            goto fail;
        }
    }
    for (size_t g = 0; m->explicit_groups && g < m->ngroups; g++) {
        if (append_group(&m->spec_text, &len, &cap, &m->groups[g], g) != 0) {
            rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
            goto fail;
        }
    }
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)m->spec_text[i];
        h *= 1099511628211ULL;
    }
    m->fingerprint = h;
    free(numel);
    free(rows);
    free(sorted);
    *out = m;
    return PSHARD_OK;
fail:
    free(numel);
    free(rows);
    free(sorted);
    shard_model_free(m);
    return rc;
}

/* Returns line i (0-based) of text into buf; false when there is no such line. */
static bool nth_line(const char *text, size_t i, char *buf, size_t len)
{
    const char *p = text;
    for (size_t k = 0; k < i; k++) {
        p = strchr(p, '\n');
        if (!p)
            return false;
        p++;
    }
    if (!*p)
        return false;
    const char *nl = strchr(p, '\n');
    size_t n = nl ? (size_t)(nl - p) : strlen(p);
    if (n >= len)
        n = len - 1;
    memcpy(buf, p, n);
    buf[n] = '\0';
    return true;
}

pshard_status_t shard_model_compare(const shard_model_t *m, int my_rank, const char *other,
                                    int other_rank, char *err, size_t errlen)
{
    if (strcmp(m->spec_text, other) == 0)
        return PSHARD_OK;
    char mine[600], theirs[600];
    for (size_t i = 0;; i++) {
        bool a = nth_line(m->spec_text, i, mine, sizeof(mine));
        bool b = nth_line(other, i, theirs, sizeof(theirs));
        if (!a && !b)
            break;
        if (a && b && strcmp(mine, theirs) == 0)
            continue;
        if (i == 0)
            return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                           "model definitions differ: rank %d has '%s', rank %d has '%s'", my_rank,
                           mine, other_rank, theirs);
        if (i > m->nparams)
            return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                           "model definitions differ in parameter group #%zu: rank %d defines "
                           "%s, rank %d defines %s",
                           i - 1 - m->nparams, my_rank, a ? mine : "nothing", other_rank,
                           b ? theirs : "nothing");
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "model definitions differ at parameter #%zu: rank %d defines %s, rank %d "
                       "defines %s",
                       i - 1, my_rank, a ? mine : "nothing", other_rank, b ? theirs : "nothing");
    }
    return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION, "model definitions differ");
}

size_t shard_model_state_bytes(const shard_model_t *m)
{
    size_t per = m->shard_numel * sizeof(float);
    return per * (1 + (m->grad ? 1 : 0) + (m->state0 ? 1 : 0) + (m->state1 ? 1 : 0));
}

pshard_status_t shard_model_check_groups(const shard_model_t *m, const shard_group_t *groups,
                                         size_t n, char *err, size_t errlen)
{
    if (n != m->ngroups)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%zu parameter groups given; the model was defined with %zu (one entry "
                       "per group, in the definition's order)",
                       n, m->ngroups);
    for (size_t g = 0; g < n; g++) {
        PS_CHECK(check_group(m->optim.kind, &groups[g], g, err, errlen));
        if (groups[g].frozen != m->groups[g].frozen)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "group %zu: frozen cannot change after the definition (it is %s); "
                           "define the model again to change requires_grad",
                           g, m->groups[g].frozen ? "frozen" : "trained");
        if (m->optim.kind == PS_OPTIM_SGD && !groups[g].frozen && groups[g].cfg.momentum != 0.0 &&
            !m->state0)
            return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                           "group %zu: momentum %g needs SGD momentum buffers, which were not "
                           "allocated because no trained group had momentum when the model was "
                           "defined; define it with the momentum it will use",
                           g, groups[g].cfg.momentum);
    }
    return PSHARD_OK;
}

void shard_model_set_groups(shard_model_t *m, const shard_group_t *groups)
{
    for (size_t g = 0; g < m->ngroups; g++) {
        m->groups[g].cfg = groups[g].cfg;
        m->groups[g].cfg.kind = m->optim.kind;
    }
}
