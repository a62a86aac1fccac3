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
#include <stdio.h>
#include <stdint.h>
#include <sys/types.h>

#include "pshard/config.h"

#define RUN_PROG "pshardrun"
#define RUN_COORD_BIN "pshard-coordinator"
#define RUN_SERVER_BIN "pshard-server"

/* Longest line forwarded as one piece; a longer run of bytes without a newline is forwarded
 * in pieces of this size so one chatty child cannot make pshardrun grow without bound. */
#define RUN_MAX_LINE 65536
/* Longest prefix in front of a forwarded line, its NUL included (--log-line-prefix-template's
 * expansion must fit). */
#define RUN_MAX_PREFIX 256
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
/* Most shard servers and trainers one pshardrun starts. */
#define RUN_MAX_NPROC 4096
/* torchrun's Std values for --redirects and --tee: which of a trainer's streams go to files. */
#define RUN_STD_OUT 1
#define RUN_STD_ERR 2

/* Options: one table (options.c), which also makes --help. torchrun's flags keep torchrun's
 * names; the ones pshardrun cannot honour are parsed and refused with a reason. */
typedef struct {
    /* torchrun's worker/node size */
    char *nnodes;         /* "N" or "MIN:MAX" */
    char *nproc_per_node; /* a number, auto, cpu or gpu; NULL: --nproc */
    int64_t nproc;        /* pshard's own name; the number the run uses once checked */
    /* torchrun's rendezvous */
    char *rdzv_backend;
    char *rdzv_endpoint;
    char *rdzv_id;
    char *rdzv_conf;
    bool standalone;
    /* torchrun's user-code launch */
    int64_t max_restarts;
    char *monitor_interval; /* seconds, a decimal */
    char *start_method;
    char *event_log_handler;
    char *role;
    bool module;
    bool no_python;
    bool run_path;
    char *log_dir;
    char *redirects;
    char *tee;
    char *local_ranks_filter;
    char *log_line_prefix_template; /* the trainers' console prefix, torchrun's macros */
    char *duplicate_stdout_filters; /* refused */
    char *duplicate_stderr_filters; /* refused */
    /* torchrun's backwards-compatible and other flags */
    int64_t node_rank;
    char *master_addr;
    int64_t master_port;
    char *local_addr;
    char *logs_specs;
    char *numa_binding;
    char *signals_to_handle;
    char *shutdown_timeout;  /* seconds, a decimal: --stop-grace-ms in torchrun's words */
    bool virtual_local_rank; /* refused */
    char *print_completion;  /* refused */
    /* pshard's own */
    char *coordinator;
    char *backend;
    char *offload;
    char *shard_memory;
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
    int64_t replace_timeout_ms;
} run_opts_t;

typedef struct {
    const char *name;
    const char *value;
} run_env_t;

typedef enum { ROLE_COORDINATOR, ROLE_SERVER, ROLE_TRAINER } run_role_t;

/* One pipe from a child's stdout or stderr, with the bytes of a line not yet complete. */
typedef struct {
    int fd;       /* read end (non-blocking, close-on-exec); -1 after EOF */
    int out_fd;   /* where lines go on the console: 1 or 2 */
    bool console; /* lines go to out_fd (not with --redirects, or --local-ranks-filter) */
    int file_fd;  /* also (or instead) to this log file, without the prefix; -1: none */
    char *buf;    /* pending bytes of an incomplete line; owned */
    size_t len;   /* bytes in buf */
} run_stream_t;

typedef struct {
    run_role_t role;
    int rank;                    /* -1 for the coordinator */
    char label[32];              /* "trainer 3", "coordinator": used in messages */
    char who[40];                /* "trainer 3", "shard server 3": the first-failure line */
    char prefix[RUN_MAX_PREFIX]; /* "[trainer 3] ", "[ROLE 3] ", --log-line-prefix-template's
                                  * expansion: in front of each forwarded line */
    char port_file[PATH_MAX];    /* servers and coordinator: where the bound port appears */
    char name[64];               /* servers: the name they register with (it orders their ranks) */
    int port;                    /* from the port file once read; 0 before */
    pid_t pid;                   /* 0 until started; also the id of its process group */
    bool reaped;                 /* waitpid returned its status */
    int wait_status;             /* valid when reaped */
    bool signalled;              /* pshardrun asked it to stop, so its exit is expected */
    bool unjudged;               /* a trainer that failed: replace it or stop? (run_judge_trainers);
                                  * a server that ended on its own: heal it or stop?
                                  * (run_judge_servers) */
    bool replace;                /* a trainer that failed, to be replaced (run_replace_trainers) */
    int64_t replace_restarts;    /* with replace: what its replacement gets as the restart count */
    run_stream_t streams[2];     /* stdout, stderr */
} run_child_t;

