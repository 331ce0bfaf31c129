"""Choosing the next token of many sequences at once, each with its own sampling parameters.

Shapes: B rows, V vocab, K = min(MAX_LOGPROBS, V) alternatives.

A row's parameters act in vLLM's (v1) order on the model's logits:
1. the banned ids (the engine's min_tokens) get -inf and logit_bias is added;
2. repetition_penalty divides the positive logits and multiplies the others of every id in
   the prompt or generated; frequency_penalty is subtracted once per generated occurrence
   of an id, presence_penalty once if it was generated at all;
3. a row whose temperature is below GREEDY_BELOW takes the argmax of these logits; the
   others divide them by their temperature, and
4. keep the ids of probability >= min_p times the largest; of those the top_k largest; of
   those the smallest set of largest holding top_p of their (renormalized) probability;
   ties at each threshold are kept;
5. draw with `jax.random.categorical` over the kept logits and the row's key.
Reported log probabilities are of the raw logits (log_softmax, before 1-4), as vLLM reports
them by default and OpenAI does.

Nothing sorts the vocabulary. When every sampling row of a batch has a top_k of at most
TOP_K_BUCKETS[-1], its candidates are `lax.top_k` of a bucketed k and the top_p cut is
taken on them; otherwise top_k and top_p are each cut by a bisection over the order of the
float32 values (`_lowest_kept`: 32 masked sums, the same kept set a sort gives). The host
picks the compiled program from what the batch uses (`Plan`): a batch of greedy rows takes
an argmax and nothing else, bias and penalties cost only batches that use them, the top
alternatives only batches that ask for some; at most PLANS programs per logits shape.

Randomness is a function of (seed, stream, position) only (`token_keys`): a sequence's
sample at position p does not depend on the batch it ran in, its row, or whether it was
preempted and recomputed. The dense `generate` uses stream = its row, the engine stream 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20  # alternatives a request may ask for (OpenAI's and vLLM's completions limit)
GREEDY_BELOW = 1e-5  # temperatures below this take the argmax (vLLM's _SAMPLING_EPS)
TOP_K_BUCKETS = (16, 64, 256)  # lax.top_k sizes; a larger top_k is cut by bisection
SEED_LIMIT = 2**64  # seeds in [0, SEED_LIMIT) (OpenAI clients send 64-bit ones)
PENALTY_LIMIT = 2.0  # presence and frequency penalties in [-PENALTY_LIMIT, PENALTY_LIMIT]
BIAS_LIMIT = 100.0  # logit_bias values in [-BIAS_LIMIT, BIAS_LIMIT]


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling (module doc for what each does). temperature 0: greedy; top_k
    0 or -1: no top-k cut; top_p 1, min_p 0: no cut; seed None: the engine draws one;
    max_tokens 0: only the prompt scored (with prompt_logprobs); stop / stop_token_ids: end
    the completion (the engine); min_tokens: EOS and stop_token_ids banned before that many
    tokens; logprobs N: the chosen token's log probability and the N likeliest alternatives;
    prompt_logprobs N: the same for each prompt token; logit_bias: (token id, bias) pairs."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field out of range ("temperature=inf; expected
        a finite number >= 0"); token ids are checked against vocab_size when given."""
        ids = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"

        def token(t: object) -> bool:
            return _integer(t) and t >= 0 and (vocab_size is None or t < vocab_size)

        def count(n: object) -> bool:
            return n is None or (_integer(n) and 0 <= n <= MAX_LOGPROBS)

        def penalty(x: object) -> bool:
            return _finite(x) and -PENALTY_LIMIT <= x <= PENALTY_LIMIT

        bad_stop_id = [t for t in self.stop_token_ids if not token(t)]
        bad_bias = [
            e
            for e in self.logit_bias
            if len(e) != 2 or not token(e[0]) or not _finite(e[1]) or abs(e[1]) > BIAS_LIMIT
        ]
        scoring_only = self.max_tokens == 0 and self.prompt_logprobs is not None
        checks = [
            ("temperature", None, _finite(self.temperature) and self.temperature >= 0,
             "a finite number >= 0"),
            ("top_k", None, _integer(self.top_k) and self.top_k >= -1,
             "an integer >= -1 (0 or -1: no top-k cut)"),
            ("top_p", None, _finite(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("min_p", None, _finite(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("seed", None, self.seed is None or (_integer(self.seed) and
             0 <= self.seed < SEED_LIMIT), "an integer in [0, 2^64)"),
            ("max_tokens", None, _integer(self.max_tokens) and (self.max_tokens >= 1 or
             scoring_only), "an integer >= 1 (0 only with prompt_logprobs)"),
            ("stop", None, all(isinstance(s, str) and s for s in self.stop),
             "non-empty strings"),
            ("stop_token_ids", bad_stop_id[:1], not bad_stop_id, f"token ids in {ids}"),
            ("min_tokens", None, _integer(self.min_tokens) and
             0 <= self.min_tokens <= self.max_tokens, "an integer from 0 to max_tokens"),
            ("logprobs", None, count(self.logprobs), f"an integer from 0 to {MAX_LOGPROBS}"),
            ("prompt_logprobs", None, count(self.prompt_logprobs),
             f"an integer from 0 to {MAX_LOGPROBS}"),
            ("presence_penalty", None, penalty(self.presence_penalty), "a number in [-2, 2]"),
            ("frequency_penalty", None, penalty(self.frequency_penalty), "a number in [-2, 2]"),
            ("repetition_penalty", None, _finite(self.repetition_penalty) and
             self.repetition_penalty > 0, "a finite number > 0"),
            ("logit_bias", bad_bias[:1], not bad_bias,
             f"(token id in {ids}, bias in [-100, 100]) pairs"),
        ]  # fmt: skip
        for name, shown, ok, expected in checks:
            if not ok:
                value = getattr(self, name) if shown is None else shown[0]
                raise ValueError(f"{name}={value!r}; expected {expected}")


class Row(NamedTuple):
    """One sequence due for a token this step (built by the engine on the host)."""

    params: SamplingParams
    seed: int  # in [0, 2^64): `key_seed` reduces it to the key's
    position: int  # the position of the token being sampled (len(tokens))
    prompt: Sequence[int]  # prompt ids (repetition_penalty counts these and the generated)
    generated: Sequence[int]  # ids generated so far (presence/frequency penalties count these)
    banned: Sequence[int] = ()  # ids that may not be sampled this step (min_tokens)


class Picked(NamedTuple):
    """NumPy arrays on the host, one entry per row given (n rows)."""

    tokens: np.ndarray  # (n,) int32
    logprobs: np.ndarray  # (n,) float32: the chosen token's, of the raw logits
    top_logprobs: np.ndarray  # (n, MAX_LOGPROBS) float32, descending (-inf past the vocab)
    top_ids: np.ndarray  # (n, MAX_LOGPROBS) int32 (-1 past the vocab)


class Plan(NamedTuple):
    """What a batch's compiled program does (static, chosen on the host by `plan_for`).

    draw: some row samples (else every row takes the argmax); top_k: 0 no row cuts top-k,
    a TOP_K_BUCKETS size (capped at V) every sampling row's candidates are that many
    `lax.top_k` (their top_p cut taken on them), -1 a bisection; top_p: a bisection cuts
    top_p (with top_k 0 or -1); adjust: bias, banned ids or penalties are applied;
    alternatives: the K likeliest tokens are reported."""

    draw: bool = False
    top_k: int = 0
    top_p: bool = False
    adjust: bool = False
    alternatives: bool = False


# argmax plans (adjust x alternatives) + sampling ones: top_k 0 or -1 with or without a
# top_p bisection, or a bucket (x adjust x alternatives)
PLANS = 2 * 2 + (2 * 2 + len(TOP_K_BUCKETS)) * 2 * 2


class _Batch(NamedTuple):
    """The rows' parameters as arrays (B,) (padding rows greedy), the additive bias (B, V)
    (logit_bias, -inf at banned ids) and the history (B, V) int32: 2 x generated count +
    1 if in the prompt (bias and history None where the plan does not adjust)."""

    seeds: np.ndarray
    positions: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    repetition: np.ndarray
    bias: np.ndarray | None
    history: np.ndarray | None


def key_seed(seed: int) -> int:
    """A seed in [0, 2^64) as the int32 `token_keys` takes: its two 32-bit halves xor'ed,
    read as a signed int32 (a seed below 2^31 is itself)."""
    folded = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    return folded - 2**32 if folded >= 2**31 else folded


def token_keys(seeds: jax.Array, streams: jax.Array, positions: jax.Array) -> jax.Array:
    """The key (B,) of each row's token at positions (B,): fold_in(fold_in(key(seed),
    stream), position)."""

    def one(seed: jax.Array, stream: jax.Array, position: jax.Array) -> jax.Array:
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), position)

    return jax.vmap(one)(seeds, streams, positions)


def _ordered(x: jax.Array) -> jax.Array:
    """uint32 keys (B, V) of float32 values (B, V) in the same order (-0.0 equal to 0.0)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _lowest_kept(order: jax.Array, weights: jax.Array, limit: jax.Array) -> jax.Array:
    """The least key T (B, 1) with sum(weights where order > T) < limit, by bisection over
    the 2^32 keys: keeping order >= T keeps each value whose larger values weigh less than
    limit. order (B, V) uint32, weights (B, V) >= 0, limit (B,) > 0 (inf: T = 0)."""

    def halve(_, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        above = jnp.sum(jnp.where(order > mid[:, None], weights, 0.0), axis=-1)
        fits = above < limit
        return jnp.where(fits, lo, mid + 1), jnp.where(fits, mid, hi)

    hi = jnp.max(order, axis=-1)  # nothing lies above the largest
    _, hi = jax.lax.fori_loop(0, 32, halve, (jnp.zeros_like(hi), hi))
    return hi[:, None]


def kept(
    scaled: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    k_mode: int,
    p_bisect: bool,
) -> jax.Array:
    """The ids (B, V) bool a row may draw from its scaled logits (B, V): min_p, then top_k,
    then top_p of what is left (module doc, step 4). top_k (B,) int (<= 0: no cut), top_p,
    min_p (B,) float. k_mode, p_bisect: `Plan.top_k`, `Plan.top_p` (with k_mode > 0 every
    row's top_k must be 1..k_mode or its row is not drawn from)."""
    top = jnp.max(scaled, axis=-1, keepdims=True)
    floor = top + jnp.log(min_p)[:, None]
    cuts_p = top_p[:, None] < 1
    if k_mode > 0:
        candidates, _ = jax.lax.top_k(scaled, k_mode)  # (B, k_mode), descending
        kth = jnp.take_along_axis(candidates, jnp.clip(top_k - 1, 0, k_mode - 1)[:, None], -1)
        floor = jnp.maximum(floor, kth)
        mass = jnp.sum(jnp.where(scaled >= floor, jnp.exp(scaled - top), 0.0), -1, keepdims=True)
        weights = jnp.where(candidates >= floor, jnp.exp(candidates - top), 0.0)
        before = jnp.cumsum(weights, axis=-1) - weights
        n = jnp.sum(before < top_p[:, None] * mass, axis=-1, keepdims=True)  # >= 1
        p_cut = jnp.take_along_axis(candidates, n - 1, axis=-1)
        return scaled >= jnp.where(cuts_p, jnp.maximum(floor, p_cut), floor)
    allowed = scaled >= floor
    order = _ordered(scaled)
    if k_mode < 0:
        limit = jnp.where(top_k > 0, top_k.astype(jnp.float32), jnp.inf)
        allowed &= order >= _lowest_kept(order, jnp.ones_like(scaled), limit)
    if p_bisect:
        weights = jnp.where(allowed, jnp.exp(scaled - top), 0.0)
        limit = jnp.where(cuts_p[:, 0], top_p * jnp.sum(weights, axis=-1), jnp.inf)
        allowed &= order >= _lowest_kept(order, weights, limit)
    return allowed


def _draw(keys: jax.Array, scaled: jax.Array, allowed: jax.Array) -> jax.Array:
    """A token (B,) of each row: categorical over its allowed scaled logits (B, V)."""
    return jax.vmap(jax.random.categorical)(keys, jnp.where(allowed, scaled, -jnp.inf))


def choose(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> jax.Array:
    """Next tokens (B,) int32 from logits (B, V) with parameters as traced arrays (the dense
    decode loop): the argmax where temperature < GREEDY_BELOW (only that, if every row
    is), else a draw from softmax(logits / temperature) cut to top_k (<= 0: no cut) and
    top_p by bisection (skipped where no row cuts). keys (B,); temperature, top_p (B,)
    float; top_k (B,) int."""
    greedy = temperature < GREEDY_BELOW

    def drawn() -> jax.Array:
        scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
        allowed = jax.lax.cond(
            jnp.any(top_k > 0) | jnp.any(top_p < 1),
            lambda: kept(scaled, top_k, top_p, jnp.zeros_like(top_p), -1, True),
            lambda: jnp.ones(scaled.shape, bool),
        )
        sampled = _draw(keys, scaled, allowed)
        return jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)

    return jax.lax.cond(
        jnp.all(greedy), lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn
    )


def _logprobs(logits: jax.Array, targets: jax.Array, alternatives: bool) -> tuple[jax.Array, ...]:
    """log_softmax(logits (N, V)) at targets (N,), and if alternatives its K largest values
    (N, K) and their ids (N, K)."""
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    norm = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    chosen = jnp.take_along_axis(shifted, targets[:, None], axis=-1)[:, 0] - norm
    if not alternatives:
        return (chosen,)
    values, ids = jax.lax.top_k(shifted, min(MAX_LOGPROBS, logits.shape[-1]))
    return chosen, values - norm[:, None], ids.astype(jnp.int32)


@jax.jit
def logprobs_of(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log_softmax(logits (N, V)) at targets (N,) int32, its K largest values (N, K), their
    ids (N, K) int32): the model's log probabilities of given tokens (prompt scoring)."""
    return _logprobs(logits.astype(jnp.float32), targets, True)


def _adjusted(logits: jax.Array, batch: _Batch) -> jax.Array:
    """Steps 1 and 2 of the module doc on logits (B, V)."""
    x = logits + batch.bias
    counts = (batch.history >> 1).astype(jnp.float32)
    penalty = batch.repetition[:, None]
    x = jnp.where(batch.history > 0, jnp.where(x > 0, x / penalty, x * penalty), x)
    return x - batch.frequency[:, None] * counts - batch.presence[:, None] * (counts > 0)


@functools.partial(jax.jit, static_argnames=("plan",))
def _pick(logits: jax.Array, batch: _Batch, plan: Plan) -> tuple[jax.Array, ...]:
    """(tokens (B,) int32, their raw log probabilities (B,)[, the K likeliest's (B, K) and
    ids (B, K)]) of logits (B, V) under `plan`."""
    raw = logits.astype(jnp.float32)
    adjusted = _adjusted(raw, batch) if plan.adjust else raw
    tokens = jnp.argmax(adjusted, axis=-1).astype(jnp.int32)
    if plan.draw:
        greedy = batch.temperature < GREEDY_BELOW
        scaled = adjusted / jnp.where(greedy, 1.0, batch.temperature)[:, None]
        allowed = kept(scaled, batch.top_k, batch.top_p, batch.min_p, plan.top_k, plan.top_p)
        keys = token_keys(batch.seeds, jnp.zeros_like(batch.seeds), batch.positions)
        tokens = jnp.where(greedy, tokens, _draw(keys, scaled, allowed).astype(jnp.int32))
    return (tokens, *_logprobs(raw, tokens, plan.alternatives))


def plan_for(rows: Sequence[Row], vocab_size: int) -> Plan:
    """The program a batch of rows needs (`Plan`)."""
    drawn = [r.params for r in rows if r.params.temperature >= GREEDY_BELOW]
    adjust = any(
        r.banned
        or r.params.logit_bias
        or r.params.presence_penalty
        or r.params.frequency_penalty
        or r.params.repetition_penalty != 1
        for r in rows
    )
    alternatives = any(r.params.logprobs for r in rows)
    if not drawn:
        return Plan(adjust=adjust, alternatives=alternatives)
    ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in drawn]
    if min(ks) > 0 and max(ks) <= TOP_K_BUCKETS[-1]:
        bucket = min(b for b in TOP_K_BUCKETS if b >= max(ks))
        return Plan(True, min(bucket, vocab_size), False, adjust, alternatives)
    top_p = any(p.top_p < 1 for p in drawn)
    return Plan(True, -1 if max(ks) > 0 else 0, top_p, adjust, alternatives)


def _batch(rows: Sequence[Row], batch: int, vocab: int, adjust: bool) -> _Batch:
    """The rows' arrays, padded to `batch` rows with greedy ones."""

    def column(dtype: type, pad: float, value: Callable[[Row], float]) -> np.ndarray:
        out = np.full(batch, pad, dtype)
        out[: len(rows)] = [value(r) for r in rows]
        return out

    def vocab_row(ids: Sequence[int]) -> np.ndarray:
        return np.bincount(np.asarray(ids, np.int64), minlength=vocab)[:vocab]

    bias = history = None
    if adjust:
        bias = np.zeros((batch, vocab), np.float32)
        history = np.zeros((batch, vocab), np.int32)
        for r, row in enumerate(rows):
            if row.params.logit_bias:
                ids, values = zip(*row.params.logit_bias, strict=True)
                bias[r, list(ids)] = values
            bias[r, list(row.banned)] = -np.inf
            history[r] = 2 * vocab_row(row.generated) + (vocab_row(row.prompt) > 0)
    return _Batch(
        seeds=column(np.int32, 0, lambda r: key_seed(r.seed)),
        positions=column(np.int32, 0, lambda r: r.position),
        temperature=column(np.float32, 0, lambda r: r.params.temperature),
        top_k=column(np.int32, 0, lambda r: max(r.params.top_k, 0)),
        top_p=column(np.float32, 1, lambda r: r.params.top_p),
        min_p=column(np.float32, 0, lambda r: r.params.min_p),
        presence=column(np.float32, 0, lambda r: r.params.presence_penalty),
        frequency=column(np.float32, 0, lambda r: r.params.frequency_penalty),
        repetition=column(np.float32, 1, lambda r: r.params.repetition_penalty),
        bias=bias,
        history=history,
    )


def sample_rows(logits: jax.Array, rows: Sequence[Row]) -> Picked:
    """The next token of each row, from logits (B, V) fp32 with B >= len(rows) (rows past
    len(rows) are padding), and its log probabilities (`Picked`). Where no row asks for
    alternatives (logprobs >= 1) top_logprobs are -inf and top_ids -1."""
    batch, vocab = logits.shape
    if len(rows) > batch:
        raise ValueError(f"rows: {len(rows)} rows for {batch} rows of logits")
    plan = plan_for(rows, vocab)
    picked = jax.device_get(_pick(logits, _batch(rows, batch, vocab, plan.adjust), plan=plan))
    n = len(rows)
    top_logprobs = np.full((n, MAX_LOGPROBS), -np.inf, np.float32)
    top_ids = np.full((n, MAX_LOGPROBS), -1, np.int32)
    if plan.alternatives:
        k = picked[2].shape[1]
        top_logprobs[:, :k], top_ids[:, :k] = picked[2][:n], picked[3][:n]
    return Picked(picked[0][:n], picked[1][:n], top_logprobs, top_ids)
