/* pshard._C's plain collectives on tensors: the Client methods torch.distributed's calls become
 * (all_reduce, broadcast, all_gather, reduce_scatter_tensor, all_to_all, reduce, gather,
 * scatter, send / recv, barrier, new_group, and any of them asynchronously through
 * collective_start). Tensors come in through DLPack and must be contiguous CPU tensors; every
 * call releases the GIL. */
#include "pshard_py.h"

#include <stdlib.h>
#include <string.h>

#include "pshard_groups.h"

/* Every collective method takes an optional last argument, a Group (pshard_groups.c) or None
 * for the world; with a group, roots are group ranks and sizes are the group's. */

/* The number of ranks of g (NULL: the world) and this trainer's rank in it (-1: not in it). */
static int coll_size(ClientObject *self, const pshard_group_t *g)
{
    return g ? pshard_group_size(g) : pshard_world_size(self->c);
}

static int coll_rank(ClientObject *self, const pshard_group_t *g)
{
    return g ? pshard_group_rank(g) : pshard_rank(self->c);
}

/* Runs a with the GIL released; NULL with the exception set, or None. */
static PyObject *run_collective(ClientObject *self, const pshard_collective_args_t *a)
{
    pshard_status_t st;
    CLIENT_CALL(self, st = pshard_collective(self->c, a));
    if (st != PSHARD_OK)
        return pshard_py_client_fail(self, st);
    Py_RETURN_NONE;
}

/* A rank of the world or of group g, or ValueError naming what it was for. */
static int check_root(ClientObject *self, const pshard_group_t *g, int root, const char *what)
{
    int n = coll_size(self, g);
    if (root >= 0 && root < n)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s %d is not a rank (%s size %d)", what, root,
                 g ? "group" : "world", n);
    return -1;
}

/* collective_start(op, send, recv, count, dtype, reduce=0, root=0, group=None, tag=0,
 * own=False) -> Work: one collective (pshard_op_t numbers) queued behind what was issued
 * before (torch's async_op=True). send / recv: contiguous CPU tensors of dtype holding at least
 * what this rank's role uses (None where it uses nothing); both are held until the work is
 * waited. own: the collective is staged (pshard_collective_start_staged), so the caller may
 * resize or free the tensors meanwhile (as it may with torch's Works): send is read now, recv
 * written when the work is waited for, and only if it still has the memory it had (else wait()
 * raises). Without own the caller must keep both tensors' memory as it is until then (a
 * blocking call). */
