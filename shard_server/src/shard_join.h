/* The agreement every trainer operation starts with (shard_join.c), as a codec and a verdict
 * that need no communicator: each rank encodes a record of REC_WORDS int64 (its operation, or
 * "joining" / "joined"), the records of all ranks are all-gathered, and every rank computes
 * the same verdict from them. The collective parts (the all-gather, and the broadcasts that
 * give a joined rank a long parameter list or a step's groups) are the operations layer's
 * (shard_ops.c). */
#ifndef PSHARD_SHARD_JOIN_H
#define PSHARD_SHARD_JOIN_H

#include <stdbool.h>
#include <stdint.h>

#include "shard_internal.h"

/* An agreement record: REC_WORDS int64 per rank. */
#define REC_WORDS 16
#define REC_INLINE_IDS 4      /* W_IDS + 4 == REC_WORDS */
#define AGREE_TAG 0x41475245u /* "AGRE" */

enum { REC_OP = 1, REC_JOIN = 2, REC_JOINED = 3 };

enum {
    W_KIND = 0,
    W_SOP,
    W_DTYPE,
    W_NIDS,
    W_ARG,    /* lr bits (step), max_norm bits (clip) or collective op */
    W_COUNT,  /* element count (collective), group words (step), norm_type bits (clip) */
    W_ROOT,   /* root (collective); step: bit 0 set_lr, bit 1 trainer_stepped, bit 2 set_step,
                 bit 3 skip */
    W_REDUCE, /* collective: pshard_reduce_t */
    W_THROW,
    W_STEP,
    W_CKPT, /* the newest checkpoint request this rank has seen (not compared) */
    W_HASH,
    W_IDS, /* REC_INLINE_IDS words */
};

_Static_assert(W_IDS + REC_INLINE_IDS == REC_WORDS, "the record's words are all used");

/* The outcome of one agreement round, the same on every rank. */
typedef struct {
    int world;
    int active;       /* ranks that asked for an operation */
    int first_active; /* whose operation the round runs; -1 when none */
    int throw_rank;   /* a joined rank that asked for throw_on_early_termination; -1 */
    int64_t throw_step;
    bool any_joined; /* some rank is joined or joining */
    bool all_joined; /* no rank asked for an operation: the post hook */
    int last_rank;   /* with all_joined: the highest rank that joined in this round */
    bool desync;
    char desync_msg[PSHARD_ERRLEN];
    int64_t ckpt_request; /* the newest checkpoint request any rank has seen */
    shard_sop_t op;       /* the agreed operation (ids point into ids_buf or the records) */
    uint32_t ids_buf_inline[REC_INLINE_IDS];
    uint32_t *ids_heap;
    int64_t *words_heap; /* a step's groups, broadcast for joined ranks */
} agreement_t;

/* This rank's record: kind REC_OP with op, or REC_JOIN / REC_JOINED (op NULL); throw_flag is
 * throw_on_early_termination, step the model's, ckpt the newest checkpoint request seen. */
void shard_rec_encode(int64_t *r, int kind, const shard_sop_t *op, bool throw_flag, int64_t step,
                      int64_t ckpt);

/* The verdict of one round from the world records recs (world * REC_WORDS): who is active,
 * joined, throwing, the last joiner, whether the active ranks asked alike (desync_msg names
 * both sides when not), the newest checkpoint request, and the first active rank's operation
 * (its ids when they fit in the record; a step's group words are not in the record). DESYNC
 * for a record no pshard server sends. Pure. */
pshard_status_t shard_agree_verdict(const int64_t *recs, int world, agreement_t *ag, char *err,
                                    size_t errlen);

/* What an active rank that asked for op makes of a verdict: DESYNC, JOINED (a rank joined with
 * throw_on_early_termination, or a broadcast's root joined), or PSHARD_OK to run it. */
pshard_status_t shard_agree_refusal(const agreement_t *ag, const shard_sop_t *op,
                                    const int64_t *recs, char *err, size_t errlen);

/* The check word of op for pshard_comm_divert_next: a nonzero hash of the record's compared
 * words, so ranks asking for different operations (other parameters of the same sizes
 * included) differ. */
uint64_t shard_sop_check(const shard_sop_t *op);

/* The check word of an agreement round's all-gather. */
#define AGREE_CHECK 0x6167726565ull /* "agree" */

/* The name of an operation kind (SHARD_SOP_*) in messages: "gather", "step", ... */
const char *shard_sop_name(int64_t kind);

/* Frees what a round allocated (NULL members are fine). */
void shard_agreement_free(agreement_t *ag);

#endif
