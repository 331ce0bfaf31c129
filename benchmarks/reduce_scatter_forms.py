"""What the fsdp gradient's reduce-scatter over every chip of a TPU slice compiles to, per target.

    PYTHONPATH=. python benchmarks/reduce_scatter_forms.py [TARGET ...]  # default below

For each target, compiled ahead of time (libtpu, no chip needed) on the mesh `bov_jax` builds
(`jax.make_mesh`, fsdp over every chip): one fp32 gradient f32[2048, 8192] (a d32 MLP matrix)
summed over the chips and split by rows inside a `shard_map`, written two ways:
- `flat`: one `psum_scatter` over the fsdp axis;
- `staged`: `bov_jax.train.torus.reduce_scatter` with the stages `scatter_stages` finds for
  the mesh (what the train step runs; printed only where there are stages).
Per form: the collective ops of the optimized HLO as `bov_jax.compile.hlo` counts them (the
all-reduce-scatter fusion counts as a reduce-scatter) with their group sizes, the bytes each
device puts on the wire over the ideal reduce-scatter's ((n-1)/n of the gradient), and the
MiB the all-reduces among them return (each device then holds that much of the reduced
gradient, not only its rows). docs/targets.md quotes this table.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from bov_jax.compile import hlo, targets
from bov_jax.train import torus

DEFAULT_TARGETS = ("v5e-8", "v6e-8", "v5p-8", "v4-16", "v5p-16", "v5p-64", "v5p-128")
ROWS, COLUMNS = 2048, 8192
AXIS = "fsdp"


def torus_shape(devices: list) -> str:
    """'2x4x4': the slice's chips per torus dimension, from the devices' coordinates."""
    coords = np.array([d.coords for d in devices])
    return "x".join(str(int(size)) for size in coords.max(axis=0) + 1 if size > 1)


def compile_forms(devices: list) -> dict[str, hlo.Module]:
    """{form: optimized HLO} of the gradient's reduce-scatter over `devices` (module docstring)."""
    mesh = jax.make_mesh((len(devices),), (AXIS,), devices=devices)
    split = PartitionSpec(AXIS, None)
    rows = jax.ShapeDtypeStruct(
        (64 * len(devices), ROWS), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(AXIS))
    )
    weight = jax.ShapeDtypeStruct((ROWS, COLUMNS), jnp.float32, sharding=NamedSharding(mesh, split))
    forms = {"flat": ()}
    if stages := torus.scatter_stages(mesh, AXIS):
        forms["staged"] = stages
    out = {}
    for form, stages in forms.items():

        def reduced(x: jax.Array, w: jax.Array, stages=stages) -> jax.Array:
            """This device's rows of the summed gradient from its (64, ROWS) rows of x."""
            partial = jnp.tile(x.T @ x, (1, COLUMNS // ROWS)) * w[0, 0]
            return torus.reduce_scatter(partial, AXIS, 0, stages)

        step = jax.shard_map(
            reduced, mesh=mesh, in_specs=(PartitionSpec(AXIS), split), out_specs=split
        )
        out[form] = hlo.parse(jax.jit(step).lower(rows, weight).compile().as_text())
    return out


def table_row(name: str, devices: list, form: str, module: hlo.Module) -> str:
    runs = list(hlo.collective_runs(module))
    ops = ", ".join(f"{r.kind} over {hlo.group_size(module, r.instruction)}" for r in runs)
    chips = len(devices)
    ideal = ROWS * COLUMNS * 4 * (chips - 1) / chips
    wire = sum(r.wire_bytes * r.times for r in runs)
    reduced_whole = sum(r.bytes * r.times for r in runs if r.kind == "all-reduce") / 2**20
    shape = torus_shape(devices)
    return f"| {name} | {shape} | {form} | {ops} | {wire / ideal:.2f} | {reduced_whole:.0f} |"


def main(names: list[str]) -> None:
    print(
        "| target | torus | form | collective ops (group size) | wire / ideal | all-reduced MiB |"
    )
    print("|---|---|---|---|---:|---:|")
    for name in names:
        devices = targets.target_devices(targets.resolve_target(name))
        for form, module in compile_forms(devices).items():
            print(table_row(name, devices, form, module), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(DEFAULT_TARGETS))
