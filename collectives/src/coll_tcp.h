/* The tcp backend's state, shared by its ring set-up (coll_tcp_conn.c) and its engine
 * (coll_tcp.c). Each communicator has one engine thread that owns both sockets; other threads
 * only queue requests and wake it through an eventfd. */
#ifndef PSHARD_COLL_TCP_H
#define PSHARD_COLL_TCP_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "coll_internal.h"
#include "coll_shm.h"
#include "coll_slots.h"

typedef struct tcp {
    pshard_comm_t *comm;
    int n, rank, next, prev;
    int listen_fd, listen_port;
    int send_fd; /* to rank next */
    int recv_fd; /* from rank prev */
    int wake_fd; /* eventfd: new requests, abort, stop */
    uint8_t key[4096];
    size_t keylen;
    const volatile int *cancel; /* set-up gives up when *cancel != 0 */

    pthread_t thread;
    bool thread_started;
    pthread_mutex_t qmu;
    ps_queue_t queue; /* pshard_coll_req_t submitted, not yet taken by the engine */
    bool stop;

    /* Buffers allocated once, pre-touched, reused by every operation. */
    uint8_t *ring; /* reduce-scatter pipeline window (accumulation type), made on first use */
    size_t ring_cap;
    uint8_t *conv; /* half-type input converted to fp32 before it is sent */
    size_t conv_cap;

    /* The same-host transport (coll_shm.h), when set-up chose it; NULL: data goes through
     * the sockets. probe is the secret the other ranks read back to test it. */
    coll_shm_t *shm;
    uint8_t probe[16];
    /* With shm, unless set-up could not share them: the slots small operations run through in
     * the caller's thread (coll_slots.h). */
    coll_slots_t *slots;
} tcp_t;

/* Listens, exchanges addresses, connects to the next rank and accepts the previous one, both
 * links authenticated. Fills send_fd/recv_fd (non-blocking). */
pshard_status_t tcp_connect_ring(tcp_t *t, const pshard_comm_config_t *cfg, char *err,
                                 size_t errlen);

/* After linking: decides, the same on every rank, whether data moves through the sockets or
 * by the same-host transport (mode, and whether every rank can read every other's
 * memory), exchanging each rank's process identity and then its vote around the ring. Sets
 * t->shm when it is the latter, and then t->slots when every rank could share them. Errors: the
 * ring's (PEER_LOST, TIMEOUT), FAILED_PRECONDITION when shm is asked for and cannot be had (naming
 * why), NO_MEMORY. */
pshard_status_t tcp_choose_transport(tcp_t *t, coll_transport_t mode, int64_t deadline, char *err,
                                     size_t errlen);

/* TCP_NODELAY, and PSHARD_SOCKET_BUFFER (bytes) for SO_SNDBUF/SO_RCVBUF when set. */
void tcp_tune_socket(int fd);

#endif
