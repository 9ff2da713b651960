/* The MPI backend's compiled hot path: issue one nonblocking MPI call and poll it.
 *
 * Why: on a shared CPU, a small call's cost is the Python that runs for it. Through
 * mpi4py, one in-place all-reduce builds a buffer object, an argument list, a Request
 * object, then loops over Request.Test in Python; here it is one C call.
 *
 * What each function keeps of the fast path's rules: nothing blocks inside MPI. Each
 * issues the nonblocking form (MPI_Iallreduce, MPI_Ibcast, ...) and tests it for at most
 * ``spin`` seconds, with the GIL released after the first test. A request that
 * completed gives None (a receive: its source rank); one that did not gives the Work of
 * it, unregistered: an instance of the class ``set_work_classes`` named (a receive's: of
 * the second class, with an mpi4py Status as ``status``), a subclass of this module's
 * ``Work`` type, which holds the fields the hot path reads and writes (request, op,
 * group, spans, keep, engine, done, ...) in the object rather than in a dict. The
 * caller waits for it through its progress engine, with the engine's timeout and
 * diagnostics. ``spin`` < 0 returns the Work untested (async calls), which ``launch``
 * fills in and registers in one call, and whose ``wait`` is ``work_wait``. An MPI
 * error, at the issue or a poll, is not raised here: the call gives its Work, done,
 * with an ``MPIError`` of MPI's message as its ``error`` (``failed_work``), which its
 * wait raises as the engine raises a library's error (CommFailedError, the group marked
 * broken), whichever path issued it.
 *
 * Arguments: the fixed ones first (communicator, datatype and op handles as mpi4py's
 * ``.handle`` gives them; the root), so that the backend binds them once with
 * functools.partial, then ``spin``, then the call's own: addresses (ints, or objects
 * with the buffer protocol) and counts (the large-count MPI calls: any size). Handles
 * are only meaningful in the MPI library mpi4py loaded, so the module is built against
 * it (mcrdl_backends.build); the backend checks ``VERSION``, ``library_version`` and
 * ``world_handle`` against what it expects before it uses the module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <mpi.h>
#include <mpi4py/mpi4py.h> /* mpi4py's C API: Request objects from handles */
#include <limits.h>
#include <stdarg.h>
#include <string.h>
#include <time.h>

static PyObject *MPIError; /* raised with MPI's error string */

static PyObject *fail(int rc)
{
    char msg[MPI_MAX_ERROR_STRING + 1];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS)
        len = 0;
    msg[len] = '\0';
    PyErr_Format(MPIError, "MPI error %d: %s", rc, len ? msg : "(no description)");
    return NULL;
}

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* A communicator handle as a Python int, as mpi4py's ``.handle`` gives it (unsigned). */
static PyObject *comm_handle(MPI_Comm comm)
{
    if (sizeof(MPI_Comm) == sizeof(unsigned int))
        return PyLong_FromUnsignedLong((unsigned long)(unsigned int)(uintptr_t)comm);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)comm);
}

/* Test ``*req`` for at most ``spin`` seconds (< 0: not at all); *flag: completed. */
static int poll(MPI_Request *req, double spin, MPI_Status *st, int *flag)
{
    int rc;
    *flag = 0;
    if (spin < 0)
        return MPI_SUCCESS;
    rc = MPI_Test(req, flag, st);
    if (rc == MPI_SUCCESS && !*flag && spin > 0) {
        double deadline = now_ns() + spin * 1e9;
        Py_BEGIN_ALLOW_THREADS
        do {
            rc = MPI_Test(req, flag, st);
        } while (rc == MPI_SUCCESS && !*flag && now_ns() < deadline);
        Py_END_ALLOW_THREADS
    }
    return rc;
}

/* The Work base type: the fields the fast path reads and writes on every async call,
 * kept in the object itself, so that issuing, registering and waiting touch memory
 * instead of looking names up in a dict. The backend's Work classes of the fast path
 * derive from it and from its Python Work class (``class _FastWork(mpi_fast.Work,
 * MPIWork)``): Python code sees the fields as ordinary attributes (``w.done``,
 * ``w.req``, ...), everything else lives in the instance dict as before. */
typedef struct {
    PyObject_HEAD
    PyObject *req;        /* the mpi4py Request */
    PyObject *status;     /* a receive's mpi4py Status, else NULL (None) */
    PyObject *counts;     /* an uneven all-to-all's count arrays, which MPI reads */
    PyObject *op, *group, *spans, *keep, *engine, *finalizers, *error;
    char done;
} WorkObject;

static PyObject *s_empty; /* () */

static PyObject *work_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    WorkObject *w = (WorkObject *)type->tp_alloc(type, 0);
    if (w == NULL)
        return NULL;
    /* as Work.__init__ leaves them: no spans, nothing kept, no finalizers */
    Py_INCREF(s_empty);
    w->spans = s_empty;
    Py_INCREF(s_empty);
    w->keep = s_empty;
    Py_INCREF(s_empty);
    w->finalizers = s_empty;
    return (PyObject *)w;
}

static int work_traverse(WorkObject *w, visitproc visit, void *arg)
{
    Py_VISIT(w->req);
    Py_VISIT(w->status);
    Py_VISIT(w->counts);
    Py_VISIT(w->op);
    Py_VISIT(w->group);
    Py_VISIT(w->spans);
    Py_VISIT(w->keep);
    Py_VISIT(w->engine);
    Py_VISIT(w->finalizers);
    Py_VISIT(w->error);
    return 0;
}

static int work_clear(WorkObject *w)
{
    Py_CLEAR(w->req);
    Py_CLEAR(w->status);
    Py_CLEAR(w->counts);
    Py_CLEAR(w->op);
    Py_CLEAR(w->group);
    Py_CLEAR(w->spans);
    Py_CLEAR(w->keep);
    Py_CLEAR(w->engine);
    Py_CLEAR(w->finalizers);
    Py_CLEAR(w->error);
    return 0;
}

