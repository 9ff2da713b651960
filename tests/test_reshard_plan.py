"""The resharding planner alone (no communication): property tests with hypothesis over
random meshes, specs, shapes, host maps and planning options, plus the layouts'
chunking rules, the plan's serialization and the converters from DTensor and JAX."""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcrdl_core.base.errors import InvalidArgumentError
from mcrdl_core.reshard import BALANCES, METHODS, ORDERS, Layout, Mesh, Plan
from mcrdl_core.reshard.layout import box_shape, chunk_bounds
from mcrdl_core.reshard.planner import make_plan


@st.composite
def layouts(draw, ndim, pool):
    naxes = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, 3), min_size=naxes, max_size=naxes))
    n = int(np.prod(sizes))
    ranks = draw(st.permutations(pool))[:n]
    if len(ranks) < n:
        sizes, ranks = [len(ranks)], ranks
    names = [f"a{i}" for i in range(len(sizes))]
    mesh = Mesh(np.array(ranks).reshape(sizes), names)
    spec = [[] for _ in range(ndim)]
    for a in draw(st.permutations(names)):
        d = draw(st.integers(-1, ndim - 1)) if ndim else -1
        if d >= 0:
            spec[d].append(a)
    return Layout(mesh, [tuple(e) for e in spec], draw(st.sampled_from(["flat", "nested"])))


@st.composite
def problems(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    pool = list(range(draw(st.integers(1, 12))))
    src = draw(layouts(ndim, pool))
    dst = draw(layouts(ndim, pool))
    hosts = draw(st.one_of(st.none(), st.integers(1, 4),
                           st.lists(st.sampled_from("abc"), min_size=12, max_size=12)))
    opts = dict(method=draw(st.sampled_from(METHODS)), balance=draw(st.sampled_from(BALANCES)),
                order=draw(st.sampled_from(ORDERS)), hosts=hosts)
    dtype = draw(st.sampled_from(["float32", "bool", "bfloat16", "int64"]))
    return shape, dtype, src, dst, opts


def _inside(box, tile):
    return all(t0 <= b0 and b1 <= t1 for (b0, b1), (t0, t1) in zip(box, tile))


SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(problems())
def test_plan_properties(prob):
    shape, dtype, src, dst, opts = prob
    check_plan(shape, dtype, src, dst, opts)


def check_plan(shape, dtype, src, dst, opts):
    plan = make_plan(shape, dtype, src, dst, **opts)
    isz = np.dtype(plan.dtype if plan.dtype != "bfloat16" else "uint16").itemsize
    src_tiles = {r: src.tile(shape, r) for r in src.mesh.rank_list()}
    # every destination replica gets every unit of its tile exactly once (boxes partition it)
    for r in dst.mesh.rank_list():
        tile = dst.tile(shape, r)
        cover = np.zeros(box_shape(tile), np.int64)
        boxes = [t.box for t in plan.transfers if r in t.receivers]
        boxes += [b for rr, b in plan.local if rr == r]
        for b in boxes:
            assert _inside(b, tile)
            cover[tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(b, tile))] += 1
        assert (cover == 1).all(), (r, tile, boxes)
    for t in plan.transfers:
        # each box lies in its sender's source tile; the sender is a replica of it
        assert t.sender in t.candidates and _inside(t.box, src_tiles[t.sender])
        assert all(_inside(t.box, src_tiles[c]) for c in t.candidates)
        # nobody receives what it already holds; receivers are distinct
        assert not set(t.receivers) & set(t.candidates)
        assert len(set(t.receivers)) == len(t.receivers) and t.receivers
        assert t.nbytes == int(np.prod(box_shape(t.box))) * isz > 0
        if opts.get("balance") == "first":
            assert t.sender == min(t.candidates)
    for r, b in plan.local:  # local copies: data the rank holds already
        assert r in src_tiles and _inside(b, src_tiles[r])
    # no host appears twice in a round
    seen = {}
    for t in plan.transfers:
        hs = {plan.hosts[r] for r in t.ranks()}
        used = seen.setdefault(t.round, set())
        assert not used & hs, (t, used)
        used |= hs
    assert [t.round for t in plan.transfers] == sorted(t.round for t in plan.transfers)
    # the prediction never beats the lower bound
    assert plan.lower_bound_s <= plan.predicted_s * (1 + 1e-9) + 1e-15
    # deterministic, and the JSON round trip keeps the fingerprint
    again = make_plan(shape, dtype, src, dst, **opts)
    assert again.to_json() == plan.to_json()
    back = Plan.from_json(plan.to_json())
    assert back.fingerprint() == plan.fingerprint() and back.to_json() == plan.to_json()


