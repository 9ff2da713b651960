"""Compressed variants as tuning-table candidates, without communication: the table
built from synthetic sweep figures, its "compressed" field read back, and what
``auto:CODECS`` / ``table`` then choose (a fake runtime stands in for the process's)."""
import json
from types import SimpleNamespace

import pytest

from mcrdl_core import dtypes
from mcrdl_core.tools import sweep, tuning
from mcrdl_core.tools.cli import _tune_codecs, tuned_ops
from mcrdl_core.compress import auto
from mcrdl_core.compress.auto import Auto
from mcrdl_core.compress.spec import Compression, parse
from mcrdl_core.base.errors import TableError
from mcrdl_core.base.ops import Op
from mcrdl_core.dispatch.selection import TuningTable

US = 1e-6
SMALL, BIG = 4096, 1 << 20


def figures():
    """all_gather on 2 ranks: plain mpi wins at 4 KiB (every codec slower); at 1 MiB
    fp16 over mpi is fastest, then int8 over mpi, then int8 over gloo; int8 over
    gloo@a2a-like columns that are only 5% faster than plain are not recorded."""
    return {("all_gather", 2, 1, "cpu", "float"): {
        SMALL: {"mpi": 10 * US, "gloo": 20 * US, "mpi+int8@ring": 50 * US,
                "gloo+int8@ring": 60 * US, "mpi+fp16@ring": 40 * US, "gloo+fp16@ring": 45 * US},
        BIG: {"mpi": 1000 * US, "gloo": 1500 * US, "mpi+int8@ring": 400 * US,
              "gloo+int8@ring": 450 * US, "mpi+fp16@ring": 300 * US,
              "gloo+fp16@ring": 960 * US}}}


def table_of(results) -> TuningTable:
    return TuningTable(tuning.merge_table(None, tuning.build_entries(results),
                                          tuning.fingerprint()))


def fake_rt(table, override=None, unavailable=()):
    from mcrdl_core.dispatch.runtime import Runtime

    caches: dict = {}
    rt = SimpleNamespace(table=table, override=override or {},
                         bootstrap=SimpleNamespace(hosts_in=lambda ranks: 1),
                         unavailable_reason=lambda n: "absent" if n in unavailable else None,
                         cache=lambda name: caches.setdefault(name, {}))
    rt.named_backend = lambda op, g, b: Runtime.named_backend(rt, op, g, b)
    return rt


_ids = iter(range(10_000, 20_000))


def group(backend=None):
    return SimpleNamespace(id=next(_ids), size=2, ranks=[0, 1], backend=backend)


@pytest.fixture
def no_calibration(monkeypatch):
    """Records calibrations instead of running them (they would communicate)."""
    calls = []

    def fake(rt, g, backend, codecs):
        calls.append(codecs)
        return auto.Calibration(2, {(o.value, v): (1.0, 0.0) for o in auto._OPS
                                    for v in ("plain",) + tuple(codecs)})
    monkeypatch.setattr(auto, "calibrate", fake)
    return calls


def pick(rt, spec, nbytes, backend=None, g=None, dtype=dtypes.float32, op=Op.ALL_GATHER):
    return auto.choose(parse(spec), rt, g or group(), op, nbytes // dtype.itemsize, dtype,
                       backend, nbytes, "cpu")


def test_build_entries_records_the_variants_that_win():
    e = tuning.build_entries(figures())[0]
    assert e["ranges"] == [[None, "mpi"]]  # uncompressed calls never see a codec
    assert e["compressed"] == {"codecs": ["fp16", "int8"], "margin": tuning.COMPRESS_MARGIN,
                               "ranges": [[SMALL, []], [None, ["mpi+fp16@ring", "mpi+int8@ring",
                                                               "gloo+int8@ring"]]]}
    # 960 us against 1000 us is inside the margin: gloo+fp16 is not listed
    plain_only = {k: {s: {b: t for b, t in by.items() if "+" not in b} for s, by in v.items()}
                  for k, v in figures().items()}
    assert "compressed" not in tuning.build_entries(plain_only)[0]


def test_auto_int8_picks_int8_where_the_table_says_and_plain_elsewhere(no_calibration):
    rt = fake_rt(table_of(figures()))
    assert pick(rt, "auto:int8", BIG) == (Compression("int8", "ring"), "mpi")
    assert pick(rt, "auto:int8", BIG, backend="auto") == (Compression("int8", "ring"), "mpi")
    assert pick(rt, "auto:int8", SMALL) == (None, None)
    assert pick(rt, "auto:fp16+int8", BIG) == (Compression("fp16", "ring"), "mpi")
    assert pick(rt, "table", BIG) == (Compression("fp16", "ring"), "mpi")  # its codecs
    assert pick(rt, "auto:int8:256", BIG)[0] == Compression("int8", "ring")  # the same codec
    # a backend the call names (or the group's default) restricts the variants
    assert pick(rt, "auto:int8", BIG, backend="gloo") == (Compression("int8", "ring"), "gloo")
    assert pick(rt, "auto:fp16", BIG, g=group("gloo")) == (None, None)
    assert pick(fake_rt(rt.table, override={"*": "gloo"}), "auto:int8", BIG) == \
        (Compression("int8", "ring"), "gloo")
    # a listed backend that cannot run here is skipped
    assert pick(fake_rt(rt.table, unavailable=("mpi",)), "auto:int8", BIG) == \
        (Compression("int8", "ring"), "gloo")
    # all-reduce and reduce-scatter have no entry here: calibration, as before
    assert no_calibration == []
    pick(rt, "auto:int8", BIG, op=Op.REDUCE_SCATTER)
    assert no_calibration == [("int8",)]


