"""bench/demo_cluster.py (the last step of ``make demo``): its summary on canned results
stays within ten lines and says what ran, what auto chose and why, the speed-ups and the
loss against the exact run; where no emulated cluster can be built it says so in one
line, with what to run instead, and exits 0 without launching anything."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "demo_cluster.py"


@pytest.fixture()
def demo(monkeypatch):
    monkeypatch.syspath_prepend(str(_PATH.parent / "apps"))
    spec = importlib.util.spec_from_file_location("demo_cluster", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(demo):
    rows = []
    for app, what, sps, loss in (("dlrm", "DLRM", (1000.0, 2000.0, 3000.0), 0.60),
                                 ("fsdp", "FSDP", (40.0, 50.0, 55.0), 4.50)):
        for (name, *_), s, dl in zip(demo.variants(app), sps, (0.0, 0.0, 0.001)):
            rows.append({"app": app, "what": what, "where": "2 hosts", "variant": name,
                         "samples_per_s": s, "vs_gloo": s / sps[0], "loss_steps": 18,
                         "final_loss": loss * (1 + dl), "loss_rel_diff": dl,
                         "ran": "all_to_all: mpi+int8:256@a2a" if "tuned" in name else "",
                         "why": "all_to_all: >= 1.1x plain mpi in the tune at every size per rank" if "tuned" in name
                         else "", "runs": 1})
    return rows


def test_summary_of_canned_results(demo):
    meta = {"hosts": 2, "ranks_per_host": 1, "rate": "1gbit", "steps": 15, "repeats": 1,
            "load": "1.0/1.0/1.0 -> 2.0/1.5/1.2", "csv": "bench/out/demo_cluster.csv",
            "png": "demo_cluster.png", "seconds": 130.0}
    lines = demo.summary(_rows(demo), meta)
    assert len(lines) <= 10
    text = "\n".join(lines)
    assert "2 emulated hosts" in lines[0] and "1gbit" in lines[0] and "load average" in lines[0]
    # DLRM: one library 2.00x gloo; tuned + codecs 3.00x gloo and 1.50x the best single
    assert "(2.00x)" in text and "3.00x gloo, 1.50x best single" in text
    assert "1.10x best single" in text  # FSDP: 55 against the one library's 50
    assert "auto chose all_to_all: mpi+int8:256@a2a (all_to_all: >= 1.1x plain mpi" in text
    assert "(+0.10%)" in text and "exact 0.6000" in text
    assert lines[-1].startswith("wrote bench/out/demo_cluster.csv")


def test_the_variants_compare_gloo_one_library_and_codecs(demo):
    names = [v[0] for v in demo.variants("fsdp")]
    assert names[:2] == ["gloo (torch)", demo.EXACT]
    coded = demo.variants("fsdp")[2]
    assert coded[3] == {"MCRDL_COMPRESSION": "all_gather=auto:bf16+int8,"
                                             "reduce_scatter=auto:bf16+int8"}
    assert coded[4] is True  # uses the tuning table
    assert all(v[3]["OMP_NUM_THREADS"] == "1" for v in demo.variants("dlrm", threads=1))
    assert demo.variants("dlrm")[2][3] == {"MCRDL_COMPRESSION": "all_to_all=auto:bf16+int8"}


def test_why_reads_the_tables_compressed_ranges(demo):
    table = {"entries": [{"op": "all_to_all", "ranges": [[None, "mpi"]],
                          "compressed": {"codecs": ["int8"], "margin": 1.1,
                                         "ranges": [[524288, []],
                                                    [None, ["mpi+int8@a2a"]]]}}]}
    assert demo.why(table, {"all_to_all": ["mpi+int8:256@a2a"]}) == (
        "all_to_all: >= 1.1x plain mpi in the tune above 512 KiB per rank")
    assert demo.why(table, {"all_to_all": ["mpi"]}) == ""
    table["entries"][0]["compressed"]["ranges"] = [[524288, ["mpi+int8@a2a"]],
                                                   [2097152, ["mpi+int8@a2a"]],
                                                   [None, ["gloo+int8@a2a"]]]
    assert demo.why(table, {"all_to_all": ["mpi+int8:256@a2a"]}) == (
        "all_to_all: >= 1.1x plain mpi in the tune up to 2 MiB per rank")


def test_cannot_run_here_says_why_in_one_line(demo, monkeypatch, capsys):
    monkeypatch.setattr(demo, "why_not_here", lambda: "creating network namespaces needs root")
    monkeypatch.setattr(demo, "tune", lambda *a, **k: pytest.fail("nothing may run"))
    assert demo.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    assert "needs root" in out[0] and "sudo make demo" in out[0] and "table.py --quick" in out[0]
