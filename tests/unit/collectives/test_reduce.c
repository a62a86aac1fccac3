/* Unit tests for the reduction kernels (coll_reduce.h): load, accumulate and store for every
 * dtype against a double-precision reference on random non-zero data, AVG-style scaling, and
 * that half types accumulate in fp32 and round exactly once at the end (also when scaled). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "coll_reduce.h"
#include "pshard/collectives.h"
#include "ps_test.h"

#define N_ELEMS 2500 /* spans more than one internal block */
#define MAX_RANKS 8

static uint64_t rng_state = 0x853c49e6748fea9bull;

static uint64_t rnd64(void)
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
    return (uint32_t)(rnd64() % n);
}

/* Rounds x to a binary format with p significand bits, minimum normal exponent emin and largest
 * finite value max_finite, to nearest even, by explicit arithmetic on the scaled significand. */
static double ref_round(double x, int p, int emin, double max_finite)
{
    if (x == 0.0 || isnan(x) || isinf(x))
        return x;
    double a = fabs(x);
    int ex;
    (void)frexp(a, &ex);
    int e = ex - 1 < emin ? emin : ex - 1;
    double quantum = ldexp(1.0, e - (p - 1));
    double scaled = a / quantum;
    double whole = floor(scaled);
    double frac = scaled - whole;
    if (frac > 0.5 || (frac == 0.5 && fmod(whole, 2.0) == 1.0))
        whole += 1.0;
    double r = whole * quantum;
    if (r > max_finite)
        r = INFINITY;
    return copysign(r, x);
}

static double ref_round_bf16(double x)
{
    return ref_round(x, 8, -126, ldexp(255.0, 120));
}

static double ref_round_f16(double x)
{
    return ref_round(x, 11, -14, 65504.0);
}

static double ref_round_dtype(double x, pshard_dtype_t dtype)
{
    return dtype == PSHARD_BF16 ? ref_round_bf16(x) : ref_round_f16(x);
}

static double half_value(uint16_t h, pshard_dtype_t dtype)
{
    return dtype == PSHARD_BF16 ? (double)ps_bf16_to_f32(h) : (double)ps_f16_to_f32(h);
}

/* Random non-zero half value: +-(1 + m) * 2^e with e in [-3, 3], so sums of up to 8 of them
 * are exact in fp32 and the double reference sum equals the fp32 accumulation. */
static uint16_t rnd_half(pshard_dtype_t dtype)
{
    int mant_bits = dtype == PSHARD_BF16 ? 7 : 10;
    double m = (double)((1u << mant_bits) + rnd_below(1u << mant_bits));
    double v = ldexp(m, (int)rnd_below(7) - 3 - mant_bits);
    if (rnd_below(2))
        v = -v;
    return dtype == PSHARD_BF16 ? ps_f32_to_bf16((float)v) : ps_f32_to_f16((float)v);
}

/* Random non-zero fp32 over a wide exponent range. */
static float rnd_f32(void)
{
    double m = (double)((1u << 23) + rnd_below(1u << 23));
    double v = ldexp(m, (int)rnd_below(41) - 20 - 23);
    return (float)(rnd_below(2) ? -v : v);
}

static void test_acc_dtype(void)
{
    CU_ASSERT_EQUAL(coll_acc_dtype(PSHARD_FP32), PSHARD_FP32);
    CU_ASSERT_EQUAL(coll_acc_dtype(PSHARD_BF16), PSHARD_FP32);
    CU_ASSERT_EQUAL(coll_acc_dtype(PSHARD_FP16), PSHARD_FP32);
    CU_ASSERT_EQUAL(coll_acc_dtype(PSHARD_INT64), PSHARD_INT64);
}

static void test_load_widens(void)
{
    static uint16_t h[N_ELEMS];
    static float acc[N_ELEMS];
    static float f[N_ELEMS];
    static int64_t i64[N_ELEMS], acc64[N_ELEMS];
    unsigned bad = 0;
    for (int d = PSHARD_BF16; d <= PSHARD_FP16; d++) {
        for (size_t i = 0; i < N_ELEMS; i++)
            h[i] = rnd_half((pshard_dtype_t)d);
        coll_reduce_load(acc, h, (pshard_dtype_t)d, N_ELEMS);
        for (size_t i = 0; i < N_ELEMS; i++)
            bad += (double)acc[i] != half_value(h[i], (pshard_dtype_t)d) || acc[i] == 0.0f;
    }
    for (size_t i = 0; i < N_ELEMS; i++) {
        f[i] = rnd_f32();
        i64[i] = (int64_t)rnd64();
    }
    coll_reduce_load(acc, f, PSHARD_FP32, N_ELEMS);
    CU_ASSERT(memcmp(acc, f, sizeof f) == 0);
    coll_reduce_load(acc64, i64, PSHARD_INT64, N_ELEMS);
    CU_ASSERT(memcmp(acc64, i64, sizeof i64) == 0);
    CU_ASSERT_EQUAL(bad, 0);
}

