/* pshard's checkpoint format: sharded, atomic, verified, reshardable. Shared by the shard
 * servers (save, load on any world size) and pshardctl (list, export, offline).
 *
 * A checkpoint root (--checkpoint-dir) holds one directory per saved step:
 *   ROOT/step-00000040/shard-00000-of-00004.bin   one file per rank that saved
 *   ROOT/step-00000040/manifest.json              written last: its rename commits the step
 * A step directory without manifest.json is not a checkpoint (a crash while saving); it is
 * ignored by listing and loading and may be overwritten.
 *
 * A shard file holds nsections sections back to back, each shard_numel little-endian fp32
 * values: section 0 the master weights, then the optimizer states in the order the manifest's
 * "sections" names them ("exp_avg", "exp_avg_sq" for Adam/AdamW, "momentum_buffer" for SGD with
 * momentum). Within a section, the rank's pieces lie as the manifest's pieces say: piece
 * (param, start, count, offset) holds elements [start, start + count) of the flattened
 * parameter `param` at element `offset` of each section. Pieces of one parameter across all
 * files cover it exactly once. Resharding reads, for each new piece, the byte ranges of the old
 * pieces it overlaps.
 *
 * manifest.json (UTF-8 JSON object; unknown keys are an error in version 1):
 *   {"format": "pshard-checkpoint", "version": 1, "step": 40, "world_size": 4,
 *    "layout": "fsdp2" | "fsdp1",
 *    "optimizer": {"kind": "sgd"|"adam"|"adamw", "lr": .., "momentum": .., "dampening": ..,
 *                  "nesterov": false, "weight_decay": .., "beta1": .., "beta2": .., "eps": ..,
 *                  "max_grad_norm": ..},
 *    "sections": ["master", "exp_avg", "exp_avg_sq"],
 *    "params": [{"name": "fc0.weight", "shape": [50, 37]}, ...],
 *    "files": [{"rank": 0, "path": "shard-00000-of-00004.bin", "bytes": 1234,
 *               "crc32c": 3808858755, "shard_numel": 100,
 *               "pieces": [[0, 0, 37, 0], [1, 0, 1, 37], ...]}, ...]}
 * Numbers are JSON integers except the optimizer's, which are doubles written with 17
 * significant digits (round-trip exact); an integer field given as a real (1.0) is refused, as
 * is a duplicate key anywhere (the file is parsed by jansson). "crc32c" is the CRC-32C (Castagnoli)
 * of the whole file as an unsigned integer. Paths are plain file names (no '/', no "..", 1..255
 * bytes).
 *
 * Thread safety: every function is reentrant; a manifest object is used by one thread at a
 * time. Errors come back as pshard_status_t with a message in err that names the file. */
#ifndef PSHARD_CKPT_H
#define PSHARD_CKPT_H

#include <stdbool.h>
#include <stddef.h>
#include <limits.h>
#include <stdint.h>

#include "pshard/dtype.h"
#include "pshard/layout.h"
#include "pshard/status.h"

#define PS_CKPT_MAX_SECTIONS 3
#define PS_CKPT_MANIFEST "manifest.json"

/* CRC-32C (Castagnoli, reflected, as iSCSI/ext4/gRPC use it): crc of the concatenation when
 * called piecewise, starting from 0. ps_crc32c(0, "123456789", 9) == 0xE3069283. Uses the CPU's
 * crc32 instruction when present. */
uint32_t ps_crc32c(uint32_t crc, const void *buf, size_t len);

typedef struct {
    uint32_t param;  /* index into params */
    uint64_t start;  /* first element of the flattened parameter */
    uint64_t count;  /* elements */
    uint64_t offset; /* element offset within each section of the file */
} ps_ckpt_piece_t;

typedef struct {
    int rank;
    char path[256]; /* file name inside the step directory */
    uint64_t bytes; /* = nsections * shard_numel * 4 */
    uint32_t crc32c;
    uint64_t shard_numel;
    size_t npieces;
    ps_ckpt_piece_t *pieces;
} ps_ckpt_file_t;

typedef struct {
    char name[256];
    int ndim; /* 1..8 */
    int64_t shape[8];
    int64_t skipped; /* steps of the checkpoint's that left this parameter alone (it had no
                        gradient; torch.optim's per-parameter "step" is step - skipped);
                        0..step, "skipped_steps" in the JSON, written only when not 0 */
} ps_ckpt_param_t;

typedef struct {
    char kind[16]; /* "sgd", "adam", "adamw" */
    double lr, momentum, dampening, weight_decay, beta1, beta2, eps, max_grad_norm;
    bool nesterov;
} ps_ckpt_optim_t;

/* One piece of one file: files[file].pieces[piece]. */
typedef struct {
    size_t file, piece;
} ps_ckpt_piece_ref_t;

