/* The gRPC server runtime: one completion queue drained by its own threads, a method table,
 * handlers run inline (if they promise not to block) or on a worker pool, and every in-flight
 * call kept as one refcounted struct whose memory is released only after all of its batches
 * have completed. Shutdown follows gRPC's order: shutdown_and_notify, cancel all calls, drain,
 * shut the queue down, drain to GRPC_QUEUE_SHUTDOWN, destroy. */
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "pshard/log.h"
#include "pshard/queue.h"
#include "pshard/rpc.h"
#include "pshard/util.h"
#include "rpc_internal.h"

#define REQUESTS_OUTSTANDING 16
/* Requests kept outstanding per registered method (see method_entry_t.registered). */
#define REGISTERED_OUTSTANDING 2

typedef enum { TAG_NEW, TAG_RECV, TAG_SEND, TAG_CLOSE, TAG_FINAL, TAG_SHUTDOWN } tag_kind_t;

typedef struct {
    tag_kind_t kind;
    ps_rpc_call_t *call;
} rpc_tag_t;

typedef struct {
    ps_rpc_method_t m;
    /* Every method but a bidi one is registered with the core before the server starts, with
     * its request message read up front: its calls come matched to it, with their one request
     * already in hand, so none takes the generic path's method lookup and receive batch (a
     * heartbeat costs fewer instructions). Bidi methods and unknown paths take that path. */
    void *registered;
    atomic_uint_least64_t calls;
    atomic_uint_least64_t errors;
} method_entry_t;

/* Reply bytes queued on the calls of one connection (its peer address names it). */
typedef struct peer_acct {
    struct peer_acct *next;
    char *peer;
    size_t bytes;
    int refs; /* calls on it */
} peer_acct_t;

typedef struct send_item {
    ps_qnode_t node;
    grpc_byte_buffer *bb;
    size_t bytes;
} send_item_t;

struct ps_rpc_call {
    ps_rpc_server_t *srv;
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array md;
    method_entry_t *method;
    method_entry_t *registered; /* a registered call's method, known before it arrives */
    gpr_timespec reg_deadline;  /* ... and its deadline */
    rpc_tag_t t_new, t_recv, t_send, t_close, t_final;

    pthread_mutex_t mu;
    int refs; /* owner (until finalized) + one per outstanding batch */
    bool initial_md_sent;
    bool finishing;     /* final status requested */
    bool final_started; /* final batch issued */
    bool send_in_flight;
    atomic_bool cancelled;     /* the client went away or a batch failed */
    ps_queue_t sendq;          /* send_item_t waiting for the one send in flight */
    size_t queued_bytes;       /* queued and in flight: bounded by the server's stream cap */
    size_t send_bytes;         /* of send_bb */
    peer_acct_t *acct;         /* its connection's share of the server's send budget */
    bool recv_paused;          /* bidi: the next request is read once every reply is sent */
    pthread_cond_t writable;   /* queued_bytes fell, or the call ended */
    grpc_byte_buffer *send_bb; /* the message being written */
    grpc_byte_buffer *final_bb;
    grpc_status_code final_code;
    grpc_slice final_details;
    bool final_details_set;
    /* The exact pshard_status_t of a failure, in trailing metadata "pshard-status", since
     * several pshard codes share one gRPC code (JOINED and ABORTED, PEER_LOST and
     * UNAVAILABLE). */
    int final_pshard_status;
    grpc_metadata final_md;
    bool final_md_set;

    grpc_byte_buffer *recv_bb;
    int close_cancelled;
    void (*cancel_fn)(void *arg, ps_rpc_call_t *call);
    void *cancel_arg;

    char *peer;
    char *identity;
    char *path;
    int64_t deadline_ns;

    struct ps_rpc_call *live_prev, *live_next;
    ps_qnode_t work_node;          /* in the server's work queue */
    ProtobufCMessage *pending_req; /* request waiting for a worker */
    int64_t queued_ns;             /* when it was queued for a worker (ps_now_ns) */
};

