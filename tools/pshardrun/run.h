/* pshardrun's internals shared by its files, as pshardctl's ctl.h is: the options, the process
 * table (one run_t per run, one run_child_t per coordinator, shard server and trainer), and each
 * file's entry points. One file per concern: options.c (the flag table, --help, checks),
 * proc.c (starting, reaping, signalling and stopping children), output.c (the line prefixer),
 * coordinator.c (the coordinator it starts and the rendezvous around it), launch.c (shard
 * servers and trainers), restart.c (the restart policy), main.c (the run's loop).
 * Single-threaded: only the main thread touches any of it. */
#ifndef PSHARD_RUN_H
#define PSHARD_RUN_H

#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "pshard/config.h"

#define RUN_PROG "pshardrun"
#define RUN_COORD_BIN "pshard-coordinator"
#define RUN_SERVER_BIN "pshard-server"

/* Longest line forwarded as one piece; a longer run of bytes without a newline is forwarded
 * in pieces of this size so one chatty child cannot make pshardrun grow without bound. */
#define RUN_MAX_LINE 65536
/* How often port files are looked for while waiting for servers to come up. */
#define RUN_PORT_POLL_MS 20
/* After SIGKILL, how long to wait for the kernel to let us reap before giving up. */
#define RUN_REAP_AFTER_KILL_MS 5000
/* How long to keep reading pipes after every child is gone (grandchildren may hold them). */
#define RUN_DRAIN_MS 2000
/* Multi-node: the coordinator store key under which node 0 publishes torch's MASTER_ADDR:PORT
 * of an attempt, and the least time the other nodes wait for it (torch's store timeout). */
#define RUN_TORCH_MASTER_KEY "pshardrun/master_port/"
#define RUN_TORCH_MASTER_WAIT_MS 300000

typedef struct {
    int64_t nproc;
    char *coordinator;
    char *backend;
    char *offload;
    char *token_file;
    int64_t lease_ms;
    char *log;
    char *coordinator_bin;
    char *server_bin;
    int64_t start_timeout_ms;
    int64_t stop_grace_ms;
    char *checkpoint_dir;
    int64_t checkpoint_every;
    int64_t checkpoint_keep;
    char *resume;
    bool resume_allow_fresh;
    int64_t max_restarts;
    int64_t replace_timeout_ms;
    char *rdzv_id;
    int64_t nnodes;
    int64_t node_rank;
    int64_t nproc_per_node;
    char *rdzv_endpoint;
} run_opts_t;

typedef struct {
    const char *name;
    const char *value;
} run_env_t;

typedef enum { ROLE_COORDINATOR, ROLE_SERVER, ROLE_TRAINER } run_role_t;

/* One pipe from a child's stdout or stderr, with the bytes of a line not yet complete. */
typedef struct {
    int fd;     /* read end (non-blocking, close-on-exec); -1 after EOF */
    int out_fd; /* where lines go: 1 or 2 */
    char *buf;  /* pending bytes of an incomplete line; owned */
    size_t len; /* bytes in buf */
} run_stream_t;

typedef struct {
    run_role_t role;
    int rank;                 /* -1 for the coordinator */
    char label[32];           /* "trainer 3", "coordinator": used in messages */
    char who[40];             /* "trainer 3", "shard server 3": the first-failure line */
    char prefix[40];          /* "[trainer 3] ": put in front of each forwarded line */
    char port_file[PATH_MAX]; /* servers and coordinator: where the bound port appears */
    int port;                 /* from the port file once read; 0 before */
    pid_t pid;                /* 0 until started; also the id of its process group */
    bool reaped;              /* waitpid returned its status */
    int wait_status;          /* valid when reaped */
    bool signalled;           /* pshardrun asked it to stop, so its exit is expected */
    bool unjudged;            /* a trainer that failed: replace it or stop? (run_judge_trainers) */
    bool replace;             /* a trainer that failed, to be replaced (run_replace_trainers) */
    int64_t replace_restarts; /* with replace: what its replacement gets as the restart count */
    run_stream_t streams[2];  /* stdout, stderr */
} run_child_t;

typedef enum {
    STOP_NONE = 0,
    STOP_DONE,           /* every trainer exited 0 */
    STOP_TRAINER_FAILED, /* a trainer exited non-zero or was killed */
    STOP_SERVICE_DIED,   /* a server or the coordinator exited on its own */
    STOP_SIGNAL,         /* pshardrun got SIGINT/SIGTERM/SIGHUP */
    STOP_STARTUP,        /* something could not be started in time */
} run_stop_t;

