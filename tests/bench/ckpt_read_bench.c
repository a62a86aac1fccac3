/* pshard-ckpt-read-bench: how long a resharded load spends finding and reading its byte ranges
 * in a checkpoint of many parameters. Writes a synthetic checkpoint (fsdp2, WORLD files,
 * PARAMS parameters of 16..22 x 8 elements, sparse shard files, so reads hit the page cache or
 * holes) under DIR, reads its manifest, then times ps_ckpt_read_range for every piece that
 * rank 1 of 3 owns after resharding, as shard_ckpt_load does.
 * usage: pshard-ckpt-read-bench DIR [PARAMS (20000)] [WORLD (8)] */
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/ckpt.h"
#include "pshard/layout.h"
#include "pshard/util.h"

#define COLS 8

static int fail(const char *what, const char *err)
{
    fprintf(stderr, "pshard-ckpt-read-bench: %s: %s\n", what, err);
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR [PARAMS] [WORLD]\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    size_t nparams = argc > 2 ? strtoul(argv[2], NULL, 10) : 20000;
    int world = argc > 3 ? atoi(argv[3]) : 8, to_world = 3;
    if (nparams < 1 || nparams > 100000 || world < 1 || world > 64)
        return fail("arguments", "PARAMS must be 1..100000 and WORLD 1..64");
    char err[512] = "";
    size_t *numel = calloc(nparams, sizeof(size_t)), *rows = calloc(nparams, sizeof(size_t));
    ps_ckpt_param_t *params = calloc(nparams, sizeof(*params));
    ps_ckpt_file_t *files = calloc((size_t)world, sizeof(*files));
    if (!numel || !rows || !params || !files)
        return fail("memory", "out of memory");
    for (size_t p = 0; p < nparams; p++) {
        rows[p] = 16 + p % 7;
        numel[p] = rows[p] * COLS;
        snprintf(params[p].name, sizeof(params[p].name), "layers.%zu.weight", p);
        params[p].ndim = 2;
        params[p].shape[0] = (int64_t)rows[p];
        params[p].shape[1] = COLS;
    }
    ps_layout_t *from = NULL, *to = NULL;
    if (ps_layout_create(PSHARD_LAYOUT_FSDP2, world, nparams, numel, rows, &from, err,
                         sizeof(err)) != PSHARD_OK ||
        ps_layout_create(PSHARD_LAYOUT_FSDP2, to_world, nparams, numel, rows, &to, err,
                         sizeof(err)) != PSHARD_OK)
        return fail("layout", err);
    mkdir(dir, 0755);
    for (int r = 0; r < world; r++) {
        ps_ckpt_file_t *f = &files[r];
        f->rank = r;
        ps_ckpt_shard_name(r, world, f->path, sizeof(f->path));
        f->shard_numel = ps_layout_shard_numel(from, r);
        f->bytes = f->shard_numel * sizeof(float);
        f->pieces = calloc(nparams, sizeof(ps_ckpt_piece_t));
        if (!f->pieces)
            return fail("memory", "out of memory");
        for (size_t p = 0; p < nparams; p++) {
            size_t cnt = ps_layout_counts(from, p)[r];
            if (cnt == 0)
                continue;
            ps_ckpt_piece_t *pc = &f->pieces[f->npieces++];
            pc->param = (uint32_t)p;
            pc->start = ps_layout_piece_offset(from, p, r);
            pc->count = cnt;
            pc->offset = ps_layout_shard_offset(from, p, r);
        }
        char path[PATH_MAX];
        snprintf(path, sizeof(path), "%s/%s", dir, f->path);
        int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0644);
        if (fd < 0 || ftruncate(fd, (off_t)f->bytes) != 0)
            return fail("creating shard files", path);
        close(fd);
    }
    ps_ckpt_manifest_t m = {.step = 1,
                            .world_size = world,
                            .layout = PSHARD_LAYOUT_FSDP2,
                            .nsections = 1,
                            .nparams = nparams,
                            .params = params,
                            .nfiles = (size_t)world,
                            .files = files};
    strcpy(m.optim.kind, "sgd");
    strcpy(m.sections[0], "master");
    if (ps_ckpt_manifest_write(dir, &m, err, sizeof(err)) != PSHARD_OK)
        return fail("writing the manifest", err);
    int64_t t0 = ps_now_ns();
    ps_ckpt_manifest_t *read = NULL;
    if (ps_ckpt_manifest_read(dir, &read, err, sizeof(err)) != PSHARD_OK)
        return fail("reading the manifest", err);
    int64_t t1 = ps_now_ns();
    float *buf = malloc(32 * COLS * sizeof(float));
    size_t reads = 0;
    for (size_t p = 0; p < nparams; p++) {
        size_t cnt = ps_layout_counts(to, p)[1];
        if (cnt == 0)
            continue;
        if (ps_ckpt_read_range(dir, read, 0, (uint32_t)p, ps_layout_piece_offset(to, p, 1), cnt,
                               buf, err, sizeof(err)) != PSHARD_OK)
            return fail("reading", err);
        reads++;
    }
    int64_t t2 = ps_now_ns();
    printf("%zu parameters in %d files: manifest read %.3f s; rank 1 of %d read its %zu pieces "
           "in %.3f s\n",
           nparams, world, (double)(t1 - t0) / 1e9, to_world, reads, (double)(t2 - t1) / 1e9);
    ps_ckpt_manifest_free(read);
    for (int r = 0; r < world; r++)
        free(files[r].pieces);
    free(files);
    free(params);
    free(numel);
    free(rows);
    free(buf);
    ps_layout_destroy(from);
    ps_layout_destroy(to);
    return 0;
}
