/* Sharded checkpoints on the shard server side: every rank writes its own shard file (master
 * weights and optimizer state, with its CRC-32C), rank 0 commits the step by writing the
 * manifest last (ckpt/include/pshard/ckpt.h has the format), and loading restores any
 * world size or layout by reading, for each of this rank's pieces, just the byte ranges of the
 * old pieces it overlaps. Every function here is collective over the ring and runs the same
 * collectives on every rank whatever happened locally, so a local failure never desyncs. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/ckpt.h"
#include "pshard/coord_client.h"
#include "pshard/coordinator.pb-c.h"
#include "pshard/log.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"

#include "shard_cuda.h"
#include "shard_internal.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoint files are little-endian fp32; a big-endian host needs byte swapping here"
#endif

#define CKPT_TAG 0x434b5054u /* "CKPT" */

static int nsections(const shard_model_t *m)
{
    return 1 + m->nstate;
}

static float *section_ptr(shard_model_t *m, int k)
{
    return k == 0 ? m->master : k == 1 ? m->state0 : m->state1;
}

/* GPU-resident shards: a checkpoint streams through a host buffer of at most BOUNCE_BYTES (or
 * one parameter piece, if larger), so no host copy of the whole shard state is needed;
 * host-resident shards are read and written in place. */
#define BOUNCE_BYTES (16u << 20)
#define BOUNCE_BYTES_EMULATED 4096u

typedef struct {
    uint8_t *buf; /* NULL for host-resident shards */
    size_t cap;
} bounce_t;

static pshard_status_t bounce_open(const shard_model_t *m, bounce_t *b, char *err, size_t errlen)
{
    memset(b, 0, sizeof(*b));
    if (!m->dev)
        return PSHARD_OK;
    size_t total = m->shard_numel * sizeof(float), piece = m->max_piece * sizeof(float);
    /* The tests' host emulation of a GPU takes a small buffer, so that their small models
     * cross many buffer boundaries. */
    size_t limit = m->dev->host_memory ? BOUNCE_BYTES_EMULATED : BOUNCE_BYTES;
    b->cap = total < limit ? total : limit;
    if (piece > b->cap)
        b->cap = piece;
    if (b->cap == 0)
        b->cap = 1;
    b->buf = malloc(b->cap);
    if (!b->buf)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY,
                       "no host memory for a %zu-byte checkpoint buffer", b->cap);
    return PSHARD_OK;
}

static void bounce_close(bounce_t *b)
{
    free(b->buf);
    memset(b, 0, sizeof(*b));
}

/* The bytes of a section to handle next from offset done of total: a bounce buffer's worth,
 * or for host shards the whole rest. */
static size_t bounce_chunk(const bounce_t *b, size_t done, size_t total)
{
    size_t left = total - done;
    return b->buf && left > b->cap ? b->cap : left;
}

/* All-gathers `words` int64 of every rank into out (world * words). */
static pshard_status_t gather_words(pshard_comm_t *comm, const int64_t *mine, int64_t *out,
                                    size_t words, const char *label, char *err, size_t errlen)
{
    pshard_coll_args_t a = {.op = PSHARD_COLL_ALL_GATHER,
                            .dtype = PSHARD_INT64,
                            .send = mine,
                            .recv = out,
                            .count = words,
                            .tag = CKPT_TAG,
                            .label = label};
    return pshard_coll_run(comm, &a, err, errlen);
}

static pshard_status_t broadcast_words(pshard_comm_t *comm, int64_t *words, size_t n,
                                       const char *label, char *err, size_t errlen)
{
    pshard_coll_args_t a = {.op = PSHARD_COLL_BROADCAST,
                            .dtype = PSHARD_INT64,
                            .send = words,
                            .recv = words,
                            .count = n,
                            .root = 0,
                            .tag = CKPT_TAG + 1,
                            .label = label};
    return pshard_coll_run(comm, &a, err, errlen);
}

void shard_fault_point(const char *name, int64_t step)
{
    const char *f = getenv("PSHARD_FAULT_INJECT");
    size_t n = strlen(name);
    if (!f || strncmp(f, name, n) != 0 || f[n] != ':')
        return;
    int64_t at = -1;
    if (ps_parse_i64(f + n + 1, 0, INT64_MAX, &at) != 0 || at != step)
        return;
    PS_ERROR(PS_SUB_SHARD, "PSHARD_FAULT_INJECT: killing this process at %s of step %" PRId64, name,
             step);
    raise(SIGKILL);
}

