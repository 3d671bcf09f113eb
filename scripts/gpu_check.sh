#!/usr/bin/env bash
# Real-GPU check of kda's CUDA backend on a lent GPU machine (one H200; CuPy, numba-cuda, torch,
# triton and pytest preinstalled there; no network). Finishes within ~8 minutes.
#
# Prepare here (with network), once; the wheels land in the gitignored scripts/wheels/:
#   pip download --no-deps fla-core array-api-compat threadpoolctl hypothesis sortedcontainers attrs einops -d scripts/wheels/
#   for v in 3.10 3.12 3.13; do
#     pip download --no-deps hypothesis --python-version $v --only-binary=:all: -d scripts/wheels/
#   done
# Run there from the repository root, carrying the wheels:
#   run(command="bash scripts/gpu_check.sh", carry=["scripts/wheels"], timeout_s=540)
# Writes under $OUT: nvidia-smi.txt, pip.txt, pytest.txt (tests/test_cuda.py on CuPy arrays),
# bench.json + bench.md (accuracy at B=2 H=16 T=4096 K=V=128 float32 vs the float64 reference
# recurrence; timings of kda.cuda and of fla's Triton chunk_kda at B=1 H=16 T=4096 K=V=128),
# bench.txt, and summary.txt.
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

# 1. the cuda tests on CuPy arrays (the module picks CuPy when /dev/nvidiactl exists)
timeout 180 python -m pytest tests/test_cuda.py -q -p no:cacheprovider -rs --durations=10 > "$OUT/pytest.txt" 2>&1
echo "pytest exit $? after $(( $(date +%s) - start )) s" | tee "$OUT/summary.txt"

# 2. accuracy at scale and timings against fla
timeout 270 python scripts/gpu_bench.py --out "$OUT" > "$OUT/bench.txt" 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
tail -n 3 "$OUT/pytest.txt" >> "$OUT/summary.txt"
cat "$OUT/bench.md" >> "$OUT/summary.txt" 2>/dev/null
cat "$OUT/summary.txt"
