/* safetensors files (8-byte little-endian header length, JSON header, raw little-endian
 * tensor data): exporting a checkpoint's master weights, streamed one parameter at a time, and
 * reading one tensor back as fp32 after validating the whole header. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_internal.h"
#include "pshard/atomic_file.h"
#include "pshard/ckpt.h"
#include "pshard/util.h"

/* The format's own bound on the header length (what the reference implementation refuses). */
#define ST_MAX_HEADER 100000000u
/* Nesting of a header: root, a tensor or __metadata__, its shape or offsets (3); some slack. */
#define ST_MAX_DEPTH 8
/* Dimensions beyond this are taken for a malformed file. */
#define ST_MAX_DIMS 64
/* Elements converted per read or write while streaming. */
#define ST_CHUNK_ELEMS (1u << 20)

/* Bytes per element of a safetensors dtype name, 0 for names the format does not define. */
static size_t st_dtype_size(const char *name)
{
    static const struct {
        const char *name;
        size_t size;
    } table[] = {{"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
                 {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
                 {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};
    for (size_t i = 0; i < PS_ARRAY_LEN(table); i++)
        if (strcmp(name, table[i].name) == 0)
            return table[i].size;
    return 0;
}

/* ---- Export ------------------------------------------------------------------------------- */

static uint64_t numel_of(const ps_ckpt_param_t *p)
{
    uint64_t n = 1;
    for (int d = 0; d < p->ndim; d++)
        n *= (uint64_t)p->shape[d];
    return n;
}

/* The header JSON, padded with spaces to a multiple of 8 bytes. */
static void build_header(ckpt_buf_t *b, const ps_ckpt_manifest_t *m, const char *st_dtype,
                         size_t elem_size)
{
    ckpt_buf_printf(b, "{\"__metadata__\":{\"format\":\"pt\",\"pshard_step\":\"%" PRId64 "\"}",
                    m->step);
    uint64_t off = 0;
    for (size_t p = 0; p < m->nparams; p++) {
        const ps_ckpt_param_t *pr = &m->params[p];
        uint64_t bytes = numel_of(pr) * elem_size;
        ckpt_buf_append(b, ",", 1);
        ckpt_buf_json_str(b, pr->name, strlen(pr->name));
        ckpt_buf_printf(b, ":{\"dtype\":\"%s\",\"shape\":[", st_dtype);
        for (int d = 0; d < pr->ndim; d++)
            ckpt_buf_printf(b, "%s%" PRId64, d ? "," : "", pr->shape[d]);
        ckpt_buf_printf(b, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", off, off + bytes);
        off += bytes;
    }
    ckpt_buf_append(b, "}", 1);
    while (!b->failed && b->len % 8 != 0)
        ckpt_buf_append(b, " ", 1);
}

pshard_status_t ps_safetensors_export(const char *step_dir, const ps_ckpt_manifest_t *m,
                                      pshard_dtype_t dtype, const char *out_path, char *err,
                                      size_t errlen)
{
    if (dtype != PSHARD_FP32 && dtype != PSHARD_BF16)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "safetensors export writes fp32 or bf16, not %s", pshard_dtype_name(dtype));
    char why[512] = "";
    pshard_status_t rc = ckpt_manifest_check(m, why, sizeof(why));
    if (rc != PSHARD_OK)
        return ps_errf(err, errlen, rc, "%s: %s", step_dir, why);
    for (size_t p = 0; p < m->nparams; p++)
        if (strcmp(m->params[p].name, "__metadata__") == 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "parameter %zu is named __metadata__, which safetensors reserves", p);
    size_t esize = pshard_dtype_size(dtype);
    ckpt_buf_t header = {0};
    build_header(&header, m, dtype == PSHARD_FP32 ? "F32" : "BF16", esize);
    if (header.failed) {
        free(header.data);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    if (header.len > ST_MAX_HEADER) {
        free(header.data);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: a header of %zu bytes is beyond safetensors' limit of %u", out_path,
                       header.len, ST_MAX_HEADER);
    }
    /* The output is the caller's own path (links followed, as cp does); only the file itself
     * is written under a fresh temporary name and renamed into place. */
    ps_atomic_file_t o;
    rc = ps_atomic_file_open_path(out_path, &o, err, errlen);
    if (rc != PSHARD_OK) {
        free(header.data);
        return rc;
    }
    int fd = o.fd;
    float *f32 = malloc(ST_CHUNK_ELEMS * sizeof(float));
    uint16_t *b16 = dtype == PSHARD_BF16 ? malloc(ST_CHUNK_ELEMS * sizeof(uint16_t)) : NULL;
    if (!f32 || (dtype == PSHARD_BF16 && !b16)) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)header.len >> (8 * i));
    PS_CHECK_GOTO(ps_write_all(fd, len8, sizeof(len8), out_path, err, errlen), rc, out);
    PS_CHECK_GOTO(ps_write_all(fd, header.data, header.len, out_path, err, errlen), rc, out);
    for (size_t p = 0; p < m->nparams; p++) {
        uint64_t numel = numel_of(&m->params[p]);
        for (uint64_t at = 0; at < numel;) {
            size_t n = numel - at < ST_CHUNK_ELEMS ? (size_t)(numel - at) : ST_CHUNK_ELEMS;
            PS_CHECK_GOTO(ps_ckpt_read_range(step_dir, m, 0, (uint32_t)p, at, n, f32, err, errlen),
                          rc, out);
            if (dtype == PSHARD_BF16) {
                ps_convert_f32_to_bf16(f32, b16, n);
                rc = ps_write_all(fd, b16, n * sizeof(uint16_t), out_path, err, errlen);
            } else {
                rc = ps_write_all(fd, f32, n * sizeof(float), out_path, err, errlen);
            }
            if (rc != PSHARD_OK)
                goto out;
            at += n;
        }
    }
out:
    free(f32);
    free(b16);
    free(header.data);
    pshard_status_t rc2 = ps_atomic_file_commit(&o, rc == PSHARD_OK, err, errlen);
    return rc != PSHARD_OK ? rc : rc2;
}

/* ---- Reading ------------------------------------------------------------------------------ */

typedef struct {
    uint64_t begin, end;
    uint32_t node; /* the tensor's entry in the header */
} st_span_t;

static int span_cmp(const void *a, const void *b)
{
    const st_span_t *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* A tensor entry's name for messages (at most 64 bytes of it). */
static int key_shown(const ckpt_json_node_t *n)
{
    return (int)(n->key_len > 64 ? 64 : n->key_len);
}

/* Checks one tensor entry: exactly dtype, shape and data_offsets, a known dtype, a shape of
 * non-negative sizes, offsets inside the data whose length matches. Fills span. */
static pshard_status_t check_tensor(const ckpt_json_doc_t *d, uint32_t t, uint64_t data_len,
                                    const char *path, st_span_t *span, char *err, size_t errlen)
{
    const ckpt_json_node_t *n = &d->nodes[t];
    const char *name = ckpt_json_key(d, n);
    int shown = key_shown(n);
    if (n->type != CKPT_JSON_OBJECT)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.*s\": expected an object, found %s", path, shown, name,
                       ckpt_json_type_name(n->type));
    for (uint32_t c = n->child; c; c = d->nodes[c].next) {
        const char *k = ckpt_json_key(d, &d->nodes[c]);
        if (strcmp(k, "dtype") != 0 && strcmp(k, "shape") != 0 && strcmp(k, "data_offsets") != 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s: tensor \"%.*s\": unknown key \"%.64s\"", path, shown, name, k);
    }
    uint32_t dt = ckpt_json_get(d, t, "dtype"), sh = ckpt_json_get(d, t, "shape"),
             of = ckpt_json_get(d, t, "data_offsets");
    if (!dt || !sh || !of)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.*s\": needs dtype, shape and data_offsets", path, shown,
                       name);
    size_t esize =
        d->nodes[dt].type == CKPT_JSON_STRING ? st_dtype_size(ckpt_json_str(d, &d->nodes[dt])) : 0;
    if (esize == 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.*s\".dtype: not a safetensors dtype", path, shown, name);
    const ckpt_json_node_t *shape = &d->nodes[sh];
    if (shape->type != CKPT_JSON_ARRAY || shape->count > ST_MAX_DIMS)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.*s\".shape: expected an array of at most %d sizes", path,
                       shown, name, ST_MAX_DIMS);
    uint64_t numel = 1;
    bool overflow = false;
    for (uint32_t c = shape->child; c; c = d->nodes[c].next) {
        const ckpt_json_node_t *e = &d->nodes[c];
        if (e->type != CKPT_JSON_INT || e->v.i < 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s: tensor \"%.*s\".shape: sizes must be integers of at least 0", path,
                           shown, name);
        uint64_t s = (uint64_t)e->v.i;
        if (s != 0 && numel > UINT64_MAX / 8 / s)
            overflow = true;
        else
            numel *= s;
    }
    const ckpt_json_node_t *offs = &d->nodes[of];
    bool ok = offs->type == CKPT_JSON_ARRAY && offs->count == 2;
    int64_t be[2] = {0, 0};
    int k = 0;
    for (uint32_t c = ok ? offs->child : 0; c && ok; c = d->nodes[c].next) {
        ok = d->nodes[c].type == CKPT_JSON_INT && d->nodes[c].v.i >= 0;
        be[k++] = d->nodes[c].v.i;
    }
    if (!ok || be[0] > be[1])
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.*s\".data_offsets: expected [begin, end] with 0 <= begin "
                       "<= end",
                       path, shown, name);
    if ((uint64_t)be[1] > data_len)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.*s\".data_offsets: [%" PRId64 ", %" PRId64
                       ") lies outside the %" PRIu64 " bytes of data",
                       path, shown, name, be[0], be[1], data_len);
    if (overflow && shape->count > 0)
        numel = UINT64_MAX;
    if (numel == UINT64_MAX || (uint64_t)(be[1] - be[0]) != numel * esize)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.*s\": data_offsets span %" PRId64
                       " bytes, but its dtype and shape need %" PRIu64,
                       path, shown, name, be[1] - be[0], numel * esize);
    *span = (st_span_t){(uint64_t)be[0], (uint64_t)be[1], t};
    return PSHARD_OK;
}

