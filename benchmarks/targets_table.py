"""Render docs/targets.md's table from the compile reports in docs/results/targets/*.json.

    python benchmarks/targets_table.py [REPORT.json ...]   # default: every report there

One markdown row per report: the report's name (its JSON file, named for the config and any
override, e.g. d32_bov_... for depth 32), target, mesh, rows x micro-batches, the schedule (fsdp
gather, recomputation), peak memory against HBM, collectives per step per device (GiB, bytes
per parameter against the ideal, counted as operands and as the wire moves them), the step
time's lower bound and what bounds it, the MFU ceiling it implies, and the compile's wall
seconds (CPU seconds in parentheses).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPORTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "targets"
HEADER = (
    "| report | target | mesh | rows x micro-batches | schedule | peak / HBM (GiB) | fits "
    "| collectives per step per device | B / param (x ideal) | wire B / param (x ideal) "
    "| step >= (bound) | MFU ceiling | compile s |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def mesh_text(mesh: dict) -> str:
    parts = [f"{axis} {size}" for axis, size in mesh.items() if size > 1]
    return ", ".join(parts) or "1 chip"


def bytes_per_parameter(train: dict, key: str, ratio_key: str) -> str:
    """'6.2 (0.88x)' from a train step's report; '-' where an older report lacks the key."""
    if key not in train:
        return "-"
    ratio = train[ratio_key]
    return f"{train[key]:.1f}" + (f" ({ratio:.2f}x)" if ratio else "")


def row(report: dict, name: str) -> str:
    train = report["steps"]["train"]
    rows = f"{report['device_batch_size']} x {report['micro_batches']}"
    if "find_rows" in report:
        tried = ", ".join(
            f"{r}: {p:.2f}"
            for r, p in sorted(report["find_rows"]["tried"].items(), key=lambda kv: int(kv[0]))
        )
        rows += f" (`--find_rows`, GiB by rows: {tried})"
    if "compiler_refused" in train:
        peak = f"refused: {train['memory_gib']['peak']} GiB of temporaries"
        return (
            f"| {name} | {report['target']} | {mesh_text(report['mesh'])} | {rows} | - "
            f"| {peak} / {report['hbm_gib']} | no | - | - | - | - | - "
            f"| {train['compile_seconds']:.0f} ({train['compile_cpu_seconds']:.0f}) |"
        )
    schedule = train["schedule"]
    plan = f"{schedule['gather']}" + (", remat" if schedule["remat"] else "")
    if report["mesh"].get("fsdp", 1) == 1:
        plan = "data" + (", remat" if schedule["remat"] else "")
    collectives = ", ".join(
        f"{kind} {c['count']:.0f}x {c['bytes'] / 2**30:.2f}"
        for kind, c in train["collectives"].items()
    )
    collectives = f"{collectives} GiB" if collectives else "none"
    per_param = bytes_per_parameter(
        train, "collective_bytes_per_parameter", "collectives_over_ideal"
    )
    wire = bytes_per_parameter(train, "collective_wire_bytes_per_parameter", "wire_over_ideal")
    prediction = train["prediction"]
    ms = prediction["step_seconds_lower_bound"] * 1e3
    bound = f"{ms:,.0f}" if ms >= 10 else f"{ms:.2f}"
    bound += f" ms ({prediction['bound_by']})"
    return (
        f"| {name} | {report['target']} | {mesh_text(report['mesh'])} | {rows} | {plan} "
        f"| {train['memory_gib']['peak']:.2f} / {report['hbm_gib']} "
        f"| {'yes' if train['fits'] else 'no'} | {collectives} | {per_param} | {wire} | {bound} "
        f"| {prediction['mfu_ceiling']:.1%} "
        f"| {train['compile_seconds']:.0f} ({train['compile_cpu_seconds']:.0f}) |"
    )


def main(paths: list[str]) -> None:
    files = [Path(p) for p in paths] or sorted(REPORTS.glob("*.json"))
    print(HEADER)
    for path in files:
        print(row(json.loads(path.read_text()), path.stem))


if __name__ == "__main__":
    main(sys.argv[1:])
