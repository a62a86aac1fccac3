/* The shard server's GPU-resident shard and the model region in its GPU memory, opened by its
 * trainer through CUDA IPC (pshard_shard_view and device_region with --backend nccl and no
 * --offload): a real coordinator and one shard server on GPU 0 (world 1: NCCL puts one rank on
 * a device), and this process as the trainer. The view and the region must say
 * PSHARD_MEMORY_CUDA on device 0 and hold device pointers; the view's contents, copied out with
 * cudaMemcpy, are the initial values; values written into them with cudaMemcpy are what the
 * next gather writes into the region's device buffers; a new gradient buffer reads zero, and
 * the gradient written there lands in the view's accumulator; a trainer step counts. Then the
 * model is defined again (the server frees
 * the first allocations after this client closed its handles) and the client closes; the
 * server must exit cleanly. Exits 77 (skipped) without a CUDA device.
 * argv: pshard-coordinator pshard-server. */
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "ps_proc.h"
#include "pshard/pshard.h"

#define NP 2
static const char *names[NP] = {"w", "b"};
static const int64_t shape_w[2] = {5, 3}, shape_b[1] = {7};
static const int64_t *shapes[NP] = {shape_w, shape_b};
static const int ndims[NP] = {2, 1};
static const size_t numels[NP] = {15, 7};

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FAILED: ");                                                           \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__);                                     \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

static float init_value(int p, size_t j)
{
    return 0.25f * (float)(p + 1) + 0.01f * (float)j;
}

static float new_value(int p, size_t j)
{
    return -1.5f * (float)(p + 1) - 0.125f * (float)j;
}

