/* pshard status codes: one enum for every component, and its names and messages (the mapping
 * to and from gRPC status codes is pshard/rpc.h's). Installed with libpshard. Codes are
 * append-only: never renumber or reuse one. */
#ifndef PSHARD_STATUS_H
#define PSHARD_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

/* The size of every buffer that holds an error message (last errors, the err arguments of
 * pshard's functions): a message is cut to PSHARD_ERRLEN - 1 bytes. */
#define PSHARD_ERRLEN 1024

/* X(name, value, message). Append new codes at the end only. */
#define PSHARD_STATUS_MAP(X)                                                                       \
    X(PSHARD_OK, 0, "success")                                                                     \
    X(PSHARD_ERR_INVALID_ARGUMENT, -1, "invalid argument")                                         \
    X(PSHARD_ERR_NO_MEMORY, -2, "out of memory")                                                   \
    X(PSHARD_ERR_SYSTEM, -3, "system call failed")                                                 \
    X(PSHARD_ERR_TIMEOUT, -4, "timed out")                                                         \
    X(PSHARD_ERR_PEER_LOST, -5, "peer lost")                                                       \
    X(PSHARD_ERR_ABORTED, -6, "aborted")                                                           \
    X(PSHARD_ERR_DESYNC, -7, "ranks ran different collectives")                                    \
    X(PSHARD_ERR_JOINED, -8, "a trainer joined (ran out of input)")                                \
    X(PSHARD_ERR_NOT_FOUND, -9, "not found")                                                       \
    X(PSHARD_ERR_PERMISSION, -10, "permission denied")                                             \
    X(PSHARD_ERR_RPC, -11, "RPC failed")                                                           \
    X(PSHARD_ERR_CUDA, -12, "CUDA error")                                                          \
    X(PSHARD_ERR_NCCL, -13, "NCCL error")                                                          \
    X(PSHARD_ERR_INTERNAL, -14, "internal error")                                                  \
    X(PSHARD_ERR_UNAVAILABLE, -15, "service unavailable")                                          \
    X(PSHARD_ERR_ALREADY_EXISTS, -16, "already exists")                                            \
    X(PSHARD_ERR_FAILED_PRECONDITION, -17, "failed precondition")                                  \
    X(PSHARD_ERR_RESOURCE_EXHAUSTED, -18, "resource exhausted")                                    \
    X(PSHARD_ERR_UNAUTHENTICATED, -19, "unauthenticated")                                          \
    X(PSHARD_ERR_UNIMPLEMENTED, -20, "not implemented")                                            \
    X(PSHARD_ERR_CANCELLED, -21, "cancelled")                                                      \
    X(PSHARD_ERR_DIVERTED, -22, "the ranks' divertible operations differed; none ran")             \
    X(PSHARD_ERR_STEP_ABORTED, -23, "a trainer was lost: the step was aborted on every rank")

typedef enum {
#define PSHARD_STATUS_ENUM_(name, value, msg) name = value,
    PSHARD_STATUS_MAP(PSHARD_STATUS_ENUM_)
#undef PSHARD_STATUS_ENUM_
} pshard_status_t;

/* The lowest (newest) code: a status read from another process is one of
 * PSHARD_ERR_LOWEST..-1. */
#define PSHARD_ERR_LOWEST PSHARD_ERR_STEP_ABORTED

/* Returns the enum name of a status ("PSHARD_ERR_TIMEOUT"), or "PSHARD_ERR_UNKNOWN" for a value
 * outside the enum. The string is static. Thread-safe. */
const char *pshard_status_name(pshard_status_t status);

/* Returns a short human-readable message for a status. The string is static. Thread-safe. */
const char *pshard_status_str(pshard_status_t status);

#ifdef __cplusplus
}
#endif
#endif
