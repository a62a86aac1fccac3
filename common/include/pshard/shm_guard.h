/* Shared memory that another process can shrink under this one's mapping (a trainer's region,
 * a shard server's own object: any process of the same user can open and truncate them). An
 * access past the new end raises SIGBUS, which would kill the process; for a guarded mapping
 * the handler instead puts zero-filled private pages over the rest of the mapping, from the
 * faulting page on, marks the mapping lost and lets the access go on. The owner asks
 * ps_shm_guard_lost at the end of each operation on it and fails the operation, naming the
 * object: what the mapping holds is no longer what the other processes see. A SIGBUS anywhere
 * else goes to the handler that was there before (the default one: the process dies). */
#ifndef PSHARD_SHM_GUARD_H
#define PSHARD_SHM_GUARD_H

#include <stdbool.h>
#include <stddef.h>

/* At most this many mappings are guarded at once (a shard server has a handful). */
#define PS_SHM_GUARD_MAX 64

/* Guards [base, base + bytes) (a mapping's start; bytes is rounded up to whole pages), installing
 * the handler on first use. Returns the guard's id, or -1 when the table is full or the handler
 * cannot be installed (logged: the mapping stays unguarded). */
int ps_shm_guard_add(void *base, size_t bytes);

/* True once a guarded access found the mapping shrunk (id -1: false). */
bool ps_shm_guard_lost(int id);

/* Stops guarding id (-1: nothing); call before unmapping. */
void ps_shm_guard_remove(int id);

#endif
