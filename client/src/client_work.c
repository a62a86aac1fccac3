/* libpshard's gathers and reduce-scatters: asynchronous ones queue for the worker thread and
 * run in issue order, blocking ones run on the caller once everything before them is done. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/log.h"
#include "pshard/util.h"

#include "client_internal.h"

/* One Gather or ReduceScatter request for the blocks picked when the work was issued. */
static pshard_status_t run_tensor_op(pshard_client_t *c, work_kind_t kind, const size_t *ids,
                                     const uint64_t *offs, size_t count, char *err, size_t errlen)
{
    if (count == 0)
        return PSHARD_OK;
    Pshard__TensorRef *refs = calloc(count, sizeof(*refs));
    Pshard__TensorRef **ptrs = calloc(count, sizeof(*ptrs));
    if (!refs || !ptrs) {
        free(refs);
        free(ptrs);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    pshard_status_t rc = PSHARD_OK;
    for (size_t k = 0; k < count; k++) {
        pshard__tensor_ref__init(&refs[k]);
        refs[k].param = (uint32_t)ids[k];
        refs[k].offset = offs[k];
        ptrs[k] = &refs[k];
    }
    size_t ps = pshard_dtype_size(c->param_dtype), gs = pshard_dtype_size(c->reduce_dtype);
    if (c->cfg.remote && kind == WORK_REDUCE_SCATTER) {
        for (size_t k = 0; k < count && rc == PSHARD_OK; k++)
            rc = client_remote_write(c, PSHARD__REGION__MODEL, &c->model, refs[k].offset,
                                     c->numel[ids[k]] * gs, 0, err, errlen);
    }
    if (rc == PSHARD_OK) {
        if (kind == WORK_GATHER) {
            Pshard__GatherRequest req = PSHARD__GATHER_REQUEST__INIT;
            req.session = c->session;
            req.n_tensors = count;
            req.tensors = ptrs;
            req.dtype = client_dtype_pb(c->param_dtype);
            rc = client_call(c, "Gather", &req.base, &pshard__gather_response__descriptor, NULL,
                             err, errlen);
        } else {
            Pshard__ReduceScatterRequest req = PSHARD__REDUCE_SCATTER_REQUEST__INIT;
            req.session = c->session;
            req.n_tensors = count;
            req.tensors = ptrs;
            req.dtype = client_dtype_pb(c->reduce_dtype);
            rc = client_call(c, "ReduceScatter", &req.base,
                             &pshard__reduce_scatter_response__descriptor, NULL, err, errlen);
        }
    }
    if (rc == PSHARD_OK && c->cfg.remote && kind == WORK_GATHER) {
        for (size_t k = 0; k < count && rc == PSHARD_OK; k++)
            rc = client_remote_read(c, PSHARD__REGION__MODEL, &c->model, refs[k].offset,
                                    c->numel[ids[k]] * ps, err, errlen);
    }
    free(refs);
    free(ptrs);
    return rc;
}

/* Publishes the end of a work's transfer (holding c->mu): gathered parameters become
 * readable, or are freed again on failure; reduce-scattered gradients go back to the pool. */
static void finish_buffers(pshard_client_t *c, pshard_work_t *w, pshard_status_t rc)
{
    for (size_t k = 0; k < w->n; k++) {
        size_t i = w->ids[k];
        if (w->kind == WORK_GATHER) {
            if (rc == PSHARD_OK)
                c->pbuf[i].state = BUF_READY;
            else
                client_param_release(c, i);
        } else {
            client_buf_release(c, &c->gbuf[i]);
        }
    }
    if (w->kind == WORK_GATHER && w->counted) {
        c->gathers_in_flight--;
        w->counted = false;
    }
}

/* Picks the parameters a work moves and their blocks, on the caller's thread (holding
 * c->mu): a gather skips what is gathered or being gathered and takes blocks from the pool,
 * waiting for unfinished work to return blocks when it is full; a reduce-scatter takes the
 * gradients handed out by pshard_grad. On error nothing is taken. */
static pshard_status_t claim_buffers(pshard_client_t *c, pshard_work_t *w, const size_t *ids,
                                     size_t n)
{
    size_t count = n ? n : c->nparams;
    w->ids = malloc((count ? count : 1) * sizeof(size_t));
    w->offs = malloc((count ? count : 1) * sizeof(uint64_t));
    if (!w->ids || !w->offs)
        return client_fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
    w->n = 0;
    for (size_t k = 0; k < count; k++) {
        size_t i = n ? ids[k] : k;
        if (i >= c->nparams) {
            finish_buffers(c, w, PSHARD_ERR_ABORTED);
            w->n = 0;
            return client_fail(c, PSHARD_ERR_NOT_FOUND,
                               "unknown parameter #%zu (the model has %zu)", i, c->nparams);
        }
        if (w->kind == WORK_GATHER) {
            if (c->pbuf[i].state != BUF_NONE) {
                c->mem.params_skipped++;
                continue;
            }
            size_t bytes = c->numel[i] * pshard_dtype_size(c->param_dtype), off;
            int took;
            while ((took = client_param_take(c, i, bytes, &off)) == 0) {
                if (client_idle(c)) {
                    size_t in_use = c->pool->in_use_bytes;
                    finish_buffers(c, w, PSHARD_ERR_ABORTED);
                    w->n = 0;
                    return client_fail(
                        c, PSHARD_ERR_NO_MEMORY,
                        "the %zu-byte pool cannot fit the %zu-byte parameter #%zu "
                        "(%zu bytes in use): reshard or reduce-scatter first, or raise "
                        "pool_bytes%s",
                        c->mem.pool_bytes, bytes, i, in_use, client_pool_hint(c));
                }
                pthread_cond_wait(&c->cv, &c->mu);
            }
            if (took < 0) {
                char why[sizeof(c->last_error)];
                ps_strlcpy(why, c->last_error, sizeof(why));
                finish_buffers(c, w, PSHARD_ERR_ABORTED);
                w->n = 0;
                return client_fail(c, PSHARD_ERR_NO_MEMORY, "%s", why);
            }
            c->pbuf[i] = (tensor_buf_t){BUF_PENDING, off, bytes};
            c->mem.params_gathered++;
        } else {
            if (c->gbuf[i].state != BUF_READY) {
                if (!n)
                    continue; /* "all": the gradients handed out */
                finish_buffers(c, w, PSHARD_ERR_ABORTED);
                w->n = 0;
                return client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                                   c->gbuf[i].state == BUF_PENDING
                                       ? "the gradient of parameter #%zu is already being "
                                         "reduce-scattered"
                                       : "the gradient of parameter #%zu was never written "
                                         "(pshard_grad hands out its buffer)",
                                   i);
            }
            c->gbuf[i].state = BUF_PENDING;
        }
        w->offs[w->n] = w->kind == WORK_GATHER ? c->pbuf[i].off : c->gbuf[i].off;
        w->ids[w->n++] = i;
    }
    return PSHARD_OK;
}

