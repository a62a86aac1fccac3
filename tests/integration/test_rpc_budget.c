/* The RPC server's send budgets (issue #13, "a byte cap per call and per connection"): a
 * client that opens many streams on one connection and reads none of them must not make the
 * server queue each stream's full per-call allowance. An in-process server with a 2 MiB
 * per-call and 4 MiB per-connection budget streams 256 KiB messages as fast as it may; 8
 * unread streams on one connection get at most the connection's budget queued between them
 * (before: 8 x 2 MiB), while a stream on a connection of its own still gets its full
 * per-call allowance. What the server holds is its queue (ps_rpc_server_load's peak); what
 * the handlers could send beyond it went to the client's HTTP/2 windows, which gRPC's
 * bandwidth probing grows at the client's will, so it is printed, not bounded. Loopback only,
 * ephemeral port. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <CUnit/Basic.h>

#include "pshard/rpc.h"
#include "pshard/shard.pb-c.h"
#include "pshard/util.h"

#define MSG_BYTES (256 * 1024)
#define CALL_BUDGET (2u << 20)
#define CONN_BUDGET (4u << 20)
#define STREAMS 8

static atomic_size_t accepted_bytes; /* what the handlers could queue, all streams together */
static atomic_int handlers_done;

/* Sends MSG_BYTES chunks until the server refuses one, never waiting for the reader. */
static void handle_flood(ps_rpc_call_t *call, const ProtobufCMessage *request, void *ctx)
{
    (void)request;
    (void)ctx;
    static uint8_t payload[MSG_BYTES];
    Pshard__DataChunk c = PSHARD__DATA_CHUNK__INIT;
    c.data.data = payload;
    c.data.len = sizeof(payload);
    for (int i = 0; i < 64; i++) {
        if (ps_rpc_call_send(call, &c.base) != PSHARD_OK)
            break;
        atomic_fetch_add(&accepted_bytes, sizeof(payload));
    }
    atomic_fetch_add(&handlers_done, 1);
    ps_rpc_call_finish(call);
}

static void wait_handlers(int n)
{
    int64_t end = ps_now_ns() + 20 * 1000000000LL;
    while (atomic_load(&handlers_done) < n && ps_now_ns() < end) {
        struct timespec ts = {0, 10 * 1000000};
        nanosleep(&ts, NULL);
    }
    CU_ASSERT_EQUAL(atomic_load(&handlers_done), n);
}

static void test_connection_budget(void)
{
    ps_rpc_server_config_t scfg = {.listen = "127.0.0.1:0",
                                   .max_stream_queue_bytes = CALL_BUDGET,
                                   .max_conn_queue_bytes = CONN_BUDGET,
                                   .worker_threads = STREAMS + 2};
    char err[256] = "";
    ps_rpc_server_t *srv = ps_rpc_server_create(&scfg, err, sizeof(err));
    CU_ASSERT_PTR_NOT_NULL_FATAL(srv);
    static const ps_rpc_method_t methods[] = {
        {"/pshard.ShardServer/ReadRegion", &pshard__region_read_request__descriptor, handle_flood,
         PS_RPC_STREAM, NULL},
    };
    CU_ASSERT_FATAL(ps_rpc_server_add_methods(srv, methods, 1) == PSHARD_OK);
    int port = ps_rpc_server_start(srv);
    CU_ASSERT_FATAL(port > 0);
    char target[64];
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);

    /* 8 streams on one connection, none read. */
    ps_rpc_channel_config_t cc = {
        .target = target, .own_connection = true, .max_message_bytes = 16 << 20};
    ps_rpc_channel_t *ch = ps_rpc_channel_create(&cc, err, sizeof(err));
    CU_ASSERT_PTR_NOT_NULL_FATAL(ch);
    Pshard__RegionReadRequest req = PSHARD__REGION_READ_REQUEST__INIT;
    ps_rpc_stream_t *st[STREAMS];
    for (int i = 0; i < STREAMS; i++) {
        st[i] = ps_rpc_stream_open(ch, "/pshard.ShardServer/ReadRegion", &req.base, 30000, err,
                                   sizeof(err));
        CU_ASSERT_PTR_NOT_NULL_FATAL(st[i]);
    }
    wait_handlers(STREAMS);
    ps_rpc_load_t load;
    ps_rpc_server_load(srv, &load);
    size_t peak = load.send_queued_peak_bytes;
    printf("\n  %d unread streams on one connection: at most %zu KiB queued in the server, "
           "%zu KiB sent in all (per-call budget %u KiB, per-connection %u KiB; without the "
           "connection budget: %u KiB queued)\n",
           STREAMS, peak / 1024, atomic_load(&accepted_bytes) / 1024, CALL_BUDGET / 1024,
           CONN_BUDGET / 1024, STREAMS * CALL_BUDGET / 1024);
    CU_ASSERT(peak > 0);
    CU_ASSERT(peak <= CONN_BUDGET);

    /* A stream on a connection of its own is not held back by the full one. */
    atomic_store(&accepted_bytes, 0);
    ps_rpc_channel_t *own = ps_rpc_channel_create(&cc, err, sizeof(err));
    CU_ASSERT_PTR_NOT_NULL_FATAL(own);
    ps_rpc_stream_t *alone = ps_rpc_stream_open(own, "/pshard.ShardServer/ReadRegion", &req.base,
                                                30000, err, sizeof(err));
    CU_ASSERT_PTR_NOT_NULL_FATAL(alone);
    wait_handlers(STREAMS + 1);
    size_t alone_bytes = atomic_load(&accepted_bytes);
    printf("  a stream on a connection of its own: %zu KiB sent\n", alone_bytes / 1024);
    /* Its own per-call cap is what stops it: 7 messages of 256 KiB and their framing fit in
     * 2 MiB (more when gRPC took some off the queue), where a budget shared with the full
     * connection would have left it 256 KiB at most. */
    CU_ASSERT(alone_bytes >= CALL_BUDGET - MSG_BYTES);

    ps_rpc_stream_close(alone);
    for (int i = 0; i < STREAMS; i++)
        ps_rpc_stream_close(st[i]);
    ps_rpc_channel_destroy(own);
    ps_rpc_channel_destroy(ch);
    ps_rpc_server_destroy(srv);
}

int main(void)
{
    if (CU_initialize_registry() != CUE_SUCCESS)
        return 1;
    CU_pSuite suite = CU_add_suite("rpc send budgets", NULL, NULL);
    CU_add_test(suite, "unread streams on one connection share its budget", test_connection_budget);
    CU_basic_set_mode(CU_BRM_VERBOSE);
    CU_basic_run_tests();
    unsigned failed = CU_get_number_of_failures() + CU_get_number_of_tests_failed();
    CU_cleanup_registry();
    return failed ? 1 : 0;
}