struct ps_rpc_server {
    grpc_server *server;
    grpc_completion_queue *cq;
    int port;
    char *token;
    size_t token_len;
    int64_t max_message_bytes;
    size_t max_stream_queue; /* bytes one call may have queued for sending */
    size_t max_conn_queue;   /* ... all calls of one connection together */
    size_t max_total_queue;  /* ... all calls of the server together */
    pthread_mutex_t acct_mu; /* peers and queued_total; taken inside a call's mu */
    peer_acct_t *peers;
    size_t queued_total;
    size_t queued_peak; /* the most queued_total has been */

    method_entry_t *methods;
    size_t nmethods, cap_methods;

    pthread_t *cq_threads;
    int n_cq_threads;

    pthread_t *workers;
    int n_workers;
    ps_workq_t work;      /* calls waiting for a worker */
    atomic_int work_busy; /* workers running a handler */

    pthread_mutex_t mu;
    pthread_cond_t cv;
    ps_rpc_call_t *live; /* every call struct not yet freed, pending requests included */
    size_t nlive;
    bool started;
    bool shutting_down;
    bool shutdown_notified; /* TAG_SHUTDOWN dequeued */
    bool shutdown_complete;
    rpc_tag_t shutdown_tag;

    void (*shutdown_hook)(void *arg);
    void *shutdown_hook_arg;

    ps_health_t *health;
    ps_reflection_t *reflection;
    ps_rpc_method_t builtin[4];
};

static void acct_get(ps_rpc_call_t *c);
static void acct_put(ps_rpc_call_t *c);
static bool acct_take(ps_rpc_call_t *c, size_t bytes);
static void acct_release(ps_rpc_call_t *c, size_t bytes);
static bool acct_room(ps_rpc_call_t *c);

static void start_final_locked(ps_rpc_call_t *c);
static void start_next_send_locked(ps_rpc_call_t *c);
static void request_new_call(ps_rpc_server_t *srv);
static void request_registered_call(ps_rpc_server_t *srv, method_entry_t *e);
static void take_request(ps_rpc_call_t *c, grpc_byte_buffer *bb);

/* --------------------------------------------------------------------------------------- */
/* Call lifetime                                                                            */

static ps_rpc_call_t *call_alloc(ps_rpc_server_t *srv)
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

static void call_unref(ps_rpc_call_t *c)
{
    pthread_mutex_lock(&c->mu);
    int left = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (left == 0)
        call_free(c);
}

static void start_batch_locked(ps_rpc_call_t *c, const grpc_op *ops, size_t nops, rpc_tag_t *tag)
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
static void finalize(ps_rpc_call_t *c, grpc_status_code code, const char *msg,
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
    start_batch_locked(c, ops, n, &c->t_final);
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
    start_batch_locked(c, ops, n, &c->t_send);
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
    finalize(call, GRPC_STATUS_OK, NULL, pack_message(response, NULL));
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
    finalize(call, code, msg, NULL);
}

/* CLOCK_REALTIME now + ns, for pthread_cond_timedwait. */
static struct timespec realtime_in(int64_t ns)
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
static void acct_get(ps_rpc_call_t *c)
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
            realtime_in(deadline_ns - now < 200000000LL ? deadline_ns - now : 200000000LL);
        pthread_cond_timedwait(&call->writable, &call->mu, &ts);
    }
    pthread_mutex_unlock(&call->mu);
    return rc;
}

void ps_rpc_call_finish(ps_rpc_call_t *call)
{
    finalize(call, GRPC_STATUS_OK, NULL, NULL);
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
/* Dispatch                                                                                 */

static void start_recv_locked(ps_rpc_call_t *c)
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
    start_batch_locked(c, ops, n, &c->t_recv);
}

static void run_handler(ps_rpc_call_t *c, ProtobufCMessage *req)
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
                start_recv_locked(c);
        }
        pthread_mutex_unlock(&c->mu);
        call_unref(c);
    }
}

