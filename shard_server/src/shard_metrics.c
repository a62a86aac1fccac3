/* The shard server's statistics, health rule and /metrics families. Operations record
 * themselves with relaxed atomic adds where they complete; Status, the health monitor and
 * scrapes read those atomics and copies under s->mu (held only briefly anywhere), never
 * op_mu, so they answer while a trainer operation is blocked in a collective. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "pshard/log.h"
#include "pshard/util.h"
#include "pshard/coord_client.h"

#include "shard_internal.h"

static const char *const opk_names[SHARD_OPK_COUNT] = {
    "gather",    "reduce_scatter", "step",   "clip_grad_norm", "all_gather", "all_reduce",
    "broadcast", "barrier",        "reduce", "gather_to_root", "scatter",    "all_to_all",
};

shard_opk_t shard_opk_of_coll(uint32_t coll_op)
{
    switch (coll_op) {
    case PSHARD_COLL_ALL_GATHER:
        return SHARD_OPK_ALL_GATHER;
    case PSHARD_COLL_BROADCAST:
        return SHARD_OPK_BROADCAST;
    case PSHARD_COLL_BARRIER:
        return SHARD_OPK_BARRIER;
    case PSHARD_COLL_REDUCE:
        return SHARD_OPK_REDUCE;
    case PSHARD_COLL_GATHER:
        return SHARD_OPK_GATHER_TO_ROOT;
    case PSHARD_COLL_SCATTER:
        return SHARD_OPK_SCATTER;
    case PSHARD_COLL_ALL_TO_ALL:
        return SHARD_OPK_ALL_TO_ALL;
    default:
        return SHARD_OPK_ALL_REDUCE;
    }
}

void shard_stats_record(pshard_shard_server_t *s, shard_opk_t op, int64_t start_ns, uint64_t bytes,
                        bool ok)
{
    shard_op_stats_t *st = &s->op_stats[op];
    int64_t ns = ps_now_ns() - start_ns;
    if (ns < 0)
        ns = 0;
    size_t b = ps_metrics_bucket_index(ps_metrics_latency_bounds, PS_METRICS_LATENCY_BUCKETS,
                                       (double)ns / 1e9);
    atomic_fetch_add_explicit(&st->buckets[b], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&st->sum_ns, (uint64_t)ns, memory_order_relaxed);
    atomic_fetch_add_explicit(&st->bytes, bytes, memory_order_relaxed);
    if (!ok)
        atomic_fetch_add_explicit(&st->errors, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&st->ops, 1, memory_order_relaxed);
}

/* ---------------------------------------------------------------------------------------- */
/* Health                                                                                    */

/* Why this server cannot serve its trainer now, into why (empty when it can). */
static void health_reason(pshard_shard_server_t *s, char *why, size_t len)
{
    why[0] = '\0';
    char cerr[PSHARD_ERRLEN] = "";
    pshard_coll_record_t rec;
    size_t nrec = 0;
    pthread_mutex_lock(&s->mu);
    pshard_comm_t *comm = s->comm;
    pshard_status_t fatal = s->fatal;
    pshard_status_t cst = PSHARD_OK;
    if (fatal != PSHARD_OK)
        snprintf(why, len, "the shard server failed: %.200s", s->fatal_msg);
    else if (comm) {
        /* Under s->mu: the setup thread swaps s->comm under it before destroying a ring. */
        cst = pshard_comm_error(comm, cerr, sizeof(cerr));
        nrec = pshard_comm_flight_records(comm, &rec, 1);
    }
    pthread_mutex_unlock(&s->mu);
    if (why[0])
        return;
    if (!comm) {
        snprintf(why, len, "no ring: the cluster has not formed yet, or is re-forming");
        return;
    }
    if (cst != PSHARD_OK) {
        snprintf(why, len, "the ring failed (until the cluster re-forms): %.180s", cerr);
        return;
    }
    ps_rpc_load_t load;
    ps_rpc_server_load(s->srv, &load);
    if (load.queued > 0 && load.oldest_wait_ns >= SHARD_SATURATED_NS) {
        snprintf(why, len,
                 "all %d RPC workers are busy (trainer operations blocked?) and %zu call(s) "
                 "wait, the oldest for %.1f s",
                 load.workers, load.queued, (double)load.oldest_wait_ns / 1e9);
        return;
    }
    int64_t timeout_ns = (s->cfg.coll_timeout_ms > 0 ? s->cfg.coll_timeout_ms : 600000) * 1000000;
    int64_t now = ps_now_ns();
    if (nrec == 1 && (rec.state == PSHARD_COLL_RUNNING || rec.state == PSHARD_COLL_QUEUED) &&
        rec.start_ns > 0 && now - rec.start_ns > timeout_ns)
        snprintf(why, len, "%s seq %" PRIu64 " has run %.1f s, past its %lld ms timeout",
                 pshard_coll_op_name(rec.op), rec.seq, (double)(now - rec.start_ns) / 1e9,
                 (long long)(timeout_ns / 1000000));
}

