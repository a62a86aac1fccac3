/* Command-line and environment configuration: parses a binary's option table from argv, the
 * environment and the table's defaults (in that order of precedence) into the binary's config
 * struct, and prints --help from the same table. */
#include "pshard/config.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "pshard/log.h"
#include "pshard/util.h"

/* result->source has one slot per option; a table larger than this is refused. */
#define CONFIG_MAX_OPTS (sizeof(((ps_config_result_t *)0)->source) / sizeof(ps_opt_source_t))

/* Longest single environment variable name accepted in an option's env list. */
#define CONFIG_MAX_ENV_NAME 128

#define CONFIG_BOOL_FORMS "true|false|1|0|yes|no|on|off"

/* The text chosen for one option while parsing, before it is written into the config struct.
 * text points into argv, the environment, the table, or a string literal; never owned. */
typedef struct {
    const char *text;       /* NULL when no flag, env or default supplied a value */
    ps_opt_source_t source; /* where text came from */
} config_choice_t;

static void *config_field(void *config, const ps_option_t *opt)
{
    return (char *)config + opt->offset;
}

static const void *config_field_const(const void *config, const ps_option_t *opt)
{
    return (const char *)config + opt->offset;
}

/* Parses boolean text (case-insensitive); returns false when it is none of the accepted forms. */
static bool config_parse_bool(const char *text, bool *out)
{
    static const char *const true_forms[] = {"true", "1", "yes", "on"};
    static const char *const false_forms[] = {"false", "0", "no", "off"};
    for (size_t i = 0; i < PS_ARRAY_LEN(true_forms); i++) {
        if (strcasecmp(text, true_forms[i]) == 0) {
            *out = true;
            return true;
        }
        if (strcasecmp(text, false_forms[i]) == 0) {
            *out = false;
            return true;
        }
    }
    return false;
}

/* True when text looks like a base-10 integer (optional sign, then digits only), so that a
 * parse failure on it can only mean it does not fit in 64 bits. */
static bool config_is_digits(const char *text)
{
    if (*text == '+' || *text == '-')
        text++;
    if (!*text)
        return false;
    for (; *text; text++) {
        if (*text < '0' || *text > '9')
            return false;
    }
    return true;
}

/* Checks that text is a valid value for opt. `label` names where the text came from
 * ("--lease-ms" or "environment PSHARD_LEASE_MS") and starts every error message.
 * Returns PSHARD_ERR_INVALID_ARGUMENT with a message in err when it is not. */
static pshard_status_t config_check_value(const ps_option_t *opt, const char *text,
                                          const char *label, char *err, size_t errlen)
{
    switch (opt->type) {
    case PS_OPT_STRING:
        return PSHARD_OK;
    case PS_OPT_INT: {
        int64_t lo = opt->min, hi = opt->max;
        if (lo == 0 && hi == 0) {
            lo = INT64_MIN;
            hi = INT64_MAX;
        }
        int64_t value;
        if (ps_parse_i64(text, INT64_MIN, INT64_MAX, &value) != 0) {
            if (config_is_digits(text))
                return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                               "%s: '%s' is out of range [%lld, %lld]", label, text, (long long)lo,
                               (long long)hi);
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: '%s' is not an integer",
                           label, text);
        }
        if (value < lo || value > hi)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s: %lld is out of range [%lld, %lld]", label, (long long)value,
                           (long long)lo, (long long)hi);
        return PSHARD_OK;
    }
    case PS_OPT_BOOL: {
        bool value;
        if (!config_parse_bool(text, &value))
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s: '%s' is not a boolean (" CONFIG_BOOL_FORMS ")", label, text);
        return PSHARD_OK;
    }
    }
    return ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "%s: option has unknown type %d", label,
                   (int)opt->type);
}

/* Copies the next name of a comma-separated env list into name (spaces around it trimmed) and
 * returns a pointer past it, or NULL at the end of the list. An empty or overlong name is
 * returned as "" so the table check can reject it. */
