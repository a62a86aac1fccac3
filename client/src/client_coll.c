/* libpshard's plain collective as one request to its shard server: the send bytes copied into
 * its place in the scratch region (client_stage.c), the Collective call, the result copied
 * out (a staged collective's are copied in when it is issued and out when the caller takes
 * them). pshard_collective (pshard_client.c) runs it on the caller, the worker thread
 * (client_work.c) for pshard_collective_start, so it sits below both. */
#include <string.h>

#include "pshard/util.h"

#include "client_internal.h"

/* torch.distributed's name of op (for messages), or NULL when op is none of them. */
const char *client_op_name(pshard_op_t op)
{
    switch (op) {
    case PSHARD_OP_ALL_GATHER:
        return "all_gather";
    case PSHARD_OP_REDUCE_SCATTER:
        return "reduce_scatter";
    case PSHARD_OP_ALL_REDUCE:
        return "all_reduce";
    case PSHARD_OP_BROADCAST:
        return "broadcast";
    case PSHARD_OP_BARRIER:
        return "barrier";
    case PSHARD_OP_REDUCE:
        return "reduce";
    case PSHARD_OP_GATHER:
        return "gather";
    case PSHARD_OP_SCATTER:
        return "scatter";
    case PSHARD_OP_ALL_TO_ALL:
        return "all_to_all";
    case PSHARD_OP_SEND:
        return "send";
    case PSHARD_OP_RECV:
        return "recv";
    }
    return NULL;
}

pshard_status_t client_collective_exec(pshard_client_t *c, const pshard_collective_args_t *a,
                                       const coll_layout_t *l, size_t base, bool copy, char *err,
                                       size_t errlen)
{
    const char *what = client_op_name(a->op);
    uint8_t *at = (uint8_t *)c->scratch.base + base;
    if (copy && l->send_bytes)
        memcpy(at, l->src, l->send_bytes);
    char why[PSHARD_ERRLEN] = "";
    pshard_status_t rc = PSHARD_OK;
    if (c->cfg.remote && l->send_bytes)
        rc = client_remote_write(c, PSHARD__REGION__SCRATCH, &c->scratch, base, l->send_bytes, 0,
                                 why, sizeof(why));
    if (rc == PSHARD_OK) {
        bool barrier = a->op == PSHARD_OP_BARRIER;
        Pshard__CollectiveRequest req = PSHARD__COLLECTIVE_REQUEST__INIT;
        req.session = c->session;
        req.op = (uint32_t)a->op;
        req.dtype = client_dtype_pb(barrier ? PSHARD_FP32 : a->dtype);
        req.reduce = barrier ? 0 : (uint32_t)a->reduce;
        req.root = barrier ? 0 : a->root;
        bool p2p = a->op == PSHARD_OP_SEND || a->op == PSHARD_OP_RECV;
        if (p2p) {
            /* the peer's world rank: the pair's communicator is not the group's */
            req.root = a->group ? a->group->ranks[a->root] : a->root;
            req.tag = a->tag;
        }
        req.count = barrier ? 0 : a->count;
        req.send_offset = base;
        req.recv_offset = base + l->recv_off;
        req.group = a->group && !p2p ? a->group->id : 0;
        rc = client_call(c, "Collective", &req.base, &pshard__collective_response__descriptor, NULL,
                         why, sizeof(why));
    }
    if (rc == PSHARD_OK && c->cfg.remote && l->recv_bytes)
        rc = client_remote_read(c, PSHARD__REGION__SCRATCH, &c->scratch, base + l->recv_off,
                                l->recv_bytes, why, sizeof(why));
    if (rc != PSHARD_OK)
        return ps_errf(err, errlen, rc, "%s: %s", what, why);
    if (copy && l->recv_bytes)
        memcpy(l->dst, at + l->recv_off, l->recv_bytes);
    return PSHARD_OK;
}
