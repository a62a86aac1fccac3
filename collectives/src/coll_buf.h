/* An operation's buffer as the engines see it: one contiguous range, or the pieces a caller
 * gave (pshard_coll_seg_t) laid end to end, addressed by logical byte offset either way. The
 * same-host transport reads a peer's buffer through the piece table the peer publishes, so
 * addresses are 64-bit integers here, not pointers. Not thread-safe (a lookup cursor). */
#ifndef PSHARD_COLL_BUF_H
#define PSHARD_COLL_BUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pshard/collectives.h"

/* One piece, as published to peers: little-endian u64 pairs on the wire of memory. */
typedef struct {
    uint64_t addr;
    uint64_t bytes;
} coll_piece_t;

typedef struct {
    uint64_t base;        /* contiguous: the buffer's address (npieces == 0) */
    coll_piece_t *pieces; /* else its pieces in logical order */
    size_t npieces;
    uint64_t *ends; /* logical byte offset where piece i ends */
    size_t cur;     /* the piece of the last lookup */
} coll_buf_t;

/* A contiguous buffer at p. */
coll_buf_t coll_buf_flat(const void *p);

/* A buffer of the n pieces segs (elements of esize bytes), which must hold `elements` in all.
 * The table is copied (free with coll_buf_free). Errors: INVALID_ARGUMENT (a NULL piece that
 * is not empty, counts that do not add up, naming which), NO_MEMORY. */
pshard_status_t coll_buf_from_segs(coll_buf_t *b, const pshard_coll_seg_t *segs, size_t n,
                                   size_t esize, size_t elements, const char *what, char *err,
                                   size_t errlen);
void coll_buf_free(coll_buf_t *b);

/* The address of logical byte off and how many bytes are contiguous from there (to the end of
 * its piece; UINT64_MAX for a contiguous buffer). off must lie inside the buffer. */
uint64_t coll_buf_at(coll_buf_t *b, uint64_t off, uint64_t *contig);

/* Local buffers: copies len bytes from src at soff to dst at doff (memmove within pieces). */
void coll_buf_copy(coll_buf_t *dst, uint64_t doff, coll_buf_t *src, uint64_t soff, size_t len);

/* The reductions of coll_reduce.h over a logical range of nel elements of dt at off. */
void coll_buf_load(void *acc, coll_buf_t *src, uint64_t off, pshard_dtype_t dt, size_t nel);
void coll_buf_accumulate(void *acc, coll_buf_t *src, uint64_t off, pshard_dtype_t dt, int red,
                         size_t nel);
void coll_buf_store(coll_buf_t *dst, uint64_t off, pshard_dtype_t dt, const void *acc, size_t nel,
                    double scale);

#endif
