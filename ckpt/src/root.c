/* A checkpoint root's step directories: listing the committed ones, and pruning
 * old ones without following links or removing anything pshard did not write. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_internal.h"
#include "pshard/log.h"
#include "pshard/util.h"

/* Parses a step directory's name; only the canonical spelling ps_ckpt_step_dir writes counts,
 * so one step has one directory. */
static bool parse_step_name(const char *name, int64_t *step)
{
    if (strncmp(name, "step-", 5) != 0)
        return false;
    int64_t v;
    if (ps_parse_i64(name + 5, 0, INT64_MAX, &v) != 0)
        return false;
    char canon[40];
    snprintf(canon, sizeof(canon), "step-%08lld", (long long)v);
    if (strcmp(canon, name) != 0)
        return false;
    *step = v;
    return true;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* Appends one refusal to refused (NULL: none kept), "; "-separated, as far as it fits. */
static void add_refusal(char *refused, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void add_refusal(char *refused, size_t len, const char *fmt, ...)
{
    if (!refused || len == 0)
        return;
    size_t used = strlen(refused);
    if (used > 0 && used + 2 < len) {
        memcpy(refused + used, "; ", 3);
        used += 2;
    }
    if (used + 1 >= len)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(refused + used, len - used, fmt, ap);
    va_end(ap);
}

/* Steps of the step directories under root (committed or not), ascending. A missing root
 * gives none. Entries named like step directories that are links or not directories are
 * skipped (the first is described in refused when it is not NULL and still empty). */
static pshard_status_t scan_step_dirs(const char *root, int64_t **steps, size_t *n, char *refused,
                                      size_t refusedlen, char *err, size_t errlen)
{
    *steps = NULL;
    *n = 0;
    DIR *dir = opendir(root);
    if (!dir) {
        if (errno == ENOENT)
            return PSHARD_OK;
        return ps_sys_err(err, errlen, "list", root);
    }
    size_t cap = 0;
    pshard_status_t rc = PSHARD_OK;
    struct dirent *e;
    errno = 0;
    while ((e = readdir(dir)) != NULL) {
        int64_t step;
        if (!parse_step_name(e->d_name, &step))
            continue;
        struct stat st;
        bool is_dir = e->d_type == DT_DIR;
        if (e->d_type == DT_UNKNOWN || e->d_type == DT_LNK)
            is_dir = fstatat(dirfd(dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                     S_ISDIR(st.st_mode);
        if (!is_dir) {
            add_refusal(refused, refusedlen, "%s/%s is %s", root, e->d_name,
                        e->d_type == DT_LNK ? "a symbolic link (never followed)"
                                            : "not a directory");
            if (e->d_type == DT_LNK)
                PS_WARN(PS_SUB_MAIN,
                        "ignoring %s/%s: a symbolic link (pshard does not follow "
                        "links inside a checkpoint root)",
                        root, e->d_name);
            errno = 0;
            continue;
        }
        if (*n == cap) {
            size_t ncap = cap ? cap * 2 : 16;
            int64_t *s = realloc(*steps, ncap * sizeof(*s));
            if (!s) {
                rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
                break;
            }
            *steps = s;
            cap = ncap;
        }
        (*steps)[(*n)++] = step;
        errno = 0;
    }
    if (rc == PSHARD_OK && errno != 0)
        rc = ps_sys_err(err, errlen, "list", root);
    closedir(dir);
    if (rc != PSHARD_OK) {
        free(*steps);
        *steps = NULL;
        *n = 0;
        return rc;
    }
    if (*n > 1)
        qsort(*steps, *n, sizeof(**steps), cmp_i64);
    return PSHARD_OK;
}

pshard_status_t ps_ckpt_list(const char *root, int64_t **steps, size_t *n, char *refused,
                             size_t refusedlen, char *err, size_t errlen)
{
    int64_t *all = NULL;
    size_t nall = 0, kept = 0;
    *steps = NULL;
    *n = 0;
    if (refused && refusedlen)
        refused[0] = '\0';
    PS_CHECK(scan_step_dirs(root, &all, &nall, refused, refusedlen, err, errlen));
    for (size_t i = 0; i < nall; i++) {
        char dir[PATH_MAX], why[PSHARD_ERRLEN] = "";
        ps_ckpt_step_dir(root, all[i], dir, sizeof(dir));
        ps_ckpt_manifest_t *m = NULL;
        pshard_status_t rc = ps_ckpt_manifest_read(dir, &m, why, sizeof(why));
        if (rc == PSHARD_ERR_NOT_FOUND)
            continue; /* a save that never committed */
        if (rc == PSHARD_ERR_INVALID_ARGUMENT) {
            PS_WARN(PS_SUB_MAIN, "ignoring %s: %s", dir, why);
            add_refusal(refused, refusedlen, "%s", why);
            continue;
        }
        if (rc != PSHARD_OK) {
            free(all);
            return ps_errf(err, errlen, rc, "%s", why);
        }
        bool same_step = m->step == all[i];
        if (!same_step) {
            PS_WARN(PS_SUB_MAIN, "ignoring %s: its manifest says step %" PRId64, dir, m->step);
            add_refusal(refused, refusedlen, "%s: its manifest says step %" PRId64, dir, m->step);
        }
        ps_ckpt_manifest_free(m);
        if (same_step)
            all[kept++] = all[i];
    }
    if (kept == 0) {
        free(all);
        return PSHARD_OK;
    }
    *steps = all;
    *n = kept;
    return PSHARD_OK;
}

/* Removes one step directory `name` of root (descriptor rfd): the manifest first (synced, so
 * the step is no longer committed even after a crash), then the files pshard writes there,
 * then the directory. A link is never followed and nothing pshard did not write is removed:
 * a directory that holds anything else stays, with a warning. */
static pshard_status_t remove_step_dir(int rfd, const char *root, const char *name, char *err,
                                       size_t errlen)
{
    char dir[PATH_MAX];
    ps_snprintf(dir, sizeof(dir), "%s/%s", root, name);
    int dfd = openat(rfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) {
        if (errno == ENOENT)
            return PSHARD_OK;
        if (errno == ELOOP || errno == ENOTDIR) {
            PS_WARN(PS_SUB_MAIN, "not pruning %s: not a directory (links are never followed)", dir);
            return PSHARD_OK;
        }
        return ps_sys_err(err, errlen, "open the directory", dir);
    }
    pshard_status_t rc = PSHARD_OK;
    struct stat st;
    if (fstatat(dfd, PS_CKPT_MANIFEST, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
        unlinkat(dfd, PS_CKPT_MANIFEST, 0) != 0 && errno != ENOENT) {
        rc = ps_sys_err(err, errlen, "remove the manifest of", dir);
        close(dfd);
        return rc;
    }
    if (fsync(dfd) != 0 && errno != EINVAL) {
        rc = ps_sys_err(err, errlen, "sync the directory", dir);
        close(dfd);
        return rc;
    }
    DIR *d = fdopendir(dfd);
    if (!d) {
        rc = ps_sys_err(err, errlen, "list", dir);
        close(dfd);
        return rc;
    }
    char foreign[256] = "";
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        bool regular =
            fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
        if (!regular || !ps_ckpt_is_own_file(e->d_name)) {
            if (!foreign[0])
                ps_strlcpy(foreign, e->d_name, sizeof(foreign));
            continue;
        }
        if (unlinkat(dirfd(d), e->d_name, 0) != 0 && errno != ENOENT && rc == PSHARD_OK) {
            char path[PATH_MAX];
            ps_snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
            rc = ps_sys_err(err, errlen, "remove", path);
        }
    }
    closedir(d);
    if (foreign[0]) {
        PS_WARN(PS_SUB_MAIN, "kept %s: it holds '%s', which pshard did not write", dir, foreign);
        return rc;
    }
    if (rc == PSHARD_OK && unlinkat(rfd, name, AT_REMOVEDIR) != 0 && errno != ENOENT)
        rc = ps_sys_err(err, errlen, "remove", dir);
    return rc;
}

pshard_status_t ps_ckpt_prune(const char *root, int keep, char *err, size_t errlen)
{
    if (keep < 1)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "keep must be at least 1, not %d",
                       keep);
    int64_t *committed = NULL, *all = NULL;
    size_t ncommitted = 0, nall = 0;
    PS_CHECK(ps_ckpt_list(root, &committed, &ncommitted, NULL, 0, err, errlen));
    pshard_status_t rc = scan_step_dirs(root, &all, &nall, NULL, 0, err, errlen);
    int rfd = -1;
    if (rc == PSHARD_OK && ncommitted > 0)
        rc = ckpt_dir_open(root, true, &rfd, err, errlen);
    if (rc != PSHARD_OK || ncommitted == 0) {
        free(committed);
        free(all);
        return rc;
    }
    int64_t newest = committed[ncommitted - 1];
    char dir[PATH_MAX];
    /* Older committed checkpoints beyond the newest `keep`, oldest first. */
    char name[32];
    for (size_t i = 0; i + (size_t)keep < ncommitted; i++) {
        snprintf(name, sizeof(name), "step-%08lld", (long long)committed[i]);
        pshard_status_t r = remove_step_dir(rfd, root, name, err, errlen);
        if (rc == PSHARD_OK)
            rc = r;
    }
    /* Saves that never committed and are older than the newest committed one (a newer one
     * may still be in progress). A directory whose manifest exists but does not parse is left
     * for a person to look at. */
    for (size_t i = 0; i < nall && all[i] < newest; i++) {
        ps_ckpt_step_dir(root, all[i], dir, sizeof(dir));
        char man[PATH_MAX];
        ps_snprintf(man, sizeof(man), "%s/%s", dir, PS_CKPT_MANIFEST);
        struct stat st;
        if (lstat(man, &st) == 0 || errno != ENOENT)
            continue;
        snprintf(name, sizeof(name), "step-%08lld", (long long)all[i]);
        pshard_status_t r = remove_step_dir(rfd, root, name, err, errlen);
        if (rc == PSHARD_OK)
            rc = r;
    }
    close(rfd);
    free(committed);
    free(all);
    return rc;
}
