/* pshard-coordinator: parses flags and environment, starts the coordinator service, prints
 * "listening on HOST:PORT", and shuts down cleanly on SIGTERM or SIGINT. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pshard/atomic_file.h"
#include "pshard/config.h"
#include "coord_metrics.h"
#include "pshard/coordinator.h"
#include "pshard/log.h"
#include "pshard/metrics.h"
#include "pshard/rdzv_file.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

typedef struct {
    char *listen;
    char *port_file;
    char *token_file;
    char *tls_cert;
    char *tls_key;
    char *tls_client_ca;
    int64_t world_size;
    char *nnodes;
    int64_t last_call_ms;
    int64_t lease_ms;
    int64_t heartbeat_ms;
    int64_t max_message_bytes;
    int64_t store_wait_ms;
    int64_t job_linger_ms;
    int64_t threads;
    char *log;
    char *metrics_listen;
    char *metrics_port_file;
    char *rdzv_file;
    char *straggler_ratio;
    int64_t straggler_steps;
} coord_opts_t;

#define OPT(flag, env, type, def, help, field, lo, hi)                                             \
    {                                                                                              \
        flag, env, type, def, help, offsetof(coord_opts_t, field), lo, hi                          \
    }

static const ps_option_t options[] = {
    OPT("listen", "PSHARD_LISTEN", PS_OPT_STRING, "0.0.0.0:29500",
        "address to serve on; port 0 picks a free port (MASTER_PORT sets the port)", listen, 0, 0),
    OPT("port-file", "PSHARD_PORT_FILE", PS_OPT_STRING, NULL,
        "write the bound port to this file once serving", port_file, 0, 0),
    OPT("rdzv-file", "PSHARD_RDZV_FILE", PS_OPT_STRING, NULL,
        "rendezvous file (init_method file://PATH): write HOST:PORT into it once serving, for "
        "trainers to find this coordinator; it must be absent or empty at start, and is "
        "emptied at a clean stop",
        rdzv_file, 0, 0),
    OPT("token-file", "PSHARD_TOKEN_FILE", PS_OPT_STRING, NULL,
        "file holding the cluster token clients must send as 'authorization: Bearer'", token_file,
        0, 0),
    OPT("tls-cert", "PSHARD_TLS_CERT", PS_OPT_STRING, NULL, "PEM server certificate (enables TLS)",
        tls_cert, 0, 0),
    OPT("tls-key", "PSHARD_TLS_KEY", PS_OPT_STRING, NULL, "PEM private key of --tls-cert", tls_key,
        0, 0),
    OPT("tls-client-ca", "PSHARD_TLS_CLIENT_CA", PS_OPT_STRING, NULL,
        "PEM CA; clients must present a certificate it signed (mTLS)", tls_client_ca, 0, 0),
    OPT("world-size", "PSHARD_WORLD_SIZE,WORLD_SIZE", PS_OPT_INT, "1",
        "number of shard servers the cluster forms with", world_size, 1, 65536),
    OPT("nnodes", "PSHARD_NNODES", PS_OPT_STRING, NULL,
        "MIN:MAX shard servers, like torchrun (overrides --world-size)", nnodes, 0, 0),
    OPT("last-call-ms", "PSHARD_LAST_CALL_MS", PS_OPT_INT, "30000",
        "with --nnodes MIN:MAX, wait this long after MIN registered for more", last_call_ms, 0,
        86400000),
    OPT("lease-ms", "PSHARD_LEASE_MS", PS_OPT_INT, "5000",
        "a member not heard from for this long is evicted", lease_ms, 10, 86400000),
    OPT("heartbeat-ms", "PSHARD_HEARTBEAT_MS", PS_OPT_INT, "1000",
        "heartbeat interval members are told to use", heartbeat_ms, 1, 86400000),
    OPT("max-message-bytes", "PSHARD_MAX_MESSAGE_BYTES", PS_OPT_INT, "4194304",
        "largest request accepted", max_message_bytes, 4096, 1073741824),
    OPT("store-wait-ms", "PSHARD_STORE_WAIT_MS", PS_OPT_INT, "300000",
        "default timeout of a store wait that names none", store_wait_ms, 1, 86400000),
    OPT("job-linger-ms", "PSHARD_JOB_LINGER_MS", PS_OPT_INT, "300000",
        "a job (other than \"default\") with no members, Watch or StoreWait for this long "
        "ends, and its store keys with it",
        job_linger_ms, 1, 86400000),
    OPT("threads", "PSHARD_THREADS", PS_OPT_INT, "4", "worker threads for slow handlers", threads,
        1, 256),
    OPT("log", "PSHARD_LOG", PS_OPT_STRING, "warn", "log level: error|warn|info|debug|trace", log,
        0, 0),
    OPT("straggler-ratio", "PSHARD_STRAGGLER_RATIO", PS_OPT_STRING, "1.5",
        "a rank whose median step compute time (last 50 steps) is at least this many times "
        "the median of all ranks' medians is slow: pshardctl status says so, and the log once "
        "it stayed slow for --straggler-steps steps (a number > 1)",
        straggler_ratio, 0, 0),
    OPT("straggler-steps", "PSHARD_STRAGGLER_STEPS", PS_OPT_INT, "10",
        "steps a rank's figures must cover before it is compared, and that it must stay slow "
        "before it is logged",
        straggler_steps, 1, 50),
    OPT("metrics-listen", "PSHARD_METRICS_LISTEN", PS_OPT_STRING, NULL,
        "serve Prometheus metrics at http://HOST:PORT/metrics; port 0 picks a free port "
        "(default: no metrics listener)",
        metrics_listen, 0, 0),
    OPT("metrics-port-file", "PSHARD_METRICS_PORT_FILE", PS_OPT_STRING, NULL,
        "write the bound metrics port to this file once serving", metrics_port_file, 0, 0),
};

/* Parses "MIN:MAX" (or "N") into min/max. */
static int parse_nnodes(const char *text, int *min, int *max)
{
    char buf[64];
    if (ps_strlcpy(buf, text, sizeof(buf)) != 0)
        return -1;
    char *colon = strchr(buf, ':');
    int64_t lo, hi;
    if (colon) {
        *colon = '\0';
        if (ps_parse_i64(buf, 1, 65536, &lo) != 0 || ps_parse_i64(colon + 1, 1, 65536, &hi) != 0)
            return -1;
    } else {
        if (ps_parse_i64(buf, 1, 65536, &lo) != 0)
            return -1;
        hi = lo;
    }
    if (lo > hi)
        return -1;
    *min = (int)lo;
    *max = (int)hi;
    return 0;
}

