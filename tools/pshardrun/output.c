/* pshardrun's output prefixer: every line a child writes on its stdout or stderr is forwarded
 * to pshardrun's own, whole, in one write, with the child's "[role rank] " in front, and a line
 * longer than RUN_MAX_LINE in pieces of that size. A trainer's stream may instead (torchrun's
 * --redirects) or also (--tee) go to a log file, as written, and may be kept off the console
 * (--local-ranks-filter). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/util.h"

#include "run.h"

/* Writes all of buf to fd, retrying short writes and EINTR. Errors (a closed terminal or
 * pipe) drop the output; children keep running and their pipes keep being drained. */
static void run_write_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return;
        }
        buf += n;
        len -= (size_t)n;
    }
}

/* Appends text[0..n) to out at *at; false when it does not fit with a NUL after it. */
static bool run_prefix_put(char *out, size_t len, size_t *at, const char *text, size_t n)
{
    if (*at + n >= len)
        return false;
    memcpy(out + *at, text, n);
    *at += n;
    out[*at] = '\0';
    return true;
}

int run_format_prefix(const char *tmpl, const char *role, const char *host, long long local_rank,
                      long long rank, char *out, size_t len, char *bad, size_t badlen)
{
    size_t at = 0;
    if (len == 0)
        return -1;
    out[0] = '\0';
    for (const char *p = tmpl; *p;) {
        if (*p != '$') {
            size_t n = strcspn(p, "$");
            if (!run_prefix_put(out, len, &at, p, n))
                return -1;
            p += n;
            continue;
        }
        if (p[1] == '$') {
            if (!run_prefix_put(out, len, &at, "$", 1))
                return -1;
            p += 2;
            continue;
        }
        /* $NAME or ${NAME}, as Python's string.Template spells them. */
        bool braced = p[1] == '{';
        const char *name = p + (braced ? 2 : 1);
        size_t n = 0;
        while (name[n] == '_' || (name[n] >= 'a' && name[n] <= 'z') ||
               (name[n] >= 'A' && name[n] <= 'Z') || (n > 0 && name[n] >= '0' && name[n] <= '9'))
            n++;
        size_t whole = (size_t)(name - p) + n + (braced ? 1 : 0);
        if (n == 0 || (braced && name[n] != '}')) {
            ps_snprintf(bad, badlen, "%.*s", (int)(braced ? strcspn(p, "}") + 1 : 1), p);
            return -2;
        }
        char num[24];
        const char *value = NULL;
        if (n == 9 && strncmp(name, "role_name", n) == 0) {
            value = role;
        } else if (n == 8 && strncmp(name, "hostname", n) == 0) {
            value = host;
        } else if (n == 10 && strncmp(name, "local_rank", n) == 0) {
            ps_snprintf(num, sizeof(num), "%lld", local_rank);
            value = num;
        } else if (n == 4 && strncmp(name, "rank", n) == 0) {
            ps_snprintf(num, sizeof(num), "%lld", rank);
            value = num;
        } else {
            ps_snprintf(bad, badlen, "%.*s", (int)whole, p);
            return -2;
        }
        if (!run_prefix_put(out, len, &at, value, strlen(value)))
            return -1;
        p += whole;
    }
    return 0;
}

/* Forwards one line (without its newline): to the console with the child's prefix, and to the
 * stream's log file without it, each in one write. */
static void run_emit_line(const run_child_t *c, const run_stream_t *s, const char *line, size_t len)
{
    static char out[sizeof(((run_child_t *)0)->prefix) + RUN_MAX_LINE + 1];
    size_t plen = strlen(c->prefix);
    memcpy(out, c->prefix, plen);
    memcpy(out + plen, line, len);
    out[plen + len] = '\n';
    if (s->console)
        run_write_all(s->out_fd, out, plen + len + 1);
    if (s->file_fd >= 0)
        run_write_all(s->file_fd, out + plen, len + 1);
}

/* Forwards every complete line in the stream's buffer; with flush, also what is left (a
 * partial line at EOF). */
static void run_stream_emit(const run_child_t *c, run_stream_t *s, bool flush)
{
    size_t start = 0;
    for (size_t i = 0; i < s->len; i++) {
        if (s->buf[i] == '\n') {
            run_emit_line(c, s, s->buf + start, i - start);
            start = i + 1;
        }
    }
    if (s->len - start == RUN_MAX_LINE || (flush && s->len > start)) {
        run_emit_line(c, s, s->buf + start, s->len - start);
        start = s->len;
    }
    memmove(s->buf, s->buf + start, s->len - start);
    s->len -= start;
}

void run_stream_close(const run_child_t *c, run_stream_t *s)
{
    if (s->fd >= 0) {
        run_stream_emit(c, s, true);
        close(s->fd);
        s->fd = -1;
    }
    if (s->file_fd >= 0)
        close(s->file_fd);
    s->file_fd = -1;
}

/* Reads what the pipe has now (a bounded amount, so one chatty child cannot starve the
 * others) and forwards complete lines; closes the stream at EOF. */
