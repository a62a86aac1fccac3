/* pshardctl: the operator's command line for a pshard cluster. It asks a coordinator for
 * status (with the Join table, and each shard server's own status and flight records, to see
 * who is stuck where), members, health, store entries and the Watch stream, can register
 * a member by hand, and handles checkpoints: list, verify and export them offline, or ask the
 * running cluster to save one. Tables for people, --json for scripts; exit 0 ok, 1 not
 * serving or failed (a corrupt checkpoint, a save that failed), 2 error. */
#include <dirent.h>
#include <inttypes.h>
#include <stdarg.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "grpc/health/v1/health.pb-c.h"
#include "pshard/ckpt.h"
#include "pshard/config.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/rpc.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"

#define EXIT_OK 0
#define EXIT_NOT_SERVING 1
#define EXIT_ERROR 2

/* Flight records shown per shard server in the table output (stuck lines first). */
#define FLIGHT_LINES_SHOWN 4
/* Shard servers asked at once by status; more are asked in batches of this many. */
#define PROBE_BATCH 64

typedef struct {
    char *coordinator;
    char *token_file;
    char *tls_ca;
    char *tls_cert;
    char *tls_key;
    char *tls_server_name;
    char *job;
    int64_t timeout_ms;
    int64_t server_timeout_ms;
    bool json;
} ctl_opts_t;

#define GOPT(flag, env, type, def, help, field, lo, hi)                                            \
    {flag, env, type, def, help, offsetof(ctl_opts_t, field), lo, hi}

static const ps_option_t global_options[] = {
    GOPT("coordinator", "PSHARD_COORDINATOR", PS_OPT_STRING, NULL,
         "coordinator HOST:PORT (default MASTER_ADDR:MASTER_PORT, else 127.0.0.1:29500)",
         coordinator, 0, 0),
    GOPT("token-file", "PSHARD_TOKEN_FILE", PS_OPT_STRING, NULL, "file holding the cluster token",
         token_file, 0, 0),
    GOPT("tls-ca", "PSHARD_TLS_CA", PS_OPT_STRING, NULL, "PEM CA that signed the server's cert",
         tls_ca, 0, 0),
    GOPT("tls-cert", "PSHARD_TLS_CERT", PS_OPT_STRING, NULL, "PEM client certificate (mTLS)",
         tls_cert, 0, 0),
    GOPT("tls-key", "PSHARD_TLS_KEY", PS_OPT_STRING, NULL, "PEM key of --tls-cert", tls_key, 0,
         0),
    GOPT("tls-server-name", "PSHARD_TLS_SERVER_NAME", PS_OPT_STRING, NULL,
         "name the server certificate must carry, if not the address's host", tls_server_name, 0,
         0),
    GOPT("job", "PSHARD_JOB", PS_OPT_STRING, NULL,
         "the job to look at or act in (torchrun's --rdzv-id; default: the coordinator's "
         "job \"default\")",
         job, 0, 0),
    GOPT("timeout-ms", "PSHARD_TIMEOUT_MS", PS_OPT_INT, "5000", "deadline of each call",
         timeout_ms, 1, 86400000),
    GOPT("server-timeout-ms", "PSHARD_SERVER_TIMEOUT_MS", PS_OPT_INT, "2000",
         "deadline of each shard server's Status call in 'status' (0: do not ask the servers)",
         server_timeout_ms, 0, 86400000),
    GOPT("json", NULL, PS_OPT_BOOL, "false", "print JSON instead of tables", json, 0, 0),
};

static const char usage_text[] =
    "commands:\n"
    "  status                      cluster state, joins, members, each shard server's step\n"
    "                              and flight records (who is stuck where), request counters\n"
    "  members                     the member table only\n"
    "  health [SERVICE]            health of the coordinator or of SERVICE (e.g. pshard.Cluster)\n"
    "  store get KEY               print a store value\n"
    "  store set KEY VALUE         set a store value\n"
    "  store delete KEY            delete a store value (torch's delete_key)\n"
    "  store add KEY DELTA         add to an integer value and print the result\n"
    "  store wait KEY...           wait until every KEY exists (--timeout-ms bounds it)\n"
    "  watch [--count N]           print cluster changes as they happen\n"
    "  register --role ROLE --name NAME [--address A] [--node N] [--device D] [--hold]\n"
    "                              register a member; --hold heartbeats until interrupted\n"
    "  checkpoint list [--verify] [--checkpoint-dir DIR]\n"
    "                              committed checkpoints under DIR (offline); --verify checks\n"
    "                              every shard file's CRC-32C and exits 1 on corruption\n"
    "  checkpoint export [--format safetensors] [--dtype fp32|bf16] [--step N]\n"
    "                    [--checkpoint-dir DIR] OUT\n"
    "                              master weights of a checkpoint (default the newest) as one\n"
    "                              safetensors file (offline; every file is verified first)\n"
    "  checkpoint save [--timeout-ms T]\n"
    "                              ask the running shard servers to save a checkpoint after\n"
    "                              their next optimizer step, and wait for it (default 10 min)\n"
    "  (DIR defaults to $PSHARD_CHECKPOINT_DIR; 'checkpoint SUBCOMMAND --help' for details)\n";

static ctl_opts_t opts;
static ps_rpc_channel_t *channel;
static char *cluster_token; /* from --token-file; sent to the coordinator and shard servers */

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("pshardctl: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return EXIT_ERROR;
}

/* Writes s as a JSON string literal. */
static void json_str(FILE *out, const char *s, size_t len)
{
    fputc('"', out);
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\')
            fprintf(out, "\\%c", ch);
        else if (ch == '\n')
            fputs("\\n", out);
        else if (ch < 0x20 || ch == 0x7f)
            fprintf(out, "\\u%04x", ch);
        else
            fputc(ch, out);
    }
    fputc('"', out);
}

static void json_cstr(FILE *out, const char *s)
{
    json_str(out, s ? s : "", s ? strlen(s) : 0);
}

static const char *state_name(Pshard__ClusterState s)
{
    switch (s) {
    case PSHARD__CLUSTER_STATE__FORMING:
        return "forming";
    case PSHARD__CLUSTER_STATE__FORMED:
        return "formed";
    case PSHARD__CLUSTER_STATE__DEGRADED:
        return "degraded";
    default:
        return "unknown";
    }
}

static const char *role_name(Pshard__Role r)
{
    return r == PSHARD__ROLE__SHARD_SERVER ? "shard_server"
           : r == PSHARD__ROLE__TRAINER    ? "trainer"
                                           : "unknown";
}

static void json_member(FILE *out, const Pshard__Member *m)
{
    fputs("{\"member_id\":", out);
    json_cstr(out, m->member_id);
    fprintf(out, ",\"role\":\"%s\",\"name\":", role_name(m->role));
    json_cstr(out, m->name);
    fprintf(out, ",\"rank\":%d,\"address\":", m->rank);
    json_cstr(out, m->address);
    fputs(",\"node\":", out);
    json_cstr(out, m->node);
    fputs(",\"device\":", out);
    json_cstr(out, m->device);
    fprintf(out,
            ",\"lease_remaining_ms\":%" PRId64 ",\"last_heartbeat_ms_ago\":%" PRId64
            ",\"registered_generation\":%" PRIu64 "}",
            m->lease_remaining_ms, m->last_heartbeat_ms_ago, m->registered_generation);
}

