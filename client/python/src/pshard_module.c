/* pshard._C: the CPython binding of libpshard. A Client is one trainer's connection to its shard
 * server; Buffers are zero-copy views of the shared memory the server writes (exported through
 * DLPack and the buffer protocol); Works are asynchronous gathers and reduce-scatters. Tensors
 * coming in (initial values, collective buffers) are read through their __dlpack__ capsule, so
 * no numpy or torch is needed here. Every blocking call releases the GIL; pshard statuses become
 * exceptions of the classes below carrying pshard's message. This file has the module, the
 * errors and the Client's core methods; the DLPack consumer and Buffers are in pshard_dlpack.c,
 * Works in pshard_work.c, define_model in pshard_define.c, the Client's plain collectives on
 * tensors in pshard_colls.c, process groups (Group, the optional last argument of every
 * collective method) in pshard_groups.c, and what they share in pshard_py.h. */
#include "pshard_py.h"

#include <string.h>
#include <time.h>

#include "pshard_groups.h"

/* ---- errors ------------------------------------------------------------------------------ */

static PyObject *Error, *InvalidArgumentError, *OutOfMemoryError, *TimeoutErr, *PeerLostError,
    *AbortedError, *DesyncError, *JoinedError, *NotFoundError, *FailedPreconditionError,
    *UnavailableError, *StepAbortedError;

static PyObject *error_class(pshard_status_t st)
{
    switch (st) {
    case PSHARD_ERR_INVALID_ARGUMENT:
        return InvalidArgumentError;
    case PSHARD_ERR_NO_MEMORY:
    case PSHARD_ERR_RESOURCE_EXHAUSTED:
        return OutOfMemoryError;
    case PSHARD_ERR_TIMEOUT:
        return TimeoutErr;
    case PSHARD_ERR_PEER_LOST:
        return PeerLostError;
    case PSHARD_ERR_ABORTED:
    case PSHARD_ERR_CANCELLED:
        return AbortedError;
    case PSHARD_ERR_DESYNC:
        return DesyncError;
    case PSHARD_ERR_JOINED:
        return JoinedError;
    case PSHARD_ERR_NOT_FOUND:
        return NotFoundError;
    case PSHARD_ERR_FAILED_PRECONDITION:
        return FailedPreconditionError;
    case PSHARD_ERR_UNAVAILABLE:
    case PSHARD_ERR_RPC:
        return UnavailableError;
    case PSHARD_ERR_STEP_ABORTED:
        return StepAbortedError;
    default:
        return Error;
    }
}

/* Raises the exception of st with message msg; the instance carries .status (the enum name).
 * Returns NULL for the caller to return. */
PyObject *pshard_py_raise_status(pshard_status_t st, const char *msg)
{
    PyObject *cls = error_class(st);
    PyObject *exc = PyObject_CallFunction(cls, "s", msg && *msg ? msg : pshard_status_name(st));
    if (!exc)
        return NULL;
    PyObject *name = PyUnicode_FromString(pshard_status_name(st));
    if (name) {
        PyObject_SetAttrString(exc, "status", name);
        Py_DECREF(name);
    }
    PyErr_SetObject(cls, exc);
    Py_DECREF(exc);
    return NULL;
}

/* ---- Client ------------------------------------------------------------------------------ */

int pshard_py_client_ok(ClientObject *self)
{
    if (!self->c || self->closing) {
        pshard_py_raise_status(PSHARD_ERR_FAILED_PRECONDITION,
                               "the process group was destroyed (destroy_process_group) or never "
                               "initialized");
        return 0;
    }
    return 1;
}

PyObject *pshard_py_client_fail(ClientObject *self, pshard_status_t st)
{
    return pshard_py_raise_status(st, pshard_last_error(self->c));
}

void pshard_py_client_really_close(ClientObject *self)
{
    if (self->c) {
        pshard_client_t *c = self->c;
        self->c = NULL;
        Py_BEGIN_ALLOW_THREADS pshard_close(c);
        Py_END_ALLOW_THREADS
    }
}

