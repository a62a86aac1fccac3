/* The coordinator's Prometheus families: cluster state and generation, members and their
 * leases, the Join table, the store, plus the gRPC and process families every service has.
 * Written from one snapshot of every job (coord_service_metrics_view), each per-job family
 * with a "job" label, on the metrics thread. */
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "coord_metrics.h"
#include "coord_straggler.h"
#include "pshard/util.h"

static void gauge(ps_metrics_t *w, const char *name, const char *help, double v)
{
    ps_metrics_family(w, name, PS_METRIC_GAUGE, help);
    ps_metrics_sample(w, NULL, v);
}

/* One gauge family with a sample per job: value(job snapshot). */
static void job_gauge(ps_metrics_t *w, const coord_metrics_view_t *v, const char *name,
                      const char *help, double (*value)(const coord_metrics_job_t *j))
{
    ps_metrics_family(w, name, PS_METRIC_GAUGE, help);
    for (size_t i = 0; i < v->njobs; i++) {
        if (!v->jobs[i].snap)
            continue;
        const char *labels[] = {"job", v->jobs[i].job, NULL};
        ps_metrics_sample(w, labels, value(&v->jobs[i]));
    }
}

static double generation_of(const coord_metrics_job_t *j)
{
    return (double)j->snap->generation;
}
static double formed_generation_of(const coord_metrics_job_t *j)
{
    return (double)j->snap->formed_generation;
}
static double world_size_of(const coord_metrics_job_t *j)
{
    return j->snap->world_size;
}
static double joined_of(const coord_metrics_job_t *j)
{
    return (double)j->snap->njoins;
}
static double last_joiner_of(const coord_metrics_job_t *j)
{
    return j->snap->last_joiner;
}
static double store_keys_of(const coord_metrics_job_t *j)
{
    return (double)j->store_keys;
}
static double store_waiters_of(const coord_metrics_job_t *j)
{
    return (double)j->store_waiters;
}

/* "Who is slow": each ranked server's step medians (from its heartbeats) and the slowest rank
 * of each job, as pshardctl status shows them. */
static void straggler_families(ps_metrics_t *w, const coord_metrics_view_t *v)
{
    static const char *const names[3] = {"pshard_coordinator_step_median_seconds",
                                         "pshard_coordinator_step_compute_median_seconds",
                                         "pshard_coordinator_step_wait_median_seconds"};
    static const char *const helps[3] = {
        "A rank's median step time over its last steps (at most 50), from its heartbeats.",
        "A rank's median step compute time (its trainer outside pshard).",
        "A rank's median step wait time (its trainer waiting on its shard server)."};
    for (int k = 0; k < 3; k++) {
        ps_metrics_family(w, names[k], PS_METRIC_GAUGE, helps[k]);
        for (size_t i = 0; i < v->njobs; i++) {
            const coord_snapshot_t *snap = v->jobs[i].snap;
            for (size_t m = 0; snap && m < snap->nmembers; m++) {
                const coord_member_t *mb = &snap->members[m];
                if (!mb->steps.set || mb->rank < 0)
                    continue;
                char rank[16];
                snprintf(rank, sizeof(rank), "%d", mb->rank);
                const char *labels[] = {"job", v->jobs[i].job, "rank", rank, NULL};
                double x = k == 0   ? mb->steps.step_s
                           : k == 1 ? mb->steps.compute_s
                                    : mb->steps.wait_s;
                ps_metrics_sample(w, labels, x);
            }
        }
    }
    coord_straggler_t *found = calloc(v->njobs + 1, sizeof(*found));
    if (!found)
        return;
    for (size_t i = 0; i < v->njobs; i++) {
        found[i].rank = -1;
        if (v->jobs[i].snap)
            coord_straggler_find(v->jobs[i].snap->members, v->jobs[i].snap->nmembers,
                                 v->straggler_ratio, v->straggler_steps, &found[i]);
    }
    ps_metrics_family(w, "pshard_coordinator_slowest_rank", PS_METRIC_GAUGE,
                      "The rank with the highest median step compute time (-1: fewer than two "
                      "ranks have enough steps).");
    for (size_t i = 0; i < v->njobs; i++) {
        const char *labels[] = {"job", v->jobs[i].job, NULL};
        ps_metrics_sample(w, labels, found[i].rank);
    }
    ps_metrics_family(w, "pshard_coordinator_slowest_ratio", PS_METRIC_GAUGE,
                      "The slowest rank's median compute time over the median of all ranks' "
                      "medians (0: no slowest rank yet); slow at --straggler-ratio or more.");
    for (size_t i = 0; i < v->njobs; i++) {
        const char *labels[] = {"job", v->jobs[i].job, NULL};
        ps_metrics_sample(w, labels, found[i].rank >= 0 ? found[i].ratio : 0);
    }
    free(found);
}