/* Writes this rank's shard file into the step directory dfd (GPU shards through the bounce
 * buffer) and returns its size and CRC-32C. A failure leaves no file behind. */
static pshard_status_t write_shard(shard_model_t *m, const bounce_t *b, int dfd,
                                   const char *step_dir, int rank, int world, uint64_t *bytes,
                                   uint32_t *crc, char *err, size_t errlen)
{
    ps_ckpt_shard_out_t *out;
    PS_CHECK(ps_ckpt_shard_out_open(dfd, step_dir, rank, world, &out, err, errlen));
    pshard_status_t rc = PSHARD_OK;
    for (int k = 0; k < nsections(m) && rc == PSHARD_OK; k++) {
        const uint8_t *sec = (const uint8_t *)section_ptr(m, k);
        size_t total = m->shard_numel * sizeof(float);
        /* Host shards: one pass over the section; GPU shards: a bounce buffer at a time. */
        for (size_t done = 0, len; done < total && rc == PSHARD_OK; done += len) {
            len = bounce_chunk(b, done, total);
            const uint8_t *p = sec + done;
            if (b->buf) {
                rc = m->dev->copy(m->device, b->buf, p, len, err, errlen);
                p = b->buf;
            }
            if (rc == PSHARD_OK)
                rc = ps_ckpt_shard_out_write(out, p, len, err, errlen);
        }
    }
    pshard_status_t rc2 = ps_ckpt_shard_out_close(out, rc == PSHARD_OK, bytes, crc, err, errlen);
    return rc != PSHARD_OK ? rc : rc2;
}

static const char *optim_kind_name(ps_optim_kind_t k)
{
    return k == PS_OPTIM_ADAM ? "adam" : k == PS_OPTIM_ADAMW ? "adamw" : "sgd";
}

/* The manifest rank 0 commits: the model's parameters, layout, optimizer and every rank's
 * file with its pieces (from the layout, so rank 0 can describe every rank's file). */
static pshard_status_t build_manifest(const shard_model_t *m, int world, const int64_t *gathered,
                                      size_t words, ps_ckpt_manifest_t *man, char *err,
                                      size_t errlen)
{
    memset(man, 0, sizeof(*man));
    man->step = m->step;
    man->aborted_steps = m->aborted_steps;
    man->world_size = world;
    man->layout = ps_layout_kind(m->layout);
    ps_strlcpy(man->optim.kind, optim_kind_name(m->optim.kind), sizeof(man->optim.kind));
    man->optim.lr = m->optim.lr;
    man->optim.momentum = m->optim.momentum;
    man->optim.dampening = m->optim.dampening;
    man->optim.nesterov = m->optim.nesterov;
    man->optim.weight_decay = m->optim.weight_decay;
    man->optim.beta1 = m->optim.beta1;
    man->optim.beta2 = m->optim.beta2;
    man->optim.eps = m->optim.eps;
    man->optim.max_grad_norm = m->max_grad_norm;
    man->nsections = nsections(m);
    ps_strlcpy(man->sections[0], "master", sizeof(man->sections[0]));
    if (m->optim.kind == PS_OPTIM_SGD) {
        if (man->nsections > 1)
            ps_strlcpy(man->sections[1], "momentum_buffer", sizeof(man->sections[1]));
    } else {
        ps_strlcpy(man->sections[1], "exp_avg", sizeof(man->sections[1]));
        ps_strlcpy(man->sections[2], "exp_avg_sq", sizeof(man->sections[2]));
    }
    man->nparams = m->nparams;
    man->params = calloc(m->nparams, sizeof(*man->params));
    man->nfiles = (size_t)world;
    man->files = calloc((size_t)world, sizeof(*man->files));
    if (!man->params || !man->files)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    for (size_t p = 0; p < m->nparams; p++) {
        ps_strlcpy(man->params[p].name, m->params[p].name, sizeof(man->params[p].name));
        man->params[p].ndim = m->params[p].ndim;
        memcpy(man->params[p].shape, m->params[p].shape, sizeof(man->params[p].shape));
        man->params[p].skipped = m->step - shard_model_pstep(m, p);
    }
    for (int r = 0; r < world; r++) {
        ps_ckpt_file_t *f = &man->files[r];
        f->rank = r;
        ps_ckpt_shard_name(r, world, f->path, sizeof(f->path));
        f->bytes = (uint64_t)gathered[(size_t)r * words + 1];
        f->crc32c = (uint32_t)gathered[(size_t)r * words + 2];
        f->shard_numel = ps_layout_shard_numel(m->layout, r);
        f->pieces = calloc(m->nparams ? m->nparams : 1, sizeof(*f->pieces));
        if (!f->pieces)
            return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
        for (size_t p = 0; p < m->nparams; p++) {
            size_t cnt = ps_layout_counts(m->layout, p)[r];
            if (cnt == 0)
                continue;
            f->pieces[f->npieces++] = (ps_ckpt_piece_t){
                .param = (uint32_t)p,
                .start = ps_layout_piece_offset(m->layout, p, r),
                .count = cnt,
                .offset = ps_layout_shard_offset(m->layout, p, r),
            };
        }
    }
    return PSHARD_OK;
}

