/* libpshard's shared-memory regions: created in /dev/shm for the shard server to map, their
 * names unlinked once it has, and parts of them given back to the kernel. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/shm_names.h"
#include "pshard/util.h"

#include "client_internal.h"

/* A new shared-memory file of bytes: an unnamed one in /dev/shm (O_TMPFILE) that gets its name
 * only while the server opens it (client_region_link), so that nothing is left in /dev/shm when
 * the trainer is killed; where /dev/shm cannot make unnamed files, a named one (shm_open). */
static int open_file(region_t *r, bool *named)
{
    *named = false;
    int fd = open("/dev/shm", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0)
        return fd;
    *named = true;
    return shm_open(r->name, O_RDWR | O_CREAT | O_EXCL, 0600);
}

/* A region of bytes, shared with the server unless remote; touch backs every page now (the
 * scratch region), otherwise pages are backed as they are first used (the model's pool). The
 * file stays open (the name can be given to it again, and parts of it mapped again). */
pshard_status_t client_region_create(region_t *r, size_t bytes, const char *what, bool remote,
                                     bool touch, char *err, size_t errlen)
{
    memset(r, 0, sizeof(*r));
    if (remote) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "cannot allocate %zu bytes", bytes);
        if (touch)
            memset(p, 0, bytes);
        r->base = p;
        r->bytes = bytes;
        return PSHARD_OK;
    }
    if (ps_shm_name(PS_SHM_TRAINER, r->name, sizeof(r->name)) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "getrandom: %s", strerror(errno));
    bool named;
    int fd = open_file(r, &named);
    if (fd < 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot create the %s region %s: %s", what,
                       r->name, strerror(errno));
    r->linked = named;
    r->fd = fd;
    r->has_fd = true;
    if (ftruncate(fd, (off_t)bytes) != 0) {
        int e = errno;
        client_region_destroy(r);
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot size the %s region to %zu bytes: %s",
                       what, bytes, strerror(e));
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        client_region_destroy(r);
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "mmap of the %s region: %s", what,
                       strerror(e));
    }
    /* Touch every page now, not inside the first operation. */
    if (touch)
        memset(p, 0, bytes);
    r->base = p;
    r->bytes = bytes;
    return PSHARD_OK;
}

/* Gives the file its name (a no-op while it has it). Once the name is removed the file cannot
 * have one again (Linux: an O_TMPFILE file is linkable once). */
pshard_status_t client_region_link(region_t *r, char *err, size_t errlen)
{
    if (r->linked || !r->name[0])
        return PSHARD_OK;
    char from[64], to[128];
    snprintf(from, sizeof(from), "/proc/self/fd/%d", r->fd);
    snprintf(to, sizeof(to), "/dev/shm%s", r->name);
    if (linkat(AT_FDCWD, from, AT_FDCWD, to, AT_SYMLINK_FOLLOW) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM,
                       "cannot name shared memory %s for the shard server: %s", r->name,
                       strerror(errno));
    r->linked = true;
    return PSHARD_OK;
}

/* Removes the region's name once the server has mapped it: the memory lives on in both
 * mappings, and a trainer killed with -9 leaves nothing behind in /dev/shm. */
void client_region_unlink(region_t *r)
{
    if (r->linked) {
        shm_unlink(r->name);
        r->linked = false;
    }
}

void client_region_destroy(region_t *r)
{
    if (r->base)
        munmap(r->base, r->bytes);
    if (r->has_fd)
        close(r->fd);
    client_region_unlink(r);
    memset(r, 0, sizeof(*r));
}

/* Gives the pages of [off, off + len) of the model region back to the kernel: MADV_REMOVE
 * punches a hole in the shared-memory file, so neither process keeps them. */
void client_region_discard(region_t *r, size_t off, size_t len)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t start = (off + page - 1) / page * page, end = (off + len) / page * page;
    if (end > start)
        madvise((uint8_t *)r->base + start, end - start, r->name[0] ? MADV_REMOVE : MADV_DONTNEED);
}
