/* The gRPC client runtime: channels (plaintext, TLS, mTLS, cluster token), blocking unary
 * calls with deadlines and retries for idempotent calls, and server-streaming reads with a
 * per-read wait. Each call uses its own pluck completion queue, so any thread may call. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

/* A unary call in flight, listed so another thread can cancel it. */
typedef struct active_call {
    grpc_call *call;
    struct active_call *next;
} active_call_t;

struct ps_rpc_channel {
    grpc_channel *channel;
    char *auth_value; /* "Bearer TOKEN" or NULL */
    char *job;        /* sent as "pshard-job" on every call, or NULL */
    char *target;
    pthread_mutex_t mu; /* guards active */
    active_call_t *active;
};

struct ps_rpc_stream {
    grpc_completion_queue *cq;
    grpc_call *call;
    grpc_metadata_array initial_md, trailing_md;
    grpc_byte_buffer *send_bb, *recv_bb;
    grpc_status_code status;
    grpc_slice details;
    int tag_send, tag_recv, tag_status; /* addresses used as tags */
    bool send_pending, recv_pending, status_pending, initial_md_asked, ended;
};

static bool pb_varint(const uint8_t **p, size_t *n, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; shift < 64 && *n > 0; shift += 7) {
        uint8_t b = **p;
        (*p)++;
        (*n)--;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            return true;
    }
    return false;
}

/* Walks the wire encoding of one message of type d; false (with *field) at the first string
 * field whose bytes hold a NUL. Malformed input returns true: protobuf-c refuses it next. */
static bool pb_walk(const ProtobufCMessageDescriptor *d, const uint8_t *p, size_t n, int depth,
                    const char **field)
{
    while (n > 0) {
        uint64_t key, len;
        if (!pb_varint(&p, &n, &key))
            return true;
        switch (key & 7) {
        case 0:
            if (!pb_varint(&p, &n, &len))
                return true;
            break;
        case 1:
        case 5: {
            size_t w = (key & 7) == 1 ? 8 : 4;
            if (n < w)
                return true;
            p += w;
            n -= w;
            break;
        }
        case 2: {
            if (!pb_varint(&p, &n, &len) || len > n)
                return true;
            const ProtobufCFieldDescriptor *f =
                key >> 3 <= UINT32_MAX
                    ? protobuf_c_message_descriptor_get_field(d, (unsigned)(key >> 3))
                    : NULL;
            if (f && f->type == PROTOBUF_C_TYPE_STRING && memchr(p, 0, (size_t)len)) {
                *field = f->name;
                return false;
            }
            if (f && f->type == PROTOBUF_C_TYPE_MESSAGE && depth < 64 &&
                !pb_walk(f->descriptor, p, (size_t)len, depth + 1, field))
                return false;
            p += len;
            n -= (size_t)len;
            break;
        }
        default:
            return true;
        }
    }
    return true;
}

bool ps_pb_strings_nul_free(const ProtobufCMessageDescriptor *d, const uint8_t *data, size_t len,
                            const char **field)
{
    *field = NULL;
    return pb_walk(d, data, len, 0, field);
}

const char *ps_token_problem(const char *token, size_t len)
{
    if (strlen(token) != len)
        return "holds a NUL byte";
    if (len < PS_TOKEN_MIN_BYTES)
        return "is shorter than 16 bytes";
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)token[i] < 0x21 || (unsigned char)token[i] > 0x7e)
            return "holds a byte a client cannot send as 'authorization: Bearer' (a space, "
                   "newline, control or non-ASCII byte)";
    if (strncmp(token, PS_TOKEN_PLACEHOLDER, strlen(PS_TOKEN_PLACEHOLDER)) == 0)
        return "is the placeholder shipped in deploy/k8s/base/secrets/cluster-token";
    return NULL;
}

