/* Process groups (torch.distributed.new_group) on the shard servers: NewGroups is an operation
 * every rank agrees on like the others (so groups made in another order on some rank are a
 * desync), which gives the groups the next ids of the comm generation; the members of each
 * build a communicator over it, bootstrapped through the coordinator's store like the world
 * ring ("grp<id>" keys scoped by the generation). A keyed NewGroups (torch's own contract: only
 * the members call, naming the group with a string they share) skips the world's agreement: the
 * members build the communicator under a name hashed from the key, and each server gives the
 * group a local id. A group's plain collectives then run on its communicator with their own
 * agreement round (shard_ops.c), so a joined member shadows them. Groups live until the
 * trainer's session ends or the cluster re-forms. */
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
 * a trainer's handle from an earlier generation never names a group of this one. The counter's
 * lower half (1..0x7fff) numbers the agreed groups, the same on every rank; its upper half
 * (0x8000..0xffff) the keyed groups, each server its own, so the two never collide. */
#define GROUP_COUNTER_MAX 0xffffu
#define KEYED_COUNTER_BASE 0x8000u
/* The longest key a keyed NewGroups takes (torch's names are a counter or a 40-digit hash). */
#define GROUP_KEY_MAX 1024

static void keyed_name(const char *key, char *buf, size_t len);
static void ranks_format(const int *ranks, int n, char *buf, size_t len);

static void group_free(shard_pg_t *g)
{
    if (!g)
        return;
    pshard_comm_destroy(g->comm);
    shard_bufs_free(&g->bufs);
    free(g->ranks);
    free(g->key);
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

void shard_pgs_suspend(pshard_shard_server_t *s, uint32_t serial)
{
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->npgs; i++) {
        shard_pg_t *g = s->pgs[i];
        pshard_comm_destroy(g->comm);
        g->comm = NULL;
        shard_bufs_free(&g->bufs);
        g->serial = serial;
    }
    pthread_mutex_unlock(&s->mu);
}

void shard_pgs_hand_over(pshard_shard_server_t *s)
{
    pthread_mutex_lock(&s->mu);
    size_t kept = 0;
    for (size_t i = 0; i < s->npgs; i++) {
        shard_pg_t *g = s->pgs[i];
        /* A keyed group the aborted step suspended: its other members keep it under its id */
        if (g->key && !g->comm && g->serial > 0) {
            g->orphan = true;
            s->pgs[kept++] = g;
        } else {
            group_free(g);
        }
    }
    s->npgs = kept;
    pthread_mutex_unlock(&s->mu);
}

