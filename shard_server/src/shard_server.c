/* The shard server's lifecycle: pshard_shard_server_start checks the configuration, starts the
 * gRPC service (shard_service.c), the lease, the communicator's set-up, the Watch and health
 * threads and the metrics endpoint; pshard_shard_server_stop ends them in order and frees all. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pshard/collectives.h"
#include "pshard/coord_client.h"
#include "pshard/log.h"
#include "pshard/metrics.h"
#include "pshard/rpc.h"
#include "pshard/shard_server.h"
#include "pshard/util.h"

#include "shard_cuda.h"
#include "shard_heal.h"
#include "shard_internal.h"
#include "shard_shm.h"

static const char *own(pshard_shard_server_t *s, int slot, const char *v)
{
    s->strings[slot] = v ? strdup(v) : NULL;
    return s->strings[slot];
}

int pshard_shard_server_port(const pshard_shard_server_t *s)
{
    return ps_rpc_server_port(s->srv);
}

int pshard_shard_server_metrics_port(const pshard_shard_server_t *s)
{
    return s->metrics ? ps_metrics_server_port(s->metrics) : 0;
}

pshard_status_t pshard_shard_server_error(const pshard_shard_server_t *s, char *err, size_t errlen)
{
    pshard_shard_server_t *m = (pshard_shard_server_t *)s;
    pthread_mutex_lock(&m->mu);
    pshard_status_t st = m->fatal;
    if (st != PSHARD_OK)
        ps_errf(err, errlen, st, "%s", m->fatal_msg);
    pthread_mutex_unlock(&m->mu);
    return st;
}

/* What one model may take by default: the machine's memory, or the cgroup v2 limit of this
 * process (a container's) when that is smaller. 0 when neither is known (no cap). */
static uint64_t machine_memory(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    uint64_t mem = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    FILE *f = fopen("/sys/fs/cgroup/memory.max", "re");
    if (f) {
        unsigned long long lim;
        if (fscanf(f, "%llu", &lim) == 1 && lim > 0 && (mem == 0 || lim < mem))
            mem = lim; /* "max" (no limit) does not parse */
        fclose(f);
    }
    return mem;
}

