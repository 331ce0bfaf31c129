"""python -m bov_jax.compile --config=CONFIG --target=TARGET [--device_batch_size=R |
--micro_batches=N] [--find_rows] [--steps=train,eval,prefill,decode] [--gpus=N] [--json_out=F]

Compiles, ahead of time and on this host (no accelerator used), the steps `main` would run
for TARGET, and reports per device: memory (arguments, outputs, temporaries, peak) against the
chip's HBM and whether it fits with --margin to spare, the attention kernels it lowered to,
its collectives by kind with bytes per step, any fp32 whole-batch logits buffer, XLA's FLOPs
against the analytic count, and the compile time. --find_rows searches the largest
train.device_batch_size whose train step fits. Config overrides as in bov_jax.main
(--config.mesh.fsdp=4). Targets: TPU slices (v4-8, v5e-4, v5e-8, v5p-8, v6e-8, v5p-64, ...;
libtpu from requirements-aot.txt) and NVIDIA h100, h200, a100 with --gpus (the CUDA plugin,
docs/targets.md). Compiled, not run: a step that fits here can still meet a runtime limit.

Exit status 0 when the train step fits (or --find_rows found a size), 1 when it does not,
2 for a bad flag, config, target or size.
"""

from __future__ import annotations

import os
import sys

import jax
from absl import flags
from ml_collections import config_flags

from bov_jax import cli
from bov_jax.config import check_config_arguments, define_config_flag
from bov_jax.errors import UserError

