/* The agreement's codec and verdict (shard_join.h), pure functions. For Join with uneven inputs
 * (PyTorch's Join / JoinHook), before every trainer operation the shard servers all-gather one
 * record each (shard_ops.c), so a rank whose trainer ran out of input learns what the others
 * run and shadows it, and every rank knows how many trainers contributed, which is what
 * gradients are averaged over; this file encodes the records and computes the verdict. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/util.h"

#include "shard_internal.h"
#include "shard_join.h"

void shard_agreement_free(agreement_t *ag)
{
    free(ag->ids_heap);
    free(ag->words_heap);
    ag->ids_heap = NULL;
    ag->words_heap = NULL;
}

static uint64_t ids_hash(const uint32_t *ids, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= ids[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* A step's group words, hashed so that ranks stepping with different hyperparameters are a
 * desync. */
static uint64_t words_hash(const int64_t *w, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint64_t)w[i];
        h *= 1099511628211ull;
    }
    return h;
}

void shard_rec_encode(int64_t *r, int kind, const shard_sop_t *op, bool throw_flag, int64_t step,
                      int64_t ckpt)
{
    memset(r, 0, REC_WORDS * sizeof(int64_t));
    r[W_KIND] = kind;
    r[W_THROW] = throw_flag;
    r[W_STEP] = step;
    r[W_CKPT] = ckpt;
    if (!op)
        return;
    r[W_SOP] = op->kind;
    r[W_DTYPE] = op->dtype;
    r[W_NIDS] = (int64_t)op->nids;
    r[W_HASH] = (int64_t)ids_hash(op->ids, op->nids);
    if (op->kind == SHARD_SOP_STEP) {
        r[W_ARG] = op->set_step ? op->step_to : shard_double_word(op->lr);
        r[W_COUNT] = (int64_t)op->nwords;
        r[W_ROOT] = (int64_t)op->set_lr | (int64_t)op->trainer_stepped << 1 |
                    (int64_t)op->set_step << 2 | (int64_t)op->skip << 3;
        r[W_HASH] = (int64_t)words_hash(op->words, op->nwords);
    } else if (op->kind == SHARD_SOP_CLIP) {
        r[W_ARG] = shard_double_word(op->max_norm);
        r[W_COUNT] = shard_double_word(op->norm_type);
    } else {
        r[W_ARG] = op->coll_op;
        r[W_COUNT] = (int64_t)op->count;
        r[W_ROOT] = op->root;
    }
    r[W_REDUCE] = op->reduce;
    for (size_t i = 0; i < op->nids && i < REC_INLINE_IDS; i++)
        r[W_IDS + i] = op->ids[i];
}

uint64_t shard_sop_check(const shard_sop_t *op)
{
    int64_t r[REC_WORDS];
    shard_rec_encode(r, REC_OP, op, false, 0, 0);
    /* The words the verdict compares: W_SOP..W_REDUCE and W_HASH onwards. */
    uint64_t h = ids_hash(NULL, 0);
    for (int w = W_SOP; w < REC_WORDS; w++) {
        if (w >= W_THROW && w < W_HASH)
            continue;
        h ^= (uint64_t)r[w];
        h *= 1099511628211ull;
    }
    return h ? h : 1;
}

const char *shard_sop_name(int64_t k)
{
    switch (k) {
    case SHARD_SOP_GATHER:
        return "gather";
    case SHARD_SOP_REDUCE_SCATTER:
        return "reduce_scatter";
    case SHARD_SOP_STEP:
        return "step";
    case SHARD_SOP_COLLECTIVE:
        return "collective";
    case SHARD_SOP_SAVE:
        return "checkpoint save";
    case SHARD_SOP_CLIP:
        return "clip_grad_norm";
    case SHARD_SOP_NEW_GROUPS:
        return "new_group";
    case SHARD_SOP_P2P:
        return "send/recv";
    default:
        return "?";
    }
}

