/* Healing a lost shard server from an HSDP replica (issue 29 §2). With R replicas x S shard
 * ranks every shard lives on R servers. When a ranked server is lost (its lease lapsed, or its
 * launcher declared it lost) and the model can heal (shard_heal_possible), the survivors abort
 * the step in flight as for a lost trainer (STEP_ABORTED: nothing of it is applied) and wait,
 * until the replacement deadline, for a server to take the vacant rank. That server learns from
 * the coordinator that it replaces a lost one (MemberView.replaces_lost); the survivors publish
 * the new ring's serial and the mesh's names in the store (pshard/heal/g<gen>/meta) and the
 * keyed process groups that held the lost rank, every rank builds the new ring and agrees on
 * the step count (the newcomer counts as "healing"), the mesh's rings are rebuilt, and on the
 * replicate ring of the lost shard index the lowest surviving rank broadcasts its shard state
 * (master weights, optimizer state, per-parameter steps, the groups' hyperparameters, the step
 * counts). The newcomer keeps it until its trainer defines the model, and adopts it then
 * instead of initial values or a checkpoint, refusing another model. */
#ifndef PSHARD_SHARD_HEAL_H
#define PSHARD_SHARD_HEAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pshard/status.h"
#include "shard_model.h"

struct pshard_shard_server;
struct pshard_comm;

/* What a replacement server received before its trainer defined the model (op_mu). */
typedef struct shard_heal_state {
    uint32_t serial;  /* the ring serial the survivors rebuilt under */
    uint64_t attempt; /* the mesh rings' definition attempt (their names) */
    int replicas, shards;
    uint64_t fingerprint;
    int source; /* the world rank the state came from; -1 until received */
    int64_t step, aborted_steps;
    size_t shard_numel, nparams, ngroups;
    int nstate;
    float *master, *state[2];
    int64_t *psteps, *group_words;
    struct pshard_comm *shard_comm, *replicate_comm; /* owned until adopted */
    int64_t started_ns;                              /* when the metadata arrived */
} shard_heal_state_t;

/* Flags of a rank in the agreement after a step abort (shard_member.c's reconcile_step). */
#define SHARD_HEAL_HAS_MODEL 1 /* the rank holds a defined model */
#define SHARD_HEAL_HEALING 2   /* the rank replaces a lost server and awaits its state */

/* With mu held: whether a lost ranked peer can be healed from a replica on this server's
 * side: a defined HSDP model (more than one replica) in host memory, the servers' own
 * optimizer (not optimizer_in_backward, not a trainer's torch.optim, whose state lives with
 * the lost trainer), and --trainer-replace-ms set. Else why (for the error) says what is
 * missing. */
bool shard_heal_possible(const struct pshard_shard_server *s, char *why, size_t len);

/* Says in the coordinator's store whether this server's model can heal (shard_heal_possible),
 * where pshardrun looks before it replaces a lost shard server alone instead of restarting the
 * job: sets pshard/heal/capable at a definition that can, deletes it once it cannot (the first
 * step of a trainer's own optimizer). Best effort: a failure is logged. No lock held. */
void shard_heal_capable(struct pshard_shard_server *s);

/* With mu held: whether ring failed as for an aborted step: STEP_ABORTED, or a lost peer
 * (PEER_LOST, the ring's own finding) where a lost server can heal, which the coordinator's
 * word (the watch thread) may not have reached yet. */
bool shard_ring_step_aborted(const struct pshard_shard_server *s, struct pshard_comm *ring);

/* A trainer operation failed with PEER_LOST (op_mu held): where a lost server can heal, the
 * ring's finding came before the coordinator's, and the step aborts as for a heal (the world
 * ring and the groups fail with STEP_ABORTED, so every rank rebuilds and the trainer resyncs);
 * *rc and err say so. Else nothing changes. */
void shard_heal_peer_lost(struct pshard_shard_server *s, pshard_status_t *rc, char *err,
                          size_t errlen);

/* The watch thread, for a lost ranked peer that can be healed: the step in flight aborts on
 * every rank (STEP_ABORTED on the world ring and every group), and the rank is awaited until
 * the --trainer-replace-ms deadline. A second loss while one is awaited ends the job. */
void shard_heal_await(struct pshard_shard_server *s, int rank, const char *name, const char *cause);

/* The setup thread, after a step abort: when a lost peer is awaited, waits (without locks)
 * until the cluster formed again with its rank held, and returns the new ring's rank, world
 * and generation; TIMEOUT past the deadline (the job ends naming the rank), ABORTED when the
 * server stops. PSHARD_OK at once when nothing is awaited. */
pshard_status_t shard_heal_wait_formed(struct pshard_shard_server *s, int *rank, int *world,
                                       uint64_t *gen, char *err, size_t errlen);

/* Survivors, before building the ring of generation gen: the store keys the newcomer reads
 * (the ring serial, the mesh; this rank's keyed groups that held the lost rank). */
void shard_heal_publish(struct pshard_shard_server *s, uint64_t gen, uint32_t serial);

/* The newcomer (MemberView.replaces_lost), before its first ring: awaits the survivors'
 * metadata for generation gen (bounded), keeps it in s->heal and returns the ring serial to
 * build under. Without it within the bound (no replica offered to heal this rank: a plain FSDP
 * job, or a model that cannot heal) it fails saying so. */
pshard_status_t shard_heal_join(struct pshard_shard_server *s, uint64_t gen, uint32_t *serial,
                                char *err, size_t errlen);

/* Every rank, on the new ring after the step-count agreement (flags: SHARD_HEAL_* per world
 * rank): the newcomer adopts the keyed groups its lost predecessor was in (as orphans its
 * trainer claims), connects the mesh's rings and receives its shard state; the survivors of a
 * healing rank's shard index send theirs (the lowest one) or take part. Survivors call it
 * after their own mesh is rebuilt (op_mu held). */
pshard_status_t shard_heal_transfer(struct pshard_shard_server *s, struct pshard_comm *comm,
                                    const int64_t *flags, uint32_t serial, uint64_t gen, char *err,
                                    size_t errlen);

/* DefineModel on the newcomer (op_mu held), m freshly created for mesh reps x shards: adopts
 * the received state and mesh into m, or FAILED_PRECONDITION when the trainer defined another
 * model than the replicas hold; the received state then stays for a definition of the right
 * model. s->heal is freed once adopted. */
pshard_status_t shard_heal_adopt(struct pshard_shard_server *s, shard_model_t *m, int reps,
                                 int shards, char *err, size_t errlen);

void shard_heal_state_free(shard_heal_state_t *h);

#endif