/* Validates the whole header (the __metadata__ object of strings and every tensor entry,
 * none overlapping another). */
static pshard_status_t check_header(const ckpt_json_doc_t *d, uint64_t data_len, const char *path,
                                    char *err, size_t errlen)
{
    const ckpt_json_node_t *root = &d->nodes[0];
    if (root->type != CKPT_JSON_OBJECT)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: the header is %s, not an object", path,
                       ckpt_json_type_name(root->type));
    st_span_t *spans = malloc((root->count ? root->count : 1) * sizeof(*spans));
    if (!spans)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    size_t n = 0;
    pshard_status_t rc = PSHARD_OK;
    for (uint32_t c = root->child; c && rc == PSHARD_OK; c = d->nodes[c].next) {
        const ckpt_json_node_t *e = &d->nodes[c];
        if (strcmp(ckpt_json_key(d, e), "__metadata__") == 0) {
            bool ok = e->type == CKPT_JSON_OBJECT;
            for (uint32_t m = ok ? e->child : 0; m && ok; m = d->nodes[m].next)
                ok = d->nodes[m].type == CKPT_JSON_STRING;
            if (!ok)
                rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                             "%s: __metadata__: expected an object of strings", path);
            continue;
        }
        rc = check_tensor(d, c, data_len, path, &spans[n], err, errlen);
        if (rc == PSHARD_OK)
            n++;
    }
    if (rc == PSHARD_OK && n > 1) {
        qsort(spans, n, sizeof(*spans), span_cmp);
        uint64_t reach = 0; /* end of the non-empty spans so far */
        uint32_t reach_node = 0;
        for (size_t i = 0; i < n && rc == PSHARD_OK; i++) {
            if (spans[i].begin == spans[i].end)
                continue;
            if (spans[i].begin < reach) {
                const ckpt_json_node_t *a = &d->nodes[spans[i].node], *b = &d->nodes[reach_node];
                rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                             "%s: tensor \"%.*s\".data_offsets overlap those of \"%.*s\"", path,
                             key_shown(a), ckpt_json_key(d, a), key_shown(b), ckpt_json_key(d, b));
            }
            if (spans[i].end > reach) {
                reach = spans[i].end;
                reach_node = spans[i].node;
            }
        }
    }
    free(spans);
    return rc;
}

