/* Unit tests of the shard server's operations layer (shard_ops.h) and of the agreement's codec
 * and verdict (shard_join.h), without processes: the verdicts from hand-made records of
 * several ranks, and shard_op_run on a server of one rank (a one-rank communicator needs no
 * peer), with a real model for the gathers, reduce-scatters and steps it runs. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ps_test.h"
#include "pshard/collectives.h"
#include "pshard/util.h"
#include "shard_join.h"
#include "shard_ops.h"

/* ---- the verdict ----------------------------------------------------------------------- */

static uint32_t ids12[] = {1, 2};
static uint32_t ids13[] = {1, 3};

static void rec_op(int64_t *recs, int r, const shard_sop_t *op, int64_t ckpt)
{
    shard_rec_encode(recs + (size_t)r * REC_WORDS, REC_OP, op, false, 4, ckpt);
}

static void rec_join(int64_t *recs, int r, int kind, bool throw_flag, int64_t step)
{
    shard_rec_encode(recs + (size_t)r * REC_WORDS, kind, NULL, throw_flag, step, 0);
}

static void test_verdict_alike(void)
{
    int64_t recs[3 * REC_WORDS];
    shard_sop_t g = {.kind = SHARD_SOP_GATHER, .dtype = PSHARD_BF16, .nids = 2, .ids = ids12};
    for (int r = 0; r < 3; r++)
        rec_op(recs, r, &g, r == 1 ? 9 : 2);
    agreement_t ag;
    char err[512] = "";
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 3, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(ag.active, 3);
    CU_ASSERT_EQUAL(ag.first_active, 0);
    CU_ASSERT_FALSE(ag.desync);
    CU_ASSERT_FALSE(ag.any_joined);
    CU_ASSERT_EQUAL(ag.ckpt_request, 9); /* the newest any rank has seen */
    CU_ASSERT_EQUAL(ag.op.kind, SHARD_SOP_GATHER);
    CU_ASSERT_EQUAL(ag.op.dtype, PSHARD_BF16);
    CU_ASSERT_EQUAL_FATAL(ag.op.nids, 2);
    CU_ASSERT(ag.op.ids[0] == 1 && ag.op.ids[1] == 2);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &g, recs, err, sizeof(err)), PSHARD_OK);
    shard_agreement_free(&ag);
}

static void test_verdict_desync_names_both(void)
{
    int64_t recs[3 * REC_WORDS];
    shard_sop_t a = {.kind = SHARD_SOP_GATHER, .dtype = PSHARD_FP32, .nids = 2, .ids = ids12};
    shard_sop_t b = {.kind = SHARD_SOP_GATHER, .dtype = PSHARD_FP32, .nids = 2, .ids = ids13};
    rec_op(recs, 0, &a, 0);
    rec_op(recs, 1, &a, 0);
    rec_op(recs, 2, &b, 0);
    agreement_t ag;
    char err[512] = "";
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 3, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_TRUE(ag.desync);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &a, recs, err, sizeof(err)), PSHARD_ERR_DESYNC);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "rank 0 gather of 2 parameter(s) starting with #1"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "rank 2 gather"));
    shard_agreement_free(&ag);

    /* A step with other hyperparameters is a desync too (the words are hashed). */
    int64_t w1[SHARD_GROUP_WORDS] = {1}, w2[SHARD_GROUP_WORDS] = {2};
    shard_sop_t s1 = {.kind = SHARD_SOP_STEP, .nwords = SHARD_GROUP_WORDS, .words = w1};
    shard_sop_t s2 = {.kind = SHARD_SOP_STEP, .nwords = SHARD_GROUP_WORDS, .words = w2};
    rec_op(recs, 0, &s1, 0);
    rec_op(recs, 1, &s2, 0);
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_TRUE(ag.desync);
    CU_ASSERT_EQUAL(ag.op.kind, SHARD_SOP_STEP);
    CU_ASSERT_EQUAL(ag.op.nwords, SHARD_GROUP_WORDS);
    shard_agreement_free(&ag);
}