int main(int argc, char **argv)
{
    ps_rpc_block_signals();
    ps_log_init("coordinator");
    coord_opts_t o;
    ps_config_result_t res;
    char err[PSHARD_ERRLEN] = "";
    int exit_code = 0;
    pshard_coordinator_t *coord = NULL;
    ps_rdzv_file_t rdzv = {.fd = -1};
    ps_metrics_server_t *metrics = NULL;
    char *token = NULL;
    int start = ps_config_main(
        options, PS_ARRAY_LEN(options), argc, argv, &o, &res, "pshard-coordinator", "[OPTIONS]",
        "Tracks membership, rendezvous, Join state and timeouts for a pshard "
        "cluster, and serves a key/value store for bootstrapping collectives.",
        false);
    if (start >= 0) {
        exit_code = start;
        goto out;
    }

    /* torchrun's MASTER_PORT names the coordinator's port when --listen/PSHARD_LISTEN do not. */
    const char *master_port = getenv("MASTER_PORT");
    if (res.source[0] == PS_SRC_DEFAULT && master_port && *master_port) {
        int64_t port;
        if (ps_parse_i64(master_port, 0, 65535, &port) != 0) {
            fprintf(stderr, "pshard-coordinator: MASTER_PORT '%s' is not a port number\n",
                    master_port);
            exit_code = 2;
            goto out;
        }
        free(o.listen);
        o.listen = malloc(32);
        if (!o.listen) {
            exit_code = 1;
            goto out;
        }
        snprintf(o.listen, 32, "0.0.0.0:%d", (int)port);
    }
    int min_nodes = (int)o.world_size, max_nodes = (int)o.world_size;
    if (o.nnodes && parse_nnodes(o.nnodes, &min_nodes, &max_nodes) != 0) {
        fprintf(stderr,
                "pshard-coordinator: --nnodes '%s' is not N or MIN:MAX with 1 <= MIN <= "
                "MAX <= 65536\n",
                o.nnodes);
        exit_code = 2;
        goto out;
    }
    char *ratio_end = NULL;
    double straggler_ratio = o.straggler_ratio ? strtod(o.straggler_ratio, &ratio_end) : 1.5;
    if (o.straggler_ratio &&
        (ratio_end == o.straggler_ratio || *ratio_end || !isfinite(straggler_ratio) ||
         straggler_ratio <= 1 || straggler_ratio > 1000)) {
        fprintf(stderr, "pshard-coordinator: --straggler-ratio '%s' is not a number in (1, 1000]\n",
                o.straggler_ratio);
        exit_code = 2;
        goto out;
    }
    if ((o.tls_cert == NULL) != (o.tls_key == NULL)) {
        fprintf(stderr, "pshard-coordinator: --tls-cert and --tls-key go together\n");
        exit_code = 2;
        goto out;
    }
    if (o.tls_client_ca && !o.tls_cert) {
        fprintf(stderr, "pshard-coordinator: --tls-client-ca needs --tls-cert and --tls-key\n");
        exit_code = 2;
        goto out;
    }
    if (o.token_file) {
        token = ps_read_token(o.token_file, err, sizeof(err));
        if (!token) {
            fprintf(stderr, "pshard-coordinator: --token-file: %s\n", err);
            exit_code = 2;
            goto out;
        }
    }
    pshard_coordinator_config_t cfg = {
        .listen = o.listen,
        .token = token,
        .tls_cert_file = o.tls_cert,
        .tls_key_file = o.tls_key,
        .tls_client_ca_file = o.tls_client_ca,
        .min_nodes = min_nodes,
        .max_nodes = max_nodes,
        .last_call_ms = o.last_call_ms,
        .lease_ms = o.lease_ms,
        .heartbeat_ms = o.heartbeat_ms,
        .max_message_bytes = o.max_message_bytes,
        .store_wait_default_ms = o.store_wait_ms,
        .job_linger_ms = o.job_linger_ms,
        .worker_threads = (int)o.threads,
        .straggler_ratio = straggler_ratio,
        .straggler_steps = o.straggler_steps,
    };
    /* Claimed before serving: a file another run left is refused before anything starts. */
    if (o.rdzv_file && ps_rdzv_file_claim(&rdzv, o.rdzv_file, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "pshard-coordinator: --rdzv-file: %s\n", err);
        exit_code = 2;
        goto out;
    }
    coord = pshard_coordinator_start(&cfg, err, sizeof(err));
    if (!coord) {
        fprintf(stderr, "pshard-coordinator: %s\n", err);
        exit_code = 1;
        goto out;
    }
    if (o.metrics_listen && *o.metrics_listen) {
        metrics = coord_metrics_start(coord, o.metrics_listen, err, sizeof(err));
        if (!metrics) {
            fprintf(stderr, "pshard-coordinator: %s\n", err);
            exit_code = 1;
            goto out;
        }
        /* Before the gRPC port file: a script that waits for that one then finds this one. */
        if (ps_announce_metrics("pshard-coordinator", o.metrics_listen,
                                ps_metrics_server_port(metrics), o.metrics_port_file) != 0) {
            exit_code = 1;
            goto out;
        }
    }
    int port = pshard_coordinator_port(coord);
    if (o.rdzv_file) {
        /* The address trainers dial: the listen host, or this host's name for a wildcard. */
        char host[256], addr[320];
        const char *colon = strrchr(o.listen, ':');
        size_t hlen = colon ? (size_t)(colon - o.listen) : 0;
        snprintf(host, sizeof(host), "%.*s", (int)hlen, o.listen);
        if (!*host || strcmp(host, "0.0.0.0") == 0 || strcmp(host, "[::]") == 0) {
            if (gethostname(host, sizeof(host) - 1) != 0)
                snprintf(host, sizeof(host), "localhost");
            host[sizeof(host) - 1] = '\0';
        }
        snprintf(addr, sizeof(addr), "%s:%d", host, port);
        if (ps_rdzv_file_publish(&rdzv, addr, err, sizeof(err)) != PSHARD_OK) {
            fprintf(stderr, "pshard-coordinator: --rdzv-file: %s\n", err);
            exit_code = 1;
            goto out;
        }
    }
    if (ps_announce_listening("pshard-coordinator", o.listen, port, o.port_file) != 0) {
        exit_code = 1;
        goto out;
    }
    PS_INFO(PS_SUB_MAIN, "serving on port %d (nodes %d:%d, lease %lld ms)", port, min_nodes,
            max_nodes, (long long)o.lease_ms);

    int sig = ps_rpc_wait_for_signal();
    PS_INFO(PS_SUB_MAIN, "signal %d: shutting down", sig);

out:
    /* Scrapes read the coordinator: stop them first. */
    ps_metrics_server_stop(metrics);
    pshard_coordinator_stop(coord);
    ps_rdzv_file_release(&rdzv);
    free(token);
    ps_config_free(options, PS_ARRAY_LEN(options), &o);
    return exit_code;
}
