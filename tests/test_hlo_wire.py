"""Collectives counted as the links move them (`hlo.wire_factor`), on hand-written HLO: each
kind's algorithm over its replica groups, the group forms XLA prints, and loop weights."""

import pytest

from bov_jax.compile import hlo

MIB = 2**20


def module(body: str, header: str = "num_partitions=8") -> hlo.Module:
    return hlo.parse(
        f"HloModule m, is_scheduled=true, {header}\n\n"
        "ENTRY %main (p: f32[1048576]) -> f32[1048576] {\n"
        "  %p = f32[1048576]{0} parameter(0)\n"
        f"{body}\n"
        "}\n"
    )


# Each op works on a 4 MiB fp32 array over groups of 4 devices (of 8).
GROUPS_OF_4 = "replica_groups={{0,1,2,3},{4,5,6,7}}"
CASES = {
    # a ring all-reduce: a reduce-scatter and an all-gather, 2 (n-1)/n of the operand
    "all-reduce": (f"%r = f32[1048576]{{0}} all-reduce(%p), {GROUPS_OF_4}, to_apply=%add", 4, 6),
    # each device receives the other n-1 parts of the result: (n-1)/n of the result
    "all-gather": (
        f"%r = f32[4194304]{{0}} all-gather(%p), {GROUPS_OF_4}, dimensions={{0}}",
        16,
        12,
    ),
    # each device sends n-1 of its operand's n parts: (n-1)/n of the operand
    "reduce-scatter": (
        f"%r = f32[262144]{{0}} reduce-scatter(%p), {GROUPS_OF_4}, dimensions={{0}}, to_apply=%add",
        4,
        3,
    ),
    "all-to-all": (f"%r = f32[1048576]{{0}} all-to-all(%p), {GROUPS_OF_4}, dimensions={{0}}", 4, 3),
    # a permute sends its whole operand to one peer
    "collective-permute": (
        "%r = f32[1048576]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}",
        4,
        4,
    ),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_each_collective_is_counted_by_operand_and_by_wire(kind):
    body, operand_mib, wire_mib = CASES[kind]
    [(found, counts)] = hlo.collectives(module(body)).items()
    assert found == kind and counts["count"] == 1
    assert counts["bytes"] == operand_mib * MIB
    assert counts["wire_bytes"] == pytest.approx(wire_mib * MIB)


@pytest.mark.parametrize(
    "groups, size",
    [
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", 2),  # across the first mesh axis
        ("replica_groups=[2,4]<=[8]", 4),  # XLA's iota form: 2 groups of 4
        ("replica_groups=[1,8]<=[2,4]T(1,0)", 8),
        ("replica_groups={}", 8),  # every device of the module
        ("", 8),
    ],
)
def test_group_sizes_in_every_form_xla_prints(groups, size):
    m = module(f"%r = f32[1048576]{{0}} all-reduce(%p), {groups}, to_apply=%add")
    [instruction] = [i for i in m.computations["main"] if i.opcode == "all-reduce"]
    assert hlo.group_size(m, instruction) == size
    assert hlo.collectives(m)["all-reduce"]["wire_bytes"] == pytest.approx(
        4 * MIB * 2 * (size - 1) / size
    )


def test_every_device_of_a_multi_replica_module_and_a_group_of_one():
    m = module(
        "%r = f32[1048576]{0} all-reduce(%p), replica_groups={}, to_apply=%add",
        header="num_partitions=4, replica_count=2",
    )
    assert m.devices == 8
    alone = module(f"%r = f32[1048576]{{0}} all-gather(%p), {'replica_groups={{0},{1}}'}")
    assert hlo.collectives(alone)["all-gather"]["wire_bytes"] == 0  # nothing leaves a device


def test_async_pairs_count_once_and_loops_by_their_trips():
    text = (
        "HloModule m, num_partitions=4\n\n"
        "%body (t: (s32[], f32[1048576])) -> (s32[], f32[1048576]) {\n"
        "  %t = (s32[], f32[1048576]{0}) parameter(0)\n"
        "  %x = f32[1048576]{0} get-tuple-element(%t), index=1\n"
        "  %s = f32[1048576]{0} all-reduce-start(%x), replica_groups={{0,1,2,3}}, to_apply=%add\n"
        "  %d = f32[1048576]{0} all-reduce-done(%s)\n"
        "  %i = s32[] get-tuple-element(%t), index=0\n"
        "  ROOT %o = (s32[], f32[1048576]{0}) tuple(%i, %d)\n"
        "}\n\n"
        "%cond (t: (s32[], f32[1048576])) -> pred[] {\n"
        "  %t = (s32[], f32[1048576]{0}) parameter(0)\n"
        "  ROOT %c = pred[] constant(true)\n"
        "}\n\n"
        "ENTRY %main (p: (s32[], f32[1048576])) -> (s32[], f32[1048576]) {\n"
        "  %p = (s32[], f32[1048576]{0}) parameter(0)\n"
        "  ROOT %w = (s32[], f32[1048576]{0}) while(%p), condition=%cond, body=%body, "
        'backend_config={"known_trip_count":{"n":"3"}}\n'
        "}\n"
    )
    counts = hlo.collectives(hlo.parse(text))["all-reduce"]
    assert counts["count"] == 3 and counts["bytes"] == 3 * 4 * MIB
    assert counts["wire_bytes"] == pytest.approx(3 * 4 * MIB * 2 * 3 / 4)


def all_reduce_scatter_fusion(root: str) -> hlo.Module:
    """A reduce-scatter as XLA TPU writes it: a fusion all-reducing the padded gradient over
    8 devices, `root` the fusion's result (the partition's slice, or the whole)."""
    return hlo.parse(
        "HloModule m, num_partitions=8\n\n"
        "%all-reduce-scatter (input: f32[32768,8]) -> f32[4200,8] {\n"
        "  %input = f32[32768,8]{1,0} parameter(0)\n"
        "  %zero = f32[] constant(0)\n"
        "  %pad = f32[33600,8]{1,0} pad(%input, %zero), padding=0_832x0_0\n"
        "  %ar = f32[33600,8]{1,0} all-reduce(%pad), replica_groups={{0,1,2,3,4,5,6,7}}, "
        "to_apply=%add\n"
        "  %id = u32[] partition-id()\n"
        "  %rows = u32[] constant(4200)\n"
        "  %at = u32[] multiply(%id, %rows)\n"
        "  %col = u32[] constant(0)\n"
        f"  ROOT %out = {root}\n"
        "}\n\n"
        "ENTRY %main (g: f32[32768,8]) -> f32[4200,8] {\n"
        "  %g = f32[32768,8]{1,0} parameter(0)\n"
        "  ROOT %f = f32[4200,8]{1,0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter, "
        'backend_config={"collective_algorithm_config":{"emitter":'
        '"SingleInputAllReduceScatterFusion"}}\n'
        "}\n"
    )


def test_xla_tpus_all_reduce_scatter_fusion_counts_as_a_reduce_scatter():
    padded = 33600 * 8 * 4
    sliced = "f32[4200,8]{1,0} dynamic-slice(%ar, %at, %col), dynamic_slice_sizes={4200,8}"
    counts = hlo.collectives(all_reduce_scatter_fusion(sliced))
    assert list(counts) == ["reduce-scatter"] and counts["reduce-scatter"]["count"] == 1
    assert counts["reduce-scatter"]["bytes"] == padded
    assert counts["reduce-scatter"]["wire_bytes"] == pytest.approx(padded * 7 / 8)
    whole = hlo.collectives(all_reduce_scatter_fusion("f32[33600,8]{1,0} copy(%ar)"))
    assert list(whole) == ["all-reduce"]  # a fusion that keeps the reduced whole all-reduces
    assert whole["all-reduce"]["wire_bytes"] == pytest.approx(padded * 2 * 7 / 8)


def test_a_tables_psum_scatter_compiled_for_v5e_8_reads_as_a_reduce_scatter():
    # XLA TPU compiles this psum_scatter of a scatter-added table gradient to its
    # all-reduce-scatter fusion on v5e-8 (an all-reduce inside, the partition's rows out).
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from bov_jax.compile import targets

    devices = np.array(targets.target_devices(targets.resolve_target("v5e-8")))
    mesh = Mesh(devices.reshape(1, 8), ("data", "fsdp"))
    rows, width = 32768, 1536  # the d24 bank; a narrow table gets a plain reduce-scatter

    def table_gradient(table: jax.Array, ids: jax.Array) -> jax.Array:
        update = jnp.ones((ids.shape[0], width), jnp.float32) * table[0, 0]
        summed = jnp.zeros((rows, width), jnp.float32).at[ids].add(update)
        return jax.lax.psum_scatter(summed, "fsdp", scatter_dimension=0, tiled=True)

    split, batch = PartitionSpec("fsdp", None), PartitionSpec(("data", "fsdp"))
    step = jax.shard_map(
        table_gradient, mesh=mesh, in_specs=(split, batch), out_specs=split, check_vma=False
    )
    table = jax.ShapeDtypeStruct((rows, width), jnp.float32, sharding=NamedSharding(mesh, split))
    ids = jax.ShapeDtypeStruct((512,), jnp.int32, sharding=NamedSharding(mesh, batch))
    module = hlo.parse(jax.jit(step).lower(table, ids).compile().as_text())
    assert hlo.scattering_all_reduces(module)  # the fusion's form, not a plain reduce-scatter
    counts = hlo.collectives(module)
    assert "all-reduce" not in counts and counts["reduce-scatter"]["count"] == 1
    whole = counts["reduce-scatter"]["bytes"]
    assert rows * width * 4 <= whole <= 1.05 * rows * width * 4  # padded rows at most 5%
    assert counts["reduce-scatter"]["wire_bytes"] == pytest.approx(whole * 7 / 8)
