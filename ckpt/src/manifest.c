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
    char msg[PSHARD_ERRLEN];
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
        if (pr->skipped < 0 || pr->skipped > m->step)
            return invalid(err, errlen,
                           "params[%zu].skipped_steps: %" PRId64 " is not in 0..%" PRId64, p,
                           pr->skipped, m->step);
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

/* The manifest as JSON, files in rank order; NULL when out of memory. Objects keep the order
 * their keys are added in, so the text reads as the header documents it. */
static json_t *manifest_json(const ps_ckpt_manifest_t *m, const size_t *order)
{
    json_t *sections = json_array(), *params = json_array(), *files = json_array();
    bool ok = sections && params && files;
    for (int k = 0; ok && k < m->nsections; k++)
        ok = json_array_append_new(sections, json_string(m->sections[k])) == 0;
    for (size_t p = 0; ok && p < m->nparams; p++) {
        const ps_ckpt_param_t *pr = &m->params[p];
        json_t *shape = json_array();
        for (int d = 0; shape && d < pr->ndim; d++)
            if (json_array_append_new(shape, json_integer(pr->shape[d])) != 0)
                json_decref(shape), shape = NULL;
        json_t *entry = shape ? json_pack("{s:s, s:o}", "name", pr->name, "shape", shape) : NULL;
        if (entry && pr->skipped != 0 &&
            json_object_set_new(entry, "skipped_steps", json_integer(pr->skipped)) != 0)
            json_decref(entry), entry = NULL;
        ok = entry && json_array_append_new(params, entry) == 0;
    }
    for (size_t i = 0; ok && i < m->nfiles; i++) {
        const ps_ckpt_file_t *f = &m->files[order[i]];
        json_t *pieces = json_array();
        for (size_t j = 0; pieces && j < f->npieces; j++) {
            const ps_ckpt_piece_t *pc = &f->pieces[j];
            if (json_array_append_new(
                    pieces, json_pack("[I, I, I, I]", (json_int_t)pc->param, (json_int_t)pc->start,
                                      (json_int_t)pc->count, (json_int_t)pc->offset)) != 0)
                json_decref(pieces), pieces = NULL;
        }
        ok = pieces && json_array_append_new(
                           files, json_pack("{s:i, s:s, s:I, s:I, s:I, s:o}", "rank", f->rank,
                                            "path", f->path, "bytes", (json_int_t)f->bytes,
                                            "crc32c", (json_int_t)f->crc32c, "shard_numel",
                                            (json_int_t)f->shard_numel, "pieces", pieces)) == 0;
    }
    if (!ok) {
        json_decref(sections);
        json_decref(params);
        json_decref(files);
        return NULL;
    }
    const ps_ckpt_optim_t *o = &m->optim;
    json_t *root = json_pack(
        "{s:s, s:i, s:I, s:i, s:s,"
        " s:{s:s, s:f, s:f, s:f, s:b, s:f, s:f, s:f, s:f, s:f},"
        " s:o, s:o, s:o}",
        "format", "pshard-checkpoint", "version", 1, "step", (json_int_t)m->step, "world_size",
        m->world_size, "layout", layout_name(m->layout), "optimizer", "kind", o->kind, "lr", o->lr,
        "momentum", o->momentum, "dampening", o->dampening, "nesterov", (int)o->nesterov,
        "weight_decay", o->weight_decay, "beta1", o->beta1, "beta2", o->beta2, "eps", o->eps,
        "max_grad_norm", o->max_grad_norm, "sections", sections, "params", params, "files", files);
    if (root && m->aborted_steps > 0 &&
        json_object_set_new(root, "aborted_steps", json_integer(m->aborted_steps)) != 0) {
        json_decref(root);
        return NULL;
    }
    return root;
}

