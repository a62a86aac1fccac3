/* Coordinator membership state machine: a dynamic array of live members with an open-addressing
 * index by member id, leases, the min:max rendezvous with a last call, rank slots that
 * remember which name held them so a restarted shard server gets its rank back, and the Join
 * table of ranks whose trainers ran out of input. */
#include "coord_state.h"

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/util.h"

#define NS_PER_MS INT64_C(1000000)
#define REASON_MAX 384

/* One rank of a formed cluster. The slot remembers the name of the shard server that held it
 * last, so that the same name gets the same rank back after a restart or an eviction. */
typedef struct {
    char name[COORD_NAME_MAX + 1];
    bool held; /* a live shard server has this rank */
    /* The generation at which its holder took it: one that held it through the cluster's last
     * degradation (held_since <= degraded_at) kept its state, a later one has none. */
    uint64_t held_since;
} rank_slot_t;

struct coord_state {
    coord_state_config_t cfg;
    coord_change_fn on_change;
    void *on_change_arg;
    uint64_t generation;
    coord_cluster_state_t state;

    coord_member_t *members; /* live members, unordered (removal swaps the last one in) */
    size_t nmembers, members_cap;

    /* Index by member id: linear probing, slot value is member index + 1, 0 = empty. The
     * capacity is a power of two kept at least twice nmembers so probes stay short. */
    uint32_t *id_index;
    size_t id_index_cap;

    int64_t last_call_deadline_ns; /* forms at this time while FORMING; -1 when not running */

    int world_size;             /* 0 until formed, then fixed */
    uint64_t formed_generation; /* generation of the last (re)forming; 0 before */
    rank_slot_t *slots;         /* world_size entries once formed */
    int held_slots;             /* slots with held == true */
    uint64_t degraded_at;       /* the generation of the last FORMED -> DEGRADED */

    /* Join table: world_size entries once formed, indexed by rank; rank -1 marks a rank that
     * has not joined. Reset (with last_joiner) whenever the cluster (re)forms. */
    coord_join_t *joins;
    int njoined;
    int last_joiner; /* last rank of the most recent completed join, or -1 */

    /* Member ids are 8 fresh random bytes followed by (counter XOR id_secret): unpredictable,
     * and never repeated within one coordinator's life because the second half is a
     * bijection of a counter. */
    uint64_t id_counter;
    uint64_t id_secret;
};

/* ---- small helpers ---------------------------------------------------------------------- */

const char *coord_role_name(coord_role_t role)
{
    switch (role) {
    case COORD_ROLE_SHARD_SERVER:
        return "shard_server";
    case COORD_ROLE_TRAINER:
        return "trainer";
    case COORD_ROLE_UNSPECIFIED:
        break;
    }
    return "unspecified";
}

const char *coord_join_phase_name(int phase)
{
    switch (phase) {
    case COORD_JOIN_PHASE_JOINED:
        return "joined";
    case COORD_JOIN_PHASE_ALL_JOINED:
        return "all_joined";
    default:
        return "unspecified";
    }
}

const char *coord_cluster_state_name(coord_cluster_state_t state)
{
    switch (state) {
    case COORD_CLUSTER_FORMING:
        return "forming";
    case COORD_CLUSTER_FORMED:
        return "formed";
    case COORD_CLUSTER_DEGRADED:
        return "degraded";
    }
    return "unknown";
}

/* now + ms, saturating at INT64_MAX instead of overflowing. */
static int64_t add_ms_saturating(int64_t now_ns, int64_t ms)
{
    if (ms > (INT64_MAX - (now_ns > 0 ? now_ns : 0)) / NS_PER_MS)
        return INT64_MAX;
    return now_ns + ms * NS_PER_MS;
}

/* Fills buf with n bytes from the kernel's CSPRNG: getrandom(2), else /dev/urandom. */
static int random_bytes(void *buf, size_t n)
{
    unsigned char *p = buf;
    size_t got = 0;
    while (got < n) {
        ssize_t r = getrandom(p + got, n - got, 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        got += (size_t)r;
    }
    if (got == n)
        return 0;
    int fd;
    SYS_CHECK(open("/dev/urandom", O_RDONLY | O_CLOEXEC), fd);
    if (fd < 0)
        return -1;
    while (got < n) {
        ssize_t r;
        SYS_CHECK(read(fd, p + got, n - got), r);
        if (r <= 0) {
            close(fd);
            return -1;
        }
        got += (size_t)r;
    }
    close(fd);
    return 0;
}

static void hex_encode(const unsigned char *bytes, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[bytes[i] >> 4];
        out[2 * i + 1] = digits[bytes[i] & 0xf];
    }
    out[2 * n] = '\0';
}

/* True when id is exactly COORD_ID_LEN lowercase hex characters. */
static bool id_is_well_formed(const char *id)
{
    for (size_t i = 0; i < COORD_ID_LEN; i++) {
        char c = id[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
            return false;
    }
    return id[COORD_ID_LEN] == '\0';
}

/* Hash of a well-formed id: its first 16 hex digits are random, so they are the hash. */
static uint64_t id_hash(const char *id)
{
    uint64_t h = 0;
    for (int i = 0; i < 16; i++) {
        char c = id[i];
        h = (h << 4) | (uint64_t)(c <= '9' ? c - '0' : c - 'a' + 10);
    }
    return h;
}

/* Checks a member id supplied by a caller. */
static pshard_status_t check_member_id(const char *member_id, char *err, size_t errlen)
{
    if (!member_id || !member_id[0])
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "member id is empty");
    size_t len = strnlen(member_id, COORD_ID_LEN + 1);
    if (len != COORD_ID_LEN || !id_is_well_formed(member_id))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "member id must be %d lowercase hex characters (got %zu bytes%s)",
                       COORD_ID_LEN, strlen(member_id),
                       len == COORD_ID_LEN ? " that are not all lowercase hex" : "");
    return PSHARD_OK;
}

