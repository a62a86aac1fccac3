/* pshard's gRPC runtime over the gRPC C core API: a server with a method table (unary,
 * server-streaming and bidi-streaming calls dispatched to handlers with protobuf-c messages),
 * token and TLS/mTLS security, the standard health and reflection services, graceful shutdown;
 * and a client with deadlines, retries for idempotent calls, and server-streaming reads. */
#ifndef PSHARD_RPC_H
#define PSHARD_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "pshard/status.h"

/* The one mapping between pshard statuses and gRPC status codes (grpc_status_code values, as int
 * so that this header needs no gRPC include). Thread-safe. */
int ps_status_to_grpc(pshard_status_t status);
pshard_status_t ps_status_from_grpc(int grpc_code);

/* ------------------------------------------------------------------------------------------ */
/* Server                                                                                      */

typedef struct ps_rpc_server ps_rpc_server_t;
typedef struct ps_rpc_call ps_rpc_call_t;

/* Method flags. */
#define PS_RPC_STREAM 0x1u /* server-streaming: the handler sends with ps_rpc_call_send */
#define PS_RPC_BIDI 0x2u   /* bidi: the handler runs once per client message, in order */
#define PS_RPC_INLINE 0x4u /* handler never blocks: run it on the completion-queue thread */
#define PS_RPC_OPEN 0x8u   /* no cluster token required (health, reflection) */

/* A handler receives the call and its unpacked request (owned by the runtime, valid until the
 * handler returns). A unary handler must eventually call ps_rpc_call_reply or ps_rpc_call_fail
 * exactly once, either before returning or later from any thread (a deferred reply). A
 * streaming handler sends with ps_rpc_call_send and ends with ps_rpc_call_finish, also exactly
 * once. A bidi handler runs once per client message and must not finish the call itself unless
 * it fails it; the runtime finishes with OK when the client half-closes. */
typedef void (*ps_rpc_handler_fn)(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx);

typedef struct {
    const char *path; /* full method path: "/pshard.Coordinator/Register" (borrowed, static) */
    const ProtobufCMessageDescriptor *request_desc;
    ps_rpc_handler_fn handler;
    unsigned flags; /* PS_RPC_* */
    void *ctx;      /* passed to the handler */
} ps_rpc_method_t;

typedef struct {
    const char *listen;             /* "HOST:PORT"; port 0 picks a free one */
    const char *tls_cert_file;      /* PEM server certificate chain; NULL = plaintext */
    const char *tls_key_file;       /* PEM private key (with tls_cert_file) */
    const char *tls_client_ca_file; /* PEM CA; when set, clients must present a cert it signed */
    const char *token;              /* cluster token; NULL or "" = no token check */
    int64_t max_message_bytes;      /* receive limit; <= 0 means 4 MiB */
    int64_t max_stream_queue_bytes; /* what one call may have queued for sending (a client that
                                       does not read); <= 0 means 8 MiB */
    int64_t max_conn_queue_bytes;   /* ... all calls of one connection together; <= 0 means 4
                                       times max_stream_queue_bytes */
    int64_t max_total_queue_bytes;  /* ... all calls of the server; <= 0 means 32 times */
    int worker_threads;             /* for handlers without PS_RPC_INLINE; <= 0 means 4 */
    int cq_threads;                 /* completion-queue threads; <= 0 means 1 */
} ps_rpc_server_config_t;

/* Creates a server bound to cfg->listen (strings are copied). It serves health (service ""
 * SERVING once started) and reflection (v1alpha and v1) itself. Errors: NULL with a message
 * in err (bad address, port in use, unreadable TLS files). Free with ps_rpc_server_destroy. */
ps_rpc_server_t *ps_rpc_server_create(const ps_rpc_server_config_t *cfg, char *err, size_t errlen);

/* Adds methods (the table is borrowed and must outlive the server). Before start only. Not
 * thread-safe. Returns INVALID_ARGUMENT for a duplicate path or after start. */
