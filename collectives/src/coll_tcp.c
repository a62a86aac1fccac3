/* The tcp backend's engine: one thread per communicator runs operations in issue order over
 * two non-blocking sockets (to the next rank, from the previous one). Each operation is a pair
 * of byte streams framed in DATA frames: all-gather and broadcast forward what they receive
 * straight from the caller's output buffer, reduce-scatter accumulates each received piece with
 * the local input in a bounded window and forwards it, so sending, receiving and reducing
 * overlap. Descriptors travel the whole ring first-come: every rank sees every other rank's
 * descriptor before it completes, so a mismatch fails everywhere and never yields wrong data.
 *
 * Why poll(2) and not libevent: a communicator has exactly two sockets and one eventfd, and one
 * operation runs at a time; a poll loop costs the same system calls as libevent's epoll backend
 * and keeps the whole state machine in one function instead of three callbacks. */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "coll_engine.h"
#include "coll_reduce.h"
#include "pshard/log.h"
#include "pshard/util.h"

#define RING_CAP (8u << 20)         /* reduce-scatter window */
#define CONV_CAP (4u << 20)         /* fp32 staging for half-type inputs */
#define DATA_FRAME (1u << 20)       /* payload of one DATA frame we send */
#define OWN_COPY_SLICE (256u << 10) /* all-gather's local copy, done while the sockets block */
#define LINGER_MS 2000              /* destroy: wait this long for the previous rank to close */
#define MAX_PHASES 2

static engine_t *engine_of(pshard_comm_t *comm)
{
    return comm->impl;
}

/* ---------------------------------------------------------------------------------------- */
/* Stream geometry                                                                           */

static size_t mod(long long a, int n)
{
    long long r = a % n;
    return (size_t)(r < 0 ? r + n : r);
}

/* Advances *k so that off lies in block *k (offsets are monotonic within a phase). */
static size_t locate(const size_t *offs, size_t nblocks, size_t *k, size_t off)
{
    while (*k + 1 < nblocks && off >= offs[*k + 1])
        (*k)++;
    return off - offs[*k];
}

/* How many bytes of the out stream may be sent now (absolute stream offset). */
static size_t out_ready(const engine_t *e, const phase_t *ph)
{
    switch (ph->kind) {
    case PH_AG: {
        size_t r = ph->out_off[1] + ph->in_done;
        return r < ph->out_total ? r : ph->out_total;
    }
    case PH_RS:
        return ph->out_total; /* readiness is item by item: rs_out() */
    case PH_BCAST:
        return e->req->op.args.root == e->t.rank
                   ? ph->out_total
                   : (ph->in_done < ph->out_total ? ph->in_done : ph->out_total);
    }
    return 0;
}

static size_t rs_item_len(const engine_t *e, const phase_t *ph, size_t j, size_t k, bool out)
{
    size_t chunk = out ? ph->out_chunk[k] : ph->in_chunk[k];
    size_t len = e->bytes[chunk], lo = j * ph->slice;
    if (len <= lo)
        return 0;
    return len - lo < ph->slice ? len - lo : ph->slice;
}

static void rs_cur_init(const engine_t *e, const phase_t *ph, rs_cur_t *c, bool out)
{
    c->j = c->k = c->start = 0;
    c->len = ph->rounds ? rs_item_len(e, ph, 0, 0, out) : 0;
}

/* Moves c to the item holding stream offset pos (or past the end). */
static void rs_cur_seek(const engine_t *e, const phase_t *ph, rs_cur_t *c, size_t pos, bool out)
{
    while (c->j < ph->rounds && pos >= c->start + c->len) {
        c->start += c->len;
        if (++c->k == ph->nblocks) {
            c->k = 0;
            c->j++;
        }
        c->len = c->j < ph->rounds ? rs_item_len(e, ph, c->j, c->k, out) : 0;
    }
}

/* In-stream offset of the next forwarded byte still to send (everything before it that is
 * forwarded has been sent); in_total when nothing more is forwarded. */
static size_t rs_fwd_pos(const phase_t *ph)
{
    if (ph->nblocks < 2 || ph->o.j >= ph->rounds)
        return ph->in_total;
    if (ph->o.k == 0)
        return ph->fw.start; /* fw sits at (o.j, 0) */
    return ph->fw.start + (ph->out_sent - ph->o.start);
}

/* The reduce-scatter out stream at out_sent: pointer and bytes ready and contiguous. */
static const uint8_t *rs_out(engine_t *e, phase_t *ph, size_t *avail)
{
    size_t p = ph->out_sent;
    rs_cur_seek(e, ph, &ph->o, p, true);
    *avail = 0;
    if (ph->o.j >= ph->rounds)
        return NULL;
    size_t j = ph->o.j, k = ph->o.k, inner = p - ph->o.start;
    /* Keep fw on in-item (j, k-1), or (j, 0) while sending this round's own slice. */
    size_t want_k = k ? k - 1 : 0;
    while (ph->fw.j < j || (ph->fw.j == j && ph->fw.k < want_k)) {
        ph->fw.start += ph->fw.len;
        if (++ph->fw.k == ph->nblocks) {
            ph->fw.k = 0;
            ph->fw.j++;
        }
        ph->fw.len = ph->fw.j < ph->rounds ? rs_item_len(e, ph, ph->fw.j, ph->fw.k, false) : 0;
    }
    if (k == 0) {
        const coll_op_t *op = &e->req->op;
        pshard_dtype_t dt = op->args.dtype;
        size_t chunk = ph->out_chunk[0];
        size_t off = j * ph->slice + inner; /* bytes into the chunk, accumulation type */
        *avail = ph->o.len - inner;
        if (coll_acc_dtype(dt) == dt) {
            uint64_t contig;
            uint64_t at = coll_buf_at(ph->src, op->displs[chunk] * e->esize + off, &contig);
            if (*avail > contig)
                *avail = (size_t)contig;
            return (const uint8_t *)(uintptr_t)at;
        }
        if (ph->conv_round != j) {
            size_t first = (j * ph->slice) / e->asize, nel = ph->o.len / e->asize;
            coll_buf_load(e->t.conv, ph->src, (op->displs[chunk] + first) * e->esize, dt, nel);
            ph->conv_round = j;
        }
        return e->t.conv + inner;
    }
    size_t in_pos = ph->fw.start + inner;
    size_t done = ph->in_done > in_pos ? ph->in_done - in_pos : 0;
    size_t left = ph->o.len - inner;
    size_t pos = in_pos % e->t.ring_cap;
    size_t wrap = e->t.ring_cap - pos;
    *avail = done < left ? done : left;
    if (*avail > wrap)
        *avail = wrap;
    return e->t.ring + pos;
}

