"""The torch frontend's tensor facts (frontends/torch/facts.py): the compiled
``tensor_facts`` (facts.cpp) and the Python forms give the same answer for every kind
of tensor the frontend may be handed (dtypes, shapes, 0-d and empty, views with an
offset, non-contiguous, sparse, meta, mismatched dtypes), a module built for another
torch is refused, ``python -m mcrdl_torch.build`` builds one, and without it the
frontend's calls still give the right results."""
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcrdl_torch import build, facts

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.int64, torch.bool, torch.complex64]


def _compiled():
    mod, why = facts.compiled()
    if mod is None:
        pytest.skip(f"mcrdl_torch.tensor_facts is not in use: {why}")
    return mod


def _tensor(kind, shape, dtype):
    base = torch.zeros(shape, dtype=dtype)
    if kind == "plain":
        return base
    if kind == "offset" and base.dim() and base.shape[0] > 1:
        return base[1:]
    if kind == "transposed" and base.dim() > 1:
        return base.transpose(0, -1)
    if kind == "strided" and base.dim() and base.shape[-1] > 1:
        return base[..., ::2]
    if kind == "sparse" and base.dim():
        return base.to_sparse()
    if kind == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    return base


tensors = st.builds(_tensor, st.sampled_from(["plain", "offset", "transposed", "strided",
                                              "sparse", "meta"]),
                    st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),
                    st.sampled_from(DTYPES))


@settings(max_examples=300, deadline=None)
@given(tensors, tensors)
def test_the_compiled_facts_equal_the_python_ones(a, b):
    c = _compiled()
    assert c.one(a) == facts._one(a)
    assert c.two(a, b) == facts._two(a, b)
    if facts._one(a) is not None:  # what the fast path may send from
        assert facts._one(a) == (a.data_ptr(), a.numel())
    got = facts._two(a, a)
    if got is not None:
        assert got[2] == (a.shape[0] if a.dim() else 1) and got[:3] == got[3:]


def test_the_compiled_facts_take_only_tensors():
    c = _compiled()
    assert c.one(3) is None and c.two(torch.ones(2), [1.0, 2.0]) is None
    with pytest.raises(TypeError):
        c.two(torch.ones(2))


def test_a_module_for_another_torch_is_refused(monkeypatch):
    mod = _compiled()
    monkeypatch.setattr(mod, "TORCH_VERSION", "0.0.1")
    got, why = facts._load()
    assert got is None and "built for torch 0.0.1" in why and "mcrdl_torch.build" in why


def test_build_writes_the_module_for_this_torch():
    """Where a C++ compiler is found the module is in use: ``make install`` built it,
    or this test builds it (25-30 s, so not again where it is in use already)."""
    if build.compiler() is None:
        pytest.skip("no C++ compiler")
    if facts.compiled()[0] is None:
        path = build.build(quiet=True)
        assert not list(path.parent.glob("tmp*.so")), "a temporary file was left behind"
    path = build.target()
    assert path.exists()
    out = subprocess.run([sys.executable, "-c", "from mcrdl_torch import facts; "
                          "m, why = facts.compiled(); print(m is not None, why, "
                          "facts.two is m.two)"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.split() == ["True", "built", "True"], out


def test_a_failed_build_says_what_failed(monkeypatch, tmp_path):
    bad = tmp_path / "facts.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(build, "SOURCE", bad)
    with pytest.raises(RuntimeError, match="building facts.cpp failed"):
        build.build(quiet=True)
    assert not list(tmp_path.glob("tmp*.so"))


def test_without_the_module_the_frontend_reads_facts_from_python(tmp_path):
    """The module's import made to fail: the Python forms serve, and one-tensor and
    two-tensor calls on one rank give the right results, plain and not (a transposed
    input takes the general path)."""
    code = r'''
import sys
sys.modules["mcrdl_torch.tensor_facts"] = None
import torch, mcrdl_torch as dist
from mcrdl_torch import facts
assert facts.compiled()[0] is None and facts.two is facts._two and facts.one is facts._one
dist.init_process_group(backend="mpi")
for _ in range(3):
    t = torch.arange(4.0)
    dist.all_reduce(t, backend="mpi"); assert t.tolist() == [0, 1, 2, 3]
    out = torch.zeros(2, 2)
    dist.all_gather_into_tensor(out, torch.arange(4.0).reshape(2, 2).t(), backend="mpi")
    assert out.tolist() == [[0, 2], [1, 3]]
    o = torch.zeros(3, 2)
    dist.all_to_all_single(o, torch.arange(6.0).reshape(3, 2), [3], [3], backend="mpi",
                           async_op=True).wait()
    assert o.flatten().tolist() == [0, 1, 2, 3, 4, 5]
    r = torch.zeros(2)
    dist.reduce_scatter_tensor(r, torch.ones(2), backend="mpi"); assert r.tolist() == [1, 1]
print("ok")
'''
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
