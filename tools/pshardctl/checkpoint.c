/* pshardctl checkpoint: list, verify and export checkpoints offline, or ask the running
 * cluster to save one. */

#include <dirent.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "pshard/ckpt.h"
#include "pshard/log.h"
#include "pshard/util.h"

#include "ctl.h"

/* ---- checkpoint: list and export offline, save through the coordinator ------------------- */

typedef struct {
    char *checkpoint_dir;
    bool verify;
    char *format;
    char *dtype;
    int64_t step;
    int64_t timeout_ms;
} ckpt_cli_t;

#define COPT(flag, env, type, def, help, field, lo, hi)                                            \
    {                                                                                              \
        flag, env, type, def, help, offsetof(ckpt_cli_t, field), lo, hi                            \
    }
#define COPT_DIR                                                                                   \
    COPT("checkpoint-dir", "PSHARD_CHECKPOINT_DIR", PS_OPT_STRING, NULL,                           \
         "directory holding the step-NNNNNNNN checkpoint directories", checkpoint_dir, 0, 0)

static const ps_option_t ckpt_list_options[] = {
    COPT_DIR,
    COPT("verify", NULL, PS_OPT_BOOL, "false",
         "also check every shard file's size and CRC-32C (exit 1 on corruption)", verify, 0, 0),
};

static const ps_option_t ckpt_export_options[] = {
    COPT_DIR,
    COPT("format", NULL, PS_OPT_STRING, "safetensors", "output format (safetensors)", format, 0, 0),
    COPT("dtype", NULL, PS_OPT_STRING, "fp32", "element type written: fp32 or bf16", dtype, 0, 0),
    COPT("step", NULL, PS_OPT_INT, "-1", "step to export (-1: the newest committed)", step, -1,
         INT64_MAX),
};

static const ps_option_t ckpt_save_options[] = {
    COPT("timeout-ms", NULL, PS_OPT_INT, "600000", "how long to wait for the shard servers to save",
         timeout_ms, 1, 86400000),
};

/* "12.3 MiB" */
static void human_bytes(uint64_t bytes, char *buf, size_t len)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = (double)bytes;
    size_t u = 0;
    while (v >= 1024 && u + 1 < PS_ARRAY_LEN(units)) {
        v /= 1024;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%" PRIu64 " B", bytes);
    else
        snprintf(buf, len, "%.1f %s", v, units[u]);
}

/* Parses a checkpoint subcommand's options (argv[0] is the subcommand). Returns -1 to go on,
 * else the exit code (after --help, or an error already printed). */
static int ckpt_parse(const char *sub, const ps_option_t *table, size_t n, int argc, char **argv,
                      ckpt_cli_t *c, ps_config_result_t *res, const char *synopsis,
                      const char *summary)
{
    char err[PSHARD_ERRLEN] = "";
    if (ps_config_parse(table, n, argc, argv, c, res, err, sizeof(err)) != PSHARD_OK)
        return ctl_fail("checkpoint %s: %s (see 'pshardctl checkpoint %s --help')", sub, err, sub);
    if (res->help) {
        char prog[64];
        snprintf(prog, sizeof(prog), "pshardctl checkpoint %s", sub);
        ps_config_usage(stdout, prog, synopsis, summary, table, n);
        return EXIT_OK;
    }
    return -1;
}

/* Step directories under root that are not committed checkpoints, and why, printed (or, with
 * ignored, appended to that JSON list). Returns how many had a manifest that does not parse. */
static int ckpt_report_ignored(const char *root, const int64_t *steps, size_t nsteps,
                               json_t *ignored)
{
    DIR *d = opendir(root);
    if (!d)
        return 0;
    int malformed = 0;
    bool first = true;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "step-", 5) != 0)
            continue;
        int64_t step = -1;
        ps_parse_i64(e->d_name + 5, 0, INT64_MAX, &step);
        bool listed = false;
        for (size_t i = 0; i < nsteps && !listed; i++) {
            char canon[40];
            snprintf(canon, sizeof(canon), "step-%08" PRId64, steps[i]);
            listed = strcmp(canon, e->d_name) == 0;
        }
        if (listed)
            continue;
        char dir[4096], why[PSHARD_ERRLEN] = "";
        snprintf(dir, sizeof(dir), "%s/%s", root, e->d_name);
        struct stat st;
        if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
            continue;
        ps_ckpt_manifest_t *m = NULL;
        pshard_status_t rc = ps_ckpt_manifest_read(dir, &m, why, sizeof(why));
        if (rc == PSHARD_ERR_NOT_FOUND)
            snprintf(why, sizeof(why), "no %s: a save that did not commit", PS_CKPT_MANIFEST);
        else if (rc == PSHARD_OK)
            snprintf(why, sizeof(why), "not named as its manifest's step %" PRId64, m->step);
        else if (rc == PSHARD_ERR_INVALID_ARGUMENT)
            malformed++;
        ps_ckpt_manifest_free(m);
        if (ignored) {
            json_array_append_new(
                ignored, json_pack("{s:o,s:o}", "dir", ctl_jstr(dir), "reason", ctl_jstr(why)));
        } else {
            printf("%signored: %s: %s\n", first ? "\n" : "", e->d_name, why);
        }
        first = false;
    }
    closedir(d);
    return malformed;
}

