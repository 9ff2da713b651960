"""Tuning tables built from synthetic timings, merged, written, refused when foreign;
the comm logger's figures against the nccl-tests formulas; the CLI's size parser."""
import json
import logging

import pytest

from mcrdl_core.tools import tuning
from mcrdl_core.tools.cli import parse_bytes
from mcrdl_core.observe.logger import CommLogger, bandwidths
from mcrdl_core.base.errors import TableError
from mcrdl_core.dispatch.selection import TuningTable, table_from_env

US = 1e-6


def synthetic():
    """all_reduce: mpi wins up to 1 KiB, gloo from 2 KiB to 8 KiB, mpi again above."""
    pts = {}
    for s in (4, 256, 1024, 2048, 4096, 8192, 16384):
        gloo_wins = 2048 <= s <= 8192
        pts[s] = {"mpi": (20 if not gloo_wins else 90) * US, "gloo": (50 if gloo_wins else 400) * US}
    return {("all_reduce", 2, 1, "cpu", "float"): pts,
            ("send_recv", 2, 1, "cpu", "float"): {4: {"mpi": 10 * US, "gloo": 300 * US}},
            ("barrier", 2, 1, "cpu", "float"): {0: {"mpi": 5 * US, "gloo": 200 * US}}}


def test_build_and_merge_ranges():
    entries = {(e["op"], e["world_size"]): e for e in tuning.build_entries(synthetic())}
    assert entries[("all_reduce", 2)]["ranges"] == [[1024, "mpi"], [8192, "gloo"], [None, "mpi"]]
    assert entries[("send", 2)]["ranges"] == entries[("recv", 2)]["ranges"] == [[None, "mpi"]]
    assert entries[("barrier", 2)]["ranges"] == [[None, "mpi"]]
    t = TuningTable(tuning.merge_table(None, list(entries.values()), tuning.fingerprint()))
    look = lambda b: t.lookup("all_reduce", 2, "cpu", "float", b)  # noqa: E731
    # edges: a size between two measured ones takes the larger one's winner
    assert [look(1024), look(1025), look(8192), look(8193), look(1 << 30)] == \
           ["mpi", "gloo", "gloo", "mpi", "mpi"]
    assert t.lookup("barrier", 2, "cpu", "int", 1) == "mpi"  # other dtype class serves


def test_merge_keeps_other_world_sizes_and_replaces_same_key():
    fp = tuning.fingerprint()
    first = tuning.merge_table(None, tuning.build_entries(synthetic()), fp)
    three = {("all_reduce", 3, 1, "cpu", "float"): {4: {"mpi": 9 * US, "gloo": 1 * US}}}
    both = tuning.merge_table(first, tuning.build_entries(three), fp)
    keys = {(e["op"], e["world_size"]) for e in both["entries"]}
    assert ("all_reduce", 2) in keys and ("all_reduce", 3) in keys
    again = {("all_reduce", 2, 1, "cpu", "float"): {4: {"mpi": 9 * US, "gloo": 1 * US}}}
    replaced = tuning.merge_table(both, tuning.build_entries(again), fp)
    ar2 = [e for e in replaced["entries"] if (e["op"], e["world_size"]) == ("all_reduce", 2)]
    assert len(ar2) == 1 and ar2[0]["ranges"] == [[None, "gloo"]]
    foreign = dict(first, machine=dict(fp, host="elsewhere"))
    fresh = tuning.merge_table(foreign, tuning.build_entries(three), fp)
    assert {e["world_size"] for e in fresh["entries"]} == {3}  # nothing kept from elsewhere


def test_write_reload_and_crossover(tmp_path):
    path = tmp_path / "sub" / "t.json"
    table = tuning.merge_table(None, tuning.build_entries(synthetic()), tuning.fingerprint())
    tuning.write_table(table, str(path))
    loaded = TuningTable.load(str(path))
    lines = tuning.crossover_lines(loaded, 2)
    assert any("all_reduce" in ln and "hosts=1" in ln and "0 B–1 KiB -> mpi, 1025 B–8 KiB -> gloo, 8193 B–inf -> mpi"
               in ln for ln in lines), lines
    assert not list(path.parent.glob("*.tmp*"))