static void *worker_main(void *arg)
{
    ps_rpc_server_t *srv = arg;
    ps_qnode_t *n;
    while ((n = ps_workq_take(&srv->work)) != NULL) {
        ps_rpc_call_t *c = PS_CONTAINER_OF(n, ps_rpc_call_t, work_node);
        atomic_fetch_add(&srv->work_busy, 1);
        ProtobufCMessage *req = c->pending_req;
        c->pending_req = NULL;
        run_handler(c, req);
        atomic_fetch_sub(&srv->work_busy, 1);
    }
    return NULL;
}

static void dispatch(ps_rpc_call_t *c, ProtobufCMessage *req)
{
    atomic_fetch_add(&c->method->calls, 1);
    if (c->method->m.flags & (PS_RPC_INLINE | PS_RPC_BIDI)) {
        run_handler(c, req);
        return;
    }
    ps_rpc_server_t *srv = c->srv;
    c->pending_req = req;
    c->queued_ns = ps_now_ns();
    ps_workq_push(&srv->work, &c->work_node);
}

static method_entry_t *find_method(ps_rpc_server_t *srv, const grpc_slice path)
{
    for (size_t i = 0; i < srv->nmethods; i++) {
        if (grpc_slice_str_cmp(path, srv->methods[i].m.path) == 0)
            return &srv->methods[i];
    }
    return NULL;
}

/* Checks "authorization: Bearer TOKEN" against the cluster token in constant time. */
static bool token_ok(ps_rpc_server_t *srv, const grpc_metadata_array *md)
{
    static const char prefix[] = "Bearer ";
    for (size_t i = 0; i < md->count; i++) {
        if (grpc_slice_str_cmp(md->metadata[i].key, "authorization") != 0)
            continue;
        const uint8_t *v = GRPC_SLICE_START_PTR(md->metadata[i].value);
        size_t n = GRPC_SLICE_LENGTH(md->metadata[i].value);
        if (n < sizeof(prefix) - 1 || memcmp(v, prefix, sizeof(prefix) - 1) != 0)
            return false;
        return ps_const_time_eq(v + sizeof(prefix) - 1, n - (sizeof(prefix) - 1), srv->token,
                                srv->token_len);
    }
    return false;
}

static void read_identity(ps_rpc_call_t *c)
{
    grpc_auth_context *ac = grpc_call_auth_context(c->call);
    if (!ac)
        return;
    if (grpc_auth_context_peer_is_authenticated(ac)) {
        grpc_auth_property_iterator it = grpc_auth_context_peer_identity(ac);
        const grpc_auth_property *p = grpc_auth_property_iterator_next(&it);
        if (p && p->value)
            c->identity = strndup(p->value, p->value_length);
    }
    grpc_auth_context_release(ac);
}

