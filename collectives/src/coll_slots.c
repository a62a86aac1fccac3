/* The same-host transport's fast path for small operations (coll_slots.h): a shared segment of
 * per-rank slots, sequence words that ranks spin and then sleep (futex) on, and the abort
 * record every rank reads. */
#include "coll_slots.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "coll_reduce.h"
#include "pshard/log.h"
#include "pshard/util.h"

#define SLOTS_MAGIC 0x3173746f6c737370ull /* "psslots1" */
#define SLOTS_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
#define HDR_BYTES 4096u
#define ABORT_MSG 512
/* Elements a reduction sums at a time (its partial sums stay in the core's cache). */
#define ACC_ELEMS 4096u
/* Spinning before sleeping: on the CPU (when every rank may have a core) and yielding it. */
#define SPIN_NS 50000
#define YIELD_NS 200000
/* A sleeper looks at the abort record, its peer's process and the deadline this often. */
#define SLEEP_SLICE_NS 20000000

typedef struct {
    uint64_t magic;
    uint8_t nonce[16];
    uint32_t n;
    uint32_t slot_bytes;
    _Atomic uint32_t abort_state; /* 0: none; 1: being written; 2: written */
    int32_t abort_status;
    uint32_t abort_origin;
    char abort_msg[ABORT_MSG];
} hdr_t;

/* A rank's control words, one cache line. */
typedef struct {
    _Atomic uint32_t bell;    /* bumped after a change to its words while someone sleeps on it */
    _Atomic uint32_t waiters; /* threads (of any rank) sleeping on bell */
    _Atomic uint32_t stage;   /* (uint32_t)(4 * (seq + 1) + k): it finished reading phase k of
                                 operation seq (operations that read the others' memory) */
    _Atomic uint32_t closed;  /* it destroyed the communicator */
    uint8_t pad[48];
} ctl_t;

/* 144: a shard server's agreement record (16 int64) fits, besides an 8-byte all-reduce. */
#define MAIL_DATA 144u
#define MAIL_IN_SLOT UINT32_MAX

/* What a peer reads of a rank's operation first, three cache lines by sequence parity: the
 * word it waits on, what descriptors are compared by, and the data of a tiny operation (an
 * 8-byte all-reduce: one line crosses between cores, not five). */
typedef struct {
    _Atomic uint32_t posted; /* (uint32_t)(seq + 1): this mail is operation seq's */
    uint32_t len;            /* data bytes in data[], or MAIL_IN_SLOT */
    uint64_t seq, tag, total_count, counts_hash;
    int32_t root;
    uint8_t op, dtype, reduce, pad;
    uint8_t data[MAIL_DATA];
} mail_t;

typedef struct {
    uint32_t len;     /* data bytes that follow in the slot */
    coll_desc_t desc; /* up to DESC_BYTES: with the buffers' addresses when the operation reads
                         memory, but never data inline (the slot carries it) */
} sdesc_t;

/* What of a descriptor goes through a slot: everything before its inline data, so that a peer
 * reads two cache lines of it, not six. */
#define DESC_BYTES offsetof(coll_desc_t, inline_len)

#define SDESC_BYTES ((offsetof(sdesc_t, desc) + DESC_BYTES + 63u) & ~(size_t)63u)

struct coll_slots {
    int n, rank;
    int fd; /* rank 0 during set-up; else -1 */
    uint8_t *base;
    size_t size, slot_bytes, block;
    hdr_t *hdr;
    int64_t spin_ns;
    void *acc; /* ACC_ELEMS partial sums (8 bytes each covers every accumulation type) */
    /* By rank, for an operation that reads the others' memory: their descriptors and the
     * buffers these name. */
    coll_desc_t *peer_desc;
    coll_buf_t *peer_sbuf, *peer_rbuf;
};

_Static_assert(sizeof(ctl_t) == 64, "one cache line of control words");
_Static_assert(sizeof(mail_t) == 192, "three cache lines of mail");
_Static_assert(sizeof(hdr_t) <= HDR_BYTES, "header fits its page");

static size_t block_bytes(size_t slot_bytes)
{
    return sizeof(ctl_t) + 2 * sizeof(mail_t) + 2 * SDESC_BYTES + 2 * slot_bytes;
}

static size_t segment_bytes(int n, size_t slot_bytes)
{
    return HDR_BYTES + (size_t)n * block_bytes(slot_bytes);
}

static ctl_t *ctl(const coll_slots_t *s, int q)
{
    return (ctl_t *)(s->base + HDR_BYTES + (size_t)q * s->block);
}

static mail_t *mail(const coll_slots_t *s, int q, uint64_t seq)
{
    return (mail_t *)((uint8_t *)ctl(s, q) + sizeof(ctl_t) + (seq & 1) * sizeof(mail_t));
}