/* The worker's run of a queued collective w, entered and left holding c->mu: a place in the
 * scratch region first (a staged one waiting on the heap gets one now and its send bytes move
 * in), then the collective with c->mu released. A staged one keeps its place and result for
 * the caller; another one's bytes are copied from and to the caller's buffers. */
static pshard_status_t run_collective(pshard_client_t *c, pshard_work_t *w, char *err,
                                      size_t errlen)
{
    w->running = true;
    pshard_status_t rc = w->in_scratch ? PSHARD_OK : client_stage_place(c, w, true);
    if (rc != PSHARD_OK) {
        ps_strlcpy(err, c->last_error, errlen);
        w->running = false;
        return rc;
    }
    pthread_mutex_unlock(&c->mu);
    /* w is running: nobody else moves its place or heap copy meanwhile */
    if (w->heap && w->layout.send_bytes)
        memcpy((uint8_t *)c->scratch.base + w->st_off, w->heap, w->layout.send_bytes);
    rc = client_collective_exec(c, &w->coll, &w->layout, w->st_off, !w->staged, err, errlen);
    pthread_mutex_lock(&c->mu);
    client_stage_drop_heap(c, w);
    w->running = false;
    if (!w->staged || rc != PSHARD_OK)
        client_stage_drop(c, w);
    return rc;
}

void *client_worker_main(void *arg)
{
    pshard_client_t *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        while ((ps_queue_empty(&c->queue) || c->busy) && !c->stop)
            pthread_cond_wait(&c->cv, &c->mu);
        pshard_work_t *w = PS_QUEUE_POP(&c->queue, pshard_work_t, node);
        if (!w) {
            pthread_mutex_unlock(&c->mu);
            return NULL;
        }
        c->busy = true;
        char err[PSHARD_ERRLEN] = "";
        pshard_status_t rc;
        if (w->kind == WORK_COLLECTIVE) {
            rc = run_collective(c, w, err, sizeof(err)); /* unlocks and locks c->mu */
        } else {
            pthread_mutex_unlock(&c->mu);
            rc = run_tensor_op(c, w->kind, w->ids, w->offs, w->n, err, sizeof(err));
            pthread_mutex_lock(&c->mu);
        }
        finish_buffers(c, w, rc);
        c->busy = false;
        w->status = rc;
        ps_strlcpy(w->error, err, sizeof(w->error));
        w->done = true;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
}

