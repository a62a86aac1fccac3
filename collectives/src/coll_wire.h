/* The tcp backend's wire format: 16-byte frame headers, the authenticated handshake (an HMAC
 * challenge keyed by the cluster token, stamped with the generation), operation descriptors and
 * abort notices. Pure encode/decode/validate functions with no I/O, so they are unit-tested and
 * fuzzed on their own. Everything on the wire is little-endian. Thread-safe (no state). */
#ifndef PSHARD_COLL_WIRE_H
#define PSHARD_COLL_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pshard/status.h"

#define COLL_WIRE_MAGIC 0x5350u /* bytes 'P' 'S' */
#define COLL_WIRE_VERSION 3u    /* 3: DESC's flags byte (divertible) */
#define COLL_FRAME_HEADER_SIZE 16
#define COLL_FRAME_MAX_DATA (4u << 20) /* largest DATA payload */
#define COLL_FRAME_MAX_CONTROL 4096u   /* largest payload of any other frame */
#define COLL_NONCE_SIZE 16
#define COLL_MAC_SIZE 32 /* HMAC-SHA256 */
#define COLL_NAME_MAX 63
#define COLL_DESC_INLINE_MAX 256 /* bytes of data a DESC may carry */

typedef enum {
    COLL_FRAME_HELLO = 1,     /* connector -> acceptor: who I am */
    COLL_FRAME_CHALLENGE = 2, /* acceptor -> connector: nonce + proof acceptor knows the token */
    COLL_FRAME_AUTH = 3,      /* connector -> acceptor: proof connector knows the token */
    COLL_FRAME_ACCEPT = 4,    /* acceptor -> connector: ring link established (empty payload) */
    COLL_FRAME_REJECT = 5,    /* either way: refused, with a reason; then close */
    COLL_FRAME_DESC = 6,      /* an operation's descriptor, sent to the next rank */
    COLL_FRAME_DATA = 7,      /* a piece of an operation's data stream */
    COLL_FRAME_ABORT = 8,     /* the communicator failed; forwarded around the ring */
    COLL_FRAME_PEER = 9,      /* after linking: a rank's process identity, around the ring */
    COLL_FRAME_DONE = 10,     /* a rank finished a phase (or its vote); around the ring */
} coll_frame_type_t;

typedef struct {
    uint8_t type;  /* coll_frame_type_t */
    uint8_t flags; /* 0 for now; nonzero is refused */
    uint32_t len;  /* payload bytes following the header */
    uint64_t seq;  /* operation sequence number (0 during the handshake) */
} coll_frame_header_t;

/* Writes the 16-byte header: magic u16, type u8, flags u8, len u32, seq u64. */
void coll_frame_header_encode(const coll_frame_header_t *h, uint8_t out[COLL_FRAME_HEADER_SIZE]);

/* Parses and validates a header: magic, known type, zero flags, len within the type's limit
 * (DATA <= COLL_FRAME_MAX_DATA, ACCEPT == 0, others <= COLL_FRAME_MAX_CONTROL). Errors:
 * PSHARD_ERR_INVALID_ARGUMENT with a message saying which field is wrong and its value. */
pshard_status_t coll_frame_header_decode(const uint8_t in[COLL_FRAME_HEADER_SIZE],
                                         coll_frame_header_t *h, char *err, size_t errlen);

typedef struct {
    uint32_t version;
    uint64_t generation;
    uint32_t world_size;
    uint32_t from_rank; /* the connector */
    uint32_t to_rank;   /* the acceptor it means to reach */
    uint8_t nonce[COLL_NONCE_SIZE];
    char comm_name[COLL_NAME_MAX + 1]; /* NUL-terminated, printable ASCII */
} coll_hello_t;

typedef struct {
    uint8_t nonce[COLL_NONCE_SIZE]; /* acceptor's nonce */
    uint8_t mac[COLL_MAC_SIZE];     /* coll_handshake_mac('A', ...) */
} coll_challenge_t;

typedef struct {
    uint8_t mac[COLL_MAC_SIZE]; /* coll_handshake_mac('C', ...) */
} coll_auth_t;

typedef struct {
    uint64_t seq;
    uint8_t op;     /* pshard_coll_op_t */
    uint8_t dtype;  /* pshard_dtype_t */
    uint8_t reduce; /* pshard_reduce_t */
    int32_t root;
    uint64_t tag;
    uint64_t total_count; /* elements across all ranks */
    uint64_t counts_hash; /* coll_counts_hash of the per-rank counts */
    uint64_t rank_count;  /* the sender's own count */
    /* Where the sender's send and recv buffers are in its address space, what same-host peers
     * read (coll_shm.h): the buffer itself when its pieces count is 0, else a table of that
     * many {u64 address, u64 bytes} pieces. 0 on a tcp ring. Not compared. */
    uint64_t send_addr, recv_addr;
    uint32_t send_pieces, recv_pieces;
    /* pshard_comm_divert_next marked it (its check is in tag): a mismatch between divertible
     * descriptors diverts the operation instead of failing it. Not compared by coll_desc_same
     * (a ring compares it too). */
    uint8_t divert;
    /* A small all-gather (or a barrier) travels in the descriptors themselves: the sender's
     * block, which every rank receives as the descriptor passes. Not compared. */
    uint16_t inline_len;
    uint8_t inline_data[COLL_DESC_INLINE_MAX];
} coll_desc_t;

