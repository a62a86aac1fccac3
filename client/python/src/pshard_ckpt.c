/* pshard._C's offline access to pshard's own checkpoints (pshard/ckpt.h), for the converters
 * between them and torch.distributed.checkpoint (pshard/checkpoint.py). No cluster is needed:
 *   ckpt_open(step_dir, verify=True) -> (handle, info): the manifest, checked, and with verify
 *       every shard file's size and CRC-32C; info is a dict (step, world_size, layout, sections,
 *       optimizer, params [(name, shape, skipped_steps)]).
 *   ckpt_read(handle, section, param, out): section `section` of parameter `param` (fp32,
 *       flattened) into the writable buffer out of exactly numel * 4 bytes.
 *   ckpt_write(root, step, optimizer, params, data): a new checkpoint ROOT/step-N of
 *       world size 1 (it loads on any world size, as every pshard checkpoint does); data[s][p]
 *       is a buffer of parameter p's section s (fp32, numel * 4 bytes). A committed checkpoint
 *       of that step is never overwritten. */
#include "pshard_py.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/ckpt.h"
#include "pshard/util.h"

#define HANDLE_NAME "pshard.ckpt"

typedef struct {
    ps_ckpt_manifest_t *m;
    char dir[4096];
} ckpt_handle_t;

static void handle_free(PyObject *cap)
{
    ckpt_handle_t *h = PyCapsule_GetPointer(cap, HANDLE_NAME);
    if (h) {
        ps_ckpt_manifest_free(h->m);
        free(h);
    }
}

static uint64_t param_numel(const ps_ckpt_param_t *p)
{
    uint64_t n = 1;
    for (int d = 0; d < p->ndim; d++)
        n *= (uint64_t)p->shape[d];
    return n;
}

static PyObject *shape_tuple(int ndim, const int64_t *shape)
{
    PyObject *t = PyTuple_New(ndim);
    for (int d = 0; t && d < ndim; d++) {
        PyObject *v = PyLong_FromLongLong(shape[d]);
        if (!v) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, d, v);
    }
    return t;
}

static PyObject *manifest_info(const ps_ckpt_manifest_t *m)
{
    PyObject *sections = PyList_New(m->nsections), *params = PyList_New((Py_ssize_t)m->nparams);
    if (!sections || !params)
        goto fail;
    for (int s = 0; s < m->nsections; s++) {
        PyObject *v = PyUnicode_FromString(m->sections[s]);
        if (!v)
            goto fail;
        PyList_SET_ITEM(sections, s, v);
    }
    for (size_t p = 0; p < m->nparams; p++) {
        const ps_ckpt_param_t *cp = &m->params[p];
        PyObject *v = Py_BuildValue("(sNL)", cp->name, shape_tuple(cp->ndim, cp->shape),
                                    (long long)cp->skipped);
        if (!v)
            goto fail;
        PyList_SET_ITEM(params, (Py_ssize_t)p, v);
    }
    const ps_ckpt_optim_t *o = &m->optim;
    return Py_BuildValue("{s:L,s:i,s:s,s:N,s:{s:s,s:d,s:d,s:d,s:O,s:d,s:d,s:d,s:d,s:d},s:N}",
                         "step", (long long)m->step, "world_size", m->world_size, "layout",
                         m->layout == PSHARD_LAYOUT_FSDP1 ? "fsdp1" : "fsdp2", "sections", sections,
                         "optimizer", "kind", o->kind, "lr", o->lr, "momentum", o->momentum,
                         "dampening", o->dampening, "nesterov", o->nesterov ? Py_True : Py_False,
                         "weight_decay", o->weight_decay, "beta1", o->beta1, "beta2", o->beta2,
                         "eps", o->eps, "max_grad_norm", o->max_grad_norm, "params", params);
fail:
    Py_XDECREF(sections);
    Py_XDECREF(params);
    return NULL;
}

