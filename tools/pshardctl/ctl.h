/* pshardctl's internals shared by its commands: the global options, the coordinator channel,
 * error and JSON output helpers, and each command's entry point (one file per command). A
 * command returns the process's exit status: EXIT_OK, EXIT_NOT_SERVING or EXIT_ERROR. */
#ifndef PSHARD_CTL_H
#define PSHARD_CTL_H

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <jansson.h>

#include "pshard/config.h"
#include "pshard/coord_client.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/flight_json.h"
#include "pshard/rpc.h"
#include "pshard/shard.pb-c.h"

#define EXIT_OK 0
#define EXIT_NOT_SERVING 1
#define EXIT_ERROR 2

typedef struct {
    char *coordinator;
    char *token_file;
    char *tls_ca;
    char *tls_cert;
    char *tls_key;
    char *tls_server_name;
    char *job;
    int64_t timeout_ms;
    int64_t server_timeout_ms;
    bool json;
} ctl_opts_t;

extern ctl_opts_t ctl_opts;
extern ps_rpc_channel_t *ctl_channel; /* to the coordinator; NULL for offline commands */
extern char *ctl_token;               /* from --token-file; sent to coordinator and servers */
extern const char ctl_usage_text[];   /* the command list --help prints */
extern volatile sig_atomic_t ctl_interrupted;

/* Prints "pshardctl: MESSAGE" to stderr; returns EXIT_ERROR. */
int ctl_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* One coordinator call through pshard/coord_client.h's ps_coord_rpc_<fn> on ctl_channel:
 * EXIT_OK with *resp set (NULL: dropped), or EXIT_ERROR after printing "<fn>: why (STATUS)". */
#define CTL_CALL(fn, req, resp, timeout_ms)                                                        \
    ctl_called(#fn, ps_coord_rpc_##fn(ctl_channel, (req), (resp), (timeout_ms), ctl_err,           \
                                      sizeof(ctl_err)))
extern char ctl_err[PSHARD_ERRLEN]; /* the last CTL_CALL's error */
int ctl_called(const char *what, pshard_status_t rc);
void ctl_on_signal(int sig); /* sets ctl_interrupted */

/* --json output is built with jansson: a JSON string of s's bytes (NULL: ""), where bytes that
 * are not UTF-8 show as U+FFFD; NULL only without memory. */
json_t *ctl_jstrn(const char *s, size_t len);
json_t *ctl_jstr(const char *s);
/* {"value": TEXT} for bytes that are UTF-8, else {"value_base64": BASE64}. */
json_t *ctl_jbytes(const void *data, size_t len);
/* Prints v (stolen; NULL means a failed build) on one compact line. EXIT_OK or EXIT_ERROR. */
int ctl_json_print(json_t *v);

const char *ctl_state_name(Pshard__ClusterState s);
const char *ctl_role_name(Pshard__Role r);
json_t *ctl_json_member(const Pshard__Member *m);
json_t *ctl_json_members(Pshard__Member **members, size_t n);
void ctl_print_members(FILE *out, Pshard__Member **members, size_t n);
json_t *ctl_json_joins(Pshard__JoinEntry **joins, size_t n);
void ctl_print_joins(FILE *out, const Pshard__StatusResponse *st);

/* One shard server asked for its own Status (with its flight records) by its own thread. */
typedef struct {
    const Pshard__Member *member;      /* borrowed from the coordinator's status */
    pshard_status_t rc;                /* PSHARD_OK when resp is set */
    char err[PSHARD_ERRLEN];           /* why it could not be asked */
    Pshard__ShardStatusResponse *resp; /* owned; free with protobuf_c_message_free_unpacked */
    pthread_t thread;
    bool started;
} ctl_server_probe_t;

/* Asks every shard server in st for its Status (ctl_opts.server_timeout_ms each, the same
 * token and TLS as the coordinator), many at once, so that hung or dead servers cost one
 * deadline per batch, not one each. Returns a calloc'd array of *n probes (free with
 * ctl_free_probes), or NULL with *n = 0 when there are none, server_timeout_ms is 0 or memory
 * ran out. */
ctl_server_probe_t *ctl_probe_servers(const Pshard__StatusResponse *st, size_t *n);
void ctl_free_probes(ctl_server_probe_t *probes, size_t n); /* NULL: nothing */

/* The commands; argv holds the words after the command's name. */
int cmd_status(bool members_only);
int cmd_health(int argc, char **argv);
int cmd_store(int argc, char **argv);
int cmd_watch(int argc, char **argv);
int cmd_register(int argc, char **argv);
int cmd_checkpoint(int argc, char **argv);
int cmd_trace(int argc, char **argv); /* trace dump (coordinator) and trace analyze (offline) */

/* A command's own options (they win over a global option of the same name), for hoisting the
 * global ones: register's, and a checkpoint subcommand's (NULL with *n = 0 when none). */
const ps_option_t *ctl_register_options(size_t *n);
const ps_option_t *ctl_checkpoint_options(const char *sub, size_t *n);

#endif
