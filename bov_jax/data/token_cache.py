"""Pre-tokenized cache of a shard directory: a TFDS builder writing ArrayRecord, read by grain.

    python -m bov_jax.data.token_cache --data_dir DIR [--tokenizer_dir T] [--cache_dir C]

One record per document, in split order (file, row group, row): `tokens` holds the document's
ids with BOS first, or nothing when the document was skipped as bad. TFDS builds it offline and
without TensorFlow. The cache lives in `<cache_dir>/<fingerprint>/`; the fingerprint covers the
tokenizer, the shards' content (sha256, bov_jax/data/identity.py) and the skip switch, so a
changed input never reads a stale cache.
The tokenizer defaults to DATA_DIR/tokenizer and the cache directory to DATA_DIR/token_cache;
processes that start together (a sweep's jobs, the processes of a host) build it once: the first
takes a file lock beside the cache and the others wait for it.
"""

import contextlib
import fcntl
import hashlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import ml_collections
import numpy as np
import pyarrow.parquet as pq
import tensorflow_datasets as tfds
from absl import flags

from bov_jax import cli
from bov_jax.data import shards
from bov_jax.data.config import default_data_config, tokenizer_path
from bov_jax.data.documents import Unit, finish_documents
from bov_jax.data.identity import content_digests
from bov_jax.data.tokenizer import Tokenizer, load_tokenizer
from bov_jax.errors import DataError
from bov_jax.files import check_writable

log = logging.getLogger(__name__)
_VERSION = "1.0.0"


class BovTokenCache(tfds.core.GeneratorBasedBuilder):
    """Writes the tokenized documents of both splits of a shard directory."""

    VERSION = tfds.core.Version(_VERSION)
    # No checksums file to look up: without this, TFDS resolves the module's resource path,
    # which needs the optional `importlib_resources` package.
    code_path = None

    def __init__(self, *, shard_dir: Path, tokenizer: Tokenizer, skip_bad: bool, **kwargs):
        self._shard_dir = shard_dir
        self._tokenizer = tokenizer
        self._skip_bad = skip_bad
        self._dtype = id_dtype(tokenizer.vocab_size)
        super().__init__(**kwargs)

    # TFDS prints "Downloading and preparing dataset ..." and "... downloaded and prepared"
    # for every build; nothing is downloaded here, and ensure_cache logs the build itself.
    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass

    def _info(self) -> tfds.core.DatasetInfo:
        tokens = tfds.features.Tensor(
            shape=(None,), dtype=self._dtype, encoding=tfds.features.Encoding.BYTES
        )
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({"tokens": tokens}),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # everything is local
        return {split: self._generate_examples(split) for split in shards.SPLITS}

    def _generate_examples(self, split: str):
        index = 0
        for path in shards.split_files(self._shard_dir, split):
            info = shards.check_shard(path)
            parquet = pq.ParquetFile(path)
            skipped = 0
            for rg in range(len(info.row_group_rows)):
                where = f"{path}: row group {rg}"
                texts: list[str | None] = []
                for row, blob in enumerate(shards.read_raw(parquet, rg, path)):
                    ok, _ = shards.decode_documents([blob], where, self._skip_bad, first_row=row)
                    texts.append(ok[0] if ok else None)
                skipped += texts.count(None)
                ids = iter(self._tokenizer.encode([t for t in texts if t is not None]))
                for text in texts:
                    tokens = [] if text is None else [self._tokenizer.bos_id, *next(ids)]
                    yield index, {"tokens": np.asarray(tokens, self._dtype)}
                    index += 1
            shards.report_skipped(path, skipped)


