/* The shard server's shard as the trainer's shared memory (pshard_shard_view) and the step a
 * trainer's own optimizer takes (pshard_step_trainer), end to end: a real coordinator, real
 * shard servers and trainers (this program run again as "trainer ..."). Each trainer checks its
 * views against the initial values' rows (an uneven shape whose last rank owns no rows, both
 * layouts, an HSDP mesh), writes new masters through them and checks every rank gathers them,
 * checks a reduce-scatter's average in the view's accumulator, that a trainer step only counts
 * the step, that it fails on every active rank naming a rank that joined, that GPU-resident
 * shards (emulated) pass the same checks through their device handle, and that remote trainers
 * are refused with the reason. The driver checks each server's objects in /dev/shm: one per
 * server while the model lives (two for GPU-resident shards; a redefinition removed the
 * first model's), none after the servers stop, and that a starting server removes a dead server's
 * leftover but no link and no other name. argv: pshard-coordinator pshard-server. */
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ps_proc.h"
#include "ps_test.h"
#include "pshard/pshard.h"
#include "pshard/util.h"

static const char *coord_bin, *server_bin, *self_bin;

/* ---- the trainer ------------------------------------------------------------------------- */

#define NP 3
static const char *names[NP] = {"w", "b", "v"};
static int64_t shape_w[2] = {5, 3}, shape_b[1] = {2}, shape_v[2] = {7, 2};
static int64_t *shapes[NP] = {shape_w, shape_b, shape_v};
static const int ndims[NP] = {2, 1, 2};

static size_t numel_of(int p)
{
    size_t n = 1;
    for (int d = 0; d < ndims[p]; d++)
        n *= (size_t)shapes[p][d];
    return n;
}

static float init_value(int p, size_t j)
{
    return (float)(p * 100) + 0.5f * (float)j + 1.0f;
}

static float new_value(int p, size_t j)
{
    return -(float)j - 1000.0f * (float)p;
}

/* Where parameter p's piece on shard rank r of S lies in the flattened parameter, computed
 * here from the layouts' definitions (not with layout.h). */
