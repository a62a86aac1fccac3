/* pshard-join-bench: Join propagation latency. A trainer (run it under pshardrun --nproc N):
 * each trial, after a barrier, rank 0 calls pshard_join while every other rank runs a one-
 * element all_reduce; the shard servers' agreement tells them rank 0 joined and its server
 * shadows the all_reduce. The latency of a trial is from rank 0's pshard_join call to the
 * last peer's all_reduce returning (same host: one monotonic clock). Then the peers join too,
 * which ends the join, and the next trial starts with everyone active again.
 * Rank 0 prints p50 / p99 / max over the trials.
 * usage: pshardrun --nproc N -- pshard-join-bench [--trials T] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/pshard.h"
#include "pshard/util.h"

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    int trials = 20;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--trials") == 0 && i + 1 < argc) {
            trials = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: pshard-join-bench [--trials T]\n");
            return 2;
        }
    }
    if (trials < 1)
        trials = 1;
    pshard_client_config_t cfg;
    char err[1024] = "";
    pshard_client_t *c = NULL;
    if (pshard_client_config_from_env(&cfg, err, sizeof(err)) != PSHARD_OK ||
        pshard_connect(&cfg, &c, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "pshard-join-bench: %s\n", err);
        return 1;
    }
    int rank = pshard_rank(c), world = pshard_world_size(c);
    /* Join needs a defined model; one small parameter is enough. */
    int64_t shape[1] = {16};
    pshard_param_t p = {"w", 1, shape};
    float init[16] = {0};
    const float *inits[1] = {init};
    pshard_model_config_t mc;
    pshard_model_config_default(&mc, PSHARD_SGD);
    int64_t *lat = calloc((size_t)trials, sizeof(int64_t));
    int64_t *times = calloc((size_t)world, sizeof(int64_t));
    int rc = 1;
    if (!lat || !times || pshard_define_model(c, &p, 1, &mc, inits) != PSHARD_OK)
        goto fail;
    for (int t = 0; t < trials; t++) {
        if (pshard_barrier(c) != PSHARD_OK)
            goto fail;
        int64_t mark;
        pshard_join_result_t jr;
        if (rank == 0) {
            mark = ps_now_ns();
            if (pshard_join(c, NULL, &jr) != PSHARD_OK)
                goto fail;
        } else {
            float x = 1.0f;
            if (pshard_all_reduce(c, &x, 1, PSHARD_FP32, false) != PSHARD_OK)
                goto fail;
            mark = ps_now_ns();
            if (pshard_join(c, NULL, &jr) != PSHARD_OK)
                goto fail;
        }
        if (pshard_all_gather(c, &mark, times, 1, PSHARD_INT64) != PSHARD_OK)
            goto fail;
        int64_t last = times[0];
        for (int r = 1; r < world; r++)
            if (times[r] > last)
                last = times[r];
        lat[t] = last - times[0];
    }
    if (rank == 0) {
        qsort(lat, (size_t)trials, sizeof(int64_t), cmp_i64);
        int p99 = (int)((trials * 99 + 99) / 100) - 1;
        printf("join propagation, %d ranks, %d trials: p50 %.3f ms, p99 %.3f ms, max %.3f ms\n",
               world, trials, (double)lat[trials / 2] / 1e6, (double)lat[p99] / 1e6,
               (double)lat[trials - 1] / 1e6);
    }
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "pshard-join-bench: rank %d: %s\n", rank, pshard_last_error(c));
out:
    free(lat);
    free(times);
    pshard_close(c);
    return rc;
}
