/* The pieces of a shard-server communicator that every file making one shares: its configuration
 * from the server's flags (the world's ring, shard_member.c; process groups and pairs,
 * shard_groups.c; an HSDP model's mesh, here), freeing the agreement and shadowing buffers kept
 * beside it, failing the world ring from another thread, the server's fatal error and its timed
 * waits. It calls no other file of the server, so membership -> operations -> process groups
 * and the heal (shard_heal.c) all reach it one way. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "pshard/log.h"
#include "pshard/util.h"

#include "shard_internal.h"

void shard_comm_config(const pshard_shard_server_t *s, pshard_comm_config_t *cc, const char *name,
                       int rank, int world, uint64_t generation)
{
    *cc = (pshard_comm_config_t){
        .rank = rank,
        .world_size = world,
        .backend = s->cfg.backend,
        .name = name,
        .coordinator = s->cfg.coordinator,
        .job = s->cfg.job,
        .listen_host = s->cfg.data_host ? s->cfg.data_host : "127.0.0.1",
        .token = s->cfg.token,
        .generation = generation,
        .timeout_ms = s->cfg.coll_timeout_ms,
        .connect_timeout_ms = 120000,
        .device = s->cfg.device,
        .host_buffers = true, /* shards and trainer regions live in host memory */
        .cancel = &s->stop_flag,
        .transport = s->cfg.transport,
        .socket_ifname = s->cfg.socket_ifname,
    };
}

void shard_bufs_free(shard_bufs_t *b)
{
    free(b->agree_buf);
    free(b->follow_buf);
    *b = (shard_bufs_t){0};
}

void shard_set_fatal(pshard_shard_server_t *s, pshard_status_t st, const char *msg)
{
    pthread_mutex_lock(&s->mu);
    if (s->fatal == PSHARD_OK) {
        s->fatal = st;
        ps_strlcpy(s->fatal_msg, msg, sizeof(s->fatal_msg));
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    PS_ERROR(PS_SUB_SHARD, "%s", msg);
}

void shard_cv_wait(pshard_shard_server_t *s, int64_t ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (ms % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&s->cv, &s->mu, &ts);
}

bool shard_abort_ring(pshard_shard_server_t *s, pshard_status_t st, const char *msg)
{
    pthread_mutex_lock(&s->mu);
    bool live = s->comm && pshard_comm_error(s->comm, NULL, 0) == PSHARD_OK;
    if (live)
        pshard_comm_abort_status(s->comm, st, msg);
    pthread_mutex_unlock(&s->mu);
    return live;
}

pshard_status_t shard_mesh_connect(pshard_shard_server_t *s, shard_model_t *m, int wrank, int reps,
                                   int shards, uint64_t attempt, uint32_t serial,
                                   uint64_t generation, char *err, size_t errlen)
{
    int replica = wrank / shards, index = wrank % shards;
    char name[64], suffix[16] = "", why[PSHARD_ERRLEN] = "";
    if (serial > 0)
        snprintf(suffix, sizeof(suffix), "~%u", serial);
    pshard_comm_t *shard_comm = NULL, *replicate_comm = NULL;
    pshard_comm_config_t cc;
    snprintf(name, sizeof(name), "hsdp%" PRIu64 "s%d%s", attempt, replica, suffix);
    shard_comm_config(s, &cc, name, index, shards, generation);
    pshard_status_t rc = pshard_comm_create(&cc, &shard_comm, why, sizeof(why));
    if (rc != PSHARD_OK)
        return ps_errf(err, errlen, rc, "cannot connect the shard ranks of replica %d: %s", replica,
                       why);
    snprintf(name, sizeof(name), "hsdp%" PRIu64 "r%d%s", attempt, index, suffix);
    shard_comm_config(s, &cc, name, replica, reps, generation);
    rc = pshard_comm_create(&cc, &replicate_comm, why, sizeof(why));
    if (rc != PSHARD_OK) {
        pshard_comm_destroy(shard_comm);
        return ps_errf(err, errlen, rc, "cannot connect the replicas of shard %d: %s", index, why);
    }
    pshard_comm_t *old[2] = {m->shard_comm, m->replicate_comm};
    pthread_mutex_lock(&s->mu); /* (the watch thread aborts them under mu) */
    m->shard_comm = shard_comm;
    m->replicate_comm = replicate_comm;
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < 2; i++)
        if (old[i])
            pshard_comm_destroy(old[i]);
    m->replicas = reps;
    m->mesh_attempt = attempt;
    int64_t own = atomic_load(&s->session_timeout_ms); /* the trainer's init timeout */
    pshard_comm_set_timeout(m->shard_comm, own);
    pshard_comm_set_timeout(m->replicate_comm, own);
    return PSHARD_OK;
}
