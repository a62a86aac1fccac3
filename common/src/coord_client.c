/* The coordinator's client (see pshard/coord_client.h). */
#include "pshard/coord_client.h"

#include <stdlib.h>
#include <string.h>

#include "pshard/util.h"

#define PS_COORD_DEFINE_(fn, Method, Req, Resp, resp, flags)                                       \
    pshard_status_t ps_coord_rpc_##fn(ps_rpc_channel_t *ch, const Pshard__##Req *request,          \
                                      Pshard__##Resp **response, int64_t timeout_ms, char *err,    \
                                      size_t errlen)                                               \
    {                                                                                              \
        ProtobufCMessage *out = NULL;                                                              \
        pshard_status_t rc = ps_rpc_unary(ch, "/pshard.Coordinator/" #Method, &request->base,      \
                                          &pshard__##resp##__descriptor, &out, timeout_ms, flags,  \
                                          NULL, err, errlen);                                      \
        if (response)                                                                              \
            *response = rc == PSHARD_OK ? (Pshard__##Resp *)out : NULL;                            \
        if (out && (rc != PSHARD_OK || !response))                                                 \
            protobuf_c_message_free_unpacked(out, NULL);                                           \
        return rc;                                                                                 \
    }
PS_COORD_UNARY(PS_COORD_DEFINE_)
#undef PS_COORD_DEFINE_

ps_rpc_stream_t *ps_coord_watch_open(ps_rpc_channel_t *ch, const Pshard__WatchRequest *request,
                                     int64_t timeout_ms, char *err, size_t errlen)
{
    return ps_rpc_stream_open(ch, "/pshard.Coordinator/Watch", &request->base, timeout_ms, err,
                              errlen);
}

pshard_status_t ps_coord_store_put(ps_rpc_channel_t *ch, const char *key, const void *value,
                                   size_t len, int64_t timeout_ms, char *err, size_t errlen)
{
    Pshard__StoreSetRequest req = PSHARD__STORE_SET_REQUEST__INIT;
    req.key = (char *)key;
    req.value.data = (uint8_t *)value;
    req.value.len = len;
    return ps_coord_rpc_store_set(ch, &req, NULL, timeout_ms, err, errlen);
}

pshard_status_t ps_coord_store_fetch(ps_rpc_channel_t *ch, const char *key, char **value,
                                     size_t *len, int64_t timeout_ms, char *err, size_t errlen)
{
    *value = NULL;
    *len = 0;
    Pshard__StoreGetRequest req = PSHARD__STORE_GET_REQUEST__INIT;
    req.key = (char *)key;
    Pshard__StoreGetResponse *resp = NULL;
    pshard_status_t rc = ps_coord_rpc_store_get(ch, &req, &resp, timeout_ms, err, errlen);
    if (rc != PSHARD_OK)
        return rc;
    char *copy = malloc(resp->value.len + 1);
    if (!copy) {
        protobuf_c_message_free_unpacked(&resp->base, NULL);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory for store key %s", key);
    }
    if (resp->value.len)
        memcpy(copy, resp->value.data, resp->value.len);
    copy[resp->value.len] = '\0';
    *value = copy;
    *len = resp->value.len;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return PSHARD_OK;
}

pshard_status_t ps_coord_store_incr(ps_rpc_channel_t *ch, const char *key, int64_t delta,
                                    int64_t *result, int64_t timeout_ms, char *err, size_t errlen)
{
    Pshard__StoreAddRequest req = PSHARD__STORE_ADD_REQUEST__INIT;
    req.key = (char *)key;
    req.delta = delta;
    Pshard__StoreAddResponse *resp = NULL;
    pshard_status_t rc = ps_coord_rpc_store_add(ch, &req, &resp, timeout_ms, err, errlen);
    if (rc == PSHARD_OK) {
        if (result)
            *result = resp->value;
        protobuf_c_message_free_unpacked(&resp->base, NULL);
    }
    return rc;
}

pshard_status_t ps_coord_store_remove(ps_rpc_channel_t *ch, const char *key, int64_t timeout_ms,
                                      char *err, size_t errlen)
{
    Pshard__StoreDeleteRequest req = PSHARD__STORE_DELETE_REQUEST__INIT;
    req.key = (char *)key;
    return ps_coord_rpc_store_delete(ch, &req, NULL, timeout_ms, err, errlen);
}

pshard_status_t ps_coord_store_await(ps_rpc_channel_t *ch, const char *const *keys, size_t n,
                                     int64_t wait_ms, Pshard__StoreWaitResponse **values, char *err,
                                     size_t errlen)
{
    Pshard__StoreWaitRequest req = PSHARD__STORE_WAIT_REQUEST__INIT;
    req.keys = (char **)keys;
    req.n_keys = n;
    req.timeout_ms = wait_ms;
    return ps_coord_rpc_store_wait(ch, &req, values, wait_ms + 5000, err, errlen);
}
