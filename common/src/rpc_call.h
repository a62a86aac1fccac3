/* The gRPC server runtime's internals shared by its two files: the call and server structs,
 * and the entries of the per-call state machine (rpc_call.c) that the server loop (rpc_server.c)
 * drives. Calls go one way: the loop calls into the call machine, never back; the call machine
 * only uses the server struct's settings and the state the two share (the live list, the send
 * budgets, the work queue), under the server's locks. Not for use outside common/. */
#ifndef PSHARD_RPC_CALL_H
#define PSHARD_RPC_CALL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <grpc/grpc.h>

#include "pshard/queue.h"
#include "pshard/rpc.h"
#include "rpc_internal.h"

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

/* Allocates a call for a pending request of srv and puts it on the server's live list, with the
 * owner reference; NULL when out of memory. Freed by the last rpc_call_unref. Thread-safe. */
ps_rpc_call_t *rpc_call_alloc(ps_rpc_server_t *srv);
/* Drops a reference; the last one frees the call. Thread-safe. */
void rpc_call_unref(ps_rpc_call_t *c);
/* Starts a batch on the call with a reference for its completion (tag's). A batch the core
 * refuses is logged and marks the call cancelled. Call with c->mu held. */
void rpc_call_start_batch_locked(ps_rpc_call_t *c, const grpc_op *ops, size_t nops, rpc_tag_t *tag);
/* Records the final status (msg may be NULL; reply, owned, may be NULL) and sends it once no
 * message is being written. Drops the owner reference exactly once; a second call is logged and
 * ignored. Thread-safe. */
void rpc_call_finalize(ps_rpc_call_t *c, grpc_status_code code, const char *msg,
                       grpc_byte_buffer *reply);
/* Joins the call to its connection's share of the send budget (by c->peer). Out of memory: the
 * call has none and may not queue messages. Once per call, before it sends. */
void rpc_call_acct_get(ps_rpc_call_t *c);
/* Starts receiving the next request message (with the initial metadata if not sent yet). Call
 * with c->mu held. */
void rpc_call_start_recv_locked(ps_rpc_call_t *c);
/* Runs the method's handler on req (freed here); a bidi call then reads its next request, or
 * waits until every reply is sent. On a worker thread, or inline on a completion-queue thread
 * for PS_RPC_INLINE and PS_RPC_BIDI methods. */
void rpc_call_run_handler(ps_rpc_call_t *c, ProtobufCMessage *req);
/* A received request message (bb, taken; NULL: the client half-closed without one): unpacked
 * and dispatched to the handler, or the call failed saying why. c->method must be set. */
void rpc_call_take_request(ps_rpc_call_t *c, grpc_byte_buffer *bb);
/* The completions of the call's batches (TAG_RECV, TAG_CLOSE, TAG_SEND), each dropping its
 * batch's reference. On a completion-queue thread. */
void rpc_call_on_recv(ps_rpc_call_t *c, bool success);
void rpc_call_on_close(ps_rpc_call_t *c);
void rpc_call_on_send(ps_rpc_call_t *c, bool success);

/* CLOCK_REALTIME now + ns, for pthread_cond_timedwait. */
struct timespec rpc_realtime_in(int64_t ns);

#endif
