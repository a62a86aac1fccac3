/* Per-step timing of this rank's trainer (shard_steps.h): the wait time is the union of the
 * intervals during which some trainer call was inside the server, so calls that overlap (an
 * asynchronous gather queued behind a reduce-scatter) count once. */
#include "shard_steps.h"

#include <stdlib.h>
#include <string.h>

void shard_steps_init(shard_steps_t *st)
{
    memset(st, 0, sizeof(*st));
    pthread_mutex_init(&st->mu, NULL);
}

void shard_steps_destroy(shard_steps_t *st)
{
    pthread_mutex_destroy(&st->mu);
}

void shard_steps_op_begin(shard_steps_t *st, int64_t now_ns)
{
    pthread_mutex_lock(&st->mu);
    if (st->inflight++ == 0)
        st->busy_since_ns = now_ns;
    pthread_mutex_unlock(&st->mu);
}

void shard_steps_op_end(shard_steps_t *st, int64_t now_ns)
{
    pthread_mutex_lock(&st->mu);
    if (st->inflight > 0 && --st->inflight == 0 && now_ns > st->busy_since_ns)
        st->busy_ns += now_ns - st->busy_since_ns;
    pthread_mutex_unlock(&st->mu);
}

void shard_steps_reset(shard_steps_t *st)
{
    pthread_mutex_lock(&st->mu);
    st->step_start_ns = 0;
    st->busy_ns = 0;
    st->marked = false;
    st->nwindow = 0;
    st->next = 0;
    pthread_mutex_unlock(&st->mu);
}

void shard_steps_boundary(shard_steps_t *st, int64_t now_ns, bool mark, uint64_t tokens,
                          uint64_t samples)
{
    pthread_mutex_lock(&st->mu);
    if (!mark && st->marked) {
        pthread_mutex_unlock(&st->mu);
        return;
    }
    st->marked |= mark;
    /* The wait so far, up to now, belongs to the step that ends here; a call still inside
     * counts on into the next one. */
    int64_t busy = st->busy_ns;
    if (st->inflight > 0 && now_ns > st->busy_since_ns) {
        busy += now_ns - st->busy_since_ns;
        st->busy_since_ns = now_ns;
    }
    st->busy_ns = 0;
    if (st->step_start_ns > 0 && now_ns >= st->step_start_ns) {
        double fig[SHARD_STEP_NFIG];
        fig[SHARD_STEP_TIME] = (double)(now_ns - st->step_start_ns) / 1e9;
        fig[SHARD_STEP_WAIT] = (double)busy / 1e9;
        /* The wait can exceed the step only by the clock readings' order; never below 0. */
        if (fig[SHARD_STEP_WAIT] > fig[SHARD_STEP_TIME])
            fig[SHARD_STEP_WAIT] = fig[SHARD_STEP_TIME];
        fig[SHARD_STEP_COMPUTE] = fig[SHARD_STEP_TIME] - fig[SHARD_STEP_WAIT];
        for (int k = 0; k < SHARD_STEP_NFIG; k++) {
            size_t b = ps_metrics_bucket_index(ps_metrics_latency_bounds,
                                               PS_METRICS_LATENCY_BUCKETS, fig[k]);
            st->hist[k][b]++;
            st->sum[k] += fig[k];
            st->window[k][st->next] = fig[k];
        }
        st->next = (st->next + 1) % SHARD_STEP_WINDOW;
        if (st->nwindow < SHARD_STEP_WINDOW)
            st->nwindow++;
        st->steps++;
    }
    /* The first mark's counts are the trainer's too, even if its step had no start here. */
    st->tokens += tokens;
    st->samples += samples;
    st->step_start_ns = now_ns;
    pthread_mutex_unlock(&st->mu);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The median of v[0..n), n > 0 (v is sorted in place). */
static double median(double *v, size_t n)
{
    qsort(v, n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

bool shard_steps_summary(shard_steps_t *st, shard_step_summary_t *out)
{
    double v[SHARD_STEP_NFIG][SHARD_STEP_WINDOW];
    pthread_mutex_lock(&st->mu);
    uint32_t n = st->nwindow;
    memcpy(v, st->window, sizeof(v));
    out->steps = st->steps;
    pthread_mutex_unlock(&st->mu);
    out->window = n;
    out->step_s = out->compute_s = out->wait_s = 0;
    if (n == 0)
        return false;
    /* The window is full, or fills from slot 0: either way its first n slots. */
    out->step_s = median(v[SHARD_STEP_TIME], n);
    out->compute_s = median(v[SHARD_STEP_COMPUTE], n);
    out->wait_s = median(v[SHARD_STEP_WAIT], n);
    return true;
}

void shard_steps_metrics(shard_steps_t *st, ps_metrics_t *w)
{
    static const char *const names[SHARD_STEP_NFIG] = {
        "pshard_step_seconds", "pshard_step_compute_seconds", "pshard_step_wait_seconds"};
    static const char *const helps[SHARD_STEP_NFIG] = {
        "Wall time between consecutive step boundaries (the end of each Step) of this rank's "
        "trainer.",
        "Per step, the time this rank's trainer spent outside pshard: step time less wait time.",
        "Per step, the time this rank's trainer waited on its shard server (collectives, "
        "agreement rounds and copies; not split by peer).",
    };
    static const char *const median_names[SHARD_STEP_NFIG] = {"pshard_step_median_seconds",
                                                              "pshard_step_compute_median_seconds",
                                                              "pshard_step_wait_median_seconds"};
    uint64_t hist[SHARD_STEP_NFIG][PS_METRICS_LATENCY_BUCKETS + 1];
    double sum[SHARD_STEP_NFIG];
    pthread_mutex_lock(&st->mu);
    memcpy(hist, st->hist, sizeof(hist));
    memcpy(sum, st->sum, sizeof(sum));
    uint64_t tokens = st->tokens, samples = st->samples;
    pthread_mutex_unlock(&st->mu);
    shard_step_summary_t med;
    bool any = shard_steps_summary(st, &med);
    double medians[SHARD_STEP_NFIG] = {med.step_s, med.compute_s, med.wait_s};
    for (int k = 0; k < SHARD_STEP_NFIG; k++) {
        ps_metrics_family(w, names[k], PS_METRIC_HISTOGRAM, helps[k]);
        ps_metrics_histogram(w, NULL, ps_metrics_latency_bounds, hist[k],
                             PS_METRICS_LATENCY_BUCKETS, sum[k]);
    }
    for (int k = 0; k < SHARD_STEP_NFIG; k++) {
        ps_metrics_family(w, median_names[k], PS_METRIC_GAUGE,
                          "The median of the last 50 steps of this session (what the heartbeat "
                          "tells the coordinator; absent before the first step).");
        if (any)
            ps_metrics_sample(w, NULL, medians[k]);
    }
    ps_metrics_family(w, "pshard_step_tokens_total", PS_METRIC_COUNTER,
                      "Tokens the trainer reported with its steps (pshard.report_step).");
    ps_metrics_sample_u64(w, NULL, tokens);
    ps_metrics_family(w, "pshard_step_samples_total", PS_METRIC_COUNTER,
                      "Samples the trainer reported with its steps (pshard.report_step).");
    ps_metrics_sample_u64(w, NULL, samples);
}
