"""MQAR accuracy of a trained run on its held-out split (bov_jax/data/mqar.py).

Accuracy is the share of answer positions (targets >= 0) whose argmax is the answer; loss is
the mean cross-entropy there, in nats. Chance is 1 / data.mqar.value_ids for a model that
knows which ids are values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bov_jax.data import mqar
from bov_jax.files import write_json_atomic

LogitsFn = Callable[[np.ndarray], np.ndarray]  # tokens (B, T) int32 -> logits (B, T, V)


def answer_sums(logits: np.ndarray, targets: np.ndarray) -> tuple[int, int, float]:
    """logits (B, T, V), targets (B, T) with -1 off the answers -> (correct, answers, nats)."""
    answers = targets >= 0
    picked = np.where(answers, targets, 0)
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    log_p = np.take_along_axis(z, picked[..., None], -1)[..., 0] - np.log(np.exp(z).sum(-1))
    correct = (logits.argmax(-1) == targets) & answers
    return int(correct.sum()), int(answers.sum()), float(-log_p[answers].sum())


def held_out_batches(mqar_cfg: Any, seq_len: int, rows: int) -> Iterator[dict[str, np.ndarray]]:
    """The held-out split once, in batches of <= `rows` examples (int32 (b, seq_len))."""
    examples = [
        mqar.make_example(mqar_cfg, seq_len, "val", 0, i) for i in range(mqar_cfg.val_examples)
    ]
    for start in range(0, len(examples), rows):
        part = examples[start : start + rows]
        yield {k: np.stack([e[k] for e in part]) for k in ("inputs", "targets")}


def evaluate(logits_fn: LogitsFn, mqar_cfg: Any, seq_len: int, rows: int = 32) -> dict[str, Any]:
    """{"accuracy", "loss", "answers", "chance"} over the held-out split."""
    correct = answers = 0
    nats = 0.0
    for batch in held_out_batches(mqar_cfg, seq_len, rows):
        c, a, n = answer_sums(logits_fn(batch["inputs"]), batch["targets"])
        correct, answers, nats = correct + c, answers + a, nats + n
    return {
        "accuracy": correct / answers,
        "loss": nats / answers,
        "answers": answers,
        "examples": mqar_cfg.val_examples,
        "chance": 1.0 / mqar_cfg.value_ids,
    }


def probe_run(workdir: str | Path, step: int | None = None) -> Path:
    """Scores a run trained with data.source="mqar"; writes WORKDIR/probes/mqar.json."""
    from bov_jax.data.config import source
    from bov_jax.errors import UserError
    from bov_jax.evals.loading import load_config, load_logits_fn

    config = load_config(workdir)
    if source(config.data) != "mqar":
        raise UserError(f"{workdir}: trained on data.source={source(config.data)!r}, not 'mqar'")
    step, _, logits_fn = load_logits_fn(workdir, step)
    result = {
        "step": step,
        "num_pairs": config.data.mqar.num_pairs,
        "model_dim": config.model.model_dim,
        "seq_len": config.model.seq_len,
        "value_path": config.model.value_path.to_dict(),
        **evaluate(logits_fn, config.data.mqar, config.model.seq_len),
    }
    path = Path(workdir) / "probes" / "mqar.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)
    return path
