"""The finished jobs of a sweep root, which the probes' sweep reports score."""

from __future__ import annotations

import json
from pathlib import Path


def finished_jobs(root: Path) -> list[Path]:
    """Workdirs root/<run>/seed<k> whose status.json says they reached their horizon."""
    jobs = []
    for status in sorted(root.glob("*/seed*/status.json")):
        record = json.loads(status.read_text())
        if record["step"] >= record["num_steps"]:
            jobs.append(status.parent)
    return jobs


def seed_of(workdir: Path) -> int:
    """root/<run>/seed<k> -> k."""
    return int(workdir.name.removeprefix("seed"))
