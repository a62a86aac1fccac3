/* Unit tests for the shard server's per-step timing (shard_steps): step, compute and wait time
 * from an injected clock, overlapping calls counted once, the window's medians and the
 * /metrics families. */
#include <string.h>

#include "ps_test.h"
#include "shard_steps.h"

#define MS(x) ((int64_t)(x)*1000000LL)

static void test_step_figures(void)
{
    shard_steps_t st;
    shard_steps_init(&st);
    shard_step_summary_t sum;
    CU_ASSERT_FALSE(shard_steps_summary(&st, &sum));
    /* The first boundary only starts the clock. */
    shard_steps_boundary(&st, MS(1000), false, 0, 0);
    CU_ASSERT_FALSE(shard_steps_summary(&st, &sum));
    /* A 100 ms step with calls 1000..1020 and, overlapping, 1010..1030 and 1050..1060:
     * 40 ms of wait. */
    shard_steps_op_begin(&st, MS(1000));
    shard_steps_op_begin(&st, MS(1010));
    shard_steps_op_end(&st, MS(1020));
    shard_steps_op_end(&st, MS(1030));
    shard_steps_op_begin(&st, MS(1050));
    shard_steps_op_end(&st, MS(1060));
    /* A call still inside at the boundary: 1090..1100 counts here, 1100..1110 in the next. */
    shard_steps_op_begin(&st, MS(1090));
    shard_steps_boundary(&st, MS(1100), false, 512, 4);
    shard_steps_op_end(&st, MS(1110));
    CU_ASSERT_TRUE(shard_steps_summary(&st, &sum));
    CU_ASSERT_EQUAL(sum.window, 1);
    CU_ASSERT_EQUAL(sum.steps, 1);
    CU_ASSERT_DOUBLE_EQUAL(sum.step_s, 0.100, 1e-9);
    CU_ASSERT_DOUBLE_EQUAL(sum.wait_s, 0.050, 1e-9);
    CU_ASSERT_DOUBLE_EQUAL(sum.compute_s, 0.050, 1e-9);
    CU_ASSERT_EQUAL(st.tokens, 512);
    CU_ASSERT_EQUAL(st.samples, 4);
    shard_steps_boundary(&st, MS(1300), false, 0, 0); /* 200 ms, 10 ms wait */
    shard_steps_boundary(&st, MS(1400), false, 0, 0); /* 100 ms, none */
    CU_ASSERT_TRUE(shard_steps_summary(&st, &sum));
    CU_ASSERT_EQUAL(sum.window, 3);
    CU_ASSERT_DOUBLE_EQUAL(sum.step_s, 0.100, 1e-9);
    CU_ASSERT_DOUBLE_EQUAL(sum.wait_s, 0.010, 1e-9);
    CU_ASSERT_DOUBLE_EQUAL(sum.compute_s, 0.100, 1e-9);
    /* The window keeps the last 50 steps: 60 steps of 10 ms after these. */
    for (int i = 1; i <= 60; i++)
        shard_steps_boundary(&st, MS(1400 + 10 * i), false, 0, 0);
    CU_ASSERT_TRUE(shard_steps_summary(&st, &sum));
    CU_ASSERT_EQUAL(sum.window, SHARD_STEP_WINDOW);
    CU_ASSERT_EQUAL(sum.steps, 63);
    CU_ASSERT_DOUBLE_EQUAL(sum.step_s, 0.010, 1e-9);
    /* A new session: the window restarts, the totals stay. */
    shard_steps_reset(&st);
    CU_ASSERT_FALSE(shard_steps_summary(&st, &sum));
    shard_steps_boundary(&st, MS(5000), false, 0, 0);
    shard_steps_boundary(&st, MS(5300), false, 0, 0);
    CU_ASSERT_TRUE(shard_steps_summary(&st, &sum));
    CU_ASSERT_EQUAL(sum.window, 1);
    CU_ASSERT_EQUAL(sum.steps, 64);
    CU_ASSERT_DOUBLE_EQUAL(sum.step_s, 0.300, 1e-9);
    shard_steps_destroy(&st);
}

/* Once the trainer marks its steps, Steps end none: each step counts once. */
static void test_marks(void)
{
    shard_steps_t st;
    shard_steps_init(&st);
    shard_step_summary_t sum;
    shard_steps_boundary(&st, MS(1000), false, 0, 0);  /* a Step */
    shard_steps_boundary(&st, MS(1050), true, 100, 2); /* the trainer's mark just after it */
    CU_ASSERT_TRUE(shard_steps_summary(&st, &sum));
    CU_ASSERT_EQUAL(sum.steps, 1);
    shard_steps_boundary(&st, MS(1300), false, 0, 0); /* ignored */
    shard_steps_boundary(&st, MS(1350), true, 100, 2);
    CU_ASSERT_TRUE(shard_steps_summary(&st, &sum));
    CU_ASSERT_EQUAL(sum.steps, 2);
    CU_ASSERT_EQUAL(sum.window, 2);
    CU_ASSERT_DOUBLE_EQUAL(sum.step_s, (0.05 + 0.3) / 2, 1e-9);
    CU_ASSERT_EQUAL(st.tokens, 200);
    CU_ASSERT_EQUAL(st.samples, 4);
    /* A new session goes by its Steps again until it marks one. */
    shard_steps_reset(&st);
    shard_steps_boundary(&st, MS(2000), false, 0, 0);
    shard_steps_boundary(&st, MS(2100), false, 0, 0);
    CU_ASSERT_TRUE(shard_steps_summary(&st, &sum));
    CU_ASSERT_EQUAL(sum.steps, 3);
    shard_steps_destroy(&st);
}

static void test_metrics(void)
{
    shard_steps_t st;
    shard_steps_init(&st);
    shard_steps_boundary(&st, MS(1000), false, 0, 0);
    shard_steps_op_begin(&st, MS(1100));
    shard_steps_op_end(&st, MS(1400));
    shard_steps_boundary(&st, MS(2000), false, 1000, 8);
    ps_metrics_t *w = ps_metrics_create();
    CU_ASSERT_PTR_NOT_NULL_FATAL(w);
    shard_steps_metrics(&st, w);
    CU_ASSERT_STRING_EQUAL(ps_metrics_error(w), "");
    const char *t = ps_metrics_text(w, NULL);
    CU_ASSERT_PTR_NOT_NULL(strstr(t, "# TYPE pshard_step_seconds histogram"));
    CU_ASSERT_PTR_NOT_NULL(strstr(t, "# TYPE pshard_step_compute_seconds histogram"));
    CU_ASSERT_PTR_NOT_NULL(strstr(t, "# TYPE pshard_step_wait_seconds histogram"));
    CU_ASSERT_PTR_NOT_NULL(strstr(t, "pshard_step_wait_seconds_sum 0.3\n"));
    CU_ASSERT_PTR_NOT_NULL(strstr(t, "pshard_step_seconds_count 1\n"));
    CU_ASSERT_PTR_NOT_NULL(strstr(t, "pshard_step_tokens_total 1000\n"));
    CU_ASSERT_PTR_NOT_NULL(strstr(t, "pshard_step_samples_total 8\n"));
    CU_ASSERT_PTR_NOT_NULL(strstr(t, "pshard_step_compute_median_seconds 0.7"));
    ps_metrics_destroy(w);
    shard_steps_destroy(&st);
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"step, compute and wait time", test_step_figures},
        {"the trainer's marks end its steps", test_marks},
        {"the /metrics families", test_metrics},
        {NULL, NULL},
    };
    return ps_test_main("shard_steps", cases);
}
