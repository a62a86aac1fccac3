/* Files of the checkpoint format (pshard/ckpt.h, "Files inside a checkpoint root"): opening
 * step directories and their files without following links or blocking, creating files under
 * O_EXCL temporaries renamed into place, and the read/write loops every writer and reader
 * shares. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt_internal.h"
#include "pshard/util.h"

/* Attempts at a fresh temporary name before giving up (each collision is a file someone else
 * made with our random suffix: practically never more than one). */
#define TEMP_TRIES 64

pshard_status_t ckpt_sys_err(char *err, size_t errlen, const char *what, const char *path)
{
    int e = errno;
    return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot %s %s: %s", what, path, strerror(e));
}

pshard_status_t ckpt_write_all(int fd, const void *buf, size_t len, const char *path, char *err,
                               size_t errlen)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return ckpt_sys_err(err, errlen, "write", path);
        if (n == 0) {
            errno = ENOSPC;
            return ckpt_sys_err(err, errlen, "write", path);
        }
        p += n;
        len -= (size_t)n;
    }
    return PSHARD_OK;
}

pshard_status_t ckpt_pread_full(int fd, void *buf, size_t len, uint64_t off, size_t *got,
                                const char *path, char *err, size_t errlen)
{
    char *p = buf;
    size_t done = 0;
    while (done < len) {
        if (off + done > (uint64_t)INT64_MAX)
            break;
        ssize_t n = pread(fd, p + done, len - done, (off_t)(off + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return ckpt_sys_err(err, errlen, "read", path);
        if (n == 0)
            break;
        done += (size_t)n;
    }
    *got = done;
    return PSHARD_OK;
}

/* ---- Opening ------------------------------------------------------------------------------ */

static pshard_status_t link_refused(char *err, size_t errlen, const char *shown)
{
    return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                   "%s is a symbolic link: pshard does not follow links inside a checkpoint "
                   "root",
                   shown);
}

pshard_status_t ps_ckpt_dir_open(const char *dir, bool follow, int *dfd, char *err, size_t errlen)
{
    *dfd = -1;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | (follow ? 0 : O_NOFOLLOW));
    if (fd >= 0) {
        *dfd = fd;
        return PSHARD_OK;
    }
    int e = errno;
    struct stat st;
    if (!follow && (e == ELOOP || e == ENOTDIR) && lstat(dir, &st) == 0 && S_ISLNK(st.st_mode))
        return link_refused(err, errlen, dir);
    errno = e;
    pshard_status_t rc = ckpt_sys_err(err, errlen, "open the directory", dir);
    return e == ENOENT ? PSHARD_ERR_NOT_FOUND : rc;
}

pshard_status_t ps_ckpt_file_open(int dfd, const char *name, const char *shown, bool follow,
                                  int *fd, uint64_t *size, char *err, size_t errlen)
{
    *fd = -1;
    /* O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; it is refused
     * below, and a regular file ignores the flag, which is cleared again anyway. */
    int f = openat(dfd, name,
                   O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | (follow ? 0 : O_NOFOLLOW));
    if (f < 0) {
        if (errno == ENOENT)
            return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "%s: missing", shown);
        if (!follow && errno == ELOOP)
            return link_refused(err, errlen, shown);
        return ckpt_sys_err(err, errlen, "open", shown);
    }
    struct stat st;
    if (fstat(f, &st) != 0) {
        pshard_status_t rc = ckpt_sys_err(err, errlen, "stat", shown);
        close(f);
        return rc;
    }
    if (!S_ISREG(st.st_mode)) {
        close(f);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s is not a regular file (%s)", shown,
                       S_ISFIFO(st.st_mode)  ? "a FIFO"
                       : S_ISDIR(st.st_mode) ? "a directory"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "a device");
    }
    int fl = fcntl(f, F_GETFL);
    if (fl < 0 || fcntl(f, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        pshard_status_t rc = ckpt_sys_err(err, errlen, "set the flags of", shown);
        close(f);
        return rc;
    }
    *fd = f;
    if (size)
        *size = (uint64_t)st.st_size;
    return PSHARD_OK;
}

pshard_status_t ps_ckpt_step_dir_make(const char *root, int64_t step, int *dfd, char *err,
                                      size_t errlen)
{
    *dfd = -1;
    char path[PATH_MAX];
    if (ps_strlcpy(path, root, sizeof(path)) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "checkpoint root too long");
    /* mkdir -p of the root: the operator's path, links allowed. */
    for (char *p = path + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(path, 0755) != 0 && errno != EEXIST)
            return ckpt_sys_err(err, errlen, "create", path);
        *p = '/';
    }
    if (mkdir(path, 0755) != 0 && errno != EEXIST)
        return ckpt_sys_err(err, errlen, "create", path);
    int rfd;
    PS_CHECK(ps_ckpt_dir_open(root, true, &rfd, err, errlen));
    char base[32], shown[PATH_MAX];
    snprintf(base, sizeof(base), "step-%08lld", (long long)step); /* as ps_ckpt_step_dir */
    ps_ckpt_step_dir(root, step, shown, sizeof(shown));
    pshard_status_t rc = PSHARD_OK;
    if (mkdirat(rfd, base, 0755) != 0 && errno != EEXIST) {
        rc = ckpt_sys_err(err, errlen, "create", shown);
    } else {
        int f = openat(rfd, base, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        struct stat st;
        if (f >= 0)
            *dfd = f;
        else if (fstatat(rfd, base, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode))
            rc = link_refused(err, errlen, shown);
        else if (errno == ENOTDIR)
            rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                         "%s exists and is not a directory", shown);
        else
            rc = ckpt_sys_err(err, errlen, "open the directory", shown);
    }
    close(rfd);
    return rc;
}

