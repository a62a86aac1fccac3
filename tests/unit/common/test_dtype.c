/* Unit tests for pshard/dtype.h: names and sizes, exhaustive fp16/bf16 round trips, fp32 -> fp16
 * and fp32 -> bf16 rounding checked against independent reference implementations (double
 * arithmetic with frexp/ldexp for fp16, integer compare-based rounding for bf16) over whole
 * binades, every boundary and millions of random bit patterns, and ps_convert's pairs. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ps_test.h"
#include "pshard/dtype.h"

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static uint32_t rnd32(void)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    rng_state = x;
    return (uint32_t)(x >> 16);
}

static float f32_of(uint32_t bits)
{
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static uint32_t bits_of(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static int f32_is_nan(uint32_t bits)
{
    return (bits & 0x7fffffffu) > 0x7f800000u;
}

static int f16_is_nan(uint16_t h)
{
    return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0;
}

/* ---- independent references ---- */

/* fp16 bits -> value, from the definition. */
static double ref_f16_value(uint16_t h)
{
    int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    double v;
    if (exp == 0)
        v = ldexp((double)mant, -24);
    else if (exp == 31)
        v = mant ? NAN : INFINITY;
    else
        v = ldexp(1024.0 + mant, exp - 25);
    return sign ? -v : v;
}

/* Rounds |value| (finite, a double) to fp16 with explicit round-half-even on the scaled
 * significand, then encodes it. Works in double: find the quantum (ulp) for the value's
 * binade with frexp, divide (exact, a power of two), split into integer and fraction, and
 * apply the tie rule by hand. */
static uint16_t ref_f32_to_f16(uint32_t bits)
{
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    float f = f32_of(bits);
    if (isnan(f))
        return (uint16_t)(sign | 0x7e00u | ((bits >> 13) & 0x3ffu)); /* quiet, payload kept */
    if (isinf(f))
        return (uint16_t)(sign | 0x7c00u);
    double a = fabs((double)f);
    if (a == 0.0)
        return sign;
    int ex;
    (void)frexp(a, &ex);
    int e = ex - 1; /* a in [2^e, 2^(e+1)) */
    if (e < -14)
        e = -14; /* subnormal quantum is fixed at 2^-24 */
    double quantum = ldexp(1.0, e - 10);
    double scaled = a / quantum;
    double whole = floor(scaled);
    double frac = scaled - whole;
    if (frac > 0.5 || (frac == 0.5 && fmod(whole, 2.0) == 1.0))
        whole += 1.0;
    double r = whole * quantum;
    if (r >= 65536.0)
        return (uint16_t)(sign | 0x7c00u);
    if (r < ldexp(1.0, -14))
        return (uint16_t)(sign | (uint16_t)ldexp(r, 24));
    (void)frexp(r, &ex);
    int exp16 = ex - 1 + 15;
    uint16_t mant = (uint16_t)(ldexp(r, -(ex - 1)) * 1024.0 - 1024.0);
    return (uint16_t)(sign | (exp16 << 10) | mant);
}

/* fp32 -> bf16 by comparing the dropped half-word with one half, the textbook way. */
static uint16_t ref_f32_to_bf16(uint32_t bits)
{
    uint16_t upper = (uint16_t)(bits >> 16);
    uint16_t lower = (uint16_t)(bits & 0xffffu);
    if (f32_is_nan(bits))
        return (uint16_t)(upper | 0x0040u);
    if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u)))
        upper++;
    return upper;
}

/* ---- names, sizes, parsing ---- */