static void print_members_table(FILE *out, Pshard__Member **members, size_t n)
{
    fprintf(out, "%-5s %-13s %-24s %-22s %-12s %-8s %9s %8s\n", "RANK", "ROLE", "NAME", "ADDRESS",
            "NODE", "DEVICE", "LEASE_MS", "LAST_HB");
    for (size_t i = 0; i < n; i++) {
        const Pshard__Member *m = members[i];
        char rank[16];
        if (m->rank >= 0)
            snprintf(rank, sizeof(rank), "%d", m->rank);
        else
            snprintf(rank, sizeof(rank), "-");
        fprintf(out, "%-5s %-13s %-24s %-22s %-12s %-8s %9" PRId64 " %6" PRId64 "ms\n", rank,
                role_name(m->role), m->name, *m->address ? m->address : "-",
                *m->node ? m->node : "-", *m->device ? m->device : "-", m->lease_remaining_ms,
                m->last_heartbeat_ms_ago);
    }
    if (n == 0)
        fprintf(out, "(no members)\n");
}

static int call(const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp, unsigned flags,
                int64_t timeout_ms)
{
    char err[1024] = "";
    char path[128];
    snprintf(path, sizeof(path), "/pshard.Coordinator/%s", method);
    pshard_status_t rc =
        ps_rpc_unary(channel, path, req, desc, resp, timeout_ms, flags, NULL, err, sizeof(err));
    if (rc != PSHARD_OK)
        return fail("%s: %s (%s)", method, err, pshard_status_name(rc));
    return EXIT_OK;
}

/* ---- Join table ------------------------------------------------------------------------ */

static void json_joins(FILE *out, Pshard__JoinEntry **joins, size_t n)
{
    fputc('[', out);
    for (size_t i = 0; i < n; i++) {
        const Pshard__JoinEntry *j = joins[i];
        if (i)
            fputc(',', out);
        fprintf(out, "{\"rank\":%d,\"member_id\":", j->rank);
        json_cstr(out, j->member_id);
        fprintf(out,
                ",\"step\":%" PRId64 ",\"joined_ms_ago\":%" PRId64
                ",\"throw_on_early_termination\":%s}",
                j->step, j->joined_ms_ago, j->throw_on_early_termination ? "true" : "false");
    }
    fputc(']', out);
}

static void print_joins_table(FILE *out, const Pshard__StatusResponse *st)
{
    if (st->n_joins == 0) {
        fprintf(out, "joins        none\n");
    } else {
        fprintf(out, "joins        %zu of %d rank%s joined\n", st->n_joins, st->world_size,
                st->world_size == 1 ? "" : "s");
        fprintf(out, "  %-5s %12s %12s  %s\n", "RANK", "STEP", "JOINED_AGO", "THROW");
        for (size_t i = 0; i < st->n_joins; i++) {
            const Pshard__JoinEntry *j = st->joins[i];
            fprintf(out, "  %-5d %12" PRId64 " %10.1f s  %s\n", j->rank, j->step,
                    (double)j->joined_ms_ago / 1000.0,
                    j->throw_on_early_termination ? "yes" : "no");
        }
    }
    if (st->last_joiner >= 0)
        fprintf(out, "last joiner  rank %d\n", st->last_joiner);
    else
        fprintf(out, "last joiner  none\n");
}

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

/* Asks one shard server for its Status with opts.server_timeout_ms, with the same token and
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
        .tls_ca_file = opts.tls_ca,
        .tls_cert_file = opts.tls_cert,
        .tls_key_file = opts.tls_key,
        .tls_server_name = opts.tls_server_name,
        .token = cluster_token,
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
                         &pshard__shard_status_response__descriptor, &msg, opts.server_timeout_ms,
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
    if (count == 0 || opts.server_timeout_ms <= 0)
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
            opts.server_timeout_ms);
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
        json_cstr(out, p->member->name);
        fputs(",\"address\":", out);
        json_cstr(out, p->member->address);
        if (p->rc != PSHARD_OK) {
            fputs(",\"reachable\":false,\"error\":", out);
            json_cstr(out, p->err);
            fprintf(out, ",\"status\":\"%s\"}", pshard_status_name(p->rc));
            continue;
        }
        const Pshard__ShardStatusResponse *r = p->resp;
        fprintf(out,
                ",\"reachable\":true,\"server_rank\":%d,\"world_size\":%d,\"step\":%" PRId64
                ",\"attached\":%s,\"generation\":%" PRIu64 ",\"backend\":",
                r->rank, r->world_size, r->step, r->attached ? "true" : "false", r->generation);
        json_cstr(out, r->backend);
        fputs(",\"placement\":", out);
        json_cstr(out, r->placement);
        fputs(",\"stuck\":[", out);
        bool first = true;
        for (size_t k = 0; k < r->n_flight_records; k++) {
            if (!flight_line_is_stuck(r->flight_records[k]))
                continue;
            if (!first)
                fputc(',', out);
            first = false;
            json_cstr(out, r->flight_records[k]);
        }
        fputs("],\"flight_records\":[", out);
        for (size_t k = 0; k < r->n_flight_records; k++) {
            if (k)
                fputc(',', out);
            json_cstr(out, r->flight_records[k]);
        }
        fputs("]}", out);
    }
    fputc(']', out);
}

/* status and members. status also asks every shard server for its own status (see
 * probe_servers); a server that does not answer is reported, not an error of the command. */
