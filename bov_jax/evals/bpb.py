"""Bits per byte (reference spec 6.3, `nanochat/loss_eval.py::evaluate_bpb`).

Per batch, with per-token cross-entropy `loss` (nats) and `nb = token_bytes[target]`:

    sum_nats  += sum(loss * (nb > 0))
    sum_bytes += sum(nb)

Targets with zero bytes (the special tokens, e.g. BOS) are excluded from both sums; negative
targets (ignore index) count as zero bytes. BPB = sum_nats / (ln 2 * sum_bytes).

`bpb_sums` reduces over every element of its inputs, so inside a jitted step on globally sharded
arrays it returns the global sums (XLA inserts the cross-device reduction). Accumulate the
per-step sums on the host (Python float / int) and call `bits_per_byte` once at the end.

`python -m bov_jax.evals.bpb --workdir=RUN` scores a checkpoint on the val split (at most one
pass of it) and writes RUN/evals/bpb_step<N>.json.
"""

import logging
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from bov_jax import cli
from bov_jax.files import write_json_atomic

log = logging.getLogger("bov_jax.evals.bpb")


def bpb_sums(
    per_token_nats: jax.Array, targets: jax.Array, token_bytes: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sums of nats and of bytes for one batch.

    Args:
      per_token_nats: (B, T) float32, cross-entropy of each target in nats.
      targets: (B, T) int32 token ids; negative ids are ignored (0 bytes).
      token_bytes: (V,) int32, UTF-8 byte length of each token id (0 for special tokens).

    Returns:
      (sum_nats, sum_bytes): float32 and int32 scalars, reduced over all B*T elements.
    """
    nb = jnp.where(targets >= 0, token_bytes[jnp.maximum(targets, 0)], 0)
    sum_nats = jnp.sum(jnp.where(nb > 0, per_token_nats.astype(jnp.float32), 0.0))
    sum_bytes = jnp.sum(nb.astype(jnp.int32))
    return sum_nats, sum_bytes


def bits_per_byte(sum_nats: float, sum_bytes: float) -> float:
    """BPB = sum_nats / (ln 2 * sum_bytes); raises if no bytes were counted."""
    sum_bytes = float(sum_bytes)
    if sum_bytes <= 0:
        raise ValueError("bits_per_byte: no target bytes were counted (sum_bytes == 0)")
    return float(sum_nats) / (math.log(2) * sum_bytes)


def val_split_tokens(data_cfg: Any, tokenizer: Any, at_most: int) -> int:
    """Tokens in one pass of the val split's documents, counted up to about `at_most`."""
    from bov_jax.data.unigram import token_counts

    return int(token_counts(data_cfg, "val", tokenizer, max_tokens=at_most).sum())


def evaluate_model(model, tokenizer, config, eval_tokens: int, batch_rows: int) -> dict[str, Any]:
    """Val BPB of `model` over about `eval_tokens` tokens of config.data's val split, at most
    one pass of it (the default budget, 41.9M tokens, is ClimbMix-sized)."""
    from flax import nnx

    from bov_jax.data.pipeline import val_batches
    from bov_jax.evals.progress import Progress

    graphdef, params = nnx.split(model)
    seq_len = config.model.seq_len

    @jax.jit
    def eval_step(p, inputs, targets, token_bytes):
        per_token = nnx.merge(graphdef, p).loss(inputs, targets, reduction="none")
        return bpb_sums(per_token, targets, token_bytes)

    one_pass = val_split_tokens(config.data, tokenizer, eval_tokens)
    budget = min(eval_tokens, one_pass)
    if budget < eval_tokens:
        log.info(
            "eval budget capped at one pass of the val split: %d tokens instead of %d",
            budget,
            eval_tokens,
        )
    batches = val_batches(config, tokenizer, batch_rows)
    token_bytes = jnp.asarray(tokenizer.token_bytes())
    steps = max(1, budget // (batch_rows * seq_len))
    progress = Progress("val BPB batches", steps, log)
    nats = nbytes = 0.0
    try:
        for _ in range(steps):
            batch = next(batches)
            n, b = eval_step(params, batch["inputs"], batch["targets"], token_bytes)
            nats, nbytes = nats + float(n), nbytes + float(b)
            progress.update()
    finally:
        batches.close()
    return {
        "val_bpb": bits_per_byte(nats, nbytes),
        "tokens": steps * batch_rows * seq_len,
        "requested_tokens": eval_tokens,
        "val_split_tokens": one_pass,
        "capped_at_one_pass": budget < eval_tokens,
    }


def evaluate_workdir(
    workdir: str | Path, eval_tokens: int, batch_rows: int, step: int | None = None
) -> dict[str, Any]:
    """Val BPB of a workdir's checkpoint (the latest if step is None) over about `eval_tokens`
    val tokens, at most one pass of the val split; written to WORKDIR/evals/bpb_step<N>.json."""
    from bov_jax.evals.loading import load_checkpoint

    step, model, tokenizer, config = load_checkpoint(workdir, step)
    result = {"step": step, **evaluate_model(model, tokenizer, config, eval_tokens, batch_rows)}
    path = Path(workdir) / "evals" / f"bpb_step{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)
    log.info("wrote %s", path)
    return result


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    from absl import flags

    flags.DEFINE_string("workdir", None, "Training workdir with a checkpoint.", required=True)
    flags.DEFINE_integer(
        "eval_tokens",
        80 * 2**19,
        "Val tokens to score (41.9M, the paper's); capped at one pass of the split.",
    )
    flags.DEFINE_integer("batch_rows", 8, "Rows per forward pass.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")


def main(argv: list[str]) -> None:
    """Val bits per byte of a workdir's checkpoint, written to WORKDIR/evals/bpb_step<N>.json."""
    import json

    from absl import flags

    del argv  # no positional arguments (cli.run checks)
    args = flags.FLAGS
    cli.log_plainly(logging.WARNING)  # quiet orbax / absl
    logging.getLogger("bov_jax").setLevel(logging.INFO)
    print(json.dumps(evaluate_workdir(args.workdir, args.eval_tokens, args.batch_rows, args.step)))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