pshard_status_t ps_safetensors_read(const char *path, const char *name, int ndim,
                                    const int64_t *shape, float *out, char *err, size_t errlen)
{
    int fd;
    uint64_t size = 0;
    /* A FIFO or device is refused here rather than waited on. */
    PS_CHECK(ckpt_file_open(AT_FDCWD, path, path, true, &fd, &size, err, errlen));
    pshard_status_t rc = PSHARD_OK;
    char *header = NULL, why[600] = "";
    void *buf = NULL;
    ckpt_json_doc_t doc = {0};
    uint8_t len8[8];
    size_t got = 0;
    PS_CHECK_GOTO(ckpt_pread_full(fd, len8, sizeof(len8), 0, &got, path, err, errlen), rc, out);
    if (got < sizeof(len8)) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "%s: %" PRIu64 " bytes is too short for a safetensors file", path, size);
        goto out;
    }
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)len8[i] << (8 * i);
    if (hlen > ST_MAX_HEADER) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "%s: header length %" PRIu64 " is beyond safetensors' limit of %u", path, hlen,
                     ST_MAX_HEADER);
        goto out;
    }
    if (8 + hlen > size) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "%s: header length %" PRIu64 " runs past the end of the file (%" PRIu64
                     " bytes)",
                     path, hlen, size);
        goto out;
    }
    header = malloc(hlen ? hlen : 1);
    if (!header) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    PS_CHECK_GOTO(ckpt_pread_full(fd, header, hlen, 8, &got, path, err, errlen), rc, out);
    if (got < hlen) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: truncated header", path);
        goto out;
    }
    rc = ckpt_json_parse(header, hlen, ST_MAX_DEPTH, &doc, why, sizeof(why));
    if (rc != PSHARD_OK) {
        ps_errf(err, errlen, rc, "%s: header: %s", path, why);
        goto out;
    }
    uint64_t data_start = 8 + hlen, data_len = size - data_start;
    PS_CHECK_GOTO(check_header(&doc, data_len, path, err, errlen), rc, out);
    uint32_t t = ckpt_json_get(&doc, 0, name);
    if (!t || strcmp(name, "__metadata__") == 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "%s: no tensor named \"%s\"", path, name);
        goto out;
    }
    const char *dtype = ckpt_json_str(&doc, &doc.nodes[ckpt_json_get(&doc, t, "dtype")]);
    pshard_dtype_t src;
    if (strcmp(dtype, "F32") == 0)
        src = PSHARD_FP32;
    else if (strcmp(dtype, "BF16") == 0)
        src = PSHARD_BF16;
    else if (strcmp(dtype, "F16") == 0)
        src = PSHARD_FP16;
    else {
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "%s: tensor \"%s\" is %s; only F32, BF16 and F16 can be read as fp32", path,
                     name, dtype);
        goto out;
    }
    const ckpt_json_node_t *sh = &doc.nodes[ckpt_json_get(&doc, t, "shape")];
    bool same = ndim >= 0 && sh->count == (uint32_t)ndim;
    int dim = 0;
    for (uint32_t c = sh->child; c && same; c = doc.nodes[c].next, dim++)
        same = doc.nodes[c].v.i == shape[dim];
    if (!same) {
        ckpt_buf_t have = {0}, want = {0};
        for (uint32_t c = sh->child; c; c = doc.nodes[c].next)
            ckpt_buf_printf(&have, "%s%" PRId64, have.len ? ", " : "", doc.nodes[c].v.i);
        for (int i = 0; i < ndim; i++)
            ckpt_buf_printf(&want, "%s%" PRId64, i ? ", " : "", shape[i]);
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "%s: tensor \"%s\" has shape [%s], expected [%s]", path, name,
                     have.data ? have.data : "", want.data ? want.data : "");
        free(have.data);
        free(want.data);
        goto out;
    }
    const ckpt_json_node_t *offs = &doc.nodes[ckpt_json_get(&doc, t, "data_offsets")];
    uint64_t begin = (uint64_t)doc.nodes[offs->child].v.i;
    uint64_t end = (uint64_t)doc.nodes[doc.nodes[offs->child].next].v.i;
    size_t esize = pshard_dtype_size(src);
    uint64_t numel = (end - begin) / esize;
    buf = malloc(ST_CHUNK_ELEMS * esize);
    if (!buf) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    for (uint64_t at = 0; at < numel;) {
        size_t n = numel - at < ST_CHUNK_ELEMS ? (size_t)(numel - at) : ST_CHUNK_ELEMS;
        PS_CHECK_GOTO(ckpt_pread_full(fd, buf, n * esize, data_start + begin + at * esize, &got,
                                      path, err, errlen),
                      rc, out);
        if (got < n * esize) {
            rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: truncated data", path);
            goto out;
        }
        if (ps_convert(buf, src, out + at, PSHARD_FP32, n) != 0) {
            rc = ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "cannot convert %s to fp32", dtype);
            goto out;
        }
        at += n;
    }
out:
    free(buf);
    ckpt_json_free(&doc);
    free(header);
    close(fd);
    return rc;
}
