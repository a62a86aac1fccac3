/* Unit tests for the tcp backend's wire format (coll_wire.h): frame headers and each of their
 * rejections, every payload's round trip and malformed variants, the handshake MAC (pinned
 * against an independent HMAC over the documented layout), coll_hello_check's refusals, the
 * counts hash and descriptor comparison/formatting. */
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdint.h>
#include <string.h>

#include "coll_wire.h"
#include "ps_test.h"
#include "pshard/collectives.h"

static coll_frame_header_t header(uint8_t type, uint32_t len, uint64_t seq)
{
    coll_frame_header_t h = {.type = type, .flags = 0, .len = len, .seq = seq};
    return h;
}

static pshard_status_t decode_header(const uint8_t *buf, coll_frame_header_t *h, char *err,
                                     size_t errlen)
{
    err[0] = '\0';
    return coll_frame_header_decode(buf, h, err, errlen);
}

static void test_header_round_trip(void)
{
    coll_frame_header_t h = header(COLL_FRAME_DESC, 48, 0x0102030405060708ull), back;
    uint8_t buf[COLL_FRAME_HEADER_SIZE];
    coll_frame_header_encode(&h, buf);
    /* Explicit little-endian layout: magic 'P' 'S', type, flags, len, seq. */
    const uint8_t want[COLL_FRAME_HEADER_SIZE] = {'P', 'S', 6, 0, 48, 0, 0, 0,
                                                  8,   7,   6, 5, 4,  3, 2, 1};
    CU_ASSERT(memcmp(buf, want, sizeof want) == 0);
    char err[128];
    CU_ASSERT_EQUAL(decode_header(buf, &back, err, sizeof err), PSHARD_OK);
    CU_ASSERT_EQUAL(back.type, COLL_FRAME_DESC);
    CU_ASSERT_EQUAL(back.flags, 0);
    CU_ASSERT_EQUAL(back.len, 48);
    CU_ASSERT_EQUAL(back.seq, 0x0102030405060708ull);

    /* Every type at its limit is accepted. */
    for (uint8_t t = COLL_FRAME_HELLO; t <= COLL_FRAME_ABORT; t++) {
        uint32_t limit = t == COLL_FRAME_DATA     ? COLL_FRAME_MAX_DATA
                         : t == COLL_FRAME_ACCEPT ? 0
                                                  : COLL_FRAME_MAX_CONTROL;
        h = header(t, limit, UINT64_MAX);
        coll_frame_header_encode(&h, buf);
        CU_ASSERT_EQUAL(decode_header(buf, &back, err, sizeof err), PSHARD_OK);
        CU_ASSERT_EQUAL(back.len, limit);
        CU_ASSERT_EQUAL(back.seq, UINT64_MAX);
    }
}