static void work_dealloc(WorkObject *w)
{
    PyObject_GC_UnTrack(w);
    work_clear(w);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

#define FIELD(name, doc) {#name, T_OBJECT, offsetof(WorkObject, name), 0, doc}
static PyMemberDef work_members[] = {
    FIELD(req, "the mpi4py Request"),
    FIELD(status, "a receive's mpi4py Status (None for other ops)"),
    FIELD(counts, "an uneven all-to-all's count arrays, kept while MPI reads them"),
    FIELD(op, "the Op"),
    FIELD(group, "the Group"),
    FIELD(spans, "((lo, hi, writes), ...): the memory the call reads and writes"),
    FIELD(keep, "what keeps that memory alive until completion"),
    FIELD(engine, "the progress engine it is registered with, or None"),
    FIELD(finalizers, "what runs at completion (a tuple or list)"),
    FIELD(error, "the error it failed with, or None"),
    {"done", T_BOOL, offsetof(WorkObject, done), 0, "whether it completed"},
    {NULL}};
#undef FIELD

static PyTypeObject WorkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpi_fast.Work",
    .tp_doc = "The fields of a fast-path MPI Work (a base of the backend's Work classes).",
    .tp_basicsize = sizeof(WorkObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = work_new,
    .tp_dealloc = (destructor)work_dealloc,
    .tp_traverse = (traverseproc)work_traverse,
    .tp_clear = (inquiry)work_clear,
    .tp_members = work_members,
};

#define WORK(o) ((WorkObject *)(o))

/* The classes of the Works made here (subclasses of Work), the set of the MPI Work
 * classes, the Python wait and launch (set_work_classes), and the count ``spins``
 * returns. */
static PyTypeObject *work_cls, *recv_work_cls;
static PyObject *work_types, *slow_wait, *slow_launch;
static unsigned long long spins;

/* The Work of the unfinished ``req``: an instance of ``cls`` with ``req`` as an mpi4py
 * Request and, for a receive, ``status``; for an uneven all-to-all, ``counts``. On an
 * error the request is leaked (MPI may still use its memory). */
static PyObject *new_work(PyTypeObject *cls, MPI_Request req, PyObject *status,
                          PyObject *counts)
{
    PyObject *w, *h;
    if (cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mpi_fast: call set_work_classes first");
        return NULL;
    }
    if ((h = PyMPIRequest_New(req)) == NULL)
        return NULL;
    if ((w = work_new(cls, NULL, NULL)) == NULL) {
        Py_DECREF(h);
        return NULL;
    }
    WORK(w)->req = h;
    Py_XINCREF(status);
    WORK(w)->status = status;
    Py_XINCREF(counts);
    WORK(w)->counts = counts;
    return w;
}

/* The Work of a call that MPI failed with ``rc``, when it was issued (``req`` is then
 * MPI_REQUEST_NULL) or polled: already done, with an MPIError of MPI's message as its
 * ``error``, so that the caller's wait (``work_wait``, then the Python one) raises what
 * the progress engine's wait raises for a library's error: CommFailedError, the group
 * marked broken. A library error is never raised from an issuer itself. */
static PyObject *failed_work(PyTypeObject *cls, MPI_Request req, PyObject *status,
                             PyObject *counts, int rc)
{
    PyObject *w, *et, *ev, *tb;
    fail(rc);
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    Py_XDECREF(et);
    Py_XDECREF(tb);
    if (ev == NULL)
        return NULL;
    if ((w = new_work(cls, req, status, counts)) == NULL) {
        Py_DECREF(ev);
        return NULL;
    }
    WORK(w)->error = ev; /* (the reference fetched) */
    WORK(w)->done = 1;
    return w;
}

/* After an issue that returned ``rc``: None if ``req`` completes within ``spin``
 * seconds, else its Work (a failed one if MPI failed the call: ``failed_work``). */
static PyObject *finish(int rc, MPI_Request req, double spin)
{
    int flag;
    if (rc != MPI_SUCCESS)
        return failed_work(work_cls, MPI_REQUEST_NULL, NULL, NULL, rc);
    rc = poll(&req, spin, MPI_STATUS_IGNORE, &flag);
    if (rc != MPI_SUCCESS)
        return failed_work(work_cls, req, NULL, NULL, rc);
    if (flag)
        Py_RETURN_NONE;
    return new_work(work_cls, req, NULL, NULL);
}

/* set_work_classes(work, recv_work, mpi_work_types, slow_wait, slow_launch): the
 * classes of the Works the calls return (subclasses of ``Work``); those ``work_wait``
 * spins for while all in flight are of them (a frozenset); the wait it leaves the rest
 * to; what ``launch`` hands a request that is not a ``Work`` (the Python issuers'):
 * ``slow_launch(op, group, req, spans, keep, engine)``, which registers its Work. */
static PyObject *set_work_classes(PyObject *self, PyObject *args)
{
    PyTypeObject *w, *r;
    PyObject *types, *slow, *launch;
    if (!PyArg_ParseTuple(args, "O!O!O!OO", &PyType_Type, &w, &PyType_Type, &r,
                          &PyFrozenSet_Type, &types, &slow, &launch))
        return NULL;
    if (!PyType_IsSubtype(w, &WorkType) || !PyType_IsSubtype(r, &WorkType)) {
        PyErr_SetString(PyExc_TypeError, "mpi_fast: the Work classes must derive from mpi_fast.Work");
        return NULL;
    }
    Py_INCREF(w);
    Py_INCREF(r);
    Py_INCREF(types);
    Py_INCREF(slow);
    Py_INCREF(launch);
    Py_XSETREF(work_cls, w);
    Py_XSETREF(recv_work_cls, r);
    Py_XSETREF(work_types, types);
    Py_XSETREF(slow_wait, slow);
    Py_XSETREF(slow_launch, launch);
    Py_RETURN_NONE;
}

/* The issuers' argument parser (they are METH_FASTCALL: called through
 * functools.partial with no argument tuple made): ``nargs`` positional arguments by
 * ``fmt``, a subset of PyArg_ParseTuple's units with the same conversions: K (unsigned
 * long long, masked), d (double), n (Py_ssize_t), i (int), p (truth), O (borrowed
 * object), O& (converter, output). 0 with an error raised if one does not convert. */
static int parse(PyObject *const *args, Py_ssize_t nargs, const char *fmt, ...)
{
    va_list va;
    Py_ssize_t i = 0, want = 0;
    const char *f;
    int ok = 1;
    for (f = fmt; *f; f++)
        if (*f != '&')
            want++;
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "mpi_fast: %zd arguments given, %zd expected", nargs, want);
        return 0;
    }
    va_start(va, fmt);
    for (f = fmt; ok && *f; f++, i++) {
        PyObject *o = args[i];
        switch (*f) {
        case 'K': {
            unsigned long long v = PyLong_Check(o) ? PyLong_AsUnsignedLongLongMask(o) : 0;
            if (!PyLong_Check(o)) {
                PyErr_SetString(PyExc_TypeError, "mpi_fast: a handle must be an int");
                ok = 0;
            } else if (v == (unsigned long long)-1 && PyErr_Occurred()) {
                ok = 0;
            }
            *va_arg(va, unsigned long long *) = v;
            break;
        }
        case 'd': {
            double v = PyFloat_AsDouble(o);
            ok = !(v == -1.0 && PyErr_Occurred());
            *va_arg(va, double *) = v;
            break;
        }
        case 'n': {
            Py_ssize_t v = PyNumber_AsSsize_t(o, PyExc_OverflowError);
            ok = !(v == -1 && PyErr_Occurred());
            *va_arg(va, Py_ssize_t *) = v;
            break;
        }
        case 'i': {
            long v = PyLong_AsLong(o);
            if (v == -1 && PyErr_Occurred()) {
                ok = 0;
            } else if (v > INT_MAX || v < INT_MIN) {
                PyErr_SetString(PyExc_OverflowError, "mpi_fast: an int argument out of range");
                ok = 0;
            }
            *va_arg(va, int *) = (int)v;
            break;
        }
        case 'p': {
            int v = PyObject_IsTrue(o);
            ok = v >= 0;
            *va_arg(va, int *) = v;
            break;
        }
        case 'O':
            if (f[1] == '&') {
                int (*conv)(PyObject *, void *) = va_arg(va, int (*)(PyObject *, void *));
                void *out = va_arg(va, void *);
                ok = conv(o, out);
                f++;
            } else {
                *va_arg(va, PyObject **) = o;
            }
            break;
        default:
            PyErr_Format(PyExc_SystemError, "mpi_fast: format unit '%c'", *f);
            ok = 0;
        }
    }
    va_end(va);
    return ok;
}

/* "O&" converter: a peer rank, or None for any source */
static int peer(PyObject *o, void *out)
{
    long r;
    if (o == Py_None) {
        *(int *)out = MPI_ANY_SOURCE;
        return 1;
    }
    r = PyLong_AsLong(o);
    if (r == -1 && PyErr_Occurred())
        return 0;
    *(int *)out = (int)r;
    return 1;
}

/* "O&" converter: an address (int) or an object with the buffer protocol (its memory
 * must be contiguous; the caller keeps the object alive while the request runs). */
static int address(PyObject *o, void *out)
{
    Py_buffer view;
    if (PyLong_Check(o)) {
        *(void **)out = PyLong_AsVoidPtr(o);
        return !PyErr_Occurred();
    }
    if (PyObject_GetBuffer(o, &view, PyBUF_ANY_CONTIGUOUS) < 0)
        return 0;
    *(void **)out = view.buf;
    PyBuffer_Release(&view);
    return 1;
}
#define COMM(h) ((MPI_Comm)(uintptr_t)(h))
#define TYPE(h) ((MPI_Datatype)(uintptr_t)(h))
#define OP(h) ((MPI_Op)(uintptr_t)(h))
typedef unsigned long long handle_t; /* parsed with "K" */

