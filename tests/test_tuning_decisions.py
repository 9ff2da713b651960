"""How tuning tables are decided and verified, on synthetic per-round timings (no
communication, no timing asserted): the evidence rule, the range optimiser, the
verification and its repairs, the table's verification block, the atomic write, the
stale-table report and the load report."""
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from mcrdl_core.tools import sweep, tuning
from mcrdl_core.base.errors import TableError
from mcrdl_core.observe.logger import CommLogger
from mcrdl_core.dispatch.selection import TuningTable, range_status

US = 1e-6
KEY = ("all_reduce", 2, 1, "cpu", "float")


def rounds(median_us, n=100, spread=0.1, seed=0, tail=0.0):
    """``n`` per-round seconds around ``median_us``: lognormal noise of ``spread`` and,
    with ``tail``, that share of rounds stalled 20x (a busy machine)."""
    rng = np.random.default_rng(seed)
    t = median_us * US * np.exp(rng.normal(0, spread, n))
    stalls = rng.random(n) < tail
    t[stalls] *= 20
    return t


def shared(n, seed, spread=0.3):
    """Per-round machine state both columns of a round share (paired noise)."""
    return np.exp(np.random.default_rng(seed).normal(0, spread, n))


# --- the evidence rule ------------------------------------------------------------------
def test_wins_needed_is_the_sign_test():
    assert tuning.wins_needed(5) == 6  # even 5 of 5 happens 1 in 32 times by chance
    assert tuning.wins_needed(12) == 11  # P(>= 11 of 12) = 13/4096 <= 1%
    assert tuning.wins_needed(12, alpha=0.05) == 10
    ks = [tuning.wins_needed(n) for n in range(12, 201)]
    assert all(k / n > 0.5 for k, n in zip(ks, range(12, 201)))
    assert ks[-1] < 0.6 * 200  # with many rounds a modest majority is enough


def test_noisy_flip_is_not_taken():
    """Two equal backends measured in 100 rounds under heavy, heavy-tailed noise: the
    candidate's median may come out lower, but it never counts as faster."""
    for seed in range(40):
        mpi = rounds(50, seed=seed, spread=0.5, tail=0.2)
        gloo = rounds(50, seed=1000 + seed, spread=0.5, tail=0.2)
        assert tuning.compare(gloo, mpi).faster is not True, seed


def test_a_few_winning_rounds_are_undecided_then_refused():
    """A candidate 20% faster by median but winning barely more than half the rounds
    is undecided (measured again), never taken as is."""
    base = rounds(100, n=40, spread=0.05, seed=1)
    cand = base.copy()
    cand[:22] *= 0.6  # 22 of 40 rounds much faster, the rest a little slower
    cand[22:] *= 1.02
    ev = tuning.compare(cand, base)
    assert ev.ratio <= 1 - tuning.MARGIN and ev.wins == 22 and ev.faster is None
    assert tuning.undecided({"mpi": base, "gloo": cand}, "mpi")


def test_large_consistent_gain_is_taken_even_under_load():
    """Both columns share each round's load (paired); the candidate is 40% faster in
    every round but a few, and 10% of rounds stall: the rule takes it."""
    n = 120
    load = shared(n, 3, spread=0.6)
    mpi = 100 * US * load * np.exp(np.random.default_rng(4).normal(0, 0.05, n))
    gloo = 0.6 * mpi * np.exp(np.random.default_rng(5).normal(0, 0.05, n))
    stalls = np.random.default_rng(6).random(n) < 0.1
    gloo[stalls] *= 20
    ev = tuning.compare(gloo, mpi)
    assert ev.faster is True and ev.ratio == pytest.approx(0.6, rel=0.1)


def test_gain_below_the_margin_or_a_microsecond_is_not_a_switch():
    mpi = rounds(100, seed=7, spread=0.01)
    assert tuning.compare(mpi * 0.97, mpi).faster is False  # every round, but only 3%
    tiny = rounds(2, seed=8, spread=0.01)
    assert tuning.compare(tiny * 0.7, tiny).faster is False  # 30%, but 0.6 us
    assert tuning.compare(tiny * 0.7, tiny, min_gain_s=0).faster is True


