/* pshard._C's DLPack side: the consumer that reads incoming tensors through their __dlpack__
 * capsule, and Buffer, a zero-copy view of a client's memory exported through DLPack and the
 * buffer protocol. */
#include "pshard_py.h"

#include <string.h>

/* ---- incoming tensors (DLPack consumer) -------------------------------------------------- */

static int dl_dtype_is(const DLDataType *t, pshard_dtype_t want)
{
    if (t->lanes != 1)
        return 0;
    switch (want) {
    case PSHARD_FP32:
        return t->code == DL_FLOAT && t->bits == 32;
    case PSHARD_FP16:
        return t->code == DL_FLOAT && t->bits == 16;
    case PSHARD_BF16:
        return t->code == DL_BFLOAT && t->bits == 16;
    case PSHARD_INT64:
        return t->code == DL_INT && t->bits == 64;
    case PSHARD_FP64:
        return t->code == DL_FLOAT && t->bits == 64;
    case PSHARD_INT32:
        return t->code == DL_INT && t->bits == 32;
    case PSHARD_UINT8: /* torch.bool is one byte too (0 or 1) */
        return (t->code == DL_UINT || t->code == DL_BOOL) && t->bits == 8;
    }
    return 0;
}

/* Reads a tensor through obj.__dlpack__(): it must be on the CPU, contiguous and of dtype
 * want. On success in->data points at its first element until pshard_py_dl_release. what names the
 * argument in errors. Returns 0, or -1 with an exception set. */
int pshard_py_dl_acquire(PyObject *obj, pshard_dtype_t want, const char *what, dl_in_t *in)
{
    memset(in, 0, sizeof(*in));
    PyObject *cap = PyObject_CallMethod(obj, "__dlpack__", NULL);
    if (!cap) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s: expected a tensor (an object with __dlpack__), "
                         "got %s",
                         what, Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    DLManagedTensor *mt = PyCapsule_GetPointer(cap, "dltensor");
    if (!mt) {
        Py_DECREF(cap);
        return -1;
    }
    /* From here on the capsule is ours: mark it used so its destructor leaves it to us. */
    PyCapsule_SetName(cap, "used_dltensor");
    in->capsule = cap;
    in->mt = mt;
    const DLTensor *t = &mt->dl_tensor;
    const char *bad = NULL;
    if (t->device.device_type != DL_CPU)
        bad = "must be on the CPU";
    else if (!dl_dtype_is(&t->dtype, want))
        bad = want == PSHARD_FP32   ? "must be float32"
              : want == PSHARD_BF16 ? "must be bfloat16"
              : want == PSHARD_FP16 ? "must be float16"
                                    : "must be int64";
    size_t numel = 1;
    if (!bad) {
        int64_t expect = 1;
        for (int d = t->ndim - 1; d >= 0; d--) {
            if (t->shape[d] < 0) {
                bad = "has a negative dimension";
                break;
            }
            if (t->strides && t->shape[d] > 1 && t->strides[d] != expect) {
                bad = "must be contiguous";
                break;
            }
            expect *= t->shape[d];
            numel *= (size_t)t->shape[d];
        }
    }
    if (bad) {
        PyErr_Format(PyExc_ValueError, "%s %s", what, bad);
        if (mt->deleter)
            mt->deleter(mt);
        Py_DECREF(cap);
        memset(in, 0, sizeof(*in));
        return -1;
    }
    in->data = (uint8_t *)t->data + t->byte_offset;
    in->numel = numel;
    return 0;
}

void pshard_py_dl_release(dl_in_t *in)
{
    if (in->mt && in->mt->deleter)
        in->mt->deleter(in->mt);
    Py_XDECREF(in->capsule);
    memset(in, 0, sizeof(*in));
}

int pshard_py_parse_dtype(PyObject *o, pshard_dtype_t *out)
{
    if (!PyUnicode_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "dtype must be a string (fp32, bf16, fp16, int64)");
        return 0;
    }
    const char *s = PyUnicode_AsUTF8(o);
    if (!s || pshard_dtype_parse(s, out) != 0) {
        PyErr_Format(PyExc_ValueError, "unknown dtype %R (fp32, bf16, fp16, int64)", o);
        return 0;
    }
    return 1;
}

