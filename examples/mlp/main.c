/* pshard-mlp: the example trainer. Parses flags and environment into one struct, then runs
 * either the single-process --local reference (mlp_local_train) or the distributed trainer
 * (mlp_dist_train, through libpshard). */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist_train.h"
#include "local_train.h"
#include "mlp.h"
#include "pshard/optim.h"
#include "pshard/config.h"
#include "pshard/types.h"
#include "pshard/log.h"
#include "pshard/util.h"

#define PROG "pshard-mlp"

/* Option values as parsed (strings where the config module has no type for them). */
typedef struct {
    int64_t steps;
    int64_t batch;
    char *widths;
    int64_t input;
    int64_t output;
    char *optimizer;
    char *lr;
    char *momentum;
    char *weight_decay;
    char *max_grad_norm;
    char *param_dtype;
    char *reduce_dtype;
    int64_t seed;
    int64_t data_seed;
    int64_t task_seed;
    bool local;
    int64_t world;
    bool uneven;
    int64_t print_every;
    char *log;
    char *layout;
    bool reshard_after_forward;
    int64_t max_gathers_in_flight;
    bool join_enable;
    bool join_throw;
    bool optimizer_in_backward;
    bool join_mid_step;
    int64_t fail_at_step;
    int64_t fail_rank;
    int64_t sleep_ms_per_step;
    int64_t sleep_rank;
    char *dump_weights;
    char *skip_steps;
    bool checkpoint_at_end;
    char *init_from;
} mlp_opts_t;

#define OPT(flag, env, type, def, help, field, lo, hi)                                             \
    {                                                                                              \
        flag, env, type, def, help, offsetof(mlp_opts_t, field), lo, hi                            \
    }

