/* Deterministic driver for the fuzz_wire target, for builds without libFuzzer (gcc): runs N
 * pseudo-random inputs (random bytes, valid encodings of every message, framed or bare, and
 * mutations of them: flipped bytes, truncation, extension) through LLVMFuzzerTestOneInput and
 * fails unless every decoder accepted some of them. With --emit-corpus DIR it instead writes
 * valid framed messages into DIR as a seed corpus for the libFuzzer build.
 * Usage: fuzz_wire_replay [N] | fuzz_wire_replay --emit-corpus DIR */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "coll_wire.h"
#include "pshard/util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
extern size_t fuzz_wire_accepted[COLL_FRAME_DONE + 1];

#define MAX_INPUT 8192

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t xorshift64(void)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    rng_state = x;
    return x;
}

static uint32_t rnd_below(uint32_t n)
{
    return (uint32_t)(xorshift64() % n);
}

/* Small integers most of the time, full-range values sometimes. */
static uint64_t rnd_value(void)
{
    return rnd_below(4) == 0 ? xorshift64() : rnd_below(16);
}

static void rnd_bytes(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)xorshift64();
}

/* Text that is usually printable and sometimes holds control or high bytes. */
static void rnd_text(char *p, size_t cap)
{
    size_t n = rnd_below((uint32_t)cap);
    bool dirty = rnd_below(8) == 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t c = (uint8_t)(0x20 + rnd_below(0x5f));
        if (dirty && rnd_below(4) == 0)
            c = (uint8_t)(1 + rnd_below(255));
        p[i] = (char)c;
    }
    p[n] = '\0';
}

/* Encodes a random, mostly valid message of a random type into out (payload only); returns
 * its length and the type. */
static size_t make_payload(uint8_t *out, size_t cap, uint8_t *type)
{
    *type = (uint8_t)(COLL_FRAME_HELLO + rnd_below(COLL_FRAME_DONE));
    switch (*type) {
    case COLL_FRAME_HELLO: {
        coll_hello_t m;
        memset(&m, 0, sizeof m);
        m.version = rnd_below(8) == 0 ? (uint32_t)rnd_value() : COLL_WIRE_VERSION;
        m.generation = rnd_value();
        m.world_size = (uint32_t)rnd_value();
        m.from_rank = (uint32_t)rnd_value();
        m.to_rank = (uint32_t)rnd_value();
        rnd_bytes(m.nonce, sizeof m.nonce);
        rnd_text(m.comm_name, sizeof m.comm_name);
        return coll_hello_encode(&m, out, cap);
    }
    case COLL_FRAME_CHALLENGE: {
        coll_challenge_t m;
        rnd_bytes(m.nonce, sizeof m.nonce);
        rnd_bytes(m.mac, sizeof m.mac);
        return coll_challenge_encode(&m, out, cap);
    }
    case COLL_FRAME_AUTH: {
        coll_auth_t m;
        rnd_bytes(m.mac, sizeof m.mac);
        return coll_auth_encode(&m, out, cap);
    }
    case COLL_FRAME_ACCEPT:
        return 0;
    case COLL_FRAME_REJECT: {
        char reason[300];
        rnd_text(reason, sizeof reason);
        return coll_reject_encode(reason, out, cap);
    }
    case COLL_FRAME_DESC: {
        coll_desc_t m;
        m.seq = rnd_value();
        m.op = (uint8_t)(1 + rnd_below(rnd_below(8) == 0 ? 7 : 5));
        m.dtype = (uint8_t)rnd_below(rnd_below(8) == 0 ? 6 : 4);
        m.reduce = (uint8_t)rnd_below(rnd_below(8) == 0 ? 4 : 2);
        m.root = (int32_t)(rnd_value() & 0xffffffffu);
        m.tag = rnd_value();
        m.total_count = rnd_value();
        m.counts_hash = xorshift64();
        m.rank_count = rnd_value();
        m.send_addr = rnd_value();
        m.recv_addr = rnd_value();
        m.send_pieces = (uint32_t)rnd_below(rnd_below(8) == 0 ? 1u << 20 : 70000);
        m.recv_pieces = (uint32_t)rnd_below(rnd_below(8) == 0 ? 1u << 20 : 70000);
        m.inline_len = (uint16_t)(rnd_below(2) ? 0 : rnd_below(COLL_DESC_INLINE_MAX + 1));
        rnd_bytes(m.inline_data, m.inline_len);
        return coll_desc_encode(&m, out, cap);
    }
    case COLL_FRAME_PEER: {
        coll_peer_t m;
        m.origin_rank = (uint32_t)rnd_value();
        m.pid = rnd_below(8) == 0 ? (uint32_t)rnd_value() : (uint32_t)(1 + rnd_below(1 << 22));
        m.pidns = rnd_value();
        rnd_bytes(m.boot_id, sizeof m.boot_id);
        m.probe_addr = rnd_value();
        rnd_bytes(m.probe, sizeof m.probe);
        return coll_peer_encode(&m, out, cap);
    }
    case COLL_FRAME_DONE: {
        coll_done_t m = {(uint32_t)rnd_value(), (uint32_t)rnd_value()};
        return coll_done_encode(&m, out, cap);
    }
    case COLL_FRAME_DATA: {
        size_t n = rnd_below(200);
        rnd_bytes(out, n < cap ? n : cap);
        return n < cap ? n : cap;
    }
    default: {
        coll_abort_t m;
        m.origin_rank = (uint32_t)rnd_value();
        m.status = rnd_below(8) == 0 ? (int32_t)rnd_below(3) : -(int32_t)(1 + rnd_below(21));
        rnd_text(m.message, sizeof m.message);
        return coll_abort_encode(&m, out, cap);
    }
    }
}

