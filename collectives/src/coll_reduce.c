/* Reduction kernels: load a contribution into the accumulation type, add further contributions,
 * and store the (optionally scaled) result rounded once to the element type. Half types are
 * widened in blocks through a stack buffer so that every inner loop is a plain array loop, and
 * loops run VEC elements at a time plus a scalar tail, the shape gcc -O2's "very cheap"
 * vectoriser cost model accepts (see dtype.c). */
#include "coll_reduce.h"

#include "pshard/collectives.h"

#include <math.h>
#include <string.h>

#define COLL_REDUCE_BLOCK 1024
#define VEC 16

static bool is_integer(pshard_dtype_t dtype)
{
    return dtype == PSHARD_INT64 || dtype == PSHARD_INT32 || dtype == PSHARD_UINT8;
}

const char *pshard_reduce_name(pshard_reduce_t reduce)
{
    static const char *const names[PSHARD_REDUCE_COUNT] = {"sum", "avg",  "product", "min",
                                                           "max", "band", "bor",     "bxor"};
    return (unsigned)reduce < PSHARD_REDUCE_COUNT ? names[reduce] : "unknown";
}

const char *pshard_reduce_problem(pshard_reduce_t reduce, pshard_dtype_t dtype)
{
    if ((unsigned)reduce >= PSHARD_REDUCE_COUNT)
        return "unknown reduction (use sum, avg, product, min, max, band, bor or bxor)";
    if ((unsigned)dtype >= PSHARD_DTYPE_COUNT)
        return "unknown dtype";
    if (reduce == PSHARD_REDUCE_AVG && is_integer(dtype))
        return dtype == PSHARD_INT64   ? "avg is not defined for int64; use sum"
               : dtype == PSHARD_INT32 ? "avg is not defined for int32; use sum"
                                       : "avg is not defined for uint8; use sum";
    if (reduce >= PSHARD_REDUCE_BAND && !is_integer(dtype))
        return reduce == PSHARD_REDUCE_BAND  ? "band is for integer dtypes only"
               : reduce == PSHARD_REDUCE_BOR ? "bor is for integer dtypes only"
                                             : "bxor is for integer dtypes only";
    return NULL;
}

int pshard_reduce_identity(pshard_reduce_t reduce, pshard_dtype_t dtype, void *out)
{
    if (pshard_reduce_problem(reduce, dtype))
        return -1;
    if (dtype == PSHARD_INT64 || dtype == PSHARD_INT32) {
        bool wide = dtype == PSHARD_INT64;
        int64_t v = reduce == PSHARD_REDUCE_PRODUCT ? 1
                    : reduce == PSHARD_REDUCE_MIN   ? (wide ? INT64_MAX : INT32_MAX)
                    : reduce == PSHARD_REDUCE_MAX   ? (wide ? INT64_MIN : INT32_MIN)
                    : reduce == PSHARD_REDUCE_BAND  ? -1
                                                    : 0;
        if (wide) {
            memcpy(out, &v, sizeof(v));
        } else {
            int32_t v32 = (int32_t)v;
            memcpy(out, &v32, sizeof(v32));
        }
        return 0;
    }
    if (dtype == PSHARD_UINT8) {
        *(uint8_t *)out = reduce == PSHARD_REDUCE_PRODUCT                               ? 1
                          : reduce == PSHARD_REDUCE_MIN || reduce == PSHARD_REDUCE_BAND ? 0xff
                                                                                        : 0;
        return 0;
    }
    double d = reduce == PSHARD_REDUCE_PRODUCT ? 1.0
               : reduce == PSHARD_REDUCE_MIN   ? INFINITY
               : reduce == PSHARD_REDUCE_MAX   ? -INFINITY
                                               : 0.0;
    if (dtype == PSHARD_FP64) {
        memcpy(out, &d, sizeof(d));
        return 0;
    }
    float f = (float)d;
    return pshard_convert(&f, PSHARD_FP32, out, dtype, 1);
}

pshard_dtype_t coll_acc_dtype(pshard_dtype_t dtype)
{
    return dtype == PSHARD_BF16 || dtype == PSHARD_FP16 ? PSHARD_FP32 : dtype;
}

static void widen_half(const uint16_t *in, pshard_dtype_t dtype, float *out, size_t n)
{
    if (dtype == PSHARD_BF16)
        ps_convert_bf16_to_f32(in, out, n);
    else
        ps_convert_f16_to_f32(in, out, n);
}