static const char *config_next_env(const char *list, char name[CONFIG_MAX_ENV_NAME])
{
    if (!list || !*list)
        return NULL;
    size_t len = strcspn(list, ",");
    const char *start = list, *end = list + len;
    while (start < end && *start == ' ')
        start++;
    while (end > start && end[-1] == ' ')
        end--;
    size_t n = (size_t)(end - start);
    if (n >= CONFIG_MAX_ENV_NAME)
        n = 0;
    memcpy(name, start, n);
    name[n] = '\0';
    list += len;
    return *list == ',' ? list + 1 : list;
}

/* Checks the table itself: non-empty, unique flags that do not shadow --help/--version, known
 * types, sane bounds, well-formed env lists and valid defaults. Any failure is a bug in the
 * binary, not in its input, so it is reported as PSHARD_ERR_INTERNAL. */
static pshard_status_t config_check_table(const ps_option_t *opts, size_t nopts, char *err,
                                          size_t errlen)
{
    for (size_t i = 0; i < nopts; i++) {
        const ps_option_t *opt = &opts[i];
        if (!opt->flag || !opt->flag[0] || opt->flag[0] == '-' || strchr(opt->flag, '='))
            return ps_errf(err, errlen, PSHARD_ERR_INTERNAL,
                           "option table: entry %zu has an invalid flag name", i);
        if (strcmp(opt->flag, "help") == 0 || strcmp(opt->flag, "version") == 0)
            return ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "option table: --%s is reserved",
                           opt->flag);
        for (size_t j = 0; j < i; j++) {
            if (strcmp(opts[j].flag, opt->flag) == 0)
                return ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "option table: --%s appears twice",
                               opt->flag);
        }
        if (opt->type != PS_OPT_STRING && opt->type != PS_OPT_INT && opt->type != PS_OPT_BOOL)
            return ps_errf(err, errlen, PSHARD_ERR_INTERNAL,
                           "option table: --%s has unknown type %d", opt->flag, (int)opt->type);
        if (opt->type == PS_OPT_INT && opt->min > opt->max)
            return ps_errf(err, errlen, PSHARD_ERR_INTERNAL,
                           "option table: --%s has min %lld > max %lld", opt->flag,
                           (long long)opt->min, (long long)opt->max);
        char name[CONFIG_MAX_ENV_NAME];
        for (const char *p = config_next_env(opt->env, name); p; p = config_next_env(p, name)) {
            if (!name[0])
                return ps_errf(err, errlen, PSHARD_ERR_INTERNAL,
                               "option table: --%s has an empty or overlong env name in '%s'",
                               opt->flag, opt->env);
        }
        if (opt->default_value) {
            char label[160];
            ps_snprintf(label, sizeof(label), "option table: default of --%s", opt->flag);
            pshard_status_t rc = config_check_value(opt, opt->default_value, label, err, errlen);
            if (rc != PSHARD_OK)
                return PSHARD_ERR_INTERNAL;
        }
    }
    return PSHARD_OK;
}

/* Finds the option named by the name[0..len) part of "--name[=value]"; NULL when none. */
static const ps_option_t *config_find(const ps_option_t *opts, size_t nopts, const char *name,
                                      size_t len, size_t *index)
{
    for (size_t i = 0; i < nopts; i++) {
        if (strlen(opts[i].flag) == len && strncmp(opts[i].flag, name, len) == 0) {
            *index = i;
            return &opts[i];
        }
    }
    return NULL;
}

/* Handles one argv element that starts with "--" and names an option (not "--", --help or
 * --version). May consume argv[*i + 1] as the value; advances *i past what it used. */