static void rec_format(const int64_t *r, char *buf, size_t len)
{
    if (r[W_SOP] == SHARD_SOP_GATHER || r[W_SOP] == SHARD_SOP_REDUCE_SCATTER)
        snprintf(buf, len, "%s of %" PRId64 " parameter(s) starting with #%" PRId64 " in %s",
                 shard_sop_name(r[W_SOP]), r[W_NIDS], r[W_IDS],
                 pshard_dtype_name((pshard_dtype_t)r[W_DTYPE]));
    else if (r[W_SOP] == SHARD_SOP_COLLECTIVE)
        snprintf(buf, len, "%s of %" PRId64 " %s", pshard_coll_op_name((pshard_coll_op_t)r[W_ARG]),
                 r[W_COUNT], pshard_dtype_name((pshard_dtype_t)r[W_DTYPE]));
    else if (r[W_SOP] == SHARD_SOP_STEP && (r[W_ROOT] & 2))
        snprintf(buf, len, "step taken by the trainer's own optimizer");
    else if (r[W_SOP] == SHARD_SOP_STEP)
        snprintf(buf, len, "step (%s, %" PRId64 " group(s) of hyperparameters)",
                 r[W_ROOT] ? "lr set" : "groups' lr", r[W_COUNT] / SHARD_GROUP_WORDS);
    else if (r[W_SOP] == SHARD_SOP_P2P)
        snprintf(buf, len, "send/recv of %" PRId64 " %s from pair rank %" PRId64 " tag %" PRId64,
                 r[W_COUNT], pshard_dtype_name((pshard_dtype_t)r[W_DTYPE]), r[W_ROOT], r[W_ARG]);
    else if (r[W_SOP] == SHARD_SOP_NEW_GROUPS)
        snprintf(buf, len,
                 "new_group of %" PRId64 " group(s), %" PRId64 " words starting %" PRId64
                 ", %" PRId64 ", %" PRId64 "",
                 r[W_COUNT], r[W_NIDS], r[W_IDS], r[W_IDS + 1], r[W_IDS + 2]);
    else if (r[W_SOP] == SHARD_SOP_CLIP)
        snprintf(buf, len, "clip_grad_norm (max_norm %g, norm_type %g)",
                 shard_word_double(r[W_ARG]), shard_word_double(r[W_COUNT]));
    else
        snprintf(buf, len, "%s", shard_sop_name(r[W_SOP]));
}

pshard_status_t shard_agree_verdict(const int64_t *recs, int world, agreement_t *ag, char *err,
                                    size_t errlen)
{
    memset(ag, 0, sizeof(*ag));
    ag->world = world;
    ag->first_active = -1;
    ag->throw_rank = -1;
    ag->last_rank = -1;
    for (int r = 0; r < world; r++) {
        const int64_t *x = recs + (size_t)r * REC_WORDS;
        if (x[W_KIND] < REC_OP || x[W_KIND] > REC_JOINED ||
            (x[W_KIND] == REC_OP &&
             (x[W_SOP] < SHARD_SOP_GATHER || x[W_SOP] > SHARD_SOP_P2P || x[W_NIDS] < 0 ||
              x[W_NIDS] > SHARD_MAX_PARAMS || x[W_DTYPE] < 0 || x[W_DTYPE] >= PSHARD_DTYPE_COUNT ||
              x[W_REDUCE] < 0 || x[W_REDUCE] >= PSHARD_REDUCE_COUNT ||
              (x[W_SOP] == SHARD_SOP_STEP &&
               (x[W_COUNT] < 0 ||
                x[W_COUNT] > SHARD_MAX_GROUPS * SHARD_GROUP_WORDS + SHARD_MAX_SKIP_WORDS ||
                ((x[W_ROOT] & 8) == 0 && x[W_COUNT] % SHARD_GROUP_WORDS != 0))))))
            return ps_errf(err, errlen, PSHARD_ERR_DESYNC,
                           "rank %d sent a malformed agreement record (kind %" PRId64 ")", r,
                           x[W_KIND]);
        if (x[W_CKPT] > ag->ckpt_request)
            ag->ckpt_request = x[W_CKPT];
        if (x[W_KIND] == REC_OP) {
            if (ag->first_active < 0)
                ag->first_active = r;
            ag->active++;
            continue;
        }
        ag->any_joined = true;
        if (x[W_KIND] == REC_JOIN)
            ag->last_rank = r;
        if (x[W_THROW] && ag->throw_rank < 0) {
            ag->throw_rank = r;
            ag->throw_step = x[W_STEP];
        }
    }
    if (ag->active == 0) {
        ag->all_joined = true;
        return PSHARD_OK;
    }
    const int64_t *f = recs + (size_t)ag->first_active * REC_WORDS;
    for (int r = ag->first_active + 1; r < world; r++) {
        const int64_t *x = recs + (size_t)r * REC_WORDS;
        if (x[W_KIND] != REC_OP)
            continue;
        /* Compared: W_SOP..W_REDUCE and W_HASH onwards (not the flags, step or request). */
        bool same = memcmp(&x[W_SOP], &f[W_SOP], (W_THROW - W_SOP) * sizeof(int64_t)) == 0 &&
                    memcmp(&x[W_HASH], &f[W_HASH], (REC_WORDS - W_HASH) * sizeof(int64_t)) == 0;
        if (!same && !ag->desync) {
            char fa[160], xa[160];
            rec_format(f, fa, sizeof(fa));
            rec_format(x, xa, sizeof(xa));
            ag->desync = true;
            snprintf(ag->desync_msg, sizeof(ag->desync_msg),
                     "ranks asked for different operations: rank %d %s, rank %d %s",
                     ag->first_active, fa, r, xa);
        }
    }
    shard_sop_t *op = &ag->op;
    op->kind = (shard_sop_kind_t)f[W_SOP];
    op->dtype = (pshard_dtype_t)f[W_DTYPE];
    op->nids = (size_t)f[W_NIDS];
    op->reduce = (uint32_t)f[W_REDUCE];
    if (op->kind == SHARD_SOP_STEP) {
        op->nwords = (size_t)f[W_COUNT];
        op->set_lr = (f[W_ROOT] & 1) != 0;
        op->trainer_stepped = (f[W_ROOT] & 2) != 0;
        op->set_step = (f[W_ROOT] & 4) != 0;
        op->skip = (f[W_ROOT] & 8) != 0;
        op->lr = op->set_step ? 0.0 : shard_word_double(f[W_ARG]);
        op->step_to = op->set_step ? f[W_ARG] : 0;
        return PSHARD_OK;
    }
    if (op->kind == SHARD_SOP_CLIP) {
        op->max_norm = shard_word_double(f[W_ARG]);
        op->norm_type = shard_word_double(f[W_COUNT]);
        return PSHARD_OK;
    }
    op->coll_op = (uint32_t)f[W_ARG];
    op->count = (uint64_t)f[W_COUNT];
    op->root = (int)f[W_ROOT];
    if (op->nids <= REC_INLINE_IDS) {
        for (size_t i = 0; i < op->nids; i++)
            ag->ids_buf_inline[i] = (uint32_t)f[W_IDS + i];
        op->ids = ag->ids_buf_inline;
    }
    return PSHARD_OK;
}