char *ps_read_token(const char *path, char *err, size_t errlen)
{
    size_t n = 0;
    char *t = ps_read_file(path, true, 4096, &n, err, errlen);
    if (!t)
        return NULL;
    const char *why = n == 0 ? "is empty" : ps_token_problem(t, n);
    if (why) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "the cluster token in %s %s; %s", path,
                why, PS_TOKEN_HOWTO);
        free(t);
        return NULL;
    }
    return t;
}

/* The metadata every call on ch sends: the cluster token and the job it belongs to. Values
 * are copied slices: the caller unrefs them once its batch has started. */
static size_t call_metadata(const ps_rpc_channel_t *ch, grpc_metadata md[2])
{
    size_t n = 0;
    memset(md, 0, 2 * sizeof(*md));
    if (ch->auth_value) {
        md[n].key = grpc_slice_from_static_string("authorization");
        md[n++].value = grpc_slice_from_copied_string(ch->auth_value);
    }
    if (ch->job) {
        md[n].key = grpc_slice_from_static_string(PS_RPC_JOB_HEADER);
        md[n++].value = grpc_slice_from_copied_string(ch->job);
    }
    return n;
}

ps_rpc_channel_t *ps_rpc_channel_create(const ps_rpc_channel_config_t *cfg, char *err,
                                        size_t errlen)
{
    if (!cfg->target || !*cfg->target) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "no server address given");
        return NULL;
    }
    ps_rpc_channel_t *ch = calloc(1, sizeof(*ch));
    if (!ch) {
        ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        return NULL;
    }
    grpc_init();
    pthread_mutex_init(&ch->mu, NULL);
    ch->target = strdup(cfg->target);
    if (cfg->token && *cfg->token) {
        size_t n = strlen(cfg->token) + 8;
        ch->auth_value = malloc(n);
        if (ch->auth_value)
            snprintf(ch->auth_value, n, "Bearer %s", cfg->token);
    }
    if (cfg->job && *cfg->job)
        ch->job = strdup(cfg->job);
    grpc_channel_credentials *creds = NULL;
    if (cfg->tls_ca_file || cfg->tls_cert_file) {
        char *ca = NULL, *cert = NULL, *key = NULL;
        if (cfg->tls_ca_file)
            ca = ps_read_file(cfg->tls_ca_file, false, 1 << 20, NULL, err, errlen);
        if (cfg->tls_cert_file) {
            cert = ps_read_file(cfg->tls_cert_file, false, 1 << 20, NULL, err, errlen);
            if (cfg->tls_key_file)
                key = ps_read_file(cfg->tls_key_file, false, 1 << 20, NULL, err, errlen);
            else
                ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                        "a client certificate needs its key (--tls-key)");
        }
        bool ok = (!cfg->tls_ca_file || ca) && (!cfg->tls_cert_file || (cert && key));
        if (ok) {
            grpc_ssl_pem_key_cert_pair pair = {key, cert};
            creds = grpc_ssl_credentials_create(ca, cert ? &pair : NULL, NULL, NULL);
        }
        free(ca);
        free(cert);
        free(key);
        if (!creds) {
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "could not build TLS credentials");
            ps_rpc_channel_destroy(ch);
            return NULL;
        }
    } else {
        creds = grpc_insecure_credentials_create();
    }
    grpc_arg args[3];
    size_t nargs = 0;
    args[nargs].type = GRPC_ARG_INTEGER;
    args[nargs].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[nargs].value.integer =
        cfg->max_message_bytes > 0 ? (int)cfg->max_message_bytes : (4 << 20);
    nargs++;
    if (cfg->own_connection) {
        args[nargs].type = GRPC_ARG_INTEGER;
        args[nargs].key = GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL;
        args[nargs].value.integer = 1;
        nargs++;
    }
    if (cfg->tls_server_name) {
        args[nargs].type = GRPC_ARG_STRING;
        args[nargs].key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
        args[nargs].value.string = (char *)cfg->tls_server_name;
        nargs++;
    }
    grpc_channel_args chargs = {nargs, args};
    ch->channel = grpc_channel_create(cfg->target, creds, &chargs);
    grpc_channel_credentials_release(creds);
    if (!ch->channel) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "cannot create a channel to %s",
                cfg->target);
        ps_rpc_channel_destroy(ch);
        return NULL;
    }
    return ch;
}

