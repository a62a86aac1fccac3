/* Process helpers for integration tests; see ps_proc.h. */
#include "ps_proc.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "grpc/health/v1/health.pb-c.h"
#include "pshard/rpc.h"
#include "pshard/util.h"

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

pid_t ps_proc_spawn(char *const argv[], const char *log_path)
{
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        if (log_path) {
            int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
            if (fd >= 0) {
                dup2(fd, 1);
                dup2(fd, 2);
                close(fd);
            }
        }
        /* The test may block signals; the child must not inherit that. */
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

int ps_proc_wait_port_file(const char *path, pid_t pid, int64_t timeout_ms)
{
    int64_t end = ps_now_ns() + timeout_ms * 1000000;
    while (ps_now_ns() < end) {
        FILE *f = fopen(path, "r");
        if (f) {
            char buf[32] = "";
            size_t n = fread(buf, 1, sizeof(buf) - 1, f);
            fclose(f);
            buf[n] = '\0';
            char *nl = strchr(buf, '\n');
            if (nl) {
                *nl = '\0';
                int64_t port;
                if (ps_parse_i64(buf, 1, 65535, &port) == 0)
                    return (int)port;
            }
        }
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid)
            return -1;
        sleep_ms(10);
    }
    return -1;
}

int ps_proc_wait_healthy(const char *target, int64_t timeout_ms)
{
    char err[256] = "";
    ps_rpc_channel_config_t cfg = {.target = target};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&cfg, err, sizeof(err));
    if (!ch)
        return -1;
    int64_t end = ps_now_ns() + timeout_ms * 1000000;
    int rc = -1;
    while (ps_now_ns() < end) {
        Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
        ProtobufCMessage *resp = NULL;
        err[0] = '\0';
        if (ps_rpc_unary(ch, "/grpc.health.v1.Health/Check", &req.base,
                         &grpc__health__v1__health_check_response__descriptor, &resp, 500, 0, NULL,
                         err, sizeof(err)) == PSHARD_OK) {
            int status = ((Grpc__Health__V1__HealthCheckResponse *)resp)->status;
            protobuf_c_message_free_unpacked(resp, NULL);
            if (status == 1) {
                rc = 0;
                break;
            }
        }
        sleep_ms(10);
    }
    ps_rpc_channel_destroy(ch);
    return rc;
}

int ps_proc_stop(pid_t pid, int64_t timeout_ms)
{
    if (pid <= 0)
        return -1;
    kill(pid, SIGTERM);
    int64_t end = ps_now_ns() + timeout_ms * 1000000;
    int status;
    while (ps_now_ns() < end) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (r < 0 && errno != EINTR)
            return -1;
        sleep_ms(5);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1;
}

/* Temporary directories made for coordinators, removed when the test program exits (their
 * logs are kept when it fails, to read). */
static char made_dirs[32][32];
static int nmade;
static int test_failed_hint;

static void remove_made_dirs(void)
{
    if (test_failed_hint)
        return;
    for (int i = 0; i < nmade; i++) {
        char path[1100];
        snprintf(path, sizeof(path), "%s/port", made_dirs[i]);
        unlink(path);
        snprintf(path, sizeof(path), "%s/coordinator.log", made_dirs[i]);
        unlink(path);
        rmdir(made_dirs[i]);
    }
}

void ps_proc_keep_logs(void)
{
    test_failed_hint = 1;
}

pid_t ps_proc_start_coordinator(const char *binary, const char *const *extra_args, char *target,
                                size_t target_len)
{
    char dir[] = "/tmp/pshard-test-XXXXXX";
    if (!mkdtemp(dir))
        return -1;
    if (nmade < (int)(sizeof(made_dirs) / sizeof(made_dirs[0]))) {
        if (nmade == 0)
            atexit(remove_made_dirs);
        snprintf(made_dirs[nmade++], sizeof(made_dirs[0]), "%s", dir);
    }
    char port_file[128], log_file[128];
    snprintf(port_file, sizeof(port_file), "%s/port", dir);
    snprintf(log_file, sizeof(log_file), "%s/coordinator.log", dir);
    char *argv[64];
    size_t n = 0;
    argv[n++] = (char *)binary;
    argv[n++] = "--listen";
    argv[n++] = "127.0.0.1:0";
    argv[n++] = "--port-file";
    argv[n++] = port_file;
    for (size_t i = 0; extra_args && extra_args[i] && n < 62; i++)
        argv[n++] = (char *)extra_args[i];
    argv[n] = NULL;
    pid_t pid = ps_proc_spawn(argv, log_file);
    if (pid < 0)
        return -1;
    int port = ps_proc_wait_port_file(port_file, pid, 10000);
    if (port < 0) {
        ps_proc_keep_logs();
        fprintf(stderr, "coordinator did not start; log in %s\n", log_file);
        ps_proc_stop(pid, 2000);
        return -1;
    }
    snprintf(target, target_len, "127.0.0.1:%d", port);
    if (ps_proc_wait_healthy(target, 10000) != 0) {
        ps_proc_keep_logs();
        fprintf(stderr, "coordinator on %s never became healthy; log in %s\n", target, log_file);
        ps_proc_stop(pid, 2000);
        return -1;
    }
    return pid;
}
