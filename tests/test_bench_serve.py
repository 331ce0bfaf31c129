"""The serving benchmark end to end at a tiny size: both models serve the whole mix through
the HTTP server, and BoV's pages without V hold more of it in the same memory."""

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_serve_serves_the_whole_mix_to_both_models(tmp_path):
    out = tmp_path / "bench.json"
    flags = dict(
        depth=3, model_dim=128, head_dim=64, seq_len=128, requests=6, clients=3,
        max_output=12, max_seqs=4, page_size=8, chunk=32, cache_mib=2, runs=1,
    )  # fmt: skip
    command = [sys.executable, "-m", "bov_jax.inference.bench_serve"]
    command += [f"--{k}={v}" for k, v in flags.items()] + [f"--json_out={out}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| BoV / baseline, per run |" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["mix_requests"] == 6
    for name in ("baseline", "BoV"):
        [run] = figures["runs"][name]
        assert run["tokens"] == figures["mix_output_tokens"]  # ignore_eos: every token asked
        assert run["ttft_p50_ms"] > 0 and run["itl_p99_ms"] >= run["itl_p50_ms"] > 0
        assert 0 < run["pages_peak"] <= sum(figures["pages"][name])
    # the same 2 MiB holds more pages in the group that BoV's missing V pages free
    assert sum(figures["pages"]["BoV"]) > sum(figures["pages"]["baseline"])
    for values in figures["bov_over_baseline"].values():
        [ratio] = values
        assert math.isfinite(ratio) and ratio > 0