static sdesc_t *sdesc(const coll_slots_t *s, int q, uint64_t seq)
{
    return (sdesc_t *)((uint8_t *)ctl(s, q) + sizeof(ctl_t) + 2 * sizeof(mail_t) +
                       (seq & 1) * SDESC_BYTES);
}

static uint8_t *sdata(const coll_slots_t *s, int q, uint64_t seq)
{
    return (uint8_t *)ctl(s, q) + sizeof(ctl_t) + 2 * sizeof(mail_t) + 2 * SDESC_BYTES +
           (seq & 1) * s->slot_bytes;
}

static void futex_wake(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void futex_wait(_Atomic uint32_t *word, uint32_t seen, int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen, &ts, NULL, 0);
}

/* The posted word v says operation want (= seq + 1) or a later one was posted. */
static bool reached(uint32_t v, uint32_t want)
{
    return (int32_t)(v - want) >= 0;
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* Spinning pays off only when every rank may have a core: otherwise it takes the core from
 * the rank it waits for. */
static int64_t spin_budget(int n)
{
    cpu_set_t set;
    int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    return n <= cpus ? SPIN_NS : 0;
}

static coll_slots_t *slots_new(int n, int rank)
{
    coll_slots_t *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->n = n;
    s->rank = rank;
    s->fd = -1;
    s->spin_ns = spin_budget(n);
    s->acc = malloc((size_t)ACC_ELEMS * 8);
    s->peer_desc = calloc((size_t)n, sizeof(coll_desc_t));
    s->peer_sbuf = calloc((size_t)n, sizeof(coll_buf_t));
    s->peer_rbuf = calloc((size_t)n, sizeof(coll_buf_t));
    if (!s->acc || !s->peer_desc || !s->peer_sbuf || !s->peer_rbuf) {
        free(s->acc);
        free(s->peer_desc);
        free(s->peer_sbuf);
        free(s->peer_rbuf);
        free(s);
        return NULL;
    }
    return s;
}

static void slots_free(coll_slots_t *s)
{
    if (s->base)
        munmap(s->base, s->size);
    if (s->fd >= 0)
        close(s->fd);
    free(s->acc);
    free(s->peer_desc);
    free(s->peer_sbuf);
    free(s->peer_rbuf);
    free(s);
}

coll_slots_t *coll_slots_create(int n, const uint8_t nonce[16], int *fd, char *why, size_t whylen)
{
    *fd = -1;
    int64_t want = COLL_SLOTS_DEFAULT_BYTES;
    const char *env = getenv("PSHARD_SHM_SLOT_BYTES");
    if (env && ps_parse_i64(env, 0, COLL_SLOTS_MAX_BYTES, &want) != 0) {
        snprintf(why, whylen, "PSHARD_SHM_SLOT_BYTES='%.32s' is not 0..%u", env,
                 COLL_SLOTS_MAX_BYTES);
        return NULL;
    }
    size_t slot_bytes = (size_t)want & ~(size_t)63;
    size_t cap = (COLL_SLOTS_MAX_SEGMENT / (2 * (size_t)n)) & ~(size_t)63;
    slot_bytes = slot_bytes < cap ? slot_bytes : cap;
    if (slot_bytes < 256) {
        snprintf(why, whylen, "%s",
                 want ? "too many ranks for slots of 256 bytes or more"
                      : "PSHARD_SHM_SLOT_BYTES=0");
        return NULL;
    }
    coll_slots_t *s = slots_new(n, 0);
    if (!s) {
        snprintf(why, whylen, "out of memory");
        return NULL;
    }
    s->slot_bytes = slot_bytes;
    s->block = block_bytes(slot_bytes);
    s->size = segment_bytes(n, slot_bytes);
    /* Sealed at its size: another process that opens it cannot shrink it under the ranks'
     * mappings (a SIGBUS in every rank's server). */
    s->fd = memfd_create("pshard-coll-slots", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (s->fd < 0 || ftruncate(s->fd, (off_t)s->size) != 0 ||
        fcntl(s->fd, F_ADD_SEALS, SLOTS_SEALS) != 0) {
        snprintf(why, whylen, "cannot make the slots' memory: %s", strerror(errno));
        slots_free(s);
        return NULL;
    }
    void *p = mmap(NULL, s->size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    if (p == MAP_FAILED) {
        snprintf(why, whylen, "cannot map the slots' memory: %s", strerror(errno));
        slots_free(s);
        return NULL;
    }
    s->base = p;
    /* Every page backed now, not at the first operation. */
    memset(s->base, 0, s->size);
    s->hdr = (hdr_t *)s->base;
    memcpy(s->hdr->nonce, nonce, 16);
    s->hdr->n = (uint32_t)n;
    s->hdr->slot_bytes = (uint32_t)slot_bytes;
    atomic_thread_fence(memory_order_release);
    s->hdr->magic = SLOTS_MAGIC;
    *fd = s->fd;
    return s;
}

coll_slots_t *coll_slots_attach(int n, int rank, pid_t pid0, int fd0, const uint8_t nonce[16],
                                char *why, size_t whylen)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)pid0, fd0);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        snprintf(why, whylen, "cannot open rank 0's slots (%s): %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    size_t most = segment_bytes(n, COLL_SLOTS_MAX_BYTES);
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < (off_t)segment_bytes(n, 256) ||
        (uint64_t)st.st_size > most) {
        snprintf(why, whylen, "%s is not rank 0's slots (size %lld)", path, (long long)st.st_size);
        close(fd);
        return NULL;
    }
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || (seals & SLOTS_SEALS) != SLOTS_SEALS) {
        snprintf(why, whylen, "%s is not sealed at its size (seals %#x): not rank 0's slots", path,
                 seals < 0 ? 0 : seals);
        close(fd);
        return NULL;
    }
    coll_slots_t *s = slots_new(n, rank);
    if (!s) {
        close(fd);
        snprintf(why, whylen, "out of memory");
        return NULL;
    }
    s->size = (size_t)st.st_size;
    void *p = mmap(NULL, s->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(why, whylen, "cannot map rank 0's slots: %s", strerror(errno));
        slots_free(s);
        return NULL;
    }
    s->base = p;
    s->hdr = (hdr_t *)s->base;
    size_t slot_bytes = s->hdr->slot_bytes;
    if (s->hdr->magic != SLOTS_MAGIC || memcmp(s->hdr->nonce, nonce, 16) != 0 ||
        s->hdr->n != (uint32_t)n || slot_bytes % 64 || slot_bytes > COLL_SLOTS_MAX_BYTES ||
        segment_bytes(n, slot_bytes) != s->size) {
        snprintf(why, whylen, "%s is not rank 0's slots for %d ranks", path, n);
        slots_free(s);
        return NULL;
    }
    s->slot_bytes = slot_bytes;
    s->block = block_bytes(slot_bytes);
    return s;
}

