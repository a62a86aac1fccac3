// The CUDA kernels and device memory of GPU-resident shards (shard_dev_cuda() of
// shard_cuda.h), built as the module libpshard_cuda_kernels.so with the CUDA runtime linked in
// statically, which the shard server opens only when shards live on a GPU (shard_cuda_load.c);
// its one exported symbol is pshard_cuda_kernels. Each kernel is a grid-stride loop over the
// elements calling the per-element code of shard_elem.h, which the host emulation runs too and
// which uses the CPU optimizer's and conversions' own element functions; compiled with -fmad=false
// so that fp32 results match the CPU's bit for bit.
#include "shard_cuda.h"

#include <stdio.h>
#include <string.h>

#include <cuda_runtime.h>

#include "pshard/util.h"
#include "shard_elem.h"

#define THREADS 256
#define MAX_BLOCKS 4096

static cudaStream_t g_stream;
static bool g_stream_ready;
static double *g_norm;      // device: the squared norm's accumulator
static unsigned int *g_max; // device: the inf-norm's maximum (bits of a non-negative float)

static pshard_status_t cuda_fail(char *err, size_t errlen, cudaError_t rc, const char *what)
{
    if (err && errlen > 0)
        snprintf(err, errlen, "%s: %s (%s)", what, cudaGetErrorString(rc), cudaGetErrorName(rc));
    return PSHARD_ERR_CUDA;
}

#define CU_TRY(call, what)                                                                         \
    do {                                                                                           \
        cudaError_t cu_try_rc_ = (call);                                                           \
        if (cu_try_rc_ != cudaSuccess)                                                             \
            return cuda_fail(err, errlen, cu_try_rc_, what);                                       \
    } while (0)

// Makes device current and the process's stream exist.
static pshard_status_t begin(int device, char *err, size_t errlen)
{
    CU_TRY(cudaSetDevice(device), "cudaSetDevice");
    if (!g_stream_ready) {
        CU_TRY(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking), "cudaStreamCreate");
        g_stream_ready = true;
    }
    return PSHARD_OK;
}

// Checks the launch and waits for the stream.
static pshard_status_t finish(const char *what, char *err, size_t errlen)
{
    CU_TRY(cudaGetLastError(), what);
    CU_TRY(cudaStreamSynchronize(g_stream), what);
    return PSHARD_OK;
}

static unsigned blocks_for(size_t n)
{
    size_t b = (n + THREADS - 1) / THREADS;
    if (b < 1)
        b = 1;
    return (unsigned)(b > MAX_BLOCKS ? MAX_BLOCKS : b);
}

#define FOR_EACH(i, n)                                                                             \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                        \
         i += (size_t)gridDim.x * blockDim.x)

__global__ static void k_convert(const float *src, void *dst, pshard_dtype_t dt, size_t n)
{
    FOR_EACH(i, n)
    {
        shard_convert_at(src, dst, dt, i);
    }
}

__global__ static void k_accumulate(float *acc, const void *r, pshard_dtype_t dt, size_t n,
                                    bool scaled, float scale)
{
    FOR_EACH(i, n)
    {
        acc[i] += shard_grad_at(r, dt, i, scaled, scale);
    }
}

__global__ static void k_scale(float *x, size_t n, float factor)
{
    FOR_EACH(i, n)
    {
        x[i] = x[i] * factor;
    }
}

// Per-block sums in shared memory, one atomicAdd per block.
__global__ static void k_sum_squares(const void *r, pshard_dtype_t dt, size_t n, bool scaled,
                                     float scale, double *out)
{
    __shared__ double part[THREADS];
    double acc = 0.0;
    FOR_EACH(i, n)
    {
        double v = (double)shard_grad_at(r, dt, i, scaled, scale);
        acc += v * v;
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s)
            part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        atomicAdd(out, part[0]);
}

