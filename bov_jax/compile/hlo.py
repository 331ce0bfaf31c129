"""What a compiled step holds, read off its optimized HLO text (`compiled.as_text()`).

The text is one module of computations; instructions name their operands and the
computations they call (fusions, while bodies, reductions). A while loop with a known trip
count (the micro-batch scan, the chunked loss) runs its body that many times, so everything
below is counted per step: each computation's instructions weigh as often as the entry
reaches it through the call graph. All figures are per device (the module is the
partitioned, per-device program).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterator

DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([^\]]*)\](\{[^}]*\})?")
# A layout's memory space other than 0 (TPU: S(1) on-chip VMEM, S(2) scalar memory) is not HBM.
OFF_HBM = re.compile(r"S\([1-9]\d*\)")
HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Attention kernels: splash (a Mosaic custom call named after its kernel) and cuDNN fMHA.
MOSAIC_TARGET = "tpu_custom_call"
CUDNN_ATTENTION = "__cudnn$fmha"


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # the result's shape text: "bf16[4,256]{...}" or a tuple "(f32[2], s32[])"
    opcode: str
    arguments: str  # the text inside the parentheses: operand names, or a constant's value
    attributes: str  # everything after the operand list

    @property
    def operands(self) -> tuple[str, ...]:
        return tuple(re.findall(r"%([\w.\-]+)", self.arguments))


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instruction]]
    entry: str
    devices: int = 1  # num_partitions x replica_count of the module's header

    @property
    def shapes(self) -> dict[str, str]:
        return {i.name: i.shape for body in self.computations.values() for i in body}


def laid_out_arrays(shape: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(dtype, dims, layout text or '') of every array in a shape text (a tuple gives several)."""
    for dtype, dims, layout in ARRAY.findall(shape):
        yield dtype, tuple(int(re.sub(r"\D", "", d)) for d in dims.split(",") if d.strip()), layout


