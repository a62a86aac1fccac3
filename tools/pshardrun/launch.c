/* Starting the workers of a run: finding pshard-server (and pshard-coordinator), the shard
 * servers with their flags, and the trainers with torchrun's environment plus pshard's own. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/util.h"

#include "run.h"

/* True when path names an executable regular file. */
static bool run_is_executable(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

/* Finds a pshard binary: the flag's path, then the build tree layout beside pshardrun
 * (<exe dir>/../<subdir>/<name>), then the installed layout (<exe dir>/<name>), then PATH.
 * Returns a malloc'd path (caller frees), or NULL after printing what was tried. */
char *run_find_binary(const char *flag_value, const char *flag, const char *subdir,
                      const char *name)
{
    if (flag_value) {
        if (run_is_executable(flag_value))
            return strdup(flag_value);
        fprintf(stderr, RUN_PROG ": --%s %s: not an executable file\n", flag, flag_value);
        return NULL;
    }
    char exe[PATH_MAX], cand[PATH_MAX + 64], dir[PATH_MAX] = "";
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = '\0';
            ps_strlcpy(dir, exe, sizeof(dir));
        }
    }
    if (dir[0]) {
        if (ps_snprintf(cand, sizeof(cand), "%s/../%s/%s", dir, subdir, name) == 0 &&
            run_is_executable(cand))
            return realpath(cand, NULL);
        if (ps_snprintf(cand, sizeof(cand), "%s/%s", dir, name) == 0 && run_is_executable(cand))
            return strdup(cand);
    }
    const char *p = getenv("PATH");
    while (p && *p) {
        size_t len = strcspn(p, ":");
        if (len > 0 && ps_snprintf(cand, sizeof(cand), "%.*s/%s", (int)len, p, name) == 0 &&
            run_is_executable(cand))
            return strdup(cand);
        p += len;
        if (*p == ':')
            p++;
    }
    fprintf(stderr,
            RUN_PROG ": cannot find %s: not at %s/../%s/%s, not at %s/%s, not on PATH; "
                     "pass --%s\n",
            name, dir[0] ? dir : "?", subdir, name, dir[0] ? dir : "?", name, flag);
    return NULL;
}

/* Starts the shard server of local rank r with its flags; does not wait for its port. Its port
 * file is new to each restart, so a healed rank's server (run_judge_servers) is never taken
 * for up by the port file its lost predecessor wrote; its name is the same at every start,
 * which is how the coordinator gives a healed server its rank back. Stops the run
 * (STOP_STARTUP) when it cannot be started. */
void run_start_server(run_t *run, int r, const char *bin)
{
    run_child_t *c = &run->servers[r];
    ps_snprintf(c->port_file, sizeof(c->port_file), "%s/server-%d.%lld.port", run->tmpdir, r,
                (long long)run->attempt);
    char *name = c->name, device[24], every[24], keep[24], replace_ms[24];
    /* The coordinator ranks servers by name (natural order): across nodes the names sort
     * by node rank, then local rank, so server K * NPROC + r is this node's r-th (of the
     * nodes that joined, with an elastic --nnodes). */
    if (run->nnodes > 1)
        ps_snprintf(c->name, sizeof(c->name), "pshardrun-node%d-%d", run->node_rank, r);
    else
        ps_snprintf(c->name, sizeof(c->name), "pshardrun-%d-%d", (int)getpid(), r);
    ps_snprintf(device, sizeof(device), "%d", r);
    ps_snprintf(every, sizeof(every), "%lld", (long long)run->opts->checkpoint_every);
    ps_snprintf(keep, sizeof(keep), "%lld", (long long)run->opts->checkpoint_keep);
    char *argv[48];
    int a = 0;
    argv[a++] = (char *)bin;
    argv[a++] = "--coordinator";
    argv[a++] = run->coord_addr;
    argv[a++] = "--listen";
    argv[a++] = "127.0.0.1:0";
    argv[a++] = "--port-file";
    argv[a++] = c->port_file;
    argv[a++] = "--name";
    argv[a++] = name;
    if (run->job[0]) {
        argv[a++] = "--job";
        argv[a++] = run->job;
    }
    if (run->data_host[0]) {
        argv[a++] = "--data-host";
        argv[a++] = run->data_host;
    }
    argv[a++] = "--backend";
    argv[a++] = run->opts->backend;
    argv[a++] = "--offload";
    argv[a++] = run->opts->offload;
    argv[a++] = "--shard-memory";
    argv[a++] = run->opts->shard_memory;
    argv[a++] = "--log";
    argv[a++] = run->opts->log;
    if (strcmp(run->opts->backend, "nccl") == 0) {
        argv[a++] = "--device"; /* one GPU per server, like LOCAL_RANK for trainers */
        argv[a++] = device;
    } else if (strcmp(run->opts->shard_memory, "gpu") == 0) {
        /* GPU shards on tcp are for servers sharing one GPU (NCCL allows one rank per GPU) */
        argv[a++] = "--device";
        argv[a++] = "0";
    }
    if (run->opts->token_file) {
        argv[a++] = "--token-file";
        argv[a++] = run->opts->token_file;
    }
    if (run->opts->checkpoint_dir) {
        argv[a++] = "--checkpoint-dir";
        argv[a++] = run->opts->checkpoint_dir;
    }
    if (run->resume) {
        argv[a++] = "--resume";
        argv[a++] = (char *)run->resume;
        if (run->opts->resume_allow_fresh)
            argv[a++] = "--resume-allow-fresh";
    }
    argv[a++] = "--checkpoint-every";
    argv[a++] = every;
    argv[a++] = "--checkpoint-keep";
    argv[a++] = keep;
    if (run->opts->max_restarts > 0 && run->opts->replace_timeout_ms > 0) {
        /* Only where a trainer may be replaced: a lost trainer's state is kept for its
         * replacement instead of being given up. */
        ps_snprintf(replace_ms, sizeof(replace_ms), "%lld",
                    (long long)run->opts->replace_timeout_ms);
        argv[a++] = "--trainer-replace-ms";
        argv[a++] = replace_ms;
    }
    argv[a] = NULL;
    if (run_spawn(run, c, bin, argv, NULL, 0) != 0)
        run_set_stop(run, STOP_STARTUP, 1);
}