/* Everything one run owns. Single-threaded: only main() touches it. */
typedef struct {
    run_opts_t *opts;
    run_child_t *children; /* coordinator (if started), servers, trainers */
    size_t nchildren;
    run_child_t *coord;        /* NULL when --coordinator names an existing one */
    run_child_t *servers;      /* nproc entries */
    run_child_t *trainers;     /* nproc entries */
    struct pollfd *pfds;       /* 1 + 2 * nchildren: the signalfd, then open streams */
    run_child_t **pfd_child;   /* for pfds[i], i >= 1: whose stream it is */
    run_stream_t **pfd_stream; /* for pfds[i], i >= 1: which stream */
    int sigfd;                 /* signalfd for SIGINT, SIGTERM, SIGHUP, SIGCHLD */
    sigset_t orig_mask;        /* restored in children */
    struct sigaction orig_sigpipe;
    run_stop_t stop; /* why we are stopping (first reason wins) */
    int stop_signal; /* for STOP_SIGNAL */
    int exit_code;   /* decided together with stop */
    bool force_kill; /* a second signal arrived: SIGKILL without grace */
    char tmpdir[PATH_MAX];
    int64_t attempt;       /* restarts so far: replacements and full restarts together */
    const char *resume;    /* what the servers get as --resume in this attempt, or NULL */
    char coord_addr[300];  /* HOST:PORT trainers and servers use */
    char job[72];          /* the job id servers get (--job), or "" for the default job */
    char master_addr[256]; /* the coordinator's host and port, as given or bound */
    int master_port;
    char torch_addr[256];  /* what trainers get as MASTER_ADDR / MASTER_PORT: where rank 0's */
    int torch_port;        /* torch TCPStore listens (env://), picked for each attempt */
    int node_rank, nnodes; /* multi-node: this node among nnodes (0 of 1 otherwise) */
    bool endpoint;         /* --rdzv-endpoint: node 0's coordinator listens on coord_addr */
    char data_host[64];    /* multi-node: the address servers' rings listen on ("": default) */
} run_t;

/* ---- options.c ---- */
extern const ps_option_t run_options[];
extern const size_t run_noptions;
/* Prints pshardrun's usage on out. */
void run_usage(FILE *out);
/* Checks option values the config table cannot and fills what the run derives from them (its
 * nodes, job id, coordinator address). Returns 0, or 2 after printing why. */
int run_check_opts(run_t *run, run_opts_t *o);

/* ---- output.c ---- */
/* Reads what the pipe has now (a bounded amount, so one chatty child cannot starve the others)
 * and forwards complete lines; closes the stream at EOF. */
void run_stream_read(const run_child_t *c, run_stream_t *s);
/* Forwards what is left in the stream (a partial line too) and closes it; a closed stream is
 * left alone. The buffer stays (the caller frees it). */
void run_stream_close(const run_child_t *c, run_stream_t *s);
/* Forwards what the child's pipes hold now: a failed child's last words (often the reason)
 * come before the line about it. */
void run_child_read_now(run_child_t *c);

/* ---- proc.c ---- */
void run_child_init(run_child_t *c, run_role_t role, int rank);
const char *run_signame(int sig, char *buf, size_t len);
void run_describe_status(int status, bool signal_text, char *buf, size_t len);
void run_report_first_failure(const run_child_t *c, const char *what);
void run_set_stop(run_t *run, run_stop_t why, int exit_code);
void run_reap(run_t *run);
void run_pump(run_t *run, int64_t deadline_ns);
int run_spawn(run_t *run, run_child_t *c, const char *path, char *const argv[],
              const run_env_t *env, size_t nenv);
void run_wait_ports(run_t *run, run_child_t *first, size_t count);
void run_stop_role(run_t *run, run_role_t role, const run_child_t *only, int sig);
void run_sweep(run_t *run);
void run_drain(run_t *run);
int run_setup_signals(run_t *run);
void run_remove_tmpdir(const char *tmpdir);

/* ---- coordinator.c ---- */
int run_parse_coordinator(run_t *run, const char *addr, bool allow_port_zero);
int run_local_address(run_t *run);
void run_start_coordinator(run_t *run, const char *bin);
void run_choose_torch_master(run_t *run);

/* ---- launch.c ---- */
char *run_find_binary(const char *flag_value, const char *flag, const char *subdir,
                      const char *name);
void run_start_servers(run_t *run, const char *bin);
void run_start_trainer(run_t *run, int r, char *const argv[], int64_t restarts);
void run_start_trainers(run_t *run, char *const argv[]);

/* ---- restart.c ---- */
void run_judge_trainers(run_t *run);
void run_replace_trainers(run_t *run, char *const argv[]);
void run_restart(run_t *run);

#endif
