/* The shard server's membership side: register with the coordinator (again under the same
 * name when evicted, which gives the old rank back), heartbeat, and build the communicator
 * once the cluster has formed — rebuilding it when the cluster re-forms — and follow the
 * coordinator's Watch so an evicted peer or trainer stops this rank's collectives at once. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pshard/coord_client.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/util.h"
#include "shard_heal.h"
#include "shard_internal.h"
#include "shard_ops.h"
#include "shard_trace.h"

static void sleep_ms(int64_t ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

/* Cut off from the coordinator for longer than the lease while a collective is stalled (for
 * half a lease or more): this server has been evicted and its peers have stopped waiting for it, so
 * its own collectives stop too and its trainer gets an error instead of waiting for a ring that is
 * gone. A coordinator that is merely down (restarting) leaves the ring running: operations
 * keep completing, so nothing stalls and nothing is aborted. */
static void lost_contact_check(pshard_shard_server_t *s)
{
    /* All of it under mu: the setup thread retires a ring only after taking it from s->comm
     * under mu, so the ring read here stays alive. */
    pthread_mutex_lock(&s->mu);
    pshard_comm_t *comm = s->comm;
    int64_t since = s->last_contact_ns, lease = s->lease_ms;
    int64_t now = ps_now_ns();
    pshard_coll_record_t recs[64];
    size_t n = 0;
    if (comm && since != 0 && lease > 0 && now - since >= lease * 1000000 &&
        pshard_comm_error(comm, NULL, 0) == PSHARD_OK)
        n = pshard_comm_flight_records(comm, recs, 64);
    /* Records come oldest first; the newest is the one that may be stuck. Half a lease of
     * stalling is evidence enough: a healthy ring finishes an operation far sooner, and a
     * merely restarting coordinator does not stall it at all. */
    if (n == 0 || recs[n - 1].state != PSHARD_COLL_RUNNING ||
        now - recs[n - 1].start_ns < lease * 500000) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    pshard_coll_record_t rec = recs[n - 1];
    char msg[PSHARD_ERRLEN];
    snprintf(msg, sizeof(msg),
             "rank %d lost contact with the coordinator %s for %lld ms (lease %lld ms) while "
             "its %s seq %llu waits on rank %d: it counts as evicted",
             pshard_comm_rank(comm), s->cfg.coordinator, (long long)((now - since) / 1000000),
             (long long)lease, pshard_coll_op_name(rec.op), (unsigned long long)rec.seq,
             rec.waiting_on);
    pshard_comm_abort_status(comm, PSHARD_ERR_PEER_LOST, msg);
    pthread_mutex_unlock(&s->mu);
    PS_ERROR(PS_SUB_SHARD, "%s", msg);
}

/* `pshardctl checkpoint save` bumps a counter in the coordinator's store; the newest value
 * goes into this server's agreement records, and the step after which any rank has seen it
 * saves on every rank. */
static void poll_checkpoint_request(pshard_shard_server_t *s)
{
    /* An add of 0 reads the counter (0 before the first request) without the NOT_FOUND a get
     * would answer every heartbeat, which status would count as errors. */
    int64_t v = 0;
    char err[PSHARD_ERRLEN] = "";
    if (ps_coord_store_incr(s->coord, "pshard/checkpoint/request", 0, &v, 2000, err, sizeof(err)) !=
        PSHARD_OK)
        return;
    pthread_mutex_lock(&s->mu);
    if (v > s->ckpt_requested)
        s->ckpt_requested = v;
    pthread_mutex_unlock(&s->mu);
}

/* After every Register or Heartbeat of the server's lease (pshard/coord_client.h): adopts
 * the coordinator's view (rank, world, generation, formed) and any checkpoint request, or
 * notices an eviction while cut off. Returns the wait before the next attempt: a full
 * heartbeat once the ring runs, 100 ms while forming, at once after the coordinator forgot
 * this server, and a growing backoff while it cannot register. */
