/* Unit tests for pshard/queue.h: the intrusive FIFO keeps order and its length through any mix
 * of pushes and pops (checked against an array model on a random run), items are reached
 * through their embedded node, and the work queue hands every item to exactly one of several
 * taker threads, in order per producer, then returns NULL to all of them once closed. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "ps_test.h"
#include "pshard/queue.h"

typedef struct {
    int payload; /* before the node, so the node is not at offset 0 */
    ps_qnode_t node;
} item_t;

static void test_fifo_basics(void)
{
    ps_queue_t q = PS_QUEUE_INIT;
    CU_ASSERT_TRUE(ps_queue_empty(&q));
    CU_ASSERT_PTR_NULL(PS_QUEUE_POP(&q, item_t, node));
    CU_ASSERT_PTR_NULL(PS_QUEUE_PEEK(&q, item_t, node));
    item_t a = {1, {NULL}}, b = {2, {NULL}}, c = {3, {NULL}};
    ps_queue_push(&q, &a.node);
    ps_queue_push(&q, &b.node);
    CU_ASSERT_EQUAL(q.len, 2);
    CU_ASSERT_PTR_EQUAL(PS_QUEUE_PEEK(&q, item_t, node), &a);
    CU_ASSERT_PTR_EQUAL(PS_QUEUE_POP(&q, item_t, node), &a);
    ps_queue_push(&q, &c.node);
    CU_ASSERT_PTR_EQUAL(PS_QUEUE_POP(&q, item_t, node), &b);
    CU_ASSERT_PTR_EQUAL(PS_QUEUE_POP(&q, item_t, node), &c);
    CU_ASSERT_TRUE(ps_queue_empty(&q));
    CU_ASSERT_EQUAL(q.len, 0);
    CU_ASSERT_PTR_NULL(q.tail);
    /* An item popped may go back in: its link was cleared. */
    ps_queue_push(&q, &a.node);
    CU_ASSERT_PTR_EQUAL(PS_QUEUE_POP(&q, item_t, node), &a);
    CU_ASSERT_PTR_NULL(a.node.next);
}

static void test_fifo_random_against_model(void)
{
    enum { N = 512, STEPS = 20000 };
    item_t *items = calloc(N, sizeof(*items));
    int model[N]; /* indices of queued items, FIFO in model[head..tail) mod N */
    size_t head = 0, len = 0;
    int free_list[N], nfree = N;
    for (int i = 0; i < N; i++) {
        items[i].payload = i;
        free_list[i] = N - 1 - i;
    }
    ps_queue_t q = PS_QUEUE_INIT;
    unsigned seed = 12345;
    int ok = 1;
    for (int s = 0; s < STEPS && ok; s++) {
        bool push = nfree > 0 && (len == 0 || rand_r(&seed) % 3 != 0);
        if (push) {
            int i = free_list[--nfree];
            ps_queue_push(&q, &items[i].node);
            model[(head + len) % N] = i;
            len++;
        } else {
            item_t *it = PS_QUEUE_POP(&q, item_t, node);
            ok &= it != NULL && it->payload == model[head];
            if (it)
                free_list[nfree++] = it->payload;
            head = (head + 1) % N;
            len--;
        }
        ok &= q.len == len && ps_queue_empty(&q) == (len == 0);
    }
    CU_ASSERT_TRUE(ok);
    free(items);
}

enum { PRODUCERS = 3, TAKERS = 4, PER_PRODUCER = 20000 };

typedef struct {
    int producer, seq;
    ps_qnode_t node;
} work_t;

typedef struct {
    ps_workq_t *wq;
    int producer;
    work_t *items;
} producer_arg_t;

typedef struct {
    ps_workq_t *wq;
    int taken;
    int in_order; /* each producer's items came to this taker in increasing order */
    int last_seq[PRODUCERS];
    int *seen; /* shared: how often each item was taken (atomic adds) */
} taker_arg_t;