void coll_slots_setup_done(coll_slots_t *s)
{
    if (s && s->fd >= 0) {
        close(s->fd);
        s->fd = -1;
    }
}

/* Tells the sleepers on c that a word of c changed (stored, sequentially consistent, before
 * this). A sleeper counts itself in waiters before it reads the bell and then the word, so
 * either it sees the new word, or this sees it waiting and rings: no bell (a locked add on a
 * line the peers spin on) while nobody sleeps. */
static void ring_bell(ctl_t *c)
{
    if (atomic_load(&c->waiters)) {
        atomic_fetch_add(&c->bell, 1);
        futex_wake(&c->bell);
    }
}

void coll_slots_close(coll_slots_t *s)
{
    if (!s)
        return;
    ctl_t *me = ctl(s, s->rank);
    atomic_store(&me->closed, 1);
    ring_bell(me);
}

void coll_slots_destroy(coll_slots_t *s)
{
    if (!s)
        return;
    coll_slots_close(s);
    slots_free(s);
}

size_t coll_slots_bytes(const coll_slots_t *s)
{
    return s->slot_bytes;
}

/* The data bytes rank q puts in its slot for op. */
static size_t post_bytes(const coll_op_t *op, int n, int q)
{
    size_t es = pshard_dtype_size(op->args.dtype);
    size_t total = op->displs[n] * es;
    switch (op->args.op) {
    case PSHARD_COLL_ALL_GATHER:
        return op->counts[q] * es;
    case PSHARD_COLL_REDUCE_SCATTER:
    case PSHARD_COLL_ALL_REDUCE:
        return total;
    case PSHARD_COLL_BROADCAST:
        return q == op->args.root ? total : 0;
    default:
        return 0;
    }
}

bool coll_slots_takes(const coll_slots_t *s, const coll_op_t *op)
{
    if (!s || op->check_only)
        return false;
    switch (op->args.op) {
    case PSHARD_COLL_ALL_GATHER:
    case PSHARD_COLL_REDUCE_SCATTER:
    case PSHARD_COLL_ALL_REDUCE:
    case PSHARD_COLL_BROADCAST:
    case PSHARD_COLL_BARRIER:
        return true;
    default:
        return false;
    }
}

