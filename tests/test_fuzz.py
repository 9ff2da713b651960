"""The differential fuzzer (tests/fuzz/, ``mcrdl fuzz``) on a bounded set of seeds at 2, 3
and 4 ranks (4: two emulated hosts of two ranks): random mixed programs of every
frontend, op, form, dtype, group, backend request, table and codec, each result checked
against NumPy on every rank, every bad input refused alike on every rank. A failure
prints its seed and a shrunk program to replay (``python tests/fuzz/driver.py --ranks N
--program FILE``). The long mode is ``mcrdl fuzz --ranks 4 --minutes 30``."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fuzz"))
import driver  # noqa: E402

#: seeds per rank count: about 20, 30 and 45 s of launches on the 2-core machine
SEEDS = {2: "0:150", 3: "1000:1100", 4: "2000:2040"}


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks", sorted(SEEDS))
def test_fuzz_seeds(ranks, tmp_path, capsys):
    status = driver.main(["--ranks", str(ranks), "--seeds", SEEDS[ranks], "--out",
                          str(tmp_path), "--shrink-seconds", "120"])
    out = capsys.readouterr().out
    print(out)
    assert status == 0, out[-12000:]
    lo, hi = (int(v) for v in SEEDS[ranks].split(":"))
    assert f"{hi - lo} programs passed, 0 failed" in out, out[-4000:]
