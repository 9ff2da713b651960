"""The MPI backend's compiled hot path (backends/mpi_fast.c): ``python -m
mcrdl_backends.build`` builds it against the MPI library mpi4py loads, the backend
loads it, refuses one built against another library, and ``mcrdl info`` says which
issuers the fast path uses. Its calls themselves are tested under mpiexec
(tests/mpi/test_fastpath*.py, with the module and, in a launch of their own, without)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py")

from mcrdl_backends import build  # noqa: E402
from mcrdl_backends import mpi as mpi_backend  # noqa: E402


def _python(code: str, **env) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, **env}, timeout=120).stdout


def test_build_writes_a_module_of_the_loaded_mpi_library():
    if build.mpicc() is None:
        pytest.skip("no mpicc (install the mpich wheel)")
    path = build.build(quiet=True)
    assert path == build.target() and path.exists()
    assert not list(path.parent.glob("tmp*.so")), "a temporary file was left behind"
    out = _python("from mcrdl_backends import mpi; m, why = mpi.compiled(); "
                  "print(m is not None, why, mpi.fast_module() is not None)")
    assert out.split() == ["True", "built", "True"], out
    off = _python("from mcrdl_backends import mpi; print(mpi.fast_module())",
                  MCRDL_MPI_FAST="0")
    assert off.strip() == "None"


def test_a_module_built_for_another_library_is_refused(monkeypatch):
    if mpi_backend.compiled()[0] is None:
        pytest.skip("the compiled module is not built")
    monkeypatch.setattr(mpi_backend, "_COMPILED", [])
    monkeypatch.setattr(mpi_backend.MPI, "Get_library_version", lambda: "Open MPI v5")
    mod, why = mpi_backend.compiled()
    assert mod is None and "another MPI library" in why and "mcrdl_backends.build" in why
    assert mpi_backend.fast_module() is None


def test_a_failed_build_says_what_failed(monkeypatch, tmp_path):
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\necho 'cc: no such header' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("MPICC", str(bad))
    before = sorted(build.target().parent.glob("tmp*"))
    with pytest.raises(RuntimeError, match="no such header"):
        build.build(quiet=True)
    assert sorted(build.target().parent.glob("tmp*")) == before  # nothing left behind


def test_info_names_the_issuers_in_use():
    out = subprocess.run([sys.executable, "-m", "mcrdl_core.tools.cli", "info"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MCRDL_MPI_FAST": "0",
                              "MCRDL_TUNING_TABLE": "none"}).stdout
    assert "MPI fast path: mpi4py issuers: MCRDL_MPI_FAST is off" in out, out


def test_a_module_built_from_another_source_version_is_refused(monkeypatch):
    if mpi_backend.compiled()[0] is None:
        pytest.skip("the compiled module is not built")
    monkeypatch.setattr(mpi_backend, "_COMPILED", [])
    monkeypatch.setattr(mpi_backend, "_FAST_VERSION", mpi_backend.mpi_fast.VERSION + 1)
    mod, why = mpi_backend.compiled()
    assert mod is None and "another version of mpi_fast.c" in why and "rebuild" in why
