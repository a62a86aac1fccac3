/* The Prometheus text exposition format 0.0.4 writer (families, samples, histograms, with the
 * format's name rules and escaping) and the process and gRPC families every service shares.
 * The HTTP side is in metrics_http.c. */
#include <dirent.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pshard/metrics.h"
#include "pshard/util.h"

const double ps_metrics_latency_bounds[PS_METRICS_LATENCY_BUCKETS] = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1,    0.25,    0.5,    1.0,   2.5,    5.0,   10.0, 60.0,  600.0,
};

#define FAMILY_NAME_MAX 200

struct ps_metrics {
    char *buf;
    size_t len, cap;
    bool oom;
    char error[PSHARD_ERRLEN];
    /* The current family; cur_ok false means its samples are dropped. */
    char cur[FAMILY_NAME_MAX + 1];
    ps_metric_type_t cur_type;
    bool cur_ok;
    /* Names of the families written so far, to refuse a second one of a name. */
    char **names;
    size_t nnames, cap_names;
};

size_t ps_metrics_bucket_index(const double *bounds, size_t n, double seconds)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (bounds[mid] >= seconds)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

ps_metrics_t *ps_metrics_create(void)
{
    ps_metrics_t *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    w->cap = 4096;
    w->buf = malloc(w->cap);
    if (!w->buf) {
        free(w);
        return NULL;
    }
    w->buf[0] = '\0';
    return w;
}

void ps_metrics_destroy(ps_metrics_t *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->nnames; i++)
        free(w->names[i]);
    free(w->names);
    free(w->buf);
    free(w);
}

static void set_error(ps_metrics_t *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_error(ps_metrics_t *w, const char *fmt, ...)
{
    if (w->error[0])
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->error, sizeof(w->error), fmt, ap);
    va_end(ap);
}

static bool reserve(ps_metrics_t *w, size_t more)
{
    if (w->oom)
        return false;
    if (w->len + more + 1 <= w->cap)
        return true;
    size_t cap = w->cap;
    while (w->len + more + 1 > cap)
        cap *= 2;
    char *p = realloc(w->buf, cap);
    if (!p) {
        w->oom = true;
        set_error(w, "out of memory writing metrics");
        return false;
    }
    w->buf = p;
    w->cap = cap;
    return true;
}

static void put(ps_metrics_t *w, const char *s, size_t n)
{
    if (!reserve(w, n))
        return;
    memcpy(w->buf + w->len, s, n);
    w->len += n;
    w->buf[w->len] = '\0';
}

static void puts_(ps_metrics_t *w, const char *s)
{
    put(w, s, strlen(s));
}

/* Writes s with backslash and newline escaped, and double quotes too when quote is set (label
 * values; HELP text escapes only the first two). */
static void put_escaped(ps_metrics_t *w, const char *s, bool quote)
{
    for (const char *p = s; *p; p++) {
        if (*p == '\\')
            put(w, "\\\\", 2);
        else if (*p == '\n')
            put(w, "\\n", 2);
        else if (*p == '"' && quote)
            put(w, "\\\"", 2);
        else
            put(w, p, 1);
    }
}

static bool name_char(char c, bool first, bool colon)
{
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_')
        return true;
    if (c == ':' && colon)
        return true;
    return !first && c >= '0' && c <= '9';
}

bool ps_metrics_name_ok(const char *name)
{
    if (!name || !*name || strlen(name) > FAMILY_NAME_MAX)
        return false;
    for (size_t i = 0; name[i]; i++)
        if (!name_char(name[i], i == 0, true))
            return false;
    return true;
}