void run_stream_read(const run_child_t *c, run_stream_t *s)
{
    for (int round = 0; round < 16; round++) {
        if (!s->buf) {
            s->buf = malloc(RUN_MAX_LINE);
            if (!s->buf) {
                /* Without a buffer the output cannot be forwarded; stop reading rather than
                 * spin, and the child gets SIGPIPE or EPIPE on its next write. */
                close(s->fd);
                s->fd = -1;
                return;
            }
        }
        ssize_t n = read(s->fd, s->buf + s->len, RUN_MAX_LINE - s->len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return;
            run_stream_close(c, s);
            return;
        }
        if (n == 0) {
            run_stream_close(c, s);
            return;
        }
        s->len += (size_t)n;
        run_stream_emit(c, s, false);
    }
}

/* Forwards what the child's pipes hold now: a failed child's last words (often the reason)
 * come before the line about it. */
void run_child_read_now(run_child_t *c)
{
    for (int k = 0; k < 2; k++) {
        if (c->streams[k].fd >= 0)
            run_stream_read(c, &c->streams[k]);
    }
}

/* mkdir -p of path (its parents too), mode 0755; an existing directory is fine. Returns 0 or
 * -1 with errno set. */
static int run_mkdirs(const char *path)
{
    char buf[PATH_MAX];
    if (ps_strlcpy(buf, path, sizeof(buf)) != 0) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return -1;
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return -1;
    struct stat st;
    if (stat(buf, &st) != 0)
        return -1;
    if (!S_ISDIR(st.st_mode)) {
        errno = ENOTDIR;
        return -1;
    }
    return 0;
}

int run_make_log_dir(run_t *run)
{
    const run_opts_t *o = run->opts;
    bool files = false;
    for (int r = 0; r < (int)o->nproc; r++)
        files = files || run->redirects[r] || run->tee[r];
    if (!files && !o->log_dir)
        return 0;
    char base[PATH_MAX];
    if (o->log_dir) {
        if (run_mkdirs(o->log_dir) != 0) {
            fprintf(stderr, RUN_PROG ": --log-dir %s: %s\n", o->log_dir, strerror(errno));
            return 1;
        }
        ps_strlcpy(base, o->log_dir, sizeof(base));
    } else {
        /* As torchrun without --log-dir: a new directory of its own under TMPDIR. */
        const char *tmp = getenv("TMPDIR");
        if (ps_snprintf(base, sizeof(base), "%s/pshardrun_logs_XXXXXX",
                        tmp && *tmp ? tmp : "/tmp") != 0 ||
            !mkdtemp(base)) {
            fprintf(stderr, RUN_PROG ": cannot create a log directory under %s: %s\n",
                    tmp && *tmp ? tmp : "/tmp", strerror(errno));
            return 1;
        }
    }
    if (ps_snprintf(run->log_run_dir, sizeof(run->log_run_dir), "%s/%s_XXXXXX", base,
                    run->job[0] ? run->job : "none") != 0 ||
        !mkdtemp(run->log_run_dir)) {
        fprintf(stderr, RUN_PROG ": cannot create a log directory under %s: %s\n", base,
                strerror(errno));
        run->log_run_dir[0] = '\0';
        return 1;
    }
    fprintf(stderr, RUN_PROG ": trainers' log files in %s\n", run->log_run_dir);
    return 0;
}

int run_open_trainer_logs(const run_t *run, run_child_t *c, int local_rank, int64_t restarts)
{
    static const char *const names[2] = {"stdout.log", "stderr.log"};
    bool any = false;
    for (int k = 0; k < 2; k++) {
        unsigned char bit = k == 0 ? RUN_STD_OUT : RUN_STD_ERR;
        bool redirected = (run->redirects[local_rank] & bit) != 0;
        c->streams[k].console = !redirected && !run->hidden[local_rank];
        any = any || redirected || (run->tee[local_rank] & bit);
    }
    if (!any || !run->log_run_dir[0])
        return 0;
    char dir[PATH_MAX], path[PATH_MAX + 16];
    if (ps_snprintf(dir, sizeof(dir), "%s/attempt_%lld/%d", run->log_run_dir, (long long)restarts,
                    local_rank) != 0 ||
        run_mkdirs(dir) != 0) {
        fprintf(stderr, RUN_PROG ": cannot create %s: %s\n", dir, strerror(errno));
        return -1;
    }
    for (int k = 0; k < 2; k++) {
        unsigned char bit = k == 0 ? RUN_STD_OUT : RUN_STD_ERR;
        if (!((run->redirects[local_rank] | run->tee[local_rank]) & bit))
            continue;
        ps_snprintf(path, sizeof(path), "%s/%s", dir, names[k]);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
        if (fd < 0) {
            fprintf(stderr, RUN_PROG ": cannot open %s: %s\n", path, strerror(errno));
            return -1;
        }
        c->streams[k].file_fd = fd;
    }
    return 0;
}
