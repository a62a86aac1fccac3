/* pshardctl status, members and health: the cluster, its joins and members, and each shard
 * server's own status and flight records (who is stuck where). */

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"

#include "ctl.h"

/* Flight records shown per shard server in the table output (stuck lines first). */
#define FLIGHT_LINES_SHOWN 4
/* Shard servers asked at once by status; more are asked in batches of this many. */
#define PROBE_BATCH 64

/* ---- Shard servers' own status (hang attribution) ----------------------------------------- */

/* Asks one shard server for its Status with ctl_opts.server_timeout_ms, with the same token and
 * TLS settings as the coordinator. Runs on its own thread; touches only its probe. */
static void *probe_server_main(void *arg)
{
    ctl_server_probe_t *p = arg;
    const Pshard__Member *m = p->member;
    if (!m->address || !*m->address) {
        p->rc = PSHARD_ERR_INVALID_ARGUMENT;
        ps_snprintf(p->err, sizeof(p->err), "it registered no address");
        return NULL;
    }
    ps_rpc_channel_config_t cfg = {
        .target = m->address,
        .tls_ca_file = ctl_opts.tls_ca,
        .tls_cert_file = ctl_opts.tls_cert,
        .tls_key_file = ctl_opts.tls_key,
        .tls_server_name = ctl_opts.tls_server_name,
        .token = ctl_token,
        .max_message_bytes = 16 << 20,
        .own_connection = true,
    };
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&cfg, p->err, sizeof(p->err));
    if (!ch) {
        p->rc = PSHARD_ERR_RPC;
        return NULL;
    }
    Pshard__ShardStatusRequest req = PSHARD__SHARD_STATUS_REQUEST__INIT;
    ProtobufCMessage *msg = NULL;
    p->rc = ps_rpc_unary(ch, "/pshard.ShardServer/Status", &req.base,
                         &pshard__shard_status_response__descriptor, &msg,
                         ctl_opts.server_timeout_ms, 0, NULL, p->err, sizeof(p->err));
    if (p->rc == PSHARD_OK)
        p->resp = (Pshard__ShardStatusResponse *)msg;
    ps_rpc_channel_destroy(ch);
    return NULL;
}

/* PROBE_BATCH servers are asked at a time, in parallel (ctl.h). */
ctl_server_probe_t *ctl_probe_servers(const Pshard__StatusResponse *st, size_t *n)
{
    *n = 0;
    size_t count = 0;
    for (size_t i = 0; i < st->n_members; i++)
        count += st->members[i]->role == PSHARD__ROLE__SHARD_SERVER;
    if (count == 0 || ctl_opts.server_timeout_ms <= 0)
        return NULL;
    ctl_server_probe_t *probes = calloc(count, sizeof(*probes));
    if (!probes)
        return NULL;
    size_t k = 0;
    for (size_t i = 0; i < st->n_members; i++)
        if (st->members[i]->role == PSHARD__ROLE__SHARD_SERVER)
            probes[k++].member = st->members[i];
    for (size_t first = 0; first < count; first += PROBE_BATCH) {
        size_t last = first + PROBE_BATCH < count ? first + PROBE_BATCH : count;
        for (size_t i = first; i < last; i++) {
            probes[i].started =
                pthread_create(&probes[i].thread, NULL, probe_server_main, &probes[i]) == 0;
            if (!probes[i].started)
                probe_server_main(&probes[i]); /* no thread: ask it here */
        }
        for (size_t i = first; i < last; i++)
            if (probes[i].started)
                pthread_join(probes[i].thread, NULL);
    }
    *n = count;
    return probes;
}

void ctl_free_probes(ctl_server_probe_t *probes, size_t n)
{
    for (size_t i = 0; probes && i < n; i++)
        if (probes[i].resp)
            protobuf_c_message_free_unpacked(&probes[i].resp->base, NULL);
    free(probes);
}

/* True for the flight recorder's line about a collective blocked on a peer. */
static bool flight_line_is_stuck(const char *line)
{
    return strstr(line, " is stuck in ") != NULL;
}

/* "rank 2" for a ranked server, "standby NAME" for one without a rank. */
static void server_label(const Pshard__Member *m, char *buf, size_t len)
{
    if (m->rank >= 0)
        ps_snprintf(buf, len, "rank %d", m->rank);
    else
        ps_snprintf(buf, len, "standby %s", m->name);
}

