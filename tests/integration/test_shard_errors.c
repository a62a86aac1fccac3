/* Bad input and robustness of pshard-server: every malformed or out-of-order trainer request
 * gets a clear gRPC error (status code and a message that says what is wrong) while the server
 * keeps serving (Status, health, and a full valid gather / reduce-scatter / step / collective
 * afterwards). Also: a trainer process killed mid-step makes its peer's reduce-scatter fail with
 * TIMEOUT naming the missing rank instead of hanging, and the --offload/--backend start-up
 * options. The test is its own trainer (raw gRPC with the generated messages, shared memory it
 * creates itself); with `--peer-trainer` it is the second rank's trainer for the kill case.
 * argv: pshard-coordinator pshard-server. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "grpc/health/v1/health.pb-c.h"
#include "ps_coord_client.h"
#include "ps_proc.h"
#include "ps_test.h"
#include "pshard/rpc.h"
#include "pshard/shard.pb-c.h"
#include "pshard/status.h"
#include "pshard/util.h"

static const char *coord_bin, *server_bin;
static char self_bin[PATH_MAX];

/* ---------------------------------------------------------------------------------------- */
/* Shared memory the test creates (names "/pshard-test-<pid>-<n>"), all unlinked at exit.      */

typedef struct {
    char name[64];
    void *base;
    size_t bytes;
} shm_t;

#define MAX_SHM 64
static char made_shm[MAX_SHM][64];
static int shm_seq;

static void shm_unlink_all(void)
{
    for (int i = 0; i < MAX_SHM; i++) {
        if (made_shm[i][0]) {
            shm_unlink(made_shm[i]);
            made_shm[i][0] = '\0';
        }
    }
}

static bool shm_make(shm_t *s, size_t bytes)
{
    memset(s, 0, sizeof(*s));
    snprintf(s->name, sizeof(s->name), "/pshard-test-%d-%d", (int)getpid(), shm_seq++);
    int fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        fprintf(stderr, "shm_open %s: %s\n", s->name, strerror(errno));
        return false;
    }
    for (int i = 0; i < MAX_SHM; i++) {
        if (!made_shm[i][0]) {
            ps_strlcpy(made_shm[i], s->name, sizeof(made_shm[i]));
            break;
        }
    }
    void *p = MAP_FAILED;
    if (ftruncate(fd, (off_t)bytes) == 0)
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        fprintf(stderr, "ftruncate/mmap %s: %s\n", s->name, strerror(errno));
        return false;
    }
    s->base = p;
    s->bytes = bytes;
    return true;
}

static void shm_drop(shm_t *s)
{
    if (s->base)
        munmap(s->base, s->bytes);
    if (s->name[0]) {
        shm_unlink(s->name);
        for (int i = 0; i < MAX_SHM; i++)
            if (strcmp(made_shm[i], s->name) == 0)
                made_shm[i][0] = '\0';
    }
    memset(s, 0, sizeof(*s));
}

/* ---------------------------------------------------------------------------------------- */
/* Calls and expectations                                                                     */

typedef struct {
    pshard_status_t rc;
    int code;
    char err[1024];
    ProtobufCMessage *resp;
} res_t;

static res_t rpc(ps_rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                 const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms)
{
    res_t r;
    memset(&r, 0, sizeof(r));
    r.code = -1;
    char path[96];
    snprintf(path, sizeof(path), "/pshard.ShardServer/%s", method);
    r.rc = ps_rpc_unary(ch, path, req, resp_desc, &r.resp, timeout_ms, 0, &r.code, r.err,
                        sizeof(r.err));
    return r;
}

/* True when the call failed with exactly `st` (and its gRPC code) and a message holding `sub`.
 * Prints what came back otherwise. Frees any response. */
static bool expect_err_(res_t *r, pshard_status_t st, const char *sub, const char *what, int line)
{
    bool ok = r->rc == st && r->code == ps_status_to_grpc(st) && !r->resp &&
              (!sub || strstr(r->err, sub) != NULL);
    if (!ok)
        fprintf(stderr, "  line %d, %s: expected %s (gRPC %d) with \"%s\"; got %s (gRPC %d): %s\n",
                line, what, pshard_status_name(st), ps_status_to_grpc(st), sub ? sub : "",
                pshard_status_name(r->rc), r->code, r->err);
    if (r->resp)
        protobuf_c_message_free_unpacked(r->resp, NULL);
    r->resp = NULL;
    return ok;
}

#define EXPECT_ERR(what, call, st, sub)                                                            \
    do {                                                                                           \
        res_t r_ = (call);                                                                         \
        CU_ASSERT(expect_err_(&r_, (st), (sub), (what), __LINE__));                                \
    } while (0)

/* Returns the response of a successful call (caller frees), or NULL after printing why. */
static ProtobufCMessage *expect_ok_(res_t r, const char *what, int line)
{
    if (r.rc != PSHARD_OK || !r.resp) {
        fprintf(stderr, "  line %d, %s: expected success; got %s (gRPC %d): %s\n", line, what,
                pshard_status_name(r.rc), r.code, r.err);
        if (r.resp)
            protobuf_c_message_free_unpacked(r.resp, NULL);
        return NULL;
    }
    return r.resp;
}
#define EXPECT_OK(what, call) expect_ok_((call), (what), __LINE__)

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

/* Health of `service` on a channel: 1 SERVING, 2 NOT_SERVING, -1 when the call failed. */
static int health(ps_rpc_channel_t *ch, const char *service)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)service;
    ProtobufCMessage *resp = NULL;
    char err[256] = "";
    if (ps_rpc_unary(ch, "/grpc.health.v1.Health/Check", &req.base,
                     &grpc__health__v1__health_check_response__descriptor, &resp, 2000, 0, NULL,
                     err, sizeof(err)) != PSHARD_OK)
        return -1;
    int st = ((Grpc__Health__V1__HealthCheckResponse *)resp)->status;
    protobuf_c_message_free_unpacked(resp, NULL);
    return st;
}

static Pshard__ShardStatusResponse *get_status(ps_rpc_channel_t *ch)
{
    Pshard__ShardStatusRequest req = PSHARD__SHARD_STATUS_REQUEST__INIT;
    return (Pshard__ShardStatusResponse *)EXPECT_OK(
        "Status", rpc(ch, "Status", &req.base, &pshard__shard_status_response__descriptor, 5000));
}

/* ---------------------------------------------------------------------------------------- */
/* Request builders                                                                          */

static res_t do_attach(ps_rpc_channel_t *ch, int rank, const char *name, uint64_t bytes)
{
    Pshard__AttachRequest req = PSHARD__ATTACH_REQUEST__INIT;
    req.rank = rank;
    req.shm_name = (char *)name;
    req.shm_bytes = bytes;
    req.trainer_name = "test_shard_errors";
    return rpc(ch, "Attach", &req.base, &pshard__attach_response__descriptor, 10000);
}

/* Gather (rs false) or ReduceScatter (rs true) of n tensors. */
static res_t do_tensors(ps_rpc_channel_t *ch, bool rs, const char *session, const uint32_t *params,
                        const uint64_t *offsets, size_t n, int dtype, int64_t timeout_ms)
{
    Pshard__TensorRef t[8], *tp[8];
    for (size_t i = 0; i < n && i < 8; i++) {
        pshard__tensor_ref__init(&t[i]);
        t[i].param = params[i];
        t[i].offset = offsets[i];
        tp[i] = &t[i];
    }
    if (rs) {
        Pshard__ReduceScatterRequest req = PSHARD__REDUCE_SCATTER_REQUEST__INIT;
        req.session = (char *)session;
        req.n_tensors = n;
        req.tensors = tp;
        req.dtype = (Pshard__DType)dtype;
        return rpc(ch, "ReduceScatter", &req.base, &pshard__reduce_scatter_response__descriptor,
                   timeout_ms);
    }
    Pshard__GatherRequest req = PSHARD__GATHER_REQUEST__INIT;
    req.session = (char *)session;
    req.n_tensors = n;
    req.tensors = tp;
    req.dtype = (Pshard__DType)dtype;
    return rpc(ch, "Gather", &req.base, &pshard__gather_response__descriptor, timeout_ms);
}

static res_t do_gather1(ps_rpc_channel_t *ch, const char *session, uint32_t param, uint64_t off,
                        int dtype)
{
    return do_tensors(ch, false, session, &param, &off, 1, dtype, 10000);
}

static res_t do_rs1(ps_rpc_channel_t *ch, const char *session, uint32_t param, uint64_t off,
                    int dtype)
{
    return do_tensors(ch, true, session, &param, &off, 1, dtype, 10000);
}

static res_t do_step(ps_rpc_channel_t *ch, const char *session, bool set_lr, double lr)
{
    Pshard__StepRequest req = PSHARD__STEP_REQUEST__INIT;
    req.session = (char *)session;
    req.set_lr = set_lr;
    req.lr = lr;
    return rpc(ch, "Step", &req.base, &pshard__step_response__descriptor, 10000);
}

static res_t do_clip(ps_rpc_channel_t *ch, const char *session, double max_norm, double norm_type)
{
    Pshard__ClipGradNormRequest req = PSHARD__CLIP_GRAD_NORM_REQUEST__INIT;
    req.session = (char *)session;
    req.max_norm = max_norm;
    req.norm_type = norm_type;
    return rpc(ch, "ClipGradNorm", &req.base, &pshard__clip_grad_norm_response__descriptor, 10000);
}

/* A Step carrying n groups (and, with set_lr, an lr too). */
static res_t do_step_groups(ps_rpc_channel_t *ch, const char *session, Pshard__OptimizerGroup *g,
                            size_t n, bool set_lr)
{
    Pshard__OptimizerGroup *gp[8];
    for (size_t i = 0; i < n && i < 8; i++)
        gp[i] = &g[i];
    Pshard__StepRequest req = PSHARD__STEP_REQUEST__INIT;
    req.session = (char *)session;
    req.set_lr = set_lr;
    req.lr = 0.1;
    req.n_groups = n;
    req.groups = gp;
    return rpc(ch, "Step", &req.base, &pshard__step_response__descriptor, 10000);
}

static res_t do_coll_full(ps_rpc_channel_t *ch, const char *session, uint32_t op, int dtype,
                          uint64_t count, uint64_t send_off, uint64_t recv_off, uint32_t reduce,
                          int root)
{
    Pshard__CollectiveRequest req = PSHARD__COLLECTIVE_REQUEST__INIT;
    req.session = (char *)session;
    req.op = op;
    req.reduce = reduce;
    req.root = root;
    req.dtype = (Pshard__DType)dtype;
    req.count = count;
    req.send_offset = send_off;
    req.recv_offset = recv_off;
    return rpc(ch, "Collective", &req.base, &pshard__collective_response__descriptor, 10000);
}

static res_t do_coll_reduce(ps_rpc_channel_t *ch, const char *session, uint32_t op, int dtype,
                            uint64_t count, uint64_t send_off, uint64_t recv_off, uint32_t reduce)
{
    return do_coll_full(ch, session, op, dtype, count, send_off, recv_off, reduce, 0);
}

static res_t do_coll(ps_rpc_channel_t *ch, const char *session, uint32_t op, int dtype,
                     uint64_t count, uint64_t send_off, uint64_t recv_off)
{
    return do_coll_reduce(ch, session, op, dtype, count, send_off, recv_off, 0);
}

/* The test model: "w" [5, 3] and "b" [4]; in the model region, fp32 init values at 0 and 64,
 * gather buffers at 128 and 256, gradient buffers at 384 and 512. */
#define NW 15
#define NB 4
#define OFF_INIT_W 0
#define OFF_INIT_B 64
#define OFF_GATHER_W 128
#define OFF_GATHER_B 256
#define OFF_GRAD_W 384
#define OFF_GRAD_B 512
#define REGION_BYTES 1024
#define SCRATCH_BYTES 4096

static float init_w(size_t i)
{
    return 0.5f + (float)i;
}
static float init_b(size_t i)
{
    return -1.0f - 0.25f * (float)i;
}

static void write_init(const shm_t *region)
{
    float *w = (float *)((uint8_t *)region->base + OFF_INIT_W);
    float *b = (float *)((uint8_t *)region->base + OFF_INIT_B);
    for (size_t i = 0; i < NW; i++)
        w[i] = init_w(i);
    for (size_t i = 0; i < NB; i++)
        b[i] = init_b(i);
}

/* True when the gather buffers of `region` hold the initial values plus delta (exactly when
 * delta is 0, within 1e-4 otherwise). */
static bool gathered_near(const shm_t *region, const char *who, float delta)
{
    const float *w = (const float *)((const uint8_t *)region->base + OFF_GATHER_W);
    const float *b = (const float *)((const uint8_t *)region->base + OFF_GATHER_B);
    for (size_t i = 0; i < NW + NB; i++) {
        float got = i < NW ? w[i] : b[i - NW];
        float want = (i < NW ? init_w(i) : init_b(i - NW)) + delta;
        if (delta == 0.0f ? got != want : !(fabsf(got - want) <= 1e-4f)) {
            fprintf(stderr, "  %s: gathered %s[%zu] = %g, expected %g\n", who, i < NW ? "w" : "b",
                    i < NW ? i : i - NW, (double)got, (double)want);
            return false;
        }
    }
    return true;
}

static bool gathered_ok(const shm_t *region, const char *who)
{
    return gathered_near(region, who, 0.0f);
}

/* Fills the gradient buffers of the model region with g. */
static void write_grads(const shm_t *region, float g)
{
    float *w = (float *)((uint8_t *)region->base + OFF_GRAD_W);
    float *b = (float *)((uint8_t *)region->base + OFF_GRAD_B);
    for (size_t i = 0; i < NW; i++)
        w[i] = g;
    for (size_t i = 0; i < NB; i++)
        b[i] = g;
}

#define MAXP 12
typedef struct {
    Pshard__DefineModelRequest req;
    Pshard__ParamSpec ps[MAXP];
    Pshard__ParamSpec *pp[MAXP];
    int64_t shapes[MAXP][12];
    char names[MAXP][300];
    Pshard__OptimizerConfig opt;
    uint64_t offsets[MAXP];
    Pshard__OptimizerGroup groups[4];
    Pshard__OptimizerGroup *gp[4];
    uint32_t param_groups[MAXP];
} define_t;

