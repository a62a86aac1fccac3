/* pshardctl trace: dump writes every shard server's flight records (its Status) as trace files,
 * DIR/pshard-trace-rank-R.json, the files a server writes itself on a collective timeout or
 * abort (pshard-server --trace-dir); analyze reads such a directory (untrusted input, bounded
 * memory) and says who never started the newest operation, who ran another descriptor at the
 * same seq, and where each rank stopped. */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/util.h"

#include "ctl.h"

/* analyze's bounds: memory stays under some 30 MiB whatever the directory holds. */
#define TRACE_MAX_FILES 1024
#define TRACE_MAX_RECORDS 64    /* per file; a server writes at most 32 */
#define TRACE_MAX_WORLD 1048576 /* a world_size above this is not a trace */

/* ---- trace dump ---------------------------------------------------------------------------- */

/* trace dump --dir DIR: the coordinator's status names the shard servers; each one's Status
 * becomes its trace file. EXIT_NOT_SERVING when a server could not be asked. */
static int trace_dump(int argc, char **argv)
{
    const char *dir = NULL;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--dir") == 0 && i + 1 < argc)
            dir = argv[++i];
        else if (strncmp(argv[i], "--dir=", 6) == 0)
            dir = argv[i] + 6;
        else
            return ctl_fail("trace dump: unknown %s '%s' (usage: trace dump --dir DIR)",
                            argv[i][0] == '-' ? "option" : "argument", argv[i]);
    }
    if (!dir || !*dir)
        return ctl_fail("trace dump: --dir DIR is required");
    if (ctl_opts.server_timeout_ms <= 0)
        return ctl_fail("trace dump: --server-timeout-ms 0 asks no shard server");
    Pshard__StatusRequest req = PSHARD__STATUS_REQUEST__INIT;
    Pshard__StatusResponse *st = NULL;
    int rc = CTL_CALL(status, &req, &st, ctl_opts.timeout_ms);
    if (rc != EXIT_OK)
        return rc;
    size_t n = 0;
    ctl_server_probe_t *probes = ctl_probe_servers(st, &n);
    if (n == 0)
        printf("no shard servers in job %s: nothing written\n", st->job);
    for (size_t i = 0; i < n; i++) {
        const ctl_server_probe_t *p = &probes[i];
        const Pshard__Member *m = p->member;
        if (p->rc != PSHARD_OK) {
            fprintf(stderr, "pshardctl: trace dump: shard server %s (%s): unreachable: %s (%s)\n",
                    m->name, *m->address ? m->address : "no address", p->err,
                    pshard_status_name(p->rc));
            if (rc == EXIT_OK)
                rc = EXIT_NOT_SERVING;
            continue;
        }
        if (p->resp->rank < 0) {
            printf("shard server %s has no rank (standby): no trace\n", m->name);
            continue;
        }
        char path[4096] = "", err[PSHARD_ERRLEN] = "";
        pshard_status_t w = ps_trace_write(dir, p->resp, st->job, "pshardctl trace dump", path,
                                           sizeof(path), err, sizeof(err));
        if (w != PSHARD_OK) {
            rc = ctl_fail("trace dump: %s (%s)", err, pshard_status_name(w));
            break;
        }
        printf("rank %d (%s): %s, %zu flight records\n", p->resp->rank, m->name, path,
               p->resp->n_records);
    }
    ctl_free_probes(probes, n);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    return rc;
}

/* ---- trace analyze: reading ---------------------------------------------------------------- */

typedef struct {
    char op[32], state[16], label[96], dtype[16], error[200];
    uint64_t seq, count, tag;
    int64_t waiting_on;
    double seconds, start_time, end_time;
} trace_rec_t;

typedef struct {
    char file[300]; /* its name in the directory */
    int64_t rank, world;
    uint64_t generation;
    char name[128], reason[300];
    trace_rec_t *recs; /* oldest first */
    size_t n;
} trace_rank_t;

/* Member key of o, when it has type want (JSON_REAL also takes an integer); NULL when it is
 * missing (with a reason in err if it is required) or of another type (with a reason). */
