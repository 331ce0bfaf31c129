"""Text completions from a model: prompts encoded with BOS, greedy or top-k sampling through
the KV-cache decoder (`model.decode.generate`), stopping at the next BOS (a new document)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from bov_jax.inference.decode import generate
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
