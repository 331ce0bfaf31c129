#!/usr/bin/env bash
# Waits until URL/health answers 200 (bov_jax.serve answers 503 while it warms up).
#   benchmarks/clients/wait_ready.sh URL [SECONDS]     (default 600; exit 1 at the limit)
set -euo pipefail
url=${1%/}
limit=${2:-600}
for ((waited = 0; waited < limit; waited += 2)); do
  if [ "$(curl -s -o /dev/null -w '%{http_code}' "$url/health")" = 200 ]; then
    exit 0
  fi
  sleep 2
done
echo "error: $url/health did not answer 200 within $limit s" >&2
exit 1
