"""Checkpoints in the workdir through an Orbax CheckpointManager.

A checkpoint `<workdir>/checkpoints/<step>/` holds the TrainState (parameters, optimizer
state, step, RNG), the data iterator's state (grain's checkpoint support, one file per
process) and the config as JSON. Saves are asynchronous and atomic: Orbax writes into a
temporary directory and renames it when complete, so a save that dies half-way never
replaces the last good checkpoint; the manager keeps the newest `checkpoint.keep`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from bov_jax.train.state import TrainState

# Keys that may differ between a run and its resumption without changing the experiment.
HARMLESS_PREFIXES = (
    "train.log_every",
    "train.eval_every",
    "train.sample_every",
    "train.sample_tokens",
    "train.stop_after_steps",
    "train.profile_",
    "train.dump_hlo",
    "train.skip_nonfinite",
    "checkpoint.",
    "data.num_workers",
)


def flatten_config(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def experiment_differences(saved: dict, current: dict) -> list[str]:
    """Config keys whose change alters the experiment, as 'key: saved -> current'."""
    a, b = flatten_config(saved), flatten_config(current)
    keys = sorted(set(a) | set(b))
    return [
        f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
        for k in keys
        if a.get(k) != b.get(k) and not k.startswith(HARMLESS_PREFIXES)
    ]


class Checkpoints:
    """Save and restore (TrainState, data iterator, config) by step."""

    def __init__(self, workdir: str | Path, keep: int, async_save: bool = True):
        self.directory = Path(workdir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: TrainState, data_iter: Any, config: dict) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=grain.checkpoint.CheckpointSave(data_iter),
                config=ocp.args.JsonSave(config),
            ),
            force=True,
        )

    def saved_config(self, step: int) -> dict:
        path = self.directory / str(step) / "config" / "metadata"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(step, path, f"config unreadable: {err}") from err

    def restore(self, step: int, target: TrainState, data_iter: Any = None) -> TrainState:
        """Restore into `target`'s structure and shardings (a concrete or abstract state).

        With `data_iter`, the iterator is also moved to the saved position, in place.
        """
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target
        )
        items = {"state": ocp.args.StandardRestore(abstract)}
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as err:  # orbax raises many types; name the step and directory
            raise CheckpointError(step, self.directory / str(step), str(err)) from err
        return restored.state

    def restore_latest(self, state: TrainState, data_iter: Any, config: dict) -> TrainState:
        """The latest checkpoint's state (and data position), or `state` if there is none.

        Stops with the list of differing keys if the checkpoint belongs to another
        experiment (model, value path, optimizer, data, horizon).
        """
        step = self.latest_step()
        if step is None:
            return state
        differences = experiment_differences(self.saved_config(step), config)
        if differences:
            raise ConfigMismatchError(
                f"{self.directory / str(step)} was written by a different experiment; "
                "differing config keys:\n  " + "\n  ".join(differences)
            )
        return self.restore(step, state, data_iter)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


class ConfigMismatchError(ValueError):
    pass


class CheckpointError(RuntimeError):
    def __init__(self, step: int, path: Path, reason: str):
        super().__init__(f"checkpoint at step {step} ({path}) cannot be restored: {reason}")
        self.step = step
