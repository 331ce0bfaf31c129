"""The HBM bytes of one compiled engine step, kernels counted by what they read.

`hlo.memory_traffic` counts each op outside a fusion by its operands and result. A Pallas
kernel is a custom call whose operands are whole arrays of which it reads a part: the
engine's paged kernels (`paged_kernels`, named with their window) read the pages a window
touches and, for a bank layer, the rows its id pages name, not the pools and the bank. They
are counted here by the parts they read; every other op as `hlo.op_traffic` counts it.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Iterator

from bov_jax.compile import hlo
from bov_jax.inference.layout import pages_touched
from bov_jax.inference.paged_kernels import KERNEL_NAME

KERNEL_CALLS = ("xla.gpu.triton", "tpu_custom_call")


def _dims(shape: str) -> tuple[str, tuple[int, ...]]:
    return next(hlo.arrays(shape))


def window_kernel_bytes(window: int, shapes: list[str], result: str) -> float:
    """The engine's kernels (`paged_kernels`): per row, the pages a window of `window` + 1
    positions touches (at most the table's width): their K pages and V pages, or their id
    pages and a head's words of a bank row per slot and head; the tables' entries of those
    pages; the positions, the queries and the output. Operands: positions (B,), K and V
    tables, q (B, H, hd), K pages (H, N, P, hd), V pages or ids[, the bank]. The GPU kernel
    (tables (B, W)) runs a program per row and head, each reading its pages' entries and ids;
    the TPU kernel (tables (B * W,), cut to the window) reads them once per page, all heads."""
    positions, k_tables, _, q, k_pages, values, *bank = shapes
    k_dtype, (heads, _, page, head_dim) = _dims(k_pages)
    batch = _dims(q)[1][0]
    tables = _dims(k_tables)[1]
    width = math.prod(tables) // batch
    pages = min(pages_touched(window + 1, page), width)
    readers = 1 if len(tables) == 1 else heads  # who reads a page's entries and ids
    slots = batch * pages * page * heads  # (row, slot, head) triples read
    keys = slots * head_dim * hlo.DTYPE_BYTES[k_dtype]
    if bank:  # the ids, and a head's share of a row: its words (`bank_words`)
        bank_dtype, bank_dims = _dims(bank[0])
        row = bank_dims[-1] * hlo.DTYPE_BYTES[bank_dtype]
        ids = batch * pages * page * readers * hlo.DTYPE_BYTES["s32"]
        values_read = ids + slots * (row // heads)
    else:
        values_read = slots * head_dim * hlo.DTYPE_BYTES[_dims(values)[0]]
    entries = 2 * batch * pages * readers * hlo.DTYPE_BYTES["s32"]
    small = hlo.shape_bytes(q) + hlo.shape_bytes(positions) + hlo.shape_bytes(result)
    return keys + values_read + entries + small


def kernel_bytes(instruction: hlo.Instruction, shapes: dict[str, str]) -> float | None:
    """A kernel of ours by what it reads and writes; None for another (counted whole)."""
    operands = [shapes.get(o, "") for o in instruction.operands]
    # the GPU kernel's name is in its backend config, the TPU kernel's is the op's own
    named = re.search(rf"{KERNEL_NAME}_w(\d+)_", instruction.name + instruction.attributes)
    if named:
        return window_kernel_bytes(int(named.group(1)), operands, instruction.shape)
    return None


def is_kernel(instruction: hlo.Instruction) -> bool:
    return instruction.opcode == "custom-call" and any(
        call in instruction.attributes for call in KERNEL_CALLS
    )


def op_bytes(module: hlo.Module) -> Iterator[tuple[hlo.Instruction, float]]:
    """Each op that moves data with the bytes it reads and writes a step (loops weighted by
    their trips)."""
    shapes = module.shapes
    for name, times in hlo.control_flow_multiplicities(module).items():
        for instruction in module.computations[name]:
            if not hlo.moves_data(instruction):
                continue
            counted = kernel_bytes(instruction, shapes) if is_kernel(instruction) else None
            if counted is None:
                counted = hlo.op_traffic(module, instruction, shapes)
            yield instruction, times * counted


def decode_step_bytes(module: hlo.Module) -> float:
    """Bytes one step reads and writes in HBM (loops weighted by their trips)."""
    return sum(moved for _, moved in op_bytes(module))


def source(module: hlo.Module, instruction: hlo.Instruction) -> str:
    """What an op is, for people: the jax primitive it was traced from and the HLO op it
    became ('gather as fusion(reshape)', 'dot_general as fusion(reduce)', 'pallas_call as
    custom-call'); '(XLA)' where XLA made the op itself (a layout copy) and named none."""
    primitive = hlo.op_name(instruction).rsplit("/", 1)[-1] or "(XLA)"
    kind = instruction.opcode
    if kind == "fusion":
        kind = f"fusion({hlo.fusion_root(module, instruction)})"
    return f"{primitive} as {kind}"


def sources(module: hlo.Module) -> list[tuple[str, float]]:
    """The step's bytes by `source`, the largest first: [(label, bytes)]."""
    totals: dict[str, float] = collections.defaultdict(float)
    for instruction, moved in op_bytes(module):
        totals[source(module, instruction)] += moved
    return sorted(totals.items(), key=lambda item: -item[1])