static int64_t lease_event(void *ctx, const ps_coord_lease_event_t *ev)
{
    pshard_shard_server_t *s = ctx;
    if (ev->registered && ev->rc != PSHARD_OK) {
        PS_WARN(PS_SUB_SHARD, "cannot register with %s: %s; retrying", s->cfg.coordinator, ev->err);
        int64_t wait = s->register_backoff_ms;
        s->register_backoff_ms = wait * 2 > 2000 ? 2000 : wait * 2;
        return wait;
    }
    if (ev->rc == PSHARD_ERR_NOT_FOUND) {
        /* Evicted (or the coordinator restarted): register again under the same name, which
         * gives the old rank back. */
        PS_WARN(PS_SUB_SHARD, "coordinator forgot us (%s); registering again", ev->err);
        pthread_mutex_lock(&s->mu);
        s->member_id[0] = '\0';
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    pthread_mutex_lock(&s->mu);
    int64_t every = s->heartbeat_ms;
    pthread_mutex_unlock(&s->mu);
    if (ev->rc != PSHARD_OK) {
        PS_WARN(PS_SUB_SHARD, "heartbeat to %s failed: %s", s->cfg.coordinator, ev->err);
        lost_contact_check(s);
    } else {
        const Pshard__MemberView *v = ev->view;
        if (ev->registered) {
            s->register_backoff_ms = 100;
            pthread_mutex_lock(&s->mu);
            ps_strlcpy(s->member_id, ev->member_id, sizeof(s->member_id));
            ps_strlcpy(s->lease_key, ev->lease_key, sizeof(s->lease_key));
            s->heartbeat_ms = every = v->heartbeat_ms > 0 ? v->heartbeat_ms : 1000;
            if (v->replaces_lost && !s->model)
                s->replaces_lost = true;
            pthread_mutex_unlock(&s->mu);
            PS_INFO(PS_SUB_SHARD, "registered with %s as %s", s->cfg.coordinator, v->member_id);
        }
        pthread_mutex_lock(&s->mu);
        s->last_contact_ns = ps_now_ns();
        if (v->lease_ms > 0)
            s->lease_ms = v->lease_ms;
        s->generation = v->generation;
        bool formed = v->state == PSHARD__CLUSTER_STATE__FORMED && v->rank >= 0;
        if (formed) {
            s->rank = v->rank;
            s->world = v->world_size;
            s->formed_generation = v->formed_generation;
        }
        s->formed = formed;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        poll_checkpoint_request(s);
    }
    /* A ring that failed since the last heartbeat leaves its flight records (--trace-dir):
     * here, on the lease's thread, the collective path never waits for the file. */
    shard_trace_check(s, NULL);
    /* Heartbeat faster while forming. */
    return s->formed && s->comm ? every : (every < 100 ? every : 100);
}

/* While waiting out of contact, the lease runs out between heartbeats: look every 100 ms. */
static void lease_wait(void *ctx, bool last_ok)
{
    if (!last_ok)
        lost_contact_check(ctx);
}

/* Every heartbeat tells the coordinator whether this server serves (its health and why
 * not), so the cluster's state and health say what is true. */
static void lease_health(void *ctx, char *reason, size_t len)
{
    pshard_shard_server_t *s = ctx;
    pthread_mutex_lock(&s->health_mu);
    if (atomic_load(&s->serving) == 2)
        ps_strlcpy(reason, s->health_reason[0] ? s->health_reason : "NOT_SERVING", len);
    else
        reason[0] = '\0';
    pthread_mutex_unlock(&s->health_mu);
}

/* The coordinator refuses a step figure over a day (StepSummary): a trainer paused that long
 * must not cost its server its lease, so the figures are capped here. */
#define STEP_SECONDS_SENT_MAX 86400.0

static double cap_seconds(double x)
{
    return x < STEP_SECONDS_SENT_MAX ? x : STEP_SECONDS_SENT_MAX;
}

/* Every heartbeat carries the medians of the trainer's last steps, so the coordinator can
 * name the slowest rank (shard_steps.h). */
static bool lease_steps(void *ctx, Pshard__StepSummary *out)
{
    pshard_shard_server_t *s = ctx;
    shard_step_summary_t sum;
    if (!shard_steps_summary(&s->steps, &sum))
        return false;
    out->window = sum.window;
    out->steps = sum.steps;
    out->step_seconds = cap_seconds(sum.step_s);
    out->compute_seconds = cap_seconds(sum.compute_s);
    out->wait_seconds = cap_seconds(sum.wait_s);
    return true;
}

pshard_status_t shard_lease_start(pshard_shard_server_t *s, char *err, size_t errlen)
{
    s->register_backoff_ms = 100;
    s->heartbeat_ms = 1000;
    ps_coord_lease_config_t lc = {
        .channel = s->coord,
        .role = PSHARD__ROLE__SHARD_SERVER,
        .name = s->cfg.name,
        .address = s->advertise,
        .node = s->cfg.node ? s->cfg.node : "",
        .device = strcmp(s->cfg.backend, "nccl") == 0 ? "cuda" : "cpu",
        .on_event = lease_event,
        .on_wait = lease_wait,
        .health = lease_health,
        .steps = lease_steps,
        .ctx = s,
    };
    return ps_coord_lease_start(&lc, false, &s->lease, err, errlen);
}

/* The ring needs rebuilding when the cluster re-formed with another rank or size for this
 * server, or when it failed (a lost peer, an eviction). A re-forming that gives every server
 * its rank back — a restarted coordinator — keeps a healthy ring and the training going.
 * Call with mu held. */
static bool comm_stale(pshard_shard_server_t *s)
{
    /* A step aborted for a lost trainer (or a lost server a replica heals): a new ring. */
    if (shard_ring_step_aborted(s, s->comm))
        return true;
    if (s->formed_generation == s->comm_generation)
        return false;
    bool same = s->rank == pshard_comm_rank(s->comm) &&
                s->world == pshard_comm_world_size(s->comm) &&
                pshard_comm_error(s->comm, NULL, 0) == PSHARD_OK;
    if (same)
        s->comm_generation = s->formed_generation; /* adopted: nothing changed for the ring */
    return !same;
}

void shard_apply_session_timeout(pshard_shard_server_t *s, pshard_comm_t *comm)
{
    int64_t ms = atomic_load(&s->session_timeout_ms);
    if (comm)
        pshard_comm_set_timeout(comm, ms);
    if (s->model && s->model->shard_comm)
        pshard_comm_set_timeout(s->model->shard_comm, ms);
    if (s->model && s->model->replicate_comm)
        pshard_comm_set_timeout(s->model->replicate_comm, ms);
}

/* Holding mu: past the deadline of an awaited replacement trainer, the rank gives up: its ring
 * fails with PEER_LOST, so the other ranks stop waiting for it and fail naming it, and this
 * server refuses everything from then on. */
static void replace_check(pshard_shard_server_t *s)
{
    if (s->replace_deadline_ns == 0 || ps_now_ns() < s->replace_deadline_ns)
        return;
    s->replace_deadline_ns = 0;
    char msg[PSHARD_ERRLEN];
    snprintf(msg, sizeof(msg),
             "rank %d's trainer was lost and no replacement defined its model within %lld ms "
             "(--trainer-replace-ms): the job cannot go on",
             s->rank, (long long)s->cfg.trainer_replace_ms);
    PS_ERROR(PS_SUB_SHARD, "%s", msg);
    if (s->comm && pshard_comm_error(s->comm, NULL, 0) == PSHARD_OK)
        pshard_comm_abort_status(s->comm, PSHARD_ERR_PEER_LOST, msg);
    if (s->fatal == PSHARD_OK) {
        s->fatal = PSHARD_ERR_PEER_LOST;
        ps_strlcpy(s->fatal_msg, msg, sizeof(s->fatal_msg));
    }
}

/* After a step aborted for a lost trainer (every rank's ring failed with STEP_ABORTED): the
 * gradients that reached this rank's accumulators in that step are dropped, so none of it is
 * applied, and the model counts the step as aborted (the data position a replacement resumes
 * at is its steps plus those). Under op_mu: an operation of the old ring may still hold it. */
static void discard_step(pshard_shard_server_t *s)
{
    pthread_mutex_lock(&s->op_mu);
    shard_model_t *m = s->model;
    if (m && !m->in_backward) {
        char err[PSHARD_ERRLEN] = "";
        if (shard_model_zero_grads(m, err, sizeof(err)) != PSHARD_OK) {
            shard_set_fatal(s, PSHARD_ERR_INTERNAL, err); /* the step cannot be dropped */
        } else {
            pthread_mutex_lock(&s->mu);
            m->aborted_steps++;
            pthread_mutex_unlock(&s->mu);
        }
    }
    pthread_mutex_unlock(&s->op_mu);
}

/* The tag of reconcile_step's all-gather: no trainer operation's (shard_exec.c's are below). */
#define TAG_RECONCILE 0x7ffffff0u

/* After a step aborted for a lost trainer, on the new ring and before any trainer operation
 * runs on it (op_mu held): the ranks agree on the model's step count. A trainer's own optimizer
 * (torch.optim) commits a step with a Step that every rank's trainer sends after its optimizer
 * ran; the abort may cut that Step's agreement short on some ranks after others completed it,
 * so the step counts wherever one rank counted it (each trainer had applied it; the trainers
 * learn which way it went from Resync). The shard servers' own optimizer applies its update
 * inside the Step, so there such a split cannot be mended: the job ends, saying so. Bounded:
 * a rank that never comes fails it after timeout_ms. */
static pshard_status_t reconcile_step(pshard_shard_server_t *s, pshard_comm_t *comm,
                                      uint32_t serial, int64_t timeout_ms, int64_t *flags,
                                      char *err, size_t errlen)
{
    int world = pshard_comm_world_size(comm);
    /* Two words a rank: its step count and its SHARD_HEAL_* flags. */
    int64_t *all = calloc((size_t)world * 2, sizeof(*all));
    if (!all)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    pthread_mutex_lock(&s->op_mu);
    shard_model_t *m = s->model;
    int64_t mine[2] = {m ? m->step : -1,
                       (m ? SHARD_HEAL_HAS_MODEL : 0) | (!m && s->heal ? SHARD_HEAL_HEALING : 0)};
    pshard_comm_set_timeout(comm, timeout_ms);
    pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_GATHER,
                            .dtype = PSHARD_INT64,
                            .send = mine,
                            .recv = all,
                            .count = 2,
                            .tag = ((uint64_t)serial << 32) | TAG_RECONCILE,
                            .label = "step count after an abort"};
    pshard_status_t rc = pshard_coll_run(comm, &a, err, errlen);
    shard_apply_session_timeout(s, comm);
    /* Every rank judges the same counts, so all go on or all fail alike. A rank that heals
     * (a replacement server awaiting its state) has none yet: it takes its replica's. */
    int top = -1, low = -1;
    for (int r = 0; r < world && rc == PSHARD_OK; r++) {
        flags[r] = all[2 * r + 1];
        if (!(flags[r] & SHARD_HEAL_HAS_MODEL))
            continue;
        if (top < 0 || all[2 * r] > all[2 * top])
            top = r;
        if (low < 0 || all[2 * r] < all[2 * low])
            low = r;
    }
    if (rc == PSHARD_OK && m && top >= 0 && all[2 * top] != all[2 * low]) {
        if (m->trainer_optimizer) {
            if (mine[0] < all[2 * top])
                PS_WARN(PS_SUB_SHARD,
                        "step %" PRId64 " was committed on rank %d before the abort cut it "
                        "short here: it counts on this rank too (the trainer had applied it)",
                        all[2 * top], top);
            pthread_mutex_lock(&s->mu);
            m->step = all[2 * top];
            pthread_mutex_unlock(&s->mu);
        } else {
            rc = ps_errf(err, errlen, PSHARD_ERR_INTERNAL,
                         "rank %d applied step %" PRId64 " of the shard servers' optimizer and "
                         "rank %d did not (the abort for a lost trainer or server cut the step "
                         "short between them): the ranks' shards no longer belong to one model; "
                         "restart the job from its last checkpoint",
                         top, all[2 * top], low);
        }
    }
    pthread_mutex_unlock(&s->op_mu);
    free(all);
    return rc;
}