def test_exact_figures_are_taken_as_given():
    assert tuning.compare(50 * US, 90 * US).faster is True
    assert tuning.compare(90 * US, 50 * US).faster is False


# --- the range optimiser ----------------------------------------------------------------
SIZES = [1 << k for k in range(2, 16)]  # 4 B .. 32 KiB


def figures(ratio_at, n=60, seed=0):
    """{size: {"mpi": rounds, "gloo": rounds}} with gloo = ratio_at(size) x mpi per
    round (paired) and a little independent noise."""
    out = {}
    for i, s in enumerate(SIZES):
        mpi = rounds(20 + s / 100, n=n, spread=0.05, seed=seed + i)
        gloo = mpi * ratio_at(s) * np.exp(np.random.default_rng(seed + 100 + i).normal(0, .02, n))
        out[s] = {"mpi": mpi, "gloo": gloo}
    return out


def ranges_of(figs, **kw):
    return tuning.decide_entry(figs, "cpu", **kw)["ranges"]


def test_one_size_flip_survives_only_if_large():
    # gloo 25% faster at 256 B only, confidently: not worth two crossovers
    assert ranges_of(figures(lambda s: 0.75 if s == 256 else 1.3)) == [[None, "mpi"]]
    # 3x faster there: worth them
    assert ranges_of(figures(lambda s: 0.33 if s == 256 else 1.3)) == \
        [[128, "mpi"], [256, "gloo"], [None, "mpi"]]


def test_a_real_crossover_is_one_boundary():
    r = ranges_of(figures(lambda s: 1.5 if s < 2048 else 0.7))
    assert r == [[1024, "mpi"], [None, "gloo"]]


def test_no_evidence_keeps_the_policy_even_when_medians_differ():
    """Equal backends with noise: the medians disagree from size to size, the table
    stays on the policy (the paper's one crossover at most, here none)."""
    figs = {s: {"mpi": rounds(50, n=30, spread=0.4, seed=i),
                "gloo": rounds(50, n=30, spread=0.4, seed=500 + i)}
            for i, s in enumerate(SIZES)}
    assert ranges_of(figs) == [[None, "mpi"]]


def test_a_neighbouring_range_is_kept_where_undecided():
    """gloo clearly faster from 1 KiB; at 8 KiB the rounds do not settle mpi vs gloo:
    gloo's range goes on (the current choice there) instead of flipping."""
    figs = figures(lambda s: 1.5 if s < 1024 else 0.6)
    n = len(figs[8192]["mpi"])
    figs[8192]["gloo"] = figs[8192]["mpi"] * np.where(np.arange(n) % 2 == 0, 1.1, 0.9)
    assert ranges_of(figs) == [[512, "mpi"], [None, "gloo"]]


def test_switch_cost_is_a_knob():
    flip = figures(lambda s: 0.75 if s == 256 else 1.3)
    assert ranges_of(flip, switch_cost=0.1) == [[128, "mpi"], [256, "gloo"], [None, "mpi"]]


def test_choose_backends_needs_evidence_for_any_switch_but_to_the_current():
    # a point where gloo's median is far lower but only in a minority of rounds
    mpi = rounds(100, n=40, spread=0.01, seed=9)
    gloo = mpi.copy()
    gloo[:15] *= 0.1
    gloo[15:] *= 1.01
    pts = [(4, {"mpi": mpi, "gloo": gloo})]
    assert tuning.choose_backends(pts, ["mpi"]) == ["mpi"]
    # from gloo (a neighbouring range), going back to the current choice needs none
    assert tuning.choose_backends([(4, {"mpi": mpi, "gloo": mpi * 3})], ["mpi"]) == ["mpi"]


