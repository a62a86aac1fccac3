/* Finding this trainer's shard server through the coordinator (init_method tcp:// and
 * file://): the server whose rank is the trainer's, from the job's Status once the cluster has
 * formed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client_internal.h"
#include "pshard/coord_client.h"
#include "pshard/rdzv_file.h"
#include "pshard/util.h"

pshard_status_t client_locate_server(const pshard_client_config_t *cfg, const char *token,
                                     char **server, char *err, size_t errlen)
{
    *server = NULL;
    if (cfg->rank < 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "finding the shard server through coordinator %s needs this trainer's "
                       "rank (RANK)",
                       cfg->coordinator);
    ps_rpc_channel_config_t ccfg = {.target = cfg->coordinator, .token = token, .job = cfg->job};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&ccfg, err, errlen);
    if (!ch)
        return PSHARD_ERR_INVALID_ARGUMENT;
    int64_t connect_ms = cfg->connect_timeout_ms > 0 ? cfg->connect_timeout_ms : 300000;
    int64_t give_up = ps_now_ns() + connect_ms * 1000000;
    pshard_status_t rc = PSHARD_ERR_TIMEOUT;
    char last[PSHARD_ERRLEN] = "the cluster has not formed";
    while (ps_now_ns() < give_up) {
        Pshard__StatusRequest req = PSHARD__STATUS_REQUEST__INIT;
        Pshard__StatusResponse *st = NULL;
        char e[PSHARD_ERRLEN] = "";
        pshard_status_t r = ps_coord_rpc_status(ch, &req, &st, 5000, e, sizeof(e));
        if (r == PSHARD_ERR_UNAUTHENTICATED || r == PSHARD_ERR_INVALID_ARGUMENT) {
            rc = ps_errf(err, errlen, r, "coordinator %s: %s", cfg->coordinator, e);
            break;
        }
        if (r == PSHARD_OK) {
            if (cfg->world_size > 0 && st->formed_generation > 0 &&
                st->world_size != cfg->world_size) {
                rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                             "WORLD_SIZE is %d but the cluster at coordinator %s has %d shard "
                             "servers",
                             cfg->world_size, cfg->coordinator, st->world_size);
                protobuf_c_message_free_unpacked(&st->base, NULL);
                break;
            }
            const char *found = NULL;
            for (size_t i = 0; i < st->n_members && !found; i++) {
                const Pshard__Member *m = st->members[i];
                if (m->role == PSHARD__ROLE__SHARD_SERVER && m->rank == cfg->rank && m->address &&
                    *m->address)
                    found = m->address;
            }
            if (found) {
                *server = strdup(found);
                rc = *server ? PSHARD_OK
                             : ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
                protobuf_c_message_free_unpacked(&st->base, NULL);
                break;
            }
            if (st->formed_generation > 0 && cfg->rank >= st->world_size) {
                rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                             "rank %d is not a rank of the %d-server cluster at coordinator %s",
                             cfg->rank, st->world_size, cfg->coordinator);
                protobuf_c_message_free_unpacked(&st->base, NULL);
                break;
            }
            snprintf(last, sizeof(last), "no shard server has rank %d yet (cluster: %s)", cfg->rank,
                     st->awaiting && *st->awaiting ? st->awaiting : "forming");
            protobuf_c_message_free_unpacked(&st->base, NULL);
        } else {
            snprintf(last, sizeof(last), "%s", e);
        }
        struct timespec ts = {0, 100 * 1000000};
        nanosleep(&ts, NULL);
    }
    if (rc == PSHARD_ERR_TIMEOUT)
        ps_errf(err, errlen, rc, "no shard server for rank %d at coordinator %s within %lld ms: %s",
                cfg->rank, cfg->coordinator, (long long)connect_ms, last);
    ps_rpc_channel_destroy(ch);
    return rc;
}

pshard_status_t pshard_rendezvous_file_read(const char *path, char *addr, size_t addrlen, char *err,
                                            size_t errlen)
{
    if (!path || !*path || !addr || addrlen == 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "no rendezvous file path");
    return ps_rdzv_file_read(path, addr, addrlen, err, errlen);
}
