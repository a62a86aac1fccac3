/* libpshard's places for plain collectives' bytes in the scratch region. A staged collective
 * (pshard_collective_start_staged) copies its send bytes into a range of the region when it is
 * issued and leaves its result there until the caller took it, so a queued collective moves
 * its bytes as often as a blocking one (once in, once out). Ranges are first fit, ordered by
 * offset in c->stage. Where none is free a staged collective waits on the heap, and whoever
 * must run (the worker, a blocking collective) moves other works' bytes to the heap to make
 * room: finished ones first, then ones still queued, never one that is running or being read.
 * Everything here holds c->mu. */
#include <stdlib.h>
#include <string.h>

#include "pshard/util.h"

#include "client_internal.h"

/* The first free range of bytes (aligned) among the held ones; false when none is. */
static bool stage_fit(const pshard_client_t *c, size_t bytes, size_t *off)
{
    if (c->nstage >= CLIENT_STAGE_MAX)
        return false;
    size_t at = 0;
    for (size_t k = 0; k < c->nstage; k++) {
        const pshard_work_t *h = c->stage[k];
        if (h->st_off >= at && h->st_off - at >= bytes)
            break;
        at = client_align(h->st_off + coll_span(&h->layout));
    }
    if (at > c->scratch.bytes || c->scratch.bytes - at < bytes)
        return false;
    *off = at;
    return true;
}

static void stage_hold(pshard_client_t *c, pshard_work_t *w, size_t off)
{
    size_t k = 0;
    while (k < c->nstage && c->stage[k]->st_off < off)
        k++;
    memmove(&c->stage[k + 1], &c->stage[k], (c->nstage - k) * sizeof(c->stage[0]));
    c->stage[k] = w;
    c->nstage++;
    w->st_off = off;
    w->in_scratch = true;
}

static void stage_unhold(pshard_client_t *c, pshard_work_t *w)
{
    for (size_t k = 0; k < c->nstage; k++)
        if (c->stage[k] == w) {
            memmove(&c->stage[k], &c->stage[k + 1], (c->nstage - k - 1) * sizeof(c->stage[0]));
            c->nstage--;
            break;
        }
    w->in_scratch = false;
}

bool client_stage_heap(pshard_client_t *c, pshard_work_t *w, size_t bytes)
{
    int best = -1;
    for (int i = 0; i < CLIENT_SPARES; i++) {
        size_t have = c->spare_bytes[i];
        if (c->spare[i] && have >= bytes && have / 2 <= bytes &&
            (best < 0 || have < c->spare_bytes[best]))
            best = i;
    }
    if (best >= 0) {
        w->heap = c->spare[best];
        w->heap_cap = c->spare_bytes[best];
        c->spare[best] = NULL;
        c->spare_bytes[best] = 0;
        return true;
    }
    w->heap = malloc(bytes ? bytes : 1);
    w->heap_cap = bytes;
    return w->heap != NULL;
}

void client_stage_drop_heap(pshard_client_t *c, pshard_work_t *w)
{
    if (!w->heap)
        return;
    size_t held = 0;
    int free_slot = -1;
    for (int i = 0; i < CLIENT_SPARES; i++) {
        held += c->spare_bytes[i];
        if (!c->spare[i])
            free_slot = i;
    }
    /* Small ones come from the heap quickly anyway. */
    if (free_slot < 0 || w->heap_cap < (64u << 10) || held + w->heap_cap > CLIENT_SPARE_MAX) {
        free(w->heap);
    } else {
        c->spare[free_slot] = w->heap;
        c->spare_bytes[free_slot] = w->heap_cap;
    }
    w->heap = NULL;
    w->heap_cap = 0;
}

void client_stage_free_spares(pshard_client_t *c)
{
    for (int i = 0; i < CLIENT_SPARES; i++) {
        free(c->spare[i]);
        c->spare[i] = NULL;
        c->spare_bytes[i] = 0;
    }
}

/* The held work whose bytes may move to the heap, finished ones first; NULL when none may. */
static pshard_work_t *stage_victim(pshard_client_t *c, const pshard_work_t *except)
{
    pshard_work_t *queued = NULL;
    for (size_t k = 0; k < c->nstage; k++) {
        pshard_work_t *h = c->stage[k];
        if (h == except || h->running || h->pinned)
            continue;
        if (h->done)
            return h;
        queued = h;
    }
    return queued;
}

/* Moves v's bytes that still matter (a queued one's send bytes, a finished one's result) from
 * the scratch region to the heap. */
static pshard_status_t stage_evict(pshard_client_t *c, pshard_work_t *v)
{
    const coll_layout_t *l = &v->layout;
    size_t off = v->done ? l->recv_off : 0;
    size_t len = v->done ? (v->status == PSHARD_OK ? l->recv_bytes : 0) : l->send_bytes;
    if (len && !client_stage_heap(c, v, coll_span(l)))
        return client_fail(c, PSHARD_ERR_NO_MEMORY,
                           "out of memory for a %zu-byte copy of a queued collective's bytes",
                           coll_span(l));
    if (len)
        memcpy(v->heap + off, (uint8_t *)c->scratch.base + v->st_off + off, len);
    stage_unhold(c, v);
    return PSHARD_OK;
}

pshard_status_t client_stage_place(pshard_client_t *c, pshard_work_t *w, bool wait)
{
    size_t bytes = coll_span(&w->layout), off;
    for (;;) {
        if (stage_fit(c, bytes, &off)) {
            stage_hold(c, w, off);
            return PSHARD_OK;
        }
        if (!wait)
            return PSHARD_ERR_UNAVAILABLE;
        pshard_work_t *v = stage_victim(c, w);
        if (v)
            PS_CHECK(stage_evict(c, v));
        else
            pthread_cond_wait(&c->cv, &c->mu); /* a pinned result is being read */
    }
}

void client_stage_drop(pshard_client_t *c, pshard_work_t *w)
{
    if (w->in_scratch) {
        stage_unhold(c, w);
        pthread_cond_broadcast(&c->cv);
    }
    client_stage_drop_heap(c, w);
}
