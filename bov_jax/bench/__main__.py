"""Benchmarks whose ratios are measured in one run.

    python -m bov_jax.bench train --configs=configs/d12.py,configs/d12_bov.py \
        [--micro_batches=N --device_batch_size=16 --steps=5 --reps=3 --tokens=corpus|random \
         --dtype=bfloat16 --attention=cudnn --noparts --json_out=out.json --profile=/tmp/trace]
    python -m bov_jax.bench data --configs=configs/quickstart.py [--seconds=5]

`train`: per config, the compiled train step at `micro_batches` micro-batches (default: what
the config's total batch needs, at most --max_micro_batches), so the optimizer is charged once
per real step, as in training. The parts are the step's own two halves
(`bov_jax.train.step.make_step_halves`: the gradients over every micro-batch, dense kernels
cast once, then the optimizer update and commit), each jitted alone with the step's
shardings and donation and waited for in turn (--noparts skips them): `gradients_ms` +
`optimizer_ms` is the step without fusion or overlap across the halves, so
`halves_over_step` sits near 1 (config a on a loaded 2-core CPU: median 1.03 / 1.05 for the
baseline / BoV value path, single rounds 0.90-1.22; tests/test_bench.py checks each half
below the step and the halves within 40% of it on a tiny model, minimum times).
Reported: step time, the two halves' times, forward+backward time per micro-batch (the
gradient half / micro-batches), MFU of the gradient half and of the whole step (analytic
FLOPs per token; null where the device's peak is unknown, e.g. CPU), tokens/s, peak memory of
the compiled step (arguments + outputs - donated + temporaries), compile time, and the step
time ratio to the first config. The configs are compiled side by side in this one process and
timed in `reps` interleaved rounds; ratios are per round (median, min, max). Token ids come from the
embedded corpus (real text: repeated ids collide in the embedding and bank gradients as in
training) unless --tokens=random. --profile writes a jax.profiler trace of a few steps per
config and prints the device time by op category and by named scope (bov_jax/bench/profile.py).
On GPUs the XLA flags of `bov_jax.train.xla_flags` are set before JAX starts.
`data`: tokens/s the data pipeline produces for the first config (with and without worker
processes) next to what its train step consumes.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from bov_jax import cli, sharding
from bov_jax.accounting import training_plan
from bov_jax.bench import profile
from bov_jax.config import load_config_file
from bov_jax.data.config import default_data_config
from bov_jax.data.pipeline import make_batch_iterator
from bov_jax.files import write_json_atomic, write_text_atomic
from bov_jax.model.spec import ModelSpec
from bov_jax.train import device_rows, host_memory, xla_flags
from bov_jax.train.metrics import peak_flops_per_device
from bov_jax.train.state import create_train_state
from bov_jax.train.step import make_step_halves, make_train_step

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    flags.DEFINE_list(
        "configs", ["configs/d12.py", "configs/d12_bov.py"], "Config files to compare."
    )
    flags.DEFINE_integer(
        "device_batch_size", 0, "Rows per device per micro-batch (0: the config's)."
    )
    flags.DEFINE_integer("seq_len", 0, "Sequence length (0: the config's).")
    flags.DEFINE_integer("depth", 0, "Override model depth (0: the config's).")
    flags.DEFINE_integer("model_dim", -1, "Override model width (-1: the config's).")
    flags.DEFINE_integer("vocab_size", 0, "Override vocab (0: the config's).")
    flags.DEFINE_integer(
        "micro_batches", 0, "Micro-batches per step (0: what the config's total batch needs)."
    )
    flags.DEFINE_integer("max_micro_batches", 16, "Cap on the default number of micro-batches.")
    flags.DEFINE_integer("steps", 5, "Timed train steps per repetition (after the compile step).")
    flags.DEFINE_integer("reps", 3, "Interleaved repetitions over the configs.")
    flags.DEFINE_enum(
        "tokens", "corpus", ["corpus", "random"], "Embedded-corpus ids or random ids."
    )
    flags.DEFINE_string("dtype", "", "Compute dtype override (bfloat16 on accelerators).")
    flags.DEFINE_string("attention", "", "Attention implementation override (xla | cudnn).")
    flags.DEFINE_string("json_out", "", "Also write the results to this JSON file.")
    flags.DEFINE_string("profile", "", "Write a jax.profiler trace of a few steps under this dir.")
    flags.DEFINE_float("seconds", 5.0, "data: seconds of pipeline reading per measurement.")
    flags.DEFINE_bool(
        "parts", True, "Also time the step's two halves (compiles the gradient half: ~2x compile)."
    )


def configure(config: Any) -> Any:
    """Apply the override flags; the step covers `micro_batches` micro-batches."""
    m, t = config.model, config.train
    for key, value in (
        ("depth", FLAGS.depth),
        ("seq_len", FLAGS.seq_len),
        ("vocab_size", FLAGS.vocab_size),
    ):
        if value:
            m[key] = value
    if FLAGS.model_dim >= 0:
        m.model_dim = FLAGS.model_dim
    if FLAGS.dtype:
        m.compute_dtype = FLAGS.dtype
    if FLAGS.attention:
        m.attention_impl = FLAGS.attention
    if FLAGS.device_batch_size:
        t.device_batch_size = FLAGS.device_batch_size
    paper_batch_tokens = training_plan(config).total_batch_tokens
    device_rows.resolve(config, paper_batch_tokens, sharding.make_mesh(config.mesh))
    micro_tokens = t.device_batch_size * jax.device_count() * m.seq_len
    accum = FLAGS.micro_batches
    if not accum:
        needed = max(1, paper_batch_tokens // micro_tokens)
        accum = min(needed, FLAGS.max_micro_batches)
    t.target_flops, t.target_tokens, t.num_steps = -1.0, -1, 1000
    t.total_batch_tokens = accum * micro_tokens
    return config


def token_ids(config: Any, count: int, rows: int, seq: int) -> np.ndarray:
    """(count, rows, seq + 1) int32 ids: embedded-corpus text (folded into the vocabulary
    if it is smaller than the corpus tokenizer's) or uniform random ids."""
    vocab = config.model.vocab_size
    if FLAGS.tokens == "random":
        return np.random.default_rng(0).integers(0, vocab, (count, rows, seq + 1), np.int32)
    data = default_data_config()
    data.num_workers = 0
    batches = make_batch_iterator(data, split="train", seq_len=seq, batch_size=rows, seed=0)
    ids = []
    for _ in range(count):
        batch = next(batches)
        ids.append(np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1))
    return np.stack(ids) % vocab