static void test_verdict_joined_ranks(void)
{
    int64_t recs[4 * REC_WORDS];
    shard_sop_t rs = {
        .kind = SHARD_SOP_REDUCE_SCATTER, .dtype = PSHARD_FP32, .nids = 2, .ids = ids12};
    rec_op(recs, 0, &rs, 0);
    rec_join(recs, 1, REC_JOINED, false, 3);
    rec_op(recs, 2, &rs, 0);
    rec_join(recs, 3, REC_JOIN, false, 5);
    agreement_t ag;
    char err[512] = "";
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 4, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(ag.active, 2); /* what gradients are averaged over */
    CU_ASSERT_TRUE(ag.any_joined);
    CU_ASSERT_FALSE(ag.all_joined);
    CU_ASSERT_FALSE(ag.desync);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &rs, recs, err, sizeof(err)), PSHARD_OK);
    shard_agreement_free(&ag);

    /* throw_on_early_termination: the others' operation runs on no rank. */
    rec_join(recs, 1, REC_JOINED, true, 3);
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 4, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(ag.throw_rank, 1);
    CU_ASSERT_EQUAL(ag.throw_step, 3);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &rs, recs, err, sizeof(err)), PSHARD_ERR_JOINED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "rank 1 joined at step 3"));
    shard_agreement_free(&ag);

    /* Everyone joined: the post hook, naming the last of this round's joiners. */
    rec_join(recs, 0, REC_JOIN, false, 6);
    rec_join(recs, 1, REC_JOINED, false, 3);
    rec_join(recs, 2, REC_JOIN, false, 6);
    rec_join(recs, 3, REC_JOINED, false, 5);
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 4, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_TRUE(ag.all_joined);
    CU_ASSERT_EQUAL(ag.active, 0);
    CU_ASSERT_EQUAL(ag.last_rank, 2);
    shard_agreement_free(&ag);
}

/* A step that sets the count: its value travels in the agreement, and two ranks that would set
 * different counts are a desync. */
static void test_verdict_set_step(void)
{
    int64_t recs[2 * REC_WORDS];
    shard_sop_t a = {.kind = SHARD_SOP_STEP, .set_step = true, .step_to = 1234567};
    shard_sop_t b = a;
    b.step_to = 7;
    agreement_t ag;
    char err[512] = "";
    rec_op(recs, 0, &a, 0);
    rec_op(recs, 1, &a, 0);
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_TRUE(ag.op.set_step);
    CU_ASSERT_FALSE(ag.op.trainer_stepped);
    CU_ASSERT_EQUAL(ag.op.step_to, 1234567);
    CU_ASSERT_EQUAL(ag.op.lr, 0.0);
    shard_agreement_free(&ag);
    rec_op(recs, 1, &b, 0);
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &a, recs, err, sizeof(err)), PSHARD_ERR_DESYNC);
    shard_agreement_free(&ag);
}

/* A step with a skip mask: its words (groups, then the mask) need not be whole groups, and a
 * mask that differs between ranks is a desync; without the skip bit the words must be. */
static void test_verdict_skip_mask(void)
{
    int64_t recs[2 * REC_WORDS];
    int64_t w1[SHARD_GROUP_WORDS + 1] = {0}, w2[SHARD_GROUP_WORDS + 1] = {0};
    w1[SHARD_GROUP_WORDS] = 5;
    w2[SHARD_GROUP_WORDS] = 4;
    shard_sop_t a = {
        .kind = SHARD_SOP_STEP, .skip = true, .words = w1, .nwords = SHARD_GROUP_WORDS + 1};
    shard_sop_t b = a;
    b.words = w2;
    agreement_t ag;
    char err[512] = "";
    rec_op(recs, 0, &a, 0);
    rec_op(recs, 1, &a, 0);
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_TRUE(ag.op.skip);
    CU_ASSERT_EQUAL(ag.op.nwords, SHARD_GROUP_WORDS + 1);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &a, recs, err, sizeof(err)), PSHARD_OK);
    shard_agreement_free(&ag);
    rec_op(recs, 1, &b, 0);
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &a, recs, err, sizeof(err)), PSHARD_ERR_DESYNC);
    shard_agreement_free(&ag);
    a.skip = false;
    err[0] = '\0';
    rec_op(recs, 0, &a, 0);
    rec_op(recs, 1, &a, 0);
    CU_ASSERT_EQUAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_ERR_DESYNC);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "malformed"));
    shard_agreement_free(&ag);
}

/* A step the trainers' own optimizer took: told apart from a server-side step (a desync), and
 * refused on every active rank while some rank has joined, naming each joined rank. */