/* ---- id index --------------------------------------------------------------------------- */

/* Returns the index-table slot holding id, or the empty slot where it would go. */
static size_t index_probe(const coord_state_t *st, const char *id)
{
    size_t mask = st->id_index_cap - 1;
    size_t pos = (size_t)id_hash(id) & mask;
    for (;;) {
        uint32_t v = st->id_index[pos];
        if (v == 0 || memcmp(st->members[v - 1].member_id, id, COORD_ID_LEN) == 0)
            return pos;
        pos = (pos + 1) & mask;
    }
}

/* Returns the member index for id, or -1. */
static long find_by_id(const coord_state_t *st, const char *id)
{
    if (st->id_index_cap == 0)
        return -1;
    uint32_t v = st->id_index[index_probe(st, id)];
    return v ? (long)v - 1 : -1;
}

static pshard_status_t index_rebuild(coord_state_t *st, size_t cap)
{
    uint32_t *table = calloc(cap, sizeof(*table));
    if (!table)
        return PSHARD_ERR_NO_MEMORY;
    free(st->id_index);
    st->id_index = table;
    st->id_index_cap = cap;
    for (size_t i = 0; i < st->nmembers; i++)
        st->id_index[index_probe(st, st->members[i].member_id)] = (uint32_t)(i + 1);
    return PSHARD_OK;
}

/* Removes the entry for id (backward-shift deletion keeps probe chains intact). */
static void index_remove(coord_state_t *st, const char *id)
{
    size_t mask = st->id_index_cap - 1;
    size_t hole = index_probe(st, id);
    if (st->id_index[hole] == 0)
        return;
    st->id_index[hole] = 0;
    size_t pos = (hole + 1) & mask;
    while (st->id_index[pos] != 0) {
        size_t home = (size_t)id_hash(st->members[st->id_index[pos] - 1].member_id) & mask;
        /* Move the entry into the hole unless its home lies cyclically in (hole, pos]. */
        bool stays = hole <= pos ? (home > hole && home <= pos) : (home > hole || home <= pos);
        if (!stays) {
            st->id_index[hole] = st->id_index[pos];
            st->id_index[pos] = 0;
            hole = pos;
        }
        pos = (pos + 1) & mask;
    }
}

/* Makes room for one more member in the array and the index. */
static pshard_status_t reserve_member(coord_state_t *st)
{
    if (st->nmembers == st->members_cap) {
        size_t cap = st->members_cap ? st->members_cap * 2 : 16;
        coord_member_t *m = realloc(st->members, cap * sizeof(*m));
        if (!m)
            return PSHARD_ERR_NO_MEMORY;
        st->members = m;
        st->members_cap = cap;
    }
    if ((st->nmembers + 1) * 2 > st->id_index_cap) {
        size_t cap = st->id_index_cap ? st->id_index_cap * 2 : 64;
        PS_CHECK(index_rebuild(st, cap));
    }
    return PSHARD_OK;
}

/* Removes member i from the array and the index; the last member moves into its place. */
static void remove_member_at(coord_state_t *st, size_t i)
{
    index_remove(st, st->members[i].member_id);
    size_t last = st->nmembers - 1;
    if (i != last) {
        index_remove(st, st->members[last].member_id);
        st->members[i] = st->members[last];
        st->id_index[index_probe(st, st->members[i].member_id)] = (uint32_t)(i + 1);
    }
    st->nmembers--;
}

static long find_by_name(const coord_state_t *st, coord_role_t role, const char *name)
{
    for (size_t i = 0; i < st->nmembers; i++)
        if (st->members[i].role == role && strcmp(st->members[i].name, name) == 0)
            return (long)i;
    return -1;
}

static int count_shard_servers(const coord_state_t *st)
{
    int n = 0;
    for (size_t i = 0; i < st->nmembers; i++)
        if (st->members[i].role == COORD_ROLE_SHARD_SERVER)
            n++;
    return n;
}

/* ---- generation and rendezvous ---------------------------------------------------------- */

/* Empties the join table and forgets the last joiner: called when the cluster (re)forms,
 * because every rank restarts its training then and old joins would describe another run. */
static void joins_reset(coord_state_t *st)
{
    if (st->njoined > 0 || st->last_joiner >= 0)
        PS_INFO(PS_SUB_COORD,
                "join table reset (%d rank%s joined, last joiner %d): the cluster formed again",
                st->njoined, st->njoined == 1 ? "" : "s", st->last_joiner);
    for (int r = 0; r < st->world_size && st->joins; r++)
        st->joins[r].rank = -1;
    st->njoined = 0;
    st->last_joiner = -1;
}

static void bump(coord_state_t *st, const char *reason)
{
    st->generation++;
    PS_INFO(PS_SUB_COORD, "generation %llu: %s", (unsigned long long)st->generation, reason);
    if (st->on_change)
        st->on_change(st->on_change_arg, st->generation, reason);
}

