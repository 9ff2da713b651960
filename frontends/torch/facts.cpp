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

PyMethodDef methods[] = {
    {"one", (PyCFunction)(void (*)(void))one, METH_FASTCALL, "one(tensor): (address, numel) or None"},
    {"two", (PyCFunction)(void (*)(void))two, METH_FASTCALL,
     "two(output, input): (address, numel, dim 0) of each, or None"},
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
        || PyModule_AddIntConstant(m, "VERSION", 2) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