bool ps_metrics_label_name_ok(const char *name)
{
    if (!name || !*name || strncmp(name, "__", 2) == 0)
        return false;
    for (size_t i = 0; name[i]; i++)
        if (!name_char(name[i], i == 0, false))
            return false;
    return true;
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

void ps_metrics_family(ps_metrics_t *w, const char *name, ps_metric_type_t type, const char *help)
{
    w->cur_ok = false;
    if (!ps_metrics_name_ok(name)) {
        set_error(w, "invalid metric name '%.100s'", name ? name : "");
        return;
    }
    if (type == PS_METRIC_COUNTER && !ends_with(name, "_total")) {
        set_error(w, "counter '%s' does not end in _total", name);
        return;
    }
    if (type != PS_METRIC_COUNTER && type != PS_METRIC_GAUGE && type != PS_METRIC_HISTOGRAM) {
        set_error(w, "metric '%s' has an unknown type %d", name, (int)type);
        return;
    }
    for (size_t i = 0; i < w->nnames; i++) {
        if (strcmp(w->names[i], name) == 0) {
            set_error(w, "metric family '%s' written twice", name);
            return;
        }
    }
    if (w->nnames == w->cap_names) {
        size_t cap = w->cap_names ? w->cap_names * 2 : 32;
        char **p = realloc(w->names, cap * sizeof(*p));
        if (!p) {
            set_error(w, "out of memory writing metrics");
            return;
        }
        w->names = p;
        w->cap_names = cap;
    }
    if (!(w->names[w->nnames] = strdup(name))) {
        set_error(w, "out of memory writing metrics");
        return;
    }
    w->nnames++;
    ps_strlcpy(w->cur, name, sizeof(w->cur));
    w->cur_type = type;
    w->cur_ok = true;
    puts_(w, "# HELP ");
    puts_(w, name);
    puts_(w, " ");
    put_escaped(w, help ? help : "", false);
    puts_(w, "\n# TYPE ");
    puts_(w, name);
    puts_(w, type == PS_METRIC_COUNTER ? " counter\n"
             : type == PS_METRIC_GAUGE ? " gauge\n"
                                       : " histogram\n");
}

static bool labels_ok(ps_metrics_t *w, const char *const *labels)
{
    for (size_t i = 0; labels && labels[i]; i += 2) {
        if (!ps_metrics_label_name_ok(labels[i]) ||
            (w->cur_type == PS_METRIC_HISTOGRAM && strcmp(labels[i], "le") == 0)) {
            set_error(w, "metric '%s': invalid label name '%.100s'", w->cur, labels[i]);
            return false;
        }
        if (!labels[i + 1]) {
            set_error(w, "metric '%s': label '%s' has no value", w->cur, labels[i]);
            return false;
        }
    }
    return true;
}

/* name{labels[,le="..."]} without the value. */
static void put_series(ps_metrics_t *w, const char *suffix, const char *const *labels,
                       const char *le)
{
    puts_(w, w->cur);
    puts_(w, suffix);
    if ((!labels || !labels[0]) && !le)
        return;
    puts_(w, "{");
    bool first = true;
    for (size_t i = 0; labels && labels[i]; i += 2) {
        if (!first)
            puts_(w, ",");
        first = false;
        puts_(w, labels[i]);
        puts_(w, "=\"");
        put_escaped(w, labels[i + 1], true);
        puts_(w, "\"");
    }
    if (le) {
        if (!first)
            puts_(w, ",");
        puts_(w, "le=\"");
        puts_(w, le);
        puts_(w, "\"");
    }
    puts_(w, "}");
}

/* A double as the format spells it: the shortest of %.15g / %.17g that reads back exactly. */
static void format_double(double v, char *buf, size_t len)
{
    if (isnan(v)) {
        ps_strlcpy(buf, "NaN", len);
    } else if (isinf(v)) {
        ps_strlcpy(buf, v > 0 ? "+Inf" : "-Inf", len);
    } else {
        snprintf(buf, len, "%.15g", v);
        if (strtod(buf, NULL) != v)
            snprintf(buf, len, "%.17g", v);
    }
}

static bool sample_ok(ps_metrics_t *w, const char *const *labels)
{
    if (!w->cur_ok)
        return false;
    if (w->cur_type == PS_METRIC_HISTOGRAM) {
        set_error(w, "metric '%s' is a histogram: use ps_metrics_histogram", w->cur);
        return false;
    }
    return labels_ok(w, labels);
}

void ps_metrics_sample(ps_metrics_t *w, const char *const *labels, double value)
{
    if (!sample_ok(w, labels))
        return;
    char v[40];
    format_double(value, v, sizeof(v));
    put_series(w, "", labels, NULL);
    puts_(w, " ");
    puts_(w, v);
    puts_(w, "\n");
}

void ps_metrics_sample_u64(ps_metrics_t *w, const char *const *labels, uint64_t value)
{
    if (!sample_ok(w, labels))
        return;
    char v[32];
    snprintf(v, sizeof(v), "%llu", (unsigned long long)value);
    put_series(w, "", labels, NULL);
    puts_(w, " ");
    puts_(w, v);
    puts_(w, "\n");
}

void ps_metrics_histogram(ps_metrics_t *w, const char *const *labels, const double *bounds,
                          const uint64_t *counts, size_t n, double sum)
{
    if (!w->cur_ok)
        return;
    if (w->cur_type != PS_METRIC_HISTOGRAM) {
        set_error(w, "metric '%s' is not a histogram", w->cur);
        return;
    }
    if (!labels_ok(w, labels))
        return;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
            set_error(w, "histogram '%s': bounds must be finite and increasing", w->cur);
            return;
        }
    }
    uint64_t cum = 0;
    char le[40], v[40];
    for (size_t i = 0; i <= n; i++) {
        cum += counts[i];
        if (i < n)
            format_double(bounds[i], le, sizeof(le));
        else
            ps_strlcpy(le, "+Inf", sizeof(le));
        put_series(w, "_bucket", labels, le);
        snprintf(v, sizeof(v), " %llu\n", (unsigned long long)cum);
        puts_(w, v);
    }
    format_double(sum, v, sizeof(v));
    put_series(w, "_sum", labels, NULL);
    puts_(w, " ");
    puts_(w, v);
    puts_(w, "\n");
    put_series(w, "_count", labels, NULL);
    snprintf(v, sizeof(v), " %llu\n", (unsigned long long)cum);
    puts_(w, v);
}