static int Client_init(ClientObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"server",      "token",      "rank",
                             "world_size",  "timeout_ms", "connect_timeout_ms",
                             "coordinator", "job",        "coll_timeout_ms",
                             NULL};
    const char *server = NULL, *token = NULL, *coordinator = NULL, *job = NULL;
    int rank = -1, world = -1;
    long long timeout_ms = 0, connect_ms = 0, coll_ms = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|zziiLLzzL", kwlist, &server, &token, &rank, &world,
                                     &timeout_ms, &connect_ms, &coordinator, &job, &coll_ms))
        return -1;
    if (self->c) {
        PyErr_SetString(PyExc_RuntimeError, "Client is already connected");
        return -1;
    }
    pshard_client_config_t cfg;
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t st = pshard_client_config_from_env(&cfg, err, sizeof(err));
    /* An explicit server or coordinator stands in for a missing PSHARD_SERVER and
     * PSHARD_COORDINATOR (the only error left then). */
    bool given = (server && *server) || (coordinator && *coordinator);
    if (st != PSHARD_OK && !(given && strncmp(err, "neither PSHARD_SERVER", 21) == 0)) {
        pshard_py_raise_status(st, err);
        return -1;
    }
    err[0] = '\0'; /* the error stood in for: messages below are the connect's own */
    if (server && *server) {
        cfg.server = server;
    } else if (coordinator && *coordinator) {
        cfg.server = NULL; /* an explicit init_method wins over the environment's server */
        cfg.coordinator = coordinator;
    }
    if (job && *job)
        cfg.job = job;
    if (token)
        cfg.token = token;
    if (rank >= 0)
        cfg.rank = rank;
    if (world > 0)
        cfg.world_size = world;
    if (timeout_ms > 0)
        cfg.timeout_ms = timeout_ms;
    cfg.coll_timeout_ms = coll_ms;
    if (connect_ms > 0)
        cfg.connect_timeout_ms = connect_ms;
    pshard_client_t *c = NULL;
    Py_BEGIN_ALLOW_THREADS st = pshard_connect(&cfg, &c, err, sizeof(err));
    Py_END_ALLOW_THREADS if (st != PSHARD_OK)
    {
        pshard_py_raise_status(st, err);
        return -1;
    }
    self->c = c;
    return 0;
}

static PyObject *Client_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    ClientObject *self = (ClientObject *)type->tp_alloc(type, 0);
    if (self)
        pthread_mutex_init(&self->op_mu, NULL);
    return (PyObject *)self;
}