bool coll_slots_fits(const coll_slots_t *s, const coll_op_t *op)
{
    if (!s || op->check_only)
        return false;
    switch (op->args.op) {
    case PSHARD_COLL_ALL_GATHER:
        for (int q = 0; q < s->n; q++)
            if (post_bytes(op, s->n, q) > s->slot_bytes)
                return false;
        return true;
    case PSHARD_COLL_REDUCE_SCATTER:
    case PSHARD_COLL_ALL_REDUCE:
    case PSHARD_COLL_BROADCAST:
        return op->displs[s->n] * pshard_dtype_size(op->args.dtype) <= s->slot_bytes;
    case PSHARD_COLL_BARRIER:
        return true;
    default:
        return false;
    }
}

static uint32_t stage_word(uint64_t seq, int k)
{
    return (uint32_t)(4 * (seq + 1) + (uint64_t)k);
}

/* Posts op: its mail (the data of a tiny operation in it, when inl), after the descriptor and
 * data the caller put in the slot. */
static void post(coll_slots_t *s, const coll_op_t *op, const coll_buf_t *src, size_t len, bool inl)
{
    const coll_desc_t *d = &op->desc;
    mail_t *m = mail(s, s->rank, d->seq);
    m->len = inl ? (uint32_t)len : MAIL_IN_SLOT;
    m->seq = d->seq;
    m->tag = d->tag;
    m->total_count = d->total_count;
    m->counts_hash = d->counts_hash;
    m->root = d->root;
    m->op = d->op;
    m->dtype = d->dtype;
    m->reduce = d->reduce;
    if (inl && len) {
        coll_buf_t to = coll_buf_flat(m->data);
        coll_buf_copy(&to, 0, (coll_buf_t *)src, 0, len);
    }
    atomic_store(&m->posted, (uint32_t)(d->seq + 1));
    ring_bell(ctl(s, s->rank));
}

/* Whether a peer's mail names the same operation as d (coll_desc_same's fields). */
static bool mail_same(const mail_t *m, const coll_desc_t *d)
{
    return m->seq == d->seq && m->op == d->op && m->dtype == d->dtype && m->reduce == d->reduce &&
           m->root == d->root && m->tag == d->tag && m->total_count == d->total_count &&
           m->counts_hash == d->counts_hash;
}

static void post_stage(coll_slots_t *s, uint64_t seq, int k)
{
    ctl_t *me = ctl(s, s->rank);
    atomic_store(&me->stage, stage_word(seq, k));
    ring_bell(me);
}

void coll_slots_abort(coll_slots_t *s, pshard_status_t status, const char *msg)
{
    hdr_t *h = s->hdr;
    uint32_t none = 0;
    if (atomic_compare_exchange_strong(&h->abort_state, &none, 1)) {
        h->abort_status = (int32_t)status;
        h->abort_origin = (uint32_t)s->rank;
        ps_strlcpy(h->abort_msg, msg ? msg : "aborted", sizeof(h->abort_msg));
        atomic_store(&h->abort_state, 2);
    }
    for (int q = 0; q < s->n; q++)
        if (atomic_load(&ctl(s, q)->waiters))
            futex_wake(&ctl(s, q)->bell);
}

bool coll_slots_aborted(coll_slots_t *s, pshard_status_t *status, char *msg, size_t msglen)
{
    hdr_t *h = s->hdr;
    uint32_t state = atomic_load_explicit(&h->abort_state, memory_order_acquire);
    if (state == 0)
        return false;
    /* Being written: the writer is a few stores away from done. */
    for (int i = 0; state == 1 && i < 1000; i++) {
        sched_yield();
        state = atomic_load_explicit(&h->abort_state, memory_order_acquire);
    }
    if (state != 2) {
        *status = PSHARD_ERR_ABORTED;
        snprintf(msg, msglen, "another rank failed the communicator");
        return true;
    }
    /* Written by another process: read like input from the wire. */
    pshard_status_t st = (pshard_status_t)h->abort_status;
    *status = st >= 0 || st < PSHARD_ERR_LOWEST ? PSHARD_ERR_ABORTED : st;
    char raw[ABORT_MSG], text[ABORT_MSG];
    memcpy(raw, h->abort_msg, sizeof(raw));
    ps_copy_printable(text, sizeof(text), raw, strnlen(raw, sizeof(raw)));
    uint32_t origin = h->abort_origin;
    if (origin == (uint32_t)s->rank)
        snprintf(msg, msglen, "%s", text);
    else if (origin < (uint32_t)s->n)
        snprintf(msg, msglen, "%s (reported by rank %u)", text, origin);
    else
        snprintf(msg, msglen,
                 "%s (an abort record naming rank %u of a %d-rank communicator: "
                 "another process wrote the slots' memory)",
                 text, origin, s->n);
    return true;
}

