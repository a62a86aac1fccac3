/* libpshard's process groups (torch.distributed.new_group): the ranks of each new group are
 * checked here, the shard servers build the groups' communicators (NewGroups: agreed by every
 * rank, or keyed and made by the members only), and a handle per group keeps its id and ranks
 * for pshard_collective. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/util.h"

#include "client_internal.h"

#define MAX_GROUPS_PER_CALL 64

static atomic_uint_fast64_t last_serial;

uint64_t client_next_serial(void)
{
    return (uint64_t)atomic_fetch_add(&last_serial, 1) + 1;
}

/* "1, 3" (at most 16 ranks, then "...") into buf. */
static void ranks_text(const int *ranks, size_t n, char *buf, size_t len)
{
    size_t used = 0;
    buf[0] = '\0';
    for (size_t k = 0; k < n && used < len; k++) {
        int w = k == 16 ? snprintf(buf + used, len - used, ", ... (%zu ranks)", n)
                        : snprintf(buf + used, len - used, "%s%d", k ? ", " : "", ranks[k]);
        if (w < 0)
            break;
        used += (size_t)w;
        if (k == 16)
            break;
    }
}

pshard_status_t client_group_check(pshard_client_t *c, const pshard_group_t *g, const char *what)
{
    if (g->client_serial != c->serial || strcmp(g->session, c->session) != 0)
        return client_fail(c, PSHARD_ERR_UNAVAILABLE,
                           "%s: group %u was made by another client (session %s), not by this "
                           "one (session %s); make the groups again on this client",
                           what, g->id, g->session, c->session);
    if (g->rank < 0) {
        char list[160];
        ranks_text(g->ranks, (size_t)g->size, list, sizeof(list));
        return client_fail(c, PSHARD_ERR_FAILED_PRECONDITION,
                           "%s: this trainer (rank %d) is not in the group (ranks %s)", what,
                           c->rank, list);
    }
    return PSHARD_OK;
}

/* INVALID_ARGUMENT naming the first group that is empty or whose ranks are not strictly
 * increasing ranks of the world; PSHARD_OK when every group is fine. */
static pshard_status_t check_groups(pshard_client_t *c, const int *ranks, const size_t *sizes,
                                    size_t ngroups)
{
    if (ngroups < 1 || ngroups > MAX_GROUPS_PER_CALL)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "new_groups: %zu groups; one call makes 1 to %d", ngroups,
                           MAX_GROUPS_PER_CALL);
    if (!ranks || !sizes)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "new_groups: ranks or sizes is NULL");
    size_t off = 0;
    for (size_t i = 0; i < ngroups; i++) {
        if (sizes[i] == 0)
            return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                               "new_groups: group %zu is empty (a group needs at least one rank)",
                               i);
        if (sizes[i] > (size_t)c->world)
            return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                               "new_groups: group %zu has %zu ranks; the world has %d", i, sizes[i],
                               c->world);
        for (size_t k = 0; k < sizes[i]; k++) {
            int r = ranks[off + k];
            if (r < 0 || r >= c->world)
                return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                                   "new_groups: group %zu: rank %d is not a rank of the %d-rank "
                                   "world",
                                   i, r, c->world);
            if (k > 0 && r == ranks[off + k - 1])
                return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                                   "new_groups: group %zu: rank %d is repeated", i, r);
            if (k > 0 && r < ranks[off + k - 1])
                return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                                   "new_groups: group %zu: rank %d comes after rank %d (ranks "
                                   "must be strictly increasing)",
                                   i, r, ranks[off + k - 1]);
        }
        off += sizes[i];
    }
    return PSHARD_OK;
}