static void Client_dealloc(ClientObject *self)
{
    pshard_py_client_really_close(self);
    Py_XDECREF(self->shapes);
    pthread_mutex_destroy(&self->op_mu);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* close(): leaves the cluster now; every call fails from now on. Views of the client's memory
 * that are still alive (tensors over it) keep it mapped, with their last values, until the
 * last one is gone, and Works not yet waited for have finished (waiting gives their outcome).
 * A thread inside a call holds the client: close waits for it up to 10 s, then leaves the
 * rest to the shard server (which evicts the trainer when its lease lapses). */
/* pshard_leave under the client's call lock, waiting up to 10 s for a call in another
 * thread. 0, or the lock's error. */
static int client_leave(ClientObject *self)
{
    pshard_client_t *c = self->c;
    int rc;
    Py_BEGIN_ALLOW_THREADS struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 10;
    rc = pthread_mutex_timedlock(&self->op_mu, &until);
    if (rc == 0) {
        pshard_leave(c);
        pthread_mutex_unlock(&self->op_mu);
    }
    Py_END_ALLOW_THREADS return rc;
}

static PyObject *Client_close(ClientObject *self, PyObject *unused)
{
    self->closing = true;
    if (self->exports == 0 && self->pending == 0)
        pshard_py_client_really_close(self);
    else if (self->c && client_leave(self) != 0 &&
             PyErr_WarnEx(PyExc_RuntimeWarning,
                          "pshard: another thread is inside a call on this trainer's connection; "
                          "it was not closed (the shard server evicts the trainer when its "
                          "lease lapses)",
                          1) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Client_get_rank(ClientObject *self, void *unused)
{
    if (!pshard_py_client_ok(self))
        return NULL;
    return PyLong_FromLong(pshard_rank(self->c));
}

static PyObject *Client_get_world(ClientObject *self, void *unused)
{
    if (!pshard_py_client_ok(self))
        return NULL;
    return PyLong_FromLong(pshard_world_size(self->c));
}

static PyObject *Client_get_model_step(ClientObject *self, void *unused)
{
    if (!pshard_py_client_ok(self))
        return NULL;
    return PyLong_FromLongLong(pshard_model_step(self->c));
}

static PyObject *Client_get_resume_step(ClientObject *self, void *unused)
{
    if (!pshard_py_client_ok(self))
        return NULL;
    return PyLong_FromLongLong(pshard_resume_step(self->c));
}

static int check_param(ClientObject *self, Py_ssize_t i)
{
    if (!pshard_py_client_ok(self))
        return 0;
    if (!self->shapes)
        return (pshard_py_raise_status(PSHARD_ERR_FAILED_PRECONDITION, "no model is defined"), 0);
    if (i < 0 || (size_t)i >= self->nparams) {
        PyErr_Format(PyExc_IndexError, "parameter #%zd: the model has %zu", i, self->nparams);
        return 0;
    }
    return 1;
}

/* A Buffer over a full buffer of the model region at p: CUDA memory when the region is in the
 * shard server's GPU memory (device_region), which only DLPack consumers take; else host. */
static PyObject *region_buffer(ClientObject *self, void *p, pshard_dtype_t dt, PyObject *shape)
{
    int device = -1;
    if (pshard_region_memory(self->c, &device) == PSHARD_MEMORY_CUDA)
        return pshard_py_cuda_buffer_new(self, p, dt, shape, device);
    return pshard_py_buffer_new(self, p, dt, shape);
}

/* region_memory() -> (kind, device): where the model region is ("host", "cuda" or
 * "emulated") and the CUDA device of a region in GPU memory (else None). */
static PyObject *Client_region_memory(ClientObject *self, PyObject *unused)
{
    (void)unused;
    if (!pshard_py_client_ok(self))
        return NULL;
    int device = -1;
    int memory = pshard_region_memory(self->c, &device);
    const char *kind = memory == PSHARD_MEMORY_CUDA       ? "cuda"
                       : memory == PSHARD_MEMORY_EMULATED ? "emulated"
                                                          : "host";
    if (device < 0)
        return Py_BuildValue("(sO)", kind, Py_None);
    return Py_BuildValue("(si)", kind, device);
}

/* param_buffer(i): the fixed full buffer of parameter i (param_dtype, its shape). */
static PyObject *Client_param_buffer(ClientObject *self, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (!check_param(self, i))
        return NULL;
    void *p = pshard_param_buffer(self->c, (size_t)i);
    if (!p)
        return pshard_py_raise_status(PSHARD_ERR_INTERNAL,
                                      "the model has no stable parameter buffers");
    return region_buffer(self, p, self->param_dtype, PyTuple_GET_ITEM(self->shapes, i));
}

/* grad(i): the full gradient buffer of parameter i (reduce_dtype, zero-filled when first
 * handed out), valid until its reduce-scatter finishes. */
static PyObject *Client_grad(ClientObject *self, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (!check_param(self, i))
        return NULL;
    void *p;
    CLIENT_CALL(self, p = pshard_grad(self->c, (size_t)i));
    if (!p)
        return pshard_py_raise_status(PSHARD_ERR_NO_MEMORY, pshard_last_error(self->c));
    return region_buffer(self, p, self->reduce_dtype, PyTuple_GET_ITEM(self->shapes, i));
}

/* param(i): the full buffer of gathered parameter i (param_dtype, its shape), valid until it is
 * resharded; FailedPreconditionError when it is not gathered. */
static PyObject *Client_param(ClientObject *self, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (!check_param(self, i))
        return NULL;
    void *p = pshard_param(self->c, (size_t)i);
    if (!p)
        return pshard_py_raise_status(PSHARD_ERR_FAILED_PRECONDITION,
                                      "the parameter is not gathered: gather it first");
    return region_buffer(self, p, self->param_dtype, PyTuple_GET_ITEM(self->shapes, i));
}

static PyObject *Client_is_gathered(ClientObject *self, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (!check_param(self, i))
        return NULL;
    return PyBool_FromLong(pshard_param(self->c, (size_t)i) != NULL);
}

/* ---- ids and works ----------------------------------------------------------------------- */

/* Converts a sequence of parameter indices (None or empty: all) into a new array. */
static int parse_ids(ClientObject *self, PyObject *o, size_t **ids, size_t *n)
{
    *ids = NULL;
    *n = 0;
    if (o == Py_None)
        return 1;
    PyObject *seq = PySequence_Fast(o, "ids must be a sequence of parameter indices");
    if (!seq)
        return 0;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    *ids = PyMem_Calloc(len ? (size_t)len : 1, sizeof(size_t));
    if (!*ids) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return 0;
    }
    for (Py_ssize_t k = 0; k < len; k++) {
        Py_ssize_t v = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, k));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            PyMem_Free(*ids);
            *ids = NULL;
            return 0;
        }
        if (v < 0 || (size_t)v >= self->nparams) {
            Py_DECREF(seq);
            PyMem_Free(*ids);
            *ids = NULL;
            PyErr_Format(PyExc_IndexError, "parameter #%zd: the model has %zu", v, self->nparams);
            return 0;
        }
        (*ids)[k] = (size_t)v;
    }
    *n = (size_t)len;
    Py_DECREF(seq);
    return 1;
}