/* allreduce(comm, dtype, op, spin, ptr, count): in place */
static PyObject *allreduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double spin;
    void *ptr;
    handle_t comm, dtype, op;
    Py_ssize_t count;
    int rc;
    MPI_Request req;
    if (!parse(args, nargs, "KKKdO&n", &comm, &dtype, &op, &spin, address, &ptr, &count))
        return NULL;
    rc = MPI_Iallreduce_c(MPI_IN_PLACE, count ? ptr : NULL, (MPI_Count)count, TYPE(dtype), OP(op),
                        COMM(comm), &req);
    return finish(rc, req, spin);
}

/* bcast(comm, dtype, root, spin, ptr, count) */
static PyObject *bcast(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double spin;
    void *ptr;
    handle_t comm, dtype;
    Py_ssize_t count;
    int root, rc;
    MPI_Request req;
    if (!parse(args, nargs, "KKidO&n", &comm, &dtype, &root, &spin, address, &ptr, &count))
        return NULL;
    rc = MPI_Ibcast_c(count ? ptr : NULL, (MPI_Count)count, TYPE(dtype), root, COMM(comm), &req);
    return finish(rc, req, spin);
}

/* reduce(comm, dtype, op, root, is_root, spin, ptr, count): in place at the root */
static PyObject *reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double spin;
    void *ptr, *mem;
    handle_t comm, dtype, op;
    Py_ssize_t count;
    int root, is_root, rc;
    MPI_Request req;
    if (!parse(args, nargs, "KKKipdO&n", &comm, &dtype, &op, &root, &is_root, &spin,
                          address, &ptr, &count))
        return NULL;
    mem = count ? ptr : NULL;
    rc = MPI_Ireduce_c(is_root ? MPI_IN_PLACE : mem, is_root ? mem : NULL, (MPI_Count)count,
                       TYPE(dtype), OP(op), root, COMM(comm), &req);
    return finish(rc, req, spin);
}

/* The all-gather and the all-to-all: one block of ``count`` elements per rank, the
 * same signature in MPI */
typedef int (*exchange_fn)(const void *, MPI_Count, MPI_Datatype, void *, MPI_Count,
                           MPI_Datatype, MPI_Comm, MPI_Request *);

static PyObject *exchange(PyObject *const *args, Py_ssize_t nargs, exchange_fn fn)
{
    double spin;
    void *out, *inp;
    handle_t comm, dtype;
    Py_ssize_t count;
    int rc;
    MPI_Request req;
    if (!parse(args, nargs, "KKdO&O&n", &comm, &dtype, &spin, address, &out, address, &inp,
                          &count))
        return NULL;
    rc = fn(count ? inp : NULL, (MPI_Count)count, TYPE(dtype), count ? out : NULL,
            (MPI_Count)count, TYPE(dtype), COMM(comm), &req);
    return finish(rc, req, spin);
}

/* --- list forms: blocks staged in a temporary ------------------------------------------
 * One side of a list form's memory (the blocks of a list all_gather's, a gather's or a
 * list all_to_all's output; of a list reduce_scatter's, a scatter's or a list
 * all_to_all's input) comes as a tuple of block addresses where it cannot go to MPI as
 * it is (not one run in order, or sharing memory with the other side): it is staged in
 * a temporary (a bytes object) as the general path stages it (api.py): an input packed
 * before the issue, an output copied into its blocks once the request completes, at
 * once where that was within the spin, else by the Work's finalizer (an ``unpack``
 * callable, which Work.complete runs). The MPI call is the general path's, so a rank on
 * either path meets the other. */

/* The ``i``-th address of the tuple ``blocks`` (-1 on an error, raised). */
static int block_at(PyObject *blocks, Py_ssize_t i, char **out)
{
    PyObject *o = PyTuple_GET_ITEM(blocks, i);
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "mpi_fast: a block address must be an int");
        return -1;
    }
    *out = (char *)PyLong_AsVoidPtr(o);
    return PyErr_Occurred() ? -1 : 0;
}

/* The size in bytes of block ``i``: ``sizes`` is an int (every block's) or a tuple. */
static Py_ssize_t block_size(PyObject *sizes, Py_ssize_t i)
{
    return PyLong_AsSsize_t(PyTuple_Check(sizes) ? PyTuple_GET_ITEM(sizes, i) : sizes);
}

/* Copy between the blocks and the temporary ``tmp`` (its bytes in block order): into
 * the temporary (``in``) or out of it. 0, or -1 with an error raised. */
static int copy_blocks(PyObject *tmp, PyObject *blocks, PyObject *sizes, int in)
{
    char *t = PyBytes_AS_STRING(tmp), *b;
    Py_ssize_t i, sz, off = 0, total = PyBytes_GET_SIZE(tmp);
    for (i = 0; i < PyTuple_GET_SIZE(blocks); i++) {
        if ((sz = block_size(sizes, i)) < 0 || sz > total - off) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "mpi_fast: blocks past their temporary");
            return -1;
        }
        if (sz) {
            if (block_at(blocks, i, &b) < 0)
                return -1;
            if (in)
                memcpy(t + off, b, (size_t)sz);
            else
                memmove(b, t + off, (size_t)sz);
        }
        off += sz;
    }
    return 0;
}

/* A new temporary of ``total`` bytes holding the blocks packed (NULL on an error). */
static PyObject *pack(PyObject *blocks, PyObject *sizes, Py_ssize_t total)
{
    PyObject *tmp = PyBytes_FromStringAndSize(NULL, total);
    if (tmp != NULL && copy_blocks(tmp, blocks, sizes, 1) < 0)
        Py_CLEAR(tmp);
    return tmp;
}

