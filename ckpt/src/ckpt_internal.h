/* Internal pieces of the checkpoint format shared by the sources of ckpt/: the CRC-32C
 * implementations (crc32c.c; separate so tests can compare them), a small strict JSON parser
 * and the helpers that write JSON text and files atomically. Not for use outside ckpt/. */
#ifndef PSHARD_CKPT_INTERNAL_H
#define PSHARD_CKPT_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

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

/* ---- JSON parsing ----------------------------------------------------------------------- */

typedef enum {
    CKPT_JSON_NULL,
    CKPT_JSON_FALSE,
    CKPT_JSON_TRUE,
    CKPT_JSON_INT,    /* an integer literal that fits in int64 */
    CKPT_JSON_DOUBLE, /* any other number (fraction, exponent, or too large for int64) */
    CKPT_JSON_STRING,
    CKPT_JSON_ARRAY,
    CKPT_JSON_OBJECT,
} ckpt_json_type_t;

/* One value. Nodes live in one array; index 0 is the root, so 0 also means "none" for links. */
typedef struct {
    uint8_t type;     /* ckpt_json_type_t */
    uint32_t next;    /* next sibling (array element or object member), 0 after the last */
    uint32_t child;   /* first element or member of an array or object, 0 when empty */
    uint32_t count;   /* elements or members of an array or object */
    uint32_t key_off; /* an object member's name: offset in the document's text */
    uint32_t key_len; /* ... and its length in bytes */
    union {
        int64_t i; /* CKPT_JSON_INT */
        double d;  /* CKPT_JSON_DOUBLE */
        struct {
            uint32_t off, len; /* CKPT_JSON_STRING: unescaped bytes in the text (NUL after) */
        } s;
    } v;
} ckpt_json_node_t;

typedef struct {
    char *text;              /* owned copy of the input; strings are unescaped in place */
    ckpt_json_node_t *nodes; /* nodes[0] is the root value */
    uint32_t nnodes;
    uint32_t cap;
} ckpt_json_doc_t;

/* Parses exactly one JSON value (RFC 8259, strictly: no comments, trailing commas, leading
 * zeros, unescaped control characters, invalid UTF-8, lone surrogates or duplicate object
 * keys) from data[0..len), nesting at most max_depth arrays/objects deep. Errors:
 * INVALID_ARGUMENT with "line L, column C: what" in err, NO_MEMORY. On success free the
 * document with ckpt_json_free; on failure nothing needs freeing. Reentrant. */
pshard_status_t ckpt_json_parse(const char *data, size_t len, int max_depth, ckpt_json_doc_t *doc,
                                char *err, size_t errlen);

/* Frees what ckpt_json_parse allocated; a zeroed document is a no-op. */
void ckpt_json_free(ckpt_json_doc_t *doc);

static inline const ckpt_json_node_t *ckpt_json_node(const ckpt_json_doc_t *doc, uint32_t i)
{
    return &doc->nodes[i];
}

/* An object member's name (NUL-terminated in the text, and key_len long). */
static inline const char *ckpt_json_key(const ckpt_json_doc_t *doc, const ckpt_json_node_t *n)
{
    return doc->text + n->key_off;
}

/* A string's bytes (NUL-terminated; an embedded \u0000 makes strlen shorter than s.len). */
static inline const char *ckpt_json_str(const ckpt_json_doc_t *doc, const ckpt_json_node_t *n)
{
    return doc->text + n->v.s.off;
}

/* The member of object `obj` named key, or 0 when it has none. */
uint32_t ckpt_json_get(const ckpt_json_doc_t *doc, uint32_t obj, const char *key);

/* "an object", "an integer", ... for messages. */
const char *ckpt_json_type_name(int type);

/* True when s[0..len) is well-formed UTF-8 (no overlong forms, surrogates or values past
 * U+10FFFF). */
bool ckpt_utf8_valid(const char *s, size_t len);

/* ---- JSON writing ----------------------------------------------------------------------- */

/* A growing text buffer. After an allocation failure `failed` is set and appends do nothing,
 * so a writer checks once at the end. Free data with free(). */
typedef struct {
    char *data;
    size_t len, cap;
    bool failed;
} ckpt_buf_t;

void ckpt_buf_printf(ckpt_buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void ckpt_buf_append(ckpt_buf_t *b, const char *s, size_t len);

/* Appends s[0..len) as a JSON string literal (quotes, backslash and control characters
 * escaped; other bytes as they are). */
void ckpt_buf_json_str(ckpt_buf_t *b, const char *s, size_t len);

/* Appends v with 17 significant digits in the C locale ("%.17g": reading it back gives v
 * exactly). v must be finite. */
void ckpt_buf_double(ckpt_buf_t *b, double v);

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