PyObject *pshard_py_ckpt_open(PyObject *mod, PyObject *args, PyObject *kw)
{
    (void)mod;
    static char *kwlist[] = {"step_dir", "verify", NULL};
    const char *dir;
    int verify = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|p", kwlist, &dir, &verify))
        return NULL;
    ckpt_handle_t *h = calloc(1, sizeof(*h));
    if (!h)
        return PyErr_NoMemory();
    if (strlen(dir) >= sizeof(h->dir)) {
        free(h);
        return pshard_py_raise_status(PSHARD_ERR_INVALID_ARGUMENT, "the path is too long");
    }
    ps_strlcpy(h->dir, dir, sizeof(h->dir));
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t st;
    Py_BEGIN_ALLOW_THREADS st = ps_ckpt_manifest_read(h->dir, &h->m, err, sizeof(err));
    for (size_t f = 0; st == PSHARD_OK && verify && f < h->m->nfiles; f++)
        st = ps_ckpt_verify_file(h->dir, &h->m->files[f], err, sizeof(err));
    Py_END_ALLOW_THREADS if (st != PSHARD_OK)
    {
        ps_ckpt_manifest_free(h->m);
        free(h);
        return pshard_py_raise_status(st, err);
    }
    PyObject *info = manifest_info(h->m);
    PyObject *cap = info ? PyCapsule_New(h, HANDLE_NAME, handle_free) : NULL;
    if (!cap) {
        Py_XDECREF(info);
        ps_ckpt_manifest_free(h->m);
        free(h);
        return NULL;
    }
    return Py_BuildValue("(NN)", cap, info);
}

PyObject *pshard_py_ckpt_read(PyObject *mod, PyObject *args)
{
    (void)mod;
    PyObject *cap;
    int section;
    Py_ssize_t param;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "Oinw*", &cap, &section, &param, &out))
        return NULL;
    ckpt_handle_t *h = PyCapsule_GetPointer(cap, HANDLE_NAME);
    PyObject *ret = NULL;
    if (!h)
        goto done;
    if (section < 0 || section >= h->m->nsections || param < 0 || (size_t)param >= h->m->nparams) {
        PyErr_Format(PyExc_IndexError, "section %d of parameter %zd: the checkpoint has %d and %zu",
                     section, param, h->m->nsections, h->m->nparams);
        goto done;
    }
    uint64_t numel = param_numel(&h->m->params[param]);
    if ((uint64_t)out.len != numel * sizeof(float) || !PyBuffer_IsContiguous(&out, 'C')) {
        PyErr_Format(PyExc_ValueError, "parameter '%s' takes a contiguous buffer of %llu bytes",
                     h->m->params[param].name, (unsigned long long)(numel * sizeof(float)));
        goto done;
    }
    char err[PSHARD_ERRLEN] = "";
    pshard_status_t st;
    Py_BEGIN_ALLOW_THREADS st = ps_ckpt_read_range(h->dir, h->m, section, (uint32_t)param, 0, numel,
                                                   out.buf, err, sizeof(err));
    Py_END_ALLOW_THREADS if (st != PSHARD_OK) pshard_py_raise_status(st, err);
    else
    {
        Py_INCREF(Py_None);
        ret = Py_None;
    }
done:
    PyBuffer_Release(&out);
    return ret;
}

/* ---- ckpt_write -------------------------------------------------------------------------- */

static int get_double(PyObject *d, const char *key, double *out)
{
    PyObject *v = PyDict_GetItemString(d, key); /* borrowed */
    if (!v)
        return 0;
    *out = PyFloat_AsDouble(v);
    return PyErr_Occurred() ? -1 : 0;
}