/* Pointer to out stream byte p and the contiguous bytes available there. */
static const uint8_t *out_ptr(engine_t *e, phase_t *ph, size_t p, size_t *contig)
{
    uint64_t c, at;
    if (ph->kind == PH_BCAST) {
        *contig = ph->out_total - p;
        at = coll_buf_at(ph->buf, p, &c);
    } else {
        size_t inner = locate(ph->out_off, ph->nblocks, &ph->out_k, p);
        size_t chunk = ph->out_chunk[ph->out_k];
        *contig = ph->out_off[ph->out_k + 1] - p;
        if (ph->out_k == 0 && ph->own_src)
            at = coll_buf_at(ph->own_src, inner, &c); /* block 0 is this rank's own */
        else
            at = coll_buf_at(ph->buf, e->displ[chunk] + inner, &c);
    }
    if (*contig > c)
        *contig = (size_t)c;
    return (const uint8_t *)(uintptr_t)at;
}

/* Where incoming byte q goes and how many contiguous bytes may land there now. */
static uint8_t *in_ptr(engine_t *e, phase_t *ph, size_t q, size_t *room)
{
    if (ph->kind == PH_BCAST || ph->kind == PH_AG) {
        uint64_t c, at;
        if (ph->kind == PH_BCAST) {
            *room = ph->in_total - q;
            at = coll_buf_at(ph->buf, q, &c);
        } else {
            size_t inner = locate(ph->in_off, ph->nblocks, &ph->in_k, q);
            *room = ph->in_off[ph->in_k + 1] - q;
            at = coll_buf_at(ph->buf, e->displ[ph->in_chunk[ph->in_k]] + inner, &c);
        }
        if (*room > c)
            *room = (size_t)c;
        return (uint8_t *)(uintptr_t)at;
    }
    /* RS: bounded window; a slot is free once its bytes were forwarded (or, for the last block,
     * reduced into the output). */
    size_t fwd = rs_fwd_pos(ph);
    size_t freed = fwd < ph->in_done ? fwd : ph->in_done;
    size_t limit = freed + e->t.ring_cap;
    size_t pos = q % e->t.ring_cap;
    size_t c = e->t.ring_cap - pos;
    size_t allowed = limit > q ? limit - q : 0;
    size_t left = ph->in_total - q;
    *room = c < allowed ? c : allowed;
    if (*room > left)
        *room = left;
    return e->t.ring + pos;
}

/* Reduces newly received whole elements of a reduce-scatter stream: each in-item is
 * accumulated with the matching slice of the local input; the last block of each round is this
 * rank's chunk, whose result is rounded once into the output. */
static void rs_process(engine_t *e, phase_t *ph)
{
    const coll_op_t *op = &e->req->op;
    pshard_dtype_t dt = op->args.dtype;
    size_t asz = e->asize;
    size_t upto = ph->in_recv - ph->in_recv % asz;
    while (ph->in_done < upto) {
        rs_cur_seek(e, ph, &ph->pr, ph->in_done, false);
        size_t q = ph->in_done;
        size_t item_end = ph->pr.start + ph->pr.len;
        size_t pos = q % e->t.ring_cap;
        size_t span = upto - q;
        if (span > item_end - q)
            span = item_end - q;
        if (span > e->t.ring_cap - pos)
            span = e->t.ring_cap - pos;
        size_t chunk = ph->in_chunk[ph->pr.k];
        size_t e0 = (ph->pr.j * ph->slice + (q - ph->pr.start)) / asz, nel = span / asz;
        uint8_t *acc = e->t.ring + pos;
        coll_buf_accumulate(acc, ph->src, (op->displs[chunk] + e0) * e->esize, dt,
                            (int)op->args.reduce, nel);
        if (ph->pr.k + 1 == ph->nblocks)
            coll_buf_store(ph->dst, ph->dst_off + e0 * e->esize, dt, acc, nel, e->scale);
        ph->in_done += span;
    }
}

static void *alloc_touched(size_t n)
{
    /* First touch now, not on the hot path. Not memset: gcc turns malloc + memset(0) into
     * calloc, which leaves fresh pages untouched. */
    volatile uint8_t *p = malloc(n);
    for (size_t i = 0; p && i < n; i += 4096)
        p[i] = 0;
    return (void *)p;
}

/* Builds the block lists of a phase. kind AG: out blocks rank, rank-1, ...; in blocks rank-1,
 * ...; RS: out rank-1, rank-2, ...; in rank-2, ..., rank. bytes[] are per-chunk sizes. */
static pshard_status_t setup_ring_phase(engine_t *e, phase_t *ph, phase_kind_t kind,
                                        const size_t *bytes)
{
    int n = e->t.n, r = e->t.rank;
    size_t nb = (size_t)n - 1;
    ph->kind = kind;
    ph->nblocks = nb;
    ph->in_chunk = calloc(nb, sizeof(size_t));
    ph->out_chunk = calloc(nb, sizeof(size_t));
    ph->in_off = calloc(nb + 1, sizeof(size_t));
    ph->out_off = calloc(nb + 1, sizeof(size_t));
    if (!ph->in_chunk || !ph->out_chunk || !ph->in_off || !ph->out_off)
        return PSHARD_ERR_NO_MEMORY;
    int out_start = kind == PH_AG ? r : r - 1;
    int in_start = kind == PH_AG ? r - 1 : r - 2;
    for (size_t k = 0; k < nb; k++) {
        ph->out_chunk[k] = mod((long long)out_start - (long long)k, n);
        ph->in_chunk[k] = mod((long long)in_start - (long long)k, n);
        ph->out_off[k + 1] = ph->out_off[k] + bytes[ph->out_chunk[k]];
        ph->in_off[k + 1] = ph->in_off[k] + bytes[ph->in_chunk[k]];
    }
    ph->out_total = ph->out_off[nb];
    ph->in_total = ph->in_off[nb];
    if (kind == PH_RS) {
        if (!e->t.ring) {
            /* The window, made by the first reduction through the sockets (on the same-host
             * transport, and for reductions small enough to ride in the descriptors, none
             * ever needs its 8 MiB). */
            e->t.ring = alloc_touched(e->t.ring_cap);
            if (!e->t.ring)
                return PSHARD_ERR_NO_MEMORY;
        }
        /* Two rounds fit in the window; slices are whole 64-byte multiples. */
        size_t slice = e->t.ring_cap / (2 * (size_t)n);
        slice -= slice % 64;
        if (slice < 4096)
            slice = 4096;
        size_t longest = 0;
        for (int i = 0; i < n; i++)
            longest = bytes[i] > longest ? bytes[i] : longest;
        ph->slice = slice;
        ph->rounds = (longest + slice - 1) / slice;
        ph->conv_round = SIZE_MAX;
        pshard_dtype_t dt = e->req->op.args.dtype;
        if (coll_acc_dtype(dt) != dt && !e->t.conv) {
            /* The fp32 staging of half-type inputs, made by the first operation that needs it
             * (an fp32-only job never pays its 4 MiB). */
            e->t.conv = alloc_touched(e->t.conv_cap);
            if (!e->t.conv)
                return PSHARD_ERR_NO_MEMORY;
        }
        rs_cur_init(e, ph, &ph->o, true);
        rs_cur_init(e, ph, &ph->fw, false);
        rs_cur_init(e, ph, &ph->pr, false);
    }
    return PSHARD_OK;
}

