"""Download ClimbMix shards (spec 5.1): parallel, resumable, each file verified.

    python -m bov_jax.corpora.climbmix --num-shards N --out DIR [--workers 8]

Fetches shard_00000 ... shard_{N-1} plus shard_06542, the validation shard (the last file in
sorted order, as in the reference). A download goes to `NAME.part` and resumes from its end with
an HTTP Range request; a finished file is verified (size against Content-Length, sha256 against
the server's X-Linked-Etag when it sends one, and a readable parquet footer with a `text`
column) before it is renamed into place. Files already in place are verified, not fetched again.
"""

import http.client
import logging
import os
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from bov_jax import cli
from bov_jax.corpora.archives import file_sha256
from bov_jax.data import shards
from bov_jax.errors import DataError

log = logging.getLogger(__name__)

BASE_URL = "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main"
MAX_SHARD = 6542  # shard_06542 is the validation shard
_CHUNK = 1 << 20


class Response(Protocol):
    """What `fetch` returns: an HTTP-like response (urllib's HTTPResponse fits)."""

    status: int
    headers: Any  # supports .get(name), like http.client.HTTPMessage

    def read(self, size: int) -> bytes: ...

    def __enter__(self) -> "Response": ...

    def __exit__(self, *exc) -> None: ...


Fetch = Callable[[str, int], Response]


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.parquet"


def http_fetch(url: str, start: int) -> Response:
    """GET `url` from byte `start` on (a Range request when start > 0)."""
    headers = {"Range": f"bytes={start}-"} if start else {}
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60)


def plan(num_shards: int) -> list[int]:
    """Shard indices to have: 0 .. num_shards - 1 and the validation shard."""
    if not 1 <= num_shards <= MAX_SHARD:
        raise DataError(f"--num-shards must be in [1, {MAX_SHARD}], got {num_shards}")
    return [*range(num_shards), MAX_SHARD]


def verify(path: Path, size: int | None = None, sha256: str | None = None) -> None:
    """Raises DataError naming `path` unless it has the given size/sha256 and is a text shard."""
    if size is not None and path.stat().st_size != size:
        raise DataError(f"{path}: {path.stat().st_size} bytes, expected {size}")
    if sha256 is not None and file_sha256(path) != sha256:
        raise DataError(f"{path}: sha256 differs from the server's {sha256}")
    shards.check_shard(path)


def _expected(response: Response, start: int) -> tuple[int | None, str | None]:
    """(total size, sha256) announced by a response for a request from byte `start`."""
    headers = response.headers
    length = headers.get("Content-Length")
    size = int(length) + (start if response.status == 206 else 0) if length else None
    etag = (
        (headers.get("X-Linked-Etag") or headers.get("ETag") or "")
        .strip('"')
        .removeprefix("W/")
        .strip('"')
    )
    return size, etag if len(etag) == 64 and all(c in "0123456789abcdef" for c in etag) else None


def download_shard(
    index: int, out_dir: Path, base_url: str, fetch: Fetch, attempts: int = 5
) -> Path:
    """Downloads one shard into `out_dir` (resuming a `.part` file), verified; returns its path."""
    final = out_dir / shard_name(index)
    if final.exists():
        verify(final)
        return final
    part = final.with_name(final.name + ".part")
    url = f"{base_url}/{shard_name(index)}"
    attempt = 0
    while True:
        attempt += 1
        start = part.stat().st_size if part.exists() else 0
        try:
            with fetch(url, start) as response:
                size, sha256 = _expected(response, start)
                with part.open("ab" if response.status == 206 else "wb") as out:
                    for block in iter(lambda: response.read(_CHUNK), b""):
                        out.write(block)
            if size is not None and part.stat().st_size < size:
                raise OSError(f"connection closed at byte {part.stat().st_size} of {size}")
            verify(part, size, sha256)
            os.replace(part, final)
            return final
        except (OSError, http.client.HTTPException, DataError) as e:
            if isinstance(e, DataError):
                part.unlink()  # complete but wrong: start over
            if attempt == attempts:
                raise DataError(f"{url}: failed after {attempts} attempts: {e}") from e
            log.warning("%s: attempt %d failed (%s); retrying", url, attempt, e)
            time.sleep(min(2**attempt, 30))


def download(
    indices: list[int],
    out_dir: Path,
    *,
    base_url: str = BASE_URL,
    workers: int = 8,
    fetch: Fetch = http_fetch,
) -> list[Path]:
    """Downloads the shards `indices` in parallel, logging progress; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    start, done = time.time(), 0

    def one(index: int) -> Path:
        nonlocal done
        path = download_shard(index, out_dir, base_url, fetch)
        done += 1
        log.info("[%d/%d] %s (%.0f s)", done, len(indices), path.name, time.time() - start)
        return path

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, indices))


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    from absl import flags

    flags.DEFINE_integer(
        "num_shards", None, "Train shards (the reference: 8, then 170).", required=True
    )
    flags.DEFINE_string("out", None, "Directory of the shards.", required=True)
    flags.DEFINE_integer("workers", 8, "Parallel downloads.")
    flags.DEFINE_string("base_url", BASE_URL, "Where the shards are served.")
    for name in ("num_shards", "base_url"):
        flags.DEFINE_alias(name.replace("_", "-"), name)


def main(argv: list[str]) -> None:
    from absl import flags

    del argv  # no positional arguments (cli.run checks)
    args = flags.FLAGS
    cli.log_plainly()
    download(plan(args.num_shards), Path(args.out), base_url=args.base_url, workers=args.workers)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
