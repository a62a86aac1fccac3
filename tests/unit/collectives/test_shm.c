/* Unit tests for the same-host transport's pieces that need no ring (coll_shm.h, coll_buf.h):
 * PSHARD_TRANSPORT's values; the set-up test that a peer's memory can be read (a forked child
 * as the peer: yes for the real one; no for another boot, another pid namespace, a secret that
 * does not read back, a process that is gone); reads of the child's memory, of memory it does
 * not have, and after it exited; reductions over a peer's buffer given in pieces; and buffers
 * in pieces addressed by logical offset; the slots' segment (coll_slots.h): what opening it
 * refuses (another segment, another size of ring, a file that is not one, one not sealed, a
 * closed fd), that nobody can resize it, what PSHARD_SHM_SLOT_BYTES turns off or refuses, and
 * the failure record every rank reads (a forged one too). */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "coll_buf.h"
#include "coll_shm.h"
#include "coll_slots.h"
#include "ps_test.h"

static void test_transport_env(void)
{
    coll_transport_t t;
    char err[PSHARD_ERRLEN] = "";
    unsetenv("PSHARD_TRANSPORT");
    CU_ASSERT_EQUAL(coll_transport_parse(NULL, &t, err, sizeof err), PSHARD_OK);
    CU_ASSERT_EQUAL(t, COLL_TRANSPORT_AUTO);
    setenv("PSHARD_TRANSPORT", "tcp", 1);
    CU_ASSERT_EQUAL(coll_transport_parse(NULL, &t, err, sizeof err), PSHARD_OK);
    CU_ASSERT_EQUAL(t, COLL_TRANSPORT_TCP);
    setenv("PSHARD_TRANSPORT", "shm", 1);
    CU_ASSERT_EQUAL(coll_transport_parse(NULL, &t, err, sizeof err), PSHARD_OK);
    CU_ASSERT_EQUAL(t, COLL_TRANSPORT_SHM);
    setenv("PSHARD_TRANSPORT", "infiniband", 1);
    CU_ASSERT_EQUAL(coll_transport_parse(NULL, &t, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "'infiniband'"));
    unsetenv("PSHARD_TRANSPORT");
    /* A value given (pshard-server --transport) comes before the environment. */
    setenv("PSHARD_TRANSPORT", "tcp", 1);
    CU_ASSERT_EQUAL(coll_transport_parse("shm", &t, err, sizeof err), PSHARD_OK);
    CU_ASSERT_EQUAL(t, COLL_TRANSPORT_SHM);
    unsetenv("PSHARD_TRANSPORT");
}

/* A forked child holding a secret and a buffer of known values; it waits on a pipe. */
typedef struct {
    pid_t pid;
    int wfd;
    coll_peer_t rec;
    uint64_t buf_addr; /* 1024 floats i * 0.5, at the same address in the child */
} child_t;

static uint8_t g_probe[16];
static float g_values[1024];

static void start_child(child_t *c)
{
    for (int i = 0; i < 16; i++)
        g_probe[i] = (uint8_t)(0xa0 + i);
    for (int i = 0; i < 1024; i++)
        g_values[i] = (float)i * 0.5f;
    int p[2];
    CU_ASSERT_FATAL(pipe(p) == 0);
    c->pid = fork();
    if (c->pid == 0) {
        close(p[1]);
        char x;
        (void)!read(p[0], &x, 1); /* until the parent closes its end */
        _exit(0);
    }
    close(p[0]);
    c->wfd = p[1];
    /* After fork the child has the same secret at the same address; the record is the
     * child's as it would publish it. */
    coll_shm_self(1, g_probe, &c->rec);
    c->rec.pid = (uint32_t)c->pid;
    c->buf_addr = (uint64_t)(uintptr_t)g_values;
    /* The parent's own copy changes now: reads must come from the child. */
    for (int i = 0; i < 1024; i++)
        g_values[i] = -1.0f;
    g_probe[0] ^= 0xff;
}

static void stop_child(child_t *c)
{
    close(c->wfd);
    waitpid(c->pid, NULL, 0);
}