def peak_bytes(compiled: Any) -> int | None:
    """Arguments + outputs - donated aliases + temporaries of a compiled function."""
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


class TrainBench:
    """One config's compiled train step, its two halves jitted alone, and a fixed batch."""

    def __init__(self, path: str):
        self.path = path
        self.config = config = configure(load_config_file(path))
        self.spec = ModelSpec.from_config(config.model)
        self.plan = training_plan(config)
        mesh = sharding.make_mesh(config.mesh)
        graphdef, self.state, shardings, tx = create_train_state(config, self.plan, mesh)
        self.rows = config.train.device_batch_size * jax.device_count()
        self.seq = config.model.seq_len
        self.accum = config.train.total_batch_tokens // (self.rows * self.seq)
        ids = token_ids(config, self.accum, self.rows, self.seq)
        self.batch = sharding.global_batch(
            {"inputs": ids[..., :-1], "targets": ids[..., 1:]}, mesh, leading=1
        )
        start = time.perf_counter()
        self.step = make_train_step(graphdef, tx, shardings, mesh)
        self.step = self.step.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - start
        self.gradients, self.update = make_step_halves(graphdef, tx, shardings, mesh)

    def run_steps(self, steps: int) -> float:
        """Seconds per train step over `steps` steps (the state advances)."""
        start = time.perf_counter()
        for _ in range(steps):
            self.state, out = self.step(self.state, self.batch)
        jax.block_until_ready(out)
        self.loss = float(out["loss"])
        return (time.perf_counter() - start) / steps

    def run_halves(self, steps: int) -> tuple[float, float]:
        """Seconds per step of (gradients, optimizer update) over `steps` steps, each half
        waited for before the next starts (the state advances)."""
        grad_s = update_s = 0.0
        for _ in range(steps):
            start = time.perf_counter()
            loss, grads = jax.block_until_ready(
                self.gradients(self.state.params, self.batch["inputs"], self.batch["targets"])
            )
            middle = time.perf_counter()
            self.state, _ = jax.block_until_ready(self.update(self.state, loss, grads))
            grad_s += middle - start
            update_s += time.perf_counter() - middle
        return grad_s / steps, update_s / steps

    def result(self, rounds: list[tuple[float, ...]]) -> dict[str, Any]:
        """`rounds`: (step, gradients, update) seconds per step of each repetition, or (step,)
        with --noparts."""
        step_s = statistics.median(r[0] for r in rounds)
        tokens = self.accum * self.rows * self.seq
        peak = peak_flops_per_device()
        fpt = self.plan.flops_per_token

        def mfu(tokens_per_s: float) -> float | None:
            return round(tokens_per_s * fpt / (peak * jax.device_count()), 4) if peak else None

        memory = peak_bytes(self.step)
        result = {
            "config": self.path,
            "depth": self.config.model.depth,
            "value_path": dict(self.config.model.value_path),
            "compute_dtype": jnp.dtype(self.spec.compute_dtype).name,
            "attention": self.spec.attention_impl,
            "token_ids": FLAGS.tokens,
            "micro_batches": self.accum,
            "tokens_per_micro_batch": self.rows * self.seq,
            "tokens_per_step": tokens,
            "compile_s": round(self.compile_s, 2),
            "step_ms": round(1000 * step_s, 2),
            "step_ms_reps": [round(1000 * r[0], 2) for r in rounds],
            "tokens_per_sec": round(tokens / step_s, 1),
            "flops_per_token": fpt,
            "mfu_step": mfu(tokens / step_s),
            "peak_memory_gib": round(memory / 2**30, 3) if memory is not None else None,
            "loss": self.loss,
        }
        if not FLAGS.parts:
            return result
        step_min, grad_min, opt_min = (min(column) for column in zip(*rounds))
        grad_s, opt_s = (statistics.median(r[i] for r in rounds) for i in (1, 2))
        return result | {
            "gradients_ms": round(1000 * grad_s, 2),
            "optimizer_ms": round(1000 * opt_s, 2),
            "fwd_bwd_ms_per_micro_batch": round(1000 * grad_s / self.accum, 2),
            "mfu_fwd_bwd": mfu(tokens / grad_s),
            "halves_over_step": spread([(g + o) / s for s, g, o in rounds]),
            "gradients_ms_min": round(1000 * grad_min, 2),
            "optimizer_ms_min": round(1000 * opt_min, 2),
            "halves_over_step_of_min_times": round((grad_min + opt_min) / step_min, 4),
        }


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def bench_train(paths: list[str]) -> list[dict[str, Any]]:
    """Every config compiled, then `reps` interleaved rounds: per config `steps` train steps,
    then (unless --noparts) `steps` steps run as the two halves; step time ratios to the first
    config are taken within each round."""
    benches = [TrainBench(path) for path in paths]
    rounds: list[list[tuple[float, ...]]] = [[] for _ in benches]

    def one_round(bench: TrainBench, steps: int) -> tuple[float, ...]:
        step_s = bench.run_steps(steps)
        return (step_s, *bench.run_halves(steps)) if FLAGS.parts else (step_s,)

    for bench in benches:
        one_round(bench, 1)  # the first calls after compiling
    for _ in range(FLAGS.reps):
        for bench, record in zip(benches, rounds, strict=True):
            record.append(one_round(bench, FLAGS.steps))
    results = []
    for bench, record in zip(benches, rounds, strict=True):
        result = bench.result(record)
        ratios = [mine[0] / first[0] for mine, first in zip(record, rounds[0], strict=True)]
        result["step_time_ratio_vs_first"] = spread(ratios)
        results.append(result)
    if FLAGS.profile:
        for index, (bench, result) in enumerate(zip(benches, results, strict=True)):
            result["profile"] = profile_steps(bench, os.path.join(FLAGS.profile, f"config{index}"))
    return results