static int cmd_checkpoint_list(int argc, char **argv)
{
    ckpt_cli_t c = {0};
    ps_config_result_t res;
    int rc = ckpt_parse("list", ckpt_list_options, PS_ARRAY_LEN(ckpt_list_options), argc, argv, &c,
                        &res, "[--verify] [--checkpoint-dir DIR]",
                        "Lists the committed checkpoints under DIR (offline).");
    int64_t *steps = NULL;
    size_t n = 0;
    char err[PSHARD_ERRLEN] = "";
    json_t *list = NULL; /* the --json output, built before anything is printed */
    if (rc >= 0)
        goto out;
    rc = EXIT_ERROR;
    if (res.first_positional < argc) {
        ctl_fail("checkpoint list: unexpected argument '%s'", argv[res.first_positional]);
        goto out;
    }
    if (!c.checkpoint_dir || !*c.checkpoint_dir) {
        ctl_fail("checkpoint list needs --checkpoint-dir DIR (or PSHARD_CHECKPOINT_DIR)");
        goto out;
    }
    if (ps_ckpt_list(c.checkpoint_dir, &steps, &n, NULL, 0, err, sizeof(err)) != PSHARD_OK) {
        ctl_fail("checkpoint list: %s", err);
        goto out;
    }
    size_t files = 0, corrupt = 0;
    list = ctl_opts.json ? json_array() : NULL;
    if (ctl_opts.json) {
        if (!list) {
            ctl_fail("out of memory");
            goto out;
        }
    } else if (n == 0) {
        printf("no committed checkpoints in %s\n", c.checkpoint_dir);
    } else {
        printf("%-10s %6s %-7s %-9s %-32s %7s %11s  %s\n", "STEP", "WORLD", "LAYOUT", "OPTIMIZER",
               "SECTIONS", "PARAMS", "SIZE", "DIRECTORY");
    }
    for (size_t i = 0; i < n; i++) {
        char dir[4096];
        ps_ckpt_step_dir(c.checkpoint_dir, steps[i], dir, sizeof(dir));
        ps_ckpt_manifest_t *m = NULL;
        err[0] = '\0';
        if (ps_ckpt_manifest_read(dir, &m, err, sizeof(err)) != PSHARD_OK) {
            /* Removed or changed since it was listed. */
            fprintf(stderr, "pshardctl: %s\n", err);
            corrupt++;
            continue;
        }
        uint64_t bytes = 0;
        for (size_t f = 0; f < m->nfiles; f++)
            bytes += m->files[f].bytes;
        char sections[128] = "";
        for (int k = 0; k < m->nsections; k++)
            snprintf(sections + strlen(sections), sizeof(sections) - strlen(sections), "%s%s",
                     k ? "," : "", m->sections[k]);
        const char *layout = m->layout == PSHARD_LAYOUT_FSDP1 ? "fsdp1" : "fsdp2";
        json_t *jfiles = NULL;
        if (list) {
            json_t *jsections = json_array();
            for (int k = 0; jsections && k < m->nsections; k++)
                json_array_append_new(jsections, ctl_jstr(m->sections[k]));
            jfiles = json_array();
            json_array_append_new(list, json_pack("{s:I,s:o,s:i,s:s,s:o,s:o,s:I,s:I,s:O}", "step",
                                                  (json_int_t)m->step, "dir", ctl_jstr(dir),
                                                  "world_size", m->world_size, "layout", layout,
                                                  "optimizer", ctl_jstr(m->optim.kind), "sections",
                                                  jsections, "params", (json_int_t)m->nparams,
                                                  "bytes", (json_int_t)bytes, "files", jfiles));
        } else {
            char size[32];
            human_bytes(bytes, size, sizeof(size));
            printf("%-10" PRId64 " %6d %-7s %-9s %-32s %7zu %11s  %s\n", m->step, m->world_size,
                   layout, m->optim.kind, sections, m->nparams, size, dir);
        }
        for (size_t f = 0; f < m->nfiles; f++) {
            const ps_ckpt_file_t *file = &m->files[f];
            char why[PSHARD_ERRLEN] = "";
            bool ok = true;
            if (c.verify) {
                ok = ps_ckpt_verify_file(dir, file, why, sizeof(why)) == PSHARD_OK;
                files++;
                corrupt += !ok;
            }
            if (jfiles) {
                json_t *jf =
                    json_pack("{s:i,s:o,s:I,s:I}", "rank", file->rank, "path", ctl_jstr(file->path),
                              "bytes", (json_int_t)file->bytes, "crc32c", (json_int_t)file->crc32c);
                if (jf && c.verify) {
                    json_object_set_new(jf, "status", json_string(ok ? "ok" : "corrupt"));
                    if (!ok)
                        json_object_set_new(jf, "error", ctl_jstr(why));
                }
                json_array_append_new(jfiles, jf);
            } else if (c.verify && ok) {
                printf("    ok       %s (%" PRIu64 " bytes, crc32c %08" PRIx32 ")\n", file->path,
                       file->bytes, file->crc32c);
            } else if (c.verify) {
                printf("    CORRUPT  %s: %s\n", file->path, why);
            }
        }
        json_decref(jfiles); /* the list holds its own reference */
        ps_ckpt_manifest_free(m);
    }
    json_t *ignored = list ? json_array() : NULL;
    int malformed = ckpt_report_ignored(c.checkpoint_dir, steps, n, ignored);
    if (list) {
        json_t *v = json_pack("{s:o,s:o,s:o}", "checkpoint_dir", ctl_jstr(c.checkpoint_dir),
                              "checkpoints", list, "ignored", ignored);
        list = NULL;
        if (v && c.verify) {
            json_object_set_new(v, "files_verified", json_integer((json_int_t)files));
            json_object_set_new(v, "corrupt", json_integer((json_int_t)corrupt));
        }
        if (ctl_json_print(v) != EXIT_OK)
            goto out;
    } else if (c.verify) {
        if (corrupt == 0)
            printf("\nverified %zu file%s: all ok\n", files, files == 1 ? "" : "s");
        else
            printf("\nverified %zu file%s: %zu CORRUPT\n", files, files == 1 ? "" : "s", corrupt);
        if (malformed)
            printf("%d step director%s with a malformed manifest\n", malformed,
                   malformed == 1 ? "y" : "ies");
    }
    rc = (corrupt > 0 || (c.verify && malformed > 0)) ? EXIT_NOT_SERVING : EXIT_OK;
out:
    json_decref(list);
    free(steps);
    ps_config_free(ckpt_list_options, PS_ARRAY_LEN(ckpt_list_options), &c);
    return rc;
}

