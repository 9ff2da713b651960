"""One place per rule (issue 23 point 3), in one process: which backend the user named
(``Runtime.named_backend``: explicit > group default > MCRDL_BACKEND, "auto" names none),
per-runtime caches that ``destroy()`` drops (calibration and decisions of compressed
calls are keyed by group ids, which restart at 0 in the next runtime), and the api
reaching compression only through the hook registry. The runtime checks run in a fresh
interpreter with no launcher variables: earlier tests of this process may leave some
(``mcrdl_torch.run``'s), and a runtime made from them would wait for peers."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import mcrdl_core

LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "HYDRA_CONTROL_FD",
               "MPI_LOCALNRANKS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT", "MCRDL_BACKEND", "MCRDL_COMPRESSION")


def _run(code: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["MCRDL_TUNING_TABLE"] = "none"
    head = ("import numpy as np, mcrdl_core\n"
            "from mcrdl_core.world.bootstrap import Bootstrap\n"
            "from mcrdl_core.base.ops import Op\n"
            "rt = mcrdl_core.init(bootstrap=Bootstrap())\n")
    proc = subprocess.run([sys.executable, "-c", head + code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_named_backend_precedence():
    _run("g = rt.world\n"
         "assert rt.named_backend(Op.ALL_REDUCE, g, None) is None\n"
         "rt.set_override('all_reduce=gloo,*=mpi')\n"
         "assert rt.named_backend(Op.ALL_REDUCE, g, None) == 'gloo'  # the op's override\n"
         "assert rt.named_backend(Op.BROADCAST, g, None) == 'mpi'  # then '*'\n"
         "g.backend = 'nccl'  # a group default beats the override\n"
         "assert rt.named_backend(Op.ALL_REDUCE, g, None) == 'nccl'\n"
         "assert rt.named_backend(Op.ALL_REDUCE, g, 'mpi') == 'mpi'  # the call beats both\n"
         "assert rt.named_backend(Op.ALL_REDUCE, g, 'auto') == 'gloo'  # auto names none\n")


def test_selection_and_the_barrier_probe_follow_it():
    _run("from mcrdl_core.dispatch.api import barrier_probe\n"
         "from mcrdl_core.memory.buffer import as_buffer\n"
         "rt.set_override('*=gloo')\n"
         "a = np.ones(4, np.float32)\n"
         "mcrdl_core.all_reduce(a)\n"
         "assert a.tolist() == [1.0] * 4\n"
         "assert rt.select(Op.ALL_REDUCE, rt.world, as_buffer(a), None).name == 'gloo'\n"
         "assert barrier_probe(rt, rt.world, None).device.kind == 'cpu'\n")


def test_destroy_drops_the_runtimes_caches():
    _run("rt.cache('compress.calibration')[(0, None, ('int8',))] = 'measured on group 0'\n"
         "mcrdl_core.all_reduce(np.ones(2, np.float32), backend='gloo')\n"
         "assert rt.choices and rt.cache('compress.calibration')\n"
         "mcrdl_core.destroy()\n"
         "assert not rt.choices and not rt._caches\n"
         "fresh = mcrdl_core.init(bootstrap=Bootstrap())\n"
         "assert fresh is not rt and fresh.cache('compress.calibration') == {}\n")


def test_api_imports_no_transform():
    """The api reaches compression through the hook registry only (mcrdl_core/dispatch/hooks.py)."""
    src = (Path(mcrdl_core.__file__).parent / "dispatch" / "api.py").read_text()
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    assert not {n for n in names if "compress" in n or "reshard" in n}, names


def test_the_compression_transform_loads_at_its_first_use():
    _run("import sys\n"
         "assert 'mcrdl_core.compress.entry' not in sys.modules\n"
         "out, x = np.zeros(8, np.float32), np.arange(8, dtype=np.float32)\n"
         "mcrdl_core.all_gather_into_tensor(out, x, compression='fp16')\n"
         "assert 'mcrdl_core.compress.entry' in sys.modules\n"
         "assert (out == x).all(), out\n")


def test_a_registered_transform_takes_the_call():
    _run("from mcrdl_core.dispatch import hooks\n"
         "seen = []\n"
         "class StandIn:\n"
         "    @staticmethod\n"
         "    def resolve(compression, op, dtype, reduce_op):\n"
         "        seen.append(('resolve', compression, op)); return compression\n"
         "    @staticmethod\n"
         "    def keeps_plain(cz, rt, g, op, buf, backend):\n"
         "        return False\n"
         "    @staticmethod\n"
         "    def all_reduce(rt, g, buf, op, cz, backend, async_op):\n"
         "        seen.append(('all_reduce', cz)); buf.array()[...] = 7\n"
         "hooks.register_transform('compression', StandIn())\n"
         "a = np.ones(3, np.float32)\n"
         "mcrdl_core.all_reduce(a, compression='whatever')\n"
         "assert seen == [('resolve', 'whatever', Op.ALL_REDUCE), ('all_reduce', 'whatever')], seen\n"
         "assert a.tolist() == [7.0] * 3\n")