pshard_status_t shard_agree_refusal(const agreement_t *ag, const shard_sop_t *op,
                                    const int64_t *recs, char *err, size_t errlen)
{
    if (ag->desync)
        return ps_errf(err, errlen, PSHARD_ERR_DESYNC, "%s", ag->desync_msg);
    if (ag->throw_rank >= 0)
        return ps_errf(err, errlen, PSHARD_ERR_JOINED,
                       "rank %d joined at step %" PRId64 " (its trainer ran out of input) "
                       "with throw_on_early_termination: this %s ran on no rank; leave the "
                       "Join block to finish (C: pshard_join)",
                       ag->throw_rank, ag->throw_step, shard_sop_name(op->kind));
    if (op->kind == SHARD_SOP_STEP && op->trainer_stepped && ag->any_joined) {
        /* The joined ranks' masters would not move while the others' do: no rank steps. */
        char ranks[PSHARD_ERRLEN / 2] = "";
        size_t used = 0;
        int njoined = 0;
        for (int r = 0; r < ag->world && used + 16 < sizeof(ranks); r++) {
            if (recs[(size_t)r * REC_WORDS + W_KIND] == REC_OP)
                continue;
            int n = snprintf(ranks + used, sizeof(ranks) - used, "%s%d", njoined ? ", " : "", r);
            used += n > 0 ? (size_t)n : 0;
            njoined++;
        }
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "rank%s %s joined (no more input): a step taken by the trainers' own "
                       "optimizer cannot run, because a joined rank's shard is updated by its "
                       "trainer's own optimizer, which stopped when it joined; use "
                       "pshard.torch.optim (stepped on the shard servers) or "
                       "Join(throw_on_early_termination=True)",
                       njoined > 1 ? "s" : "", ranks);
    }
    if (op->kind == SHARD_SOP_P2P && ag->any_joined)
        return ps_errf(err, errlen, PSHARD_ERR_JOINED,
                       "the peer has joined (its trainer ran out of input): a send or recv with "
                       "a joined rank cannot complete");
    if (op->kind == SHARD_SOP_NEW_GROUPS && ag->any_joined) {
        int joined = 0;
        while (joined < ag->world - 1 && recs[(size_t)joined * REC_WORDS + W_KIND] == REC_OP)
            joined++;
        return ps_errf(err, errlen, PSHARD_ERR_JOINED,
                       "rank %d has joined (no more input): process groups are made while every "
                       "trainer is active (make them before the training loop)",
                       joined);
    }
    if (op->kind == SHARD_SOP_COLLECTIVE && op->coll_op == PSHARD_COLL_BROADCAST && op->root >= 0 &&
        op->root < ag->world && recs[(size_t)op->root * REC_WORDS + W_KIND] != REC_OP)
        return ps_errf(err, errlen, PSHARD_ERR_JOINED,
                       "the broadcast's root, rank %d, has joined (no more input)", op->root);
    return PSHARD_OK;
}
