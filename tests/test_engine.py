"""The serving engine against the dense decoder and the full forward, on random weights:
continuous batching, chunked prefill, sliding windows, preemption and recomputation.

Most of this file's time is XLA compiling the engine's step shapes (one program per rows,
columns and pages bucket, per model structure and pool shapes): the engines here share
TIGHT's pools and block size wherever the property tested allows, so that later tests run
the programs earlier ones compiled, and XLA compiles with its cheap settings (conftest)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import randomize, tiny_model

from bov_jax.inference import decode, paged
from bov_jax.inference.allocator import PageAllocator
from bov_jax.inference.engine import Engine, EngineConfig, held_back
from bov_jax.inference.layout import CacheLayout
from bov_jax.inference.sampling import SamplingParams

RNG = np.random.default_rng(0)
# Lengths around the chunk (8) and past the short window (8): prefills of one, two and five
# chunks, one-token prompts that decode at once.
PROMPTS = [RNG.integers(1, 200, size=n).tolist() for n in (5, 17, 30, 9, 3, 1, 40)]
NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW)
# Few pages: 7 requests through 3 batch slots, the later ones admitted as earlier ones
# finish, and the pages run out mid-decode, so the youngest is preempted and recomputed.
# Attention in blocks of 2 pages: the window-64 layers' spans (up to 16 pages) take several,
# through the online softmax (the other tests read a span in one block).
TIGHT = EngineConfig(
    page_size=4, max_seqs=3, chunk=8, record_logits=True, pages=(8, 20), block_pages=2
)
VARIANTS = {
    "baseline": ("d12", True),
    "BoV without a V cache": ("d12_bov", True),
    "BoV with a V cache": ("d12_bov", False),
    "v1": ("d12_v1", True),
}


def tight(**changes) -> EngineConfig:
    """TIGHT with changes: its pools and blocks, so its compiled step shapes are reused."""
    return EngineConfig(**{**TIGHT.__dict__, **changes})


@functools.cache
def random_model(preset: str, depth: int = 4, seed: int = 3):
    """A tiny model with every weight random; one per arguments (no test changes one)."""
    model = tiny_model(preset, depth=depth)
    randomize(model, seed=seed)  # live output projections, smear and coefficients
    return model


@functools.partial(jax.jit, static_argnames="graphdef")
def _forward(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def full_forward(model, seqs):
    """The full forward's logits (n, V) of each sequence, in one call: the sequences padded
    to the model's seq_len in one batch (causal: the padding is unseen), one compilation a
    model structure and batch, not an eager forward per sequence length."""
    ids = np.zeros((len(seqs), model.spec.seq_len), np.int32)
    for r, seq in enumerate(seqs):
        ids[r, : len(seq)] = seq
    logits = np.asarray(_forward(*nnx.split(model), jnp.asarray(ids)))
    return [logits[r, : len(seq)] for r, seq in enumerate(seqs)]


def full_logits(model, prompts, completions):
    """The full forward's logits (n, V) at the positions that produced each completion."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    return [x[len(p) - 1 :] for p, x in zip(prompts, full_forward(model, seqs), strict=True)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_paged_greedy_decoding_equals_dense_decoding_and_the_full_forward(variant):
    preset, eliminate = VARIANTS[variant]
    model = random_model(preset)
    assert model.spec.windows == (8, 8, 8, 64)  # windows of 8 and 64, past 8 here
    engine = Engine(model, tight(eliminate_bank_v=eliminate))
    results = engine.generate(PROMPTS, GREEDY)
    assert engine.scheduler.preemptions > 0
    dense = decode.generate(model, PROMPTS, NEW, eliminate_bank_v=eliminate)
    fulls = full_logits(model, PROMPTS, [r.token_ids for r in results])
    for result, want, full in zip(results, dense, fulls, strict=True):
        assert result.token_ids == want and result.finish_reason == "length"
        assert float(np.std(full)) > 0.1
        np.testing.assert_allclose(np.stack(result.logits), full[:NEW], rtol=1e-5, atol=2e-5)
        assert [int(row.argmax()) for row in result.logits] == result.token_ids
    assert engine.allocator.used_pages(0) == engine.allocator.used_pages(1) == 0


