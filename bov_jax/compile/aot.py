"""Compile the steps `main` runs for a target's devices, from abstract state.

`Setup` builds what `bov_jax.train.loop` builds — the mesh over the target's devices (every
host's), the batch layout, the model, optimizer and the jitted initialiser of the state
(`train_state_init`) — without allocating anything: the initialiser is compiled for its
output shardings, and the state is ShapeDtypeStructs carrying them. The steps are the loop's
own (`make_train_step`, `make_eval_step`, the decode engine's prefill and decode loop),
lowered and compiled by the target's compiler.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bov_jax import sharding
from bov_jax.accounting import (
    TrainingPlan,
    attention_flops_per_token,
    param_counts,
    xla_attention_flops_per_token,
)
from bov_jax.compile import hlo, roofline
from bov_jax.compile.targets import Target
from bov_jax.files import write_text_atomic
from bov_jax.inference import decode
from bov_jax.model.spec import ModelSpec
from bov_jax.train import fsdp
from bov_jax.train.layout import BatchLayout
from bov_jax.train.optim import param_labels
from bov_jax.train.state import TrainState, train_state_init
from bov_jax.train.step import abstract_batch, make_eval_step, make_train_step

GIB = 2**30
STEPS = ("train", "eval", "prefill", "decode")
TOP_SOURCES = 8  # collective sources listed per step
DECODE_PROMPT = 8  # tokens of the prompt a decode is compiled for (one row, as main samples)


def abstract(shape: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `shape` (a tree of them) carrying `shardings` (the same tree)."""
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shape, shardings
    )


@dataclasses.dataclass
class Setup:
    """Everything the steps need, built as `loop.run` and `Trainer` build it, abstractly."""

    config: Any
    target: Target
    mesh: jax.sharding.Mesh
    plan: TrainingPlan
    processes: int
    spec: ModelSpec
    graphdef: Any
    tx: Any
    shardings: TrainState
    state: TrainState  # ShapeDtypeStructs with shardings

    @classmethod
    def build(cls, config: Any, target: Target, devices: list, plan: TrainingPlan) -> Setup:
        mesh = sharding.make_mesh(config.mesh, devices)
        graphdef, init, tx = train_state_init(config, plan, mesh)
        shardings = init.lower().compile().output_shardings
        state = abstract(jax.eval_shape(init), shardings)
        spec = ModelSpec.from_config(config.model, sharding.platform(mesh))
        processes = len({d.process_index for d in devices})
        return cls(config, target, mesh, plan, processes, spec, graphdef, tx, shardings, state)

    def schedule(self) -> fsdp.StepSchedule:
        """mesh.fsdp_gather and train.remat resolved for the target's memory at the current
        train.device_batch_size (what `main` would choose on the target)."""
        return fsdp.schedule_for(self.config, self.mesh, self.state, self.target.hbm_bytes)

    def layout(self) -> BatchLayout:
        return BatchLayout.resolve(self.config, self.plan, self.mesh, self.processes)

    def tokens(self, shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding.batch_sharding(self.mesh))

    def replicated(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.replicated(self.mesh))


def lowered_train(setup: Setup, schedule: fsdp.StepSchedule) -> Any:
    """The train step `main` runs, with `schedule`, lowered for the target."""
    layout, fault_step = setup.layout(), setup.config.train.fault_nonfinite_step
    step = make_train_step(
        setup.graphdef, setup.tx, setup.shardings, setup.mesh, fault_step, schedule
    )
    batch = abstract_batch(setup.mesh, layout.accum, layout.micro_rows, setup.spec.seq_len)
    return step.lower(setup.state, batch)


def lowered_steps(setup: Setup, names: tuple[str, ...]) -> dict[str, Any]:
    """{name: lowered step} for `names` out of STEPS but train (`train_report`)."""
    spec, layout = setup.spec, setup.layout()
    seq = spec.seq_len
    out = {}
    if "eval" in names:
        step = make_eval_step(setup.graphdef, setup.shardings, setup.mesh)
        batch = setup.tokens((layout.micro_rows, seq))
        token_bytes = setup.replicated((spec.vocab_size,), jnp.int32)
        out["eval"] = step.lower(
            setup.state.params, {"inputs": batch, "targets": batch}, token_bytes
        )
    if "prefill" in names or "decode" in names:
        out.update(lowered_decode(setup, names))
    return out


