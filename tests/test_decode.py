"""KV-cached decoding against the full forward, on tiny models with all weights random."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import randomize, tiny_model, tokens

from bov_jax.inference import attention, decode, sampling
from bov_jax.inference.texts import sample_text, sample_texts
from bov_jax.presets import PRESETS

# Prefill 5 tokens, then single steps up to 20 tokens: past the short window (8) of the
# sliding-window layers, and every step's smear reads the cache.
PREFILL, LENGTH = (5,), 20
# Cheaper XLA compilation for the many small test programs (same semantics).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
fast_jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)


@functools.partial(fast_jit, static_argnames=("graphdef", "calls", "eliminate_bank_v"))
def cached_logits(graphdef, state, ids, *, calls=PREFILL, eliminate_bank_v=True):
    """Logits (B, T, V) of ids (B, T) from cached forwards of ids[:, :calls[0]], then
    ids[:, calls[0]:calls[1]], ... (a prefill and chunks), then one token at a time."""
    model = nnx.merge(graphdef, state)
    batch, length = ids.shape
    cache = decode.init_cache(model.spec, batch, length, eliminate_bank_v=eliminate_bank_v)
    out = []
    for start, end in zip((0, *calls[:-1]), calls, strict=True):
        logits, cache = decode.forward_cached(model, ids[:, start:end], cache)
        out.append(logits)

    def step(cache, token):
        logits, cache = decode.forward_cached(model, token[:, None], cache)
        return cache, logits[:, 0]

    _, steps = jax.lax.scan(step, cache, ids[:, calls[-1] :].T)
    return jnp.concatenate([*out, steps.transpose(1, 0, 2)], axis=1)


@functools.partial(fast_jit, static_argnames="graphdef")
def step_logits(graphdef, state, ids, cache):
    return decode.forward_cached(nnx.merge(graphdef, state), ids, cache)


@functools.partial(fast_jit, static_argnames="graphdef")
def _forward(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def full_forward(model, ids):
    """The full forward's logits (B, T, V): one compiled program, not one eager op at a time."""
    return _forward(*nnx.split(model), ids)


def random_model(preset: str, seed: int = 3, depth: int = 4, **overrides):
    model = tiny_model(preset, depth=depth, **overrides)
    randomize(model, seed=seed)  # live output projections, smear and coefficients
    return model


@pytest.fixture(scope="module")
def bov_model():
    """A small BoV model for the engine tests: layer 0 short-window, layer 1 BoV."""
    return random_model("d12_bov", depth=2)


def assert_cached_matches_full(model, ids, **kwargs):
    full = model(ids)  # eager: its ops' compilations are shared by the presets
    cached = cached_logits(*nnx.split(model), ids, **kwargs)
    assert float(jnp.std(full)) > 0.1
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_cached_decoding_reproduces_the_full_forward(preset):
    model = random_model(preset)
    assert model.spec.windows == (8, 8, 8, 64)
    assert_cached_matches_full(model, tokens(2, LENGTH))


def test_chunks_and_long_window_layers_past_seq_len():
    model = random_model("d12_bov", seq_len=16, short_window=4)
    assert model.spec.windows == (4, 4, 4, 16)
    assert_cached_matches_full(model, tokens(2, 40), calls=(5, 11, 30))  # two chunks


def test_decode_step_mixes_in_the_stored_previous_embedding():
    model = random_model("d12", depth=2)
    model.smear_lambda[...] = jnp.full((1,), 3.0)  # a strong smear
    graphdef, state = nnx.split(model)
    ids = tokens(1, 12)
    _, cache = step_logits(graphdef, state, ids[:, :11], decode.init_cache(model.spec, 1, 12))
    np.testing.assert_array_equal(cache.prev_embedding, model.embed(ids[:, 10:11]))
    step, _ = step_logits(graphdef, state, ids[:, 11:], cache)
    full = full_forward(model, ids)
    np.testing.assert_allclose(step[:, 0], full[:, 11], rtol=1e-5, atol=2e-5)
    no_prev = cache._replace(prev_embedding=jnp.zeros_like(cache.prev_embedding))
    wrong, _ = step_logits(graphdef, state, ids[:, 11:], no_prev)
    assert float(jnp.max(jnp.abs(wrong - step))) > 1e-2


