/* Unit tests for pshard/ckpt.h: CRC-32C (known vectors, the CRC instruction against the table
 * code on odd lengths and alignments, a throughput line), the manifest (write -> read round trip
 * of every field, atomic writes that leave no temporary file, errors naming the path, a table of
 * malformed manifests each refused with the JSON path of the problem, jansson's refusals of
 * duplicate keys, reals for integers, unknown keys, torn and oversized files), shard file
 * verification (flipped byte, truncation, missing file), element ranges read across piece
 * boundaries of several files (FSDP2 rows, FSDP1 flat split, hand-placed scattered pieces),
 * listing and pruning, and safetensors export (fp32, bf16) and reading, with a table of
 * malformed files. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ckpt_internal.h"
#include "ps_test.h"
#include "pshard/atomic_file.h"
#include "pshard/ckpt.h"
#include "pshard/dtype.h"
#include "pshard/layout.h"
#include "pshard/log.h"

/* ---- helpers ------------------------------------------------------------------------------ */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rnd64(void)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    rng_state = x;
    return x;
}

static uint64_t rnd_below(uint64_t n)
{
    return n ? rnd64() % n : 0;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    chmod(path, 0755); /* a test may have made it read-only */
    return remove(path);
}

static void rm_rf(const char *path)
{
    chmod(path, 0755);
    nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* A fresh temporary directory; the caller removes it with rm_rf. */
static void make_tmpdir(char *buf, size_t len)
{
    snprintf(buf, len, "/tmp/pshard-ckpt-test-XXXXXX");
    CU_ASSERT_PTR_NOT_NULL_FATAL(mkdtemp(buf));
}

static void write_text(const char *path, const char *text, size_t len)
{
    FILE *f = fopen(path, "wb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    CU_ASSERT_EQUAL(fwrite(text, 1, len, f), len);
    fclose(f);
}

/* Number of directory entries other than "." and "..". */
static int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    return n;
}

/* The checkpoint's value of element i of parameter p in section k: distinct everywhere,
 * exact in fp32, and mostly not exact in bf16 so that rounding is exercised. */
static float val(int k, size_t p, uint64_t i)
{
    float base = (float)((k + 1) * 1000 + (int)p * 100);
    float frac = (float)i * 0.375f + 0.0625f;
    return (i % 2) ? base + frac : -(base + frac);
}

typedef struct {
    const char *name;
    int ndim;
    int64_t shape[8];
} tparam_t;

static const tparam_t model[] = {
    {"fc0.weight", 2, {7, 5}}, {"fc0.bias", 1, {3}}, {"cube", 3, {2, 2, 2}},
    {"row", 2, {1, 4}},        {"long", 1, {10}},    {"fc1.weight", 2, {4, 6}},
};
#define NMODEL (sizeof(model) / sizeof(model[0]))

static uint64_t tnumel(const tparam_t *p)
{
    uint64_t n = 1;
    for (int d = 0; d < p->ndim; d++)
        n *= (uint64_t)p->shape[d];
    return n;
}

static void manifest_release(ps_ckpt_manifest_t *m)
{
    for (size_t i = 0; m->files && i < m->nfiles; i++)
        free(m->files[i].pieces);
    free(m->files);
    free(m->params);
    memset(m, 0, sizeof(*m));
}

/* Writes a synthetic checkpoint of `model` at ROOT/step-STEP with the real layout math: each
 * rank's file holds its pieces back to back in every section, with val() values. Fills m (free
 * with manifest_release) and step_dir. */
static void build_ckpt(const char *root, int64_t step, pshard_layout_t kind, int world,
                       int nsections, ps_ckpt_manifest_t *m, char *step_dir, size_t dirlen)
{
    size_t numel[NMODEL], rows[NMODEL];
    for (size_t p = 0; p < NMODEL; p++) {
        numel[p] = tnumel(&model[p]);
        rows[p] = (size_t)model[p].shape[0];
    }
    ps_layout_t *layout = NULL;
    char err[512] = "";
    CU_ASSERT_EQUAL_FATAL(
        ps_layout_create(kind, world, NMODEL, numel, rows, &layout, err, sizeof(err)), PSHARD_OK);
    mkdir(root, 0755);
    ps_ckpt_step_dir(root, step, step_dir, dirlen);
    CU_ASSERT_EQUAL_FATAL(mkdir(step_dir, 0755), 0);
    memset(m, 0, sizeof(*m));
    m->step = step;
    m->world_size = world;
    m->layout = kind;
    snprintf(m->optim.kind, sizeof(m->optim.kind), "%s", nsections == 3 ? "adamw" : "sgd");
    m->optim.lr = 0.001;
    m->optim.momentum = 0.9;
    m->optim.beta1 = 0.9;
    m->optim.beta2 = 0.999;
    m->optim.eps = 1e-8;
    m->nsections = nsections;
    static const char *const secs[] = {"master", "exp_avg", "exp_avg_sq"};
    for (int k = 0; k < nsections; k++)
        snprintf(m->sections[k], sizeof(m->sections[k]), "%s",
                 nsections == 2 && k == 1 ? "momentum_buffer" : secs[k]);
    m->nparams = NMODEL;
    m->params = calloc(NMODEL, sizeof(*m->params));
    m->nfiles = (size_t)world;
    m->files = calloc((size_t)world, sizeof(*m->files));
    CU_ASSERT_FATAL(m->params && m->files);
    for (size_t p = 0; p < NMODEL; p++) {
        snprintf(m->params[p].name, sizeof(m->params[p].name), "%s", model[p].name);
        m->params[p].ndim = model[p].ndim;
        memcpy(m->params[p].shape, model[p].shape, sizeof(model[p].shape));
    }
    for (int r = 0; r < world; r++) {
        ps_ckpt_file_t *f = &m->files[r];
        f->rank = r;
        ps_ckpt_shard_name(r, world, f->path, sizeof(f->path));
        f->shard_numel = ps_layout_shard_numel(layout, r);
        f->bytes = (uint64_t)nsections * f->shard_numel * 4;
        f->pieces = calloc(NMODEL, sizeof(*f->pieces));
        CU_ASSERT_FATAL(f->pieces != NULL);
        float *buf = calloc(f->shard_numel * (size_t)nsections + 1, sizeof(float));
        CU_ASSERT_FATAL(buf != NULL);
        for (size_t p = 0; p < NMODEL; p++) {
            size_t cnt = ps_layout_counts(layout, p)[r];
            if (cnt == 0)
                continue;
            size_t start = ps_layout_piece_offset(layout, p, r);
            size_t off = ps_layout_shard_offset(layout, p, r);
            f->pieces[f->npieces++] = (ps_ckpt_piece_t){(uint32_t)p, start, cnt, off};
            for (int k = 0; k < nsections; k++)
                for (size_t i = 0; i < cnt; i++)
                    buf[(size_t)k * f->shard_numel + off + i] = val(k, p, start + i);
        }
        char path[600];
        snprintf(path, sizeof(path), "%s/%s", step_dir, f->path);
        write_text(path, (const char *)buf, f->bytes);
        f->crc32c = ps_crc32c(0, buf, f->bytes);
        free(buf);
    }
    ps_layout_destroy(layout);
    err[0] = '\0';
    pshard_status_t rc = ps_ckpt_manifest_write(step_dir, m, err, sizeof(err));
    if (rc != PSHARD_OK)
        fprintf(stderr, "manifest_write: %s\n", err);
    CU_ASSERT_EQUAL_FATAL(rc, PSHARD_OK);
}

/* ---- CRC-32C ------------------------------------------------------------------------------ */

static void test_crc_vectors(void)
{
    static const struct {
        uint8_t fill; /* 0, 0xff, or 1 for 0..31, 2 for 31..0 */
        uint32_t want;
    } iscsi[] = {{0, 0x8A9136AAu}, {0xff, 0x62A8AB43u}, {1, 0x46DD794Eu}, {2, 0x113FDB5Cu}};
    CU_ASSERT_EQUAL(ps_crc32c(0, "123456789", 9), 0xE3069283u);
    CU_ASSERT_EQUAL(ckpt_crc32c_sw(0, "123456789", 9), 0xE3069283u);
    CU_ASSERT_EQUAL(ckpt_crc32c_hw(0, "123456789", 9), 0xE3069283u);
    CU_ASSERT_EQUAL(ps_crc32c(0, "", 0), 0u);
    CU_ASSERT_EQUAL(ps_crc32c(ps_crc32c(0, "1234", 4), "56789", 5), 0xE3069283u);
    CU_ASSERT_EQUAL(ckpt_crc32c_sw(ckpt_crc32c_sw(0, "12", 2), "3456789", 7), 0xE3069283u);
    /* RFC 3720 (iSCSI) B.4 test patterns, 32 bytes each. */
    for (size_t t = 0; t < sizeof(iscsi) / sizeof(iscsi[0]); t++) {
        uint8_t b[32];
        for (int i = 0; i < 32; i++)
            b[i] = iscsi[t].fill == 1   ? (uint8_t)i
                   : iscsi[t].fill == 2 ? (uint8_t)(31 - i)
                                        : iscsi[t].fill;
        CU_ASSERT_EQUAL(ps_crc32c(0, b, 32), iscsi[t].want);
        CU_ASSERT_EQUAL(ckpt_crc32c_sw(0, b, 32), iscsi[t].want);
    }
}

static void test_crc_hw_sw_agree(void)
{
    enum { N = 1 << 16 };
    uint8_t *buf = malloc(N + 64);
    CU_ASSERT_FATAL(buf != NULL);
    for (size_t i = 0; i < N + 64; i++)
        buf[i] = (uint8_t)rnd64();
    if (!ckpt_crc32c_hw_available())
        fprintf(stderr, "\n  (no CRC instruction here: the table code is checked alone)\n");
    else if (!ckpt_crc32c_fold_available())
        fprintf(stderr, "\n  (no VPCLMULQDQ here: folding is not checked)\n");
    int bad = 0;
    for (int t = 0; t < 3000; t++) {
        size_t off = rnd_below(17), len = t < 64 ? (size_t)t : rnd_below(N - 17);
        if (t % 3 == 0)
            len |= 1; /* odd lengths */
        const uint8_t *p = buf + off;
        uint32_t sw = ckpt_crc32c_sw(0, p, len), hw = ckpt_crc32c_hw(0, p, len);
        /* The instruction alone and folding (hw, where the CPU has it) from a nonzero start. */
        uint32_t seed = (uint32_t)rnd64();
        if (ckpt_crc32c_insn(seed, p, len) != ckpt_crc32c_sw(seed, p, len) ||
            ckpt_crc32c_hw(seed, p, len) != ckpt_crc32c_sw(seed, p, len))
            bad++;
        /* Piecewise in two random parts, through both paths. */
        size_t cut = rnd_below(len + 1);
        uint32_t split = ckpt_crc32c_hw(ckpt_crc32c_sw(0, p, cut), p + cut, len - cut);
        uint32_t split2 = ckpt_crc32c_sw(ckpt_crc32c_hw(0, p, cut), p + cut, len - cut);
        if (sw != hw || sw != split || sw != split2 || sw != ps_crc32c(0, p, len))
            bad++;
    }
    CU_ASSERT_EQUAL(bad, 0);
    free(buf);
}

static double seconds_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Prints MB/s of both paths over a 64 MiB buffer (best of 3); asserts only that they agree. */
static void test_crc_throughput(void)
{
    size_t n = 64u << 20;
    uint8_t *buf = malloc(n);
    CU_ASSERT_FATAL(buf != NULL);
    for (size_t i = 0; i < n; i++)
        buf[i] = (uint8_t)(i * 2654435761u >> 13);
    double best_sw = 1e9, best_insn = 1e9, best_hw = 1e9;
    uint32_t c_sw = 0, c_insn = 0, c_hw = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = seconds_now();
        c_sw = ckpt_crc32c_sw(0, buf, n);
        double t1 = seconds_now();
        c_insn = ckpt_crc32c_insn(0, buf, n);
        double t2 = seconds_now();
        c_hw = ckpt_crc32c_hw(0, buf, n);
        double t3 = seconds_now();
        best_sw = t1 - t0 < best_sw ? t1 - t0 : best_sw;
        best_insn = t2 - t1 < best_insn ? t2 - t1 : best_insn;
        best_hw = t3 - t2 < best_hw ? t3 - t2 : best_hw;
    }
    CU_ASSERT_EQUAL(c_sw, c_insn);
    CU_ASSERT_EQUAL(c_sw, c_hw);
    fprintf(stderr,
            "\n  crc32c over 64 MiB (best of 3): table %.0f MB/s, %s %.0f MB/s, %s %.0f MB/s\n",
            (double)n / best_sw / 1e6,
            ckpt_crc32c_hw_available() ? "crc32 instruction" : "(no instruction; table)",
            (double)n / best_insn / 1e6,
            ckpt_crc32c_fold_available() ? "folding" : "(no folding; as above)",
            (double)n / best_hw / 1e6);
    free(buf);
}

