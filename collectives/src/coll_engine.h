/* The tcp backend's engine state (coll_tcp.c), shared with the paths that skip the ring's data
 * streams (coll_direct.c): operations small enough to travel in the descriptors, and the
 * same-host transport's reads of the other ranks' memory. Everything here runs on the
 * communicator's engine thread. */
#ifndef PSHARD_COLL_ENGINE_H
#define PSHARD_COLL_ENGINE_H

#include "coll_tcp.h"

#define MAX_PHASES 2
#define DRAIN_NS (2000000000LL) /* after a failure: keep pushing the abort notice out this long */
#define NEXT_LOST_GRACE_NS (300000000LL) /* a send failed: wait for an abort notice first */

typedef enum { PH_AG, PH_RS, PH_BCAST } phase_kind_t;

typedef struct ctrl_frame {
    ps_qnode_t node;
    size_t len;
    uint8_t buf[COLL_FRAME_HEADER_SIZE + COLL_FRAME_MAX_CONTROL];
} ctrl_frame_t;

/* A position in a reduce-scatter stream: item (round j, block k) starting at `start`. */
typedef struct {
    size_t j, k, start, len;
} rs_cur_t;

/* One phase of an operation: the byte stream sent to next and the one received from prev. */
typedef struct {
    phase_kind_t kind;
    coll_buf_t *buf;              /* AG/BCAST: the output buffer; RS: unused */
    coll_buf_t *src;              /* RS: the local input (dtype) */
    coll_buf_t *dst;              /* RS: the buffer this rank's reduced chunk goes to (dtype), */
    uint64_t dst_off;             /* ... from this byte on */
    size_t *in_chunk, *out_chunk; /* chunk id of each block */
    size_t *in_off, *out_off;     /* block start offsets in the stream, nblocks + 1 entries */
    size_t nblocks;
    size_t in_total, out_total;
    size_t in_recv, in_done, out_sent;
    size_t in_k, out_k; /* block cursors */
    /* RS streams are ordered in rounds: round j carries slice j of every block, so a rank
     * never needs more than about two rounds of window to keep the ring moving (a plain
     * block order deadlocks once a block outgrows the window plus the socket buffers). */
    size_t slice, rounds;
    rs_cur_t o, fw, pr; /* out cursor, its forwarded in-item, processing cursor */
    size_t conv_round;  /* round whose input slice sits converted in conv (SIZE_MAX: none) */
    /* AG out of place: this rank's block is sent straight from the caller's input and copied
     * into the output in slices while the sockets would block, instead of one serial memmove
     * before anything is sent (64 MiB at 128 MiB n=2: about a fifth of the operation). */
    coll_buf_t *own_src; /* NULL: none; else its first own_len bytes go to buf at own_dst */
    uint64_t own_dst;
    size_t own_len, own_copied;
} phase_t;

