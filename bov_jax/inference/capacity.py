"""How many sequences one chip can serve at a context, read off the compiled engine.

    python -m bov_jax.inference.capacity --config=configs/d24_bov.py --target=h200 \\
        --contexts=2048,32768 [--variants=... --page_size=16 --chunk=256 --margin=0.1 \\
        --json_out=F]

For the config's model with the baseline value path, with BoV keeping V pages, and with BoV
keeping none (the config's own value path must be BoV's: source bank, combine replace), it
compiles the engine's decoding step ahead of time for one chip of --target (TPU slices with
libtpu, NVIDIA GPUs with the CUDA plugin, as `bov_jax.compile`; nothing runs) and reports:

  weights            the parameters in the compute dtype (`engine.serving_params`)
  bytes per token    of the cache layout, every pool holding the token (`CacheLayout`)
  bytes a sequence   the most pages one sequence of the context holds at once, as the
                     allocator holds them: the sliding-window groups release what their
                     window left behind
  sequences          the most sequences of the context whose step fits in HBM x (1 - margin):
                     the compiled step's peak (its arguments: weights, pages as
                     `CacheLayout.pages_for` sizes them, block tables; its fp32 logits; its
                     temporaries; XLA's memory analysis) at most that
  workspace          the step's temporaries at that batch
  step, tokens/s     the decoding step's memory-bound lower time (its HBM bytes, read off
                     the compiled HLO, over the chip's bandwidth) at that batch, and the
                     tokens a second it implies (sequences / step time)
  ideal, ratio       the floor of a step: the weights once and each sequence's pages once
                     (weights + sequences x bytes a sequence), and the step's bytes over it;
                     the JSON breaks the step's bytes down by op (`step_traffic.sources`)

The search compiles few batches (`search`): the step's bytes beyond the weights and pages
(temporaries, logits, tables) grow about linearly with the batch, so it compiles at the
batch that would fit with none, fits that growth through the batches compiled so far, and
compiles the batch the fit predicts until a compiled batch fits and the fit says one more
would not (two to four compilations). The compiler's own log lines are kept back unless a
compilation fails.

On NVIDIA GPUs JAX preallocates 75% of the memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says
otherwise: the plan assumes 1 - margin of it, the fraction the server must set (the table's
head names it).

Compiled and estimated, not measured: a real step adds launch gaps and kernels short of
the bandwidth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from bov_jax.compile import hlo, roofline
from bov_jax.compile.targets import Target
from bov_jax.errors import ConfigError
from bov_jax.inference import paged, step_traffic
from bov_jax.inference.engine import serving_params
from bov_jax.inference.layout import CacheLayout
from bov_jax.model.gpt import GPT
from bov_jax.model.spec import ModelSpec
from bov_jax.model.values import ValuePathSpec

GIB = 2**30
MAX_ROUNDS = 8  # compilations in the search for the largest fitting batch, at most
TOP_SOURCES = 8  # ops of the step's bytes listed per plan
VARIANTS = ("baseline", "BoV, V pages", "BoV, no V pages")
JAX_GPU_FRACTION = 0.75  # of GPU memory JAX preallocates without XLA_PYTHON_CLIENT_MEM_FRACTION


@dataclasses.dataclass(frozen=True)
class Plan:
    """One variant at one context on one chip (module doc)."""

    variant: str
    context: int
    weights_bytes: int
    bytes_per_token: int
    sequence_bytes: int
    workspace_bytes: int
    sequences: int
    pages: tuple[int, ...]
    step_bytes: float
    step_seconds: float
    tokens_per_second: float
    peak_bytes: int
    ideal_bytes: int  # weights + sequences x sequence_bytes
    ratio: float  # step_bytes / ideal_bytes
    sources: tuple[tuple[str, float], ...]  # the step's largest bytes by op, (label, bytes)
    compilations: int
    seconds: float  # wall time of the plan's compilations and analysis

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def variants(spec: ModelSpec) -> dict[str, tuple[ModelSpec, bool]]:
    """{name: (spec, eliminate_bank_v)}: the baseline is the spec with the residual path."""
    if not spec.value_path.id_only:
        raise ConfigError(
            f"model.value_path is {spec.value_path}; capacity compares BoV (source='bank', "
            "combine='replace') with and without V pages against the baseline"
        )
    base = dataclasses.replace(spec, value_path=ValuePathSpec())
    return {VARIANTS[0]: (base, True), VARIANTS[1]: (spec, False), VARIANTS[2]: (spec, True)}


def abstract_params(spec: ModelSpec, layout: CacheLayout, device) -> nnx.State:
    """The served parameters as ShapeDtypeStructs on `device`."""
    model = nnx.eval_shape(lambda: GPT(spec))
    graphdef, state = nnx.split(model)
    placed = SingleDeviceSharding(device)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed), state)
    return graphdef, serving_params(model, state, layout)


def nbytes(tree: Any) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def pool_bytes(layout: CacheLayout, pages: Sequence[int]) -> int:
    """Bytes of the pools with pages[g] pages in group g."""
    return sum(count * layout.page_bytes(g) for g, count in enumerate(pages))


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keep what is written to the process's stderr (the compilers' C++ log lines: XLA's GPU
    scheduler logs an error whenever a program's arguments pass 80% of the device, which
    every plan near the memory line does) back, and write it out only if the block fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            sys.stderr.flush()
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def compile_decode(
    graphdef, params, layout: CacheLayout, device, sequences: int, context: int, pages
) -> Any:
    """The engine's decoding step for `sequences` rows at `context` positions, compiled."""
    placed = SingleDeviceSharding(device)
    width = -(-context // layout.page_size)

    def on_device(shape: tuple[int, ...], dtype=jnp.int32) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    pools = jax.tree.map(lambda x: on_device(x.shape, x.dtype), paged.abstract_pools(layout, pages))
    rows = on_device((sequences,))
    inputs = paged.StepInput(
        on_device((sequences, 1)),
        rows,
        rows,
        rows,
        tuple(on_device((sequences, width)) for _ in layout.groups),
    )
    spans = paged.spans_for(layout, width - 1, 1, width)
    lowered = paged.forward_step.lower(graphdef, params, pools, inputs, layout=layout, spans=spans)
    return lowered.compile()


def peak_bytes(compiled: Any) -> int:
    """The compiled step's peak: arguments + outputs - donated + temporaries."""
    analysis = compiled.memory_analysis()
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )


