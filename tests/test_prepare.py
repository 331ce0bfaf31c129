"""The paper-scale path offline: a local ClimbMix mirror -> `python -m bov_jax.prepare` (a
download killed half-way and resumed, a rerun that only verifies) -> `python -m bov_jax.main
--config=configs/d24_bov.py` at CPU size; and the one-line stop of an unprepared paper config.

The mirror is an HTTP server on 127.0.0.1 in this process (Range requests, Content-Length and
the hub's X-Linked-Etag sha256), serving shards in the ClimbMix layout written by the test.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_resume import REPO, environment

from bov_jax.corpora import climbmix
from bov_jax.data.testing import write_corpus
from bov_jax.prepare import (
    MARGIN,
    TOKENS_PER_SHARD,
    check_prepared,
    prepare_command,
    shards_for_tokens,
)
from bov_jax.presets import config_for

VOCAB = 384
# The downloader reads 1 MiB blocks: the shard cut half-way must be larger for its .part file
# to hold bytes when the download is killed. Random bytes in an extra column make it so (the
# readers take only the text column).
STALLED = climbmix.shard_name(0)
STALL_AFTER = 3 << 20 >> 1  # bytes sent before the server stalls


class Mirror(http.server.ThreadingHTTPServer):
    """Serves `files` {name: bytes} like the hub; the first request for STALLED stops after
    STALL_AFTER bytes until `release` is set (at most 60 s)."""

    daemon_threads = True

    def __init__(self, files: dict[str, bytes]):
        super().__init__(("127.0.0.1", 0), MirrorHandler)
        self.files = files
        self.requests: list[tuple[str, int]] = []
        self.release = threading.Event()
        self.stalled_once = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class MirrorHandler(http.server.BaseHTTPRequestHandler):
    server: Mirror

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        name = self.path.rsplit("/", 1)[-1]
        data = self.server.files.get(name)
        if data is None:
            self.send_error(404)
            return
        start = int(self.headers.get("Range", "bytes=0-")[len("bytes=") :].rstrip("-") or 0)
        self.server.requests.append((name, start))
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.end_headers()
        if name == STALLED and not self.server.stalled_once:
            self.server.stalled_once = True
            self.wfile.write(data[start:STALL_AFTER])
            self.wfile.flush()
            self.server.release.wait(60)
            return  # the connection closes short
        self.wfile.write(data[start:])


def mirror_files(root: Path) -> dict[str, bytes]:
    """shard_00000 (padded past 1 MiB), shard_00001 and the val shard shard_06542."""
    corpus = write_corpus(root, train_shards=2, docs_per_shard=48, max_words=300)
    (corpus / "shard_00002.parquet").rename(corpus / climbmix.shard_name(climbmix.MAX_SHARD))
    first = pq.read_table(corpus / STALLED)
    rng = np.random.default_rng(0)
    padding = [rng.bytes((3 << 20) // len(first)) for _ in range(len(first))]
    pq.write_table(first.append_column("padding", pa.array(padding, pa.binary())), corpus / STALLED)
    return {p.name: p.read_bytes() for p in sorted(corpus.glob("*.parquet"))}


@pytest.fixture()
def mirror(tmp_path) -> Iterator[Mirror]:
    server = Mirror(mirror_files(tmp_path / "hub"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


def command(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=timeout
    )


def prepare_args(data: Path, mirror: Mirror) -> list[str]:
    return command(
        "bov_jax.prepare",
        "--config=configs/d24_bov.py",
        f"--config.model.vocab_size={VOCAB}",
        f"--data_dir={data}",
        "--num_shards=2",
        f"--base_url={mirror.url}",
        "--threads=2",
    )


CPU_D24 = (
    f"--config.model.vocab_size={VOCAB}",
    "--config.model.depth=3",
    "--config.model.model_dim=64",
    "--config.model.head_dim=32",
    "--config.model.seq_len=64",
    "--config.train.num_steps=2",
    "--config.train.total_batch_tokens=256",
    "--config.train.device_batch_size=4",
    "--config.train.eval_tokens=256",
    "--config.train.sample_tokens=0",
)


def test_offline_prepare_then_d24_trains_and_evaluates(mirror, tmp_path):
    data, workdir = tmp_path / "climbmix", tmp_path / "run"
    # 1. a prepare killed while shard_00000 is half-way through
    killed = subprocess.Popen(
        prepare_args(data, mirror), cwd=REPO, env=environment(), stdout=subprocess.PIPE, text=True
    )
    part = data / f"{STALLED}.part"
    deadline = time.monotonic() + 60
    while not (part.exists() and part.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed.kill()
    killed.wait(30)
    mirror.release.set()
    size_at_kill = part.stat().st_size
    assert 0 < size_at_kill < len(mirror.files[STALLED])
    assert "2 train shards + the val shard" in killed.stdout.read()  # said before downloading
    killed.stdout.close()

    # 2. the rerun resumes the partial file and prepares the directory
    done = run(prepare_args(data, mirror))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (STALLED, size_at_kill) in mirror.requests  # a Range request from the cut
    assert (data / STALLED).read_bytes() == mirror.files[STALLED]
    record = json.loads((data / "prepared.json").read_text())
    assert record["vocab_size"] == VOCAB and record["tokenizer_sha256"]
    assert record["shards"] == [STALLED, "shard_00001.parquet", "shard_06542.parquet"]
    assert record["split_tokens"]["train"] > record["split_tokens"]["val"] > 0
    assert "is ready" in done.stdout
    assert "building the token cache" in done.stderr
    for noise in ("Downloading and preparing", "\r", "\x1b["):  # TFDS' banner, progress bars
        assert noise not in done.stdout + done.stderr
    tokenizer_record = json.loads((data / "tokenizer" / "training_config.json").read_text())
    assert (tokenizer_record["doc_chars"], tokenizer_record["max_chars"]) == (10_000, 2 * 10**9)

    # 3. a rerun on the ready directory verifies and does nothing else
    requests = len(mirror.requests)
    tokenizer_mtime = (data / "tokenizer" / "tokenizer.model").stat().st_mtime_ns
    again = run(prepare_args(data, mirror))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is ready (verified prepared.json" in again.stdout
    assert len(mirror.requests) == requests
    assert (data / "tokenizer" / "tokenizer.model").stat().st_mtime_ns == tokenizer_mtime
    assert "building the token cache" not in again.stderr

    # 3b. a shard damaged in place (same size and footer, mtime set back) is fetched again
    damaged = data / "shard_00001.parquet"
    stat = damaged.stat()
    with open(damaged, "r+b") as f:
        f.seek(stat.st_size // 3)
        f.write(bytes(1024))
    os.utime(damaged, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    refetched = run(prepare_args(data, mirror))
    assert refetched.returncode == 0, refetched.stderr[-3000:]
    assert "shard_00001.parquet differs from prepared.json (size or sha256)" in refetched.stderr
    assert damaged.read_bytes() == mirror.files[damaged.name]
    assert mirror.requests[requests:] == [(damaged.name, 0)]
    record = json.loads((data / "prepared.json").read_text())
    assert {f["name"]: f["sha256"] for f in record["files"]}[damaged.name] == hashlib.sha256(
        mirror.files[damaged.name]
    ).hexdigest()

    # 4. the paper config trains on it
    main = run(
        command(
            "bov_jax.main",
            "--config=configs/d24_bov.py",
            f"--config.data.data_dir={data}",
            f"--workdir={workdir}",
            *CPU_D24,
        )
    )
    assert main.returncode == 0, main.stderr[-3000:]
    for line in (
        "backend cpu: 1 x cpu (1 per process), 1 process(es)",
        "dtypes: compute float32, params float32, tables float32; attention xla",
        f"workdir {workdir}: metrics.jsonl and tensorboard/ (tensorboard --logdir {workdir}/",
        f"saving checkpoint 2 to {workdir}/checkpoints/2",
        "checkpoint 2 saved (",
    ):
        assert line in main.stderr, line
    (entry,) = json.loads((workdir / "run.json").read_text())["invocations"]
    assert len(entry["git"]["commit"]) == 40 and isinstance(entry["git"]["dirty"], bool)
    assert {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain"} <= set(entry["versions"])
    assert entry["versions"]["jax"] == jax.__version__
    assert (entry["backend"], entry["device_kind"], entry["device_count"]) == ("cpu", "cpu", 1)
    assert entry["process_count"] == 1 and entry["start_step"] == 0
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_bpb" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(np.isfinite(r["val_bpb"]) for r in evals)
    assert [r["step"] for r in records if "loss" in r] == [0, 1]


def test_unprepared_paper_config_stops_at_once_naming_prepare(tmp_path):
    workdir = tmp_path / "run"
    start = time.monotonic()
    done = run(command("bov_jax.main", "--config=configs/d24_bov.py", f"--workdir={workdir}"))
    seconds = time.monotonic() - start
    assert done.returncode == 2 and seconds < 30
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: the data is not prepared: tokenizer ")
    assert "has vocab size 8192 but model.vocab_size is 32768" in lines[0]
    assert (
        "run `python -m bov_jax.prepare --config=configs/d24_bov.py --data_dir=DIR`, then add "
        "--config.data.data_dir=DIR" in lines[0]
    )
    assert not workdir.exists()


def test_show_config_prints_the_given_config_with_its_overrides():
    done = run(
        command(
            "bov_jax.main",
            "--config=configs/quickstart.py",
            "--config.train.num_steps=7",
            "--show_config",
        )
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "model.depth = 4  # transformer blocks" in lines
    assert any(line.startswith("train.num_steps = 7") for line in lines)


def test_prepare_command_keeps_the_config_and_its_overrides():
    argv = [
        "--config",
        "configs/d24.py",
        "--workdir=W",
        "--config.train.target_flops=3.91e19",
        "--config.data.data_dir=/data/cm",
        "--local_device_count=2",
    ]
    assert prepare_command(argv) == (
        "python -m bov_jax.prepare --config=configs/d24.py "
        "--config.train.target_flops=3.91e19 --data_dir=/data/cm",
        True,
    )
    config = config_for("d24")
    config.data.data_dir = "/nonexistent/cm"
    with pytest.raises(Exception, match=r"data directory /nonexistent/cm does not exist; run `"):
        check_prepared(config, argv)


def test_shard_count_covers_the_horizon_with_the_margin():
    assert shards_for_tokens(1) == 1
    assert shards_for_tokens(TOKENS_PER_SHARD) == 2  # one shard's tokens need 1.2 shards
    tokens = 100 * 10**9  # the d24 horizon
    count = shards_for_tokens(tokens)
    assert (count - 1) * TOKENS_PER_SHARD < tokens * (1 + MARGIN) <= count * TOKENS_PER_SHARD
    assert count == 2305  # about 230 GB
    assert shards_for_tokens(10**15) == climbmix.MAX_SHARD
