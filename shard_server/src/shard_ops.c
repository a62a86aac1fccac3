/* The shard server's operations layer (see shard_ops.h): the one entry, the agreement round
 * every operation starts with, and Join as an operation (a joined rank shadows the others'
 * operations — its real slice for gathers, zeros for gradient reductions and collectives, the
 * main hook — until every rank has joined and each Join says who joined last, the post
 * hook). */
#include "shard_heal.h"
#include "shard_ops.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/coord_client.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/dtype.h"
#include "pshard/log.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"

#include "shard_cuda.h"
#include "shard_join.h"

pshard_comm_t *shard_op_comm(pshard_shard_server_t *s, pshard_status_t *rc, char *err,
                             size_t errlen)
{
    pthread_mutex_lock(&s->mu);
    pshard_comm_t *c = s->comm;
    pshard_status_t fatal = s->fatal;
    char msg[PSHARD_ERRLEN];
    ps_strlcpy(msg, s->fatal_msg, sizeof(msg));
    pthread_mutex_unlock(&s->mu);
    if (fatal != PSHARD_OK) {
        /* Its own status, not UNAVAILABLE: a retry cannot help (a full store, the cluster that
         * did not form in time), so a trainer attaching fails at once with the cause instead
         * of retrying until its connect timeout. */
        *rc = ps_errf(err, errlen, fatal, "shard server failed: %s", msg);
        return NULL;
    }
    if (!c)
        *rc = ps_errf(err, errlen, PSHARD_ERR_UNAVAILABLE,
                      "the cluster has not formed yet (or is re-forming); retry");
    return c;
}

pshard_status_t shard_session_check(const pshard_shard_server_t *s, const char *session, char *err,
                                    size_t errlen)
{
    if (!s->session[0])
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "no trainer is attached; call Attach first");
    if (!session || strcmp(session, s->session) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "session '%s' is not the attached trainer's (another trainer attached "
                       "since?)",
                       session ? session : "");
    return PSHARD_OK;
}

/* Whether op runs ahead of the agreement, its first collective divertible: while no rank of
 * comm has joined (as far as the agreements showed), for the operations of a training step's
 * bulk (gathers, reduce-scatters, plain collectives) whose first collective is on comm itself,
 * where comm can divert. Every rank decides alike (the same verdicts, the same operation).
 * An optimizer step, clip_grad_norm, a save, new_group and send/recv always agree first: a
 * joined rank takes part in them all, and the step carries the checkpoint requests. Sets
 * op->active to every rank and marks comm's next collective with op's check word. */
static bool runs_ahead(pshard_shard_server_t *s, pshard_comm_t *comm, const shard_bufs_t *bufs,
                       shard_op_t *op)
{
    if (bufs->joined_seen)
        return false;
    shard_sop_kind_t k = op->sop.kind;
    if (k != SHARD_SOP_COLLECTIVE && k != SHARD_SOP_GATHER && k != SHARD_SOP_REDUCE_SCATTER)
        return false;
    /* HSDP: a gather's data moves on the replica's shard ranks, not on comm */
    if (k != SHARD_SOP_COLLECTIVE &&
        (!s->model || (s->model->shard_comm && s->model->shard_comm != comm)))
        return false;
    if (!pshard_comm_divert_next(comm, shard_sop_check(&op->sop)))
        return false;
    op->active = pshard_comm_world_size(comm);
    op->ckpt_request = 0; /* (read by a step only) */
    return true;
}

/* Holding mu: the world ring failed for an aborted step (a lost trainer) and the setup thread
 * has not put its replacement in place yet. */
static bool ring_rebuilding(pshard_shard_server_t *s)
{
    if (s->comm)
        return shard_ring_step_aborted(s, s->comm);
    return s->ring_serial > s->comm_serial && s->fatal == PSHARD_OK;
}

/* Waits (without op_mu, which the rebuild takes) while the world ring is rebuilt after an
 * aborted step, at most as long as a ring takes to form, so that an operation runs on the new
 * ring instead of failing UNAVAILABLE. False (UNAVAILABLE in *rc, err says why) when it was not
 * rebuilt by until. */