static void test_names_and_sizes(void)
{
    CU_ASSERT_EQUAL(pshard_dtype_size(PSHARD_FP32), 4);
    CU_ASSERT_EQUAL(pshard_dtype_size(PSHARD_BF16), 2);
    CU_ASSERT_EQUAL(pshard_dtype_size(PSHARD_FP16), 2);
    CU_ASSERT_EQUAL(pshard_dtype_size(PSHARD_INT64), 8);
    CU_ASSERT_EQUAL(pshard_dtype_size(PSHARD_FP64), 8);
    CU_ASSERT_EQUAL(pshard_dtype_size(PSHARD_INT32), 4);
    CU_ASSERT_EQUAL(pshard_dtype_size(PSHARD_UINT8), 1);
    CU_ASSERT_EQUAL(pshard_dtype_size((pshard_dtype_t)PSHARD_DTYPE_COUNT), 0);
    CU_ASSERT_STRING_EQUAL(pshard_dtype_name(PSHARD_FP64), "fp64");
    CU_ASSERT_STRING_EQUAL(pshard_dtype_name(PSHARD_INT32), "int32");
    CU_ASSERT_STRING_EQUAL(pshard_dtype_name(PSHARD_UINT8), "uint8");
    CU_ASSERT_STRING_EQUAL(pshard_dtype_name(PSHARD_FP32), "fp32");
    CU_ASSERT_STRING_EQUAL(pshard_dtype_name(PSHARD_BF16), "bf16");
    CU_ASSERT_STRING_EQUAL(pshard_dtype_name(PSHARD_FP16), "fp16");
    CU_ASSERT_STRING_EQUAL(pshard_dtype_name(PSHARD_INT64), "int64");
    CU_ASSERT_STRING_EQUAL(pshard_dtype_name((pshard_dtype_t)9), "unknown");

    static const struct {
        const char *text;
        pshard_dtype_t dtype;
    } ok[] = {{"fp32", PSHARD_FP32},     {"float32", PSHARD_FP32}, {"bf16", PSHARD_BF16},
              {"bfloat16", PSHARD_BF16}, {"fp16", PSHARD_FP16},    {"float16", PSHARD_FP16},
              {"int64", PSHARD_INT64},   {"fp64", PSHARD_FP64},    {"float64", PSHARD_FP64},
              {"int32", PSHARD_INT32},   {"uint8", PSHARD_UINT8}};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        pshard_dtype_t d = (pshard_dtype_t)99;
        CU_ASSERT_EQUAL(pshard_dtype_parse(ok[i].text, &d), 0);
        CU_ASSERT_EQUAL(d, ok[i].dtype);
    }
    static const char *const bad[] = {"", "fp", "fp8", "int16", "fp32 ", "FP32x", "bf16\n"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        pshard_dtype_t d = PSHARD_INT64;
        CU_ASSERT_EQUAL(pshard_dtype_parse(bad[i], &d), -1);
        CU_ASSERT_EQUAL(d, PSHARD_INT64);
    }
    pshard_dtype_t d;
    CU_ASSERT_EQUAL(pshard_dtype_parse(NULL, &d), -1);
}

/* ---- fp16 ---- */

/* All 65536 fp16 patterns: widening matches the definition exactly, and narrowing the result
 * gives the same bits back (NaNs: still NaN, same sign and payload, quiet bit set). */
static void test_f16_exhaustive_round_trip(void)
{
    unsigned bad_value = 0, bad_trip = 0, nans = 0;
    for (uint32_t h = 0; h <= 0xffffu; h++) {
        float f = ps_f16_to_f32((uint16_t)h);
        uint16_t back = ps_f32_to_f16(f);
        if (f16_is_nan((uint16_t)h)) {
            nans++;
            uint32_t fb = bits_of(f);
            if (!isnan(f) || (fb & 0x00400000u) == 0 || (fb >> 31) != (h >> 15) ||
                ((fb >> 13) & 0x1ffu) != (h & 0x1ffu))
                bad_value++;
            if (!f16_is_nan(back) || back != (uint16_t)(h | 0x0200u))
                bad_trip++;
            continue;
        }
        double want = ref_f16_value((uint16_t)h);
        if ((double)f != want || !signbit(f) != !signbit(want))
            bad_value++;
        if (back != h) {
            if (bad_trip < 5)
                fprintf(stderr, "fp16 0x%04x -> %a -> 0x%04x\n", h, (double)f, back);
            bad_trip++;
        }
    }
    CU_ASSERT_EQUAL(nans, 2 * 1023);
    CU_ASSERT_EQUAL(bad_value, 0);
    CU_ASSERT_EQUAL(bad_trip, 0);
}

/* Compares ps_f32_to_f16 with the reference for bits in [lo, hi] (and their negatives when
 * both_signs); returns the number of mismatches, printing the first few. */
