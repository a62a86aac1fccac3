/* The coordinator's /metrics: the families (coord_metrics.c) and the one entry point into the
 * service that they read (coord_service.c, at its end): a consistent snapshot of membership,
 * generation, join table and store sizes, taken under the service's mutex. */
#ifndef PSHARD_COORD_METRICS_H
#define PSHARD_COORD_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "coord_state.h"
#include "pshard/coordinator.h"
#include "pshard/metrics.h"
#include "pshard/rpc.h"

/* One job's part of the view. */
typedef struct {
    char job[72];
    const coord_snapshot_t *snap; /* NULL when out of memory */
    size_t store_keys, store_waiters;
} coord_metrics_job_t;

/* What coord_service_metrics_view hands its callback: all valid only during the call. */
typedef struct {
    const coord_metrics_job_t *jobs; /* every job, the default one first */
    size_t njobs;
    int64_t now_ns, started_ns; /* ps_now_ns clock */
    int64_t lease_ms;
    double straggler_ratio;   /* --straggler-ratio */
    uint32_t straggler_steps; /* --straggler-steps */
    ps_rpc_server_t *srv;     /* for the per-method counters */
} coord_metrics_view_t;

/* Takes every job's snapshot under the service's mutex (briefly), then calls fn(arg, view)
 * without it. Thread-safe (the metrics thread calls it). */
void coord_service_metrics_view(pshard_coordinator_t *c,
                                void (*fn)(void *arg, const coord_metrics_view_t *view), void *arg);

/* Starts the coordinator's metrics listener on listen (see ps_metrics_server_start); stop it
 * with ps_metrics_server_stop before pshard_coordinator_stop. NULL with a message in err. */
ps_metrics_server_t *coord_metrics_start(pshard_coordinator_t *c, const char *listen, char *err,
                                         size_t errlen);

#endif