static bool wait_ring(pshard_shard_server_t *s, int64_t until, pshard_status_t *rc, char *err,
                      size_t errlen)
{
    pthread_mutex_lock(&s->mu);
    while (ring_rebuilding(s) && !atomic_load(&s->stop) && ps_now_ns() < until) {
        shard_cv_wait(s, 50);
    }
    bool ready = !ring_rebuilding(s);
    pthread_mutex_unlock(&s->mu);
    if (!ready)
        *rc = ps_errf(err, errlen, PSHARD_ERR_UNAVAILABLE,
                      "the ring is still being rebuilt after an aborted step; retry");
    return ready;
}

/* Holding op_mu: fails every operation of a trainer that has not taken note of every step
 * abort yet (its operations queued before it heard of one must not run on the new ring),
 * until it does (Resync). */
static pshard_status_t abort_check(pshard_shard_server_t *s, const shard_op_t *op, char *err,
                                   size_t errlen)
{
    pshard_status_t rc = PSHARD_OK;
    pthread_mutex_lock(&s->mu);
    if (s->session_aborts < s->ring_serial) {
        if (op->ack_abort)
            s->session_aborts = s->ring_serial;
        else
            rc = ps_errf(err, errlen, PSHARD_ERR_STEP_ABORTED, "%s", s->abort_msg);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* shard_op_run's body. */
static pshard_status_t op_run(pshard_shard_server_t *s, shard_op_t *op, char *err, size_t errlen)
{
    pshard_status_t rc = PSHARD_OK;
    pshard_comm_t *comm;
    int64_t until = ps_now_ns() + (int64_t)120 * 1000000000; /* as long as a ring may form */
    for (;;) {
        if (!wait_ring(s, until, &rc, err, errlen))
            return rc;
        /* A quick refusal while the cluster forms, without waiting for a running operation. */
        if (!shard_op_comm(s, &rc, err, errlen))
            return rc;
        pthread_mutex_lock(&s->op_mu);
        /* Again under op_mu: the setup thread may have replaced and retired the communicator
         * (shard_ops_retire_comm) while this operation waited for the lock. */
        comm = shard_op_comm(s, &rc, err, errlen);
        if (!comm) {
            pthread_mutex_unlock(&s->op_mu);
            return rc;
        }
        pthread_mutex_lock(&s->mu);
        bool again = ring_rebuilding(s);
        pthread_mutex_unlock(&s->mu);
        if (!again)
            break;
        pthread_mutex_unlock(&s->op_mu); /* a step abort came meanwhile: wait for its ring */
    }
    if (!op->no_session)
        rc = shard_session_check(s, op->session, err, errlen);
    if (rc == PSHARD_OK && !op->no_session)
        rc = abort_check(s, op, err, errlen);
    if (rc == PSHARD_OK && !op->no_session)
        rc = shard_shm_check(s, !op->new_model, err, errlen);
    if (rc == PSHARD_OK && op->needs_model && !s->model)
        rc = ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION, "%s", op->needs_model);
    shard_bufs_t *bufs = &s->bufs;
    if (rc == PSHARD_OK && op->p2p) {
        shard_pg_t *g = shard_pair_get(s, comm, op->peer, s->cfg.coll_timeout_ms, &rc, err, errlen);
        if (g) {
            comm = g->comm;
            bufs = &g->bufs;
        }
    }
    if (rc == PSHARD_OK && op->group) {
        shard_pg_t *g = shard_pg_find(s, op->group, &rc, err, errlen);
        if (g) {
            comm = g->comm;
            bufs = &g->bufs;
        }
    }
    if (rc == PSHARD_OK && op->check)
        rc = op->check(s, comm, op, err, errlen);
    if (rc != PSHARD_OK) {
        pthread_mutex_unlock(&s->op_mu);
        return rc;
    }
    int64_t start_ns = ps_now_ns();
    bool ahead = op->agree && runs_ahead(s, comm, bufs, op);
    if (ahead) {
        rc = op->run(s, comm, op, err, errlen);
        pshard_comm_divert_next(comm, 0); /* when run failed before its first collective */
        bool diverted = rc == PSHARD_ERR_DIVERTED;
        pthread_mutex_lock(&s->mu);
        s->ops_ahead++;
        s->ops_diverted += diverted;
        pthread_mutex_unlock(&s->mu);
        if (diverted) {
            ahead = false;
            /* Some rank asked for something else: a joined rank's agreement round, or another
             * operation (a desync, which the round names). Nothing ran anywhere. */
            PS_DEBUG(PS_SUB_SHARD, "%s", err);
            err[0] = '\0';
            rc = PSHARD_OK;
        }
    }
    if (!ahead) {
        if (op->agree)
            rc = shard_agree_active(s, comm, bufs, &op->sop, &op->active, &op->ckpt_request, err,
                                    errlen);
        if (rc == PSHARD_OK)
            rc = op->run(s, comm, op, err, errlen);
    }
    if (rc == PSHARD_ERR_PEER_LOST)
        shard_heal_peer_lost(s, &rc, err, errlen);
    /* Another process may have shrunk the memory the operation used: then it did not do what
     * it says, whatever it returned. */
    if (rc == PSHARD_OK && !op->no_session)
        rc = shard_shm_check(s, true, err, errlen);
    if (op->opk >= 0)
        shard_stats_record(s, (shard_opk_t)op->opk, start_ns, op->bytes, rc == PSHARD_OK);
    pthread_mutex_unlock(&s->op_mu);
    return rc;
}

pshard_status_t shard_op_run(pshard_shard_server_t *s, shard_op_t *op, char *err, size_t errlen)
{
    /* From its arrival, the wait for op_mu included: the trainer waits on pshard all along
     * (the step's wait time, shard_steps.h). */
    shard_steps_op_begin(&s->steps, ps_now_ns());
    pshard_status_t rc = op_run(s, op, err, errlen);
    shard_steps_op_end(&s->steps, ps_now_ns());
    return rc;
}

void shard_ops_retire_comm(pshard_shard_server_t *s, pshard_comm_t *old)
{
    pthread_mutex_lock(&s->op_mu);
    pshard_comm_destroy(old);
    s->bufs.joined_seen = false; /* the new generation's ranks have joined nothing yet */
    /* The groups were the old generation's: their ids start again with the new one. */
    shard_pgs_clear(s);
    shard_pairs_clear(s);
    s->next_pg_id = 1;
    s->next_keyed_pg_id = 0;
    pthread_mutex_unlock(&s->op_mu);
}

void shard_ops_retire_ring(pshard_shard_server_t *s, pshard_comm_t *old, uint32_t serial)
{
    pthread_mutex_lock(&s->op_mu);
    pshard_comm_destroy(old);
    s->bufs.joined_seen = false;
    /* The generation goes on: the groups keep their ids and are rebuilt on their first use. */
    shard_pgs_suspend(s, serial);
    shard_pairs_clear(s);
    pthread_mutex_unlock(&s->op_mu);
}

/* ---- the agreement round and Join's shadowing (the codec and verdict are shard_join.c's) ---- */

/* Broadcasts the agreed step's group words from the first active rank when a joined rank
 * needs them (every rank decides alike from the records); otherwise an active rank keeps its
 * own (the hash comparison made them equal). */
static pshard_status_t share_words(pshard_comm_t *comm, agreement_t *ag, int rank,
                                   const shard_sop_t *mine, char *err, size_t errlen)
{
    shard_sop_t *op = &ag->op;
    if (!ag->any_joined || ag->desync || ag->throw_rank >= 0) {
        op->words = mine ? mine->words : NULL; /* only active ranks go on to use it */
        return PSHARD_OK;
    }
    ag->words_heap = calloc(op->nwords, sizeof(int64_t));
    if (!ag->words_heap)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    if (rank == ag->first_active)
        memcpy(ag->words_heap, mine->words, op->nwords * sizeof(int64_t));
    pshard_coll_args_t b = {.op = PSHARD_COLL_BROADCAST,
                            .dtype = PSHARD_INT64,
                            .send = ag->words_heap,
                            .recv = ag->words_heap,
                            .count = op->nwords,
                            .root = ag->first_active,
                            .tag = AGREE_TAG + 2,
                            .label = "agreement groups"};
    op->words = ag->words_heap;
    return pshard_coll_run(comm, &b, err, errlen);
}

/* Runs one agreement round: this rank's record is (kind, mine). On success *ag holds the
 * outcome (free with agreement_free); errors are the all-gather's, or DESYNC for records no
 * pshard server sends. */
static pshard_status_t agree(pshard_shard_server_t *s, pshard_comm_t *comm, shard_bufs_t *bufs,
                             int kind, const shard_sop_t *mine, bool throw_flag, agreement_t *ag,
                             char *err, size_t errlen)
{
    memset(ag, 0, sizeof(*ag));
    int world = pshard_comm_world_size(comm), rank = pshard_comm_rank(comm);
    size_t need = (size_t)world * REC_WORDS;
    if (bufs->agree_cap < need) {
        int64_t *nb = realloc(bufs->agree_buf, need * sizeof(int64_t));
        if (!nb)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        bufs->agree_buf = nb;
        bufs->agree_cap = need;
    }
    int64_t rec[REC_WORDS];
    pthread_mutex_lock(&s->mu);
    int64_t ckpt = s->ckpt_requested;
    pthread_mutex_unlock(&s->mu);
    shard_rec_encode(rec, kind, mine, throw_flag, s->model ? s->model->step : 0, ckpt);
    char label[64];
    pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_GATHER,
                            .dtype = PSHARD_INT64,
                            .send = rec,
                            .recv = bufs->agree_buf,
                            .count = REC_WORDS,
                            .tag = AGREE_TAG,
                            .label = shard_op_label(s->model, "agreement", label, sizeof(label))};
    /* Divertible: the others may be running an operation ahead of the agreement (runs_ahead),
     * which diverts it and brings them here for the next round. Agreement rounds never divert
     * each other (their descriptors are all alike). */
    pshard_status_t rc;
    do {
        pshard_comm_divert_next(comm, AGREE_CHECK);
        rc = pshard_coll_run(comm, &a, err, errlen);
        pshard_comm_divert_next(comm, 0);
        if (rc == PSHARD_ERR_DIVERTED)
            err[0] = '\0';
    } while (rc == PSHARD_ERR_DIVERTED);
    PS_CHECK(rc);
    PS_CHECK(shard_agree_verdict(bufs->agree_buf, world, ag, err, errlen));
    if (ag->any_joined)
        bufs->joined_seen = true;
    if (ag->throw_rank >= 0 && ag->active > 0) { /* the active ranks get JOINED */
        pthread_mutex_lock(&s->mu);
        s->join_refused = true;
        pthread_mutex_unlock(&s->mu);
    }
    shard_sop_t *op = &ag->op;
    if (ag->all_joined || op->kind == SHARD_SOP_CLIP)
        return PSHARD_OK;
    if (op->kind == SHARD_SOP_STEP)
        return op->nwords > 0 ? share_words(comm, ag, rank, mine, err, errlen) : PSHARD_OK;
    if (op->nids <= REC_INLINE_IDS)
        return PSHARD_OK;
    /* Longer lists travel only when a joined rank needs them: everyone can tell from the
     * records, so every rank makes the same decision. */
    if (!ag->any_joined || ag->desync || ag->throw_rank >= 0) {
        op->ids = mine ? mine->ids : NULL; /* only active ranks go on to use it */
        return PSHARD_OK;
    }
    int64_t *wide = calloc(op->nids, sizeof(int64_t));
    ag->ids_heap = malloc(op->nids * sizeof(uint32_t));
    if (!wide || !ag->ids_heap) {
        free(wide);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    if (rank == ag->first_active)
        for (size_t i = 0; i < op->nids; i++)
            wide[i] = mine->ids[i];
    pshard_coll_args_t b = {.op = PSHARD_COLL_BROADCAST,
                            .dtype = PSHARD_INT64,
                            .send = wide,
                            .recv = wide,
                            .count = op->nids,
                            .root = ag->first_active,
                            .tag = AGREE_TAG + 1,
                            .label = "agreement ids"};
    rc = pshard_coll_run(comm, &b, err, errlen);
    for (size_t i = 0; rc == PSHARD_OK && i < op->nids; i++)
        ag->ids_heap[i] = (uint32_t)wide[i];
    free(wide);
    op->ids = ag->ids_heap;
    return rc;
}

pshard_status_t shard_agree_active(pshard_shard_server_t *s, pshard_comm_t *comm,
                                   shard_bufs_t *bufs, const shard_sop_t *op, int *active,
                                   int64_t *ckpt_request, char *err, size_t errlen)
{
    agreement_t ag;
    pshard_status_t rc = agree(s, comm, bufs, REC_OP, op, false, &ag, err, errlen);
    if (rc == PSHARD_OK) {
        rc = shard_agree_refusal(&ag, op, bufs->agree_buf, err, errlen);
        *active = ag.active;
        if (ckpt_request)
            *ckpt_request = ag.ckpt_request;
    }
    shard_agreement_free(&ag);
    return rc;
}

/* A buffer of at least bytes for shadowing the others' operations, reused across them. */
static void *follow_buffer(shard_bufs_t *b, size_t bytes)
{
    if (bytes == 0)
        bytes = 1;
    if (b->follow_cap < bytes) {
        void *nb = realloc(b->follow_buf, bytes);
        if (!nb)
            return NULL;
        b->follow_buf = nb;
        b->follow_cap = bytes;
    }
    return b->follow_buf;
}

/* The main hook: runs this rank's side of the operation the others agreed on. */
static pshard_status_t follow(pshard_shard_server_t *s, pshard_comm_t *comm, shard_bufs_t *bufs,
                              const agreement_t *ag, char *err, size_t errlen)
{
    shard_model_t *m = s->model;
    const shard_sop_t *op = &ag->op;
    if (op->kind == SHARD_SOP_COLLECTIVE) {
        size_t es = pshard_dtype_size(op->dtype);
        uint64_t world = (uint64_t)ag->world;
        if (op->count > (1ull << 32) / es || op->coll_op < PSHARD_COLL_ALL_GATHER ||
            op->coll_op > PSHARD_COLL_ALL_TO_ALL)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "cannot shadow %s of %" PRIu64 " elements",
                           pshard_coll_op_name((pshard_coll_op_t)op->coll_op), op->count);
        size_t send_bytes = (size_t)op->count * es;
        bool gathers = op->coll_op == PSHARD_COLL_ALL_GATHER || op->coll_op == PSHARD_COLL_GATHER ||
                       op->coll_op == PSHARD_COLL_ALL_TO_ALL;
        size_t recv_bytes = gathers ? send_bytes * world : send_bytes;
        if (op->coll_op == PSHARD_COLL_SCATTER || op->coll_op == PSHARD_COLL_ALL_TO_ALL ||
            op->coll_op == PSHARD_COLL_REDUCE_SCATTER)
            send_bytes *= world; /* whether or not this rank is the root: zeros if it is */
        uint8_t *buf = follow_buffer(bufs, send_bytes + recv_bytes);
        if (!buf)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        /* Nothing to contribute: the reduction's identity (zeros for a sum, and for the other
         * operations, which send nothing this rank's result depends on). */
        memset(buf, 0, send_bytes);
        if ((op->coll_op == PSHARD_COLL_ALL_REDUCE || op->coll_op == PSHARD_COLL_REDUCE ||
             op->coll_op == PSHARD_COLL_REDUCE_SCATTER) &&
            send_bytes > 0 &&
            pshard_reduce_identity((pshard_reduce_t)op->reduce, op->dtype, buf) == 0)
            for (size_t k = 1; k < send_bytes / es; k++)
                memcpy(buf + k * es, buf, es);
        /* A broadcast runs in place: the receive buffer is the send buffer. */
        void *recv = op->coll_op == PSHARD_COLL_BROADCAST ? buf : buf + send_bytes;
        return shard_run_collective(comm, op, buf, recv, ag->active, err, errlen);
    }
    if (bufs != &s->bufs)
        return ps_errf(err, errlen, PSHARD_ERR_DESYNC,
                       "the others run %s on a process group; only plain collectives run there",
                       shard_sop_name(op->kind));
    if (!m)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "the others run %s but no model is defined here", shard_sop_name(op->kind));
    if (op->kind == SHARD_SOP_STEP)
        return shard_run_step(s, comm, m, op, ag->ckpt_request, &(double){0}, err, errlen);
    if (op->kind == SHARD_SOP_CLIP)
        return shard_run_clip(comm, m, op->max_norm, op->norm_type, &(double){0}, err, errlen);
    if (op->kind == SHARD_SOP_SAVE) {
        char dir[512];
        return shard_ckpt_save(s, comm, m, dir, sizeof(dir), err, errlen);
    }
    /* The same operation as the others', on one scratch buffer as large as the largest of its
     * tensors: what is gathered into it is thrown away, and zeros are this rank's gradient. */
    size_t es = pshard_dtype_size(op->dtype), largest = 0;
    for (size_t i = 0; i < op->nids; i++) {
        uint32_t p = op->ids[i];
        if (p >= m->nparams)
            return ps_errf(err, errlen, PSHARD_ERR_DESYNC,
                           "the others run %s of parameter #%u; the model has %zu",
                           shard_sop_name(op->kind), p, m->nparams);
        largest = m->params[p].numel * es > largest ? m->params[p].numel * es : largest;
    }
    void *buf = follow_buffer(bufs, largest);
    void **each = malloc((op->nids ? op->nids : 1) * sizeof(void *));
    if (!buf || !each) {
        free(each);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    for (size_t i = 0; i < op->nids; i++)
        each[i] = buf;
    bool gather = op->kind == SHARD_SOP_GATHER;
    if (!gather)
        memset(buf, 0, largest); /* this rank contributes no gradient */
    pshard_status_t rc = shard_tensors_run(comm, m, gather, op->ids, each, false, op->nids,
                                           op->dtype, ag->active, err, errlen);
    free(each);
    return rc;
}

