/* What pshardctl's commands share: the error line, the coordinator call, and the member and
 * Join tables and their JSON. */

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
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

/* Writes s as a JSON string literal. */
void ctl_json_str(FILE *out, const char *s, size_t len)
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

void ctl_json_cstr(FILE *out, const char *s)
{
    ctl_json_str(out, s ? s : "", s ? strlen(s) : 0);
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

void ctl_json_member(FILE *out, const Pshard__Member *m)
{
    fputs("{\"member_id\":", out);
    ctl_json_cstr(out, m->member_id);
    fprintf(out, ",\"role\":\"%s\",\"name\":", ctl_role_name(m->role));
    ctl_json_cstr(out, m->name);
    fprintf(out, ",\"rank\":%d,\"address\":", m->rank);
    ctl_json_cstr(out, m->address);
    fputs(",\"node\":", out);
    ctl_json_cstr(out, m->node);
    fputs(",\"device\":", out);
    ctl_json_cstr(out, m->device);
    fprintf(out,
            ",\"lease_remaining_ms\":%" PRId64 ",\"last_heartbeat_ms_ago\":%" PRId64
            ",\"registered_generation\":%" PRIu64 "}",
            m->lease_remaining_ms, m->last_heartbeat_ms_ago, m->registered_generation);
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
    }
    if (n == 0)
        fprintf(out, "(no members)\n");
}

char ctl_err[1024];

int ctl_called(const char *what, pshard_status_t rc)
{
    if (rc != PSHARD_OK)
        return ctl_fail("%s: %s (%s)", what, ctl_err, pshard_status_name(rc));
    return EXIT_OK;
}

/* ---- Join table ------------------------------------------------------------------------ */

void ctl_json_joins(FILE *out, Pshard__JoinEntry **joins, size_t n)
{
    fputc('[', out);
    for (size_t i = 0; i < n; i++) {
        const Pshard__JoinEntry *j = joins[i];
        if (i)
            fputc(',', out);
        fprintf(out, "{\"rank\":%d,\"member_id\":", j->rank);
        ctl_json_cstr(out, j->member_id);
        fprintf(out,
                ",\"step\":%" PRId64 ",\"joined_ms_ago\":%" PRId64
                ",\"throw_on_early_termination\":%s}",
                j->step, j->joined_ms_ago, j->throw_on_early_termination ? "true" : "false");
    }
    fputc(']', out);
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

