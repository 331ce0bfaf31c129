"""Build a shard directory (ClimbMix layout) from packages: fetch, extract, mix, shard, manifest.

Used by `build_embedded` and `build_debmix`. Each step is resumable: downloads, unpacked trees
and each source's extracted documents are kept in a work directory and reused on a rerun.
"""

import json
import logging
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from absl import flags

from bov_jax.corpora import registry
from bov_jax.corpora.sources.text import split_document
from bov_jax.data import shards

log = logging.getLogger(__name__)
MANIFEST = "MANIFEST.json"


@dataclass(frozen=True)
class Source:
    """One corpus source: a package, its licence, and how to turn its files into documents.

    `extract(root)` yields documents from the tree the package was unpacked into (only the
    files matching `members`). `max_bytes` > 0 keeps a seeded selection of whole documents up
    to that many bytes; `max_doc_bytes` > 0 splits longer documents at paragraph breaks.
    """

    name: str
    package: registry.Package
    licence: str
    extract: Callable[[Path], Iterable[str]]
    members: tuple[str, ...] = ("*",)
    max_bytes: int = 0
    max_doc_bytes: int = 0
    notes: str = ""


@dataclass
class _Extracted:
    source: Source
    fetched: registry.Fetched
    texts: list[str] = field(default_factory=list)


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _select(texts: list[str], max_bytes: int, seed: int, name: str) -> list[str]:
    """A seeded subset of whole documents, at most `max_bytes`, in their original order."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    keep, total = [], 0
    for i in rng.permutation(len(texts)):
        if total + _nbytes(texts[i]) <= max_bytes:
            keep.append(int(i))
            total += _nbytes(texts[i])
    return [texts[i] for i in sorted(keep)]


def _extract_source(source: Source, work_dir: Path, seed: int) -> _Extracted:
    fetched = registry.fetch(source.package, work_dir / "downloads")
    # keyed by the archive digest: a new pin never reuses documents of the old archive
    cached = work_dir / "documents" / f"{source.name}-{fetched.sha256[:16]}.parquet"
    if cached.exists():
        texts = pq.read_table(cached).column(shards.TEXT_COLUMN).to_pylist()
        return _Extracted(source, fetched, texts)
    root = registry.unpack(fetched, work_dir / "unpacked" / source.name, source.members)
    texts = [t.strip() for t in source.extract(root) if t.strip()]
    if source.max_doc_bytes:
        texts = [part for t in texts for part in split_document(t, source.max_doc_bytes)]
    if source.max_bytes:
        texts = _select(texts, source.max_bytes, seed, source.name)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    pq.write_table(pa.table({shards.TEXT_COLUMN: pa.array(texts, pa.string())}), tmp)
    tmp.replace(cached)
    return _Extracted(source, fetched, texts)


def _shard_bounds(sizes: list[int], shard_bytes: int) -> list[tuple[int, int]]:
    """Cuts consecutive documents into runs of about `shard_bytes` each (at least one run)."""
    count = max(1, round(sum(sizes) / shard_bytes))
    cuts = np.searchsorted(np.cumsum(sizes), np.arange(1, count) * sum(sizes) / count)
    edges = [0, *[int(c) + 1 for c in cuts], len(sizes)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def build_corpus(
    sources: list[Source],
    out_dir: Path,
    work_dir: Path,
    *,
    corpus_name: str,
    command: str,
    seed: int,
    shard_bytes: int,
    val_fraction: float,
    row_group_size: int,
) -> dict:
    """Builds `out_dir/shard_NNNNN.parquet` (last one = val) and `out_dir/MANIFEST.json`.

    Documents of all sources are shuffled together with `seed`; the trailing `val_fraction` of
    the bytes becomes the validation shard, the rest is cut into train shards of ~`shard_bytes`.
    Returns the manifest.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    extracted = []
    for i, source in enumerate(sources):
        start = time.time()
        item = _extract_source(source, work_dir, seed)
        extracted.append(item)
        log.info(
            "[%d/%d] %-28s %s %s: %d documents, %.1f MB (%.0f s)",
            i + 1,
            len(sources),
            source.name,
            item.fetched.name,
            item.fetched.version,
            len(item.texts),
            sum(map(_nbytes, item.texts)) / 1e6,
            time.time() - start,
        )
    docs = [(e.source.name, t) for e in extracted for t in e.texts]
    docs = [docs[i] for i in np.random.default_rng(seed).permutation(len(docs))]
    sizes = [_nbytes(t) for _, t in docs]
    n_val = int(np.searchsorted(np.cumsum(sizes[::-1]), val_fraction * sum(sizes))) + 1
    runs = _shard_bounds(sizes[:-n_val], shard_bytes) + [(len(docs) - n_val, len(docs))]
    for stale in out_dir.glob("*.parquet"):
        stale.unlink()
    shard_entries = []
    for k, (a, b) in enumerate(runs):
        path = out_dir / f"shard_{k:05d}.parquet"
        texts, names = [t for _, t in docs[a:b]], [s for s, _ in docs[a:b]]
        digest = shards.write_shard(path, texts, names, row_group_size)
        split = "val" if k == len(runs) - 1 else "train"
        shard_entries.append(
            dict(
                file=path.name,
                split=split,
                documents=b - a,
                text_bytes=sum(sizes[a:b]),
                file_bytes=path.stat().st_size,
                sha256=digest,
            )
        )
        log.info("wrote %s (%s): %d documents, %.1f MB", path, split, b - a, sum(sizes[a:b]) / 1e6)
    manifest = dict(
        corpus=corpus_name,
        built_by=command,
        seed=seed,
        val_fraction=val_fraction,
        row_group_size=row_group_size,
        documents=len(docs),
        text_bytes=sum(sizes),
        sources=[
            dict(
                name=e.source.name,
                registry=e.source.package.registry,
                package=e.fetched.name,
                requested=e.source.package.name,
                version=e.fetched.version,
                archive=e.fetched.path.name,
                archive_sha256=e.fetched.sha256,
                licence=e.source.licence,
                documents=len(e.texts),
                text_bytes=sum(map(_nbytes, e.texts)),
                notes=e.source.notes,
            )
            for e in extracted
        ],
        shards=shard_entries,
    )
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def define_corpus_flags(corpus_name: str, default_out: Path | None) -> None:
    """A corpus builder's flags, defined when it runs: --out (required without a default),
    --work_dir (also --work-dir)."""
    out = None if default_out is None else str(default_out)
    flags.DEFINE_string("out", out, "Shard directory to write.", required=default_out is None)
    cache = Path.home() / ".cache" / "bov_jax" / corpus_name
    flags.DEFINE_string("work_dir", str(cache), "Downloads and extracted documents, kept.")
    flags.DEFINE_alias("work-dir", "work_dir")


def corpus_main(sources: list[Source], corpus_name: str, **build_kwargs) -> None:
    """The command line of a corpus builder: `build_corpus` into --out, keeping --work_dir."""
    build_corpus(
        sources,
        Path(flags.FLAGS.out),
        Path(flags.FLAGS.work_dir),
        corpus_name=corpus_name,
        command=f"python -m bov_jax.corpora.build_{corpus_name}",
        **build_kwargs,
    )