static json_t *member(const json_t *o, const char *key, json_type want, bool required,
                      const char *where, const char *file, char *err, size_t errlen)
{
    json_t *v = json_object_get(o, key);
    static const char *const names[] = {"an object", "an array",  "a string",  "an integer",
                                        "a number",  "a boolean", "a boolean", "null"};
    if (!v) {
        if (required)
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: %s%s is missing", file, where,
                    key);
        return NULL;
    }
    bool ok = json_typeof(v) == want || (want == JSON_REAL && json_is_integer(v)) ||
              (want == JSON_TRUE && json_is_boolean(v));
    if (!ok) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: %s%s is not %s", file, where, key,
                names[want]);
        return NULL;
    }
    return v;
}

/* Reads integer member key into *out within [lo, hi]; optional ones that are absent keep *out.
 * false with the reason in err. */
static bool int_member(const json_t *o, const char *key, bool required, int64_t lo, int64_t hi,
                       int64_t *out, const char *where, const char *file, char *err, size_t errlen)
{
    json_t *v = member(o, key, JSON_INTEGER, required, where, file, err, errlen);
    if (!v)
        return !*err;
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "%s: %s%s is %" JSON_INTEGER_FORMAT ", not in [%" PRId64 ", %" PRId64 "]", file,
                where, key, x, lo, hi);
        return false;
    }
    *out = x;
    return true;
}

static bool str_member(const json_t *o, const char *key, bool required, char *out, size_t cap,
                       const char *where, const char *file, char *err, size_t errlen)
{
    json_t *v = member(o, key, JSON_STRING, required, where, file, err, errlen);
    if (v)
        ps_copy_printable(out, cap, json_string_value(v), json_string_length(v));
    return !*err;
}

static bool num_member(const json_t *o, const char *key, double *out, const char *where,
                       const char *file, char *err, size_t errlen)
{
    json_t *v = member(o, key, JSON_REAL, false, where, file, err, errlen);
    if (v)
        *out = json_number_value(v);
    return !*err;
}

/* One record of flight_records[i] into r. */
static bool read_record(const json_t *o, size_t i, trace_rec_t *r, const char *file, char *err,
                        size_t errlen)
{
    char where[48];
    ps_snprintf(where, sizeof(where), "flight_records[%zu].", i);
    if (!json_is_object(o))
        return !ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                        "%s: flight_records[%zu] is not "
                        "an object",
                        file, i);
    int64_t seq = 0, count = 0, tag = 0;
    r->waiting_on = -1;
    bool ok = str_member(o, "op", true, r->op, sizeof(r->op), where, file, err, errlen) &&
              int_member(o, "seq", true, 0, INT64_MAX, &seq, where, file, err, errlen) &&
              str_member(o, "state", true, r->state, sizeof(r->state), where, file, err, errlen) &&
              str_member(o, "label", false, r->label, sizeof(r->label), where, file, err, errlen) &&
              str_member(o, "dtype", false, r->dtype, sizeof(r->dtype), where, file, err, errlen) &&
              str_member(o, "error", false, r->error, sizeof(r->error), where, file, err, errlen) &&
              int_member(o, "count", false, 0, INT64_MAX, &count, where, file, err, errlen) &&
              /* a tag is 64 bits; jansson holds it signed */
              int_member(o, "tag", false, INT64_MIN, INT64_MAX, &tag, where, file, err, errlen) &&
              int_member(o, "waiting_on", false, -1, TRACE_MAX_WORLD, &r->waiting_on, where, file,
                         err, errlen) &&
              num_member(o, "seconds", &r->seconds, where, file, err, errlen) &&
              num_member(o, "start_time", &r->start_time, where, file, err, errlen) &&
              num_member(o, "end_time", &r->end_time, where, file, err, errlen);
    r->seq = (uint64_t)seq;
    r->count = (uint64_t)count;
    r->tag = (uint64_t)tag;
    return ok;
}

/* Reads and checks one trace file (name in dirfd) into t. false with the reason, naming the
 * file, in err. */
