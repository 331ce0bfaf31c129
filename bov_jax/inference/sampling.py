"""Choosing the next token of many sequences at once, each with its own sampling parameters.

Shapes: B rows, V vocab. A row's parameters are arrays, not compile-time constants, so a
batch mixing greedy, temperature, top-k and top-p requests runs one compiled program.

Randomness is a function of (seed, stream, position) only (`token_keys`): a sequence's
sample at position p does not depend on the batch it ran in, its row, or whether it was
preempted and recomputed. The dense `generate` uses stream = its row, the engine stream 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 5  # alternatives a request may ask for (OpenAI's completions limit)
MIN_TEMPERATURE = 1e-6


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling. temperature 0: greedy; top_k 0: every token; top_p 1: no
    nucleus cut; seed None: the engine draws one; logprobs N: the chosen token's log
    probability and the N likeliest alternatives (of the model's distribution)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range."""
        checks = [
            ("temperature", self.temperature >= 0, "a number >= 0"),
            ("top_k", self.top_k >= 0, "an integer >= 0 (0: no top-k cut)"),
            ("top_p", 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("seed", self.seed is None or 0 <= self.seed < 2**31, "an integer in [0, 2^31)"),
            ("max_tokens", self.max_tokens >= 1, "an integer >= 1"),
            ("stop", all(self.stop) and len(self.stop) <= 4, "at most 4 non-empty strings"),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"an integer from 0 to {MAX_LOGPROBS}",
            ),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected {expected}")


def token_keys(seeds: jax.Array, streams: jax.Array, positions: jax.Array) -> jax.Array:
    """The key (B,) of each row's token at positions (B,): fold_in(fold_in(key(seed),
    stream), position)."""

    def one(seed: jax.Array, stream: jax.Array, position: jax.Array) -> jax.Array:
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), position)

    return jax.vmap(one)(seeds, streams, positions)


def choose(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> jax.Array:
    """Next tokens (B,) int32 from logits (B, V): the argmax where temperature is 0, else a
    sample from softmax(logits / temperature) restricted to the top_k largest (all where
    top_k is 0) and to the smallest set of largest logits holding top_p of the probability
    (ties at either threshold are kept). keys (B,); temperature, top_p (B,) float; top_k
    (B,) int."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, MIN_TEMPERATURE)[:, None]
    ranked = -jnp.sort(-scaled, axis=-1)  # descending
    kth = jnp.take_along_axis(ranked, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
    k_cut = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the larger logits
    kept = jnp.sum(before < top_p[:, None], axis=-1, keepdims=True)  # >= 1
    p_cut = jnp.take_along_axis(ranked, kept - 1, axis=-1)
    allowed = jnp.where(scaled >= jnp.maximum(k_cut, p_cut), scaled, -jnp.inf)
    sampled = jax.vmap(jax.random.categorical)(keys, allowed)
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


@jax.jit
def sample(
    logits: jax.Array,
    seeds: jax.Array,
    positions: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The engine's choice for rows of logits (B, V) whose next tokens sit at positions (B,):
    (tokens (B,) int32, their log probabilities (B,), the MAX_LOGPROBS likeliest tokens'
    log probabilities (B, N) and ids (B, N)), of the model's distribution (log_softmax of
    the logits, before temperature and cuts, as OpenAI and vLLM report them)."""
    keys = token_keys(seeds, jnp.zeros_like(seeds), positions)
    tokens = choose(logits, keys, temperature, top_k, top_p)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    return tokens, chosen, top_values, top_ids