/* A framed message: header (type, len = payload length, random seq) followed by the payload. */
static size_t make_framed(uint8_t *out, size_t cap)
{
    uint8_t type;
    size_t n = make_payload(out + COLL_FRAME_HEADER_SIZE, cap - COLL_FRAME_HEADER_SIZE, &type);
    coll_frame_header_t h = {.type = type, .flags = 0, .len = (uint32_t)n, .seq = rnd_value()};
    coll_frame_header_encode(&h, out);
    return COLL_FRAME_HEADER_SIZE + n;
}

static size_t mutate(uint8_t *buf, size_t n)
{
    uint32_t flips = rnd_below(4);
    for (uint32_t i = 0; i < flips && n > 0; i++) {
        size_t at = rnd_below((uint32_t)n);
        buf[at] = rnd_below(2) ? (uint8_t)xorshift64() : (uint8_t)(buf[at] ^ (1u << rnd_below(8)));
    }
    switch (rnd_below(6)) {
    case 0: /* truncate */
        return n ? rnd_below((uint32_t)n + 1) : 0;
    case 1: { /* extend */
        size_t extra = 1 + rnd_below(32);
        if (n + extra > MAX_INPUT)
            extra = MAX_INPUT - n;
        rnd_bytes(buf + n, extra);
        return n + extra;
    }
    default:
        return n;
    }
}

static int emit_corpus(const char *dir)
{
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "fuzz_wire_replay: mkdir %s: %s\n", dir, strerror(errno));
        return 1;
    }
    static uint8_t buf[MAX_INPUT];
    for (int i = 0; i < 64; i++) {
        size_t n;
        uint8_t type;
        if (i % 2)
            n = make_framed(buf, sizeof buf);
        else
            n = make_payload(buf, sizeof buf, &type);
        char path[4096];
        if (ps_snprintf(path, sizeof path, "%s/seed_%02d", dir, i) != 0)
            return 1;
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(buf, 1, n, f) != n) {
            fprintf(stderr, "fuzz_wire_replay: cannot write %s\n", path);
            if (f)
                fclose(f);
            return 1;
        }
        fclose(f);
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--emit-corpus") == 0)
        return emit_corpus(argv[2]);
    int64_t runs = 200000;
    if (argc == 2 && ps_parse_i64(argv[1], 1, INT64_MAX, &runs) != 0) {
        fprintf(stderr, "usage: %s [runs] | %s --emit-corpus DIR\n", argv[0], argv[0]);
        return 2;
    }

    static uint8_t buf[MAX_INPUT + 64];
    for (int64_t r = 0; r < runs; r++) {
        size_t n;
        switch (rnd_below(4)) {
        case 0: /* random bytes, sometimes behind a valid header */
            n = rnd_below(300);
            rnd_bytes(buf, n);
            if (n >= COLL_FRAME_HEADER_SIZE && rnd_below(2)) {
                coll_frame_header_t h = {.type = (uint8_t)(1 + rnd_below(8)),
                                         .len = (uint32_t)(n - COLL_FRAME_HEADER_SIZE)};
                coll_frame_header_encode(&h, buf);
            }
            break;
        case 1: { /* a valid bare payload, maybe mutated */
            uint8_t type;
            n = make_payload(buf, MAX_INPUT, &type);
            if (rnd_below(2))
                n = mutate(buf, n);
            break;
        }
        default: /* a valid framed message, maybe mutated */
            n = make_framed(buf, MAX_INPUT);
            if (rnd_below(2))
                n = mutate(buf, n);
            break;
        }
        LLVMFuzzerTestOneInput(buf, n);
    }

    static const char *const names[] = {"header", "HELLO", "CHALLENGE", "AUTH", "ACCEPT", "REJECT",
                                        "DESC",   "DATA",  "ABORT",     "PEER", "DONE"};
    int missing = 0;
    printf("fuzz_wire_replay: %lld inputs; accepted:", (long long)runs);
    for (int i = 0; i <= COLL_FRAME_DONE; i++) {
        if (i == COLL_FRAME_ACCEPT || i == COLL_FRAME_DATA)
            continue; /* no payload decoder */
        printf(" %s %zu", names[i], fuzz_wire_accepted[i]);
        if (fuzz_wire_accepted[i] == 0)
            missing = 1;
    }
    printf("\n");
    if (missing && runs >= 1000) {
        fprintf(stderr, "fuzz_wire_replay: some decoder never accepted a valid input\n");
        return 1;
    }
    return 0;
}