static void manifest_release(ps_ckpt_manifest_t *man)
{
    for (size_t i = 0; man->files && i < man->nfiles; i++)
        free(man->files[i].pieces);
    free(man->files);
    free(man->params);
    memset(man, 0, sizeof(*man));
}

/* Every rank of comm (the ranks the model is sharded over) writes its shard; its rank 0
 * commits. */
static pshard_status_t save_on(pshard_shard_server_t *s, pshard_comm_t *comm, shard_model_t *m,
                               char *dir, size_t dirlen, char *err, size_t errlen)
{
    int rank = pshard_comm_rank(comm), world = pshard_comm_world_size(comm);
    const char *root = s->cfg.checkpoint_dir;
    char step_dir[PATH_MAX], local_err[512] = "";
    pshard_status_t local = PSHARD_OK;
    bool committed = false;
    int dfd = -1;
    if (!root || !*root) {
        local = ps_errf(local_err, sizeof(local_err), PSHARD_ERR_FAILED_PRECONDITION,
                        "no --checkpoint-dir is configured on rank %d", rank);
    } else {
        ps_ckpt_step_dir(root, m->step, step_dir, sizeof(step_dir));
        local = ps_ckpt_step_dir_make(root, m->step, &dfd, local_err, sizeof(local_err));
        struct stat st;
        committed =
            local == PSHARD_OK && fstatat(dfd, PS_CKPT_MANIFEST, &st, AT_SYMLINK_NOFOLLOW) == 0;
    }
    int64_t t0 = ps_now_ns();
    /* Phase 1: every rank writes its shard (unless this step is committed already: saving the
     * same state twice would only risk the committed copy). */
    int64_t mine[3] = {local == PSHARD_OK, 0, 0};
    if (local == PSHARD_OK && !committed) {
        uint64_t bytes = 0;
        uint32_t crc = 0;
        bounce_t b;
        local = bounce_open(m, &b, local_err, sizeof(local_err));
        if (local == PSHARD_OK)
            local = write_shard(m, &b, dfd, step_dir, rank, world, &bytes, &crc, local_err,
                                sizeof(local_err));
        bounce_close(&b);
        mine[0] = local == PSHARD_OK;
        mine[1] = (int64_t)bytes;
        mine[2] = crc;
    }
    if (committed)
        mine[0] = 2;
    if (dfd >= 0)
        close(dfd);
    int64_t *all = calloc((size_t)world * 3, sizeof(int64_t));
    if (!all)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    pshard_status_t rc = gather_words(comm, mine, all, 3, "checkpoint shards", err, errlen);
    int failed = -1;
    bool all_committed = true;
    for (int r = 0; rc == PSHARD_OK && r < world; r++) {
        if (all[(size_t)r * 3] == 0 && failed < 0)
            failed = r;
        if (all[(size_t)r * 3] != 2)
            all_committed = false;
    }
    /* Phase 2: rank 0 commits, then tells everyone whether it did. */
    int64_t verdict[1] = {0};
    char commit_err[PSHARD_ERRLEN] = "";
    if (rc == PSHARD_OK && rank == 0 && failed < 0 && !all_committed) {
        ps_ckpt_manifest_t man;
        pshard_status_t mr = build_manifest(m, world, all, 3, &man, commit_err, sizeof(commit_err));
        if (mr == PSHARD_OK)
            shard_fault_point("ckpt-before-manifest", m->step);
        if (mr == PSHARD_OK)
            mr = ps_ckpt_manifest_write(step_dir, &man, commit_err, sizeof(commit_err));
        manifest_release(&man);
        verdict[0] = mr == PSHARD_OK;
        if (mr == PSHARD_OK) {
            char perr[PSHARD_ERRLEN] = "";
            if (ps_ckpt_prune(root, (int)s->cfg.checkpoint_keep, perr, sizeof(perr)) != PSHARD_OK)
                PS_WARN(PS_SUB_SHARD, "pruning old checkpoints: %s", perr);
        } else {
            PS_ERROR(PS_SUB_SHARD, "committing the checkpoint of step %" PRId64 ": %s", m->step,
                     commit_err);
        }
    } else if (rank == 0) {
        verdict[0] = failed < 0;
    }
    if (rc == PSHARD_OK)
        rc = broadcast_words(comm, verdict, 1, "checkpoint commit", err, errlen);
    free(all);
    if (rc != PSHARD_OK)
        return rc;
    if (failed >= 0) {
        if (failed == rank)
            return ps_errf(err, errlen, local, "checkpoint of step %" PRId64 " not saved: %s",
                           m->step, local_err);
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM,
                       "checkpoint of step %" PRId64 " not saved: rank %d could not write its "
                       "shard (its log says why); the previous checkpoints are intact",
                       m->step, failed);
    }
    if (!verdict[0])
        return ps_errf(err, errlen, PSHARD_ERR_SYSTEM,
                       "checkpoint of step %" PRId64 " not committed: %s", m->step,
                       rank == 0 ? commit_err
                                 : "rank 0 could not write the manifest (its log "
                                   "says why); the previous checkpoints are intact");
    char abs[PATH_MAX];
    if (!realpath(step_dir, abs))
        ps_strlcpy(abs, step_dir, sizeof(abs));
    ps_strlcpy(dir, abs, dirlen);
    PS_INFO(PS_SUB_SHARD, "checkpoint of step %" PRId64 " %s in %s (%.1f ms, %zu bytes here)",
            m->step, all_committed ? "was already committed" : "committed", abs,
            (double)(ps_now_ns() - t0) / 1e6,
            (size_t)nsections(m) * m->shard_numel * sizeof(float));
    return PSHARD_OK;
}

