"""MQAR as a data source: examples solvable by construction, disjoint seeded splits, the
trainer's config choice, and the accuracy probe on a model built to copy."""

import json

import numpy as np
import pytest

from bov_jax.data import mqar
from bov_jax.data.config import MQAR_TOKENIZER, default_data_config, validate_data_config
from bov_jax.data.pipeline import make_batch_iterator, split_documents
from bov_jax.data.tokenizer import load_tokenizer
from bov_jax.errors import DataError
from bov_jax.probes import mqar as mqar_probe


def mqar_data(**overrides):
    c = default_data_config()
    c.source = "mqar"
    c.mqar.update(overrides)
    return c


def batches(data_cfg, split="train", seq_len=64, rows=8, seed=3, count=2, **kw):
    it = make_batch_iterator(
        data_cfg, split=split, seq_len=seq_len, batch_size=rows, seed=seed, **kw
    )
    return [next(it) for _ in range(count)]


@pytest.mark.parametrize("pairs,seq_len", [(1, 4), (4, 64), (16, 64), (8, 257)])
def test_every_query_asks_a_stated_key_and_only_answers_are_targets(pairs, seq_len):
    cfg = mqar_data(num_pairs=pairs).mqar
    keys = range(cfg.first_id, cfg.first_id + cfg.key_ids)
    values = range(keys.stop, keys.stop + cfg.value_ids)
    for split in ("train", "val"):
        for index in range(20):
            ex = mqar.make_example(cfg, seq_len, split, 7, index)
            inputs, targets = ex["inputs"], ex["targets"]
            assert inputs.shape == targets.shape == (seq_len,)
            stated = {int(inputs[2 * i]): int(inputs[2 * i + 1]) for i in range(pairs)}
            assert len(stated) == pairs and len(set(stated.values())) == pairs
            assert all(k in keys and v in values for k, v in stated.items())
            answers = np.flatnonzero(targets >= 0)
            assert len(answers) == pairs  # the loss mask covers exactly the N answers
            assert answers.min() >= 2 * pairs and np.all((answers - 2 * pairs) % 2 == 0)
            assert sorted(int(inputs[p]) for p in answers) == sorted(stated)  # each key once
            for p in answers:
                assert targets[p] == stated[int(inputs[p])]
            rest = np.delete(inputs, np.concatenate([np.arange(2 * pairs), answers]))
            assert np.all(rest >= values.stop)  # fillers are neither keys nor values


def test_splits_are_disjoint_by_construction():
    cfg = mqar_data(num_pairs=2, key_ids=6, value_ids=6).mqar  # small spaces: collisions likely

    def contexts(split):
        return {tuple(mqar.make_example(cfg, 16, split, 0, i)["inputs"][:4]) for i in range(400)}

    train, val = contexts("train"), contexts("val")
    assert all(mqar.held_out(np.array(c)) for c in val)
    assert not any(mqar.held_out(np.array(c)) for c in train)
    assert train.isdisjoint(val) and len(val) > 50


def test_fixed_seeds_give_identical_data_and_val_ignores_the_seed():
    cfg = mqar_data(num_pairs=4)
    a, b, c = (batches(cfg, seed=s) for s in (3, 3, 4))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["targets"], y["targets"])
    assert not np.array_equal(a[0]["inputs"], c[0]["inputs"])
    v3, v4 = batches(cfg, "val", seed=3), batches(cfg, "val", seed=4)
    np.testing.assert_array_equal(v3[1]["inputs"], v4[1]["inputs"])


def test_processes_share_the_stream_and_the_iterator_resumes():
    cfg = mqar_data(num_pairs=4)
    whole = batches(cfg, rows=2, count=2)
    halves = [batches(cfg, rows=1, count=2, process_index=p, process_count=2) for p in (0, 1)]
    np.testing.assert_array_equal(whole[0]["inputs"][0], halves[0][0]["inputs"][0])
    np.testing.assert_array_equal(whole[0]["inputs"][1], halves[1][0]["inputs"][0])
    it = make_batch_iterator(cfg, split="train", seq_len=32, batch_size=2, seed=0)
    next(it)
    state = it.get_state()
    expected = next(it)
    again = make_batch_iterator(cfg, split="train", seq_len=32, batch_size=2, seed=0)
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["inputs"], expected["inputs"])