static void bumpf(coord_state_t *st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bumpf(coord_state_t *st, const char *fmt, ...)
{
    char reason[REASON_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof(reason), fmt, ap);
    va_end(ap);
    bump(st, reason);
}

/* Orders members for display and rank assignment: natural order of names. */
static int cmp_member_name(const void *a, const void *b)
{
    const coord_member_t *ma = *(const coord_member_t *const *)a;
    const coord_member_t *mb = *(const coord_member_t *const *)b;
    return ps_natural_cmp(ma->name, mb->name);
}

/* Forms the cluster: ranks 0..k-1 go to the first k = min(count, max_nodes) live shard servers
 * in natural name order, the rest stay standby. Returns PSHARD_ERR_NO_MEMORY and changes
 * nothing when the slot table cannot be allocated (tick retries later). */
static pshard_status_t form_cluster(coord_state_t *st)
{
    int n = count_shard_servers(st);
    coord_member_t **order = malloc((size_t)(n ? n : 1) * sizeof(*order));
    int k = n < st->cfg.max_nodes ? n : st->cfg.max_nodes;
    rank_slot_t *slots = calloc((size_t)(k ? k : 1), sizeof(*slots));
    coord_join_t *joins = calloc((size_t)(k ? k : 1), sizeof(*joins));
    if (!order || !slots || !joins) {
        free(order);
        free(slots);
        free(joins);
        PS_ERROR(PS_SUB_COORD, "out of memory forming the cluster; will retry");
        return PSHARD_ERR_NO_MEMORY;
    }
    int j = 0;
    for (size_t i = 0; i < st->nmembers; i++)
        if (st->members[i].role == COORD_ROLE_SHARD_SERVER)
            order[j++] = &st->members[i];
    qsort(order, (size_t)n, sizeof(*order), cmp_member_name);
    for (int r = 0; r < n; r++) {
        if (r < k) {
            order[r]->rank = r;
            ps_strlcpy(slots[r].name, order[r]->name, sizeof(slots[r].name));
            slots[r].held = true;
            slots[r].held_since = st->generation;
        } else {
            order[r]->rank = -1;
        }
    }
    free(order);
    free(st->slots); /* forming happens once, but never leak if that changes */
    free(st->joins);
    st->slots = slots;
    st->joins = joins;
    st->world_size = k;
    st->held_slots = k;
    joins_reset(st);
    st->state = COORD_CLUSTER_FORMED;
    st->last_call_deadline_ns = -1;
    bumpf(st, "cluster formed with %d shard server%s", k, k == 1 ? "" : "s");
    st->formed_generation = st->generation;
    return PSHARD_OK;
}

/* Re-evaluates the rendezvous after a membership change while FORMING. Returns the number
 * of generation bumps it caused. */
static int rendezvous_update(coord_state_t *st, int64_t now_ns)
{
    if (st->state != COORD_CLUSTER_FORMING)
        return 0;
    int n = count_shard_servers(st);
    if (n >= st->cfg.max_nodes)
        return form_cluster(st) == PSHARD_OK;
    if (n >= st->cfg.min_nodes) {
        if (st->cfg.last_call_ms == 0)
            return form_cluster(st) == PSHARD_OK;
        if (st->last_call_deadline_ns < 0) {
            st->last_call_deadline_ns = add_ms_saturating(now_ns, st->cfg.last_call_ms);
            PS_INFO(PS_SUB_COORD, "%d of min %d shard servers registered; last call for %lld ms", n,
                    st->cfg.min_nodes, (long long)st->cfg.last_call_ms);
        }
        return 0;
    }
    if (st->last_call_deadline_ns >= 0) {
        PS_INFO(PS_SUB_COORD, "shard servers dropped to %d below min %d; last call cancelled", n,
                st->cfg.min_nodes);
        st->last_call_deadline_ns = -1;
    }
    return 0;
}

/* Handles a ranked shard server going away from a formed cluster: its slot becomes vacant
 * (the name is kept) and the cluster is DEGRADED. Returns the number of bumps. */
static int vacate_rank(coord_state_t *st, int rank, const char *name)
{
    if (rank < 0 || rank >= st->world_size || !st->slots[rank].held)
        return 0;
    st->slots[rank].held = false;
    st->held_slots--;
    if (st->state == COORD_CLUSTER_FORMED) {
        st->state = COORD_CLUSTER_DEGRADED;
        st->degraded_at = st->generation;
        bumpf(st, "cluster degraded: rank %d (was %s) is vacant", rank, name);
        return 1;
    }
    return 0;
}

/* Removes member i (already known to exist) with the given bump reason; handles rank vacancy
 * and the rendezvous. Returns the number of bumps. */
static int drop_member(coord_state_t *st, size_t i, const char *why, int64_t now_ns)
{
    coord_member_t gone = st->members[i];
    remove_member_at(st, i);
    bumpf(st, "member %s %s", gone.name, why);
    int changes = 1;
    if (gone.role == COORD_ROLE_SHARD_SERVER) {
        changes += vacate_rank(st, gone.rank, gone.name);
        changes += rendezvous_update(st, now_ns);
    }
    return changes;
}

/* The rank a shard server named name gets when it registers after the cluster formed: the
 * slot that remembers its name, else the lowest vacant slot, else -1 (standby). */
static int pick_rank(const coord_state_t *st, const char *name)
{
    for (int r = 0; r < st->world_size; r++)
        if (strcmp(st->slots[r].name, name) == 0)
            return r;
    for (int r = 0; r < st->world_size; r++)
        if (!st->slots[r].held)
            return r;
    return -1;
}

static void fill_view(const coord_state_t *st, const coord_member_t *m, coord_member_view_t *out)
{
    if (!out)
        return;
    memset(out, 0, sizeof(*out));
    memcpy(out->member_id, m->member_id, sizeof(out->member_id));
    out->generation = st->generation;
    out->rank = m->rank;
    out->world_size = st->world_size;
    out->state = st->state;
    out->formed_generation = st->formed_generation;
    out->replaces_lost = m->replaces_lost;
    out->lease_ms = st->cfg.lease_ms;
    out->heartbeat_ms = st->cfg.heartbeat_ms;
}

/* ---- validation ------------------------------------------------------------------------- */

static pshard_status_t check_name(const char *name, char *err, size_t errlen)
{
    if (!name || !name[0])
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "name is empty");
    size_t len = strlen(name);
    if (len > COORD_NAME_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "name is %zu bytes; the limit is %d", len, COORD_NAME_MAX);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)name[i];
        if (c <= 0x20 || c >= 0x7f)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "name contains a non-printable or space byte at offset %zu", i);
    }
    return PSHARD_OK;
}

