/* "Who is slow" (coord_straggler.h): the slowest rank by median compute time, and the rule that
 * logs a rank that stays slow once. */
#include "coord_straggler.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/util.h"

pshard_status_t coord_steps_check(const coord_steps_t *s, char *err, size_t errlen)
{
    if (s->window > COORD_STEP_WINDOW)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "step summary: window %u is over %d steps", s->window, COORD_STEP_WINDOW);
    const double v[3] = {s->step_s, s->compute_s, s->wait_s};
    static const char *const names[3] = {"step_seconds", "compute_seconds", "wait_seconds"};
    for (int k = 0; k < 3; k++)
        if (!isfinite(v[k]) || v[k] < 0 || v[k] > COORD_STEP_SECONDS_MAX)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "step summary: %s %g is not a time in 0 .. %.0f s", names[k], v[k],
                           COORD_STEP_SECONDS_MAX);
    return PSHARD_OK;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static bool eligible(const coord_member_t *m, uint32_t min_window)
{
    return m->role == COORD_ROLE_SHARD_SERVER && m->rank >= 0 && m->steps.set &&
           m->steps.window > 0 && m->steps.window >= min_window;
}

void coord_straggler_find(const coord_member_t *members, size_t n, double threshold,
                          uint32_t min_window, coord_straggler_t *out)
{
    memset(out, 0, sizeof(*out));
    out->rank = -1;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += eligible(&members[i], min_window);
    if (k < 2)
        return;
    double *v = malloc(k * sizeof(*v));
    if (!v)
        return;
    const coord_member_t *slowest = NULL;
    k = 0;
    for (size_t i = 0; i < n; i++) {
        const coord_member_t *m = &members[i];
        if (!eligible(m, min_window))
            continue;
        v[k++] = m->steps.compute_s;
        if (!slowest || m->steps.compute_s > slowest->steps.compute_s ||
            (m->steps.compute_s == slowest->steps.compute_s && m->rank < slowest->rank))
            slowest = m;
    }
    qsort(v, k, sizeof(*v), cmp_double);
    double median = k % 2 ? v[k / 2] : (v[k / 2 - 1] + v[k / 2]) / 2;
    free(v);
    out->rank = slowest->rank;
    ps_strlcpy(out->name, slowest->name, sizeof(out->name));
    out->compute_s = slowest->steps.compute_s;
    out->median_s = median;
    out->ratio = slowest->steps.compute_s / (median > 1e-6 ? median : 1e-6);
    out->window = slowest->steps.window;
    out->steps = slowest->steps.steps;
    out->ranks = (uint32_t)k;
    out->slow = out->ratio >= threshold;
}

void coord_straggler_watch_init(coord_straggler_watch_t *w)
{
    memset(w, 0, sizeof(*w));
    w->rank = -1;
}

void coord_straggler_format(const coord_straggler_t *s, char *buf, size_t len)
{
    snprintf(buf, len,
             "rank %d (%s) is %.2fx the median step compute over the last %u steps (%.3f s "
             "against %.3f s, %u ranks)",
             s->rank, s->name, s->ratio, s->window, s->compute_s, s->median_s, s->ranks);
}

coord_straggler_event_t coord_straggler_watch_update(coord_straggler_watch_t *w,
                                                     const coord_straggler_t *cur,
                                                     uint32_t min_steps, double threshold,
                                                     char *msg, size_t msglen)
{
    msg[0] = '\0';
    bool slow = cur->rank >= 0 && cur->slow;
    if (slow && cur->rank == w->rank) {
        /* Its server's count restarts when it does: start counting again from there. */
        if (cur->steps < w->since_steps)
            w->since_steps = cur->steps;
        if (w->logged || cur->steps - w->since_steps < min_steps)
            return COORD_STRAGGLER_QUIET;
        w->logged = true;
        char line[512];
        coord_straggler_format(cur, line, sizeof(line));
        snprintf(msg, msglen, "slow rank: %s, for %llu steps now (--straggler-ratio %.2f)", line,
                 (unsigned long long)(cur->steps - w->since_steps), threshold);
        return COORD_STRAGGLER_SLOW;
    }
    coord_straggler_event_t ev = COORD_STRAGGLER_QUIET;
    if (w->logged) {
        ev = COORD_STRAGGLER_RECOVERED;
        if (cur->rank >= 0)
            snprintf(msg, msglen,
                     "rank %d is no longer slow: the slowest is now rank %d at %.2fx the median "
                     "step compute (--straggler-ratio %.2f)",
                     w->rank, cur->rank, cur->ratio, threshold);
        else
            snprintf(msg, msglen, "rank %d is no longer slow (too few figures to compare)",
                     w->rank);
    }
    w->rank = slow ? cur->rank : -1;
    w->since_steps = slow ? cur->steps : 0;
    w->logged = false;
    return ev;
}