void coll_reduce_load(void *acc, const void *in, pshard_dtype_t dtype, size_t n)
{
    switch (dtype) {
    case PSHARD_FP32:
        memcpy(acc, in, n * sizeof(float));
        return;
    case PSHARD_INT64:
    case PSHARD_FP64:
    case PSHARD_INT32:
    case PSHARD_UINT8:
        memcpy(acc, in, n * pshard_dtype_size(dtype));
        return;
    case PSHARD_BF16:
    case PSHARD_FP16:
        widen_half(in, dtype, acc, n);
        return;
    }
}

/* One loop per operation, each in the shape the vectoriser takes (see the file comment). */
#define REDUCE_LOOP(name, T, EXPR)                                                                 \
    static void name(T *restrict acc, const T *restrict in, size_t n)                              \
    {                                                                                              \
        size_t i = 0;                                                                              \
        for (; i + VEC <= n; i += VEC)                                                             \
            for (size_t j = 0; j < VEC; j++) {                                                     \
                T a = acc[i + j], b = in[i + j];                                                   \
                acc[i + j] = (EXPR);                                                               \
            }                                                                                      \
        for (; i < n; i++) {                                                                       \
            T a = acc[i], b = in[i];                                                               \
            acc[i] = (EXPR);                                                                       \
        }                                                                                          \
    }

REDUCE_LOOP(add_f32, float, a + b)
REDUCE_LOOP(mul_f32, float, a *b)
/* NaN wins, as in torch.maximum / torch.minimum: a NaN in acc stays (both comparisons are
 * false), a NaN in `in` is taken (b != b). */
REDUCE_LOOP(max_f32, float, (b > a || b != b) ? b : a)
REDUCE_LOOP(min_f32, float, (b < a || b != b) ? b : a)
/* int64 sums and products wrap modulo 2^64 (two's complement) instead of overflowing, which
 * would be undefined behaviour on signed integers. */
REDUCE_LOOP(add_i64, int64_t, (int64_t)((uint64_t)a + (uint64_t)b))
REDUCE_LOOP(mul_i64, int64_t, (int64_t)((uint64_t)a *(uint64_t)b))
REDUCE_LOOP(max_i64, int64_t, b > a ? b : a)
REDUCE_LOOP(min_i64, int64_t, b < a ? b : a)
REDUCE_LOOP(and_i64, int64_t, a &b)
REDUCE_LOOP(or_i64, int64_t, a | b)
REDUCE_LOOP(xor_i64, int64_t, a ^ b)
REDUCE_LOOP(add_f64, double, a + b)
REDUCE_LOOP(mul_f64, double, a *b)
REDUCE_LOOP(max_f64, double, (b > a || b != b) ? b : a)
REDUCE_LOOP(min_f64, double, (b < a || b != b) ? b : a)
REDUCE_LOOP(add_i32, int32_t, (int32_t)((uint32_t)a + (uint32_t)b))
REDUCE_LOOP(mul_i32, int32_t, (int32_t)((uint32_t)a *(uint32_t)b))
REDUCE_LOOP(max_i32, int32_t, b > a ? b : a)
REDUCE_LOOP(min_i32, int32_t, b < a ? b : a)
REDUCE_LOOP(and_i32, int32_t, a &b)
REDUCE_LOOP(or_i32, int32_t, a | b)
REDUCE_LOOP(xor_i32, int32_t, a ^ b)
/* uint8 wraps modulo 256, as torch's uint8 arithmetic does. */
REDUCE_LOOP(add_u8, uint8_t, (uint8_t)(a + b))
REDUCE_LOOP(mul_u8, uint8_t, (uint8_t)(a *b))
REDUCE_LOOP(max_u8, uint8_t, b > a ? b : a)
REDUCE_LOOP(min_u8, uint8_t, b < a ? b : a)
REDUCE_LOOP(and_u8, uint8_t, a &b)
REDUCE_LOOP(or_u8, uint8_t, a | b)
REDUCE_LOOP(xor_u8, uint8_t, a ^ b)