static int cmd_checkpoint_export(int argc, char **argv)
{
    ckpt_cli_t c = {0};
    ps_config_result_t res;
    int rc = ckpt_parse("export", ckpt_export_options, PS_ARRAY_LEN(ckpt_export_options), argc,
                        argv, &c, &res,
                        "[--format safetensors] [--dtype fp32|bf16] [--step N] "
                        "[--checkpoint-dir DIR] OUT",
                        "Writes the master weights of a committed checkpoint (default: the "
                        "newest) as one\nsafetensors file OUT, after checking every shard "
                        "file's CRC-32C (offline).");
    int64_t *steps = NULL;
    size_t n = 0;
    ps_ckpt_manifest_t *m = NULL;
    char err[PSHARD_ERRLEN] = "", dir[4096];
    if (rc >= 0)
        goto out;
    rc = EXIT_ERROR;
    if (res.first_positional != argc - 1) {
        if (res.first_positional >= argc)
            ctl_fail("checkpoint export needs the OUT file (after the options)");
        else
            ctl_fail("checkpoint export takes one OUT file, after the options; '%s' is extra",
                     argv[res.first_positional + 1]);
        goto out;
    }
    const char *out_path = argv[res.first_positional];
    if (strcmp(c.format, "safetensors") != 0) {
        ctl_fail("checkpoint export: --format %s is not supported (safetensors is)", c.format);
        goto out;
    }
    pshard_dtype_t dtype;
    if (pshard_dtype_parse(c.dtype, &dtype) != 0 ||
        (dtype != PSHARD_FP32 && dtype != PSHARD_BF16)) {
        ctl_fail("checkpoint export: --dtype must be fp32 or bf16, not '%s'", c.dtype);
        goto out;
    }
    if (!c.checkpoint_dir || !*c.checkpoint_dir) {
        ctl_fail("checkpoint export needs --checkpoint-dir DIR (or PSHARD_CHECKPOINT_DIR)");
        goto out;
    }
    if (ps_ckpt_list(c.checkpoint_dir, &steps, &n, NULL, 0, err, sizeof(err)) != PSHARD_OK) {
        ctl_fail("checkpoint export: %s", err);
        goto out;
    }
    if (n == 0) {
        ctl_fail("checkpoint export: no committed checkpoints in %s", c.checkpoint_dir);
        goto out;
    }
    int64_t step = steps[n - 1];
    if (c.step >= 0) {
        bool found = false;
        for (size_t i = 0; i < n && !found; i++)
            found = steps[i] == c.step;
        if (!found) {
            ctl_fail("checkpoint export: no committed checkpoint of step %" PRId64
                     " in %s (the newest is step %" PRId64 ")",
                     c.step, c.checkpoint_dir, steps[n - 1]);
            goto out;
        }
        step = c.step;
    }
    ps_ckpt_step_dir(c.checkpoint_dir, step, dir, sizeof(dir));
    if (ps_ckpt_manifest_read(dir, &m, err, sizeof(err)) != PSHARD_OK) {
        ctl_fail("checkpoint export: %s", err);
        goto out;
    }
    for (size_t f = 0; f < m->nfiles; f++) {
        err[0] = '\0';
        if (ps_ckpt_verify_file(dir, &m->files[f], err, sizeof(err)) != PSHARD_OK) {
            ctl_fail("checkpoint export: refusing to export step %" PRId64 ": %s", step, err);
            rc = EXIT_NOT_SERVING;
            goto out;
        }
    }
    err[0] = '\0';
    if (ps_safetensors_export(dir, m, dtype, out_path, err, sizeof(err)) != PSHARD_OK) {
        ctl_fail("checkpoint export: %s", err);
        goto out;
    }
    struct stat st;
    uint64_t size = stat(out_path, &st) == 0 ? (uint64_t)st.st_size : 0;
    if (ctl_opts.json) {
        ctl_json_print(json_pack("{s:I,s:o,s:o,s:s,s:s,s:I,s:I}", "step", (json_int_t)step, "dir",
                                 ctl_jstr(dir), "out", ctl_jstr(out_path), "format", "safetensors",
                                 "dtype", pshard_dtype_name(dtype), "tensors",
                                 (json_int_t)m->nparams, "bytes", (json_int_t)size));
    } else {
        char human[32];
        human_bytes(size, human, sizeof(human));
        printf("exported step %" PRId64 " (%zu tensors, %s, %s) from %s to %s\n", step, m->nparams,
               pshard_dtype_name(dtype), human, dir, out_path);
    }
    rc = EXIT_OK;
out:
    ps_ckpt_manifest_free(m);
    free(steps);
    ps_config_free(ckpt_export_options, PS_ARRAY_LEN(ckpt_export_options), &c);
    return rc;
}

