#!/usr/bin/env bash
# Both clients, stock, against one served run: exports the run's tokenizer for Hugging Face
# clients, serves the run on 127.0.0.1:PORT, runs lm_eval.sh (both tasks), compares its
# loglikelihoods with in-process scoring, runs guidellm.sh, and stops the server.
#
#   benchmarks/clients/run_all.sh WORKDIR PORT OUT_DIR
#
# Outputs under OUT_DIR: hf_tokenizer/, server.log, lm_eval/ (with lm_eval.log),
# compare.txt, guidellm/{chat,completions}/ (with guidellm.log). MAX_LENGTH (default: the
# run's seq_len from its config.json) is lm-eval's max_length; the other variables are
# lm_eval.sh's and guidellm.sh's; SERVE_FLAGS, more flags of the server (e.g. --nowarmup).
# The server runs with the Python on PATH (this project's environment).
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n 2,12p "$0" >&2
  exit 2
fi
workdir=$(realpath "$1")
port=$2
out=$(realpath -m "$3")
here=$(cd "$(dirname "$0")" && pwd)
name=$(basename "$workdir")
url=http://127.0.0.1:$port
mkdir -p "$out"
python -m bov_jax.interop.hf_tokenizer --workdir="$workdir" --out="$out/hf_tokenizer"
seq_len=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['model']['seq_len'])" \
  "$workdir/config.json")
# shellcheck disable=SC2086  # SERVE_FLAGS: more flags of the server, split on spaces
python -m bov_jax.serve --workdir="$workdir" --port="$port" ${SERVE_FLAGS:-} >"$out/server.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
export MAX_LENGTH=${MAX_LENGTH:-$seq_len}
"$here/lm_eval.sh" "$url" "$name" "$out/lm_eval" "$out/hf_tokenizer"
python "$here/compare_loglikelihoods.py" --workdir="$workdir" --max_length="$MAX_LENGTH" \
  "$out"/lm_eval/*/samples_bov_next_sentence_*.jsonl | tee "$out/compare.txt"
"$here/guidellm.sh" "$url" "$name" "$out/guidellm" "$out/hf_tokenizer"