static void on_new(ps_rpc_call_t *c, bool success)
{
    ps_rpc_server_t *srv = c->srv;
    if (!success) {
        /* Shutdown: the pending request will never carry a call. */
        call_unref(c);
        return;
    }
    pthread_mutex_lock(&srv->mu);
    bool shutting = srv->shutting_down;
    pthread_mutex_unlock(&srv->mu);
    method_entry_t *reg = c->registered;
    if (!shutting) {
        if (reg)
            request_registered_call(srv, reg);
        else
            request_new_call(srv);
    }

    c->path = reg ? strdup(reg->m.path)
                  : strndup((const char *)GRPC_SLICE_START_PTR(c->details.method),
                            GRPC_SLICE_LENGTH(c->details.method));
    c->peer = grpc_call_get_peer(c->call);
    acct_get(c);
    gpr_timespec deadline = reg ? c->reg_deadline : c->details.deadline;
    if (gpr_time_cmp(deadline, gpr_inf_future(deadline.clock_type)) != 0) {
        gpr_timespec now = gpr_now(deadline.clock_type);
        gpr_timespec left = gpr_time_sub(deadline, now);
        int64_t left_ns = (int64_t)left.tv_sec * 1000000000 + left.tv_nsec;
        c->deadline_ns = ps_now_ns() + left_ns;
    }
    read_identity(c);

    pthread_mutex_lock(&c->mu);
    grpc_op close_op;
    memset(&close_op, 0, sizeof(close_op));
    close_op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    close_op.data.recv_close_on_server.cancelled = &c->close_cancelled;
    start_batch_locked(c, &close_op, 1, &c->t_close);
    pthread_mutex_unlock(&c->mu);

    c->method = reg ? reg : find_method(srv, c->details.method);
    if (!c->method) {
        char msg[PSHARD_ERRLEN];
        snprintf(msg, sizeof(msg), "unknown method %s", c->path ? c->path : "?");
        PS_DEBUG(PS_SUB_RPC, "%s (from %s)", msg, c->peer ? c->peer : "?");
        finalize(c, GRPC_STATUS_UNIMPLEMENTED, msg, NULL);
        return;
    }
    if (srv->token && !(c->method->m.flags & PS_RPC_OPEN) && !token_ok(srv, &c->md)) {
        atomic_fetch_add(&c->method->calls, 1);
        PS_INFO(PS_SUB_RPC, "%s from %s refused: missing or wrong cluster token", c->path,
                c->peer ? c->peer : "?");
        finalize(c, GRPC_STATUS_UNAUTHENTICATED,
                 "missing or wrong cluster token (send 'authorization: Bearer <token>')", NULL);
        return;
    }
    if (reg) {
        /* The request came with the call. A unary reply carries the headers with the status;
         * a stream sends them now, as the generic path does with its receive. */
        grpc_byte_buffer *bb = c->recv_bb;
        c->recv_bb = NULL;
        if (reg->m.flags & PS_RPC_STREAM) {
            pthread_mutex_lock(&c->mu);
            grpc_op op;
            memset(&op, 0, sizeof(op));
            op.op = GRPC_OP_SEND_INITIAL_METADATA;
            c->initial_md_sent = true;
            start_batch_locked(c, &op, 1, &c->t_final);
            pthread_mutex_unlock(&c->mu);
        }
        take_request(c, bb);
        return;
    }
    pthread_mutex_lock(&c->mu);
    start_recv_locked(c);
    pthread_mutex_unlock(&c->mu);
}

/* A received request message (bb; NULL: the client half-closed without one): unpacked and
 * dispatched, or the call failed saying why. Takes bb. */
static void take_request(ps_rpc_call_t *c, grpc_byte_buffer *bb)
{
    bool bidi = (c->method->m.flags & PS_RPC_BIDI) != 0;
    if (!bb) {
        if (bidi)
            finalize(c, GRPC_STATUS_OK, NULL, NULL);
        else
            finalize(c, GRPC_STATUS_INVALID_ARGUMENT, "the client sent no request message", NULL);
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
            finalize(c, GRPC_STATUS_INVALID_ARGUMENT, msg, NULL);
        } else if (!req) {
            char msg[PSHARD_ERRLEN];
            snprintf(msg, sizeof(msg), "request to %s is not a valid %s message", c->path,
                     c->method->m.request_desc->name);
            atomic_fetch_add(&c->method->calls, 1);
            finalize(c, GRPC_STATUS_INVALID_ARGUMENT, msg, NULL);
        } else {
            dispatch(c, req);
        }
    }
}

static void on_recv(ps_rpc_call_t *c, bool success)
{
    grpc_byte_buffer *bb = c->recv_bb;
    c->recv_bb = NULL;
    if (!success) {
        atomic_store(&c->cancelled, true);
        if (bb)
            grpc_byte_buffer_destroy(bb);
        finalize(c, GRPC_STATUS_CANCELLED, "call cancelled", NULL);
    } else {
        take_request(c, bb);
    }
    call_unref(c); /* the receive batch's reference */
}

static void on_close(ps_rpc_call_t *c)
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
    call_unref(c);
}