_BIG = Mesh(np.arange(64).reshape(8, 8), ("x", "y"))
_BIG2 = Mesh(np.arange(32, 96).reshape(4, 16), ("p", "q"))


@pytest.mark.parametrize("shape, src, dst", [
    ((50, 37), Layout(_BIG, ["x", "y"]), Layout(_BIG2, ["q", "p"])),  # uneven, overlapping
    ((50, 37), Layout(_BIG, ["x"]), Layout(_BIG2, [None, ("p", "q")], "nested")),  # replicas
    ((101,), Layout(_BIG, [("x", "y")]), Layout(_BIG2, [("q", "p")], "nested")),
    ((6, 5, 4), Layout(_BIG, [None, "y"]), Layout(_BIG2, ["p", None, "q"])),
])
@pytest.mark.parametrize("opts", [dict(hosts=8), dict(hosts=4, balance="least_load"),
                                  dict(hosts=3, method="send_recv", order="naive"),
                                  dict(hosts=8, method="send_recv_allgather")])
def test_plan_properties_on_bigger_meshes(shape, src, dst, opts):
    """The planner's array code over meshes of 64 ranks: many replicas per host, ranks
    in both meshes, uneven and empty blocks."""
    check_plan(shape, "float32", src, dst, opts)


def test_chunking_jax_and_dtensor_rules():
    assert chunk_bounds(5, [2, 2], "flat") == [0, 2, 4, 5, 5]  # ceil(5/4) = 2
    assert chunk_bounds(5, [2, 2], "nested") == [0, 2, 3, 4, 5]  # chunk(3, 2), then (2, 2)
    assert chunk_bounds(3, [4], "flat") == [0, 1, 2, 3, 3]  # the last block empty
    assert chunk_bounds(0, [3], "nested") == [0, 0, 0, 0]


def test_layout_tiles_and_replicas():
    mesh = Mesh([[4, 5, 6], [7, 8, 9]], ("x", "y"))
    lay = Layout(mesh, [("y", "x")])  # dim 0 over 6 blocks, y major
    assert lay.tile((12,), 4) == ((0, 2),) and lay.tile((12,), 7) == ((2, 4),)
    assert lay.tile((12,), 5) == ((4, 6),) and lay.tile((12,), 3) is None
    rep = Layout(mesh, [None, "x"])
    assert rep.tile((3, 4), 4) == rep.tile((3, 4), 6) == ((0, 3), (0, 2))


def test_overlapping_meshes_copy_in_place_and_balance_by_host():
    a = Layout(Mesh([0, 1, 2, 3], ("r",)), [])  # replicated on 4 ranks, 2 hosts
    b = Layout(Mesh([[0, 1], [2, 3]], ("x", "y")), ["x", "y"])
    p = make_plan((8, 8), "float32", a, b, hosts=2)
    assert not p.transfers and len(p.local) == 4 and p.lower_bound_s == 0
    c = Layout(Mesh([[4, 5], [6, 7]], ("x", "y")), ["x", "y"])  # two other hosts
    lpt = make_plan((8, 8), "float32", a, c, hosts=2, balance="lpt")
    first = make_plan((8, 8), "float32", a, c, hosts=2, balance="first")
    assert {t.sender for t in first.transfers} == {0}
    assert {lpt.hosts[t.sender] for t in lpt.transfers} == {"h0", "h1"}
    assert lpt.lower_bound_s == pytest.approx(first.lower_bound_s / 2)


def test_prediction_counts_the_aggregate_limit_and_chain_fill():
    """1 rank -> 4 hosts, 64 MiB: the chain's link bound is one copy over the link; the
    fill adds 3 segments; an aggregate limit below 4 links' worth of bytes dominates."""
    from mcrdl_core.reshard import LinkModel

    a, b = Layout(Mesh([0], ("r",)), []), Layout(Mesh([1, 2, 3, 4], ("r",)), [])
    n = 64 << 20
    free = make_plan((n,), "uint8", a, b, link=LinkModel(1e8, 0.0, 1e9))
    assert free.lower_bound_s == pytest.approx(n / 1e8)
    assert free.predicted_s == pytest.approx((n + 3 * (1 << 20)) / 1e8)
    tight = make_plan((n,), "uint8", a, b, link=LinkModel(1e8, 0.0, 1e9, 2e8))
    assert tight.predicted_s == pytest.approx(4 * n / 2e8 + 3 * (1 << 20) / 1e8)
    assert Plan.from_json(tight.to_json()).link == tight.link
    with pytest.raises(InvalidArgumentError, match="aggregate"):
        LinkModel(1e8, 0.0, 1e9, -1.0)