PyObject *Client_collective_start(ClientObject *self, PyObject *args)
{
    int op, reduce = 0, root = 0;
    PyObject *send, *recv, *dt, *gobj = Py_None;
    unsigned long long count;
    unsigned int tag = 0;
    int own = 0;
    if (!PyArg_ParseTuple(args, "iOOKO|iiOIp", &op, &send, &recv, &count, &dt, &reduce, &root,
                          &gobj, &tag, &own))
        return NULL;
    pshard_dtype_t dtype;
    const pshard_group_t *g = NULL;
    if (!pshard_py_client_ok(self) || !pshard_py_parse_dtype(dt, &dtype) ||
        !pshard_py_group_arg(gobj, &g))
        return NULL;
    size_t n = (size_t)coll_size(self, g), c = (size_t)count;
    bool root_me = coll_rank(self, g) == root;
    size_t need_send = c, need_recv = c;
    switch (op) {
    case PSHARD_OP_ALL_GATHER:
        need_recv = n * c;
        break;
    case PSHARD_OP_ALL_REDUCE:
        break;
    case PSHARD_OP_BROADCAST:
        need_send = root_me ? c : 0;
        break;
    case PSHARD_OP_BARRIER:
        need_send = need_recv = 0;
        break;
    case PSHARD_OP_REDUCE:
        need_recv = root_me ? c : 0;
        break;
    case PSHARD_OP_GATHER:
        need_recv = root_me ? n * c : 0;
        break;
    case PSHARD_OP_SCATTER:
        need_send = root_me ? n * c : 0;
        break;
    case PSHARD_OP_ALL_TO_ALL:
        need_send = need_recv = n * c;
        break;
    case PSHARD_OP_REDUCE_SCATTER:
        need_send = n * c;
        break;
    case PSHARD_OP_SEND:
        need_recv = 0;
        break;
    case PSHARD_OP_RECV:
        need_send = 0;
        break;
    default:
        return PyErr_Format(PyExc_ValueError, "collective_start: unknown op %d", op);
    }
    if (count > (1ull << 40))
        return PyErr_Format(PyExc_ValueError, "collective_start: count %llu is too large", count);
    WorkObject *w = pshard_py_work_new(self);
    if (!w)
        return NULL;
    PyObject *objs[2] = {send, recv};
    size_t need[2] = {need_send, need_recv};
    const char *names[2] = {"collective_start send", "collective_start recv"};
    for (int k = 0; k < 2; k++) {
        if (need[k] == 0 || objs[k] == Py_None)
            continue;
        if (pshard_py_dl_acquire(objs[k], dtype, names[k], &w->dl[k]) != 0) {
            Py_DECREF(w);
            return NULL;
        }
        if (w->dl[k].numel < need[k]) {
            PyErr_Format(PyExc_ValueError, "%s has %zu elements; this collective uses %zu",
                         names[k], w->dl[k].numel, need[k]);
            Py_DECREF(w);
            return NULL;
        }
    }
    for (int k = 0; k < 2; k++)
        if (need[k] > 0 && !w->dl[k].data) {
            PyErr_Format(PyExc_ValueError, "%s is None; this collective uses %zu elements",
                         names[k], need[k]);
            Py_DECREF(w);
            return NULL;
        }
    if (g) {
        w->group = gobj;
        Py_INCREF(gobj);
    }
    pshard_collective_args_t a = {.op = (pshard_op_t)op,
                                  .group = g,
                                  .send = w->dl[0].data,
                                  .recv = w->dl[1].data,
                                  .count = c,
                                  .dtype = dtype,
                                  .reduce = (pshard_reduce_t)reduce,
                                  .root = root,
                                  .tag = tag};
    if (op == PSHARD_OP_BROADCAST && !a.send)
        a.send = a.recv;
    if (own && a.recv && need[1]) {
        w->out_bytes = need[1] * pshard_dtype_size(dtype);
        w->out_dtype = dtype;
        w->out_obj = recv;
        Py_INCREF(recv);
    }
    pshard_status_t st;
    pshard_work_t *work = NULL;
    CLIENT_CALL(self, st = own ? pshard_collective_start_staged(self->c, &a, &work)
                               : pshard_collective_start(self->c, &a, &work));
    if (own && st == PSHARD_OK) /* the send tensor was read; the recv one is checked at the end */
        pshard_py_dl_release(&w->dl[0]);
    return pshard_py_work_started(self, w, st, work);
}

/* p2p(op, tensor, dtype, peer, tag=0, group=None): a blocking send (op 10) of the whole tensor
 * to peer or recv (op 11) into it from peer (a rank of group, or of the world). */
PyObject *Client_p2p(ClientObject *self, PyObject *args)
{
    int op, peer;
    unsigned int tag = 0;
    PyObject *t, *dt;
    const pshard_group_t *g = NULL;
    if (!PyArg_ParseTuple(args, "iOOi|IO&", &op, &t, &dt, &peer, &tag, pshard_py_group_arg, &g))
        return NULL;
    if (op != PSHARD_OP_SEND && op != PSHARD_OP_RECV)
        return PyErr_Format(PyExc_ValueError, "p2p: op %d is neither send (10) nor recv (11)", op);
    pshard_dtype_t dtype;
    if (!pshard_py_client_ok(self) || !pshard_py_parse_dtype(dt, &dtype) ||
        check_root(self, g, peer, op == PSHARD_OP_SEND ? "dst" : "src") != 0)
        return NULL;
    dl_in_t in;
    if (pshard_py_dl_acquire(t, dtype, op == PSHARD_OP_SEND ? "send tensor" : "recv tensor", &in) !=
        0)
        return NULL;
    pshard_collective_args_t a = {.op = (pshard_op_t)op,
                                  .group = g,
                                  .send = in.data,
                                  .recv = in.data,
                                  .count = in.numel,
                                  .dtype = dtype,
                                  .root = peer,
                                  .tag = tag};
    PyObject *res = run_collective(self, &a);
    pshard_py_dl_release(&in);
    return res;
}

/* reduce_scatter(output, input, dtype, op, group=None): input holds the group's size blocks
 * of output's element count; output gets the reduction of every rank's block for this rank. */
