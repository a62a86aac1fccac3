/* pshardrun's options: the one table {flag, env, type, default, help} that is parsed, logged
 * and printed by --help, and the checks of what the table cannot check. */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/util.h"

#include "run.h"

/* clang-format off */
#define OPT(flag, env, type, def, help, field, lo, hi)                                             \
    {flag, env, type, def, help, offsetof(run_opts_t, field), lo, hi}
/* clang-format on */

const ps_option_t run_options[] = {
    OPT("nproc", "PSHARD_NPROC", PS_OPT_INT, "1", "number of shard servers and trainers to start",
        nproc, 1, 4096),
    OPT("nproc-per-node", "PSHARD_NPROC_PER_NODE", PS_OPT_INT, "0",
        "torchrun's name for --nproc: shard servers and trainers on this node", nproc_per_node, 0,
        4096),
    OPT("nnodes", "PSHARD_NNODES", PS_OPT_INT, "1",
        "nodes of the job, each running its own pshardrun with --node-rank (a fixed number, "
        "not torchrun's MIN:MAX)",
        nnodes, 1, 4096),
    OPT("node-rank", "PSHARD_NODE_RANK", PS_OPT_INT, "0",
        "this node's rank, 0..NNODES-1: its trainers get RANK = node rank * NPROC + LOCAL_RANK",
        node_rank, 0, 4095),
    OPT("rdzv-endpoint", "PSHARD_RDZV_ENDPOINT", PS_OPT_STRING, NULL,
        "with --nnodes > 1: HOST:PORT of the job's coordinator; node rank 0 starts it listening "
        "there (port 0: a free one, printed as 'coordinator for N nodes on HOST:PORT'), the "
        "other nodes use it (torchrun's --rdzv-endpoint)",
        rdzv_endpoint, 0, 0),
    OPT("coordinator", "PSHARD_COORDINATOR", PS_OPT_STRING, NULL,
        "use this coordinator HOST:PORT instead of starting one on 127.0.0.1", coordinator, 0, 0),
    OPT("backend", "PSHARD_BACKEND", PS_OPT_STRING, "tcp", "collectives backend: tcp or nccl",
        backend, 0, 0),
    OPT("offload", "PSHARD_OFFLOAD", PS_OPT_STRING, "none", "where shards live: none or cpu",
        offload, 0, 0),
    OPT("token-file", "PSHARD_TOKEN_FILE", PS_OPT_STRING, NULL,
        "cluster token file, passed to the coordinator, servers and trainers", token_file, 0, 0),
    OPT("lease-ms", "PSHARD_LEASE_MS", PS_OPT_INT, "0",
        "member lease of the coordinator pshardrun starts (0: its default)", lease_ms, 0, 86400000),
    OPT("log", "PSHARD_LOG", PS_OPT_STRING, "warn",
        "log level of pshardrun and its children: error|warn|info|debug|trace", log, 0, 0),
    OPT("coordinator-bin", "PSHARD_COORDINATOR_BIN", PS_OPT_STRING, NULL,
        "path of pshard-coordinator (default: beside pshardrun, then PATH)", coordinator_bin, 0, 0),
    OPT("server-bin", "PSHARD_SERVER_BIN", PS_OPT_STRING, NULL,
        "path of pshard-server (default: beside pshardrun, then PATH)", server_bin, 0, 0),
    OPT("start-timeout-ms", "PSHARD_START_TIMEOUT_MS", PS_OPT_INT, "30000",
        "give up if the coordinator or a server has not written its port file by then",
        start_timeout_ms, 1, 86400000),
    OPT("stop-grace-ms", "PSHARD_STOP_GRACE_MS", PS_OPT_INT, "5000",
        "after SIGTERM, wait this long before SIGKILL", stop_grace_ms, 0, 3600000),
    OPT("checkpoint-dir", "PSHARD_CHECKPOINT_DIR", PS_OPT_STRING, NULL,
        "checkpoint root of the shard servers (default: --resume's)", checkpoint_dir, 0, 0),
    OPT("checkpoint-every", "PSHARD_CHECKPOINT_EVERY", PS_OPT_INT, "0",
        "save a checkpoint after every Kth optimizer step (0: only when asked)", checkpoint_every,
        0, INT64_MAX),
    OPT("checkpoint-keep", "PSHARD_CHECKPOINT_KEEP", PS_OPT_INT, "3",
        "committed checkpoints kept, newest first", checkpoint_keep, 1, 1000000),
    OPT("resume", "PSHARD_RESUME", PS_OPT_STRING, NULL,
        "restart from the newest committed checkpoint under this root (any world size)", resume, 0,
        0),
    OPT("resume-allow-fresh", "PSHARD_RESUME_ALLOW_FRESH", PS_OPT_BOOL, "false",
        "when every checkpoint under the root is refused (corrupt, a link, another step), "
        "start from the initial values with a warning instead of failing",
        resume_allow_fresh, 0, 0),
    OPT("rdzv-id", "PSHARD_JOB", PS_OPT_STRING, NULL,
        "job id on the coordinator (torchrun's --rdzv-id): this job's members, ranks and store "
        "keys are its own, so jobs sharing a --coordinator never meet (default: a fresh id per "
        "run with --coordinator, the coordinator's default job without)",
        rdzv_id, 0, 0),
    OPT("max-restarts", "PSHARD_MAX_RESTARTS", PS_OPT_INT, "0",
        "restarts allowed in all (torchrun's --max-restarts): a trainer that fails while the "
        "coordinator and every shard server run is replaced alone (see --replace-timeout-ms); "
        "any other failure stops everything and starts it again, resuming from the newest "
        "checkpoint under --checkpoint-dir (or --resume) when there is one; trainers see the "
        "restarts so far in PSHARD_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT",
        max_restarts, 0, 1000000),
    OPT("replace-timeout-ms", "PSHARD_REPLACE_TIMEOUT_MS", PS_OPT_INT, "60000",
        "with --max-restarts: the shard servers keep a failed trainer's state this long while "
        "its replacement starts (pshard-server --trainer-replace-ms); 0: no replacement, any "
        "failure restarts everything",
        replace_timeout_ms, 0, 86400000),
};