static void free_phases(engine_t *e)
{
    coll_direct_free(e);
    for (size_t i = 0; i < e->nphases; i++) {
        phase_t *ph = &e->phases[i];
        free(ph->in_chunk);
        free(ph->out_chunk);
        free(ph->in_off);
        free(ph->out_off);
        memset(ph, 0, sizeof(*ph));
    }
    e->nphases = 0;
    free(e->bytes);
    free(e->displ);
    e->bytes = e->displ = NULL;
}

/* Sets up the phases of the request's operation. For n == 1 the work is a local copy and no
 * phase is created. */
static pshard_status_t setup_op(engine_t *e)
{
    coll_op_t *op = &e->req->op;
    const pshard_coll_args_t *a = &op->args;
    int n = e->t.n, r = e->t.rank;
    coll_engine_op_init(e);
    e->bytes = calloc((size_t)n, sizeof(size_t));
    e->displ = calloc((size_t)n, sizeof(size_t));
    if (!e->bytes || !e->displ)
        return PSHARD_ERR_NO_MEMORY;
    uint8_t *recv = a->recv;
    const uint8_t *send = a->send;
    bool whole = !op->sbuf.npieces && !op->rbuf.npieces; /* no pieces: may be in place */
    size_t es = e->esize;

    if (n == 1) {
        size_t nbytes = a->op == PSHARD_COLL_BARRIER ? 0 : op->displs[1] * es;
        if (nbytes)
            coll_buf_copy(&op->rbuf, 0, &op->sbuf, 0, nbytes);
        return PSHARD_OK;
    }
    switch (a->op) {
    case PSHARD_COLL_BARRIER:
        return PSHARD_OK; /* the descriptors' round is the barrier */
    case PSHARD_COLL_ALL_GATHER: {
        for (int i = 0; i < n; i++) {
            e->bytes[i] = op->counts[i] * es;
            e->displ[i] = op->displs[i] * es;
        }
        size_t out_bytes = op->displs[n] * es;
        if (e->bytes[r] && (!whole || send != recv + e->displ[r])) {
            if (!whole || send + e->bytes[r] <= recv || send >= recv + out_bytes) {
                e->phases[0].own_src = &op->sbuf;
                e->phases[0].own_dst = e->displ[r];
                e->phases[0].own_len = e->bytes[r];
            } else {
                memmove(recv + e->displ[r], send, e->bytes[r]); /* overlapping: copy first */
            }
        }
        e->phases[0].buf = &op->rbuf;
        e->nphases = 1;
        return setup_ring_phase(e, &e->phases[0], PH_AG, e->bytes);
    }
    case PSHARD_COLL_REDUCE_SCATTER:
    case PSHARD_COLL_ALL_REDUCE: {
        for (int i = 0; i < n; i++) {
            e->bytes[i] = op->counts[i] * e->asize;
            e->displ[i] = op->displs[i] * es;
        }
        phase_t *rs = &e->phases[0];
        rs->src = &op->sbuf;
        rs->dst = &op->rbuf;
        rs->dst_off = a->op == PSHARD_COLL_ALL_REDUCE ? e->displ[r] : 0;
        e->nphases = 1;
        PS_CHECK(setup_ring_phase(e, rs, PH_RS, e->bytes));
        if (a->op == PSHARD_COLL_ALL_REDUCE) {
            size_t *ag_bytes = calloc((size_t)n, sizeof(size_t));
            if (!ag_bytes)
                return PSHARD_ERR_NO_MEMORY;
            for (int i = 0; i < n; i++)
                ag_bytes[i] = op->counts[i] * es;
            phase_t *ag = &e->phases[1];
            ag->buf = &op->rbuf;
            e->nphases = 2;
            pshard_status_t rc = setup_ring_phase(e, ag, PH_AG, ag_bytes);
            free(ag_bytes);
            return rc;
        }
        return PSHARD_OK;
    }
    case PSHARD_COLL_BROADCAST: {
        size_t total = op->displs[n] * es;
        if (r == a->root && total)
            coll_buf_copy(&op->rbuf, 0, &op->sbuf, 0, total);
        phase_t *ph = &e->phases[0];
        ph->kind = PH_BCAST;
        ph->buf = &op->rbuf;
        ph->in_total = r == a->root ? 0 : total;
        ph->out_total = e->t.next == a->root ? 0 : total;
        e->nphases = 1;
        return PSHARD_OK;
    }
    case PSHARD_COLL_REDUCE:
    case PSHARD_COLL_GATHER:
    case PSHARD_COLL_SCATTER:
    case PSHARD_COLL_ALL_TO_ALL:
        break; /* never here: coll_comm.c runs them as all_reduce, all_gather, broadcast */
    }
    return PSHARD_ERR_INVALID_ARGUMENT;
}

/* The bytes a phase switch needs: the AG phase of an all-reduce uses per-chunk output sizes. */
static void enter_phase(engine_t *e)
{
    phase_t *ph = &e->phases[e->cur];
    if (ph->kind == PH_AG) {
        const coll_op_t *op = &e->req->op;
        if (op->args.op != PSHARD_COLL_BARRIER) {
            for (int i = 0; i < e->t.n; i++)
                e->displ[i] = op->displs[i] * e->esize;
        }
    }
}

static bool phase_done(const engine_t *e, const phase_t *ph)
{
    bool data_frame_open = e->of_active && e->of_is_data && e->of_phase == ph;
    return ph->in_done == ph->in_total && ph->out_sent == ph->out_total && !data_frame_open &&
           ph->own_copied == ph->own_len;
}

/* ---------------------------------------------------------------------------------------- */
/* Socket I/O                                                                                */