typedef pshard_status_t (*start_fn)(pshard_client_t *, const size_t *, size_t, pshard_work_t **);
typedef pshard_status_t (*sync_fn)(pshard_client_t *, const size_t *, size_t);

static PyObject *ids_call(ClientObject *self, PyObject *arg, sync_fn fn)
{
    if (!pshard_py_client_ok(self))
        return NULL;
    size_t *ids, n;
    if (!parse_ids(self, arg, &ids, &n))
        return NULL;
    if (ids && n == 0) { /* an empty list means nothing, not "all" */
        PyMem_Free(ids);
        Py_RETURN_NONE;
    }
    pshard_status_t st;
    CLIENT_CALL(self, st = fn(self->c, ids, n));
    PyMem_Free(ids);
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    Py_RETURN_NONE;
}

static PyObject *ids_start(ClientObject *self, PyObject *arg, start_fn fn)
{
    if (!pshard_py_client_ok(self))
        return NULL;
    size_t *ids, n;
    if (!parse_ids(self, arg, &ids, &n))
        return NULL;
    WorkObject *w = pshard_py_work_new(self);
    if (!w) {
        PyMem_Free(ids);
        return NULL;
    }
    if (ids && n == 0) {
        PyMem_Free(ids);
        return (PyObject *)w;
    }
    pshard_status_t st;
    pshard_work_t *work = NULL;
    CLIENT_CALL(self, st = fn(self->c, ids, n, &work));
    PyMem_Free(ids);
    return pshard_py_work_started(self, w, st, work);
}

static PyObject *Client_gather(ClientObject *self, PyObject *a)
{
    return ids_call(self, a, pshard_gather);
}
static PyObject *Client_reduce_scatter(ClientObject *self, PyObject *a)
{
    return ids_call(self, a, pshard_reduce_scatter);
}
static PyObject *Client_reshard(ClientObject *self, PyObject *a)
{
    return ids_call(self, a, pshard_reshard);
}
static PyObject *Client_gather_start(ClientObject *self, PyObject *a)
{
    return ids_start(self, a, pshard_gather_start);
}
static PyObject *Client_reduce_scatter_start(ClientObject *self, PyObject *a)
{
    return ids_start(self, a, pshard_reduce_scatter_start);
}

/* ---- step, clipping, join, checkpoints --------------------------------------------------- */

static PyObject *Client_step(ClientObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"groups", "lr", "skip", NULL};
    PyObject *groups = Py_None;
    double lr = -1;
    Py_buffer skip = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|Ody*", kwlist, &groups, &lr, &skip))
        return NULL;
    if (skip.buf && skip.len > 0 && groups == Py_None) {
        PyBuffer_Release(&skip);
        PyErr_SetString(PyExc_ValueError, "step(skip=...) goes with groups=");
        return NULL;
    }
    if (!pshard_py_client_ok(self))
        return NULL;
    int64_t step = 0;
    double norm = 0;
    pshard_status_t st;
    if (groups == Py_None) {
        CLIENT_CALL(self, st = pshard_step(self->c, lr, &step, &norm));
    } else {
        PyObject *seq = PySequence_Fast(groups, "groups must be a sequence of dicts");
        if (!seq)
            return NULL;
        size_t ng = (size_t)PySequence_Fast_GET_SIZE(seq);
        pshard_optim_group_t *g = PyMem_Calloc(ng ? ng : 1, sizeof(*g));
        if (!g) {
            Py_DECREF(seq);
            if (skip.buf)
                PyBuffer_Release(&skip);
            return PyErr_NoMemory();
        }
        for (size_t k = 0; k < ng; k++) {
            if (pshard_py_group_from_dict(PySequence_Fast_GET_ITEM(seq, k), &g[k]) != 0) {
                PyMem_Free(g);
                Py_DECREF(seq);
                if (skip.buf)
                    PyBuffer_Release(&skip);
                return NULL;
            }
        }
        Py_DECREF(seq);
        const uint8_t *bits = skip.buf;
        size_t nbytes = skip.buf ? (size_t)skip.len : 0;
        CLIENT_CALL(self, st = pshard_step_groups_skip(self->c, g, ng, bits, nbytes, &step, &norm));
        PyMem_Free(g);
    }
    if (skip.buf)
        PyBuffer_Release(&skip);
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    return Py_BuildValue("(Ld)", (long long)step, norm);
}

