/* The conversions between the half types and fp32 behind pshard_convert (pshard/types.h, which
 * declares the element types): round to nearest even, NaN stays NaN (quiet), Inf stays Inf,
 * subnormals are kept exactly where representable. Internal to pshard (not installed). All
 * functions are pure and thread-safe. */
#ifndef PSHARD_DTYPE_H
#define PSHARD_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#include "pshard/types.h"

uint16_t ps_f32_to_bf16(float value);
float ps_bf16_to_f32(uint16_t value);
uint16_t ps_f32_to_f16(float value);
float ps_f16_to_f32(uint16_t value);

/* Bulk conversions of n elements; src and dst must not overlap. */
void ps_convert_f32_to_bf16(const float *src, uint16_t *dst, size_t n);
void ps_convert_bf16_to_f32(const uint16_t *src, float *dst, size_t n);
void ps_convert_f32_to_f16(const float *src, uint16_t *dst, size_t n);
void ps_convert_f16_to_f32(const uint16_t *src, float *dst, size_t n);

#endif
