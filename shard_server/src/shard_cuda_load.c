/* shard_dev_cuda() for builds with nvcc: opens the kernels module libpshard_cuda_kernels.so
 * (shard_cuda.cu) on first use, so that pshard-server needs no CUDA library to start and loads
 * the kernels, with the CUDA runtime linked into them, only when shards live on a GPU. */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/util.h"
#include "shard_cuda.h"

#define KERNELS_MODULE "libpshard_cuda_kernels.so"
#define KERNELS_ENTRY "pshard_cuda_kernels"

typedef const shard_dev_ops_t *(*kernels_entry_t)(const char *version);

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static bool load_tried;
static const shard_dev_ops_t *loaded_ops;
static char load_err[PSHARD_ERRLEN];

/* Opens the module: $PSHARD_CUDA_KERNELS alone when set, else beside the executable, then in
 * ../lib from it (where `cmake --install` puts it). NULL when none opens; tried then lists each
 * attempt with dlerror's reason. */
static void *open_module(char *tried, size_t len)
{
    char paths[2][PATH_MAX + 64];
    int n = 0;
    const char *only = getenv("PSHARD_CUDA_KERNELS");
    if (only && only[0]) {
        snprintf(paths[n++], sizeof(paths[0]), "%s", only);
    } else {
        char exe[PATH_MAX];
        ssize_t got = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
        if (got > 0) {
            exe[got] = '\0';
            char *slash = strrchr(exe, '/');
            if (slash)
                *slash = '\0';
            snprintf(paths[n++], sizeof(paths[0]), "%s/%s", exe, KERNELS_MODULE);
            snprintf(paths[n++], sizeof(paths[0]), "%s/../lib/%s", exe, KERNELS_MODULE);
        }
    }
    tried[0] = '\0';
    for (int i = 0; i < n; i++) {
        void *h = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL);
        if (h) {
            PS_DEBUG(PS_SUB_SHARD, "loaded the CUDA kernels from %s", paths[i]);
            return h;
        }
        const char *why = dlerror();
        size_t used = strlen(tried);
        ps_snprintf(tried + used, len - used, "%s%s", used ? "; " : "", why ? why : paths[i]);
    }
    if (n == 0)
        snprintf(tried, len, "cannot read /proc/self/exe to find the executable's directory");
    return NULL;
}

/* Loads the module and takes its table; load_mu held. */
static const shard_dev_ops_t *load_locked(char *err, size_t errlen)
{
    char tried[PSHARD_ERRLEN];
    void *h = open_module(tried, sizeof(tried));
    if (!h) {
        ps_errf(err, errlen, PSHARD_ERR_NOT_FOUND,
                "the CUDA kernels module %s was not found: it is installed beside pshard-server "
                "(or in ../lib from it); set PSHARD_CUDA_KERNELS to its path (dlopen: %s)",
                KERNELS_MODULE, tried);
        return NULL;
    }
    kernels_entry_t entry;
    void *sym = dlsym(h, KERNELS_ENTRY);
    memcpy(&entry, &sym, sizeof(sym)); /* ISO C has no cast from void * to a function pointer */
    const shard_dev_ops_t *ops = sym ? entry(PSHARD_VERSION_STRING) : NULL;
    if (!ops) {
        ps_errf(err, errlen, PSHARD_ERR_INTERNAL,
                "%s is not the CUDA kernels module of pshard %s (%s): install the one built with "
                "this pshard-server",
                KERNELS_MODULE, PSHARD_VERSION_STRING,
                sym ? "another version" : "no " KERNELS_ENTRY);
        dlclose(h);
        return NULL;
    }
    return ops;
}

const shard_dev_ops_t *shard_dev_cuda(char *err, size_t errlen)
{
    pthread_mutex_lock(&load_mu);
    if (!load_tried) {
        loaded_ops = load_locked(load_err, sizeof(load_err));
        load_tried = true;
    }
    const shard_dev_ops_t *ops = loaded_ops;
    if (!ops)
        ps_strlcpy(err, load_err, errlen);
    pthread_mutex_unlock(&load_mu);
    return ops;
}
