#!/usr/bin/env bash
# lm-evaluation-harness, stock, against an OpenAI-compatible server: the two local tasks of
# lm_eval_tasks/ (bov_next_sentence: loglikelihood requests; bov_continue: generate_until),
# model local-completions with its defaults (tokenized requests: prompts sent as token ids),
# batch size 4, per-sample logs for compare_loglikelihoods.py.
#
#   benchmarks/clients/lm_eval.sh URL MODEL OUT_DIR HF_TOKENIZER_DIR [huggingface|remote]
#
# URL: the server's root (http://127.0.0.1:8000). HF_TOKENIZER_DIR: written by
# `python -m bov_jax.interop.hf_tokenizer --workdir=RUN --out=DIR` (used by the huggingface
# backend; the remote backend asks the server's /tokenizer_info, /tokenize, /detokenize).
# Waits for URL/health to answer 200 (WAIT_S, default 600 s) first. Environment:
# LM_EVAL_VENV (default /work/clients/lm_eval_venv), MAX_LENGTH (lm-eval's
# max_length, default 2048: set the model's seq_len), LIMIT (items per task, default all).
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n 2,14p "$0" >&2
  exit 2
fi
url=${1%/}
model=$2
out=$(realpath -m "$3")
tokenizer=$(realpath "$4")
backend=${5:-huggingface}
venv=${LM_EVAL_VENV:-/work/clients/lm_eval_venv}
"$(dirname "$0")/wait_ready.sh" "$url" "${WAIT_S:-600}"
mkdir -p "$out"
args="model=$model,base_url=$url/v1/completions,tokenizer_backend=$backend"
args+=",tokenized_requests=True,max_length=${MAX_LENGTH:-2048},max_retries=1,timeout=600"
if [ "$backend" = huggingface ]; then
  args+=",tokenizer=$tokenizer"
fi
limit=()
if [ -n "${LIMIT:-}" ]; then
  limit=(--limit "$LIMIT")
fi
# The tasks' data paths are relative to their folder; nothing is fetched from the hub.
cd "$(dirname "$0")/lm_eval_tasks"
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$venv/bin/lm_eval" run --model local-completions --model_args "$args" \
  --tasks bov_next_sentence,bov_continue --include_path . --batch_size 4 \
  --output_path "$out" --log_samples "${limit[@]}" 2>&1 | tee "$out/lm_eval.log"