/* The optimizer record: a dict with "kind" and any of the manifest's numbers. */
static int parse_optim(PyObject *d, ps_ckpt_optim_t *o, int *nsections, char (*names)[32])
{
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "optimizer is a dict with 'kind'");
        return -1;
    }
    PyObject *kind = PyDict_GetItemString(d, "kind");
    const char *k = kind && PyUnicode_Check(kind) ? PyUnicode_AsUTF8(kind) : NULL;
    if (!k || (strcmp(k, "sgd") && strcmp(k, "adam") && strcmp(k, "adamw"))) {
        PyErr_SetString(PyExc_ValueError, "optimizer['kind'] is 'sgd', 'adam' or 'adamw'");
        return -1;
    }
    ps_strlcpy(o->kind, k, sizeof(o->kind));
    o->beta1 = 0.9;
    o->beta2 = 0.999;
    o->eps = 1e-8;
    if (get_double(d, "lr", &o->lr) || get_double(d, "momentum", &o->momentum) ||
        get_double(d, "dampening", &o->dampening) ||
        get_double(d, "weight_decay", &o->weight_decay) || get_double(d, "beta1", &o->beta1) ||
        get_double(d, "beta2", &o->beta2) || get_double(d, "eps", &o->eps) ||
        get_double(d, "max_grad_norm", &o->max_grad_norm))
        return -1;
    PyObject *nest = PyDict_GetItemString(d, "nesterov");
    o->nesterov = nest && PyObject_IsTrue(nest) == 1;
    ps_strlcpy(names[0], "master", 32);
    if (strcmp(k, "sgd") == 0) {
        *nsections = o->momentum != 0 ? 2 : 1;
        ps_strlcpy(names[1], "momentum_buffer", 32);
    } else {
        *nsections = 3;
        ps_strlcpy(names[1], "exp_avg", 32);
        ps_strlcpy(names[2], "exp_avg_sq", 32);
    }
    return 0;
}

/* params: [(name, shape, skipped_steps)], checked as the manifest reader would. */
static int parse_params(PyObject *list, int64_t step, ps_ckpt_manifest_t *m)
{
    PyObject *seq = PySequence_Fast(list, "params is a list of (name, shape, skipped_steps)");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    m->params = calloc(n ? (size_t)n : 1, sizeof(*m->params));
    if (!m->params) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    m->nparams = (size_t)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *name;
        PyObject *shape;
        long long skipped;
        ps_ckpt_param_t *p = &m->params[i];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "sOL", &name, &shape, &skipped))
            goto fail;
        PyObject *dims = PySequence_Fast(shape, "a shape is a sequence of ints");
        if (!dims)
            goto fail;
        Py_ssize_t nd = PySequence_Fast_GET_SIZE(dims);
        if (!*name || strlen(name) >= sizeof(p->name) || nd < 1 || nd > 8 || skipped < 0 ||
            skipped > step) {
            Py_DECREF(dims);
            PyErr_Format(PyExc_ValueError,
                         "parameter #%zd '%s': a name of 1..255 bytes, 1..8 dimensions and "
                         "skipped_steps in 0..%lld",
                         i, name, (long long)step);
            goto fail;
        }
        ps_strlcpy(p->name, name, sizeof(p->name));
        p->ndim = (int)nd;
        p->skipped = skipped;
        for (Py_ssize_t d = 0; d < nd; d++) {
            p->shape[d] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(dims, d));
            if (p->shape[d] < 0 && !PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "parameter '%s' has a negative dimension", name);
        }
        Py_DECREF(dims);
        if (PyErr_Occurred())
            goto fail;
    }
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    return -1;
}

/* Writes section after section, each parameter's buffer in turn, into the one shard file. */
static int write_data(ps_ckpt_shard_out_t *out, const ps_ckpt_manifest_t *m, PyObject *data,
                      char *err, size_t errlen, pshard_status_t *st)
{
    PyObject *secs = PySequence_Fast(data, "data is a list (sections) of lists (parameters)");
    if (!secs)
        return -1;
    int rc = 0;
    if (PySequence_Fast_GET_SIZE(secs) != m->nsections) {
        PyErr_Format(PyExc_ValueError, "data has %zd sections; the optimizer keeps %d",
                     PySequence_Fast_GET_SIZE(secs), m->nsections);
        rc = -1;
    }
    for (int s = 0; rc == 0 && s < m->nsections; s++) {
        PyObject *bufs = PySequence_Fast(PySequence_Fast_GET_ITEM(secs, s),
                                         "each section of data is a list of buffers");
        if (!bufs || PySequence_Fast_GET_SIZE(bufs) != (Py_ssize_t)m->nparams) {
            if (bufs)
                PyErr_Format(PyExc_ValueError, "section '%s' has %zd buffers for %zu parameters",
                             m->sections[s], PySequence_Fast_GET_SIZE(bufs), m->nparams);
            Py_XDECREF(bufs);
            rc = -1;
            break;
        }
        for (size_t p = 0; rc == 0 && p < m->nparams; p++) {
            Py_buffer b;
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(bufs, (Py_ssize_t)p), &b,
                                   PyBUF_C_CONTIGUOUS) < 0) {
                rc = -1;
                break;
            }
            uint64_t want = param_numel(&m->params[p]) * sizeof(float);
            if ((uint64_t)b.len != want) {
                PyErr_Format(PyExc_ValueError, "section '%s' of '%s' is %zd bytes, not %llu",
                             m->sections[s], m->params[p].name, b.len, (unsigned long long)want);
                rc = -1;
            } else {
                Py_BEGIN_ALLOW_THREADS *st =
                    ps_ckpt_shard_out_write(out, b.buf, (size_t)b.len, err, errlen);
                Py_END_ALLOW_THREADS if (*st != PSHARD_OK) rc = -1;
            }
            PyBuffer_Release(&b);
        }
        Py_DECREF(bufs);
    }
    Py_DECREF(secs);
    return rc;
}

