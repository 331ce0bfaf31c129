#!/usr/bin/env bash
# One prepared device check on a single H200 (run through the session's device tool):
# train-step throughput and MFU for d12 and d24, baseline vs BoV (bf16, cuDNN attention),
# then decode tokens/s and cache bytes, baseline vs BoV. Results land in $OUT.
# Wheels in .whl/ pin flax/optax/ml_collections to the versions the project is tested with.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
common="--dtype=bfloat16 --attention=cudnn"
timeout 200 python3 -m bov_jax.bench train --configs=configs/d12.py,configs/d12_bov.py $common \
    --device_batch_size=16 --steps=10 --json_out="$OUT/train_d12.json" 2>&1 | grep -v "^W" | tee "$OUT/train_d12.log"
timeout 260 python3 -m bov_jax.bench train --configs=configs/d24.py,configs/d24_bov.py $common \
    --device_batch_size=8 --steps=5 --json_out="$OUT/train_d24.json" 2>&1 | grep -v "^W" | tee "$OUT/train_d24.log"
timeout 120 python3 -m bov_jax.bench_decode --baseline=d24 --bov=d24_bov --depth=24 --model_dim=1536 \
    --head_dim=128 --vocab_size=32768 --dtype=bfloat16 --batch=8 --contexts=2048,8192,32768 \
    2>&1 | grep -v "^W" | tee "$OUT/decode_d24.log"
