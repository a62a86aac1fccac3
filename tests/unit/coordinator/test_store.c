/* Unit tests for the coordinator key/value store (coord_store): set/get, compare_set and add
 * with torch TCPStore semantics, limits, and waiters fired by writes, ticks, cancel and
 * destroy. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_store.h"
#include "ps_test.h"

/* What one waiter's callback saw. */
typedef struct {
    int calls;
    int order; /* global sequence number of the (last) call */
    pshard_status_t status;
    size_t nkeys;
    bool values_null;
    char values[4][64]; /* first values, NUL-terminated copies */
    size_t lens[4];
    char missing[64];
    bool missing_null;
} seen_t;

static int call_seq;

static void on_wait(void *arg, pshard_status_t status, const uint8_t *const *values,
                    const size_t *lens, size_t nkeys, const char *missing)
{
    seen_t *s = arg;
    s->calls++;
    s->order = ++call_seq;
    s->status = status;
    s->nkeys = nkeys;
    s->values_null = values == NULL;
    s->missing_null = missing == NULL;
    if (missing)
        snprintf(s->missing, sizeof(s->missing), "%s", missing);
    for (size_t i = 0; values && i < nkeys && i < 4; i++) {
        size_t n = lens[i] < sizeof(s->values[i]) - 1 ? lens[i] : sizeof(s->values[i]) - 1;
        memcpy(s->values[i], values[i], n);
        s->values[i][n] = '\0';
        s->lens[i] = lens[i];
    }
}

static pshard_status_t set_str(coord_store_t *st, const char *key, const char *value)
{
    char err[256] = "";
    return coord_store_set(st, key, (const uint8_t *)value, strlen(value), err, sizeof(err));
}

/* True when key holds exactly the text want. */
static bool value_is(coord_store_t *st, const char *key, const char *want)
{
    const uint8_t *v = NULL;
    size_t len = 0;
    char err[256] = "";
    if (coord_store_get(st, key, &v, &len, err, sizeof(err)) != PSHARD_OK)
        return false;
    return len == strlen(want) && memcmp(v, want, len) == 0;
}

static pshard_status_t wait_keys(coord_store_t *st, const char *const *keys, size_t n,
                                 int64_t deadline, seen_t *seen, uint64_t *id)
{
    char err[256] = "";
    pshard_status_t rc =
        coord_store_wait(st, keys, n, deadline, on_wait, seen, id, err, sizeof(err));
    if (rc != PSHARD_OK)
        fprintf(stderr, "wait: %s\n", err);
    return rc;
}

