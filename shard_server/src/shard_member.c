/* The shard server's membership side: register with the coordinator (again under the same
 * name when evicted, which gives the old rank back), heartbeat, and build the communicator
 * once the cluster has formed — rebuilding it when the cluster re-forms. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/util.h"
#include "shard_internal.h"

static void sleep_ms(int64_t ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
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

static pshard_status_t do_register(pshard_shard_server_t *s, char *err, size_t errlen)
{
    Pshard__RegisterRequest req = PSHARD__REGISTER_REQUEST__INIT;
    req.role = PSHARD__ROLE__SHARD_SERVER;
    req.name = (char *)s->cfg.name;
    req.address = s->advertise;
    req.node = (char *)(s->cfg.node ? s->cfg.node : "");
    req.device = (char *)(strcmp(s->cfg.backend, "nccl") == 0 ? "cuda" : "cpu");
    ProtobufCMessage *resp = NULL;
    pshard_status_t rc = ps_rpc_unary(s->coord, "/pshard.Coordinator/Register", &req.base,
                                      &pshard__member_view__descriptor, &resp, 5000, 0, NULL, err,
                                      errlen);
    if (rc != PSHARD_OK)
        return rc;
    Pshard__MemberView *v = (Pshard__MemberView *)resp;
    pthread_mutex_lock(&s->mu);
    ps_strlcpy(s->member_id, v->member_id, sizeof(s->member_id));
    s->heartbeat_ms = v->heartbeat_ms > 0 ? v->heartbeat_ms : 1000;
    pthread_mutex_unlock(&s->mu);
    protobuf_c_message_free_unpacked(resp, NULL);
    PS_INFO(PS_SUB_SHARD, "registered with %s as %s", s->cfg.coordinator, s->member_id);
    return PSHARD_OK;
}

void *shard_heartbeat_main(void *arg)
{
    pshard_shard_server_t *s = arg;
    char err[512];
    int64_t backoff = 100;
    while (!atomic_load(&s->stop)) {
        err[0] = '\0';
        if (!s->member_id[0]) {
            if (do_register(s, err, sizeof(err)) != PSHARD_OK) {
                PS_WARN(PS_SUB_SHARD, "cannot register with %s: %s; retrying", s->cfg.coordinator,
                        err);
                sleep_ms(backoff);
                backoff = backoff * 2 > 2000 ? 2000 : backoff * 2;
                continue;
            }
            backoff = 100;
        }
        Pshard__HeartbeatRequest req = PSHARD__HEARTBEAT_REQUEST__INIT;
        char id[64];
        pthread_mutex_lock(&s->mu);
        ps_strlcpy(id, s->member_id, sizeof(id));
        int64_t every = s->heartbeat_ms;
        pthread_mutex_unlock(&s->mu);
        req.member_id = id;
        ProtobufCMessage *resp = NULL;
        pshard_status_t rc = ps_rpc_unary(s->coord, "/pshard.Coordinator/Heartbeat", &req.base,
                                          &pshard__member_view__descriptor, &resp, every * 2, 0,
                                          NULL, err, sizeof(err));
        if (rc == PSHARD_ERR_NOT_FOUND) {
            /* Evicted (or the coordinator restarted): register again under the same name,
             * which gives the old rank back. */
            PS_WARN(PS_SUB_SHARD, "coordinator forgot us (%s); registering again", err);
            s->member_id[0] = '\0';
            continue;
        }
        if (rc == PSHARD_OK) {
            Pshard__MemberView *v = (Pshard__MemberView *)resp;
            pthread_mutex_lock(&s->mu);
            s->generation = v->generation;
            bool formed = v->state == PSHARD__CLUSTER_STATE__FORMED && v->rank >= 0;
            if (formed) {
                s->rank = v->rank;
                s->world = v->world_size;
                s->formed_generation = v->formed_generation;
            }
            s->formed = formed;
            pthread_cond_broadcast(&s->cv);
            pthread_mutex_unlock(&s->mu);
            protobuf_c_message_free_unpacked(resp, NULL);
        } else {
            PS_WARN(PS_SUB_SHARD, "heartbeat to %s failed: %s", s->cfg.coordinator, err);
        }
        /* Sleep in small pieces so stop is prompt; heartbeat faster while forming. */
        int64_t wait = s->formed && s->comm ? every : (every < 100 ? every : 100);
        for (int64_t t = 0; t < wait && !atomic_load(&s->stop); t += 20)
            sleep_ms(20);
    }
    return NULL;
}

void *shard_setup_main(void *arg)
{
    pshard_shard_server_t *s = arg;
    int64_t give_up = s->cfg.form_timeout_ms > 0 ? ps_now_ns() + s->cfg.form_timeout_ms * 1000000
                                                 : INT64_MAX;
    while (!atomic_load(&s->stop)) {
        pthread_mutex_lock(&s->mu);
        while (!atomic_load(&s->stop) &&
               (!s->formed || (s->comm && s->formed_generation == s->comm_generation))) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100 * 1000000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
            if (!s->comm && ps_now_ns() > give_up) {
                pthread_mutex_unlock(&s->mu);
                shard_set_fatal(s, PSHARD_ERR_TIMEOUT, "the cluster did not form in time");
                return NULL;
            }
        }
        if (atomic_load(&s->stop)) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        int rank = s->rank, world = s->world;
        uint64_t gen = s->formed_generation;
        pshard_comm_t *old = s->comm;
        s->comm = NULL;
        pthread_mutex_unlock(&s->mu);
        if (old) {
            /* The cluster re-formed: the old ring is not the new one. */
            PS_WARN(PS_SUB_SHARD, "cluster re-formed (generation %" PRIu64 "); rebuilding the "
                                  "communicator",
                    gen);
            ps_rpc_server_set_health(s->srv, "pshard.ShardServer", 2);
            pthread_mutex_lock(&s->op_mu);
            pshard_comm_abort(old, "cluster re-formed");
            pshard_comm_destroy(old);
            pthread_mutex_unlock(&s->op_mu);
        }
        ps_log_set_rank(rank);
        pshard_comm_config_t cc = {
            .rank = rank,
            .world_size = world,
            .backend = s->cfg.backend,
            .name = "shard",
            .coordinator = s->cfg.coordinator,
            .listen_host = s->cfg.data_host ? s->cfg.data_host : "127.0.0.1",
            .token = s->cfg.token,
            .generation = gen,
            .timeout_ms = s->cfg.coll_timeout_ms,
            .connect_timeout_ms = 120000,
            .device = s->cfg.device,
            .cancel = &s->stop_flag,
        };
        char err[1024] = "";
        pshard_comm_t *comm = NULL;
        pshard_status_t rc = pshard_comm_create(&cc, &comm, err, sizeof(err));
        if (rc != PSHARD_OK) {
            PS_WARN(PS_SUB_SHARD, "cannot build the communicator (rank %d of %d): %s; retrying",
                    rank, world, err);
            sleep_ms(500);
            continue;
        }
        pthread_mutex_lock(&s->mu);
        s->comm = comm;
        s->comm_generation = gen;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        ps_rpc_server_set_health(s->srv, "pshard.ShardServer", 1);
        PS_INFO(PS_SUB_SHARD, "rank %d of %d ready (generation %" PRIu64 ")", rank, world, gen);
    }
    return NULL;
}

