"""A compiled step's time on a target, bounded from below by what its chips can do.

Three lower bounds per step, from the compiled program (per device, loops weighted by their
trip counts) and the chip's published figures (CHIPS, with their sources):

  compute      the dots XLA compiled (`hlo.matmul_flops`), plus attention run inside kernels
               (splash, cuDNN: no dot XLA sees; the analytic count), over the dense bf16 peak;
  memory       the bytes the program's ops read and write in HBM (`hlo.memory_traffic`: each
               op outside a fusion reads its operands and writes its result; arrays TPU's
               compiler placed in on-chip VMEM do not count) over the HBM bandwidth;
  collectives  the collectives' bytes as the links move them (`hlo.wire_factor`) over the
               chip's link bandwidth in one direction: ICI for a TPU slice (every chip of a
               slice, multi-host ones too, is on ICI), NVLink within a GPU host, the network
               per GPU across GPU hosts.

The step cannot be faster than the largest bound (perfect overlap of the three) and the
model's MFU cannot exceed (analytic model FLOPs / chips / peak) / that bound. A real step adds
what the bounds leave out: kernels short of peak, launch gaps, exposed collectives.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published per-chip figures: dense bf16 FLOP/s, HBM bytes/s, link bytes/s (one
    direction; None where no per-chip figure is published), and bytes/s per chip across hosts
    (GPUs; None for TPU slices, which are ICI throughout)."""

    peak_flops: float
    hbm_bandwidth: float
    link_bandwidth: float | None
    network_bandwidth: float | None
    source: str


GB = 1e9
CHIPS = {
    "v4": Chip(275e12, 1200 * GB, None, None, "cloud.google.com/tpu/docs/v4 (no ICI figure)"),
    "v5e": Chip(197e12, 819 * GB, 200 * GB, None, "cloud.google.com/tpu/docs/v5e: ICI 1600 Gbps"),
    "v5p": Chip(459e12, 2765 * GB, 600 * GB, None, "cloud.google.com/tpu/docs/v5p: ICI 4800 Gbps"),
    "v6e": Chip(
        918e12, 1638 * GB, 400 * GB, None, "cloud.google.com/tpu/docs/v6e: ICI 800 GBps both ways"
    ),
    "h100": Chip(
        989e12,
        3350 * GB,
        450 * GB,
        50 * GB,
        "NVIDIA H100 SXM datasheet: NVLink 900 GB/s both ways; 400 Gb/s InfiniBand per GPU",
    ),
    "h200": Chip(
        989e12,
        4800 * GB,
        450 * GB,
        50 * GB,
        "NVIDIA H200 SXM datasheet: NVLink 900 GB/s both ways; 400 Gb/s InfiniBand per GPU",
    ),
    "a100": Chip(
        312e12,
        2039 * GB,
        300 * GB,
        25 * GB,
        "NVIDIA A100 80GB SXM datasheet: NVLink 600 GB/s both ways; 200 Gb/s InfiniBand per GPU",
    ),
}


def predict(
    chip: str,
    *,
    chips: int,
    hosts: int,
    platform: str,
    matmul_flops: float,
    kernel_flops: float,
    traffic_bytes: float,
    collective_bytes: float,
    model_flops_per_step: float,
) -> dict[str, Any]:
    """The bounds (seconds per step), the largest, and the MFU ceiling it implies; per-device
    figures except `model_flops_per_step` (the analytic count over all chips)."""
    spec = CHIPS[chip]
    over_network = platform == "gpu" and hosts > 1
    link = spec.network_bandwidth if over_network else spec.link_bandwidth
    bounds = {
        "compute": (matmul_flops + kernel_flops) / spec.peak_flops,
        "memory": traffic_bytes / spec.hbm_bandwidth,
    }
    if link is not None:
        bounds["collectives"] = collective_bytes / link
    slowest = max(bounds, key=bounds.get)
    step = bounds[slowest]
    return {
        "bounds_seconds": {name: round(value, 4) for name, value in bounds.items()},
        "step_seconds_lower_bound": round(step, 4),
        "bound_by": slowest,
        "mfu_ceiling": round(model_flops_per_step / chips / spec.peak_flops / step, 4),
        "chip": dataclasses.asdict(spec) | {"name": chip},
        "collectives_over": "the network" if over_network else "chip links",
    }
