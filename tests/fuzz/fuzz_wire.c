/* libFuzzer target for the collectives wire decoders (coll_wire.h): every input goes to the
 * frame-header decoder, to every payload decoder, and through the receive path (header, then
 * the payload its type names). Each successful decode is re-encoded and decoded again; any
 * difference, a non-canonical encoding or unsanitised text aborts. Also linked with a
 * deterministic driver (fuzz_wire_replay.c) so gcc builds run it as a unit test. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll_wire.h"
#include "pshard/collectives.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* How many inputs each decoder accepted, indexed by coll_frame_type_t (0: frame header).
 * Read by the replay driver to prove that valid inputs reached every decoder. */
size_t fuzz_wire_accepted[COLL_FRAME_DONE + 1];

#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz_wire: check failed at line %d: %s\n", __LINE__, #cond);          \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

static void check_err_text(const char *err, size_t cap)
{
    /* A decoder's message is NUL-terminated within its buffer and non-empty on failure. */
    FUZZ_CHECK(memchr(err, '\0', cap) != NULL);
    FUZZ_CHECK(err[0] != '\0');
}

static void check_printable(const char *text, size_t cap)
{
    const char *end = memchr(text, '\0', cap);
    FUZZ_CHECK(end != NULL);
    for (const char *p = text; p < end; p++)
        FUZZ_CHECK(*p >= 0x20 && *p <= 0x7e);
}

static void fuzz_header(const uint8_t *data, size_t size)
{
    if (size < COLL_FRAME_HEADER_SIZE)
        return;
    coll_frame_header_t h;
    char err[256] = "";
    if (coll_frame_header_decode(data, &h, err, sizeof err) != PSHARD_OK) {
        check_err_text(err, sizeof err);
        return;
    }
    fuzz_wire_accepted[0]++;
    uint8_t again[COLL_FRAME_HEADER_SIZE];
    coll_frame_header_encode(&h, again);
    FUZZ_CHECK(memcmp(again, data, COLL_FRAME_HEADER_SIZE) == 0);
    coll_frame_header_t h2;
    FUZZ_CHECK(coll_frame_header_decode(again, &h2, NULL, 0) == PSHARD_OK);
    FUZZ_CHECK(h2.type == h.type && h2.flags == h.flags && h2.len == h.len && h2.seq == h.seq);
    FUZZ_CHECK(h.flags == 0 && h.type >= COLL_FRAME_HELLO && h.type <= COLL_FRAME_DONE);
}

static void fuzz_hello(const uint8_t *data, size_t size)
{
    coll_hello_t m;
    char err[256] = "";
    if (coll_hello_decode(data, size, &m, err, sizeof err) != PSHARD_OK) {
        check_err_text(err, sizeof err);
        return;
    }
    fuzz_wire_accepted[COLL_FRAME_HELLO]++;
    check_printable(m.comm_name, sizeof m.comm_name);
    uint8_t buf[512];
    size_t n = coll_hello_encode(&m, buf, sizeof buf);
    FUZZ_CHECK(n == size && memcmp(buf, data, n) == 0);
    coll_hello_t m2;
    FUZZ_CHECK(coll_hello_decode(buf, n, &m2, NULL, 0) == PSHARD_OK);
    FUZZ_CHECK(m2.version == m.version && m2.generation == m.generation &&
               m2.world_size == m.world_size && m2.from_rank == m.from_rank &&
               m2.to_rank == m.to_rank && memcmp(m2.nonce, m.nonce, COLL_NONCE_SIZE) == 0 &&
               strcmp(m2.comm_name, m.comm_name) == 0);

    /* The check and the MAC must accept anything the decoder does. */
    char check_err[256] = "";
    (void)coll_hello_check(&m, 7, 4, 1, "default", check_err, sizeof check_err);
    FUZZ_CHECK(memchr(check_err, '\0', sizeof check_err) != NULL);
    uint8_t mac1[COLL_MAC_SIZE], mac2[COLL_MAC_SIZE];
    coll_handshake_mac(data, size > 8 ? 8 : size, 'A', &m, m.nonce, mac1);
    coll_handshake_mac(data, size > 8 ? 8 : size, 'A', &m2, m2.nonce, mac2);
    FUZZ_CHECK(coll_mac_equal(mac1, mac2));
}