static void test_header_rejections(void)
{
    uint8_t buf[COLL_FRAME_HEADER_SIZE];
    coll_frame_header_t h = header(COLL_FRAME_HELLO, 10, 0), out;
    char err[128];

    coll_frame_header_encode(&h, buf);
    buf[0] = 'X';
    CU_ASSERT_EQUAL(decode_header(buf, &out, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "magic"));
    buf[0] = 'S';
    buf[1] = 'P'; /* byte-swapped magic */
    CU_ASSERT_EQUAL(decode_header(buf, &out, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);

    const uint8_t bad_types[] = {0, 11, 200, 255};
    for (size_t i = 0; i < sizeof bad_types; i++) {
        h = header(bad_types[i], 0, 0);
        coll_frame_header_encode(&h, buf);
        CU_ASSERT_EQUAL(decode_header(buf, &out, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
        CU_ASSERT_PTR_NOT_NULL(strstr(err, "unknown frame type"));
    }

    h = header(COLL_FRAME_DATA, 5, 0);
    h.flags = 1;
    coll_frame_header_encode(&h, buf);
    CU_ASSERT_EQUAL(decode_header(buf, &out, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "flags"));

    h = header(COLL_FRAME_DATA, COLL_FRAME_MAX_DATA + 1, 0);
    coll_frame_header_encode(&h, buf);
    CU_ASSERT_EQUAL(decode_header(buf, &out, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "DATA"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "4194305"));

    for (uint8_t t = COLL_FRAME_HELLO; t <= COLL_FRAME_ABORT; t++) {
        if (t == COLL_FRAME_DATA || t == COLL_FRAME_ACCEPT)
            continue;
        h = header(t, COLL_FRAME_MAX_CONTROL + 1, 0);
        coll_frame_header_encode(&h, buf);
        CU_ASSERT_EQUAL(decode_header(buf, &out, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
        h = header(t, UINT32_MAX, 0);
        coll_frame_header_encode(&h, buf);
        CU_ASSERT_EQUAL(decode_header(buf, &out, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    }

    h = header(COLL_FRAME_ACCEPT, 1, 0); /* ACCEPT carries no payload */
    coll_frame_header_encode(&h, buf);
    CU_ASSERT_EQUAL(decode_header(buf, &out, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "ACCEPT"));

    /* err may be NULL. */
    CU_ASSERT_EQUAL(coll_frame_header_decode(buf, &out, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
}

static coll_hello_t sample_hello(void)
{
    coll_hello_t m;
    memset(&m, 0, sizeof m);
    m.version = COLL_WIRE_VERSION;
    m.generation = 7;
    m.world_size = 4;
    m.from_rank = 0;
    m.to_rank = 1;
    for (int i = 0; i < COLL_NONCE_SIZE; i++)
        m.nonce[i] = (uint8_t)(0xa0 + i);
    memcpy(m.comm_name, "default", 8);
    return m;
}

static void test_hello_round_trip_and_rejections(void)
{
    coll_hello_t m = sample_hello(), back;
    uint8_t buf[256];
    char err[128] = "";
    size_t n = coll_hello_encode(&m, buf, sizeof buf);
    CU_ASSERT_EQUAL(n, 104);
    CU_ASSERT_EQUAL(coll_hello_encode(&m, buf, n - 1), 0);
    CU_ASSERT_EQUAL(buf[4], 7); /* generation u64 LE at 4 */
    CU_ASSERT_EQUAL(buf[40], 'd');
    CU_ASSERT_EQUAL(coll_hello_decode(buf, n, &back, err, sizeof err), PSHARD_OK);
    CU_ASSERT_EQUAL(back.version, m.version);
    CU_ASSERT_EQUAL(back.generation, m.generation);
    CU_ASSERT_EQUAL(back.world_size, m.world_size);
    CU_ASSERT_EQUAL(back.from_rank, m.from_rank);
    CU_ASSERT_EQUAL(back.to_rank, m.to_rank);
    CU_ASSERT(memcmp(back.nonce, m.nonce, COLL_NONCE_SIZE) == 0);
    CU_ASSERT_STRING_EQUAL(back.comm_name, "default");

    /* Longest name (63 chars) and empty name. */
    memset(m.comm_name, 'n', COLL_NAME_MAX);
    m.comm_name[COLL_NAME_MAX] = '\0';
    n = coll_hello_encode(&m, buf, sizeof buf);
    CU_ASSERT_EQUAL(coll_hello_decode(buf, n, &back, err, sizeof err), PSHARD_OK);
    CU_ASSERT_EQUAL(strlen(back.comm_name), COLL_NAME_MAX);
    m.comm_name[0] = '\0';
    n = coll_hello_encode(&m, buf, sizeof buf);
    CU_ASSERT_EQUAL(coll_hello_decode(buf, n, &back, err, sizeof err), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(back.comm_name, "");

    m = sample_hello();
    n = coll_hello_encode(&m, buf, sizeof buf);
    /* Truncated and overlong payloads. */
    for (size_t len = 0; len < n; len += 13)
        CU_ASSERT_EQUAL(coll_hello_decode(buf, len, &back, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(coll_hello_decode(buf, n - 1, &back, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(coll_hello_decode(buf, n + 1, &back, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);

    /* Non-printable name byte. */
    buf[42] = 0x07;
    err[0] = '\0';
    CU_ASSERT_EQUAL(coll_hello_decode(buf, n, &back, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "non-printable"));
    buf[42] = 0xc3;
    CU_ASSERT_EQUAL(coll_hello_decode(buf, n, &back, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
    buf[42] = 'f';

    /* Unterminated name (64 printable bytes). */
    memset(buf + 40, 'x', 64);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coll_hello_decode(buf, n, &back, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "NUL"));

    /* Garbage after the terminator. */
    n = coll_hello_encode(&m, buf, sizeof buf);
    buf[40 + 63] = 'z';
    CU_ASSERT_EQUAL(coll_hello_decode(buf, n, &back, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
}

static void test_challenge_auth_round_trip(void)
{
    coll_challenge_t c, cb;
    coll_auth_t a, ab;
    for (int i = 0; i < COLL_NONCE_SIZE; i++)
        c.nonce[i] = (uint8_t)i;
    for (int i = 0; i < COLL_MAC_SIZE; i++)
        c.mac[i] = a.mac[i] = (uint8_t)(0xff - i);
    uint8_t buf[128];
    size_t n = coll_challenge_encode(&c, buf, sizeof buf);
    CU_ASSERT_EQUAL(n, COLL_NONCE_SIZE + COLL_MAC_SIZE);
    CU_ASSERT_EQUAL(coll_challenge_encode(&c, buf, n - 1), 0);
    CU_ASSERT_EQUAL(coll_challenge_decode(buf, n, &cb, NULL, 0), PSHARD_OK);
    CU_ASSERT(memcmp(&c, &cb, sizeof c) == 0);
    CU_ASSERT_EQUAL(coll_challenge_decode(buf, n - 1, &cb, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(coll_challenge_decode(buf, n + 1, &cb, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(coll_challenge_decode(buf, 0, &cb, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);

    n = coll_auth_encode(&a, buf, sizeof buf);
    CU_ASSERT_EQUAL(n, COLL_MAC_SIZE);
    CU_ASSERT_EQUAL(coll_auth_encode(&a, buf, n - 1), 0);
    CU_ASSERT_EQUAL(coll_auth_decode(buf, n, &ab, NULL, 0), PSHARD_OK);
    CU_ASSERT(memcmp(&a, &ab, sizeof a) == 0);
    char err[128] = "";
    CU_ASSERT_EQUAL(coll_auth_decode(buf, n - 1, &ab, err, sizeof err),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "AUTH"));
    CU_ASSERT_EQUAL(coll_auth_decode(buf, n + 1, &ab, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
}

static void test_reject_round_trip_and_sanitising(void)
{
    uint8_t buf[COLL_FRAME_MAX_CONTROL + 16];
    char reason[256];
    size_t n = coll_reject_encode("stale generation 3", buf, sizeof buf);
    CU_ASSERT_EQUAL(n, 2 + 18);
    CU_ASSERT_EQUAL(coll_reject_encode("stale generation 3", buf, n - 1), 0);
    CU_ASSERT_EQUAL(coll_reject_decode(buf, n, reason, sizeof reason, NULL, 0), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(reason, "stale generation 3");

    /* Empty and NULL reasons are two bytes. */
    CU_ASSERT_EQUAL(coll_reject_encode("", buf, sizeof buf), 2);
    CU_ASSERT_EQUAL(coll_reject_encode(NULL, buf, sizeof buf), 2);
    CU_ASSERT_EQUAL(coll_reject_decode(buf, 2, reason, sizeof reason, NULL, 0), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(reason, "");

    /* Control and high bytes (and an embedded NUL) become '?'. */
    const uint8_t dirty[] = {5, 0, 'a', '\n', 0, 0xff, 'b'};
    CU_ASSERT_EQUAL(coll_reject_decode(dirty, sizeof dirty, reason, sizeof reason, NULL, 0),
                    PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(reason, "a???b");
    /* A small buffer truncates. */
    CU_ASSERT_EQUAL(coll_reject_decode(dirty, sizeof dirty, reason, 3, NULL, 0), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(reason, "a?");

    /* Length mismatches either way. */
    CU_ASSERT_EQUAL(coll_reject_decode(dirty, sizeof dirty - 1, reason, sizeof reason, NULL, 0),
                    PSHARD_ERR_INVALID_ARGUMENT);
    const uint8_t longer[] = {1, 0, 'a', 'b'};
    CU_ASSERT_EQUAL(coll_reject_decode(longer, sizeof longer, reason, sizeof reason, NULL, 0),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(coll_reject_decode(longer, 1, reason, sizeof reason, NULL, 0),
                    PSHARD_ERR_INVALID_ARGUMENT);
    const uint8_t huge[] = {0xff, 0xff};
    CU_ASSERT_EQUAL(coll_reject_decode(huge, sizeof huge, reason, sizeof reason, NULL, 0),
                    PSHARD_ERR_INVALID_ARGUMENT);

    /* An over-long reason is cut to fit a control frame. */
    static char big[COLL_FRAME_MAX_CONTROL * 2];
    memset(big, 'r', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    n = coll_reject_encode(big, buf, sizeof buf);
    CU_ASSERT_EQUAL(n, COLL_FRAME_MAX_CONTROL);
    CU_ASSERT_EQUAL(coll_reject_decode(buf, n, NULL, 0, NULL, 0), PSHARD_OK);
}

static coll_desc_t sample_desc(void)
{
    coll_desc_t d = {.seq = 418,
                     .op = PSHARD_COLL_ALL_GATHER,
                     .dtype = PSHARD_FP32,
                     .reduce = PSHARD_REDUCE_SUM,
                     .root = -1,
                     .tag = 0x2a,
                     .total_count = 1024,
                     .counts_hash = 0x9c3a000000000001ull,
                     .rank_count = 256,
                     .send_addr = 0x7f0012345000ull,
                     .recv_addr = 0x7f0067890000ull,
                     .send_pieces = 12,
                     .recv_pieces = 0};
    return d;
}

#define DESC_BUF (72 + COLL_DESC_INLINE_MAX + 16)

static void test_desc_round_trip_and_rejections(void)
{
    coll_desc_t d = sample_desc(), back;
    d.tag = 0x8877665544332211ull;
    d.root = INT32_MIN;
    uint8_t buf[128];
    size_t n = coll_desc_encode(&d, buf, sizeof buf);
    CU_ASSERT_EQUAL(n, 72);
    CU_ASSERT_EQUAL(coll_desc_encode(&d, buf, n - 1), 0);
    CU_ASSERT_EQUAL(buf[16], 0x11); /* tag LE */
    CU_ASSERT_EQUAL(coll_desc_decode(buf, n, &back, NULL, 0), PSHARD_OK);
    CU_ASSERT(coll_desc_same(&d, &back));
    CU_ASSERT_EQUAL(back.rank_count, d.rank_count);
    CU_ASSERT_EQUAL(back.send_addr, d.send_addr);
    CU_ASSERT_EQUAL(back.recv_addr, d.recv_addr);
    CU_ASSERT_EQUAL(back.send_pieces, d.send_pieces);
    CU_ASSERT_EQUAL(back.recv_pieces, d.recv_pieces);
    /* The buffer addresses are where the sender's buffers are, not part of what must agree. */
    back.send_addr ^= 0x1000;
    back.recv_addr = 0;
    CU_ASSERT(coll_desc_same(&d, &back));
    CU_ASSERT_EQUAL(back.root, INT32_MIN);

    CU_ASSERT_EQUAL(back.inline_len, 0);
    CU_ASSERT_EQUAL(coll_desc_decode(buf, n - 1, &back, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);

    /* A small all-gather's block rides along: up to COLL_DESC_INLINE_MAX bytes, no more. */
    coll_desc_t in = d;
    in.inline_len = COLL_DESC_INLINE_MAX;
    for (int i = 0; i < COLL_DESC_INLINE_MAX; i++)
        in.inline_data[i] = (uint8_t)(i * 7);
    uint8_t big[DESC_BUF];
    size_t bn = coll_desc_encode(&in, big, sizeof big);
    CU_ASSERT_EQUAL(bn, 72 + COLL_DESC_INLINE_MAX);
    CU_ASSERT_EQUAL(coll_desc_decode(big, bn, &back, NULL, 0), PSHARD_OK);
    CU_ASSERT(back.inline_len == COLL_DESC_INLINE_MAX &&
              memcmp(back.inline_data, in.inline_data, COLL_DESC_INLINE_MAX) == 0);
    CU_ASSERT(coll_desc_same(&d, &back));
    CU_ASSERT_EQUAL(coll_desc_decode(big, bn + 1, &back, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
    in.inline_len = COLL_DESC_INLINE_MAX + 1;
    CU_ASSERT_EQUAL(coll_desc_encode(&in, big, sizeof big), 0);

    struct {
        size_t offset;
        uint8_t value;
        const char *word;
    } bad[] = {{8, 0, "op"},     {8, 10, "op"},     {8, 255, "op"},
               {9, 7, "dtype"},  {9, 200, "dtype"}, {10, 8, "reduce"},
               {11, 2, "flags"}, {66, 2, "pieces"}, {70, 9, "pieces"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        n = coll_desc_encode(&d, buf, sizeof buf);
        buf[bad[i].offset] = bad[i].value;
        char err[128] = "";
        CU_ASSERT_EQUAL(coll_desc_decode(buf, n, &back, err, sizeof err),
                        PSHARD_ERR_INVALID_ARGUMENT);
        CU_ASSERT_PTR_NOT_NULL(strstr(err, bad[i].word));
    }
    /* The divertible flag travels (a ring compares it besides coll_desc_same's fields). */
    d.divert = 1;
    n = coll_desc_encode(&d, buf, sizeof buf);
    CU_ASSERT_EQUAL(buf[11], 1);
    CU_ASSERT_EQUAL(coll_desc_decode(buf, n, &back, NULL, 0), PSHARD_OK);
    CU_ASSERT_EQUAL(back.divert, 1);
    d.divert = 0;
    n = coll_desc_encode(&d, buf, sizeof buf);
    CU_ASSERT_EQUAL(coll_desc_decode(buf, n, &back, NULL, 0), PSHARD_OK);
    CU_ASSERT_EQUAL(back.divert, 0);
    /* All valid enum values pass. */
    for (uint8_t op = 1; op <= 5; op++)
        for (uint8_t dt = 0; dt <= 3; dt++)
            for (uint8_t rd = 0; rd <= 1; rd++) {
                d.op = op;
                d.dtype = dt;
                d.reduce = rd;
                n = coll_desc_encode(&d, buf, sizeof buf);
                CU_ASSERT_EQUAL(coll_desc_decode(buf, n, &back, NULL, 0), PSHARD_OK);
                CU_ASSERT(coll_desc_same(&d, &back));
            }
}

static void test_abort_round_trip_and_sanitising(void)
{
    coll_abort_t a = {.origin_rank = 3, .status = PSHARD_ERR_PEER_LOST}, back;
    memcpy(a.message, "rank 3 lost its successor", 26);
    uint8_t buf[1024];
    size_t n = coll_abort_encode(&a, buf, sizeof buf);
    CU_ASSERT_EQUAL(n, 10 + 25);
    CU_ASSERT_EQUAL(coll_abort_encode(&a, buf, n - 1), 0);
    CU_ASSERT_EQUAL(coll_abort_decode(buf, n, &back, NULL, 0), PSHARD_OK);
    CU_ASSERT_EQUAL(back.origin_rank, 3);
    CU_ASSERT_EQUAL(back.status, PSHARD_ERR_PEER_LOST);
    CU_ASSERT_STRING_EQUAL(back.message, a.message);

    CU_ASSERT_EQUAL(coll_abort_decode(buf, n - 1, &back, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(coll_abort_decode(buf, n + 1, &back, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(coll_abort_decode(buf, 9, &back, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);

    /* Non-printable text is sanitised. */
    buf[10] = 0x1b;
    buf[11] = 0;
    CU_ASSERT_EQUAL(coll_abort_decode(buf, n, &back, NULL, 0), PSHARD_OK);
    CU_ASSERT_EQUAL(strncmp(back.message, "??nk 3", 6), 0);

    /* A message longer than the struct holds, and a success status, are refused. */
    buf[8] = 0x00;
    buf[9] = 0x02; /* 512 */
    CU_ASSERT_EQUAL(coll_abort_decode(buf, 10 + 512, &back, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
    a.status = PSHARD_OK;
    n = coll_abort_encode(&a, buf, sizeof buf);
    CU_ASSERT_EQUAL(coll_abort_decode(buf, n, &back, NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);

    /* The longest message (511) round-trips. */
    a.status = PSHARD_ERR_ABORTED;
    memset(a.message, 'm', sizeof a.message);
    a.message[sizeof a.message - 1] = '\0';
    n = coll_abort_encode(&a, buf, sizeof buf);
    CU_ASSERT_EQUAL(n, 10 + 511);
    CU_ASSERT_EQUAL(coll_abort_decode(buf, n, &back, NULL, 0), PSHARD_OK);
    CU_ASSERT_EQUAL(strlen(back.message), 511);
}

/* The documented MAC input: tag "pshard-coll-v1" with its NUL, role, encoded HELLO, nonce. */
static void reference_mac(const uint8_t *key, size_t keylen, char role, const coll_hello_t *h,
                          const uint8_t nonce[COLL_NONCE_SIZE], uint8_t mac[COLL_MAC_SIZE])
{
    uint8_t input[15 + 1 + 104 + COLL_NONCE_SIZE];
    memcpy(input, "pshard-coll-v1", 15);
    input[15] = (uint8_t)role;
    CU_ASSERT_EQUAL(coll_hello_encode(h, input + 16, 104), 104);
    memcpy(input + 120, nonce, COLL_NONCE_SIZE);
    static const uint8_t none[1];
    unsigned len = 0;
    HMAC(EVP_sha256(), keylen ? key : none, (int)keylen, input, sizeof input, mac, &len);
    CU_ASSERT_EQUAL(len, COLL_MAC_SIZE);
}

static void test_handshake_mac(void)
{
    const uint8_t key[] = "cluster-token";
    coll_hello_t h = sample_hello();
    uint8_t nonce[COLL_NONCE_SIZE];
    memset(nonce, 0x5a, sizeof nonce);
    uint8_t m1[COLL_MAC_SIZE], m2[COLL_MAC_SIZE], ref[COLL_MAC_SIZE];

    coll_handshake_mac(key, sizeof key - 1, 'A', &h, nonce, m1);
    coll_handshake_mac(key, sizeof key - 1, 'A', &h, nonce, m2);
    CU_ASSERT(coll_mac_equal(m1, m2));
    reference_mac(key, sizeof key - 1, 'A', &h, nonce, ref);
    CU_ASSERT(memcmp(m1, ref, COLL_MAC_SIZE) == 0);

    /* Each input matters. */
    coll_handshake_mac(key, sizeof key - 2, 'A', &h, nonce, m2); /* different token */
    CU_ASSERT(!coll_mac_equal(m1, m2));
    coll_handshake_mac(key, sizeof key - 1, 'C', &h, nonce, m2); /* role */
    CU_ASSERT(!coll_mac_equal(m1, m2));
    nonce[3] ^= 1;
    coll_handshake_mac(key, sizeof key - 1, 'A', &h, nonce, m2); /* acceptor nonce */
    CU_ASSERT(!coll_mac_equal(m1, m2));
    nonce[3] ^= 1;
    coll_hello_t h2 = h;
    h2.generation++;
    coll_handshake_mac(key, sizeof key - 1, 'A', &h2, nonce, m2); /* generation */
    CU_ASSERT(!coll_mac_equal(m1, m2));
    h2 = h;
    h2.nonce[0] ^= 0x80;
    coll_handshake_mac(key, sizeof key - 1, 'A', &h2, nonce, m2); /* connector nonce */
    CU_ASSERT(!coll_mac_equal(m1, m2));
    h2 = h;
    h2.from_rank = 2;
    coll_handshake_mac(key, sizeof key - 1, 'A', &h2, nonce, m2); /* identity */
    CU_ASSERT(!coll_mac_equal(m1, m2));

    /* An empty key works, is deterministic, matches HMAC with a zero-length key and differs
     * from a keyed MAC. */
    coll_handshake_mac(NULL, 0, 'A', &h, nonce, m1);
    coll_handshake_mac((const uint8_t *)"", 0, 'A', &h, nonce, m2);
    CU_ASSERT(coll_mac_equal(m1, m2));
    reference_mac(NULL, 0, 'A', &h, nonce, ref);
    CU_ASSERT(memcmp(m1, ref, COLL_MAC_SIZE) == 0);
    coll_handshake_mac(key, sizeof key - 1, 'A', &h, nonce, m2);
    CU_ASSERT(!coll_mac_equal(m1, m2));

    /* coll_mac_equal looks at every byte. */
    memcpy(m2, m1, COLL_MAC_SIZE);
    m2[COLL_MAC_SIZE - 1] ^= 1;
    CU_ASSERT(!coll_mac_equal(m1, m2));
    m2[COLL_MAC_SIZE - 1] ^= 1;
    m2[0] ^= 1;
    CU_ASSERT(!coll_mac_equal(m1, m2));
}

static pshard_status_t check(const coll_hello_t *h, char *err, size_t errlen)
{
    err[0] = '\0';
    return coll_hello_check(h, 7, 4, 1, "default", err, errlen);
}

static void test_hello_check(void)
{
    char err[256];
    coll_hello_t h = sample_hello();
    CU_ASSERT_EQUAL(check(&h, err, sizeof err), PSHARD_OK);

    h.generation = 5;
    CU_ASSERT_EQUAL(check(&h, err, sizeof err), PSHARD_ERR_PERMISSION);
    CU_ASSERT_STRING_EQUAL(err, "stale generation 5, this ring is generation 7");
    h.generation = 9;
    CU_ASSERT_EQUAL(check(&h, err, sizeof err), PSHARD_ERR_PERMISSION);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "generation 9"));

    h = sample_hello();
    h.to_rank = 2;
    CU_ASSERT_EQUAL(check(&h, err, sizeof err), PSHARD_ERR_PERMISSION);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "rank 2"));

    h = sample_hello();
    h.from_rank = 3;
    CU_ASSERT_EQUAL(check(&h, err, sizeof err), PSHARD_ERR_PERMISSION);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "from rank 3"));

    h = sample_hello();
    h.world_size = 8;
    CU_ASSERT_EQUAL(check(&h, err, sizeof err), PSHARD_ERR_PERMISSION);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "world size"));

    h = sample_hello();
    memcpy(h.comm_name, "other", 6);
    CU_ASSERT_EQUAL(check(&h, err, sizeof err), PSHARD_ERR_PERMISSION);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "\"other\""));

    h = sample_hello();
    h.version = 1; /* a build without the same-host transport's frames */
    CU_ASSERT_EQUAL(check(&h, err, sizeof err), PSHARD_ERR_PERMISSION);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "version"));

    /* Rank 0's predecessor wraps around to world - 1. */
    h = sample_hello();
    h.to_rank = 0;
    h.from_rank = 3;
    err[0] = '\0';
    CU_ASSERT_EQUAL(coll_hello_check(&h, 7, 4, 0, "default", err, sizeof err), PSHARD_OK);
    h.from_rank = 1;
    CU_ASSERT_EQUAL(coll_hello_check(&h, 7, 4, 0, "default", err, sizeof err),
                    PSHARD_ERR_PERMISSION);

    /* A one-rank ring talks to itself. */
    h = sample_hello();
    h.world_size = 1;
    h.to_rank = h.from_rank = 0;
    CU_ASSERT_EQUAL(coll_hello_check(&h, 7, 1, 0, "default", NULL, 0), PSHARD_OK);
    /* A caller's impossible rank is an argument error, not a crash. */
    CU_ASSERT_EQUAL(coll_hello_check(&h, 7, 0, 0, "default", NULL, 0), PSHARD_ERR_INVALID_ARGUMENT);
}

static void test_random_nonce(void)
{
    uint8_t a[COLL_NONCE_SIZE], b[COLL_NONCE_SIZE];
    coll_random_nonce(a);
    coll_random_nonce(b);
    CU_ASSERT(memcmp(a, b, COLL_NONCE_SIZE) != 0);
}

static void test_counts_hash(void)
{
    const size_t a[] = {256, 256, 256, 256};
    const size_t b[] = {256, 256, 256, 255};
    const size_t c[] = {256, 256, 256};
    const size_t d[] = {0, 256, 256, 256, 256};
    CU_ASSERT_EQUAL(coll_counts_hash(a, 4), coll_counts_hash(a, 4));
    CU_ASSERT_NOT_EQUAL(coll_counts_hash(a, 4), coll_counts_hash(b, 4));
    CU_ASSERT_NOT_EQUAL(coll_counts_hash(a, 4), coll_counts_hash(c, 3));
    CU_ASSERT_NOT_EQUAL(coll_counts_hash(a, 4), coll_counts_hash(d, 5));
    CU_ASSERT_EQUAL(coll_counts_hash(NULL, 0), 0xcbf29ce484222325ull); /* FNV offset basis */
    /* FNV-1a's step a count at a time: (hash ^ count) * prime. */
    const size_t one[] = {1};
    CU_ASSERT_EQUAL(coll_counts_hash(one, 1), (0xcbf29ce484222325ull ^ 1) * 0x100000001b3ull);
    /* counts that differ only in their high bytes differ too */
    const size_t hi_a[] = {(size_t)1 << 40, 7}, hi_b[] = {(size_t)1 << 41, 7};
    CU_ASSERT_NOT_EQUAL(coll_counts_hash(hi_a, 2), coll_counts_hash(hi_b, 2));
}

static void test_desc_same(void)
{
    coll_desc_t a = sample_desc(), b = a;
    CU_ASSERT(coll_desc_same(&a, &b));
    b.rank_count = 7; /* not compared: ranks may own different counts */
    CU_ASSERT(coll_desc_same(&a, &b));
    b = a, b.seq++;
    CU_ASSERT(!coll_desc_same(&a, &b));
    b = a, b.op = PSHARD_COLL_BROADCAST;
    CU_ASSERT(!coll_desc_same(&a, &b));
    b = a, b.dtype = PSHARD_BF16;
    CU_ASSERT(!coll_desc_same(&a, &b));
    b = a, b.reduce = PSHARD_REDUCE_AVG;
    CU_ASSERT(!coll_desc_same(&a, &b));
    b = a, b.root = 2;
    CU_ASSERT(!coll_desc_same(&a, &b));
    b = a, b.tag = 0x2b;
    CU_ASSERT(!coll_desc_same(&a, &b));
    b = a, b.total_count = 1025;
    CU_ASSERT(!coll_desc_same(&a, &b));
    b = a, b.counts_hash ^= 1;
    CU_ASSERT(!coll_desc_same(&a, &b));
}

static void test_desc_format(void)
{
    char buf[256];
    coll_desc_t d = sample_desc();
    coll_desc_format(&d, buf, sizeof buf);
    CU_ASSERT_STRING_EQUAL(buf, "all_gather seq 418 fp32 tag 0x2a total 1024 (this rank 256, "
                                "counts #9c3a000000000001)");
    d.op = PSHARD_COLL_REDUCE_SCATTER;
    d.dtype = PSHARD_BF16;
    d.reduce = PSHARD_REDUCE_AVG;
    coll_desc_format(&d, buf, sizeof buf);
    CU_ASSERT_PTR_NOT_NULL(strstr(buf, "reduce_scatter seq 418 bf16 avg tag 0x2a"));
    d.op = PSHARD_COLL_ALL_REDUCE;
    d.reduce = PSHARD_REDUCE_SUM;
    coll_desc_format(&d, buf, sizeof buf);
    CU_ASSERT_PTR_NOT_NULL(strstr(buf, "all_reduce seq 418 bf16 sum"));
    d.op = PSHARD_COLL_BROADCAST;
    d.root = 2;
    coll_desc_format(&d, buf, sizeof buf);
    CU_ASSERT_PTR_NOT_NULL(strstr(buf, "broadcast seq 418 bf16 root 2 tag"));
    d.op = PSHARD_COLL_BARRIER;
    coll_desc_format(&d, buf, sizeof buf);
    CU_ASSERT_EQUAL(strncmp(buf, "barrier seq 418", 15), 0);
    d.op = 77;
    d.dtype = 9;
    coll_desc_format(&d, buf, sizeof buf);
    CU_ASSERT_EQUAL(strncmp(buf, "op(77) seq 418 dtype(9)", 23), 0);

    /* Truncation is safe. */
    char tiny[8];
    coll_desc_format(&d, tiny, sizeof tiny);
    CU_ASSERT_EQUAL(strlen(tiny), 7);
}

static void test_peer_and_done_round_trip(void)
{
    coll_peer_t p = {
        .origin_rank = 3, .pid = 4242, .pidns = 4026531836ull, .probe_addr = 0x7ffe00001000ull};
    for (int i = 0; i < 16; i++) {
        p.boot_id[i] = (uint8_t)(0xb0 + i);
        p.probe[i] = (uint8_t)(0x50 + i);
    }
    uint8_t buf[128];
    size_t n = coll_peer_encode(&p, buf, sizeof buf);
    CU_ASSERT_EQUAL(n, 56);
    CU_ASSERT_EQUAL(coll_peer_encode(&p, buf, n - 1), 0);
    coll_peer_t back;
    CU_ASSERT_EQUAL(coll_peer_decode(buf, n, &back, NULL, 0), PSHARD_OK);
    CU_ASSERT(back.origin_rank == 3 && back.pid == 4242 && back.pidns == p.pidns &&
              back.probe_addr == p.probe_addr && memcmp(back.boot_id, p.boot_id, 16) == 0 &&
              memcmp(back.probe, p.probe, 16) == 0);
    char err[128] = "";
    CU_ASSERT_EQUAL(coll_peer_decode(buf, n - 1, &back, err, sizeof err),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "PEER"));
    p.pid = 0; /* no process has pid 0 */
    n = coll_peer_encode(&p, buf, sizeof buf);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coll_peer_decode(buf, n, &back, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "pid"));

    coll_done_t d = {.origin_rank = 2, .value = 1}, dback;
    n = coll_done_encode(&d, buf, sizeof buf);
    CU_ASSERT_EQUAL(n, 8);
    CU_ASSERT_EQUAL(coll_done_decode(buf, n, &dback, NULL, 0), PSHARD_OK);
    CU_ASSERT(dback.origin_rank == 2 && dback.value == 1);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coll_done_decode(buf, n + 1, &dback, err, sizeof err),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "DONE"));
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"header_round_trip", test_header_round_trip},
        {"header_rejections", test_header_rejections},
        {"hello_round_trip_and_rejections", test_hello_round_trip_and_rejections},
        {"challenge_auth_round_trip", test_challenge_auth_round_trip},
        {"reject_round_trip_and_sanitising", test_reject_round_trip_and_sanitising},
        {"desc_round_trip_and_rejections", test_desc_round_trip_and_rejections},
        {"abort_round_trip_and_sanitising", test_abort_round_trip_and_sanitising},
        {"peer_and_done_round_trip", test_peer_and_done_round_trip},
        {"handshake_mac", test_handshake_mac},
        {"hello_check", test_hello_check},
        {"random_nonce", test_random_nonce},
        {"counts_hash", test_counts_hash},
        {"desc_same", test_desc_same},
        {"desc_format", test_desc_format},
        {NULL, NULL},
    };
    return ps_test_main("coll_wire", cases);
}
