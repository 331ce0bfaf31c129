#!/usr/bin/env bash
# Train on a Cloud TPU pod slice (TPU VMs) with gcloud: create the slice, copy this checkout to
# every worker, install, run bov_jax.main on all workers at once, follow, stop, delete.
#
#   launch/tpu_pod.sh COMMAND [bov_jax.main flags...]
#
#   create    create the slice (SPOT=1: a spot slice)
#   sync      copy this checkout (tracked and untracked, not ignored files, no virtual
#             environments) to every worker, with its git commit in .revision.json (the run
#             record reads it)
#   install   on every worker: a venv (REMOTE_DIR/.venv) with Python >= 3.11 and
#             `pip install -e .[tpu]`; mount NFS_SHARE. TPU VM images ship Python 3.10: the
#             script takes python3.11+ if the image has one, else installs uv from PyPI and
#             a Python 3.11 with `uv python install 3.11`; it stops with one line if neither works
#   prepare   on worker 0: python -m bov_jax.prepare --config=$CONFIG --data_dir=$DATA_DIR
#             (shards, tokenizer, token cache on the shared storage); extra flags go to it
#   run       start training on every worker in the background (resumes if WORKDIR has
#             checkpoints), with --config.data.data_dir=$DATA_DIR when DATA_DIR is set;
#             extra flags go to bov_jax.main, e.g. --config.train.num_steps=100
#   wait      return once the run has ended on every worker: status 0 when WORKDIR/status.json
#             shows its horizon reached, 1 otherwise (the sweep's tpu_commands.sh uses it)
#   logs      follow worker 0's log
#   status    is the process alive on each worker; last log line; WORKDIR/status.json
#   stop      SIGTERM on every worker: the run checkpoints and exits 0 (`run` resumes it)
#   delete    delete the slice
#   all       sync, install and run
#
# Settings (environment variables):
#   TPU_NAME          slice name (required)
#   ZONE              e.g. us-central2-b (required)
#   PROJECT           gcloud project (default: gcloud's current one)
#   ACCELERATOR_TYPE  create: slice type (default v5p-32)
#   RUNTIME_VERSION   create: TPU VM image (default v2-alpha-tpuv5)
#   SPOT              create: 1 for a spot slice (default 0)
#   REMOTE_DIR        checkout directory on the workers, relative to $HOME (default bov_jax)
#   WORKDIR           run directory; must be the same shared storage on every worker, e.g. an
#                     NFS (Filestore) mount (required by run and status)
#   DATA_DIR          prepared data directory on the shared storage (required by prepare)
#   CONFIG            experiment config (default configs/d24_bov.py)
#   NFS_SHARE         install: server:/export to mount at SHARED_MOUNT on every worker
#   SHARED_MOUNT      install: mount point (default /mnt/shared)
#   POLL              wait: seconds between checks (default 60)
#
# jax.distributed finds the other workers by itself on TPU VMs; every worker runs the same
# command, reads its own data streams and writes its shards of each checkpoint; worker 0 alone
# writes the logs' INFO lines, metrics.jsonl and config.json. See docs/launch.md.
set -euo pipefail

# The comment block above, as help text.
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

command=${1:-}
[[ -n $command ]] || { usage >&2; exit 2; }
shift

: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
ACCELERATOR_TYPE=${ACCELERATOR_TYPE:-v5p-32}
RUNTIME_VERSION=${RUNTIME_VERSION:-v2-alpha-tpuv5}
SPOT=${SPOT:-0}
REMOTE_DIR=${REMOTE_DIR:-bov_jax}
CONFIG=${CONFIG:-configs/d24_bov.py}
SHARED_MOUNT=${SHARED_MOUNT:-/mnt/shared}
POLL=${POLL:-60}
repo=$(cd "$(dirname "$0")/.." && pwd)

gcloud_tpu() {
  gcloud compute tpus tpu-vm "$@" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"}
}

# Run a shell command on every worker at once (and wait for all of them).
on_all_workers() {
  gcloud_tpu ssh "$TPU_NAME" --worker=all --command="$1"
}

require_workdir() { : "${WORKDIR:?set WORKDIR to a directory shared by all workers}"; }

create() {
  local spot=""
  ((SPOT)) && spot=--spot
  gcloud_tpu create "$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" \
    --version="$RUNTIME_VERSION" ${spot:+"$spot"}
}

# The checkout's files (NUL-separated): tracked and untracked, not ignored, and nothing inside
# a virtual environment (a directory holding pyvenv.cfg), whatever its name.
code_files() {
  local files venvs=() f v
  mapfile -d '' files < <(git -C "$repo" ls-files -z --cached --others --exclude-standard)
  for f in "${files[@]}"; do
    [[ $f == */pyvenv.cfg ]] && venvs+=("${f%pyvenv.cfg}")
  done
  for f in "${files[@]}"; do
    for v in ${venvs[@]+"${venvs[@]}"}; do [[ $f == "$v"* ]] && continue 2; done
    printf '%s\0' "$f"
  done
}

sync_code() {
  local tmp dirty=false
  tmp=$(mktemp -d)
  [[ -z $(git -C "$repo" status --porcelain --untracked-files=no) ]] || dirty=true
  printf '{"commit": "%s", "dirty": %s}\n' "$(git -C "$repo" rev-parse HEAD)" "$dirty" \
    >"$tmp/.revision.json"
  code_files | (cd "$repo" && tar --null --ignore-failed-read -czf "$tmp/code.tgz" -T - \
    -C "$tmp" .revision.json)
  gcloud_tpu scp "$tmp/code.tgz" "$TPU_NAME:bov_jax_code.tgz" --worker=all
  rm -rf "$tmp"
  on_all_workers "mkdir -p ~/$REMOTE_DIR && tar -xzf ~/bov_jax_code.tgz -C ~/$REMOTE_DIR"
}