static void expected_piece(bool fsdp1, int p, int r, int S, size_t *offset, size_t *numel)
{
    if (!fsdp1) {
        size_t rows = (size_t)shapes[p][0], row = numel_of(p) / rows;
        size_t chunk = (rows + (size_t)S - 1) / (size_t)S;
        size_t lo = (size_t)r * chunk < rows ? (size_t)r * chunk : rows;
        size_t hi = (size_t)(r + 1) * chunk < rows ? (size_t)(r + 1) * chunk : rows;
        *offset = lo * row;
        *numel = (hi - lo) * row;
        return;
    }
    size_t total = 0, start = 0;
    for (int q = 0; q < NP; q++) {
        if (q == p)
            start = total;
        total += numel_of(q);
    }
    size_t per = (total + (size_t)S - 1) / (size_t)S;
    size_t lo = (size_t)r * per, hi = lo + per;
    size_t a = lo > start ? lo : start, b = hi < start + numel_of(p) ? hi : start + numel_of(p);
    *offset = b > a ? a - start : 0;
    *numel = b > a ? b - a : 0;
}

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "rank %d: ", rank);                                                    \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__);                                     \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* trainer SERVER RANK WORLD CASE LAYOUT SHARDS: CASE basic, join, refused (not shared). */
static int trainer_main(int argc, char **argv)
{
    if (argc < 8)
        return 2;
    int rank = (int)strtol(argv[3], NULL, 10), world = (int)strtol(argv[4], NULL, 10);
    const char *mode = argv[5];
    bool fsdp1 = strcmp(argv[6], "fsdp1") == 0;
    int S = (int)strtol(argv[7], NULL, 10);
    const char *remote = getenv("PSHARD_REMOTE");
    pshard_client_config_t cfg = {.server = argv[2],
                                  .rank = rank,
                                  .world_size = world,
                                  .connect_timeout_ms = 30000,
                                  .timeout_ms = 30000,
                                  .remote = remote && strcmp(remote, "1") == 0};
    pshard_client_t *c = NULL;
    char err[1024] = "";
    CHECK(pshard_connect(&cfg, &c, err, sizeof(err)) == PSHARD_OK, "connect: %s", err);
    pshard_shard_view_t v;
    CHECK(pshard_shard_view(c, 0, &v) == PSHARD_ERR_FAILED_PRECONDITION &&
              strstr(pshard_last_error(c), "pshard_define_model"),
          "a view before any model: %s", pshard_last_error(c));

    float *init[NP];
    pshard_param_t params[NP];
    for (int p = 0; p < NP; p++) {
        init[p] = malloc(numel_of(p) * sizeof(float));
        for (size_t j = 0; j < numel_of(p); j++)
            init[p][j] = init_value(p, j);
        params[p] = (pshard_param_t){.name = names[p], .shape = shapes[p], .ndim = ndims[p]};
    }
    pshard_model_config_t mc;
    pshard_model_config_default(&mc, PSHARD_SGD);
    mc.layout = fsdp1 ? PSHARD_LAYOUT_FSDP1 : PSHARD_LAYOUT_FSDP2;
    mc.lr = 0.1;
    if (S != world) {
        mc.replicate = world / S;
        mc.shard = S;
    }
    bool in_backward = strcmp(mode, "in_backward") == 0;
    mc.optimizer_in_backward = in_backward;
    /* The model region in the server's (emulated) GPU memory when it keeps the shards there. */
    const char *dr = getenv("PSHARD_TEST_DEVICE_REGION");
    mc.device_region = dr && strcmp(dr, "1") == 0;
    const char *emu = getenv("PSHARD_TEST_EMULATE_DEVICE");
    bool on_dev = emu && strcmp(emu, "1") == 0;
    /* A first model, replaced at once: its server object must go with it. */
    CHECK(pshard_define_model(c, params, 1, &mc, (const float *const *)init) == PSHARD_OK,
          "define (first): %s", pshard_last_error(c));
    CHECK(pshard_define_model(c, params, NP, &mc, (const float *const *)init) == PSHARD_OK,
          "define: %s", pshard_last_error(c));
    for (int p = 0; p < NP; p++)
        free(init[p]);
    int srank = rank % S;
    int rdev = -2, rmem = pshard_region_memory(c, &rdev);
    bool region_dev = mc.device_region && on_dev && !cfg.remote;
    CHECK(region_dev ? rmem == PSHARD_MEMORY_EMULATED && rdev == 0
                     : rmem == PSHARD_MEMORY_HOST && rdev == -1,
          "the model region is in memory %d of device %d (device_region %d)", rmem, rdev,
          (int)mc.device_region);

    if (strcmp(mode, "refused") == 0) {
        pshard_status_t st = pshard_shard_view(c, 0, &v);
        const char *want = "remote";
        CHECK(st == PSHARD_ERR_FAILED_PRECONDITION && strstr(pshard_last_error(c), want) &&
                  strstr(pshard_last_error(c), "pshard_step"),
              "a view that cannot be: %s (%s)", pshard_status_name(st), pshard_last_error(c));
        pshard_close(c);
        return 0;
    }

    CHECK(pshard_shard_view(c, NP, &v) == PSHARD_ERR_INVALID_ARGUMENT, "a bad index: %s",
          pshard_last_error(c));
    if (in_backward) {
        /* No accumulator: the masters only; and no trainer step (it would update twice). */
        for (int p = 0; p < NP; p++) {
            CHECK(pshard_shard_view(c, (size_t)p, &v) == PSHARD_OK, "view: %s",
                  pshard_last_error(c));
            CHECK(v.grad == NULL, "'%s' has an accumulator in backward mode", names[p]);
            for (size_t k = 0; k < v.numel; k++)
                CHECK(v.master[k] == init_value(p, v.offset + k), "'%s'[%zu] is %g", names[p],
                      v.offset + k, v.master[k]);
        }
        pshard_status_t st = pshard_step_trainer(c, NULL);
        CHECK(st == PSHARD_ERR_FAILED_PRECONDITION &&
                  strstr(pshard_last_error(c), "optimizer_in_backward"),
              "a trainer step in backward mode: %s (%s)", pshard_status_name(st),
              pshard_last_error(c));
        pshard_close(c);
        return 0;
    }
    /* The views hold the initial values' pieces, and zero gradients; GPU-resident shards
     * (emulated: PSHARD_TEST_EMULATE_DEVICE=1) are opened through the device's handle. */
    for (int p = 0; p < NP; p++) {
        CHECK(pshard_shard_view(c, (size_t)p, &v) == PSHARD_OK, "view %d: %s", p,
              pshard_last_error(c));
        CHECK(on_dev ? v.memory == PSHARD_MEMORY_EMULATED && v.device == 0
                     : v.memory == PSHARD_MEMORY_HOST && v.device == -1,
              "'%s' is in memory %d of device %d", names[p], v.memory, v.device);
        size_t off, n;
        expected_piece(fsdp1, p, srank, S, &off, &n);
        CHECK(v.numel == n && (n == 0 || v.offset == off),
              "'%s': the view has %zu elements at %zu; shard rank %d of %d owns %zu at %zu",
              names[p], v.numel, v.offset, srank, S, n, off);
        CHECK(v.grad != NULL, "'%s' has no accumulator", names[p]);
        for (size_t k = 0; k < v.numel; k++) {
            CHECK(v.master[k] == init_value(p, off + k), "'%s'[%zu] is %g, not %g", names[p],
                  off + k, v.master[k], init_value(p, off + k));
            CHECK(v.grad[k] == 0.0f, "'%s' grad[%zu] is %g", names[p], off + k, v.grad[k]);
        }
    }
    if (!fsdp1 && S == 3)
        CHECK(pshard_shard_view(c, 1, &v) == PSHARD_OK && (srank < 2 ? v.numel == 1 : v.numel == 0),
              "'b' on shard rank %d has %zu elements", srank, v.numel);

    /* New masters written through the views are what every rank gathers. */
    for (int p = 0; p < NP; p++) {
        CHECK(pshard_shard_view(c, (size_t)p, &v) == PSHARD_OK, "view: %s", pshard_last_error(c));
        for (size_t k = 0; k < v.numel; k++)
            v.master[k] = new_value(p, v.offset + k);
    }
    CHECK(pshard_gather(c, NULL, 0) == PSHARD_OK, "gather: %s", pshard_last_error(c));
    for (int p = 0; p < NP; p++) {
        const float *full = pshard_param(c, (size_t)p);
        CHECK(full, "'%s' is not gathered", names[p]);
        for (size_t j = 0; j < numel_of(p); j++)
            CHECK(full[j] == new_value(p, j), "gathered '%s'[%zu] is %g, written %g", names[p], j,
                  full[j], new_value(p, j));
    }
    CHECK(pshard_reshard(c, NULL, 0) == PSHARD_OK, "reshard: %s", pshard_last_error(c));

    /* A reduce-scatter's average lands in the view's accumulator: rank q sends (q+1)(j+1). */
    for (int p = 0; p < NP; p++) {
        float *g = pshard_grad(c, (size_t)p);
        CHECK(g, "grad buffer: %s", pshard_last_error(c));
        for (size_t j = 0; j < numel_of(p); j++) {
            CHECK(g[j] == 0.0f, "a new gradient buffer of '%s' holds %g at %zu", names[p], g[j], j);
            g[j] = (float)(rank + 1) * (float)(j + 1);
        }
    }
    CHECK(pshard_reduce_scatter(c, NULL, 0) == PSHARD_OK, "reduce_scatter: %s",
          pshard_last_error(c));
    float *snap[NP][2];
    for (int p = 0; p < NP; p++) {
        CHECK(pshard_shard_view(c, (size_t)p, &v) == PSHARD_OK, "view: %s", pshard_last_error(c));
        for (size_t k = 0; k < v.numel; k++) {
            float want = (float)(v.offset + k + 1) * (float)(world + 1) / 2.0f;
            CHECK(fabsf(v.grad[k] - want) <= 1e-5f * fabsf(want), "'%s' grad[%zu] is %g, not %g",
                  names[p], v.offset + k, v.grad[k], want);
        }
        snap[p][0] = malloc((v.numel + 1) * sizeof(float));
        snap[p][1] = malloc((v.numel + 1) * sizeof(float));
        memcpy(snap[p][0], v.master, v.numel * sizeof(float));
        memcpy(snap[p][1], v.grad, v.numel * sizeof(float));
    }

    if (strcmp(mode, "join") == 0) {
        /* The last rank joins; the others' trainer step fails naming it, on every one of them. */
        pshard_join_options_t jo;
        pshard_join_options_default(&jo);
        if (rank == world - 1) {
            CHECK(pshard_join(c, &jo, NULL) == PSHARD_OK, "join: %s", pshard_last_error(c));
        } else {
            pshard_status_t st = pshard_step_trainer(c, NULL);
            char want[64];
            snprintf(want, sizeof(want), "rank %d joined", world - 1);
            CHECK(st == PSHARD_ERR_FAILED_PRECONDITION && strstr(pshard_last_error(c), want) &&
                      strstr(pshard_last_error(c), "throw_on_early_termination"),
                  "a trainer step with rank %d joined: %s (%s)", world - 1, pshard_status_name(st),
                  pshard_last_error(c));
            CHECK(pshard_join(c, &jo, NULL) == PSHARD_OK, "join: %s", pshard_last_error(c));
        }
    } else {
        /* A trainer step counts the step and changes neither masters nor accumulators. */
        int64_t step = -1;
        CHECK(pshard_step_trainer(c, &step) == PSHARD_OK, "step_trainer: %s", pshard_last_error(c));
        CHECK(step == 1, "the trainer step is step %lld, not 1", (long long)step);
        CHECK(pshard_step_trainer(c, &step) == PSHARD_OK && step == 2, "second step: %s",
              pshard_last_error(c));
        /* A restored count (a loaded optimizer state) goes on from there, changing nothing. */
        CHECK(pshard_set_step(c, -1) == PSHARD_ERR_INVALID_ARGUMENT, "a negative count: %s",
              pshard_last_error(c));
        CHECK(pshard_set_step(c, 7) == PSHARD_OK, "set_step: %s", pshard_last_error(c));
        CHECK(pshard_step_trainer(c, &step) == PSHARD_OK && step == 8,
              "the step after set_step(7) is %lld: %s", (long long)step, pshard_last_error(c));
        /* SGD without momentum keeps no optimizer state. */
        CHECK(pshard_shard_view(c, 0, &v) == PSHARD_OK && !v.state0 && !v.state1,
              "SGD without momentum shows optimizer state");
    }
    if (strcmp(mode, "join") != 0 && world > 1) {
        /* A definition the servers refuse (rank 0 names its first parameter otherwise) leaves
         * the model and its shard as they were (a GPU-resident one closed for the attempt and
         * opened again). */
        const char *other[NP];
        for (int p = 0; p < NP; p++)
            other[p] = p == 0 && rank == 0 ? "renamed" : names[p];
        pshard_param_t again[NP];
        float *zeros[NP];
        for (int p = 0; p < NP; p++) {
            again[p] = (pshard_param_t){.name = other[p], .shape = shapes[p], .ndim = ndims[p]};
            zeros[p] = calloc(numel_of(p), sizeof(float));
        }
        pshard_status_t st = pshard_define_model(c, again, NP, &mc, (const float *const *)zeros);
        for (int p = 0; p < NP; p++)
            free(zeros[p]);
        CHECK(st != PSHARD_OK, "a definition that differs on rank 0 was accepted");
    }
    for (int p = 0; p < NP; p++) {
        CHECK(pshard_shard_view(c, (size_t)p, &v) == PSHARD_OK, "view: %s", pshard_last_error(c));
        CHECK(memcmp(snap[p][0], v.master, v.numel * sizeof(float)) == 0,
              "'%s': the masters changed", names[p]);
        CHECK(memcmp(snap[p][1], v.grad, v.numel * sizeof(float)) == 0,
              "'%s': the accumulators changed", names[p]);
        free(snap[p][0]);
        free(snap[p][1]);
    }
    /* And the masters written are still what a gather returns. */
    CHECK(pshard_gather(c, NULL, 0) == PSHARD_OK, "gather: %s", pshard_last_error(c));
    for (int p = 0; p < NP; p++) {
        const float *full = pshard_param(c, (size_t)p);
        for (size_t j = 0; full && j < numel_of(p); j++)
            CHECK(full[j] == new_value(p, j), "gathered '%s'[%zu] is %g after the step", names[p],
                  j, full[j]);
    }
    pshard_close(c);
    return 0;
}