static PyObject *Client_clip_grad_norm(ClientObject *self, PyObject *args)
{
    double max_norm, norm_type = 2.0;
    if (!PyArg_ParseTuple(args, "d|d", &max_norm, &norm_type))
        return NULL;
    if (!pshard_py_client_ok(self))
        return NULL;
    double total = 0;
    pshard_status_t st;
    CLIENT_CALL(self, st = pshard_clip_grad_norm(self->c, max_norm, norm_type, &total));
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    return PyFloat_FromDouble(total);
}

static PyObject *Client_join(ClientObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"enable", "throw_on_early_termination", NULL};
    int enable = 1, throw_early = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|pp", kwlist, &enable, &throw_early))
        return NULL;
    if (!pshard_py_client_ok(self))
        return NULL;
    pshard_join_options_t o = {.enable = enable != 0,
                               .throw_on_early_termination = throw_early != 0};
    pshard_join_result_t r;
    memset(&r, 0, sizeof(r));
    pshard_status_t st;
    CLIENT_CALL(self, st = pshard_join(self->c, &o, &r));
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    return Py_BuildValue("{s:O,s:i,s:L,s:K,s:O}", "is_last_joiner",
                         r.is_last_joiner ? Py_True : Py_False, "last_rank", r.last_rank, "step",
                         (long long)r.step, "shadowed_ops", (unsigned long long)r.shadowed_ops,
                         "others_raised", r.others_raised ? Py_True : Py_False);
}

static PyObject *Client_checkpoint_save(ClientObject *self, PyObject *unused)
{
    if (!pshard_py_client_ok(self))
        return NULL;
    int64_t step = 0;
    char dir[4096] = "";
    pshard_status_t st;
    CLIENT_CALL(self, st = pshard_checkpoint_save(self->c, &step, dir, sizeof(dir)));
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    return Py_BuildValue("(Ls)", (long long)step, dir);
}

static PyObject *Client_memory_stats(ClientObject *self, PyObject *unused)
{
    if (!pshard_py_client_ok(self))
        return NULL;
    pshard_memory_stats_t m;
    pshard_memory_stats(self->c, &m);
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:K,s:K,s:i}", "pool_bytes", (Py_ssize_t)m.pool_bytes, "in_use_bytes",
        (Py_ssize_t)m.in_use_bytes, "peak_in_use_bytes", (Py_ssize_t)m.peak_in_use_bytes,
        "touched_bytes", (Py_ssize_t)m.touched_bytes, "params_gathered",
        (unsigned long long)m.params_gathered, "params_skipped",
        (unsigned long long)m.params_skipped, "peak_gathers_in_flight", m.peak_gathers_in_flight);
}

