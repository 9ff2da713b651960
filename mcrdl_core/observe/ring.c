/* The flight recorder's ring in C (observe/recorder.py loads it when built).
 *
 * The same ring as recorder.py's Python columns, slot for slot: one entry a call,
 * slot tick % size, where tick counts every call of the process. A call of the fast
 * path records itself with one C call (note) and ends with one more (end), instead of
 * a dozen Python stores: on a 2-core VM the Python form cost 0.8 µs a call, this one
 * a few tenths (bench/overhead.py). The clock is CLOCK_MONOTONIC, the one behind
 * Python's time.perf_counter on Linux, so the entries' times and the async Works' own
 * (Work.t_done) are on one clock.
 *
 * Every function runs under the GIL: a note is never seen half made by another
 * thread's note or by slot(). The ring holds references to the objects it records
 * (the call's static tuple, its extra, its outcome) until the slot is reused.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <time.h>

#define VERSION 4

static Py_ssize_t size = 0;
static long long next_tick = 0;
static long long *ticks, *seqs, *counts;
static double *t_issue, *t_end;
static PyObject **descs, **extras, **outcomes;
static PyObject *s_seq, *s_p2p;  /* "trace_seq", "trace_p2p" */
static PyObject *s_done, *s_error, *s_t_done, *s_async;  /* "done", ..., the marker "async" */

static inline double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void clear_slot(Py_ssize_t i) {
    ticks[i] = -1;
    Py_CLEAR(descs[i]);
    Py_CLEAR(extras[i]);
    Py_CLEAR(outcomes[i]);
}

/* init(size): (re)make an empty ring of `size` slots, ticks from 0. */
static PyObject *ring_init(PyObject *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) { PyErr_SetString(PyExc_ValueError, "the ring needs at least one slot"); return NULL; }
    for (Py_ssize_t i = 0; i < size; i++) clear_slot(i);
    PyMem_Free(ticks); PyMem_Free(seqs); PyMem_Free(counts);
    PyMem_Free(t_issue); PyMem_Free(t_end);
    PyMem_Free(descs); PyMem_Free(extras); PyMem_Free(outcomes);
    ticks = PyMem_Calloc(n, sizeof *ticks); seqs = PyMem_Calloc(n, sizeof *seqs);
    counts = PyMem_Calloc(n, sizeof *counts);
    t_issue = PyMem_Calloc(n, sizeof *t_issue); t_end = PyMem_Calloc(n, sizeof *t_end);
    descs = PyMem_Calloc(n, sizeof *descs); extras = PyMem_Calloc(n, sizeof *extras);
    outcomes = PyMem_Calloc(n, sizeof *outcomes);
    if (!ticks || !seqs || !counts || !t_issue || !t_end || !descs || !extras || !outcomes) {
        size = 0;
        return PyErr_NoMemory();
    }
    size = n;
    next_tick = 0;
    for (Py_ssize_t i = 0; i < n; i++) ticks[i] = -1;
    Py_RETURN_NONE;
}

/* Release the async Work of call t (if the slot still holds it) once it is done
 * without an error: its end becomes the Work's t_done (unknown where the Work keeps
 * none: the MPI fast path's compiled Works), its outcome the marker "async". Why: a ring of thousands of Works held until their slots are reused
 * kept their memory from being reused hot, which cost async calls most of a µs each. A
 * failed Work stays (its error is the entry's state); any error here is dropped. */