typedef struct {
    int64_t step;
    /* Steps aborted before this one (a trainer lost and replaced, pshard-server
     * --trainer-replace-ms): the data position the job resumes at is step + aborted_steps.
     * "aborted_steps" in the JSON, written only when not 0. */
    int64_t aborted_steps;
    int world_size;
    pshard_layout_t layout;
    ps_ckpt_optim_t optim;
    int nsections;                           /* 1..PS_CKPT_MAX_SECTIONS */
    char sections[PS_CKPT_MAX_SECTIONS][32]; /* "master", then the state names */
    size_t nparams;
    ps_ckpt_param_t *params;
    size_t nfiles;
    ps_ckpt_file_t *files; /* sorted by rank */
    /* Built by ps_ckpt_manifest_read (NULL in a manifest put together by hand): the pieces of
     * parameter p, in file order, are by_param[by_param_start[p] .. by_param_start[p + 1]), so
     * ps_ckpt_read_range looks at those instead of every piece of every file. */
    size_t *by_param_start;
    ps_ckpt_piece_ref_t *by_param;
} ps_ckpt_manifest_t;

/* "ROOT/step-%08lld" into buf. Returns buf. */
const char *ps_ckpt_step_dir(const char *root, int64_t step, char *buf, size_t len);

/* "shard-%05d-of-%05d.bin". Returns buf. */
const char *ps_ckpt_shard_name(int rank, int world, char *buf, size_t len);

/* Writes m as STEP_DIR/manifest.json atomically: a temporary file in the same directory,
 * fsync, rename, then fsync of the directory; only then is the checkpoint committed. Errors:
 * SYSTEM (message names the path and the errno text; ENOSPC and EACCES are spelled out), and
 * nothing of a previous checkpoint is touched either way. */
pshard_status_t ps_ckpt_manifest_write(const char *step_dir, const ps_ckpt_manifest_t *m, char *err,
                                       size_t errlen);

/* Reads and validates STEP_DIR/manifest.json: JSON syntax, every key and type, plain file
 * names, pieces within each file and covering every parameter exactly once, sizes consistent
 * (bytes = nsections * shard_numel * 4). Does not read the shard files. Errors: NOT_FOUND (no
 * manifest: not a committed checkpoint), INVALID_ARGUMENT (malformed, with the JSON path of the
 * first problem), SYSTEM. Free with ps_ckpt_manifest_free. */
pshard_status_t ps_ckpt_manifest_read(const char *step_dir, ps_ckpt_manifest_t **out, char *err,
                                      size_t errlen);
void ps_ckpt_manifest_free(ps_ckpt_manifest_t *m);

/* Committed checkpoints under root (directories "step-N" holding a manifest that parses),
 * ascending by step: *steps is malloc'd (free()), *n its length; a missing root is zero
 * checkpoints, not an error. Step directories that are refused (a link, a manifest that does
 * not parse or names another step) are left out with a warning; refused gets every refusal,
 * "; "-separated as far as they fit ("" when none; refused may be NULL). */
pshard_status_t ps_ckpt_list(const char *root, int64_t **steps, size_t *n, char *refused,
                             size_t refusedlen, char *err, size_t errlen);

/* Checks file f of the checkpoint in step_dir: it exists, has f->bytes bytes and its CRC-32C
 * is f->crc32c. Errors: NOT_FOUND, INVALID_ARGUMENT ("truncated: N of M bytes", "checksum
 * mismatch"), SYSTEM. */
pshard_status_t ps_ckpt_verify_file(const char *step_dir, const ps_ckpt_file_t *f, char *err,
                                    size_t errlen);

/* Reads elements [start, start + count) of section `section` (0 = master) of the flattened
 * parameter `param` into out (fp32), from whichever files hold them (pread of just those byte
 * ranges). Errors: INVALID_ARGUMENT (range outside the parameter, unknown section), SYSTEM,
 * INVALID_ARGUMENT for a short read ("truncated"). Does not verify checksums. */
pshard_status_t ps_ckpt_read_range(const char *step_dir, const ps_ckpt_manifest_t *m, int section,
                                   uint32_t param, uint64_t start, uint64_t count, float *out,
                                   char *err, size_t errlen);

/* ---- Writing and reading one shard file as a stream ---------------------------------------
 * A rank's file is its sections back to back; a writer hands them over in any number of pieces
 * (e.g. a bounce buffer of device memory at a time) and gets the size and CRC-32C the manifest
 * needs; a reader takes them back in order with the CRC checked at the end. */
typedef struct ps_ckpt_shard_out ps_ckpt_shard_out_t;
typedef struct ps_ckpt_shard_in ps_ckpt_shard_in_t;

/* Starts writing shard-RANK-of-WORLD.bin in the step directory dfd (borrowed until close;
 * step_dir is its path, for messages) under a fresh O_EXCL temporary. Errors: SYSTEM,
 * NO_MEMORY, INVALID_ARGUMENT (path too long). */
