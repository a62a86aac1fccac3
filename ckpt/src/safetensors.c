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

/* The header JSON (compact, the metadata first, tensors in parameter order), padded with
 * spaces to a multiple of 8 bytes into *out (malloc'd) and *len. Errors: NO_MEMORY. */
static pshard_status_t build_header(const ps_ckpt_manifest_t *m, const char *st_dtype,
                                    size_t elem_size, char **out, size_t *len, char *err,
                                    size_t errlen)
{
    char step[32];
    snprintf(step, sizeof(step), "%" PRId64, m->step);
    json_t *h = json_pack("{s:{s:s, s:s}}", "__metadata__", "format", "pt", "pshard_step", step);
    uint64_t off = 0;
    for (size_t p = 0; h && p < m->nparams; p++) {
        const ps_ckpt_param_t *pr = &m->params[p];
        uint64_t bytes = numel_of(pr) * elem_size;
        json_t *shape = json_array();
        for (int d = 0; shape && d < pr->ndim; d++)
            if (json_array_append_new(shape, json_integer(pr->shape[d])) != 0)
                json_decref(shape), shape = NULL;
        json_t *t = shape ? json_pack("{s:s, s:o, s:[I, I]}", "dtype", st_dtype, "shape", shape,
                                      "data_offsets", (json_int_t)off, (json_int_t)(off + bytes))
                          : NULL;
        if (json_object_set_new(h, pr->name, t) != 0)
            json_decref(h), h = NULL;
        off += bytes;
    }
    char *text = h ? json_dumps(h, JSON_COMPACT) : NULL;
    json_decref(h);
    size_t n = text ? strlen(text) : 0, padded = (n + 7) / 8 * 8;
    char *buf = text ? realloc(text, padded + 1) : NULL;
    if (!buf) {
        free(text);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    memset(buf + n, ' ', padded - n);
    *out = buf;
    *len = padded;
    return PSHARD_OK;
}

pshard_status_t ps_safetensors_export(const char *step_dir, const ps_ckpt_manifest_t *m,
                                      pshard_dtype_t dtype, const char *out_path, char *err,
                                      size_t errlen)
{
    if (dtype != PSHARD_FP32 && dtype != PSHARD_BF16)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "safetensors export writes fp32 or bf16, not %s", pshard_dtype_name(dtype));
    char why[PSHARD_ERRLEN] = "";
    pshard_status_t rc = ckpt_manifest_check(m, why, sizeof(why));
    if (rc != PSHARD_OK)
        return ps_errf(err, errlen, rc, "%s: %s", step_dir, why);
    for (size_t p = 0; p < m->nparams; p++)
        if (strcmp(m->params[p].name, "__metadata__") == 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "parameter %zu is named __metadata__, which safetensors reserves", p);
    size_t esize = pshard_dtype_size(dtype);
    char *header = NULL;
    size_t header_len = 0;
    PS_CHECK(build_header(m, dtype == PSHARD_FP32 ? "F32" : "BF16", esize, &header, &header_len,
                          err, errlen));
    if (header_len > ST_MAX_HEADER) {
        free(header);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: a header of %zu bytes is beyond safetensors' limit of %u", out_path,
                       header_len, ST_MAX_HEADER);
    }
    /* The output is the caller's own path (links followed, as cp does); only the file itself
     * is written under a fresh temporary name and renamed into place. */
    ps_atomic_file_t o;
    rc = ps_atomic_file_open_path(out_path, &o, err, errlen);
    if (rc != PSHARD_OK) {
        free(header);
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
        len8[i] = (uint8_t)((uint64_t)header_len >> (8 * i));
    PS_CHECK_GOTO(ps_write_all(fd, len8, sizeof(len8), out_path, err, errlen), rc, out);
    PS_CHECK_GOTO(ps_write_all(fd, header, header_len, out_path, err, errlen), rc, out);
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
    free(header);
    pshard_status_t rc2 = ps_atomic_file_commit(&o, rc == PSHARD_OK, err, errlen);
    return rc != PSHARD_OK ? rc : rc2;
}

/* ---- Reading ------------------------------------------------------------------------------ */

typedef struct {
    uint64_t begin, end;
    const char *name; /* the tensor's key in the header */
} st_span_t;

