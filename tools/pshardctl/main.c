/* pshardctl: the operator's command line for a pshard cluster. It asks a coordinator for
 * status (with the Join table, and each shard server's own status and flight records, to see
 * who is stuck where), members, health, store entries and the Watch stream, can register
 * a member by hand, and handles checkpoints: list, verify and export them offline, or ask the
 * running cluster to save one, and writes (trace dump) and reads (trace analyze) the shard
 * servers' flight records as trace files. Tables for people, --json for scripts; exit 0 ok, 1 not
 * serving or failed (a corrupt checkpoint, a save that failed), 2 error. */

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/log.h"
#include "pshard/util.h"

#include "ctl.h"

#define GOPT(flag, env, type, def, help, field, lo, hi)                                            \
    {                                                                                              \
        flag, env, type, def, help, offsetof(ctl_opts_t, field), lo, hi                            \
    }

static const ps_option_t global_options[] = {
    GOPT("coordinator", "PSHARD_COORDINATOR", PS_OPT_STRING, NULL,
         "coordinator HOST:PORT (default MASTER_ADDR:MASTER_PORT, else 127.0.0.1:29500)",
         coordinator, 0, 0),
    GOPT("token-file", "PSHARD_TOKEN_FILE", PS_OPT_STRING, NULL, "file holding the cluster token",
         token_file, 0, 0),
    GOPT("tls-ca", "PSHARD_TLS_CA", PS_OPT_STRING, NULL, "PEM CA that signed the server's cert",
         tls_ca, 0, 0),
    GOPT("tls-cert", "PSHARD_TLS_CERT", PS_OPT_STRING, NULL, "PEM client certificate (mTLS)",
         tls_cert, 0, 0),
    GOPT("tls-key", "PSHARD_TLS_KEY", PS_OPT_STRING, NULL, "PEM key of --tls-cert", tls_key, 0, 0),
    GOPT("tls-server-name", "PSHARD_TLS_SERVER_NAME", PS_OPT_STRING, NULL,
         "name the server certificate must carry, if not the address's host", tls_server_name, 0,
         0),
    GOPT("job", "PSHARD_JOB", PS_OPT_STRING, NULL,
         "the job to look at or act in (torchrun's --rdzv-id; default: the coordinator's "
         "job \"default\")",
         job, 0, 0),
    GOPT("timeout-ms", "PSHARD_TIMEOUT_MS", PS_OPT_INT, "5000", "deadline of each call", timeout_ms,
         1, 86400000),
    GOPT("server-timeout-ms", "PSHARD_SERVER_TIMEOUT_MS", PS_OPT_INT, "2000",
         "deadline of each shard server's Status call in 'status' (0: do not ask the servers)",
         server_timeout_ms, 0, 86400000),
    GOPT("json", NULL, PS_OPT_BOOL, "false", "print JSON instead of tables", json, 0, 0),
};

/* The option of table t that arg ("--flag" or "--flag=value") names, or NULL. */
static const ps_option_t *option_named(const ps_option_t *t, size_t n, const char *arg)
{
    if (strncmp(arg, "--", 2) != 0)
        return NULL;
    const char *name = arg + 2, *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    for (size_t i = 0; i < n; i++)
        if (strlen(t[i].flag) == len && strncmp(t[i].flag, name, len) == 0)
            return &t[i];
    return NULL;
}

/* Global options may come anywhere on the line, as git and kubectl take them (`pshardctl
 * status --json`): this puts every one found after the command in front of it (with its value
 * when that is the next word), unless the command's own table has an option of that name, and
 * stops at "--". out and rest hold argc + 1 entries each; returns out's count. */
static int hoist_global_options(int argc, char **argv, char **out, char **rest)
{
    int n = 0, nrest = 0;
    const char *cmd = NULL, *sub = NULL;
    out[n++] = argv[0];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            while (i < argc)
                rest[nrest++] = argv[i++];
            break;
        }
        size_t nown = 0;
        const ps_option_t *own = NULL;
        if (cmd && strcmp(cmd, "register") == 0)
            own = ctl_register_options(&nown);
        else if (cmd && strcmp(cmd, "checkpoint") == 0)
            own = ctl_checkpoint_options(sub, &nown);
        const ps_option_t *g = option_named(global_options, PS_ARRAY_LEN(global_options), a);
        if (g && !(own && option_named(own, nown, a))) {
            out[n++] = argv[i];
            if (g->type != PS_OPT_BOOL && !strchr(a, '=') && i + 1 < argc)
                out[n++] = argv[++i];
            continue;
        }
        if (a[0] != '-') {
            if (!cmd)
                cmd = a;
            else if (!sub && strcmp(cmd, "checkpoint") == 0)
                sub = a;
        }
        rest[nrest++] = argv[i];
    }
    for (int k = 0; k < nrest; k++)
        out[n++] = rest[k];
    out[n] = NULL;
    return n;
}

