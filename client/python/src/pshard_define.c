/* pshard._C's Client.define_model: the model's parameters (names, shapes, optional initial
 * values read through DLPack), its optimizer and parameter groups (dicts as torch.optim's
 * param_groups), layout and mixed precision, handed to pshard_define_model with the GIL
 * released. */
#include "pshard_py.h"

#include <string.h>

static int dict_double(PyObject *d, const char *key, double *out)
{
    PyObject *v = PyDict_GetItemString(d, key);
    if (!v)
        return 0;
    double x = PyFloat_AsDouble(v);
    if (x == -1.0 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

static int dict_bool(PyObject *d, const char *key, bool *out)
{
    PyObject *v = PyDict_GetItemString(d, key);
    if (!v)
        return 0;
    int t = PyObject_IsTrue(v);
    if (t < 0)
        return -1;
    *out = t != 0;
    return 0;
}

/* Fills a group from a dict of torch's names (lr, momentum, dampening, nesterov,
 * weight_decay, betas, eps, frozen); missing keys keep *g. Returns 0 or -1 (exception). */
int pshard_py_group_from_dict(PyObject *d, pshard_optim_group_t *g)
{
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "an optimizer group must be a dict");
        return -1;
    }
    if (dict_double(d, "lr", &g->lr) || dict_double(d, "momentum", &g->momentum) ||
        dict_double(d, "dampening", &g->dampening) ||
        dict_double(d, "weight_decay", &g->weight_decay) || dict_double(d, "eps", &g->eps) ||
        dict_bool(d, "nesterov", &g->nesterov) || dict_bool(d, "frozen", &g->frozen))
        return -1;
    PyObject *betas = PyDict_GetItemString(d, "betas");
    if (betas) {
        if (!PyArg_ParseTuple(betas, "dd;betas must be a pair of floats", &g->beta1, &g->beta2))
            return -1;
    }
    return 0;
}

