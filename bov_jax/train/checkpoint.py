"""Checkpoints in the workdir through an Orbax CheckpointManager.

A checkpoint `<workdir>/checkpoints/<step>/` holds

  state/              the TrainState: parameters, optimizer state (optax counts, Muon and
                      Adam buffers), step and RNG key; each process writes its own shards
  data/               the position of every data stream, `stream_<j>-of-<n>.json` (grain's
                      iterator state), written by the process that reads stream j
  config/             the run's config as JSON
  bov_manifest.json   size and CRC32 of the files above

Saves are asynchronous and atomic: Orbax writes `<step>.orbax-checkpoint-tmp/` and renames it
once every process has finished and process 0 has written the manifest into it, so a save
that dies half-way never replaces the last good checkpoint (the leftover temporary directory
is not a step, and the next save of that step replaces it). The newest `keep` are kept.

Saving refuses a state with a non-finite value (the step already keeps such a state out; this
is the last line of defence). A save that fails in the background (a full disk) surfaces at
the next `check_saves`, `save` or `wait` as CheckpointSaveError; the steps saved before stay.

Restoring checks the manifest first: a missing, truncated or corrupted file raises
CheckpointError naming the step and the file (`damaged`). Only such damage lets
`restore_latest(..., fallback=True)` move that step aside (`<step>.corrupt-<time>`) and resume
from the one before; nothing else moves a checkpoint. A saved state whose structure or shapes
differ from this model's (another width, depth, optimizer) is another experiment:
ConfigMismatchError listing the leaves, found from the checkpoint's metadata before Orbax reads
any array, and nothing moves. The data the checkpoint was trained on is compared by content
(the config's `data_files` fingerprints, see bov_jax/data/identity.py): changed files raise
DataChangedError naming them, and data iterator positions that do not fit the data raise
DataStateError.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from bov_jax.data.identity import as_recorded, changed_files, data_files
from bov_jax.errors import UserError
from bov_jax.train.state import TrainState, all_finite

log = logging.getLogger("bov_jax")

MANIFEST = "bov_manifest.json"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's temporary step directory (atomic rename)
# Orbax adds the commit time to this file after the manifest is written.
UNCHECKED = {MANIFEST, "_CHECKPOINT_METADATA"}
CORRUPT_MARK = ".corrupt-"  # <step>.corrupt-<time>: a damaged step moved aside

# Keys that may differ between a run and its resumption without changing the experiment:
# frequencies and budgets of logging, evaluation, sampling and saving, the device layout
# (mesh, micro-batch size: the same batch is accumulated differently) and the data loader's
# parallelism.
DATA_FILES = "data_files"  # the config entry holding the data's fingerprint
HARMLESS_PREFIXES = (
    "name",
    "train.log_every",
    "train.eval_every",
    "train.eval_tokens",
    "train.sample_every",
    "train.sample_tokens",
    "train.core_at_end",
    "train.stop_after_steps",
    "train.device_batch_size",
    "train.profile_",
    "train.dump_hlo",
    "train.skip_nonfinite",
    "train.fault_nonfinite_step",
    "mesh.",
    "model.attention_impl",
    "checkpoint.",
    "data.data_dir",  # where the data lies: its content is compared through DATA_FILES
    "data.tokenizer_dir",
    "data.cache_dir",
    DATA_FILES,
    "data.use_cache",  # the token cache or on-the-fly encoding: the same stream either way
    "data.num_workers",
    "data.read_threads",
    "data.encode_threads",
    "data.prefetch_buffer_size",
)
# Keys `checkpoint.allow_changes` may accept: they leave the saved state's shapes and the model
# as they were (horizon, batch, schedules, optimizer constants, compute dtype).
RESUMABLE_PREFIXES = ("train.", "optim.", "model.compute_dtype", "model.loss_chunk_tokens")
NOT_RESUMABLE = ("train.data_streams",)  # the saved data positions are per stream
RESUMABLE_KEYS = "train.* but train.data_streams, optim.*, model.compute_dtype, " + (
    "model.loss_chunk_tokens"
)


def resumable_change(key: str) -> bool:
    return key.startswith(RESUMABLE_PREFIXES) and not key.startswith(NOT_RESUMABLE)


class ConfigMismatchError(UserError, ValueError):
    """The workdir's checkpoint belongs to another experiment."""

    exit_status = 1