/* Tells the coordinator (best effort, short deadline: the join goes on without it). */
static void report_join(pshard_shard_server_t *s, Pshard__JoinPhase phase, int rank, int64_t step,
                        bool throw_flag, int last_rank)
{
    if (!s->coord)
        return; /* no coordinator to tell (a server built without one, in the unit tests) */
    char id[64], key[64];
    pthread_mutex_lock(&s->mu);
    ps_strlcpy(id, s->member_id, sizeof(id));
    ps_strlcpy(key, s->lease_key, sizeof(key));
    pthread_mutex_unlock(&s->mu);
    Pshard__JoinReport req = PSHARD__JOIN_REPORT__INIT;
    req.member_id = id;
    req.lease_key = key;
    req.rank = rank;
    req.phase = phase;
    req.step = step;
    req.throw_on_early_termination = throw_flag;
    req.last_rank = last_rank;
    char err[PSHARD_ERRLEN] = "";
    if (ps_coord_rpc_report_join(s->coord, &req, NULL, 2000, err, sizeof(err)) != PSHARD_OK)
        PS_WARN(PS_SUB_SHARD, "could not report the join to the coordinator: %s", err);
}

/* One communicator a joined rank shadows (the world's, or a group's it is in): agreement rounds
 * on it until every one of its ranks has joined. */
