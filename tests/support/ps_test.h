/* Shared CUnit runner for pshard's unit suites: each test program lists its tests in a table
 * and calls ps_test_main, which runs them and returns non-zero on any failure. */
#ifndef PS_TEST_H
#define PS_TEST_H

#include <CUnit/Basic.h>

typedef struct {
    const char *name;
    void (*fn)(void);
} ps_test_case_t;

/* Runs every case in cases (terminated by {NULL, NULL}) as one suite named suite_name.
 * Returns 0 when all pass, 1 on failures, 2 when CUnit could not start. */
int ps_test_main(const char *suite_name, const ps_test_case_t *cases);

#endif
