"""The training loop: config -> mesh -> state -> steps -> metrics and checkpoints.

Read top to bottom: `run` validates everything, builds the mesh, state and data, restores
the latest checkpoint if the workdir has one, and then loops over steps. Evaluation runs at
step 0, every `train.eval_every` steps and at the end (val BPB on a fixed token budget from
a fresh validation iterator, as the reference does); checkpoints at `checkpoint.save_every`,
at the end, when `train.stop_after_steps` is reached and on SIGTERM/SIGINT.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from bov_jax import sharding
from bov_jax.accounting import training_plan
from bov_jax.config import validate_config
from bov_jax.data.config import tokenizer_path, validate_data_config
from bov_jax.data.pipeline import make_batch_iterator
from bov_jax.data.tokenizer import load_tokenizer
from bov_jax.data.unigram import unigram_bpb
from bov_jax.evals.bpb import bits_per_byte
from bov_jax.model.spec import ModelSpec
from bov_jax.train import schedules
from bov_jax.train.checkpoint import Checkpoints
from bov_jax.train.layout import BatchLayout
from bov_jax.train.metrics import MetricsWriter, Throughput, log_line
from bov_jax.train.state import create_train_state
from bov_jax.train.step import make_eval_step, make_train_step

log = logging.getLogger("bov_jax")


class NonFiniteLossError(RuntimeError):
    pass


def write_json_atomic(path: Path, payload: dict) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        json.dump(payload, tmp, indent=2)
    os.replace(tmp.name, path)


class StopRequest:
    """Turns SIGTERM / SIGINT into a flag the loop checks between steps."""

    def __init__(self):
        self.signal_name: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def __bool__(self) -> bool:
        return self.signal_name is not None


def evaluate_bpb(config, layout, mesh, eval_step, params, token_bytes, tokenizer) -> float:
    """Val BPB over `train.eval_tokens` (at least one batch) from a fresh val iterator."""
    seq_len = config.model.seq_len
    steps = max(1, config.train.eval_tokens // (layout.micro_rows * seq_len))
    val = make_batch_iterator(
        config.data,
        split="val",
        seq_len=seq_len,
        batch_size=layout.eval_rows_per_process,
        seed=config.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        tokenizer=tokenizer,
    )
    nats = nbytes = 0.0
    for _ in range(steps):
        batch = sharding.global_batch(next(val), mesh)
        step_nats, step_bytes = eval_step(params, batch, token_bytes)
        nats, nbytes = nats + float(step_nats), nbytes + float(step_bytes)
    return bits_per_byte(nats, nbytes)


class Profiler:
    """A jax.profiler trace of steps [start, start + count) and the compiled step's HLO."""

    def __init__(self, workdir: Path, start: int, count: int, dump_hlo: bool):
        self.dir, self.start, self.stop = workdir, start, start + count
        self.dump_hlo = dump_hlo and jax.process_index() == 0

    def before_step(self, step: int, train_step, state, batch) -> None:
        if self.dump_hlo:
            hlo = train_step.lower(state, batch).compile().as_text()
            (self.dir / "train_step.hlo.txt").write_text(hlo)
            self.dump_hlo = False
        if step == self.start and self.stop > self.start:
            jax.profiler.start_trace(str(self.dir / "profile"))

    def after_step(self, step: int, out: dict) -> None:
        if step == self.stop - 1 and self.stop > self.start >= 0:
            jax.block_until_ready(out)
            jax.profiler.stop_trace()


def log_sample(graphdef, params, tokenizer, max_new_tokens: int) -> None:
    """Greedy continuation of a fixed prompt, so runs can be compared by eye."""
    from flax import nnx

    from bov_jax.model.decode import sample_text

    model = nnx.merge(graphdef, params)
    text = sample_text(model, tokenizer, "The meaning of life is", max_new_tokens=max_new_tokens)
    log.info("sample: %r", text)


