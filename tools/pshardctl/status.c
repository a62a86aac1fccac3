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

/* One shard server asked for its status by its own thread. */
typedef struct {
    const Pshard__Member *member;      /* borrowed from the coordinator's status */
    pshard_status_t rc;                /* PSHARD_OK when resp is set */
    char err[512];                     /* why it could not be asked */
    Pshard__ShardStatusResponse *resp; /* owned; free with protobuf_c_message_free_unpacked */
    pthread_t thread;
    bool started;
} server_probe_t;

/* Asks one shard server for its Status with ctl_opts.server_timeout_ms, with the same token and
 * TLS settings as the coordinator. Runs on its own thread; touches only its probe. */
static void *probe_server_main(void *arg)
{
    server_probe_t *p = arg;
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
                         &pshard__shard_status_response__descriptor, &msg, ctl_opts.server_timeout_ms,
                         0, NULL, p->err, sizeof(p->err));
    if (p->rc == PSHARD_OK)
        p->resp = (Pshard__ShardStatusResponse *)msg;
    ps_rpc_channel_destroy(ch);
    return NULL;
}

/* Asks every shard server in st for its status, PROBE_BATCH at a time in parallel, so that
 * hung or dead servers cost one deadline per batch, not one each. Returns a calloc'd array
 * of *n probes (free with free_probes), or NULL with *n = 0 when there are none or memory
 * ran out. */