static bool do_writes(engine_t *e)
{
    bool progress = false;
    e->write_blocked = false;
    if (e->next_lost_errno)
        return false;
    for (int frames = 0; frames < 16; frames++) {
        if (!e->of_active) {
            ctrl_frame_t *f = PS_QUEUE_POP(&e->ctrl, ctrl_frame_t, node);
            if (f) {
                e->of_ctrl = f;
                e->of_is_data = false;
                e->of_payload = f->buf;
                e->of_len = f->len;
                e->of_off = 0;
                e->of_hdr_off = COLL_FRAME_HEADER_SIZE; /* header is inside buf */
                e->of_zero_pad = false; /* padding belongs to an abandoned DATA frame only */
                e->of_active = true;
            } else if (e->req && !e->op_failed && !e->held && e->cur < e->nphases) {
                phase_t *ph = &e->phases[e->cur];
                size_t len, contig;
                const uint8_t *p;
                if (ph->kind == PH_RS) {
                    if (ph->out_sent >= ph->out_total)
                        break;
                    p = rs_out(e, ph, &len);
                } else {
                    size_t ready = out_ready(e, ph);
                    if (ready <= ph->out_sent)
                        break;
                    p = out_ptr(e, ph, ph->out_sent, &contig);
                    len = ready - ph->out_sent;
                    if (len > contig)
                        len = contig;
                }
                if (len > DATA_FRAME)
                    len = DATA_FRAME;
                if (len == 0)
                    break;
                coll_frame_header_t h = {COLL_FRAME_DATA, 0, (uint32_t)len, e->req->op.desc.seq};
                coll_frame_header_encode(&h, e->of_hdr);
                e->of_hdr_off = 0;
                e->of_payload = p;
                e->of_len = len;
                e->of_off = 0;
                e->of_is_data = true;
                e->of_zero_pad = false;
                e->of_phase = ph;
                e->of_active = true;
            } else {
                break;
            }
        }
        static const uint8_t zeros[65536];
        struct iovec iov[2];
        int niov = 0;
        if (e->of_hdr_off < COLL_FRAME_HEADER_SIZE) {
            iov[niov].iov_base = e->of_hdr + e->of_hdr_off;
            iov[niov].iov_len = COLL_FRAME_HEADER_SIZE - e->of_hdr_off;
            niov++;
        }
        size_t left = e->of_len - e->of_off;
        if (left) {
            if (e->of_zero_pad && e->of_is_data) {
                iov[niov].iov_base = (void *)zeros;
                iov[niov].iov_len = left < sizeof(zeros) ? left : sizeof(zeros);
            } else {
                iov[niov].iov_base = (void *)(e->of_payload + e->of_off);
                iov[niov].iov_len = left;
            }
            niov++;
        }
        struct msghdr mh = {0};
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)niov;
        ssize_t w = sendmsg(e->t.send_fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                e->write_blocked = true;
                return progress;
            }
            /* The next rank is gone. Its neighbour on the other side may already be telling
             * the ring why (a desync, an abort): give that notice a moment to arrive before
             * reporting a lost peer. */
            if (!e->next_lost_errno) {
                e->next_lost_errno = errno;
                e->next_lost_ns = ps_now_ns();
            }
            e->of_active = false; /* the link is dead: drop what is queued */
            free(e->of_ctrl);
            e->of_ctrl = NULL;
            coll_engine_free_ctrl(e);
            e->drain_until_ns = 0;
            return true;
        }
        progress = true;
        size_t wrote = (size_t)w;
        if (e->of_hdr_off < COLL_FRAME_HEADER_SIZE) {
            size_t h = COLL_FRAME_HEADER_SIZE - e->of_hdr_off;
            size_t take = wrote < h ? wrote : h;
            e->of_hdr_off += take;
            wrote -= take;
        }
        e->of_off += wrote;
        if (e->of_is_data && !e->of_zero_pad)
            e->of_phase->out_sent += wrote;
        if (e->of_hdr_off == COLL_FRAME_HEADER_SIZE && e->of_off == e->of_len) {
            e->of_active = false;
            if (e->of_ctrl) {
                free(e->of_ctrl);
                e->of_ctrl = NULL;
            }
        }
    }
    return progress;
}

static bool expecting_input(const engine_t *e)
{
    if (!e->req || e->op_failed)
        return false;
    if (e->abort_waiting)
        return true;
    if (e->descs_received < e->t.n - 1)
        return true;
    if (e->held) /* no data until it is released (or diverted: none at all) */
        return false;
    if (e->direct) /* the ranks' last notices are the last frames of the operation */
        return e->done_seen[e->dfinal] < e->t.n - 1;
    for (size_t i = e->cur; i < e->nphases; i++) {
        if (e->phases[i].in_recv < e->phases[i].in_total)
            return true;
    }
    return false;
}

static void handle_desc(engine_t *e)
{
    coll_op_t *op = &e->req->op;
    coll_desc_t d;
    char err[PSHARD_ERRLEN] = "";
    if (coll_desc_decode(e->if_ctrl, e->if_h.len, &d, err, sizeof(err)) != PSHARD_OK) {
        coll_engine_fail_protocol(e, err);
        return;
    }
    int origin = (int)mod((long long)e->t.rank - 1 - e->descs_received, e->t.n);
    bool same = coll_desc_same(&d, &op->desc) && d.divert == op->desc.divert;
    if (!same && d.divert && op->desc.divert && e->if_h.seq == op->desc.seq) {
        /* Both divertible: this rank moves nothing and ends DIVERTED once every descriptor
         * came (each rank sees all of them, so all decide alike); pass it on meanwhile. */
        if (e->diverted_by < 0)
            e->diverted_by = origin;
        e->descs_received++;
        if (origin != e->t.next)
            coll_engine_queue_ctrl(e, COLL_FRAME_DESC, e->if_h.seq, e->if_ctrl, e->if_h.len);
        return;
    }
    if (!same || e->if_h.seq != op->desc.seq) {
        char theirs[256], mine[256], msg[900];
        coll_desc_format(&d, theirs, sizeof(theirs));
        coll_desc_format(&op->desc, mine, sizeof(mine));
        snprintf(msg, sizeof(msg), "desync: rank %d ran %s but rank %d ran %s", origin, theirs,
                 e->t.rank, mine);
        coll_engine_fail_op(e, PSHARD_ERR_DESYNC, msg, true);
        return;
    }
    if (e->inline_op) {
        size_t want = coll_inline_bytes(e, op, origin);
        if (d.inline_len != want) {
            char what[128];
            snprintf(what, sizeof(what), "rank %d's descriptor carried %u bytes of data, not %zu",
                     origin, d.inline_len, want);
            coll_engine_fail_protocol(e, what);
            return;
        }
        coll_buf_t inl = coll_buf_flat(d.inline_data);
        if (op->args.op == PSHARD_COLL_ALL_GATHER)
            coll_buf_copy(&op->rbuf, op->displs[origin] * e->esize, &inl, 0, want);
        else if (op->args.op == PSHARD_COLL_BROADCAST)
            coll_buf_copy(&op->rbuf, 0, &inl, 0, want);
        else
            memcpy(e->inline_in + (size_t)origin * COLL_DESC_INLINE_MAX, d.inline_data, want);
    }
    e->descs_received++;
    if (e->direct) {
        e->peer_desc[origin] = d;
    }
    /* Forward it unless the next rank is where it came from. */
    if (origin != e->t.next)
        coll_engine_queue_ctrl(e, COLL_FRAME_DESC, e->if_h.seq, e->if_ctrl, e->if_h.len);
}

