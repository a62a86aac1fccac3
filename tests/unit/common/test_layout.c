/* Unit tests for pshard/layout.h: FSDP2 dim-0 sharding (divisible and ragged row counts, fewer
 * rows than ranks, world 1), FSDP1 flat sharding (parameters cut anywhere, padding only at the
 * end), the invariants both share (counts sum to numel, pieces contiguous in rank order, shards
 * back to back), an exhaustive cross-check against a brute-force owner of every element on
 * random shapes, and argument errors. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_test.h"
#include "pshard/layout.h"

static ps_layout_t *make(pshard_layout_t kind, int world, size_t nparams, const size_t *numel,
                         const size_t *rows)
{
    ps_layout_t *layout = NULL;
    char err[256] = "";
    pshard_status_t rc =
        ps_layout_create(kind, world, nparams, numel, rows, &layout, err, sizeof err);
    if (rc != PSHARD_OK)
        fprintf(stderr, "ps_layout_create: %s\n", err);
    CU_ASSERT_EQUAL_FATAL(rc, PSHARD_OK);
    CU_ASSERT_PTR_NOT_NULL_FATAL(layout);
    return layout;
}

/* The invariants every layout keeps; returns 1 when all hold. */
static int check_invariants(const ps_layout_t *layout)
{
    int ok = 1;
    int world = ps_layout_world(layout);
    size_t nparams = ps_layout_nparams(layout);
    size_t *shard_pos = calloc((size_t)world, sizeof(size_t));
    if (!shard_pos)
        return 0;
    for (size_t p = 0; p < nparams; p++) {
        const size_t *counts = ps_layout_counts(layout, p);
        size_t sum = 0;
        for (int r = 0; r < world; r++) {
            /* Pieces are contiguous and in rank order: each starts where the previous ended. */
            ok &= ps_layout_piece_offset(layout, p, r) == sum;
            /* A rank's pieces are back to back in parameter order. */
            ok &= ps_layout_shard_offset(layout, p, r) == shard_pos[r];
            shard_pos[r] += counts[r];
            sum += counts[r];
        }
        ok &= sum == ps_layout_numel(layout, p);
    }
    for (int r = 0; r < world; r++)
        ok &= ps_layout_shard_numel(layout, r) == shard_pos[r];
    free(shard_pos);
    return ok;
}

static void expect_counts(const ps_layout_t *layout, size_t p, const size_t *want, int world)
{
    const size_t *got = ps_layout_counts(layout, p);
    for (int r = 0; r < world; r++) {
        if (got[r] != want[r])
            fprintf(stderr, "param %zu rank %d: count %zu, want %zu\n", p, r, got[r], want[r]);
        CU_ASSERT_EQUAL(got[r], want[r]);
    }
}

/* ---- FSDP2 ---- */

static void test_fsdp2_divisible(void)
{
    /* 8 x 3 over 4 ranks: 2 rows = 6 elements each. */
    size_t numel[] = {24}, rows[] = {8};
    ps_layout_t *l = make(PSHARD_LAYOUT_FSDP2, 4, 1, numel, rows);
    size_t want[] = {6, 6, 6, 6};
    expect_counts(l, 0, want, 4);
    CU_ASSERT_EQUAL(ps_layout_piece_offset(l, 0, 2), 12);
    CU_ASSERT_EQUAL(ps_layout_kind(l), PSHARD_LAYOUT_FSDP2);
    CU_ASSERT_EQUAL(ps_layout_world(l), 4);
    CU_ASSERT_EQUAL(ps_layout_nparams(l), 1);
    CU_ASSERT_EQUAL(ps_layout_numel(l, 0), 24);
    CU_ASSERT(check_invariants(l));
    ps_layout_destroy(l);
}

static void test_fsdp2_ragged(void)
{
    /* 10 rows x 5 over 4 ranks: chunk ceil(10/4) = 3 rows -> 3, 3, 3, 1 rows. */
    size_t numel[] = {50}, rows[] = {10};
    ps_layout_t *l = make(PSHARD_LAYOUT_FSDP2, 4, 1, numel, rows);
    size_t want[] = {15, 15, 15, 5};
    expect_counts(l, 0, want, 4);
    CU_ASSERT_EQUAL(ps_layout_piece_offset(l, 0, 3), 45);
    CU_ASSERT(check_invariants(l));
    ps_layout_destroy(l);

    /* 9 rows over 4 ranks: chunk 3 -> 3, 3, 3, 0: the last rank owns nothing although 9 > 4. */
    size_t numel2[] = {9}, rows2[] = {9};
    l = make(PSHARD_LAYOUT_FSDP2, 4, 1, numel2, rows2);
    size_t want2[] = {3, 3, 3, 0};
    expect_counts(l, 0, want2, 4);
    CU_ASSERT_EQUAL(ps_layout_piece_offset(l, 0, 3), 9);
    CU_ASSERT(check_invariants(l));
    ps_layout_destroy(l);
}