static int span_cmp(const void *a, const void *b)
{
    const st_span_t *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Checks one tensor entry: exactly dtype, shape and data_offsets, a known dtype, a shape of
 * non-negative sizes, offsets inside the data whose length matches. Fills span. */
static pshard_status_t check_tensor(const char *name, const json_t *t, uint64_t data_len,
                                    const char *path, st_span_t *span, char *err, size_t errlen)
{
    json_t *dt, *sh, *of;
    json_error_t je;
    if (json_unpack_ex((json_t *)t, &je, JSON_STRICT, "{s:o, s:o, s:o}", "dtype", &dt, "shape", &sh,
                       "data_offsets", &of) != 0) {
        if (!json_is_object(t))
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s: tensor \"%.64s\": expected an object, found %s", path, name,
                           ckpt_json_type_name(t));
        const char *k;
        json_t *v;
        json_object_foreach(
            (json_t *)t, k,
            v) if (strcmp(k, "dtype") != 0 && strcmp(k, "shape") != 0 &&
                   strcmp(k, "data_offsets") !=
                       0) return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                                         "%s: tensor \"%.64s\": unknown key \"%.64s\"", path, name,
                                         k);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.64s\": needs dtype, shape and data_offsets", path, name);
    }
    size_t esize = json_is_string(dt) ? st_dtype_size(json_string_value(dt)) : 0;
    if (esize == 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.64s\".dtype: not a safetensors dtype", path, name);
    if (!json_is_array(sh) || json_array_size(sh) > ST_MAX_DIMS)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.64s\".shape: expected an array of at most %d sizes", path,
                       name, ST_MAX_DIMS);
    uint64_t numel = 1;
    bool overflow = false;
    size_t d;
    json_t *e;
    json_array_foreach(sh, d, e)
    {
        if (!json_is_integer(e) || json_integer_value(e) < 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s: tensor \"%.64s\".shape: sizes must be integers of at least 0", path,
                           name);
        uint64_t s = (uint64_t)json_integer_value(e);
        if (s != 0 && numel > UINT64_MAX / 8 / s)
            overflow = true;
        else
            numel *= s;
    }
    json_int_t be[2];
    if (json_unpack_ex(of, &je, JSON_STRICT, "[II]", &be[0], &be[1]) != 0 || be[0] < 0 ||
        be[0] > be[1])
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.64s\".data_offsets: expected [begin, end] with 0 <= begin "
                       "<= end",
                       path, name);
    if ((uint64_t)be[1] > data_len)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.64s\".data_offsets: [%" PRId64 ", %" PRId64
                       ") lies outside the %" PRIu64 " bytes of data",
                       path, name, (int64_t)be[0], (int64_t)be[1], data_len);
    if (overflow && json_array_size(sh) > 0)
        numel = UINT64_MAX;
    if (numel == UINT64_MAX || (uint64_t)(be[1] - be[0]) != numel * esize)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: tensor \"%.64s\": data_offsets span %" PRId64
                       " bytes, but its dtype and shape need %" PRIu64,
                       path, name, (int64_t)(be[1] - be[0]), numel * esize);
    *span = (st_span_t){(uint64_t)be[0], (uint64_t)be[1], name};
    return PSHARD_OK;
}

/* Validates the whole header (the __metadata__ object of strings and every tensor entry,
 * none overlapping another). */
static pshard_status_t check_header(const json_t *root, uint64_t data_len, const char *path,
                                    char *err, size_t errlen)
{
    if (!json_is_object(root))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: the header is %s, not an object", path, ckpt_json_type_name(root));
    size_t count = json_object_size(root);
    st_span_t *spans = malloc((count ? count : 1) * sizeof(*spans));
    if (!spans)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    size_t n = 0;
    pshard_status_t rc = PSHARD_OK;
    const char *key;
    json_t *e;
    json_object_foreach((json_t *)root, key, e)
    {
        if (rc != PSHARD_OK)
            break;
        if (strcmp(key, "__metadata__") == 0) {
            bool ok = json_is_object(e);
            const char *mk;
            json_t *mv;
            json_object_foreach(ok ? e : NULL, mk, mv) ok = ok && json_is_string(mv);
            if (!ok)
                rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                             "%s: __metadata__: expected an object of strings", path);
            continue;
        }
        rc = check_tensor(key, e, data_len, path, &spans[n], err, errlen);
        if (rc == PSHARD_OK)
            n++;
    }
    if (rc == PSHARD_OK && n > 1) {
        qsort(spans, n, sizeof(*spans), span_cmp);
        uint64_t reach = 0; /* end of the non-empty spans so far */
        const char *reach_name = "";
        for (size_t i = 0; i < n && rc == PSHARD_OK; i++) {
            if (spans[i].begin == spans[i].end)
                continue;
            if (spans[i].begin < reach)
                rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                             "%s: tensor \"%.64s\".data_offsets overlap those of \"%.64s\"", path,
                             spans[i].name, reach_name);
            if (spans[i].end > reach) {
                reach = spans[i].end;
                reach_name = spans[i].name;
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
    char *header = NULL, why[PSHARD_ERRLEN] = "";
    void *buf = NULL;
    json_t *doc = NULL;
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
    rc = ckpt_json_load(header, hlen, &doc, why, sizeof(why));
    if (rc != PSHARD_OK) {
        ps_errf(err, errlen, rc, "%s: header: %s", path, why);
        goto out;
    }
    uint64_t data_start = 8 + hlen, data_len = size - data_start;
    PS_CHECK_GOTO(check_header(doc, data_len, path, err, errlen), rc, out);
    const json_t *t = json_object_get(doc, name);
    if (!t || strcmp(name, "__metadata__") == 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "%s: no tensor named \"%s\"", path, name);
        goto out;
    }
    const char *dtype = json_string_value(json_object_get(t, "dtype"));
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
    const json_t *sh = json_object_get(t, "shape");
    bool same = ndim >= 0 && json_array_size(sh) == (size_t)ndim;
    for (int d = 0; same && d < ndim; d++)
        same = json_integer_value(json_array_get(sh, (size_t)d)) == shape[d];
    if (!same) {
        /* Both shapes as JSON writes them: "[3, 2]". */
        json_t *want = json_array();
        for (int d = 0; want && d < ndim; d++)
            json_array_append_new(want, json_integer(shape[d]));
        char *have_s = json_dumps(sh, JSON_INDENT(0)), *want_s = json_dumps(want, JSON_INDENT(0));
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "%s: tensor \"%s\" has shape %s, expected %s", path, name,
                     have_s ? have_s : "?", want_s ? want_s : "?");
        free(have_s);
        free(want_s);
        json_decref(want);
        goto out;
    }
    json_int_t begin_i, end_i;
    json_unpack(json_object_get(t, "data_offsets"), "[II]", &begin_i, &end_i);
    uint64_t begin = (uint64_t)begin_i, end = (uint64_t)end_i;
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
        if (pshard_convert(buf, src, out + at, PSHARD_FP32, n) != 0) {
            rc = ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "cannot convert %s to fp32", dtype);
            goto out;
        }
        at += n;
    }
out:
    free(buf);
    json_decref(doc);
    free(header);
    close(fd);
    return rc;
}
