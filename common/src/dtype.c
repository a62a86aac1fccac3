/* Element types and the fp32 <-> bf16/fp16 conversions. Every conversion rounds to nearest even
 * and keeps NaNs NaN (quieted, sign kept, top payload bits kept). The per-element helpers compute
 * every candidate and pick one with mask selects (no branches, so no FP operation is left
 * conditional), and the bulk loops run in fixed-size blocks plus a scalar tail: gcc -O2's
 * "very cheap" vectoriser cost model only takes loops whose trip count is a multiple of the
 * vector width, which the blocks are. */
#include "pshard/dtype.h"

#include <string.h>

#define F32_SIGN 0x80000000u
#define F32_ABS 0x7fffffffu
#define F32_INF 0x7f800000u
#define F32_QUIET 0x00400000u

static inline uint32_t f32_bits(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

static inline float f32_from_bits(uint32_t bits)
{
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* cond (0 or 1) ? a : b, as bit arithmetic so that the compiler keeps it branch-free. */
static inline uint32_t select_u32(uint32_t cond, uint32_t a, uint32_t b)
{
    uint32_t mask = 0u - cond;
    return (a & mask) | (b & ~mask);
}

/* fp32 -> bf16: add 0x7fff plus the kept LSB, then truncate (RNE; a carry out of the mantissa
 * bumps the exponent, which is how the largest finite values overflow to Inf). A NaN keeps its
 * sign and top payload bits and gets the quiet bit, so it can never round to Inf. */
static inline uint16_t f32_to_bf16_bits(uint32_t bits)
{
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (bits >> 16) | 0x0040u;
    return (uint16_t)select_u32((bits & F32_ABS) > F32_INF, quiet_nan, rounded);
}

/* bf16 -> fp32 is exact: widen; a NaN gets the quiet bit. */
static inline uint32_t bf16_to_f32_bits(uint16_t value)
{
    uint32_t bits = (uint32_t)value << 16;
    return bits | select_u32((bits & F32_ABS) > F32_INF, F32_QUIET, 0u);
}

/* fp32 -> fp16. Three candidates, one select:
 *  - normal results: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest
 *    even with integer arithmetic; a carry may reach exponent 31, which is Inf (correct RNE
 *    overflow for 65520 <= |x| < 65536); |x| >= 65536 is clamped to Inf;
 *  - subnormal results (|x| < 2^-14): |x| + 0.5f in fp32 has an ulp of 2^-24, the fp16
 *    subnormal step, so the FPU's own RNE addition rounds correctly (ties, sticky bits and
 *    values below the smallest subnormal included); its low bits are the fp16 mantissa;
 *  - NaN/Inf: Inf stays Inf, NaN keeps sign and top 10 payload bits and gets the quiet bit. */
static inline uint16_t f32_to_f16_bits(uint32_t bits)
{
    uint32_t sign = (bits >> 16) & 0x8000u;
    uint32_t mag = bits & F32_ABS;

    uint32_t normal = (mag - (112u << 23) + 0xfffu + ((mag >> 13) & 1u)) >> 13;
    normal = select_u32(mag >= (143u << 23), 0x7c00u, normal);

    float sub_sum = f32_from_bits(mag) + 0.5f;
    uint32_t subnormal = f32_bits(sub_sum) - 0x3f000000u;

    uint32_t special = select_u32(mag > F32_INF, 0x7e00u | ((mag >> 13) & 0x3ffu), 0x7c00u);

    uint32_t out = select_u32(mag < (113u << 23), subnormal, normal);
    out = select_u32(mag >= F32_INF, special, out);
    return (uint16_t)(sign | out);
}

/* fp16 -> fp32 is exact. Normals rebias the exponent; subnormals are mantissa * 2^-24 computed
 * in fp32 (exact: an integer below 2^10 times a power of two); Inf/NaN get exponent 255 and a
 * NaN gets the quiet bit. */
static inline uint32_t f16_to_f32_bits(uint16_t value)
{
    uint32_t sign = ((uint32_t)value & 0x8000u) << 16;
    uint32_t exp = (uint32_t)value & 0x7c00u;
    uint32_t mant = (uint32_t)value & 0x03ffu;

    uint32_t normal = (((uint32_t)value & 0x7fffu) << 13) + (112u << 23);
    uint32_t subnormal = f32_bits((float)(int32_t)mant * 0x1p-24f);
    uint32_t special = F32_INF | (mant << 13) | select_u32(mant != 0, F32_QUIET, 0u);

    uint32_t out = select_u32(exp == 0, subnormal, normal);
    out = select_u32(exp == 0x7c00u, special, out);
    return sign | out;
}

size_t pshard_dtype_size(pshard_dtype_t dtype)
{
    switch (dtype) {
    case PSHARD_FP32:
        return 4;
    case PSHARD_BF16:
    case PSHARD_FP16:
        return 2;
    case PSHARD_INT64:
        return 8;
    }
    return 0;
}

const char *pshard_dtype_name(pshard_dtype_t dtype)
{
    switch (dtype) {
    case PSHARD_FP32:
        return "fp32";
    case PSHARD_BF16:
        return "bf16";
    case PSHARD_FP16:
        return "fp16";
    case PSHARD_INT64:
        return "int64";
    }
    return "unknown";
}

int pshard_dtype_parse(const char *text, pshard_dtype_t *dtype)
{
    static const struct {
        const char *name;
        pshard_dtype_t dtype;
    } names[] = {
        {"fp32", PSHARD_FP32},     {"float32", PSHARD_FP32}, {"bf16", PSHARD_BF16},
        {"bfloat16", PSHARD_BF16}, {"fp16", PSHARD_FP16},    {"float16", PSHARD_FP16},
        {"int64", PSHARD_INT64},
    };
    if (!text || !dtype)
        return -1;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (strcmp(text, names[i].name) == 0) {
            *dtype = names[i].dtype;
            return 0;
        }
    }
    return -1;
}

uint16_t ps_f32_to_bf16(float value)
{
    return f32_to_bf16_bits(f32_bits(value));
}

float ps_bf16_to_f32(uint16_t value)
{
    return f32_from_bits(bf16_to_f32_bits(value));
}

uint16_t ps_f32_to_f16(float value)
{
    return f32_to_f16_bits(f32_bits(value));
}

float ps_f16_to_f32(uint16_t value)
{
    return f32_from_bits(f16_to_f32_bits(value));
}

/* Bulk loops: BLOCK elements at a time (constant trip count, vectorised), then the tail. */
#define BLOCK 16

void ps_convert_f32_to_bf16(const float *restrict src, uint16_t *restrict dst, size_t n)
{
    size_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK)
        for (size_t j = 0; j < BLOCK; j++)
            dst[i + j] = f32_to_bf16_bits(f32_bits(src[i + j]));
    for (; i < n; i++)
        dst[i] = f32_to_bf16_bits(f32_bits(src[i]));
}

