/* One call's life on the server, the per-call state machine that the server loop (rpc_server.c)
 * drives: receiving the request, running the handler inline or handing it to the worker pool,
 * sending the reply or stream messages within the call's, its connection's and the server's send
 * budgets, cancellation and the deadline, and the final status. Every in-flight call is one
 * refcounted struct whose memory is released only after all of its batches have completed. */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>

#include "pshard/log.h"
#include "pshard/queue.h"
#include "pshard/rpc.h"
#include "pshard/util.h"
#include "rpc_call.h"

typedef struct send_item {
    ps_qnode_t node;
    grpc_byte_buffer *bb;
    size_t bytes;
} send_item_t;

static void acct_put(ps_rpc_call_t *c);
static bool acct_take(ps_rpc_call_t *c, size_t bytes);
static void acct_release(ps_rpc_call_t *c, size_t bytes);
static bool acct_room(ps_rpc_call_t *c);

static void start_final_locked(ps_rpc_call_t *c);
static void start_next_send_locked(ps_rpc_call_t *c);

/* --------------------------------------------------------------------------------------- */
/* Call lifetime                                                                            */

ps_rpc_call_t *rpc_call_alloc(ps_rpc_server_t *srv)
{
    ps_rpc_call_t *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->srv = srv;
    grpc_call_details_init(&c->details);
    grpc_metadata_array_init(&c->md);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->writable, NULL);
    c->refs = 1;
    c->t_new = (rpc_tag_t){TAG_NEW, c};
    c->t_recv = (rpc_tag_t){TAG_RECV, c};
    c->t_send = (rpc_tag_t){TAG_SEND, c};
    c->t_close = (rpc_tag_t){TAG_CLOSE, c};
    c->t_final = (rpc_tag_t){TAG_FINAL, c};
    c->deadline_ns = INT64_MAX;
    pthread_mutex_lock(&srv->mu);
    c->live_next = srv->live;
    if (srv->live)
        srv->live->live_prev = c;
    srv->live = c;
    srv->nlive++;
    pthread_mutex_unlock(&srv->mu);
    return c;
}

static void call_free(ps_rpc_call_t *c)
{
    ps_rpc_server_t *srv = c->srv;
    if (c->call)
        grpc_call_unref(c->call);
    grpc_call_details_destroy(&c->details);
    grpc_metadata_array_destroy(&c->md);
    if (c->recv_bb)
        grpc_byte_buffer_destroy(c->recv_bb);
    if (c->send_bb)
        grpc_byte_buffer_destroy(c->send_bb);
    if (c->final_bb)
        grpc_byte_buffer_destroy(c->final_bb);
    if (c->final_details_set)
        grpc_slice_unref(c->final_details);
    if (c->final_md_set)
        grpc_slice_unref(c->final_md.value);
    send_item_t *it;
    while ((it = PS_QUEUE_POP(&c->sendq, send_item_t, node)) != NULL) {
        grpc_byte_buffer_destroy(it->bb);
        free(it);
    }
    acct_release(c, c->queued_bytes);
    acct_put(c);
    if (c->peer)
        gpr_free(c->peer);
    free(c->identity);
    free(c->path);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->writable);
    pthread_mutex_lock(&srv->mu);
    if (c->live_prev)
        c->live_prev->live_next = c->live_next;
    else
        srv->live = c->live_next;
    if (c->live_next)
        c->live_next->live_prev = c->live_prev;
    srv->nlive--;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
    free(c);
}

void rpc_call_unref(ps_rpc_call_t *c)
{
    pthread_mutex_lock(&c->mu);
    int left = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (left == 0)
        call_free(c);
}

void rpc_call_start_batch_locked(ps_rpc_call_t *c, const grpc_op *ops, size_t nops, rpc_tag_t *tag)
{
    c->refs++;
    grpc_call_error e = grpc_call_start_batch(c->call, ops, nops, tag, NULL);
    if (e != GRPC_CALL_OK) {
        /* A batch the core refused will never complete; undo its reference. This only happens
         * on a programming error (e.g. two sends at once), so log it loudly. */
        c->refs--;
        atomic_store(&c->cancelled, true);
        PS_ERROR(PS_SUB_RPC, "grpc_call_start_batch(%s) failed: %d", c->path ? c->path : "?",
                 (int)e);
    }
}

