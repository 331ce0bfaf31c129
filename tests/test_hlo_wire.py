"""Collectives counted as the links move them (`hlo.wire_bytes`), on hand-written HLO: each
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
