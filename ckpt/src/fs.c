/* Files of the checkpoint format (pshard/ckpt.h, "Files inside a checkpoint root"): the step
 * directories' names, opening them and their files without following links or blocking, the read
 * loop every reader shares, and which files pruning may remove. New files are written with
 * pshard/atomic_file.h. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_internal.h"
#include "pshard/util.h"

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
            return ps_sys_err(err, errlen, "read", path);
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

pshard_status_t ckpt_dir_open(const char *dir, bool follow, int *dfd, char *err, size_t errlen)
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
    pshard_status_t rc = ps_sys_err(err, errlen, "open the directory", dir);
    return e == ENOENT ? PSHARD_ERR_NOT_FOUND : rc;
}

pshard_status_t ckpt_file_open(int dfd, const char *name, const char *shown, bool follow, int *fd,
                               uint64_t *size, char *err, size_t errlen)
{
    *fd = -1;
    /* O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; it is refused
     * below, and a regular file ignores the flag, which is cleared again anyway. */
    int f =
        openat(dfd, name, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | (follow ? 0 : O_NOFOLLOW));
    if (f < 0) {
        if (errno == ENOENT)
            return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "%s: missing", shown);
        if (!follow && errno == ELOOP)
            return link_refused(err, errlen, shown);
        return ps_sys_err(err, errlen, "open", shown);
    }
    struct stat st;
    if (fstat(f, &st) != 0) {
        pshard_status_t rc = ps_sys_err(err, errlen, "stat", shown);
        close(f);
        return rc;
    }
    if (!S_ISREG(st.st_mode)) {
        close(f);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s is not a regular file (%s)",
                       shown,
                       S_ISFIFO(st.st_mode)   ? "a FIFO"
                       : S_ISDIR(st.st_mode)  ? "a directory"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "a device");
    }
    int fl = fcntl(f, F_GETFL);
    if (fl < 0 || fcntl(f, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        pshard_status_t rc = ps_sys_err(err, errlen, "set the flags of", shown);
        close(f);
        return rc;
    }
    *fd = f;
    if (size)
        *size = (uint64_t)st.st_size;
    return PSHARD_OK;
}

const char *ps_ckpt_step_dir(const char *root, int64_t step, char *buf, size_t len)
{
    size_t n = strlen(root);
    const char *sep = n > 0 && root[n - 1] == '/' ? "" : "/";
    snprintf(buf, len, "%s%sstep-%08lld", root, sep, (long long)step);
    return buf;
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
            return ps_sys_err(err, errlen, "create", path);
        *p = '/';
    }
    if (mkdir(path, 0755) != 0 && errno != EEXIST)
        return ps_sys_err(err, errlen, "create", path);
    int rfd;
    PS_CHECK(ckpt_dir_open(root, true, &rfd, err, errlen));
    char base[32], shown[PATH_MAX];
    snprintf(base, sizeof(base), "step-%08lld", (long long)step); /* as ps_ckpt_step_dir */
    ps_ckpt_step_dir(root, step, shown, sizeof(shown));
    pshard_status_t rc = PSHARD_OK;
    if (mkdirat(rfd, base, 0755) != 0 && errno != EEXIST) {
        rc = ps_sys_err(err, errlen, "create", shown);
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
            rc = ps_sys_err(err, errlen, "open the directory", shown);
    }
    close(rfd);
    return rc;
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
    /* Temporaries: ".NAME.tmp-SUFFIX" (ps_atomic_file_open; 6-character suffixes from older
     * versions) and "NAME.tmp" (older shard files). */
    if (n > 4 && strcmp(name + n - 4, ".tmp") == 0 && own_final_name(name, n - 4))
        return true;
    const char *t = strstr(name, ".tmp-");
    if (name[0] != '.' || !t)
        return false;
    size_t suffix = strlen(t + 5);
    if (suffix < 6 || suffix > 12 ||
        strspn(t + 5, "0123456789abcdefABCDEFGHIJKLMNOPQRSTUVWXYZ"
                      "ghijklmnopqrstuvwxyz") != suffix)
        return false;
    return own_final_name(name + 1, (size_t)(t - name - 1));
}
