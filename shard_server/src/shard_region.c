/* The shard server's trainer regions: mapping a trainer's shared memory, private regions
 * (anonymous memory instead, for a trainer on another host), pinning them for the GPU, and the
 * region operations that move a remote trainer's bytes in and out in chunks of at most 1 MiB
 * (the ReadRegion and WriteRegion handlers in shard_service.c run them through shard_op_run). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/collectives.h"
#include "pshard/log.h"
#include "pshard/shm_guard.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"
#include "shard_internal.h"
#include "shard_ops.h"

#define CHUNK_MAX (1u << 20)

/* Maps a trainer's shared-memory object. The name must look like "/pshard-..." (letters,
 * digits, '.', '_', '-'), name a regular object of at least `bytes` bytes. */
pshard_status_t shard_map_shm(const char *name, uint64_t bytes, shm_map_t *out, char *err,
                              size_t errlen)
{
    size_t n = name ? strlen(name) : 0;
    if (n < 9 || n > SHM_NAME_MAX || strncmp(name, "/pshard-", 8) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "shared-memory name must be \"/pshard-...\" (at most %d bytes)",
                       SHM_NAME_MAX);
    for (size_t i = 1; i < n; i++) {
        char ch = name[i];
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                  (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
        if (!ok)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "shared-memory name has an invalid character at %zu", i);
    }
    if (bytes == 0 || bytes > (1ull << 46))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "shared-memory size %" PRIu64 " is out of range", bytes);
    int fd = shm_open(name, O_RDWR | O_NOFOLLOW, 0);
    if (fd < 0)
        return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "cannot open shared memory %s: %s", name,
                       strerror(errno));
    struct stat stt;
    if (fstat(fd, &stt) != 0 || !S_ISREG(stt.st_mode) || (uint64_t)stt.st_size < bytes) {
        close(fd);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "shared memory %s is smaller than the %" PRIu64 " bytes announced", name,
                       bytes);
    }
    void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot map %s: %s", name, strerror(errno));
    out->base = p;
    out->bytes = (size_t)bytes;
    out->guard = ps_shm_guard_add(p, (size_t)bytes) + 1;
    ps_strlcpy(out->name, name, sizeof(out->name));
    return PSHARD_OK;
}

/* A private region for a trainer on another host (no shared memory): anonymous pages. */
pshard_status_t shard_alloc_private(uint64_t bytes, shm_map_t *out, char *err, size_t errlen)
{
    if (bytes == 0 || bytes > (1ull << 46))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "region size %" PRIu64 " is out of range", bytes);
    void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                       "cannot allocate a %" PRIu64 "-byte region: %s", bytes, strerror(errno));
    out->base = p;
    out->bytes = (size_t)bytes;
    out->name[0] = '\0';
    return PSHARD_OK;
}

void shard_unmap(shm_map_t *m)
{
    ps_shm_guard_remove(m->guard - 1);
    if (m->pinned)
        pshard_host_unpin(m->pin_device, m->base);
    if (m->base)
        munmap(m->base, m->bytes);
    memset(m, 0, sizeof(*m));
}

/* True when m is mapped and another process shrank it under the mapping. */
static bool shrunk(const shm_map_t *m)
{
    return m->base && ps_shm_guard_lost(m->guard - 1);
}

pshard_status_t shard_shm_check(const pshard_shard_server_t *s, bool model_too, char *err,
                                size_t errlen)
{
    const char *what = NULL, *name = "", *then = "the trainer must attach again";
    if (shrunk(&s->model_shm)) {
        what = "the trainer's model region";
        name = s->model_shm.name;
    } else if (shrunk(&s->scratch)) {
        what = "the trainer's scratch region";
        name = s->scratch.name;
    } else if (model_too && s->model && s->model->shm.base &&
               ps_shm_guard_lost(s->model->shm.guard - 1)) {
        what = "the shard server's own copy of its shard";
        name = s->model->shm.name;
        then = "the model must be defined again, from a checkpoint";
    }
    if (!what)
        return PSHARD_OK;
    return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                   "%s (shared memory %s) was shrunk by another process while this server had it "
                   "mapped: its contents are lost and nothing more runs on it (%s)",
                   what, name, then);
}

/* True when this server's collectives run on the GPU (host buffers staged by the backend). */
bool shard_on_gpu(const pshard_shard_server_t *s)
{
    return strcmp(s->cfg.backend, "nccl") == 0;
}