static void handle_abort(engine_t *e)
{
    coll_abort_t a;
    char err[PSHARD_ERRLEN] = "";
    if (coll_abort_decode(e->if_ctrl, e->if_h.len, &a, err, sizeof(err)) != PSHARD_OK) {
        coll_engine_fail_protocol(e, err);
        return;
    }
    if ((int)a.origin_rank == e->t.rank || a.origin_rank >= (uint32_t)e->t.n)
        return; /* our own notice came back around */
    pshard_status_t st = (pshard_status_t)a.status;
    if (st >= 0 || st < PSHARD_ERR_LOWEST)
        st = PSHARD_ERR_ABORTED;
    if ((int)a.origin_rank != e->t.next)
        coll_engine_queue_abort(e, a.origin_rank, st, a.message, e->if_h.seq);
    char msg[PSHARD_ERRLEN];
    snprintf(msg, sizeof(msg), "%s (reported by rank %u)", a.message, a.origin_rank);
    coll_engine_fail_op(e, st, msg, false);
}

/* Reads up to len bytes from the previous rank. Returns 1 with *got > 0, 0 when nothing is
 * available now (read_blocked set), or -1 after failing the operation (closed or broken link). */
static int recv_some(engine_t *e, void *buf, size_t len, size_t *got)
{
    for (;;) {
        ssize_t r = recv(e->t.recv_fd, buf, len, MSG_DONTWAIT);
        if (r > 0) {
            *got = (size_t)r;
            return 1;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            e->read_blocked = true;
            return 0;
        }
        coll_engine_fail_errno(e, false, r == 0 ? 0 : errno);
        return -1;
    }
}

static bool do_reads(engine_t *e)
{
    bool progress = false;
    e->read_blocked = false;
    while (expecting_input(e)) {
        if (!e->if_have_hdr) {
            size_t got;
            int r = recv_some(e, e->if_hdr + e->if_hdr_off, COLL_FRAME_HEADER_SIZE - e->if_hdr_off,
                              &got);
            if (r <= 0)
                return r == 0 ? progress : true;
            progress = true;
            e->if_hdr_off += got;
            if (e->if_hdr_off < COLL_FRAME_HEADER_SIZE)
                continue;
            char err[PSHARD_ERRLEN] = "";
            if (coll_frame_header_decode(e->if_hdr, &e->if_h, err, sizeof(err)) != PSHARD_OK) {
                coll_engine_fail_protocol(e, err);
                return true;
            }
            e->if_have_hdr = true;
            e->if_off = 0;
            uint8_t type = e->if_h.type;
            if (type != COLL_FRAME_DESC && type != COLL_FRAME_DATA && type != COLL_FRAME_ABORT &&
                type != COLL_FRAME_DONE) {
                char what[96];
                snprintf(what, sizeof(what), "unexpected frame type %u", type);
                coll_engine_fail_protocol(e, what);
                return true;
            }
            if (type != COLL_FRAME_ABORT && e->if_h.seq != e->req->op.desc.seq) {
                char what[160];
                snprintf(what, sizeof(what),
                         "it sent a frame of operation seq %" PRIu64 " while this rank runs seq "
                         "%" PRIu64 " (the ranks issued different numbers of collectives)",
                         e->if_h.seq, e->req->op.desc.seq);
                coll_engine_fail_protocol(e, what);
                return true;
            }
            if (type == COLL_FRAME_DATA && e->descs_received == 0) {
                coll_engine_fail_protocol(e, "it sent data before its descriptor");
                return true;
            }
        }
        if (e->if_h.type == COLL_FRAME_DATA) {
            if (e->cur >= e->nphases) {
                coll_engine_fail_protocol(e, "it sent more data than the operation holds");
                return true;
            }
            phase_t *ph = &e->phases[e->cur];
            size_t frame_left = e->if_h.len - e->if_off;
            if (frame_left == 0) {
                e->if_have_hdr = false;
                e->if_hdr_off = 0;
                continue;
            }
            if (ph->in_recv == ph->in_total) {
                if (e->cur + 1 < e->nphases)
                    return progress; /* data of the next phase: wait for the switch */
                coll_engine_fail_protocol(e, "it sent more data than the operation holds");
                return true;
            }
            size_t room;
            uint8_t *dst = in_ptr(e, ph, ph->in_recv, &room);
            if (room > frame_left)
                room = frame_left;
            if (room == 0)
                return progress; /* window full: wait for sends to free it */
            size_t got;
            int r = recv_some(e, dst, room, &got);
            if (r <= 0)
                return r == 0 ? progress : true;
            progress = true;
            e->if_off += got;
            ph->in_recv += got;
            if (ph->kind == PH_RS)
                rs_process(e, ph);
            else
                ph->in_done = ph->in_recv;
            if (e->if_off == e->if_h.len) {
                e->if_have_hdr = false;
                e->if_hdr_off = 0;
            }
        } else {
            size_t left = e->if_h.len - e->if_off;
            if (left) {
                size_t got;
                int r = recv_some(e, e->if_ctrl + e->if_off, left, &got);
                if (r <= 0)
                    return r == 0 ? progress : true;
                progress = true;
                e->if_off += got;
                if (e->if_off < e->if_h.len)
                    continue;
            }
            e->if_have_hdr = false;
            e->if_hdr_off = 0;
            if (e->if_h.type == COLL_FRAME_DESC)
                handle_desc(e);
            else if (e->if_h.type == COLL_FRAME_DONE)
                coll_direct_done(e);
            else
                handle_abort(e);
            progress = true;
        }
    }
    return progress;
}

/* Whether an abort notice waits on the socket, right behind the frames this operation
 * needed: it is read (failing the operation) before the operation reports success, so a rank
 * that joins an operation after another rank aborted it learns so even when every frame the
 * operation needed had already arrived (a small all-gather carried in the descriptors). */
