/* The pshard coordinator service: membership with leases, rendezvous, the key/value store,
 * Watch and status, served over gRPC. pshard-coordinator's main() is a thin wrapper around
 * this, so tests and tools can run a coordinator in-process too. */
#ifndef PSHARD_COORDINATOR_H
#define PSHARD_COORDINATOR_H

#include <stddef.h>
#include <stdint.h>

#include "pshard/status.h"

typedef struct pshard_coordinator pshard_coordinator_t;

typedef struct {
    const char *listen;        /* "HOST:PORT"; port 0 picks a free port */
    const char *token;         /* cluster token, or NULL for none */
    const char *tls_cert_file; /* server certificate (TLS) or NULL */
    const char *tls_key_file;
    const char *tls_client_ca_file; /* require client certificates signed by this CA (mTLS) */
    int min_nodes, max_nodes;       /* rendezvous size: fixed N is min == max == N */
    int64_t last_call_ms;           /* wait for more shard servers after min registered */
    int64_t lease_ms, heartbeat_ms;
    int64_t max_message_bytes;
    int64_t store_wait_default_ms; /* StoreWait with timeout 0 waits this long */
    int64_t job_linger_ms;         /* an unused job other than "default" ends after this
                                      (<= 0: 300000) */
    int worker_threads;
    /* "Who is slow": a rank whose median step compute time is at least straggler_ratio times
     * the median of the ranks' medians is the slow one (<= 1 or not finite: 1.5), and is
     * logged once it stayed so for straggler_steps steps (<= 0: 10); only figures over at
     * least straggler_steps steps are compared. */
    double straggler_ratio;
    int64_t straggler_steps;
} pshard_coordinator_config_t;

/* Starts serving (threads of its own). NULL with a message in err on a bad config or when the
 * address cannot be bound. Stop with pshard_coordinator_stop. Not thread-safe. */
pshard_coordinator_t *pshard_coordinator_start(const pshard_coordinator_config_t *cfg, char *err,
                                               size_t errlen);

/* The bound port. Thread-safe. */
int pshard_coordinator_port(const pshard_coordinator_t *c);

/* Graceful stop: health NOT_SERVING, open Watch streams and store waits finished, calls
 * drained, threads joined, memory freed. NULL is a no-op. Not from a handler. */
void pshard_coordinator_stop(pshard_coordinator_t *c);

#endif