/* Whether the communicator failed: a failure recorded by any rank, or an abort here; the
 * error in err. */
static pshard_status_t stopped(coll_slots_t *s, pshard_comm_t *comm, char *err, size_t errlen)
{
    pshard_status_t st;
    char why[PSHARD_ERRLEN];
    if (coll_slots_aborted(s, &st, why, sizeof(why)))
        return ps_errf(err, errlen, st, "%s", why);
    if (atomic_load(&comm->aborted)) {
        st = pshard_comm_error(comm, why, sizeof(why));
        return ps_errf(err, errlen, st != PSHARD_OK ? st : PSHARD_ERR_ABORTED, "%s",
                       st != PSHARD_OK ? why : "aborted");
    }
    return PSHARD_OK;
}

/* Whether the operation must stop: the communicator failed (stopped), or the operation's
 * deadline passed; the error (as coll_slots_run's) in err. */
static pshard_status_t going(coll_slots_t *s, pshard_comm_t *comm, coll_op_t *op, char *err,
                             size_t errlen)
{
    PS_CHECK(stopped(s, comm, err, errlen));
    if (ps_now_ns() >= coll_op_deadline(op))
        return ps_errf(err, errlen, PSHARD_ERR_TIMEOUT, "%s seq %" PRIu64 " timed out on rank %d",
                       pshard_coll_op_name(op->desc.op), op->desc.seq, s->rank);
    return PSHARD_OK;
}

/* Waits until rank q's word (its posted or stage word) reaches want, spinning briefly, then
 * sleeping on q's bell. Errors as coll_slots_run's. */
static pshard_status_t wait_word(coll_slots_t *s, coll_shm_t *shm, pshard_comm_t *comm,
                                 coll_op_t *op, int q, _Atomic uint32_t *word, uint32_t want,
                                 char *err, size_t errlen)
{
    ctl_t *c = ctl(s, q);
    int64_t start = 0, spent = 0;
    for (uint32_t i = 1;; i++) {
        if (reached(atomic_load_explicit(word, memory_order_acquire), want))
            return PSHARD_OK;
        if ((i & 63) == 0) {
            int64_t now = ps_now_ns();
            if (!start)
                coll_op_deadline(op); /* the operation's clock starts with its first wait */
            start = start ? start : now;
            spent = now - start;
            if (spent >= s->spin_ns + YIELD_NS)
                break;
        }
        if (spent < s->spin_ns)
            cpu_relax();
        else
            sched_yield();
    }
    const char *what = pshard_coll_op_name((pshard_coll_op_t)op->desc.op);
    coll_record_waiting(comm, op, q);
    for (;;) {
        atomic_fetch_add(&c->waiters, 1);
        uint32_t bell = atomic_load(&c->bell);
        int64_t left = coll_op_deadline(op) - ps_now_ns();
        if (!reached(atomic_load(word), want) && left > 0)
            futex_wait(&c->bell, bell, left < SLEEP_SLICE_NS ? left : SLEEP_SLICE_NS);
        atomic_fetch_sub(&c->waiters, 1);
        if (reached(atomic_load_explicit(word, memory_order_acquire), want)) {
            coll_record_waiting(comm, op, -1);
            return PSHARD_OK;
        }
        PS_CHECK(stopped(s, comm, err, errlen));
        if (atomic_load(&c->closed))
            return ps_errf(err, errlen, PSHARD_ERR_PEER_LOST,
                           "%s seq %" PRIu64 " on rank %d: lost rank %d (it closed the "
                           "communicator)",
                           what, op->desc.seq, s->rank, q);
        if (!coll_shm_alive(shm, q))
            return ps_errf(err, errlen, PSHARD_ERR_PEER_LOST,
                           "%s seq %" PRIu64 " on rank %d: lost rank %d (its process, pid %d, "
                           "exited)",
                           what, op->desc.seq, s->rank, q, coll_shm_pid(shm, q));
        if (ps_now_ns() >= coll_op_deadline(op))
            return ps_errf(err, errlen, PSHARD_ERR_TIMEOUT,
                           "%s seq %" PRIu64 " timed out on rank %d waiting on rank %d: it has "
                           "%s (same-host transport)",
                           what, op->desc.seq, s->rank, q,
                           word == &c->stage ? "not finished reading the others' buffers"
                                             : "not started this operation");
    }
}

/* Waits until every other rank finished phase k of op (read what it needed of this rank's
 * buffers). */
static pshard_status_t wait_stage(coll_slots_t *s, coll_shm_t *shm, pshard_comm_t *comm,
                                  coll_op_t *op, int k, char *err, size_t errlen)
{
    for (int d = 1; d < s->n; d++) {
        int q = (s->rank + d) % s->n;
        PS_CHECK(wait_word(s, shm, comm, op, q, &ctl(s, q)->stage, stage_word(op->desc.seq, k), err,
                           errlen));
    }
    return PSHARD_OK;
}