static const ps_option_t options[] = {
    OPT("steps", NULL, PS_OPT_INT, "20", "training steps (batches per rank)", steps, 0, 1000000000),
    OPT("batch", NULL, PS_OPT_INT, "32", "rows per rank per step", batch, 1, 1048576),
    OPT("widths", NULL, PS_OPT_STRING, "1024,1024,1024,1024",
        "hidden layer widths, comma-separated (empty: one linear layer)", widths, 0, 0),
    OPT("input", NULL, PS_OPT_INT, "256", "input features", input, 1, 1048576),
    OPT("output", NULL, PS_OPT_INT, "64", "output features", output, 1, 1048576),
    OPT("optimizer", NULL, PS_OPT_STRING, "adam", "sgd|adam|adamw", optimizer, 0, 0),
    OPT("lr", NULL, PS_OPT_STRING, "3e-3", "learning rate (fixed for every step)", lr, 0, 0),
    OPT("momentum", NULL, PS_OPT_STRING, NULL, "SGD momentum (default 0)", momentum, 0, 0),
    OPT("weight-decay", NULL, PS_OPT_STRING, NULL, "weight decay (default: sgd/adam 0, adamw 0.01)",
        weight_decay, 0, 0),
    OPT("max-grad-norm", NULL, PS_OPT_STRING, "0", "clip gradients to this global L2 norm; 0 = off",
        max_grad_norm, 0, 0),
    OPT("param-dtype", NULL, PS_OPT_STRING, "fp32",
        "fp32|bf16|fp16: parameters as gathered by trainers (distributed mode)", param_dtype, 0, 0),
    OPT("reduce-dtype", NULL, PS_OPT_STRING, "fp32",
        "fp32|bf16: gradients as reduced (distributed mode)", reduce_dtype, 0, 0),
    OPT("seed", NULL, PS_OPT_INT, "0", "model init seed", seed, 0, INT64_MAX),
    OPT("data-seed", NULL, PS_OPT_INT, "1", "input data seed", data_seed, 0, INT64_MAX),
    OPT("task-seed", NULL, PS_OPT_INT, "2", "teacher (target function) seed", task_seed, 0,
        INT64_MAX),
    OPT("local", NULL, PS_OPT_BOOL, "false",
        "train in this process on the union of --world ranks' batches (reference)", local, 0, 0),
    OPT("world", NULL, PS_OPT_INT, "1", "ranks simulated with --local", world, 1, 65536),
    OPT("uneven", NULL, PS_OPT_BOOL, "false", "rank r gets steps + r batches (tests Join)", uneven,
        0, 0),
    OPT("print-every", NULL, PS_OPT_INT, "1", "print every Nth step's loss (0: none)", print_every,
        0, 1000000000),
    OPT("log", "PSHARD_LOG", PS_OPT_STRING, "warn", "log level: error|warn|info|debug|trace", log,
        0, 0),
    OPT("layout", "PSHARD_LAYOUT", PS_OPT_STRING, "fsdp2",
        "sharding layout: fsdp2 (dim 0 per parameter) or fsdp1 (flat)", layout, 0, 0),
    OPT("reshard-after-forward", NULL, PS_OPT_BOOL, "true",
        "free each layer's full parameters after forward (FULL_SHARD); false keeps them for "
        "backward (SHARD_GRAD_OP)",
        reshard_after_forward, 0, 0),
    OPT("max-gathers-in-flight", NULL, PS_OPT_INT, "2",
        "bound on asynchronous gathers issued and unfinished (0: none)", max_gathers_in_flight, 0,
        1024),
    OPT("join-enable", NULL, PS_OPT_BOOL, "true",
        "with --uneven, ranks that run out join (false: pshard_join refuses, like "
        "Join(enable=False))",
        join_enable, 0, 0),
    OPT("join-throw", NULL, PS_OPT_BOOL, "false",
        "with --uneven, the first join stops every rank (throw_on_early_termination)", join_throw,
        0, 0),
    OPT("join-mid-step", NULL, PS_OPT_BOOL, "false",
        "with --uneven, a rank that runs out starts one more step, gathers its first layer and "
        "joins there (a join in the middle of a step)",
        join_mid_step, 0, 0),
    OPT("fail-at-step", NULL, PS_OPT_INT, "0",
        "fault injection for restart tests: on the first attempt (PSHARD_RESTART_COUNT unset or "
        "0), rank --fail-rank exits with status 3 just before this step (0: never)",
        fail_at_step, 0, 1000000000),
    OPT("fail-rank", NULL, PS_OPT_INT, "0", "the rank --fail-at-step stops", fail_rank, 0, 1000000),
    OPT("sleep-ms-per-step", NULL, PS_OPT_INT, "0",
        "a straggler for tests of pshardctl status: rank --sleep-rank sleeps this long in every "
        "step, before its forward (as a slow data loader would)",
        sleep_ms_per_step, 0, 3600000),
    OPT("sleep-rank", NULL, PS_OPT_INT, "-1", "the rank --sleep-ms-per-step slows (-1: every rank)",
        sleep_rank, -1, 1000000),
    OPT("optimizer-in-backward", NULL, PS_OPT_BOOL, "false",
        "shard servers update each layer at its reduce-scatter and keep no gradient "
        "accumulator (needs --max-grad-norm 0)",
        optimizer_in_backward, 0, 0),
    OPT("dump-weights", NULL, PS_OPT_STRING, NULL,
        "write the final weights here (raw fp32, definition order; rank 0 in distributed mode)",
        dump_weights, 0, 0),
    OPT("skip-steps", NULL, PS_OPT_STRING, NULL,
        "comma list of steps (1-based) to leave out, as the steps a lost trainer aborted were: "
        "the reference run of a job whose trainers were replaced",
        skip_steps, 0, 0),
    OPT("checkpoint-at-end", NULL, PS_OPT_BOOL, "false",
        "save a checkpoint after the last step (the servers' --checkpoint-dir)", checkpoint_at_end,
        0, 0),
    OPT("init-from", NULL, PS_OPT_STRING, NULL,
        "initial weights from this safetensors file (e.g. pshardctl checkpoint export)", init_from,
        0, 0),
};

/* The validated configuration every mode runs from. */
typedef struct {
    mlp_shape_t shape;
    int batch;
    int64_t steps;
    int world;
    bool uneven;
    uint64_t seed, data_seed, task_seed;
    ps_optim_config_t optim;
    double max_grad_norm;
    pshard_dtype_t param_dtype;
    pshard_dtype_t reduce_dtype;
    int64_t print_every;
    bool local;
} mlp_config_t;

/* Parses a whole string as a finite double >= 0; returns 0 or -1. */
static int parse_nonneg_double(const char *text, double *out)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(text, &end);
    if (errno != 0 || end == text || *end != '\0' || !isfinite(v) || v < 0.0)
        return -1;
    *out = v;
    return 0;
}

