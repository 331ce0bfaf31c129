#!/usr/bin/env bash
# guidellm, stock, against an OpenAI-compatible server: its default benchmark (streaming
# /v1/chat/completions, synthetic text prompts) and the same over streaming /v1/completions,
# kept short: the synchronous profile (one request at a time), MAX_REQUESTS requests each.
#
#   benchmarks/clients/guidellm.sh URL MODEL OUT_DIR HF_TOKENIZER_DIR
#
# URL: the server's root (http://127.0.0.1:8000). HF_TOKENIZER_DIR: written by
# `python -m bov_jax.interop.hf_tokenizer --workdir=RUN --out=DIR`; guidellm counts and
# builds the synthetic prompts' tokens with it. Outputs: OUT_DIR/{chat,completions}/
# benchmarks.json and guidellm.log. Environment: GUIDELLM_VENV (default
# /work/clients/guidellm_venv), MAX_REQUESTS (default 8), PROMPT_TOKENS (default 64),
# OUTPUT_TOKENS (default 32), PROFILE (default synchronous; e.g. kind=constant,rate=2).
# Waits for URL/health to answer 200 (WAIT_S, default 600 s) first.
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n 2,14p "$0" >&2
  exit 2
fi
url=${1%/}
model=$2
out=$(realpath -m "$3")
tokenizer=$(realpath "$4")
venv=${GUIDELLM_VENV:-/work/clients/guidellm_venv}
profile=${PROFILE:-kind=synchronous}
"$(dirname "$0")/wait_ready.sh" "$url" "${WAIT_S:-600}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0
for endpoint in chat completions; do
  dir=$out/$endpoint
  mkdir -p "$dir"
  format=/v1/chat/completions
  [ "$endpoint" = completions ] && format=/v1/completions
  echo "== guidellm $endpoint ($format, streaming) -> $dir"
  "$venv/bin/guidellm" run \
    --backend "kind=openai_http,target=$url,model=$model,request_format=$format" \
    --profile "$profile" \
    --constraint "kind=max_requests,count=${MAX_REQUESTS:-8}" \
    --data "kind=synthetic_text,prompt_tokens=${PROMPT_TOKENS:-64},output_tokens=${OUTPUT_TOKENS:-32}" \
    --tokenizer "kind=huggingface_auto,model=$tokenizer" \
    --output "kind=json,path=$dir/benchmarks.json" --output kind=console \
    --disable-progress 2>&1 | tee "$dir/guidellm.log" || status=1
done
exit $status
