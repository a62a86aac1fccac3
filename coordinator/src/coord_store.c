/* The coordinator's key/value store: an open-addressing hash table of copied keys and values,
 * with waiters kept in id order that fire exactly once (all keys present, deadline, cancel or
 * destroy). Callbacks run synchronously and must not call back into the store. */
#include "coord_store.h"

#include <stdbool.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/util.h"

/* Longest key echoed into an error message; longer ones are cut with "...". */
#define KEY_ECHO_MAX 128
/* Longest integer text add() accepts: sign, 19 digits, and generous room for leading zeros. */
#define INT_TEXT_MAX 64

typedef struct {
    char *key;
    size_t key_len;
    uint64_t hash;
    uint8_t *value; /* never NULL, even for an empty value */
    size_t len;
} entry_t;

typedef struct waiter {
    uint64_t id;
    int64_t deadline_ns;
    coord_store_wait_fn fn;
    void *arg;
    size_t nkeys;
    char **keys;            /* copies, in request order */
    uint64_t *hashes;       /* hash of each key, so most non-matching keys skip the strcmp */
    const uint8_t **values; /* filled just before a successful callback */
    size_t *lens;
    struct waiter *next_ready; /* link in a list of waiters about to fire */
} waiter_t;

struct coord_store {
    /* Linear probing with backward-shift deletion; capacity a power of two, load <= 1/2. */
    entry_t **table;
    size_t cap;
    size_t nkeys;
    uint64_t bytes; /* sum of key and value lengths */
    coord_store_usage_t own;
    coord_store_usage_t *use; /* &own, or the usage shared with other stores */

    waiter_t **waiters; /* pending, sorted by id (ids only grow, so appending keeps order) */
    size_t nwaiters, waiters_cap;
    uint64_t next_wait_id;
};

/* ---- hashing and lookup ----------------------------------------------------------------- */

/* FNV-1a: keys are bounded in number and length, so a hostile key set can at worst make
 * probes linear in COORD_STORE_MAX_KEYS. */
static uint64_t hash_key(const char *key, size_t len)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)key[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* Returns the slot holding key, or the empty slot where it would go. */
static size_t probe(const coord_store_t *store, const char *key, size_t len, uint64_t hash)
{
    size_t mask = store->cap - 1;
    size_t pos = (size_t)hash & mask;
    for (;;) {
        const entry_t *e = store->table[pos];
        if (!e || (e->hash == hash && e->key_len == len && memcmp(e->key, key, len) == 0))
            return pos;
        pos = (pos + 1) & mask;
    }
}

static entry_t *lookup(const coord_store_t *store, const char *key, size_t len, uint64_t hash)
{
    return store->table[probe(store, key, len, hash)];
}

static pshard_status_t grow_table(coord_store_t *store)
{
    size_t cap = store->cap * 2;
    entry_t **table = calloc(cap, sizeof(*table));
    if (!table)
        return PSHARD_ERR_NO_MEMORY;
    entry_t **old = store->table;
    size_t old_cap = store->cap;
    store->table = table;
    store->cap = cap;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i])
            table[probe(store, old[i]->key, old[i]->key_len, old[i]->hash)] = old[i];
    free(old);
    return PSHARD_OK;
}

static void remove_slot(coord_store_t *store, size_t hole)
{
    size_t mask = store->cap - 1;
    store->table[hole] = NULL;
    size_t pos = (hole + 1) & mask;
    while (store->table[pos]) {
        size_t home = (size_t)store->table[pos]->hash & mask;
        /* The entry may fill the hole unless its home lies cyclically in (hole, pos]. */
        bool stays = hole <= pos ? (home > hole && home <= pos) : (home > hole || home <= pos);
        if (!stays) {
            store->table[hole] = store->table[pos];
            store->table[pos] = NULL;
            hole = pos;
        }
        pos = (pos + 1) & mask;
    }
}