static int cmd_status(bool members_only)
{
    Pshard__StatusRequest req = PSHARD__STATUS_REQUEST__INIT;
    ProtobufCMessage *msg = NULL;
    int rc = call("Status", &req.base, &pshard__status_response__descriptor, &msg,
                  PS_RPC_IDEMPOTENT, opts.timeout_ms);
    if (rc != EXIT_OK)
        return rc;
    Pshard__StatusResponse *st = (Pshard__StatusResponse *)msg;
    size_t nprobes = 0;
    server_probe_t *probes = members_only ? NULL : probe_servers(st, &nprobes);
    if (opts.json) {
        if (members_only) {
            fputc('[', stdout);
            for (size_t i = 0; i < st->n_members; i++) {
                if (i)
                    fputc(',', stdout);
                json_member(stdout, st->members[i]);
            }
            fputs("]\n", stdout);
        } else {
            printf("{\"version\":");
            json_cstr(stdout, st->version);
            fputs(",\"job\":", stdout);
            json_cstr(stdout, st->job);
            fputs(",\"jobs\":[", stdout);
            for (size_t i = 0; i < st->n_jobs; i++) {
                const Pshard__JobSummary *j = st->jobs[i];
                fputs(i ? ",{\"job\":" : "{\"job\":", stdout);
                json_cstr(stdout, j->job);
                printf(",\"state\":\"%s\",\"generation\":%" PRIu64 ",\"world_size\":%d,"
                       "\"members\":%u,\"store_keys\":%" PRIu64 ",\"idle_ms\":%" PRId64 "}",
                       state_name(j->state), j->generation, j->world_size, j->members,
                       j->store_keys, j->idle_ms);
            }
            fputc(']', stdout);
            printf(",\"generation\":%" PRIu64 ",\"formed_generation\":%" PRIu64
                   ",\"state\":\"%s\",\"world_size\":%d,"
                   "\"min_nodes\":%d,\"max_nodes\":%d,\"awaiting\":",
                   st->generation, st->formed_generation, state_name(st->state), st->world_size,
                   st->min_nodes, st->max_nodes);
            json_cstr(stdout, st->awaiting);
            printf(",\"last_call_remaining_ms\":%" PRId64 ",\"uptime_ms\":%" PRId64
                   ",\"store_keys\":%" PRIu64 ",\"store_waiters\":%" PRIu64 ",\"lease_ms\":%" PRId64
                   ",\"heartbeat_ms\":%" PRId64 ",\"members\":[",
                   st->last_call_remaining_ms, st->uptime_ms, st->store_keys, st->store_waiters,
                   st->lease_ms, st->heartbeat_ms);
            for (size_t i = 0; i < st->n_members; i++) {
                if (i)
                    fputc(',', stdout);
                json_member(stdout, st->members[i]);
            }
            fputs("],\"joins\":", stdout);
            json_joins(stdout, st->joins, st->n_joins);
            printf(",\"last_joiner\":%d,\"servers\":", st->last_joiner);
            json_servers(stdout, probes, nprobes);
            fputs(",\"counters\":[", stdout);
            for (size_t i = 0; i < st->n_counters; i++) {
                if (i)
                    fputc(',', stdout);
                fputs("{\"method\":", stdout);
                json_cstr(stdout, st->counters[i]->method);
                printf(",\"calls\":%" PRIu64 ",\"errors\":%" PRIu64 "}", st->counters[i]->calls,
                       st->counters[i]->errors);
            }
            fputs("]}\n", stdout);
        }
    } else {
        if (!members_only) {
            printf("coordinator  %s (pshard %s, up %" PRId64 " s)\n", opts.coordinator, st->version,
                   st->uptime_ms / 1000);
            printf("job          %s%s\n", st->job,
                   st->n_jobs > 1 ? "" : " (the only one on this coordinator)");
            printf("cluster      %s, generation %" PRIu64 "\n", state_name(st->state),
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
            print_joins_table(stdout, st);
            if (st->n_jobs > 1) {
                printf("jobs         %zu on this coordinator (unused ones end after %" PRId64
                       " s)\n",
                       st->n_jobs, st->job_linger_ms / 1000);
                printf("  %-24s %-9s %10s %6s %7s %6s\n", "JOB", "STATE", "GENERATION", "WORLD",
                       "MEMBERS", "KEYS");
                for (size_t i = 0; i < st->n_jobs; i++) {
                    const Pshard__JobSummary *j = st->jobs[i];
                    printf("  %-24s %-9s %10" PRIu64 " %6d %7u %6" PRIu64 "%s\n", j->job,
                           state_name(j->state), j->generation, j->world_size, j->members,
                           j->store_keys, strcmp(j->job, st->job) == 0 ? "  <- this one" : "");
                }
            }
            fputc('\n', stdout);
        }
        print_members_table(stdout, st->members, st->n_members);
        if (!members_only) {
            if (opts.server_timeout_ms > 0)
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
    protobuf_c_message_free_unpacked(msg, NULL);
    return EXIT_OK;
}

static int cmd_health(int argc, char **argv)
{
    if (argc > 1)
        return fail("health takes at most one SERVICE");
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = argc == 1 ? argv[0] : "";
    ProtobufCMessage *msg = NULL;
    char err[1024] = "";
    int code = 0;
    pshard_status_t rc = ps_rpc_unary(channel, "/grpc.health.v1.Health/Check", &req.base,
                                      &grpc__health__v1__health_check_response__descriptor, &msg,
                                      opts.timeout_ms, 0, &code, err, sizeof(err));
    const char *service = *req.service ? req.service : "(server)";
    if (rc == PSHARD_ERR_NOT_FOUND) {
        if (opts.json)
            printf("{\"service\":\"%s\",\"status\":\"SERVICE_UNKNOWN\"}\n", service);
        else
            printf("%s: SERVICE_UNKNOWN\n", service);
        return EXIT_NOT_SERVING;
    }
    if (rc != PSHARD_OK)
        return fail("health: %s (%s)", err, pshard_status_name(rc));
    Grpc__Health__V1__HealthCheckResponse *resp = (Grpc__Health__V1__HealthCheckResponse *)msg;
    const char *name = resp->status == 1 ? "SERVING" : resp->status == 2 ? "NOT_SERVING" : "UNKNOWN";
    if (opts.json) {
        fputs("{\"service\":", stdout);
        json_cstr(stdout, service);
        printf(",\"status\":\"%s\"}\n", name);
    } else {
        printf("%s: %s\n", service, name);
    }
    int exit_code = resp->status == 1 ? EXIT_OK : EXIT_NOT_SERVING;
    protobuf_c_message_free_unpacked(msg, NULL);
    return exit_code;
}

static int cmd_store(int argc, char **argv)
{
    if (argc < 2)
        return fail("store needs get|set|add|wait and a KEY (see --help)");
    const char *sub = argv[0];
    ProtobufCMessage *msg = NULL;
    int rc;
    if (strcmp(sub, "get") == 0 && argc == 2) {
        Pshard__StoreGetRequest req = PSHARD__STORE_GET_REQUEST__INIT;
        req.key = argv[1];
        rc = call("StoreGet", &req.base, &pshard__store_get_response__descriptor, &msg,
                  PS_RPC_IDEMPOTENT, opts.timeout_ms);
        if (rc != EXIT_OK)
            return rc;
        Pshard__StoreGetResponse *r = (Pshard__StoreGetResponse *)msg;
        if (opts.json) {
            fputs("{\"key\":", stdout);
            json_cstr(stdout, argv[1]);
            fputs(",\"value\":", stdout);
            json_str(stdout, (const char *)r->value.data, r->value.len);
            fputs("}\n", stdout);
        } else {
            fwrite(r->value.data, 1, r->value.len, stdout);
            fputc('\n', stdout);
        }
    } else if (strcmp(sub, "set") == 0 && argc == 3) {
        Pshard__StoreSetRequest req = PSHARD__STORE_SET_REQUEST__INIT;
        req.key = argv[1];
        req.value.data = (uint8_t *)argv[2];
        req.value.len = strlen(argv[2]);
        rc = call("StoreSet", &req.base, &pshard__store_set_response__descriptor, &msg,
                  PS_RPC_IDEMPOTENT, opts.timeout_ms);
        if (rc != EXIT_OK)
            return rc;
    } else if (strcmp(sub, "delete") == 0 && argc == 2) {
        Pshard__StoreDeleteRequest req = PSHARD__STORE_DELETE_REQUEST__INIT;
        req.key = argv[1];
        rc = call("StoreDelete", &req.base, &pshard__store_delete_response__descriptor, &msg, 0,
                  opts.timeout_ms);
        if (rc != EXIT_OK)
            return rc;
        bool deleted = ((Pshard__StoreDeleteResponse *)msg)->deleted;
        if (opts.json)
            printf("{\"deleted\":%s}\n", deleted ? "true" : "false");
        else
            printf("%s\n", deleted ? "deleted" : "not set");
    } else if (strcmp(sub, "add") == 0 && argc == 3) {
        Pshard__StoreAddRequest req = PSHARD__STORE_ADD_REQUEST__INIT;
        req.key = argv[1];
        if (ps_parse_i64(argv[2], INT64_MIN, INT64_MAX, &req.delta) != 0)
            return fail("store add: '%s' is not an integer", argv[2]);
        rc = call("StoreAdd", &req.base, &pshard__store_add_response__descriptor, &msg, 0,
                  opts.timeout_ms);
        if (rc != EXIT_OK)
            return rc;
        printf("%" PRId64 "\n", ((Pshard__StoreAddResponse *)msg)->value);
    } else if (strcmp(sub, "wait") == 0) {
        Pshard__StoreWaitRequest req = PSHARD__STORE_WAIT_REQUEST__INIT;
        req.n_keys = (size_t)argc - 1;
        req.keys = argv + 1;
        req.timeout_ms = opts.timeout_ms;
        rc = call("StoreWait", &req.base, &pshard__store_wait_response__descriptor, &msg, 0,
                  opts.timeout_ms + 2000);
        if (rc != EXIT_OK)
            return rc;
        Pshard__StoreWaitResponse *r = (Pshard__StoreWaitResponse *)msg;
        for (size_t i = 0; i < r->n_values; i++) {
            printf("%s=", argv[1 + i]);
            fwrite(r->values[i].data, 1, r->values[i].len, stdout);
            fputc('\n', stdout);
        }
    } else {
        return fail("store: unknown form '%s' with %d arguments (see --help)", sub, argc - 1);
    }
    if (msg)
        protobuf_c_message_free_unpacked(msg, NULL);
    return EXIT_OK;
}

static volatile sig_atomic_t interrupted;
static void on_signal(int sig)
{
    (void)sig;
    interrupted = 1;
}

static void print_event(const Pshard__ClusterEvent *ev)
{
    if (opts.json) {
        printf("{\"generation\":%" PRIu64 ",\"state\":\"%s\",\"world_size\":%d,\"reason\":",
               ev->generation, state_name(ev->state), ev->world_size);
        json_cstr(stdout, ev->reason);
        fputs(",\"members\":[", stdout);
        for (size_t i = 0; i < ev->n_members; i++) {
            if (i)
                fputc(',', stdout);
            json_member(stdout, ev->members[i]);
        }
        fputs("],\"joins\":", stdout);
        json_joins(stdout, ev->joins, ev->n_joins);
        printf(",\"last_joiner\":%d,\"members_omitted\":%u}\n", ev->last_joiner,
               ev->members_omitted);
    } else {
        printf("generation %" PRIu64 "  %-8s  %zu members  %s", ev->generation,
               state_name(ev->state), ev->n_members + ev->members_omitted, ev->reason);
        if (ev->last_joiner >= 0)
            printf(" (last joiner rank %d)", ev->last_joiner);
        for (size_t i = 0; i < ev->n_joins; i++)
            printf("%s rank %d at step %" PRId64 "%s", i == 0 ? "; joined:" : ",",
                   ev->joins[i]->rank, ev->joins[i]->step,
                   ev->joins[i]->throw_on_early_termination ? " (throw)" : "");
        fputc('\n', stdout);
    }
    fflush(stdout);
}

static int cmd_watch(int argc, char **argv)
{
    int64_t count = 0;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--count") == 0 && i + 1 < argc) {
            if (ps_parse_i64(argv[++i], 1, INT64_MAX, &count) != 0)
                return fail("watch: --count needs a positive integer");
        } else {
            return fail("watch: unexpected argument '%s'", argv[i]);
        }
    }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    Pshard__WatchRequest req = PSHARD__WATCH_REQUEST__INIT;
    char err[1024] = "";
    ps_rpc_stream_t *st = ps_rpc_stream_open(channel, "/pshard.Coordinator/Watch", &req.base, 0,
                                             err, sizeof(err));
    if (!st)
        return fail("watch: %s", err);
    int rc = EXIT_OK;
    int64_t seen = 0;
    while (!interrupted && (count == 0 || seen < count)) {
        ProtobufCMessage *msg = NULL;
        pshard_status_t s = ps_rpc_stream_next(st, &pshard__cluster_event__descriptor, &msg, 200,
                                               NULL, err, sizeof(err));
        if (s == PSHARD_ERR_TIMEOUT)
            continue;
        if (s != PSHARD_OK) {
            rc = fail("watch: %s (%s)", err, pshard_status_name(s));
            break;
        }
        if (!msg) {
            fprintf(stderr, "pshardctl: watch: the coordinator ended the stream\n");
            break;
        }
        print_event((Pshard__ClusterEvent *)msg);
        protobuf_c_message_free_unpacked(msg, NULL);
        seen++;
    }
    ps_rpc_stream_close(st);
    return rc;
}

typedef struct {
    char *role;
    char *name;
    char *address;
    char *node;
    char *device;
    bool hold;
} reg_opts_t;

#define ROPT(flag, type, def, help, field)                                                          \
    {flag, NULL, type, def, help, offsetof(reg_opts_t, field), 0, 0}

static const ps_option_t reg_options[] = {
    ROPT("role", PS_OPT_STRING, NULL, "shard_server or trainer", role),
    ROPT("name", PS_OPT_STRING, NULL, "member name", name),
    ROPT("address", PS_OPT_STRING, "", "address the member serves on", address),
    ROPT("node", PS_OPT_STRING, "", "node name", node),
    ROPT("device", PS_OPT_STRING, "", "device, e.g. cpu or cuda:0", device),
    ROPT("hold", PS_OPT_BOOL, "false", "heartbeat until interrupted, then leave", hold),
};

static void sleep_ms(int64_t ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

static int cmd_register(int argc, char **argv)
{
    reg_opts_t r;
    ps_config_result_t res;
    char err[1024] = "";
    int rc = EXIT_ERROR;
    /* ps_config_parse expects argv[0] to be the program name. */
    if (ps_config_parse(reg_options, PS_ARRAY_LEN(reg_options), argc + 1, argv - 1, &r, &res, err,
                        sizeof(err)) != PSHARD_OK) {
        fail("register: %s", err);
        goto out;
    }
    if (!r.role || !r.name) {
        fail("register needs --role and --name");
        goto out;
    }
    Pshard__RegisterRequest req = PSHARD__REGISTER_REQUEST__INIT;
    if (strcmp(r.role, "shard_server") == 0) {
        req.role = PSHARD__ROLE__SHARD_SERVER;
    } else if (strcmp(r.role, "trainer") == 0) {
        req.role = PSHARD__ROLE__TRAINER;
    } else {
        fail("register: --role must be shard_server or trainer, not '%s'", r.role);
        goto out;
    }
    req.name = r.name;
    req.address = r.address;
    req.node = r.node;
    req.device = r.device;
    ProtobufCMessage *msg = NULL;
    if (call("Register", &req.base, &pshard__member_view__descriptor, &msg, 0, opts.timeout_ms) !=
        EXIT_OK)
        goto out;
    Pshard__MemberView *v = (Pshard__MemberView *)msg;
    char member_id[64], lease_key[64];
    ps_strlcpy(member_id, v->member_id, sizeof(member_id));
    ps_strlcpy(lease_key, v->lease_key ? v->lease_key : "", sizeof(lease_key));
    int64_t heartbeat_ms = v->heartbeat_ms > 0 ? v->heartbeat_ms : 1000;
    printf("registered %s as %s (rank %d, generation %" PRIu64 ", %s)\n", r.name, member_id,
           v->rank, v->generation, state_name(v->state));
    fflush(stdout);
    protobuf_c_message_free_unpacked(msg, NULL);
    rc = EXIT_OK;
    if (!r.hold)
        goto out;
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    while (!interrupted) {
        sleep_ms(heartbeat_ms);
        if (interrupted)
            break;
        Pshard__HeartbeatRequest hb = PSHARD__HEARTBEAT_REQUEST__INIT;
        hb.member_id = member_id;
        hb.lease_key = lease_key;
        if (call("Heartbeat", &hb.base, &pshard__member_view__descriptor, &msg, PS_RPC_IDEMPOTENT,
                 opts.timeout_ms) != EXIT_OK) {
            rc = EXIT_ERROR;
            goto out;
        }
        protobuf_c_message_free_unpacked(msg, NULL);
    }
    Pshard__LeaveRequest lv = PSHARD__LEAVE_REQUEST__INIT;
    lv.member_id = member_id;
    lv.lease_key = lease_key;
    if (call("Leave", &lv.base, &pshard__leave_response__descriptor, &msg, PS_RPC_IDEMPOTENT,
             opts.timeout_ms) == EXIT_OK)
        protobuf_c_message_free_unpacked(msg, NULL);
out:
    ps_config_free(reg_options, PS_ARRAY_LEN(reg_options), &r);
    return rc;
}

/* ---- checkpoint: list and export offline, save through the coordinator ------------------- */

typedef struct {
    char *checkpoint_dir;
    bool verify;
    char *format;
    char *dtype;
    int64_t step;
    int64_t timeout_ms;
} ckpt_cli_t;

#define COPT(flag, env, type, def, help, field, lo, hi)                                            \
    {flag, env, type, def, help, offsetof(ckpt_cli_t, field), lo, hi}
#define COPT_DIR                                                                                   \
    COPT("checkpoint-dir", "PSHARD_CHECKPOINT_DIR", PS_OPT_STRING, NULL,                           \
         "directory holding the step-NNNNNNNN checkpoint directories", checkpoint_dir, 0, 0)

static const ps_option_t ckpt_list_options[] = {
    COPT_DIR,
    COPT("verify", NULL, PS_OPT_BOOL, "false",
         "also check every shard file's size and CRC-32C (exit 1 on corruption)", verify, 0, 0),
};

static const ps_option_t ckpt_export_options[] = {
    COPT_DIR,
    COPT("format", NULL, PS_OPT_STRING, "safetensors", "output format (safetensors)", format, 0,
         0),
    COPT("dtype", NULL, PS_OPT_STRING, "fp32", "element type written: fp32 or bf16", dtype, 0, 0),
    COPT("step", NULL, PS_OPT_INT, "-1", "step to export (-1: the newest committed)", step, -1,
         INT64_MAX),
};

static const ps_option_t ckpt_save_options[] = {
    COPT("timeout-ms", NULL, PS_OPT_INT, "600000",
         "how long to wait for the shard servers to save", timeout_ms, 1, 86400000),
};

/* "12.3 MiB" */
static void human_bytes(uint64_t bytes, char *buf, size_t len)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = (double)bytes;
    size_t u = 0;
    while (v >= 1024 && u + 1 < PS_ARRAY_LEN(units)) {
        v /= 1024;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%" PRIu64 " B", bytes);
    else
        snprintf(buf, len, "%.1f %s", v, units[u]);
}

/* Parses a checkpoint subcommand's options (argv[0] is the subcommand). Returns -1 to go on,
 * else the exit code (after --help, or an error already printed). */
static int ckpt_parse(const char *sub, const ps_option_t *table, size_t n, int argc, char **argv,
                      ckpt_cli_t *c, ps_config_result_t *res, const char *synopsis,
                      const char *summary)
{
    char err[1024] = "";
    if (ps_config_parse(table, n, argc, argv, c, res, err, sizeof(err)) != PSHARD_OK)
        return fail("checkpoint %s: %s (see 'pshardctl checkpoint %s --help')", sub, err, sub);
    if (res->help) {
        char prog[64];
        snprintf(prog, sizeof(prog), "pshardctl checkpoint %s", sub);
        ps_config_usage(stdout, prog, synopsis, summary, table, n);
        return EXIT_OK;
    }
    return -1;
}

/* Step directories under root that are not committed checkpoints, and why, printed (or
 * added to the JSON "ignored" list). Returns how many had a manifest that does not parse. */
static int ckpt_report_ignored(const char *root, const int64_t *steps, size_t nsteps)
{
    DIR *d = opendir(root);
    if (!d)
        return 0;
    int malformed = 0;
    bool first = true;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "step-", 5) != 0)
            continue;
        int64_t step = -1;
        ps_parse_i64(e->d_name + 5, 0, INT64_MAX, &step);
        bool listed = false;
        for (size_t i = 0; i < nsteps && !listed; i++) {
            char canon[40];
            snprintf(canon, sizeof(canon), "step-%08" PRId64, steps[i]);
            listed = strcmp(canon, e->d_name) == 0;
        }
        if (listed)
            continue;
        char dir[4096], why[1024] = "";
        snprintf(dir, sizeof(dir), "%s/%s", root, e->d_name);
        struct stat st;
        if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
            continue;
        ps_ckpt_manifest_t *m = NULL;
        pshard_status_t rc = ps_ckpt_manifest_read(dir, &m, why, sizeof(why));
        if (rc == PSHARD_ERR_NOT_FOUND)
            snprintf(why, sizeof(why), "no %s: a save that did not commit", PS_CKPT_MANIFEST);
        else if (rc == PSHARD_OK)
            snprintf(why, sizeof(why), "not named as its manifest's step %" PRId64, m->step);
        else if (rc == PSHARD_ERR_INVALID_ARGUMENT)
            malformed++;
        ps_ckpt_manifest_free(m);
        if (opts.json) {
            fputs(first ? "" : ",", stdout);
            fputs("{\"dir\":", stdout);
            json_cstr(stdout, dir);
            fputs(",\"reason\":", stdout);
            json_cstr(stdout, why);
            fputc('}', stdout);
        } else {
            printf("%signored: %s: %s\n", first ? "\n" : "", e->d_name, why);
        }
        first = false;
    }
    closedir(d);
    return malformed;
}

