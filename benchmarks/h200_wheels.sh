#!/usr/bin/env bash
# Download the wheels benchmarks/h200.sh needs on the H200 image into .whl/ (Python 3.12,
# manylinux x86-64): one per line of benchmarks/h200_wheels.txt, without their dependencies
# (the list names each one the image lacks). A package with no such wheel (promise: an sdist
# only) is built here into a pure-Python wheel. Carry .whl with the device tool's `run`.
#   bash benchmarks/h200_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
grep -v '^\s*#' benchmarks/h200_wheels.txt | grep -v '^\s*$' | while read -r spec; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$spec" 2>/dev/null ||
    python3 -m pip wheel -q --no-deps -w .whl "$spec"
done
ls .whl
