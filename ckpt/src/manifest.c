/* The manifest of a checkpoint (pshard/ckpt.h): validating it, writing it atomically (its
 * rename commits the step), and reading it back with every key, type, name, size and piece
 * checked, indexed by parameter for ps_ckpt_read_range. */
#include "pshard/ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_internal.h"
#include "pshard/atomic_file.h"
#include "pshard/log.h"
#include "pshard/util.h"

/* A manifest larger than this is refused before it is read. */
#define MANIFEST_MAX_BYTES (64u << 20)
/* Nesting of the manifest: root, files, a file, its pieces, one piece (5); some slack. */
#define MANIFEST_MAX_DEPTH 16
/* World sizes beyond this are taken for corruption. */
#define CKPT_MAX_WORLD (1 << 20)

const char *ckpt_plain_name_problem(const char *path, size_t cap)
{
    size_t n = strnlen(path, cap);
    if (n == 0)
        return "is empty";
    if (n == cap || n > 255)
        return "is longer than 255 bytes";
    if (strchr(path, '/'))
        return "is not a plain file name (it contains '/')";
    if (strcmp(path, ".") == 0 || strcmp(path, "..") == 0)
        return "is not a plain file name";
    if (strcmp(path, PS_CKPT_MANIFEST) == 0)
        return "is the manifest's own name";
    if (!ckpt_utf8_valid(path, n))
        return "is not valid UTF-8";
    return NULL;
}

static const char *layout_name(pshard_layout_t l)
{
    return l == PSHARD_LAYOUT_FSDP1 ? "fsdp1" : "fsdp2";
}

static bool optim_kind_known(const char *kind)
{
    return strcmp(kind, "sgd") == 0 || strcmp(kind, "adam") == 0 || strcmp(kind, "adamw") == 0;
}

uint64_t ckpt_param_numel(const ps_ckpt_param_t *p)
{
    uint64_t n = 1;
    for (int d = 0; d < p->ndim && d < 8; d++) {
        if (p->shape[d] < 0)
            return UINT64_MAX;
        uint64_t s = (uint64_t)p->shape[d];
        if (s != 0 && n > CKPT_MAX_NUMEL / s)
            return UINT64_MAX;
        n *= s;
    }
    return n;
}

/* ---- Validation shared by writing and reading ---------------------------------------------- */