static void test_can_read(void)
{
    child_t c;
    start_child(&c);
    uint8_t mine_probe[16] = {1};
    coll_peer_t me;
    coll_shm_self(0, mine_probe, &me);
    char why[PSHARD_ERRLEN] = "";
    CU_ASSERT_TRUE(coll_shm_can_read(&me, &c.rec, why, sizeof why));

    coll_peer_t other = c.rec;
    other.boot_id[3] ^= 1;
    CU_ASSERT_FALSE(coll_shm_can_read(&me, &other, why, sizeof why));
    CU_ASSERT_PTR_NOT_NULL(strstr(why, "another host"));
    other = c.rec;
    other.pidns += 1;
    CU_ASSERT_FALSE(coll_shm_can_read(&me, &other, why, sizeof why));
    CU_ASSERT_PTR_NOT_NULL(strstr(why, "pid namespace"));
    other = c.rec;
    other.probe[5] ^= 1;
    CU_ASSERT_FALSE(coll_shm_can_read(&me, &other, why, sizeof why));
    CU_ASSERT_PTR_NOT_NULL(strstr(why, "secret"));
    stop_child(&c);
    CU_ASSERT_FALSE(coll_shm_can_read(&me, &c.rec, why, sizeof why));
    CU_ASSERT_PTR_NOT_NULL(strstr(why, "cannot read"));
}

/* A peer of rank 1 holding the 1024 floats i * 0.5 in g_values and a table of them as two
 * pieces, [512, 1024) then [0, 512), in g_table; the parent's copies change after the fork. */
static coll_piece_t g_table[2];

static coll_shm_t *peer_with_values(child_t *c)
{
    for (int i = 0; i < 1024; i++)
        g_values[i] = (float)i * 0.5f;
    g_table[0] = (coll_piece_t){(uint64_t)(uintptr_t)(g_values + 512), 512 * 4};
    g_table[1] = (coll_piece_t){(uint64_t)(uintptr_t)g_values, 512 * 4};
    start_child(c); /* forks, then sets the parent's g_values to -1 */
    g_table[0] = g_table[1] = (coll_piece_t){0, 0};
    uint8_t mine_probe[16] = {2};
    coll_peer_t recs[2];
    coll_shm_self(0, mine_probe, &recs[0]);
    recs[1] = c->rec;
    return coll_shm_create(2, 0, recs);
}

static void test_read_and_reduce(void)
{
    child_t c;
    coll_shm_t *s = peer_with_values(&c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(s);
    char err[PSHARD_ERRLEN] = "";

    float got[1024];
    CU_ASSERT_EQUAL(coll_shm_read(s, 1, got, c.buf_addr, sizeof got, err, sizeof err), PSHARD_OK);
    int same = 1;
    for (int i = 0; i < 1024; i++)
        same &= got[i] == (float)i * 0.5f;
    CU_ASSERT_TRUE(same);

    /* Memory the peer does not have: named, not a crash. */
    err[0] = '\0';
    CU_ASSERT_EQUAL(coll_shm_read(s, 1, got, 16, 64, err, sizeof err), PSHARD_ERR_DESYNC);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "rank 1"));

    /* The peer's buffer as its table of pieces; a table that does not hold the operation's
     * bytes is refused. */
    coll_buf_t bufs[2] = {{0}, {0}}, wrong;
    uint64_t table = (uint64_t)(uintptr_t)g_table;
    CU_ASSERT_EQUAL(coll_shm_fetch_buf(s, 1, table, 2, 4096, &bufs[1], err, sizeof err), PSHARD_OK);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coll_shm_fetch_buf(s, 1, table, 2, 4000, &wrong, err, sizeof err),
                    PSHARD_ERR_DESYNC);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "pieces"));

    /* out[k] = (own[k] + the peer's logical[k]) / 2 for 300 elements from logical 400 on,
     * across the peer's piece boundary at 512. */
    float own[1024], out[300];
    for (int i = 0; i < 1024; i++)
        own[i] = 100.0f;
    coll_buf_t ownb = coll_buf_flat(own), outb = coll_buf_flat(out);
    CU_ASSERT_EQUAL(coll_shm_reduce(s, bufs, 400 * 4, &ownb, 400 * 4, &outb, 0, PSHARD_FP32,
                                    PSHARD_REDUCE_SUM, 300, 0.5f, err, sizeof err),
                    PSHARD_OK);
    same = 1;
    for (int k = 0; k < 300; k++) {
        int logical = 400 + k;
        int index = logical < 512 ? logical + 512 : logical - 512;
        same &= out[k] == (100.0f + (float)index * 0.5f) * 0.5f;
    }
    CU_ASSERT_TRUE(same);
    coll_buf_free(&bufs[1]);

    /* Once the peer exited, a read names it lost. */
    stop_child(&c);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coll_shm_read(s, 1, got, c.buf_addr, 64, err, sizeof err),
                    PSHARD_ERR_PEER_LOST);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "lost rank 1"));
    coll_shm_destroy(s);
}

