/* pshard._C's Work: an asynchronous gather, reduce-scatter or collective of a Client, waited
 * for with the GIL released; a staged collective's result is written into its recv tensor
 * at the wait. */
#include "pshard_py.h"

#include <string.h>

static void work_init(WorkObject *w, ClientObject *owner)
{
    w->owner = owner;
    Py_INCREF(owner);
    w->w = NULL;
    w->status = PSHARD_OK;
    w->error[0] = '\0';
    memset(w->dl, 0, sizeof(w->dl));
    w->group = NULL;
    w->out_bytes = 0;
    w->out_obj = NULL;
}

WorkObject *pshard_py_work_new(ClientObject *owner)
{
    WorkObject *w = PyObject_New(WorkObject, &pshard_py_WorkType);
    if (w)
        work_init(w, owner);
    return w;
}

/* w with the work a start function gave (st), counted until waited for; or the error, w
 * dropped. */
PyObject *pshard_py_work_started(ClientObject *self, WorkObject *w, pshard_status_t st,
                                 pshard_work_t *work)
{
    if (st != PSHARD_OK) {
        Py_DECREF(w);
        return pshard_py_client_fail(self, st);
    }
    w->w = work;
    self->pending++;
    return (PyObject *)w;
}

/* A staged collective's result (collective_start's own), result_bytes at result, written into
 * the recv tensor if that still has the memory it had at the start; else the work fails saying
 * so. With the GIL, so that no other Python thread resizes the tensor meanwhile. */
static void work_own_finish(WorkObject *w, const void *result, size_t result_bytes)
{
    if (w->out_obj && w->status == PSHARD_OK) {
        PyObject *et, *ev, *tb; /* a dealloc may come while an exception propagates */
        PyErr_Fetch(&et, &ev, &tb);
        dl_in_t now;
        bool same = pshard_py_dl_acquire(w->out_obj, w->out_dtype, "the recv tensor", &now) == 0 &&
                    now.data == w->dl[1].data && now.numel == w->dl[1].numel;
        pshard_py_dl_release(&now);
        PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        if (same && result && result_bytes == w->out_bytes) {
            memcpy(w->dl[1].data, result, w->out_bytes);
        } else {
            w->status = PSHARD_ERR_FAILED_PRECONDITION;
            if (same)
                PyOS_snprintf(w->error, sizeof(w->error),
                              "an asynchronous collective ended with %zu bytes for an output of "
                              "%zu: its result was not written",
                              result_bytes, w->out_bytes);
            else
                PyOS_snprintf(w->error, sizeof(w->error),
                              "the output tensor of an asynchronous collective was resized, "
                              "freed or given other memory before the collective finished, so "
                              "its result (%zu bytes) was not written: keep the tensor as it is "
                              "until wait() on the Work returns",
                              w->out_bytes);
        }
    }
    Py_CLEAR(w->out_obj);
}

/* Waits for the work (GIL released) and keeps its outcome; idempotent. */
static void work_finish(WorkObject *w)
{
    if (w->w) {
        pshard_work_t *work = w->w;
        w->w = NULL;
        pshard_status_t st;
        const void *result = NULL;
        size_t result_bytes = 0;
        bool own = w->out_obj != NULL;
        Py_BEGIN_ALLOW_THREADS st =
            own ? pshard_work_wait_result(work, &result, &result_bytes) : pshard_work_wait(work);
        Py_END_ALLOW_THREADS w->status = st;
        if (st != PSHARD_OK && w->owner->c)
            PyOS_snprintf(w->error, sizeof(w->error), "%s", pshard_last_error(w->owner->c));
        if (own) {
            work_own_finish(w, result, result_bytes);
            pshard_work_wait(work); /* frees it; its status is kept already */
        }
        /* A close asked for meanwhile waited for this work (its handle needs the client). */
        ClientObject *owner = w->owner;
        if (--owner->pending == 0 && owner->exports == 0 && owner->closing)
            pshard_py_client_really_close(owner);
    }
    Py_CLEAR(w->out_obj);
    pshard_py_dl_release(&w->dl[0]);
    pshard_py_dl_release(&w->dl[1]);
    Py_CLEAR(w->group);
}

static PyObject *Work_wait(WorkObject *w, PyObject *unused)
{
    work_finish(w);
    if (w->status != PSHARD_OK)
        return pshard_py_raise_status(w->status, w->error);
    Py_RETURN_TRUE;
}

static PyObject *Work_is_completed(WorkObject *w, PyObject *unused)
{
    return PyBool_FromLong(!w->w || pshard_work_test(w->w));
}

static void Work_dealloc(WorkObject *w)
{
    /* A handle is freed only by waiting for it; an error nobody will wait for is told. */
    bool unwaited = w->w != NULL;
    work_finish(w);
    if (unwaited && w->status != PSHARD_OK)
        PySys_FormatStderr("pshard: an operation dropped without wait() failed: %s\n",
                           w->error[0] ? w->error : pshard_status_name(w->status));
    Py_DECREF(w->owner);
    PyObject_Free(w);
}

static PyMethodDef Work_methods[] = {
    {"wait", (PyCFunction)Work_wait, METH_NOARGS,
     "Blocks until the operation finished; raises its error. Returns True."},
    {"is_completed", (PyCFunction)Work_is_completed, METH_NOARGS,
     "True once the operation finished (wait() then returns at once)."},
    {NULL}};

PyTypeObject pshard_py_WorkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pshard._C.Work",
    .tp_basicsize = sizeof(WorkObject),
    .tp_dealloc = (destructor)Work_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An asynchronous gather or reduce-scatter (torch.distributed's Work).",
    .tp_methods = Work_methods,
};