static void release_done(long long t)
{
    if (t < 0 || size == 0) return;
    Py_ssize_t j = (Py_ssize_t)(t % size);
    PyObject *o = outcomes[j];
    if (ticks[j] != t || o == NULL || o == Py_None || PyTuple_CheckExact(o)
            || PyUnicode_CheckExact(o))
        return;
    Py_INCREF(o);  /* (the lookups below may run Python code) */
    /* (looked up without raising: an AttributeError made and dropped costs more than
     * the rest of the call) */
    PyObject *x = NULL;
    double end_ = -1.0;
    int yes = 0;
    if (_PyObject_LookupAttr(o, s_done, &x) > 0) {
        yes = PyObject_IsTrue(x);
        Py_DECREF(x);
    }
    if (yes == 1 && _PyObject_LookupAttr(o, s_error, &x) >= 0 && x != NULL) {
        if (x != Py_None) yes = 0;  /* a failed Work stays: its error is the state */
        Py_DECREF(x);
    }
    if (yes == 1 && _PyObject_LookupAttr(o, s_t_done, &x) > 0) {
        if (PyFloat_Check(x)) end_ = PyFloat_AS_DOUBLE(x);
        Py_DECREF(x);
    }
    PyErr_Clear();
    /* the slot may have changed meanwhile: write only to the call looked at */
    if (yes == 1 && size > 0 && ticks[j] == t && outcomes[j] == o) {
        if (end_ >= t_issue[j]) t_end[j] = end_;  /* else: its end is unknown */
        Py_INCREF(s_async);
        Py_SETREF(outcomes[j], s_async);
    }
    Py_DECREF(o);
}

/* Add ``by`` to the sequence number of desc's group (desc[8]: point to point, its
 * trace_p2p, else trace_seq), written back; *seq: the new number. 0, or -1 with an
 * exception set. */
static int bump(PyObject *desc, int by, long long *seq)
{
    PyObject *g = PyTuple_GET_ITEM(desc, 0);
    PyObject *name = PyTuple_GET_ITEM(desc, 8) == Py_True ? s_p2p : s_seq;
    PyObject *v = PyObject_GetAttr(g, name);
    if (v == NULL) return -1;
    long long n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (n == -1 && PyErr_Occurred()) return -1;
    PyObject *nv = PyLong_FromLongLong(n + by);
    if (nv == NULL) return -1;
    int rc = PyObject_SetAttr(g, name, nv);
    Py_DECREF(nv);
    *seq = n + by;
    return rc;
}

/* Record a call: its group's next sequence number (bump), its slot filled. Returns the
 * slot, or -1 with an exception set; *tick: the call's tick. */
static Py_ssize_t note_c(PyObject *desc, long long count, PyObject *extra, PyObject *out,
                         long long *tick)
{
    long long seq;
    if (bump(desc, 1, &seq) < 0) return -1;
    long long t = next_tick++;
    Py_ssize_t i = (Py_ssize_t)(t % size);
    ticks[i] = t;
    seqs[i] = seq;
    counts[i] = count;
    Py_INCREF(desc); Py_XSETREF(descs[i], desc);
    Py_INCREF(extra); Py_XSETREF(extras[i], extra);
    Py_INCREF(out); Py_XSETREF(outcomes[i], out);
    t_issue[i] = now();
    *tick = t;
    if (t >= 4) release_done(t - 4);  /* (a p2p step's send, waited by now) */
    if (t >= 64) release_done(t - 64);  /* (an overlapped collective, a second look) */
    return i;
}

/* Forget call t of desc: its group's number taken back whatever happened to its slot
 * (another thread may have gone round the ring meanwhile: the number must still go,
 * or this rank numbers the group's later calls one higher than its peers), the slot
 * emptied while it still holds that call. */
static int forget_c(long long t, PyObject *desc)
{
    if (size > 0 && t >= 0) {
        Py_ssize_t i = (Py_ssize_t)(t % size);
        if (ticks[i] == t) clear_slot(i);
    }
    long long seq;
    return bump(desc, -1, &seq);
}

static int check_desc(PyObject *desc)
{
    if (!PyTuple_Check(desc) || PyTuple_GET_SIZE(desc) < 9) {
        PyErr_SetString(PyExc_TypeError, "desc: the recorder's tuple (recorder.describe)");
        return -1;
    }
    if (size == 0) {
        PyErr_SetString(PyExc_RuntimeError, "the ring is not made: init(size)");
        return -1;
    }
    return 0;
}

