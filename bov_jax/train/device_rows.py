"""`train.device_batch_size = 0`: rows per device per micro-batch from the compiled targets.

The paper presets leave the micro-batch to the chip they run on: `COMPILED_ROWS` holds, per
model depth and chip, the rows per device that the ahead-of-time compiles of docs/targets.md
found to fit with the data-parallel mesh (`python -m bov_jax.compile`; the reports are in
docs/results/targets/, and tests/test_device_rows.py checks the table against them), or None
where no row count fits that way. BoV needs a few GiB more than the baseline at the same rows
(its banks and their moments); the entries are BoV's and hold for both. Elsewhere (no entry
for the chip, CPU, or a mesh with fsdp or tensor axes) `FALLBACK_ROWS` applies. Either is
lowered to the largest size that divides each device's rows per step.
"""

from __future__ import annotations

import re
from typing import Any

import jax

from bov_jax import sharding
from bov_jax.config import AUTO_DEVICE_ROWS
from bov_jax.errors import ConfigError
from bov_jax.train.layout import largest_divisor

FALLBACK_ROWS = 8

# (model.depth, chip) -> rows per device per micro-batch that fit with data parallelism, or
# None where even the smallest compiled size does not (compiled, not run).
COMPILED_ROWS: dict[tuple[int, str], int | None] = {
    (12, "v5p"): 32,
    (12, "v5e"): 8,
    (12, "v6e"): 32,
    (12, "h100"): 32,
    (12, "h200"): 32,
    (24, "v5p"): 16,
    (24, "v5e"): None,
    (24, "v6e"): 4,
    (24, "h100"): 8,
    (24, "h200"): 16,
}

_TPU_KINDS = {
    "TPU v4": "v4",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
}
_NVIDIA_MODEL = re.compile(r"\b(A100|H100|H200)\b")


def chip(device_kind: str) -> str | None:
    """The chip of a jax `device_kind` as the compile targets name it ("TPU v5 lite" -> "v5e",
    "NVIDIA H200 141GB HBM3e" -> "h200"); None for any other device."""
    if device_kind in _TPU_KINDS:
        return _TPU_KINDS[device_kind]
    found = _NVIDIA_MODEL.search(device_kind) if device_kind.startswith("NVIDIA") else None
    return found.group(1).lower() if found else None


def resolve(config: Any, total_batch_tokens: int, mesh: jax.sharding.Mesh) -> str | None:
    """Set `config.train.device_batch_size` when it is `AUTO_DEVICE_ROWS`; returns what was chosen
    and why (a log line), or None when the config gave a size. A chip that the table says
    cannot hold the model with data parallelism is a ConfigError."""
    train = config.train
    if train.device_batch_size != AUTO_DEVICE_ROWS:
        return None
    kind = mesh.devices.flat[0].device_kind
    key = (config.model.depth, chip(kind))
    data_parallel = mesh.shape.get("fsdp", 1) == mesh.shape.get("tensor", 1) == 1
    from_table = data_parallel and key in COMPILED_ROWS
    if from_table and COMPILED_ROWS[key] is None:
        raise ConfigError(
            f"train.device_batch_size=0 (auto): a depth-{key[0]} model does not fit {kind} "
            "chips with data parallelism at any compiled row count (docs/targets.md); shard "
            "it with --config.mesh.fsdp=N and give --config.train.device_batch_size=R"
        )
    per_step = total_batch_tokens // (config.model.seq_len * sharding.batch_size_per_step(mesh))
    train.device_batch_size = largest_divisor(
        max(1, per_step), COMPILED_ROWS[key] if from_table else FALLBACK_ROWS
    )
    source = (
        f"the compiled table for depth {key[0]} on {key[1]} (docs/targets.md)"
        if from_table
        else f"no compiled data-parallel entry for depth {key[0]} on {kind}: the fallback of "
        f"{FALLBACK_ROWS}"
    )
    return (
        f"train.device_batch_size=0 (auto): {train.device_batch_size} rows per device per "
        f"micro-batch, from {source}"
    )