/* The same operation table for each element type: op -> loop. */
#define COMBINE(name, T, add, mul, min, max, band, bor, bxor)                                      \
    static void name(T *acc, const T *in, int op, size_t n)                                        \
    {                                                                                              \
        switch (op) {                                                                              \
        case PSHARD_REDUCE_SUM:                                                                    \
        case PSHARD_REDUCE_AVG:                                                                    \
            add(acc, in, n);                                                                       \
            return;                                                                                \
        case PSHARD_REDUCE_PRODUCT:                                                                \
            mul(acc, in, n);                                                                       \
            return;                                                                                \
        case PSHARD_REDUCE_MIN:                                                                    \
            min(acc, in, n);                                                                       \
            return;                                                                                \
        case PSHARD_REDUCE_MAX:                                                                    \
            max(acc, in, n);                                                                       \
            return;                                                                                \
        case PSHARD_REDUCE_BAND:                                                                   \
            band(acc, in, n);                                                                      \
            return;                                                                                \
        case PSHARD_REDUCE_BOR:                                                                    \
            bor(acc, in, n);                                                                       \
            return;                                                                                \
        case PSHARD_REDUCE_BXOR:                                                                   \
            bxor(acc, in, n);                                                                      \
            return;                                                                                \
        }                                                                                          \
    }

/* Floating types have no bitwise reductions (refused before): those leave acc as it is. */
static void keep_f64(double *acc, const double *in, size_t n)
{
    (void)acc;
    (void)in;
    (void)n;
}

COMBINE(combine_f64, double, add_f64, mul_f64, min_f64, max_f64, keep_f64, keep_f64, keep_f64)
COMBINE(combine_i32, int32_t, add_i32, mul_i32, min_i32, max_i32, and_i32, or_i32, xor_i32)
COMBINE(combine_u8, uint8_t, add_u8, mul_u8, min_u8, max_u8, and_u8, or_u8, xor_u8)

static void combine_f32(float *acc, const float *in, int op, size_t n)
{
    switch (op) {
    case PSHARD_REDUCE_PRODUCT:
        mul_f32(acc, in, n);
        return;
    case PSHARD_REDUCE_MIN:
        min_f32(acc, in, n);
        return;
    case PSHARD_REDUCE_MAX:
        max_f32(acc, in, n);
        return;
    case PSHARD_REDUCE_SUM:
    case PSHARD_REDUCE_AVG:
        add_f32(acc, in, n);
        return;
    }
}

static void combine_i64(int64_t *acc, const int64_t *in, int op, size_t n)
{
    switch (op) {
    case PSHARD_REDUCE_SUM:
        add_i64(acc, in, n);
        return;
    case PSHARD_REDUCE_PRODUCT:
        mul_i64(acc, in, n);
        return;
    case PSHARD_REDUCE_MIN:
        min_i64(acc, in, n);
        return;
    case PSHARD_REDUCE_MAX:
        max_i64(acc, in, n);
        return;
    case PSHARD_REDUCE_BAND:
        and_i64(acc, in, n);
        return;
    case PSHARD_REDUCE_BOR:
        or_i64(acc, in, n);
        return;
    case PSHARD_REDUCE_BXOR:
        xor_i64(acc, in, n);
        return;
    }
}

void coll_reduce_accumulate(void *acc, const void *in, pshard_dtype_t dtype, int op, size_t n)
{
    switch (dtype) {
    case PSHARD_FP32:
        combine_f32(acc, in, op, n);
        return;
    case PSHARD_INT64:
        combine_i64(acc, in, op, n);
        return;
    case PSHARD_FP64:
        combine_f64(acc, in, op, n);
        return;
    case PSHARD_INT32:
        combine_i32(acc, in, op, n);
        return;
    case PSHARD_UINT8:
        combine_u8(acc, in, op, n);
        return;
    case PSHARD_BF16:
    case PSHARD_FP16: {
        float block[COLL_REDUCE_BLOCK];
        float *acc_f = acc;
        const uint16_t *in_h = in;
        while (n > 0) {
            size_t chunk = n < COLL_REDUCE_BLOCK ? n : COLL_REDUCE_BLOCK;
            widen_half(in_h, dtype, block, chunk);
            combine_f32(acc_f, block, op, chunk);
            acc_f += chunk;
            in_h += chunk;
            n -= chunk;
        }
        return;
    }
    }
}

/* acc * scale as an fp32 rounded to odd: the product of two floats is exact in double, and
 * rounding it to odd at fp32 precision (truncate, then set the last bit if anything was lost)
 * keeps enough information that the later RNE rounding to bf16/fp16 (at least 13 fewer bits)
 * gives the same result as rounding the exact product once. Plain RNE to fp32 first would be a
 * double rounding that can land on a false tie.
 *
 * From the RNE result: when it is inexact and even, step one ulp to its odd neighbour on the
 * other side of the exact value (towards zero if RNE rounded away from zero, else away). Only
 * the sign of the residual matters; scaling it by 2^200 keeps even the smallest possible
 * residual (2^-298) from underflowing when it is narrowed to fp32. A NaN residual (NaN or Inf
 * input) compares false both ways and changes nothing; an overflow to Inf has residual -Inf
 * and steps back to FLT_MAX, which still rounds to Inf in both half types. The decisions are
 * all-ones/zero masks in 32-bit lanes so that the loop vectorises. */
