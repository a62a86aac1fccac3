/* Unit tests for the option-table parser (common/src/config.c): precedence flag > environment
 * > default, flag forms, error messages, positionals, --help/--version, usage and logging. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_test.h"
#include "pshard/config.h"
#include "pshard/log.h"

typedef struct {
    char *listen;
    char *name;
    char *token;
    int64_t lease_ms;
    int64_t offset;
    bool verbose;
    bool fast;
} test_cfg_t;

/* Indexes into test_opts, for result.source[]. */
enum { OPT_LISTEN, OPT_NAME, OPT_TOKEN, OPT_LEASE, OPT_OFFSET, OPT_VERBOSE, OPT_FAST, OPT_COUNT };

static const ps_option_t test_opts[] = {
    {"listen", "PSHARD_TEST_LISTEN, PSHARD_TEST_LISTEN_ALT", PS_OPT_STRING, "0.0.0.0:7070",
     "address to listen on", offsetof(test_cfg_t, listen), 0, 0},
    {"name", NULL, PS_OPT_STRING, NULL, "a name with no default", offsetof(test_cfg_t, name), 0, 0},
    {"auth-token", "PSHARD_TEST_TOKEN", PS_OPT_STRING, NULL, "shared secret",
     offsetof(test_cfg_t, token), 0, 0},
    {"lease-ms", "PSHARD_TEST_LEASE_MS", PS_OPT_INT, "5000", "lease length in milliseconds",
     offsetof(test_cfg_t, lease_ms), 1, 3600000},
    {"offset", NULL, PS_OPT_INT, NULL, "any 64-bit integer", offsetof(test_cfg_t, offset), 0, 0},
    {"verbose", "PSHARD_TEST_VERBOSE", PS_OPT_BOOL, NULL, "say more", offsetof(test_cfg_t, verbose),
     0, 0},
    {"fast", NULL, PS_OPT_BOOL, "true", "go fast", offsetof(test_cfg_t, fast), 0, 0},
};

static const char *const test_env_names[] = {"PSHARD_TEST_LISTEN", "PSHARD_TEST_LISTEN_ALT",
                                             "PSHARD_TEST_TOKEN", "PSHARD_TEST_LEASE_MS",
                                             "PSHARD_TEST_VERBOSE"};

#define ARGV(...) ((char *[]){"prog", __VA_ARGS__, NULL})
#define ARGC(...) ((int)(sizeof((char *[]){"prog", __VA_ARGS__}) / sizeof(char *)))
/* Parses the given arguments (after "prog") into c/r with error text in err. */
#define PARSE(c, r, err, ...)                                                                      \
    ps_config_parse(test_opts, OPT_COUNT, ARGC(__VA_ARGS__), ARGV(__VA_ARGS__), (c), (r), (err),   \
                    sizeof(err))

static void clear_env(void)
{
    for (size_t i = 0; i < sizeof(test_env_names) / sizeof(test_env_names[0]); i++)
        unsetenv(test_env_names[i]);
}

static pshard_status_t parse_no_args(test_cfg_t *c, ps_config_result_t *r, char *err, size_t errlen)
{
    char *argv[] = {"prog", NULL};
    return ps_config_parse(test_opts, OPT_COUNT, 1, argv, c, r, err, errlen);
}