static void write_view(void *arg, const coord_metrics_view_t *v)
{
    ps_metrics_t *w = arg;
    const char *info[] = {"version", PSHARD_VERSION_STRING, NULL};
    ps_metrics_family(w, "pshard_coordinator_info", PS_METRIC_GAUGE,
                      "Constant 1, labelled with the coordinator's version.");
    ps_metrics_sample(w, info, 1);
    gauge(w, "pshard_coordinator_jobs", "Jobs the coordinator holds (the default job too).",
          (double)v->njobs);
    job_gauge(w, v, "pshard_coordinator_generation",
              "Cluster generation of a job: bumped by every membership change.", generation_of);
    job_gauge(w, v, "pshard_coordinator_formed_generation",
              "Generation at which a job's current ranks were (re)formed (0: never formed).",
              formed_generation_of);
    job_gauge(w, v, "pshard_coordinator_world_size", "Ranks assigned when formed (0 before).",
              world_size_of);
    static const coord_cluster_state_t states[] = {COORD_CLUSTER_FORMING, COORD_CLUSTER_FORMED,
                                                   COORD_CLUSTER_DEGRADED};
    ps_metrics_family(w, "pshard_coordinator_cluster_state", PS_METRIC_GAUGE,
                      "1 for a job's cluster state now, 0 for the others.");
    for (size_t i = 0; i < v->njobs; i++) {
        const coord_snapshot_t *snap = v->jobs[i].snap;
        for (size_t k = 0; snap && k < PS_ARRAY_LEN(states); k++) {
            const char *labels[] = {"job", v->jobs[i].job, "state",
                                    coord_cluster_state_name(states[k]), NULL};
            ps_metrics_sample(w, labels, snap->state == states[k] ? 1 : 0);
        }
    }
    static const coord_role_t roles[] = {COORD_ROLE_SHARD_SERVER, COORD_ROLE_TRAINER};
    ps_metrics_family(w, "pshard_coordinator_members", PS_METRIC_GAUGE,
                      "Registered members of a job (lease running), by role.");
    for (size_t i = 0; i < v->njobs; i++) {
        const coord_snapshot_t *snap = v->jobs[i].snap;
        for (size_t k = 0; snap && k < PS_ARRAY_LEN(roles); k++) {
            size_t n = 0;
            for (size_t m = 0; m < snap->nmembers; m++)
                n += snap->members[m].role == roles[k];
            const char *labels[] = {"job", v->jobs[i].job, "role", coord_role_name(roles[k]), NULL};
            ps_metrics_sample(w, labels, (double)n);
        }
    }
    gauge(w, "pshard_coordinator_lease_seconds",
          "Lease: a member not heard from for this long is evicted.", (double)v->lease_ms / 1e3);
    /* Per member: the name is what operators know a member by (the pod name). */
    for (int pass = 0; pass < 2; pass++) {
        ps_metrics_family(w,
                          pass == 0 ? "pshard_coordinator_member_lease_age_seconds"
                                    : "pshard_coordinator_member_lease_remaining_seconds",
                          PS_METRIC_GAUGE,
                          pass == 0 ? "Seconds since the member's last heartbeat."
                                    : "Seconds until the member's lease lapses.");
        for (size_t i = 0; i < v->njobs; i++) {
            const coord_snapshot_t *snap = v->jobs[i].snap;
            for (size_t k = 0; snap && k < snap->nmembers; k++) {
                const coord_member_t *m = &snap->members[k];
                char rank[16];
                snprintf(rank, sizeof(rank), "%d", m->rank);
                const char *labels[] = {"job",   v->jobs[i].job, "name",
                                        m->name, "role",         coord_role_name(m->role),
                                        "rank",  rank,           NULL};
                int64_t ns =
                    pass == 0 ? v->now_ns - m->last_heartbeat_ns : m->lease_deadline_ns - v->now_ns;
                ps_metrics_sample(w, labels, ns > 0 ? (double)ns / 1e9 : 0);
            }
        }
    }
    job_gauge(w, v, "pshard_coordinator_joined_ranks",
              "Ranks whose trainer has joined (Join, uneven inputs) in a job's current round.",
              joined_of);
    ps_metrics_family(w, "pshard_coordinator_join_step", PS_METRIC_GAUGE,
                      "The step at which a joined rank's trainer joined.");
    for (size_t i = 0; i < v->njobs; i++) {
        const coord_snapshot_t *snap = v->jobs[i].snap;
        for (size_t k = 0; snap && k < snap->njoins; k++) {
            char rank[16];
            snprintf(rank, sizeof(rank), "%d", snap->joins[k].rank);
            const char *labels[] = {"job", v->jobs[i].job, "rank", rank, NULL};
            ps_metrics_sample(w, labels, (double)snap->joins[k].step);
        }
    }
    job_gauge(w, v, "pshard_coordinator_last_joiner",
              "The last rank of a job's most recent completed join (-1: none yet).",
              last_joiner_of);
    job_gauge(w, v, "pshard_coordinator_store_keys", "Keys in a job's key/value store.",
              store_keys_of);
    job_gauge(w, v, "pshard_coordinator_store_waiters", "A job's pending store waits (StoreWait).",
              store_waiters_of);
    straggler_families(w, v);
    ps_metrics_rpc(w, v->srv);
    ps_metrics_process(w, v->started_ns);
}

static void collect(void *arg, ps_metrics_t *w)
{
    coord_service_metrics_view(arg, write_view, w);
}

ps_metrics_server_t *coord_metrics_start(pshard_coordinator_t *c, const char *listen, char *err,
                                         size_t errlen)
{
    return ps_metrics_server_start(listen, collect, c, err, errlen);
}