class DataChangedError(UserError, ValueError):
    """The data differs from the checkpoint's (by content); names the files."""

    exit_status = 1


class DataStateError(UserError, ValueError):
    """The checkpoint's data iterator positions do not fit the data as it is now."""

    exit_status = 1


class CheckpointSaveError(UserError, RuntimeError):
    """A save failed (in the background or at once); the steps saved before are intact."""

    exit_status = 1


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be restored: names the step and the file (or directory).

    `damaged`: its files are missing, cut short or corrupted (the manifest's check, unreadable
    files), the one case `checkpoint.fallback` may move it aside for.
    """

    exit_status = 1

    def __init__(self, step: int, path: Path | str, reason: str, damaged: bool = True):
        super().__init__(f"checkpoint at step {step}: {path}: {reason}")
        self.step, self.path, self.reason, self.damaged = step, Path(path), reason, damaged


class CheckpointFileError(OSError):
    """A file of a step that cannot be read (raised inside handlers, which know no step)."""

    def __init__(self, path: Path | str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


def flatten_config(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def same_value(a: Any, b: Any) -> bool:
    """Config equality with NaN equal to NaN (also inside lists)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same_value, a, b))
    return a == b


def allowed_changes(config: dict) -> set[str]:
    """The keys of `checkpoint.allow_changes` (comma-separated)."""
    text = config.get("checkpoint", {}).get("allow_changes", "")
    return {key.strip() for key in text.split(",") if key.strip()}


def experiment_differences(saved: dict, current: dict) -> list[str]:
    """Config keys whose change alters the experiment, as 'key: saved -> current'."""
    a, b = flatten_config(saved), flatten_config(current)
    keys = sorted(set(a) | set(b))
    return [
        f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
        for k in keys
        if not same_value(a.get(k), b.get(k)) and not k.startswith(HARMLESS_PREFIXES)
    ]


# ---------------------------------------------------------------------------------------------
# Data streams: one grain iterator state per stream, written by the process that reads it.


class StreamSet(Protocol):
    """The data streams this process reads: `iterators[j]` for its stream indices j."""

    count: int  # streams of the whole run
    iterators: dict[int, Any]  # grain DatasetIterators with get_state / set_state


def stream_file(index: int, count: int) -> str:
    return f"stream_{index}-of-{count}.json"


class DataStreamsHandler(ocp.CheckpointHandler):
    """Orbax handler for the iterator states of this process's data streams (synchronous:
    the states are taken when `save` is called, before the loop draws the next batch)."""

    def save(self, directory: epath.Path, args: DataStreamsArgs) -> None:
        for index, iterator in args.streams.iterators.items():
            path = directory / stream_file(index, args.streams.count)
            path.write_text(json.dumps(iterator.get_state()))

    def restore(self, directory: epath.Path, args: DataStreamsArgs) -> StreamSet:
        for index, iterator in args.streams.iterators.items():
            path = directory / stream_file(index, args.streams.count)
            try:
                saved = json.loads(path.read_text())
            except (OSError, ValueError) as err:
                raise CheckpointFileError(path, f"data stream state unreadable: {err}") from err
            try:
                iterator.set_state(saved)
            except (ValueError, KeyError, TypeError, IndexError) as err:
                raise DataStateError(
                    f"{path}: the saved data position does not fit the data now ({err}); the "
                    "shards changed since this checkpoint. Put the original shards back, or "
                    "start a new workdir with --config.checkpoint.init_params_from="
                    f"{Path(str(directory)).parent}"
                ) from err
        return args.streams

    def metadata(self, directory: epath.Path) -> None:
        return None