void ps_rpc_channel_destroy(ps_rpc_channel_t *ch)
{
    if (!ch)
        return;
    if (ch->channel)
        grpc_channel_destroy(ch->channel);
    free(ch->auth_value);
    free(ch->job);
    free(ch->target);
    pthread_mutex_destroy(&ch->mu);
    free(ch);
    grpc_shutdown();
}

void ps_rpc_channel_cancel_calls(ps_rpc_channel_t *ch, const char *reason)
{
    pthread_mutex_lock(&ch->mu);
    for (active_call_t *a = ch->active; a; a = a->next)
        grpc_call_cancel_with_status(a->call, GRPC_STATUS_UNAVAILABLE,
                                     reason ? reason : "cancelled", NULL);
    pthread_mutex_unlock(&ch->mu);
}

static gpr_timespec deadline_after_ms(int64_t ms)
{
    if (ms <= 0)
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

static void drain_and_destroy_cq(grpc_completion_queue *cq)
{
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
}

static pshard_status_t status_from_call(grpc_status_code code, grpc_slice details,
                                        const grpc_metadata_array *trailing, const char *target,
                                        const char *path, char *err, size_t errlen)
{
    if (code == GRPC_STATUS_OK)
        return PSHARD_OK;
    pshard_status_t st = ps_status_from_grpc((int)code);
    /* A pshard server names the exact status; trust it only if it maps to the same gRPC code
     * (a peer cannot turn an error into success or into another class). */
    for (size_t i = 0; trailing && i < trailing->count; i++) {
        const grpc_metadata *m = &trailing->metadata[i];
        if (grpc_slice_str_cmp(m->key, "pshard-status") != 0)
            continue;
        char v[16];
        size_t len = GRPC_SLICE_LENGTH(m->value);
        if (len == 0 || len >= sizeof(v))
            break;
        memcpy(v, GRPC_SLICE_START_PTR(m->value), len);
        v[len] = '\0';
        char *end = NULL;
        long x = strtol(v, &end, 10);
        if (*end == '\0' && x < 0 && x >= -1000 &&
            strcmp(pshard_status_name((pshard_status_t)x), "PSHARD_ERR_UNKNOWN") != 0 &&
            ps_status_to_grpc((pshard_status_t)x) == (int)code)
            st = (pshard_status_t)x;
        break;
    }
    ps_errf(err, errlen, st, "%.*s", (int)GRPC_SLICE_LENGTH(details),
            (const char *)GRPC_SLICE_START_PTR(details));
    if (GRPC_SLICE_LENGTH(details) == 0)
        ps_errf(err, errlen, st, "%s on %s failed with gRPC status %d", path, target, (int)code);
    return st;
}

/* One attempt of a unary call with raw bytes. */
static pshard_status_t unary_once(ps_rpc_channel_t *ch, const char *path, grpc_slice request,
                                  gpr_timespec deadline, grpc_slice *response, bool *has_response,
                                  int *grpc_code, char *err, size_t errlen)
{
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_call *call =
        grpc_channel_create_call(ch->channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                 grpc_slice_from_static_string(path), NULL, deadline, NULL);
    active_call_t me = {.call = call};
    pthread_mutex_lock(&ch->mu);
    me.next = ch->active;
    ch->active = &me;
    pthread_mutex_unlock(&ch->mu);
    grpc_metadata md[2];
    size_t nmd = call_metadata(ch, md);
    grpc_byte_buffer *send_bb = grpc_raw_byte_buffer_create(&request, 1);
    grpc_byte_buffer *recv_bb = NULL;
    grpc_metadata_array initial_md, trailing_md;
    grpc_metadata_array_init(&initial_md);
    grpc_metadata_array_init(&trailing_md);
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();

    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = nmd;
    ops[0].data.send_initial_metadata.metadata = nmd ? md : NULL;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &initial_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv_bb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trailing_md;
    ops[5].data.recv_status_on_client.status = &status;
    ops[5].data.recv_status_on_client.status_details = &details;

    int tag = 0;
    pshard_status_t rc = PSHARD_OK;
    grpc_call_error started = grpc_call_start_batch(call, ops, 6, &tag, NULL);
    for (size_t i = 0; i < nmd; i++)
        grpc_slice_unref(md[i].value);
    if (started != GRPC_CALL_OK) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "cannot start a call to %s", path);
    } else {
        grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (grpc_code)
            *grpc_code = (int)status;
        rc = status_from_call(status, details, &trailing_md, ch->target, path, err, errlen);
        if (rc == PSHARD_OK && recv_bb) {
            grpc_byte_buffer_reader reader;
            if (grpc_byte_buffer_reader_init(&reader, recv_bb)) {
                *response = grpc_byte_buffer_reader_readall(&reader);
                *has_response = true;
                grpc_byte_buffer_reader_destroy(&reader);
            }
        } else if (rc == PSHARD_OK) {
            rc = ps_errf(err, errlen, PSHARD_ERR_RPC, "%s returned no message", path);
        }
    }
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&initial_md);
    grpc_metadata_array_destroy(&trailing_md);
    grpc_byte_buffer_destroy(send_bb);
    if (recv_bb)
        grpc_byte_buffer_destroy(recv_bb);
    pthread_mutex_lock(&ch->mu);
    for (active_call_t **pp = &ch->active; *pp; pp = &(*pp)->next) {
        if (*pp == &me) {
            *pp = me.next;
            break;
        }
    }
    grpc_call_unref(call);
    pthread_mutex_unlock(&ch->mu);
    drain_and_destroy_cq(cq);
    return rc;
}