static int cmd_checkpoint_list(int argc, char **argv)
{
    ckpt_cli_t c = {0};
    ps_config_result_t res;
    int rc = ckpt_parse("list", ckpt_list_options, PS_ARRAY_LEN(ckpt_list_options), argc, argv,
                        &c, &res, "[--verify] [--checkpoint-dir DIR]",
                        "Lists the committed checkpoints under DIR (offline).");
    int64_t *steps = NULL;
    size_t n = 0;
    char err[1024] = "";
    if (rc >= 0)
        goto out;
    rc = EXIT_ERROR;
    if (res.first_positional < argc) {
        fail("checkpoint list: unexpected argument '%s'", argv[res.first_positional]);
        goto out;
    }
    if (!c.checkpoint_dir || !*c.checkpoint_dir) {
        fail("checkpoint list needs --checkpoint-dir DIR (or PSHARD_CHECKPOINT_DIR)");
        goto out;
    }
    if (ps_ckpt_list(c.checkpoint_dir, &steps, &n, NULL, 0, err, sizeof(err)) != PSHARD_OK) {
        fail("checkpoint list: %s", err);
        goto out;
    }
    size_t files = 0, corrupt = 0;
    if (opts.json) {
        fputs("{\"checkpoint_dir\":", stdout);
        json_cstr(stdout, c.checkpoint_dir);
        fputs(",\"checkpoints\":[", stdout);
    } else if (n == 0) {
        printf("no committed checkpoints in %s\n", c.checkpoint_dir);
    } else {
        printf("%-10s %6s %-7s %-9s %-32s %7s %11s  %s\n", "STEP", "WORLD", "LAYOUT", "OPTIMIZER",
               "SECTIONS", "PARAMS", "SIZE", "DIRECTORY");
    }
    for (size_t i = 0; i < n; i++) {
        char dir[4096];
        ps_ckpt_step_dir(c.checkpoint_dir, steps[i], dir, sizeof(dir));
        ps_ckpt_manifest_t *m = NULL;
        err[0] = '\0';
        if (ps_ckpt_manifest_read(dir, &m, err, sizeof(err)) != PSHARD_OK) {
            /* Removed or changed since it was listed. */
            fprintf(stderr, "pshardctl: %s\n", err);
            corrupt++;
            continue;
        }
        uint64_t bytes = 0;
        for (size_t f = 0; f < m->nfiles; f++)
            bytes += m->files[f].bytes;
        char sections[128] = "";
        for (int k = 0; k < m->nsections; k++)
            snprintf(sections + strlen(sections), sizeof(sections) - strlen(sections), "%s%s",
                     k ? "," : "", m->sections[k]);
        const char *layout = m->layout == PSHARD_LAYOUT_FSDP1 ? "fsdp1" : "fsdp2";
        if (opts.json) {
            printf("%s{\"step\":%" PRId64 ",\"dir\":", i ? "," : "", m->step);
            json_cstr(stdout, dir);
            printf(",\"world_size\":%d,\"layout\":\"%s\",\"optimizer\":", m->world_size, layout);
            json_cstr(stdout, m->optim.kind);
            fputs(",\"sections\":[", stdout);
            for (int k = 0; k < m->nsections; k++) {
                fputs(k ? "," : "", stdout);
                json_cstr(stdout, m->sections[k]);
            }
            printf("],\"params\":%zu,\"bytes\":%" PRIu64 ",\"files\":[", m->nparams, bytes);
        } else {
            char size[32];
            human_bytes(bytes, size, sizeof(size));
            printf("%-10" PRId64 " %6d %-7s %-9s %-32s %7zu %11s  %s\n", m->step, m->world_size,
                   layout, m->optim.kind, sections, m->nparams, size, dir);
        }
        for (size_t f = 0; f < m->nfiles; f++) {
            const ps_ckpt_file_t *file = &m->files[f];
            char why[1024] = "";
            bool ok = true;
            if (c.verify) {
                ok = ps_ckpt_verify_file(dir, file, why, sizeof(why)) == PSHARD_OK;
                files++;
                corrupt += !ok;
            }
            if (opts.json) {
                printf("%s{\"rank\":%d,\"path\":", f ? "," : "", file->rank);
                json_cstr(stdout, file->path);
                printf(",\"bytes\":%" PRIu64 ",\"crc32c\":%" PRIu32, file->bytes, file->crc32c);
                if (c.verify) {
                    printf(",\"status\":\"%s\"", ok ? "ok" : "corrupt");
                    if (!ok) {
                        fputs(",\"error\":", stdout);
                        json_cstr(stdout, why);
                    }
                }
                fputc('}', stdout);
            } else if (c.verify && ok) {
                printf("    ok       %s (%" PRIu64 " bytes, crc32c %08" PRIx32 ")\n", file->path,
                       file->bytes, file->crc32c);
            } else if (c.verify) {
                printf("    CORRUPT  %s: %s\n", file->path, why);
            }
        }
        if (opts.json)
            fputs("]}", stdout);
        ps_ckpt_manifest_free(m);
    }
    if (opts.json)
        fputs("],\"ignored\":[", stdout);
    int malformed = ckpt_report_ignored(c.checkpoint_dir, steps, n);
    if (opts.json) {
        printf("]");
        if (c.verify)
            printf(",\"files_verified\":%zu,\"corrupt\":%zu", files, corrupt);
        printf("}\n");
    } else if (c.verify) {
        if (corrupt == 0)
            printf("\nverified %zu file%s: all ok\n", files, files == 1 ? "" : "s");
        else
            printf("\nverified %zu file%s: %zu CORRUPT\n", files, files == 1 ? "" : "s",
                   corrupt);
        if (malformed)
            printf("%d step director%s with a malformed manifest\n", malformed,
                   malformed == 1 ? "y" : "ies");
    }
    rc = (corrupt > 0 || (c.verify && malformed > 0)) ? EXIT_NOT_SERVING : EXIT_OK;
out:
    free(steps);
    ps_config_free(ckpt_list_options, PS_ARRAY_LEN(ckpt_list_options), &c);
    return rc;
}