static void test_verdict_trainer_step(void)
{
    int64_t recs[4 * REC_WORDS];
    shard_sop_t ts = {.kind = SHARD_SOP_STEP, .trainer_stepped = true};
    shard_sop_t plain = {.kind = SHARD_SOP_STEP};
    agreement_t ag;
    char err[512] = "";
    rec_op(recs, 0, &ts, 0);
    rec_op(recs, 1, &plain, 0);
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_TRUE(ag.op.trainer_stepped);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &ts, recs, err, sizeof(err)), PSHARD_ERR_DESYNC);
    CU_ASSERT_PTR_NOT_NULL(strstr(ag.desync_msg, "trainer's own optimizer"));
    shard_agreement_free(&ag);

    rec_op(recs, 0, &ts, 0);
    rec_join(recs, 1, REC_JOINED, false, 3);
    rec_op(recs, 2, &ts, 0);
    rec_join(recs, 3, REC_JOIN, false, 3);
    err[0] = '\0'; /* (the first error stays in a buffer) */
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 4, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &ts, recs, err, sizeof(err)),
                    PSHARD_ERR_FAILED_PRECONDITION);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "ranks 1, 3 joined"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "throw_on_early_termination"));
    shard_agreement_free(&ag);

    /* No rank joined: it runs. */
    rec_op(recs, 1, &ts, 0);
    rec_op(recs, 3, &ts, 0);
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 4, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &ts, recs, err, sizeof(err)), PSHARD_OK);
    shard_agreement_free(&ag);
}

static void test_verdict_broadcast_root_joined(void)
{
    int64_t recs[2 * REC_WORDS];
    shard_sop_t b = {.kind = SHARD_SOP_COLLECTIVE,
                     .dtype = PSHARD_FP32,
                     .coll_op = PSHARD_COLL_BROADCAST,
                     .count = 8,
                     .root = 1};
    rec_op(recs, 0, &b, 0);
    rec_join(recs, 1, REC_JOINED, false, 2);
    agreement_t ag;
    char err[512] = "";
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(ag.op.coll_op, PSHARD_COLL_BROADCAST);
    CU_ASSERT_EQUAL(ag.op.count, 8);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &b, recs, err, sizeof(err)), PSHARD_ERR_JOINED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "root, rank 1, has joined"));
    shard_agreement_free(&ag);
}

static void test_verdict_malformed(void)
{
    int64_t recs[2 * REC_WORDS];
    shard_sop_t g = {.kind = SHARD_SOP_GATHER, .nids = 2, .ids = ids12};
    rec_op(recs, 0, &g, 0);
    rec_op(recs, 1, &g, 0);
    agreement_t ag;
    char err[512] = "";
    recs[REC_WORDS + W_KIND] = 9;
    CU_ASSERT_EQUAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_ERR_DESYNC);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "rank 1 sent a malformed agreement record"));
    recs[REC_WORDS + W_KIND] = REC_OP;
    recs[REC_WORDS + W_NIDS] = -1;
    CU_ASSERT_EQUAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_ERR_DESYNC);
    recs[REC_WORDS + W_NIDS] = 2;
    recs[W_SOP] = SHARD_SOP_P2P + 1;
    CU_ASSERT_EQUAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_ERR_DESYNC);
}

/* Process groups are agreed like any operation: other groups (or another order) on one rank
 * are a desync naming new_group, and a joined rank makes the others refuse with JOINED naming
 * it (it would not build its communicators). */
static void test_verdict_new_groups(void)
{
    uint32_t a_words[] = {2, 2, 0, 1, 2, 2, 3}; /* [[0, 1], [2, 3]] */
    uint32_t b_words[] = {2, 2, 2, 3, 2, 0, 1}; /* the same groups in another order */
    shard_sop_t a = {.kind = SHARD_SOP_NEW_GROUPS, .nids = 7, .ids = a_words, .count = 2};
    shard_sop_t b = {.kind = SHARD_SOP_NEW_GROUPS, .nids = 7, .ids = b_words, .count = 2};
    int64_t recs[4 * REC_WORDS];
    for (int r = 0; r < 4; r++)
        rec_op(recs, r, r == 3 ? &b : &a, 0);
    agreement_t ag;
    char err[512] = "";
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 4, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &a, recs, err, sizeof(err)), PSHARD_ERR_DESYNC);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "rank 0 new_group of 2 group(s)"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "rank 3 new_group"));
    shard_agreement_free(&ag);

    rec_op(recs, 3, &a, 0);
    rec_join(recs, 2, REC_JOINED, false, 7);
    err[0] = '\0';
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 4, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &a, recs, err, sizeof(err)), PSHARD_ERR_JOINED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "rank 2 has joined"));
    shard_agreement_free(&ag);
}

