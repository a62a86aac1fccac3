/* What the files of pshard._C share: the Client and Work objects, the DLPack consumer and the
 * helpers their methods call. pshard_module.c has the module and the Client's core methods;
 * pshard_dlpack.c the DLPack consumer and Buffers; pshard_work.c Works; pshard_define.c
 * define_model; pshard_colls.c the Client's plain collectives on tensors (torch.distributed's
 * calls); pshard_groups.c the process groups; pshard_shard.c the views of the shard server's
 * own memory and the trainer-side step, pshard_store.c the coordinator's store
 * (pshard._C.Store).
 * Internal to the extension. */
#ifndef PSHARD_PY_H
#define PSHARD_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "pshard/pshard.h"

/* ---- DLPack (the v0.8 / legacy ABI, from the DLPack specification) ----------------------- */

typedef struct {
    int32_t device_type; /* kDLCPU = 1, kDLCUDA = 2 */
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code; /* kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4 */
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

#define DL_CPU 1
#define DL_CUDA 2
#define DL_INT 0
#define DL_UINT 1
#define DL_FLOAT 2
#define DL_BFLOAT 4
#define DL_BOOL 6

/* A Client: one trainer's connection to its shard server. */
typedef struct {
    PyObject_HEAD pshard_client_t *c;
    /* libpshard's client is used by one thread at a time: Python threads take turns here,
     * with the GIL released. */
    pthread_mutex_t op_mu;
    pshard_dtype_t param_dtype, reduce_dtype;
    size_t nparams;
    PyObject *shapes;   /* tuple of shape tuples of the defined model, or NULL */
    bool closing;       /* close() was called while views of its memory were alive */
    Py_ssize_t exports; /* live Buffers (and DLPack tensors) pointing into its memory */
    Py_ssize_t pending; /* Works not yet waited for: close waits for them to be */
} ClientObject;

/* Runs stmt on self's client with the GIL released, one Python thread at a time. */
#define CLIENT_CALL(self, stmt)                                                                    \
    do {                                                                                           \
        Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&(self)->op_mu);                                 \
        stmt;                                                                                      \
        pthread_mutex_unlock(&(self)->op_mu);                                                      \
        Py_END_ALLOW_THREADS                                                                       \
    } while (0)

/* A tensor coming in through its __dlpack__ capsule (pshard_py_dl_acquire). */
typedef struct {
    PyObject *capsule;
    DLManagedTensor *mt;
    void *data;
    size_t numel;
} dl_in_t;

/* A Work: an asynchronous gather, reduce-scatter or collective. */
typedef struct {
    PyObject_HEAD ClientObject *owner;
    pshard_work_t *w; /* NULL once waited */
    pshard_status_t status;
    char error[PSHARD_ERRLEN];
    /* An asynchronous collective's tensors and group, held until it finished. */
    dl_in_t dl[2];
    PyObject *group;
    /* A staged collective (collective_start's own) that receives: its result, out_bytes,
     * goes into the recv tensor out_obj when the work is waited for, if that tensor still has
     * the memory it had at the start. */
    size_t out_bytes;
    PyObject *out_obj;
    pshard_dtype_t out_dtype;
} WorkObject;

/* Adds pshard._C.Store (pshard_store.c) to the module; -1 with an exception on failure. */
int pshard_py_store_init(PyObject *m);

