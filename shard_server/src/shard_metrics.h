/* The shard server's own statistics (per-operation counters, bytes and latency histograms,
 * updated with atomics where each operation completes), its /metrics families, and the health
 * rule that says whether it can serve trainers now (shard_metrics.c). None of it takes op_mu:
 * Status, health and scrapes never wait behind a trainer operation. */
#ifndef PSHARD_SHARD_METRICS_H
#define PSHARD_SHARD_METRICS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "pshard/metrics.h"

/* The trainer operations the statistics tell apart (the "op" label). */
typedef enum {
    SHARD_OPK_GATHER = 0,
    SHARD_OPK_REDUCE_SCATTER,
    SHARD_OPK_STEP,
    SHARD_OPK_CLIP_GRAD_NORM,
    SHARD_OPK_ALL_GATHER,
    SHARD_OPK_ALL_REDUCE,
    SHARD_OPK_BROADCAST,
    SHARD_OPK_BARRIER,
    SHARD_OPK_REDUCE, /* plain collectives to and from a root */
    SHARD_OPK_GATHER_TO_ROOT,
    SHARD_OPK_SCATTER,
    SHARD_OPK_ALL_TO_ALL,
    SHARD_OPK_COUNT
} shard_opk_t;

typedef struct {
    atomic_uint_least64_t ops;    /* completed, successfully or not */
    atomic_uint_least64_t errors; /* of those, failed */
    atomic_uint_least64_t bytes;  /* tensor bytes moved (full size: what the trainer sees) */
    atomic_uint_least64_t sum_ns; /* total duration */
    atomic_uint_least64_t buckets[PS_METRICS_LATENCY_BUCKETS + 1];
} shard_op_stats_t;

/* How long a call may wait for a worker before the server counts as unable to serve (every
 * worker is busy, or it would not wait at all). */
#define SHARD_SATURATED_NS (1000 * 1000000LL)

struct pshard_shard_server;

/* Records one operation of kind op that started at start_ns (ps_now_ns) and has just ended,
 * moving bytes, ok or not. Lock-free; any thread. */
void shard_stats_record(struct pshard_shard_server *s, shard_opk_t op, int64_t start_ns,
                        uint64_t bytes, bool ok);

/* The op kind of a plain collective (pshard_coll_op_t value). */
shard_opk_t shard_opk_of_coll(uint32_t coll_op);

/* Evaluates the health rule (README, "Health") and sets "pshard.ShardServer" SERVING or
 * NOT_SERVING when it changed, logging the reason of each change. Thread-safe; takes s->mu
 * briefly, never op_mu. */
void shard_health_update(struct pshard_shard_server *s);

/* Thread body: shard_health_update every 100 ms until s->stop. */
void *shard_monitor_main(void *arg);

/* ps_metrics_collect_fn for the shard server (arg is the server). */
void shard_metrics_collect(void *arg, ps_metrics_t *w);

#endif