static pshard_status_t config_parse_long(const ps_option_t *opts, size_t nopts, int argc,
                                         char **argv, int *i, config_choice_t *choice, char *err,
                                         size_t errlen)
{
    const char *arg = argv[*i];
    const char *name = arg + 2;
    const char *eq = strchr(name, '=');
    size_t name_len = eq ? (size_t)(eq - name) : strlen(name);
    const char *value = eq ? eq + 1 : NULL;

    size_t index = 0;
    const ps_option_t *opt = config_find(opts, nopts, name, name_len, &index);
    if (!opt && name_len > 3 && strncmp(name, "no-", 3) == 0) {
        /* --no-NAME turns a boolean off; an exact "no-..." option name was preferred above. */
        opt = config_find(opts, nopts, name + 3, name_len - 3, &index);
        if (opt && opt->type == PS_OPT_BOOL) {
            if (value)
                return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                               "--%.*s does not take a value", (int)name_len, name);
            choice[index].text = "false";
            choice[index].source = PS_SRC_FLAG;
            return PSHARD_OK;
        }
        opt = NULL;
    }
    if (!opt)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown flag --%.*s",
                       (int)name_len, name);

    char label[160];
    ps_snprintf(label, sizeof(label), "--%s", opt->flag);
    if (!value) {
        if (opt->type == PS_OPT_BOOL) {
            value = "true";
        } else {
            /* The next argument is the value unless it is missing or is itself a long option
             * (or "--"): "--listen --verbose" is far more likely a forgotten value than a
             * listen address. Single-dash values such as "-5" are accepted. */
            const char *next = *i + 1 < argc ? argv[*i + 1] : NULL;
            if (!next || strncmp(next, "--", 2) == 0)
                return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s needs a value", label);
            value = next;
            (*i)++;
        }
    }
    PS_CHECK(config_check_value(opt, value, label, err, errlen));
    choice[index].text = value;
    choice[index].source = PS_SRC_FLAG;
    return PSHARD_OK;
}

/* Picks the first set, non-empty variable of opt's env list, checking its value. */
static pshard_status_t config_from_env(const ps_option_t *opt, config_choice_t *choice, char *err,
                                       size_t errlen)
{
    char name[CONFIG_MAX_ENV_NAME];
    for (const char *p = config_next_env(opt->env, name); p; p = config_next_env(p, name)) {
        const char *value = getenv(name);
        if (!value || !value[0])
            continue;
        char label[CONFIG_MAX_ENV_NAME + 16];
        ps_snprintf(label, sizeof(label), "environment %s", name);
        PS_CHECK(config_check_value(opt, value, label, err, errlen));
        choice->text = value;
        choice->source = PS_SRC_ENV;
        return PSHARD_OK;
    }
    return PSHARD_OK;
}

/* Writes already-checked text into opt's field. Strings are copied (freed by ps_config_free). */
static pshard_status_t config_store(const ps_option_t *opt, const char *text, void *config,
                                    char *err, size_t errlen)
{
    void *field = config_field(config, opt);
    switch (opt->type) {
    case PS_OPT_STRING: {
        char *copy = NULL;
        if (text) {
            copy = strdup(text);
            if (!copy)
                return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "--%s: out of memory", opt->flag);
        }
        *(char **)field = copy;
        return PSHARD_OK;
    }
    case PS_OPT_INT: {
        int64_t value = 0;
        if (text && ps_parse_i64(text, INT64_MIN, INT64_MAX, &value) != 0)
            return ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "--%s: unchecked value '%s'",
                           opt->flag, text);
        *(int64_t *)field = value;
        return PSHARD_OK;
    }
    case PS_OPT_BOOL: {
        bool value = false;
        if (text && !config_parse_bool(text, &value))
            return ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "--%s: unchecked value '%s'",
                           opt->flag, text);
        *(bool *)field = value;
        return PSHARD_OK;
    }
    }
    return PSHARD_ERR_INTERNAL;
}

/* Sets every option field to its empty value (NULL, 0, false) without freeing anything. */
static void config_clear(const ps_option_t *opts, size_t nopts, void *config)
{
    for (size_t i = 0; i < nopts; i++) {
        void *field = config_field(config, &opts[i]);
        switch (opts[i].type) {
        case PS_OPT_STRING:
            *(char **)field = NULL;
            break;
        case PS_OPT_INT:
            *(int64_t *)field = 0;
            break;
        case PS_OPT_BOOL:
            *(bool *)field = false;
            break;
        }
    }
}

/* Every option field is overwritten (strings first set to NULL, without freeing what was there:
 * pass a fresh struct, or ps_config_free one before parsing into it again). All values are
 * checked before any string is copied, so on an input error no string is allocated. When
 * --help, -h or --version is seen, parsing stops there and PSHARD_OK is returned with every
 * field empty; the caller is expected to print and exit. */