void shard_health_update(pshard_shard_server_t *s)
{
    char why[PSHARD_ERRLEN];
    health_reason(s, why, sizeof(why));
    int want = why[0] ? 2 : 1;
    pthread_mutex_lock(&s->health_mu);
    int had = atomic_load(&s->serving);
    if (want != had) {
        /* Not at start-up: "forming" is the expected state then, not news. */
        if (want == 2 && had == 1)
            PS_WARN(PS_SUB_SHARD, "health NOT_SERVING: %s", why);
        else if (want == 1)
            PS_INFO(PS_SUB_SHARD, "health SERVING%s%s",
                    had == 2 && s->health_reason[0] ? " again; it was NOT_SERVING: " : "",
                    had == 2 ? s->health_reason : "");
        atomic_store(&s->serving, want);
        ps_rpc_server_set_health(s->srv, "pshard.ShardServer", want);
    }
    ps_strlcpy(s->health_reason, why, sizeof(s->health_reason));
    pthread_mutex_unlock(&s->health_mu);
    if (want != had) /* the coordinator hears it now, not at the next heartbeat */
        ps_coord_lease_poke(s->lease);
}

void *shard_monitor_main(void *arg)
{
    pshard_shard_server_t *s = arg;
    while (!atomic_load(&s->stop)) {
        shard_health_update(s);
        struct timespec ts = {0, 100 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* /metrics                                                                                  */

static void gauge(ps_metrics_t *w, const char *name, const char *help, double v)
{
    ps_metrics_family(w, name, PS_METRIC_GAUGE, help);
    ps_metrics_sample(w, NULL, v);
}

/* One counter family over the op kinds, from field `which` of each op's statistics. */
static void op_counter(ps_metrics_t *w, pshard_shard_server_t *s, const char *name,
                       const char *help, int which)
{
    ps_metrics_family(w, name, PS_METRIC_COUNTER, help);
    for (int k = 0; k < SHARD_OPK_COUNT; k++) {
        const shard_op_stats_t *st = &s->op_stats[k];
        uint64_t v = which == 0   ? atomic_load(&st->ops)
                     : which == 1 ? atomic_load(&st->errors)
                                  : atomic_load(&st->bytes);
        const char *labels[] = {"op", opk_names[k], NULL};
        ps_metrics_sample_u64(w, labels, v);
    }
}

void shard_metrics_collect(void *arg, ps_metrics_t *w)
{
    pshard_shard_server_t *s = arg;
    pthread_mutex_lock(&s->mu);
    int rank = s->rank, world = s->world;
    uint64_t generation = s->generation, ring_generation = s->comm_generation;
    bool ring = s->comm && pshard_comm_error(s->comm, NULL, 0) == PSHARD_OK;
    bool attached = s->session[0] != 0 && !s->trainer_gone;
    bool joined = s->joined;
    int64_t joined_step = s->joined_step;
    uint64_t shadowed = s->shadowed_ops, ahead = s->ops_ahead, diverted = s->ops_diverted;
    int64_t last_contact = s->last_contact_ns, lease_ms = s->lease_ms;
    bool registered = s->member_id[0] != 0;
    const shard_model_t *m = s->model;
    int64_t step = m ? m->step : 0;
    int64_t aborted = m ? m->aborted_steps : 0;
    uint32_t step_aborts = s->ring_serial;
    bool awaiting = s->replace_deadline_ns != 0;
    uint64_t heals = s->heals;
    bool heal_awaited = s->heal_rank >= 0;
    size_t nparams = m ? m->nparams : 0;
    uint64_t shard_elements = m ? m->shard_numel : 0;
    uint64_t state_bytes = m ? shard_model_state_bytes(m) : 0;
    uint64_t to_host = m ? atomic_load(&m->staged_to_host) : 0;
    uint64_t to_device = m ? atomic_load(&m->staged_to_device) : 0;
    pthread_mutex_unlock(&s->mu);

    const char *info[] = {"name",    s->cfg.name,    "backend", s->cfg.backend,
                          "offload", s->cfg.offload, "version", PSHARD_VERSION_STRING,
                          NULL};
    ps_metrics_family(w, "pshard_shard_info", PS_METRIC_GAUGE,
                      "Constant 1, labelled with this shard server's name, backend and offload.");
    ps_metrics_sample(w, info, 1);
    gauge(w, "pshard_shard_serving",
          "1 while health pshard.ShardServer is SERVING, 0 while NOT_SERVING (see the README's "
          "health rule).",
          atomic_load(&s->serving) == 1 ? 1 : 0);
    gauge(w, "pshard_shard_registered", "1 once registered with the coordinator.",
          registered ? 1 : 0);
    gauge(w, "pshard_shard_rank", "This server's rank (-1 before the cluster formed).", rank);
    gauge(w, "pshard_shard_world_size", "Shard servers in the cluster (0 before it formed).",
          world);
    gauge(w, "pshard_shard_generation", "The cluster generation last heard from the coordinator.",
          (double)generation);
    gauge(w, "pshard_shard_ring_generation",
          "The generation this server's communicator (ring) was built for.",
          (double)ring_generation);
    gauge(w, "pshard_shard_ring_up", "1 while this server has a working communicator.",
          ring ? 1 : 0);
    gauge(w, "pshard_shard_lease_age_seconds",
          "Seconds since the last successful heartbeat to the coordinator (-1: none yet).",
          last_contact > 0 ? (double)(ps_now_ns() - last_contact) / 1e9 : -1);
    gauge(w, "pshard_shard_lease_seconds",
          "The coordinator's lease: evicted after this long "
          "without a heartbeat (0: not known yet).",
          (double)lease_ms / 1e3);
    gauge(w, "pshard_shard_trainer_attached", "1 while a trainer is attached.", attached ? 1 : 0);
    gauge(w, "pshard_shard_step", "Optimizer steps taken on this rank's shard.", (double)step);
    gauge(w, "pshard_shard_steps_aborted",
          "Steps of the defined model aborted on every rank because a trainer was lost and "
          "replaced (--trainer-replace-ms).",
          (double)aborted);
    ps_metrics_family(w, "pshard_shard_step_aborts_total", PS_METRIC_COUNTER,
                      "Rebuilds of this server's ring after a step aborted for a lost trainer.");
    ps_metrics_sample_u64(w, NULL, step_aborts);
    gauge(w, "pshard_shard_awaiting_trainer",
          "1 while this rank's trainer was lost and its replacement is awaited.", awaiting ? 1 : 0);
    ps_metrics_family(w, "pshard_shard_heals_total", PS_METRIC_COUNTER,
                      "Heals of a lost shard server from an HSDP replica that this server took "
                      "part in (as the replacement, the source or a survivor).");
    ps_metrics_sample_u64(w, NULL, heals);
    gauge(w, "pshard_shard_awaiting_heal",
          "1 while a lost shard server's rank is awaited to heal from a replica.",
          heal_awaited ? 1 : 0);
    gauge(w, "pshard_shard_params", "Parameters of the defined model (0: none defined).",
          (double)nparams);
    gauge(w, "pshard_shard_elements", "Elements of the parameters this rank owns.",
          (double)shard_elements);
    gauge(w, "pshard_shard_state_bytes",
          "Bytes of shard state (master weights, gradients, optimizer state).",
          (double)state_bytes);
    ps_metrics_family(w, "pshard_shard_device_staged_bytes_total", PS_METRIC_COUNTER,
                      "Bytes the defined model's gathers and reduce-scatters copied between "
                      "host and GPU memory: GPU buffers through host memory on tcp "
                      "(--shard-memory gpu), host buffers (CPU offload, a model region in host "
                      "memory) to the GPU and back on nccl; 0 with GPU-resident shards and the "
                      "model region in GPU memory on nccl.");
    const char *lh[] = {"direction", "to_host", NULL}, *ld[] = {"direction", "to_device", NULL};
    ps_metrics_sample_u64(w, lh, to_host);
    ps_metrics_sample_u64(w, ld, to_device);
    gauge(w, "pshard_shard_joined",
          "1 while this rank's trainer has joined (Join, uneven "
          "inputs) and the server shadows the other ranks.",
          joined ? 1 : 0);
    gauge(w, "pshard_shard_joined_step", "The step at which this rank's trainer joined.",
          (double)joined_step);
    gauge(w, "pshard_shard_join_shadowed_ops",
          "Operations of the other ranks shadowed since this rank's trainer joined.",
          (double)shadowed);
    ps_metrics_family(w, "pshard_shard_ops_ahead_total", PS_METRIC_COUNTER,
                      "Gathers, reduce-scatters and collectives run without an agreement round "
                      "first (no rank had joined).");
    ps_metrics_sample_u64(w, NULL, ahead);
    ps_metrics_family(w, "pshard_shard_ops_diverted_total", PS_METRIC_COUNTER,
                      "Operations run ahead that some rank's other operation (a joined rank's "
                      "agreement round) diverted to an agreement round.");
    ps_metrics_sample_u64(w, NULL, diverted);

    op_counter(w, s, "pshard_shard_ops_total",
               "Trainer operations completed (gathers, reduce-scatters, steps, collectives), "
               "successfully or not.",
               0);
    op_counter(w, s, "pshard_shard_op_errors_total", "Trainer operations that failed.", 1);
    op_counter(w, s, "pshard_shard_op_bytes_total",
               "Tensor bytes of trainer operations (full parameter or gradient sizes).", 2);
    ps_metrics_family(w, "pshard_shard_op_duration_seconds", PS_METRIC_HISTOGRAM,
                      "Duration of trainer operations, from the start of the run (after the "
                      "request is checked) to completion.");
    for (int k = 0; k < SHARD_OPK_COUNT; k++) {
        const shard_op_stats_t *st = &s->op_stats[k];
        uint64_t counts[PS_METRICS_LATENCY_BUCKETS + 1];
        /* _count is the buckets' sum, so a scrape racing an update stays self-consistent. */
        for (size_t b = 0; b <= PS_METRICS_LATENCY_BUCKETS; b++)
            counts[b] = atomic_load(&st->buckets[b]);
        const char *labels[] = {"op", opk_names[k], NULL};
        ps_metrics_histogram(w, labels, ps_metrics_latency_bounds, counts,
                             PS_METRICS_LATENCY_BUCKETS, (double)atomic_load(&st->sum_ns) / 1e9);
    }
    shard_steps_metrics(&s->steps, w);
    ps_metrics_rpc(w, s->srv);
    ps_metrics_process(w, s->started_ns);
}