static unsigned check_f16_range(uint32_t lo, uint32_t hi, int both_signs)
{
    unsigned bad = 0;
    for (uint64_t b = lo; b <= hi; b++) {
        for (int s = 0; s <= both_signs; s++) {
            uint32_t bits = (uint32_t)b ^ (s ? 0x80000000u : 0u);
            uint16_t got = ps_f32_to_f16(f32_of(bits));
            uint16_t want = ref_f32_to_f16(bits);
            if (got != want) {
                if (bad < 5)
                    fprintf(stderr, "fp32 0x%08x -> fp16 0x%04x, want 0x%04x\n", bits, got, want);
                bad++;
            }
        }
    }
    return bad;
}

/* Every fp32 in whole binades that exercise each path (normal rounding, subnormal rounding,
 * below the smallest subnormal), plus windows around every boundary. */
static void test_f16_rounding_exhaustive_ranges(void)
{
    unsigned bad = 0;
    bad += check_f16_range(0x3f800000u, 0x3fffffffu, 1); /* [1, 2): normal path */
    bad += check_f16_range(0x38000000u, 0x387fffffu, 1); /* [2^-15, 2^-14): subnormal */
    bad += check_f16_range(0x33000000u, 0x337fffffu, 0); /* [2^-25, 2^-24): 0 or 1 */
    bad += check_f16_range(0x32800000u, 0x32ffffffu, 0); /* [2^-26, 2^-25): all to 0 */
    /* Windows of +-2^16 patterns around: 0 and fp32 subnormals, 2^-24, 2^-14 (subnormal to
     * normal), 2^-13, 65504/65520 (largest finite, overflow tie), 65536, fp32 max, Inf and the NaNs
     * above it. */
    static const uint32_t centres[] = {0x00010000u, 0x00800000u, 0x33800000u, 0x38800000u,
                                       0x39000000u, 0x477fe000u, 0x477ff000u, 0x47800000u,
                                       0x7f7f0000u, 0x7f800000u};
    for (size_t i = 0; i < sizeof centres / sizeof centres[0]; i++)
        bad += check_f16_range(centres[i] - 0x10000u, centres[i] + 0xffffu, 1);
    CU_ASSERT_EQUAL(bad, 0);
}

/* Tens of millions of random fp32 bit patterns (any exponent, both signs). NaNs are checked
 * for NaN-ness, sign and payload instead of bits. */
static void test_f16_rounding_random(void)
{
    unsigned bad = 0, nans = 0;
    for (uint32_t i = 0; i < 24000000u; i++) {
        uint32_t bits = rnd32();
        /* Half the draws concentrate on fp16's exponent range, where rounding happens. */
        if (i & 1)
            bits = (bits & 0x80ffffffu) | ((uint32_t)(0x66 + (bits >> 24) % 0x2a) << 23);
        uint16_t got = ps_f32_to_f16(f32_of(bits));
        if (f32_is_nan(bits)) {
            nans++;
            uint16_t want =
                (uint16_t)(((bits >> 16) & 0x8000u) | 0x7e00u | ((bits >> 13) & 0x3ffu));
            if (got != want)
                bad++;
            continue;
        }
        if (got != ref_f32_to_f16(bits)) {
            if (bad < 5)
                fprintf(stderr, "fp32 0x%08x -> fp16 0x%04x, want 0x%04x\n", bits, got,
                        ref_f32_to_f16(bits));
            bad++;
        }
    }
    CU_ASSERT(nans > 0);
    CU_ASSERT_EQUAL(bad, 0);
}

