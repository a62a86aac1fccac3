/* The same-host transport (coll_shm.h): reading other ranks' memory with process_vm_readv,
 * the set-up test that proves it works for a peer, and reductions that read through a small
 * bounce buffer so each peer's bytes cross memory once. */
#include "coll_shm.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include "coll_reduce.h"
#include "pshard/util.h"

/* Elements a reduction handles at a time: its fp32 partial sums and one peer's slice stay in
 * the core's cache between the read and the add. */
#define SLICE_ELEMS (64u << 10)

struct coll_shm {
    int n, rank;
    pid_t *pid;  /* by rank */
    int *pidfd;  /* by rank: readable once that process exits; -1 where unknown */
    void *acc;   /* SLICE_ELEMS partial sums (fp32 or int64) */
    void *slice; /* SLICE_ELEMS elements of one peer, in its dtype */
};

pshard_status_t coll_transport_parse(const char *value, coll_transport_t *out, char *err,
                                     size_t errlen)
{
    const char *v = value ? value : getenv("PSHARD_TRANSPORT");
    if (!v || !*v || strcmp(v, "auto") == 0)
        *out = COLL_TRANSPORT_AUTO;
    else if (strcmp(v, "tcp") == 0)
        *out = COLL_TRANSPORT_TCP;
    else if (strcmp(v, "shm") == 0)
        *out = COLL_TRANSPORT_SHM;
    else
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "transport '%.64s' (PSHARD_TRANSPORT, --transport): use auto, tcp or shm",
                       v);
    return PSHARD_OK;
}

/* The kernel's boot id (16 bytes from /proc/sys/kernel/random/boot_id), zeros if unreadable. */
static void boot_id(uint8_t out[16])
{
    memset(out, 0, 16);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f)
        return;
    char text[64] = "";
    if (fgets(text, sizeof(text), f)) {
        size_t k = 0;
        for (const char *p = text; *p && k < 32; p++) {
            int v = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10 : -1;
            if (v < 0)
                continue;
            out[k / 2] = (uint8_t)(out[k / 2] | (k % 2 ? v : v << 4));
            k++;
        }
    }
    fclose(f);
}

void coll_shm_self(uint32_t rank, const uint8_t probe[16], coll_peer_t *out)
{
    memset(out, 0, sizeof(*out));
    out->origin_rank = rank;
    out->pid = (uint32_t)getpid();
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) == 0)
        out->pidns = (uint64_t)st.st_ino;
    boot_id(out->boot_id);
    out->probe_addr = (uint64_t)(uintptr_t)probe;
    memcpy(out->probe, probe, 16);
}

bool coll_shm_can_read(const coll_peer_t *me, const coll_peer_t *peer, char *why, size_t whylen)
{
    static const uint8_t zero[16];
    if (memcmp(me->boot_id, zero, 16) == 0 || memcmp(me->boot_id, peer->boot_id, 16) != 0) {
        snprintf(why, whylen, "rank %u runs on another host (or its boot id is unknown)",
                 peer->origin_rank);
        return false;
    }
    if (me->pidns == 0 || me->pidns != peer->pidns) {
        snprintf(why, whylen, "rank %u runs in another pid namespace (another container)",
                 peer->origin_rank);
        return false;
    }
    uint8_t got[16];
    struct iovec local = {got, sizeof(got)};
    struct iovec remote = {(void *)(uintptr_t)peer->probe_addr, sizeof(got)};
    ssize_t r = process_vm_readv((pid_t)peer->pid, &local, 1, &remote, 1, 0);
    if (r != (ssize_t)sizeof(got)) {
        snprintf(why, whylen, "cannot read rank %u's memory (pid %u): %s", peer->origin_rank,
                 peer->pid, r < 0 ? strerror(errno) : "short read");
        return false;
    }
    if (memcmp(got, peer->probe, sizeof(got)) != 0) {
        snprintf(why, whylen, "pid %u is not rank %u's process (its secret did not read back)",
                 peer->pid, peer->origin_rank);
        return false;
    }
    return true;
}

