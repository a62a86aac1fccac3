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

/* After an eviction: if no shard server holds this trainer's rank any more, its own server is
 * the one that was lost (dead, hung or cut off). Its collectives cannot tell this trainer, so
 * the calls waiting on it are cancelled and every later one fails with PEER_LOST. */
static void check_own_server(pshard_client_t *c)
{
    Pshard__StatusRequest req = PSHARD__STATUS_REQUEST__INIT;
    Pshard__StatusResponse *st = NULL;
    char err[PSHARD_ERRLEN] = "";
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

/* After every Register or Heartbeat (pshard/coord_client.h's lease renews it, and registers
 * again when the coordinator forgot this trainer): failures are only logged, the lease is
 * what they cost; a new generation of a degraded cluster may be this trainer's own server's
 * eviction. */
static int64_t lease_event(void *ctx, const ps_coord_lease_event_t *ev)
{
    pshard_client_t *c = ctx;
    if (ev->rc != PSHARD_OK)
        PS_WARN(PS_SUB_CLIENT, "trainer lease with %s: %s", c->coord_addr, ev->err);
    else if (!ev->registered && ev->generation_changed &&
             ev->view->state == PSHARD__CLUSTER_STATE__DEGRADED)
        check_own_server(c);
    return -1; /* the coordinator's heartbeat interval */
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
    ps_rpc_channel_config_t cc = {.target = c->coord_addr,
                                  .token = c->token,
                                  .tls_ca_file = ca && *ca ? ca : NULL,
                                  .job = c->job[0] ? c->job : NULL,
                                  .max_message_bytes = 64 << 20}; /* a large job's Status */
    char err[PSHARD_ERRLEN] = "";
    c->coord = ps_rpc_channel_create(&cc, err, sizeof(err));
    if (!c->coord) {
        PS_WARN(PS_SUB_CLIENT,
                "cannot reach coordinator %s: %s; a lost trainer will only be "
                "noticed by the collectives' timeout",
                c->coord_addr, err);
        return;
    }
    char name[64], host[64] = "";
    snprintf(name, sizeof(name), "trainer-%d", c->rank);
    gethostname(host, sizeof(host) - 1);
    ps_coord_lease_config_t lc = {.channel = c->coord,
                                  .role = PSHARD__ROLE__TRAINER,
                                  .name = name,
                                  .address = c->server,
                                  .node = host,
                                  .device = "cpu",
                                  .heartbeat_timeout_ms = 2000,
                                  .on_event = lease_event,
                                  .ctx = c};
    pshard_status_t rc = ps_coord_lease_start(&lc, true, &c->lease, err, sizeof(err));
    if (rc == PSHARD_ERR_ALREADY_EXISTS)
        /* A previous incarnation of this rank (a restarted trainer) still holds the name:
         * the lease registers once that lease has lapsed. */
        PS_WARN(PS_SUB_CLIENT, "trainer lease with %s: %s; registering when it lapses",
                c->coord_addr, err);
    else if (rc != PSHARD_OK)
        PS_WARN(PS_SUB_CLIENT,
                "cannot register the trainer with coordinator %s: %s; a lost "
                "trainer will only be noticed by the collectives' timeout",
                c->coord_addr, err);
}

/* Stops the lease and leaves the job when the last heartbeat went through. */
void client_lease_stop(pshard_client_t *c)
{
    ps_coord_lease_stop(c->lease);
    c->lease = NULL;
}
