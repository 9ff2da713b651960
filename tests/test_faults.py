"""Fault injection (issue 10, part B): stragglers, dead peers, mismatched calls, bad
tuning tables and unwaited async work, at 2 ranks under mpiexec. Each launch has a hard
timeout (a hang fails the test), and every case is checked on the surviving ranks: the
right exception, within MCRDL_TIMEOUT plus a margin (tests/faults/plan.py has the plan,
tests/faults/job.py the cases; tests/faults/table.py prints docs/reliability.md's table).
Launches run four at a time: they mostly wait on timeouts, so this keeps the file's
wall time near its longest launch."""
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "faults"))
import plan  # noqa: E402

LAUNCHES = [launch for launch in plan.LAUNCHES if launch.in_test]
_RESULTS: dict = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("faults"))
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda launch: plan.run(launch, tmp), LAUNCHES))
    return {r.launch.name: r for r in done}


@pytest.mark.multirank
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [launch.name for launch in LAUNCHES])
def test_fault_launch(results, name):
    res = results[name]
    print(f"{name}: exit {res.rc}, {res.wall:.1f} s")
    for r in res.records:
        print(f"  rank {r['rank']} {r['case']}: {r['outcome']} after {r['seconds']} s")
    bad = plan.problems(res)
    assert not bad, "\n".join(bad) + "\n--- output tail ---\n" + res.output[-6000:]
