/* pshardrun's process table and its supervision: starting a child in its own process group with
 * its output on pipes, reaping (as the subreaper of every descendant), the one first-failure
 * line, signals to pshardrun through a signalfd, and stopping a role's children with a grace
 * period before SIGKILL. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "pshard/log.h"
#include "pshard/util.h"

#include "run.h"

static const char *const role_names[] = {"coordinator", "server", "trainer"};
/* How the first-failure line names each role. */
static const char *const role_long_names[] = {"coordinator", "shard server", "trainer"};

void run_child_init(run_child_t *c, run_role_t role, int rank)
{
    memset(c, 0, sizeof(*c));
    c->role = role;
    run_child_relabel(c, rank);
    for (int k = 0; k < 2; k++) {
        c->streams[k].fd = -1;
        c->streams[k].out_fd = k + 1;
        c->streams[k].console = true;
        c->streams[k].file_fd = -1;
    }
}

void run_child_relabel(run_child_t *c, int rank)
{
    run_role_t role = c->role;
    c->rank = rank;
    if (role == ROLE_COORDINATOR) {
        ps_snprintf(c->label, sizeof(c->label), "%s", role_names[role]);
        ps_snprintf(c->who, sizeof(c->who), "%s", role_long_names[role]);
        ps_snprintf(c->prefix, sizeof(c->prefix), "[%s] ", role_names[role]);
    } else {
        ps_snprintf(c->label, sizeof(c->label), "%s %d", role_names[role], rank);
        ps_snprintf(c->who, sizeof(c->who), "%s %d", role_long_names[role], rank);
        ps_snprintf(c->prefix, sizeof(c->prefix), "[%s %d] ", role_names[role], rank);
    }
}

/* True while the child or anything left in its process group may still be running. */
static bool run_child_alive(const run_child_t *c)
{
    if (c->pid <= 0)
        return false;
    if (!c->reaped)
        return true;
    return kill(-c->pid, 0) == 0;
}

/* Sends sig to the child's process group (which catches the shell's children too), or to the
 * child itself if it moved out of its group. */
static void run_child_signal(run_child_t *c, int sig)
{
    if (c->pid <= 0)
        return;
    c->signalled = true;
    if (kill(-c->pid, sig) != 0 && !c->reaped)
        kill(c->pid, sig);
}

/* Names the signals pshardrun sends or handles; others by number. The result is either a
 * literal or buf. */
const char *run_signame(int sig, char *buf, size_t len)
{
    switch (sig) {
    case SIGINT:
        return "SIGINT";
    case SIGTERM:
        return "SIGTERM";
    case SIGHUP:
        return "SIGHUP";
    case SIGQUIT:
        return "SIGQUIT";
    case SIGUSR1:
        return "SIGUSR1";
    case SIGUSR2:
        return "SIGUSR2";
    case SIGKILL:
        return "SIGKILL";
    default:
        ps_snprintf(buf, len, "signal %d", sig);
        return buf;
    }
}

/* Describes a wait status: "exited with status 3" or "killed by signal 9", with the signal's
 * description ("killed by signal 9 (Killed)") when signal_text is true. The first-failure
 * line leaves it out so that its form stays fixed for scripts. */
void run_describe_status(int status, bool signal_text, char *buf, size_t len)
{
    if (WIFEXITED(status))
        ps_snprintf(buf, len, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status) && signal_text)
        ps_snprintf(buf, len, "killed by signal %d (%s)", WTERMSIG(status),
                    strsignal(WTERMSIG(status)));
    else if (WIFSIGNALED(status))
        ps_snprintf(buf, len, "killed by signal %d", WTERMSIG(status));
    else
        ps_snprintf(buf, len, "ended with wait status 0x%x", (unsigned)status);
}

/* Prints the one line that names the first process to fail. Called only where the stop
 * reason is first set, so it prints at most once per run. */