/* A send / recv is agreed on its pair: both ends sending (roots 0 and 1) is a desync naming
 * send/recv; a joined peer makes the other end refuse with JOINED. */
static void test_verdict_p2p(void)
{
    shard_sop_t send0 = {.kind = SHARD_SOP_P2P, .dtype = PSHARD_FP32, .count = 4, .root = 0};
    shard_sop_t send1 = send0;
    send1.root = 1;
    int64_t recs[2 * REC_WORDS];
    rec_op(recs, 0, &send0, 0);
    rec_op(recs, 1, &send1, 0);
    agreement_t ag;
    char err[512] = "";
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &send0, recs, err, sizeof(err)), PSHARD_ERR_DESYNC);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "rank 0 send/recv of 4 fp32 from pair rank 0"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "from pair rank 1"));
    shard_agreement_free(&ag);
    rec_op(recs, 1, &send0, 0);
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_OK);
    err[0] = '\0';
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &send0, recs, err, sizeof(err)), PSHARD_OK);
    shard_agreement_free(&ag);
    rec_join(recs, 1, REC_JOINED, false, 3);
    CU_ASSERT_EQUAL_FATAL(shard_agree_verdict(recs, 2, &ag, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(shard_agree_refusal(&ag, &send0, recs, err, sizeof(err)), PSHARD_ERR_JOINED);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "joined"));
    shard_agreement_free(&ag);
}

/* ---- shard_op_run on one rank ------------------------------------------------------------ */

typedef struct {
    pshard_shard_server_t *s;
    pshard_comm_t *comm;
    void *region;
} one_rank_t;

static int one_rank(one_rank_t *o, bool with_model)
{
    memset(o, 0, sizeof(*o));
    pshard_shard_server_t *s = calloc(1, sizeof(*s));
    if (!s)
        return -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->op_mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    strcpy(s->session, "session-1");
    const char *peers[] = {"127.0.0.1:0"};
    pshard_comm_config_t cfg = {.rank = 0, .world_size = 1, .name = "ops", .peers = peers};
    char err[512] = "";
    if (pshard_comm_create(&cfg, &o->comm, err, sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "one-rank communicator: %s\n", err);
        return -1;
    }
    s->comm = o->comm;
    o->s = s;
    if (!with_model)
        return 0;
    const char *names[] = {"w", "b"};
    const int64_t shape_w[] = {4, 3}, shape_b[] = {3};
    const int64_t *shapes[] = {shape_w, shape_b};
    const size_t ndims[] = {2, 1};
    ps_optim_config_t oc;
    ps_optim_defaults(PS_OPTIM_SGD, &oc);
    oc.lr = 0.5;
    if (shard_model_create(0, 1, PSHARD_LAYOUT_FSDP2, 2, names, shapes, ndims, &oc, NULL, 0, NULL,
                           0, 0, false, NULL, 0, 0, "not shared in this unit test", &s->model, err,
                           sizeof(err)) != PSHARD_OK) {
        fprintf(stderr, "model: %s\n", err);
        return -1;
    }
    o->region = calloc(1, 4096);
    s->model_shm.base = o->region;
    s->model_shm.bytes = 4096;
    return 0;
}

static void one_rank_free(one_rank_t *o)
{
    if (!o->s)
        return;
    shard_model_free(o->s->model);
    shard_bufs_free(&o->s->bufs);
    pshard_comm_destroy(o->comm);
    pthread_mutex_destroy(&o->s->mu);
    pthread_mutex_destroy(&o->s->op_mu);
    pthread_cond_destroy(&o->s->cv);
    free(o->s);
    free(o->region);
}

typedef struct {
    int checks, runs;
    int active_seen;
    bool locked_in_run;
    pshard_status_t check_rc;
} probe_t;

static pshard_status_t probe_check(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                   char *err, size_t errlen)
{
    probe_t *p = op->arg;
    p->checks++;
    if (p->check_rc != PSHARD_OK)
        return ps_errf(err, errlen, p->check_rc, "refused by check");
    return PSHARD_OK;
}

