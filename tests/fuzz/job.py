"""One rank of the differential fuzzer: runs programs (tests/fuzz/program.py) and checks
every result against the NumPy reference on this rank.

    mpiexec -n 3 python tests/fuzz/job.py --seeds 0:20 --out DIR
    mpiexec -n 3 python tests/fuzz/job.py --program DIR/shrunk.json --out DIR

Each step's outcome on each rank is one word (``ok``, ``skip`` for a non-member, ``err:Class``
for an error the step was meant to raise, or a failure) and, after each program, the
ranks compare their words through an MPI communicator of their own: a step where one rank
raised and another did not is a failure too. Rank 0 writes ``DIR/result.json``; every rank
writes ``DIR/progress.RANK`` (seed and step) before each step, so a hang is named.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mcrdl_core as core  # noqa: E402
import mcrdl_jax as mj  # noqa: E402
import mcrdl_torch as dist  # noqa: E402
from mcrdl_core.base import errors as E  # noqa: E402
from mcrdl_core.dispatch.selection import TuningTable  # noqa: E402

import program as P  # noqa: E402

RED = {"sum": core.ReduceOp.SUM, "max": core.ReduceOp.MAX, "min": core.ReduceOp.MIN,
       "product": core.ReduceOp.PRODUCT, "avg": core.ReduceOp.AVG, "band": core.ReduceOp.BAND,
       "bor": core.ReduceOp.BOR, "bxor": core.ReduceOp.BXOR}
#: the error each bad input must raise on every rank, before anything is sent
#: (InvalidArgumentError where not listed)
BAD_EXPECT = {"bitwise_float": E.UnsupportedError, "unknown_backend": E.BackendUnavailableError}
RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6, "float64": 1e-12}


class Mismatch(Exception):
    """A result that differs from the reference (the program can go on)."""


# ---- arrays of each frontend -------------------------------------------------------------
def make(front: str, arr: np.ndarray):
    if front == "core":
        return np.array(arr, copy=True)
    if front == "torch":
        if arr.dtype == P.BF16:
            return torch.from_numpy(arr.view(np.uint16).copy()).view(torch.bfloat16)
        return torch.from_numpy(np.array(arr, copy=True))
    return jnp.asarray(arr)


def to_np(x, dtype: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(P.BF16).copy()
        return x.numpy().copy()
    return np.asarray(x).astype(P.np_dtype(dtype), copy=True)


def compare(actual: np.ndarray, expect: np.ndarray, st: dict, n: int, what: str,
            scale: float | None = None) -> None:
    """Raise Mismatch unless ``actual`` matches the reference within what the step's
    dtype and codec allow."""
    if actual.shape != expect.shape:
        raise Mismatch(f"{what}: shape {actual.shape}, expected {expect.shape}")
    if actual.size == 0:
        return
    dt = st["dtype"]
    if dt in P.INTS:
        if not np.array_equal(actual, expect):
            bad = np.flatnonzero(actual.ravel() != expect.ravel())
            raise Mismatch(f"{what}: {bad.size} of {actual.size} elements differ, first at "
                           f"{bad[0]}: {actual.ravel()[bad[0]]} != {expect.ravel()[bad[0]]}")
        return
    a, e = actual.astype(np.float64), expect.astype(np.float64)
    codec = (st.get("compression") or "").split("@")[0]
    bound = P.CODECS.get(codec, 0.0)
    if bound > 0:
        if not np.all(np.isfinite(a)):
            raise Mismatch(f"{what}: non-finite values under codec {st['compression']}")
        err = np.linalg.norm(a - e) / max(np.linalg.norm(e) if scale is None else scale, 1e-300)
        allowed = codec_allowance(st, n) * bound + 2 * RTOL[dt]
        if err > allowed:
            raise Mismatch(f"{what}: relative L2 error {err:.3g} > {allowed:.3g} under "
                           f"codec {st['compression']}")
        return
    same_inf = np.isinf(e) & (a == e)
    fin = ~np.isinf(e)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf where ~fin
        ok = same_inf | (fin & (np.abs(a - e) <= RTOL[dt] * np.abs(e) + 1e-30))
    if not np.all(ok):
        bad = np.flatnonzero(~ok.ravel())
        raise Mismatch(f"{what}: {bad.size} of {a.size} elements differ, first at {bad[0]}: "
                       f"{a.ravel()[bad[0]]!r} != {e.ravel()[bad[0]]!r}")


def codec_allowance(st: dict, n: int) -> float:
    """How many codec bounds (relative L2 error of one round trip) a compressed result
    may be off by. A gather or an all-to-all, relative to the result's norm: each block
    moves once (ring, a2a), or is re-encoded at every hop (p2p: n - 1). A reduction,
    relative to S, the root of the sum of its contributions' squared norms: the partial
    sum of k blocks that a hop encodes has norm at most sqrt(k) S, so the error is at
    most (sum of sqrt(k), k < n) S, and an all-reduce encodes each result block once more
    (at most sqrt(n) S; n - 1 times with p2p). 1.2 is room for the dtype's own rounding.
    One contribution left out is off by about S / sqrt(n), two blocks swapped by more."""
    algo = (st.get("compression") or "").partition("@")[2] or "ring"
    if st["op"].startswith(("all_gather", "all_to_all")):
        return 1.0 if algo != "p2p" else float(max(n - 1, 1))
    total = sum(np.sqrt(k) for k in range(1, n))
    if st["op"] == "all_reduce":
        total += np.sqrt(n) * (n - 1 if algo == "p2p" else 1)
    return float(total) * 1.2


def contributions(blocks: list, red: str) -> float:
    """S of ``codec_allowance``: the root of the summed squared norms of the blocks a
    reduction adds (divided by their number for AVG)."""
    s = float(np.sqrt(sum(np.sum(np.square(b.astype(np.float64))) for b in blocks)))
    return s / len(blocks) if red == "avg" else s


# ---- one program -------------------------------------------------------------------------
class Runner:
    def __init__(self, groups, pool, out: Path):
        self.groups, self.pool, self.out = groups, pool, out
        self.rank = core.get_rank()
        self.rt = core.get_runtime()
        self.refusals = {}  # (step kind, err:Class) -> count

    def progress(self, seed, i):
        (self.out / f"progress.{self.rank}").write_text(f"{seed} {i}\n")

    def run(self, prog: dict) -> list[str]:
        """Run ``prog``; one outcome word per step."""
        self.rt.set_table(TuningTable(prog["table"], warn=False) if prog["table"] else None)
        self.rt.debug = bool(prog["debug"])
        steps = prog["steps"]
        present = {s["i"] for s in steps}
        self.aliased = {s["alias"] for s in steps if "alias" in s and s["alias"] in present}
        self.results = {}  # step index -> (result object, expected of every group rank)
        outcome = {s["i"]: "skip" for s in steps}
        pending = []  # (wait after step index, step, work, check)
        broken = False
        for k, st in enumerate(steps):
            self.progress(prog["seed"], st["i"])
            if broken:
                outcome[st["i"]] = "abandoned"
                continue
            try:
                res = self.step(st)
                if res is not None:
                    work, check = res
                    if work is None:
                        check()
                        outcome[st["i"]] = "ok"
                    else:
                        pending.append((k + st.get("wait", 0), st, work, check))
                        outcome[st["i"]] = "issued"
            except Exception as exc:  # noqa: BLE001
                outcome[st["i"]], broken = self.failed(st, exc)
            keep = []
            for due, pst, work, check in pending:
                if due > k or broken:
                    keep.append((due, pst, work, check))
                    continue
                outcome[pst["i"]], broken = self.finish(pst, work, check)
            pending = keep
        for _, pst, work, check in pending:
            if broken:
                outcome[pst["i"]] = "abandoned"
                continue
            outcome[pst["i"]], broken = self.finish(pst, work, check)
        self.broken = broken
        for s in steps:  # what was refused, for the report (err:Class words)
            if outcome[s["i"]].startswith("err:"):
                key = (s.get("bad") or f"{s['op']} {s['compression']} {s['dtype']} "
                       f"{s['backend']}", outcome[s["i"]])
                self.refusals[key] = self.refusals.get(key, 0) + 1
        return [outcome[s["i"]] for s in steps]

    def finish(self, st, work, check):
        try:
            for w in (work if isinstance(work, list) else [work]):
                w.wait()
            check()
            return "ok", False
        except Exception as exc:  # noqa: BLE001
            return self.failed(st, exc)

    def failed(self, st, exc):
        """(outcome word, whether the program must stop on this rank)."""
        name = type(exc).__name__
        if isinstance(exc, Mismatch):
            return f"FAIL mismatch: {exc}", False
        if st.get("bad"):
            want = BAD_EXPECT.get(st["bad"], E.InvalidArgumentError)
            if self.rt.debug:  # the debug check may see the sizes disagree first
                want = (want, E.MismatchError)
            if isinstance(exc, want):
                return f"err:{name}", False  # refused before anything was sent
            return f"FAIL bad input {st['bad']} raised {name}, expected {want}: {exc}", False
        explicit = st["backend"] not in (None, "auto") or self.pool[st["group"]]["backend"] \
            not in (None, "auto")
        if explicit and isinstance(exc, E.UnsupportedError):
            return f"err:{name}", False  # the user named a backend that cannot do this
        codec = (st.get("compression") or "").split("@")[0]
        if codec and codec != "none" and st["dtype"] in P.INTS and isinstance(exc, E.DtypeError):
            return f"err:{name}", False  # a lossy codec refuses integers (documented)
        if codec and st.get("reduce") not in (None, "sum", "avg") \
                and isinstance(exc, E.UnsupportedError):
            return f"err:{name}", False  # compressed reductions are sums (documented)
        tb = "".join(traceback.format_exception(exc, limit=-4)).strip().splitlines()
        return f"FAIL {name}: {str(exc)[:400]} | {' / '.join(tb[-6:])[:600]}", True

    # ---- the calls ----------------------------------------------------------------------
    def step(self, st: dict):
        """Issue one step; (work or None, check) for a member, None for a non-member."""
        spec = self.pool[st["group"]]
        ranks = spec["ranks"]
        if self.rank not in ranks:
            return None
        g = self.groups[st["group"]]
        n, me = len(ranks), ranks.index(self.rank)
        st = dict(st)
        if st.get("bad"):
            return self.bad(st, g, n, me, ranks)
        op = getattr(self, "op_" + st["op"])
        return op(st, g, n, me, ranks)

    def kw(self, st, compress=False):
        kw = {"backend": st["backend"]}
        if compress and st.get("compression"):
            kw["compression"] = st["compression"]
        return kw

    def api(self, front):
        return {"core": core, "torch": dist}[front]

    def vals(self, st, r, shape, salt=0):
        return P.values(st, r, shape, salt)

    def alias_source(self, st, ranks):
        """(the buffer of the aliased step, every group rank's expected content) or None."""
        src = st.get("alias")
        if src is None or src not in self.results:
            return None
        return self.results[src]

    def in_place_inputs(self, st, ranks):
        """(the buffer to work on in place, or None for a new one; every group rank's
        input): an aliased step's are the earlier step's buffer and expected content."""
        src = self.alias_source(st, ranks)
        if src is not None:
            return src
        return None, [self.vals(st, r, P.shape_of(st)) for r in ranks]

    def keep(self, st, buf, expect_all):
        if st["i"] in self.aliased:
            self.results[st["i"]] = (buf, expect_all)

    def checker(self, st, n, pairs):
        """A check of [(actual object, expected array, what)], skipped for a step whose
        buffer a later step rewrites (that step checks the content)."""
        def check():
            if st["i"] in self.aliased:
                return
            for obj, exp, what, *scale in pairs:  # scale: S of a compressed reduction
                compare(to_np(obj, st["dtype"]), exp, st, n, f"step {st['i']} {st['op']} {what}",
                        *scale)
        return check

    def issue(self, st, call):
        """Run ``call(async_op)``: (work, ...) for async steps, else (None, ...)."""
        if st["async"]:
            return call(True)
        call(False)
        return None

    def op_all_reduce(self, st, g, n, me, ranks):
        buf, ins = self.in_place_inputs(st, ranks)
        red = st.get("reduce", "sum")
        exp = P.reduce_all(ins, red, st["dtype"])
        f = st["front"]
        if f in ("jax", "jit"):
            x = make(f, ins[me])
            fn = lambda v: mj.all_reduce(v, op=RED[red], group=g, **self.kw(st, True))  # noqa: E731
            y = (jax.jit(fn) if f == "jit" else fn)(x)
            return None, self.checker(st, n, [(y, exp, "result", contributions(ins, red))])
        if buf is None:
            buf = make(f, ins[me])
        self.keep(st, buf, [exp] * n)
        w = self.issue(st, lambda a: self.api(f).all_reduce(buf, op=RED[red], group=g,
                                                            async_op=a, **self.kw(st, True)))
        return w, self.checker(st, n, [(buf, exp, "result", contributions(ins, red))])

    def op_broadcast(self, st, g, n, me, ranks):
        buf, ins = self.in_place_inputs(st, ranks)
        root = st["root"]
        exp = ins[ranks.index(root)]
        f = st["front"]
        if f in ("jax", "jit"):
            fn = lambda v: mj.broadcast(v, src=root, group=g, backend=st["backend"])  # noqa: E731
            y = (jax.jit(fn) if f == "jit" else fn)(make(f, ins[me]))
            return None, self.checker(st, n, [(y, exp, "result")])
        if buf is None:
            buf = make(f, ins[me])
        self.keep(st, buf, [exp] * n)
        w = self.issue(st, lambda a: self.api(f).broadcast(buf, src=root, group=g, async_op=a,
                                                           backend=st["backend"]))
        return w, self.checker(st, n, [(buf, exp, "result")])

    def op_reduce(self, st, g, n, me, ranks):
        root, red = st["root"], st.get("reduce", "sum")
        ins = [self.vals(st, r, P.shape_of(st)) for r in ranks]
        exp = P.reduce_all(ins, red, st["dtype"])
        f = st["front"]
        mine = self.rank == root
        if f in ("jax", "jit"):
            y = mj.reduce(make(f, ins[me]), dst=root, op=RED[red], group=g, backend=st["backend"])
            return None, self.checker(st, n, [(y, exp if mine else ins[me], "result")])
        buf = make(f, ins[me])
        w = self.issue(st, lambda a: self.api(f).reduce(buf, dst=root, op=RED[red], group=g,
                                                        async_op=a, backend=st["backend"]))
        return w, self.checker(st, n, [(buf, exp, "result")] if mine else [])

    def op_all_gather_into_tensor(self, st, g, n, me, ranks):
        shape = P.shape_of(st)
        ins = [self.vals(st, r, shape) for r in ranks]
        exp = np.concatenate(ins) if ins[0].ndim else np.stack(ins)
        f = st["front"]
        out = make(f, np.zeros_like(exp))
        c = shape[0]
        if st["seed"] % 5 == 0:  # in place: the input is this rank's block of the output
            inp = out[me * c:(me + 1) * c]
            inp[...] = make(f, ins[me]) if f == "torch" else ins[me]
        else:
            inp = make(f, ins[me])
        self.keep(st, out, [exp] * n)
        w = self.issue(st, lambda a: self.api(f).all_gather_into_tensor(
            out, inp, group=g, async_op=a, **self.kw(st, True)))
        return w, self.checker(st, n, [(out, exp, "output")])

    def op_all_gather(self, st, g, n, me, ranks):
        shape = P.shape_of(st)
        ins = [self.vals(st, r, shape) for r in ranks]
        f = st["front"]
        if f in ("jax", "jit"):
            fn = lambda v: mj.all_gather(v, group=g, **self.kw(st, True))  # noqa: E731
            y = (jax.jit(fn) if f == "jit" else fn)(make(f, ins[me]))
            return None, self.checker(st, n, [(y, np.stack(ins), "result")])
        outs = [make(f, np.zeros(shape, P.np_dtype(st["dtype"]))) for _ in range(n)]
        w = self.issue(st, lambda a: self.api(f).all_gather(outs, make(f, ins[me]), group=g,
                                                            async_op=a, **self.kw(st, True)))
        return w, self.checker(st, n, [(o, e, f"output[{j}]") for j, (o, e)
                                       in enumerate(zip(outs, ins))])

    def op_reduce_scatter_tensor(self, st, g, n, me, ranks):
        c = st["count"]
        red = st.get("reduce", "sum")
        ins = [self.vals(st, r, (n * c,)) for r in ranks]
        exp = P.reduce_all([x[me * c:(me + 1) * c] for x in ins], red, st["dtype"])
        f = st["front"]
        out = make(f, np.zeros((c,), P.np_dtype(st["dtype"])))
        self.keep(st, out, [P.reduce_all([x[j * c:(j + 1) * c] for x in ins], red, st["dtype"])
                            for j in range(n)] if st["i"] in self.aliased else None)
        w = self.issue(st, lambda a: self.api(f).reduce_scatter_tensor(
            out, make(f, ins[me]), op=RED[red], group=g, async_op=a, **self.kw(st, True)))
        mine = [x[me * c:(me + 1) * c] for x in ins]
        return w, self.checker(st, n, [(out, exp, "output", contributions(mine, red))])

    def op_reduce_scatter(self, st, g, n, me, ranks):
        c = st["count"]
        red = st.get("reduce", "sum")
        f = st["front"]
        if f in ("jax", "jit"):
            ins = [self.vals(st, r, (n * c,)) for r in ranks]
            exp = P.reduce_all([x[me * c:(me + 1) * c] for x in ins], red, st["dtype"])
            fn = lambda v: mj.reduce_scatter(v, op=RED[red], group=g, **self.kw(st, True))  # noqa: E731
            y = (jax.jit(fn) if f == "jit" else fn)(make(f, ins[me]))
            mine = [x[me * c:(me + 1) * c] for x in ins]
            return None, self.checker(st, n, [(y, exp, "result", contributions(mine, red))])
        ins = [[self.vals(st, r, (c,), salt=j) for j in range(n)] for r in ranks]
        exp = P.reduce_all([x[me] for x in ins], red, st["dtype"])
        out = make(f, np.zeros((c,), P.np_dtype(st["dtype"])))
        lst = [make(f, x) for x in ins[me]]
        w = self.issue(st, lambda a: self.api(f).reduce_scatter(
            out, lst, op=RED[red], group=g, async_op=a, **self.kw(st, True)))
        return w, self.checker(st, n, [(out, exp, "output",
                                        contributions([x[me] for x in ins], red))])

    def _a2a_counts(self, st, n):
        cols = st.get("cols", 1)
        if st.get("splits") is not None:
            m = np.array(st["splits"])
        else:
            m = np.full((n, n), st["count"])
        return m, cols

    def op_all_to_all_single(self, st, g, n, me, ranks):
        m, cols = self._a2a_counts(st, n)
        uneven = st.get("splits") is not None
        ins = [self.vals(st, r, (int(m[i].sum()), cols) if cols > 1 else (int(m[i].sum()),))
               for i, r in enumerate(ranks)]
        blocks = [P.rows_split(x, m[i]) for i, x in enumerate(ins)]
        exp_all = [np.concatenate([blocks[i][j] for i in range(n)]) for j in range(n)]
        exp = exp_all[me]
        f = st["front"]
        in_s = [int(v) for v in m[me]] if uneven else None
        out_s = [int(v) for v in m[:, me]] if uneven else None
        if f in ("jax", "jit"):
            fn = lambda v: mj.all_to_all(v, group=g, input_split_sizes=in_s,  # noqa: E731
                                         output_split_sizes=out_s, **self.kw(st, True))
            y = (jax.jit(fn) if f == "jit" else fn)(make(f, ins[me]))
            return None, self.checker(st, n, [(y, exp, "result")])
        out = make(f, np.zeros_like(exp))
        inp = make(f, ins[me])
        self.keep(st, out, exp_all)
        w = self.issue(st, lambda a: self.api(f).all_to_all_single(
            out, inp, output_split_sizes=out_s, input_split_sizes=in_s, group=g, async_op=a,
            **self.kw(st, True)))
        return w, self.checker(st, n, [(out, exp, "output"), (inp, ins[me], "input (unchanged)")])

    def op_all_to_all(self, st, g, n, me, ranks):
        m, cols = self._a2a_counts(st, n)
        shp = (lambda k: (int(k), cols)) if cols > 1 else (lambda k: (int(k),))
        ins = [[self.vals(st, r, shp(m[i][j]), salt=j) for j in range(n)]
               for i, r in enumerate(ranks)]
        f = st["front"]
        outs = [make(f, np.zeros(shp(m[i][me]), P.np_dtype(st["dtype"]))) for i in range(n)]
        lst = [make(f, x) for x in ins[me]]
        w = self.issue(st, lambda a: self.api(f).all_to_all(outs, lst, group=g, async_op=a,
                                                            **self.kw(st, True)))
        return w, self.checker(st, n, [(o, ins[i][me], f"output[{i}]")
                                       for i, o in enumerate(outs)])

    def op_gather(self, st, g, n, me, ranks):
        root = st["root"]
        shape = P.shape_of(st)
        ins = [self.vals(st, r, shape) for r in ranks]
        f = st["front"]
        mine = self.rank == root
        if f in ("jax", "jit"):
            y = mj.gather(make(f, ins[me]), dst=root, group=g, backend=st["backend"])
            return None, self.checker(st, n, [(y, np.stack(ins) if mine else ins[me], "result")])
        lst = [make(f, np.zeros(shape, P.np_dtype(st["dtype"]))) for _ in range(n)] if mine else None
        w = self.issue(st, lambda a: self.api(f).gather(make(f, ins[me]), lst, dst=root, group=g,
                                                        async_op=a, backend=st["backend"]))
        return w, self.checker(st, n, [(o, e, f"gather_list[{j}]") for j, (o, e)
                                       in enumerate(zip(lst or [], ins))])

    def op_scatter(self, st, g, n, me, ranks):
        root = st["root"]
        shape = P.shape_of(st)
        blocks = [self.vals(st, root, shape, salt=j) for j in range(n)]
        f = st["front"]
        mine = self.rank == root
        if f in ("jax", "jit"):
            x = np.stack(blocks) if mine else np.zeros((n, *shape), P.np_dtype(st["dtype"]))
            y = mj.scatter(make(f, x), src=root, group=g, backend=st["backend"])
            return None, self.checker(st, n, [(y, blocks[me], "result")])
        out = make(f, np.zeros(shape, P.np_dtype(st["dtype"])))
        lst = [make(f, b) for b in blocks] if mine else None
        w = self.issue(st, lambda a: self.api(f).scatter(out, lst, src=root, group=g, async_op=a,
                                                         backend=st["backend"]))
        return w, self.checker(st, n, [(out, blocks[me], "output")])

    def op_barrier(self, st, g, n, me, ranks):
        self.api(st["front"]).barrier(group=g, backend=st["backend"])
        return None, lambda: None

    def op_ring(self, st, g, n, me, ranks):
        if n < 2:
            return None, lambda: None
        shape = P.shape_of(st)
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
        mine = self.vals(st, self.rank, shape)
        exp = self.vals(st, prv, shape)
        f, tag = st["front"], st["tag"]
        if f in ("jax", "jit"):
            fn = lambda v, like: mj.sendrecv(v, like, source=prv, dest=nxt, group=g,  # noqa: E731
                                             tag=tag, backend=st["backend"])
            y = (jax.jit(fn) if f == "jit" else fn)(make(f, mine), make(f, np.zeros_like(exp)))
            return None, self.checker(st, n, [(y, exp, "received")])
        return self.exchange(st, g, nxt, prv, make(f, mine), exp, batch=False)

    def op_pair(self, st, g, n, me, ranks):
        if n < 2 or self.rank not in (st["src"], st["dst"]):
            return None  # not a party to it: skip
        shape = P.shape_of(st)
        data = self.vals(st, st["src"], shape)
        f, tag, api = st["front"], st["tag"], self.api(st["front"])
        if self.rank == st["src"]:
            buf = make(f, data)
            if st["async"]:
                return api.isend(buf, dst=st["dst"], group=g, tag=tag, backend=st["backend"]), \
                    lambda: None
            api.send(buf, dst=st["dst"], group=g, tag=tag, backend=st["backend"])
            return None, lambda: None
        out = make(f, np.zeros_like(data))
        if st["async"]:
            w = api.irecv(out, src=st["src"], group=g, tag=tag, backend=st["backend"])
        else:
            api.recv(out, src=st["src"], group=g, tag=tag, backend=st["backend"])
            w = None
        return w, self.checker(st, n, [(out, data, "received")])

    def op_batch(self, st, g, n, me, ranks):
        if n < 2:
            return None, lambda: None
        shape = P.shape_of(st)
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
        mine = make(st["front"], self.vals(st, self.rank, shape))
        return self.exchange(st, g, nxt, prv, mine, self.vals(st, prv, shape), batch=True)

    def exchange(self, st, g, nxt, prv, mine, exp, batch: bool):
        """Receive from ``prv`` and send ``mine`` to ``nxt``: isend/irecv or one
        batch_isend_irecv; waited now, or later for an async step."""
        f, api, tag = st["front"], self.api(st["front"]), st["tag"]
        out = make(f, np.zeros_like(exp))
        if batch:
            works = core.batch_isend_irecv([core.P2POp(api.irecv, out, prv, g, tag),
                                            core.P2POp(api.isend, mine, nxt, g, tag)],
                                           backend=st["backend"])
        else:
            works = [api.irecv(out, src=prv, group=g, tag=tag, backend=st["backend"]),
                     api.isend(mine, dst=nxt, group=g, tag=tag, backend=st["backend"])]
        if not st["async"]:
            for w in works:
                w.wait()
            works = None
        return works, self.checker(st, n=len(self.pool[st["group"]]["ranks"]),
                                   pairs=[(out, exp, "received")])

    # ---- bad input: the same error on every member, nothing sent ----------------------------
    def bad(self, st, g, n, me, ranks):
        f, kind = st["front"], st["bad"]
        api = self.api(f)
        c = max(st["count"], 1)
        z = lambda k, dt="float32": make(f, np.zeros((k,), dt))  # noqa: E731
        if kind == "a2a_sizes":
            call = lambda: api.all_to_all_single(z(n * c + n), z(n * c), group=g,  # noqa: E731
                                                 backend=st["backend"])
        elif kind == "a2a_split_sum":
            call = lambda: api.all_to_all_single(z(n * c), z(n * c), [c] * n,  # noqa: E731
                                                 [c + 1] * n, group=g, backend=st["backend"])
        elif kind == "bad_root":
            call = lambda: api.broadcast(z(c), src=len(self.pool[0]["ranks"]) + 3, group=g,  # noqa: E731
                                         backend=st["backend"])
        elif kind == "bad_tag":
            if n < 2:
                return None, lambda: None
            peer = ranks[(me + 1) % n] if me % 2 == 0 else ranks[(me - 1) % n]
            if peer == self.rank or (n % 2 == 1 and me == n - 1):
                return None
            tag = st["tag"]
            call = (lambda: api.isend(z(c), dst=peer, group=g, tag=tag, backend=st["backend"])) \
                if me % 2 == 0 else \
                (lambda: api.irecv(z(c), src=peer, group=g, tag=tag, backend=st["backend"]))
        elif kind == "rs_size":
            call = lambda: api.reduce_scatter_tensor(z(c), z(n * c + 1), group=g,  # noqa: E731
                                                     backend=st["backend"])
        elif kind == "ag_size":
            call = lambda: api.all_gather_into_tensor(z(n * c + 1), z(c), group=g,  # noqa: E731
                                                      backend=st["backend"])
        elif kind == "bitwise_float":
            call = lambda: api.all_reduce(z(c, st["dtype"]), op=core.ReduceOp.BAND, group=g,  # noqa: E731
                                          backend=st["backend"])
        elif kind == "unknown_backend":
            call = lambda: api.all_reduce(z(c), group=g, backend="nosuch")  # noqa: E731
        elif kind == "unknown_codec":
            call = lambda: api.all_reduce(z(c), group=g, backend=st["backend"],  # noqa: E731
                                          compression="zz9")
        else:  # dtype_mix
            call = lambda: api.all_gather_into_tensor(z(n * c), z(c, "int32"), group=g,  # noqa: E731
                                                      backend=st["backend"])

        def check():
            try:
                call()
            except E.McrdlError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise RuntimeError(f"bad input {kind} raised {type(exc).__name__} (not an "
                                   f"mcrdl_core.errors class): {exc}") from exc
            raise Mismatch(f"bad input {kind} was accepted")
        return None, check


def compare_outcomes(prog, words_by_rank) -> list[str]:
    """Failures of a program: steps that failed on a rank, and steps whose members'
    outcomes differ (one rank raised, another did not)."""
    pool = P.group_pool(prog["nranks"])
    fails = []
    for k, st in enumerate(prog["steps"]):
        members = pool[st["group"]]["ranks"]
        words = {r: words_by_rank[r][k] for r in members}
        for r, w in words.items():
            if w.startswith("FAIL"):
                fails.append(f"step {st['i']} ({st['op']}) rank {r}: {w}")
        kinds = {w.split(" ")[0] for w in words.values() if w not in ("skip", "abandoned")}
        errs = {w for w in words.values() if w.startswith("err:")}
        if errs and len(kinds) > 1:
            fails.append(f"step {st['i']} ({st['op']}): ranks disagree: {words}")
    return fails


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0:4", help="A:B, the seeds A..B-1")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--program", help="a program file (JSON) to run instead of seeds")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop starting seeds after this")
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep-going", action="store_true",
                    help="go on after a program whose results were wrong (not after a hang)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    side = MPI.COMM_WORLD.Dup()  # the ranks compare outcomes off MCR-DL's channels
    core.init()
    rank, size = core.get_rank(), core.get_world_size()
    rph = int(os.environ.get("MCRDL_RANKS_PER_HOST") or 0)
    pool = P.group_pool(size)
    groups = [None if spec.get("world") else core.new_group(spec["ranks"], backend=spec["backend"])
              for spec in pool]
    # every member makes its first call on each group and backend together (documented:
    # a communicator is made at the first call, by every member), so that a later
    # point-to-point step between two members can be the group's first traffic
    for spec, g in zip(pool, groups):
        if rank in spec["ranks"]:
            for name in ("mpi", "gloo"):
                core.barrier(group=g, backend=name)
    runner = Runner(groups, pool, out)
    if a.program:
        progs = [json.loads(Path(a.program).read_text())]
    else:
        lo, hi = (int(v) for v in a.seeds.split(":"))
        progs = (P.make_program(s, size, a.steps, rph) for s in range(lo, hi))
    t0 = time.monotonic()
    report = {"ranks": size, "ran": [], "failed": None}
    status = 0
    for prog in progs:
        # rank 0's clock decides for everyone: ranks that judged the time alone could
        # part ways here, some starting one more program than the others
        if a.minutes and side.bcast(time.monotonic() - t0 > a.minutes * 60, root=0):
            break
        words = runner.run(prog)
        everyone = side.allgather(words)
        fails = compare_outcomes(prog, everyone)
        report["ran"].append(prog["seed"])
        if fails:
            status = 1
            if report["failed"] is None:
                report["failed"] = {"seed": prog["seed"], "failures": fails, "program": prog}
            report.setdefault("all_failures", []).append({"seed": prog["seed"], "failures": fails})
            if not a.keep_going or runner.broken:
                break
        if side.allreduce(runner.broken, op=MPI.LOR):
            break
    if rank == 0:
        report["refusals"] = sorted([*k, v] for k, v in runner.refusals.items())
        (out / "result.json").write_text(json.dumps(report))
    side.Barrier()
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
