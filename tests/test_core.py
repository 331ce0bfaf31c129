"""CORE harness: prompt rendering, spans, scoring and aggregation on a hand-made 3-task bundle.

The fake tokenizer maps each character to its code point (BOS = 511), so a token's byte length
differs from 1 for non-ASCII characters. The fake model is a peaked bigram table: after character
c it puts logit S on NEXT(c) (the next code point unless overridden) and 0 elsewhere, so a token
costs EPS nats when it follows that chain and WRONG nats otherwise.
"""

import json
import logging
import math
import random
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from bov_jax.errors import UserError
from bov_jax.evals import core, tasks

BUNDLE = Path(__file__).parent / "data" / "core" / "bundle"
V = 512
BOS = 511
S = 10.0
EPS = math.log(1 + (V - 1) * math.exp(-S))
WRONG = math.log(math.exp(S) + V - 1)
OVERRIDES = {" ": "a", ":": " ", "x": " "}


class CharTokenizer:
    bos_id = BOS
    vocab_size = V

    def encode_one(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids if i != BOS)


def _bigram_table() -> np.ndarray:
    table = np.zeros((V, V), np.float32)
    for i in range(V - 1):
        table[i, ord(OVERRIDES.get(chr(i), chr(i + 1)))] = S
    return table


TABLE = _bigram_table()


def bigram_logits(tokens: np.ndarray) -> np.ndarray:
    assert tokens.dtype == np.int32 and tokens.ndim == 2
    return TABLE[tokens]


TOK = CharTokenizer()
COPA = tasks.TASKS_BY_LABEL["copa"]
WINOGRAD = tasks.TASKS_BY_LABEL["winograd"]
LAMBADA = tasks.TASKS_BY_LABEL["lambada_openai"]


# --- task table ---------------------------------------------------------------------------------


def test_task_table_matches_spec():
    assert len(tasks.CORE_TASKS) == 21
    assert "hellaswag_zeroshot" not in tasks.TASKS_BY_LABEL
    arc = tasks.TASKS_BY_LABEL["arc_easy"]
    assert (arc.num_fewshot, arc.delimiter, arc.random_baseline) == (25, "\nAnswer: ", 25.0)
    assert tasks.TASKS_BY_LABEL["winogrande"].num_fewshot == 5
    assert tasks.TASKS_BY_LABEL["boolq"].random_baseline == 62.0
    assert tasks.TASKS_BY_LABEL["bigbench_language_identification"].random_baseline == 9.1
    types_ = {t.task_type for t in tasks.CORE_TASKS}
    assert types_ == {"multiple_choice", "schema", "language_modeling"}


# --- rendering ----------------------------------------------------------------------------------


def test_render_mc_with_fewshot():
    shots = [
        {"query": "Q: 1+1?", "choices": ["2", "3"], "gold": 0},
        {"query": "Q: 3+3?", "choices": ["5", "6"], "gold": 1},
    ]
    item = {"query": "Q: 2+2?", "choices": ["4", "5"], "gold": 0}
    assert core.render_prompts_mc(item, "\nAnswer: ", shots) == [
        "Q: 1+1?\nAnswer: 2\n\nQ: 3+3?\nAnswer: 6\n\nQ: 2+2?\nAnswer: 4",
        "Q: 1+1?\nAnswer: 2\n\nQ: 3+3?\nAnswer: 6\n\nQ: 2+2?\nAnswer: 5",
    ]
    assert core.render_prompts_mc(item, " ") == ["Q: 2+2? 4", "Q: 2+2? 5"]


def test_render_schema_with_fewshot():
    shot = {
        "context_options": ["Ann ran, so Ann", "Ann ran, so Bob"],
        "continuation": "won.",
        "gold": 1,
    }
    item = {"context_options": ["It rained, so Ann", "It rained, so Bob"], "continuation": "hid."}
    assert core.render_prompts_schema(item, " ", [shot]) == [
        "Ann ran, so Bob won.\n\nIt rained, so Ann hid.",
        "Ann ran, so Bob won.\n\nIt rained, so Bob hid.",
    ]


def test_render_lm_trims_contexts_and_strips_prompt_without():
    shot = {"context": "The capital of Italy is\n", "continuation": "Rome"}
    item = {"context": "  The capital of France is ", "continuation": "Paris"}
    assert core.render_prompts_lm(item, " ", [shot]) == [
        "The capital of Italy is Rome\n\nThe capital of France is",
        "The capital of Italy is Rome\n\nThe capital of France is Paris",
    ]
    assert core.render_prompts_lm(item, "\nAnswer: ") == [
        "The capital of France is\nAnswer:",
        "The capital of France is\nAnswer: Paris",
    ]


