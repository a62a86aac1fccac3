/* Healing a lost shard server from an HSDP replica: see shard_heal.h for the sequence. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/coord_client.h"
#include "pshard/log.h"
#include "pshard/util.h"

#include "shard_heal.h"
#include "shard_internal.h"
#include "shard_ops.h"

/* Tags of the state's broadcasts on the replicate ring (no trainer operation runs there yet). */
#define TAG_HEAL 0x7fffff00u
/* The longest a newcomer waits for the survivors' metadata without a --trainer-replace-ms of
 * its own to go by. */
#define HEAL_META_WAIT_MS 60000
/* The header broadcast before the state: what the receivers allocate and check. */
enum { H_FINGERPRINT, H_STEP, H_ABORTED, H_NUMEL, H_NPARAMS, H_NGROUPS, H_NSTATE, H_WORDS };

bool shard_heal_possible(const pshard_shard_server_t *s, char *why, size_t len)
{
    const shard_model_t *m = s->model;
    const char *no = s->cfg.trainer_replace_ms <= 0
                         ? "--trainer-replace-ms is not set (pshardrun sets it with --max-restarts)"
                     : !m              ? "no model is defined"
                     : m->replicas < 2 ? "no replica holds its shards (HSDP needs replicate >= 2)"
                     : s->dev          ? "the shards are in GPU memory"
                     : m->in_backward  ? "the model steps in backward (optimizer_in_backward)"
                     : m->trainer_optimizer
                         ? "a trainer's own optimizer (torch.optim) holds state only the lost "
                           "rank's trainer and server had; pshard.torch.optim keeps it on the "
                           "servers, where a replica has it"
                         : NULL;
    if (no && why)
        snprintf(why, len, "%s", no);
    return no == NULL;
}

#define HEAL_CAPABLE_KEY "pshard/heal/capable"

void shard_heal_capable(pshard_shard_server_t *s)
{
    pthread_mutex_lock(&s->mu);
    bool can = shard_heal_possible(s, NULL, 0);
    pthread_mutex_unlock(&s->mu);
    if (!s->coord)
        return;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t rc =
        can ? ps_coord_store_put(s->coord, HEAL_CAPABLE_KEY, "1", 1, 5000, err, sizeof(err))
            : ps_coord_store_remove(s->coord, HEAL_CAPABLE_KEY, 5000, err, sizeof(err));
    if (rc != PSHARD_OK)
        PS_WARN(PS_SUB_SHARD, "could not %s %s in the store: %s", can ? "set" : "delete",
                HEAL_CAPABLE_KEY, err);
}

bool shard_ring_step_aborted(const pshard_shard_server_t *s, pshard_comm_t *ring)
{
    pshard_status_t e = pshard_comm_error(ring, NULL, 0);
    return e == PSHARD_ERR_STEP_ABORTED ||
           (e == PSHARD_ERR_PEER_LOST && shard_heal_possible(s, NULL, 0));
}

void shard_heal_peer_lost(pshard_shard_server_t *s, pshard_status_t *rc, char *err, size_t errlen)
{
    pthread_mutex_lock(&s->mu);
    bool heal = shard_heal_possible(s, NULL, 0);
    pthread_mutex_unlock(&s->mu);
    if (!heal)
        return;
    char msg[PSHARD_ERRLEN];
    ps_snprintf(msg, sizeof(msg),
                "the step in flight is aborted on every rank and none of it is applied: %s; a "
                "replacement server may heal the lost rank from a replica",
                err);
    PS_WARN(PS_SUB_SHARD, "%s", msg);
    shard_abort_ring(s, PSHARD_ERR_STEP_ABORTED, msg);
    shard_pgs_abort(s, -1, PSHARD_ERR_STEP_ABORTED, msg);
    err[0] = '\0';
    *rc = ps_errf(err, errlen, PSHARD_ERR_STEP_ABORTED, "%s", msg);
}

