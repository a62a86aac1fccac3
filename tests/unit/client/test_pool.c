/* Unit tests of libpshard's model-region allocator (client/src/client_pool.h): first fit from
 * the low end, alignment, coalescing, exhaustion, the counters, and a random run checked
 * against a byte map of what is handed out. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "client_pool.h"
#include "ps_test.h"

/* The list is sorted, disjoint, not touching (coalesced), inside [start, start + size). */
static void check_holes(const client_pool_t *p, size_t start, size_t size)
{
    for (size_t h = 0; h < p->nholes; h++) {
        CU_ASSERT(p->holes[h].bytes > 0);
        CU_ASSERT(p->holes[h].off >= start);
        CU_ASSERT(p->holes[h].off + p->holes[h].bytes <= start + size);
        if (h > 0)
            CU_ASSERT(p->holes[h - 1].off + p->holes[h - 1].bytes < p->holes[h].off);
    }
}

static void test_first_fit_from_low_end(void)
{
    client_pool_t *p = client_pool_create(0, 4096);
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    size_t a, b, c;
    CU_ASSERT(client_pool_alloc(p, 1, CLIENT_POOL_ALIGN, &a));
    CU_ASSERT(client_pool_alloc(p, 100, CLIENT_POOL_ALIGN, &b));
    CU_ASSERT(client_pool_alloc(p, 64, CLIENT_POOL_ALIGN, &c));
    CU_ASSERT_EQUAL(a, 0);
    CU_ASSERT_EQUAL(b, 64);  /* 1 byte takes one 64-byte block */
    CU_ASSERT_EQUAL(c, 192); /* 100 bytes take 128 */
    CU_ASSERT_EQUAL(p->in_use_bytes, 256);
    CU_ASSERT_EQUAL(p->touched_bytes, 256);
    /* A freed block is the first fit for the next one that fits in it. */
    client_pool_free(p, b, 100);
    size_t d;
    CU_ASSERT(client_pool_alloc(p, 70, CLIENT_POOL_ALIGN, &d));
    CU_ASSERT_EQUAL(d, 64);
    CU_ASSERT_EQUAL(p->touched_bytes, 256);
    check_holes(p, 0, 4096);
    client_pool_destroy(p);
    client_pool_destroy(NULL);
}

static void test_coalescing(void)
{
    client_pool_t *p = client_pool_create(128, 1024);
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    size_t a, b, c;
    CU_ASSERT(client_pool_alloc(p, 128, CLIENT_POOL_ALIGN, &a));
    CU_ASSERT(client_pool_alloc(p, 128, CLIENT_POOL_ALIGN, &b));
    CU_ASSERT(client_pool_alloc(p, 128, CLIENT_POOL_ALIGN, &c));
    client_pool_free(p, b, 128); /* a hole between two blocks */
    CU_ASSERT_EQUAL(p->nholes, 2);
    client_pool_free(p, a, 128); /* merges with the hole after it */
    CU_ASSERT_EQUAL(p->nholes, 2);
    CU_ASSERT_EQUAL(p->holes[0].off, 128);
    CU_ASSERT_EQUAL(p->holes[0].bytes, 256);
    client_pool_free(p, c, 128); /* merges with both neighbours */
    CU_ASSERT_EQUAL_FATAL(p->nholes, 1);
    CU_ASSERT_EQUAL(p->holes[0].off, 128);
    CU_ASSERT_EQUAL(p->holes[0].bytes, 1024);
    CU_ASSERT_EQUAL(p->in_use_bytes, 0);
    CU_ASSERT_EQUAL(p->peak_in_use_bytes, 384);
    client_pool_destroy(p);
}