/* ---- the driver -------------------------------------------------------------------------- */

/* How many entries of /dev/shm start with prefix (without the leading '/'). */
static int count_shm(const char *prefix)
{
    DIR *d = opendir("/dev/shm");
    if (!d)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return n;
}

static bool exists_shm(const char *name)
{
    char path[256];
    snprintf(path, sizeof(path), "/dev/shm/%s", name);
    struct stat st;
    return lstat(path, &st) == 0;
}

/* Runs one case: world servers (and trainers) with shard ranks S, mode as the trainer's. */
static bool run_case(int world, int S, const char *layout, const char *mode)
{
    char world_s[16], shards_s[16];
    snprintf(world_s, sizeof(world_s), "%d", world);
    snprintf(shards_s, sizeof(shards_s), "%d", S);
    const char *cargs[] = {"--world-size", world_s, NULL};
    char target[64];
    pid_t coord = ps_proc_start_coordinator(coord_bin, cargs, target, sizeof(target));
    if (coord < 0)
        return false;
    char dir[] = "/tmp/pshard-view-XXXXXX";
    if (!mkdtemp(dir))
        return false;
    pid_t servers[8], trainers[8];
    char addr[8][64];
    bool ok = true;
    for (int r = 0; r < world; r++) {
        char name[32], port_file[128], log[128];
        snprintf(name, sizeof(name), "srv-%d", r);
        snprintf(port_file, sizeof(port_file), "%s/server-%d.port", dir, r);
        snprintf(log, sizeof(log), "%s/server-%d.log", dir, r);
        char *argv[] = {
            (char *)server_bin, "--coordinator",     target,  "--name", name, "--port-file",
            port_file,          "--coll-timeout-ms", "30000", NULL};
        servers[r] = ps_proc_spawn(argv, log);
    }
    for (int r = 0; r < world; r++) {
        char port_file[128];
        snprintf(port_file, sizeof(port_file), "%s/server-%d.port", dir, r);
        int port = ps_proc_wait_port_file(port_file, servers[r], 10000);
        if (port < 0) {
            fprintf(stderr, "server %d did not start (log in %s)\n", r, dir);
            ok = false;
        }
        snprintf(addr[r], sizeof(addr[r]), "127.0.0.1:%d", port);
    }
    for (int r = 0; ok && r < world; r++) {
        char rank_s[16];
        snprintf(rank_s, sizeof(rank_s), "%d", r);
        char *argv[] = {(char *)self_bin, "trainer",      addr[r],  rank_s, world_s,
                        (char *)mode,     (char *)layout, shards_s, NULL};
        trainers[r] = ps_proc_spawn(argv, NULL);
    }
    int64_t end = ps_now_ns() + 120 * 1000000000LL;
    for (int r = 0; ok && r < world; r++) {
        int st = 0;
        pid_t got = 0;
        while ((got = waitpid(trainers[r], &st, WNOHANG)) == 0 && ps_now_ns() < end) {
            struct timespec ts = {0, 10 * 1000000};
            nanosleep(&ts, NULL);
        }
        if (got != trainers[r]) {
            fprintf(stderr, "trainer %d hung; killing it\n", r);
            kill(trainers[r], SIGKILL);
            waitpid(trainers[r], &st, 0);
            ok = false;
        } else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "trainer %d failed (status %d); server logs in %s\n", r, st, dir);
            ok = false;
        }
    }
    /* The model is still defined: one object per host-shard server (the first model's went
     * with it), two for (emulated) GPU-resident ones (the step counts, the device memory) and
     * three with the model region there too, none for remote trainers. */
    const char *emu = getenv("PSHARD_TEST_EMULATE_DEVICE");
    const char *dr = getenv("PSHARD_TEST_DEVICE_REGION");
    bool on_dev = emu && strcmp(emu, "1") == 0;
    int want = strcmp(mode, "refused") == 0 ? 0 : on_dev ? (dr && strcmp(dr, "1") == 0 ? 3 : 2) : 1;
    for (int r = 0; ok && r < world; r++) {
        char prefix[64];
        snprintf(prefix, sizeof(prefix), "pshard-srv-%d-", (int)servers[r]);
        int n = count_shm(prefix);
        if (n != want) {
            fprintf(stderr, "server %d has %d objects in /dev/shm, expected %d\n", r, n, want);
            ok = false;
        }
    }
    for (int r = 0; r < world; r++) {
        int code = ps_proc_stop(servers[r], 10000);
        if (code != 0) {
            fprintf(stderr, "server %d exited with %d\n", r, code);
            ok = false;
        }
        char prefix[64];
        snprintf(prefix, sizeof(prefix), "pshard-srv-%d-", (int)servers[r]);
        if (count_shm(prefix) != 0) {
            fprintf(stderr, "server %d left its object in /dev/shm\n", r);
            ok = false;
        }
    }
    ps_proc_stop(coord, 10000);
    if (ok) {
        for (int r = 0; r < world; r++) {
            char path[160];
            snprintf(path, sizeof(path), "%s/server-%d.port", dir, r);
            unlink(path);
            snprintf(path, sizeof(path), "%s/server-%d.log", dir, r);
            unlink(path);
        }
        rmdir(dir);
    }
    return ok;
}