void shard_heal_await(pshard_shard_server_t *s, int rank, const char *name, const char *cause)
{
    char msg[PSHARD_ERRLEN];
    pthread_mutex_lock(&s->mu);
    int64_t wait_ms = s->cfg.trainer_replace_ms;
    int other = s->heal_rank;
    if (other < 0) {
        s->heal_rank = rank;
        s->heal_from_gen = s->comm_generation;
        s->heal_started_ns = ps_now_ns();
        s->heal_deadline_ns = s->heal_started_ns + wait_ms * 1000000;
        ps_strlcpy(s->heal_cause, cause, sizeof(s->heal_cause));
        ps_snprintf(s->heal_note, sizeof(s->heal_note),
                    "awaiting a replacement for rank %d (lost: %s) to heal from a replica, for "
                    "up to %lld ms",
                    rank, cause, (long long)wait_ms);
    }
    s->ring_cancel = 1; /* a ring set-up that counts on the lost rank gives up */
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pshard_status_t st = PSHARD_ERR_STEP_ABORTED;
    if (other >= 0 && other != rank) {
        snprintf(msg, sizeof(msg),
                 "rank %d (shard server %s) was lost (%s) while rank %d was still awaited: one "
                 "heal at a time, the job cannot go on",
                 rank, name, cause, other);
        st = PSHARD_ERR_PEER_LOST;
        shard_set_fatal(s, st, msg);
    } else {
        snprintf(msg, sizeof(msg),
                 "rank %d (shard server %s) was lost (%s): the step in flight is aborted on every "
                 "rank and none of it is applied; a replacement server for rank %d heals from a "
                 "replica holding its shard if it comes within %lld ms (pshardrun "
                 "--max-restarts)",
                 rank, name, cause, rank, (long long)wait_ms);
        PS_WARN(PS_SUB_SHARD, "%s", msg);
    }
    shard_abort_ring(s, st, msg);
    shard_pgs_abort(s, -1, st, msg);
}