void run_report_first_failure(const run_child_t *c, const char *what)
{
    fprintf(stderr, RUN_PROG ": first failure: %s (pid %d) %s\n", c->who, (int)c->pid, what);
}

/* Records the first reason to stop; later reasons are ignored. */
void run_set_stop(run_t *run, run_stop_t why, int exit_code)
{
    if (run->stop != STOP_NONE)
        return;
    run->stop = why;
    run->exit_code = exit_code;
}

/* What can be told of a lost shard server's chances of being healed while it is reaped
 * (run_on_exit calls this, so anything it needs must not wait): the attempt's trainers run,
 * the server had come up (one lost before its port appeared failed to start), a restart is
 * left, trainer replacement is on (the other servers keep a lost rank's place only then),
 * and the coordinator pshardrun started, if any, still runs (it hands the rank back). When
 * false, the server's end stops the run at once as it always did. */
bool run_may_heal(const run_t *run, const run_child_t *server)
{
    const run_opts_t *o = run->opts;
    return run->supervising && server->port != 0 && o->replace_timeout_ms > 0 &&
           run->attempt < o->max_restarts && !(run->coord && run->coord->reaped);
}

/* Takes note of one reaped child: a service that died on its own is the first failure unless
 * something else already is, or, for a shard server that might be healed (run_may_heal), is
 * judged once every child that ended by now is reaped (run_judge_servers); a failed trainer
 * likewise (run_judge_trainers), so that a server lost at the same time is seen first. A
 * trainer pshardrun stopped while the run goes on (its server is being healed) did not fail. */
static void run_on_exit(run_t *run, run_child_t *c, int status)
{
    c->reaped = true;
    c->wait_status = status;
    char what[96];
    run_describe_status(status, true, what, sizeof(what));
    PS_INFO(PS_SUB_MAIN, "%s (pid %d) %s", c->label, (int)c->pid, what);
    if (run->stop != STOP_NONE)
        return;
    if (c->role == ROLE_TRAINER) {
        c->unjudged = !c->signalled && !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        return;
    }
    if (!c->signalled) {
        if (c->role == ROLE_SERVER && run_may_heal(run, c)) {
            c->unjudged = true;
            return;
        }
        run_child_read_now(c);
        char failure[96];
        run_describe_status(status, false, failure, sizeof(failure));
        run_report_first_failure(c, failure);
        run_set_stop(run, STOP_SERVICE_DIED, 1);
    }
}

/* Reaps every child that has ended, ours or orphans handed to us as subreaper. Failed
 * trainers are left marked for the restart policy (run_judge_trainers), which the run's loop
 * calls after each round, once every child that ended by then is reaped. */
void run_reap(run_t *run)
{
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) {
            if (pid < 0 && errno == EINTR)
                continue;
            break;
        }
        run_child_t *c = NULL;
        for (size_t i = 0; i < run->nchildren; i++) {
            if (run->children[i].pid == pid && !run->children[i].reaped) {
                c = &run->children[i];
                break;
            }
        }
        if (c)
            run_on_exit(run, c, status);
        else
            PS_DEBUG(PS_SUB_MAIN, "reaped orphaned descendant pid %d", (int)pid);
    }
}

/* What a signal to pshardrun does: the first one stops the run (forwarding it to the
 * trainers); the next one while stopping skips the grace periods. */
static void run_on_signal(run_t *run, int sig)
{
    char name[32];
    if (run->stop == STOP_NONE) {
        fprintf(stderr, RUN_PROG ": got %s; stopping trainers, servers and coordinator\n",
                run_signame(sig, name, sizeof(name)));
        run->stop_signal = sig;
        run_set_stop(run, STOP_SIGNAL, 128 + sig);
        return;
    }
    if (!run->force_kill) {
        fprintf(stderr, RUN_PROG ": got %s while stopping; killing everything now\n",
                run_signame(sig, name, sizeof(name)));
        run->force_kill = true;
    }
}

