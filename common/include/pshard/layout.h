/* Shard layout math shared by shard servers, the client library and tests: which elements of
 * each parameter every rank owns.
 *  FSDP2 (default): each parameter is sharded on dim 0; with rows = shape[0] and
 *    chunk = ceil(rows / N), rank r owns rows [r*chunk, min(rows, (r+1)*chunk)) — the last
 *    ranks may own fewer rows or none.
 *  FSDP1: all parameters are flattened into one buffer of T elements in definition order,
 *    padded to a multiple of N; rank r owns flat elements [r*T'/N, (r+1)*T'/N) ∩ [0, T), which
 *    cuts parameters anywhere.
 * In both, each rank's piece of a parameter is one contiguous range of the flattened parameter
 * and the pieces are in rank order, so gathering a parameter is an all_gather with per-rank
 * counts. A rank stores its pieces of all parameters back to back (its shard). Immutable after
 * creation: thread-safe. Internal to pshard (not installed). */
#ifndef PSHARD_LAYOUT_H
#define PSHARD_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "pshard/status.h"
#include "pshard/types.h"

typedef struct ps_layout ps_layout_t;

/* numel[p] is parameter p's element count and rows[p] its shape[0] (numel for a 0-d/1-d
 * tensor: rows must divide numel). Errors: INVALID_ARGUMENT (world < 1, rows 0 with numel > 0,
 * numel not a multiple of rows, unknown kind; message names the parameter index), NO_MEMORY.
 * Free with ps_layout_destroy. */
pshard_status_t ps_layout_create(pshard_layout_t kind, int world, size_t nparams,
                                 const size_t *numel, const size_t *rows, ps_layout_t **out,
                                 char *err, size_t errlen);
void ps_layout_destroy(ps_layout_t *layout);

pshard_layout_t ps_layout_kind(const ps_layout_t *layout);
int ps_layout_world(const ps_layout_t *layout);
size_t ps_layout_nparams(const ps_layout_t *layout);
size_t ps_layout_numel(const ps_layout_t *layout, size_t param);

/* Per-rank element counts of parameter p (world entries, pointer valid for the layout's life). */
const size_t *ps_layout_counts(const ps_layout_t *layout, size_t param);

/* Start of rank's piece within the flattened parameter p. */
size_t ps_layout_piece_offset(const ps_layout_t *layout, size_t param, int rank);

/* Where parameter p's piece starts within rank's shard (its pieces back to back, in parameter
 * order), and the total elements of rank's shard. */
size_t ps_layout_shard_offset(const ps_layout_t *layout, size_t param, int rank);
size_t ps_layout_shard_numel(const ps_layout_t *layout, int rank);

#endif