/* Starts every shard server and waits for all their ports. */
void run_start_servers(run_t *run, const char *bin)
{
    for (int r = 0; r < (int)run->opts->nproc && run->stop == STOP_NONE; r++)
        run_start_server(run, r, bin);
    if (run->stop == STOP_NONE)
        run_wait_ports(run, run->servers, (size_t)run->opts->nproc);
}

/* Starts rank r's trainer with the torchrun environment plus pshard's own variables, which
 * tell it the restarts so far. Stops the run (STOP_STARTUP) when it cannot be started. */
void run_start_trainer(run_t *run, int r, char *const argv[], int64_t restarts)
{
    int n = (int)run->opts->nproc;
    char rank[16], local_rank[16], world[16], local_world[16], group_rank[16], group_world[16],
        mport[16], server[64], attempt[24], max_restarts[24];
    ps_snprintf(attempt, sizeof(attempt), "%lld", (long long)restarts);
    ps_snprintf(max_restarts, sizeof(max_restarts), "%lld", (long long)run->opts->max_restarts);
    ps_snprintf(rank, sizeof(rank), "%d", run->rank_base + r);
    ps_snprintf(local_rank, sizeof(local_rank), "%d", r);
    ps_snprintf(world, sizeof(world), "%d", run->world);
    ps_snprintf(local_world, sizeof(local_world), "%d", n);
    /* Nodes in the order of their ranks among those that joined (torchrun's group rank). */
    ps_snprintf(group_rank, sizeof(group_rank), "%d", run->rank_base / n);
    ps_snprintf(group_world, sizeof(group_world), "%d", run->world / n);
    ps_snprintf(mport, sizeof(mport), "%d", run->torch_port);
    ps_snprintf(server, sizeof(server), "127.0.0.1:%d", run->servers[r].port);
    const run_env_t env[] = {
        {"RANK", rank},
        {"LOCAL_RANK", local_rank},
        {"WORLD_SIZE", world},
        {"LOCAL_WORLD_SIZE", local_world},
        {"GROUP_RANK", group_rank},
        {"GROUP_WORLD_SIZE", group_world},
        {"ROLE_NAME", run->opts->role},
        {"ROLE_RANK", rank},
        {"ROLE_WORLD_SIZE", world},
        {"MASTER_ADDR", run->torch_addr},
        {"MASTER_PORT", mport},
        {"PSHARD_COORDINATOR", run->coord_addr},
        {"PSHARD_SERVER", server},
        {"PSHARD_LOG", run->opts->log},
        {"PSHARD_JOB", run->job},
        {"TORCHELASTIC_RUN_ID", run->job[0] ? run->job : "none"},
        {"PSHARD_RESTART_COUNT", attempt},
        {"TORCHELASTIC_RESTART_COUNT", attempt},
        {"TORCHELASTIC_MAX_RESTARTS", max_restarts},
        {"PSHARD_TOKEN_FILE", run->opts->token_file}, /* last: dropped when NULL */
    };
    size_t nenv = PS_ARRAY_LEN(env) - (run->opts->token_file ? 0 : 1);
    run_child_t *c = &run->trainers[r];
    if (run->opts->log_line_prefix_template && *run->opts->log_line_prefix_template) {
        /* Checked to fit at the widest ranks (run_check_opts). */
        char host[256] = "", bad[64];
        gethostname(host, sizeof(host) - 1);
        run_format_prefix(run->opts->log_line_prefix_template, run->opts->role, host, r, c->rank,
                          c->prefix, sizeof(c->prefix), bad, sizeof(bad));
    } else if (strcmp(run->opts->role, "default") != 0) {
        ps_snprintf(c->prefix, sizeof(c->prefix), "[%s %d] ", run->opts->role, c->rank);
    }
    if (run_open_trainer_logs(run, c, r, restarts) != 0 ||
        run_spawn(run, c, argv[0], argv, env, nenv) != 0)
        run_set_stop(run, STOP_STARTUP, 1);
}

/* Starts every trainer of an attempt. */
void run_start_trainers(run_t *run, char *const argv[])
{
    for (int r = 0; r < (int)run->opts->nproc && run->stop == STOP_NONE; r++)
        run_start_trainer(run, r, argv, run->attempt);
}
