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
 * the second class, with an mpi4py Status as ``status``), made without its constructor,
 * with the mpi4py Request as ``req``; the caller fills in the rest and waits for it
 * through its progress engine, with the engine's timeout and diagnostics. ``spin`` < 0
 * returns the Work untested (async calls). Making the Work here saves an async call
 * the Python of a Request wrapper and of the Work's construction. An MPI error raises
 * ``MPIError`` with MPI's message.
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

/* The classes of the Works made here, the set of the MPI Work classes and the Python
 * wait (set_work_classes), names set on the Works, and the count ``spins`` returns. */
static PyTypeObject *work_cls, *recv_work_cls;
static PyObject *work_types, *slow_wait;
static unsigned long long spins;
static PyObject *s_req, *s_status, *s_counts, *s_empty;

/* The Work of the unfinished ``req``: an instance of ``cls`` made as ``cls.__new__(cls)``
 * would, with ``req`` (an mpi4py Request) and, where ``name`` is not NULL, ``value`` as
 * attribute ``name``. On an error the request is leaked (MPI may still use its memory). */
static PyObject *new_work(PyTypeObject *cls, MPI_Request req, PyObject *name, PyObject *value)
{
    PyObject *w, *h;
    if (cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mpi_fast: call set_work_classes first");
        return NULL;
    }
    if ((h = PyMPIRequest_New(req)) == NULL)
        return NULL;
    w = PyBaseObject_Type.tp_new(cls, s_empty, NULL);
    if (w == NULL || PyObject_SetAttr(w, s_req, h) < 0
        || (name != NULL && PyObject_SetAttr(w, name, value) < 0)) {
        Py_XDECREF(w);
        Py_DECREF(h);
        return NULL;
    }
    Py_DECREF(h);
    return w;
}

/* None if ``req`` completes within ``spin`` seconds, else its Work. */
static PyObject *finish(MPI_Request req, double spin)
{
    int flag, rc = poll(&req, spin, MPI_STATUS_IGNORE, &flag);
    if (rc != MPI_SUCCESS)
        return fail(rc);
    if (flag)
        Py_RETURN_NONE;
    return new_work(work_cls, req, NULL, NULL);
}

/* set_work_classes(work, recv_work, mpi_work_types, slow_wait): the classes of the Works
 * the calls return; those ``work_wait`` spins for while all in flight are of them (a
 * frozenset); the wait it leaves the rest to. */