@ocp.args.register_with_handler(DataStreamsHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class DataStreamsArgs(ocp.args.CheckpointArgs):
    streams: StreamSet


# ---------------------------------------------------------------------------------------------
# Manifest: size and CRC32 of every file of a step, checked before restoring.


def file_crc32(path: Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def write_manifest(step_dir: Path) -> None:
    files = {
        str(p.relative_to(step_dir)): [p.stat().st_size, file_crc32(p)]
        for p in sorted(step_dir.rglob("*"))
        if p.is_file() and str(p.relative_to(step_dir)) not in UNCHECKED
    }
    (step_dir / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def verify_manifest(step_dir: Path, step: int) -> bool:
    """Raise CheckpointError naming the first missing, truncated or corrupted file; whether
    there was a manifest to check (a step written before manifests has none)."""
    path = step_dir / MANIFEST
    if not path.exists():
        if not step_dir.is_dir():
            raise CheckpointError(step, step_dir, "no such checkpoint directory")
        log.warning("%s has no %s: restoring it unverified", step_dir, MANIFEST)
        return False
    try:
        files = json.loads(path.read_text())["files"]
        entries = [(name, int(size), int(crc)) for name, (size, crc) in files.items()]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(step, path, f"manifest unreadable: {err}") from err
    for name, size, crc in entries:
        file = step_dir / name
        if not file.is_file():
            raise CheckpointError(step, file, "missing")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(step, file, f"truncated: {actual} bytes, {size} expected")
        if file_crc32(file) != crc:
            raise CheckpointError(step, file, "corrupted: CRC32 differs from the manifest")
    return True


def verify_everywhere(step_dir: Path, step: int) -> bool:
    """Process 0 checks the manifest (one read of the files); every process gets the verdict.
    Whether the step had a manifest to check."""
    error, verified = None, (step_dir / MANIFEST).exists()
    if jax.process_index() == 0:
        try:
            verified = verify_manifest(step_dir, step)
        except CheckpointError as err:
            error = err
    if jax.process_count() > 1:
        failed = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
        if failed and error is None:
            error = CheckpointError(step, step_dir, "verification failed on process 0")
    if error is not None:
        raise error
    return verified


def first_line(err: BaseException, limit: int = 300) -> str:
    """An exception's first line, cut to `limit` characters (Orbax and TensorStore errors carry
    whole specs: the file they name is in the first line)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def quiet_absl() -> Iterator[None]:
    """Orbax's warnings through absl off (reading the metadata of one item of a step warns
    that the step's own metadata file is not there)."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def saved_tree(step_dir: Path, item: str = "state") -> Any:
    """The tree of array metadata (shape, dtype) of a step's saved state, read without
    loading any array."""
    with quiet_absl(), ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.metadata(step_dir / item).item_metadata.tree


def shape_differences(saved: Any, wanted: Any, limit: int = 8) -> list[str]:
    """'path: saved shape -> wanted shape' for every leaf that differs or is absent (at most
    `limit`, then a count of the others)."""
    a, b = leaf_shapes(saved), leaf_shapes(wanted)
    differences = [
        f"{k}: {a.get(k, '<absent>')} -> {b.get(k, '<absent>')}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]
    if len(differences) > limit:
        differences[limit:] = [f"... and {len(differences) - limit} more"]
    return differences


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with `tree`'s shapes, dtypes and shardings (a restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


# ---------------------------------------------------------------------------------------------


finite_state = jax.jit(all_finite)


class Checkpoints:
    """Save and restore (TrainState, data streams, config) by step."""

    def __init__(self, workdir: str | Path, keep: int, async_save: bool = True):
        self.directory = Path(workdir).absolute() / "checkpoints"
        self.async_save = async_save
        self._saving: int | None = None
        self._save_started = 0.0
        # Always asynchronous underneath, so that the manifest callback runs before the
        # atomic rename; a synchronous save waits for it.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=True,
            create=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest),
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def _write_manifest(self) -> None:
        """Runs on process 0 after every process finished writing, before the rename."""
        tmp = self.directory / f"{self._saving}{TMP_SUFFIX}"
        write_manifest(tmp if tmp.is_dir() else self.step_dir(self._saving))

    def save(self, step: int, state: TrainState, streams: StreamSet, config: dict) -> None:
        """Save (asynchronously unless async_save=False); refuses a non-finite state."""
        # One save at a time (the callback knows its step), and the check runs after the last
        # one: a jitted reduction, one computation, not one small collective per leaf racing
        # the background writer (on multi-device CPU those could stall XLA's all-reduce).
        self.wait()
        if not bool(finite_state(state)):
            raise CheckpointSaveError(
                f"refusing to save step {step}: the state holds non-finite values; "
                f"the latest checkpoint ({self.latest_step()}) is kept"
            )
        self._saving, self._save_started = step, time.monotonic()
        log.info(
            "saving checkpoint %d to %s%s",
            step,
            self.step_dir(step),
            " (in the background)" if self.async_save else "",
        )
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=DataStreamsArgs(streams),
                    config=ocp.args.JsonSave(config),
                ),
                force=True,
            )
        except OSError as err:
            raise self.save_error(step, err) from err
        if not self.async_save:
            self.wait()

    def save_error(self, step: int | None, err: BaseException) -> CheckpointSaveError:
        kept = self.all_steps()
        return CheckpointSaveError(
            f"saving the checkpoint of step {step} in {self.directory} failed: {err}; "
            f"the checkpoints saved before are intact (steps {kept or 'none'})"
        )

    def check_saves(self) -> None:
        """Raise CheckpointSaveError if the last background save has failed (no waiting)."""
        if self._saving is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def saved_config(self, step: int) -> dict:
        path = self.step_dir(step) / "config" / "metadata"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(step, path, f"config unreadable: {err}") from err

    def restore(
        self, step: int, target: TrainState, streams: StreamSet | None = None, verify: bool = True
    ) -> TrainState:
        """Restore into `target`'s structure and shardings (a concrete or abstract state), so
        a checkpoint written on another mesh or device count is resharded onto this one.

        With `streams`, the data iterators are also moved to the saved positions, in place.
        """
        verified = verify_everywhere(self.step_dir(step), step) if verify else True
        return self._restore_state(step, target, streams, verified)

    def _restore_state(
        self, step: int, target: TrainState, streams: StreamSet | None, verified: bool
    ) -> TrainState:
        """restore() after the manifest's check (`verified`: there was a manifest)."""
        step_dir = self.step_dir(step)
        self.check_shapes(step, target, verified)
        items = {"state": ocp.args.StandardRestore(abstract_like(target))}
        if streams is not None:
            items["data"] = DataStreamsArgs(streams)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except CheckpointFileError as err:
            raise CheckpointError(step, err.path, err.reason) from err
        except DataStateError:
            raise
        except Exception as err:  # orbax raises many types; name the step and directory
            # Files that passed the manifest's check are intact: not a damaged checkpoint.
            reason = first_line(err) + ("" if verified else " (no manifest to check it by)")
            raise CheckpointError(step, step_dir, reason, damaged=not verified) from err
        return restored.state

    def check_shapes(self, step: int, target: TrainState, verified: bool) -> None:
        """ConfigMismatchError listing the leaves whose presence or shape differs between the
        saved state and `target` (from the saved metadata; no array is read)."""
        try:
            saved = saved_tree(self.step_dir(step))
        except Exception as err:  # noqa: BLE001 -- unreadable metadata
            path = self.step_dir(step) / "state"
            raise CheckpointError(step, path, first_line(err), damaged=not verified) from err
        differences = shape_differences(saved, target)
        if differences:
            raise ConfigMismatchError(
                f"{self.step_dir(step)} holds a state of other shapes than this model's (another "
                "experiment; nothing was moved):\n  " + "\n  ".join(differences) + "\nUse "
                "another workdir, or start one from parameters of matching shapes with "
                f"--config.checkpoint.init_params_from={self.directory.parent}"
            )

    def restore_latest(
        self, state: TrainState, streams: StreamSet, config: dict, fallback: bool = False
    ) -> TrainState:
        """The latest checkpoint's state (and data positions), or `state` if there is none.

        Stops with the list of differing keys if the checkpoint belongs to another experiment.
        A checkpoint that cannot be restored raises CheckpointError; with `fallback`, a damaged
        one (and only that) is moved aside and the previous one is tried.
        """
        steps = self.all_steps()
        moved = []
        for step in reversed(steps):
            try:
                return self._restore_checked(step, state, streams, config)
            except CheckpointError as err:
                if not err.damaged:
                    raise
                if not fallback:
                    raise CheckpointError(
                        err.step,
                        err.path,
                        f"{err.reason} (--config.checkpoint.fallback=True resumes from the "
                        "previous checkpoint instead)",
                    ) from err
                log.warning("%s; falling back to the previous checkpoint", err)
                moved.append(str(self.quarantine(step)))
        if steps:
            raise CheckpointError(
                steps[0],
                self.directory,
                f"no earlier checkpoint to fall back to; moved aside: {', '.join(moved)}",
            )
        return state

    def _restore_checked(
        self, step: int, state: TrainState, streams: StreamSet, config: dict
    ) -> TrainState:
        verified = verify_everywhere(self.step_dir(step), step)
        saved = self.saved_config(step)
        self.check_experiment(step, saved, config)
        self.check_data(step, saved, config)
        restored = self._restore_state(step, state, streams, verified)
        log.info("resumed from %s", self.step_dir(step))
        return restored

    def check_experiment(self, step: int, saved: dict, config: dict) -> None:
        """ConfigMismatchError listing the differing keys, except those of
        `checkpoint.allow_changes`, which are accepted with a warning."""
        saved_model = saved.get("model", {})
        if saved_model.get("compute_dtype") == "auto":  # written before auto was recorded resolved
            resolved = config["model"]["compute_dtype"]
            log.warning(
                "checkpoint %d recorded model.compute_dtype='auto' without what it resolved to; "
                "assuming %r, as it resolves here",
                step,
                resolved,
            )
            saved = {**saved, "model": {**saved_model, "compute_dtype": resolved}}
        allowed = allowed_changes(config)
        differences = experiment_differences(saved, config)
        keys = {d: d.split(":", 1)[0] for d in differences}
        accepted = [d for d in differences if keys[d] in allowed and resumable_change(keys[d])]
        refused = [d for d in differences if d not in accepted]
        if refused:
            unacceptable = [keys[d] for d in refused if keys[d] in allowed]
            resumable = [keys[d] for d in refused if resumable_change(keys[d])]
            remedies = [
                "Use another workdir",
                "start one from these parameters only with "
                f"--config.checkpoint.init_params_from={self.directory.parent}",
            ]
            if resumable:
                remedies.append(
                    "accept listed keys on purpose with "
                    f'--config.checkpoint.allow_changes="{",".join(resumable)}"'
                )
            note = (
                f"\ncheckpoint.allow_changes cannot accept {', '.join(unacceptable)}: only keys "
                "that leave the saved state's shapes, data positions and model as they were "
                f"({RESUMABLE_KEYS})"
                if unacceptable
                else ""
            )
            raise ConfigMismatchError(
                f"{self.step_dir(step)} was written by a different experiment (nothing was "
                "moved); differing config keys:\n  "
                + "\n  ".join(refused)
                + note
                + "\n"
                + "; ".join(remedies)
            )
        for difference in accepted:
            log.warning(
                "resuming step %d with a changed key (checkpoint.allow_changes): %s; the "
                "learning-rate and momentum schedules follow the new values from here, so the "
                "rest of the run differs from one planned this way from the start",
                step,
                difference,
            )

    def check_data(self, step: int, saved: dict, config: dict) -> None:
        """DataChangedError naming the files whose content differs from the checkpoint's."""
        if DATA_FILES not in saved or DATA_FILES not in config:
            log.warning("checkpoint %d records no data fingerprint: data not compared", step)
            return
        files = data_files(ml_collections.ConfigDict(config["data"]))
        current = as_recorded(saved[DATA_FILES], config[DATA_FILES], files)
        changes = changed_files(saved[DATA_FILES], current)
        if changes:
            raise DataChangedError(
                f"the data in {config['data']['data_dir']} is not the data of checkpoint "
                f"{self.step_dir(step)}:\n  " + "\n  ".join(changes) + "\nPut the original "
                "files back (or point --config.data.data_dir at them), or start a new workdir "
                f"with --config.checkpoint.init_params_from={self.directory.parent}"
            )

    def quarantine(self, step: int) -> Path:
        """Move a damaged step out of the manager's sight (kept for inspection); its new path."""
        bad = self.directory / f"{step}{CORRUPT_MARK}{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0:
            self.step_dir(step).rename(bad)
            log.warning("moved checkpoint %d aside to %s", step, bad)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"bov_jax quarantine {step}")
        self.manager.reload()
        return bad

    def quarantined(self) -> list[Path]:
        """The steps moved aside as damaged (`<step>.corrupt-<time>`), oldest step first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if CORRUPT_MARK in p.name]
        return sorted(found, key=lambda p: (int(p.name.split(".")[0]), p.name))

    def wait(self) -> None:
        """Wait for the save in flight; CheckpointSaveError if it failed."""
        step = self._saving
        try:
            self.manager.wait_until_finished()
        except Exception as err:  # orbax re-raises the background thread's error
            raise self.save_error(step, err) from err
        finally:
            self._saving = None
        if step is not None:
            log.info("checkpoint %d saved (%.1f s)", step, time.monotonic() - self._save_started)

    def close(self) -> None:
        """Release the manager (a failed save was already reported by `wait`)."""
        try:
            self.manager.close()
        except Exception as err:  # noqa: BLE001 -- the run already stops with its own error
            log.debug("closing the checkpoint manager: %s", err)


# ---------------------------------------------------------------------------------------------
# Parameters only (fine-tuning from another run's checkpoint).


def source_step_dir(source: str | Path) -> Path:
    """A step directory, or a workdir / checkpoints directory (its latest step)."""
    path = Path(source).absolute()
    if (path / "state").is_dir():
        return path
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit())
    if not steps:
        raise FileNotFoundError(f"checkpoint.init_params_from={source}: no checkpoint there")
    return directory / str(steps[-1])


def stored_shape(leaf: Any) -> tuple[int, ...]:
    """The shape a leaf is saved with: a typed PRNG key is saved as its key data."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
    return tuple(leaf.shape)


def leaf_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """{'params/blocks/0/...': shape} (saved dict keys are strings, ours may be ints)."""
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): stored_shape(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def parameter_differences(step_dir: Path, target_params: dict) -> list[str]:
    """'path: saved shape -> wanted shape' for every parameter that differs or is absent."""
    return shape_differences(saved_tree(step_dir)["params"], target_params, limit=10**6)


def load_parameters(source: str | Path, target_params: dict) -> dict:
    """The parameters of a checkpoint, placed like `target_params` (same tree and shapes).

    Raises ValueError listing every parameter whose presence or shape differs.
    """
    step_dir = source_step_dir(source)
    verify_everywhere(step_dir, int(step_dir.name))
    differences = parameter_differences(step_dir, target_params)
    if differences:
        raise ValueError(
            f"cannot initialise from {step_dir}: parameters differ (saved -> this model):\n  "
            + "\n  ".join(differences)
        )
    item = {"params": abstract_like(target_params)}
    with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore(
            step_dir / "state",
            args=ocp.args.PyTreeRestore(
                item=item,
                restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                partial_restore=True,
            ),
        )
    log.info("initialised the parameters from %s (optimizer, step and data start fresh)", step_dir)
    return restored["params"]