/* Checks the manifest describes this model: same parameters (names, shapes, order) and the
 * same optimizer state. */
static pshard_status_t check_matches(const shard_model_t *m, const ps_ckpt_manifest_t *man,
                                     const char *dir, char *err, size_t errlen)
{
    if (man->nparams != m->nparams)
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "checkpoint %s has %zu parameters; the model defines %zu", dir, man->nparams,
                       m->nparams);
    for (size_t p = 0; p < m->nparams; p++) {
        const ps_ckpt_param_t *cp = &man->params[p];
        bool same = strcmp(cp->name, m->params[p].name) == 0 && cp->ndim == m->params[p].ndim &&
                    memcmp(cp->shape, m->params[p].shape, (size_t)cp->ndim * sizeof(int64_t)) == 0;
        if (!same)
            return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                           "checkpoint %s: parameter #%zu is '%s' (%d dims, first %" PRId64
                           "); the model defines '%s' (%d dims, first %" PRId64 ")",
                           dir, p, cp->name, cp->ndim, cp->shape[0], m->params[p].name,
                           m->params[p].ndim, m->params[p].shape[0]);
    }
    if (strcmp(man->optim.kind, optim_kind_name(m->optim.kind)) != 0 ||
        man->nsections != nsections(m))
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "checkpoint %s holds %s state (%d sections); the model uses %s (%d)", dir,
                       man->optim.kind, man->nsections, optim_kind_name(m->optim.kind),
                       nsections(m));
    return PSHARD_OK;
}

/* Reads file f, which holds exactly this rank's shard, into the model's sections (GPU shards
 * through the bounce buffer), checking its size and CRC-32C on the way. */