static void fuzz_challenge(const uint8_t *data, size_t size)
{
    coll_challenge_t m;
    char err[256] = "";
    if (coll_challenge_decode(data, size, &m, err, sizeof err) != PSHARD_OK) {
        check_err_text(err, sizeof err);
        return;
    }
    fuzz_wire_accepted[COLL_FRAME_CHALLENGE]++;
    uint8_t buf[128];
    size_t n = coll_challenge_encode(&m, buf, sizeof buf);
    FUZZ_CHECK(n == size && memcmp(buf, data, n) == 0);
    coll_challenge_t m2;
    FUZZ_CHECK(coll_challenge_decode(buf, n, &m2, NULL, 0) == PSHARD_OK);
    FUZZ_CHECK(memcmp(&m2, &m, sizeof m) == 0);
}

static void fuzz_auth(const uint8_t *data, size_t size)
{
    coll_auth_t m;
    char err[256] = "";
    if (coll_auth_decode(data, size, &m, err, sizeof err) != PSHARD_OK) {
        check_err_text(err, sizeof err);
        return;
    }
    fuzz_wire_accepted[COLL_FRAME_AUTH]++;
    uint8_t buf[64];
    size_t n = coll_auth_encode(&m, buf, sizeof buf);
    FUZZ_CHECK(n == size && memcmp(buf, data, n) == 0);
    coll_auth_t m2;
    FUZZ_CHECK(coll_auth_decode(buf, n, &m2, NULL, 0) == PSHARD_OK);
    FUZZ_CHECK(memcmp(&m2, &m, sizeof m) == 0);
}

static void fuzz_reject(const uint8_t *data, size_t size)
{
    static char reason[COLL_FRAME_MAX_CONTROL];
    char err[256] = "";
    if (coll_reject_decode(data, size, reason, sizeof reason, err, sizeof err) != PSHARD_OK) {
        check_err_text(err, sizeof err);
        return;
    }
    fuzz_wire_accepted[COLL_FRAME_REJECT]++;
    check_printable(reason, sizeof reason);
    FUZZ_CHECK(strlen(reason) + 2 == size); /* the buffer fits any valid reason */

    /* Small buffers truncate and stay terminated and printable. */
    char small[8];
    memset(small, 'x', sizeof small);
    FUZZ_CHECK(coll_reject_decode(data, size, small, sizeof small, NULL, 0) == PSHARD_OK);
    check_printable(small, sizeof small);
    FUZZ_CHECK(strncmp(small, reason, sizeof small - 1) == 0);
    FUZZ_CHECK(coll_reject_decode(data, size, NULL, 0, NULL, 0) == PSHARD_OK);

    static uint8_t buf[COLL_FRAME_MAX_CONTROL];
    static char reason2[COLL_FRAME_MAX_CONTROL];
    size_t n = coll_reject_encode(reason, buf, sizeof buf);
    FUZZ_CHECK(n == size);
    FUZZ_CHECK(coll_reject_decode(buf, n, reason2, sizeof reason2, NULL, 0) == PSHARD_OK);
    FUZZ_CHECK(strcmp(reason, reason2) == 0);
}

static void fuzz_desc(const uint8_t *data, size_t size)
{
    coll_desc_t m;
    char err[256] = "";
    if (coll_desc_decode(data, size, &m, err, sizeof err) != PSHARD_OK) {
        check_err_text(err, sizeof err);
        return;
    }
    fuzz_wire_accepted[COLL_FRAME_DESC]++;
    FUZZ_CHECK(m.inline_len <= COLL_DESC_INLINE_MAX);
    uint8_t buf[128 + COLL_DESC_INLINE_MAX];
    size_t n = coll_desc_encode(&m, buf, sizeof buf);
    FUZZ_CHECK(n == size && memcmp(buf, data, n) == 0);
    coll_desc_t m2;
    FUZZ_CHECK(coll_desc_decode(buf, n, &m2, NULL, 0) == PSHARD_OK);
    FUZZ_CHECK(coll_desc_same(&m, &m2) && m.rank_count == m2.rank_count &&
               m.send_addr == m2.send_addr && m.recv_addr == m2.recv_addr &&
               m.send_pieces == m2.send_pieces && m.recv_pieces == m2.recv_pieces &&
               m.send_pieces <= PSHARD_COLL_MAX_SEGS && m.recv_pieces <= PSHARD_COLL_MAX_SEGS &&
               m.inline_len == m2.inline_len &&
               memcmp(m.inline_data, m2.inline_data, m.inline_len) == 0);

    char text[256];
    coll_desc_format(&m, text, sizeof text);
    check_printable(text, sizeof text);
    char tiny[6];
    coll_desc_format(&m, tiny, sizeof tiny);
    FUZZ_CHECK(strlen(tiny) < sizeof tiny);
}

