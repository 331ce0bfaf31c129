#!/usr/bin/env bash
# d24 BoV from a fresh 8-GPU node to a report, in one script: install, data, train, evaluate.
#
#   git clone <this repository> bov_jax && cd bov_jax && bash launch/speedrun_d24.sh
#   bash launch/speedrun_d24.sh --config.train.target_flops=3.91e19     # the ablation budget
#
#   1. install  a venv ($VENV) with `pip install -e .[cuda12]`, from a Python >= 3.11
#   2. check    jax sees the GPUs (stops with one line on a CPU-only jax)
#   3. prepare  python -m bov_jax.prepare: ClimbMix shards for the horizon, the 32768-token
#               tokenizer, the token cache in $DATA_DIR (about 230 GB at 100B tokens)
#   4. train    python -m bov_jax.main, one process driving every GPU of the node; rerunning
#               the script resumes from the latest checkpoint (every 1000 steps)
#   5. evaluate python -m bov_jax.evals.bpb (the val split's 41.9M tokens), the CORE bundle
#               (built once from PyPI), python -m bov_jax.evals.core
#   6. report   python -m bov_jax.report --workdir=$RUN -> $RUN/report.md
#
# Arguments are config overrides for both prepare and train (--config.<key>=<value>).
# Environment:
#   CONFIG    experiment (default configs/d24_bov.py; configs/d24.py for the baseline)
#   RUN       workdir (default runs/d24_bov)
#   DATA_DIR  prepared data (default ~/.cache/bov_jax/climbmix)
#   VENV      virtualenv (default .venv); PYTHON: the interpreter that creates it (default
#             python3; on an older image: `uv python install 3.11` and PYTHON=$(uv python find 3.11))
#   CORE_MAX_PER_TASK  examples per CORE task (default -1: all)
# The paper's d24 runs are multi-day on one node (100B tokens at ~600k tokens/s on 8 H200s is
# about 2 days); set --config.train.stop_after_steps=N to end an invocation early.
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/d24_bov.py}
RUN=${RUN:-runs/d24_bov}
DATA_DIR=${DATA_DIR:-$HOME/.cache/bov_jax/climbmix}
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
CORE_MAX_PER_TASK=${CORE_MAX_PER_TASK:--1}

step() { echo "== $*" >&2; }
fail() { echo "error: $*" >&2; exit 1; }

step "1. install ($VENV)"
if [[ ! -x $VENV/bin/python ]]; then
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null ||
    fail "$PYTHON is $("$PYTHON" -V 2>&1 || echo missing); bov_jax needs Python >= 3.11: set PYTHON (e.g. uv python install 3.11; PYTHON=\$(uv python find 3.11))"
  "$PYTHON" -m venv "$VENV"
fi
py=$VENV/bin/python
"$py" -m pip install -q -U pip
"$py" -m pip install -q -e '.[cuda12]'

step "2. check the GPUs"
"$py" - <<'EOF' || exit 1
import sys
import jax
backend = jax.default_backend()
if backend != "gpu":
    sys.exit(f"error: jax {jax.__version__} runs on {backend}, not on the GPUs; is the NVIDIA "
             "driver visible (nvidia-smi) and jax[cuda12] installed in this venv?")
print(f"{jax.device_count()} x {jax.devices()[0].device_kind}", file=sys.stderr)
EOF

step "3. prepare $DATA_DIR"
"$py" -m bov_jax.prepare --config="$CONFIG" --data_dir="$DATA_DIR" "$@"

step "4. train $RUN"
"$py" -m bov_jax.main --config="$CONFIG" --workdir="$RUN" --config.data.data_dir="$DATA_DIR" "$@"
finished=$("$py" -c 'import json, sys; s = json.load(open(sys.argv[1])); print(int(s["step"] >= s["num_steps"]))' "$RUN/status.json")
((finished)) || { echo "stopped before the horizon; rerun the same command to resume" >&2; exit 0; }

step "5. evaluate"
"$py" -m bov_jax.evals.bpb --workdir="$RUN"
bundle=${BOV_EVAL_BUNDLE:-$HOME/.cache/bov_jax/eval_bundle}
[[ -f $bundle/manifest.json ]] || "$py" -m bov_jax.evals.bundle --out "$bundle"
"$py" -m bov_jax.evals.core --workdir="$RUN" --bundle_dir="$bundle" --max_per_task="$CORE_MAX_PER_TASK"

step "6. report"
"$py" -m bov_jax.report --workdir="$RUN"
