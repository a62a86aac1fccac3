/* pshard._C's views of the shard server's own memory: Client.shard_view(i), this rank's fp32
 * master weights and gradient accumulator of parameter i as Buffers (what a DTensor's local
 * shard and its .grad are made from), Client.shard_state(i), the servers' optimizer state of
 * the same elements, Client.step_trainer(), which ends a step that a torch.optim optimizer
 * took on them, Client.trainer_state_info(), where such an optimizer keeps its state for a
 * replacement, and Client.set_step(n), which restores the servers' step count. */
#include "pshard_py.h"

/* A Buffer over n fp32 values at p of a view's arrays: host memory (host shards, the emulated
 * device's), or CUDA memory of the view's device (GPU-resident shards opened through CUDA
 * IPC), which only DLPack consumers (torch.from_dlpack) take. */
static PyObject *array_buffer(ClientObject *self, const pshard_shard_view_t *v, float *p,
                              PyObject *shape)
{
    if (v->memory == PSHARD_MEMORY_CUDA)
        return pshard_py_cuda_buffer_new(self, p, PSHARD_FP32, shape, v->device);
    return pshard_py_buffer_new(self, p, PSHARD_FP32, shape);
}

PyObject *Client_shard_memory(ClientObject *self, PyObject *unused)
{
    if (!pshard_py_client_ok(self))
        return NULL;
    pshard_shard_view_t v;
    pshard_status_t st;
    CLIENT_CALL(self, st = pshard_shard_view(self->c, 0, &v));
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    const char *kind = v.memory == PSHARD_MEMORY_CUDA       ? "cuda"
                       : v.memory == PSHARD_MEMORY_EMULATED ? "emulated"
                                                            : "host";
    if (v.device < 0)
        return Py_BuildValue("(sO)", kind, Py_None);
    return Py_BuildValue("(si)", kind, v.device);
}

PyObject *Client_shard_view(ClientObject *self, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (!pshard_py_client_ok(self))
        return NULL;
    if (i < 0)
        return pshard_py_raise_status(PSHARD_ERR_INVALID_ARGUMENT, "a parameter index is >= 0");
    pshard_shard_view_t v;
    pshard_status_t st;
    CLIENT_CALL(self, st = pshard_shard_view(self->c, (size_t)i, &v));
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    PyObject *shape = Py_BuildValue("(n)", (Py_ssize_t)v.numel);
    if (!shape)
        return NULL;
    PyObject *master = array_buffer(self, &v, v.master, shape);
    PyObject *grad = v.grad ? array_buffer(self, &v, v.grad, shape) : Py_None;
    Py_DECREF(shape);
    if (!master || !grad) {
        Py_XDECREF(master);
        if (grad != Py_None)
            Py_XDECREF(grad);
        return NULL;
    }
    if (grad == Py_None)
        Py_INCREF(grad);
    PyObject *out =
        Py_BuildValue("(NNnn)", master, grad, (Py_ssize_t)v.offset, (Py_ssize_t)v.numel);
    return out;
}

PyObject *Client_step_trainer(ClientObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"kept", NULL};
    int kept = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$p:step_trainer", kwlist, &kept))
        return NULL;
    if (!pshard_py_client_ok(self))
        return NULL;
    int64_t step = 0;
    pshard_status_t st;
    CLIENT_CALL(self, st = kept ? pshard_step_trainer_kept(self->c, &step)
                                : pshard_step_trainer(self->c, &step));
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    return PyLong_FromLongLong((long long)step);
}

PyObject *Client_trainer_state_info(ClientObject *self, PyObject *unused)
{
    (void)unused;
    if (!pshard_py_client_ok(self))
        return NULL;
    pshard_trainer_state_info_t info;
    pshard_status_t st;
    CLIENT_CALL(self, st = pshard_trainer_state_info(self->c, &info));
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    return Py_BuildValue("(ssL)", info.names[0], info.names[1], (long long)info.trainer_replace_ms);
}

PyObject *Client_resync(ClientObject *self, PyObject *unused)
{
    (void)unused;
    if (!pshard_py_client_ok(self))
        return NULL;
    int64_t next = 0;
    pshard_status_t st;
    CLIENT_CALL(self, st = pshard_resync(self->c, &next));
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    return PyLong_FromLongLong((long long)next);
}

PyObject *Client_report_step(ClientObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"tokens", "samples", NULL};
    long long tokens = 0, samples = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|LL:report_step", kwlist, &tokens, &samples))
        return NULL;
    if (tokens < 0 || samples < 0) {
        PyErr_Format(PyExc_ValueError,
                     "report_step: tokens and samples must be >= 0 (got %lld, %lld)", tokens,
                     samples);
        return NULL;
    }
    if (!pshard_py_client_ok(self))
        return NULL;
    pshard_status_t st;
    CLIENT_CALL(self, st = pshard_report_step(self->c, (uint64_t)tokens, (uint64_t)samples));
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    Py_RETURN_NONE;
}

/* A Buffer over n fp32 values at p of view v's arrays, or None when p is NULL. */
static PyObject *view_or_none(ClientObject *self, const pshard_shard_view_t *v, float *p,
                              PyObject *shape)
{
    if (!p)
        Py_RETURN_NONE;
    return array_buffer(self, v, p, shape);
}

PyObject *Client_shard_state(ClientObject *self, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (!pshard_py_client_ok(self))
        return NULL;
    if (i < 0)
        return pshard_py_raise_status(PSHARD_ERR_INVALID_ARGUMENT, "a parameter index is >= 0");
    pshard_shard_view_t v;
    pshard_status_t st;
    CLIENT_CALL(self, st = pshard_shard_view(self->c, (size_t)i, &v));
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    PyObject *shape = Py_BuildValue("(n)", (Py_ssize_t)v.numel);
    if (!shape)
        return NULL;
    PyObject *one = Py_BuildValue("(n)", (Py_ssize_t)1);
    PyObject *s0 = view_or_none(self, &v, v.state0, shape);
    PyObject *s1 = s0 ? view_or_none(self, &v, v.state1, shape) : NULL;
    PyObject *count = s1 && one ? pshard_py_buffer_new(self, v.step, PSHARD_INT64, one) : NULL;
    Py_DECREF(shape);
    Py_XDECREF(one);
    if (!count) {
        Py_XDECREF(s0);
        Py_XDECREF(s1);
        return NULL;
    }
    return Py_BuildValue("(NNN)", s0, s1, count);
}

PyObject *Client_set_step(ClientObject *self, PyObject *arg)
{
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (!pshard_py_client_ok(self))
        return NULL;
    if (n < 0)
        return pshard_py_raise_status(PSHARD_ERR_INVALID_ARGUMENT, "a step count is >= 0");
    pshard_status_t st;
    CLIENT_CALL(self, st = pshard_set_step(self->c, (int64_t)n));
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    Py_RETURN_NONE;
}
