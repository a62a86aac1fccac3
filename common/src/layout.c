/* Shard layout math (see pshard/layout.h): computes, once at creation, every rank's element
 * count, piece offset and shard offset for every parameter, so that the accessors are table
 * look-ups. Empty pieces get the offset where they would start, which keeps each parameter's
 * piece offsets equal to the prefix sums of its counts. */
#include "pshard/layout.h"

#include <assert.h>
#include <stdint.h>
#include <stdlib.h>

#include "pshard/util.h"

struct ps_layout {
    pshard_layout_t kind;
    int world;
    size_t nparams;
    size_t *numel;        /* [nparams] */
    size_t *counts;       /* [nparams * world]: elements of param p owned by rank r */
    size_t *piece_offset; /* [nparams * world]: start of that piece within param p */
    size_t *shard_offset; /* [nparams * world]: start of that piece within rank r's shard */
    size_t *shard_numel;  /* [world] */
};

static size_t min_size(size_t a, size_t b)
{
    return a < b ? a : b;
}

/* a clamped to [0, hi] for an a that may be "negative" (given as base > a). */
static size_t clamp_sub(size_t a, size_t base, size_t hi)
{
    if (a <= base)
        return 0;
    return min_size(a - base, hi);
}

/* First row owned by rank (the row count when rank owns none), without overflowing rank*chunk. */
static size_t fsdp2_first_row(size_t rows, size_t chunk, size_t rank)
{
    if (chunk == 0 || rank > rows / chunk)
        return rows;
    return min_size(rows, rank * chunk);
}

/* Checks every parameter's shape and the total size. */
static pshard_status_t check_params(int world, size_t nparams, const size_t *numel,
                                    const size_t *rows, size_t *total_out, char *err, size_t errlen)
{
    size_t total = 0;
    for (size_t p = 0; p < nparams; p++) {
        if (rows[p] == 0 && numel[p] > 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "parameter %zu: shape[0] is 0 but it has %zu elements", p, numel[p]);
        if (rows[p] > 0 && numel[p] % rows[p] != 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "parameter %zu: %zu elements is not a multiple of shape[0] = %zu", p,
                           numel[p], rows[p]);
        if (numel[p] > SIZE_MAX - total)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "parameter %zu: total element count overflows", p);
        total += numel[p];
    }
    /* FSDP1 pads the total up to a multiple of world; keep that representable. */
    if (total > SIZE_MAX - (size_t)world)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "total element count %zu is too large", total);
    *total_out = total;
    return PSHARD_OK;
}

/* Fills counts and piece offsets of parameter p for each layout. */
static void fill_fsdp2(ps_layout_t *layout, size_t p, size_t rows)
{
    size_t world = (size_t)layout->world;
    size_t row_elems = rows ? layout->numel[p] / rows : 0;
    size_t chunk = rows / world + (rows % world != 0);
    for (size_t r = 0; r < world; r++) {
        size_t first = fsdp2_first_row(rows, chunk, r);
        size_t end = fsdp2_first_row(rows, chunk, r + 1);
        layout->piece_offset[p * world + r] = first * row_elems;
        layout->counts[p * world + r] = (end - first) * row_elems;
    }
}

static void fill_fsdp1(ps_layout_t *layout, size_t p, size_t param_base, size_t chunk)
{
    size_t world = (size_t)layout->world;
    size_t numel = layout->numel[p];
    for (size_t r = 0; r < world; r++) {
        /* r*chunk and (r+1)*chunk are at most the padded total, checked to fit in size_t. */
        size_t begin = clamp_sub(r * chunk, param_base, numel);
        size_t end = clamp_sub((r + 1) * chunk, param_base, numel);
        layout->piece_offset[p * world + r] = begin;
        layout->counts[p * world + r] = end - begin;
    }
}