static inline uint32_t round_to_odd_bits(float acc, float scale)
{
    double exact = (double)acc * (double)scale;
    float nearest = (float)exact;
    float residual = (float)((exact - (double)nearest) * 0x1p200);
    uint32_t bits;
    memcpy(&bits, &nearest, sizeof bits);
    uint32_t below = residual < 0.0f ? ~0u : 0u;
    uint32_t above = residual > 0.0f ? ~0u : 0u;
    uint32_t positive = nearest > 0.0f ? ~0u : 0u;
    uint32_t negative = nearest < 0.0f ? ~0u : 0u;
    uint32_t even = (bits & 1u) - 1u;
    uint32_t adjust = (below | above) & even;
    uint32_t away = (positive & below) | (negative & above);
    uint32_t step = away | (~away & 1u); /* -1 (all ones) or +1 ulp of the magnitude */
    return bits + (adjust & step);
}

static void scale_round_to_odd(const float *restrict acc, float *restrict out, size_t n,
                               float scale)
{
    size_t i = 0;
    for (; i + VEC <= n; i += VEC) {
        for (size_t j = 0; j < VEC; j++) {
            uint32_t bits = round_to_odd_bits(acc[i + j], scale);
            memcpy(&out[i + j], &bits, sizeof bits);
        }
    }
    for (; i < n; i++) {
        uint32_t bits = round_to_odd_bits(acc[i], scale);
        memcpy(&out[i], &bits, sizeof bits);
    }
}

static void scale_f32(float *restrict out, const float *restrict acc, size_t n, float scale)
{
    size_t i = 0;
    for (; i + VEC <= n; i += VEC)
        for (size_t j = 0; j < VEC; j++)
            out[i + j] = acc[i + j] * scale;
    for (; i < n; i++)
        out[i] = acc[i] * scale;
}

static void scale_f32_in_place(float *buf, size_t n, float scale)
{
    size_t i = 0;
    for (; i + VEC <= n; i += VEC)
        for (size_t j = 0; j < VEC; j++)
            buf[i + j] *= scale;
    for (; i < n; i++)
        buf[i] *= scale;
}

void coll_reduce_store(void *out, pshard_dtype_t dtype, const void *acc, size_t n, double scale64)
{
    float scale = (float)scale64; /* 1/n: the same as 1.0f/n for every n <= 2^20 */
    switch (dtype) {
    case PSHARD_FP64: {
        double *o = out;
        const double *a = acc;
        if (scale64 != 1.0) {
            for (size_t i = 0; i < n; i++)
                o[i] = a[i] * scale64;
        } else if (out != acc) {
            memmove(out, acc, n * sizeof(double));
        }
        return;
    }
    case PSHARD_INT32:
    case PSHARD_UINT8:
        if (out != acc)
            memmove(out, acc, n * pshard_dtype_size(dtype));
        return;
    case PSHARD_FP32:
        if (scale == 1.0f) {
            if (out != acc)
                memmove(out, acc, n * sizeof(float));
        } else if (out == acc) {
            scale_f32_in_place(out, n, scale);
        } else {
            scale_f32(out, acc, n, scale);
        }
        return;
    case PSHARD_INT64:
        if (out != acc)
            memmove(out, acc, n * sizeof(int64_t));
        return;
    case PSHARD_BF16:
    case PSHARD_FP16: {
        const float *acc_f = acc;
        uint16_t *out_h = out;
        float block[COLL_REDUCE_BLOCK];
        while (n > 0) {
            size_t chunk = n < COLL_REDUCE_BLOCK ? n : COLL_REDUCE_BLOCK;
            const float *src = acc_f;
            if (scale != 1.0f) {
                scale_round_to_odd(acc_f, block, chunk, scale);
                src = block;
            }
            if (dtype == PSHARD_BF16)
                ps_convert_f32_to_bf16(src, out_h, chunk);
            else
                ps_convert_f32_to_f16(src, out_h, chunk);
            acc_f += chunk;
            out_h += chunk;
            n -= chunk;
        }
        return;
    }
    }
}