static pshard_status_t invalid(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static pshard_status_t invalid(char *err, size_t errlen, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s", msg);
}

typedef struct {
    uint32_t param;
    uint64_t start, end; /* elements of the parameter, or of the file for the overlap check */
    size_t file, piece;  /* indices into m->files and its pieces */
} piece_ref_t;

static int piece_ref_cmp(const void *a, const void *b)
{
    const piece_ref_t *x = a, *y = b;
    if (x->param != y->param)
        return x->param < y->param ? -1 : 1;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    return x->file < y->file ? -1 : x->file > y->file;
}

typedef struct {
    const char *name;
    size_t index;
} name_ref_t;

static int name_ref_cmp(const void *a, const void *b)
{
    const name_ref_t *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c ? c : (x->index < y->index ? -1 : x->index > y->index);
}

/* Checks for two entries of the same name; what says which list ("params", "files"), field
 * which key ("name", "path"). */
static pshard_status_t check_unique(const char *const *names, size_t n, const char *what,
                                    const char *field, char *err, size_t errlen)
{
    if (n < 2)
        return PSHARD_OK;
    name_ref_t *refs = malloc(n * sizeof(*refs));
    if (!refs)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    for (size_t i = 0; i < n; i++)
        refs[i] = (name_ref_t){names[i], i};
    qsort(refs, n, sizeof(*refs), name_ref_cmp);
    pshard_status_t rc = PSHARD_OK;
    for (size_t i = 1; i < n && rc == PSHARD_OK; i++)
        if (strcmp(refs[i - 1].name, refs[i].name) == 0)
            rc = invalid(err, errlen, "%s[%zu].%s: \"%s\" is also the %s of %s[%zu]", what,
                         refs[i].index, field, refs[i].name, field, what, refs[i - 1].index);
    free(refs);
    return rc;
}

/* Everything about m that does not need the shard files: names, ranges, sizes, ranks, and
 * that the pieces of each parameter tile it exactly once. Paths in messages index m's arrays
 * as they are (the JSON order when m was just read). */
pshard_status_t ckpt_manifest_check(const ps_ckpt_manifest_t *m, char *err, size_t errlen)
{
    if (m->step < 0)
        return invalid(err, errlen, "step: %" PRId64 " is negative", m->step);
    if (m->world_size < 1 || m->world_size > CKPT_MAX_WORLD)
        return invalid(err, errlen, "world_size: %d is not in 1..%d", m->world_size,
                       CKPT_MAX_WORLD);
    if (m->layout != PSHARD_LAYOUT_FSDP1 && m->layout != PSHARD_LAYOUT_FSDP2)
        return invalid(err, errlen, "layout: unknown layout %d", (int)m->layout);
    if (strnlen(m->optim.kind, sizeof(m->optim.kind)) == sizeof(m->optim.kind) ||
        !optim_kind_known(m->optim.kind))
        return invalid(err, errlen, "optimizer.kind: \"%.*s\" is not sgd, adam or adamw",
                       (int)sizeof(m->optim.kind), m->optim.kind);
    const struct {
        const char *name;
        double v;
    } hyper[] = {{"lr", m->optim.lr},
                 {"momentum", m->optim.momentum},
                 {"dampening", m->optim.dampening},
                 {"weight_decay", m->optim.weight_decay},
                 {"beta1", m->optim.beta1},
                 {"beta2", m->optim.beta2},
                 {"eps", m->optim.eps},
                 {"max_grad_norm", m->optim.max_grad_norm}};
    for (size_t i = 0; i < PS_ARRAY_LEN(hyper); i++)
        if (!isfinite(hyper[i].v))
            return invalid(err, errlen, "optimizer.%s: not a finite number", hyper[i].name);
    if (m->nsections < 1 || m->nsections > PS_CKPT_MAX_SECTIONS)
        return invalid(err, errlen, "sections: expected 1 to %d names, found %d",
                       PS_CKPT_MAX_SECTIONS, m->nsections);
    for (int k = 0; k < m->nsections; k++) {
        size_t n = strnlen(m->sections[k], sizeof(m->sections[k]));
        if (n == 0 || n == sizeof(m->sections[k]) || !ckpt_utf8_valid(m->sections[k], n))
            return invalid(err, errlen,
                           "sections[%d]: a section name must be 1 to %zu bytes of UTF-8", k,
                           sizeof(m->sections[k]) - 1);
    }
    if (m->nparams > 0 && !m->params)
        return invalid(err, errlen, "params: %zu parameters but no array", m->nparams);
    if (m->nparams > UINT32_MAX)
        return invalid(err, errlen, "params: %zu parameters are too many", m->nparams);
    for (size_t p = 0; p < m->nparams; p++) {
        const ps_ckpt_param_t *pr = &m->params[p];
        size_t n = strnlen(pr->name, sizeof(pr->name));
        if (n == 0 || n == sizeof(pr->name) || !ckpt_utf8_valid(pr->name, n))
            return invalid(err, errlen, "params[%zu].name: must be 1 to 255 bytes of UTF-8", p);
        if (pr->ndim < 1 || pr->ndim > 8)
            return invalid(err, errlen, "params[%zu].shape: expected 1 to 8 dimensions, found %d",
                           p, pr->ndim);
        for (int d = 0; d < pr->ndim; d++)
            if (pr->shape[d] < 0)
                return invalid(err, errlen, "params[%zu].shape[%d]: %" PRId64 " is negative", p, d,
                               pr->shape[d]);
        if (ckpt_param_numel(pr) == UINT64_MAX)
            return invalid(err, errlen, "params[%zu].shape: more than %" PRIu64 " elements", p,
                           CKPT_MAX_NUMEL);
    }
    pshard_status_t rc = PSHARD_OK;
    const char **names =
        malloc((m->nparams > m->nfiles ? m->nparams : m->nfiles) * sizeof(*names) + 1);
    int *rank_file = malloc((size_t)m->world_size * sizeof(*rank_file));
    piece_ref_t *refs = NULL;
    if (!names || !rank_file) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    for (size_t p = 0; p < m->nparams; p++)
        names[p] = m->params[p].name;
    PS_CHECK_GOTO(check_unique(names, m->nparams, "params", "name", err, errlen), rc, out);

    /* Files: one per rank, plain distinct names, sizes that match their sections. */
    if (m->nfiles > 0 && !m->files) {
        rc = invalid(err, errlen, "files: %zu files but no array", m->nfiles);
        goto out;
    }
    for (int r = 0; r < m->world_size; r++)
        rank_file[r] = -1;
    size_t total_pieces = 0;
    for (size_t i = 0; i < m->nfiles; i++) {
        const ps_ckpt_file_t *f = &m->files[i];
        if (f->rank < 0 || f->rank >= m->world_size) {
            rc = invalid(err, errlen, "files[%zu].rank: %d is not in 0..%d (world_size %d)", i,
                         f->rank, m->world_size - 1, m->world_size);
            goto out;
        }
        if (rank_file[f->rank] >= 0) {
            rc = invalid(err, errlen, "files[%zu].rank: rank %d also has files[%d]", i, f->rank,
                         rank_file[f->rank]);
            goto out;
        }
        rank_file[f->rank] = (int)i;
        const char *why = ckpt_plain_name_problem(f->path, sizeof(f->path));
        if (why) {
            rc = invalid(err, errlen, "files[%zu].path: \"%.*s\" %s", i, 64, f->path, why);
            goto out;
        }
        names[i] = f->path;
        if (f->shard_numel > CKPT_MAX_NUMEL) {
            rc = invalid(err, errlen, "files[%zu].shard_numel: %" PRIu64 " is too large", i,
                         f->shard_numel);
            goto out;
        }
        uint64_t want = (uint64_t)m->nsections * f->shard_numel * sizeof(float);
        if (f->bytes != want) {
            rc = invalid(err, errlen,
                         "files[%zu].bytes: %" PRIu64 ", but %d section%s of %" PRIu64
                         " elements are %" PRIu64 " bytes",
                         i, f->bytes, m->nsections, m->nsections == 1 ? "" : "s", f->shard_numel,
                         want);
            goto out;
        }
        if (f->npieces > 0 && !f->pieces) {
            rc = invalid(err, errlen, "files[%zu].pieces: %zu pieces but no array", i, f->npieces);
            goto out;
        }
        total_pieces += f->npieces;
    }
    if (m->nfiles != (size_t)m->world_size) {
        int missing = 0;
        while (missing < m->world_size && rank_file[missing] >= 0)
            missing++;
        rc = invalid(err, errlen, "files: %zu files for world_size %d (no file for rank %d)",
                     m->nfiles, m->world_size, missing);
        goto out;
    }
    PS_CHECK_GOTO(check_unique(names, m->nfiles, "files", "path", err, errlen), rc, out);

    /* Pieces: inside their parameter and their file, not overlapping within the file. */
    refs = malloc((total_pieces ? total_pieces : 1) * sizeof(*refs));
    if (!refs) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory (%zu pieces)", total_pieces);
        goto out;
    }
    size_t k = 0;
    for (size_t i = 0; i < m->nfiles; i++) {
        const ps_ckpt_file_t *f = &m->files[i];
        size_t first = k;
        for (size_t j = 0; j < f->npieces; j++) {
            const ps_ckpt_piece_t *pc = &f->pieces[j];
            if (pc->param >= m->nparams) {
                rc = invalid(err, errlen,
                             "files[%zu].pieces[%zu]: parameter %" PRIu32
                             " does not exist (%zu parameters)",
                             i, j, pc->param, m->nparams);
                goto out;
            }
            const ps_ckpt_param_t *pr = &m->params[pc->param];
            uint64_t numel = ckpt_param_numel(pr);
            if (pc->count == 0) {
                rc = invalid(err, errlen, "files[%zu].pieces[%zu]: empty piece (count 0)", i, j);
                goto out;
            }
            if (pc->count > numel || pc->start > numel - pc->count) {
                rc = invalid(err, errlen,
                             "files[%zu].pieces[%zu]: elements [%" PRIu64 ", %" PRIu64
                             ") lie outside parameter %" PRIu32 " (%s, %" PRIu64 " elements)",
                             i, j, pc->start, pc->start + pc->count, pc->param, pr->name, numel);
                goto out;
            }
            if (pc->count > f->shard_numel || pc->offset > f->shard_numel - pc->count) {
                rc = invalid(err, errlen,
                             "files[%zu].pieces[%zu]: file elements [%" PRIu64 ", %" PRIu64
                             ") lie outside the file's %" PRIu64 " elements per section",
                             i, j, pc->offset, pc->offset + pc->count, f->shard_numel);
                goto out;
            }
            refs[k++] = (piece_ref_t){0, pc->offset, pc->offset + pc->count, i, j};
        }
        qsort(refs + first, k - first, sizeof(*refs), piece_ref_cmp);
        for (size_t a = first + 1; a < k; a++) {
            if (refs[a].start < refs[a - 1].end) {
                rc = invalid(err, errlen,
                             "files[%zu].pieces[%zu]: file elements [%" PRIu64 ", %" PRIu64
                             ") overlap files[%zu].pieces[%zu]",
                             i, refs[a].piece, refs[a].start, refs[a].end, i, refs[a - 1].piece);
                goto out;
            }
        }
    }

    /* Coverage: sorted by (param, start), each parameter's pieces must tile [0, numel). */
    k = 0;
    for (size_t i = 0; i < m->nfiles; i++)
        for (size_t j = 0; j < m->files[i].npieces; j++) {
            const ps_ckpt_piece_t *pc = &m->files[i].pieces[j];
            refs[k++] = (piece_ref_t){pc->param, pc->start, pc->start + pc->count, i, j};
        }
    qsort(refs, k, sizeof(*refs), piece_ref_cmp);
    size_t r = 0;
    for (uint32_t p = 0; p < m->nparams; p++) {
        uint64_t next = 0, numel = ckpt_param_numel(&m->params[p]);
        const piece_ref_t *prev = NULL;
        for (; r < k && refs[r].param == p; r++) {
            const piece_ref_t *c = &refs[r];
            if (c->start < next) {
                rc = invalid(err, errlen,
                             "files[%zu].pieces[%zu]: elements [%" PRIu64 ", %" PRIu64
                             ") of parameter %" PRIu32 " (%s) overlap files[%zu].pieces[%zu]",
                             c->file, c->piece, c->start, c->end, p, m->params[p].name, prev->file,
                             prev->piece);
                goto out;
            }
            if (c->start > next) {
                rc = invalid(err, errlen,
                             "params[%" PRIu32 "] (%s): elements [%" PRIu64 ", %" PRIu64
                             ") are in no file's pieces (a gap)",
                             p, m->params[p].name, next, c->start);
                goto out;
            }
            next = c->end;
            prev = c;
        }
        if (next < numel) {
            rc = invalid(err, errlen,
                         "params[%" PRIu32 "] (%s): elements [%" PRIu64 ", %" PRIu64
                         ") are in no file's pieces (a gap)",
                         p, m->params[p].name, next, numel);
            goto out;
        }
    }
out:
    free(refs);
    free(rank_file);
    free(names);
    return rc;
}