static server_probe_t *probe_servers(const Pshard__StatusResponse *st, size_t *n)
{
    *n = 0;
    size_t count = 0;
    for (size_t i = 0; i < st->n_members; i++)
        count += st->members[i]->role == PSHARD__ROLE__SHARD_SERVER;
    if (count == 0 || ctl_opts.server_timeout_ms <= 0)
        return NULL;
    server_probe_t *probes = calloc(count, sizeof(*probes));
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

static void free_probes(server_probe_t *probes, size_t n)
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

static void print_servers_table(FILE *out, const server_probe_t *probes, size_t n)
{
    fprintf(out, "\nshard servers (Status of each, %" PRId64 " ms deadline)\n",
            ctl_opts.server_timeout_ms);
    for (size_t i = 0; i < n; i++) {
        const server_probe_t *p = &probes[i];
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
        if (r->rank != p->member->rank)
            fprintf(out, " (the server says it is rank %d)", r->rank);
        fputc('\n', out);
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
    }
    if (n == 0)
        fprintf(out, "(no shard servers)\n");
}

static void json_servers(FILE *out, const server_probe_t *probes, size_t n)
{
    fputc('[', out);
    for (size_t i = 0; i < n; i++) {
        const server_probe_t *p = &probes[i];
        if (i)
            fputc(',', out);
        fprintf(out, "{\"rank\":%d,\"name\":", p->member->rank);
        ctl_json_cstr(out, p->member->name);
        fputs(",\"address\":", out);
        ctl_json_cstr(out, p->member->address);
        if (p->rc != PSHARD_OK) {
            fputs(",\"reachable\":false,\"error\":", out);
            ctl_json_cstr(out, p->err);
            fprintf(out, ",\"status\":\"%s\"}", pshard_status_name(p->rc));
            continue;
        }
        const Pshard__ShardStatusResponse *r = p->resp;
        fprintf(out,
                ",\"reachable\":true,\"server_rank\":%d,\"world_size\":%d,\"step\":%" PRId64
                ",\"attached\":%s,\"generation\":%" PRIu64 ",\"backend\":",
                r->rank, r->world_size, r->step, r->attached ? "true" : "false", r->generation);
        ctl_json_cstr(out, r->backend);
        fputs(",\"placement\":", out);
        ctl_json_cstr(out, r->placement);
        fputs(",\"stuck\":[", out);
        bool first = true;
        for (size_t k = 0; k < r->n_flight_records; k++) {
            if (!flight_line_is_stuck(r->flight_records[k]))
                continue;
            if (!first)
                fputc(',', out);
            first = false;
            ctl_json_cstr(out, r->flight_records[k]);
        }
        fputs("],\"flight_records\":[", out);
        for (size_t k = 0; k < r->n_flight_records; k++) {
            if (k)
                fputc(',', out);
            ctl_json_cstr(out, r->flight_records[k]);
        }
        fputs("]}", out);
    }
    fputc(']', out);
}

/* status and members. status also asks every shard server for its own status (see
 * probe_servers); a server that does not answer is reported, not an error of the command. */
int cmd_status(bool members_only)
{
    Pshard__StatusRequest req = PSHARD__STATUS_REQUEST__INIT;
    Pshard__StatusResponse *st = NULL;
    int rc = CTL_CALL(status, &req, &st, ctl_opts.timeout_ms);
    if (rc != EXIT_OK)
        return rc;
    size_t nprobes = 0;
    server_probe_t *probes = members_only ? NULL : probe_servers(st, &nprobes);
    if (ctl_opts.json) {
        if (members_only) {
            fputc('[', stdout);
            for (size_t i = 0; i < st->n_members; i++) {
                if (i)
                    fputc(',', stdout);
                ctl_json_member(stdout, st->members[i]);
            }
            fputs("]\n", stdout);
        } else {
            printf("{\"version\":");
            ctl_json_cstr(stdout, st->version);
            fputs(",\"job\":", stdout);
            ctl_json_cstr(stdout, st->job);
            fputs(",\"jobs\":[", stdout);
            for (size_t i = 0; i < st->n_jobs; i++) {
                const Pshard__JobSummary *j = st->jobs[i];
                fputs(i ? ",{\"job\":" : "{\"job\":", stdout);
                ctl_json_cstr(stdout, j->job);
                printf(",\"state\":\"%s\",\"generation\":%" PRIu64 ",\"world_size\":%d,"
                       "\"members\":%u,\"store_keys\":%" PRIu64 ",\"idle_ms\":%" PRId64 "}",
                       ctl_state_name(j->state), j->generation, j->world_size, j->members,
                       j->store_keys, j->idle_ms);
            }
            fputc(']', stdout);
            printf(",\"generation\":%" PRIu64 ",\"formed_generation\":%" PRIu64
                   ",\"state\":\"%s\",\"world_size\":%d,"
                   "\"min_nodes\":%d,\"max_nodes\":%d,\"awaiting\":",
                   st->generation, st->formed_generation, ctl_state_name(st->state), st->world_size,
                   st->min_nodes, st->max_nodes);
            ctl_json_cstr(stdout, st->awaiting);
            printf(",\"last_call_remaining_ms\":%" PRId64 ",\"uptime_ms\":%" PRId64
                   ",\"store_keys\":%" PRIu64 ",\"store_waiters\":%" PRIu64 ",\"lease_ms\":%" PRId64
                   ",\"heartbeat_ms\":%" PRId64 ",\"members\":[",
                   st->last_call_remaining_ms, st->uptime_ms, st->store_keys, st->store_waiters,
                   st->lease_ms, st->heartbeat_ms);
            for (size_t i = 0; i < st->n_members; i++) {
                if (i)
                    fputc(',', stdout);
                ctl_json_member(stdout, st->members[i]);
            }
            fputs("],\"joins\":", stdout);
            ctl_json_joins(stdout, st->joins, st->n_joins);
            printf(",\"last_joiner\":%d,\"servers\":", st->last_joiner);
            json_servers(stdout, probes, nprobes);
            fputs(",\"counters\":[", stdout);
            for (size_t i = 0; i < st->n_counters; i++) {
                if (i)
                    fputc(',', stdout);
                fputs("{\"method\":", stdout);
                ctl_json_cstr(stdout, st->counters[i]->method);
                printf(",\"calls\":%" PRIu64 ",\"errors\":%" PRIu64 "}", st->counters[i]->calls,
                       st->counters[i]->errors);
            }
            fputs("]}\n", stdout);
        }
    } else {
        if (!members_only) {
            printf("coordinator  %s (pshard %s, up %" PRId64 " s)\n", ctl_opts.coordinator, st->version,
                   st->uptime_ms / 1000);
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
    free_probes(probes, nprobes);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    return EXIT_OK;
}

int cmd_health(int argc, char **argv)
{
    if (argc > 1)
        return ctl_fail("health takes at most one SERVICE");
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = argc == 1 ? argv[0] : "";
    ProtobufCMessage *msg = NULL;
    char err[1024] = "";
    int code = 0;
    pshard_status_t rc = ps_rpc_unary(ctl_channel, "/grpc.health.v1.Health/Check", &req.base,
                                      &grpc__health__v1__health_check_response__descriptor, &msg,
                                      ctl_opts.timeout_ms, 0, &code, err, sizeof(err));
    const char *service = *req.service ? req.service : "(server)";
    if (rc == PSHARD_ERR_NOT_FOUND) {
        if (ctl_opts.json)
            printf("{\"service\":\"%s\",\"status\":\"SERVICE_UNKNOWN\"}\n", service);
        else
            printf("%s: SERVICE_UNKNOWN\n", service);
        return EXIT_NOT_SERVING;
    }
    if (rc != PSHARD_OK)
        return ctl_fail("health: %s (%s)", err, pshard_status_name(rc));
    Grpc__Health__V1__HealthCheckResponse *resp = (Grpc__Health__V1__HealthCheckResponse *)msg;
    const char *name = resp->status == 1 ? "SERVING" : resp->status == 2 ? "NOT_SERVING" : "UNKNOWN";
    if (ctl_opts.json) {
        fputs("{\"service\":", stdout);
        ctl_json_cstr(stdout, service);
        printf(",\"status\":\"%s\"}\n", name);
    } else {
        printf("%s: %s\n", service, name);
    }
    int exit_code = resp->status == 1 ? EXIT_OK : EXIT_NOT_SERVING;
    protobuf_c_message_free_unpacked(msg, NULL);
    return exit_code;
}

