/* pshard._C's process groups (pshard_groups.c): the Group type over a pshard_group_t, and the
 * helpers pshard_module.c's Client uses to make groups and to take a group argument. */
#ifndef PSHARD_PY_GROUPS_H
#define PSHARD_PY_GROUPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>

#include "pshard/pshard.h"

/* Readies the Group type and adds it to module m as "Group". Returns 0, or -1 with an
 * exception set. */
int pshard_py_groups_init(PyObject *m);

/* A PyArg "O&" converter for an optional group argument: None leaves *(const pshard_group_t **)
 * out NULL (the world), a Group gives its handle (borrowed: valid while the Group lives, which
 * the argument tuple ensures during the call). Anything else is a TypeError (returns 0). */
int pshard_py_group_arg(PyObject *o, void *out);

/* Reads a list of rank lists (ints) into malloc'd ranks (every group's ranks one after another)
 * and sizes (one per group), as pshard_new_groups takes them; their values are checked by
 * libpshard. Returns 0 (the caller frees both), or -1 with a TypeError set. */
int pshard_py_rank_lists(PyObject *lists, int **ranks, size_t **sizes, size_t *ngroups);

/* A list of n new Group objects owning handles gs[0..n) (every handle is freed on failure).
 * Returns a new reference, or NULL with an exception set. */
PyObject *pshard_py_groups_wrap(pshard_group_t **gs, size_t n);

#endif