static void test_defaults(void)
{
    clear_env();
    test_cfg_t c;
    memset(&c, 0xab, sizeof(c)); /* parse must overwrite every field */
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(parse_no_args(&c, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(err, "");
    CU_ASSERT_PTR_NOT_NULL_FATAL(c.listen);
    CU_ASSERT_STRING_EQUAL(c.listen, "0.0.0.0:7070");
    CU_ASSERT_PTR_NULL(c.name);
    CU_ASSERT_PTR_NULL(c.token);
    CU_ASSERT_EQUAL(c.lease_ms, 5000);
    CU_ASSERT_EQUAL(c.offset, 0);
    CU_ASSERT_FALSE(c.verbose);
    CU_ASSERT_TRUE(c.fast);
    CU_ASSERT_FALSE(r.help);
    CU_ASSERT_FALSE(r.version);
    CU_ASSERT_EQUAL(r.first_positional, 1);
    for (int i = 0; i < OPT_COUNT; i++)
        CU_ASSERT_EQUAL(r.source[i], PS_SRC_DEFAULT);
    ps_config_free(test_opts, OPT_COUNT, &c);
}

static void test_env_over_default(void)
{
    clear_env();
    setenv("PSHARD_TEST_LISTEN", "10.0.0.1:9000", 1);
    setenv("PSHARD_TEST_LEASE_MS", "250", 1);
    setenv("PSHARD_TEST_VERBOSE", "yes", 1);
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(parse_no_args(&c, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(c.listen, "10.0.0.1:9000");
    CU_ASSERT_EQUAL(c.lease_ms, 250);
    CU_ASSERT_TRUE(c.verbose);
    CU_ASSERT_EQUAL(r.source[OPT_LISTEN], PS_SRC_ENV);
    CU_ASSERT_EQUAL(r.source[OPT_LEASE], PS_SRC_ENV);
    CU_ASSERT_EQUAL(r.source[OPT_VERBOSE], PS_SRC_ENV);
    CU_ASSERT_EQUAL(r.source[OPT_FAST], PS_SRC_DEFAULT);
    ps_config_free(test_opts, OPT_COUNT, &c);
    clear_env();
}

static void test_flag_over_env(void)
{
    clear_env();
    setenv("PSHARD_TEST_LISTEN", "env:1", 1);
    setenv("PSHARD_TEST_LEASE_MS", "not-a-number", 1); /* ignored: the flag wins */
    setenv("PSHARD_TEST_VERBOSE", "true", 1);
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(
        PARSE(&c, &r, err, "--listen", "flag:2", "--lease-ms", "7", "--no-verbose"), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(err, "");
    CU_ASSERT_STRING_EQUAL(c.listen, "flag:2");
    CU_ASSERT_EQUAL(c.lease_ms, 7);
    CU_ASSERT_FALSE(c.verbose);
    CU_ASSERT_EQUAL(r.source[OPT_LISTEN], PS_SRC_FLAG);
    CU_ASSERT_EQUAL(r.source[OPT_LEASE], PS_SRC_FLAG);
    CU_ASSERT_EQUAL(r.source[OPT_VERBOSE], PS_SRC_FLAG);
    ps_config_free(test_opts, OPT_COUNT, &c);
    clear_env();
}

static void test_second_env_name(void)
{
    clear_env();
    setenv("PSHARD_TEST_LISTEN_ALT", "alt:3", 1);
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(parse_no_args(&c, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(c.listen, "alt:3");
    CU_ASSERT_EQUAL(r.source[OPT_LISTEN], PS_SRC_ENV);
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* Both set: the first name in the list wins. */
    setenv("PSHARD_TEST_LISTEN", "first:4", 1);
    CU_ASSERT_EQUAL_FATAL(parse_no_args(&c, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(c.listen, "first:4");
    ps_config_free(test_opts, OPT_COUNT, &c);
    clear_env();
}

static void test_empty_env_is_unset(void)
{
    clear_env();
    setenv("PSHARD_TEST_LISTEN", "", 1);
    setenv("PSHARD_TEST_LISTEN_ALT", "alt:5", 1);
    setenv("PSHARD_TEST_LEASE_MS", "", 1); /* empty: not an error, just unset */
    setenv("PSHARD_TEST_VERBOSE", "", 1);
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(parse_no_args(&c, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(c.listen, "alt:5");
    CU_ASSERT_EQUAL(c.lease_ms, 5000);
    CU_ASSERT_EQUAL(r.source[OPT_LEASE], PS_SRC_DEFAULT);
    CU_ASSERT_FALSE(c.verbose);
    CU_ASSERT_EQUAL(r.source[OPT_VERBOSE], PS_SRC_DEFAULT);
    ps_config_free(test_opts, OPT_COUNT, &c);

    setenv("PSHARD_TEST_LISTEN_ALT", "", 1);
    CU_ASSERT_EQUAL_FATAL(parse_no_args(&c, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(c.listen, "0.0.0.0:7070");
    CU_ASSERT_EQUAL(r.source[OPT_LISTEN], PS_SRC_DEFAULT);
    ps_config_free(test_opts, OPT_COUNT, &c);
    clear_env();
}

static void test_equals_and_space_forms(void)
{
    clear_env();
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--listen=a:1", "--lease-ms", "42",
                                "--name=", "--auth-token", "k=v", "--offset=-3"),
                          PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(c.listen, "a:1");
    CU_ASSERT_EQUAL(c.lease_ms, 42);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c.name);
    CU_ASSERT_STRING_EQUAL(c.name, ""); /* "--name=" gives an empty string, not NULL */
    CU_ASSERT_STRING_EQUAL(c.token, "k=v");
    CU_ASSERT_EQUAL(c.offset, -3);
    CU_ASSERT_EQUAL(r.first_positional, 8);
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* Only the first '=' splits; a separate value may start with a single dash. */
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--listen=x=y", "--offset", "-5", "--name", "-"),
                          PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(c.listen, "x=y");
    CU_ASSERT_EQUAL(c.offset, -5);
    CU_ASSERT_STRING_EQUAL(c.name, "-");
    ps_config_free(test_opts, OPT_COUNT, &c);
}

static void test_bool_forms(void)
{
    clear_env();
    static const struct {
        const char *arg;
        bool want;
    } cases[] = {
        {"--verbose", true},        {"--verbose=true", true}, {"--verbose=1", true},
        {"--verbose=yes", true},    {"--verbose=on", true},   {"--verbose=TRUE", true},
        {"--verbose=false", false}, {"--verbose=0", false},   {"--verbose=no", false},
        {"--verbose=off", false},   {"--no-verbose", false},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        test_cfg_t c;
        ps_config_result_t r;
        char err[256] = "";
        /* Start from the opposite value via the environment so the flag must change it. */
        setenv("PSHARD_TEST_VERBOSE", cases[i].want ? "0" : "1", 1);
        char *argv[] = {"prog", (char *)cases[i].arg, NULL};
        CU_ASSERT_EQUAL_FATAL(
            ps_config_parse(test_opts, OPT_COUNT, 2, argv, &c, &r, err, sizeof(err)), PSHARD_OK);
        if (c.verbose != cases[i].want)
            fprintf(stderr, "bool form %s gave %d\n", cases[i].arg, (int)c.verbose);
        CU_ASSERT_EQUAL(c.verbose, cases[i].want);
        CU_ASSERT_EQUAL(r.source[OPT_VERBOSE], PS_SRC_FLAG);
        ps_config_free(test_opts, OPT_COUNT, &c);
    }
    clear_env();

    /* --no-X turns off a default-true boolean; a bare boolean flag takes no argument. */
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--no-fast", "--verbose", "file"), PSHARD_OK);
    CU_ASSERT_FALSE(c.fast);
    CU_ASSERT_TRUE(c.verbose);
    CU_ASSERT_EQUAL(r.first_positional, 3);
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* The environment accepts the same forms. */
    setenv("PSHARD_TEST_VERBOSE", "on", 1);
    CU_ASSERT_EQUAL_FATAL(parse_no_args(&c, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_TRUE(c.verbose);
    ps_config_free(test_opts, OPT_COUNT, &c);
    setenv("PSHARD_TEST_VERBOSE", "off", 1);
    CU_ASSERT_EQUAL_FATAL(parse_no_args(&c, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_FALSE(c.verbose);
    ps_config_free(test_opts, OPT_COUNT, &c);
    clear_env();
}

static void test_bad_bool(void)
{
    clear_env();
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--verbose=maybe"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "--verbose"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "'maybe' is not a boolean"));
    ps_config_free(test_opts, OPT_COUNT, &c);

    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--no-verbose=1"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "--no-verbose does not take a value");
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* --no- only applies to booleans. */
    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--no-listen"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "unknown flag --no-listen");
    ps_config_free(test_opts, OPT_COUNT, &c);

    setenv("PSHARD_TEST_VERBOSE", "sometimes", 1);
    CU_ASSERT_EQUAL(parse_no_args(&c, &r, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "environment PSHARD_TEST_VERBOSE"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "'sometimes' is not a boolean"));
    ps_config_free(test_opts, OPT_COUNT, &c);
    clear_env();
}

static void test_unknown_flag(void)
{
    clear_env();
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--foo"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "unknown flag --foo");
    ps_config_free(test_opts, OPT_COUNT, &c);

    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--listen", "x", "--foo=bar"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "unknown flag --foo");
    ps_config_free(test_opts, OPT_COUNT, &c);

    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "-x"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "unknown flag -x");
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* A prefix of a flag is not that flag. */
    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--list", "x"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "unknown flag --list");
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* A NULL error buffer is allowed. */
    char *argv[] = {"prog", "--foo", NULL};
    CU_ASSERT_EQUAL(ps_config_parse(test_opts, OPT_COUNT, 2, argv, &c, &r, NULL, 0),
                    PSHARD_ERR_INVALID_ARGUMENT);
    ps_config_free(test_opts, OPT_COUNT, &c);
}

static void test_missing_value(void)
{
    clear_env();
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--listen"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "--listen needs a value");
    ps_config_free(test_opts, OPT_COUNT, &c);

    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--listen", "--verbose"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "--listen needs a value");
    ps_config_free(test_opts, OPT_COUNT, &c);

    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--verbose", "--lease-ms"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "--lease-ms needs a value");
    ps_config_free(test_opts, OPT_COUNT, &c);
}

static void test_int_errors(void)
{
    clear_env();
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--lease-ms", "abc"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "--lease-ms: 'abc' is not an integer");
    ps_config_free(test_opts, OPT_COUNT, &c);

    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--lease-ms", "0"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "--lease-ms: 0 is out of range [1, 3600000]");
    ps_config_free(test_opts, OPT_COUNT, &c);

    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--lease-ms=3600001"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "--lease-ms: 3600001 is out of range [1, 3600000]");
    ps_config_free(test_opts, OPT_COUNT, &c);

    static const char *const junk[] = {"0x10", "12abc", " 5", "5 ", "", "1e3", "--"};
    for (size_t i = 0; i < sizeof(junk) / sizeof(junk[0]); i++) {
        char *argv[] = {"prog", "--offset=", NULL};
        char arg[64];
        snprintf(arg, sizeof(arg), "--offset=%s", junk[i]);
        argv[1] = arg;
        CU_ASSERT_EQUAL(ps_config_parse(test_opts, OPT_COUNT, 2, argv, &c, &r, err, sizeof(err)),
                        PSHARD_ERR_INVALID_ARGUMENT);
        CU_ASSERT_PTR_NOT_NULL(strstr(err, "is not an integer"));
        ps_config_free(test_opts, OPT_COUNT, &c);
    }

    /* Past int64: out of range, not "not an integer". */
    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--offset", "9223372036854775808"),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "--offset: '9223372036854775808' is out of range"));
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* Bounds are inclusive; min == max == 0 means the whole int64 range. */
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--lease-ms", "1", "--offset", "-9223372036854775808"),
                          PSHARD_OK);
    CU_ASSERT_EQUAL(c.lease_ms, 1);
    CU_ASSERT_EQUAL(c.offset, INT64_MIN);
    ps_config_free(test_opts, OPT_COUNT, &c);
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--lease-ms=3600000", "--offset=+7"), PSHARD_OK);
    CU_ASSERT_EQUAL(c.lease_ms, 3600000);
    CU_ASSERT_EQUAL(c.offset, 7);
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* Errors from the environment name the variable. */
    setenv("PSHARD_TEST_LEASE_MS", "x", 1);
    CU_ASSERT_EQUAL(parse_no_args(&c, &r, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "environment PSHARD_TEST_LEASE_MS: 'x' is not an integer");
    ps_config_free(test_opts, OPT_COUNT, &c);
    setenv("PSHARD_TEST_LEASE_MS", "0", 1);
    CU_ASSERT_EQUAL(parse_no_args(&c, &r, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "environment PSHARD_TEST_LEASE_MS: 0 is out of range [1, 3600000]");
    ps_config_free(test_opts, OPT_COUNT, &c);
    clear_env();
}

static void test_double_dash_and_positionals(void)
{
    clear_env();
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    /* Everything after "--" is positional, even if it looks like a flag. */
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--listen", "a", "--", "--lease-ms", "5"), PSHARD_OK);
    CU_ASSERT_EQUAL(r.first_positional, 4);
    CU_ASSERT_STRING_EQUAL(c.listen, "a");
    CU_ASSERT_EQUAL(c.lease_ms, 5000);
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* The first non-option ends the options. */
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--verbose", "file1", "--listen", "x"), PSHARD_OK);
    CU_ASSERT_EQUAL(r.first_positional, 2);
    CU_ASSERT_STRING_EQUAL(c.listen, "0.0.0.0:7070");
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* A lone "-" is a positional. */
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--verbose", "-", "x"), PSHARD_OK);
    CU_ASSERT_EQUAL(r.first_positional, 2);
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* "--" last: no positionals, first_positional == argc. */
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--verbose", "--"), PSHARD_OK);
    CU_ASSERT_EQUAL(r.first_positional, 3);
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* No positionals at all. */
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--verbose"), PSHARD_OK);
    CU_ASSERT_EQUAL(r.first_positional, 2);
    ps_config_free(test_opts, OPT_COUNT, &c);
}

static void test_help_and_version(void)
{
    clear_env();
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--help"), PSHARD_OK);
    CU_ASSERT_TRUE(r.help);
    CU_ASSERT_FALSE(r.version);
    ps_config_free(test_opts, OPT_COUNT, &c);

    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--verbose", "-h"), PSHARD_OK);
    CU_ASSERT_TRUE(r.help);
    ps_config_free(test_opts, OPT_COUNT, &c);

    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--version"), PSHARD_OK);
    CU_ASSERT_TRUE(r.version);
    CU_ASSERT_FALSE(r.help);
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* Parsing stops at --help: later mistakes and a bad environment do not matter. */
    setenv("PSHARD_TEST_LEASE_MS", "junk", 1);
    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--help", "--bogus"), PSHARD_OK);
    CU_ASSERT_TRUE(r.help);
    CU_ASSERT_STRING_EQUAL(err, "");
    ps_config_free(test_opts, OPT_COUNT, &c);
    clear_env();

    /* A mistake before --help is still reported. */
    CU_ASSERT_EQUAL(PARSE(&c, &r, err, "--bogus", "--help"), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "unknown flag --bogus");
    ps_config_free(test_opts, OPT_COUNT, &c);

    /* After "--", --help is a positional. */
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--", "--help"), PSHARD_OK);
    CU_ASSERT_FALSE(r.help);
    CU_ASSERT_EQUAL(r.first_positional, 2);
    ps_config_free(test_opts, OPT_COUNT, &c);
}

static void test_last_flag_wins(void)
{
    clear_env();
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--listen", "a", "--listen=b", "--verbose",
                                "--no-verbose", "--lease-ms", "1", "--lease-ms=2"),
                          PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(c.listen, "b");
    CU_ASSERT_FALSE(c.verbose);
    CU_ASSERT_EQUAL(c.lease_ms, 2);
    ps_config_free(test_opts, OPT_COUNT, &c); /* ASan reports a leak if "a" was copied too */
}

static void test_sources(void)
{
    clear_env();
    setenv("PSHARD_TEST_LEASE_MS", "77", 1);
    setenv("PSHARD_TEST_TOKEN", "s3cret", 1);
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--listen=l", "--no-fast"), PSHARD_OK);
    CU_ASSERT_EQUAL(r.source[OPT_LISTEN], PS_SRC_FLAG);
    CU_ASSERT_EQUAL(r.source[OPT_NAME], PS_SRC_DEFAULT);
    CU_ASSERT_EQUAL(r.source[OPT_TOKEN], PS_SRC_ENV);
    CU_ASSERT_EQUAL(r.source[OPT_LEASE], PS_SRC_ENV);
    CU_ASSERT_EQUAL(r.source[OPT_OFFSET], PS_SRC_DEFAULT);
    CU_ASSERT_EQUAL(r.source[OPT_VERBOSE], PS_SRC_DEFAULT);
    CU_ASSERT_EQUAL(r.source[OPT_FAST], PS_SRC_FLAG);
    CU_ASSERT_STRING_EQUAL(c.token, "s3cret");
    CU_ASSERT_EQUAL(c.lease_ms, 77);
    ps_config_free(test_opts, OPT_COUNT, &c);
    clear_env();
}

static void test_free_twice(void)
{
    clear_env();
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--name", "n", "--auth-token", "t"), PSHARD_OK);
    CU_ASSERT_PTR_NOT_NULL(c.name);
    ps_config_free(test_opts, OPT_COUNT, &c);
    CU_ASSERT_PTR_NULL(c.listen);
    CU_ASSERT_PTR_NULL(c.name);
    CU_ASSERT_PTR_NULL(c.token);
    ps_config_free(test_opts, OPT_COUNT, &c);
    CU_ASSERT_PTR_NULL(c.listen);
    ps_config_free(test_opts, OPT_COUNT, NULL);
    ps_config_free(NULL, 0, &c);
}

/* Returns the column where `help` starts in the usage line that contains it, or -1. */
static long help_column(const char *text, const char *help)
{
    const char *hit = strstr(text, help);
    if (!hit)
        return -1;
    const char *line = hit;
    while (line > text && line[-1] != '\n')
        line--;
    return (long)(hit - line);
}

static void test_usage(void)
{
    char *text = NULL;
    size_t len = 0;
    FILE *out = open_memstream(&text, &len);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    ps_config_usage(out, "pshard-test", "[options] FILE", "Runs the config tests.", test_opts,
                    OPT_COUNT);
    fclose(out);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    CU_ASSERT_EQUAL(strncmp(text, "usage: pshard-test [options] FILE\n", 34), 0);
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "Runs the config tests."));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "options:"));
    for (size_t i = 0; i < OPT_COUNT; i++) {
        char want[64];
        snprintf(want, sizeof(want), "--%s%s", test_opts[i].flag,
                 test_opts[i].type == PS_OPT_BOOL ? " " : " VALUE");
        if (!strstr(text, want))
            fprintf(stderr, "usage lacks '%s'\n", want);
        CU_ASSERT_PTR_NOT_NULL(strstr(text, want));
        CU_ASSERT_PTR_NOT_NULL(strstr(text, test_opts[i].help));
    }
    for (size_t i = 0; i < sizeof(test_env_names) / sizeof(test_env_names[0]); i++)
        CU_ASSERT_PTR_NOT_NULL(strstr(text, test_env_names[i]));
    CU_ASSERT_PTR_NULL(strstr(text, "--verbose VALUE"));
    CU_ASSERT_PTR_NOT_NULL(
        strstr(text, "(env: PSHARD_TEST_LISTEN, PSHARD_TEST_LISTEN_ALT; default: 0.0.0.0:7070)"));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "(env: PSHARD_TEST_LEASE_MS; default: 5000)"));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "go fast (default: true)"));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "a name with no default\n"));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "--help"));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "--version"));

    /* Help texts line up in one column. */
    long col = help_column(text, test_opts[0].help);
    CU_ASSERT(col > 0);
    for (size_t i = 1; i < OPT_COUNT; i++)
        CU_ASSERT_EQUAL(help_column(text, test_opts[i].help), col);
    CU_ASSERT_EQUAL(help_column(text, "show this help"), col);
    free(text);
}

