/* The trainer's lease with the coordinator: registered as "trainer-RANK" of its job, renewed
 * by a thread, registered again when the coordinator forgot it, and left on close. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pshard/coord_client.h"
#include "pshard/log.h"
#include "pshard/util.h"

#include "client_internal.h"

/* Registers this trainer with the coordinator as "trainer-RANK". */
static pshard_status_t lease_register(pshard_client_t *c, char *err, size_t errlen)
{
    char name[64], host[64] = "", device[32] = "cpu";
    snprintf(name, sizeof(name), "trainer-%d", c->rank);
    gethostname(host, sizeof(host) - 1);
    Pshard__RegisterRequest req = PSHARD__REGISTER_REQUEST__INIT;
    req.role = PSHARD__ROLE__TRAINER;
    req.name = name;
    req.address = c->server;
    req.node = host;
    req.device = device;
    char key[64];
    pthread_mutex_lock(&c->mu);
    ps_strlcpy(key, c->lease_key, sizeof(key)); /* ours from before, if any: takes over */
    pthread_mutex_unlock(&c->mu);
    req.lease_key = key;
    Pshard__MemberView *v = NULL;
    PS_CHECK(ps_coord_rpc_register(c->coord, &req, &v, 5000, err, errlen));
    pthread_mutex_lock(&c->mu);
    ps_strlcpy(c->member_id, v->member_id, sizeof(c->member_id));
    ps_strlcpy(c->lease_key, v->lease_key ? v->lease_key : "", sizeof(c->lease_key));
    c->heartbeat_ms = v->heartbeat_ms > 0 ? v->heartbeat_ms : 1000;
    pthread_mutex_unlock(&c->mu);
    protobuf_c_message_free_unpacked(&v->base, NULL);
    return PSHARD_OK;
}

/* After an eviction: if no shard server holds this trainer's rank any more, its own server is
 * the one that was lost (dead, hung or cut off). Its collectives cannot tell this trainer, so
 * the calls waiting on it are cancelled and every later one fails with PEER_LOST. */
static void check_own_server(pshard_client_t *c)
{
    Pshard__StatusRequest req = PSHARD__STATUS_REQUEST__INIT;
    Pshard__StatusResponse *st = NULL;
    char err[256] = "";
    if (ps_coord_rpc_status(c->coord, &req, &st, 2000, err, sizeof(err)) != PSHARD_OK)
        return;
    bool held = false;
    for (size_t i = 0; i < st->n_members; i++)
        if (st->members[i]->role == PSHARD__ROLE__SHARD_SERVER && st->members[i]->rank == c->rank)
            held = true;
    protobuf_c_message_free_unpacked(&st->base, NULL);
    if (held)
        return;
    pthread_mutex_lock(&c->mu);
    if (c->lost == PSHARD_OK) {
        c->lost = PSHARD_ERR_PEER_LOST;
        snprintf(c->lost_msg, sizeof(c->lost_msg),
                 "rank %d's own shard server (%s) was evicted by the coordinator: it died, "
                 "hangs or is cut off",
                 c->rank, c->server);
    }
    pthread_mutex_unlock(&c->mu);
    PS_ERROR(PS_SUB_CLIENT, "%s", c->lost_msg);
    ps_rpc_channel_cancel_calls(c->ch, c->lost_msg);
}

/* Renews the lease every heartbeat_ms; registers again when the coordinator forgot this
 * trainer (it restarted). Failures are only logged: the lease is what they cost. */
