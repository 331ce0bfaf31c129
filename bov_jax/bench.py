"""Benchmarks whose ratios are measured in one run.

    python -m bov_jax.bench train --configs=configs/d12.py,configs/d12_bov.py \
        [--device_batch_size=16 --seq_len=2048 --steps=10 --dtype=bfloat16 --attention=cudnn]
    python -m bov_jax.bench data --configs=configs/quickstart.py [--seconds=5]

`train`: tokens/s, step time, MFU and compile time of the compiled train step, configs side
by side in this one process on the same devices. Batches are random tokens; one step is one
micro-batch per device. `data`: tokens/s the data pipeline produces for the first config
(with and without worker processes) next to what its train step consumes.
"""

from __future__ import annotations

import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from bov_jax import cli, sharding
from bov_jax.accounting import training_plan
from bov_jax.model.spec import ModelSpec
from bov_jax.train.metrics import peak_flops_per_device
from bov_jax.train.state import create_train_state
from bov_jax.train.step import make_train_step

flags.DEFINE_list("configs", ["configs/d12.py", "configs/d12_bov.py"], "Config files to compare.")
flags.DEFINE_integer("device_batch_size", 0, "Rows per device (0: the config's).")
flags.DEFINE_integer("seq_len", 0, "Sequence length (0: the config's).")
flags.DEFINE_integer("depth", 0, "Override model depth (0: the config's).")
flags.DEFINE_integer("model_dim", -1, "Override model width (-1: the config's).")
flags.DEFINE_integer("vocab_size", 0, "Override vocab (0: the config's).")
flags.DEFINE_integer("steps", 5, "Timed steps after the compile step.")
flags.DEFINE_string("dtype", "", "Compute dtype override (bfloat16 on accelerators).")
flags.DEFINE_string("attention", "", "Attention implementation override (xla | cudnn).")
flags.DEFINE_string("json_out", "", "Also write the results to this JSON file.")
flags.DEFINE_float("seconds", 5.0, "data: seconds of pipeline reading per measurement.")
FLAGS = flags.FLAGS


def load_config(path: str) -> Any:
    return config_flags.config_flags.ConfigFileFlagParser(name="config").parse(path)


def configure(config: Any) -> Any:
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
    t.target_flops, t.target_tokens, t.num_steps = -1.0, -1, 1000
    t.total_batch_tokens = t.device_batch_size * jax.device_count() * m.seq_len
    return config


def bench_train(path: str) -> dict[str, Any]:
    config = configure(load_config(path))
    spec = ModelSpec.from_config(config.model)
    plan = training_plan(config)
    mesh = sharding.make_mesh(config.mesh)
    graphdef, state, shardings, tx = create_train_state(config, plan, mesh)
    step = make_train_step(graphdef, tx, shardings, mesh)
    rows, seq = config.train.device_batch_size * jax.device_count(), config.model.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.model.vocab_size, (1, rows, seq + 1), dtype=np.int32)
    batch = sharding.global_batch(
        {"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}, mesh, leading=1
    )
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    state, out = compiled(state, batch)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(FLAGS.steps):
        state, out = compiled(state, batch)
    jax.block_until_ready(out)
    step_s = (time.perf_counter() - start) / FLAGS.steps
    tok_s = rows * seq / step_s
    peak = peak_flops_per_device()
    memory = compiled.memory_analysis()
    return {
        "config": path,
        "depth": config.model.depth,
        "value_path": dict(config.model.value_path),
        "compute_dtype": jnp.dtype(spec.compute_dtype).name,
        "attention": spec.attention_impl,
        "tokens_per_step": rows * seq,
        "compile_s": round(compile_s, 2),
        "step_ms": round(1000 * step_s, 2),
        "tokens_per_sec": round(tok_s, 1),
        "flops_per_token": plan.flops_per_token,
        "model_tflops_per_sec": round(tok_s * plan.flops_per_token / 1e12, 2),
        "mfu": round(tok_s * plan.flops_per_token / (peak * jax.device_count()), 4)
        if peak
        else None,
        "loss": float(out["loss"]),
        "temp_gib": round(getattr(memory, "temp_size_in_bytes", 0) / 2**30, 2) if memory else None,
    }


def bench_data(path: str) -> None:
    """Pipeline tokens/s (0 and 2 workers) against the train step's consumption."""
    from bov_jax.data.bench import measure_pipeline

    config = load_config(path)
    seq, rows = config.model.seq_len, config.train.device_batch_size * jax.device_count()
    produced = {
        workers: measure_pipeline(config.data, seq, rows, FLAGS.seconds, workers)
        for workers in (0, 2)
    }
    consumed = bench_train(path)["tokens_per_sec"]
    print(f"trainer consumes {consumed:,.0f} tokens/s ({path})")
    for workers, rate in produced.items():
        print(f"pipeline, {workers} workers: {rate:,.0f} tokens/s = {rate / consumed:,.1f}x")


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in ("train", "data"):
        raise app.UsageError("usage: python -m bov_jax.bench {train,data} --configs=a.py,b.py")
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}", flush=True)
    if argv[1] == "data":
        bench_data(FLAGS.configs[0])
        return
    results = []
    for path in FLAGS.configs:
        results.append(bench_train(path))
        print(json.dumps(results[-1]), flush=True)
    base = results[0]
    header = f"{'step ms':>9} {'tok/s':>12} {'MFU':>7} {'compile s':>10} {'speed vs first':>15}"
    print(f"\n{'config':36} {header}")
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(
            f"{r['config']:36} {r['step_ms']:9.1f} {r['tokens_per_sec']:12,.0f} {mfu:>7} "
            f"{r['compile_s']:10.1f} {r['tokens_per_sec'] / base['tokens_per_sec']:15.3f}"
        )
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    cli.run(main)