void shard_pin_region(pshard_shard_server_t *s, shm_map_t *m)
{
    if (!shard_on_gpu(s) || !m->base || m->pinned)
        return;
    char err[PSHARD_ERRLEN] = "";
    if (pshard_host_pin(s->cfg.device, m->base, m->bytes, err, sizeof(err)) == PSHARD_OK) {
        m->pinned = true;
        m->pin_device = s->cfg.device;
    } else
        PS_WARN(PS_SUB_SHARD,
                "trainer region of %zu bytes stays pageable (copies to the GPU "
                "are slower): %s",
                m->bytes, err);
}

/* Checks [offset, offset + len) lies in the region and offset is aligned to align. */
bool shard_in_region(const shm_map_t *m, uint64_t offset, uint64_t len, size_t align)
{
    return m->base && offset <= m->bytes && len <= m->bytes - offset &&
           (align == 0 || offset % align == 0);
}

pshard_status_t shard_region_size_ok(const pshard_shard_server_t *s, uint64_t bytes, char *err,
                                     size_t errlen)
{
    if (s->max_model_bytes == 0 || bytes <= s->max_model_bytes)
        return PSHARD_OK;
    return ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                   "a model region of %" PRIu64 " bytes is more than this shard server may hold "
                   "(%" PRIu64 " bytes, --max-model-memory)",
                   bytes, s->max_model_bytes);
}

/* The region a remote trainer names, into *out. Errors: INVALID_ARGUMENT for an unknown one,
 * FAILED_PRECONDITION when it is not there yet. */
static pshard_status_t region_of(pshard_shard_server_t *s, Pshard__Region r, shm_map_t **out,
                                 char *err, size_t errlen)
{
    shm_map_t *m = r == PSHARD__REGION__SCRATCH ? &s->scratch
                   : r == PSHARD__REGION__MODEL ? &s->model_shm
                                                : NULL;
    if (!m)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown region %d", (int)r);
    if (!m->base)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "the %s region is not there yet",
                       r == PSHARD__REGION__SCRATCH ? "scratch" : "model");
    *out = m;
    return PSHARD_OK;
}

pshard_status_t shard_region_read_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                      char *err, size_t errlen)
{
    /* Checked again for every chunk: a new session (a re-attach) replaces the regions. */
    shard_read_chunk_t *a = op->arg;
    const Pshard__RegionReadRequest *req = a->req;
    shm_map_t *m = NULL;
    PS_CHECK(region_of(s, req->region, &m, err, errlen));
    if (!shard_in_region(m, req->offset, req->length, 0))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%" PRIu64 " bytes at offset %" PRIu64 " lie outside the %zu-byte region",
                       req->length, req->offset, m->bytes);
    if (a->off >= req->length) {
        ps_rpc_call_finish(a->call);
        a->finished = true;
        return PSHARD_OK;
    }
    uint64_t n = req->length - a->off < CHUNK_MAX ? req->length - a->off : CHUNK_MAX;
    Pshard__DataChunk c = PSHARD__DATA_CHUNK__INIT;
    c.offset = req->offset + a->off;
    c.data.data = (uint8_t *)m->base + req->offset + a->off;
    c.data.len = (size_t)n;
    a->sent = ps_rpc_call_send(a->call, &c.base);
    if (a->sent == PSHARD_OK)
        a->off += n;
    return PSHARD_OK;
}

pshard_status_t shard_region_write_run(pshard_shard_server_t *s, pshard_comm_t *comm,
                                       shard_op_t *op, char *err, size_t errlen)
{
    const Pshard__RegionWriteRequest *req = op->arg;
    if (req->data.len > CHUNK_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "a chunk of %zu bytes exceeds the %u-byte limit", req->data.len, CHUNK_MAX);
    shm_map_t *m = NULL;
    if (req->region == PSHARD__REGION__MODEL && req->region_bytes) {
        /* Before DefineModel: the private model region being filled. */
        PS_CHECK(shard_region_size_ok(s, req->region_bytes, err, errlen));
        if (s->pending_model.bytes != req->region_bytes) {
            shard_unmap(&s->pending_model);
            PS_CHECK(shard_alloc_private(req->region_bytes, &s->pending_model, err, errlen));
        }
        m = &s->pending_model;
    } else {
        PS_CHECK(region_of(s, req->region, &m, err, errlen));
    }
    if (!shard_in_region(m, req->offset, req->data.len, 0))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%zu bytes at offset %" PRIu64 " lie outside the %zu-byte region",
                       req->data.len, req->offset, m->bytes);
    if (req->data.len)
        memcpy((uint8_t *)m->base + req->offset, req->data.data, req->data.len);
    return PSHARD_OK;
}
