/* A trainer for the sharded-training equivalence test: it trains a few oddly shaped parameters
 * (rows not divisible by the world size, a parameter with fewer rows than ranks) through
 * libpshard, and alongside it runs the same training in one process on the full parameters
 * with every rank's gradients averaged — the reference — then checks that the gathered
 * parameters match it. Gradients are a deterministic function of (parameters, rank, step), so
 * each trainer can compute every rank's. Exit 0 when they match.
 * The modes groups, groups_join and groups_in_backward train with parameter groups instead
 * (run_groups below): per-group hyperparameters changed at every step, a frozen parameter,
 * clip_grad_norm, and in groups_join a rank that joins before the last step.
 * With PSHARD_STABLE=1 the model uses stable_param_buffers and conv.c has 600 rows (19 KiB, more
 * than a page: remapped between the pool and its fixed address on the shared-memory path); each
 * gathered parameter must then sit at its fixed address and read as zeros once resharded.
 * usage: shard_trainer SERVER RANK WORLD LAYOUT(fsdp2|fsdp1) OPT(sgd|adam|adamw) DTYPE(fp32|bf16)
 *        STEPS [mismatch|in_backward|groups|groups_join|groups_in_backward|groups_mismatch] */
#include <math.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/optim.h"
#include "pshard/dtype.h"
#include "pshard/pshard.h"
#include "pshard/util.h"

#define NP 4

static int64_t shapes[NP][3] = {{7, 3, 0}, {2, 0, 0}, {16, 4, 2}, {1, 0, 0}};
static const int ndims[NP] = {2, 1, 3, 1};
static const char *const names[NP] = {"layer.a", "bias.b", "conv.c", "scale.d"};

static size_t numel_of(int p)
{
    size_t n = 1;
    for (int d = 0; d < ndims[p]; d++)
        n *= (size_t)shapes[p][d];
    return n;
}

static float grad_value(float param, int rank, int64_t step, size_t i, int p)
{
    return 0.05f * param +
           0.1f * sinf((float)(rank * 13 + (int)i * 7 + p * 3) * 0.37f + (float)step * 0.11f);
}

static float *ref[NP], *st0[NP], *st1[NP], *avg[NP];

static void free_arrays(void)
{
    for (int p = 0; p < NP; p++) {
        free(ref[p]);
        free(st0[p]);
        free(st1[p]);
        free(avg[p]);
    }
}

/* Shared-memory objects this process created (the local path makes two per client). */
/* Shared-memory objects this process has mapped (from /proc/self/maps), and how many of
 * its objects still have a name in /dev/shm (none once the server has mapped them). */
static int own_shm_mappings(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    int n = 0;
    char line[512];
    while (f && fgets(line, sizeof(line), f))
        n += strstr(line, "/dev/shm/pshard-") != NULL;
    if (f)
        fclose(f);
    return n;
}

/* Names in /dev/shm of this process's own mappings: a mapping whose name was unlinked reads
 * "(deleted)" in /proc/self/maps. (Not a listing of /dev/shm by pid prefix: a process of an
 * earlier test with the same, since reused, pid may have been killed before unlinking.) The
 * shard server's own object ("/pshard-srv-...", its shard as shared memory) is not this
 * process's: the server unlinks it with the model, and a starting server sweeps a dead one's. */
static int own_shm_names(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    int n = 0;
    char line[512];
    while (f && fgets(line, sizeof(line), f)) {
        if (strstr(line, "/dev/shm/pshard-") && !strstr(line, "/dev/shm/pshard-srv-") &&
            !strstr(line, "(deleted)")) {
            fprintf(stderr, "still linked: %s", line);
            n++;
        }
    }
    if (f)
        fclose(f);
    return n;
}

static float round_param(float v, pshard_dtype_t dt)
{
    return dt == PSHARD_BF16 ? ps_bf16_to_f32(ps_f32_to_bf16(v)) : v;
}

/* ---- parameter groups, a frozen parameter, clip_grad_norm ---------------------------------- */

#define NG 3
/* layer.a and scale.d train in group 0, conv.c in group 1; bias.b is frozen (group 2). */
static const uint32_t group_of[NP] = {0, 2, 1, 0};

