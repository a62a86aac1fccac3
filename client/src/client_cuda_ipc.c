/* libpshard's opening of a shard server's GPU memory (CUDA IPC): the CUDA runtime is loaded at
 * run time (dlopen of the SONAME the build found, PSHARD_CUDART_SONAME), so that a trainer on a
 * machine without CUDA loads libpshard and runs everything else; without CUDA at build time,
 * or without the library at run time, opening a handle is an error naming what is missing. */
#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#include "pshard/util.h"

#include "client_internal.h"

#ifdef PSHARD_CUDART_SONAME
/* cudaIpcMemHandle_t: 64 opaque bytes, passed by value. */
typedef struct {
    char reserved[CLIENT_IPC_HANDLE_BYTES];
} ipc_handle_t;

typedef int (*get_device_fn)(int *);
typedef int (*set_device_fn)(int);
typedef int (*ipc_open_fn)(void **, ipc_handle_t, unsigned int);
typedef int (*ipc_close_fn)(void *);
typedef const char *(*error_string_fn)(int);
typedef int (*memset_fn)(void *, int, size_t);
typedef int (*stream_sync_fn)(void *);

static struct {
    bool tried;
    char err[PSHARD_ERRLEN];
    get_device_fn get_device;
    set_device_fn set_device;
    ipc_open_fn open;
    ipc_close_fn close;
    error_string_fn error_string;
    memset_fn memset;
    stream_sync_fn stream_sync;
} rt;
static pthread_mutex_t rt_mu = PTHREAD_MUTEX_INITIALIZER;

/* Loads the runtime once; false with the reason in rt.err. Under rt_mu. */
static bool load_locked(void)
{
    if (rt.tried)
        return rt.open != NULL;
    rt.tried = true;
    void *h = dlopen(PSHARD_CUDART_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *why = dlerror();
        ps_snprintf(rt.err, sizeof(rt.err),
                    "cannot load the CUDA runtime %s (%s): install the CUDA runtime, or start the "
                    "shard servers with --offload cpu",
                    PSHARD_CUDART_SONAME, why ? why : "unknown");
        return false;
    }
    rt.get_device = (get_device_fn)dlsym(h, "cudaGetDevice");
    rt.set_device = (set_device_fn)dlsym(h, "cudaSetDevice");
    rt.close = (ipc_close_fn)dlsym(h, "cudaIpcCloseMemHandle");
    rt.error_string = (error_string_fn)dlsym(h, "cudaGetErrorString");
    rt.memset = (memset_fn)dlsym(h, "cudaMemset");
    rt.stream_sync = (stream_sync_fn)dlsym(h, "cudaStreamSynchronize");
    ipc_open_fn open = (ipc_open_fn)dlsym(h, "cudaIpcOpenMemHandle");
    if (!rt.get_device || !rt.set_device || !rt.close || !rt.error_string || !rt.memset ||
        !rt.stream_sync || !open) {
        ps_snprintf(rt.err, sizeof(rt.err), "%s lacks the CUDA IPC functions",
                    PSHARD_CUDART_SONAME);
        return false;
    }
    rt.open = open;
    return true;
}

pshard_status_t client_cuda_ipc_open(const void *handle, size_t len, int device, void **out,
                                     char *err, size_t errlen)
{
    *out = NULL;
    if (len != CLIENT_IPC_HANDLE_BYTES)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "a CUDA IPC handle has %d bytes, not %zu", CLIENT_IPC_HANDLE_BYTES, len);
    pthread_mutex_lock(&rt_mu);
    bool ok = load_locked();
    pthread_mutex_unlock(&rt_mu);
    if (!ok)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION, "%s", rt.err);
    ipc_handle_t h;
    memcpy(&h, handle, sizeof(h));
    int saved = -1;
    int rc = rt.get_device(&saved);
    if (rc == 0)
        rc = rt.set_device(device);
    void *p = NULL;
    if (rc == 0)
        rc = rt.open(&p, h, 1 /* cudaIpcMemLazyEnablePeerAccess */);
    if (saved >= 0)
        rt.set_device(saved);
    if (rc != 0)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "cudaIpcOpenMemHandle of the shard server's GPU memory on device %d: %s "
                       "(the trainer must be on the server's host, with a CUDA device)",
                       device, rt.error_string(rc));
    *out = p;
    return PSHARD_OK;
}

void client_cuda_ipc_close(void *p)
{
    if (p && rt.close)
        rt.close(p);
}

pshard_status_t client_cuda_zero(int device, void *p, size_t bytes, char *err, size_t errlen)
{
    pthread_mutex_lock(&rt_mu);
    bool ok = load_locked();
    pthread_mutex_unlock(&rt_mu);
    if (!ok)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION, "%s", rt.err);
    int saved = -1;
    int rc = rt.get_device(&saved);
    if (rc == 0)
        rc = rt.set_device(device);
    if (rc == 0)
        rc = rt.memset(p, 0, bytes);
    if (rc == 0)
        rc = rt.stream_sync(NULL); /* the legacy default stream, which the memset ran on */
    if (saved >= 0)
        rt.set_device(saved);
    if (rc != 0)
        return ps_errf(err, errlen, PSHARD_ERR_CUDA, "zeroing %zu bytes on CUDA device %d: %s",
                       bytes, device, rt.error_string(rc));
    return PSHARD_OK;
}
#else
pshard_status_t client_cuda_ipc_open(const void *handle, size_t len, int device, void **out,
                                     char *err, size_t errlen)
{
    (void)handle;
    (void)len;
    *out = NULL;
    return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                   "the shard server keeps the shard in GPU memory (device %d), and this libpshard "
                   "was built without CUDA, so it cannot open it: rebuild with CUDA, or start the "
                   "shard servers with --offload cpu",
                   device);
}

void client_cuda_ipc_close(void *p)
{
    (void)p;
}

pshard_status_t client_cuda_zero(int device, void *p, size_t bytes, char *err, size_t errlen)
{
    (void)p;
    (void)bytes;
    return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                   "this libpshard was built without CUDA: it cannot write CUDA device %d's memory",
                   device);
}
#endif
