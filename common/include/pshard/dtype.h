/* Element types pshard moves and reduces (fp32, bf16, fp16, int64) and the conversions between
 * the half types and fp32: round to nearest even, NaN stays NaN (quiet), Inf stays Inf,
 * subnormals are kept exactly where representable. All functions are pure and thread-safe. */
#ifndef PSHARD_DTYPE_H
#define PSHARD_DTYPE_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    PSHARD_FP32 = 0,
    PSHARD_BF16 = 1,
    PSHARD_FP16 = 2,
    PSHARD_INT64 = 3,
} pshard_dtype_t;

#define PSHARD_DTYPE_COUNT 4

/* Bytes per element (4, 2, 2, 8), or 0 for an unknown value. */
size_t pshard_dtype_size(pshard_dtype_t dtype);

/* "fp32", "bf16", "fp16", "int64", or "unknown". */
const char *pshard_dtype_name(pshard_dtype_t dtype);

/* Parses the names above (also "float32", "bfloat16", "float16"); returns 0 or -1. */
int pshard_dtype_parse(const char *text, pshard_dtype_t *dtype);

uint16_t ps_f32_to_bf16(float value);
float ps_bf16_to_f32(uint16_t value);
uint16_t ps_f32_to_f16(float value);
float ps_f16_to_f32(uint16_t value);

/* Bulk conversions of n elements; src and dst must not overlap. */
void ps_convert_f32_to_bf16(const float *src, uint16_t *dst, size_t n);
void ps_convert_bf16_to_f32(const uint16_t *src, float *dst, size_t n);
void ps_convert_f32_to_f16(const float *src, uint16_t *dst, size_t n);
void ps_convert_f16_to_f32(const uint16_t *src, float *dst, size_t n);

/* Converts n elements of src_type to dst_type via fp32 (int64 only to/from int64). Returns 0,
 * or -1 for an unsupported pair. */
int ps_convert(const void *src, pshard_dtype_t src_type, void *dst, pshard_dtype_t dst_type,
               size_t n);

#endif