typedef enum {
    STOP_NONE = 0,
    STOP_DONE,           /* every trainer exited 0 */
    STOP_TRAINER_FAILED, /* a trainer exited non-zero or was killed */
    STOP_SERVICE_DIED,   /* a server or the coordinator exited on its own */
    STOP_SIGNAL,         /* pshardrun got a signal of --signals-to-handle */
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
    int sigfd;                 /* signalfd for --signals-to-handle and SIGCHLD */
    sigset_t orig_mask;        /* restored in children */
    struct sigaction orig_sigpipe;
    run_stop_t stop; /* why we are stopping (first reason wins) */
    int stop_signal; /* for STOP_SIGNAL */
    int exit_code;   /* decided together with stop */
    bool force_kill; /* a second signal arrived: SIGKILL without grace */
    char tmpdir[PATH_MAX];
    int64_t attempt;        /* restarts so far: replacements, heals and full restarts together */
    bool supervising;       /* the attempt's trainers run and its loop judges the children that
                             * end (so a lost server may wait for run_judge_servers) */
    const char *server_bin; /* pshard-server's path, for heals (main owns it) */
    const char *resume;     /* what the servers get as --resume in this attempt, or NULL */
    char coord_addr[300];   /* HOST:PORT trainers and servers use */
    char job[72];           /* the job id servers get (--job), or "" for the default job */
    char master_addr[256];  /* the coordinator's host and port, as given or bound */
    int master_port;
    char torch_addr[256];    /* what trainers get as MASTER_ADDR / MASTER_PORT: where rank 0's */
    int torch_port;          /* torch TCPStore listens (env://), picked for each attempt */
    int node_rank, nnodes;   /* multi-node: this node among nnodes (0 of 1 otherwise) */
    bool endpoint;           /* --rdzv-endpoint: node 0's coordinator listens on coord_addr */
    bool host;               /* this node starts the job's coordinator (node rank 0, or is_host) */
    char data_host[64];      /* multi-node: the address servers' rings listen on ("": default) */
    int nnodes_min;          /* --nnodes MIN:MAX's MIN (nnodes is MAX); equal unless elastic */
    int rank_base;           /* the global rank of this node's first server and trainer */
    int world;               /* shard servers (and trainers) of the job in this attempt */
    int64_t monitor_ms;      /* --monitor-interval: the longest wait between two reaps */
    int64_t join_timeout_ms; /* --rdzv-conf join_timeout: how long nodes wait for each other */
    int64_t last_call_ms;    /* --rdzv-conf last_call_timeout (0: the coordinator's default) */
    sigset_t handled;        /* --signals-to-handle (SIGCHLD is handled besides) */
    char **cmd;              /* the trainers' argv, NULL-terminated: the array is owned (free),
                              * its strings borrowed from main's argv or from python */
    char python[PATH_MAX];   /* the interpreter cmd[0] names when the trainer runs under Python */
    char log_run_dir[PATH_MAX];             /* where trainers' log files go ("": no files) */
    unsigned char redirects[RUN_MAX_NPROC]; /* by local rank: RUN_STD_OUT | RUN_STD_ERR */
    unsigned char tee[RUN_MAX_NPROC];       /* by local rank: likewise, to file and console */
    bool hidden[RUN_MAX_NPROC]; /* by local rank: left off the console (--local-ranks-filter) */
} run_t;

/* ---- options.c ---- */
extern const ps_option_t run_options[];
extern const size_t run_noptions;
/* Parses argv, torchrun's spellings and pshard's, into o (then the environment, then the
 * defaults; free o's strings with ps_config_free). *cmd is where the trainer's command starts
 * (argc when there is none), *dashdash whether "--" came before it. Returns -1 when main should
 * go on, 0 after --help or --version, 2 after a message naming the bad flag (an unknown one
 * with the nearest known one) or value. */
int run_parse_args(int argc, char **argv, run_opts_t *o, ps_config_result_t *res, int *cmd,
                   bool *dashdash);
/* Builds run->cmd from argv[first..argc): as it is after "--" or with --no-python, else
 * behind "the current Python" (see run_usage) with -u, and -m for a module. Returns 0, or 2
 * after saying why (no command, no Python). */
int run_build_command(run_t *run, int argc, char **argv, int first, bool dashdash);
/* Checks option values the config table cannot and fills what the run derives from them (its
 * nodes, job id, coordinator address); res says which options were given. Returns 0, or 2 after
 * printing why. */
