/* Integration tests of libpshard's store client (pshard/store.h) against the real
 * pshard-coordinator binary on an ephemeral loopback port, with a cluster token: torch's Store
 * semantics (get waits, add creates, TCPStore's compare_set answers, wait, check, delete),
 * the limits' errors, job scoping, and one handle shared by several threads.
 * argv[1] is the coordinator binary. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_proc.h"
#include "ps_test.h"
#include "pshard/store.h"
#include "pshard/util.h"

#define TOKEN "store-test-token-0123"

static const char *coordinator_bin;
static char token_path[64];
static char target[64];
static pid_t coord_pid = -1;

/* Opens a store on the test's coordinator for job (with the token); NULL on failure. */
static pshard_store_t *open_store(const char *job)
{
    char err[PSHARD_ERRLEN] = "";
    pshard_store_t *s = NULL;
    pshard_status_t rc = pshard_store_open(target, job, TOKEN, &s, err, sizeof(err));
    if (rc != PSHARD_OK)
        fprintf(stderr, "pshard_store_open: %s\n", err);
    return s;
}

/* Whether value[0..len) is the C string want. */
static bool bytes_are(const void *value, size_t len, const char *want)
{
    return value && len == strlen(want) && memcmp(value, want, len) == 0;
}

static void test_set_get_add_delete(void)
{
    pshard_store_t *s = open_store("store-basic");
    CU_ASSERT_PTR_NOT_NULL_FATAL(s);
    CU_ASSERT_EQUAL(pshard_store_set(s, "k", "v1", 2, 5000), PSHARD_OK);
    void *value = NULL;
    size_t len = 0;
    CU_ASSERT_EQUAL(pshard_store_get(s, "k", &value, &len, 5000), PSHARD_OK);
    CU_ASSERT(bytes_are(value, len, "v1"));
    CU_ASSERT_EQUAL(((char *)value)[len], '\0');
    pshard_store_free(value);

    int64_t sum = 0;
    CU_ASSERT_EQUAL(pshard_store_add(s, "n", 5, &sum, 5000), PSHARD_OK);
    CU_ASSERT_EQUAL(sum, 5);
    CU_ASSERT_EQUAL(pshard_store_add(s, "n", -7, &sum, 5000), PSHARD_OK);
    CU_ASSERT_EQUAL(sum, -2);
    CU_ASSERT_EQUAL(pshard_store_add(s, "k", 1, NULL, 5000), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(pshard_store_last_error(s), "integer"));

    bool deleted = false;
    CU_ASSERT_EQUAL(pshard_store_delete(s, "k", &deleted, 5000), PSHARD_OK);
    CU_ASSERT(deleted);
    CU_ASSERT_EQUAL(pshard_store_delete(s, "k", &deleted, 5000), PSHARD_OK);
    CU_ASSERT(!deleted);
    /* A job that never had a key: nothing to delete, no error. */
    pshard_store_t *fresh = open_store("store-never-used");
    CU_ASSERT_EQUAL(pshard_store_delete(fresh, "k", &deleted, 5000), PSHARD_OK);
    CU_ASSERT(!deleted);
    pshard_store_close(fresh);
    pshard_store_close(s);
    pshard_store_close(NULL);
}

