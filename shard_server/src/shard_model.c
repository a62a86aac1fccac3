/* A shard server's model state; see shard_model.h. */
#include "shard_model.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "pshard/collectives.h"
#include "pshard/util.h"
#include "shard_cuda.h"

#define HUGE_PAGE (2u << 20)

static size_t touched_len(size_t n)
{
    return ((n ? n : 1) + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
}

/* Zeroed memory whose pages are backed now, not at the first step or checkpoint load, from
 * transparent huge pages where the kernel allows (512x fewer page faults for state arrays of
 * hundreds of MiB). malloc + memset would not do: the compiler turns that into calloc, which
 * leaves the pages untouched. Free with free_touched and the same n. */
static void *alloc_touched(size_t n)
{
    size_t len = touched_len(n);
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    madvise(p, len, MADV_HUGEPAGE);
    memset(p, 0, len);
    return p;
}

static void free_touched(void *p, size_t n)
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
    if (m->dev) {
        void *arrays[5] = {m->master, m->grad, m->state0, m->state1, m->stage};
        for (int i = 0; i < 5; i++)
            m->dev->free_mem(m->device, arrays[i]);
    } else {
        free_touched(m->master, bytes);
        free_touched(m->grad, bytes);
        free_touched(m->state0, bytes);
        free_touched(m->state1, bytes);
        free_touched(m->stage, m->max_piece * 4);
    }
    free(m->reduced);
    free(m->spec_text);
    free(m);
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

pshard_status_t shard_model_create(int rank, int world, pshard_layout_t layout, size_t nparams,
                                   const char *const *names, const int64_t *const *shapes,
                                   const size_t *ndims, const ps_optim_config_t *optim,
                                   double max_grad_norm, bool in_backward,
                                   const struct shard_dev_ops *dev, int device, shard_model_t **out,
                                   char *err, size_t errlen)
{
    *out = NULL;
    if (nparams == 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "the model has no parameters");
    if (nparams > SHARD_MAX_PARAMS)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "the model has %zu parameters; the limit is %d", nparams,
                       SHARD_MAX_PARAMS);
    if (layout != PSHARD_LAYOUT_FSDP2 && layout != PSHARD_LAYOUT_FSDP1)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown layout %d",
                       (int)layout);
    if (ps_optim_validate(optim, err, errlen) != 0)
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
    m->optim = *optim;
    m->max_grad_norm = max_grad_norm;
    m->in_backward = in_backward;
    m->cur_lr = optim->lr;
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
                             "parameter #%zu: the name has a space or non-printable byte at %zu",
                             i, k);
                goto fail;
            }
        }
        if (ndims[i] < 1 || ndims[i] > SHARD_MAX_DIMS) {
            rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                         "parameter '%s' has %zu dimensions; 1..%d are supported", name,
                         ndims[i], SHARD_MAX_DIMS);
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
    int nstate = ps_optim_state_count(optim);
    /* In-backward updates need no accumulator, only a flag per parameter and step. */
    if (in_backward)
        m->reduced = calloc(nparams, 1);
    if (dev) {
        m->dev = dev;
        m->device = device;
        rc = alloc_on_device(m, bytes, in_backward, nstate, err, errlen);
        if (rc != PSHARD_OK)
            goto fail;
    } else {
        m->master = alloc_touched(bytes);
        if (!in_backward)
            m->grad = alloc_touched(bytes);
        if (nstate >= 1)
            m->state0 = alloc_touched(bytes);
        if (nstate >= 2)
            m->state1 = alloc_touched(bytes);
        m->stage = alloc_touched(m->max_piece * 4); /* widest staged type: fp32 */
    }
    if (!m->master || (in_backward ? !m->reduced : !m->grad) || (nstate >= 1 && !m->state0) ||
        (nstate >= 2 && !m->state1) || !m->stage) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY,
                     "cannot allocate %zu bytes of shard state",
                     bytes * (size_t)(1 + !in_backward + nstate));
        goto fail;
    }

    /* The canonical definition text: compared across ranks, hashed for the fingerprint. */
    size_t cap = 256, len = 0;
    m->spec_text = malloc(cap);
    if (!m->spec_text ||
        append(&m->spec_text, &len, &cap, "layout %s world %d optimizer %d%s\n",
               layout == PSHARD_LAYOUT_FSDP2 ? "fsdp2" : "fsdp1", world, (int)optim->kind,
               in_backward ? " in_backward" : "") != 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < nparams; i++) {
        char line[600];
        format_param(&m->params[i], line, sizeof(line));
        if (append(&m->spec_text, &len, &cap, "%s\n", line) != 0) {
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

pshard_status_t shard_model_compare(const shard_model_t *m, const char *other, int other_rank,
                                    char *err, size_t errlen)
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
                           "model definitions differ: rank %d has '%s', rank %d has '%s'",
                           m->rank, mine, other_rank, theirs);
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "model definitions differ at parameter #%zu: rank %d defines %s, rank %d "
                       "defines %s",
                       i - 1, m->rank, a ? mine : "nothing", other_rank, b ? theirs : "nothing");
    }
    return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION, "model definitions differ");
}

size_t shard_model_state_bytes(const shard_model_t *m)
{
    size_t per = m->shard_numel * sizeof(float);
    return per * (1 + (m->grad ? 1 : 0) + (m->state0 ? 1 : 0) + (m->state1 ? 1 : 0));
}