static void test_fsdp2_uneven(void)
{
    CU_ASSERT(run_case(3, 3, "fsdp2", "basic"));
}
static void test_fsdp1(void)
{
    CU_ASSERT(run_case(2, 2, "fsdp1", "basic"));
}
/* HSDP, replicate 2 x shard 2: views over the shard ranks of each replica. */
static void test_hsdp(void)
{
    CU_ASSERT(run_case(4, 2, "fsdp2", "basic"));
}
/* optimizer_in_backward: the masters are shared, there is no accumulator, and a trainer step
 * is refused. */
static void test_in_backward(void)
{
    CU_ASSERT(run_case(2, 2, "fsdp2", "in_backward"));
}
static void test_join_refuses_trainer_step(void)
{
    CU_ASSERT(run_case(3, 3, "fsdp2", "join"));
}
/* GPU-resident shards (the emulated device): opened through the device memory's handle, the
 * same checks as host shards, for FSDP2 and HSDP. */
static void test_device_shards(void)
{
    setenv("PSHARD_TEST_EMULATE_DEVICE", "1", 1);
    CU_ASSERT(run_case(3, 3, "fsdp2", "basic"));
    CU_ASSERT(run_case(4, 2, "fsdp2", "basic"));
    unsetenv("PSHARD_TEST_EMULATE_DEVICE");
}
/* The model region in the servers' (emulated) GPU memory (device_region): the gathers, the
 * gradients (zeroed on the device) and every check above through it, a rank that joined
 * shadowing with host buffers while the others' are device memory, a refused definition that
 * closes and opens it again; with host shards the region stays shared memory. */