/* Turns parsed options into cfg; returns 0, or -1 after printing why on stderr. */
static int build_config(const mlp_opts_t *o, mlp_config_t *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    if (mlp_parse_widths(o->widths ? o->widths : "", (int)o->input, (int)o->output, &cfg->shape) !=
        0) {
        fprintf(stderr, PROG ": --widths '%s' is not a list of at most %d positive widths\n",
                o->widths ? o->widths : "", MLP_MAX_LAYERS - 1);
        return -1;
    }
    ps_optim_kind_t kind;
    if (strcmp(o->optimizer, "sgd") == 0) {
        kind = PS_OPTIM_SGD;
    } else if (strcmp(o->optimizer, "adam") == 0) {
        kind = PS_OPTIM_ADAM;
    } else if (strcmp(o->optimizer, "adamw") == 0) {
        kind = PS_OPTIM_ADAMW;
    } else {
        fprintf(stderr, PROG ": --optimizer '%s' is not sgd|adam|adamw\n", o->optimizer);
        return -1;
    }
    ps_optim_defaults(kind, &cfg->optim);
    struct {
        const char *flag, *text;
        double *dst;
    } reals[] = {
        {"lr", o->lr, &cfg->optim.lr},
        {"momentum", o->momentum, &cfg->optim.momentum},
        {"weight-decay", o->weight_decay, &cfg->optim.weight_decay},
        {"max-grad-norm", o->max_grad_norm, &cfg->max_grad_norm},
    };
    for (size_t i = 0; i < PS_ARRAY_LEN(reals); i++) {
        if (reals[i].text && parse_nonneg_double(reals[i].text, reals[i].dst) != 0) {
            fprintf(stderr, PROG ": --%s '%s' is not a finite number >= 0\n", reals[i].flag,
                    reals[i].text);
            return -1;
        }
    }
    if (kind != PS_OPTIM_SGD && cfg->optim.momentum != 0.0) {
        fprintf(stderr, PROG ": --momentum only applies to --optimizer sgd\n");
        return -1;
    }
    char err[PSHARD_ERRLEN] = "";
    if (ps_optim_validate(&cfg->optim, err, sizeof(err)) != 0) {
        fprintf(stderr, PROG ": %s\n", err);
        return -1;
    }
    if (pshard_dtype_parse(o->param_dtype, &cfg->param_dtype) != 0 ||
        cfg->param_dtype == PSHARD_INT64) {
        fprintf(stderr, PROG ": --param-dtype '%s' is not fp32|bf16|fp16\n", o->param_dtype);
        return -1;
    }
    if (pshard_dtype_parse(o->reduce_dtype, &cfg->reduce_dtype) != 0 ||
        (cfg->reduce_dtype != PSHARD_FP32 && cfg->reduce_dtype != PSHARD_BF16)) {
        fprintf(stderr, PROG ": --reduce-dtype '%s' is not fp32|bf16\n", o->reduce_dtype);
        return -1;
    }
    cfg->batch = (int)o->batch;
    cfg->steps = o->steps;
    cfg->world = (int)o->world;
    cfg->uneven = o->uneven;
    cfg->seed = (uint64_t)o->seed;
    cfg->data_seed = (uint64_t)o->data_seed;
    cfg->task_seed = (uint64_t)o->task_seed;
    cfg->print_every = o->print_every;
    cfg->local = o->local;
    return 0;
}

static int run_local(const mlp_config_t *cfg, const char *dump)
{
    mlp_local_args_t a;
    memset(&a, 0, sizeof(a));
    a.shape = cfg->shape;
    a.batch = cfg->batch;
    a.steps = cfg->steps;
    a.world = cfg->world;
    a.uneven = cfg->uneven;
    a.seed = cfg->seed;
    a.data_seed = cfg->data_seed;
    a.task_seed = cfg->task_seed;
    a.optim = cfg->optim;
    a.max_grad_norm = cfg->max_grad_norm;
    a.print_every = cfg->print_every;
    a.dump_weights = dump;
    return mlp_local_train(&a);
}

/* --skip-steps "3,17": positive step numbers, at most MLP_MAX_SKIPS. 0, or 2 with a message. */
static int parse_steps(const char *text, mlp_dist_args_t *d)
{
    d->nskip = 0;
    if (!text || !*text)
        return 0;
    const char *p = text;
    while (*p) {
        char item[24];
        size_t n = strcspn(p, ",");
        int64_t v;
        if (n == 0 || n >= sizeof(item) || d->nskip == MLP_MAX_SKIPS) {
            fprintf(stderr, PROG ": --skip-steps '%s' is not a list of at most %d steps\n", text,
                    MLP_MAX_SKIPS);
            return 2;
        }
        memcpy(item, p, n);
        item[n] = '\0';
        if (ps_parse_i64(item, 1, INT64_MAX, &v) != 0) {
            fprintf(stderr, PROG ": --skip-steps: '%s' is not a step number (1, 2, ...)\n", item);
            return 2;
        }
        d->skip[d->nskip++] = v;
        p += n + (p[n] == ',');
    }
    return 0;
}