// Per-block maxima of |x| as bits in shared memory, one atomicMax per block.
__global__ static void k_max_abs(const float *x, size_t n, unsigned int *out)
{
    __shared__ unsigned int part[THREADS];
    unsigned int top = 0;
    FOR_EACH(i, n)
    {
        unsigned int bits = shard_abs_bits_at(x, i);
        top = bits > top ? bits : top;
    }
    part[threadIdx.x] = top;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s && part[threadIdx.x + s] > part[threadIdx.x])
            part[threadIdx.x] = part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        atomicMax(out, part[0]);
}

__global__ static void k_optim(ps_optim_scalars_t sc, float *p, const void *r, pshard_dtype_t dt,
                               bool scaled, float scale, float *s0, float *s1, size_t n)
{
    FOR_EACH(i, n)
    {
        shard_optim_at(&sc, p, r, dt, scaled, scale, s0, s1, i);
    }
}

static pshard_status_t dev_alloc(int device, size_t bytes, void **out, char *err, size_t errlen)
{
    *out = NULL;
    PS_CHECK(begin(device, err, errlen));
    void *p = NULL;
    char what[96];
    snprintf(what, sizeof(what), "cudaMalloc(%zu bytes) for shard state", bytes);
    CU_TRY(cudaMalloc(&p, bytes ? bytes : 16), what);
    cudaError_t rc = cudaMemsetAsync(p, 0, bytes ? bytes : 16, g_stream);
    if (rc == cudaSuccess)
        rc = cudaStreamSynchronize(g_stream);
    if (rc != cudaSuccess) {
        cudaFree(p);
        return cuda_fail(err, errlen, rc, "zeroing shard state");
    }
    *out = p;
    return PSHARD_OK;
}

static void dev_free(int device, void *p)
{
    if (p && cudaSetDevice(device) == cudaSuccess)
        cudaFree(p);
}

// One cudaMalloc of its own (an IPC handle names a whole allocation), zeroed, and its handle.
static pshard_status_t dev_alloc_shared(int device, size_t bytes, shard_dev_shared_t *out,
                                        char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    void *p = NULL;
    PS_CHECK(dev_alloc(device, bytes, &p, err, errlen));
    cudaIpcMemHandle_t h;
    cudaError_t rc = cudaIpcGetMemHandle(&h, p);
    if (rc != cudaSuccess) {
        cudaFree(p);
        return cuda_fail(err, errlen, rc, "cudaIpcGetMemHandle for the shard");
    }
    static_assert(sizeof(h) <= SHARD_DEV_HANDLE_MAX, "an IPC handle fits");
    memcpy(out->handle, &h, sizeof(h));
    out->handle_len = sizeof(h);
    out->ptr = p;
    out->bytes = bytes;
    return PSHARD_OK;
}

static void dev_free_shared(int device, shard_dev_shared_t *s)
{
    dev_free(device, s->ptr);
    memset(s, 0, sizeof(*s));
}

static pshard_status_t dev_copy(int device, void *dst, const void *src, size_t bytes, char *err,
                                size_t errlen)
{
    PS_CHECK(begin(device, err, errlen));
    if (bytes == 0)
        return PSHARD_OK;
    CU_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, g_stream), "cudaMemcpyAsync");
    return finish("copying shard state", err, errlen);
}

static pshard_status_t dev_zero(int device, float *x, size_t n, char *err, size_t errlen)
{
    PS_CHECK(begin(device, err, errlen));
    CU_TRY(cudaMemsetAsync(x, 0, n * sizeof(float), g_stream), "zeroing gradients");
    return finish("zeroing gradients", err, errlen);
}

static pshard_status_t dev_convert(int device, const float *src, void *dst, pshard_dtype_t dt,
                                   size_t n, char *err, size_t errlen)
{
    PS_CHECK(begin(device, err, errlen));
    if (n == 0)
        return PSHARD_OK;
    k_convert<<<blocks_for(n), THREADS, 0, g_stream>>>(src, dst, dt, n);
    return finish("converting a slice for a gather", err, errlen);
}

static pshard_status_t dev_accumulate(int device, float *acc, const void *r, pshard_dtype_t dt,
                                      size_t n, bool scaled, float scale, char *err, size_t errlen)
{
    PS_CHECK(begin(device, err, errlen));
    if (n == 0)
        return PSHARD_OK;
    k_accumulate<<<blocks_for(n), THREADS, 0, g_stream>>>(acc, r, dt, n, scaled, scale);
    return finish("accumulating a gradient slice", err, errlen);
}

