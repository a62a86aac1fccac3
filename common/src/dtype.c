/* Element types and the fp32 <-> bf16/fp16 conversions. Every conversion rounds to nearest even
 * and keeps NaNs NaN (quieted, sign kept, top payload bits kept). The per-element helpers
 * (pshard/dtype_bits.h, shared with the CUDA kernels) compute every candidate and pick one with
 * mask selects (no branches, so no FP operation is left conditional), and the bulk loops run in
 * fixed-size blocks plus a scalar tail: gcc -O2's "very cheap" vectoriser cost model only takes
 * loops whose trip count is a multiple of the vector width, which the blocks are. */
#include "pshard/dtype.h"

#include <string.h>

#include "pshard/dtype_bits.h"

size_t pshard_dtype_size(pshard_dtype_t dtype)
{
    switch (dtype) {
    case PSHARD_FP32:
        return 4;
    case PSHARD_BF16:
    case PSHARD_FP16:
        return 2;
    case PSHARD_INT64:
    case PSHARD_FP64:
        return 8;
    case PSHARD_INT32:
        return 4;
    case PSHARD_UINT8:
        return 1;
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
    case PSHARD_FP64:
        return "fp64";
    case PSHARD_INT32:
        return "int32";
    case PSHARD_UINT8:
        return "uint8";
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
        {"int64", PSHARD_INT64},   {"fp64", PSHARD_FP64},    {"float64", PSHARD_FP64},
        {"int32", PSHARD_INT32},   {"uint8", PSHARD_UINT8},
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

int pshard_convert(const void *src, pshard_dtype_t src_type, void *dst, pshard_dtype_t dst_type,
                   size_t n)
{
    size_t src_size = pshard_dtype_size(src_type);
    size_t dst_size = pshard_dtype_size(dst_type);
    if (src_size == 0 || dst_size == 0)
        return -1;
    if (src_type == dst_type) {
        if (n)
            memcpy(dst, src, n * src_size);
        return 0;
    }
    /* Between different types: only among fp32, bf16 and fp16. */
    if (src_type > PSHARD_FP16 || dst_type > PSHARD_FP16)
        return -1;
    if (n == 0)
        return 0;
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
