#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels that scripts/gpu_check.sh installs offline on the
# lent GPU machine (which has python3 with numpy, numba, numba-cuda, CuPy, torch, triton, pytest,
# pytest-xdist and pytest-timeout, and no network) into the gitignored scripts/wheels/, which
# the run command carries (docs/gpu.md). All are pure-Python wheels; each is fetched for every
# Python the machine may have, so that whichever it is finds its own.
#
#   bash scripts/fetch_gpu_wheels.sh        # then: ls scripts/wheels
set -euo pipefail
cd "$(dirname "$0")/.."
dest=scripts/wheels
mkdir -p "$dest"
# kda's own (array-api-compat, threadpoolctl); the tests' (hypothesis and what it imports:
# sortedcontainers, and exceptiongroup + typing-extensions below Python 3.11); fla's Triton
# chunk_kda (fla-core, the version CI tests against, and einops); pytest-timeout in case
packages=(
    "array-api-compat>=1.9"
    "threadpoolctl>=3"
    "hypothesis>=6.100"
    "sortedcontainers>=2.1,<3"
    "exceptiongroup>=1"
    "typing-extensions>=4.6"
    "einops"
    "fla-core==0.6.0"
    "pytest-timeout>=2"
)
for version in 3.10 3.11 3.12 3.13; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
        --dest "$dest" "${packages[@]}"
done
ls -l "$dest"
du -sh "$dest"