/* The groups as an lr scheduler that also moves momentum and betas (like OneCycleLR) would set
 * them for `step` (0: at the definition): the lr decays every step; from step 4 group 0's SGD
 * momentum drops and its beta1 changes, and group 1 gets an SGD momentum it did not have. The
 * frozen group has hyperparameters that would change its parameter a lot were it stepped. */
static void groups_at(pshard_optimizer_t opt, int step, pshard_optim_group_t g[NG])
{
    bool sgd = opt == PSHARD_SGD, late = step >= 4;
    double decay = 1.0 - 0.05 * step;
    g[0] = (pshard_optim_group_t){.lr = (sgd ? 0.1 : 0.01) * decay,
                                  .momentum = sgd ? (late ? 0.5 : 0.9) : 0.0,
                                  .nesterov = sgd,
                                  .weight_decay = opt == PSHARD_ADAMW ? 0.05 : 0.01,
                                  .beta1 = late ? 0.85 : 0.9,
                                  .beta2 = 0.999,
                                  .eps = 1e-8};
    g[1] = (pshard_optim_group_t){.lr = (sgd ? 0.03 : 0.003) * decay,
                                  .momentum = sgd && late ? 0.8 : 0.0,
                                  .weight_decay = 0.2,
                                  .beta1 = 0.8,
                                  .beta2 = 0.99,
                                  .eps = 1e-6};
    g[2] = (pshard_optim_group_t){.lr = 1.0,
                                  .momentum = sgd ? 0.9 : 0.0,
                                  .weight_decay = 0.5,
                                  .beta1 = 0.9,
                                  .beta2 = 0.999,
                                  .eps = 1e-8,
                                  .frozen = true};
}

static ps_optim_config_t group_cfg(pshard_optimizer_t opt, const pshard_optim_group_t *g)
{
    ps_optim_config_t c;
    ps_optim_defaults(opt == PSHARD_ADAM    ? PS_OPTIM_ADAM
                      : opt == PSHARD_ADAMW ? PS_OPTIM_ADAMW
                                            : PS_OPTIM_SGD,
                      &c);
    c.lr = g->lr;
    c.momentum = g->momentum;
    c.dampening = g->dampening;
    c.nesterov = g->nesterov;
    c.weight_decay = g->weight_decay;
    c.beta1 = g->beta1;
    c.beta2 = g->beta2;
    c.eps = g->eps;
    return c;
}

/* How step `step` clips (clip_grad_norm_ before the step): norm 2 to 0.3, inf to 0.05, or the
 * norm alone (max_norm 0). */
static void clip_at(int step, double *max_norm, double *norm_type)
{
    *norm_type = step % 3 == 2 ? INFINITY : 2.0;
    *max_norm = step % 3 == 1 ? 0.3 : step % 3 == 2 ? 0.05 : 0.0;
}

/* The reference's norm of the trained averaged gradients, as the shard servers compute it:
 * norm 2 from squares summed in double, inf as the largest magnitude. */
static double ref_norm(bool inf)
{
    double sq = 0;
    float top = 0;
    for (int p = 0; p < NP; p++) {
        if (group_of[p] == 2)
            continue;
        sq += ps_sum_squares(avg[p], numel_of(p));
        float both[2] = {top, ps_max_abs(avg[p], numel_of(p))};
        top = ps_max_abs(both, 2);
    }
    return inf ? (double)top : sqrt(sq);
}

static bool near(double got, double want, double rel)
{
    return fabs(got - want) <= rel * fabs(want) + 1e-7;
}

/* One reference step: avg from the first `active` ranks' gradients, clip_grad_norm (torch's
 * fp32 formula; not in backward), then each trained parameter's update with its group's
 * hyperparameters (in backward: the groups of the previous step's Step). *clip_norm gets the
 * clip's total norm, *step_norm the norm the step sees. */