pshard_status_t ps_rpc_server_add_methods(ps_rpc_server_t *srv, const ps_rpc_method_t *methods,
                                          size_t n);

/* Called once when shutdown begins (from the thread calling ps_rpc_server_shutdown), so the
 * service can finish the deferred calls and streams it holds. */
void ps_rpc_server_set_shutdown_hook(ps_rpc_server_t *srv, void (*fn)(void *arg), void *arg);

/* Starts serving. Returns the bound port (> 0) or -1. Not thread-safe. */
int ps_rpc_server_start(ps_rpc_server_t *srv);
int ps_rpc_server_port(const ps_rpc_server_t *srv);

/* Health: sets the status reported by grpc.health.v1.Health for `service` ("" is the whole
 * server) and pushes it to Watch subscribers. status: 1 SERVING, 2 NOT_SERVING. Thread-safe. */
void ps_rpc_server_set_health(ps_rpc_server_t *srv, const char *service, int status);

/* Per-method counters for status output. Calls fn once per registered method. Thread-safe. */
void ps_rpc_server_counters(ps_rpc_server_t *srv,
                            void (*fn)(void *arg, const char *path, uint64_t calls,
                                       uint64_t errors),
                            void *arg);

/* The worker pool's load right now: its size, how many workers run a handler, how many calls
 * wait for a worker, and how long the oldest of those has waited (0 when none waits). A call
 * waits only when every worker is busy, so a long wait means the pool is saturated (trainer
 * operations blocked in collectives, for instance). And the reply bytes all calls have queued
 * that gRPC has not yet taken (the send budgets bound them), now and at most since start.
 * Thread-safe. */
typedef struct {
    int workers;
    int busy;
    size_t queued;
    int64_t oldest_wait_ns;
    size_t send_queued_bytes;
    size_t send_queued_peak_bytes;
} ps_rpc_load_t;
void ps_rpc_server_load(ps_rpc_server_t *srv, ps_rpc_load_t *out);

/* Graceful shutdown: health NOT_SERVING, stop accepting calls, cancel open calls and streams,
 * run the shutdown hook, wait until every call is released, stop the threads. Blocks.
 * Idempotent. Thread-safe, but not from a handler. */
void ps_rpc_server_shutdown(ps_rpc_server_t *srv);

/* Shuts down if needed and frees the server. NULL is a no-op. */
void ps_rpc_server_destroy(ps_rpc_server_t *srv);

/* Finishes a unary call successfully with `response` (packed and copied; the caller keeps
 * ownership of the message). The call must not be used afterwards. Thread-safe. */
void ps_rpc_call_reply(ps_rpc_call_t *call, const ProtobufCMessage *response);

/* Finishes any call with an error: the gRPC status is ps_status_to_grpc(status), and the
 * formatted message is sent as the status details. The call must not be used afterwards. */