static bool take_pending_abort(engine_t *e)
{
    if (e->t.n < 2 || e->if_have_hdr || e->if_hdr_off)
        return false;
    uint8_t hdr[COLL_FRAME_HEADER_SIZE];
    coll_frame_header_t h;
    ssize_t r = recv(e->t.recv_fd, hdr, sizeof(hdr), MSG_PEEK | MSG_DONTWAIT);
    if (r != (ssize_t)sizeof(hdr) || coll_frame_header_decode(hdr, &h, NULL, 0) != PSHARD_OK ||
        h.type != COLL_FRAME_ABORT)
        return false;
    e->abort_waiting = true;
    do_reads(e);
    e->abort_waiting = false;
    return e->op_failed;
}

/* ---------------------------------------------------------------------------------------- */
/* The engine                                                                                */

static void drain_wake(engine_t *e)
{
    uint64_t v;
    while (read(e->t.wake_fd, &v, sizeof(v)) > 0) {
    }
}

static pshard_coll_req_t *pop_request(engine_t *e)
{
    pthread_mutex_lock(&e->t.qmu);
    pshard_coll_req_t *r = PS_QUEUE_POP(&e->t.queue, pshard_coll_req_t, node);
    pthread_mutex_unlock(&e->t.qmu);
    return r;
}

static void fail_timeout(engine_t *e)
{
    const coll_op_t *op = &e->req->op;
    char msg[PSHARD_ERRLEN];
    phase_t *ph = e->cur < e->nphases ? &e->phases[e->cur] : NULL;
    int who = e->waiting_on >= 0 ? e->waiting_on : e->t.prev;
    snprintf(msg, sizeof(msg),
             "%s seq %" PRIu64 " timed out on rank %d waiting on rank %d: received %zu of %zu "
             "bytes from rank %d, sent %zu of %zu bytes to rank %d, %d of %d descriptors%s",
             pshard_coll_op_name(op->args.op), op->desc.seq, e->t.rank, who, ph ? ph->in_recv : 0,
             ph ? ph->in_total : 0, e->t.prev, ph ? ph->out_sent : 0, ph ? ph->out_total : 0,
             e->t.next, e->descs_received, e->t.n - 1,
             e->direct ? " (same-host transport: some rank never said it finished reading)" : "");
    coll_engine_fail_op(e, PSHARD_ERR_TIMEOUT, msg, true);
}

static pshard_status_t slots_run(engine_t *e, coll_op_t *op, char *err, size_t errlen);

static void run_request(engine_t *e, pshard_coll_req_t *req)
{
    if (coll_slots_takes(e->t.slots, &req->op)) {
        /* A same-host ring whose slots every rank shares: the sockets carry nothing. */
        char msg[PSHARD_ERRLEN];
        msg[0] = '\0';
        pshard_status_t st = slots_run(e, &req->op, msg, sizeof(msg));
        coll_complete(req, st, msg);
        return;
    }
    e->req = req;
    char msg[PSHARD_ERRLEN];
    pshard_status_t rc = PSHARD_OK;
    coll_engine_op_init(e);
    if (coll_inline_is(e, &req->op))
        coll_inline_setup(e);
    else if (coll_direct_is(e, &req->op))
        coll_direct_setup(e);
    else
        rc = setup_op(e);
    if (rc != PSHARD_OK) {
        snprintf(msg, sizeof(msg), "cannot set up %s: %s", pshard_coll_op_name(req->op.args.op),
                 pshard_status_str(rc));
        coll_complete(req, rc, msg);
        free_phases(e);
        e->req = NULL;
        return;
    }
    coll_record_waiting(e->t.comm, &req->op, -1);
    if (e->t.n == 1) {
        coll_complete(req, PSHARD_OK, NULL);
        free_phases(e);
        e->req = NULL;
        return;
    }
    uint8_t buf[COLL_FRAME_MAX_CONTROL];
    size_t n = coll_desc_encode(&req->op.desc, buf, sizeof(buf));
    coll_engine_queue_ctrl(e, COLL_FRAME_DESC, req->op.desc.seq, buf, n);
    e->held = req->op.desc.divert;
    if (e->cur < e->nphases)
        enter_phase(e);

    int64_t spin_until = 0;
    while (!e->op_failed) {
        bool progress = true;
        while (progress && !e->op_failed) {
            progress = do_writes(e);
            if (!e->op_failed && do_reads(e))
                progress = true;
            if (progress)
                spin_until = 0;
            if (!e->op_failed && e->direct && coll_direct_step(e))
                progress = true;
            if (!e->op_failed && e->held && e->descs_received == e->t.n - 1) {
                if (e->diverted_by >= 0) {
                    do_writes(e); /* the forwarded descriptors first, as below */
                    char why[160];
                    snprintf(why, sizeof(why),
                             "%s seq %" PRIu64 " diverted: rank %d ran another divertible "
                             "operation",
                             pshard_coll_op_name(req->op.args.op), req->op.desc.seq,
                             e->diverted_by);
                    coll_complete(req, PSHARD_ERR_DIVERTED, why);
                    free_phases(e);
                    e->req = NULL;
                    return;
                }
                e->held = false; /* every descriptor matched: the data may go */
                progress = true;
            }
            while (!e->op_failed && !e->held && e->cur < e->nphases &&
                   phase_done(e, &e->phases[e->cur])) {
                e->cur++;
                if (e->cur < e->nphases)
                    enter_phase(e);
                progress = true;
            }
            if (!e->op_failed && !e->held && e->cur == e->nphases &&
                e->descs_received == e->t.n - 1 && (!e->direct || e->dstage == DS_COMPLETE) &&
                !take_pending_abort(e)) {
                if (e->inline_op)
                    coll_inline_finish(e);
                /* Forwarded descriptors may still be queued; they go out before anything of
                 * the next operation. */
                do_writes(e);
                coll_complete(req, PSHARD_OK, NULL);
                free_phases(e);
                e->req = NULL;
                return;
            }
        }
        if (e->op_failed)
            break;
        if (atomic_load(&e->t.comm->aborted)) {
            char why[PSHARD_ERRLEN] = "";
            pshard_status_t st = pshard_comm_error(e->t.comm, why, sizeof(why));
            if (st == PSHARD_OK) {
                st = PSHARD_ERR_ABORTED;
                ps_strlcpy(why, "aborted", sizeof(why));
            }
            coll_engine_fail_op(e, st, why, true);
            break;
        }
        int64_t now = ps_now_ns();
        if (e->next_lost_errno &&
            (now - e->next_lost_ns >= NEXT_LOST_GRACE_NS || !expecting_input(e))) {
            coll_engine_fail_errno(e, true, e->next_lost_errno);
            break;
        }
        if (now >= req->op.deadline_ns) {
            fail_timeout(e);
            break;
        }
        int waiting = e->read_blocked && expecting_input(e) ? e->t.prev
                      : e->write_blocked                    ? e->t.next
                                                            : -1;
        if (waiting != e->waiting_on) {
            e->waiting_on = waiting;
            coll_record_waiting(e->t.comm, &req->op, waiting);
        }
        /* Both sockets would block: do a slice of the local copy instead of sleeping. */
        if (!e->held && e->cur < e->nphases) {
            phase_t *ph = &e->phases[e->cur];
            if (ph->own_copied < ph->own_len) {
                size_t step = ph->own_len - ph->own_copied;
                step = step < OWN_COPY_SLICE ? step : OWN_COPY_SLICE;
                coll_buf_copy(ph->buf, ph->own_dst + ph->own_copied, ph->own_src, ph->own_copied,
                              step);
                ph->own_copied += step;
                continue;
            }
        }
        if (e->busy_poll_ns > 0) {
            /* Opt-in (PSHARD_BUSY_POLL_US): retry the non-blocking calls for a while before
             * sleeping in poll(2); pays off when every rank has a core of its own. */
            if (spin_until == 0)
                spin_until = now + e->busy_poll_ns;
            if (now < spin_until)
                continue;
        }
        spin_until = 0;
        struct pollfd pfds[3];
        int np = 0;
        pfds[np++] = (struct pollfd){e->t.wake_fd, POLLIN, 0};
        if (e->read_blocked)
            pfds[np++] = (struct pollfd){e->t.recv_fd, POLLIN, 0};
        if (e->write_blocked)
            pfds[np++] = (struct pollfd){e->t.send_fd, POLLOUT, 0};
        int64_t left_ms = (req->op.deadline_ns - now) / 1000000 + 1;
        int timeout = left_ms > 1000 ? 1000 : (int)left_ms;
        if ((e->next_lost_errno || (e->direct && e->dstage == DS_READ_FAILED)) && timeout > 20)
            timeout = 20;
        int pr = poll(pfds, (nfds_t)np, timeout);
        if (pr > 0 && (pfds[0].revents & POLLIN))
            drain_wake(e);
    }
    free_phases(e);
    e->req = NULL;
}

