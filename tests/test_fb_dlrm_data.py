"""bench/apps/fb_dlrm_data.py: its whole-array draws must give facebookresearch/dlrm's
random mini-batches exactly (same tensors, same dtypes, the generator left in the same
state), and leave the cases it does not cover to the program's own function. And
``bench/apps/table.py --apps fb_dlrm``, which runs that program through fb_dlrm.py.

The reference below is the program's per-sample loop for uniform indices, written
from its behaviour (one ``random(1)`` per sample and table, ``np.unique`` of the
rounded index, offsets counting up), since the dlrm checkout is not a dependency."""
from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

_PATH = Path(__file__).resolve().parents[1] / "bench" / "apps" / "fb_dlrm_data.py"


def _module():
    spec = importlib.util.spec_from_file_location("fb_dlrm_data", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _per_sample(m_den, ln_emb, n, per_lookup, fixed, dist, *rest):
    """The program's draw, one sample at a time (uniform; ``per_lookup`` indices)."""
    assert dist == "uniform"
    ra = np.random
    dense = torch.tensor(ra.rand(n, m_den).astype(np.float32))
    offsets, indices = [], []
    for size in ln_emb:
        offs, idx, at = [], [], 0
        for _ in range(n):
            k = np.int64(per_lookup) if fixed else np.int64(
                np.round(max([1.0], ra.random(1)[0] * min(size, per_lookup))))
            group = np.unique(np.round(ra.random(k) * (size - 1)).astype(np.int64))
            offs.append(at)
            idx += group.tolist()
            at += group.size
        offsets.append(torch.tensor(offs))
        indices.append(torch.tensor(idx))
    return dense, offsets, indices


def _draw(fn, seed, *args):
    np.random.seed(seed)
    out = fn(*args)
    return out, np.random.random(3)  # what the next draw gives: the state after


@pytest.mark.parametrize("n, ln_emb", [(0, [7]), (1, [5, 1]), (257, [20000, 3, 1, 977])])
def test_the_whole_array_draw_equals_the_per_sample_one(n, ln_emb):
    dp = types.SimpleNamespace(generate_dist_input_batch=_per_sample)
    _module().patch(dp)
    args = (13, np.array(ln_emb), n, 1, True, "uniform", 1, 1, -1, 1)
    (d0, o0, i0), after0 = _draw(_per_sample, 123, *args)
    (d1, o1, i1), after1 = _draw(dp.generate_dist_input_batch, 123, *args)
    assert torch.equal(d0, d1) and d0.dtype == d1.dtype
    assert len(o0) == len(o1) == len(i0) == len(i1) == len(ln_emb)
    for a, b in zip(o0 + i0, o1 + i1):
        assert a.dtype == b.dtype and torch.equal(a, b)
        assert n == 0 or a.dtype == torch.int64  # (the program's empty batch: float32)
    assert np.array_equal(after0, after1)


@pytest.mark.parametrize("per_lookup, fixed", [(3, True), (1, False), (4, False)])
def test_other_cases_run_the_programs_own_draw(per_lookup, fixed):
    calls = []

    def original(*args):
        calls.append(args)
        return _per_sample(*args)

    dp = types.SimpleNamespace(generate_dist_input_batch=original)
    _module().patch(dp)
    args = (4, np.array([50, 9]), 16, per_lookup, fixed, "uniform", 1, 1, -1, 1)
    (d0, o0, i0), _ = _draw(_per_sample, 7, *args)
    (d1, o1, i1), _ = _draw(dp.generate_dist_input_batch, 7, *args)
    assert len(calls) == 1
    assert torch.equal(d0, d1) and all(torch.equal(a, b) for a, b in zip(o0 + i0, o1 + i1))


def test_the_apps_table_runs_fb_dlrm_through_its_script(monkeypatch, tmp_path):
    """``table.py --apps fb_dlrm`` needs the checkout; a run goes through
    fb_dlrm_data.py in the checkout with absolute paths, is timed after the first print
    interval, and is reported as an app's result without a comm share."""
    monkeypatch.syspath_prepend(str(_PATH.parent))
    import fb_dlrm
    import table

    with pytest.raises(SystemExit):
        table.parse(["--apps", "fb_dlrm"])
    assert table.parse(["--apps", "fb_dlrm", "--dlrm", "x"]).dlrm == "x"
    seen = []
    ms_per_it = ((10, 900.0), (20, 200.0), (30, 100.0), (40, 300.0), (50, 200.0), (60, 200.0))
    printed = "".join(f"Finished training it {i}/60 of epoch 0, {ms:.2f} ms/it, "
                      f"loss {0.9 - i / 1e3:.6f}\n" for i, ms in ms_per_it)

    def run(cmd, **kw):
        seen.append((cmd, kw))
        return types.SimpleNamespace(returncode=0, stdout=printed, stderr="")

    monkeypatch.setattr(fb_dlrm.subprocess, "run", run)
    monkeypatch.chdir(tmp_path)
    for i, tuned in ((3, True), (1, False)):  # tuned; forced mpi
        r = table.launch("fb_dlrm", 4, table.variants("int8")[i], 60, "t.json", "1gbit", 2,
                         "comm", "dlrm")
        # its 20-60 (after the first interval): 200 ms/it on average, 2048 samples each
        assert r == {"samples_per_s": pytest.approx(10240.0), "losses": [0.84],
                     "comm_share": None}
    (cmd, kw), (cmd_mpi, kw_mpi) = seen
    assert kw["cwd"] == tmp_path / "dlrm"
    assert cmd[cmd.index(str(_PATH)) + 1] == str(tmp_path / "dlrm" / "dlrm_s_pytorch.py")
    assert "--print-freq=10" in cmd and "--num-batches=60" in cmd
    assert kw["env"]["MCRDL_TUNING_TABLE"] == str(tmp_path / "t.json")
    assert kw_mpi["env"]["MCRDL_TUNING_TABLE"] == "none"
    assert kw_mpi["env"]["MCRDL_BACKEND"] == "mpi"
    assert table._median_share([r, r]) is None
    assert table._median_share([{"comm_share": 0.2}, r, {"comm_share": 0.4}]) == pytest.approx(0.3)
    assert (table._share(None), table._share(0.25)) == ("-", "25%")
