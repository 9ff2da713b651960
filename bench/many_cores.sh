#!/bin/bash
# The emulated-cluster benchmarks of the compression issue on a machine with a few cores
# per rank (the 2-core development VM runs 4 ranks on 2 cores, and there the compressed
# all-to-alls are CPU-bound). One command, in this order, each step skipped when too little
# of BUDGET (seconds) is left:
#   1. the compressed all-to-all alone, 2 hosts x 2 ranks at 1 Gbit/s, 4-16 MiB per rank;
#   2. the apps table's MoE block, 4 hosts x 1 rank at 1 Gbit/s, tuned, 3 rotated repeats;
#   3. the same on 2 hosts x 2 ranks.
# Every rank gets cores/4 intra-op threads (OMP_NUM_THREADS), as 4 hosts of that many cores
# would give it. Logs and results go to $OUT (default bench/out/many_cores).
#
#   sudo bash bench/many_cores.sh                        # with the project's .venv
#   PY=python3 WHEELS=DIR sudo -E bash bench/many_cores.sh   # another Python: installs
#       the wheels in DIR (mpi4py, mpich for that Python) and the project (--no-deps -e .)
#
# A machine without iproute2: put `ip` and `tc` (with the libraries they need next to
# them, in lib/, their rpath set to $ORIGIN/lib) in a folder and name it IPROUTE=DIR.
# Ran on a 16-core machine: docs/benchmarks.md, "MoE with cores to spare (16 cores,
# 4x1 at 1 Gbit/s)".
set -u
cd "$(dirname "$0")/.."
OUTD=${OUT:-bench/out/many_cores}; mkdir -p "$OUTD"
exec > >(tee "$OUTD/log.txt") 2>&1
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-3600}
left() { echo $((BUDGET - SECONDS)); }
PY=${PY:-$PWD/.venv/bin/python}
echo "== $(date -u) $(nproc) cores; $(uptime)"
if [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade "$WHEELS"/*.whl || exit 3
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 4
    "$PY" -m mcrdl_backends.build && "$PY" -m mcrdl_core.tools.build_codecs || exit 5
    "$PY" -m mcrdl_torch.build || echo "note: tensor facts not built (Python path)"
fi
BIN=$(dirname "$PY")
[ -n "${IPROUTE:-}" ] && export PATH=$IPROUTE:$PATH
for t in ip tc unshare nsenter; do command -v $t >/dev/null || { echo "missing: $t"; exit 6; }; done
T=$(( $(nproc) / 4 )); [ $T -ge 1 ] || T=1; export OMP_NUM_THREADS=$T
"$PY" -c "import sys, torch, mpi4py.MPI as M; print(sys.version.split()[0], 'torch', torch.__version__, M.Get_library_version().splitlines()[0], 'threads/rank', torch.get_num_threads())"

if [ "$(left)" -gt 120 ]; then
    echo "== 1. compressed all-to-all alone, 2x2 at 1 Gbit/s ($(left) s left; $(uptime))"
    for run in 1 2 3; do
        timeout $(( $(left) - 10 )) "$BIN/mcrdl" cluster run --hosts 2 --ranks-per-host 2 --rate 1gbit -- \
            "$PY" bench/compression.py --ops all_to_all --min-bytes 4M --max-bytes 16M --factor 2 \
            --codecs fp16,bf16,int8,fp8 --aa --rounds 7 2>&1 | grep -v "socket.cpp"
    done
fi
run_table() {
    local h=$1
    [ "$(left)" -gt 300 ] || { echo "== skipped the table on $h hosts: $(left) s left"; return; }
    echo "== table: 4 ranks on $h hosts at 1 Gbit/s, MoE comm-cap ($(left) s left; $(uptime))"
    timeout $(( $(left) - 10 )) "$PY" bench/apps/table.py --ranks 4 --cluster 1gbit --hosts "$h" \
        --tune --apps moe --shape comm-cap --steps 20 --repeats 3 --codecs bf16,int8 2>&1 \
        | grep -v "socket.cpp\|selection: tuning table"
    cp bench/out/apps_table_cluster_1gbit_"$h"h_comm-cap.json bench/out/apps_table_cluster_1gbit_"$h"h_comm-cap.png \
        bench/out/apps_tuning_cluster_1gbit_"$h"h.json "$OUTD"/ 2>/dev/null
}
run_table 4
run_table 2
echo "== done at $SECONDS s; $(uptime)"
