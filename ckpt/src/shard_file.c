/* Shard files (pshard/ckpt.h): writing one rank's file as a stream with its CRC-32C,
 * reading it back whole with the CRC checked, verifying it, and reading element ranges of a
 * parameter from whichever files hold them. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt_internal.h"
#include "pshard/atomic_file.h"
#include "pshard/ckpt.h"
#include "pshard/util.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoint files are little-endian fp32; a big-endian host needs byte swapping here"
#endif

/* Streams are checksummed in pieces that stay in the CPU cache between the CRC and the copy. */
#define STREAM_CHUNK (256u << 10)
/* ps_ckpt_verify_file reads in buffers of this size. */
#define VERIFY_CHUNK (4u << 20)

const char *ps_ckpt_shard_name(int rank, int world, char *buf, size_t len)
{
    snprintf(buf, len, "shard-%05d-of-%05d.bin", rank, world);
    return buf;
}

/* Opens file `name` of the step directory dir as ckpt_file_open does (no links, regular files
 * only); *size (may be NULL) gets its size. */
static pshard_status_t open_in_dir(const char *dir, const char *name, const char *shown, int *fd,
                                   uint64_t *size, char *err, size_t errlen)
{
    int dfd;
    PS_CHECK(ckpt_dir_open(dir, false, &dfd, err, errlen));
    pshard_status_t rc = ckpt_file_open(dfd, name, shown, false, fd, size, err, errlen);
    close(dfd);
    return rc;
}

/* ---- Writing ------------------------------------------------------------------------------ */

struct ps_ckpt_shard_out {
    ps_atomic_file_t file;
    uint64_t bytes;
    uint32_t crc;
};

pshard_status_t ps_ckpt_shard_out_open(int dfd, const char *step_dir, int rank, int world,
                                       ps_ckpt_shard_out_t **out, char *err, size_t errlen)
{
    *out = NULL;
    char name[64], path[PATH_MAX];
    ps_ckpt_shard_name(rank, world, name, sizeof(name));
    if (ps_snprintf(path, sizeof(path), "%s/%s", step_dir, name) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "path too long: %s", step_dir);
    ps_ckpt_shard_out_t *o = calloc(1, sizeof(*o));
    if (!o)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    pshard_status_t rc = ps_atomic_file_open(dfd, name, path, &o->file, err, errlen);
    if (rc != PSHARD_OK) {
        free(o);
        return rc;
    }
    *out = o;
    return PSHARD_OK;
}

pshard_status_t ps_ckpt_shard_out_write(ps_ckpt_shard_out_t *o, const void *buf, size_t len,
                                        char *err, size_t errlen)
{
    const uint8_t *p = buf;
    while (len > 0) {
        size_t n = len < STREAM_CHUNK ? len : STREAM_CHUNK;
        o->crc = ps_crc32c(o->crc, p, n);
        PS_CHECK(ps_atomic_file_write(&o->file, p, n, err, errlen));
        o->bytes += n;
        p += n;
        len -= n;
    }
    return PSHARD_OK;
}

pshard_status_t ps_ckpt_shard_out_close(ps_ckpt_shard_out_t *o, bool commit, uint64_t *bytes,
                                        uint32_t *crc32c, char *err, size_t errlen)
{
    if (!o)
        return PSHARD_OK;
    pshard_status_t rc = ps_atomic_file_commit(&o->file, commit, err, errlen);
    if (commit && rc == PSHARD_OK) {
        *bytes = o->bytes;
        *crc32c = o->crc;
    }
    free(o);
    return rc;
}

/* ---- Reading ------------------------------------------------------------------------------ */

struct ps_ckpt_shard_in {
    int fd;
    uint64_t bytes, done; /* the manifest's size, and how much was read */
    uint32_t crc, want_crc;
    char path[PATH_MAX];
};

