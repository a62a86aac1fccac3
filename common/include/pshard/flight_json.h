/* The flight recorder as JSON, in one shape for every writer: a record (the Status RPC's
 * FlightRecord, as `pshardctl status --json` shows it) and a trace file,
 * DIR/pshard-trace-rank-R.json, that a shard server writes on a collective timeout or abort
 * (--trace-dir) and `pshardctl trace dump` writes from the servers' Status, for `pshardctl
 * trace analyze` to read (torch's TORCH_NCCL_DUMP_ON_TIMEOUT).
 *
 * Thread safety: every function is reentrant. */
#ifndef PSHARD_FLIGHT_JSON_H
#define PSHARD_FLIGHT_JSON_H

#include <stddef.h>

#include <jansson.h>

#include "pshard/shard.pb-c.h"
#include "pshard/status.h"

/* A trace file's name: printf format taking the rank, its prefix and suffix (for readers). */
#define PS_TRACE_FILE_FMT "pshard-trace-rank-%d.json"
#define PS_TRACE_FILE_PREFIX "pshard-trace-rank-"
#define PS_TRACE_FILE_SUFFIX ".json"
/* The largest trace file written or read: a server writes at most 32 records of bounded
 * strings (some 30 KiB); a reader refuses anything larger than this as not a trace. */
#define PS_TRACE_MAX_BYTES (1 << 20)
/* The "format" member of a trace file, and its version. */
#define PS_TRACE_FORMAT "pshard-trace"
#define PS_TRACE_VERSION 1

/* A JSON string of s's len bytes (s NULL: ""); bytes that are not UTF-8 show as U+FFFD, since
 * JSON holds text only. NULL only without memory. Free with json_decref. */
json_t *ps_json_strn(const char *s, size_t len);
/* As ps_json_strn for a NUL-terminated s. */
json_t *ps_json_str(const char *s);

/* One flight record as JSON: rank, op, seq, state, stuck, waiting_on, seconds, label, dtype,
 * count, error, tag, start_time and end_time (seconds since the epoch; 0: not yet). NULL
 * without memory. Free with json_decref. */
json_t *ps_flight_record_json(const Pshard__FlightRecord *f);

/* A trace file's object: format, version, rank, world_size, name, job (NULL: "default"),
 * generation, step, time (now, seconds since the epoch), reason, backend, transport and
 * flight_records (st's records, oldest first), from a shard server's Status st (borrowed).
 * NULL without memory. Free with json_decref. */
json_t *ps_trace_json(const Pshard__ShardStatusResponse *st, const char *job, const char *reason);

/* Writes ps_trace_json(st, job, reason) to dir/pshard-trace-rank-R.json (R = st->rank),
 * atomically (pshard/atomic_file.h: a reader sees the old file or the whole new one), creating
 * dir (not its parents) when it is missing. path (may be NULL) receives the file's path.
 * Errors: INVALID_ARGUMENT (no rank, a name too long), SYSTEM (naming the path), NO_MEMORY;
 * a file larger than PS_TRACE_MAX_BYTES is refused (INTERNAL), never written. */
pshard_status_t ps_trace_write(const char *dir, const Pshard__ShardStatusResponse *st,
                               const char *job, const char *reason, char *path, size_t pathlen,
                               char *err, size_t errlen);

#endif