pshard_status_t ps_config_parse(const ps_option_t *opts, size_t nopts, int argc, char **argv,
                                void *config, ps_config_result_t *result, char *err, size_t errlen)
{
    if (err && errlen > 0)
        err[0] = '\0';
    if (!result || !config || (nopts > 0 && !opts) || argc < 0 || (argc > 0 && !argv))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "ps_config_parse: NULL table, config, result or argv");
    memset(result, 0, sizeof(*result));
    result->first_positional = argc;
    if (nopts > CONFIG_MAX_OPTS)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "too many options (%zu, at most %zu)", nopts, (size_t)CONFIG_MAX_OPTS);
    PS_CHECK(config_check_table(opts, nopts, err, errlen));
    config_clear(opts, nopts, config);

    config_choice_t choice[CONFIG_MAX_OPTS];
    for (size_t k = 0; k < nopts; k++) {
        choice[k].text = opts[k].default_value;
        choice[k].source = PS_SRC_DEFAULT;
    }

    /* argv[0] is the program name. */
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (!arg || arg[0] != '-' || arg[1] == '\0') {
            /* First positional ("-" alone is one, conventionally stdin). */
            result->first_positional = i;
            break;
        }
        if (strcmp(arg, "--") == 0) {
            result->first_positional = i + 1;
            break;
        }
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            result->help = true;
            return PSHARD_OK;
        }
        if (strcmp(arg, "--version") == 0) {
            result->version = true;
            return PSHARD_OK;
        }
        if (strncmp(arg, "--help=", 7) == 0 || strncmp(arg, "--version=", 10) == 0)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "--%.*s does not take a value",
                           (int)strcspn(arg + 2, "="), arg + 2);
        if (arg[1] != '-')
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "unknown flag %s", arg);
        PS_CHECK(config_parse_long(opts, nopts, argc, argv, &i, choice, err, errlen));
    }

    /* The environment is read only for options no flag set, so a bad variable does not
     * matter when the flag overrides it. */
    for (size_t k = 0; k < nopts; k++) {
        if (choice[k].source != PS_SRC_FLAG)
            PS_CHECK(config_from_env(&opts[k], &choice[k], err, errlen));
    }

    for (size_t k = 0; k < nopts; k++) {
        PS_CHECK(config_store(&opts[k], choice[k].text, config, err, errlen));
        result->source[k] = choice[k].source;
    }
    return PSHARD_OK;
}

void ps_config_free(const ps_option_t *opts, size_t nopts, void *config)
{
    if (!opts || !config)
        return;
    for (size_t i = 0; i < nopts; i++) {
        if (opts[i].type != PS_OPT_STRING)
            continue;
        char **field = config_field(config, &opts[i]);
        free(*field);
        *field = NULL;
    }
}

/* Writes the left column of an option's usage line ("--flag VALUE") into buf. */
static void config_usage_left(const ps_option_t *opt, char *buf, size_t len)
{
    if (opt->type == PS_OPT_BOOL)
        ps_snprintf(buf, len, "--%s", opt->flag);
    else
        ps_snprintf(buf, len, "--%s VALUE", opt->flag);
}

