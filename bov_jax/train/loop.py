"""The training loop: config -> mesh -> state -> steps -> metrics and checkpoints.

Read top to bottom: `run` validates everything, builds the mesh, state and data, restores
the latest checkpoint if the workdir has one (or takes the parameters of another run's
checkpoint, `checkpoint.init_params_from`), and hands over to `Trainer.train`. Evaluation runs
at step 0, every `train.eval_every` steps and at the end (val BPB on a fixed token budget from
a fresh validation iterator, as the reference does, on the same tokens whatever the device
layout); checkpoints at `checkpoint.save_every`, at the end, when `train.stop_after_steps` is
reached and on SIGTERM/SIGINT.

A resumed run is the same run: the checkpoint restores parameters, optimizer state, step, RNG
and the position of every data stream, and metrics.jsonl is cut back to the restored step so
that every step appears once. A step with a non-finite loss, gradient or update leaves the
state unchanged; the run stops there without saving (the last good checkpoint stays the
latest) unless `train.skip_nonfinite`, which draws the next batch instead. The host checks a
step (finiteness, loss) only once the next one is queued on the device, so the device does not
wait on the host between steps. A checkpoint save
that fails in the background (a full disk) stops the run after the step during which it is
noticed. The config recorded in config.json and in every checkpoint holds the `auto` choices
as resolved on this machine and the data's fingerprint (`data_files`), so a resumption
compares what actually ran.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import signal
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from bov_jax import sharding
from bov_jax.accounting import TrainingPlan, evaluation_cost, training_plan
from bov_jax.config import config_errors, validate_config
from bov_jax.data.config import tokenizer_path, validate_data_config
from bov_jax.data.identity import data_fingerprint
from bov_jax.data.pipeline import make_batch_iterator, val_batches
from bov_jax.data.token_cache import ensure_cache
from bov_jax.data.tokenizer import Tokenizer, load_tokenizer
from bov_jax.data.unigram import unigram_bpb
from bov_jax.errors import ConfigError, UserError
from bov_jax.evals.bpb import bits_per_byte
from bov_jax.files import check_writable, write_json_atomic, write_text_atomic
from bov_jax.model.gpt import learned_coefficients
from bov_jax.model.spec import resolve_auto
from bov_jax.train import device_rows, fsdp, run_record, schedules, workdir_lock
from bov_jax.train.checkpoint import DATA_FILES, Checkpoints, abstract_like, load_parameters
from bov_jax.train.layout import BatchLayout
from bov_jax.train.metrics import MetricsWriter, Throughput, log_line
from bov_jax.train.state import TrainState, create_train_state
from bov_jax.train.step import abstract_batch, make_eval_step, make_train_step, on_mesh

log = logging.getLogger("bov_jax")

MAX_SKIPPED_IN_A_ROW = 16  # train.skip_nonfinite gives up after this many bad batches


class NonFiniteLossError(UserError, RuntimeError):
    """A step's loss, gradient or update was not finite (and skipping was not allowed or
    gave up)."""

    exit_status = 1


def nonfinite_problem(step: int, out: dict) -> str:
    return (
        f"non-finite loss, gradient or update at step {step} "
        f"(loss {float(out['loss'])}, gradient norm {float(out['grad_norm'])})"
    )


def ensure_writable(workdir: Path) -> None:
    """Create `workdir` and check that a file can be written there, before anything runs."""
    try:
        check_writable(workdir)
    except OSError as err:
        raise UserError(
            f"workdir {workdir} is not writable ({err.strerror}); pass a writable --workdir"
        ) from err


class NoUsableCheckpointError(UserError, RuntimeError):
    """Every checkpoint of the workdir was moved aside as damaged: no silent fresh start."""

    exit_status = 1


def keep_earlier_metrics(workdir: Path) -> None:
    """Before step 0 in a workdir with no checkpoint: the metrics.jsonl of an earlier start
    (stopped before its first save, or started over) is renamed beside, never emptied."""
    path = workdir / "metrics.jsonl"
    if not path.is_file() or path.stat().st_size == 0:
        return
    kept = workdir / f"metrics.before-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    path.rename(kept)
    log.warning(
        "%s has no checkpoint (its run stopped before its first save, or starts over): "
        "starting from step 0; the earlier records are kept in %s",
        workdir,
        kept,
    )


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the records of steps before `step` (a resumed run rewrites the rest).

    A line that is not a record (cut short by a killed process, not UTF-8, not JSON) is
    dropped and counted in a warning.
    """
    if not path.exists():
        return
    kept, unreadable = [], 0
    for line in path.read_bytes().splitlines():
        try:
            if json.loads(line.decode("utf-8"))["step"] < step:
                kept.append(line.decode("utf-8") + "\n")
        except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
            unreadable += 1
    if unreadable:
        log.warning("%s: dropped %d unreadable line(s)", path, unreadable)
    write_text_atomic(path, "".join(kept))


