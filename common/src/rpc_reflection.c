/* gRPC server reflection (grpc.reflection.v1alpha and v1, one wire format) over a
 * FileDescriptorSet embedded at build time, so grpcurl can list, describe and call pshard's
 * services with no .proto files at hand. Immutable once serving, so handlers take no lock. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "google/protobuf/descriptor.pb-c.h"
#include "grpc/reflection/v1alpha/reflection.pb-c.h"
#include "pshard/log.h"
#include "pshard/util.h"
#include "rpc_internal.h"

#define GRPC_NOT_FOUND 5
#define GRPC_UNIMPLEMENTED 12
#define GRPC_INVALID_ARGUMENT 3

typedef struct {
    char *name;
    size_t file;
} symbol_t;

struct ps_reflection {
    Google__Protobuf__FileDescriptorSet *set;
    ProtobufCBinaryData *packed; /* each file's serialized FileDescriptorProto */
    symbol_t *symbols;
    size_t nsymbols, cap_symbols;
    char **services;
    size_t nservices;
};

static int add_symbol(ps_reflection_t *r, const char *scope, const char *name, size_t file)
{
    if (r->nsymbols == r->cap_symbols) {
        size_t cap = r->cap_symbols ? r->cap_symbols * 2 : 64;
        symbol_t *p = realloc(r->symbols, cap * sizeof(*p));
        if (!p)
            return -1;
        r->symbols = p;
        r->cap_symbols = cap;
    }
    size_t len = strlen(scope) + strlen(name) + 2;
    char *full = malloc(len);
    if (!full)
        return -1;
    snprintf(full, len, "%s%s%s", scope, *scope ? "." : "", name);
    r->symbols[r->nsymbols++] = (symbol_t){full, file};
    return 0;
}

static int add_enum(ps_reflection_t *r, const char *scope,
                    const Google__Protobuf__EnumDescriptorProto *e, size_t file)
{
    if (!e->name || add_symbol(r, scope, e->name, file) != 0)
        return -1;
    /* Enum values live in the enum's enclosing scope, as in C++. */
    for (size_t i = 0; i < e->n_value; i++) {
        if (e->value[i]->name && add_symbol(r, scope, e->value[i]->name, file) != 0)
            return -1;
    }
    return 0;
}

static int add_message(ps_reflection_t *r, const char *scope,
                       const Google__Protobuf__DescriptorProto *m, size_t file)
{
    if (!m->name || add_symbol(r, scope, m->name, file) != 0)
        return -1;
    char inner[512];
    snprintf(inner, sizeof(inner), "%s%s%s", scope, *scope ? "." : "", m->name);
    for (size_t i = 0; i < m->n_field; i++) {
        if (m->field[i]->name && add_symbol(r, inner, m->field[i]->name, file) != 0)
            return -1;
    }
    for (size_t i = 0; i < m->n_nested_type; i++) {
        if (add_message(r, inner, m->nested_type[i], file) != 0)
            return -1;
    }
    for (size_t i = 0; i < m->n_enum_type; i++) {
        if (add_enum(r, inner, m->enum_type[i], file) != 0)
            return -1;
    }
    return 0;
}

ps_reflection_t *ps_reflection_create(const uint8_t *set, size_t len, char *err, size_t errlen)
{
    ps_reflection_t *r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    r->set = google__protobuf__file_descriptor_set__unpack(NULL, len, set);
    if (!r->set) {
        ps_errf(err, errlen, PSHARD_ERR_INTERNAL, "embedded descriptor set does not parse");
        goto fail;
    }
    r->packed = calloc(r->set->n_file ? r->set->n_file : 1, sizeof(*r->packed));
    if (!r->packed)
        goto fail;
    for (size_t f = 0; f < r->set->n_file; f++) {
        const Google__Protobuf__FileDescriptorProto *fd = r->set->file[f];
        size_t n = protobuf_c_message_get_packed_size(&fd->base);
        r->packed[f].data = malloc(n ? n : 1);
        if (!r->packed[f].data)
            goto fail;
        r->packed[f].len = protobuf_c_message_pack(&fd->base, r->packed[f].data);
        const char *pkg = fd->package ? fd->package : "";
        for (size_t i = 0; i < fd->n_message_type; i++) {
            if (add_message(r, pkg, fd->message_type[i], f) != 0)
                goto fail;
        }
        for (size_t i = 0; i < fd->n_enum_type; i++) {
            if (add_enum(r, pkg, fd->enum_type[i], f) != 0)
                goto fail;
        }
        for (size_t i = 0; i < fd->n_service; i++) {
            const Google__Protobuf__ServiceDescriptorProto *s = fd->service[i];
            if (!s->name || add_symbol(r, pkg, s->name, f) != 0)
                goto fail;
            char scope[512];
            snprintf(scope, sizeof(scope), "%s%s%s", pkg, *pkg ? "." : "", s->name);
            for (size_t m = 0; m < s->n_method; m++) {
                if (s->method[m]->name && add_symbol(r, scope, s->method[m]->name, f) != 0)
                    goto fail;
            }
        }
    }
    return r;
fail:
    ps_errf(err, errlen, PSHARD_ERR_NO_MEMORY, "reflection: out of memory");
    ps_reflection_destroy(r);
    return NULL;
}

