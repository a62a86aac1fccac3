/* CUnit runner used by every unit suite; see ps_test.h. */
#include "ps_test.h"
#include "ps_proc.h"

#include <stdio.h>

int ps_test_main(const char *suite_name, const ps_test_case_t *cases)
{
    if (CU_initialize_registry() != CUE_SUCCESS)
        return 2;
    CU_pSuite suite = CU_add_suite(suite_name, NULL, NULL);
    if (!suite) {
        CU_cleanup_registry();
        return 2;
    }
    for (const ps_test_case_t *c = cases; c->name; c++) {
        if (!CU_add_test(suite, c->name, c->fn)) {
            CU_cleanup_registry();
            return 2;
        }
    }
    CU_basic_set_mode(CU_BRM_VERBOSE);
    CU_basic_run_tests();
    unsigned failed = CU_get_number_of_failures() + CU_get_number_of_tests_failed();
    unsigned ran = CU_get_number_of_tests_run();
    CU_cleanup_registry();
    if (failed)
        ps_proc_keep_logs(); /* failing runs keep the coordinators' logs to read */
    if (ran == 0) {
        fprintf(stderr, "%s: no test ran\n", suite_name);
        return 1;
    }
    return failed ? 1 : 0;
}
