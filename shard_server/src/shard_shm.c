/* The shard server's own shared-memory objects (see shard_shm.h): one per model, holding the
 * host-resident master weights and gradient accumulator its trainer maps. */
#include "shard_shm.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/util.h"

/* This process's PID namespace's id ("pid:[ID]" in /proc/self/ns/pid), or 0 when unknown. */
static unsigned long long pid_ns(void)
{
    char link[64];
    ssize_t n = readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
    if (n <= 5)
        return 0;
    link[n] = '\0';
    if (strncmp(link, "pid:[", 5) != 0)
        return 0;
    char *end = NULL;
    errno = 0;
    unsigned long long id = strtoull(link + 5, &end, 10);
    return errno || *end != ']' ? 0 : id;
}

pshard_status_t shard_shm_create(size_t bytes, size_t huge_from, shard_shm_t *out, char *err,
                                 size_t errlen)
{
    memset(out, 0, sizeof(*out));
    uint8_t rnd[6];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd))
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "getrandom: %s", strerror(errno));
    char name[sizeof(out->name)];
    snprintf(name, sizeof(name), SHARD_SHM_PREFIX "%d-%llx-%02x%02x%02x%02x%02x%02x", (int)getpid(),
             pid_ns(), rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5]);
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "shm_open %s: %s", name, strerror(errno));
    pshard_status_t rc = PSHARD_OK;
    void *p = MAP_FAILED;
    if (ftruncate(fd, (off_t)bytes) != 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot size %s to %zu bytes: %s", name, bytes,
                     strerror(errno));
        goto fail;
    }
    /* Reserve the pages now: touching a page of a full tmpfs would raise SIGBUS. */
    int fe = posix_fallocate(fd, 0, (off_t)bytes);
    if (fe != 0) {
        rc = ps_errf(err, errlen, fe == ENOSPC ? PSHARD_ERR_RESOURCE_EXHAUSTED : PSHARD_ERR_SYSTEM,
                     "cannot reserve %zu bytes of shared memory for %s: %s (is /dev/shm too "
                     "small?)",
                     bytes, name, strerror(fe));
        goto fail;
    }
    p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        rc = ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "mmap %s: %s", name, strerror(errno));
        goto fail;
    }
    close(fd);
    if (bytes >= huge_from)
        madvise(p, bytes, MADV_HUGEPAGE); /* honoured when shmem_enabled allows it */
    memset(p, 0, bytes);                  /* backed now, not in the first step */
    ps_strlcpy(out->name, name, sizeof(out->name));
    out->base = p;
    out->bytes = bytes;
    return PSHARD_OK;
fail:
    close(fd);
    shm_unlink(name);
    return rc;
}

void shard_shm_destroy(shard_shm_t *shm)
{
    if (shm->base)
        munmap(shm->base, shm->bytes);
    if (shm->name[0] && shm_unlink(shm->name) != 0 && errno != ENOENT)
        PS_WARN(PS_SUB_SHARD, "cannot remove shared memory %s: %s", shm->name, strerror(errno));
    memset(shm, 0, sizeof(*shm));
}

/* Whether s is 1..32 lowercase hex digits up to the end or to a '-' (*end set there). */
static bool hex_run(const char *s, const char **end)
{
    size_t n = 0;
    while ((s[n] >= '0' && s[n] <= '9') || (s[n] >= 'a' && s[n] <= 'f'))
        n++;
    *end = s + n;
    return n >= 1 && n <= 32;
}

/* The PID in a name "pshard-srv-PID-NS-HEX" (without the leading '/') whose NS is ns, or -1
 * when the name is not exactly of that form. */
static long leftover_pid(const char *name, unsigned long long ns)
{
    const char *prefix = SHARD_SHM_PREFIX + 1;
    size_t plen = strlen(prefix);
    if (strncmp(name, prefix, plen) != 0)
        return -1;
    const char *p = name + plen;
    char *end = NULL;
    errno = 0;
    long pid = strtol(p, &end, 10);
    if (errno || end == p || *end != '-' || pid <= 0 || *p < '0' || *p > '9')
        return -1;
    const char *ns_text = end + 1, *ns_end = NULL, *rnd_end = NULL;
    if (!hex_run(ns_text, &ns_end) || *ns_end != '-' || !hex_run(ns_end + 1, &rnd_end) ||
        *rnd_end != '\0')
        return -1;
    if (strtoull(ns_text, NULL, 16) != ns)
        return -1; /* another namespace's: its PIDs mean nothing here */
    return pid;
}

int shard_shm_sweep(void)
{
    DIR *d = opendir("/dev/shm");
    if (!d)
        return 0;
    int removed = 0;
    unsigned long long ns = pid_ns();
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        long pid = leftover_pid(e->d_name, ns);
        if (pid < 0 || pid == (long)getpid())
            continue;
        struct stat st;
        /* Never follow a link: only a regular file of this user is a leftover of ours. */
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
            st.st_uid != geteuid())
            continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue; /* alive (or not ours to ask about): its object is in use */
        char name[300];
        snprintf(name, sizeof(name), "/%s", e->d_name);
        if (shm_unlink(name) == 0) {
            removed++;
            PS_INFO(PS_SUB_SHARD, "removed %s, left by shard server %ld, which is gone", name, pid);
        } else if (errno != ENOENT) {
            PS_WARN(PS_SUB_SHARD, "cannot remove %s (left by dead server %ld): %s", name, pid,
                    strerror(errno));
        }
    }
    closedir(d);
    return removed;
}