static void work_free(pshard_work_t *w)
{
    if (w) {
        free(w->ids);
        free(w->offs);
        free(w);
    }
}

static pshard_status_t start_work(pshard_client_t *c, work_kind_t kind, const size_t *ids, size_t n,
                                  pshard_work_t **out)
{
    *out = NULL;
    if (!c->nparams)
        return client_fail(c, PSHARD_ERR_FAILED_PRECONDITION, "no model is defined");
    pshard_work_t *w = calloc(1, sizeof(*w));
    if (!w)
        return client_fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
    w->kind = kind;
    w->c = c;
    pthread_mutex_lock(&c->mu);
    if (kind == WORK_GATHER) {
        while (c->max_gathers_in_flight > 0 && c->gathers_in_flight >= c->max_gathers_in_flight)
            pthread_cond_wait(&c->cv, &c->mu);
    }
    pshard_status_t rc = claim_buffers(c, w, ids, n);
    if (rc != PSHARD_OK) {
        pthread_mutex_unlock(&c->mu);
        work_free(w);
        return rc;
    }
    if (w->n == 0) {
        w->done = true; /* nothing to move: complete at once */
    } else {
        if (kind == WORK_GATHER) {
            w->counted = true;
            if (++c->gathers_in_flight > c->mem.peak_gathers_in_flight)
                c->mem.peak_gathers_in_flight = c->gathers_in_flight;
        }
        ps_queue_push(&c->queue, &w->node);
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    *out = w;
    return PSHARD_OK;
}

pshard_status_t client_work_queue_collective(pshard_client_t *c, const pshard_collective_args_t *a,
                                             const coll_layout_t *l, bool staged,
                                             pshard_work_t **out)
{
    pshard_work_t *w = calloc(1, sizeof(*w));
    if (!w)
        return client_fail(c, PSHARD_ERR_NO_MEMORY, "out of memory");
    w->kind = WORK_COLLECTIVE;
    w->c = c;
    w->coll = *a;
    w->layout = *l;
    w->staged = staged;
    pthread_mutex_lock(&c->mu);
    if (staged) {
        /* the send bytes now, into a free range of the scratch region, else onto the heap */
        uint8_t *to = NULL;
        if (client_stage_place(c, w, false) == PSHARD_OK)
            to = (uint8_t *)c->scratch.base + w->st_off;
        else if (client_stage_heap(c, w, coll_span(l)))
            to = w->heap;
        if (!to) {
            pthread_mutex_unlock(&c->mu);
            free(w);
            return client_fail(c, PSHARD_ERR_NO_MEMORY,
                               "out of memory for a %zu-byte copy of a queued collective's bytes",
                               coll_span(l));
        }
        if (l->send_bytes)
            memcpy(to, l->src, l->send_bytes);
        w->coll.send = w->coll.recv = NULL; /* never read or written again */
        w->layout.src = w->layout.dst = NULL;
    }
    ps_queue_push(&c->queue, &w->node);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    *out = w;
    return PSHARD_OK;
}

pshard_status_t pshard_gather_start(pshard_client_t *c, const size_t *ids, size_t n,
                                    pshard_work_t **work)
{
    return start_work(c, WORK_GATHER, ids, n, work);
}

pshard_status_t pshard_reduce_scatter_start(pshard_client_t *c, const size_t *ids, size_t n,
                                            pshard_work_t **work)
{
    return start_work(c, WORK_REDUCE_SCATTER, ids, n, work);
}

/* Holding c->mu: waits for w to finish; its status (its message made the client's). */
static pshard_status_t work_outcome(pshard_work_t *w)
{
    pshard_client_t *c = w->c;
    while (!w->done)
        pthread_cond_wait(&c->cv, &c->mu);
    if (w->status != PSHARD_OK)
        ps_strlcpy(c->last_error, w->error, sizeof(c->last_error));
    return w->status;
}

pshard_status_t pshard_work_wait(pshard_work_t *w)
{
    if (!w)
        return PSHARD_ERR_INVALID_ARGUMENT;
    pshard_client_t *c = w->c;
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc = work_outcome(w);
    w->pinned = false;
    client_stage_drop(c, w);
    pthread_mutex_unlock(&c->mu);
    work_free(w);
    return rc;
}

pshard_status_t pshard_work_wait_result(pshard_work_t *w, const void **result, size_t *bytes)
{
    if (!w || !result || !bytes)
        return PSHARD_ERR_INVALID_ARGUMENT;
    *result = NULL;
    *bytes = 0;
    pshard_client_t *c = w->c;
    pthread_mutex_lock(&c->mu);
    pshard_status_t rc = work_outcome(w);
    if (rc == PSHARD_OK && w->staged && w->layout.recv_bytes) {
        w->pinned = true;
        const uint8_t *at = w->in_scratch ? (uint8_t *)c->scratch.base + w->st_off : w->heap;
        *result = at + w->layout.recv_off;
        *bytes = w->layout.recv_bytes;
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

bool pshard_work_test(pshard_work_t *w)
{
    if (!w)
        return false;
    pthread_mutex_lock(&w->c->mu);
    bool done = w->done;
    pthread_mutex_unlock(&w->c->mu);
    return done;
}

/* A blocking operation runs on the caller's thread once everything issued before it finished:
 * handing it to the worker and waiting would only add two thread wake-ups. */
static pshard_status_t run_inline(pshard_client_t *c, work_kind_t kind, const size_t *ids, size_t n)
{
    if (!c->nparams)
        return client_fail(c, PSHARD_ERR_FAILED_PRECONDITION, "no model is defined");
    pshard_work_t w = {.c = c, .kind = kind};
    pthread_mutex_lock(&c->mu);
    client_wait_idle(c);
    pshard_status_t rc = claim_buffers(c, &w, ids, n);
    if (rc != PSHARD_OK) {
        pthread_mutex_unlock(&c->mu);
        free(w.ids);
        free(w.offs);
        return rc;
    }
    c->busy = true;
    pthread_mutex_unlock(&c->mu);
    char err[PSHARD_ERRLEN] = "";
    rc = run_tensor_op(c, kind, w.ids, w.offs, w.n, err, sizeof(err));
    pthread_mutex_lock(&c->mu);
    finish_buffers(c, &w, rc);
    c->busy = false;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    free(w.ids);
    free(w.offs);
    if (rc != PSHARD_OK)
        client_fail(c, rc, "%s", err);
    return rc;
}

pshard_status_t pshard_gather(pshard_client_t *c, const size_t *ids, size_t n)
{
    /* Parameters an earlier gather brought in need nothing: return without queueing behind
     * the reduce-scatters in flight (backward gathers a unit it prefetched while the unit
     * after it is being reduced). */
    pthread_mutex_lock(&c->mu);
    bool all_ready = c->nparams > 0;
    for (size_t k = 0; k < (n ? n : c->nparams) && all_ready; k++) {
        size_t i = n ? ids[k] : k;
        all_ready = i < c->nparams && c->pbuf[i].state == BUF_READY;
    }
    if (all_ready)
        c->mem.params_skipped += n ? n : c->nparams;
    pthread_mutex_unlock(&c->mu);
    return all_ready ? PSHARD_OK : run_inline(c, WORK_GATHER, ids, n);
}

pshard_status_t pshard_reduce_scatter(pshard_client_t *c, const size_t *ids, size_t n)
{
    return run_inline(c, WORK_REDUCE_SCATTER, ids, n);
}

pshard_status_t pshard_reshard(pshard_client_t *c, const size_t *ids, size_t n)
{
    pthread_mutex_lock(&c->mu);
    size_t count = n ? n : c->nparams;
    pshard_status_t rc = PSHARD_OK;
    for (size_t k = 0; k < count && rc == PSHARD_OK; k++) {
        size_t i = n ? ids[k] : k;
        if (i >= c->nparams)
            rc = client_fail(c, PSHARD_ERR_NOT_FOUND, "unknown parameter #%zu (the model has %zu)",
                             i, c->nparams);
        else if (c->pbuf[i].state == BUF_PENDING)
            rc =
                client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                            "parameter #%zu is still being gathered: wait for its gather first", i);
    }
    if (rc == PSHARD_OK)
        for (size_t k = 0; k < count; k++)
            client_param_release(c, n ? ids[k] : k);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

pshard_status_t pshard_forward_done(pshard_client_t *c, const size_t *ids, size_t n)
{
    return c->reshard_after_forward ? pshard_reshard(c, ids, n) : PSHARD_OK;
}
