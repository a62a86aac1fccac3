/* Unit tests for pshard_status_t (names, messages, the one gRPC mapping) and for the small
 * helpers of common/src/util.c (integer parsing, natural order, first-error buffers, bounded
 * copies, constant-time comparison). */
#include <grpc/status.h>
#include <stdint.h>
#include <string.h>

#include "ps_test.h"
#include "pshard/rpc.h"
#include "pshard/status.h"
#include "pshard/util.h"

typedef struct {
    pshard_status_t status;
    const char *name;
} status_entry_t;

static const status_entry_t all_statuses[] = {
#define STATUS_ENTRY_(name, value, msg) {name, #name},
    PSHARD_STATUS_MAP(STATUS_ENTRY_)
#undef STATUS_ENTRY_
};
#define N_STATUSES (sizeof(all_statuses) / sizeof(all_statuses[0]))

static void test_names_match_enum(void)
{
    CU_ASSERT(N_STATUSES >= 22);
    for (size_t i = 0; i < N_STATUSES; i++) {
        const char *name = pshard_status_name(all_statuses[i].status);
        CU_ASSERT_PTR_NOT_NULL_FATAL(name);
        CU_ASSERT_STRING_EQUAL(name, all_statuses[i].name);
    }
    CU_ASSERT_STRING_EQUAL(pshard_status_name(PSHARD_OK), "PSHARD_OK");
    CU_ASSERT_STRING_EQUAL(pshard_status_name(PSHARD_ERR_TIMEOUT), "PSHARD_ERR_TIMEOUT");
    CU_ASSERT_STRING_EQUAL(pshard_status_name(PSHARD_ERR_CANCELLED), "PSHARD_ERR_CANCELLED");
}

static void test_names_distinct_messages_nonempty(void)
{
    for (size_t i = 0; i < N_STATUSES; i++) {
        const char *msg = pshard_status_str(all_statuses[i].status);
        CU_ASSERT_PTR_NOT_NULL_FATAL(msg);
        CU_ASSERT(msg[0] != '\0');
        for (size_t j = 0; j < i; j++) {
            CU_ASSERT(all_statuses[i].status != all_statuses[j].status);
            CU_ASSERT(strcmp(pshard_status_name(all_statuses[i].status),
                             pshard_status_name(all_statuses[j].status)) != 0);
        }
    }
    /* OK is zero and every error is negative, so "rc < 0" tests work. */
    CU_ASSERT_EQUAL((int)PSHARD_OK, 0);
    for (size_t i = 1; i < N_STATUSES; i++)
        CU_ASSERT((int)all_statuses[i].status < 0);
}

static void test_unknown_status(void)
{
    static const int unknown[] = {1, 12345, PSHARD_ERR_LOWEST - 1, -1000, INT32_MIN};
    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
        pshard_status_t s = (pshard_status_t)unknown[i];
        CU_ASSERT_STRING_EQUAL(pshard_status_name(s), "PSHARD_ERR_UNKNOWN");
        CU_ASSERT_PTR_NOT_NULL(pshard_status_str(s));
        CU_ASSERT(pshard_status_str(s)[0] != '\0');
        CU_ASSERT_EQUAL(ps_status_to_grpc(s), GRPC_STATUS_UNKNOWN);
    }
}