static void test_alignment_splits_a_hole(void)
{
    client_pool_t *p = client_pool_create(64, 3 * 4096);
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    size_t a;
    CU_ASSERT(client_pool_alloc(p, 100, 4096, &a));
    CU_ASSERT_EQUAL(a, 4096);
    /* [64, 4096) stays free before the block and the rest after it. */
    CU_ASSERT_EQUAL_FATAL(p->nholes, 2);
    CU_ASSERT_EQUAL(p->holes[0].off, 64);
    CU_ASSERT_EQUAL(p->holes[0].bytes, 4096 - 64);
    CU_ASSERT_EQUAL(p->holes[1].off, 4096 + 128);
    size_t b;
    CU_ASSERT(client_pool_alloc(p, 64, CLIENT_POOL_ALIGN, &b));
    CU_ASSERT_EQUAL(b, 64); /* the lead is still usable */
    /* A block that ends a hole exactly: no new entry. */
    size_t c;
    CU_ASSERT(client_pool_alloc(p, 4096 - 128, CLIENT_POOL_ALIGN, &c));
    CU_ASSERT_EQUAL(c, 128);
    CU_ASSERT_EQUAL(p->nholes, 1);
    client_pool_free(p, a, 100);
    client_pool_free(p, b, 64);
    client_pool_free(p, c, 4096 - 128);
    CU_ASSERT_EQUAL_FATAL(p->nholes, 1);
    CU_ASSERT_EQUAL(p->holes[0].bytes, 3 * 4096);
    client_pool_destroy(p);
}

