/* Internal pieces of the checkpoint format shared by the sources of ckpt/: the CRC-32C
 * implementations (crc32c.c; separate so tests can compare them), JSON helpers over jansson,
 * the manifest's checks and the file helpers that never follow links. Not for use outside
 * ckpt/. */
#ifndef PSHARD_CKPT_INTERNAL_H
#define PSHARD_CKPT_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "pshard/ckpt.h"
#include "pshard/status.h"

/* ---- CRC-32C ---------------------------------------------------------------------------- */

/* The portable table-driven CRC-32C (slice-by-8); same contract as ps_crc32c. Thread-safe. */
uint32_t ckpt_crc32c_sw(uint32_t crc, const void *buf, size_t len);

/* True when this build has a CRC instruction path and this CPU supports it. Thread-safe. */
bool ckpt_crc32c_hw_available(void);

/* The fastest CRC-32C this CPU has (what ps_crc32c uses): folding when
 * ckpt_crc32c_fold_available(), else the crc32 instruction, else the table. Thread-safe. */
uint32_t ckpt_crc32c_hw(uint32_t crc, const void *buf, size_t len);

/* True when the carry-less-multiply folding path runs here (x86, AVX-512, VPCLMULQDQ). */
bool ckpt_crc32c_fold_available(void);

/* The crc32 instruction alone (three streams), so tests can compare it with folding; the
 * table where there is no instruction. Thread-safe. */
uint32_t ckpt_crc32c_insn(uint32_t crc, const void *buf, size_t len);

/* ---- Manifest -------------------------------------------------------------------------- */

/* Element counts beyond this are taken for corruption (bytes of 3 sections still fit). */
#define CKPT_MAX_NUMEL ((uint64_t)1 << 60)

/* Why path (a char array of capacity cap) is not a plain file name (1..255 bytes of UTF-8, no
 * '/', not "." or "..", not the manifest's own name), or NULL when it is one. */
const char *ckpt_plain_name_problem(const char *path, size_t cap);

/* Elements of parameter p, or UINT64_MAX when that exceeds CKPT_MAX_NUMEL. */
uint64_t ckpt_param_numel(const ps_ckpt_param_t *p);

/* Indexes every piece of m by parameter (counting sort, file order kept): the pieces of
 * parameter p are (*refs)[(*start)[p] .. (*start)[p + 1]). Both arrays are malloc'd (free()).
 * Errors: NO_MEMORY. */
pshard_status_t ckpt_build_index(const ps_ckpt_manifest_t *m, size_t **start,
                                 ps_ckpt_piece_ref_t **refs, char *err, size_t errlen);

/* Everything ps_ckpt_manifest_read checks beyond JSON types: names, ranges, sizes, one file per
 * rank, pieces inside their parameter and file and tiling each parameter exactly once.
 * Errors: INVALID_ARGUMENT with the JSON path of the first problem (indices as m's arrays
 * are), NO_MEMORY. Reentrant. */
pshard_status_t ckpt_manifest_check(const ps_ckpt_manifest_t *m, char *err, size_t errlen);

/* ---- JSON (jansson) --------------------------------------------------------------------- */

/* Parses data[0..len) as one JSON object or array with jansson, refusing duplicate object keys
 * and keeping integers apart from reals. Errors: INVALID_ARGUMENT with "line L, column C: what"
 * in err. On success *out is a new reference (json_decref). Reentrant. */
pshard_status_t ckpt_json_load(const char *data, size_t len, json_t **out, char *err,
                               size_t errlen);

/* "an object", "an integer", "a real number", ... for messages. */
const char *ckpt_json_type_name(const json_t *v);

/* True when s[0..len) is UTF-8 that jansson accepts as a string (so it can be written). */
bool ckpt_utf8_valid(const char *s, size_t len);

/* What a field of an object with fixed keys must hold. */
typedef enum {
    CKPT_JSON_STRING,
    CKPT_JSON_INTEGER, /* a JSON integer: 1.0 is not one */
    CKPT_JSON_NUMBER,  /* an integer or a real */
    CKPT_JSON_BOOLEAN,
    CKPT_JSON_ARRAY,
    CKPT_JSON_ANY, /* checked by the caller */
} ckpt_json_kind_t;

typedef struct {
    const char *key;
    ckpt_json_kind_t kind; /* | CKPT_JSON_OPTIONAL: the key may be absent */
} ckpt_json_field_t;
#define CKPT_JSON_OPTIONAL 0x100

/* After json_unpack_ex(..., JSON_STRICT, ...) refused obj (at JSON path where, "" for the
 * root): says why, as the first of: not an object, an unknown key, a missing key, a value of
 * the wrong kind. Returns INVALID_ARGUMENT. */
pshard_status_t ckpt_json_explain(const json_t *obj, const char *where,
                                  const ckpt_json_field_t *fields, size_t nfields, char *err,
                                  size_t errlen);

/* ---- Files ------------------------------------------------------------------------------ */

/* Opens directory dir (O_DIRECTORY; with !follow a link as its last component is refused).
 * Errors: NOT_FOUND (ENOENT), INVALID_ARGUMENT (a link), SYSTEM; messages name dir. */
pshard_status_t ckpt_dir_open(const char *dir, bool follow, int *dfd, char *err, size_t errlen);

/* Opens name in directory dfd (AT_FDCWD for a path) for reading: regular files only, never
 * waiting on a FIFO, O_NOFOLLOW unless follow; *size (may be NULL) gets its size. shown is the
 * path messages use. Errors: NOT_FOUND ("missing"), INVALID_ARGUMENT (a link, not a regular
 * file), SYSTEM. */
pshard_status_t ckpt_file_open(int dfd, const char *name, const char *shown, bool follow, int *fd,
                               uint64_t *size, char *err, size_t errlen);

/* pread(2) of up to len bytes at off, retrying on EINTR and short reads; *got is how many
 * bytes were read (less than len only at end of file). Errors: SYSTEM naming path. */
pshard_status_t ckpt_pread_full(int fd, void *buf, size_t len, uint64_t off, size_t *got,
                                const char *path, char *err, size_t errlen);

#endif