/* unpack(): the staged output into its blocks; self = (tmp, blocks, sizes) */
static PyObject *unpack_call(PyObject *self, PyObject *unused)
{
    if (copy_blocks(PyTuple_GET_ITEM(self, 0), PyTuple_GET_ITEM(self, 1),
                    PyTuple_GET_ITEM(self, 2), 0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef unpack_def = {"unpack", unpack_call, METH_NOARGS,
                                 "unpack(): copy a staged output into its blocks"};

/* The ``unpack`` of a temporary (a new reference, or NULL). */
static PyObject *unpacker(PyObject *tmp, PyObject *blocks, PyObject *sizes)
{
    PyObject *self = PyTuple_Pack(3, tmp, blocks, sizes), *f;
    if (self == NULL)
        return NULL;
    f = PyCFunction_New(&unpack_def, self);
    Py_DECREF(self);
    return f;
}

/* After the issue of a list form that returned ``rc``: None if the request completed
 * within ``spin`` (``unpack``, if any, run), else its Work, which keeps ``keep`` (the
 * temporaries, the counts MPI reads) until it completes and runs ``unpack`` then
 * (``finalizers``); a failed one as ``finish``'s. Borrows its arguments. */
static PyObject *finish_staged(int rc, MPI_Request req, double spin, PyObject *unpack,
                               PyObject *keep)
{
    int flag;
    PyObject *w, *r;
    if (rc != MPI_SUCCESS)
        return failed_work(work_cls, MPI_REQUEST_NULL, NULL, NULL, rc);
    rc = poll(&req, spin, MPI_STATUS_IGNORE, &flag);
    if (rc != MPI_SUCCESS)
        return failed_work(work_cls, req, NULL, keep, rc);
    if (flag) {
        if (unpack == NULL)
            Py_RETURN_NONE;
        if ((r = PyObject_CallNoArgs(unpack)) == NULL)
            return NULL;
        Py_DECREF(r);
        Py_RETURN_NONE;
    }
    if ((w = new_work(work_cls, req, NULL, keep)) == NULL)
        return NULL;
    if (unpack != NULL) {
        PyObject *fins = PyTuple_Pack(1, unpack);
        if (fins == NULL) {
            Py_DECREF(w);
            return NULL;
        }
        Py_XSETREF(WORK(w)->finalizers, fins);
    }
    return w;
}

/* The staging of one side of ``n`` blocks of ``count`` elements of ``isz`` bytes: a new
 * temporary (packed where ``in``) and, for an output, its ``unpack``. 0, or -1. */
static int stage_even(PyObject *blocks, Py_ssize_t n, Py_ssize_t count, int isz, int in,
                      PyObject **tmp, PyObject **unpack)
{
    PyObject *sizes;
    if (PyTuple_GET_SIZE(blocks) != n) {
        PyErr_SetString(PyExc_ValueError, "mpi_fast: one block per rank of the group");
        return -1;
    }
    if ((sizes = PyLong_FromSsize_t(count * isz)) == NULL)
        return -1;
    *tmp = in ? pack(blocks, sizes, n * count * isz)
              : PyBytes_FromStringAndSize(NULL, n * count * isz);
    if (*tmp != NULL && !in && (*unpack = unpacker(*tmp, blocks, sizes)) == NULL)
        Py_CLEAR(*tmp);
    Py_DECREF(sizes);
    return *tmp == NULL ? -1 : 0;
}

/* The group size and the datatype's size (0 on an MPI error: the caller refuses). */
static int sizes_of(handle_t comm, handle_t dtype, int *n, int *isz)
{
    return MPI_Comm_size(COMM(comm), n) == MPI_SUCCESS
           && MPI_Type_size(TYPE(dtype), isz) == MPI_SUCCESS;
}

/* allgather(comm, dtype, spin, out, inp, count): count per rank; ``out`` an address,
 * or a tuple of the group's block addresses (staged: the list form) */
static PyObject *allgather(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double spin;
    void *out = NULL, *inp;
    handle_t comm, dtype;
    Py_ssize_t count;
    int rc, n, isz;
    PyObject *o, *tmp = NULL, *un = NULL, *res;
    MPI_Request req;
    if (!parse(args, nargs, "KKdOO&n", &comm, &dtype, &spin, &o, address, &inp, &count))
        return NULL;
    if (!PyTuple_Check(o)) {
        if (!address(o, &out))
            return NULL;
        rc = MPI_Iallgather_c(count ? inp : NULL, (MPI_Count)count, TYPE(dtype),
                              count ? out : NULL, (MPI_Count)count, TYPE(dtype), COMM(comm),
                              &req);
        return finish(rc, req, spin);
    }
    if (!sizes_of(comm, dtype, &n, &isz))
        Py_RETURN_FALSE;
    if (stage_even(o, n, count, isz, 0, &tmp, &un) < 0)
        return NULL;
    rc = MPI_Iallgather_c(count ? inp : NULL, (MPI_Count)count, TYPE(dtype),
                          count ? PyBytes_AS_STRING(tmp) : NULL, (MPI_Count)count, TYPE(dtype),
                          COMM(comm), &req);
    res = finish_staged(rc, req, spin, un, tmp);
    Py_DECREF(tmp);
    Py_DECREF(un);
    return res;
}

/* reduce_scatter(comm, dtype, op, spin, out, inp, count): count per rank; ``inp`` an
 * address, or a tuple of the group's block addresses (packed: the list form) */
static PyObject *reduce_scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double spin;
    void *out, *inp = NULL;
    handle_t comm, dtype, op;
    Py_ssize_t count;
    int rc, n, isz;
    PyObject *o, *tmp = NULL, *res;
    MPI_Request req;
    if (!parse(args, nargs, "KKKdO&On", &comm, &dtype, &op, &spin, address, &out, &o, &count))
        return NULL;
    if (!PyTuple_Check(o)) {
        if (!address(o, &inp))
            return NULL;
        rc = MPI_Ireduce_scatter_block_c(count ? inp : NULL, count ? out : NULL,
                                         (MPI_Count)count, TYPE(dtype), OP(op), COMM(comm),
                                         &req);
        return finish(rc, req, spin);
    }
    if (!sizes_of(comm, dtype, &n, &isz))
        Py_RETURN_FALSE;
    if (stage_even(o, n, count, isz, 1, &tmp, NULL) < 0)
        return NULL;
    rc = MPI_Ireduce_scatter_block_c(count ? PyBytes_AS_STRING(tmp) : NULL, count ? out : NULL,
                                     (MPI_Count)count, TYPE(dtype), OP(op), COMM(comm), &req);
    res = finish_staged(rc, req, spin, NULL, tmp);
    Py_DECREF(tmp);
    return res;
}

/* gather(comm, dtype, root, is_root, spin, out, inp, count): count per rank; at the
 * root ``out`` is an address or a tuple of the group's block addresses (staged),
 * elsewhere ignored */
static PyObject *gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double spin;
    void *out = NULL, *inp;
    handle_t comm, dtype;
    Py_ssize_t count;
    int root, is_root, rc, n, isz;
    PyObject *o, *tmp = NULL, *un = NULL, *res;
    MPI_Request req;
    if (!parse(args, nargs, "KKipdOO&n", &comm, &dtype, &root, &is_root, &spin, &o, address,
               &inp, &count))
        return NULL;
    if (is_root && PyTuple_Check(o)) {
        if (!sizes_of(comm, dtype, &n, &isz))
            Py_RETURN_FALSE;
        if (stage_even(o, n, count, isz, 0, &tmp, &un) < 0)
            return NULL;
        out = PyBytes_AS_STRING(tmp);
    } else if (is_root && !address(o, &out)) {
        return NULL;
    }
    rc = MPI_Igather_c(count ? inp : NULL, (MPI_Count)count, TYPE(dtype),
                       is_root && count ? out : NULL, (MPI_Count)count, TYPE(dtype), root,
                       COMM(comm), &req);
    if (tmp == NULL)
        return finish(rc, req, spin);
    res = finish_staged(rc, req, spin, un, tmp);
    Py_DECREF(tmp);
    Py_DECREF(un);
    return res;
}

/* scatter(comm, dtype, root, is_root, spin, out, inp, count): count per rank; at the
 * root ``inp`` is an address or a tuple of the group's block addresses (packed),
 * elsewhere ignored */
static PyObject *scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double spin;
    void *out, *inp = NULL;
    handle_t comm, dtype;
    Py_ssize_t count;
    int root, is_root, rc, n, isz;
    PyObject *o, *tmp = NULL, *res;
    MPI_Request req;
    if (!parse(args, nargs, "KKipdO&On", &comm, &dtype, &root, &is_root, &spin, address, &out,
               &o, &count))
        return NULL;
    if (is_root && PyTuple_Check(o)) {
        if (!sizes_of(comm, dtype, &n, &isz))
            Py_RETURN_FALSE;
        if (stage_even(o, n, count, isz, 1, &tmp, NULL) < 0)
            return NULL;
        inp = PyBytes_AS_STRING(tmp);
    } else if (is_root && !address(o, &inp)) {
        return NULL;
    }
    rc = MPI_Iscatter_c(is_root && count ? inp : NULL, (MPI_Count)count, TYPE(dtype),
                        count ? out : NULL, (MPI_Count)count, TYPE(dtype), root, COMM(comm),
                        &req);
    if (tmp == NULL)
        return finish(rc, req, spin);
    res = finish_staged(rc, req, spin, NULL, tmp);
    Py_DECREF(tmp);
    return res;
}

/* One side of a list all-to-all: element counts from ``counts`` (a tuple of n ints >= 0)
 * and where its blocks lie. 1: MPI can address them as they are, from ``*base`` with
 * ``displs`` in elements (every non-empty block on an element boundary from the
 * lowest, and for an output (``ordered``) in list order without overlaps); 0: they
 * must be staged (``displs`` left to the caller); -1: an error (raised), or counts of
 * another kind (``*bad`` set, nothing raised). ``*lo``/``*hi``: the span of the
 * non-empty blocks (equal where there are none). */
