/* pshard-tcp-ref: the loopback TCP limit that pshard's tcp collectives are measured against.
 * For each of --pairs streams it forks a receiver and a sender process connected over
 * 127.0.0.1; the sender writes --total bytes (after --warmup untimed ones) in --chunk writes
 * from a pre-touched buffer, the receiver reads them into another and times them. Prints each
 * stream's rate and the aggregate in GB/s (1e9 bytes per second). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pshard/config.h"
#include "pshard/util.h"

#define PROG "pshard-tcp-ref"
#define MAX_PAIRS 16

typedef struct {
    char *total;           /* bytes timed per stream */
    char *warmup;          /* bytes sent first, untimed (slow start, cold caches) */
    char *chunk;           /* bytes per write(2) and read(2) */
    int64_t pairs;         /* concurrent streams */
    int64_t repeat;        /* measurements; the best is reported last */
    int64_t socket_buffer; /* SO_SNDBUF/SO_RCVBUF; 0: PSHARD_SOCKET_BUFFER or the kernel's */
} ref_opts_t;

#define OPT(flag, env, type, def, help, field, lo, hi)                                             \
    {                                                                                              \
        flag, env, type, def, help, offsetof(ref_opts_t, field), lo, hi                            \
    }

static const ps_option_t options[] = {
    OPT("total", "PSHARD_TCP_REF_TOTAL", PS_OPT_STRING, "1G",
        "bytes timed per stream (suffix K, M, G = 2^10, 2^20, 2^30)", total, 0, 0),
    OPT("warmup", "PSHARD_TCP_REF_WARMUP", PS_OPT_STRING, "256M",
        "bytes sent before the clock starts", warmup, 0, 0),
    OPT("chunk", "PSHARD_TCP_REF_CHUNK", PS_OPT_STRING, "4M", "bytes per write and read call",
        chunk, 0, 0),
    OPT("pairs", "PSHARD_TCP_REF_PAIRS", PS_OPT_INT, "1",
        "concurrent sender/receiver pairs (one stream each)", pairs, 1, MAX_PAIRS),
    OPT("repeat", "PSHARD_TCP_REF_REPEAT", PS_OPT_INT, "3", "measurements (rows) to take", repeat,
        1, 100),
    OPT("socket-buffer", NULL, PS_OPT_INT, "0",
        "SO_SNDBUF/SO_RCVBUF bytes; 0: PSHARD_SOCKET_BUFFER when set (as pshard does), else the "
        "kernel's autotuning",
        socket_buffer, 0, 1 << 30),
};

/* Parses "64", "1K", "16M", "1G" (binary multiples, optional "B"/"iB"); 0 or -1. */
static int parse_size(const char *text, size_t *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || end == text || text[0] == '-')
        return -1;
    unsigned shift = 0;
    if (*end == 'k' || *end == 'K')
        shift = 10;
    else if (*end == 'm' || *end == 'M')
        shift = 20;
    else if (*end == 'g' || *end == 'G')
        shift = 30;
    if (shift)
        end++;
    if (*end && strcasecmp(end, "B") != 0 && strcasecmp(end, "iB") != 0)
        return -1;
    if (v > (SIZE_MAX >> shift))
        return -1;
    *out = (size_t)(v << shift);
    return 0;
}

/* TCP_NODELAY and the buffer sizes pshard's sockets get (coll_tcp_conn.c tcp_tune_socket). */
static void tune(int fd, int64_t socket_buffer)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    int64_t bytes = socket_buffer;
    const char *env = getenv("PSHARD_SOCKET_BUFFER");
    if (bytes == 0 && env && ps_parse_i64(env, 65536, 1 << 30, &bytes) != 0)
        bytes = 0;
    if (bytes > 0) {
        int b = (int)bytes;
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof(b));
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof(b));
    }
}

static void *alloc_touched(size_t n)
{
    void *p = malloc(n);
    if (p)
        memset(p, 0x5a, n);
    return p;
}