/* address, node and device: optional (NULL means empty), printable ASCII including space. */
static pshard_status_t check_field(const char *field, const char *value, char *err, size_t errlen)
{
    if (!value)
        return PSHARD_OK;
    size_t len = strlen(value);
    if (len > COORD_FIELD_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s is %zu bytes; the limit is %d",
                       field, len, COORD_FIELD_MAX);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)value[i];
        if (c < 0x20 || c >= 0x7f)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s contains a non-printable byte at offset %zu", field, i);
    }
    return PSHARD_OK;
}

static pshard_status_t unknown_id(const char *member_id, char *err, size_t errlen)
{
    return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND,
                   "unknown member id %s: it was evicted or never registered; register again",
                   member_id);
}

/* Compares two keys in time independent of where they differ; false for a missing key or one
 * of the wrong length. */
static bool key_matches(const char *given, const char *key)
{
    if (!given || strnlen(given, COORD_KEY_LEN + 1) != COORD_KEY_LEN)
        return false;
    unsigned char diff = 0;
    for (size_t i = 0; i < COORD_KEY_LEN; i++)
        diff |= (unsigned char)(given[i] ^ key[i]);
    return diff == 0;
}

/* Finds the member that member_id names and checks that the caller holds its lease key: the
 * id alone is public (Status and Watch show it). Returns the index, or -1 with err set. */
static long find_keyed(const coord_state_t *st, const char *member_id, const char *lease_key,
                       pshard_status_t *rc, char *err, size_t errlen)
{
    *rc = check_member_id(member_id, err, errlen);
    if (*rc != PSHARD_OK)
        return -1;
    long i = find_by_id(st, member_id);
    if (i < 0) {
        *rc = unknown_id(member_id, err, errlen);
        return -1;
    }
    if (!key_matches(lease_key, st->members[i].lease_key)) {
        *rc = ps_errf(err, errlen, PSHARD_ERR_PERMISSION,
                      "%s for member %s (%s): only the member itself may renew, end or report "
                      "for its lease, with the lease_key its Register returned",
                      lease_key && lease_key[0] ? "wrong lease key" : "no lease key", member_id,
                      st->members[i].name);
        return -1;
    }
    return i;
}

/* ---- public API ------------------------------------------------------------------------- */

coord_state_t *coord_state_create(const coord_state_config_t *cfg, int64_t now_ns,
                                  coord_change_fn on_change, void *on_change_arg)
{
    (void)now_ns; /* nothing is time-dependent until the first member registers */
    if (!cfg || cfg->lease_ms <= 0 || cfg->heartbeat_ms <= 0 || cfg->min_nodes < 1 ||
        cfg->min_nodes > cfg->max_nodes || cfg->last_call_ms < 0)
        return NULL;
    coord_state_t *st = calloc(1, sizeof(*st));
    if (!st)
        return NULL;
    st->cfg = *cfg;
    st->on_change = on_change;
    st->on_change_arg = on_change_arg;
    st->generation = 1;
    st->state = COORD_CLUSTER_FORMING;
    st->last_call_deadline_ns = -1;
    st->last_joiner = -1;
    if (random_bytes(&st->id_secret, sizeof(st->id_secret)) != 0) {
        PS_ERROR(PS_SUB_COORD, "cannot read random bytes for member ids");
        free(st);
        return NULL;
    }
    return st;
}

void coord_state_destroy(coord_state_t *st)
{
    if (!st)
        return;
    free(st->members);
    free(st->id_index);
    free(st->slots);
    free(st->joins);
    free(st);
}