static void free_entry(entry_t *e)
{
    if (!e)
        return;
    free(e->key);
    free(e->value);
    free(e);
}

/* ---- validation ------------------------------------------------------------------------- */

/* Checks one key; what names the argument in messages ("key", "keys[3]"). On success *len is
 * the key's length. */
static pshard_status_t check_key(const char *what, const char *key, size_t *len, char *err,
                                 size_t errlen)
{
    if (!key)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s is missing", what);
    size_t n = strlen(key);
    if (n == 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s is empty", what);
    if (n > COORD_STORE_KEY_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s is %zu bytes; the limit is %d",
                       what, n, COORD_STORE_KEY_MAX);
    *len = n;
    return PSHARD_OK;
}

static pshard_status_t check_value(const char *what, const uint8_t *value, size_t len, char *err,
                                   size_t errlen)
{
    if (len > COORD_STORE_VALUE_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s is %zu bytes; the limit is %d",
                       what, len, COORD_STORE_VALUE_MAX);
    if (!value && len > 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s is NULL but %zu bytes long",
                       what, len);
    return PSHARD_OK;
}

/* Prints at most KEY_ECHO_MAX bytes of a key, for messages. */
#define KEY_FMT "\"%.*s%s\""
#define KEY_ARGS(key, len)                                                                         \
    (int)((len) > KEY_ECHO_MAX ? KEY_ECHO_MAX : (len)), (key), ((len) > KEY_ECHO_MAX ? "..." : "")

/* ---- waiters ---------------------------------------------------------------------------- */

static void free_waiter(waiter_t *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->nkeys; i++)
        free(w->keys[i]);
    free(w->keys);
    free(w->hashes);
    free(w->values);
    free(w->lens);
    free(w);
}

/* Fills w->values/lens from the store; returns the index of the first absent key, or nkeys
 * when every key is present. */
static size_t resolve_waiter(const coord_store_t *store, waiter_t *w)
{
    for (size_t i = 0; i < w->nkeys; i++) {
        const entry_t *e = lookup(store, w->keys[i], strlen(w->keys[i]), w->hashes[i]);
        if (!e)
            return i;
        w->values[i] = e->value;
        w->lens[i] = e->len;
    }
    return w->nkeys;
}

static bool waiter_has_key(const waiter_t *w, const char *key, uint64_t hash)
{
    for (size_t i = 0; i < w->nkeys; i++)
        if (w->hashes[i] == hash && strcmp(w->keys[i], key) == 0)
            return true;
    return false;
}

/* Puts a waiter back into the pending array at its id's place. The array has room: the
 * waiter was taken out of it moments ago. */
static void reinsert_waiter(coord_store_t *store, waiter_t *w)
{
    size_t lo = 0, hi = store->nwaiters;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (store->waiters[mid]->id < w->id)
            lo = mid + 1;
        else
            hi = mid;
    }
    memmove(&store->waiters[lo + 1], &store->waiters[lo],
            (store->nwaiters - lo) * sizeof(*store->waiters));
    store->waiters[lo] = w;
    store->nwaiters++;
}

/* Delivers PSHARD_OK to every waiter on the list, in list (id) order, and frees them. The
 * values are looked up right before each callback; a waiter whose keys are no longer all
 * present (which only a misbehaving, re-entrant callback could cause) goes back to pending
 * rather than firing with missing values. */
static void fire_ready(coord_store_t *store, waiter_t *head)
{
    while (head) {
        waiter_t *w = head;
        head = w->next_ready;
        w->next_ready = NULL;
        if (resolve_waiter(store, w) < w->nkeys) {
            reinsert_waiter(store, w);
            continue;
        }
        w->fn(w->arg, PSHARD_OK, w->values, w->lens, w->nkeys, NULL);
        free_waiter(w);
    }
}

/* After key was created: takes every pending waiter that names it and now has all its keys
 * out of the pending array (one pass, order kept), then fires them. */