/* note(desc, count, extra=None, out=None) -> tick. */
static PyObject *ring_note(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "note(desc, count, extra=None, out=None)");
        return NULL;
    }
    if (check_desc(args[0]) < 0) return NULL;
    long long count = PyLong_AsLongLong(args[1]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    long long t;
    if (note_c(args[0], count, nargs > 2 ? args[2] : Py_None, nargs > 3 ? args[3] : Py_None,
               &t) < 0)
        return NULL;
    return PyLong_FromLongLong(t);
}

/* recorded(fn, desc, count_at, mul, extra_at): fn, a blocking issuer (spin, ...) ->
 * None when done (a receive: its source, an int), False when it refused its
 * arguments, else the Work of a call not done within the spin, wrapped so that every
 * call of it is recorded in C: noted before fn runs (count: its argument count_at
 * times mul, or 1 where count_at < 0; extra: the tuple of its arguments at the
 * indices extra_at, the argument itself where extra_at names one, or None), ended when fn returns done, forgotten when fn refused
 * (nothing was sent). A call not done within the spin stays issued until the caller,
 * once its wait returns, calls end_of(desc). */
typedef struct {
    PyObject_HEAD
    PyObject *fn, *desc;
    Py_ssize_t count_at, mul, n_extra, extra_at[4];
    vectorcallfunc vectorcall;
} Recorded;

static PyObject *recorded_call(PyObject *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames)
{
    Recorded *r = (Recorded *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    long long count = 1, t;
    if (r->count_at >= 0) {
        if (r->count_at >= nargs) {
            PyErr_SetString(PyExc_TypeError, "recorded call: too few arguments");
            return NULL;
        }
        count = PyLong_AsLongLong(args[r->count_at]);
        if (count == -1 && PyErr_Occurred()) return NULL;
        count *= r->mul;
    }
    PyObject *extra = Py_None;
    if (r->n_extra == 1) {  /* one argument: itself, no tuple made */
        extra = r->extra_at[0] < nargs ? args[r->extra_at[0]] : Py_None;
        Py_INCREF(extra);
    } else if (r->n_extra) {
        extra = PyTuple_New(r->n_extra);
        if (extra == NULL) return NULL;
        for (Py_ssize_t k = 0; k < r->n_extra; k++) {
            Py_ssize_t at = r->extra_at[k];
            PyObject *x = at < nargs ? args[at] : Py_None;
            Py_INCREF(x);
            PyTuple_SET_ITEM(extra, k, x);
        }
    } else {
        Py_INCREF(extra);
    }
    if (size == 0) {  /* (no ring made: the call alone) */
        Py_DECREF(extra);
        return PyObject_Vectorcall(r->fn, args, nargsf, kwnames);
    }
    Py_ssize_t i = note_c(r->desc, count, extra, Py_None, &t);
    Py_DECREF(extra);
    if (i < 0) return NULL;
    PyObject *res = PyObject_Vectorcall(r->fn, args, nargsf, kwnames);
    if (res == NULL) return res;
    if (res == Py_False) {  /* refused, nothing sent: no entry, no number */
        if (forget_c(t, r->desc) < 0) { Py_DECREF(res); return NULL; }
        return res;
    }
    if (size == 0) return res;  /* (the ring was made anew meanwhile) */
    i = (Py_ssize_t)(t % size);  /* (and may be of another size now) */
    if (ticks[i] == t && (res == Py_None || PyLong_CheckExact(res)))
        t_end[i] = now();
    return res;
}

static void recorded_dealloc(PyObject *self)
{
    Recorded *r = (Recorded *)self;
    Py_XDECREF(r->fn);
    Py_XDECREF(r->desc);
    Py_TYPE(self)->tp_free(self);
}

static PyTypeObject RecordedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mcrdl_core.observe.ring.Recorded",
    .tp_basicsize = sizeof(Recorded),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Recorded, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = recorded_dealloc,
    .tp_doc = "A blocking issuer whose calls the ring records (ring.recorded).",
};

