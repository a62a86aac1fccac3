/* The tcp backend's wire format (see coll_wire.h): explicit little-endian encoders, decoders
 * that check every length before reading and refuse anything malformed, the HMAC handshake
 * proof and the HELLO check. Payload layouts (offsets in bytes):
 *   HELLO     (104) version u32 @0, generation u64 @4, world_size u32 @12, from_rank u32 @16,
 *                   to_rank u32 @20, nonce[16] @24, comm_name[64] @40 (printable, NUL-padded)
 *   CHALLENGE  (48) nonce[16] @0, mac[32] @16
 *   AUTH       (32) mac[32] @0
 *   REJECT (2 + n)  n u16 @0, reason bytes[n] @2 (n <= COLL_FRAME_MAX_CONTROL - 2)
 *   DESC       (72) seq u64 @0, op u8 @8, dtype u8 @9, reduce u8 @10, flags u8 @11 (0x01:
 *                   divertible; the other bits zero), root i32 @12,
 *                   tag u64 @16, total_count u64 @24, counts_hash u64 @32, rank_count u64 @40,
 *                   send_addr u64 @48, recv_addr u64 @56, send_pieces u32 @64,
 *                   recv_pieces u32 @68 (<= PSHARD_COLL_MAX_SEGS each), then up to
 *                   COLL_DESC_INLINE_MAX bytes of inline data (the rest of the payload)
 *   ABORT (10 + n)  origin_rank u32 @0, status i32 @4, n u16 @8, message bytes[n] @10 (n <= 511)
 *   PEER       (56) origin_rank u32 @0, pid u32 @4, pidns u64 @8, boot_id[16] @16,
 *                   probe_addr u64 @32, probe[16] @40
 *   DONE        (8) origin_rank u32 @0, value u32 @4
 */
#include "coll_wire.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "pshard/collectives.h"
#include "pshard/dtype.h"
#include "pshard/util.h"

#define HELLO_SIZE (40 + COLL_NAME_MAX + 1)
#define CHALLENGE_SIZE (COLL_NONCE_SIZE + COLL_MAC_SIZE)
#define AUTH_SIZE COLL_MAC_SIZE
#define DESC_SIZE 72
#define DESC_FLAG_DIVERT 0x01u
#define PEER_SIZE 56
#define DONE_SIZE 8
#define REJECT_MAX_TEXT (COLL_FRAME_MAX_CONTROL - 2)
#define ABORT_HEAD_SIZE 10
#define ABORT_MAX_TEXT (sizeof(((coll_abort_t *)0)->message) - 1)

/* The MAC's domain tag; the trailing NUL is part of the MAC input, separating it from the role
 * byte. Changing the handshake layout means changing this tag. */
static const char mac_domain_tag[] = "pshard-coll-v1";

static void put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* Two's complement reinterpretation without implementation-defined conversions. */
static int32_t i32_from_u32(uint32_t v)
{
    int32_t out;
    memcpy(&out, &v, sizeof out);
    return out;
}

static uint32_t u32_from_i32(int32_t v)
{
    uint32_t out;
    memcpy(&out, &v, sizeof out);
    return out;
}

static bool is_printable(uint8_t c)
{
    return c >= 0x20 && c <= 0x7e;
}

static const char *frame_type_name(unsigned type)
{
    switch (type) {
    case COLL_FRAME_HELLO:
        return "HELLO";
    case COLL_FRAME_CHALLENGE:
        return "CHALLENGE";
    case COLL_FRAME_AUTH:
        return "AUTH";
    case COLL_FRAME_ACCEPT:
        return "ACCEPT";
    case COLL_FRAME_REJECT:
        return "REJECT";
    case COLL_FRAME_DESC:
        return "DESC";
    case COLL_FRAME_DATA:
        return "DATA";
    case COLL_FRAME_ABORT:
        return "ABORT";
    case COLL_FRAME_PEER:
        return "PEER";
    case COLL_FRAME_DONE:
        return "DONE";
    }
    return "unknown";
}

static pshard_status_t bad_size(char *err, size_t errlen, const char *what, size_t len, size_t want)
{
    return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                   "%s payload is %zu bytes, expected %zu", what, len, want);
}

void coll_frame_header_encode(const coll_frame_header_t *h, uint8_t out[COLL_FRAME_HEADER_SIZE])
{
    put_u16(out, COLL_WIRE_MAGIC);
    out[2] = h->type;
    out[3] = h->flags;
    put_u32(out + 4, h->len);
    put_u64(out + 8, h->seq);
}