/* Sender process: connects, writes warmup + total bytes, closes. Exit status 0 or 1. */
static int sender(int port, const ref_opts_t *o, size_t total, size_t chunk)
{
    uint8_t *buf = alloc_touched(chunk);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (!buf || fd < 0)
        return 1;
    tune(fd, o->socket_buffer);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        fprintf(stderr, PROG ": connect: %s\n", strerror(errno));
        return 1;
    }
    size_t left = total;
    while (left > 0) {
        size_t want = left < chunk ? left : chunk;
        ssize_t w = send(fd, buf, want, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            fprintf(stderr, PROG ": send: %s\n", strerror(errno));
            return 1;
        }
        left -= (size_t)w;
    }
    close(fd);
    free(buf);
    return 0;
}

/* Receiver process: accepts one connection, reads warmup bytes, then times `total` bytes and
 * writes {start_ns, end_ns} (CLOCK_MONOTONIC, comparable across processes) to result_fd. */
static int receiver(int listen_fd, int result_fd, const ref_opts_t *o, size_t warmup, size_t total,
                    size_t chunk)
{
    uint8_t *buf = alloc_touched(chunk);
    int fd = accept(listen_fd, NULL, NULL);
    if (!buf || fd < 0)
        return 1;
    tune(fd, o->socket_buffer);
    int64_t times[2] = {0, 0};
    size_t got_total = 0, target = warmup + total;
    if (warmup == 0)
        times[0] = ps_now_ns();
    while (got_total < target) {
        size_t want = target - got_total;
        if (want > chunk)
            want = chunk;
        /* Stop exactly at the warm-up boundary so the clock starts on a byte count. */
        if (got_total < warmup && want > warmup - got_total)
            want = warmup - got_total;
        ssize_t r = recv(fd, buf, want, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            fprintf(stderr, PROG ": recv: %s\n", r ? strerror(errno) : "early end of stream");
            return 1;
        }
        got_total += (size_t)r;
        if (got_total == warmup && times[0] == 0)
            times[0] = ps_now_ns();
    }
    times[1] = ps_now_ns();
    close(fd);
    free(buf);
    return write(result_fd, times, sizeof(times)) == (ssize_t)sizeof(times) ? 0 : 1;
}

static pid_t fork_child(void)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
    }
    return pid;
}

/* One measurement with `pairs` streams; fills per-stream and aggregate GB/s. Every child is
 * reaped before it returns; on failure the survivors are killed by PID. Returns 0 or -1. */
static int measure(const ref_opts_t *o, size_t warmup, size_t total, size_t chunk,
                   double *per_stream, double *aggregate)
{
    int np = (int)o->pairs;
    pid_t pids[2 * MAX_PAIRS];
    int result_fd[MAX_PAIRS];
    int nchildren = 0, rc = 0;
    for (int p = 0; p < np; p++)
        result_fd[p] = -1;
    for (int p = 0; p < np && rc == 0; p++) {
        int lfd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t len = sizeof(a);
        int fds[2] = {-1, -1};
        if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(lfd, 1) != 0 ||
            getsockname(lfd, (struct sockaddr *)&a, &len) != 0 || pipe(fds) != 0) {
            fprintf(stderr, PROG ": listen on loopback: %s\n", strerror(errno));
            if (lfd >= 0)
                close(lfd);
            rc = -1;
            break;
        }
        /* The listener is set up before either child exists: the sender cannot connect early. */
        tune(lfd, o->socket_buffer);
        pid_t r = fork_child();
        if (r == 0) {
            close(fds[0]);
            _exit(receiver(lfd, fds[1], o, warmup, total, chunk));
        }
        close(fds[1]);
        result_fd[p] = fds[0];
        if (r > 0)
            pids[nchildren++] = r;
        pid_t s = r > 0 ? fork_child() : -1;
        if (s == 0) {
            close(lfd);
            _exit(sender(ntohs(a.sin_port), o, warmup + total, chunk));
        }
        close(lfd);
        if (s > 0)
            pids[nchildren++] = s;
        if (r < 0 || s < 0) {
            fprintf(stderr, PROG ": fork: %s\n", strerror(errno));
            rc = -1;
        }
    }
    int64_t first = INT64_MAX, last = 0;
    double sum = 0;
    for (int p = 0; p < np && rc == 0; p++) {
        int64_t t[2];
        ssize_t got;
        do {
            got = read(result_fd[p], t, sizeof(t));
        } while (got < 0 && errno == EINTR);
        if (got != (ssize_t)sizeof(t)) {
            fprintf(stderr, PROG ": stream %d reported no time\n", p);
            rc = -1;
            break;
        }
        first = t[0] < first ? t[0] : first;
        last = t[1] > last ? t[1] : last;
        sum += (double)total / (double)(t[1] - t[0]);
    }
    for (int i = 0; i < nchildren; i++) {
        int st;
        if (rc != 0)
            kill(pids[i], SIGKILL);
        if (waitpid(pids[i], &st, 0) == pids[i] && (!WIFEXITED(st) || WEXITSTATUS(st) != 0))
            rc = -1;
    }
    for (int p = 0; p < np; p++) {
        if (result_fd[p] >= 0)
            close(result_fd[p]);
    }
    if (rc == 0) {
        *per_stream = sum / np;
        *aggregate = (double)total * np / (double)(last - first);
    }
    return rc;
}

