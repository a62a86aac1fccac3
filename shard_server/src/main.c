/* pshard-server: parses flags and environment, starts a shard server, prints "listening on
 * HOST:PORT", and leaves the cluster cleanly on SIGTERM or SIGINT. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pshard/atomic_file.h"
#include "pshard/config.h"
#include "pshard/log.h"
#include "pshard/metrics.h"
#include "pshard/rpc.h"
#include "pshard/shard_server.h"
#include "pshard/util.h"

typedef struct {
    char *coordinator;
    char *listen;
    char *advertise;
    char *port_file;
    char *name;
    char *job;
    char *node;
    char *backend;
    char *offload;
    char *shard_memory;
    char *transport;
    char *data_host;
    char *socket_ifname;
    char *token_file;
    char *tls_cert;
    char *tls_key;
    char *tls_client_ca;
    char *coordinator_ca;
    int64_t coll_timeout_ms;
    int64_t form_timeout_ms;
    int64_t device;
    char *log;
    char *checkpoint_dir;
    int64_t checkpoint_every;
    int64_t checkpoint_keep;
    char *resume;
    bool resume_allow_fresh;
    int64_t max_model_memory;
    char *metrics_listen;
    char *metrics_port_file;
    int64_t trainer_replace_ms;
    char *trace_dir;
} server_opts_t;

#define OPT(flag, env, type, def, help, field, lo, hi)                                             \
    {                                                                                              \
        flag, env, type, def, help, offsetof(server_opts_t, field), lo, hi                         \
    }

static const ps_option_t options[] = {
    OPT("coordinator", "PSHARD_COORDINATOR", PS_OPT_STRING, NULL,
        "coordinator HOST:PORT (default MASTER_ADDR:MASTER_PORT)", coordinator, 0, 0),
    OPT("listen", "PSHARD_SERVER_LISTEN", PS_OPT_STRING, "127.0.0.1:0",
        "address trainers connect to; port 0 picks a free port", listen, 0, 0),
    OPT("advertise", "PSHARD_ADVERTISE", PS_OPT_STRING, NULL,
        "address registered with the coordinator (default: the listen address)", advertise, 0, 0),
    OPT("port-file", "PSHARD_PORT_FILE", PS_OPT_STRING, NULL,
        "write the bound port to this file once serving", port_file, 0, 0),
    OPT("name", "PSHARD_NAME,POD_NAME,HOSTNAME", PS_OPT_STRING, NULL,
        "stable member name; a restart under the same name gets its rank back", name, 0, 0),
    OPT("job", "PSHARD_JOB", PS_OPT_STRING, NULL,
        "job id on the coordinator (torchrun's --rdzv-id): members, ranks and store keys are "
        "the job's own (default: the coordinator's job \"default\")",
        job, 0, 0),
    OPT("node", "PSHARD_NODE,NODE_NAME", PS_OPT_STRING, NULL, "node name shown in status", node, 0,
        0),
    OPT("backend", "PSHARD_BACKEND", PS_OPT_STRING, "tcp", "collectives backend: tcp or nccl",
        backend, 0, 0),
    OPT("offload", "PSHARD_OFFLOAD", PS_OPT_STRING, "none",
        "where shards live: none (host memory with tcp; GPU memory with nccl) or "
        "cpu (host memory, pinned with nccl)",
        offload, 0, 0),
    OPT("shard-memory", "PSHARD_SHARD_MEMORY", PS_OPT_STRING, "auto",
        "where the shards live: auto (GPU memory with nccl unless --offload cpu, else host "
        "memory), host, or gpu (on --device; with tcp the collectives copy this rank's slices "
        "through host memory, so several servers can share one GPU)",
        shard_memory, 0, 0),
    OPT("transport", "PSHARD_TRANSPORT", PS_OPT_STRING, "auto",
        "how the tcp backend moves data between shard servers: auto (read each other's memory "
        "when every server is on this host and may, else the sockets), tcp or shm",
        transport, 0, 0),
    OPT("data-host", "PSHARD_DATA_HOST", PS_OPT_STRING, "127.0.0.1",
        "interface the collectives listen on", data_host, 0, 0),
    OPT("socket-ifname", "PSHARD_SOCKET_IFNAME", PS_OPT_STRING, NULL,
        "listen for the collectives on this network interface's IPv4 address instead (eth0; a "
        "comma list: the first that has one), as GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME",
        socket_ifname, 0, 0),
    OPT("token-file", "PSHARD_TOKEN_FILE", PS_OPT_STRING, NULL, "file holding the cluster token",
        token_file, 0, 0),
    OPT("tls-cert", "PSHARD_TLS_CERT", PS_OPT_STRING, NULL, "PEM certificate for trainers",
        tls_cert, 0, 0),
    OPT("tls-key", "PSHARD_TLS_KEY", PS_OPT_STRING, NULL, "PEM key of --tls-cert", tls_key, 0, 0),
    OPT("tls-client-ca", "PSHARD_TLS_CLIENT_CA", PS_OPT_STRING, NULL,
        "require trainer certificates signed by this CA", tls_client_ca, 0, 0),
    OPT("coordinator-ca", "PSHARD_COORDINATOR_CA", PS_OPT_STRING, NULL,
        "CA that signed the coordinator's TLS certificate", coordinator_ca, 0, 0),
    OPT("coll-timeout-ms", "PSHARD_COLL_TIMEOUT_MS", PS_OPT_INT, "600000",
        "timeout of each collective", coll_timeout_ms, 1, 86400000),
    OPT("form-timeout-ms", "PSHARD_FORM_TIMEOUT_MS", PS_OPT_INT, "0",
        "give up if the cluster has not formed by then (0: wait)", form_timeout_ms, 0, 86400000),
    OPT("device", "LOCAL_RANK", PS_OPT_INT, "0",
        "CUDA device for --backend nccl and --shard-memory gpu", device, 0, 1024),
    OPT("log", "PSHARD_LOG", PS_OPT_STRING, "warn", "log level: error|warn|info|debug|trace", log,
        0, 0),
    OPT("checkpoint-dir", "PSHARD_CHECKPOINT_DIR", PS_OPT_STRING, NULL,
        "checkpoint root shared by all shard servers (default: --resume's)", checkpoint_dir, 0, 0),
    OPT("checkpoint-every", "PSHARD_CHECKPOINT_EVERY", PS_OPT_INT, "0",
        "save a checkpoint after every Kth optimizer step (0: only when asked)", checkpoint_every,
        0, INT64_MAX),
    OPT("checkpoint-keep", "PSHARD_CHECKPOINT_KEEP", PS_OPT_INT, "3",
        "committed checkpoints kept, newest first", checkpoint_keep, 1, 1000000),
    OPT("resume", "PSHARD_RESUME", PS_OPT_STRING, NULL,
        "restore the newest committed checkpoint under this root (any world size)", resume, 0, 0),
    OPT("resume-allow-fresh", "PSHARD_RESUME_ALLOW_FRESH", PS_OPT_BOOL, "false",
        "with --resume: start from the initial values when every checkpoint there is refused "
        "(default: fail, naming what was refused)",
        resume_allow_fresh, 0, 0),
    OPT("max-model-memory", "PSHARD_MAX_MODEL_MEMORY", PS_OPT_INT, "0",
        "bytes one model may take on this server (shards, optimizer states, its region); a "
        "larger DefineModel is refused before anything is allocated (0: the machine's memory "
        "or the cgroup's limit)",
        max_model_memory, 0, INT64_MAX),
    OPT("metrics-listen", "PSHARD_METRICS_LISTEN", PS_OPT_STRING, NULL,
        "serve Prometheus metrics at http://HOST:PORT/metrics; port 0 picks a free port "
        "(default: no metrics listener)",
        metrics_listen, 0, 0),
    OPT("metrics-port-file", "PSHARD_METRICS_PORT_FILE", PS_OPT_STRING, NULL,
        "write the bound metrics port to this file once serving", metrics_port_file, 0, 0),
    OPT("trainer-replace-ms", "PSHARD_TRAINER_REPLACE_MS", PS_OPT_INT, "0",
        "keep a lost trainer's rank and wait this long for its replacement (pshardrun "
        "--max-restarts): the step in flight aborts on every rank and training goes on when "
        "the new trainer attaches (0: a lost trainer ends the job)",
        trainer_replace_ms, 0, 86400000),
    OPT("trace-dir", "PSHARD_TRACE_DIR", PS_OPT_STRING, NULL,
        "on a collective timeout or abort, write this rank's flight records as JSON to "
        "DIR/pshard-trace-rank-R.json (read them with pshardctl trace analyze DIR)",
        trace_dir, 0, 0),
};

int main(int argc, char **argv)
{
    ps_rpc_block_signals();
    ps_log_init("server");
    server_opts_t o;
    ps_config_result_t res;
    char err[PSHARD_ERRLEN] = "";
    int rc = 0;
    char *token = NULL;
    char default_coord[300];
    pshard_shard_server_t *srv = NULL;
    int start = ps_config_main(options, PS_ARRAY_LEN(options), argc, argv, &o, &res,
                               "pshard-server", "[OPTIONS]",
                               "Owns one rank's shards of the model, runs the collectives with the "
                               "other shard servers and serves its local trainer.",
                               false);
    if (start >= 0) {
        rc = start;
        goto out;
    }
    if (!o.coordinator) {
        ps_default_coordinator(default_coord, sizeof(default_coord));
        o.coordinator = strdup(default_coord);
    }
    if (!o.name || !*o.name) {
        fprintf(stderr, "pshard-server: --name (or PSHARD_NAME, POD_NAME, HOSTNAME) is required\n");
        rc = 2;
        goto out;
    }
    if (o.token_file) {
        token = ps_read_token(o.token_file, err, sizeof(err));
        if (!token) {
            fprintf(stderr, "pshard-server: --token-file: %s\n", err);
            rc = 2;
            goto out;
        }
    }
    pshard_shard_server_config_t cfg = {
        .coordinator = o.coordinator,
        .job = o.job,
        .listen = o.listen,
        .advertise = o.advertise,
        .name = o.name,
        .node = o.node,
        .backend = o.backend,
        .offload = o.offload,
        .shard_memory = o.shard_memory,
        .transport = o.transport,
        .data_host = o.data_host,
        .socket_ifname = o.socket_ifname,
        .token = token,
        .tls_cert_file = o.tls_cert,
        .tls_key_file = o.tls_key,
        .tls_client_ca_file = o.tls_client_ca,
        .coord_tls_ca_file = o.coordinator_ca,
        .coll_timeout_ms = o.coll_timeout_ms,
        .form_timeout_ms = o.form_timeout_ms,
        .device = (int)o.device,
        .checkpoint_dir = o.checkpoint_dir ? o.checkpoint_dir : o.resume,
        .checkpoint_every = o.checkpoint_every,
        .checkpoint_keep = o.checkpoint_keep,
        .resume = o.resume,
        .resume_allow_fresh = o.resume_allow_fresh,
        .max_model_memory = o.max_model_memory,
        .metrics_listen = o.metrics_listen,
        .trainer_replace_ms = o.trainer_replace_ms,
        .trace_dir = o.trace_dir,
    };
    srv = pshard_shard_server_start(&cfg, err, sizeof(err));
    if (!srv) {
        fprintf(stderr, "pshard-server: %s\n", err);
        rc = strstr(err, "--") ? 2 : 1;
        goto out;
    }
    /* The metrics port first: a script that waits for the gRPC port file then finds it. */
    if (o.metrics_listen &&
        ps_announce_metrics("pshard-server", o.metrics_listen,
                            pshard_shard_server_metrics_port(srv), o.metrics_port_file) != 0) {
        rc = 1;
        goto out;
    }
    if (ps_announce_listening("pshard-server", o.listen, pshard_shard_server_port(srv),
                              o.port_file) != 0) {
        rc = 1;
        goto out;
    }
    int sig = ps_rpc_wait_for_signal();
    PS_INFO(PS_SUB_MAIN, "signal %d: leaving the cluster", sig);
out:
    pshard_shard_server_stop(srv);
    free(token);
    ps_config_free(options, PS_ARRAY_LEN(options), &o);
    return rc;
}
