/* Process groups (torch.distributed.new_group) on the shard servers: NewGroups is an operation
 * every rank agrees on like the others (so groups made in another order on some rank are a
 * desync), which gives the groups the next ids of the comm generation; the members of each
 * build a communicator over it, bootstrapped through the coordinator's store like the world
 * ring ("grp<id>" keys scoped by the generation). A group's plain collectives then run on its
 * communicator with their own agreement round (shard_ops.c), so a joined member shadows them.
 * Groups live until the trainer's session ends or the cluster re-forms. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/log.h"
#include "pshard/util.h"

#include "shard_ops.h"

#define GROUPS_PER_CALL 64
#define GROUPS_PER_SESSION 1024
/* Ids carry the comm generation's low 16 bits above a counter of the generation's groups, so
 * a trainer's handle from an earlier generation never names a group of this one. */
#define GROUP_COUNTER_MAX 0xffffu

static void group_free(shard_pg_t *g)
{
    if (!g)
        return;
    pshard_comm_destroy(g->comm);
    shard_bufs_free(&g->bufs);
    free(g->ranks);
    free(g);
}

void shard_pgs_clear(pshard_shard_server_t *s)
{
    pthread_mutex_lock(&s->mu);
    shard_pg_t **gs = s->pgs;
    size_t n = s->npgs;
    s->pgs = NULL;
    s->npgs = 0;
    pthread_mutex_unlock(&s->mu);
    for (size_t i = 0; i < n; i++)
        group_free(gs[i]);
    free(gs);
}

void shard_pgs_abort(pshard_shard_server_t *s, int lost, pshard_status_t status, const char *msg)
{
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->npgs; i++) {
        shard_pg_t *g = s->pgs[i];
        bool holds = lost < 0;
        for (int k = 0; !holds && k < g->size; k++)
            holds = g->ranks[k] == lost;
        if (holds && g->comm && pshard_comm_error(g->comm, NULL, 0) == PSHARD_OK)
            pshard_comm_abort_status(g->comm, status, msg);
    }
    /* An HSDP model's communicators too: a model operation may wait in them, and with a rank
     * lost the world's agreement fails every later one anyway. */
    pshard_comm_t *mesh[2] = {s->model ? s->model->shard_comm : NULL,
                              s->model ? s->model->replicate_comm : NULL};
    for (int i = 0; i < 2; i++)
        if (mesh[i] && pshard_comm_error(mesh[i], NULL, 0) == PSHARD_OK)
            pshard_comm_abort_status(mesh[i], status, msg);
    pthread_mutex_unlock(&s->mu);
}

static void ranks_format(const int *ranks, int n, char *buf, size_t len)
{
    size_t off = 0;
    buf[0] = '\0';
    for (int k = 0; k < n && off + 16 < len; k++)
        off += (size_t)snprintf(buf + off, len - off, "%s%d", k ? ", " : "", ranks[k]);
    if (off + 16 >= len && len > 4)
        snprintf(buf + len - 5, 5, "...");
}

void shard_pg_describe(const shard_pg_t *g, char *buf, size_t len)
{
    char list[96];
    ranks_format(g->ranks, g->size, list, sizeof(list));
    int off = snprintf(buf, len, "group %" PRIu32 " (ranks %s): rank %d of %d over %s; ", g->id,
                       list, g->grank, g->size, pshard_comm_transport(g->comm));
    if (off < 0 || (size_t)off >= len)
        return;
    pshard_coll_record_t rec[64];
    size_t n = pshard_comm_flight_records(g->comm, rec, 64);
    if (n == 0)
        snprintf(buf + off, len - (size_t)off, "no operation yet");
    else
        pshard_coll_record_format(g->comm, &rec[n - 1], buf + off, len - (size_t)off);
}

shard_pg_t *shard_pg_find(pshard_shard_server_t *s, uint32_t id, pshard_status_t *rc, char *err,
                          size_t errlen)
{
    for (size_t i = 0; i < s->npgs; i++) {
        shard_pg_t *g = s->pgs[i];
        if (g->id != id)
            continue;
        if (g->grank < 0) {
            char list[160];
            ranks_format(g->ranks, g->size, list, sizeof(list));
            *rc = ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                          "rank %d is not in group %" PRIu32 " (ranks %s)", s->rank, id, list);
            return NULL;
        }
        return g;
    }
    uint32_t gen16 = (uint32_t)(s->comm_generation & 0xffff);
    if (id >> 16 == gen16 && (id & GROUP_COUNTER_MAX) >= s->next_pg_id)
        *rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                      "there is no group %" PRIu32 " (make groups with NewGroups)", id);
    else
        *rc = ps_errf(err, errlen, PSHARD_ERR_UNAVAILABLE,
                      "group %" PRIu32 " belongs to an earlier session or cluster generation "
                      "(or its communicator could not be built); make it again",
                      id);
    return NULL;
}