def test_bov_layers_hold_no_v_pages_and_the_id_pages_serve_them_all():
    spec = random_model("d12_bov").spec
    assert spec.targets == (2, 3)
    without = CacheLayout.build(spec, 4)
    with_v = CacheLayout.build(spec, 4, eliminate_bank_v=False)
    pools = paged.init_pools(without, (5, 6))
    assert sorted(pools) == ["ids", "k.0", "k.1", "k.2", "k.3", "v.0", "v.1"]
    assert sorted(paged.init_pools(with_v, (5, 6))) == [
        *(f"k.{i}" for i in range(4)),
        *(f"v.{i}" for i in range(4)),
    ]
    assert pools["ids"].shape == (6, 4) and pools["ids"].dtype == jnp.int32
    # layer 2 (window 8) reads the ids through the window-64 group that holds them
    reads = without.layers[2]
    assert (reads.mode, reads.values, reads.window) == ("bank", "ids", 8)
    assert without.pool("ids").group != without.pool("k.2").group


def test_sampled_completions_follow_the_seed_not_the_batch():
    """A seeded request samples the same tokens alone, in a busy batch, after preemption,
    and as the dense decoder's single row with that seed."""
    model = random_model("d12_bov")
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7, max_tokens=NEW)
    alone = Engine(model, tight(max_seqs=1, record_logits=False))
    [solo] = alone.generate([PROMPTS[2]], params)
    busy = Engine(model, TIGHT)
    others = SamplingParams(temperature=1.0, max_tokens=NEW, seed=1)
    results = busy.generate(PROMPTS, [params if i == 2 else others for i in range(7)])
    assert busy.scheduler.preemptions > 0
    assert results[2].token_ids == solo.token_ids
    dense = decode.generate(model, [PROMPTS[2]], NEW, temperature=1.0, top_k=20, seed=7, top_p=0.9)
    assert solo.token_ids == dense[0]
    reseeded = alone.generate([PROMPTS[2]], SamplingParams(**{**params.__dict__, "seed": 8}))
    assert reseeded[0].token_ids != solo.token_ids


def test_a_long_running_engine_compiles_a_bounded_set_of_shapes():
    """Waves of requests of random lengths: one compilation per distinct step shape, never
    one per request, and no more shapes than the engine's bound; a repeated wave compiles
    nothing."""
    model = random_model("d12_bov")
    engine = Engine(model, tight(max_seqs=4, record_logits=False))  # 3 rows pad to 4
    rng = np.random.default_rng(1)
    waves = [
        [rng.integers(1, 200, size=n).tolist() for n in rng.integers(1, 40, 12)] for _ in range(3)
    ]
    before = paged.forward_step._cache_size()
    for wave in waves:
        engine.generate(wave, SamplingParams(temperature=0.8, max_tokens=int(rng.integers(4, 20))))
    assert engine.steps > 4 * len(engine.shapes)
    assert paged.forward_step._cache_size() - before <= len(engine.shapes) <= engine.shape_bound()
    compiled = paged.forward_step._cache_size()
    engine.generate(waves[0], SamplingParams(temperature=0.8, max_tokens=12))
    assert paged.forward_step._cache_size() == compiled


def test_window_pages_are_released_while_a_long_sequence_decodes():
    engine = Engine(random_model("d12"), tight(max_seqs=1, record_logits=False))
    engine.add("long", PROMPTS[6], SamplingParams(temperature=0, max_tokens=20))
    held = []
    while engine.has_work():
        engine.step()
        held.append(engine.allocator.held("long"))
    short = max(pages for pages, _ in held)
    assert short <= engine.layout.live_pages(0, 60, 8) < 60 // 4  # window 8: a few pages
    assert max(pages for _, pages in held) == 15  # window 64: every page of 60 tokens


class CharTokenizer:
    """Characters a-z as ids 1..26; id 0 is BOS."""

    bos_id = 0

    def encode_one(self, text):
        return [ord(c) - 96 for c in text]

    def decode(self, ids):
        return "".join(chr(96 + i) if 0 < i <= 26 else "?" for i in ids if i)


