/* The tcp engine's paths that skip the ring's data streams (coll_engine.h): operations whose
 * data travels in the descriptors themselves, and the same-host transport (coll_shm.h), where
 * each rank reads the others' buffers and says so with a DONE notice around the ring. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll_engine.h"
#include "coll_reduce.h"
#include "pshard/util.h"

/* Whether the request moves its data by reading the other ranks' memory (a barrier or a
 * descriptor check carries none and stays on the sockets). */
bool coll_direct_is(const engine_t *e, const coll_op_t *op)
{
    pshard_coll_op_t k = op->args.op;
    return e->t.shm && e->t.n > 1 && !op->check_only &&
           (k == PSHARD_COLL_ALL_GATHER || k == PSHARD_COLL_REDUCE_SCATTER ||
            k == PSHARD_COLL_ALL_REDUCE || k == PSHARD_COLL_BROADCAST);
}

/* The bytes of data a rank's descriptor carries in an inline operation: its block of an
 * all-gather, its whole input of a reduce-scatter or all-reduce, the root's of a broadcast. */
size_t coll_inline_bytes(const engine_t *e, const coll_op_t *op, int rank)
{
    size_t total = op->displs[e->t.n] * e->esize;
    switch (op->args.op) {
    case PSHARD_COLL_ALL_GATHER:
        return op->counts[rank] * e->esize;
    case PSHARD_COLL_REDUCE_SCATTER:
    case PSHARD_COLL_ALL_REDUCE:
        return total;
    case PSHARD_COLL_BROADCAST:
        return rank == op->args.root ? total : 0;
    case PSHARD_COLL_BARRIER:
    case PSHARD_COLL_REDUCE: /* never here: coll_comm.c runs these three as others */
    case PSHARD_COLL_GATHER:
    case PSHARD_COLL_SCATTER:
    case PSHARD_COLL_ALL_TO_ALL:
        return 0;
    }
    return 0;
}

/* Whether the request's data is small enough to travel in the descriptors (at most
 * COLL_DESC_INLINE_MAX bytes a rank: the shard servers' agreement records, a norm, an 8-byte
 * all-reduce; a barrier has none): one round of descriptors then does it all, and a reduction
 * is summed on every rank in rank order, so every rank gets the same result. The same on
 * every rank. */
bool coll_inline_is(const engine_t *e, const coll_op_t *op)
{
    if (op->check_only || e->t.n < 2)
        return false;
    for (int q = 0; q < e->t.n; q++)
        if (coll_inline_bytes(e, op, q) > COLL_DESC_INLINE_MAX)
            return false;
    return true;
}

/* Sets up an inline operation: this rank's data goes into its descriptor (and an all-gather's
 * block into its own output, a broadcast root's into recv); the others' arrive with theirs
 * (handle_desc) and reductions are done once all have (coll_inline_finish). */
void coll_inline_setup(engine_t *e)
{
    coll_op_t *op = &e->req->op;
    int r = e->t.rank;
    size_t bytes = coll_inline_bytes(e, op, r);
    e->inline_op = true;
    coll_buf_t inl = coll_buf_flat(op->desc.inline_data);
    coll_buf_copy(&inl, 0, &op->sbuf, 0, bytes);
    op->desc.inline_len = (uint16_t)bytes;
    if (op->args.op == PSHARD_COLL_ALL_GATHER)
        coll_buf_copy(&op->rbuf, op->displs[r] * e->esize, &op->sbuf, 0, bytes);
    else if (op->args.op == PSHARD_COLL_BROADCAST && bytes)
        coll_buf_copy(&op->rbuf, 0, &op->sbuf, 0, bytes);
}

/* A reduce-scatter's or all-reduce's result from every rank's input (this rank's own and the
 * others' as their descriptors carried them, in e->inline_in), summed in rank order. */
void coll_inline_finish(engine_t *e)
{
    coll_op_t *op = &e->req->op;
    pshard_coll_op_t k = op->args.op;
    if (k != PSHARD_COLL_REDUCE_SCATTER && k != PSHARD_COLL_ALL_REDUCE)
        return;
    int r = e->t.rank;
    size_t first = k == PSHARD_COLL_REDUCE_SCATTER ? op->displs[r] : 0;
    size_t nel = k == PSHARD_COLL_REDUCE_SCATTER ? op->counts[r] : op->displs[e->t.n];
    uint64_t acc[COLL_DESC_INLINE_MAX / 2]; /* partial sums of 2-byte elements are 4 bytes */
    for (int q = 0; q < e->t.n; q++) {
        coll_buf_t in =
            q == r ? op->sbuf : coll_buf_flat(e->inline_in + (size_t)q * COLL_DESC_INLINE_MAX);
        if (q == 0)
            coll_buf_load(acc, &in, first * e->esize, op->args.dtype, nel);
        else
            coll_buf_accumulate(acc, &in, first * e->esize, op->args.dtype, (int)op->args.reduce,
                                nel);
    }
    coll_buf_store(&op->rbuf, 0, op->args.dtype, acc, nel, e->scale);
}

