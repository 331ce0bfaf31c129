"""How many sequences one chip can serve at a context, read off the compiled engine.

    python -m bov_jax.inference.capacity --config=configs/d24_bov.py --target=h200 \\
        --contexts=2048,32768 [--page_size=16 --chunk=256 --margin=0.1 --json_out=F]

For the config's model with the baseline value path, with BoV keeping V pages, and with BoV
keeping none (the config's own value path must be BoV's: source bank, combine replace), it
compiles the engine's decoding step ahead of time for one chip of --target (TPU slices with
libtpu, NVIDIA GPUs with the CUDA plugin, as `bov_jax.compile`; nothing runs) and reports:

  weights            the parameters in the compute dtype (`engine.serving_params`)
  bytes per token    of the cache layout, every pool holding the token (`CacheLayout`)
  bytes a sequence   the most pages one sequence of the context holds at once: the
                     sliding-window groups release what their window left behind
  workspace          the compiled step's temporaries at that batch (XLA's memory analysis)
  sequences          the most sequences of the context whose pages fit in
                     HBM x (1 - margin) - weights - workspace, found by recompiling at each
                     candidate batch until the workspace it needs leaves room for it
  step, tokens/s     the decoding step's memory-bound lower time (its HBM bytes, read off
                     the compiled HLO, over the chip's bandwidth) at that batch, and the
                     tokens a second it implies (sequences / step time)

Compiled and estimated, not measured: a real step adds launch gaps and kernels short of
the bandwidth.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
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
MAX_ROUNDS = 14  # compilations in the search for the largest fitting batch
VARIANTS = ("baseline", "BoV, V pages", "BoV, no V pages")


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


def abstract_params(spec: ModelSpec, device) -> nnx.State:
    """The served parameters as ShapeDtypeStructs on `device`."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(spec)))
    placed = SingleDeviceSharding(device)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed), state)
    return graphdef, serving_params(state, spec.compute_dtype)


def nbytes(tree: Any) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


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
    layout = CacheLayout.build(spec, page_size, None, eliminate_bank_v)
    graphdef, params = abstract_params(spec, device)
    weights = nbytes(params)
    usable = int(target.hbm_bytes * (1 - margin)) - weights
    chunk = min(chunk, context)
    # The most sequences whose pages fit beside the step's own workspace at that batch:
    # between `low` (fits) and `high` (does not), first guessing what the last compiled
    # batch's workspace leaves room for (a smaller batch needs less), then by bisection. A
    # batch does not fit when its pages and workspace exceed the budget, or when the
    # compiler refuses it as too large for the chip (TPU's does).
    low, high = 0, layout.sequences_within(usable, context, chunk) + 1
    trial, compiled, guess = high - 1, None, None
    for _ in range(MAX_ROUNDS):
        if high - low <= 1:
            break
        pages = layout.pages_for(trial, context, chunk)
        try:
            candidate = compile_decode(graphdef, params, layout, device, trial, context, pages)
        except jax.errors.JaxRuntimeError as err:
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            candidate = None
        if candidate is not None:
            room = usable - candidate.memory_analysis().temp_size_in_bytes
            guess = layout.sequences_within(room, context, chunk)
        if candidate is not None and guess >= trial:
            low, compiled = trial, candidate
        else:
            high = trial
        first = compiled is None and guess is not None and low < guess < high
        trial = guess if first else (low + high) // 2
    sequences = low
    workspace = compiled.memory_analysis().temp_size_in_bytes if compiled else 0
    if compiled is None or sequences < 1:
        return Plan(
            name,
            context,
            weights,
            layout.bytes_per_token,
            layout.sequence_bytes(context),
            workspace,
            0,
            (),
            0.0,
            0.0,
            0.0,
            0,
        )
    analysis = compiled.memory_analysis()
    peak = (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )
    traffic = step_traffic.decode_step_bytes(hlo.parse(compiled.as_text()))
    seconds = traffic / roofline.CHIPS[target.chip].hbm_bandwidth
    return Plan(
        variant=name,
        context=context,
        weights_bytes=weights,
        bytes_per_token=layout.bytes_per_token,
        sequence_bytes=layout.sequence_bytes(context),
        workspace_bytes=workspace,
        sequences=sequences,
        pages=layout.pages_for(sequences, context, chunk),
        step_bytes=traffic,
        step_seconds=seconds,
        tokens_per_second=sequences / seconds,
        peak_bytes=peak,
    )


def report(
    spec: ModelSpec,
    target: Target,
    device,
    contexts: Sequence[int],
    page_size: int,
    chunk: int,
    margin: float,
) -> list[Plan]:
    """Every variant at every context."""
    return [
        plan(name, s, eliminate, target, device, context, page_size, chunk, margin)
        for context in contexts
        for name, (s, eliminate) in variants(spec).items()
    ]


def table(plans: Sequence[Plan], target: Target, margin: float) -> str:
    """A markdown table of the plans, with each variant's sequences against the baseline's."""
    base = {p.context: p.sequences for p in plans if p.variant == VARIANTS[0]}
    head = (
        f"One chip of {target.label}: {target.hbm_bytes / GIB:.1f} GiB HBM, {margin:.0%} kept "
        "free.\n\n"
        "| context | variant | weights GiB | bytes / token | MiB / sequence | workspace GiB "
        "| sequences | vs baseline | peak GiB | step >= ms | tokens/s <= |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [
        f"| {p.context:,} | {p.variant} | {p.weights_bytes / GIB:.2f} | {p.bytes_per_token:,} "
        f"| {p.sequence_bytes / 2**20:.1f} | {p.workspace_bytes / GIB:.2f} | {p.sequences:,} "
        f"| {p.sequences / max(base[p.context], 1):.3f} | {p.peak_bytes / GIB:.1f} "
        f"| {p.step_seconds * 1e3:.2f} | {p.tokens_per_second:,.0f} |"
        for p in plans
    ]
    return "\n".join([head, *rows])


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
    device = target_devices(target)[0]
    spec = ModelSpec.from_config(f.config.model, target.platform)
    plans = report(spec, target, device, contexts, f.page_size, f.chunk, f.margin)
    print(table(plans, target, f.margin))
    if f.json_out:
        rows = [p.row() for p in plans]
        write_json_atomic(f.json_out, {"target": target.name, "margin": f.margin, "plans": rows})


def define_flags() -> None:
    from absl import flags

    from bov_jax.config import define_config_flag

    define_config_flag()
    flags.DEFINE_string("target", None, "h200, h100, a100 (one GPU) or a TPU slice (one chip).")
    flags.DEFINE_list("contexts", ["2048", "32768"], "Context lengths, comma-separated.")
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