pshard_status_t ps_ckpt_shard_out_open(int dfd, const char *step_dir, int rank, int world,
                                       ps_ckpt_shard_out_t **out, char *err, size_t errlen);
/* Appends len bytes, checksumming them on the way. Errors: SYSTEM naming the file. */
pshard_status_t ps_ckpt_shard_out_write(ps_ckpt_shard_out_t *o, const void *buf, size_t len,
                                        char *err, size_t errlen);
/* commit: syncs and renames the file into place, then sets *bytes and *crc32c; !commit (or a
 * failure) removes the temporary. Frees o either way (NULL is a no-op). Errors: SYSTEM. */
pshard_status_t ps_ckpt_shard_out_close(ps_ckpt_shard_out_t *o, bool commit, uint64_t *bytes,
                                        uint32_t *crc32c, char *err, size_t errlen);

/* Opens file f of the checkpoint in step_dir for reading from its start: a plain name, no
 * link, a regular file of exactly f->bytes bytes. Errors: NOT_FOUND, INVALID_ARGUMENT
 * ("truncated: N of M bytes", a link, a FIFO), SYSTEM, NO_MEMORY. */
pshard_status_t ps_ckpt_shard_in_open(const char *step_dir, const ps_ckpt_file_t *f,
                                      ps_ckpt_shard_in_t **in, char *err, size_t errlen);
/* Reads the next len bytes into buf, checksumming them. Errors: INVALID_ARGUMENT (truncated,
 * or past f->bytes), SYSTEM. */
pshard_status_t ps_ckpt_shard_in_read(ps_ckpt_shard_in_t *in, void *buf, size_t len, char *err,
                                      size_t errlen);
/* verify: every byte was read and the CRC-32C is f->crc32c (INVALID_ARGUMENT "checksum
 * mismatch" if not). Closes and frees in either way (NULL is a no-op). */
pshard_status_t ps_ckpt_shard_in_close(ps_ckpt_shard_in_t *in, bool verify, char *err,
                                       size_t errlen);

/* Removes committed checkpoints under root beyond the newest `keep` (keep >= 1), and step
 * directories without a manifest older than the newest committed one. The manifest is removed
 * first so a half-removed checkpoint is never seen as committed. Errors: SYSTEM. */
pshard_status_t ps_ckpt_prune(const char *root, int keep, char *err, size_t errlen);

/* ---- Files inside a checkpoint root ------------------------------------------------------
 * A checkpoint root is untrusted: pshard never follows a symbolic link inside it and never
 * blocks opening one of its files. Step directories and their files are opened relative to a
 * directory descriptor with O_NOFOLLOW (a link is refused, never followed), files with
 * O_NONBLOCK and checked to be regular files before anything is read (a FIFO or device is
 * refused), new files are written under a fresh O_EXCL temporary name and renamed into place
 * (pshard/atomic_file.h), and pruning removes only regular files of the names pshard writes.
 * The root's own path may hold links (an operator's mount point). */

/* Creates root (with missing parents) and its directory for step, and opens that (*dfd). An
 * existing step directory is reused; one that is a link or not a directory is refused
 * (INVALID_ARGUMENT). Errors also SYSTEM. */
pshard_status_t ps_ckpt_step_dir_make(const char *root, int64_t step, int *dfd, char *err,
                                      size_t errlen);

/* Whether name is one pshard writes in a step directory (the manifest, a shard file, or a
 * temporary of either): what pruning may remove. */
bool ps_ckpt_is_own_file(const char *name);

/* safetensors (8-byte little-endian header length, JSON header, raw little-endian data):
 * writes the master weights (section 0) of every parameter of the checkpoint in step_dir as
 * one file at out_path, in dtype fp32 or bf16 (round to nearest even), tensors named as the
 * parameters and in their order, with "__metadata__": {"format": "pt", "pshard_step": "40"}.
 * Written to a temporary file and renamed. Errors: INVALID_ARGUMENT (dtype), SYSTEM, and
 * ps_ckpt_read_range's. */
pshard_status_t ps_safetensors_export(const char *step_dir, const ps_ckpt_manifest_t *m,
                                      pshard_dtype_t dtype, const char *out_path, char *err,
                                      size_t errlen);

/* Reads a safetensors file's tensor `name` (F32, BF16 or F16 with the given shape) as fp32 into
 * out (numel elements). Validates the header (length bounds, JSON, data_offsets inside the
 * file and not overlapping). Errors: NOT_FOUND (no such tensor), INVALID_ARGUMENT (shape or
 * dtype mismatch, malformed file), SYSTEM. */
pshard_status_t ps_safetensors_read(const char *path, const char *name, int ndim,
                                    const int64_t *shape, float *out, char *err, size_t errlen);

#endif