def id_dtype(vocab_size: int) -> np.dtype:
    """The dtype of the cached ids: uint16 for vocabularies up to 65536, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def fingerprint(shard_dir: Path, tokenizer: Tokenizer, skip_bad: bool) -> str:
    """16 hex digits naming the cache of (shards by content, tokenizer, skip switch, cache
    format): an edited shard, even one of the same size, never reads the old cache."""
    digest = hashlib.sha256(f"{_VERSION} {tokenizer.sha256} {skip_bad}".encode())
    paths = shards.list_shards(shard_dir)
    for path in paths:
        shards.check_shard(path)
    for path, content in content_digests(paths).items():
        digest.update(f"{path.name} {content}".encode())
    return digest.hexdigest()[:16]


def cache_root(data_cfg: ml_collections.ConfigDict) -> Path:
    """Where caches of `data_cfg.data_dir` live (data.cache_dir, default DATA_DIR/token_cache)."""
    return Path(data_cfg.cache_dir or Path(data_cfg.data_dir) / "token_cache")


def _check_writable(root: Path) -> None:
    """Raises DataError, suggesting data.cache_dir, unless a cache can be written in `root`."""
    try:
        check_writable(root)
    except OSError as e:
        raise DataError(
            f"cannot build the token cache in {root}: {e.strerror or e}; set config key "
            "data.cache_dir to a writable directory (or data.use_cache=False to encode on the fly)"
        ) from e


def _builder(data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer) -> BovTokenCache:
    shard_dir = Path(data_cfg.data_dir)
    root = cache_root(data_cfg) / fingerprint(shard_dir, tokenizer, data_cfg.skip_bad_documents)
    return BovTokenCache(
        shard_dir=shard_dir,
        tokenizer=tokenizer,
        skip_bad=data_cfg.skip_bad_documents,
        data_dir=str(root),
        file_format="array_record",
    )


def built_cache(data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer) -> Path | None:
    """The directory of the cache for `data_cfg` and `tokenizer` if it is built, else None."""
    cache = Path(_builder(data_cfg, tokenizer).data_dir)
    return cache if (cache / "dataset_info.json").exists() else None


def ensure_cache(data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer) -> Path:
    """Returns the directory of the cache for `data_cfg` and `tokenizer`, building it if needed
    (TFDS' progress bars only on a terminal)."""
    builder = _builder(data_cfg, tokenizer)
    cache = Path(builder.data_dir)
    root = cache.parents[1]  # <root>/bov_token_cache/<version>
    if not (cache / "dataset_info.json").exists():
        _check_writable(root)
        with build_lock(root):  # jobs of a sweep or processes of a host may start together
            if not (cache / "dataset_info.json").exists():
                start = time.time()
                log.info("building the token cache of %s in %s", data_cfg.data_dir, cache)
                tfds.display_progress_bar(sys.stderr.isatty())
                builder.download_and_prepare()
                log.info("token cache built in %.0f s", time.time() - start)
    return cache


@contextlib.contextmanager
def build_lock(root: Path) -> Iterator[None]:
    """Holds an exclusive lock on ROOT/build.lock: one process builds, the others wait for it."""
    with open(root / "build.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish the token cache in %s", root)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class CachedUnitReader:
    """Reads a unit's documents from the cache (same output as documents.ParquetUnitReader)."""

    def __init__(self, cache_dir: Path, split: str, bos_id: int, max_doc_tokens: int):
        self._cache_dir = str(cache_dir)
        self._split = split
        self._bos_id = bos_id
        self._max_doc_tokens = max_doc_tokens
        self._source = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_source": None}

    def records(self, first: int, count: int) -> list[np.ndarray]:
        """Token arrays (BOS first, empty if skipped) of documents [first, first + count)."""
        if self._source is None:
            self._source = tfds.builder_from_directory(self._cache_dir).as_data_source(self._split)
        return [r["tokens"] for r in self._source.__getitems__(range(first, first + count))]

    def __call__(self, unit: Unit) -> dict:
        records = self.records(unit.first_document, unit.stop - unit.start)
        docs = [r[1:] for r in records if len(r)]
        return finish_documents(docs, len(records) - len(docs), self._bos_id, self._max_doc_tokens)


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    flags.DEFINE_string("data_dir", None, "Shard directory.", required=True)
    flags.DEFINE_string("tokenizer_dir", None, "Default: DATA_DIR/tokenizer.")
    flags.DEFINE_string("cache_dir", None, "Default: DATA_DIR/token_cache.")
    flags.DEFINE_bool(
        "skip_bad_documents", False, "Skip and count non-UTF-8 documents instead of stopping."
    )
    for name in ("data_dir", "tokenizer_dir", "cache_dir", "skip_bad_documents"):
        flags.DEFINE_alias(name.replace("_", "-"), name)


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (cli.run checks)
    args = flags.FLAGS
    cli.log_plainly()
    data_cfg = default_data_config()
    data_cfg.data_dir = str(Path(args.data_dir).resolve())
    data_cfg.tokenizer_dir = args.tokenizer_dir or ""
    data_cfg.cache_dir = args.cache_dir or ""
    data_cfg.skip_bad_documents = args.skip_bad_documents
    tokenizer = load_tokenizer(tokenizer_path(data_cfg), num_threads=data_cfg.encode_threads)
    print(ensure_cache(data_cfg, tokenizer))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
