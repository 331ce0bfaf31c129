"""No TPU probe on a host without a TPU (bov_jax/train/platform.py.skip_absent_tpu)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from bov_jax.train.platform import platforms_without_tpu

REPO = Path(__file__).resolve().parents[1]
TPU_NOISE = ("libtpu", "TPU", "InitGoogle", "host bounds", "worker hostname")


def run_without_platforms(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_libtpu_is_installed_so_the_probe_would_run():
    # requirements-aot.txt (CI installs it): without libtpu the tests below prove nothing
    assert importlib.util.find_spec("libtpu") is not None


def test_a_command_on_this_cpu_host_prints_no_tpu_lines():
    result = run_without_platforms("-m", "bov_jax.main", "--check_platform=cpu")
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert not [word for word in TPU_NOISE if word in output], output


def test_plain_jax_without_bov_jax_still_probes_libtpu():
    # what the import of bov_jax prevents: the same backend start without it
    result = run_without_platforms("-c", "import jax; jax.devices()")
    assert result.returncode == 0, result.stderr
    assert any(word in result.stderr for word in TPU_NOISE), result.stderr


def test_the_users_jax_platforms_is_kept():
    assert platforms_without_tpu({"JAX_PLATFORMS": "tpu"}) is None
    assert platforms_without_tpu({}) == "cpu"  # this host: libtpu installed, no TPU, no GPU
