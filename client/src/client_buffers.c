/* Where a parameter's full values and full gradient live while unsharded: pool blocks, or
 * with stable_param_buffers fixed addresses that are remapped onto pool blocks. Callers hold
 * the client's mutex. */
#include <errno.h>
#include <string.h>
#include <sys/mman.h>

#include "pshard/log.h"
#include "pshard/util.h"

#include "client_internal.h"

void client_buf_release(pshard_client_t *c, tensor_buf_t *b)
{
    if (b->state != BUF_NONE)
        client_pool_free(c->pool, b->off, b->bytes);
    b->state = BUF_NONE;
}

static size_t page_up(const pshard_client_t *c, size_t x)
{
    return (x + c->page - 1) / c->page * c->page;
}

/* Whether parameter i's fixed addresses are remapped to pool blocks (see stable_off). */
static bool param_remapped(const pshard_client_t *c, size_t i)
{
    return c->remap && c->numel[i] * pshard_dtype_size(c->param_dtype) >= c->page;
}

/* Points the len bytes at parameter i's fixed address at the region's file from file_off. */
static bool param_map(pshard_client_t *c, size_t i, size_t file_off, size_t len, bool populate)
{
    void *want = (uint8_t *)c->model.base + c->stable_off[i];
    void *p =
        mmap(want, len, PROT_READ | PROT_WRITE,
             MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0), c->model.fd, (off_t)file_off);
    return p == want;
}

/* Takes the block for parameter i's full values: its fixed block with stable_param_buffers
 * (for a remapped parameter, a pool block mapped at its fixed address), else one from the
 * pool. 1: taken; 0: the pool is full; -1: failed (the error is set). */
int client_param_take(pshard_client_t *c, size_t i, size_t bytes, size_t *off)
{
    if (!c->stable_off)
        return client_pool_alloc(c->pool, bytes, CLIENT_POOL_ALIGN, off) ? 1 : 0;
    if (param_remapped(c, i)) {
        size_t len = page_up(c, bytes);
        if (!client_pool_alloc(c->pool, len, c->page, off))
            return 0;
        if (!param_map(c, i, *off, len, true)) {
            int e = errno;
            /* Whatever the failed call left at the fixed address, put its own pages back
             * before the block can go to another parameter. */
            if (param_map(c, i, c->stable_off[i], len, false))
                client_pool_free(c->pool, *off, len);
            client_fail(c, PSHARD_ERR_NO_MEMORY, "cannot map parameter #%zu's %zu-byte block: %s",
                        i, len, strerror(e));
            return -1;
        }
        return 1;
    }
    *off = c->stable_off[i];
    client_pool_hold(c->pool, bytes);
    return 1;
}

/* Reshards parameter i: its block goes back to the pool, or with stable_param_buffers its
 * addresses stay valid and read as zeros until the next gather writes them again (a remapped
 * parameter's show its own unwritten pages again, its pool block is kept backed for the next
 * gather; another one's pages go back to the kernel). */
void client_param_release(pshard_client_t *c, size_t i)
{
    tensor_buf_t *b = &c->pbuf[i];
    if (b->state != BUF_NONE && c->stable_off && param_remapped(c, i)) {
        size_t len = page_up(c, b->bytes);
        if (param_map(c, i, c->stable_off[i], len, false))
            client_pool_free(c->pool, b->off, len);
        else /* still shown at the fixed address: never hand it to another parameter */
            PS_WARN(PS_SUB_CLIENT,
                    "cannot map parameter #%zu's own pages back (%s): its %zu-byte pool block "
                    "stays out of the pool",
                    i, strerror(errno), len);
        b->state = BUF_NONE;
    } else if (b->state != BUF_NONE && c->stable_off) {
        client_pool_unhold(c->pool, b->bytes);
        /* A block of a page or more owns whole pages, its last one included. (GPU memory
         * stays allocated: the next gather writes it again.) */
        if (!c->region_dev.base)
            client_region_discard(&c->model, b->off,
                                  b->bytes >= c->page ? page_up(c, b->bytes) : b->bytes);
        b->state = BUF_NONE;
    }
    client_buf_release(c, b);
}

/* Frees every full parameter and gradient (a new model, or parameters stale after a step). */
void client_params_reset(pshard_client_t *c)
{
    for (size_t i = 0; i < c->nparams; i++)
        if (c->pbuf[i].state == BUF_READY)
            client_param_release(c, i);
}
