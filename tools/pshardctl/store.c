/* pshardctl store: get, set, delete, add and wait on the coordinator's store. */

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard/util.h"

#include "ctl.h"

int cmd_store(int argc, char **argv)
{
    if (argc < 2)
        return ctl_fail("store needs get|set|add|wait and a KEY (see --help)");
    const char *sub = argv[0];
    int64_t timeout = ctl_opts.timeout_ms;
    int rc;
    if (strcmp(sub, "get") == 0 && argc == 2) {
        Pshard__StoreGetRequest req = PSHARD__STORE_GET_REQUEST__INIT;
        req.key = argv[1];
        Pshard__StoreGetResponse *r = NULL;
        if ((rc = CTL_CALL(store_get, &req, &r, timeout)) != EXIT_OK)
            return rc;
        if (ctl_opts.json) {
            json_t *v = json_pack("{s:o}", "key", ctl_jstr(argv[1]));
            json_t *value = ctl_jbytes(r->value.data, r->value.len);
            if (v && (!value || json_object_update(v, value) != 0)) {
                json_decref(v);
                v = NULL;
            }
            json_decref(value);
            rc = ctl_json_print(v);
        } else {
            fwrite(r->value.data, 1, r->value.len, stdout);
            fputc('\n', stdout);
        }
        protobuf_c_message_free_unpacked(&r->base, NULL);
        return rc;
    } else if (strcmp(sub, "set") == 0 && argc == 3) {
        Pshard__StoreSetRequest req = PSHARD__STORE_SET_REQUEST__INIT;
        req.key = argv[1];
        req.value.data = (uint8_t *)argv[2];
        req.value.len = strlen(argv[2]);
        if ((rc = CTL_CALL(store_set, &req, NULL, timeout)) != EXIT_OK)
            return rc;
    } else if (strcmp(sub, "delete") == 0 && argc == 2) {
        Pshard__StoreDeleteRequest req = PSHARD__STORE_DELETE_REQUEST__INIT;
        req.key = argv[1];
        Pshard__StoreDeleteResponse *r = NULL;
        if ((rc = CTL_CALL(store_delete, &req, &r, timeout)) != EXIT_OK)
            return rc;
        if (ctl_opts.json)
            ctl_json_print(json_pack("{s:b}", "deleted", r->deleted));
        else
            printf("%s\n", r->deleted ? "deleted" : "not set");
        protobuf_c_message_free_unpacked(&r->base, NULL);
    } else if (strcmp(sub, "add") == 0 && argc == 3) {
        Pshard__StoreAddRequest req = PSHARD__STORE_ADD_REQUEST__INIT;
        req.key = argv[1];
        if (ps_parse_i64(argv[2], INT64_MIN, INT64_MAX, &req.delta) != 0)
            return ctl_fail("store add: '%s' is not an integer", argv[2]);
        Pshard__StoreAddResponse *r = NULL;
        if ((rc = CTL_CALL(store_add, &req, &r, timeout)) != EXIT_OK)
            return rc;
        printf("%" PRId64 "\n", r->value);
        protobuf_c_message_free_unpacked(&r->base, NULL);
    } else if (strcmp(sub, "wait") == 0) {
        Pshard__StoreWaitRequest req = PSHARD__STORE_WAIT_REQUEST__INIT;
        req.n_keys = (size_t)argc - 1;
        req.keys = argv + 1;
        req.timeout_ms = timeout;
        Pshard__StoreWaitResponse *r = NULL;
        if ((rc = CTL_CALL(store_wait, &req, &r, timeout + 2000)) != EXIT_OK)
            return rc;
        for (size_t i = 0; i < r->n_values; i++) {
            printf("%s=", argv[1 + i]);
            fwrite(r->values[i].data, 1, r->values[i].len, stdout);
            fputc('\n', stdout);
        }
        protobuf_c_message_free_unpacked(&r->base, NULL);
    } else {
        return ctl_fail("store: unknown form '%s' with %d arguments (see --help)", sub, argc - 1);
    }
    return EXIT_OK;
}