/* ---- Writing the manifest ------------------------------------------------------------------ */

static void write_manifest_json(ckpt_buf_t *b, const ps_ckpt_manifest_t *m, const size_t *order)
{
    ckpt_buf_printf(b,
                    "{\"format\": \"pshard-checkpoint\", \"version\": 1, \"step\": %" PRId64
                    ", \"world_size\": %d, \"layout\": \"%s\",\n \"optimizer\": {\"kind\": ",
                    m->step, m->world_size, layout_name(m->layout));
    ckpt_buf_json_str(b, m->optim.kind, strlen(m->optim.kind));
    const struct {
        const char *name;
        double v;
    } hyper[] = {
        {"lr", m->optim.lr}, {"momentum", m->optim.momentum}, {"dampening", m->optim.dampening}};
    for (size_t i = 0; i < PS_ARRAY_LEN(hyper); i++) {
        ckpt_buf_printf(b, ", \"%s\": ", hyper[i].name);
        ckpt_buf_double(b, hyper[i].v);
    }
    ckpt_buf_printf(b, ", \"nesterov\": %s", m->optim.nesterov ? "true" : "false");
    const struct {
        const char *name;
        double v;
    } rest[] = {{"weight_decay", m->optim.weight_decay},
                {"beta1", m->optim.beta1},
                {"beta2", m->optim.beta2},
                {"eps", m->optim.eps},
                {"max_grad_norm", m->optim.max_grad_norm}};
    for (size_t i = 0; i < PS_ARRAY_LEN(rest); i++) {
        ckpt_buf_printf(b, ", \"%s\": ", rest[i].name);
        ckpt_buf_double(b, rest[i].v);
    }
    ckpt_buf_printf(b, "},\n \"sections\": [");
    for (int k = 0; k < m->nsections; k++) {
        if (k)
            ckpt_buf_printf(b, ", ");
        ckpt_buf_json_str(b, m->sections[k], strlen(m->sections[k]));
    }
    ckpt_buf_printf(b, "],\n \"params\": [");
    for (size_t p = 0; p < m->nparams; p++) {
        const ps_ckpt_param_t *pr = &m->params[p];
        ckpt_buf_printf(b, "%s\n  {\"name\": ", p ? "," : "");
        ckpt_buf_json_str(b, pr->name, strlen(pr->name));
        ckpt_buf_printf(b, ", \"shape\": [");
        for (int d = 0; d < pr->ndim; d++)
            ckpt_buf_printf(b, "%s%" PRId64, d ? ", " : "", pr->shape[d]);
        ckpt_buf_printf(b, "]}");
    }
    ckpt_buf_printf(b, "],\n \"files\": [");
    for (size_t i = 0; i < m->nfiles; i++) {
        const ps_ckpt_file_t *f = &m->files[order[i]];
        ckpt_buf_printf(b, "%s\n  {\"rank\": %d, \"path\": ", i ? "," : "", f->rank);
        ckpt_buf_json_str(b, f->path, strlen(f->path));
        ckpt_buf_printf(b,
                        ", \"bytes\": %" PRIu64 ", \"crc32c\": %" PRIu32
                        ", \"shard_numel\": %" PRIu64 ",\n   \"pieces\": [",
                        f->bytes, f->crc32c, f->shard_numel);
        for (size_t j = 0; j < f->npieces; j++) {
            const ps_ckpt_piece_t *pc = &f->pieces[j];
            ckpt_buf_printf(b, "%s[%" PRIu32 ", %" PRIu64 ", %" PRIu64 ", %" PRIu64 "]",
                            j == 0 ? "" : (j % 8 == 0 ? ",\n    " : ", "), pc->param, pc->start,
                            pc->count, pc->offset);
        }
        ckpt_buf_printf(b, "]}");
    }
    ckpt_buf_printf(b, "]}\n");
}