pshard_status_t shard_heal_wait_formed(pshard_shard_server_t *s, int *rank, int *world,
                                       uint64_t *gen, char *err, size_t errlen)
{
    pthread_mutex_lock(&s->mu);
    if (s->heal_rank < 0) {
        pthread_mutex_unlock(&s->mu);
        return PSHARD_OK;
    }
    while (!atomic_load(&s->stop) &&
           !(s->formed && s->formed_generation > s->heal_from_gen && s->rank >= 0) &&
           ps_now_ns() < s->heal_deadline_ns) {
        shard_cv_wait(s, 100);
    }
    pshard_status_t rc = PSHARD_OK;
    if (atomic_load(&s->stop))
        rc = ps_errf(err, errlen, PSHARD_ERR_ABORTED, "the server is stopping");
    else if (!(s->formed && s->formed_generation > s->heal_from_gen))
        rc = ps_errf(err, errlen, PSHARD_ERR_PEER_LOST,
                     "rank %d's shard server was lost (%s) and no replacement took its rank within "
                     "%lld ms (--trainer-replace-ms): the job cannot go on",
                     s->heal_rank, s->heal_cause, (long long)s->cfg.trainer_replace_ms);
    *rank = s->rank;
    *world = s->world;
    *gen = s->formed_generation;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static void meta_key(char *buf, size_t len, uint64_t gen)
{
    snprintf(buf, len, "pshard/heal/g%" PRIu64 "/meta", gen);
}

static void groups_key(char *buf, size_t len, uint64_t gen, int rank)
{
    snprintf(buf, len, "pshard/heal/g%" PRIu64 "/groups/%d", gen, rank);
}

/* A keyed group's line: "id serial timeout_ms size r0,r1,... hexkey\n". */
static char *groups_text(pshard_shard_server_t *s, int lost, size_t *len)
{
    size_t cap = 256, used = 0;
    char *out = malloc(cap);
    if (!out)
        return NULL;
    out[0] = '\0';
    for (size_t i = 0; i < s->npgs; i++) {
        const shard_pg_t *g = s->pgs[i];
        bool holds = false;
        for (int k = 0; k < g->size; k++)
            holds |= g->ranks[k] == lost;
        if (!g->key || !holds)
            continue;
        size_t need = used + 64 + (size_t)g->size * 12 + 2 * strlen(g->key) + 2;
        if (need > cap) {
            char *grown = realloc(out, need * 2);
            if (!grown) {
                free(out);
                return NULL;
            }
            out = grown;
            cap = need * 2;
        }
        used += (size_t)snprintf(out + used, cap - used, "%" PRIu32 " %" PRIu32 " %" PRId64 " %d ",
                                 g->id, g->serial, g->timeout_ms, g->size);
        for (int k = 0; k < g->size; k++)
            used += (size_t)snprintf(out + used, cap - used, "%s%d", k ? "," : "", g->ranks[k]);
        out[used++] = ' ';
        for (const unsigned char *p = (const unsigned char *)g->key; *p; p++)
            used += (size_t)snprintf(out + used, cap - used, "%02x", *p);
        out[used++] = '\n';
        out[used] = '\0';
    }
    *len = used;
    return out;
}

void shard_heal_publish(pshard_shard_server_t *s, uint64_t gen, uint32_t serial)
{
    pthread_mutex_lock(&s->op_mu);
    const shard_model_t *m = s->model;
    char key[96], val[160], err[PSHARD_ERRLEN] = "";
    meta_key(key, sizeof(key), gen);
    snprintf(val, sizeof(val),
             "serial %" PRIu32 " attempt %" PRIu64 " replicas %d shards %d fp %016" PRIx64, serial,
             m->mesh_attempt, m->replicas, m->world, m->fingerprint);
    if (ps_coord_store_put(s->coord, key, val, strlen(val), 10000, err, sizeof(err)) != PSHARD_OK)
        PS_WARN(PS_SUB_SHARD, "could not publish %s for the replacement: %s", key, err);
    size_t len = 0;
    char *text = groups_text(s, s->heal_rank, &len);
    groups_key(key, sizeof(key), gen, s->rank);
    err[0] = '\0';
    if (!text || ps_coord_store_put(s->coord, key, text, len, 10000, err, sizeof(err)) != PSHARD_OK)
        PS_WARN(PS_SUB_SHARD, "could not publish %s for the replacement: %s", key,
                text ? err : "out of memory");
    free(text);
    pthread_mutex_unlock(&s->op_mu);
}

void shard_heal_state_free(shard_heal_state_t *h)
{
    if (!h)
        return;
    pshard_comm_destroy(h->shard_comm);
    pshard_comm_destroy(h->replicate_comm);
    free(h->master);
    free(h->state[0]);
    free(h->state[1]);
    free(h->psteps);
    free(h->group_words);
    free(h);
}

pshard_status_t shard_heal_join(pshard_shard_server_t *s, uint64_t gen, uint32_t *serial, char *err,
                                size_t errlen)
{
    char key[96];
    meta_key(key, sizeof(key), gen);
    int64_t limit_ms =
        s->cfg.trainer_replace_ms > 0 ? s->cfg.trainer_replace_ms : HEAL_META_WAIT_MS;
    int64_t give_up = ps_now_ns() + limit_ms * 1000000;
    const char *keys[1] = {key};
    Pshard__StoreWaitResponse *wr = NULL;
    for (;;) {
        char werr[PSHARD_ERRLEN] = "";
        pshard_status_t rc = ps_coord_store_await(s->coord, keys, 1, 500, &wr, werr, sizeof(werr));
        if (rc == PSHARD_OK)
            break;
        if (atomic_load(&s->stop))
            return ps_errf(err, errlen, PSHARD_ERR_ABORTED, "the server is stopping");
        if (rc != PSHARD_ERR_TIMEOUT || ps_now_ns() > give_up)
            return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                           "this server took rank %d of a lost shard server, but no replica "
                           "offered to heal it within %lld ms (%s): the lost rank's state is "
                           "gone; without HSDP replicas (or with a torch.optim optimizer in the "
                           "trainer) restart the job from its last checkpoint",
                           s->rank, (long long)limit_ms, werr[0] ? werr : "no metadata");
    }
    char text[160] = "";
    if (wr->n_values == 1) {
        size_t n = wr->values[0].len < sizeof(text) - 1 ? wr->values[0].len : sizeof(text) - 1;
        memcpy(text, wr->values[0].data, n);
        text[n] = '\0';
    }
    protobuf_c_message_free_unpacked(&wr->base, NULL);
    shard_heal_state_t *h = calloc(1, sizeof(*h));
    if (!h)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    h->source = -1;
    if (sscanf(text, "serial %" SCNu32 " attempt %" SCNu64 " replicas %d shards %d fp %" SCNx64,
               &h->serial, &h->attempt, &h->replicas, &h->shards, &h->fingerprint) != 5 ||
        h->replicas < 2 || h->shards < 1 || (int64_t)h->replicas * h->shards != s->world) {
        free(h);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "store key %s holds no usable heal metadata (\"%.80s\") for a %d-rank world",
                       key, text, s->world);
    }
    h->started_ns = ps_now_ns();
    pthread_mutex_lock(&s->op_mu);
    shard_heal_state_free(s->heal);
    s->heal = h;
    pthread_mutex_unlock(&s->op_mu);
    *serial = h->serial;
    PS_WARN(PS_SUB_SHARD,
            "this server replaces rank %d's lost shard server: its state comes from a replica "
            "(ring serial %" PRIu32 ", %d x %d mesh)",
            s->rank, h->serial, h->replicas, h->shards);
    return PSHARD_OK;
}

