/* Prometheus metrics for pshard's services: a writer of the text exposition format 0.0.4
 * (counter, gauge and histogram families with HELP and TYPE lines, validated names, escaped
 * label values), and a small HTTP server on libevent's evhttp that answers GET/HEAD /metrics
 * from its own thread by asking the service to write its families. */
#ifndef PSHARD_METRICS_H
#define PSHARD_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pshard/rpc.h"
#include "pshard/status.h"

/* ------------------------------------------------------------------------------------------ */
/* Writer                                                                                      */

typedef struct ps_metrics ps_metrics_t;

typedef enum {
    PS_METRIC_COUNTER = 1, /* name must end in "_total" */
    PS_METRIC_GAUGE = 2,
    PS_METRIC_HISTOGRAM = 3, /* samples name_bucket{le=...}, name_sum, name_count */
} ps_metric_type_t;

/* The latency buckets (seconds) pshard's histograms use, from 100 us to 10 minutes (a
 * collective's default timeout). PS_METRICS_LATENCY_BUCKETS bounds; counts arrays of a
 * histogram over them have one more entry, for +Inf. */
#define PS_METRICS_LATENCY_BUCKETS 18
extern const double ps_metrics_latency_bounds[PS_METRICS_LATENCY_BUCKETS];

/* The index of the first bound >= seconds among bounds[0..n), or n (the +Inf bucket). */
size_t ps_metrics_bucket_index(const double *bounds, size_t n, double seconds);

/* An empty exposition. NULL when out of memory. Free with ps_metrics_destroy. Not
 * thread-safe: one thread writes one exposition. */
ps_metrics_t *ps_metrics_create(void);
void ps_metrics_destroy(ps_metrics_t *w); /* NULL is a no-op */

/* Starts a family: "# HELP name help" (help escaped) and "# TYPE name type". Errors (kept in
 * the writer, first one wins, see ps_metrics_error): a name outside [a-zA-Z_:][a-zA-Z0-9_:]*,
 * a counter not ending in "_total", a family written twice. A refused family writes nothing,
 * and neither do its samples. */
void ps_metrics_family(ps_metrics_t *w, const char *name, ps_metric_type_t type, const char *help);

/* One sample of the current counter or gauge family. labels: NULL, or name/value string pairs
 * ending with a NULL name ({"op", "gather", NULL}); label names must match
 * [a-zA-Z_][a-zA-Z0-9_]* and not start with "__" (and not be "le" in a histogram); values are
 * escaped (backslash, double quote, newline). Non-finite values print as NaN, +Inf, -Inf. */
void ps_metrics_sample(ps_metrics_t *w, const char *const *labels, double value);
void ps_metrics_sample_u64(ps_metrics_t *w, const char *const *labels, uint64_t value);

/* One histogram of the current histogram family: bounds[0..n) strictly increasing finite
 * upper bounds, counts[0..n] the observations per bucket (not cumulative; counts[n] those
 * above the last bound), sum the sum of the observations. Writes the cumulative
 * name_bucket{...,le="B"} lines, le="+Inf", name_sum and name_count. */
void ps_metrics_histogram(ps_metrics_t *w, const char *const *labels, const double *bounds,
                          const uint64_t *counts, size_t n, double sum);

/* What was written (NUL-terminated; *len may be NULL) and the first error ("" when none).
 * Both valid until the next call on w. */
const char *ps_metrics_text(const ps_metrics_t *w, size_t *len);
const char *ps_metrics_error(const ps_metrics_t *w);

/* Whether name is a valid metric name / label name (exported for tests). */
bool ps_metrics_name_ok(const char *name);
bool ps_metrics_label_name_ok(const char *name);

/* The process families every service exposes: pshard_process_resident_memory_bytes and
 * pshard_process_open_fds (from /proc/self), pshard_process_uptime_seconds since started_ns
 * (ps_now_ns clock). */
void ps_metrics_process(ps_metrics_t *w, int64_t started_ns);

/* The gRPC server's families: pshard_rpc_calls_total and pshard_rpc_errors_total by service
 * and method (the server's own per-method counters, the ones Status shows), and its worker
 * pool (pshard_rpc_workers, pshard_rpc_workers_busy, pshard_rpc_queued_calls,
 * pshard_rpc_queue_wait_seconds: how long the oldest queued call has waited). Thread-safe. */
void ps_metrics_rpc(ps_metrics_t *w, ps_rpc_server_t *srv);

/* ------------------------------------------------------------------------------------------ */
/* HTTP server                                                                                 */

typedef struct ps_metrics_server ps_metrics_server_t;

/* Writes the service's families into w. Runs on the metrics server's thread, once per scrape,
 * while the service keeps running: it must be thread-safe with respect to the service and
 * never wait behind the service's operations (read atomics or a short lock). */
typedef void (*ps_metrics_collect_fn)(void *arg, ps_metrics_t *w);

/* Binds listen ("HOST:PORT", "[V6]:PORT"; port 0 picks a free one) and serves, from a thread of
 * its own with its own event_base: GET and HEAD /metrics answer 200 with what collect wrote
 * (text/plain; version=0.0.4), other paths 404, other methods 405; requests are limited to 8
 * KiB of headers and 1 KiB of body and 10 s. A collect that reports an error answers 500 with
 * the error. Errors: NULL with a message in err (bad address, port in use). Stop with
 * ps_metrics_server_stop. Not thread-safe. */
ps_metrics_server_t *ps_metrics_server_start(const char *listen, ps_metrics_collect_fn collect,
                                             void *arg, char *err, size_t errlen);

/* The bound port. Thread-safe. */
int ps_metrics_server_port(const ps_metrics_server_t *m);

/* Stops the thread (after the scrape in progress, if any), closes the socket, frees. NULL is a
 * no-op. Not from the collect callback. */
void ps_metrics_server_stop(ps_metrics_server_t *m);

/* What a daemon does once its metrics listener is bound, as ps_announce_listening does for its
 * gRPC port: writes port to port_file (if non-NULL, atomically) and prints
 * "metrics on http://HOST:PORT/metrics" to stdout. Returns 0, or -1 with a message on stderr. */
int ps_announce_metrics(const char *prog, const char *listen, int port, const char *port_file);

#endif
