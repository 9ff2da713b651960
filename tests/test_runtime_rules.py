"""One place per rule (issue 23 point 3), in one process: which backend the user named
(``Runtime.named_backend``: explicit > group default > MCRDL_BACKEND, "auto" names none)
and per-runtime caches that ``destroy()`` drops (calibration and decisions of compressed
calls are keyed by group ids, which restart at 0 in the next runtime)."""
import numpy as np
import pytest

import mcrdl_core
from mcrdl_core.ops import Op
from mcrdl_core.runtime import get_runtime


@pytest.fixture
def rt():
    mcrdl_core.destroy()
    r = mcrdl_core.init()
    yield r
    r.set_override({})
    r.world.backend = None
    mcrdl_core.destroy()


def test_named_backend_precedence(rt):
    g = rt.world
    assert rt.named_backend(Op.ALL_REDUCE, g, None) is None
    rt.set_override("all_reduce=gloo,*=mpi")
    assert rt.named_backend(Op.ALL_REDUCE, g, None) == "gloo"  # the op's override
    assert rt.named_backend(Op.BROADCAST, g, None) == "mpi"  # then "*"
    g.backend = "nccl"  # a group default beats the override
    assert rt.named_backend(Op.ALL_REDUCE, g, None) == "nccl"
    assert rt.named_backend(Op.ALL_REDUCE, g, "mpi") == "mpi"  # and the call beats both
    assert rt.named_backend(Op.ALL_REDUCE, g, "auto") == "gloo"  # "auto" names none here
    g.backend = None


def test_selection_the_barrier_probe_and_auto_compression_follow_it(rt):
    from mcrdl_core.cuda import barrier_probe

    rt.set_override("*=gloo")
    a = np.ones(4, np.float32)
    mcrdl_core.all_reduce(a)
    assert a.tolist() == [1.0] * 4  # one rank
    assert rt.select(Op.ALL_REDUCE, rt.world, mcrdl_core.buffer.as_buffer(a), None).name == "gloo"
    assert barrier_probe(rt, rt.world, None).device.kind == "cpu"


def test_destroy_drops_the_runtimes_caches(rt):
    rt.cache("compress.calibration")[(0, None, ("int8",))] = "measured on group 0"
    mcrdl_core.all_reduce(np.ones(2, np.float32), backend="mpi")
    assert rt._choice and rt.cache("compress.calibration")
    mcrdl_core.destroy()
    assert not rt._choice and not rt._caches
    fresh = get_runtime()
    assert fresh is not rt and fresh.cache("compress.calibration") == {}


def test_api_imports_no_transform():
    """The api reaches compression through the hook registry only (mcrdl_core/hooks.py)."""
    import ast
    from pathlib import Path

    src = Path(mcrdl_core.__file__).with_name("api.py").read_text()
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    assert not {n for n in names if "compress" in n or "reshard" in n}, names


def test_the_compression_transform_loads_at_its_first_use():
    import subprocess
    import sys

    code = ("import sys, numpy as np, mcrdl_core\n"
            "assert 'mcrdl_core.compress.entry' not in sys.modules\n"
            "out, x = np.zeros(8, np.float32), np.arange(8, dtype=np.float32)\n"
            "mcrdl_core.all_gather_into_tensor(out, x, compression='fp16')\n"
            "assert 'mcrdl_core.compress.entry' in sys.modules\n"
            "assert (out == x).all(), out\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ,
                                            "MCRDL_TUNING_TABLE": "none"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_registered_transform_takes_the_call(rt, monkeypatch):
    from mcrdl_core import hooks

    seen = []

    class StandIn:
        @staticmethod
        def resolve(compression, op, dtype, reduce_op):
            seen.append(("resolve", compression, op))
            return compression

        @staticmethod
        def keeps_plain(cz, rt, g, op, buf, backend):
            return False

        @staticmethod
        def all_reduce(rt, g, buf, op, cz, backend, async_op):
            seen.append(("all_reduce", cz))
            buf.array()[...] = 7

    monkeypatch.setitem(hooks.TRANSFORMS, "compression", StandIn())
    a = np.ones(3, np.float32)
    mcrdl_core.all_reduce(a, compression="whatever")
    assert seen == [("resolve", "whatever", Op.ALL_REDUCE), ("all_reduce", "whatever")]
    assert a.tolist() == [7.0] * 3
