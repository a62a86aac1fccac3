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

#include "pshard/coord_client.h"
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
    for (int i = 0; s->pairs && i < s->npairs; i++) {
        shard_pg_t *g = s->pairs[i];
        if (g && (lost < 0 || i == lost) && pshard_comm_error(g->comm, NULL, 0) == PSHARD_OK)
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

/* "0, 2, 5" into buf (len > 16); "..." at the end when not every rank fits. */
static void ranks_format(const int *ranks, int n, char *buf, size_t len)
{
    size_t off = 0;
    int k = 0;
    buf[0] = '\0';
    for (; k < n && off + 16 < len; k++) /* one rank and ", " take at most 13 bytes */
        off += (size_t)snprintf(buf + off, len - off, "%s%d", k ? ", " : "", ranks[k]);
    if (k < n)
        snprintf(buf + off, len - off, ", ...");
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
                          "this rank is not in group %" PRIu32 " (ranks %s)", id, list);
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
static pshard_status_t group_make(pshard_shard_server_t *s, int rank, const Pshard__GroupRanks *pb,
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
        if (g->ranks[k] == rank)
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
    /* Under mu: the watch thread walks the array (shard_pgs_abort), and realloc may move it. */
    pthread_mutex_lock(&s->mu);
    shard_pg_t **grown = realloc(s->pgs, (s->npgs + n) * sizeof(*grown));
    if (grown)
        s->pgs = grown;
    pthread_mutex_unlock(&s->mu);
    if (!made || !grown) {
        free(made);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    pshard_status_t rc = PSHARD_OK;
    for (size_t i = 0; i < n && rc == PSHARD_OK; i++)
        rc = group_make(s, pshard_comm_rank(comm), req->groups[i], a->first_id + (uint32_t)i,
                        req->timeout_ms, &made[i], err, errlen);
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

/* ---- point-to-point: a communicator per pair of ranks ------------------------------------ */

#define PAIR_ID_BASE 0x80000000u /* a pair's id in messages: this | the peer's world rank */

static void joined_key(const pshard_shard_server_t *s, int rank, char *key, size_t len)
{
    snprintf(key, len, "pshard/joined/g%" PRIu64 "/rank/%d", s->comm_generation, rank);
}

void shard_pairs_mark_joined(pshard_shard_server_t *s, int rank, bool joined)
{
    if (!s->coord)
        return;
    char key[96], err[PSHARD_ERRLEN] = "";
    joined_key(s, rank, key, sizeof(key));
    pshard_status_t rc = joined ? ps_coord_store_put(s->coord, key, "1", 1, 2000, err, sizeof(err))
                                : ps_coord_store_remove(s->coord, key, 2000, err, sizeof(err));
    if (rc != PSHARD_OK)
        PS_WARN(PS_SUB_SHARD, "could not %s %s: %s", joined ? "set" : "delete", key, err);
}

void shard_pairs_clear(pshard_shard_server_t *s)
{
    pthread_mutex_lock(&s->mu);
    shard_pg_t **pairs = s->pairs;
    uint32_t *epoch = s->pair_epoch;
    int n = s->npairs;
    s->pairs = NULL;
    s->pair_epoch = NULL;
    s->npairs = 0;
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; pairs && i < n; i++)
        group_free(pairs[i]);
    free(pairs);
    free(epoch);
}

shard_pg_t *shard_pair_get(pshard_shard_server_t *s, pshard_comm_t *world, int peer,
                           int64_t timeout_ms, pshard_status_t *rc, char *err, size_t errlen)
{
    int me = pshard_comm_rank(world), n = pshard_comm_world_size(world);
    if (peer < 0 || peer >= n || peer == me) {
        *rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                      "rank %d cannot send to or receive from rank %d (a rank of this %d-rank "
                      "cluster other than itself)",
                      me, peer, n);
        return NULL;
    }
    if (s->pairs && s->npairs != n) /* (a ring of another size: they are cleared with it) */
        shard_pairs_clear(s);
    if (!s->pairs) {
        shard_pg_t **pairs = calloc((size_t)n, sizeof(*pairs));
        uint32_t *epoch = calloc((size_t)n, sizeof(*epoch));
        if (!pairs || !epoch) {
            free(pairs);
            free(epoch);
            *rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
            return NULL;
        }
        pthread_mutex_lock(&s->mu);
        s->pairs = pairs;
        s->pair_epoch = epoch;
        s->npairs = n;
        pthread_mutex_unlock(&s->mu);
    }
    shard_pg_t *g = s->pairs[peer];
    if (g && pshard_comm_error(g->comm, NULL, 0) == PSHARD_OK)
        return g;
    if (g) {
        /* It failed (both ends learn of a failure through the ring's abort notice): both
         * build the next epoch's. */
        pthread_mutex_lock(&s->mu);
        s->pairs[peer] = NULL;
        pthread_mutex_unlock(&s->mu);
        group_free(g);
        s->pair_epoch[peer]++;
    }
    /* A peer whose trainer joined would never build its end: say so instead of waiting. */
    char key[96], *val = NULL, why[PSHARD_ERRLEN] = "";
    size_t vlen = 0;
    joined_key(s, peer, key, sizeof(key));
    if (s->coord &&
        ps_coord_store_fetch(s->coord, key, &val, &vlen, 2000, why, sizeof(why)) == PSHARD_OK) {
        free(val);
        *rc = ps_errf(err, errlen, PSHARD_ERR_JOINED,
                      "rank %d has joined (its trainer ran out of input): a send or recv with it "
                      "cannot complete",
                      peer);
        return NULL;
    }
    int lo = me < peer ? me : peer, hi = me < peer ? peer : me;
    g = calloc(1, sizeof(*g));
    if (!g || !(g->ranks = malloc(2 * sizeof(int)))) {
        free(g);
        *rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        return NULL;
    }
    g->id = PAIR_ID_BASE | (uint32_t)peer;
    g->size = 2;
    g->ranks[0] = lo;
    g->ranks[1] = hi;
    g->grank = me == lo ? 0 : 1;
    char name[48];
    snprintf(name, sizeof(name), "p2p%dx%de%" PRIu32, lo, hi, s->pair_epoch[peer]);
    pshard_comm_config_t cc;
    shard_comm_config(s, &cc, name, g->grank, 2, s->comm_generation);
    if (timeout_ms > 0)
        cc.connect_timeout_ms = timeout_ms;
    why[0] = '\0';
    *rc = pshard_comm_create(&cc, &g->comm, why, sizeof(why));
    if (*rc != PSHARD_OK) {
        group_free(g);
        ps_errf(err, errlen, *rc,
                "cannot connect rank %d with rank %d for send/recv (does rank %d's trainer call "
                "the matching recv or send?): %s",
                me, peer, peer, why);
        return NULL;
    }
    pthread_mutex_lock(&s->mu);
    s->pairs[peer] = g;
    pthread_mutex_unlock(&s->mu);
    return g;
}