void ps_config_usage(FILE *out, const char *prog, const char *synopsis, const char *summary,
                     const ps_option_t *opts, size_t nopts)
{
    static const char help_left[] = "-h, --help";
    static const char version_left[] = "--version";
    if (!out)
        return;
    if (!opts)
        nopts = 0;
    fprintf(out, "usage: %s%s%s\n", prog ? prog : "pshard", synopsis ? " " : "",
            synopsis ? synopsis : "");
    if (summary && summary[0])
        fprintf(out, "\n%s\n", summary);
    fprintf(out, "\noptions:\n");

    char left[160];
    int width = (int)strlen(help_left);
    for (size_t i = 0; i < nopts; i++) {
        config_usage_left(&opts[i], left, sizeof(left));
        if ((int)strlen(left) > width)
            width = (int)strlen(left);
    }

    for (size_t i = 0; i < nopts; i++) {
        const ps_option_t *opt = &opts[i];
        config_usage_left(opt, left, sizeof(left));
        fprintf(out, "  %-*s  %s", width, left, opt->help ? opt->help : "");
        bool has_env = opt->env && opt->env[0];
        if (has_env || opt->default_value) {
            fprintf(out, " (");
            if (has_env) {
                fprintf(out, "env: ");
                char name[CONFIG_MAX_ENV_NAME];
                bool first = true;
                for (const char *p = config_next_env(opt->env, name); p;
                     p = config_next_env(p, name)) {
                    fprintf(out, "%s%s", first ? "" : ", ", name);
                    first = false;
                }
            }
            if (opt->default_value)
                fprintf(out, "%sdefault: %s", has_env ? "; " : "", opt->default_value);
            fprintf(out, ")");
        }
        fprintf(out, "\n");
    }
    fprintf(out, "  %-*s  %s\n", width, help_left, "show this help and exit");
    fprintf(out, "  %-*s  %s\n", width, version_left, "show the version and exit");
}

static const char *config_source_name(ps_opt_source_t source)
{
    switch (source) {
    case PS_SRC_FLAG:
        return "flag";
    case PS_SRC_ENV:
        return "env";
    case PS_SRC_DEFAULT:
        return "default";
    }
    return "unknown";
}

void ps_config_log(const ps_option_t *opts, size_t nopts, const void *config,
                   const ps_config_result_t *result)
{
    if (!opts || !config || !ps_log_enabled(PS_LOG_INFO, PS_SUB_MAIN))
        return;
    if (nopts > CONFIG_MAX_OPTS)
        nopts = CONFIG_MAX_OPTS;
    for (size_t i = 0; i < nopts; i++) {
        const ps_option_t *opt = &opts[i];
        const void *field = config_field_const(config, opt);
        bool secret = strstr(opt->flag, "token") != NULL;
        char value[32];
        const char *shown = value;
        switch (opt->type) {
        case PS_OPT_STRING: {
            const char *s = *(char *const *)field;
            if (secret)
                shown = (s && s[0]) ? "(set)" : "(unset)";
            else
                shown = s ? s : "(unset)";
            break;
        }
        case PS_OPT_INT:
            if (secret)
                shown = "(set)";
            else
                ps_snprintf(value, sizeof(value), "%lld", (long long)*(const int64_t *)field);
            break;
        case PS_OPT_BOOL:
            shown = *(const bool *)field ? "true" : "false";
            break;
        default:
            shown = "?";
            break;
        }
        PS_INFO(PS_SUB_MAIN, "config: --%s=%s (%s)", opt->flag, shown,
                result ? config_source_name(result->source[i]) : "unknown");
    }
}

int ps_config_main(const ps_option_t *opts, size_t nopts, int argc, char **argv, void *config,
                   ps_config_result_t *result, const char *prog, const char *synopsis,
                   const char *summary, bool allow_positional)
{
    char err[PSHARD_ERRLEN] = "";
    if (ps_config_parse(opts, nopts, argc, argv, config, result, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "%s: %s (see --help)\n", prog, err);
        return 2;
    }
    if (result->help) {
        ps_config_usage(stdout, prog, synopsis, summary, opts, nopts);
        return 0;
    }
    if (result->version) {
        printf("%s %s\n", prog, PSHARD_VERSION_STRING);
        return 0;
    }
    if (!allow_positional && result->first_positional < argc) {
        fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", prog,
                argv[result->first_positional]);
        return 2;
    }
    for (size_t i = 0; i < nopts; i++) {
        if (strcmp(opts[i].flag, "log") != 0 || opts[i].type != PS_OPT_STRING)
            continue;
        const char *text = *(char *const *)((const char *)config + opts[i].offset);
        ps_log_level_t level;
        if (text && !ps_log_parse_level(text, &level)) {
            fprintf(stderr, "%s: --log '%s' is not error|warn|info|debug|trace\n", prog, text);
            return 2;
        }
        if (text)
            ps_log_set_level(level);
    }
    ps_config_log(opts, nopts, config, result);
    return -1;
}
