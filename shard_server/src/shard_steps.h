/* Per-step timing of this rank's trainer, for "who is slow" (straggler attribution): step time,
 * compute time and wait time of each step, kept as /metrics histograms and as a window of the
 * last SHARD_STEP_WINDOW steps whose medians the server sends with its heartbeats, so that the
 * coordinator can compare the ranks (shard_steps.c). Pure logic with an injected clock; its
 * own mutex, never op_mu.
 *
 * Definitions (README, "Who is slow"):
 * - a step boundary is the end of a successful Step (the shard servers' optimizer, or
 *   pshard_step_trainer after a trainer's own torch.optim optimizer; a Step that only sets the
 *   step count is none), or a mark the trainer sends itself (MarkStep: pshard.report_step,
 *   which a trainer without Steps, e.g. DDP on the "pshard" backend, calls). Once a session's
 *   trainer marked a step, only its marks are boundaries, so a trainer calling both counts
 *   each step once. The first boundary of a session only starts the clock;
 * - step time: the wall time between two consecutive boundaries;
 * - wait time: the part of it during which at least one call of the trainer was inside this
 *   server (its collectives, the agreement rounds, the copies, and the wait for op_mu): the
 *   time the trainer waited on pshard. It is not split by peer: a ring collective blocks on its
 *   neighbour whoever is late upstream, so a per-peer figure would name the wrong rank;
 * - compute time: step time less wait time (the trainer's own forward, backward and data
 *   loading, plus the RPC transit, which the server cannot see). */
#ifndef PSHARD_SHARD_STEPS_H
#define PSHARD_SHARD_STEPS_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "pshard/metrics.h"

#define SHARD_STEP_WINDOW 50

/* The three figures of a step, in the order of their histograms. */
enum { SHARD_STEP_TIME = 0, SHARD_STEP_COMPUTE, SHARD_STEP_WAIT, SHARD_STEP_NFIG };

typedef struct {
    pthread_mutex_t mu;
    int inflight;          /* trainer calls inside the server now */
    int64_t busy_since_ns; /* when inflight last went from 0 to 1 */
    int64_t busy_ns;       /* wait time of the current step before busy_since_ns */
    int64_t step_start_ns; /* the last boundary; 0: none yet in this session */
    double window[SHARD_STEP_NFIG][SHARD_STEP_WINDOW]; /* the newest steps, a ring */
    uint32_t nwindow, next;
    uint64_t steps; /* steps measured since the server started */
    uint64_t hist[SHARD_STEP_NFIG][PS_METRICS_LATENCY_BUCKETS + 1];
    double sum[SHARD_STEP_NFIG];
    uint64_t tokens, samples; /* what trainers reported with their steps */
    bool marked;              /* this session's trainer marks its steps itself */
} shard_steps_t;

/* What a heartbeat carries: the medians over the window, which holds window steps (0: nothing
 * measured yet), and every step measured. */
typedef struct {
    uint32_t window;
    uint64_t steps;
    double step_s, compute_s, wait_s;
} shard_step_summary_t;

void shard_steps_init(shard_steps_t *st);
void shard_steps_destroy(shard_steps_t *st);

/* A trainer call entered (begin) or left (end) the server at now_ns. Thread-safe. */
void shard_steps_op_begin(shard_steps_t *st, int64_t now_ns);
void shard_steps_op_end(shard_steps_t *st, int64_t now_ns);

/* A new trainer session: its first boundary starts the clock again and the window restarts
 * (the histograms and totals stay: they count since the server started). Thread-safe. */
void shard_steps_reset(shard_steps_t *st);

/* A step boundary at now_ns, from a Step (mark false) or the trainer's MarkStep (mark true; a
 * Step is none once the session marked one): records the step that ends here (unless it is
 * the session's first boundary) and adds the tokens and samples the trainer reported for it.
 * Thread-safe. */
void shard_steps_boundary(shard_steps_t *st, int64_t now_ns, bool mark, uint64_t tokens,
                          uint64_t samples);

/* The window's medians into *out. Returns whether the window holds any step. Thread-safe. */
bool shard_steps_summary(shard_steps_t *st, shard_step_summary_t *out);

/* The families pshard_step_seconds, pshard_step_compute_seconds, pshard_step_wait_seconds
 * (histograms), pshard_step_tokens_total and pshard_step_samples_total (counters), and the
 * window's medians as gauges. Thread-safe; holds st's mutex only to copy. */
void shard_steps_metrics(shard_steps_t *st, ps_metrics_t *w);

#endif
