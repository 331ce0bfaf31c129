#!/usr/bin/env bash
# N CPU processes on this machine, joined by jax.distributed on 127.0.0.1 (gloo collectives):
# a stand-in for N hosts, to test multi-host code paths without a cluster.
#
#   launch/local_multiprocess.sh N --config=configs/quickstart.py --workdir=runs/mp [flags...]
#
# Environment:
#   LOCAL_DEVICES  CPU devices per process (default 1)
#   PORT           coordinator port (default: a free one)
#   LOG_DIR        where processes 1..N-1 write process_<i>.log (default: a new temp dir);
#                  process 0 writes to this terminal, as on a real pod
#   PYTHON         interpreter (default python)
#
# SIGTERM / SIGINT are forwarded to every process (each checkpoints and exits 0). If one
# process fails, the others are sent SIGTERM. The exit status is the first failure's, or 0.
# Needs bash >= 5.1 (wait -n -p).
set -euo pipefail

if (($# < 1)) || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N main-flags... (N processes of python -m bov_jax.main)" >&2
  exit 2
fi
num_processes=$1
shift
python=${PYTHON:-python}
devices=${LOCAL_DEVICES:-1}
port=${PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
log_dir=${LOG_DIR:-$(mktemp -d -t bov_jax_mp.XXXXXX)}
mkdir -p "$log_dir"
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

pids=()
forward() { kill "-$1" "${pids[@]}" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward INT' INT

for ((i = 0; i < num_processes; i++)); do
  cmd=("$python" -u -m bov_jax.main
    --coordinator_address="127.0.0.1:$port" --num_processes="$num_processes"
    --process_id="$i" --local_device_count="$devices" "$@")
  if ((i == 0)); then
    "${cmd[@]}" &
  else
    "${cmd[@]}" >"$log_dir/process_$i.log" 2>&1 &
  fi
  pids+=($!)
done
((num_processes == 1)) || echo "processes 1..$((num_processes - 1)) log to $log_dir" >&2

status=0
live=("${pids[@]}")
while ((${#live[@]} > 0)); do
  finished=""
  if wait -n -p finished "${live[@]}"; then rc=0; else rc=$?; fi
  [[ -n ${finished:-} ]] || continue # interrupted by a forwarded signal: keep waiting
  mapfile -t live < <(printf '%s\n' "${live[@]}" | grep -vx "$finished")
  if ((rc != 0 && status == 0)); then
    status=$rc
    forward TERM
  fi
done
exit "$status"