pshard_status_t shard_pg_adopt_orphan(pshard_shard_server_t *s, uint32_t id, const char *key,
                                      const int *ranks, int size, uint32_t serial,
                                      int64_t timeout_ms, char *err, size_t errlen)
{
    int grank = -1;
    for (int k = 0; k < size; k++)
        if (ranks[k] == s->rank)
            grank = k;
    if (grank < 0 || strlen(key) > GROUP_KEY_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "group %" PRIu32 " does not hold rank %d, or its key is too long", id,
                       s->rank);
    for (size_t i = 0; i < s->npgs; i++)
        if (s->pgs[i]->id == id || (s->pgs[i]->key && strcmp(s->pgs[i]->key, key) == 0))
            return PSHARD_OK; /* another survivor listed it too */
    if (s->npgs + 1 > GROUPS_PER_SESSION)
        return ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED, "too many process groups");
    shard_pg_t *g = calloc(1, sizeof(*g));
    if (!g || !(g->ranks = malloc((size_t)size * sizeof(int))) || !(g->key = strdup(key))) {
        group_free(g);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    g->id = id;
    g->size = size;
    g->grank = grank;
    g->timeout_ms = timeout_ms;
    g->serial = serial;
    g->orphan = true;
    memcpy(g->ranks, ranks, (size_t)size * sizeof(int));
    pthread_mutex_lock(&s->mu);
    shard_pg_t **grown = realloc(s->pgs, (s->npgs + 1) * sizeof(*grown));
    if (grown) {
        s->pgs = grown;
        s->pgs[s->npgs++] = g;
    }
    pthread_mutex_unlock(&s->mu);
    if (!grown) {
        group_free(g);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    return PSHARD_OK;
}

/* Rebuilds the communicator of g, suspended by an aborted step, under its name and serial:
 * blocks until every member's server has done the same (the members' trainers use the group
 * again, a replaced one after making it again). */
static pshard_status_t group_rebuild(pshard_shard_server_t *s, shard_pg_t *g, char *err,
                                     size_t errlen)
{
    char name[64], base[48], list[160];
    if (g->key)
        keyed_name(g->key, base, sizeof(base));
    else
        snprintf(base, sizeof(base), "grp%" PRIu32, g->id);
    snprintf(name, sizeof(name), "%s~%" PRIu32, base, g->serial);
    pshard_comm_config_t cc;
    shard_comm_config(s, &cc, name, g->grank, g->size, s->comm_generation);
    if (g->timeout_ms > 0)
        cc.timeout_ms = g->timeout_ms;
    cc.connect_timeout_ms = g->timeout_ms > 0 ? g->timeout_ms : s->cfg.coll_timeout_ms;
    char why[PSHARD_ERRLEN] = "";
    pshard_comm_t *comm = NULL;
    pshard_status_t rc = pshard_comm_create(&cc, &comm, why, sizeof(why));
    if (rc != PSHARD_OK) {
        ranks_format(g->ranks, g->size, list, sizeof(list));
        return ps_errf(err, errlen, rc,
                       "group %" PRIu32 " (ranks %s) could not be rebuilt after the aborted step "
                       "(ring serial %" PRIu32 "): %s. Every member's trainer must use it again; "
                       "a replaced trainer must first make it again (torch's new_group, the same "
                       "calls in the same order%s)",
                       g->id, list, g->serial, why,
                       g->key ? "" : "; an unkeyed group cannot be made again by one rank alone");
    }
    pthread_mutex_lock(&s->mu);
    g->comm = comm;
    pthread_mutex_unlock(&s->mu);
    PS_INFO(PS_SUB_SHARD,
            "rebuilt process group %" PRIu32 " after the aborted step (serial %" PRIu32 ")", g->id,
            g->serial);
    return PSHARD_OK;
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
    /* A keyed group's key, cut short: the line has a flight record to hold as well. */
    int off = snprintf(buf, len, "group %" PRIu32 " (%s%.40s%s%sranks %s): rank %d of %d over %s; ",
                       g->id, g->key ? "key \"" : "", g->key ? g->key : "",
                       g->key && strlen(g->key) > 40 ? "..." : "", g->key ? "\", " : "", list,
                       g->grank, g->size, pshard_comm_transport(g->comm));
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
        if (g->id != id || g->orphan)
            continue;
        if (g->grank < 0) {
            char list[160];
            ranks_format(g->ranks, g->size, list, sizeof(list));
            *rc = ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                          "this rank is not in group %" PRIu32 " (ranks %s)", id, list);
            return NULL;
        }
        if (!g->comm && (*rc = group_rebuild(s, g, err, errlen)) != PSHARD_OK)
            return NULL;
        return g;
    }
    uint32_t gen16 = (uint32_t)(s->comm_generation & 0xffff), counter = id & GROUP_COUNTER_MAX;
    uint32_t next = counter >= KEYED_COUNTER_BASE ? s->next_keyed_pg_id : s->next_pg_id;
    if (id >> 16 == gen16 && counter >= next)
        *rc = ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                      "there is no group %" PRIu32 " (make groups with NewGroups)", id);
    else
        *rc = ps_errf(err, errlen, PSHARD_ERR_UNAVAILABLE,
                      "group %" PRIu32 " belongs to an earlier session or cluster generation "
                      "(or its communicator could not be built); make it again",
                      id);
    return NULL;
}