class StopRequest:
    """Turns SIGTERM / SIGINT into a flag the loop checks between steps.

    The first signal only sets the flag; the previous handlers are then put back, so a second
    one acts as usual (a second Ctrl-C interrupts at once).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
        self.uninstall()

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agreed(self) -> bool:
        """Whether any process was asked to stop, so that all stop after the same step (with
        several processes, a small all-gather: call it at the same point on every process)."""
        local = self.signal_name is not None
        if jax.process_count() == 1:
            return local
        return bool(np.any(multihost_utils.process_allgather(np.int32(local))))


def resolve_data_streams(config: Any, layout: BatchLayout) -> int:
    """train.data_streams, 0 meaning one per process; checked against processes and rows."""
    processes = jax.process_count()
    count = config.train.data_streams or processes
    if count < 1 or count % processes:
        raise ConfigError(
            f"train.data_streams={count}; expected a positive multiple of the {processes} processes"
        )
    if layout.micro_rows % count:
        raise ConfigError(
            f"train.data_streams={count} does not divide the {layout.micro_rows} rows of a "
            "micro-batch (train.device_batch_size x batch devices)"
        )
    return count


class DataStreams:
    """This process's share of the run's `count` data streams of one split.

    Stream j is the pipeline's stream (process_index=j, process_count=count), so the data order
    depends on the number of streams only: 1 process x 2 devices reads exactly the batches of
    2 processes x 1 device, and a run resumes on another process count with the same streams.
    Process p reads streams [p k, (p + 1) k), k = count / processes; every micro-batch takes
    the same number of rows from each stream, in stream order.
    """

    def __init__(
        self, config: Any, split: str, count: int, rows_per_process: int, tokenizer: Tokenizer
    ):
        per_process = count // jax.process_count()
        first = jax.process_index() * per_process
        self.count = count
        self.iterators = {
            j: make_batch_iterator(
                config.data,
                split=split,
                seq_len=config.model.seq_len,
                batch_size=rows_per_process // per_process,
                seed=config.seed,
                process_index=j,
                process_count=count,
                tokenizer=tokenizer,
            )
            for j in range(first, first + per_process)
        }

    def next_local(self, accum: int) -> dict[str, np.ndarray]:
        """This process's rows of the next step: {name: (accum, rows / accum, T)}."""
        parts = [next(iterator) for iterator in self.iterators.values()]
        return {
            name: np.concatenate(
                [p[name].reshape(accum, -1, p[name].shape[-1]) for p in parts], axis=1
            )
            for name in parts[0]
        }

    def close(self) -> None:
        for iterator in self.iterators.values():
            iterator.close()