/* A valid definition of the test model on `region` (SGD, lr 0.1, fsdp2, INIT_LOCAL). */
static void define_init(define_t *d, const char *session, const shm_t *region)
{
    memset(d, 0, sizeof(*d));
    pshard__define_model_request__init(&d->req);
    d->req.session = (char *)session;
    for (int i = 0; i < MAXP; i++) {
        pshard__param_spec__init(&d->ps[i]);
        d->ps[i].name = d->names[i];
        d->ps[i].shape = d->shapes[i];
        d->pp[i] = &d->ps[i];
    }
    ps_strlcpy(d->names[0], "w", sizeof(d->names[0]));
    d->shapes[0][0] = 5;
    d->shapes[0][1] = 3;
    d->ps[0].n_shape = 2;
    ps_strlcpy(d->names[1], "b", sizeof(d->names[1]));
    d->shapes[1][0] = 4;
    d->ps[1].n_shape = 1;
    d->req.n_params = 2;
    d->req.params = d->pp;
    pshard__optimizer_config__init(&d->opt);
    d->opt.kind = PSHARD__OPTIMIZER_KIND__SGD;
    d->opt.lr = 0.1;
    d->req.optimizer = &d->opt;
    d->req.layout = PSHARD__LAYOUT__FSDP2;
    d->req.init = PSHARD__INIT_MODE__INIT_LOCAL;
    d->req.shm_name = (char *)region->name;
    d->req.shm_bytes = region->bytes;
    d->offsets[0] = OFF_INIT_W;
    d->offsets[1] = OFF_INIT_B;
    d->req.n_init_offsets = 2;
    d->req.init_offsets = d->offsets;
}

static res_t do_define(ps_rpc_channel_t *ch, const define_t *d, int64_t timeout_ms)
{
    return rpc(ch, "DefineModel", &d->req.base, &pshard__define_model_response__descriptor,
               timeout_ms);
}

/* The test model with two SGD groups: "w" in group 0 (lr 0.1, momentum 0.9 when momentum,
 * else 0), "b" in group 1 (lr 0.5, frozen when frozen_b). */
static void define_groups(define_t *d, const char *session, const shm_t *region, bool momentum,
                          bool frozen_b)
{
    define_init(d, session, region);
    d->opt.lr = -1; /* unused with groups */
    for (int i = 0; i < 4; i++) {
        pshard__optimizer_group__init(&d->groups[i]);
        d->gp[i] = &d->groups[i];
    }
    d->groups[0].lr = 0.1;
    d->groups[0].momentum = momentum ? 0.9 : 0.0;
    d->groups[1].lr = 0.5;
    d->groups[1].frozen = frozen_b;
    d->req.n_groups = 2;
    d->req.groups = d->gp;
    d->param_groups[0] = 0;
    d->param_groups[1] = 1;
    d->req.n_param_groups = 2;
    d->req.param_groups = d->param_groups;
}

/* ---------------------------------------------------------------------------------------- */
/* A trainer's state: its scratch and model regions, its session, its step count.             */

typedef struct {
    shm_t scratch, region;
    char session[64];
    bool defined;
    int64_t steps;
} trainer_t;

static void trainer_free(trainer_t *t)
{
    shm_drop(&t->scratch);
    shm_drop(&t->region);
    memset(t, 0, sizeof(*t));
}

static bool trainer_attach(ps_rpc_channel_t *ch, trainer_t *t, int rank, const char *expect_offload)
{
    if (!t->scratch.base && !shm_make(&t->scratch, SCRATCH_BYTES))
        return false;
    if (!t->region.base && !shm_make(&t->region, REGION_BYTES))
        return false;
    Pshard__AttachResponse *a = (Pshard__AttachResponse *)EXPECT_OK(
        "Attach", do_attach(ch, rank, t->scratch.name, t->scratch.bytes));
    if (!a)
        return false;
    bool ok = a->rank == rank && strlen(a->session) > 0 && strlen(a->session) < sizeof(t->session);
    if (expect_offload && strcmp(a->offload, expect_offload) != 0) {
        fprintf(stderr, "  Attach reported offload '%s', expected '%s'\n", a->offload,
                expect_offload);
        ok = false;
    }
    ps_strlcpy(t->session, a->session, sizeof(t->session));
    protobuf_c_message_free_unpacked(&a->base, NULL);
    t->defined = false;
    t->steps = 0;
    return ok;
}

static bool trainer_define(ps_rpc_channel_t *ch, trainer_t *t)
{
    write_init(&t->region);
    define_t d;
    define_init(&d, t->session, &t->region);
    Pshard__DefineModelResponse *r =
        (Pshard__DefineModelResponse *)EXPECT_OK("DefineModel", do_define(ch, &d, 20000));
    if (!r)
        return false;
    bool ok = r->shard_elements == NW + NB && strlen(r->fingerprint) > 0;
    if (!ok)
        fprintf(stderr, "  DefineModel: %" PRIu64 " shard elements\n", r->shard_elements);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    t->defined = ok;
    t->steps = 0;
    return ok;
}

/* The server still serves a world-1 trainer t: Status and health answer, and (when t is attached
 * and defined) a full valid gather, reduce-scatter, step and all-reduce succeed with the right
 * values. Asserts each part. */
static void check_serving_(ps_rpc_channel_t *ch, trainer_t *t, int line)
{
    bool ok = true;
    Pshard__ShardStatusResponse *st = get_status(ch);
    if (!st) {
        ok = false;
    } else {
        if (st->rank != 0 || st->world_size != 1 || !st->name || !st->name[0])
            ok = false;
        if (t && st->attached != (t->session[0] != 0))
            ok = false;
        if (t && t->defined && st->params != 2)
            ok = false;
        if (!ok)
            fprintf(stderr, "  Status: rank %d world %d attached %d params %u\n", st->rank,
                    st->world_size, st->attached, st->params);
        protobuf_c_message_free_unpacked(&st->base, NULL);
    }
    if (health(ch, "pshard.ShardServer") != 1 || health(ch, "") != 1) {
        fprintf(stderr, "  health is not SERVING\n");
        ok = false;
    }
    if (t && t->defined) {
        uint8_t *base = t->region.base;
        memset(base + OFF_GATHER_W, 0xab, OFF_GRAD_W - OFF_GATHER_W);
        const uint32_t ps[2] = {0, 1};
        const uint64_t go[2] = {OFF_GATHER_W, OFF_GATHER_B};
        ProtobufCMessage *r = EXPECT_OK(
            "Gather", do_tensors(ch, false, t->session, ps, go, 2, PSHARD__DTYPE__FP32, 10000));
        if (r)
            protobuf_c_message_free_unpacked(r, NULL);
        if (!r || !gathered_ok(&t->region, "valid Gather"))
            ok = false;
        memset(base + OFF_GRAD_W, 0, REGION_BYTES - OFF_GRAD_W);
        const uint64_t ro[2] = {OFF_GRAD_W, OFF_GRAD_B};
        r = EXPECT_OK("ReduceScatter",
                      do_tensors(ch, true, t->session, ps, ro, 2, PSHARD__DTYPE__FP32, 10000));
        if (r)
            protobuf_c_message_free_unpacked(r, NULL);
        else
            ok = false;
        Pshard__StepResponse *s =
            (Pshard__StepResponse *)EXPECT_OK("Step", do_step(ch, t->session, false, 0));
        if (!s) {
            ok = false;
        } else {
            t->steps++;
            if (s->step != t->steps || s->grad_norm != 0.0) {
                fprintf(stderr,
                        "  Step returned step %" PRId64 " (expected %" PRId64 "), grad norm %g\n",
                        s->step, t->steps, s->grad_norm);
                ok = false;
            }
            protobuf_c_message_free_unpacked(&s->base, NULL);
        }
    }
    if (t && t->session[0]) {
        float *send = (float *)t->scratch.base, *recv = send + 64;
        for (int i = 0; i < 8; i++) {
            send[i] = (float)i * 1.5f + 1.0f;
            recv[i] = 0;
        }
        ProtobufCMessage *r =
            EXPECT_OK("Collective", do_coll(ch, t->session, 3, PSHARD__DTYPE__FP32, 8, 0, 64 * 4));
        if (r)
            protobuf_c_message_free_unpacked(r, NULL);
        else
            ok = false;
        for (int i = 0; r && i < 8; i++) {
            if (recv[i] != send[i]) {
                fprintf(stderr, "  all_reduce over one rank: recv[%d] = %g, expected %g\n", i,
                        (double)recv[i], (double)send[i]);
                ok = false;
                break;
            }
        }
    }
    if (!ok)
        fprintf(stderr, "  (the server stopped serving correctly; checked at line %d)\n", line);
    CU_ASSERT(ok);
}
#define CHECK_SERVING(ch, t) check_serving_((ch), (t), __LINE__)

/* ---------------------------------------------------------------------------------------- */
/* Clusters: a coordinator and `world` shard servers                                          */

typedef struct {
    int world;
    pid_t coord;
    pid_t servers[2];
    char dir[64];
    char addr[2][64];
    char target[64]; /* the coordinator */
    ps_rpc_channel_t *ch[2];
    int rank_of[2]; /* rank of servers[i] */
} cluster_t;

static bool cluster_start(cluster_t *c, int world, const char *const *server_extra)
{
    memset(c, 0, sizeof(*c));
    c->world = world;
    c->coord = -1;
    c->servers[0] = c->servers[1] = -1;
    char world_s[16];
    snprintf(world_s, sizeof(world_s), "%d", world);
    const char *cargs[] = {"--world-size", world_s, NULL};
    char target[64];
    c->coord = ps_proc_start_coordinator(coord_bin, cargs, target, sizeof(target));
    if (c->coord < 0)
        return false;
    ps_strlcpy(c->target, target, sizeof(c->target));
    ps_strlcpy(c->dir, "/tmp/pshard-shard-errors-XXXXXX", sizeof(c->dir));
    if (!mkdtemp(c->dir))
        return false;
    for (int r = 0; r < world; r++) {
        char name[32], port_file[128], log[128];
        snprintf(name, sizeof(name), "srv-%d", r);
        snprintf(port_file, sizeof(port_file), "%s/server-%d.port", c->dir, r);
        snprintf(log, sizeof(log), "%s/server-%d.log", c->dir, r);
        char *argv[32];
        int n = 0;
        argv[n++] = (char *)server_bin;
        argv[n++] = "--coordinator";
        argv[n++] = target;
        argv[n++] = "--name";
        argv[n++] = name;
        argv[n++] = "--port-file";
        argv[n++] = port_file;
        for (int i = 0; server_extra && server_extra[i] && n < 30; i++)
            argv[n++] = (char *)server_extra[i];
        argv[n] = NULL;
        c->servers[r] = ps_proc_spawn(argv, log);
    }
    for (int r = 0; r < world; r++) {
        char port_file[128];
        snprintf(port_file, sizeof(port_file), "%s/server-%d.port", c->dir, r);
        int port = ps_proc_wait_port_file(port_file, c->servers[r], 15000);
        if (port < 0) {
            fprintf(stderr, "server %d did not start (logs in %s)\n", r, c->dir);
            return false;
        }
        snprintf(c->addr[r], sizeof(c->addr[r]), "127.0.0.1:%d", port);
        char err[256] = "";
        ps_rpc_channel_config_t cfg = {.target = c->addr[r], .own_connection = true};
        c->ch[r] = ps_rpc_channel_create(&cfg, err, sizeof(err));
        if (!c->ch[r]) {
            fprintf(stderr, "channel to %s: %s\n", c->addr[r], err);
            return false;
        }
    }
    /* The trainer service is SERVING once the cluster formed and the communicator is built. */
    for (int r = 0; r < world; r++) {
        int64_t end = ps_now_ns() + 60 * 1000000000LL;
        while (health(c->ch[r], "pshard.ShardServer") != 1 && ps_now_ns() < end)
            sleep_ms(20);
        if (health(c->ch[r], "pshard.ShardServer") != 1) {
            fprintf(stderr, "server %d never became SERVING (logs in %s)\n", r, c->dir);
            return false;
        }
        Pshard__ShardStatusResponse *st = get_status(c->ch[r]);
        if (!st)
            return false;
        c->rank_of[r] = st->rank;
        protobuf_c_message_free_unpacked(&st->base, NULL);
    }
    if (world == 2 && c->rank_of[0] == c->rank_of[1]) {
        fprintf(stderr, "both servers report rank %d\n", c->rank_of[0]);
        return false;
    }
    return true;
}

/* Stops everything the cluster started; true when every server exited 0 (clean shutdown, and
 * no leak report under the sanitizers). Removes the logs when all went well. */
static bool cluster_stop(cluster_t *c)
{
    bool ok = true;
    for (int r = 0; r < 2; r++) {
        if (c->ch[r])
            ps_rpc_channel_destroy(c->ch[r]);
        c->ch[r] = NULL;
    }
    for (int r = 0; r < c->world; r++) {
        if (c->servers[r] <= 0)
            continue;
        int code = ps_proc_stop(c->servers[r], 15000);
        if (code != 0) {
            fprintf(stderr, "server %d exited with %d (logs in %s)\n", r, code, c->dir);
            ok = false;
        }
        c->servers[r] = -1;
    }
    if (c->coord > 0)
        ps_proc_stop(c->coord, 10000);
    c->coord = -1;
    if (ok && c->dir[0]) {
        for (int r = 0; r < c->world; r++) {
            char p[128];
            snprintf(p, sizeof(p), "%s/server-%d.log", c->dir, r);
            unlink(p);
            snprintf(p, sizeof(p), "%s/server-%d.port", c->dir, r);
            unlink(p);
        }
        rmdir(c->dir);
    }
    return ok;
}

/* The shared world-1 cluster and its trainer for most cases. */
static cluster_t one;
static bool one_ok;
static trainer_t tr;

/* Makes sure the shared trainer is attached and has the test model defined. */
static bool ensure_trainer(void)
{
    if (!one_ok)
        return false;
    if (tr.session[0] && tr.defined)
        return true;
    if (!tr.session[0] && !trainer_attach(one.ch[0], &tr, 0, "none"))
        return false;
    return trainer_define(one.ch[0], &tr);
}

/* ---------------------------------------------------------------------------------------- */
/* Cases                                                                                     */