static void test_get_times_out_naming_the_key(void)
{
    pshard_store_t *s = open_store("store-timeout");
    CU_ASSERT_PTR_NOT_NULL_FATAL(s);
    void *value = (void *)1;
    size_t len = 1;
    int64_t t0 = ps_now_ns();
    CU_ASSERT_EQUAL(pshard_store_get(s, "absent-key", &value, &len, 300), PSHARD_ERR_TIMEOUT);
    CU_ASSERT(ps_now_ns() - t0 >= 250 * 1000000LL);
    CU_ASSERT_PTR_NULL(value);
    CU_ASSERT_EQUAL(len, 0);
    CU_ASSERT_PTR_NOT_NULL(strstr(pshard_store_last_error(s), "absent-key"));
    const char *keys[] = {"w1", "w2"};
    CU_ASSERT_EQUAL(pshard_store_set(s, "w1", "", 0, 5000), PSHARD_OK);
    CU_ASSERT_EQUAL(pshard_store_wait(s, keys, 2, 300), PSHARD_ERR_TIMEOUT);
    CU_ASSERT_PTR_NOT_NULL(strstr(pshard_store_last_error(s), "w2"));
    CU_ASSERT_EQUAL(pshard_store_set(s, "w2", "x", 1, 5000), PSHARD_OK);
    CU_ASSERT_EQUAL(pshard_store_wait(s, keys, 2, 5000), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(pshard_store_last_error(s), "");
    CU_ASSERT_EQUAL(pshard_store_wait(s, NULL, 0, 5000), PSHARD_OK);
    bool all = false;
    CU_ASSERT_EQUAL(pshard_store_check(s, keys, 2, &all, 5000), PSHARD_OK);
    CU_ASSERT(all);
    const char *some[] = {"w1", "nope"};
    CU_ASSERT_EQUAL(pshard_store_check(s, some, 2, &all, 5000), PSHARD_OK);
    CU_ASSERT(!all);
    pshard_store_close(s);
}

static void test_compare_set_answers_as_tcpstore(void)
{
    pshard_store_t *s = open_store("store-cas");
    CU_ASSERT_PTR_NOT_NULL_FATAL(s);
    void *cur = NULL;
    size_t clen = 0;
    bool swapped = false;
    /* Absent, empty expected: stored. */
    CU_ASSERT_EQUAL(pshard_store_compare_set(s, "c", "", 0, "v", 1, &cur, &clen, &swapped, 5000),
                    PSHARD_OK);
    CU_ASSERT(swapped && bytes_are(cur, clen, "v"));
    pshard_store_free(cur);
    /* Absent, non-empty expected: nothing stored, expected echoed. */
    CU_ASSERT_EQUAL(pshard_store_compare_set(s, "c2", "x", 1, "v", 1, &cur, &clen, &swapped, 5000),
                    PSHARD_OK);
    CU_ASSERT(!swapped && bytes_are(cur, clen, "x"));
    pshard_store_free(cur);
    /* Matching, then not matching. */
    CU_ASSERT_EQUAL(pshard_store_compare_set(s, "c", "v", 1, "w", 1, &cur, &clen, &swapped, 5000),
                    PSHARD_OK);
    CU_ASSERT(swapped && bytes_are(cur, clen, "w"));
    pshard_store_free(cur);
    CU_ASSERT_EQUAL(pshard_store_compare_set(s, "c", "zz", 2, "q", 1, &cur, &clen, &swapped, 5000),
                    PSHARD_OK);
    CU_ASSERT(!swapped && bytes_are(cur, clen, "w"));
    pshard_store_free(cur);
    /* A key holding an empty value is not an absent one. */
    CU_ASSERT_EQUAL(pshard_store_set(s, "e", "", 0, 5000), PSHARD_OK);
    CU_ASSERT_EQUAL(pshard_store_compare_set(s, "e", "x", 1, "y", 1, &cur, &clen, NULL, 5000),
                    PSHARD_OK);
    CU_ASSERT(bytes_are(cur, clen, ""));
    pshard_store_free(cur);
    pshard_store_close(s);
}

static void test_limits_and_jobs(void)
{
    pshard_store_t *s = open_store("store-limits");
    CU_ASSERT_PTR_NOT_NULL_FATAL(s);
    CU_ASSERT_EQUAL(pshard_store_set(s, "", "v", 1, 5000), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(pshard_store_last_error(s), "empty"));
    char *long_key = malloc(PSHARD_STORE_KEY_MAX + 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(long_key);
    memset(long_key, 'k', PSHARD_STORE_KEY_MAX + 1);
    long_key[PSHARD_STORE_KEY_MAX + 1] = '\0';
    CU_ASSERT_EQUAL(pshard_store_set(s, long_key, "v", 1, 5000), PSHARD_ERR_INVALID_ARGUMENT);
    long_key[PSHARD_STORE_KEY_MAX] = '\0'; /* exactly the limit: fine */
    CU_ASSERT_EQUAL(pshard_store_set(s, long_key, "v", 1, 5000), PSHARD_OK);
    free(long_key);
    char *big = calloc(1, PSHARD_STORE_VALUE_MAX + 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(big);
    CU_ASSERT_EQUAL(pshard_store_set(s, "big", big, PSHARD_STORE_VALUE_MAX + 1, 5000),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_EQUAL(pshard_store_set(s, "big", big, PSHARD_STORE_VALUE_MAX, 5000), PSHARD_OK);
    free(big);

    /* Another job does not see the key; the default job neither. */
    CU_ASSERT_EQUAL(pshard_store_set(s, "mine", "1", 1, 5000), PSHARD_OK);
    pshard_store_t *other = open_store("store-other");
    pshard_store_t *dflt = open_store(NULL);
    const char *mine[] = {"mine"};
    bool all = true;
    CU_ASSERT_EQUAL(pshard_store_check(other, mine, 1, &all, 5000), PSHARD_OK);
    CU_ASSERT(!all);
    CU_ASSERT_EQUAL(pshard_store_check(dflt, mine, 1, &all, 5000), PSHARD_OK);
    CU_ASSERT(!all);
    pshard_store_close(other);
    pshard_store_close(dflt);

    /* A wrong token is refused. */
    char err[PSHARD_ERRLEN] = "";
    pshard_store_t *bad = NULL;
    CU_ASSERT_EQUAL(
        pshard_store_open(target, NULL, "wrong-token-0123456789", &bad, err, sizeof(err)),
        PSHARD_OK);
    CU_ASSERT_EQUAL(pshard_store_set(bad, "k", "v", 1, 5000), PSHARD_ERR_UNAUTHENTICATED);
    pshard_store_close(bad);
    CU_ASSERT_EQUAL(pshard_store_open("no-port", NULL, NULL, &bad, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NULL(bad);
    pshard_store_close(s);
}

#define THREADS 4
#define ADDS 50

static void *adder(void *arg)
{
    pshard_store_t *s = arg;
    for (int i = 0; i < ADDS; i++)
        if (pshard_store_add(s, "ctr", 1, NULL, 10000) != PSHARD_OK)
            return (void *)1;
    /* An error on this thread is this thread's own. */
    if (pshard_store_set(s, "", "v", 1, 1000) != PSHARD_ERR_INVALID_ARGUMENT ||
        !strstr(pshard_store_last_error(s), "empty"))
        return (void *)1;
    return NULL;
}

static void *waiter(void *arg)
{
    pshard_store_t *s = arg;
    void *value = NULL;
    size_t len = 0;
    pshard_status_t rc = pshard_store_get(s, "go", &value, &len, 20000);
    bool ok = rc == PSHARD_OK && bytes_are(value, len, "now");
    pshard_store_free(value);
    return ok ? NULL : (void *)1;
}

static void test_threads_share_a_handle(void)
{
    pshard_store_t *s = open_store("store-threads");
    CU_ASSERT_PTR_NOT_NULL_FATAL(s);
    pthread_t t[THREADS + 1];
    CU_ASSERT_EQUAL_FATAL(pthread_create(&t[THREADS], NULL, waiter, s), 0);
    for (int i = 0; i < THREADS; i++)
        CU_ASSERT_EQUAL_FATAL(pthread_create(&t[i], NULL, adder, s), 0);
    for (int i = 0; i < THREADS; i++) {
        void *ret = NULL;
        pthread_join(t[i], &ret);
        CU_ASSERT_PTR_NULL(ret);
    }
    /* The waiter is blocked in a get on the same handle all along. */
    CU_ASSERT_STRING_EQUAL(pshard_store_last_error(s), "");
    CU_ASSERT_EQUAL(pshard_store_set(s, "go", "now", 3, 5000), PSHARD_OK);
    void *ret = NULL;
    pthread_join(t[THREADS], &ret);
    CU_ASSERT_PTR_NULL(ret);
    int64_t sum = 0;
    CU_ASSERT_EQUAL(pshard_store_add(s, "ctr", 0, &sum, 5000), PSHARD_OK);
    CU_ASSERT_EQUAL(sum, THREADS * ADDS);
    pshard_store_close(s);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH-TO-pshard-coordinator\n", argv[0]);
        return 2;
    }
    coordinator_bin = argv[1];
    signal(SIGPIPE, SIG_IGN);
    ps_strlcpy(token_path, "/tmp/pshard-store-token-XXXXXX", sizeof(token_path));
    int fd = mkstemp(token_path);
    if (fd < 0 || write(fd, TOKEN "\n", sizeof(TOKEN)) != (ssize_t)sizeof(TOKEN)) {
        perror("token file");
        return 2;
    }
    close(fd);
    const char *args[] = {"--token-file", token_path, NULL};
    coord_pid = ps_proc_start_coordinator(coordinator_bin, args, target, sizeof(target));
    if (coord_pid < 0) {
        fprintf(stderr, "cannot start %s\n", coordinator_bin);
        unlink(token_path);
        return 1;
    }
    static const ps_test_case_t cases[] = {
        {"set, get, add, delete", test_set_get_add_delete},
        {"get and wait time out naming the key", test_get_times_out_naming_the_key},
        {"compare_set answers as TCPStore", test_compare_set_answers_as_tcpstore},
        {"limits, jobs and the token", test_limits_and_jobs},
        {"threads share one handle", test_threads_share_a_handle},
        {NULL, NULL},
    };
    int rc = ps_test_main("store_client", cases);
    ps_proc_stop(coord_pid, 10000);
    unlink(token_path);
    return rc;
}