static bool read_trace(int dirfd, const char *dir, const char *name, trace_rank_t *t, char *err,
                       size_t errlen)
{
    char file[4096 + 300];
    ps_snprintf(file, sizeof(file), "%s/%s", dir, name);
    ps_strlcpy(t->file, name, sizeof(t->file));
    /* No links, and no FIFO to hang on: a trace is a regular file. */
    int fd = openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return !ps_sys_err(err, errlen, "open", file);
    struct stat sb;
    char *buf = NULL;
    json_t *root = NULL;
    bool ok = false;
    if (fstat(fd, &sb) != 0) {
        ps_sys_err(err, errlen, "stat", file);
        goto out;
    }
    if (!S_ISREG(sb.st_mode)) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: not a regular file", file);
        goto out;
    }
    if (sb.st_size > PS_TRACE_MAX_BYTES) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "%s: %lld bytes, larger than a trace can be (%d)", file, (long long)sb.st_size,
                PS_TRACE_MAX_BYTES);
        goto out;
    }
    buf = malloc(PS_TRACE_MAX_BYTES + 1);
    if (!buf) {
        ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "%s: out of memory", file);
        goto out;
    }
    size_t len = 0; /* read to the end, however it changed since fstat, up to the bound */
    for (;;) {
        ssize_t k = read(fd, buf + len, PS_TRACE_MAX_BYTES + 1 - len);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0) {
            ps_sys_err(err, errlen, "read", file);
            goto out;
        }
        if (k == 0)
            break;
        len += (size_t)k;
        if (len > PS_TRACE_MAX_BYTES) {
            ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                    "%s: larger than a trace can be (%d bytes)", file, PS_TRACE_MAX_BYTES);
            goto out;
        }
    }
    json_error_t jerr;
    root = json_loadb(buf, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: not JSON: line %d: %s", file,
                jerr.line, jerr.text);
        goto out;
    }
    if (!json_is_object(root)) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: not a JSON object", file);
        goto out;
    }
    int64_t gen = 0;
    char format[32] = "";
    if (!str_member(root, "format", false, format, sizeof(format), "", file, err, errlen) ||
        !int_member(root, "rank", true, 0, TRACE_MAX_WORLD - 1, &t->rank, "", file, err, errlen) ||
        !int_member(root, "world_size", true, 1, TRACE_MAX_WORLD, &t->world, "", file, err,
                    errlen) ||
        !int_member(root, "generation", false, 0, INT64_MAX, &gen, "", file, err, errlen) ||
        !str_member(root, "name", false, t->name, sizeof(t->name), "", file, err, errlen) ||
        !str_member(root, "reason", false, t->reason, sizeof(t->reason), "", file, err, errlen))
        goto out;
    t->generation = (uint64_t)gen;
    if (*format && strcmp(format, PS_TRACE_FORMAT) != 0) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: format is \"%s\", not \"%s\"", file,
                format, PS_TRACE_FORMAT);
        goto out;
    }
    if (t->rank >= t->world) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "%s: rank %" PRId64 " is not below its world_size %" PRId64, file, t->rank,
                t->world);
        goto out;
    }
    json_t *recs = member(root, "flight_records", JSON_ARRAY, true, "", file, err, errlen);
    if (!recs)
        goto out;
    size_t n = json_array_size(recs);
    if (n > TRACE_MAX_RECORDS) {
        ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                "%s: %zu flight records, more than a trace holds (%d)", file, n, TRACE_MAX_RECORDS);
        goto out;
    }
    t->recs = calloc(n ? n : 1, sizeof(*t->recs));
    if (!t->recs) {
        ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "%s: out of memory", file);
        goto out;
    }
    for (t->n = 0; t->n < n; t->n++)
        if (!read_record(json_array_get(recs, t->n), t->n, &t->recs[t->n], file, err, errlen))
            goto out;
    ok = true;
out:
    json_decref(root);
    free(buf);
    close(fd);
    return ok;
}