static pshard_status_t probe_run(pshard_shard_server_t *s, pshard_comm_t *comm, shard_op_t *op,
                                 char *err, size_t errlen)
{
    probe_t *p = op->arg;
    p->runs++;
    p->active_seen = op->active;
    p->locked_in_run = pthread_mutex_trylock(&s->op_mu) == EBUSY;
    return PSHARD_OK;
}

static bool op_mu_free(pshard_shard_server_t *s)
{
    if (pthread_mutex_trylock(&s->op_mu) != 0)
        return false;
    pthread_mutex_unlock(&s->op_mu);
    return true;
}

/* shard_op_run into an emptied buffer (an error buffer keeps its first message). */
static pshard_status_t run_fresh(pshard_shard_server_t *s, shard_op_t *op, char *err, size_t errlen)
{
    err[0] = '\0';
    return shard_op_run(s, op, err, errlen);
}

static void test_op_refusals(void)
{
    one_rank_t o;
    CU_ASSERT_FATAL(one_rank(&o, false) == 0);
    pshard_shard_server_t *s = o.s;
    probe_t p = {0};
    shard_op_t op = {.session = "session-1",
                     .agree = true,
                     .sop = {.kind = SHARD_SOP_COLLECTIVE, .coll_op = PSHARD_COLL_BARRIER},
                     .opk = SHARD_OPK_BARRIER,
                     .check = probe_check,
                     .run = probe_run,
                     .arg = &p};
    char err[512] = "";

    s->comm = NULL; /* the cluster has not formed */
    CU_ASSERT_EQUAL(run_fresh(s, &op, err, sizeof(err)), PSHARD_ERR_UNAVAILABLE);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "has not formed"));
    s->comm = o.comm;
    s->fatal = PSHARD_ERR_TIMEOUT;
    strcpy(s->fatal_msg, "the cluster did not form in time");
    /* (not UNAVAILABLE: a trainer must not retry what cannot recover) */
    CU_ASSERT_EQUAL(run_fresh(s, &op, err, sizeof(err)), PSHARD_ERR_TIMEOUT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "shard server failed: the cluster did not form"));
    s->fatal = PSHARD_OK;

    op.session = "someone-else";
    CU_ASSERT_EQUAL(run_fresh(s, &op, err, sizeof(err)), PSHARD_ERR_FAILED_PRECONDITION);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "not the attached trainer's"));
    op.session = "session-1";
    op.needs_model = "no model is defined";
    CU_ASSERT_EQUAL(run_fresh(s, &op, err, sizeof(err)), PSHARD_ERR_FAILED_PRECONDITION);
    CU_ASSERT_STRING_EQUAL(err, "no model is defined");
    op.needs_model = NULL;
    p.check_rc = PSHARD_ERR_INVALID_ARGUMENT;
    CU_ASSERT_EQUAL(run_fresh(s, &op, err, sizeof(err)), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_STRING_EQUAL(err, "refused by check");
    /* Nothing ran, nothing was counted, and the lock is free again after every refusal. */
    CU_ASSERT_EQUAL(p.runs, 0);
    CU_ASSERT_EQUAL(p.checks, 1);
    CU_ASSERT_EQUAL(atomic_load(&s->op_stats[SHARD_OPK_BARRIER].ops), 0);
    CU_ASSERT_TRUE(op_mu_free(s));
    s->session[0] = '\0';
    CU_ASSERT_EQUAL(run_fresh(s, &op, err, sizeof(err)), PSHARD_ERR_FAILED_PRECONDITION);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "no trainer is attached"));
    one_rank_free(&o);
}

