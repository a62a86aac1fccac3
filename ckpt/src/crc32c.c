/* CRC-32C (Castagnoli, reflected) for checkpoint files: a portable slice-by-8 table version,
 * the CPU's crc32 instruction in three interleaved streams, and, on x86 CPUs with AVX-512 and
 * VPCLMULQDQ, carry-less-multiply folding of 256 bytes per round finished by the instruction.
 * All three give the same results (the unit tests compare them on random buffers). */
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ckpt_internal.h"

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#endif

#define CRC32C_POLY 0x82F63B78u /* Castagnoli, reflected */

static uint32_t crc_table[8][256];
static bool crc_have_hw, crc_have_fold;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

/* The crc32 instruction has a latency of 3 cycles and a throughput of 1: three independent
 * streams over consecutive blocks of CRC_STRIDE bytes keep it busy, and their registers are
 * joined with crc_shift, which advances a register over CRC_STRIDE zero bytes (the CRC is
 * linear: raw(r, A||B) = shift_|B|(raw(r, A)) ^ raw(0, B)). crc_shift_table[k][b] is the shift
 * of byte b in position k of the register. */
#define CRC_STRIDE 8192u
static uint32_t crc_shift_table[4][256];

static inline uint32_t crc_shift(uint32_t r)
{
    return crc_shift_table[0][r & 0xff] ^ crc_shift_table[1][(r >> 8) & 0xff] ^
           crc_shift_table[2][(r >> 16) & 0xff] ^ crc_shift_table[3][r >> 24];
}

/* The register (no pre- or post-inversion) after len zero bytes from register r, bytewise. */
static uint32_t crc_raw_zeros(uint32_t r, size_t len)
{
    while (len-- > 0)
        r = crc_table[0][r & 0xff] ^ (r >> 8);
    return r;
}

#if defined(__x86_64__)
/* Folding with carry-less multiplies (x86 with AVX-512 and VPCLMULQDQ): the data is taken 16
 * bytes at a time in the reflected bit order of the crc32 instruction (bit k of a block is the
 * coefficient of x^(127-k)). Moving a block X forward by T bits multiplies it by x^T mod P:
 * its low quadword (the higher degrees) by x^(T+31) and its high one by x^(T-33), each as a
 * reflected 32-bit constant, which lines the 95-bit products up with the block T bits later.
 * Folding keeps the CRC: at the end the crc32 instruction reduces the last 16 bytes. */
enum { FOLD_128, FOLD_256, FOLD_384, FOLD_512, FOLD_1024, FOLD_1536, FOLD_2048, FOLD_N };
static const unsigned fold_bits[FOLD_N] = {128, 256, 384, 512, 1024, 1536, 2048};
static uint64_t fold_k[FOLD_N][2]; /* {low quadword's constant, high quadword's} */

/* x^n mod P with P the Castagnoli polynomial in normal order (bit i: coefficient of x^i). */
static uint32_t xpow_mod(unsigned n)
{
    uint32_t r = 1;
    for (unsigned i = 0; i < n; i++)
        r = (r & 0x80000000u) ? (r << 1) ^ 0x1EDC6F41u : r << 1;
    return r;
}

static uint32_t reflect32(uint32_t v)
{
    uint32_t r = 0;
    for (int i = 0; i < 32; i++)
        if (v & (1u << i))
            r |= 1u << (31 - i);
    return r;
}

static void fold_init(void)
{
    for (int i = 0; i < FOLD_N; i++) {
        fold_k[i][0] = reflect32(xpow_mod(fold_bits[i] + 31));
        fold_k[i][1] = reflect32(xpow_mod(fold_bits[i] - 33));
    }
}
#endif

/* Builds the slice-by-8 tables: crc_table[0] is the byte-at-a-time table, crc_table[k] advances
 * a byte's contribution through k more zero bytes. Also decides whether the CPU has crc32. */
