/* ckpt_synth: writes a synthetic pshard checkpoint with the checkpoint library and the real
 * layout math, for the offline pshardctl tests: ROOT/step-STEP with one shard file per rank
 * holding pseudo-random fp32 values (seeded by the step; varied magnitudes and signs, some
 * bf16 rounding ties) in every section, and a committed manifest.
 * usage: ckpt_synth ROOT STEP WORLD fsdp1|fsdp2 NSECTIONS */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "pshard/ckpt.h"
#include "pshard/layout.h"
#include "pshard/util.h"

typedef struct {
    const char *name;
    int ndim;
    int64_t shape[8];
} synth_param_t;

/* Names exercise JSON escaping in the manifest and the safetensors header. */
static const synth_param_t synth_model[] = {
    {"embed.weight", 2, {13, 8}},
    {"layers.0.attn.\"q\".weight", 2, {8, 8}},
    {"layers.0.norm.\xc3\xa9", 1, {8}},
    {"layers.0.mlp\\w1", 3, {3, 4, 2}},
    {"head.weight", 2, {5, 8}},
    {"head.bias", 1, {5}},
    {"one", 1, {1}},
};
#define SYNTH_NPARAMS (sizeof(synth_model) / sizeof(synth_model[0]))

static uint64_t rng;

static uint32_t next_u32(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}

/* A finite float: mostly random bits with a moderate exponent, sometimes a bf16 tie
 * (low 16 bits exactly 0x8000), zero, or negative zero. */
