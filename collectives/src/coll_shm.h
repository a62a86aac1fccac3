/* The same-host transport ("shm") of the tcp backend: when every rank of a ring runs on one
 * host, in one pid namespace, and may read the others' memory (process_vm_readv, Linux's
 * cross-memory attach, allowed by the same ptrace check as a debugger), an operation's data
 * moves by each rank reading the others' buffers straight into its own: one copy, against two
 * copies and the TCP stack through the sockets. The sockets still carry the descriptors (with
 * the buffers' addresses), the phase notices, aborts and failure detection (coll_tcp.c).
 * Chosen at set-up: every rank proves it can read every other by reading back a secret the
 * other holds (PSHARD_TRANSPORT=tcp|shm forces one). Thread safety: a coll_shm_t is used by
 * its communicator's engine thread only. */
#ifndef PSHARD_COLL_SHM_H
#define PSHARD_COLL_SHM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "coll_buf.h"
#include "coll_wire.h"
#include "pshard/dtype.h"
#include "pshard/status.h"

typedef enum {
    COLL_TRANSPORT_AUTO = 0, /* shm when every rank can read every other, else tcp */
    COLL_TRANSPORT_TCP,
    COLL_TRANSPORT_SHM, /* shm or a set-up error saying why not */
} coll_transport_t;

/* value (NULL: the environment's PSHARD_TRANSPORT): NULL, "" or "auto", "tcp", "shm".
 * INVALID_ARGUMENT naming the value. */
pshard_status_t coll_transport_parse(const char *value, coll_transport_t *out, char *err,
                                     size_t errlen);

/* The largest piece one coll_shm_read copies (the engine checks abort and deadlines between
 * pieces) and the elements one coll_shm_reduce call reduces. */
#define COLL_SHM_PIECE (4u << 20)
#define COLL_SHM_REDUCE_MAX (1u << 20)

typedef struct coll_shm coll_shm_t;

/* This process's PEER record as rank `rank`: the secret it proves itself with is the 16 bytes
 * at probe, which must stay there while the communicator lives. */
void coll_shm_self(uint32_t rank, const uint8_t probe[16], coll_peer_t *out);

/* Whether this process (whose record is me) can read peer's memory: the same boot, the same
 * pid namespace, and peer's secret read back from its address. false with the reason in why. */
bool coll_shm_can_read(const coll_peer_t *me, const coll_peer_t *peer, char *why, size_t whylen);

/* The transport of a ring of n ranks that can all read each other; recs holds every rank's
 * record, by rank. NULL when out of memory. Free with coll_shm_destroy (NULL is a no-op). */
coll_shm_t *coll_shm_create(int n, int rank, const coll_peer_t *recs);
void coll_shm_destroy(coll_shm_t *s);

/* Whether rank q's process still runs (true where that cannot be known), and its pid. */
bool coll_shm_alive(const coll_shm_t *s, int q);
int coll_shm_pid(const coll_shm_t *s, int q);

/* Copies len (<= COLL_SHM_PIECE) bytes at src_addr in rank q's memory to dst. Errors:
 * PEER_LOST (q's process is gone), DESYNC (q named memory it does not have), SYSTEM. */
pshard_status_t coll_shm_read(coll_shm_t *s, int q, void *dst, uint64_t src_addr, size_t len,
                              char *err, size_t errlen);

/* Copies len bytes from logical offset roff of rank q's buffer `remote` (its addresses) to
 * logical offset loff of this rank's buffer `local`, piece by piece. Errors as coll_shm_read's. */
pshard_status_t coll_shm_read_buf(coll_shm_t *s, int q, coll_buf_t *local, uint64_t loff,
                                  coll_buf_t *remote, uint64_t roff, size_t len, char *err,
                                  size_t errlen);

/* Reads rank q's table of npieces pieces at addr into *out (a buffer of `bytes` bytes in all;
 * free with coll_buf_free), or makes *out the whole buffer at addr when npieces is 0. Errors:
 * coll_shm_read's, DESYNC when the pieces do not hold `bytes`, NO_MEMORY. */
pshard_status_t coll_shm_fetch_buf(coll_shm_t *s, int q, uint64_t addr, uint32_t npieces,
                                   uint64_t bytes, coll_buf_t *out, char *err, size_t errlen);

/* Writes scale * the reduction (red, a pshard_reduce_t) over every rank q of the count elements
 * (dtype dt) at byte offset off of q's buffer bufs[q] to `out` at out_off; this rank's own
 * come from `own` at own_off (bufs[rank] is not read); half types reduce in fp32 and round
 * once, as the ring does.
 * count <= COLL_SHM_REDUCE_MAX. out may be own. Errors as coll_shm_read's. */
pshard_status_t coll_shm_reduce(coll_shm_t *s, coll_buf_t *bufs, uint64_t off, coll_buf_t *own,
                                uint64_t own_off, coll_buf_t *out, uint64_t out_off,
                                pshard_dtype_t dt, int red, size_t count, double scale, char *err,
                                size_t errlen);

#endif
