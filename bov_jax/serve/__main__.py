"""Serve a trained model over HTTP: OpenAI's completions API on the paged engine.

    python -m bov_jax.serve --workdir=RUN [--port=8000 --max_seqs=16 --cache_gib=20]
    python -m bov_jax.serve --checkpoint_dir=DIR [--tokenizer=tokenizer.pkl]   # authors' or
                                                       # `bov_jax.interop export` checkpoints
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "RUN", "prompt": "The meaning of life is", "max_tokens": 32}'

Binds 127.0.0.1 unless --host says otherwise (another address gets a warning: the API has
no authentication). The model is named after the workdir (or --model_name). The cache holds
room for --max_seqs sequences of --max_context tokens, or as many as --cache_gib of pages
fits (bov_jax/inference/layout.py).

Start-up checks what it can before the model loads: the port (bound at once), the run's
config and checkpoint (nothing is written into the run), --max_context against the trained
context, and --cache_gib against the least one sequence needs. The log then says the
checkpoint, the device, the parameters, the value path, the cache; the engine compiles
every step shape (`warmup.py`; --nowarmup skips it) while /health answers 503, and the log
says "ready" when requests are served at full speed. Compiled programs are kept in JAX's
persistent cache (--compilation_cache, outside the run) for the next start.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from absl import flags

from bov_jax import cli
from bov_jax.errors import UserError

GIB = 2**30
MIB = 2**20
log = logging.getLogger("bov_jax.serve")
COMPILATION_CACHE = "~/.cache/bov_jax/jax_compilation"


def define_flags() -> None:
    """The command's flags (defined on use: other entry points also have a --workdir)."""
    flags.DEFINE_string("workdir", None, "Training (or imported) workdir with a checkpoint.")
    flags.DEFINE_string("checkpoint_dir", None, "Or: a directory of model_*.pt + meta_*.json.")
    flags.DEFINE_string("tokenizer", None, "tokenizer.pkl / .model for --checkpoint_dir.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_string("host", "127.0.0.1", "Address to bind (not a local one: a warning).")
    flags.DEFINE_integer("port", 8000, "Port to bind.")
    flags.DEFINE_string("model_name", None, "The model's name in requests (default: the run's).")
    flags.DEFINE_integer("max_seqs", 8, "Sequences decoding at once (batch slots).")
    flags.DEFINE_integer("max_context", None, "Positions a sequence may use (default: seq_len).")
    flags.DEFINE_bool(
        "allow_long_context", False, "Take a --max_context past the context the model trained on."
    )
    flags.DEFINE_integer("page_size", 16, "Tokens a cache page.")
    flags.DEFINE_integer("chunk", 256, "Prompt tokens prefilled a step at most.")
    flags.DEFINE_float("cache_gib", None, "Memory for cache pages (default: max_seqs full ones).")
    flags.DEFINE_bool("eliminate_bank_v", True, "BoV layers keep no V pages (the paper's Eq. 6).")
    flags.DEFINE_integer("seed", 0, "Draws the seeds of requests that give none.")
    flags.DEFINE_bool("warmup", True, "Compile every step shape before saying ready.")
    flags.DEFINE_string(
        "compilation_cache",
        COMPILATION_CACHE,
        "JAX's persistent compilation cache (a folder; empty: none).",
    )
    flags.DEFINE_float("drain_s", 30.0, "Seconds requests in flight may finish after a signal.")
    flags.DEFINE_float("max_body_mib", 1.0, "Largest request body (MiB); larger ones get 413.")
    flags.DEFINE_float(
        "memory_fraction",
        0.9,
        "Share of an NVIDIA GPU's memory JAX may take (XLA_PYTHON_CLIENT_MEM_FRACTION, unless "
        "set): the capacity plan assumes 1 - its margin; JAX's own default is 0.75.",
    )


def is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def claim_port(host: str, port: int):
    """The socket bound to (host, port), before anything slow; a busy port in one line."""
    from bov_jax.serve.running import bound_socket

    try:
        return bound_socket(host, port, listen=False)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise UserError(
                f"--port={port}: {host}:{port} is in use by another process; "
                "stop it or pick another --port"
            ) from err
        raise UserError(f"--host={host} --port={port}: cannot bind: {err.strerror}") from err


@contextlib.contextmanager
def run_folder(f: flags.FlagValues) -> Iterator[tuple[Path, int | None, str]]:
    """(workdir, step, model name) of --workdir, or of --checkpoint_dir imported into a
    temporary workdir (removed on exit). A workdir without a checkpoint is refused here:
    opening its checkpoints would create checkpoints/ in it."""
    from bov_jax.interop.checkpoints import import_checkpoint

    if bool(f.workdir) == bool(f.checkpoint_dir):
        raise UserError("give one of --workdir=RUN or --checkpoint_dir=DIR")
    if f.workdir:
        workdir = Path(f.workdir)
        if not (workdir / "config.json").is_file():
            raise UserError(f"{workdir / 'config.json'} not found: is {workdir} a bov_jax workdir?")
        saved = workdir / "checkpoints"
        if not saved.is_dir() or not any(p.name.isdigit() for p in saved.iterdir()):
            raise UserError(f"{workdir} holds no checkpoint (no step folder in {saved})")
        yield workdir, f.step, f.model_name or workdir.name
        return
    with tempfile.TemporaryDirectory(prefix="bov_serve_") as scratch:
        workdir = Path(scratch) / "run"
        step = import_checkpoint(f.checkpoint_dir, workdir, f.step, f.tokenizer)
        yield workdir, step, f.model_name or Path(f.checkpoint_dir).name


def checked_context(f: flags.FlagValues, trained: int) -> int:
    """--max_context (default: the trained context), refused past the trained context
    unless --allow_long_context (then a warning)."""
    max_context = f.max_context or trained
    if max_context < 2:
        raise UserError(f"--max_context={max_context}; expected at least 2 positions")
    if max_context > trained:
        if not f.allow_long_context:
            raise UserError(
                f"--max_context={max_context} is past the {trained} positions the model "
                "trained on; its output there is untested (--allow_long_context takes it)"
            )
        log.warning(
            "WARNING: --max_context=%d is past the trained context of %d positions",
            max_context,
            trained,
        )
    return max_context


def cache_pages(f: flags.FlagValues, layout, max_context: int) -> tuple[int, ...] | None:
    """Pages per group for --cache_gib (None: the engine's default, --max_seqs full
    sequences); refused below the least one sequence needs (`CacheLayout.pages_for`: one
    sequence decoding while one more prefills a chunk)."""
    if f.cache_gib is None:
        return None
    chunk = min(f.chunk, max_context)
    fits = layout.sequences_within(int(f.cache_gib * GIB), max_context, chunk)
    if fits < 1:
        least = layout.pages_for(1, max_context, chunk)
        need = sum(n * layout.page_bytes(g) for g, n in enumerate(least))
        raise UserError(
            f"--cache_gib={f.cache_gib:g} holds no sequence of {max_context} tokens: the least "
            f"is {need / GIB:.4f} GiB ({need:,} bytes: pages {list(least)}, one sequence "
            f"decoding and one prefilling chunks of {chunk}); give more or a smaller --max_context"
        )
    return layout.pages_for(fits, max_context, chunk)


def value_path_words(spec, layout) -> str:
    """The value path in words: which layers take values from where, and their V cache."""
    from bov_jax.inference.layout import BANK, V1

    vp = spec.value_path
    targets = spec.targets
    if not targets:
        return f"dense: each of the {spec.n_layer} layers projects its own values"
    one = len(targets) == 1
    span = f"layer {targets[0]}" if one else f"layers {targets[0]}-{targets[-1]}"
    source = {
        "bank": "a token-id table (Bank of Values)" + (", shared" if vp.bank_shared else ""),
        "v1": "layer 0's values",
        "x0": "the embedding stream",
        "residual": "their own projection",
    }[vp.source]
    scale = "" if vp.scale == "none" else f", {vp.scale} scale"
    take = "takes" if one else "take"
    words = f"{span} of {spec.n_layer} {take} values from {source} ({vp.combine}{scale})"
    banks = sum(1 for reads in layout.layers if reads.mode == BANK)
    shared = sum(1 for reads in layout.layers if reads.mode == V1)
    if banks:
        words += f"; {banks} with no V cache (values gathered by token id)"
    if shared:
        words += f"; {shared} reading layer 0's V cache"
    return words


def parameter_count(model) -> int:
    import jax
    from flax import nnx

    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def use_compilation_cache(folder: str) -> str:
    """JAX's persistent compilation cache in `folder` (~ expanded); its path, or "off"."""
    if not folder:
        return "off"
    import jax

    path = Path(folder).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    return str(path)


def main(argv: list[str]) -> None:
    """`start`, with Ctrl-C before the server runs (while loading) one line, not a traceback
    (once it runs, signals drain it: running.py)."""
    try:
        start(argv)
    except KeyboardInterrupt:
        print("interrupted before the server started", file=sys.stderr)
        sys.exit(130)


def start(argv: list[str]) -> None:
    import jax

    from bov_jax.evals.loading import load_checkpoint, load_config
    from bov_jax.inference.engine import Engine, EngineConfig
    from bov_jax.inference.layout import CacheLayout
    from bov_jax.model.spec import ModelSpec
    from bov_jax.serve.running import serve

    del argv
    f = flags.FLAGS
    cli.quiet_libraries()
    for name in ("max_seqs", "page_size", "chunk"):
        if f[name].value < 1:
            raise UserError(f"--{name}={f[name].value}; expected a positive integer")
    for name in ("drain_s", "max_body_mib"):
        if not f[name].value > 0:
            raise UserError(f"--{name}={f[name].value}; expected a positive number")
    if not 0 < f.memory_fraction <= 1:
        raise UserError(f"--memory_fraction={f.memory_fraction}; expected a number in (0, 1]")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{f.memory_fraction:.2f}")
    sock = claim_port(f.host, f.port)
    if not is_local(f.host):
        log.warning(
            "WARNING: --host=%s: this API has no authentication, and anyone who reaches "
            "port %d on this machine's network can use it",
            f.host,
            f.port,
        )
    with run_folder(f) as (workdir, step, name):
        spec = ModelSpec.from_config(load_config(workdir).model)
        max_context = checked_context(f, spec.seq_len)
        layout = CacheLayout.build(spec, f.page_size, None, f.eliminate_bank_v)
        pages = cache_pages(f, layout, max_context)
        cache = use_compilation_cache(f.compilation_cache)
        step, model, tokenizer, _ = load_checkpoint(workdir, step)
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
    device = engine.device
    log.info(
        "serving %s (checkpoint step %d of %s): %s parameters, %d layers, context %d "
        "(trained on %d)",
        name,
        step,
        f.workdir or f.checkpoint_dir,
        f"{parameter_count(model):,}",
        spec.n_layer,
        max_context,
        spec.seq_len,
    )
    log.info("value path: %s", value_path_words(spec, engine.layout))
    log.info(
        "device: %s (%s, %d visible), compute in %s",
        device.device_kind,
        device.platform,
        len(jax.devices()),
        jax.numpy.dtype(spec.compute_dtype).name,
    )
    log.info(
        "cache: %s pages of %d tokens per group (%.3f GiB), %d batch slots, prefill chunks of %d",
        list(engine.pages),
        f.page_size,
        sum(n * engine.layout.page_bytes(g) for g, n in enumerate(engine.pages)) / GIB,
        f.max_seqs,
        engine.chunk,
    )
    log.info("%s", engine.layout.describe())
    if f.warmup:
        log.info(
            "warming up: at most %d compiled step shapes (compilation cache: %s); "
            "/health is 503 until ready",
            engine.shape_bound(),
            cache,
        )
    else:
        log.info(
            "no warm-up (--nowarmup): at most %d compiled step shapes, each when a request "
            "first needs it",
            engine.shape_bound(),
        )
    address = f"http://{'[' + f.host + ']' if ':' in f.host else f.host}:{f.port}"

    def ready() -> None:
        log.info(
            "ready: listening on %s (POST /v1/completions, GET /v1/models, /health, "
            "/metrics); Ctrl-C or SIGTERM drains for up to %g s",
            address,
            f.drain_s,
        )

    serve(
        engine,
        tokenizer,
        name,
        sock,
        drain_s=f.drain_s,
        max_body_bytes=int(f.max_body_mib * MIB),
        warmup=f.warmup,
        on_ready=ready,
    )
    log.info("stopped")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