@pytest.mark.parametrize("preset", ["d12_bov", "d12_bov_shared"])
def test_bov_without_v_cache_equals_bov_with_v_cache(preset):
    model = random_model(preset)
    targets = model.spec.targets
    without = decode.init_cache(model.spec, 2, LENGTH)
    with_v = decode.init_cache(model.spec, 2, LENGTH, eliminate_bank_v=False)
    assert [v is None for v in without.v] == [i in targets for i in range(4)]
    assert without.token_ids.shape == (2, LENGTH) and with_v.token_ids is None
    assert all(v is not None for v in with_v.v)
    ids = tokens(2, LENGTH)
    graphdef, state = nnx.split(model)
    a = cached_logits(graphdef, state, ids, eliminate_bank_v=True)
    b = cached_logits(graphdef, state, ids, eliminate_bank_v=False)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_v1_targets_read_layer_0s_v_cache():
    model = random_model("d12_v1")
    cache = decode.init_cache(model.spec, 1, 8)
    assert [v is None for v in cache.v] == [False, False, True, True]
    assert cache.token_ids is None


def full_cache_attention(q, k, v, *, q_positions, k_length, window):
    """Attention over every slot of the cache, masked: what the windowed read must equal."""
    mask = attention.cache_mask(q_positions, k.shape[1], k_length, window)
    return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], implementation="xla")


@functools.partial(fast_jit, static_argnames=("window", "k_length", "queries"))
def windowed_reads(window, k_length, queries):
    """(the reference, the windowed read, the table reference, the fused table read) of a
    case, in one program (eager, each op of each case compiled on its own)."""
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (2, queries, 2, 8))
    k = jax.random.normal(keys[1], (2, 48, 2, 8))
    v = jax.random.normal(keys[4], (2, 48, 2, 8))
    table = jax.random.normal(keys[2], (30, 16))
    ids = jax.random.randint(keys[3], (2, 48), 0, 30)
    start = max(k_length - queries, 0)
    mask = dict(q_positions=start + jnp.arange(queries), k_length=k_length, window=window)
    return (
        full_cache_attention(q, k, v, **mask),
        attention.cached_attention(q, k, v, **mask),
        full_cache_attention(q, k, table[ids].reshape(2, 48, 2, 8), **mask),
        attention.cached_table_attention(q, k, table, ids, **mask),
    )


@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize(("window", "k_length"), [(4, 23), (100, 23), (4, 48), (7, 5)])
def test_windowed_cache_reads_equal_attention_over_every_slot(window, k_length, queries):
    """The attentions read only the slots the window reaches (a static count); the table's
    rows gathered where they are weighed equal attention over the gathered values."""
    start = max(k_length - queries, 0)
    first, count = attention.visible_slots(start + np.arange(queries), 48, window)
    assert count == min(48, window + queries) and 0 <= int(first) <= 48 - count
    want, cached, gathered, fused = windowed_reads(window, k_length, queries)
    assert float(jnp.std(want)) > 0.1
    np.testing.assert_allclose(cached, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fused, gathered, rtol=1e-5, atol=1e-6)


PROMPTS = [[1, 5, 9, 13, 17], [1, *range(20, 28)], [1, *range(40, 51)]]


def logits_behind(model, completions):
    """For each row, the full forward's logits (n, V) at the positions that produced it."""
    seqs = [p + c for p, c in zip(PROMPTS, completions, strict=True)]
    width = max(map(len, seqs))
    ids = jnp.array([s + [0] * (width - len(s)) for s in seqs])  # causal: padding is unseen
    logits = np.asarray(full_forward(model, ids))
    return [logits[r, len(p) - 1 : len(s) - 1] for r, (p, s) in enumerate(zip(PROMPTS, seqs))]


def test_greedy_generation_follows_the_full_forward_and_is_deterministic(bov_model):
    first = decode.generate(bov_model, PROMPTS, 8)
    assert first == decode.generate(bov_model, PROMPTS, 8)
    assert [len(c) for c in first] == [8, 8, 8]
    for completion, logits in zip(first, logits_behind(bov_model, first), strict=True):
        assert logits.argmax(-1).tolist() == completion


