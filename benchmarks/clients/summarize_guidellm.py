"""A Markdown table of guidellm runs: one row per benchmarks.json (requests successful and
errored, prompt and output tokens per request, TTFT and inter-token latency, output tokens/s).

    python benchmarks/clients/summarize_guidellm.py LABEL=OUT/guidellm/chat/benchmarks.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = (
    "run",
    "requests ok / errored",
    "prompt / output tokens",
    "TTFT median (p95) ms",
    "ITL median (p95) ms",
    "output tokens/s",
)


def row(label: str, path: Path) -> str:
    """One table row from a guidellm benchmarks.json (its first benchmark)."""
    metrics = json.loads(path.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]

    def ok(name: str) -> dict:
        return metrics[name]["successful"]

    def latency(name: str) -> str:
        return f"{ok(name)['median']:.1f} ({ok(name)['percentiles']['p95']:.1f})"

    tokens = f"{ok('prompt_token_count')['mean']:.0f} / {ok('output_token_count')['mean']:.0f}"
    cells = (
        label,
        f"{totals['successful']} / {totals['errored']}",
        tokens,
        latency("time_to_first_token_ms"),
        latency("inter_token_latency_ms"),
        f"{ok('output_tokens_per_second')['mean']:.1f}",
    )
    return "| " + " | ".join(cells) + " |"


def main(args: list[str]) -> None:
    if not args or any("=" not in a for a in args):
        sys.exit("usage: summarize_guidellm.py LABEL=benchmarks.json ...")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for arg in args:
        label, path = arg.split("=", 1)
        print(row(label, Path(path)))


if __name__ == "__main__":
    main(sys.argv[1:])
