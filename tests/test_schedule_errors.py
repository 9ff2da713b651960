"""A multi-stage call (compressed, two-level) whose library fails a stage while the call
is being issued raises what a wait on it would: CommFailedError naming op, group and
backend, with the group marked broken, not the library's own exception (ranks that
chose different codecs made MPI truncate a ring stage's receive inside
``ScheduleWork.__init__``, and mpi4py's MPI.Exception escaped to the caller)."""
import pytest

from mcrdl_core.base.errors import CommFailedError, InvalidArgumentError
from mcrdl_core.base.ops import Op
from mcrdl_core.compress.schedule import ScheduleWork


class LibraryError(Exception):
    """Stands for a library's own exception (mpi4py's MPI.Exception)."""


class Stage:
    op, desc, host_progress, error = "recv", "stage", False, None

    def test(self):
        raise LibraryError("Message truncated")


class FakeGroup:
    broken = None

    def describe(self):
        return "group 'g' (ranks [0, 1])"

    def mark_broken(self, error):
        self.broken = error


def stages(first):
    yield first
    yield first


def test_a_stage_failing_at_the_issue_raises_comm_failed_and_breaks_the_group():
    g = FakeGroup()
    with pytest.raises(CommFailedError, match="all_reduce on group 'g'.*mpi\\+int8@ring.*"
                       "Message truncated") as got:
        ScheduleWork("mpi+int8@ring", Op.ALL_REDUCE, g, stages(Stage()))
    assert isinstance(got.value.__cause__, LibraryError)
    assert g.broken is got.value


def test_mcrdl_errors_at_the_issue_pass_unchanged():
    def refused():
        raise InvalidArgumentError("bad input")
        yield  # (a generator)

    g = FakeGroup()
    with pytest.raises(InvalidArgumentError, match="bad input"):
        ScheduleWork("mpi+int8@ring", Op.ALL_REDUCE, g, refused())
    assert g.broken is None