static int cmd_checkpoint_export(int argc, char **argv)
{
    ckpt_cli_t c = {0};
    ps_config_result_t res;
    int rc = ckpt_parse("export", ckpt_export_options, PS_ARRAY_LEN(ckpt_export_options), argc,
                        argv, &c, &res,
                        "[--format safetensors] [--dtype fp32|bf16] [--step N] "
                        "[--checkpoint-dir DIR] OUT",
                        "Writes the master weights of a committed checkpoint (default: the "
                        "newest) as one\nsafetensors file OUT, after checking every shard "
                        "file's CRC-32C (offline).");
    int64_t *steps = NULL;
    size_t n = 0;
    ps_ckpt_manifest_t *m = NULL;
    char err[1024] = "", dir[4096];
    if (rc >= 0)
        goto out;
    rc = EXIT_ERROR;
    if (res.first_positional != argc - 1) {
        if (res.first_positional >= argc)
            fail("checkpoint export needs the OUT file (after the options)");
        else
            fail("checkpoint export takes one OUT file, after the options; '%s' is extra",
                 argv[res.first_positional + 1]);
        goto out;
    }
    const char *out_path = argv[res.first_positional];
    if (strcmp(c.format, "safetensors") != 0) {
        fail("checkpoint export: --format %s is not supported (safetensors is)", c.format);
        goto out;
    }
    pshard_dtype_t dtype;
    if (pshard_dtype_parse(c.dtype, &dtype) != 0 ||
        (dtype != PSHARD_FP32 && dtype != PSHARD_BF16)) {
        fail("checkpoint export: --dtype must be fp32 or bf16, not '%s'", c.dtype);
        goto out;
    }
    if (!c.checkpoint_dir || !*c.checkpoint_dir) {
        fail("checkpoint export needs --checkpoint-dir DIR (or PSHARD_CHECKPOINT_DIR)");
        goto out;
    }
    if (ps_ckpt_list(c.checkpoint_dir, &steps, &n, NULL, 0, err, sizeof(err)) != PSHARD_OK) {
        fail("checkpoint export: %s", err);
        goto out;
    }
    if (n == 0) {
        fail("checkpoint export: no committed checkpoints in %s", c.checkpoint_dir);
        goto out;
    }
    int64_t step = steps[n - 1];
    if (c.step >= 0) {
        bool found = false;
        for (size_t i = 0; i < n && !found; i++)
            found = steps[i] == c.step;
        if (!found) {
            fail("checkpoint export: no committed checkpoint of step %" PRId64
                 " in %s (the newest is step %" PRId64 ")",
                 c.step, c.checkpoint_dir, steps[n - 1]);
            goto out;
        }
        step = c.step;
    }
    ps_ckpt_step_dir(c.checkpoint_dir, step, dir, sizeof(dir));
    if (ps_ckpt_manifest_read(dir, &m, err, sizeof(err)) != PSHARD_OK) {
        fail("checkpoint export: %s", err);
        goto out;
    }
    for (size_t f = 0; f < m->nfiles; f++) {
        err[0] = '\0';
        if (ps_ckpt_verify_file(dir, &m->files[f], err, sizeof(err)) != PSHARD_OK) {
            fail("checkpoint export: refusing to export step %" PRId64 ": %s", step, err);
            rc = EXIT_NOT_SERVING;
            goto out;
        }
    }
    err[0] = '\0';
    if (ps_safetensors_export(dir, m, dtype, out_path, err, sizeof(err)) != PSHARD_OK) {
        fail("checkpoint export: %s", err);
        goto out;
    }
    struct stat st;
    uint64_t size = stat(out_path, &st) == 0 ? (uint64_t)st.st_size : 0;
    if (opts.json) {
        printf("{\"step\":%" PRId64 ",\"dir\":", step);
        json_cstr(stdout, dir);
        fputs(",\"out\":", stdout);
        json_cstr(stdout, out_path);
        printf(",\"format\":\"safetensors\",\"dtype\":\"%s\",\"tensors\":%zu,\"bytes\":%" PRIu64
               "}\n",
               pshard_dtype_name(dtype), m->nparams, size);
    } else {
        char human[32];
        human_bytes(size, human, sizeof(human));
        printf("exported step %" PRId64 " (%zu tensors, %s, %s) from %s to %s\n", step,
               m->nparams, pshard_dtype_name(dtype), human, dir, out_path);
    }
    rc = EXIT_OK;
out:
    ps_ckpt_manifest_free(m);
    free(steps);
    ps_config_free(ckpt_export_options, PS_ARRAY_LEN(ckpt_export_options), &c);
    return rc;
}