def test_foreign_or_bad_table_from_env_warns_and_falls_back(tmp_path, monkeypatch, caplog):
    table = tuning.merge_table(None, tuning.build_entries(synthetic()), tuning.fingerprint())
    table["machine"]["host"] = "some-other-host"
    p = tmp_path / "foreign.json"
    p.write_text(json.dumps(table))
    monkeypatch.setenv("MCRDL_TUNING_TABLE", str(p))
    with caplog.at_level(logging.WARNING, logger="mcrdl.selection"):
        assert table_from_env() is None
    assert str(p) in caplog.text and "another machine" in caplog.text and "host" in caplog.text
    p.write_text(json.dumps(table)[:50])  # truncated
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mcrdl.selection"):
        assert table_from_env() is None
    assert str(p) in caplog.text and "not valid JSON" in caplog.text
    monkeypatch.setenv("MCRDL_TUNING_TABLE", "none")
    assert table_from_env() is None


def test_entries_are_keyed_by_ranks_and_hosts():
    """4 ranks on one host and 4 ranks on 2 hosts are different entries: a lookup for
    one never takes the other's backend."""
    fp = tuning.fingerprint()
    res = {("all_gather", 4, 1, "cpu", "float"): {1 << 20: {"mpi": 1 * US, "gloo": 9 * US}},
           ("all_gather", 4, 2, "cpu", "float"): {1 << 20: {"mpi": 9 * US, "gloo": 1 * US}}}
    t = TuningTable(tuning.merge_table(None, tuning.build_entries(res), fp))
    assert t.data["schema"] == "mcrdl.tuning/2"
    assert t.lookup("all_gather", 4, "cpu", "float", 1 << 20) == "mpi"  # hosts=1 by default
    assert t.lookup("all_gather", 4, "cpu", "float", 1 << 20, hosts=1) == "mpi"
    assert t.lookup("all_gather", 4, "cpu", "float", 1 << 20, hosts=2) == "gloo"
    assert t.lookup("all_gather", 4, "cpu", "float", 1 << 20, hosts=4) is None  # a miss
    assert [ln.split(":")[0].split()[1:3] for ln in tuning.crossover_lines(t, 4, 2)] == \
           [["n=4", "hosts=2"]]
    # re-tuning the 2-host shape keeps the 1-host entry
    again = {("all_gather", 4, 2, "cpu", "float"): {1 << 20: {"mpi": 1 * US, "gloo": 9 * US}}}
    t2 = TuningTable(tuning.merge_table(t.data, tuning.build_entries(again), fp))
    assert len(t2.data["entries"]) == 2
    assert t2.lookup("all_gather", 4, "cpu", "float", 1 << 20, hosts=2) == "mpi"
    bad = dict(t.data, entries=[dict(t.data["entries"][0], hosts=5)])  # 5 hosts, 4 ranks
    with pytest.raises(TableError, match="hosts"):
        TuningTable(bad)
    del bad["entries"][0]["hosts"]
    with pytest.raises(TableError, match="hosts"):
        TuningTable(bad)


def test_schema_1_tables_are_read_as_one_host_and_rewritten_as_schema_2():
    v1 = {"schema": "mcrdl.tuning/1", "machine": tuning.fingerprint(),
          "entries": [{"op": "all_reduce", "world_size": 2, "device": "cpu",
                       "dtype_class": "float", "ranges": [[None, "gloo"]]}]}
    t = TuningTable(v1)
    assert t.lookup("all_reduce", 2, "cpu", "float", 8) == "gloo"
    assert t.lookup("all_reduce", 2, "cpu", "float", 8, hosts=2) is None
    two = {("all_reduce", 2, 2, "cpu", "float"): {4: {"mpi": 1 * US, "gloo": 9 * US}}}
    merged = tuning.merge_table(v1, tuning.build_entries(two), tuning.fingerprint())
    assert merged["schema"] == "mcrdl.tuning/2"
    assert sorted((e["hosts"], e["ranges"][0][1]) for e in merged["entries"]) == \
           [(1, "gloo"), (2, "mpi")]
    with pytest.raises(TableError, match="mcrdl.tuning/2"):
        TuningTable(dict(v1, schema="mcrdl.tuning/9"))


