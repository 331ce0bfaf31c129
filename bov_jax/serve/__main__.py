"""Serve a trained model over HTTP: OpenAI's completions API on the paged engine.

    python -m bov_jax.serve --workdir=RUN [--port=8000 --max_seqs=16 --cache_gib=20]
    python -m bov_jax.serve --checkpoint_dir=DIR [--tokenizer=tokenizer.pkl]   # authors' or
                                                       # `bov_jax.interop export` checkpoints
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "RUN", "prompt": "The meaning of life is", "max_tokens": 32}'

Binds 127.0.0.1 unless --host says otherwise. The model is named after the workdir (or
--model_name). The cache holds room for --max_seqs sequences of --max_context tokens, or as
many as --cache_gib of pages fits (bov_jax/inference/layout.py); the start-up log says the
layout, the pages and how many compiled step shapes the engine can need.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from absl import flags

from bov_jax import cli
from bov_jax.errors import UserError

GIB = 2**30
log = logging.getLogger("bov_jax.serve")


def define_flags() -> None:
    """The command's flags (defined on use: other entry points also have a --workdir)."""
    flags.DEFINE_string("workdir", None, "Training (or imported) workdir with a checkpoint.")
    flags.DEFINE_string("checkpoint_dir", None, "Or: a directory of model_*.pt + meta_*.json.")
    flags.DEFINE_string("tokenizer", None, "tokenizer.pkl / .model for --checkpoint_dir.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
    flags.DEFINE_integer("port", 8000, "Port to bind.")
    flags.DEFINE_string("model_name", None, "The model's name in requests (default: the run's).")
    flags.DEFINE_integer("max_seqs", 8, "Sequences decoding at once (batch slots).")
    flags.DEFINE_integer("max_context", None, "Positions a sequence may use (default: seq_len).")
    flags.DEFINE_integer("page_size", 16, "Tokens a cache page.")
    flags.DEFINE_integer("chunk", 256, "Prompt tokens prefilled a step at most.")
    flags.DEFINE_float("cache_gib", None, "Memory for cache pages (default: max_seqs full ones).")
    flags.DEFINE_bool("eliminate_bank_v", True, "BoV layers keep no V pages (the paper's Eq. 6).")
    flags.DEFINE_integer("seed", 0, "Draws the seeds of requests that give none.")


def load(f: flags.FlagValues):
    """(model, tokenizer, name) from --workdir or --checkpoint_dir."""
    from bov_jax.evals.loading import load_model_and_tokenizer
    from bov_jax.interop.checkpoints import import_checkpoint

    if bool(f.workdir) == bool(f.checkpoint_dir):
        raise UserError("give one of --workdir=RUN or --checkpoint_dir=DIR")
    if f.workdir:
        model, tokenizer, _ = load_model_and_tokenizer(f.workdir, f.step)
        return model, tokenizer, f.model_name or Path(f.workdir).name
    with tempfile.TemporaryDirectory(prefix="bov_serve_") as scratch:
        workdir = Path(scratch) / "run"
        step = import_checkpoint(f.checkpoint_dir, workdir, f.step, f.tokenizer)
        model, tokenizer, _ = load_model_and_tokenizer(workdir, step)
    return model, tokenizer, f.model_name or Path(f.checkpoint_dir).name


def main(argv: list[str]) -> None:
    from bov_jax.inference.engine import Engine, EngineConfig
    from bov_jax.inference.layout import CacheLayout
    from bov_jax.serve.running import serve

    del argv
    f = flags.FLAGS
    cli.log_plainly()
    for name in ("max_seqs", "page_size", "chunk"):
        if f[name].value < 1:
            raise UserError(f"--{name}={f[name].value}; expected a positive integer")
    model, tokenizer, name = load(f)
    spec = model.spec
    max_context = f.max_context or spec.seq_len
    if max_context < 2:
        raise UserError(f"--max_context={max_context}; expected at least 2 positions")
    layout = CacheLayout.build(spec, f.page_size, None, f.eliminate_bank_v)
    pages = None
    if f.cache_gib is not None:
        fits = layout.sequences_within(int(f.cache_gib * GIB), max_context, f.chunk)
        if fits < 1:
            need = layout.sequence_bytes(max_context) / GIB
            raise UserError(
                f"--cache_gib={f.cache_gib} holds no sequence of {max_context} tokens "
                f"({need:.3f} GiB each); give more or a smaller --max_context"
            )
        pages = layout.pages_for(fits, max_context, min(f.chunk, max_context))
    config = EngineConfig(
        page_size=f.page_size,
        max_seqs=f.max_seqs,
        max_context=max_context,
        chunk=f.chunk,
        pages=pages,
        eliminate_bank_v=f.eliminate_bank_v,
        seed=f.seed,
    )
    engine = Engine(model, config, tokenizer)
    log.info(
        "serving %s: %s, %d layers, context %d", name, spec.value_path, spec.n_layer, max_context
    )
    log.info("%s", engine.layout.describe())
    log.info(
        "pages per group %s (%.3f GiB), %d batch slots, prefill chunks of %d; at most %d "
        "compiled step shapes",
        list(engine.pages),
        sum(n * engine.layout.page_bytes(g) for g, n in enumerate(engine.pages)) / GIB,
        f.max_seqs,
        engine.chunk,
        engine.shape_bound(),
    )
    log.info(
        "listening on http://%s:%d (POST /v1/completions, GET /health, GET /metrics)",
        f.host,
        f.port,
    )
    serve(engine, tokenizer, name, f.host, f.port)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
