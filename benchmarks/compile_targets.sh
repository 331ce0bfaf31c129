#!/usr/bin/env bash
# Recompile every row of docs/targets.md's table into docs/results/targets/<name>.json (the
# reports `python benchmarks/targets_table.py` renders). TPU rows need requirements-aot.txt;
# NVIDIA rows the CUDA plugin, from the interpreter in $CUDA_PYTHON (a venv with
# "jax[cuda12]==<jax version>"; rows skipped with a line when unset). Hours of CPU on 2 cores:
# run it in the background. Usage: bash benchmarks/compile_targets.sh [NAME ...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=docs/results/targets
PY=${PYTHON:-python3}
DP="--config.mesh.fsdp=1"
FS="--config.mesh.data=1 --config.mesh.fsdp=8"
# name | python (tpu or gpu) | compile flags
ROWS=(
  "d12_v5p-8|tpu|--config=configs/d12.py --target=v5p-8 $DP --device_batch_size=32"
  "d12_bov_v5p-8|tpu|--config=configs/d12_bov.py --target=v5p-8 $DP --device_batch_size=32"
  "d12_bov_v5e-8|tpu|--config=configs/d12_bov.py --target=v5e-8 $DP --device_batch_size=8"
  "d12_bov_v5e-8_fsdp8|tpu|--config=configs/d12_bov.py --target=v5e-8 $FS --device_batch_size=16"
  "d12_bov_v6e-8|tpu|--config=configs/d12_bov.py --target=v6e-8 $DP --device_batch_size=32"
  "d12_bov_h100x8|gpu|--config=configs/d12_bov.py --target=h100 --gpus=8 $DP --device_batch_size=32"
  "d12_h200x8|gpu|--config=configs/d12.py --target=h200 --gpus=8 $DP --device_batch_size=32"
  "d12_bov_h200x8|gpu|--config=configs/d12_bov.py --target=h200 --gpus=8 $DP --device_batch_size=32"
  "d24_v5p-8|tpu|--config=configs/d24.py --target=v5p-8 $DP --device_batch_size=16"
  "d24_bov_v5p-8|tpu|--config=configs/d24_bov.py --target=v5p-8 $DP --device_batch_size=16"
  "d24_bov_v5p-64|tpu|--config=configs/d24_bov.py --target=v5p-64 $DP --device_batch_size=8"
  "d24_bov_v6e-8|tpu|--config=configs/d24_bov.py --target=v6e-8 $DP --device_batch_size=4"
  "d24_bov_v6e-8_fsdp8|tpu|--config=configs/d24_bov.py --target=v6e-8 $FS --device_batch_size=8"
  "d24_bov_v5e-8|tpu|--config=configs/d24_bov.py --target=v5e-8 $DP --device_batch_size=1"
  "d24_bov_v5e-8_fsdp8|tpu|--config=configs/d24_bov.py --target=v5e-8 $FS --device_batch_size=2"
  "d24_bov_v5e-8_fsdp8_rows|tpu|--config=configs/d24_bov.py --target=v5e-8 $FS --find_rows"
  "d24_h100x8|gpu|--config=configs/d24.py --target=h100 --gpus=8 $DP --device_batch_size=8"
  "d24_bov_h100x8|gpu|--config=configs/d24_bov.py --target=h100 --gpus=8 $DP --device_batch_size=8"
  "d24_bov_h200x8|gpu|--config=configs/d24_bov.py --target=h200 --gpus=8 $DP --device_batch_size=16"
  "d24_bov_h200x8_fsdp8|gpu|--config=configs/d24_bov.py --target=h200 --gpus=8 $FS --device_batch_size=16"
  "d24_bov_h200x1_8x8|gpu|--config=configs/d24_bov.py --target=h200 --gpus=1 --config.train.total_batch_tokens=131072 --device_batch_size=8"
  "d32_bov_v5p-64_fsdp32|tpu|--config=configs/d24_bov.py --config.model.depth=32 --target=v5p-64 --config.mesh.data=1 --config.mesh.fsdp=32 --device_batch_size=16"
  "quickstart_v5e-4|tpu|--config=configs/quickstart.py --target=v5e-4 $DP --device_batch_size=2"
)
for row in "${ROWS[@]}"; do
  IFS='|' read -r name kind flags <<<"$row"
  if (($# > 0)) && [[ " $* " != *" $name "* ]]; then continue; fi
  python=$PY
  if [ "$kind" = gpu ]; then
    python=${CUDA_PYTHON:-}
    [ -n "$python" ] || { echo "$name: skipped (set CUDA_PYTHON)"; continue; }
  fi
  echo "$name: $python -m bov_jax.compile $flags"
  # shellcheck disable=SC2086  # flags are words
  "$python" -m bov_jax.compile $flags --json_out="$OUT/$name.json" >"$OUT/$name.log" 2>&1
  echo "$name: exit $? ($(tail -1 "$OUT/$name.log" | cut -c1-120))"
done
