/* "Who is slow": which rank's trainer computes longest per step, from the step figures the
 * shard servers send with their heartbeats (coord_straggler.c). Pure functions over the
 * members, no I/O and no locks; the service calls them under its mutex. */
#ifndef PSHARD_COORD_STRAGGLER_H
#define PSHARD_COORD_STRAGGLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "coord_state.h"
#include "pshard/status.h"

#define COORD_STEP_WINDOW 50           /* the servers' window: the most steps a median is over */
#define COORD_STEP_SECONDS_MAX 86400.0 /* a figure over a day is refused as nonsense */

/* The slowest rank of a job. */
typedef struct {
    int rank; /* -1 when fewer than two ranks have figures over enough steps */
    char name[COORD_NAME_MAX + 1];
    double ratio;     /* its median compute time over the median of the ranks' medians */
    double compute_s; /* its median compute time */
    double median_s;  /* the median of the ranks' medians */
    uint32_t window;  /* steps its median is over */
    uint64_t steps;   /* steps its server measured since it started */
    uint32_t ranks;   /* ranks compared */
    bool slow;        /* ratio >= the threshold */
} coord_straggler_t;

/* PSHARD_OK when untrusted step figures are sane, else INVALID_ARGUMENT naming the field: a
 * window over COORD_STEP_WINDOW, or a time that is not finite, negative or over
 * COORD_STEP_SECONDS_MAX. */
pshard_status_t coord_steps_check(const coord_steps_t *s, char *err, size_t errlen);

/* Finds the slowest of members[0..n) (unordered): among the ranked shard servers whose
 * figures are over at least min_window steps, the one with the highest median compute time
 * (the lower rank on a tie), compared with the median of all their medians (a median below 1
 * microsecond counts as 1 microsecond, so that the ratio stays finite). slow when the ratio
 * is at least threshold. Needs two such ranks; else out->rank is -1. Errors: none (out of
 * memory gives rank -1). */
void coord_straggler_find(const coord_member_t *members, size_t n, double threshold,
                          uint32_t min_window, coord_straggler_t *out);

/* What the log has said of a job's slowest rank, so that a rank that stays slow is logged
 * once, and again only after it recovered. */
typedef struct {
    int rank;             /* the rank slow since since_steps, or -1 */
    uint64_t since_steps; /* its server's step count when it was first seen slow */
    bool logged;          /* its slowness was logged */
} coord_straggler_watch_t;

typedef enum {
    COORD_STRAGGLER_QUIET = 0,     /* nothing to log */
    COORD_STRAGGLER_SLOW = 1,      /* a rank stayed slow for min_steps steps: msg says it */
    COORD_STRAGGLER_RECOVERED = 2, /* the rank logged slow is not any more: msg says it */
} coord_straggler_event_t;

void coord_straggler_watch_init(coord_straggler_watch_t *w);

/* Follows the newest finding cur: a rank that is slow in every finding while its server
 * measures min_steps more steps is reported once (SLOW); once it is not the slow rank any
 * more, RECOVERED (if it was reported). msg gets the line to log. */
coord_straggler_event_t coord_straggler_watch_update(coord_straggler_watch_t *w,
                                                     const coord_straggler_t *cur,
                                                     uint32_t min_steps, double threshold,
                                                     char *msg, size_t msglen);

/* "rank 3 (shard-3) is 1.80x the median step compute over the last 50 steps (0.210 s against
 * 0.117 s)" into buf. */
void coord_straggler_format(const coord_straggler_t *s, char *buf, size_t len);

#endif
