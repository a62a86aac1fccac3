/* libpshard's calls to its shard server, the client's last error (client_fail), and the remote
 * path (PSHARD_REMOTE=1): region bytes copied over gRPC in 1 MiB chunks instead of shared
 * memory. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "pshard/log.h"
#include "pshard/util.h"

#include "client_internal.h"

pshard_status_t client_fail(pshard_client_t *c, pshard_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->last_error, sizeof(c->last_error), fmt, ap);
    va_end(ap);
    return st;
}

const char *pshard_last_error(const pshard_client_t *c)
{
    return c ? c->last_error : "no client";
}

/* PSHARD_OK, or the sticky loss of this trainer's shard server (message into err). */
static pshard_status_t lost_check(pshard_client_t *c, char *err, size_t errlen)
{
    pthread_mutex_lock(&c->mu);
    pshard_status_t st = c->lost;
    if (st != PSHARD_OK && err && errlen)
        snprintf(err, errlen, "%s", c->lost_msg);
    pthread_mutex_unlock(&c->mu);
    return st;
}

pshard_status_t client_call(pshard_client_t *c, const char *method, const ProtobufCMessage *req,
                            const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp,
                            char *err, size_t errlen)
{
    char path[96];
    snprintf(path, sizeof(path), "/pshard.ShardServer/%s", method);
    ProtobufCMessage *r = NULL;
    if (lost_check(c, err, errlen) != PSHARD_OK)
        return c->lost;
    pshard_status_t rc =
        ps_rpc_unary(c->ch, path, req, desc, &r, c->cfg.timeout_ms, 0, NULL, err, errlen);
    if (rc != PSHARD_OK && lost_check(c, NULL, 0) != PSHARD_OK) {
        /* Cancelled because the server was evicted: say so, not "cancelled". */
        snprintf(err, errlen, "%s", c->lost_msg);
        rc = c->lost;
    }
    if (resp)
        *resp = r;
    else if (r)
        protobuf_c_message_free_unpacked(r, NULL);
    return rc;
}

/* Remote path: copies len bytes at off of a local region to the server's, in chunks.
 * region_bytes (MODEL before DefineModel) asks the server to create its region first. */
pshard_status_t client_remote_write(pshard_client_t *c, Pshard__Region region, const region_t *r,
                                    size_t off, size_t len, uint64_t region_bytes, char *err,
                                    size_t errlen)
{
    size_t done = 0;
    do {
        size_t n = len - done < CHUNK ? len - done : CHUNK;
        Pshard__RegionWriteRequest req = PSHARD__REGION_WRITE_REQUEST__INIT;
        req.session = c->session;
        req.region = region;
        req.offset = off + done;
        req.data.data = (uint8_t *)r->base + off + done;
        req.data.len = n;
        req.region_bytes = region_bytes;
        PS_CHECK(client_call(c, "WriteRegion", &req.base,
                             &pshard__region_write_response__descriptor, NULL, err, errlen));
        done += n;
    } while (done < len);
    return PSHARD_OK;
}

/* Remote path: fetches len bytes at off of the server's region into the local one. */
pshard_status_t client_remote_read(pshard_client_t *c, Pshard__Region region, region_t *r,
                                   size_t off, size_t len, char *err, size_t errlen)
{
    Pshard__RegionReadRequest req = PSHARD__REGION_READ_REQUEST__INIT;
    req.session = c->session;
    req.region = region;
    req.offset = off;
    req.length = len;
    ps_rpc_stream_t *st = ps_rpc_stream_open(c->ch, "/pshard.ShardServer/ReadRegion", &req.base,
                                             c->cfg.timeout_ms, err, errlen);
    if (!st)
        return PSHARD_ERR_RPC;
    size_t got = 0;
    pshard_status_t rc = PSHARD_OK;
    for (;;) {
        ProtobufCMessage *msg = NULL;
        rc = ps_rpc_stream_next(st, &pshard__data_chunk__descriptor, &msg, -1, NULL, err, errlen);
        if (rc != PSHARD_OK || !msg)
            break;
        Pshard__DataChunk *ch = (Pshard__DataChunk *)msg;
        if (ch->offset < off || ch->data.len > len || ch->offset - off > len - ch->data.len) {
            rc = ps_errf(err, errlen, PSHARD_ERR_RPC, "the server sent a chunk outside the range");
        } else {
            memcpy((uint8_t *)r->base + ch->offset, ch->data.data, ch->data.len);
            got += ch->data.len;
        }
        protobuf_c_message_free_unpacked(msg, NULL);
        if (rc != PSHARD_OK)
            break;
    }
    ps_rpc_stream_close(st);
    if (rc == PSHARD_OK && got != len)
        rc = ps_errf(err, errlen, PSHARD_ERR_RPC, "the server sent %zu of %zu bytes", got, len);
    return rc;
}

Pshard__DType client_dtype_pb(pshard_dtype_t d)
{
    switch (d) {
    case PSHARD_BF16:
        return PSHARD__DTYPE__BF16;
    case PSHARD_FP16:
        return PSHARD__DTYPE__FP16;
    case PSHARD_INT64:
        return PSHARD__DTYPE__INT64;
    case PSHARD_FP64:
        return PSHARD__DTYPE__FP64;
    case PSHARD_INT32:
        return PSHARD__DTYPE__INT32;
    case PSHARD_UINT8:
        return PSHARD__DTYPE__UINT8;
    default:
        return PSHARD__DTYPE__FP32;
    }
}