static void test_buf_pieces(void)
{
    float a[3] = {1, 2, 3}, b[1] = {4}, c[4] = {5, 6, 7, 8};
    pshard_coll_seg_t segs[] = {{a, 3}, {NULL, 0}, {b, 1}, {c, 4}};
    coll_buf_t vb;
    char err[PSHARD_ERRLEN] = "";
    CU_ASSERT_EQUAL_FATAL(coll_buf_from_segs(&vb, segs, 4, 4, 8, "recv", err, sizeof err),
                          PSHARD_OK);
    uint64_t contig;
    CU_ASSERT_EQUAL(coll_buf_at(&vb, 3 * 4, &contig), (uint64_t)(uintptr_t)b);
    CU_ASSERT_EQUAL(contig, 4);
    CU_ASSERT_EQUAL(coll_buf_at(&vb, 5 * 4, &contig), (uint64_t)(uintptr_t)(c + 1));
    CU_ASSERT_EQUAL(contig, 12);
    CU_ASSERT_EQUAL(coll_buf_at(&vb, 1 * 4, &contig), (uint64_t)(uintptr_t)(a + 1)); /* back */
    float flat[8];
    coll_buf_t fb = coll_buf_flat(flat);
    coll_buf_copy(&fb, 0, &vb, 0, sizeof flat);
    int ok = 1;
    for (int i = 0; i < 8; i++)
        ok &= flat[i] == (float)(i + 1);
    CU_ASSERT_TRUE(ok);
    float acc[8];
    coll_buf_load(acc, &vb, 2 * 4, PSHARD_FP32, 5);
    coll_buf_accumulate(acc, &vb, 2 * 4, PSHARD_FP32, PSHARD_REDUCE_SUM, 5);
    coll_buf_store(&vb, 2 * 4, PSHARD_FP32, acc, 5, 1.0f);
    CU_ASSERT(a[2] == 6 && b[0] == 8 && c[0] == 10 && c[2] == 14 && c[3] == 8);
    coll_buf_free(&vb);

    /* Pieces that do not add up, and a NULL piece holding elements, are named. */
    err[0] = '\0';
    CU_ASSERT_EQUAL(coll_buf_from_segs(&vb, segs, 4, 4, 9, "recv", err, sizeof err),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "recv pieces hold 8 elements"));
    pshard_coll_seg_t bad[] = {{a, 3}, {NULL, 2}};
    err[0] = '\0';
    CU_ASSERT_EQUAL(coll_buf_from_segs(&vb, bad, 2, 4, 5, "send", err, sizeof err),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "send piece 1 is NULL"));
    err[0] = '\0';
    CU_ASSERT_EQUAL(coll_buf_from_segs(&vb, segs, 0, 4, 0, "send", err, sizeof err),
                    PSHARD_ERR_INVALID_ARGUMENT);
}