def test_multi_host_table_fits_every_host_of_the_job(monkeypatch):
    """rank 0 writes the table of a job on hosts a and b: host b accepts it, host c
    does not; on an emulated cluster every host is the one real machine."""
    written = tuning.fingerprint(["node-a", "node-b"])
    assert written["hosts"] == ["node-a", "node-b"]
    here = dict(tuning.fingerprint(), host="node-b")
    assert tuning.machine_differences(written, here) == []
    assert tuning.machine_differences(written, dict(here, host="node-c")) == ["host"]
    monkeypatch.setenv("MCRDL_CLUSTER_MACHINE", "the-real-machine")
    assert tuning.fingerprint(["h0", "h1"])["host"] == "the-real-machine"


def test_default_table_path(monkeypatch, tmp_path):
    monkeypatch.delenv("MCRDL_TUNING_TABLE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.default_path() == str(tmp_path / "mcrdl" / "tuning.json")
    assert table_from_env() is None  # nothing there: the policy, silently (nothing to warn)


@pytest.mark.parametrize("op, factor", [("all_reduce", 2 * 3 / 4), ("all_gather", 3 / 4),
                                        ("reduce_scatter", 3 / 4), ("all_to_all", 3 / 4),
                                        ("broadcast", 1), ("reduce", 1), ("send", 1)])
def test_bandwidth_formulas_match_nccl_tests(op, factor):
    alg, bus = bandwidths(op, 8 << 20, 4, 0.002)
    assert alg == pytest.approx((8 << 20) / 0.002)
    assert bus == pytest.approx(alg * factor)


def test_logger_rows_summary_and_json(tmp_path):
    lg = CommLogger()
    for s in (1e-3, 3e-3, 2e-3):
        lg.record("all_reduce", 1 << 20, "mpi", 2, s)
    lg.record("all_gather", 4096, "gloo", 2, 1e-4)
    rows = {(r["op"], r["backend"]): r for r in lg.rows()}
    ar = rows[("all_reduce", "mpi")]
    assert ar["calls"] == 3 and ar["median_s"] == 2e-3 and ar["min_s"] == 1e-3
    assert ar["algbw_Bps"] == pytest.approx((1 << 20) / 2e-3)
    assert ar["busbw_Bps"] == pytest.approx(ar["algbw_Bps"] * 2 * 1 / 2)
    assert "all_gather" in lg.summary(print_fn=None)
    data = json.loads(lg.to_json(str(tmp_path / "log.json")))
    assert data["calls"] == 4 and len(data["summary"]) == 2


def test_parse_bytes():
    assert [parse_bytes(x) for x in ("4", "64K", "64KiB", "1M", "2G", "512b")] == \
           [4, 65536, 65536, 1 << 20, 2 << 30, 512]


def test_a_table_tuned_under_other_links_is_refused_naming_both(tmp_path, monkeypatch, caplog):
    """Issue 24 point 7: the links' class (an emulated cluster's rate) is in the machine
    block; a job under other links warns, naming both, and keeps the policy."""
    monkeypatch.setenv("MCRDL_CLUSTER", "c1")
    monkeypatch.setenv("MCRDL_CLUSTER_RATE", "1gbit")
    fp = tuning.fingerprint(["h0", "h1"])
    assert fp["link"] == "1gbit"
    table = tuning.merge_table(None, tuning.build_entries(synthetic()), fp)
    p = tmp_path / "t.json"
    p.write_text(json.dumps(table))
    monkeypatch.setenv("MCRDL_TUNING_TABLE", str(p))
    assert table_from_env() is not None  # the same links: used
    monkeypatch.setenv("MCRDL_CLUSTER_RATE", "10gbit")
    with caplog.at_level(logging.WARNING, logger="mcrdl.selection"):
        assert table_from_env() is None
    assert "tuned on 1gbit" in caplog.text and "this job has 10gbit" in caplog.text
    monkeypatch.delenv("MCRDL_CLUSTER")  # one host: a cluster's table does not fit either
    assert tuning.fingerprint()["link"] is None
    assert any("links" in d for d in tuning.machine_differences(fp, tuning.fingerprint()))