static void test_exhaustion(void)
{
    client_pool_t *p = client_pool_create(0, 256);
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    size_t a, b;
    CU_ASSERT_FALSE(client_pool_alloc(p, 257, CLIENT_POOL_ALIGN, &a));
    CU_ASSERT(client_pool_alloc(p, 200, CLIENT_POOL_ALIGN, &a)); /* 256: all of it */
    CU_ASSERT_EQUAL(p->nholes, 0);
    CU_ASSERT_FALSE(client_pool_alloc(p, 1, CLIENT_POOL_ALIGN, &b));
    CU_ASSERT_EQUAL(p->in_use_bytes, 256);
    client_pool_free(p, a, 200);
    CU_ASSERT(client_pool_alloc(p, 1, CLIENT_POOL_ALIGN, &b));
    CU_ASSERT_EQUAL(b, 0);
    client_pool_destroy(p);

    client_pool_t *empty = client_pool_create(0, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(empty);
    CU_ASSERT_FALSE(client_pool_alloc(empty, 1, CLIENT_POOL_ALIGN, &a));
    client_pool_destroy(empty);
}

static void test_hold_counts_outside_blocks(void)
{
    client_pool_t *p = client_pool_create(4096, 4096);
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    client_pool_hold(p, 10); /* a fixed buffer of 10 bytes: one 64-byte block */
    CU_ASSERT_EQUAL(p->in_use_bytes, 64);
    size_t a;
    CU_ASSERT(client_pool_alloc(p, 64, CLIENT_POOL_ALIGN, &a));
    CU_ASSERT_EQUAL(p->in_use_bytes, 128);
    client_pool_unhold(p, 10);
    client_pool_free(p, a, 64);
    CU_ASSERT_EQUAL(p->in_use_bytes, 0);
    CU_ASSERT_EQUAL(p->peak_in_use_bytes, 128);
    CU_ASSERT_EQUAL(p->touched_bytes, 4096 + 64); /* held bytes are not pool offsets */
    client_pool_destroy(p);
}

static void test_many_holes_grow_the_list(void)
{
    enum { N = 200 };
    client_pool_t *p = client_pool_create(0, N * 64);
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    size_t off[N];
    for (int i = 0; i < N; i++)
        CU_ASSERT_FATAL(client_pool_alloc(p, 64, CLIENT_POOL_ALIGN, &off[i]));
    for (int i = 0; i < N; i += 2)
        client_pool_free(p, off[i], 64);
    CU_ASSERT_EQUAL(p->nholes, N / 2); /* beyond the 16 entries it starts with */
    check_holes(p, 0, N * 64);
    for (int i = 1; i < N; i += 2)
        client_pool_free(p, off[i], 64);
    CU_ASSERT_EQUAL_FATAL(p->nholes, 1);
    CU_ASSERT_EQUAL(p->holes[0].bytes, N * 64);
    client_pool_destroy(p);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Random takes and gives, every block checked against a map of the bytes handed out: never
 * overlapping, always inside the pool and aligned, counters exact, and a first-fit promise:
 * a failed take means no hole could hold it. */
static void test_random_against_byte_map(void)
{
    enum { START = 256, SIZE = 64 * 1024, LIVE = 64, ROUNDS = 20000 };
    client_pool_t *p = client_pool_create(START, SIZE);
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    unsigned char *map = calloc(START + SIZE, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(map);
    struct {
        size_t off, bytes;
        bool live;
    } blocks[LIVE] = {{0}};
    size_t in_use = 0;
    int failures = 0;
    for (int r = 0; r < ROUNDS; r++) {
        int k = (int)(rng() % LIVE);
        if (blocks[k].live) {
            size_t blk = client_pool_block(blocks[k].bytes);
            memset(map + blocks[k].off, 0, blk);
            client_pool_free(p, blocks[k].off, blocks[k].bytes);
            in_use -= blk;
            blocks[k].live = false;
        } else {
            size_t bytes = (size_t)(rng() % 3000);
            size_t align = rng() % 4 == 0 ? 1024 : CLIENT_POOL_ALIGN;
            size_t off;
            if (!client_pool_alloc(p, bytes, align, &off)) {
                size_t blk = client_pool_block(bytes);
                for (size_t h = 0; h < p->nholes; h++) {
                    size_t s = (p->holes[h].off + align - 1) / align * align;
                    CU_ASSERT(s + blk > p->holes[h].off + p->holes[h].bytes);
                }
                failures++;
                continue;
            }
            size_t blk = client_pool_block(bytes);
            CU_ASSERT(off % align == 0);
            CU_ASSERT(off >= START && off + blk <= START + SIZE);
            bool clash = false;
            for (size_t i = 0; i < blk; i++)
                clash |= map[off + i] != 0;
            CU_ASSERT_FALSE(clash);
            memset(map + off, 1, blk);
            in_use += blk;
            blocks[k].off = off;
            blocks[k].bytes = bytes;
            blocks[k].live = true;
        }
        CU_ASSERT_EQUAL(p->in_use_bytes, in_use);
    }
    check_holes(p, START, SIZE);
    /* What is free plus what is held is the whole pool. */
    size_t free_bytes = 0;
    for (size_t h = 0; h < p->nholes; h++)
        free_bytes += p->holes[h].bytes;
    CU_ASSERT_EQUAL(free_bytes + in_use, SIZE);
    for (int k = 0; k < LIVE; k++)
        if (blocks[k].live)
            client_pool_free(p, blocks[k].off, blocks[k].bytes);
    CU_ASSERT_EQUAL_FATAL(p->nholes, 1);
    CU_ASSERT_EQUAL(p->holes[0].off, START);
    CU_ASSERT_EQUAL(p->holes[0].bytes, SIZE);
    CU_ASSERT_EQUAL(p->in_use_bytes, 0);
    CU_ASSERT(failures > 0); /* the run did reach a full pool */
    free(map);
    client_pool_destroy(p);
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"first fit from the low end", test_first_fit_from_low_end},
        {"coalescing", test_coalescing},
        {"alignment splits a hole", test_alignment_splits_a_hole},
        {"exhaustion", test_exhaustion},
        {"hold counts outside blocks", test_hold_counts_outside_blocks},
        {"many holes grow the list", test_many_holes_grow_the_list},
        {"random against a byte map", test_random_against_byte_map},
        {NULL, NULL},
    };
    return ps_test_main("client_pool", cases);
}