def test_splice_re_decides_only_the_measured_sizes():
    old = {"op": "all_reduce", "world_size": 2, "hosts": 1, "device": "cpu",
           "dtype_class": "float", "ranges": [[1024, "mpi"], [None, "gloo"]],
           "measured": {"sizes": SIZES, "rounds": [1] * len(SIZES), "median_s": {}}}
    figs = {s: f for s, f in figures(lambda s: 0.5).items() if s in (256, 512)}
    e = tuning.decide_entry(figs, "cpu", existing=old)
    # 256 and 512 moved to gloo; 1024, not measured again, keeps its old choice
    assert e["ranges"] == [[128, "mpi"], [512, "gloo"], [1024, "mpi"], [None, "gloo"]]
    assert e["measured"]["sizes"] == SIZES
    again = {s: f for s, f in figures(lambda s: 1.0).items() if s == 4096}
    assert tuning.decide_entry(again, "cpu", existing=old)["ranges"] == old["ranges"]


def test_build_entries_records_what_was_measured():
    figs = figures(lambda s: 1.5 if s < 2048 else 0.7)
    e = tuning.build_entries({KEY: figs})[0]
    assert e["measured"]["sizes"] == SIZES and e["measured"]["rounds"] == [60] * len(SIZES)
    assert e["measured"]["median_s"]["gloo"][0] == pytest.approx(np.median(figs[4]["gloo"]))
    TuningTable(tuning.merge_table(None, [e], tuning.fingerprint()))  # valid


# --- verification -----------------------------------------------------------------------
def test_verification_sizes_take_both_sides_of_each_boundary():
    got = tuning.verification_sizes(SIZES, [[1024, "mpi"], [None, "gloo"]], inside=1)
    assert {1024, 2048, 4, 1 << 15} <= set(got) and len(got) == 6


def point(size, auto, auto_us, **single_us):
    figs = {"auto": rounds(auto_us, n=50, spread=0.02, seed=size)}
    for i, (b, us) in enumerate(single_us.items()):
        figs[b] = figs["auto"] * us / auto_us
    return tuning.verify_point(size, auto, figs)


def test_verify_point_verdicts():
    assert point(64, "gloo", 50, mpi=60, gloo=50)["verdict"] == "ok"
    lost = point(64, "gloo", 50, mpi=20, gloo=50)
    assert lost["verdict"] == "lost" and lost["against"] == "mpi" and lost["ratio"] < 0.5
    assert lost["single_s"]["mpi"] == pytest.approx(20 * US, rel=0.05)


def test_repair_gives_lost_ranges_back_to_the_policy_only():
    ranges = [[64, "mpi"], [1024, "gloo"], [None, "mpi"]]
    pts = [point(64, "mpi", 30, mpi=30, gloo=10),  # the policy range loses: kept
           point(512, "gloo", 50, mpi=20, gloo=50)]  # the gloo range loses: repaired
    assert range_status(ranges, pts, "mpi") == ["missed", "lost", "unverified"]
    fixed, notes = tuning.repair(ranges, pts, "mpi")
    assert fixed == [[None, "mpi"]] and notes == ["65 B–1 KiB: gloo -> mpi"]


def test_a_loss_the_policy_cannot_fix_keeps_the_range():
    """Barrier on CUDA buffers, tuned on an H200: the table's mpi lost by 2 µs to mpi
    itself (auto's own path), and the policy's nccl measured 9x slower. Giving the range
    back to the policy, or not using it at load, would make every call slower."""
    ranges = [[None, "mpi"]]
    pts = [point(0, "mpi", 11.9, mpi=10.0, nccl=89.1)]
    assert pts[0]["verdict"] == "lost"
    assert range_status(ranges, pts, "nccl") == ["missed"]
    assert tuning.repair(ranges, pts, "nccl") == ([[None, "mpi"]], [])
    # the same loss where the policy is faster than the range's backend: repaired
    pts = [point(0, "mpi", 11.9, mpi=10.0, nccl=5.0)]
    assert range_status(ranges, pts, "nccl") == ["lost"]
    assert tuning.repair(ranges, pts, "nccl")[0] == [[None, "nccl"]]