void ps_reflection_destroy(ps_reflection_t *r)
{
    if (!r)
        return;
    if (r->packed && r->set) {
        for (size_t f = 0; f < r->set->n_file; f++)
            free(r->packed[f].data);
    }
    free(r->packed);
    for (size_t i = 0; i < r->nsymbols; i++)
        free(r->symbols[i].name);
    free(r->symbols);
    for (size_t i = 0; i < r->nservices; i++)
        free(r->services[i]);
    free(r->services);
    if (r->set)
        google__protobuf__file_descriptor_set__free_unpacked(r->set, NULL);
    free(r);
}

void ps_reflection_add_service(ps_reflection_t *r, const char *name)
{
    char **p = realloc(r->services, (r->nservices + 1) * sizeof(*p));
    if (!p)
        return;
    r->services = p;
    char *copy = strdup(name);
    if (copy)
        r->services[r->nservices++] = copy;
}

static long find_file(const ps_reflection_t *r, const char *name)
{
    for (size_t f = 0; f < r->set->n_file; f++) {
        if (r->set->file[f]->name && strcmp(r->set->file[f]->name, name) == 0)
            return (long)f;
    }
    return -1;
}

/* Marks file f and everything it imports, transitively. */
static void mark_deps(const ps_reflection_t *r, size_t f, char *marked)
{
    if (marked[f])
        return;
    marked[f] = 1;
    const Google__Protobuf__FileDescriptorProto *fd = r->set->file[f];
    for (size_t i = 0; i < fd->n_dependency; i++) {
        long d = find_file(r, fd->dependency[i]);
        if (d >= 0)
            mark_deps(r, (size_t)d, marked);
    }
}

/* Sends one answer; one the server's send budgets refuse (a client that reads none of its
 * answers, on a connection with many such streams) ends the stream with the reason, so the
 * client is never left waiting for an answer that was dropped. */
static void reply(ps_rpc_call_t *call, const ProtobufCMessage *msg)
{
    if (ps_rpc_call_send(call, msg) == PSHARD_ERR_RESOURCE_EXHAUSTED)
        ps_rpc_call_fail(call, PSHARD_ERR_RESOURCE_EXHAUSTED,
                         "too many reflection answers unread on this connection");
}

static void send_error(ps_rpc_call_t *call,
                       Grpc__Reflection__V1alpha__ServerReflectionResponse *resp, int code,
                       const char *msg)
{
    Grpc__Reflection__V1alpha__ErrorResponse er = GRPC__REFLECTION__V1ALPHA__ERROR_RESPONSE__INIT;
    er.error_code = code;
    er.error_message = (char *)msg;
    resp->message_response_case =
        GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ERROR_RESPONSE;
    resp->error_response = &er;
    reply(call, &resp->base);
}

static void send_files(const ps_reflection_t *r, ps_rpc_call_t *call,
                       Grpc__Reflection__V1alpha__ServerReflectionResponse *resp, size_t file)
{
    size_t n = r->set->n_file;
    char *marked = calloc(n, 1);
    ProtobufCBinaryData *list = calloc(n, sizeof(*list));
    if (!marked || !list) {
        free(marked);
        free(list);
        send_error(call, resp, 8, "out of memory");
        return;
    }
    mark_deps(r, file, marked);
    /* The requested file first, then its dependencies. */
    size_t count = 0;
    list[count++] = r->packed[file];
    for (size_t f = 0; f < n; f++) {
        if (marked[f] && f != file)
            list[count++] = r->packed[f];
    }
    Grpc__Reflection__V1alpha__FileDescriptorResponse fdr =
        GRPC__REFLECTION__V1ALPHA__FILE_DESCRIPTOR_RESPONSE__INIT;
    fdr.n_file_descriptor_proto = count;
    fdr.file_descriptor_proto = list;
    resp->message_response_case =
        GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_FILE_DESCRIPTOR_RESPONSE;
    resp->file_descriptor_response = &fdr;
    reply(call, &resp->base);
    free(marked);
    free(list);
}

