/* pshard._C.Store: libpshard's store client (pshard/store.h) for Python, under pshard.Store
 * (pshard/_store.py), torch's Store over the coordinator. Every call releases the GIL; a
 * read-write lock keeps close() from freeing the handle under a call in another thread. */
#include "pshard_py.h"

#include "pshard/store.h"

typedef struct {
    PyObject_HEAD pshard_store_t *s; /* NULL once closed */
    pthread_rwlock_t lock;           /* calls hold it shared, close exclusive */
} StoreObject;

/* Takes the handle for one call (the caller then releases the GIL); NULL with ValueError when
 * the store is closed. The caller ends with store_release. */
static pshard_store_t *store_acquire(StoreObject *self)
{
    pthread_rwlock_rdlock(&self->lock);
    if (!self->s) {
        pthread_rwlock_unlock(&self->lock);
        PyErr_SetString(PyExc_ValueError, "the pshard store is closed");
        return NULL;
    }
    return self->s;
}

static void store_release(StoreObject *self)
{
    pthread_rwlock_unlock(&self->lock);
}

/* Raises the exception of rc with the message the failed call left in this thread. Call it
 * before store_release. */
static PyObject *store_raise(StoreObject *self, pshard_status_t rc)
{
    return pshard_py_raise_status(rc, pshard_store_last_error(self->s));
}

/* A key argument as UTF-8 without NUL bytes (the coordinator's keys are C strings); NULL with
 * an exception otherwise. The text belongs to o. */
static const char *key_text(PyObject *o, const char *what)
{
    if (!PyUnicode_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a str, not %s", what, Py_TYPE(o)->tp_name);
        return NULL;
    }
    Py_ssize_t n = 0;
    const char *text = PyUnicode_AsUTF8AndSize(o, &n);
    if (text && (size_t)n != strlen(text)) {
        PyErr_Format(PyExc_ValueError, "%s contains a NUL character", what);
        return NULL;
    }
    return text;
}

/* keys (a list or tuple of str) as a malloc'd array of UTF-8 strings owned by the list's
 * items; NULL with an exception. *seq is the sequence to release with Py_DECREF. */
static const char **key_array(PyObject *keys, PyObject **seq, size_t *n)
{
    *seq = PySequence_Fast(keys, "keys must be a list of str");
    if (!*seq)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(*seq);
    const char **out = PyMem_Malloc((size_t)(m ? m : 1) * sizeof(*out));
    if (!out) {
        Py_CLEAR(*seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        out[i] = key_text(PySequence_Fast_GET_ITEM(*seq, i), "each key");
        if (!out[i]) {
            PyMem_Free(out);
            Py_CLEAR(*seq);
            return NULL;
        }
    }
    *n = (size_t)m;
    return out;
}

/* A new reference to None (Py_NewRef is 3.10+; the package supports 3.9). */
static PyObject *none_ref(void)
{
    Py_INCREF(Py_None);
    return Py_None;
}

static int Store_init(StoreObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"coordinator", "job", "token", NULL};
    const char *coordinator = NULL, *job = NULL, *token = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|zz:Store", kwlist, &coordinator, &job, &token))
        return -1;
    if (self->s) {
        PyErr_SetString(PyExc_RuntimeError, "Store.__init__ called twice");
        return -1;
    }
    char err[PSHARD_ERRLEN] = "";
    pshard_store_t *s = NULL;
    pshard_status_t rc;
    PyThreadState *ts = PyEval_SaveThread();
    rc = pshard_store_open(coordinator, job, token, &s, err, sizeof(err));
    PyEval_RestoreThread(ts);
    if (rc != PSHARD_OK) {
        pshard_py_raise_status(rc, err);
        return -1;
    }
    self->s = s;
    return 0;
}

static PyObject *Store_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)args;
    (void)kw;
    StoreObject *self = (StoreObject *)type->tp_alloc(type, 0);
    if (self) {
        self->s = NULL;
        pthread_rwlock_init(&self->lock, NULL);
    }
    return (PyObject *)self;
}