static void test_op_runs_under_the_lock(void)
{
    one_rank_t o;
    CU_ASSERT_FATAL(one_rank(&o, false) == 0);
    pshard_shard_server_t *s = o.s;
    probe_t p = {0};
    shard_op_t op = {.session = "session-1",
                     .agree = true,
                     .sop = {.kind = SHARD_SOP_COLLECTIVE, .coll_op = PSHARD_COLL_BARRIER},
                     .opk = SHARD_OPK_BARRIER,
                     .check = probe_check,
                     .run = probe_run,
                     .arg = &p};
    char err[512] = "";
    CU_ASSERT_EQUAL(shard_op_run(s, &op, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_EQUAL(p.checks, 1);
    CU_ASSERT_EQUAL(p.runs, 1);
    CU_ASSERT_EQUAL(p.active_seen, 1); /* the agreement ran: one contributing rank */
    CU_ASSERT_TRUE(p.locked_in_run);
    CU_ASSERT_TRUE(op_mu_free(s));
    CU_ASSERT_EQUAL(atomic_load(&s->op_stats[SHARD_OPK_BARRIER].ops), 1);
    one_rank_free(&o);
}

/* A gather, a reduce-scatter and a step through the operations' cores on one rank: the
 * gather returns the master weights, the gradient lands in the accumulator and SGD applies
 * it (lr 0.5). */
static void test_model_ops_on_one_rank(void)
{
    one_rank_t o;
    CU_ASSERT_FATAL(one_rank(&o, true) == 0);
    pshard_shard_server_t *s = o.s;
    shard_model_t *m = s->model;
    for (size_t k = 0; k < m->shard_numel; k++)
        m->master[k] = (float)k;
    char err[512] = "";
    float full[12] = {0};
    CU_ASSERT_EQUAL_FATAL(
        shard_gather_one(o.comm, m, 0, PSHARD_FP32, full, false, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT(full[0] == 0.0f && full[11] == 11.0f);
    float grad[12];
    for (int k = 0; k < 12; k++)
        grad[k] = 2.0f;
    CU_ASSERT_EQUAL_FATAL(
        shard_reduce_scatter_one(o.comm, m, 0, PSHARD_FP32, grad, false, 1, err, sizeof(err)),
        PSHARD_OK);
    CU_ASSERT(m->grad[0] == 2.0f && m->grad[11] == 2.0f);
    shard_sop_t step = {.kind = SHARD_SOP_STEP};
    double norm = 0;
    CU_ASSERT_EQUAL_FATAL(shard_run_step(s, o.comm, m, &step, 0, &norm, err, sizeof(err)),
                          PSHARD_OK);
    CU_ASSERT_EQUAL(m->step, 1);
    CU_ASSERT(m->master[0] == -1.0f && m->master[11] == 10.0f); /* w - 0.5 * 2 */
    CU_ASSERT(m->master[12] == 12.0f);                          /* b had no gradient */
    CU_ASSERT(norm > 6.92 && norm < 6.93);                      /* sqrt(12 * 4) */
    CU_ASSERT(m->grad[0] == 0.0f);
    one_rank_free(&o);
}

/* Join on one rank: every rank has joined at once, this one last, nothing shadowed. */
static void test_join_alone(void)
{
    one_rank_t o;
    CU_ASSERT_FATAL(one_rank(&o, true) == 0);
    shard_join_result_t r = {.throw_on_early_termination = false};
    shard_op_t op = {.session = "session-1",
                     .needs_model = "define the model before joining",
                     .opk = -1,
                     .run = shard_join_run,
                     .arg = &r};
    char err[512] = "";
    CU_ASSERT_EQUAL(shard_op_run(o.s, &op, err, sizeof(err)), PSHARD_OK);
    CU_ASSERT_TRUE(r.is_last_joiner);
    CU_ASSERT_EQUAL(r.last_rank, 0);
    CU_ASSERT_EQUAL(r.shadowed, 0);
    CU_ASSERT_FALSE(o.s->joined);
    one_rank_free(&o);
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"verdict: ranks that ask alike", test_verdict_alike},
        {"verdict: a desync names both sides", test_verdict_desync_names_both},
        {"verdict: joined, throwing and all-joined ranks", test_verdict_joined_ranks},
        {"verdict: a broadcast whose root joined", test_verdict_broadcast_root_joined},
        {"verdict: a step the trainers' optimizer took", test_verdict_trainer_step},
        {"verdict: a step that sets the count", test_verdict_set_step},
        {"verdict: a step with a skip mask", test_verdict_skip_mask},
        {"verdict: malformed records", test_verdict_malformed},
        {"verdict: process groups", test_verdict_new_groups},
        {"verdict: send / recv", test_verdict_p2p},
        {"op: refusals leave the lock free and run nothing", test_op_refusals},
        {"op: check, agree and run under the lock", test_op_runs_under_the_lock},
        {"op: gather, reduce-scatter and step on one rank", test_model_ops_on_one_rank},
        {"op: join alone", test_join_alone},
        {NULL, NULL},
    };
    return ps_test_main("shard_ops", cases);
}