/* ---- names -------------------------------------------------------------------------------- */

static void test_names(void)
{
    char buf[128];
    CU_ASSERT_STRING_EQUAL(ps_ckpt_step_dir("/ck", 40, buf, sizeof(buf)), "/ck/step-00000040");
    CU_ASSERT_STRING_EQUAL(ps_ckpt_step_dir("/ck/", 123456789, buf, sizeof(buf)),
                           "/ck/step-123456789");
    CU_ASSERT_STRING_EQUAL(ps_ckpt_shard_name(3, 16, buf, sizeof(buf)), "shard-00003-of-00016.bin");
}

/* ---- manifest ----------------------------------------------------------------------------- */

static void test_manifest_roundtrip(void)
{
    char root[64], dir[128], err[512] = "";
    make_tmpdir(root, sizeof(root));
    snprintf(dir, sizeof(dir), "%s/step-00000040", root);
    CU_ASSERT_EQUAL_FATAL(mkdir(dir, 0755), 0);
    ps_ckpt_manifest_t m = {0};
    m.step = 40;
    m.aborted_steps = 3;
    m.world_size = 2;
    m.layout = PSHARD_LAYOUT_FSDP1;
    snprintf(m.optim.kind, sizeof(m.optim.kind), "adamw");
    m.optim.lr = 0.1;
    m.optim.momentum = 1.0 / 3.0;
    m.optim.dampening = 2.5e-300;
    m.optim.weight_decay = 0.01;
    m.optim.beta1 = 0.9;
    m.optim.beta2 = 0.9990000000000001;
    m.optim.eps = 1e-8;
    m.optim.max_grad_norm = 123456789.125;
    m.optim.nesterov = true;
    m.nsections = 3;
    snprintf(m.sections[0], 32, "master");
    snprintf(m.sections[1], 32, "exp_avg");
    snprintf(m.sections[2], 32, "exp_avg_sq");
    ps_ckpt_param_t params[2] = {{"w \"quoted\"\\ \xc3\xa9\t", 2, {3, 4}, 0}, {"b", 1, {5}, 39}};
    m.nparams = 2;
    m.params = params;
    /* Files given rank 1 first: the manifest is written, and read back, in rank order. */
    ps_ckpt_piece_t p0[] = {{0, 0, 9, 0}}, p1[] = {{0, 9, 3, 0}, {1, 0, 5, 3}};
    ps_ckpt_file_t files[2] = {
        {.rank = 1,
         .path = "shard-00001-of-00002.bin",
         .bytes = 96,
         .crc32c = 4294967295u,
         .shard_numel = 8,
         .npieces = 2,
         .pieces = p1},
        {.rank = 0,
         .path = "shard-00000-of-00002.bin",
         .bytes = 108,
         .crc32c = 3808858755u,
         .shard_numel = 9,
         .npieces = 1,
         .pieces = p0},
    };
    m.nfiles = 2;
    m.files = files;
    pshard_status_t rc = ps_ckpt_manifest_write(dir, &m, err, sizeof(err));
    if (rc != PSHARD_OK)
        fprintf(stderr, "write: %s\n", err);
    CU_ASSERT_EQUAL_FATAL(rc, PSHARD_OK);
    /* Only manifest.json is left: the temporary file was renamed. */
    CU_ASSERT_EQUAL(count_entries(dir), 1);
    ps_ckpt_manifest_t *r = NULL;
    rc = ps_ckpt_manifest_read(dir, &r, err, sizeof(err));
    if (rc != PSHARD_OK)
        fprintf(stderr, "read: %s\n", err);
    CU_ASSERT_EQUAL_FATAL(rc, PSHARD_OK);
    CU_ASSERT_EQUAL(r->step, 40);
    CU_ASSERT_EQUAL(r->aborted_steps, 3);
    CU_ASSERT_EQUAL(r->world_size, 2);
    CU_ASSERT_EQUAL(r->layout, PSHARD_LAYOUT_FSDP1);
    /* The index by parameter lists exactly each parameter's pieces, in file order. */
    CU_ASSERT_FATAL(r->by_param_start != NULL && r->by_param != NULL);
    for (size_t p = 0; p < r->nparams; p++) {
        size_t k = r->by_param_start[p];
        for (size_t i = 0; i < r->nfiles; i++)
            for (size_t j = 0; j < r->files[i].npieces; j++) {
                if (r->files[i].pieces[j].param != p)
                    continue;
                CU_ASSERT(k < r->by_param_start[p + 1] && r->by_param[k].file == i &&
                          r->by_param[k].piece == j);
                k++;
            }
        CU_ASSERT_EQUAL(k, r->by_param_start[p + 1]);
    }
    CU_ASSERT_STRING_EQUAL(r->optim.kind, "adamw");
    /* Exact: 17 significant digits read back to the same double. */
    CU_ASSERT(r->optim.lr == m.optim.lr);
    CU_ASSERT(r->optim.momentum == m.optim.momentum);
    CU_ASSERT(r->optim.dampening == m.optim.dampening);
    CU_ASSERT(r->optim.weight_decay == m.optim.weight_decay);
    CU_ASSERT(r->optim.beta1 == m.optim.beta1);
    CU_ASSERT(r->optim.beta2 == m.optim.beta2);
    CU_ASSERT(r->optim.eps == m.optim.eps);
    CU_ASSERT(r->optim.max_grad_norm == m.optim.max_grad_norm);
    CU_ASSERT(r->optim.nesterov);
    CU_ASSERT_EQUAL(r->nsections, 3);
    CU_ASSERT_STRING_EQUAL(r->sections[0], "master");
    CU_ASSERT_STRING_EQUAL(r->sections[1], "exp_avg");
    CU_ASSERT_STRING_EQUAL(r->sections[2], "exp_avg_sq");
    CU_ASSERT_EQUAL_FATAL(r->nparams, 2);
    CU_ASSERT_STRING_EQUAL(r->params[0].name, params[0].name);
    CU_ASSERT_EQUAL(r->params[0].ndim, 2);
    CU_ASSERT_EQUAL(r->params[0].shape[0], 3);
    CU_ASSERT_EQUAL(r->params[0].shape[1], 4);
    CU_ASSERT_STRING_EQUAL(r->params[1].name, "b");
    CU_ASSERT_EQUAL(r->params[1].ndim, 1);
    CU_ASSERT_EQUAL(r->params[1].shape[0], 5);
    CU_ASSERT_EQUAL(r->params[0].skipped, 0);
    CU_ASSERT_EQUAL(r->params[1].skipped, 39);
    CU_ASSERT_EQUAL_FATAL(r->nfiles, 2);
    for (int i = 0; i < 2; i++) {
        const ps_ckpt_file_t *want = &files[1 - i], *got = &r->files[i];
        CU_ASSERT_EQUAL(got->rank, i);
        CU_ASSERT_STRING_EQUAL(got->path, want->path);
        CU_ASSERT_EQUAL(got->bytes, want->bytes);
        CU_ASSERT_EQUAL(got->crc32c, want->crc32c);
        CU_ASSERT_EQUAL(got->shard_numel, want->shard_numel);
        CU_ASSERT_EQUAL_FATAL(got->npieces, want->npieces);
        for (size_t j = 0; j < got->npieces; j++) {
            CU_ASSERT_EQUAL(got->pieces[j].param, want->pieces[j].param);
            CU_ASSERT_EQUAL(got->pieces[j].start, want->pieces[j].start);
            CU_ASSERT_EQUAL(got->pieces[j].count, want->pieces[j].count);
            CU_ASSERT_EQUAL(got->pieces[j].offset, want->pieces[j].offset);
        }
    }
    ps_ckpt_manifest_free(r);
    /* The text starts as the header documents it. */
    char path[256], text[200] = "";
    snprintf(path, sizeof(path), "%s/manifest.json", dir);
    FILE *f = fopen(path, "r");
    CU_ASSERT_FATAL(f != NULL);
    CU_ASSERT(fread(text, 1, sizeof(text) - 1, f) > 0);
    fclose(f);
    CU_ASSERT(strncmp(text,
                      "{\"format\": \"pshard-checkpoint\", \"version\": 1, \"step\": 40, "
                      "\"world_size\": 2, \"layout\": \"fsdp1\"",
                      strlen("{\"format\": \"pshard-checkpoint\", \"version\": 1, \"step\": 40, "
                             "\"world_size\": 2, \"layout\": \"fsdp1\"")) == 0);
    CU_ASSERT(strstr(text, "\"lr\": 0.10000000000000001") != NULL);
    ps_ckpt_manifest_free(NULL);
    rm_rf(root);
}