static int side_of(PyObject *blocks, PyObject *counts, int n, int isz, int ordered,
                   MPI_Count *cnt, MPI_Aint *displs, char **base, char **lo, char **hi,
                   int *bad)
{
    Py_ssize_t i, c;
    char *a, *prev = NULL;
    int fits = 1;
    *lo = *hi = NULL;
    if (!PyTuple_Check(blocks) || !PyTuple_Check(counts) || PyTuple_GET_SIZE(blocks) != n
        || PyTuple_GET_SIZE(counts) != n) {
        *bad = 1;
        return -1;
    }
    for (i = 0; i < n; i++) {
        c = PyLong_Check(PyTuple_GET_ITEM(counts, i)) ? PyLong_AsSsize_t(PyTuple_GET_ITEM(counts, i)) : -1;
        if (c < 0) {
            PyErr_Clear();
            *bad = 1;
            return -1;
        }
        cnt[i] = (MPI_Count)c;
        if (!c)
            continue;
        if (block_at(blocks, i, &a) < 0)
            return -1;
        if (ordered && prev != NULL && a < prev)
            fits = 0;
        prev = a + c * isz;
        if (*lo == NULL || a < *lo)
            *lo = a;
        if (a + c * isz > *hi)
            *hi = a + c * isz;
    }
    for (i = 0; fits && i < n; i++) {
        displs[i] = 0;
        if (cnt[i]) {
            block_at(blocks, i, &a);
            if ((a - *lo) % isz)
                fits = 0;
            displs[i] = (MPI_Aint)((a - *lo) / isz);
        }
    }
    *base = *lo;
    return fits;
}

/* Displacements of consecutive blocks; the side's total bytes, and its sizes tuple in
 * bytes (a new reference) in ``*sizes``. -1 on an error. */
static Py_ssize_t packed(const MPI_Count *cnt, int n, int isz, MPI_Aint *displs,
                         PyObject **sizes)
{
    Py_ssize_t total = 0;
    int i;
    if ((*sizes = PyTuple_New(n)) == NULL)
        return -1;
    for (i = 0; i < n; i++) {
        PyObject *s = PyLong_FromSsize_t((Py_ssize_t)cnt[i] * isz);
        if (s == NULL) {
            Py_CLEAR(*sizes);
            return -1;
        }
        PyTuple_SET_ITEM(*sizes, i, s);
        displs[i] = (MPI_Aint)(total / isz);
        total += (Py_ssize_t)cnt[i] * isz;
    }
    return total;
}

/* alltoall_list(comm, dtype, n, me, spin, outs, out_counts, ins, in_counts): the list
 * all-to-all (``MPI_Ialltoallv``, as the general path issues it on its packed
 * temporaries): ``outs``/``ins`` the tuples of the n blocks' addresses, ``*_counts``
 * their element counts. Each side goes to MPI where it is (displacements from its
 * lowest block) where it can (``side_of``; an input only apart from the outputs), else
 * staged. False, with nothing sent, where counts are not n ints >= 0 or this rank's
 * own block differs between the two sides (the general path raises its error). */
static PyObject *alltoall_list(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double spin;
    handle_t comm, dtype;
    int n, me, rc, isz, bad = 0, direct_out, direct_in;
    PyObject *outs, *ocs, *ins, *ics, *counts, *tmp_out = NULL, *tmp_in = NULL, *un = NULL,
                                                  *sizes = NULL, *keep = NULL, *res = NULL;
    MPI_Count *oc, *ic;
    MPI_Aint *od, *id;
    char *obase, *ibase, *olo, *ohi, *ilo, *ihi;
    Py_ssize_t total;
    MPI_Request req;
    if (!parse(args, nargs, "KKiidOOOO", &comm, &dtype, &n, &me, &spin, &outs, &ocs, &ins, &ics))
        return NULL;
    if (n <= 0 || me < 0 || me >= n || MPI_Type_size(TYPE(dtype), &isz) != MPI_SUCCESS || isz <= 0)
        Py_RETURN_FALSE;
    counts = PyBytes_FromStringAndSize(NULL, 2 * (Py_ssize_t)n * (sizeof(MPI_Count) + sizeof(MPI_Aint)));
    if (counts == NULL)
        return NULL;
    oc = (MPI_Count *)PyBytes_AS_STRING(counts);
    ic = oc + n;
    od = (MPI_Aint *)(ic + n);
    id = od + n;
    direct_out = side_of(outs, ocs, n, isz, 1, oc, od, &obase, &olo, &ohi, &bad);
    if (direct_out < 0)
        goto refuse;
    direct_in = side_of(ins, ics, n, isz, 0, ic, id, &ibase, &ilo, &ihi, &bad);
    if (direct_in < 0)
        goto refuse;
    if (oc[me] != ic[me]) {
        bad = 1;
        goto refuse;
    }
    if (!direct_out) { /* staged: received packed, copied into the blocks at completion */
        if ((total = packed(oc, n, isz, od, &sizes)) < 0
            || (tmp_out = PyBytes_FromStringAndSize(NULL, total)) == NULL
            || (un = unpacker(tmp_out, outs, sizes)) == NULL)
            goto end;
        obase = PyBytes_AS_STRING(tmp_out);
        Py_CLEAR(sizes);
    } else if (direct_in && ilo < ihi && ilo < ohi && olo < ihi) {
        direct_in = 0; /* the inputs share memory with the outputs: MPI must not read there */
    }
    if (!direct_in) {
        if ((total = packed(ic, n, isz, id, &sizes)) < 0
            || (tmp_in = pack(ins, sizes, total)) == NULL)
            goto end;
        ibase = PyBytes_AS_STRING(tmp_in);
    }
    if ((keep = PyTuple_Pack(3, counts, tmp_out ? tmp_out : Py_None, tmp_in ? tmp_in : Py_None)) == NULL)
        goto end;
    rc = MPI_Ialltoallv_c(ibase, ic, id, TYPE(dtype), obase, oc, od, TYPE(dtype), COMM(comm), &req);
    res = finish_staged(rc, req, spin, un, keep);
    goto end;
refuse:
    if (!bad)
        goto end;
    Py_INCREF(Py_False);
    res = Py_False;
end:
    Py_DECREF(counts);
    Py_XDECREF(tmp_out);
    Py_XDECREF(tmp_in);
    Py_XDECREF(un);
    Py_XDECREF(sizes);
    Py_XDECREF(keep);
    return res;
}

/* alltoall(comm, dtype, spin, out, inp, count): count per peer */
static PyObject *alltoall(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return exchange(args, nargs, MPI_Ialltoall_c);
}

/* One side of an uneven all-to-all: element counts and displacements per peer from
 * ``splits`` (a list or tuple of n row counts that add up to ``rows``; a row is count /
 * rows elements) or, for None, ``rows`` split evenly. 1: they fit; 0: they do not, or
 * the splits are of another kind (nothing raised: the caller's general path judges the
 * call). The splits are copied into a tuple first, so that an item's __index__ cannot
 * change them while they are read. */