PyObject *Client_reduce_scatter_tensor(ClientObject *self, PyObject *args)
{
    PyObject *out, *in, *dt;
    int op = PSHARD_REDUCE_SUM;
    const pshard_group_t *g = NULL;
    if (!PyArg_ParseTuple(args, "OOOi|O&", &out, &in, &dt, &op, pshard_py_group_arg, &g))
        return NULL;
    pshard_dtype_t dtype;
    if (!pshard_py_client_ok(self) || !pshard_py_parse_dtype(dt, &dtype))
        return NULL;
    dl_in_t o, i;
    if (pshard_py_dl_acquire(out, dtype, "reduce_scatter output", &o) != 0)
        return NULL;
    if (pshard_py_dl_acquire(in, dtype, "reduce_scatter input", &i) != 0) {
        pshard_py_dl_release(&o);
        return NULL;
    }
    PyObject *res = NULL;
    size_t n = (size_t)coll_size(self, g);
    if (i.numel != n * o.numel)
        PyErr_Format(PyExc_ValueError,
                     "reduce_scatter: input has %zu elements; it needs %zu (the %s size %zu "
                     "times output's %zu)",
                     i.numel, n * o.numel, g ? "group" : "world", n, o.numel);
    else {
        pshard_collective_args_t a = {.op = PSHARD_OP_REDUCE_SCATTER,
                                      .group = g,
                                      .send = i.data,
                                      .recv = o.data,
                                      .count = o.numel,
                                      .dtype = dtype,
                                      .reduce = (pshard_reduce_t)op};
        res = run_collective(self, &a);
    }
    pshard_py_dl_release(&i);
    pshard_py_dl_release(&o);
    return res;
}

PyObject *Client_all_reduce(ClientObject *self, PyObject *args)
{
    PyObject *t, *dt;
    int op = PSHARD_REDUCE_SUM; /* torch.distributed.ReduceOp's numbers; True is avg */
    const pshard_group_t *g = NULL;
    if (!PyArg_ParseTuple(args, "OO|iO&", &t, &dt, &op, pshard_py_group_arg, &g))
        return NULL;
    pshard_dtype_t dtype;
    if (!pshard_py_client_ok(self) || !pshard_py_parse_dtype(dt, &dtype))
        return NULL;
    dl_in_t in;
    if (pshard_py_dl_acquire(t, dtype, "all_reduce tensor", &in) != 0)
        return NULL;
    pshard_collective_args_t a = {.op = PSHARD_OP_ALL_REDUCE,
                                  .group = g,
                                  .send = in.data,
                                  .recv = in.data,
                                  .count = in.numel,
                                  .dtype = dtype,
                                  .reduce = (pshard_reduce_t)op};
    PyObject *res = run_collective(self, &a);
    pshard_py_dl_release(&in);
    return res;
}

PyObject *Client_broadcast(ClientObject *self, PyObject *args)
{
    PyObject *t, *dt;
    int root;
    const pshard_group_t *g = NULL;
    if (!PyArg_ParseTuple(args, "OOi|O&", &t, &dt, &root, pshard_py_group_arg, &g))
        return NULL;
    pshard_dtype_t dtype;
    if (!pshard_py_client_ok(self) || !pshard_py_parse_dtype(dt, &dtype) ||
        check_root(self, g, root, "src") != 0)
        return NULL;
    dl_in_t in;
    if (pshard_py_dl_acquire(t, dtype, "broadcast tensor", &in) != 0)
        return NULL;
    pshard_collective_args_t a = {.op = PSHARD_OP_BROADCAST,
                                  .group = g,
                                  .send = in.data,
                                  .recv = in.data,
                                  .count = in.numel,
                                  .dtype = dtype,
                                  .root = root};
    PyObject *res = run_collective(self, &a);
    pshard_py_dl_release(&in);
    return res;
}

/* all_gather(output, input, dtype): output has the group's size times the input's elements;
 * all_to_all(output, input, dtype): both the same size, a multiple of the group's size (equal
 * blocks, block k to and from rank k). */
