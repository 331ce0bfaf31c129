"""The most tokens/s a config can reach on this machine: its analytic training FLOPs per token
against the fp32 matmul throughput XLA reaches here, measured in the same run.

    python benchmarks/cpu_roofline.py --config=a [--reps=5]   # from the repository root

The matmul is the lm_head's of the config (tokens x width @ width x vocab, fp32), the largest
and most efficient matmul of a training step; no step can beat the FLOPs rate of its best
matmul, so `tokens_per_s_bound` is an upper bound on any implementation's training tokens/s on
these cores. Prints JSON.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # compare_trees, then this tree's bov_jax

from compare_trees import build_config  # noqa: E402

from bov_jax.accounting import training_plan  # noqa: E402


def matmul_flops_per_s(rows: int, width: int, vocab: int, reps: int) -> list[float]:
    """FLOP/s of a jitted fp32 (rows, width) @ (width, vocab) matmul, one figure per rep."""
    keys = jax.random.split(jax.random.key(0))
    a = jax.random.normal(keys[0], (rows, width), jnp.float32)
    b = jax.random.normal(keys[1], (width, vocab), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        rates.append(2 * rows * width * vocab / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="a", help="a | quickstart (see compare_trees.py)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    config = build_config(args.config)
    flops_per_token = training_plan(config).flops_per_token
    rows = config.train.device_batch_size * config.model.seq_len
    rates = matmul_flops_per_s(rows, config.model.model_dim, config.model.vocab_size, args.reps)
    best = max(rates)
    print(
        json.dumps(
            {
                "config": args.config,
                "devices": str(jax.devices()[0].device_kind),
                "cpu_count": os.cpu_count(),
                "flops_per_token": flops_per_token,
                "lm_head_matmul_gflops_best": round(best / 1e9, 1),
                "lm_head_matmul_gflops_median": round(statistics.median(rates) / 1e9, 1),
                "tokens_per_s_bound": round(best / flops_per_token, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
