/* Small helpers every component uses: monotonic time, bounded string formatting into a
 * caller's error buffer (first error wins), and the check macros of STYLE.md. */
#ifndef PSHARD_UTIL_H
#define PSHARD_UTIL_H

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pshard/status.h"

/* Monotonic clock in nanoseconds (CLOCK_MONOTONIC). Thread-safe. */
int64_t ps_now_ns(void);

/* Wall clock in milliseconds since the epoch. Thread-safe. */
int64_t ps_wall_ms(void);

/* Formats into err (capacity errlen) only if err is non-NULL, errlen > 0 and err is still
 * empty, so the first error recorded is the one kept. Always NUL-terminates. Returns status
 * unchanged so call sites can write `return ps_errf(err, n, PSHARD_ERR_..., "...")`. */
pshard_status_t ps_errf(char *err, size_t errlen, pshard_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* "cannot WHAT PATH: strerror(errno)" into err as ps_errf does; returns PSHARD_ERR_SYSTEM. */
pshard_status_t ps_sys_err(char *err, size_t errlen, const char *what, const char *path);

/* snprintf that reports truncation: returns 0 on success, -1 if the output did not fit. */
int ps_snprintf(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Copies src into dst (capacity len) and always NUL-terminates; returns -1 on truncation. */
int ps_strlcpy(char *dst, const char *src, size_t len);

/* Copies n bytes of src (text from the wire or another process) into dst (capacity cap >= 1),
 * each byte that is not printable ASCII (a NUL too) replaced by '?', truncated to cap - 1;
 * always NUL-terminates. */
void ps_copy_printable(char *dst, size_t cap, const void *src, size_t n);

/* Parses a whole string as a base-10 integer within [min, max]; returns 0 or -1. */
int ps_parse_i64(const char *text, int64_t min, int64_t max, int64_t *out);

/* Natural-order comparison ("node-2" < "node-10"), used for stable rank assignment. */
int ps_natural_cmp(const char *a, const char *b);

/* The coordinator address torch.distributed's environment implies: MASTER_ADDR:MASTER_PORT,
 * each defaulting to 127.0.0.1 and 29500. Writes into buf. */
void ps_default_coordinator(char *buf, size_t len);

/* Compares two byte strings in time independent of where they differ (for tokens). */
int ps_const_time_eq(const void *a, size_t alen, const void *b, size_t blen);

#define PS_CHECK(expr)                                                                             \
    do {                                                                                           \
        pshard_status_t ps_check_rc_ = (expr);                                                     \
        if (ps_check_rc_ != PSHARD_OK)                                                             \
            return ps_check_rc_;                                                                   \
    } while (0)

#define PS_CHECK_GOTO(expr, rc_var, label)                                                         \
    do {                                                                                           \
        (rc_var) = (expr);                                                                         \
        if ((rc_var) != PSHARD_OK)                                                                 \
            goto label;                                                                            \
    } while (0)

/* Retries a system call on EINTR; leaves the result in rc_var (-1 and errno on failure). */
#define SYS_CHECK(call, rc_var)                                                                    \
    do {                                                                                           \
        (rc_var) = (call);                                                                         \
    } while ((rc_var) == -1 && errno == EINTR)

#define PS_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* Reads a whole small regular file (TLS material, tokens: a FIFO or device is refused, not
 * waited on) into a malloc'd NUL-terminated buffer of at most max_bytes, freed with free().
 * Trailing newlines are stripped when strip is true. NULL with a message naming the path. */
char *ps_read_file(const char *path, bool strip, size_t max_bytes, size_t *len, char *err,
                   size_t errlen);

#endif
