"""One compile report: target -> devices -> setup -> compiled steps -> a JSON-able dict.

Keys: `fits`, `peak_memory_gib`, `hbm_gib`, `attention_kernels` and `collectives` describe the
train step (or the first step compiled); `steps` holds every compiled step's figures
(bov_jax.compile.aot.analyse) and `find_rows` the sizes tried by --find_rows.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from bov_jax import sharding
from bov_jax.accounting import training_plan
from bov_jax.compile import aot
from bov_jax.compile.targets import resolve_target, target_devices
from bov_jax.config import ConfigError, config_errors, validate_config
from bov_jax.errors import UserError
from bov_jax.model.spec import resolve_auto
from bov_jax.train import device_rows

COMPILER_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


@dataclasses.dataclass(frozen=True)
class Options:
    target: str
    gpus: int = 8
    steps: tuple[str, ...] = ("train",)
    margin: float = 0.1  # share of HBM kept free
    device_batch_size: int | None = None
    micro_batches: int | None = None
    find_rows: bool = False
    config_name: str = ""
    hlo_dir: str | None = None  # where the compiled steps' HLO text goes

    def check(self) -> None:
        unknown = set(self.steps) - set(aot.STEPS)
        if unknown or not self.steps:
            raise UserError(
                f"--steps={','.join(self.steps)}; expected some of {', '.join(aot.STEPS)}"
            )
        if not 0 <= self.margin < 1:
            raise UserError(f"--margin={self.margin}; expected a share in [0, 1)")
        if self.device_batch_size is not None and self.micro_batches is not None:
            raise UserError("give --device_batch_size or --micro_batches, not both")
        for name in ("device_batch_size", "micro_batches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name}={value}; expected a positive integer")


def set_rows(setup: aot.Setup, options: Options, log: Any) -> None:
    """--device_batch_size or --micro_batches into config.train.device_batch_size; without
    them, a configured size that does not split the step's rows over the target's batch
    devices becomes the largest one below it that does (configs are written for the
    devices of their authors, often fewer)."""
    train = setup.config.train
    if options.device_batch_size is None and options.micro_batches is None:
        chosen = device_rows.resolve(setup.config, setup.plan.total_batch_tokens, setup.mesh)
        if chosen:
            log(chosen)
    rows_per_step = setup.plan.total_batch_tokens // setup.config.model.seq_len
    batch_devices = sharding.batch_size_per_step(setup.mesh)
    if options.device_batch_size is not None:
        train.device_batch_size = options.device_batch_size
    elif options.micro_batches is not None:
        split = options.micro_batches * batch_devices
        if rows_per_step % split:
            raise ConfigError(
                f"--micro_batches={options.micro_batches} does not split the step's "
                f"{rows_per_step} rows over {batch_devices} batch devices"
            )
        train.device_batch_size = rows_per_step // split
    elif train.device_batch_size not in aot.row_candidates(setup):
        fitting = [r for r in aot.row_candidates(setup) if r < train.device_batch_size]
        if fitting:
            log(
                f"train.device_batch_size={train.device_batch_size} does not split the step's "
                f"{rows_per_step} rows over {batch_devices} batch devices; using {fitting[-1]}"
            )
            train.device_batch_size = fitting[-1]


def progress(line: str) -> None:
    print(line, flush=True)


def run(config: Any, options: Options, log: Any = progress) -> dict[str, Any]:
    """Compile `options.steps` of `config` for `options.target`; the report (module doc).
    `log` takes progress lines (None: quiet)."""
    log = log or (lambda line: None)
    options.check()
    validate_config(config)
    target = resolve_target(options.target, options.gpus)
    devices = target_devices(target)
    plan = training_plan(config)
    with config_errors():
        setup = aot.Setup.build(config, target, devices, plan)
        set_rows(setup, options, log)
        report: dict[str, Any] = {"target": target.label, **aot.mesh_summary(setup)}
        if options.find_rows:
            log(f"searching train.device_batch_size for {target.label} ...")
            best, tried = aot.largest_fitting_rows(setup, options.margin, log)
            report["find_rows"] = {
                "largest_fitting": best,
                "tried": {rows: step["memory_gib"]["peak"] for rows, step in tried.items()},
            }
            if best is None:
                raise NoFit(f"not even 1 row per device fits {target.label}")
            config.train.device_batch_size = best
        setup.layout()  # the size is valid before anything compiles
        known = {"train": tried[best]} if options.find_rows else {}
        rest = tuple(name for name in options.steps if name not in known)
        steps = {**known, **aot.compile_steps(setup, rest, options.margin, options.hlo_dir)}
        steps = {name: steps[name] for name in options.steps}
    first = steps[options.steps[0]]
    layout = setup.layout()
    platform = sharding.platform(setup.mesh)
    return {
        **report,
        "config": options.config_name,
        "fits": first["fits"],
        "peak_memory_gib": first["memory_gib"]["peak"],
        "hbm_gib": round(target.hbm_bytes / aot.GIB, 2),
        "margin": options.margin,
        "attention_kernels": first.get("attention_kernels"),
        "collectives": first.get("collectives"),
        "attention_impl": resolve_auto("attention_impl", config.model.attention_impl, platform),
        "compute_dtype": resolve_auto("compute_dtype", config.model.compute_dtype, platform),
        "device_batch_size": config.train.device_batch_size,
        "micro_batches": layout.accum,
        "rows_per_step": layout.rows_per_step,
        "seq_len": config.model.seq_len,
        "steps": steps,
        # The compiler options in effect (libtpu reads LIBTPU_INIT_ARGS, XLA XLA_FLAGS).
        "compiler_flags": {k: os.environ[k] for k in COMPILER_FLAG_VARIABLES if os.environ.get(k)},
        "note": "compiled ahead of time for the target, not run",
    }


class NoFit(UserError):
    """--find_rows found no size that fits."""

    exit_status = 1
