"""Bits per byte (reference spec 6.3, `nanochat/loss_eval.py::evaluate_bpb`).

Per batch, with per-token cross-entropy `loss` (nats) and `nb = token_bytes[target]`:

    sum_nats  += sum(loss * (nb > 0))
    sum_bytes += sum(nb)

Targets with zero bytes (the special tokens, e.g. BOS) are excluded from both sums; negative
targets (ignore index) count as zero bytes. BPB = sum_nats / (ln 2 * sum_bytes).

`bpb_sums` reduces over every element of its inputs, so inside a jitted step on globally sharded
arrays it returns the global sums (XLA inserts the cross-device reduction). Accumulate the
per-step sums on the host (Python float / int) and call `bits_per_byte` once at the end.
"""

import math

import jax
import jax.numpy as jnp

from bov_jax import cli


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


def evaluate_model(model, tokenizer, config, eval_tokens: int, batch_rows: int) -> dict:
    """Val BPB of `model` over about `eval_tokens` tokens of config.data's val split."""
    from flax import nnx

    from bov_jax.data.pipeline import make_batch_iterator

    graphdef, params = nnx.split(model)
    seq_len = config.model.seq_len

    @jax.jit
    def step(p, inputs, targets, token_bytes):
        per_token = nnx.merge(graphdef, p).loss(inputs, targets, reduction="none")
        return bpb_sums(per_token, targets, token_bytes)

    batches = make_batch_iterator(
        config.data,
        split="val",
        seq_len=seq_len,
        batch_size=batch_rows,
        seed=config.seed,
        tokenizer=tokenizer,
    )
    token_bytes = jnp.asarray(tokenizer.token_bytes())
    steps = max(1, eval_tokens // (batch_rows * seq_len))
    nats = nbytes = 0.0
    for _ in range(steps):
        batch = next(batches)
        n, b = step(params, batch["inputs"], batch["targets"], token_bytes)
        nats, nbytes = nats + float(n), nbytes + float(b)
    return {"val_bpb": bits_per_byte(nats, nbytes), "tokens": steps * batch_rows * seq_len}


def evaluate_workdir(workdir: str, eval_tokens: int, batch_rows: int) -> dict:
    """Val BPB of a workdir's latest checkpoint over about `eval_tokens` val tokens."""
    from bov_jax.evals.loading import load_model_and_tokenizer

    model, tokenizer, config = load_model_and_tokenizer(workdir)
    return evaluate_model(model, tokenizer, config, eval_tokens, batch_rows)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="Val bits per byte of a workdir's checkpoint.")
    parser.add_argument("--workdir", required=True, help="training workdir with a checkpoint")
    parser.add_argument(
        "--eval_tokens", type=int, default=80 * 2**19, help="validation tokens to score"
    )
    parser.add_argument("--batch_rows", type=int, default=8, help="rows per forward pass")
    args = parser.parse_args(argv)
    print(json.dumps(evaluate_workdir(args.workdir, args.eval_tokens, args.batch_rows)))


if __name__ == "__main__":
    cli.run_argparse(main)