static void test_grpc_round_trip(void)
{
    /* Statuses that own their gRPC code map there and back unchanged. */
    static const struct {
        pshard_status_t status;
        grpc_status_code code;
    } owned[] = {
        {PSHARD_OK, GRPC_STATUS_OK},
        {PSHARD_ERR_INVALID_ARGUMENT, GRPC_STATUS_INVALID_ARGUMENT},
        {PSHARD_ERR_TIMEOUT, GRPC_STATUS_DEADLINE_EXCEEDED},
        {PSHARD_ERR_NOT_FOUND, GRPC_STATUS_NOT_FOUND},
        {PSHARD_ERR_PERMISSION, GRPC_STATUS_PERMISSION_DENIED},
        {PSHARD_ERR_ALREADY_EXISTS, GRPC_STATUS_ALREADY_EXISTS},
        {PSHARD_ERR_FAILED_PRECONDITION, GRPC_STATUS_FAILED_PRECONDITION},
        {PSHARD_ERR_RESOURCE_EXHAUSTED, GRPC_STATUS_RESOURCE_EXHAUSTED},
        {PSHARD_ERR_ABORTED, GRPC_STATUS_ABORTED},
        {PSHARD_ERR_UNIMPLEMENTED, GRPC_STATUS_UNIMPLEMENTED},
        {PSHARD_ERR_UNAVAILABLE, GRPC_STATUS_UNAVAILABLE},
        {PSHARD_ERR_UNAUTHENTICATED, GRPC_STATUS_UNAUTHENTICATED},
        {PSHARD_ERR_CANCELLED, GRPC_STATUS_CANCELLED},
    };
    for (size_t i = 0; i < sizeof(owned) / sizeof(owned[0]); i++) {
        int code = ps_status_to_grpc(owned[i].status);
        CU_ASSERT_EQUAL(code, (int)owned[i].code);
        CU_ASSERT_EQUAL(ps_status_from_grpc(code), owned[i].status);
    }
}