const size_t run_noptions = PS_ARRAY_LEN(run_options);

/* Checks option values the config table cannot. Returns 0, or 2 after printing why. */
int run_check_opts(run_t *run, run_opts_t *o)
{
    ps_log_level_t level;
    if (!ps_log_parse_level(o->log, &level)) {
        fprintf(stderr, RUN_PROG ": --log '%s' is not error|warn|info|debug|trace\n", o->log);
        return 2;
    }
    ps_log_set_level(level);
    if (strcmp(o->backend, "tcp") != 0 && strcmp(o->backend, "nccl") != 0) {
        fprintf(stderr, RUN_PROG ": --backend '%s' is not tcp or nccl\n", o->backend);
        return 2;
    }
    if (strcmp(o->offload, "none") != 0 && strcmp(o->offload, "cpu") != 0) {
        fprintf(stderr, RUN_PROG ": --offload '%s' is not none or cpu\n", o->offload);
        return 2;
    }
    if (o->token_file && access(o->token_file, R_OK) != 0) {
        fprintf(stderr, RUN_PROG ": --token-file %s: %s\n", o->token_file, strerror(errno));
        return 2;
    }
    run->nnodes = (int)o->nnodes;
    run->node_rank = (int)o->node_rank;
    if (o->nproc_per_node > 0) {
        if (o->nproc != 1 && o->nproc != o->nproc_per_node) {
            fprintf(stderr, RUN_PROG ": --nproc %lld and --nproc-per-node %lld differ: give one\n",
                    (long long)o->nproc, (long long)o->nproc_per_node);
            return 2;
        }
        o->nproc = o->nproc_per_node;
    }
    if (o->node_rank >= o->nnodes) {
        fprintf(stderr, RUN_PROG ": --node-rank %lld is not below --nnodes %lld\n",
                (long long)o->node_rank, (long long)o->nnodes);
        return 2;
    }
    if (o->nnodes > 1 && !o->rdzv_endpoint && !o->coordinator) {
        fprintf(stderr,
                RUN_PROG ": --nnodes %lld needs --rdzv-endpoint HOST:PORT (where node "
                         "rank 0 starts the coordinator) or --coordinator\n",
                (long long)o->nnodes);
        return 2;
    }
    if (o->nnodes > 1 && o->max_restarts > 0) {
        fprintf(stderr, RUN_PROG ": --max-restarts with --nnodes > 1 is not supported yet (a "
                                 "restart is not coordinated across nodes)\n");
        return 2;
    }
    if (o->nnodes > 1 && o->coordinator && !o->rdzv_id) {
        /* Each node would make up a job id of its own, and the nodes would never meet. */
        fprintf(stderr,
                RUN_PROG ": --nnodes %lld with --coordinator needs --rdzv-id (the same "
                         "on every node)\n",
                (long long)o->nnodes);
        return 2;
    }
    if (o->rdzv_endpoint && o->coordinator) {
        fprintf(stderr, RUN_PROG ": give --rdzv-endpoint or --coordinator, not both\n");
        return 2;
    }
    if (o->rdzv_endpoint && o->nproc * o->nnodes > 65536) {
        fprintf(stderr, RUN_PROG ": %lld nodes of %lld are more than 65536 ranks\n",
                (long long)o->nnodes, (long long)o->nproc);
        return 2;
    }
    if (o->rdzv_endpoint) {
        if (run_parse_coordinator(run, o->rdzv_endpoint, o->node_rank == 0) != 0) {
            fprintf(stderr, RUN_PROG ": --rdzv-endpoint '%s' is not HOST:PORT\n", o->rdzv_endpoint);
            return 2;
        }
        run->endpoint = o->node_rank == 0;
        if (o->nnodes > 1 && run_local_address(run) != 0)
            return 2;
    }
    if (o->coordinator && run_parse_coordinator(run, o->coordinator, false) != 0) {
        fprintf(stderr, RUN_PROG ": --coordinator '%s' is not HOST:PORT\n", o->coordinator);
        return 2;
    }
    if (o->coordinator && o->lease_ms > 0)
        fprintf(stderr, RUN_PROG ": --lease-ms is ignored with --coordinator (the running "
                                 "coordinator's lease applies)\n");
    if (o->rdzv_id) {
        size_t len = strlen(o->rdzv_id);
        bool ok = len >= 1 && len <= 64;
        for (size_t i = 0; ok && i < len; i++)
            ok = isalnum((unsigned char)o->rdzv_id[i]) || strchr("._-", o->rdzv_id[i]);
        if (!ok) {
            fprintf(stderr, RUN_PROG ": --rdzv-id '%s' must be 1 to 64 of A-Z a-z 0-9 . _ -\n",
                    o->rdzv_id);
            return 2;
        }
        ps_strlcpy(run->job, o->rdzv_id, sizeof(run->job));
    } else if (o->coordinator) {
        /* A coordinator others may use too: a job of our own, never one that ran before. */
        char host[64] = "host";
        gethostname(host, sizeof(host) - 1);
        host[sizeof(host) - 1] = '\0';
        for (char *h = host; *h; h++)
            if (!isalnum((unsigned char)*h) && *h != '-')
                *h = '-';
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ps_snprintf(run->job, sizeof(run->job), "pshardrun-%.24s-%d-%llx", host, (int)getpid(),
                    (unsigned long long)ts.tv_sec * 1000000ull +
                        (unsigned long long)ts.tv_nsec / 1000);
    }
    if (run->job[0] && !o->rdzv_id)
        fprintf(stderr, RUN_PROG ": job %s on coordinator %s (pshardctl --job %s status)\n",
                run->job, o->coordinator, run->job);
    return 0;
}
