/* torch's Store over the coordinator's key/value store (pshard/store.h): one gRPC channel per
 * handle, each call one or a few coordinator methods; get and wait are the coordinator's
 * StoreWait, which holds the call until the keys exist or its deadline passes. */
#include "client_internal.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/coord_client.h"
#include "pshard/rpc.h"
#include "pshard/store.h"
#include "pshard/util.h"

/* The coordinator refuses a StoreWait longer than this; longer waits are made of several. */
#define WAIT_CHUNK_MS (24LL * 3600 * 1000)
/* What a StoreWait's RPC deadline adds to the wait itself (as ps_coord_store_await does). */
#define WAIT_SLACK_MS 5000
/* Keys the coordinator takes in one StoreWait. */
#define WAIT_KEYS_MAX 1024

struct pshard_store {
    ps_rpc_channel_t *ch;
    uint64_t id; /* tells this handle's errors apart in the thread's error slot */
    char target[300];
};

/* Each thread's last error: which handle it came from and its message. A thread-local slot
 * rather than one per handle, so that threads sharing a handle never read each other's. */
static _Thread_local uint64_t tls_err_id;
static _Thread_local char tls_err[PSHARD_ERRLEN];
static atomic_uint_fast64_t next_store_id = 1;

/* Records a failed call's message for pshard_store_last_error; returns rc. */
static pshard_status_t store_fail(const pshard_store_t *s, pshard_status_t rc, const char *msg)
{
    tls_err_id = s->id;
    ps_strlcpy(tls_err, msg && *msg ? msg : pshard_status_str(rc), sizeof(tls_err));
    return rc;
}

/* Starts a call: clears the thread's error for s. */
static void store_begin(const pshard_store_t *s)
{
    if (tls_err_id == s->id)
        tls_err[0] = '\0';
}

/* Longest timeout taken (about 31 years): deadlines in ns stay far from int64's end. */
#define TIMEOUT_MAX_MS 1000000000000LL

static int64_t timeout_of(int64_t timeout_ms)
{
    if (timeout_ms <= 0)
        return PSHARD_STORE_DEFAULT_TIMEOUT_MS;
    return timeout_ms > TIMEOUT_MAX_MS ? TIMEOUT_MAX_MS : timeout_ms;
}

/* The key rules, checked here so that the message says which call broke them. */
static pshard_status_t check_key(const char *what, const char *key, char *err, size_t errlen)
{
    if (!key)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: the key is NULL", what);
    size_t n = strnlen(key, PSHARD_STORE_KEY_MAX + 1);
    if (n == 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: the key is empty", what);
    if (n > PSHARD_STORE_KEY_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: the key '%.64s...' is over the coordinator's limit of %d bytes", what,
                       key, PSHARD_STORE_KEY_MAX);
    return PSHARD_OK;
}

static pshard_status_t check_value(const char *what, const void *value, size_t len, char *err,
                                   size_t errlen)
{
    if (len > PSHARD_STORE_VALUE_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: the value is %zu bytes; the coordinator's limit is %d", what, len,
                       PSHARD_STORE_VALUE_MAX);
    if (!value && len > 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: the value is NULL but %zu bytes long", what, len);
    return PSHARD_OK;
}

/* A malloc'd copy of data[0..len) with a NUL one past the end, or NULL. */
static void *copy_bytes(const void *data, size_t len)
{
    char *copy = malloc(len + 1);
    if (!copy)
        return NULL;
    if (len)
        memcpy(copy, data, len);
    copy[len] = '\0';
    return copy;
}

pshard_status_t pshard_store_open(const char *coordinator, const char *job, const char *token,
                                  pshard_store_t **out, char *err, size_t errlen)
{
    if (!out)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "store open: out is NULL");
    *out = NULL;
    if (!coordinator || !*coordinator || !strrchr(coordinator, ':'))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "store open: the coordinator address '%s' is not HOST:PORT",
                       coordinator ? coordinator : "(null)");
    pshard_store_t *s = calloc(1, sizeof(*s));
    if (!s)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "store open: out of memory");
    if (ps_strlcpy(s->target, coordinator, sizeof(s->target)) != 0) {
        free(s);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "store open: the coordinator address is over %zu bytes",
                       sizeof(s->target) - 1);
    }
    char *read_token = NULL;
    char local_err[PSHARD_ERRLEN] = "";
    if (!token) {
        const char *tf = getenv("PSHARD_TOKEN_FILE");
        if (tf && *tf) {
            read_token = ps_read_token(tf, local_err, sizeof(local_err));
            if (!read_token) {
                free(s);
                return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                               "store open: %s (PSHARD_TOKEN_FILE)", local_err);
            }
            token = read_token;
        }
    }
    const char *ca = getenv("PSHARD_COORDINATOR_CA");
    ps_rpc_channel_config_t cc = {.target = s->target,
                                  .token = token && *token ? token : NULL,
                                  .tls_ca_file = ca && *ca ? ca : NULL,
                                  .job = job && *job ? job : NULL,
                                  .max_message_bytes = 64 << 20}; /* a wait's values */
    s->ch = ps_rpc_channel_create(&cc, local_err, sizeof(local_err));
    free(read_token); /* the channel copied it */
    if (!s->ch) {
        free(s);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "store open: cannot make a channel to coordinator %s: %s", coordinator,
                       local_err);
    }
    s->id = atomic_fetch_add(&next_store_id, 1);
    *out = s;
    return PSHARD_OK;
}

