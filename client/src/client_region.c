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
#include "pshard/util.h"

#include "client_internal.h"

/* A region of bytes, shared with the server unless remote; touch backs every page now (the
 * scratch region), otherwise pages are backed as they are first used (the model's pool). */
pshard_status_t client_region_create(region_t *r, size_t bytes, const char *what, bool remote,
                                     bool touch, bool keep_fd, char *err, size_t errlen)
{
    if (remote) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "cannot allocate %zu bytes", bytes);
        if (touch)
            memset(p, 0, bytes);
        r->base = p;
        r->bytes = bytes;
        r->name[0] = '\0';
        return PSHARD_OK;
    }
    uint8_t rnd[8];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd))
        memset(rnd, 0x5a, sizeof(rnd));
    snprintf(r->name, sizeof(r->name), "/pshard-%d-%s-%02x%02x%02x%02x%02x%02x", (int)getpid(),
             what, rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5]);
    int fd = shm_open(r->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "shm_open %s: %s", r->name, strerror(errno));
    if (ftruncate(fd, (off_t)bytes) != 0) {
        int e = errno;
        close(fd);
        shm_unlink(r->name);
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot size %s to %zu bytes: %s", r->name,
                       bytes, strerror(e));
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED || !keep_fd)
        close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(r->name);
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "mmap %s: %s", r->name, strerror(errno));
    }
    r->linked = true;
    r->fd = fd;
    r->has_fd = keep_fd;
    /* Touch every page now, not inside the first operation. */
    if (touch)
        memset(p, 0, bytes);
    r->base = p;
    r->bytes = bytes;
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