/* fp32: the accumulation is the in-order fp32 sum (bit for bit), within n*eps of the double
 * sum; the store multiplies by scale with one rounding and may be in place. */
static void test_fp32_sum_and_scale(void)
{
    enum { RANKS = 6 };
    static float in[RANKS][N_ELEMS], acc[N_ELEMS], out[N_ELEMS];
    for (int r = 0; r < RANKS; r++)
        for (size_t i = 0; i < N_ELEMS; i++)
            in[r][i] = rnd_f32();
    coll_reduce_load(acc, in[0], PSHARD_FP32, N_ELEMS);
    for (int r = 1; r < RANKS; r++)
        coll_reduce_accumulate(acc, in[r], PSHARD_FP32, PSHARD_REDUCE_SUM, N_ELEMS);

    const float scale = 1.0f / RANKS;
    unsigned bad = 0;
    for (size_t i = 0; i < N_ELEMS; i++) {
        float seq = in[0][i];
        double exact = in[0][i], magnitude = fabs(in[0][i]);
        for (int r = 1; r < RANKS; r++) {
            seq += in[r][i];
            exact += in[r][i];
            magnitude += fabs(in[r][i]);
        }
        bad += memcmp(&seq, &acc[i], sizeof seq) != 0;
        bad += fabs((double)acc[i] - exact) > RANKS * ldexp(1.0, -24) * magnitude;
    }
    CU_ASSERT_EQUAL(bad, 0);

    coll_reduce_store(out, PSHARD_FP32, acc, N_ELEMS, 1.0f);
    CU_ASSERT(memcmp(out, acc, sizeof out) == 0);
    coll_reduce_store(out, PSHARD_FP32, acc, N_ELEMS, scale);
    for (size_t i = 0; i < N_ELEMS; i++) {
        float want = (float)((double)acc[i] * (double)scale);
        bad += memcmp(&want, &out[i], sizeof want) != 0;
    }
    coll_reduce_store(acc, PSHARD_FP32, acc, N_ELEMS, scale); /* in place */
    CU_ASSERT(memcmp(out, acc, sizeof out) == 0);
    CU_ASSERT_EQUAL(bad, 0);
}

/* bf16/fp16: the fp32 accumulation equals the exact (double) sum for this data, and the store
 * equals the exact sum (times scale) rounded once to the element type. */
static void check_half_sum(pshard_dtype_t dtype, int ranks)
{
    static uint16_t in[MAX_RANKS][N_ELEMS], out[N_ELEMS];
    static float acc[N_ELEMS];
    static double exact[N_ELEMS];
    for (int r = 0; r < ranks; r++)
        for (size_t i = 0; i < N_ELEMS; i++)
            in[r][i] = rnd_half(dtype);
    coll_reduce_load(acc, in[0], dtype, N_ELEMS);
    for (int r = 1; r < ranks; r++)
        coll_reduce_accumulate(acc, in[r], dtype, PSHARD_REDUCE_SUM, N_ELEMS);
    unsigned bad = 0, rounded = 0;
    for (size_t i = 0; i < N_ELEMS; i++) {
        exact[i] = 0.0;
        for (int r = 0; r < ranks; r++)
            exact[i] += half_value(in[r][i], dtype);
        bad += (double)acc[i] != exact[i];
    }
    CU_ASSERT_EQUAL(bad, 0);

    const float scales[] = {1.0f, 1.0f / (float)ranks, 0.1f};
    for (size_t s = 0; s < sizeof scales / sizeof scales[0]; s++) {
        coll_reduce_store(out, dtype, acc, N_ELEMS, scales[s]);
        for (size_t i = 0; i < N_ELEMS; i++) {
            double want = ref_round_dtype(exact[i] * (double)scales[s], dtype);
            double got = half_value(out[i], dtype);
            if (got != want || !signbit(got) != !signbit(want)) {
                if (bad < 5)
                    fprintf(stderr, "%s sum %.17g * %g: got %.17g want %.17g\n",
                            pshard_dtype_name(dtype), exact[i], (double)scales[s], got, want);
                bad++;
            }
            rounded += want != exact[i] * (double)scales[s];
        }
    }
    CU_ASSERT_EQUAL(bad, 0);
    CU_ASSERT(rounded > N_ELEMS); /* the data really needed rounding */
}