def test_decode_compiles_once_per_shape(bov_model):
    decode.generate(bov_model, PROMPTS, 8)
    before = decode.decode_loop._cache_size()
    decode.generate(bov_model, PROMPTS, 5, temperature=0.5, seed=1)
    decode.generate(random_model("d12_bov", seed=4, depth=2), PROMPTS, 7)  # same structure
    assert decode.decode_loop._cache_size() == before


def test_top_k_sampling_is_reproducible_and_picks_only_from_the_top_k(bov_model):
    run = functools.partial(decode.generate, bov_model, PROMPTS, 8, temperature=1.0, top_k=3)
    first = run(seed=5)
    assert first == run(seed=5)
    assert first != run(seed=6)
    for completion, logits in zip(first, logits_behind(bov_model, first), strict=True):
        top3 = np.argsort(logits, -1)[:, -3:]
        assert all(t in row for t, row in zip(completion, top3, strict=True))


def test_choose_cuts_to_top_k_and_top_p_and_is_greedy_at_temperature_0():
    logits = jax.random.normal(jax.random.key(0), (6, 50))
    order = np.argsort(np.asarray(logits), -1)[:, ::-1]
    probs = np.asarray(jax.nn.softmax(logits / 2.0))
    nucleus = [  # the smallest set of largest logits holding 0.5 of the probability
        set(order[r, : 1 + int(np.sum(np.cumsum(probs[r, order[r]]) < 0.5))]) for r in range(6)
    ]
    rows = jnp.arange(6)
    temperature = jnp.full((6,), 2.0)
    top_k = jnp.array([4, 4, 4, 0, 0, 1])
    top_p = jnp.array([1.0, 1.0, 1.0, 0.5, 0.5, 1.0])

    # one compilation each (called eagerly, every call traced and compiled its conds anew)
    choose, token_keys = fast_jit(sampling.choose), fast_jit(sampling.token_keys)

    def pick(i):
        keys = token_keys(jnp.full((6,), i), rows, rows)
        return choose(logits, keys, temperature, top_k, top_p)

    picks = np.stack([pick(i) for i in range(60)])
    assert all(set(picks[:, r]) <= set(order[r, :4]) for r in range(3))
    assert all(set(picks[:, r]) <= nucleus[r] for r in (3, 4))
    assert set(picks[:, 5]) == {order[5, 0]}
    assert len(set(picks[:, 0])) > 1 and len(set(picks[:, 3])) > 1  # it samples
    keys = token_keys(rows, rows, rows)
    greedy = choose(logits, keys, jnp.zeros(6), top_k, top_p)
    np.testing.assert_array_equal(greedy, np.asarray(logits).argmax(-1))


def test_stop_tokens_end_each_row_without_being_returned(bov_model):
    free = decode.generate(bov_model, PROMPTS, 8)
    stop = free[0][3]
    stopped = decode.generate(bov_model, PROMPTS, 8, stop_tokens=(stop,))
    for row, out in zip(free, stopped, strict=True):
        assert out == (row[: row.index(stop)] if stop in row else row)
    assert len(stopped[0]) <= 3


class CharTokenizer:
    """Characters a-z as ids 1..26; id 0 is BOS."""

    bos_id = 0

    def encode_one(self, text):
        return [ord(c) - 96 for c in text]

    def decode(self, ids):
        return "".join(chr(96 + i) if 0 < i <= 26 else "?" for i in ids if i)


def test_sample_texts_return_the_decoded_completions(bov_model):
    tokenizer = CharTokenizer()
    texts = ["abcd", "efghijkl", "mnopqrstuvw"]  # the lengths of PROMPTS: no new compile
    samples = sample_texts(bov_model, tokenizer, texts, max_new_tokens=8)
    ids = [[0, *tokenizer.encode_one(t)] for t in texts]
    completions = decode.generate(bov_model, ids, 8, stop_tokens=(0,))
    assert samples == [tokenizer.decode(c) for c in completions]
    assert sample_text(bov_model, tokenizer, "abcd", max_new_tokens=8) == samples[0]
