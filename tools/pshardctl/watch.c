/* pshardctl watch: prints the coordinator's cluster events as they come. */

#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "pshard/util.h"

#include "ctl.h"

static void print_event(const Pshard__ClusterEvent *ev)
{
    if (ctl_opts.json) {
        ctl_json_print(
            json_pack("{s:I,s:s,s:i,s:o,s:o,s:o,s:i,s:I}", "generation", (json_int_t)ev->generation,
                      "state", ctl_state_name(ev->state), "world_size", ev->world_size, "reason",
                      ctl_jstr(ev->reason), "members", ctl_json_members(ev->members, ev->n_members),
                      "joins", ctl_json_joins(ev->joins, ev->n_joins), "last_joiner",
                      ev->last_joiner, "members_omitted", (json_int_t)ev->members_omitted));
    } else {
        printf("generation %" PRIu64 "  %-8s  %zu members  %s", ev->generation,
               ctl_state_name(ev->state), ev->n_members + ev->members_omitted, ev->reason);
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

int cmd_watch(int argc, char **argv)
{
    int64_t count = 0;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--count") == 0 && i + 1 < argc) {
            if (ps_parse_i64(argv[++i], 1, INT64_MAX, &count) != 0)
                return ctl_fail("watch: --count needs a positive integer");
        } else {
            return ctl_fail("watch: unexpected argument '%s'", argv[i]);
        }
    }
    signal(SIGINT, ctl_on_signal);
    signal(SIGTERM, ctl_on_signal);
    Pshard__WatchRequest req = PSHARD__WATCH_REQUEST__INIT;
    char err[PSHARD_ERRLEN] = "";
    ps_rpc_stream_t *st = ps_coord_watch_open(ctl_channel, &req, 0, err, sizeof(err));
    if (!st)
        return ctl_fail("watch: %s", err);
    int rc = EXIT_OK;
    int64_t seen = 0;
    while (!ctl_interrupted && (count == 0 || seen < count)) {
        ProtobufCMessage *msg = NULL;
        pshard_status_t s = ps_rpc_stream_next(st, &pshard__cluster_event__descriptor, &msg, 200,
                                               NULL, err, sizeof(err));
        if (s == PSHARD_ERR_TIMEOUT)
            continue;
        if (s != PSHARD_OK) {
            rc = ctl_fail("watch: %s (%s)", err, pshard_status_name(s));
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