/* The newcomer: the keyed groups the lost server was in, from every survivor's list (deduped by
 * id), kept as orphans that the new trainer claims by making them again (shard_groups.c). What
 * cannot be parsed is skipped with a warning: the trainer's new_group then fails naming it. */
static void adopt_groups(pshard_shard_server_t *s, uint64_t gen, int world)
{
    for (int r = 0; r < world; r++) {
        if (r == s->rank)
            continue;
        char key[96], *text = NULL, err[PSHARD_ERRLEN] = "";
        size_t len = 0;
        groups_key(key, sizeof(key), gen, r);
        if (ps_coord_store_fetch(s->coord, key, &text, &len, 5000, err, sizeof(err)) != PSHARD_OK)
            continue; /* a survivor that could not publish: its groups are made anew */
        char *save = NULL;
        for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
            uint32_t id, serial;
            int64_t timeout_ms;
            int size, used = 0;
            if (sscanf(line, "%" SCNu32 " %" SCNu32 " %" SCNd64 " %d %n", &id, &serial, &timeout_ms,
                       &size, &used) != 4 ||
                size < 1 || size > world) {
                PS_WARN(PS_SUB_SHARD, "rank %d's heal group line is malformed: %.80s", r, line);
                continue;
            }
            int *ranks = malloc((size_t)size * sizeof(int));
            char *hex = NULL;
            const char *p = line + used;
            bool ok = ranks != NULL;
            for (int k = 0; ok && k < size; k++) {
                char *end = NULL;
                long v = strtol(p, &end, 10);
                ok = end != p && v >= 0 && v < world && (k == 0 || v > ranks[k - 1]) &&
                     (*end == (k + 1 < size ? ',' : ' '));
                if (ok) {
                    ranks[k] = (int)v;
                    p = end + 1;
                }
            }
            size_t hl = ok ? strlen(p) : 0;
            ok = ok && hl > 0 && hl % 2 == 0 && (hex = malloc(hl / 2 + 1)) != NULL;
            for (size_t k = 0; ok && k < hl / 2; k++) {
                unsigned v;
                ok = sscanf(p + 2 * k, "%2x", &v) == 1 && v >= 0x20 && v < 0x7f;
                hex[k] = (char)v;
            }
            if (ok) {
                hex[hl / 2] = '\0';
                char why[PSHARD_ERRLEN] = "";
                if (shard_pg_adopt_orphan(s, id, hex, ranks, size, serial, timeout_ms, why,
                                          sizeof(why)) != PSHARD_OK)
                    PS_WARN(PS_SUB_SHARD, "cannot keep group %" PRIu32 " for the trainer: %s", id,
                            why);
            } else {
                PS_WARN(PS_SUB_SHARD, "rank %d's heal group line is malformed: %.80s", r, line);
            }
            free(hex);
            free(ranks);
        }
        free(text);
    }
}

