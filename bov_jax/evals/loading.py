"""Load a trained model, its config and tokenizer from a workdir (evaluation and sampling).

The workdir's config.json rebuilds the model; the latest checkpoint (or `step`) supplies the
parameters, restored on a single-process mesh of the local devices.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from bov_jax import sharding
from bov_jax.accounting import training_plan
from bov_jax.config import config_from_record
from bov_jax.data.config import tokenizer_path
from bov_jax.data.tokenizer import Tokenizer, load_tokenizer
from bov_jax.errors import ConfigError
from bov_jax.model.gpt import GPT
from bov_jax.train.checkpoint import Checkpoints
from bov_jax.train.state import create_train_state


def load_config(workdir: str | Path) -> ml_collections.ConfigDict:
    path = Path(workdir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {workdir} a bov_jax workdir?")
    try:
        record = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{path} is not the JSON a run writes ({err}); is it damaged?") from err
    if not isinstance(record, dict):
        raise ConfigError(f"{path} holds a {type(record).__name__}, not a run's config")
    return config_from_record(record)


def load_model_and_tokenizer(
    workdir: str | Path, step: int | None = None
) -> tuple[GPT, Tokenizer, ml_collections.ConfigDict]:
    """(model with the checkpoint's parameters, tokenizer, config)."""
    _, model, tokenizer, config = load_checkpoint(workdir, step)
    return model, tokenizer, config


def load_checkpoint(
    workdir: str | Path, step: int | None = None
) -> tuple[int, GPT, Tokenizer, ml_collections.ConfigDict]:
    """(step restored, model with its parameters, tokenizer, config); the latest step if None."""
    config = load_config(workdir)
    with config.unlocked():
        config.mesh.update(data=-1, fsdp=1, tensor=1)
    mesh = sharding.make_mesh(config.mesh)
    graphdef, state, _, _ = create_train_state(config, training_plan(config), mesh)
    checkpoints = Checkpoints(workdir, keep=10**6, async_save=False)
    try:
        step = checkpoints.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{workdir} holds no checkpoint")
        state = checkpoints.restore(step, state)
    finally:
        checkpoints.close()
    tokenizer = load_tokenizer(tokenizer_path(config.data), config.model.vocab_size)
    return step, nnx.merge(graphdef, state.params), tokenizer, config


def load_logits_fn(workdir: str | Path, step: int | None = None) -> tuple[int, Tokenizer, Any]:
    """(step, tokenizer, logits_fn) where logits_fn(tokens (B, T) int32) -> (B, T, V) float32."""
    step, model, tokenizer, _ = load_checkpoint(workdir, step)
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, tokens: nnx.merge(graphdef, p)(tokens))
    return step, tokenizer, lambda tokens: np.asarray(forward(params, tokens))