static void fuzz_abort(const uint8_t *data, size_t size)
{
    coll_abort_t m;
    char err[256] = "";
    if (coll_abort_decode(data, size, &m, err, sizeof err) != PSHARD_OK) {
        check_err_text(err, sizeof err);
        return;
    }
    fuzz_wire_accepted[COLL_FRAME_ABORT]++;
    check_printable(m.message, sizeof m.message);
    uint8_t buf[1024];
    size_t n = coll_abort_encode(&m, buf, sizeof buf);
    FUZZ_CHECK(n == size);
    coll_abort_t m2;
    FUZZ_CHECK(coll_abort_decode(buf, n, &m2, NULL, 0) == PSHARD_OK);
    FUZZ_CHECK(m2.origin_rank == m.origin_rank && m2.status == m.status &&
               strcmp(m2.message, m.message) == 0);
}

static void fuzz_peer(const uint8_t *data, size_t size)
{
    coll_peer_t m;
    char err[256] = "";
    if (coll_peer_decode(data, size, &m, err, sizeof err) != PSHARD_OK) {
        check_err_text(err, sizeof err);
        return;
    }
    fuzz_wire_accepted[COLL_FRAME_PEER]++;
    FUZZ_CHECK(m.pid != 0 && m.pid <= INT32_MAX);
    uint8_t buf[128];
    size_t n = coll_peer_encode(&m, buf, sizeof buf);
    FUZZ_CHECK(n == size && memcmp(buf, data, n) == 0);
}

static void fuzz_done(const uint8_t *data, size_t size)
{
    coll_done_t m;
    char err[256] = "";
    if (coll_done_decode(data, size, &m, err, sizeof err) != PSHARD_OK) {
        check_err_text(err, sizeof err);
        return;
    }
    fuzz_wire_accepted[COLL_FRAME_DONE]++;
    uint8_t buf[32];
    size_t n = coll_done_encode(&m, buf, sizeof buf);
    FUZZ_CHECK(n == size && memcmp(buf, data, n) == 0);
}

/* The receive path: a header, then (within what the input holds) the payload its type names. */
static void fuzz_framed(const uint8_t *data, size_t size)
{
    coll_frame_header_t h;
    if (size < COLL_FRAME_HEADER_SIZE || coll_frame_header_decode(data, &h, NULL, 0) != PSHARD_OK)
        return;
    const uint8_t *payload = data + COLL_FRAME_HEADER_SIZE;
    size_t avail = size - COLL_FRAME_HEADER_SIZE;
    size_t len = h.len < avail ? h.len : avail;
    switch (h.type) {
    case COLL_FRAME_HELLO:
        fuzz_hello(payload, len);
        break;
    case COLL_FRAME_CHALLENGE:
        fuzz_challenge(payload, len);
        break;
    case COLL_FRAME_AUTH:
        fuzz_auth(payload, len);
        break;
    case COLL_FRAME_REJECT:
        fuzz_reject(payload, len);
        break;
    case COLL_FRAME_DESC:
        fuzz_desc(payload, len);
        break;
    case COLL_FRAME_ABORT:
        fuzz_abort(payload, len);
        break;
    case COLL_FRAME_PEER:
        fuzz_peer(payload, len);
        break;
    case COLL_FRAME_DONE:
        fuzz_done(payload, len);
        break;
    default:
        break;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* Copy so that ASan sees the exact extent of the input (and no decoder can rely on
     * bytes past it). */
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy)
        return 0;
    if (size)
        memcpy(copy, data, size);

    fuzz_header(copy, size);
    fuzz_hello(copy, size);
    fuzz_challenge(copy, size);
    fuzz_auth(copy, size);
    fuzz_reject(copy, size);
    fuzz_desc(copy, size);
    fuzz_abort(copy, size);
    fuzz_peer(copy, size);
    fuzz_done(copy, size);
    fuzz_framed(copy, size);

    size_t counts[64];
    size_t ncounts = size / sizeof(size_t) < 64 ? size / sizeof(size_t) : 64;
    if (ncounts)
        memcpy(counts, copy, ncounts * sizeof(size_t));
    (void)coll_counts_hash(counts, ncounts);

    free(copy);
    return 0;
}
