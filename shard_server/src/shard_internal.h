/* Internals of the shard server shared by its membership side (shard_member.c: register,
 * heartbeat, building the communicator) and its trainer-facing service (shard_service.c). */
#ifndef PSHARD_SHARD_INTERNAL_H
#define PSHARD_SHARD_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "pshard/collectives.h"
#include "pshard/rpc.h"
#include "pshard/shard_server.h"
#include "shard_model.h"

#define NMETHODS 9
#define SHM_NAME_MAX 200

typedef struct {
    void *base;
    size_t bytes;
    char name[SHM_NAME_MAX + 2];
} shm_map_t;

struct pshard_shard_server {
    pshard_shard_server_config_t cfg;
    char *strings[16]; /* owned copies of cfg strings */
    ps_rpc_server_t *srv;
    ps_rpc_channel_t *coord;
    char advertise[300];

    pthread_t hb_thread, setup_thread;
    bool hb_started, setup_started;
    atomic_bool stop;
    volatile int stop_flag; /* mirrors stop for the communicator's set-up (pshard_comm_config) */

    pthread_mutex_t mu;
    pthread_cond_t cv;
    char member_id[64];
    int rank, world;
    uint64_t generation, formed_generation, comm_generation;
    int64_t heartbeat_ms;
    bool formed;
    pshard_comm_t *comm; /* set once built; replaced only by the setup thread */
    pshard_status_t fatal;
    char fatal_msg[512];

    /* Trainer state, guarded by op_mu (one operation at a time). */
    pthread_mutex_t op_mu;
    char session[40];
    shm_map_t scratch, model_shm;
    shm_map_t pending_model; /* remote trainers: private model region filled before DefineModel */
    shard_model_t *model;

    ps_rpc_method_t methods[NMETHODS];
    char paths[NMETHODS][64];
};


/* Records the first fatal background error, wakes waiters and logs it. Thread-safe. */
void shard_set_fatal(pshard_shard_server_t *s, pshard_status_t st, const char *msg);

/* Thread bodies (arg is the server): registration and heartbeats; building (and, when the
 * cluster re-forms, rebuilding) the communicator. Both return once s->stop is set. */
void *shard_heartbeat_main(void *arg);
void *shard_setup_main(void *arg);

/* Unmaps a region (shared or private) and clears it; an empty one is a no-op. */
void shard_unmap(shm_map_t *m);

/* True when [offset, offset + len) lies inside m and offset is a multiple of align (0: any). */
bool shard_in_region(const shm_map_t *m, uint64_t offset, uint64_t len, size_t align);

/* True when session names the attached trainer; otherwise fails the call and returns false.
 * Call with op_mu held. */
bool shard_session_ok(pshard_shard_server_t *s, ps_rpc_call_t *call, const char *session);

/* Anonymous memory of bytes for a remote trainer's region (shard_region.c). */
pshard_status_t shard_alloc_private(uint64_t bytes, shm_map_t *out, char *err, size_t errlen);

/* ReadRegion (server streaming) and WriteRegion handlers (shard_region.c). */
void shard_handle_read_region(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx);
void shard_handle_write_region(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx);

#endif