/* A handle for the group of id holding ranks[0..n), or NULL when out of memory. */
static pshard_group_t *group_make(const pshard_client_t *c, uint32_t id, const int *ranks, size_t n)
{
    pshard_group_t *g = malloc(sizeof(*g) + n * sizeof(int));
    if (!g)
        return NULL;
    g->id = id;
    g->size = (int)n;
    g->rank = -1;
    g->client_serial = c->serial;
    ps_strlcpy(g->session, c->session, sizeof(g->session));
    memcpy(g->ranks, ranks, n * sizeof(int));
    for (size_t k = 0; k < n; k++)
        if (ranks[k] == c->rank)
            g->rank = (int)k;
    return g;
}

pshard_status_t pshard_new_groups(pshard_client_t *c, const int *ranks, const size_t *sizes,
                                  size_t ngroups, int64_t timeout_ms, pshard_group_t **out)
{
    if (!out)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "new_groups: out is NULL");
    for (size_t i = 0; i < ngroups && i < MAX_GROUPS_PER_CALL; i++)
        out[i] = NULL;
    PS_CHECK(check_groups(c, ranks, sizes, ngroups));
    if (timeout_ms < 0)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "new_groups: timeout_ms %lld is negative (0: the servers' collective "
                           "timeout)",
                           (long long)timeout_ms);
    size_t total = 0;
    for (size_t i = 0; i < ngroups; i++)
        total += sizes[i];
    /* The request's copies: GroupRanks.ranks is int32_t, and protobuf-c wants them mutable. */
    Pshard__GroupRanks msgs[MAX_GROUPS_PER_CALL];
    Pshard__GroupRanks *msgp[MAX_GROUPS_PER_CALL];
    int32_t *copy = malloc(total * sizeof(int32_t));
    if (!copy)
        return client_fail(c, PSHARD_ERR_NO_MEMORY, "new_groups: out of memory");
    size_t off = 0;
    for (size_t i = 0; i < ngroups; i++) {
        pshard__group_ranks__init(&msgs[i]);
        msgs[i].n_ranks = sizes[i];
        msgs[i].ranks = copy + off;
        for (size_t k = 0; k < sizes[i]; k++)
            copy[off + k] = ranks[off + k];
        msgp[i] = &msgs[i];
        off += sizes[i];
    }
    Pshard__NewGroupsRequest req = PSHARD__NEW_GROUPS_REQUEST__INIT;
    req.session = c->session;
    req.n_groups = ngroups;
    req.groups = msgp;
    req.timeout_ms = timeout_ms;
    ProtobufCMessage *resp = NULL;
    char err[PSHARD_ERRLEN] = "";
    client_run_alone_begin(c); /* after the gathers and reduce-scatters issued before */
    pshard_status_t rc =
        client_call(c, "NewGroups", &req.base, &pshard__new_groups_response__descriptor, &resp, err,
                    sizeof(err));
    client_run_alone_end(c);
    free(copy);
    if (rc != PSHARD_OK) {
        if (resp)
            protobuf_c_message_free_unpacked(resp, NULL);
        return client_fail(c, rc, "new_groups: %s", err);
    }
    Pshard__NewGroupsResponse *r = (Pshard__NewGroupsResponse *)resp;
    if (r->n_ids != ngroups) {
        rc = client_fail(c, PSHARD_ERR_RPC,
                         "new_groups: the shard server answered %zu group ids for %zu groups",
                         r->n_ids, ngroups);
        goto done;
    }
    for (size_t i = 0; i < ngroups; i++)
        if (r->ids[i] == 0) {
            rc = client_fail(c, PSHARD_ERR_RPC,
                             "new_groups: the shard server answered id 0 (the world) for group "
                             "%zu",
                             i);
            goto done;
        }
    off = 0;
    for (size_t i = 0; i < ngroups; i++) {
        out[i] = group_make(c, r->ids[i], ranks + off, sizes[i]);
        if (!out[i]) {
            for (size_t j = 0; j < i; j++) {
                pshard_group_free(out[j]);
                out[j] = NULL;
            }
            rc = client_fail(c, PSHARD_ERR_NO_MEMORY, "new_groups: out of memory");
            goto done;
        }
        off += sizes[i];
    }
done:
    protobuf_c_message_free_unpacked(resp, NULL);
    return rc;
}

