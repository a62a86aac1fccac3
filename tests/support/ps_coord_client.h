/* Small coordinator calls the integration tests share: Register a member and fetch Status over
 * a channel the test made. Errors go to stderr. */
#ifndef PS_COORD_CLIENT_H
#define PS_COORD_CLIENT_H

#include <stdbool.h>
#include <stddef.h>

#include "pshard/coordinator.pb-c.h"
#include "pshard/rpc.h"

/* Registers `name` with `role` at `address`; on success copies its member id into id and
 * remembers its lease key for ps_coord_lease_key. */
bool ps_coord_register(ps_rpc_channel_t *ch, Pshard__Role role, const char *name,
                       const char *address, char *id, size_t idlen);

/* The lease key ps_coord_register got for member_id, or "" for an id it never registered
 * (the newest 256 registrations are kept). */
const char *ps_coord_lease_key(const char *member_id);

/* The coordinator's Status (free with protobuf_c_message_free_unpacked), or NULL. */
Pshard__StatusResponse *ps_coord_status(ps_rpc_channel_t *ch);

#endif
