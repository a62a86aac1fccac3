/* Names and messages of pshard_status_t, and the one mapping to and from gRPC status codes. */
#include "pshard/status.h"
#include "pshard/rpc.h"

#include <grpc/status.h>

const char *pshard_status_name(pshard_status_t status)
{
    switch (status) {
#define PSHARD_STATUS_NAME_(name, value, msg)                                                      \
    case name:                                                                                     \
        return #name;
        PSHARD_STATUS_MAP(PSHARD_STATUS_NAME_)
#undef PSHARD_STATUS_NAME_
    }
    return "PSHARD_ERR_UNKNOWN";
}

const char *pshard_status_str(pshard_status_t status)
{
    switch (status) {
#define PSHARD_STATUS_STR_(name, value, msg)                                                       \
    case name:                                                                                     \
        return msg;
        PSHARD_STATUS_MAP(PSHARD_STATUS_STR_)
#undef PSHARD_STATUS_STR_
    }
    return "unknown status";
}

int ps_status_to_grpc(pshard_status_t status)
{
    switch (status) {
    case PSHARD_OK:
        return GRPC_STATUS_OK;
    case PSHARD_ERR_INVALID_ARGUMENT:
    case PSHARD_ERR_DESYNC:
        return GRPC_STATUS_INVALID_ARGUMENT;
    case PSHARD_ERR_NO_MEMORY:
    case PSHARD_ERR_RESOURCE_EXHAUSTED:
        return GRPC_STATUS_RESOURCE_EXHAUSTED;
    case PSHARD_ERR_TIMEOUT:
        return GRPC_STATUS_DEADLINE_EXCEEDED;
    case PSHARD_ERR_PEER_LOST:
    case PSHARD_ERR_UNAVAILABLE:
    case PSHARD_ERR_RPC:
        return GRPC_STATUS_UNAVAILABLE;
    case PSHARD_ERR_ABORTED:
    case PSHARD_ERR_JOINED:
    case PSHARD_ERR_DIVERTED: /* the shard servers' own; a trainer never sees it */
    case PSHARD_ERR_STEP_ABORTED:
        return GRPC_STATUS_ABORTED;
    case PSHARD_ERR_NOT_FOUND:
        return GRPC_STATUS_NOT_FOUND;
    case PSHARD_ERR_PERMISSION:
        return GRPC_STATUS_PERMISSION_DENIED;
    case PSHARD_ERR_ALREADY_EXISTS:
        return GRPC_STATUS_ALREADY_EXISTS;
    case PSHARD_ERR_FAILED_PRECONDITION:
        return GRPC_STATUS_FAILED_PRECONDITION;
    case PSHARD_ERR_UNAUTHENTICATED:
        return GRPC_STATUS_UNAUTHENTICATED;
    case PSHARD_ERR_UNIMPLEMENTED:
        return GRPC_STATUS_UNIMPLEMENTED;
    case PSHARD_ERR_CANCELLED:
        return GRPC_STATUS_CANCELLED;
    case PSHARD_ERR_SYSTEM:
    case PSHARD_ERR_CUDA:
    case PSHARD_ERR_NCCL:
    case PSHARD_ERR_INTERNAL:
        return GRPC_STATUS_INTERNAL;
    }
    return GRPC_STATUS_UNKNOWN;
}

pshard_status_t ps_status_from_grpc(int grpc_code)
{
    switch (grpc_code) {
    case GRPC_STATUS_OK:
        return PSHARD_OK;
    case GRPC_STATUS_CANCELLED:
        return PSHARD_ERR_CANCELLED;
    case GRPC_STATUS_INVALID_ARGUMENT:
    case GRPC_STATUS_OUT_OF_RANGE:
        return PSHARD_ERR_INVALID_ARGUMENT;
    case GRPC_STATUS_DEADLINE_EXCEEDED:
        return PSHARD_ERR_TIMEOUT;
    case GRPC_STATUS_NOT_FOUND:
        return PSHARD_ERR_NOT_FOUND;
    case GRPC_STATUS_ALREADY_EXISTS:
        return PSHARD_ERR_ALREADY_EXISTS;
    case GRPC_STATUS_PERMISSION_DENIED:
        return PSHARD_ERR_PERMISSION;
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
        return PSHARD_ERR_RESOURCE_EXHAUSTED;
    case GRPC_STATUS_FAILED_PRECONDITION:
        return PSHARD_ERR_FAILED_PRECONDITION;
    case GRPC_STATUS_ABORTED:
        return PSHARD_ERR_ABORTED;
    case GRPC_STATUS_UNIMPLEMENTED:
        return PSHARD_ERR_UNIMPLEMENTED;
    case GRPC_STATUS_UNAVAILABLE:
        return PSHARD_ERR_UNAVAILABLE;
    case GRPC_STATUS_UNAUTHENTICATED:
        return PSHARD_ERR_UNAUTHENTICATED;
    default:
        return PSHARD_ERR_RPC;
    }
}