/* Broadcasts count elements of dtype dt on comm from root: the source sends buf, the others
 * receive into it. */
static pshard_status_t bcast(pshard_comm_t *comm, int root, pshard_dtype_t dt, void *buf,
                             size_t count, uint32_t serial, uint32_t part, const char *label,
                             char *err, size_t errlen)
{
    if (count == 0)
        return PSHARD_OK;
    pshard_coll_args_t a = {.op = PSHARD_COLL_BROADCAST,
                            .dtype = dt,
                            .root = root,
                            .send = buf,
                            .recv = buf,
                            .count = count,
                            .tag = ((uint64_t)serial << 32) | (TAG_HEAL + part),
                            .label = label};
    return pshard_coll_run(comm, &a, err, errlen);
}

/* One replicate ring's transfer: the source's state to every other member. mine: this rank's
 * model (NULL on the newcomer, which receives into h). */
static pshard_status_t transfer(pshard_comm_t *rep, int root, bool source,
                                const shard_model_t *mine, shard_heal_state_t *h, uint32_t serial,
                                char *err, size_t errlen)
{
    int64_t hdr[H_WORDS] = {0};
    if (source) {
        hdr[H_FINGERPRINT] = (int64_t)mine->fingerprint;
        hdr[H_STEP] = mine->step;
        hdr[H_ABORTED] = mine->aborted_steps;
        hdr[H_NUMEL] = (int64_t)mine->shard_numel;
        hdr[H_NPARAMS] = (int64_t)mine->nparams;
        hdr[H_NGROUPS] = (int64_t)mine->ngroups;
        hdr[H_NSTATE] = mine->nstate;
    }
    PS_CHECK(bcast(rep, root, PSHARD_INT64, hdr, H_WORDS, serial, 0, "heal header", err, errlen));
    if (source)
        shard_fault_point("heal-send", mine->step);
    if (hdr[H_NUMEL] < 0 || hdr[H_NPARAMS] < 1 || hdr[H_NPARAMS] > SHARD_MAX_PARAMS ||
        hdr[H_NGROUPS] < 1 || hdr[H_NGROUPS] > SHARD_MAX_GROUPS || hdr[H_NSTATE] < 0 ||
        hdr[H_NSTATE] > 2 || (uint64_t)hdr[H_NUMEL] > ((uint64_t)1 << 40))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "the heal source sent an impossible shard header (%" PRId64
                       " elements, %" PRId64 " parameters, %" PRId64 " groups, %" PRId64
                       " state arrays)",
                       hdr[H_NUMEL], hdr[H_NPARAMS], hdr[H_NGROUPS], hdr[H_NSTATE]);
    size_t numel = (size_t)hdr[H_NUMEL], np = (size_t)hdr[H_NPARAMS], ng = (size_t)hdr[H_NGROUPS];
    int nstate = (int)hdr[H_NSTATE];
    /* Sender: its own arrays. A receiver: h's (the newcomer keeps them), or scratch (a replica
     * that is neither: it takes part and drops what it got). */
    float *master = NULL, *st[2] = {NULL, NULL};
    int64_t *psteps = NULL, *words = NULL;
    if (source) {
        master = mine->master;
        st[0] = mine->state0;
        st[1] = mine->state1;
        psteps = mine->psteps;
        words = calloc(ng * SHARD_GROUP_WORDS, sizeof(int64_t));
        if (!words)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        shard_groups_encode(mine->groups, ng, words);
    } else {
        master = malloc(numel * sizeof(float) + 1);
        for (int k = 0; k < nstate; k++)
            st[k] = malloc(numel * sizeof(float) + 1);
        psteps = malloc(np * sizeof(int64_t));
        words = malloc(ng * SHARD_GROUP_WORDS * sizeof(int64_t));
        if (!master || (nstate > 0 && !st[0]) || (nstate > 1 && !st[1]) || !psteps || !words) {
            free(master);
            free(st[0]);
            free(st[1]);
            free(psteps);
            free(words);
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY,
                           "out of memory receiving a %zu-element shard state", numel);
        }
    }
    pshard_status_t rc =
        bcast(rep, root, PSHARD_FP32, master, numel, serial, 1, "heal master", err, errlen);
    for (int k = 0; k < nstate && rc == PSHARD_OK; k++)
        rc = bcast(rep, root, PSHARD_FP32, st[k], numel, serial, 2 + (uint32_t)k, "heal state", err,
                   errlen);
    if (rc == PSHARD_OK)
        rc = bcast(rep, root, PSHARD_INT64, psteps, np, serial, 4, "heal steps", err, errlen);
    if (rc == PSHARD_OK)
        rc = bcast(rep, root, PSHARD_INT64, words, ng * SHARD_GROUP_WORDS, serial, 5, "heal groups",
                   err, errlen);
    if (source) {
        free(words);
        return rc;
    }
    if (rc == PSHARD_OK && h) {
        h->fingerprint = (uint64_t)hdr[H_FINGERPRINT];
        h->step = hdr[H_STEP];
        h->aborted_steps = hdr[H_ABORTED];
        h->shard_numel = numel;
        h->nparams = np;
        h->ngroups = ng;
        h->nstate = nstate;
        h->master = master;
        h->state[0] = st[0];
        h->state[1] = st[1];
        h->psteps = psteps;
        h->group_words = words;
        return PSHARD_OK;
    }
    free(master);
    free(st[0]);
    free(st[1]);
    free(psteps);
    free(words);
    return rc;
}

