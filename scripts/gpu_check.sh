#!/usr/bin/env bash
# The one-shot check of kda's CUDA backend on a lent GPU machine (one H200, driver 580 / CUDA 13;
# python3 with CuPy, numba-cuda, torch, triton, pytest, pytest-xdist, pytest-timeout; no network),
# and the same steps on a CPU machine under Numba's CUDA simulator (--simulate, run by CI).
#
#   bash scripts/gpu_check.sh              # on the GPU machine (docs/gpu.md has the run command)
#   OUT=$(mktemp -d) bash scripts/gpu_check.sh --simulate
#
# Before going to the GPU machine, fetch the wheels it lacks (scripts/fetch_gpu_wheels.sh, into
# the gitignored scripts/wheels/, carried there with the working tree).
#
# Steps, correctness before speed, each under its own cap (timeout -s INT: pytest still writes
# its report) within an overall budget (KDA_CHECK_BUDGET seconds: 360 on a GPU, 540 under the
# simulator); each step's status and time are appended to $OUT/summary.txt as it finishes:
#   env        nvidia-smi, python3, the relevant packages            -> env.txt
#   wheels     offline installs of what does not import (scripts/wheels/) -> wheels.txt
#   preflight  versions, the device, one tiny chunk_kda vs the recurrence -> preflight.txt;
#              a failure stops the check here
#   pytest     every test marked `cuda` (tests/conftest.py: what runs kda.cuda's kernels), -n
#              workers, a per-test timeout                       -> pytest.txt, pytest.xml
#   bench      accuracy at scale in four gate regimes, then timings and per-kernel times with
#              check_finite=False (scripts/gpu_bench.py)          -> bench.txt, bench.json, bench.md
#   fla        fla's Triton chunk_kda, bfloat16 only             -> fla.txt, added to bench.*
# Exit status: 0 when every step passed (a skipped fla counts as passed), else 1.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

mode=gpu
case "${1:-}" in
    --simulate) mode=simulate ;;
    "") ;;
    *) echo "usage: $0 [--simulate]" >&2; exit 2 ;;
esac

OUT="${OUT:-/tmp/kda_gpu_check}"
mkdir -p "$OUT"
summary="$OUT/summary.txt"
: > "$summary"
PY="${KDA_PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
# what scripts/wheels/ provides is installed into $site (the wheels step), on the path; outside
# the repository, so that no install made on one machine travels to another with the wheels
site="${KDA_SITE:-${TMPDIR:-/tmp}/kda_gpu_site}"
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}"
export HYPOTHESIS_PROFILE=ci
if [ "$mode" = simulate ]; then
    export NUMBA_ENABLE_CUDASIM=1
    budget="${KDA_CHECK_BUDGET:-540}"
    tests_cap=$((budget - 120))  # 420 s of the default budget
    workers="${KDA_CHECK_WORKERS:-2}"
    per_test=240  # the simulator runs every thread in Python
    simulate_flag=--simulate
else
    unset NUMBA_ENABLE_CUDASIM
    budget="${KDA_CHECK_BUDGET:-360}"
    tests_cap=180
    workers="${KDA_CHECK_WORKERS:-4}"
    per_test=90
    simulate_flag=
fi
start=$(date +%s)
deadline=$((start + budget))
failures=0

note() { echo "$*" | tee -a "$summary"; }

# run_step NAME CAP RESERVE CMD...: CMD (a program: shell functions go through bash -c, exported)
# with its output in $OUT/NAME.txt, cut (SIGINT, then SIGKILL 15 s later) after CAP seconds or
# when only RESERVE seconds of the budget are left for the steps after it; appends
# "NAME: ok|FAILED|CUT ... in N s" to the summary
run_step() {
    local name=$1 cap=$2 reserve=$3
    shift 3
    local now left t0 rc status
    now=$(date +%s)
    left=$((deadline - now - reserve))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 5 ]; then
        note "$name: SKIPPED (no time left in the ${budget} s budget)"
        failures=$((failures + 1))
        return 1
    fi
    t0=$(date +%s)
    timeout -s INT -k 15 "$cap" "$@" > "$OUT/$name.txt" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 130 | 137) status="CUT at the ${cap} s cap" ;;
        *) status=FAILED ;;
    esac
    note "$name: $status (exit $rc) in $(($(date +%s) - t0)) s, $(($(date +%s) - start)) s since start"
    [ "$rc" -eq 0 ] || failures=$((failures + 1))
    return "$rc"
}

note "kda gpu_check ($mode) at $(date -u +%FT%TZ), budget ${budget} s, out $OUT"

# env: what the machine has (never fails the check)
env_info() {
    if [ "$mode" = gpu ]; then nvidia-smi || echo "nvidia-smi failed"; fi
    command -v "$PY" && "$PY" --version
    "$PY" -m pip list 2>/dev/null | grep -i -E "numba|cupy|torch|triton|fla|hypothesis|array.api|pytest|cuda|numpy|einops|threadpool"
    git -C "$root" log -1 --format="commit %H %s" 2>/dev/null || true
}
export -f env_info
export PY mode root
run_step env 20 0 bash -c env_info