static void test_bf16_sum_and_scale(void)
{
    check_half_sum(PSHARD_BF16, 7);
    check_half_sum(PSHARD_BF16, 8);
}

static void test_fp16_sum_and_scale(void)
{
    check_half_sum(PSHARD_FP16, 5);
    check_half_sum(PSHARD_FP16, 8);
}

/* int64 sums wrap modulo 2^64 and the store ignores scale. */
static void test_int64_sum(void)
{
    enum { RANKS = 5 };
    static int64_t in[RANKS][N_ELEMS], acc[N_ELEMS], out[N_ELEMS];
    for (int r = 0; r < RANKS; r++)
        for (size_t i = 0; i < N_ELEMS; i++) {
            uint64_t v = rnd64();
            in[r][i] = (int64_t)(i % 2 ? v : (v >> 40) + 1); /* large and small, never 0 */
        }
    coll_reduce_load(acc, in[0], PSHARD_INT64, N_ELEMS);
    for (int r = 1; r < RANKS; r++)
        coll_reduce_accumulate(acc, in[r], PSHARD_INT64, PSHARD_REDUCE_SUM, N_ELEMS);
    unsigned bad = 0;
    for (size_t i = 0; i < N_ELEMS; i++) {
        uint64_t want = 0;
        for (int r = 0; r < RANKS; r++)
            want += (uint64_t)in[r][i];
        bad += (uint64_t)acc[i] != want;
    }
    CU_ASSERT_EQUAL(bad, 0);
    coll_reduce_store(out, PSHARD_INT64, acc, N_ELEMS, 0.2f);
    CU_ASSERT(memcmp(out, acc, sizeof out) == 0);
    coll_reduce_store(acc, PSHARD_INT64, acc, N_ELEMS, 0.2f);
    CU_ASSERT(memcmp(out, acc, sizeof out) == 0);
}

/* 1 + 3 * (a quarter ulp): rounding after every addition never moves off 1, rounding the fp32
 * sum once gives 1 + ulp, which is what the exact sum rounds to. */
static void check_round_once(pshard_dtype_t dtype, int ulp_exp)
{
    float values[4] = {1.0f, ldexpf(1.0f, ulp_exp - 2), ldexpf(1.0f, ulp_exp - 2),
                       ldexpf(1.0f, ulp_exp - 2)};
    uint16_t in[4];
    CU_ASSERT_EQUAL(pshard_convert(values, PSHARD_FP32, in, dtype, 4), 0);

    uint16_t stepwise = in[0];
    for (int r = 1; r < 4; r++) {
        float sum = (float)half_value(stepwise, dtype) + (float)half_value(in[r], dtype);
        CU_ASSERT_EQUAL(pshard_convert(&sum, PSHARD_FP32, &stepwise, dtype, 1), 0);
    }

    float acc;
    uint16_t once;
    coll_reduce_load(&acc, &in[0], dtype, 1);
    for (int r = 1; r < 4; r++)
        coll_reduce_accumulate(&acc, &in[r], dtype, PSHARD_REDUCE_SUM, 1);
    coll_reduce_store(&once, dtype, &acc, 1, 1.0f);

    double exact = 1.0 + 3.0 * ldexp(1.0, ulp_exp - 2);
    CU_ASSERT_EQUAL(half_value(stepwise, dtype), 1.0);
    CU_ASSERT_EQUAL(half_value(once, dtype), 1.0 + ldexp(1.0, ulp_exp));
    CU_ASSERT_EQUAL(half_value(once, dtype), ref_round_dtype(exact, dtype));
    CU_ASSERT_NOT_EQUAL(once, stepwise);
}

static void test_round_once_not_per_step(void)
{
    check_round_once(PSHARD_BF16, -7);
    check_round_once(PSHARD_FP16, -10);
}

/* With a scale, rounding acc * scale to fp32 first and then to the half type is a double
 * rounding: find sums where that lands on a false tie and show the store does not. Also checks
 * a large random sample of scaled stores against the once-rounded reference. */