static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int b = 0; b < 8; b++)
            c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int k = 1; k < 8; k++)
            crc_table[k][i] = (crc_table[k - 1][i] >> 8) ^ crc_table[0][crc_table[k - 1][i] & 0xff];
    /* The shift is linear: its value on each of the 32 register bits, then by bytes. */
    uint32_t bit_shift[32];
    for (int b = 0; b < 32; b++)
        bit_shift[b] = crc_raw_zeros(1u << b, CRC_STRIDE);
    for (int k = 0; k < 4; k++)
        for (uint32_t v = 0; v < 256; v++) {
            uint32_t r = 0;
            for (int b = 0; b < 8; b++)
                if (v & (1u << b))
                    r ^= bit_shift[8 * k + b];
            crc_shift_table[k][v] = r;
        }
#if defined(__x86_64__)
    __builtin_cpu_init();
    crc_have_hw = __builtin_cpu_supports("sse4.2");
    crc_have_fold = crc_have_hw && __builtin_cpu_supports("avx512f") &&
                    __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul");
    fold_init();
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
    crc_have_hw = true;
#endif
}

uint32_t ckpt_crc32c_sw(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&crc_once, crc_init);
    const uint8_t *p = buf;
    uint32_t c = ~crc;
    while (len > 0 && ((uintptr_t)p & 7) != 0) {
        c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, sizeof(v));
        v ^= c;
        c = crc_table[7][v & 0xff] ^ crc_table[6][(v >> 8) & 0xff] ^
            crc_table[5][(v >> 16) & 0xff] ^ crc_table[4][(v >> 24) & 0xff] ^
            crc_table[3][(v >> 32) & 0xff] ^ crc_table[2][(v >> 40) & 0xff] ^
            crc_table[1][(v >> 48) & 0xff] ^ crc_table[0][v >> 56];
        p += 8;
        len -= 8;
    }
    while (len-- > 0)
        c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return ~c;
}

#if defined(__x86_64__)
#define FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

FOLD_TARGET static inline __m128i fold128(__m128i x, int t)
{
    __m128i k = _mm_set_epi64x((long long)fold_k[t][1], (long long)fold_k[t][0]);
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

FOLD_TARGET static inline __m512i fold512(__m512i x, int t)
{
    __m512i k =
        _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_k[t][1], (long long)fold_k[t][0]));
    return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x00),
                            _mm512_clmulepi64_epi128(x, k, 0x11));
}

/* The register (no inversions) after *len >= 256 bytes at *p from register c; advances *p and
 * *len past every whole 16-byte block (fewer than 16 bytes remain). Four 64-byte accumulators
 * fold 256 bytes per round; they are then folded into one, its four lanes into one block, and
 * that block is reduced by the crc32 instruction. */
FOLD_TARGET static uint64_t crc32c_fold(uint32_t c, const uint8_t **pp, size_t *lenp)
{
    const uint8_t *p = *pp;
    size_t len = *lenp;
    __m512i x0 = _mm512_loadu_si512((const void *)p);
    __m512i x1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(p + 128));
    __m512i x3 = _mm512_loadu_si512((const void *)(p + 192));
    /* The initial register enters as the message's first 32 bits. */
    x0 = _mm512_xor_si512(x0,
                          _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128((int)c), 0));
    p += 256;
    len -= 256;
    while (len >= 256) {
        x0 = _mm512_xor_si512(fold512(x0, FOLD_2048), _mm512_loadu_si512((const void *)p));
        x1 = _mm512_xor_si512(fold512(x1, FOLD_2048), _mm512_loadu_si512((const void *)(p + 64)));
        x2 = _mm512_xor_si512(fold512(x2, FOLD_2048), _mm512_loadu_si512((const void *)(p + 128)));
        x3 = _mm512_xor_si512(fold512(x3, FOLD_2048), _mm512_loadu_si512((const void *)(p + 192)));
        p += 256;
        len -= 256;
    }
    __m512i x = _mm512_xor_si512(_mm512_xor_si512(fold512(x0, FOLD_1536), fold512(x1, FOLD_1024)),
                                 _mm512_xor_si512(fold512(x2, FOLD_512), x3));
    __m128i r = _mm_xor_si128(_mm_xor_si128(fold128(_mm512_extracti32x4_epi32(x, 0), FOLD_384),
                                            fold128(_mm512_extracti32x4_epi32(x, 1), FOLD_256)),
                              _mm_xor_si128(fold128(_mm512_extracti32x4_epi32(x, 2), FOLD_128),
                                            _mm512_extracti32x4_epi32(x, 3)));
    while (len >= 16) {
        r = _mm_xor_si128(fold128(r, FOLD_128), _mm_loadu_si128((const __m128i *)p));
        p += 16;
        len -= 16;
    }
    uint64_t reg = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(r));
    reg = _mm_crc32_u64(reg, (uint64_t)_mm_extract_epi64(r, 1));
    *pp = p;
    *lenp = len;
    return reg;
}