def table_with_points(pts):
    e = {"op": "all_reduce", "world_size": 2, "hosts": 1, "device": "cpu",
         "dtype_class": "float", "ranges": [[1024, "mpi"], [None, "gloo"]],
         "verification": {"when": "now", "margin": 0.05, "points": pts}}
    return {"schema": "mcrdl.tuning/2", "machine": tuning.fingerprint(), "entries": [e]}


def test_a_range_whose_verification_lost_is_not_used(caplog):
    data = table_with_points([point(4096, "gloo", 50, mpi=20, gloo=50),
                              point(512, "mpi", 30, mpi=30, gloo=40)])
    with caplog.at_level(logging.WARNING, logger="mcrdl.selection"):
        t = TuningTable(data, "t.json")
    assert t.lookup("all_reduce", 2, "cpu", "float", 8192) is None  # the policy decides
    assert t.lookup("all_reduce", 2, "cpu", "float", 512) == "mpi"
    assert "t.json" in caplog.text and "1025 B–inf on gloo (slower than mpi)" in caplog.text
    assert any("LOST" in ln for ln in tuning.crossover_lines(t))
    caplog.clear()
    ok = TuningTable(table_with_points([point(4096, "gloo", 50, mpi=80, gloo=50)]))
    assert ok.lookup("all_reduce", 2, "cpu", "float", 8192) == "gloo" and not ok.lost


@pytest.mark.parametrize("bad", [
    "yes", {"points": "none"}, {"points": [{"bytes": 4}]},
    {"points": [{"bytes": 4, "auto": "mpi", "auto_s": 1.0, "single_s": {}, "verdict": "bad"}]},
    {"points": [{"bytes": 4, "auto": "mpi", "auto_s": 1.0, "single_s": {}, "verdict": "lost"}]},
])
def test_malformed_verification_block_is_refused(bad):
    data = table_with_points([])
    data["entries"][0]["verification"] = bad
    with pytest.raises(TableError, match="verification"):
        TuningTable(data)


def test_verified_figure_interpolates_inside_a_range():
    pts = [point(2048, "gloo", 100, mpi=300, gloo=100), point(8192, "gloo", 400, mpi=900, gloo=400)]
    t = TuningTable(table_with_points(pts))
    fig, rng = t.verified_figure("all_reduce", 2, "cpu", "float", 4096, "gloo")
    assert fig == pytest.approx(200 * US, rel=0.05) and rng == (1025, None)
    assert t.verified_figure("all_reduce", 2, "cpu", "float", 16384, "gloo")[0] == \
        pytest.approx(400 * US, rel=0.05)  # nearest, 2x away
    assert t.verified_figure("all_reduce", 2, "cpu", "float", 1 << 20, "gloo") is None
    # a range without verified figures: nothing to compare with
    assert t.verified_figure("all_reduce", 2, "cpu", "float", 512, "gloo") is None


class FakeBootstrap:
    def bcast(self, obj, root=0):
        return json.loads(json.dumps(obj)) if obj is not None else obj


class FakeRuntime:
    rank, world_size = 0, 2

    def __init__(self):
        self.bootstrap = FakeBootstrap()
        self.table = None

    def set_table(self, t):
        self.table = t


def fake_measure(truth, log):
    """measure() from ``truth(op, size, backend) -> us``; "auto" follows the table in
    force on the fake runtime."""
    def measure(op, size, cols, n):
        log.append((op, size))
        base = rounds(1, n=n or 30, spread=0.02, seed=size)
        out = {}
        for c in cols:
            b = c
            if c == "auto":
                b = RT.table.lookup(op if op != "send_recv" else "send", 2, "cpu", "float",
                                    size) or "mpi"
            out[c] = base * truth(op, size, b)
        return out
    return measure