/* A lost server's replacement has its shard: the awaited rank is served again (the setup thread,
 * once the transfer succeeded on this rank). */
static void heal_done(pshard_shard_server_t *s)
{
    pthread_mutex_lock(&s->mu);
    int rank = s->heal_rank;
    double took = (double)(ps_now_ns() - s->heal_started_ns) / 1e9;
    char cause[sizeof(s->heal_cause)];
    memcpy(cause, s->heal_cause, sizeof(cause));
    s->heal_rank = -1;
    if (rank >= 0) {
        s->heals++;
        ps_snprintf(s->heal_note, sizeof(s->heal_note),
                    "rank %d healed from a replica %.3f s after it was lost (%s)", rank, took,
                    cause);
    }
    pthread_mutex_unlock(&s->mu);
    if (rank >= 0)
        PS_WARN(PS_SUB_SHARD,
                "rank %d's lost shard server (%s) is healed: its replacement holds a replica's "
                "shard state %.3f s after the loss; training goes on at the next step",
                rank, cause, took);
}

void *shard_setup_main(void *arg)
{
    pshard_shard_server_t *s = arg;
    int64_t give_up =
        s->cfg.form_timeout_ms > 0 ? ps_now_ns() + s->cfg.form_timeout_ms * 1000000 : INT64_MAX;
    /* After a step abort, until the new ring is up and the ranks agreed on the step count
     * (kept across a ring set-up that failed and is retried). */
    bool rebuild_pending = false;
    while (!atomic_load(&s->stop)) {
        pthread_mutex_lock(&s->mu);
        while (!atomic_load(&s->stop) && (!s->formed || (s->comm && !comm_stale(s)))) {
            shard_cv_wait(s, 100);
            replace_check(s);
            if (!s->comm && ps_now_ns() > give_up) {
                pthread_mutex_unlock(&s->mu);
                shard_set_fatal(s, PSHARD_ERR_TIMEOUT, "the cluster did not form in time");
                return NULL;
            }
        }
        if (atomic_load(&s->stop)) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        int rank = s->rank, world = s->world;
        uint64_t gen = s->formed_generation;
        pshard_comm_t *old = s->comm;
        char why[PSHARD_ERRLEN] = "";
        bool step_abort = old && shard_ring_step_aborted(s, old);
        if (old)
            pshard_comm_error(old, why, sizeof(why));
        if (step_abort) {
            s->ring_serial++;
            ps_strlcpy(s->abort_msg, why, sizeof(s->abort_msg));
        }
        uint32_t serial = s->ring_serial;
        s->comm = NULL;
        pthread_mutex_unlock(&s->mu);
        if (step_abort) {
            PS_WARN(PS_SUB_SHARD, "step aborted (%s); rebuilding the ring (serial %u)", why,
                    serial);
            shard_health_update(s);
            shard_pgs_abort(s, -1, PSHARD_ERR_STEP_ABORTED, why);
            shard_trace_check(s, old);
            shard_ops_retire_ring(s, old, serial);
            discard_step(s);
            old = NULL;
            rebuild_pending = true;
        }
        if (rebuild_pending) {
            /* A lost server (the watch thread may learn of it only now, while a peer's abort
             * reached this rank first: it then cancels the ring's set-up below): its
             * replacement's ring is the re-formed cluster's. */
            pthread_mutex_lock(&s->mu);
            s->ring_cancel = s->stop_flag;
            pthread_mutex_unlock(&s->mu);
            pshard_status_t hrc = shard_heal_wait_formed(s, &rank, &world, &gen, why, sizeof(why));
            if (hrc != PSHARD_OK) {
                shard_set_fatal(s, hrc, why);
                break;
            }
            pthread_mutex_lock(&s->mu);
            bool healing = s->heal_rank >= 0;
            pthread_mutex_unlock(&s->mu);
            if (healing)
                shard_heal_publish(s, gen, serial);
        }
        /* A server that took a lost one's rank: its first ring is the survivors' rebuilt one,
         * under their serial, and its state comes from a replica. */
        bool joining = false;
        if (!old && !rebuild_pending && s->comm_generation == 0) {
            pthread_mutex_lock(&s->mu);
            joining = s->replaces_lost;
            pthread_mutex_unlock(&s->mu);
        }
        if (joining) {
            uint32_t theirs = 0;
            pshard_status_t hrc = shard_heal_join(s, gen, &theirs, why, sizeof(why));
            if (hrc != PSHARD_OK) {
                shard_set_fatal(s, hrc, why);
                break;
            }
            pthread_mutex_lock(&s->mu);
            s->ring_serial = serial = theirs;
            s->session_aborts = theirs; /* its trainer begins after them */
            pthread_mutex_unlock(&s->mu);
        }
        if (old) {
            /* The cluster re-formed: the old ring is not the new one. */
            PS_WARN(PS_SUB_SHARD,
                    "cluster re-formed (generation %" PRIu64 "); rebuilding the "
                    "communicator",
                    gen);
            shard_health_update(s); /* s->comm is NULL now: NOT_SERVING */
            /* Abort first, without op_mu: a trainer operation may hold it inside a collective
             * of the old ring, and only the abort releases it. */
            if (pshard_comm_error(old, NULL, 0) == PSHARD_OK)
                pshard_comm_abort_status(old, PSHARD_ERR_ABORTED,
                                         "the cluster re-formed: this ring is replaced");
            shard_pgs_abort(s, -1, PSHARD_ERR_ABORTED,
                            "the cluster re-formed: the process groups of the old one end");
            shard_trace_check(s, old); /* unless its failure was written already */
            shard_ops_retire_comm(s, old);
        }
        ps_log_set_rank(rank);
        pshard_comm_config_t cc;
        char ring[32] = "shard";
        if (serial > 0) /* a fresh name: no store key or handshake of the failed ring matches */
            snprintf(ring, sizeof(ring), "shard~%u", serial);
        shard_comm_config(s, &cc, ring, rank, world, gen);
        cc.cancel = &s->ring_cancel;
        int64_t own = atomic_load(&s->session_timeout_ms); /* the attached trainer's */
        if (own > 0)
            cc.timeout_ms = own;
        char err[PSHARD_ERRLEN] = "";
        pshard_comm_t *comm = NULL;
        pshard_status_t rc = pshard_comm_create(&cc, &comm, err, sizeof(err));
        if (rc == PSHARD_ERR_RESOURCE_EXHAUSTED || rc == PSHARD_ERR_FAILED_PRECONDITION ||
            rc == PSHARD_ERR_INVALID_ARGUMENT) {
            /* The coordinator's store is full, --transport shm cannot be had, or a setting is
             * wrong (an interface that went away): retrying cannot help, the job must be
             * told. */
            char msg[PSHARD_ERRLEN]; /* cut at PSHARD_ERRLEN like every error message */
            ps_snprintf(msg, sizeof(msg), "cannot build the communicator (rank %d of %d): %s", rank,
                        world, err);
            shard_set_fatal(s, rc, msg);
            break;
        }
        if (rc != PSHARD_OK) {
            PS_WARN(PS_SUB_SHARD, "cannot build the communicator (rank %d of %d): %s; retrying",
                    rank, world, err);
            sleep_ms(500);
            continue;
        }
        if (rebuild_pending || joining) {
            pthread_mutex_lock(&s->mu);
            int64_t lease = s->lease_ms;
            pthread_mutex_unlock(&s->mu);
            int64_t bound = 4 * lease > 10000 ? 4 * lease : 10000;
            int64_t *flags = calloc((size_t)world, sizeof(*flags));
            rc = flags ? reconcile_step(s, comm, serial, bound, flags, err, sizeof(err))
                       : ps_errf(err, sizeof(err), PSHARD_ERR_NO_MEMORY, "out of memory");
            bool heal = false;
            for (int r = 0; rc == PSHARD_OK && r < world; r++)
                heal |= (flags[r] & SHARD_HEAL_HEALING) != 0;
            if (rc == PSHARD_OK) {
                /* An HSDP model's replica and shard rings failed with the world's: new ones,
                 * under new names, as the world's. */
                pthread_mutex_lock(&s->op_mu);
                shard_model_t *m = s->model;
                if (m && m->replicas > 1)
                    rc = shard_mesh_connect(s, m, rank, m->replicas, m->world, m->mesh_attempt,
                                            serial, gen, err, sizeof(err));
                /* Then a lost server's replacement gets its shard from a replica. */
                if (rc == PSHARD_OK && heal)
                    rc = shard_heal_transfer(s, comm, flags, serial, gen, err, sizeof(err));
                pthread_mutex_unlock(&s->op_mu);
            }
            free(flags);
            if (rc == PSHARD_OK && heal)
                heal_done(s);
            if (rc != PSHARD_OK) {
                char msg[PSHARD_ERRLEN];
                ps_snprintf(msg, sizeof(msg),
                            "after the aborted step, the ranks could not go on together: %s", err);
                pshard_comm_destroy(comm);
                shard_set_fatal(s, rc, msg);
                break;
            }
            rebuild_pending = false;
        }
        pthread_mutex_lock(&s->mu);
        s->comm = comm;
        s->comm_generation = gen;
        s->comm_serial = serial;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        shard_health_update(s); /* SERVING unless another reason holds */
        PS_INFO(PS_SUB_SHARD, "rank %d of %d ready (generation %" PRIu64 ")", rank, world, gen);
    }
    return NULL;
}