/* After a failure: fail whatever arrives with the sticky error, and for a short while keep
 * pushing out the abort notice so the peers learn why. */
static void fail_queued(engine_t *e)
{
    pshard_coll_req_t *r;
    while ((r = pop_request(e)) != NULL) {
        char msg[PSHARD_ERRLEN] = "";
        pshard_status_t st = pshard_comm_error(e->t.comm, msg, sizeof(msg));
        if (st == PSHARD_OK)
            ps_strlcpy(msg, "communicator failed", sizeof(msg));
        coll_complete(r, st != PSHARD_OK ? st : PSHARD_ERR_ABORTED, msg);
    }
}

static void *engine_main(void *arg)
{
    engine_t *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->t.qmu);
        bool stop = e->t.stop;
        pthread_mutex_unlock(&e->t.qmu);
        /* An abort queues its notice first, also when a destroy follows at once: an idle
         * rank's peers must learn why the ring ends, not just that its sockets closed. */
        if (!e->failed && atomic_load(&e->t.comm->aborted)) {
            e->failed = true;
            e->drain_until_ns = ps_now_ns() + DRAIN_NS;
            char msg[PSHARD_ERRLEN] = "";
            pshard_status_t st = pshard_comm_error(e->t.comm, msg, sizeof(msg));
            if (st == PSHARD_OK) {
                st = PSHARD_ERR_ABORTED;
                ps_strlcpy(msg, "aborted", sizeof(msg));
            }
            if (e->t.n > 1)
                coll_engine_queue_abort(e, (uint32_t)e->t.rank, st, msg, 0);
        }
        if (stop) {
            /* Push out what the ring still needs from us (forwarded descriptors, an abort
             * notice) before the sockets close. */
            int64_t until = ps_now_ns() + DRAIN_NS / 2;
            while (e->t.n > 1 && (e->of_active || !ps_queue_empty(&e->ctrl)) &&
                   !e->next_lost_errno && ps_now_ns() < until) {
                do_writes(e);
                if (e->write_blocked) {
                    struct pollfd pfd = {e->t.send_fd, POLLOUT, 0};
                    poll(&pfd, 1, 50);
                }
            }
            break;
        }
        if (e->failed) {
            fail_queued(e);
        } else {
            pshard_coll_req_t *r = pop_request(e);
            if (r) {
                coll_wait_here(e->t.comm);
                run_request(e, r);
                continue;
            }
        }
        bool flushing = e->t.n > 1 && (e->of_active || !ps_queue_empty(&e->ctrl)) &&
                        (!e->failed || ps_now_ns() < e->drain_until_ns);
        if (flushing)
            do_writes(e);
        struct pollfd pfds[2];
        int np = 0;
        pfds[np++] = (struct pollfd){e->t.wake_fd, POLLIN, 0};
        if (flushing && e->write_blocked)
            pfds[np++] = (struct pollfd){e->t.send_fd, POLLOUT, 0};
        int pr = poll(pfds, (nfds_t)np, flushing ? 50 : 1000);
        if (pr > 0 && (pfds[0].revents & POLLIN))
            drain_wake(e);
    }
    return NULL;
}

static void wake(engine_t *e)
{
    uint64_t one = 1;
    ssize_t w = write(e->t.wake_fd, &one, sizeof(one));
    (void)w;
}

/* ---------------------------------------------------------------------------------------- */
/* Backend entry points                                                                      */

static pshard_status_t tcp_connect(pshard_comm_t *comm, const pshard_comm_config_t *cfg, char *err,
                                   size_t errlen)
{
    engine_t *e = calloc(1, sizeof(*e));
    if (!e)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    tcp_t *t = &e->t;
    t->comm = comm;
    t->n = comm->world_size;
    t->rank = comm->rank;
    t->next = (t->rank + 1) % t->n;
    t->prev = (t->rank - 1 + t->n) % t->n;
    t->listen_fd = t->send_fd = t->recv_fd = -1;
    if (cfg->token) {
        t->keylen = strlen(cfg->token);
        if (t->keylen > sizeof(t->key)) {
            free(e);
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "the cluster token is longer than %zu bytes", sizeof(t->key));
        }
        memcpy(t->key, cfg->token, t->keylen);
    }
    pthread_mutex_init(&t->qmu, NULL);
    t->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    comm->impl = e;
    pshard_status_t rc = PSHARD_OK;
    if (t->wake_fd < 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "eventfd: %s", strerror(errno));
        goto fail;
    }
    const char *busy = getenv("PSHARD_BUSY_POLL_US");
    int64_t busy_us;
    if (busy && ps_parse_i64(busy, 0, 1000000, &busy_us) == 0)
        e->busy_poll_ns = busy_us * 1000;
    if (t->n > 1) {
        t->ring_cap = RING_CAP;
        t->conv_cap = CONV_CAP;
        e->inline_in = calloc((size_t)t->n, COLL_DESC_INLINE_MAX);
        if (!e->inline_in) {
            rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
            goto fail;
        }
        rc = tcp_connect_ring(t, cfg, err, errlen);
        if (rc != PSHARD_OK)
            goto fail;
        if (t->shm) {
            e->peer_desc = calloc((size_t)t->n, sizeof(coll_desc_t));
            e->peer_sbuf = calloc((size_t)t->n, sizeof(coll_buf_t));
            e->peer_rbuf = calloc((size_t)t->n, sizeof(coll_buf_t));
            if (!e->peer_desc || !e->peer_sbuf || !e->peer_rbuf) {
                rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
                goto fail;
            }
        }
    }
    if (pthread_create(&t->thread, NULL, engine_main, e) != 0) {
        rc = ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot start the engine thread");
        goto fail;
    }
    t->thread_started = true;
    return PSHARD_OK;