static pshard_status_t read_own_file(shard_model_t *m, const bounce_t *b, const char *step_dir,
                                     const ps_ckpt_file_t *f, char *err, size_t errlen)
{
    ps_ckpt_shard_in_t *in;
    PS_CHECK(ps_ckpt_shard_in_open(step_dir, f, &in, err, errlen));
    pshard_status_t rc = PSHARD_OK;
    for (int k = 0; k < nsections(m) && rc == PSHARD_OK; k++) {
        uint8_t *sec = (uint8_t *)section_ptr(m, k);
        size_t total = m->shard_numel * sizeof(float);
        /* Host shards: straight into the section; GPU shards: a bounce buffer at a time. */
        for (size_t done = 0, len; done < total && rc == PSHARD_OK; done += len) {
            len = bounce_chunk(b, done, total);
            rc = ps_ckpt_shard_in_read(in, b->buf ? b->buf : sec + done, len, err, errlen);
            if (rc == PSHARD_OK && b->buf)
                rc = m->dev->copy(m->device, sec + done, b->buf, len, err, errlen);
        }
    }
    pshard_status_t rc2 = ps_ckpt_shard_in_close(in, rc == PSHARD_OK, err, errlen);
    return rc != PSHARD_OK ? rc : rc2;
}

pshard_status_t shard_ckpt_save(pshard_shard_server_t *s, pshard_comm_t *comm, shard_model_t *m,
                                char *dir, size_t dirlen, char *err, size_t errlen)
{
    if (!m->replicate_comm)
        return save_on(s, comm, m, dir, dirlen, err, errlen);
    /* HSDP: the replicas hold the same shards, so the first one writes the checkpoint (as
     * torch's does for a replicated dimension) and tells the others how it went. */
    int64_t verdict[1] = {PSHARD_OK};
    char why[PSHARD_ERRLEN] = "";
    bool writer = pshard_comm_rank(m->replicate_comm) == 0;
    if (writer)
        verdict[0] = save_on(s, m->shard_comm, m, dir, dirlen, why, sizeof(why));
    PS_CHECK(
        broadcast_words(m->replicate_comm, verdict, 1, "checkpoint by replica 0", err, errlen));
    if (verdict[0] != PSHARD_OK)
        return ps_errf(err, errlen, (pshard_status_t)verdict[0], "%s",
                       writer ? why
                              : "checkpoint not saved: replica 0 could not write it (its ranks' "
                                "logs say why); the previous checkpoints are intact");
    if (!writer && s->cfg.checkpoint_dir) {
        char step_dir[PATH_MAX], abs[PATH_MAX];
        ps_ckpt_step_dir(s->cfg.checkpoint_dir, m->step, step_dir, sizeof(step_dir));
        ps_strlcpy(dir, realpath(step_dir, abs) ? abs : step_dir, dirlen);
    }
    return PSHARD_OK;
}