/* This rank's trainer was lost and --trainer-replace-ms keeps the rank for a replacement: the
 * step in flight aborts on every rank (the ring and this rank's groups fail with STEP_ABORTED,
 * so every server rebuilds its ring and discards the step's gradients, shard_setup_main), and
 * the replacement may attach until the deadline (replace_check). */
static void await_replacement(pshard_shard_server_t *s, int rank, const char *name,
                              const char *cause, bool trainer_optimizer)
{
    char msg[PSHARD_ERRLEN];
    int64_t wait_ms = s->cfg.trainer_replace_ms;
    /* A trainer's own optimizer (torch.optim) may have committed the step before the loss:
     * then it counts on every rank (reconcile_step); else it is rolled back everywhere. */
    snprintf(msg, sizeof(msg),
             "rank %d's trainer %s was lost (%s): the step in flight is aborted on every rank, "
             "%s; its replacement may attach within %lld ms (pshardrun --max-restarts)",
             rank, name, cause,
             trainer_optimizer ? "its gradients discarded and its torch.optim update rolled back "
                                 "unless the lost trainer had committed it (then it counts on "
                                 "every rank: pshard.torch.resync returns the step to go on from)"
                               : "and none of it is applied",
             (long long)wait_ms);
    pthread_mutex_lock(&s->mu);
    s->replace_deadline_ns = ps_now_ns() + wait_ms * 1000000;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (shard_abort_ring(s, PSHARD_ERR_STEP_ABORTED, msg))
        PS_WARN(PS_SUB_SHARD, "%s", msg);
    shard_pgs_abort(s, -1, PSHARD_ERR_STEP_ABORTED, msg);
}

