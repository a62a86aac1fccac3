/* Builds without nvcc: no CUDA kernels, so GPU-resident shards are refused at start. */
#include "shard_cuda.h"

const shard_dev_ops_t *shard_dev_cuda(void)
{
    return NULL;
}