pshard_status_t coll_frame_header_decode(const uint8_t in[COLL_FRAME_HEADER_SIZE],
                                         coll_frame_header_t *h, char *err, size_t errlen)
{
    uint16_t magic = get_u16(in);
    if (magic != COLL_WIRE_MAGIC)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "bad frame magic 0x%04x (expected 0x%04x)", magic, COLL_WIRE_MAGIC);
    uint8_t type = in[2];
    if (type < COLL_FRAME_HELLO || type > COLL_FRAME_DONE)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown frame type %u", type);
    uint8_t flags = in[3];
    if (flags != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s frame has nonzero flags 0x%02x", frame_type_name(type), flags);
    uint32_t len = get_u32(in + 4);
    uint32_t limit = COLL_FRAME_MAX_CONTROL;
    if (type == COLL_FRAME_DATA)
        limit = COLL_FRAME_MAX_DATA;
    else if (type == COLL_FRAME_ACCEPT)
        limit = 0;
    if (len > limit)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s frame len %u exceeds its limit of %u bytes", frame_type_name(type), len,
                       limit);
    h->type = type;
    h->flags = flags;
    h->len = len;
    h->seq = get_u64(in + 8);
    return PSHARD_OK;
}

/* Writes the 104-byte HELLO; the name is cut at COLL_NAME_MAX bytes and NUL-padded. */
static void hello_write(const coll_hello_t *m, uint8_t out[HELLO_SIZE])
{
    put_u32(out, m->version);
    put_u64(out + 4, m->generation);
    put_u32(out + 12, m->world_size);
    put_u32(out + 16, m->from_rank);
    put_u32(out + 20, m->to_rank);
    memcpy(out + 24, m->nonce, COLL_NONCE_SIZE);
    size_t name_len = strnlen(m->comm_name, COLL_NAME_MAX);
    memset(out + 40, 0, COLL_NAME_MAX + 1);
    memcpy(out + 40, m->comm_name, name_len);
}

size_t coll_hello_encode(const coll_hello_t *m, uint8_t *out, size_t cap)
{
    if (cap < HELLO_SIZE)
        return 0;
    hello_write(m, out);
    return HELLO_SIZE;
}

pshard_status_t coll_hello_decode(const uint8_t *in, size_t len, coll_hello_t *m, char *err,
                                  size_t errlen)
{
    if (len != HELLO_SIZE)
        return bad_size(err, errlen, "HELLO", len, HELLO_SIZE);
    const uint8_t *name = in + 40;
    size_t name_len = 0;
    while (name_len <= COLL_NAME_MAX && name[name_len] != 0) {
        if (!is_printable(name[name_len]))
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "HELLO comm name has a non-printable byte 0x%02x at offset %zu",
                           name[name_len], name_len);
        name_len++;
    }
    if (name_len > COLL_NAME_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "HELLO comm name is not NUL-terminated within %d bytes", COLL_NAME_MAX + 1);
    for (size_t i = name_len; i <= COLL_NAME_MAX; i++) {
        if (name[i] != 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "HELLO comm name padding is not zero at offset %zu", i);
    }
    m->version = get_u32(in);
    m->generation = get_u64(in + 4);
    m->world_size = get_u32(in + 12);
    m->from_rank = get_u32(in + 16);
    m->to_rank = get_u32(in + 20);
    memcpy(m->nonce, in + 24, COLL_NONCE_SIZE);
    memcpy(m->comm_name, name, name_len);
    m->comm_name[name_len] = '\0';
    return PSHARD_OK;
}

size_t coll_challenge_encode(const coll_challenge_t *m, uint8_t *out, size_t cap)
{
    if (cap < CHALLENGE_SIZE)
        return 0;
    memcpy(out, m->nonce, COLL_NONCE_SIZE);
    memcpy(out + COLL_NONCE_SIZE, m->mac, COLL_MAC_SIZE);
    return CHALLENGE_SIZE;
}

pshard_status_t coll_challenge_decode(const uint8_t *in, size_t len, coll_challenge_t *m, char *err,
                                      size_t errlen)
{
    if (len != CHALLENGE_SIZE)
        return bad_size(err, errlen, "CHALLENGE", len, CHALLENGE_SIZE);
    memcpy(m->nonce, in, COLL_NONCE_SIZE);
    memcpy(m->mac, in + COLL_NONCE_SIZE, COLL_MAC_SIZE);
    return PSHARD_OK;
}