/* Runs a unary call, retrying idempotent calls on UNAVAILABLE with exponential backoff
 * (25 ms doubling to 1 s) while the deadline allows. */
static pshard_status_t unary_slices(ps_rpc_channel_t *ch, const char *path, grpc_slice request,
                                    grpc_slice *response, bool *has_response, int64_t timeout_ms,
                                    unsigned flags, int *grpc_code, char *err, size_t errlen)
{
    if (timeout_ms <= 0)
        timeout_ms = 30000;
    int64_t end_ns = ps_now_ns() + timeout_ms * 1000000;
    int64_t backoff_ms = 25;
    for (;;) {
        char attempt_err[PSHARD_ERRLEN] = "";
        int64_t left_ms = (end_ns - ps_now_ns()) / 1000000;
        if (left_ms < 1)
            left_ms = 1;
        pshard_status_t rc = unary_once(ch, path, request, deadline_after_ms(left_ms), response,
                                        has_response, grpc_code, attempt_err, sizeof(attempt_err));
        if (rc == PSHARD_OK)
            return rc;
        int64_t now = ps_now_ns();
        if (!(flags & PS_RPC_IDEMPOTENT) || rc != PSHARD_ERR_UNAVAILABLE ||
            now + backoff_ms * 1000000 >= end_ns) {
            return ps_errf(err, errlen, rc, "%s", attempt_err);
        }
        PS_DEBUG(PS_SUB_RPC, "%s on %s unavailable (%s); retrying in %lld ms", path, ch->target,
                 attempt_err, (long long)backoff_ms);
        struct timespec ts = {backoff_ms / 1000, (backoff_ms % 1000) * 1000000};
        nanosleep(&ts, NULL);
        backoff_ms = backoff_ms * 2 > 1000 ? 1000 : backoff_ms * 2;
    }
}

