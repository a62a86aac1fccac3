/* pshard._C's process groups: a Group owns one libpshard group handle (pshard_new_groups) and
 * shows this trainer's rank in it, its size and its world ranks; Client.new_groups makes them
 * and every collective method of Client takes one as its optional last argument. */
#include "pshard_groups.h"

#include <limits.h>
#include <stdlib.h>

typedef struct {
    PyObject_HEAD pshard_group_t *g;
} GroupObject;

static PyTypeObject GroupType;

static void Group_dealloc(GroupObject *self)
{
    pshard_group_free(self->g);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Group_get_rank(GroupObject *self, void *unused)
{
    (void)unused;
    return PyLong_FromLong(pshard_group_rank(self->g));
}

static PyObject *Group_get_size(GroupObject *self, void *unused)
{
    (void)unused;
    return PyLong_FromLong(pshard_group_size(self->g));
}

static PyObject *Group_get_ranks(GroupObject *self, void *unused)
{
    (void)unused;
    int n = pshard_group_size(self->g);
    PyObject *t = PyTuple_New(n);
    if (!t)
        return NULL;
    for (int k = 0; k < n; k++) {
        PyObject *r = PyLong_FromLong(pshard_group_global_rank(self->g, k));
        if (!r) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, k, r);
    }
    return t;
}

static PyObject *Group_repr(GroupObject *self)
{
    PyObject *ranks = Group_get_ranks(self, NULL);
    if (!ranks)
        return NULL;
    PyObject *s = PyUnicode_FromFormat("pshard._C.Group(ranks=%R, rank=%d)", ranks,
                                       pshard_group_rank(self->g));
    Py_DECREF(ranks);
    return s;
}

static PyGetSetDef Group_getset[] = {
    {"rank", (getter)Group_get_rank, NULL, "this trainer's rank in the group, -1 if not in it",
     NULL},
    {"size", (getter)Group_get_size, NULL, "the number of ranks in the group", NULL},
    {"ranks", (getter)Group_get_ranks, NULL, "the group's world ranks, in group-rank order", NULL},
    {NULL}};

static PyTypeObject GroupType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pshard._C.Group",
    .tp_basicsize = sizeof(GroupObject),
    .tp_dealloc = (destructor)Group_dealloc,
    .tp_repr = (reprfunc)Group_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A process group made by Client.new_groups (torch.distributed.new_group); pass it "
              "as the last argument of a Client collective.",
    .tp_getset = Group_getset,
};

int pshard_py_groups_init(PyObject *m)
{
    if (PyType_Ready(&GroupType) < 0)
        return -1;
    Py_INCREF(&GroupType);
    if (PyModule_AddObject(m, "Group", (PyObject *)&GroupType) < 0) {
        Py_DECREF(&GroupType);
        return -1;
    }
    return 0;
}

int pshard_py_group_arg(PyObject *o, void *out)
{
    const pshard_group_t **g = out;
    if (o == Py_None) {
        *g = NULL;
        return 1;
    }
    if (!PyObject_TypeCheck(o, &GroupType)) {
        PyErr_Format(PyExc_TypeError, "group must be a pshard._C.Group or None (the world), not %s",
                     Py_TYPE(o)->tp_name);
        return 0;
    }
    *g = ((GroupObject *)o)->g;
    return 1;
}

int pshard_py_rank_lists(PyObject *lists, int **ranks, size_t **sizes, size_t *ngroups)
{
    *ranks = NULL;
    *sizes = NULL;
    *ngroups = 0;
    PyObject *outer = PySequence_Fast(lists, "new_groups takes a list of lists of ranks");
    if (!outer)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(outer);
    PyObject **inner = calloc((size_t)n + 1, sizeof(PyObject *));
    size_t *sz = calloc((size_t)n + 1, sizeof(size_t));
    int *rs = NULL;
    size_t total = 0;
    if (!inner || !sz) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        inner[i] = PySequence_Fast(PySequence_Fast_GET_ITEM(outer, i),
                                   "each group of new_groups must be a list of ranks");
        if (!inner[i])
            goto fail;
        sz[i] = (size_t)PySequence_Fast_GET_SIZE(inner[i]);
        total += sz[i];
    }
    rs = malloc((total + 1) * sizeof(int));
    if (!rs) {
        PyErr_NoMemory();
        goto fail;
    }
    size_t off = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        for (size_t k = 0; k < sz[i]; k++) {
            PyObject *item = PySequence_Fast_GET_ITEM(inner[i], (Py_ssize_t)k);
            PyObject *idx = PyNumber_Index(item);
            if (!idx) {
                PyErr_Format(PyExc_TypeError, "new_groups: group %zd: rank %R is not an int", i,
                             item);
                goto fail;
            }
            int overflow = 0;
            long v = PyLong_AsLongAndOverflow(idx, &overflow);
            Py_DECREF(idx);
            if (overflow)
                v = overflow < 0 ? LONG_MIN : LONG_MAX;
            /* Out of int's range: a rank no world has, which libpshard refuses by number. */
            rs[off + k] = v < INT_MIN ? INT_MIN : v > INT_MAX ? INT_MAX : (int)v;
        }
        off += sz[i];
    }
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(inner[i]);
    free(inner);
    Py_DECREF(outer);
    *ranks = rs;
    *sizes = sz;
    *ngroups = (size_t)n;
    return 0;
fail:
    for (Py_ssize_t i = 0; inner && i < n; i++)
        Py_XDECREF(inner[i]);
    free(inner);
    free(sz);
    free(rs);
    Py_DECREF(outer);
    return -1;
}

PyObject *pshard_py_groups_wrap(pshard_group_t **gs, size_t n)
{
    PyObject *list = PyList_New((Py_ssize_t)n);
    size_t done = 0;
    if (!list)
        goto fail;
    for (; done < n; done++) {
        GroupObject *o = PyObject_New(GroupObject, &GroupType);
        if (!o)
            goto fail;
        o->g = gs[done];
        PyList_SET_ITEM(list, (Py_ssize_t)done, (PyObject *)o);
    }
    return list;
fail:
    Py_XDECREF(list); /* frees the Groups made so far, and their handles */
    for (; done < n; done++)
        pshard_group_free(gs[done]);
    return NULL;
}