int run_check_opts(run_t *run, run_opts_t *o, const ps_config_result_t *res);

/* ---- output.c ---- */
/* Reads what the pipe has now (a bounded amount, so one chatty child cannot starve the others)
 * and forwards complete lines; closes the stream at EOF. */
void run_stream_read(const run_child_t *c, run_stream_t *s);
/* Forwards what is left in the stream (a partial line too) and closes it; a closed stream is
 * left alone. The buffer stays (the caller frees it). */
void run_stream_close(const run_child_t *c, run_stream_t *s);
/* Expands torchrun's --log-line-prefix-template (string.Template's $NAME, ${NAME} and $$ with
 * the names role_name, local_rank, rank and hostname) into out[0..len). Returns 0, -1 when the
 * expansion does not fit, or -2 for an unknown name or a lone '$' (then the offending text,
 * cut to fit, is in bad[0..badlen)). */
int run_format_prefix(const char *tmpl, const char *role, const char *host, long long local_rank,
                      long long rank, char *out, size_t len, char *bad, size_t badlen);
/* Forwards what the child's pipes hold now: a failed child's last words (often the reason)
 * come before the line about it. */
void run_child_read_now(run_child_t *c);
/* Creates the directory trainers' log files go to when --redirects or --tee send any there,
 * or --log-dir is given: LOG_DIR/RUNID_XXXXXX (RUNID: the job id, or torchrun's "none"), under
 * a new TMPDIR/pshardrun_logs_XXXXXX without --log-dir, and prints where. Returns 0, or 1
 * after saying why. */
int run_make_log_dir(run_t *run);
/* Sets where a trainer's streams go before it starts: the console unless redirected or
 * filtered out, and files LOCAL_RANK/stdout.log and stderr.log under attempt_RESTARTS/ of the
 * log directory for the streams redirected or teed (closed with the stream). Returns 0, or -1
 * after saying why. */
int run_open_trainer_logs(const run_t *run, run_child_t *c, int local_rank, int64_t restarts);

/* ---- proc.c ---- */
void run_child_init(run_child_t *c, run_role_t role, int rank);
/* Gives a child of role role another rank: its label, its name in messages and its prefix. */
void run_child_relabel(run_child_t *c, int rank);
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
/* Tells the coordinator that the member called name ("trainer-R" for the trainer of global
 * rank R, a shard server's run_child_t name) is lost (its process ended: why), so that its
 * rank is vacant now instead of after its lease: a lost trainer's server aborts the step and
 * awaits the replacement, a lost server's rank waits for the new server of the same name.
 * Best effort (the lease still catches it); says why when it fails. */
void run_declare_lost(run_t *run, const char *name, const char *why);
/* Reads store key of the job's coordinator: 1 with *value its bytes, NUL-terminated (free()),
 * 0 when the key is not there, -1 after saying why it could not be read (*value NULL). */
int run_store_get(run_t *run, const char *key, char **value);
int run_parse_coordinator(run_t *run, const char *addr, bool allow_port_zero);
int run_local_address(run_t *run);
void run_start_coordinator(run_t *run, const char *bin);
void run_choose_torch_master(run_t *run);
/* Learns this attempt's ranks: fixed --nnodes N gives node rank * NPROC + local rank of N *
 * NPROC; an elastic --nnodes MIN:MAX waits (up to --rdzv-conf join_timeout) for the job to form
 * and reads its servers' ranks from the coordinator, relabelling servers and trainers. Sets
 * run->rank_base and run->world; on failure stops the run (STOP_STARTUP) after saying why. */
void run_learn_ranks(run_t *run);

/* ---- launch.c ---- */
char *run_find_binary(const char *flag_value, const char *flag, const char *subdir,
                      const char *name);
void run_start_server(run_t *run, int r, const char *bin);
void run_start_servers(run_t *run, const char *bin);
void run_start_trainer(run_t *run, int r, char *const argv[], int64_t restarts);
void run_start_trainers(run_t *run, char *const argv[]);

/* ---- restart.c ---- */
/* The store key through which a model's shard servers say that a lost one can be healed from a
 * replica (HSDP); pshardrun only reads it. */
#define RUN_HEAL_CAPABLE_KEY "pshard/heal/capable"
bool run_may_heal(const run_t *run, const run_child_t *server);
void run_judge_servers(run_t *run);
void run_judge_trainers(run_t *run);
void run_replace_trainers(run_t *run, char *const argv[]);
void run_restart(run_t *run);

#endif
