/* pshardrun's restart policy: a trainer that fails while the coordinator and every shard
 * server still run is replaced alone (the servers keep its state); any other failure stops
 * everything, and with restarts left everything starts again from the newest checkpoint. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "pshard/util.h"

#include "run.h"

/* True when a failed trainer can be replaced alone: replacement is on, a restart is left, and
 * every service pshardrun started still runs (their state is what the replacement needs). */
static bool run_can_replace(const run_t *run)
{
    const run_opts_t *o = run->opts;
    if (o->max_restarts == 0 || o->replace_timeout_ms == 0 || run->attempt >= o->max_restarts)
        return false;
    if (run->coord && run->coord->reaped)
        return false;
    for (int r = 0; r < (int)o->nproc; r++) {
        if (run->servers[r].reaped)
            return false;
    }
    return true;
}

/* Decides for each trainer that failed since the last call: replace it alone (one restart
 * used, one line saying so; run_replace_trainers starts the replacement), or, when that is not
 * possible, stop the run as the first failure. Does nothing but forget them when the run is
 * already stopping, e.g. because a server ended in the same round of reaping. */
void run_judge_trainers(run_t *run)
{
    for (int r = 0; r < (int)run->opts->nproc; r++) {
        run_child_t *c = &run->trainers[r];
        if (!c->unjudged)
            continue;
        c->unjudged = false;
        if (run->stop != STOP_NONE)
            continue;
        run_child_read_now(c);
        char failure[96];
        run_describe_status(c->wait_status, false, failure, sizeof(failure));
        if (run_can_replace(run)) {
            c->replace = true;
            c->replace_restarts = ++run->attempt;
            fprintf(stderr,
                    RUN_PROG ": %s %s; replacing it (restart %lld of %lld); the other ranks "
                             "and the shard servers keep running\n",
                    c->label, failure, (long long)run->attempt, (long long)run->opts->max_restarts);
            /* Its server aborts the step and awaits the replacement now, not after the lease. */
            char why[160], name[32];
            ps_snprintf(why, sizeof(why), "pshardrun saw its process end: %s", failure);
            ps_snprintf(name, sizeof(name), "trainer-%d", run->rank_base + r);
            run_declare_lost(run, name, why);
            continue;
        }
        int status = c->wait_status;
        run_report_first_failure(c, failure);
        run_set_stop(run, STOP_TRAINER_FAILED,
                     WIFEXITED(status)     ? WEXITSTATUS(status)
                     : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                           : 1);
    }
}

/* Starts a new trainer for each rank whose trainer failed and was judged replaceable
 * (run_judge_trainers), with the same command and environment but the restart count; the
 * other trainers, the servers and the coordinator are not touched. What is left of the failed
 * trainer's process group is stopped first and its pipes are drained and closed, so the new
 * one starts clean. Stops when the run is stopping (a replacement then no longer matters). */
void run_replace_trainers(run_t *run, char *const argv[])
{
    for (int r = 0; r < (int)run->opts->nproc && run->stop == STOP_NONE; r++) {
        run_child_t *c = &run->trainers[r];
        if (!c->replace)
            continue;
        run_stop_role(run, ROLE_TRAINER, c, SIGTERM);
        if (run->stop != STOP_NONE)
            return;
        run_child_read_now(c);
        for (int k = 0; k < 2; k++) {
            run_stream_close(c, &c->streams[k]);
            free(c->streams[k].buf);
        }
        int64_t restarts = c->replace_restarts;
        run_child_init(c, ROLE_TRAINER, c->rank);
        run_start_trainer(run, r, argv, restarts);
    }
}

/* After a failure, with restarts left: every process is gone; clears what the last attempt
 * left (children, port files, the stop reason) so the next one starts like the first, from the
 * newest checkpoint when there is a checkpoint root. */
void run_restart(run_t *run)
{
    run->attempt++;
    const char *root = run->opts->resume ? run->opts->resume : run->opts->checkpoint_dir;
    run->resume = root;
    char from[PATH_MAX + 64];
    if (root)
        ps_snprintf(from, sizeof(from), "resuming from the newest checkpoint in %s", root);
    else
        ps_snprintf(from, sizeof(from), "from step 0 (no --checkpoint-dir to resume from)");
    fprintf(stderr, RUN_PROG ": restart %lld of %lld: starting %s again, %s\n",
            (long long)run->attempt, (long long)run->opts->max_restarts,
            run->coord ? "the coordinator, shard servers and trainers"
                       : "the shard servers and trainers",
            from);
    for (size_t i = 0; i < run->nchildren; i++) {
        run_child_t *c = &run->children[i];
        if (c->port_file[0])
            unlink(c->port_file);
        run_child_init(c, c->role, c->rank);
    }
    run->stop = STOP_NONE;
    run->stop_signal = 0;
    run->exit_code = 0;
}
