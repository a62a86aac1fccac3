/* Names of pshard's shared-memory objects and the sweep of dead processes' leftovers (see
 * shm_names.h). */
#include "pshard/shm_names.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/log.h"

unsigned long long ps_pid_ns(void)
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

int ps_shm_name(const char *prefix, char *buf, size_t len)
{
    uint8_t rnd[6];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd))
        return -1;
    snprintf(buf, len, "%s%d-%llx-%02x%02x%02x%02x%02x%02x", prefix, (int)getpid(), ps_pid_ns(),
             rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5]);
    return 0;
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

/* The PID in a name "PREFIX-PID-NS-HEX" (prefix without its leading '/') whose NS is ns, or -1
 * when the name is not exactly of that form. */
static long leftover_pid(const char *name, const char *prefix, unsigned long long ns)
{
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

int ps_shm_sweep(const char *prefix, const char *who)
{
    DIR *d = opendir("/dev/shm");
    if (!d)
        return 0;
    int removed = 0;
    unsigned long long ns = ps_pid_ns();
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        long pid = leftover_pid(e->d_name, prefix + 1, ns);
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
            PS_INFO(PS_SUB_MAIN, "removed %s, left by %s %ld, which is gone", name, who, pid);
        } else if (errno != ENOENT) {
            PS_WARN(PS_SUB_MAIN, "cannot remove %s (left by dead %s %ld): %s", name, who, pid,
                    strerror(errno));
        }
    }
    closedir(d);
    return removed;
}