void ps_convert_bf16_to_f32(const uint16_t *restrict src, float *restrict dst, size_t n)
{
    size_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK)
        for (size_t j = 0; j < BLOCK; j++)
            dst[i + j] = f32_from_bits(bf16_to_f32_bits(src[i + j]));
    for (; i < n; i++)
        dst[i] = f32_from_bits(bf16_to_f32_bits(src[i]));
}

void ps_convert_f32_to_f16(const float *restrict src, uint16_t *restrict dst, size_t n)
{
    size_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK)
        for (size_t j = 0; j < BLOCK; j++)
            dst[i + j] = f32_to_f16_bits(f32_bits(src[i + j]));
    for (; i < n; i++)
        dst[i] = f32_to_f16_bits(f32_bits(src[i]));
}

void ps_convert_f16_to_f32(const uint16_t *restrict src, float *restrict dst, size_t n)
{
    size_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK)
        for (size_t j = 0; j < BLOCK; j++)
            dst[i + j] = f32_from_bits(f16_to_f32_bits(src[i + j]));
    for (; i < n; i++)
        dst[i] = f32_from_bits(f16_to_f32_bits(src[i]));
}

/* Half <-> half goes through fp32 in blocks: widening is exact, so the one narrowing is the
 * only rounding. */
static void convert_half_to_half(const uint16_t *src, pshard_dtype_t src_type, uint16_t *dst,
                                 pshard_dtype_t dst_type, size_t n)
{
    float block[1024];
    while (n > 0) {
        size_t chunk = n < 1024 ? n : 1024;
        if (src_type == PSHARD_BF16)
            ps_convert_bf16_to_f32(src, block, chunk);
        else
            ps_convert_f16_to_f32(src, block, chunk);
        if (dst_type == PSHARD_BF16)
            ps_convert_f32_to_bf16(block, dst, chunk);
        else
            ps_convert_f32_to_f16(block, dst, chunk);
        src += chunk;
        dst += chunk;
        n -= chunk;
    }
}

int ps_convert(const void *src, pshard_dtype_t src_type, void *dst, pshard_dtype_t dst_type,
               size_t n)
{
    size_t src_size = pshard_dtype_size(src_type);
    size_t dst_size = pshard_dtype_size(dst_type);
    if (src_size == 0 || dst_size == 0)
        return -1;
    if ((src_type == PSHARD_INT64) != (dst_type == PSHARD_INT64))
        return -1;
    if (n == 0)
        return 0;
    if (src_type == dst_type) {
        memcpy(dst, src, n * src_size);
        return 0;
    }
    if (src_type == PSHARD_FP32) {
        if (dst_type == PSHARD_BF16)
            ps_convert_f32_to_bf16(src, dst, n);
        else
            ps_convert_f32_to_f16(src, dst, n);
    } else if (dst_type == PSHARD_FP32) {
        if (src_type == PSHARD_BF16)
            ps_convert_bf16_to_f32(src, dst, n);
        else
            ps_convert_f16_to_f32(src, dst, n);
    } else {
        convert_half_to_half(src, src_type, dst, dst_type, n);
    }
    return 0;
}