/* out[out_off...] = scale * the reduction over every rank of elements [first, first + nel) of
 * their slots, summed in rank order so that every rank gets the same bits. */
static uint8_t *small_data(const coll_slots_t *s, int q, uint64_t seq, bool inl)
{
    return inl ? mail(s, q, seq)->data : sdata(s, q, seq);
}

static void reduce_slots(coll_slots_t *s, coll_op_t *op, bool inl, size_t first, size_t nel,
                         coll_buf_t *out, uint64_t out_off)
{
    pshard_dtype_t dt = op->args.dtype;
    size_t es = pshard_dtype_size(dt);
    double scale = op->args.reduce == PSHARD_REDUCE_AVG ? 1.0 / (double)s->n : 1.0;
    uint64_t seq = op->desc.seq;
    for (size_t done = 0; done < nel;) {
        size_t m = nel - done < ACC_ELEMS ? nel - done : ACC_ELEMS;
        size_t at = (first + done) * es;
        coll_reduce_load(s->acc, small_data(s, 0, seq, inl) + at, dt, m);
        for (int q = 1; q < s->n; q++)
            coll_reduce_accumulate(s->acc, small_data(s, q, seq, inl) + at, dt,
                                   (int)op->args.reduce, m);
        coll_buf_store(out, out_off + done * es, dt, s->acc, m, scale);
        done += m;
    }
}

void coll_publish_buffers(coll_op_t *op, int rank, int n)
{
    const pshard_coll_args_t *a = &op->args;
    size_t es = pshard_dtype_size(a->dtype);
    coll_desc_t *d = &op->desc;
    d->send_addr = op->sbuf.npieces ? (uint64_t)(uintptr_t)op->sbuf.pieces : op->sbuf.base;
    d->send_pieces = (uint32_t)op->sbuf.npieces;
    d->recv_addr = op->rbuf.npieces ? (uint64_t)(uintptr_t)op->rbuf.pieces : op->rbuf.base;
    d->recv_pieces = (uint32_t)op->rbuf.npieces;
    bool whole = !op->sbuf.npieces && !op->rbuf.npieces;
    uint8_t *recv = a->recv;
    if (a->op == PSHARD_COLL_ALL_GATHER) {
        size_t at = op->displs[rank] * es, bytes = op->counts[rank] * es;
        if (whole) {
            if (bytes && a->send != recv + at)
                memmove(recv + at, a->send, bytes);
            d->send_addr = (uint64_t)(uintptr_t)(recv + at);
        } else if (bytes) {
            coll_buf_copy(&op->rbuf, at, &op->sbuf, 0, bytes);
        }
    } else if (a->op == PSHARD_COLL_BROADCAST && rank == a->root) {
        size_t total = op->displs[n] * es;
        if (total)
            coll_buf_copy(&op->rbuf, 0, &op->sbuf, 0, total);
        if (whole)
            d->send_addr = op->rbuf.base;
    }
}

static void free_peer_bufs(coll_slots_t *s)
{
    for (int q = 0; q < s->n; q++) {
        coll_buf_free(&s->peer_sbuf[q]);
        coll_buf_free(&s->peer_rbuf[q]);
    }
}

/* A read of another rank's memory failed: when some rank recorded a failure first (it gave up
 * on the operation and may have let its buffers go), that failure is the cause. */
static pshard_status_t read_failed(coll_slots_t *s, const coll_op_t *op, pshard_status_t rc,
                                   char *err, size_t errlen)
{
    pshard_status_t st;
    char why[PSHARD_ERRLEN];
    if (coll_slots_aborted(s, &st, why, sizeof(why))) {
        err[0] = '\0';
        return ps_errf(err, errlen, st, "%s", why);
    }
    char first[PSHARD_ERRLEN];
    ps_strlcpy(first, err, sizeof(first));
    err[0] = '\0';
    return ps_errf(err, errlen, rc, "%s seq %" PRIu64 " on rank %d: %s",
                   pshard_coll_op_name(op->args.op), op->desc.seq, s->rank, first);
}

/* The reading of an operation too big for the slots: each rank reads what it needs of the
 * others' buffers (process_vm_readv), in pieces between which it checks for failures, says
 * when it finished each phase, and completes once every rank finished reading its buffers. */
