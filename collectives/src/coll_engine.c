/* The tcp engine's control frames (queued for the next rank) and its one way of failing an
 * operation (coll_engine.h), shared by the ring (coll_tcp.c) and the paths beside it
 * (coll_direct.c). Engine thread only. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll_engine.h"
#include "coll_reduce.h"
#include "pshard/log.h"
#include "pshard/util.h"

/* ---------------------------------------------------------------------------------------- */
/* Control frames                                                                            */

void coll_engine_queue_ctrl(engine_t *e, uint8_t type, uint64_t seq, const uint8_t *payload,
                            size_t len)
{
    ctrl_frame_t *f = malloc(sizeof(*f));
    if (!f)
        return; /* out of memory: peers will time out and name us */
    coll_frame_header_t h = {type, 0, (uint32_t)len, seq};
    coll_frame_header_encode(&h, f->buf);
    memcpy(f->buf + COLL_FRAME_HEADER_SIZE, payload, len);
    f->len = COLL_FRAME_HEADER_SIZE + len;
    ps_queue_push(&e->ctrl, &f->node);
}

/* Drops the control frames not yet sent (the link is gone, or the engine is). */
void coll_engine_free_ctrl(engine_t *e)
{
    ctrl_frame_t *f;
    while ((f = PS_QUEUE_POP(&e->ctrl, ctrl_frame_t, node)) != NULL)
        free(f);
}

void coll_engine_queue_abort(engine_t *e, uint32_t origin, pshard_status_t status, const char *msg,
                             uint64_t seq)
{
    coll_abort_t a;
    memset(&a, 0, sizeof(a));
    a.origin_rank = origin;
    a.status = (int32_t)status;
    ps_strlcpy(a.message, msg, sizeof(a.message));
    uint8_t buf[COLL_FRAME_MAX_CONTROL];
    size_t n = coll_abort_encode(&a, buf, sizeof(buf));
    if (n)
        coll_engine_queue_ctrl(e, COLL_FRAME_ABORT, seq, buf, n);
}

/* ---------------------------------------------------------------------------------------- */
/* Failure                                                                                   */

void coll_engine_fail_op(engine_t *e, pshard_status_t st, const char *msg, bool originate)
{
    if (e->op_failed || !e->req)
        return;
    e->op_failed = true;
    PS_WARN(PS_SUB_COLL, "%s", msg);
    /* A half-written DATA frame is finished with zeros: the caller's buffer may be freed once
     * the request completes. */
    if (e->of_active && e->of_is_data)
        e->of_zero_pad = true;
    if (originate && e->t.n > 1)
        coll_engine_queue_abort(e, (uint32_t)e->t.rank, st, msg, e->req->op.desc.seq);

    e->failed = true;
    e->drain_until_ns = ps_now_ns() + DRAIN_NS;
    coll_complete(e->req, st, msg);
}

void coll_engine_fail_errno(engine_t *e, bool sending, int err_no)
{
    char msg[PSHARD_ERRLEN];
    const coll_op_t *op = &e->req->op;
    int peer = sending ? e->t.next : e->t.prev;
    snprintf(msg, sizeof(msg),
             "%s seq %" PRIu64 " on rank %d: lost rank %d (%s while %s it); the process died, "
             "closed the communicator, or the network failed",
             pshard_coll_op_name(op->args.op), op->desc.seq, e->t.rank, peer,
             err_no ? strerror(err_no) : "connection closed",
             sending ? "sending to" : "receiving from");
    coll_engine_fail_op(e, PSHARD_ERR_PEER_LOST, msg, true);
}

void coll_engine_fail_protocol(engine_t *e, const char *what)
{
    char msg[PSHARD_ERRLEN];
    snprintf(msg, sizeof(msg), "%s seq %" PRIu64 " on rank %d: rank %d broke the protocol: %s",
             pshard_coll_op_name(e->req->op.args.op), e->req->op.desc.seq, e->t.rank, e->t.prev,
             what);
    coll_engine_fail_op(e, PSHARD_ERR_DESYNC, msg, true);
}

/* What every operation starts from: its element sizes and scale, no phases, no descriptor. */
void coll_engine_op_init(engine_t *e)
{
    const pshard_coll_args_t *a = &e->req->op.args;
    e->esize = pshard_dtype_size(a->dtype);
    e->asize = pshard_dtype_size(coll_acc_dtype(a->dtype));
    e->scale = a->reduce == PSHARD_REDUCE_AVG ? 1.0 / (double)e->t.n : 1.0;
    e->cur = 0;
    e->nphases = 0;
    e->descs_received = 0;
    e->held = false;
    e->diverted_by = -1;
    e->op_failed = false;
    e->waiting_on = -1;
    e->direct = false;
    e->inline_op = false;
}