pshard_status_t ps_ckpt_shard_in_open(const char *step_dir, const ps_ckpt_file_t *f,
                                      ps_ckpt_shard_in_t **in, char *err, size_t errlen)
{
    *in = NULL;
    const char *why = ckpt_plain_name_problem(f->path, sizeof(f->path));
    if (why)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: shard file name \"%.*s\" %s",
                       step_dir, 64, f->path, why);
    ps_ckpt_shard_in_t *r = calloc(1, sizeof(*r));
    if (!r)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    r->fd = -1;
    r->bytes = f->bytes;
    r->want_crc = f->crc32c;
    uint64_t size = 0;
    pshard_status_t rc = PSHARD_OK;
    if (ps_snprintf(r->path, sizeof(r->path), "%s/%s", step_dir, f->path) != 0)
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "path too long: %s", step_dir);
    if (rc == PSHARD_OK)
        rc = open_in_dir(step_dir, f->path, r->path, &r->fd, &size, err, errlen);
    if (rc == PSHARD_OK && size < f->bytes)
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "%s: truncated: %" PRIu64 " of %" PRIu64 " bytes", r->path, size, f->bytes);
    if (rc == PSHARD_OK && size > f->bytes)
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "%s: %" PRIu64 " bytes, but the manifest says %" PRIu64, r->path, size,
                     f->bytes);
    if (rc != PSHARD_OK) {
        ps_ckpt_shard_in_close(r, false, NULL, 0);
        return rc;
    }
    *in = r;
    return PSHARD_OK;
}

pshard_status_t ps_ckpt_shard_in_read(ps_ckpt_shard_in_t *r, void *buf, size_t len, char *err,
                                      size_t errlen)
{
    if (len > r->bytes - r->done)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: reading past the %" PRIu64 " bytes the manifest gives it", r->path,
                       r->bytes);
    uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = read(r->fd, p, len < STREAM_CHUNK ? len : STREAM_CHUNK);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return ps_sys_err(err, errlen, "read", r->path);
        if (n == 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s: truncated: %" PRIu64 " of %" PRIu64 " bytes", r->path, r->done,
                           r->bytes);
        r->crc = ps_crc32c(r->crc, p, (size_t)n);
        r->done += (uint64_t)n;
        p += n;
        len -= (size_t)n;
    }
    return PSHARD_OK;
}

pshard_status_t ps_ckpt_shard_in_close(ps_ckpt_shard_in_t *r, bool verify, char *err, size_t errlen)
{
    if (!r)
        return PSHARD_OK;
    pshard_status_t rc = PSHARD_OK;
    if (verify && r->done != r->bytes)
        rc = ps_errf(err, errlen, PSHARD_ERR_INTERNAL,
                     "%s: %" PRIu64 " of %" PRIu64 " bytes read; the checksum needs all", r->path,
                     r->done, r->bytes);
    else if (verify && r->crc != r->want_crc)
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "%s: checksum mismatch (CRC-32C %08" PRIx32 ", the manifest says %08" PRIx32
                     ")",
                     r->path, r->crc, r->want_crc);
    if (r->fd >= 0)
        close(r->fd);
    free(r);
    return rc;
}

pshard_status_t ps_ckpt_verify_file(const char *step_dir, const ps_ckpt_file_t *f, char *err,
                                    size_t errlen)
{
    ps_ckpt_shard_in_t *in;
    PS_CHECK(ps_ckpt_shard_in_open(step_dir, f, &in, err, errlen));
    size_t cap = f->bytes < VERIFY_CHUNK ? (size_t)f->bytes : VERIFY_CHUNK;
    uint8_t *buf = malloc(cap ? cap : 1);
    pshard_status_t rc =
        buf ? PSHARD_OK : ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    for (uint64_t off = 0; off < f->bytes && rc == PSHARD_OK; off += cap) {
        size_t n = f->bytes - off < cap ? (size_t)(f->bytes - off) : cap;
        rc = ps_ckpt_shard_in_read(in, buf, n, err, errlen);
    }
    free(buf);
    pshard_status_t rc2 = ps_ckpt_shard_in_close(in, rc == PSHARD_OK, err, errlen);
    return rc != PSHARD_OK ? rc : rc2;
}

