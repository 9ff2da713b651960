/* The MPI backend's compiled hot path: issue one nonblocking MPI call and poll it.
 *
 * Why: on a shared CPU, a small call's cost is the Python that runs for it. Through
 * mpi4py, one in-place all-reduce builds a buffer object, an argument list, a Request
 * object, then loops over Request.Test in Python; here it is one C call.
 *
 * What each function keeps of the fast path's rules: nothing blocks inside MPI. Each
 * issues the nonblocking form (MPI_Iallreduce, MPI_Ibcast, ...) and tests it for at most
 * ``spin`` seconds, with the GIL released after the first test. A request that
 * completed gives None (a receive: its source rank); one that did not gives it as an
 * mpi4py Request (a receive: in a 1-tuple), which the caller waits for through its
 * progress engine, with the engine's timeout and diagnostics. ``spin`` < 0 returns the
 * Request untested (async calls). An MPI error raises ``MPIError`` with MPI's message.
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
#include <mpi.h>
#include <mpi4py/mpi4py.h> /* mpi4py's C API: Request objects from handles */
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

/* None if ``req`` completes within ``spin`` seconds, else an mpi4py Request of it. */
static PyObject *finish(MPI_Request req, double spin)
{
    int flag, rc = poll(&req, spin, MPI_STATUS_IGNORE, &flag);
    if (rc != MPI_SUCCESS)
        return fail(rc);
    if (flag)
        Py_RETURN_NONE;
    return PyMPIRequest_New(req);
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
static PyObject *allreduce(PyObject *self, PyObject *args)
{
    double spin;
    void *ptr;
    handle_t comm, dtype, op;
    Py_ssize_t count;
    int rc;
    MPI_Request req;
    if (!PyArg_ParseTuple(args, "KKKdO&n", &comm, &dtype, &op, &spin, address, &ptr, &count))
        return NULL;
    rc = MPI_Iallreduce_c(MPI_IN_PLACE, count ? ptr : NULL, (MPI_Count)count, TYPE(dtype), OP(op),
                        COMM(comm), &req);
    return rc == MPI_SUCCESS ? finish(req, spin) : fail(rc);
}

/* bcast(comm, dtype, root, spin, ptr, count) */
static PyObject *bcast(PyObject *self, PyObject *args)
{
    double spin;
    void *ptr;
    handle_t comm, dtype;
    Py_ssize_t count;
    int root, rc;
    MPI_Request req;
    if (!PyArg_ParseTuple(args, "KKidO&n", &comm, &dtype, &root, &spin, address, &ptr, &count))
        return NULL;
    rc = MPI_Ibcast_c(count ? ptr : NULL, (MPI_Count)count, TYPE(dtype), root, COMM(comm), &req);
    return rc == MPI_SUCCESS ? finish(req, spin) : fail(rc);
}

/* reduce(comm, dtype, op, root, is_root, spin, ptr, count): in place at the root */
static PyObject *reduce(PyObject *self, PyObject *args)
{
    double spin;
    void *ptr, *mem;
    handle_t comm, dtype, op;
    Py_ssize_t count;
    int root, is_root, rc;
    MPI_Request req;
    if (!PyArg_ParseTuple(args, "KKKipdO&n", &comm, &dtype, &op, &root, &is_root, &spin,
                          address, &ptr, &count))
        return NULL;
    mem = count ? ptr : NULL;
    rc = MPI_Ireduce_c(is_root ? MPI_IN_PLACE : mem, is_root ? mem : NULL, (MPI_Count)count,
                       TYPE(dtype), OP(op), root, COMM(comm), &req);
    return rc == MPI_SUCCESS ? finish(req, spin) : fail(rc);
}

/* The all-gather and the all-to-all: one block of ``count`` elements per rank, the
 * same signature in MPI */
typedef int (*exchange_fn)(const void *, MPI_Count, MPI_Datatype, void *, MPI_Count,
                           MPI_Datatype, MPI_Comm, MPI_Request *);

static PyObject *exchange(PyObject *args, exchange_fn fn)
{
    double spin;
    void *out, *inp;
    handle_t comm, dtype;
    Py_ssize_t count;
    int rc;
    MPI_Request req;
    if (!PyArg_ParseTuple(args, "KKdO&O&n", &comm, &dtype, &spin, address, &out, address, &inp,
                          &count))
        return NULL;
    rc = fn(count ? inp : NULL, (MPI_Count)count, TYPE(dtype), count ? out : NULL,
            (MPI_Count)count, TYPE(dtype), COMM(comm), &req);
    return rc == MPI_SUCCESS ? finish(req, spin) : fail(rc);
}

/* allgather(comm, dtype, spin, out, inp, count): count per rank */
static PyObject *allgather(PyObject *self, PyObject *args)
{
    return exchange(args, MPI_Iallgather_c);
}

/* reduce_scatter(comm, dtype, op, spin, out, inp, count): count per rank */
static PyObject *reduce_scatter(PyObject *self, PyObject *args)
{
    double spin;
    void *out, *inp;
    handle_t comm, dtype, op;
    Py_ssize_t count;
    int rc;
    MPI_Request req;
    if (!PyArg_ParseTuple(args, "KKKdO&O&n", &comm, &dtype, &op, &spin, address, &out, address,
                          &inp, &count))
        return NULL;
    rc = MPI_Ireduce_scatter_block_c(count ? inp : NULL, count ? out : NULL, (MPI_Count)count,
                                     TYPE(dtype), OP(op), COMM(comm), &req);
    return rc == MPI_SUCCESS ? finish(req, spin) : fail(rc);
}

/* alltoall(comm, dtype, spin, out, inp, count): count per peer */
static PyObject *alltoall(PyObject *self, PyObject *args)
{
    return exchange(args, MPI_Ialltoall_c);
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
 * ``spin``, or (Request, counts): the counts' memory, which MPI reads until the request
 * completes, goes with the request for the caller to keep alive. */
static PyObject *alltoallv(PyObject *self, PyObject *args)
{
    double spin;
    void *out, *inp;
    handle_t comm, dtype;
    Py_ssize_t out_count, out_rows, in_count, in_rows;
    int n, me, rc, flag;
    PyObject *out_splits, *in_splits, *keep, *h, *tup;
    MPI_Count *oc, *ic;
    MPI_Aint *od, *id;
    MPI_Request req;
    if (!PyArg_ParseTuple(args, "KKiidO&nnO&nnOO", &comm, &dtype, &n, &me, &spin, address, &out,
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
        return fail(rc);
    }
    rc = poll(&req, spin, MPI_STATUS_IGNORE, &flag);
    if (rc != MPI_SUCCESS || flag) {
        Py_DECREF(keep);
        if (rc != MPI_SUCCESS)
            return fail(rc);
        Py_RETURN_NONE;
    }
    /* from here on MPI may still read the counts: on an error (out of memory) they are
     * leaked, not freed */
    h = PyMPIRequest_New(req);
    if (h == NULL)
        return NULL;
    tup = PyTuple_Pack(2, h, keep);
    Py_DECREF(h);
    if (tup != NULL)
        Py_DECREF(keep);
    return tup;
}

/* send(comm, dtype, spin, ptr, count, peer, tag) */
static PyObject *send(PyObject *self, PyObject *args)
{
    double spin;
    void *ptr;
    handle_t comm, dtype;
    Py_ssize_t count;
    int peer, tag, rc;
    MPI_Request req;
    if (!PyArg_ParseTuple(args, "KKdO&nii", &comm, &dtype, &spin, address, &ptr, &count, &peer,
                          &tag))
        return NULL;
    rc = MPI_Isend_c(count ? ptr : NULL, (MPI_Count)count, TYPE(dtype), peer, tag, COMM(comm),
                     &req);
    return rc == MPI_SUCCESS ? finish(req, spin) : fail(rc);
}

/* recv(comm, dtype, spin, ptr, count, peer, tag), peer None: any source. Returns the
 * source rank if the receive completed within ``spin``, else its Request in a 1-tuple. */
static PyObject *recv(PyObject *self, PyObject *args)
{
    double spin;
    void *ptr;
    handle_t comm, dtype;
    Py_ssize_t count;
    int src, tag, rc, flag;
    MPI_Request req;
    MPI_Status st;
    PyObject *h, *tup;
    if (!PyArg_ParseTuple(args, "KKdO&nO&i", &comm, &dtype, &spin, address, &ptr, &count, peer,
                          &src, &tag))
        return NULL;
    rc = MPI_Irecv_c(count ? ptr : NULL, (MPI_Count)count, TYPE(dtype), src, tag, COMM(comm),
                     &req);
    if (rc != MPI_SUCCESS)
        return fail(rc);
    rc = poll(&req, spin, &st, &flag);
    if (rc != MPI_SUCCESS)
        return fail(rc);
    if (flag)
        return PyLong_FromLong(st.MPI_SOURCE);
    h = PyMPIRequest_New(req);
    if (h == NULL)
        return NULL;
    tup = PyTuple_Pack(1, h);
    Py_DECREF(h);
    return tup;
}

/* barrier(comm, spin) */
static PyObject *barrier(PyObject *self, PyObject *args)
{
    double spin;
    handle_t comm;
    int rc;
    MPI_Request req;
    if (!PyArg_ParseTuple(args, "Kd", &comm, &spin))
        return NULL;
    rc = MPI_Ibarrier(COMM(comm), &req);
    return rc == MPI_SUCCESS ? finish(req, spin) : fail(rc);
}

/* spin(request, spin[, status]): test an mpi4py Request for at most ``spin`` seconds (at
 * least once), as the calls above test their own: True if it completed. The request is
 * tested in place, so the Request object sees it completed (MPI_REQUEST_NULL) and a
 * receive's mpi4py Status, if given, holds its source. The wait of an async call's Work
 * (MPI's progress is global: testing one request also drives the others in flight). */
static PyObject *spin_request(PyObject *self, PyObject *args)
{
    PyObject *r, *s = Py_None;
    double spin;
    MPI_Request *req;
    MPI_Status *st = MPI_STATUS_IGNORE;
    int flag, rc;
    if (!PyArg_ParseTuple(args, "Od|O", &r, &spin, &s))
        return NULL;
    req = PyMPIRequest_Get(r);
    if (req == NULL)
        return NULL;
    if (s != Py_None && (st = PyMPIStatus_Get(s)) == NULL)
        return NULL;
    rc = poll(req, spin < 0 ? 0 : spin, st, &flag);
    if (rc != MPI_SUCCESS)
        return fail(rc);
    return PyBool_FromLong(flag);
}

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
    {"allreduce", allreduce, METH_VARARGS, "allreduce(comm, dtype, op, spin, ptr, count)"},
    {"bcast", bcast, METH_VARARGS, "bcast(comm, dtype, root, spin, ptr, count)"},
    {"reduce", reduce, METH_VARARGS,
     "reduce(comm, dtype, op, root, is_root, spin, ptr, count)"},
    {"allgather", allgather, METH_VARARGS, "allgather(comm, dtype, spin, out, inp, count)"},
    {"reduce_scatter", reduce_scatter, METH_VARARGS,
     "reduce_scatter(comm, dtype, op, spin, out, inp, count)"},
    {"alltoall", alltoall, METH_VARARGS, "alltoall(comm, dtype, spin, out, inp, count)"},
    {"alltoallv", alltoallv, METH_VARARGS,
     "alltoallv(comm, dtype, n, me, spin, out, out_count, out_rows, inp, in_count, in_rows, "
     "out_splits, in_splits)"},
    {"send", send, METH_VARARGS, "send(comm, dtype, spin, ptr, count, peer, tag)"},
    {"recv", recv, METH_VARARGS, "recv(comm, dtype, spin, ptr, count, peer, tag)"},
    {"barrier", barrier, METH_VARARGS, "barrier(comm, spin)"},
    {"spin", spin_request, METH_VARARGS, "spin(request, spin[, status])"},
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
    if (PyModule_AddIntConstant(m, "VERSION", 3) < 0)
        return NULL;
    MPIError = PyErr_NewException("mpi_fast.MPIError", PyExc_RuntimeError, NULL);
    if (MPIError == NULL || PyModule_AddObject(m, "MPIError", MPIError) < 0)
        return NULL;
    return m;
}