def test_sample_fewshot():
    assert core.sample_fewshot(0, 5, 2) == [4, 1]  # Random(1234).sample([1, 2, 3, 4], 2)
    assert core.sample_fewshot(3, 6, 3) == [1, 4, 5]  # Random(1237).sample([0, 1, 2, 4, 5], 3)
    for idx in range(6):
        shots = core.sample_fewshot(idx, 6, 4)
        assert idx not in shots and len(set(shots)) == 4
    assert core.sample_fewshot(1, 6, 0) == []
    assert sorted(core.sample_fewshot(0, 3, 10)) == [1, 2]  # clamped to the other examples


# --- tokenisation and spans ---------------------------------------------------------------------


def test_common_prefix_and_suffix():
    assert core.common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert core.common_prefix_length([[1, 2], [1, 2]]) == 2
    assert core.common_suffix_length([[9, 1, 2], [8, 1, 2], [1, 2]]) == 2
    assert core.common_suffix_length([[1, 2], [1, 3]]) == 0


def test_tokenize_example_spans():
    rows, starts, ends = core.tokenize_example("multiple_choice", ["q a", "q bc"], TOK)
    assert rows == [[BOS, *b"q a"], [BOS, *b"q bc"]]
    assert (starts, ends) == ([3, 3], [4, 5])
    rows, starts, ends = core.tokenize_example("schema", ["x is", "yz is"], TOK)
    assert (starts, ends) == ([2, 3], [5, 6])
    rows, starts, ends = core.tokenize_example("language_modeling", ["ab:", "ab: c"], TOK)
    assert rows == [[BOS, *b"ab: c"]]
    assert (starts, ends) == ([4], [6])


def test_lm_prompt_must_be_a_token_prefix():
    class LengthTokenizer(CharTokenizer):
        def encode_one(self, text):
            return [len(text)]

    with pytest.raises(ValueError, match="prefix"):
        core.tokenize_example("language_modeling", ["ab:", "ab: c"], LengthTokenizer())


def test_stack_rows_pads_right_with_bos():
    ids = core.stack_rows([[BOS, 1, 2], [BOS, 3]], BOS, pad_multiple=4)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, [[BOS, 1, 2, BOS], [BOS, 3, BOS, BOS]])
    assert core.stack_rows([[BOS, 1, 2]], BOS).shape == (1, 3)


def test_span_nats_matches_hand_computation():
    ids = np.array([BOS, ord(" "), ord("a"), ord("c")], np.int32)  # ' '->a follows, a->c does not
    logits = bigram_logits(ids[None])[0]
    assert core.span_nats(logits[1:3], ids[2:4]) == pytest.approx(EPS + WRONG)
    assert core.span_nats(logits[3:3], ids[4:4]) == 0.0


# --- scoring ------------------------------------------------------------------------------------


def _data(task):
    return core.load_task_data(BUNDLE, task)


def test_mc_scores_are_byte_normalised():
    data = [{"query": "q2", "choices": ["bcdefghi", "éêëìíî"], "gold": 1}]
    # "bcdefghi": (WRONG + 7 EPS) / 8 bytes; "éêëìíî": (WRONG + 5 EPS) / 12 bytes -> choice 1.
    # A per-token mean would pick choice 0: (WRONG + 5 EPS) / 6 tokens is the larger one.
    assert (WRONG + 5 * EPS) / 12 < (WRONG + 7 * EPS) / 8 < (WRONG + 5 * EPS) / 6
    assert core.evaluate_example(0, data, COPA, TOK, bigram_logits)


def test_per_task_accuracies():
    # copa: q1 right (EPS vs WRONG), q2 right (bytes), q3 wrong, q4 tie -> first -> wrong, q5 right.
    assert core.evaluate_task(_data(COPA), COPA, TOK, bigram_logits) == pytest.approx(3 / 5)
    # winograd: only the option ending in 'x' predicts the delimiter; the second item's gold is 1.
    assert core.evaluate_task(_data(WINOGRAD), WINOGRAD, TOK, bigram_logits) == pytest.approx(2 / 3)
    # lambada: ':' -> ' ' -> 'a' -> 'b' -> 'c' chains; "ba" and a context ending in 'k' fail.
    assert core.evaluate_task(_data(LAMBADA), LAMBADA, TOK, bigram_logits) == pytest.approx(1 / 2)


def test_fewshot_and_padding_do_not_change_results():
    lm_fewshot = tasks.CoreTask("toy", LAMBADA.dataset_uri, "language_modeling", 2, " ", 0.0, 4)
    assert core.evaluate_task(_data(LAMBADA), lm_fewshot, TOK, bigram_logits, 64) == 0.5
    mc_fewshot = tasks.CoreTask("toy", COPA.dataset_uri, "multiple_choice", 3, " ", 50.0, 5)
    assert core.evaluate_task(_data(COPA), mc_fewshot, TOK, bigram_logits, 7) == pytest.approx(0.6)