static int side(PyObject *splits, Py_ssize_t count, Py_ssize_t rows, int n, MPI_Count *counts,
                MPI_Aint *displs)
{
    Py_ssize_t per_row = rows ? count / rows : 0, total = 0, s, i;
    PyObject *seq, **items;
    if (splits == Py_None) {
        if (rows % n)
            return 0;
        for (i = 0; i < n; i++) {
            counts[i] = (MPI_Count)(count / n);
            displs[i] = (MPI_Aint)(i * (count / n));
        }
        return 1;
    }
    if (!PyList_Check(splits) && !PyTuple_Check(splits))
        return 0;
    seq = PySequence_Tuple(splits);
    if (seq == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (PyTuple_GET_SIZE(seq) != n) {
        Py_DECREF(seq);
        return 0;
    }
    items = PySequence_Fast_ITEMS(seq);
    for (i = 0; i < n; i++) {
        s = PyNumber_AsSsize_t(items[i], NULL);
        if (s < 0 || s > rows - total) { /* negative, not an int, or past the rows */
            PyErr_Clear();
            Py_DECREF(seq);
            return 0;
        }
        counts[i] = (MPI_Count)(s * per_row);
        displs[i] = (MPI_Aint)(total * per_row);
        total += s;
    }
    Py_DECREF(seq);
    return total == rows;
}

/* alltoallv(comm, dtype, n, me, spin, out, out_count, out_rows, inp, in_count, in_rows,
 * out_splits, in_splits): ``all_to_all_single`` by split sizes along dim 0 (None: even on
 * that side). False, with nothing sent, if the splits do not fit (see ``side``) or this
 * rank's own block differs in size between them; else None if it completed within
 * ``spin``, or its Work, with the counts' memory, which MPI reads until the request
 * completes, as ``counts``. */
static PyObject *alltoallv(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double spin;
    void *out, *inp;
    handle_t comm, dtype;
    Py_ssize_t out_count, out_rows, in_count, in_rows;
    int n, me, rc, flag;
    PyObject *out_splits, *in_splits, *keep, *w;
    MPI_Count *oc, *ic;
    MPI_Aint *od, *id;
    MPI_Request req;
    if (!parse(args, nargs, "KKiidO&nnO&nnOO", &comm, &dtype, &n, &me, &spin, address, &out,
                          &out_count, &out_rows, address, &inp, &in_count, &in_rows, &out_splits,
                          &in_splits))
        return NULL;
    if (n <= 0 || me < 0 || me >= n || out_rows < 0 || in_rows < 0)
        Py_RETURN_FALSE;
    keep = PyBytes_FromStringAndSize(NULL, 2 * (Py_ssize_t)n * (sizeof(MPI_Count) + sizeof(MPI_Aint)));
    if (keep == NULL)
        return NULL;
    oc = (MPI_Count *)PyBytes_AS_STRING(keep);
    ic = oc + n;
    od = (MPI_Aint *)(ic + n);
    id = od + n;
    if (!side(out_splits, out_count, out_rows, n, oc, od)
        || !side(in_splits, in_count, in_rows, n, ic, id) || oc[me] != ic[me]) {
        Py_DECREF(keep);
        Py_RETURN_FALSE;
    }
    rc = MPI_Ialltoallv_c(in_count ? inp : NULL, ic, id, TYPE(dtype), out_count ? out : NULL, oc,
                          od, TYPE(dtype), COMM(comm), &req);
    if (rc != MPI_SUCCESS) {
        Py_DECREF(keep);
        return failed_work(work_cls, MPI_REQUEST_NULL, NULL, NULL, rc);
    }
    rc = poll(&req, spin, MPI_STATUS_IGNORE, &flag);
    if (rc == MPI_SUCCESS && flag) {
        Py_DECREF(keep);
        Py_RETURN_NONE;
    }
    /* from here on MPI may still read the counts: on an error (out of memory) they are
     * leaked, not freed */
    w = rc == MPI_SUCCESS ? new_work(work_cls, req, NULL, keep)
                          : failed_work(work_cls, req, NULL, keep, rc);
    if (w != NULL)
        Py_DECREF(keep);
    return w;
}

/* send(comm, dtype, spin, ptr, count, peer, tag) */
static PyObject *send(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double spin;
    void *ptr;
    handle_t comm, dtype;
    Py_ssize_t count;
    int peer, tag, rc;
    MPI_Request req;
    if (!parse(args, nargs, "KKdO&nii", &comm, &dtype, &spin, address, &ptr, &count, &peer,
                          &tag))
        return NULL;
    rc = MPI_Isend_c(count ? ptr : NULL, (MPI_Count)count, TYPE(dtype), peer, tag, COMM(comm),
                     &req);
    return finish(rc, req, spin);
}

/* recv(comm, dtype, spin, ptr, count, peer, tag), peer None: any source. Returns the
 * source rank if the receive completed within ``spin``, else its Work, with a Status. */
static PyObject *recv(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double spin;
    void *ptr;
    handle_t comm, dtype;
    Py_ssize_t count;
    int src, tag, rc, flag;
    MPI_Request req;
    MPI_Status st;
    PyObject *status, *w;
    if (!parse(args, nargs, "KKdO&nO&i", &comm, &dtype, &spin, address, &ptr, &count, peer,
                          &src, &tag))
        return NULL;
    rc = MPI_Irecv_c(count ? ptr : NULL, (MPI_Count)count, TYPE(dtype), src, tag, COMM(comm),
                     &req);
    if (rc == MPI_SUCCESS) {
        rc = poll(&req, spin, &st, &flag);
        if (rc == MPI_SUCCESS && flag)
            return PyLong_FromLong(st.MPI_SOURCE);
    } else {
        req = MPI_REQUEST_NULL;
    }
    memset(&st, 0, sizeof st);
    if ((status = PyMPIStatus_New(&st)) == NULL)
        return NULL;
    w = rc == MPI_SUCCESS ? new_work(recv_work_cls, req, status, NULL)
                          : failed_work(recv_work_cls, req, status, NULL, rc);
    Py_DECREF(status);
    return w;
}

/* barrier(comm, spin) */
static PyObject *barrier(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double spin;
    handle_t comm;
    int rc;
    MPI_Request req;
    if (!parse(args, nargs, "Kd", &comm, &spin))
        return NULL;
    rc = MPI_Ibarrier(COMM(comm), &req);
    return finish(rc, req, spin);
}

/* Names the wait reads on the engine and calls, interned once (at import). */
static PyObject *s_pending, *s_inflight, *s_poll_lock, *s_spin_s, *s_complete, *s_acquire,
    *s_release;

/* Whether ``o``'s attribute ``name`` is true (-1: error). */
static int attr_true(PyObject *o, PyObject *name)
{
    int t;
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* Spin on the request of ``w`` (an async fast-path Work, registered with engine ``eng``)
 * under the engine's poll_lock, and finish it if it completed. Returns 1 if it did, 2 if
 * it spun and the request is not done, 0 if the lock was busy, -1 on an error (raised). */
static int spin_and_finish(WorkObject *w, PyObject *eng, PyObject *inflight)
{
    PyObject *lock, *o;
    MPI_Request *r;
    MPI_Status *st = MPI_STATUS_IGNORE;
    double spin;
    int flag = 0, rc, got, out = -1;
    Py_ssize_t i;

    lock = PyObject_GetAttr(eng, s_poll_lock);
    if (lock == NULL)
        return -1;
    o = PyObject_CallMethodOneArg(lock, s_acquire, Py_False);
    if (o == NULL) {
        Py_DECREF(lock);
        return -1;
    }
    got = o == Py_True;
    Py_DECREF(o);
    if (!got) {
        Py_DECREF(lock);
        return 0;
    }
    /* under the lock: another thread may have finished it meanwhile */
    if (w->done) {
        out = 1;
        goto release;
    }
    if ((o = PyObject_GetAttr(eng, s_spin_s)) == NULL)
        goto release;
    spin = PyFloat_AsDouble(o);
    Py_DECREF(o);
    if (spin == -1.0 && PyErr_Occurred())
        goto release;
    if (w->req == NULL || (r = PyMPIRequest_Get(w->req)) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "mpi_fast: a Work without a request");
        goto release;
    }
    if (w->status != NULL && w->status != Py_None && (st = PyMPIStatus_Get(w->status)) == NULL)
        goto release;
    rc = poll(r, spin < 0 ? 0 : spin, st, &flag);
    if (rc != MPI_SUCCESS) {
        fail(rc);
        goto release;
    }
    if (!flag) {
        out = 2;
        goto release;
    }
    if (w->finalizers != NULL && PyTuple_CheckExact(w->finalizers)
        && PyTuple_GET_SIZE(w->finalizers) == 1) {
        /* a staged output's only finalizer (this module's unpack): run here */
        PyObject *f = PyTuple_GET_ITEM(w->finalizers, 0);
        if (PyCFunction_Check(f) && PyCFunction_GET_FUNCTION(f) == (PyCFunction)unpack_call) {
            if ((o = unpack_call(PyCFunction_GET_SELF(f), NULL)) == NULL) {
                PyErr_Clear(); /* Work.complete runs it again and fails the work with it */
            } else {
                Py_DECREF(o);
                Py_INCREF(s_empty);
                Py_XSETREF(w->finalizers, s_empty);
            }
        }
    }
    if (w->finalizers != NULL && (rc = PyObject_IsTrue(w->finalizers)) != 0) {
        if (rc < 0)
            goto release;
        /* finalizers to run: Work.complete does it all */
        if ((o = PyObject_CallMethodNoArgs((PyObject *)w, s_complete)) == NULL)
            goto release;
        Py_DECREF(o);
        out = 1;
        goto release;
    }
    /* Work.complete without finalizers: keep dropped, done, out of the in-flight list */
    Py_INCREF(s_empty);
    Py_XSETREF(w->keep, s_empty);
    w->done = 1;
    for (i = 0; i < PyList_GET_SIZE(inflight); i++)
        if (PyList_GET_ITEM(inflight, i) == (PyObject *)w) {
            if (PyList_SetSlice(inflight, i, i + 1, NULL) < 0)
                goto release;
            break;
        }
    out = 1;
release:
    if (out < 0) { /* release the lock, keeping the error raised */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        o = PyObject_CallMethodNoArgs(lock, s_release);
        Py_XDECREF(o);
        PyErr_Restore(et, ev, tb);
    } else if ((o = PyObject_CallMethodNoArgs(lock, s_release)) == NULL) {
        out = -1;
    } else {
        Py_DECREF(o);
    }
    Py_DECREF(lock);
    return out;
}

/* The first step of an async fast-path Work's wait: 1 if the work is done without an
 * error, already or now: its request completed within the engine's spin, tested
 * under the engine's poll_lock while every work in flight is of ``types`` and nothing
 * is deferred. 2 if it spun that long and the request is not done; 0 if it did not try
 * (an error to raise: a work done with one, a finalizer's too; no engine, deferred
 * work, another library's work in flight, the lock busy); -1 on an error (raised: an
 * MPI error is MPIError). Finishing is
 * Work.complete where the work has finalizers, else its three effects, done here. */
static int finish_core(WorkObject *w, PyObject *types)
{
    PyObject *eng = w->engine, *inflight;
    int t, out = -1;
    Py_ssize_t i;
    if (w->done)
        return w->error == NULL || w->error == Py_None;
    if (eng == NULL || eng == Py_None)
        return 0;
    Py_INCREF(eng);
    if ((t = attr_true(eng, s_pending)) != 0) {
        Py_DECREF(eng);
        return t < 0 ? -1 : 0;
    }
    if ((inflight = PyObject_GetAttr(eng, s_inflight)) == NULL) {
        Py_DECREF(eng);
        return -1;
    }
    if (!PyList_Check(inflight)) {
        out = 0;
        goto end;
    }
    for (i = 0; i < PyList_GET_SIZE(inflight); i++) {
        /* a type hashes by identity: no Python code runs here */
        t = PySet_Contains(types, (PyObject *)Py_TYPE(PyList_GET_ITEM(inflight, i)));
        if (t <= 0) {
            out = t < 0 ? -1 : 0;
            goto end;
        }
    }
    out = spin_and_finish(w, eng, inflight);
    if (out == 1 || out == 2)
        spins++;
    if (out == 1 && w->error != NULL && w->error != Py_None)
        out = 0; /* done, but failed (a finalizer raised): the Python wait raises it */
end:
    Py_DECREF(inflight);
    Py_DECREF(eng);
    return out;
}

/* The wait of the fast path's Works while this module is in use (``work_wait``, an
 * instance method: ``work.wait(timeout=None)``): ``finish_core`` where no timeout is
 * given, True if that finished the work; else, or after failing the work with an error
 * raised there (``work.complete(error)``), the Python wait ``set_work_classes`` named
 * (the engine's: its timeout, diagnostics, and the work's error raised). */
static PyObject *work_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    PyObject *w, *timeout = Py_None, *et, *ev, *tb, *r;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    int out;
    if (nargs < 1 || nargs + nkw > 2
        || (nkw == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "timeout") != 0)) {
        PyErr_SetString(PyExc_TypeError, "wait(timeout=None): one optional argument, timeout");
        return NULL;
    }
    w = args[0];
    if (nargs + nkw == 2)
        timeout = args[1];
    if (timeout == Py_None && work_types != NULL && PyObject_TypeCheck(w, &WorkType)) {
        out = finish_core(WORK(w), work_types);
        if (out == 1)
            Py_RETURN_TRUE;
        if (out < 0) { /* a library error: the work fails with it */
            PyErr_Fetch(&et, &ev, &tb);
            PyErr_NormalizeException(&et, &ev, &tb);
            if (ev == NULL) {
                Py_XDECREF(et);
                Py_XDECREF(tb);
                return NULL;
            }
            if (tb != NULL)
                PyException_SetTraceback(ev, tb);
            r = PyObject_CallMethodOneArg(w, s_complete, ev);
            Py_XDECREF(et);
            Py_DECREF(ev);
            Py_XDECREF(tb);
            if (r == NULL)
                return NULL;
            Py_DECREF(r);
        }
    }
    if (slow_wait == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mpi_fast: call set_work_classes first");
        return NULL;
    }
    return PyObject_CallFunctionObjArgs(slow_wait, w, timeout, NULL);
}