/* The trainer: returns 0 when every check passed. */
static int train(const char *server)
{
    pshard_client_config_t cfg = {.server = server,
                                  .rank = 0,
                                  .world_size = 1,
                                  .connect_timeout_ms = 30000,
                                  .timeout_ms = 60000};
    pshard_client_t *c = NULL;
    char err[1024] = "";
    CHECK(pshard_connect(&cfg, &c, err, sizeof(err)) == PSHARD_OK, "connect: %s", err);
    float init_w[15], init_b[7];
    float *init[NP] = {init_w, init_b};
    pshard_param_t params[NP];
    for (int p = 0; p < NP; p++) {
        for (size_t j = 0; j < numels[p]; j++)
            init[p][j] = init_value(p, j);
        params[p] = (pshard_param_t){.name = names[p], .shape = shapes[p], .ndim = ndims[p]};
    }
    pshard_model_config_t mc;
    pshard_model_config_default(&mc, PSHARD_ADAM);
    mc.device_region = true;
    mc.stable_param_buffers = true;
    CHECK(pshard_define_model(c, params, NP, &mc, (const float *const *)init) == PSHARD_OK,
          "define: %s", pshard_last_error(c));
    int rdev = -1;
    CHECK(pshard_region_memory(c, &rdev) == PSHARD_MEMORY_CUDA && rdev == 0,
          "the model region is not the server's GPU memory (device %d)", rdev);
    pshard_shard_view_t v;
    float host[32];
    for (int p = 0; p < NP; p++) {
        CHECK(pshard_shard_view(c, (size_t)p, &v) == PSHARD_OK, "view: %s", pshard_last_error(c));
        CHECK(v.memory == PSHARD_MEMORY_CUDA && v.device == 0 && v.numel == numels[p],
              "'%s': memory %d on device %d, %zu elements", names[p], v.memory, v.device, v.numel);
        struct cudaPointerAttributes at;
        CHECK(cudaPointerGetAttributes(&at, v.master) == cudaSuccess &&
                  at.type == cudaMemoryTypeDevice,
              "'%s': the view's master is not device memory", names[p]);
        CHECK(cudaMemcpy(host, v.master, v.numel * 4, cudaMemcpyDeviceToHost) == cudaSuccess,
              "copying '%s' out", names[p]);
        for (size_t j = 0; j < v.numel; j++)
            CHECK(host[j] == init_value(p, j), "'%s'[%zu] is %g, not %g", names[p], j, host[j],
                  init_value(p, j));
        for (size_t j = 0; j < v.numel; j++)
            host[j] = new_value(p, j);
        CHECK(cudaMemcpy(v.master, host, v.numel * 4, cudaMemcpyHostToDevice) == cudaSuccess,
              "writing '%s'", names[p]);
    }
    CHECK(pshard_gather(c, NULL, 0) == PSHARD_OK, "gather: %s", pshard_last_error(c));
    for (int p = 0; p < NP; p++) {
        const float *full = pshard_param(c, (size_t)p);
        CHECK(full != NULL, "'%s' not gathered", names[p]);
        struct cudaPointerAttributes at;
        CHECK(cudaPointerGetAttributes(&at, full) == cudaSuccess && at.type == cudaMemoryTypeDevice,
              "'%s': the gathered buffer is not device memory", names[p]);
        CHECK(cudaMemcpy(host, full, numels[p] * 4, cudaMemcpyDeviceToHost) == cudaSuccess,
              "copying gathered '%s' out", names[p]);
        for (size_t j = 0; j < numels[p]; j++)
            CHECK(host[j] == new_value(p, j), "gathered '%s'[%zu] is %g, written %g", names[p], j,
                  host[j], new_value(p, j));
    }
    CHECK(pshard_reshard(c, NULL, 0) == PSHARD_OK, "reshard: %s", pshard_last_error(c));
    for (int p = 0; p < NP; p++) {
        float *g = pshard_grad(c, (size_t)p);
        CHECK(g != NULL, "grad buffer: %s", pshard_last_error(c));
        CHECK(cudaMemcpy(host, g, numels[p] * 4, cudaMemcpyDeviceToHost) == cudaSuccess,
              "copying '%s' grad buffer out", names[p]);
        for (size_t j = 0; j < numels[p]; j++) {
            CHECK(host[j] == 0.0f, "a new gradient buffer of '%s' holds %g", names[p], host[j]);
            host[j] = (float)(j + 1) * 0.5f;
        }
        CHECK(cudaMemcpy(g, host, numels[p] * 4, cudaMemcpyHostToDevice) == cudaSuccess,
              "writing '%s' grad", names[p]);
    }
    CHECK(pshard_reduce_scatter(c, NULL, 0) == PSHARD_OK, "reduce_scatter: %s",
          pshard_last_error(c));
    for (int p = 0; p < NP; p++) {
        CHECK(pshard_shard_view(c, (size_t)p, &v) == PSHARD_OK, "view: %s", pshard_last_error(c));
        CHECK(cudaMemcpy(host, v.grad, v.numel * 4, cudaMemcpyDeviceToHost) == cudaSuccess,
              "copying '%s' grad out", names[p]);
        for (size_t j = 0; j < v.numel; j++)
            CHECK(host[j] == (float)(j + 1) * 0.5f, "'%s' grad[%zu] is %g", names[p], j, host[j]);
    }
    int64_t step = 0;
    CHECK(pshard_step_trainer(c, &step) == PSHARD_OK && step == 1, "trainer step: %s (step %lld)",
          pshard_last_error(c), (long long)step);
    /* A second definition: the server swaps allocations, this client reopens. */
    CHECK(pshard_define_model(c, params, NP, &mc, (const float *const *)init) == PSHARD_OK,
          "define again: %s", pshard_last_error(c));
    CHECK(pshard_shard_view(c, 0, &v) == PSHARD_OK && v.memory == PSHARD_MEMORY_CUDA,
          "view after redefining: %s", pshard_last_error(c));
    CHECK(cudaMemcpy(host, v.master, v.numel * 4, cudaMemcpyDeviceToHost) == cudaSuccess &&
              host[0] == init_value(0, 0),
          "the redefined model's master is %g", host[0]);
    pshard_close(c);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s COORDINATOR SERVER\n", argv[0]);
        return 2;
    }
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n < 1) {
        printf("no CUDA device (%s): skipping the CUDA IPC shard test\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return 77;
    }
    signal(SIGPIPE, SIG_IGN);
    const char *cargs[] = {"--world-size", "1", NULL};
    char target[64];
    pid_t coord = ps_proc_start_coordinator(argv[1], cargs, target, sizeof(target));
    if (coord < 0) {
        fprintf(stderr, "the coordinator did not start\n");
        return 1;
    }
    char dir[] = "/tmp/pshard-ipc-XXXXXX";
    if (!mkdtemp(dir)) {
        ps_proc_stop(coord, 10000);
        return 1;
    }
    char port_file[128], log[128];
    snprintf(port_file, sizeof(port_file), "%s/server.port", dir);
    snprintf(log, sizeof(log), "%s/server.log", dir);
    char *sargv[] = {argv[2], "--coordinator", target, "--name",      "srv-0",   "--backend",
                     "nccl",  "--device",      "0",    "--port-file", port_file, NULL};
    pid_t server = ps_proc_spawn(sargv, log);
    int port = ps_proc_wait_port_file(port_file, server, 60000);
    int rc = 1;
    if (port < 0) {
        fprintf(stderr, "the shard server did not start (log in %s)\n", log);
    } else {
        char addr[64];
        snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
        rc = train(addr);
    }
    int code = ps_proc_stop(server, 20000);
    if (code != 0) {
        fprintf(stderr, "the shard server exited with %d (log in %s)\n", code, log);
        rc = 1;
    }
    ps_proc_stop(coord, 10000);
    if (rc == 0) {
        unlink(port_file);
        unlink(log);
        rmdir(dir);
        printf("the GPU-resident shard through CUDA IPC: all checks passed\n");
    }
    return rc;
}