/* What the watch thread remembers of a member between events: enough to name an evicted one. */
typedef struct {
    char name[128];
    int role, rank;
} known_member_t;

/* Handles one ClusterEvent: an eviction of a ranked shard server, or of the trainer attached
 * to this server, fails this rank's collectives with PEER_LOST naming it; the other ranks
 * learn of a trainer's loss through the ring (the abort travels with its reason). Any other
 * trainer member (a monitoring tool, `pshardctl register`, another job's) is not this job's
 * business. The coordinator words evictions as "member NAME lease expired", and a trainer its
 * launcher declared lost as "member NAME lost (WHY)" (coord_state.c). */
static void on_cluster_event(pshard_shard_server_t *s, const Pshard__ClusterEvent *ev,
                             known_member_t **known, size_t *nknown)
{
    const char *suffix = " lease expired";
    const char *reason = ev->reason ? ev->reason : "";
    size_t rl = strlen(reason), sl = strlen(suffix);
    /* "member NAME lease expired", or "member NAME lost (WHY)": a launcher (pshardrun) saw the
     * trainer's process end and said so at once (LeaveRequest.lost). */
    bool member = rl > 7 && memcmp(reason, "member ", 7) == 0;
    const char *lost = member ? strstr(reason + 7, " lost (") : NULL;
    size_t name_end = 0;
    char cause[256] = "";
    if (member && rl > 7 + sl && strcmp(reason + rl - sl, suffix) == 0)
        name_end = rl - sl;
    else if (lost && lost > reason + 7 && reason[rl - 1] == ')') {
        name_end = (size_t)(lost - reason);
        const char *w = lost + 7;
        size_t wl = (size_t)(reason + rl - 1 - w);
        snprintf(cause, sizeof(cause), "%.*s",
                 (int)(wl < sizeof(cause) - 1 ? wl : sizeof(cause) - 1), w);
    }
    if (name_end > 7) {
        char name[128];
        size_t nl = name_end - 7 < sizeof(name) - 1 ? name_end - 7 : sizeof(name) - 1;
        memcpy(name, reason + 7, nl);
        name[nl] = '\0';
        const known_member_t *who = NULL;
        for (size_t i = 0; i < *nknown; i++)
            if (strcmp((*known)[i].name, name) == 0)
                who = &(*known)[i];
        pthread_mutex_lock(&s->mu);
        /* The ring itself only under mu (shard_abort_ring): the setup thread may retire it. */
        bool comm = s->comm != NULL;
        int rank = s->rank;
        int64_t lease = s->lease_ms;
        bool ours = s->session[0] && strcmp(s->trainer_name, name) == 0;
        bool state_lost = s->model && s->model->trainer_optimizer && !s->model->trainer_state_kept;
        const char *why_not =
            !s->model || s->cfg.trainer_replace_ms <= 0 ? ""
            : state_lost ? " (not replaceable: its own optimizer, torch.optim, held state only "
                           "it had; pshard.torch keeps it for a replacement when one "
                           "torch.optim optimizer steps the model on a trainer that maps its "
                           "shard server's memory)"
            : s->model->in_backward ? " (not replaceable: optimizer_in_backward)"
                                    : "";
        /* A replacement can take over only a defined model whose gradients can be discarded
         * (not optimizer_in_backward, which applies them as they come), whose optimizer state
         * survives the trainer (on the servers, or a trainer's own optimizer's kept in shared
         * memory with the values its step began from: trainer_state_kept). Else the job fails
         * as without. */
        bool keep =
            s->cfg.trainer_replace_ms > 0 && s->model && !s->model->in_backward && !state_lost;
        bool trainer_optimizer = s->model && s->model->trainer_optimizer;
        char no_heal[200] = "";
        bool heal = shard_heal_possible(s, no_heal, sizeof(no_heal));
        pthread_mutex_unlock(&s->mu);
        if (!cause[0])
            snprintf(cause, sizeof(cause), "no heartbeat within its %lld ms lease",
                     (long long)lease);
        /* Our own trainer is known by name: a job too large for one event may have left it
         * out of the member lists (members_omitted). */
        bool trainer = ours && (!who || who->role == PSHARD__ROLE__TRAINER);
        bool matters =
            trainer || (who && who->role == PSHARD__ROLE__SHARD_SERVER && who->rank >= 0);
        if (trainer && keep && comm) {
            await_replacement(s, rank, name, cause, trainer_optimizer);
        } else if (!trainer && matters && heal) {
            /* Also without a ring: a peer's abort may have reached this rank first, and the
             * ring it is building now counts on the lost rank (shard_heal_await cancels it). */
            shard_heal_await(s, who->rank, name, cause);
        } else if (matters && comm) {
            char msg[PSHARD_ERRLEN];
            if (trainer)
                snprintf(msg, sizeof(msg),
                         "trainer %s was evicted: %s (it died, hangs or is cut off); rank %d "
                         "stops its collectives%s",
                         name, cause, rank, why_not);
            else
                snprintf(
                    msg, sizeof(msg),
                    "rank %d (shard server %s) was lost: %s (it died, hangs or is cut off)%s%s",
                    who->rank, name, cause, s->cfg.trainer_replace_ms > 0 ? "; not healed: " : "",
                    s->cfg.trainer_replace_ms > 0 ? no_heal : "");
            if (shard_abort_ring(s, PSHARD_ERR_PEER_LOST, msg))
                PS_ERROR(PS_SUB_SHARD, "%s", msg);
            /* Every group holding the lost rank fails too (this rank's trainer: all of this
             * rank's groups); the others go on, as torch's would. */
            shard_pgs_abort(s, trainer ? -1 : who->rank, PSHARD_ERR_PEER_LOST, msg);
        }
    }
    known_member_t *next = calloc(ev->n_members ? ev->n_members : 1, sizeof(*next));
    if (!next)
        return;
    for (size_t i = 0; i < ev->n_members; i++) {
        ps_strlcpy(next[i].name, ev->members[i]->name ? ev->members[i]->name : "",
                   sizeof(next[i].name));
        next[i].role = ev->members[i]->role;
        next[i].rank = ev->members[i]->rank;
    }
    free(*known);
    *known = next;
    *nknown = ev->n_members;
    /* Whether the attached trainer still holds its lease: Attach refuses a second trainer
     * while it does. */
    pthread_mutex_lock(&s->mu);
    bool seen = false;
    for (size_t i = 0; i < ev->n_members && s->trainer_name[0]; i++)
        if (next[i].role == PSHARD__ROLE__TRAINER && strcmp(next[i].name, s->trainer_name) == 0)
            seen = true;
    /* A list cut short says nothing about those it left out. */
    if (seen || ev->members_omitted == 0) {
        if (s->trainer_seen && !seen)
            s->trainer_gone = true; /* no longer attached, whatever the session says */
        s->trainer_seen = seen;
    }
    pthread_mutex_unlock(&s->mu);
    if (ev->members_omitted > 0)
        PS_DEBUG(PS_SUB_SHARD, "Watch event lists %zu members, %u more left out (a large job)",
                 ev->n_members, ev->members_omitted);
}

