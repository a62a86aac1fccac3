/* Internal pieces of the gRPC runtime shared between the server core, the health service and
 * the reflection service. Not for use outside common/. */
#ifndef PSHARD_RPC_INTERNAL_H
#define PSHARD_RPC_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "pshard/rpc.h"

/* Health service state: per-service status and Watch subscribers. Thread-safe. */
typedef struct ps_health ps_health_t;

ps_health_t *ps_health_create(void);
/* Frees the state; every watcher must have been finished (ps_health_shutdown). */
void ps_health_destroy(ps_health_t *h);
/* Sets a service's status (1 SERVING, 2 NOT_SERVING) and notifies its watchers. */
void ps_health_set(ps_health_t *h, const char *service, int status);
/* Marks every service NOT_SERVING, tells the watchers, and finishes their streams. */
void ps_health_shutdown(ps_health_t *h);
/* The two methods, with the health state as ctx. */
void ps_health_methods(ps_health_t *h, ps_rpc_method_t out[2]);

/* Reflection over an embedded FileDescriptorSet. Immutable after creation: thread-safe. */
typedef struct ps_reflection ps_reflection_t;

/* Parses the descriptor set (borrowed; must outlive the object). NULL with a message on error. */
ps_reflection_t *ps_reflection_create(const uint8_t *set, size_t len, char *err, size_t errlen);
void ps_reflection_destroy(ps_reflection_t *r);
/* Adds a service name to list_services (copied). Before serving only. */
void ps_reflection_add_service(ps_reflection_t *r, const char *name);
/* The v1alpha and v1 methods, with the reflection object as ctx. */
void ps_reflection_methods(ps_reflection_t *r, ps_rpc_method_t out[2]);

extern const unsigned char ps_descriptor_set[];
extern const unsigned long ps_descriptor_set_len;

#endif
