/* The shard server's remote path: private regions (anonymous memory instead of a trainer's
 * shared memory) and the two RPCs that move bytes in and out of them in chunks of at most
 * 1 MiB, for a trainer on another host. */
#include <errno.h>
#include <inttypes.h>
#include <string.h>
#include <sys/mman.h>

#include "pshard/shard.pb-c.h"
#include "pshard/util.h"
#include "shard_internal.h"

/* A private region for a trainer on another host (no shared memory): anonymous pages. */
pshard_status_t shard_alloc_private(uint64_t bytes, shm_map_t *out, char *err, size_t errlen)
{
    if (bytes == 0 || bytes > (1ull << 46))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "region size %" PRIu64 " is out of range", bytes);
    void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                   0);
    if (p == MAP_FAILED)
        return ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                       "cannot allocate a %" PRIu64 "-byte region: %s", bytes, strerror(errno));
    out->base = p;
    out->bytes = (size_t)bytes;
    out->name[0] = '\0';
    return PSHARD_OK;
}

/* The region a remote trainer names; NULL (and the call failed) when it is not there. */
static shm_map_t *region_of(pshard_shard_server_t *s, ps_rpc_call_t *call, Pshard__Region r)
{
    shm_map_t *m = r == PSHARD__REGION__SCRATCH ? &s->scratch
                   : r == PSHARD__REGION__MODEL ? &s->model_shm
                                                : NULL;
    if (!m) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT, "unknown region %d", (int)r);
        return NULL;
    }
    if (!m->base) {
        ps_rpc_call_fail(call, PSHARD_ERR_FAILED_PRECONDITION, "the %s region is not there yet",
                         r == PSHARD__REGION__SCRATCH ? "scratch" : "model");
        return NULL;
    }
    return m;
}

#define CHUNK_MAX (1u << 20)
#define READ_STALL_NS (60LL * 1000000000LL) /* ReadRegion: a client that reads nothing this long */

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

static void read_region(pshard_shard_server_t *s, ps_rpc_call_t *call,
                        const Pshard__RegionReadRequest *req)
{
    /* Chunks go out at the pace the client reads them (a bounded send queue), each copied
     * under op_mu after checking again that the session and the range are still valid; a
     * client that reads nothing for READ_STALL_NS is dropped. */
    int64_t deadline = ps_rpc_call_deadline_ns(call);
    bool wait = false; /* the last chunk was queued, or refused for want of room */
    for (uint64_t off = 0;; off += CHUNK_MAX) {
        if (wait) {
            int64_t until = ps_now_ns() + READ_STALL_NS;
            pshard_status_t w = ps_rpc_call_wait_writable(call, until < deadline ? until : deadline);
            if (w == PSHARD_ERR_TIMEOUT) {
                ps_rpc_call_fail(call, PSHARD_ERR_RESOURCE_EXHAUSTED,
                                 "ReadRegion: the client read nothing for %lld s",
                                 (long long)(READ_STALL_NS / 1000000000LL));
                return;
            }
            if (w != PSHARD_OK) {
                ps_rpc_call_finish(call); /* the client went away: end the call */
                return;
            }
        }
        pthread_mutex_lock(&s->op_mu);
        shm_map_t *m = NULL;
        if (!shard_session_ok(s, call, req->session) ||
            (m = region_of(s, call, req->region)) == NULL) {
            pthread_mutex_unlock(&s->op_mu);
            return; /* failed with the reason (a new session since the first chunk, say) */
        }
        if (!shard_in_region(m, req->offset, req->length, 0)) {
            ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                             "%" PRIu64 " bytes at offset %" PRIu64
                             " lie outside the %zu-byte region",
                             req->length, req->offset, m->bytes);
            pthread_mutex_unlock(&s->op_mu);
            return;
        }
        if (off >= req->length) {
            ps_rpc_call_finish(call);
            pthread_mutex_unlock(&s->op_mu);
            return;
        }
        uint64_t n = req->length - off < CHUNK_MAX ? req->length - off : CHUNK_MAX;
        Pshard__DataChunk c = PSHARD__DATA_CHUNK__INIT;
        c.offset = req->offset + off;
        c.data.data = (uint8_t *)m->base + req->offset + off;
        c.data.len = (size_t)n;
        pshard_status_t rc = ps_rpc_call_send(call, &c.base);
        pthread_mutex_unlock(&s->op_mu);
        wait = true;
        if (rc == PSHARD_ERR_RESOURCE_EXHAUSTED) {
            /* Its connection's (or the server's) send budget is full for now: wait for room
             * and send this chunk again. */
            off -= CHUNK_MAX;
            continue;
        }
        if (rc == PSHARD_ERR_CANCELLED) {
            ps_rpc_call_finish(call);
            return;
        }
        if (rc != PSHARD_OK) {
            ps_rpc_call_fail(call, rc, "ReadRegion: cannot queue a chunk");
            return;
        }
    }
}

