"""A config file that is not right: one `error:` line naming the file, from every command.

Every command that takes a config file loads it through `bov_jax.config.load_config_file`;
each kind of broken file below (all seen by a new user at 49cab77, where they printed 31-62
line tracebacks or an 879-character line) ends in one `error:` line of at most ~200
characters naming the file (and its line where there is one), at most one hint line, exit
status 2, and nothing created in the workdir.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_resume import REPO, environment

from bov_jax.config import load_config_file
from bov_jax.errors import ConfigError

BAD_FILES = {
    "syntax": ("def get_config(:\n    pass\n", "line 1: syntax error"),
    "missing_module": (
        "import no_such_module_here\n\ndef get_config():\n    return None\n",
        "line 1 failed to load: ModuleNotFoundError: No module named 'no_such_module_here'",
    ),
    "returns_int": ("def get_config():\n    return 3\n", "get_config() returned int; expected"),
    "returns_dict": (
        "def get_config():\n    return {'model': {}}\n",
        "get_config() returned dict; expected an ml_collections.ConfigDict",
    ),
    "no_sections": (
        "import ml_collections\n\ndef get_config():\n    c = ml_collections.ConfigDict()\n"
        "    c.name = 'x'\n    return c\n",
        "returned a ConfigDict without the sections data, model, optim, train, mesh, checkpoint",
    ),
    "some_sections": (
        "from bov_jax.config import default_config\n\ndef get_config():\n"
        "    c = default_config()\n    del c['optim']\n    return c\n",
        "returned a ConfigDict without the section optim",
    ),
    "raises": (
        "def get_config():\n    raise ValueError('far too long a message ' * 40)\n",
        "line 2: get_config() raised ValueError: far too long a message",
    ),
    "no_get_config": ("CONFIG = 1\n", "defines no get_config()"),
}
MAX_LINE = 200


def write_bad(directory: Path, kind: str) -> Path:
    path = directory / f"{kind}.py"
    path.write_text(BAD_FILES[kind][0])
    return path


def run_command(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_one_line(result: subprocess.CompletedProcess, path: Path, expected: str) -> None:
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr
    assert len(errors) == 1 and len(lines) <= 2, result.stderr
    assert len(errors[0]) <= MAX_LINE + len(str(path)), errors[0]
    assert f"config file {path}" in errors[0] and expected in errors[0], errors[0]
    assert all(line == errors[0] or line.startswith("hint: ") for line in lines), result.stderr


def test_main_prints_one_line_per_kind_of_bad_file_and_creates_nothing(tmp_path):
    runs = {kind: (write_bad(tmp_path, kind), tmp_path / f"workdir_{kind}") for kind in BAD_FILES}
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(
            lambda item: run_command(
                ["bov_jax.main", f"--config={item[0]}", f"--workdir={item[1]}"]
            ),
            runs.values(),
        )
        for (kind, (path, workdir)), result in zip(runs.items(), results):
            assert_one_line(result, path, BAD_FILES[kind][1])
            assert not workdir.exists(), kind


@pytest.mark.parametrize(
    "command",
    [
        ["bov_jax.prepare", "--data_dir={tmp}/data"],
        ["bov_jax.compile", "--target=v5e-4"],
        ["bov_jax.inference.memory"],
    ],
)
def test_every_config_command_loads_through_the_same_path(tmp_path, command):
    path = write_bad(tmp_path, "returns_dict")
    args = [arg.format(tmp=tmp_path) for arg in command]
    result = run_command([*args, f"--config={path}"])
    assert_one_line(result, path, BAD_FILES["returns_dict"][1])
    assert not (tmp_path / "data").exists()


def test_accounting_which_config_imports_says_the_same_in_one_line(tmp_path):
    """bov_jax.accounting cannot use the loader (bov_jax.config imports it); absl's loading of
    the file still ends in one error line."""
    path = write_bad(tmp_path, "syntax")
    result = run_command(["bov_jax.accounting", f"--config={path}"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "SyntaxError" in errors[0], result.stderr
    assert len(errors[0]) <= MAX_LINE and "Traceback" not in result.stderr


def test_bench_and_sweep_configs_load_through_the_same_path(tmp_path):
    path = write_bad(tmp_path, "missing_module")
    bench = run_command(["bov_jax.bench", "train", f"--configs={path}"])
    assert_one_line(bench, path, BAD_FILES["missing_module"][1])
    sweep_file = tmp_path / "sweep.py"
    sweep_file.write_text(
        "from bov_jax.sweep.jobs import Run, Sweep\n\n"
        "def get_sweep():\n"
        f"    return Sweep('bad', 'bad', (Run('bad', {str(path)!r}),), baseline='bad')\n"
    )
    sweep = run_command(["bov_jax.sweep", f"--sweep={sweep_file}", f"--root={tmp_path}/root"])
    assert sweep.returncode == 2 and f"config file {path}" in sweep.stderr, sweep.stderr


def test_the_traceback_is_kept_for_debug(tmp_path):
    path = write_bad(tmp_path, "raises")
    with pytest.raises(ConfigError) as caught:
        load_config_file(str(path))
    assert isinstance(caught.value.__cause__, ValueError)  # --debug shows this traceback


def test_a_good_file_with_a_preset_loads_locked():
    config = load_config_file(str(REPO / "configs/ablations.py:d12_x0_learn"))
    assert config.model.value_path.source == "x0"
    with pytest.raises(AttributeError):
        config.no_such_key = 1


def test_a_damaged_workdir_config_is_one_line_for_the_workdir_commands(tmp_path):
    (tmp_path / "config.json").write_text('{"model": ')  # cut short
    result = run_command(["bov_jax.evals.bpb", f"--workdir={tmp_path}"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert f"{tmp_path / 'config.json'} is not the JSON a run writes" in errors[0]


def test_every_key_of_the_schema_has_a_doc_for_show_config():
    from bov_jax.config import describe_keys

    undocumented = [key for key, _, doc in describe_keys() if not doc]
    assert undocumented == []
    assert any(key == "data.mqar.num_pairs" for key, _, _ in describe_keys())