size_t coll_auth_encode(const coll_auth_t *m, uint8_t *out, size_t cap)
{
    if (cap < AUTH_SIZE)
        return 0;
    memcpy(out, m->mac, COLL_MAC_SIZE);
    return AUTH_SIZE;
}

pshard_status_t coll_auth_decode(const uint8_t *in, size_t len, coll_auth_t *m, char *err,
                                 size_t errlen)
{
    if (len != AUTH_SIZE)
        return bad_size(err, errlen, "AUTH", len, AUTH_SIZE);
    memcpy(m->mac, in, COLL_MAC_SIZE);
    return PSHARD_OK;
}

/* A reason longer than fits in a control frame is cut (it is informational); NULL is empty. */
size_t coll_reject_encode(const char *reason, uint8_t *out, size_t cap)
{
    size_t n = reason ? strnlen(reason, REJECT_MAX_TEXT) : 0;
    if (cap < 2 + n)
        return 0;
    put_u16(out, (uint16_t)n);
    memcpy(out + 2, reason ? reason : "", n);
    return 2 + n;
}

pshard_status_t coll_reject_decode(const uint8_t *in, size_t len, char *reason, size_t reason_len,
                                   char *err, size_t errlen)
{
    if (len < 2)
        return bad_size(err, errlen, "REJECT", len, 2);
    size_t n = get_u16(in);
    if (n > REJECT_MAX_TEXT)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "REJECT reason length %zu exceeds %u", n, (unsigned)REJECT_MAX_TEXT);
    if (len != 2 + n)
        return bad_size(err, errlen, "REJECT", len, 2 + n);
    if (reason && reason_len > 0)
        ps_copy_printable(reason, reason_len, in + 2, n);
    return PSHARD_OK;
}

size_t coll_desc_encode(const coll_desc_t *m, uint8_t *out, size_t cap)
{
    if (m->inline_len > COLL_DESC_INLINE_MAX || cap < DESC_SIZE + (size_t)m->inline_len)
        return 0;
    put_u64(out, m->seq);
    out[8] = m->op;
    out[9] = m->dtype;
    out[10] = m->reduce;
    out[11] = m->divert ? DESC_FLAG_DIVERT : 0;
    put_u32(out + 12, u32_from_i32(m->root));
    put_u64(out + 16, m->tag);
    put_u64(out + 24, m->total_count);
    put_u64(out + 32, m->counts_hash);
    put_u64(out + 40, m->rank_count);
    put_u64(out + 48, m->send_addr);
    put_u64(out + 56, m->recv_addr);
    put_u32(out + 64, m->send_pieces);
    put_u32(out + 68, m->recv_pieces);
    memcpy(out + DESC_SIZE, m->inline_data, m->inline_len);
    return DESC_SIZE + m->inline_len;
}

pshard_status_t coll_desc_decode(const uint8_t *in, size_t len, coll_desc_t *m, char *err,
                                 size_t errlen)
{
    if (len < DESC_SIZE || len > DESC_SIZE + COLL_DESC_INLINE_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "DESC payload is %zu bytes, expected %d to %d", len, DESC_SIZE,
                       DESC_SIZE + COLL_DESC_INLINE_MAX);
    uint8_t op = in[8], dtype = in[9], reduce = in[10];
    if (op < PSHARD_COLL_ALL_GATHER || op > PSHARD_COLL_ALL_TO_ALL)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "DESC has unknown op %u", op);
    if (dtype >= PSHARD_DTYPE_COUNT)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "DESC has unknown dtype %u",
                       dtype);
    if (reduce >= PSHARD_REDUCE_COUNT)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "DESC has unknown reduce %u",
                       reduce);
    if (in[11] & ~DESC_FLAG_DIVERT)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "DESC flags byte is 0x%02x; only 0x%02x (divertible) is defined", in[11],
                       DESC_FLAG_DIVERT);
    m->divert = in[11] & DESC_FLAG_DIVERT;
    m->seq = get_u64(in);
    m->op = op;
    m->dtype = dtype;
    m->reduce = reduce;
    m->root = i32_from_u32(get_u32(in + 12));
    m->tag = get_u64(in + 16);
    m->total_count = get_u64(in + 24);
    m->counts_hash = get_u64(in + 32);
    m->rank_count = get_u64(in + 40);
    m->send_addr = get_u64(in + 48);
    m->recv_addr = get_u64(in + 56);
    m->send_pieces = get_u32(in + 64);
    m->recv_pieces = get_u32(in + 68);
    if (m->send_pieces > PSHARD_COLL_MAX_SEGS || m->recv_pieces > PSHARD_COLL_MAX_SEGS)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "DESC names %u and %u buffer pieces; at most %d are allowed", m->send_pieces,
                       m->recv_pieces, PSHARD_COLL_MAX_SEGS);
    m->inline_len = (uint16_t)(len - DESC_SIZE);
    memcpy(m->inline_data, in + DESC_SIZE, m->inline_len);
    return PSHARD_OK;
}