def test_stop_strings_cut_the_text_and_end_the_request():
    model = random_model("d12_bov")
    engine = Engine(model, tight(max_seqs=2, record_logits=False), CharTokenizer())
    prompt = [0, *CharTokenizer().encode_one("abcdef")]
    [free] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW))
    assert len(free.text) >= 6 and free.finish_reason in ("length", "stop")
    stop = free.text[3:5]
    params = SamplingParams(temperature=0, max_tokens=NEW, stop=(stop, "never"))
    [cut] = engine.generate([prompt], params)
    assert cut.text == free.text[: free.text.index(stop)] and cut.finish_reason == "stop"
    assert len(cut.token_ids) == free.text.index(stop) + len(stop)  # a character a token


def test_text_that_may_begin_a_stop_string_is_held_back():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["world"]) == 0
    assert held_back("abc\ufffd", []) == 1
    assert held_back("ab", ["b", "abc"]) == 2


def test_an_aborted_request_frees_its_pages():
    engine = Engine(random_model("d12"), tight(max_seqs=2, record_logits=False))
    engine.add("a", PROMPTS[1], SamplingParams(max_tokens=NEW))
    engine.step()
    engine.step()
    assert sum(engine.allocator.held("a")) > 0
    engine.abort("a")
    [out] = engine.step()
    assert out.finish_reason == "abort" and not engine.has_work()
    assert engine.allocator.used_pages(0) == engine.allocator.used_pages(1) == 0


def test_a_request_aborted_while_it_waits_ends_without_failing_the_step():
    """A client that leaves before its request is admitted (it never held a page)."""
    engine = Engine(random_model("d12"), tight(max_seqs=1, record_logits=False))
    engine.add("running", PROMPTS[1], SamplingParams(max_tokens=4))
    engine.add("waiting", PROMPTS[0], SamplingParams(max_tokens=4))
    engine.step()
    assert [s.id for s in engine.scheduler.waiting] == ["waiting"]
    engine.abort("waiting")
    outputs = engine.step()
    assert [o.finish_reason for o in outputs if o.request_id == "waiting"] == ["abort"]
    while engine.has_work():
        outputs += engine.step()
    assert [o.finish_reason for o in outputs if o.finish_reason] == ["abort", "length"]


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], GREEDY, "prompt"),
        ([1, 999], GREEDY, "prompt"),
        ([1] * 60, GREEDY, "max_tokens"),
        ([1], SamplingParams(max_tokens=0), "max_tokens"),
        ([1], SamplingParams(temperature=-1), "temperature"),
        ([1], SamplingParams(top_p=0), "top_p"),
        ([1], SamplingParams(logprobs=21), "logprobs"),
        ([1], SamplingParams(stop=("x",)), "stop"),  # no tokenizer
    ],
)
def test_a_request_the_engine_cannot_serve_is_refused_naming_the_field(prompt, params, field):
    engine = Engine(random_model("d12", depth=2), EngineConfig(page_size=4, max_seqs=1))
    with pytest.raises(ValueError, match=field):
        engine.add("x", prompt, params)
    assert not engine.has_work()


def test_too_few_pages_for_one_whole_sequence_is_refused():
    with pytest.raises(ValueError, match="pages"):
        Engine(random_model("d12", depth=2), EngineConfig(page_size=4, pages=(3, 3)))


def full_logprobs(model, prompts):
    """log_softmax of the full forward's logits (n, V) over each prompt."""
    return [np.asarray(jax.nn.log_softmax(x, axis=-1)) for x in full_forward(model, prompts)]


def assert_prompt_scores_equal_the_full_forward(want, prompt, scores, k):
    """Each prompt token's logprob and top-k against the full forward's log_softmax (n, V)
    (first entry None)."""
    assert scores[0] is None and len(scores) == len(prompt)
    for j in range(1, len(prompt)):
        entry = scores[j]
        assert entry.token == prompt[j]
        np.testing.assert_allclose(entry.logprob, want[j - 1, prompt[j]], rtol=0, atol=5e-5)
        assert [t for t, _ in entry.top] == np.argsort(-want[j - 1])[:k].tolist()


