/* Unit tests for "who is slow" (coord_straggler): checking untrusted step figures, finding the
 * slowest rank against the median of the ranks' medians, and logging a rank that stays slow
 * once, and its recovery once. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "coord_straggler.h"
#include "ps_test.h"

static coord_member_t members[8];

/* Member i: a ranked shard server with median compute c over window steps, steps in all. */
static void set_member(int i, int rank, double c, uint32_t window, uint64_t steps)
{
    coord_member_t *m = &members[i];
    memset(m, 0, sizeof(*m));
    m->role = COORD_ROLE_SHARD_SERVER;
    m->rank = rank;
    snprintf(m->name, sizeof(m->name), "server-%d", rank);
    m->steps.set = true;
    m->steps.window = window;
    m->steps.steps = steps;
    m->steps.compute_s = c;
    m->steps.step_s = 0.25;
    m->steps.wait_s = 0.25 - c > 0 ? 0.25 - c : 0;
}

static void test_check(void)
{
    char err[256];
    coord_steps_t ok = {.set = true, .window = 50, .steps = 1000, .step_s = 1, .compute_s = 0.5};
    CU_ASSERT_EQUAL(coord_steps_check(&ok, err, sizeof(err)), PSHARD_OK);
    coord_steps_t bad = ok;
    bad.window = 51;
    CU_ASSERT_EQUAL(coord_steps_check(&bad, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "window 51"));
    err[0] = '\0'; /* (ps_errf keeps the first error) */
    bad = ok;
    bad.compute_s = NAN;
    CU_ASSERT_EQUAL(coord_steps_check(&bad, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "compute_seconds"));
    err[0] = '\0';
    bad = ok;
    bad.wait_s = -0.001;
    CU_ASSERT_EQUAL(coord_steps_check(&bad, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "wait_seconds"));
    bad = ok;
    bad.step_s = INFINITY;
    CU_ASSERT_EQUAL(coord_steps_check(&bad, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    bad = ok;
    bad.step_s = 1e9;
    CU_ASSERT_EQUAL(coord_steps_check(&bad, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
}

static void test_find(void)
{
    coord_straggler_t s;
    /* One rank alone has nobody to be compared with. */
    set_member(0, 0, 0.01, 50, 100);
    coord_straggler_find(members, 1, 1.5, 10, &s);
    CU_ASSERT_EQUAL(s.rank, -1);
    /* Rank 3 at 0.18 s against ranks at 0.1 s: 1.8x the median of the medians. */
    set_member(0, 2, 0.10, 50, 100);
    set_member(1, 0, 0.10, 50, 100);
    set_member(2, 3, 0.18, 50, 100);
    set_member(3, 1, 0.11, 50, 100);
    coord_straggler_find(members, 4, 1.5, 10, &s);
    CU_ASSERT_EQUAL(s.rank, 3);
    CU_ASSERT_STRING_EQUAL(s.name, "server-3");
    CU_ASSERT_EQUAL(s.ranks, 4);
    CU_ASSERT_DOUBLE_EQUAL(s.median_s, 0.105, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(s.ratio, 0.18 / 0.105, 1e-9);
    CU_ASSERT_TRUE(s.slow);
    char line[512];
    coord_straggler_format(&s, line, sizeof(line));
    CU_ASSERT_PTR_NOT_NULL(strstr(line, "rank 3 (server-3) is 1.71x the median step compute"));
    /* Under the threshold: named, not slow. */
    coord_straggler_find(members, 4, 2.0, 10, &s);
    CU_ASSERT_EQUAL(s.rank, 3);
    CU_ASSERT_FALSE(s.slow);
    /* Too few steps, a trainer, an unranked server and no figures are left out. */
    members[2].steps.window = 5;
    members[3].role = COORD_ROLE_TRAINER;
    members[3].rank = -1;
    set_member(4, -1, 9.0, 50, 100);
    memset(&members[5], 0, sizeof(members[5]));
    members[5].role = COORD_ROLE_SHARD_SERVER;
    members[5].rank = 4;
    coord_straggler_find(members, 6, 1.5, 10, &s);
    CU_ASSERT_EQUAL(s.ranks, 2);
    CU_ASSERT_EQUAL(s.rank, 0); /* a tie: the lower rank */
    CU_ASSERT_DOUBLE_EQUAL(s.ratio, 1.0, 1e-12);
    CU_ASSERT_FALSE(s.slow);
    /* Every median 0: the ratio stays finite. */
    set_member(0, 0, 0, 50, 100);
    set_member(1, 1, 0, 50, 100);
    coord_straggler_find(members, 2, 1.5, 10, &s);
    CU_ASSERT_TRUE(isfinite(s.ratio));
    CU_ASSERT_FALSE(s.slow);
}

static void test_watch(void)
{
    coord_straggler_watch_t w;
    coord_straggler_watch_init(&w);
    char msg[1024];
    coord_straggler_t s = {.rank = 2,
                           .ratio = 3,
                           .compute_s = 0.3,
                           .median_s = 0.1,
                           .window = 50,
                           .steps = 100,
                           .ranks = 3,
                           .slow = true};
    snprintf(s.name, sizeof(s.name), "server-2");
    /* Slow, but not for 10 steps yet. */
    CU_ASSERT_EQUAL(coord_straggler_watch_update(&w, &s, 10, 1.5, msg, sizeof(msg)),
                    COORD_STRAGGLER_QUIET);
    s.steps = 105;
    CU_ASSERT_EQUAL(coord_straggler_watch_update(&w, &s, 10, 1.5, msg, sizeof(msg)),
                    COORD_STRAGGLER_QUIET);
    s.steps = 110;
    CU_ASSERT_EQUAL(coord_straggler_watch_update(&w, &s, 10, 1.5, msg, sizeof(msg)),
                    COORD_STRAGGLER_SLOW);
    CU_ASSERT_PTR_NOT_NULL(strstr(msg, "rank 2 (server-2) is 3.00x"));
    /* Once only while it stays slow. */
    s.steps = 200;
    CU_ASSERT_EQUAL(coord_straggler_watch_update(&w, &s, 10, 1.5, msg, sizeof(msg)),
                    COORD_STRAGGLER_QUIET);
    /* Recovered: said once, then quiet. */
    s.slow = false;
    s.ratio = 1.1;
    CU_ASSERT_EQUAL(coord_straggler_watch_update(&w, &s, 10, 1.5, msg, sizeof(msg)),
                    COORD_STRAGGLER_RECOVERED);
    CU_ASSERT_PTR_NOT_NULL(strstr(msg, "rank 2 is no longer slow"));
    CU_ASSERT_EQUAL(coord_straggler_watch_update(&w, &s, 10, 1.5, msg, sizeof(msg)),
                    COORD_STRAGGLER_QUIET);
    /* Slow again: counted from the start again, logged again. */
    s.slow = true;
    s.steps = 300;
    CU_ASSERT_EQUAL(coord_straggler_watch_update(&w, &s, 10, 1.5, msg, sizeof(msg)),
                    COORD_STRAGGLER_QUIET);
    s.steps = 310;
    CU_ASSERT_EQUAL(coord_straggler_watch_update(&w, &s, 10, 1.5, msg, sizeof(msg)),
                    COORD_STRAGGLER_SLOW);
    /* A slow rank that is slow only briefly, never logged, recovers in silence. */
    coord_straggler_watch_init(&w);
    s.steps = 400;
    coord_straggler_watch_update(&w, &s, 10, 1.5, msg, sizeof(msg));
    s.slow = false;
    CU_ASSERT_EQUAL(coord_straggler_watch_update(&w, &s, 10, 1.5, msg, sizeof(msg)),
                    COORD_STRAGGLER_QUIET);
    CU_ASSERT_STRING_EQUAL(msg, "");
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"step figures are checked", test_check},
        {"the slowest rank against the median of medians", test_find},
        {"a rank that stays slow is logged once", test_watch},
        {NULL, NULL},
    };
    return ps_test_main("coord_straggler", cases);
}