/* PSHARD_OK when group i of a request holds strictly increasing ranks of a world-rank
 * cluster, else INVALID_ARGUMENT saying what is wrong. */
static pshard_status_t ranks_check(const Pshard__GroupRanks *g, size_t i, int world, char *err,
                                   size_t errlen)
{
    if (!g || g->n_ranks == 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "group %zu has no ranks", i);
    for (size_t k = 0; k < g->n_ranks; k++) {
        if (g->ranks[k] < 0 || g->ranks[k] >= world)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "group %zu: rank %d is not a rank of this %d-rank cluster", i,
                           g->ranks[k], world);
        if (k > 0 && g->ranks[k] <= g->ranks[k - 1])
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "group %zu: ranks must be strictly increasing (rank %d follows %d)", i,
                           g->ranks[k], g->ranks[k - 1]);
    }
    return PSHARD_OK;
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
        PS_CHECK(ranks_check(req->groups[i], i, world, err, errlen));
        words += 1 + req->groups[i]->n_ranks;
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
    g->timeout_ms = timeout_ms;
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
    if (s->next_pg_id + n > KEYED_COUNTER_BASE)
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
    char name[64];
    /* The ring's serial too: pairs made again after an aborted step (same generation) must not
     * meet the old pairs' store keys. */
    snprintf(name, sizeof(name), "p2p%dx%de%" PRIu32 "s%" PRIu32, lo, hi, s->pair_epoch[peer],
             s->comm_serial);
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

/* ---- keyed groups: made by their members only ------------------------------------------- */

/* The communicator (and store) name of the group keyed key: "key" + its FNV-1a 64 hash in hex +
 * "n" + its length, short and safe in store keys whatever the key holds; the communicator scopes
 * it by the comm generation. */
static void keyed_name(const char *key, char *buf, size_t len)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a 64: offset basis, then xor and multiply */
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)key; *p; p++, n++) {
        h ^= *p;
        h *= 0x100000001b3ull;
    }
    snprintf(buf, len, "key%016" PRIx64 "n%zu", h, n);
}

/* The store key under which world rank rank's server says it started building group name:
 * what a member that timed out reads to name the members that never came. */
static void arrival_key(const pshard_shard_server_t *s, const char *name, int rank, char *buf,
                        size_t len)
{
    snprintf(buf, len, "pshard/keyed/%s/g%" PRIu64 "/in/%d", name, s->comm_generation, rank);
}

/* After a failed build: "; ranks 2, 3 never started building it (...)" into buf for the members
 * whose arrival key is missing, or "" when the store cannot tell (or every member came). Each
 * member sets its key before building and deletes it once built, so a member that built the
 * group and deleted its key before this one failed would be named too; a build fails on every
 * member together, nearly always, so that needs a member lost at the very end of the build. */
static void missing_members(pshard_shard_server_t *s, const char *name, const shard_pg_t *g,
                            char *buf, size_t len)
{
    int missing[64], nmissing = 0;
    buf[0] = '\0';
    if (!s->coord)
        return;
    for (int k = 0; k < g->size && nmissing < 64; k++) {
        if (k == g->grank)
            continue;
        char key[160], *val = NULL, why[PSHARD_ERRLEN] = "";
        size_t vlen = 0;
        arrival_key(s, name, g->ranks[k], key, sizeof(key));
        pshard_status_t rc =
            ps_coord_store_fetch(s->coord, key, &val, &vlen, 2000, why, sizeof(why));
        free(val);
        if (rc == PSHARD_ERR_NOT_FOUND)
            missing[nmissing++] = g->ranks[k];
        else if (rc != PSHARD_OK)
            return; /* the store cannot tell */
    }
    if (nmissing == 0)
        return;
    char list[160];
    ranks_format(missing, nmissing, list, sizeof(list));
    snprintf(buf, len,
             "; rank%s %s never started building it (did %s trainer%s call new_group with this "
             "key?)",
             nmissing > 1 ? "s" : "", list, nmissing > 1 ? "their" : "its",
             nmissing > 1 ? "s" : "");
}

