"""Data benchmark: tokens/s the pipeline produces on this host.

    python -m bov_jax.data.bench [--seq_len 512] [--batch_size 32] [--seconds 10] [--workers 2]

Prints tokens/s for the configured data (default: the embedded corpus, token cache on) with
and without worker processes, and for on-the-fly sentencepiece encoding (`use_cache=False`).
"""

import copy
import time

import ml_collections
from absl import flags

from bov_jax import cli
from bov_jax.data.config import default_data_config
from bov_jax.data.packing import packing_stats
from bov_jax.data.pipeline import make_batch_iterator


def measure_pipeline(
    data_cfg: ml_collections.ConfigDict,
    seq_len: int,
    batch_size: int,
    seconds: float,
    num_workers: int,
) -> float:
    """Train-split tokens (batch_size * seq_len per batch) produced per second over `seconds`.

    The first batch (cache build, worker start-up, filling the packing buffer) is not timed.
    """
    cfg = copy.deepcopy(data_cfg)
    cfg.num_workers = num_workers
    iterator = make_batch_iterator(
        cfg, split="train", seq_len=seq_len, batch_size=batch_size, seed=0
    )
    try:
        next(iterator)
        batches, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            next(iterator)
            batches += 1
        return batches * batch_size * seq_len / (time.perf_counter() - start)
    finally:
        iterator.close()


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    flags.DEFINE_string("data_dir", None, "Shard directory (default: the embedded corpus).")
    flags.DEFINE_integer("seq_len", 512, "Tokens per row.")
    flags.DEFINE_integer("batch_size", 32, "Rows per batch.")
    flags.DEFINE_float("seconds", 10.0, "Reading time per measurement.")
    flags.DEFINE_integer("workers", 2, "Grain worker processes.")
    for name in ("data_dir", "seq_len", "batch_size"):
        flags.DEFINE_alias(name.replace("_", "-"), name)


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (cli.run checks)
    args = flags.FLAGS
    cfg = default_data_config()
    if args.data_dir:
        cfg.data_dir = args.data_dir
    print(f"data {cfg.data_dir}, seq_len {args.seq_len}, batch {args.batch_size}")
    print(f"{args.seconds:.0f} s per measurement, first batch not timed")
    for use_cache in (True, False):
        cfg.use_cache = use_cache
        for workers in (0, args.workers):
            rate = measure_pipeline(cfg, args.seq_len, args.batch_size, args.seconds, workers)
            source = "token cache" if use_cache else "on-the-fly sentencepiece"
            print(f"{source:26s} workers={workers}: {rate:12,.0f} tokens/s", flush=True)
    cfg.use_cache = True
    iterator = make_batch_iterator(
        cfg, split="train", seq_len=args.seq_len, batch_size=args.batch_size, seed=0
    )
    for _ in range(200):
        next(iterator)
    stats = packing_stats(iterator)
    iterator.close()
    print(f"crop fraction after 200 batches: {stats.crop_fraction:.3f} ({stats.rows} rows)")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
