"""benchmarks/results/h200.json from what `bash benchmarks/h200.sh` (default mode, then decode
mode) left in its $OUT folder.

    python benchmarks/h200_results.py OUT_DIR [--command="bash benchmarks/h200.sh; ..."]

Reads train_d12.json and train_d24.json (`bov_jax.bench train --json_out`: the baseline
config first, then BoV), decode_d24_bank_kernel1.json (`bov_jax.inference.bench_decode --json_out`,
the bank kernel on) and gpu.txt (the image's versions), and writes the figures issue 34 asks
for, as fractions: d24_bov_mfu, d12_bov_mfu, bov_over_base_step_d24 (BoV's step time over
the baseline's, the median of interleaved repetitions), decode_no_v_over_base_2k and _32k
(BoV without a V cache, tokens/s over the baseline's), profile_attributed_share (the d24 BoV
profile's smaller share: to a category or to a scope), plus jax, date and command. A figure
whose file is missing is null, and the script says which.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bov_jax import cli  # noqa: E402
from bov_jax.errors import UserError  # noqa: E402
from bov_jax.files import write_json_atomic  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "h200.json")
NO_V, BASELINE = "BoV, no V cache", "baseline"


def read_json(folder: str, name: str) -> object | None:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        print(f"{path}: missing; its figures are null", file=sys.stderr)
        return None
    with open(path) as file:
        return json.load(file)


def train_figures(results: list[dict] | None) -> tuple[float | None, float | None, dict | None]:
    """(BoV's MFU, BoV's step time over the baseline's, BoV's profile) of a train JSON."""
    if not results:
        return None, None, None
    bov = results[-1]
    ratio = bov.get("step_time_ratio_vs_first", {}).get("median")
    return bov.get("mfu_step"), ratio, bov.get("profile")


def decode_ratio(figures: dict | None, context: int) -> float | None:
    """BoV without a V cache over the baseline, tokens/s, at `context`."""
    for row in (figures or {}).get("contexts", []):
        if row["context"] == context:
            rates = row["tokens_per_sec"]
            return rates[NO_V] / rates[BASELINE]
    return None


def jax_version(folder: str) -> str | None:
    path = os.path.join(folder, "gpu.txt")
    if not os.path.isfile(path):
        return None
    with open(path) as file:
        found = re.search(r"\bjax (\S+)", file.read())
    return found.group(1) if found else None


def collect(folder: str, command: str) -> dict:
    d12_mfu, _, _ = train_figures(read_json(folder, "train_d12.json"))
    d24_mfu, d24_ratio, profile = train_figures(read_json(folder, "train_d24.json"))
    decode = read_json(folder, "decode_d24_bank_kernel1.json")
    shares = (profile or {}).get("attributed_share")
    return {
        "d24_bov_mfu": d24_mfu,
        "d12_bov_mfu": d12_mfu,
        "bov_over_base_step_d24": d24_ratio,
        "decode_no_v_over_base_2k": decode_ratio(decode, 2048),
        "decode_no_v_over_base_32k": decode_ratio(decode, 32768),
        "profile_attributed_share": min(shares.values()) if shares else None,
        "jax": jax_version(folder),
        "date": datetime.date.today().isoformat(),
        "command": command,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="the $OUT folder of the h200.sh runs")
    both_modes = "bash benchmarks/h200.sh; bash benchmarks/h200.sh decode"
    parser.add_argument("--command", default=both_modes, help="how the figures were made")
    parser.add_argument("--json_out", default=RESULTS)
    args = parser.parse_args()
    if not os.path.isdir(args.out_dir):
        raise UserError(f"{args.out_dir}: no such folder; expected the $OUT of h200.sh's runs")
    results = collect(args.out_dir, args.command)
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    write_json_atomic(args.json_out, results)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    cli.guarded(main)
