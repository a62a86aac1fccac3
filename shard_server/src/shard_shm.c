/* The shard server's own shared-memory objects (see shard_shm.h): one per model, holding the
 * host-resident master weights and gradient accumulator its trainer maps. */
#include "shard_shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/shm_guard.h"
#include "pshard/shm_names.h"
#include "pshard/util.h"

pshard_status_t shard_shm_create(size_t bytes, size_t huge_from, shard_shm_t *out, char *err,
                                 size_t errlen)
{
    memset(out, 0, sizeof(*out));
    char name[sizeof(out->name)];
    if (ps_shm_name(PS_SHM_SERVER, name, sizeof(name)) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "getrandom: %s", strerror(errno));
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
    out->guard = ps_shm_guard_add(p, bytes) + 1;
    return PSHARD_OK;
fail:
    close(fd);
    shm_unlink(name);
    return rc;
}

void shard_shm_destroy(shard_shm_t *shm)
{
    ps_shm_guard_remove(shm->guard - 1);
    if (shm->base)
        munmap(shm->base, shm->bytes);
    if (shm->name[0] && shm_unlink(shm->name) != 0 && errno != ENOENT)
        PS_WARN(PS_SUB_SHARD, "cannot remove shared memory %s: %s", shm->name, strerror(errno));
    memset(shm, 0, sizeof(*shm));
}

int shard_shm_sweep(void)
{
    return ps_shm_sweep(PS_SHM_SERVER, "shard server") + ps_shm_sweep(PS_SHM_TRAINER, "trainer");
}
