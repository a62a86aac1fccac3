/* libpshard's openings of its shard server's memory: the shared-memory objects the server
 * made (named "/pshard-srv-..."), and its device memory, a CUDA IPC handle or, for the test
 * suite's emulated device, one more such object standing in for the allocation (the
 * GPU-resident shard, and the model region in GPU memory). */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/util.h"

#include "client_internal.h"

#define SRV_PREFIX "/pshard-srv-"

bool client_srv_name_ok(const char *name)
{
    size_t n = strlen(name), plen = strlen(SRV_PREFIX);
    if (n <= plen || n >= 64 || strncmp(name, SRV_PREFIX, plen) != 0)
        return false;
    for (size_t i = plen; i < n; i++) {
        char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '-'))
            return false;
    }
    return true;
}

pshard_status_t client_map_object(const char *name, size_t bytes, void **base, char *err,
                                  size_t errlen)
{
    int fd = shm_open(name, O_RDWR | O_NOFOLLOW, 0);
    if (fd < 0)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "cannot open %s: %s", name, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
        (uint64_t)st.st_size < bytes) {
        close(fd);
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM,
                       "%s is not a %zu-byte shared-memory object of this user", name, bytes);
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED)
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM, "mmap %s: %s", name, strerror(e));
    *base = p;
    return PSHARD_OK;
}

pshard_status_t client_dev_set(dev_map_t *d, const void *handle, size_t len, const char *kind,
                               int device, uint64_t bytes, char *err, size_t errlen)
{
    memset(d, 0, sizeof(*d));
    kind = kind ? kind : "";
    bool cuda = strcmp(kind, "cuda") == 0;
    if (!cuda && strcmp(kind, "emulated") != 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "device memory of an unknown kind '%.32s'", kind);
    if (device < 0)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "CUDA device %d is not one",
                       device);
    if (len == 0 || len > sizeof(d->handle))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "a device memory handle of %zu bytes", len);
    if (bytes == 0 || bytes > (1ull << 46))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "device memory of %llu bytes is out of range", (unsigned long long)bytes);
    memcpy(d->handle, handle, len);
    d->handle_len = len;
    d->bytes = (size_t)bytes;
    d->device = device;
    d->memory = cuda ? PSHARD_MEMORY_CUDA : PSHARD_MEMORY_EMULATED;
    return PSHARD_OK;
}

pshard_status_t client_dev_open(dev_map_t *d, const char *other, char *err, size_t errlen)
{
    if (d->base)
        return PSHARD_OK;
    if (d->memory == PSHARD_MEMORY_CUDA)
        return client_cuda_ipc_open(d->handle, d->handle_len, d->device, &d->base, err, errlen);
    char name[64];
    if (d->handle_len >= sizeof(name))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "an emulated device handle of %zu bytes", d->handle_len);
    memcpy(name, d->handle, d->handle_len);
    name[d->handle_len] = '\0';
    if (!client_srv_name_ok(name) || (other && strcmp(name, other) == 0))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "the emulated device memory's name is not one of the server's objects");
    return client_map_object(name, d->bytes, &d->base, err, errlen);
}

void client_dev_close(dev_map_t *d)
{
    if (d->memory == PSHARD_MEMORY_CUDA)
        client_cuda_ipc_close(d->base);
    else if (d->base)
        munmap(d->base, d->bytes);
    d->base = NULL;
}

pshard_status_t client_dev_zero(const dev_map_t *d, void *p, size_t bytes, char *err, size_t errlen)
{
    if (d->memory == PSHARD_MEMORY_CUDA)
        return client_cuda_zero(d->device, p, bytes, err, errlen);
    memset(p, 0, bytes);
    return PSHARD_OK;
}
