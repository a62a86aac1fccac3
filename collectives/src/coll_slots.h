/* The operations of a same-host ring, run through one shared segment of slots instead of the
 * ring's sockets: each rank writes its descriptor (and the data of a small operation) into its
 * own slot and raises a sequence word, then reads every other rank's slot once that rank's word
 * reaches the same operation, spinning briefly and then sleeping on the rank's bell (a futex).
 * A small operation (its data fits a slot) then completes from the slots; a bigger one reads
 * the others' buffers, whose addresses the descriptors carry (process_vm_readv, coll_shm.h),
 * raises a stage word after each phase of reading, and completes once every rank finished
 * reading its buffers. Either runs in whichever thread gets to it: the caller's (a blocking
 * call, or a small operation) or the engine's (an asynchronous big one), one at a time.
 * A reduction of a small operation is summed on every rank in rank order, so every rank gets
 * the same bits; a big one's blocks are each reduced once, by their owner.
 *
 * Two slots a rank, by sequence parity: a rank reaches operation s + 2 only after every rank
 * posted s + 1, which each does only after it finished reading s, so a slot is never written
 * while another rank may read it.
 *
 * The segment also carries the communicator's first failure (an abort record), which every
 * rank's waiters read, and each rank's "closed" mark; a rank's lost process is named by its
 * pidfd.
 *
 * The segment is a memfd made by rank 0 and opened by the others through /proc/PID/fd, the
 * same permission as reading another process's memory (which the transport has proven): it
 * has no name, so a killed rank leaves nothing in /dev/shm. */
#ifndef PSHARD_COLL_SLOTS_H
#define PSHARD_COLL_SLOTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "coll_internal.h"
#include "coll_shm.h"

typedef struct coll_slots coll_slots_t;

/* Default data bytes a slot holds (PSHARD_SHM_SLOT_BYTES on rank 0 sets it, 0 turns the fast
 * path off); the segment is capped so that n ranks' slots stay within COLL_SLOTS_MAX_SEGMENT. */
#define COLL_SLOTS_DEFAULT_BYTES (32u << 10)
#define COLL_SLOTS_MAX_BYTES (1u << 20)
#define COLL_SLOTS_MAX_SEGMENT (16u << 20)

/* Rank 0: makes the segment for n ranks, stamped with nonce (its transport secret, which the
 * others check). *fd is the memfd the others open through /proc/<pid>/fd/<fd>, kept open until
 * coll_slots_setup_done. NULL with why (e.g. the fast path is turned off) when it cannot. */
coll_slots_t *coll_slots_create(int n, const uint8_t nonce[16], int *fd, char *why, size_t whylen);

/* Ranks other than 0: opens rank 0's segment (its pid and fd), and checks that it is the one
 * made for n ranks with nonce. NULL with why when it cannot. */
coll_slots_t *coll_slots_attach(int n, int rank, pid_t pid0, int fd0, const uint8_t nonce[16],
                                char *why, size_t whylen);

/* Set-up finished on every rank (rank 0 closes its fd). */
void coll_slots_setup_done(coll_slots_t *s);

/* Marks this rank's slot closed (a waiting peer then reports it lost) and wakes the peers.
 * NULL is a no-op. Not concurrently with coll_slots_run. */
void coll_slots_close(coll_slots_t *s);

/* Closes (as coll_slots_close) and unmaps. NULL is a no-op. */
void coll_slots_destroy(coll_slots_t *s);

/* Whether op runs through the slots: an all-gather, reduce-scatter, all-reduce, broadcast or
 * barrier (what reduce, gather, scatter and all-to-all run as). NULL s: no. */
bool coll_slots_takes(const coll_slots_t *s, const coll_op_t *op);

/* Whether op's data travels in the slots: every rank's fits one. Depends only on what every
 * rank's descriptor holds, so it is the same on every rank. */
bool coll_slots_fits(const coll_slots_t *s, const coll_op_t *op);

/* Runs op (coll_slots_takes; its desc.seq assigned) in the calling thread; nothing else of
 * the communicator may run meanwhile. shm reads the others' memory and names lost processes.
 * Errors: DIVERTED (every rank's descriptor is divertible and some differ: nothing moved,
 * nothing failed; every rank reads every descriptor before it decides), DESYNC (a rank posted
 * another descriptor, naming both; or named memory it does not have), TIMEOUT (naming the rank not
 * yet there), PEER_LOST (a rank's process exited or it closed the communicator), ABORTED or
 * whatever the abort record says (an abort anywhere), each with its message in err. */
pshard_status_t coll_slots_run(coll_slots_t *s, coll_shm_t *shm, pshard_comm_t *comm, coll_op_t *op,
                               char *err, size_t errlen);

/* Writes the communicator's first failure (rank, status, message) for every rank, unless one
 * is there already, and wakes every waiter. Any thread. */
void coll_slots_abort(coll_slots_t *s, pshard_status_t status, const char *msg);

/* Whether a failure was recorded: its status, and its message with the rank that reported it,
 * in msg. Any thread. */
bool coll_slots_aborted(coll_slots_t *s, pshard_status_t *status, char *msg, size_t msglen);

/* For an operation whose peers read this rank's memory (the engine's same-host path and the
 * slots' big operations): puts this rank's own block where the others read it (all-gather: into
 * its output; a broadcast root: to its recv), so that they never read a send buffer this copy
 * overlaps, and writes the buffers' addresses (or their piece tables') into op->desc. */
void coll_publish_buffers(coll_op_t *op, int rank, int n);

/* The data bytes a slot holds. */
size_t coll_slots_bytes(const coll_slots_t *s);

#endif