static void check_scaled_single_rounding(pshard_dtype_t dtype)
{
    const float scale = 1.0f / 3.0f;
    unsigned found = 0, bad = 0;
    for (uint32_t i = 0; i < 4000000u && found < 16; i++) {
        float acc = rnd_f32();
        double exact = (double)acc * (double)scale;
        if (fabs(exact) > 60000.0 || fabs(exact) < 1e-4)
            continue;
        float naive_f32 = acc * scale;
        uint16_t naive =
            dtype == PSHARD_BF16 ? ps_f32_to_bf16(naive_f32) : ps_f32_to_f16(naive_f32);
        double want = ref_round_dtype(exact, dtype);
        if (half_value(naive, dtype) == want)
            continue;
        found++;
        uint16_t got;
        coll_reduce_store(&got, dtype, &acc, 1, scale);
        bad += half_value(got, dtype) != want;
    }
    CU_ASSERT(found > 0); /* the trap exists for this scale */
    CU_ASSERT_EQUAL(bad, 0);

    static float acc[N_ELEMS];
    static uint16_t out[N_ELEMS];
    const float scales[] = {1.0f / 3.0f, 1.0f / 7.0f, 0.3f};
    for (int round = 0; round < 40; round++) {
        for (size_t i = 0; i < N_ELEMS; i++)
            acc[i] = rnd_f32();
        float s = scales[round % 3];
        coll_reduce_store(out, dtype, acc, N_ELEMS, s);
        for (size_t i = 0; i < N_ELEMS; i++) {
            double want = ref_round_dtype((double)acc[i] * (double)s, dtype);
            double got = half_value(out[i], dtype);
            bad += got != want || !signbit(got) != !signbit(want);
        }
    }
    CU_ASSERT_EQUAL(bad, 0);
}

/* Any fp32 accumulator bits (subnormals, huge values, Inf, NaN) and any scale: the scaled
 * store equals the exact product rounded once; NaN stays NaN. */
static void check_scaled_any_bits(pshard_dtype_t dtype)
{
    static float acc[N_ELEMS];
    static uint16_t out[N_ELEMS];
    unsigned bad = 0;
    for (int round = 0; round < 200; round++) {
        for (size_t i = 0; i < N_ELEMS; i++) {
            uint32_t bits = (uint32_t)rnd64();
            memcpy(&acc[i], &bits, sizeof bits);
        }
        uint32_t scale_bits = 0x3c000000u + (uint32_t)(rnd64() % 0x7000000u); /* ~2^-7..2^7 */
        float s;
        memcpy(&s, &scale_bits, sizeof s);
        coll_reduce_store(out, dtype, acc, N_ELEMS, s);
        for (size_t i = 0; i < N_ELEMS; i++) {
            double want = ref_round_dtype((double)acc[i] * (double)s, dtype);
            double got = half_value(out[i], dtype);
            if (isnan(want)) {
                bad += !isnan(got);
                continue;
            }
            if (got != want || !signbit(got) != !signbit(want)) {
                if (bad < 5)
                    fprintf(stderr, "%s %a * %a: got %a want %a\n", pshard_dtype_name(dtype),
                            (double)acc[i], (double)s, got, want);
                bad++;
            }
        }
    }
    CU_ASSERT_EQUAL(bad, 0);
}

static void test_scaled_store_rounds_once(void)
{
    check_scaled_any_bits(PSHARD_BF16);
    check_scaled_any_bits(PSHARD_FP16);
    check_scaled_single_rounding(PSHARD_BF16);
    check_scaled_single_rounding(PSHARD_FP16);
}

/* bf16 subnormal ties: acc is exactly a bf16 midpoint and the scale moves the exact product off
 * it by far less than half an fp32 ulp, so the product rounds back onto the midpoint in fp32
 * (and the residual underflows in fp32 unless the kernel guards against it). The once-rounded
 * result must follow the residual's sign, not the tie rule. */