PyObject *Client_define_model(ClientObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"names",
                             "shapes",
                             "init",
                             "optimizer",
                             "groups",
                             "param_groups",
                             "layout",
                             "param_dtype",
                             "reduce_dtype",
                             "reshard_after_forward",
                             "max_gathers_in_flight",
                             "max_grad_norm",
                             "init_from_rank0",
                             "replicate",
                             "shard",
                             "device_region",
                             "stable_param_buffers",
                             "pool_bytes",
                             NULL};
    PyObject *names, *shapes, *init = Py_None, *groups = Py_None, *pgroups = Py_None;
    const char *optimizer = "sgd", *layout = "fsdp2";
    PyObject *pdt = NULL, *rdt = NULL;
    int reshard = 1, max_inflight = 2, from_rank0 = 1, replicate = 0, shard = 0, on_dev = 0;
    int stable = 1;
    Py_ssize_t pool_bytes = 0;
    double max_grad_norm = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|OsOOsOOpidpiippn", kwlist, &names, &shapes,
                                     &init, &optimizer, &groups, &pgroups, &layout, &pdt, &rdt,
                                     &reshard, &max_inflight, &max_grad_norm, &from_rank0,
                                     &replicate, &shard, &on_dev, &stable, &pool_bytes))
        return NULL;
    if (!pshard_py_client_ok(self))
        return NULL;
    if (self->exports > 0)
        return pshard_py_raise_status(
            PSHARD_ERR_FAILED_PRECONDITION,
            "the model is already defined and views of its parameters are "
            "alive; a client defines one model");
    pshard_optimizer_t kind;
    if (strcmp(optimizer, "sgd") == 0)
        kind = PSHARD_SGD;
    else if (strcmp(optimizer, "adam") == 0)
        kind = PSHARD_ADAM;
    else if (strcmp(optimizer, "adamw") == 0)
        kind = PSHARD_ADAMW;
    else
        return PyErr_Format(PyExc_ValueError, "optimizer must be sgd, adam or adamw, not '%s'",
                            optimizer);
    pshard_model_config_t mc;
    pshard_model_config_default(&mc, kind);
    mc.replicate = replicate; /* HSDP (both 0: none); libpshard checks them */
    mc.shard = shard;
    if (strcmp(layout, "fsdp2") == 0)
        mc.layout = PSHARD_LAYOUT_FSDP2;
    else if (strcmp(layout, "fsdp1") == 0)
        mc.layout = PSHARD_LAYOUT_FSDP1;
    else
        return PyErr_Format(PyExc_ValueError, "layout must be fsdp2 or fsdp1, not '%s'", layout);
    if (pdt && pdt != Py_None && !pshard_py_parse_dtype(pdt, &mc.param_dtype))
        return NULL;
    mc.reduce_dtype = mc.param_dtype == PSHARD_BF16 ? PSHARD_BF16 : PSHARD_FP32;
    if (rdt && rdt != Py_None && !pshard_py_parse_dtype(rdt, &mc.reduce_dtype))
        return NULL;
    mc.reshard_after_forward = reshard != 0;
    mc.max_gathers_in_flight = max_inflight;
    mc.max_grad_norm = max_grad_norm;
    mc.init_from_rank0 = from_rank0 != 0;
    if (pool_bytes < 0)
        return PyErr_Format(PyExc_ValueError, "pool_bytes must be >= 0 (0: the default), not %zd",
                            pool_bytes);
    mc.stable_param_buffers = stable != 0;
    mc.pool_bytes = (size_t)pool_bytes;
    mc.device_region = on_dev != 0;

    PyObject *nseq = PySequence_Fast(names, "names must be a sequence of str");
    PyObject *sseq = nseq ? PySequence_Fast(shapes, "shapes must be a sequence") : NULL;
    PyObject *iseq = NULL, *gseq = NULL, *pgseq = NULL, *shape_tuples = NULL;
    pshard_param_t *params = NULL;
    int64_t *dims = NULL;
    const float **initp = NULL;
    dl_in_t *ins = NULL;
    pshard_optim_group_t *garr = NULL;
    uint32_t *pg = NULL;
    PyObject *result = NULL;
    size_t n = 0;
    if (!sseq)
        goto out;
    n = (size_t)PySequence_Fast_GET_SIZE(nseq);
    if ((size_t)PySequence_Fast_GET_SIZE(sseq) != n) {
        PyErr_SetString(PyExc_ValueError, "names and shapes differ in length");
        goto out;
    }
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "the model has no parameters");
        goto out;
    }
    params = PyMem_Calloc(n, sizeof(*params));
    dims = PyMem_Calloc(n * 8, sizeof(int64_t));
    shape_tuples = PyTuple_New((Py_ssize_t)n);
    if (!params || !dims || !shape_tuples) {
        PyErr_NoMemory();
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        PyObject *nm = PySequence_Fast_GET_ITEM(nseq, i);
        params[i].name = PyUnicode_Check(nm) ? PyUnicode_AsUTF8(nm) : NULL;
        if (!params[i].name) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "parameter #%zu: the name must be a str", i);
            goto out;
        }
        PyObject *sh = PySequence_Fast(PySequence_Fast_GET_ITEM(sseq, i),
                                       "a shape must be a sequence of ints");
        if (!sh)
            goto out;
        Py_ssize_t nd = PySequence_Fast_GET_SIZE(sh);
        if (nd < 1 || nd > 8) {
            Py_DECREF(sh);
            PyErr_Format(PyExc_ValueError,
                         "parameter '%s' has %zd dimensions; pshard shards tensors of 1 to 8 "
                         "dimensions",
                         params[i].name, nd);
            goto out;
        }
        PyObject *tup = PyTuple_New(nd);
        if (!tup) {
            Py_DECREF(sh);
            goto out;
        }
        for (Py_ssize_t d = 0; d < nd; d++) {
            PyObject *item = PySequence_Fast_GET_ITEM(sh, d);
            long long v = PyLong_AsLongLong(item);
            if (v == -1 && PyErr_Occurred()) {
                Py_DECREF(sh);
                Py_DECREF(tup);
                goto out;
            }
            dims[i * 8 + (size_t)d] = v;
            Py_INCREF(item);
            PyTuple_SET_ITEM(tup, d, item);
        }
        Py_DECREF(sh);
        PyTuple_SET_ITEM(shape_tuples, (Py_ssize_t)i, tup);
        params[i].ndim = (int)nd;
        params[i].shape = &dims[i * 8];
    }
    if (init != Py_None) {
        iseq = PySequence_Fast(init, "init must be a sequence of tensors or None");
        if (!iseq)
            goto out;
        if ((size_t)PySequence_Fast_GET_SIZE(iseq) != n) {
            PyErr_SetString(PyExc_ValueError, "init and names differ in length");
            goto out;
        }
        ins = PyMem_Calloc(n, sizeof(*ins));
        initp = PyMem_Calloc(n, sizeof(*initp));
        if (!ins || !initp) {
            PyErr_NoMemory();
            goto out;
        }
        for (size_t i = 0; i < n; i++) {
            char what[320];
            PyOS_snprintf(what, sizeof(what), "initial value of '%s'", params[i].name);
            if (pshard_py_dl_acquire(PySequence_Fast_GET_ITEM(iseq, i), PSHARD_FP32, what,
                                     &ins[i]) != 0)
                goto out;
            size_t want = 1;
            for (int d = 0; d < params[i].ndim; d++)
                want *= (size_t)(params[i].shape[d] > 0 ? params[i].shape[d] : 0);
            if (ins[i].numel != want) {
                PyErr_Format(PyExc_ValueError, "%s has %zu elements, the shape says %zu", what,
                             ins[i].numel, want);
                goto out;
            }
            initp[i] = ins[i].data;
        }
    }
    if (groups != Py_None) {
        gseq = PySequence_Fast(groups, "groups must be a sequence of dicts");
        pgseq = gseq ? PySequence_Fast(pgroups, "param_groups must be a sequence of ints") : NULL;
        if (!pgseq)
            goto out;
        size_t ng = (size_t)PySequence_Fast_GET_SIZE(gseq);
        if (ng == 0 || (size_t)PySequence_Fast_GET_SIZE(pgseq) != n) {
            PyErr_SetString(PyExc_ValueError,
                            "groups must not be empty and param_groups must name one group per "
                            "parameter");
            goto out;
        }
        garr = PyMem_Calloc(ng, sizeof(*garr));
        pg = PyMem_Calloc(n, sizeof(*pg));
        if (!garr || !pg) {
            PyErr_NoMemory();
            goto out;
        }
        for (size_t g = 0; g < ng; g++) {
            garr[g] = (pshard_optim_group_t){.lr = mc.lr,
                                             .momentum = mc.momentum,
                                             .dampening = mc.dampening,
                                             .weight_decay = mc.weight_decay,
                                             .beta1 = mc.beta1,
                                             .beta2 = mc.beta2,
                                             .eps = mc.eps,
                                             .nesterov = mc.nesterov};
            if (pshard_py_group_from_dict(PySequence_Fast_GET_ITEM(gseq, g), &garr[g]) != 0)
                goto out;
        }
        for (size_t i = 0; i < n; i++) {
            long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(pgseq, i));
            if (v == -1 && PyErr_Occurred())
                goto out;
            if (v < 0 || (size_t)v >= ng) {
                PyErr_Format(PyExc_ValueError, "parameter '%s' is in group %ld of %zu",
                             params[i].name, v, ng);
                goto out;
            }
            pg[i] = (uint32_t)v;
        }
        /* Group 0 also fills the model-wide fields (single-group servers read those). */
        mc.lr = garr[0].lr;
        mc.momentum = garr[0].momentum;
        mc.dampening = garr[0].dampening;
        mc.weight_decay = garr[0].weight_decay;
        mc.beta1 = garr[0].beta1;
        mc.beta2 = garr[0].beta2;
        mc.eps = garr[0].eps;
        mc.nesterov = garr[0].nesterov;
        mc.ngroups = ng;
        mc.groups = garr;
        mc.param_groups = pg;
    }
    pshard_status_t st;
    CLIENT_CALL(self, st = pshard_define_model(self->c, params, n, &mc,
                                               initp ? (const float *const *)initp : NULL));
    if (st != PSHARD_OK) {
        pshard_py_client_fail(self, st);
        goto out;
    }
    self->param_dtype = mc.param_dtype;
    self->reduce_dtype = mc.reduce_dtype;
    self->nparams = n;
    Py_XSETREF(self->shapes, shape_tuples);
    shape_tuples = NULL;
    result = PyLong_FromLongLong(pshard_model_step(self->c));
out:
    if (ins)
        for (size_t i = 0; i < n; i++)
            pshard_py_dl_release(&ins[i]);
    PyMem_Free(ins);
    PyMem_Free(initp);
    PyMem_Free(params);
    PyMem_Free(dims);
    PyMem_Free(garr);
    PyMem_Free(pg);
    Py_XDECREF(shape_tuples);
    Py_XDECREF(nseq);
    Py_XDECREF(sseq);
    Py_XDECREF(iseq);
    Py_XDECREF(gseq);
    Py_XDECREF(pgseq);
    return result;
}