coll_shm_t *coll_shm_create(int n, int rank, const coll_peer_t *recs)
{
    coll_shm_t *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->n = n;
    s->rank = rank;
    s->pid = calloc((size_t)n, sizeof(pid_t));
    s->pidfd = malloc((size_t)n * sizeof(int));
    /* 8 bytes an element covers every partial-sum and element type. */
    s->acc = malloc((size_t)SLICE_ELEMS * 8);
    s->slice = malloc((size_t)SLICE_ELEMS * 8);
    if (!s->pid || !s->pidfd || !s->acc || !s->slice) {
        if (s->pidfd)
            for (int i = 0; i < n; i++)
                s->pidfd[i] = -1;
        coll_shm_destroy(s);
        return NULL;
    }
    /* Pages backed before the first operation: a store per page (gcc may turn malloc + memset
     * into calloc, which leaves them untouched). */
    for (size_t i = 0; i < (size_t)SLICE_ELEMS * 8; i += 4096) {
        ((volatile uint8_t *)s->acc)[i] = 0;
        ((volatile uint8_t *)s->slice)[i] = 0;
    }
    for (int i = 0; i < n; i++) {
        s->pid[i] = (pid_t)recs[i].pid;
        s->pidfd[i] = -1;
#ifdef SYS_pidfd_open
        if (i != rank)
            s->pidfd[i] = (int)syscall(SYS_pidfd_open, s->pid[i], 0);
#endif
    }
    return s;
}

void coll_shm_destroy(coll_shm_t *s)
{
    if (!s)
        return;
    for (int i = 0; s->pidfd && i < s->n; i++)
        if (s->pidfd[i] >= 0)
            close(s->pidfd[i]);
    free(s->pid);
    free(s->pidfd);
    free(s->acc);
    free(s->slice);
    free(s);
}

int coll_shm_pid(const coll_shm_t *s, int q)
{
    return (int)s->pid[q];
}

/* False once rank q's process has exited (its pid may then name another process). */
bool coll_shm_alive(const coll_shm_t *s, int q)
{
    if (s->pidfd[q] < 0)
        return true;
    struct pollfd p = {s->pidfd[q], POLLIN, 0};
    return poll(&p, 1, 0) == 0;
}

/* After a failed read: whether rank q's process is on its way out (its memory goes before its
 * pidfd says it exited, so wait a little for that). */
static bool exiting(const coll_shm_t *s, int q)
{
    if (s->pidfd[q] < 0)
        return false;
    struct pollfd p = {s->pidfd[q], POLLIN, 0};
    return poll(&p, 1, 50) > 0;
}

pshard_status_t coll_shm_read(coll_shm_t *s, int q, void *dst, uint64_t src_addr, size_t len,
                              char *err, size_t errlen)
{
    uint8_t *d = dst;
    uint64_t a = src_addr;
    while (len > 0) {
        if (!coll_shm_alive(s, q))
            return ps_errf(err, errlen, PSHARD_ERR_PEER_LOST,
                           "lost rank %d: its process (pid %d) exited", q, (int)s->pid[q]);
        struct iovec local = {d, len};
        struct iovec remote = {(void *)(uintptr_t)a, len};
        ssize_t r = process_vm_readv(s->pid[q], &local, 1, &remote, 1, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno == ESRCH)
            return ps_errf(err, errlen, PSHARD_ERR_PEER_LOST,
                           "lost rank %d: its process (pid %d) is gone", q, (int)s->pid[q]);
        if ((r == 0 || (r < 0 && errno == EFAULT)) && exiting(s, q))
            return ps_errf(err, errlen, PSHARD_ERR_PEER_LOST,
                           "lost rank %d: its process (pid %d) exited while this rank read it", q,
                           (int)s->pid[q]);
        if (r == 0 || (r < 0 && errno == EFAULT))
            return ps_errf(err, errlen, PSHARD_ERR_DESYNC,
                           "rank %d named %zu bytes at 0x%llx that its process does not have", q,
                           len, (unsigned long long)a);
        if (r < 0)
            return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot read rank %d's memory: %s", q,
                           strerror(errno));
        d += r;
        a += (uint64_t)r;
        len -= (size_t)r;
    }
    return PSHARD_OK;
}