static void *producer_main(void *p)
{
    producer_arg_t *a = p;
    for (int i = 0; i < PER_PRODUCER; i++) {
        a->items[i].producer = a->producer;
        a->items[i].seq = i;
        ps_workq_push(a->wq, &a->items[i].node);
    }
    return NULL;
}

static void *taker_main(void *p)
{
    taker_arg_t *a = p;
    ps_qnode_t *n;
    for (int i = 0; i < PRODUCERS; i++)
        a->last_seq[i] = -1;
    a->in_order = 1;
    while ((n = ps_workq_take(a->wq)) != NULL) {
        work_t *w = PS_CONTAINER_OF(n, work_t, node);
        a->in_order &= w->seq > a->last_seq[w->producer];
        a->last_seq[w->producer] = w->seq;
        __atomic_fetch_add(&a->seen[w->producer * PER_PRODUCER + w->seq], 1, __ATOMIC_RELAXED);
        a->taken++;
    }
    return NULL;
}

static void test_workq_threads(void)
{
    ps_workq_t wq;
    ps_workq_init(&wq);
    int *seen = calloc(PRODUCERS * PER_PRODUCER, sizeof(int));
    work_t *items = calloc(PRODUCERS * PER_PRODUCER, sizeof(work_t));
    CU_ASSERT_PTR_NOT_NULL_FATAL(seen);
    CU_ASSERT_PTR_NOT_NULL_FATAL(items);
    pthread_t takers[TAKERS], producers[PRODUCERS];
    taker_arg_t targ[TAKERS];
    producer_arg_t parg[PRODUCERS];
    for (int t = 0; t < TAKERS; t++) {
        targ[t] = (taker_arg_t){.wq = &wq, .seen = seen};
        pthread_create(&takers[t], NULL, taker_main, &targ[t]);
    }
    for (int p = 0; p < PRODUCERS; p++) {
        parg[p] = (producer_arg_t){&wq, p, items + p * PER_PRODUCER};
        pthread_create(&producers[p], NULL, producer_main, &parg[p]);
    }
    for (int p = 0; p < PRODUCERS; p++)
        pthread_join(producers[p], NULL);
    ps_workq_close(&wq);
    int taken = 0, in_order = 1;
    for (int t = 0; t < TAKERS; t++) {
        pthread_join(takers[t], NULL);
        taken += targ[t].taken;
        in_order &= targ[t].in_order;
    }
    CU_ASSERT_EQUAL(taken, PRODUCERS * PER_PRODUCER);
    CU_ASSERT_TRUE(in_order);
    int once = 1;
    for (int i = 0; i < PRODUCERS * PER_PRODUCER; i++)
        once &= seen[i] == 1;
    CU_ASSERT_TRUE(once);
    CU_ASSERT_TRUE(ps_queue_empty(&wq.q));
    /* Closed and empty: a taker returns at once. */
    CU_ASSERT_PTR_NULL(ps_workq_take(&wq));
    ps_workq_destroy(&wq);
    free(seen);
    free(items);
}

static void test_workq_drains_after_close(void)
{
    ps_workq_t wq;
    ps_workq_init(&wq);
    item_t a = {1, {NULL}}, b = {2, {NULL}};
    ps_workq_push(&wq, &a.node);
    ps_workq_close(&wq);
    ps_workq_push(&wq, &b.node);
    CU_ASSERT_PTR_EQUAL(ps_workq_take(&wq), &a.node);
    CU_ASSERT_PTR_EQUAL(ps_workq_take(&wq), &b.node);
    CU_ASSERT_PTR_NULL(ps_workq_take(&wq));
    ps_workq_destroy(&wq);
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"fifo: order, length, peek, reuse", test_fifo_basics},
        {"fifo: 20,000 random pushes and pops against a model", test_fifo_random_against_model},
        {"workq: 3 producers, 4 takers, each item once, in order per producer", test_workq_threads},
        {"workq: what is queued is still taken after close", test_workq_drains_after_close},
        {NULL, NULL},
    };
    return ps_test_main("queue", cases);
}