pshard_status_t shard_ckpt_load(pshard_shard_server_t *s, pshard_comm_t *comm, shard_model_t *m,
                                const char *root, bool *restored, char *dir, size_t dirlen,
                                char *err, size_t errlen)
{
    *restored = false;
    /* HSDP: every replica reads the shards of its shard ranks (the same files). */
    comm = m->shard_comm ? m->shard_comm : comm;
    int rank = pshard_comm_rank(comm), world = pshard_comm_world_size(comm);
    char local_err[PSHARD_ERRLEN] = "";
    pshard_status_t local = PSHARD_OK;
    /* Rank 0 picks the step (the newest committed), so all restore the same one. */
    /* -1: nothing there, start fresh; -2: nothing loadable, and something was refused (or the
     * root could not be listed): an error, unless --resume-allow-fresh. */
    int64_t pick[1] = {-1};
    char refused[768] = "";
    if (rank == 0) {
        int64_t *steps = NULL;
        size_t n = 0;
        pshard_status_t lr =
            ps_ckpt_list(root, &steps, &n, refused, sizeof(refused), local_err, sizeof(local_err));
        if (lr == PSHARD_OK && n > 0)
            pick[0] = steps[n - 1];
        else if (lr != PSHARD_OK)
            ps_strlcpy(refused, local_err, sizeof(refused));
        if (pick[0] < 0 && refused[0]) {
            if (s->cfg.resume_allow_fresh)
                PS_WARN(PS_SUB_SHARD,
                        "no loadable checkpoint under %s (%s): starting fresh, as "
                        "--resume-allow-fresh says",
                        root, refused);
            else
                pick[0] = -2;
        }
        free(steps);
        local_err[0] = '\0';
    }
    PS_CHECK(broadcast_words(comm, pick, 1, "checkpoint pick", err, errlen));
    if (pick[0] == -2) {
        /* Every rank's trainer gets rank 0's reasons, whichever reports first. */
        int64_t words[sizeof(refused) / 8];
        memcpy(words, refused, sizeof(words));
        PS_CHECK(
            broadcast_words(comm, words, PS_ARRAY_LEN(words), "checkpoint refusals", err, errlen));
        memcpy(refused, words, sizeof(words));
        refused[sizeof(refused) - 1] = '\0';
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "nothing to resume from in %s: %s (--resume-allow-fresh starts from "
                       "the initial values instead)",
                       root, refused);
    }
    if (pick[0] < 0) {
        PS_INFO(PS_SUB_SHARD, "no checkpoint under %s yet: starting fresh", root);
        return PSHARD_OK;
    }
    char step_dir[PATH_MAX];
    ps_ckpt_step_dir(root, pick[0], step_dir, sizeof(step_dir));
    int64_t t0 = ps_now_ns();
    /* Phase 1: the manifest, the model check, and this rank's share of the checksums. */
    ps_ckpt_manifest_t *man = NULL;
    int64_t bad_file = -1;
    bounce_t b;
    local = bounce_open(m, &b, local_err, sizeof(local_err));
    if (local == PSHARD_OK)
        local = ps_ckpt_manifest_read(step_dir, &man, local_err, sizeof(local_err));
    if (local == PSHARD_OK)
        local = check_matches(m, man, step_dir, local_err, sizeof(local_err));
    /* Same world size and layout (the common restart): this rank's file is exactly its shard,
     * so one pass reads it into place and checks its CRC at the same time. */
    bool direct = local == PSHARD_OK && man->world_size == world &&
                  man->layout == ps_layout_kind(m->layout) &&
                  man->files[rank].shard_numel == m->shard_numel;
    for (size_t f = (size_t)rank; local == PSHARD_OK && f < man->nfiles; f += (size_t)world) {
        local = direct
                    ? read_own_file(m, &b, step_dir, &man->files[f], local_err, sizeof(local_err))
                    : ps_ckpt_verify_file(step_dir, &man->files[f], local_err, sizeof(local_err));
        if (local != PSHARD_OK)
            bad_file = (int64_t)f;
    }
    int64_t mine[2] = {local == PSHARD_OK, bad_file};
    int64_t *all = calloc((size_t)world * 2, sizeof(int64_t));
    if (!all) {
        ps_ckpt_manifest_free(man);
        bounce_close(&b);
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    }
    pshard_status_t rc = gather_words(comm, mine, all, 2, "checkpoint verify", err, errlen);
    int failed = -1;
    for (int r = 0; rc == PSHARD_OK && r < world && failed < 0; r++)
        if (all[(size_t)r * 2] == 0)
            failed = r;
    /* Phase 2: read this rank's pieces of every section, from whichever old files hold
     * them. */
    if (rc == PSHARD_OK && failed < 0) {
        for (size_t p = 0; !direct && p < m->nparams && local == PSHARD_OK; p++) {
            size_t cnt = ps_layout_counts(m->layout, p)[rank];
            if (cnt == 0)
                continue;
            size_t start = ps_layout_piece_offset(m->layout, p, rank);
            size_t off = ps_layout_shard_offset(m->layout, p, rank);
            for (int k = 0; k < nsections(m) && local == PSHARD_OK; k++) {
                /* GPU shards: the piece goes through the bounce buffer (it fits). */
                float *dst = b.buf ? (float *)(void *)b.buf : section_ptr(m, k) + off;
                local = ps_ckpt_read_range(step_dir, man, k, (uint32_t)p, start, cnt, dst,
                                           local_err, sizeof(local_err));
                if (local == PSHARD_OK && b.buf)
                    local = m->dev->copy(m->device, section_ptr(m, k) + off, b.buf,
                                         cnt * sizeof(float), local_err, sizeof(local_err));
            }
        }
        mine[0] = local == PSHARD_OK;
        rc = gather_words(comm, mine, all, 2, "checkpoint read", err, errlen);
        for (int r = 0; rc == PSHARD_OK && r < world && failed < 0; r++)
            if (all[(size_t)r * 2] == 0)
                failed = r;
    }
    int64_t saved_step = man ? man->step : 0, saved_aborted = man ? man->aborted_steps : 0;
    /* Each parameter's own count (torch.optim's per-parameter step), set with the step's. */
    size_t nskipped = man ? man->nparams : 0;
    int64_t *skipped = man ? calloc(nskipped ? nskipped : 1, sizeof(int64_t)) : NULL;
    if (man && !skipped && rc == PSHARD_OK)
        rc = ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory");
    for (size_t p = 0; skipped && p < nskipped; p++)
        skipped[p] = man->params[p].skipped;
    int64_t file_named = failed >= 0 ? all[(size_t)failed * 2 + 1] : -1;
    char file_name[64] = "";
    if (man && file_named >= 0 && (size_t)file_named < man->nfiles)
        ps_strlcpy(file_name, man->files[file_named].path, sizeof(file_name));
    ps_ckpt_manifest_free(man);
    bounce_close(&b);
    free(all);
    if (rc != PSHARD_OK || failed >= 0)
        free(skipped);
    if (rc != PSHARD_OK)
        return rc;
    if (failed >= 0) {
        if (failed == rank)
            return ps_errf(err, errlen, local, "cannot resume from %s: %s", step_dir, local_err);
        if (file_name[0])
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "cannot resume from %s: %s failed verification on rank %d (its log "
                           "says why)",
                           step_dir, file_name, failed);
        return ps_errf(err, errlen, PSHARD_ERR_FAILED_PRECONDITION,
                       "cannot resume from %s: rank %d refused it (its log says why)", step_dir,
                       failed);
    }
    pthread_mutex_lock(&s->mu);
    shard_model_set_step(m, saved_step);
    m->aborted_steps = saved_aborted; /* the data position goes on after them too */
    for (size_t p = 0; skipped && p < m->nparams && p < nskipped; p++)
        m->psteps[p] = saved_step - skipped[p];
    pthread_mutex_unlock(&s->mu);
    free(skipped);
    char abs[PATH_MAX];
    if (!realpath(step_dir, abs))
        ps_strlcpy(abs, step_dir, sizeof(abs));
    ps_strlcpy(dir, abs, dirlen);
    *restored = true;
    PS_INFO(PS_SUB_SHARD, "resumed step %" PRId64 " from %s (%.1f ms)%s", saved_step, abs,
            (double)(ps_now_ns() - t0) / 1e6,
            saved_aborted > 0 ? "; its aborted steps count in the data position" : "");
    return PSHARD_OK;
}