/* The shard servers watch the request counter; after their next optimizer step they save,
 * and rank 0 answers request R under CKPT_DONE_KEY/R with "step=S dir=D" or "error=MSG". */
#define CKPT_REQUEST_KEY "pshard/checkpoint/request"
#define CKPT_DONE_KEY "pshard/checkpoint/done"

static int cmd_checkpoint_save(int argc, char **argv)
{
    ckpt_cli_t c = {0};
    ps_config_result_t res;
    int rc = ckpt_parse("save", ckpt_save_options, PS_ARRAY_LEN(ckpt_save_options), argc, argv,
                        &c, &res, "[--timeout-ms T]",
                        "Asks the running shard servers (through the coordinator's store) to "
                        "save a checkpoint\nafter their next optimizer step, and waits for it.");
    ProtobufCMessage *msg = NULL;
    char err[1024] = "";
    if (rc >= 0)
        goto out;
    rc = EXIT_ERROR;
    if (res.first_positional < argc) {
        fail("checkpoint save: unexpected argument '%s'", argv[res.first_positional]);
        goto out;
    }
    Pshard__StoreAddRequest add = PSHARD__STORE_ADD_REQUEST__INIT;
    add.key = CKPT_REQUEST_KEY;
    add.delta = 1;
    if (call("StoreAdd", &add.base, &pshard__store_add_response__descriptor, &msg, 0,
             opts.timeout_ms) != EXIT_OK)
        goto out;
    int64_t request = ((Pshard__StoreAddResponse *)msg)->value;
    protobuf_c_message_free_unpacked(msg, NULL);
    msg = NULL;
    char key[96];
    snprintf(key, sizeof(key), "%s/%" PRId64, CKPT_DONE_KEY, request);
    char *keys[] = {key};
    Pshard__StoreWaitRequest wait = PSHARD__STORE_WAIT_REQUEST__INIT;
    wait.n_keys = 1;
    wait.keys = keys;
    wait.timeout_ms = c.timeout_ms;
    pshard_status_t st = ps_rpc_unary(channel, "/pshard.Coordinator/StoreWait", &wait.base,
                                      &pshard__store_wait_response__descriptor, &msg,
                                      c.timeout_ms + 2000, 0, NULL, err, sizeof(err));
    if (st == PSHARD_ERR_TIMEOUT) {
        fprintf(stderr,
                "pshardctl: checkpoint save: no answer to request %" PRId64 " within %" PRId64
                " ms; the shard servers save after their next optimizer step (is training "
                "running, with --checkpoint-dir?)\n",
                request, c.timeout_ms);
        rc = EXIT_NOT_SERVING;
        goto out;
    }
    if (st != PSHARD_OK) {
        fail("checkpoint save: StoreWait: %s (%s)", err, pshard_status_name(st));
        goto out;
    }
    Pshard__StoreWaitResponse *r = (Pshard__StoreWaitResponse *)msg;
    if (r->n_values != 1) {
        fail("checkpoint save: the coordinator answered %zu values for one key", r->n_values);
        goto out;
    }
    char value[8192];
    size_t vlen = r->values[0].len < sizeof(value) - 1 ? r->values[0].len : sizeof(value) - 1;
    memcpy(value, r->values[0].data, vlen);
    value[vlen] = '\0';
    int64_t step = -1;
    const char *dir_at = strstr(value, " dir=");
    if (strncmp(value, "error=", 6) == 0) {
        if (opts.json) {
            printf("{\"request\":%" PRId64 ",\"error\":", request);
            json_cstr(stdout, value + 6);
            printf("}\n");
        }
        fprintf(stderr, "pshardctl: checkpoint save failed: %s\n", value + 6);
        rc = EXIT_NOT_SERVING;
        goto out;
    }
    char step_text[32] = "";
    if (strncmp(value, "step=", 5) == 0 && dir_at && dir_at - (value + 5) < (int)sizeof(step_text))
        snprintf(step_text, sizeof(step_text), "%.*s", (int)(dir_at - (value + 5)), value + 5);
    if (!dir_at || ps_parse_i64(step_text, 0, INT64_MAX, &step) != 0) {
        fail("checkpoint save: unexpected answer under %s: '%s'", key, value);
        goto out;
    }
    const char *dir = dir_at + 5;
    if (opts.json) {
        printf("{\"request\":%" PRId64 ",\"step\":%" PRId64 ",\"dir\":", request, step);
        json_cstr(stdout, dir);
        printf("}\n");
    } else {
        printf("checkpoint saved: step %" PRId64 " in %s\n", step, dir);
    }
    rc = EXIT_OK;
out:
    if (msg)
        protobuf_c_message_free_unpacked(msg, NULL);
    ps_config_free(ckpt_save_options, PS_ARRAY_LEN(ckpt_save_options), &c);
    return rc;
}