/* A valid manifest: world 2, w (4x3, rows split 2/2) and b (5, split 3/2), one section. */
static const char base_manifest[] =
    "{\"format\": \"pshard-checkpoint\", \"version\": 1, \"step\": 40, \"world_size\": 2,\n"
    " \"layout\": \"fsdp2\",\n"
    " \"optimizer\": {\"kind\": \"sgd\", \"lr\": 0.5, \"momentum\": 0, \"dampening\": 0,\n"
    "   \"nesterov\": false, \"weight_decay\": 0, \"beta1\": 0.9, \"beta2\": 0.999, \"eps\": "
    "1e-08, \"max_grad_norm\": 0},\n"
    " \"sections\": [\"master\"],\n"
    " \"params\": [{\"name\": \"w\", \"shape\": [4, 3]}, {\"name\": \"b\", \"shape\": [5]}],\n"
    " \"files\": [\n"
    "  {\"rank\": 0, \"path\": \"shard-00000-of-00002.bin\", \"bytes\": 36, \"crc32c\": 7, "
    "\"shard_numel\": 9, \"pieces\": [[0, 0, 6, 0], [1, 0, 3, 6]]},\n"
    "  {\"rank\": 1, \"path\": \"shard-00001-of-00002.bin\", \"bytes\": 32, \"crc32c\": 8, "
    "\"shard_numel\": 8, \"pieces\": [[0, 6, 6, 0], [1, 3, 2, 6]]}]}\n";

typedef struct {
    const char *find;    /* replaced once in base_manifest (NULL: use text as a whole) */
    const char *replace; /* ... by this, or the whole manifest when find is NULL */
    const char *expect;  /* substring the error must contain */
} bad_manifest_t;

static const bad_manifest_t bad_manifests[] = {
    /* JSON syntax */
    {NULL, "{\"format\": \"pshard-checkpoint\",", "line 1, column 31: string or '}' expected"},
    {NULL, "", "'[' or '{' expected near end of file"},
    {NULL, "[1, 2]", "manifest: expected an object, found an array"},
    {"[4, 3]}, ", "[4, 3],}, ", "line 6, column 43: string or '}' expected near '}'"},
    {"\"bytes\": 36", "\"bytes\": 036", "invalid token near '0'"},
    {"\"name\": \"b\"", "\"name\": \"\\ud800\"", "invalid Unicode '\\uD800'"},
    {"\"name\": \"b\"", "\"name\": \"\xc3\x28\"", "unable to decode byte 0xc3"},
    {"\"step\": 40", "\"step\": 40, \"step\": 41",
     "line 1, column 64: duplicate object key near '\"step\"'"},
    {"\"step\": 40", "\"step\": 40 /* c */", "'}' expected near '/'"},
    /* keys and types */
    {"\"version\": 1", "\"version\": 2", "version 2 is not supported"},
    {"\"format\": \"pshard-checkpoint\"", "\"format\": \"torch\"", "format: \"torch\""},
    {"\"step\": 40", "\"step\": 40, \"extra\": 1", "unknown key \"extra\""},
    {"\"layout\": \"fsdp2\",\n", "", "missing key \"layout\""},
    {"\"step\": 40", "\"step\": \"40\"", "step: expected an integer, found a string"},
    {"\"step\": 40", "\"step\": 40.5", "step: expected an integer, found a real number"},
    {"\"step\": 40", "\"step\": -1", "step: -1 is out of range"},
    {"\"step\": 40", "\"step\": 40, \"aborted_steps\": -2", "aborted_steps: -2 is out of range"},
    {"\"step\": 40", "\"step\": 40, \"aborted_steps\": 9223372036854775800",
     "aborted_steps: 9223372036854775800 is out of range"},
    {"\"step\": 40", "\"step\": 40, \"aborted_steps\": \"3\"",
     "aborted_steps: expected an integer, found a string"},
    {"\"world_size\": 2", "\"world_size\": 0", "world_size: 0 is out of range"},
    {"\"layout\": \"fsdp2\"", "\"layout\": \"ddp\"", "layout: \"ddp\" is not fsdp2 or fsdp1"},
    {"\"kind\": \"sgd\"", "\"kind\": \"lion\"", "optimizer.kind: \"lion\""},
    {"\"nesterov\": false", "\"nesterov\": 0", "optimizer.nesterov: expected a boolean"},
    {"\"lr\": 0.5", "\"lr\": \"fast\"", "optimizer.lr: expected a number"},
    {"\"eps\": 1e-08, ", "", "optimizer: missing key \"eps\""},
    {"[\"master\"]", "[\"master\", \"a\", \"b\", \"c\"]",
     "sections: expected 1 to 3 names, found 4"},
    {"[\"master\"]", "[]", "sections: expected 1 to 3 names, found 0"},
    {"[\"master\"]", "[\"master\", \"\"]", "sections[1]: a section name cannot be empty"},
    {"\"shape\": [5]", "\"shape\": []", "params[1].shape: expected 1 to 8 dimensions"},
    {"\"shape\": [5]", "\"shape\": [-5]", "params[1].shape[0]: -5 is out of range"},
    {"\"name\": \"b\"", "\"name\": \"\"", "params[1].name"},
    {"\"name\": \"b\"", "\"name\": \"w\"", "params[1].name: \"w\" is also the name of params[0]"},
    {"\"rank\": 1, \"path\"", "\"rank\": 1, \"checksum\": 1, \"path\"",
     "files[1]: unknown key \"checksum\""},
    {"\"crc32c\": 8", "\"crc32c\": 4294967296", "files[1].crc32c: 4294967296 is out of range"},
    {"[0, 6, 6, 0], [1, 3, 2, 6]", "[0, 6, 6, 0], [1, 3, 2]",
     "files[1].pieces[1]: expected 4 integers"},
    {"[0, 6, 6, 0], [1, 3, 2, 6]", "[0, 6, 6, 0], [1, 3, -2, 6]",
     "files[1].pieces[1]: expected 4 integers"},
    /* paths */
    {"\"shard-00001-of-00002.bin\"", "\"sub/shard.bin\"",
     "files[1].path: \"sub/shard.bin\" is not a plain file name"},
    {"\"shard-00001-of-00002.bin\"", "\"..\"", "files[1].path: \"..\" is not a plain file name"},
    {"\"shard-00001-of-00002.bin\"", "\"\"", "files[1].path: \"\" is empty"},
    {"\"shard-00001-of-00002.bin\"", "\"shard-00000-of-00002.bin\"",
     "files[1].path: \"shard-00000-of-00002.bin\" is also the path of files[0]"},
    /* ranks */
    {"\"rank\": 1", "\"rank\": 0", "files[1].rank: rank 0 also has files[0]"},
    {"\"world_size\": 2", "\"world_size\": 3", "no file for rank 2"},
    {"\"rank\": 1", "\"rank\": 2", "files[1].rank: 2 is not in 0..1"},
    /* sizes and pieces */
    {"\"bytes\": 32", "\"bytes\": 33", "files[1].bytes: 33, but 1 section of 8 elements are 32"},
    {"[1, 3, 2, 6]", "[1, 3, 2, 7]",
     "files[1].pieces[1]: file elements [7, 9) lie outside the file"},
    {"[0, 6, 6, 0]", "[0, 6, 7, 0]",
     "files[1].pieces[0]: elements [6, 13) lie outside parameter 0"},
    {"[1, 3, 2, 6]", "[5, 3, 2, 6]", "files[1].pieces[1]: parameter 5 does not exist"},
    {"[1, 3, 2, 6]", "[1, 3, 0, 6]", "files[1].pieces[1]: empty piece"},
    {"[0, 6, 6, 0], [1, 3, 2, 6]", "[0, 6, 6, 0], [1, 3, 2, 5]",
     "files[1].pieces[1]: file elements [5, 7) overlap files[1].pieces[0]"},
    {"[1, 3, 2, 6]", "[1, 2, 2, 6]",
     "elements [2, 4) of parameter 1 (b) overlap files[0].pieces[1]"},
    {"[1, 0, 3, 6]", "[1, 0, 2, 6]", "params[1] (b): elements [2, 3) are in no file's pieces"},
    {"[1, 3, 2, 6]]}]}", "[1, 3, 1, 6]]}]}",
     "params[1] (b): elements [4, 5) are in no file's pieces"},
    /* jansson's refusals: duplicate keys anywhere, reals where integers belong, unknown keys
     * in every object whose keys are fixed, \u0000, integers beyond int64, trailing text */
    {"\"kind\": \"sgd\"", "\"kind\": \"sgd\", \"kind\": \"adam\"", "duplicate object key"},
    {"\"bytes\": 32", "\"bytes\": 32, \"bytes\": 32", "duplicate object key"},
    {"\"version\": 1", "\"version\": 1.0", "version: expected an integer, found a real number"},
    {"\"world_size\": 2", "\"world_size\": 2e0",
     "world_size: expected an integer, found a real number"},
    {"\"bytes\": 32", "\"bytes\": 32.0", "files[1].bytes: expected an integer, found a real"},
    {"\"rank\": 1", "\"rank\": 1.0", "files[1].rank: expected an integer, found a real"},
    {"\"shape\": [5]", "\"shape\": [5.0]", "params[1].shape: expected an array of integers"},
    {"[1, 3, 2, 6]", "[1, 3, 2.0, 6]", "files[1].pieces[1]: expected 4 integers"},
    {"\"kind\": \"sgd\"", "\"kind\": \"sgd\", \"lion\": 1",
     "optimizer: unknown key \"lion\" (not in version 1)"},
    {"\"name\": \"w\"", "\"name\": \"w\", \"dtype\": \"f32\"", "params[0]: unknown key \"dtype\""},
    {"\"shape\": [5]}", "\"shape\": [5]}, [5]", "params[2]: expected an object, found an array"},
    {"\"name\": \"b\"", "\"name\": \"b\\u0000\"", "\\u0000 is not allowed"},
    {"\"step\": 40", "\"step\": 99999999999999999999", "too big integer"},
    {"\"eps\": 1e-08", "\"eps\": 1e999", "real number overflow"},
    {"\"files\": [", "\"files\": {", "expected"},
    {"]}]}\n", "]}]} x", "end of file expected"},
};

