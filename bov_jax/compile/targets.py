"""Compile targets: accelerator names -> the devices of a topology description.

TPU slices are named as the TPU tools name them, `<generation>-<size>`: v4 and v5p count
TensorCores (two per chip: v5p-8 is 4 chips), v5e and v6e count chips (v6e-8 is 8 chips).
`jax.experimental.topologies` describes such a slice on any host once libtpu is installed
(requirements-aot.txt); a slice of more than one host (v5p-64: 32 chips, 8 hosts) gives the
devices of every host, so the mesh spans every chip.

NVIDIA targets (`h100`, `h200`, `a100`, with a GPU count) are described by the GpuTargetConfig
files in gpu_targets/ and need the CUDA plugin (`pip install jax[cuda12]` of the installed jax
version, about 5 GB); 8 GPUs per host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any

from bov_jax.errors import UserError

GIB = 2**30
GPUS_PER_HOST = 8


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    prefix: str  # as in topology names, "v5p:2x2x1"
    cores_per_chip: int  # the accelerator name counts cores (v4, v5p) or chips
    dims: int  # 3D torus (v4, v5p) or 2D (v5e, v6e)
    hbm_gib: float  # per chip
    chip_config: str | None  # v4's two cores form one device ("megacore")


TPU = {
    "v4": TpuGeneration("v4", 2, 3, 32, "megacore"),
    "v5p": TpuGeneration("v5p", 2, 3, 95, None),
    "v5e": TpuGeneration("v5e", 1, 2, 16, None),
    "v6e": TpuGeneration("v6e", 1, 2, 32, None),
}
GPU_FILES = {"h100": "h100.txtpb", "h200": "h200.txtpb", "a100": "a100.txtpb"}
MAX_2D_CHIPS = 256  # a full v5e / v6e pod, 16 x 16


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as given: "v5p-8", "h200"
    platform: str  # "tpu" or "gpu"
    chips: int
    hbm_bytes: int  # per chip
    topology: str  # "v5p:2x2x1", or the GPU topology "1x1x8"
    chip: str  # the key of its figures in bov_jax.compile.roofline.CHIPS: "v5e", "h200"
    options: tuple[tuple[str, Any], ...] = ()  # further get_topology_desc arguments

    @property
    def label(self) -> str:
        return f"{self.name} x{self.chips}" if self.platform == "gpu" else self.name


def known_targets() -> str:
    return f"TPU {', '.join(f'{g}-N' for g in TPU)} (e.g. v5p-8, v5e-4, v5p-64) or " + (
        f"NVIDIA {', '.join(GPU_FILES)} with --gpus=N"
    )


def topology_shape(chips: int, dims: int) -> tuple[int, ...]:
    """The chips' grid as the TPU tools lay it out: 4 -> 2x2x1 (3D) or 2x2, 8 -> 2x2x2 or 2x4,
    32 -> 2x4x4 or 4x8; the smallest axis (the last of equal ones) doubles first."""
    shape = [1] * dims if dims == 2 else [2, 2, 1]
    while math.prod(shape) < chips:
        smallest = min(shape)
        index = max(i for i, size in enumerate(shape) if size == smallest)
        shape[index] *= 2
    return tuple(shape)


def tpu_target(name: str, generation: TpuGeneration, size: int) -> Target:
    if size % generation.cores_per_chip:
        raise UserError(f"--target={name}: {generation.prefix} sizes count cores, 2 per chip")
    chips = size // generation.cores_per_chip
    smallest = 4 if generation.dims == 3 else 1
    largest = MAX_2D_CHIPS if generation.dims == 2 else 2**14
    valid = chips & (chips - 1) == 0 and smallest <= chips <= largest
    if not valid or (generation.dims == 2 and chips == 2):
        first = smallest * generation.cores_per_chip
        raise UserError(
            f"--target={name}: expected {generation.prefix}-N with N a power of two from {first}"
            + (f" (not 2) to {largest}" if generation.dims == 2 else "")
        )
    shape = topology_shape(chips, generation.dims)
    # v5e and v6e hosts hold up to 8 chips (a slice of up to 8 is one host), the others 4.
    per_host = (*shape, 1) if generation.dims == 2 and chips <= 8 else (2, 2, 1)
    options: list[tuple[str, Any]] = [("chips_per_host_bounds", per_host)]
    if generation.chip_config:
        options.append(("chip_config_name", generation.chip_config))
    return Target(
        name=name,
        platform="tpu",
        chips=chips,
        hbm_bytes=int(generation.hbm_gib * GIB),
        topology=f"{generation.prefix}:{'x'.join(map(str, shape))}",
        chip=generation.prefix,
        options=tuple(options),
    )


def gpu_config_text(model: str) -> str:
    return (resources.files("bov_jax.compile") / "gpu_targets" / GPU_FILES[model]).read_text()


def gpu_target(name: str, gpus: int) -> Target:
    if gpus < 1 or (gpus > GPUS_PER_HOST and gpus % GPUS_PER_HOST):
        raise UserError(
            f"--gpus={gpus}: expected 1 to {GPUS_PER_HOST} GPUs, or a multiple of "
            f"{GPUS_PER_HOST} ({GPUS_PER_HOST} per host)"
        )
    memory = re.search(r"device_memory_size:\s*(\d+)", gpu_config_text(name))
    assert memory, f"gpu_targets/{GPU_FILES[name]} has no device_memory_size"
    per_host = min(gpus, GPUS_PER_HOST)
    return Target(
        name=name,
        platform="gpu",
        chips=gpus,
        hbm_bytes=int(memory.group(1)),
        topology=f"1x{gpus // per_host}x{per_host}",
        chip=name,
    )


def resolve_target(name: str, gpus: int = GPUS_PER_HOST) -> Target:
    """The target named `name` (v5p-8, v6e-8, v5p-64, h200 with `gpus` GPUs)."""
    key = name.strip().lower()
    if key in GPU_FILES:
        return gpu_target(key, gpus)
    match = re.fullmatch(r"(v\d+[a-z]?)-(\d+)", key)
    if not match or match.group(1) not in TPU:
        raise UserError(f"unknown --target={name}; expected {known_targets()}")
    return tpu_target(name, TPU[match.group(1)], int(match.group(2)))


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """The environment variables of `variables` that are not set, set for the block."""
    added = {k: v for k, v in variables.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def accelerator_type(name: str) -> str:
    """The accelerator type as a TPU VM reports it: v5e slices are "v5litepod-N"."""
    return re.sub(r"^v5e-", "v5litepod-", name.strip().lower())


def target_devices(target: Target) -> list:
    """The target's devices (every host's), from its topology description."""
    from jax.experimental import topologies

    if target.platform == "tpu":
        # A compile-only client needs no lock on chips: another jax process of this host
        # that loaded libtpu (any jax program not pinned to the CPU) holds that lock. Off a
        # TPU VM, libtpu asks for the host's accelerator and workers: this target, this host.
        tpu_env = {
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
            "TPU_ACCELERATOR_TYPE": accelerator_type(target.name),
            "TPU_WORKER_HOSTNAMES": "localhost",
        }
        try:
            with environment(tpu_env):
                description = topologies.get_topology_desc(
                    topology_name=target.topology, platform="tpu", **dict(target.options)
                )
        except Exception as err:  # libtpu missing, or a topology it does not know
            raise UserError(
                f"cannot describe the TPU topology {target.topology} for --target={target.name}"
                f" ({str(err).splitlines()[0][:200]}); TPU targets need libtpu: "
                "pip install -r requirements-aot.txt"
            ) from err
    else:
        # The plugin checks the CUDA libraries against a local GPU unless told not to.
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        try:
            description = topologies.get_topology_desc(
                platform="cuda",
                target_config=gpu_config_text(target.name),
                topology=target.topology,
            )
        except Exception as err:  # no CUDA plugin, or a config it cannot read
            raise UserError(
                f"cannot describe --target={target.name} x{target.chips} "
                f"({str(err).splitlines()[0][:200]}); NVIDIA targets need the CUDA plugin: "
                "pip install 'jax[cuda12]==<the installed jax version>' (docs/targets.md)"
            ) from err
    devices = list(description.devices)
    if len(devices) != target.chips:
        raise UserError(
            f"--target={target.name}: the topology {target.topology} gave {len(devices)} "
            f"devices, expected {target.chips}"
        )
    return devices