static PyObject *output_input_call(ClientObject *self, PyObject *args, bool to_all)
{
    PyObject *out, *t, *dt;
    const pshard_group_t *g = NULL;
    if (!PyArg_ParseTuple(args, "OOO|O&", &out, &t, &dt, pshard_py_group_arg, &g))
        return NULL;
    pshard_dtype_t dtype;
    if (!pshard_py_client_ok(self) || !pshard_py_parse_dtype(dt, &dtype))
        return NULL;
    const char *op = to_all ? "all_to_all" : "all_gather";
    const char *size_name = g ? "group" : "world";
    char in_what[32], out_what[32];
    snprintf(in_what, sizeof(in_what), "%s input", op);
    snprintf(out_what, sizeof(out_what), "%s output", op);
    dl_in_t src, dst;
    if (pshard_py_dl_acquire(t, dtype, in_what, &src) != 0)
        return NULL;
    if (pshard_py_dl_acquire(out, dtype, out_what, &dst) != 0) {
        pshard_py_dl_release(&src);
        return NULL;
    }
    size_t n = (size_t)coll_size(self, g);
    bool ok = n > 0 &&
              (to_all ? dst.numel == src.numel && src.numel % n == 0 : dst.numel == src.numel * n);
    PyObject *res = NULL;
    if (!ok) {
        if (to_all)
            PyErr_Format(PyExc_ValueError,
                         "all_to_all needs input and output of the same size, a multiple of "
                         "the %s size %zu (got %zu and %zu elements)",
                         size_name, n, src.numel, dst.numel);
        else
            PyErr_Format(PyExc_ValueError,
                         "the output has %zu elements; %s size %zu times the input's %zu is %zu",
                         dst.numel, size_name, n, src.numel, src.numel * n);
    } else {
        pshard_collective_args_t a = {.op = to_all ? PSHARD_OP_ALL_TO_ALL : PSHARD_OP_ALL_GATHER,
                                      .group = g,
                                      .send = src.data,
                                      .recv = dst.data,
                                      .count = to_all ? src.numel / n : src.numel,
                                      .dtype = dtype};
        res = run_collective(self, &a);
    }
    pshard_py_dl_release(&src);
    pshard_py_dl_release(&dst);
    return res;
}

PyObject *Client_all_gather(ClientObject *self, PyObject *args)
{
    return output_input_call(self, args, false);
}

PyObject *Client_all_to_all(ClientObject *self, PyObject *args)
{
    return output_input_call(self, args, true);
}

PyObject *Client_reduce(ClientObject *self, PyObject *args)
{
    PyObject *t, *dt;
    int op, root;
    const pshard_group_t *g = NULL;
    if (!PyArg_ParseTuple(args, "OOii|O&", &t, &dt, &op, &root, pshard_py_group_arg, &g))
        return NULL;
    pshard_dtype_t dtype;
    if (!pshard_py_client_ok(self) || !pshard_py_parse_dtype(dt, &dtype) ||
        check_root(self, g, root, "dst") != 0)
        return NULL;
    dl_in_t in;
    if (pshard_py_dl_acquire(t, dtype, "reduce tensor", &in) != 0)
        return NULL;
    pshard_collective_args_t a = {.op = PSHARD_OP_REDUCE,
                                  .group = g,
                                  .send = in.data,
                                  .recv = in.data,
                                  .count = in.numel,
                                  .dtype = dtype,
                                  .reduce = (pshard_reduce_t)op,
                                  .root = root};
    PyObject *res = run_collective(self, &a);
    pshard_py_dl_release(&in);
    return res;
}

/* gather(output or None, input, dtype, dst) and scatter(output, input or None, dtype, src):
 * the root's side has the group's size times the other side's elements. */
