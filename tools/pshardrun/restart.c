/* pshardrun's restart policy: a trainer that fails while the coordinator and every shard
 * server still run is replaced alone (the servers keep its state); a lost shard server of a
 * model that can heal is replaced alone with its trainer (a replica gives the new server its
 * state); any other failure stops everything, and with restarts left everything starts again
 * from the newest checkpoint. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/shm_names.h"
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

/* Forwards what is left of a child's output, closes its pipes and makes its entry new (same
 * role and rank), so a replacement starts clean in the same slot. The process and its group
 * must be gone. */
static void run_child_renew(run_child_t *c)
{
    run_child_read_now(c);
    for (int k = 0; k < 2; k++) {
        run_stream_close(c, &c->streams[k]);
        free(c->streams[k].buf);
    }
    run_child_init(c, c->role, c->rank);
}

/* True when the lost server of local rank r can be healed: run_may_heal still holds after the
 * round of reaping, no other server is lost too (a replica may be among them), the rank's
 * trainer has not finished (a new one would train again), and the model's servers said they
 * can heal (the store key; a model without replicas never sets it). */
static bool run_can_heal(run_t *run, int r)
{
    if (!run_may_heal(run, &run->servers[r]))
        return false;
    for (int i = 0; i < (int)run->opts->nproc; i++) {
        if (i != r && run->servers[i].reaped)
            return false;
    }
    const run_child_t *t = &run->trainers[r];
    if (t->reaped && WIFEXITED(t->wait_status) && WEXITSTATUS(t->wait_status) == 0)
        return false;
    char *value = NULL;
    int got = run_store_get(run, RUN_HEAL_CAPABLE_KEY, &value);
    free(value);
    if (got == 0)
        PS_INFO(PS_SUB_MAIN, "no %s in the job's store: the model's servers cannot heal",
                RUN_HEAL_CAPABLE_KEY);
    return got == 1;
}

/* Replaces the lost server of local rank r and its trainer (restart restarts): declares the
 * server lost, so its rank is vacant at once, starts a new server with the same name (which
 * takes the rank back and gets the state from a replica) and waits for its port, then stops
 * the old trainer, which was attached to the lost server, and starts a new one against the new
 * server. Returns early when the run starts stopping (e.g. the new server did not come up). */
static void run_heal_server(run_t *run, int r, int64_t restarts, const char *failure)
{
    run_child_t *s = &run->servers[r], *t = &run->trainers[r];
    char why[160];
    ps_snprintf(why, sizeof(why), "pshardrun saw its process end: %s", failure);
    run_declare_lost(run, s->name, why);
    /* Whatever its process group left behind must not outlive it. */
    run_stop_role(run, ROLE_SERVER, s, SIGTERM);
    if (run->stop != STOP_NONE)
        return;
    run_child_renew(s);
    run_start_server(run, r, run->server_bin);
    if (run->stop == STOP_NONE)
        run_wait_ports(run, s, 1);
    if (run->stop != STOP_NONE)
        return;
    /* Its end is expected: run_on_exit does not take it for a failure. */
    run_stop_role(run, ROLE_TRAINER, t, SIGTERM);
    if (run->stop != STOP_NONE)
        return;
    run_child_renew(t);
    /* A trainer killed after the grace period left its lease behind, which would make the new
     * one wait for it to lapse before it may register. */
    char name[32];
    ps_snprintf(name, sizeof(name), "trainer-%d", t->rank);
    run_declare_lost(run, name, "pshardrun stopped it: its shard server was lost and replaced");
    /* The dead server's model state and the old trainer's regions, now rather than at the end. */
    ps_shm_sweep(PS_SHM_TRAINER, "trainer");
    ps_shm_sweep(PS_SHM_SERVER, "shard server");
    run_start_trainer(run, r, run->cmd, restarts);
}

/* Decides for each shard server that ended on its own since the last call (run_on_exit left
 * it to this when run_may_heal held): heal it with its trainer (one restart used, one line
 * saying so), or, when that is not possible, stop the run naming it as the first failure, as
 * a lost server always did. Called after each round of reaping and before run_judge_trainers,
 * so that a trainer that failed with its server is not judged against a server being healed.
 * Does nothing but forget them when the run is already stopping. */
void run_judge_servers(run_t *run)
{
    for (int r = 0; r < (int)run->opts->nproc; r++) {
        run_child_t *c = &run->servers[r];
        if (!c->unjudged)
            continue;
        c->unjudged = false;
        if (run->stop != STOP_NONE)
            continue;
        run_child_read_now(c);
        char failure[96];
        run_describe_status(c->wait_status, false, failure, sizeof(failure));
        if (run_can_heal(run, r)) {
            int64_t restarts = ++run->attempt;
            fprintf(stderr,
                    RUN_PROG ": shard server of rank %d %s; replacing it and its trainer (restart "
                             "%lld of %lld): a replica heals its state, the other ranks keep "
                             "running\n",
                    c->rank, failure, (long long)restarts, (long long)run->opts->max_restarts);
            run_heal_server(run, r, restarts, failure);
            continue;
        }
        run_report_first_failure(c, failure);
        run_set_stop(run, STOP_SERVICE_DIED, 1);
    }
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
        int64_t restarts = c->replace_restarts;
        run_child_renew(c);
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