pshard_status_t shard_new_group_keyed_run(pshard_shard_server_t *s, pshard_comm_t *comm,
                                          shard_op_t *op, char *err, size_t errlen)
{
    shard_new_groups_arg_t *a = op->arg;
    const Pshard__NewGroupsRequest *req = a->req;
    const char *key = req->key;
    int me = pshard_comm_rank(comm), world = pshard_comm_world_size(comm);
    size_t keylen = strlen(key);
    if (keylen > GROUP_KEY_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "group key of %zu bytes: at most %d", keylen, GROUP_KEY_MAX);
    if (req->n_groups != 1)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "NewGroups with a key makes exactly one group, not %zu", req->n_groups);
    if (req->timeout_ms < 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "timeout_ms %" PRId64 " is negative", req->timeout_ms);
    if (s->npgs + 1 > GROUPS_PER_SESSION)
        return ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                       "this session has %zu process groups; one more exceeds the %d a session "
                       "may have",
                       s->npgs, GROUPS_PER_SESSION);
    const Pshard__GroupRanks *pb = req->groups[0];
    PS_CHECK(ranks_check(pb, 0, world, err, errlen));
    char list[160];
    int grank = -1;
    for (size_t k = 0; k < pb->n_ranks; k++)
        if (pb->ranks[k] == me)
            grank = (int)k;
    if (grank < 0) {
        int *rs = malloc(pb->n_ranks * sizeof(int));
        if (!rs)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        for (size_t k = 0; k < pb->n_ranks; k++)
            rs[k] = pb->ranks[k];
        ranks_format(rs, (int)pb->n_ranks, list, sizeof(list));
        free(rs);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "rank %d is not a member of group \"%.64s\" (ranks %s): with a key, only "
                       "the group's members make it",
                       me, key, list);
    }
    char name[48];
    keyed_name(key, name, sizeof(name));
    for (size_t i = 0; i < s->npgs; i++) {
        shard_pg_t *o = s->pgs[i];
        if (!o->key)
            continue;
        char oname[48];
        keyed_name(o->key, oname, sizeof(oname));
        if (strcmp(o->key, key) != 0 && strcmp(oname, name) != 0)
            continue;
        ranks_format(o->ranks, o->size, list, sizeof(list));
        if (o->orphan && strcmp(o->key, key) == 0) {
            /* The lost trainer's group, made again by its replacement: the same group, under
             * the id the other members use, rebuilt with them on its first use. */
            bool same = o->size == (int)pb->n_ranks;
            for (int k = 0; same && k < o->size; k++)
                same = o->ranks[k] == pb->ranks[k];
            if (!same)
                return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                               "group \"%.64s\" was made with ranks %s by the trainer this one "
                               "replaces; a replacement makes its groups again alike",
                               key, list);
            pthread_mutex_lock(&s->mu);
            o->orphan = false;
            o->timeout_ms = req->timeout_ms;
            pthread_mutex_unlock(&s->mu);
            a->first_id = o->id;
            PS_INFO(PS_SUB_SHARD,
                    "the replacement trainer made group \"%.64s\" (ranks %s) again: id %" PRIu32,
                    key, list, o->id);
            return PSHARD_OK;
        }
        if (strcmp(o->key, key) == 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "group \"%.64s\" already exists (id %" PRIu32 ", ranks %s): a key "
                           "names one group per session",
                           key, o->id, list);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "group key \"%.64s\" hashes like the key of group %" PRIu32
                       " (\"%.64s\"); use another key",
                       key, o->id, o->key);
    }
    if (s->next_keyed_pg_id < KEYED_COUNTER_BASE)
        s->next_keyed_pg_id = KEYED_COUNTER_BASE;
    if (s->next_keyed_pg_id > GROUP_COUNTER_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                       "this cluster generation made %u keyed process groups on this server; no "
                       "more ids",
                       GROUP_COUNTER_MAX + 1 - KEYED_COUNTER_BASE);
    /* A member whose trainer joined never builds its end: say so instead of waiting. */
    for (size_t k = 0; s->coord && k < pb->n_ranks; k++) {
        if (pb->ranks[k] == me)
            continue;
        char jkey[96], *val = NULL, why[PSHARD_ERRLEN] = "";
        size_t vlen = 0;
        joined_key(s, pb->ranks[k], jkey, sizeof(jkey));
        if (ps_coord_store_fetch(s->coord, jkey, &val, &vlen, 2000, why, sizeof(why)) ==
            PSHARD_OK) {
            free(val);
            return ps_errf(err, errlen, PSHARD_ERR_JOINED,
                           "rank %d has joined (its trainer ran out of input): group \"%.64s\" "
                           "cannot be made with it",
                           pb->ranks[k], key);
        }
    }
    uint32_t gen16 = (uint32_t)(s->comm_generation & 0xffff);
    uint32_t id = gen16 << 16 | s->next_keyed_pg_id++;
    shard_pg_t *g = calloc(1, sizeof(*g));
    if (!g || !(g->ranks = malloc(pb->n_ranks * sizeof(int))) || !(g->key = strdup(key))) {
        group_free(g);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    g->id = id;
    g->size = (int)pb->n_ranks;
    g->grank = grank;
    g->timeout_ms = req->timeout_ms;
    for (int k = 0; k < g->size; k++)
        g->ranks[k] = pb->ranks[k];
    ranks_format(g->ranks, g->size, list, sizeof(list));
    /* Grow the array first (under mu: the watch thread walks it), so nothing fails after the
     * communicator is built. */
    pthread_mutex_lock(&s->mu);
    shard_pg_t **grown = realloc(s->pgs, (s->npgs + 1) * sizeof(*grown));
    if (grown)
        s->pgs = grown;
    pthread_mutex_unlock(&s->mu);
    if (!grown) {
        group_free(g);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    char arrived[160], why[PSHARD_ERRLEN] = "";
    arrival_key(s, name, me, arrived, sizeof(arrived));
    if (s->coord &&
        ps_coord_store_put(s->coord, arrived, "1", 1, 2000, why, sizeof(why)) != PSHARD_OK)
        PS_WARN(PS_SUB_SHARD, "could not set %s: %s", arrived, why);
    pshard_comm_config_t cc;
    shard_comm_config(s, &cc, name, g->grank, g->size, s->comm_generation);
    if (req->timeout_ms > 0)
        cc.timeout_ms = req->timeout_ms;
    cc.connect_timeout_ms = req->timeout_ms > 0 ? req->timeout_ms : s->cfg.coll_timeout_ms;
    why[0] = '\0';
    pshard_status_t rc = pshard_comm_create(&cc, &g->comm, why, sizeof(why));
    if (rc != PSHARD_OK) {
        char missing[256];
        missing_members(s, name, g, missing, sizeof(missing));
        group_free(g);
        /* A member that never came is the cause, whatever broke first here (a member that gave
         * up before this one resets its connections): every member reports it alike. */
        if (missing[0])
            rc = PSHARD_ERR_TIMEOUT;
        return ps_errf(err, errlen, rc,
                       "cannot build group \"%.64s\" (ranks %s; this is rank %d)%s: %s (the "
                       "communicator's ranks are the group's, in the order of its ranks)",
                       key, list, me, missing, why);
    }
    /* Every member has come: the arrival marks are no longer needed (best effort). */
    if (s->coord && ps_coord_store_remove(s->coord, arrived, 2000, why, sizeof(why)) != PSHARD_OK)
        PS_DEBUG(PS_SUB_SHARD, "could not delete %s: %s", arrived, why);
    pthread_mutex_lock(&s->mu);
    s->pgs[s->npgs++] = g;
    pthread_mutex_unlock(&s->mu);
    a->first_id = id;
    PS_INFO(PS_SUB_SHARD, "made keyed process group \"%.64s\" (ranks %s), id %" PRIu32, key, list,
            id);
    return PSHARD_OK;
}