static PyObject *set_work_classes(PyObject *self, PyObject *args)
{
    PyTypeObject *w, *r;
    PyObject *types, *slow;
    if (!PyArg_ParseTuple(args, "O!O!O!O", &PyType_Type, &w, &PyType_Type, &r,
                          &PyFrozenSet_Type, &types, &slow))
        return NULL;
    Py_INCREF(w);
    Py_INCREF(r);
    Py_INCREF(types);
    Py_INCREF(slow);
    Py_XSETREF(work_cls, w);
    Py_XSETREF(recv_work_cls, r);
    Py_XSETREF(work_types, types);
    Py_XSETREF(slow_wait, slow);
    Py_RETURN_NONE;
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
 * ``spin``, or its Work, with the counts' memory, which MPI reads until the request
 * completes, as ``counts``. */
static PyObject *alltoallv(PyObject *self, PyObject *args)
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
    w = new_work(work_cls, req, s_counts, keep);
    if (w != NULL)
        Py_DECREF(keep);
    return w;
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
 * source rank if the receive completed within ``spin``, else its Work, with a Status. */
static PyObject *recv(PyObject *self, PyObject *args)
{
    double spin;
    void *ptr;
    handle_t comm, dtype;
    Py_ssize_t count;
    int src, tag, rc, flag;
    MPI_Request req;
    MPI_Status st;
    PyObject *status, *w;
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
    memset(&st, 0, sizeof st);
    if ((status = PyMPIStatus_New(&st)) == NULL)
        return NULL;
    w = new_work(recv_work_cls, req, s_status, status);
    Py_DECREF(status);
    return w;
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

/* Names the wait reads and writes, interned once (at import). */
static PyObject *s_done, *s_error, *s_engine, *s_pending, *s_inflight, *s_poll_lock, *s_spin_s,
    *s_finalizers, *s_keep, *s_complete, *s_acquire, *s_release;

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
static int spin_and_finish(PyObject *w, PyObject *eng, PyObject *inflight)
{
    PyObject *lock, *o, *req = NULL, *status = NULL;
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
    if ((rc = attr_true(w, s_done)) != 0) {
        out = rc < 0 ? -1 : 1;
        goto release;
    }
    if ((o = PyObject_GetAttr(eng, s_spin_s)) == NULL)
        goto release;
    spin = PyFloat_AsDouble(o);
    Py_DECREF(o);
    if (spin == -1.0 && PyErr_Occurred())
        goto release;
    if ((req = PyObject_GetAttr(w, s_req)) == NULL || (r = PyMPIRequest_Get(req)) == NULL)
        goto release;
    if ((status = PyObject_GetAttr(w, s_status)) == NULL)
        goto release;
    if (status != Py_None && (st = PyMPIStatus_Get(status)) == NULL)
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
    if ((rc = attr_true(w, s_finalizers)) < 0)
        goto release;
    if (rc) { /* finalizers to run: Work.complete does it all */
        if ((o = PyObject_CallMethodNoArgs(w, s_complete)) == NULL)
            goto release;
        Py_DECREF(o);
        out = 1;
        goto release;
    }
    /* Work.complete without finalizers: keep dropped, done, out of the in-flight list */
    if (PyObject_SetAttr(w, s_keep, s_empty) < 0 || PyObject_SetAttr(w, s_done, Py_True) < 0)
        goto release;
    for (i = 0; i < PyList_GET_SIZE(inflight); i++)
        if (PyList_GET_ITEM(inflight, i) == w) {
            if (PyList_SetSlice(inflight, i, i + 1, NULL) < 0)
                goto release;
            break;
        }
    out = 1;
release:
    Py_XDECREF(req);
    Py_XDECREF(status);
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

/* The first step of an async fast-path Work's wait: 1 if the work is done, already
 * (without an error) or now: its request completed within the engine's spin, tested
 * under the engine's poll_lock while every work in flight is of ``types`` and nothing
 * is deferred. 2 if it spun that long and the request is not done; 0 if it did not try
 * (an error to raise, no engine, deferred work, another library's work in flight, the
 * lock busy); -1 on an error (raised: an MPI error is MPIError). Finishing is
 * Work.complete where the work has finalizers, else its three effects, done here. */
static int finish_core(PyObject *w, PyObject *types)
{
    PyObject *eng, *inflight = NULL, *o;
    int t, out = -1;
    Py_ssize_t i;
    if ((t = attr_true(w, s_done)) < 0)
        return -1;
    if (t) {
        if ((o = PyObject_GetAttr(w, s_error)) == NULL)
            return -1;
        t = o == Py_None;
        Py_DECREF(o);
        return t;
    }
    if ((eng = PyObject_GetAttr(w, s_engine)) == NULL)
        return -1;
    if (eng == Py_None) {
        out = 0;
        goto end;
    }
    if ((t = attr_true(eng, s_pending)) != 0) {
        out = t < 0 ? -1 : 0;
        goto end;
    }
    if ((inflight = PyObject_GetAttr(eng, s_inflight)) == NULL)
        goto end;
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
end:
    Py_XDECREF(inflight);
    Py_DECREF(eng);
    return out;
}

/* The wait of the fast path's Works while this module is in use (``work_wait``, an
 * instance method: ``work.wait(timeout=None)``): ``finish_core`` where no timeout is
 * given, True if that finished the work; else, or after failing the work with an error
 * raised there (``work.complete(error)``), the Python wait ``set_work_classes`` named
 * (the engine's: its timeout, diagnostics, and the work's error raised). */
static PyObject *work_wait(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"work", "timeout", NULL};
    PyObject *w, *timeout = Py_None, *et, *ev, *tb, *r;
    int out;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:wait", names, &w, &timeout))
        return NULL;
    if (timeout == Py_None && work_types != NULL) {
        out = finish_core(w, work_types);
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

/* spins(): how many waits spun in this module (a count for tests) */
static PyObject *spin_count(PyObject *self, PyObject *args)
{
    return PyLong_FromUnsignedLongLong(spins);
}

static PyMethodDef work_wait_def = {"wait", (PyCFunction)(void (*)(void))work_wait,
                                    METH_VARARGS | METH_KEYWORDS,
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
    {"set_work_classes", set_work_classes, METH_VARARGS,
     "set_work_classes(work, recv_work, mpi_work_types, slow_wait)"},
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
    if (PyModule_AddIntConstant(m, "VERSION", 4) < 0)
        return NULL;
#define INTERN(v, name) if ((v = PyUnicode_InternFromString(name)) == NULL) return NULL
    INTERN(s_done, "done");
    INTERN(s_error, "error");
    INTERN(s_engine, "engine");
    INTERN(s_pending, "pending");
    INTERN(s_inflight, "inflight");
    INTERN(s_poll_lock, "poll_lock");
    INTERN(s_spin_s, "spin_s");
    INTERN(s_req, "req");
    INTERN(s_status, "status");
    INTERN(s_finalizers, "finalizers");
    INTERN(s_keep, "keep");
    INTERN(s_complete, "complete");
    INTERN(s_acquire, "acquire");
    INTERN(s_release, "release");
    INTERN(s_counts, "counts");
#undef INTERN
    if ((s_empty = PyTuple_New(0)) == NULL)
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