static void notify_created(coord_store_t *store, const char *key, uint64_t hash)
{
    waiter_t *head = NULL, **tail = &head;
    size_t kept = 0;
    for (size_t i = 0; i < store->nwaiters; i++) {
        waiter_t *w = store->waiters[i];
        if (waiter_has_key(w, key, hash) && resolve_waiter(store, w) == w->nkeys) {
            *tail = w;
            tail = &w->next_ready;
        } else {
            store->waiters[kept++] = w;
        }
    }
    *tail = NULL;
    store->nwaiters = kept;
    fire_ready(store, head);
}

/* Finds a pending waiter's position by id, or returns -1. */
static long find_waiter(const coord_store_t *store, uint64_t id)
{
    size_t lo = 0, hi = store->nwaiters;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        uint64_t mid_id = store->waiters[mid]->id;
        if (mid_id == id)
            return (long)mid;
        if (mid_id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1;
}

/* ---- writing ---------------------------------------------------------------------------- */

/* Stores a copy of value under key (already validated, klen its length), creating the entry
 * if needed, and fires waiters the creation satisfied. *out (may be NULL) gets the entry. */
/* A store that is full is an error for the caller to act on, never one to retry. */
static pshard_status_t full(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static pshard_status_t full(char *err, size_t errlen, const char *fmt, ...)
{
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    return ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                   "the coordinator's store is full: it %s; delete keys that are no longer "
                   "needed (StoreDelete, torch's delete_key) or let finished jobs end (their "
                   "keys go with them)",
                   what);
}

static pshard_status_t put(coord_store_t *store, const char *key, size_t klen, uint64_t hash,
                           const uint8_t *value, size_t len, entry_t **out, char *err,
                           size_t errlen)
{
    PS_CHECK(check_value("value", value, len, err, errlen));
    uint8_t *copy = malloc(len ? len : 1);
    if (!copy)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory storing %zu bytes", len);
    if (len)
        memcpy(copy, value, len);

    size_t pos = probe(store, key, klen, hash);
    entry_t *e = store->table[pos];
    if (e) {
        uint64_t total = store->use->bytes - e->len + len;
        if (total > COORD_STORE_MAX_BYTES) {
            free(copy);
            return full(err, errlen, "would hold %llu bytes; the limit is %llu",
                        (unsigned long long)total, (unsigned long long)COORD_STORE_MAX_BYTES);
        }
        free(e->value);
        e->value = copy;
        store->bytes = store->bytes - e->len + len;
        store->use->bytes = total;
        e->len = len;
        if (out)
            *out = e;
        return PSHARD_OK; /* the key existed already, so no waiter can newly be satisfied */
    }

    pshard_status_t rc = PSHARD_OK;
    uint64_t total = store->use->bytes + klen + len;
    if (store->use->keys >= COORD_STORE_MAX_KEYS) {
        rc = full(err, errlen, "holds %zu keys; the limit is %d", store->use->keys,
                  COORD_STORE_MAX_KEYS);
        goto fail;
    }
    if (total > COORD_STORE_MAX_BYTES) {
        rc = full(err, errlen, "would hold %llu bytes; the limit is %llu",
                  (unsigned long long)total, (unsigned long long)COORD_STORE_MAX_BYTES);
        goto fail;
    }
    if ((store->nkeys + 1) * 2 > store->cap) {
        if (grow_table(store) != PSHARD_OK) {
            rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory growing the store");
            goto fail;
        }
        pos = probe(store, key, klen, hash);
    }
    e = calloc(1, sizeof(*e));
    char *kcopy = malloc(klen + 1);
    if (!e || !kcopy) {
        free(e);
        free(kcopy);
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory storing a key");
        goto fail;
    }
    memcpy(kcopy, key, klen + 1);
    e->key = kcopy;
    e->key_len = klen;
    e->hash = hash;
    e->value = copy;
    e->len = len;
    store->table[pos] = e;
    store->nkeys++;
    store->bytes += klen + len;
    store->use->keys++;
    store->use->bytes = total;
    if (out)
        *out = e;
    notify_created(store, key, hash);
    return PSHARD_OK;

fail:
    free(copy);
    return rc;
}

/* ---- public API ------------------------------------------------------------------------- */

coord_store_t *coord_store_create(void)
{
    return coord_store_create_shared(NULL);
}

coord_store_t *coord_store_create_shared(coord_store_usage_t *usage)
{
    coord_store_t *store = calloc(1, sizeof(*store));
    if (!store)
        return NULL;
    store->use = usage ? usage : &store->own;
    store->cap = 64;
    store->table = calloc(store->cap, sizeof(*store->table));
    if (!store->table) {
        free(store);
        return NULL;
    }
    store->next_wait_id = 1;
    return store;
}

void coord_store_destroy(coord_store_t *store)
{
    if (!store)
        return;
    /* Detach the pending waiters first so the store looks empty of them while callbacks run. */
    waiter_t **pending = store->waiters;
    size_t npending = store->nwaiters;
    store->waiters = NULL;
    store->nwaiters = store->waiters_cap = 0;
    for (size_t i = 0; i < npending; i++) {
        pending[i]->fn(pending[i]->arg, PSHARD_ERR_CANCELLED, NULL, NULL, pending[i]->nkeys, NULL);
        free_waiter(pending[i]);
    }
    free(pending);
    for (size_t i = 0; i < store->cap; i++)
        free_entry(store->table[i]);
    store->use->keys -= store->nkeys;
    store->use->bytes -= store->bytes;
    free(store->table);
    free(store);
}

pshard_status_t coord_store_set(coord_store_t *store, const char *key, const uint8_t *value,
                                size_t len, char *err, size_t errlen)
{
    size_t klen = 0;
    PS_CHECK(check_key("key", key, &klen, err, errlen));
    return put(store, key, klen, hash_key(key, klen), value, len, NULL, err, errlen);
}

pshard_status_t coord_store_get(const coord_store_t *store, const char *key, const uint8_t **value,
                                size_t *len, char *err, size_t errlen)
{
    size_t klen = 0;
    PS_CHECK(check_key("key", key, &klen, err, errlen));
    const entry_t *e = lookup(store, key, klen, hash_key(key, klen));
    if (!e)
        return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "key " KEY_FMT " is not set",
                       KEY_ARGS(key, klen));
    if (value)
        *value = e->value;
    if (len)
        *len = e->len;
    return PSHARD_OK;
}