static float next_value(void)
{
    uint32_t r = next_u32(), kind = r % 16, bits;
    if (kind == 0)
        bits = 0;
    else if (kind == 1)
        bits = 0x80000000u;
    else if (kind == 2)
        bits = (next_u32() & 0x3fff0000u) | 0x8000u | ((r & 1u) << 31) | 0x3c000000u;
    else
        bits = (next_u32() & 0x807fffffu) | ((uint32_t)(100 + r % 60) << 23);
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: ckpt_synth ROOT STEP WORLD fsdp1|fsdp2 NSECTIONS\n");
        return 2;
    }
    const char *root = argv[1];
    int64_t step, world, nsec;
    if (ps_parse_i64(argv[2], 0, INT64_MAX, &step) != 0 ||
        ps_parse_i64(argv[3], 1, 4096, &world) != 0 ||
        ps_parse_i64(argv[5], 1, PS_CKPT_MAX_SECTIONS, &nsec) != 0 ||
        (strcmp(argv[4], "fsdp1") != 0 && strcmp(argv[4], "fsdp2") != 0)) {
        fprintf(stderr, "ckpt_synth: bad arguments\n");
        return 2;
    }
    pshard_layout_t kind =
        strcmp(argv[4], "fsdp1") == 0 ? PSHARD_LAYOUT_FSDP1 : PSHARD_LAYOUT_FSDP2;
    size_t numel[SYNTH_NPARAMS], rows[SYNTH_NPARAMS];
    for (size_t p = 0; p < SYNTH_NPARAMS; p++) {
        numel[p] = 1;
        for (int d = 0; d < synth_model[p].ndim; d++)
            numel[p] *= (size_t)synth_model[p].shape[d];
        rows[p] = (size_t)synth_model[p].shape[0];
    }
    char err[1024] = "", dir[4096];
    ps_layout_t *layout = NULL;
    if (ps_layout_create(kind, (int)world, SYNTH_NPARAMS, numel, rows, &layout, err, sizeof(err)) !=
        PSHARD_OK) {
        fprintf(stderr, "ckpt_synth: %s\n", err);
        return 1;
    }
    ps_ckpt_step_dir(root, step, dir, sizeof(dir));
    if ((mkdir(root, 0755) != 0 && errno != EEXIST) || (mkdir(dir, 0755) != 0 && errno != EEXIST)) {
        perror("ckpt_synth: mkdir");
        return 1;
    }
    /* The full parameters first (so values do not depend on the world size), then slices. */
    rng = 0x9E3779B97F4A7C15ull ^ (uint64_t)step * 0x100000001B3ull;
    float *full[PS_CKPT_MAX_SECTIONS][SYNTH_NPARAMS];
    for (int k = 0; k < nsec; k++)
        for (size_t p = 0; p < SYNTH_NPARAMS; p++) {
            full[k][p] = malloc(numel[p] * sizeof(float));
            for (size_t i = 0; i < numel[p]; i++)
                full[k][p][i] = next_value();
        }
    ps_ckpt_manifest_t m = {
        .step = step, .world_size = (int)world, .layout = kind, .nsections = (int)nsec};
    snprintf(m.optim.kind, sizeof(m.optim.kind), "%s", nsec == 3 ? "adam" : "sgd");
    m.optim.lr = 0.001;
    m.optim.momentum = nsec == 2 ? 0.9 : 0;
    m.optim.beta1 = 0.9;
    m.optim.beta2 = 0.999;
    m.optim.eps = 1e-8;
    static const char *const names3[] = {"master", "exp_avg", "exp_avg_sq"};
    for (int k = 0; k < nsec; k++)
        snprintf(m.sections[k], sizeof(m.sections[k]), "%s",
                 nsec == 2 && k == 1 ? "momentum_buffer" : names3[k]);
    ps_ckpt_param_t params[SYNTH_NPARAMS];
    memset(params, 0, sizeof(params));
    for (size_t p = 0; p < SYNTH_NPARAMS; p++) {
        snprintf(params[p].name, sizeof(params[p].name), "%s", synth_model[p].name);
        params[p].ndim = synth_model[p].ndim;
        memcpy(params[p].shape, synth_model[p].shape, sizeof(params[p].shape));
    }
    m.nparams = SYNTH_NPARAMS;
    m.params = params;
    m.nfiles = (size_t)world;
    m.files = calloc((size_t)world, sizeof(*m.files));
    for (int r = 0; r < world; r++) {
        ps_ckpt_file_t *f = &m.files[r];
        f->rank = r;
        ps_ckpt_shard_name(r, (int)world, f->path, sizeof(f->path));
        f->shard_numel = ps_layout_shard_numel(layout, r);
        f->bytes = (uint64_t)nsec * f->shard_numel * sizeof(float);
        f->pieces = calloc(SYNTH_NPARAMS, sizeof(*f->pieces));
        float *buf = calloc((size_t)nsec * f->shard_numel + 1, sizeof(float));
        for (size_t p = 0; p < SYNTH_NPARAMS; p++) {
            size_t cnt = ps_layout_counts(layout, p)[r];
            if (cnt == 0)
                continue;
            size_t start = ps_layout_piece_offset(layout, p, r);
            size_t off = ps_layout_shard_offset(layout, p, r);
            f->pieces[f->npieces++] = (ps_ckpt_piece_t){(uint32_t)p, start, cnt, off};
            for (int k = 0; k < nsec; k++)
                memcpy(buf + (size_t)k * f->shard_numel + off, full[k][p] + start,
                       cnt * sizeof(float));
        }
        char path[4400];
        snprintf(path, sizeof(path), "%s/%s", dir, f->path);
        FILE *out = fopen(path, "wb");
        if (!out || fwrite(buf, 1, f->bytes, out) != f->bytes || fclose(out) != 0) {
            perror(path);
            return 1;
        }
        f->crc32c = ps_crc32c(0, buf, f->bytes);
        free(buf);
    }
    if (ps_ckpt_manifest_write(dir, &m, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "ckpt_synth: %s\n", err);
        return 1;
    }
    printf("%s\n", dir);
    for (int r = 0; r < world; r++)
        free(m.files[r].pieces);
    free(m.files);
    for (int k = 0; k < nsec; k++)
        for (size_t p = 0; p < SYNTH_NPARAMS; p++)
            free(full[k][p]);
    ps_layout_destroy(layout);
    return 0;
}
