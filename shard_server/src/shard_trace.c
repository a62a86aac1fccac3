/* The shard server's flight records as Status carries them, and its trace file on a collective
 * timeout or abort (--trace-dir; shard_trace.h). It calls no other file of the server, so the
 * service and the membership side both reach it one way. */
#include <stdio.h>
#include <stdlib.h>

#include "pshard/coord_client.h"
#include "pshard/flight_json.h"
#include "pshard/log.h"
#include "pshard/util.h"
#include "shard_trace.h"

void shard_flight_read(pshard_comm_t *comm, shard_flight_t *out)
{
    static const char *const states[] = {"queued", "running", "done", "failed"};
    out->n = pshard_comm_flight_records(comm, out->recs, SHARD_FLIGHT_MAX);
    int64_t now = ps_now_ns();
    /* The records' clock is the monotonic one; a trace read beside other hosts' needs the
     * wall clock, which is now's less the time since. */
    double wall_now = (double)ps_wall_ms() / 1e3;
    for (size_t i = 0; i < out->n; i++) {
        const pshard_coll_record_t *r = &out->recs[i];
        pshard_coll_record_format(comm, r, out->text[i], sizeof(out->text[i]));
        out->lines[i] = out->text[i];
        Pshard__FlightRecord *f = &out->fr[i];
        pshard__flight_record__init(f);
        f->rank = pshard_comm_rank(comm);
        f->op = (char *)pshard_coll_op_name(r->op);
        f->seq = r->seq;
        f->state = (unsigned)r->state < 4 ? (char *)states[r->state] : "unknown";
        f->stuck = r->state == PSHARD_COLL_RUNNING && r->waiting_on >= 0;
        f->waiting_on = f->stuck || r->state == PSHARD_COLL_FAILED ? r->waiting_on : -1;
        f->seconds = r->state == PSHARD_COLL_RUNNING && r->start_ns > 0
                         ? (double)(now - r->start_ns) / 1e9
                     : r->state == PSHARD_COLL_DONE ? (double)(r->end_ns - r->start_ns) / 1e9
                                                    : 0;
        f->label = (char *)r->label;
        f->dtype = (char *)pshard_dtype_name(r->dtype);
        f->count = r->total_count;
        f->error = r->state == PSHARD_COLL_FAILED ? (char *)r->error : "";
        f->tag = r->tag;
        if (r->start_ns > 0)
            f->start_time = wall_now - (double)(now - r->start_ns) / 1e9;
        if (r->end_ns > 0 && r->state >= PSHARD_COLL_DONE)
            f->end_time = wall_now - (double)(now - r->end_ns) / 1e9;
        out->records[i] = f;
    }
}

/* Writes the trace of comm (NULL: s->comm) once per comm generation: when it failed (its
 * first error is the reason), or, with asked, whatever its state, because another rank's ring
 * failed. Returns whether a trace was due (written, or its failure logged). */
static bool trace_write(pshard_shard_server_t *s, pshard_comm_t *comm, bool asked)
{
    shard_flight_t *fl = malloc(sizeof(*fl)); /* some 20 KiB: not on a thread's stack */
    if (!fl)
        return false;
    char why[PSHARD_ERRLEN] = "", reason[PSHARD_ERRLEN + 32];
    Pshard__ShardStatusResponse st = PSHARD__SHARD_STATUS_RESPONSE__INIT;
    bool write = false;
    pthread_mutex_lock(&s->mu);
    if (!comm)
        comm = s->comm;
    pshard_status_t failed = comm ? pshard_comm_error(comm, why, sizeof(why)) : PSHARD_OK;
    /* One trace per ring: a ring that failed stays failed until the cluster re-forms, which
     * gives the next one another generation. */
    if (comm && (failed != PSHARD_OK || asked) &&
        !(s->trace_written && s->trace_generation == s->comm_generation)) {
        s->trace_written = true;
        s->trace_generation = s->comm_generation;
        write = true;
        shard_flight_read(comm, fl);
        if (failed != PSHARD_OK)
            ps_snprintf(reason, sizeof(reason), "%s: %s", pshard_status_name(failed), why);
        else
            ps_strlcpy(reason,
                       "asked: another rank's collective failed (timeout or abort) and asked "
                       "every rank for its flight records",
                       sizeof(reason));
        st.name = (char *)s->cfg.name;
        st.rank = pshard_comm_rank(comm);
        st.world_size = pshard_comm_world_size(comm);
        st.generation = s->comm_generation;
        st.backend = (char *)s->cfg.backend;
        st.transport = (char *)pshard_comm_transport(comm);
        st.step = s->model ? s->model->step : 0;
        st.n_records = fl->n;
        st.records = fl->records;
    }
    pthread_mutex_unlock(&s->mu);
    if (write) {
        char err[PSHARD_ERRLEN] = "", path[4096] = "";
        if (ps_trace_write(s->cfg.trace_dir, &st, s->cfg.job, reason, path, sizeof(path), err,
                           sizeof(err)) == PSHARD_OK)
            PS_WARN(PS_SUB_SHARD, "flight records written to %s (%s)", path, reason);
        else if (!atomic_exchange(&s->trace_warned, true))
            PS_ERROR(PS_SUB_SHARD, "cannot write the flight records to --trace-dir: %s", err);
    }
    free(fl);
    return write;
}

void shard_trace_check(pshard_shard_server_t *s, pshard_comm_t *comm)
{
    if (!s->cfg.trace_dir)
        return;
    bool lease = comm == NULL;
    char err[PSHARD_ERRLEN] = "";
    int64_t v = 0;
    if (trace_write(s, comm, false)) {
        /* As torch's watchdog does through its store: ask every other rank for its records
         * too, since the rank that never started the operation has not failed (yet). */
        if (lease && ps_coord_store_incr(s->coord, SHARD_TRACE_REQUEST_KEY, 1, &v, 2000, err,
                                         sizeof(err)) == PSHARD_OK)
            s->trace_request_seen = v;
        return;
    }
    if (!lease)
        return;
    /* An add of 0 reads the counter (0 before any request) without a NOT_FOUND. */
    if (ps_coord_store_incr(s->coord, SHARD_TRACE_REQUEST_KEY, 0, &v, 2000, err, sizeof(err)) !=
        PSHARD_OK)
        return;
    if (s->trace_request_known && v > s->trace_request_seen)
        trace_write(s, NULL, true);
    s->trace_request_known = true;
    s->trace_request_seen = v;
}