pshard_status_t ps_ckpt_manifest_write(const char *step_dir, const ps_ckpt_manifest_t *m, char *err,
                                       size_t errlen)
{
    char path[PATH_MAX];
    if (ps_snprintf(path, sizeof(path), "%s/%s", step_dir, PS_CKPT_MANIFEST) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "path too long: %s", step_dir);
    char why[512] = "";
    pshard_status_t rc = ckpt_manifest_check(m, why, sizeof(why));
    if (rc != PSHARD_OK)
        return ps_errf(err, errlen, rc, "refusing to write %s: %s", path, why);
    /* Files in rank order (ckpt_manifest_check made sure each rank has exactly one). */
    size_t *order = malloc((m->nfiles ? m->nfiles : 1) * sizeof(*order));
    if (!order)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    for (size_t i = 0; i < m->nfiles; i++)
        order[m->files[i].rank] = i;
    ckpt_buf_t b = {0};
    write_manifest_json(&b, m, order);
    free(order);
    if (b.failed) {
        free(b.data);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory writing %s", path);
    }
    if (b.len > MANIFEST_MAX_BYTES) {
        free(b.data);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "refusing to write %s: %zu bytes is more than a manifest may have", path,
                       b.len);
    }
    int dfd;
    rc = ckpt_dir_open(step_dir, false, &dfd, err, errlen);
    if (rc == PSHARD_ERR_NOT_FOUND)
        rc = PSHARD_ERR_SYSTEM; /* writing: a missing directory is the system's problem */
    if (rc == PSHARD_OK) {
        rc = ps_atomic_file_put(dfd, PS_CKPT_MANIFEST, path, b.data, b.len, err, errlen);
        close(dfd);
    }
    free(b.data);
    return rc;
}

