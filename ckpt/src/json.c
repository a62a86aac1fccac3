/* A small strict JSON parser and writer for the checkpoint manifest and safetensors headers,
 * plus the file helpers both share (atomic writes through a temporary file, full reads and
 * writes). The parser builds a compact node array over an unescaped copy of the input so that
 * callers can check a schema and name the JSON path of the first problem. */
#include "ckpt_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/util.h"

/* More values than this in one document is refused (the node array alone would pass 512 MiB). */
#define JSON_MAX_NODES (1u << 24)
/* Objects with up to this many members are checked for repeated names as they are parsed;
 * larger ones by sorting their names once at the end. */
#define JSON_INLINE_DUP_CHECK 32
/* A number literal longer than this is refused rather than copied for strtod. */
#define JSON_MAX_NUMBER_CHARS 512

/* ---- C locale for number text ------------------------------------------------------------- */

static pthread_once_t c_locale_once = PTHREAD_ONCE_INIT;
static locale_t c_locale;

static void c_locale_init(void)
{
    c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0);
}

/* The "C" locale, so '.' is the decimal point whatever the program's locale; (locale_t)0 if it
 * could not be created (the current locale is used then). */
static locale_t json_c_locale(void)
{
    pthread_once(&c_locale_once, c_locale_init);
    return c_locale;
}

/* ---- UTF-8 ------------------------------------------------------------------------------- */

/* Length of the well-formed UTF-8 sequence at s (at most avail bytes), or 0 if malformed. */
static size_t utf8_seq_len(const unsigned char *s, size_t avail)
{
    unsigned char c = s[0];
    size_t n;
    unsigned char lo = 0x80, hi = 0xBF; /* bounds of the second byte */
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        if (c == 0xE0)
            lo = 0xA0; /* no overlong forms */
        else if (c == 0xED)
            hi = 0x9F; /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        if (c == 0xF0)
            lo = 0x90;
        else if (c == 0xF4)
            hi = 0x8F; /* nothing past U+10FFFF */
    } else {
        return 0;
    }
    if (avail < n || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < n; i++)
        if ((s[i] & 0xC0) != 0x80)
            return 0;
    return n;
}

bool ckpt_utf8_valid(const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        size_t n = utf8_seq_len(p + i, len - i);
        if (n == 0)
            return false;
        i += n;
    }
    return true;
}

/* ---- Parser ------------------------------------------------------------------------------- */

typedef struct {
    const char *orig; /* the caller's input, for line and column numbers */
    char *text;       /* doc->text: a copy, unescaped in place */
    size_t len;
    size_t pos;
    int depth, max_depth;
    ckpt_json_doc_t *doc;
    char *err;
    size_t errlen;
} json_parser_t;