static PyMethodDef Client_methods[] = {
    {"close", (PyCFunction)Client_close, METH_NOARGS, "Leaves the cluster."},
    {"define_model", (PyCFunction)(void (*)(void))Client_define_model, METH_VARARGS | METH_KEYWORDS,
     "define_model(names, shapes, init=None, optimizer='sgd', groups=None, param_groups=None, "
     "layout='fsdp2', param_dtype=None, reduce_dtype=None, reshard_after_forward=True, "
     "max_gathers_in_flight=2, max_grad_norm=0.0, init_from_rank0=True) -> resumed step"},
    {"param_buffer", (PyCFunction)Client_param_buffer, METH_O,
     "The fixed full buffer of parameter i (valid contents only while gathered)."},
    {"grad", (PyCFunction)Client_grad, METH_O, "The full gradient buffer of parameter i."},
    {"region_memory", (PyCFunction)Client_region_memory, METH_NOARGS,
     "(kind, device): where the model region is: host, cuda or emulated (device_region)."},
    {"is_gathered", (PyCFunction)Client_is_gathered, METH_O, "Whether parameter i is gathered."},
    {"param", (PyCFunction)Client_param, METH_O,
     "The full buffer of gathered parameter i, valid until it is resharded."},
    {"gather", (PyCFunction)Client_gather, METH_O, "Gathers ids (None: all)."},
    {"gather_start", (PyCFunction)Client_gather_start, METH_O, "Asynchronous gather -> Work."},
    {"reduce_scatter", (PyCFunction)Client_reduce_scatter, METH_O,
     "Reduce-scatters the gradients of ids (None: all handed out)."},
    {"reduce_scatter_start", (PyCFunction)Client_reduce_scatter_start, METH_O,
     "Asynchronous reduce-scatter -> Work."},
    {"reshard", (PyCFunction)Client_reshard, METH_O, "Frees the full buffers of ids."},
    {"step", (PyCFunction)(void (*)(void))Client_step, METH_VARARGS | METH_KEYWORDS,
     "step(groups=None, lr=-1, skip=b'') -> (step, grad_norm); skip: a bit per parameter "
     "the servers' optimizer leaves alone (no gradient this step)"},
    {"step_trainer", (PyCFunction)(void (*)(void))Client_step_trainer, METH_VARARGS | METH_KEYWORDS,
     "step_trainer(*, kept=False) -> step: ends a step the trainer's own optimizer took on the "
     "shard views; kept: the trainer keeps that optimizer's state for a replacement "
     "(trainer_state_info)"},
    {"trainer_state_info", (PyCFunction)Client_trainer_state_info, METH_NOARGS,
     "trainer_state_info() -> (name, other_name, trainer_replace_ms): the shared-memory objects "
     "a trainer's own optimizer keeps its state in for a replacement, and the server's "
     "--trainer-replace-ms (0: none)"},
    {"resync", (PyCFunction)Client_resync, METH_NOARGS,
     "resync() -> step: after StepAbortedError, waits until the shard servers rebuilt their "
     "ring, gives back every gathered parameter and gradient, and returns the step whose data "
     "comes next (steps applied plus steps aborted)"},
    {"report_step", (PyCFunction)(void (*)(void))Client_report_step, METH_VARARGS | METH_KEYWORDS,
     "report_step(tokens=0, samples=0): a training step ends now, having processed these "
     "(the server's step timing and throughput counters; pshard.report_step)"},
    {"shard_view", (PyCFunction)Client_shard_view, METH_O,
     "shard_view(i) -> (master, grad or None, offset, numel): this rank's fp32 shard of "
     "parameter i in the shard server's memory (1-D Buffers of numel elements; CUDA ones, for "
     "torch.from_dlpack only, where shard_memory() says 'cuda')"},
    {"shard_memory", (PyCFunction)Client_shard_memory, METH_NOARGS,
     "shard_memory() -> (kind, device): where this rank's shard is: 'host' (shared memory), "
     "'cuda' (the shard server's GPU, opened through CUDA IPC) or 'emulated' (the tests' host "
     "stand-in for a GPU), and the CUDA device (None for host memory)"},
    {"shard_state", (PyCFunction)Client_shard_state, METH_O,
     "shard_state(i) -> (state0 or None, state1 or None, step): the shard servers' optimizer "
     "state of the elements of shard_view(i) (Adam: exp_avg, exp_avg_sq; SGD: momentum_buffer, "
     "None) and the parameter's own step count (a 1-element int64 Buffer)"},
    {"set_step", (PyCFunction)Client_set_step, METH_O,
     "set_step(n): the shard servers' step count becomes n (a restored optimizer state)"},
    {"clip_grad_norm", (PyCFunction)Client_clip_grad_norm, METH_VARARGS,
     "clip_grad_norm(max_norm, norm_type=2.0) -> total norm"},
    {"join", (PyCFunction)(void (*)(void))Client_join, METH_VARARGS | METH_KEYWORDS,
     "join(enable=True, throw_on_early_termination=False) -> dict"},
    {"checkpoint_save", (PyCFunction)Client_checkpoint_save, METH_NOARGS, "-> (step, dir)"},
    {"memory_stats", (PyCFunction)Client_memory_stats, METH_NOARGS, "-> dict"},
    {"all_reduce", (PyCFunction)Client_all_reduce, METH_VARARGS,
     "all_reduce(tensor, dtype, op=0, group=None), in place (op: ReduceOp's number)"},
    {"broadcast", (PyCFunction)Client_broadcast, METH_VARARGS,
     "broadcast(tensor, dtype, src, group=None)"},
    {"all_gather", (PyCFunction)Client_all_gather, METH_VARARGS,
     "all_gather(output, input, dtype, group=None)"},
    {"collective_start", (PyCFunction)Client_collective_start, METH_VARARGS,
     "collective_start(op, send, recv, count, dtype, reduce=0, root=0, group=None, tag=0, "
     "own=False) "
     "-> Work (own: staged, done with send at once, recv written at wait)"},
    {"reduce_scatter_tensor", (PyCFunction)Client_reduce_scatter_tensor, METH_VARARGS,
     "reduce_scatter_tensor(output, input, dtype, op, group=None)"},
    {"p2p", (PyCFunction)Client_p2p, METH_VARARGS,
     "p2p(op, tensor, dtype, peer, tag=0, group=None): send (10) or recv (11) of the whole tensor"},
    {"barrier", (PyCFunction)Client_barrier, METH_VARARGS, "barrier(group=None)"},
    {"reduce", (PyCFunction)Client_reduce, METH_VARARGS,
     "reduce(tensor, dtype, op, dst, group=None)"},
    {"all_to_all", (PyCFunction)Client_all_to_all, METH_VARARGS,
     "all_to_all(output, input, dtype, group=None): equal blocks, block k to and from rank k"},
    {"gather_to", (PyCFunction)Client_gather_to, METH_VARARGS,
     "gather_to(output or None, input, dtype, dst, group=None)"},
    {"scatter_from", (PyCFunction)Client_scatter_from, METH_VARARGS,
     "scatter_from(output, input or None, dtype, src, group=None)"},
    {"new_groups", (PyCFunction)(void (*)(void))Client_new_groups, METH_VARARGS | METH_KEYWORDS,
     "new_groups(groups, timeout_ms=0, key=None) -> [Group]: process groups of the world ranks "
     "in each list (collective: every rank, same lists); with key (a str, torch's group_name), "
     "one list whose members alone make the group; with a group, a collective's roots are group "
     "ranks"},
    {NULL}};