static void test_device_region(void)
{
    setenv("PSHARD_TEST_DEVICE_REGION", "1", 1);
    CU_ASSERT(run_case(2, 2, "fsdp2", "basic"));
    setenv("PSHARD_TEST_EMULATE_DEVICE", "1", 1);
    CU_ASSERT(run_case(3, 3, "fsdp2", "basic"));
    CU_ASSERT(run_case(4, 2, "fsdp2", "basic"));
    CU_ASSERT(run_case(3, 3, "fsdp2", "join"));
    unsetenv("PSHARD_TEST_EMULATE_DEVICE");
    unsetenv("PSHARD_TEST_DEVICE_REGION");
}
static void test_not_shared(void)
{
    setenv("PSHARD_REMOTE", "1", 1);
    CU_ASSERT(run_case(2, 2, "fsdp2", "refused"));
    unsetenv("PSHARD_REMOTE");
}

/* The id of this process's PID namespace (as in /proc/self/ns/pid), 0 when unknown. */
static unsigned long long pid_ns(void)
{
    char link[64];
    ssize_t n = readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
    if (n <= 5)
        return 0;
    link[n] = '\0';
    return strtoull(link + 5, NULL, 10);
}

static bool make_shm(const char *name)
{
    char path[96];
    snprintf(path, sizeof(path), "/%s", name);
    int fd = shm_open(path, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
        return false;
    close(fd);
    return true;
}

static void remove_shm(const char *name)
{
    char path[96];
    snprintf(path, sizeof(path), "/%s", name);
    shm_unlink(path);
}

/* A starting server removes a dead server's object of its PID namespace, and neither a link
 * named like one, nor another name, nor one of another PID namespace (whose PIDs it cannot
 * check). */
static void test_sweep(void)
{
    pid_t dead = fork();
    if (dead == 0)
        _exit(0);
    CU_ASSERT_FATAL(dead > 0);
    waitpid(dead, NULL, 0);
    unsigned long long ns = pid_ns();
    char left[80], link_name[80], other[80], foreign[80], link_path[112];
    char target[] = "/tmp/pshard-view-tgtXXXXXX";
    snprintf(left, sizeof(left), "pshard-srv-%d-%llx-0123456789ab", (int)dead, ns);
    snprintf(link_name, sizeof(link_name), "pshard-srv-%d-%llx-00ff", (int)dead, ns);
    snprintf(other, sizeof(other), "pshard-srv-%d-%llx-notours", (int)dead, ns);
    snprintf(foreign, sizeof(foreign), "pshard-srv-%d-%llx-0123456789ab", (int)dead, ns + 1);
    CU_ASSERT_FATAL(make_shm(left) && make_shm(other) && make_shm(foreign));
    int tfd = mkstemp(target);
    CU_ASSERT_FATAL(tfd >= 0);
    close(tfd);
    snprintf(link_path, sizeof(link_path), "/dev/shm/%s", link_name);
    CU_ASSERT_FATAL(symlink(target, link_path) == 0);
    CU_ASSERT(run_case(1, 1, "fsdp2", "basic"));
    CU_ASSERT(!exists_shm(left));
    CU_ASSERT(exists_shm(link_name));
    CU_ASSERT(exists_shm(other));
    CU_ASSERT(exists_shm(foreign));
    struct stat st;
    CU_ASSERT(stat(target, &st) == 0);
    unlink(link_path);
    remove_shm(other);
    remove_shm(foreign);
    remove_shm(left);
    unlink(target);
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "trainer") == 0)
        return trainer_main(argc, argv);
    if (argc < 3) {
        fprintf(stderr, "usage: %s COORDINATOR SERVER\n", argv[0]);
        return 2;
    }
    coord_bin = argv[1];
    server_bin = argv[2];
    self_bin = "/proc/self/exe";
    static char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) {
        self[n] = '\0';
        self_bin = self;
    }
    signal(SIGPIPE, SIG_IGN);
    static const ps_test_case_t cases[] = {
        {"3 ranks, fsdp2, a parameter the last rank owns none of", test_fsdp2_uneven},
        {"2 ranks, fsdp1", test_fsdp1},
        {"HSDP 2 x 2", test_hsdp},
        {"optimizer in backward: masters only, no trainer step", test_in_backward},
        {"a trainer step with a joined rank fails on every rank", test_join_refuses_trainer_step},
        {"the model region in the servers' GPU memory", test_device_region},
        {"GPU-resident shards (emulated) through their device handle", test_device_shards},
        {"remote trainers are not shared", test_not_shared},
        {"a starting server removes dead servers' objects only", test_sweep},
        {NULL, NULL},
    };
    return ps_test_main("shard_view", cases);
}