/* A ReadRegion waits for its reader while it holds a worker of the RPC pool: so that slow or
 * stalled readers cannot take every worker from the trainer's operations, at most all but two
 * of them read regions at once (at least one). */
void shard_handle_read_region(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_shard_server_t *s = ctx;
    ps_rpc_load_t load;
    ps_rpc_server_load(s->srv, &load);
    int limit = load.workers > 2 ? load.workers - 2 : 1;
    int now = atomic_fetch_add(&s->region_reads, 1);
    if (now >= limit) {
        atomic_fetch_sub(&s->region_reads, 1);
        ps_rpc_call_fail(call, PSHARD_ERR_RESOURCE_EXHAUSTED,
                         "ReadRegion: %d region reads are in progress, the most this server "
                         "runs at once (its other workers stay for trainer operations); retry "
                         "when one has finished",
                         now);
        return;
    }
    read_region(s, call, (const Pshard__RegionReadRequest *)request);
    atomic_fetch_sub(&s->region_reads, 1);
}

void shard_handle_write_region(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    pshard_shard_server_t *s = ctx;
    const Pshard__RegionWriteRequest *req = (const Pshard__RegionWriteRequest *)request;
    pthread_mutex_lock(&s->op_mu);
    if (!shard_session_ok(s, call, req->session)) {
        pthread_mutex_unlock(&s->op_mu);
        return;
    }
    char err[PSHARD_ERRLEN] = "";
    shm_map_t *m = NULL;
    if (req->data.len > CHUNK_MAX) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                         "a chunk of %zu bytes exceeds the %u-byte limit", req->data.len,
                         CHUNK_MAX);
    } else if (req->region == PSHARD__REGION__MODEL && req->region_bytes &&
               shard_region_size_ok(s, req->region_bytes, err, sizeof(err)) != PSHARD_OK) {
        ps_rpc_call_fail(call, PSHARD_ERR_RESOURCE_EXHAUSTED, "%s", err);
    } else if (req->region == PSHARD__REGION__MODEL && req->region_bytes) {
        /* Before DefineModel: the private model region being filled. */
        if (s->pending_model.bytes != req->region_bytes) {
            shard_unmap(&s->pending_model);
            pshard_status_t rc = shard_alloc_private(req->region_bytes, &s->pending_model, err,
                                               sizeof(err));
            if (rc != PSHARD_OK)
                ps_rpc_call_fail(call, rc, "%s", err);
            else
                m = &s->pending_model;
        } else {
            m = &s->pending_model;
        }
    } else {
        m = region_of(s, call, req->region);
    }
    if (m && !shard_in_region(m, req->offset, req->data.len, 0)) {
        ps_rpc_call_fail(call, PSHARD_ERR_INVALID_ARGUMENT,
                         "%zu bytes at offset %" PRIu64 " lie outside the %zu-byte region",
                         req->data.len, req->offset, m->bytes);
        m = NULL;
    }
    if (m) {
        if (req->data.len)
            memcpy((uint8_t *)m->base + req->offset, req->data.data, req->data.len);
        Pshard__RegionWriteResponse out = PSHARD__REGION_WRITE_RESPONSE__INIT;
        ps_rpc_call_reply(call, &out.base);
    }
    pthread_mutex_unlock(&s->op_mu);
}