static void test_before_attach_and_define(void)
{
    CU_ASSERT_FATAL(one_ok);
    ps_rpc_channel_t *ch = one.ch[0];
    Pshard__ShardStatusResponse *st = get_status(ch);
    CU_ASSERT_FATAL(st != NULL);
    CU_ASSERT(!st->attached); /* the precondition of this case: nobody attached yet */
    CU_ASSERT_STRING_EQUAL(st->offload, "none");
    protobuf_c_message_free_unpacked(&st->base, NULL);
    const pshard_status_t FP = PSHARD_ERR_FAILED_PRECONDITION;

    EXPECT_ERR("Gather before Attach", do_gather1(ch, "", 0, OFF_GATHER_W, PSHARD__DTYPE__FP32), FP,
               "Attach");
    EXPECT_ERR("ReduceScatter before Attach", do_rs1(ch, "", 0, OFF_GRAD_W, PSHARD__DTYPE__FP32),
               FP, "Attach");
    EXPECT_ERR("Step before Attach", do_step(ch, "", false, 0), FP, "Attach");
    EXPECT_ERR("ClipGradNorm before Attach", do_clip(ch, "", 1.0, 2.0), FP, "Attach");
    EXPECT_ERR("Collective before Attach", do_coll(ch, "", 5, PSHARD__DTYPE__FP32, 0, 0, 0), FP,
               "Attach");
    shm_t region;
    CU_ASSERT_FATAL(shm_make(&region, REGION_BYTES));
    write_init(&region);
    define_t d;
    define_init(&d, "0123456789abcdef0123456789abcdef", &region);
    EXPECT_ERR("DefineModel before Attach", do_define(ch, &d, 10000), FP, "Attach");
    define_init(&d, "", &region);
    EXPECT_ERR("DefineModel before Attach, no session", do_define(ch, &d, 10000), FP, "Attach");
    shm_drop(&region);
    CHECK_SERVING(ch, NULL);

    /* Attached, but no model yet. */
    CU_ASSERT_FATAL(trainer_attach(ch, &tr, 0, "none"));
    EXPECT_ERR("Gather before DefineModel",
               do_gather1(ch, tr.session, 0, OFF_GATHER_W, PSHARD__DTYPE__FP32), FP, "DefineModel");
    EXPECT_ERR("ReduceScatter before DefineModel",
               do_rs1(ch, tr.session, 0, OFF_GRAD_W, PSHARD__DTYPE__FP32), FP, "DefineModel");
    EXPECT_ERR("Step before DefineModel", do_step(ch, tr.session, false, 0), FP,
               "no model is defined");
    EXPECT_ERR("ClipGradNorm before DefineModel", do_clip(ch, tr.session, 1.0, 2.0), FP,
               "no model is defined");
    CHECK_SERVING(ch, &tr); /* Status says attached; a plain collective already works */
    CU_ASSERT_FATAL(trainer_define(ch, &tr));
    CHECK_SERVING(ch, &tr);
}

static void test_wrong_session(void)
{
    CU_ASSERT_FATAL(ensure_trainer());
    ps_rpc_channel_t *ch = one.ch[0];
    const pshard_status_t FP = PSHARD_ERR_FAILED_PRECONDITION;
    const char *bad[] = {"deadbeef", "", "0123456789abcdef0123456789abcdef", NULL};
    for (int i = 0; bad[i]; i++) {
        EXPECT_ERR("Gather, wrong session",
                   do_gather1(ch, bad[i], 0, OFF_GATHER_W, PSHARD__DTYPE__FP32), FP, "session");
        EXPECT_ERR("ReduceScatter, wrong session",
                   do_rs1(ch, bad[i], 0, OFF_GRAD_W, PSHARD__DTYPE__FP32), FP, "session");
        EXPECT_ERR("Step, wrong session", do_step(ch, bad[i], false, 0), FP, "session");
        EXPECT_ERR("Collective, wrong session",
                   do_coll(ch, bad[i], 3, PSHARD__DTYPE__FP32, 4, 0, 64), FP, "session");
        define_t d;
        define_init(&d, bad[i], &tr.region);
        EXPECT_ERR("DefineModel, wrong session", do_define(ch, &d, 10000), FP, "session");
    }
    /* The session really is checked: one character off. */
    char off[64];
    ps_strlcpy(off, tr.session, sizeof(off));
    off[0] = off[0] == '0' ? '1' : '0';
    EXPECT_ERR("Gather, session one character off",
               do_gather1(ch, off, 0, OFF_GATHER_W, PSHARD__DTYPE__FP32), FP, "session");
    CHECK_SERVING(ch, &tr);

    /* Another trainer attaching replaces the session: the old one is refused from then on. */
    char old[64];
    ps_strlcpy(old, tr.session, sizeof(old));
    CU_ASSERT_FATAL(trainer_attach(ch, &tr, 0, "none"));
    CU_ASSERT(strcmp(old, tr.session) != 0);
    EXPECT_ERR("Gather with the replaced session",
               do_gather1(ch, old, 0, OFF_GATHER_W, PSHARD__DTYPE__FP32), FP, "session");
    EXPECT_ERR("Step with the replaced session", do_step(ch, old, false, 0), FP, "session");
    CU_ASSERT_FATAL(trainer_define(ch, &tr));
    CHECK_SERVING(ch, &tr);
}

static res_t do_attach_as(ps_rpc_channel_t *ch, const char *member, const char *trainer,
                          const char *shm, uint64_t bytes)
{
    Pshard__AttachRequest req = PSHARD__ATTACH_REQUEST__INIT;
    req.rank = 0;
    req.shm_name = (char *)shm;
    req.shm_bytes = bytes;
    req.trainer_name = (char *)trainer;
    req.member_name = (char *)member;
    return rpc(ch, "Attach", &req.base, &pshard__attach_response__descriptor, 10000);
}

/* Attach from a second token holder must not take a rank from a running trainer (it used to
 * replace the session and kill the job): refused while the coordinator holds the attached
 * trainer's lease, allowed once that trainer has left. */
static void test_attach_refused_while_trainer_lives(void)
{
    cluster_t c;
    CU_ASSERT_FATAL(cluster_start(&c, 1, NULL));
    shm_t a, b;
    CU_ASSERT_FATAL(shm_make(&a, 4096) && shm_make(&b, 4096));
    res_t r = do_attach_as(c.ch[0], "trainer-0", "first", a.name, 4096);
    CU_ASSERT_EQUAL_FATAL(r.rc, PSHARD_OK);
    protobuf_c_message_free_unpacked(r.resp, NULL);
    /* The first trainer's lease, as libpshard registers it. */
    char err[256] = "", id[64];
    ps_rpc_channel_config_t cc = {.target = c.target};
    ps_rpc_channel_t *coord = ps_rpc_channel_create(&cc, err, sizeof(err));
    CU_ASSERT_FATAL(
        coord && ps_coord_register(coord, PSHARD__ROLE__TRAINER, "trainer-0", "", id, sizeof(id)));
    /* Once the server has seen that lease (on Watch), a second Attach is refused. */
    int64_t end = ps_now_ns() + 10 * 1000000000LL;
    do {
        r = do_attach_as(c.ch[0], "trainer-0", "second", b.name, 4096);
        if (r.rc == PSHARD_OK)
            protobuf_c_message_free_unpacked(r.resp, NULL);
        if (r.rc == PSHARD_ERR_ALREADY_EXISTS)
            break;
        sleep_ms(50);
    } while (ps_now_ns() < end);
    CU_ASSERT_EQUAL(r.rc, PSHARD_ERR_ALREADY_EXISTS);
    CU_ASSERT_PTR_NOT_NULL(strstr(r.err, "attached to a live trainer (trainer-0"));
    if (r.rc != PSHARD_ERR_ALREADY_EXISTS)
        fprintf(stderr, "  second Attach: %s (%s)\n", pshard_status_name(r.rc), r.err);
    /* The first trainer leaves: the rank is free for the next one. */
    Pshard__LeaveRequest lv = PSHARD__LEAVE_REQUEST__INIT;
    lv.member_id = id;
    lv.lease_key = (char *)ps_coord_lease_key(id);
    ProtobufCMessage *resp = NULL;
    CU_ASSERT_EQUAL(ps_rpc_unary(coord, "/pshard.Coordinator/Leave", &lv.base,
                                 &pshard__leave_response__descriptor, &resp, 5000, 0, NULL, err,
                                 sizeof(err)),
                    PSHARD_OK);
    if (resp)
        protobuf_c_message_free_unpacked(resp, NULL);
    end = ps_now_ns() + 10 * 1000000000LL;
    do {
        r = do_attach_as(c.ch[0], "trainer-0", "second", b.name, 4096);
        if (r.rc == PSHARD_OK)
            break;
        sleep_ms(50);
    } while (ps_now_ns() < end);
    CU_ASSERT_EQUAL(r.rc, PSHARD_OK);
    if (r.rc == PSHARD_OK)
        protobuf_c_message_free_unpacked(r.resp, NULL);
    ps_rpc_channel_destroy(coord);
    shm_drop(&a);
    shm_drop(&b);
    CU_ASSERT(cluster_stop(&c));
}

static void test_attach_bad(void)
{
    CU_ASSERT_FATAL(ensure_trainer());
    ps_rpc_channel_t *ch = one.ch[0];
    const pshard_status_t IA = PSHARD_ERR_INVALID_ARGUMENT;
    shm_t obj;
    CU_ASSERT_FATAL(shm_make(&obj, 4096));

    EXPECT_ERR("Attach, wrong rank", do_attach(ch, 1, obj.name, 4096), IA,
               "trainer rank 1 attached to the shard server of rank 0");
    EXPECT_ERR("Attach, negative rank", do_attach(ch, -1, obj.name, 4096), IA, "rank -1");
    EXPECT_ERR("Attach ../etc", do_attach(ch, 0, "../etc", 4096), IA, "\"/pshard-...\"");
    EXPECT_ERR("Attach /other-name", do_attach(ch, 0, "/other-name", 4096), IA, "\"/pshard-...\"");
    /* An empty name asks for the remote path (a private region); its size is still checked. */
    EXPECT_ERR("Attach, remote with 0 bytes", do_attach(ch, 0, "", 0), IA, "out of range");
    EXPECT_ERR("Attach, remote with 2^50 bytes", do_attach(ch, 0, "", 1ull << 50), IA,
               "out of range");
    EXPECT_ERR("Attach /pshard-", do_attach(ch, 0, "/pshard-", 4096), IA, "\"/pshard-...\"");
    char longname[400] = "/pshard-";
    memset(longname + 8, 'a', 300);
    longname[308] = '\0';
    EXPECT_ERR("Attach, name too long", do_attach(ch, 0, longname, 4096), IA, "at most");
    EXPECT_ERR("Attach, path in the name", do_attach(ch, 0, "/pshard-a/../../etc/passwd", 4096), IA,
               "invalid character");
    EXPECT_ERR("Attach, space in the name", do_attach(ch, 0, "/pshard-a b", 4096), IA,
               "invalid character");
    EXPECT_ERR("Attach, 0 bytes", do_attach(ch, 0, obj.name, 0), IA, "out of range");
    EXPECT_ERR("Attach, 2^50 bytes", do_attach(ch, 0, obj.name, 1ull << 50), IA, "out of range");
    EXPECT_ERR("Attach, larger than the object", do_attach(ch, 0, obj.name, 8192), IA,
               "smaller than the 8192 bytes");
    char missing[64];
    snprintf(missing, sizeof(missing), "/pshard-test-%d-missing", (int)getpid());
    EXPECT_ERR("Attach, no such object", do_attach(ch, 0, missing, 4096), PSHARD_ERR_NOT_FOUND,
               "cannot open");
    /* A symbolic link under /dev/shm is not followed (O_NOFOLLOW). */
    char link_name[64], link_path[96], target_path[96];
    snprintf(link_name, sizeof(link_name), "/pshard-test-%d-link", (int)getpid());
    snprintf(link_path, sizeof(link_path), "/dev/shm%s", link_name);
    snprintf(target_path, sizeof(target_path), "/dev/shm%s", obj.name);
    if (symlink(target_path, link_path) == 0) {
        EXPECT_ERR("Attach, symbolic link", do_attach(ch, 0, link_name, 4096), PSHARD_ERR_NOT_FOUND,
                   "cannot open");
        unlink(link_path);
    } else {
        fprintf(stderr, "  (no symlink case: %s: %s)\n", link_path, strerror(errno));
    }
    shm_drop(&obj);
    /* None of that disturbed the attached trainer. */
    CHECK_SERVING(ch, &tr);
}

typedef void (*define_mut_fn)(define_t *d);

static void mut_empty(define_t *d)
{
    d->req.n_params = 0;
    d->req.n_init_offsets = 0;
}
static void mut_duplicate(define_t *d)
{
    ps_strlcpy(d->names[1], "w", sizeof(d->names[1]));
}
static void mut_space(define_t *d)
{
    ps_strlcpy(d->names[1], "my bias", sizeof(d->names[1]));
}
static void mut_empty_name(define_t *d)
{
    d->names[0][0] = '\0';
}
static void mut_long_name(define_t *d)
{
    memset(d->names[0], 'n', 256);
    d->names[0][256] = '\0';
}
static void mut_nine_dims(define_t *d)
{
    for (int i = 0; i < 9; i++)
        d->shapes[0][i] = 1;
    d->ps[0].n_shape = 9;
}
static void mut_no_dims(define_t *d)
{
    d->ps[1].n_shape = 0;
}
static void mut_zero_dim(define_t *d)
{
    d->shapes[0][1] = 0;
}
static void mut_negative_dim(define_t *d)
{
    d->shapes[1][0] = -4;
}
static void mut_overflow(define_t *d)
{
    d->shapes[0][0] = 1ll << 40;
    d->shapes[0][1] = 1ll << 40;
    d->shapes[0][2] = 1ll << 40;
    d->ps[0].n_shape = 3;
}
static void mut_huge_dim(define_t *d)
{
    d->shapes[1][0] = INT64_MAX;
}
static void mut_too_large(define_t *d)
{
    d->shapes[0][0] = 1ll << 40; /* 2^57 elements: valid, but no machine can allocate them */
    d->shapes[0][1] = 1ll << 17;
}
static void mut_optimizer_enum(define_t *d)
{
    d->opt.kind = (Pshard__OptimizerKind)7;
}
static void mut_layout_enum(define_t *d)
{
    d->req.layout = (Pshard__Layout)5;
}
static void mut_negative_lr(define_t *d)
{
    d->opt.lr = -0.1;
}
static void mut_nan_lr(define_t *d)
{
    d->opt.lr = NAN;
}
static void adam(define_t *d)
{
    d->opt.kind = PSHARD__OPTIMIZER_KIND__ADAM;
    d->opt.lr = 0.001;
    d->opt.beta1 = 0.9;
    d->opt.beta2 = 0.999;
    d->opt.eps = 1e-8;
}
static void mut_beta1(define_t *d)
{
    adam(d);
    d->opt.beta1 = 1.0;
}
static void mut_beta2(define_t *d)
{
    adam(d);
    d->opt.kind = PSHARD__OPTIMIZER_KIND__ADAMW;
    d->opt.beta2 = 1.5;
}
static void mut_negative_eps(define_t *d)
{
    adam(d);
    d->opt.eps = -1e-8;
}
static void mut_negative_momentum(define_t *d)
{
    d->opt.momentum = -0.9;
}
static void mut_negative_wd(define_t *d)
{
    d->opt.weight_decay = -0.01;
}
static void mut_nesterov(define_t *d)
{
    d->opt.nesterov = true;
}
static void mut_clip(define_t *d)
{
    d->opt.max_grad_norm = -1;
}
static void mut_in_backward_clip(define_t *d)
{
    d->opt.in_backward = true;
    d->opt.max_grad_norm = 1.0;
}
static void mut_no_offsets(define_t *d)
{
    d->req.n_init_offsets = 0;
}
static void mut_one_offset(define_t *d)
{
    d->req.n_init_offsets = 1;
}
static void mut_no_offsets_rank0(define_t *d)
{
    d->req.init = PSHARD__INIT_MODE__INIT_FROM_RANK0;
    d->req.n_init_offsets = 0;
}
static void mut_offset_outside(define_t *d)
{
    d->offsets[1] = REGION_BYTES - 8; /* 16 bytes of b at 1016 */
}
static void mut_offset_wrap(define_t *d)
{
    d->offsets[0] = UINT64_MAX - 7;
}
static void mut_offset_misaligned(define_t *d)
{
    d->offsets[1] = OFF_INIT_B + 2;
}
static void mut_region_name(define_t *d)
{
    d->req.shm_name = "/tmp/model";
}
static void mut_region_zero(define_t *d)
{
    d->req.shm_bytes = 0;
}
static void mut_region_larger(define_t *d)
{
    d->req.shm_bytes = REGION_BYTES * 2;
}
static char missing_region[64];
static void mut_region_missing(define_t *d)
{
    d->req.shm_name = missing_region;
}