typedef struct {
    pshard_shard_server_t *s;
    pshard_comm_t *comm;
    shard_bufs_t *bufs;
    bool throw_flag;
    pshard_status_t rc;
    int last_rank; /* of the communicator, once all joined */
    char err[PSHARD_ERRLEN];
    pthread_t thread;
    bool started;
} shadow_t;

static void shadow_loop(shadow_t *w)
{
    pshard_shard_server_t *s = w->s;
    int kind = REC_JOIN;
    w->rc = PSHARD_OK;
    w->last_rank = -1;
    for (;;) {
        agreement_t ag;
        w->rc = agree(s, w->comm, w->bufs, kind, NULL, w->throw_flag, &ag, w->err, sizeof(w->err));
        kind = REC_JOINED;
        if (w->rc != PSHARD_OK)
            break;
        if (ag.all_joined) {
            w->last_rank = ag.last_rank;
            w->bufs->joined_seen = false; /* every rank of the communicator, in this round */
            shard_agreement_free(&ag);
            break;
        }
        const int64_t *recs = w->bufs->agree_buf;
        /* (what every active rank refuses, shard_agree_refusal, runs nowhere) */
        bool skip = ag.desync || ag.throw_rank >= 0 || ag.op.kind == SHARD_SOP_NEW_GROUPS ||
                    ag.op.kind == SHARD_SOP_P2P ||
                    (ag.op.kind == SHARD_SOP_STEP && ag.op.trainer_stepped) ||
                    (ag.op.kind == SHARD_SOP_COLLECTIVE && ag.op.coll_op == PSHARD_COLL_BROADCAST &&
                     ag.op.root >= 0 && ag.op.root < ag.world &&
                     recs[(size_t)ag.op.root * REC_WORDS + W_KIND] != REC_OP);
        if (!skip)
            w->rc = follow(s, w->comm, w->bufs, &ag, w->err, sizeof(w->err));
        shard_agreement_free(&ag);
        if (w->rc != PSHARD_OK)
            break;
        if (!skip) {
            pthread_mutex_lock(&s->mu);
            s->shadowed_ops++;
            pthread_mutex_unlock(&s->mu);
        }
    }
}