def arrays(shape: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a shape text (a tuple gives several)."""
    for dtype, dims, _ in laid_out_arrays(shape):
        yield dtype, dims


def shape_bytes(shape: str) -> float:
    return sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in arrays(shape))


def placed_arrays(shape: str) -> list[tuple[float, bool]]:
    """(bytes, in HBM) of every array in a shape text, in order: an array whose layout names
    a memory space other than 0 (`S(1)`: TPU's on-chip VMEM) is not in HBM."""
    return [
        (DTYPE_BYTES[dtype] * math.prod(dims), not OFF_HBM.search(layout))
        for dtype, dims, layout in laid_out_arrays(shape)
    ]


def hbm_bytes(shape: str) -> float:
    """Bytes of a shape's arrays that sit in HBM (`placed_arrays`)."""
    return sum(size for size, in_hbm in placed_arrays(shape) if in_hbm)


def split_closing(text: str, start: int) -> int:
    """The index just past the parenthesis closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def parse_instruction(line: str) -> Instruction | None:
    match = INSTRUCTION.match(line)
    if not match:
        return None
    name, rest = match.groups()
    end = split_closing(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].strip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    close = split_closing(rest, paren)
    return Instruction(name, shape, opcode, rest[paren + 1 : close - 1], rest[close:])


def parse(text: str) -> Module:
    computations: dict[str, list[Instruction]] = {}
    entry, current, devices = "", None, 1
    for line in text.splitlines():
        if line.startswith("HloModule "):
            for key in ("num_partitions", "replica_count"):
                found = re.search(rf"\b{key}=(\d+)", line)
                devices *= int(found[1]) if found else 1
            continue
        header = HEADER.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif line.strip() == "}":
            current = None
        elif current is not None:
            instruction = parse_instruction(line)
            if instruction:
                computations[current].append(instruction)
    return Module(computations, entry, devices)


def called(instruction: Instruction, key: str) -> str | None:
    """The computation an instruction names under `key` ("body", "condition", "calls")."""
    found = re.search(rf"{key}=%?([\w.\-]+)", instruction.attributes)
    return found[1] if found else None


def trip_count(module: Module, loop: Instruction) -> int:
    """A while loop's trip count: XLA's known_trip_count where it notes one, else the bound of
    a counter compared `< constant` in the condition (lax.scan and fori_loop count from 0 by
    1); 1 where neither is found."""
    known = TRIP_COUNT.search(loop.attributes)
    if known:
        return int(known[1])
    body = module.computations.get(called(loop, "condition") or "", [])
    constants = {i.name: i.arguments for i in body if i.opcode == "constant"}
    for instruction in body:
        if instruction.opcode == "compare" and "direction=LT" in instruction.attributes:
            bounds = [constants[o] for o in instruction.operands[1:] if o in constants]
            if bounds and bounds[0].strip().isdigit():
                return int(bounds[0])
    return 1


def multiplicities(module: Module) -> dict[str, int]:
    """How many times each computation runs per execution of the entry (a while body times
    its loop's `trip_count`)."""
    names = set(module.computations)
    calls: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for caller, body in module.computations.items():
        for instruction in body:
            body_name = called(instruction, "body")
            for callee in re.findall(r"%([\w.\-]+)", instruction.attributes):
                if callee in names:
                    loop = instruction.opcode == "while" and callee == body_name
                    calls[caller].append((callee, trip_count(module, instruction) if loop else 1))
    counts: dict[str, int] = collections.defaultdict(int)

    def visit(name: str, times: int) -> None:
        counts[name] += times
        for callee, factor in calls[name]:
            visit(callee, times * factor)

    visit(module.entry, 1)
    return dict(counts)


def weighted(module: Module) -> Iterator[tuple[Instruction, int]]:
    """Every instruction with how often it runs per step."""
    for name, times in multiplicities(module).items():
        for instruction in module.computations[name]:
            yield instruction, times


# Ops that move no data of their own (views, tuples, control flow whose bodies are counted).
NO_TRAFFIC = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "while",
    "conditional",
    "call",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
}


def moves_data(instruction: Instruction) -> bool:
    """Whether an op reads or writes memory of its own (a kernel on a GPU): not a view, a
    tuple, control flow (its bodies count) or the `-done` half of an asynchronous op."""
    return instruction.opcode not in NO_TRAFFIC and not instruction.opcode.endswith("-done")


def control_flow_multiplicities(module: Module) -> dict[str, int]:
    """Like `multiplicities`, but only the computations that run as a program (the entry, loop
    bodies and conditions, conditional branches, calls): not fusion bodies or reducers."""
    counts: dict[str, int] = collections.defaultdict(int)

    def visit(name: str, times: int) -> None:
        counts[name] += times
        for instruction in module.computations.get(name, []):
            if instruction.opcode == "while":
                trips = trip_count(module, instruction)
                for key in ("body", "condition"):
                    found = called(instruction, key)
                    if found:
                        visit(found, times * (trips if key == "body" else trips + 1))
            elif instruction.opcode in ("conditional", "call"):
                for callee in re.findall(r"%([\w.\-]+)", instruction.attributes):
                    if callee in module.computations:
                        visit(callee, times)

    visit(module.entry, 1)
    return dict(counts)


def fusion_root(module: Module, instruction: Instruction) -> str:
    """The opcode at the root of a fusion's computation, its last instruction ('' if none)."""
    body = module.computations.get(called(instruction, "calls") or "", [])
    return body[-1].opcode if body else ""


# Ops that read only the part of their first operand they return.
PARTIAL_READS = ("dynamic-slice", "gather", "slice")


def fused_reads(module: Module, instruction: Instruction) -> dict[int, float]:
    """{operand index: bytes read} for a fusion's operands that its computation reads only
    through ops that return part of them (a table or a cache indexed inside the fusion): the
    sum of what those ops return, not the whole operand."""
    body = module.computations.get(called(instruction, "calls") or "", [])
    parameters = {i.name: int(i.arguments) for i in body if i.opcode == "parameter"}
    reads: dict[int, float] = {}
    for name, index in parameters.items():
        users = [i for i in body if name in i.operands]
        if users and all(u.opcode in PARTIAL_READS and u.operands[0] == name for u in users):
            reads[index] = sum(hbm_bytes(u.shape) for u in users)
    return reads


def op_traffic(module: Module, instruction: Instruction, shapes: dict[str, str]) -> float:
    """Bytes one op reads and writes in HBM. Arrays the compiler placed on chip (TPU's VMEM)
    do not count. An update in place (a dynamic-update-slice or a scatter, alone or at a
    fusion's root) moves its update, not the buffer it writes into; a gather or dynamic-slice
    reads what it returns, not its whole operand, also inside a fusion (`fused_reads`); a
    copy between memory spaces (`copy-start`, `slice-start`: a prefetch into VMEM or an
    eviction) moves its destination once per side in HBM; another asynchronous op
    (`*-start`) moves its output once in and once out."""
    operands = [hbm_bytes(shapes.get(o, "")) for o in instruction.operands]
    result = hbm_bytes(instruction.shape)
    kind = instruction.opcode
    if kind in ("copy-start", "slice-start"):  # result: (the source, the destination, context)
        placed = placed_arrays(instruction.shape)
        if len(placed) < 2:
            return 0.0
        (_, source_in_hbm), (size, destination_in_hbm) = placed[0], placed[1]
        return size * (source_in_hbm + destination_in_hbm)
    if kind.endswith("-start"):  # async: its result holds the operands beside the output
        return 2.0 * max(0.0, result - sum(operands))
    if kind == "fusion":
        kind = fusion_root(module, instruction) or kind
        for index, read in fused_reads(module, instruction).items():
            if index < len(operands):
                operands[index] = min(operands[index], read)
    if kind in ("dynamic-update-slice", "scatter"):  # the largest operand is the buffer
        rest = sorted(operands)[:-1]
        return 2.0 * sum(rest)
    if kind in PARTIAL_READS:
        return 2.0 * result
    return result + sum(operands)


def memory_traffic(module: Module) -> float:
    """Bytes per step per device that the program's ops read and write in device memory: each
    op outside a fusion reads its operands and writes its result (a fusion's internals stay on
    chip; `op_traffic`), loop bodies weighted by their trip counts. An estimate of the HBM
    traffic that XLA's cost analysis, which counts a loop body once, does not give."""
    shapes = module.shapes
    total = 0.0
    for name, times in control_flow_multiplicities(module).items():
        for instruction in module.computations[name]:
            if moves_data(instruction):
                total += times * op_traffic(module, instruction, shapes)
    return total


def collective_kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVES and not opcode.endswith("-done") else None


def fusion_bodies(module: Module) -> set[str]:
    """The computations that fusion instructions call."""
    return {
        body
        for instructions in module.computations.values()
        for i in instructions
        if i.opcode == "fusion" and (body := called(i, "calls"))
    }


def scattering_all_reduces(module: Module) -> frozenset[str]:
    """The all-reduces that run as reduce-scatters: inside a fusion whose computation slices
    the all-reduce's result (a dynamic-slice at the partition's offset). XLA TPU writes a
    reduce-scatter so, as an `all-reduce-scatter` fusion (its emitter in the fusion's
    backend_config: AllReduceScatterFusion, a ring reduce-scatter), and only the slice leaves
    the fusion: each device sends (n-1)/n of the operand and holds no reduced whole."""
    found = set()
    for name in fusion_bodies(module):
        body = module.computations.get(name, [])
        reduced = {i.name for i in body if i.opcode == "all-reduce"}
        found |= {i.operands[0] for i in body if i.opcode == "dynamic-slice"} & reduced
    return frozenset(found)


def kind_in(module: Module, instruction: Instruction, scattering: frozenset[str]) -> str | None:
    """The collective an instruction runs (`collective_kind`), a reduce-scatter for the
    all-reduces of `scattering` (`scattering_all_reduces`)."""
    kind = collective_kind(instruction.opcode)
    return "reduce-scatter" if kind == "all-reduce" and instruction.name in scattering else kind


@dataclasses.dataclass(frozen=True)
class CollectiveRun:
    """One collective op of the per-device program and how often it runs per step: its kind
    (`kind_in`), bytes (`collective_bytes`) and wire bytes (`wire_factor` on its group)."""

    instruction: Instruction
    kind: str
    times: int
    bytes: float
    wire_bytes: float


def collective_runs(module: Module) -> Iterator[CollectiveRun]:
    shapes, scattering = module.shapes, scattering_all_reduces(module)
    for instruction, times in weighted(module):
        kind = kind_in(module, instruction, scattering)
        if kind is None:
            continue
        size = collective_bytes(instruction, shapes)
        wire = size * wire_factor(kind, group_size(module, instruction))
        yield CollectiveRun(instruction, kind, times, size, wire)


def collectives(module: Module) -> dict[str, dict[str, float]]:
    """{kind: {"count": ops per step, "bytes": bytes per step, "wire_bytes": ...}} per
    device: bytes as `collective_bytes` (the gathered result of an all-gather, the operands
    of the others), wire bytes what each device sends over the links (`wire_factor`)."""
    out: dict[str, dict[str, float]] = {}
    for run in collective_runs(module):
        entry = out.setdefault(run.kind, {"count": 0, "bytes": 0.0, "wire_bytes": 0.0})
        entry["count"] += run.times
        entry["bytes"] += run.times * run.bytes
        entry["wire_bytes"] += run.times * run.wire_bytes
    return dict(sorted(out.items()))


def group_size(module: Module, instruction: Instruction) -> int:
    """Devices in each of a collective's replica groups: its first explicit group
    ({{0,1,2,3},...}), the group size of the iota form ([groups,size]<=[...]), or every
    device of the module for {} or no groups."""
    explicit = re.search(r"replica_groups=\{\{([\d,\s]*)\}", instruction.attributes)
    if explicit:
        return len([d for d in explicit[1].split(",") if d.strip()])
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", instruction.attributes)
    return int(iota[2]) if iota else module.devices


def wire_factor(kind: str, devices: int) -> float:
    """What one device sends over the links per byte `collective_bytes` counts, for the
    algorithm each collective runs on a group of `devices`: an all-gather, a reduce-scatter
    and an all-to-all (n-1)/n of the whole array (every other device's part passes once), a
    ring all-reduce 2(n-1)/n (a reduce-scatter, then an all-gather), a permute its operand."""
    if kind == "collective-permute":
        return 1.0
    share = (devices - 1) / devices
    return 2 * share if kind == "all-reduce" else share


def collective_bytes(instruction: Instruction, shapes: dict[str, str]) -> float:
    """Bytes one collective moves per run, as `collectives` counts them."""
    if collective_kind(instruction.opcode) == "all-gather":
        results = list(arrays(instruction.shape))
        return sum(DTYPE_BYTES[d] * math.prod(s) for d, s in results[-len(instruction.operands) :])
    return sum(shape_bytes(shapes.get(o, "")) for o in instruction.operands)


def scope(instruction: Instruction) -> str:
    """Where an op was traced, for people: its jax name stack without the jit and the
    primitive ('shard_map', 'muon/shard_map'); '(combined by XLA)' when XLA merged ops and
    left no name."""
    parts = op_name(instruction).split("/")
    if len(parts) < 2:
        return "(combined by XLA)"
    inner = [p for p in parts[1:-1] if p not in ("while", "body", "cond", "branch_0_fun")]
    return "/".join(inner) or "(step)"


def collective_sources(module: Module, top: int = 8) -> list[dict[str, object]]:
    """The collectives per step per device grouped by kind, name scope and operand shape, the
    largest `top` by bytes: [{kind, scope, shape, count, bytes, wire_bytes}]."""
    shapes = module.shapes
    groups: dict[tuple[str, str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for run in collective_runs(module):
        operands = run.instruction.operands
        first = next(arrays(shapes.get(operands[0], "")), None) if operands else None
        shape = f"{first[0]}[{','.join(map(str, first[1]))}]" if first else "?"
        entry = groups[(run.kind, scope(run.instruction), shape)]
        entry[0] += run.times
        entry[1] += run.times * run.bytes
        entry[2] += run.times * run.wire_bytes
    ranked = sorted(groups.items(), key=lambda item: -item[1][1])[:top]
    return [
        {"kind": k, "scope": sc, "shape": sh, "count": c, "bytes": b, "wire_bytes": w}
        for (k, sc, sh), (c, b, w) in ranked
    ]


def op_name(instruction: Instruction) -> str:
    """The jax name stack the instruction was traced under (its metadata's op_name)."""
    found = re.search(r'op_name="([^"]*)"', instruction.attributes)
    return found[1] if found else ""


def matmul_flops(module: Module, traced_in: str = "") -> float:
    """2 x multiply-adds of every dot and convolution, per step, per device; with
    `traced_in`, only those whose op_name contains it (e.g. "/micro_batch/": traced inside
    that name scope, whatever XLA made of the loops around it)."""
    shapes = module.shapes
    total = 0.0
    for instruction, times in weighted(module):
        if traced_in not in op_name(instruction):
            continue
        out = [dims for _, dims in arrays(instruction.shape)]
        if instruction.opcode == "dot" and out:
            lhs = next(arrays(shapes.get(instruction.operands[0], "")), (None, ()))[1]
            dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attributes)
            contracted = [lhs[int(d)] for d in dims[1].split(",") if d] if dims else []
            total += times * 2 * math.prod(out[0]) * math.prod(contracted)
        elif instruction.opcode == "convolution" and out:
            total += times * convolution_flops(instruction, out[0], shapes)
    return total


def convolution_flops(instruction: Instruction, out: tuple[int, ...], shapes: dict) -> float:
    """2 x output elements x input features per group x the window's taps that meet input.

    A dot with batch dimensions can lower to a convolution whose window spans the batch with
    an input dilation as large (size=B lhs_dilate=B): only one tap per output meets an input
    element, so each window axis counts ceil(size / lhs_dilate) taps."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instruction.attributes)
    lhs = next(arrays(shapes.get(instruction.operands[0], "")), (None, ()))[1]
    if not labels or not lhs:
        return 0.0
    features = lhs[labels[1].index("f")]
    groups = re.search(r"feature_group_count=(\d+)", instruction.attributes)
    window = re.search(r"window=\{([^}]*)\}", instruction.attributes)
    fields = dict(re.findall(r"(\w+)=([\dx_]+)", window[1])) if window else {}
    sizes = [int(v) for v in fields.get("size", "1").split("x")]
    dilations = [int(v) for v in fields.get("lhs_dilate", "x".join("1" * len(sizes))).split("x")]
    taps = math.prod(-(-size // dilation) for size, dilation in zip(sizes, dilations))
    return 2.0 * math.prod(out) * features / (int(groups[1]) if groups else 1) * taps


def attention_kernels(module: Module) -> dict[str, int]:
    """Attention custom calls in the program (static count): splash kernels (Mosaic custom
    calls named splash_*), cuDNN fused attention, and every Mosaic call."""
    counts = {"splash": 0, "cudnn": 0, "mosaic": 0}
    for body in module.computations.values():
        for instruction in body:
            if instruction.opcode != "custom-call":
                continue
            target = re.search(r'custom_call_target="([^"]+)"', instruction.attributes)
            target = target[1] if target else ""
            if target == MOSAIC_TARGET:
                counts["mosaic"] += 1
                counts["splash"] += "splash" in instruction.name
            counts["cudnn"] += target.startswith(CUDNN_ATTENTION)
    return counts


def interpreted_kernel_ops(module: Module, kernel: str = "splash_mha") -> int:
    """Dots and convolutions traced from inside a Pallas kernel named `kernel*`: its body
    run in interpret mode, as XLA ops (a native kernel is one custom call)."""
    return sum(
        instruction.opcode in ("dot", "convolution") and kernel in op_name(instruction)
        for body in module.computations.values()
        for instruction in body
    )


def loop_trip_counts(module: Module) -> list[int]:
    """The trip count of every while loop (the micro-batch scan, the chunked loss...)."""
    return sorted(
        trip_count(module, instruction)
        for body in module.computations.values()
        for instruction in body
        if instruction.opcode == "while"
    )


def large_fp32(module: Module, vocab: set[int], tokens: int) -> list[str]:
    """fp32 arrays shaped like whole-batch logits: a last axis of a vocab size (any of
    `vocab`: the padded vocab and its shards) and at least `tokens` (the rows x T of a
    device's micro-batch) before it. The chunked loss never holds one."""
    found = set()
    for body in module.computations.values():
        for instruction in body:
            for dtype, dims in arrays(instruction.shape):
                if (
                    dtype == "f32"
                    and dims
                    and dims[-1] in vocab
                    and math.prod(dims) >= tokens * dims[-1]
                ):
                    found.add(f"f32[{','.join(map(str, dims))}]")
    return sorted(found)