def test_one_padded_batch_per_example():
    calls = []

    def recording(tokens):
        calls.append(tokens.copy())
        return bigram_logits(tokens)

    data = [{"query": "q", "choices": ["ab", "abcd", "z"], "gold": 1}]
    core.evaluate_example(0, data, COPA, TOK, recording, pad_multiple=8)
    (batch,) = calls
    assert batch.shape == (3, 8)
    np.testing.assert_array_equal(batch[:, 0], BOS)
    np.testing.assert_array_equal(batch[0], [BOS, *b"q ab", BOS, BOS, BOS])


def test_centered_accuracy():
    assert tasks.centered_accuracy(0.6, 50.0) == pytest.approx(0.2)
    assert tasks.centered_accuracy(0.25, 25.0) == pytest.approx(0.0)
    assert tasks.centered_accuracy(0.5, 0.0) == pytest.approx(0.5)


def test_evaluate_core_on_three_task_bundle():
    res = core.evaluate_core(BUNDLE, TOK, bigram_logits, pad_multiple=16)
    assert res["results"] == pytest.approx({"copa": 0.6, "lambada_openai": 0.5, "winograd": 2 / 3})
    assert res["centered_results"] == pytest.approx(
        {"copa": 0.2, "lambada_openai": 0.5, "winograd": 1 / 3}
    )
    assert res["core_metric"] == pytest.approx((0.2 + 0.5 + 1 / 3) / 3)
    assert res["num_examples"] == {"copa": 5, "lambada_openai": 4, "winograd": 3}
    assert (res["num_tasks"], res["num_tasks_total"]) == (3, 21)
    assert len(res["missing_tasks"]) == 18 and "winograd" not in res["missing_tasks"]

    table = core.format_core_table(res)
    assert "CORE 0.3444 (mean centered accuracy over 3 of 21 tasks; missing: jeopardy," in table
    assert "copa" in table and "0.6000" in table and "0.2000" in table


def test_evaluate_core_task_subset_and_truncation():
    res = core.evaluate_core(
        BUNDLE, TOK, bigram_logits, max_per_task=2, tasks=["lambada_openai", "squad"]
    )
    correct = [True, True, False, False]  # file order of lambada_openai.jsonl
    order = list(range(4))
    random.Random(1337).shuffle(order)
    assert res["results"]["lambada_openai"] == np.mean([correct[i] for i in order[:2]])
    assert res["missing_tasks"] == ["squad"]
    assert (res["num_tasks"], res["num_tasks_total"]) == (1, 2)
    with pytest.raises(ValueError, match="unknown CORE tasks"):
        core.evaluate_core(BUNDLE, TOK, bigram_logits, tasks=["nope"])


def test_cli_main(monkeypatch, capsys, caplog, tmp_path, command_flags):
    loading = types.ModuleType("bov_jax.evals.loading")
    loading.load_logits_fn = lambda workdir, step: (7, TOK, bigram_logits)
    loading.load_config = lambda workdir: None  # evals.core checks the workdir first
    monkeypatch.setitem(sys.modules, "bov_jax.evals.loading", loading)
    out = tmp_path / "core.json"
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="bov_jax.evals.core"):
        command_flags(
            core.define_flags, f"--workdir={run}", f"--bundle-dir={BUNDLE}", f"--output={out}"
        )
        core.main(["core"])
    assert "CORE 0.3444" in capsys.readouterr().out
    assert '"core_metric"' in out.read_text()
    saved = json.loads((run / "evals" / "core_step7.json").read_text())
    assert saved["step"] == 7 and saved["max_per_task"] == -1
    assert saved["core_metric"] == pytest.approx((0.2 + 0.5 + 1 / 3) / 3)
    assert saved["centered_results"]["copa"] == pytest.approx(0.2)
    assert "CORE examples: 12/12 (100%)" in caplog.text and "ETA" in caplog.text
    assert "copa (0-shot" in caplog.text  # per-task lines reach the package logger
    with pytest.raises(UserError, match="no CORE bundle at .*; build one with"):
        command_flags(core.define_flags, "--workdir=unused", f"--bundle-dir={tmp_path / 'none'}")
        core.main(["core"])


def test_evaluate_into_workdir_skips_without_a_bundle(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="bov_jax.evals.core"):
        path = core.evaluate_into_workdir(tmp_path, 3, TOK, bigram_logits, 4, tmp_path / "none")
    assert path is None and not (tmp_path / "evals").exists()
    assert caplog.text.count("CORE skipped: no eval bundle") == 1


def test_jax_logits_fn():
    import jax.numpy as jnp

    table = jnp.asarray(TABLE)
    acc = core.evaluate_task(_data(COPA), COPA, TOK, lambda t: table[t], pad_multiple=8)
    assert acc == pytest.approx(0.6)