int main(int argc, char **argv)
{
    ps_log_init("pshardctl");
    char **hoisted = calloc((size_t)argc * 2 + 2, sizeof(char *));
    if (!hoisted) {
        fputs("pshardctl: out of memory\n", stderr);
        return EXIT_ERROR;
    }
    argc = hoist_global_options(argc, argv, hoisted, hoisted + argc + 1);
    argv = hoisted;
    ps_config_result_t res;
    char err[PSHARD_ERRLEN] = "";
    int rc = EXIT_ERROR;
    char default_target[300];
    if (ps_config_parse(global_options, PS_ARRAY_LEN(global_options), argc, argv, &ctl_opts, &res,
                        err, sizeof(err)) != PSHARD_OK) {
        ctl_fail("%s (see --help)", err);
        goto out;
    }
    if (res.help) {
        ps_config_usage(stdout, "pshardctl", "[OPTIONS] COMMAND [ARGS]",
                        "Queries and drives a pshard coordinator.", global_options,
                        PS_ARRAY_LEN(global_options));
        fputs(ctl_usage_text, stdout);
        rc = EXIT_OK;
        goto out;
    }
    if (res.version) {
        printf("pshardctl %s\n", PSHARD_VERSION_STRING);
        rc = EXIT_OK;
        goto out;
    }
    if (res.first_positional >= argc) {
        ctl_fail("no command given (see --help)");
        goto out;
    }
    const char *cmd = argv[res.first_positional];
    int cargc = argc - res.first_positional - 1;
    char **cargv = argv + res.first_positional + 1;
    /* Checkpoint files are read offline: no coordinator, token or TLS is needed for them. */
    if (strcmp(cmd, "checkpoint") == 0 && !(cargc > 0 && strcmp(cargv[0], "save") == 0)) {
        rc = cmd_checkpoint(cargc, cargv);
        goto out;
    }
    /* So is a trace directory. */
    if (strcmp(cmd, "trace") == 0 && !(cargc > 0 && strcmp(cargv[0], "dump") == 0)) {
        rc = cmd_trace(cargc, cargv);
        goto out;
    }
    if (!ctl_opts.coordinator) {
        ps_default_coordinator(default_target, sizeof(default_target));
        ctl_opts.coordinator = strdup(default_target);
    }
    if (ctl_opts.token_file) {
        ctl_token = ps_read_token(ctl_opts.token_file, err, sizeof(err));
        if (!ctl_token) {
            ctl_fail("--token-file: %s", err);
            goto out;
        }
    }
    ps_rpc_channel_config_t ccfg = {
        .target = ctl_opts.coordinator,
        .tls_ca_file = ctl_opts.tls_ca,
        .tls_cert_file = ctl_opts.tls_cert,
        .tls_key_file = ctl_opts.tls_key,
        .tls_server_name = ctl_opts.tls_server_name,
        .token = ctl_token,
        .max_message_bytes = 64 << 20,
        .job = ctl_opts.job,
    };
    ctl_channel = ps_rpc_channel_create(&ccfg, err, sizeof(err));
    if (!ctl_channel) {
        ctl_fail("%s", err);
        goto out;
    }
    if ((strcmp(cmd, "status") == 0 || strcmp(cmd, "members") == 0) && cargc > 0)
        rc = ctl_fail("%s: unknown %s '%s' (see --help)", cmd,
                      cargv[0][0] == '-' ? "option" : "argument", cargv[0]);
    else if (strcmp(cmd, "status") == 0)
        rc = cmd_status(false);
    else if (strcmp(cmd, "members") == 0)
        rc = cmd_status(true);
    else if (strcmp(cmd, "health") == 0)
        rc = cmd_health(cargc, cargv);
    else if (strcmp(cmd, "store") == 0)
        rc = cmd_store(cargc, cargv);
    else if (strcmp(cmd, "watch") == 0)
        rc = cmd_watch(cargc, cargv);
    else if (strcmp(cmd, "register") == 0)
        rc = cmd_register(cargc, cargv);
    else if (strcmp(cmd, "checkpoint") == 0)
        rc = cmd_checkpoint(cargc, cargv);
    else if (strcmp(cmd, "trace") == 0)
        rc = cmd_trace(cargc, cargv);
    else
        rc = ctl_fail("unknown command '%s' (see --help)", cmd);
out:
    ps_rpc_channel_destroy(ctl_channel);
    free(ctl_token);
    ps_config_free(global_options, PS_ARRAY_LEN(global_options), &ctl_opts);
    free(hoisted);
    return rc;
}
