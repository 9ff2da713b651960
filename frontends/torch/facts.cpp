// The torch frontend's tensor facts in one call (module ``mcrdl_torch.tensor_facts``).
//
// Why: before the fast path can issue anything it needs a tensor's address and element
// count and to know it is a contiguous CPU tensor; a two-tensor op also needs both of
// the same dtype and each one's dim 0. Read from Python that is one torch call per fact
// (60-140 ns each: torch checks for __torch_function__ and sets up a warning handler on
// every attribute), 4 for one tensor and 10-12 for two. Here the same facts come from
// the at::Tensor inside the Python object in one C call.
//
// What it returns is exactly what the Python reads return (frontends/torch/facts.py
// holds the Python form, used where this module is not built, and the tests hold the
// two to each other); None where the fast path does not apply (not a strided CPU
// tensor, not contiguous, dtypes differ), and the frontend then takes its general path,
// which gives every error. Built against the installed torch by ``python -m
// mcrdl_torch.build`` (``make install``), which records torch's version; the frontend
// refuses a module built for another.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

#include <exception>
#include <initializer_list>

#ifndef MCRDL_TORCH_VERSION
#error "build with -DMCRDL_TORCH_VERSION=\"<torch.__version__>\" (python -m mcrdl_torch.build)"
#endif

namespace {

// The tensor of ``o`` if it is a torch.Tensor on the CPU, strided and contiguous, and
// not nested: a nested tensor of strided layout is "contiguous" and has an address and
// an element count, but no one shape, so the frontend's general path refuses it (with
// the same error on every call, where the fast path would have taken it once a plain
// tensor had bound the call's key).
const at::Tensor *plain(PyObject *o)
{
    if (!THPVariable_Check(o))
        return nullptr;
    const at::Tensor &t = THPVariable_Unpack(o);
    if (!t.defined() || t.layout() != at::kStrided || t.is_nested() || !t.is_cpu()
        || !t.is_contiguous())
        return nullptr;
    return &t;
}

// A tuple of ``n`` new references (nullptr, the rest released, if one of them is).
PyObject *pack(std::initializer_list<PyObject *> items)
{
    PyObject *tup = PyTuple_New((Py_ssize_t)items.size());
    Py_ssize_t k = 0;
    bool ok = tup != nullptr;
    for (PyObject *x : items) {
        if (x == nullptr || !ok)
            ok = false, Py_XDECREF(x);
        else
            PyTuple_SET_ITEM(tup, k++, x);
    }
    if (!ok) {
        Py_XDECREF(tup); // (its unset items are NULL, which dealloc skips)
        return nullptr;
    }
    return tup;
}

PyObject *address(const at::Tensor &t)
{
    return PyLong_FromVoidPtr(const_cast<void *>(t.const_data_ptr()));
}

PyObject *integer(int64_t v)
{
    return PyLong_FromLongLong((long long)v);
}

PyObject *rows(const at::Tensor &t)
{
    return integer(t.dim() ? t.size(0) : 1);
}

// one(t): (address, numel), or None
PyObject *one(PyObject *, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "one(tensor)");
        return nullptr;
    }
    try {
        const at::Tensor *t = plain(args[0]);
        if (t == nullptr)
            Py_RETURN_NONE;
        return pack({address(*t), integer(t->numel())});
    } catch (const std::exception &e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
}

// two(out, inp): (out address, out numel, out dim 0, inp address, inp numel, inp dim 0),
// dim 0 being 1 for a 0-d tensor, or None (either not plain, or their dtypes differ)
PyObject *two(PyObject *, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "two(output, input)");
        return nullptr;
    }
    try {
        const at::Tensor *o = plain(args[0]), *i = plain(args[1]);
        if (o == nullptr || i == nullptr || o->scalar_type() != i->scalar_type())
            Py_RETURN_NONE;
        return pack({address(*o), integer(o->numel()), rows(*o), address(*i),
                     integer(i->numel()), rows(*i)});
    } catch (const std::exception &e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
}

// Whether ``o``'s type is one of the tuple ``types`` (exactly: not a subclass)
bool of_types(PyObject *o, PyObject *types)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++)
        if ((PyObject *)Py_TYPE(o) == PyTuple_GET_ITEM(types, i))
            return true;
    return false;
}