/* Waits up to deadline_ns (monotonic) for output, signals or exits, and handles what came.
 * Returns early after any event. */
void run_pump(run_t *run, int64_t deadline_ns)
{
    nfds_t n = 0;
    run->pfds[n++] = (struct pollfd){.fd = run->sigfd, .events = POLLIN};
    for (size_t i = 0; i < run->nchildren; i++) {
        for (int k = 0; k < 2; k++) {
            run_stream_t *s = &run->children[i].streams[k];
            if (s->fd < 0)
                continue;
            run->pfd_child[n] = &run->children[i];
            run->pfd_stream[n] = s;
            run->pfds[n++] = (struct pollfd){.fd = s->fd, .events = POLLIN};
        }
    }
    int64_t wait_ms = (deadline_ns - ps_now_ns()) / 1000000;
    if (wait_ms < 0)
        wait_ms = 0;
    /* Reaping does not depend on SIGCHLD alone: at least every --monitor-interval. */
    if (wait_ms > run->monitor_ms)
        wait_ms = run->monitor_ms;
    int rc = poll(run->pfds, n, (int)wait_ms);
    if (rc > 0) {
        if (run->pfds[0].revents) {
            struct signalfd_siginfo si;
            while (read(run->sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
                if (si.ssi_signo != SIGCHLD)
                    run_on_signal(run, (int)si.ssi_signo);
            }
        }
        for (nfds_t j = 1; j < n; j++) {
            if (run->pfds[j].revents && run->pfd_stream[j]->fd >= 0)
                run_stream_read(run->pfd_child[j], run->pfd_stream[j]);
        }
    }
    run_reap(run);
}

/* Starts one child with its stdout and stderr on new pipes, in its own process group, with
 * stdin from /dev/null. `path` is executed as is (execv) for services and looked up on PATH
 * (execvp) for trainers. `env` (nenv entries, may be NULL) is set in the child only.
 * A child that cannot exec prints why on its stderr and exits 127, which the normal exit
 * handling reports. Returns 0, or -1 with a message printed when fork or pipe fail. */
int run_spawn(run_t *run, run_child_t *c, const char *path, char *const argv[],
              const run_env_t *env, size_t nenv)
{
    int fds[2][2] = {{-1, -1}, {-1, -1}};
    for (int k = 0; k < 2; k++) {
        if (pipe2(fds[k], O_CLOEXEC) != 0) {
            fprintf(stderr, RUN_PROG ": cannot create a pipe for %s: %s\n", c->label,
                    strerror(errno));
            goto fail;
        }
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, RUN_PROG ": cannot fork %s: %s\n", c->label, strerror(errno));
        goto fail;
    }
    if (pid == 0) {
        /* Child. pshardrun is single-threaded, so the libc calls below are safe after fork. */
        setpgid(0, 0);
        /* If pshardrun is killed outright, the child is told to stop too. */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)
            _exit(1);
        sigaction(SIGPIPE, &run->orig_sigpipe, NULL);
        sigprocmask(SIG_SETMASK, &run->orig_mask, NULL);
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0 && devnull != 0) {
            dup2(devnull, 0);
            close(devnull);
        }
        if (dup2(fds[0][1], 1) < 0 || dup2(fds[1][1], 2) < 0)
            _exit(127);
        for (size_t i = 0; i < nenv; i++)
            setenv(env[i].name, env[i].value, 1);
        if (c->role == ROLE_TRAINER)
            execvp(path, argv);
        else
            execv(path, argv);
        dprintf(2, RUN_PROG ": cannot execute '%s': %s\n", path, strerror(errno));
        _exit(127);
    }
    /* Parent: make the group now too, so a signal sent before the child runs finds it. */
    setpgid(pid, pid);
    c->pid = pid;
    for (int k = 0; k < 2; k++) {
        close(fds[k][1]);
        c->streams[k].fd = fds[k][0];
        fcntl(fds[k][0], F_SETFL, fcntl(fds[k][0], F_GETFL) | O_NONBLOCK);
    }
    PS_INFO(PS_SUB_MAIN, "started %s (pid %d): %s", c->label, (int)pid, path);
    return 0;
