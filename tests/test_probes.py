"""The language-model probes: loss by position, induction, passkey through the engine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import randomize, tiny_model

from bov_jax.data.config import MQAR_TOKENIZER
from bov_jax.data.tokenizer import load_tokenizer
from bov_jax.inference.engine import Engine, EngineConfig
from bov_jax.probes import induction, passkey, positions
from bov_jax.probes.model_fns import token_fn


@pytest.fixture(scope="module")
def model():
    m = tiny_model("d12_bov", depth=2, vocab_size=257, seq_len=160)
    randomize(m, seed=5)  # live output projections
    return m


def test_loss_by_position_averages_to_the_plain_loss(model):
    rows = np.random.default_rng(0).integers(0, 257, size=(5, 65)).astype(np.int32)
    losses = positions.loss_by_position(token_fn(model), rows, batch=2)
    assert losses.shape == (5, 64)
    plain = float(model.loss(jnp.asarray(rows[:, :-1]), jnp.asarray(rows[:, 1:])))
    s = positions.summary(losses, bins=4)
    assert s["mean"] == pytest.approx(plain, rel=1e-5)
    assert np.mean(s["by_position"]) == pytest.approx(plain, rel=1e-5)
    assert [b["first"] for b in s["bins"]] == [0, 16, 32, 48]


def test_induction_repeats_the_span_and_scores_only_its_copyable_tokens():
    rng = np.random.default_rng(1)
    ids = np.arange(3, 10**6)  # no id repeats by chance: only the span's copy does
    inputs, targets = induction.induction_batch(rng, ids, 256, 8, 40, rows=4)
    assert inputs.shape == (4, 48) and np.all(inputs[:, 0] == 256)
    np.testing.assert_array_equal(inputs[:, 41:48], inputs[:, 1:8])
    scored = targets >= 0
    assert scored.sum(axis=1).tolist() == [7] * 4
    np.testing.assert_array_equal(targets[scored].reshape(4, 7), inputs[:, 2:9][:, :7])

    def copy_fn(x, y):  # a model built to copy: the token after the last earlier occurrence
        out = np.zeros_like(x)
        for b, row in enumerate(x):
            for t, tok in enumerate(row):
                earlier = np.flatnonzero(row[:t] == tok)
                out[b, t] = row[earlier[-1] + 1] if len(earlier) else 0
        return np.zeros(x.shape, np.float32), out

    assert induction.score(copy_fn, inputs, targets)["accuracy"] == 1.0
    with pytest.raises(ValueError, match="span"):
        induction.induction_batch(rng, ids, 256, 9, 8, rows=1)


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_prompt_puts_the_key_at_the_requested_depth(depth):
    tok = load_tokenizer(MQAR_TOKENIZER)
    ids, at = passkey.passkey_prompt(tok, 200, depth, 31337)
    needle = tok.encode_one(passkey.NEEDLE.format(key=31337))
    question = tok.encode_one(passkey.QUESTION)
    room = 200 - 1 - len(needle) - len(question)
    assert len(ids) == 200 and ids[0] == tok.bos_id
    assert at == 1 + round(depth * room) and ids[at : at + len(needle)] == needle
    assert ids[-len(question) :] == question


def test_passkey_read_back_through_the_engine_is_the_full_forward_argmax(model):
    tok = load_tokenizer(MQAR_TOKENIZER)
    prompts = [passkey.passkey_prompt(tok, 150, d, 4242)[0] for d in (0.2, 0.8)]
    engine = Engine(model, EngineConfig(page_size=16, max_seqs=2), tok)
    got = passkey.read_back(engine, prompts, max_tokens=5)
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))  # causal: padding is harmless
    for prompt, completion in zip(prompts, got, strict=True):
        ids = list(prompt)
        for _ in range(5):
            padded = np.zeros((1, 160), np.int32)
            padded[0, : len(ids)] = ids
            ids.append(int(np.asarray(forward(params, padded))[0, len(ids) - 1].argmax()))
        assert completion == ids[len(prompt) :]


def fake_lm_result(seed: int, shift: float) -> dict:
    """An lm probe result of two positions, one induction cell and one passkey context."""
    return {
        "name": "fake",
        "step": 10,
        "seed": seed,
        "seq_len": 4,
        "value_path": {},
        "positions": {
            "mean": 2.0 + seed + shift,
            "by_position": [2.0 + seed + shift] * 4,
            "bins": [{"first": 0, "last": 3, "loss": 2.0 + seed + shift}],
        },
        "induction": [
            {"span": 2, "distance": 2, "accuracy": 0.1 * seed + shift, "loss": 1.0, "tokens": 1}
        ],
        "passkey": [
            {"context": 64, "depth": 0.0, "accuracy": shift},
            {"context": 64, "depth": 1.0, "accuracy": 0.0},
        ],
    }


def test_the_lm_sweep_report_pairs_each_seed_with_the_baseline_and_probes_no_job_twice(
    tmp_path, monkeypatch
):
    import json

    from bov_jax.probes import lm_sweep

    for run, shift in (("d12", 0.0), ("d12_bov", 0.25)):
        for seed in range(3):
            job = tmp_path / "root" / run / f"seed{seed}"
            (job / "probes").mkdir(parents=True)
            (job / "status.json").write_text(json.dumps({"step": 10, "num_steps": 10}))
            (job / "probes" / "lm_step10.json").write_text(json.dumps(fake_lm_result(seed, shift)))
    unfinished = tmp_path / "root" / "d12_bov" / "seed3"
    unfinished.mkdir()
    (unfinished / "status.json").write_text(json.dumps({"step": 5, "num_steps": 10}))

    def no_probe(*args):
        raise AssertionError(f"probed {args[0]} again")

    monkeypatch.setattr(lm_sweep, "probe_run", no_probe)
    written = lm_sweep.report(tmp_path / "root", tmp_path / "out", "d12", 1, 1, 1)
    assert [p.name for p in written] == ["lm_probes.md", "lm_probes.json", "lm_probes.png"]
    assert all(p.stat().st_size > 0 for p in written)
    sections = {
        part.splitlines()[0]: {line.split(" | ")[0]: line for line in part.splitlines()}
        for part in written[0].read_text().split("\n## ")[1:]
    }
    rows = {**sections["induction accuracy"], **sections["loss by position (nats)"]}
    rows.update(sections["passkey accuracy"])
    # every seed differs from its baseline by exactly +0.25: a zero-width interval, n = 3
    assert rows["| every position"].endswith(
        "| 3.000 ± 1.000 (n=3) | 3.250 ± 1.000 (n=3) | +0.250 [+0.250, +0.250] (n=3) |"
    )
    assert "+0.250 [+0.250, +0.250] (n=3)" in rows["| span 2, distance 2"]
    assert rows["| context 64, every depth"].endswith("| +0.125 [+0.125, +0.125] (n=3) |")
    assert set(json.loads(written[1].read_text())["runs"]["d12_bov"]) == {"0", "1", "2"}
