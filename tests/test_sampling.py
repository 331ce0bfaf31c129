"""The engine's sampler (bov_jax/inference/sampling.py) against NumPy references of vLLM's
semantics: cuts without sorting, penalties, bias, banned ids, logprobs, validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bov_jax.inference import sampling
from bov_jax.inference.sampling import Row, SamplingParams

B, V = 8, 512


def random_logits(seed: int, scale: float = 3.0) -> np.ndarray:
    return scale * np.asarray(jax.random.normal(jax.random.key(seed), (B, V)), np.float32)


def reference_kept(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """vLLM's cuts by sorting, one row (V,): min_p, top_k, then top_p of what is left."""
    probs = np.exp(scaled - scaled.max())
    keep = probs >= min_p * probs.max()
    ranked = np.sort(scaled)[::-1]
    if 0 < top_k < len(scaled):
        keep &= scaled >= ranked[top_k - 1]
    if top_p < 1:
        weights = np.sort(np.where(keep, probs, 0.0))[::-1]
        weights /= weights.sum()
        before = np.cumsum(weights) - weights
        keep &= scaled >= ranked[np.sum(before < top_p) - 1]
    return keep


def reference_adjusted(logits: np.ndarray, row: Row) -> np.ndarray:
    """vLLM's logit bias, banned ids and penalties on one row (V,)."""
    p = row.params
    x = logits.astype(np.float64)
    for token, bias in p.logit_bias:
        x[token] += bias
    x[list(row.banned)] = -np.inf
    counts = np.bincount(row.generated, minlength=V)
    seen = (counts > 0) | (np.bincount(row.prompt, minlength=V) > 0)
    r = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def row_keys(rows: list[Row]) -> jax.Array:
    seeds = jnp.array([sampling.key_seed(r.seed) for r in rows], jnp.int32)
    positions = jnp.array([r.position for r in rows], jnp.int32)
    return sampling.token_keys(seeds, jnp.zeros_like(seeds), positions)