fail:
    comm->backend->destroy(comm);
    return rc;
}

static void tcp_submit(pshard_comm_t *comm, pshard_coll_req_t *req)
{
    engine_t *e = engine_of(comm);
    pthread_mutex_lock(&e->t.qmu);
    ps_queue_push(&e->t.queue, &req->node);
    pthread_mutex_unlock(&e->t.qmu);
    wake(e);
}

static void tcp_abort(pshard_comm_t *comm)
{
    engine_t *e = engine_of(comm);
    if (e->t.slots) {
        /* Fast-path waiters on every rank sleep on the slots, not on the ring. */
        char msg[PSHARD_ERRLEN] = "";
        pshard_status_t st = pshard_comm_error(comm, msg, sizeof(msg));
        coll_slots_abort(e->t.slots, st != PSHARD_OK ? st : PSHARD_ERR_ABORTED,
                         st != PSHARD_OK ? msg : "aborted");
    }
    wake(e);
}

/* Runs op through the slots (coll_slots.h), in the engine's thread or a caller's. */
static pshard_status_t slots_run(engine_t *e, coll_op_t *op, char *err, size_t errlen)
{
    pshard_comm_t *comm = e->t.comm;
    pshard_status_t rc = coll_slots_run(e->t.slots, e->t.shm, comm, op, err, errlen);
    if (rc != PSHARD_OK && rc != PSHARD_ERR_DIVERTED) {
        /* The communicator is done for, on every rank: the others learn it from the slots'
         * record, this rank's engine fails what is queued. */
        coll_set_sticky(comm, rc, err);
        coll_slots_abort(e->t.slots, rc, err);
        atomic_store(&comm->aborted, true);
        wake(e);
    }
    return rc;
}

/* A same-host ring whose slots every rank shares runs an operation the caller waits for at
 * once (pshard_coll_run) in the caller's thread: no hand-off to the engine and back. */
static bool tcp_here(const pshard_comm_t *comm, const coll_op_t *op, bool blocking)
{
    const engine_t *e = comm->impl;
    return blocking && coll_slots_takes(e->t.slots, op);
}

/* The slots divert (coll_slots_run), and so does a ring through the sockets (a divertible
 * operation holds its data until every descriptor matched); the engine's same-host path, which
 * lets the others read this rank's buffers as soon as they have its descriptor, does not. The
 * same on every rank (the transport's vote). */
static bool tcp_divertible(const pshard_comm_t *comm)
{
    const engine_t *e = comm->impl;
    return e->t.slots != NULL || !e->t.shm;
}

static pshard_status_t tcp_run_here(pshard_comm_t *comm, coll_op_t *op, char *err, size_t errlen)
{
    return slots_run(engine_of(comm), op, err, errlen);
}

static void tcp_destroy(pshard_comm_t *comm)
{
    engine_t *e = engine_of(comm);
    if (!e)
        return;
    tcp_t *t = &e->t;
    if (t->thread_started) {
        /* Anything still queued fails rather than hangs. */
        pthread_mutex_lock(&t->qmu);
        if (!ps_queue_empty(&t->queue)) {
            atomic_store(&comm->aborted, true);
            coll_set_sticky(comm, PSHARD_ERR_ABORTED, "communicator destroyed");
        }
        t->stop = true;
        pthread_mutex_unlock(&t->qmu);
        wake(e);
        pthread_join(t->thread, NULL);
        fail_queued(e);
    }
    /* Fast-path peers waiting on this rank learn it is gone now, not after the linger. */
    coll_slots_close(t->slots);
    /* Close gracefully: end our stream to next at once, then read and discard what prev still
     * sends until it closes too (or LINGER_MS passes). Closing a socket with unread data would
     * send a reset, and prev would report us lost instead of the failure we told the ring. */
    if (t->send_fd >= 0)
        shutdown(t->send_fd, SHUT_WR);
    if (t->recv_fd >= 0) {
        int64_t until = ps_now_ns() + (int64_t)LINGER_MS * 1000000;
        static uint8_t sink[65536];
        while (ps_now_ns() < until) {
            struct pollfd pfd = {t->recv_fd, POLLIN, 0};
            if (poll(&pfd, 1, 50) <= 0)
                continue;
            ssize_t r = recv(t->recv_fd, sink, sizeof(sink), MSG_DONTWAIT);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR))
                break;
        }
    }
    if (t->send_fd >= 0)
        close(t->send_fd);
    if (t->recv_fd >= 0)
        close(t->recv_fd);
    if (t->listen_fd >= 0)
        close(t->listen_fd);
    if (t->wake_fd >= 0)
        close(t->wake_fd);
    coll_engine_free_ctrl(e);
    free(e->of_ctrl);
    coll_slots_destroy(t->slots);
    coll_shm_destroy(t->shm);
    free(e->peer_desc);
    free(e->peer_sbuf);
    free(e->peer_rbuf);
    free(e->inline_in);
    free(t->ring);
    free(t->conv);
    pthread_mutex_destroy(&t->qmu);
    free(e);
    comm->impl = NULL;
}

static const char *tcp_transport(const pshard_comm_t *comm)
{
    const engine_t *e = comm->impl;
    return e && e->t.shm ? "shm" : "tcp";
}

const coll_backend_t coll_tcp_backend = {
    .name = "tcp",
    .transport = tcp_transport,
    .pieces = true,
    .bitwise = true,
    .connect = tcp_connect,
    .submit = tcp_submit,
    .abort = tcp_abort,
    .here = tcp_here,
    .run_here = tcp_run_here,
    .divertible = tcp_divertible,
    .destroy = tcp_destroy,
    .host_buffers = true,
};