void *shard_watch_main(void *arg)
{
    pshard_shard_server_t *s = arg;
    known_member_t *known = NULL;
    size_t nknown = 0;
    int fails = 0; /* Watch streams in a row that ended without delivering an event */
    while (!atomic_load(&s->stop)) {
        if (!s->member_id[0]) {
            sleep_ms(50);
            continue;
        }
        Pshard__WatchRequest req = PSHARD__WATCH_REQUEST__INIT;
        char err[PSHARD_ERRLEN] = "";
        bool got = false;
        ps_rpc_stream_t *st =
            ps_coord_watch_open(s->coord, &req, 24LL * 3600 * 1000, err, sizeof(err));
        while (st && !atomic_load(&s->stop)) {
            ProtobufCMessage *msg = NULL;
            err[0] = '\0';
            pshard_status_t rc = ps_rpc_stream_next(st, &pshard__cluster_event__descriptor, &msg,
                                                    100, NULL, err, sizeof(err));
            if (rc == PSHARD_ERR_TIMEOUT)
                continue;
            if (rc != PSHARD_OK || !msg)
                break; /* the coordinator went away or ended the stream: open a new one */
            got = true;
            fails = 0;
            on_cluster_event(s, (const Pshard__ClusterEvent *)msg, &known, &nknown);
            protobuf_c_message_free_unpacked(msg, NULL);
        }
        if (st)
            ps_rpc_stream_close(st);
        /* Failure detection must not switch off silently: a Watch that keeps failing (not a
         * coordinator that merely restarts, which answers again within a few tries) is an
         * error, said again every 50 tries. */
        if (!got && !atomic_load(&s->stop) && (++fails == 5 || fails % 50 == 0))
            PS_ERROR(PS_SUB_SHARD,
                     "cannot follow the coordinator's Watch (%d tries in a row): %s; until it "
                     "works, a lost peer or trainer reaches rank %d only through the ring's own "
                     "timeouts and the lease check",
                     fails, err[0] ? err : "the stream ended", s->rank);
        for (int t = 0; t < 10 && !atomic_load(&s->stop); t++)
            sleep_ms(20);
    }
    free(known);
    return NULL;
}