static void test_define_bad(void)
{
    CU_ASSERT_FATAL(ensure_trainer());
    ps_rpc_channel_t *ch = one.ch[0];
    snprintf(missing_region, sizeof(missing_region), "/pshard-test-%d-nomodel", (int)getpid());
    const pshard_status_t IA = PSHARD_ERR_INVALID_ARGUMENT;
    static const struct {
        const char *what;
        define_mut_fn fn;
        pshard_status_t st;
        const char *sub;
    } cases[] = {
        {"empty model", mut_empty, IA, "no parameters"},
        {"duplicate names", mut_duplicate, IA, "parameter name 'w' is used twice"},
        {"name with a space", mut_space, IA, "space"},
        {"empty name", mut_empty_name, IA, "name must be 1..255 bytes"},
        {"256-byte name", mut_long_name, IA, "name must be 1..255 bytes"},
        {"9 dimensions", mut_nine_dims, IA, "9 dimensions"},
        {"no dimensions", mut_no_dims, IA, "0 dimensions"},
        {"a zero dimension", mut_zero_dim, IA, "dimension 1 is 0"},
        {"a negative dimension", mut_negative_dim, IA, "dimension 0 is -4"},
        {"overflowing shape", mut_overflow, IA, "fit in memory"},
        {"INT64_MAX dimension", mut_huge_dim, IA, "fit in memory"},
        {"too large for the region", mut_too_large, IA, "'w' lie outside the model region"},
        {"unknown optimizer", mut_optimizer_enum, IA, "unknown optimizer 7"},
        {"unknown layout", mut_layout_enum, IA, "unknown layout 5"},
        {"negative lr", mut_negative_lr, IA, "learning rate"},
        {"NaN lr", mut_nan_lr, IA, "learning rate"},
        {"beta1 = 1", mut_beta1, IA, "beta parameter at index 0"},
        {"beta2 = 1.5", mut_beta2, IA, "beta parameter at index 1"},
        {"negative eps", mut_negative_eps, IA, "epsilon"},
        {"negative momentum", mut_negative_momentum, IA, "momentum"},
        {"negative weight decay", mut_negative_wd, IA, "weight_decay"},
        {"nesterov without momentum", mut_nesterov, IA, "Nesterov"},
        {"negative max_grad_norm", mut_clip, IA, "max_grad_norm"},
        {"clipping with optimizer_in_backward", mut_in_backward_clip, IA, "it cannot clip"},
        {"init offsets missing", mut_no_offsets, IA, "init_offsets has 0 entries for 2"},
        {"one init offset for two params", mut_one_offset, IA, "init_offsets has 1 entries for 2"},
        {"init offsets missing (from rank 0)", mut_no_offsets_rank0, IA,
         "init_offsets has 0 entries"},
        {"init offset outside the region", mut_offset_outside, IA,
         "init values of 'b' lie outside the model region"},
        {"init offset wrapping around", mut_offset_wrap, IA,
         "init values of 'w' lie outside the model region"},
        {"init offset misaligned", mut_offset_misaligned, IA, "'b' lie outside"},
        {"model region not /pshard-", mut_region_name, IA, "\"/pshard-...\""},
        {"model region of 0 bytes", mut_region_zero, IA, "out of range"},
        {"model region larger than the object", mut_region_larger, IA, "smaller than"},
        {"model region missing", mut_region_missing, PSHARD_ERR_NOT_FOUND, "cannot open"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        define_t d;
        define_init(&d, tr.session, &tr.region);
        cases[i].fn(&d);
        char what[128];
        snprintf(what, sizeof(what), "DefineModel, %s", cases[i].what);
        EXPECT_ERR(what, do_define(ch, &d, 10000), cases[i].st, cases[i].sub);
    }
    /* Too many parameters (the limit is 100000). */
    {
        size_t n = 100001;
        Pshard__ParamSpec *ps = calloc(n, sizeof(*ps));
        Pshard__ParamSpec **pp = calloc(n, sizeof(*pp));
        char(*names)[16] = calloc(n, sizeof(*names));
        int64_t one_dim = 1;
        CU_ASSERT_FATAL(ps && pp && names);
        for (size_t i = 0; i < n; i++) {
            pshard__param_spec__init(&ps[i]);
            snprintf(names[i], sizeof(names[i]), "p%zu", i);
            ps[i].name = names[i];
            ps[i].n_shape = 1;
            ps[i].shape = &one_dim;
            pp[i] = &ps[i];
        }
        define_t d;
        define_init(&d, tr.session, &tr.region);
        d.req.n_params = n;
        d.req.params = pp;
        d.req.n_init_offsets = 0;
        EXPECT_ERR("DefineModel, 100001 parameters", do_define(ch, &d, 20000), IA,
                   "the limit is 100000");
        free(names);
        free(pp);
        free(ps);
    }
    /* The model defined before is intact and still served. */
    CHECK_SERVING(ch, &tr);
}

static long vmhwm_kb(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "re");
    long kb = -1;
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "VmHWM: %ld", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb;
}

/* A definition is validated before anything of its size is allocated: a 2^27-element parameter
 * with a bad init offset is refused without the server touching its 1.5 GB of state, and a
 * model (or region) larger than --max-model-memory is refused by size. */
static void test_define_memory(void)
{
    CU_ASSERT_FATAL(ensure_trainer());
    long before = vmhwm_kb(one.servers[0]);
    define_t d;
    define_init(&d, tr.session, &tr.region);
    d.shapes[0][0] = 1ll << 27;
    d.ps[0].n_shape = 1;
    d.offsets[0] = 64; /* 512 MiB of values cannot lie in a 1 KiB region */
    EXPECT_ERR("DefineModel, 2^27 elements outside the region", do_define(one.ch[0], &d, 20000),
               PSHARD_ERR_INVALID_ARGUMENT, "init values of 'w' lie outside the model region");
    long after = vmhwm_kb(one.servers[0]);
    if (after - before > 32 * 1024)
        fprintf(stderr, "\n  the refused DefineModel grew the server's VmHWM from %ld to %ld kB\n",
                before, after);
    CU_ASSERT(before > 0 && after - before <= 32 * 1024);
    CHECK_SERVING(one.ch[0], &tr);

    cluster_t c;
    const char *args[] = {"--max-model-memory", "65536", NULL};
    bool up = cluster_start(&c, 1, args);
    CU_ASSERT_FATAL(up);
    trainer_t t;
    memset(&t, 0, sizeof(t));
    CU_ASSERT_FATAL(trainer_attach(c.ch[0], &t, 0, NULL));
    shm_t big;
    CU_ASSERT_FATAL(shm_make(&big, 65536));
    /* Adam on 4096 elements: 4 sections of 16 KiB, staging and one full parameter = 96 KiB. */
    define_init(&d, t.session, &big);
    d.opt.kind = PSHARD__OPTIMIZER_KIND__ADAM;
    d.opt.beta1 = 0.9;
    d.opt.beta2 = 0.999;
    d.opt.eps = 1e-8;
    d.opt.lr = 1e-3;
    d.shapes[0][0] = 4096;
    d.ps[0].n_shape = 1;
    d.offsets[0] = 0;
    d.offsets[1] = 4096 * 4;
    EXPECT_ERR("DefineModel beyond --max-model-memory", do_define(c.ch[0], &d, 20000),
               PSHARD_ERR_RESOURCE_EXHAUSTED, "--max-model-memory");
    /* 2048 elements with SGD fit: 2 sections of 8 KiB, staging and one parameter = 32 KiB. */
    d.opt.kind = PSHARD__OPTIMIZER_KIND__SGD;
    d.opt.lr = 0.1;
    d.shapes[0][0] = 2048;
    d.offsets[1] = 2048 * 4;
    ProtobufCMessage *r =
        EXPECT_OK("DefineModel within --max-model-memory", do_define(c.ch[0], &d, 20000));
    if (r)
        protobuf_c_message_free_unpacked(r, NULL);
    shm_t huge;
    CU_ASSERT_FATAL(shm_make(&huge, 65536 * 2));
    define_init(&d, t.session, &huge);
    EXPECT_ERR("DefineModel, a region beyond --max-model-memory", do_define(c.ch[0], &d, 20000),
               PSHARD_ERR_RESOURCE_EXHAUSTED, "model region of 131072 bytes");
    shm_drop(&huge);
    shm_drop(&big);
    trainer_free(&t);
    CU_ASSERT(cluster_stop(&c));
}

/* A DefineModel that is refused must not change what the attached trainer has: here the
 * refused definition names a second (valid) model region, then fails on its init offsets. The
 * previous model must still gather into the previous region. */
static void test_define_refused_keeps_state(void)
{
    CU_ASSERT_FATAL(ensure_trainer());
    ps_rpc_channel_t *ch = one.ch[0];
    shm_t other;
    CU_ASSERT_FATAL(shm_make(&other, REGION_BYTES));
    memset(other.base, 0, other.bytes);
    define_t d;
    define_init(&d, tr.session, &other);
    d.offsets[0] = 4096; /* outside: refused after the region was mapped */
    EXPECT_ERR("DefineModel, second region, init outside", do_define(ch, &d, 10000),
               PSHARD_ERR_INVALID_ARGUMENT, "outside the model region");
    const float *w = (const float *)((uint8_t *)other.base + OFF_GATHER_W);
    CHECK_SERVING(ch, &tr);
    if (w[0] != 0.0f)
        fprintf(stderr,
                "  BUG: the gather after the refused DefineModel wrote into the refused "
                "region %s (w[0] = %g there)\n",
                other.name, (double)w[0]);
    CU_ASSERT(w[0] == 0.0f);
    shm_drop(&other);
    /* Leave a clean state for the next cases whatever happened. */
    CU_ASSERT(trainer_define(ch, &tr));
}

static void test_tensors_bad(void)
{
    CU_ASSERT_FATAL(ensure_trainer());
    ps_rpc_channel_t *ch = one.ch[0];
    const pshard_status_t IA = PSHARD_ERR_INVALID_ARGUMENT, NF = PSHARD_ERR_NOT_FOUND;
    const char *s = tr.session;
    const int F32 = PSHARD__DTYPE__FP32, BF16 = PSHARD__DTYPE__BF16;

    EXPECT_ERR("Gather, unknown param", do_gather1(ch, s, 2, OFF_GATHER_W, F32), NF,
               "unknown parameter #2 (the model has 2)");
    EXPECT_ERR("Gather, param 2^32-1", do_gather1(ch, s, UINT32_MAX, OFF_GATHER_W, F32), NF,
               "unknown parameter #4294967295");
    EXPECT_ERR("Gather, buffer past the end", do_gather1(ch, s, 0, REGION_BYTES - 56, F32), IA,
               "outside the model region");
    EXPECT_ERR("Gather, offset = region size", do_gather1(ch, s, 1, REGION_BYTES, F32), IA,
               "outside");
    EXPECT_ERR("Gather, offset wrapping around", do_gather1(ch, s, 1, UINT64_MAX - 3, F32), IA,
               "outside");
    EXPECT_ERR("Gather, misaligned fp32", do_gather1(ch, s, 0, OFF_GATHER_W + 2, F32), IA,
               "misaligned");
    EXPECT_ERR("Gather, misaligned bf16", do_gather1(ch, s, 0, OFF_GATHER_W + 1, BF16), IA,
               "misaligned");
    EXPECT_ERR("Gather, int64", do_gather1(ch, s, 0, OFF_GATHER_W, PSHARD__DTYPE__INT64), IA,
               "param dtype must be fp32, bf16 or fp16");
    EXPECT_ERR("Gather, unknown dtype", do_gather1(ch, s, 0, OFF_GATHER_W, 9), IA,
               "param dtype must be");
    EXPECT_ERR("Gather, no tensors", do_tensors(ch, false, s, NULL, NULL, 0, F32, 10000), IA,
               "no tensors");
    /* One good and one bad tensor: refused as a whole, the good buffer untouched. */
    {
        uint8_t *g = (uint8_t *)tr.region.base + OFF_GATHER_W;
        memset(g, 0x5a, NW * 4);
        const uint32_t ps[2] = {0, 1};
        const uint64_t offs[2] = {OFF_GATHER_W, REGION_BYTES - 4};
        EXPECT_ERR("Gather, second tensor outside",
                   do_tensors(ch, false, s, ps, offs, 2, F32, 10000), IA, "'b'");
        bool untouched = true;
        for (size_t i = 0; i < NW * 4; i++)
            untouched = untouched && g[i] == 0x5a;
        CU_ASSERT(untouched);
    }
    EXPECT_ERR("ReduceScatter, fp16", do_rs1(ch, s, 0, OFF_GRAD_W, PSHARD__DTYPE__FP16), IA,
               "reduce dtype must be fp32 or bf16");
    EXPECT_ERR("ReduceScatter, int64", do_rs1(ch, s, 0, OFF_GRAD_W, PSHARD__DTYPE__INT64), IA,
               "reduce dtype must be fp32 or bf16");
    EXPECT_ERR("ReduceScatter, unknown param", do_rs1(ch, s, 5, OFF_GRAD_W, F32), NF,
               "unknown parameter #5");
    EXPECT_ERR("ReduceScatter, buffer past the end", do_rs1(ch, s, 0, REGION_BYTES - 4, F32), IA,
               "outside the model region");
    EXPECT_ERR("ReduceScatter, misaligned", do_rs1(ch, s, 1, OFF_GRAD_B + 1, F32), IA,
               "misaligned");
    EXPECT_ERR("ReduceScatter, no tensors", do_tensors(ch, true, s, NULL, NULL, 0, F32, 10000), IA,
               "no tensors");
    EXPECT_ERR("Step, negative lr", do_step(ch, s, true, -0.5), IA, "learning rate");
    EXPECT_ERR("Step, NaN lr", do_step(ch, s, true, NAN), IA, "learning rate");
    EXPECT_ERR("Step, infinite lr", do_step(ch, s, true, INFINITY), IA, "learning rate");
    CHECK_SERVING(ch, &tr);
}