static void test_fsdp2_fewer_rows_than_ranks(void)
{
    /* 3 rows x 4 over 8 ranks: chunk 1 -> ranks 0..2 own one row, ranks 3..7 nothing. */
    size_t numel[] = {12}, rows[] = {3};
    ps_layout_t *l = make(PSHARD_LAYOUT_FSDP2, 8, 1, numel, rows);
    size_t want[] = {4, 4, 4, 0, 0, 0, 0, 0};
    expect_counts(l, 0, want, 8);
    for (int r = 3; r < 8; r++) {
        CU_ASSERT_EQUAL(ps_layout_piece_offset(l, 0, r), 12);
        CU_ASSERT_EQUAL(ps_layout_shard_numel(l, r), 0);
    }
    CU_ASSERT(check_invariants(l));
    ps_layout_destroy(l);
}

static void test_fsdp2_one_row_and_world_one(void)
{
    /* A bias-like 1 x 7 parameter lives wholly on rank 0. */
    size_t numel[] = {7, 6}, rows[] = {1, 6};
    ps_layout_t *l = make(PSHARD_LAYOUT_FSDP2, 3, 2, numel, rows);
    size_t want0[] = {7, 0, 0}, want1[] = {2, 2, 2};
    expect_counts(l, 0, want0, 3);
    expect_counts(l, 1, want1, 3);
    CU_ASSERT_EQUAL(ps_layout_shard_offset(l, 1, 0), 7);
    CU_ASSERT_EQUAL(ps_layout_shard_offset(l, 1, 1), 0);
    CU_ASSERT_EQUAL(ps_layout_shard_numel(l, 0), 9);
    CU_ASSERT_EQUAL(ps_layout_shard_numel(l, 1), 2);
    CU_ASSERT(check_invariants(l));
    ps_layout_destroy(l);

    /* World 1 owns everything. */
    size_t numel1[] = {12, 5, 0}, rows1[] = {4, 5, 0};
    l = make(PSHARD_LAYOUT_FSDP2, 1, 3, numel1, rows1);
    CU_ASSERT_EQUAL(ps_layout_counts(l, 0)[0], 12);
    CU_ASSERT_EQUAL(ps_layout_counts(l, 1)[0], 5);
    CU_ASSERT_EQUAL(ps_layout_counts(l, 2)[0], 0);
    CU_ASSERT_EQUAL(ps_layout_shard_offset(l, 1, 0), 12);
    CU_ASSERT_EQUAL(ps_layout_shard_offset(l, 2, 0), 17);
    CU_ASSERT_EQUAL(ps_layout_shard_numel(l, 0), 17);
    CU_ASSERT(check_invariants(l));
    ps_layout_destroy(l);
}

static void test_fsdp2_shard_offsets(void)
{
    /* Three parameters over 2 ranks: each rank's pieces follow each other in its shard. */
    size_t numel[] = {6, 5, 8}, rows[] = {3, 5, 2};
    ps_layout_t *l = make(PSHARD_LAYOUT_FSDP2, 2, 3, numel, rows);
    /* p0: 2 rows x 2 | 1 row x 2 -> 4 | 2; p1: 3 | 2; p2: 4 | 4. */
    size_t want0[] = {4, 2}, want1[] = {3, 2}, want2[] = {4, 4};
    expect_counts(l, 0, want0, 2);
    expect_counts(l, 1, want1, 2);
    expect_counts(l, 2, want2, 2);
    CU_ASSERT_EQUAL(ps_layout_shard_offset(l, 0, 0), 0);
    CU_ASSERT_EQUAL(ps_layout_shard_offset(l, 1, 0), 4);
    CU_ASSERT_EQUAL(ps_layout_shard_offset(l, 2, 0), 7);
    CU_ASSERT_EQUAL(ps_layout_shard_offset(l, 1, 1), 2);
    CU_ASSERT_EQUAL(ps_layout_shard_offset(l, 2, 1), 4);
    CU_ASSERT_EQUAL(ps_layout_shard_numel(l, 0), 11);
    CU_ASSERT_EQUAL(ps_layout_shard_numel(l, 1), 8);
    CU_ASSERT(check_invariants(l));
    ps_layout_destroy(l);
}

/* ---- FSDP1 ---- */

