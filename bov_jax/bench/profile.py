"""Device time of a compiled function by op category and by named scope, from a profiler trace.

A jax.profiler trace records one event per executed HLO op (stat `hlo_op`, on CPU and GPU).
The compiled module's HLO text says what each op is: its opcode (for a fusion, the opcodes
of the computation it calls) gives the category, and the `jax.named_scope` path in its
metadata gives the scope. Summing event durations per op then gives

  categories: matmul (dot, convolution), attention (fused attention custom calls, e.g. cuDNN),
              gather/scatter, reductions, copies (copy, transpose), elementwise (arithmetic
              and the reshaping around it: most loop fusions), other
  scopes:     the innermost of SCOPES in the op's name-scope path (bank inside attn counts as
              bank), else "other"

A trace directory that also holds the module's HLO text (HLO_FILE, as `bov_jax.bench train
--profile` writes it) is whole: `trace_breakdown` recomputes its breakdown anywhere, so a
trace recorded on a GPU can serve as a test fixture on a CPU.
"""

from __future__ import annotations

import collections
import glob
import os
import re

from jax.profiler import ProfileData

# The model's (gpt.py: embed, block with attn, bank and mlp inside, loss) and the train step's
# (fsdp.py: grads, the micro-batches' gradient sum; step.py: optimizer, with optim.py's muon
# and adamw inside) name scopes.
SCOPES = ("embed", "block", "attn", "mlp", "bank", "loss", "grads", "optimizer", "muon", "adamw")
HLO_FILE = "step.hlo.txt"  # the traced module's HLO text, beside the trace
CATEGORIES = (
    "matmul",
    "attention",
    "gather/scatter",
    "reductions",
    "copies",
    "elementwise",
    "other",
)

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
# A tuple-shaped result may hold `/*index=5*/` comments (XLA writes one every fifth element).
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%([\w.\-]+) = (?:\((?:[^=]|/\*index=\d+\*/)*?\)|\S+) ([a-z][\w\-]*)\((.*)$"
)
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SCOPE = re.compile(r"(?:^|/|\()(" + "|".join(SCOPES) + r")(?=/|\)|$)")


# Opcodes that make an op's category, in the order _category tests them.
_KEY_OPCODES = {
    "matmul": {"dot", "convolution"},
    "gather/scatter": {"gather", "scatter", "dynamic-slice", "dynamic-update-slice"},
    "reductions": {"reduce", "reduce-window", "all-reduce", "reduce-scatter"},
}


_COPIES = {"copy", "transpose", "bitcast", "parameter", "tuple"}
# Arithmetic opcodes and the shape and layout ops fused around them: an op (or fusion) of these
# alone is elementwise.
_ELEMENTWISE = _COPIES | {
    *("abs", "add", "and", "atan2", "bitcast-convert", "broadcast", "cbrt", "ceil", "clamp"),
    *("compare", "concatenate", "constant", "convert", "cosine", "divide", "erf", "exponential"),
    *("exponential-minus-one", "floor", "get-tuple-element", "iota", "is-finite", "log"),
    *("log-plus-one", "logistic", "maximum", "minimum", "multiply", "negate", "not", "or"),
    *("pad", "power", "reduce-precision", "remainder", "reshape", "reverse", "round-nearest-afz"),
    *("round-nearest-even", "rsqrt", "select", "shift-left", "shift-right-arithmetic"),
    *("shift-right-logical", "sign", "sine", "slice", "sqrt", "subtract", "tan", "tanh", "xor"),
}


def _category(opcodes: set[str], line: str) -> str:
    if "custom-call" in opcodes and re.search(r"cudnn|fmha|attention|flash", line, re.I):
        return "attention"
    for category, keys in _KEY_OPCODES.items():
        if opcodes & keys:
            return category
    if opcodes and opcodes <= _COPIES:
        return "copies"
    if opcodes and opcodes <= _ELEMENTWISE:
        return "elementwise"
    return "other"


def _scope(line: str) -> str:
    op_name = _OP_NAME.search(line)
    scopes = _SCOPE.findall(op_name.group(1)) if op_name else []
    return scopes[-1] if scopes else "other"