/* The shard servers watch the request counter; after their next optimizer step they save,
 * and rank 0 answers request R under CKPT_DONE_KEY/R with "step=S dir=D" or "error=MSG". */
#define CKPT_REQUEST_KEY "pshard/checkpoint/request"
#define CKPT_DONE_KEY "pshard/checkpoint/done"

static int cmd_checkpoint_save(int argc, char **argv)
{
    ckpt_cli_t c = {0};
    ps_config_result_t res;
    int rc = ckpt_parse("save", ckpt_save_options, PS_ARRAY_LEN(ckpt_save_options), argc, argv, &c,
                        &res, "[--timeout-ms T]",
                        "Asks the running shard servers (through the coordinator's store) to "
                        "save a checkpoint\nafter their next optimizer step, and waits for it.");
    Pshard__StoreWaitResponse *r = NULL;
    char err[PSHARD_ERRLEN] = "";
    if (rc >= 0)
        goto out;
    rc = EXIT_ERROR;
    if (res.first_positional < argc) {
        ctl_fail("checkpoint save: unexpected argument '%s'", argv[res.first_positional]);
        goto out;
    }
    int64_t request = 0;
    pshard_status_t st = ps_coord_store_incr(ctl_channel, CKPT_REQUEST_KEY, 1, &request,
                                             ctl_opts.timeout_ms, err, sizeof(err));
    if (st != PSHARD_OK) {
        ctl_fail("checkpoint save: StoreAdd: %s (%s)", err, pshard_status_name(st));
        goto out;
    }
    char key[96];
    snprintf(key, sizeof(key), "%s/%" PRId64, CKPT_DONE_KEY, request);
    const char *keys[] = {key};
    st = ps_coord_store_await(ctl_channel, keys, 1, c.timeout_ms, &r, err, sizeof(err));
    if (st == PSHARD_ERR_TIMEOUT) {
        fprintf(stderr,
                "pshardctl: checkpoint save: no answer to request %" PRId64 " within %" PRId64
                " ms; the shard servers save after their next optimizer step (is training "
                "running, with --checkpoint-dir?)\n",
                request, c.timeout_ms);
        rc = EXIT_NOT_SERVING;
        goto out;
    }
    if (st != PSHARD_OK) {
        ctl_fail("checkpoint save: StoreWait: %s (%s)", err, pshard_status_name(st));
        goto out;
    }
    if (r->n_values != 1) {
        ctl_fail("checkpoint save: the coordinator answered %zu values for one key", r->n_values);
        goto out;
    }
    char value[8192];
    size_t vlen = r->values[0].len < sizeof(value) - 1 ? r->values[0].len : sizeof(value) - 1;
    memcpy(value, r->values[0].data, vlen);
    value[vlen] = '\0';
    int64_t step = -1;
    const char *dir_at = strstr(value, " dir=");
    if (strncmp(value, "error=", 6) == 0) {
        if (ctl_opts.json)
            ctl_json_print(json_pack("{s:I,s:o}", "request", (json_int_t)request, "error",
                                     ctl_jstr(value + 6)));
        fprintf(stderr, "pshardctl: checkpoint save failed: %s\n", value + 6);
        rc = EXIT_NOT_SERVING;
        goto out;
    }
    char step_text[32] = "";
    if (strncmp(value, "step=", 5) == 0 && dir_at && dir_at - (value + 5) < (int)sizeof(step_text))
        snprintf(step_text, sizeof(step_text), "%.*s", (int)(dir_at - (value + 5)), value + 5);
    if (!dir_at || ps_parse_i64(step_text, 0, INT64_MAX, &step) != 0) {
        ctl_fail("checkpoint save: unexpected answer under %s: '%s'", key, value);
        goto out;
    }
    const char *dir = dir_at + 5;
    if (ctl_opts.json) {
        ctl_json_print(json_pack("{s:I,s:I,s:o}", "request", (json_int_t)request, "step",
                                 (json_int_t)step, "dir", ctl_jstr(dir)));
    } else {
        printf("checkpoint saved: step %" PRId64 " in %s\n", step, dir);
    }
    rc = EXIT_OK;
out:
    if (r)
        protobuf_c_message_free_unpacked(&r->base, NULL);
    ps_config_free(ckpt_save_options, PS_ARRAY_LEN(ckpt_save_options), &c);
    return rc;
}