static void ref_step(pshard_optimizer_t opt, pshard_dtype_t dt, int step, int active,
                     bool in_backward, double *clip_norm, double *step_norm)
{
    for (int p = 0; p < NP; p++) {
        for (size_t i = 0; i < numel_of(p); i++) {
            double sum = 0;
            for (int q = 0; q < active; q++)
                sum += grad_value(round_param(ref[p][i], dt), q, step, i, p);
            avg[p][i] = (float)(sum / active);
        }
    }
    double max_norm, norm_type;
    clip_at(step, &max_norm, &norm_type);
    *clip_norm = *step_norm = ref_norm(false);
    if (!in_backward) {
        *clip_norm = ref_norm(isinf(norm_type));
        float total = (float)*clip_norm;
        float coef = (1.0f / (total + 1e-6f)) * (float)max_norm;
        for (int p = 0; p < NP && max_norm > 0 && coef < 1.0f; p++)
            ps_scale(avg[p], numel_of(p), coef);
        *step_norm = ref_norm(false);
    }
    pshard_optim_group_t g[NG];
    groups_at(opt, in_backward ? step - 1 : step, g);
    for (int p = 0; p < NP; p++) {
        if (group_of[p] == 2)
            continue;
        ps_optim_config_t c = group_cfg(opt, &g[group_of[p]]);
        ps_optim_step(&c, c.lr, step, ref[p], avg[p], st0[p], st1[p], numel_of(p));
    }
}

/* The gathered parameters against the reference (and the frozen one against its initial
 * values, exactly); returns the number of mismatches. */
static int check_gathered(pshard_client_t *c, pshard_dtype_t dt, int rank, int step,
                          float *const *init)
{
    int bad = 0;
    for (int p = 0; p < NP; p++) {
        const void *g = pshard_param(c, (size_t)p);
        if (!g) {
            fprintf(stderr, "rank %d step %d: %s is not gathered\n", rank, step, names[p]);
            return bad + 1;
        }
        for (size_t i = 0; i < numel_of(p); i++) {
            float got = dt == PSHARD_BF16 ? ps_bf16_to_f32(((const uint16_t *)g)[i])
                                          : ((const float *)g)[i];
            float want = round_param(ref[p][i], dt);
            double tol = dt == PSHARD_BF16 ? fabs(want) / 128.0 + 1e-6 : 1e-5 * fabs(want) + 1e-7;
            bool frozen_changed = group_of[p] == 2 && got != round_param(init[p][i], dt);
            if ((fabs((double)got - (double)want) > tol || frozen_changed) && bad++ < 5)
                fprintf(stderr, "rank %d step %d: %s[%zu] = %.9g, reference %.9g%s\n", rank, step,
                        names[p], i, got, want, frozen_changed ? " (frozen: changed)" : "");
        }
    }
    return bad;
}

/* Trains with parameter groups: every step gathers, writes the gradients of the trained
 * parameters, reduce-scatters them, clips (clip_grad_norm, norm 2 or inf, or only the norm)
 * and steps with that step's groups; the clip's total norm, the step's norm and the gathered
 * parameters are checked against the reference. Step 2 also checks that reduce-scattering the
 * frozen parameter and wrong group lists are refused on every rank without a hang. join: the
 * last rank joins instead of running the last step, which the others then run with its server
 * shadowing them (clip and groups included). in_backward: updates at the reduce-scatters with
 * the previous Step's groups, and clip_grad_norm refused. A resumed model (pshard-server
 * --resume) continues from its step after replaying the reference up to it. mismatch: the last
 * rank defines group 1 with another weight decay, which every rank must refuse naming it. */
