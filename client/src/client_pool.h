/* The model region's allocator inside libpshard: a free list of [offset, size) holes over one
 * range of the region, kept sorted by offset and coalesced. Full parameters and gradients take
 * a block while they are unsharded and give it back afterwards, so only what is unsharded at
 * once is backed by memory. Not thread-safe: the client calls it holding its mutex. */
#ifndef PSHARD_CLIENT_POOL_H
#define PSHARD_CLIENT_POOL_H

#include <stdbool.h>
#include <stddef.h>

#define CLIENT_POOL_ALIGN 64 /* every block's size is rounded up to this, and starts on it */

typedef struct {
    size_t off, bytes;
} client_pool_hole_t;

typedef struct {
    client_pool_hole_t *holes;
    size_t nholes, cap;
    size_t in_use_bytes;      /* held now: pool blocks and client_pool_hold's */
    size_t peak_in_use_bytes; /* the most held at once */
    size_t touched_bytes;     /* the highest end of a block ever handed out */
} client_pool_t;

/* A pool of the size bytes at start of the region (start a multiple of CLIENT_POOL_ALIGN), all
 * free. NULL without memory. Free with client_pool_destroy (NULL is a no-op). */
client_pool_t *client_pool_create(size_t start, size_t size);
void client_pool_destroy(client_pool_t *pool);

/* Size of a block of `bytes` (0 counts as 1): rounded up to CLIENT_POOL_ALIGN. */
size_t client_pool_block(size_t bytes);

/* First fit from the low end, so that a repeating pattern of takes and gives reuses the same
 * (already backed) blocks: a block of client_pool_block(bytes) starting at a multiple of
 * align (a multiple of CLIENT_POOL_ALIGN). false when no hole fits; a hole that would be cut
 * in two needs a list entry, and without memory for it that hole is passed over. */
bool client_pool_alloc(client_pool_t *pool, size_t bytes, size_t align, size_t *off);

/* Gives back a block client_pool_alloc returned (same bytes) and merges it with its
 * neighbours. Without memory for a new list entry the block is lost to the pool (never handed
 * out twice). */
void client_pool_free(client_pool_t *pool, size_t off, size_t bytes);

/* Counts a block held outside the free list (a fixed parameter buffer) in in_use_bytes, or
 * stops counting it. */
void client_pool_hold(client_pool_t *pool, size_t bytes);
void client_pool_unhold(client_pool_t *pool, size_t bytes);

#endif