/* The crc32 instruction alone (three streams), or with folding first when fold is set. */
__attribute__((target("sse4.2"))) static uint32_t crc32c_insn(uint32_t crc, const uint8_t *p,
                                                              size_t len, bool fold)
{
    uint32_t c = ~crc;
    uint64_t c64;
    if (fold && len >= 256) {
        c64 = crc32c_fold(c, &p, &len);
    } else {
        while (len > 0 && ((uintptr_t)p & 7) != 0) {
            c = _mm_crc32_u8(c, *p++);
            len--;
        }
        c64 = c;
        while (len >= 3 * CRC_STRIDE) {
            uint64_t a = c64, b = 0, d = 0;
            for (size_t i = 0; i < CRC_STRIDE; i += 8) {
                uint64_t va, vb, vd;
                memcpy(&va, p + i, 8);
                memcpy(&vb, p + CRC_STRIDE + i, 8);
                memcpy(&vd, p + 2 * CRC_STRIDE + i, 8);
                a = _mm_crc32_u64(a, va);
                b = _mm_crc32_u64(b, vb);
                d = _mm_crc32_u64(d, vd);
            }
            c64 = crc_shift(crc_shift((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)d;
            p += 3 * CRC_STRIDE;
            len -= 3 * CRC_STRIDE;
        }
    }
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, sizeof(v));
        c64 = _mm_crc32_u64(c64, v);
        p += 8;
        len -= 8;
    }
    c = (uint32_t)c64;
    while (len-- > 0)
        c = _mm_crc32_u8(c, *p++);
    return ~c;
}
#define CKPT_HAVE_CRC_INSN 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
static uint32_t crc32c_insn(uint32_t crc, const uint8_t *p, size_t len, bool fold)
{
    (void)fold;
    uint32_t c = ~crc;
    while (len > 0 && ((uintptr_t)p & 7) != 0) {
        c = __crc32cb(c, *p++);
        len--;
    }
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, sizeof(v));
        c = __crc32cd(c, v);
        p += 8;
        len -= 8;
    }
    while (len-- > 0)
        c = __crc32cb(c, *p++);
    return ~c;
}
#define CKPT_HAVE_CRC_INSN 1
#endif

bool ckpt_crc32c_hw_available(void)
{
    pthread_once(&crc_once, crc_init);
    return crc_have_hw;
}

bool ckpt_crc32c_fold_available(void)
{
    pthread_once(&crc_once, crc_init);
    return crc_have_fold;
}

uint32_t ckpt_crc32c_hw(uint32_t crc, const void *buf, size_t len)
{
#ifdef CKPT_HAVE_CRC_INSN
    if (ckpt_crc32c_hw_available())
        return crc32c_insn(crc, buf, len, crc_have_fold);
#endif
    return ckpt_crc32c_sw(crc, buf, len);
}

uint32_t ckpt_crc32c_insn(uint32_t crc, const void *buf, size_t len)
{
#ifdef CKPT_HAVE_CRC_INSN
    if (ckpt_crc32c_hw_available())
        return crc32c_insn(crc, buf, len, false);
#endif
    return ckpt_crc32c_sw(crc, buf, len);
}

uint32_t ps_crc32c(uint32_t crc, const void *buf, size_t len)
{
    return ckpt_crc32c_hw(crc, buf, len);
}
