"""A config's training speed as a fraction of the machine's peak fp32 FLOP/s, both measured in
one run, interleaved.

    python benchmarks/cpu_roofline.py --config=a [--reps=5 --steps=2 --size=4096]

Each repetition times a large square fp32 matmul (size x size @ size x size, jitted by XLA and
through numpy's BLAS; the faster of the two is the repetition's peak) and then `--steps` train
steps of the config (this tree's `bov_jax`, the step of benchmarks/compare_trees.py). Model
FLOP/s = tokens/s x the analytic training FLOPs per token (bov_jax/accounting.py); the
fraction of peak is taken per repetition. On a shared machine other jobs slow both alike
within a repetition; the best repetition is the nearest to an idle machine. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # compare_trees, then this tree's bov_jax

from compare_trees import build_config, compiled_step, prepare_host  # noqa: E402

from bov_jax.accounting import training_plan  # noqa: E402


def square_matmul_flops_per_s(size: int, calls: int = 3) -> dict[str, float]:
    """Best FLOP/s over `calls` of an fp32 (size, size) @ (size, size) matmul, by XLA (jitted)
    and by numpy's BLAS."""
    keys = jax.random.split(jax.random.key(0))
    a, b = (jax.random.normal(key, (size, size), jnp.float32) for key in keys)
    host_a, host_b = np.asarray(a), np.asarray(b)
    matmul = jax.jit(jnp.matmul)
    runs = {"xla": lambda: matmul(a, b).block_until_ready(), "numpy": lambda: host_a @ host_b}
    rates = {}
    for name, run in runs.items():
        run()  # warm
        best = float("inf")
        for _ in range(calls):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        rates[name] = 2 * size**3 / best
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="a", help="a | quickstart (see compare_trees.py)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="train steps per repetition")
    parser.add_argument("--size", type=int, default=4096, help="side of the square matmul")
    args = parser.parse_args()
    prepare_host()
    flops_per_token = training_plan(build_config(args.config)).flops_per_token
    step, state, batch, tokens = compiled_step(args.config)
    rounds = []
    for _ in range(args.reps):
        peak = square_matmul_flops_per_s(args.size)
        start = time.perf_counter()
        for _ in range(args.steps):
            state, out = step(state, batch)
        jax.block_until_ready(out)
        tokens_per_s = tokens * args.steps / (time.perf_counter() - start)
        rounds.append({**peak, "tokens_per_s": tokens_per_s})
    peaks = [max(r["xla"], r["numpy"]) for r in rounds]
    model = [r["tokens_per_s"] * flops_per_token for r in rounds]
    fractions = [m / p for m, p in zip(model, peaks, strict=True)]

    def gflops(values: list[float]) -> dict[str, float]:
        return {
            "max": round(max(values) / 1e9, 1),
            "median": round(statistics.median(values) / 1e9, 1),
        }

    print(
        json.dumps(
            {
                "config": args.config,
                "devices": str(jax.devices()[0].device_kind),
                "cpu_count": os.cpu_count(),
                "matmul_size": args.size,
                "peak_gflops": gflops(peaks),
                "xla_matmul_gflops": gflops([r["xla"] for r in rounds]),
                "numpy_matmul_gflops": gflops([r["numpy"] for r in rounds]),
                "flops_per_token": flops_per_token,
                "tokens_per_s": {
                    "max": round(max(r["tokens_per_s"] for r in rounds), 1),
                    "median": round(statistics.median(r["tokens_per_s"] for r in rounds), 1),
                },
                "model_gflops": gflops(model),
                "fraction_of_peak": {
                    "max": round(max(fractions), 3),
                    "median": round(statistics.median(fractions), 3),
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