# wheels: offline installs of what the machine lacks, by import name; nothing when all import.
# Required: kda's own dependencies and the tests'; optional: fla's (its step reports a skip) and
# pytest's plugins (the tests then run without them)
REQUIRED="array_api_compat:array-api-compat threadpoolctl:threadpoolctl hypothesis:hypothesis"
REQUIRED="$REQUIRED sortedcontainers:sortedcontainers"
OPTIONAL="einops:einops fla:fla-core pytest_timeout:pytest-timeout xdist:pytest-xdist"
install_wheels() {
    set -o pipefail
    local pair missing=() failed=0
    if ! "$PY" -c "import sys; sys.exit(sys.version_info < (3, 11))"; then
        REQUIRED="$REQUIRED exceptiongroup:exceptiongroup"  # hypothesis's, below Python 3.11
    fi
    for pair in $REQUIRED $OPTIONAL; do
        "$PY" -c "import ${pair%%:*}" 2> /dev/null || missing+=("${pair#*:}")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        echo "every module imports: nothing to install"
        return 0
    fi
    echo "missing: ${missing[*]}"
    # one at a time, --no-deps, from the folder only (fla-core's torch and triton are the
    # machine's own), into $site (on PYTHONPATH: no write to the machine's site-packages, which
    # may be externally managed); --find-links picks the wheel that fits this Python. Where pip
    # fails, the wheel is unpacked there (every one is pure Python but hypothesis, whose wheel is
    # chosen by this Python's cpXY tag)
    local dist name tag whl
    tag=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
    mkdir -p "$site"
    for dist in "${missing[@]}"; do
        if ! "$PY" -m pip install --no-index --no-deps --find-links scripts/wheels --target "$site" \
            --upgrade "$dist" 2>&1 | tail -n 2; then
            name=$(echo "$dist" | tr - _)
            whl=$(ls scripts/wheels/"$name"-*-py3-none-any.whl scripts/wheels/"$name"-*-py2.py3-none-any.whl \
                scripts/wheels/"$name"-*-"$tag"-*.whl 2> /dev/null | tail -n 1)
            if [ -n "$whl" ]; then
                echo "pip failed: unpacking $whl"
                "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$whl" "$site"
            fi
        fi
    done
    for pair in $REQUIRED; do
        "$PY" -c "import ${pair%%:*}" 2> /dev/null || { echo "still missing: ${pair#*:}"; failed=1; }
    done
    for pair in $OPTIONAL; do
        "$PY" -c "import ${pair%%:*}" 2> /dev/null || echo "still missing (optional): ${pair#*:}"
    done
    [ -d scripts/wheels ] || echo "(no scripts/wheels/: run scripts/fetch_gpu_wheels.sh and carry it)"
    return $failed
}
export -f install_wheels
export REQUIRED OPTIONAL site
run_step wheels 90 0 bash -c install_wheels

# preflight: stop here if the basics fail
if ! run_step preflight 120 210 "$PY" -u scripts/gpu_preflight.py $simulate_flag --summary "$summary"; then
    note "preflight failed: the check stops here (see $OUT/preflight.txt)"
    cat "$summary"
    exit 1
fi

# tests: everything marked cuda, wherever it lives
timeout_args=()
if "$PY" -c "import pytest_timeout" 2> /dev/null; then
    timeout_args=(--timeout "$per_test" --timeout-method thread)
else
    note "  (pytest-timeout is not installed: no per-test timeout)"
fi
xdist_args=()
if "$PY" -c "import xdist" 2> /dev/null && [ "$workers" -gt 1 ]; then
    xdist_args=(-n "$workers")
fi
# the reserves: what the steps after each one need at least (pytest 60 s, bench 100 s, fla 50 s)
run_step pytest "$tests_cap" 150 "$PY" -u -m pytest tests -m cuda "${xdist_args[@]}" "${timeout_args[@]}" \
    -p no:cacheprovider -v -rfEs --durations=20 --junitxml="$OUT/pytest.xml"
grep -E "^(=+ .*(passed|failed|error).* =+|FAILED|ERROR)" "$OUT/pytest.txt" | tail -n 15 | sed 's/^/  /' >> "$summary"

# bench: accuracy at scale first, then speed
run_step bench 120 50 "$PY" -u scripts/gpu_bench.py $simulate_flag --out "$OUT"
# fla: its Triton compiles on a cold cache; bfloat16 only
run_step fla 90 0 "$PY" -u scripts/gpu_bench.py $simulate_flag --fla --out "$OUT"
if [ -f "$OUT/bench.md" ]; then
    sed 's/^/  /' "$OUT/bench.md" >> "$summary"
fi

note "done in $(($(date +%s) - start)) s: $failures step(s) not ok"
[ "$failures" -eq 0 ]