/* Whether ``(lo, hi, writes)`` spans ``a`` and ``b`` overlap where one of them writes
 * (1), not (0), or an error (-1): the rule of ``mcrdl_core.engine.work.conflicts``. */
static int span_pair(PyObject *a, PyObject *b)
{
    PyObject *x, *y;
    int t;
    if (!PyTuple_Check(a) || PyTuple_GET_SIZE(a) != 3 || !PyTuple_Check(b)
        || PyTuple_GET_SIZE(b) != 3) {
        PyErr_SetString(PyExc_TypeError, "mpi_fast: a span is a (lo, hi, writes) tuple");
        return -1;
    }
    if ((t = PyObject_IsTrue(PyTuple_GET_ITEM(a, 2))) == 0)
        t = PyObject_IsTrue(PyTuple_GET_ITEM(b, 2));
    if (t <= 0)
        return t;
    x = PyTuple_GET_ITEM(a, 0); /* a.lo < b.hi and b.lo < a.hi */
    y = PyTuple_GET_ITEM(b, 1);
    if ((t = PyObject_RichCompareBool(x, y, Py_LT)) <= 0)
        return t;
    return PyObject_RichCompareBool(PyTuple_GET_ITEM(b, 0), PyTuple_GET_ITEM(a, 1), Py_LT);
}

/* Whether the memory of ``spans`` conflicts with that of a work in ``inflight`` (1),
 * not (0), or an error (-1). */
static int conflicts(PyObject *inflight, PyObject *spans)
{
    Py_ssize_t i, j, k;
    int t = 0;
    if (!PyTuple_Check(spans)) {
        PyErr_SetString(PyExc_TypeError, "mpi_fast: spans are a tuple");
        return -1;
    }
    for (i = 0; t == 0 && i < PyList_GET_SIZE(inflight); i++) {
        PyObject *w = PyList_GET_ITEM(inflight, i), *ws, *seq;
        if (PyObject_TypeCheck(w, &WorkType)) {
            ws = WORK(w)->spans;
            Py_XINCREF(ws);
        } else {
            Py_INCREF(w); /* (another thread may drop it from the list meanwhile) */
            ws = PyObject_GetAttrString(w, "spans");
            Py_DECREF(w);
        }
        if (ws == NULL) {
            if (PyErr_Occurred())
                return -1;
            continue;
        }
        seq = PySequence_Fast(ws, "mpi_fast: a work's spans are a sequence");
        Py_DECREF(ws);
        if (seq == NULL)
            return -1;
        for (j = 0; t == 0 && j < PySequence_Fast_GET_SIZE(seq); j++)
            for (k = 0; t == 0 && k < PyTuple_GET_SIZE(spans); k++)
                t = span_pair(PySequence_Fast_GET_ITEM(seq, j), PyTuple_GET_ITEM(spans, k));
        Py_DECREF(seq);
    }
    return t;
}

