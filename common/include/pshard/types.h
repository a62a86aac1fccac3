/* The value types of pshard's public API, shared by every component: element types (fp32,
 * bf16, fp16, int64) with their sizes, names and conversions, the reductions, and the two
 * shard layouts.
 * Installed with libpshard; everything declared here is exported by it. Pure, thread-safe. */
#ifndef PSHARD_TYPES_H
#define PSHARD_TYPES_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    PSHARD_FP32 = 0,
    PSHARD_BF16 = 1,
    PSHARD_FP16 = 2,
    PSHARD_INT64 = 3,
    /* Collectives only (parameters and gradients are fp32, bf16 or fp16): */
    PSHARD_FP64 = 4,
    PSHARD_INT32 = 5,
    PSHARD_UINT8 = 6, /* also torch.bool's storage */
} pshard_dtype_t;

#define PSHARD_DTYPE_COUNT 7

/* Bytes per element (4, 2, 2, 8, 8, 4, 1), or 0 for an unknown value. */
size_t pshard_dtype_size(pshard_dtype_t dtype);

/* "fp32", "bf16", "fp16", "int64", "fp64", "int32", "uint8", or "unknown". */
const char *pshard_dtype_name(pshard_dtype_t dtype);

/* Parses the names above (also "float32", "bfloat16", "float16", "float64"); returns 0 or
 * -1. */
int pshard_dtype_parse(const char *text, pshard_dtype_t *dtype);

/* Converts n elements of src_type to dst_type via fp32 between fp32, bf16 and fp16: round to
 * nearest even, NaN stays NaN (quiet), Inf stays Inf, subnormals kept where representable.
 * Other types convert only to themselves (a copy). src and dst must not overlap. Returns 0, or
 * -1 for an unsupported pair. */
int pshard_convert(const void *src, pshard_dtype_t src_type, void *dst, pshard_dtype_t dst_type,
                   size_t n);

/* Reductions of the collectives, numbered as torch.distributed.ReduceOp's. */
typedef enum {
    PSHARD_REDUCE_SUM = 0,
    PSHARD_REDUCE_AVG = 1, /* sum divided by the number of contributing ranks (not int64) */
    PSHARD_REDUCE_PRODUCT = 2,
    PSHARD_REDUCE_MIN = 3,
    PSHARD_REDUCE_MAX = 4,
    PSHARD_REDUCE_BAND = 5, /* bitwise: int64 only */
    PSHARD_REDUCE_BOR = 6,
    PSHARD_REDUCE_BXOR = 7,
} pshard_reduce_t;

#define PSHARD_REDUCE_COUNT 8

/* How parameters are cut into shards (see pshard/pshard.h, pshard_model_config_t). */
typedef enum {
    PSHARD_LAYOUT_FSDP2 = 0, /* each parameter on dim 0 */
    PSHARD_LAYOUT_FSDP1 = 1, /* all parameters flattened into one buffer */
} pshard_layout_t;

#ifdef __cplusplus
}
#endif
#endif