/* pshard_ckpt.c: pshard's checkpoints read and written offline (module functions). */
PyObject *pshard_py_ckpt_open(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *pshard_py_ckpt_read(PyObject *mod, PyObject *args);
PyObject *pshard_py_ckpt_write(PyObject *mod, PyObject *args);

/* Raises the exception class of st (pshard.Error's subclasses) with msg, the enum name on
 * .status; returns NULL. */
PyObject *pshard_py_raise_status(pshard_status_t st, const char *msg);

/* 1 when self can take calls; else 0 with the exception a destroyed process group gives. */
int pshard_py_client_ok(ClientObject *self);

/* Raises the exception of st with the client's last error; returns NULL. */
PyObject *pshard_py_client_fail(ClientObject *self, pshard_status_t st);

/* Closes self's connection now (GIL released) if it is open: close(), or the last Buffer or
 * Work that close() waited for. */
void pshard_py_client_really_close(ClientObject *self);

/* A PyArg "O&" converter: a dtype name ("fp32", "bf16", ...) into *(pshard_dtype_t *)out.
 * Returns 1, or 0 with a TypeError or ValueError set. */
int pshard_py_parse_dtype(PyObject *o, pshard_dtype_t *out);

/* Reads a tensor through obj.__dlpack__(): on the CPU, contiguous, of dtype want; what names
 * the argument in errors. Returns 0 (release with pshard_py_dl_release), or -1 with an
 * exception set. */
int pshard_py_dl_acquire(PyObject *obj, pshard_dtype_t want, const char *what, dl_in_t *in);
void pshard_py_dl_release(dl_in_t *in);

/* The Work type, pshard._C.Work (pshard_work.c). */
extern PyTypeObject pshard_py_WorkType;

/* A new Work of owner with nothing started, or NULL with an exception set. */
WorkObject *pshard_py_work_new(ClientObject *owner);

/* w holding the work a start function gave (st), counted until waited for; or, when st is an
 * error, NULL with its exception set and w dropped. */
PyObject *pshard_py_work_started(ClientObject *self, WorkObject *w, pshard_status_t st,
                                 pshard_work_t *work);

/* The Buffer type, pshard._C.Buffer (pshard_dlpack.c). */
extern PyTypeObject pshard_py_BufferType;

/* A new Buffer (pshard_dlpack.c): a view of data, in owner's memory, of dtype and shape (a
 * tuple of ints), exported through DLPack and the buffer protocol; it keeps owner alive and
 * counted among its exports. NULL with an exception set when out of memory. */
PyObject *pshard_py_buffer_new(ClientObject *owner, void *data, pshard_dtype_t dtype,
                               PyObject *shape);
/* The same over CUDA device memory of device `device` (a GPU-resident shard opened through
 * CUDA IPC): DLPack says kDLCUDA; the buffer protocol refuses it. */
PyObject *pshard_py_cuda_buffer_new(ClientObject *owner, void *data, pshard_dtype_t dtype,
                                    PyObject *shape, int device);

/* Client.shard_view, shard_state, step_trainer, trainer_state_info and set_step
 * (pshard_shard.c), for the Client's method table. */
PyObject *Client_shard_view(ClientObject *self, PyObject *arg);
/* Client.shard_memory() -> (kind, device): where the shard is ("host", "cuda", "emulated") and
 * the CUDA device of GPU-resident shards (else None). */
PyObject *Client_shard_memory(ClientObject *self, PyObject *unused);
PyObject *Client_step_trainer(ClientObject *self, PyObject *args, PyObject *kwargs);
PyObject *Client_trainer_state_info(ClientObject *self, PyObject *unused);
PyObject *Client_resync(ClientObject *self, PyObject *unused);
PyObject *Client_report_step(ClientObject *self, PyObject *args, PyObject *kwargs);
PyObject *Client_shard_state(ClientObject *self, PyObject *arg);
PyObject *Client_set_step(ClientObject *self, PyObject *arg);

/* Client.define_model (pshard_define.c), for the Client's method table. */
PyObject *Client_define_model(ClientObject *self, PyObject *args, PyObject *kw);

/* Fills a group from a dict of torch's names (lr, momentum, dampening, nesterov, weight_decay,
 * betas, eps, frozen); missing keys keep *g. Returns 0, or -1 with an exception set
 * (pshard_define.c; Client.step takes such dicts too). */
int pshard_py_group_from_dict(PyObject *d, pshard_optim_group_t *g);

/* The Client's plain collectives (pshard_colls.c), for its method table: each takes the
 * arguments its docstring in pshard_module.c gives, the last one an optional Group. */
PyObject *Client_collective_start(ClientObject *self, PyObject *args);
PyObject *Client_p2p(ClientObject *self, PyObject *args);
PyObject *Client_reduce_scatter_tensor(ClientObject *self, PyObject *args);
PyObject *Client_all_reduce(ClientObject *self, PyObject *args);
PyObject *Client_broadcast(ClientObject *self, PyObject *args);
PyObject *Client_all_gather(ClientObject *self, PyObject *args);
PyObject *Client_all_to_all(ClientObject *self, PyObject *args);
PyObject *Client_reduce(ClientObject *self, PyObject *args);
PyObject *Client_gather_to(ClientObject *self, PyObject *args);
PyObject *Client_scatter_from(ClientObject *self, PyObject *args);
PyObject *Client_barrier(ClientObject *self, PyObject *args);
PyObject *Client_new_groups(ClientObject *self, PyObject *args, PyObject *kw);

#endif