size_t coll_peer_encode(const coll_peer_t *m, uint8_t *out, size_t cap)
{
    if (cap < PEER_SIZE)
        return 0;
    put_u32(out, m->origin_rank);
    put_u32(out + 4, m->pid);
    put_u64(out + 8, m->pidns);
    memcpy(out + 16, m->boot_id, 16);
    put_u64(out + 32, m->probe_addr);
    memcpy(out + 40, m->probe, 16);
    return PEER_SIZE;
}

pshard_status_t coll_peer_decode(const uint8_t *in, size_t len, coll_peer_t *m, char *err,
                                 size_t errlen)
{
    if (len != PEER_SIZE)
        return bad_size(err, errlen, "PEER", len, PEER_SIZE);
    m->origin_rank = get_u32(in);
    m->pid = get_u32(in + 4);
    if (m->pid == 0 || m->pid > INT32_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "PEER has pid %u", m->pid);
    m->pidns = get_u64(in + 8);
    memcpy(m->boot_id, in + 16, 16);
    m->probe_addr = get_u64(in + 32);
    memcpy(m->probe, in + 40, 16);
    return PSHARD_OK;
}

size_t coll_done_encode(const coll_done_t *m, uint8_t *out, size_t cap)
{
    if (cap < DONE_SIZE)
        return 0;
    put_u32(out, m->origin_rank);
    put_u32(out + 4, m->value);
    return DONE_SIZE;
}

pshard_status_t coll_done_decode(const uint8_t *in, size_t len, coll_done_t *m, char *err,
                                 size_t errlen)
{
    if (len != DONE_SIZE)
        return bad_size(err, errlen, "DONE", len, DONE_SIZE);
    m->origin_rank = get_u32(in);
    m->value = get_u32(in + 4);
    return PSHARD_OK;
}

size_t coll_abort_encode(const coll_abort_t *m, uint8_t *out, size_t cap)
{
    size_t n = strnlen(m->message, ABORT_MAX_TEXT);
    if (cap < ABORT_HEAD_SIZE + n)
        return 0;
    put_u32(out, m->origin_rank);
    put_u32(out + 4, u32_from_i32(m->status));
    put_u16(out + 8, (uint16_t)n);
    memcpy(out + ABORT_HEAD_SIZE, m->message, n);
    return ABORT_HEAD_SIZE + n;
}

pshard_status_t coll_abort_decode(const uint8_t *in, size_t len, coll_abort_t *m, char *err,
                                  size_t errlen)
{
    if (len < ABORT_HEAD_SIZE)
        return bad_size(err, errlen, "ABORT", len, ABORT_HEAD_SIZE);
    size_t n = get_u16(in + 8);
    if (n > ABORT_MAX_TEXT)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "ABORT message length %zu exceeds %zu", n, (size_t)ABORT_MAX_TEXT);
    if (len != ABORT_HEAD_SIZE + n)
        return bad_size(err, errlen, "ABORT", len, ABORT_HEAD_SIZE + n);
    int32_t status = i32_from_u32(get_u32(in + 4));
    if (status >= 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "ABORT carries status %d, expected an error (< 0)", (int)status);
    m->origin_rank = get_u32(in);
    m->status = status;
    ps_copy_printable(m->message, sizeof m->message, in + ABORT_HEAD_SIZE, n);
    return PSHARD_OK;
}