pshard_status_t coord_state_register(coord_state_t *st, coord_role_t role, const char *name,
                                     const char *address, const char *node, const char *device,
                                     const char *lease_key, int64_t now_ns,
                                     coord_member_view_t *out, char *err, size_t errlen)
{
    if (role != COORD_ROLE_SHARD_SERVER && role != COORD_ROLE_TRAINER)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "role must be shard_server or trainer (got %d)", (int)role);
    PS_CHECK(check_name(name, err, errlen));
    PS_CHECK(check_field("address", address, err, errlen));
    PS_CHECK(check_field("node", node, err, errlen));
    PS_CHECK(check_field("device", device, err, errlen));

    long old = find_by_name(st, role, name);
    if (old >= 0 && now_ns <= st->members[old].lease_deadline_ns &&
        !key_matches(lease_key, st->members[old].lease_key)) {
        int64_t left = (st->members[old].lease_deadline_ns - now_ns + NS_PER_MS - 1) / NS_PER_MS;
        return ps_errf(err, errlen, PSHARD_ERR_ALREADY_EXISTS,
                       "%s '%s' is held by a live member (%s) whose lease lapses in %lld ms "
                       "unless it renews it; a restarted member registers again once it has "
                       "lapsed%s",
                       coord_role_name(role), name, st->members[old].member_id, (long long)left,
                       lease_key && lease_key[0] ? " (the lease key given is not that member's)"
                                                 : "");
    }
    if (old >= 0 && role == COORD_ROLE_SHARD_SERVER && st->members[old].rank >= 0 &&
        !key_matches(lease_key, st->members[old].lease_key)) {
        /* A ranked server restarted (another incarnation: not its key) after its lease lapsed,
         * before a tick evicted it: it was lost, and says so as an eviction would, so that the
         * others learn of it and the new one takes the vacant rank as a replacement. */
        drop_member(st, (size_t)old, "lease expired", now_ns);
        old = -1;
    }
    if (old < 0 && st->nmembers >= COORD_MAX_MEMBERS)
        return ps_errf(err, errlen, PSHARD_ERR_RESOURCE_EXHAUSTED,
                       "the coordinator already has %d members; the limit is %d", (int)st->nmembers,
                       COORD_MAX_MEMBERS);
    if (reserve_member(st) != PSHARD_OK)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory registering %s", name);

    unsigned char id_bytes[16], key_bytes[COORD_KEY_LEN / 2];
    if (random_bytes(id_bytes, 8) != 0 || random_bytes(key_bytes, sizeof(key_bytes)) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot read random bytes for a member id");
    uint64_t tail = (st->id_counter++) ^ st->id_secret;
    for (int i = 0; i < 8; i++)
        id_bytes[8 + i] = (unsigned char)(tail >> (56 - 8 * i));

    coord_member_t m;
    memset(&m, 0, sizeof(m));
    hex_encode(id_bytes, sizeof(id_bytes), m.member_id);
    hex_encode(key_bytes, sizeof(key_bytes), m.lease_key);
    m.role = role;
    ps_strlcpy(m.name, name, sizeof(m.name));
    ps_strlcpy(m.address, address ? address : "", sizeof(m.address));
    ps_strlcpy(m.node, node ? node : "", sizeof(m.node));
    ps_strlcpy(m.device, device ? device : "", sizeof(m.device));
    m.rank = -1;
    m.registered_ns = now_ns;
    m.last_heartbeat_ns = now_ns;
    m.lease_deadline_ns = add_ms_saturating(now_ns, st->cfg.lease_ms);

    bool formed_once = st->state != COORD_CLUSTER_FORMING;
    bool replaced = old >= 0;
    if (replaced) {
        /* A restarted member: its old incarnation goes away without leaving a vacancy. */
        m.rank = st->members[old].rank;
        remove_member_at(st, (size_t)old);
    }
    bool filled_vacancy = false;
    if (role == COORD_ROLE_SHARD_SERVER && formed_once && m.rank < 0) {
        int r = pick_rank(st, name);
        if (r >= 0 && !st->slots[r].held) {
            m.rank = r;
            ps_strlcpy(st->slots[r].name, name, sizeof(st->slots[r].name));
            st->slots[r].held = true;
            st->slots[r].held_since = st->generation + 1;
            st->held_slots++;
            filled_vacancy = true;
        }
    }
    /* Its state is lost with its predecessor, and some rank kept its own through the loss (so
     * a replica may heal it): not when every server is new, as after a full restart. */
    for (int r = 0; filled_vacancy && r < st->world_size && !m.replaces_lost; r++)
        m.replaces_lost =
            r != m.rank && st->slots[r].held && st->slots[r].held_since <= st->degraded_at;
    m.registered_generation = st->generation + 1;
    st->members[st->nmembers] = m;
    st->id_index[index_probe(st, m.member_id)] = (uint32_t)(st->nmembers + 1);
    st->nmembers++;
    coord_member_t *mine = &st->members[st->nmembers - 1];

    if (role == COORD_ROLE_TRAINER)
        bumpf(st, "member %s registered as trainer%s", name, replaced ? " (replaced)" : "");
    else if (mine->rank >= 0)
        bumpf(st, "member %s registered%s with rank %d", name, replaced ? " (replaced)" : "",
              mine->rank);
    else if (formed_once)
        bumpf(st, "member %s registered%s as standby", name, replaced ? " (replaced)" : "");
    else
        bumpf(st, "member %s registered%s", name, replaced ? " (replaced)" : "");

    if (filled_vacancy && st->state == COORD_CLUSTER_DEGRADED && st->held_slots == st->world_size) {
        st->state = COORD_CLUSTER_FORMED;
        joins_reset(st);
        bumpf(st, "cluster formed again: all %d ranks held (rank %d now %s)", st->world_size,
              mine->rank, name);
        st->formed_generation = st->generation;
    }
    if (role == COORD_ROLE_SHARD_SERVER)
        rendezvous_update(st, now_ns);

    /* Forming may have assigned ranks; look the member up again by id. */
    long idx = find_by_id(st, m.member_id);
    fill_view(st, &st->members[idx], out);
    if (out)
        memcpy(out->lease_key, m.lease_key, sizeof(out->lease_key));
    return PSHARD_OK;
}

