"""bench/results.py (docs/results.md's generator): a row on canned apps-table results gives
the best single library, MCR-DL's variant, their ratio, the A/A and the loss check, and
says where it falls short of the paper; a layout not measured yet says so."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "results.py"


@pytest.fixture()
def results(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(_PATH.parent / "apps"))
    spec = importlib.util.spec_from_file_location("results_page", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    return mod


def _rows(coded: float):
    return [{"app": "dlrm", "variant": v, "samples_per_s": s, "loss_max_rel_diff_vs_gloo": 1e-7,
             "ran": ["all_to_all: mpi+int8:256@a2a"] if "+" in v else []}
            for v, s in (("gloo (torch)", 100), ("mcrdl: mpi", 120), ("mcrdl: gloo", 90),
                         ("mcrdl: tuned", 118), ("mcrdl: tuned + a2a bf16+int8", coded),
                         ("mcrdl: mpi (A/A)", 114))]


def test_a_row_compares_with_the_best_single_library(results):
    row = results._row(results.CLAIMS[0], {"rows": _rows(180.0)})
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "mcrdl: mpi 120" and cells[3] == "mcrdl: tuned + a2a bf16+int8 180"
    assert cells[4] == "1.50x" and cells[5] == "0.95"
    assert cells[6] == "max 1e-07 vs gloo" and cells[7] == "all_to_all: mpi+int8:256@a2a"
    short = results._row(results.CLAIMS[0], {"rows": _rows(132.0)})
    assert "1.10x **short of 1.25x**" in short


def test_the_page_says_what_is_not_measured(results):
    page = results.render(results.QUICK)
    assert page.startswith("# Results")
    assert "Not measured yet" in page and "not built yet" in page
    assert page.count("| MCR-DL (mix-and-match)") == 3