def masked_draw(rows: list[Row], scaled: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The straightforward sample: categorical over the kept logits with each row's key."""
    masked = jnp.where(jnp.asarray(keep), jnp.asarray(scaled, jnp.float32), -jnp.inf)
    return np.asarray(jax.vmap(jax.random.categorical)(row_keys(rows), masked))


CUTS = {  # (top_k, top_p, min_p) of B rows
    "top_k": [(1, 1.0, 0.0), (2, 1.0, 0.0), (5, 0.9, 0.0), (16, 0.5, 0.0), (40, 1.0, 0.1),
              (64, 0.3, 0.05), (3, 0.99, 0.5), (50, 0.95, 0.0)],
    "top_p / min_p": [(0, 0.5, 0.0), (0, 0.9, 0.0), (0, 0.99, 0.0), (0, 1.0, 0.2),
                      (0, 0.7, 0.01), (10, 0.8, 0.0), (300, 0.95, 0.0), (0, 0.05, 0.0)],
    "no cut": [(0, 1.0, 0.0), (-1, 1.0, 0.0)] * 4,
}  # fmt: skip


@pytest.mark.parametrize("name", CUTS)
def test_cuts_keep_the_sorted_reference_sets_and_draw_as_a_masked_categorical(name):
    logits = random_logits(1)
    temperature = np.linspace(0.5, 1.5, B, dtype=np.float32)
    rows = [
        Row(SamplingParams(float(t), k, p, m, seed=2**40 + i), 2**40 + i, 7 + i, [], [])
        for i, (t, (k, p, m)) in enumerate(zip(temperature, CUTS[name], strict=True))
    ]
    plan = sampling.plan_for(rows, V)
    assert plan.top_k == {"top_k": 64, "top_p / min_p": -1, "no cut": 0}[name]
    scaled = logits / temperature[:, None]
    expected = np.stack([reference_kept(scaled[i], *cut) for i, cut in enumerate(CUTS[name])])
    cuts = np.array(CUTS[name])
    allowed = jax.jit(sampling.kept, static_argnums=(4, 5))(
        jnp.asarray(scaled),
        jnp.asarray(np.maximum(cuts[:, 0], 0).astype(np.int32)),
        jnp.asarray(cuts[:, 1], jnp.float32),
        jnp.asarray(cuts[:, 2], jnp.float32),
        plan.top_k,
        plan.top_p,
    )
    np.testing.assert_array_equal(np.asarray(allowed), expected)
    sizes = expected.sum(-1)  # the cuts bite, to one id and to many
    assert (sizes == V).all() if name == "no cut" else (1 in sizes and (sizes > 20).any())
    picked = sampling.sample_rows(jnp.asarray(logits), rows)
    np.testing.assert_array_equal(picked.tokens, masked_draw(rows, scaled, expected))


def test_bisection_keeps_the_sorted_reference_sets_with_ties_and_zeros():
    scaled = np.round(random_logits(2, scale=2.0), 0)  # many ties, -0.0 and 0.0
    scaled[0, :5] = -0.0
    cuts = [(3, 1.0), (10, 0.9), (0, 0.5), (7, 0.3), (0, 0.95), (300, 0.99), (1, 1.0), (0, 1.0)]
    expected = np.stack([reference_kept(scaled[i], k, p, 0.0) for i, (k, p) in enumerate(cuts)])
    k, p = (jnp.asarray(c) for c in zip(*cuts, strict=True))
    kept = jax.jit(sampling.kept, static_argnums=(4, 5))
    allowed = kept(jnp.asarray(scaled), k, p.astype(jnp.float32), jnp.zeros(B), -1, True)
    np.testing.assert_array_equal(np.asarray(allowed), expected)


def test_greedy_batches_take_the_argmax_and_nothing_else():
    logits = random_logits(3)
    rows = [Row(SamplingParams(0.0, top_k=5, top_p=0.5), i, i, [], []) for i in range(B - 2)]
    assert sampling.plan_for(rows, V) == sampling.Plan()  # no draw, no cuts, no alternatives
    picked = sampling.sample_rows(jnp.asarray(logits), rows)
    np.testing.assert_array_equal(picked.tokens, logits[: B - 2].argmax(-1))
    assert picked.tokens.shape == (B - 2,) and picked.top_ids.shape == (B - 2, 20)


def test_mixed_batches_keep_greedy_rows_greedy_and_top_k_minus_1_equals_0():
    logits = jnp.asarray(random_logits(4))
    greedy = SamplingParams(temperature=0.0)

    def tokens(top_k: int) -> np.ndarray:
        rows = [Row(SamplingParams(top_k=top_k), i, 3, [], []) for i in range(B - 1)]
        return sampling.sample_rows(logits, [*rows, Row(greedy, 0, 3, [], [])]).tokens

    draws = tokens(0)
    np.testing.assert_array_equal(draws, tokens(-1))
    assert draws[-1] == int(np.argmax(logits[B - 1]))
    assert len(set(draws[:-1].tolist())) > 1


def test_penalties_and_bias_follow_vllm_formulas():
    logits = random_logits(5)
    prompt, generated = [1, 2, 3, 3, 40], [3, 7, 7, 7, 9, 2]
    cases = [
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=-0.7),
        SamplingParams(frequency_penalty=2.0, presence_penalty=-2.0),
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(repetition_penalty=0.4, frequency_penalty=0.5),
        SamplingParams(logit_bias=((5, 3.0), (6, -4.0))),
        SamplingParams(logit_bias=((7, 2.0),), repetition_penalty=1.3, presence_penalty=1.0),
        SamplingParams(),
    ]
    for position in range(3):
        rows = [Row(p, 11 + i, 20 + position, prompt, generated) for i, p in enumerate(cases)]
        expected = np.stack([reference_adjusted(logits[i], r) for i, r in enumerate(rows)])
        assert all((expected[i] != logits[i]).any() for i in range(B - 1))  # each bites
        assert (expected[-1] == logits[-1]).all()
        keep = np.ones((B, V), bool)
        picked = sampling.sample_rows(jnp.asarray(logits), rows)
        np.testing.assert_array_equal(picked.tokens, masked_draw(rows, expected, keep))
        greedy = [r._replace(params=SamplingParams(**{**vars(r.params), "temperature": 0}))
                  for r in rows]  # fmt: skip
        picked = sampling.sample_rows(jnp.asarray(logits), greedy)
        np.testing.assert_array_equal(picked.tokens, expected.argmax(-1))


def test_logit_bias_forces_a_token_and_banned_ids_are_never_drawn():
    logits = jnp.asarray(random_logits(6))
    order = np.argsort(-np.asarray(logits), -1)
    forced = Row(SamplingParams(logit_bias=((17, 100.0),)), 1, 0, [], [])
    for position in range(8):
        rows = [forced._replace(position=position)] + [
            Row(SamplingParams(temperature=t), r, position, [], [], banned=order[r, :4].tolist())
            for r, t in zip(range(1, B), [0.0, 1.0, 2.0, 5.0, 0.0, 1.0, 3.0], strict=True)
        ]
        picked = sampling.sample_rows(logits, rows)
        assert picked.tokens[0] == 17
        for r in range(1, B):
            assert picked.tokens[r] not in order[r, :4]
        assert picked.tokens[1] == order[1, 4]  # greedy: the best id not banned