static void write_manifest_text(const char *dir, const char *text)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/manifest.json", dir);
    write_text(path, text, strlen(text));
}

static void test_manifest_malformed(void)
{
    char root[64], dir[128];
    make_tmpdir(root, sizeof(root));
    snprintf(dir, sizeof(dir), "%s/step-00000040", root);
    CU_ASSERT_EQUAL_FATAL(mkdir(dir, 0755), 0);
    /* The base itself is valid. */
    write_manifest_text(dir, base_manifest);
    ps_ckpt_manifest_t *m = NULL;
    char err[1024] = "";
    pshard_status_t rc = ps_ckpt_manifest_read(dir, &m, err, sizeof(err));
    if (rc != PSHARD_OK)
        fprintf(stderr, "base manifest: %s\n", err);
    CU_ASSERT_EQUAL_FATAL(rc, PSHARD_OK);
    ps_ckpt_manifest_free(m);
    int failures = 0;
    for (size_t i = 0; i < sizeof(bad_manifests) / sizeof(bad_manifests[0]); i++) {
        const bad_manifest_t *c = &bad_manifests[i];
        char text[4096];
        if (!c->find) {
            snprintf(text, sizeof(text), "%s", c->replace);
        } else {
            const char *at = strstr(base_manifest, c->find);
            CU_ASSERT_PTR_NOT_NULL_FATAL(at);
            snprintf(text, sizeof(text), "%.*s%s%s", (int)(at - base_manifest), base_manifest,
                     c->replace, at + strlen(c->find));
        }
        write_manifest_text(dir, text);
        m = NULL;
        err[0] = '\0';
        rc = ps_ckpt_manifest_read(dir, &m, err, sizeof(err));
        bool ok = rc == PSHARD_ERR_INVALID_ARGUMENT && m == NULL && strstr(err, c->expect) &&
                  strstr(err, "manifest.json");
        if (!ok) {
            fprintf(stderr, "\n  case %zu: want INVALID_ARGUMENT with \"%s\", got %s: %s\n", i,
                    c->expect, pshard_status_name(rc), err);
            failures++;
        }
        ps_ckpt_manifest_free(m);
    }
    CU_ASSERT_EQUAL(failures, 0);

    /* A manifest cut short anywhere (a torn copy) is refused, naming the file. */
    failures = 0;
    size_t full = strlen(base_manifest);
    for (size_t cut = 0; cut + 1 < full; cut += 7) {
        char text[4096];
        snprintf(text, sizeof(text), "%.*s", (int)cut, base_manifest);
        write_manifest_text(dir, text);
        m = NULL;
        err[0] = '\0';
        rc = ps_ckpt_manifest_read(dir, &m, err, sizeof(err));
        if (rc != PSHARD_ERR_INVALID_ARGUMENT || m || !strstr(err, "manifest.json: line ")) {
            fprintf(stderr, "\n  cut at %zu: %s: %s\n", cut, pshard_status_name(rc), err);
            failures++;
        }
        ps_ckpt_manifest_free(m);
    }
    CU_ASSERT_EQUAL(failures, 0);

    /* Nesting deeper than jansson's limit (2048), and a manifest over 64 MiB (sparse). */
    static char deep[6001];
    memset(deep, '[', 3000);
    memset(deep + 3000, ']', 3000);
    write_manifest_text(dir, deep);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_ckpt_manifest_read(dir, &m, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT(strstr(err, "maximum parsing depth reached") != NULL);
    char path[256];
    snprintf(path, sizeof(path), "%s/manifest.json", dir);
    CU_ASSERT_EQUAL(truncate(path, (off_t)(65u << 20)), 0);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_ckpt_manifest_read(dir, &m, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT(strstr(err, "64 MiB") != NULL);

    /* No manifest at all: not committed. */
    unlink(path);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_ckpt_manifest_read(dir, &m, err, sizeof(err)), PSHARD_ERR_NOT_FOUND);
    CU_ASSERT(strstr(err, "not a committed checkpoint") != NULL);
    snprintf(path, sizeof(path), "%s/no-such-dir", root);
    CU_ASSERT_EQUAL(ps_ckpt_manifest_read(path, &m, err, sizeof(err)), PSHARD_ERR_NOT_FOUND);
    rm_rf(root);
}

/* The writer refuses what the reader would refuse, and reports system errors naming the path;
 * a failed write leaves the committed manifest as it was and no temporary file. */
static void test_manifest_write_errors(void)
{
    char root[64], dir[160], err[1024] = "";
    make_tmpdir(root, sizeof(root));
    ps_ckpt_manifest_t m;
    build_ckpt(root, 5, PSHARD_LAYOUT_FSDP2, 3, 2, &m, dir, sizeof(dir));

    /* Invalid: a gap in parameter 0's coverage. */
    m.files[1].pieces[0].count--;
    CU_ASSERT_EQUAL(ps_ckpt_manifest_write(dir, &m, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT(strstr(err, "refusing to write") && strstr(err, "manifest.json"));
    m.files[1].pieces[0].count++;

    /* A directory that cannot exist: its parent is a regular file (ENOTDIR, even for root). */
    char file_parent[256], bad_dir[300];
    snprintf(file_parent, sizeof(file_parent), "%s/plain-file", root);
    write_text(file_parent, "x", 1);
    snprintf(bad_dir, sizeof(bad_dir), "%s/step-00000005", file_parent);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_ckpt_manifest_write(bad_dir, &m, err, sizeof(err)), PSHARD_ERR_SYSTEM);
    CU_ASSERT(strstr(err, bad_dir) != NULL);
    CU_ASSERT(strstr(err, "Not a directory") != NULL);

    /* A directory this user may not write: as root, a child process that became nobody. */
    m.optim.lr = 0.25; /* a different manifest, which must not replace the committed one */
    if (geteuid() != 0) {
        CU_ASSERT_EQUAL(chmod(dir, 0555), 0);
        err[0] = '\0';
        CU_ASSERT_EQUAL(ps_ckpt_manifest_write(dir, &m, err, sizeof(err)), PSHARD_ERR_SYSTEM);
        CU_ASSERT(strstr(err, dir) != NULL);
        CU_ASSERT(strstr(err, "Permission denied") != NULL);
        chmod(dir, 0755);
    } else {
        chmod(root, 0755); /* nobody may enter, not write */
        pid_t pid = fork();
        CU_ASSERT_FATAL(pid >= 0);
        if (pid == 0) {
            if (setgid(65534) != 0 || setuid(65534) != 0)
                _exit(77);
            char cerr[1024] = "";
            pshard_status_t crc = ps_ckpt_manifest_write(dir, &m, cerr, sizeof(cerr));
            bool ok =
                crc == PSHARD_ERR_SYSTEM && strstr(cerr, dir) && strstr(cerr, "Permission denied");
            if (!ok)
                fprintf(stderr, "\n  as nobody: %s: %s\n", pshard_status_name(crc), cerr);
            _exit(ok ? 0 : 1);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        CU_ASSERT(WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 77));
        if (WIFEXITED(status) && WEXITSTATUS(status) == 77)
            fprintf(stderr, "\n  (cannot become nobody: the permission case is skipped)\n");
    }
    ps_ckpt_manifest_t *r = NULL;
    CU_ASSERT_EQUAL_FATAL(ps_ckpt_manifest_read(dir, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT(r->optim.lr == 0.001);
    ps_ckpt_manifest_free(r);
    /* Either way: the step directory holds the shard files and the manifest, nothing else. */
    CU_ASSERT_EQUAL(count_entries(dir), 4);
    manifest_release(&m);
    rm_rf(root);
}

/* A full file system: a child in its own mount namespace mounts a 16 KiB tmpfs and writes a
 * manifest larger than that. Needs root (or CAP_SYS_ADMIN); skipped otherwise. */
static void test_manifest_write_enospc(void)
{
    char mnt[64];
    make_tmpdir(mnt, sizeof(mnt));
    pid_t pid = fork();
    CU_ASSERT_FATAL(pid >= 0);
    if (pid == 0) {
        if (unshare(CLONE_NEWNS) != 0 || mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
            mount("tmpfs", mnt, "tmpfs", 0, "size=16k") != 0)
            _exit(77);
        ps_ckpt_param_t *params = calloc(2000, sizeof(*params));
        ps_ckpt_piece_t *pieces = calloc(2000, sizeof(*pieces));
        if (!params || !pieces)
            _exit(2);
        for (uint32_t p = 0; p < 2000; p++) {
            snprintf(params[p].name, sizeof(params[p].name), "layers.%u.weight", p);
            params[p].ndim = 1;
            params[p].shape[0] = 1;
            pieces[p] = (ps_ckpt_piece_t){p, 0, 1, p};
        }
        ps_ckpt_file_t file = {.rank = 0,
                               .path = "shard-00000-of-00001.bin",
                               .bytes = 8000,
                               .shard_numel = 2000,
                               .npieces = 2000,
                               .pieces = pieces};
        ps_ckpt_manifest_t m = {.step = 1,
                                .world_size = 1,
                                .optim = {.kind = "sgd"},
                                .nsections = 1,
                                .sections = {"master"},
                                .nparams = 2000,
                                .params = params,
                                .nfiles = 1,
                                .files = &file};
        char cerr[1024] = "";
        pshard_status_t crc = ps_ckpt_manifest_write(mnt, &m, cerr, sizeof(cerr));
        bool ok = crc == PSHARD_ERR_SYSTEM && strstr(cerr, mnt) &&
                  strstr(cerr, "No space left on device") && count_entries(mnt) == 0;
        if (!ok)
            fprintf(stderr, "\n  full disk: %s: %s (%d entries left)\n", pshard_status_name(crc),
                    cerr, count_entries(mnt));
        free(params);
        free(pieces);
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CU_ASSERT(WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 77));
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77)
        fprintf(stderr, "\n  (cannot mount a small tmpfs here: the full-disk case is skipped)\n");
    rm_rf(mnt);
}

/* ---- shard files -------------------------------------------------------------------------- */

static void flip_byte(const char *path, off_t at)
{
    int fd = open(path, O_RDWR);
    CU_ASSERT_FATAL(fd >= 0);
    unsigned char b;
    CU_ASSERT_EQUAL(pread(fd, &b, 1, at), 1);
    b ^= 0x10;
    CU_ASSERT_EQUAL(pwrite(fd, &b, 1, at), 1);
    close(fd);
}

static void test_verify_file(void)
{
    char root[64], dir[160], err[1024] = "", path[512];
    make_tmpdir(root, sizeof(root));
    ps_ckpt_manifest_t m;
    build_ckpt(root, 7, PSHARD_LAYOUT_FSDP2, 3, 3, &m, dir, sizeof(dir));
    for (size_t i = 0; i < m.nfiles; i++)
        CU_ASSERT_EQUAL(ps_ckpt_verify_file(dir, &m.files[i], err, sizeof(err)), PSHARD_OK);

    snprintf(path, sizeof(path), "%s/%s", dir, m.files[1].path);
    flip_byte(path, 37);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_ckpt_verify_file(dir, &m.files[1], err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT(strstr(err, "shard-00001-of-00003.bin") && strstr(err, "checksum mismatch"));
    flip_byte(path, 37);
    CU_ASSERT_EQUAL(ps_ckpt_verify_file(dir, &m.files[1], err, sizeof(err)), PSHARD_OK);

    snprintf(path, sizeof(path), "%s/%s", dir, m.files[2].path);
    CU_ASSERT_EQUAL(truncate(path, (off_t)m.files[2].bytes - 4), 0);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_ckpt_verify_file(dir, &m.files[2], err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    char want[160];
    snprintf(want, sizeof(want),
             "shard-00002-of-00003.bin: truncated: %" PRIu64 " of %" PRIu64 " bytes",
             m.files[2].bytes - 4, m.files[2].bytes);
    CU_ASSERT(strstr(err, want) != NULL);
    if (!strstr(err, want))
        fprintf(stderr, "\n  got: %s\n  want: %s\n", err, want);

    /* ... and read_range of the lost bytes says truncated too. */
    float buf[64];
    const ps_ckpt_file_t *f2 = &m.files[2];
    const ps_ckpt_piece_t *last = &f2->pieces[f2->npieces - 1];
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_ckpt_read_range(dir, &m, 2, last->param, last->start, last->count, buf, err,
                                       sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT(strstr(err, "truncated") && strstr(err, "shard-00002-of-00003.bin"));

    CU_ASSERT_EQUAL(unlink(path), 0);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_ckpt_verify_file(dir, &m.files[2], err, sizeof(err)), PSHARD_ERR_NOT_FOUND);
    CU_ASSERT(strstr(err, "shard-00002-of-00003.bin") != NULL);
    manifest_release(&m);
    rm_rf(root);
}

/* Reads every parameter whole and many random ranges of every section, through whichever
 * files hold them, and compares with val(). Returns the number of mismatches. */
static int check_ranges(const char *dir, const ps_ckpt_manifest_t *m)
{
    int bad = 0;
    char err[512];
    for (size_t p = 0; p < m->nparams; p++) {
        uint64_t numel = tnumel(&model[p]);
        float *buf = calloc(numel + 1, sizeof(float));
        for (int k = 0; k < m->nsections; k++) {
            for (int t = 0; t < 40; t++) {
                uint64_t start = t == 0 ? 0 : rnd_below(numel + 1);
                uint64_t count = t == 0 ? numel : rnd_below(numel - start + 1);
                err[0] = '\0';
                memset(buf, 0xff, (numel + 1) * sizeof(float));
                pshard_status_t rc =
                    ps_ckpt_read_range(dir, m, k, (uint32_t)p, start, count, buf, err, sizeof(err));
                if (rc != PSHARD_OK) {
                    fprintf(stderr, "\n  read_range: %s\n", err);
                    bad++;
                    continue;
                }
                for (uint64_t i = 0; i < count; i++)
                    bad += buf[i] != val(k, p, start + i);
                uint32_t sentinel;
                memcpy(&sentinel, &buf[count], 4);
                bad += sentinel != 0xffffffffu; /* nothing written past the range */
            }
        }
        free(buf);
    }
    return bad;
}

static void test_read_range_layouts(void)
{
    char root[64], dir[160], err[512] = "";
    make_tmpdir(root, sizeof(root));
    ps_ckpt_manifest_t m;
    /* FSDP2 rows over 3 ranks (some own nothing of "row"), then an FSDP1 flat split over 3. */
    build_ckpt(root, 10, PSHARD_LAYOUT_FSDP2, 3, 3, &m, dir, sizeof(dir));
    CU_ASSERT_EQUAL(check_ranges(dir, &m), 0);
    ps_ckpt_manifest_t *r = NULL;
    CU_ASSERT_EQUAL_FATAL(ps_ckpt_manifest_read(dir, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(check_ranges(dir, r), 0);
    ps_ckpt_manifest_free(r);
    manifest_release(&m);

    build_ckpt(root, 20, PSHARD_LAYOUT_FSDP1, 3, 2, &m, dir, sizeof(dir));
    CU_ASSERT_EQUAL(check_ranges(dir, &m), 0);
    /* Errors: out of range, unknown section, unknown parameter. */
    float buf[8];
    CU_ASSERT_EQUAL(ps_ckpt_read_range(dir, &m, 0, 1, 2, 2, buf, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT(strstr(err, "outside parameter fc0.bias") != NULL);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_ckpt_read_range(dir, &m, 2, 1, 0, 1, buf, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT(strstr(err, "section 2 does not exist") != NULL);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_ckpt_read_range(dir, &m, 0, 99, 0, 1, buf, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(ps_ckpt_read_range(dir, &m, 0, 1, 3, 0, buf, err, sizeof(err)), PSHARD_OK);
    manifest_release(&m);
    rm_rf(root);
}

/* Pieces placed by hand: a parameter split into non-contiguous pieces of one file, listed out
 * of order, with the other file's piece between them. */
static void test_read_range_scattered(void)
{
    char root[64], dir[160], err[512] = "";
    make_tmpdir(root, sizeof(root));
    snprintf(dir, sizeof(dir), "%s/step-00000001", root);
    CU_ASSERT_EQUAL_FATAL(mkdir(dir, 0755), 0);
    /* Parameter 0 has 10 elements: file A holds [7,10) at 0 and [0,3) at 5; file B [3,7) at 1.
     * Two sections. Element e of section k is 100*k + e. */
    float a[2][8], b[2][5];
    memset(a, 0, sizeof(a));
    memset(b, 0, sizeof(b));
    for (int k = 0; k < 2; k++) {
        for (int e = 7; e < 10; e++)
            a[k][e - 7] = (float)(100 * k + e);
        for (int e = 0; e < 3; e++)
            a[k][5 + e] = (float)(100 * k + e);
        for (int e = 3; e < 7; e++)
            b[k][1 + e - 3] = (float)(100 * k + e);
    }
    char path[300];
    snprintf(path, sizeof(path), "%s/a.bin", dir);
    write_text(path, (const char *)a, sizeof(a));
    snprintf(path, sizeof(path), "%s/b.bin", dir);
    write_text(path, (const char *)b, sizeof(b));
    ps_ckpt_piece_t pa[] = {{0, 7, 3, 0}, {0, 0, 3, 5}}, pb[] = {{0, 3, 4, 1}};
    ps_ckpt_param_t prm = {"x", 1, {10}, 0};
    ps_ckpt_file_t files[2] = {
        {.rank = 0,
         .path = "a.bin",
         .bytes = sizeof(a),
         .crc32c = ps_crc32c(0, a, sizeof(a)),
         .shard_numel = 8,
         .npieces = 2,
         .pieces = pa},
        {.rank = 1,
         .path = "b.bin",
         .bytes = sizeof(b),
         .crc32c = ps_crc32c(0, b, sizeof(b)),
         .shard_numel = 5,
         .npieces = 1,
         .pieces = pb},
    };
    ps_ckpt_manifest_t m = {.step = 1,
                            .world_size = 2,
                            .layout = PSHARD_LAYOUT_FSDP1,
                            .optim = {.kind = "sgd"},
                            .nsections = 2,
                            .sections = {"master", "momentum_buffer"},
                            .nparams = 1,
                            .params = &prm,
                            .nfiles = 2,
                            .files = files};
    CU_ASSERT_EQUAL_FATAL(ps_ckpt_manifest_write(dir, &m, err, sizeof(err)), PSHARD_OK);
    ps_ckpt_manifest_t *r = NULL;
    CU_ASSERT_EQUAL_FATAL(ps_ckpt_manifest_read(dir, &r, err, sizeof(err)), PSHARD_OK);
    int bad = 0;
    for (int k = 0; k < 2; k++)
        for (uint64_t s = 0; s <= 10; s++)
            for (uint64_t c = 0; s + c <= 10; c++) {
                float out[10];
                if (ps_ckpt_read_range(dir, r, k, 0, s, c, out, err, sizeof(err)) != PSHARD_OK) {
                    bad++;
                    continue;
                }
                for (uint64_t i = 0; i < c; i++)
                    bad += out[i] != (float)(100 * k + (int)(s + i));
            }
    CU_ASSERT_EQUAL(bad, 0);
    for (size_t i = 0; i < r->nfiles; i++)
        CU_ASSERT_EQUAL(ps_ckpt_verify_file(dir, &r->files[i], err, sizeof(err)), PSHARD_OK);
    ps_ckpt_manifest_free(r);
    rm_rf(root);
}

/* ---- list and prune ----------------------------------------------------------------------- */

static bool exists(const char *root, const char *name)
{
    char path[300];
    struct stat st;
    snprintf(path, sizeof(path), "%s/%s", root, name);
    return stat(path, &st) == 0;
}

static void test_list_and_prune(void)
{
    char root[64], dir[160], err[512] = "", path[300];
    make_tmpdir(root, sizeof(root));
    int64_t *steps = NULL;
    size_t n = 99;
    /* A missing root holds no checkpoints. */
    snprintf(path, sizeof(path), "%s/none", root);
    CU_ASSERT_EQUAL(ps_ckpt_list(path, &steps, &n, NULL, 0, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(n, 0);
    free(steps);
    CU_ASSERT_EQUAL(ps_ckpt_prune(path, 2, err, sizeof(err)), PSHARD_OK);

    ps_ckpt_manifest_t m;
    const int64_t committed[] = {20, 5, 15, 10};
    for (size_t i = 0; i < 4; i++) {
        build_ckpt(root, committed[i], PSHARD_LAYOUT_FSDP2, 2, 1, &m, dir, sizeof(dir));
        manifest_release(&m);
    }
    /* Not checkpoints: saves that never committed (older and newer than the newest), a
     * non-canonical name, an unrelated directory, a manifest that does not parse. */
    build_ckpt(root, 3, PSHARD_LAYOUT_FSDP2, 2, 1, &m, dir, sizeof(dir));
    manifest_release(&m);
    snprintf(path, sizeof(path), "%s/manifest.json", dir);
    unlink(path);
    snprintf(path, sizeof(path), "%s/step-00000025", root);
    mkdir(path, 0755);
    snprintf(path, sizeof(path), "%s/step-00000025/shard-00000-of-00002.bin", root);
    write_text(path, "abcd", 4);
    snprintf(path, sizeof(path), "%s/step-7", root);
    mkdir(path, 0755);
    snprintf(path, sizeof(path), "%s/notes", root);
    mkdir(path, 0755);
    build_ckpt(root, 12, PSHARD_LAYOUT_FSDP2, 2, 1, &m, dir, sizeof(dir));
    manifest_release(&m);
    write_manifest_text(dir, "{\"format\": \"pshard-checkpoint\"}");

    ps_log_set_level(PS_LOG_ERROR); /* listing warns about step 12's manifest */
    CU_ASSERT_EQUAL_FATAL(ps_ckpt_list(root, &steps, &n, NULL, 0, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL_FATAL(n, 4);
    CU_ASSERT(steps[0] == 5 && steps[1] == 10 && steps[2] == 15 && steps[3] == 20);
    free(steps);

    CU_ASSERT_EQUAL(ps_ckpt_prune(root, 0, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(ps_ckpt_prune(root, 2, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL_FATAL(ps_ckpt_list(root, &steps, &n, NULL, 0, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL_FATAL(n, 2);
    CU_ASSERT(steps[0] == 15 && steps[1] == 20);
    free(steps);
    CU_ASSERT(!exists(root, "step-00000005") && !exists(root, "step-00000010"));
    CU_ASSERT(!exists(root, "step-00000003")); /* uncommitted, older than step 20 */
    CU_ASSERT(exists(root, "step-00000025"));  /* may still be being saved */
    CU_ASSERT(exists(root, "step-00000012"));  /* a bad manifest is left for a person */
    CU_ASSERT(exists(root, "step-7") && exists(root, "notes"));
    /* Keeping more than there are removes nothing. */
    CU_ASSERT_EQUAL(ps_ckpt_prune(root, 5, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT(exists(root, "step-00000015/manifest.json"));
    ps_log_set_level(PS_LOG_WARN);
    rm_rf(root);
}

/* ---- an untrusted checkpoint root --------------------------------------------------------- */

static bool file_has(const char *path, const char *text)
{
    char buf[64] = "";
    FILE *f = fopen(path, "rb");
    if (!f)
        return false;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    return strcmp(buf, text) == 0;
}

static bool is_link(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0 && S_ISLNK(st.st_mode);
}

/* Links inside the root are never followed: not by pruning, listing, making a step directory
 * or writing a file over a planted link. */
static void test_root_links(void)
{
    char root[64], victim[64], dir[160], err[512] = "", path[300], target[300];
    make_tmpdir(root, sizeof(root));
    make_tmpdir(victim, sizeof(victim));
    const char *names[] = {"keep.txt", "manifest.json", "shard-00000-of-00002.bin",
                           ".manifest.json.tmp-abcdef"};
    for (size_t i = 0; i < 4; i++) {
        snprintf(path, sizeof(path), "%s/%s", victim, names[i]);
        write_text(path, "victim", 6);
    }
    ps_ckpt_manifest_t m;
    for (int64_t st = 10; st <= 20; st += 10) {
        build_ckpt(root, st, PSHARD_LAYOUT_FSDP2, 2, 1, &m, dir, sizeof(dir));
        manifest_release(&m);
    }
    /* step-1 and step-15 are links to the victim directory (older than the newest). */
    snprintf(path, sizeof(path), "%s/step-00000001", root);
    CU_ASSERT_EQUAL_FATAL(symlink(victim, path), 0);
    snprintf(path, sizeof(path), "%s/step-00000015", root);
    CU_ASSERT_EQUAL_FATAL(symlink(victim, path), 0);

    ps_log_set_level(PS_LOG_ERROR);
    int64_t *steps = NULL;
    size_t n = 0;
    char refused[512] = "x";
    CU_ASSERT_EQUAL_FATAL(
        ps_ckpt_list(root, &steps, &n, refused, sizeof(refused), err, sizeof(err)), PSHARD_OK);
    CU_ASSERT(n == 2 && steps[0] == 10 && steps[1] == 20);
    CU_ASSERT_PTR_NOT_NULL(strstr(refused, "symbolic link"));
    free(steps);
    CU_ASSERT_EQUAL(ps_ckpt_prune(root, 1, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT(!exists(root, "step-00000010"));
    for (size_t i = 0; i < 4; i++) {
        snprintf(path, sizeof(path), "%s/%s", victim, names[i]);
        CU_ASSERT(file_has(path, "victim"));
    }
    snprintf(path, sizeof(path), "%s/step-00000001", root);
    CU_ASSERT(is_link(path)); /* left alone */

    /* A step directory that is a link is refused, not written through. */
    int dfd = -1;
    snprintf(path, sizeof(path), "%s/step-00000030", root);
    CU_ASSERT_EQUAL_FATAL(symlink(victim, path), 0);
    CU_ASSERT_EQUAL(ps_ckpt_step_dir_make(root, 30, &dfd, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "symbolic link"));
    CU_ASSERT_EQUAL(dfd, -1);
    err[0] = '\0';
    ps_ckpt_manifest_t *r = NULL;
    ps_ckpt_step_dir(root, 30, dir, sizeof(dir));
    CU_ASSERT_EQUAL(ps_ckpt_manifest_read(dir, &r, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NULL(r);
    err[0] = '\0';

    /* A file planted as a link at the final name: the write replaces the link itself. */
    CU_ASSERT_EQUAL_FATAL(ps_ckpt_step_dir_make(root, 40, &dfd, err, sizeof(err)), PSHARD_OK);
    snprintf(target, sizeof(target), "%s/keep.txt", victim);
    snprintf(path, sizeof(path), "%s/step-00000040/shard-00000-of-00001.bin", root);
    CU_ASSERT_EQUAL_FATAL(symlink(target, path), 0);
    CU_ASSERT_EQUAL(
        ps_atomic_file_put(dfd, "shard-00000-of-00001.bin", path, "data", 4, err, sizeof(err)),
        PSHARD_OK);
    CU_ASSERT(!is_link(path) && file_has(path, "data"));
    CU_ASSERT(file_has(target, "victim"));
    /* Reading a link inside the root is refused, and names it. */
    snprintf(path, sizeof(path), "%s/step-00000040/other.bin", root);
    CU_ASSERT_EQUAL_FATAL(symlink(target, path), 0);
    int fd = -1;
    CU_ASSERT_EQUAL(ckpt_file_open(dfd, "other.bin", path, false, &fd, NULL, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "symbolic link"));
    CU_ASSERT_EQUAL(fd, -1);
    close(dfd);
    ps_log_set_level(PS_LOG_WARN);
    rm_rf(root);
    rm_rf(victim);
}

/* Pruning removes only the regular files pshard writes; a step directory holding anything
 * else stays (uncommitted), with that file. */
static void test_prune_foreign_files(void)
{
    char root[64], dir[160], err[512] = "", path[300];
    make_tmpdir(root, sizeof(root));
    ps_ckpt_manifest_t m;
    build_ckpt(root, 40, PSHARD_LAYOUT_FSDP2, 2, 1, &m, dir, sizeof(dir));
    manifest_release(&m);
    snprintf(path, sizeof(path), "%s/notes.txt", dir);
    write_text(path, "mine", 4);
    snprintf(path, sizeof(path), "%s/.shard-00001-of-00002.bin.tmp-0123456789ab", dir);
    write_text(path, "tmp", 3);
    build_ckpt(root, 45, PSHARD_LAYOUT_FSDP2, 2, 1, &m, dir, sizeof(dir));
    manifest_release(&m);
    ps_log_set_level(PS_LOG_ERROR);
    CU_ASSERT_EQUAL(ps_ckpt_prune(root, 1, err, sizeof(err)), PSHARD_OK);
    ps_log_set_level(PS_LOG_WARN);
    CU_ASSERT(exists(root, "step-00000040/notes.txt"));
    CU_ASSERT(!exists(root, "step-00000040/manifest.json"));
    CU_ASSERT(!exists(root, "step-00000040/shard-00000-of-00002.bin"));
    CU_ASSERT(!exists(root, "step-00000040/.shard-00001-of-00002.bin.tmp-0123456789ab"));
    CU_ASSERT(exists(root, "step-00000045/manifest.json"));

    CU_ASSERT(ps_ckpt_is_own_file("manifest.json"));
    CU_ASSERT(ps_ckpt_is_own_file("shard-00003-of-00004.bin"));
    CU_ASSERT(ps_ckpt_is_own_file("shard-00003-of-00004.bin.tmp"));
    CU_ASSERT(ps_ckpt_is_own_file(".manifest.json.tmp-Ab12Cd"));
    CU_ASSERT(!ps_ckpt_is_own_file("notes.tmp"));
    CU_ASSERT(!ps_ckpt_is_own_file(".notes.tmp-0123456789ab"));
    CU_ASSERT(!ps_ckpt_is_own_file("shard-1-of-2.bin.bak"));
    CU_ASSERT(!ps_ckpt_is_own_file(".manifest.json.tmp-../x"));
    rm_rf(root);
}

/* A FIFO (no writer ever comes) as a manifest, a shard file or a safetensors file is refused
 * at once instead of blocking the reader forever. */
static void test_fifo_refused(void)
{
    char root[64], dir[160], err[512] = "", path[300];
    make_tmpdir(root, sizeof(root));
    ps_ckpt_manifest_t m;
    build_ckpt(root, 50, PSHARD_LAYOUT_FSDP2, 2, 1, &m, dir, sizeof(dir));
    ps_ckpt_manifest_t *r = NULL;
    CU_ASSERT_EQUAL_FATAL(ps_ckpt_manifest_read(dir, &r, err, sizeof(err)), PSHARD_OK);
    alarm(30); /* a regression hangs: let SIGALRM fail the suite instead */
    snprintf(path, sizeof(path), "%s/%.64s", dir, r->files[0].path);
    unlink(path);
    CU_ASSERT_EQUAL_FATAL(mkfifo(path, 0644), 0);
    CU_ASSERT_EQUAL(ps_ckpt_verify_file(dir, &r->files[0], err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "FIFO"));
    float out[4];
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_ckpt_read_range(dir, r, 0, 0, 0, 1, out, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "FIFO"));
    ps_ckpt_manifest_free(r);
    r = NULL;
    snprintf(path, sizeof(path), "%s/manifest.json", dir);
    unlink(path);
    CU_ASSERT_EQUAL_FATAL(mkfifo(path, 0644), 0);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_ckpt_manifest_read(dir, &r, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "FIFO"));
    int64_t *steps = NULL;
    size_t n = 9;
    char refused[512] = "";
    ps_log_set_level(PS_LOG_ERROR);
    CU_ASSERT_EQUAL(ps_ckpt_list(root, &steps, &n, refused, sizeof(refused), err, sizeof(err)),
                    PSHARD_OK);
    ps_log_set_level(PS_LOG_WARN);
    CU_ASSERT_EQUAL(n, 0);
    CU_ASSERT_PTR_NOT_NULL(strstr(refused, "FIFO"));
    free(steps);
    snprintf(path, sizeof(path), "%s/model.safetensors", root);
    CU_ASSERT_EQUAL_FATAL(mkfifo(path, 0644), 0);
    float v[6];
    const int64_t shape[2] = {2, 3};
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_safetensors_read(path, "t", 2, shape, v, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "FIFO"));
    alarm(0);
    manifest_release(&m);
    rm_rf(root);
}

/* ---- safetensors -------------------------------------------------------------------------- */

static void check_export(const char *dir, const ps_ckpt_manifest_t *m, pshard_dtype_t dtype,
                         const char *out)
{
    char err[1024] = "";
    pshard_status_t rc = ps_safetensors_export(dir, m, dtype, out, err, sizeof(err));
    if (rc != PSHARD_OK)
        fprintf(stderr, "\n  export: %s\n", err);
    CU_ASSERT_EQUAL_FATAL(rc, PSHARD_OK);
    /* Layout: 8-byte length, a header padded to 8 with the metadata, then the data. */
    FILE *f = fopen(out, "rb");
    CU_ASSERT_FATAL(f != NULL);
    uint8_t len8[8];
    CU_ASSERT_EQUAL(fread(len8, 1, 8, f), 8);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)len8[i] << (8 * i);
    CU_ASSERT_EQUAL(hlen % 8, 0);
    char *header = calloc(hlen + 1, 1);
    CU_ASSERT_EQUAL(fread(header, 1, hlen, f), hlen);
    CU_ASSERT(strstr(header, "\"__metadata__\":{\"format\":\"pt\",\"pshard_step\":\"") != NULL);
    CU_ASSERT(strstr(header, dtype == PSHARD_BF16 ? "\"BF16\"" : "\"F32\"") != NULL);
    free(header);
    fseek(f, 0, SEEK_END);
    uint64_t total = 0;
    for (size_t p = 0; p < m->nparams; p++)
        total += tnumel(&model[p]) * pshard_dtype_size(dtype);
    CU_ASSERT_EQUAL((uint64_t)ftell(f), 8 + hlen + total);
    fclose(f);
    int bad = 0;
    for (size_t p = 0; p < m->nparams; p++) {
        uint64_t numel = tnumel(&model[p]);
        float *buf = calloc(numel, sizeof(float));
        err[0] = '\0';
        rc = ps_safetensors_read(out, model[p].name, model[p].ndim, model[p].shape, buf, err,
                                 sizeof(err));
        if (rc != PSHARD_OK)
            fprintf(stderr, "\n  read %s: %s\n", model[p].name, err);
        CU_ASSERT_EQUAL(rc, PSHARD_OK);
        for (uint64_t i = 0; i < numel; i++) {
            float want = val(0, p, i);
            if (dtype == PSHARD_BF16)
                want = ps_bf16_to_f32(ps_f32_to_bf16(want));
            bad += buf[i] != want;
        }
        free(buf);
    }
    CU_ASSERT_EQUAL(bad, 0);
}

static void test_safetensors_export(void)
{
    char root[64], dir[160], out[200], err[512] = "";
    make_tmpdir(root, sizeof(root));
    ps_ckpt_manifest_t m;
    build_ckpt(root, 30, PSHARD_LAYOUT_FSDP1, 3, 3, &m, dir, sizeof(dir));
    snprintf(out, sizeof(out), "%s/out", root);
    mkdir(out, 0755);
    snprintf(out, sizeof(out), "%s/out/model.safetensors", root);
    check_export(dir, &m, PSHARD_FP32, out);
    check_export(dir, &m, PSHARD_BF16, out); /* replaces the fp32 file */
    /* The bf16 comparison above meant something: many values are not bf16-exact. */
    int inexact = 0;
    for (uint64_t i = 0; i < 35; i++)
        inexact += ps_bf16_to_f32(ps_f32_to_bf16(val(0, 0, i))) != val(0, 0, i);
    CU_ASSERT(inexact > 10);
    snprintf(out, sizeof(out), "%s/out", root);
    CU_ASSERT_EQUAL(count_entries(out), 1); /* no temporary file left */
    snprintf(out, sizeof(out), "%s/out/model.safetensors", root);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_safetensors_export(dir, &m, PSHARD_FP16, out, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT(strstr(err, "fp16") != NULL);
    /* An output directory that does not exist: a system error naming the path. */
    snprintf(out, sizeof(out), "%s/missing/model.safetensors", root);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_safetensors_export(dir, &m, PSHARD_FP32, out, err, sizeof(err)),
                    PSHARD_ERR_SYSTEM);
    CU_ASSERT(strstr(err, out) != NULL);
    manifest_release(&m);
    rm_rf(root);
}

/* Writes a safetensors file by hand: the header (length taken from it unless hlen_override is
 * nonzero) and data_len bytes of data (element j of a little-endian fp32 view is j + 0.5). */
static void write_st(const char *path, const char *header, uint64_t hlen_override, size_t data_len)
{
    FILE *f = fopen(path, "wb");
    CU_ASSERT_FATAL(f != NULL);
    uint64_t hlen = hlen_override ? hlen_override : strlen(header);
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)(hlen >> (8 * i));
    fwrite(len8, 1, 8, f);
    fwrite(header, 1, strlen(header), f);
    for (size_t j = 0; j + 4 <= data_len; j += 4) {
        float v = (float)(j / 4) + 0.5f;
        fwrite(&v, 4, 1, f);
    }
    for (size_t j = data_len / 4 * 4; j < data_len; j++)
        fputc(0, f);
    fclose(f);
}

typedef struct {
    const char *header;
    uint64_t hlen; /* 0: the header's own length */
    size_t data_len;
    const char *name; /* tensor asked for, with shape {2, 3} unless ask_ndim says otherwise */
    pshard_status_t want;
    const char *expect;
} bad_st_t;

#define ST_T(extra) "{\"t\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}" extra "}"

static const bad_st_t bad_sts[] = {
    {ST_T(""), 0, 24, "u", PSHARD_ERR_NOT_FOUND, "no tensor named \"u\""},
    {ST_T(""), 1000, 24, "t", PSHARD_ERR_INVALID_ARGUMENT, "runs past the end of the file"},
    {ST_T(""), 100000001, 24, "t", PSHARD_ERR_INVALID_ARGUMENT, "beyond safetensors' limit"},
    {"{\"t\":", 0, 24, "t", PSHARD_ERR_INVALID_ARGUMENT, "header: line 1"},
    {"[]", 0, 24, "t", PSHARD_ERR_INVALID_ARGUMENT, "not an object"},
    {ST_T(""), 0, 20, "t", PSHARD_ERR_INVALID_ARGUMENT, "lies outside the 20 bytes of data"},
    {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[24,0]}}", 0, 24, "t",
     PSHARD_ERR_INVALID_ARGUMENT, "expected [begin, end]"},
    {ST_T(",\"u\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]}"), 0, 24, "t",
     PSHARD_ERR_INVALID_ARGUMENT, "overlap"},
    {"{\"t\":{\"dtype\":\"F33\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", 0, 24, "t",
     PSHARD_ERR_INVALID_ARGUMENT, "not a safetensors dtype"},
    {"{\"t\":{\"dtype\":\"I32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", 0, 24, "t",
     PSHARD_ERR_INVALID_ARGUMENT, "only F32, BF16 and F16"},
    {"{\"t\":{\"dtype\":\"F32\",\"shape\":[3,2],\"data_offsets\":[0,24]}}", 0, 24, "t",
     PSHARD_ERR_INVALID_ARGUMENT, "has shape [3, 2], expected [2, 3]"},
    {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}}", 0, 24, "t",
     PSHARD_ERR_INVALID_ARGUMENT, "need 24"},
    {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2,-3],\"data_offsets\":[0,24]}}", 0, 24, "t",
     PSHARD_ERR_INVALID_ARGUMENT, "sizes must be integers"},
    {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2,3]}}", 0, 24, "t", PSHARD_ERR_INVALID_ARGUMENT,
     "needs dtype, shape and data_offsets"},
    {ST_T(",\"__metadata__\":{\"step\":40}"), 0, 24, "t", PSHARD_ERR_INVALID_ARGUMENT,
     "__metadata__: expected an object of strings"},
    {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24],\"x\":1}}", 0, 24, "t",
     PSHARD_ERR_INVALID_ARGUMENT, "unknown key \"x\""},
    {"", 0, 0, "t", PSHARD_ERR_INVALID_ARGUMENT, "header: line 1, column 0"},
    {ST_T(",\"t\":{}"), 0, 24, "t", PSHARD_ERR_INVALID_ARGUMENT, "duplicate object key"},
    {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24.0]}}", 0, 24, "t",
     PSHARD_ERR_INVALID_ARGUMENT, "expected [begin, end]"},
    {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2.0,3],\"data_offsets\":[0,24]}}", 0, 24, "t",
     PSHARD_ERR_INVALID_ARGUMENT, "sizes must be integers"},
};

static void test_safetensors_malformed(void)
{
    char root[64], path[200], err[1024];
    make_tmpdir(root, sizeof(root));
    snprintf(path, sizeof(path), "%s/x.safetensors", root);
    const int64_t shape[] = {2, 3};
    float out[6];
    int failures = 0;
    for (size_t i = 0; i < sizeof(bad_sts) / sizeof(bad_sts[0]); i++) {
        const bad_st_t *c = &bad_sts[i];
        write_st(path, c->header, c->hlen, c->data_len);
        err[0] = '\0';
        pshard_status_t rc = ps_safetensors_read(path, c->name, 2, shape, out, err, sizeof(err));
        if (rc != c->want || !strstr(err, c->expect) || !strstr(err, path)) {
            fprintf(stderr, "\n  case %zu: want %s with \"%s\", got %s: %s\n", i,
                    pshard_status_name(c->want), c->expect, pshard_status_name(rc), err);
            failures++;
        }
    }
    CU_ASSERT_EQUAL(failures, 0);
    /* Too short for the length itself. */
    write_text(path, "abc", 3);
    CU_ASSERT_EQUAL(ps_safetensors_read(path, "t", 2, shape, out, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    /* The valid base reads, F16 and BF16 convert, spaces after the header are fine. */
    write_st(path, ST_T("") "      ", 0, 24);
    CU_ASSERT_EQUAL(ps_safetensors_read(path, "t", 2, shape, out, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT(out[0] == 0.5f && out[5] == 5.5f);
    FILE *f = fopen(path, "wb");
    const char hdr[] = "{\"h\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]},"
                       "\"b\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[4,6]}}";
    uint64_t hl = strlen(hdr);
    fwrite(&hl, 8, 1, f);
    fwrite(hdr, 1, hl, f);
    const uint16_t data[] = {0x3C00 /* 1.0 */, 0xC000 /* -2.0 */, 0x4049 /* 3.140625 */};
    fwrite(data, 2, 3, f);
    fclose(f);
    int64_t s2[] = {2}, s1[] = {1};
    CU_ASSERT_EQUAL(ps_safetensors_read(path, "h", 1, s2, out, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT(out[0] == 1.0f && out[1] == -2.0f);
    CU_ASSERT_EQUAL(ps_safetensors_read(path, "b", 1, s1, out, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT(out[0] == 3.140625f);
    rm_rf(root);
}

/* ---- JSON details not covered above ------------------------------------------------------- */

/* ckpt_json_load is jansson with duplicate keys refused: integers stay integers (to INT64's
 * limits), reals stay reals, escapes decode; anything not strict JSON is refused with where. */
static void test_json_load(void)
{
    json_t *d = NULL;
    char err[256] = "";
    const char text[] = " {\"a\\u00e9\\ud83d\\ude00\\n\": [1, -0, 9223372036854775807, "
                        "-9223372036854775808, 1.0, 1.5e3, true, false, null, "
                        "\"\\\"\\\\\\/\\b\\f\\r\\t\"]} ";
    CU_ASSERT_EQUAL_FATAL(ckpt_json_load(text, strlen(text), &d, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL_FATAL(json_object_size(d), 1);
    const json_t *arr = json_object_get(d, "a\xc3\xa9\xf0\x9f\x98\x80\n");
    CU_ASSERT_EQUAL_FATAL(json_array_size(arr), 10);
    const json_t *e[10];
    for (size_t i = 0; i < 10; i++)
        e[i] = json_array_get(arr, i);
    CU_ASSERT(json_is_integer(e[0]) && json_integer_value(e[0]) == 1);
    CU_ASSERT(json_is_integer(e[1]) && json_integer_value(e[1]) == 0);
    CU_ASSERT(json_is_integer(e[2]) && json_integer_value(e[2]) == INT64_MAX);
    CU_ASSERT(json_is_integer(e[3]) && json_integer_value(e[3]) == INT64_MIN);
    CU_ASSERT(json_is_real(e[4]) && json_real_value(e[4]) == 1.0); /* not an integer */
    CU_ASSERT(json_is_real(e[5]) && json_real_value(e[5]) == 1500.0);
    CU_ASSERT(json_is_true(e[6]) && json_is_false(e[7]) && json_is_null(e[8]));
    CU_ASSERT_STRING_EQUAL(json_string_value(e[9]), "\"\\/\b\f\r\t");
    CU_ASSERT_STRING_EQUAL(ckpt_json_type_name(e[4]), "a real number");
    json_decref(d);
    static const char *const bad[] = {"[1 2]",
                                      "{\"a\" 1}",
                                      "[1,]",
                                      "[01]",
                                      "[1.]",
                                      "[1e]",
                                      "[-]",
                                      "[\"a]",
                                      "[\"\\x\"]",
                                      "[tru]",
                                      "[nul]",
                                      "{1:2}",
                                      "[1e400]",
                                      "[\"\x01\"]",
                                      "\xef\xbb\xbf{}",
                                      "[9223372036854775808]",
                                      "[\"\\u0000\"]",
                                      "[\"\\ud800\"]",
                                      "[\"\xc3\x28\"]",
                                      "{} x",
                                      "",
                                      "1"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        err[0] = '\0';
        d = NULL;
        pshard_status_t rc = ckpt_json_load(bad[i], strlen(bad[i]), &d, err, sizeof(err));
        if (rc != PSHARD_ERR_INVALID_ARGUMENT)
            fprintf(stderr, "\n  %s was accepted\n", bad[i]);
        CU_ASSERT_EQUAL(rc, PSHARD_ERR_INVALID_ARGUMENT);
        CU_ASSERT_PTR_NULL(d);
        CU_ASSERT(strncmp(err, "line 1, column ", 15) == 0);
        json_decref(d);
    }
    /* A large object's repeated name is found too. */
    char big[2048] = "{";
    for (int i = 0; i < 100; i++)
        snprintf(big + strlen(big), sizeof(big) - strlen(big), "%s\"k%d\": %d", i ? ", " : "",
                 i == 77 ? 3 : i, i);
    snprintf(big + strlen(big), sizeof(big) - strlen(big), "}");
    err[0] = '\0';
    CU_ASSERT_EQUAL(ckpt_json_load(big, strlen(big), &d, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT(strstr(err, "duplicate object key near '\"k3\"'") != NULL);
    /* What the writers rely on: control characters escaped and doubles written with 17
     * digits read back exactly; text that is not UTF-8 cannot be written at all. */
    json_t *w = json_pack("[s, f]", "q\"\\\x01\n\t\xc3\xa9", 0.1);
    char *out = json_dumps(w, JSON_INDENT(0) | JSON_REAL_PRECISION(17));
    CU_ASSERT_STRING_EQUAL(out, "[\"q\\\"\\\\\\u0001\\n\\t\xc3\xa9\", 0.10000000000000001]");
    CU_ASSERT_EQUAL_FATAL(ckpt_json_load(out, strlen(out), &d, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT(json_equal(d, w));
    CU_ASSERT(json_real_value(json_array_get(d, 1)) == 0.1);
    json_decref(d);
    json_decref(w);
    free(out);
    CU_ASSERT(ckpt_utf8_valid("\xc3\xa9", 2));
    CU_ASSERT(!ckpt_utf8_valid("\xc3\x28", 2));
    CU_ASSERT(!ckpt_utf8_valid("\xed\xa0\x80", 3)); /* a surrogate */
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"crc32c known vectors", test_crc_vectors},
        {"crc32c instruction agrees with the table code", test_crc_hw_sw_agree},
        {"crc32c throughput", test_crc_throughput},
        {"step directory and shard names", test_names},
        {"JSON: strict loading over jansson", test_json_load},
        {"manifest write -> read round trip", test_manifest_roundtrip},
        {"malformed manifests are refused with their JSON path", test_manifest_malformed},
        {"manifest write errors name the path", test_manifest_write_errors},
        {"manifest write on a full file system", test_manifest_write_enospc},
        {"verify_file: flipped byte, truncation, missing", test_verify_file},
        {"read_range across files: fsdp2 rows and fsdp1 flat", test_read_range_layouts},
        {"read_range: scattered pieces out of order", test_read_range_scattered},
        {"list and prune", test_list_and_prune},
        {"links inside the root are never followed", test_root_links},
        {"prune removes only what pshard writes", test_prune_foreign_files},
        {"a FIFO as manifest, shard or safetensors file is refused", test_fifo_refused},
        {"safetensors export fp32 and bf16", test_safetensors_export},
        {"malformed safetensors files", test_safetensors_malformed},
        {NULL, NULL},
    };
    return ps_test_main("ckpt", cases);
}
