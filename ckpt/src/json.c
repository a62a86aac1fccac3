/* The checkpoint format's JSON, over jansson: loading a document strictly (duplicate keys
 * refused, integers kept apart from reals) with messages that say where, naming values' types,
 * and explaining why an object with fixed keys did not unpack. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ckpt_internal.h"
#include "pshard/util.h"

pshard_status_t ckpt_json_load(const char *data, size_t len, json_t **out, char *err, size_t errlen)
{
    json_error_t je;
    /* No JSON_DECODE_ANY: the root is an object or an array (a manifest or a safetensors
     * header is an object; the schema checks say so when it is not). Integers stay integers:
     * no JSON_DECODE_INT_AS_REAL. */
    *out = json_loadb(data, len, JSON_REJECT_DUPLICATES, &je);
    if (*out)
        return PSHARD_OK;
    return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "line %d, column %d: %s", je.line,
                   je.column, je.text);
}

const char *ckpt_json_type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_STRING:
        return "a string";
    case JSON_INTEGER:
        return "an integer";
    case JSON_REAL:
        return "a real number";
    case JSON_TRUE:
    case JSON_FALSE:
        return "a boolean";
    default:
        return "null";
    }
}

bool ckpt_utf8_valid(const char *s, size_t len)
{
    /* Exactly what jansson will write: it refuses to make a string of anything else. */
    json_t *v = json_stringn(s, len);
    json_decref(v);
    return v != NULL;
}

static bool has_type(const json_t *v, ckpt_json_kind_t kind)
{
    switch (kind) {
    case CKPT_JSON_STRING:
        return json_is_string(v);
    case CKPT_JSON_INTEGER:
        return json_is_integer(v);
    case CKPT_JSON_NUMBER:
        return json_is_number(v);
    case CKPT_JSON_BOOLEAN:
        return json_is_boolean(v);
    case CKPT_JSON_ARRAY:
        return json_is_array(v);
    default:
        return true;
    }
}

static const char *const kind_names[] = {"a string",  "an integer", "a number",
                                         "a boolean", "an array",   "a value"};

pshard_status_t ckpt_json_explain(const json_t *obj, const char *where,
                                  const ckpt_json_field_t *fields, size_t nfields, char *err,
                                  size_t errlen)
{
    const char *sep = *where ? ": " : "";
    if (!json_is_object(obj))
        return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: expected an object, found %s",
                       *where ? where : "manifest", ckpt_json_type_name(obj));
    const char *key;
    json_t *value;
    json_object_foreach((json_t *)obj, key, value)
    {
        bool known = false;
        for (size_t i = 0; i < nfields && !known; i++)
            known = strcmp(key, fields[i].key) == 0;
        if (!known)
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s%sunknown key \"%.64s\" (not in version 1)", where, sep, key);
    }
    for (size_t i = 0; i < nfields; i++)
        if (!(fields[i].kind & CKPT_JSON_OPTIONAL) && !json_object_get(obj, fields[i].key))
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s%smissing key \"%s\"",
                           where, sep, fields[i].key);
    for (size_t i = 0; i < nfields; i++) {
        const json_t *v = json_object_get(obj, fields[i].key);
        ckpt_json_kind_t kind = (ckpt_json_kind_t)(fields[i].kind & ~CKPT_JSON_OPTIONAL);
        if (v && !has_type(v, kind))
            return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT,
                           "%s%s%s: expected %s, found %s", where, *where ? "." : "", fields[i].key,
                           kind_names[kind], ckpt_json_type_name(v));
    }
    return ps_errf(err, errlen, PSHARD_ERR_INVALID_ARGUMENT, "%s: malformed",
                   *where ? where : "manifest");
}
