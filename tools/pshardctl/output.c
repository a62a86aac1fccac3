/* What pshardctl's commands share: the error line, the coordinator call, the member and Join
 * tables, and their JSON (jansson, with text that is not UTF-8 made safe). */

#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"

int ctl_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("pshardctl: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return EXIT_ERROR;
}

json_t *ctl_jstrn(const char *s, size_t len)
{
    return ps_json_strn(s, len);
}

json_t *ctl_jstr(const char *s)
{
    return ps_json_str(s);
}

json_t *ctl_jbytes(const void *data, size_t len)
{
    json_t *text = json_stringn(data ? data : "", data ? len : 0);
    if (text)
        return json_pack("{s:o}", "value", text);
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const unsigned char *p = data;
    char *out = malloc((len + 2) / 3 * 4 + 1);
    if (!out)
        return NULL;
    size_t o = 0;
    for (size_t i = 0; i < len; i += 3) {
        uint32_t w = (uint32_t)p[i] << 16 | (i + 1 < len ? (uint32_t)p[i + 1] << 8 : 0) |
                     (i + 2 < len ? p[i + 2] : 0);
        out[o++] = b64[w >> 18 & 63];
        out[o++] = b64[w >> 12 & 63];
        out[o++] = i + 1 < len ? b64[w >> 6 & 63] : '=';
        out[o++] = i + 2 < len ? b64[w & 63] : '=';
    }
    json_t *v = json_pack("{s:s%}", "value_base64", out, o);
    free(out);
    return v;
}

int ctl_json_print(json_t *v)
{
    if (!v)
        return ctl_fail("out of memory building the JSON output");
    int rc = json_dumpf(v, stdout, JSON_COMPACT) == 0 ? EXIT_OK : EXIT_ERROR;
    fputc('\n', stdout);
    fflush(stdout);
    json_decref(v);
    return rc;
}

const char *ctl_state_name(Pshard__ClusterState s)
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

const char *ctl_role_name(Pshard__Role r)
{
    return r == PSHARD__ROLE__SHARD_SERVER ? "shard_server"
           : r == PSHARD__ROLE__TRAINER    ? "trainer"
                                           : "unknown";
}

json_t *ctl_json_member(const Pshard__Member *m)
{
    return json_pack("{s:o,s:s,s:o,s:i,s:o,s:o,s:o,s:I,s:I,s:I,s:b,s:o}", "member_id",
                     ctl_jstr(m->member_id), "role", ctl_role_name(m->role), "name",
                     ctl_jstr(m->name), "rank", m->rank, "address", ctl_jstr(m->address), "node",
                     ctl_jstr(m->node), "device", ctl_jstr(m->device), "lease_remaining_ms",
                     (json_int_t)m->lease_remaining_ms, "last_heartbeat_ms_ago",
                     (json_int_t)m->last_heartbeat_ms_ago, "registered_generation",
                     (json_int_t)m->registered_generation, "serving", !m->not_serving,
                     "not_serving_reason", ctl_jstr(m->not_serving_reason));
}

json_t *ctl_json_members(Pshard__Member **members, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++)
        if (json_array_append_new(a, ctl_json_member(members[i])) != 0) {
            json_decref(a);
            return NULL;
        }
    return a;
}

void ctl_print_members(FILE *out, Pshard__Member **members, size_t n)
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
                ctl_role_name(m->role), m->name, *m->address ? m->address : "-",
                *m->node ? m->node : "-", *m->device ? m->device : "-", m->lease_remaining_ms,
                m->last_heartbeat_ms_ago);
        if (m->not_serving)
            fprintf(out, "      NOT SERVING: %s\n", m->not_serving_reason);
    }
    if (n == 0)
        fprintf(out, "(no members)\n");
}

/* The state every command shares: the global options (main.c parses them), the coordinator
 * channel, the token, and the command list --help prints. */
const char ctl_usage_text[] =
    "commands:\n"
    "  status                      cluster state, joins, members, each shard server's step\n"
    "                              and flight records (who is stuck where), request counters\n"
    "  members                     the member table only\n"
    "  health [SERVICE]            health of SERVICE (e.g. pshard.Cluster), or of the server and\n"
    "                              its pshard services (exit 1 when one is not SERVING)\n"
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
    "  (DIR defaults to $PSHARD_CHECKPOINT_DIR; 'checkpoint SUBCOMMAND --help' for details)\n"
    "  trace dump --dir DIR        ask every shard server for its flight records and write\n"
    "                              DIR/pshard-trace-rank-R.json for each (exit 1 when one\n"
    "                              could not be asked)\n"
    "  trace analyze DIR           read the pshard-trace-rank-*.json in DIR (a dump, or what\n"
    "                              pshard-server --trace-dir wrote on a timeout) and say which\n"
    "                              rank never started the newest operation, which ranks ran\n"
    "                              different descriptors at one seq, and each rank's last\n"
    "                              operation (offline; exit 0 with the report, 2 when DIR or\n"
    "                              a file in it cannot be read: malformed, too large, a rank\n"
    "                              claimed twice)\n";

ctl_opts_t ctl_opts;
ps_rpc_channel_t *ctl_channel;
char *ctl_token;

char ctl_err[PSHARD_ERRLEN];

int ctl_called(const char *what, pshard_status_t rc)
{
    if (rc != PSHARD_OK)
        return ctl_fail("%s: %s (%s)", what, ctl_err, pshard_status_name(rc));
    return EXIT_OK;
}

json_t *ctl_json_joins(Pshard__JoinEntry **joins, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++) {
        const Pshard__JoinEntry *j = joins[i];
        if (json_array_append_new(
                a, json_pack("{s:i,s:o,s:I,s:I,s:b}", "rank", j->rank, "member_id",
                             ctl_jstr(j->member_id), "step", (json_int_t)j->step, "joined_ms_ago",
                             (json_int_t)j->joined_ms_ago, "throw_on_early_termination",
                             j->throw_on_early_termination)) != 0) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

void ctl_print_joins(FILE *out, const Pshard__StatusResponse *st)
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

volatile sig_atomic_t ctl_interrupted;
void ctl_on_signal(int sig)
{
    (void)sig;
    ctl_interrupted = 1;
}