/* ---- Reading the manifest ------------------------------------------------------------------ */

/* Schema checks over the parsed document; messages start with the JSON path. */
typedef struct {
    const ckpt_json_doc_t *d;
    char *err;
    size_t errlen;
} schema_t;

static pshard_status_t schema_fail(schema_t *s, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static pshard_status_t schema_fail(schema_t *s, const char *path, const char *fmt, ...)
{
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (!*path)
        return ps_errf(s->err, s->errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s", msg);
    return ps_errf(s->err, s->errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: %s", path, msg);
}

/* path of member key of the object at `where` ("" for the root). */
static void join_path(char *buf, size_t len, const char *where, const char *key)
{
    if (*where)
        snprintf(buf, len, "%s.%s", where, key);
    else
        snprintf(buf, len, "%s", key);
}

static pshard_status_t want_type(schema_t *s, uint32_t n, int type, const char *path)
{
    int t = s->d->nodes[n].type;
    if (t == type || (type == CKPT_JSON_TRUE && t == CKPT_JSON_FALSE))
        return PSHARD_OK;
    return schema_fail(s, path, "expected %s, found %s", ckpt_json_type_name(type),
                       ckpt_json_type_name(t));
}

/* The object at obj (path where) must have exactly the keys in `keys`. */
static pshard_status_t check_keys(schema_t *s, uint32_t obj, const char *where,
                                  const char *const *keys, size_t nkeys)
{
    PS_CHECK(want_type(s, obj, CKPT_JSON_OBJECT, *where ? where : "manifest"));
    for (uint32_t c = s->d->nodes[obj].child; c; c = s->d->nodes[c].next) {
        const ckpt_json_node_t *n = &s->d->nodes[c];
        bool known = false;
        for (size_t i = 0; i < nkeys && !known; i++)
            known = strlen(keys[i]) == n->key_len &&
                    memcmp(keys[i], ckpt_json_key(s->d, n), n->key_len) == 0;
        if (!known)
            return schema_fail(s, where, "unknown key \"%.*s\" (not in version 1)",
                               (int)(n->key_len > 64 ? 64 : n->key_len), ckpt_json_key(s->d, n));
    }
    for (size_t i = 0; i < nkeys; i++)
        if (!ckpt_json_get(s->d, obj, keys[i]))
            return schema_fail(s, where, "missing key \"%s\"", keys[i]);
    return PSHARD_OK;
}

static pshard_status_t get_int(schema_t *s, uint32_t n, const char *path, int64_t lo, int64_t hi,
                               int64_t *out)
{
    PS_CHECK(want_type(s, n, CKPT_JSON_INT, path));
    int64_t v = s->d->nodes[n].v.i;
    if (v < lo || v > hi)
        return schema_fail(s, path, "%" PRId64 " is out of range (%" PRId64 " to %" PRId64 ")", v,
                           lo, hi);
    *out = v;
    return PSHARD_OK;
}

static pshard_status_t get_int_key(schema_t *s, uint32_t obj, const char *where, const char *key,
                                   int64_t lo, int64_t hi, int64_t *out)
{
    char path[128];
    join_path(path, sizeof(path), where, key);
    return get_int(s, ckpt_json_get(s->d, obj, key), path, lo, hi, out);
}

static pshard_status_t get_double_key(schema_t *s, uint32_t obj, const char *where, const char *key,
                                      double *out)
{
    char path[128];
    join_path(path, sizeof(path), where, key);
    const ckpt_json_node_t *n = &s->d->nodes[ckpt_json_get(s->d, obj, key)];
    if (n->type == CKPT_JSON_INT)
        *out = (double)n->v.i;
    else if (n->type == CKPT_JSON_DOUBLE)
        *out = n->v.d;
    else
        return schema_fail(s, path, "expected a number, found %s", ckpt_json_type_name(n->type));
    return PSHARD_OK;
}

/* A string into buf (capacity cap, so at most cap - 1 bytes); no embedded NUL. */
static pshard_status_t get_string(schema_t *s, uint32_t n, const char *path, char *buf, size_t cap)
{
    PS_CHECK(want_type(s, n, CKPT_JSON_STRING, path));
    const ckpt_json_node_t *node = &s->d->nodes[n];
    const char *str = ckpt_json_str(s->d, node);
    if (strlen(str) != node->v.s.len)
        return schema_fail(s, path, "contains a NUL character");
    if (node->v.s.len >= cap)
        return schema_fail(s, path, "longer than %zu bytes", cap - 1);
    memcpy(buf, str, node->v.s.len + 1);
    return PSHARD_OK;
}

static pshard_status_t get_string_key(schema_t *s, uint32_t obj, const char *where, const char *key,
                                      char *buf, size_t cap)
{
    char path[128];
    join_path(path, sizeof(path), where, key);
    return get_string(s, ckpt_json_get(s->d, obj, key), path, buf, cap);
}

static const char *const root_keys[] = {"format",    "version",  "step",   "world_size", "layout",
                                        "optimizer", "sections", "params", "files"};
static const char *const optim_keys[] = {"kind",     "lr",           "momentum", "dampening",
                                         "nesterov", "weight_decay", "beta1",    "beta2",
                                         "eps",      "max_grad_norm"};
static const char *const param_keys[] = {"name", "shape"};
static const char *const file_keys[] = {"rank", "path", "bytes", "crc32c", "shard_numel", "pieces"};

static pshard_status_t read_optimizer(schema_t *s, uint32_t obj, ps_ckpt_optim_t *o)
{
    const char *w = "optimizer";
    PS_CHECK(check_keys(s, obj, w, optim_keys, PS_ARRAY_LEN(optim_keys)));
    PS_CHECK(get_string_key(s, obj, w, "kind", o->kind, sizeof(o->kind)));
    if (!optim_kind_known(o->kind))
        return schema_fail(s, "optimizer.kind", "\"%s\" is not sgd, adam or adamw", o->kind);
    PS_CHECK(get_double_key(s, obj, w, "lr", &o->lr));
    PS_CHECK(get_double_key(s, obj, w, "momentum", &o->momentum));
    PS_CHECK(get_double_key(s, obj, w, "dampening", &o->dampening));
    PS_CHECK(get_double_key(s, obj, w, "weight_decay", &o->weight_decay));
    PS_CHECK(get_double_key(s, obj, w, "beta1", &o->beta1));
    PS_CHECK(get_double_key(s, obj, w, "beta2", &o->beta2));
    PS_CHECK(get_double_key(s, obj, w, "eps", &o->eps));
    PS_CHECK(get_double_key(s, obj, w, "max_grad_norm", &o->max_grad_norm));
    uint32_t nb = ckpt_json_get(s->d, obj, "nesterov");
    PS_CHECK(want_type(s, nb, CKPT_JSON_TRUE, "optimizer.nesterov"));
    o->nesterov = s->d->nodes[nb].type == CKPT_JSON_TRUE;
    return PSHARD_OK;
}

static pshard_status_t read_params(schema_t *s, uint32_t arr, ps_ckpt_manifest_t *m)
{
    const ckpt_json_doc_t *d = s->d;
    PS_CHECK(want_type(s, arr, CKPT_JSON_ARRAY, "params"));
    m->nparams = d->nodes[arr].count;
    m->params = calloc(m->nparams ? m->nparams : 1, sizeof(*m->params));
    if (!m->params)
        return ps_errf(s->err, s->errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    size_t p = 0;
    for (uint32_t c = d->nodes[arr].child; c; c = d->nodes[c].next, p++) {
        char where[48], path[64];
        snprintf(where, sizeof(where), "params[%zu]", p);
        PS_CHECK(check_keys(s, c, where, param_keys, PS_ARRAY_LEN(param_keys)));
        ps_ckpt_param_t *pr = &m->params[p];
        PS_CHECK(get_string_key(s, c, where, "name", pr->name, sizeof(pr->name)));
        uint32_t shape = ckpt_json_get(d, c, "shape");
        snprintf(path, sizeof(path), "%s.shape", where);
        PS_CHECK(want_type(s, shape, CKPT_JSON_ARRAY, path));
        if (d->nodes[shape].count < 1 || d->nodes[shape].count > 8)
            return schema_fail(s, path, "expected 1 to 8 dimensions, found %u",
                               d->nodes[shape].count);
        pr->ndim = (int)d->nodes[shape].count;
        int dim = 0;
        for (uint32_t e = d->nodes[shape].child; e; e = d->nodes[e].next, dim++) {
            char dpath[80];
            snprintf(dpath, sizeof(dpath), "%s[%d]", path, dim);
            PS_CHECK(get_int(s, e, dpath, 0, INT64_MAX, &pr->shape[dim]));
        }
    }
    return PSHARD_OK;
}

static pshard_status_t read_files(schema_t *s, uint32_t arr, ps_ckpt_manifest_t *m)
{
    const ckpt_json_doc_t *d = s->d;
    PS_CHECK(want_type(s, arr, CKPT_JSON_ARRAY, "files"));
    m->nfiles = d->nodes[arr].count;
    m->files = calloc(m->nfiles ? m->nfiles : 1, sizeof(*m->files));
    if (!m->files)
        return ps_errf(s->err, s->errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    size_t i = 0;
    for (uint32_t c = d->nodes[arr].child; c; c = d->nodes[c].next, i++) {
        char where[48], path[64];
        snprintf(where, sizeof(where), "files[%zu]", i);
        PS_CHECK(check_keys(s, c, where, file_keys, PS_ARRAY_LEN(file_keys)));
        ps_ckpt_file_t *f = &m->files[i];
        int64_t v;
        PS_CHECK(get_int_key(s, c, where, "rank", 0, INT_MAX, &v));
        f->rank = (int)v;
        PS_CHECK(get_string_key(s, c, where, "path", f->path, sizeof(f->path)));
        PS_CHECK(get_int_key(s, c, where, "bytes", 0, INT64_MAX, &v));
        f->bytes = (uint64_t)v;
        PS_CHECK(get_int_key(s, c, where, "crc32c", 0, UINT32_MAX, &v));
        f->crc32c = (uint32_t)v;
        PS_CHECK(get_int_key(s, c, where, "shard_numel", 0, INT64_MAX, &v));
        f->shard_numel = (uint64_t)v;
        uint32_t pieces = ckpt_json_get(d, c, "pieces");
        snprintf(path, sizeof(path), "%s.pieces", where);
        PS_CHECK(want_type(s, pieces, CKPT_JSON_ARRAY, path));
        f->npieces = d->nodes[pieces].count;
        f->pieces = calloc(f->npieces ? f->npieces : 1, sizeof(*f->pieces));
        if (!f->pieces)
            return ps_errf(s->err, s->errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        size_t j = 0;
        for (uint32_t e = d->nodes[pieces].child; e; e = d->nodes[e].next, j++) {
            char ppath[96];
            snprintf(ppath, sizeof(ppath), "%s[%zu]", path, j);
            const ckpt_json_node_t *pn = &d->nodes[e];
            int64_t q[4];
            int nq = 0;
            bool ok = pn->type == CKPT_JSON_ARRAY && pn->count == 4;
            for (uint32_t x = ok ? pn->child : 0; x && ok; x = d->nodes[x].next) {
                ok = d->nodes[x].type == CKPT_JSON_INT && d->nodes[x].v.i >= 0;
                q[nq++] = d->nodes[x].v.i;
            }
            if (!ok)
                return schema_fail(s, ppath,
                                   "expected 4 integers [param, start, count, offset], each "
                                   "at least 0");
            if (q[0] > UINT32_MAX)
                return schema_fail(s, ppath, "parameter index %" PRId64 " is too large", q[0]);
            f->pieces[j] =
                (ps_ckpt_piece_t){(uint32_t)q[0], (uint64_t)q[1], (uint64_t)q[2], (uint64_t)q[3]};
        }
    }
    return PSHARD_OK;
}

/* Fills m from the document; every type and key is checked here, the rest by
 * ckpt_manifest_check. */
static pshard_status_t manifest_from_json(const ckpt_json_doc_t *d, ps_ckpt_manifest_t *m,
                                          char *err, size_t errlen)
{
    schema_t s = {d, err, errlen};
    PS_CHECK(want_type(&s, 0, CKPT_JSON_OBJECT, "manifest"));
    /* The format and version first, so a newer manifest says so rather than listing keys. */
    uint32_t n = ckpt_json_get(d, 0, "format");
    if (!n)
        return schema_fail(&s, "", "missing key \"format\"");
    char format[64];
    PS_CHECK(get_string(&s, n, "format", format, sizeof(format)));
    if (strcmp(format, "pshard-checkpoint") != 0)
        return schema_fail(&s, "format", "\"%s\" is not \"pshard-checkpoint\"", format);
    n = ckpt_json_get(d, 0, "version");
    if (!n)
        return schema_fail(&s, "", "missing key \"version\"");
    int64_t version;
    PS_CHECK(get_int(&s, n, "version", INT64_MIN, INT64_MAX, &version));
    if (version != 1)
        return schema_fail(&s, "version",
                           "version %" PRId64 " is not supported (this build "
                           "reads version 1)",
                           version);
    PS_CHECK(check_keys(&s, 0, "", root_keys, PS_ARRAY_LEN(root_keys)));
    PS_CHECK(get_int_key(&s, 0, "", "step", 0, INT64_MAX, &m->step));
    int64_t world;
    PS_CHECK(get_int_key(&s, 0, "", "world_size", 1, CKPT_MAX_WORLD, &world));
    m->world_size = (int)world;
    char layout[16];
    PS_CHECK(get_string_key(&s, 0, "", "layout", layout, sizeof(layout)));
    if (strcmp(layout, "fsdp2") == 0)
        m->layout = PSHARD_LAYOUT_FSDP2;
    else if (strcmp(layout, "fsdp1") == 0)
        m->layout = PSHARD_LAYOUT_FSDP1;
    else
        return schema_fail(&s, "layout", "\"%s\" is not fsdp2 or fsdp1", layout);
    PS_CHECK(read_optimizer(&s, ckpt_json_get(d, 0, "optimizer"), &m->optim));
    uint32_t secs = ckpt_json_get(d, 0, "sections");
    PS_CHECK(want_type(&s, secs, CKPT_JSON_ARRAY, "sections"));
    if (d->nodes[secs].count < 1 || d->nodes[secs].count > PS_CKPT_MAX_SECTIONS)
        return schema_fail(&s, "sections", "expected 1 to %d names, found %u", PS_CKPT_MAX_SECTIONS,
                           d->nodes[secs].count);
    m->nsections = (int)d->nodes[secs].count;
    int k = 0;
    for (uint32_t c = d->nodes[secs].child; c; c = d->nodes[c].next, k++) {
        char path[32];
        snprintf(path, sizeof(path), "sections[%d]", k);
        PS_CHECK(get_string(&s, c, path, m->sections[k], sizeof(m->sections[k])));
        if (!m->sections[k][0])
            return schema_fail(&s, path, "a section name cannot be empty");
    }
    PS_CHECK(read_params(&s, ckpt_json_get(d, 0, "params"), m));
    PS_CHECK(read_files(&s, ckpt_json_get(d, 0, "files"), m));
    return PSHARD_OK;
}

void ps_ckpt_manifest_free(ps_ckpt_manifest_t *m)
{
    if (!m)
        return;
    for (size_t i = 0; m->files && i < m->nfiles; i++)
        free(m->files[i].pieces);
    free(m->files);
    free(m->params);
    free(m->by_param_start);
    free(m->by_param);
    free(m);
}

pshard_status_t ckpt_build_index(const ps_ckpt_manifest_t *m, size_t **start,
                                   ps_ckpt_piece_ref_t **refs, char *err, size_t errlen)
{
    size_t total = 0;
    for (size_t i = 0; i < m->nfiles; i++)
        total += m->files[i].npieces;
    size_t *first = calloc(m->nparams + 1, sizeof(size_t));
    size_t *next = calloc(m->nparams + 1, sizeof(size_t));
    ps_ckpt_piece_ref_t *all = calloc(total ? total : 1, sizeof(*all));
    if (!first || !next || !all) {
        free(first);
        free(next);
        free(all);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    for (size_t i = 0; i < m->nfiles; i++)
        for (size_t j = 0; j < m->files[i].npieces; j++)
            first[m->files[i].pieces[j].param + 1]++;
    for (size_t p = 0; p < m->nparams; p++)
        first[p + 1] += first[p];
    memcpy(next, first, (m->nparams + 1) * sizeof(size_t));
    for (size_t i = 0; i < m->nfiles; i++)
        for (size_t j = 0; j < m->files[i].npieces; j++)
            all[next[m->files[i].pieces[j].param]++] = (ps_ckpt_piece_ref_t){i, j};
    free(next);
    *start = first;
    *refs = all;
    return PSHARD_OK;
}

/* Sorts m->files by rank (ckpt_manifest_check made sure the ranks are 0..N-1, once each). */
static pshard_status_t sort_files_by_rank(ps_ckpt_manifest_t *m, char *err, size_t errlen)
{
    ps_ckpt_file_t *sorted = calloc(m->nfiles ? m->nfiles : 1, sizeof(*sorted));
    if (!sorted)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    for (size_t i = 0; i < m->nfiles; i++)
        sorted[m->files[i].rank] = m->files[i];
    free(m->files);
    m->files = sorted;
    return PSHARD_OK;
}

pshard_status_t ps_ckpt_manifest_read(const char *step_dir, ps_ckpt_manifest_t **out, char *err,
                                      size_t errlen)
{
    *out = NULL;
    char path[PATH_MAX];
    if (ps_snprintf(path, sizeof(path), "%s/%s", step_dir, PS_CKPT_MANIFEST) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "path too long: %s", step_dir);
    int dfd, fd = -1;
    uint64_t fsize = 0;
    char open_err[PATH_MAX + 128] = "";
    pshard_status_t rc = ckpt_dir_open(step_dir, false, &dfd, open_err, sizeof(open_err));
    if (rc == PSHARD_OK) {
        rc = ckpt_file_open(dfd, PS_CKPT_MANIFEST, path, false, &fd, &fsize, open_err,
                               sizeof(open_err));
        close(dfd);
    }
    if (rc == PSHARD_ERR_NOT_FOUND)
        return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND,
                       "%s: no %s (not a committed checkpoint)", step_dir, PS_CKPT_MANIFEST);
    if (rc != PSHARD_OK)
        return ps_errf(err, errlen, rc, "%s", open_err);
    char *data = NULL, why[600] = "";
    ckpt_json_doc_t doc = {0};
    ps_ckpt_manifest_t *m = NULL;
    if (fsize > MANIFEST_MAX_BYTES) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "%s: %" PRIu64 " bytes is more than the %u MiB a manifest may have", path,
                     fsize, MANIFEST_MAX_BYTES >> 20);
        goto out;
    }
    size_t size = (size_t)fsize, got = 0;
    data = malloc(size ? size : 1);
    if (!data) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory reading %s", path);
        goto out;
    }
    PS_CHECK_GOTO(ckpt_pread_full(fd, data, size, 0, &got, path, err, errlen), rc, out);
    rc = ckpt_json_parse(data, got, MANIFEST_MAX_DEPTH, &doc, why, sizeof(why));
    if (rc == PSHARD_OK) {
        m = calloc(1, sizeof(*m));
        if (!m)
            rc = ps_errf(why, sizeof(why), PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    if (rc == PSHARD_OK)
        rc = manifest_from_json(&doc, m, why, sizeof(why));
    if (rc == PSHARD_OK)
        rc = ckpt_manifest_check(m, why, sizeof(why));
    if (rc == PSHARD_OK)
        rc = sort_files_by_rank(m, why, sizeof(why));
    if (rc == PSHARD_OK)
        rc = ckpt_build_index(m, &m->by_param_start, &m->by_param, why, sizeof(why));
    if (rc != PSHARD_OK) {
        ps_errf(err, errlen, rc, "%s: %s", path, why);
        goto out;
    }
    *out = m;
    m = NULL;
out:
    ps_ckpt_manifest_free(m);
    ckpt_json_free(&doc);
    free(data);
    close(fd);
    return rc;
}