/* The client's strings (coordinator address, job): "" when closed. */
static PyObject *Client_get_coordinator(ClientObject *self, void *closure)
{
    (void)closure;
    return PyUnicode_FromString(self->c ? pshard_coordinator(self->c) : "");
}

static PyObject *Client_get_job(ClientObject *self, void *closure)
{
    (void)closure;
    return PyUnicode_FromString(self->c ? pshard_job(self->c) : "");
}

static PyGetSetDef Client_getset[] = {
    {"rank", (getter)Client_get_rank, NULL, "this trainer's rank", NULL},
    {"world_size", (getter)Client_get_world, NULL, "the number of shard servers", NULL},
    {"model_step", (getter)Client_get_model_step, NULL,
     "optimizer steps the defined model has taken (> 0 after a resume)", NULL},
    {"resume_step", (getter)Client_get_resume_step, NULL,
     "the step whose data comes next: steps taken plus steps aborted (a lost trainer replaced)",
     NULL},
    {"coordinator", (getter)Client_get_coordinator, NULL,
     "the coordinator HOST:PORT of this trainer's lease (\"\" without one)", NULL},
    {"job", (getter)Client_get_job, NULL, "the job on the coordinator (\"\": its default)", NULL},
    {NULL}};

static PyTypeObject ClientType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pshard._C.Client",
    .tp_basicsize = sizeof(ClientObject),
    .tp_dealloc = (destructor)Client_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Client(server=None, token=None, rank=-1, world_size=-1, timeout_ms=0, "
              "connect_timeout_ms=0, coordinator=None, job=None, coll_timeout_ms=0): one trainer's "
              "connection to its shard server (defaults "
              "from RANK, WORLD_SIZE, PSHARD_SERVER, PSHARD_TOKEN_FILE).",
    .tp_methods = Client_methods,
    .tp_getset = Client_getset,
    .tp_init = (initproc)Client_init,
    .tp_new = Client_new,
};

/* ---- module ------------------------------------------------------------------------------ */

static int add_error(PyObject *m, PyObject **slot, const char *name, PyObject *extra_base,
                     const char *doc)
{
    char full[128];
    PyOS_snprintf(full, sizeof(full), "pshard.%s", name);
    PyObject *bases = extra_base ? PyTuple_Pack(2, Error, extra_base) : PyTuple_Pack(1, Error);
    if (!bases)
        return -1;
    *slot = PyErr_NewExceptionWithDoc(full, doc, bases, NULL);
    Py_DECREF(bases);
    if (!*slot)
        return -1;
    Py_INCREF(*slot);
    return PyModule_AddObject(m, name, *slot);
}

