"""benchmarks/h200.sh runs on the H200 image as written: its commands import nothing beyond
the image's packages (benchmarks/h200_image_packages.txt, from the device tool's KINDS.md)
and the wheels it carries (benchmarks/h200_wheels.txt).

Each command runs in a subprocess whose imports of any other installed distribution fail as
they would there (ModuleNotFoundError), so a new import in the bench's path breaks this test
here, on CPU, instead of the first minutes of a GPU session.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from test_resume import REPO, environment

BENCHMARKS = REPO / "benchmarks"

# Runs `python -m MODULE ARGS...` with every import of a distribution outside ALLOWED refused.
IMAGE_ONLY = """
import importlib.abc, importlib.metadata, re, runpy, sys
allowed = set(sys.argv[1].split(","))
owners = importlib.metadata.packages_distributions()
def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()
class ImageOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.partition(".")[0]
        dists = owners.get(top)
        if "." in name or not dists or any(norm(d) in allowed for d in dists):
            return None
        raise ModuleNotFoundError(f"{name} ({dists[0]}) is not on the H200 image", name=name)
sys.meta_path.insert(0, ImageOnly())
module, sys.argv = sys.argv[2], sys.argv[2:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def names(path: Path) -> set[str]:
    """Normalized distribution names of a list file (`name` or `name==version` lines)."""
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return {re.sub(r"[-_.]+", "-", line.split("==")[0]).lower() for line in lines if line}


def run_on_image(*args: str) -> subprocess.CompletedProcess:
    allowed = names(BENCHMARKS / "h200_image_packages.txt") | names(BENCHMARKS / "h200_wheels.txt")
    allowed.add("bov-jax")  # the project itself: its working tree travels to the device
    return subprocess.run(
        [sys.executable, "-c", IMAGE_ONLY, ",".join(sorted(allowed)), *args],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_wheel_list_pins_one_version_of_what_the_image_lacks():
    lines = [
        line.split("#")[0].strip()
        for line in (BENCHMARKS / "h200_wheels.txt").read_text().splitlines()
    ]
    specs = [line for line in lines if line]
    assert all(re.fullmatch(r"[\w.-]+==[\w.]+", spec) for spec in specs), specs
    assert len(names(BENCHMARKS / "h200_wheels.txt")) == len(specs)  # one version each
    assert not names(BENCHMARKS / "h200_wheels.txt") & names(BENCHMARKS / "h200_image_packages.txt")


def test_the_benches_of_h200_sh_run_on_the_image_packages_and_the_wheels(tmp_path):
    train = run_on_image(
        "bov_jax.bench",
        "train",
        "--configs=configs/d12.py,configs/d12_bov.py",
        "--depth=2",
        "--model_dim=128",
        "--seq_len=64",
        "--vocab_size=512",
        "--device_batch_size=2",
        "--max_micro_batches=2",
        "--steps=1",
        "--reps=1",
        f"--json_out={tmp_path / 'train.json'}",
        f"--profile={tmp_path / 'trace'}",
    )
    assert train.returncode == 0, train.stderr[-3000:]
    assert (tmp_path / "train.json").is_file() and "not on the H200 image" not in train.stderr
    decode = run_on_image(
        "bov_jax.inference.bench_decode",
        "--depth=2",
        "--model_dim=128",
        "--head_dim=64",
        "--vocab_size=256",
        "--batch=2",
        "--contexts=64",
        "--new_tokens=2",
        "--repeats=1",
        f"--json_out={tmp_path / 'decode.json'}",
    )
    assert decode.returncode == 0, decode.stderr[-3000:]
    results_from_the_run_folder(tmp_path)


def results_from_the_run_folder(run: Path) -> None:
    """benchmarks/h200_results.py reads the benches' JSON as h200.sh names it in $OUT."""
    out = run / "out"
    out.mkdir()
    train = json.loads((run / "train.json").read_text())
    for name in ("train_d12.json", "train_d24.json"):
        (out / name).write_text(json.dumps(train))
    decode = json.loads((run / "decode.json").read_text())
    (out / "decode_d24_bank_kernel1.json").write_text(
        json.dumps({**decode, "contexts": [{**decode["contexts"][0], "context": 2048}]})
    )
    (out / "gpu.txt").write_text("NVIDIA H200, 143771 MiB\njax 0.11.2 jaxlib 0.11.2 flax 0.12.10\n")
    written = subprocess.run(
        [sys.executable, str(BENCHMARKS / "h200_results.py"), str(out), "--command=h200.sh"]
        + [f"--json_out={run / 'h200.json'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert written.returncode == 0, written.stderr
    results = json.loads((run / "h200.json").read_text())
    bov = train[-1]
    rates = decode["contexts"][0]["tokens_per_sec"]
    assert results["bov_over_base_step_d24"] == bov["step_time_ratio_vs_first"]["median"]
    assert results["d24_bov_mfu"] == bov["mfu_step"]  # null on CPU: no peak to divide by
    assert results["decode_no_v_over_base_2k"] == rates["BoV, no V cache"] / rates["baseline"]
    assert results["decode_no_v_over_base_32k"] is None  # this run has no 32K row
    assert "missing" not in written.stderr
    shares = bov["profile"]["attributed_share"]
    assert results["profile_attributed_share"] == min(shares.values()) > 0
    assert (results["jax"], results["command"]) == ("0.11.2", "h200.sh")


def test_a_package_off_the_image_is_refused():
    """The guard itself: an installed distribution that is neither on the image nor carried
    (tensorboardX, which the trainer's metrics use and the bench does not) cannot be imported."""
    refused = run_on_image("tensorboardX")
    assert refused.returncode != 0
    assert "tensorboardX (tensorboardX) is not on the H200 image" in refused.stderr