/* A trace file's name: "pshard-trace-rank-R.json", R decimal; *rank gets R. */
static bool trace_name(const char *name, int64_t *rank)
{
    size_t pl = strlen(PS_TRACE_FILE_PREFIX), sl = strlen(PS_TRACE_FILE_SUFFIX), n = strlen(name);
    if (n <= pl + sl || strncmp(name, PS_TRACE_FILE_PREFIX, pl) != 0 ||
        strcmp(name + n - sl, PS_TRACE_FILE_SUFFIX) != 0 || n - pl - sl > 12)
        return false;
    char digits[16];
    memcpy(digits, name + pl, n - pl - sl);
    digits[n - pl - sl] = '\0';
    for (const char *p = digits; *p; p++)
        if (*p < '0' || *p > '9')
            return false;
    return ps_parse_i64(digits, 0, INT64_MAX, rank) == 0;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int by_rank(const void *a, const void *b)
{
    const trace_rank_t *x = a, *y = b;
    return (x->rank > y->rank) - (x->rank < y->rank);
}

/* ---- trace analyze: the report ------------------------------------------------------------- */

/* Appends ranks[0..n) to buf as "0,1,3" with runs as "4-9". */
static void rank_list(const int64_t *ranks, size_t n, char *buf, size_t len)
{
    size_t o = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n && o < len; i++) {
        size_t j = i;
        while (j + 1 < n && ranks[j + 1] == ranks[j] + 1)
            j++;
        int w = j > i + 1 ? snprintf(buf + o, len - o, "%s%" PRId64 "-%" PRId64, o ? "," : "",
                                     ranks[i], ranks[j])
                          : snprintf(buf + o, len - o, "%s%" PRId64, o ? "," : "", ranks[i]);
        if (w < 0)
            break;
        o += (size_t)w;
        if (j > i + 1)
            i = j;
    }
}

/* Whether the rank got to run r: running or done, or failed after it started waiting. An
 * operation queued behind a failed one fails at once without running (no start time). */
static bool started(const trace_rec_t *r)
{
    return strcmp(r->state, "running") == 0 || strcmp(r->state, "done") == 0 ||
           (strcmp(r->state, "failed") == 0 && r->start_time > 0);
}

/* The rank's newest operation that it started (NULL: none). */
static const trace_rec_t *newest(const trace_rank_t *t)
{
    const trace_rec_t *best = NULL;
    for (size_t i = 0; i < t->n; i++)
        if (started(&t->recs[i]) && (!best || t->recs[i].seq > best->seq))
            best = &t->recs[i];
    return best;
}

static const trace_rec_t *at_seq(const trace_rank_t *t, uint64_t seq)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->recs[i].seq == seq)
            return &t->recs[i];
    return NULL;
}

/* How long a rank waited in r: running so far, or until it failed; -1: it did not wait. */
static double waited(const trace_rec_t *r)
{
    if (strcmp(r->state, "running") == 0)
        return r->seconds;
    if (strcmp(r->state, "failed") == 0 && r->start_time > 0 && r->end_time >= r->start_time)
        return r->end_time - r->start_time;
    return -1;
}

/* "all_gather seq 418 (step 12, fc3.weight)" */
static void describe_op(const trace_rec_t *r, char *buf, size_t len)
{
    snprintf(buf, len, "%s seq %" PRIu64 "%s%s%s", r->op, r->seq, *r->label ? " (" : "", r->label,
             *r->label ? ")" : "");
}

/* What the ranks compare: op, dtype, element count and tag. */
static bool same_descriptor(const trace_rec_t *a, const trace_rec_t *b)
{
    return strcmp(a->op, b->op) == 0 && strcmp(a->dtype, b->dtype) == 0 && a->count == b->count &&
           a->tag == b->tag;
}

static void describe_descriptor(const trace_rec_t *r, char *buf, size_t len)
{
    snprintf(buf, len, "%s %s count %" PRIu64 " tag 0x%" PRIx64 "%s%s%s", r->op, r->dtype, r->count,
             r->tag, *r->label ? " (" : "", r->label, *r->label ? ")" : "");
}

