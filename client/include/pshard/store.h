/* libpshard's store client: torch.distributed's Store (set, get that waits, add, compare_set,
 * wait, check, delete_key) over the coordinator's job-scoped key/value store. A handle stands
 * alone (no pshard_client_t), because torch makes its store before its process group.
 *
 * Limits are the coordinator's: a key is 1..PSHARD_STORE_KEY_MAX bytes of text, a value at most
 * PSHARD_STORE_VALUE_MAX bytes; add works on values that are base-10 int64 text (what add
 * itself writes).
 *
 * Thread safety: every function may be called from any number of threads at once on the same
 * handle, except pshard_store_close, which must be the handle's last call. Each thread sees the
 * message of its own last failed call (pshard_store_last_error). */
#ifndef PSHARD_STORE_H
#define PSHARD_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pshard/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifndef PSHARD_API
#if defined(PSHARD_BUILDING_LIBRARY)
#define PSHARD_API __attribute__((visibility("default")))
#else
#define PSHARD_API
#endif
#endif

#define PSHARD_STORE_KEY_MAX 1024                  /* bytes in a key (the coordinator's limit) */
#define PSHARD_STORE_VALUE_MAX (1024 * 1024)       /* bytes in a value (1 MiB) */
#define PSHARD_STORE_DEFAULT_TIMEOUT_MS (300000LL) /* timeout_ms <= 0: torch's default, 5 min */

typedef struct pshard_store pshard_store_t;

/* Opens a store on the coordinator at "HOST:PORT" for job (NULL or "": the coordinator's
 * default job). token NULL reads PSHARD_TOKEN_FILE when it is set, "" sends none;
 * PSHARD_COORDINATOR_CA, when set, names the PEM CA for TLS. The connection is made by the
 * first call, which waits for it up to its timeout. On PSHARD_OK *out is the handle (free with
 * pshard_store_close); otherwise *out is NULL and err (errlen bytes, may be NULL) says why:
 * INVALID_ARGUMENT for a malformed address or an unreadable token file. Strings are copied. */
PSHARD_API pshard_status_t pshard_store_open(const char *coordinator, const char *job,
                                             const char *token, pshard_store_t **out, char *err,
                                             size_t errlen);

/* Closes the handle; calls still in flight on other threads are not allowed. NULL is a no-op. */
PSHARD_API void pshard_store_close(pshard_store_t *s);

/* The message of the calling thread's last failed call on s ("" when it has none). Valid until
 * this thread's next call on any store. */
PSHARD_API const char *pshard_store_last_error(const pshard_store_t *s);

/* Sets key to a copy of value[0..len). Every call below takes timeout_ms (<= 0:
 * PSHARD_STORE_DEFAULT_TIMEOUT_MS): the most it waits, for the coordinator and, where it says
 * so, for keys. Errors: INVALID_ARGUMENT (empty or over-long key, value over the limit),
 * RESOURCE_EXHAUSTED (the coordinator's store is full), TIMEOUT, UNAVAILABLE, UNAUTHENTICATED. */
PSHARD_API pshard_status_t pshard_store_set(pshard_store_t *s, const char *key, const void *value,
                                            size_t len, int64_t timeout_ms);

/* Waits up to timeout_ms for key to be set, then returns its value as torch's Store.get does:
 * *value malloc'd (NUL-terminated one past *len, for text; free with pshard_store_free), *len
 * its length. TIMEOUT, naming the key, when it was not set in time; on any error *value is NULL
 * and *len 0. */
PSHARD_API pshard_status_t pshard_store_get(pshard_store_t *s, const char *key, void **value,
                                            size_t *len, int64_t timeout_ms);

/* Adds delta to the integer at key (absent: 0, so add creates the key) and stores the sum as
 * base-10 text; *result (may be NULL) is the new value. INVALID_ARGUMENT when the value there is
 * not an integer or the sum overflows int64. Not retried: a lost reply may have added. */
PSHARD_API pshard_status_t pshard_store_add(pshard_store_t *s, const char *key, int64_t delta,
                                            int64_t *result, int64_t timeout_ms);

/* torch's compare_set: when key holds exactly expected, or is absent and expected is empty
 * (elen 0), key is set to desired. *current (malloc'd as in pshard_store_get, free with
 * pshard_store_free) is what torch's TCPStore returns: the value now stored; for an absent key
 * with a non-empty expected, nothing is stored and *current is a copy of expected (TCPStore's
 * answer). *swapped (may be NULL) tells whether desired was stored. Not retried. */
PSHARD_API pshard_status_t pshard_store_compare_set(pshard_store_t *s, const char *key,
                                                    const void *expected, size_t elen,
                                                    const void *desired, size_t dlen,
                                                    void **current, size_t *clen, bool *swapped,
                                                    int64_t timeout_ms);

/* Waits up to timeout_ms until every one of keys[0..n) is set (n 0: returns at once). TIMEOUT
 * naming a key still absent. */
PSHARD_API pshard_status_t pshard_store_wait(pshard_store_t *s, const char *const *keys, size_t n,
                                             int64_t timeout_ms);

/* *all_exist tells whether every one of keys[0..n) is set now (true for n 0); it never waits
 * for keys. */
PSHARD_API pshard_status_t pshard_store_check(pshard_store_t *s, const char *const *keys, size_t n,
                                              bool *all_exist, int64_t timeout_ms);

/* Deletes key; *deleted (may be NULL) is false when it was not set (no error then). */
PSHARD_API pshard_status_t pshard_store_delete(pshard_store_t *s, const char *key, bool *deleted,
                                               int64_t timeout_ms);

/* Frees a value pshard_store_get or pshard_store_compare_set returned. NULL is a no-op. */
PSHARD_API void pshard_store_free(void *value);

#ifdef __cplusplus
}
#endif

#endif
