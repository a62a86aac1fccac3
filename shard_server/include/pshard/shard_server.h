/* The pshard shard server: registers with the coordinator, takes its rank when the cluster
 * forms, builds its communicator, owns slice r of every parameter (fp32 master weights,
 * gradient accumulator, optimizer state) and serves its local trainer. pshard-server's main()
 * is a thin wrapper so tests can run one in-process too. */
#ifndef PSHARD_SHARD_SERVER_H
#define PSHARD_SHARD_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pshard/status.h"

typedef struct pshard_shard_server pshard_shard_server_t;

typedef struct {
    const char *coordinator;   /* "HOST:PORT" of the coordinator */
    const char *job;           /* the job on the coordinator (torchrun's --rdzv-id); NULL: the
                                  coordinator's default job */
    const char *listen;        /* "HOST:PORT" for trainers; port 0 picks one */
    const char *advertise;     /* address registered with the coordinator (default: listen) */
    const char *name;          /* member name (stable across restarts, e.g. the pod name) */
    const char *node;          /* node name for status */
    const char *backend;       /* "tcp" or "nccl" */
    const char *offload;       /* "none" or "cpu" */
    const char *shard_memory;  /* where the shards live: "auto" (NULL: GPU memory with nccl
                                  unless offload is "cpu", else host memory), "host" (with
                                  nccl: as offload "cpu") or "gpu" (on `device`; with tcp the
                                  collectives stage this rank's slices through host memory,
                                  for several servers sharing one GPU) */
    const char *transport;     /* tcp backend: "auto", "tcp" or "shm" (collectives.h); NULL: auto */
    const char *data_host;     /* interface the collectives listen on (default 127.0.0.1) */
    const char *socket_ifname; /* or: listen on this network interface's IPv4 address ("eth0";
                                  a comma list: the first that has one); wins over data_host */
    const char *token;         /* cluster token, or NULL */
    const char *tls_cert_file, *tls_key_file, *tls_client_ca_file; /* trainer-facing TLS */
    const char *coord_tls_ca_file; /* to verify the coordinator's TLS certificate */
    int64_t coll_timeout_ms;       /* per-collective timeout; 0 = 10 minutes */
    int64_t form_timeout_ms;       /* how long to wait for the cluster to form; 0 = forever */
    int64_t max_message_bytes;
    int device;                 /* CUDA device for nccl and shard_memory "gpu" */
    const char *checkpoint_dir; /* where checkpoints are saved (shared by all ranks), or NULL */
    int64_t checkpoint_every;   /* save after every Kth optimizer step; 0 = only on request */
    int64_t checkpoint_keep;    /* committed checkpoints kept (newest); 0 = 3 */
    const char *resume;         /* restore the newest committed checkpoint under this root when
                                   the model is defined (any world size, either layout); NULL */
    bool resume_allow_fresh;
    int64_t max_model_memory; /* bytes one model's state may take on this server (shards,
                                 optimizer states, its region); 0 = the machine's memory or
                                 the cgroup's limit, whichever is smaller */  /* with resume: when every checkpoint there is refused (corrupt,
                                 a link, another step), start from the initial values with a
                                 warning instead of failing DefineModel */
    const char *metrics_listen; /* "HOST:PORT" for Prometheus' /metrics (port 0 picks one);
                                   NULL: no metrics listener */
    int64_t trainer_replace_ms; /* > 0: a lost trainer (its lease lapsed) aborts the step in
                                   flight on every rank, this server keeps the rank's state and
                                   its replacement may attach within this long; 0: a lost
                                   trainer ends the job (PEER_LOST) */
    const char *trace_dir;      /* on a collective timeout or abort, write the flight records
                                   to DIR/pshard-trace-rank-R.json (created if missing); NULL:
                                   no trace files */
} pshard_shard_server_config_t;

/* Starts serving trainers at once (health "pshard.ShardServer" is NOT_SERVING until the
 * cluster formed and the communicator is up), registers with the coordinator and brings the
 * rest up in the background. NULL with a message in err on a bad config or when the address
 * cannot be bound. Not thread-safe. */
pshard_shard_server_t *pshard_shard_server_start(const pshard_shard_server_config_t *cfg, char *err,
                                                 size_t errlen);

int pshard_shard_server_port(const pshard_shard_server_t *s);

/* The bound port of the metrics listener, or 0 without --metrics-listen. Thread-safe. */
int pshard_shard_server_metrics_port(const pshard_shard_server_t *s);

/* Fatal background error (lost coordinator, communicator failure at set-up), or PSHARD_OK. */
pshard_status_t pshard_shard_server_error(const pshard_shard_server_t *s, char *err, size_t errlen);

/* Leaves the cluster (Leave), stops serving, frees everything. NULL is a no-op. */
void pshard_shard_server_stop(pshard_shard_server_t *s);

#endif