static void test_f16_special_cases(void)
{
    static const struct {
        uint32_t f32;
        uint16_t f16;
    } cases[] = {
        {0x00000000u, 0x0000}, /* +0 */
        {0x80000000u, 0x8000}, /* -0 keeps its sign */
        {0x3f800000u, 0x3c00}, /* 1 */
        {0x3f801000u, 0x3c00}, /* 1 + 2^-11: tie, even stays down */
        {0x3f803000u, 0x3c02}, /* 1 + 3*2^-11: tie, odd goes up to even */
        {0x3f801001u, 0x3c01}, /* just above the tie */
        {0x3f800fffu, 0x3c00}, /* just below the tie */
        {0x477fe000u, 0x7bff}, /* 65504, largest finite */
        {0x477fefffu, 0x7bff}, /* just below the overflow tie */
        {0x477ff000u, 0x7c00}, /* 65520: tie between 65504 (odd) and 2^16 -> Inf */
        {0x47800000u, 0x7c00}, /* 65536 */
        {0x7f7fffffu, 0x7c00}, /* fp32 max */
        {0xc77ff000u, 0xfc00}, /* -65520 -> -Inf */
        {0x7f800000u, 0x7c00}, /* Inf */
        {0xff800000u, 0xfc00}, /* -Inf */
        {0x7fc00000u, 0x7e00}, /* quiet NaN */
        {0xffc00000u, 0xfe00}, /* negative NaN keeps its sign */
        {0x7f802000u, 0x7e01}, /* signalling NaN: payload kept, quieted */
        {0x7f800001u, 0x7e00}, /* payload only in dropped bits: still NaN, never Inf */
        {0x387fc000u, 0x03ff}, /* largest subnormal */
        {0x387fe000u, 0x0400}, /* tie between largest subnormal (odd) and 2^-14 */
        {0x38800000u, 0x0400}, /* 2^-14, smallest normal */
        {0x33800000u, 0x0001}, /* 2^-24, smallest subnormal */
        {0x33000000u, 0x0000}, /* 2^-25: tie between 0 and 2^-24 -> 0 (even) */
        {0x33000001u, 0x0001}, /* just above that tie */
        {0xb3000001u, 0x8001}, /* and negative */
        {0x33c00000u, 0x0002}, /* 3*2^-25: tie between 1 and 2 -> 2 */
        {0x32800000u, 0x0000}, /* 2^-26 */
        {0x00000001u, 0x0000}, /* smallest fp32 subnormal */
        {0x80000001u, 0x8000}, /* -smallest fp32 subnormal -> -0 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t got = ps_f32_to_f16(f32_of(cases[i].f32));
        if (got != cases[i].f16)
            fprintf(stderr, "fp32 0x%08x -> 0x%04x, want 0x%04x\n", cases[i].f32, got,
                    cases[i].f16);
        CU_ASSERT_EQUAL(got, cases[i].f16);
    }
    CU_ASSERT(isinf(ps_f16_to_f32(0x7c00)) && ps_f16_to_f32(0x7c00) > 0);
    CU_ASSERT(isinf(ps_f16_to_f32(0xfc00)) && ps_f16_to_f32(0xfc00) < 0);
    CU_ASSERT(isnan(ps_f16_to_f32(0x7c01)));
    CU_ASSERT_EQUAL(bits_of(ps_f16_to_f32(0x7c01)), 0x7fc02000u); /* quieted, payload kept */
    CU_ASSERT_EQUAL(ps_f16_to_f32(0x0001), ldexpf(1.0f, -24));
    CU_ASSERT_EQUAL(ps_f16_to_f32(0x7bff), 65504.0f);
}

/* ---- bf16 ---- */

static void test_bf16_exhaustive_round_trip(void)
{
    unsigned bad_value = 0, bad_trip = 0;
    for (uint32_t h = 0; h <= 0xffffu; h++) {
        float f = ps_bf16_to_f32((uint16_t)h);
        uint16_t back = ps_f32_to_bf16(f);
        uint32_t want_bits = h << 16;
        if (f32_is_nan(want_bits)) {
            if (bits_of(f) != (want_bits | 0x00400000u))
                bad_value++;
            if (back != (uint16_t)(h | 0x0040u))
                bad_trip++;
            continue;
        }
        if (bits_of(f) != want_bits)
            bad_value++;
        if (back != h)
            bad_trip++;
    }
    CU_ASSERT_EQUAL(bad_value, 0);
    CU_ASSERT_EQUAL(bad_trip, 0);
}

static void test_bf16_rounding_random(void)
{
    unsigned bad = 0;
    for (uint32_t i = 0; i < 4000000u; i++) {
        uint32_t bits = rnd32();
        switch (i & 7) {
        case 0: /* force a tie */
            bits = (bits & 0xffff0000u) | 0x8000u;
            break;
        case 1: /* NaN or Inf */
            bits |= 0x7f800000u;
            break;
        case 2: /* subnormal */
            bits &= 0x807fffffu;
            break;
        case 3: /* near overflow */
            bits = (bits & 0x8000ffffu) | 0x7f7f0000u;
            break;
        default:
            break;
        }
        uint16_t got = ps_f32_to_bf16(f32_of(bits));
        uint16_t want = ref_f32_to_bf16(bits);
        if (got != want) {
            if (bad < 5)
                fprintf(stderr, "fp32 0x%08x -> bf16 0x%04x, want 0x%04x\n", bits, got, want);
            bad++;
        }
    }
    CU_ASSERT_EQUAL(bad, 0);
}

static void test_bf16_special_cases(void)
{
    static const struct {
        uint32_t f32;
        uint16_t bf16;
    } cases[] = {
        {0x3f808000u, 0x3f80}, /* 1 + 2^-8: tie, even stays */
        {0x3f818000u, 0x3f82}, /* tie with odd upper half: up to even */
        {0x3f808001u, 0x3f81}, /* just above the tie */
        {0x3f807fffu, 0x3f80}, /* just below */
        {0x7f7f7fffu, 0x7f7f}, /* largest that stays finite */
        {0x7f7f8000u, 0x7f80}, /* tie between max (odd) and 2^128 -> Inf */
        {0x7f7fffffu, 0x7f80}, /* fp32 max -> Inf */
        {0xff7fffffu, 0xff80}, /* -fp32 max -> -Inf */
        {0x7f800000u, 0x7f80}, /* Inf */
        {0xff800000u, 0xff80}, /* -Inf */
        {0x7fffffffu, 0x7fff}, /* NaN with all payload bits must not carry into Inf/sign */
        {0xffffffffu, 0xffff},
        {0x7f800001u, 0x7fc0}, /* sNaN with low payload only: quiet NaN, never Inf */
        {0xff800001u, 0xffc0},
        {0x7fa00000u, 0x7fe0}, /* sNaN keeps its top payload bits */
        {0x00008000u, 0x0000}, /* subnormal tie, even */
        {0x00018000u, 0x0002}, /* subnormal tie, odd -> up */
        {0x807fffffu, 0x8080}, /* largest negative subnormal rounds to -min normal */
        {0x80000000u, 0x8000},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t got = ps_f32_to_bf16(f32_of(cases[i].f32));
        if (got != cases[i].bf16)
            fprintf(stderr, "fp32 0x%08x -> 0x%04x, want 0x%04x\n", cases[i].f32, got,
                    cases[i].bf16);
        CU_ASSERT_EQUAL(got, cases[i].bf16);
    }
    CU_ASSERT_EQUAL(bits_of(ps_bf16_to_f32(0x7f81)), 0x7fc10000u); /* widening quiets */
}

/* ---- bulk conversions and ps_convert ---- */

#define CONVERT_N 3001 /* more than one internal block */

static void test_bulk_matches_scalar(void)
{
    static float f32[CONVERT_N], f32_back[CONVERT_N];
    static uint16_t h[CONVERT_N];
    unsigned bad = 0;
    for (size_t i = 0; i < CONVERT_N; i++)
        f32[i] = f32_of(rnd32());
    ps_convert_f32_to_bf16(f32, h, CONVERT_N);
    for (size_t i = 0; i < CONVERT_N; i++)
        bad += h[i] != ps_f32_to_bf16(f32[i]);
    ps_convert_bf16_to_f32(h, f32_back, CONVERT_N);
    for (size_t i = 0; i < CONVERT_N; i++)
        bad += bits_of(f32_back[i]) != bits_of(ps_bf16_to_f32(h[i]));
    ps_convert_f32_to_f16(f32, h, CONVERT_N);
    for (size_t i = 0; i < CONVERT_N; i++)
        bad += h[i] != ps_f32_to_f16(f32[i]);
    ps_convert_f16_to_f32(h, f32_back, CONVERT_N);
    for (size_t i = 0; i < CONVERT_N; i++)
        bad += bits_of(f32_back[i]) != bits_of(ps_f16_to_f32(h[i]));
    CU_ASSERT_EQUAL(bad, 0);
}

/* The vectorised bulk loops agree with the scalar functions on every half pattern and on every
 * fp32 pattern of whole windows (each path: zero, subnormal, normal, overflow, Inf, NaN),
 * at odd offsets and lengths so that both the blocked part and the tail run. */
static void test_bulk_exhaustive(void)
{
    static uint16_t all_h[65536 + 7], h_out[65536 + 7];
    static float f[65536 + 7];
    unsigned bad = 0;
    for (uint32_t i = 0; i < 65536; i++)
        all_h[i + 3] = (uint16_t)i;
    ps_convert_f16_to_f32(all_h + 3, f + 1, 65536);
    for (uint32_t i = 0; i < 65536; i++)
        bad += bits_of(f[i + 1]) != bits_of(ps_f16_to_f32((uint16_t)i));
    ps_convert_bf16_to_f32(all_h + 3, f + 1, 65536);
    for (uint32_t i = 0; i < 65536; i++)
        bad += bits_of(f[i + 1]) != bits_of(ps_bf16_to_f32((uint16_t)i));

    static const uint32_t starts[] = {0x00000000u, 0x32ff8000u, 0x387f8000u, 0x3f800000u,
                                      0x477f8000u, 0x7f7f8000u, 0x7fff8000u, 0xb87f8000u,
                                      0xff7f8000u, 0xffff0000u};
    for (size_t s = 0; s < sizeof starts / sizeof starts[0]; s++) {
        for (uint32_t i = 0; i < 65536 + 5; i++)
            f[i] = f32_of(starts[s] + i);
        ps_convert_f32_to_f16(f, h_out + 1, 65536 + 5);
        for (uint32_t i = 0; i < 65536 + 5; i++)
            bad += h_out[i + 1] != ps_f32_to_f16(f[i]);
        ps_convert_f32_to_bf16(f, h_out + 1, 65536 + 5);
        for (uint32_t i = 0; i < 65536 + 5; i++)
            bad += h_out[i + 1] != ps_f32_to_bf16(f[i]);
    }
    CU_ASSERT_EQUAL(bad, 0);
}

/* Every pair: floats convert through fp32 (one rounding), int64 only to itself. */
static void test_convert_pairs(void)
{
    static float f32[CONVERT_N], f32_out[CONVERT_N];
    static uint16_t bf16[CONVERT_N], f16[CONVERT_N], h_out[CONVERT_N];
    static int64_t i64[CONVERT_N], i64_out[CONVERT_N];
    for (size_t i = 0; i < CONVERT_N; i++) {
        f32[i] = f32_of(rnd32());
        bf16[i] = (uint16_t)rnd32();
        f16[i] = (uint16_t)rnd32();
        i64[i] = (int64_t)(((uint64_t)rnd32() << 32) | rnd32());
    }
    unsigned bad = 0;

    CU_ASSERT_EQUAL(pshard_convert(f32, PSHARD_FP32, f32_out, PSHARD_FP32, CONVERT_N), 0);
    CU_ASSERT(memcmp(f32, f32_out, sizeof f32) == 0);
    CU_ASSERT_EQUAL(pshard_convert(f32, PSHARD_FP32, h_out, PSHARD_BF16, CONVERT_N), 0);
    for (size_t i = 0; i < CONVERT_N; i++)
        bad += h_out[i] != ps_f32_to_bf16(f32[i]);
    CU_ASSERT_EQUAL(pshard_convert(f32, PSHARD_FP32, h_out, PSHARD_FP16, CONVERT_N), 0);
    for (size_t i = 0; i < CONVERT_N; i++)
        bad += h_out[i] != ps_f32_to_f16(f32[i]);
    CU_ASSERT_EQUAL(pshard_convert(bf16, PSHARD_BF16, f32_out, PSHARD_FP32, CONVERT_N), 0);
    for (size_t i = 0; i < CONVERT_N; i++)
        bad += bits_of(f32_out[i]) != bits_of(ps_bf16_to_f32(bf16[i]));
    CU_ASSERT_EQUAL(pshard_convert(f16, PSHARD_FP16, f32_out, PSHARD_FP32, CONVERT_N), 0);
    for (size_t i = 0; i < CONVERT_N; i++)
        bad += bits_of(f32_out[i]) != bits_of(ps_f16_to_f32(f16[i]));
    CU_ASSERT_EQUAL(pshard_convert(bf16, PSHARD_BF16, h_out, PSHARD_FP16, CONVERT_N), 0);
    for (size_t i = 0; i < CONVERT_N; i++)
        bad += h_out[i] != ps_f32_to_f16(ps_bf16_to_f32(bf16[i]));
    CU_ASSERT_EQUAL(pshard_convert(f16, PSHARD_FP16, h_out, PSHARD_BF16, CONVERT_N), 0);
    for (size_t i = 0; i < CONVERT_N; i++)
        bad += h_out[i] != ps_f32_to_bf16(ps_f16_to_f32(f16[i]));
    CU_ASSERT_EQUAL(pshard_convert(bf16, PSHARD_BF16, h_out, PSHARD_BF16, CONVERT_N), 0);
    CU_ASSERT(memcmp(bf16, h_out, sizeof bf16) == 0);
    CU_ASSERT_EQUAL(pshard_convert(i64, PSHARD_INT64, i64_out, PSHARD_INT64, CONVERT_N), 0);
    CU_ASSERT(memcmp(i64, i64_out, sizeof i64) == 0);
    CU_ASSERT_EQUAL(bad, 0);

    /* Unsupported pairs and unknown types leave dst alone. */
    memset(i64_out, 0, sizeof i64_out);
    CU_ASSERT_EQUAL(pshard_convert(f32, PSHARD_FP32, i64_out, PSHARD_INT64, 4), -1);
    CU_ASSERT_EQUAL(pshard_convert(i64, PSHARD_INT64, f32_out, PSHARD_FP32, 4), -1);
    CU_ASSERT_EQUAL(pshard_convert(i64, PSHARD_INT64, h_out, PSHARD_BF16, 4), -1);
    CU_ASSERT_EQUAL(pshard_convert(f16, PSHARD_FP16, i64_out, PSHARD_INT64, 4), -1);
    CU_ASSERT_EQUAL(pshard_convert(f32, (pshard_dtype_t)7, f32_out, PSHARD_FP32, 4), -1);
    CU_ASSERT_EQUAL(pshard_convert(f32, PSHARD_FP32, f32_out, (pshard_dtype_t)9, 4), -1);
    CU_ASSERT_EQUAL(pshard_convert(f32, PSHARD_FP32, i64_out, PSHARD_FP64, 4), -1);
    CU_ASSERT_EQUAL(pshard_convert(f32, PSHARD_FP32, i64_out, PSHARD_INT32, 4), -1);
    CU_ASSERT_EQUAL(pshard_convert(f16, PSHARD_FP16, i64_out, PSHARD_UINT8, 4), -1);
    CU_ASSERT_EQUAL(i64_out[0], 0);
    CU_ASSERT_EQUAL(pshard_convert(f32, PSHARD_FP32, h_out, PSHARD_BF16, 0), 0);
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"names_and_sizes", test_names_and_sizes},
        {"f16_exhaustive_round_trip", test_f16_exhaustive_round_trip},
        {"f16_rounding_exhaustive_ranges", test_f16_rounding_exhaustive_ranges},
        {"f16_rounding_random", test_f16_rounding_random},
        {"f16_special_cases", test_f16_special_cases},
        {"bf16_exhaustive_round_trip", test_bf16_exhaustive_round_trip},
        {"bf16_rounding_random", test_bf16_rounding_random},
        {"bf16_special_cases", test_bf16_special_cases},
        {"bulk_matches_scalar", test_bulk_matches_scalar},
        {"bulk_exhaustive", test_bulk_exhaustive},
        {"convert_pairs", test_convert_pairs},
        {NULL, NULL},
    };
    return ps_test_main("common_dtype", cases);
}