pshard_status_t ps_layout_create(pshard_layout_t kind, int world, size_t nparams,
                                 const size_t *numel, const size_t *rows, ps_layout_t **out,
                                 char *err, size_t errlen)
{
    if (!out)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "layout: out is NULL");
    *out = NULL;
    if (kind != PSHARD_LAYOUT_FSDP2 && kind != PSHARD_LAYOUT_FSDP1)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown layout kind %d",
                       (int)kind);
    if (world < 1)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "world size must be at least 1, got %d", world);
    if (nparams > 0 && (!numel || !rows))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "layout: numel or rows is NULL for %zu parameters", nparams);
    size_t total = 0;
    PS_CHECK(check_params(world, nparams, numel, rows, &total, err, errlen));

    size_t uworld = (size_t)world;
    if (nparams > SIZE_MAX / uworld / sizeof(size_t))
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "layout: %zu parameters x %d ranks",
                       nparams, world);
    size_t cells = nparams * uworld;
    ps_layout_t *layout = calloc(1, sizeof *layout);
    if (!layout)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "layout: out of memory");
    layout->kind = kind;
    layout->world = world;
    layout->nparams = nparams;
    /* calloc(0) may return NULL; allocate at least one element so NULL means failure. */
    layout->numel = calloc(nparams ? nparams : 1, sizeof(size_t));
    layout->counts = calloc(cells ? cells : 1, sizeof(size_t));
    layout->piece_offset = calloc(cells ? cells : 1, sizeof(size_t));
    layout->shard_offset = calloc(cells ? cells : 1, sizeof(size_t));
    layout->shard_numel = calloc(uworld, sizeof(size_t));
    if (!layout->numel || !layout->counts || !layout->piece_offset || !layout->shard_offset ||
        !layout->shard_numel) {
        ps_layout_destroy(layout);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "layout: out of memory");
    }

    size_t fsdp1_chunk = total / uworld + (total % uworld != 0);
    size_t param_base = 0;
    for (size_t p = 0; p < nparams; p++) {
        layout->numel[p] = numel[p];
        if (kind == PSHARD_LAYOUT_FSDP2)
            fill_fsdp2(layout, p, rows[p]);
        else
            fill_fsdp1(layout, p, param_base, fsdp1_chunk);
        param_base += numel[p];
        for (size_t r = 0; r < uworld; r++) {
            layout->shard_offset[p * uworld + r] = layout->shard_numel[r];
            layout->shard_numel[r] += layout->counts[p * uworld + r];
        }
    }
    *out = layout;
    return PSHARD_OK;
}

void ps_layout_destroy(ps_layout_t *layout)
{
    if (!layout)
        return;
    free(layout->numel);
    free(layout->counts);
    free(layout->piece_offset);
    free(layout->shard_offset);
    free(layout->shard_numel);
    free(layout);
}

pshard_layout_t ps_layout_kind(const ps_layout_t *layout)
{
    return layout->kind;
}

int ps_layout_world(const ps_layout_t *layout)
{
    return layout->world;
}

size_t ps_layout_nparams(const ps_layout_t *layout)
{
    return layout->nparams;
}

size_t ps_layout_numel(const ps_layout_t *layout, size_t param)
{
    assert(param < layout->nparams);
    return layout->numel[param];
}

const size_t *ps_layout_counts(const ps_layout_t *layout, size_t param)
{
    assert(param < layout->nparams);
    return &layout->counts[param * (size_t)layout->world];
}

size_t ps_layout_piece_offset(const ps_layout_t *layout, size_t param, int rank)
{
    assert(param < layout->nparams && rank >= 0 && rank < layout->world);
    return layout->piece_offset[param * (size_t)layout->world + (size_t)rank];
}

size_t ps_layout_shard_offset(const ps_layout_t *layout, size_t param, int rank)
{
    assert(param < layout->nparams && rank >= 0 && rank < layout->world);
    return layout->shard_offset[param * (size_t)layout->world + (size_t)rank];
}

size_t ps_layout_shard_numel(const ps_layout_t *layout, int rank)
{
    assert(rank >= 0 && rank < layout->world);
    return layout->shard_numel[rank];
}
