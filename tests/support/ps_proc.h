/* Process helpers for integration tests: start a real pshard binary, wait for its port file
 * and its health with a deadline (never a fixed sleep), and stop it by PID. */
#ifndef PS_PROC_H
#define PS_PROC_H

#include <stdint.h>
#include <sys/types.h>

/* Starts argv[0] with argv (NULL-terminated); stdout and stderr go to log_path (appended) when
 * it is non-NULL. Returns the PID or -1. */
pid_t ps_proc_spawn(char *const argv[], const char *log_path);

/* Waits until path holds a port number, or the process exits, or timeout_ms passes.
 * Returns the port or -1. */
int ps_proc_wait_port_file(const char *path, pid_t pid, int64_t timeout_ms);

/* Polls grpc.health.v1.Health/Check for service "" on target until SERVING or timeout.
 * Returns 0 when serving, -1 otherwise. */
int ps_proc_wait_healthy(const char *target, int64_t timeout_ms);

/* SIGTERM, wait up to timeout_ms, then SIGKILL. Returns the exit code (0..255), 128+signal if
 * killed by a signal, or -1 if it had to be SIGKILLed. */
int ps_proc_stop(pid_t pid, int64_t timeout_ms);

/* Starts a coordinator binary on 127.0.0.1:0 with extra args (NULL-terminated list), waits for
 * it to serve, and fills target ("127.0.0.1:PORT"). Returns the PID or -1. The port file and
 * log live in a fresh temporary directory, removed at exit unless ps_proc_keep_logs ran. */
pid_t ps_proc_start_coordinator(const char *binary, const char *const *extra_args, char *target,
                                size_t target_len);

/* Keeps the coordinators' temporary directories (and logs) when the program exits; they are
 * removed otherwise. */
void ps_proc_keep_logs(void);

#endif
