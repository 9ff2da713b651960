"""The tests under tests/mpi/ run inside mpiexec (launched by test_multirank.py); a plain
pytest run must not collect them itself."""
import os

collect_ignore = [] if os.environ.get("MCRDL_MPI_TESTS") == "1" else ["mpi"]