pshard_status_t pshard_new_group(pshard_client_t *c, const int *ranks, size_t n, int64_t timeout_ms,
                                 pshard_group_t **out)
{
    return pshard_new_groups(c, ranks, &n, 1, timeout_ms, out);
}

#define MAX_KEY_BYTES 1024 /* the shard server's bound too (shard_groups.c) */

pshard_status_t pshard_new_group_keyed(pshard_client_t *c, const char *key, const int *ranks,
                                       size_t n, int64_t timeout_ms, pshard_group_t **out)
{
    if (!out)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT, "new_group_keyed: out is NULL");
    *out = NULL;
    if (!key || !key[0])
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "new_group_keyed: the key is %s (a group needs a name its members "
                           "share)",
                           key ? "empty" : "NULL");
    size_t keylen = strlen(key);
    if (keylen > MAX_KEY_BYTES)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "new_group_keyed: the key has %zu bytes; at most %d", keylen,
                           MAX_KEY_BYTES);
    PS_CHECK(check_groups(c, ranks, &n, 1));
    if (timeout_ms < 0)
        return client_fail(c, PSHARD_ERR_INVALID_ARGUMENT,
                           "new_group_keyed: timeout_ms %lld is negative (0: the servers' "
                           "collective timeout)",
                           (long long)timeout_ms);
    /* Membership is the server's to refuse (it names this rank), not checked here. */
    int32_t *copy = malloc(n * sizeof(int32_t));
    if (!copy)
        return client_fail(c, PSHARD_ERR_NO_MEMORY, "new_group_keyed: out of memory");
    for (size_t k = 0; k < n; k++)
        copy[k] = ranks[k];
    Pshard__GroupRanks msg = PSHARD__GROUP_RANKS__INIT;
    Pshard__GroupRanks *msgp = &msg;
    msg.n_ranks = n;
    msg.ranks = copy;
    Pshard__NewGroupsRequest req = PSHARD__NEW_GROUPS_REQUEST__INIT;
    req.session = c->session;
    req.n_groups = 1;
    req.groups = &msgp;
    req.timeout_ms = timeout_ms;
    req.key = (char *)key; /* protobuf-c's fields are not const; packing only reads it */
    ProtobufCMessage *resp = NULL;
    char err[PSHARD_ERRLEN] = "";
    client_run_alone_begin(c); /* after the gathers and reduce-scatters issued before */
    pshard_status_t rc =
        client_call(c, "NewGroups", &req.base, &pshard__new_groups_response__descriptor, &resp, err,
                    sizeof(err));
    client_run_alone_end(c);
    free(copy);
    if (rc != PSHARD_OK) {
        if (resp)
            protobuf_c_message_free_unpacked(resp, NULL);
        return client_fail(c, rc, "new_group_keyed: %s", err);
    }
    Pshard__NewGroupsResponse *r = (Pshard__NewGroupsResponse *)resp;
    if (r->n_ids != 1 || r->ids[0] == 0)
        rc = client_fail(c, PSHARD_ERR_RPC,
                         "new_group_keyed: the shard server answered %zu group ids (%s) for one "
                         "group",
                         r->n_ids, r->n_ids == 1 ? "id 0, the world" : "not one");
    else if (!(*out = group_make(c, r->ids[0], ranks, n)))
        rc = client_fail(c, PSHARD_ERR_NO_MEMORY, "new_group_keyed: out of memory");
    protobuf_c_message_free_unpacked(resp, NULL);
    return rc;
}

int pshard_group_rank(const pshard_group_t *g)
{
    return g ? g->rank : -1;
}

int pshard_group_size(const pshard_group_t *g)
{
    return g ? g->size : 0;
}

int pshard_group_global_rank(const pshard_group_t *g, int k)
{
    if (!g || k < 0 || k >= g->size)
        return -1;
    return g->ranks[k];
}

void pshard_group_free(pshard_group_t *g)
{
    free(g);
}
