"""Passkey retrieval: a number stated once inside repetitive filler text, asked for at the end,
read back by greedy decoding through the serving engine (bov_jax.inference). Accuracy on a grid
of context length x depth (the share of the filler before the key).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"


def passkey_prompt(tokenizer: Any, context: int, depth: float, key: int) -> tuple[list[int], int]:
    """(prompt ids of exactly `context` tokens: BOS, filler with the needle inserted, the
    question; position of the needle's first token). The needle starts after round(depth x
    filler tokens) filler tokens."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth}; expected a share of the filler in [0, 1]")
    needle = tokenizer.encode_one(NEEDLE.format(key=key))
    question = tokenizer.encode_one(QUESTION)
    room = context - 1 - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"context {context} cannot hold the needle and the question")
    unit = tokenizer.encode_one(FILLER)
    filler = (unit * (room // len(unit) + 1))[:room]
    cut = round(depth * room)
    ids = [tokenizer.bos_id, *filler[:cut], *needle, *filler[cut:], *question]
    return ids, 1 + cut


def read_back(engine: Any, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions of `max_tokens` tokens through the engine."""
    from bov_jax.inference.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.token_ids for r in engine.generate([list(p) for p in prompts], params)]


def grid(
    engine: Any,
    tokenizer: Any,
    contexts: Sequence[int],
    depths: Sequence[float],
    trials: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Accuracy per (context, depth): the completion's text starts with the key's digits."""
    rng = np.random.default_rng(seed)
    max_tokens = len(tokenizer.encode_one(" 99999")) + 1
    out = []
    for context in contexts:
        for depth in depths:
            keys = rng.integers(10000, 100000, size=trials)
            prompts = [passkey_prompt(tokenizer, context, depth, int(k))[0] for k in keys]
            completions = read_back(engine, prompts, max_tokens)
            hits = [
                tokenizer.decode(c).strip().startswith(str(k))
                for c, k in zip(completions, keys, strict=True)
            ]
            out.append({"context": context, "depth": depth, "accuracy": float(np.mean(hits))})
    return out