pshard_status_t ps_ckpt_manifest_write(const char *step_dir, const ps_ckpt_manifest_t *m, char *err,
                                       size_t errlen)
{
    char path[PATH_MAX];
    if (ps_snprintf(path, sizeof(path), "%s/%s", step_dir, PS_CKPT_MANIFEST) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "path too long: %s", step_dir);
    char why[PSHARD_ERRLEN] = "";
    pshard_status_t rc = ckpt_manifest_check(m, why, sizeof(why));
    if (rc != PSHARD_OK)
        return ps_errf(err, errlen, rc, "refusing to write %s: %s", path, why);
    /* Files in rank order (ckpt_manifest_check made sure each rank has exactly one). */
    size_t *order = malloc((m->nfiles ? m->nfiles : 1) * sizeof(*order));
    if (!order)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    for (size_t i = 0; i < m->nfiles; i++)
        order[m->files[i].rank] = i;
    json_t *doc = manifest_json(m, order);
    free(order);
    /* One line with ", " and ": " separators; doubles with 17 significant digits (exact). */
    char *text = doc ? json_dumps(doc, JSON_INDENT(0) | JSON_REAL_PRECISION(17)) : NULL;
    json_decref(doc);
    if (!text)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory writing %s", path);
    size_t len = strlen(text);
    if (len + 1 > MANIFEST_MAX_BYTES) {
        free(text);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "refusing to write %s: %zu bytes is more than a manifest may have", path,
                       len + 1);
    }
    text[len] = '\n'; /* over the NUL: the file ends with a newline */
    int dfd;
    rc = ckpt_dir_open(step_dir, false, &dfd, err, errlen);
    if (rc == PSHARD_ERR_NOT_FOUND)
        rc = PSHARD_ERR_SYSTEM; /* writing: a missing directory is the system's problem */
    if (rc == PSHARD_OK) {
        rc = ps_atomic_file_put(dfd, PS_CKPT_MANIFEST, path, text, len + 1, err, errlen);
        close(dfd);
    }
    free(text);
    return rc;
}

/* ---- Reading the manifest ------------------------------------------------------------------ */