/* Like torch's TCPStore, except for one case: where torch answers an absent key with a
 * non-empty expected value by echoing expected back, this reports the truth: *swapped = 0,
 * *value = NULL and *len = 0 (there is no current value). */
pshard_status_t coord_store_compare_set(coord_store_t *store, const char *key,
                                        const uint8_t *expected, size_t expected_len,
                                        const uint8_t *desired, size_t desired_len, int *swapped,
                                        const uint8_t **value, size_t *len, char *err,
                                        size_t errlen)
{
    size_t klen = 0;
    PS_CHECK(check_key("key", key, &klen, err, errlen));
    PS_CHECK(check_value("expected value", expected, expected_len, err, errlen));
    PS_CHECK(check_value("desired value", desired, desired_len, err, errlen));
    uint64_t hash = hash_key(key, klen);
    entry_t *e = lookup(store, key, klen, hash);
    bool swap = e ? (e->len == expected_len &&
                     (expected_len == 0 || memcmp(e->value, expected, expected_len) == 0))
                  : expected_len == 0;
    if (swap)
        PS_CHECK(put(store, key, klen, hash, desired, desired_len, &e, err, errlen));
    if (swapped)
        *swapped = swap ? 1 : 0;
    if (value)
        *value = e ? e->value : NULL;
    if (len)
        *len = e ? e->len : 0;
    return PSHARD_OK;
}

