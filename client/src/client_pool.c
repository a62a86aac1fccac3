/* The model region's free-list allocator (see client_pool.h). */
#include "client_pool.h"

#include <stdlib.h>
#include <string.h>

client_pool_t *client_pool_create(size_t start, size_t size)
{
    client_pool_t *p = calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    p->cap = 16;
    p->holes = malloc(p->cap * sizeof(client_pool_hole_t));
    if (!p->holes) {
        free(p);
        return NULL;
    }
    if (size > 0)
        p->holes[p->nholes++] = (client_pool_hole_t){start, size};
    return p;
}

void client_pool_destroy(client_pool_t *pool)
{
    if (!pool)
        return;
    free(pool->holes);
    free(pool);
}

size_t client_pool_block(size_t bytes)
{
    bytes = bytes ? bytes : 1;
    return (bytes + CLIENT_POOL_ALIGN - 1) / CLIENT_POOL_ALIGN * CLIENT_POOL_ALIGN;
}

static bool holes_reserve(client_pool_t *p)
{
    if (p->nholes < p->cap)
        return true;
    size_t cap = 2 * p->cap;
    client_pool_hole_t *nh = realloc(p->holes, cap * sizeof(client_pool_hole_t));
    if (!nh)
        return false;
    p->holes = nh;
    p->cap = cap;
    return true;
}

void client_pool_hold(client_pool_t *p, size_t bytes)
{
    p->in_use_bytes += client_pool_block(bytes);
    if (p->in_use_bytes > p->peak_in_use_bytes)
        p->peak_in_use_bytes = p->in_use_bytes;
}

void client_pool_unhold(client_pool_t *p, size_t bytes)
{
    p->in_use_bytes -= client_pool_block(bytes);
}

bool client_pool_alloc(client_pool_t *p, size_t bytes, size_t align, size_t *off)
{
    bytes = client_pool_block(bytes);
    for (size_t h = 0; h < p->nholes; h++) {
        client_pool_hole_t *hole = &p->holes[h];
        size_t start = (hole->off + align - 1) / align * align;
        size_t lead = start - hole->off;
        if (hole->bytes < lead || hole->bytes - lead < bytes)
            continue;
        if (lead > 0 && hole->bytes - lead > bytes) {
            /* [hole.off, start) stays a hole and the rest after the block becomes one. */
            if (!holes_reserve(p))
                continue;
            hole = &p->holes[h];
            memmove(&p->holes[h + 2], &p->holes[h + 1],
                    (p->nholes - h - 1) * sizeof(client_pool_hole_t));
            p->holes[h + 1] = (client_pool_hole_t){start + bytes, hole->bytes - lead - bytes};
            hole->bytes = lead;
            p->nholes++;
        } else if (lead > 0) {
            hole->bytes = lead; /* the block ends the hole */
        } else {
            hole->off += bytes;
            hole->bytes -= bytes;
            if (hole->bytes == 0) {
                memmove(&p->holes[h], &p->holes[h + 1],
                        (p->nholes - h - 1) * sizeof(client_pool_hole_t));
                p->nholes--;
            }
        }
        *off = start;
        client_pool_hold(p, bytes);
        if (start + bytes > p->touched_bytes)
            p->touched_bytes = start + bytes;
        return true;
    }
    return false;
}

void client_pool_free(client_pool_t *p, size_t off, size_t bytes)
{
    bytes = client_pool_block(bytes);
    p->in_use_bytes -= bytes;
    size_t h = 0;
    while (h < p->nholes && p->holes[h].off < off)
        h++;
    bool merge_prev = h > 0 && p->holes[h - 1].off + p->holes[h - 1].bytes == off;
    bool merge_next = h < p->nholes && off + bytes == p->holes[h].off;
    if (merge_prev && merge_next) {
        p->holes[h - 1].bytes += bytes + p->holes[h].bytes;
        memmove(&p->holes[h], &p->holes[h + 1], (p->nholes - h - 1) * sizeof(client_pool_hole_t));
        p->nholes--;
    } else if (merge_prev) {
        p->holes[h - 1].bytes += bytes;
    } else if (merge_next) {
        p->holes[h].off = off;
        p->holes[h].bytes += bytes;
    } else {
        if (!holes_reserve(p))
            return;
        memmove(&p->holes[h + 1], &p->holes[h], (p->nholes - h) * sizeof(client_pool_hole_t));
        p->holes[h] = (client_pool_hole_t){off, bytes};
        p->nholes++;
    }
}