def classify_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """HLO op name -> (category, scope) for every instruction of a compiled module's text.

    A fusion's category comes from the opcodes it contains; its scope from the contained ops
    that make that category (a fusion of an mlp matmul with an unscoped reduction is mlp),
    else from its own metadata, else (a fusion without metadata, as XLA's CPU fusions often
    are) the scope most of its contained ops carry. An op left without a scope takes that of
    the loop, conditional or call it runs in (the chunked loss's loop body is loss).
    """
    computations: dict[str, list[tuple[str, str, list[str], str]]] = {}
    current, entry = None, []
    for line in hlo_text.splitlines():
        if (match := _COMPUTATION.match(line)) and "=" not in line.split("{")[0]:
            current = computations.setdefault(match.group(1), [])
            entry += [match.group(1)] if line.startswith("ENTRY") else []
        elif current is not None and (match := _INSTRUCTION.match(line)):
            name, opcode, rest = match.groups()
            current.append((name, opcode, _CALLED.findall(rest), line))

    def inner_ops(computation: str, seen: frozenset = frozenset()) -> list[tuple[str, str]]:
        """(opcode, scope) of every instruction inside `computation`, recursively."""
        found = []
        for _, opcode, called, line in computations.get(computation, []):
            if opcode != "parameter":
                found.append((opcode, _scope(line)))
            for callee in called:
                if callee not in seen:
                    found += inner_ops(callee, seen | {callee})
        return found

    enclosing: dict[str, str] = {}  # control-flow computation -> the scope it runs in

    def enclose(computation: str, scope: str) -> None:
        enclosing[computation] = scope
        for _, opcode, called, line in computations.get(computation, []):
            if opcode in ("while", "conditional", "call"):
                own = _scope(line)
                inner = own if own != "other" else scope
                for callee in called:
                    if callee not in enclosing:
                        enclose(callee, inner)

    for computation in [*entry, *computations]:  # from the entry down, first
        if computation not in enclosing:
            enclose(computation, "other")

    ops = {}
    for computation, instructions in computations.items():
        for name, opcode, called, line in instructions:
            scope = _scope(line)
            if opcode != "fusion":
                category = _category({opcode}, line)
            else:
                inner = [op for c in called for op in inner_ops(c)]
                category = _category({opcode for opcode, _ in inner}, line)
                keys = _KEY_OPCODES.get(category, set())
                scopes = [s for opcode, s in inner if opcode in keys and s != "other"]
                if not scopes and scope == "other":
                    counts = collections.Counter(s for _, s in inner if s != "other")
                    scopes = [s for s, _ in counts.most_common(1)]
                scope = scopes[0] if scopes else scope
            ops[name] = (category, scope if scope != "other" else enclosing[computation])
    return ops


def op_times(trace_dir: str, module: str) -> dict[str, float]:
    """Seconds per HLO op of the HLO module named `module` in the newest trace under dir."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb profile under {trace_dir}")
    data = ProfileData.from_file(max(paths, key=os.path.getmtime))
    times: dict[str, float] = collections.defaultdict(float)
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if stats.get("hlo_module") == module and "hlo_op" in stats:
                    times[stats["hlo_op"]] += event.duration_ns * 1e-9
    return dict(times)


def breakdown(hlo_text: str, times: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(seconds by category, seconds by scope) of the timed ops; unknown ops count as other."""
    ops = classify_ops(hlo_text)
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    by_scope = dict.fromkeys((*SCOPES, "other"), 0.0)
    for op, seconds in times.items():
        category, scope = ops.get(op, ("other", "other"))
        by_category[category] += seconds
        by_scope[scope] += seconds
    return by_category, by_scope


def module_name(hlo_text: str) -> str:
    """The module's name, as the trace's `hlo_module` stat gives it: 'HloModule jit_step, ...'."""
    return hlo_text.split(",", 1)[0].split("\n", 1)[0].removeprefix("HloModule ").strip()


def trace_breakdown(trace_dir: str) -> tuple[dict[str, float], dict[str, float]]:
    """`breakdown` of the newest trace under trace_dir, for the module in its HLO_FILE."""
    with open(os.path.join(trace_dir, HLO_FILE)) as file:
        hlo_text = file.read()
    return breakdown(hlo_text, op_times(trace_dir, module_name(hlo_text)))


def attributed_share(seconds: dict[str, float]) -> float:
    """The share of the timed seconds (by category or by scope) not in "other"; 0 if none."""
    total = sum(seconds.values())
    return (total - seconds["other"]) / total if total else 0.0