PyObject *pshard_py_ckpt_write(PyObject *mod, PyObject *args)
{
    (void)mod;
    const char *root;
    long long step;
    PyObject *optim, *params, *data;
    if (!PyArg_ParseTuple(args, "sLOOO", &root, &step, &optim, &params, &data))
        return NULL;
    if (step < 0)
        return pshard_py_raise_status(PSHARD_ERR_INVALID_ARGUMENT, "the step is >= 0");
    ps_ckpt_manifest_t m = {0};
    ps_ckpt_file_t file = {0};
    char step_dir[4096], err[PSHARD_ERRLEN] = "";
    pshard_status_t st = PSHARD_OK;
    int dfd = -1;
    PyObject *ret = NULL;
    m.step = step;
    m.world_size = 1;
    m.layout = PSHARD_LAYOUT_FSDP2;
    if (parse_optim(optim, &m.optim, &m.nsections, m.sections) < 0 ||
        parse_params(params, step, &m) < 0)
        goto done;
    ps_ckpt_step_dir(root, step, step_dir, sizeof(step_dir));
    st = ps_ckpt_step_dir_make(root, step, &dfd, err, sizeof(err));
    if (st == PSHARD_OK && faccessat(dfd, PS_CKPT_MANIFEST, F_OK, AT_SYMLINK_NOFOLLOW) == 0)
        st = ps_errf(err, sizeof(err), PSHARD_ERR_ALREADY_EXISTS,
                     "%s already holds a committed checkpoint; remove it or pick another step",
                     step_dir);
    ps_ckpt_shard_out_t *out = NULL;
    if (st == PSHARD_OK)
        st = ps_ckpt_shard_out_open(dfd, step_dir, 0, 1, &out, err, sizeof(err));
    if (st != PSHARD_OK)
        goto done;
    int wrc = write_data(out, &m, data, err, sizeof(err), &st);
    pshard_status_t st2 =
        ps_ckpt_shard_out_close(out, wrc == 0, &file.bytes, &file.crc32c, err, sizeof(err));
    if (wrc < 0 || st2 != PSHARD_OK) {
        if (st == PSHARD_OK)
            st = st2;
        goto done;
    }
    file.rank = 0;
    ps_ckpt_shard_name(0, 1, file.path, sizeof(file.path));
    file.pieces = calloc(m.nparams ? m.nparams : 1, sizeof(*file.pieces));
    if (!file.pieces) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t p = 0; p < m.nparams; p++) {
        uint64_t n = param_numel(&m.params[p]);
        if (n == 0)
            continue;
        file.pieces[file.npieces++] = (ps_ckpt_piece_t){
            .param = (uint32_t)p, .start = 0, .count = n, .offset = file.shard_numel};
        file.shard_numel += n;
    }
    m.nfiles = 1;
    m.files = &file;
    Py_BEGIN_ALLOW_THREADS st = ps_ckpt_manifest_write(step_dir, &m, err, sizeof(err));
    Py_END_ALLOW_THREADS if (st == PSHARD_OK) ret = PyUnicode_FromString(step_dir);
done:
    if (st != PSHARD_OK && !PyErr_Occurred())
        pshard_py_raise_status(st, err);
    if (dfd >= 0)
        close(dfd);
    free(file.pieces);
    free(m.params);
    return ret;
}
