"""The serving engine against the dense `generate` on one batch, and the sampler's share of
an engine step.

    python -m bov_jax.inference.bench_engine                     # quickstart model, CPU
    python -m bov_jax.inference.bench_engine --repeats=5 --temperature=1 --top_k=50

The model is --config's with random weights (decoding cost does not depend on the values).
--batch prompts of --prompt_tokens random ids each get --new_tokens tokens (no stop token,
so every row runs to the end) from `decode.generate` (prefill of the batch, then its jitted
decode loop) and from `Engine.generate` (paged cache, continuous batching, one
`sample_rows` call a step), with the same sampling parameters. The first run of each
compiles and is not timed; then --repeats runs alternate dense, engine, dense, engine ...,
and each repeat gives tokens/s of both and their ratio (engine / dense); the medians are
printed with every repeat's figures.

The sampler is timed apart on logits of the engine's decoding shape (batch, vocab): one
`sample_rows` call for the batch's rows (the engine's `_sample` adds only the host's
bookkeeping), against an argmax of the same logits (the floor), each the best of
--sampler_calls calls after a compiling one; its share is that time over an engine step
(an engine run's time over its steps).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from bov_jax import cli
from bov_jax.config import load_config_file
from bov_jax.files import write_json_atomic
from bov_jax.inference import decode, sampling
from bov_jax.inference.engine import Engine, EngineConfig
from bov_jax.model.gpt import GPT
from bov_jax.model.spec import ModelSpec


def params_of(args: flags.FlagValues) -> sampling.SamplingParams:
    """Every request's sampling parameters."""
    params = sampling.SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=0,
        max_tokens=args.new_tokens,
        ignore_eos=True,
    )
    params.validate()
    return params


def best_call_s(fn: Callable[[], object], calls: int) -> float:
    """The best of `calls` timed calls of fn (results waited for) after a compiling one."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def sampler_figures(vocab: int, rows: list[sampling.Row], calls: int) -> dict[str, float]:
    """Seconds a call of `sample_rows` and of an argmax on (len(rows), vocab) logits."""
    logits = jax.random.normal(jax.random.key(0), (len(rows), vocab), jnp.float32)
    argmax = jax.jit(lambda x: jnp.argmax(x, axis=-1))
    return {
        "sample_rows_s": best_call_s(lambda: sampling.sample_rows(logits, rows), calls),
        "argmax_s": best_call_s(lambda: argmax(logits), calls),
    }


def run(args: flags.FlagValues) -> tuple[str, dict]:
    """The report's lines and its figures."""
    config = load_config_file(args.config)
    spec = ModelSpec.from_config(config.model)
    model = GPT(spec, seed=0)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, spec.vocab_size, (args.batch, args.prompt_tokens)).tolist()
    params = params_of(args)
    engine = Engine(
        model,
        EngineConfig(max_seqs=args.batch, max_context=args.prompt_tokens + args.new_tokens),
        eos_ids=(),
    )

    def dense() -> None:
        decode.generate(
            model,
            prompts,
            args.new_tokens,
            params.temperature,
            params.top_k,
            seed=0,
            top_p=params.top_p,
        )

    def served() -> None:
        engine.generate(prompts, params)

    steps = []

    def timed(fn: Callable[[], None]) -> float:
        before = engine.steps
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if engine.steps != before:
            steps.append((elapsed, engine.steps - before))
        return elapsed

    dense()  # compiles
    served()
    tokens = args.batch * args.new_tokens
    repeats = []
    for _ in range(args.repeats):
        dense_s, engine_s = timed(dense), timed(served)
        repeats.append(
            {
                "dense_tokens_per_s": tokens / dense_s,
                "engine_tokens_per_s": tokens / engine_s,
                "ratio": dense_s / engine_s,
            }
        )
    step_s = statistics.median(elapsed / n for elapsed, n in steps)
    rows = [sampling.Row(params, 0, args.prompt_tokens + i, p, []) for i, p in enumerate(prompts)]
    sampler = sampler_figures(spec.vocab_size, rows, args.sampler_calls)
    median = {k: statistics.median(r[k] for r in repeats) for k in repeats[0]}
    figures = {
        "device": jax.devices()[0].device_kind,
        "config": args.config,
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "params": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p},
        "repeats": repeats,
        "median": median,
        "engine_step_s": step_s,
        "sampler": sampler,
        "sampler_share_of_step": sampler["sample_rows_s"] / step_s,
    }
    lines = [
        f"device {figures['device']}; {args.config}: depth {spec.n_layer}, d {spec.d_model}, "
        f"vocab {spec.vocab_size}; batch {args.batch} x ({args.prompt_tokens} + "
        f"{args.new_tokens}); temperature {params.temperature}, top_k {params.top_k}, "
        f"top_p {params.top_p}; n = {args.repeats} alternated repeats",
        f"{'repeat':>6} {'dense tok/s':>12} {'engine tok/s':>13} {'engine/dense':>13}",
        *(
            f"{i:>6} {r['dense_tokens_per_s']:>12.1f} {r['engine_tokens_per_s']:>13.1f} "
            f"{r['ratio']:>13.3f}"
            for i, r in enumerate(repeats, 1)
        ),
        f"{'median':>6} {median['dense_tokens_per_s']:>12.1f} "
        f"{median['engine_tokens_per_s']:>13.1f} {median['ratio']:>13.3f}",
        f"engine step {step_s * 1e3:.2f} ms (median over runs); sampler: sample_rows "
        f"{sampler['sample_rows_s'] * 1e3:.3f} ms a call ({figures['sampler_share_of_step']:.1%}"
        f" of a step), argmax {sampler['argmax_s'] * 1e3:.3f} ms",
    ]
    return "\n".join(lines), figures


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    flags.DEFINE_string("config", "configs/quickstart.py", "Config file of the model.")
    flags.DEFINE_integer("batch", 8, "Prompts (the engine's max_seqs).")
    flags.DEFINE_integer("prompt_tokens", 128, "Tokens a prompt.")
    flags.DEFINE_integer("new_tokens", 128, "Tokens generated a prompt.")
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0: greedy.")
    flags.DEFINE_integer("top_k", 0, "Top-k cut; 0: none.")
    flags.DEFINE_float("top_p", 1.0, "Top-p cut; 1: none.")
    flags.DEFINE_integer("repeats", 3, "Timed runs of each, alternated.")
    flags.DEFINE_integer("sampler_calls", 20, "Timed sampler calls (the best is kept).")
    flags.DEFINE_integer("seed", 0, "Draws the prompts.")
    flags.DEFINE_string("json_out", None, "Also write the figures to this JSON file.")


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (cli.run checks)
    report, figures = run(flags.FLAGS)
    print(report)
    if flags.FLAGS.json_out:
        write_json_atomic(flags.FLAGS.json_out, figures)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