void coll_handshake_mac(const uint8_t *key, size_t keylen, char role, const coll_hello_t *hello,
                        const uint8_t acceptor_nonce[COLL_NONCE_SIZE], uint8_t mac[COLL_MAC_SIZE])
{
    uint8_t input[sizeof mac_domain_tag + 1 + HELLO_SIZE + COLL_NONCE_SIZE];
    size_t off = 0;
    memcpy(input, mac_domain_tag, sizeof mac_domain_tag);
    off += sizeof mac_domain_tag;
    input[off++] = (uint8_t)role;
    hello_write(hello, input + off);
    off += HELLO_SIZE;
    memcpy(input + off, acceptor_nonce, COLL_NONCE_SIZE);
    off += COLL_NONCE_SIZE;

    /* OpenSSL treats a NULL key as "reuse the previous key"; an empty key must be a real,
     * zero-length key, so pass a valid pointer. */
    static const uint8_t empty_key[1] = {0};
    unsigned int mac_len = 0;
    uint8_t *done = NULL;
    if (keylen <= INT_MAX)
        done = HMAC(EVP_sha256(), (keylen > 0 && key) ? key : empty_key, (int)keylen, input, off,
                    mac, &mac_len);
    if (!done || mac_len != COLL_MAC_SIZE) {
        /* Never expected. A fixed fallback (zeros) would let two failing peers agree without
         * knowing the token, so make the MAC unpredictable instead: the handshake then fails. */
        coll_random_nonce(mac);
        coll_random_nonce(mac + COLL_NONCE_SIZE);
    }
}

bool coll_mac_equal(const uint8_t a[COLL_MAC_SIZE], const uint8_t b[COLL_MAC_SIZE])
{
    return CRYPTO_memcmp(a, b, COLL_MAC_SIZE) == 0;
}

pshard_status_t coll_hello_check(const coll_hello_t *h, uint64_t generation, uint32_t world_size,
                                 uint32_t my_rank, const char *comm_name, char *err, size_t errlen)
{
    if (world_size == 0 || my_rank >= world_size)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "rank %u is outside a world of size %u", my_rank, world_size);
    const char *want_name = comm_name ? comm_name : "";
    if (h->version != COLL_WIRE_VERSION)
        return ps_errf(err, errlen, PSHARD_ERR_PERMISSION,
                       "peer speaks wire version %u, this rank speaks version %u", h->version,
                       COLL_WIRE_VERSION);
    if (h->generation < generation)
        return ps_errf(err, errlen, PSHARD_ERR_PERMISSION,
                       "stale generation %llu, this ring is generation %llu",
                       (unsigned long long)h->generation, (unsigned long long)generation);
    if (h->generation > generation)
        return ps_errf(err, errlen, PSHARD_ERR_PERMISSION,
                       "generation %llu is newer than this ring's generation %llu (this rank is "
                       "stale)",
                       (unsigned long long)h->generation, (unsigned long long)generation);
    if (strncmp(h->comm_name, want_name, COLL_NAME_MAX + 1) != 0)
        return ps_errf(err, errlen, PSHARD_ERR_PERMISSION,
                       "communicator name \"%.*s\" does not match this ring's \"%.*s\"",
                       COLL_NAME_MAX, h->comm_name, COLL_NAME_MAX, want_name);
    if (h->world_size != world_size)
        return ps_errf(err, errlen, PSHARD_ERR_PERMISSION,
                       "peer's world size is %u, this ring's is %u", h->world_size, world_size);
    if (h->to_rank != my_rank)
        return ps_errf(err, errlen, PSHARD_ERR_PERMISSION,
                       "HELLO meant for rank %u reached rank %u", h->to_rank, my_rank);
    uint32_t predecessor = (uint32_t)(((uint64_t)my_rank + world_size - 1) % world_size);
    if (h->from_rank != predecessor)
        return ps_errf(err, errlen, PSHARD_ERR_PERMISSION,
                       "HELLO from rank %u, but rank %u only accepts its ring predecessor rank %u",
                       h->from_rank, my_rank, predecessor);
    return PSHARD_OK;
}

/* Last resort when the kernel and OpenSSL both refuse randomness (never expected): a splitmix64
 * stream seeded from clocks, the pid and an address. Unpredictable enough to keep handshakes
 * from being replayed verbatim, not a cryptographic source. */
static void weak_random_fill(uint8_t *out, size_t n)
{
    struct timespec mono, wall;
    clock_gettime(CLOCK_MONOTONIC, &mono);
    clock_gettime(CLOCK_REALTIME, &wall);
    uint64_t state = (uint64_t)mono.tv_nsec ^ ((uint64_t)wall.tv_sec << 20) ^
                     ((uint64_t)wall.tv_nsec << 32) ^ (uint64_t)getpid() ^ (uint64_t)(uintptr_t)out;
    for (size_t i = 0; i < n; i++) {
        state += 0x9e3779b97f4a7c15ull;
        uint64_t z = state;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        out[i] = (uint8_t)(z ^ (z >> 31));
    }
}

