"""The language-model probes of one trained run: loss by position, induction and passkey,
written to WORKDIR/probes/lm_step<N>.json (see positions.py, induction.py, passkey.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bov_jax.files import write_json_atomic
from bov_jax.probes import induction, passkey, positions
from bov_jax.probes.model_fns import token_fn

SPANS = (8, 32)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
READ_BACK_ROOM = 16  # positions left after the longest passkey prompt


def distances(seq_len: int) -> tuple[int, ...]:
    """Powers of two from 16 up to the longest that fits a span of 8 in the context."""
    return tuple(d for d in (2**k for k in range(4, 20)) if d + SPANS[0] <= seq_len)


def contexts(seq_len: int) -> tuple[int, ...]:
    """Passkey prompt lengths: quarters of the context, the last one leaving room for the
    key's read-back."""
    return tuple(sorted({max(64, (seq_len - READ_BACK_ROOM) * q // 4) for q in (1, 2, 3, 4)}))


def probe_run(
    workdir: str | Path, step: int | None, documents: int, rows: int, trials: int
) -> Path:
    """Runs the three probes on a run's checkpoint; returns the JSON's path."""
    from bov_jax.evals.loading import load_checkpoint
    from bov_jax.inference.engine import Engine, EngineConfig

    step, model, tokenizer, config = load_checkpoint(workdir, step)
    fn = token_fn(model)
    seq_len = config.model.seq_len
    docs = np.stack(list(positions.long_documents(config, tokenizer, documents)))
    text_ids = np.flatnonzero(tokenizer.token_bytes() > 0)
    engine = Engine(model, EngineConfig(max_seqs=trials, max_context=seq_len), tokenizer)
    result: dict[str, Any] = {
        "name": config.name,
        "step": step,
        "seed": config.seed,
        "seq_len": seq_len,
        "value_path": config.model.value_path.to_dict(),
        "positions": positions.summary(positions.loss_by_position(fn, docs)),
        "induction": induction.probe(
            fn, text_ids, tokenizer.bos_id, seq_len, SPANS, distances(seq_len), rows
        ),
        "passkey": passkey.grid(engine, tokenizer, contexts(seq_len), DEPTHS, trials),
    }
    path = Path(workdir) / "probes" / f"lm_step{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)
    return path