/* Records the final status and, once no message is being written, sends it. Drops the owner
 * reference exactly once. */
void rpc_call_finalize(ps_rpc_call_t *c, grpc_status_code code, const char *msg,
                       grpc_byte_buffer *reply)
{
    pthread_mutex_lock(&c->mu);
    if (c->finishing) {
        pthread_mutex_unlock(&c->mu);
        if (reply)
            grpc_byte_buffer_destroy(reply);
        PS_WARN(PS_SUB_RPC, "%s: call finished twice (ignored)", c->path ? c->path : "?");
        return;
    }
    c->finishing = true;
    pthread_cond_broadcast(&c->writable);
    c->final_code = code;
    c->final_bb = reply;
    if (msg && *msg) {
        c->final_details = grpc_slice_from_copied_string(msg);
        c->final_details_set = true;
    }
    if (c->method && code != GRPC_STATUS_OK)
        atomic_fetch_add(&c->method->errors, 1);
    if (!c->send_in_flight)
        start_final_locked(c);
    int left = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (left == 0)
        call_free(c);
}

static void start_final_locked(ps_rpc_call_t *c)
{
    if (c->final_started)
        return;
    c->final_started = true;
    /* Messages still queued are dropped when the call failed; on success they were sent. */
    grpc_op ops[3];
    size_t n = 0;
    memset(ops, 0, sizeof(ops));
    if (!c->initial_md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
        c->initial_md_sent = true;
    }
    if (c->final_bb) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = c->final_bb;
        n++;
    }
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = c->final_code;
    ops[n].data.send_status_from_server.status_details =
        c->final_details_set ? &c->final_details : NULL;
    ops[n].data.send_status_from_server.trailing_metadata_count = 0;
    if (c->final_pshard_status != 0) {
        char v[16];
        snprintf(v, sizeof(v), "%d", c->final_pshard_status);
        c->final_md.key = grpc_slice_from_static_string("pshard-status");
        c->final_md.value = grpc_slice_from_copied_string(v);
        c->final_md_set = true;
        ops[n].data.send_status_from_server.trailing_metadata_count = 1;
        ops[n].data.send_status_from_server.trailing_metadata = &c->final_md;
    }
    n++;
    rpc_call_start_batch_locked(c, ops, n, &c->t_final);
}

static void start_next_send_locked(ps_rpc_call_t *c)
{
    send_item_t *it = PS_QUEUE_POP(&c->sendq, send_item_t, node);
    if (!it)
        return;
    c->send_bb = it->bb;
    c->send_bytes = it->bytes;
    free(it);
    grpc_op ops[2];
    size_t n = 0;
    memset(ops, 0, sizeof(ops));
    if (!c->initial_md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
        c->initial_md_sent = true;
    }
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = c->send_bb;
    n++;
    c->send_in_flight = true;
    rpc_call_start_batch_locked(c, ops, n, &c->t_send);
}

