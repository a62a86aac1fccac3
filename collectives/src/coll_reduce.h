/* Reduction kernels for the collectives: partial results travel as fp32 for fp32/bf16/fp16 (so
 * half types accumulate in fp32 and round once) and in their own type for fp64, int64, int32
 * and uint8 (integers wrap). Pure, thread-safe. */
#ifndef PSHARD_COLL_REDUCE_H
#define PSHARD_COLL_REDUCE_H

#include <stddef.h>
#include <stdint.h>

#include "pshard/dtype.h"

/* The element type partial results travel in: PSHARD_FP32 for fp32, bf16 and fp16; the type
 * itself for the others. */
pshard_dtype_t coll_acc_dtype(pshard_dtype_t dtype);

/* acc[0..n) = in[0..n) converted to the accumulation type (a copy for fp32/int64). */
void coll_reduce_load(void *acc, const void *in, pshard_dtype_t dtype, size_t n);

/* acc[i] = acc[i] (op) in[i], in being of `dtype` and acc of coll_acc_dtype(dtype); op is a
 * pshard_reduce_t (avg accumulates as sum; the caller scales at the store). The bitwise ops
 * apply to int64 only (for other types they leave acc as it is: coll_comm.c refuses them). */
void coll_reduce_accumulate(void *acc, const void *in, pshard_dtype_t dtype, int op, size_t n);

/* out[i] = acc[i] * scale rounded to `dtype` (round to nearest even; scale 1 means a plain
 * conversion; fp32 and the half types scale by (float)scale, fp64 by scale; integers ignore
 * it). out may alias acc except for the half types. */
void coll_reduce_store(void *out, pshard_dtype_t dtype, const void *acc, size_t n, double scale);

#endif
