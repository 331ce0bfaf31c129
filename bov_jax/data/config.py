"""The `config.data` subtree: every data key with its default, and its validation."""

from pathlib import Path

import ml_collections

from bov_jax.data import mqar, shards
from bov_jax.data.tokenizer import load_tokenizer
from bov_jax.errors import DataError

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_DIR = REPO_ROOT / "data" / "embedded"
MQAR_TOKENIZER = REPO_ROOT / "data" / "mqar"  # holds tokenizer.pkl (mqar.byte_tokenizer)
_INT_MINIMUMS = dict(
    buffer_size=1,
    tokenizer_batch_size=1,
    encode_threads=1,
    read_threads=1,
    prefetch_buffer_size=1,
    num_workers=0,
    max_doc_tokens=0,
)
_BOOLS = ("use_cache", "shuffle", "skip_bad_documents")
SOURCES = ("shards", "mqar")


def default_data_config() -> ml_collections.ConfigDict:
    """Defaults of every data key (spec 5.2-5.3 where the reference has a value)."""
    c = ml_collections.ConfigDict()
    # "shards": the corpus below. "mqar": synthetic multi-query associative recall examples
    # (bov_jax/data/mqar.py, keys data.mqar); the tokenizer is still loaded (BPB, samples).
    c.source = "shards"
    c.mqar = mqar.default_mqar_config()
    # Shard directory (ClimbMix layout: *.parquet, the last file is the val split). The default
    # is the corpus embedded in the repository (data/embedded), so nothing is downloaded.
    c.data_dir = str(EMBEDDED_DIR)
    # "": DATA_DIR/tokenizer. A directory, or the file itself, whose suffix names the backend:
    # tokenizer.model (SentencePiece) or tokenizer.pkl (the reference's tiktoken pickle).
    c.tokenizer_dir = ""
    c.use_cache = True  # read pre-tokenized ArrayRecord (built on first use) instead of encoding
    c.cache_dir = ""  # "": DATA_DIR/token_cache
    c.buffer_size = 1000  # best-fit packing buffer, in documents (spec 5.3)
    c.tokenizer_batch_size = 128  # documents per unit of reading/encoding (spec 5.2)
    c.encode_threads = 2  # sentencepiece threads per batch encode
    c.read_threads = 2  # grain threads reading units (parallel row groups)
    c.prefetch_buffer_size = 8  # units read ahead
    c.num_workers = 0  # grain worker processes reading units (0: in the training process)
    c.shuffle = True  # reshuffle the train units every epoch (val order is fixed)
    c.skip_bad_documents = False  # skip and count non-UTF-8 documents instead of stopping
    # 0: documents stay whole and are cropped by the packer (the reference). N > 0: a document
    # longer than N tokens becomes pieces of at most N tokens, each starting with BOS.
    c.max_doc_tokens = 0
    return c


def tokenizer_path(data_cfg: ml_collections.ConfigDict) -> Path:
    """The tokenizer directory (data.tokenizer_dir, default DATA_DIR/tokenizer, or for MQAR
    the committed byte-level tokenizer, whose 257 ids hold its keys, values and fillers)."""
    if data_cfg.tokenizer_dir:
        return Path(data_cfg.tokenizer_dir)
    if source(data_cfg) == "mqar":
        return MQAR_TOKENIZER
    return Path(data_cfg.data_dir) / "tokenizer"


def source(data_cfg: ml_collections.ConfigDict) -> str:
    """data.source; "shards" for configs recorded before it existed."""
    return getattr(data_cfg, "source", "shards")


def _check_keys(data_cfg: ml_collections.ConfigDict) -> None:
    defaults = default_data_config()
    for key in defaults:
        if key not in data_cfg:
            raise DataError(f"config key data.{key} is missing")
    for key in data_cfg:
        if key not in defaults:
            raise DataError(f"config key data.{key} is unknown; data keys are {sorted(defaults)}")
    for key, minimum in _INT_MINIMUMS.items():
        value = data_cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise DataError(f"config key data.{key} must be an integer >= {minimum}, got {value!r}")
    for key in _BOOLS:
        if not isinstance(data_cfg[key], bool):
            raise DataError(f"config key data.{key} must be True or False, got {data_cfg[key]!r}")
    if data_cfg.max_doc_tokens == 1:
        raise DataError("config key data.max_doc_tokens must be 0 (off) or >= 2 (BOS + 1 token)")


def validate_data_config(
    data_cfg: ml_collections.ConfigDict, vocab_size: int, seq_len: int
) -> None:
    """Checks the data keys, the shards, the tokenizer and the sequence length before training.

    Raises DataError naming the key or file and the problem: a missing data directory, an
    empty, truncated or text-less shard, a non-UTF-8 document (unless data.skip_bad_documents;
    with data.use_cache the scan happens while the cache is built), a tokenizer whose vocab
    differs from `vocab_size`, or a `seq_len` the packing cannot serve.
    """
    _check_keys(data_cfg)
    if data_cfg.source not in SOURCES:
        raise DataError(f"config key data.source={data_cfg.source!r}; expected one of {SOURCES}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"sequence length {seq_len!r} cannot be packed: it must be an integer >= 1")
    if source(data_cfg) == "mqar":
        mqar.validate_mqar_config(data_cfg.mqar, vocab_size, seq_len)
        load_tokenizer(tokenizer_path(data_cfg), vocab_size)
        return
    for split in shards.SPLITS:
        infos = [shards.check_shard(p) for p in shards.split_files(Path(data_cfg.data_dir), split)]
        if not data_cfg.use_cache:
            for info in infos:
                skipped = shards.scan_documents(info, data_cfg.skip_bad_documents)
                shards.report_skipped(info.path, skipped)
        # every token but BOS covers at least one byte of text
        bound = sum(info.text_bytes_bound + info.num_documents for info in infos)
        if seq_len + 1 > bound:
            raise DataError(
                f"sequence length {seq_len} cannot be packed: rows of {seq_len + 1} tokens need "
                f"more than the at most {bound} tokens of split {split!r} "
                f"({', '.join(str(i.path) for i in infos)})"
            )
    load_tokenizer(tokenizer_path(data_cfg), vocab_size)