static pshard_status_t read_peers(coll_slots_t *s, coll_shm_t *shm, pshard_comm_t *comm,
                                  coll_op_t *op, char *err, size_t errlen)
{
    const pshard_coll_args_t *a = &op->args;
    int n = s->n, me = s->rank;
    size_t es = pshard_dtype_size(a->dtype);
    uint64_t total = op->displs[n] * es;
    double scale = a->reduce == PSHARD_REDUCE_AVG ? 1.0 / (double)n : 1.0;
    pshard_status_t rc;
    coll_record_waiting(comm, op, -1);
    for (int q = 0; q < n; q++) {
        const coll_desc_t *d = &s->peer_desc[q];
        bool reads_send = a->op != PSHARD_COLL_BROADCAST || q == a->root;
        uint64_t sbytes = a->op == PSHARD_COLL_ALL_GATHER ? op->counts[q] * es : total;
        if (q == me)
            continue;
        if (reads_send && (rc = coll_shm_fetch_buf(shm, q, d->send_addr, d->send_pieces, sbytes,
                                                   &s->peer_sbuf[q], err, errlen)) != PSHARD_OK)
            return read_failed(s, op, rc, err, errlen);
        if (a->op == PSHARD_COLL_ALL_REDUCE &&
            (rc = coll_shm_fetch_buf(shm, q, d->recv_addr, d->recv_pieces, total, &s->peer_rbuf[q],
                                     err, errlen)) != PSHARD_OK)
            return read_failed(s, op, rc, err, errlen);
    }
    if (a->op == PSHARD_COLL_REDUCE_SCATTER || a->op == PSHARD_COLL_ALL_REDUCE) {
        /* This rank's block: its own part plus every other rank's, slice by slice. */
        size_t count = op->counts[me];
        uint64_t out0 = a->op == PSHARD_COLL_ALL_REDUCE ? op->displs[me] * es : 0;
        for (size_t done = 0; done < count;) {
            PS_CHECK(going(s, comm, op, err, errlen));
            size_t nel = count - done < COLL_SHM_REDUCE_MAX ? count - done : COLL_SHM_REDUCE_MAX;
            uint64_t first = (op->displs[me] + done) * es;
            rc = coll_shm_reduce(shm, s->peer_sbuf, first, &op->sbuf, first, &op->rbuf,
                                 out0 + done * es, a->dtype, (int)a->reduce, nel, scale, err,
                                 errlen);
            if (rc != PSHARD_OK)
                return read_failed(s, op, rc, err, errlen);
            done += nel;
        }
    }
    if (a->op == PSHARD_COLL_ALL_REDUCE) {
        /* Every rank's reduced block, once it is there. */
        post_stage(s, op->desc.seq, 1);
        PS_CHECK(wait_stage(s, shm, comm, op, 1, err, errlen));
    }
    if (a->op == PSHARD_COLL_BROADCAST && me != a->root) {
        for (uint64_t off = 0; off < total;) {
            PS_CHECK(going(s, comm, op, err, errlen));
            size_t len = total - off < COLL_SHM_PIECE ? (size_t)(total - off) : COLL_SHM_PIECE;
            rc = coll_shm_read_buf(shm, a->root, &op->rbuf, off, &s->peer_sbuf[a->root], off, len,
                                   err, errlen);
            if (rc != PSHARD_OK)
                return read_failed(s, op, rc, err, errlen);
            off += len;
        }
    }
    if (a->op == PSHARD_COLL_ALL_GATHER || a->op == PSHARD_COLL_ALL_REDUCE) {
        /* Every other rank's block (all-gather: from where it published it; all-reduce: its
         * reduced block in its output), starting with the next rank's so that the ranks do not
         * all read the same one at once. */
        bool second = a->op == PSHARD_COLL_ALL_REDUCE;
        for (int k = 1; k < n; k++) {
            int q = (me + k) % n;
            size_t bytes = op->counts[q] * es, at = op->displs[q] * es;
            for (size_t off = 0; off < bytes;) {
                PS_CHECK(going(s, comm, op, err, errlen));
                size_t len = bytes - off < COLL_SHM_PIECE ? bytes - off : COLL_SHM_PIECE;
                rc = coll_shm_read_buf(shm, q, &op->rbuf, at + off,
                                       second ? &s->peer_rbuf[q] : &s->peer_sbuf[q],
                                       (second ? at : 0) + off, len, err, errlen);
                if (rc != PSHARD_OK)
                    return read_failed(s, op, rc, err, errlen);
                off += len;
            }
        }
    }
    /* No rank lets its buffers go before every other rank finished reading them. */
    post_stage(s, op->desc.seq, 2);
    return wait_stage(s, shm, comm, op, 2, err, errlen);
}