# Before any backend starts: this host's CPU is all the compiler needs (and a TPU host's
# chips stay free for a running job). JAX_PLATFORMS, when set, decides instead.
if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags (defined on use, as every command's)."""
    define_config_flag()
    flags.DEFINE_string("target", None, "v5p-8, v5e-4, v6e-8, v5p-64, ... or h100, h200, a100.")
    flags.DEFINE_integer("gpus", 8, "NVIDIA targets: the number of GPUs (8 per host).")
    flags.DEFINE_integer("device_batch_size", None, "Rows per device per micro-batch (overrides).")
    flags.DEFINE_integer("micro_batches", None, "Micro-batches per step (sets device_batch_size).")
    flags.DEFINE_bool("find_rows", False, "Find the largest device_batch_size that fits.")
    flags.DEFINE_list("steps", ["train"], "Steps to compile: train, eval, prefill, decode.")
    flags.DEFINE_float("margin", 0.1, "Share of HBM kept free (runtime, fragmentation).")
    flags.DEFINE_string("json_out", None, "Also write the report to this JSON file.")
    flags.DEFINE_string("hlo_dir", None, "Also write each compiled step's HLO text here.")


def count(n: int, noun: str) -> str:
    """'1 row', '2 rows', '1 micro-batch', '8 micro-batches'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('ch') else 's'}"


def fsdp_schedule(schedule: dict) -> str:
    """'gathered per step, blocks recomputed' from a report's schedule."""
    remat = ", blocks recomputed" if schedule["remat"] else ""
    return f"gathered per {schedule['gather']}{remat}"


def held_back_line(held: dict) -> str:
    """'  without recomputation: peak 16.69 GiB = sharded state 1.00 + ...' from a report."""
    parts = " + ".join(f"{name} {b / 2**30:.2f}" for name, b in held["buffers_bytes"].items())
    line = (
        f"  without recomputation: peak {held['peak_gib']:.2f} GiB = {parts}; recomputing the "
        f"blocks frees {held['recomputation_frees_gib']:.2f} GiB"
    )
    ratio = held["recomputation_flops_over_plain"]
    return line + (f" for {ratio - 1:.1%} more model FLOPs" if ratio else "")


def summary_lines(report: dict) -> list[str]:
    """The report as a few readable lines."""
    lines = [
        f"target {report['target']} ({report['device_kind']}, {count(report['chips'], 'chip')}, "
        f"{count(report['hosts'], 'host')}, {report['hbm_gib']:.1f} GiB HBM each); "
        f"mesh {report['mesh']}",
        f"config {report['config']}: {report['attention_impl']} attention, "
        f"{report['compute_dtype']} compute; {count(report['micro_batches'], 'micro-batch')} "
        f"of {count(report['device_batch_size'], 'row')} x {report['seq_len']} per device",
    ]
    for name, step in report["steps"].items():
        if "compiler_refused" in step:
            lines.append(
                f"{name}: does NOT fit, the compiler refused it: {step['compiler_refused']}"
            )
            continue
        m = step["memory_gib"]
        collectives = ", ".join(
            f"{kind} {c['count']:.0f}x {c['bytes'] / 2**30:.2f} GiB"
            for kind, c in step["collectives"].items()
        )
        lines += [
            f"{name}: peak {m['peak']:.2f} GiB (arguments {m['argument']:.2f}, outputs "
            f"{m['output']:.2f}, aliased {m['alias']:.2f}, temporaries {m['temporary']:.2f}): "
            + ("fits" if step["fits"] else "does NOT fit")
            + f" with {report['margin']:.0%} margin; compiled in {step['compile_seconds']:.0f} s",
            f"  attention kernels {step['attention_kernels']} {step['kernels']}; "
            f"fp32 logits buffers {step['fp32_logits_buffers'] or 'none'}",
            f"  collectives per step per device: {collectives or 'none'}",
        ]
        if "collective_bytes_per_step" in step:
            ideal = step["ideal_collective_bytes_per_step"]
            lines.append(
                f"  {fsdp_schedule(step['schedule'])}: collectives "
                f"{step['collective_bytes_per_step'] / 2**30:.2f} GiB per step per device = "
                f"{step['collective_bytes_per_parameter']:.1f} B per parameter; ideal "
                f"{ideal / 2**30:.2f} GiB"
                + (f" ({step['collectives_over_ideal']:.2f}x)" if ideal else "")
            )
            wire = step["ideal_collective_wire_bytes_per_step"]
            lines.append(
                f"    on the wire: {step['collective_wire_bytes_per_step'] / 2**30:.2f} GiB = "
                f"{step['collective_wire_bytes_per_parameter']:.1f} B per parameter; ideal "
                f"{wire / 2**30:.2f} GiB" + (f" ({step['wire_over_ideal']:.2f}x)" if wire else "")
            )
            lines += [
                f"    {c['kind']} {c['count']:.0f}x {c['shape']} in {c['scope']}: "
                f"{c['bytes'] / 2**30:.3f} GiB ({c['wire_bytes'] / 2**30:.3f} on the wire)"
                for c in step["collective_sources"][:4]
            ]
        if "without_remat" in step:
            lines.append(held_back_line(step["without_remat"]))
        if "recomputed_alternative" in step:
            alt = step["recomputed_alternative"]
            lines.append(
                f"  no recomputation at {count(report['device_batch_size'], 'row')}: "
                f"{alt['flops_saved']:.1%} fewer model FLOPs per step than "
                f"{count(alt['device_batch_size'], 'row')} with "
                + ("the blocks recomputed" if alt["remat"] else "no recomputation")
                + f" (peak {alt['peak_gib']:.2f} GiB, "
                + ("fits)" if alt["fits"] else "does not fit)")
            )
        if "prediction" in step:
            pr = step["prediction"]
            bounds = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in pr["bounds_seconds"].items())
            lines.append(
                f"  step time >= {pr['step_seconds_lower_bound'] * 1e3:.0f} ms ({pr['bound_by']} "
                f"bound; {bounds}); MFU ceiling {pr['mfu_ceiling']:.1%}"
            )
        if "flops" in step:
            f = step["flops"]
            lines.append(
                f"  FLOPs per step (all chips): XLA {f['xla_per_step']:.3e} = model "
                f"{f['xla_model_per_step']:.3e} + optimizer {f['xla_optimizer_per_step']:.3e}; "
                f"analytic {f['analytic_per_step']:.3e}; XLA model / comparable analytic "
                f"{f['xla_model_over_comparable']:.3f}"
            )
    if "find_rows" in report:
        best = report["find_rows"]["largest_fitting"]
        lines.append(f"largest fitting train.device_batch_size: {best}")
    return lines


def main(argv: list[str]) -> None:

    del argv  # cli.run refuses positional arguments
    for name in ("config", "target"):
        if not FLAGS[name].present:
            raise UserError(f"--{name} is required (--help explains the flags)")
    from bov_jax.compile.report import Options, run

    options = Options(
        target=FLAGS.target,
        gpus=FLAGS.gpus,
        steps=tuple(FLAGS.steps),
        margin=FLAGS.margin,
        device_batch_size=FLAGS.device_batch_size,
        micro_batches=FLAGS.micro_batches,
        find_rows=FLAGS.find_rows,
        config_name=config_flags.get_config_filename(FLAGS["config"]),
        hlo_dir=FLAGS.hlo_dir,
    )
    report = run(FLAGS.config, options)
    for line in summary_lines(report):
        print(line)
    if FLAGS.json_out:
        from bov_jax.files import write_json_atomic

        write_json_atomic(FLAGS.json_out, report)
    sys.exit(0 if report["fits"] else 1)


if __name__ == "__main__":
    define_flags()
    cli.run(main, check_argv=check_config_arguments)
