"""Install and launch: the dependencies are declared once (pyproject.toml's, plus `dev`, are
requirements.txt; the accelerator extras pin the same jax), `launch/tpu_pod.sh install` stops
with one line without a Python >= 3.11, and the documented commands name modules that exist."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def test_requirements_txt_is_pyproject_dependencies_plus_dev():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["dev"]
    assert requirement_lines(REPO / "requirements.txt") == declared


def test_accelerator_extras_pin_the_cpu_jax_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    jax = next(d for d in project["dependencies"] if re.match(r"jax[<>=]", d))
    extras = project["optional-dependencies"]
    assert extras["cuda12"] == [jax.replace("jax", "jax[cuda12]", 1)]
    assert extras["tpu"] == [jax.replace("jax", "jax[tpu]", 1)]
    assert project["requires-python"] == ">=3.11"


def test_tpu_pod_install_stops_with_one_line_without_python_311(tmp_path):
    """`launch/tpu_pod.sh install` on an image whose pythons are all 3.10 and where uv cannot be
    installed: gcloud is replaced by a stand-in that runs the worker command here."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "gcloud").write_text(
        "#!/bin/bash\n"
        'for a in "$@"; do case $a in --command=*) exec /bin/bash -c "${a#--command=}";; esac\n'
        "done\n"
    )
    for name in ("python3", "python3.11", "python3.12", "python3.13"):  # Python 3.10, no pip
        (fake / name).write_text('#!/bin/bash\n[ "$1" = -V ] && echo "Python 3.10.12"\nexit 1\n')
    for path in fake.iterdir():
        path.chmod(0o755)
    home = tmp_path / "home"
    (home / "bov_jax").mkdir(parents=True)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(home), "TPU_NAME": "t", "ZONE": "z"}
    done = subprocess.run(
        ["bash", str(REPO / "launch" / "tpu_pod.sh"), "install"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and "no Python >= 3.11 (the image has Python 3.10.12)" in line
    assert "uv could not install one" in line and not (home / "bov_jax" / ".venv").exists()


DOCUMENTED = [
    "README.md",
    *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")),
]
LAUNCH = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "launch").glob("*.sh"))


@pytest.mark.parametrize("path", DOCUMENTED + LAUNCH)
def test_documented_commands_name_existing_modules(path):
    modules = set(re.findall(r"-m (bov_jax(?:\.\w+)*)", (REPO / path).read_text()))
    missing = [m for m in sorted(modules) if importlib.util.find_spec(m) is None]
    assert not missing, f"{path} runs modules that do not exist: {missing}"


@pytest.mark.parametrize("path", [*LAUNCH, "launch/slurm.sbatch"])
def test_launch_scripts_parse(path):
    done = subprocess.run(["bash", "-n", str(REPO / path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def readme_install() -> list[str]:
    """The arguments of the README's first `pip install` (the main job's command)."""
    line = next(x for x in (REPO / "README.md").read_text().splitlines() if x.startswith("pip "))
    return line.split("&&")[0].split()


def test_the_readme_install_makes_the_commands_work_from_any_folder(tmp_path):
    """The README's install in a new venv, then the server's command from a folder of its
    own. The dependencies come from this venv's site-packages (--no-deps), the build backend
    (setuptools) from the package index, as for a user. setuptools leaves bov_jax.egg-info
    in the checkout (git ignores it)."""
    assert readme_install() == ["pip", "install", "-e", "."]
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    Path(site, "dependencies.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="")

    def command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(python), *args],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    assert "No module named 'bov_jax'" in command("-m", "bov_jax.serve", "--help").stderr
    pip = ["-m", *readme_install()[:-1], str(REPO), "--no-deps"]
    installed = command(*pip, "--quiet", "--disable-pip-version-check")
    assert installed.returncode == 0, installed.stderr
    done = command("-m", "bov_jax.serve", "--help")
    assert done.returncode == 0 and "Serve a trained model" in done.stdout, done.stderr