static void on_send(ps_rpc_call_t *c, bool success)
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
            start_recv_locked(c);
    }
    pthread_mutex_unlock(&c->mu);
    if (end_paused)
        finalize(c, GRPC_STATUS_CANCELLED, "call cancelled", NULL);
    call_unref(c);
}

static void *cq_thread_main(void *arg)
{
    ps_rpc_server_t *srv = arg;
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            return NULL;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        rpc_tag_t *tag = ev.tag;
        switch (tag->kind) {
        case TAG_NEW:
            on_new(tag->call, ev.success != 0);
            break;
        case TAG_RECV:
            on_recv(tag->call, ev.success != 0);
            break;
        case TAG_SEND:
            on_send(tag->call, ev.success != 0);
            break;
        case TAG_CLOSE:
            on_close(tag->call);
            break;
        case TAG_FINAL:
            call_unref(tag->call);
            break;
        case TAG_SHUTDOWN:
            pthread_mutex_lock(&srv->mu);
            srv->shutdown_notified = true;
            pthread_cond_broadcast(&srv->cv);
            pthread_mutex_unlock(&srv->mu);
            break;
        }
    }
}

static void request_new_call(ps_rpc_server_t *srv)
{
    ps_rpc_call_t *c = call_alloc(srv);
    if (!c) {
        PS_ERROR(PS_SUB_RPC, "out of memory accepting calls");
        return;
    }
    grpc_call_error e = grpc_server_request_call(srv->server, &c->call, &c->details, &c->md,
                                                 srv->cq, srv->cq, &c->t_new);
    if (e != GRPC_CALL_OK) {
        PS_ERROR(PS_SUB_RPC, "grpc_server_request_call failed: %d", (int)e);
        call_unref(c);
    }
}

static void request_registered_call(ps_rpc_server_t *srv, method_entry_t *e)
{
    ps_rpc_call_t *c = call_alloc(srv);
    if (!c) {
        PS_ERROR(PS_SUB_RPC, "out of memory accepting calls");
        return;
    }
    c->registered = e;
    grpc_call_error err =
        grpc_server_request_registered_call(srv->server, e->registered, &c->call, &c->reg_deadline,
                                            &c->md, &c->recv_bb, srv->cq, srv->cq, &c->t_new);
    if (err != GRPC_CALL_OK) {
        PS_ERROR(PS_SUB_RPC, "grpc_server_request_registered_call(%s) failed: %d", e->m.path,
                 (int)err);
        call_unref(c);
    }
}

/* --------------------------------------------------------------------------------------- */
/* Server lifecycle                                                                         */

static grpc_server_credentials *server_credentials(const ps_rpc_server_config_t *cfg, char *err,
                                                   size_t errlen)
{
    if (!cfg->tls_cert_file && !cfg->tls_key_file && !cfg->tls_client_ca_file)
        return grpc_insecure_server_credentials_create();
    if (!cfg->tls_cert_file || !cfg->tls_key_file) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "TLS needs both a certificate (--tls-cert) and a key (--tls-key)");
        return NULL;
    }
    char *cert = ps_read_file(cfg->tls_cert_file, false, 1 << 20, NULL, err, errlen);
    char *key = cert ? ps_read_file(cfg->tls_key_file, false, 1 << 20, NULL, err, errlen) : NULL;
    char *ca = NULL;
    if (key && cfg->tls_client_ca_file)
        ca = ps_read_file(cfg->tls_client_ca_file, false, 1 << 20, NULL, err, errlen);
    grpc_server_credentials *creds = NULL;
    if (cert && key && (ca || !cfg->tls_client_ca_file)) {
        grpc_ssl_pem_key_cert_pair pair = {key, cert};
        creds = grpc_ssl_server_credentials_create_ex(
            ca, &pair, 1,
            ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
               : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
            NULL);
        if (!creds)
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                    "could not build TLS credentials from %s and %s", cfg->tls_cert_file,
                    cfg->tls_key_file);
    }
    free(cert);
    free(key);
    free(ca);
    return creds;
}