static void test_grpc_specific_codes(void)
{
    CU_ASSERT_EQUAL(ps_status_to_grpc(PSHARD_ERR_PEER_LOST), GRPC_STATUS_UNAVAILABLE);
    CU_ASSERT_EQUAL(ps_status_to_grpc(PSHARD_ERR_DESYNC), GRPC_STATUS_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(ps_status_to_grpc(PSHARD_ERR_NO_MEMORY), GRPC_STATUS_RESOURCE_EXHAUSTED);
    CU_ASSERT_EQUAL(ps_status_to_grpc(PSHARD_ERR_RPC), GRPC_STATUS_UNAVAILABLE);
    CU_ASSERT_EQUAL(ps_status_to_grpc(PSHARD_ERR_JOINED), GRPC_STATUS_ABORTED);
    CU_ASSERT_EQUAL(ps_status_to_grpc(PSHARD_ERR_DIVERTED), GRPC_STATUS_ABORTED);
    CU_ASSERT_EQUAL(ps_status_to_grpc(PSHARD_ERR_STEP_ABORTED), GRPC_STATUS_ABORTED);
    CU_ASSERT_EQUAL(ps_status_to_grpc(PSHARD_ERR_INTERNAL), GRPC_STATUS_INTERNAL);
    CU_ASSERT_EQUAL(ps_status_to_grpc(PSHARD_ERR_SYSTEM), GRPC_STATUS_INTERNAL);
    CU_ASSERT_EQUAL(ps_status_to_grpc(PSHARD_ERR_CUDA), GRPC_STATUS_INTERNAL);
    CU_ASSERT_EQUAL(ps_status_to_grpc(PSHARD_ERR_NCCL), GRPC_STATUS_INTERNAL);

    /* Codes no pshard status owns become a generic RPC failure. */
    CU_ASSERT_EQUAL(ps_status_from_grpc(GRPC_STATUS_DATA_LOSS), PSHARD_ERR_RPC);
    CU_ASSERT_EQUAL(ps_status_from_grpc(GRPC_STATUS_UNKNOWN), PSHARD_ERR_RPC);
    CU_ASSERT_EQUAL(ps_status_from_grpc(9999), PSHARD_ERR_RPC);
    CU_ASSERT_EQUAL(ps_status_from_grpc(-1), PSHARD_ERR_RPC);
    CU_ASSERT_EQUAL(ps_status_from_grpc(GRPC_STATUS_OUT_OF_RANGE), PSHARD_ERR_INVALID_ARGUMENT);
}

static void test_errors_never_become_ok(void)
{
    /* An error sent over gRPC must never arrive as success, and success must stay success. */
    for (size_t i = 0; i < N_STATUSES; i++) {
        pshard_status_t s = all_statuses[i].status;
        int code = ps_status_to_grpc(s);
        if (s == PSHARD_OK) {
            CU_ASSERT_EQUAL(code, GRPC_STATUS_OK);
        } else {
            CU_ASSERT(code != GRPC_STATUS_OK);
            CU_ASSERT(ps_status_from_grpc(code) != PSHARD_OK);
        }
    }
}

static void test_parse_i64(void)
{
    int64_t v = 0;
    CU_ASSERT_EQUAL(ps_parse_i64("0", INT64_MIN, INT64_MAX, &v), 0);
    CU_ASSERT_EQUAL(v, 0);
    CU_ASSERT_EQUAL(ps_parse_i64("-17", INT64_MIN, INT64_MAX, &v), 0);
    CU_ASSERT_EQUAL(v, -17);
    CU_ASSERT_EQUAL(ps_parse_i64("+7", INT64_MIN, INT64_MAX, &v), 0);
    CU_ASSERT_EQUAL(v, 7);
    CU_ASSERT_EQUAL(ps_parse_i64("9223372036854775807", INT64_MIN, INT64_MAX, &v), 0);
    CU_ASSERT_EQUAL(v, INT64_MAX);
    CU_ASSERT_EQUAL(ps_parse_i64("-9223372036854775808", INT64_MIN, INT64_MAX, &v), 0);
    CU_ASSERT_EQUAL(v, INT64_MIN);

    /* Overflow, bounds (inclusive) and junk fail and leave *out alone. */
    v = 42;
    CU_ASSERT_EQUAL(ps_parse_i64("9223372036854775808", INT64_MIN, INT64_MAX, &v), -1);
    CU_ASSERT_EQUAL(ps_parse_i64("-9223372036854775809", INT64_MIN, INT64_MAX, &v), -1);
    CU_ASSERT_EQUAL(ps_parse_i64("5", 1, 4, &v), -1);
    CU_ASSERT_EQUAL(ps_parse_i64("0", 1, 4, &v), -1);
    static const char *const junk[] = {"",    " 1",  "1 ",  "1x", "x1", "0x10",
                                       "1.5", "1e3", "--1", "+",  "-"};
    for (size_t i = 0; i < sizeof(junk) / sizeof(junk[0]); i++)
        CU_ASSERT_EQUAL(ps_parse_i64(junk[i], INT64_MIN, INT64_MAX, &v), -1);
    CU_ASSERT_EQUAL(ps_parse_i64(NULL, INT64_MIN, INT64_MAX, &v), -1);
    CU_ASSERT_EQUAL(v, 42);

    CU_ASSERT_EQUAL(ps_parse_i64("1", 1, 4, &v), 0);
    CU_ASSERT_EQUAL(v, 1);
    CU_ASSERT_EQUAL(ps_parse_i64("4", 1, 4, &v), 0);
    CU_ASSERT_EQUAL(v, 4);
    CU_ASSERT_EQUAL(ps_parse_i64("010", INT64_MIN, INT64_MAX, &v), 0);
    CU_ASSERT_EQUAL(v, 10); /* base 10, not octal */
}

static void test_natural_cmp(void)
{
    CU_ASSERT(ps_natural_cmp("s2", "s10") < 0);
    CU_ASSERT(ps_natural_cmp("s10", "s2") > 0);
    CU_ASSERT(ps_natural_cmp("node-2", "node-10") < 0);
    CU_ASSERT(ps_natural_cmp("a", "b") < 0);
    CU_ASSERT(ps_natural_cmp("b", "a") > 0);
    CU_ASSERT_EQUAL(ps_natural_cmp("node-7", "node-7"), 0);
    CU_ASSERT_EQUAL(ps_natural_cmp("", ""), 0);
    CU_ASSERT(ps_natural_cmp("node", "node-1") < 0);
    CU_ASSERT(ps_natural_cmp("node-1", "node") > 0);
    CU_ASSERT(ps_natural_cmp("", "a") < 0);
    CU_ASSERT(ps_natural_cmp("x9y", "x10a") < 0);
    CU_ASSERT(ps_natural_cmp("x10a", "x10b") < 0);
    CU_ASSERT(ps_natural_cmp("h1-r2", "h1-r10") < 0);
    CU_ASSERT(ps_natural_cmp("99", "100") < 0);
}

static void test_errf_first_error_wins(void)
{
    char err[64] = "";
    CU_ASSERT_EQUAL(ps_errf(err, sizeof(err), PSHARD_ERR_TIMEOUT, "first %d", 1),
                    PSHARD_ERR_TIMEOUT);
    CU_ASSERT_STRING_EQUAL(err, "first 1");
    CU_ASSERT_EQUAL(ps_errf(err, sizeof(err), PSHARD_ERR_INTERNAL, "second %d", 2),
                    PSHARD_ERR_INTERNAL);
    CU_ASSERT_STRING_EQUAL(err, "first 1");

    /* NULL or empty buffers are allowed; the status still comes back. */
    CU_ASSERT_EQUAL(ps_errf(NULL, 0, PSHARD_ERR_RPC, "x"), PSHARD_ERR_RPC);
    char one[1] = {'\0'};
    CU_ASSERT_EQUAL(ps_errf(one, 0, PSHARD_ERR_RPC, "x"), PSHARD_ERR_RPC);
    CU_ASSERT_EQUAL(one[0], '\0');

    /* A long message is truncated and NUL-terminated. */
    char small[8];
    memset(small, 0, sizeof(small));
    ps_errf(small, sizeof(small), PSHARD_ERR_RPC, "%s", "a much longer message");
    CU_ASSERT_STRING_EQUAL(small, "a much ");
}

static void test_const_time_eq(void)
{
    CU_ASSERT_TRUE(ps_const_time_eq("secret", 6, "secret", 6));
    CU_ASSERT_FALSE(ps_const_time_eq("secret", 6, "secreT", 6));
    CU_ASSERT_FALSE(ps_const_time_eq("Secret", 6, "secret", 6));
    CU_ASSERT_FALSE(ps_const_time_eq("secret", 6, "secret!", 7));
    CU_ASSERT_FALSE(ps_const_time_eq("secret", 6, "secre", 5));
    CU_ASSERT_TRUE(ps_const_time_eq("", 0, "", 0));
    CU_ASSERT_FALSE(ps_const_time_eq("", 0, "a", 1));
}

static void test_strlcpy_and_snprintf(void)
{
    char buf[4];
    CU_ASSERT_EQUAL(ps_strlcpy(buf, "abc", sizeof(buf)), 0);
    CU_ASSERT_STRING_EQUAL(buf, "abc");
    CU_ASSERT_EQUAL(ps_strlcpy(buf, "abcd", sizeof(buf)), -1);
    CU_ASSERT_STRING_EQUAL(buf, "abc");
    CU_ASSERT_EQUAL(ps_strlcpy(buf, "", sizeof(buf)), 0);
    CU_ASSERT_STRING_EQUAL(buf, "");
    buf[0] = 'z';
    CU_ASSERT_EQUAL(ps_strlcpy(buf, "abc", 0), -1);
    CU_ASSERT_EQUAL(buf[0], 'z');

    char out[6];
    CU_ASSERT_EQUAL(ps_snprintf(out, sizeof(out), "%d", 12345), 0);
    CU_ASSERT_STRING_EQUAL(out, "12345");
    CU_ASSERT_EQUAL(ps_snprintf(out, sizeof(out), "%d", 123456), -1);
    CU_ASSERT_STRING_EQUAL(out, "12345");
}

static void test_clocks(void)
{
    int64_t a = ps_now_ns();
    int64_t b = ps_now_ns();
    CU_ASSERT(a > 0);
    CU_ASSERT(b >= a);
    CU_ASSERT(ps_wall_ms() > INT64_C(1600000000000)); /* after September 2020 */
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"names_match_enum", test_names_match_enum},
        {"names_distinct_messages_nonempty", test_names_distinct_messages_nonempty},
        {"unknown_status", test_unknown_status},
        {"grpc_round_trip", test_grpc_round_trip},
        {"grpc_specific_codes", test_grpc_specific_codes},
        {"errors_never_become_ok", test_errors_never_become_ok},
        {"util_parse_i64", test_parse_i64},
        {"util_natural_cmp", test_natural_cmp},
        {"util_errf_first_error_wins", test_errf_first_error_wins},
        {"util_const_time_eq", test_const_time_eq},
        {"util_strlcpy_and_snprintf", test_strlcpy_and_snprintf},
        {"util_clocks", test_clocks},
        {NULL, NULL},
    };
    return ps_test_main("status", cases);
}