fail:
    for (int k = 0; k < 2; k++) {
        for (int e = 0; e < 2; e++) {
            if (fds[k][e] >= 0)
                close(fds[k][e]);
        }
    }
    return -1;
}

/* Reads a port file if it is there (it is written with a rename, so whole or absent).
 * Returns the port, or 0 when it is not there yet or does not hold a port. */
static int run_read_port_file(const char *path)
{
    char buf[32];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    buf[strcspn(buf, "\r\n ")] = '\0';
    int64_t port;
    if (ps_parse_i64(buf, 1, 65535, &port) != 0)
        return 0;
    return (int)port;
}

/* Waits until every child in [first, first+count) has written its port file, the run is
 * stopping, or the start timeout passes (which stops the run with a message). */
void run_wait_ports(run_t *run, run_child_t *first, size_t count)
{
    int64_t deadline = ps_now_ns() + run->opts->start_timeout_ms * 1000000;
    for (;;) {
        if (run->stop != STOP_NONE)
            return;
        run_child_t *missing = NULL;
        for (size_t i = 0; i < count; i++) {
            if (first[i].port == 0)
                first[i].port = run_read_port_file(first[i].port_file);
            if (first[i].port == 0 && !missing)
                missing = &first[i];
        }
        if (!missing)
            return;
        int64_t now = ps_now_ns();
        if (now >= deadline) {
            char what[96];
            ps_snprintf(what, sizeof(what), "did not write its port file within %lld ms",
                        (long long)run->opts->start_timeout_ms);
            run_report_first_failure(missing, what);
            run_set_stop(run, STOP_STARTUP, 1);
            return;
        }
        int64_t next = now + (int64_t)RUN_PORT_POLL_MS * 1000000;
        run_pump(run, next < deadline ? next : deadline);
    }
}

/* Stops every child of one role that is still running, or only the child `only` when it is
 * not NULL: sends sig to its process group, waits up to the grace period, then SIGKILLs what is
 * left and waits for it to be reaped. */
void run_stop_role(run_t *run, run_role_t role, const run_child_t *only, int sig)
{
    char name[32];
    const char *signame = run_signame(sig, name, sizeof(name));
    bool any = false;
    for (size_t i = 0; i < run->nchildren; i++) {
        run_child_t *c = &run->children[i];
        if (only && c != only)
            continue;
        if (c->role == role && run_child_alive(c)) {
            PS_DEBUG(PS_SUB_MAIN, "sending %s to %s (pid %d)", signame, c->label, (int)c->pid);
            run_child_signal(c, sig);
            any = true;
        }
    }
    if (!any)
        return;
    int64_t deadline = ps_now_ns() + run->opts->stop_grace_ms * 1000000;
    bool killed = false;
    for (;;) {
        bool alive = false;
        for (size_t i = 0; i < run->nchildren && !alive; i++)
            alive = (!only || &run->children[i] == only) && run->children[i].role == role &&
                    run_child_alive(&run->children[i]);
        if (!alive)
            return;
        int64_t now = ps_now_ns();
        if (!killed && (run->force_kill || now >= deadline)) {
            for (size_t i = 0; i < run->nchildren; i++) {
                run_child_t *c = &run->children[i];
                if (only && c != only)
                    continue;
                if (c->role == role && run_child_alive(c)) {
                    if (!run->force_kill)
                        fprintf(stderr,
                                RUN_PROG ": %s%s (pid %d) still running %lld ms after %s; "
                                         "sending SIGKILL\n",
                                c->reaped ? "processes left behind by " : "", c->label, (int)c->pid,
                                (long long)run->opts->stop_grace_ms, signame);
                    run_child_signal(c, SIGKILL);
                }
            }
            killed = true;
            deadline = now + (int64_t)RUN_REAP_AFTER_KILL_MS * 1000000;
        } else if (killed && now >= deadline) {
            fprintf(stderr, RUN_PROG ": some %s processes did not end after SIGKILL\n",
                    role_names[role]);
            return;
        }
        int64_t next = now + 50 * 1000000LL;
        run_pump(run, next < deadline ? next : deadline);
    }
}

