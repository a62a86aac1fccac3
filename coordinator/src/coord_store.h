/* The coordinator's key/value store (the role of torch's TCPStore): set, get, compare-and-set,
 * add, and waiters that fire when all of their keys exist or their deadline passes. Pure logic
 * with an injected clock; waiters report through callbacks. Not thread-safe: the service holds
 * its mutex around every call, and callbacks run under it. */
#ifndef PSHARD_COORD_STORE_H
#define PSHARD_COORD_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "pshard/status.h"

#define COORD_STORE_KEY_MAX 1024             /* bytes in a key */
#define COORD_STORE_VALUE_MAX (1024 * 1024)  /* bytes in a value (1 MiB) */
#define COORD_STORE_MAX_KEYS 65536           /* keys in the store */
#define COORD_STORE_MAX_BYTES (256ull << 20) /* keys + values in the store */
#define COORD_STORE_WAIT_KEYS_MAX 1024       /* keys in one wait */
#define COORD_STORE_MAX_WAITERS 16384        /* pending waits */

typedef struct coord_store coord_store_t;

/* Keys and bytes that several stores share one limit for (COORD_STORE_MAX_KEYS and
 * COORD_STORE_MAX_BYTES): a coordinator gives each job a store, and all of them together stay
 * within the limits. */
typedef struct {
    size_t keys;
    uint64_t bytes;
} coord_store_usage_t;

/* Outcome of a wait, delivered exactly once per waiter. On PSHARD_OK, values[i]/lens[i] are the
 * current values of the waited keys in request order; they point into the store and are valid
 * only during the callback. On PSHARD_ERR_TIMEOUT, values is NULL and missing names the first
 * key still absent. On PSHARD_ERR_CANCELLED (coord_store_cancel_wait, or store destroyed),
 * values and missing are NULL. */
typedef void (*coord_store_wait_fn)(void *arg, pshard_status_t status, const uint8_t *const *values,
                                    const size_t *lens, size_t nkeys, const char *missing);

/* Creates an empty store; NULL when out of memory. */
coord_store_t *coord_store_create(void);

/* The same, counting its keys and bytes in *usage (which must outlive the store) against the
 * limits shared with every other store made with it. Destroying the store gives them back. */
coord_store_t *coord_store_create_shared(coord_store_usage_t *usage);

/* Cancels every pending waiter (callback with PSHARD_ERR_CANCELLED) and frees the store. NULL
 * is a no-op. */
void coord_store_destroy(coord_store_t *store);

/* Key rules everywhere: 1..COORD_STORE_KEY_MAX bytes, no NUL. Errors say which rule broke. */

/* Sets key to value (len <= COORD_STORE_VALUE_MAX, copied) and fires any waiters now
 * satisfied. Errors: INVALID_ARGUMENT (bad key, value too large, message gives the sizes),
 * RESOURCE_EXHAUSTED (too many keys or bytes in the store). */
pshard_status_t coord_store_set(coord_store_t *store, const char *key, const uint8_t *value,
                                size_t len, char *err, size_t errlen);

/* Looks key up. On PSHARD_OK *value points into the store (valid until the next modifying
 * call) and *len is its size. Errors: NOT_FOUND, INVALID_ARGUMENT. */
pshard_status_t coord_store_get(const coord_store_t *store, const char *key, const uint8_t **value,
                                size_t *len, char *err, size_t errlen);

/* torch's compare_set: if key is absent and expected_len == 0, or the current value equals
 * expected, the value becomes desired and *swapped = 1; otherwise nothing changes and
 * *swapped = 0. Either way *value and *len then point at the current value (into the store).
 * Errors as coord_store_set. */
pshard_status_t coord_store_compare_set(coord_store_t *store, const char *key,
                                        const uint8_t *expected, size_t expected_len,
                                        const uint8_t *desired, size_t desired_len, int *swapped,
                                        const uint8_t **value, size_t *len, char *err,
                                        size_t errlen);

/* torch's add: treats the value as a base-10 int64 text ("0" when absent), adds delta, stores
 * the result as text and returns it in *result. Errors: INVALID_ARGUMENT when the current value
 * is not an integer, or on overflow (message says which). Fires satisfied waiters. */
pshard_status_t coord_store_add(coord_store_t *store, const char *key, int64_t delta,
                                int64_t *result, char *err, size_t errlen);

/* Deletes key (torch's delete_key). Returns PSHARD_OK or NOT_FOUND. */
pshard_status_t coord_store_delete(coord_store_t *store, const char *key, char *err, size_t errlen);

/* Waits for every key in keys[0..nkeys) (1..COORD_STORE_WAIT_KEYS_MAX keys). If all exist now,
 * the callback runs before this returns. Otherwise it runs later from coord_store_set / add /
 * compare_set (all present) or coord_store_tick (deadline_ns passed). Keys are copied.
 * *wait_id (may be NULL) receives an id for coord_store_cancel_wait. Errors (callback NOT
 * called): INVALID_ARGUMENT, RESOURCE_EXHAUSTED (too many waiters). */
pshard_status_t coord_store_wait(coord_store_t *store, const char *const *keys, size_t nkeys,
                                 int64_t deadline_ns, coord_store_wait_fn fn, void *arg,
                                 uint64_t *wait_id, char *err, size_t errlen);

/* Cancels a pending waiter: its callback runs with PSHARD_ERR_CANCELLED before this returns.
 * Returns NOT_FOUND when it already completed. */
pshard_status_t coord_store_cancel_wait(coord_store_t *store, uint64_t wait_id);

/* Times out waiters whose deadline passed (callback with PSHARD_ERR_TIMEOUT). Returns how many. */
int coord_store_tick(coord_store_t *store, int64_t now_ns);

/* Earliest waiter deadline, or INT64_MAX with none pending. */
int64_t coord_store_next_deadline_ns(const coord_store_t *store);

/* Counts for status output. */
size_t coord_store_num_keys(const coord_store_t *store);
size_t coord_store_num_waiters(const coord_store_t *store);

#endif