def profile_steps(bench: TrainBench, trace_dir: str, steps: int = 3) -> dict[str, Any]:
    """Trace `steps` train steps; print and return milliseconds per step by category/scope."""
    with jax.profiler.trace(trace_dir):
        bench.run_steps(steps)
    write_text_atomic(os.path.join(trace_dir, profile.HLO_FILE), bench.step.as_text())
    by_category, by_scope = profile.trace_breakdown(trace_dir)
    out = {
        "trace_dir": trace_dir,
        "ms_per_step_by_category": {k: round(1000 * v / steps, 2) for k, v in by_category.items()},
        "ms_per_step_by_scope": {k: round(1000 * v / steps, 2) for k, v in by_scope.items()},
        "attributed_share": {
            "category": round(profile.attributed_share(by_category), 4),
            "scope": round(profile.attributed_share(by_scope), 4),
        },
    }
    print(f"profile of {bench.path} ({trace_dir}), device ms per step:")
    for key in ("ms_per_step_by_category", "ms_per_step_by_scope"):
        print("  " + "  ".join(f"{name} {ms:.1f}" for name, ms in out[key].items()))
    shares = out["attributed_share"]
    print(f"  attributed: {shares['category']:.1%} to a category, {shares['scope']:.1%} to a scope")
    return out