static void test_too_many_options(void)
{
    enum { N = 65 };
    struct {
        char *v[N];
    } big;
    static char names[N][8];
    static ps_option_t opts[N];
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof(names[i]), "o%d", i);
        opts[i] = (ps_option_t){names[i], NULL, PS_OPT_STRING, "d", "h", (size_t)i * sizeof(char *),
                                0,        0};
    }
    char *argv[] = {"prog", "--o63=last", NULL};
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL(ps_config_parse(opts, N, 2, argv, &big, &r, err, sizeof(err)),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "too many options"));

    /* Exactly 64 is fine. */
    CU_ASSERT_EQUAL_FATAL(ps_config_parse(opts, N - 1, 2, argv, &big, &r, err, sizeof(err)),
                          PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(big.v[63], "last");
    CU_ASSERT_EQUAL(r.source[63], PS_SRC_FLAG);
    CU_ASSERT_STRING_EQUAL(big.v[0], "d");
    ps_config_free(opts, N - 1, &big);
}

static void test_bad_table(void)
{
    typedef struct {
        int64_t n;
        bool b;
        char *s;
    } small_t;
    small_t c;
    ps_config_result_t r;
    char err[256] = "";
    char *argv[] = {"prog", NULL};

    const ps_option_t bad_int[] = {
        {"n", NULL, PS_OPT_INT, "abc", "h", offsetof(small_t, n), 0, 0},
    };
    CU_ASSERT_EQUAL(ps_config_parse(bad_int, 1, 1, argv, &c, &r, err, sizeof(err)),
                    PSHARD_ERR_INTERNAL);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "default of --n"));

    /* A bad default is caught even when a flag would have overridden it. */
    char *argv_n[] = {"prog", "--n=3", NULL};
    CU_ASSERT_EQUAL(ps_config_parse(bad_int, 1, 2, argv_n, &c, &r, err, sizeof(err)),
                    PSHARD_ERR_INTERNAL);

    const ps_option_t out_of_range[] = {
        {"n", NULL, PS_OPT_INT, "0", "h", offsetof(small_t, n), 1, 10},
    };
    CU_ASSERT_EQUAL(ps_config_parse(out_of_range, 1, 1, argv, &c, &r, err, sizeof(err)),
                    PSHARD_ERR_INTERNAL);

    const ps_option_t bad_bool[] = {
        {"b", NULL, PS_OPT_BOOL, "maybe", "h", offsetof(small_t, b), 0, 0},
    };
    CU_ASSERT_EQUAL(ps_config_parse(bad_bool, 1, 1, argv, &c, &r, err, sizeof(err)),
                    PSHARD_ERR_INTERNAL);

    const ps_option_t duplicate[] = {
        {"s", NULL, PS_OPT_STRING, NULL, "h", offsetof(small_t, s), 0, 0},
        {"s", NULL, PS_OPT_STRING, NULL, "h", offsetof(small_t, s), 0, 0},
    };
    CU_ASSERT_EQUAL(ps_config_parse(duplicate, 2, 1, argv, &c, &r, err, sizeof(err)),
                    PSHARD_ERR_INTERNAL);

    const ps_option_t good[] = {
        {"n", NULL, PS_OPT_INT, "-4", "h", offsetof(small_t, n), -5, 5},
        {"b", NULL, PS_OPT_BOOL, "yes", "h", offsetof(small_t, b), 0, 0},
        {"s", NULL, PS_OPT_STRING, "str", "h", offsetof(small_t, s), 0, 0},
    };
    CU_ASSERT_EQUAL_FATAL(ps_config_parse(good, 3, 1, argv, &c, &r, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(c.n, -4);
    CU_ASSERT_TRUE(c.b);
    CU_ASSERT_STRING_EQUAL(c.s, "str");
    ps_config_free(good, 3, &c);
}

/* Runs ps_config_log with stderr sent to a temporary file and returns what it wrote (free it). */
static char *capture_log(const test_cfg_t *c, const ps_config_result_t *r)
{
    fflush(stderr);
    FILE *tmp = tmpfile();
    if (!tmp)
        return NULL;
    int saved = dup(2);
    dup2(fileno(tmp), 2);
    ps_log_set_level(PS_LOG_INFO);
    ps_config_log(test_opts, OPT_COUNT, c, r);
    ps_log_set_level(PS_LOG_WARN);
    dup2(saved, 2);
    close(saved);
    fseek(tmp, 0, SEEK_END);
    long size = ftell(tmp);
    if (size < 0) {
        fclose(tmp);
        return NULL;
    }
    rewind(tmp);
    char *text = calloc(1, (size_t)size + 1);
    if (text && fread(text, 1, (size_t)size, tmp) != (size_t)size)
        text[0] = '\0';
    fclose(tmp);
    return text;
}

static void test_log(void)
{
    clear_env();
    setenv("PSHARD_TEST_LEASE_MS", "900", 1);
    test_cfg_t c;
    ps_config_result_t r;
    char err[256] = "";
    CU_ASSERT_EQUAL_FATAL(PARSE(&c, &r, err, "--auth-token", "hunter2", "--verbose"), PSHARD_OK);
    char *text = capture_log(&c, &r);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "config: --listen=0.0.0.0:7070 (default)"));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "config: --lease-ms=900 (env)"));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "config: --verbose=true (flag)"));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "config: --name=(unset) (default)"));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "config: --auth-token=(set) (flag)"));
    CU_ASSERT_PTR_NULL(strstr(text, "hunter2"));
    free(text);
    ps_config_free(test_opts, OPT_COUNT, &c);

    CU_ASSERT_EQUAL_FATAL(parse_no_args(&c, &r, err, sizeof(err)), PSHARD_OK);
    text = capture_log(&c, &r);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "config: --auth-token=(unset) (default)"));
    free(text);

    /* Below info level nothing is written. */
    fflush(stderr);
    FILE *tmp = tmpfile();
    CU_ASSERT_PTR_NOT_NULL_FATAL(tmp);
    int saved = dup(2);
    dup2(fileno(tmp), 2);
    ps_config_log(test_opts, OPT_COUNT, &c, &r);
    dup2(saved, 2);
    close(saved);
    fseek(tmp, 0, SEEK_END);
    CU_ASSERT_EQUAL(ftell(tmp), 0);
    fclose(tmp);
    ps_config_free(test_opts, OPT_COUNT, &c);
    clear_env();
}