static int cmd_checkpoint(int argc, char **argv)
{
    if (argc < 1)
        return fail("checkpoint needs list, export or save (see --help)");
    if (strcmp(argv[0], "--help") == 0 || strcmp(argv[0], "-h") == 0) {
        fputs(strstr(usage_text, "  checkpoint list"), stdout);
        return EXIT_OK;
    }
    /* Listing reports unreadable manifests itself; the library's warnings would repeat them. */
    if (!getenv("PSHARD_LOG"))
        ps_log_set_level(PS_LOG_ERROR);
    if (strcmp(argv[0], "list") == 0)
        return cmd_checkpoint_list(argc, argv);
    if (strcmp(argv[0], "export") == 0)
        return cmd_checkpoint_export(argc, argv);
    if (strcmp(argv[0], "save") == 0)
        return cmd_checkpoint_save(argc, argv);
    return fail("checkpoint: unknown subcommand '%s' (list, export or save)", argv[0]);
}

/* The option of table t that arg ("--flag" or "--flag=value") names, or NULL. */
static const ps_option_t *option_named(const ps_option_t *t, size_t n, const char *arg)
{
    if (strncmp(arg, "--", 2) != 0)
        return NULL;
    const char *name = arg + 2, *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    for (size_t i = 0; i < n; i++)
        if (strlen(t[i].flag) == len && strncmp(t[i].flag, name, len) == 0)
            return &t[i];
    return NULL;
}