static PyObject *rooted_move(ClientObject *self, PyObject *args, bool gather)
{
    PyObject *out, *t, *dt;
    int root;
    const pshard_group_t *g = NULL;
    if (!PyArg_ParseTuple(args, "OOOi|O&", &out, &t, &dt, &root, pshard_py_group_arg, &g))
        return NULL;
    pshard_dtype_t dtype;
    if (!pshard_py_client_ok(self) || !pshard_py_parse_dtype(dt, &dtype) ||
        check_root(self, g, root, gather ? "dst" : "src") != 0)
        return NULL;
    bool me = coll_rank(self, g) == root;
    PyObject *big_obj = gather ? out : t, *small_obj = gather ? t : out;
    const char *big_what = gather ? "gather output" : "scatter input";
    const char *small_what = gather ? "gather input" : "scatter output";
    if (me && big_obj == Py_None)
        return PyErr_Format(PyExc_ValueError, "the root needs a %s", big_what);
    dl_in_t small, big;
    memset(&big, 0, sizeof(big));
    if (pshard_py_dl_acquire(small_obj, dtype, small_what, &small) != 0)
        return NULL;
    if (me && pshard_py_dl_acquire(big_obj, dtype, big_what, &big) != 0) {
        pshard_py_dl_release(&small);
        return NULL;
    }
    size_t n = (size_t)coll_size(self, g);
    PyObject *res = NULL;
    if (me && big.numel != small.numel * n) {
        PyErr_Format(PyExc_ValueError,
                     "the %s has %zu elements; %s size %zu times the %s's %zu is %zu", big_what,
                     big.numel, g ? "group" : "world", n, small_what, small.numel, small.numel * n);
    } else {
        pshard_collective_args_t a = {.op = gather ? PSHARD_OP_GATHER : PSHARD_OP_SCATTER,
                                      .group = g,
                                      .send = gather ? small.data : big.data,
                                      .recv = gather ? big.data : small.data,
                                      .count = small.numel,
                                      .dtype = dtype,
                                      .root = root};
        res = run_collective(self, &a);
    }
    pshard_py_dl_release(&small);
    pshard_py_dl_release(&big);
    return res;
}

PyObject *Client_gather_to(ClientObject *self, PyObject *args)
{
    return rooted_move(self, args, true);
}

PyObject *Client_scatter_from(ClientObject *self, PyObject *args)
{
    return rooted_move(self, args, false);
}

PyObject *Client_barrier(ClientObject *self, PyObject *args)
{
    const pshard_group_t *g = NULL;
    if (!PyArg_ParseTuple(args, "|O&", pshard_py_group_arg, &g) || !pshard_py_client_ok(self))
        return NULL;
    pshard_collective_args_t a = {.op = PSHARD_OP_BARRIER, .group = g};
    return run_collective(self, &a);
}

/* new_groups(rank_lists, timeout_ms=0, key=None) -> [Group]: one Group per list of world ranks
 * (strictly increasing), also for the groups this trainer is not in; collective over every
 * rank. With key (a str), rank_lists holds exactly one list and only that group's members call
 * (pshard_new_group_keyed, torch's new_group contract). */
PyObject *Client_new_groups(ClientObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"groups", "timeout_ms", "key", NULL};
    PyObject *lists, *keyobj = Py_None;
    long long timeout_ms = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|LO", kwlist, &lists, &timeout_ms, &keyobj) ||
        !pshard_py_client_ok(self))
        return NULL;
    const char *key = NULL;
    if (keyobj != Py_None) {
        if (!PyUnicode_Check(keyobj))
            return PyErr_Format(PyExc_TypeError, "new_groups: key must be a str or None, not %s",
                                Py_TYPE(keyobj)->tp_name);
        Py_ssize_t keylen;
        key = PyUnicode_AsUTF8AndSize(keyobj, &keylen);
        if (!key)
            return NULL;
        if ((size_t)keylen != strlen(key))
            return PyErr_Format(PyExc_ValueError, "new_groups: key %R holds a NUL character",
                                keyobj);
    }
    int *ranks;
    size_t *sizes, n;
    if (pshard_py_rank_lists(lists, &ranks, &sizes, &n) != 0)
        return NULL;
    if (key && n != 1) {
        free(ranks);
        free(sizes);
        return PyErr_Format(PyExc_ValueError,
                            "new_groups: with a key, groups holds exactly one list of ranks, not "
                            "%zu",
                            n);
    }
    pshard_group_t **gs = calloc(n + 1, sizeof(*gs));
    if (!gs) {
        free(ranks);
        free(sizes);
        return PyErr_NoMemory();
    }
    pshard_status_t st;
    if (key) /* (the str keeps key's UTF-8 alive: keyobj is borrowed from args or kw) */
        CLIENT_CALL(self,
                    st = pshard_new_group_keyed(self->c, key, ranks, sizes[0], timeout_ms, gs));
    else
        CLIENT_CALL(self, st = pshard_new_groups(self->c, ranks, sizes, n, timeout_ms, gs));
    free(ranks);
    free(sizes);
    PyObject *res =
        st == PSHARD_OK ? pshard_py_groups_wrap(gs, n) : pshard_py_client_fail(self, st);
    free(gs);
    return res;
}