/* ---- Buffer: a view of the client's shared memory ---------------------------------------- */

typedef struct {
    PyObject_HEAD ClientObject *owner; /* keeps the mapping alive */
    void *data;
    size_t nbytes;
    pshard_dtype_t dtype;
    int ndim;
    int64_t shape[8];
    Py_ssize_t pyshape[8], pystrides[8];
    int cuda_device; /* -1: host memory; else the CUDA device whose memory data is (DLPack
                        only: no buffer protocol) */
} BufferObject;

static void export_release(ClientObject *owner)
{
    owner->exports--;
    if (owner->exports == 0 && owner->pending == 0 && owner->closing)
        pshard_py_client_really_close(owner);
}

PyObject *pshard_py_buffer_new(ClientObject *owner, void *data, pshard_dtype_t dtype,
                               PyObject *shape)
{
    BufferObject *b = PyObject_New(BufferObject, &pshard_py_BufferType);
    if (!b)
        return NULL;
    b->owner = owner;
    Py_INCREF(owner);
    owner->exports++;
    b->data = data;
    b->dtype = dtype;
    b->ndim = (int)PyTuple_GET_SIZE(shape);
    size_t n = 1;
    for (int d = 0; d < b->ndim; d++) {
        b->shape[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
        n *= (size_t)b->shape[d];
    }
    b->nbytes = n * pshard_dtype_size(dtype);
    b->cuda_device = -1;
    return (PyObject *)b;
}

PyObject *pshard_py_cuda_buffer_new(ClientObject *owner, void *data, pshard_dtype_t dtype,
                                    PyObject *shape, int device)
{
    PyObject *b = pshard_py_buffer_new(owner, data, dtype, shape);
    if (b)
        ((BufferObject *)b)->cuda_device = device;
    return b;
}

static void Buffer_dealloc(BufferObject *b)
{
    ClientObject *owner = b->owner;
    export_release(owner);
    Py_DECREF(owner);
    PyObject_Free(b);
}

typedef struct {
    DLManagedTensor mt;
    int64_t shape[8];
    PyObject *buffer; /* the Buffer, kept alive by the consumer's tensor */
} dl_out_t;

static void dl_out_deleter(DLManagedTensor *mt)
{
    dl_out_t *o = (dl_out_t *)mt;
    /* Called when the consumer frees its tensor, from whatever thread that is. */
    PyGILState_STATE g = PyGILState_Ensure();
    Py_DECREF(o->buffer);
    PyMem_RawFree(o);
    PyGILState_Release(g);
}

static void dl_capsule_destructor(PyObject *cap)
{
    /* Still named "dltensor": never consumed, so the producer frees it. */
    if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *mt = PyCapsule_GetPointer(cap, "dltensor");
        if (mt && mt->deleter)
            mt->deleter(mt);
    }
}

static PyObject *Buffer_dlpack(BufferObject *b, PyObject *args, PyObject *kw)
{
    /* stream, max_version, dl_device and copy are accepted and need nothing on the CPU; the
     * capsule is the legacy (unversioned) one, which consumers accept. */
    PyObject *copy = kw ? PyDict_GetItemString(kw, "copy") : NULL;
    if (copy && PyObject_IsTrue(copy) == 1)
        return PyErr_Format(PyExc_BufferError, "pshard buffers are views; copy=True is not "
                                               "supported");
    dl_out_t *o = PyMem_RawCalloc(1, sizeof(*o));
    if (!o)
        return PyErr_NoMemory();
    DLTensor *t = &o->mt.dl_tensor;
    t->data = b->data;
    t->device.device_type = b->cuda_device >= 0 ? DL_CUDA : DL_CPU;
    t->device.device_id = b->cuda_device >= 0 ? b->cuda_device : 0;
    t->ndim = b->ndim;
    switch (b->dtype) {
    case PSHARD_FP32:
        t->dtype = (DLDataType){DL_FLOAT, 32, 1};
        break;
    case PSHARD_BF16:
        t->dtype = (DLDataType){DL_BFLOAT, 16, 1};
        break;
    case PSHARD_FP16:
        t->dtype = (DLDataType){DL_FLOAT, 16, 1};
        break;
    case PSHARD_INT64:
        t->dtype = (DLDataType){DL_INT, 64, 1};
        break;
    case PSHARD_FP64:
        t->dtype = (DLDataType){DL_FLOAT, 64, 1};
        break;
    case PSHARD_INT32:
        t->dtype = (DLDataType){DL_INT, 32, 1};
        break;
    case PSHARD_UINT8:
        t->dtype = (DLDataType){DL_UINT, 8, 1};
        break;
    }
    memcpy(o->shape, b->shape, sizeof(o->shape));
    t->shape = o->shape;
    t->strides = NULL; /* compact row-major */
    o->buffer = (PyObject *)b;
    Py_INCREF(b);
    o->mt.manager_ctx = o;
    o->mt.deleter = dl_out_deleter;
    PyObject *cap = PyCapsule_New(&o->mt, "dltensor", dl_capsule_destructor);
    if (!cap) {
        Py_DECREF(b);
        PyMem_RawFree(o);
    }
    return cap;
}