/* Messages start with the JSON path of the problem. */
static pshard_status_t bad(char *err, size_t errlen, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static pshard_status_t bad(char *err, size_t errlen, const char *path, const char *fmt, ...)
{
    char msg[PSHARD_ERRLEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: %s", path, msg);
}

static pshard_status_t in_range(int64_t v, const char *path, int64_t lo, int64_t hi, char *err,
                                size_t errlen)
{
    if (v < lo || v > hi)
        return bad(err, errlen, path, "%" PRId64 " is out of range (%" PRId64 " to %" PRId64 ")", v,
                   lo, hi);
    return PSHARD_OK;
}

/* A string of len bytes into buf (capacity cap). jansson refuses \u0000 in strings. */
static pshard_status_t copy_string(const char *s, size_t len, const char *path, char *buf,
                                   size_t cap, char *err, size_t errlen)
{
    if (len >= cap)
        return bad(err, errlen, path, "longer than %zu bytes", cap - 1);
    memcpy(buf, s, len + 1);
    return PSHARD_OK;
}

static pshard_status_t want_array(const json_t *v, const char *path, char *err, size_t errlen)
{
    if (json_is_array(v))
        return PSHARD_OK;
    return bad(err, errlen, path, "expected an array, found %s", ckpt_json_type_name(v));
}

static const ckpt_json_field_t root_fields[] = {
    {"format", CKPT_JSON_STRING}, {"version", CKPT_JSON_INTEGER},
    {"step", CKPT_JSON_INTEGER},  {"world_size", CKPT_JSON_INTEGER},
    {"layout", CKPT_JSON_STRING}, {"optimizer", CKPT_JSON_ANY},
    {"sections", CKPT_JSON_ANY},  {"params", CKPT_JSON_ANY},
    {"files", CKPT_JSON_ANY},     {"aborted_steps", CKPT_JSON_INTEGER | CKPT_JSON_OPTIONAL}};
static const ckpt_json_field_t optim_fields[] = {
    {"kind", CKPT_JSON_STRING},      {"lr", CKPT_JSON_NUMBER},
    {"momentum", CKPT_JSON_NUMBER},  {"dampening", CKPT_JSON_NUMBER},
    {"nesterov", CKPT_JSON_BOOLEAN}, {"weight_decay", CKPT_JSON_NUMBER},
    {"beta1", CKPT_JSON_NUMBER},     {"beta2", CKPT_JSON_NUMBER},
    {"eps", CKPT_JSON_NUMBER},       {"max_grad_norm", CKPT_JSON_NUMBER}};
static const ckpt_json_field_t param_fields[] = {
    {"name", CKPT_JSON_STRING},
    {"shape", CKPT_JSON_ARRAY},
    {"skipped_steps", CKPT_JSON_INTEGER | CKPT_JSON_OPTIONAL}};
static const ckpt_json_field_t file_fields[] = {
    {"rank", CKPT_JSON_INTEGER},   {"path", CKPT_JSON_STRING},         {"bytes", CKPT_JSON_INTEGER},
    {"crc32c", CKPT_JSON_INTEGER}, {"shard_numel", CKPT_JSON_INTEGER}, {"pieces", CKPT_JSON_ARRAY}};

static pshard_status_t read_optimizer(const json_t *obj, ps_ckpt_optim_t *o, char *err,
                                      size_t errlen)
{
    const char *kind;
    size_t kind_len;
    int nesterov;
    json_error_t je;
    if (json_unpack_ex(
            (json_t *)obj, &je, JSON_STRICT, "{s:s%, s:F, s:F, s:F, s:b, s:F, s:F, s:F, s:F, s:F}",
            "kind", &kind, &kind_len, "lr", &o->lr, "momentum", &o->momentum, "dampening",
            &o->dampening, "nesterov", &nesterov, "weight_decay", &o->weight_decay, "beta1",
            &o->beta1, "beta2", &o->beta2, "eps", &o->eps, "max_grad_norm", &o->max_grad_norm) != 0)
        return ckpt_json_explain(obj, "optimizer", optim_fields, PS_ARRAY_LEN(optim_fields), err,
                                 errlen);
    o->nesterov = nesterov;
    PS_CHECK(copy_string(kind, kind_len, "optimizer.kind", o->kind, sizeof(o->kind), err, errlen));
    if (!optim_kind_known(o->kind))
        return bad(err, errlen, "optimizer.kind", "\"%s\" is not sgd, adam or adamw", o->kind);
    return PSHARD_OK;
}

static pshard_status_t read_params(const json_t *arr, ps_ckpt_manifest_t *m, char *err,
                                   size_t errlen)
{
    PS_CHECK(want_array(arr, "params", err, errlen));
    m->nparams = json_array_size(arr);
    m->params = calloc(m->nparams ? m->nparams : 1, sizeof(*m->params));
    if (!m->params)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    size_t p;
    const json_t *entry;
    json_array_foreach((json_t *)arr, p, entry)
    {
        char where[32], path[48], dpath[80];
        snprintf(where, sizeof(where), "params[%zu]", p);
        snprintf(path, sizeof(path), "%s.name", where);
        ps_ckpt_param_t *pr = &m->params[p];
        const char *name;
        size_t name_len;
        json_t *shape, *skipped = NULL;
        json_error_t je;
        if (json_unpack_ex((json_t *)entry, &je, JSON_STRICT, "{s:s%, s:o, s?o}", "name", &name,
                           &name_len, "shape", &shape, "skipped_steps", &skipped) != 0 ||
            !json_is_array(shape) || (skipped && !json_is_integer(skipped)))
            return ckpt_json_explain(entry, where, param_fields, PS_ARRAY_LEN(param_fields), err,
                                     errlen);
        PS_CHECK(copy_string(name, name_len, path, pr->name, sizeof(pr->name), err, errlen));
        snprintf(path, sizeof(path), "%s.shape", where);
        size_t ndim = json_array_size(shape);
        if (ndim < 1 || ndim > 8)
            return bad(err, errlen, path, "expected 1 to 8 dimensions, found %zu", ndim);
        pr->ndim = (int)ndim;
        size_t d;
        const json_t *dim;
        json_array_foreach(shape, d, dim)
        {
            snprintf(dpath, sizeof(dpath), "%s[%zu]", path, d);
            if (!json_is_integer(dim))
                return bad(err, errlen, path, "expected an array of integers, found %s at [%zu]",
                           ckpt_json_type_name(dim), d);
            pr->shape[d] = json_integer_value(dim);
            PS_CHECK(in_range(pr->shape[d], dpath, 0, INT64_MAX, err, errlen));
        }
        if (skipped) {
            snprintf(path, sizeof(path), "%s.skipped_steps", where);
            pr->skipped = json_integer_value(skipped);
            PS_CHECK(in_range(pr->skipped, path, 0, m->step, err, errlen));
        }
    }
    return PSHARD_OK;
}

static pshard_status_t read_files(const json_t *arr, ps_ckpt_manifest_t *m, char *err,
                                  size_t errlen)
{
    PS_CHECK(want_array(arr, "files", err, errlen));
    m->nfiles = json_array_size(arr);
    m->files = calloc(m->nfiles ? m->nfiles : 1, sizeof(*m->files));
    if (!m->files)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    size_t i;
    const json_t *entry;
    json_array_foreach((json_t *)arr, i, entry)
    {
        char where[48], path[64], ppath[96];
        snprintf(where, sizeof(where), "files[%zu]", i);
        ps_ckpt_file_t *f = &m->files[i];
        json_int_t rank, bytes, crc, numel;
        const char *name;
        size_t name_len;
        json_t *pieces;
        json_error_t je;
        if (json_unpack_ex((json_t *)entry, &je, JSON_STRICT, "{s:I, s:s%, s:I, s:I, s:I, s:o}",
                           "rank", &rank, "path", &name, &name_len, "bytes", &bytes, "crc32c", &crc,
                           "shard_numel", &numel, "pieces", &pieces) != 0 ||
            !json_is_array(pieces))
            return ckpt_json_explain(entry, where, file_fields, PS_ARRAY_LEN(file_fields), err,
                                     errlen);
        const struct {
            const char *key;
            json_int_t v, hi;
        } ints[] = {{"rank", rank, INT_MAX},
                    {"bytes", bytes, INT64_MAX},
                    {"crc32c", crc, UINT32_MAX},
                    {"shard_numel", numel, INT64_MAX}};
        for (size_t k = 0; k < PS_ARRAY_LEN(ints); k++) {
            snprintf(path, sizeof(path), "%s.%s", where, ints[k].key);
            PS_CHECK(in_range(ints[k].v, path, 0, ints[k].hi, err, errlen));
        }
        f->rank = (int)rank;
        f->bytes = (uint64_t)bytes;
        f->crc32c = (uint32_t)crc;
        f->shard_numel = (uint64_t)numel;
        snprintf(path, sizeof(path), "%s.path", where);
        PS_CHECK(copy_string(name, name_len, path, f->path, sizeof(f->path), err, errlen));
        f->npieces = json_array_size(pieces);
        f->pieces = calloc(f->npieces ? f->npieces : 1, sizeof(*f->pieces));
        if (!f->pieces)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        size_t j;
        const json_t *piece;
        json_array_foreach(pieces, j, piece)
        {
            json_int_t q[4];
            bool ok = json_unpack_ex((json_t *)piece, &je, JSON_STRICT, "[IIII]", &q[0], &q[1],
                                     &q[2], &q[3]) == 0 &&
                      q[0] >= 0 && q[1] >= 0 && q[2] >= 0 && q[3] >= 0;
            snprintf(ppath, sizeof(ppath), "%s.pieces[%zu]", where, j);
            if (!ok)
                return bad(err, errlen, ppath,
                           "expected 4 integers [param, start, count, offset], each at least 0");
            if (q[0] > UINT32_MAX)
                return bad(err, errlen, ppath, "parameter index %" PRId64 " is too large",
                           (int64_t)q[0]);
            f->pieces[j] =
                (ps_ckpt_piece_t){(uint32_t)q[0], (uint64_t)q[1], (uint64_t)q[2], (uint64_t)q[3]};
        }
    }
    return PSHARD_OK;
}

/* Fills m from the document; every type and key is checked here, the rest by
 * ckpt_manifest_check. */
static pshard_status_t manifest_from_json(const json_t *root, ps_ckpt_manifest_t *m, char *err,
                                          size_t errlen)
{
    if (!json_is_object(root))
        return bad(err, errlen, "manifest", "expected an object, found %s",
                   ckpt_json_type_name(root));
    /* The format and version first, so a newer manifest says so rather than listing keys. */
    const json_t *format = json_object_get(root, "format");
    const json_t *version = json_object_get(root, "version");
    if (!format || !version)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "missing key \"%s\"",
                       format ? "version" : "format");
    if (!json_is_string(format) || !json_is_integer(version))
        return bad(err, errlen, json_is_string(format) ? "version" : "format",
                   "expected %s, found %s", json_is_string(format) ? "an integer" : "a string",
                   ckpt_json_type_name(json_is_string(format) ? version : format));
    if (strcmp(json_string_value(format), "pshard-checkpoint") != 0)
        return bad(err, errlen, "format", "\"%.64s\" is not \"pshard-checkpoint\"",
                   json_string_value(format));
    if (json_integer_value(version) != 1)
        return bad(err, errlen, "version",
                   "version %" PRId64 " is not supported (this build reads version 1)",
                   (int64_t)json_integer_value(version));
    const char *layout, *format_s;
    json_int_t vers, step, world, aborted = 0;
    json_t *optim, *secs, *params, *files;
    json_error_t je;
    if (json_unpack_ex((json_t *)root, &je, JSON_STRICT,
                       "{s:s, s:I, s:I, s:I, s:s, s:o, s:o, s:o, s:o, s?I}", "format", &format_s,
                       "version", &vers, "step", &step, "world_size", &world, "layout", &layout,
                       "optimizer", &optim, "sections", &secs, "params", &params, "files", &files,
                       "aborted_steps", &aborted) != 0)
        return ckpt_json_explain(root, "", root_fields, PS_ARRAY_LEN(root_fields), err, errlen);
    PS_CHECK(in_range(step, "step", 0, INT64_MAX, err, errlen));
    PS_CHECK(in_range(aborted, "aborted_steps", 0, INT64_MAX - step, err, errlen));
    m->aborted_steps = aborted;
    PS_CHECK(in_range(world, "world_size", 1, CKPT_MAX_WORLD, err, errlen));
    m->step = step;
    m->world_size = (int)world;
    if (strcmp(layout, "fsdp2") == 0)
        m->layout = PSHARD_LAYOUT_FSDP2;
    else if (strcmp(layout, "fsdp1") == 0)
        m->layout = PSHARD_LAYOUT_FSDP1;
    else
        return bad(err, errlen, "layout", "\"%.16s\" is not fsdp2 or fsdp1", layout);
    PS_CHECK(read_optimizer(optim, &m->optim, err, errlen));
    PS_CHECK(want_array(secs, "sections", err, errlen));
    size_t nsecs = json_array_size(secs);
    if (nsecs < 1 || nsecs > PS_CKPT_MAX_SECTIONS)
        return bad(err, errlen, "sections", "expected 1 to %d names, found %zu",
                   PS_CKPT_MAX_SECTIONS, nsecs);
    m->nsections = (int)nsecs;
    size_t k;
    const json_t *sec;
    json_array_foreach(secs, k, sec)
    {
        char path[32];
        snprintf(path, sizeof(path), "sections[%zu]", k);
        if (!json_is_string(sec))
            return bad(err, errlen, path, "expected a string, found %s", ckpt_json_type_name(sec));
        PS_CHECK(copy_string(json_string_value(sec), json_string_length(sec), path, m->sections[k],
                             sizeof(m->sections[k]), err, errlen));
        if (!m->sections[k][0])
            return bad(err, errlen, path, "a section name cannot be empty");
    }
    PS_CHECK(read_params(params, m, err, errlen));
    return read_files(files, m, err, errlen);
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
        return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "%s: no %s (not a committed checkpoint)",
                       step_dir, PS_CKPT_MANIFEST);
    if (rc != PSHARD_OK)
        return ps_errf(err, errlen, rc, "%s", open_err);
    char *data = NULL, why[PSHARD_ERRLEN] = "";
    json_t *doc = NULL;
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
    rc = ckpt_json_load(data, got, &doc, why, sizeof(why));
    if (rc == PSHARD_OK) {
        m = calloc(1, sizeof(*m));
        if (!m)
            rc = ps_errf(why, sizeof(why), PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    if (rc == PSHARD_OK)
        rc = manifest_from_json(doc, m, why, sizeof(why));
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
    json_decref(doc);
    free(data);
    close(fd);
    return rc;
}