class Profiler:
    """A jax.profiler trace of steps [start, start + count) and the compiled step's HLO."""

    def __init__(self, workdir: Path, start: int, count: int, dump_hlo: bool):
        self.dir, self.start, self.stop = workdir, start, start + count
        self.dump_hlo = dump_hlo and jax.process_index() == 0

    def before_step(self, step: int, train_step: Any, state: TrainState, batch: dict) -> None:
        if self.dump_hlo:
            hlo = train_step.lower(state, batch).compile().as_text()
            (self.dir / "train_step.hlo.txt").write_text(hlo)
            self.dump_hlo = False
        if step == self.start and self.stop > self.start:
            jax.profiler.start_trace(str(self.dir / "profile"))

    def traces(self, step: int) -> bool:
        return self.stop > self.start >= 0 and self.start <= step < self.stop

    def after_step(self, step: int, out: dict) -> None:
        if step == self.stop - 1 and self.traces(step):
            jax.block_until_ready(out)
            jax.profiler.stop_trace()


def log_sample(graphdef: Any, params: dict, tokenizer: Tokenizer, max_new_tokens: int) -> None:
    """Greedy continuation of a fixed prompt, so runs can be compared by eye."""
    from flax import nnx

    from bov_jax.inference.texts import sample_text

    model = nnx.merge(graphdef, params)
    text = sample_text(model, tokenizer, "The meaning of life is", max_new_tokens=max_new_tokens)
    log.info("sample: %r", text)