/* Sets up a direct operation. This rank's own block goes where it belongs first (all-gather:
 * into the output; broadcast root: to recv), and the descriptor names where the others read
 * it from, so that they never read a send buffer this copy overlaps. */
void coll_direct_setup(engine_t *e)
{
    coll_op_t *op = &e->req->op;
    const pshard_coll_args_t *a = &op->args;
    int r = e->t.rank;
    coll_engine_op_init(e);
    e->direct = true;
    e->dstage = DS_DESCS;
    e->dfinal = a->op == PSHARD_COLL_ALL_REDUCE ? 2 : 1;
    memset(e->done_seen, 0, sizeof(e->done_seen));
    e->dk = 1;
    e->doff = 0;
    e->peer_bufs = false;
    coll_publish_buffers(op, r, e->t.n);
}

/* Frees the other ranks' piece tables read for the running operation. */
void coll_direct_free(engine_t *e)
{
    for (int q = 0; e->peer_bufs && q < e->t.n; q++) {
        coll_buf_free(&e->peer_sbuf[q]);
        coll_buf_free(&e->peer_rbuf[q]);
    }
    e->peer_bufs = false;
}

/* The other ranks' buffers, from their descriptors: what this operation reads of each. */
static pshard_status_t direct_fetch(engine_t *e, char *err, size_t errlen)
{
    coll_op_t *op = &e->req->op;
    const pshard_coll_args_t *a = &op->args;
    int n = e->t.n;
    uint64_t total = op->displs[n] * e->esize;
    e->peer_bufs = true;
    for (int q = 0; q < n; q++) {
        const coll_desc_t *d = &e->peer_desc[q];
        bool reads_send = a->op != PSHARD_COLL_BROADCAST || q == a->root;
        uint64_t sbytes = a->op == PSHARD_COLL_ALL_GATHER ? op->counts[q] * e->esize : total;
        if (q == e->t.rank)
            continue;
        if (reads_send)
            PS_CHECK(coll_shm_fetch_buf(e->t.shm, q, d->send_addr, d->send_pieces, sbytes,
                                        &e->peer_sbuf[q], err, errlen));
        if (a->op == PSHARD_COLL_ALL_REDUCE)
            PS_CHECK(coll_shm_fetch_buf(e->t.shm, q, d->recv_addr, d->recv_pieces, total,
                                        &e->peer_rbuf[q], err, errlen));
    }
    return PSHARD_OK;
}

static void queue_done(engine_t *e, uint32_t phase)
{
    coll_done_t d = {(uint32_t)e->t.rank, phase};
    uint8_t buf[16];
    size_t len = coll_done_encode(&d, buf, sizeof(buf));
    coll_engine_queue_ctrl(e, COLL_FRAME_DONE, e->req->op.desc.seq, buf, len);
}

/* One piece of a direct operation's reading (at most COLL_SHM_PIECE bytes, or
 * COLL_SHM_REDUCE_MAX elements of a reduction), so the engine serves the sockets between
 * pieces. second: all-reduce's second half. *finished once the phase's reading is done. */
static pshard_status_t direct_piece(engine_t *e, bool second, bool *finished, char *err,
                                    size_t errlen)
{
    coll_op_t *op = &e->req->op;
    const pshard_coll_args_t *a = &op->args;
    int n = e->t.n, r = e->t.rank;
    size_t es = e->esize;
    *finished = false;
    if (!e->peer_bufs)
        PS_CHECK(direct_fetch(e, err, errlen));
    if (!second && (a->op == PSHARD_COLL_REDUCE_SCATTER || a->op == PSHARD_COLL_ALL_REDUCE)) {
        /* This rank's block: its own part plus every other rank's, read slice by slice. */
        size_t count = op->counts[r], left = count - e->doff;
        size_t nel = left < COLL_SHM_REDUCE_MAX ? left : COLL_SHM_REDUCE_MAX;
        uint64_t first = (op->displs[r] + e->doff) * es;
        uint64_t out = (a->op == PSHARD_COLL_ALL_REDUCE ? op->displs[r] * es : 0) + e->doff * es;
        if (nel)
            PS_CHECK(coll_shm_reduce(e->t.shm, e->peer_sbuf, first, &op->sbuf, first, &op->rbuf,
                                     out, a->dtype, (int)a->reduce, nel, e->scale, err, errlen));
        e->doff += nel;
        *finished = e->doff == count;
        return PSHARD_OK;
    }
    if (a->op == PSHARD_COLL_BROADCAST) {
        size_t total = op->displs[n] * es, left = total - e->doff;
        size_t len = left < COLL_SHM_PIECE ? left : COLL_SHM_PIECE;
        if (r != a->root && len)
            PS_CHECK(coll_shm_read_buf(e->t.shm, a->root, &op->rbuf, e->doff,
                                       &e->peer_sbuf[a->root], e->doff, len, err, errlen));
        e->doff += r == a->root ? left : len;
        *finished = e->doff == total;
        return PSHARD_OK;
    }
    /* Every other rank's block (all-gather: from its output, where its own block went first;
     * all-reduce's second half: its reduced block), starting with the next rank's so that
     * the ranks do not all read the same one at once. */
    while (e->dk < n) {
        int q = (r + e->dk) % n;
        size_t bytes = op->counts[q] * es, at = op->displs[q] * es;
        if (e->doff >= bytes) {
            e->dk++;
            e->doff = 0;
            continue;
        }
        size_t len = bytes - e->doff < COLL_SHM_PIECE ? bytes - e->doff : COLL_SHM_PIECE;
        PS_CHECK(coll_shm_read_buf(e->t.shm, q, &op->rbuf, at + e->doff,
                                   second ? &e->peer_rbuf[q] : &e->peer_sbuf[q],
                                   (second ? at : 0) + e->doff, len, err, errlen));
        e->doff += len;
        return PSHARD_OK;
    }
    *finished = true;
    return PSHARD_OK;
}