pshard_shard_server_t *pshard_shard_server_start(const pshard_shard_server_config_t *cfg, char *err,
                                                 size_t errlen)
{
    if (!cfg->coordinator || !cfg->listen || !cfg->name) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "a shard server needs --coordinator, --listen and --name");
        return NULL;
    }
    const char *backend = cfg->backend ? cfg->backend : "tcp";
    const char *offload = cfg->offload ? cfg->offload : "none";
    if (strcmp(backend, "tcp") != 0 && strcmp(backend, "nccl") != 0) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "--backend must be tcp or nccl");
        return NULL;
    }
    if (strcmp(offload, "none") != 0 && strcmp(offload, "cpu") != 0) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "--offload must be none or cpu");
        return NULL;
    }
    const char *transport = cfg->transport ? cfg->transport : "auto";
    if (strcmp(transport, "auto") != 0 && strcmp(transport, "tcp") != 0 &&
        strcmp(transport, "shm") != 0) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "--transport (PSHARD_TRANSPORT) must be auto, tcp or shm, not '%.64s'", transport);
        return NULL;
    }
    if (cfg->socket_ifname && *cfg->socket_ifname) {
        char addr[64], why[PSHARD_ERRLEN] = "";
        if (pshard_socket_ifname_address(cfg->socket_ifname, addr, sizeof(addr), why,
                                         sizeof(why)) != PSHARD_OK) {
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "--socket-ifname: %s", why);
            return NULL;
        }
    }
    const char *shard_memory = cfg->shard_memory ? cfg->shard_memory : "auto";
    bool nccl = strcmp(backend, "nccl") == 0, cpu_offload = strcmp(offload, "cpu") == 0;
    if (strcmp(shard_memory, "auto") != 0 && strcmp(shard_memory, "host") != 0 &&
        strcmp(shard_memory, "gpu") != 0) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "--shard-memory (PSHARD_SHARD_MEMORY) must be auto, host or gpu, not '%.64s'",
                shard_memory);
        return NULL;
    }
    bool want_gpu = strcmp(shard_memory, "gpu") == 0;
    if (want_gpu && cpu_offload) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "--shard-memory gpu keeps the shards in GPU memory and --offload cpu in host "
                "memory: give one of them");
        return NULL;
    }
    if (nccl && strcmp(shard_memory, "host") == 0)
        offload = "cpu"; /* the same placement, under the name the rest of the server knows */
    if (strcmp(shard_memory, "auto") == 0)
        want_gpu = nccl && !cpu_offload;
    /* Shard objects of servers that died without freeing their models (SIGKILL, a crash). */
    shard_shm_sweep();
    /* The tests' host emulation of GPU memory (shard_cuda.h) stands in for it on tcp: where
     * the shards would be on a GPU, and with --shard-memory auto where they would otherwise be
     * in host memory (so the CPU suite runs the GPU-resident paths unchanged). */
    bool emulate = !nccl && getenv("PSHARD_TEST_EMULATE_DEVICE") &&
                   strcmp(getenv("PSHARD_TEST_EMULATE_DEVICE"), "1") == 0 &&
                   (want_gpu || (strcmp(shard_memory, "auto") == 0 && !cpu_offload));
    /* NCCL and the CUDA runtime are loaded now (dlopen), not linked, so a missing one is
     * named here with its package rather than by the dynamic linker at every start. */
    if (nccl && pshard_nccl_load(err, errlen) != PSHARD_OK)
        return NULL;
    const shard_dev_ops_t *cuda_ops = NULL;
    if (want_gpu && !emulate) {
        char why[PSHARD_ERRLEN] = "";
        cuda_ops = shard_dev_cuda(why, sizeof(why));
        if (!cuda_ops) {
            if (nccl)
                ps_errf(err, errlen, PSHARD_ERR_UNIMPLEMENTED,
                        "--backend nccl with --offload none keeps shards and optimizer state in "
                        "GPU memory, which needs the CUDA kernels, but %s; or run --backend nccl "
                        "--offload cpu (slices and optimizer state in pinned host memory, "
                        "collectives on the GPU through NCCL, like FSDP's CPUOffload)",
                        why);
            else
                ps_errf(err, errlen, PSHARD_ERR_UNIMPLEMENTED,
                        "--shard-memory gpu keeps shards and optimizer state in GPU memory, "
                        "which needs the CUDA kernels, but %s; or leave the shards in host "
                        "memory (--shard-memory auto)",
                        why);
            return NULL;
        }
    }
    if ((nccl || cuda_ops) && pshard_cuda_check_device(cfg->device, err, errlen) != PSHARD_OK) {
        size_t used = strlen(err);
        if (used + 1 < errlen)
            snprintf(err + used, errlen - used, " (%s needs a GPU; --device %d)",
                     nccl ? "--backend nccl" : "--shard-memory gpu", cfg->device);
        return NULL;
    }
    pshard_shard_server_t *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->cfg = *cfg;
    s->cfg.coordinator = own(s, 0, cfg->coordinator);
    s->cfg.listen = own(s, 1, cfg->listen);
    s->cfg.advertise = own(s, 2, cfg->advertise);
    s->cfg.name = own(s, 3, cfg->name);
    s->cfg.node = own(s, 4, cfg->node);
    s->cfg.backend = own(s, 5, backend);
    s->cfg.offload = own(s, 6, offload);
    s->cfg.shard_memory = own(s, 15, shard_memory);
    /* Shards in GPU memory (or the tests' host emulation of it); NULL: host memory. */
    s->dev = emulate ? &shard_dev_emulated : cuda_ops;
    if (s->dev && s->dev->host_memory)
        PS_WARN(PS_SUB_SHARD, "PSHARD_TEST_EMULATE_DEVICE=1: shards in host memory standing in "
                              "for GPU memory (a test mode)");
    s->cfg.data_host = own(s, 7, cfg->data_host);
    s->cfg.token = own(s, 8, cfg->token);
    s->cfg.checkpoint_dir = own(s, 9, cfg->checkpoint_dir);
    s->cfg.resume = own(s, 10, cfg->resume);
    s->cfg.job = own(s, 11, cfg->job);
    s->cfg.transport = own(s, 12, transport);
    s->cfg.socket_ifname = own(s, 13, cfg->socket_ifname);
    s->cfg.trace_dir = own(s, 14, cfg->trace_dir);
    s->max_model_bytes =
        cfg->max_model_memory > 0 ? (uint64_t)cfg->max_model_memory : machine_memory();
    if (s->cfg.checkpoint_keep <= 0)
        s->cfg.checkpoint_keep = 3;
    s->rank = -1;
    s->heal_rank = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_mutex_init(&s->op_mu, NULL);
    pthread_mutex_init(&s->health_mu, NULL);
    shard_steps_init(&s->steps);
    atomic_init(&s->stop, false);
    atomic_init(&s->serving, 2);
    atomic_init(&s->region_reads, 0);
    s->started_ns = ps_now_ns();

    ps_rpc_server_config_t rcfg = {
        .listen = cfg->listen,
        .tls_cert_file = cfg->tls_cert_file,
        .tls_key_file = cfg->tls_key_file,
        .tls_client_ca_file = cfg->tls_client_ca_file,
        .token = cfg->token,
        .max_message_bytes = cfg->max_message_bytes,
        .worker_threads = 4,
        .cq_threads = 1,
    };
    s->srv = ps_rpc_server_create(&rcfg, err, errlen);
    if (!s->srv) {
        pshard_shard_server_stop(s);
        return NULL;
    }
    shard_service_add_methods(s);
    if (ps_rpc_server_start(s->srv) < 0) {
        ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot start the gRPC server");
        pshard_shard_server_stop(s);
        return NULL;
    }
    ps_rpc_server_set_health(s->srv, "pshard.ShardServer", 2);
    /* Advertise HOST:PORT with the port actually bound. */
    char host[256];
    ps_strlcpy(host, cfg->advertise ? cfg->advertise : cfg->listen, sizeof(host));
    char *colon = strrchr(host, ':');
    if (colon)
        *colon = '\0';
    if (strcmp(host, "0.0.0.0") == 0 || host[0] == '\0')
        ps_strlcpy(host, "127.0.0.1", sizeof(host));
    snprintf(s->advertise, sizeof(s->advertise), "%s:%d", host, ps_rpc_server_port(s->srv));

    ps_rpc_channel_config_t ccfg = {.target = cfg->coordinator,
                                    .token = cfg->token,
                                    .tls_ca_file = cfg->coord_tls_ca_file,
                                    .job = cfg->job,
                                    /* Status of a large job is larger than 4 MiB */
                                    .max_message_bytes = 64 << 20};
    s->coord = ps_rpc_channel_create(&ccfg, err, errlen);
    if (!s->coord) {
        pshard_shard_server_stop(s);
        return NULL;
    }
    if (shard_lease_start(s, err, errlen) != PSHARD_OK) {
        pshard_shard_server_stop(s);
        return NULL;
    }
    if (pthread_create(&s->setup_thread, NULL, shard_setup_main, s) == 0)
        s->setup_started = true;
    if (pthread_create(&s->watch_thread, NULL, shard_watch_main, s) == 0)
        s->watch_started = true;
    if (pthread_create(&s->monitor_thread, NULL, shard_monitor_main, s) == 0)
        s->monitor_started = true;
    if (cfg->metrics_listen && *cfg->metrics_listen) {
        s->metrics =
            ps_metrics_server_start(cfg->metrics_listen, shard_metrics_collect, s, err, errlen);
        if (!s->metrics) {
            pshard_shard_server_stop(s);
            return NULL;
        }
    }
    return s;
}