typedef void (*groups_mut_fn)(define_t *d);

static void gmut_index(define_t *d)
{
    d->param_groups[1] = 2;
}
static void gmut_index_max(define_t *d)
{
    d->param_groups[0] = UINT32_MAX;
}
static void gmut_short(define_t *d)
{
    d->req.n_param_groups = 1;
}
static void gmut_no_assignment(define_t *d)
{
    d->req.n_param_groups = 0;
}
static void gmut_assignment_only(define_t *d)
{
    d->req.n_groups = 0;
}
static void gmut_lr(define_t *d)
{
    d->groups[1].lr = -0.5;
}
static void gmut_nan_momentum(define_t *d)
{
    d->groups[0].momentum = NAN;
}
static void gmut_nesterov(define_t *d)
{
    d->groups[1].nesterov = true;
}
static void gmut_adam_beta(define_t *d)
{
    d->opt.kind = PSHARD__OPTIMIZER_KIND__ADAM;
    d->groups[0].beta1 = 0.9;
    d->groups[0].beta2 = 0.999;
    d->groups[1].beta1 = 0.9;
    d->groups[1].beta2 = 1.0;
}

/* Parameter groups: refused definitions, refused Steps (wrong count, frozen changed, lr and
 * groups together, invalid values, momentum without buffers), the frozen parameter's
 * ReduceScatter refused, and a frozen parameter that never changes while the other trains. */
static void test_groups_bad(void)
{
    CU_ASSERT_FATAL(ensure_trainer());
    ps_rpc_channel_t *ch = one.ch[0];
    const pshard_status_t IA = PSHARD_ERR_INVALID_ARGUMENT, FP = PSHARD_ERR_FAILED_PRECONDITION;
    const char *s = tr.session;
    static const struct {
        const char *what;
        groups_mut_fn fn;
        const char *sub;
    } cases[] = {
        {"group index out of range", gmut_index,
         "parameter 'b' is assigned to group 2, but there are 2 groups"},
        {"group index 2^32-1", gmut_index_max, "parameter 'w' is assigned to group 4294967295"},
        {"param_groups too short", gmut_short, "param_groups has 1 entries for 2 parameters"},
        {"groups without param_groups", gmut_no_assignment,
         "param_groups has 0 entries for 2 parameters"},
        {"param_groups without groups", gmut_assignment_only, "no groups are defined"},
        {"a group's negative lr", gmut_lr, "group 1: Invalid learning rate"},
        {"a group's NaN momentum", gmut_nan_momentum, "group 0: Invalid momentum"},
        {"a group's nesterov without momentum", gmut_nesterov, "group 1: Nesterov"},
        {"a group's beta2 = 1", gmut_adam_beta, "group 1: Invalid beta parameter at index 1"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        define_t d;
        define_groups(&d, s, &tr.region, true, true);
        cases[i].fn(&d);
        char what[128];
        snprintf(what, sizeof(what), "DefineModel, %s", cases[i].what);
        EXPECT_ERR(what, do_define(ch, &d, 10000), IA, cases[i].sub);
    }
    /* 1025 groups: over the limit. */
    {
        size_t n = 1025;
        Pshard__OptimizerGroup *g = calloc(n, sizeof(*g));
        Pshard__OptimizerGroup **gp = calloc(n, sizeof(*gp));
        CU_ASSERT_FATAL(g && gp);
        for (size_t i = 0; i < n; i++) {
            pshard__optimizer_group__init(&g[i]);
            gp[i] = &g[i];
        }
        define_t d;
        define_groups(&d, s, &tr.region, true, true);
        d.req.n_groups = n;
        d.req.groups = gp;
        EXPECT_ERR("DefineModel, 1025 groups", do_define(ch, &d, 10000), IA,
                   "1025 parameter groups; the limit is 1024");
        free(gp);
        free(g);
    }
    CHECK_SERVING(ch, &tr); /* the model defined before is untouched */

    /* A model whose "b" is frozen. */
    write_init(&tr.region);
    define_t d;
    define_groups(&d, s, &tr.region, true, true);
    ProtobufCMessage *r = EXPECT_OK("DefineModel with groups", do_define(ch, &d, 10000));
    CU_ASSERT_FATAL(r != NULL);
    protobuf_c_message_free_unpacked(r, NULL);
    tr.defined = false; /* not the standard model any more */
    EXPECT_ERR("ReduceScatter of the frozen 'b'", do_rs1(ch, s, 1, OFF_GRAD_B, PSHARD__DTYPE__FP32),
               FP, "'b' is frozen");
    {
        const uint32_t ps[2] = {0, 1};
        const uint64_t ro[2] = {OFF_GRAD_W, OFF_GRAD_B};
        EXPECT_ERR("ReduceScatter of 'w' and the frozen 'b'",
                   do_tensors(ch, true, s, ps, ro, 2, PSHARD__DTYPE__FP32, 10000), FP,
                   "'b' is frozen");
    }
    Pshard__OptimizerGroup g[3];
    for (int i = 0; i < 3; i++) {
        pshard__optimizer_group__init(&g[i]);
        g[i].lr = 0.1;
        g[i].momentum = 0.9;
    }
    g[1].frozen = true;
    EXPECT_ERR("Step with 1 group of 2", do_step_groups(ch, s, g, 1, false), IA,
               "1 parameter groups given; the model was defined with 2");
    EXPECT_ERR("Step with 3 groups of 2", do_step_groups(ch, s, g, 3, false), IA,
               "3 parameter groups given");
    EXPECT_ERR("Step with groups and lr", do_step_groups(ch, s, g, 2, true), IA, "either groups");
    g[1].frozen = false;
    EXPECT_ERR("Step unfreezing group 1", do_step_groups(ch, s, g, 2, false), IA,
               "group 1: frozen cannot change");
    g[1].frozen = true;
    g[0].lr = -1;
    EXPECT_ERR("Step with a negative group lr", do_step_groups(ch, s, g, 2, false), IA,
               "group 0: Invalid learning rate");
    g[0].lr = INFINITY;
    g[0].momentum = -0.5;
    EXPECT_ERR("Step with a negative group momentum", do_step_groups(ch, s, g, 2, false), IA,
               "group 0: Invalid momentum");
    g[0].momentum = 0.9;
    g[0].lr = 0.1;
    /* A training step: w moves by lr * 1 (first momentum step), b stays. */
    write_grads(&tr.region, 1.0f);
    r = EXPECT_OK("ReduceScatter of 'w'", do_rs1(ch, s, 0, OFF_GRAD_W, PSHARD__DTYPE__FP32));
    if (r)
        protobuf_c_message_free_unpacked(r, NULL);
    g[1].lr = 100; /* a frozen group's hyperparameters may change: they are unused */
    Pshard__StepResponse *st =
        (Pshard__StepResponse *)EXPECT_OK("Step with groups", do_step_groups(ch, s, g, 2, false));
    CU_ASSERT(st && st->step == 1 && fabs(st->grad_norm - sqrt((double)NW)) < 1e-6);
    if (st)
        protobuf_c_message_free_unpacked(&st->base, NULL);
    const uint32_t ps[2] = {0, 1};
    const uint64_t go[2] = {OFF_GATHER_W, OFF_GATHER_B};
    r = EXPECT_OK("Gather", do_tensors(ch, false, s, ps, go, 2, PSHARD__DTYPE__FP32, 10000));
    if (r)
        protobuf_c_message_free_unpacked(r, NULL);
    const float *w = (const float *)((uint8_t *)tr.region.base + OFF_GATHER_W);
    const float *b = (const float *)((uint8_t *)tr.region.base + OFF_GATHER_B);
    bool moved = true, frozen = true;
    for (size_t i = 0; i < NW; i++)
        moved = moved && fabsf(w[i] - (init_w(i) - 0.1f)) < 1e-6f;
    for (size_t i = 0; i < NB; i++)
        frozen = frozen && b[i] == init_b(i);
    CU_ASSERT(moved);
    CU_ASSERT(frozen);

    /* SGD groups that all start without momentum have no momentum buffers to turn on. */
    write_init(&tr.region);
    define_groups(&d, s, &tr.region, false, false);
    r = EXPECT_OK("DefineModel, no momentum", do_define(ch, &d, 10000));
    if (r)
        protobuf_c_message_free_unpacked(r, NULL);
    g[1].frozen = false;
    EXPECT_ERR("Step turning momentum on", do_step_groups(ch, s, g, 2, false), FP,
               "momentum 0.9 needs SGD momentum buffers");
    /* Frozen groups do not count: a frozen group with momentum allocates nothing. */
    define_groups(&d, s, &tr.region, false, true);
    d.groups[1].momentum = 0.9;
    r = EXPECT_OK("DefineModel, momentum only in the frozen group", do_define(ch, &d, 10000));
    if (r)
        protobuf_c_message_free_unpacked(r, NULL);
    g[1].frozen = true;
    EXPECT_ERR("Step turning momentum on, frozen group with momentum",
               do_step_groups(ch, s, g, 2, false), FP, "group 0: momentum 0.9 needs");
    Pshard__ShardStatusResponse *status = get_status(ch);
    CU_ASSERT(status && status->state_bytes == (NW + NB) * 4 * 2); /* master + grads only */
    if (status)
        protobuf_c_message_free_unpacked(&status->base, NULL);
    CU_ASSERT(trainer_define(ch, &tr));
    CHECK_SERVING(ch, &tr);
}

/* ClipGradNorm: refusals (norm_type, max_norm, order, in backward), then the norm and the
 * clipped update against what they must be for known gradients, norm 2 and inf. */
static void test_clip_grad_norm(void)
{
    CU_ASSERT_FATAL(ensure_trainer());
    ps_rpc_channel_t *ch = one.ch[0];
    const pshard_status_t IA = PSHARD_ERR_INVALID_ARGUMENT, FP = PSHARD_ERR_FAILED_PRECONDITION;
    const char *s = tr.session;
    EXPECT_ERR("ClipGradNorm, norm_type 3", do_clip(ch, s, 1.0, 3.0), IA,
               "norm_type 3 is not supported");
    EXPECT_ERR("ClipGradNorm, norm_type 1", do_clip(ch, s, 1.0, 1.0), IA, "2.0 or inf");
    EXPECT_ERR("ClipGradNorm, norm_type -inf", do_clip(ch, s, 1.0, -INFINITY), IA, "norm_type");
    EXPECT_ERR("ClipGradNorm, norm_type NaN", do_clip(ch, s, 1.0, NAN), IA, "norm_type");
    EXPECT_ERR("ClipGradNorm, negative max_norm", do_clip(ch, s, -1.0, 2.0), IA,
               "max_norm -1 must be >= 0");
    EXPECT_ERR("ClipGradNorm, NaN max_norm", do_clip(ch, s, NAN, 2.0), IA, "max_norm");
    EXPECT_ERR("ClipGradNorm, wrong session", do_clip(ch, "deadbeef", 1.0, 2.0), FP, "session");
    CHECK_SERVING(ch, &tr);

    /* Known gradients: w all 3, b all -4 (NW = 15, NB = 4): norm 2 is sqrt(15*9 + 4*16) and
     * clipping to 1 scales them by (1 / (norm + 1e-6)) * 1 in fp32; then SGD lr 0.1 moves w
     * by -0.1 * 3 * coef. */
    float *gw = (float *)((uint8_t *)tr.region.base + OFF_GRAD_W);
    float *gb = (float *)((uint8_t *)tr.region.base + OFF_GRAD_B);
    for (size_t i = 0; i < NW; i++)
        gw[i] = 3.0f;
    for (size_t i = 0; i < NB; i++)
        gb[i] = -4.0f;
    const uint32_t ps[2] = {0, 1};
    const uint64_t ro[2] = {OFF_GRAD_W, OFF_GRAD_B};
    ProtobufCMessage *r =
        EXPECT_OK("ReduceScatter", do_tensors(ch, true, s, ps, ro, 2, PSHARD__DTYPE__FP32, 10000));
    if (r)
        protobuf_c_message_free_unpacked(r, NULL);
    double want2 = sqrt(15.0 * 9.0 + 4.0 * 16.0);
    Pshard__ClipGradNormResponse *c = (Pshard__ClipGradNormResponse *)EXPECT_OK(
        "ClipGradNorm inf, norm only", do_clip(ch, s, 0.0, INFINITY));
    CU_ASSERT(c && c->total_norm == 4.0);
    if (c)
        protobuf_c_message_free_unpacked(&c->base, NULL);
    c = (Pshard__ClipGradNormResponse *)EXPECT_OK("ClipGradNorm 2 to 100 (no clipping)",
                                                  do_clip(ch, s, 100.0, 2.0));
    CU_ASSERT(c && c->total_norm == (double)(float)want2);
    if (c)
        protobuf_c_message_free_unpacked(&c->base, NULL);
    c = (Pshard__ClipGradNormResponse *)EXPECT_OK("ClipGradNorm 2 to 1", do_clip(ch, s, 1.0, 2.0));
    CU_ASSERT(c && c->total_norm == (double)(float)want2);
    if (c)
        protobuf_c_message_free_unpacked(&c->base, NULL);
    float coef = (1.0f / ((float)want2 + 1e-6f)) * 1.0f;
    /* Clipped: the norm is now about 1 and the largest magnitude 4 * coef, about 0.28; inf-norm
     * clipping to 0.1 scales again by 0.1 / (4 * coef + 1e-6). */
    c = (Pshard__ClipGradNormResponse *)EXPECT_OK("ClipGradNorm inf to 0.1",
                                                  do_clip(ch, s, 0.1, INFINITY));
    float inf_total = -4.0f * coef;
    inf_total = fabsf(inf_total);
    CU_ASSERT(c && c->total_norm == (double)inf_total);
    if (c)
        protobuf_c_message_free_unpacked(&c->base, NULL);
    float coef2 = (1.0f / (inf_total + 1e-6f)) * 0.1f;
    CU_ASSERT(coef2 < 1.0f);
    Pshard__StepResponse *st =
        (Pshard__StepResponse *)EXPECT_OK("Step after clipping", do_step(ch, s, false, 0));
    float gw_final = 3.0f * coef * coef2, gb_final = -4.0f * coef * coef2;
    double want_step_norm =
        sqrt(15.0 * (double)gw_final * gw_final + 4.0 * (double)gb_final * gb_final);
    CU_ASSERT(st && fabs(st->grad_norm - want_step_norm) < 1e-6);
    if (st) {
        tr.steps = st->step;
        protobuf_c_message_free_unpacked(&st->base, NULL);
    }
    const uint64_t go[2] = {OFF_GATHER_W, OFF_GATHER_B};
    r = EXPECT_OK("Gather", do_tensors(ch, false, s, ps, go, 2, PSHARD__DTYPE__FP32, 10000));
    if (r)
        protobuf_c_message_free_unpacked(r, NULL);
    const float *w = (const float *)((uint8_t *)tr.region.base + OFF_GATHER_W);
    const float *b = (const float *)((uint8_t *)tr.region.base + OFF_GATHER_B);
    bool ok = true;
    for (size_t i = 0; i < NW; i++)
        ok = ok && w[i] == init_w(i) + (-0.1f) * gw_final;
    for (size_t i = 0; i < NB; i++)
        ok = ok && b[i] == init_b(i) + (-0.1f) * gb_final;
    if (!ok)
        fprintf(stderr, "  after clipping: w[0] = %.9g (want %.9g), b[0] = %.9g (want %.9g)\n",
                (double)w[0], (double)(init_w(0) + (-0.1f) * gw_final), (double)b[0],
                (double)(init_b(0) + (-0.1f) * gb_final));
    CU_ASSERT(ok);

    /* optimizer_in_backward keeps no accumulator: clipping is refused. */
    write_init(&tr.region);
    define_t d;
    define_init(&d, s, &tr.region);
    d.opt.in_backward = true;
    r = EXPECT_OK("DefineModel in backward", do_define(ch, &d, 10000));
    if (r)
        protobuf_c_message_free_unpacked(r, NULL);
    EXPECT_ERR("ClipGradNorm in backward", do_clip(ch, s, 1.0, 2.0), FP, "optimizer_in_backward");
    CU_ASSERT(trainer_define(ch, &tr));
    CHECK_SERVING(ch, &tr);
}

static void test_collective_bad(void)
{
    CU_ASSERT_FATAL(ensure_trainer());
    ps_rpc_channel_t *ch = one.ch[0];
    const pshard_status_t IA = PSHARD_ERR_INVALID_ARGUMENT;
    const char *s = tr.session;
    const int F32 = PSHARD__DTYPE__FP32;
    const uint32_t bad_ops[] = {0, 12, 99, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad_ops) / sizeof(bad_ops[0]); i++) {
        char sub[32];
        snprintf(sub, sizeof(sub), "op %u is not one of", bad_ops[i]);
        EXPECT_ERR("Collective, bad op", do_coll(ch, s, bad_ops[i], F32, 4, 0, 64), IA, sub);
    }
    EXPECT_ERR("Collective, unknown dtype", do_coll(ch, s, 3, 9, 4, 0, 64), IA, "unknown dtype 9");
    /* send (10) / recv (11) to world rank root 0: this rank itself on one rank */
    EXPECT_ERR("Collective, send to itself", do_coll(ch, s, 10, F32, 4, 0, 64), IA,
               "cannot send to or receive from rank 0");
    EXPECT_ERR("Collective, reduce_scatter input past the end", do_coll(ch, s, 2, F32, 1024, 4, 0),
               IA, "outside");
    EXPECT_ERR("Collective, send outside scratch", do_coll(ch, s, 3, F32, 4, SCRATCH_BYTES, 0), IA,
               "outside the 4096-byte scratch region");
    EXPECT_ERR("Collective, send past the end", do_coll(ch, s, 3, F32, 4, SCRATCH_BYTES - 8, 0), IA,
               "outside");
    EXPECT_ERR("Collective, recv past the end", do_coll(ch, s, 4, F32, 4, 0, SCRATCH_BYTES - 4), IA,
               "outside");
    EXPECT_ERR("Collective, all_gather recv past the end", do_coll(ch, s, 1, F32, 1024, 0, 4), IA,
               "outside");
    EXPECT_ERR("Collective, recv offset wrapping around",
               do_coll(ch, s, 3, F32, 4, 0, UINT64_MAX - 3), IA, "outside");
    EXPECT_ERR("Collective, huge count", do_coll(ch, s, 3, F32, 1ull << 41, 0, 0), IA, "outside");
    EXPECT_ERR("Collective, count overflowing bytes",
               do_coll(ch, s, 3, PSHARD__DTYPE__INT64, 1ull << 61, 0, 0), IA, "outside");
    EXPECT_ERR("Collective, misaligned", do_coll(ch, s, 3, F32, 4, 2, 64), IA, "misaligned");
    /* Reductions: unknown ones, bitwise on floats, avg on int64. */
    EXPECT_ERR("Collective, reduce 8", do_coll_reduce(ch, s, 3, F32, 4, 0, 64, 8), IA,
               "unknown reduction");
    EXPECT_ERR("Collective, reduce UINT32_MAX", do_coll_reduce(ch, s, 3, F32, 4, 0, 64, UINT32_MAX),
               IA, "unknown reduction");
    EXPECT_ERR("Collective, band of fp32", do_coll_reduce(ch, s, 3, F32, 4, 0, 64, 5), IA,
               "band is for integer dtypes only");
    EXPECT_ERR("Collective, avg of int64",
               do_coll_reduce(ch, s, 3, PSHARD__DTYPE__INT64, 4, 0, 64, 1), IA,
               "avg is not defined for int64");
    /* reduce, gather, scatter: the root must be a rank; reduce's reduction is checked. */
    EXPECT_ERR("Collective, reduce to rank 1 of 1", do_coll_full(ch, s, 6, F32, 4, 0, 64, 0, 1), IA,
               "reduce root 1 is not a rank of this 1-rank cluster");
    EXPECT_ERR("Collective, gather to rank -1", do_coll_full(ch, s, 7, F32, 4, 0, 64, 0, -1), IA,
               "gather root -1 is not a rank");
    EXPECT_ERR("Collective, scatter from rank 7", do_coll_full(ch, s, 8, F32, 4, 0, 64, 0, 7), IA,
               "scatter root 7 is not a rank");
    EXPECT_ERR("Collective, reduce band of fp32", do_coll_full(ch, s, 6, F32, 4, 0, 64, 5, 0), IA,
               "band is for integer dtypes only");
    EXPECT_ERR("Collective, gather recv past the end",
               do_coll_full(ch, s, 7, F32, 1024, 0, 4, 0, 0), IA, "outside");
    EXPECT_ERR("Collective, scatter send past the end",
               do_coll_full(ch, s, 8, F32, 1024, 4, 0, 0, 0), IA, "outside");
    /* ... and on one rank they are copies. */
    {
        float *sc = (float *)tr.scratch.base;
        for (int i = 0; i < 4; i++)
            sc[i] = (float)i + 0.5f;
        static const uint32_t rooted_ops[] = {6, 7, 8, 9};
        for (int k = 0; k < 4; k++) {
            memset(sc + 16, 0, 4 * sizeof(float));
            ProtobufCMessage *r =
                EXPECT_OK("Collective, rooted op on one rank",
                          do_coll_full(ch, s, rooted_ops[k], F32, 4, 0, 64, 4 /* max */, 0));
            if (r)
                protobuf_c_message_free_unpacked(r, NULL);
            for (int i = 0; i < 4; i++)
                CU_ASSERT_EQUAL(sc[16 + i], (float)i + 0.5f);
        }
    }
    /* A reduction sent with an op that does not reduce is ignored (as before). */
    ProtobufCMessage *ok = EXPECT_OK("Collective, broadcast with reduce 99",
                                     do_coll_reduce(ch, s, 4, F32, 4, 0, 0, 99));
    if (ok)
        protobuf_c_message_free_unpacked(ok, NULL);
    CHECK_SERVING(ch, &tr);
}

