/* Loads the CUDA runtime and NCCL at run time (coll_cuda_api.h). The build passes the SONAMEs
 * of the libraries CMake found (PSHARD_CUDART_SONAME, PSHARD_NCCL_SONAME) and their
 * directories (PSHARD_CUDART_DIR, PSHARD_NCCL_DIR), so the versions loaded are those the
 * headers described; the directories are a last resort for builds whose CUDA is not on the
 * dynamic linker's path (what the build tree's RPATH gave before). */
#include "coll_cuda_api.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/log.h"
#include "pshard/util.h"

#if !defined(PSHARD_CUDART_SONAME) || !defined(PSHARD_NCCL_SONAME) ||                              \
    !defined(PSHARD_CUDART_DIR) || !defined(PSHARD_NCCL_DIR)
#error "the build defines PSHARD_CUDART_SONAME, PSHARD_NCCL_SONAME and their directories"
#endif

#define CUDA_MAJOR (CUDART_VERSION / 1000)
#define CUDA_MINOR (CUDART_VERSION % 1000 / 10)

coll_cuda_api_t coll_cu;

/* One library's loading: done once, its outcome kept for later calls. */
typedef struct lib_state {
    bool tried;
    pshard_status_t status;
    char err[PSHARD_ERRLEN];
} lib_state_t;

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static lib_state_t cudart_state, nccl_state;

/* dlopens the library: $env_var alone when set, else soname, then dir/soname. NULL when none
 * loads; tried then lists each attempt with dlerror's reason. */
static void *open_lib(const char *env_var, const char *soname, const char *dir, char *tried,
                      size_t len)
{
    const char *only = getenv(env_var);
    char fallback[1024];
    const char *names[2] = {soname, fallback};
    int n = 2;
    if (only && only[0]) {
        names[0] = only;
        n = 1;
    } else {
        snprintf(fallback, sizeof(fallback), "%s/%s", dir, soname);
    }
    tried[0] = '\0';
    for (int i = 0; i < n; i++) {
        void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (h) {
            PS_DEBUG(PS_SUB_COLL, "loaded %s", names[i]);
            return h;
        }
        const char *why = dlerror();
        size_t used = strlen(tried);
        ps_snprintf(tried + used, len - used, "%s%s", used ? "; " : "", why ? why : names[i]);
    }
    return NULL;
}

/* dlsym of one function into the table; on a missing one, jumps to missing_symbol with its
 * name in missing. memcpy: ISO C has no cast from void * to a function pointer. */
#define BIND_ONE_(fn)                                                                              \
    do {                                                                                           \
        void *sym_ = dlsym(h, #fn);                                                                \
        if (!sym_) {                                                                               \
            missing = #fn;                                                                         \
            goto missing_symbol;                                                                   \
        }                                                                                          \
        memcpy(&coll_cu.fn, &sym_, sizeof(sym_));                                                  \
    } while (0);

/* Fills the CUDA entries; load_mu held. */
static pshard_status_t load_cudart_locked(char *err, size_t errlen)
{
    char tried[PSHARD_ERRLEN];
    void *h = open_lib("PSHARD_CUDART_LIBRARY", PSHARD_CUDART_SONAME, PSHARD_CUDART_DIR, tried,
                       sizeof(tried));
    const char *missing = NULL;
    if (!h) {
        char pip[64];
        if (CUDA_MAJOR >= 13)
            snprintf(pip, sizeof(pip), "nvidia-cuda-runtime");
        else
            snprintf(pip, sizeof(pip), "nvidia-cuda-runtime-cu%d", CUDA_MAJOR);
        return ps_errf(err, errlen, PSHARD_ERR_CUDA,
                       "%s not found: install the CUDA %d runtime (Debian/Ubuntu: "
                       "cuda-cudart-%d-%d from NVIDIA's CUDA repository, or pip install %s) or "
                       "set LD_LIBRARY_PATH to its directory (dlopen: %s)",
                       PSHARD_CUDART_SONAME, CUDA_MAJOR, CUDA_MAJOR, CUDA_MINOR, pip, tried);
    }
    COLL_CUDART_FUNCS(BIND_ONE_)
    return PSHARD_OK;
missing_symbol:
    return ps_errf(err, errlen, PSHARD_ERR_CUDA,
                   "%s has no %s: it is older than the CUDA %d.%d runtime pshard was built with; "
                   "install that runtime or newer",
                   PSHARD_CUDART_SONAME, missing, CUDA_MAJOR, CUDA_MINOR);
}

/* Fills the NCCL entries; load_mu held. */
static pshard_status_t load_nccl_locked(char *err, size_t errlen)
{
    char tried[PSHARD_ERRLEN];
    void *h =
        open_lib("PSHARD_NCCL_LIBRARY", PSHARD_NCCL_SONAME, PSHARD_NCCL_DIR, tried, sizeof(tried));
    const char *missing = NULL;
    if (!h)
        return ps_errf(err, errlen, PSHARD_ERR_NCCL,
                       "%s not found: install NCCL (Debian/Ubuntu: libnccl2 from NVIDIA's CUDA "
                       "repository, or pip install nvidia-nccl-cu%d) or set LD_LIBRARY_PATH to "
                       "its directory (dlopen: %s)",
                       PSHARD_NCCL_SONAME, CUDA_MAJOR, tried);
    COLL_NCCL_FUNCS(BIND_ONE_)
    return PSHARD_OK;
missing_symbol:
    return ps_errf(err, errlen, PSHARD_ERR_NCCL,
                   "%s has no %s: it is older than NCCL %d.%d, which pshard was built with; "
                   "install that NCCL or newer",
                   PSHARD_NCCL_SONAME, missing, NCCL_MAJOR, NCCL_MINOR);
}

/* Runs load once for st, keeping its outcome; load_mu held. The caller reports a failure
 * (the shard server as its start error), so it is not logged here. */
static pshard_status_t load_once_locked(lib_state_t *st,
                                        pshard_status_t (*load)(char *err, size_t errlen))
{
    if (!st->tried) {
        st->status = load(st->err, sizeof(st->err));
        st->tried = true;
    }
    return st->status;
}

pshard_status_t coll_cudart_load(char *err, size_t errlen)
{
    pthread_mutex_lock(&load_mu);
    pshard_status_t rc = load_once_locked(&cudart_state, load_cudart_locked);
    if (rc != PSHARD_OK)
        ps_errf(err, errlen, rc, "%s", cudart_state.err);
    pthread_mutex_unlock(&load_mu);
    return rc;
}

pshard_status_t coll_nccl_load(char *err, size_t errlen)
{
    pthread_mutex_lock(&load_mu);
    lib_state_t *failed = NULL;
    pshard_status_t rc = load_once_locked(&cudart_state, load_cudart_locked);
    if (rc != PSHARD_OK)
        failed = &cudart_state;
    else if ((rc = load_once_locked(&nccl_state, load_nccl_locked)) != PSHARD_OK)
        failed = &nccl_state;
    if (failed)
        ps_errf(err, errlen, rc, "%s", failed->err);
    pthread_mutex_unlock(&load_mu);
    return rc;
}
