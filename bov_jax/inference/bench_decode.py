"""Decode throughput and cache memory: baseline vs BoV (with and without V caches).

    python -m bov_jax.inference.bench_decode                       # small CPU-sized models
    python -m bov_jax.inference.bench_decode --depth=24 --model_dim=1536 --head_dim=128 \
        --vocab_size=32768 --dtype=bfloat16 --batch=8 --contexts=2048,8192,32768   # GPU

For each context length C the cache is filled synthetically (random K, V and token ids,
position C: decode cost does not depend on the values, and a prefill of C tokens would
dominate the run), then the jitted decode loop of `bov_jax.inference.decode.Engine` generates
--new_tokens tokens per row (sampling with temperature 1, so rows never stop early). It
is run once to compile and then timed --repeats times; tokens/s = batch * new_tokens /
the best time. Cache bytes are `bov_jax.memory.kv_cache_bytes` at the cache's length.
"""

from __future__ import annotations

import itertools
import time

import jax
import jax.numpy as jnp
from absl import flags

from bov_jax import cli
from bov_jax.files import write_json_atomic
from bov_jax.inference.decode import SLOT_MULTIPLE, Engine, KVCache, Prefilled, init_cache
from bov_jax.inference.memory import kv_cache_bytes
from bov_jax.model.gpt import GPT
from bov_jax.model.spec import ModelSpec
from bov_jax.presets import config_for

MIB = 2**20


def bench_spec(preset: str, args: flags.FlagValues) -> ModelSpec:
    """A preset's spec at the benchmark's sizes."""
    config = config_for(preset)
    config.model.update(
        depth=args.depth,
        model_dim=args.model_dim,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        param_dtype=args.dtype,
        compute_dtype=args.dtype,
    )
    return ModelSpec.from_config(config.model)


def synthetic_batch(
    spec: ModelSpec, batch: int, context: int, max_len: int, eliminate_bank_v: bool, seed: int
) -> Prefilled:
    """A batch whose cache looks prefilled with `context` random tokens."""
    base = jax.random.key(seed)
    keys = (jax.random.fold_in(base, i) for i in itertools.count())
    shapes = jax.eval_shape(
        lambda: init_cache(spec, batch, max_len, eliminate_bank_v=eliminate_bank_v)
    )

    def fill(x: jax.ShapeDtypeStruct | None) -> jax.Array | None:
        if x is None:
            return None
        if x.dtype == jnp.int32:
            return jax.random.randint(next(keys), x.shape, 0, spec.vocab_size, jnp.int32)
        return jax.random.normal(next(keys), x.shape, x.dtype)

    cache = KVCache(
        k=tuple(fill(k) for k in shapes.k),
        v=tuple(fill(v) for v in shapes.v),
        token_ids=fill(shapes.token_ids),
        prev_embedding=fill(shapes.prev_embedding),
        pos=jnp.int32(context),
    )
    tokens = jax.random.randint(next(keys), (batch, max_len), 0, spec.vocab_size, jnp.int32)
    logits = jax.random.normal(next(keys), (batch, spec.vocab_size), jnp.float32)
    return Prefilled(cache, tokens, logits, jnp.full((batch,), context, jnp.int32))


def decode_rate(engine: Engine, context: int, args: flags.FlagValues) -> tuple[float, int]:
    """(tokens/s, cache bytes) of the engine's decode loop after `context` tokens."""
    max_len = -(-(context + args.new_tokens) // SLOT_MULTIPLE) * SLOT_MULTIPLE
    best = float("inf")
    for rep in range(args.repeats + 1):  # rep 0 compiles
        batch = synthetic_batch(
            engine.spec, args.batch, context, max_len, engine.eliminate_bank_v, rep
        )
        jax.block_until_ready(batch)
        start = time.perf_counter()
        jax.block_until_ready(engine.decode(batch, args.new_tokens, temperature=1.0, seed=rep))
        if rep:
            best = min(best, time.perf_counter() - start)
    size = kv_cache_bytes(
        engine.spec, args.batch, max_len, engine.cache_dtype, engine.eliminate_bank_v
    )
    return args.batch * args.new_tokens / best, size


def run(args: flags.FlagValues) -> tuple[str, dict]:
    """The side-by-side table, one row per context length, and the same figures as a dict:
    {device, contexts: [{context, tokens_per_sec: {variant: rate}, cache_mib: {...}}]}."""
    variants = {
        "baseline": (args.baseline, True),
        "BoV, V cache": (args.bov, False),
        "BoV, no V cache": (args.bov, True),
    }
    models = {p: GPT(bench_spec(p, args), seed=0) for p in {args.baseline, args.bov}}
    engines = {name: Engine(models[p], eliminate_bank_v=e) for name, (p, e) in variants.items()}
    spec = models[args.bov].spec
    lines = [
        f"device {jax.devices()[0].device_kind}; depth {spec.n_layer}, d {spec.d_model}, "
        f"{spec.n_head} heads, vocab {spec.vocab_size}, {args.dtype}; BoV layers "
        f"{spec.targets}; batch {args.batch}, {args.new_tokens} new tokens per row",
        f"{'context':>8} "
        + " ".join(f"{name + ' tok/s':>22}" for name in variants)
        + " "
        + " ".join(f"{name + ' MiB':>20}" for name in variants),
    ]
    figures = {"device": jax.devices()[0].device_kind, "contexts": []}
    for context in map(int, args.contexts):
        rates, sizes = zip(*(decode_rate(e, context, args) for e in engines.values()))
        lines.append(
            f"{context:>8} "
            + " ".join(f"{r:>22.1f}" for r in rates)
            + " "
            + " ".join(f"{s / MIB:>20.2f}" for s in sizes)
        )
        figures["contexts"].append(
            {
                "context": context,
                "tokens_per_sec": dict(zip(variants, rates, strict=True)),
                "cache_mib": {v: size / MIB for v, size in zip(variants, sizes, strict=True)},
            }
        )
    return "\n".join(lines), figures


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    flags.DEFINE_string("baseline", "d12", "Baseline preset.")
    flags.DEFINE_string("bov", "d12_bov", "BoV preset.")
    flags.DEFINE_integer("depth", 6, "Layers.")
    flags.DEFINE_integer("model_dim", 256, "Model width.")
    flags.DEFINE_integer("head_dim", 64, "Attention head width.")
    flags.DEFINE_integer("vocab_size", 8192, "Vocabulary size.")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
    flags.DEFINE_integer("batch", 4, "Sequences decoded together.")
    flags.DEFINE_list("contexts", ["256", "1024", "4096"], "Context lengths, comma-separated.")
    flags.register_validator(
        "contexts",
        lambda values: all(value.isdigit() and int(value) > 0 for value in values),
        "expected positive integers, comma-separated",
    )
    flags.DEFINE_integer("new_tokens", 32, "Tokens decoded per sequence.")
    flags.DEFINE_integer("repeats", 2, "Timed repetitions.")
    flags.DEFINE_string("json_out", None, "Also write the figures to this JSON file.")


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (cli.run checks)
    table, figures = run(flags.FLAGS)
    print(table)
    if flags.FLAGS.json_out:
        write_json_atomic(flags.FLAGS.json_out, figures)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
