/* Builds without nvcc: no CUDA kernels, so GPU-resident shards are refused at start. */
#include "shard_cuda.h"
#include "pshard/util.h"

const shard_dev_ops_t *shard_dev_cuda(char *err, size_t errlen)
{
    ps_errf(err, errlen, PSHARD_ERR_UNIMPLEMENTED,
            "this pshard-server was built without nvcc (no CUDA kernels)");
    return NULL;
}