static void *shadow_main(void *arg)
{
    shadow_loop(arg);
    return NULL;
}

pshard_status_t shard_join_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                               char *err, size_t errlen)
{
    shard_join_result_t *res = op->arg;
    int rank = pshard_comm_rank(comm);
    bool throw_flag = res->throw_on_early_termination;
    pthread_mutex_lock(&s->mu);
    s->joined = true;
    s->joined_step = s->model->step;
    s->shadowed_ops = 0;
    pthread_mutex_unlock(&s->mu);
    PS_INFO(PS_SUB_SHARD, "trainer joined at step %" PRId64 "%s; shadowing the other ranks",
            s->joined_step, throw_flag ? " (throw_on_early_termination)" : "");
    report_join(s, PSHARD__JOIN_PHASE__JOINED, rank, s->joined_step, throw_flag, -1);
    /* The process groups this rank is in get a thread each (their operations come in their
     * own order, independent of the world's); the world's is this thread. The groups cannot
     * change meanwhile: this operation holds op_mu. */
    shadow_t world = {.s = s, .comm = comm, .bufs = &s->bufs, .throw_flag = throw_flag};
    /* The process groups, then the pairs (whose peers' sends and receives are refused with
     * JOINED). */
    size_t npairs = s->pairs ? (size_t)s->npairs : 0, nall = s->npgs + npairs;
    shard_pg_t **all = calloc(nall ? nall : 1, sizeof(*all));
    shadow_t *groups = calloc(nall ? nall : 1, sizeof(*groups));
    if (!groups || !all) {
        free(all);
        free(groups);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    for (size_t i = 0; i < s->npgs; i++)
        all[i] = s->pgs[i];
    for (size_t i = 0; i < npairs; i++)
        all[s->npgs + i] = s->pairs[i];
    shard_pairs_mark_joined(s, rank, true);
    pshard_status_t rc = PSHARD_OK;
    for (size_t i = 0; i < nall && rc == PSHARD_OK; i++) {
        shard_pg_t *g = all[i];
        if (!g)
            continue;
        if (!g->comm)
            continue;
        groups[i] = (shadow_t){.s = s, .comm = g->comm, .bufs = &g->bufs, .throw_flag = throw_flag};
        if (pthread_create(&groups[i].thread, NULL, shadow_main, &groups[i]) != 0)
            rc = ps_errf(err, errlen, PSHARD_ERR_SYSTEM,
                         "cannot start a thread to shadow group %" PRIu32, g->id);
        else
            groups[i].started = true;
    }
    if (rc == PSHARD_OK) {
        shadow_loop(&world);
        rc = world.rc;
        if (rc != PSHARD_OK)
            ps_errf(err, errlen, rc, "%s", world.err);
    }
    if (rc != PSHARD_OK) /* the groups' rounds would wait for ever for this rank's world */
        shard_pgs_abort(s, -1, rc, err);
    for (size_t i = 0; i < nall; i++) {
        if (!groups[i].started)
            continue;
        pthread_join(groups[i].thread, NULL);
        if (groups[i].rc != PSHARD_OK && rc == PSHARD_OK)
            rc = ps_errf(err, errlen, groups[i].rc, "group %" PRIu32 ": %s", all[i]->id,
                         groups[i].err);
    }
    shard_pairs_mark_joined(s, rank, false);
    free(groups);
    free(all);
    int last_rank = world.last_rank;
    pthread_mutex_lock(&s->mu);
    s->joined = false;
    res->shadowed = s->shadowed_ops;
    res->others_raised = s->join_refused;
    if (rc == PSHARD_OK) /* every rank joined: the next join starts afresh */
        s->join_refused = false;
    pthread_mutex_unlock(&s->mu);
    res->step = s->model->step;
    if (rc != PSHARD_OK) {
        PS_WARN(PS_SUB_SHARD, "join ended with an error: %s", err);
        char why[PSHARD_ERRLEN];
        ps_strlcpy(why, err, sizeof(why));
        return ps_errf(err, errlen, rc, "while shadowing the other ranks after the join: %s", why);
    }
    PS_INFO(PS_SUB_SHARD, "every rank joined (last: rank %d) after %" PRIu64 " shadowed operations",
            last_rank, res->shadowed);
    if (rank == 0)
        report_join(s, PSHARD__JOIN_PHASE__ALL_JOINED, rank, res->step, false, last_rank);
    res->is_last_joiner = last_rank == rank;
    res->last_rank = last_rank;
    return PSHARD_OK;
}
