/* The rendezvous file of init_method file:// (see rdzv_file.h). */
#include "pshard/rdzv_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/util.h"

#define RDZV_MAX 300

static int lock_fd(int fd, short type)
{
    struct flock l = {.l_type = type, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
    while (fcntl(fd, F_SETLKW, &l) != 0) {
        if (errno != EINTR)
            return -1;
    }
    return 0;
}

/* The file's content (up to RDZV_MAX - 1 bytes, NUL-terminated) into buf; its size. */
static ssize_t read_all(int fd, char *buf, size_t len)
{
    size_t got = 0;
    while (got + 1 < len) {
        ssize_t n = pread(fd, buf + got, len - 1 - got, (off_t)got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -1;
        if (n == 0)
            break;
        got += (size_t)n;
    }
    buf[got] = '\0';
    return (ssize_t)got;
}

/* What a claim writes until the address is published: readers take it for "not yet", and a
 * second coordinator claiming the same file finds it taken. */
#define RDZV_CLAIMED "#claimed"

/* Who may have written the file: this user or root, and nobody else (no group or other write
 * permission), as ssh insists for its keys; the address it holds receives the cluster token. */
static pshard_status_t check_owner(const struct stat *st, const char *path, char *err,
                                   size_t errlen)
{
    if (st->st_uid != geteuid() && st->st_uid != 0)
        return ps_errf(err, errlen, PSHARD_ERR_PERMISSION,
                       "rendezvous file %s is owned by uid %u, not by this user (uid %u) or root: "
                       "refused, since whoever can write it receives the cluster token",
                       path, (unsigned)st->st_uid, (unsigned)geteuid());
    if (st->st_mode & (S_IWGRP | S_IWOTH))
        return ps_errf(err, errlen, PSHARD_ERR_PERMISSION,
                       "rendezvous file %s is writable by %s (mode %03o): refused, since whoever "
                       "can write it receives the cluster token (chmod go-w it)",
                       path, st->st_mode & S_IWOTH ? "others" : "its group",
                       (unsigned)(st->st_mode & 0777));
    return PSHARD_OK;
}

/* Replaces characters a message should not carry (control bytes) with '?'. */
static void printable(char *s)
{
    for (; *s; s++) {
        if ((unsigned char)*s < 0x20 || (unsigned char)*s == 0x7f)
            *s = '?';
    }
}

pshard_status_t ps_rdzv_file_claim(ps_rdzv_file_t *f, const char *path, char *err, size_t errlen)
{
    f->fd = -1;
    f->addr[0] = '\0';
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0644);
    if (fd < 0)
        return ps_errf(err, errlen,
                       errno == ELOOP ? PSHARD_ERR_INVALID_ARGUMENT : PSHARD_ERR_SYSTEM,
                       "rendezvous file %s: %s", path,
                       errno == ELOOP ? "is a symbolic link (not followed)" : strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "rendezvous file %s is not a regular file", path);
    }
    pshard_status_t own = check_owner(&st, path, err, errlen);
    if (own != PSHARD_OK) {
        close(fd);
        return own;
    }
    if (lock_fd(fd, F_WRLCK) != 0) {
        pshard_status_t rc =
            ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "rendezvous file %s: cannot lock it: %s", path,
                    strerror(errno));
        close(fd);
        return rc;
    }
    char old[RDZV_MAX];
    ssize_t n = read_all(fd, old, sizeof(old));
    if (n != 0) {
        pshard_status_t rc;
        if (n < 0) {
            rc = ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "rendezvous file %s: %s", path,
                         strerror(errno));
        } else {
            old[strcspn(old, "\n")] = '\0';
            printable(old);
            rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                         "rendezvous file %s already holds '%.80s' (an earlier run that did not "
                         "stop cleanly, or another coordinator using it): it must be absent or "
                         "empty at start; remove it, or give each job a file of its own",
                         path, old);
        }
        lock_fd(fd, F_UNLCK);
        close(fd);
        return rc;
    }
    /* Taken under the lock: a second coordinator claiming the file now finds it not empty. */
    char mark[64];
    int len = snprintf(mark, sizeof(mark), RDZV_CLAIMED " by pid %d\n", (int)getpid());
    if (pwrite(fd, mark, (size_t)len, 0) != len || fsync(fd) != 0) {
        pshard_status_t rc =
            ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "rendezvous file %s: cannot claim it: %s", path,
                    strerror(errno));
        lock_fd(fd, F_UNLCK);
        close(fd);
        return rc;
    }
    ps_strlcpy(f->addr, mark, sizeof(f->addr));
    f->addr[strcspn(f->addr, "\n")] = '\0';
    lock_fd(fd, F_UNLCK);
    f->fd = fd;
    return PSHARD_OK;
}

