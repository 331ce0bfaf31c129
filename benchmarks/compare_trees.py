"""Train-step speed of two source trees (e.g. this branch and a `git worktree` of an older
commit), measured in one run with interleaved repetitions so that load from other jobs on a
shared machine falls on both alike.

    python benchmarks/compare_trees.py --trees=/tmp/base,. --config=a --reps=5 --steps=2

Each tree runs in its own worker process (its own `bov_jax` on PYTHONPATH): the worker
prepares the process as that tree's `bov_jax.main` does (`prepare_host`), builds and compiles
the train step once, then times `--steps` steps per request. The driver
asks the workers in turn, `--reps` times, and prints per-tree medians and the ratio of
tokens/s of each tree to the first one (median and range over the repetitions).

Configs: `a` is the quickstart BoV model at vocab 32768 with every layer long-window
(depth 4, width 256, 2 heads of 128, seq 512, batch 8, fp32 on CPU); `quickstart` is
configs/quickstart.py as shipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time


def build_config(name: str):
    """The named benchmark config (imports the worker tree's bov_jax)."""
    sys.path.insert(0, os.path.join(os.getcwd(), "configs"))
    import quickstart  # configs/quickstart.py of the worker's tree

    config = quickstart.get_config("d12_bov")
    if name == "a":
        config.model.vocab_size = 32768
        config.model.window_pattern = "L"
    elif name != "quickstart":
        raise SystemExit(f"--config={name!r}; expected 'a' or 'quickstart'")
    return config


def compiled_step(config_name: str):
    """(compiled train step, state, one micro-batch of random ids, tokens per step) of the
    named config, from the `bov_jax` on sys.path."""
    import jax
    import numpy as np

    from bov_jax import sharding
    from bov_jax.accounting import training_plan
    from bov_jax.train.state import create_train_state
    from bov_jax.train.step import make_train_step

    config = build_config(config_name)
    plan = training_plan(config)
    mesh = sharding.make_mesh(config.mesh)
    graphdef, state, shardings, tx = create_train_state(config, plan, mesh)
    step = make_train_step(graphdef, tx, shardings, mesh)
    rows, seq = config.train.device_batch_size, config.model.seq_len
    ids = np.random.default_rng(0).integers(0, config.model.vocab_size, (1, rows, seq + 1))
    ids = ids.astype(np.int32)
    batch = sharding.global_batch({"inputs": ids[..., :-1], "targets": ids[..., 1:]}, mesh, 1)
    compiled = step.lower(state, batch).compile()
    state, out = compiled(state, batch)
    jax.block_until_ready(out)
    return compiled, state, batch, rows * seq


def prepare_host() -> None:
    """The host-memory setting that the tree's `bov_jax.main` applies on CPU before JAX starts
    its backend (trees before bov_jax/train/host_memory.py have none)."""
    if importlib.util.find_spec("bov_jax.train.host_memory") is not None:
        from bov_jax.train.host_memory import reuse_freed_memory_on_cpu

        reuse_freed_memory_on_cpu()


def worker(config_name: str) -> None:
    """Compile the train step, then answer each stdin line `n` with the seconds of n steps."""
    import jax

    prepare_host()
    compiled, state, batch, tokens = compiled_step(config_name)
    print(json.dumps({"ready": True, "tokens_per_step": tokens}), flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        for _ in range(int(line)):
            state, out = compiled(state, batch)
        jax.block_until_ready(out)
        print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", default="", help="comma-separated source trees")
    parser.add_argument("--config", default="a", help="a | quickstart")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed repetition")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if not args.trees:
        parser.error("--trees is required, e.g. --trees=/tmp/base,.")
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    procs, tokens = [], 0
    for tree in trees:  # compile one at a time so the compiles do not compete
        env = {**os.environ, "PYTHONPATH": tree}
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", args.config],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        tokens = json.loads(proc.stdout.readline())["tokens_per_step"]
        procs.append(proc)
    times: list[list[float]] = [[] for _ in trees]
    for _ in range(args.reps):
        for proc, record in zip(procs, times, strict=True):
            proc.stdin.write(f"{args.steps}\n")
            proc.stdin.flush()
            record.append(json.loads(proc.stdout.readline())["seconds"] / args.steps)
    for proc in procs:
        proc.stdin.close()
        proc.wait()
    result = {"config": args.config, "tokens_per_step": tokens, "reps": args.reps, "trees": []}
    for tree, record in zip(trees, times, strict=True):
        ratios = [first / mine for first, mine in zip(times[0], record, strict=True)]
        result["trees"].append(
            {
                "tree": tree,
                "step_s_median": round(statistics.median(record), 4),
                "tokens_per_s_median": round(tokens / statistics.median(record), 1),
                "speedup_vs_first_median": round(statistics.median(ratios), 3),
                "speedup_vs_first_range": [round(min(ratios), 3), round(max(ratios), 3)],
            }
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
