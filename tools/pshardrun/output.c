/* pshardrun's output prefixer: every line a child writes on its stdout or stderr is forwarded
 * to pshardrun's own, whole, in one write, with the child's "[role rank] " in front, and a line
 * longer than RUN_MAX_LINE in pieces of that size. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* Forwards one line (without its newline) with the child's prefix, in one write. */
static void run_emit_line(const run_child_t *c, int out_fd, const char *line, size_t len)
{
    static char out[sizeof(((run_child_t *)0)->prefix) + RUN_MAX_LINE + 1];
    size_t plen = strlen(c->prefix);
    memcpy(out, c->prefix, plen);
    memcpy(out + plen, line, len);
    out[plen + len] = '\n';
    run_write_all(out_fd, out, plen + len + 1);
}

/* Forwards every complete line in the stream's buffer; with flush, also what is left (a
 * partial line at EOF). */
static void run_stream_emit(const run_child_t *c, run_stream_t *s, bool flush)
{
    size_t start = 0;
    for (size_t i = 0; i < s->len; i++) {
        if (s->buf[i] == '\n') {
            run_emit_line(c, s->out_fd, s->buf + start, i - start);
            start = i + 1;
        }
    }
    if (s->len - start == RUN_MAX_LINE || (flush && s->len > start)) {
        run_emit_line(c, s->out_fd, s->buf + start, s->len - start);
        start = s->len;
    }
    memmove(s->buf, s->buf + start, s->len - start);
    s->len -= start;
}

void run_stream_close(const run_child_t *c, run_stream_t *s)
{
    if (s->fd < 0)
        return;
    run_stream_emit(c, s, true);
    close(s->fd);
    s->fd = -1;
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