static void test_scaled_store_subnormal_ties(void)
{
    const struct {
        uint32_t acc_bits;   /* a bf16 subnormal midpoint (k + 1/2) * 2^-133 */
        uint32_t scale_bits; /* 1 + 2^-23 or 1 - 2^-24 */
        uint16_t want;
        uint16_t tie_rule; /* what rounding the fp32 product would give */
    } cases[] = {
        {0x00028000u, 0x3f800001u, 0x0003, 0x0002}, /* 2.5 + eps -> 3 (tie rule: 2) */
        {0x00038000u, 0x3f7fffffu, 0x0003, 0x0004}, /* 3.5 - eps -> 3 (tie rule: 4) */
        {0x80028000u, 0x3f800001u, 0x8003, 0x8002}, /* and negative */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        float acc, scale;
        memcpy(&acc, &cases[i].acc_bits, sizeof acc);
        memcpy(&scale, &cases[i].scale_bits, sizeof scale);
        CU_ASSERT_EQUAL(ps_f32_to_bf16(acc * scale), cases[i].tie_rule);
        uint16_t got;
        coll_reduce_store(&got, PSHARD_BF16, &acc, 1, scale);
        CU_ASSERT_EQUAL(got, cases[i].want);
        CU_ASSERT_EQUAL(half_value(got, PSHARD_BF16), ref_round_bf16((double)acc * (double)scale));
    }
}

/* Overflow and specials survive the store: Inf stays Inf, NaN stays NaN, too large -> Inf. */
static void test_store_specials(void)
{
    float acc[5] = {INFINITY, -INFINITY, NAN, 3.0e38f, 70000.0f};
    uint16_t out[5];
    coll_reduce_store(out, PSHARD_BF16, acc, 5, 1.0f);
    CU_ASSERT_EQUAL(out[0], 0x7f80);
    CU_ASSERT_EQUAL(out[1], 0xff80);
    CU_ASSERT(isnan(ps_bf16_to_f32(out[2])));
    CU_ASSERT_EQUAL(out[3], ps_f32_to_bf16(3.0e38f));
    coll_reduce_store(out, PSHARD_FP16, acc, 5, 0.5f);
    CU_ASSERT_EQUAL(out[0], 0x7c00);
    CU_ASSERT_EQUAL(out[1], 0xfc00);
    CU_ASSERT(isnan(ps_f16_to_f32(out[2])));
    CU_ASSERT_EQUAL(out[3], 0x7c00);
    CU_ASSERT_EQUAL(out[4], ps_f32_to_f16(35000.0f));
    float big = 3.4e38f;
    coll_reduce_store(out, PSHARD_BF16, &big, 1, 4.0f); /* product beyond fp32 -> Inf */
    CU_ASSERT_EQUAL(out[0], 0x7f80);
}

/* product, min, max over fp32 (NaN winning, in either position; -0/+0; Inf) and over bf16,
 * against the element-wise reference, for lengths that cover the vector loop and its tail. */
static void test_float_ops(void)
{
    enum { N = 37 };
    float a[N], b[N];
    for (int i = 0; i < N; i++) {
        a[i] = (float)(i % 7) - 3.5f;
        b[i] = (float)((i * 5) % 11) - 4.25f;
    }
    a[3] = NAN;
    b[9] = NAN;
    a[20] = INFINITY;
    b[21] = -INFINITY;
    static const int ops[] = {PSHARD_REDUCE_PRODUCT, PSHARD_REDUCE_MIN, PSHARD_REDUCE_MAX};
    for (size_t k = 0; k < sizeof(ops) / sizeof(ops[0]); k++) {
        float acc[N];
        coll_reduce_load(acc, a, PSHARD_FP32, N);
        coll_reduce_accumulate(acc, b, PSHARD_FP32, ops[k], N);
        for (int i = 0; i < N; i++) {
            float want = ops[k] == PSHARD_REDUCE_PRODUCT ? a[i] * b[i]
                         : isnan(a[i]) || isnan(b[i])    ? NAN
                         : ops[k] == PSHARD_REDUCE_MIN   ? fminf(a[i], b[i])
                                                         : fmaxf(a[i], b[i]);
            if (isnan(want)) {
                CU_ASSERT(isnan(acc[i]));
            } else {
                CU_ASSERT_EQUAL(acc[i], want);
            }
        }
    }
    /* bf16: max of exactly representable values stores back exactly. */
    uint16_t ha[N], hb[N], out[N];
    for (int i = 0; i < N; i++) {
        ha[i] = ps_f32_to_bf16((float)(i % 5) - 2.0f);
        hb[i] = ps_f32_to_bf16((float)(i % 3) - 1.0f);
    }
    float acc[N];
    coll_reduce_load(acc, ha, PSHARD_BF16, N);
    coll_reduce_accumulate(acc, hb, PSHARD_BF16, PSHARD_REDUCE_MAX, N);
    coll_reduce_store(out, PSHARD_BF16, acc, N, 1.0f);
    for (int i = 0; i < N; i++) {
        float x = (float)(i % 5) - 2.0f, y = (float)(i % 3) - 1.0f;
        CU_ASSERT_EQUAL(ps_bf16_to_f32(out[i]), x > y ? x : y);
    }
}

