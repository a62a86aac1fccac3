/* The flight recorder as JSON (pshard/flight_json.h): one record's object, a trace file's object,
 * and writing a trace file atomically. The shard server (dump on timeout or abort) and pshardctl
 * (status --json, trace dump) both build their JSON here, so there is one format. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "pshard/atomic_file.h"
#include "pshard/flight_json.h"
#include "pshard/util.h"

/* Length of the valid UTF-8 sequence at p (n bytes left), or 0: overlong forms, surrogates
 * and code points past U+10FFFF are not valid. */
static size_t utf8_at(const unsigned char *p, size_t n)
{
    if (p[0] < 0x80)
        return 1;
    size_t len = p[0] >= 0xc2 && p[0] <= 0xdf   ? 2
                 : p[0] >= 0xe0 && p[0] <= 0xef ? 3
                 : p[0] >= 0xf0 && p[0] <= 0xf4 ? 4
                                                : 0;
    if (len == 0 || len > n)
        return 0;
    for (size_t i = 1; i < len; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    if ((p[0] == 0xe0 && p[1] < 0xa0) || (p[0] == 0xed && p[1] > 0x9f) ||
        (p[0] == 0xf0 && p[1] < 0x90) || (p[0] == 0xf4 && p[1] > 0x8f))
        return 0;
    return len;
}

json_t *ps_json_strn(const char *s, size_t len)
{
    json_t *v = json_stringn(s ? s : "", s ? len : 0);
    if (v || !s)
        return v;
    /* Not UTF-8: JSON holds text only, so each stray byte shows as U+FFFD. */
    char *clean = malloc(len * 3 + 1);
    if (!clean)
        return NULL;
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        size_t k = utf8_at((const unsigned char *)s + i, len - i);
        if (k == 0) {
            memcpy(clean + o, "\xef\xbf\xbd", 3);
            o += 3;
            i++;
        } else {
            memcpy(clean + o, s + i, k);
            o += k;
            i += k;
        }
    }
    v = json_stringn(clean, o);
    free(clean);
    return v;
}

json_t *ps_json_str(const char *s)
{
    return ps_json_strn(s, s ? strlen(s) : 0);
}

json_t *ps_flight_record_json(const Pshard__FlightRecord *f)
{
    return json_pack("{s:i,s:o,s:I,s:o,s:b,s:i,s:f,s:o,s:o,s:I,s:o,s:I,s:f,s:f}", "rank", f->rank,
                     "op", ps_json_str(f->op), "seq", (json_int_t)f->seq, "state",
                     ps_json_str(f->state), "stuck", f->stuck, "waiting_on", f->waiting_on,
                     "seconds", f->seconds, "label", ps_json_str(f->label), "dtype",
                     ps_json_str(f->dtype), "count", (json_int_t)f->count, "error",
                     ps_json_str(f->error), "tag", (json_int_t)f->tag, "start_time", f->start_time,
                     "end_time", f->end_time);
}

json_t *ps_trace_json(const Pshard__ShardStatusResponse *st, const char *job, const char *reason)
{
    json_t *records = json_array();
    for (size_t k = 0; records && k < st->n_records; k++)
        if (json_array_append_new(records, ps_flight_record_json(st->records[k])) != 0) {
            json_decref(records);
            return NULL;
        }
    return json_pack("{s:s,s:i,s:i,s:i,s:o,s:o,s:I,s:I,s:f,s:o,s:o,s:o,s:o}", "format",
                     PS_TRACE_FORMAT, "version", PS_TRACE_VERSION, "rank", st->rank, "world_size",
                     st->world_size, "name", ps_json_str(st->name), "job",
                     ps_json_str(job && *job ? job : "default"), "generation",
                     (json_int_t)st->generation, "step", (json_int_t)st->step, "time",
                     (double)ps_wall_ms() / 1e3, "reason", ps_json_str(reason), "backend",
                     ps_json_str(st->backend), "transport", ps_json_str(st->transport),
                     "flight_records", records);
}

pshard_status_t ps_trace_write(const char *dir, const Pshard__ShardStatusResponse *st,
                               const char *job, const char *reason, char *path, size_t pathlen,
                               char *err, size_t errlen)
{
    if (st->rank < 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "shard server %s has no rank: no trace file to name", st->name);
    char file[PATH_MAX];
    if (ps_snprintf(file, sizeof(file), "%s/" PS_TRACE_FILE_FMT, dir, st->rank) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "trace directory %s: too long",
                       dir);
    if (path)
        ps_strlcpy(path, file, pathlen);
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return ps_sys_err(err, errlen, "create the trace directory", dir);
    json_t *v = ps_trace_json(st, job, reason);
    char *text = v ? json_dumps(v, JSON_COMPACT) : NULL;
    json_decref(v);
    if (!text)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory writing %s", file);
    size_t len = strlen(text);
    pshard_status_t rc = PSHARD_OK;
    if (len + 1 > PS_TRACE_MAX_BYTES) {
        rc = ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "trace %s would take %zu bytes (at most %d)",
                     file, len + 1, PS_TRACE_MAX_BYTES);
    } else {
        text[len] = '\n'; /* the NUL becomes the file's last newline */
        ps_atomic_file_t f;
        rc = ps_atomic_file_open_path(file, &f, err, errlen);
        if (rc == PSHARD_OK) {
            rc = ps_atomic_file_write(&f, text, len + 1, err, errlen);
            pshard_status_t c = ps_atomic_file_commit(&f, rc == PSHARD_OK, err, errlen);
            if (rc == PSHARD_OK)
                rc = c;
        }
    }
    free(text);
    return rc;
}
