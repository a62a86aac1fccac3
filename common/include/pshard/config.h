/* Command-line and environment configuration for every pshard binary: one table of options
 * {flag, env, type, default, help} per binary, which also produces --help. Precedence is
 * flag > environment > default. Values land in the binary's own config struct (by offset). */
#ifndef PSHARD_CONFIG_H
#define PSHARD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "pshard/status.h"

typedef enum {
    PS_OPT_STRING, /* char * field; the parsed value is a malloc'd copy (ps_config_free frees) */
    PS_OPT_INT,    /* int64_t field; base 10, checked against [min, max] */
    PS_OPT_BOOL,   /* bool field; "--flag", "--flag=true|false|1|0|yes|no", env likewise */
} ps_opt_type_t;

typedef enum {
    PS_SRC_DEFAULT = 0,
    PS_SRC_ENV = 1,
    PS_SRC_FLAG = 2,
} ps_opt_source_t;

typedef struct {
    const char *flag;          /* long flag without dashes: "listen" means --listen */
    const char *env;           /* comma-separated env names tried in order, or NULL */
    ps_opt_type_t type;        /* how the text is parsed */
    const char *default_value; /* text form of the default, or NULL for none (string stays NULL) */
    const char *help;          /* one line for --help */
    size_t offset;             /* offsetof(the binary's config struct, field) */
    int64_t min, max;          /* bounds for PS_OPT_INT (ignored when min == max == 0) */
} ps_option_t;

/* What ps_config_parse found besides option values. */
typedef struct {
    bool help;                  /* --help or -h was given: print usage, exit 0 */
    bool version;               /* --version was given: print version, exit 0 */
    int first_positional;       /* argv index of the first non-option argument (or argc) */
    ps_opt_source_t source[64]; /* where each option's value came from, by table index */
} ps_config_result_t;

/* Fills `config` (the binary's struct) from argv, then the environment, then defaults, for
 * every option in `opts` (at most 64). Parsing stops at the first non-option argument or
 * after "--". Errors: PSHARD_ERR_INVALID_ARGUMENT with a message in err naming the flag or
 * environment variable and what was wrong (unknown flag, missing value, bad integer, out of
 * range, bad boolean). On error, strings already parsed stay in `config`; call
 * ps_config_free to release them. Not thread-safe (reads the environment). */
pshard_status_t ps_config_parse(const ps_option_t *opts, size_t nopts, int argc, char **argv,
                                void *config, ps_config_result_t *result, char *err, size_t errlen);

/* The start every pshard daemon and tool shares: ps_config_parse, then usage on --help and
 * "PROG VERSION" on --version, a refusal of positional arguments unless allow_positional,
 * and the log level of the option named "log" (if the table has one) applied with
 * ps_log_set_level. Returns -1 when main should go on, else the exit code main returns: 0
 * after --help/--version, 2 after a message on stderr naming the bad flag or value. */
int ps_config_main(const ps_option_t *opts, size_t nopts, int argc, char **argv, void *config,
                   ps_config_result_t *result, const char *prog, const char *synopsis,
                   const char *summary, bool allow_positional);

/* Frees the PS_OPT_STRING fields of `config` and sets them to NULL. NULL config is a no-op. */
void ps_config_free(const ps_option_t *opts, size_t nopts, void *config);

/* Prints usage: "usage: PROG SYNOPSIS", the summary, then one line per option with its flag,
 * env names, default and help, plus --help and --version. */
void ps_config_usage(FILE *out, const char *prog, const char *synopsis, const char *summary,
                     const ps_option_t *opts, size_t nopts);

/* Logs the effective configuration at info level (subsystem main), one line per option with
 * its value and source. Options whose flag contains "token" are shown as "(set)". */
void ps_config_log(const ps_option_t *opts, size_t nopts, const void *config,
                   const ps_config_result_t *result);

#endif