static pshard_status_t add_method(ps_rpc_server_t *srv, const ps_rpc_method_t *m)
{
    for (size_t i = 0; i < srv->nmethods; i++) {
        if (strcmp(srv->methods[i].m.path, m->path) == 0)
            return PSHARD_ERR_INVALID_ARGUMENT;
    }
    if (srv->nmethods == srv->cap_methods) {
        size_t cap = srv->cap_methods ? srv->cap_methods * 2 : 16;
        method_entry_t *p = realloc(srv->methods, cap * sizeof(*p));
        if (!p)
            return PSHARD_ERR_NO_MEMORY;
        srv->methods = p;
        srv->cap_methods = cap;
    }
    method_entry_t *e = &srv->methods[srv->nmethods++];
    e->m = *m;
    e->registered = NULL; /* set at start, for the methods that are registered */
    atomic_init(&e->calls, 0);
    atomic_init(&e->errors, 0);
    return PSHARD_OK;
}

ps_rpc_server_t *ps_rpc_server_create(const ps_rpc_server_config_t *cfg, char *err, size_t errlen)
{
    ps_rpc_server_t *srv = calloc(1, sizeof(*srv));
    if (!srv) {
        ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        return NULL;
    }
    grpc_init();
    pthread_mutex_init(&srv->mu, NULL);
    pthread_cond_init(&srv->cv, NULL);
    ps_workq_init(&srv->work);
    pthread_mutex_init(&srv->acct_mu, NULL);
    srv->shutdown_tag = (rpc_tag_t){TAG_SHUTDOWN, NULL};
    srv->max_message_bytes = cfg->max_message_bytes > 0 ? cfg->max_message_bytes : (4 << 20);
    srv->max_stream_queue =
        cfg->max_stream_queue_bytes > 0 ? (size_t)cfg->max_stream_queue_bytes : (8u << 20);
    srv->max_conn_queue = cfg->max_conn_queue_bytes > 0 ? (size_t)cfg->max_conn_queue_bytes
                                                        : 4 * srv->max_stream_queue;
    srv->max_total_queue = cfg->max_total_queue_bytes > 0 ? (size_t)cfg->max_total_queue_bytes
                                                          : 32 * srv->max_stream_queue;
    srv->n_workers = cfg->worker_threads > 0 ? cfg->worker_threads : 4;
    srv->n_cq_threads = cfg->cq_threads > 0 ? cfg->cq_threads : 1;
    if (cfg->token && *cfg->token) {
        const char *why = ps_token_problem(cfg->token, strlen(cfg->token));
        if (why) {
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "the cluster token %s; %s", why,
                    PS_TOKEN_HOWTO);
            goto fail;
        }
        srv->token = strdup(cfg->token);
        srv->token_len = strlen(cfg->token);
    }

    grpc_arg args[4];
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = (int)srv->max_message_bytes;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[1].value.integer = -1;
    /* Let clients keep idle connections alive with pings (members heartbeat for hours). */
    args[2].type = GRPC_ARG_INTEGER;
    args[2].key = GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS;
    args[2].value.integer = 1000;
    args[3].type = GRPC_ARG_INTEGER;
    args[3].key = GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS;
    args[3].value.integer = 1;
    grpc_channel_args chargs = {PS_ARRAY_LEN(args), args};
    srv->server = grpc_server_create(&chargs, NULL);
    srv->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(srv->server, srv->cq, NULL);

    grpc_server_credentials *creds = server_credentials(cfg, err, errlen);
    if (!creds)
        goto fail;
    srv->port = grpc_server_add_http2_port(srv->server, cfg->listen, creds);
    grpc_server_credentials_release(creds);
    if (srv->port <= 0) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "cannot listen on '%s' (bad address, or the port is in use)", cfg->listen);
        goto fail;
    }

    srv->health = ps_health_create();
    srv->reflection = ps_reflection_create(ps_descriptor_set, ps_descriptor_set_len, err, errlen);
    if (!srv->health || !srv->reflection)
        goto fail;
    ps_health_methods(srv->health, &srv->builtin[0]);
    ps_reflection_methods(srv->reflection, &srv->builtin[2]);
    for (size_t i = 0; i < 4; i++) {
        if (add_method(srv, &srv->builtin[i]) != PSHARD_OK) {
            ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
            goto fail;
        }
    }
    return srv;