const char *ps_metrics_text(const ps_metrics_t *w, size_t *len)
{
    if (len)
        *len = w->len;
    return w->buf;
}

const char *ps_metrics_error(const ps_metrics_t *w)
{
    return w->error;
}

/* ---------------------------------------------------------------------------------------- */
/* Families every service exposes                                                            */

/* Resident set size in bytes from /proc/self/statm (its second field, in pages); -1. */
static double resident_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "re");
    if (!f)
        return -1;
    unsigned long long size = 0, resident = 0;
    int n = fscanf(f, "%llu %llu", &size, &resident);
    fclose(f);
    long page = sysconf(_SC_PAGESIZE);
    return n == 2 && page > 0 ? (double)resident * (double)page : -1;
}

/* Open file descriptors: the entries of /proc/self/fd, less the one reading it; -1. */
static double open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    double n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] != '.')
            n++;
    }
    closedir(d);
    return n > 0 ? n - 1 : 0;
}

void ps_metrics_process(ps_metrics_t *w, int64_t started_ns)
{
    double rss = resident_bytes(), fds = open_fds();
    if (rss >= 0) {
        ps_metrics_family(w, "pshard_process_resident_memory_bytes", PS_METRIC_GAUGE,
                          "Resident memory of this process in bytes.");
        ps_metrics_sample(w, NULL, rss);
    }
    if (fds >= 0) {
        ps_metrics_family(w, "pshard_process_open_fds", PS_METRIC_GAUGE,
                          "Open file descriptors of this process.");
        ps_metrics_sample(w, NULL, fds);
    }
    ps_metrics_family(w, "pshard_process_uptime_seconds", PS_METRIC_GAUGE,
                      "Seconds since this service started.");
    ps_metrics_sample(w, NULL, (double)(ps_now_ns() - started_ns) / 1e9);
}

typedef struct {
    ps_metrics_t *w;
    bool errors; /* this pass writes the errors, else the calls */
} rpc_pass_t;

static void rpc_counter(void *arg, const char *path, uint64_t calls, uint64_t errors)
{
    rpc_pass_t *p = arg;
    /* "/pkg.Service/Method" into service and method labels. */
    char service[128] = "", method[128] = "";
    const char *s = path[0] == '/' ? path + 1 : path;
    const char *slash = strchr(s, '/');
    if (slash) {
        snprintf(service, sizeof(service), "%.*s", (int)(slash - s), s);
        ps_strlcpy(method, slash + 1, sizeof(method));
    } else {
        ps_strlcpy(method, s, sizeof(method));
    }
    const char *labels[] = {"service", service, "method", method, NULL};
    ps_metrics_sample_u64(p->w, labels, p->errors ? errors : calls);
}

void ps_metrics_rpc(ps_metrics_t *w, ps_rpc_server_t *srv)
{
    rpc_pass_t p = {w, false};
    ps_metrics_family(w, "pshard_rpc_calls_total", PS_METRIC_COUNTER,
                      "gRPC calls received, by service and method.");
    ps_rpc_server_counters(srv, rpc_counter, &p);
    p.errors = true;
    ps_metrics_family(w, "pshard_rpc_errors_total", PS_METRIC_COUNTER,
                      "gRPC calls that ended with a status other than OK, by service and method.");
    ps_rpc_server_counters(srv, rpc_counter, &p);
    ps_rpc_load_t load;
    ps_rpc_server_load(srv, &load);
    ps_metrics_family(w, "pshard_rpc_workers", PS_METRIC_GAUGE,
                      "Worker threads that run the gRPC handlers which may block.");
    ps_metrics_sample(w, NULL, load.workers);
    ps_metrics_family(w, "pshard_rpc_workers_busy", PS_METRIC_GAUGE,
                      "Worker threads running a handler now.");
    ps_metrics_sample(w, NULL, load.busy);
    ps_metrics_family(w, "pshard_rpc_queued_calls", PS_METRIC_GAUGE,
                      "Calls waiting for a free worker thread.");
    ps_metrics_sample(w, NULL, (double)load.queued);
    ps_metrics_family(w, "pshard_rpc_queue_wait_seconds", PS_METRIC_GAUGE,
                      "How long the oldest call waiting for a worker has waited (0: none waits).");
    ps_metrics_sample(w, NULL, (double)load.oldest_wait_ns / 1e9);
    ps_metrics_family(w, "pshard_rpc_send_queue_bytes", PS_METRIC_GAUGE,
                      "Reply bytes queued for clients that gRPC has not yet taken.");
    ps_metrics_sample(w, NULL, (double)load.send_queued_bytes);
}