static void print_servers_table(FILE *out, const ctl_server_probe_t *probes, size_t n)
{
    fprintf(out, "\nshard servers (Status of each, %" PRId64 " ms deadline)\n",
            ctl_opts.server_timeout_ms);
    for (size_t i = 0; i < n; i++) {
        const ctl_server_probe_t *p = &probes[i];
        char label[300];
        server_label(p->member, label, sizeof(label));
        const char *addr = *p->member->address ? p->member->address : "no address";
        if (p->rc != PSHARD_OK) {
            fprintf(out, "%s (%s): unreachable: %s (%s)\n", label, addr, p->err,
                    pshard_status_name(p->rc));
            continue;
        }
        const Pshard__ShardStatusResponse *r = p->resp;
        fprintf(out, "%s (%s): step %" PRId64 ", %s, generation %" PRIu64, label, addr, r->step,
                r->attached ? "attached" : "not attached", r->generation);
        if (*r->backend)
            fprintf(out, ", %s", r->backend);
        if (*r->placement)
            fprintf(out, ", shards in %s", r->placement);
        if (*r->transport)
            fprintf(out, ", data over %s", r->transport);
        if (r->device_staged_to_host || r->device_staged_to_device)
            fprintf(out, ", %.1f MiB copied between host and GPU memory",
                    (double)(r->device_staged_to_host + r->device_staged_to_device) / 1048576.0);
        if (r->rank != p->member->rank)
            fprintf(out, " (the server says it is rank %d)", r->rank);
        fputc('\n', out);
        if (*r->heal)
            fprintf(out, "    heal: %s\n", r->heal);
        /* Stuck lines first, then the most recent others, oldest of those first. */
        size_t shown = 0;
        for (size_t k = 0; k < r->n_flight_records && shown < FLIGHT_LINES_SHOWN; k++) {
            if (flight_line_is_stuck(r->flight_records[k])) {
                fprintf(out, "    %s\n", r->flight_records[k]);
                shown++;
            }
        }
        size_t others = 0;
        for (size_t k = 0; k < r->n_flight_records; k++)
            others += !flight_line_is_stuck(r->flight_records[k]);
        size_t room = FLIGHT_LINES_SHOWN - shown;
        size_t skip = others > room ? others - room : 0;
        for (size_t k = 0; k < r->n_flight_records; k++) {
            if (flight_line_is_stuck(r->flight_records[k]))
                continue;
            if (skip > 0) {
                skip--;
                continue;
            }
            fprintf(out, "    %s\n", r->flight_records[k]);
        }
        if (r->n_flight_records == 0)
            fprintf(out, "    (no collectives recorded)\n");
        for (size_t k = 0; k < r->n_groups; k++)
            fprintf(out, "    %s\n", r->groups[k]);
    }
    if (n == 0)
        fprintf(out, "(no shard servers)\n");
}

/* Appends s to array a; false (a freed) without memory. */
static bool append(json_t *a, json_t *v)
{
    return json_array_append_new(a, v) == 0;
}

