/* Sharded training end to end: a real coordinator, N real shard servers and N shard_trainer
 * processes per case; each trainer checks its gathered parameters against a single-process
 * reference every step. Cases cover 1-3 ranks, both layouts, SGD (momentum, nesterov), Adam and
 * AdamW with clipping, bf16 parameters, and a mismatched model definition that every rank must
 * refuse; and parameter groups (per-group and per-step hyperparameters, a frozen parameter,
 * clip_grad_norm with norm 2 and inf, with a joined rank, in backward, on emulated GPU shards,
 * through a checkpoint and resume). argv: pshard-coordinator pshard-server shard_trainer. */
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ps_proc.h"
#include "ps_test.h"
#include "pshard/rpc.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"

static const char *coord_bin, *server_bin, *trainer_bin;

/* What the servers of a finished case say of the agreement rounds (Join's) they skipped: on a
 * same-host ring every rank's gathers and reduce-scatters ran ahead of the agreement, and with
 * a joined rank (the last one, before the last step) exactly one operation of each other rank
 * was diverted to an agreement round: the first after the join (the join ends every rank's
 * agreeing, so the final gather ran ahead again). */
static bool check_ahead(char addr[][64], int world, bool join)
{
    bool ok = true;
    for (int r = 0; r < world; r++) {
        char err[256] = "";
        ps_rpc_channel_config_t cfg = {.target = addr[r], .own_connection = true};
        ps_rpc_channel_t *ch = ps_rpc_channel_create(&cfg, err, sizeof(err));
        Pshard__ShardStatusRequest req = PSHARD__SHARD_STATUS_REQUEST__INIT;
        ProtobufCMessage *resp = NULL;
        if (!ch || ps_rpc_unary(ch, "/pshard.ShardServer/Status", &req.base,
                                &pshard__shard_status_response__descriptor, &resp, 5000, 0, NULL,
                                err, sizeof(err)) != PSHARD_OK) {
            fprintf(stderr, "server %d: Status: %s\n", r, err);
            ok = false;
        } else {
            const Pshard__ShardStatusResponse *st = (const Pshard__ShardStatusResponse *)resp;
            /* (both run ahead; the same-host path without slots would not) */
            bool ahead = strcmp(st->transport, "shm") == 0 || strcmp(st->transport, "tcp") == 0;
            uint64_t want = join && st->rank < world - 1 ? 1 : 0;
            if (ahead && (st->ops_ahead == 0 || st->ops_diverted != want)) {
                fprintf(stderr,
                        "server %d (rank %d, %s): %llu operations ran ahead of the agreement, "
                        "%llu diverted; expected some and %llu\n",
                        r, st->rank, st->transport, (unsigned long long)st->ops_ahead,
                        (unsigned long long)st->ops_diverted, (unsigned long long)want);
                ok = false;
            } else if (join) {
                printf("rank %d (%s): %llu operations ran ahead of the agreement, %llu "
                       "diverted\n",
                       st->rank, st->transport, (unsigned long long)st->ops_ahead,
                       (unsigned long long)st->ops_diverted);
            }
            if (!ahead && st->ops_ahead != 0) {
                fprintf(stderr, "server %d (%s): %llu operations ran ahead of the agreement\n", r,
                        st->transport, (unsigned long long)st->ops_ahead);
                ok = false;
            }
        }
        if (resp)
            protobuf_c_message_free_unpacked(resp, NULL);
        if (ch)
            ps_rpc_channel_destroy(ch);
    }
    return ok;
}

/* Runs one case of `steps` steps, the servers started with server_extra (NULL-terminated, may
 * be NULL); returns true when every trainer exited 0 and the servers stopped cleanly. */