pshard_status_t ps_rdzv_file_publish(ps_rdzv_file_t *f, const char *addr, char *err, size_t errlen)
{
    char line[RDZV_MAX];
    int len = snprintf(line, sizeof(line), "%s\n", addr);
    if (f->fd < 0 || len <= 1 || (size_t)len >= sizeof(line))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "cannot publish '%.64s' in the rendezvous file", addr);
    if (lock_fd(f->fd, F_WRLCK) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "rendezvous file: cannot lock it: %s",
                       strerror(errno));
    pshard_status_t rc = PSHARD_OK;
    if (ftruncate(f->fd, 0) != 0 || pwrite(f->fd, line, (size_t)len, 0) != len || fsync(f->fd) != 0)
        rc = ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "rendezvous file: cannot write it: %s",
                     strerror(errno));
    else
        ps_strlcpy(f->addr, addr, sizeof(f->addr));
    lock_fd(f->fd, F_UNLCK);
    return rc;
}

void ps_rdzv_file_release(ps_rdzv_file_t *f)
{
    if (f->fd < 0)
        return;
    if (f->addr[0] && lock_fd(f->fd, F_WRLCK) == 0) {
        char now[RDZV_MAX];
        if (read_all(f->fd, now, sizeof(now)) > 0) {
            now[strcspn(now, "\n")] = '\0';
            if (strcmp(now, f->addr) == 0 && ftruncate(f->fd, 0) == 0)
                (void)fsync(f->fd);
        }
        lock_fd(f->fd, F_UNLCK);
    }
    close(f->fd);
    f->fd = -1;
}

pshard_status_t ps_rdzv_file_read(const char *path, char *addr, size_t addrlen, char *err,
                                  size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ENOENT)
            return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "rendezvous file %s is not there yet",
                           path);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "rendezvous file %s: %s", path,
                       errno == ELOOP ? "is a symbolic link (not followed)" : strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd); /* a FIFO or device would read as "empty" for ever */
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "rendezvous file %s is not a regular file", path);
    }
    pshard_status_t own = check_owner(&st, path, err, errlen);
    if (own != PSHARD_OK) {
        close(fd);
        return own;
    }
    char buf[RDZV_MAX];
    ssize_t n = -1;
    if (lock_fd(fd, F_RDLCK) == 0) {
        n = read_all(fd, buf, sizeof(buf));
        lock_fd(fd, F_UNLCK);
    }
    close(fd);
    if (n < 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "rendezvous file %s: %s", path,
                       strerror(errno));
    if (n == 0)
        return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND, "rendezvous file %s is empty", path);
    if (strncmp(buf, RDZV_CLAIMED, strlen(RDZV_CLAIMED)) == 0)
        return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND,
                       "rendezvous file %s is claimed by a coordinator that has not published "
                       "its address yet",
                       path);
    size_t line = strcspn(buf, "\n");
    bool one_line = buf[line] == '\0' || buf[line + 1] == '\0';
    buf[line] = '\0';
    const char *colon = strrchr(buf, ':');
    int64_t port;
    if (!one_line || line == 0 || !colon || colon == buf ||
        ps_parse_i64(colon + 1, 1, 65535, &port) != 0 || ps_strlcpy(addr, buf, addrlen) != 0) {
        printable(buf);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "rendezvous file %s holds '%.80s', not one HOST:PORT line", path, buf);
    }
    return PSHARD_OK;
}