pshard_status_t shard_heal_transfer(pshard_shard_server_t *s, pshard_comm_t *comm,
                                    const int64_t *flags, uint32_t serial, uint64_t gen, char *err,
                                    size_t errlen)
{
    int me = pshard_comm_rank(comm), world = pshard_comm_world_size(comm);
    shard_heal_state_t *h = s->heal;
    bool healing = h != NULL && h->source < 0;
    if (!healing && (!s->model || !s->model->replicate_comm))
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "a rank awaits its state from a replica, but rank %d holds no HSDP model "
                       "to heal it from",
                       me);
    int shards = healing ? h->shards : s->model->world;
    if (shards < 1 || world % shards != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "no mesh to heal over");
    int index = me % shards;
    bool wanted = false; /* a rank of this shard index awaits its state */
    int source = -1;
    for (int r = index; r < world; r += shards) {
        if (flags[r] & SHARD_HEAL_HEALING)
            wanted = true;
        else if ((flags[r] & SHARD_HEAL_HAS_MODEL) && source < 0)
            source = r;
    }
    if (healing) {
        adopt_groups(s, gen, world);
        shard_model_t holder;
        memset(&holder, 0, sizeof(holder));
        PS_CHECK(shard_mesh_connect(s, &holder, me, h->replicas, h->shards, h->attempt, serial, gen,
                                    err, errlen));
        h->shard_comm = holder.shard_comm;
        h->replicate_comm = holder.replicate_comm;
    }
    if (!wanted)
        return PSHARD_OK;
    if (source < 0)
        return ps_errf(err, errlen, PSHARD_ERR_PEER_LOST,
                       "no rank of shard index %d holds its state any more (every replica of it "
                       "was lost): the job cannot go on; restart it from its last checkpoint",
                       index);
    pshard_comm_t *rep = healing ? h->replicate_comm : s->model->replicate_comm;
    int64_t t0 = ps_now_ns();
    pshard_status_t rc = transfer(rep, source / shards, me == source, healing ? NULL : s->model,
                                  healing ? h : NULL, serial, err, errlen);
    if (rc != PSHARD_OK) {
        char why[PSHARD_ERRLEN];
        ps_snprintf(why, sizeof(why), "%s", err);
        err[0] = '\0';
        return ps_errf(err, errlen, rc,
                       "healing shard index %d from rank %d failed on rank %d: %s; the job cannot "
                       "go on",
                       index, source, me, why);
    }
    if (healing) {
        h->source = source;
    } else if (me == source) {
        PS_INFO(PS_SUB_SHARD, "sent this rank's shard state to heal shard index %d in %.3f s",
                index, (double)(ps_now_ns() - t0) / 1e9);
    }
    return PSHARD_OK;
}