RT = FakeRuntime()


def test_verify_repairs_a_losing_range_and_records_the_block():
    # the table says gloo from 1 KiB, but gloo is slower there in truth
    truth = lambda op, s, b: 20 if b == "mpi" else 60  # noqa: E731
    e = tuning.build_entries({KEY: figures(lambda s: 1.5 if s < 1024 else 0.6)})[0]
    table = tuning.merge_table(None, [e], tuning.fingerprint())
    log = []
    out = tuning.verify(RT, table, [KEY], ["mpi", "gloo"], fake_measure(truth, log))
    entry = out["table"]["entries"][0]
    assert entry["ranges"] == [[None, "mpi"]] and out["repaired"] == 1 and out["lost"] == 0
    v = entry["verification"]
    assert {p["auto"] for p in v["points"]} == {"mpi"} and v["when"]
    assert all(p["verdict"] == "ok" for p in v["points"])
    assert "repaired 513 B–inf: gloo -> mpi" in out["lines"][0]
    assert "best single backend (mpi)" in out["total"]
    TuningTable(out["table"])  # valid, nothing lost


def test_verify_only_reports_and_a_good_table_passes():
    def truth(op, s, b):
        return (20 if b == "mpi" else 60) if s < 1024 else (90 if b == "mpi" else 30)
    e = tuning.build_entries({KEY: figures(lambda s: 1.5 if s < 1024 else 0.6)})[0]
    table = tuning.merge_table(None, [e], tuning.fingerprint())
    log = []
    out = tuning.verify(RT, table, [KEY], ["mpi", "gloo"], fake_measure(truth, log), repairs=0)
    assert out["lost"] == 0 and out["repaired"] == 0
    assert out["table"]["entries"][0]["ranges"] == e["ranges"]
    assert out["lines"][0].rstrip().endswith("ok")
    # checking again: every point measured afresh, stored ones ignored
    n = len(log)
    tuning.verify(RT, out["table"], [KEY], ["mpi", "gloo"], fake_measure(truth, log),
                  repairs=0, reuse=False)
    assert len(log) == 2 * n
    tuning.verify(RT, out["table"], [KEY], ["mpi", "gloo"], fake_measure(truth, log), repairs=0)
    assert len(log) == 2 * n  # a re-tune reuses the points that still hold


def test_remeasure_is_bounded_and_appends_rounds():
    mpi = rounds(100, n=12, seed=1)
    gloo = mpi * 0.8
    gloo[:3] *= 1.5  # wins 9 of 12: undecided
    res = {"all_reduce": {4: {"mpi": mpi, "gloo": gloo}}}
    log = []

    def measure(op, size, cols, n):  # the same pattern again: 9 of every 12 rounds
        log.append(n)
        reps = n // 12
        return {"mpi": np.tile(mpi, reps), "gloo": np.tile(gloo, reps)}
    still = tuning.remeasure_undecided(RT, res, "cpu", measure, passes=2)
    assert log == [12, 24] and len(res["all_reduce"][4]["mpi"]) == 48
    assert still == []  # 36 of 48 rounds: decided (faster)
    assert tuning.compare(res["all_reduce"][4]["gloo"], res["all_reduce"][4]["mpi"]).faster


def test_on_root_raises_everywhere():
    class Other(FakeRuntime):
        rank = 1

    class Boot:
        def bcast(self, obj, root=0):
            return ("error", "ValueError: bad")
    rt = Other()
    rt.bootstrap = Boot()
    with pytest.raises(RuntimeError, match="rank 0 failed.*bad"):
        tuning.on_root(rt, lambda: 1)
    with pytest.raises(ZeroDivisionError):
        tuning.on_root(RT, lambda: 1 / 0)