/* launch(op, group, issue, args, spans, keep, engine): an async fast-path call, issued
 * and registered (``Backend.fast_launch``). None, with nothing issued, where the
 * memory of ``spans`` conflicts with work in flight on ``engine`` or ``issue(*args)``
 * refuses its arguments (returns False): the caller's general path orders or judges
 * the call. Else the Work: a Work made here gets its fields set and is appended to
 * ``engine.inflight`` (unless MPI failed it at the issue: then it is done, with its
 * error for the wait to raise, and nothing is in flight); anything else (the Python issuers' requests) goes to the Python
 * launch ``set_work_classes`` named, as ``launch(op, group, req, spans, keep,
 * engine)``. */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    WorkObject *w;
    PyObject *inflight, *req;
    int rc;
    if (nargs != 7 || !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "launch(op, group, issue, args: tuple, spans, keep, engine)");
        return NULL;
    }
    if ((inflight = PyObject_GetAttr(args[6], s_inflight)) == NULL)
        return NULL;
    if (!PyList_Check(inflight)) {
        Py_DECREF(inflight);
        PyErr_SetString(PyExc_TypeError, "mpi_fast.launch: engine.inflight is not a list");
        return NULL;
    }
    if (PyList_GET_SIZE(inflight) && (rc = conflicts(inflight, args[4])) != 0) {
        Py_DECREF(inflight);
        if (rc < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    req = PyObject_Call(args[2], args[3], NULL);
    if (req == NULL || req == Py_False) {
        Py_DECREF(inflight);
        if (req == NULL)
            return NULL;
        Py_DECREF(req);
        Py_RETURN_NONE;
    }
    if (!PyObject_TypeCheck(req, &WorkType)) {
        PyObject *r, *call[6] = {args[0], args[1], req, args[4], args[5], args[6]};
        Py_DECREF(inflight);
        if (slow_launch == NULL) {
            Py_DECREF(req);
            PyErr_SetString(PyExc_RuntimeError, "mpi_fast: call set_work_classes first");
            return NULL;
        }
        r = PyObject_Vectorcall(slow_launch, call, 6, NULL);
        Py_DECREF(req);
        return r;
    }
    w = WORK(req);
    Py_INCREF(args[0]);
    Py_XSETREF(w->op, args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(w->group, args[1]);
    Py_INCREF(args[4]);
    Py_XSETREF(w->spans, args[4]);
    Py_INCREF(args[5]);
    Py_XSETREF(w->keep, args[5]);
    Py_INCREF(args[6]);
    Py_XSETREF(w->engine, args[6]);
    if (w->done) { /* MPI failed it at the issue: nothing in flight, its wait raises */
        Py_DECREF(inflight);
        return req;
    }
    rc = PyList_Append(inflight, req);
    Py_DECREF(inflight);
    if (rc < 0) {
        Py_DECREF(req);
        return NULL;
    }
    return req;
}

/* spins(): how many waits spun in this module (a count for tests) */
static PyObject *spin_count(PyObject *self, PyObject *args)
{
    return PyLong_FromUnsignedLongLong(spins);
}

static PyMethodDef work_wait_def = {"wait", (PyCFunction)(void (*)(void))work_wait,
                                    METH_FASTCALL | METH_KEYWORDS,
                                    "wait(timeout=None): the fast path's Work wait"};

/* library_version(): MPI_Get_library_version of the library this module is linked to */
static PyObject *library_version(PyObject *self, PyObject *args)
{
    char v[MPI_MAX_LIBRARY_VERSION_STRING + 1];
    int len = 0;
    if (MPI_Get_library_version(v, &len) != MPI_SUCCESS)
        len = 0;
    return PyUnicode_DecodeLatin1(v, len, NULL);
}

/* world_handle(): MPI_COMM_WORLD's handle in the library this module is built for; it
 * equals mpi4py's ``MPI.COMM_WORLD.handle`` only if both use the same handle ABI */
static PyObject *world_handle(PyObject *self, PyObject *args)
{
    return comm_handle(MPI_COMM_WORLD);
}

static PyMethodDef methods[] = {
    {"world_handle", world_handle, METH_NOARGS, "world_handle()"},
    {"library_version", library_version, METH_NOARGS, "library_version()"},
    {"allreduce", (PyCFunction)(void (*)(void))allreduce, METH_FASTCALL, "allreduce(comm, dtype, op, spin, ptr, count)"},
    {"bcast", (PyCFunction)(void (*)(void))bcast, METH_FASTCALL, "bcast(comm, dtype, root, spin, ptr, count)"},
    {"reduce", (PyCFunction)(void (*)(void))reduce, METH_FASTCALL,
     "reduce(comm, dtype, op, root, is_root, spin, ptr, count)"},
    {"allgather", (PyCFunction)(void (*)(void))allgather, METH_FASTCALL, "allgather(comm, dtype, spin, out, inp, count)"},
    {"reduce_scatter", (PyCFunction)(void (*)(void))reduce_scatter, METH_FASTCALL,
     "reduce_scatter(comm, dtype, op, spin, out, inp, count)"},
    {"alltoall", (PyCFunction)(void (*)(void))alltoall, METH_FASTCALL, "alltoall(comm, dtype, spin, out, inp, count)"},
    {"alltoall_list", (PyCFunction)(void (*)(void))alltoall_list, METH_FASTCALL,
     "alltoall_list(comm, dtype, n, me, spin, outs, out_counts, ins, in_counts)"},
    {"gather", (PyCFunction)(void (*)(void))gather, METH_FASTCALL,
     "gather(comm, dtype, root, is_root, spin, out, inp, count)"},
    {"scatter", (PyCFunction)(void (*)(void))scatter, METH_FASTCALL,
     "scatter(comm, dtype, root, is_root, spin, out, inp, count)"},
    {"alltoallv", (PyCFunction)(void (*)(void))alltoallv, METH_FASTCALL,
     "alltoallv(comm, dtype, n, me, spin, out, out_count, out_rows, inp, in_count, in_rows, "
     "out_splits, in_splits)"},
    {"send", (PyCFunction)(void (*)(void))send, METH_FASTCALL, "send(comm, dtype, spin, ptr, count, peer, tag)"},
    {"recv", (PyCFunction)(void (*)(void))recv, METH_FASTCALL, "recv(comm, dtype, spin, ptr, count, peer, tag)"},
    {"barrier", (PyCFunction)(void (*)(void))barrier, METH_FASTCALL, "barrier(comm, spin)"},
    {"set_work_classes", set_work_classes, METH_VARARGS,
     "set_work_classes(work, recv_work, mpi_work_types, slow_wait, slow_launch)"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(op, group, issue, args, spans, keep, engine): issue and register an async "
     "call, or None"},
    {"spins", spin_count, METH_NOARGS, "spins()"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mpi_fast", "The MPI backend's compiled hot path.", -1, methods,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_mpi_fast(void)
{
    PyObject *m;
    if (import_mpi4py() < 0)
        return NULL;
    m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* what mcrdl_backends.mpi expects: raise it when the functions or their arguments
     * change, so that a module built from an older source is refused, not misused */
    if (PyModule_AddIntConstant(m, "VERSION", 7) < 0)
        return NULL;
#define INTERN(v, name) if ((v = PyUnicode_InternFromString(name)) == NULL) return NULL
    INTERN(s_pending, "pending");
    INTERN(s_inflight, "inflight");
    INTERN(s_poll_lock, "poll_lock");
    INTERN(s_spin_s, "spin_s");
    INTERN(s_complete, "complete");
    INTERN(s_acquire, "acquire");
    INTERN(s_release, "release");
#undef INTERN
    if ((s_empty = PyTuple_New(0)) == NULL)
        return NULL;
    if (PyType_Ready(&WorkType) < 0)
        return NULL;
    Py_INCREF(&WorkType);
    if (PyModule_AddObject(m, "Work", (PyObject *)&WorkType) < 0)
        return NULL;
    {
        PyObject *f = PyCFunction_New(&work_wait_def, NULL), *meth;
        if (f == NULL)
            return NULL;
        meth = PyInstanceMethod_New(f); /* binds the Work as the first argument */
        Py_DECREF(f);
        if (meth == NULL || PyModule_AddObject(m, "work_wait", meth) < 0)
            return NULL;
    }
    MPIError = PyErr_NewException("mpi_fast.MPIError", PyExc_RuntimeError, NULL);
    if (MPIError == NULL || PyModule_AddObject(m, "MPIError", MPIError) < 0)
        return NULL;
    return m;
}