static bool run_case_with(int world, const char *layout, const char *opt, const char *dtype,
                          const char *extra, const char *steps, const char *const *server_extra)
{
    char world_s[16];
    snprintf(world_s, sizeof(world_s), "%d", world);
    const char *cargs[] = {"--world-size", world_s, NULL};
    char target[64];
    pid_t coord = ps_proc_start_coordinator(coord_bin, cargs, target, sizeof(target));
    if (coord < 0)
        return false;
    char dir[] = "/tmp/pshard-shard-XXXXXX";
    if (!mkdtemp(dir))
        return false;
    pid_t servers[8], trainers[8];
    char addr[8][64];
    bool ok = true;
    for (int r = 0; r < world; r++) {
        char name[32], port_file[128], log[128];
        snprintf(name, sizeof(name), "srv-%d", r);
        snprintf(port_file, sizeof(port_file), "%s/server-%d.port", dir, r);
        snprintf(log, sizeof(log), "%s/server-%d.log", dir, r);
        char *argv[16] = {
            (char *)server_bin, "--coordinator",     target,  "--name", name, "--port-file",
            port_file,          "--coll-timeout-ms", "30000", NULL};
        for (int i = 0, n = 9; server_extra && server_extra[i] && n < 15; i++, n++)
            argv[n] = (char *)server_extra[i];
        servers[r] = ps_proc_spawn(argv, log);
    }
    for (int r = 0; r < world; r++) {
        char port_file[128];
        snprintf(port_file, sizeof(port_file), "%s/server-%d.port", dir, r);
        int port = ps_proc_wait_port_file(port_file, servers[r], 10000);
        if (port < 0) {
            fprintf(stderr, "server %d did not start (log in %s)\n", r, dir);
            ok = false;
        }
        snprintf(addr[r], sizeof(addr[r]), "127.0.0.1:%d", port);
    }
    for (int r = 0; ok && r < world; r++) {
        char rank_s[16];
        snprintf(rank_s, sizeof(rank_s), "%d", r);
        char *argv[] = {(char *)trainer_bin, addr[r],     rank_s,        world_s,
                        (char *)layout,      (char *)opt, (char *)dtype, (char *)steps,
                        (char *)extra,       NULL};
        trainers[r] = ps_proc_spawn(argv, NULL);
    }
    int64_t end = ps_now_ns() + 120 * 1000000000LL;
    for (int r = 0; ok && r < world; r++) {
        int st = 0;
        pid_t got = 0;
        while ((got = waitpid(trainers[r], &st, WNOHANG)) == 0 && ps_now_ns() < end) {
            struct timespec ts = {0, 10 * 1000000};
            nanosleep(&ts, NULL);
        }
        if (got != trainers[r]) {
            fprintf(stderr, "trainer %d hung; killing it\n", r);
            kill(trainers[r], SIGKILL);
            waitpid(trainers[r], &st, 0);
            ok = false;
        } else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "trainer %d failed (status %d); server logs in %s\n", r, st, dir);
            ok = false;
        }
    }
    if (ok && world > 1 && !strstr(extra, "mismatch"))
        ok = check_ahead(addr, world, strstr(extra, "join") != NULL);
    for (int r = 0; r < world; r++) {
        int code = ps_proc_stop(servers[r], 10000);
        if (code != 0) {
            fprintf(stderr, "server %d exited with %d\n", r, code);
            ok = false;
        }
    }
    ps_proc_stop(coord, 10000);
    if (ok) {
        /* Keep the servers' logs only when the case failed. */
        for (int r = 0; r < world; r++) {
            char path[160];
            snprintf(path, sizeof(path), "%s/server-%d.port", dir, r);
            unlink(path);
            snprintf(path, sizeof(path), "%s/server-%d.log", dir, r);
            unlink(path);
        }
        rmdir(dir);
    }
    return ok;
}

static bool run_case(int world, const char *layout, const char *opt, const char *dtype,
                     const char *extra)
{
    return run_case_with(world, layout, opt, dtype, extra, "12", NULL);
}

static void test_one_rank(void)
{
    CU_ASSERT(run_case(1, "fsdp2", "adam", "fp32", ""));
}
static void test_two_ranks_sgd(void)
{
    CU_ASSERT(run_case(2, "fsdp2", "sgd", "fp32", ""));
}
static void test_three_ranks_adam(void)
{
    CU_ASSERT(run_case(3, "fsdp2", "adam", "fp32", ""));
}
static void test_three_ranks_adamw_fsdp1(void)
{
    CU_ASSERT(run_case(3, "fsdp1", "adamw", "fp32", ""));
}
static void test_two_ranks_sgd_fsdp1(void)
{
    CU_ASSERT(run_case(2, "fsdp1", "sgd", "fp32", ""));
}
static void test_bf16_params(void)
{
    CU_ASSERT(run_case(3, "fsdp2", "adamw", "bf16", ""));
}
/* A trainer on "another host": no shared memory, tensors stream over gRPC in 1 MiB chunks. */
static void test_remote_path(void)
{
    setenv("PSHARD_REMOTE", "1", 1);
    CU_ASSERT(run_case(3, "fsdp2", "adam", "fp32", ""));
    CU_ASSERT(run_case(2, "fsdp1", "sgd", "bf16", ""));
    unsetenv("PSHARD_REMOTE");
}

/* stable_param_buffers: each parameter's full buffer at a fixed address (what torch needs);
 * on the shared-memory path a buffer of whole pages shows a pool block while gathered. */
static void test_stable_buffers(void)
{
    setenv("PSHARD_STABLE", "1", 1);
    CU_ASSERT(run_case(2, "fsdp2", "adam", "fp32", ""));
    CU_ASSERT(run_case(3, "fsdp2", "sgd", "bf16", ""));
    setenv("PSHARD_REMOTE", "1", 1);
    CU_ASSERT(run_case(2, "fsdp2", "adam", "fp32", ""));
    unsetenv("PSHARD_REMOTE");
    unsetenv("PSHARD_STABLE");
}

/* optimizer_in_backward: updates at the reduce-scatters, no accumulator; a second
 * reduce-scatter of a parameter in one step is refused. */