pshard_status_t coll_slots_run(coll_slots_t *s, coll_shm_t *shm, pshard_comm_t *comm, coll_op_t *op,
                               char *err, size_t errlen)
{
    int n = s->n, me = s->rank;
    uint64_t seq = op->desc.seq;
    pshard_status_t st;
    char why[PSHARD_ERRLEN];
    if (coll_slots_aborted(s, &st, why, sizeof(why)))
        return ps_errf(err, errlen, st, "%s", why);
    bool small = coll_slots_fits(s, op);
    /* Tiny: every rank's data fits its mail (the same on every rank). */
    bool inl = small;
    for (int q = 0; inl && q < n; q++)
        inl = post_bytes(op, n, q) <= MAIL_DATA;
    sdesc_t *mine = sdesc(s, me, seq);
    size_t len = small ? post_bytes(op, n, me) : 0;
    if (!small)
        coll_publish_buffers(op, me, n);
    /* The whole descriptor goes into the slot too, though a peer reads it only for the
     * addresses of a big operation or to name a desync. */
    memcpy(&mine->desc, &op->desc, DESC_BYTES);
    mine->len = (uint32_t)len;
    if (len && !inl) {
        coll_buf_t slot = coll_buf_flat(sdata(s, me, seq));
        coll_buf_copy(&slot, 0, &op->sbuf, 0, len);
    }
    post(s, op, &op->sbuf, len, inl);
    int diverted_by = -1; /* a rank whose divertible descriptor differs from this one's */
    for (int k = 1; k < n; k++) {
        int q = (me + k) % n;
        mail_t *m = mail(s, q, seq);
        PS_CHECK(wait_word(s, shm, comm, op, q, &m->posted, (uint32_t)(seq + 1), err, errlen));
        bool same = mail_same(m, &op->desc);
        if (same && inl && m->len == post_bytes(op, n, q))
            continue;
        sdesc_t theirs;
        memcpy(&theirs, sdesc(s, q, seq), offsetof(sdesc_t, desc) + DESC_BYTES);
        theirs.desc.inline_len = 0;
        if (!same || !coll_desc_same(&theirs.desc, &op->desc)) {
            if (op->desc.divert && theirs.desc.divert) {
                /* Diverted, unless another rank's differs and is not divertible: every rank
                 * reads every descriptor first, so all of them decide alike (none of them has
                 * all the others equal to its own), and none goes on before all posted. */
                if (diverted_by < 0)
                    diverted_by = q;
                continue;
            }
            char a[256], b[256];
            coll_desc_format(&theirs.desc, a, sizeof(a));
            coll_desc_format(&op->desc, b, sizeof(b));
            return ps_errf(err, errlen, PSHARD_ERR_DESYNC,
                           "desync: rank %d ran %s but rank %d ran %s", q, a, me, b);
        }
        if (theirs.len != (small ? post_bytes(op, n, q) : 0) ||
            m->len != (inl ? theirs.len : MAIL_IN_SLOT))
            return ps_errf(err, errlen, PSHARD_ERR_DESYNC,
                           "%s seq %" PRIu64 ": rank %d put %u bytes in its slot, not %zu",
                           pshard_coll_op_name(op->args.op), seq, q, theirs.len,
                           small ? post_bytes(op, n, q) : 0);
        s->peer_desc[q] = theirs.desc;
    }
    if (diverted_by >= 0)
        return ps_errf(err, errlen, PSHARD_ERR_DIVERTED,
                       "%s seq %" PRIu64 " diverted: rank %d ran another divertible operation",
                       pshard_coll_op_name(op->args.op), seq, diverted_by);
    if (!small) {
        st = read_peers(s, shm, comm, op, err, errlen);
        free_peer_bufs(s);
        return st;
    }
    size_t es = pshard_dtype_size(op->args.dtype);
    switch (op->args.op) {
    case PSHARD_COLL_ALL_GATHER:
        for (int q = 0; q < n; q++) {
            coll_buf_t from = coll_buf_flat(small_data(s, q, seq, inl));
            if (op->counts[q])
                coll_buf_copy(&op->rbuf, op->displs[q] * es, &from, 0, op->counts[q] * es);
        }
        break;
    case PSHARD_COLL_BROADCAST:
        if (op->displs[n]) {
            coll_buf_t from = coll_buf_flat(small_data(s, op->args.root, seq, inl));
            coll_buf_copy(&op->rbuf, 0, &from, 0, op->displs[n] * es);
        }
        break;
    case PSHARD_COLL_ALL_REDUCE:
        reduce_slots(s, op, inl, 0, op->displs[n], &op->rbuf, 0);
        break;
    case PSHARD_COLL_REDUCE_SCATTER:
        reduce_slots(s, op, inl, op->displs[me], op->counts[me], &op->rbuf, 0);
        break;
    default:
        break;
    }
    return PSHARD_OK;
}