static PyObject *ring_recorded(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyTuple_Check(args[4]) || PyTuple_GET_SIZE(args[4]) > 4) {
        PyErr_SetString(PyExc_TypeError,
                        "recorded(fn, desc, count_at, mul, extra_at: a tuple of <= 4)");
        return NULL;
    }
    if (check_desc(args[1]) < 0) return NULL;
    Py_ssize_t count_at = PyLong_AsSsize_t(args[2]), mul = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    Recorded *r = PyObject_New(Recorded, &RecordedType);
    if (r == NULL) return NULL;
    r->n_extra = PyTuple_GET_SIZE(args[4]);
    for (Py_ssize_t k = 0; k < r->n_extra; k++) {
        r->extra_at[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[4], k));
        if (r->extra_at[k] == -1 && PyErr_Occurred()) {
            r->fn = r->desc = NULL;
            Py_DECREF(r);
            return NULL;
        }
    }
    Py_INCREF(args[0]); r->fn = args[0];
    Py_INCREF(args[1]); r->desc = args[1];
    r->count_at = count_at;
    r->mul = mul;
    r->vectorcall = recorded_call;
    return (PyObject *)r;
}

/* end_of(desc): end the newest call of desc not ended yet (a recorded call that was
 * not done within its spin, once its wait returned). */
static PyObject *ring_end_of(PyObject *self, PyObject *desc)
{
    long long first = next_tick > size ? next_tick - size : 0;
    for (long long t = next_tick - 1; t >= first; t--) {
        Py_ssize_t i = (Py_ssize_t)(t % size);
        if (ticks[i] == t && descs[i] == desc && outcomes[i] == Py_None
                && t_end[i] < t_issue[i]) {
            t_end[i] = now();
            break;
        }
    }
    Py_RETURN_NONE;
}

/* lowered(desc, count, extra, out): an entry without a sequence number (seq -1) and
 * without touching the group (a JAX call lowered into a compiled program). */
static PyObject *ring_lowered(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "lowered(desc, count, extra, out)"); return NULL; }
    if (size == 0) { PyErr_SetString(PyExc_RuntimeError, "the ring is not made: init(size)"); return NULL; }
    long long count = PyLong_AsLongLong(args[1]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    long long t = next_tick++;
    Py_ssize_t i = (Py_ssize_t)(t % size);
    ticks[i] = t;
    seqs[i] = -1;
    counts[i] = count;
    Py_INCREF(args[0]); Py_XSETREF(descs[i], args[0]);
    Py_INCREF(args[2]); Py_XSETREF(extras[i], args[2]);
    Py_INCREF(args[3]); Py_XSETREF(outcomes[i], args[3]);
    t_issue[i] = now();
    return PyLong_FromLongLong(t);
}

static int slot_of(PyObject *arg, Py_ssize_t *i) {
    long long t = PyLong_AsLongLong(arg);
    if (t == -1 && PyErr_Occurred()) return -1;
    if (size == 0 || t < 0) { *i = -1; return 0; }
    *i = (Py_ssize_t)(t % size);
    if (ticks[*i] != t) *i = -1;  /* the slot holds a later call now */
    return 0;
}

/* end(tick): the blocking call returned now. */
static PyObject *ring_end(PyObject *self, PyObject *arg) {
    Py_ssize_t i;
    if (slot_of(arg, &i) < 0) return NULL;
    if (i >= 0) t_end[i] = now();
    Py_RETURN_NONE;
}