def test_a_codec_the_call_did_not_allow_is_never_picked(no_calibration):
    rt = fake_rt(table_of(figures()))
    only_fp16 = json.loads(json.dumps(rt.table.data))
    only_fp16["entries"][0]["compressed"]["ranges"][-1][1] = ["mpi+fp16@ring"]
    rt = fake_rt(TuningTable(only_fp16))
    assert pick(rt, "auto:int8", BIG) == (None, None)  # fp16 wins there, but int8 is allowed
    assert pick(rt, "auto:int4", BIG) == (None, None)
    assert no_calibration == [("int4",)]  # int4 was not measured: calibrated instead
    assert pick(rt, "table", BIG, dtype=dtypes.int32) == (None, None)  # never lossy on ints


def test_table_spec_without_table_measurements_is_plain(no_calibration):
    plain_only = {k: {s: {b: t for b, t in by.items() if "+" not in b} for s, by in v.items()}
                  for k, v in figures().items()}
    for rt in (fake_rt(None), fake_rt(table_of(plain_only))):
        assert pick(rt, "table", BIG) == (None, None)
    assert no_calibration == []
    assert parse("table") == Auto(()) and str(Auto(())) == "table"


def test_old_tables_without_the_field_still_load_and_mean_no_compression(no_calibration):
    old = {"schema": "mcrdl.tuning/1", "machine": tuning.fingerprint(),
           "entries": [{"op": "all_gather", "world_size": 2, "device": "cpu",
                        "dtype_class": "float", "ranges": [[None, "gloo"]]}]}
    t = TuningTable(old)
    assert t.lookup("all_gather", 2, "cpu", "float", BIG) == "gloo"
    assert t.lookup_compressed("all_gather", 2, "cpu", "float", BIG) is None
    assert pick(fake_rt(t), "auto:int8", BIG) == (None, None)  # from the stubbed calibration
    assert no_calibration == [("int8",)]
    rewritten = tuning.merge_table(old, [], tuning.fingerprint())
    assert "compressed" not in TuningTable(rewritten).data["entries"][0]


def test_written_table_keeps_the_field_and_prints_it(tmp_path):
    path = tmp_path / "t.json"
    tuning.write_table(table_of(figures()).data, str(path))
    t = TuningTable.load(str(path))
    assert t.lookup_compressed("all_gather", 2, "cpu", "float", SMALL) == (("fp16", "int8"), ())
    codecs, variants = t.lookup_compressed("all_gather", 2, "cpu", "float", None)
    assert variants[0] == ("mpi", "fp16", "ring")
    lines = tuning.crossover_lines(t, 2)
    assert any("compressed (fp16+int8" in ln and "0 B–4 KiB -> plain" in ln
               and "4097 B–inf -> mpi+fp16@ring > mpi+int8@ring > gloo+int8@ring" in ln
               for ln in lines), lines
    # re-tuning the key without --compression replaces the entry, field and all
    plain = {k: {s: {"mpi": 1.0} for s in v} for k, v in figures().items()}
    again = tuning.merge_table(t.data, tuning.build_entries(plain), tuning.fingerprint())
    assert "compressed" not in again["entries"][0]


@pytest.mark.parametrize("bad", [
    {"codecs": "int8", "ranges": [[None, []]]},
    {"codecs": ["int8"], "ranges": []},
    {"codecs": ["int8"], "ranges": [[None, "mpi+int8@ring"]]},
    {"codecs": ["int8"], "ranges": [[None, ["mpi-int8"]]]},
    {"codecs": ["int8"], "ranges": [[None, []], [4, []]]},
])
def test_malformed_compressed_field_is_refused(bad):
    data = table_of(figures()).data
    data["entries"][0]["compressed"] = bad
    with pytest.raises(TableError, match="compressed|codecs"):
        TuningTable(data)


def test_sweep_columns():
    cols = sweep.compressed_columns("reduce_scatter", ["mpi", "gloo", "mpi@2"], ("int8",))
    assert cols == ["mpi+int8@ring", "gloo+int8@ring", "mpi+int8@a2a", "gloo+int8@a2a"]
    assert sweep.compressed_columns("all_gather", ["mpi"], ("fp16", "int8")) == \
        ["mpi+fp16@ring", "mpi+int8@ring"]
    assert sweep.compressed_columns("all_to_all", ["mpi", "gloo"], ("fp16",)) == \
        ["mpi+fp16@a2a", "gloo+fp16@a2a"]
    assert sweep.compressed_columns("broadcast", ["mpi"], ("int8",)) == []
    assert sweep.split_column("mpi+int8:512@a2a") == ("mpi", "int8:512@a2a")
    assert sweep.split_column("mpi@2") == ("mpi", None)


def test_tune_codecs_are_checked_before_anything_runs():
    ops = ["all_gather"]
    assert _tune_codecs(None, "cpu", ops) == ()
    assert _tune_codecs("fp16, int8,fp16", "cpu", ops) == ("fp16", "int8")
    for text, msg in (("int8@a2a", "codec names"), ("auto:int8", "codec names"),
                      ("int9", "unknown codec"), ("zfp:16", "CUDA|zfp")):
        with pytest.raises(SystemExit, match=msg):
            _tune_codecs(text, "cuda" if text.startswith("zfp") else "cpu", ops)
    with pytest.raises(SystemExit, match="--ops"):
        _tune_codecs("int8", "cpu", ["broadcast"])


def test_a_cuda_tune_leaves_barrier_to_the_host_tune():
    """A cuda barrier entry would never be read (a barrier on CUDA is selected only for a
    named backend, which comes before the table)."""
    ops = ["all_reduce", "barrier", "send_recv"]
    assert tuned_ops(ops, "cuda") == ["all_reduce", "send_recv"]
    assert tuned_ops(ops, "cpu") == ops