pshard_status_t coord_state_heartbeat(coord_state_t *st, const char *member_id,
                                      const char *lease_key, int64_t now_ns,
                                      coord_member_view_t *out, char *err, size_t errlen)
{
    pshard_status_t rc;
    long i = find_keyed(st, member_id, lease_key, &rc, err, errlen);
    if (i < 0)
        return rc;
    coord_member_t *m = &st->members[i];
    m->last_heartbeat_ns = now_ns;
    m->lease_deadline_ns = add_ms_saturating(now_ns, st->cfg.lease_ms);
    fill_view(st, m, out);
    return PSHARD_OK;
}

pshard_status_t coord_state_leave(coord_state_t *st, const char *member_id, const char *lease_key,
                                  int64_t now_ns, char *err, size_t errlen)
{
    pshard_status_t rc;
    long i = find_keyed(st, member_id, lease_key, &rc, err, errlen);
    if (i < 0)
        return rc;
    drop_member(st, (size_t)i, "left", now_ns);
    return PSHARD_OK;
}

pshard_status_t coord_state_declare_lost(coord_state_t *st, const char *name, const char *why,
                                         int64_t now_ns, char *err, size_t errlen)
{
    size_t wl = strlen(why);
    if (wl == 0 || wl > 200)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "lost: %zu bytes; say why in 1 to 200 bytes", wl);
    for (size_t k = 0; k < wl; k++)
        if ((unsigned char)why[k] < 0x20 || (unsigned char)why[k] == 0x7f)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "lost: byte %zu is a control character", k);
    /* A name may be a trainer's and a shard server's both: the trainer is meant first (the
     * launcher declares the one it reaped; pshardrun names them apart). */
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < st->nmembers; i++) {
            coord_role_t want = pass == 0 ? COORD_ROLE_TRAINER : COORD_ROLE_SHARD_SERVER;
            if (strcmp(st->members[i].name, name) != 0 || st->members[i].role != want)
                continue;
            char reason[224];
            snprintf(reason, sizeof(reason), "lost (%s)", why);
            drop_member(st, i, reason, now_ns);
            return PSHARD_OK;
        }
    }
    return ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND,
                   "no member named \"%.64s\" (it left, was evicted, or never registered)", name);
}

/* One member due for eviction: what the sort needs, and its id to find it again afterwards. */
typedef struct {
    int64_t deadline_ns;
    const coord_member_t *member; /* valid only while sorting */
    char member_id[COORD_ID_LEN + 1];
} expiry_t;

/* Evictions happen in deadline order, ties by name, so that reasons come out in a stable
 * order whatever the array order is. */
static int cmp_expiry(const void *a, const void *b)
{
    const expiry_t *ea = a, *eb = b;
    if (ea->deadline_ns != eb->deadline_ns)
        return ea->deadline_ns < eb->deadline_ns ? -1 : 1;
    int c = ps_natural_cmp(ea->member->name, eb->member->name);
    if (c != 0)
        return c;
    return (int)ea->member->role - (int)eb->member->role;
}

/* Evicts every member whose lease lapsed; returns the number of bumps. */
static int evict_expired(coord_state_t *st, int64_t now_ns)
{
    size_t n = 0;
    for (size_t i = 0; i < st->nmembers; i++)
        if (now_ns > st->members[i].lease_deadline_ns)
            n++;
    if (n == 0)
        return 0;
    expiry_t *list = malloc(n * sizeof(*list));
    if (!list) {
        /* Evict one at a time in array order; still correct, only the order differs. */
        int changes = 0;
        for (size_t i = st->nmembers; i-- > 0;)
            if (i < st->nmembers && now_ns > st->members[i].lease_deadline_ns)
                changes += drop_member(st, i, "lease expired", now_ns);
        return changes;
    }
    size_t j = 0;
    for (size_t i = 0; i < st->nmembers; i++) {
        if (now_ns <= st->members[i].lease_deadline_ns)
            continue;
        list[j].deadline_ns = st->members[i].lease_deadline_ns;
        list[j].member = &st->members[i];
        memcpy(list[j].member_id, st->members[i].member_id, sizeof(list[j].member_id));
        j++;
    }
    qsort(list, n, sizeof(*list), cmp_expiry);
    int changes = 0;
    for (size_t k = 0; k < n; k++) {
        /* Removal moves members around, so find each one again by id. */
        long i = find_by_id(st, list[k].member_id);
        if (i >= 0)
            changes += drop_member(st, (size_t)i, "lease expired", now_ns);
    }
    free(list);
    return changes;
}

int coord_state_tick(coord_state_t *st, int64_t now_ns)
{
    int changes = evict_expired(st, now_ns);
    if (st->state == COORD_CLUSTER_FORMING && st->last_call_deadline_ns >= 0 &&
        now_ns >= st->last_call_deadline_ns) {
        if (count_shard_servers(st) >= st->cfg.min_nodes) {
            if (form_cluster(st) == PSHARD_OK)
                changes++;
        } else {
            st->last_call_deadline_ns = -1;
        }
    }
    return changes;
}

int64_t coord_state_next_deadline_ns(const coord_state_t *st)
{
    int64_t next = INT64_MAX;
    if (st->state == COORD_CLUSTER_FORMING && st->last_call_deadline_ns >= 0)
        next = st->last_call_deadline_ns;
    for (size_t i = 0; i < st->nmembers; i++) {
        /* A lease lapses once now passes its deadline, so the first instant that evicts is
         * one nanosecond later. */
        int64_t d = st->members[i].lease_deadline_ns;
        int64_t evict_at = d == INT64_MAX ? INT64_MAX : d + 1;
        if (evict_at < next)
            next = evict_at;
    }
    return next;
}