/* Kills and reaps whatever descendants are left that escaped their process groups (they were
 * handed to pshardrun, the subreaper, when their parents ended). Bounded in time. */
void run_sweep(run_t *run)
{
    char path[64];
    ps_snprintf(path, sizeof(path), "/proc/self/task/%d/children", (int)getpid());
    int64_t deadline = ps_now_ns() + (int64_t)RUN_REAP_AFTER_KILL_MS * 1000000;
    for (;;) {
        run_reap(run);
        FILE *f = fopen(path, "re");
        bool any = false;
        if (f) {
            long pid;
            while (fscanf(f, "%ld", &pid) == 1) {
                PS_DEBUG(PS_SUB_MAIN, "killing leftover descendant pid %ld", pid);
                kill((pid_t)pid, SIGKILL);
                any = true;
            }
            fclose(f);
        } else {
            /* No /proc children list: wait for what waitpid still knows about. */
            any = waitpid(-1, NULL, WNOHANG) == 0;
        }
        if (!any || ps_now_ns() >= deadline)
            return;
        run_pump(run, ps_now_ns() + 20 * 1000000LL);
    }
}

/* Forwards what is still buffered in the pipes (bounded in time), then closes them. */
void run_drain(run_t *run)
{
    int64_t deadline = ps_now_ns() + (int64_t)RUN_DRAIN_MS * 1000000;
    for (;;) {
        bool open_any = false;
        for (size_t i = 0; i < run->nchildren && !open_any; i++)
            open_any = run->children[i].streams[0].fd >= 0 || run->children[i].streams[1].fd >= 0;
        if (!open_any || ps_now_ns() >= deadline)
            break;
        run_pump(run, deadline);
    }
    for (size_t i = 0; i < run->nchildren; i++) {
        for (int k = 0; k < 2; k++) {
            run_stream_close(&run->children[i], &run->children[i].streams[k]);
            free(run->children[i].streams[k].buf);
            run->children[i].streams[k].buf = NULL;
        }
    }
}

/* Blocks the signals pshardrun handles and routes them to a signalfd; makes pshardrun the
 * subreaper of its descendants. Returns 0 or -1 after printing why. */
int run_setup_signals(run_t *run)
{
    sigset_t set = run->handled; /* --signals-to-handle */
    sigaddset(&set, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &set, &run->orig_mask) != 0)
        return -1;
    run->sigfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (run->sigfd < 0) {
        fprintf(stderr, RUN_PROG ": signalfd: %s\n", strerror(errno));
        return -1;
    }
    /* A closed stdout must not kill pshardrun while children still need reaping. */
    struct sigaction ign = {.sa_handler = SIG_IGN};
    sigemptyset(&ign.sa_mask);
    sigaction(SIGPIPE, &ign, &run->orig_sigpipe);
    /* Orphaned grandchildren come to us instead of init, so none outlives the run. */
    if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0)
        PS_WARN(PS_SUB_MAIN, "PR_SET_CHILD_SUBREAPER: %s", strerror(errno));
    return 0;
}

/* Removes the run's temporary directory and the port files in it. */
void run_remove_tmpdir(const char *tmpdir)
{
    if (!tmpdir[0])
        return;
    DIR *d = opendir(tmpdir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
                unlinkat(dirfd(d), e->d_name, 0);
        }
        closedir(d);
    }
    if (rmdir(tmpdir) != 0)
        PS_WARN(PS_SUB_MAIN, "cannot remove %s: %s", tmpdir, strerror(errno));
}