static void test_set_get_overwrite_delete(void)
{
    coord_store_t *st = coord_store_create();
    CU_ASSERT_PTR_NOT_NULL_FATAL(st);
    CU_ASSERT_EQUAL(coord_store_num_keys(st), 0);
    CU_ASSERT_EQUAL(set_str(st, "addr/0", "10.0.0.1:29500"), PSHARD_OK);
    CU_ASSERT_TRUE(value_is(st, "addr/0", "10.0.0.1:29500"));
    CU_ASSERT_EQUAL(set_str(st, "addr/0", "x"), PSHARD_OK);
    CU_ASSERT_TRUE(value_is(st, "addr/0", "x"));
    CU_ASSERT_EQUAL(coord_store_num_keys(st), 1);

    /* Values are copied, and binary (embedded NUL) values work. */
    uint8_t buf[4] = {1, 0, 2, 3};
    char err[256] = "";
    CU_ASSERT_EQUAL(coord_store_set(st, "bin", buf, sizeof(buf), err, sizeof(err)), PSHARD_OK);
    buf[0] = 9;
    const uint8_t *v;
    size_t len;
    CU_ASSERT_EQUAL(coord_store_get(st, "bin", &v, &len, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(len, 4);
    CU_ASSERT_EQUAL(v[0], 1);
    CU_ASSERT_EQUAL(v[3], 3);

    CU_ASSERT_EQUAL(coord_store_set(st, "empty", NULL, 0, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(coord_store_get(st, "empty", &v, &len, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(len, 0);
    CU_ASSERT_EQUAL(coord_store_num_keys(st), 3);

    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_store_get(st, "nope", &v, &len, err, sizeof(err)), PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "\"nope\""));

    CU_ASSERT_EQUAL(coord_store_delete(st, "addr/0", err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(coord_store_get(st, "addr/0", &v, &len, err, sizeof(err)),
                    PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_EQUAL(coord_store_delete(st, "addr/0", err, sizeof(err)), PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_EQUAL(coord_store_num_keys(st), 2);
    CU_ASSERT_TRUE(value_is(st, "empty", ""));
    coord_store_destroy(st);
    coord_store_destroy(NULL);
}

static void test_value_size_limit(void)
{
    coord_store_t *st = coord_store_create();
    uint8_t *big = malloc(COORD_STORE_VALUE_MAX + 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(big);
    memset(big, 'v', COORD_STORE_VALUE_MAX + 1);
    char err[256] = "";
    CU_ASSERT_EQUAL(coord_store_set(st, "k", big, COORD_STORE_VALUE_MAX, err, sizeof(err)),
                    PSHARD_OK);
    const uint8_t *v;
    size_t len;
    CU_ASSERT_EQUAL(coord_store_get(st, "k", &v, &len, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(len, COORD_STORE_VALUE_MAX);

    CU_ASSERT_EQUAL(coord_store_set(st, "k", big, COORD_STORE_VALUE_MAX + 1, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "value is 1048577 bytes; the limit is 1048576"));
    CU_ASSERT_EQUAL(coord_store_get(st, "k", &v, &len, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(len, COORD_STORE_VALUE_MAX); /* unchanged */
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_store_set(st, "k2", NULL, 5, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    free(big);
    coord_store_destroy(st);
}

static void test_key_rules(void)
{
    coord_store_t *st = coord_store_create();
    char err[256] = "";
    CU_ASSERT_EQUAL(coord_store_set(st, "", (const uint8_t *)"v", 1, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "key is empty"));
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_store_set(st, NULL, (const uint8_t *)"v", 1, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    char key[COORD_STORE_KEY_MAX + 2];
    memset(key, 'k', sizeof(key));
    key[COORD_STORE_KEY_MAX + 1] = '\0';
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_store_set(st, key, (const uint8_t *)"v", 1, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "key is 1025 bytes; the limit is 1024"));
    key[COORD_STORE_KEY_MAX] = '\0';
    CU_ASSERT_EQUAL(set_str(st, key, "v"), PSHARD_OK);
    CU_ASSERT_TRUE(value_is(st, key, "v"));
    err[0] = '\0';
    const uint8_t *v;
    size_t len;
    CU_ASSERT_EQUAL(coord_store_get(st, "", &v, &len, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(coord_store_delete(st, "", err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    int64_t r;
    CU_ASSERT_EQUAL(coord_store_add(st, "", 1, &r, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(coord_store_num_keys(st), 1);
    coord_store_destroy(st);
}

static void test_compare_set(void)
{
    coord_store_t *st = coord_store_create();
    char err[256] = "";
    int swapped = -1;
    const uint8_t *v = NULL;
    size_t len = 99;

    /* Absent key, non-empty expected: nothing happens. */
    CU_ASSERT_EQUAL(coord_store_compare_set(st, "k", (const uint8_t *)"old", 3,
                                            (const uint8_t *)"new", 3, &swapped, &v, &len, err,
                                            sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(swapped, 0);
    CU_ASSERT_PTR_NULL(v);
    CU_ASSERT_EQUAL(len, 0);
    CU_ASSERT_EQUAL(coord_store_num_keys(st), 0);

    /* Absent key, empty expected: sets. */
    CU_ASSERT_EQUAL(coord_store_compare_set(st, "k", NULL, 0, (const uint8_t *)"first", 5, &swapped,
                                            &v, &len, err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(swapped, 1);
    CU_ASSERT_EQUAL(len, 5);
    CU_ASSERT_EQUAL(memcmp(v, "first", 5), 0);
    CU_ASSERT_TRUE(value_is(st, "k", "first"));

    /* Mismatch: value stays, the current one comes back. */
    CU_ASSERT_EQUAL(coord_store_compare_set(st, "k", (const uint8_t *)"firsT", 5,
                                            (const uint8_t *)"second", 6, &swapped, &v, &len, err,
                                            sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(swapped, 0);
    CU_ASSERT_EQUAL(len, 5);
    CU_ASSERT_EQUAL(memcmp(v, "first", 5), 0);
    CU_ASSERT_TRUE(value_is(st, "k", "first"));
    /* A prefix of the current value is a mismatch too; so is empty expected on a present key. */
    CU_ASSERT_EQUAL(coord_store_compare_set(st, "k", (const uint8_t *)"fir", 3,
                                            (const uint8_t *)"second", 6, &swapped, &v, &len, err,
                                            sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(swapped, 0);
    CU_ASSERT_EQUAL(coord_store_compare_set(st, "k", NULL, 0, (const uint8_t *)"second", 6,
                                            &swapped, &v, &len, err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(swapped, 0);
    CU_ASSERT_TRUE(value_is(st, "k", "first"));

    /* Match: swaps. */
    CU_ASSERT_EQUAL(coord_store_compare_set(st, "k", (const uint8_t *)"first", 5,
                                            (const uint8_t *)"second", 6, &swapped, &v, &len, err,
                                            sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(swapped, 1);
    CU_ASSERT_EQUAL(len, 6);
    CU_ASSERT_EQUAL(memcmp(v, "second", 6), 0);
    CU_ASSERT_TRUE(value_is(st, "k", "second"));

    /* A present empty value matches an empty expected. */
    CU_ASSERT_EQUAL(set_str(st, "e", ""), PSHARD_OK);
    CU_ASSERT_EQUAL(coord_store_compare_set(st, "e", NULL, 0, (const uint8_t *)"x", 1, &swapped, &v,
                                            &len, err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(swapped, 1);
    CU_ASSERT_TRUE(value_is(st, "e", "x"));

    /* Limits as for set. */
    uint8_t *big = calloc(1, COORD_STORE_VALUE_MAX + 1);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_store_compare_set(st, "k", (const uint8_t *)"second", 6, big,
                                            COORD_STORE_VALUE_MAX + 1, &swapped, &v, &len, err,
                                            sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "1048577 bytes; the limit is 1048576"));
    CU_ASSERT_TRUE(value_is(st, "k", "second"));
    free(big);
    coord_store_destroy(st);
}

static void test_add(void)
{
    coord_store_t *st = coord_store_create();
    char err[256] = "";
    int64_t r = 0;
    CU_ASSERT_EQUAL(coord_store_add(st, "n", 5, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(r, 5);
    CU_ASSERT_TRUE(value_is(st, "n", "5"));
    CU_ASSERT_EQUAL(coord_store_add(st, "n", 3, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(r, 8);
    CU_ASSERT_EQUAL(coord_store_add(st, "n", -10, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(r, -2);
    CU_ASSERT_TRUE(value_is(st, "n", "-2"));
    CU_ASSERT_EQUAL(coord_store_add(st, "zero", 0, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(r, 0);
    CU_ASSERT_TRUE(value_is(st, "zero", "0"));

    /* A value set as text counts too. */
    CU_ASSERT_EQUAL(set_str(st, "t", "41"), PSHARD_OK);
    CU_ASSERT_EQUAL(coord_store_add(st, "t", 1, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(r, 42);

    static const char *const not_ints[] = {"abc", "", "12x", " 1", "1.5", "+", "-"};
    for (size_t i = 0; i < sizeof(not_ints) / sizeof(not_ints[0]); i++) {
        CU_ASSERT_EQUAL(set_str(st, "bad", not_ints[i]), PSHARD_OK);
        err[0] = '\0';
        CU_ASSERT_EQUAL(coord_store_add(st, "bad", 1, &r, err, sizeof(err)),
                        PSHARD_ERR_INVALID_ARGUMENT);
        CU_ASSERT_PTR_NOT_NULL(strstr(err, "not a base-10 integer"));
        CU_ASSERT_TRUE(value_is(st, "bad", not_ints[i]));
    }
    uint8_t with_nul[3] = {'1', 0, '2'};
    CU_ASSERT_EQUAL(coord_store_set(st, "bad", with_nul, 3, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(coord_store_add(st, "bad", 1, &r, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);

    CU_ASSERT_EQUAL(set_str(st, "max", "9223372036854775807"), PSHARD_OK);
    err[0] = '\0';
    r = 7;
    CU_ASSERT_EQUAL(coord_store_add(st, "max", 1, &r, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "overflows int64"));
    CU_ASSERT_EQUAL(r, 7);
    CU_ASSERT_TRUE(value_is(st, "max", "9223372036854775807"));
    CU_ASSERT_EQUAL(coord_store_add(st, "max", -1, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(r, INT64_MAX - 1);

    CU_ASSERT_EQUAL(set_str(st, "min", "-9223372036854775808"), PSHARD_OK);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_store_add(st, "min", -1, &r, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "overflows int64"));
    CU_ASSERT_EQUAL(coord_store_add(st, "min", INT64_MAX, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(r, -1);

    CU_ASSERT_EQUAL(set_str(st, "huge", "99999999999999999999"), PSHARD_OK);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_store_add(st, "huge", 1, &r, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "outside the int64 range"));
    coord_store_destroy(st);
}

static void test_wait_satisfied_immediately(void)
{
    coord_store_t *st = coord_store_create();
    set_str(st, "a", "A");
    set_str(st, "b", "BB");
    seen_t seen = {0};
    const char *keys[] = {"b", "a", "b"};
    uint64_t id = 0;
    CU_ASSERT_EQUAL(wait_keys(st, keys, 3, INT64_MAX, &seen, &id), PSHARD_OK);
    CU_ASSERT_EQUAL(seen.calls, 1);
    CU_ASSERT_EQUAL(seen.status, PSHARD_OK);
    CU_ASSERT_EQUAL(seen.nkeys, 3);
    CU_ASSERT_FALSE(seen.values_null);
    CU_ASSERT_TRUE(seen.missing_null);
    CU_ASSERT_STRING_EQUAL(seen.values[0], "BB");
    CU_ASSERT_STRING_EQUAL(seen.values[1], "A");
    CU_ASSERT_STRING_EQUAL(seen.values[2], "BB");
    CU_ASSERT_EQUAL(seen.lens[0], 2);
    CU_ASSERT_EQUAL(coord_store_num_waiters(st), 0);
    CU_ASSERT_NOT_EQUAL(id, 0);
    CU_ASSERT_EQUAL(coord_store_cancel_wait(st, id), PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_EQUAL(seen.calls, 1);
    coord_store_destroy(st);
    CU_ASSERT_EQUAL(seen.calls, 1);
}

static void test_wait_satisfied_later_by_set(void)
{
    coord_store_t *st = coord_store_create();
    seen_t seen = {0};
    /* Keys are copied: the caller's buffers may change after wait returns. */
    char k0[8] = "peer/1", k1[8] = "peer/0";
    const char *keys[] = {k0, k1};
    uint64_t id = 0;
    CU_ASSERT_EQUAL(wait_keys(st, keys, 2, 1000, &seen, &id), PSHARD_OK);
    memset(k0, 'x', 6);
    memset(k1, 'y', 6);
    CU_ASSERT_EQUAL(seen.calls, 0);
    CU_ASSERT_EQUAL(coord_store_num_waiters(st), 1);
    CU_ASSERT_EQUAL(coord_store_next_deadline_ns(st), 1000);
    CU_ASSERT_EQUAL(set_str(st, "peer/0", "host0"), PSHARD_OK);
    CU_ASSERT_EQUAL(seen.calls, 0);
    CU_ASSERT_EQUAL(set_str(st, "peer/0", "host0b"), PSHARD_OK); /* overwrite: still one */
    CU_ASSERT_EQUAL(seen.calls, 0);
    CU_ASSERT_EQUAL(set_str(st, "peer/1", "host1"), PSHARD_OK);
    CU_ASSERT_EQUAL(seen.calls, 1);
    CU_ASSERT_EQUAL(seen.status, PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(seen.values[0], "host1");
    CU_ASSERT_STRING_EQUAL(seen.values[1], "host0b");
    CU_ASSERT_EQUAL(coord_store_num_waiters(st), 0);
    CU_ASSERT_EQUAL(coord_store_next_deadline_ns(st), INT64_MAX);
    /* Exactly once: later writes, ticks, cancel and destroy do not call it again. */
    CU_ASSERT_EQUAL(set_str(st, "peer/1", "again"), PSHARD_OK);
    CU_ASSERT_EQUAL(coord_store_tick(st, 5000), 0);
    CU_ASSERT_EQUAL(coord_store_cancel_wait(st, id), PSHARD_ERR_NOT_FOUND);
    coord_store_destroy(st);
    CU_ASSERT_EQUAL(seen.calls, 1);
}

static void test_wait_satisfied_by_add_and_compare_set(void)
{
    coord_store_t *st = coord_store_create();
    seen_t by_add = {0}, by_cas = {0};
    const char *k_add[] = {"count"};
    const char *k_cas[] = {"lock"};
    CU_ASSERT_EQUAL(wait_keys(st, k_add, 1, INT64_MAX, &by_add, NULL), PSHARD_OK);
    CU_ASSERT_EQUAL(wait_keys(st, k_cas, 1, INT64_MAX, &by_cas, NULL), PSHARD_OK);
    char err[256] = "";
    int64_t r;
    CU_ASSERT_EQUAL(coord_store_add(st, "count", 4, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(by_add.calls, 1);
    CU_ASSERT_STRING_EQUAL(by_add.values[0], "4");
    CU_ASSERT_EQUAL(by_cas.calls, 0);

    int swapped;
    const uint8_t *v;
    size_t len;
    /* A failed compare_set on an absent key creates nothing and fires nothing. */
    CU_ASSERT_EQUAL(coord_store_compare_set(st, "lock", (const uint8_t *)"x", 1,
                                            (const uint8_t *)"me", 2, &swapped, &v, &len, err,
                                            sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(by_cas.calls, 0);
    CU_ASSERT_EQUAL(coord_store_compare_set(st, "lock", NULL, 0, (const uint8_t *)"me", 2, &swapped,
                                            &v, &len, err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(swapped, 1);
    CU_ASSERT_EQUAL(by_cas.calls, 1);
    CU_ASSERT_STRING_EQUAL(by_cas.values[0], "me");
    coord_store_destroy(st);
}

static void test_wait_timeout_names_missing_key(void)
{
    coord_store_t *st = coord_store_create();
    seen_t seen = {0};
    const char *keys[] = {"a", "b", "c"};
    CU_ASSERT_EQUAL(wait_keys(st, keys, 3, 100, &seen, NULL), PSHARD_OK);
    set_str(st, "a", "1");
    CU_ASSERT_EQUAL(coord_store_next_deadline_ns(st), 100);
    CU_ASSERT_EQUAL(coord_store_tick(st, 99), 0);
    CU_ASSERT_EQUAL(seen.calls, 0);
    CU_ASSERT_EQUAL(coord_store_tick(st, 100), 1);
    CU_ASSERT_EQUAL(seen.calls, 1);
    CU_ASSERT_EQUAL(seen.status, PSHARD_ERR_TIMEOUT);
    CU_ASSERT_TRUE(seen.values_null);
    CU_ASSERT_FALSE(seen.missing_null);
    CU_ASSERT_STRING_EQUAL(seen.missing, "b");
    CU_ASSERT_EQUAL(seen.nkeys, 3);
    CU_ASSERT_EQUAL(coord_store_num_waiters(st), 0);
    CU_ASSERT_EQUAL(coord_store_next_deadline_ns(st), INT64_MAX);
    set_str(st, "b", "2");
    set_str(st, "c", "3");
    CU_ASSERT_EQUAL(coord_store_tick(st, 200), 0);
    CU_ASSERT_EQUAL(seen.calls, 1);
    coord_store_destroy(st);
}

static void test_tick_fires_only_expired(void)
{
    coord_store_t *st = coord_store_create();
    seen_t s1 = {0}, s2 = {0}, s3 = {0};
    const char *keys[] = {"k"};
    CU_ASSERT_EQUAL(wait_keys(st, keys, 1, 300, &s1, NULL), PSHARD_OK);
    CU_ASSERT_EQUAL(wait_keys(st, keys, 1, 100, &s2, NULL), PSHARD_OK);
    CU_ASSERT_EQUAL(wait_keys(st, keys, 1, 200, &s3, NULL), PSHARD_OK);
    CU_ASSERT_EQUAL(coord_store_next_deadline_ns(st), 100);
    CU_ASSERT_EQUAL(coord_store_tick(st, 250), 2);
    CU_ASSERT_EQUAL(s1.calls, 0);
    CU_ASSERT_EQUAL(s2.calls, 1);
    CU_ASSERT_EQUAL(s3.calls, 1);
    CU_ASSERT_STRING_EQUAL(s2.missing, "k");
    CU_ASSERT_EQUAL(coord_store_next_deadline_ns(st), 300);
    CU_ASSERT_EQUAL(coord_store_num_waiters(st), 1);
    set_str(st, "k", "v");
    CU_ASSERT_EQUAL(s1.calls, 1);
    CU_ASSERT_EQUAL(s1.status, PSHARD_OK);
    coord_store_destroy(st);
}

static void test_cancel(void)
{
    coord_store_t *st = coord_store_create();
    seen_t a = {0}, b = {0};
    const char *keys[] = {"k"};
    uint64_t ida = 0, idb = 0;
    CU_ASSERT_EQUAL(wait_keys(st, keys, 1, INT64_MAX, &a, &ida), PSHARD_OK);
    CU_ASSERT_EQUAL(wait_keys(st, keys, 1, INT64_MAX, &b, &idb), PSHARD_OK);
    CU_ASSERT_NOT_EQUAL(ida, idb);
    CU_ASSERT_EQUAL(coord_store_cancel_wait(st, ida), PSHARD_OK);
    CU_ASSERT_EQUAL(a.calls, 1);
    CU_ASSERT_EQUAL(a.status, PSHARD_ERR_CANCELLED);
    CU_ASSERT_TRUE(a.values_null);
    CU_ASSERT_TRUE(a.missing_null);
    CU_ASSERT_EQUAL(coord_store_num_waiters(st), 1);
    CU_ASSERT_EQUAL(coord_store_cancel_wait(st, ida), PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_EQUAL(coord_store_cancel_wait(st, 987654), PSHARD_ERR_NOT_FOUND);
    set_str(st, "k", "v");
    CU_ASSERT_EQUAL(a.calls, 1);
    CU_ASSERT_EQUAL(b.calls, 1);
    CU_ASSERT_EQUAL(b.status, PSHARD_OK);
    coord_store_destroy(st);
}

static void test_destroy_cancels_pending(void)
{
    coord_store_t *st = coord_store_create();
    seen_t a = {0}, b = {0};
    const char *ka[] = {"x"};
    const char *kb[] = {"y", "z"};
    CU_ASSERT_EQUAL(wait_keys(st, ka, 1, 100, &a, NULL), PSHARD_OK);
    CU_ASSERT_EQUAL(wait_keys(st, kb, 2, INT64_MAX, &b, NULL), PSHARD_OK);
    set_str(st, "y", "1");
    coord_store_destroy(st);
    CU_ASSERT_EQUAL(a.calls, 1);
    CU_ASSERT_EQUAL(a.status, PSHARD_ERR_CANCELLED);
    CU_ASSERT_EQUAL(b.calls, 1);
    CU_ASSERT_EQUAL(b.status, PSHARD_ERR_CANCELLED);
    CU_ASSERT_TRUE(b.values_null);
    CU_ASSERT_TRUE(b.missing_null);
}

static void test_one_set_fires_several_waiters(void)
{
    coord_store_t *st = coord_store_create();
    seen_t s[5] = {{0}};
    const char *k[] = {"k"};
    const char *k_other[] = {"k", "other"};
    const char *other_k[] = {"other", "k"};
    const char *unrelated[] = {"u"};
    set_str(st, "other", "O");
    CU_ASSERT_EQUAL(wait_keys(st, k, 1, INT64_MAX, &s[0], NULL), PSHARD_OK);
    CU_ASSERT_EQUAL(wait_keys(st, unrelated, 1, INT64_MAX, &s[1], NULL), PSHARD_OK);
    CU_ASSERT_EQUAL(wait_keys(st, k_other, 2, INT64_MAX, &s[2], NULL), PSHARD_OK);
    CU_ASSERT_EQUAL(wait_keys(st, other_k, 2, INT64_MAX, &s[3], NULL), PSHARD_OK);
    CU_ASSERT_EQUAL(wait_keys(st, k, 1, INT64_MAX, &s[4], NULL), PSHARD_OK);
    CU_ASSERT_EQUAL(coord_store_num_waiters(st), 5);
    call_seq = 0;
    CU_ASSERT_EQUAL(set_str(st, "k", "K"), PSHARD_OK);
    CU_ASSERT_EQUAL(coord_store_num_waiters(st), 1);
    int fired[] = {0, 2, 3, 4};
    for (int i = 0; i < 4; i++) {
        seen_t *w = &s[fired[i]];
        CU_ASSERT_EQUAL(w->calls, 1);
        CU_ASSERT_EQUAL(w->status, PSHARD_OK);
        CU_ASSERT_EQUAL(w->order, i + 1); /* in the order the waits were made */
    }
    CU_ASSERT_STRING_EQUAL(s[2].values[0], "K");
    CU_ASSERT_STRING_EQUAL(s[2].values[1], "O");
    CU_ASSERT_STRING_EQUAL(s[3].values[0], "O");
    CU_ASSERT_STRING_EQUAL(s[3].values[1], "K");
    CU_ASSERT_EQUAL(s[1].calls, 0);
    set_str(st, "u", "U");
    CU_ASSERT_EQUAL(s[1].calls, 1);
    coord_store_destroy(st);
    for (int i = 0; i < 5; i++)
        CU_ASSERT_EQUAL(s[i].calls, 1);
}

static void test_wait_needs_all_keys_at_once(void)
{
    coord_store_t *st = coord_store_create();
    seen_t seen = {0};
    const char *keys[] = {"a", "b"};
    char err[256] = "";
    CU_ASSERT_EQUAL(wait_keys(st, keys, 2, INT64_MAX, &seen, NULL), PSHARD_OK);
    set_str(st, "a", "1");
    CU_ASSERT_EQUAL(coord_store_delete(st, "a", err, sizeof(err)), PSHARD_OK);
    set_str(st, "b", "2");
    CU_ASSERT_EQUAL(seen.calls, 0);
    set_str(st, "a", "3");
    CU_ASSERT_EQUAL(seen.calls, 1);
    CU_ASSERT_STRING_EQUAL(seen.values[0], "3");
    CU_ASSERT_STRING_EQUAL(seen.values[1], "2");
    coord_store_destroy(st);
}

static void test_wait_validation(void)
{
    coord_store_t *st = coord_store_create();
    seen_t seen = {0};
    char err[256] = "";
    const char *one[] = {"a"};
    CU_ASSERT_EQUAL(coord_store_wait(st, one, 0, 0, on_wait, &seen, NULL, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_store_wait(st, one, 1, 0, NULL, &seen, NULL, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    const char *with_empty[] = {"a", ""};
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_store_wait(st, with_empty, 2, 0, on_wait, &seen, NULL, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "keys[1] is empty"));

    const char **many = calloc(COORD_STORE_WAIT_KEYS_MAX + 1, sizeof(*many));
    for (size_t i = 0; i < COORD_STORE_WAIT_KEYS_MAX + 1; i++)
        many[i] = "k";
    err[0] = '\0';
    CU_ASSERT_EQUAL(coord_store_wait(st, many, COORD_STORE_WAIT_KEYS_MAX + 1, 0, on_wait, &seen,
                                     NULL, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "1025 keys; the limit is 1024"));
    CU_ASSERT_EQUAL(coord_store_wait(st, many, COORD_STORE_WAIT_KEYS_MAX, INT64_MAX, on_wait, &seen,
                                     NULL, err, sizeof(err)),
                    PSHARD_OK);
    free(many);
    CU_ASSERT_EQUAL(seen.calls, 0);
    CU_ASSERT_EQUAL(coord_store_num_waiters(st), 1);
    set_str(st, "k", "v");
    CU_ASSERT_EQUAL(seen.calls, 1);
    CU_ASSERT_EQUAL(seen.nkeys, COORD_STORE_WAIT_KEYS_MAX);
    coord_store_destroy(st);
}

static int counted_calls;
static void count_call(void *arg, pshard_status_t status, const uint8_t *const *values,
                       const size_t *lens, size_t nkeys, const char *missing)
{
    (void)arg, (void)status, (void)values, (void)lens, (void)nkeys, (void)missing;
    counted_calls++;
}

static void test_waiter_limit(void)
{
    coord_store_t *st = coord_store_create();
    const char *keys[] = {"never"};
    char err[256] = "";
    counted_calls = 0;
    for (int i = 0; i < COORD_STORE_MAX_WAITERS; i++)
        CU_ASSERT_EQUAL_FATAL(
            coord_store_wait(st, keys, 1, INT64_MAX, count_call, NULL, NULL, err, sizeof(err)),
            PSHARD_OK);
    CU_ASSERT_EQUAL(
        coord_store_wait(st, keys, 1, INT64_MAX, count_call, NULL, NULL, err, sizeof(err)),
        PSHARD_ERR_RESOURCE_EXHAUSTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "the limit is 16384"));
    /* A wait that completes at once does not need a slot. */
    set_str(st, "now", "1");
    const char *now_keys[] = {"now"};
    CU_ASSERT_EQUAL(
        coord_store_wait(st, now_keys, 1, INT64_MAX, count_call, NULL, NULL, err, sizeof(err)),
        PSHARD_OK);
    CU_ASSERT_EQUAL(counted_calls, 1);
    CU_ASSERT_EQUAL(coord_store_num_waiters(st), COORD_STORE_MAX_WAITERS);
    set_str(st, "never", "now");
    CU_ASSERT_EQUAL(counted_calls, 1 + COORD_STORE_MAX_WAITERS);
    CU_ASSERT_EQUAL(coord_store_num_waiters(st), 0);
    coord_store_destroy(st);
}

static void test_key_count_limit(void)
{
    coord_store_t *st = coord_store_create();
    char key[32], err[256] = "";
    for (int i = 0; i < COORD_STORE_MAX_KEYS; i++) {
        snprintf(key, sizeof(key), "key/%d", i);
        CU_ASSERT_EQUAL_FATAL(coord_store_set(st, key, (const uint8_t *)"v", 1, err, sizeof(err)),
                              PSHARD_OK);
    }
    CU_ASSERT_EQUAL(coord_store_num_keys(st), COORD_STORE_MAX_KEYS);
    CU_ASSERT_EQUAL(coord_store_set(st, "one-more", (const uint8_t *)"v", 1, err, sizeof(err)),
                    PSHARD_ERR_RESOURCE_EXHAUSTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "65536 keys; the limit is 65536"));
    int64_t r;
    CU_ASSERT_EQUAL(coord_store_add(st, "one-more", 1, &r, err, sizeof(err)),
                    PSHARD_ERR_RESOURCE_EXHAUSTED);
    /* Overwriting an existing key is still fine, and a delete makes room. */
    CU_ASSERT_EQUAL(set_str(st, "key/7", "w"), PSHARD_OK);
    CU_ASSERT_EQUAL(coord_store_delete(st, "key/3", err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(set_str(st, "one-more", "v"), PSHARD_OK);
    /* Every key is still where it should be after all the growth. */
    int found = 0;
    for (int i = 0; i < COORD_STORE_MAX_KEYS; i++) {
        snprintf(key, sizeof(key), "key/%d", i);
        found += value_is(st, key, i == 7 ? "w" : "v");
    }
    CU_ASSERT_EQUAL(found, COORD_STORE_MAX_KEYS - 1);
    coord_store_destroy(st);
}

/* Deleting many keys keeps every other key reachable (backward-shift deletion). */
/* Stores made with one usage (a coordinator's jobs) share the key limit: filling it from two
 * stores refuses the next key in either, with a message that says what to do, and ending one
 * store (a job that ended) gives its keys back. */
static void test_shared_usage(void)
{
    coord_store_usage_t usage = {0};
    coord_store_t *a = coord_store_create_shared(&usage);
    coord_store_t *b = coord_store_create_shared(&usage);
    CU_ASSERT_PTR_NOT_NULL_FATAL(a);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    char key[32], err[512] = "";
    for (int i = 0; i < COORD_STORE_MAX_KEYS; i++) {
        snprintf(key, sizeof(key), "key/%d", i);
        CU_ASSERT_EQUAL_FATAL(
            coord_store_set(i % 2 ? a : b, key, (const uint8_t *)"v", 1, err, sizeof(err)),
            PSHARD_OK);
    }
    CU_ASSERT_EQUAL(usage.keys, COORD_STORE_MAX_KEYS);
    CU_ASSERT_EQUAL(coord_store_num_keys(a) + coord_store_num_keys(b), COORD_STORE_MAX_KEYS);
    CU_ASSERT_EQUAL(coord_store_set(a, "one-more", (const uint8_t *)"v", 1, err, sizeof(err)),
                    PSHARD_ERR_RESOURCE_EXHAUSTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "store is full"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "delete_key"));
    /* Overwriting a key needs no new room. */
    CU_ASSERT_EQUAL(coord_store_set(a, "key/1", (const uint8_t *)"w", 1, err, sizeof(err)),
                    PSHARD_OK);
    CU_ASSERT_EQUAL(coord_store_delete(b, "key/0", err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(usage.keys, COORD_STORE_MAX_KEYS - 1);
    CU_ASSERT_EQUAL(coord_store_set(a, "one-more", (const uint8_t *)"v", 1, err, sizeof(err)),
                    PSHARD_OK);
    size_t in_b = coord_store_num_keys(b);
    uint64_t bytes_before = usage.bytes;
    coord_store_destroy(b);
    CU_ASSERT_EQUAL(usage.keys, COORD_STORE_MAX_KEYS - in_b);
    CU_ASSERT(usage.bytes < bytes_before);
    CU_ASSERT_EQUAL(coord_store_set(a, "after", (const uint8_t *)"v", 1, err, sizeof(err)),
                    PSHARD_OK);
    coord_store_destroy(a);
    CU_ASSERT_EQUAL(usage.keys, 0);
    CU_ASSERT_EQUAL(usage.bytes, 0);
}

static void test_delete_keeps_others_reachable(void)
{
    coord_store_t *st = coord_store_create();
    char key[32], err[256] = "";
    enum { N = 5000 };
    for (int i = 0; i < N; i++) {
        snprintf(key, sizeof(key), "%d", i);
        CU_ASSERT_EQUAL(set_str(st, key, key), PSHARD_OK);
    }
    for (int i = 0; i < N; i += 2) {
        snprintf(key, sizeof(key), "%d", i);
        CU_ASSERT_EQUAL(coord_store_delete(st, key, err, sizeof(err)), PSHARD_OK);
    }
    int ok = 0;
    const uint8_t *v;
    size_t len;
    for (int i = 0; i < N; i++) {
        snprintf(key, sizeof(key), "%d", i);
        pshard_status_t rc = coord_store_get(st, key, &v, &len, err, sizeof(err));
        ok += (i % 2) ? (rc == PSHARD_OK && value_is(st, key, key)) : rc == PSHARD_ERR_NOT_FOUND;
    }
    CU_ASSERT_EQUAL(ok, N);
    CU_ASSERT_EQUAL(coord_store_num_keys(st), N / 2);
    coord_store_destroy(st);
}

static void test_byte_limit(void)
{
    coord_store_t *st = coord_store_create();
    uint8_t *mib = calloc(1, COORD_STORE_VALUE_MAX);
    CU_ASSERT_PTR_NOT_NULL_FATAL(mib);
    char key[16], err[256] = "";
    /* 255 x (4-byte key + 1 MiB) fits in 256 MiB; a 256th does not. */
    for (int i = 0; i < 255; i++) {
        snprintf(key, sizeof(key), "v%03d", i);
        CU_ASSERT_EQUAL_FATAL(
            coord_store_set(st, key, mib, COORD_STORE_VALUE_MAX, err, sizeof(err)), PSHARD_OK);
    }
    CU_ASSERT_EQUAL(coord_store_set(st, "v255", mib, COORD_STORE_VALUE_MAX, err, sizeof(err)),
                    PSHARD_ERR_RESOURCE_EXHAUSTED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "the limit is 268435456"));
    /* Shrinking an existing value frees room. */
    CU_ASSERT_EQUAL(set_str(st, "v000", "small"), PSHARD_OK);
    CU_ASSERT_EQUAL(coord_store_set(st, "v255", mib, COORD_STORE_VALUE_MAX, err, sizeof(err)),
                    PSHARD_OK);
    free(mib);
    coord_store_destroy(st);
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"set, get, overwrite, delete", test_set_get_overwrite_delete},
        {"value size limit", test_value_size_limit},
        {"key rules", test_key_rules},
        {"compare_set", test_compare_set},
        {"add", test_add},
        {"wait satisfied immediately", test_wait_satisfied_immediately},
        {"wait satisfied later by set", test_wait_satisfied_later_by_set},
        {"wait satisfied by add and compare_set", test_wait_satisfied_by_add_and_compare_set},
        {"wait timeout names the missing key", test_wait_timeout_names_missing_key},
        {"tick fires only expired waiters", test_tick_fires_only_expired},
        {"cancel", test_cancel},
        {"destroy cancels pending waiters", test_destroy_cancels_pending},
        {"one set fires several waiters", test_one_set_fires_several_waiters},
        {"wait needs all keys present at once", test_wait_needs_all_keys_at_once},
        {"wait validation", test_wait_validation},
        {"waiter limit", test_waiter_limit},
        {"key count limit", test_key_count_limit},
        {"delete keeps other keys reachable", test_delete_keeps_others_reachable},
        {"stores sharing one usage share the limits", test_shared_usage},
        {"byte limit", test_byte_limit},
        {NULL, NULL},
    };
    return ps_test_main("coord_store", cases);
}