pshard_status_t coll_shm_read_buf(coll_shm_t *s, int q, coll_buf_t *local, uint64_t loff,
                                  coll_buf_t *remote, uint64_t roff, size_t len, char *err,
                                  size_t errlen)
{
    while (len > 0) {
        uint64_t lc, rc;
        uint8_t *d = (uint8_t *)(uintptr_t)coll_buf_at(local, loff, &lc);
        uint64_t src = coll_buf_at(remote, roff, &rc);
        uint64_t n = len;
        n = n < lc ? n : lc;
        n = n < rc ? n : rc;
        PS_CHECK(coll_shm_read(s, q, d, src, (size_t)n, err, errlen));
        loff += n;
        roff += n;
        len -= (size_t)n;
    }
    return PSHARD_OK;
}

pshard_status_t coll_shm_fetch_buf(coll_shm_t *s, int q, uint64_t addr, uint32_t npieces,
                                   uint64_t bytes, coll_buf_t *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    if (npieces == 0) {
        out->base = addr;
        return PSHARD_OK;
    }
    if (npieces > PSHARD_COLL_MAX_SEGS)
        return ps_errf(err, errlen, PSHARD_ERR_DESYNC,
                       "rank %d's buffer has %u pieces (at most %d)", q, npieces,
                       PSHARD_COLL_MAX_SEGS);
    out->pieces = malloc((size_t)npieces * sizeof(coll_piece_t));
    out->ends = malloc((size_t)npieces * sizeof(uint64_t));
    if (!out->pieces || !out->ends) {
        coll_buf_free(out);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    size_t table = (size_t)npieces * sizeof(coll_piece_t);
    for (size_t done = 0; done < table;) {
        size_t len = table - done < COLL_SHM_PIECE ? table - done : COLL_SHM_PIECE;
        pshard_status_t rc =
            coll_shm_read(s, q, (uint8_t *)out->pieces + done, addr + done, len, err, errlen);
        if (rc != PSHARD_OK) {
            coll_buf_free(out);
            return rc;
        }
        done += len;
    }
    uint64_t total = 0;
    for (uint32_t i = 0; i < npieces; i++) {
        if (out->pieces[i].bytes > bytes - total) {
            total = bytes + 1;
            break;
        }
        total += out->pieces[i].bytes;
        out->ends[i] = total;
    }
    if (total != bytes) {
        coll_buf_free(out);
        return ps_errf(err, errlen, PSHARD_ERR_DESYNC,
                       "rank %d's buffer pieces do not hold the operation's %llu bytes", q,
                       (unsigned long long)bytes);
    }
    out->npieces = npieces;
    return PSHARD_OK;
}

pshard_status_t coll_shm_reduce(coll_shm_t *s, coll_buf_t *bufs, uint64_t off, coll_buf_t *own,
                                uint64_t own_off, coll_buf_t *out, uint64_t out_off,
                                pshard_dtype_t dt, int red, size_t count, double scale, char *err,
                                size_t errlen)
{
    size_t es = pshard_dtype_size(dt);
    coll_buf_t slice = coll_buf_flat(s->slice);
    for (size_t done = 0; done < count;) {
        size_t nel = count - done < SLICE_ELEMS ? count - done : SLICE_ELEMS;
        coll_buf_load(s->acc, own, own_off + done * es, dt, nel);
        for (int q = 0; q < s->n; q++) {
            if (q == s->rank)
                continue;
            PS_CHECK(coll_shm_read_buf(s, q, &slice, 0, &bufs[q], off + done * es, nel * es, err,
                                       errlen));
            coll_reduce_accumulate(s->acc, s->slice, dt, red, nel);
        }
        coll_buf_store(out, out_off + done * es, dt, s->acc, nel, scale);
        done += nel;
    }
    return PSHARD_OK;
}