def test_min_p_cuts_below_its_share_of_the_largest_probability():
    logits = jnp.asarray(random_logits(7, scale=1.0))
    probs = np.asarray(jax.nn.softmax(logits, -1))
    rows = [Row(SamplingParams(min_p=0.5), r, r, [], []) for r in range(B)]
    seen = np.zeros((B, V), bool)
    for position in range(16):
        picked = sampling.sample_rows(logits, [r._replace(position=position) for r in rows])
        seen[np.arange(B), picked.tokens] = True
    allowed = probs >= 0.5 * probs.max(-1, keepdims=True)
    assert not (seen & ~allowed).any()
    assert seen.sum() > B  # more than one id a row


def test_logprobs_are_of_the_raw_logits_whatever_the_bias():
    logits = jnp.asarray(random_logits(8))
    raw = np.asarray(jax.nn.log_softmax(logits, -1))
    rows = [
        Row(SamplingParams(temperature=0.0, logprobs=20, logit_bias=((r, 50.0),)), 0, 0, [], [])
        for r in range(B)
    ]
    picked = sampling.sample_rows(logits, rows)
    np.testing.assert_array_equal(picked.tokens, np.arange(B))
    np.testing.assert_allclose(picked.logprobs, raw[np.arange(B), np.arange(B)], rtol=1e-6)
    order = np.argsort(-raw, -1)[:, :20]
    np.testing.assert_array_equal(picked.top_ids, order)
    np.testing.assert_allclose(picked.top_logprobs, np.take_along_axis(raw, order, -1), rtol=1e-6)
    chosen, values, ids = sampling.logprobs_of(logits, jnp.arange(B, dtype=jnp.int32))
    np.testing.assert_allclose(np.asarray(chosen), picked.logprobs, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(ids), order)


def test_new_parameter_values_compile_no_new_program():
    logits = jnp.asarray(random_logits(9)[:, :384])  # a shape no other test compiles

    def run(greedy: dict, cut_k: dict, cut_p: dict, step: int) -> None:
        for options in ([greedy], [greedy, cut_k], [cut_p, greedy, cut_p]):
            rows = [Row(SamplingParams(**o), step, step, [1], [2]) for o in options]
            sampling.sample_rows(logits, rows)

    before = sampling._pick._cache_size()
    run({"temperature": 0}, {"top_k": 40}, {"top_p": 0.8}, 0)
    plans = sampling._pick._cache_size() - before
    assert plans == 3
    run({"temperature": 0, "top_k": 9}, {"top_k": 50, "temperature": 1.3},
        {"top_p": 0.6, "min_p": 0.1, "top_k": -1}, 1)  # fmt: skip
    assert sampling._pick._cache_size() - before == plans


def test_seeds_take_64_bits_and_keep_their_32_bit_keys():
    assert sampling.key_seed(12345) == 12345
    assert sampling.key_seed(2**32 - 1) == -1
    assert sampling.key_seed(2**64 - 1) == 0  # both halves all ones
    assert sampling.key_seed(2**40 + 5) != sampling.key_seed(5)
    SamplingParams(seed=2**64 - 1).validate()


@pytest.mark.parametrize(
    "field, fields, vocab",
    [
        ("temperature=inf", {"temperature": float("inf")}, None),
        ("temperature=nan", {"temperature": float("nan")}, None),
        ("temperature=-0.5", {"temperature": -0.5}, None),
        ("top_k=-2", {"top_k": -2}, None),
        ("top_p=0", {"top_p": 0}, None),
        ("min_p=1.5", {"min_p": 1.5}, None),
        ("seed=18446744073709551616", {"seed": 2**64}, None),
        ("max_tokens=0", {"max_tokens": 0}, None),
        ("stop=('',)", {"stop": ("",)}, None),
        ("stop_token_ids=512", {"stop_token_ids": (3, 512)}, V),
        ("min_tokens=17", {"min_tokens": 17}, None),
        ("logprobs=21", {"logprobs": 21}, None),
        ("prompt_logprobs=-1", {"prompt_logprobs": -1}, None),
        ("presence_penalty=2.5", {"presence_penalty": 2.5}, None),
        ("frequency_penalty=-3", {"frequency_penalty": -3}, None),
        ("repetition_penalty=0", {"repetition_penalty": 0}, None),
        ("logit_bias=(512, 1.0)", {"logit_bias": ((1, 2.0), (512, 1.0))}, V),
        ("logit_bias=(3, 101.0)", {"logit_bias": ((3, 101.0),)}, None),
    ],
)
def test_validation_names_the_field(field, fields, vocab):
    with pytest.raises(ValueError) as err:
        SamplingParams(**fields).validate(vocab)
    assert str(err.value).startswith(field + ";")
    assert "expected" in str(err.value)


def test_validation_accepts_the_edges():
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate()
    SamplingParams(
        temperature=0, top_k=-1, min_p=1, min_tokens=16, logprobs=20, presence_penalty=-2,
        frequency_penalty=2, logit_bias=((511, -100.0),), stop=("a",) * 9,
    ).validate(V)  # fmt: skip