def test_plan_json_is_readable():
    a = Layout(Mesh([0], ("r",)), [])
    b = Layout(Mesh([1, 2, 3], ("r",)), [])
    d = json.loads(make_plan((4,), "float32", a, b).to_json())
    assert d["format"] == "mcrdl.reshard.plan" and d["transfers"][0]["receivers"] == [1, 2, 3]
    assert d["host_bytes"]["r0"] == [16, 0]


@pytest.mark.parametrize("bad, msg", [
    (lambda m: Layout(m, ["z"]), "not one of"),
    (lambda m: Layout(m, ["x", "x"]), "twice"),
    (lambda m: Layout(m, [], "ragged"), "chunking"),
    (lambda m: make_plan((4,), "float32", Layout(m, []), Layout(m, []), method="scatter"), "method"),
    (lambda m: make_plan((4,), "float32", Layout(m, []), Layout(m, []), hosts={0: "a"}), "hosts"),
    (lambda m: make_plan((4,), "float32", Layout(m, [None, "x"]), Layout(m, [])),
     "dimensions"),
    (lambda m: Mesh([0, 0], ("x",)), "repeat"),
])
def test_bad_input_says_what_to_do(bad, msg):
    mesh = Mesh([0, 1], ("x",))
    with pytest.raises(InvalidArgumentError, match=msg):
        bad(mesh)


def test_dtensor_placements_convert():
    torch = pytest.importorskip("torch")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Replicate, Shard

    import mcrdl_torch.resharding as tr

    mesh = DeviceMesh("cpu", torch.tensor([[3, 1], [0, 2]]), mesh_dim_names=("dp", "tp"),
                      _init_backend=False, _rank=0)
    lay = tr.layout(mesh, [Shard(0), Shard(0)])
    assert lay.spec == (("dp", "tp"),) and lay.chunking == "nested"
    assert lay.mesh.ranks.tolist() == [[3, 1], [0, 2]]
    # DTensor's own local shapes and offsets for an uneven size agree with the layout's
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for r in range(4):
        m = DeviceMesh("cpu", torch.tensor([[3, 1], [0, 2]]), mesh_dim_names=("dp", "tp"),
                       _init_backend=False, _rank=r)
        for pl in ([Shard(0), Shard(0)], [Shard(1), Replicate()], [Replicate(), Shard(0)]):
            shape, off = compute_local_shape_and_global_offset((5, 3), m, pl)
            box = tr.layout(m, pl).tile((5, 3), r)
            assert tuple(shape) == box_shape(box) and tuple(off) == tuple(lo for lo, _ in box)
    with pytest.raises(Exception, match="Partial"):
        tr.layout(mesh, [Partial(), Replicate()])


def test_jax_sharding_converts():
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh as JMesh
    from jax.sharding import NamedSharding, PartitionSpec as P

    import mcrdl_jax.resharding as jr

    jm = JMesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
    lay = jr.layout(NamedSharding(jm, P(("y", "x"), None)), ranks=[[5]])
    assert lay.spec == (("y", "x"), ()) and lay.chunking == "flat"
    assert lay.mesh.rank_list() == [5]
    mine = Mesh([[0, 1], [2, 3]], ("x", "y"))
    assert jr.layout(P("x", "y"), mesh=mine).tile((3, 3), 3) == ((2, 3), (2, 3))


FIRST_CALL = """
import sys
import numpy as np
import mcrdl_core as mc
from mcrdl_core.reshard import Layout, Mesh
src, dst = Layout(Mesh([0], ("a",)), []), Layout(Mesh([1], ("b",)), [])
x = np.arange(6, dtype=np.float32) if mc.get_rank() == 0 else None
y = mc.reshard(x, src, dst, (6,), dtype=np.float32, method="send_recv", backend=sys.argv[1],
               hosts=1, check=False)
assert (y is None) == (mc.get_rank() != 1) and (y is None or (y == np.arange(6)).all())
print("first-call reshard ok", flush=True)
"""


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_transfer_between_two_of_three_ranks_as_the_first_call(backend):
    """The world communicator that carries the point-to-point messages is created
    collectively over the world: a fresh program whose first call is a reshard between
    ranks 0 and 1 must not leave rank 2 out of that creation (it hung until the
    timeout before reshard made every rank take part)."""
    import os
    import shutil
    import subprocess
    import sys

    bindir = os.path.dirname(sys.executable)
    mpiexec = shutil.which("mpiexec", path=bindir)
    env = dict(os.environ, MCRDL_TIMEOUT="20", MCRDL_TUNING_TABLE="none",
               PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run([mpiexec, "-n", "3", sys.executable, "-c", FIRST_CALL, backend],
                          env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.count("first-call reshard ok") == 3, out[-3000:]
