/* An intrusive FIFO (ps_queue_t) and a work queue built on it (ps_workq_t: the FIFO, a mutex,
 * a condition variable and a close flag), the one shape every queue of requests, calls,
 * frames and works in pshard takes. An item embeds a ps_qnode_t; the queue never allocates
 * or frees, so pushing cannot fail and the owner of an item stays its owner. */
#ifndef PSHARD_QUEUE_H
#define PSHARD_QUEUE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

typedef struct ps_qnode {
    struct ps_qnode *next;
} ps_qnode_t;

/* Zero-initialised (or PS_QUEUE_INIT) is an empty queue. Not thread-safe: the owner locks. */
typedef struct {
    ps_qnode_t *head, *tail;
    size_t len; /* items queued */
} ps_queue_t;

#define PS_QUEUE_INIT                                                                              \
    {                                                                                              \
        NULL, NULL, 0                                                                              \
    }

/* The struct of type `type` whose member `member` is the node at ptr. */
#define PS_CONTAINER_OF(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

/* The item of type `type` at the head of q (not removed), or NULL. */
#define PS_QUEUE_PEEK(q, type, member)                                                             \
    ((q)->head ? PS_CONTAINER_OF((q)->head, type, member) : (type *)NULL)

/* Removes and returns the item of type `type` at the head of q, or NULL. */
#define PS_QUEUE_POP(q, type, member)                                                              \
    ((type *)ps_queue__entry(ps_queue_pop(q), offsetof(type, member)))

static inline bool ps_queue_empty(const ps_queue_t *q)
{
    return q->head == NULL;
}

/* Appends n (not in any queue) at the tail. */
static inline void ps_queue_push(ps_queue_t *q, ps_qnode_t *n)
{
    n->next = NULL;
    if (q->tail)
        q->tail->next = n;
    else
        q->head = n;
    q->tail = n;
    q->len++;
}

/* Removes and returns the head, or NULL when q is empty. */
static inline ps_qnode_t *ps_queue_pop(ps_queue_t *q)
{
    ps_qnode_t *n = q->head;
    if (n) {
        q->head = n->next;
        if (!q->head)
            q->tail = NULL;
        q->len--;
        n->next = NULL;
    }
    return n;
}

/* The item whose node at offset off is n, or NULL for NULL. */
static inline void *ps_queue__entry(ps_qnode_t *n, size_t off)
{
    return n ? (void *)((char *)n - off) : NULL;
}

/* A FIFO shared by producer threads and the threads that take from it. Thread-safe. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ps_queue_t q; /* under mu */
    bool closed;  /* under mu: takers return NULL once q is empty */
} ps_workq_t;

/* Initialises an empty, open queue; ps_workq_destroy releases it (the items are the owner's). */
void ps_workq_init(ps_workq_t *wq);
void ps_workq_destroy(ps_workq_t *wq);

/* Appends n and wakes one taker. A push after close is still taken (the queue drains). */
void ps_workq_push(ps_workq_t *wq, ps_qnode_t *n);

/* Waits for an item and removes it; NULL once the queue is closed and empty. */
ps_qnode_t *ps_workq_take(ps_workq_t *wq);

/* Wakes every taker: they take what is left, then return NULL. */
void ps_workq_close(ps_workq_t *wq);

#endif
