/* Buffers given whole or in pieces (coll_buf.h). */
#include "coll_buf.h"

#include <stdlib.h>
#include <string.h>

#include "coll_reduce.h"
#include "pshard/util.h"

coll_buf_t coll_buf_flat(const void *p)
{
    return (coll_buf_t){.base = (uint64_t)(uintptr_t)p};
}

pshard_status_t coll_buf_from_segs(coll_buf_t *b, const pshard_coll_seg_t *segs, size_t n,
                                   size_t esize, size_t elements, const char *what, char *err,
                                   size_t errlen)
{
    memset(b, 0, sizeof(*b));
    if (n == 0 || n > PSHARD_COLL_MAX_SEGS)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s has %zu pieces; 1 to %d are allowed", what, n, PSHARD_COLL_MAX_SEGS);
    b->pieces = malloc(n * sizeof(*b->pieces));
    b->ends = malloc(n * sizeof(*b->ends));
    if (!b->pieces || !b->ends) {
        coll_buf_free(b);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (segs[i].count && !segs[i].ptr) {
            coll_buf_free(b);
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s piece %zu is NULL but holds %zu elements", what, i, segs[i].count);
        }
        if (segs[i].count > elements - total / esize) {
            coll_buf_free(b);
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s pieces hold more than the operation's %zu elements", what, elements);
        }
        b->pieces[i] = (coll_piece_t){(uint64_t)(uintptr_t)segs[i].ptr, segs[i].count * esize};
        total += segs[i].count * esize;
        b->ends[i] = total;
    }
    if (total != (uint64_t)elements * esize) {
        coll_buf_free(b);
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "%s pieces hold %llu elements, the operation %zu", what,
                       (unsigned long long)(total / esize), elements);
    }
    b->npieces = n;
    return PSHARD_OK;
}

void coll_buf_free(coll_buf_t *b)
{
    free(b->pieces);
    free(b->ends);
    b->pieces = NULL;
    b->ends = NULL;
    b->npieces = 0;
}

uint64_t coll_buf_at(coll_buf_t *b, uint64_t off, uint64_t *contig)
{
    if (!b->npieces) {
        *contig = UINT64_MAX;
        return b->base + off;
    }
    /* Forward scans are the common case; anything else starts over with a binary search. */
    size_t i = b->cur < b->npieces ? b->cur : 0;
    uint64_t start = i ? b->ends[i - 1] : 0;
    if (off < start || off >= b->ends[i]) {
        if (i + 1 < b->npieces && off >= b->ends[i] && off < b->ends[i + 1]) {
            i++;
        } else {
            size_t lo = 0, hi = b->npieces - 1;
            while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;
                if (b->ends[mid] <= off)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            i = lo;
        }
        /* Empty pieces end where they start: step past them. */
        while (i + 1 < b->npieces && b->ends[i] <= off)
            i++;
        b->cur = i;
        start = i ? b->ends[i - 1] : 0;
    }
    *contig = b->ends[i] - off;
    return b->pieces[i].addr + (off - start);
}

void coll_buf_copy(coll_buf_t *dst, uint64_t doff, coll_buf_t *src, uint64_t soff, size_t len)
{
    while (len > 0) {
        uint64_t dc, sc;
        uint8_t *d = (uint8_t *)(uintptr_t)coll_buf_at(dst, doff, &dc);
        const uint8_t *s = (const uint8_t *)(uintptr_t)coll_buf_at(src, soff, &sc);
        uint64_t n = len;
        n = n < dc ? n : dc;
        n = n < sc ? n : sc;
        if (d != s)
            memmove(d, s, (size_t)n);
        doff += n;
        soff += n;
        len -= (size_t)n;
    }
}

/* Runs fn over the contiguous stretches of nel elements of dt at off in b, with acc advancing
 * by the partial-sum size per element. */
typedef void (*span_fn)(uint8_t *acc, uint8_t *p, pshard_dtype_t dt, size_t nel, double scale,
                        int red);

static void over_spans(coll_buf_t *b, uint64_t off, pshard_dtype_t dt, size_t nel, uint8_t *acc,
                       double scale, int red, span_fn fn)
{
    size_t es = pshard_dtype_size(dt), as = pshard_dtype_size(coll_acc_dtype(dt));
    while (nel > 0) {
        uint64_t c;
        uint8_t *p = (uint8_t *)(uintptr_t)coll_buf_at(b, off, &c);
        size_t k = c / es < nel ? (size_t)(c / es) : nel;
        fn(acc, p, dt, k, scale, red);
        acc += k * as;
        off += (uint64_t)k * es;
        nel -= k;
    }
}

static void load_span(uint8_t *acc, uint8_t *p, pshard_dtype_t dt, size_t nel, double scale,
                      int red)
{
    (void)scale;
    (void)red;
    coll_reduce_load(acc, p, dt, nel);
}

static void accumulate_span(uint8_t *acc, uint8_t *p, pshard_dtype_t dt, size_t nel, double scale,
                            int red)
{
    (void)scale;
    coll_reduce_accumulate(acc, p, dt, red, nel);
}

static void store_span(uint8_t *acc, uint8_t *p, pshard_dtype_t dt, size_t nel, double scale,
                       int red)
{
    (void)red;
    coll_reduce_store(p, dt, acc, nel, scale);
}

void coll_buf_load(void *acc, coll_buf_t *src, uint64_t off, pshard_dtype_t dt, size_t nel)
{
    over_spans(src, off, dt, nel, acc, 1.0, 0, load_span);
}

void coll_buf_accumulate(void *acc, coll_buf_t *src, uint64_t off, pshard_dtype_t dt, int red,
                         size_t nel)
{
    over_spans(src, off, dt, nel, acc, 1.0, red, accumulate_span);
}

void coll_buf_store(coll_buf_t *dst, uint64_t off, pshard_dtype_t dt, const void *acc, size_t nel,
                    double scale)
{
    over_spans(dst, off, dt, nel, (uint8_t *)acc, scale, 0, store_span);
}
