/* The per-element fp32 <-> bf16/fp16 conversions (round to nearest even, NaN kept NaN) as
 * inline functions that compile both as C (common/src/dtype.c's bulk loops) and as CUDA device
 * code (the shard server's GPU kernels), so both give the same bits. Internal to pshard. */
#ifndef PSHARD_DTYPE_BITS_H
#define PSHARD_DTYPE_BITS_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define PS_HD __host__ __device__
#else
#define PS_HD
#endif

#define PS_F32_SIGN 0x80000000u
#define PS_F32_ABS 0x7fffffffu
#define PS_F32_INF 0x7f800000u
#define PS_F32_QUIET 0x00400000u

PS_HD static inline uint32_t f32_bits(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

PS_HD static inline float f32_from_bits(uint32_t bits)
{
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* cond (0 or 1) ? a : b, as bit arithmetic so that the compiler keeps it branch-free. */
PS_HD static inline uint32_t select_u32(uint32_t cond, uint32_t a, uint32_t b)
{
    uint32_t mask = 0u - cond;
    return (a & mask) | (b & ~mask);
}

/* fp32 -> bf16: add 0x7fff plus the kept LSB, then truncate (RNE; a carry out of the mantissa
 * bumps the exponent, which is how the largest finite values overflow to Inf). A NaN keeps its
 * sign and top payload bits and gets the quiet bit, so it can never round to Inf. */
PS_HD static inline uint16_t f32_to_bf16_bits(uint32_t bits)
{
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (bits >> 16) | 0x0040u;
    return (uint16_t)select_u32((bits & PS_F32_ABS) > PS_F32_INF, quiet_nan, rounded);
}

/* bf16 -> fp32 is exact: widen; a NaN gets the quiet bit. */
PS_HD static inline uint32_t bf16_to_f32_bits(uint16_t value)
{
    uint32_t bits = (uint32_t)value << 16;
    return bits | select_u32((bits & PS_F32_ABS) > PS_F32_INF, PS_F32_QUIET, 0u);
}

/* fp32 -> fp16. Three candidates, one select:
 *  - normal results: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest
 *    even with integer arithmetic; a carry may reach exponent 31, which is Inf (correct RNE
 *    overflow for 65520 <= |x| < 65536); |x| >= 65536 is clamped to Inf;
 *  - subnormal results (|x| < 2^-14): |x| + 0.5f in fp32 has an ulp of 2^-24, the fp16
 *    subnormal step, so the FPU's own RNE addition rounds correctly (ties, sticky bits and
 *    values below the smallest subnormal included); its low bits are the fp16 mantissa;
 *  - NaN/Inf: Inf stays Inf, NaN keeps sign and top 10 payload bits and gets the quiet bit. */
PS_HD static inline uint16_t f32_to_f16_bits(uint32_t bits)
{
    uint32_t sign = (bits >> 16) & 0x8000u;
    uint32_t mag = bits & PS_F32_ABS;

    uint32_t normal = (mag - (112u << 23) + 0xfffu + ((mag >> 13) & 1u)) >> 13;
    normal = select_u32(mag >= (143u << 23), 0x7c00u, normal);

    float sub_sum = f32_from_bits(mag) + 0.5f;
    uint32_t subnormal = f32_bits(sub_sum) - 0x3f000000u;

    uint32_t special = select_u32(mag > PS_F32_INF, 0x7e00u | ((mag >> 13) & 0x3ffu), 0x7c00u);

    uint32_t out = select_u32(mag < (113u << 23), subnormal, normal);
    out = select_u32(mag >= PS_F32_INF, special, out);
    return (uint16_t)(sign | out);
}

/* fp16 -> fp32 is exact. Normals rebias the exponent; subnormals are mantissa * 2^-24 computed
 * in fp32 (exact: an integer below 2^10 times a power of two); Inf/NaN get exponent 255 and a
 * NaN gets the quiet bit. */
PS_HD static inline uint32_t f16_to_f32_bits(uint16_t value)
{
    uint32_t sign = ((uint32_t)value & 0x8000u) << 16;
    uint32_t exp = (uint32_t)value & 0x7c00u;
    uint32_t mant = (uint32_t)value & 0x03ffu;

    uint32_t normal = (((uint32_t)value & 0x7fffu) << 13) + (112u << 23);
    uint32_t subnormal = f32_bits((float)(int32_t)mant * 0x1p-24f);
    uint32_t special = PS_F32_INF | (mant << 13) | select_u32(mant != 0, PS_F32_QUIET, 0u);

    uint32_t out = select_u32(exp == 0, subnormal, normal);
    out = select_u32(exp == 0x7c00u, special, out);
    return sign | out;
}

#endif