static pshard_status_t json_fail(json_parser_t *p, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static pshard_status_t json_fail(json_parser_t *p, const char *fmt, ...)
{
    size_t line = 1, col = 1;
    for (size_t i = 0; i < p->pos && i < p->len; i++) {
        if (p->orig[i] == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    return ps_errf(p->err, p->errlen, PSHARD_ERR_INVALID_ARGUMENT, "line %zu, column %zu: %s", line,
                   col, what);
}

/* Describes the byte at the current position for a message. */
static void json_describe_here(const json_parser_t *p, char *buf, size_t len)
{
    if (p->pos >= p->len) {
        ps_snprintf(buf, len, "the end of the input");
        return;
    }
    unsigned char c = (unsigned char)p->text[p->pos];
    if (c > 0x20 && c < 0x7f)
        ps_snprintf(buf, len, "'%c'", c);
    else
        ps_snprintf(buf, len, "byte 0x%02x", c);
}

static pshard_status_t json_unexpected(json_parser_t *p, const char *expected)
{
    char here[32];
    json_describe_here(p, here, sizeof(here));
    return json_fail(p, "expected %s, found %s", expected, here);
}

static void json_skip_ws(json_parser_t *p)
{
    while (p->pos < p->len) {
        char c = p->text[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            break;
        p->pos++;
    }
}

static pshard_status_t json_new_node(json_parser_t *p, ckpt_json_type_t type, uint32_t *idx)
{
    ckpt_json_doc_t *d = p->doc;
    if (d->nnodes >= JSON_MAX_NODES)
        return json_fail(p, "more than %u values", JSON_MAX_NODES);
    if (d->nnodes == d->cap) {
        uint32_t cap = d->cap ? d->cap * 2 : 64;
        ckpt_json_node_t *n = realloc(d->nodes, (size_t)cap * sizeof(*n));
        if (!n)
            return ps_errf(p->err, p->errlen, PSHARD_ERR_NO_MEMORY,
                           "out of memory parsing JSON (%u values)", d->nnodes);
        d->nodes = n;
        d->cap = cap;
    }
    *idx = d->nnodes++;
    memset(&d->nodes[*idx], 0, sizeof(d->nodes[*idx]));
    d->nodes[*idx].type = (uint8_t)type;
    return PSHARD_OK;
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Reads the 4 hex digits after "\u" at p->pos (which points at the 'u'). */
static pshard_status_t json_read_u16(json_parser_t *p, uint32_t *out)
{
    if (p->pos + 5 > p->len)
        return json_fail(p, "\\u needs 4 hex digits");
    uint32_t v = 0;
    for (int i = 1; i <= 4; i++) {
        int h = hex_value(p->text[p->pos + (size_t)i]);
        if (h < 0)
            return json_fail(p, "\\u needs 4 hex digits");
        v = v << 4 | (uint32_t)h;
    }
    *out = v;
    p->pos += 5;
    return PSHARD_OK;
}

/* Parses the string literal at p->pos (a '"'), unescaping it in place; *off and *len say where
 * its bytes now are. They are NUL-terminated: the result is never longer than the literal. */
static pshard_status_t json_string(json_parser_t *p, uint32_t *off, uint32_t *len)
{
    char *t = p->text;
    size_t start_pos = p->pos;
    p->pos++; /* the opening quote */
    size_t w = p->pos;
    *off = (uint32_t)w;
    for (;;) {
        if (p->pos >= p->len) {
            p->pos = start_pos;
            return json_fail(p, "unterminated string");
        }
        unsigned char c = (unsigned char)t[p->pos];
        if (c == '"')
            break;
        if (c < 0x20)
            return json_fail(p, "control character 0x%02x in a string (it must be escaped)", c);
        if (c == '\\') {
            p->pos++;
            if (p->pos >= p->len)
                return json_fail(p, "unterminated string");
            char e = t[p->pos];
            const char *simple = strchr("\"\\/bfnrt", e);
            if (e != '\0' && simple) {
                static const char decoded[] = "\"\\/\b\f\n\r\t";
                t[w++] = decoded[simple - "\"\\/bfnrt"];
                p->pos++;
                continue;
            }
            if (e != 'u')
                return json_fail(p, "invalid escape '\\%c'", e > 0x20 && e < 0x7f ? e : '?');
            uint32_t cp;
            PS_CHECK(json_read_u16(p, &cp));
            if (cp >= 0xDC00 && cp <= 0xDFFF)
                return json_fail(p, "lone low surrogate \\u%04X", cp);
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                uint32_t low;
                if (p->pos + 1 >= p->len || t[p->pos] != '\\' || t[p->pos + 1] != 'u')
                    return json_fail(p, "high surrogate \\u%04X without a low surrogate", cp);
                p->pos++;
                PS_CHECK(json_read_u16(p, &low));
                if (low < 0xDC00 || low > 0xDFFF)
                    return json_fail(p, "high surrogate \\u%04X followed by \\u%04X", cp, low);
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            }
            if (cp < 0x80) {
                t[w++] = (char)cp;
            } else if (cp < 0x800) {
                t[w++] = (char)(0xC0 | cp >> 6);
                t[w++] = (char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                t[w++] = (char)(0xE0 | cp >> 12);
                t[w++] = (char)(0x80 | (cp >> 6 & 0x3F));
                t[w++] = (char)(0x80 | (cp & 0x3F));
            } else {
                t[w++] = (char)(0xF0 | cp >> 18);
                t[w++] = (char)(0x80 | (cp >> 12 & 0x3F));
                t[w++] = (char)(0x80 | (cp >> 6 & 0x3F));
                t[w++] = (char)(0x80 | (cp & 0x3F));
            }
            continue;
        }
        size_t n = utf8_seq_len((const unsigned char *)t + p->pos, p->len - p->pos);
        if (n == 0)
            return json_fail(p, "invalid UTF-8 in a string");
        memmove(t + w, t + p->pos, n);
        w += n;
        p->pos += n;
    }
    *len = (uint32_t)(w - *off);
    p->pos++; /* the closing quote; only now may its byte be overwritten */
    t[w] = '\0';
    return PSHARD_OK;
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

static pshard_status_t json_number(json_parser_t *p, uint32_t idx)
{
    const char *t = p->text;
    size_t start = p->pos;
    bool neg = false, integral = true;
    if (t[p->pos] == '-') {
        neg = true;
        p->pos++;
    }
    if (p->pos >= p->len || !is_digit(t[p->pos]))
        return json_unexpected(p, "a digit");
    if (t[p->pos] == '0') {
        p->pos++;
        if (p->pos < p->len && is_digit(t[p->pos]))
            return json_fail(p, "leading zeros are not allowed in numbers");
    } else {
        while (p->pos < p->len && is_digit(t[p->pos]))
            p->pos++;
    }
    size_t int_end = p->pos;
    if (p->pos < p->len && t[p->pos] == '.') {
        integral = false;
        p->pos++;
        if (p->pos >= p->len || !is_digit(t[p->pos]))
            return json_unexpected(p, "a digit after the decimal point");
        while (p->pos < p->len && is_digit(t[p->pos]))
            p->pos++;
    }
    if (p->pos < p->len && (t[p->pos] == 'e' || t[p->pos] == 'E')) {
        integral = false;
        p->pos++;
        if (p->pos < p->len && (t[p->pos] == '+' || t[p->pos] == '-'))
            p->pos++;
        if (p->pos >= p->len || !is_digit(t[p->pos]))
            return json_unexpected(p, "a digit in the exponent");
        while (p->pos < p->len && is_digit(t[p->pos]))
            p->pos++;
    }
    ckpt_json_node_t *n = &p->doc->nodes[idx];
    if (integral) {
        uint64_t mag = 0, limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
        bool fits = true;
        for (size_t i = start + neg; i < int_end && fits; i++) {
            uint64_t d = (uint64_t)(t[i] - '0');
            if (mag > (limit - d) / 10)
                fits = false;
            else
                mag = mag * 10 + d;
        }
        if (fits) {
            n->type = CKPT_JSON_INT;
            n->v.i =
                neg ? (mag == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)mag) : (int64_t)mag;
            return PSHARD_OK;
        }
    }
    size_t nchars = p->pos - start;
    if (nchars > JSON_MAX_NUMBER_CHARS) {
        p->pos = start;
        return json_fail(p, "number longer than %d characters", JSON_MAX_NUMBER_CHARS);
    }
    char buf[JSON_MAX_NUMBER_CHARS + 1];
    memcpy(buf, t + start, nchars);
    buf[nchars] = '\0';
    locale_t loc = json_c_locale();
    double v = loc ? strtod_l(buf, NULL, loc) : strtod(buf, NULL);
    if (!isfinite(v)) {
        p->pos = start;
        return json_fail(p, "number %s is out of range", buf);
    }
    n->type = CKPT_JSON_DOUBLE;
    n->v.d = v;
    return PSHARD_OK;
}

typedef struct {
    const char *key;
    uint32_t len;
} json_key_ref_t;

static int json_key_cmp(const void *a, const void *b)
{
    const json_key_ref_t *x = a, *y = b;
    uint32_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->key, y->key, n);
    if (c != 0)
        return c;
    return x->len < y->len ? -1 : x->len > y->len;
}

/* Refuses an object with two members of the same name. */
static pshard_status_t json_check_duplicates(json_parser_t *p, uint32_t obj, size_t obj_pos)
{
    const ckpt_json_doc_t *d = p->doc;
    uint32_t count = d->nodes[obj].count;
    if (count < 2)
        return PSHARD_OK;
    json_key_ref_t *refs = malloc((size_t)count * sizeof(*refs));
    if (!refs)
        return ps_errf(p->err, p->errlen, PSHARD_ERR_NO_MEMORY, "out of memory parsing JSON");
    size_t k = 0;
    for (uint32_t c = d->nodes[obj].child; c; c = d->nodes[c].next)
        refs[k++] = (json_key_ref_t){d->text + d->nodes[c].key_off, d->nodes[c].key_len};
    qsort(refs, count, sizeof(*refs), json_key_cmp);
    pshard_status_t rc = PSHARD_OK;
    for (size_t i = 1; i < count && rc == PSHARD_OK; i++) {
        if (json_key_cmp(&refs[i - 1], &refs[i]) == 0) {
            p->pos = obj_pos;
            int shown = (int)(refs[i].len > 64 ? 64 : refs[i].len);
            rc = json_fail(p, "duplicate key \"%.*s\" in an object", shown, refs[i].key);
        }
    }
    free(refs);
    return rc;
}

static pshard_status_t json_value(json_parser_t *p, uint32_t *out);

/* Parses an array or object at p->pos ('[' or '{'). */
static pshard_status_t json_container(json_parser_t *p, bool is_object, uint32_t *out)
{
    size_t open_pos = p->pos;
    if (p->depth >= p->max_depth)
        return json_fail(p, "nested deeper than %d levels", p->max_depth);
    p->depth++;
    uint32_t idx;
    PS_CHECK(json_new_node(p, is_object ? CKPT_JSON_OBJECT : CKPT_JSON_ARRAY, &idx));
    p->pos++;
    json_skip_ws(p);
    char close = is_object ? '}' : ']';
    if (p->pos < p->len && p->text[p->pos] == close) {
        p->pos++;
        p->depth--;
        *out = idx;
        return PSHARD_OK;
    }
    uint32_t last = 0, count = 0;
    for (;;) {
        json_skip_ws(p);
        uint32_t key_off = 0, key_len = 0, child;
        size_t key_pos = 0;
        if (is_object) {
            if (p->pos >= p->len || p->text[p->pos] != '"')
                return json_unexpected(p, "a member name in double quotes");
            key_pos = p->pos;
            PS_CHECK(json_string(p, &key_off, &key_len));
            json_skip_ws(p);
            if (p->pos >= p->len || p->text[p->pos] != ':')
                return json_unexpected(p, "':' after a member name");
            p->pos++;
        }
        if (is_object && count < JSON_INLINE_DUP_CHECK) {
            /* Small objects are checked here, to point at the repeated name itself. */
            const ckpt_json_node_t *nodes = p->doc->nodes;
            for (uint32_t c = nodes[idx].child; c; c = nodes[c].next)
                if (nodes[c].key_len == key_len &&
                    memcmp(p->text + nodes[c].key_off, p->text + key_off, key_len) == 0) {
                    p->pos = key_pos;
                    return json_fail(p, "duplicate key \"%.*s\" in an object",
                                     (int)(key_len > 64 ? 64 : key_len), p->text + key_off);
                }
        }
        PS_CHECK(json_value(p, &child));
        ckpt_json_node_t *nodes = p->doc->nodes;
        nodes[child].key_off = key_off;
        nodes[child].key_len = key_len;
        if (last)
            nodes[last].next = child;
        else
            nodes[idx].child = child;
        last = child;
        count++;
        nodes[idx].count = count;
        json_skip_ws(p);
        if (p->pos < p->len && p->text[p->pos] == ',') {
            p->pos++;
            json_skip_ws(p);
            if (p->pos < p->len && p->text[p->pos] == close)
                return json_fail(p, "trailing comma before '%c'", close);
            continue;
        }
        if (p->pos < p->len && p->text[p->pos] == close) {
            p->pos++;
            break;
        }
        return json_unexpected(p, is_object ? "',' or '}' after an object member"
                                            : "',' or ']' after an array element");
    }
    p->depth--;
    if (is_object && count > JSON_INLINE_DUP_CHECK)
        PS_CHECK(json_check_duplicates(p, idx, open_pos));
    *out = idx;
    return PSHARD_OK;
}

static pshard_status_t json_literal(json_parser_t *p, const char *word, ckpt_json_type_t type,
                                    uint32_t *out)
{
    size_t n = strlen(word);
    if (p->pos + n > p->len || memcmp(p->text + p->pos, word, n) != 0)
        return json_unexpected(p, "a JSON value");
    PS_CHECK(json_new_node(p, type, out));
    p->pos += n;
    return PSHARD_OK;
}

static pshard_status_t json_value(json_parser_t *p, uint32_t *out)
{
    json_skip_ws(p);
    if (p->pos >= p->len)
        return json_unexpected(p, "a JSON value");
    char c = p->text[p->pos];
    switch (c) {
    case '{':
        return json_container(p, true, out);
    case '[':
        return json_container(p, false, out);
    case '"': {
        uint32_t idx, off, len;
        PS_CHECK(json_new_node(p, CKPT_JSON_STRING, &idx));
        PS_CHECK(json_string(p, &off, &len));
        p->doc->nodes[idx].v.s.off = off;
        p->doc->nodes[idx].v.s.len = len;
        *out = idx;
        return PSHARD_OK;
    }
    case 't':
        return json_literal(p, "true", CKPT_JSON_TRUE, out);
    case 'f':
        return json_literal(p, "false", CKPT_JSON_FALSE, out);
    case 'n':
        return json_literal(p, "null", CKPT_JSON_NULL, out);
    default:
        if (c == '-' || is_digit(c)) {
            PS_CHECK(json_new_node(p, CKPT_JSON_INT, out));
            return json_number(p, *out);
        }
        return json_unexpected(p, "a JSON value");
    }
}

pshard_status_t ckpt_json_parse(const char *data, size_t len, int max_depth, ckpt_json_doc_t *doc,
                                char *err, size_t errlen)
{
    memset(doc, 0, sizeof(*doc));
    if (len >= UINT32_MAX)
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                       "JSON text of %zu bytes is too large", len);
    doc->text = malloc(len + 1);
    if (!doc->text)
        return ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "out of memory (%zu bytes of JSON)", len);
    memcpy(doc->text, data, len);
    doc->text[len] = '\0';
    json_parser_t p = {.orig = data,
                       .text = doc->text,
                       .len = len,
                       .max_depth = max_depth,
                       .doc = doc,
                       .err = err,
                       .errlen = errlen};
    uint32_t root;
    pshard_status_t rc = json_value(&p, &root);
    if (rc == PSHARD_OK) {
        json_skip_ws(&p);
        if (p.pos < p.len)
            rc = json_unexpected(&p, "nothing after the JSON value");
    }
    if (rc != PSHARD_OK)
        ckpt_json_free(doc);
    return rc;
}

void ckpt_json_free(ckpt_json_doc_t *doc)
{
    if (!doc)
        return;
    free(doc->text);
    free(doc->nodes);
    memset(doc, 0, sizeof(*doc));
}

uint32_t ckpt_json_get(const ckpt_json_doc_t *doc, uint32_t obj, const char *key)
{
    size_t klen = strlen(key);
    for (uint32_t c = doc->nodes[obj].child; c; c = doc->nodes[c].next) {
        const ckpt_json_node_t *n = &doc->nodes[c];
        if (n->key_len == klen && memcmp(doc->text + n->key_off, key, klen) == 0)
            return c;
    }
    return 0;
}

const char *ckpt_json_type_name(int type)
{
    switch (type) {
    case CKPT_JSON_NULL:
        return "null";
    case CKPT_JSON_FALSE:
    case CKPT_JSON_TRUE:
        return "a boolean";
    case CKPT_JSON_INT:
        return "an integer";
    case CKPT_JSON_DOUBLE:
        return "a number";
    case CKPT_JSON_STRING:
        return "a string";
    case CKPT_JSON_ARRAY:
        return "an array";
    case CKPT_JSON_OBJECT:
        return "an object";
    default:
        return "an unknown value";
    }
}

/* ---- Writer ------------------------------------------------------------------------------- */

static bool buf_reserve(ckpt_buf_t *b, size_t extra)
{
    if (b->failed)
        return false;
    if (b->len + extra + 1 <= b->cap)
        return true;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra + 1) {
        if (cap > SIZE_MAX / 2) {
            b->failed = true;
            return false;
        }
        cap *= 2;
    }
    char *d = realloc(b->data, cap);
    if (!d) {
        b->failed = true;
        return false;
    }
    b->data = d;
    b->cap = cap;
    return true;
}

void ckpt_buf_append(ckpt_buf_t *b, const char *s, size_t len)
{
    if (!buf_reserve(b, len))
        return;
    memcpy(b->data + b->len, s, len);
    b->len += len;
    b->data[b->len] = '\0';
}

static void buf_vprintf(ckpt_buf_t *b, const char *fmt, va_list ap)
{
    va_list ap2;
    va_copy(ap2, ap);
    char small[256];
    int n = vsnprintf(small, sizeof(small), fmt, ap);
    if (n < 0) {
        b->failed = true;
    } else if ((size_t)n < sizeof(small)) {
        ckpt_buf_append(b, small, (size_t)n);
    } else if (buf_reserve(b, (size_t)n)) {
        vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap2);
        b->len += (size_t)n;
    }
    va_end(ap2);
}

void ckpt_buf_printf(ckpt_buf_t *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    buf_vprintf(b, fmt, ap);
    va_end(ap);
}

void ckpt_buf_json_str(ckpt_buf_t *b, const char *s, size_t len)
{
    ckpt_buf_append(b, "\"", 1);
    size_t run = 0; /* bytes copied through unchanged, appended in one go */
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            run++;
            continue;
        }
        ckpt_buf_append(b, s + i - run, run);
        run = 0;
        if (c == '"')
            ckpt_buf_append(b, "\\\"", 2);
        else if (c == '\\')
            ckpt_buf_append(b, "\\\\", 2);
        else if (c == '\n')
            ckpt_buf_append(b, "\\n", 2);
        else if (c == '\t')
            ckpt_buf_append(b, "\\t", 2);
        else
            ckpt_buf_printf(b, "\\u%04x", c);
    }
    ckpt_buf_append(b, s + len - run, run);
    ckpt_buf_append(b, "\"", 1);
}

void ckpt_buf_double(ckpt_buf_t *b, double v)
{
    locale_t loc = json_c_locale();
    locale_t old = loc ? uselocale(loc) : (locale_t)0;
    ckpt_buf_printf(b, "%.17g", v);
    if (loc)
        uselocale(old);
}