int main(int argc, char **argv)
{
    ref_opts_t o;
    memset(&o, 0, sizeof(o));
    ps_config_result_t res;
    char err[512] = "";
    int exit_code = 2;
    size_t total = 0, warmup = 0, chunk = 0;
    if (ps_config_parse(options, PS_ARRAY_LEN(options), argc, argv, &o, &res, err, sizeof(err)) !=
        PSHARD_OK) {
        fprintf(stderr, PROG ": %s (see --help)\n", err);
        goto out;
    }
    if (res.help) {
        ps_config_usage(stdout, PROG, "[OPTIONS]",
                        "Loopback single-stream TCP throughput (sender and receiver processes, "
                        "large writes from pre-touched buffers): the limit a collective over "
                        "loopback TCP can approach.",
                        options, PS_ARRAY_LEN(options));
        exit_code = 0;
        goto out;
    }
    if (res.version) {
        printf(PROG " %s\n", PSHARD_VERSION_STRING);
        exit_code = 0;
        goto out;
    }
    if (res.first_positional < argc) {
        fprintf(stderr, PROG ": unexpected argument '%s'\n", argv[res.first_positional]);
        goto out;
    }
    if (parse_size(o.total, &total) != 0 || total == 0 || parse_size(o.warmup, &warmup) != 0 ||
        parse_size(o.chunk, &chunk) != 0 || chunk == 0) {
        fprintf(stderr, PROG ": --total, --warmup and --chunk must be sizes (total, chunk > 0)\n");
        goto out;
    }
    signal(SIGPIPE, SIG_IGN);
    printf("# %s: loopback TCP, %lld stream(s), %zu-byte writes, %zu bytes timed per stream "
           "after %zu untimed; GB/s = 1e9 B/s\n",
           PROG, (long long)o.pairs, chunk, total, warmup);
    printf("# %7s %14s %10s %17s %16s\n", "streams", "bytes/stream", "run", "per-stream(GB/s)",
           "aggregate(GB/s)");
    double best = 0, best_stream = 0;
    exit_code = 0;
    for (int64_t i = 0; i < o.repeat; i++) {
        double stream = 0, agg = 0;
        if (measure(&o, warmup, total, chunk, &stream, &agg) != 0) {
            exit_code = 1;
            break;
        }
        printf("  %7lld %14zu %10lld %17.3f %16.3f\n", (long long)o.pairs, total, (long long)i + 1,
               stream, agg);
        fflush(stdout);
        if (agg > best) {
            best = agg;
            best_stream = stream;
        }
    }
    if (exit_code == 0)
        printf("  %7lld %14zu %10s %17.3f %16.3f\n", (long long)o.pairs, total, "best", best_stream,
               best);
out:
    ps_config_free(options, PS_ARRAY_LEN(options), &o);
    return exit_code;
}
