/* The work queue of pshard/queue.h: an intrusive FIFO behind one mutex and one condition
 * variable. */
#include "pshard/queue.h"

void ps_workq_init(ps_workq_t *wq)
{
    pthread_mutex_init(&wq->mu, NULL);
    pthread_cond_init(&wq->cv, NULL);
    wq->q = (ps_queue_t)PS_QUEUE_INIT;
    wq->closed = false;
}

void ps_workq_destroy(ps_workq_t *wq)
{
    pthread_cond_destroy(&wq->cv);
    pthread_mutex_destroy(&wq->mu);
}

void ps_workq_push(ps_workq_t *wq, ps_qnode_t *n)
{
    pthread_mutex_lock(&wq->mu);
    ps_queue_push(&wq->q, n);
    pthread_cond_signal(&wq->cv);
    pthread_mutex_unlock(&wq->mu);
}

ps_qnode_t *ps_workq_take(ps_workq_t *wq)
{
    pthread_mutex_lock(&wq->mu);
    while (ps_queue_empty(&wq->q) && !wq->closed)
        pthread_cond_wait(&wq->cv, &wq->mu);
    ps_qnode_t *n = ps_queue_pop(&wq->q);
    pthread_mutex_unlock(&wq->mu);
    return n;
}

void ps_workq_close(ps_workq_t *wq)
{
    pthread_mutex_lock(&wq->mu);
    wq->closed = true;
    pthread_cond_broadcast(&wq->cv);
    pthread_mutex_unlock(&wq->mu);
}