void pshard_store_close(pshard_store_t *s)
{
    if (!s)
        return;
    if (tls_err_id == s->id)
        tls_err[0] = '\0';
    ps_rpc_channel_destroy(s->ch);
    free(s);
}

const char *pshard_store_last_error(const pshard_store_t *s)
{
    return s && tls_err_id == s->id ? tls_err : "";
}

pshard_status_t pshard_store_set(pshard_store_t *s, const char *key, const void *value, size_t len,
                                 int64_t timeout_ms)
{
    char err[PSHARD_ERRLEN] = "";
    store_begin(s);
    pshard_status_t rc = check_key("store set", key, err, sizeof(err));
    if (rc == PSHARD_OK)
        rc = check_value("store set", value, len, err, sizeof(err));
    if (rc == PSHARD_OK)
        rc = ps_coord_store_put(s->ch, key, value, len, timeout_of(timeout_ms), err, sizeof(err));
    return rc == PSHARD_OK ? rc : store_fail(s, rc, err);
}

/* Waits until every one of keys[0..n) (n <= WAIT_KEYS_MAX) is set or deadline_ns passes, in
 * StoreWaits of at most WAIT_CHUNK_MS; *values (may be NULL) gets the last reply. */
static pshard_status_t wait_keys(pshard_store_t *s, const char *const *keys, size_t n,
                                 int64_t deadline_ns, Pshard__StoreWaitResponse **values, char *err,
                                 size_t errlen)
{
    for (;;) {
        int64_t left_ms = (deadline_ns - ps_now_ns()) / 1000000;
        if (left_ms < 1)
            left_ms = 1; /* one last look: the keys may be there already */
        int64_t chunk = left_ms > WAIT_CHUNK_MS ? WAIT_CHUNK_MS : left_ms;
        Pshard__StoreWaitRequest req = PSHARD__STORE_WAIT_REQUEST__INIT;
        req.keys = (char **)keys;
        req.n_keys = n;
        req.timeout_ms = chunk;
        pshard_status_t rc =
            ps_coord_rpc_store_wait(s->ch, &req, values, chunk + WAIT_SLACK_MS, err, errlen);
        if (rc != PSHARD_ERR_TIMEOUT || chunk == left_ms)
            return rc;
    }
}

