"""WORKDIR/run.json: what ran, one entry per invocation (a resumed run may move machines).

Each entry holds the start time, the step it started from, the code's git commit and whether
the tree had uncommitted changes, the versions of the libraries that decide the numbers
(jax, jaxlib, flax, optax, orbax, grain, ...), the backend, device kind and counts, the
process count and the host. config.json stays the experiment (compared on resume); run.json
is the machine and the code.

A checkout without .git (launch/tpu_pod.sh copies files only) reads the revision from
REVISION_FILE, which that script writes from the workstation's checkout.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import jax

from bov_jax.files import write_json_atomic

REPO_ROOT = Path(__file__).resolve().parents[2]
REVISION_FILE = ".revision.json"
RUN_FILE = "run.json"
LIBRARIES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "grain",
    "numpy",
    "ml-dtypes",
    "tensorflow-datasets",
    "sentencepiece",
)
# Accelerator plugins: which of them is installed says which jax backend a machine can run.
PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "libtpu")


def git_revision(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """{"commit": sha, "dirty": uncommitted changes to tracked files} of `repo`; from
    REVISION_FILE without git or .git; both None when neither says."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return {"commit": commit, "dirty": bool(status.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        recorded = json.loads((repo / REVISION_FILE).read_text())
        return {"commit": recorded.get("commit"), "dirty": recorded.get("dirty")}
    except (OSError, ValueError, AttributeError):
        return {"commit": None, "dirty": None}


def library_versions() -> dict[str, str]:
    """{distribution: version} of LIBRARIES and the installed PLUGINS."""
    versions = {}
    for name in (*LIBRARIES, *PLUGINS):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            if name in LIBRARIES:
                versions[name] = "not installed"
    return versions


def device_summary() -> dict[str, Any]:
    """The backend, device kind, global and local device counts, process count and index."""
    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
    }


def invocation(step: int) -> dict[str, Any]:
    """This invocation's entry, starting from `step`."""
    return {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "start_step": step,
        "git": git_revision(),
        "versions": library_versions(),
        "python": platform.python_version(),
        "host": socket.gethostname(),
        **device_summary(),
    }


def append_invocation(workdir: Path, entry: dict[str, Any]) -> None:
    """Add `entry` to WORKDIR/run.json's "invocations" (atomic; a damaged file starts over)."""
    path = Path(workdir) / RUN_FILE
    try:
        record = json.loads(path.read_text())
        entries = list(record["invocations"])
    except (OSError, ValueError, KeyError, TypeError):
        entries = []
    write_json_atomic(path, {"invocations": [*entries, entry]})