typedef struct {
    char *log;
    int64_t n;
} main_cfg_t;

static const ps_option_t main_opts[] = {
    {"log", NULL, PS_OPT_STRING, "warn", "log level", offsetof(main_cfg_t, log), 0, 0},
    {"n", NULL, PS_OPT_INT, "1", "a number", offsetof(main_cfg_t, n), 1, 9},
};

/* ps_config_main: go on (-1), or the exit code for --help/--version (0) and bad input (2). */
static void test_config_main(void)
{
    main_cfg_t c;
    ps_config_result_t r;
    char *ok[] = {"prog", "--n", "3", "--log", "error", NULL};
    CU_ASSERT_EQUAL(ps_config_main(main_opts, 2, 5, ok, &c, &r, "prog", "", "", false), -1);
    CU_ASSERT_EQUAL(c.n, 3);
    CU_ASSERT(ps_log_enabled(PS_LOG_ERROR, PS_SUB_MAIN));
    CU_ASSERT(!ps_log_enabled(PS_LOG_WARN, PS_SUB_MAIN));
    ps_log_set_level(PS_LOG_WARN);
    ps_config_free(main_opts, 2, &c);
    char *badlog[] = {"prog", "--log", "loud", NULL};
    CU_ASSERT_EQUAL(ps_config_main(main_opts, 2, 3, badlog, &c, &r, "prog", "", "", false), 2);
    ps_config_free(main_opts, 2, &c);
    char *badn[] = {"prog", "--n", "10", NULL};
    CU_ASSERT_EQUAL(ps_config_main(main_opts, 2, 3, badn, &c, &r, "prog", "", "", false), 2);
    ps_config_free(main_opts, 2, &c);
    char *extra[] = {"prog", "stray", NULL};
    CU_ASSERT_EQUAL(ps_config_main(main_opts, 2, 2, extra, &c, &r, "prog", "", "", false), 2);
    ps_config_free(main_opts, 2, &c);
    CU_ASSERT_EQUAL(ps_config_main(main_opts, 2, 2, extra, &c, &r, "prog", "", "", true), -1);
    ps_config_free(main_opts, 2, &c);
    char *ver[] = {"prog", "--version", NULL};
    CU_ASSERT_EQUAL(ps_config_main(main_opts, 2, 2, ver, &c, &r, "prog", "", "", false), 0);
    ps_config_free(main_opts, 2, &c);
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"defaults", test_defaults},
        {"env_over_default", test_env_over_default},
        {"flag_over_env", test_flag_over_env},
        {"second_env_name", test_second_env_name},
        {"empty_env_is_unset", test_empty_env_is_unset},
        {"equals_and_space_forms", test_equals_and_space_forms},
        {"bool_forms", test_bool_forms},
        {"bad_bool", test_bad_bool},
        {"unknown_flag", test_unknown_flag},
        {"missing_value", test_missing_value},
        {"int_errors", test_int_errors},
        {"double_dash_and_positionals", test_double_dash_and_positionals},
        {"help_and_version", test_help_and_version},
        {"last_flag_wins", test_last_flag_wins},
        {"sources", test_sources},
        {"free_twice", test_free_twice},
        {"usage", test_usage},
        {"too_many_options", test_too_many_options},
        {"bad_table", test_bad_table},
        {"log", test_log},
        {"config_main", test_config_main},
        {NULL, NULL},
    };
    return ps_test_main("config", cases);
}