def lowered_decode(setup: Setup, names: tuple[str, ...]) -> dict[str, Any]:
    """The sampling engine's prefill and decode loop for one row over a cache of seq_len
    slots (what `main` runs for its samples), with the training parameters' shardings."""
    spec, params = setup.spec, setup.state.params
    slots = -(-spec.seq_len // decode.SLOT_MULTIPLE) * decode.SLOT_MULTIPLE
    static = dict(max_len=slots, dtype=jnp.dtype(spec.compute_dtype), eliminate_bank_v=True)
    prompt = setup.replicated((1, DECODE_PROMPT), jnp.int32)
    prefill = decode.prefill_step.lower(setup.graphdef, params, prompt, **static)
    out = {"prefill": prefill} if "prefill" in names else {}
    if "decode" in names:
        compiled = prefill.compile()
        logits, cache = abstract(
            jax.eval_shape(
                lambda p, t: decode.prefill_step(setup.graphdef, p, t, **static), params, prompt
            ),
            compiled.output_shardings,
        )
        rep = setup.replicated
        out["decode"] = decode.decode_loop.lower(
            setup.graphdef,
            params,
            cache,
            rep((1, slots), jnp.int32),
            logits,
            rep((1,), jnp.int32),
            rep((), jnp.int32),
            rep((), jnp.float32),  # temperature
            rep((), jnp.int32),  # top_k
            rep((), jnp.float32),  # top_p
            rep((), jnp.int32),  # seed
            rep((1,), jnp.int32),
        )
    return out


def memory(compiled: Any) -> dict[str, float]:
    """Per-device bytes, in GiB: arguments, outputs, aliased (donated) outputs, temporaries,
    and the peak: arguments + outputs - aliased + temporaries."""
    m = compiled.memory_analysis()
    peak = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    sizes = {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "alias": m.alias_size_in_bytes,
        "temporary": m.temp_size_in_bytes,
        "generated_code": m.generated_code_size_in_bytes,
        "peak": peak,
    }
    return {name: round(value / GIB, 4) for name, value in sizes.items()}


def analyse(
    setup: Setup, name: str, lowered: Any, margin: float, hlo_dir: str | None = None
) -> dict[str, Any]:
    """Compile one lowered step and read its memory, kernels, collectives and FLOPs; with
    `hlo_dir`, its optimized HLO is written there as <name>.hlo.txt."""
    start, cpu = time.perf_counter(), time.process_time()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        return out_of_memory(err, time.perf_counter() - start, time.process_time() - cpu)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    text = compiled.as_text()
    if hlo_dir:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(hlo_dir) / f"{name}.hlo.txt", text)
    module = hlo.parse(text)
    spec, layout = setup.spec, setup.layout()
    shards = setup.mesh.shape["tensor"]
    vocab = {spec.padded_vocab, spec.padded_vocab // shards, spec.vocab_size}
    rows = setup.config.train.device_batch_size
    mem = memory(compiled)
    hbm = setup.target.hbm_bytes / GIB
    kernels = hlo.attention_kernels(module)
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    report = {
        "compile_seconds": round(seconds, 1),
        "compile_cpu_seconds": round(cpu, 1),
        "memory_gib": mem,
        "fits": mem["peak"] <= hbm * (1 - margin),
        "attention_kernels": kernels["splash"] + kernels["cudnn"],
        "kernels": kernels,
        "interpreted_kernel_ops": hlo.interpreted_kernel_ops(module),
        "loop_trip_counts": hlo.loop_trip_counts(module),
        "collectives": hlo.collectives(module),
        "fp32_logits_buffers": hlo.large_fp32(module, vocab, rows * spec.seq_len),
        "xla_matmul_flops_per_device": hlo.matmul_flops(module),
        "xla_cost_analysis_flops_per_device": cost.get("flops"),
    }
    if name == "train":
        report["flops"] = train_flops(setup, layout, module)
        report.update(train_collectives(setup, module))
        report["prediction"] = predicted_step(setup, module, report)
    return report


def ideal_collective_bytes(setup: Setup, wire: bool = False) -> float:
    """What a step must move per device: on an fsdp mesh the compute copy gathered once (2 B
    per bf16 parameter), the fp32 gradient reduce-scattered once (4 B), Muon's bf16 update of
    its matrices gathered once (2 B) and, with a data axis too, each device's gradient shard
    all-reduced over it; on a data-parallel mesh the fp32 gradient all-reduced (4 B). As
    `hlo.collectives` counts bytes; with `wire`, as the links move them (`hlo.wire_factor`:
    (n-1)/n of a gather or reduce-scatter over n devices, 2(n-1)/n of a ring all-reduce)."""
    params = setup.state.params
    dims = fsdp.fsdp_dims(setup.shardings.params)
    labels = param_labels(params)
    data, shards = setup.mesh.shape["data"], setup.mesh.shape["fsdp"]

    def sized(path, x, dim, label):
        n = math.prod(x.shape)
        gathered = fsdp.transfer_dtype(path, x, setup.spec.compute_dtype).itemsize
        return (
            n,
            n * gathered if dim >= 0 else 0,
            n * 2 if label == "muon" and dim >= 0 else 0,
        )

    leaves = jax.tree.leaves(
        jax.tree_util.tree_map_with_path(sized, params, dims, labels),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    count, gathered, muon = (sum(column) for column in zip(*leaves))

    def factor(kind: str, devices: int) -> float:
        return hlo.wire_factor(kind, devices) if wire else 1.0

    across_data = 4.0 * count / shards * factor("all-reduce", data) if data > 1 else 0.0
    if shards == 1:
        return across_data
    fsdp_bytes = gathered * factor("all-gather", shards) + muon * factor("all-gather", shards)
    return fsdp_bytes + 4.0 * count * factor("reduce-scatter", shards) + across_data


def train_collectives(setup: Setup, module: hlo.Module) -> dict[str, Any]:
    """The train step's collectives per device per step against the ideal, per parameter, and
    their largest sources (kind, name scope, operand shape)."""
    kinds = hlo.collectives(module).values()
    total, wire = sum(c["bytes"] for c in kinds), sum(c["wire_bytes"] for c in kinds)
    ideal, ideal_wire = ideal_collective_bytes(setup), ideal_collective_bytes(setup, wire=True)
    count = param_counts(setup.spec).total
    return {
        "collective_bytes_per_step": total,
        "ideal_collective_bytes_per_step": ideal,
        "collectives_over_ideal": round(total / ideal, 3) if ideal else None,
        "collective_bytes_per_parameter": round(total / count, 2),
        "collective_wire_bytes_per_step": wire,
        "ideal_collective_wire_bytes_per_step": ideal_wire,
        "wire_over_ideal": round(wire / ideal_wire, 3) if ideal_wire else None,
        "collective_wire_bytes_per_parameter": round(wire / count, 2),
        "collective_sources": hlo.collective_sources(module, TOP_SOURCES),
    }


def predicted_step(setup: Setup, module: hlo.Module, report: dict[str, Any]) -> dict[str, Any]:
    """The step time's lower bounds on the target (bov_jax/compile/roofline.py)."""
    flops = report["flops"]
    in_kernels = setup.spec.attention_impl in ("splash", "cudnn")
    chips = setup.mesh.size
    kernel_flops = flops["analytic_attention_per_step"] / chips if in_kernels else 0.0
    return roofline.predict(
        setup.target.chip,
        chips=chips,
        hosts=setup.processes,
        platform=sharding.platform(setup.mesh),
        matmul_flops=report["xla_matmul_flops_per_device"],
        kernel_flops=kernel_flops,
        traffic_bytes=hlo.memory_traffic(module),
        collective_bytes=report["collective_wire_bytes_per_step"],
        model_flops_per_step=flops["analytic_per_step"],
    )


def out_of_memory(err: Exception, seconds: float, cpu: float) -> dict[str, Any]:
    """The report of a step the compiler refused for want of HBM (the TPU compiler stops at
    "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm ..."), with what it needed.

    The refusal names the temporaries it could not place, not the arguments beside them, so
    the reported peak is a lower bound (`peak_is_lower_bound`)."""
    message = next(line for line in str(err).splitlines() if "RESOURCE_EXHAUSTED" in line)
    needed = re.search(r"required[^(]*\(([\d.]+)([KMGT])", message)
    scale = {"K": 2**-20, "M": 2**-10, "G": 1.0, "T": 2**10}
    temporaries = float(needed[1]) * scale[needed[2]] if needed else None
    return {
        "compile_seconds": round(seconds, 1),
        "compile_cpu_seconds": round(cpu, 1),
        "memory_gib": {"temporaries": temporaries, "peak": temporaries},
        "peak_is_lower_bound": True,
        "fits": False,
        "compiler_refused": message.strip(),
    }


def train_flops(setup: Setup, layout: BatchLayout, module: hlo.Module) -> dict[str, Any]:
    """The step's FLOPs: XLA's (dots and convolutions of the compiled program, loop trip
    counts applied, summed over the chips) against bov_jax.accounting's analytic count.

    The model's share is what was traced in `fsdp.MICRO_BATCH_SCOPE` (forward, backward and
    loss); the rest is the optimizer's (Muon's orthogonalisation, replicated on every chip).
    Attention inside kernels (splash, cuDNN) is not a dot XLA sees; so the comparable analytic
    figure is the matmul part plus, for XLA attention only, the scores it computes
    (`accounting.xla_attention_flops_per_token`)."""
    spec = setup.spec
    tokens = layout.rows_per_step * spec.seq_len
    matmul = 6 * param_counts(spec).flop_matmul * tokens
    in_kernels = spec.attention_impl in ("splash", "cudnn")
    comparable = matmul + (0 if in_kernels else xla_attention_flops_per_token(spec) * tokens)
    xla = hlo.matmul_flops(module) * setup.mesh.size
    model = hlo.matmul_flops(module, traced_in=f"/{fsdp.MICRO_BATCH_SCOPE}/") * setup.mesh.size
    return {
        "xla_per_step": xla,
        "xla_model_per_step": model,
        "xla_optimizer_per_step": xla - model,
        "analytic_per_step": setup.plan.flops_per_token * tokens,
        "analytic_matmul_per_step": matmul,
        "analytic_attention_per_step": attention_flops_per_token(spec) * tokens,
        "comparable_analytic_per_step": comparable,
        "xla_model_over_comparable": model / comparable,
    }


def train_report(
    setup: Setup,
    margin: float,
    hlo_dir: str | None = None,
    recompute: bool = True,
    plain: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The train step's report with the schedule `main` would choose on the target: train.remat
    =auto recomputes the blocks only where the step compiled without it does not fit
    (`fsdp.fit_remat`; the step is then compiled twice). With `recompute` False the step is
    compiled without recomputation whatever its peak; `plain`, that step's report where it
    was compiled already."""
    reports: dict[bool, dict[str, Any]] = {} if plain is None else {False: plain}

    def peak_bytes(schedule: fsdp.StepSchedule) -> float:
        if schedule.remat not in reports:
            lowered = lowered_train(setup, schedule)
            reports[schedule.remat] = analyse(setup, "train", lowered, margin, hlo_dir)
        peak = reports[schedule.remat]["memory_gib"]["peak"]
        return math.inf if peak is None else peak * GIB

    schedule = setup.schedule()
    if recompute:
        schedule = fsdp.fit_remat(
            schedule, setup.config.train.remat, setup.target.hbm_bytes, peak_bytes
        )
    peak_bytes(schedule)
    report = dict(reports[schedule.remat], schedule=dataclasses.asdict(schedule))
    if schedule.remat and False in reports:
        report["without_remat"] = held_back(setup, reports[False], report)
    return report


def held_back(setup: Setup, plain: dict[str, Any], recomputed: dict[str, Any]) -> dict[str, Any]:
    """What keeps the step compiled without recomputation (`plain`) from fitting, by buffer
    (bytes per device): the sharded state, the step's buffers (`fsdp.step_buffers`) and the
    rest of its peak (the activations kept for the backward, and workspace); what recomputing
    the blocks (`recomputed`) frees of it (GiB), and the model FLOPs it costs."""
    peak = plain["memory_gib"]["peak"]
    buffers = {"sharded state": float(fsdp.per_device_bytes(setup.state))}
    step = fsdp.step_buffers(setup.state.params, setup.spec.compute_dtype)
    buffers.update({name: float(size) for name, size in step.items()})
    buffers["activations and workspace"] = peak * GIB - sum(buffers.values())
    flops = plain.get("flops", {}).get("xla_model_per_step")
    return {
        "peak_gib": peak,
        "buffers_bytes": buffers,
        "recomputation_frees_gib": round(peak - recomputed["memory_gib"]["peak"], 4),
        "model_flops_per_step": flops,
        "recomputation_flops_over_plain": (
            round(recomputed["flops"]["xla_model_per_step"] / flops, 4) if flops else None
        ),
    }


def compile_steps(
    setup: Setup, names: tuple[str, ...], margin: float, hlo_dir: str | None = None
) -> dict[str, dict[str, Any]]:
    lowered = lowered_steps(setup, names)
    return {
        name: train_report(setup, margin, hlo_dir)
        if name == "train"
        else analyse(setup, name, lowered[name], margin, hlo_dir)
        for name in names
    }


def row_candidates(setup: Setup) -> list[int]:
    """Every train.device_batch_size that splits the step's rows into whole micro-batches
    over the batch devices (and the processes), ascending."""
    rows = setup.plan.total_batch_tokens // setup.config.model.seq_len
    per_device = rows // sharding.batch_size_per_step(setup.mesh)
    batch_devices = sharding.batch_size_per_step(setup.mesh)
    return [
        r
        for r in range(1, per_device + 1)
        if per_device % r == 0 and (r * batch_devices) % setup.processes == 0
    ]


def largest_fitting_rows(
    setup: Setup, margin: float, log: Any = print
) -> tuple[int | None, dict[int, dict]]:
    """The largest device_batch_size whose train step fits (None if even 1 row does not) and
    the train report of every size tried. With train.remat=auto, steps without recomputation
    are searched first: fewer rows per micro-batch and more micro-batches do the same FLOPs,
    recomputing every block does more. Only where not even 1 row fits so is the search run
    again with recomputation. Where a size fits without it, the next larger size tried is
    compiled with recomputation too, and the chosen size's report says the FLOPs that saves
    (`recomputed_alternative`)."""
    auto = setup.config.train.remat == "auto"
    best, tried = search_rows(setup, margin, log, recompute=not auto)
    if auto and best is None:
        log("  not even 1 row fits without recomputation; searching with it")
        return search_rows(setup, margin, log, recompute=True)
    larger = [rows for rows in sorted(tried) if best is not None and rows > best]
    if auto and larger:
        setup.config.train.device_batch_size = larger[0]
        recomputed = train_report(setup, margin, plain=tried[larger[0]])
        tried[best]["recomputed_alternative"] = recomputed_alternative(
            larger[0], recomputed, tried[best]
        )
    return best, tried


def search_rows(
    setup: Setup, margin: float, log: Any, recompute: bool
) -> tuple[int | None, dict[int, dict]]:
    """Binary search over `row_candidates` for the largest size whose train step fits
    (memory grows with the rows), `train_report(recompute=...)` at each."""
    candidates = row_candidates(setup)
    tried: dict[int, dict] = {}
    low, high, best = 0, len(candidates) - 1, None
    while low <= high:
        middle = (low + high) // 2
        rows = candidates[middle]
        setup.config.train.device_batch_size = rows
        tried[rows] = train_report(setup, margin, recompute=recompute)
        peak = tried[rows]["memory_gib"]["peak"]
        log(
            f"  device_batch_size={rows}"
            + ("" if recompute else " without recomputation")
            + ": peak "
            + (f"{peak:.2f} GiB, " if peak is not None else "unknown, ")
            + ("fits" if tried[rows]["fits"] else "does not fit")
            + f" ({tried[rows]['compile_seconds']:.0f} s)"
        )
        if tried[rows]["fits"]:
            best, low = rows, middle + 1
        else:
            high = middle - 1
    return best, tried


def recomputed_alternative(rows: int, recomputed: dict, chosen: dict) -> dict[str, Any]:
    """The step at `rows` rows per micro-batch as train.remat=auto compiles it (`recomputed`)
    against the chosen step compiled without recomputation: its peak, schedule, what held
    its plain step back (`held_back`) and the model FLOPs per step the chosen one saves."""
    alternative = recomputed["flops"]["xla_model_per_step"]
    return {
        "device_batch_size": rows,
        "remat": recomputed["schedule"]["remat"],
        "fits": recomputed["fits"],
        "peak_gib": recomputed["memory_gib"]["peak"],
        "model_flops_per_step": alternative,
        "flops_saved": round(1 - chosen["flops"]["xla_model_per_step"] / alternative, 4),
        "without_remat": recomputed.get("without_remat"),
    }


def mesh_summary(setup: Setup) -> dict[str, Any]:
    return {
        "mesh": dict(setup.mesh.shape),
        "chips": setup.mesh.size,
        "hosts": setup.processes,
        "device_kind": np.asarray(setup.mesh.devices).flat[0].device_kind,
    }