fail:
    ps_rpc_server_destroy(srv);
    return NULL;
}

pshard_status_t ps_rpc_server_add_methods(ps_rpc_server_t *srv, const ps_rpc_method_t *methods,
                                          size_t n)
{
    if (srv->started)
        return PSHARD_ERR_INVALID_ARGUMENT;
    for (size_t i = 0; i < n; i++)
        PS_CHECK(add_method(srv, &methods[i]));
    return PSHARD_OK;
}

void ps_rpc_server_set_shutdown_hook(ps_rpc_server_t *srv, void (*fn)(void *arg), void *arg)
{
    srv->shutdown_hook = fn;
    srv->shutdown_hook_arg = arg;
}

/* Every distinct "pkg.Service" among the method paths goes to reflection's list_services. */
static void register_service_names(ps_rpc_server_t *srv)
{
    for (size_t i = 0; i < srv->nmethods; i++) {
        const char *p = srv->methods[i].m.path + 1;
        const char *slash = strchr(p, '/');
        if (!slash)
            continue;
        size_t len = (size_t)(slash - p);
        bool seen = false;
        for (size_t j = 0; j < i && !seen; j++) {
            const char *q = srv->methods[j].m.path + 1;
            seen = strncmp(p, q, len) == 0 && q[len] == '/';
        }
        if (!seen) {
            char name[256];
            snprintf(name, sizeof(name), "%.*s", (int)len, p);
            ps_reflection_add_service(srv->reflection, name);
        }
    }
}

