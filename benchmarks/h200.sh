#!/usr/bin/env bash
# The prepared device checks on a single H200 (run through the session's device tool), sized
# for a 15-minute device budget: the machine's start, one default run and one rerun or second
# mode. Every mode uses bf16, cuDNN attention (XLA attention if cuDNN fails), embedded-corpus
# token ids and 8 micro-batches per step (the cap; d12 trains with 16 and d24 with 64, the
# optimizer share scales down further). Usage: bash benchmarks/h200.sh [MODE]
#   (none)  d12 and d24 pairs (baseline, BoV) with the XLA GPU flags of
#           bov_jax/train/xla_flags.py: step time, the step's two halves (gradients,
#           optimizer: tests/test_bench.py checks that they add up to the step), MFU,
#           tokens/s, peak memory, BoV/baseline step ratio (interleaved); d24 BoV profiled
#           (time by category and named scope, the shares attributed); a whole trace of one
#           quickstart step kept in gpu_profile/ (the xplane and the step's HLO: a fixture for
#           the profile's tests). At most 150 + 270 + 90 s.
#   d12|d24 that pair alone (a rerun).
#   flags   the d12 pair without the XLA flags (BOV_XLA_GPU_FLAGS=0), steps only: at most 120 s.
#   decode  d24 decoding at batch 8, baseline vs BoV with and without the V cache, with the
#           bank kernel and with XLA ops in its place: at most 480 s (66 s each at 49cab77).
#   rows    the micro-batch size: both pairs at 4 micro-batches of 2x and 4x their default rows
#           per device, steps only (tokens/s and peak memory against the default run's):
#           at most 540 s.
# The image's jax/flax/optax are used; what it lacks (benchmarks/h200_wheels.txt) is carried
# as wheels in .whl/: run `bash benchmarks/h200_wheels.sh` here first, then carry .whl
# (tests/test_h200_image.py runs both benches with only the image's packages and these).
# --profile turns the GPU's command buffers off (bov_jax/train/xla_flags.py), so that the
# trace has an event per op. Results land in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, 'jaxlib', \
jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__)" | tee -a "$OUT/gpu.txt"
bench() {  # name, timeout, configs, device batch, extra flags...
  local name=$1 limit=$2 configs=$3 rows=$4; shift 4
  timeout "$limit" python3 -m bov_jax.bench train --configs="$configs" --dtype=bfloat16 \
      --attention="$attn" --device_batch_size="$rows" --max_micro_batches=8 --steps=2 --reps=3 \
      --json_out="$OUT/train_$name.json" "$@" 2>&1 | grep -v "^W[0-9]" | tee "$OUT/train_$name.log"
  return "${PIPESTATUS[0]}"
}
decode() {  # d24 decode at batch 8: baseline vs BoV with and without the V cache; the bank
  # kernel (bov_jax/inference/bank_gather.py), then XLA ops in its place (BOV_BANK_KERNEL=0)
  for kernel in 1 0; do
    BOV_BANK_KERNEL=$kernel timeout 240 python3 -m bov_jax.inference.bench_decode --baseline=d24 \
        --bov=d24_bov --depth=24 --model_dim=1536 --head_dim=128 --vocab_size=32768 \
        --dtype=bfloat16 --batch=8 --contexts=2048,32768 --new_tokens=64 \
        --json_out="$OUT/decode_d24_bank_kernel$kernel.json" 2>&1 \
        | grep -v "^W[0-9]" | tee "$OUT/decode_d24_bank_kernel$kernel.log"
  done
}
only=${1:-}
if [ "$only" = decode ]; then decode; exit; fi
attn=cudnn
if [ "$only" = rows ]; then
  for r in 16 32; do
    bench "d24_rows$r" 170 configs/d24.py,configs/d24_bov.py $r --micro_batches=4 --noparts
  done
  for r in 32 64; do
    bench "d12_rows$r" 100 configs/d12.py,configs/d12_bov.py $r --micro_batches=4 --noparts
  done
  exit
fi
if [ "$only" = flags ]; then
  BOV_XLA_GPU_FLAGS=0 bench d12_noflags 120 configs/d12.py,configs/d12_bov.py 16 --noparts
  exit
fi
if [ "$only" != d24 ]; then
  bench d12 150 configs/d12.py,configs/d12_bov.py 16 \
      || { attn=xla; bench d12 150 configs/d12.py,configs/d12_bov.py 16; }
fi
[ "$only" != d12 ] && bench d24 270 configs/d24.py,configs/d24_bov.py 8 --profile="$OUT/trace"
rm -rf "$OUT/trace"  # the printed and JSON breakdowns are what comes back
if [ -z "$only" ]; then  # a small trace, whole: bov_jax.bench.profile.trace_breakdown reads it
  timeout 90 python3 -m bov_jax.bench train --configs=configs/quickstart.py --dtype=bfloat16 \
      --attention="$attn" --max_micro_batches=1 --steps=1 --reps=1 --noparts \
      --profile="$OUT/gpu_profile" 2>&1 | grep -v "^W[0-9]" | tee "$OUT/gpu_profile.log"
  rm -f "$OUT"/gpu_profile/config0/plugins/profile/*/*.trace.json.gz  # the xplane holds it
fi