/* Moves the running direct operation on by one step; true when it did. */
bool coll_direct_step(engine_t *e)
{
    int n = e->t.n;
    switch (e->dstage) {
    case DS_DESCS:
        if (e->descs_received < n - 1)
            return false;
        e->dstage = DS_READ1;
        return true;
    case DS_READ1:
    case DS_READ2: {
        bool second = e->dstage == DS_READ2, finished = false;
        char err[PSHARD_ERRLEN] = "";
        pshard_status_t rc = direct_piece(e, second, &finished, err, sizeof(err));
        if (rc != PSHARD_OK) {
            /* A rank whose memory cannot be read any more may have given up on this operation
             * (lost another rank, timed out) and let its buffers go: its abort notice, which
             * says why, wins if it comes within the grace period. */
            e->read_failed = rc;
            e->read_failed_ns = ps_now_ns();
            ps_snprintf(
                e->read_failed_msg, sizeof(e->read_failed_msg), "%s seq %" PRIu64 " on rank %d: %s",
                pshard_coll_op_name(e->req->op.args.op), e->req->op.desc.seq, e->t.rank, err);
            e->dstage = DS_READ_FAILED;
            return true;
        }
        if (finished) {
            queue_done(e, second ? 2 : 1);
            e->dstage = !second && e->dfinal == 2 ? DS_WAIT1 : DS_WAIT_FINAL;
        }
        return true;
    }
    case DS_WAIT1:
        if (e->done_seen[1] < n - 1)
            return false;
        e->dk = 1;
        e->doff = 0;
        e->dstage = DS_READ2;
        return true;
    case DS_WAIT_FINAL:
        if (e->done_seen[e->dfinal] < n - 1)
            return false;
        e->dstage = DS_COMPLETE;
        return true;
    case DS_READ_FAILED:
        if (ps_now_ns() - e->read_failed_ns < NEXT_LOST_GRACE_NS)
            return false;
        coll_engine_fail_op(e, e->read_failed, e->read_failed_msg, true);
        return true;
    }
    return false;
}

/* A rank says it finished a phase of the running direct operation (it read everything it
 * needed from the others); forwarded like descriptors. */
void coll_direct_done(engine_t *e)
{
    coll_done_t d;
    char err[PSHARD_ERRLEN] = "";
    if (!e->direct) {
        coll_engine_fail_protocol(
            e, "it sent a DONE notice for an operation that moves data through the "
               "sockets (the ranks chose different transports)");
        return;
    }
    if (coll_done_decode(e->if_ctrl, e->if_h.len, &d, err, sizeof(err)) != PSHARD_OK) {
        coll_engine_fail_protocol(e, err);
        return;
    }
    if (d.origin_rank >= (uint32_t)e->t.n || (int)d.origin_rank == e->t.rank || d.value < 1 ||
        d.value > (uint32_t)e->dfinal || ++e->done_seen[d.value] > e->t.n - 1) {
        char what[128];
        snprintf(what, sizeof(what),
                 "it sent a DONE notice of rank %u, phase %u, not one of "
                 "this operation's",
                 d.origin_rank, d.value);
        coll_engine_fail_protocol(e, what);
        return;
    }
    if ((int)d.origin_rank != e->t.next)
        coll_engine_queue_ctrl(e, COLL_FRAME_DONE, e->if_h.seq, e->if_ctrl, e->if_h.len);
}