pshard_status_t ps_rpc_unary(ps_rpc_channel_t *ch, const char *path,
                             const ProtobufCMessage *request,
                             const ProtobufCMessageDescriptor *response_desc,
                             ProtobufCMessage **response, int64_t timeout_ms, unsigned flags,
                             int *grpc_code, char *err, size_t errlen)
{
    *response = NULL;
    size_t len = protobuf_c_message_get_packed_size(request);
    grpc_slice req = grpc_slice_malloc(len);
    protobuf_c_message_pack(request, GRPC_SLICE_START_PTR(req));
    grpc_slice resp;
    bool has = false;
    pshard_status_t rc =
        unary_slices(ch, path, req, &resp, &has, timeout_ms, flags, grpc_code, err, errlen);
    grpc_slice_unref(req);
    if (has) {
        if (rc == PSHARD_OK) {
            *response = protobuf_c_message_unpack(response_desc, NULL, GRPC_SLICE_LENGTH(resp),
                                                  GRPC_SLICE_START_PTR(resp));
            if (!*response)
                rc = ps_errf(err, errlen, PSHARD_ERR_RPC, "%s returned a malformed %s", path,
                             response_desc->name);
        }
        grpc_slice_unref(resp);
    }
    return rc;
}

pshard_status_t ps_rpc_unary_raw(ps_rpc_channel_t *ch, const char *path, const void *request,
                                 size_t request_len, void **response, size_t *response_len,
                                 int64_t timeout_ms, int *grpc_code, char *err, size_t errlen)
{
    *response = NULL;
    *response_len = 0;
    grpc_slice req = grpc_slice_from_copied_buffer(request, request_len);
    grpc_slice resp;
    bool has = false;
    pshard_status_t rc =
        unary_slices(ch, path, req, &resp, &has, timeout_ms, 0, grpc_code, err, errlen);
    grpc_slice_unref(req);
    if (has) {
        size_t n = GRPC_SLICE_LENGTH(resp);
        *response = malloc(n ? n : 1);
        if (*response) {
            memcpy(*response, GRPC_SLICE_START_PTR(resp), n);
            *response_len = n;
        } else {
            rc = PSHARD_ERR_NO_MEMORY;
        }
        grpc_slice_unref(resp);
    }
    return rc;
}

ps_rpc_stream_t *ps_rpc_stream_open(ps_rpc_channel_t *ch, const char *path,
                                    const ProtobufCMessage *request, int64_t timeout_ms, char *err,
                                    size_t errlen)
{
    ps_rpc_stream_t *st = calloc(1, sizeof(*st));
    if (!st) {
        ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        return NULL;
    }
    st->cq = grpc_completion_queue_create_for_pluck(NULL);
    st->call = grpc_channel_create_call(ch->channel, NULL, GRPC_PROPAGATE_DEFAULTS, st->cq,
                                        grpc_slice_from_static_string(path), NULL,
                                        deadline_after_ms(timeout_ms), NULL);
    grpc_metadata_array_init(&st->initial_md);
    grpc_metadata_array_init(&st->trailing_md);
    st->details = grpc_empty_slice();
    size_t len = protobuf_c_message_get_packed_size(request);
    grpc_slice s = grpc_slice_malloc(len);
    protobuf_c_message_pack(request, GRPC_SLICE_START_PTR(s));
    st->send_bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);

    grpc_metadata md[2];
    size_t nmd = call_metadata(ch, md);
    grpc_op ops[3];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = nmd;
    ops[0].data.send_initial_metadata.metadata = nmd ? md : NULL;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = st->send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    grpc_call_error e1 = grpc_call_start_batch(st->call, ops, 3, &st->tag_send, NULL);
    for (size_t i = 0; i < nmd; i++)
        grpc_slice_unref(md[i].value);
    st->send_pending = e1 == GRPC_CALL_OK;

    grpc_op sop;
    memset(&sop, 0, sizeof(sop));
    sop.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    sop.data.recv_status_on_client.trailing_metadata = &st->trailing_md;
    sop.data.recv_status_on_client.status = &st->status;
    sop.data.recv_status_on_client.status_details = &st->details;
    grpc_call_error e2 = grpc_call_start_batch(st->call, &sop, 1, &st->tag_status, NULL);
    st->status_pending = e2 == GRPC_CALL_OK;
    if (e1 != GRPC_CALL_OK || e2 != GRPC_CALL_OK) {
        ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "cannot start stream %s", path);
        ps_rpc_stream_close(st);
        return NULL;
    }
    return st;
}

