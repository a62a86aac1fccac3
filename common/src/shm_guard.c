/* Guarded shared-memory mappings (pshard/shm_guard.h): a table of ranges the SIGBUS handler
 * reads without locks (each slot's range is published with one atomic store of its start). */
#include "pshard/shm_guard.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "pshard/log.h"

typedef struct {
    _Atomic uintptr_t base; /* 0: free */
    _Atomic size_t bytes;
    atomic_bool lost;
} guard_t;

static guard_t guards[PS_SHM_GUARD_MAX];
static pthread_mutex_t guards_mu = PTHREAD_MUTEX_INITIALIZER; /* add / remove */
static struct sigaction previous;
static bool installed;
static uintptr_t page_size;

/* Async-signal-safe: atomics, mmap and the previous handler only. */
static void on_sigbus(int sig, siginfo_t *si, void *ctx)
{
    uintptr_t at = (uintptr_t)si->si_addr;
    for (int i = 0; i < PS_SHM_GUARD_MAX; i++) {
        uintptr_t base = atomic_load(&guards[i].base);
        size_t bytes = atomic_load(&guards[i].bytes);
        if (!base || at < base || at - base >= bytes)
            continue;
        uintptr_t page = at & ~(page_size - 1);
        void *p = mmap((void *)page, base + bytes - page, PROT_READ | PROT_WRITE,
                       MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p != MAP_FAILED) {
            atomic_store(&guards[i].lost, true);
            return; /* the access runs again, on the private pages */
        }
        break;
    }
    if (previous.sa_flags & SA_SIGINFO) {
        previous.sa_sigaction(sig, si, ctx);
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
    } else {
        /* The default action: a fault dies on the same access once this returns; a SIGBUS
         * another process sent is sent again, to be delivered when this returns. */
        signal(SIGBUS, SIG_DFL);
        if (si->si_code <= 0)
            raise(SIGBUS);
    }
}

static bool install(void)
{
    if (installed)
        return true;
    page_size = (uintptr_t)sysconf(_SC_PAGESIZE);
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous) != 0)
        return false;
    installed = true;
    return true;
}

int ps_shm_guard_add(void *base, size_t bytes)
{
    if (!base || !bytes)
        return -1;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    bytes = (bytes + page - 1) & ~(page - 1);
    int id = -1;
    pthread_mutex_lock(&guards_mu);
    if (install()) {
        for (int i = 0; i < PS_SHM_GUARD_MAX && id < 0; i++) {
            if (atomic_load(&guards[i].base))
                continue;
            atomic_store(&guards[i].lost, false);
            atomic_store(&guards[i].bytes, bytes);
            atomic_store(&guards[i].base, (uintptr_t)base);
            id = i;
        }
    }
    pthread_mutex_unlock(&guards_mu);
    if (id < 0)
        PS_WARN(PS_SUB_MAIN,
                "shared memory at %p (%zu bytes) is not guarded against being shrunk "
                "by another process: %s",
                base, bytes,
                installed ? "too many guarded mappings" : "cannot install the SIGBUS handler");
    return id;
}

bool ps_shm_guard_lost(int id)
{
    return id >= 0 && id < PS_SHM_GUARD_MAX && atomic_load(&guards[id].lost);
}

void ps_shm_guard_remove(int id)
{
    if (id < 0 || id >= PS_SHM_GUARD_MAX)
        return;
    pthread_mutex_lock(&guards_mu);
    atomic_store(&guards[id].base, 0);
    atomic_store(&guards[id].lost, false);
    pthread_mutex_unlock(&guards_mu);
}