static void Store_dealloc(StoreObject *self)
{
    pshard_store_close(self->s); /* no call can be running: they hold a reference */
    pthread_rwlock_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Store_close(StoreObject *self, PyObject *unused)
{
    (void)unused;
    pshard_store_t *s;
    PyThreadState *ts = PyEval_SaveThread();
    pthread_rwlock_wrlock(&self->lock); /* calls in flight finish first */
    s = self->s;
    self->s = NULL;
    pthread_rwlock_unlock(&self->lock);
    pshard_store_close(s);
    PyEval_RestoreThread(ts);
    Py_RETURN_NONE;
}

static PyObject *Store_set(StoreObject *self, PyObject *args)
{
    PyObject *ko;
    Py_buffer value;
    long long timeout_ms = 0;
    if (!PyArg_ParseTuple(args, "Oy*|L:set", &ko, &value, &timeout_ms))
        return NULL;
    const char *key = key_text(ko, "key");
    pshard_store_t *s = key ? store_acquire(self) : NULL;
    if (!s) {
        PyBuffer_Release(&value);
        return NULL;
    }
    pshard_status_t rc;
    PyThreadState *ts = PyEval_SaveThread();
    rc = pshard_store_set(s, key, value.buf, (size_t)value.len, timeout_ms);
    PyEval_RestoreThread(ts);
    PyBuffer_Release(&value);
    PyObject *out = rc == PSHARD_OK ? none_ref() : store_raise(self, rc);
    store_release(self);
    return out;
}

static PyObject *Store_get(StoreObject *self, PyObject *args)
{
    PyObject *ko;
    long long timeout_ms = 0;
    if (!PyArg_ParseTuple(args, "O|L:get", &ko, &timeout_ms))
        return NULL;
    const char *key = key_text(ko, "key");
    pshard_store_t *s = key ? store_acquire(self) : NULL;
    if (!s)
        return NULL;
    void *value = NULL;
    size_t len = 0;
    pshard_status_t rc;
    PyThreadState *ts = PyEval_SaveThread();
    rc = pshard_store_get(s, key, &value, &len, timeout_ms);
    PyEval_RestoreThread(ts);
    PyObject *out =
        rc == PSHARD_OK ? PyBytes_FromStringAndSize(value, (Py_ssize_t)len) : store_raise(self, rc);
    store_release(self);
    pshard_store_free(value);
    return out;
}

static PyObject *Store_add(StoreObject *self, PyObject *args)
{
    PyObject *ko;
    long long delta, timeout_ms = 0;
    if (!PyArg_ParseTuple(args, "OL|L:add", &ko, &delta, &timeout_ms))
        return NULL;
    const char *key = key_text(ko, "key");
    pshard_store_t *s = key ? store_acquire(self) : NULL;
    if (!s)
        return NULL;
    int64_t result = 0;
    pshard_status_t rc;
    PyThreadState *ts = PyEval_SaveThread();
    rc = pshard_store_add(s, key, delta, &result, timeout_ms);
    PyEval_RestoreThread(ts);
    PyObject *out = rc == PSHARD_OK ? PyLong_FromLongLong(result) : store_raise(self, rc);
    store_release(self);
    return out;
}

static PyObject *Store_compare_set(StoreObject *self, PyObject *args)
{
    PyObject *ko;
    Py_buffer expected, desired;
    long long timeout_ms = 0;
    if (!PyArg_ParseTuple(args, "Oy*y*|L:compare_set", &ko, &expected, &desired, &timeout_ms))
        return NULL;
    const char *key = key_text(ko, "key");
    pshard_store_t *s = key ? store_acquire(self) : NULL;
    PyObject *out = NULL;
    if (s) {
        void *current = NULL;
        size_t clen = 0;
        pshard_status_t rc;
        PyThreadState *ts = PyEval_SaveThread();
        rc = pshard_store_compare_set(s, key, expected.buf, (size_t)expected.len, desired.buf,
                                      (size_t)desired.len, &current, &clen, NULL, timeout_ms);
        PyEval_RestoreThread(ts);
        out = rc == PSHARD_OK ? PyBytes_FromStringAndSize(current, (Py_ssize_t)clen)
                              : store_raise(self, rc);
        store_release(self);
        pshard_store_free(current);
    }
    PyBuffer_Release(&expected);
    PyBuffer_Release(&desired);
    return out;
}

/* wait(keys, timeout_ms) and check(keys, timeout_ms): the two calls on a list of keys. */
static PyObject *store_keys_call(StoreObject *self, PyObject *args, bool check)
{
    PyObject *ko, *seq = NULL;
    long long timeout_ms = 0;
    if (!PyArg_ParseTuple(args, check ? "O|L:check" : "O|L:wait", &ko, &timeout_ms))
        return NULL;
    size_t n = 0;
    const char **keys = key_array(ko, &seq, &n);
    if (!keys)
        return NULL;
    pshard_store_t *s = store_acquire(self);
    PyObject *out = NULL;
    if (s) {
        bool all = false;
        pshard_status_t rc;
        PyThreadState *ts = PyEval_SaveThread();
        rc = check ? pshard_store_check(s, keys, n, &all, timeout_ms)
                   : pshard_store_wait(s, keys, n, timeout_ms);
        PyEval_RestoreThread(ts);
        if (rc != PSHARD_OK)
            out = store_raise(self, rc);
        else
            out = check ? PyBool_FromLong(all) : none_ref();
        store_release(self);
    }
    PyMem_Free(keys);
    Py_DECREF(seq);
    return out;
}

static PyObject *Store_wait(StoreObject *self, PyObject *args)
{
    return store_keys_call(self, args, false);
}

static PyObject *Store_check(StoreObject *self, PyObject *args)
{
    return store_keys_call(self, args, true);
}

static PyObject *Store_delete_key(StoreObject *self, PyObject *args)
{
    PyObject *ko;
    long long timeout_ms = 0;
    if (!PyArg_ParseTuple(args, "O|L:delete_key", &ko, &timeout_ms))
        return NULL;
    const char *key = key_text(ko, "key");
    pshard_store_t *s = key ? store_acquire(self) : NULL;
    if (!s)
        return NULL;
    bool deleted = false;
    pshard_status_t rc;
    PyThreadState *ts = PyEval_SaveThread();
    rc = pshard_store_delete(s, key, &deleted, timeout_ms);
    PyEval_RestoreThread(ts);
    PyObject *out = rc == PSHARD_OK ? PyBool_FromLong(deleted) : store_raise(self, rc);
    store_release(self);
    return out;
}

static PyMethodDef Store_methods[] = {
    {"set", (PyCFunction)Store_set, METH_VARARGS,
     "set(key, value: bytes, timeout_ms=0): stores value under key."},
    {"get", (PyCFunction)Store_get, METH_VARARGS,
     "get(key, timeout_ms=0) -> bytes: waits up to timeout_ms for key (TimeoutError)."},
    {"add", (PyCFunction)Store_add, METH_VARARGS,
     "add(key, delta, timeout_ms=0) -> int: adds delta to the integer at key (0 if absent)."},
    {"compare_set", (PyCFunction)Store_compare_set, METH_VARARGS,
     "compare_set(key, expected: bytes, desired: bytes, timeout_ms=0) -> bytes: torch's "
     "compare_set (TCPStore's return values)."},
    {"wait", (PyCFunction)Store_wait, METH_VARARGS,
     "wait(keys, timeout_ms=0): waits until every key is set (TimeoutError)."},
    {"check", (PyCFunction)Store_check, METH_VARARGS,
     "check(keys, timeout_ms=0) -> bool: whether every key is set now."},
    {"delete_key", (PyCFunction)Store_delete_key, METH_VARARGS,
     "delete_key(key, timeout_ms=0) -> bool: False when the key was not set."},
    {"close", (PyCFunction)Store_close, METH_NOARGS,
     "close(): closes the connection; later calls raise ValueError."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pshard._C.Store",
    .tp_basicsize = sizeof(StoreObject),
    .tp_dealloc = (destructor)Store_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Store(coordinator, job=None, token=None): the coordinator's key/value store of "
              "one job. timeout_ms <= 0 means 5 minutes.",
    .tp_methods = Store_methods,
    .tp_init = (initproc)Store_init,
    .tp_new = Store_new,
};

int pshard_py_store_init(PyObject *m)
{
    if (PyType_Ready(&StoreType) < 0)
        return -1;
    Py_INCREF(&StoreType);
    if (PyModule_AddObject(m, "Store", (PyObject *)&StoreType) < 0) {
        Py_DECREF(&StoreType);
        return -1;
    }
    return 0;
}