static json_t *json_servers(const ctl_server_probe_t *probes, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++) {
        const ctl_server_probe_t *p = &probes[i];
        json_t *o = json_pack("{s:i,s:o,s:o,s:b}", "rank", p->member->rank, "name",
                              ctl_jstr(p->member->name), "address", ctl_jstr(p->member->address),
                              "reachable", p->rc == PSHARD_OK);
        if (o && p->rc != PSHARD_OK) {
            json_t *why = json_pack("{s:o,s:s}", "error", ctl_jstr(p->err), "status",
                                    pshard_status_name(p->rc));
            if (!why || json_object_update(o, why) != 0)
                json_decref(o), o = NULL;
            json_decref(why);
        } else if (o) {
            const Pshard__ShardStatusResponse *r = p->resp;
            json_t *stuck = json_array(), *records = json_array(), *groups = json_array();
            for (size_t k = 0; stuck && records && k < r->n_records; k++) {
                const Pshard__FlightRecord *f = r->records[k];
                if (!append(records, ps_flight_record_json(f)) ||
                    (f->stuck && !append(stuck, ps_flight_record_json(f))))
                    break;
            }
            for (size_t k = 0; groups && k < r->n_groups; k++)
                if (!append(groups, ctl_jstr(r->groups[k])))
                    break;
            json_t *more = json_pack(
                "{s:i,s:i,s:I,s:b,s:I,s:o,s:o,s:o,s:o,s:o,s:o,s:o}", "server_rank", r->rank,
                "world_size", r->world_size, "step", (json_int_t)r->step, "attached", r->attached,
                "generation", (json_int_t)r->generation, "backend", ctl_jstr(r->backend),
                "placement", ctl_jstr(r->placement), "transport", ctl_jstr(r->transport), "stuck",
                stuck, "flight_records", records, "groups", groups, "heal", ctl_jstr(r->heal));
            if (!more || json_object_update(o, more) != 0)
                json_decref(o), o = NULL;
            json_decref(more);
            json_t *staged = o ? json_pack("{s:{s:I,s:I}}", "device_staged_bytes", "to_host",
                                           (json_int_t)r->device_staged_to_host, "to_device",
                                           (json_int_t)r->device_staged_to_device)
                               : NULL;
            if (o && (!staged || json_object_update(o, staged) != 0))
                json_decref(o), o = NULL;
            json_decref(staged);
        }
        if (!o || !append(a, o)) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

static json_t *json_jobs(const Pshard__StatusResponse *st)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < st->n_jobs; i++) {
        const Pshard__JobSummary *j = st->jobs[i];
        if (!append(a,
                    json_pack("{s:o,s:s,s:I,s:i,s:i,s:I,s:I}", "job", ctl_jstr(j->job), "state",
                              ctl_state_name(j->state), "generation", (json_int_t)j->generation,
                              "world_size", j->world_size, "members", (int)j->members, "store_keys",
                              (json_int_t)j->store_keys, "idle_ms", (json_int_t)j->idle_ms))) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

static json_t *json_counters(const Pshard__StatusResponse *st)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < st->n_counters; i++) {
        const Pshard__MethodCounter *c = st->counters[i];
        if (!append(a, json_pack("{s:o,s:I,s:I}", "method", ctl_jstr(c->method), "calls",
                                 (json_int_t)c->calls, "errors", (json_int_t)c->errors))) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

/* The slowest rank and every rank's step figures (README, "Who is slow"), as JSON. */
static json_t *json_straggler(const Pshard__StatusResponse *st)
{
    json_t *ranks = json_array();
    for (size_t i = 0; ranks && i < st->n_members; i++) {
        const Pshard__Member *m = st->members[i];
        const Pshard__StepSummary *s = m->steps;
        if (!s || m->rank < 0)
            continue;
        if (!append(ranks, json_pack("{s:i,s:o,s:i,s:I,s:f,s:f,s:f}", "rank", m->rank, "name",
                                     ctl_jstr(m->name), "window", (int)s->window, "steps",
                                     (json_int_t)s->steps, "step_seconds", s->step_seconds,
                                     "compute_seconds", s->compute_seconds, "wait_seconds",
                                     s->wait_seconds))) {
            json_decref(ranks);
            return NULL;
        }
    }
    const Pshard__Straggler *g = st->straggler;
    if (!g || g->rank < 0)
        return json_pack("{s:n,s:o}", "rank", "ranks", ranks);
    return json_pack("{s:i,s:o,s:f,s:f,s:f,s:i,s:i,s:f,s:b,s:o}", "rank", g->rank, "name",
                     ctl_jstr(g->name), "ratio", g->ratio, "compute_seconds", g->compute_seconds,
                     "median_compute_seconds", g->median_compute_seconds, "window", (int)g->window,
                     "ranks_compared", (int)g->ranks, "threshold", g->threshold, "slow", g->slow,
                     "ranks", ranks);
}

/* "slowest      rank 3 (shard-3) is 1.80x the median step compute ..." and one line per rank
 * with step figures; nothing before any rank has them. */
static void print_straggler(FILE *out, const Pshard__StatusResponse *st)
{
    const Pshard__Straggler *g = st->straggler;
    bool any = false;
    for (size_t i = 0; i < st->n_members; i++)
        any |= st->members[i]->steps != NULL && st->members[i]->rank >= 0;
    if (!any)
        return;
    if (g && g->rank >= 0)
        fprintf(out,
                "slowest      rank %d (%s) is %.2fx the median step compute over the last %u "
                "steps (%.3f s against %.3f s)%s\n",
                g->rank, g->name, g->ratio, g->window, g->compute_seconds,
                g->median_compute_seconds, g->slow ? ": SLOW (--straggler-ratio)" : "");
    else
        fprintf(out, "slowest      not known yet: two ranks need enough steps to compare\n");
    for (size_t i = 0; i < st->n_members; i++) {
        const Pshard__Member *m = st->members[i];
        const Pshard__StepSummary *s = m->steps;
        if (!s || m->rank < 0)
            continue;
        fprintf(out,
                "  rank %-4d  step %.3f s  compute %.3f s  wait %.3f s  (medians of %u steps, "
                "%" PRIu64 " in all)\n",
                m->rank, s->step_seconds, s->compute_seconds, s->wait_seconds, s->window, s->steps);
    }
}

/* status and members. status also asks every shard server for its own status (see
 * ctl_probe_servers); a server that does not answer is reported, not an error of the command. */
int cmd_status(bool members_only)
{
    Pshard__StatusRequest req = PSHARD__STATUS_REQUEST__INIT;
    Pshard__StatusResponse *st = NULL;
    int rc = CTL_CALL(status, &req, &st, ctl_opts.timeout_ms);
    if (rc != EXIT_OK)
        return rc;
    size_t nprobes = 0;
    ctl_server_probe_t *probes = members_only ? NULL : ctl_probe_servers(st, &nprobes);
    if (ctl_opts.json) {
        json_t *v;
        if (members_only) {
            v = ctl_json_members(st->members, st->n_members);
        } else {
            v = json_pack("{s:o,s:o,s:o,s:I,s:I,s:s,s:i,s:i,s:i,s:o,s:I,s:I,s:I,s:I,s:I,s:I}",
                          "version", ctl_jstr(st->version), "job", ctl_jstr(st->job), "jobs",
                          json_jobs(st), "generation", (json_int_t)st->generation,
                          "formed_generation", (json_int_t)st->formed_generation, "state",
                          ctl_state_name(st->state), "world_size", st->world_size, "min_nodes",
                          st->min_nodes, "max_nodes", st->max_nodes, "awaiting",
                          ctl_jstr(st->awaiting), "last_call_remaining_ms",
                          (json_int_t)st->last_call_remaining_ms, "uptime_ms",
                          (json_int_t)st->uptime_ms, "store_keys", (json_int_t)st->store_keys,
                          "store_waiters", (json_int_t)st->store_waiters, "lease_ms",
                          (json_int_t)st->lease_ms, "heartbeat_ms", (json_int_t)st->heartbeat_ms);
            json_t *rest = json_pack(
                "{s:o,s:o,s:i,s:o,s:o}", "members", ctl_json_members(st->members, st->n_members),
                "joins", ctl_json_joins(st->joins, st->n_joins), "last_joiner", st->last_joiner,
                "servers", json_servers(probes, nprobes), "counters", json_counters(st));
            if (rest && json_object_set_new(rest, "straggler", json_straggler(st)) != 0) {
                json_decref(rest);
                rest = NULL;
            }
            if (v && (!rest || json_object_update(v, rest) != 0)) {
                json_decref(v);
                v = NULL;
            }
            json_decref(rest);
        }
        rc = ctl_json_print(v);
    } else {
        if (!members_only) {
            printf("coordinator  %s (pshard %s, up %" PRId64 " s)\n", ctl_opts.coordinator,
                   st->version, st->uptime_ms / 1000);
            printf("job          %s%s\n", st->job,
                   st->n_jobs > 1 ? "" : " (the only one on this coordinator)");
            printf("cluster      %s, generation %" PRIu64 "\n", ctl_state_name(st->state),
                   st->generation);
            if (st->min_nodes == st->max_nodes)
                printf("world size   %d (expected %d)\n", st->world_size, st->max_nodes);
            else
                printf("world size   %d (expected %d:%d)\n", st->world_size, st->min_nodes,
                       st->max_nodes);
            if (*st->awaiting)
                printf("awaiting     %s\n", st->awaiting);
            printf("leases       %" PRId64 " ms, heartbeat every %" PRId64 " ms\n", st->lease_ms,
                   st->heartbeat_ms);
            printf("store        %" PRIu64 " keys, %" PRIu64 " waiting\n", st->store_keys,
                   st->store_waiters);
            print_straggler(stdout, st);
            ctl_print_joins(stdout, st);
            if (st->n_jobs > 1) {
                printf("jobs         %zu on this coordinator (unused ones end after %" PRId64
                       " s)\n",
                       st->n_jobs, st->job_linger_ms / 1000);
                printf("  %-24s %-9s %10s %6s %7s %6s\n", "JOB", "STATE", "GENERATION", "WORLD",
                       "MEMBERS", "KEYS");
                for (size_t i = 0; i < st->n_jobs; i++) {
                    const Pshard__JobSummary *j = st->jobs[i];
                    printf("  %-24s %-9s %10" PRIu64 " %6d %7u %6" PRIu64 "%s\n", j->job,
                           ctl_state_name(j->state), j->generation, j->world_size, j->members,
                           j->store_keys, strcmp(j->job, st->job) == 0 ? "  <- this one" : "");
                }
            }
            fputc('\n', stdout);
        }
        ctl_print_members(stdout, st->members, st->n_members);
        if (!members_only) {
            if (ctl_opts.server_timeout_ms > 0)
                print_servers_table(stdout, probes, nprobes);
            printf("\n%-40s %10s %8s\n", "METHOD", "CALLS", "ERRORS");
            for (size_t i = 0; i < st->n_counters; i++) {
                if (st->counters[i]->calls == 0)
                    continue;
                printf("%-40s %10" PRIu64 " %8" PRIu64 "\n", st->counters[i]->method,
                       st->counters[i]->calls, st->counters[i]->errors);
            }
        }
    }
    /* A degraded cluster (a rank gone, or a shard server not serving) is not healthy. */
    if (rc == EXIT_OK && !members_only && st->state == PSHARD__CLUSTER_STATE__DEGRADED)
        rc = EXIT_NOT_SERVING;
    ctl_free_probes(probes, nprobes);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    return rc;
}

/* One health check: 1 SERVING, 2 NOT_SERVING, 0 UNKNOWN, -1 no such service; -2 failed
 * (printed). */
static int check_health(const char *service)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)service;
    ProtobufCMessage *msg = NULL;
    char err[PSHARD_ERRLEN] = "";
    int code = 0;
    pshard_status_t rc = ps_rpc_unary(ctl_channel, "/grpc.health.v1.Health/Check", &req.base,
                                      &grpc__health__v1__health_check_response__descriptor, &msg,
                                      ctl_opts.timeout_ms, 0, &code, err, sizeof(err));
    if (rc == PSHARD_ERR_NOT_FOUND)
        return -1;
    if (rc != PSHARD_OK) {
        ctl_fail("health: %s (%s)", err, pshard_status_name(rc));
        return -2;
    }
    int status = ((Grpc__Health__V1__HealthCheckResponse *)msg)->status;
    protobuf_c_message_free_unpacked(msg, NULL);
    return status == 1 || status == 2 ? status : 0;
}