/* Answers a `pshardctl checkpoint save` request in the coordinator's store (rank 0). */
static void answer_request(pshard_shard_server_t *s, int64_t request, const char *value)
{
    char key[96];
    snprintf(key, sizeof(key), "pshard/checkpoint/done/%" PRId64, request);
    char err[PSHARD_ERRLEN] = "";
    if (ps_coord_store_put(s->coord, key, value, strlen(value), 5000, err, sizeof(err)) !=
        PSHARD_OK)
        PS_WARN(PS_SUB_SHARD, "cannot answer checkpoint request %" PRId64 ": %s", request, err);
}

pshard_status_t shard_ckpt_after_step(pshard_shard_server_t *s, pshard_comm_t *comm,
                                      shard_model_t *m, int64_t ckpt_request, char *err,
                                      size_t errlen)
{
    bool periodic = s->cfg.checkpoint_every > 0 && m->step % s->cfg.checkpoint_every == 0 &&
                    s->cfg.checkpoint_dir;
    bool requested = ckpt_request > s->ckpt_handled;
    if (!periodic && !requested)
        return PSHARD_OK;
    char dir[PATH_MAX] = "", serr[768] = "";
    pshard_status_t rc = shard_ckpt_save(s, comm, m, dir, sizeof(dir), serr, sizeof(serr));
    if (requested) {
        s->ckpt_handled = ckpt_request;
        if (pshard_comm_rank(comm) == 0) {
            char value[PATH_MAX + 900];
            if (rc == PSHARD_OK)
                snprintf(value, sizeof(value), "step=%" PRId64 " dir=%s", m->step, dir);
            else
                snprintf(value, sizeof(value), "error=%s", serr);
            answer_request(s, ckpt_request, value);
        }
    }
    if (rc != PSHARD_OK)
        return ps_errf(err, errlen, rc, "step %" PRId64 " was applied, but %s", m->step, serr);
    return PSHARD_OK;
}
