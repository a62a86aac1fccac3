/* Atomic whole-file writes (pshard/atomic_file.h): an O_EXCL temporary beside the final name,
 * synced, renamed into place, the directory synced; the temporary removed on any failure. The
 * port file a service writes once it listens is one of them. */
#include "pshard/atomic_file.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "pshard/util.h"

/* Attempts at a fresh temporary name before giving up (each collision is a file someone else
 * made with our random suffix: practically never more than one). */
#define TEMP_TRIES 64

pshard_status_t ps_write_all(int fd, const void *buf, size_t len, const char *shown, char *err,
                             size_t errlen)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            if (n == 0)
                errno = ENOSPC;
            return ps_sys_err(err, errlen, "write", shown);
        }
        p += n;
        len -= (size_t)n;
    }
    return PSHARD_OK;
}

static uint64_t temp_random(void)
{
    uint64_t r;
    if (getrandom(&r, sizeof(r), GRND_NONBLOCK) == (ssize_t)sizeof(r))
        return r;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    static _Atomic uint64_t counter;
    return ((uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)getpid() << 32) ^ ++counter;
}

pshard_status_t ps_atomic_file_open(int dfd, const char *name, const char *shown,
                                    ps_atomic_file_t *f, char *err, size_t errlen)
{
    memset(f, 0, sizeof(*f));
    f->fd = -1;
    f->dfd = dfd;
    if (ps_strlcpy(f->name, name, sizeof(f->name)) != 0 ||
        ps_strlcpy(f->shown, shown, sizeof(f->shown)) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "file name too long: %s", shown);
    for (int i = 0; i < TEMP_TRIES; i++) {
        ps_snprintf(f->tmp, sizeof(f->tmp), ".%s.tmp-%012" PRIx64, name,
                    (uint64_t)(temp_random() & 0xFFFFFFFFFFFFull));
        /* O_EXCL: never opens what is already there, a planted link included. */
        int fd = openat(dfd, f->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (fd >= 0) {
            f->fd = fd;
            return PSHARD_OK;
        }
        if (errno != EEXIST)
            return ps_sys_err(err, errlen, "create a temporary file for", shown);
    }
    return ps_errf(err, errlen, PSHARD_ERR_SYSTEM,
                   "cannot create a temporary file for %s: %d names taken", shown, TEMP_TRIES);
}

pshard_status_t ps_atomic_file_open_path(const char *path, ps_atomic_file_t *f, char *err,
                                         size_t errlen)
{
    memset(f, 0, sizeof(*f));
    f->fd = f->dfd = -1;
    char dir[PATH_MAX];
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    int too_long = !slash ? ps_snprintf(dir, sizeof(dir), ".")
                   : slash == path
                       ? ps_snprintf(dir, sizeof(dir), "/")
                       : ps_snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path), path);
    if (!*base || too_long)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s: not a file path (or too long)", path);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0)
        return ps_sys_err(err, errlen, "open the directory to write", path);
    pshard_status_t rc = ps_atomic_file_open(dfd, base, path, f, err, errlen);
    if (rc != PSHARD_OK) {
        close(dfd);
        f->dfd = -1;
        return rc;
    }
    f->own_dfd = true;
    return PSHARD_OK;
}

pshard_status_t ps_atomic_file_write(ps_atomic_file_t *f, const void *buf, size_t len, char *err,
                                     size_t errlen)
{
    return ps_write_all(f->fd, buf, len, f->shown, err, errlen);
}

pshard_status_t ps_atomic_file_commit(ps_atomic_file_t *f, bool ok, char *err, size_t errlen)
{
    if (f->fd < 0)
        return PSHARD_OK;
    pshard_status_t rc = PSHARD_OK;
    if (ok && fsync(f->fd) != 0)
        rc = ps_sys_err(err, errlen, "sync", f->shown);
    if (close(f->fd) != 0 && ok && rc == PSHARD_OK)
        rc = ps_sys_err(err, errlen, "write", f->shown);
    f->fd = -1;
    /* renameat replaces a link at the final name itself, never what it points to. */
    if (ok && rc == PSHARD_OK && renameat(f->dfd, f->tmp, f->dfd, f->name) != 0)
        rc = ps_sys_err(err, errlen, "rename a temporary file to", f->shown);
    if (!ok || rc != PSHARD_OK) {
        unlinkat(f->dfd, f->tmp, 0); /* ours: made with O_EXCL */
        if (!ok)
            rc = PSHARD_OK;
    } else if (fsync(f->dfd) != 0 && errno != EINVAL) {
        /* Some file systems cannot sync a directory (EINVAL); the rename is as durable as they
         * make it then. */
        rc = ps_sys_err(err, errlen, "sync the directory of", f->shown);
    }
    if (f->own_dfd)
        close(f->dfd);
    f->own_dfd = false;
    return rc;
}

pshard_status_t ps_atomic_file_put(int dfd, const char *name, const char *shown, const void *data,
                                   size_t len, char *err, size_t errlen)
{
    ps_atomic_file_t f;
    PS_CHECK(ps_atomic_file_open(dfd, name, shown, &f, err, errlen));
    pshard_status_t rc = ps_atomic_file_write(&f, data, len, err, errlen);
    pshard_status_t rc2 = ps_atomic_file_commit(&f, rc == PSHARD_OK, err, errlen);
    return rc != PSHARD_OK ? rc : rc2;
}

pshard_status_t ps_write_port_file(const char *path, int port, char *err, size_t errlen)
{
    char text[16];
    int len = snprintf(text, sizeof(text), "%d\n", port);
    ps_atomic_file_t f;
    PS_CHECK(ps_atomic_file_open_path(path, &f, err, errlen));
    pshard_status_t rc = ps_atomic_file_write(&f, text, (size_t)len, err, errlen);
    pshard_status_t rc2 = ps_atomic_file_commit(&f, rc == PSHARD_OK, err, errlen);
    return rc != PSHARD_OK ? rc : rc2;
}

int ps_announce_listening(const char *prog, const char *listen, int port, const char *port_file)
{
    char err[PATH_MAX + 128] = "";
    if (port_file && ps_write_port_file(port_file, port, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "%s: --port-file: %s\n", prog, err);
        return -1;
    }
    char host[256];
    ps_strlcpy(host, listen, sizeof(host));
    char *colon = strrchr(host, ':');
    if (colon)
        *colon = '\0';
    printf("listening on %s:%d\n", host, port);
    fflush(stdout);
    return 0;
}