/* ---- Element ranges ----------------------------------------------------------------------- */

pshard_status_t ps_ckpt_read_range(const char *step_dir, const ps_ckpt_manifest_t *m, int section,
                                   uint32_t param, uint64_t start, uint64_t count, float *out,
                                   char *err, size_t errlen)
{
    if (section < 0 || section >= m->nsections)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: section %d does not exist (%d sections)", step_dir, section,
                       m->nsections);
    if (param >= m->nparams)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: parameter %" PRIu32 " does not exist (%zu parameters)", step_dir, param,
                       m->nparams);
    uint64_t numel = ckpt_param_numel(&m->params[param]);
    if (count > numel || start > numel - count)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: elements [%" PRIu64 ", %" PRIu64 ") lie outside parameter %s (%" PRIu64
                       " elements)",
                       step_dir, start, start + count, m->params[param].name, numel);
    uint64_t end = start + count, covered = 0;
    /* This parameter's pieces, in file order (so each file is opened once), from the
     * manifest's index; a manifest put together by hand has none, so one is built here. */
    size_t *own_start = NULL;
    ps_ckpt_piece_ref_t *own = NULL;
    const size_t *first = m->by_param_start;
    const ps_ckpt_piece_ref_t *all = m->by_param;
    if (!all) {
        PS_CHECK(ckpt_build_index(m, &own_start, &own, err, errlen));
        first = own_start;
        all = own;
    }
    const ps_ckpt_piece_ref_t *refs = all + first[param];
    size_t nrefs = first[param + 1] - first[param];
    pshard_status_t rc = PSHARD_OK;
    int fd = -1;
    size_t fd_file = SIZE_MAX;
    char path[PATH_MAX] = "";
    for (size_t r = 0; r < nrefs && covered < count && rc == PSHARD_OK; r++) {
        const ps_ckpt_file_t *f = &m->files[refs[r].file];
        const ps_ckpt_piece_t *pc = &f->pieces[refs[r].piece];
        uint64_t lo = pc->start > start ? pc->start : start;
        uint64_t hi = pc->start + pc->count < end ? pc->start + pc->count : end;
        if (lo >= hi)
            continue;
        if (fd_file != refs[r].file) {
            if (fd >= 0)
                close(fd);
            fd = -1;
            fd_file = refs[r].file;
            const char *why = ckpt_plain_name_problem(f->path, sizeof(f->path));
            if (why) {
                rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                             "%s: shard file name \"%.*s\" %s", step_dir, 64, f->path, why);
                break;
            }
            ps_snprintf(path, sizeof(path), "%s/%s", step_dir, f->path);
            rc = open_in_dir(step_dir, f->path, path, &fd, NULL, err, errlen);
            if (rc != PSHARD_OK)
                break;
        }
        uint64_t elem = (uint64_t)section * f->shard_numel + pc->offset + (lo - pc->start);
        size_t want = (size_t)(hi - lo) * sizeof(float), got = 0;
        rc = ckpt_pread_full(fd, out + (lo - start), want, elem * sizeof(float), &got, path, err,
                             errlen);
        if (rc == PSHARD_OK && got < want)
            rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                         "%s: truncated: needed bytes up to %" PRIu64 ", the file ends at %" PRIu64,
                         path, (elem + (hi - lo)) * sizeof(float), elem * sizeof(float) + got);
        covered += hi - lo;
    }
    if (fd >= 0)
        close(fd);
    free(own_start);
    free(own);
    if (rc == PSHARD_OK && covered != count)
        rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                     "%s: the pieces of parameter %s hold %" PRIu64 " of elements [%" PRIu64
                     ", %" PRIu64 ")",
                     step_dir, m->params[param].name, covered, start, end);
    return rc;
}