static void test_in_backward(void)
{
    CU_ASSERT(run_case(3, "fsdp2", "adam", "fp32", "in_backward"));
    CU_ASSERT(run_case(2, "fsdp1", "sgd", "bf16", "in_backward"));
}

/* Parameter groups: two trained groups with their own lr, weight decay, momentum or betas, all
 * changed at every step, and a frozen parameter that never changes and whose reduce-scatter
 * every rank refuses; clip_grad_norm (norm 2, inf, norm only) before each step. */
static void test_groups(void)
{
    CU_ASSERT(run_case(1, "fsdp2", "adam", "fp32", "groups"));
    CU_ASSERT(run_case(2, "fsdp2", "sgd", "fp32", "groups"));
    CU_ASSERT(run_case(3, "fsdp1", "adamw", "fp32", "groups"));
    CU_ASSERT(run_case(3, "fsdp2", "sgd", "bf16", "groups"));
}

/* The last rank joins before the last step: its server shadows the others' clip_grad_norm and
 * their step with groups. */
static void test_groups_join(void)
{
    CU_ASSERT(run_case(3, "fsdp2", "adam", "fp32", "groups_join"));
    CU_ASSERT(run_case(2, "fsdp1", "sgd", "fp32", "groups_join"));
    /* through the sockets: the join diverts the operations there too */
    setenv("PSHARD_TRANSPORT", "tcp", 1);
    CU_ASSERT(run_case(3, "fsdp2", "adam", "fp32", "groups_join"));
    unsetenv("PSHARD_TRANSPORT");
}

/* optimizer_in_backward with groups: each update uses its parameter's group (as the previous
 * step left them); clip_grad_norm is refused. */
static void test_groups_in_backward(void)
{
    CU_ASSERT(run_case(2, "fsdp2", "adamw", "fp32", "groups_in_backward"));
    CU_ASSERT(run_case(3, "fsdp1", "sgd", "fp32", "groups_in_backward"));
}

/* GPU-resident shards in the tests' host emulation: the device's norms, scaling and
 * per-group optimizer calls. */
static void test_groups_emulated_device(void)
{
    setenv("PSHARD_TEST_EMULATE_DEVICE", "1", 1);
    CU_ASSERT(run_case(3, "fsdp2", "adam", "fp32", "groups"));
    CU_ASSERT(run_case(2, "fsdp1", "sgd", "fp32", "groups_join"));
    unsetenv("PSHARD_TEST_EMULATE_DEVICE");
}

/* A checkpoint of a model with groups (master weights of the frozen parameter included)
 * resumed in the other layout: the trainer replays its reference up to the restored step and
 * trains on. */
static void test_groups_checkpoint_resume(void)
{
    char dir[] = "/tmp/pshard-shard-ckpt-XXXXXX";
    CU_ASSERT_FATAL(mkdtemp(dir) != NULL);
    const char *save[] = {"--checkpoint-dir", dir, "--checkpoint-every", "4", NULL};
    CU_ASSERT(run_case_with(2, "fsdp2", "adam", "fp32", "groups", "8", save));
    const char *resume[] = {"--checkpoint-dir", dir, "--resume", dir, NULL};
    CU_ASSERT(run_case_with(2, "fsdp1", "adam", "fp32", "groups", "12", resume));
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    CU_ASSERT(system(cmd) == 0);
}

static void test_mismatched_definition(void)
{
    CU_ASSERT(run_case(2, "fsdp2", "sgd", "fp32", "mismatch"));
    CU_ASSERT(run_case(2, "fsdp2", "sgd", "fp32", "groups_mismatch"));
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s COORDINATOR SERVER TRAINER\n", argv[0]);
        return 2;
    }
    coord_bin = argv[1];
    server_bin = argv[2];
    trainer_bin = argv[3];
    signal(SIGPIPE, SIG_IGN);
    static const ps_test_case_t cases[] = {
        {"1 rank, fsdp2, adam", test_one_rank},
        {"2 ranks, fsdp2, sgd momentum nesterov", test_two_ranks_sgd},
        {"3 ranks, fsdp2, adam", test_three_ranks_adam},
        {"3 ranks, fsdp1, adamw", test_three_ranks_adamw_fsdp1},
        {"2 ranks, fsdp1, sgd", test_two_ranks_sgd_fsdp1},
        {"3 ranks, bf16 params, adamw", test_bf16_params},
        {"remote path (gRPC streaming, no shared memory)", test_remote_path},
        {"stable parameter buffers (remapped pool blocks)", test_stable_buffers},
        {"optimizer in backward", test_in_backward},
        {"mismatched model definitions are refused", test_mismatched_definition},
        {"parameter groups, frozen parameter, clip_grad_norm", test_groups},
        {"parameter groups with a joined rank", test_groups_join},
        {"parameter groups in backward", test_groups_in_backward},
        {"parameter groups on emulated GPU shards", test_groups_emulated_device},
        {"parameter groups through a checkpoint and resume", test_groups_checkpoint_resume},
        {NULL, NULL},
    };
    return ps_test_main("sharded_training", cases);
}