void coll_random_nonce(uint8_t nonce[COLL_NONCE_SIZE])
{
    size_t got = 0;
    while (got < COLL_NONCE_SIZE) {
        ssize_t n = getrandom(nonce + got, COLL_NONCE_SIZE - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    if (got == COLL_NONCE_SIZE)
        return;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        got = 0;
        while (got < COLL_NONCE_SIZE) {
            ssize_t n = read(fd, nonce + got, COLL_NONCE_SIZE - got);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0)
                break;
            got += (size_t)n;
        }
        close(fd);
        if (got == COLL_NONCE_SIZE)
            return;
    }
    if (RAND_bytes(nonce, COLL_NONCE_SIZE) == 1)
        return;
    weak_random_fill(nonce, COLL_NONCE_SIZE);
}

uint64_t coll_counts_hash(const size_t *counts, size_t n)
{
    /* FNV-1a's constants, a count (not a byte) at a time: one multiply a rank, part of every
     * operation's set-up. Each step is a bijection, so lists that differ in one count differ. */
    uint64_t hash = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        hash ^= (uint64_t)counts[i];
        hash *= 0x100000001b3ull;
    }
    return hash;
}

bool coll_desc_same(const coll_desc_t *a, const coll_desc_t *b)
{
    return a->seq == b->seq && a->op == b->op && a->dtype == b->dtype && a->reduce == b->reduce &&
           a->root == b->root && a->tag == b->tag && a->total_count == b->total_count &&
           a->counts_hash == b->counts_hash;
}

const char *pshard_coll_op_name(pshard_coll_op_t op)
{
    switch (op) {
    case PSHARD_COLL_ALL_GATHER:
        return "all_gather";
    case PSHARD_COLL_REDUCE_SCATTER:
        return "reduce_scatter";
    case PSHARD_COLL_ALL_REDUCE:
        return "all_reduce";
    case PSHARD_COLL_BROADCAST:
        return "broadcast";
    case PSHARD_COLL_BARRIER:
        return "barrier";
    case PSHARD_COLL_REDUCE:
        return "reduce";
    case PSHARD_COLL_GATHER:
        return "gather";
    case PSHARD_COLL_SCATTER:
        return "scatter";
    case PSHARD_COLL_ALL_TO_ALL:
        return "all_to_all";
    }
    return "unknown";
}

/* Reducing ops also show sum/avg, broadcast shows its root: the fields a desync message needs
 * to explain itself. Output is truncated to len. */
void coll_desc_format(const coll_desc_t *d, char *buf, size_t len)
{
    if (!buf || len == 0)
        return;
    char op_text[24];
    const char *op = pshard_coll_op_name((pshard_coll_op_t)d->op);
    if (strcmp(op, "unknown") == 0) {
        snprintf(op_text, sizeof op_text, "op(%u)", (unsigned)d->op);
        op = op_text;
    }
    char dtype_text[24];
    if (d->dtype < PSHARD_DTYPE_COUNT)
        snprintf(dtype_text, sizeof dtype_text, "%s", pshard_dtype_name(d->dtype));
    else
        snprintf(dtype_text, sizeof dtype_text, "dtype(%u)", (unsigned)d->dtype);
    char extra[32] = "";
    if (d->op == PSHARD_COLL_REDUCE_SCATTER || d->op == PSHARD_COLL_ALL_REDUCE ||
        d->op == PSHARD_COLL_REDUCE) {
        if (d->reduce < PSHARD_REDUCE_COUNT)
            snprintf(extra, sizeof extra, " %s", pshard_reduce_name((pshard_reduce_t)d->reduce));
        else
            snprintf(extra, sizeof extra, " reduce(%u)", (unsigned)d->reduce);
    }
    if (d->op == PSHARD_COLL_BROADCAST ||
        (d->op >= PSHARD_COLL_REDUCE && d->op != PSHARD_COLL_ALL_TO_ALL)) {
        size_t used = strlen(extra);
        snprintf(extra + used, sizeof extra - used, " root %d", (int)d->root);
    }
    snprintf(buf, len, "%s seq %llu %s%s tag 0x%llx total %llu (this rank %llu, counts #%016llx)",
             op, (unsigned long long)d->seq, dtype_text, extra, (unsigned long long)d->tag,
             (unsigned long long)d->total_count, (unsigned long long)d->rank_count,
             (unsigned long long)d->counts_hash);
}