/* int64: product and sum wrap modulo 2^64; min, max, band, bor, bxor. */
static void test_int64_ops(void)
{
    enum { N = 21 };
    int64_t a[N], b[N];
    for (int i = 0; i < N; i++) {
        a[i] = (int64_t)i * 0x0123456789abLL - 7;
        b[i] = -(int64_t)i * 977 + 0x5555;
    }
    a[4] = INT64_MAX;
    b[4] = 2; /* the product wraps */
    static const int ops[] = {PSHARD_REDUCE_SUM, PSHARD_REDUCE_PRODUCT, PSHARD_REDUCE_MIN,
                              PSHARD_REDUCE_MAX, PSHARD_REDUCE_BAND,    PSHARD_REDUCE_BOR,
                              PSHARD_REDUCE_BXOR};
    for (size_t k = 0; k < sizeof(ops) / sizeof(ops[0]); k++) {
        int64_t acc[N];
        coll_reduce_load(acc, a, PSHARD_INT64, N);
        coll_reduce_accumulate(acc, b, PSHARD_INT64, ops[k], N);
        for (int i = 0; i < N; i++) {
            uint64_t x = (uint64_t)a[i], y = (uint64_t)b[i];
            int64_t want = 0;
            switch (ops[k]) {
            case PSHARD_REDUCE_SUM:
                want = (int64_t)(x + y);
                break;
            case PSHARD_REDUCE_PRODUCT:
                want = (int64_t)(x * y);
                break;
            case PSHARD_REDUCE_MIN:
                want = a[i] < b[i] ? a[i] : b[i];
                break;
            case PSHARD_REDUCE_MAX:
                want = a[i] > b[i] ? a[i] : b[i];
                break;
            case PSHARD_REDUCE_BAND:
                want = (int64_t)(x & y);
                break;
            case PSHARD_REDUCE_BOR:
                want = (int64_t)(x | y);
                break;
            default:
                want = (int64_t)(x ^ y);
            }
            CU_ASSERT_EQUAL(acc[i], want);
        }
    }
    CU_ASSERT_EQUAL((int64_t)((uint64_t)INT64_MAX * 2u), -2);
}

/* Names and which dtypes each reduction is defined for. */
static void test_reduce_names_and_problems(void)
{
    CU_ASSERT_STRING_EQUAL(pshard_reduce_name(PSHARD_REDUCE_MAX), "max");
    CU_ASSERT_STRING_EQUAL(pshard_reduce_name(PSHARD_REDUCE_BXOR), "bxor");
    CU_ASSERT_STRING_EQUAL(pshard_reduce_name((pshard_reduce_t)99), "unknown");
    CU_ASSERT_PTR_NULL(pshard_reduce_problem(PSHARD_REDUCE_MIN, PSHARD_BF16));
    CU_ASSERT_PTR_NULL(pshard_reduce_problem(PSHARD_REDUCE_BOR, PSHARD_INT64));
    CU_ASSERT_PTR_NOT_NULL(pshard_reduce_problem(PSHARD_REDUCE_AVG, PSHARD_INT64));
    CU_ASSERT_PTR_NOT_NULL(
        strstr(pshard_reduce_problem(PSHARD_REDUCE_BAND, PSHARD_FP32), "integer"));
    CU_ASSERT_PTR_NOT_NULL(pshard_reduce_problem((pshard_reduce_t)8, PSHARD_FP32));
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"acc_dtype", test_acc_dtype},
        {"load_widens", test_load_widens},
        {"fp32_sum_and_scale", test_fp32_sum_and_scale},
        {"bf16_sum_and_scale", test_bf16_sum_and_scale},
        {"fp16_sum_and_scale", test_fp16_sum_and_scale},
        {"int64_sum", test_int64_sum},
        {"round_once_not_per_step", test_round_once_not_per_step},
        {"scaled_store_rounds_once", test_scaled_store_rounds_once},
        {"scaled_store_subnormal_ties", test_scaled_store_subnormal_ties},
        {"store_specials", test_store_specials},
        {"float_ops", test_float_ops},
        {"int64_ops", test_int64_ops},
        {"reduce_names_and_problems", test_reduce_names_and_problems},
        {NULL, NULL},
    };
    return ps_test_main("coll_reduce", cases);
}