@pytest.mark.parametrize("variant", ["baseline", "BoV without a V cache"])
def test_prompt_logprobs_equal_the_full_forward_across_chunks_and_preemptions(variant):
    """Scored prompts of one to five chunks, through 3 slots with too few pages (the pages run
    out and sequences are preempted), with completions of 0 (scoring only), 1 and 12 tokens:
    every prompt token's logprob and top-3 are the full forward's, the completions those of
    unscored requests."""
    preset, eliminate = VARIANTS[variant]
    model = random_model(preset)
    config = tight(eliminate_bank_v=eliminate)
    engine = Engine(model, config)
    new = [0, 1, 12, 0, 12, 1, 12]
    params = [SamplingParams(temperature=0, max_tokens=n, prompt_logprobs=3) for n in new]
    results = engine.generate(PROMPTS, params)
    assert engine.scheduler.preemptions > 0
    plain = Engine(model, config).generate(
        PROMPTS, [SamplingParams(temperature=0, max_tokens=max(n, 1)) for n in new]
    )
    full = full_logprobs(model, PROMPTS)
    for prompt, n, result, want, scores in zip(PROMPTS, new, results, plain, full, strict=True):
        assert_prompt_scores_equal_the_full_forward(scores, prompt, result.prompt_logprobs, 3)
        assert result.token_ids == want.token_ids[:n] and result.finish_reason == "length"
    assert engine.allocator.used_pages(0) == engine.allocator.used_pages(1) == 0


def test_a_sequence_preempted_while_its_prompt_is_scored_scores_each_token_once():
    model = random_model("d12_bov")
    engine = Engine(model, tight(max_seqs=2, record_logits=False))
    prompt = PROMPTS[6]  # 40 tokens: five chunks
    engine.add("scored", prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
    engine.step()
    engine.step()  # two chunks computed and scored
    (seq,) = engine.scheduler.running
    assert seq.computed == 16 and len(engine._streams["scored"].prompt_scores) == 17
    engine.scheduler._preempt([])  # the pages taken back: recomputed from position 0
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert engine.scheduler.preemptions == 1
    first = outputs[0]
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    [want] = full_logprobs(model, [prompt])
    assert_prompt_scores_equal_the_full_forward(want, prompt, first.prompt_logprobs, 2)


def test_prefix_sharing_computes_less_and_changes_nothing():
    """The contexts of multiple-choice items (a context and four continuations, as
    lm-evaluation-harness scores them) and n samples of one prompt, with and without prefix
    sharing, through 3 slots with too few pages: the same tokens, logits and prompt scores,
    fewer tokens computed, and every page back at the end."""
    model = random_model("d12_bov")
    contexts = [RNG.integers(1, 200, size=n).tolist() for n in (21, 34)]
    prompts = [c + RNG.integers(1, 200, size=m).tolist() for c in contexts for m in (1, 3, 6, 2)]
    prompts += [PROMPTS[2]] * 3
    params = [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)] * 8
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=10) for s in range(3)]
    runs = {}
    for sharing in (False, True):
        engine = Engine(model, tight(prefix_sharing=sharing))
        runs[sharing] = engine.generate(prompts, params), engine
    (plain, unshared), (shared, engine) = runs[False], runs[True]
    assert unshared.scheduler.shared_tokens == 0 < engine.scheduler.shared_tokens
    for a, b in zip(plain, shared, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), rtol=1e-5, atol=2e-5)
        if a.prompt_logprobs is not None:
            assert [e and e.token for e in a.prompt_logprobs] == [
                e and e.token for e in b.prompt_logprobs
            ]
            np.testing.assert_allclose(
                [e.logprob for e in a.prompt_logprobs[1:]],
                [e.logprob for e in b.prompt_logprobs[1:]],
                rtol=0,
                atol=5e-5,
            )
    assert engine.allocator.used_pages(0) == engine.allocator.used_pages(1) == 0


def test_a_shared_page_is_freed_by_its_last_holder():
    layout = CacheLayout.build(random_model("d12", depth=2).spec, 4)
    allocator = PageAllocator(layout, (6, 6), 8)
    assert allocator.reserve("a", 9)  # three pages in each group
    free = [allocator.free_pages(g) for g in range(2)]
    assert allocator.share("b", "a", 8)  # the two full pages: no new page taken
    assert [allocator.free_pages(g) for g in range(2)] == free
    allocator.free("a")
    assert [allocator.free_pages(g) for g in range(2)] == [f + 1 for f in free]  # a's third
    allocator.free("b")
    assert [allocator.free_pages(g) for g in range(2)] == [5, 5]