static pshard_status_t dev_sum_squares(int device, const void *r, pshard_dtype_t dt, size_t n,
                                       bool scaled, float scale, double *out, char *err,
                                       size_t errlen)
{
    *out = 0.0;
    PS_CHECK(begin(device, err, errlen));
    if (n == 0)
        return PSHARD_OK;
    if (!g_norm)
        CU_TRY(cudaMalloc((void **)&g_norm, sizeof(double)), "cudaMalloc (norm)");
    CU_TRY(cudaMemsetAsync(g_norm, 0, sizeof(double), g_stream), "cudaMemsetAsync (norm)");
    k_sum_squares<<<blocks_for(n), THREADS, 0, g_stream>>>(r, dt, n, scaled, scale, g_norm);
    CU_TRY(cudaGetLastError(), "the squared gradient norm");
    CU_TRY(cudaMemcpyAsync(out, g_norm, sizeof(double), cudaMemcpyDeviceToHost, g_stream),
           "copying the squared gradient norm");
    CU_TRY(cudaStreamSynchronize(g_stream), "the squared gradient norm");
    return PSHARD_OK;
}

static pshard_status_t dev_scale(int device, float *x, size_t n, float factor, char *err,
                                 size_t errlen)
{
    PS_CHECK(begin(device, err, errlen));
    if (n == 0)
        return PSHARD_OK;
    k_scale<<<blocks_for(n), THREADS, 0, g_stream>>>(x, n, factor);
    return finish("clipping gradients", err, errlen);
}

static pshard_status_t dev_optim_step(int device, const ps_optim_scalars_t *sc, float *param,
                                      const void *r, pshard_dtype_t dt, bool scaled, float scale,
                                      float *state0, float *state1, size_t n, char *err,
                                      size_t errlen)
{
    PS_CHECK(begin(device, err, errlen));
    if (n == 0)
        return PSHARD_OK;
    k_optim<<<blocks_for(n), THREADS, 0, g_stream>>>(*sc, param, r, dt, scaled, scale, state0,
                                                     state1, n);
    return finish("the optimizer step", err, errlen);
}

static pshard_status_t dev_max_abs(int device, const float *x, size_t n, float *out, char *err,
                                   size_t errlen)
{
    *out = 0.0f;
    PS_CHECK(begin(device, err, errlen));
    if (n == 0)
        return PSHARD_OK;
    if (!g_max)
        CU_TRY(cudaMalloc((void **)&g_max, sizeof(unsigned int)), "cudaMalloc (max norm)");
    CU_TRY(cudaMemsetAsync(g_max, 0, sizeof(unsigned int), g_stream), "cudaMemsetAsync (max norm)");
    k_max_abs<<<blocks_for(n), THREADS, 0, g_stream>>>(x, n, g_max);
    CU_TRY(cudaGetLastError(), "the gradients' largest magnitude");
    unsigned int bits = 0;
    CU_TRY(cudaMemcpyAsync(&bits, g_max, sizeof(bits), cudaMemcpyDeviceToHost, g_stream),
           "copying the gradients' largest magnitude");
    CU_TRY(cudaStreamSynchronize(g_stream), "the gradients' largest magnitude");
    *out = f32_from_bits(bits);
    return PSHARD_OK;
}

static const shard_dev_ops_t cuda_ops = {
    "cuda",         false,       dev_alloc,        dev_free,        dev_copy,
    dev_zero,       dev_convert, dev_accumulate,   dev_sum_squares, dev_scale,
    dev_optim_step, dev_max_abs, dev_alloc_shared, dev_free_shared,
};

// The module's entry: the table, or NULL when the loader is of another pshard version (the
// table's layout is that of the shard_cuda.h it was built with).
extern "C" __attribute__((visibility("default"))) const shard_dev_ops_t *
pshard_cuda_kernels(const char *version)
{
    return strcmp(version, PSHARD_VERSION_STRING) == 0 ? &cuda_ops : NULL;
}