class Trainer:
    """Steps, evaluation, metrics and checkpoints of one invocation."""

    def __init__(
        self,
        config: Any,
        workdir: Path,
        plan: TrainingPlan,
        mesh: jax.sharding.Mesh,
        layout: BatchLayout,
        tokenizer: Tokenizer,
        config_dict: dict,
        stop: StopRequest,
    ):
        self.config, self.workdir, self.plan, self.mesh = config, workdir, plan, mesh
        self.layout, self.tokenizer, self.config_dict = layout, tokenizer, config_dict
        self.stop = stop
        self.streams = config_dict["train"]["data_streams"]
        self.graphdef, self.fresh_state, shardings, tx = create_train_state(config, plan, mesh)
        self.train_step = self.fitting_train_step(tx, shardings)
        self.eval_step = make_eval_step(self.graphdef, shardings, mesh)
        self.token_bytes = jax.device_put(
            jnp.asarray(tokenizer.token_bytes()), sharding.replicated(mesh)
        )
        self.train_data = DataStreams(
            config, "train", self.streams, layout.rows_per_process, tokenizer
        )
        ck = config.checkpoint
        self.checkpoints = Checkpoints(workdir, ck.keep, ck.async_save)
        t = config.train
        self.profiler = Profiler(workdir, t.profile_start_step, t.profile_num_steps, t.dump_hlo)
        self.throughput = Throughput(plan.total_batch_tokens, plan.flops_per_token)
        self.first_step = 0  # of this invocation, set by `train`

    def fitting_train_step(self, tx: Any, shardings: TrainState) -> Any:
        """The jitted train step with the schedule that fits this run's devices (fsdp.py): on
        an accelerator with train.remat=auto, compiled once without recomputation to see its
        peak memory (and once more with it where that does not fit), then logged."""
        config, mesh, layout = self.config, self.mesh, self.layout
        memory = fsdp.device_memory_bytes(mesh)

        def step_with(schedule: fsdp.StepSchedule) -> Any:
            fault = config.train.fault_nonfinite_step
            return make_train_step(self.graphdef, tx, shardings, mesh, fault, schedule)

        def peak_bytes(schedule: fsdp.StepSchedule) -> float:
            batch = abstract_batch(mesh, layout.accum, layout.micro_rows, config.model.seq_len)
            lowered = step_with(schedule).lower(abstract_like(self.fresh_state), batch)
            return fsdp.compiled_peak_bytes(lowered.compile())

        schedule = fsdp.schedule_for(config, mesh, self.fresh_state, memory)
        schedule = fsdp.fit_remat(schedule, config.train.remat, memory, peak_bytes)
        log.info("%s", schedule.describe())
        return step_with(schedule)

    def close(self) -> None:
        self.checkpoints.close()
        self.train_data.close()

    def restore_or_initialize(self) -> TrainState:
        """The latest checkpoint of this workdir, else `init_params_from`, else the init."""
        ck = self.config.checkpoint
        state, self.fresh_state = self.fresh_state, None
        moved = self.checkpoints.quarantined()
        if self.checkpoints.latest_step() is not None:
            if moved:
                log.warning(
                    "checkpoints moved aside as damaged earlier: %s", ", ".join(map(str, moved))
                )
            target = abstract_like(state)
            del state  # free the initial state before the restored one is allocated
            return self.checkpoints.restore_latest(
                target, self.train_data, self.config_dict, ck.fallback
            )
        if moved and not ck.start_over:
            raise NoUsableCheckpointError(
                f"{self.checkpoints.directory} holds no usable checkpoint: every one was moved "
                f"aside as damaged ({', '.join(map(str, moved))}), and this run will not start "
                "from step 0 over the records of the last. Put a good checkpoint back there, or "
                "start over on purpose with --config.checkpoint.start_over=True (metrics.jsonl is "
                "kept beside)"
            )
        if jax.process_index() == 0:
            keep_earlier_metrics(self.workdir)
        if ck.init_params_from:
            return state._replace(params=load_parameters(ck.init_params_from, state.params))
        return state

    def evaluate(self, params: dict) -> float:
        """Val BPB over the first max(1, train.eval_tokens // seq_len) rows of the val split's
        one stream (`val_batches`): the same rows whatever the processes, mesh and rows per
        device. Every process reads them in global micro-batches and keeps its share; rows
        past the budget in the last micro-batch get targets -1, which count neither nats nor
        bytes."""
        rows = max(1, self.config.train.eval_tokens // self.config.model.seq_len)
        micro, share = self.layout.micro_rows, self.layout.eval_rows_per_process
        first = jax.process_index() * share
        val = val_batches(self.config, self.tokenizer, micro)
        nats = nbytes = 0.0
        try:
            for start in range(0, rows, micro):
                local = {k: v[first : first + share] for k, v in next(val).items()}
                counted = start + first + np.arange(share) < rows
                local["targets"] = np.where(counted[:, None], local["targets"], -1)
                batch = sharding.global_batch(local, self.mesh)
                step_nats, step_bytes = self.eval_step(params, batch, self.token_bytes)
                nats, nbytes = nats + float(step_nats), nbytes + float(step_bytes)
        finally:
            val.close()
        return bits_per_byte(nats, nbytes)

    def advance(self, state: TrainState, step: int) -> tuple[TrainState, dict]:
        """Dispatch optimizer step `step` and return its (state, outputs) without waiting for
        the device. With `train.skip_nonfinite` the step is waited for, and a non-finite one
        is redrawn on the next batch; otherwise `settle` checks it later."""
        for attempt in range(MAX_SKIPPED_IN_A_ROW):
            local = self.train_data.next_local(self.layout.accum)
            batch = sharding.global_batch(local, self.mesh, leading=1)
            if attempt == 0:
                self.profiler.before_step(step, self.train_step, state, batch)
            state, out = self.train_step(state, batch)
            if not self.config.train.skip_nonfinite or bool(out["finite"]):
                return state, out
            log.warning("%s: batch skipped (train.skip_nonfinite)", nonfinite_problem(step, out))
        raise NonFiniteLossError(
            f"{MAX_SKIPPED_IN_A_ROW} batches in a row were non-finite at step {step}"
        )

    def settle(self, step: int, record: dict, out: dict, metrics: MetricsWriter) -> None:
        """Wait for dispatched step `step`; stop the run if it was not finite (its update was
        not applied), else complete its record, write it and log it where due."""
        if not bool(out["finite"]):
            self.checkpoints.wait()
            latest = self.checkpoints.latest_step()
            kept = (
                "no checkpoint yet"
                if latest is None
                else f"the latest checkpoint is {self.checkpoints.step_dir(latest)}"
                ", where a rerun continues"
            )
            raise NonFiniteLossError(
                f"{nonfinite_problem(step, out)}: stopped without saving; {kept}. "
                "--config.train.skip_nonfinite=True would skip such batches."
            )
        self.profiler.after_step(step, out)
        dt = self.throughput.tick()
        record.update(self.step_record(step, out, dt))
        metrics.write(record)
        if (step + 1) % self.config.train.log_every == 0 or step == self.first_step:
            self.log_step(step, record, dt)

    def step_record(self, step: int, out: dict, dt: float) -> dict[str, Any]:
        o = self.config.optim
        lrm = float(
            schedules.lr_multiplier(
                step, self.plan.num_steps, o.warmup_steps, o.warmdown_ratio, o.final_lr_frac
            )
        )
        tok_s = self.throughput.tokens_per_sec(dt)
        record = {
            "loss": float(out["loss"]),
            "lr": o.matrix_lr * self.plan.batch_lr_scale * lrm,
            "lrm": lrm,
            "tokens_per_sec": tok_s,
            "grad_norm": float(out["grad_norm"]),
        }
        mfu = self.throughput.mfu(tok_s)
        if mfu is not None:
            record["mfu"] = mfu
        return record

    def log_step(self, step: int, record: dict, dt: float) -> None:
        num_steps = self.plan.num_steps
        eta = self.throughput.eta_seconds(num_steps - step - 1, dt)
        line = log_line(
            step,
            num_steps,
            record["loss"],
            record["lr"],
            dt,
            record["tokens_per_sec"],
            record.get("mfu"),
            eta,
        )
        log.info(line)

    def save(self, step: int, state: TrainState) -> None:
        self.checkpoints.save(step, state, self.train_data, self.config_dict)

    def stop_reason(self, step: int, stop_at: int) -> str | None:
        """Why this invocation ends before `step`, or None; the same on every process."""
        if step >= self.plan.num_steps:
            return None
        if step >= stop_at:
            return "train.stop_after_steps"
        if self.stop.agreed():
            return self.stop.signal_name or "a signal to another process"
        return None

    def eval_due(self, step: int) -> bool:
        return step % self.config.train.eval_every == 0 or step >= self.plan.num_steps

    def record_start(self, step: int, params: dict, final: dict) -> dict[str, Any]:
        """The step's record before its update: the learned coefficients every log step, the
        val BPB where due (and the unigram line)."""
        record: dict[str, Any] = {"step": step}
        if step == 0 and "unigram_bpb" in final:
            record["unigram_bpb"] = final["unigram_bpb"]
        if self.eval_due(step) or step % self.config.train.log_every == 0:
            record["coefficients"] = learned_coefficients(params)  # a few scalars: cheap
        if self.eval_due(step):
            record["val_bpb"] = final["val_bpb"] = self.evaluate(params)
            log.info("Step %05d | Validation bpb: %.6f", step, record["val_bpb"])
            self.throughput.restart()
        return record

    def needs_settled_state(self, step: int) -> bool:
        """Whether the state after step `step` is used (saved, sampled, traced) at once, so
        that the step must be checked before the next one is dispatched."""
        return self.save_due(step) or self.sample_due(step) or self.profiler.traces(step)

    def save_due(self, step: int) -> bool:
        save_every = self.config.checkpoint.save_every
        return save_every > 0 and (step + 1) % save_every == 0

    def sample_due(self, step: int) -> bool:
        t, done = self.config.train, step + 1
        return t.sample_tokens > 0 and (done % t.sample_every == 0 or done == self.plan.num_steps)

    def after_step(self, step: int, state: TrainState) -> None:
        """Periodic checkpoint and sample once step `step` is done and settled."""
        if self.save_due(step):
            self.save(step + 1, state)
        if self.sample_due(step):
            log_sample(self.graphdef, state.params, self.tokenizer, self.config.train.sample_tokens)
            self.throughput.restart()

    def core_at_end(self, params: dict, step: int) -> None:
        """CORE of the final model into evals/core_step<step>.json (train.core_at_end)."""
        from flax import nnx

        from bov_jax.evals import core

        if jax.process_count() > 1:
            log.warning("train.core_at_end: single-process only; run python -m bov_jax.evals.core")
            return
        forward = jax.jit(on_mesh(lambda p, ids: nnx.merge(self.graphdef, p)(ids), self.mesh))
        logits_fn = lambda ids: np.asarray(forward(params, ids))  # noqa: E731
        limit = self.config.train.core_at_end
        core.evaluate_into_workdir(
            self.workdir, step, self.tokenizer, logits_fn, limit, core.DEFAULT_BUNDLE_DIR
        )

    def train(self, state: TrainState, metrics: MetricsWriter) -> dict[str, Any]:
        """Steps from the state's step to the horizon, this invocation's stop or a signal;
        then a checkpoint of the step reached (unless it exists).

        A step is checked (`settle`) once the next one has been dispatched, so the device
        always has a step queued while the host reads the previous one's finiteness and loss
        and loads the next batch; a step whose state is evaluated, saved or sampled is
        checked before anything uses it.
        """
        t, num_steps = self.config.train, self.plan.num_steps
        self.first_step = start = int(state.step)
        stop_at = start + t.stop_after_steps if t.stop_after_steps > 0 else num_steps
        final: dict[str, Any] = {}
        if start == 0 and jax.process_index() == 0:
            final["unigram_bpb"] = unigram_bpb(self.config.data, self.tokenizer)
            log.info("unigram reference line: val BPB %.4f", final["unigram_bpb"])
        pending: tuple | None = None  # (step, record, outputs) dispatched, not yet checked
        for step in itertools.count(start):
            final["step"] = step
            reason = self.stop_reason(step, stop_at)
            if pending and (reason or self.eval_due(step)):
                self.settle(*pending, metrics)
                pending = None
            if reason:
                log.info("stopping at step %d (%s)", step, reason)
                break
            record = self.record_start(step, state.params, final)
            if step >= num_steps:
                metrics.write(record)
                break
            state, out = self.advance(state, step)
            if pending:
                self.settle(*pending, metrics)
            pending = (step, record, out)
            if self.needs_settled_state(step):
                self.settle(*pending, metrics)
                pending = None
                self.after_step(step, state)
            self.checkpoints.check_saves()
        if self.checkpoints.latest_step() != final["step"]:
            self.save(final["step"], state)
        self.checkpoints.wait()
        final["finished"] = final["step"] >= num_steps
        if final["finished"] and t.core_at_end:
            self.core_at_end(state.params, final["step"])
        if jax.process_index() == 0:  # for job scripts: requeue until finished
            status = {"step": final["step"], "num_steps": num_steps}
            write_json_atomic(self.workdir / "status.json", status)
        return final


def train_in(workdir: Path, trainer: Trainer) -> dict[str, Any]:
    """Restore or initialise, then train; the workdir's records follow the restored step."""
    try:
        state = trainer.restore_or_initialize()
        if jax.process_index() == 0:  # only now: a mismatching checkpoint keeps its config
            write_json_atomic(workdir / "config.json", trainer.config_dict)
            run_record.append_invocation(workdir, run_record.invocation(int(state.step)))
            truncate_metrics(workdir / "metrics.jsonl", int(state.step))
        metrics = MetricsWriter(workdir, int(state.step))
        try:
            return trainer.train(state, metrics)
        finally:
            metrics.close()
    finally:
        trainer.close()


def prepare_token_cache(data_cfg: Any, tokenizer: Tokenizer) -> None:
    """Process 0 builds the pre-tokenized cache (if used and missing); the others wait for it
    instead of racing to build the same files."""
    if not data_cfg.use_cache:
        return
    if jax.process_index() == 0:
        ensure_cache(data_cfg, tokenizer)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("bov_jax token cache ready")


def recorded_config(config: Any, streams: int, platform: str) -> dict[str, Any]:
    """The config as written to config.json and checkpoints: `auto` and 0 choices resolved
    as for the mesh's `platform` (compute dtype, attention, data streams) and the data's
    fingerprint."""
    recorded = json.loads(config.to_json_best_effort())
    for key in ("compute_dtype", "attention_impl"):
        recorded["model"][key] = resolve_auto(key, config.model[key], platform)
    recorded["train"]["data_streams"] = streams
    recorded[DATA_FILES] = data_fingerprint(config.data)
    return recorded


def log_setup(config_dict: dict[str, Any], workdir: Path) -> None:
    """What runs where: backend, devices, processes, dtypes, attention, and the run's files."""
    d, model = run_record.device_summary(), config_dict["model"]
    m = {key: resolve_auto(key, value) for key, value in model.items() if isinstance(value, str)}
    log.info(
        "backend %s: %d x %s (%d per process), %d process(es)",
        d["backend"],
        d["device_count"],
        d["device_kind"],
        d["local_device_count"],
        d["process_count"],
    )
    log.info(
        "dtypes: compute %s, params %s, tables %s; attention %s",
        m["compute_dtype"],
        m["param_dtype"],
        m["table_dtype"],
        m["attention_impl"],
    )
    every = config_dict["checkpoint"]["save_every"]
    log.info(
        "workdir %s: metrics.jsonl and tensorboard/ (tensorboard --logdir %s), checkpoints/ "
        "(%s and at the end), config.json, run.json",
        workdir.absolute(),
        workdir.absolute() / "tensorboard",
        f"every {every} steps" if every else "only",
    )


def run(config: Any, workdir: str | Path) -> dict[str, Any]:
    """Train (or resume) the configured run in `workdir`; returns the final metrics.

    Process 0 holds the workdir's lock throughout: a second run on it stops at once.
    """
    workdir = Path(workdir)
    validate_config(config)
    ensure_writable(workdir)
    with workdir_lock.hold(workdir) if jax.process_index() == 0 else contextlib.nullcontext():
        return run_in(config, workdir)


def run_in(config: Any, workdir: Path) -> dict[str, Any]:
    """`run` once the workdir is checked and held."""
    plan = training_plan(config)
    with config_errors():
        mesh = sharding.make_mesh(config.mesh)
        rows_choice = device_rows.resolve(config, plan.total_batch_tokens, mesh)
        layout = BatchLayout.resolve(config, plan, mesh)
    streams = resolve_data_streams(config, layout)
    validate_data_config(config.data, config.model.vocab_size, config.model.seq_len)
    tokenizer = load_tokenizer(
        tokenizer_path(config.data), config.model.vocab_size, config.data.encode_threads
    )
    prepare_token_cache(config.data, tokenizer)
    is_main = jax.process_index() == 0
    config_dict = recorded_config(config, streams, sharding.platform(mesh))
    log_setup(config_dict, workdir)
    log.info("plan: %s", json.dumps(plan.summary()))
    if rows_choice:
        log.info("%s", rows_choice)
    cost = evaluation_cost(config, plan)
    log.info(
        "val BPB: %d evals of %d tokens (every %d steps): +%.1f%% of the training compute",
        cost["evals"],
        cost["tokens_per_eval"],
        cost["eval_every"],
        100 * cost["compute_share"],
    )
    log.info(
        "mesh %s; %d micro-batches of %d rows per step; %d data streams",
        dict(mesh.shape),
        layout.accum,
        layout.micro_rows,
        streams,
    )
    stop = StopRequest()
    try:
        final = train_in(
            workdir, Trainer(config, workdir, plan, mesh, layout, tokenizer, config_dict, stop)
        )
    finally:
        stop.uninstall()
    if is_main and final["finished"] and math.isfinite(final.get("val_bpb", math.nan)):
        log.info("final step %d, val BPB %.6f", final["step"], final["val_bpb"])
    return final