/* rendezvous_file_read(path) -> "HOST:PORT", or None while the file is absent or empty. */
static PyObject *mod_rendezvous_file_read(PyObject *mod, PyObject *arg)
{
    (void)mod;
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path)
        return NULL;
    char addr[320], err[PSHARD_ERRLEN] = "";
    pshard_status_t st;
    Py_BEGIN_ALLOW_THREADS st =
        pshard_rendezvous_file_read(path, addr, sizeof(addr), err, sizeof(err));
    Py_END_ALLOW_THREADS if (st == PSHARD_ERR_NOT_FOUND) Py_RETURN_NONE;
    if (st != PSHARD_OK)
        return pshard_py_raise_status(st, err);
    return PyUnicode_FromString(addr);
}

static PyMethodDef module_methods[] = {
    {"rendezvous_file_read", mod_rendezvous_file_read, METH_O,
     "rendezvous_file_read(path): the coordinator's HOST:PORT, or None while not written"},
    {"ckpt_open", (PyCFunction)(void (*)(void))pshard_py_ckpt_open, METH_VARARGS | METH_KEYWORDS,
     "ckpt_open(step_dir, verify=True) -> (handle, info): a pshard checkpoint, offline"},
    {"ckpt_read", pshard_py_ckpt_read, METH_VARARGS,
     "ckpt_read(handle, section, param, out): one parameter's section (fp32) into out"},
    {"ckpt_write", pshard_py_ckpt_write, METH_VARARGS,
     "ckpt_write(root, step, optimizer, params, data) -> step_dir (world size 1)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef pshard_module = {PyModuleDef_HEAD_INIT, "pshard._C",
                                           "CPython binding of libpshard.", -1, module_methods};

PyMODINIT_FUNC PyInit__C(void)
{
    PyObject *m = PyModule_Create(&pshard_module);
    if (!m)
        return NULL;
    if (PyType_Ready(&ClientType) < 0 || PyType_Ready(&pshard_py_BufferType) < 0 ||
        PyType_Ready(&pshard_py_WorkType) < 0)
        goto fail;
    Error = PyErr_NewExceptionWithDoc("pshard.Error",
                                      "A pshard operation failed; .status names pshard's status.",
                                      PyExc_RuntimeError, NULL);
    if (!Error)
        goto fail;
    Py_INCREF(Error);
    if (PyModule_AddObject(m, "Error", Error) < 0 ||
        add_error(m, &InvalidArgumentError, "InvalidArgumentError", PyExc_ValueError,
                  "An argument was refused.") ||
        add_error(m, &OutOfMemoryError, "OutOfMemoryError", PyExc_MemoryError,
                  "Memory (or the shared-memory pool) ran out.") ||
        add_error(m, &TimeoutErr, "TimeoutError", PyExc_TimeoutError,
                  "An operation timed out; the message names the rank that did not answer.") ||
        add_error(m, &PeerLostError, "PeerLostError", NULL,
                  "A rank (trainer or shard server) was lost; the message names it.") ||
        add_error(m, &AbortedError, "AbortedError", NULL, "The operation was aborted.") ||
        add_error(m, &DesyncError, "DesyncError", NULL,
                  "Ranks ran different collectives; the message names both.") ||
        add_error(m, &JoinedError, "JoinedError", NULL,
                  "Another rank joined with throw_on_early_termination; the message names it.") ||
        add_error(m, &NotFoundError, "NotFoundError", PyExc_LookupError, "Not found.") ||
        add_error(m, &FailedPreconditionError, "FailedPreconditionError", NULL,
                  "The operation is not possible in the current state.") ||
        add_error(m, &UnavailableError, "UnavailableError", PyExc_ConnectionError,
                  "A pshard service could not be reached.") ||
        add_error(m, &StepAbortedError, "StepAbortedError", NULL,
                  "A trainer was lost and is being replaced: the step in flight was aborted on "
                  "every rank and none of it applied. Skip to the next step."))
        goto fail;
    if (pshard_py_groups_init(m) < 0)
        goto fail;
    if (pshard_py_store_init(m) < 0)
        goto fail;
    Py_INCREF(&ClientType);
    Py_INCREF(&pshard_py_BufferType);
    Py_INCREF(&pshard_py_WorkType);
    if (PyModule_AddObject(m, "Client", (PyObject *)&ClientType) < 0 ||
        PyModule_AddObject(m, "Buffer", (PyObject *)&pshard_py_BufferType) < 0 ||
        PyModule_AddObject(m, "Work", (PyObject *)&pshard_py_WorkType) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
