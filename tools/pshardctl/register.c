/* pshardctl register: registers a member by hand; --hold heartbeats until interrupted. */

#include <inttypes.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "pshard/util.h"

#include "ctl.h"

typedef struct {
    char *role;
    char *name;
    char *address;
    char *node;
    char *device;
    bool hold;
} reg_opts_t;

#define ROPT(flag, type, def, help, field)                                                         \
    {                                                                                              \
        flag, NULL, type, def, help, offsetof(reg_opts_t, field), 0, 0                             \
    }

static const ps_option_t reg_options[] = {
    ROPT("role", PS_OPT_STRING, NULL, "shard_server or trainer", role),
    ROPT("name", PS_OPT_STRING, NULL, "member name", name),
    ROPT("address", PS_OPT_STRING, "", "address the member serves on", address),
    ROPT("node", PS_OPT_STRING, "", "node name", node),
    ROPT("device", PS_OPT_STRING, "", "device, e.g. cpu or cuda:0", device),
    ROPT("hold", PS_OPT_BOOL, "false", "heartbeat until ctl_interrupted, then leave", hold),
};

static void sleep_ms(int64_t ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

int cmd_register(int argc, char **argv)
{
    reg_opts_t r;
    ps_config_result_t res;
    char err[PSHARD_ERRLEN] = "";
    int rc = EXIT_ERROR;
    /* ps_config_parse expects argv[0] to be the program name. */
    if (ps_config_parse(reg_options, PS_ARRAY_LEN(reg_options), argc + 1, argv - 1, &r, &res, err,
                        sizeof(err)) != PSHARD_OK) {
        ctl_fail("register: %s", err);
        goto out;
    }
    if (!r.role || !r.name) {
        ctl_fail("register needs --role and --name");
        goto out;
    }
    Pshard__RegisterRequest req = PSHARD__REGISTER_REQUEST__INIT;
    if (strcmp(r.role, "shard_server") == 0) {
        req.role = PSHARD__ROLE__SHARD_SERVER;
    } else if (strcmp(r.role, "trainer") == 0) {
        req.role = PSHARD__ROLE__TRAINER;
    } else {
        ctl_fail("register: --role must be shard_server or trainer, not '%s'", r.role);
        goto out;
    }
    req.name = r.name;
    req.address = r.address;
    req.node = r.node;
    req.device = r.device;
    Pshard__MemberView *v = NULL;
    if (CTL_CALL(register, &req, &v, ctl_opts.timeout_ms) != EXIT_OK)
        goto out;
    char member_id[64], lease_key[64];
    ps_strlcpy(member_id, v->member_id, sizeof(member_id));
    ps_strlcpy(lease_key, v->lease_key ? v->lease_key : "", sizeof(lease_key));
    int64_t heartbeat_ms = v->heartbeat_ms > 0 ? v->heartbeat_ms : 1000;
    printf("registered %s as %s (rank %d, generation %" PRIu64 ", %s)\n", r.name, member_id,
           v->rank, v->generation, ctl_state_name(v->state));
    fflush(stdout);
    protobuf_c_message_free_unpacked(&v->base, NULL);
    rc = EXIT_OK;
    if (!r.hold)
        goto out;
    signal(SIGINT, ctl_on_signal);
    signal(SIGTERM, ctl_on_signal);
    while (!ctl_interrupted) {
        sleep_ms(heartbeat_ms);
        if (ctl_interrupted)
            break;
        Pshard__HeartbeatRequest hb = PSHARD__HEARTBEAT_REQUEST__INIT;
        hb.member_id = member_id;
        hb.lease_key = lease_key;
        if (CTL_CALL(heartbeat, &hb, NULL, ctl_opts.timeout_ms) != EXIT_OK) {
            rc = EXIT_ERROR;
            goto out;
        }
    }
    Pshard__LeaveRequest lv = PSHARD__LEAVE_REQUEST__INIT;
    lv.member_id = member_id;
    lv.lease_key = lease_key;
    CTL_CALL(leave, &lv, NULL, ctl_opts.timeout_ms);
out:
    ps_config_free(reg_options, PS_ARRAY_LEN(reg_options), &r);
    return rc;
}

const ps_option_t *ctl_register_options(size_t *n)
{
    *n = PS_ARRAY_LEN(reg_options);
    return reg_options;
}