pshard_status_t shard_heal_adopt(pshard_shard_server_t *s, shard_model_t *m, int reps, int shards,
                                 char *err, size_t errlen)
{
    shard_heal_state_t *h = s->heal;
    pshard_status_t rc = PSHARD_OK;
    if (h->source < 0)
        rc = ps_errf(err, errlen, PSHARD_ERR_UNAVAILABLE,
                     "this server replaces a lost one and has not received its state yet; retry");
    else if (m->fingerprint != h->fingerprint || reps != h->replicas || shards != h->shards)
        rc = ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                     "rank %d's replacement trainer defines another model (fingerprint %016" PRIx64
                     ", mesh %d x %d) than its replicas hold (%016" PRIx64 ", mesh %d x %d, healed "
                     "from rank %d): start the same training script",
                     s->rank, m->fingerprint, reps, shards, h->fingerprint, h->replicas, h->shards,
                     h->source);
    else if (m->shard_numel != h->shard_numel || m->nparams != h->nparams ||
             m->ngroups != h->ngroups || m->nstate != h->nstate)
        rc = ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                     "rank %d's shard from rank %d does not fit the model defined here (%zu vs %zu "
                     "elements, %d vs %d state arrays)",
                     s->rank, h->source, h->shard_numel, m->shard_numel, h->nstate, m->nstate);
    if (rc != PSHARD_OK)
        return rc; /* the state stays for a definition of the right model */
    memcpy(m->master, h->master, h->shard_numel * sizeof(float));
    if (h->nstate > 0)
        memcpy(m->state0, h->state[0], h->shard_numel * sizeof(float));
    if (h->nstate > 1)
        memcpy(m->state1, h->state[1], h->shard_numel * sizeof(float));
    shard_model_set_step(m, h->step);
    memcpy(m->psteps, h->psteps, h->nparams * sizeof(int64_t));
    m->aborted_steps = h->aborted_steps;
    shard_group_t *groups = calloc(h->ngroups, sizeof(*groups));
    if (!groups)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    s->heal = NULL; /* adopted from here on */
    shard_groups_decode(h->group_words, h->ngroups, m->optim.kind, groups);
    shard_model_set_groups(m, groups);
    free(groups);
    pthread_mutex_lock(&s->mu);
    m->shard_comm = h->shard_comm;
    m->replicate_comm = h->replicate_comm;
    pthread_mutex_unlock(&s->mu);
    h->shard_comm = h->replicate_comm = NULL;
    m->replicas = h->replicas;
    m->mesh_attempt = h->attempt;
    int64_t own = atomic_load(&s->session_timeout_ms);
    pshard_comm_set_timeout(m->shard_comm, own);
    pshard_comm_set_timeout(m->replicate_comm, own);
    pthread_mutex_lock(&s->mu);
    int64_t lost_ns = s->heal_started_ns;
    s->heals++;
    double took = (double)(ps_now_ns() - (lost_ns ? lost_ns : h->started_ns)) / 1e9;
    ps_snprintf(s->heal_note, sizeof(s->heal_note),
                "rank %d healed from rank %d at step %" PRId64 ", %.3f s after this server took "
                "the lost one's rank",
                s->rank, h->source, h->step, took);
    pthread_mutex_unlock(&s->mu);
    PS_WARN(PS_SUB_SHARD,
            "rank %d healed from rank %d (a replica of its shard): %zu elements and the "
            "optimizer state at step %" PRId64 " (%" PRId64 " aborted), %.3f s after this "
            "server took the lost server's rank",
            s->rank, h->source, h->shard_numel, h->step, h->aborted_steps, took);
    shard_heal_state_free(h);
    return PSHARD_OK;
}