int ps_rpc_server_start(ps_rpc_server_t *srv)
{
    if (srv->started)
        return srv->port;
    register_service_names(srv);
    for (size_t i = 0; i < srv->nmethods; i++) {
        method_entry_t *e = &srv->methods[i];
        if (!(e->m.flags & PS_RPC_BIDI))
            e->registered = grpc_server_register_method(
                srv->server, e->m.path, NULL, GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    }
    grpc_server_start(srv->server);
    srv->started = true;
    srv->cq_threads = calloc((size_t)srv->n_cq_threads, sizeof(pthread_t));
    srv->workers = calloc((size_t)srv->n_workers, sizeof(pthread_t));
    if (!srv->cq_threads || !srv->workers)
        return -1;
    for (int i = 0; i < srv->n_cq_threads; i++)
        pthread_create(&srv->cq_threads[i], NULL, cq_thread_main, srv);
    for (int i = 0; i < srv->n_workers; i++)
        pthread_create(&srv->workers[i], NULL, worker_main, srv);
    for (int i = 0; i < REQUESTS_OUTSTANDING; i++)
        request_new_call(srv);
    for (size_t i = 0; i < srv->nmethods; i++) {
        for (int k = 0; k < REGISTERED_OUTSTANDING && srv->methods[i].registered; k++)
            request_registered_call(srv, &srv->methods[i]);
    }
    ps_health_set(srv->health, "", 1);
    return srv->port;
}

int ps_rpc_server_port(const ps_rpc_server_t *srv)
{
    return srv->port;
}

void ps_rpc_server_set_health(ps_rpc_server_t *srv, const char *service, int status)
{
    ps_health_set(srv->health, service, status);
}

void ps_rpc_server_counters(ps_rpc_server_t *srv,
                            void (*fn)(void *arg, const char *path, uint64_t calls,
                                       uint64_t errors),
                            void *arg)
{
    for (size_t i = 0; i < srv->nmethods; i++)
        fn(arg, srv->methods[i].m.path, atomic_load(&srv->methods[i].calls),
           atomic_load(&srv->methods[i].errors));
}

void ps_rpc_server_load(ps_rpc_server_t *srv, ps_rpc_load_t *out)
{
    int64_t now = ps_now_ns();
    out->workers = srv->n_workers;
    out->busy = atomic_load(&srv->work_busy);
    pthread_mutex_lock(&srv->work.mu);
    out->queued = srv->work.q.len;
    const ps_rpc_call_t *oldest = PS_QUEUE_PEEK(&srv->work.q, ps_rpc_call_t, work_node);
    out->oldest_wait_ns = oldest ? now - oldest->queued_ns : 0;
    pthread_mutex_unlock(&srv->work.mu);
    pthread_mutex_lock(&srv->acct_mu);
    out->send_queued_bytes = srv->queued_total;
    out->send_queued_peak_bytes = srv->queued_peak;
    pthread_mutex_unlock(&srv->acct_mu);
}

void ps_rpc_server_shutdown(ps_rpc_server_t *srv)
{
    pthread_mutex_lock(&srv->mu);
    if (!srv->started || srv->shutting_down) {
        while (srv->started && !srv->shutdown_complete)
            pthread_cond_wait(&srv->cv, &srv->mu);
        pthread_mutex_unlock(&srv->mu);
        return;
    }
    srv->shutting_down = true;
    pthread_mutex_unlock(&srv->mu);

    ps_health_shutdown(srv->health);
    grpc_server_shutdown_and_notify(srv->server, srv->cq, &srv->shutdown_tag);
    grpc_server_cancel_all_calls(srv->server);
    if (srv->shutdown_hook)
        srv->shutdown_hook(srv->shutdown_hook_arg);

    /* Wait for the core's shutdown notice and for every call struct to be released. A service
     * that never finishes a call it holds would block us; give up after 10 s and say so. */
    int64_t give_up_ns = ps_now_ns() + 10 * 1000000000LL;
    pthread_mutex_lock(&srv->mu);
    while (!srv->shutdown_notified || srv->nlive > 0) {
        struct timespec ts = realtime_in(50 * 1000000LL);
        pthread_cond_timedwait(&srv->cv, &srv->mu, &ts);
        if (ps_now_ns() > give_up_ns) {
            PS_ERROR(PS_SUB_RPC, "shutdown: %zu calls were never finished; exiting anyway",
                     srv->nlive);
            break;
        }
    }
    pthread_mutex_unlock(&srv->mu);

    ps_workq_close(&srv->work);
    for (int i = 0; i < srv->n_workers; i++)
        pthread_join(srv->workers[i], NULL);

    grpc_completion_queue_shutdown(srv->cq);
    for (int i = 0; i < srv->n_cq_threads; i++)
        pthread_join(srv->cq_threads[i], NULL);

    pthread_mutex_lock(&srv->mu);
    srv->shutdown_complete = true;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
}

void ps_rpc_server_destroy(ps_rpc_server_t *srv)
{
    if (!srv)
        return;
    if (srv->started) {
        ps_rpc_server_shutdown(srv);
    } else if (srv->cq) {
        /* Never started: no calls exist; drain the queue to its shutdown event. */
        grpc_completion_queue_shutdown(srv->cq);
        while (grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN) {
        }
    }
    if (srv->server)
        grpc_server_destroy(srv->server);
    if (srv->cq)
        grpc_completion_queue_destroy(srv->cq);
    ps_health_destroy(srv->health);
    ps_reflection_destroy(srv->reflection);
    free(srv->methods);
    free(srv->cq_threads);
    free(srv->workers);
    free(srv->token);
    pthread_mutex_destroy(&srv->mu);
    pthread_cond_destroy(&srv->cv);
    ps_workq_destroy(&srv->work);
    pthread_mutex_destroy(&srv->acct_mu);
    free(srv);
    grpc_shutdown();
}

void ps_rpc_block_signals(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
}

int ps_rpc_wait_for_signal(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    int sig = 0;
    while (sigwait(&set, &sig) != 0) {
    }
    return sig;
}