def bench_data(path: str) -> None:
    """Pipeline tokens/s (0 and 2 workers) against the train step's consumption."""
    from bov_jax.data.bench import measure_pipeline

    config = load_config_file(path)
    seq, rows = config.model.seq_len, config.train.device_batch_size * jax.device_count()
    produced = {
        workers: measure_pipeline(config.data, seq, rows, FLAGS.seconds, workers)
        for workers in (0, 2)
    }
    consumed = bench_train([path])[0]["tokens_per_sec"]
    print(f"trainer consumes {consumed:,.0f} tokens/s ({path})")
    for workers, rate in produced.items():
        print(f"pipeline, {workers} workers: {rate:,.0f} tokens/s = {rate / consumed:,.1f}x")


def main(argv: list[str]) -> None:
    xla_flags.set_gpu_flags(profiling=bool(FLAGS.profile))  # before the backend starts
    host_memory.reuse_freed_memory_on_cpu()  # before the backend starts
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}", flush=True)
    if argv[1] == "data":
        bench_data(FLAGS.configs[0])
        return
    results = bench_train(FLAGS.configs)
    for result in results:
        print(json.dumps(result), flush=True)
    header = (
        f"{'mb':>3} {'step ms':>9} {'grad ms':>9} {'opt ms':>8} {'halves':>7} {'tok/s':>10} "
        f"{'MFU fb':>7} {'MFU':>6} {'GiB':>7} {'ratio (min-max)':>20}"
    )
    print(f"\n{'config':34} {header}")
    for r in results:
        ratio = r["step_time_ratio_vs_first"]
        span = f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})"
        grad, opt = (f"{r[k]:.1f}" if k in r else "-" for k in ("gradients_ms", "optimizer_ms"))
        halves = f"{r['halves_over_step']['median']:.3f}" if "halves_over_step" in r else "-"
        print(
            f"{r['config']:34} {r['micro_batches']:3d} {r['step_ms']:9.1f} "
            f"{grad:>9} {opt:>8} {halves:>7} "
            f"{r['tokens_per_sec']:10,.0f} {percent(r.get('mfu_fwd_bwd')):>7} "
            f"{percent(r['mfu_step']):>6} {r['peak_memory_gib'] or 0:7.2f} {span:>20}"
        )
    print("halves: (grad + opt) / step; ratio: step time / the first config's step time;")
    print("both per interleaved repetition (median)")
    if FLAGS.json_out:
        write_json_atomic(FLAGS.json_out, results)


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


if __name__ == "__main__":
    define_flags()
    cli.run(main, commands=("train", "data"))