# Runs on each worker, in the checkout: a venv with Python >= 3.11, then the package for TPU.
# shellcheck disable=SC2016  # expanded on the worker
VENV_SCRIPT='
set -e
py=""
for candidate in python3.13 python3.12 python3.11 python3; do
  if command -v "$candidate" >/dev/null &&
    "$candidate" -c "import sys; sys.exit(sys.version_info < (3, 11))" 2>/dev/null; then
    py=$(command -v "$candidate"); break
  fi
done
if [ -z "$py" ]; then
  python3 -m pip install -q --user uv >/dev/null 2>&1 &&
    "$HOME/.local/bin/uv" python install -q 3.11 >/dev/null 2>&1 &&
    py=$("$HOME/.local/bin/uv" python find 3.11) || {
    echo "error: $(hostname): no Python >= 3.11 (the image has $(python3 -V 2>&1)) and uv could not install one; install python3.11 and python3.11-venv (e.g. from ppa:deadsnakes/ppa) and rerun install" >&2
    exit 1
  }
fi
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q -U pip
.venv/bin/python -m pip install -q -e ".[tpu]"
echo "$(hostname): $(.venv/bin/python -V), jax $(.venv/bin/python -c "import jax; print(jax.__version__)"), libtpu $(.venv/bin/python -c "import importlib.metadata as m; print(m.version(\"libtpu\"))")"
'

install() {
  local mount=""
  if [[ -n ${NFS_SHARE:-} ]]; then
    mount="sudo apt-get -qq update && sudo apt-get -qq install -y nfs-common &&
      sudo mkdir -p $SHARED_MOUNT && (mountpoint -q $SHARED_MOUNT ||
      sudo mount -t nfs -o hard,timeo=600 $NFS_SHARE $SHARED_MOUNT) &&
      sudo chmod a+rwx $SHARED_MOUNT &&"
  fi
  on_all_workers "$mount cd ~/$REMOTE_DIR && bash -c $(printf '%q' "$VENV_SCRIPT")"
}

prepare() {
  : "${DATA_DIR:?set DATA_DIR to a directory on storage shared by all workers}"
  local flags
  flags=$(printf '%q ' --config="$CONFIG" --data_dir="$DATA_DIR" "$@")
  gcloud_tpu ssh "$TPU_NAME" --worker=0 \
    --command="cd ~/$REMOTE_DIR && .venv/bin/python -m bov_jax.prepare $flags"
}

run() {
  require_workdir
  local flags
  flags=$(printf '%q ' --config="$CONFIG" --workdir="$WORKDIR" \
    ${DATA_DIR:+--config.data.data_dir="$DATA_DIR"} "$@")
  # nohup + background: the run outlives the ssh session; the pid file lets `stop` signal it.
  # (Braces: only the run goes to the background, after the directory exists.)
  on_all_workers "cd ~/$REMOTE_DIR && mkdir -p logs && {
    nohup .venv/bin/python -u -m bov_jax.main $flags > logs/main.log 2>&1 < /dev/null &
    echo \$! > logs/main.pid; }"
  echo "started on every worker; follow with: $0 logs" >&2
}

logs() {
  gcloud_tpu ssh "$TPU_NAME" --worker=0 --command="tail -n 50 -F ~/$REMOTE_DIR/logs/main.log"
}

status() {
  require_workdir
  on_all_workers "cd ~/$REMOTE_DIR && if kill -0 \$(cat logs/main.pid 2>/dev/null) 2>/dev/null;
    then echo \"\$(hostname): running\"; else echo \"\$(hostname): not running\"; fi;
    tail -n 1 logs/main.log 2>/dev/null || true"
  gcloud_tpu ssh "$TPU_NAME" --worker=0 --command="cat $WORKDIR/status.json 2>/dev/null || true"
}

wait_run() {
  require_workdir
  # `run` leaves each worker's pid in logs/main.pid; a worker prints "running" while it lives.
  local alive="kill -0 \$(cat ~/$REMOTE_DIR/logs/main.pid 2>/dev/null) 2>/dev/null && echo running"
  while [[ $(on_all_workers "$alive || true") == *running* ]]; do sleep "$POLL"; done
  local status step="" num_steps=""
  status=$(gcloud_tpu ssh "$TPU_NAME" --worker=0 --command="cat $WORKDIR/status.json || true")
  [[ $status =~ \"step\":\ *([0-9]+) ]] && step=${BASH_REMATCH[1]}
  [[ $status =~ \"num_steps\":\ *([0-9]+) ]] && num_steps=${BASH_REMATCH[1]}
  if [[ -n $step && -n $num_steps ]] && ((step >= num_steps)); then
    echo "run complete: $WORKDIR (step $step)"
  else
    echo "error: the run in $WORKDIR ended before its horizon (status.json: ${status//[$'\n ']/});" \
      "see $0 logs" >&2
    return 1
  fi
}

stop() {
  on_all_workers "kill -TERM \$(cat ~/$REMOTE_DIR/logs/main.pid) 2>/dev/null || true"
}

case $command in
  create) create ;;
  sync) sync_code ;;
  install) install ;;
  prepare) prepare "$@" ;;
  run) run "$@" ;;
  wait) wait_run ;;
  logs) logs ;;
  status) status ;;
  stop) stop ;;
  delete) gcloud_tpu delete "$TPU_NAME" --quiet ;;
  all) sync_code && install && run "$@" ;;
  *) usage >&2; exit 2 ;;
esac
