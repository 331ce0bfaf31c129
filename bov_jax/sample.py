"""Text completions from a model: the trainer's periodic samples and a CLI.

    python -m bov_jax.sample --workdir=<dir> --prompt "The capital of France is" \
        [--max_new_tokens=64 --temperature=0 --top_k=50 --seed=0 --step=N]

Prompts are BOS + the encoded text; generation stops at the next BOS (a new document)
or after max_new_tokens.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Protocol

from bov_jax import cli
from bov_jax.model.decode import generate
from bov_jax.model.gpt import GPT


class Tokenizer(Protocol):
    """What sampling needs from a tokenizer."""

    bos_id: int

    def encode_one(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def sample_texts(
    model: GPT,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
) -> list[str]:
    """The completion (without the prompt) of each prompt, decoded in one batch."""
    texts = [tokenizer.encode_one(p) for p in prompts]
    ids = [[tokenizer.bos_id, *t] for t in texts]
    completions = generate(
        model, ids, max_new_tokens, temperature, top_k, seed, stop_tokens=(tokenizer.bos_id,)
    )
    return [completion_text(tokenizer, t, c) for t, c in zip(texts, completions, strict=True)]


def completion_text(tokenizer: Tokenizer, prompt: Sequence[int], completion: Sequence[int]) -> str:
    """The text the completion adds to the prompt.

    Decoded together with the prompt, so pieces that depend on their left context (a
    leading-space marker, a UTF-8 character split across the boundary) come out right.
    """
    head = tokenizer.decode(list(prompt))
    full = tokenizer.decode([*prompt, *completion])
    return full[len(head) :] if full.startswith(head) else tokenizer.decode(list(completion))


def sample_text(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
) -> str:
    """The completion (without the prompt) of one prompt."""
    return sample_texts(model, tokenizer, [prompt], max_new_tokens, temperature, top_k, seed)[0]


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: load a workdir's latest checkpoint and print prompt + completion."""
    parser = argparse.ArgumentParser(prog="python -m bov_jax.sample", description=__doc__)
    parser.add_argument("--workdir", required=True, help="training workdir with a checkpoint")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=None, help="sample from the k likeliest")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    args = parser.parse_args(argv)
    from bov_jax.evals.loading import load_model_and_tokenizer

    model, tokenizer, _ = load_model_and_tokenizer(args.workdir, args.step)
    completion = sample_text(
        model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed
    )
    print(args.prompt + completion)


if __name__ == "__main__":
    cli.run_argparse(main)