static void report(const char *dir, const trace_rank_t *t, size_t n)
{
    int64_t world = 0;
    for (size_t i = 0; i < n; i++)
        world = t[i].world > world ? t[i].world : world;
    char list[512];
    printf("trace of %zu shard server%s in %s (world size %" PRId64 ")\n", n, n == 1 ? "" : "s",
           dir, world);
    for (size_t i = 1; i < n; i++)
        if (t[i].world != t[0].world)
            printf("note: %s says world size %" PRId64 ", %s says %" PRId64
                   " (traces of different rings)\n",
                   t[0].file, t[0].world, t[i].file, t[i].world);
    /* Ranks without a file: lists are bounded by the ranks there are files for. */
    int64_t *ranks = calloc(n + 1, sizeof(*ranks));
    if (!ranks)
        return;
    int64_t missing = world - (int64_t)n;
    if (missing > 0) {
        printf("%" PRId64 " rank%s left no trace file:", missing, missing == 1 ? "" : "s");
        int64_t shown = 0, r = 0;
        for (size_t i = 0; i <= n && shown < 64; i++) {
            int64_t upto = i < n ? t[i].rank : world;
            for (; r < upto && shown < 64; r++, shown++)
                printf(" %" PRId64, r);
            r = upto + 1;
        }
        printf("%s\n", missing > shown ? " ..." : "");
    }
    /* The newest operation any rank started, and who never started it (its records of that seq,
     * if any, say it was queued or failed without running). */
    const trace_rec_t *top = NULL;
    for (size_t i = 0; i < n; i++) {
        const trace_rec_t *r = newest(&t[i]);
        if (r && (!top || r->seq > top->seq))
            top = r;
    }
    if (!top) {
        printf("no rank started any operation\n");
    } else {
        size_t nlag = 0, nwait = 0;
        int64_t *waiters = malloc((n + 1) * sizeof(*waiters));
        double longest = 0;
        for (size_t i = 0; waiters && i < n; i++) {
            const trace_rec_t *r = at_seq(&t[i], top->seq);
            const trace_rec_t *last = newest(&t[i]);
            if (!last || last->seq < top->seq) {
                ranks[nlag++] = t[i].rank;
            } else if (r && waited(r) >= 0) {
                waiters[nwait++] = t[i].rank;
                longest = waited(r) > longest ? waited(r) : longest;
            }
        }
        /* Without a rank's trace, the ranks that waited on it in that operation speak for it. */
        bool guessed = false;
        for (size_t i = 0; waiters && nlag == 0 && i < n; i++) {
            const trace_rec_t *r = at_seq(&t[i], top->seq);
            if (!r || waited(r) < 0 || r->waiting_on < 0 || r->waiting_on >= world)
                continue;
            bool has_file = false, listed = false;
            for (size_t j = 0; j < n; j++)
                has_file |= t[j].rank == r->waiting_on;
            for (size_t j = 0; j < nlag; j++)
                listed |= ranks[j] == r->waiting_on;
            if (!has_file && !listed)
                ranks[nlag++] = r->waiting_on;
            guessed = true;
        }
        if (guessed)
            qsort(ranks, nlag, sizeof(*ranks), cmp_i64);
        char what[200];
        describe_op(top, what, sizeof(what));
        if (nlag > 0) {
            rank_list(ranks, nlag, list, sizeof(list));
            printf("rank%s %s never started %s", nlag == 1 ? "" : "s", list, what);
            if (guessed)
                printf(" (%s no trace file; the ranks that waited name %s)",
                       nlag == 1 ? "it left" : "they left", nlag == 1 ? "it" : "them");
            if (nwait > 0) {
                rank_list(waiters, nwait, list, sizeof(list));
                printf("; rank%s %s waited for it %.1f s", nwait == 1 ? "" : "s", list, longest);
            }
            putchar('\n');
        } else {
            printf("every rank with a trace started %s, the newest operation\n", what);
        }
        free(waiters);
    }
    /* Desyncs: the same seq with another descriptor (each seq against its lowest rank). */
    size_t desyncs = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t k = 0; k < t[i].n; k++) {
            const trace_rec_t *a = &t[i].recs[k];
            bool first = true; /* a seq is judged once, at the lowest rank holding it */
            for (size_t j = 0; j < i && first; j++)
                first = at_seq(&t[j], a->seq) == NULL;
            for (size_t j = i + 1; first && j < n; j++) {
                const trace_rec_t *b = at_seq(&t[j], a->seq);
                if (!b || same_descriptor(a, b))
                    continue;
                char da[200], db[200];
                describe_descriptor(a, da, sizeof(da));
                describe_descriptor(b, db, sizeof(db));
                printf("desync at seq %" PRIu64 ": rank %" PRId64 " ran %s, rank %" PRId64
                       " ran %s\n",
                       a->seq, t[i].rank, da, t[j].rank, db);
                desyncs++;
            }
        }
    if (desyncs == 0)
        printf("no two ranks ran different descriptors at the same seq\n");
    /* Where each rank stopped. */
    for (size_t i = 0; i < n; i++) {
        const trace_rec_t *r = newest(&t[i]);
        size_t later = 0; /* issued after it, never run */
        for (size_t k = 0; k < t[i].n; k++)
            later += !started(&t[i].recs[k]) && (!r || t[i].recs[k].seq > r->seq);
        printf("rank %" PRId64 "%s%s%s: ", t[i].rank, *t[i].name ? " (" : "", t[i].name,
               *t[i].name ? ")" : "");
        if (!r) {
            printf("no operation started");
        } else {
            char what[200];
            describe_op(r, what, sizeof(what));
            printf("last %s %s", what, r->state);
            if (waited(r) >= 0)
                printf(" after %.1f s", waited(r));
            if (r->waiting_on >= 0)
                printf(", waiting on rank %" PRId64, r->waiting_on);
            if (*r->error)
                printf(": %s", r->error);
        }
        if (later > 0)
            printf(" (then %zu more issued that never ran)", later);
        /* Why it was written, unless that only repeats the failure just printed. */
        if (*t[i].reason && !(r && *r->error && strstr(t[i].reason, r->error)))
            printf(" [trace: %s]", t[i].reason);
        putchar('\n');
    }
    free(ranks);
}