/* ---- Join ------------------------------------------------------------------------------ */

pshard_status_t coord_state_report_join(coord_state_t *st, const coord_join_report_t *report,
                                        int64_t now_ns, coord_join_change_t *change, char *err,
                                        size_t errlen)
{
    *change = COORD_JOIN_UNCHANGED;
    if (report->phase != COORD_JOIN_PHASE_JOINED && report->phase != COORD_JOIN_PHASE_ALL_JOINED)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "join phase must be JOINED (1) or ALL_JOINED (2), got %d", report->phase);
    if (report->step < 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "join step is %lld; it must be 0 or more", (long long)report->step);
    pshard_status_t rc;
    long i = find_keyed(st, report->member_id, report->lease_key, &rc, err, errlen);
    if (i < 0)
        return rc;
    const coord_member_t *m = &st->members[i];
    if (m->role != COORD_ROLE_SHARD_SERVER)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "member %s (%s) is a trainer; joins are reported by the shard server of "
                       "the trainer's rank",
                       m->member_id, m->name);
    if (m->rank < 0)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "shard server %s (%s) holds no rank (%s); only a ranked shard server "
                       "reports joins",
                       m->member_id, m->name,
                       st->state == COORD_CLUSTER_FORMING ? "the cluster is still forming"
                                                          : "it is a standby");
    if (m->rank != report->rank)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "shard server %s (%s) holds rank %d, but reported a join for rank %d",
                       m->member_id, m->name, m->rank, report->rank);
    /* A ranked member implies a formed cluster, so the table exists and rank < world_size. */
    if (report->phase == COORD_JOIN_PHASE_ALL_JOINED) {
        if (report->last_rank < 0 || report->last_rank >= st->world_size)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "last_rank %d of an ALL_JOINED report is outside 0..%d",
                           report->last_rank, st->world_size - 1);
        if (st->njoined == 0 && st->last_joiner == report->last_rank)
            return PSHARD_OK; /* another rank's report of the same completion */
        PS_INFO(PS_SUB_COORD,
                "all joined: rank %d reports every rank joined (%d in the table), last joiner "
                "rank %d",
                report->rank, st->njoined, report->last_rank);
        for (int r = 0; r < st->world_size; r++)
            st->joins[r].rank = -1;
        st->njoined = 0;
        st->last_joiner = report->last_rank;
        *change = COORD_JOIN_ALL_JOINED;
        return PSHARD_OK;
    }
    coord_join_t *j = &st->joins[m->rank];
    if (j->rank == m->rank && j->step == report->step &&
        j->throw_on_early_termination == report->throw_on_early_termination &&
        strcmp(j->member_id, m->member_id) == 0)
        return PSHARD_OK; /* a retried report */
    if (j->rank < 0)
        st->njoined++;
    j->rank = m->rank;
    memcpy(j->member_id, m->member_id, sizeof(j->member_id));
    j->step = report->step;
    j->joined_ns = now_ns;
    j->throw_on_early_termination = report->throw_on_early_termination;
    PS_INFO(PS_SUB_COORD, "join: rank %d (%s) joined at step %lld%s; %d of %d ranks joined",
            m->rank, m->name, (long long)report->step,
            report->throw_on_early_termination ? " (throw_on_early_termination)" : "", st->njoined,
            st->world_size);
    *change = COORD_JOIN_CHANGED;
    return PSHARD_OK;
}

int coord_state_last_joiner(const coord_state_t *st)
{
    return st->last_joiner;
}

size_t coord_state_member_count(const coord_state_t *st)
{
    return st->nmembers;
}

int coord_state_world_size(const coord_state_t *st)
{
    return st->world_size;
}

uint64_t coord_state_generation(const coord_state_t *st)
{
    return st->generation;
}

/* A ranked shard server of a formed cluster that reports it is not serving. */
static bool rank_not_serving(const coord_member_t *m)
{
    return m->role == COORD_ROLE_SHARD_SERVER && m->rank >= 0 && m->not_serving;
}

coord_cluster_state_t coord_state_cluster_state(const coord_state_t *st)
{
    if (st->state == COORD_CLUSTER_FORMED)
        for (size_t i = 0; i < st->nmembers; i++)
            if (rank_not_serving(&st->members[i]))
                return COORD_CLUSTER_DEGRADED;
    return st->state;
}

bool coord_state_set_health(coord_state_t *st, const char *member_id, const char *reason)
{
    char clean[COORD_FIELD_MAX + 1] = "";
    size_t n = 0;
    for (; reason && reason[n] && n < COORD_FIELD_MAX; n++)
        clean[n] = reason[n] >= 0x20 && reason[n] < 0x7f ? reason[n] : '?';
    clean[n] = '\0';
    long i = find_by_id(st, member_id); /* (hashed: this runs on every heartbeat) */
    if (i < 0)
        return false;
    coord_member_t *m = &st->members[i];
    bool not_serving = n > 0;
    bool changed = m->not_serving != not_serving || strcmp(m->not_serving_reason, clean) != 0;
    m->not_serving = not_serving;
    memcpy(m->not_serving_reason, clean, n + 1);
    return changed;
}

void coord_state_set_steps(coord_state_t *st, const char *member_id, const coord_steps_t *steps)
{
    long i = find_by_id(st, member_id);
    if (i >= 0)
        st->members[i].steps = *steps;
}

const coord_member_t *coord_state_members(const coord_state_t *st, size_t *n)
{
    *n = st->nmembers;
    return st->members;
}