static PyObject *Buffer_dlpack_device(BufferObject *b, PyObject *unused)
{
    if (b->cuda_device >= 0)
        return Py_BuildValue("(ii)", DL_CUDA, b->cuda_device);
    return Py_BuildValue("(ii)", DL_CPU, 0);
}

static PyObject *Buffer_get_nbytes(BufferObject *b, void *unused)
{
    return PyLong_FromSize_t(b->nbytes);
}

static PyObject *Buffer_get_address(BufferObject *b, void *unused)
{
    return PyLong_FromVoidPtr(b->data);
}

static int Buffer_getbuffer(BufferObject *b, Py_buffer *view, int flags)
{
    static char fmt_f[] = "f", fmt_e[] = "e", fmt_q[] = "q", fmt_h[] = "H";
    size_t item = pshard_dtype_size(b->dtype);
    if (b->cuda_device >= 0) {
        PyErr_SetString(PyExc_BufferError,
                        "this pshard buffer is CUDA device memory: use torch.from_dlpack");
        view->obj = NULL;
        return -1;
    }
    view->obj = (PyObject *)b;
    Py_INCREF(b);
    view->buf = b->data;
    view->len = (Py_ssize_t)b->nbytes;
    view->readonly = 0;
    view->itemsize = (Py_ssize_t)item;
    view->format = NULL;
    if (flags & PyBUF_FORMAT)
        view->format = b->dtype == PSHARD_FP32    ? fmt_f
                       : b->dtype == PSHARD_FP16  ? fmt_e
                       : b->dtype == PSHARD_INT64 ? fmt_q
                                                  : fmt_h; /* bf16: raw 16-bit words */
    view->ndim = b->ndim;
    Py_ssize_t stride = (Py_ssize_t)item;
    for (int d = b->ndim - 1; d >= 0; d--) {
        b->pyshape[d] = (Py_ssize_t)b->shape[d];
        b->pystrides[d] = stride;
        stride *= (Py_ssize_t)b->shape[d];
    }
    view->shape = (flags & PyBUF_ND) == PyBUF_ND ? b->pyshape : NULL;
    view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? b->pystrides : NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    return 0;
}

static PyBufferProcs Buffer_as_buffer = {(getbufferproc)Buffer_getbuffer, NULL};

static PyMethodDef Buffer_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))Buffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "DLPack capsule of this view (CPU); the tensor made from it keeps the memory alive."},
    {"__dlpack_device__", (PyCFunction)Buffer_dlpack_device, METH_NOARGS, "(kDLCPU, 0)"},
    {NULL}};

static PyGetSetDef Buffer_getset[] = {
    {"nbytes", (getter)Buffer_get_nbytes, NULL, "size in bytes", NULL},
    {"address", (getter)Buffer_get_address, NULL, "address of the first byte", NULL},
    {NULL}};

PyTypeObject pshard_py_BufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pshard._C.Buffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_dealloc = (destructor)Buffer_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A view of shared memory owned by a pshard client (DLPack and buffer protocol).",
    .tp_methods = Buffer_methods,
    .tp_getset = Buffer_getset,
    .tp_as_buffer = &Buffer_as_buffer,
};
