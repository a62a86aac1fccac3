/* A multi-layer perceptron with forward and backward written out (matrix products through
 * cblas_sgemm), the learnable synthetic task the example trains on, and its data schedule.
 * Shared by the example trainer's distributed mode and its single-process --local reference,
 * so both compute exactly the same thing. Not thread-safe per model object. */
#ifndef PSHARD_EXAMPLE_MLP_H
#define PSHARD_EXAMPLE_MLP_H

#include <stddef.h>
#include <stdint.h>

#define MLP_MAX_LAYERS 16

/* widths[0] is the input size, widths[nlayers] the output size; layer l maps widths[l] to
 * widths[l+1]. Parameters in definition order: for each layer l, "fc{l}.weight" of shape
 * [widths[l+1], widths[l]] (torch.nn.Linear's layout: out x in, row-major) then "fc{l}.bias" of
 * shape [widths[l+1]]. ReLU between layers, none after the last. */
typedef struct {
    int nlayers;
    int widths[MLP_MAX_LAYERS + 1];
} mlp_shape_t;

/* Parses "1024,1024,1024,1024" as the hidden widths; the input and output sizes are given
 * separately. Returns 0 or -1 (bad number, too many layers). */
int mlp_parse_widths(const char *text, int input, int output, mlp_shape_t *shape);

size_t mlp_num_params(const mlp_shape_t *shape); /* 2 * nlayers tensors */
void mlp_param_name(const mlp_shape_t *shape, size_t p, char *buf, size_t len);
size_t mlp_param_numel(const mlp_shape_t *shape, size_t p);
size_t mlp_param_rows(const mlp_shape_t *shape, size_t p); /* shape[0] */
int mlp_param_ndim(const mlp_shape_t *shape, size_t p);
void mlp_param_shape(const mlp_shape_t *shape, size_t p, int64_t out[2]);

/* torch.nn.Linear's default init (kaiming-uniform weights and uniform biases, bound
 * 1/sqrt(fan_in)) from a deterministic generator seeded by seed: the same seed gives the same
 * values on every rank and in --local. params[p] has mlp_param_numel elements. */
void mlp_init_params(const mlp_shape_t *shape, uint64_t seed, float *const *params);

/* Scratch for forward/backward at batch size up to max_batch. Free with mlp_workspace_free. */
typedef struct mlp_workspace mlp_workspace_t;
mlp_workspace_t *mlp_workspace_create(const mlp_shape_t *shape, int max_batch);
void mlp_workspace_free(mlp_workspace_t *ws);

/* Forward on x [batch x widths[0]] and the mean-squared-error loss against y
 * [batch x widths[nlayers]] (mean over batch and outputs, like torch.nn.MSELoss). If grads is
 * non-NULL, also runs backward and writes d(loss)/d(param) into grads[p] (overwriting).
 * params/grads are fp32 arrays per parameter. Returns the loss. */
double mlp_forward_backward(const mlp_shape_t *shape, mlp_workspace_t *ws,
                            const float *const *params, const float *x, const float *y, int batch,
                            float *const *grads);

/* The same computation one layer at a time, for trainers that hold one layer's parameters at
 * a time (FSDP): mlp_layer_forward for l = 0 .. nlayers-1 in order (x is the batch, read by
 * layers 0 in both passes), then mlp_loss (returns the loss and seeds backward), then
 * mlp_layer_backward for l = nlayers-1 down to 0, which writes layer l's gradients into gw
 * [widths[l+1] x widths[l]] and gb [widths[l+1]] (overwriting). w and b are layer l's
 * parameters. Results are bit-identical to mlp_forward_backward's. */
void mlp_layer_forward(const mlp_shape_t *shape, mlp_workspace_t *ws, int l, const float *w,
                       const float *b, const float *x, int batch);
double mlp_loss(const mlp_shape_t *shape, mlp_workspace_t *ws, const float *y, int batch);
void mlp_layer_backward(const mlp_shape_t *shape, mlp_workspace_t *ws, int l, const float *w,
                        const float *x, int batch, float *gw, float *gb);

/* Writes params (fp32, definition order) to path as raw little-endian floats, for tests that
 * compare final weights. Returns 0, or -1 with a message on stderr. */
int mlp_dump_weights(const char *path, const mlp_shape_t *shape, const float *const *params);

/* The task: a fixed random "teacher" MLP (same shape, seeded by task_seed, independent of the
 * student's init) produces targets y = teacher(x) for inputs x ~ N(0, 1). Batch b of rank r
 * (b = 0, 1, ...) is a deterministic function of (data_seed, rank, b), so the --local reference
 * can rebuild every rank's batches. Fills x [batch x in] and y [batch x out]. */
typedef struct mlp_task mlp_task_t;
mlp_task_t *mlp_task_create(const mlp_shape_t *shape, uint64_t task_seed);
void mlp_task_free(mlp_task_t *task);
void mlp_task_batch(mlp_task_t *task, uint64_t data_seed, int rank, int64_t b, int batch, float *x,
                    float *y);

#endif