/* Snapshot order: shard servers by rank, unranked shard servers by name, trainers by name. */
static int cmp_snapshot(const void *a, const void *b)
{
    const coord_member_t *ma = a, *mb = b;
    if (ma->role != mb->role)
        return ma->role == COORD_ROLE_SHARD_SERVER ? -1 : 1;
    if (ma->role == COORD_ROLE_SHARD_SERVER) {
        if ((ma->rank >= 0) != (mb->rank >= 0))
            return ma->rank >= 0 ? -1 : 1;
        if (ma->rank >= 0)
            return ma->rank < mb->rank ? -1 : (ma->rank > mb->rank);
    }
    return ps_natural_cmp(ma->name, mb->name);
}

/* Appends item to buf (len bytes, used so far); false (with ", ..." or "..." written) when
 * it does not fit. */
static bool append_item(char *buf, size_t len, size_t *used, const char *item)
{
    size_t n = strlen(item);
    if (*used + n + 5 >= len) {
        ps_strlcpy(buf + *used, *used ? ", ..." : "...", len - *used);
        return false;
    }
    memcpy(buf + *used, item, n + 1);
    *used += n;
    return true;
}

static void describe_awaiting(const coord_state_t *st, int shard_servers, int64_t remaining_ms,
                              char *buf, size_t len)
{
    buf[0] = '\0';
    if (st->state == COORD_CLUSTER_FORMING) {
        if (remaining_ms >= 0) {
            int more = st->cfg.max_nodes - shard_servers;
            ps_snprintf(buf, len, "last call: waiting up to %lld ms for up to %d more shard %s",
                        (long long)remaining_ms, more, more == 1 ? "server" : "servers");
        } else {
            int more = st->cfg.min_nodes - shard_servers;
            if (more < 1)
                more = 1; /* only while a form attempt failed for memory */
            ps_snprintf(buf, len, "%d more shard %s (%d of min %d registered)", more,
                        more == 1 ? "server" : "servers", shard_servers, st->cfg.min_nodes);
        }
        return;
    }
    /* "rank 2 (was pshard-server-2), rank 0 (pshard-server-0) not serving: why"; ends in
     * ", ..." when out of room. */
    size_t used = 0;
    for (int r = 0; st->state == COORD_CLUSTER_DEGRADED && r < st->world_size; r++) {
        if (st->slots[r].held)
            continue;
        char item[COORD_NAME_MAX + 40];
        ps_snprintf(item, sizeof(item), "%srank %d (was %s)", used ? ", " : "", r,
                    st->slots[r].name);
        if (!append_item(buf, len, &used, item))
            return;
    }
    for (size_t i = 0; i < st->nmembers; i++) {
        const coord_member_t *m = &st->members[i];
        if (!rank_not_serving(m))
            continue;
        char item[COORD_NAME_MAX + COORD_FIELD_MAX + 64];
        ps_snprintf(item, sizeof(item), "%srank %d (%s) not serving: %s", used ? ", " : "", m->rank,
                    m->name, m->not_serving_reason);
        if (!append_item(buf, len, &used, item))
            return;
    }
}

coord_snapshot_t *coord_state_snapshot(const coord_state_t *st, int64_t now_ns)
{
    coord_snapshot_t *snap = calloc(1, sizeof(*snap));
    if (!snap)
        return NULL;
    snap->members = malloc((st->nmembers ? st->nmembers : 1) * sizeof(*snap->members));
    if (!snap->members) {
        free(snap);
        return NULL;
    }
    if (st->nmembers)
        memcpy(snap->members, st->members, st->nmembers * sizeof(*snap->members));
    for (size_t i = 0; i < st->nmembers; i++) /* a snapshot is for showing: no secrets */
        memset(snap->members[i].lease_key, 0, sizeof(snap->members[i].lease_key));
    snap->nmembers = st->nmembers;
    qsort(snap->members, snap->nmembers, sizeof(*snap->members), cmp_snapshot);
    snap->generation = st->generation;
    snap->state = coord_state_cluster_state(st);
    snap->world_size = st->world_size;
    snap->formed_generation = st->formed_generation;
    snap->min_nodes = st->cfg.min_nodes;
    snap->max_nodes = st->cfg.max_nodes;
    snap->shard_servers = count_shard_servers(st);
    snap->last_call_remaining_ms = -1;
    if (st->state == COORD_CLUSTER_FORMING && st->last_call_deadline_ns >= 0) {
        int64_t left = st->last_call_deadline_ns - now_ns;
        /* Round up so "0 ms" only shows once the timer really expired. */
        snap->last_call_remaining_ms = left <= 0 ? 0 : (left + NS_PER_MS - 1) / NS_PER_MS;
    }
    describe_awaiting(st, snap->shard_servers, snap->last_call_remaining_ms, snap->awaiting,
                      sizeof(snap->awaiting));
    snap->last_joiner = st->last_joiner;
    if (st->njoined > 0) {
        snap->joins = malloc((size_t)st->njoined * sizeof(*snap->joins));
        if (!snap->joins) {
            coord_snapshot_free(snap);
            return NULL;
        }
        for (int r = 0; r < st->world_size; r++)
            if (st->joins[r].rank >= 0)
                snap->joins[snap->njoins++] = st->joins[r];
    }
    return snap;
}

void coord_snapshot_free(coord_snapshot_t *snap)
{
    if (!snap)
        return;
    free(snap->members);
    free(snap->joins);
    free(snap);
}