typedef struct engine {
    tcp_t t; /* first: coll_tcp_conn.c sees only this part */

    /* Link state that outlives single operations. */
    ps_queue_t ctrl; /* ctrl_frame_t to send before the next data frame */
    bool of_active, of_is_data, of_zero_pad;
    uint8_t of_hdr[COLL_FRAME_HEADER_SIZE];
    size_t of_hdr_off;
    const uint8_t *of_payload;
    size_t of_len, of_off;
    ctrl_frame_t *of_ctrl;
    phase_t *of_phase; /* the phase whose out stream a DATA frame belongs to */

    uint8_t if_hdr[COLL_FRAME_HEADER_SIZE];
    size_t if_hdr_off;
    bool if_have_hdr;
    coll_frame_header_t if_h;
    size_t if_off;
    uint8_t if_ctrl[COLL_FRAME_MAX_CONTROL];

    bool failed;
    int64_t drain_until_ns;
    int next_lost_errno;  /* a send to next failed with this errno (0: none) */
    int64_t next_lost_ns; /* when */

    /* The running operation. */
    pshard_coll_req_t *req;
    phase_t phases[MAX_PHASES];
    size_t nphases, cur;
    size_t esize, asize;
    size_t *bytes; /* per-chunk byte sizes for the current phase kind */
    size_t *displ; /* per-chunk byte offsets */
    int descs_received;
    /* A divertible operation (desc.divert) sends no data until every descriptor came and
     * matched (held); diverted_by is the first rank whose divertible descriptor differed, and
     * the operation then ends DIVERTED once all descriptors came, having moved nothing. */
    bool held;
    int diverted_by;
    bool op_failed;
    bool read_blocked, write_blocked;
    int waiting_on;
    double scale;         /* 1/n for avg (as a float, 1.0f/n exactly for n <= 2^20), else 1 */
    int64_t busy_poll_ns; /* PSHARD_BUSY_POLL_US; 0: sleep in poll(2) at once */

    /* The same-host transport (t.shm): the running operation reads the other ranks' buffers
     * (their descriptors give the addresses) instead of streaming through the sockets, then
     * says so around the ring with DONE notices; it completes once every rank has said it
     * finished reading, so no buffer is let go while another rank may still read it. */
    bool direct;
    int dstage;             /* DS_* */
    int dfinal;             /* the phase its last DONE carries: 1, or 2 for all-reduce */
    int done_seen[3];       /* DONE notices received, by phase */
    int dk;                 /* read cursor: the k-th other rank (rank + k) */
    size_t doff;            /* ... and the bytes (elements for a reduction) done of its chunk */
    coll_desc_t *peer_desc; /* by rank: its descriptor, with its buffers' addresses */
    coll_buf_t *peer_sbuf, *peer_rbuf; /* by rank: its buffers, fetched at the first read */
    bool peer_bufs;                    /* fetched for the running operation */
    bool inline_op;                    /* the running operation's data travels in the descriptors */
    uint8_t *inline_in; /* by rank: COLL_DESC_INLINE_MAX bytes of an inline reduction's input */
    bool abort_waiting; /* an abort notice is next on the socket: read it (take_pending_abort) */
    /* A read of another rank's memory failed: its error, kept for a grace period in which the
     * ring's abort notice (the real cause: that rank gave up) may still arrive. */
    pshard_status_t read_failed;
    int64_t read_failed_ns;
    char read_failed_msg[PSHARD_ERRLEN];
} engine_t;

enum { DS_DESCS, DS_READ1, DS_WAIT1, DS_READ2, DS_WAIT_FINAL, DS_COMPLETE, DS_READ_FAILED };

/* coll_engine.c: control frames and failing, used by both paths. */
/* Queues a control frame (sent before the next data frame); out of memory drops it. */
void coll_engine_queue_ctrl(engine_t *e, uint8_t type, uint64_t seq, const uint8_t *payload,
                            size_t len);
/* Fails the running operation with st and msg (once), telling the ring when originate. */
void coll_engine_fail_op(engine_t *e, pshard_status_t st, const char *msg, bool originate);
/* Fails it because the previous rank broke the protocol (what it did, in what). */
void coll_engine_fail_protocol(engine_t *e, const char *what);
/* Fails it because a send to (sending) or receive from the previous rank failed with err_no. */
void coll_engine_fail_errno(engine_t *e, bool sending, int err_no);
/* Queues an abort notice of origin (forwarded, or this rank's own). */
void coll_engine_queue_abort(engine_t *e, uint32_t origin, pshard_status_t status, const char *msg,
                             uint64_t seq);
/* Drops the control frames not yet sent (the link is gone, or the engine is). */
void coll_engine_free_ctrl(engine_t *e);
/* Resets the per-operation state for e->req. */
void coll_engine_op_init(engine_t *e);

/* coll_direct.c. Inline operations: coll_inline_is says whether the request's data travels in
 * the descriptors (the same on every rank); coll_inline_bytes, how much rank's descriptor
 * carries; coll_inline_setup puts this rank's in; coll_inline_finish reduces once every
 * descriptor came. */
bool coll_inline_is(const engine_t *e, const coll_op_t *op);
size_t coll_inline_bytes(const engine_t *e, const coll_op_t *op, int rank);
void coll_inline_setup(engine_t *e);
void coll_inline_finish(engine_t *e);

/* The same-host transport: coll_direct_is says whether the request reads the other ranks'
 * memory; coll_direct_setup publishes this rank's buffers in its descriptor; coll_direct_step
 * moves the operation on by one piece of work (true when it did); coll_direct_done takes a
 * DONE notice; coll_direct_free drops what the operation read of the others' piece tables. */
bool coll_direct_is(const engine_t *e, const coll_op_t *op);
void coll_direct_setup(engine_t *e);
bool coll_direct_step(engine_t *e);
void coll_direct_done(engine_t *e);
void coll_direct_free(engine_t *e);

#endif