pshard_status_t pshard_store_get(pshard_store_t *s, const char *key, void **value, size_t *len,
                                 int64_t timeout_ms)
{
    char err[PSHARD_ERRLEN] = "";
    store_begin(s);
    *value = NULL;
    *len = 0;
    pshard_status_t rc = check_key("store get", key, err, sizeof(err));
    if (rc != PSHARD_OK)
        return store_fail(s, rc, err);
    int64_t t = timeout_of(timeout_ms);
    Pshard__StoreWaitResponse *resp = NULL;
    rc = wait_keys(s, &key, 1, ps_now_ns() + t * 1000000, &resp, err, sizeof(err));
    if (rc == PSHARD_ERR_TIMEOUT) {
        char why[PSHARD_ERRLEN];
        ps_strlcpy(why, err, sizeof(why));
        ps_errf(err, sizeof(err), rc, "store get: key '%.200s' was not set within %lld ms (%s)",
                key, (long long)t, why);
    }
    if (rc != PSHARD_OK)
        return store_fail(s, rc, err);
    if (resp->n_values != 1) {
        ps_errf(err, sizeof(err), PSHARD_ERR_INTERNAL,
                "store get: the coordinator answered %zu values for one key", resp->n_values);
        protobuf_c_message_free_unpacked(&resp->base, NULL);
        return store_fail(s, PSHARD_ERR_INTERNAL, err);
    }
    void *copy = copy_bytes(resp->values[0].data, resp->values[0].len);
    size_t n = resp->values[0].len;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    if (!copy)
        return store_fail(s, PSHARD_ERR_NO_MEMORY, "store get: out of memory for the value");
    *value = copy;
    *len = n;
    return PSHARD_OK;
}

pshard_status_t pshard_store_add(pshard_store_t *s, const char *key, int64_t delta, int64_t *result,
                                 int64_t timeout_ms)
{
    char err[PSHARD_ERRLEN] = "";
    store_begin(s);
    pshard_status_t rc = check_key("store add", key, err, sizeof(err));
    if (rc == PSHARD_OK)
        rc = ps_coord_store_incr(s->ch, key, delta, result, timeout_of(timeout_ms), err,
                                 sizeof(err));
    return rc == PSHARD_OK ? rc : store_fail(s, rc, err);
}

/* After a compare_set that found no value: true when key exists holding an empty value (false
 * when it is absent, or when it has since been set to something else: the compare_set then
 * most likely met it absent). */
static bool holds_empty_value(pshard_store_t *s, const char *key, int64_t timeout_ms)
{
    Pshard__StoreGetRequest req = PSHARD__STORE_GET_REQUEST__INIT;
    req.key = (char *)key;
    Pshard__StoreGetResponse *resp = NULL;
    char err[PSHARD_ERRLEN];
    if (ps_coord_rpc_store_get(s->ch, &req, &resp, timeout_ms, err, sizeof(err)) != PSHARD_OK)
        return false;
    bool empty = resp->value.len == 0;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return empty;
}

pshard_status_t pshard_store_compare_set(pshard_store_t *s, const char *key, const void *expected,
                                         size_t elen, const void *desired, size_t dlen,
                                         void **current, size_t *clen, bool *swapped,
                                         int64_t timeout_ms)
{
    char err[PSHARD_ERRLEN] = "";
    store_begin(s);
    *current = NULL;
    *clen = 0;
    if (swapped)
        *swapped = false;
    pshard_status_t rc = check_key("store compare_set", key, err, sizeof(err));
    if (rc == PSHARD_OK)
        rc = check_value("store compare_set (expected)", expected, elen, err, sizeof(err));
    if (rc == PSHARD_OK)
        rc = check_value("store compare_set (desired)", desired, dlen, err, sizeof(err));
    if (rc != PSHARD_OK)
        return store_fail(s, rc, err);
    Pshard__StoreCompareSetRequest req = PSHARD__STORE_COMPARE_SET_REQUEST__INIT;
    req.key = (char *)key;
    req.expected.data = (uint8_t *)expected;
    req.expected.len = elen;
    req.desired.data = (uint8_t *)desired;
    req.desired.len = dlen;
    Pshard__StoreCompareSetResponse *resp = NULL;
    rc = ps_coord_rpc_store_compare_set(s->ch, &req, &resp, timeout_of(timeout_ms), err,
                                        sizeof(err));
    if (rc != PSHARD_OK)
        return store_fail(s, rc, err);
    /* The coordinator answers an absent key with a non-empty expected by "not swapped, no
     * value"; TCPStore answers it with expected, which is what torch's callers check for. The
     * reply looks the same for a key holding an empty value, so a get tells them apart. */
    bool absent_echo = !resp->swapped && resp->value.len == 0 && elen > 0 &&
                       !holds_empty_value(s, key, timeout_of(timeout_ms));
    const void *answer = absent_echo ? expected : resp->value.data;
    size_t alen = absent_echo ? elen : resp->value.len;
    void *copy = copy_bytes(answer, alen);
    if (swapped)
        *swapped = resp->swapped;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    if (!copy)
        return store_fail(s, PSHARD_ERR_NO_MEMORY, "store compare_set: out of memory");
    *current = copy;
    *clen = alen;
    return PSHARD_OK;
}

