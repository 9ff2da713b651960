"""The differential fuzzer's programs: generated from a seed, identical on every rank, and
their NumPy reference.

A program is plain data (JSON-able dicts), so a failing one can be printed, saved, shrunk
and replayed (``job.py --program FILE``). ``make_program(seed, nranks)`` draws a random
tuning table (or none), the debug mode and a list of steps; each step is one call of one
frontend (the NumPy core, mcrdl_torch, mcrdl_jax eager or under ``jit``) on one group of
a fixed pool (the world, the world in reverse, a shuffled sub-group, and groups whose
default backend is mpi, gloo or auto), with a dtype, a size (0, 1, odd, up to ~1 MiB),
values (small integers, values near the dtype's range that cancel, or Gaussian data for
codecs), a backend request, maybe a codec, maybe ``async_op`` with its wait some steps
later, maybe an input that is the buffer of an earlier call still in flight (in place,
aliased), and bad-input steps that must raise the same error on every rank.

Every rank can compute every rank's input (``inputs``), so ``reference`` gives the
expected output of every rank; ``job.py`` checks its own against it. Nothing here imports
MCR-DL: the program and its reference do not depend on the code under test.
"""
from __future__ import annotations

import zlib

import numpy as np

try:  # bfloat16 for NumPy (a dependency of jax)
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None

FLOATS = ("float32", "float64", "float16", "bfloat16")
INTS = ("int32", "int64", "int8", "uint8")
#: dtypes each frontend is given (NumPy has no bfloat16 of its own; JAX runs 32-bit)
FRONT_DTYPES = {"core": ("float32", "float64", "float16", "int32", "int64", "int8", "uint8"),
                "torch": FLOATS + INTS,
                "jax": ("float32", "float16", "bfloat16", "int32", "int8", "uint8"),
                "jit": ("float32", "float16", "bfloat16", "int32", "int8", "uint8")}
#: ops each frontend runs in the fuzzer
FRONT_OPS = {
    "core": ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
             "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "all_to_all",
             "gather", "scatter", "barrier", "ring", "pair", "batch"),
    "torch": ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
              "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "all_to_all",
              "gather", "scatter", "barrier", "ring", "pair", "batch"),
    "jax": ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
            "all_to_all_single", "gather", "scatter", "ring"),
    "jit": ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all_single",
            "ring"),
}
ASYNC_FRONTS = ("core", "torch")
#: ops that take ``compression=``, and the codecs with their documented bound on the
#: relative L2 error of one round trip (docs/compression.md)
COMPRESSIBLE = ("all_reduce", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
                "reduce_scatter", "all_to_all_single", "all_to_all")
CODECS = {"fp16": 4.9e-4, "bf16": 3.9e-3, "int8": 6.3e-2, "fp8": 6.25e-2, "none": 0.0}
REDUCERS = ("sum", "max", "min", "product", "avg")
BACKENDS = (None, None, "mpi", "gloo", "auto")
#: tags the fuzzer's point-to-point steps use: the user range is [0, 31740)
#: (mcrdl_core.base.tags.USER_TAG_LIMIT), 0 most often, its edges too
TAGS = (0, 0, 0, 1, 7, 1000, 31739)
#: tags no user call may name (below 0, the core's reserved range, past int32)
BAD_TAGS = (-1, 31740, 31745, 32767, 1 << 40)
BAD_KINDS = ("a2a_sizes", "a2a_split_sum", "bad_root", "bad_tag", "rs_size",
             "ag_size", "bitwise_float", "unknown_backend", "unknown_codec", "dtype_mix")


def group_pool(nranks: int) -> list[dict]:
    """The fixed pool of groups every program draws from (made once per job, in this
    order, by every rank): the world, the world reversed, a shuffled sub-group (all but
    the last rank where there are 3 or more), and groups with a default backend."""
    world = list(range(nranks))
    rev = world[::-1]
    if nranks >= 3:
        sub = [(r * 2 + 1) % nranks for r in range(nranks)][: nranks - 1]
        if len(set(sub)) != len(sub):
            sub = rev[: nranks - 1]
    else:
        sub = rev
    return [{"ranks": world, "backend": None, "world": True},
            {"ranks": rev, "backend": None},
            {"ranks": sub, "backend": None},
            {"ranks": world, "backend": "mpi"},
            {"ranks": world, "backend": "gloo"},
            {"ranks": rev, "backend": "auto"},
            {"ranks": sub, "backend": "gloo"}]