static void test_fsdp1_cuts_parameters(void)
{
    /* 10 + 6 = 16 elements over 4 ranks: 4 each. Rank 2 owns p0[8..10) and p1[0..2). */
    size_t numel[] = {10, 6}, rows[] = {5, 3};
    ps_layout_t *l = make(PSHARD_LAYOUT_FSDP1, 4, 2, numel, rows);
    size_t want0[] = {4, 4, 2, 0}, want1[] = {0, 0, 2, 4};
    expect_counts(l, 0, want0, 4);
    expect_counts(l, 1, want1, 4);
    CU_ASSERT_EQUAL(ps_layout_kind(l), PSHARD_LAYOUT_FSDP1);
    CU_ASSERT_EQUAL(ps_layout_piece_offset(l, 0, 2), 8);
    CU_ASSERT_EQUAL(ps_layout_piece_offset(l, 1, 2), 0);
    CU_ASSERT_EQUAL(ps_layout_piece_offset(l, 1, 3), 2);
    CU_ASSERT_EQUAL(ps_layout_shard_offset(l, 1, 2), 2);
    CU_ASSERT_EQUAL(ps_layout_shard_offset(l, 1, 3), 0);
    for (int r = 0; r < 4; r++)
        CU_ASSERT_EQUAL(ps_layout_shard_numel(l, r), 4);
    CU_ASSERT(check_invariants(l));
    ps_layout_destroy(l);
}

static void test_fsdp1_padding_at_end(void)
{
    /* 7 + 3 = 10 over 4 ranks: padded to 12, chunk 3 -> 3, 3, 3, 1 (the padding is rank 3's). */
    size_t numel[] = {7, 3}, rows[] = {7, 1};
    ps_layout_t *l = make(PSHARD_LAYOUT_FSDP1, 4, 2, numel, rows);
    size_t want0[] = {3, 3, 1, 0}, want1[] = {0, 0, 2, 1};
    expect_counts(l, 0, want0, 4);
    expect_counts(l, 1, want1, 4);
    CU_ASSERT_EQUAL(ps_layout_shard_numel(l, 0), 3);
    CU_ASSERT_EQUAL(ps_layout_shard_numel(l, 2), 3);
    CU_ASSERT_EQUAL(ps_layout_shard_numel(l, 3), 1);
    CU_ASSERT(check_invariants(l));
    ps_layout_destroy(l);

    /* 2 elements over 4 ranks: chunk 1, the last two ranks own nothing. */
    size_t numel2[] = {2}, rows2[] = {2};
    l = make(PSHARD_LAYOUT_FSDP1, 4, 1, numel2, rows2);
    size_t want2[] = {1, 1, 0, 0};
    expect_counts(l, 0, want2, 4);
    CU_ASSERT_EQUAL(ps_layout_piece_offset(l, 0, 3), 2);
    CU_ASSERT(check_invariants(l));
    ps_layout_destroy(l);
}

static void test_fsdp1_ignores_rows(void)
{
    /* A parameter with one row is still split across ranks in FSDP1. */
    size_t numel[] = {8}, rows[] = {1};
    ps_layout_t *l = make(PSHARD_LAYOUT_FSDP1, 2, 1, numel, rows);
    size_t want[] = {4, 4};
    expect_counts(l, 0, want, 2);
    CU_ASSERT(check_invariants(l));
    ps_layout_destroy(l);
}

/* ---- brute-force cross-check ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(uint32_t bound)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    rng_state = x;
    return (uint32_t)((x >> 16) % bound);
}

/* Owner of element e of parameter p, straight from the definitions in DESIGN.md. */
static int brute_owner(pshard_layout_t kind, int world, const size_t *numel, const size_t *rows,
                       size_t nparams, size_t p, size_t e)
{
    if (kind == PSHARD_LAYOUT_FSDP2) {
        size_t row = e / (numel[p] / rows[p]);
        size_t chunk = (rows[p] + (size_t)world - 1) / (size_t)world;
        for (int r = 0; r < world; r++)
            if (row >= (size_t)r * chunk && row < (size_t)(r + 1) * chunk)
                return r;
        return -1;
    }
    size_t total = 0, base = 0;
    for (size_t q = 0; q < nparams; q++) {
        if (q < p)
            base += numel[q];
        total += numel[q];
    }
    size_t padded = total;
    while (padded % (size_t)world)
        padded++;
    size_t chunk = padded / (size_t)world;
    size_t flat = base + e;
    for (int r = 0; r < world; r++)
        if (flat >= (size_t)r * chunk && flat < (size_t)(r + 1) * chunk)
            return r;
    return -1;
}

