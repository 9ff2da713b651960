# make demo : create .venv, install, run the demo on 2 local ranks
# make test : create .venv, install, run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# the venv's bin/ holds mpiexec and mpicc from the mpich wheel
export PATH := $(abspath $(VENV))/bin:$(PATH)
STAMP := $(VENV)/.mcrdl-installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch (a newer or unpinned torch would pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	# MPI first, in a step of its own: mpi4jax (below) compiles against the mpicc that the
	# mpich wheel puts in .venv/bin, which does not exist until this step has finished
	# (a pip call that installs both builds mpi4jax before mpich is unpacked)
	$(PY) -m pip install -q -e '.[mpich]'
	test -x $(VENV)/bin/mpicc || { echo "the mpich wheel installed no mpicc in $(VENV)/bin" >&2; exit 1; }
	# mpi4jax compiles against the venv's MPICH (mpicc is in .venv/bin, on PATH above);
	# CUDA_PATH points at an empty folder so that a machine with nvcc but no CUDA
	# headers builds the CPU-only extension instead of failing
	mkdir -p $(VENV)/no-cuda
	# gpu: CuPy + NCCL wheels; they import without a GPU (the NCCL backend then reports
	# itself unavailable with the reason, and the GPU tests skip)
	CUDA_PATH=$(abspath $(VENV))/no-cuda $(PY) -m pip install -q -e '.[mpich,torch,jax,test,bench,gpu]'
	touch $(STAMP)

# the MPI backend's compiled hot path (backends/mpi_fast.c), against the venv's MPICH;
# rebuilt when its source changes (without it the fast path issues through mpi4py)
FAST := $(VENV)/.mcrdl-mpi-fast
$(FAST): $(STAMP) backends/mpi_fast.c backends/build.py
	$(PY) -m mcrdl_backends.build
	touch $(FAST)

# the torch frontend's tensor facts in C++ (frontends/torch/facts.cpp), against the venv's
# torch; optional: without a C++ compiler the frontend reads them from Python (a note
# says so), rebuilt when its source changes
FACTS := $(VENV)/.mcrdl-torch-facts
$(FACTS): $(STAMP) frontends/torch/facts.cpp frontends/torch/build.py
	$(PY) -m mcrdl_torch.build || echo "note: mcrdl_torch.tensor_facts not built; the torch frontend reads tensor facts from Python" >&2
	touch $(FACTS)

# the host codecs' inner loops in C (mcrdl_core/compress/codec_kernels.c), a plain shared
# library loaded with ctypes; optional: without a C compiler the int8/fp8/fp16 codecs run
# their NumPy path (the same bytes, slower), rebuilt when its source changes
KERNELS := $(VENV)/.mcrdl-codec-kernels
$(KERNELS): $(STAMP) mcrdl_core/compress/codec_kernels.c mcrdl_core/tools/build_codecs.py
	$(PY) -m mcrdl_core.tools.build_codecs || echo "note: codec kernels not built; the int8/fp8/fp16 codecs run their NumPy path" >&2
	touch $(KERNELS)

# the flight recorder's ring in C (mcrdl_core/observe/ring.c), against this Python's
# headers; optional: without a C compiler the recorder keeps its entries in Python
# columns (the same entries, a few tenths of a µs more per call), rebuilt when its
# source changes
RING := $(VENV)/.mcrdl-ring
$(RING): $(STAMP) mcrdl_core/observe/ring.c mcrdl_core/tools/build_ring.py
	$(PY) -m mcrdl_core.tools.build_ring || echo "note: the recorder's C ring not built; the flight recorder keeps its entries in Python" >&2
	touch $(RING)

install: $(STAMP) $(FAST) $(FACTS) $(KERNELS) $(RING)

# tune on 2 local ranks (short size range), then bench auto against each backend
demo: install
	mpiexec -n 2 $(VENV)/bin/mcrdl tune --max-bytes 64K
	mpiexec -n 2 $(VENV)/bin/mcrdl bench --max-bytes 64K --out bench/out
	mpiexec -n 2 $(VENV)/bin/mcrdl info
	$(PY) bench/demo_cluster.py

# pytest's exit 5 (no test collected) would reach make's caller as make's own 2; say it here
test: install
	$(PY) -m pytest --durations=15; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5): nothing was checked" >&2; exit 0; fi; \
	exit $$rc

bench: install
	mpiexec -n 2 $(PY) bench/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