static void *lease_main(void *arg)
{
    pshard_client_t *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        /* The condition variable is shared with the operations: wake-ups for them do not
         * count as the heartbeat's turn. */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int64_t ns = ts.tv_nsec + (c->heartbeat_ms % 1000) * 1000000;
        ts.tv_sec += c->heartbeat_ms / 1000 + ns / 1000000000;
        ts.tv_nsec = ns % 1000000000;
        while (!c->stop && pthread_cond_timedwait(&c->cv, &c->mu, &ts) != ETIMEDOUT) {
        }
        if (c->stop)
            break;
        char id[64], key[64];
        ps_strlcpy(id, c->member_id, sizeof(id));
        ps_strlcpy(key, c->lease_key, sizeof(key));
        pthread_mutex_unlock(&c->mu);
        char err[512] = "";
        pshard_status_t rc;
        if (!id[0]) {
            rc = lease_register(c, err, sizeof(err));
        } else {
            Pshard__HeartbeatRequest req = PSHARD__HEARTBEAT_REQUEST__INIT;
            req.member_id = id;
            req.lease_key = key;
            Pshard__MemberView *v = NULL;
            rc = ps_coord_rpc_heartbeat(c->coord, &req, &v, 2000, err, sizeof(err));
            if (v) {
                bool changed = v->generation != c->seen_generation;
                bool degraded = v->state == PSHARD__CLUSTER_STATE__DEGRADED;
                c->seen_generation = v->generation;
                protobuf_c_message_free_unpacked(&v->base, NULL);
                if (changed && degraded)
                    check_own_server(c);
            }
            if (rc == PSHARD_ERR_NOT_FOUND) {
                pthread_mutex_lock(&c->mu);
                c->member_id[0] = '\0'; /* register again on the next round */
                pthread_mutex_unlock(&c->mu);
            }
        }
        if (rc != PSHARD_OK)
            PS_WARN(PS_SUB_CLIENT, "trainer lease with %s: %s", c->coord_addr, err);
        pthread_mutex_lock(&c->mu);
        c->lease_ok = rc == PSHARD_OK;
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Starts the trainer's lease (best effort: without a coordinator address or when it cannot
 * be reached, training works, only a lost trainer is then found by the collectives'
 * timeout). PSHARD_COORDINATOR overrides the address the shard server reported. */
void client_lease_start(pshard_client_t *c, const char *reported)
{
    const char *env = getenv("PSHARD_COORDINATOR");
    const char *addr = env && *env ? env : reported;
    if (!addr || !*addr)
        return;
    ps_strlcpy(c->coord_addr, addr, sizeof(c->coord_addr));
    const char *ca = getenv("PSHARD_COORDINATOR_CA");
    ps_rpc_channel_config_t cc = {.target = c->coord_addr, .token = c->token,
                                  .tls_ca_file = ca && *ca ? ca : NULL,
                                  .job = c->job[0] ? c->job : NULL,
                                  .max_message_bytes = 64 << 20}; /* a large job's Status */
    char err[512] = "";
    c->coord = ps_rpc_channel_create(&cc, err, sizeof(err));
    pshard_status_t rc = c->coord ? lease_register(c, err, sizeof(err)) : PSHARD_ERR_UNAVAILABLE;
    if (rc == PSHARD_ERR_ALREADY_EXISTS) {
        /* A previous incarnation of this rank (a restarted trainer) still holds the name:
         * the lease thread registers once that lease has lapsed. */
        PS_WARN(PS_SUB_CLIENT, "trainer lease with %s: %s; registering when it lapses",
                c->coord_addr, err);
        c->heartbeat_ms = 1000;
    } else if (rc != PSHARD_OK) {
        PS_WARN(PS_SUB_CLIENT, "cannot register the trainer with coordinator %s: %s; a lost "
                               "trainer will only be noticed by the collectives' timeout",
                c->coord_addr, err);
        return;
    }
    c->lease_ok = rc == PSHARD_OK;
    if (pthread_create(&c->lease_thread, NULL, lease_main, c) == 0)
        c->lease_started = true;
}

/* Stops the lease thread (waking it with c->stop, which pshard_close sets for the worker too)
 * and leaves the job when the last heartbeat went through. */
void client_lease_stop(pshard_client_t *c)
{
    if (c->lease_started) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        /* A heartbeat waiting on an unreachable coordinator must not hold up the exit. */
        ps_rpc_channel_cancel_calls(c->coord, "the trainer is closing");
        pthread_join(c->lease_thread, NULL);
    }
    if (c->coord && c->member_id[0] && c->lease_ok) {
        Pshard__LeaveRequest lv = PSHARD__LEAVE_REQUEST__INIT;
        lv.member_id = c->member_id;
        lv.lease_key = c->lease_key;
        char err[256] = "";
        ps_coord_rpc_leave(c->coord, &lv, NULL, 1000, err, sizeof(err));
    }
}