static void cross_check(pshard_layout_t kind)
{
    enum { MAXP = 6 };
    int mismatches = 0;
    for (int iter = 0; iter < 400; iter++) {
        int world = 1 + (int)rnd(8);
        size_t nparams = 1 + rnd(MAXP);
        size_t numel[MAXP], rows[MAXP];
        for (size_t p = 0; p < nparams; p++) {
            /* Mostly small row counts around the world size, sometimes empty tensors. */
            rows[p] = rnd(12);
            size_t cols = 1 + rnd(5);
            if (rnd(10) == 0)
                cols = 0;
            if (rows[p] == 0)
                cols = 0;
            numel[p] = rows[p] * cols;
        }
        ps_layout_t *l = make(kind, world, nparams, numel, rows);
        CU_ASSERT(check_invariants(l));
        for (size_t p = 0; p < nparams; p++) {
            /* Count, for each rank, the elements the brute force gives it, and check they form
             * the range [piece_offset, piece_offset + count). */
            const size_t *counts = ps_layout_counts(l, p);
            for (size_t e = 0; e < numel[p]; e++) {
                int owner = brute_owner(kind, world, numel, rows, nparams, p, e);
                size_t off = owner >= 0 ? ps_layout_piece_offset(l, p, owner) : 0;
                if (owner < 0 || e < off || e >= off + counts[owner]) {
                    if (mismatches++ < 5)
                        fprintf(stderr, "kind %d world %d param %zu elem %zu: brute owner %d\n",
                                (int)kind, world, p, e, owner);
                }
            }
        }
        ps_layout_destroy(l);
    }
    CU_ASSERT_EQUAL(mismatches, 0);
}

static void test_cross_check_fsdp2(void)
{
    cross_check(PSHARD_LAYOUT_FSDP2);
}

static void test_cross_check_fsdp1(void)
{
    cross_check(PSHARD_LAYOUT_FSDP1);
}

/* ---- errors ---- */

static void expect_error(pshard_layout_t kind, int world, size_t nparams, const size_t *numel,
                         const size_t *rows, const char *needle)
{
    ps_layout_t *layout = (ps_layout_t *)(uintptr_t)1;
    char err[256] = "";
    pshard_status_t rc =
        ps_layout_create(kind, world, nparams, numel, rows, &layout, err, sizeof err);
    CU_ASSERT_EQUAL(rc, PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NULL(layout);
    if (!strstr(err, needle))
        fprintf(stderr, "error \"%s\" does not mention \"%s\"\n", err, needle);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, needle));
}

static void test_errors(void)
{
    size_t numel[] = {4, 6}, rows_zero[] = {2, 0}, rows_bad[] = {4, 4}, rows_ok[] = {2, 3};
    expect_error(PSHARD_LAYOUT_FSDP2, 2, 2, numel, rows_zero, "parameter 1");
    expect_error(PSHARD_LAYOUT_FSDP1, 2, 2, numel, rows_zero, "parameter 1");
    expect_error(PSHARD_LAYOUT_FSDP2, 2, 2, numel, rows_bad, "parameter 1");
    expect_error(PSHARD_LAYOUT_FSDP2, 0, 2, numel, rows_ok, "world");
    expect_error(PSHARD_LAYOUT_FSDP2, -3, 2, numel, rows_ok, "world");
    expect_error((pshard_layout_t)7, 2, 2, numel, rows_ok, "kind");
    /* The first error is the one kept in err. */
    char err[64] = "earlier";
    ps_layout_t *layout = NULL;
    CU_ASSERT_EQUAL(
        ps_layout_create(PSHARD_LAYOUT_FSDP2, 0, 2, numel, rows_ok, &layout, err, sizeof err),
        PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "earlier");
    /* No error buffer is fine; destroy(NULL) is a no-op. */
    CU_ASSERT_EQUAL(ps_layout_create(PSHARD_LAYOUT_FSDP2, 2, 2, numel, rows_zero, &layout, NULL, 0),
                    PSHARD_ERR_INVALID_ARGUMENT);
    ps_layout_destroy(NULL);
}

static void test_empty(void)
{
    /* No parameters: every shard is empty. */
    ps_layout_t *l = make(PSHARD_LAYOUT_FSDP1, 3, 0, NULL, NULL);
    CU_ASSERT_EQUAL(ps_layout_nparams(l), 0);
    CU_ASSERT_EQUAL(ps_layout_shard_numel(l, 2), 0);
    ps_layout_destroy(l);
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"fsdp2_divisible", test_fsdp2_divisible},
        {"fsdp2_ragged", test_fsdp2_ragged},
        {"fsdp2_fewer_rows_than_ranks", test_fsdp2_fewer_rows_than_ranks},
        {"fsdp2_one_row_and_world_one", test_fsdp2_one_row_and_world_one},
        {"fsdp2_shard_offsets", test_fsdp2_shard_offsets},
        {"fsdp1_cuts_parameters", test_fsdp1_cuts_parameters},
        {"fsdp1_padding_at_end", test_fsdp1_padding_at_end},
        {"fsdp1_ignores_rows", test_fsdp1_ignores_rows},
        {"cross_check_fsdp2", test_cross_check_fsdp2},
        {"cross_check_fsdp1", test_cross_check_fsdp1},
        {"errors", test_errors},
        {"empty", test_empty},
        {NULL, NULL},
    };
    return ps_test_main("layout", cases);
}
