/* The pieces of a shard-server communicator that every file making one shares: its configuration
 * from the server's flags (the world's ring, shard_member.c; process groups and pairs,
 * shard_groups.c; an HSDP model's mesh, shard_define.c) and freeing the agreement and shadowing
 * buffers kept beside it. It calls no other file of the server, so membership -> operations ->
 * process groups all reach it one way. */
#include <stdlib.h>

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