static void test_garbage(void)
{
    CU_ASSERT_FATAL(ensure_trainer());
    ps_rpc_channel_t *ch = one.ch[0];
    static const char *const methods[][2] = {
        {"Attach", "AttachRequest"},      {"DefineModel", "DefineModelRequest"},
        {"Gather", "GatherRequest"},      {"ReduceScatter", "ReduceScatterRequest"},
        {"Step", "StepRequest"},          {"Collective", "CollectiveRequest"},
        {"Status", "ShardStatusRequest"}, {"ClipGradNorm", "ClipGradNormRequest"},
    };
    static const struct {
        const char *what;
        const char *bytes;
        size_t len;
    } payloads[] = {
        {"a varint that never ends", "\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 12},
        {"a truncated length-delimited field",
         "\x0a\x7f"
         "abc",
         5},
        {"wire type 7", "\x0f\x01\x02", 3},
        {"field number 0", "\x00\x01", 2},
    };
    for (size_t m = 0; m < sizeof(methods) / sizeof(methods[0]); m++) {
        char path[96];
        snprintf(path, sizeof(path), "/pshard.ShardServer/%s", methods[m][0]);
        for (size_t p = 0; p < sizeof(payloads) / sizeof(payloads[0]); p++) {
            res_t r;
            memset(&r, 0, sizeof(r));
            void *resp = NULL;
            size_t resp_len = 0;
            r.code = -1;
            r.rc = ps_rpc_unary_raw(ch, path, payloads[p].bytes, payloads[p].len, &resp, &resp_len,
                                    10000, &r.code, r.err, sizeof(r.err));
            free(resp);
            char what[160];
            snprintf(what, sizeof(what), "%s with %s", methods[m][0], payloads[p].what);
            CU_ASSERT(expect_err_(&r, PSHARD_ERR_INVALID_ARGUMENT, "not a valid", what, __LINE__));
            CU_ASSERT(strstr(r.err, methods[m][1]) != NULL);
        }
    }
    /* A request over the 4 MiB receive limit. */
    {
        size_t n = 5u << 20;
        char *big = calloc(1, n);
        CU_ASSERT_FATAL(big != NULL);
        big[0] = 0x0a; /* field 1 (session), length 5 MiB - 5 */
        size_t len = n - 5, k = 1;
        while (len >= 0x80) {
            big[k++] = (char)(0x80 | (len & 0x7f));
            len >>= 7;
        }
        big[k++] = (char)len;
        res_t r;
        memset(&r, 0, sizeof(r));
        void *resp = NULL;
        size_t resp_len = 0;
        r.rc = ps_rpc_unary_raw(ch, "/pshard.ShardServer/Gather", big, n, &resp, &resp_len, 10000,
                                &r.code, r.err, sizeof(r.err));
        free(resp);
        free(big);
        CU_ASSERT(
            expect_err_(&r, PSHARD_ERR_RESOURCE_EXHAUSTED, NULL, "Gather of 5 MiB", __LINE__));
    }
    CHECK_SERVING(ch, &tr);
}

/* --transport tcp keeps two servers of one host on the sockets, and Status says so; the ring
 * listens on the first of --socket-ifname's interfaces that exists (lo). */
static void test_transport_option(void)
{
    cluster_t c;
    const char *args[] = {"--transport", "tcp", "--socket-ifname", "nosuch0,lo", NULL};
    bool up = cluster_start(&c, 2, args);
    CU_ASSERT(up);
    if (!up)
        return;
    for (int r = 0; r < 2; r++) {
        Pshard__ShardStatusResponse *st = get_status(c.ch[r]);
        CU_ASSERT(st != NULL);
        if (st) {
            CU_ASSERT_STRING_EQUAL(st->transport, "tcp");
            protobuf_c_message_free_unpacked(&st->base, NULL);
        }
    }
    CU_ASSERT(cluster_stop(&c));
}

static void test_offload_and_backend_options(void)
{
    /* Default: Status says "none" (the shared server). */
    CU_ASSERT_FATAL(one_ok);
    Pshard__ShardStatusResponse *st = get_status(one.ch[0]);
    CU_ASSERT_FATAL(st != NULL);
    CU_ASSERT_STRING_EQUAL(st->offload, "none");
    CU_ASSERT_STRING_EQUAL(st->backend, "tcp");
    CU_ASSERT_STRING_EQUAL(st->placement, "host");
    protobuf_c_message_free_unpacked(&st->base, NULL);

    /* --offload cpu starts, reports "cpu" and trains. */
    cluster_t c;
    const char *cpu_args[] = {"--offload", "cpu", NULL};
    bool up = cluster_start(&c, 1, cpu_args);
    CU_ASSERT(up);
    if (up) {
        st = get_status(c.ch[0]);
        CU_ASSERT(st != NULL);
        if (st) {
            CU_ASSERT_STRING_EQUAL(st->offload, "cpu");
            CU_ASSERT_STRING_EQUAL(st->placement, "host"); /* tcp: nothing to pin for */
            protobuf_c_message_free_unpacked(&st->base, NULL);
        }
        trainer_t t;
        memset(&t, 0, sizeof(t));
        CU_ASSERT(trainer_attach(c.ch[0], &t, 0, "cpu") && trainer_define(c.ch[0], &t));
        CHECK_SERVING(c.ch[0], &t);
        trainer_free(&t);
    }
    CU_ASSERT(cluster_stop(&c));

    /* Refused at start with a message: --offload gpu, a CUDA device that is not there for
     * --backend nccl with shards in GPU or host memory (on any machine: no GPU, or no device
     * 1000), an unknown backend, an unknown transport. */
    static const struct {
        const char *flag, *value, *flag2, *value2, *sub1, *sub2;
    } refused[] = {
        {"--offload", "gpu", NULL, NULL, "--offload", "none or cpu"},
        {"--backend", "nccl", NULL, NULL, "--backend nccl needs a GPU", "--device 1000"},
        {"--backend", "nccl", "--offload", "cpu", "--backend nccl needs a GPU", "--device 1000"},
        {"--backend", "mpi", NULL, NULL, "--backend", "tcp or nccl"},
        {"--transport", "infiniband", NULL, NULL, "--transport", "auto, tcp or shm"},
        {"--socket-ifname", "nosuch0", NULL, NULL, "--socket-ifname", "no such interface"},
    };
    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
        char dir[] = "/tmp/pshard-shard-errors-XXXXXX";
        CU_ASSERT_FATAL(mkdtemp(dir) != NULL);
        char log[128], port_file[128];
        snprintf(log, sizeof(log), "%s/server.log", dir);
        snprintf(port_file, sizeof(port_file), "%s/server.port", dir);
        char *argv[] = {(char *)server_bin,
                        "--coordinator",
                        "127.0.0.1:1",
                        "--name",
                        "refused",
                        "--port-file",
                        port_file,
                        (char *)refused[i].flag,
                        (char *)refused[i].value,
                        "--device",
                        "1000",
                        (char *)refused[i].flag2,
                        (char *)refused[i].value2,
                        NULL};
        pid_t pid = ps_proc_spawn(argv, log);
        CU_ASSERT_FATAL(pid > 0);
        int status = 0;
        pid_t got = 0;
        int64_t end = ps_now_ns() + 20 * 1000000000LL;
        while ((got = waitpid(pid, &status, WNOHANG)) == 0 && ps_now_ns() < end)
            sleep_ms(10);
        if (got != pid) {
            fprintf(stderr, "  pshard-server %s %s kept running\n", refused[i].flag,
                    refused[i].value);
            ps_proc_stop(pid, 5000);
        }
        CU_ASSERT(got == pid && WIFEXITED(status) &&
                  (WEXITSTATUS(status) == 1 || WEXITSTATUS(status) == 2));
        char *text = ps_read_file(log, false, 1 << 20, NULL, NULL, 0);
        bool msg_ok = text && strstr(text, refused[i].sub1) && strstr(text, refused[i].sub2);
        if (!msg_ok)
            fprintf(stderr, "  pshard-server %s %s said: %s\n", refused[i].flag, refused[i].value,
                    text ? text : "(nothing)");
        CU_ASSERT(msg_ok);
        CU_ASSERT(access(port_file, F_OK) != 0); /* it never served */
        free(text);
        unlink(log);
        unlink(port_file);
        rmdir(dir);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* A trainer killed mid-step (world 2)                                                        */

static bool wait_file(const char *path, pid_t pid, int64_t timeout_ms)
{
    int64_t end = ps_now_ns() + timeout_ms * 1000000;
    while (ps_now_ns() < end) {
        if (access(path, F_OK) == 0)
            return true;
        if (pid > 0 && waitpid(pid, NULL, WNOHANG) == pid) {
            fprintf(stderr, "  the peer trainer exited early\n");
            return false;
        }
        sleep_ms(10);
    }
    return false;
}

static void touch(const char *path)
{
    FILE *f = fopen(path, "w");
    if (f)
        fclose(f);
}

/* World-2 training helpers shared by trainer 0 (the test) and trainer 1 (--peer-trainer). Rank
 * 0 reduce-scatters gradients of 1, rank 1 of 3: the average is 2, and one SGD step (lr 0.1)
 * moves every parameter by -0.2; the global gradient norm is sqrt(19 * 2^2). */
#define W2_DELTA (-0.2f)

static bool w2_gather(ps_rpc_channel_t *ch, trainer_t *t, float delta, const char *who)
{
    memset((uint8_t *)t->region.base + OFF_GATHER_W, 0, OFF_GRAD_W - OFF_GATHER_W);
    const uint32_t ps[2] = {0, 1};
    const uint64_t go[2] = {OFF_GATHER_W, OFF_GATHER_B};
    ProtobufCMessage *r =
        EXPECT_OK(who, do_tensors(ch, false, t->session, ps, go, 2, PSHARD__DTYPE__FP32, 30000));
    if (!r)
        return false;
    protobuf_c_message_free_unpacked(r, NULL);
    return gathered_near(&t->region, who, delta);
}

static bool w2_reduce_and_step(ps_rpc_channel_t *ch, trainer_t *t, int rank, const char *who)
{
    write_grads(&t->region, rank == 0 ? 1.0f : 3.0f);
    const uint32_t ps[2] = {0, 1};
    const uint64_t ro[2] = {OFF_GRAD_W, OFF_GRAD_B};
    ProtobufCMessage *r =
        EXPECT_OK(who, do_tensors(ch, true, t->session, ps, ro, 2, PSHARD__DTYPE__FP32, 30000));
    if (!r)
        return false;
    protobuf_c_message_free_unpacked(r, NULL);
    Pshard__StepResponse *st =
        (Pshard__StepResponse *)EXPECT_OK(who, do_step(ch, t->session, false, 0));
    if (!st)
        return false;
    bool ok = st->step == 1 && fabs(st->grad_norm - sqrt(19.0 * 4.0)) < 1e-3;
    if (!ok)
        fprintf(stderr, "  %s: step %" PRId64 ", grad norm %g (expected 1, %g)\n", who, st->step,
                st->grad_norm, sqrt(19.0 * 4.0));
    protobuf_c_message_free_unpacked(&st->base, NULL);
    return ok;
}

/* --peer-trainer ADDR RANK DIR: attach, define (rank 0 provides the values), gather and check,
 * then announce DIR/gathered and wait to be killed. Its shm objects are
 * "/pshard-test-<pid>-0" and "-1"; whoever kills it unlinks them. */
static int peer_trainer_main(const char *addr, const char *rank_s, const char *dir)
{
    int64_t rank;
    if (ps_parse_i64(rank_s, 0, 1, &rank) != 0)
        return 2;
    char err[256] = "";
    ps_rpc_channel_config_t cfg = {.target = addr, .own_connection = true};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&cfg, err, sizeof(err));
    if (!ch) {
        fprintf(stderr, "peer: channel: %s\n", err);
        return 1;
    }
    trainer_t t;
    memset(&t, 0, sizeof(t));
    if (!trainer_attach(ch, &t, (int)rank, NULL)) {
        fprintf(stderr, "peer: attach failed\n");
        return 1;
    }
    char path[300];
    snprintf(path, sizeof(path), "%s/attached", dir);
    touch(path);
    define_t d;
    define_init(&d, t.session, &t.region);
    d.req.init = PSHARD__INIT_MODE__INIT_FROM_RANK0;
    d.req.n_init_offsets = 0; /* rank 1 provides no values */
    ProtobufCMessage *r = EXPECT_OK("peer DefineModel", do_define(ch, &d, 30000));
    if (!r)
        return 1;
    protobuf_c_message_free_unpacked(r, NULL);
    /* One full step with trainer 0, then the next step's gather. */
    if (!w2_gather(ch, &t, 0.0f, "peer gather 1") ||
        !w2_reduce_and_step(ch, &t, (int)rank, "peer reduce-scatter and step") ||
        !w2_gather(ch, &t, W2_DELTA, "peer gather 2"))
        return 1;
    snprintf(path, sizeof(path), "%s/gathered", dir);
    touch(path);
    /* Never reduce-scatter again: wait to be killed. */
    for (int i = 0; i < 120 * 10; i++)
        sleep_ms(100);
    fprintf(stderr, "peer: nobody killed me\n");
    return 3;
}

static void test_trainer_killed_mid_step(void)
{
    cluster_t c;
    const char *args[] = {"--coll-timeout-ms", "2000", NULL};
    bool up = cluster_start(&c, 2, args);
    CU_ASSERT(up);
    pid_t peer = -1;
    trainer_t t;
    memset(&t, 0, sizeof(t));
    char dir[] = "/tmp/pshard-shard-errors-peer-XXXXXX";
    bool have_dir = mkdtemp(dir) != NULL;
    CU_ASSERT(have_dir);
    if (!up || !have_dir)
        goto out;
    int me = c.rank_of[0] == 0 ? 0 : 1, other = 1 - me; /* me: the server of rank 0 */
    ps_rpc_channel_t *ch = c.ch[me];
    /* Two servers of one host: by default they read each other's memory. */
    Pshard__ShardStatusResponse *st0 = get_status(ch);
    CU_ASSERT(st0 != NULL);
    if (st0) {
        CU_ASSERT_STRING_EQUAL(st0->transport, "shm");
        protobuf_c_message_free_unpacked(&st0->base, NULL);
    }
    if (!trainer_attach(ch, &t, 0, "none")) {
        CU_FAIL("trainer 0 cannot attach");
        goto out;
    }
    char log[128];
    snprintf(log, sizeof(log), "%s/peer.log", dir);
    char *argv[] = {self_bin, "--peer-trainer", c.addr[other], "1", dir, NULL};
    peer = ps_proc_spawn(argv, log);
    CU_ASSERT(peer > 0);
    if (peer <= 0)
        goto out;
    char path[128];
    snprintf(path, sizeof(path), "%s/attached", dir);
    if (!wait_file(path, peer, 30000)) {
        CU_FAIL("the peer trainer did not attach");
        goto out;
    }
    /* Rank 0 provides the initial values; both define, both gather. */
    write_init(&t.region);
    define_t d;
    define_init(&d, t.session, &t.region);
    d.req.init = PSHARD__INIT_MODE__INIT_FROM_RANK0;
    ProtobufCMessage *r = EXPECT_OK("DefineModel (world 2)", do_define(ch, &d, 30000));
    CU_ASSERT(r != NULL);
    if (!r)
        goto out;
    protobuf_c_message_free_unpacked(r, NULL);
    /* One full step together, then the next step's gather. */
    bool step_ok = w2_gather(ch, &t, 0.0f, "trainer 0 gather 1") &&
                   w2_reduce_and_step(ch, &t, 0, "trainer 0 reduce-scatter and step") &&
                   w2_gather(ch, &t, W2_DELTA, "trainer 0 gather 2");
    CU_ASSERT(step_ok);
    if (!step_ok)
        goto out;
    snprintf(path, sizeof(path), "%s/gathered", dir);
    if (!wait_file(path, peer, 30000)) {
        CU_FAIL("the peer trainer did not gather");
        goto out;
    }
    /* Trainer 1 dies before its reduce-scatter. */
    CU_ASSERT(kill(peer, SIGKILL) == 0);
    int status = 0;
    CU_ASSERT(waitpid(peer, &status, 0) == peer && WIFSIGNALED(status));
    for (int i = 0; i < 2; i++) {
        char name[64];
        snprintf(name, sizeof(name), "/pshard-test-%d-%d", (int)peer, i);
        CU_ASSERT(shm_unlink(name) == 0); /* it had created them */
    }
    peer = -1;

    /* Trainer 0's reduce-scatter must fail within the collective timeout, naming rank 1. */
    write_grads(&t.region, 1.0f);
    const uint32_t ps[2] = {0, 1};
    const uint64_t ro[2] = {OFF_GRAD_W, OFF_GRAD_B};
    int64_t t0 = ps_now_ns();
    res_t rs = do_tensors(ch, true, t.session, ps, ro, 2, PSHARD__DTYPE__FP32, 60000);
    double secs = (double)(ps_now_ns() - t0) / 1e9;
    fprintf(stderr, "  reduce-scatter without the peer failed after %.2f s: %s\n", secs, rs.err);
    CU_ASSERT(
        expect_err_(&rs, PSHARD_ERR_TIMEOUT, "rank 1", "ReduceScatter without the peer", __LINE__));
    CU_ASSERT(strstr(rs.err, "timed out") != NULL);
    CU_ASSERT(secs >= 1.5 && secs < 30.0); /* it waited for the 2 s timeout, not the deadline */

    /* Both servers keep answering. */
    for (int i = 0; i < 2; i++) {
        Pshard__ShardStatusResponse *st = get_status(c.ch[i]);
        CU_ASSERT(st != NULL);
        if (st) {
            CU_ASSERT(st->rank == c.rank_of[i] && st->world_size == 2);
            protobuf_c_message_free_unpacked(&st->base, NULL);
        }
    }
    /* A new trainer can attach to the dead trainer's server. */
    {
        trainer_t t1;
        memset(&t1, 0, sizeof(t1));
        CU_ASSERT(trainer_attach(c.ch[other], &t1, 1, "none"));
        trainer_free(&t1);
    }
out:
    if (peer > 0) {
        kill(peer, SIGKILL);
        waitpid(peer, NULL, 0);
        for (int i = 0; i < 2; i++) {
            char name[64];
            snprintf(name, sizeof(name), "/pshard-test-%d-%d", (int)peer, i);
            shm_unlink(name);
        }
    }
    trainer_free(&t);
    CU_ASSERT(cluster_stop(&c));
    if (have_dir) {
        char p[128];
        const char *files[] = {"attached", "gathered", "peer.log"};
        for (size_t i = 0; i < 3; i++) {
            snprintf(p, sizeof(p), "%s/%s", dir, files[i]);
            if (i == 2 && CU_get_number_of_failures() > 0) {
                char *text = ps_read_file(p, false, 1 << 16, NULL, NULL, 0);
                if (text && *text)
                    fprintf(stderr, "  peer trainer log:\n%s\n", text);
                free(text);
            }
            unlink(p);
        }
        rmdir(dir);
    }
}

/* The remote path's byte movers refuse what does not fit: chunks over 1 MiB, ranges outside
 * the region, unknown regions, wrong sessions; the server keeps serving. */
static void test_region_bad(void)
{
    CU_ASSERT_FATAL(ensure_trainer());
    ps_rpc_channel_t *ch = one.ch[0];
    const pshard_status_t IA = PSHARD_ERR_INVALID_ARGUMENT;
    static uint8_t big[(1u << 20) + 1];
    Pshard__RegionWriteRequest w = PSHARD__REGION_WRITE_REQUEST__INIT;
    w.session = tr.session;
    w.region = PSHARD__REGION__SCRATCH;
    w.data.data = big;
    w.data.len = sizeof(big);
    EXPECT_ERR("WriteRegion, chunk over 1 MiB",
               rpc(ch, "WriteRegion", &w.base, &pshard__region_write_response__descriptor, 5000),
               IA, "exceeds");
    w.data.len = 16;
    w.offset = (uint64_t)1 << 40;
    EXPECT_ERR("WriteRegion, outside the region",
               rpc(ch, "WriteRegion", &w.base, &pshard__region_write_response__descriptor, 5000),
               IA, "outside");
    w.offset = 0;
    w.region = 7;
    EXPECT_ERR("WriteRegion, unknown region",
               rpc(ch, "WriteRegion", &w.base, &pshard__region_write_response__descriptor, 5000),
               IA, "unknown region");
    w.region = PSHARD__REGION__SCRATCH;
    w.session = "not-a-session";
    EXPECT_ERR("WriteRegion, wrong session",
               rpc(ch, "WriteRegion", &w.base, &pshard__region_write_response__descriptor, 5000),
               PSHARD_ERR_FAILED_PRECONDITION, "session");
    /* A good write, then reading it back through the stream. */
    w.session = tr.session;
    memset(big, 0x5a, 16);
    ProtobufCMessage *ok =
        EXPECT_OK("WriteRegion, 16 bytes", rpc(ch, "WriteRegion", &w.base,
                                               &pshard__region_write_response__descriptor, 5000));
    CU_ASSERT(ok != NULL);
    if (ok)
        protobuf_c_message_free_unpacked(ok, NULL);
    Pshard__RegionReadRequest rq = PSHARD__REGION_READ_REQUEST__INIT;
    rq.session = tr.session;
    rq.region = PSHARD__REGION__SCRATCH;
    rq.length = 16;
    char err[512] = "";
    ps_rpc_stream_t *st =
        ps_rpc_stream_open(ch, "/pshard.ShardServer/ReadRegion", &rq.base, 5000, err, sizeof(err));
    CU_ASSERT_FATAL(st != NULL);
    ProtobufCMessage *msg = NULL;
    CU_ASSERT(ps_rpc_stream_next(st, &pshard__data_chunk__descriptor, &msg, 5000, NULL, err,
                                 sizeof(err)) == PSHARD_OK);
    if (msg) {
        Pshard__DataChunk *c = (Pshard__DataChunk *)msg;
        CU_ASSERT(c->offset == 0 && c->data.len == 16 && c->data.data[15] == 0x5a);
        protobuf_c_message_free_unpacked(msg, NULL);
    }
    ps_rpc_stream_close(st);
    /* Reading past the end fails on the stream with INVALID_ARGUMENT. */
    rq.offset = (uint64_t)1 << 40;
    st = ps_rpc_stream_open(ch, "/pshard.ShardServer/ReadRegion", &rq.base, 5000, err, sizeof(err));
    CU_ASSERT_FATAL(st != NULL);
    msg = NULL;
    err[0] = '\0';
    int code = 0;
    pshard_status_t rc = ps_rpc_stream_next(st, &pshard__data_chunk__descriptor, &msg, 5000, &code,
                                            err, sizeof(err));
    CU_ASSERT(rc == IA && strstr(err, "outside") != NULL);
    if (msg)
        protobuf_c_message_free_unpacked(msg, NULL);
    ps_rpc_stream_close(st);
    check_serving_(ch, &tr, __LINE__);
}

/* Another process of the same user shrinks shared memory the server has mapped: the trainer's
 * model region, then the server's own copy of its shard. The server used to die of SIGBUS at
 * its next access; now that operation fails naming the memory, so does every later one on it,
 * and the server goes on serving the trainer once it attaches again (defines its model again). */
static void test_shm_shrunk(void)
{
    CU_ASSERT_FATAL(ensure_trainer());
    ps_rpc_channel_t *ch = one.ch[0];
    const pshard_status_t FP = PSHARD_ERR_FAILED_PRECONDITION;
    const uint32_t ps[2] = {0, 1};
    const uint64_t go[2] = {OFF_GATHER_W, OFF_GATHER_B};
    int fd = shm_open(tr.region.name, O_RDWR, 0);
    CU_ASSERT_FATAL(fd >= 0);
    CU_ASSERT_FATAL(ftruncate(fd, 0) == 0);
    close(fd);
    /* (This process must not touch its own mapping of the region from here on.) */
    for (int k = 0; k < 2; k++) {
        res_t r = do_tensors(ch, false, tr.session, ps, go, 2, PSHARD__DTYPE__FP32, 10000);
        CU_ASSERT(strstr(r.err, tr.region.name) != NULL);
        CU_ASSERT(expect_err_(&r, FP, "model region", "Gather into a shrunk region", __LINE__));
    }
    CU_ASSERT(health(ch, "") == 1);
    trainer_free(&tr); /* unmaps without touching */
    CU_ASSERT_FATAL(ensure_trainer());
    CHECK_SERVING(ch, &tr);

    /* The server's own copy of its shard (the name DefineModel gives the trainer). */
    define_t d;
    write_init(&tr.region);
    define_init(&d, tr.session, &tr.region);
    Pshard__DefineModelResponse *dr =
        (Pshard__DefineModelResponse *)EXPECT_OK("DefineModel", do_define(ch, &d, 20000));
    CU_ASSERT_FATAL(dr != NULL);
    char own[64];
    ps_strlcpy(own, dr->shard_shm_name, sizeof(own));
    protobuf_c_message_free_unpacked(&dr->base, NULL);
    tr.steps = 0;
    CU_ASSERT_FATAL(own[0] == '/');
    fd = shm_open(own, O_RDWR, 0);
    CU_ASSERT_FATAL(fd >= 0);
    CU_ASSERT_FATAL(ftruncate(fd, 0) == 0);
    close(fd);
    for (int k = 0; k < 2; k++) {
        res_t r = do_tensors(ch, false, tr.session, ps, go, 2, PSHARD__DTYPE__FP32, 10000);
        CU_ASSERT(strstr(r.err, own) != NULL);
        CU_ASSERT(
            expect_err_(&r, FP, "own copy of its shard", "Gather from a shrunk shard", __LINE__));
    }
    EXPECT_ERR("Step on a shrunk shard", do_step(ch, tr.session, false, 0), FP, "defined again");
    CU_ASSERT(health(ch, "") == 1);
    CU_ASSERT(trainer_define(ch, &tr));
    CHECK_SERVING(ch, &tr);
}

static long status_kb(pid_t pid, const char *key)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "re");
    long kb = -1;
    size_t kl = strlen(key);
    while (f && fgets(line, sizeof(line), f))
        if (strncmp(line, key, kl) == 0 && line[kl] == ':') {
            kb = strtol(line + kl + 1, NULL, 10);
            break;
        }
    if (f)
        fclose(f);
    return kb;
}