pshard_status_t ps_rpc_stream_next(ps_rpc_stream_t *st, const ProtobufCMessageDescriptor *desc,
                                   ProtobufCMessage **msg, int64_t wait_ms, int *grpc_code,
                                   char *err, size_t errlen)
{
    *msg = NULL;
    if (st->ended)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION, "the stream has ended");
    if (!st->recv_pending) {
        grpc_op ops[2];
        size_t n = 0;
        memset(ops, 0, sizeof(ops));
        if (!st->initial_md_asked) {
            ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
            ops[n].data.recv_initial_metadata.recv_initial_metadata = &st->initial_md;
            n++;
            st->initial_md_asked = true;
        }
        ops[n].op = GRPC_OP_RECV_MESSAGE;
        ops[n].data.recv_message.recv_message = &st->recv_bb;
        n++;
        if (grpc_call_start_batch(st->call, ops, n, &st->tag_recv, NULL) != GRPC_CALL_OK)
            return ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "cannot read the stream");
        st->recv_pending = true;
    }
    gpr_timespec until = wait_ms < 0 ? gpr_inf_future(GPR_CLOCK_REALTIME)
                                     : deadline_after_ms(wait_ms > 0 ? wait_ms : 1);
    grpc_event ev = grpc_completion_queue_pluck(st->cq, &st->tag_recv, until, NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT)
        return PSHARD_ERR_TIMEOUT;
    st->recv_pending = false;
    if (st->recv_bb) {
        grpc_byte_buffer_reader reader;
        pshard_status_t rc = PSHARD_OK;
        if (grpc_byte_buffer_reader_init(&reader, st->recv_bb)) {
            grpc_slice s = grpc_byte_buffer_reader_readall(&reader);
            grpc_byte_buffer_reader_destroy(&reader);
            *msg = protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(s),
                                             GRPC_SLICE_START_PTR(s));
            grpc_slice_unref(s);
        }
        grpc_byte_buffer_destroy(st->recv_bb);
        st->recv_bb = NULL;
        if (!*msg)
            rc = ps_errf(err, errlen, PSHARD_ERR_RPC, "the stream sent a malformed %s", desc->name);
        return rc;
    }
    /* End of stream: the status tells whether it ended well. */
    st->ended = true;
    if (st->status_pending) {
        grpc_completion_queue_pluck(st->cq, &st->tag_status, gpr_inf_future(GPR_CLOCK_REALTIME),
                                    NULL);
        st->status_pending = false;
    }
    if (grpc_code)
        *grpc_code = (int)st->status;
    return status_from_call(st->status, st->details, &st->trailing_md, "server", "stream", err,
                            errlen);
}

void ps_rpc_stream_close(ps_rpc_stream_t *st)
{
    if (!st)
        return;
    if (st->call) {
        if (!st->ended)
            grpc_call_cancel(st->call, NULL);
        gpr_timespec forever = gpr_inf_future(GPR_CLOCK_REALTIME);
        if (st->send_pending)
            grpc_completion_queue_pluck(st->cq, &st->tag_send, forever, NULL);
        if (st->recv_pending)
            grpc_completion_queue_pluck(st->cq, &st->tag_recv, forever, NULL);
        if (st->status_pending)
            grpc_completion_queue_pluck(st->cq, &st->tag_status, forever, NULL);
        grpc_call_unref(st->call);
    }
    if (st->recv_bb)
        grpc_byte_buffer_destroy(st->recv_bb);
    if (st->send_bb)
        grpc_byte_buffer_destroy(st->send_bb);
    grpc_metadata_array_destroy(&st->initial_md);
    grpc_metadata_array_destroy(&st->trailing_md);
    grpc_slice_unref(st->details);
    drain_and_destroy_cq(st->cq);
    free(st);
}