/* trace analyze DIR. EXIT_OK with the report, EXIT_ERROR for usage or input it cannot read
 * (naming the file). */
static int trace_analyze(int argc, char **argv)
{
    if (argc != 1 || argv[0][0] == '-')
        return ctl_fail("usage: pshardctl trace analyze DIR");
    const char *dir = argv[0];
    int dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = dirfd >= 0 ? fdopendir(dirfd) : NULL;
    if (!d) {
        int e = errno;
        if (dirfd >= 0)
            close(dirfd);
        return ctl_fail("trace analyze: cannot open %s: %s", dir, strerror(e));
    }
    trace_rank_t *t = calloc(TRACE_MAX_FILES, sizeof(*t));
    size_t n = 0;
    int rc = EXIT_OK;
    char err[PSHARD_ERRLEN] = "";
    if (!t) {
        closedir(d);
        return ctl_fail("trace analyze: out of memory");
    }
    for (struct dirent *e; rc == EXIT_OK && (e = readdir(d));) {
        int64_t rank;
        if (!trace_name(e->d_name, &rank))
            continue;
        if (n == TRACE_MAX_FILES) {
            rc = ctl_fail("trace analyze: %s holds more than %d trace files", dir, TRACE_MAX_FILES);
            break;
        }
        if (!read_trace(dirfd, dir, e->d_name, &t[n], err, sizeof(err)))
            rc = ctl_fail("trace analyze: %s", err);
        else if (t[n].rank != rank)
            rc = ctl_fail("trace analyze: %s/%s: says it is rank %" PRId64, dir, e->d_name,
                          t[n].rank);
        n++;
    }
    if (rc == EXIT_OK && n == 0)
        rc = ctl_fail("trace analyze: no " PS_TRACE_FILE_PREFIX "*" PS_TRACE_FILE_SUFFIX " in %s",
                      dir);
    if (rc == EXIT_OK) {
        qsort(t, n, sizeof(*t), by_rank);
        for (size_t i = 1; i < n && rc == EXIT_OK; i++)
            if (t[i].rank == t[i - 1].rank)
                rc = ctl_fail("trace analyze: %s/%s and %s/%s both hold rank %" PRId64, dir,
                              t[i - 1].file, dir, t[i].file, t[i].rank);
    }
    if (rc == EXIT_OK)
        report(dir, t, n);
    for (size_t i = 0; i < n; i++)
        free(t[i].recs);
    free(t);
    closedir(d);
    return rc;
}

int cmd_trace(int argc, char **argv)
{
    if (argc > 0 && strcmp(argv[0], "dump") == 0)
        return trace_dump(argc - 1, argv + 1);
    if (argc > 0 && strcmp(argv[0], "analyze") == 0)
        return trace_analyze(argc - 1, argv + 1);
    return ctl_fail("usage: pshardctl trace dump --dir DIR | trace analyze DIR");
}
