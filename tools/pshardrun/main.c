/* pshardrun: the torchrun of pshard. It starts a coordinator (unless one is named), N shard
 * servers and N trainers on this host, forwards every child's output line by line with a
 * "[role rank]" prefix, forwards the signals of --signals-to-handle, and stops everything it
 * started when the trainers are done or the first of them fails. It takes torchrun's flags and
 * spellings (options.c), runs a bare training script with Python as torchrun does, and joins
 * nodes with --nnodes N or MIN:MAX. When a process fails, exactly one line on
 * stderr names the first to fail: "pshardrun: first failure: trainer 2 (pid 1234) exited with
 * status 1" (or "shard server 1 ... killed by signal 9", "coordinator ...").
 *
 * With --max-restarts, a trainer that fails while the coordinator and every shard server still
 * run is replaced alone (the servers hold the state, so nobody else restarts), and its line
 * says so instead: "pshardrun: trainer 2 exited with status 1; replacing it (restart 1 of 3);
 * ...". A shard server that is lost while the same holds is replaced alone with its trainer when
 * the model's servers say they can heal (a replica gives the new server its state): "pshardrun:
 * shard server of rank 1 killed by signal 9; replacing it and its trainer (restart 1 of 3): ...".
 * Any other failure stops everything and starts it again from the newest checkpoint.
 *
 * Exit status: 0 when every rank's last trainer exited 0; the failing trainer's exit status (or
 * 128+N when it was killed by signal N); 128+N when pshardrun itself got signal N; 1 when a
 * shard server or the coordinator died unexpectedly or could not be started; 2 for usage
 * errors. Trainers run with stdin from /dev/null. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "pshard/log.h"
#include "pshard/shm_names.h"
#include "pshard/util.h"

#include "run.h"

int main(int argc, char **argv)
{
    ps_log_init(RUN_PROG);
    run_opts_t o;
    memset(&o, 0, sizeof(o));
    ps_config_result_t res;
    char *coord_bin = NULL, *server_bin = NULL;
    run_t run;
    memset(&run, 0, sizeof(run));
    run.sigfd = -1;
    run.opts = &o;
    int exit_code = 0;

    int cmd = argc;
    bool dashdash = false;
    exit_code = run_parse_args(argc, argv, &o, &res, &cmd, &dashdash);
    if (exit_code >= 0)
        goto out;
    exit_code = run_check_opts(&run, &o, &res);
    if (exit_code == 0)
        exit_code = run_build_command(&run, argc, argv, cmd, dashdash);
    if (exit_code != 0)
        goto out;
    ps_config_log(run_options, run_noptions, &o, &res);

    /* A path given by flag that is not executable is a usage error (2); a binary the search
     * does not find is an installation problem (1). */
    server_bin = run_find_binary(o.server_bin, "server-bin", "shard_server", RUN_SERVER_BIN);
    if (!server_bin) {
        exit_code = o.server_bin ? 2 : 1;
        goto out;
    }
    run.server_bin = server_bin;
    /* A coordinator of its own unless one is named, or another node starts it. */
    bool own_coord = !o.coordinator && (!o.rdzv_endpoint || run.host);
    if (own_coord) {
        coord_bin =
            run_find_binary(o.coordinator_bin, "coordinator-bin", "coordinator", RUN_COORD_BIN);
        if (!coord_bin) {
            exit_code = o.coordinator_bin ? 2 : 1;
            goto out;
        }
    }

    size_t n = (size_t)o.nproc;
    run.nchildren = (own_coord ? 1 : 0) + 2 * n;
    run.children = calloc(run.nchildren, sizeof(*run.children));
    run.pfds = calloc(1 + 2 * run.nchildren, sizeof(*run.pfds));
    run.pfd_child = calloc(1 + 2 * run.nchildren, sizeof(*run.pfd_child));
    run.pfd_stream = calloc(1 + 2 * run.nchildren, sizeof(*run.pfd_stream));
    if (!run.children || !run.pfds || !run.pfd_child || !run.pfd_stream) {
        fprintf(stderr, RUN_PROG ": out of memory for %zu processes\n", run.nchildren);
        exit_code = 1;
        goto out;
    }
    size_t at = 0;
    if (own_coord) {
        run.coord = &run.children[at];
        run_child_init(&run.children[at++], ROLE_COORDINATOR, -1);
    }
    /* Labelled with their global ranks ("[trainer 5]" on node 1 of 4-process nodes). */
    int base = run.node_rank * (int)n;
    run.servers = &run.children[at];
    for (size_t r = 0; r < n; r++)
        run_child_init(&run.children[at++], ROLE_SERVER, base + (int)r);
    run.trainers = &run.children[at];
    for (size_t r = 0; r < n; r++)
        run_child_init(&run.children[at++], ROLE_TRAINER, base + (int)r);

    if (run_setup_signals(&run) != 0) {
        exit_code = 1;
        goto out;
    }
    const char *tmp = getenv("TMPDIR");
    if (ps_snprintf(run.tmpdir, sizeof(run.tmpdir), "%s/pshardrun-XXXXXX",
                    tmp && *tmp ? tmp : "/tmp") != 0 ||
        !mkdtemp(run.tmpdir)) {
        fprintf(stderr, RUN_PROG ": cannot create a temporary directory: %s\n", strerror(errno));
        run.tmpdir[0] = '\0';
        exit_code = 1;
        goto out;
    }

    if (run_make_log_dir(&run) != 0) {
        exit_code = 1;
        goto out;
    }
    run.resume = o.resume;
    for (;;) {
        if (run.coord)
            run_start_coordinator(&run, coord_bin);
        if (run.stop == STOP_NONE)
            run_start_servers(&run, server_bin);
        if (run.stop == STOP_NONE)
            run_learn_ranks(&run);
        if (run.stop == STOP_NONE)
            run_choose_torch_master(&run);
        if (run.stop == STOP_NONE)
            run_start_trainers(&run, run.cmd);
        run.supervising = true;
        while (run.stop == STOP_NONE) {
            run_replace_trainers(&run, run.cmd);
            if (run.stop != STOP_NONE)
                break;
            /* Done when each rank's latest trainer exited 0 (a failed one is being replaced
             * or has stopped the run). */
            bool all_done = true;
            for (size_t r = 0; r < n && all_done; r++) {
                const run_child_t *t = &run.trainers[r];
                all_done = t->reaped && !t->replace && WIFEXITED(t->wait_status) &&
                           WEXITSTATUS(t->wait_status) == 0;
            }
            if (all_done) {
                run_set_stop(&run, STOP_DONE, 0);
                break;
            }
            run_pump(&run, ps_now_ns() + 1000 * 1000000LL);
            run_judge_servers(&run);
            run_judge_trainers(&run);
        }
        run.supervising = false;

        /* Stop in dependency order: trainers first (with the signal pshardrun got, if any),
         * then the servers (which leave the cluster), then the coordinator. */
        run_stop_role(&run, ROLE_TRAINER, NULL,
                      run.stop == STOP_SIGNAL ? run.stop_signal : SIGTERM);
        run_stop_role(&run, ROLE_SERVER, NULL, SIGTERM);
        run_stop_role(&run, ROLE_COORDINATOR, NULL, SIGTERM);
        run_sweep(&run);
        run_drain(&run);
        /* What the killed ones left in /dev/shm (a trainer stopped inside an Attach or a
         * DefineModel, a server killed): their PIDs are gone now. */
        ps_shm_sweep(PS_SHM_TRAINER, "trainer");
        ps_shm_sweep(PS_SHM_SERVER, "shard server");
        bool failed = run.stop == STOP_TRAINER_FAILED || run.stop == STOP_SERVICE_DIED;
        if (!failed || run.attempt >= o.max_restarts)
            break;
        if (run.nnodes > 1) {
            /* The other nodes' servers would have to restart from the same checkpoint too. */
            fprintf(stderr, RUN_PROG ": not restarting: across nodes only a failed trainer is "
                                     "replaced; a full restart is not coordinated across nodes "
                                     "yet\n");
            break;
        }
        run_restart(&run);
    }
    exit_code = run.exit_code;
    if (run.stop == STOP_DONE) {
        for (size_t i = 0; i < run.nchildren; i++) {
            const run_child_t *c = &run.children[i];
            if (c->role != ROLE_TRAINER && c->reaped &&
                !(WIFEXITED(c->wait_status) && WEXITSTATUS(c->wait_status) == 0)) {
                char what[96];
                run_describe_status(c->wait_status, true, what, sizeof(what));
                PS_WARN(PS_SUB_MAIN, "%s (pid %d) %s while stopping", c->label, (int)c->pid, what);
            }
        }
    }

out:
    if (run.sigfd >= 0)
        close(run.sigfd);
    run_remove_tmpdir(run.tmpdir);
    free(run.cmd);
    free(run.children);
    free(run.pfds);
    free(run.pfd_child);
    free(run.pfd_stream);
    free(coord_bin);
    free(server_bin);
    ps_config_free(run_options, run_noptions, &o);
    return exit_code;
}
