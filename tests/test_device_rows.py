"""train.device_batch_size = 0: the compiled rows for the chip, and the table's evidence."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import pytest

from bov_jax import sharding
from bov_jax.compile import targets
from bov_jax.config import load_config_file
from bov_jax.errors import ConfigError
from bov_jax.presets import config_for
from bov_jax.train import device_rows

REPO = Path(__file__).resolve().parents[1]
REPORTS = sorted((REPO / "docs" / "results" / "targets").glob("*.json"))


@pytest.mark.parametrize("name", ["v4-8", "v5e-8", "v5p-8", "v6e-8"])
def test_tpu_device_kinds_name_their_chip(name):
    devices = targets.target_devices(targets.resolve_target(name))
    assert device_rows.chip(devices[0].device_kind) == name.split("-")[0]


@pytest.mark.parametrize("model", ["a100", "h100", "h200"])
def test_gpu_device_kinds_name_their_chip(model):
    text = targets.gpu_config_text(model)
    kind = re.search(r'device_description_str: "([^"]+)"', text).group(1)
    assert device_rows.chip(kind) == model
    assert device_rows.chip(jax.devices()[0].device_kind) is None  # this host's CPU


def data_parallel_reports() -> dict[tuple[int, str, int], bool]:
    """(depth, chip, rows) -> fits, over the committed data-parallel reports."""
    found = {}
    for path in REPORTS:
        report = json.loads(path.read_text())
        if report["mesh"]["fsdp"] == report["mesh"]["tensor"] == 1:
            depth = load_config_file(str(REPO / report["config"])).model.depth
            key = (depth, device_rows.chip(report["device_kind"]), report["device_batch_size"])
            found[key] = found.get(key, True) and report["fits"]
    return found


def test_every_entry_is_what_the_committed_compiles_found():
    """Each (depth, chip) entry is the rows of a committed data-parallel report that fits on
    that chip; a None entry has a report at one row per device that does not."""
    reports = data_parallel_reports()
    for (depth, chip), rows in device_rows.COMPILED_ROWS.items():
        if rows is None:
            assert reports.get((depth, chip, 1)) is False, f"{depth=} on {chip}: no 1-row report"
            assert not any(fits for (d, c, _), fits in reports.items() if (d, c) == (depth, chip))
        else:
            assert reports.get((depth, chip, rows)), f"no fitting report for {depth=} on {chip}"


def test_a_preset_takes_its_rows_from_the_table_for_the_target_chip():
    config = config_for("d24_bov")
    devices = targets.target_devices(targets.resolve_target("v5p-8"))
    mesh = sharding.make_mesh(config.mesh, devices)
    chosen = device_rows.resolve(config, 2**20, mesh)
    assert config.train.device_batch_size == device_rows.COMPILED_ROWS[(24, "v5p")] == 16
    assert "compiled table for depth 24 on v5p" in chosen


def test_a_chip_too_small_for_data_parallelism_is_a_config_error():
    config = config_for("d24_bov")
    devices = targets.target_devices(targets.resolve_target("v5e-8"))
    with pytest.raises(ConfigError, match="does not fit TPU v5 lite chips with data parallel"):
        device_rows.resolve(config, 2**20, sharding.make_mesh(config.mesh, devices))
    config.mesh.data, config.mesh.fsdp = 1, 8  # the table is for data parallelism only
    chosen = device_rows.resolve(config, 2**20, sharding.make_mesh(config.mesh, devices))
    assert config.train.device_batch_size == device_rows.FALLBACK_ROWS
    assert "fallback" in chosen


def test_without_an_entry_the_fallback_is_lowered_to_divide_the_rows():
    config = config_for("d12_bov")
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    chosen = device_rows.resolve(config, 12 * 2048, mesh)  # 12 rows per device per step
    assert device_rows.FALLBACK_ROWS == 8 and config.train.device_batch_size == 6
    assert "fallback of 8" in chosen


def test_a_given_size_is_kept():
    config = config_for("d12_bov")
    config.train.device_batch_size = 4
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    assert device_rows.resolve(config, 2**19, mesh) is None
    assert config.train.device_batch_size == 4