/* The options of a command's own table (they win over a global option of the same name, as
 * `checkpoint save --timeout-ms`); NULL when the command has none. */
static const ps_option_t *command_options(const char *cmd, const char *sub, size_t *n)
{
    *n = 0;
    if (cmd && strcmp(cmd, "register") == 0) {
        *n = PS_ARRAY_LEN(reg_options);
        return reg_options;
    }
    if (!cmd || strcmp(cmd, "checkpoint") != 0 || !sub)
        return NULL;
    if (strcmp(sub, "list") == 0) {
        *n = PS_ARRAY_LEN(ckpt_list_options);
        return ckpt_list_options;
    }
    if (strcmp(sub, "export") == 0) {
        *n = PS_ARRAY_LEN(ckpt_export_options);
        return ckpt_export_options;
    }
    if (strcmp(sub, "save") == 0) {
        *n = PS_ARRAY_LEN(ckpt_save_options);
        return ckpt_save_options;
    }
    return NULL;
}

/* Global options may come anywhere on the line, as git and kubectl take them (`pshardctl
 * status --json`): this puts every one found after the command in front of it (with its value
 * when that is the next word), unless the command's own table has an option of that name, and
 * stops at "--". out and rest hold argc + 1 entries each; returns out's count. */
static int hoist_global_options(int argc, char **argv, char **out, char **rest)
{
    int n = 0, nrest = 0;
    const char *cmd = NULL, *sub = NULL;
    out[n++] = argv[0];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            while (i < argc)
                rest[nrest++] = argv[i++];
            break;
        }
        size_t nown = 0;
        const ps_option_t *own = command_options(cmd, sub, &nown);
        const ps_option_t *g = option_named(global_options, PS_ARRAY_LEN(global_options), a);
        if (g && !(own && option_named(own, nown, a))) {
            out[n++] = argv[i];
            if (g->type != PS_OPT_BOOL && !strchr(a, '=') && i + 1 < argc)
                out[n++] = argv[++i];
            continue;
        }
        if (a[0] != '-') {
            if (!cmd)
                cmd = a;
            else if (!sub && strcmp(cmd, "checkpoint") == 0)
                sub = a;
        }
        rest[nrest++] = argv[i];
    }
    for (int k = 0; k < nrest; k++)
        out[n++] = rest[k];
    out[n] = NULL;
    return n;
}

int main(int argc, char **argv)
{
    ps_log_init("pshardctl");
    char **hoisted = calloc((size_t)argc * 2 + 2, sizeof(char *));
    if (!hoisted) {
        fputs("pshardctl: out of memory\n", stderr);
        return EXIT_ERROR;
    }
    argc = hoist_global_options(argc, argv, hoisted, hoisted + argc + 1);
    argv = hoisted;
    ps_config_result_t res;
    char err[1024] = "";
    int rc = EXIT_ERROR;
    char default_target[300];
    if (ps_config_parse(global_options, PS_ARRAY_LEN(global_options), argc, argv, &opts, &res,
                        err, sizeof(err)) != PSHARD_OK) {
        fail("%s (see --help)", err);
        goto out;
    }
    if (res.help) {
        ps_config_usage(stdout, "pshardctl", "[OPTIONS] COMMAND [ARGS]",
                        "Queries and drives a pshard coordinator.", global_options,
                        PS_ARRAY_LEN(global_options));
        fputs(usage_text, stdout);
        rc = EXIT_OK;
        goto out;
    }
    if (res.version) {
        printf("pshardctl %s\n", PSHARD_VERSION_STRING);
        rc = EXIT_OK;
        goto out;
    }
    if (res.first_positional >= argc) {
        fail("no command given (see --help)");
        goto out;
    }
    const char *cmd = argv[res.first_positional];
    int cargc = argc - res.first_positional - 1;
    char **cargv = argv + res.first_positional + 1;
    /* Checkpoint files are read offline: no coordinator, token or TLS is needed for them. */
    if (strcmp(cmd, "checkpoint") == 0 && !(cargc > 0 && strcmp(cargv[0], "save") == 0)) {
        rc = cmd_checkpoint(cargc, cargv);
        goto out;
    }
    if (!opts.coordinator) {
        ps_default_coordinator(default_target, sizeof(default_target));
        opts.coordinator = strdup(default_target);
    }
    if (opts.token_file) {
        cluster_token = ps_read_token(opts.token_file, err, sizeof(err));
        if (!cluster_token) {
            fail("--token-file: %s", err);
            goto out;
        }
    }
    ps_rpc_channel_config_t ccfg = {
        .target = opts.coordinator,
        .tls_ca_file = opts.tls_ca,
        .tls_cert_file = opts.tls_cert,
        .tls_key_file = opts.tls_key,
        .tls_server_name = opts.tls_server_name,
        .token = cluster_token,
        .max_message_bytes = 64 << 20,
        .job = opts.job,
    };
    channel = ps_rpc_channel_create(&ccfg, err, sizeof(err));
    if (!channel) {
        fail("%s", err);
        goto out;
    }
    if ((strcmp(cmd, "status") == 0 || strcmp(cmd, "members") == 0) && cargc > 0)
        rc = fail("%s: unknown %s '%s' (see --help)", cmd,
                  cargv[0][0] == '-' ? "option" : "argument", cargv[0]);
    else if (strcmp(cmd, "status") == 0)
        rc = cmd_status(false);
    else if (strcmp(cmd, "members") == 0)
        rc = cmd_status(true);
    else if (strcmp(cmd, "health") == 0)
        rc = cmd_health(cargc, cargv);
    else if (strcmp(cmd, "store") == 0)
        rc = cmd_store(cargc, cargv);
    else if (strcmp(cmd, "watch") == 0)
        rc = cmd_watch(cargc, cargv);
    else if (strcmp(cmd, "register") == 0)
        rc = cmd_register(cargc, cargv);
    else if (strcmp(cmd, "checkpoint") == 0)
        rc = cmd_checkpoint(cargc, cargv);
    else
        rc = fail("unknown command '%s' (see --help)", cmd);
out:
    ps_rpc_channel_destroy(channel);
    free(cluster_token);
    ps_config_free(global_options, PS_ARRAY_LEN(global_options), &opts);
    free(hoisted);
    return rc;
}