# --- the atomic write -------------------------------------------------------------------
def test_interrupted_write_leaves_the_old_table(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    old = tuning.merge_table(None, tuning.build_entries({KEY: {4: {"mpi": 1.0}}}),
                             tuning.fingerprint())
    tuning.write_table(old, str(path))
    before = path.read_text()

    def dies(obj, f, **kw):
        f.write('{"schema": "mcrdl.tun')
        raise KeyboardInterrupt
    monkeypatch.setattr(tuning.json, "dump", dies)
    with pytest.raises(KeyboardInterrupt):
        tuning.write_table(dict(old, entries=[]), str(path))
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


# --- the stale-table report -------------------------------------------------------------
def stale_table():
    pts = [point(2048, "gloo", 100, mpi=300, gloo=100), point(8192, "gloo", 400, mpi=900, gloo=400),
           point(4, "mpi", 10, mpi=10, gloo=50)]
    return TuningTable(table_with_points(pts))


def test_stale_report_flags_persistent_gaps_only():
    t = stale_table()
    lg = CommLogger()
    for i in range(40):
        lg.record("all_reduce", 4096, "gloo", 2, 900 * US)  # 4.5x the verified 200 us
        lg.record("all_reduce", 8192, "gloo", 2, (2000 if i % 3 == 0 else 420) * US)  # spikes
        lg.record("all_reduce", 4, "mpi", 2, 12 * US)  # as verified
    lg.record("all_reduce", 2048, "gloo", 2, 5000 * US)  # few calls: not judged
    rows = lg.stale(t)
    assert [(r["op"], r["bytes"], r["backend"], r["slower"]) for r in rows] == \
        [("all_reduce", 4096, "gloo", True)]
    assert rows[0]["ratio"] == pytest.approx(4.5, rel=0.05) and rows[0]["range"] == (1025, None)
    assert rows[0]["retune"] == "mpiexec -n 2 mcrdl tune --ops all_reduce --sizes 4096"
    text = lg.summary(print_fn=None, table=t)
    assert "table stale: re-run mcrdl tune" in text and "4.50x" in text
    assert "table stale" not in CommLogger().summary(print_fn=None, table=t)


def test_stale_report_reads_sizes_per_rank_and_flags_faster_too():
    data = table_with_points([point(4096, "gloo", 200, mpi=300, gloo=200)])
    data["entries"][0]["op"] = "all_gather"
    lg = CommLogger()
    for _ in range(30):
        lg.record("all_gather", 2 * 4096, "gloo", 2, 50 * US)  # S = 2 ranks x 4 KiB
    rows = lg.stale(TuningTable(data))
    assert [(r["bytes"], r["slower"]) for r in rows] == [(4096, False)]


# --- load -------------------------------------------------------------------------------
def rank_figures(host="vm", cores=2, ranks=2, load=0.1, busy=0.0, own=0.0, steal=0.0):
    tick = 100
    wall = 10.0
    total = cores * wall * tick
    return {"host": host, "cores": cores, "ranks": ranks, "own_cpu_s": own, "wall_s": wall,
            "load_before": load, "load_max": load,
            "stat": [int((busy + own) * tick), int(steal * total), int(total)]}


def test_load_report_quiet_and_busy(monkeypatch):
    monkeypatch.setattr(sweep.os, "sysconf", lambda name: 100)
    quiet = sweep.load_report([rank_figures(own=9.0), rank_figures(own=9.0)], spread=0.1)
    assert quiet["warnings"] == [] and quiet["hosts"][0]["others_cores"] == pytest.approx(0.0)
    busy = sweep.load_report([rank_figures(load=3.9, busy=19.0, own=0.0, steal=0.1,
                                           ranks=3)], spread=0.9)
    text = " | ".join(busy["warnings"])
    for part in ("more ranks than cores", "load average 3.90", "other processes used 1.90 cores",
                 "10% of CPU time stolen", "rounds disagree"):
        assert part in text, text


def test_a_load_left_by_exited_processes_is_no_warning(monkeypatch):
    """A one-minute load average of 2 before the run on a 2-core host whose other
    processes were idle during it (the previous step of ``make demo``, its two ranks
    gone) gives no warning; the same load with others busy, or unmeasured, does."""
    monkeypatch.setattr(sweep.os, "sysconf", lambda name: 100)
    after_a_step = sweep.load_report([rank_figures(load=2.0, own=9.0)] * 2)
    assert after_a_step["warnings"] == []
    busy = sweep.load_report([rank_figures(load=2.0, busy=15.0, own=9.0)] * 2)
    assert any("load average 2.00" in w for w in busy["warnings"]), busy["warnings"]
    unmeasured = dict(rank_figures(load=2.0), stat=None)
    assert any("load average 2.00" in w
               for w in sweep.load_report([unmeasured] * 2)["warnings"])


def test_round_spread_and_order():
    assert sweep.round_spread({"x": {4: {"mpi": np.ones(10)}}}) == 0.0
    assert sweep.round_spread({"x": {4: {"mpi": rounds(10, spread=1.0)}}}) > sweep.SPREAD_WARN
    for k in (1, 2, 3, 4, 5):
        order = sweep.round_order(k, 2 * k * 3)
        assert all(sorted(r) == list(range(k)) for r in order)
        firsts = [r[0] for r in order]
        assert len({firsts.count(c) for c in range(k)}) == 1  # each column first alike
        if k > 1:
            pairs = [(r[i], r[i + 1]) for r in order for i in range(k - 1)]
            assert len({pairs.count((a, b)) for a in range(k) for b in range(k) if a != b}) == 1


def test_whole_cycles_put_every_column_at_every_position():
    """measure_rounds runs whole cycles of the design: every column (the A/A control
    included, wherever --backends puts it) sits at every position of a round equally
    often and directly follows every other column equally often."""
    for k in range(1, 7):
        for asked in (1, 5, 12, 24, 25):
            n = sweep.whole_cycles(k, asked)
            assert n >= asked and n % (k if k % 2 == 0 or k == 1 else 2 * k) == 0
            order = sweep.round_order(k, n)
            for col in range(k):
                at = [row.index(col) for row in order]
                assert len({at.count(p) for p in range(k)}) == 1, (k, asked, col)
            if k > 1:
                pairs = [(r[i], r[i + 1]) for r in order for i in range(k - 1)]
                assert len({pairs.count((a, b)) for a in range(k) for b in range(k)
                            if a != b}) == 1


def test_block_sizes():
    """A block's untimed calls last DISCARD_S (at least one; none for long calls) and
    its timed calls about BLOCK_S (at least one), both bounded; slices cover the timed
    calls exactly."""
    assert sweep.discards_for(3e-6) == 34 and sweep.calls_for(3e-6) == 333
    assert sweep.discards_for(500e-6) == 1 and sweep.calls_for(500e-6) == 2
    assert sweep.discards_for(sweep.LONG_CALL_S) == 0 and sweep.calls_for(1.0) == 1
    assert sweep.discards_for(0.0) == sweep.MAX_DISCARD and sweep.calls_for(0.0) == sweep.MAX_CALLS
    for calls in (1, 2, 4, 5, 7, 333, 1000):
        cut = sweep.slices_of(calls)
        assert sum(cut) == calls and len(cut) == min(calls, sweep.SLICES) and min(cut) >= 1
        assert max(cut) - min(cut) <= 1


def test_timed_blocks_runs_each_column_as_one_block_in_the_rounds_order():
    """The sequence of calls: per round, in the round's order, each column's block: a
    barrier, its discarded calls, its timed calls, nothing of another column inside."""
    log = []
    fns = [lambda c=c: log.append(c) for c in "abc"]
    plan = [(2, 3), (0, 1), (1, 7)]
    order = sweep.round_order(3, sweep.whole_cycles(3, 1))
    out = sweep.timed_blocks(fns, order, plan, barrier=lambda: log.append("|"))
    assert out.shape == (3, 6) and (out >= 0).all()
    want = []
    for row in order:
        for i in row:
            want += ["|"] + ["abc"[i]] * sum(plan[i])
    assert log == want


def test_block_plan_is_the_slowest_ranks():
    """The plan comes from the figures after ``slowest`` (the MAX over ranks), so every
    rank runs the same blocks; each function warms up before it is timed, in two passes
    over the functions in opposite orders (a function right after a slow one is also
    estimated before it)."""
    log = []
    fns = [lambda c=c: log.append(c) for c in "ab"]

    def slowest(a):  # as if another rank had taken 3 µs and 500 µs per call
        np.maximum(a, [3e-6, 500e-6], out=a)

    plan = sweep.block_plan(fns, 3, lambda: log.append("|"), slowest)
    assert plan == [(34, 333), (1, 2)]
    one = 3 + sweep.PROBES  # warm-up and timed calls of one function in one pass
    assert log == (["|"] + ["a"] * one + ["|"] + ["b"] * one
                   + ["|"] + ["b"] * one + ["|"] + ["a"] * one)


def test_control_backend(capsys):
    from mcrdl_core.tools.cli import build_parser, control_backend

    assert control_backend(None, ["mpi", "gloo"], "cpu") is None
    assert control_backend("", ["gloo", "mpi"], "cpu") == "mpi"  # the policy's, any order
    assert control_backend("gloo", ["gloo", "mpi"], "cpu") == "gloo"
    with pytest.raises(SystemExit, match="not among"):
        control_backend("nccl", ["gloo", "mpi"], "cpu")
    ap = build_parser()
    assert ap.parse_args(["bench", "--control"]).control == ""
    assert ap.parse_args(["bench", "--control", "gloo"]).control == "gloo"
    assert ap.parse_args(["bench"]).control is None


def test_summary_uses_the_runtime_table(monkeypatch):
    """Without a table argument, the report reads the runtime's table in force and the
    topology (hosts of a group) from its bootstrap."""
    import mcrdl_core.dispatch.runtime as runtime

    t = stale_table()
    rt = SimpleNamespace(table=t, world_size=2,
                         bootstrap=SimpleNamespace(hosts=["vm"], hosts_in=lambda r: 1))
    monkeypatch.setattr(runtime, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime, "get_runtime", lambda: rt)
    lg = CommLogger()
    for _ in range(25):
        lg.record("all_reduce", 4096, "gloo", 2, 900 * US)
    assert "table stale" in lg.summary(print_fn=None)
    rt.table = None
    assert lg.stale() == []


# --- the two-level algorithms as a candidate ------------------------------------------
def test_hier_is_a_column_of_all_reduce_and_all_to_all_only_where_hosts_are_shared():
    assert sweep.algorithm_columns("all_reduce", True) == ["hier"]
    assert sweep.algorithm_columns("all_to_all", True) == ["hier"]
    assert sweep.algorithm_columns("broadcast", True) == []
    assert sweep.algorithm_columns("all_reduce", False) == []


def test_hier_is_chosen_like_a_backend_where_it_wins_and_never_by_the_policy():
    from mcrdl_core.dispatch.selection import algorithm, is_algorithm
    figs = figures(lambda s: 1.3)  # gloo slower everywhere
    for i, (s, by) in enumerate(figs.items()):
        noise = np.exp(np.random.default_rng(200 + i).normal(0, .02, len(by["mpi"])))
        by["hier"] = by["mpi"] * (0.5 if s >= 2048 else 1.4) * noise
    assert ranges_of(figs) == [[1024, "mpi"], [None, "hier"]]
    assert tuning.policy_choice("cpu", ["hier", "gloo", "mpi"]) == "mpi"
    assert is_algorithm("hier") and is_algorithm("hier:mpi") and not is_algorithm("mpi")
    # no table: no algorithm (and the lookup is never made)
    assert algorithm(SimpleNamespace(table=None), None, None, None, None) is None