pshard_status_t coord_store_add(coord_store_t *store, const char *key, int64_t delta,
                                int64_t *result, char *err, size_t errlen)
{
    size_t klen = 0;
    PS_CHECK(check_key("key", key, &klen, err, errlen));
    uint64_t hash = hash_key(key, klen);
    const entry_t *e = lookup(store, key, klen, hash);
    int64_t current = 0;
    if (e) {
        char text[INT_TEXT_MAX + 1];
        bool ok = e->len > 0 && e->len <= INT_TEXT_MAX && !memchr(e->value, '\0', e->len);
        if (ok) {
            memcpy(text, e->value, e->len);
            text[e->len] = '\0';
            ok = ps_parse_i64(text, INT64_MIN, INT64_MAX, &current) == 0;
            if (!ok) {
                /* Tell "too big" apart from "not a number". */
                size_t i = (text[0] == '-' || text[0] == '+') ? 1 : 0;
                bool digits = text[i] != '\0';
                for (; text[i]; i++)
                    digits = digits && text[i] >= '0' && text[i] <= '9';
                if (digits)
                    return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                                   "the value of key " KEY_FMT " (%s) is outside the int64 range",
                                   KEY_ARGS(key, klen), text);
            }
        }
        if (!ok)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "the value of key " KEY_FMT
                           " is not a base-10 integer (%zu bytes), so add cannot apply",
                           KEY_ARGS(key, klen), e->len);
    }
    if ((delta > 0 && current > INT64_MAX - delta) || (delta < 0 && current < INT64_MIN - delta))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "adding %lld to %lld (key " KEY_FMT ") overflows int64", (long long)delta,
                       (long long)current, KEY_ARGS(key, klen));
    int64_t sum = current + delta;
    char out[32];
    ps_snprintf(out, sizeof(out), "%lld", (long long)sum);
    PS_CHECK(put(store, key, klen, hash, (const uint8_t *)out, strlen(out), NULL, err, errlen));
    if (result)
        *result = sum;
    return PSHARD_OK;
}

pshard_status_t coord_store_delete(coord_store_t *store, const char *key, char *err, size_t errlen)
{
    size_t klen = 0;
    PS_CHECK(check_key("key", key, &klen, err, errlen));
    size_t pos = probe(store, key, klen, hash_key(key, klen));
    entry_t *e = store->table[pos];
    if (!e)
        return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "key " KEY_FMT " is not set",
                       KEY_ARGS(key, klen));
    store->bytes -= e->key_len + e->len;
    store->nkeys--;
    store->use->bytes -= e->key_len + e->len;
    store->use->keys--;
    remove_slot(store, pos);
    free_entry(e);
    return PSHARD_OK;
}