static const char *health_name(int status)
{
    return status == 1    ? "SERVING"
           : status == 2  ? "NOT_SERVING"
           : status == -1 ? "SERVICE_UNKNOWN"
                          : "UNKNOWN";
}

/* health SERVICE: that service. health: the server's overall status and each pshard service
 * it has (the coordinator's pshard.Cluster, a shard server's pshard.ShardServer), so a live
 * process whose cluster or shard service cannot serve is not reported healthy. */
int cmd_health(int argc, char **argv)
{
    if (argc > 1)
        return ctl_fail("health takes at most one SERVICE");
    static const char *const all[] = {"", "pshard.Coordinator", "pshard.Cluster",
                                      "pshard.ShardServer"};
    const char *one[] = {argc == 1 ? argv[0] : ""};
    const char *const *services = argc == 1 ? one : all;
    size_t n = argc == 1 ? 1 : PS_ARRAY_LEN(all);
    json_t *list = ctl_opts.json ? json_array() : NULL;
    int exit_code = EXIT_OK, worst = 1;
    const char *worst_service = "(server)";
    for (size_t i = 0; i < n; i++) {
        int st = check_health(services[i]);
        if (st == -2) {
            json_decref(list);
            return EXIT_ERROR;
        }
        if (st == -1 && argc == 0)
            continue; /* a service this server does not have */
        const char *service = *services[i] ? services[i] : "(server)";
        if (st != 1) {
            exit_code = EXIT_NOT_SERVING;
            if (worst == 1) {
                worst = st;
                worst_service = service;
            }
        }
        if (list)
            json_array_append_new(list, json_pack("{s:o,s:s}", "service", ctl_jstr(service),
                                                  "status", health_name(st)));
        else
            printf("%s: %s\n", service, health_name(st));
    }
    if (list)
        ctl_json_print(json_pack("{s:o,s:s,s:o}", "service", ctl_jstr(worst_service), "status",
                                 health_name(worst), "services", list));
    return exit_code;
}