/* outcome(tick, value): the call's async Work, or the (state, text) of its error. */
static PyObject *ring_outcome(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "outcome(tick, value)"); return NULL; }
    Py_ssize_t i;
    if (slot_of(args[0], &i) < 0) return NULL;
    if (i >= 0) { Py_INCREF(args[1]); Py_XSETREF(outcomes[i], args[1]); }
    Py_RETURN_NONE;
}

/* forget(tick, desc): take back the call (undo: it was not issued after all): its
 * group's number, and its slot while the slot still holds it. */
static PyObject *ring_forget(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "forget(tick, desc)"); return NULL; }
    if (check_desc(args[1]) < 0) return NULL;
    long long t = PyLong_AsLongLong(args[0]);
    if (t == -1 && PyErr_Occurred()) return NULL;
    if (forget_c(t, args[1]) < 0) return NULL;
    Py_RETURN_NONE;
}

/* clear(): forget every entry. */
static PyObject *ring_clear(PyObject *self, PyObject *unused) {
    for (Py_ssize_t i = 0; i < size; i++) clear_slot(i);
    Py_RETURN_NONE;
}

/* slots() -> [(tick, desc, seq, t_issue, t_end, count, extra, outcome), ...] of every
 * filled slot, oldest call first. */
static PyObject *ring_slots(PyObject *self, PyObject *unused) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    long long first = next_tick > size ? next_tick - size : 0;
    for (long long t = first; t < next_tick; t++) {
        Py_ssize_t i = (Py_ssize_t)(t % size);
        if (ticks[i] != t || descs[i] == NULL) continue;
        PyObject *item = Py_BuildValue("(LOLddLOO)", t, descs[i], seqs[i], t_issue[i],
                                       t_end[i], counts[i], extras[i], outcomes[i]);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *ring_now(PyObject *self, PyObject *unused) {
    return PyFloat_FromDouble(now());
}

static PyMethodDef methods[] = {
    {"init", ring_init, METH_O, "init(size): an empty ring of size slots"},
    {"note", (PyCFunction)(void (*)(void))ring_note, METH_FASTCALL,
     "note(desc, count, extra=None, out=None) -> tick: record a call issued now"},
    {"lowered", (PyCFunction)(void (*)(void))ring_lowered, METH_FASTCALL,
     "lowered(desc, count, extra, out) -> tick: an entry with no sequence number"},
    {"end", ring_end, METH_O, "end(tick): the blocking call returned now"},
    {"outcome", (PyCFunction)(void (*)(void))ring_outcome, METH_FASTCALL,
     "outcome(tick, value): the call's Work or (state, text) of its error"},
    {"forget", (PyCFunction)(void (*)(void))ring_forget, METH_FASTCALL,
     "forget(tick, desc): take back the call: its number, its slot"},
    {"recorded", (PyCFunction)(void (*)(void))ring_recorded, METH_FASTCALL,
     "recorded(fn, desc, count_at, mul, extra_at) -> fn, its calls recorded"},
    {"end_of", ring_end_of, METH_O, "end_of(desc): end desc's newest open call"},
    {"clear", ring_clear, METH_NOARGS, "clear(): forget every entry"},
    {"slots", ring_slots, METH_NOARGS, "slots() -> the filled slots, oldest first"},
    {"now", ring_now, METH_NOARGS, "now(): the ring's clock (time.perf_counter's)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ring",
    "The flight recorder's ring in C (see observe/recorder.py).", -1, methods,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_ring(void) {
    s_seq = PyUnicode_InternFromString("trace_seq");
    s_p2p = PyUnicode_InternFromString("trace_p2p");
    s_done = PyUnicode_InternFromString("done");
    s_error = PyUnicode_InternFromString("error");
    s_t_done = PyUnicode_InternFromString("t_done");
    s_async = PyUnicode_InternFromString("async");
    if (s_seq == NULL || s_p2p == NULL || s_done == NULL || s_error == NULL || s_t_done == NULL
            || s_async == NULL || PyType_Ready(&RecordedType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "VERSION", VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