def hosts_of(ranks, ranks_per_host: int) -> int:
    k = ranks_per_host or 0
    return len({r // k for r in ranks}) if k >= 1 else 1


def _table(rng, nranks: int, ranks_per_host: int) -> dict:
    """A random tuning table with crossovers, for every group size and host count of
    the pool: one to three ranges per op and dtype class, on mpi and gloo (and now and
    then a name the job cannot run: nccl, hier:nccl, or a two-level all-reduce)."""
    entries = []
    shapes = sorted({(len(g["ranks"]), hosts_of(g["ranks"], ranks_per_host))
                     for g in group_pool(nranks)})
    ops = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
           "gather", "scatter", "send", "recv", "barrier")
    for op in ops:
        for n, hosts in shapes:
            for cls in ("float", "int"):
                if rng.random() < 0.25:
                    continue
                k = int(rng.integers(1, 4))
                bounds = sorted(rng.choice([16, 64, 1024, 4096, 65536], size=k - 1,
                                           replace=False).tolist())
                names = ["mpi", "gloo"]
                if op == "all_reduce":
                    names += ["hier:mpi", "hier:nccl"]
                if rng.random() < 0.1:
                    names.append("nccl")
                ranges = [[int(b), str(rng.choice(names))] for b in bounds]
                ranges.append([None, str(rng.choice(names))])
                entries.append({"op": op, "world_size": n, "hosts": hosts, "device": "cpu",
                                "dtype_class": cls, "ranges": ranges})
    return {"schema": "mcrdl.tuning/2", "machine": {"host": "fuzz"}, "entries": entries}


def _count(rng) -> int:
    u = rng.random()
    if u < 0.08:
        return 0
    if u < 0.18:
        return 1
    if u < 0.6:
        return int(rng.choice([2, 3, 5, 7, 9, 17, 33]))
    if u < 0.93:
        return int(rng.integers(34, 3000))
    return int(rng.integers(20000, 120000))  # up to ~1 MiB of float64 per rank


def _step(rng, nranks: int, pool, i: int, prior: list[dict]) -> dict:
    front = str(rng.choice(["core", "core", "torch", "torch", "torch", "jax", "jit"],
                           p=[0.22, 0.08, 0.25, 0.2, 0.1, 0.1, 0.05]))
    op = str(rng.choice(FRONT_OPS[front]))
    gi = int(rng.integers(len(pool)))
    ranks = pool[gi]["ranks"]
    n = len(ranks)
    dtype = str(rng.choice(FRONT_DTYPES[front]))
    st = {"i": i, "front": front, "op": op, "group": gi, "dtype": dtype, "count": _count(rng),
          "seed": int(rng.integers(1 << 30)), "backend": BACKENDS[int(rng.integers(len(BACKENDS)))],
          "values": "small", "async": False, "wait": 0, "compression": None}
    if op in ("all_reduce", "all_to_all_single") and front in ASYNC_FRONTS \
            and rng.random() < 0.12:  # mcrdl_jax has no two-level algorithms
        st["backend"] = str(rng.choice(["hier", "hier:mpi", "hier:gloo"]))
    if op in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"):
        red = list(REDUCERS) + (["band", "bor", "bxor"] if dtype in INTS else [])
        if dtype not in FLOATS:
            red.remove("avg")
        st["reduce"] = str(rng.choice(red))
    if op in ("broadcast", "reduce", "gather", "scatter"):
        st["root"] = int(ranks[int(rng.integers(n))])
    if op in ("all_to_all_single", "all_to_all"):
        st["cols"] = int(rng.choice([1, 1, 3]))
        if rng.random() < 0.5:  # uneven: rows rank a sends to rank b, often nearly even
            base = int(rng.integers(0, 4))
            m = np.full((n, n), base, dtype=np.int64)
            if rng.random() < 0.5:
                m = rng.integers(0, 5, size=(n, n))
            else:
                for _ in range(int(rng.integers(1, n + 1))):
                    a, b = rng.integers(n, size=2)
                    m[a, b] = int(rng.integers(0, 5))
            st["splits"] = m.tolist()
        if rng.random() < 0.1:  # one rank exchanges nothing
            m = np.array(st.get("splits") or np.full((n, n), max(1, st["count"] % 4)))
            idle = int(rng.integers(n))
            m[idle, :] = 0
            m[:, idle] = 0
            st["splits"] = m.tolist()
    if op in ("ring", "pair", "batch"):
        st["tag"] = int(TAGS[int(rng.integers(len(TAGS)))])
        st["count"] = min(st["count"], 5000)
        if op == "pair":
            a, b = rng.choice(n, size=2, replace=False) if n > 1 else (0, 0)
            st["src"], st["dst"] = int(ranks[int(a)]), int(ranks[int(b)])
    if front == "jit":
        st["count"] = min(st["count"], 4096)
    if op == "reduce_scatter" or op == "reduce_scatter_tensor":
        st["count"] = min(st["count"], 30000)
    # codecs, where the op takes them (float data; on ints they must change nothing)
    if op in COMPRESSIBLE and front in ("core", "torch", "jax") and rng.random() < 0.3 \
            and not str(st["backend"]).startswith("hier"):
        codec = str(rng.choice(list(CODECS)))
        algo = ""
        if op.startswith(("all_gather", "reduce_scatter", "all_reduce")):
            algo = str(rng.choice(["", "", "@ring", "@p2p", "@a2a"]))
        st["compression"] = codec + algo
        if dtype in FLOATS and codec != "none":
            st["values"] = "normal"
            if st.get("reduce") not in (None, "sum", "avg"):
                # the codecs' error bound composes simply through sums (docs/compression.md)
                st["reduce"] = "sum"
    if (dtype in INTS and st.get("reduce") == "sum" and st["compression"] is None
            and rng.random() < 0.3):
        st["values"] = "range"  # near the integer type's top: sums wrap, as in C
    if st.get("reduce") in ("product",):
        st["values"] = "tiny"
    elif (st["values"] == "small" and dtype == "float16"
          and st.get("reduce") == "sum" and st["backend"] in ("mpi", "hier:mpi")
          and st["compression"] in (None, "none") and rng.random() < 0.4):
        st["values"] = "range"  # large values whose sum is small: accumulate wide, round once
    if front in ASYNC_FRONTS and op != "barrier" and rng.random() < 0.35:
        st["async"] = True
        st["wait"] = int(rng.integers(0, 4))  # waited after this many later steps
    # aliasing: an in-place call on the buffer of an earlier call (maybe still in flight)
    if op in ("all_reduce", "broadcast") and front in ASYNC_FRONTS and rng.random() < 0.3:
        cands = [p for p in prior[-6:] if p["front"] == front and p["group"] == gi
                 and p["op"] in ("all_reduce", "broadcast", "all_to_all_single",
                                 "all_gather_into_tensor", "reduce_scatter_tensor")
                 and "bad" not in p and "alias" not in p and "aliased_by" not in p
                 and p["compression"] is None and p["values"] == "small"
                 and p.get("splits") is None  # a buffer of one shape on every rank
                 and p.get("reduce") not in ("avg", "product")]
        if cands:
            p = cands[-1]
            st["alias"] = p["i"]
            p["aliased_by"] = i
            st["dtype"], st["count"] = p["dtype"], p["count"]
            st["values"] = "small"
            if st.get("reduce") in ("band", "bor", "bxor") and p["dtype"] in FLOATS:
                st["reduce"] = "sum"
            if st.get("reduce") in ("product", "avg"):
                st["reduce"] = "max"
            st.pop("cols", None)
            st["compression"] = None
    if rng.random() < 0.05 and "alias" not in st:
        st["bad"] = str(rng.choice(BAD_KINDS))
        st["tag"] = int(BAD_TAGS[int(rng.integers(len(BAD_TAGS)))])
        st["async"], st["wait"] = False, 0
        if front in ("jax", "jit"):
            st["front"] = "torch"
        st["dtype"] = "float32" if st["bad"] != "bitwise_float" else st["dtype"]
        if st["bad"] == "bitwise_float" and st["dtype"] not in ("float32", "float64"):
            st["dtype"] = "float32"
    return st


def make_program(seed: int, nranks: int, nsteps: int = 24, ranks_per_host: int = 0) -> dict:
    """The program of ``seed`` at ``nranks`` ranks: every rank makes the same one."""
    rng = np.random.default_rng([seed, nranks, 48])
    pool = group_pool(nranks)
    steps: list[dict] = []
    for i in range(nsteps):
        steps.append(_step(rng, nranks, pool, i, steps))
    return {"seed": seed, "nranks": nranks, "ranks_per_host": ranks_per_host,
            "debug": bool(rng.random() < 0.25),
            "table": _table(rng, nranks, ranks_per_host) if rng.random() < 0.5 else None,
            "steps": steps}


# ---- data and reference ------------------------------------------------------------------
def np_dtype(name: str):
    return BF16 if name == "bfloat16" else np.dtype(name)


def shape_of(st: dict, count: int | None = None) -> tuple:
    c = st["count"] if count is None else count
    cols = st.get("cols", 1)
    return (c, cols) if cols > 1 else (c,)


def values(st: dict, rank: int, shape, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s data for step ``st`` (every rank can compute every rank's)."""
    rng = np.random.default_rng([st["seed"], rank, salt, zlib.crc32(st["op"].encode())])
    dt = np_dtype(st["dtype"])
    kind = st["values"]
    if kind == "normal":
        v = rng.standard_normal(shape)  # zero mean: a dropped or swapped block shows
    elif kind == "range":
        # float16 values near its top (40000 of 65504) and a small remainder, signed
        # + + - - by rank: the exact sum is small, a partial sum of two ranks (one host's,
        # with two ranks per host) overflows float16; float32 accumulation is exact
        sign = 1 if (rank // 2) % 2 == 0 else -1
        if st["dtype"] in INTS:
            info = np.iinfo(np_dtype(st["dtype"]))  # integer arithmetic (int64 is exact)
            v = np.int64(info.max) - rng.integers(0, 8, size=shape, dtype=np.int64)
            return (v * (sign if info.min < 0 else 1)).astype(np_dtype(st["dtype"]))
        v = sign * 40000.0 + rng.integers(0, 4, size=shape)
    elif kind == "tiny":
        v = rng.integers(1, 4, size=shape).astype(np.float64)
    else:
        v = rng.integers(1, 6, size=shape).astype(np.float64)
    if st["dtype"] in INTS and st.get("reduce") in ("band", "bor", "bxor"):
        v = rng.integers(0, 100, size=shape).astype(np.float64)
    return v.astype(dt)


def reduce_all(arrs: list[np.ndarray], red: str, dtype: str) -> np.ndarray:
    """The reduction of ``arrs`` computed wide and rounded once to ``dtype``."""
    dt = np_dtype(dtype)
    if dtype in INTS:
        a = np.stack([x.astype(np.int64) for x in arrs])
        if red in ("band", "bor", "bxor"):
            f = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[red]
            out = f.reduce(a, axis=0)
        elif red == "avg":
            out = a.sum(0) // len(arrs)
        else:
            out = {"sum": a.sum(0), "max": a.max(0), "min": a.min(0), "product": a.prod(0)}[red]
        return out.astype(dt)  # wraps as the libraries do
    a = np.stack([x.astype(np.float64) for x in arrs])
    out = {"sum": a.sum(0), "max": a.max(0), "min": a.min(0), "product": a.prod(0),
           "avg": a.mean(0)}[red]
    return out.astype(dt)


def rows_split(arr: np.ndarray, counts) -> list[np.ndarray]:
    offs = np.cumsum([0, *counts])
    return [arr[offs[j]:offs[j + 1]] for j in range(len(counts))]