/* A rank's process, for the same-host transport's test of whether the others can read its
 * memory (coll_shm.h): its pid in the pid namespace pidns, on the boot boot_id, and where a
 * secret only it holds lies. */
typedef struct {
    uint32_t origin_rank;
    uint32_t pid;
    uint64_t pidns;
    uint8_t boot_id[16];
    uint64_t probe_addr;
    uint8_t probe[16];
} coll_peer_t;

/* A rank finished phase `value` of the current operation, or (seq 0, during set-up) its vote. */
typedef struct {
    uint32_t origin_rank;
    uint32_t value;
} coll_done_t;

typedef struct {
    uint32_t origin_rank; /* the rank where the failure started */
    int32_t status;       /* pshard_status_t */
    char message[512];    /* NUL-terminated */
} coll_abort_t;

/* Payload encoders return the number of bytes written (at most cap), or 0 if cap is too small.
 * Decoders validate lengths and contents (NUL termination, printable names, known enum values)
 * and return PSHARD_ERR_INVALID_ARGUMENT with a message on malformed input. */
size_t coll_hello_encode(const coll_hello_t *m, uint8_t *out, size_t cap);
pshard_status_t coll_hello_decode(const uint8_t *in, size_t len, coll_hello_t *m, char *err,
                                  size_t errlen);
size_t coll_challenge_encode(const coll_challenge_t *m, uint8_t *out, size_t cap);
pshard_status_t coll_challenge_decode(const uint8_t *in, size_t len, coll_challenge_t *m, char *err,
                                      size_t errlen);
size_t coll_auth_encode(const coll_auth_t *m, uint8_t *out, size_t cap);
pshard_status_t coll_auth_decode(const uint8_t *in, size_t len, coll_auth_t *m, char *err,
                                 size_t errlen);
size_t coll_reject_encode(const char *reason, uint8_t *out, size_t cap);
/* Copies the (printable-sanitised) reason into reason[reason_len]. */
pshard_status_t coll_reject_decode(const uint8_t *in, size_t len, char *reason, size_t reason_len,
                                   char *err, size_t errlen);
size_t coll_desc_encode(const coll_desc_t *m, uint8_t *out, size_t cap);
pshard_status_t coll_desc_decode(const uint8_t *in, size_t len, coll_desc_t *m, char *err,
                                 size_t errlen);
size_t coll_peer_encode(const coll_peer_t *m, uint8_t *out, size_t cap);
pshard_status_t coll_peer_decode(const uint8_t *in, size_t len, coll_peer_t *m, char *err,
                                 size_t errlen);
size_t coll_done_encode(const coll_done_t *m, uint8_t *out, size_t cap);
pshard_status_t coll_done_decode(const uint8_t *in, size_t len, coll_done_t *m, char *err,
                                 size_t errlen);
size_t coll_abort_encode(const coll_abort_t *m, uint8_t *out, size_t cap);
pshard_status_t coll_abort_decode(const uint8_t *in, size_t len, coll_abort_t *m, char *err,
                                  size_t errlen);

/* HMAC-SHA256 keyed by the cluster token over a domain tag, the role byte ('A' acceptor proof,
 * 'C' connector proof), the encoded HELLO, and the acceptor's nonce. key may be empty. */
void coll_handshake_mac(const uint8_t *key, size_t keylen, char role, const coll_hello_t *hello,
                        const uint8_t acceptor_nonce[COLL_NONCE_SIZE], uint8_t mac[COLL_MAC_SIZE]);

/* Constant-time MAC comparison. */
bool coll_mac_equal(const uint8_t a[COLL_MAC_SIZE], const uint8_t b[COLL_MAC_SIZE]);

/* Checks a HELLO an acceptor received against what it expects: version, generation (message
 * says "stale generation G, this ring is generation H"), world size, comm name, to_rank ==
 * my_rank, from_rank == (my_rank - 1 + world) % world. PSHARD_ERR_PERMISSION with a message. */
pshard_status_t coll_hello_check(const coll_hello_t *h, uint64_t generation, uint32_t world_size,
                                 uint32_t my_rank, const char *comm_name, char *err, size_t errlen);

/* Fills a nonce from getrandom(2) (falls back to /dev/urandom). */
void coll_random_nonce(uint8_t nonce[COLL_NONCE_SIZE]);

/* A hash of counts[0..n) (what counts_hash holds): FNV-1a's step a count at a time. */
uint64_t coll_counts_hash(const size_t *counts, size_t n);

/* True when two descriptors describe the same operation (every field but rank_count and the
 * buffer addresses). */
bool coll_desc_same(const coll_desc_t *a, const coll_desc_t *b);

/* "all_gather seq 418 fp32 tag 0x2a total 1024 (this rank 256, counts #9c3a...)". */
void coll_desc_format(const coll_desc_t *d, char *buf, size_t len);

#endif