// many(ts, like, types, writes): the list facts of a list or tuple ``ts`` of tensors,
// each of a type in ``types`` (exactly), plain and of ``like``'s dtype: (addresses,
// element counts, the common count or -1, run, lo, hi, spans), ``run`` True where each
// starts where the previous one ends (list order, n >= 1), ``[lo, hi)`` the span of the
// non-empty ones (0, 0 if none), ``spans`` each one's ``(lo, hi, writes)``; else None
PyObject *many(PyObject *, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "many(tensors, like, types: tuple, writes)");
        return nullptr;
    }
    int writes = PyObject_IsTrue(args[3]);
    if (writes < 0)
        return nullptr;
    PyObject *ts = args[0], *types = args[2];
    if ((!PyList_Check(ts) && !PyTuple_Check(ts)) || !THPVariable_Check(args[1]))
        Py_RETURN_NONE;
    try {
        const at::Tensor &like = THPVariable_Unpack(args[1]);
        if (!like.defined())
            Py_RETURN_NONE;
        auto kind = like.scalar_type();
        Py_ssize_t n = PySequence_Fast_GET_SIZE(ts);
        PyObject **items = PySequence_Fast_ITEMS(ts);
        PyObject *ptrs = PyTuple_New(n), *counts = PyTuple_New(n), *spans = PyTuple_New(n);
        if (ptrs == nullptr || counts == nullptr || spans == nullptr) {
            Py_XDECREF(ptrs);
            Py_XDECREF(counts);
            Py_XDECREF(spans);
            return nullptr;
        }
        long long common = -1;
        bool run = n > 0;
        uintptr_t next = 0, lo = 0, hi = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            const at::Tensor *t = of_types(items[i], types) ? plain(items[i]) : nullptr;
            if (t == nullptr || t->scalar_type() != kind) {
                Py_DECREF(ptrs);
                Py_DECREF(counts);
                Py_DECREF(spans);
                Py_RETURN_NONE;
            }
            uintptr_t p = (uintptr_t)t->const_data_ptr();
            long long c = (long long)t->numel();
            uintptr_t end = p + (uintptr_t)(c * (long long)t->element_size());
            PyObject *a = PyLong_FromVoidPtr((void *)p), *k = integer(c);
            PyObject *sp = a == nullptr ? nullptr
                           : pack({(Py_INCREF(a), a), PyLong_FromVoidPtr((void *)end),
                                   PyBool_FromLong(writes)});
            if (a == nullptr || k == nullptr || sp == nullptr) {
                Py_XDECREF(a);
                Py_XDECREF(k);
                Py_XDECREF(sp);
                Py_DECREF(ptrs);
                Py_DECREF(counts);
                Py_DECREF(spans);
                return nullptr;
            }
            PyTuple_SET_ITEM(ptrs, i, a);
            PyTuple_SET_ITEM(counts, i, k);
            PyTuple_SET_ITEM(spans, i, sp);
            if (i == 0)
                common = c;
            else if (c != common)
                common = -1;
            if (i && p != next)
                run = false;
            next = end;
            if (c) {
                if (lo == hi)
                    lo = p, hi = end;
                else
                    lo = p < lo ? p : lo, hi = end > hi ? end : hi;
            }
        }
        if (n == 0)
            common = -1;
        return pack({ptrs, counts, integer(common), PyBool_FromLong(run),
                     PyLong_FromVoidPtr((void *)lo), PyLong_FromVoidPtr((void *)hi), spans});
    } catch (const std::exception &e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
}

PyMethodDef methods[] = {
    {"one", (PyCFunction)(void (*)(void))one, METH_FASTCALL, "one(tensor): (address, numel) or None"},
    {"two", (PyCFunction)(void (*)(void))two, METH_FASTCALL,
     "two(output, input): (address, numel, dim 0) of each, or None"},
    {"many", (PyCFunction)(void (*)(void))many, METH_FASTCALL,
     "many(tensors, like, types, writes): the list facts of tensors of like's dtype, or None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "tensor_facts",
                      "The torch frontend's tensor facts in one call.", -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

} // namespace

PyMODINIT_FUNC PyInit_tensor_facts(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == nullptr)
        return nullptr;
    // what the frontend checks before it uses the module: the torch it was built
    // against, and the version of this file's calls
    if (PyModule_AddStringConstant(m, "TORCH_VERSION", MCRDL_TORCH_VERSION) < 0
        || PyModule_AddIntConstant(m, "VERSION", 4) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
