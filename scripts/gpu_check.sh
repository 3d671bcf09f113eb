#!/usr/bin/env bash
# Real-GPU check of kda's CUDA backend on a lent GPU machine (one H200; CuPy, numba-cuda, torch,
# triton and pytest preinstalled there; no network). Finishes within ~9 minutes.
#
# Prepare here (with network), once; the wheels land in the gitignored scripts/wheels/:
#   pip download --no-deps fla-core array-api-compat threadpoolctl hypothesis sortedcontainers attrs einops -d scripts/wheels/
#   for v in 3.10 3.12 3.13; do
#     pip download --no-deps hypothesis --python-version $v --only-binary=:all: -d scripts/wheels/
#   done
# Run there from the repository root, carrying the wheels:
#   run(command="bash scripts/gpu_check.sh", carry=["scripts/wheels"], timeout_s=590)
# Writes under $OUT: nvidia-smi.txt, pip.txt, pytest.txt (tests/backends/test_cuda.py and tests/backends/test_ptx.py,
# plus every other tests/test_*.py that uses CuPy: decode, plans, torch on CUDA, ...; each skips
# what it cannot run), bench.json + bench.md (accuracy at B=2 H=16 T=4096 K=V=128 float32 vs the
# float64 reference recurrence; timings of kda.cuda and of fla's Triton chunk_kda at B=1 H=16
# T=4096 K=V=128; milliseconds per kda.cuda kernel), bench.txt, and summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kda_gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset NUMBA_ENABLE_CUDASIM
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0  # small grids are expected in the tests
start=$(date +%s)

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python --version >> "$OUT/nvidia-smi.txt" 2>&1

# offline installs of what the machine may lack; one wheel at a time so that a wheel for
# another Python version fails alone
for whl in scripts/wheels/*.whl; do
    python -m pip install --no-index --no-deps --quiet "$whl" >> "$OUT/pip.txt" 2>&1 || echo "skipped $whl" >> "$OUT/pip.txt"
done
python -m pip list 2>/dev/null | grep -i -E "numba|cupy|torch|triton|fla|hypothesis|array.api|cuda" >> "$OUT/pip.txt"

# 1. the cuda tests on CuPy arrays (the modules pick CuPy when /dev/nvidiactl exists), the PTX
#    checks, and every other test module that uses CuPy
# (tests/backends/test_primitives.py is left out: it hands NumPy arrays to the kernels, which only the
# simulator takes without a copy warning; CI runs it there)
gpu_tests=$(grep -l -i -E "cupy|cuda" tests/test_*.py | grep -v test_primitives.py | sort -u | tr '\n' ' ')
echo "test modules: $gpu_tests" > "$OUT/pytest.txt"
timeout 300 python -m pytest $gpu_tests -q -p no:cacheprovider -rs --durations=15 >> "$OUT/pytest.txt" 2>&1
echo "pytest exit $? after $(( $(date +%s) - start )) s" | tee "$OUT/summary.txt"

# 2. accuracy at scale and timings against fla
timeout 220 python scripts/gpu_bench.py --out "$OUT" > "$OUT/bench.txt" 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
tail -n 3 "$OUT/pytest.txt" >> "$OUT/summary.txt"
cat "$OUT/bench.md" >> "$OUT/summary.txt" 2>/dev/null
cat "$OUT/summary.txt"