def run(config: Any, workdir: str | Path) -> dict[str, Any]:
    """Train (or resume) the configured run in `workdir`; returns the final metrics."""
    workdir = Path(workdir)
    validate_config(config)
    plan = training_plan(config)
    spec = ModelSpec.from_config(config.model)
    mesh = sharding.make_mesh(config.mesh)
    layout = BatchLayout.resolve(config, plan, mesh)
    validate_data_config(config.data, config.model.vocab_size, config.model.seq_len)
    tokenizer = load_tokenizer(
        tokenizer_path(config.data), config.model.vocab_size, config.data.encode_threads
    )
    is_main = jax.process_index() == 0
    workdir.mkdir(parents=True, exist_ok=True)
    config_dict = json.loads(config.to_json_best_effort())
    if is_main:
        write_json_atomic(workdir / "config.json", config_dict)
    log.info("plan: %s", json.dumps(plan.summary()))
    log.info(
        "mesh %s; %d micro-batches of %d rows per step",
        dict(mesh.shape),
        layout.accum,
        layout.micro_rows,
    )

    graphdef, state, shardings, tx = create_train_state(config, plan, mesh)
    train_iter = make_batch_iterator(
        config.data,
        split="train",
        seq_len=spec.seq_len,
        batch_size=layout.rows_per_process,
        seed=config.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        tokenizer=tokenizer,
    )
    checkpoints = Checkpoints(workdir, config.checkpoint.keep, config.checkpoint.async_save)
    state = checkpoints.restore_latest(state, train_iter, config_dict)
    train_step = make_train_step(graphdef, tx, shardings, mesh)
    eval_step = make_eval_step(graphdef, shardings, mesh)
    token_bytes = jax.device_put(jnp.asarray(tokenizer.token_bytes()), sharding.replicated(mesh))
    unigram = unigram_bpb(config.data, tokenizer)
    log.info("unigram reference line: val BPB %.4f", unigram)

    metrics = MetricsWriter(workdir)
    profiler = Profiler(workdir, t.profile_start_step, t.profile_num_steps, t.dump_hlo)
    stop = StopRequest()
    step = int(state.step)
    start_step = step
    t = config.train
    stop_at = (
        min(plan.num_steps, step + t.stop_after_steps) if t.stop_after_steps > 0 else plan.num_steps
    )
    throughput = Throughput(plan.total_batch_tokens, plan.flops_per_token)
    muon_lr = config.optim.matrix_lr * plan.batch_lr_scale
    final: dict[str, Any] = {"unigram_bpb": unigram}
    try:
        while True:
            record: dict[str, Any] = {"step": step}
            finished = step >= plan.num_steps
            if not finished and (step == stop_at or stop):
                break
            if step % t.eval_every == 0 or finished:
                record["val_bpb"] = evaluate_bpb(
                    config, layout, mesh, eval_step, state.params, token_bytes, tokenizer
                )
                log.info("Step %05d | Validation bpb: %.6f", step, record["val_bpb"])
                final["val_bpb"] = record["val_bpb"]
                throughput.restart()
            if finished:
                metrics.write(record)
                break
            local = next(train_iter)
            batch = sharding.global_batch(
                {k: v.reshape(layout.accum, -1, v.shape[-1]) for k, v in local.items()},
                mesh,
                leading=1,
            )
            profiler.before_step(step, train_step, state, batch)
            state, out = train_step(state, batch)
            profiler.after_step(step, out)
            loss = float(out["loss"])
            if not bool(out["finite"]):
                if not t.skip_nonfinite:
                    raise NonFiniteLossError(
                        f"non-finite loss or gradient at step {step} (loss={loss}); the state "
                        f"was not updated and the last good checkpoint is kept"
                    )
                log.warning("step %d: non-finite loss or gradient; batch skipped", step)
                continue
            dt = throughput.tick()
            tok_s = throughput.tokens_per_sec(dt)
            lrm = float(
                schedules.lr_multiplier(
                    step,
                    plan.num_steps,
                    config.optim.warmup_steps,
                    config.optim.warmdown_ratio,
                    config.optim.final_lr_frac,
                )
            )
            record.update(
                loss=loss,
                lr=muon_lr * lrm,
                lrm=lrm,
                tokens_per_sec=tok_s,
                grad_norm=float(out["grad_norm"]),
            )
            mfu = throughput.mfu(tok_s)
            if mfu is not None:
                record["mfu"] = mfu
            metrics.write(record)
            step += 1
            if step % t.log_every == 0 or step == start_step + 1:
                log.info(
                    log_line(
                        step - 1,
                        plan.num_steps,
                        loss,
                        muon_lr * lrm,
                        dt,
                        tok_s,
                        mfu,
                        throughput.eta_seconds(plan.num_steps - step, dt),
                    )
                )
            if config.checkpoint.save_every > 0 and step % config.checkpoint.save_every == 0:
                checkpoints.save(step, state, train_iter, config_dict)
            if step % t.sample_every == 0 and step < plan.num_steps:
                log_sample(graphdef, state.params, tokenizer, config.train.sample_tokens)
                throughput.restart()
        if stop:
            log.info("%s received: checkpointing at step %d", stop.signal_name, step)
        if checkpoints.latest_step() != step:
            checkpoints.save(step, state, train_iter, config_dict)
        checkpoints.wait()
    finally:
        checkpoints.close()
        metrics.close()
    final["step"] = step
    if math.isfinite(final.get("val_bpb", math.nan)) and is_main:
        log.info("final step %d, val BPB %.6f (unigram line %.4f)", step, final["val_bpb"], unigram)
    return final
