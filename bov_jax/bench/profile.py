"""Device time of a compiled function by op category and by named scope, from a profiler trace.

A jax.profiler trace records one event per executed HLO op (stat `hlo_op`, on CPU and GPU).
The compiled module's HLO text says what each op is: its opcode (for a fusion, the opcodes
of the computation it calls) gives the category, and the `jax.named_scope` path in its
metadata gives the scope. Summing event durations per op then gives

  categories: matmul (dot, convolution), attention (fused attention custom calls, e.g. cuDNN),
              gather/scatter, reductions, copies (copy, transpose), other
  scopes:     the innermost of SCOPES in the op's name-scope path (bank inside attn counts as
              bank), else "other"
"""

from __future__ import annotations

import collections
import glob
import os
import re

from jax.profiler import ProfileData

SCOPES = ("attn", "mlp", "bank", "loss", "muon", "adamw")
CATEGORIES = ("matmul", "attention", "gather/scatter", "reductions", "copies", "other")

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (?:\([^=]*?\)|\S+) ([a-z][\w\-]*)\((.*)$")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SCOPE = re.compile(r"(?:^|/|\()(" + "|".join(SCOPES) + r")(?=/|\)|$)")


# Opcodes that make an op's category, in the order _category tests them.
_KEY_OPCODES = {
    "matmul": {"dot", "convolution"},
    "gather/scatter": {"gather", "scatter", "dynamic-slice", "dynamic-update-slice"},
    "reductions": {"reduce", "reduce-window", "all-reduce", "reduce-scatter"},
}


def _category(opcodes: set[str], line: str) -> str:
    if "custom-call" in opcodes and re.search(r"cudnn|fmha|attention|flash", line, re.I):
        return "attention"
    for category, keys in _KEY_OPCODES.items():
        if opcodes & keys:
            return category
    if opcodes and opcodes <= {"copy", "transpose", "bitcast", "parameter", "tuple"}:
        return "copies"
    return "other"


def _scope(line: str) -> str:
    op_name = _OP_NAME.search(line)
    scopes = _SCOPE.findall(op_name.group(1)) if op_name else []
    return scopes[-1] if scopes else "other"


def classify_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """HLO op name -> (category, scope) for every instruction of a compiled module's text.

    A fusion's category comes from the opcodes it contains; its scope from the contained ops
    that make that category (a fusion of an mlp matmul with an unscoped reduction is mlp),
    else from its own metadata.
    """
    computations: dict[str, list[tuple[str, str, list[str], str]]] = {}
    current = None
    for line in hlo_text.splitlines():
        if (match := _COMPUTATION.match(line)) and "=" not in line.split("{")[0]:
            current = computations.setdefault(match.group(1), [])
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

    ops = {}
    for instructions in computations.values():
        for name, opcode, called, line in instructions:
            scope = _scope(line)
            if opcode != "fusion":
                ops[name] = (_category({opcode}, line), scope)
                continue
            inner = [op for c in called for op in inner_ops(c)]
            category = _category({opcode for opcode, _ in inner}, line)
            keys = _KEY_OPCODES.get(category, set())
            scopes = [s for opcode, s in inner if opcode in keys and s != "other"]
            ops[name] = (category, scopes[0] if scopes else scope)
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
