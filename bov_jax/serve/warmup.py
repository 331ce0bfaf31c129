"""Compile every step a configuration can run before the server says it is ready.

The engine's steps come in a bounded set of shapes (`Engine.shape_bound`): decoding steps
of R rows (a power of two up to max_seqs) of one token, prefill steps of one row of C
tokens (a power of two up to the chunk), each reading the spans `paged.spans_for` gives
for the bucket of the batch's last page. `step_shapes` lists exactly those, and
`compile_steps` runs each once on padding rows (counts 0: they write only the null page,
and the donated pools come back as the engine's), with the sampler at each row count, so
the jit caches hold every program a request can need. A request after that compiles
nothing: the first is as fast as the second.

With JAX's persistent compilation cache (`python -m bov_jax.serve --compilation_cache`),
a later start of the same configuration reads the programs from disk instead of
compiling them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
import numpy as np

from bov_jax.inference import paged, sampling
from bov_jax.inference.engine import Engine
from bov_jax.inference.sampling import Row, SamplingParams

log = logging.getLogger("bov_jax.serve")
Shape = tuple[int, int, tuple[tuple[int, int], ...]]  # (rows, columns, spans)


def step_shapes(engine: Engine) -> list[Shape]:
    """Every (rows, columns, spans) the engine's steps can take, decoding steps first, then
    prefill chunks, each from the fewest pages read up."""
    max_seqs, chunk, width = engine.config.max_seqs, engine.chunk, engine.width
    kinds = [(paged.bucket(n, max_seqs), 1) for n in range(1, max_seqs + 1)]
    kinds += [(1, paged.bucket(n, chunk)) for n in range(1, chunk + 1)]
    shapes: dict[Shape, None] = {}  # ordered, without repeats
    for rows, columns in dict.fromkeys(kinds):
        for end_page in range(width):
            spans = paged.spans_for(engine.layout, end_page, columns, width)
            shapes[(rows, columns, spans)] = None
    return list(shapes)


def run_step(engine: Engine, shape: Shape) -> jax.Array:
    """One step of `shape` on padding rows; its logits (rows, V). The engine's pools are
    donated to it and replaced by the ones it returns."""
    rows, columns, spans = shape
    zeros = np.zeros(rows, np.int32)
    inputs = paged.StepInput(
        np.zeros((rows, columns), np.int32), zeros, zeros, zeros, engine.allocator.tables([], rows)
    )
    return engine.run_step(inputs, spans)


def sample_padding(logits: jax.Array) -> None:
    """The sampler's greedy and default programs at logits' row count (`Engine._sample`)."""
    for params in (SamplingParams(temperature=0.0), SamplingParams()):
        sampling.sample_rows(logits, [Row(params, 0, 1, (0,), ())] * logits.shape[0])


def compile_steps(engine: Engine, stopping: Callable[[], bool] = lambda: False) -> None:
    """Compile (and run once) every step shape and the sampler at every row count; logs
    how many and how long. Call it on the thread that steps the engine, before it steps;
    it ends early once `stopping()` (the server is shutting down)."""
    start = time.monotonic()
    shapes = step_shapes(engine)
    sampled: set[int] = set()
    for shape in shapes:
        if stopping():
            log.info("warm-up stopped: the server is shutting down")
            return
        logits = run_step(engine, shape)
        if shape[0] not in sampled:
            sample_padding(logits)
            sampled.add(shape[0])
    jax.block_until_ready(engine.pools)
    log.info("warm-up: %d step shapes compiled in %.1f s", len(shapes), time.monotonic() - start)