/* ---- Writing ------------------------------------------------------------------------------ */

static uint64_t temp_random(void)
{
    uint64_t r;
    if (getrandom(&r, sizeof(r), GRND_NONBLOCK) == (ssize_t)sizeof(r))
        return r;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    static _Atomic uint64_t counter;
    return ((uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)getpid() << 32) ^
           ++counter;
}

pshard_status_t ps_ckpt_out_open(int dfd, const char *name, const char *shown, ps_ckpt_out_t *o,
                                 char *err, size_t errlen)
{
    memset(o, 0, sizeof(*o));
    o->fd = -1;
    o->dfd = dfd;
    if (ps_strlcpy(o->name, name, sizeof(o->name)) != 0 ||
        ps_strlcpy(o->shown, shown, sizeof(o->shown)) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "file name too long: %s", shown);
    for (int i = 0; i < TEMP_TRIES; i++) {
        ps_snprintf(o->tmp, sizeof(o->tmp), ".%s.tmp-%012" PRIx64, name,
                    (uint64_t)(temp_random() & 0xFFFFFFFFFFFFull));
        /* O_EXCL: never opens what is already there, a planted link included. */
        int f = openat(dfd, o->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (f >= 0) {
            o->fd = f;
            return PSHARD_OK;
        }
        if (errno != EEXIST)
            return ckpt_sys_err(err, errlen, "create a temporary file for", shown);
    }
    return ps_errf(err, errlen, PSHARD_ERR_SYSTEM,
                   "cannot create a temporary file for %s: %d names taken", shown, TEMP_TRIES);
}

pshard_status_t ps_ckpt_out_write(ps_ckpt_out_t *o, const void *buf, size_t len, char *err,
                                  size_t errlen)
{
    return ckpt_write_all(o->fd, buf, len, o->shown, err, errlen);
}

pshard_status_t ps_ckpt_out_commit(ps_ckpt_out_t *o, bool ok, char *err, size_t errlen)
{
    if (o->fd < 0)
        return PSHARD_OK;
    pshard_status_t rc = PSHARD_OK;
    if (ok && fsync(o->fd) != 0)
        rc = ckpt_sys_err(err, errlen, "sync", o->shown);
    if (close(o->fd) != 0 && ok && rc == PSHARD_OK)
        rc = ckpt_sys_err(err, errlen, "write", o->shown);
    o->fd = -1;
    /* renameat replaces a link at the final name itself, never what it points to. */
    if (ok && rc == PSHARD_OK && renameat(o->dfd, o->tmp, o->dfd, o->name) != 0)
        rc = ckpt_sys_err(err, errlen, "rename a temporary file to", o->shown);
    if (!ok || rc != PSHARD_OK) {
        unlinkat(o->dfd, o->tmp, 0); /* ours: made with O_EXCL above */
        return ok ? rc : PSHARD_OK;
    }
    /* Some file systems cannot sync a directory (EINVAL); the rename is as durable as they
     * make it then. */
    if (fsync(o->dfd) != 0 && errno != EINVAL)
        rc = ckpt_sys_err(err, errlen, "sync the directory of", o->shown);
    return rc;
}

pshard_status_t ps_ckpt_write_file(int dfd, const char *name, const char *shown,
                                   const void *data, size_t len, char *err, size_t errlen)
{
    ps_ckpt_out_t o;
    PS_CHECK(ps_ckpt_out_open(dfd, name, shown, &o, err, errlen));
    pshard_status_t rc = ps_ckpt_out_write(&o, data, len, err, errlen);
    pshard_status_t rc2 = ps_ckpt_out_commit(&o, rc == PSHARD_OK, err, errlen);
    return rc != PSHARD_OK ? rc : rc2;
}

static bool own_final_name(const char *name, size_t n)
{
    if (n == strlen(PS_CKPT_MANIFEST) && memcmp(name, PS_CKPT_MANIFEST, n) == 0)
        return true;
    char buf[64];
    if (n >= sizeof(buf))
        return false;
    memcpy(buf, name, n);
    buf[n] = '\0';
    int r, w, end = 0;
    return sscanf(buf, "shard-%5d-of-%5d.bin%n", &r, &w, &end) == 2 && (size_t)end == n;
}

bool ps_ckpt_is_own_file(const char *name)
{
    size_t n = strlen(name);
    if (own_final_name(name, n))
        return true;
    /* Temporaries: ".NAME.tmp-SUFFIX" (ps_ckpt_out_open; 6-character suffixes from older
     * versions) and "NAME.tmp" (older shard files). */
    if (n > 4 && strcmp(name + n - 4, ".tmp") == 0 && own_final_name(name, n - 4))
        return true;
    const char *t = strstr(name, ".tmp-");
    if (name[0] != '.' || !t)
        return false;
    size_t suffix = strlen(t + 5);
    if (suffix < 6 || suffix > 12 || strspn(t + 5, "0123456789abcdefABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                   "ghijklmnopqrstuvwxyz") != suffix)
        return false;
    return own_final_name(name + 1, (size_t)(t - name - 1));
}