static long find_symbol(const ps_reflection_t *r, const char *name)
{
    if (name[0] == '.')
        name++;
    for (size_t i = 0; i < r->nsymbols; i++) {
        if (strcmp(r->symbols[i].name, name) == 0)
            return (long)r->symbols[i].file;
    }
    return -1;
}

static void reflection_info(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    const ps_reflection_t *r = ctx;
    const Grpc__Reflection__V1alpha__ServerReflectionRequest *req =
        (const Grpc__Reflection__V1alpha__ServerReflectionRequest *)request;
    Grpc__Reflection__V1alpha__ServerReflectionResponse resp =
        GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__INIT;
    resp.valid_host = req->host ? req->host : "";
    resp.original_request = (Grpc__Reflection__V1alpha__ServerReflectionRequest *)req;
    char msg[PSHARD_ERRLEN];

    switch (req->message_request_case) {
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_LIST_SERVICES: {
        Grpc__Reflection__V1alpha__ServiceResponse *items =
            calloc(r->nservices ? r->nservices : 1, sizeof(*items));
        Grpc__Reflection__V1alpha__ServiceResponse **ptrs =
            calloc(r->nservices ? r->nservices : 1, sizeof(*ptrs));
        if (!items || !ptrs) {
            free(items);
            free(ptrs);
            send_error(call, &resp, 8, "out of memory");
            return;
        }
        for (size_t i = 0; i < r->nservices; i++) {
            grpc__reflection__v1alpha__service_response__init(&items[i]);
            items[i].name = r->services[i];
            ptrs[i] = &items[i];
        }
        Grpc__Reflection__V1alpha__ListServiceResponse list =
            GRPC__REFLECTION__V1ALPHA__LIST_SERVICE_RESPONSE__INIT;
        list.n_service = r->nservices;
        list.service = ptrs;
        resp.message_response_case =
            GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_LIST_SERVICES_RESPONSE;
        resp.list_services_response = &list;
        reply(call, &resp.base);
        free(items);
        free(ptrs);
        return;
    }
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_BY_FILENAME: {
        long f = find_file(r, req->file_by_filename);
        if (f < 0) {
            snprintf(msg, sizeof(msg), "file not found: %.500s", req->file_by_filename);
            send_error(call, &resp, GRPC_NOT_FOUND, msg);
        } else {
            send_files(r, call, &resp, (size_t)f);
        }
        return;
    }
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_SYMBOL: {
        long f = find_symbol(r, req->file_containing_symbol);
        if (f < 0) {
            snprintf(msg, sizeof(msg), "symbol not found: %.500s", req->file_containing_symbol);
            send_error(call, &resp, GRPC_NOT_FOUND, msg);
        } else {
            send_files(r, call, &resp, (size_t)f);
        }
        return;
    }
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_EXTENSION:
        send_error(call, &resp, GRPC_NOT_FOUND, "pshard's schemas declare no extensions");
        return;
    case GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_ALL_EXTENSION_NUMBERS_OF_TYPE: {
        if (find_symbol(r, req->all_extension_numbers_of_type) < 0) {
            snprintf(msg, sizeof(msg), "type not found: %.500s",
                     req->all_extension_numbers_of_type);
            send_error(call, &resp, GRPC_NOT_FOUND, msg);
            return;
        }
        Grpc__Reflection__V1alpha__ExtensionNumberResponse en =
            GRPC__REFLECTION__V1ALPHA__EXTENSION_NUMBER_RESPONSE__INIT;
        en.base_type_name = req->all_extension_numbers_of_type;
        resp.message_response_case =
            GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ALL_EXTENSION_NUMBERS_RESPONSE;
        resp.all_extension_numbers_response = &en;
        reply(call, &resp.base);
        return;
    }
    default:
        send_error(call, &resp, GRPC_INVALID_ARGUMENT,
                   "the request names no reflection query (list_services, file_by_filename, "
                   "file_containing_symbol, ...)");
        return;
    }
}

void ps_reflection_methods(ps_reflection_t *r, ps_rpc_method_t out[2])
{
    out[0] = (ps_rpc_method_t){"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                               &grpc__reflection__v1alpha__server_reflection_request__descriptor,
                               reflection_info, PS_RPC_BIDI | PS_RPC_INLINE | PS_RPC_OPEN, r};
    out[1] = (ps_rpc_method_t){"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                               &grpc__reflection__v1alpha__server_reflection_request__descriptor,
                               reflection_info, PS_RPC_BIDI | PS_RPC_INLINE | PS_RPC_OPEN, r};
}