static void test_slots_segment(void)
{
    uint8_t nonce[16], other[16];
    for (int i = 0; i < 16; i++) {
        nonce[i] = (uint8_t)(i * 7 + 1);
        other[i] = (uint8_t)(i * 7 + 2);
    }
    char why[PSHARD_ERRLEN] = "";
    int fd = -1;
    unsetenv("PSHARD_SHM_SLOT_BYTES");
    coll_slots_t *made = coll_slots_create(3, nonce, &fd, why, sizeof why);
    CU_ASSERT_PTR_NOT_NULL_FATAL(made);
    CU_ASSERT(fd >= 0);
    CU_ASSERT_EQUAL(coll_slots_bytes(made), COLL_SLOTS_DEFAULT_BYTES);

    /* The right segment opens (here through this process's own /proc entry). */
    coll_slots_t *peer = coll_slots_attach(3, 1, getpid(), fd, nonce, why, sizeof why);
    CU_ASSERT_PTR_NOT_NULL(peer);
    /* Another segment's secret, another size of ring, a file that is no segment: refused,
     * saying which file. */
    why[0] = '\0';
    CU_ASSERT_PTR_NULL(coll_slots_attach(3, 2, getpid(), fd, other, why, sizeof why));
    CU_ASSERT_PTR_NOT_NULL(strstr(why, "is not rank 0's slots"));
    why[0] = '\0';
    CU_ASSERT_PTR_NULL(coll_slots_attach(4, 2, getpid(), fd, nonce, why, sizeof why));
    CU_ASSERT_PTR_NOT_NULL(strstr(why, "is not rank 0's slots"));
    int null_fd = open("/dev/null", O_RDWR);
    why[0] = '\0';
    CU_ASSERT_PTR_NULL(coll_slots_attach(3, 2, getpid(), null_fd, nonce, why, sizeof why));
    CU_ASSERT_PTR_NOT_NULL(strstr(why, "is not rank 0's slots"));
    close(null_fd);
    /* A FIFO is no segment either (and opening it read-write does not block). */
    char fifo[] = "/tmp/pshard-slots-fifo-XXXXXX";
    int tmp = mkstemp(fifo);
    CU_ASSERT_FATAL(tmp >= 0);
    close(tmp);
    unlink(fifo);
    CU_ASSERT_FATAL(mkfifo(fifo, 0600) == 0);
    int fifo_fd = open(fifo, O_RDWR);
    why[0] = '\0';
    CU_ASSERT_PTR_NULL(coll_slots_attach(3, 2, getpid(), fifo_fd, nonce, why, sizeof why));
    CU_ASSERT_PTR_NOT_NULL(strstr(why, "is not rank 0's slots"));
    close(fifo_fd);
    unlink(fifo);

    /* Sealed at its size: another process that opens it can neither shrink it under the
     * ranks' mappings (a SIGBUS in each) nor grow it; the mappings stay good. */
    struct stat st0;
    CU_ASSERT_FATAL(fstat(fd, &st0) == 0);
    CU_ASSERT_EQUAL(ftruncate(fd, 4096), -1);
    CU_ASSERT_EQUAL(errno, EPERM);
    CU_ASSERT_EQUAL(ftruncate(fd, st0.st_size * 2), -1);
    pshard_status_t st = PSHARD_OK;
    char msg[PSHARD_ERRLEN] = "";
    CU_ASSERT_FALSE(coll_slots_aborted(peer, &st, msg, sizeof msg));
    /* A copy of the segment that is not sealed is refused: someone could shrink it. */
    int copy = memfd_create("not-sealed", MFD_CLOEXEC);
    CU_ASSERT_FATAL(copy >= 0 && ftruncate(copy, st0.st_size) == 0);
    void *src = mmap(NULL, (size_t)st0.st_size, PROT_READ, MAP_SHARED, fd, 0);
    CU_ASSERT_FATAL(src != MAP_FAILED);
    CU_ASSERT_EQUAL(pwrite(copy, src, (size_t)st0.st_size, 0), st0.st_size);
    munmap(src, (size_t)st0.st_size);
    why[0] = '\0';
    CU_ASSERT_PTR_NULL(coll_slots_attach(3, 2, getpid(), copy, nonce, why, sizeof why));
    CU_ASSERT_PTR_NOT_NULL(strstr(why, "is not sealed"));

    /* An abort record forged by another process with write access (its layout: state at 32,
     * status at 36, origin at 40, message at 44): read like input from the wire, the control
     * bytes replaced and a rank the ring does not have called so. */
    coll_slots_t *forged = coll_slots_create(2, nonce, &fd, why, sizeof why);
    CU_ASSERT_PTR_NOT_NULL_FATAL(forged);
    uint8_t *h = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CU_ASSERT_FATAL(h != MAP_FAILED);
    const char evil[] = "rank 1 failed\x1b[2J\r\nERROR: everything is fine";
    memcpy(h + 44, evil, sizeof evil);
    uint32_t origin = 7, state = 2;
    int32_t status = (int32_t)PSHARD_ERR_PEER_LOST;
    memcpy(h + 40, &origin, 4);
    memcpy(h + 36, &status, 4);
    memcpy(h + 32, &state, 4);
    CU_ASSERT_TRUE(coll_slots_aborted(forged, &st, msg, sizeof msg));
    CU_ASSERT_EQUAL(st, PSHARD_ERR_PEER_LOST);
    for (const char *c = msg; *c; c++)
        CU_ASSERT(*c >= 0x20 && *c <= 0x7e);
    CU_ASSERT_PTR_NOT_NULL(strstr(msg, "rank 1 failed?[2J??ERROR"));
    CU_ASSERT_PTR_NOT_NULL(strstr(msg, "naming rank 7 of a 2-rank communicator"));
    munmap(h, 4096);
    coll_slots_destroy(forged);
    close(copy);

    /* A failure recorded on one rank is read on the others, naming who reported it; the first
     * one stays. */
    coll_slots_abort(made, PSHARD_ERR_DESYNC, "desync: rank 0 ran this but rank 1 ran that");
    coll_slots_abort(peer, PSHARD_ERR_TIMEOUT, "a later failure");
    CU_ASSERT_TRUE(coll_slots_aborted(peer, &st, msg, sizeof msg));
    CU_ASSERT_EQUAL(st, PSHARD_ERR_DESYNC);
    CU_ASSERT_PTR_NOT_NULL(strstr(msg, "desync: rank 0 ran this"));
    CU_ASSERT_PTR_NOT_NULL(strstr(msg, "(reported by rank 0)"));
    CU_ASSERT_TRUE(coll_slots_aborted(made, &st, msg, sizeof msg));
    CU_ASSERT_PTR_NULL(strstr(msg, "reported by"));

    /* Once set-up is done rank 0's fd is closed: nobody else can open the segment. */
    coll_slots_setup_done(made);
    why[0] = '\0';
    CU_ASSERT_PTR_NULL(coll_slots_attach(3, 2, getpid(), fd, nonce, why, sizeof why));
    CU_ASSERT(why[0] != '\0');
    coll_slots_destroy(peer);
    coll_slots_destroy(made);
    coll_slots_destroy(NULL);

    /* PSHARD_SHM_SLOT_BYTES: 0 turns the slots off, a bad value is named, a small one is
     * rounded down to whole cache lines. */
    setenv("PSHARD_SHM_SLOT_BYTES", "0", 1);
    why[0] = '\0';
    CU_ASSERT_PTR_NULL(coll_slots_create(2, nonce, &fd, why, sizeof why));
    CU_ASSERT_PTR_NOT_NULL(strstr(why, "PSHARD_SHM_SLOT_BYTES=0"));
    setenv("PSHARD_SHM_SLOT_BYTES", "lots", 1);
    why[0] = '\0';
    CU_ASSERT_PTR_NULL(coll_slots_create(2, nonce, &fd, why, sizeof why));
    CU_ASSERT_PTR_NOT_NULL(strstr(why, "'lots'"));
    setenv("PSHARD_SHM_SLOT_BYTES", "1000", 1);
    made = coll_slots_create(2, nonce, &fd, why, sizeof why);
    CU_ASSERT_PTR_NOT_NULL_FATAL(made);
    CU_ASSERT_EQUAL(coll_slots_bytes(made), 960);
    coll_slots_destroy(made);
    unsetenv("PSHARD_SHM_SLOT_BYTES");
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    static const ps_test_case_t cases[] = {
        {"PSHARD_TRANSPORT values", test_transport_env},
        {"can read: the real peer yes; another boot, pid namespace, secret, or gone: no",
         test_can_read},
        {"reads, pieces tables, reductions, memory not there, a peer gone", test_read_and_reduce},
        {"buffers in pieces by logical offset", test_buf_pieces},
        {"slots: opening refuses what is not the segment; the failure record", test_slots_segment},
        {NULL, NULL},
    };
    return ps_test_main("coll_shm", cases);
}