def fitted(extra: dict[int, int], cost: Callable[[int], int], limit: int) -> int:
    """The most sequences n with cost(n) + extra(n) <= limit, extra (the peak's bytes beyond
    `cost`, measured at the batches of `extra`, at least one) a line through the last two
    batches measured, or through 0 and the only one."""
    (n0, e0), (n1, e1) = ([(0, 0)] + list(extra.items()))[-2:]
    slope = (e1 - e0) / (n1 - n0)
    base = e1 - slope * n1
    fixed, each = cost(0), cost(1) - cost(0)
    return int((limit - fixed - base) // max(each + slope, 1))


def search(
    measure: Callable[[int], int | None],
    cost: Callable[[int], int],
    limit: int,
    upper: int,
    rounds: int = MAX_ROUNDS,
) -> tuple[int, int]:
    """(the most sequences n <= upper whose measured peak is at most `limit`, the batches
    measured). measure(n): the compiled peak at n, None if the compiler refused the batch as
    too large; cost(n): the bytes of the peak known without compiling (weights and pages), a
    line in n. Starts at `upper` and goes where `fitted` points, inside what is known to fit
    (low) and not (high), halving the gap when the fit points outside it or nothing was
    measured yet; stops once a measured batch fits and the fit (or a measurement) says the
    next does not."""
    low, high, extra = 0, upper + 1, {}
    trial = upper
    for count in range(1, rounds + 1):
        peak = measure(trial)
        if peak is not None:
            extra[trial] = peak - cost(trial)
        if peak is not None and peak <= limit:
            low = trial
        else:
            high = trial
        guess = fitted(extra, cost, limit) if extra else (low + high) // 2
        if high - low <= 1 or (guess == low and low in extra):
            return low, count
        trial = guess if low < guess < high else (low + high) // 2
    return low, rounds


def plan(
    name: str,
    spec: ModelSpec,
    eliminate_bank_v: bool,
    target: Target,
    device,
    context: int,
    page_size: int,
    chunk: int,
    margin: float,
) -> Plan:
    """The most sequences of `context` tokens the variant serves on one chip (module doc)."""
    began = time.perf_counter()
    layout = CacheLayout.build(spec, page_size, None, eliminate_bank_v)
    graphdef, params = abstract_params(spec, layout, device)
    weights = nbytes(params)
    limit = int(target.hbm_bytes * (1 - margin))
    chunk = min(chunk, context)
    compiled: dict[int, Any] = {}

    def cost(sequences: int) -> int:
        return weights + pool_bytes(layout, layout.pages_for(sequences, context, chunk))

    def measure(sequences: int) -> int | None:
        pages = layout.pages_for(sequences, context, chunk)
        try:
            with quiet():
                step = compile_decode(graphdef, params, layout, device, sequences, context, pages)
        except jax.errors.JaxRuntimeError as err:
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            return None
        compiled[sequences] = step
        return peak_bytes(step)

    upper = max(1, (limit - cost(0)) // (cost(1) - cost(0)))
    sequences, compilations = search(measure, cost, limit, upper)
    sequence_bytes = layout.sequence_bytes(context)
    ideal = weights + sequences * sequence_bytes
    step = compiled.get(sequences)
    if step is None:  # not even one sequence fits
        return Plan(
            variant=name,
            context=context,
            weights_bytes=weights,
            bytes_per_token=layout.bytes_per_token,
            sequence_bytes=sequence_bytes,
            workspace_bytes=0,
            sequences=0,
            pages=(),
            step_bytes=0.0,
            step_seconds=0.0,
            tokens_per_second=0.0,
            peak_bytes=0,
            ideal_bytes=ideal,
            ratio=0.0,
            sources=(),
            compilations=compilations,
            seconds=time.perf_counter() - began,
        )
    module = hlo.parse(step.as_text())
    traffic = step_traffic.decode_step_bytes(module)
    seconds = traffic / roofline.CHIPS[target.chip].hbm_bandwidth
    return Plan(
        variant=name,
        context=context,
        weights_bytes=weights,
        bytes_per_token=layout.bytes_per_token,
        sequence_bytes=sequence_bytes,
        workspace_bytes=step.memory_analysis().temp_size_in_bytes,
        sequences=sequences,
        pages=layout.pages_for(sequences, context, chunk),
        step_bytes=traffic,
        step_seconds=seconds,
        tokens_per_second=sequences / seconds,
        peak_bytes=peak_bytes(step),
        ideal_bytes=ideal,
        ratio=traffic / ideal,
        sources=tuple(step_traffic.sources(module)[:TOP_SOURCES]),
        compilations=compilations,
        seconds=time.perf_counter() - began,
    )


def report(
    spec: ModelSpec,
    target: Target,
    device,
    contexts: Sequence[int],
    page_size: int,
    chunk: int,
    margin: float,
    names: Sequence[str] = VARIANTS,
) -> list[Plan]:
    """The variants `names` (of VARIANTS) at every context."""
    return [
        plan(name, s, eliminate, target, device, context, page_size, chunk, margin)
        for context in contexts
        for name, (s, eliminate) in variants(spec).items()
        if name in names
    ]


def memory_fraction(target: Target, margin: float) -> str:
    """What the server must be given for the plan to hold: on NVIDIA GPUs the share of the
    GPU's memory JAX may take (1 - margin, not JAX's default 0.75)."""
    if target.platform != "gpu":
        return "the runtime gives JAX the whole HBM; nothing to set"
    held = target.hbm_bytes * JAX_GPU_FRACTION / GIB
    return (
        f"serve with XLA_PYTHON_CLIENT_MEM_FRACTION={1 - margin:.2f}: the plan assumes it "
        f"(JAX's default {JAX_GPU_FRACTION} would give {held:.1f} GiB)"
    )


def table(plans: Sequence[Plan], target: Target, margin: float) -> str:
    """A markdown table of the plans, with each variant's sequences against the baseline's."""
    base = {p.context: p.sequences for p in plans if p.variant == VARIANTS[0]}
    head = (
        f"One chip of {target.label}: {target.hbm_bytes / GIB:.1f} GiB HBM, {margin:.0%} kept "
        f"free; {memory_fraction(target, margin)}.\n\n"
        "| context | variant | weights GiB | bytes / token | MiB / sequence | workspace GiB "
        "| sequences | vs baseline | peak GiB | step GB | ideal GB | ratio | step >= ms "
        "| tokens/s <= |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [
        f"| {p.context:,} | {p.variant} | {p.weights_bytes / GIB:.2f} | {p.bytes_per_token:,} "
        f"| {p.sequence_bytes / 2**20:.1f} | {p.workspace_bytes / GIB:.2f} | {p.sequences:,} "
        f"| {f'{p.sequences / base[p.context]:.3f}' if base.get(p.context) else '-'} "
        f"| {p.peak_bytes / GIB:.1f} | {p.step_bytes / 1e9:.1f} | {p.ideal_bytes / 1e9:.1f} "
        f"| {p.ratio:.2f} | {p.step_seconds * 1e3:.2f} | {p.tokens_per_second:,.0f} |"
        for p in plans
    ]
    return "\n".join([head, *rows])


def breakdown(plans: Sequence[Plan]) -> str:
    """Per plan, the step's largest bytes by op (`step_traffic.sources`), and its time."""
    lines = ["Step bytes by op (GB), largest first:"]
    for p in plans:
        ops = "; ".join(f"{label} {moved / 1e9:.2f}" for label, moved in p.sources)
        lines.append(
            f"- {p.context:,} {p.variant} ({p.compilations} compilations, {p.seconds:.0f} s): {ops}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from absl import flags

    from bov_jax.compile.targets import resolve_target, target_devices
    from bov_jax.errors import UserError
    from bov_jax.files import write_json_atomic

    del argv
    f = flags.FLAGS
    if not f["config"].present or not f.target:
        raise UserError("--config and --target are required (--help explains the flags)")
    contexts = [int(c) for c in f.contexts]
    target = resolve_target(f.target, 1)
    with quiet():
        device = target_devices(target)[0]
    spec = ModelSpec.from_config(f.config.model, target.platform)
    plans = report(spec, target, device, contexts, f.page_size, f.chunk, f.margin, f.variants)
    print(table(plans, target, f.margin))
    print()
    print(breakdown(plans))
    if f.json_out:
        rows = [p.row() for p in plans]
        write_json_atomic(
            f.json_out,
            {
                "target": target.name,
                "margin": f.margin,
                "memory": memory_fraction(target, f.margin),
                "plans": rows,
            },
        )


def define_flags() -> None:
    from absl import flags

    from bov_jax.config import define_config_flag

    define_config_flag()
    flags.DEFINE_string("target", None, "h200, h100, a100 (one GPU) or a TPU slice (one chip).")
    flags.DEFINE_list("contexts", ["2048", "32768"], "Context lengths, comma-separated.")
    flags.DEFINE_multi_enum(
        "variants", list(VARIANTS), VARIANTS, "The variants to plan (repeat the flag for several)."
    )
    flags.register_validator(
        "contexts",
        lambda values: all(v.isdigit() and int(v) > 1 for v in values),
        "expected integers > 1, comma-separated",
    )
    flags.DEFINE_integer("page_size", 16, "Tokens a cache page.")
    flags.DEFINE_integer("chunk", 256, "Prompt tokens prefilled a step at most.")
    flags.DEFINE_float("margin", 0.1, "Share of HBM kept free (runtime, fragmentation).")
    flags.DEFINE_string("json_out", None, "Also write the plans to this JSON file.")


if __name__ == "__main__":
    # the host's CPU compiles; JAX_PLATFORMS, when set, decides instead
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    from bov_jax import cli
    from bov_jax.config import check_config_arguments

    define_flags()
    cli.run(main, check_argv=check_config_arguments)