/* The packed message; *bytes (may be NULL) gets its size. */
static grpc_byte_buffer *pack_message(const ProtobufCMessage *msg, size_t *bytes)
{
    size_t len = protobuf_c_message_get_packed_size(msg);
    if (bytes)
        *bytes = len;
    grpc_slice s = grpc_slice_malloc(len);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* --------------------------------------------------------------------------------------- */
/* Public call API                                                                          */

void ps_rpc_call_reply(ps_rpc_call_t *call, const ProtobufCMessage *response)
{
    rpc_call_finalize(call, GRPC_STATUS_OK, NULL, pack_message(response, NULL));
}

void ps_rpc_call_fail(ps_rpc_call_t *call, pshard_status_t status, const char *fmt, ...)
{
    char msg[PSHARD_ERRLEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    grpc_status_code code = (grpc_status_code)ps_status_to_grpc(status);
    if (code == GRPC_STATUS_OK)
        code = GRPC_STATUS_UNKNOWN;
    PS_DEBUG(PS_SUB_RPC, "%s from %s failed: %s: %s", call->path, call->peer ? call->peer : "?",
             pshard_status_name(status), msg);
    call->final_pshard_status = (int)status; /* read once final_started, under the lock */
    rpc_call_finalize(call, code, msg, NULL);
}

/* CLOCK_REALTIME now + ns, for pthread_cond_timedwait. */
struct timespec rpc_realtime_in(int64_t ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec += (long)(ns % 1000000000LL);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

struct ps_rpc_packed {
    grpc_byte_buffer *bb;
    size_t bytes;
};

ps_rpc_packed_t *ps_rpc_pack(const ProtobufCMessage *msg)
{
    ps_rpc_packed_t *p = malloc(sizeof(*p));
    if (!p)
        return NULL;
    p->bb = pack_message(msg, &p->bytes);
    return p;
}

void ps_rpc_packed_free(ps_rpc_packed_t *p)
{
    if (!p)
        return;
    grpc_byte_buffer_destroy(p->bb);
    free(p);
}

/* The per-connection and per-server send budgets. A connection's calls together may have
 * max_conn_queue bytes of replies queued, the server's max_total_queue; a message that would
 * pass either is refused (RESOURCE_EXHAUSTED to the handler), unless nothing at all is queued
 * on that connection (so one large message still goes out). */
void rpc_call_acct_get(ps_rpc_call_t *c)
{
    ps_rpc_server_t *srv = c->srv;
    const char *peer = c->peer ? c->peer : "?";
    pthread_mutex_lock(&srv->acct_mu);
    peer_acct_t *a = srv->peers;
    while (a && strcmp(a->peer, peer) != 0)
        a = a->next;
    if (!a) {
        a = calloc(1, sizeof(*a));
        if (a && !(a->peer = strdup(peer))) {
            free(a);
            a = NULL;
        }
        if (a) {
            a->next = srv->peers;
            srv->peers = a;
        }
    }
    if (a)
        a->refs++;
    c->acct = a;
    pthread_mutex_unlock(&srv->acct_mu);
}

static void acct_put(ps_rpc_call_t *c)
{
    ps_rpc_server_t *srv = c->srv;
    if (!c->acct)
        return;
    pthread_mutex_lock(&srv->acct_mu);
    if (--c->acct->refs == 0) {
        for (peer_acct_t **pp = &srv->peers; *pp; pp = &(*pp)->next) {
            if (*pp == c->acct) {
                *pp = c->acct->next;
                break;
            }
        }
        free(c->acct->peer);
        free(c->acct);
    }
    c->acct = NULL;
    pthread_mutex_unlock(&srv->acct_mu);
}

static bool acct_take(ps_rpc_call_t *c, size_t bytes)
{
    ps_rpc_server_t *srv = c->srv;
    if (!c->acct)
        return false; /* out of memory when the call arrived: it may not queue anything */
    pthread_mutex_lock(&srv->acct_mu);
    bool ok = c->acct->bytes == 0 || (c->acct->bytes + bytes <= srv->max_conn_queue &&
                                      srv->queued_total + bytes <= srv->max_total_queue);
    if (ok) {
        c->acct->bytes += bytes;
        srv->queued_total += bytes;
        if (srv->queued_total > srv->queued_peak)
            srv->queued_peak = srv->queued_total;
    } else {
        PS_DEBUG(PS_SUB_RPC,
                 "%s: refused %zu more reply bytes to %s (%zu queued on its "
                 "connection, %zu in the server)",
                 c->path, bytes, c->acct->peer, c->acct->bytes, srv->queued_total);
    }
    pthread_mutex_unlock(&srv->acct_mu);
    return ok;
}

static void acct_release(ps_rpc_call_t *c, size_t bytes)
{
    ps_rpc_server_t *srv = c->srv;
    if (!c->acct || bytes == 0)
        return;
    pthread_mutex_lock(&srv->acct_mu);
    c->acct->bytes -= bytes;
    srv->queued_total -= bytes;
    pthread_mutex_unlock(&srv->acct_mu);
}

/* Room for a reader to go on: its connection and the server are at most half full. */
static bool acct_room(ps_rpc_call_t *c)
{
    ps_rpc_server_t *srv = c->srv;
    if (!c->acct)
        return true;
    pthread_mutex_lock(&srv->acct_mu);
    bool room =
        c->acct->bytes <= srv->max_conn_queue / 2 && srv->queued_total <= srv->max_total_queue / 2;
    pthread_mutex_unlock(&srv->acct_mu);
    return room;
}

/* Queues bb (owned) of `bytes` on the call, unless the call ended or its queue is over the
 * server's cap (the first message always fits), or its connection's or the server's send
 * budget would be passed. */
static pshard_status_t queue_send(ps_rpc_call_t *call, grpc_byte_buffer *bb, size_t bytes)
{
    send_item_t *it = malloc(sizeof(*it));
    if (!it) {
        grpc_byte_buffer_destroy(bb);
        return PSHARD_ERR_NO_MEMORY;
    }
    it->bb = bb;
    it->bytes = bytes;
    pthread_mutex_lock(&call->mu);
    pshard_status_t rc = PSHARD_OK;
    if (call->finishing || atomic_load(&call->cancelled))
        rc = PSHARD_ERR_CANCELLED;
    else if (call->queued_bytes > 0 && call->queued_bytes + bytes > call->srv->max_stream_queue)
        rc = PSHARD_ERR_RESOURCE_EXHAUSTED;
    else if (!acct_take(call, bytes))
        rc = PSHARD_ERR_RESOURCE_EXHAUSTED;
    if (rc != PSHARD_OK) {
        pthread_mutex_unlock(&call->mu);
        grpc_byte_buffer_destroy(it->bb);
        free(it);
        return rc;
    }
    call->queued_bytes += bytes;
    ps_queue_push(&call->sendq, &it->node);
    if (!call->send_in_flight)
        start_next_send_locked(call);
    pthread_mutex_unlock(&call->mu);
    return PSHARD_OK;
}

pshard_status_t ps_rpc_call_send(ps_rpc_call_t *call, const ProtobufCMessage *msg)
{
    if (atomic_load(&call->cancelled))
        return PSHARD_ERR_CANCELLED;
    size_t bytes;
    grpc_byte_buffer *bb = pack_message(msg, &bytes);
    return queue_send(call, bb, bytes);
}

pshard_status_t ps_rpc_call_send_packed(ps_rpc_call_t *call, const ps_rpc_packed_t *msg)
{
    if (atomic_load(&call->cancelled))
        return PSHARD_ERR_CANCELLED;
    grpc_byte_buffer *bb = grpc_byte_buffer_copy(msg->bb); /* shares the slices */
    return bb ? queue_send(call, bb, msg->bytes) : PSHARD_ERR_NO_MEMORY;
}

pshard_status_t ps_rpc_call_wait_writable(ps_rpc_call_t *call, int64_t deadline_ns)
{
    pthread_mutex_lock(&call->mu);
    pshard_status_t rc = PSHARD_OK;
    for (;;) {
        if (call->finishing || atomic_load(&call->cancelled)) {
            rc = PSHARD_ERR_CANCELLED;
            break;
        }
        if (call->queued_bytes <= call->srv->max_stream_queue / 2 && acct_room(call))
            break;
        int64_t now = ps_now_ns();
        if (now >= deadline_ns) {
            rc = PSHARD_ERR_TIMEOUT;
            break;
        }
        /* The wait wakes on every completed send; a slice keeps the deadline honest. */
        struct timespec ts =
            rpc_realtime_in(deadline_ns - now < 200000000LL ? deadline_ns - now : 200000000LL);
        pthread_cond_timedwait(&call->writable, &call->mu, &ts);
    }
    pthread_mutex_unlock(&call->mu);
    return rc;
}

void ps_rpc_call_finish(ps_rpc_call_t *call)
{
    rpc_call_finalize(call, GRPC_STATUS_OK, NULL, NULL);
}

void ps_rpc_call_on_cancel(ps_rpc_call_t *call, void (*fn)(void *arg, ps_rpc_call_t *call),
                           void *arg)
{
    pthread_mutex_lock(&call->mu);
    call->cancel_fn = fn;
    call->cancel_arg = arg;
    bool already = atomic_load(&call->cancelled) && !call->finishing;
    pthread_mutex_unlock(&call->mu);
    /* The client may have gone before the handler registered: tell it now. */
    if (already && fn)
        fn(arg, call);
}

bool ps_rpc_call_is_cancelled(const ps_rpc_call_t *call)
{
    return atomic_load(&call->cancelled);
}

int64_t ps_rpc_call_deadline_ns(const ps_rpc_call_t *call)
{
    return call->deadline_ns;
}

const char *ps_rpc_call_header(const ps_rpc_call_t *call, const char *key, size_t *len)
{
    for (size_t i = 0; i < call->md.count; i++) {
        if (grpc_slice_str_cmp(call->md.metadata[i].key, key) == 0) {
            *len = GRPC_SLICE_LENGTH(call->md.metadata[i].value);
            return (const char *)GRPC_SLICE_START_PTR(call->md.metadata[i].value);
        }
    }
    *len = 0;
    return NULL;
}

const char *ps_rpc_call_method(const ps_rpc_call_t *call)
{
    return call->path;
}

const char *ps_rpc_call_peer(const ps_rpc_call_t *call)
{
    return call->peer ? call->peer : "unknown";
}

const char *ps_rpc_call_peer_identity(const ps_rpc_call_t *call)
{
    return call->identity;
}

/* --------------------------------------------------------------------------------------- */
/* Receiving, dispatch and the batches' completions                                         */

void rpc_call_start_recv_locked(ps_rpc_call_t *c)
{
    grpc_op ops[2];
    size_t n = 0;
    memset(ops, 0, sizeof(ops));
    if (!c->initial_md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
        c->initial_md_sent = true;
    }
    ops[n].op = GRPC_OP_RECV_MESSAGE;
    ops[n].data.recv_message.recv_message = &c->recv_bb;
    n++;
    rpc_call_start_batch_locked(c, ops, n, &c->t_recv);
}

void rpc_call_run_handler(ps_rpc_call_t *c, ProtobufCMessage *req)
{
    const ps_rpc_method_t *m = &c->method->m;
    bool bidi = (m->flags & PS_RPC_BIDI) != 0;
    if (bidi) {
        /* The runtime keeps ownership of a bidi call; hold a reference across the handler. */
        pthread_mutex_lock(&c->mu);
        c->refs++;
        pthread_mutex_unlock(&c->mu);
    }
    m->handler(c, req, m->ctx);
    protobuf_c_message_free_unpacked(req, NULL);
    if (bidi) {
        /* A client that does not read its replies must not make the server queue them
         * without bound: the next request is read only once every reply is sent. */
        pthread_mutex_lock(&c->mu);
        if (!c->finishing && !atomic_load(&c->cancelled)) {
            if (c->send_in_flight || !ps_queue_empty(&c->sendq))
                c->recv_paused = true;
            else
                rpc_call_start_recv_locked(c);
        }
        pthread_mutex_unlock(&c->mu);
        rpc_call_unref(c);
    }
}

static void dispatch(ps_rpc_call_t *c, ProtobufCMessage *req)
{
    atomic_fetch_add(&c->method->calls, 1);
    if (c->method->m.flags & (PS_RPC_INLINE | PS_RPC_BIDI)) {
        rpc_call_run_handler(c, req);
        return;
    }
    ps_rpc_server_t *srv = c->srv;
    c->pending_req = req;
    c->queued_ns = ps_now_ns();
    ps_workq_push(&srv->work, &c->work_node);
}

/* A received request message (bb; NULL: the client half-closed without one): unpacked and
 * dispatched, or the call failed saying why. Takes bb. */
void rpc_call_take_request(ps_rpc_call_t *c, grpc_byte_buffer *bb)
{
    bool bidi = (c->method->m.flags & PS_RPC_BIDI) != 0;
    if (!bb) {
        if (bidi)
            rpc_call_finalize(c, GRPC_STATUS_OK, NULL, NULL);
        else
            rpc_call_finalize(c, GRPC_STATUS_INVALID_ARGUMENT, "the client sent no request message",
                              NULL);
    } else {
        grpc_byte_buffer_reader reader;
        ProtobufCMessage *req = NULL;
        const char *nul_in = NULL;
        if (grpc_byte_buffer_reader_init(&reader, bb)) {
            grpc_slice s = grpc_byte_buffer_reader_readall(&reader);
            grpc_byte_buffer_reader_destroy(&reader);
            const char *nul_field = NULL;
            if (!ps_pb_strings_nul_free(c->method->m.request_desc, GRPC_SLICE_START_PTR(s),
                                        GRPC_SLICE_LENGTH(s), &nul_field))
                nul_in = nul_field;
            else
                req = protobuf_c_message_unpack(c->method->m.request_desc, NULL,
                                                GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
            grpc_slice_unref(s);
        }
        grpc_byte_buffer_destroy(bb);
        if (nul_in) {
            /* C strings end at a NUL: "a\0x" and "a\0y" would be one key, name or token. */
            char msg[PSHARD_ERRLEN];
            snprintf(msg, sizeof(msg), "request to %s: field '%s' holds a NUL byte", c->path,
                     nul_in);
            atomic_fetch_add(&c->method->calls, 1);
            rpc_call_finalize(c, GRPC_STATUS_INVALID_ARGUMENT, msg, NULL);
        } else if (!req) {
            char msg[PSHARD_ERRLEN];
            snprintf(msg, sizeof(msg), "request to %s is not a valid %s message", c->path,
                     c->method->m.request_desc->name);
            atomic_fetch_add(&c->method->calls, 1);
            rpc_call_finalize(c, GRPC_STATUS_INVALID_ARGUMENT, msg, NULL);
        } else {
            dispatch(c, req);
        }
    }
}

void rpc_call_on_recv(ps_rpc_call_t *c, bool success)
{
    grpc_byte_buffer *bb = c->recv_bb;
    c->recv_bb = NULL;
    if (!success) {
        atomic_store(&c->cancelled, true);
        if (bb)
            grpc_byte_buffer_destroy(bb);
        rpc_call_finalize(c, GRPC_STATUS_CANCELLED, "call cancelled", NULL);
    } else {
        rpc_call_take_request(c, bb);
    }
    rpc_call_unref(c); /* the receive batch's reference */
}

void rpc_call_on_close(ps_rpc_call_t *c)
{
    void (*fn)(void *, ps_rpc_call_t *) = NULL;
    void *arg = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->close_cancelled) {
        atomic_store(&c->cancelled, true);
        pthread_cond_broadcast(&c->writable);
        if (!c->finishing) {
            fn = c->cancel_fn;
            arg = c->cancel_arg;
            c->cancel_fn = NULL;
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (fn)
        fn(arg, c);
    rpc_call_unref(c);
}

void rpc_call_on_send(ps_rpc_call_t *c, bool success)
{
    pthread_mutex_lock(&c->mu);
    if (c->send_bb) {
        grpc_byte_buffer_destroy(c->send_bb);
        c->send_bb = NULL;
    }
    c->queued_bytes -= c->send_bytes;
    acct_release(c, c->send_bytes);
    c->send_bytes = 0;
    c->send_in_flight = false;
    if (!success)
        atomic_store(&c->cancelled, true);
    pthread_cond_broadcast(&c->writable);
    bool end_paused = false;
    if (!ps_queue_empty(&c->sendq) && !atomic_load(&c->cancelled))
        start_next_send_locked(c);
    else if (c->finishing)
        start_final_locked(c);
    else if (c->recv_paused) {
        /* Every reply is out: read the next request; or the client went away while this
         * bidi call waited for that, and no receive is pending to notice: end it here. */
        c->recv_paused = false;
        if (atomic_load(&c->cancelled))
            end_paused = true;
        else
            rpc_call_start_recv_locked(c);
    }
    pthread_mutex_unlock(&c->mu);
    if (end_paused)
        rpc_call_finalize(c, GRPC_STATUS_CANCELLED, "call cancelled", NULL);
    rpc_call_unref(c);
}
