"""Text completions from a workdir's checkpoint.

    python -m bov_jax.inference.sample --workdir=<dir> --prompt="The capital of France is" \
        [--max_new_tokens=64 --temperature=0 --top_k=50 --seed=0 --step=N]

Prompts are BOS + the encoded text; generation stops at the next BOS (a new document)
or after max_new_tokens (bov_jax/inference/texts.py).
"""

from __future__ import annotations

from absl import flags

from bov_jax import cli
from bov_jax.errors import UserError


def define_flags() -> None:
    """The command's flags (defined on use: other entry points also have a --workdir)."""
    flags.DEFINE_string("workdir", None, "Training workdir with a checkpoint.")
    flags.DEFINE_string("prompt", None, "Text to continue.")
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.")
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0: greedy.")
    flags.DEFINE_integer("top_k", None, "Sample from the k likeliest tokens.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")


def main(argv: list[str]) -> None:
    """Load a workdir's checkpoint and print prompt + completion."""
    from bov_jax.evals.loading import load_model_and_tokenizer
    from bov_jax.inference.texts import sample_text

    f = flags.FLAGS
    if not f.workdir or f.prompt is None:
        raise UserError("--workdir=RUN and --prompt=TEXT are required")
    model, tokenizer, _ = load_model_and_tokenizer(f.workdir, f.step)
    completion = sample_text(
        model, tokenizer, f.prompt, f.max_new_tokens, f.temperature, f.top_k, f.seed
    )
    print(f.prompt + completion)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