static int run_distributed(const mlp_config_t *cfg, const mlp_opts_t *o)
{
    const char *layout = o->layout;
    mlp_dist_args_t d;
    memset(&d, 0, sizeof(d));
    mlp_local_args_t *a = &d.common;
    a->shape = cfg->shape;
    a->batch = cfg->batch;
    a->steps = cfg->steps;
    a->world = cfg->world;
    a->uneven = cfg->uneven;
    a->seed = cfg->seed;
    a->data_seed = cfg->data_seed;
    a->task_seed = cfg->task_seed;
    a->optim = cfg->optim;
    a->max_grad_norm = cfg->max_grad_norm;
    a->print_every = cfg->print_every;
    d.param_dtype = cfg->param_dtype;
    d.reduce_dtype = cfg->reduce_dtype;
    d.reshard_after_forward = o->reshard_after_forward;
    d.max_gathers_in_flight = (int)o->max_gathers_in_flight;
    d.join_enable = o->join_enable;
    d.join_throw = o->join_throw;
    d.optimizer_in_backward = o->optimizer_in_backward;
    d.join_mid_step = o->join_mid_step;
    d.fail_at_step = o->fail_at_step;
    d.fail_rank = (int)o->fail_rank;
    d.sleep_ms_per_step = o->sleep_ms_per_step;
    d.sleep_rank = (int)o->sleep_rank;
    d.checkpoint_at_end = o->checkpoint_at_end;
    d.init_from = o->init_from;
    a->dump_weights = o->dump_weights;
    if (parse_steps(o->skip_steps, &d) != 0)
        return 2;
    if (strcmp(layout, "fsdp2") == 0) {
        d.layout = PSHARD_LAYOUT_FSDP2;
    } else if (strcmp(layout, "fsdp1") == 0) {
        d.layout = PSHARD_LAYOUT_FSDP1;
    } else {
        fprintf(stderr, PROG ": --layout '%s' is not fsdp2|fsdp1\n", layout);
        return 2;
    }
    return mlp_dist_train(&d);
}

int main(int argc, char **argv)
{
    ps_log_init("mlp");
    mlp_opts_t o;
    ps_config_result_t res;
    mlp_config_t cfg;
    char err[PSHARD_ERRLEN] = "";
    int exit_code = 0;
    if (ps_config_parse(options, PS_ARRAY_LEN(options), argc, argv, &o, &res, err, sizeof(err)) !=
        PSHARD_OK) {
        fprintf(stderr, PROG ": %s (see --help)\n", err);
        exit_code = 2;
        goto out;
    }
    if (res.help) {
        ps_config_usage(stdout, PROG, "[OPTIONS]",
                        "Trains an MLP on a synthetic teacher task, either with pshard (sharded "
                        "across shard servers) or with --local in one process as the reference.",
                        options, PS_ARRAY_LEN(options));
        goto out;
    }
    if (res.version) {
        printf(PROG " %s\n", PSHARD_VERSION_STRING);
        goto out;
    }
    if (res.first_positional < argc) {
        fprintf(stderr, PROG ": unexpected argument '%s' (see --help)\n",
                argv[res.first_positional]);
        exit_code = 2;
        goto out;
    }
    ps_log_level_t level;
    if (!ps_log_parse_level(o.log, &level)) {
        fprintf(stderr, PROG ": --log '%s' is not error|warn|info|debug|trace\n", o.log);
        exit_code = 2;
        goto out;
    }
    ps_log_set_level(level);
    ps_config_log(options, PS_ARRAY_LEN(options), &o, &res);
    if (build_config(&o, &cfg) != 0) {
        exit_code = 2;
        goto out;
    }
    if (cfg.local) {
        exit_code = run_local(&cfg, o.dump_weights);
        goto out;
    }
    exit_code = run_distributed(&cfg, &o);
out:
    ps_config_free(options, PS_ARRAY_LEN(options), &o);
    return exit_code;
}
