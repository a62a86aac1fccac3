/* Small shared helpers: clocks, bounded formatting, integer parsing, natural ordering, a
 * constant-time comparison and port files. */
#include "pshard/util.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>

int64_t ps_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t ps_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

pshard_status_t ps_errf(char *err, size_t errlen, pshard_status_t status, const char *fmt, ...)
{
    if (err && errlen > 0 && err[0] == '\0') {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return status;
}

pshard_status_t ps_sys_err(char *err, size_t errlen, const char *what, const char *path)
{
    int e = errno;
    return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot %s %s: %s", what, path, strerror(e));
}

int ps_snprintf(char *buf, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, len, fmt, ap);
    va_end(ap);
    return (n < 0 || (size_t)n >= len) ? -1 : 0;
}

int ps_strlcpy(char *dst, const char *src, size_t len)
{
    if (len == 0)
        return -1;
    size_t n = strlen(src);
    if (n >= len) {
        memcpy(dst, src, len - 1);
        dst[len - 1] = '\0';
        return -1;
    }
    memcpy(dst, src, n + 1);
    return 0;
}

void ps_copy_printable(char *dst, size_t cap, const void *src, size_t n)
{
    const unsigned char *b = src;
    size_t k = n < cap - 1 ? n : cap - 1;
    for (size_t i = 0; i < k; i++)
        dst[i] = b[i] >= 0x20 && b[i] <= 0x7e ? (char)b[i] : '?';
    dst[k] = '\0';
}

int ps_parse_i64(const char *text, int64_t min, int64_t max, int64_t *out)
{
    if (!text || !*text || isspace((unsigned char)*text))
        return -1;
    errno = 0;
    char *end = NULL;
    long long v = strtoll(text, &end, 10);
    if (errno != 0 || !end || *end != '\0' || v < min || v > max)
        return -1;
    *out = (int64_t)v;
    return 0;
}

int ps_natural_cmp(const char *a, const char *b)
{
    while (*a && *b) {
        if (isdigit((unsigned char)*a) && isdigit((unsigned char)*b)) {
            /* Compare digit runs by value: skip leading zeros, then longer run wins, then
             * lexicographic order of equal-length runs. */
            while (*a == '0')
                a++;
            while (*b == '0')
                b++;
            size_t la = 0, lb = 0;
            while (isdigit((unsigned char)a[la]))
                la++;
            while (isdigit((unsigned char)b[lb]))
                lb++;
            if (la != lb)
                return la < lb ? -1 : 1;
            int c = memcmp(a, b, la);
            if (c != 0)
                return c < 0 ? -1 : 1;
            a += la;
            b += lb;
            continue;
        }
        if (*a != *b)
            return (unsigned char)*a < (unsigned char)*b ? -1 : 1;
        a++;
        b++;
    }
    if (*a == *b)
        return 0;
    return *a ? 1 : -1;
}

int ps_const_time_eq(const void *a, size_t alen, const void *b, size_t blen)
{
    const unsigned char *pa = a, *pb = b;
    unsigned char diff = (unsigned char)(alen != blen);
    size_t n = alen < blen ? alen : blen;
    for (size_t i = 0; i < n; i++)
        diff |= pa[i] ^ pb[i];
    return diff == 0;
}

void ps_default_coordinator(char *buf, size_t len)
{
    const char *addr = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT");
    snprintf(buf, len, "%s:%s", addr && *addr ? addr : "127.0.0.1", port && *port ? port : "29500");
}

char *ps_read_file(const char *path, bool strip, size_t max_bytes, size_t *len, char *err,
                   size_t errlen)
{
    /* O_NONBLOCK, then S_ISREG: a FIFO or device given as a token or TLS file is refused
     * instead of blocking the process at start. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) {
        ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    int fl = fcntl(fd, F_GETFL);
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || fl < 0 ||
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s is not a regular file", path);
        close(fd);
        return NULL;
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot open %s: %s", path, strerror(errno));
        close(fd);
        return NULL;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        if (n == cap) {
            if (cap >= max_bytes) {
                ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s is larger than %zu bytes",
                        path, max_bytes);
                free(buf);
                buf = NULL;
                break;
            }
            cap = cap * 2 > max_bytes ? max_bytes : cap * 2;
            char *p = realloc(buf, cap + 1);
            if (!p) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = p;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0) {
            if (ferror(f)) {
                ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot read %s", path);
                free(buf);
                buf = NULL;
            }
            break;
        }
    }
    fclose(f);
    if (!buf) {
        ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "cannot read %s", path);
        return NULL;
    }
    if (strip) {
        while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' '))
            n--;
    }
    buf[n] = '\0';
    if (len)
        *len = n;
    return buf;
}