pshard_status_t shard_new_groups_check(pshard_shard_server_t *s, pshard_comm_t *comm,
                                       shard_op_t *op, char *err, size_t errlen)
{
    shard_new_groups_arg_t *a = op->arg;
    const Pshard__NewGroupsRequest *req = a->req;
    int world = pshard_comm_world_size(comm);
    if (req->n_groups == 0 || req->n_groups > GROUPS_PER_CALL)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "NewGroups takes 1 to %d groups, not %zu", GROUPS_PER_CALL, req->n_groups);
    if (s->npgs + req->n_groups > GROUPS_PER_SESSION)
        return ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                       "this session has %zu process groups; %zu more exceed the %d a session "
                       "may have",
                       s->npgs, req->n_groups, GROUPS_PER_SESSION);
    if (req->timeout_ms < 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "timeout_ms %" PRId64 " is negative", req->timeout_ms);
    size_t words = 1;
    for (size_t i = 0; i < req->n_groups; i++) {
        const Pshard__GroupRanks *g = req->groups[i];
        if (!g || g->n_ranks == 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "group %zu has no ranks", i);
        for (size_t k = 0; k < g->n_ranks; k++) {
            if (g->ranks[k] < 0 || g->ranks[k] >= world)
                return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                               "group %zu: rank %d is not a rank of this %d-rank cluster", i,
                               g->ranks[k], world);
            if (k > 0 && g->ranks[k] <= g->ranks[k - 1])
                return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                               "group %zu: ranks must be strictly increasing (rank %d follows "
                               "%d)",
                               i, g->ranks[k], g->ranks[k - 1]);
        }
        words += 1 + g->n_ranks;
    }
    a->words = malloc(words * sizeof(uint32_t));
    if (!a->words)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    size_t w = 0;
    a->words[w++] = (uint32_t)req->n_groups;
    for (size_t i = 0; i < req->n_groups; i++) {
        a->words[w++] = (uint32_t)req->groups[i]->n_ranks;
        for (size_t k = 0; k < req->groups[i]->n_ranks; k++)
            a->words[w++] = (uint32_t)req->groups[i]->ranks[k];
    }
    op->sop.ids = a->words;
    op->sop.nids = words;
    op->sop.count = req->n_groups;
    return PSHARD_OK;
}

/* One group of the request as this rank keeps it, with its communicator when it is a member
 * (which blocks until every member has connected). */
static pshard_status_t group_make(pshard_shard_server_t *s, const Pshard__GroupRanks *pb,
                                  uint32_t id, int64_t timeout_ms, shard_pg_t **out, char *err,
                                  size_t errlen)
{
    shard_pg_t *g = calloc(1, sizeof(*g));
    if (!g || !(g->ranks = malloc(pb->n_ranks * sizeof(int)))) {
        free(g);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    g->id = id;
    g->size = (int)pb->n_ranks;
    g->grank = -1;
    for (int k = 0; k < g->size; k++) {
        g->ranks[k] = pb->ranks[k];
        if (g->ranks[k] == s->rank)
            g->grank = k;
    }
    if (g->grank >= 0) {
        char name[32];
        snprintf(name, sizeof(name), "grp%" PRIu32, id);
        pshard_comm_config_t cc;
        shard_comm_config(s, &cc, name, g->grank, g->size, s->comm_generation);
        if (timeout_ms > 0)
            cc.timeout_ms = timeout_ms;
        char why[PSHARD_ERRLEN] = "";
        pshard_status_t rc = pshard_comm_create(&cc, &g->comm, why, sizeof(why));
        if (rc != PSHARD_OK) {
            char list[160];
            ranks_format(g->ranks, g->size, list, sizeof(list));
            group_free(g);
            return ps_errf(err, errlen, rc, "cannot build group %" PRIu32 " (ranks %s): %s", id,
                           list, why);
        }
    }
    *out = g;
    return PSHARD_OK;
}

pshard_status_t shard_new_groups_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                     char *err, size_t errlen)
{
    (void)comm;
    shard_new_groups_arg_t *a = op->arg;
    const Pshard__NewGroupsRequest *req = a->req;
    size_t n = req->n_groups;
    if (s->next_pg_id == 0)
        s->next_pg_id = 1;
    if (s->next_pg_id + n > GROUP_COUNTER_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                       "this cluster generation made %" PRIu32 " process groups; no more ids",
                       s->next_pg_id - 1);
    uint32_t gen16 = (uint32_t)(s->comm_generation & 0xffff);
    a->first_id = gen16 << 16 | s->next_pg_id;
    /* The ids are taken on every rank whatever happens next, so the ranks stay in step. */
    s->next_pg_id += (uint32_t)n;
    shard_pg_t **made = calloc(n, sizeof(*made));
    shard_pg_t **grown = realloc(s->pgs, (s->npgs + n) * sizeof(*grown));
    if (grown) {
        pthread_mutex_lock(&s->mu);
        s->pgs = grown;
        pthread_mutex_unlock(&s->mu);
    }
    if (!made || !grown) {
        free(made);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    pshard_status_t rc = PSHARD_OK;
    for (size_t i = 0; i < n && rc == PSHARD_OK; i++)
        rc = group_make(s, req->groups[i], a->first_id + (uint32_t)i, req->timeout_ms, &made[i],
                        err, errlen);
    if (rc != PSHARD_OK) {
        for (size_t i = 0; i < n; i++)
            group_free(made[i]);
        free(made);
        return rc;
    }
    pthread_mutex_lock(&s->mu);
    memcpy(s->pgs + s->npgs, made, n * sizeof(*made));
    s->npgs += n;
    pthread_mutex_unlock(&s->mu);
    free(made);
    PS_INFO(PS_SUB_SHARD, "made %zu process group(s), ids %" PRIu32 "..%" PRIu32, n, a->first_id,
            a->first_id + (uint32_t)n - 1);
    return PSHARD_OK;
}