def test_the_val_split_repeats_its_examples():
    cfg = mqar_data(num_pairs=2, val_examples=4)
    first, second = batches(cfg, "val", seq_len=16, rows=4)
    np.testing.assert_array_equal(first["inputs"], second["inputs"])
    assert len(list(split_documents(cfg, "val", None))) == 4


def test_config_choice_validates_and_loads_the_committed_byte_tokenizer():
    cfg = mqar_data(num_pairs=8)
    validate_data_config(cfg, vocab_size=257, seq_len=64)
    assert (MQAR_TOKENIZER / "tokenizer.pkl").read_bytes() == mqar.byte_tokenizer()
    assert load_tokenizer(MQAR_TOKENIZER, 257).bos_id == 256
    for overrides, seq_len, word in [
        ({"num_pairs": 17}, 64, "num_pairs"),
        ({"key_ids": 300}, 64, "vocab_size"),
        ({"power_a": 0.0}, 64, "power_a"),
        ({"num_pairs": 0}, 64, "num_pairs"),
    ]:
        with pytest.raises(DataError, match=word):
            validate_data_config(mqar_data(**overrides), vocab_size=257, seq_len=seq_len)
    bad = mqar_data()
    bad.source = "mqaar"
    with pytest.raises(DataError, match="data.source"):
        validate_data_config(bad, vocab_size=257, seq_len=64)


def copying_logits(vocab: int):
    """A model built to copy: at each position, the token that followed the current token's
    first earlier occurrence (uniform where it has none)."""

    def logits_fn(tokens: np.ndarray) -> np.ndarray:
        out = np.zeros((*tokens.shape, vocab), np.float32)
        for b, row in enumerate(tokens):
            seen: dict[int, int] = {}
            for t, tok in enumerate(row):
                if int(tok) in seen:
                    out[b, t, row[seen[int(tok)] + 1]] = 10.0
                elif t + 1 < len(row):
                    seen[int(tok)] = t
        return out

    return logits_fn


def test_a_model_built_to_copy_scores_above_chance_and_a_blind_one_does_not():
    cfg = mqar_data(num_pairs=8, val_examples=24).mqar
    copy = mqar_probe.evaluate(copying_logits(257), cfg, 64, rows=8)
    assert copy["answers"] == 24 * 8 and copy["accuracy"] > 0.9 > 20 * copy["chance"]
    blind = mqar_probe.evaluate(lambda x: np.zeros((*x.shape, 257), np.float32), cfg, 64)
    assert blind["accuracy"] < 0.05
    assert blind["loss"] == pytest.approx(np.log(257), rel=1e-6)


def test_sweep_report_pairs_each_value_path_with_its_baseline_by_seed(tmp_path):
    from bov_jax.probes import mqar_sweep

    accuracies = {"baseline": [0.2, 0.4, 0.9], "bov": [0.5, 0.6, 0.9]}
    for path, values in accuracies.items():
        for seed, accuracy in enumerate(values):
            workdir = tmp_path / f"{path}_d64_n8" / f"seed{seed}"
            (workdir / "probes").mkdir(parents=True)
            (workdir / "status.json").write_text('{"step": 4, "num_steps": 4}')
            result = {"model_dim": 64, "num_pairs": 8, "accuracy": accuracy, "chance": 0.01}
            (workdir / "probes" / "mqar.json").write_text(json.dumps(result))
    unfinished = tmp_path / "bov_d64_n8" / "seed3"
    unfinished.mkdir()
    (unfinished / "status.json").write_text('{"step": 2, "num_steps": 4}')
    written = mqar_sweep.report([str(tmp_path)], tmp_path / "out")
    table = written[0].read_text()
    assert "| 8 | 64 | baseline | 0.500 ± 0.361 (n=3) | - |" in table
    # differences 0.3, 0.2, 0.0: mean 0.167, t(0.975, 2) = 4.303
    assert "| 8 | 64 | bov | 0.667 ± 0.208 (n=3) | +0.167 [-0.213, +0.546] (n=3) |" in table
    assert written[2].read_bytes()[:4] == b"\x89PNG"