void ps_rpc_call_fail(ps_rpc_call_t *call, pshard_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Queues one message on a streaming call (sent in order, one write at a time). Returns
 * PSHARD_ERR_CANCELLED when the client has gone or the call is finishing, and
 * PSHARD_ERR_RESOURCE_EXHAUSTED (nothing queued) when the call already has
 * max_stream_queue_bytes queued that the client has not read: memory per stream is bounded,
 * and the caller decides (drop, tell the client to resync, or wait with
 * ps_rpc_call_wait_writable). A bidi stream's next request is read only once every reply to
 * the previous ones is sent. Thread-safe. */
pshard_status_t ps_rpc_call_send(ps_rpc_call_t *call, const ProtobufCMessage *msg);

/* One message packed once for many streams (a Watch event to every watcher): the slices are
 * shared, not copied, per call. */
typedef struct ps_rpc_packed ps_rpc_packed_t;
ps_rpc_packed_t *ps_rpc_pack(const ProtobufCMessage *msg);
pshard_status_t ps_rpc_call_send_packed(ps_rpc_call_t *call, const ps_rpc_packed_t *msg);
void ps_rpc_packed_free(ps_rpc_packed_t *msg);

/* Blocks until the call has at most half its cap queued (PSHARD_OK), it ended
 * (PSHARD_ERR_CANCELLED) or deadline_ns (ps_now_ns clock) passed (PSHARD_ERR_TIMEOUT).
 * For a handler that streams much (ReadRegion) at the pace the client reads. */
pshard_status_t ps_rpc_call_wait_writable(ps_rpc_call_t *call, int64_t deadline_ns);

/* Ends a streaming call with OK after the queued messages. The call must not be used after. */
void ps_rpc_call_finish(ps_rpc_call_t *call);

/* Registers a callback run once (on a completion-queue thread) when the client cancels or
 * disconnects before the call finished; it may call ps_rpc_call_finish/fail itself only if it
 * also owns the call's completion. Set it from the handler, before the handler returns. */
void ps_rpc_call_on_cancel(ps_rpc_call_t *call, void (*fn)(void *arg, ps_rpc_call_t *call),
                           void *arg);

bool ps_rpc_call_is_cancelled(const ps_rpc_call_t *call);

/* The call's deadline on the ps_now_ns() clock, or INT64_MAX when the client set none. */
int64_t ps_rpc_call_deadline_ns(const ps_rpc_call_t *call);

/* The value of request header `key` (lowercase) as a length-counted string (*len set; NOT
 * NUL-terminated), or NULL when the client sent none. Valid for the call's life. */
const char *ps_rpc_call_header(const ps_rpc_call_t *call, const char *key, size_t *len);

/* The method path, e.g. "/pshard.Coordinator/Register". Valid for the call's life. */
const char *ps_rpc_call_method(const ps_rpc_call_t *call);

/* The client's address ("ipv4:127.0.0.1:5555"), valid for the call's life. */
const char *ps_rpc_call_peer(const ps_rpc_call_t *call);

/* With mTLS, the verified identity of the client certificate (its subject CN or SAN); NULL
 * otherwise. Valid for the call's life. */
const char *ps_rpc_call_peer_identity(const ps_rpc_call_t *call);

/* Blocks SIGTERM and SIGINT in the calling thread (call in main() before creating any thread
 * so every thread inherits the mask), then later ps_rpc_wait_for_signal() returns the signal
 * number when one arrives. */
void ps_rpc_block_signals(void);
int ps_rpc_wait_for_signal(void);

/* ------------------------------------------------------------------------------------------ */
/* Client                                                                                      */

typedef struct ps_rpc_channel ps_rpc_channel_t;
typedef struct ps_rpc_stream ps_rpc_stream_t;

typedef struct {
    const char *target;        /* "HOST:PORT" */
    const char *tls_ca_file;   /* PEM CA to verify the server; NULL = plaintext */
    const char *tls_cert_file; /* client certificate for mTLS (with tls_key_file) */
    const char *tls_key_file;
    const char *tls_server_name; /* expected server name when it differs from target's host */
    const char *token;           /* sent as "authorization: Bearer TOKEN"; NULL = none */
    int64_t max_message_bytes;   /* receive limit; <= 0 means 4 MiB */
    bool own_connection;         /* do not share the TCP connection with other channels */
    const char *job;             /* sent as PS_RPC_JOB_HEADER on every call; NULL = none (the
                                    coordinator's default job) */
} ps_rpc_channel_config_t;

/* The request header that scopes a coordinator call to one job (torchrun's --rdzv-id). */
#define PS_RPC_JOB_HEADER "pshard-job"

/* Call flags. */
#define PS_RPC_IDEMPOTENT 0x1u /* retry with backoff on UNAVAILABLE until the deadline */

/* Creates a channel (strings copied; TLS files read now). NULL with a message on error. Each
 * channel is thread-safe: calls may run from many threads at once. */
ps_rpc_channel_t *ps_rpc_channel_create(const ps_rpc_channel_config_t *cfg, char *err,
                                        size_t errlen);
void ps_rpc_channel_destroy(ps_rpc_channel_t *ch);

/* Cancels every unary call in flight on ch (they fail with UNAVAILABLE and reason), e.g. when
 * the server they wait on was evicted by the coordinator. Thread-safe. */
void ps_rpc_channel_cancel_calls(ps_rpc_channel_t *ch, const char *reason);

/* Blocking unary call with a deadline of timeout_ms (> 0). On PSHARD_OK *response is a message
 * of response_desc (free with protobuf_c_message_free_unpacked(*response, NULL)). On error
 * *response is NULL, err holds the server's status details or the local reason, and
 * *grpc_code (may be NULL) the gRPC status code. Thread-safe. */
pshard_status_t ps_rpc_unary(ps_rpc_channel_t *ch, const char *path,
                             const ProtobufCMessage *request,
                             const ProtobufCMessageDescriptor *response_desc,
                             ProtobufCMessage **response, int64_t timeout_ms, unsigned flags,
                             int *grpc_code, char *err, size_t errlen);

/* As ps_rpc_unary with raw request bytes and raw response bytes (*response malloc'd, free()
 * it). For tools and tests that send what protobuf-c would not. */
pshard_status_t ps_rpc_unary_raw(ps_rpc_channel_t *ch, const char *path, const void *request,
                                 size_t request_len, void **response, size_t *response_len,
                                 int64_t timeout_ms, int *grpc_code, char *err, size_t errlen);

/* Opens a server-streaming call (timeout_ms <= 0: no deadline). NULL with a message on error
 * (only local failures; server errors surface from ps_rpc_stream_next). Not thread-safe: one
 * thread reads a stream. */
ps_rpc_stream_t *ps_rpc_stream_open(ps_rpc_channel_t *ch, const char *path,
                                    const ProtobufCMessage *request, int64_t timeout_ms, char *err,
                                    size_t errlen);

/* Waits up to wait_ms (< 0: forever) for the next message. PSHARD_OK with *msg set (free with
 * protobuf_c_message_free_unpacked); PSHARD_OK with *msg NULL when the server ended the stream
 * with OK; PSHARD_ERR_TIMEOUT when wait_ms passed and the stream is still open (call again);
 * another error when the stream failed (message in err, gRPC code in *grpc_code). */
pshard_status_t ps_rpc_stream_next(ps_rpc_stream_t *st, const ProtobufCMessageDescriptor *desc,
                                   ProtobufCMessage **msg, int64_t wait_ms, int *grpc_code,
                                   char *err, size_t errlen);

/* Cancels (if still open) and frees the stream. NULL is a no-op. */
void ps_rpc_stream_close(ps_rpc_stream_t *st);

/* Whether every string field of the message data[0..len) of type d (nested messages
 * included) is free of NUL bytes; else false with *field naming the first that is not. C
 * strings end at a NUL, so such a string would silently mean its prefix (two store keys
 * "a\0x" and "a\0y" one key): the server refuses such requests before unpacking them. */
bool ps_pb_strings_nul_free(const ProtobufCMessageDescriptor *d, const uint8_t *data, size_t len,
                            const char **field);

/* Cluster tokens: at least PS_TOKEN_MIN_BYTES bytes of printable ASCII without spaces (what a
 * client can send in "authorization: Bearer TOKEN"), and not the placeholder the Kubernetes
 * base ships. ps_token_problem says what is wrong with token[0..len) ("is shorter than 16
 * bytes", ...) or returns NULL. ps_read_token reads one from a file (trailing newlines
 * stripped), refusing a bad one: NULL with "the cluster token in PATH <problem>; make one
 * with ..." in err. */
#define PS_TOKEN_MIN_BYTES 16
#define PS_TOKEN_PLACEHOLDER "REPLACE-ME"
#define PS_TOKEN_HOWTO "make one with: head -c 32 /dev/urandom | base64 > FILE"
const char *ps_token_problem(const char *token, size_t len);
char *ps_read_token(const char *path, char *err, size_t errlen);

#endif
