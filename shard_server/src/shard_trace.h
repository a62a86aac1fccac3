/* The shard server's flight records as the Status RPC carries them (FlightRecord), and the
 * trace file it writes on a collective timeout or abort when --trace-dir is set
 * (DIR/pshard-trace-rank-R.json, pshard/flight_json.h), as torch's TORCH_NCCL_DUMP_ON_TIMEOUT.
 * Status (shard_service.c) and the dump (shard_member.c) both read the records here. */
#ifndef PSHARD_SHARD_TRACE_H
#define PSHARD_SHARD_TRACE_H

#include "pshard/shard.pb-c.h"
#include "shard_internal.h"

/* Records a Status or a trace carries (the newest). */
#define SHARD_FLIGHT_MAX 32

/* A communicator's newest flight records, both as the one-line sentences of Status's
 * flight_records and as FlightRecord messages (records / n point into this struct). */
typedef struct {
    pshard_coll_record_t recs[SHARD_FLIGHT_MAX];
    Pshard__FlightRecord fr[SHARD_FLIGHT_MAX];
    Pshard__FlightRecord *records[SHARD_FLIGHT_MAX];
    char text[SHARD_FLIGHT_MAX][256];
    char *lines[SHARD_FLIGHT_MAX];
    size_t n;
} shard_flight_t;

/* Fills out from comm's newest records (oldest first); comm must stay alive meanwhile (the
 * caller holds s->mu, under which the setup thread swaps the ring). Thread-safe. */
void shard_flight_read(pshard_comm_t *comm, shard_flight_t *out);

/* The coordinator's store counter a server bumps once it wrote the trace of its failed ring,
 * asking every server of the job for its own (TORCH_NCCL_DUMP_ON_TIMEOUT dumps every rank). */
#define SHARD_TRACE_REQUEST_KEY "pshard/trace/request"

/* With --trace-dir: when comm (NULL: s->comm) has failed (a timeout, an abort, a lost peer, a
 * desync) and its generation's trace is not written yet, writes this rank's trace file with
 * the failure as its reason. From the lease's thread (comm NULL) it then bumps
 * SHARD_TRACE_REQUEST_KEY, and otherwise reads it: a request it has not seen writes this
 * rank's trace (once per ring) even when its own ring has not failed, since the rank that
 * never started an operation does not time out. A write that fails is logged once per
 * server, never raised: the trace must not stop anything. Called from the lease thread after
 * each heartbeat and by the setup thread before it retires a ring, never on the collective
 * path. Takes s->mu. */
void shard_trace_check(pshard_shard_server_t *s, pshard_comm_t *comm);

#endif