void pshard_shard_server_stop(pshard_shard_server_t *s)
{
    if (!s)
        return;
    atomic_store(&s->stop, true);
    s->stop_flag = 1;
    s->ring_cancel = 1;
    pthread_mutex_lock(&s->mu);
    pthread_cond_broadcast(&s->cv);
    pshard_comm_t *comm = s->comm;
    pthread_mutex_unlock(&s->mu);
    /* Release a trainer operation blocked in a collective before joining anything. */
    if (comm)
        pshard_comm_abort(comm, "shard server stopping");
    shard_pgs_abort(s, -1, PSHARD_ERR_ABORTED, "shard server stopping");
    if (s->setup_started)
        pthread_join(s->setup_thread, NULL);
    /* The health monitor pokes the lease: it ends first. */
    if (s->monitor_started)
        pthread_join(s->monitor_thread, NULL);
    /* Ends the heartbeats and leaves the job. */
    ps_coord_lease_stop(s->lease);
    s->lease = NULL;
    if (s->watch_started)
        pthread_join(s->watch_thread, NULL);
    /* Scrapes read the RPC server's counters: end them first. */
    ps_metrics_server_stop(s->metrics);
    ps_rpc_server_destroy(s->srv);
    ps_rpc_channel_destroy(s->coord);
    pshard_comm_destroy(s->comm);
    shard_unmap(&s->scratch);
    shard_unmap(&s->model_shm);
    shard_unmap(&s->pending_model);
    shard_model_free(s->model);
    shard_heal_state_free(s->heal);
    shard_pgs_clear(s);
    shard_pairs_clear(s);
    shard_bufs_free(&s->bufs);
    for (size_t i = 0; i < 16; i++)
        free(s->strings[i]);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->op_mu);
    pthread_mutex_destroy(&s->health_mu);
    shard_steps_destroy(&s->steps);
    free(s);
}
