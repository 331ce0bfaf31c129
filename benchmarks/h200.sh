#!/usr/bin/env bash
# One prepared device check on a single H200 (run through the session's device tool):
# train-step throughput and MFU for d12 and d24, baseline vs BoV, bf16 with cuDNN attention
# (falling back to XLA attention if cuDNN fails); `h200.sh decode` times d24 decoding instead.
# The image's jax/flax/optax are used; only ml_collections is carried as a wheel in .whl/.
# Results land in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__)" | tee -a "$OUT/gpu.txt"
bench() {  # name, timeout, configs, device batch, steps, attention
  timeout "$2" python3 -m bov_jax.bench train --configs="$3" --dtype=bfloat16 --attention="$6" \
      --device_batch_size="$4" --steps="$5" --json_out="$OUT/train_$1.json" 2>&1 \
      | grep -v "^W[0-9]" | tee "$OUT/train_$1.log"
}
decode() {  # d24 decode at batch 8: baseline vs BoV with and without the V cache
  timeout 300 python3 -m bov_jax.bench_decode --baseline=d24 --bov=d24_bov --depth=24 \
      --model_dim=1536 --head_dim=128 --vocab_size=32768 --dtype=bfloat16 --batch=8 \
      --contexts=2048,32768 --new_tokens=64 2>&1 | grep -v "^W[0-9]" | tee "$OUT/decode_d24.log"
}
only=${1:-}  # "d12" or "d24" runs that pair alone; "decode" runs the decode benchmark alone
if [ "$only" = decode ]; then decode; exit; fi
attn=cudnn
if [ "$only" != d24 ]; then
  bench d12 150 configs/d12.py,configs/d12_bov.py 16 10 $attn \
      || { attn=xla; bench d12 150 configs/d12.py,configs/d12_bov.py 16 10 $attn; }
fi
[ "$only" != d12 ] && bench d24 230 configs/d24.py,configs/d24_bov.py 8 5 $attn