pshard_status_t coord_store_wait(coord_store_t *store, const char *const *keys, size_t nkeys,
                                 int64_t deadline_ns, coord_store_wait_fn fn, void *arg,
                                 uint64_t *wait_id, char *err, size_t errlen)
{
    if (!fn)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "wait needs a callback");
    if (nkeys == 0 || !keys)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "wait needs at least one key");
    if (nkeys > COORD_STORE_WAIT_KEYS_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "wait names %zu keys; the limit is %d", nkeys, COORD_STORE_WAIT_KEYS_MAX);
    for (size_t i = 0; i < nkeys; i++) {
        char what[32];
        size_t klen;
        ps_snprintf(what, sizeof(what), "keys[%zu]", i);
        PS_CHECK(check_key(what, keys[i], &klen, err, errlen));
    }

    waiter_t *w = calloc(1, sizeof(*w));
    if (!w)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory for a wait");
    w->keys = calloc(nkeys, sizeof(*w->keys));
    w->hashes = calloc(nkeys, sizeof(*w->hashes));
    w->values = calloc(nkeys, sizeof(*w->values));
    w->lens = calloc(nkeys, sizeof(*w->lens));
    if (!w->keys || !w->hashes || !w->values || !w->lens) {
        free_waiter(w);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory for a wait");
    }
    for (size_t i = 0; i < nkeys; i++) {
        size_t klen = strlen(keys[i]);
        w->keys[i] = malloc(klen + 1);
        if (!w->keys[i]) {
            w->nkeys = i;
            free_waiter(w);
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory for a wait");
        }
        memcpy(w->keys[i], keys[i], klen + 1);
        w->hashes[i] = hash_key(keys[i], klen);
    }
    w->nkeys = nkeys;
    w->deadline_ns = deadline_ns;
    w->fn = fn;
    w->arg = arg;

    if (resolve_waiter(store, w) == nkeys) {
        w->id = store->next_wait_id++;
        if (wait_id)
            *wait_id = w->id;
        fn(arg, PSHARD_OK, w->values, w->lens, nkeys, NULL);
        free_waiter(w);
        return PSHARD_OK;
    }
    if (store->nwaiters >= COORD_STORE_MAX_WAITERS) {
        free_waiter(w);
        return ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                       "%zu waits are pending; the limit is %d", store->nwaiters,
                       COORD_STORE_MAX_WAITERS);
    }
    if (store->nwaiters == store->waiters_cap) {
        size_t cap = store->waiters_cap ? store->waiters_cap * 2 : 16;
        waiter_t **grown = realloc(store->waiters, cap * sizeof(*grown));
        if (!grown) {
            free_waiter(w);
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory for a wait");
        }
        store->waiters = grown;
        store->waiters_cap = cap;
    }
    w->id = store->next_wait_id++;
    store->waiters[store->nwaiters++] = w;
    if (wait_id)
        *wait_id = w->id;
    return PSHARD_OK;
}

pshard_status_t coord_store_cancel_wait(coord_store_t *store, uint64_t wait_id)
{
    long pos = find_waiter(store, wait_id);
    if (pos < 0)
        return PSHARD_ERR_NOT_FOUND;
    waiter_t *w = store->waiters[pos];
    memmove(&store->waiters[pos], &store->waiters[pos + 1],
            (store->nwaiters - (size_t)pos - 1) * sizeof(*store->waiters));
    store->nwaiters--;
    w->fn(w->arg, PSHARD_ERR_CANCELLED, NULL, NULL, w->nkeys, NULL);
    free_waiter(w);
    return PSHARD_OK;
}

int coord_store_tick(coord_store_t *store, int64_t now_ns)
{
    waiter_t *head = NULL, **tail = &head;
    size_t kept = 0;
    for (size_t i = 0; i < store->nwaiters; i++) {
        waiter_t *w = store->waiters[i];
        if (now_ns >= w->deadline_ns) {
            *tail = w;
            tail = &w->next_ready;
        } else {
            store->waiters[kept++] = w;
        }
    }
    *tail = NULL;
    store->nwaiters = kept;
    int fired = 0;
    while (head) {
        waiter_t *w = head;
        head = w->next_ready;
        size_t missing = resolve_waiter(store, w);
        if (missing < w->nkeys)
            w->fn(w->arg, PSHARD_ERR_TIMEOUT, NULL, NULL, w->nkeys, w->keys[missing]);
        else /* every key arrived (cannot normally happen: it would have fired already) */
            w->fn(w->arg, PSHARD_OK, w->values, w->lens, w->nkeys, NULL);
        free_waiter(w);
        fired++;
    }
    return fired;
}

int64_t coord_store_next_deadline_ns(const coord_store_t *store)
{
    int64_t next = INT64_MAX;
    for (size_t i = 0; i < store->nwaiters; i++)
        if (store->waiters[i]->deadline_ns < next)
            next = store->waiters[i]->deadline_ns;
    return next;
}

size_t coord_store_num_keys(const coord_store_t *store)
{
    return store->nkeys;
}

size_t coord_store_num_waiters(const coord_store_t *store)
{
    return store->nwaiters;
}