static int run_groups(pshard_client_t *c, int rank, int world, pshard_layout_t layout,
                      pshard_optimizer_t opt, pshard_dtype_t dt, int steps, bool join,
                      bool in_backward, bool mismatch)
{
    pshard_model_config_t mc;
    pshard_model_config_default(&mc, opt);
    if (mc.ngroups != 0 || mc.groups || mc.param_groups) {
        fprintf(stderr, "rank %d: pshard_model_config_default left groups set\n", rank);
        return 1;
    }
    mc.layout = layout;
    mc.param_dtype = dt;
    mc.lr = -1; /* unused with groups: a value the server would refuse */
    mc.optimizer_in_backward = in_backward;
    pshard_optim_group_t g[NG];
    groups_at(opt, 0, g);
    if (mismatch && rank == world - 1)
        g[1].weight_decay *= 2;
    mc.ngroups = NG;
    mc.groups = g;
    mc.param_groups = group_of;
    pshard_param_t params[NP];
    float *init[NP];
    for (int p = 0; p < NP; p++) {
        params[p] = (pshard_param_t){names[p], ndims[p], shapes[p]};
        init[p] = malloc(numel_of(p) * sizeof(float));
        memcpy(init[p], ref[p], numel_of(p) * sizeof(float));
    }
    int failures = 0;
    if (pshard_define_model(c, params, NP, &mc, (const float *const *)ref) != PSHARD_OK) {
        bool expected = mismatch && strstr(pshard_last_error(c), "parameter group #1");
        fprintf(stderr, "rank %d: define: %s%s\n", rank, pshard_last_error(c),
                expected ? " (as expected)" : "");
        failures += !expected;
        goto out;
    }
    if (mismatch) {
        fprintf(stderr, "rank %d: definitions with different groups were accepted\n", rank);
        failures++;
        goto out;
    }
    int64_t start = pshard_model_step(c);
    double clip_ref = 0, step_ref = 0;
    for (int step = 1; step <= start; step++)
        ref_step(opt, dt, step, world, in_backward, &clip_ref, &step_ref);
    if (start > 0 && rank == 0)
        printf("resumed at step %lld\n", (long long)start);
    for (int step = (int)start + 1; step <= steps; step++) {
        bool last = step == steps;
        if (join && last && rank == world - 1) {
            /* Joins first: the others join after the last step, so one of them is last. */
            pshard_join_result_t jr = {0};
            if (pshard_join(c, NULL, &jr) != PSHARD_OK || jr.step != steps || jr.is_last_joiner) {
                fprintf(stderr, "rank %d: join: %s (step %lld, last %d)\n", rank,
                        pshard_last_error(c), (long long)jr.step, (int)jr.is_last_joiner);
                failures++;
            }
            ref_step(opt, dt, step, world - 1, in_backward, &clip_ref, &step_ref);
            break;
        }
        if (pshard_gather(c, NULL, 0) != PSHARD_OK) {
            fprintf(stderr, "rank %d: gather: %s\n", rank, pshard_last_error(c));
            failures++;
            goto out;
        }
        failures += check_gathered(c, dt, rank, step - 1, init);
        int active = join && last ? world - 1 : world;
        for (int p = 0; p < NP; p++) {
            if (group_of[p] == 2)
                continue;
            const void *gp = pshard_param(c, (size_t)p);
            float *grad = pshard_grad(c, (size_t)p);
            for (size_t i = 0; i < numel_of(p); i++) {
                float pv = dt == PSHARD_BF16 ? ps_bf16_to_f32(((const uint16_t *)gp)[i])
                                             : ((const float *)gp)[i];
                grad[i] = grad_value(pv, rank, step, i, p);
            }
        }
        if (pshard_reduce_scatter(c, NULL, 0) != PSHARD_OK) {
            fprintf(stderr, "rank %d: reduce_scatter: %s\n", rank, pshard_last_error(c));
            failures++;
            goto out;
        }
        if (step == 2) {
            /* The frozen parameter's reduce-scatter is refused here and on every other rank,
             * before any collective (no rank waits), and so are wrong group lists. */
            static const size_t frozen = 1;
            pshard_status_t st =
                pshard_grad(c, frozen) ? pshard_reduce_scatter(c, &frozen, 1) : PSHARD_ERR_INTERNAL;
            if (st != PSHARD_ERR_FAILED_PRECONDITION ||
                !strstr(pshard_last_error(c), "'bias.b' is frozen")) {
                fprintf(stderr, "rank %d: reduce-scatter of a frozen parameter gave %s: %s\n", rank,
                        pshard_status_name(st), pshard_last_error(c));
                failures++;
            }
            pshard_optim_group_t bad[NG];
            groups_at(opt, step, bad);
            st = pshard_step_groups(c, bad, NG - 1, NULL, NULL);
            if (st != PSHARD_ERR_INVALID_ARGUMENT ||
                !strstr(pshard_last_error(c), "2 parameter groups given; the model was "
                                              "defined with 3")) {
                fprintf(stderr, "rank %d: a step with 2 of 3 groups gave %s: %s\n", rank,
                        pshard_status_name(st), pshard_last_error(c));
                failures++;
            }
            bad[2].frozen = false;
            st = pshard_step_groups(c, bad, NG, NULL, NULL);
            if (st != PSHARD_ERR_INVALID_ARGUMENT ||
                !strstr(pshard_last_error(c), "group 2: frozen cannot change")) {
                fprintf(stderr, "rank %d: unfreezing a group at a step gave %s: %s\n", rank,
                        pshard_status_name(st), pshard_last_error(c));
                failures++;
            }
        }
        ref_step(opt, dt, step, active, in_backward, &clip_ref, &step_ref);
        double max_norm, norm_type, total = -1;
        clip_at(step, &max_norm, &norm_type);
        pshard_status_t st = pshard_clip_grad_norm(c, max_norm, norm_type, &total);
        if (in_backward) {
            if (st != PSHARD_ERR_FAILED_PRECONDITION ||
                !strstr(pshard_last_error(c), "optimizer_in_backward")) {
                fprintf(stderr, "rank %d: clip_grad_norm in backward gave %s: %s\n", rank,
                        pshard_status_name(st), pshard_last_error(c));
                failures++;
            }
        } else if (st != PSHARD_OK || !near(total, clip_ref, 1e-5)) {
            fprintf(stderr,
                    "rank %d step %d: clip_grad_norm(%g, %g) gave %s, total %.9g, "
                    "reference %.9g: %s\n",
                    rank, step, max_norm, norm_type, pshard_status_name(st), total, clip_ref,
                    pshard_last_error(c));
            failures++;
        }
        groups_at(opt, step, g);
        int64_t got_step = 0;
        double norm = -1;
        if (pshard_step_groups(c, g, NG, &got_step, &norm) != PSHARD_OK) {
            fprintf(stderr, "rank %d: step: %s\n", rank, pshard_last_error(c));
            failures++;
            goto out;
        }
        if (got_step != step || !near(norm, step_ref, 1e-5)) {
            fprintf(stderr,
                    "rank %d step %d: the step says step %lld, grad norm %.9g; "
                    "reference %.9g\n",
                    rank, step, (long long)got_step, norm, step_ref);
            failures++;
        }
    }
    if (join && rank != world - 1) {
        pshard_join_result_t jr = {0};
        if (pshard_join(c, NULL, &jr) != PSHARD_OK || jr.step != steps) {
            fprintf(stderr, "rank %d: join: %s\n", rank, pshard_last_error(c));
            failures++;
        }
    }
    /* The final parameters, on every rank (a joined one included). */
    if (pshard_gather(c, NULL, 0) != PSHARD_OK) {
        fprintf(stderr, "rank %d: final gather: %s\n", rank, pshard_last_error(c));
        failures++;
    } else {
        failures += check_gathered(c, dt, rank, steps, init);
    }
out:
    for (int p = 0; p < NP; p++)
        free(init[p]);
    pshard_close(c);
    if (failures == 0 && rank == 0 && !mismatch)
        printf("rank 0: %d steps with parameter groups match the reference\n", steps);
    return failures ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc < 8) {
        fprintf(stderr, "usage: %s SERVER RANK WORLD LAYOUT OPT DTYPE STEPS [mismatch]\n", argv[0]);
        return 2;
    }
    int64_t v;
    ps_parse_i64(argv[2], 0, 64, &v);
    int rank = (int)v;
    ps_parse_i64(argv[3], 1, 64, &v);
    int world = (int)v;
    pshard_layout_t layout =
        strcmp(argv[4], "fsdp1") == 0 ? PSHARD_LAYOUT_FSDP1 : PSHARD_LAYOUT_FSDP2;
    pshard_optimizer_t opt = strcmp(argv[5], "adam") == 0    ? PSHARD_ADAM
                             : strcmp(argv[5], "adamw") == 0 ? PSHARD_ADAMW
                                                             : PSHARD_SGD;
    pshard_dtype_t dt = strcmp(argv[6], "bf16") == 0 ? PSHARD_BF16 : PSHARD_FP32;
    ps_parse_i64(argv[7], 1, 1000, &v);
    int steps = (int)v;
    bool mismatch = argc > 8 && strcmp(argv[8], "mismatch") == 0;
    bool in_backward = argc > 8 && strcmp(argv[8], "in_backward") == 0;
    bool groups = argc > 8 && strncmp(argv[8], "groups", 6) == 0;
    const char *stable_env = getenv("PSHARD_STABLE");
    bool stable = stable_env && strcmp(stable_env, "1") == 0;
    if (stable)
        shapes[2][0] = 600;

    const char *remote = getenv("PSHARD_REMOTE");
    pshard_client_config_t cfg = {.server = argv[1],
                                  .rank = rank,
                                  .world_size = world,
                                  .connect_timeout_ms = 30000,
                                  .timeout_ms = 30000,
                                  .remote = remote && strcmp(remote, "1") == 0};
    pshard_client_t *c = NULL;
    char err[1024] = "";
    if (pshard_connect(&cfg, &c, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "rank %d: connect: %s\n", rank, err);
        return 1;
    }
    if (groups) {
        atexit(free_arrays);
        for (int p = 0; p < NP; p++) {
            size_t n = numel_of(p);
            ref[p] = malloc(n * sizeof(float));
            st0[p] = calloc(n, sizeof(float));
            st1[p] = calloc(n, sizeof(float));
            avg[p] = malloc(n * sizeof(float));
            for (size_t i = 0; i < n; i++)
                ref[p][i] = 0.5f * sinf((float)(i * 31 + (size_t)p * 101) * 0.013f) + 0.01f;
        }
        return run_groups(
            c, rank, world, layout, opt, dt, steps, strcmp(argv[8], "groups_join") == 0,
            strcmp(argv[8], "groups_in_backward") == 0, strcmp(argv[8], "groups_mismatch") == 0);
    }
    pshard_model_config_t mc;
    pshard_model_config_default(&mc, opt);
    mc.layout = layout;
    mc.param_dtype = dt;
    mc.lr = opt == PSHARD_SGD ? 0.1 : 0.01;
    mc.momentum = opt == PSHARD_SGD ? 0.9 : 0;
    mc.nesterov = opt == PSHARD_SGD;
    mc.weight_decay = opt == PSHARD_ADAMW ? 0.05 : (opt == PSHARD_ADAM ? 0.01 : 0.001);
    mc.max_grad_norm = in_backward ? 0 : 0.5; /* in-backward updates cannot clip */
    mc.optimizer_in_backward = in_backward;
    mc.max_gathers_in_flight = 1; /* odd steps issue two gathers: the second must wait */
    mc.stable_param_buffers = stable;
    pshard_param_t params[NP];
    atexit(free_arrays);
    for (int p = 0; p < NP; p++) {
        params[p] = (pshard_param_t){names[p], ndims[p], shapes[p]};
        size_t n = numel_of(p);
        ref[p] = malloc(n * sizeof(float));
        st0[p] = calloc(n, sizeof(float));
        st1[p] = calloc(n, sizeof(float));
        avg[p] = malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++)
            ref[p][i] = 0.5f * sinf((float)(i * 31 + (size_t)p * 101) * 0.013f) + 0.01f;
    }
    int64_t mismatch_shape[3] = {7, 4, 0};
    if (mismatch && rank == world - 1)
        params[0].shape = mismatch_shape;
    if (pshard_define_model(c, params, NP, &mc, (const float *const *)ref) != PSHARD_OK) {
        fprintf(stderr, "rank %d: define: %s\n", rank, pshard_last_error(c));
        int code = mismatch && strstr(pshard_last_error(c), "layer.a") ? 0 : 1;
        if (mismatch)
            printf("rank %d: refused as expected: %s\n", rank, pshard_last_error(c));
        pshard_close(c);
        return code;
    }
    /* The remote path uses no shared memory at all; the local one does, and its objects
     * are already unlinked (nothing is left in /dev/shm if this process is killed). */
    if ((own_shm_mappings() == 0) != cfg.remote || own_shm_names() != 0) {
        fprintf(stderr,
                "rank %d: %d shared-memory mappings, %d names in /dev/shm on the %s "
                "path\n",
                rank, own_shm_mappings(), own_shm_names(), cfg.remote ? "remote" : "local");
        pshard_close(c);
        return 1;
    }
    if (mismatch) {
        fprintf(stderr, "rank %d: a mismatched definition was accepted\n", rank);
        pshard_close(c);
        return 1;
    }
    ps_optim_config_t oc;
    ps_optim_defaults(opt == PSHARD_ADAM    ? PS_OPTIM_ADAM
                      : opt == PSHARD_ADAMW ? PS_OPTIM_ADAMW
                                            : PS_OPTIM_SGD,
                      &oc);
    oc.lr = mc.lr;
    oc.momentum = mc.momentum;
    oc.nesterov = mc.nesterov;
    oc.weight_decay = mc.weight_decay;

    int failures = 0;
    for (int step = 1; step <= steps; step++) {
        /* Prefetch-style: two asynchronous gathers in flight, waited in order (odd steps), or
         * one blocking gather of everything (even steps). */
        pshard_status_t grc;
        if (step % 2) {
            static const size_t first[2] = {0, 1}, second[2] = {2, 3};
            pshard_work_t *w1 = NULL, *w2 = NULL;
            grc = pshard_gather_start(c, first, 2, &w1);
            if (grc == PSHARD_OK)
                grc = pshard_gather_start(c, second, 2, &w2);
            if (w1 && pshard_work_wait(w1) != PSHARD_OK)
                grc = PSHARD_ERR_RPC;
            if (w2 && pshard_work_wait(w2) != PSHARD_OK)
                grc = PSHARD_ERR_RPC;
        } else {
            grc = pshard_gather(c, NULL, 0);
            /* Gathered already: a second gather moves nothing (SHARD_GRAD_OP's saving). */
            pshard_memory_stats_t before, after;
            pshard_memory_stats(c, &before);
            if (grc == PSHARD_OK)
                grc = pshard_gather(c, NULL, 0);
            pshard_memory_stats(c, &after);
            if (after.params_skipped != before.params_skipped + NP ||
                after.params_gathered != before.params_gathered) {
                fprintf(stderr, "rank %d: a repeated gather moved parameters again\n", rank);
                failures++;
            }
        }
        if (grc != PSHARD_OK) {
            fprintf(stderr, "rank %d: gather: %s\n", rank, pshard_last_error(c));
            return 1;
        }
        /* The gathered parameters equal the reference (rounded to the param dtype). */
        double worst = 0;
        for (int p = 0; p < NP; p++) {
            size_t n = numel_of(p);
            const void *g = pshard_param(c, (size_t)p);
            if (stable && g != pshard_param_buffer(c, (size_t)p)) {
                fprintf(stderr,
                        "rank %d step %d: %s is gathered at %p, not at its fixed "
                        "address %p\n",
                        rank, step, names[p], g, pshard_param_buffer(c, (size_t)p));
                return 1;
            }
            for (size_t i = 0; i < n; i++) {
                float got = dt == PSHARD_BF16 ? ps_bf16_to_f32(((const uint16_t *)g)[i])
                                              : ((const float *)g)[i];
                float want = round_param(ref[p][i], dt);
                double tol =
                    dt == PSHARD_BF16 ? fabs(want) / 128.0 + 1e-6 : 1e-5 * fabs(want) + 1e-7;
                double d = fabs((double)got - (double)want);
                if (d > tol) {
                    if (failures++ < 5)
                        fprintf(stderr, "rank %d step %d: %s[%zu] = %.9g, reference %.9g\n", rank,
                                step, names[p], i, got, want);
                }
                if (d > worst)
                    worst = d;
            }
        }
        /* Local gradients from the gathered values; reference: every rank's, averaged. */
        for (int p = 0; p < NP; p++) {
            size_t n = numel_of(p);
            const void *g = pshard_param(c, (size_t)p);
            float *grad = pshard_grad(c, (size_t)p);
            for (size_t i = 0; i < n; i++) {
                float pv = dt == PSHARD_BF16 ? ps_bf16_to_f32(((const uint16_t *)g)[i])
                                             : ((const float *)g)[i];
                grad[i] = grad_value(pv, rank, step, i, p);
                double sum = 0;
                for (int q = 0; q < world; q++)
                    sum += grad_value(round_param(ref[p][i], dt), q, step, i, p);
                avg[p][i] = (float)(sum / world);
            }
        }
        pshard_work_t *rsw = NULL;
        if (pshard_reduce_scatter_start(c, NULL, 0, &rsw) != PSHARD_OK ||
            pshard_work_wait(rsw) != PSHARD_OK) {
            fprintf(stderr, "rank %d: reduce_scatter: %s\n", rank, pshard_last_error(c));
            return 1;
        }
        /* In-backward, the update is done: a second reduce-scatter of a parameter in the
         * same step (gradient accumulation) is refused on every rank, changing nothing. */
        if (in_backward && step == 2) {
            static const size_t first = 0;
            float *g0 = pshard_grad(c, first);
            if (g0)
                memset(g0, 0, numel_of(0) * sizeof(float));
            pshard_status_t st = g0 ? pshard_reduce_scatter(c, &first, 1) : PSHARD_ERR_INTERNAL;
            if (st != PSHARD_ERR_FAILED_PRECONDITION ||
                !strstr(pshard_last_error(c), "already reduce-scattered")) {
                fprintf(stderr, "rank %d: a second reduce-scatter in one step gave %d: %s\n", rank,
                        (int)st, pshard_last_error(c));
                failures++;
            }
        }
        double norm = 0;
        if (pshard_step(c, -1, NULL, &norm) != PSHARD_OK) {
            fprintf(stderr, "rank %d: step: %s\n", rank, pshard_last_error(c));
            return 1;
        }
        /* The step made every full copy stale: they are freed; a fixed buffer of whole pages
         * reads as zeros (its own pages, not the pool block the next gather reuses). */
        for (int p = 0; p < NP && stable; p++) {
            size_t bytes = numel_of(p) * (dt == PSHARD_BF16 ? 2 : 4);
            const uint8_t *b = pshard_param_buffer(c, (size_t)p);
            if (bytes < (size_t)sysconf(_SC_PAGESIZE))
                continue;
            for (size_t k = 0; k < bytes; k++) {
                if (b[k] != 0) {
                    fprintf(stderr, "rank %d step %d: resharded %s reads %u at byte %zu\n", rank,
                            step, names[p], b[k], k);
                    failures++;
                    break;
                }
            }
        }
        for (int p = 0; p < NP; p++) {
            if (pshard_param(c, (size_t)p) || pshard_grad(c, (size_t)p) == NULL) {
                fprintf(stderr,
                        "rank %d: after the step parameter %d is still gathered, or "
                        "its gradient cannot be handed out\n",
                        rank, p);
                failures++;
            }
        }
        double sq = 0;
        for (int p = 0; p < NP; p++)
            sq += ps_sum_squares(avg[p], numel_of(p));
        double ref_norm = sqrt(sq);
        if (fabs(norm - ref_norm) > 1e-4 * ref_norm + 1e-6) {
            fprintf(stderr, "rank %d step %d: grad norm %.9g, reference %.9g\n", rank, step, norm,
                    ref_norm);
            failures++;
        }
        double coef = mc.max_grad_norm / (ref_norm + 1e-6);
        for (int p = 0; p < NP; p++) {
            if (mc.max_grad_norm > 0 && coef < 1)
                ps_scale(avg[p], numel_of(p), (float)coef);
            ps_optim_step(&oc, oc.lr, step, ref[p], avg[p], st0[p], st1[p], numel_of(p));
        }
        if (rank == 0 && (step == 1 || step == steps))
            printf("step %d grad_norm %.6f worst_param_diff %.3g\n", step, norm, worst);
    }
    /* Plain collectives through the shard server. */
    float m[2] = {(float)rank, 1.0f};
    if (pshard_all_reduce(c, m, 2, PSHARD_FP32, false) != PSHARD_OK ||
        m[0] != (float)(world * (world - 1) / 2) || m[1] != (float)world) {
        fprintf(stderr, "rank %d: all_reduce gave %g %g: %s\n", rank, m[0], m[1],
                pshard_last_error(c));
        failures++;
    }
    if (pshard_barrier(c) != PSHARD_OK) {
        fprintf(stderr, "rank %d: barrier: %s\n", rank, pshard_last_error(c));
        failures++;
    }
    pshard_memory_stats_t mem;
    pshard_memory_stats(c, &mem);
    if (mem.peak_gathers_in_flight != 1) {
        fprintf(stderr, "rank %d: %d gathers were in flight at once; the bound is 1\n", rank,
                mem.peak_gathers_in_flight);
        failures++;
    }
    pshard_close(c);
    if (failures == 0 && rank == 0)
        printf("rank 0: %d steps match the single-process reference\n", steps);
    return failures ? 1 : 0;
}
