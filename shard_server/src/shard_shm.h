/* The shared-memory object a shard server keeps a model's host-resident master weights and
 * gradient accumulator in, so that its trainer can map them (pshard_shard_view): created per
 * model as "/pshard-srv-PID-NS-HEX" (mode 0600; NS is the PID namespace's id in hex, HEX
 * random), unlinked when the model is freed, and the leftovers of servers that died swept when
 * a server starts. Not thread-safe: one owner each. */
#ifndef PSHARD_SHARD_SHM_H
#define PSHARD_SHARD_SHM_H

#include <stddef.h>

#include "pshard/status.h"

typedef struct {
    char name[64]; /* "" when there is none */
    void *base;    /* MAP_SHARED mapping of the whole object */
    size_t bytes;
    int guard; /* its ps_shm_guard id + 1 (0: none) */
} shard_shm_t;

/* Creates a new object of bytes (> 0) bytes, maps it, advises huge pages from huge_from bytes
 * on and backs every page now (zeros). The space is reserved with posix_fallocate first, so a
 * full /dev/shm is an error here (RESOURCE_EXHAUSTED, message saying so) rather than a SIGBUS
 * at the first touch; other errors are SYSTEM. On error nothing is left behind. Release with
 * shard_shm_destroy. */
pshard_status_t shard_shm_create(size_t bytes, size_t huge_from, shard_shm_t *out, char *err,
                                 size_t errlen);

/* Unmaps and unlinks the object (a trainer's mapping stays valid until it unmaps). Zeroes
 * *shm; an empty one is a no-op. */
void shard_shm_destroy(shard_shm_t *shm);

/* Removes what dead shard servers and trainers left in /dev/shm (ps_shm_sweep of both
 * prefixes). Returns how many were removed. */
int shard_shm_sweep(void);

#endif