pshard_status_t pshard_store_wait(pshard_store_t *s, const char *const *keys, size_t n,
                                  int64_t timeout_ms)
{
    char err[PSHARD_ERRLEN] = "";
    store_begin(s);
    if (n > 0 && !keys)
        return store_fail(s, PSHARD_ERR_INVALID_ARGUMENT, "store wait: keys is NULL");
    for (size_t i = 0; i < n; i++) {
        pshard_status_t rc = check_key("store wait", keys[i], err, sizeof(err));
        if (rc != PSHARD_OK)
            return store_fail(s, rc, err);
    }
    int64_t t = timeout_of(timeout_ms);
    int64_t deadline = ps_now_ns() + t * 1000000;
    /* More keys than one StoreWait takes: wait for them a slice at a time, all against the
     * one deadline (every key must exist at the end either way). */
    for (size_t at = 0; at < n; at += WAIT_KEYS_MAX) {
        size_t m = n - at > WAIT_KEYS_MAX ? WAIT_KEYS_MAX : n - at;
        pshard_status_t rc = wait_keys(s, keys + at, m, deadline, NULL, err, sizeof(err));
        if (rc == PSHARD_ERR_TIMEOUT) {
            char why[PSHARD_ERRLEN];
            ps_strlcpy(why, err, sizeof(why));
            ps_errf(err, sizeof(err), rc,
                    "store wait for %zu key%s: not all set within %lld ms (%s)", n,
                    n == 1 ? "" : "s", (long long)t, why);
        }
        if (rc != PSHARD_OK)
            return store_fail(s, rc, err);
    }
    return PSHARD_OK;
}

pshard_status_t pshard_store_check(pshard_store_t *s, const char *const *keys, size_t n,
                                   bool *all_exist, int64_t timeout_ms)
{
    char err[PSHARD_ERRLEN] = "";
    store_begin(s);
    *all_exist = false;
    if (n > 0 && !keys)
        return store_fail(s, PSHARD_ERR_INVALID_ARGUMENT, "store check: keys is NULL");
    for (size_t i = 0; i < n; i++) {
        pshard_status_t rc = check_key("store check", keys[i], err, sizeof(err));
        if (rc != PSHARD_OK)
            return store_fail(s, rc, err);
    }
    int64_t deadline = ps_now_ns() + timeout_of(timeout_ms) * 1000000;
    for (size_t i = 0; i < n; i++) {
        int64_t left_ms = (deadline - ps_now_ns()) / 1000000;
        Pshard__StoreGetRequest req = PSHARD__STORE_GET_REQUEST__INIT;
        req.key = (char *)keys[i];
        /* The value comes along (GetRequest has no existence-only form); it is dropped. */
        pshard_status_t rc =
            ps_coord_rpc_store_get(s->ch, &req, NULL, left_ms > 0 ? left_ms : 1, err, sizeof(err));
        if (rc == PSHARD_ERR_NOT_FOUND)
            return PSHARD_OK; /* the key, or the whole job, is not there */
        if (rc != PSHARD_OK)
            return store_fail(s, rc, err);
    }
    *all_exist = true;
    return PSHARD_OK;
}

pshard_status_t pshard_store_delete(pshard_store_t *s, const char *key, bool *deleted,
                                    int64_t timeout_ms)
{
    char err[PSHARD_ERRLEN] = "";
    store_begin(s);
    if (deleted)
        *deleted = false;
    pshard_status_t rc = check_key("store delete", key, err, sizeof(err));
    if (rc != PSHARD_OK)
        return store_fail(s, rc, err);
    Pshard__StoreDeleteRequest req = PSHARD__STORE_DELETE_REQUEST__INIT;
    req.key = (char *)key;
    Pshard__StoreDeleteResponse *resp = NULL;
    rc = ps_coord_rpc_store_delete(s->ch, &req, &resp, timeout_of(timeout_ms), err, sizeof(err));
    if (rc != PSHARD_OK)
        return store_fail(s, rc, err);
    if (deleted)
        *deleted = resp->deleted;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return PSHARD_OK;
}

void pshard_store_free(void *value)
{
    free(value);
}