int cmd_checkpoint(int argc, char **argv)
{
    if (argc < 1)
        return ctl_fail("checkpoint needs list, export or save (see --help)");
    if (strcmp(argv[0], "--help") == 0 || strcmp(argv[0], "-h") == 0) {
        fputs(strstr(ctl_usage_text, "  checkpoint list"), stdout);
        return EXIT_OK;
    }
    /* Listing reports unreadable manifests itself; the library's warnings would repeat them. */
    if (!getenv("PSHARD_LOG"))
        ps_log_set_level(PS_LOG_ERROR);
    if (strcmp(argv[0], "list") == 0)
        return cmd_checkpoint_list(argc, argv);
    if (strcmp(argv[0], "export") == 0)
        return cmd_checkpoint_export(argc, argv);
    if (strcmp(argv[0], "save") == 0)
        return cmd_checkpoint_save(argc, argv);
    return ctl_fail("checkpoint: unknown subcommand '%s' (list, export or save)", argv[0]);
}

const ps_option_t *ctl_checkpoint_options(const char *sub, size_t *n)
{
    *n = 0;
    if (!sub)
        return NULL;
    if (strcmp(sub, "list") == 0) {
        *n = PS_ARRAY_LEN(ckpt_list_options);
        return ckpt_list_options;
    }
    if (strcmp(sub, "export") == 0) {
        *n = PS_ARRAY_LEN(ckpt_export_options);
        return ckpt_export_options;
    }
    if (strcmp(sub, "save") == 0) {
        *n = PS_ARRAY_LEN(ckpt_save_options);
        return ckpt_save_options;
    }
    return NULL;
}
