#include "ps_coord_client.h"

#include <stdio.h>

#include "pshard/util.h"

bool ps_coord_register(ps_rpc_channel_t *ch, Pshard__Role role, const char *name,
                       const char *address, char *id, size_t idlen)
{
    Pshard__RegisterRequest req = PSHARD__REGISTER_REQUEST__INIT;
    req.role = role;
    req.name = (char *)name;
    req.address = (char *)address;
    ProtobufCMessage *resp = NULL;
    char err[256] = "";
    if (ps_rpc_unary(ch, "/pshard.Coordinator/Register", &req.base,
                     &pshard__member_view__descriptor, &resp, 5000, 0, NULL, err,
                     sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "register %s: %s\n", name, err);
        return false;
    }
    ps_strlcpy(id, ((Pshard__MemberView *)resp)->member_id, idlen);
    protobuf_c_message_free_unpacked(resp, NULL);
    return true;
}

Pshard__StatusResponse *ps_coord_status(ps_rpc_channel_t *ch)
{
    Pshard__StatusRequest req = PSHARD__STATUS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    char err[256] = "";
    if (ps_rpc_unary(ch, "/pshard.Coordinator/Status", &req.base,
                     &pshard__status_response__descriptor, &resp, 5000, 0, NULL, err,
                     sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "status: %s\n", err);
        return NULL;
    }
    return (Pshard__StatusResponse *)resp;
}
