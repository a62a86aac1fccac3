#include "ps_coord_client.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "pshard/coord_client.h"
#include "pshard/util.h"

enum { KEPT = 256 };
static struct {
    char id[64], key[64];
} kept[KEPT];
static size_t nkept;
static pthread_mutex_t kept_mu = PTHREAD_MUTEX_INITIALIZER;

const char *ps_coord_lease_key(const char *member_id)
{
    const char *key = "";
    pthread_mutex_lock(&kept_mu);
    for (size_t i = 0; member_id && i < nkept && i < KEPT; i++)
        if (strcmp(kept[i].id, member_id) == 0)
            key = kept[i].key;
    pthread_mutex_unlock(&kept_mu);
    return key;
}

bool ps_coord_register(ps_rpc_channel_t *ch, Pshard__Role role, const char *name,
                       const char *address, char *id, size_t idlen)
{
    Pshard__RegisterRequest req = PSHARD__REGISTER_REQUEST__INIT;
    req.role = role;
    req.name = (char *)name;
    req.address = (char *)address;
    Pshard__MemberView *v = NULL;
    char err[256] = "";
    if (ps_coord_rpc_register(ch, &req, &v, 5000, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "register %s: %s\n", name, err);
        return false;
    }
    ps_strlcpy(id, v->member_id, idlen);
    pthread_mutex_lock(&kept_mu);
    size_t at = nkept++ % KEPT;
    ps_strlcpy(kept[at].id, v->member_id, sizeof(kept[at].id));
    ps_strlcpy(kept[at].key, v->lease_key ? v->lease_key : "", sizeof(kept[at].key));
    pthread_mutex_unlock(&kept_mu);
    protobuf_c_message_free_unpacked(&v->base, NULL);
    return true;
}

Pshard__StatusResponse *ps_coord_status(ps_rpc_channel_t *ch)
{
    Pshard__StatusRequest req = PSHARD__STATUS_REQUEST__INIT;
    Pshard__StatusResponse *st = NULL;
    char err[256] = "";
    if (ps_coord_rpc_status(ch, &req, &st, 5000, err, sizeof(err)) != PSHARD_OK)
        fprintf(stderr, "status: %s\n", err);
    return st;
}