/* ReadRegion streams at the pace its client reads: four unread reads of a 64 MiB region
 * used to copy all of it into the server's send queues (16 -> 717 MiB); now each holds at most
 * the server's stream cap, and a read that is read completes. Unread reads also held every
 * worker of the pool (4) for up to a minute, so the trainer's next operation waited that long;
 * now at most all but two workers read regions, the rest are refused at once. */
static void test_read_region_unread(void)
{
    cluster_t c;
    CU_ASSERT_FATAL(cluster_start(&c, 1, NULL));
    trainer_t t;
    memset(&t, 0, sizeof(t));
    const size_t big = (size_t)64 << 20;
    CU_ASSERT_FATAL(shm_make(&t.scratch, big));
    memset(t.scratch.base, 0x3c, big);
    CU_ASSERT_FATAL(trainer_attach(c.ch[0], &t, 0, NULL));
    Pshard__RegionReadRequest rq = PSHARD__REGION_READ_REQUEST__INIT;
    rq.session = t.session;
    rq.region = PSHARD__REGION__SCRATCH;
    rq.length = big;
    char err[512] = "";
    long before = status_kb(c.servers[0], "RssAnon");
    ps_rpc_stream_t *st[4];
    for (int i = 0; i < 4; i++) {
        st[i] = ps_rpc_stream_open(c.ch[0], "/pshard.ShardServer/ReadRegion", &rq.base, 60000, err,
                                   sizeof(err));
        CU_ASSERT_FATAL(st[i] != NULL);
    }
    /* Give the server time to queue what it would. */
    long peak = before;
    for (int k = 0; k < 20; k++) {
        struct timespec ts = {0, 100 * 1000000};
        nanosleep(&ts, NULL);
        long now = status_kb(c.servers[0], "RssAnon");
        if (now > peak)
            peak = now;
    }
    fprintf(stderr, "\n  4 unread ReadRegion calls of 64 MiB: server RssAnon %ld -> %ld kB\n",
            before, peak);
    CU_ASSERT(before > 0 && peak - before < 100 * 1024);
    /* A trainer operation still finds a worker, at once. */
    Pshard__RegionWriteRequest w = PSHARD__REGION_WRITE_REQUEST__INIT;
    w.session = t.session;
    w.region = PSHARD__REGION__SCRATCH;
    w.data.data = (uint8_t *)"\x3c\x3c\x3c\x3c";
    w.data.len = 4;
    int64_t t0 = ps_now_ns();
    res_t wr =
        rpc(c.ch[0], "WriteRegion", &w.base, &pshard__region_write_response__descriptor, 5000);
    fprintf(stderr, "  WriteRegion beside them: %s in %.1f ms\n", pshard_status_name(wr.rc),
            (double)(ps_now_ns() - t0) / 1e6);
    CU_ASSERT_EQUAL(wr.rc, PSHARD_OK);
    if (wr.resp)
        protobuf_c_message_free_unpacked(wr.resp, NULL);
    /* Two were refused at once, with the reason; the first chunk of the others is there. */
    int refused = 0, reading = -1;
    ProtobufCMessage *first = NULL;
    for (int i = 0; i < 4; i++) {
        ProtobufCMessage *msg = NULL;
        err[0] = '\0';
        pshard_status_t rc = ps_rpc_stream_next(st[i], &pshard__data_chunk__descriptor, &msg, 10000,
                                                NULL, err, sizeof(err));
        if (rc == PSHARD_ERR_RESOURCE_EXHAUSTED && strstr(err, "region reads are in progress"))
            refused++;
        else if (rc == PSHARD_OK && msg && reading < 0) {
            reading = i;
            first = msg;
            continue;
        }
        if (msg)
            protobuf_c_message_free_unpacked(msg, NULL);
    }
    CU_ASSERT_EQUAL(refused, 2);
    CU_ASSERT_FATAL(reading >= 0);
    /* One read to its end delivers every byte. */
    uint64_t got = 0;
    bool same = true;
    for (;;) {
        ProtobufCMessage *msg = first;
        first = NULL;
        pshard_status_t rc = PSHARD_OK;
        if (!msg)
            rc = ps_rpc_stream_next(st[reading], &pshard__data_chunk__descriptor, &msg, 30000, NULL,
                                    err, sizeof(err));
        if (rc != PSHARD_OK || !msg)
            break;
        Pshard__DataChunk *ch = (Pshard__DataChunk *)msg;
        same = same && ch->offset == got && ch->data.len > 0 && ch->data.data[0] == 0x3c &&
               ch->data.data[ch->data.len - 1] == 0x3c;
        got += ch->data.len;
        protobuf_c_message_free_unpacked(msg, NULL);
    }
    CU_ASSERT_EQUAL(got, big);
    CU_ASSERT(same);
    for (int i = 0; i < 4; i++)
        ps_rpc_stream_close(st[i]);
    trainer_free(&t);
    CU_ASSERT(cluster_stop(&c));
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    atexit(shm_unlink_all);
    if (argc == 5 && strcmp(argv[1], "--peer-trainer") == 0)
        return peer_trainer_main(argv[2], argv[3], argv[4]);
    if (argc < 3) {
        fprintf(stderr, "usage: %s COORDINATOR SERVER\n", argv[0]);
        return 2;
    }
    coord_bin = argv[1];
    server_bin = argv[2];
    ssize_t n = readlink("/proc/self/exe", self_bin, sizeof(self_bin) - 1);
    if (n <= 0)
        return 2;
    self_bin[n] = '\0';
    /* Under AddressSanitizer a failed huge malloc must return NULL, as it does in production,
     * instead of aborting the server ("too large to allocate" case). */
    {
        const char *old = getenv("ASAN_OPTIONS");
        char opts[1024];
        snprintf(opts, sizeof(opts), "%s%sallocator_may_return_null=1", old ? old : "",
                 old && *old ? ":" : "");
        setenv("ASAN_OPTIONS", opts, 1);
    }
    one_ok = cluster_start(&one, 1, NULL);
    if (!one_ok)
        fprintf(stderr, "the world-1 cluster did not start\n");
    static const ps_test_case_t cases[] = {
        {"calls before Attach and before DefineModel", test_before_attach_and_define},
        {"wrong or replaced session", test_wrong_session},
        {"Attach: bad shm names and sizes, wrong rank", test_attach_bad},
        {"Attach: refused while a live trainer holds the rank",
         test_attach_refused_while_trainer_lives},
        {"DefineModel: bad shapes, names, enums, optimizer, init offsets", test_define_bad},
        {"a refused DefineModel keeps the defined model", test_define_refused_keeps_state},
        {"DefineModel: validated before allocating, capped by --max-model-memory",
         test_define_memory},
        {"Gather/ReduceScatter/Step: bad params, offsets, dtypes, lr", test_tensors_bad},
        {"parameter groups: bad definitions and steps, frozen parameters", test_groups_bad},
        {"ClipGradNorm: refusals, norm 2 and inf, the clipped step", test_clip_grad_norm},
        {"Collective: bad op, dtype, offsets", test_collective_bad},
        {"garbage bytes on each method, oversized request", test_garbage},
        {"ReadRegion/WriteRegion: oversized chunks, ranges, regions, sessions", test_region_bad},
        {"ReadRegion: unread streams hold a bounded queue each", test_read_region_unread},
        {"--offload cpu/none, --offload gpu and --backend nccl refused",
         test_offload_and_backend_options},
        {"--transport tcp: two servers of one host use the sockets", test_transport_option},
        {"shared memory shrunk by another process: the operation fails, the server lives",
         test_shm_shrunk},
        {"a trainer killed mid-step: ReduceScatter times out naming the rank",
         test_trainer_killed_mid_step},
        {NULL, NULL},
    };
    int rc = ps_test_main("shard_errors", cases);
    trainer_free(&tr);
    if (!cluster_stop(&one)) {
        fprintf(stderr, "the world-1 server did not stop cleanly\n");
        rc = 1;
    }
    shm_unlink_all();
    return rc;
}
