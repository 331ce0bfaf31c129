"""SentencePiece BPE tokenizer: training on a corpus's train shards, loading, token_bytes.

`load_tokenizer` also loads the reference's tiktoken pickle (a `.pkl` file), the second
backend, for evaluating the authors' checkpoints (see bov_jax/data/tiktoken_tokenizer.py).

    python -m bov_jax.data.tokenizer train --data_dir DIR --vocab_size 8192 [--out DIR/tokenizer]

Layout of the vocabulary: id 0 is `<|bos|>`, ids 1-8 the other reference specials (spec 6.1,
in the reference's order), id 9 `<unk>`, ids 10-265 the 256 byte-fallback pieces, then the
BPE pieces. Text is kept byte-exact: identity normalisation, no dummy prefix, whitespace kept,
so decode(encode(text)) == text for any text without the U+2581 character, and token_bytes()
sums to the UTF-8 length of the decoded text.
"""

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import sentencepiece as spm

from bov_jax import cli
from bov_jax.data import shards
from bov_jax.data.tiktoken_tokenizer import PICKLE_FILE, TiktokenTokenizer, load_tiktoken
from bov_jax.errors import DataError

log = logging.getLogger(__name__)

MODEL_FILE = "tokenizer.model"
CONFIG_FILE = "training_config.json"
BOS = "<|bos|>"
SPECIALS = (
    BOS,
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
)
_MAX_LINE_BYTES = 4096
# The reference's tokenizer budget (tok_train, spec 6.1): documents cropped to 10,000
# characters, reading stops after 2B characters of the train shards.
REFERENCE_DOC_CHARS = 10_000
REFERENCE_MAX_CHARS = 2_000_000_000


class Tokenizer:
    """A loaded SentencePiece model. Picklable (grain worker processes rebuild it from bytes)."""

    def __init__(self, model_proto: bytes, path: str, num_threads: int = 1):
        self._proto = model_proto
        self.path = path
        self.num_threads = num_threads
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)

    def __getstate__(self) -> dict:
        return dict(proto=self._proto, path=self.path, num_threads=self.num_threads)

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["proto"], state["path"], state["num_threads"])

    @property
    def sha256(self) -> str:
        """Digest of the model file (identifies the tokenizer in caches)."""
        return hashlib.sha256(self._proto).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    def special_id(self, name: str) -> int | None:
        """The id of special token `name` (e.g. "<|user_start|>"), None if it has none."""
        i = self._sp.piece_to_id(name)
        return i if self._sp.is_control(i) and self._sp.id_to_piece(i) == name else None

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without BOS (special-token strings are not parsed)."""
        return self._sp.encode(texts, out_type=int, num_threads=self.num_threads)

    def encode_one(self, text: str) -> list[int]:
        """Token ids of one text, without BOS."""
        return self._sp.encode(text, out_type=int)

    def decode(self, ids: list[int]) -> str:
        """Text of a list of ids; special tokens decode to nothing."""
        return self._sp.decode([int(i) for i in ids])

    def token_bytes(self) -> np.ndarray:
        """int32 (vocab_size,): UTF-8 bytes each id stands for; 0 for specials and <unk> (spec 6.2).

        Byte-fallback pieces count 1 byte, so sums over a token sequence equal the UTF-8 length
        of its decoded text (the reference's tiktoken table counts partial UTF-8 as 3 bytes).
        """
        out = np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            if self._sp.is_byte(i):
                out[i] = 1
            elif not (self._sp.is_control(i) or self._sp.is_unknown(i) or self._sp.is_unused(i)):
                out[i] = len(self._sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        return out


def model_path(path: Path) -> Path:
    """The tokenizer file for `path`, which names the file or its directory.

    The file says the backend: `.model` is SentencePiece, `.pkl` the reference's pickled
    tiktoken Encoding (bov_jax/data/tiktoken_tokenizer.py). A directory holding no
    tokenizer.model but a tokenizer.pkl means the latter.
    """
    path = Path(path)
    if path.suffix in (".model", ".pkl"):
        return path
    if not (path / MODEL_FILE).is_file() and (path / PICKLE_FILE).is_file():
        return path / PICKLE_FILE
    return path / MODEL_FILE


def load_tokenizer(
    path: Path, expected_vocab_size: int | None = None, num_threads: int = 1
) -> Tokenizer | TiktokenTokenizer:
    """Loads a tokenizer (file or directory) and checks it against the model's vocab size."""
    file = model_path(path)
    if not file.is_file():
        raise DataError(
            f"tokenizer {file} does not exist (config key data.tokenizer_dir); train one with "
            "`python -m bov_jax.data.tokenizer train --data_dir DIR --vocab_size N`"
        )
    if file.suffix == ".pkl":
        tokenizer = load_tiktoken(file, num_threads)
    else:
        try:
            tokenizer = Tokenizer(file.read_bytes(), str(file), num_threads)
        except (RuntimeError, OSError) as e:
            raise DataError(f"tokenizer {file} is not a SentencePiece model: {e}") from e
        if tokenizer.bos_id < 0 or tokenizer._sp.id_to_piece(tokenizer.bos_id) != BOS:
            raise DataError(f"tokenizer {file} has no {BOS} token")
    if expected_vocab_size is not None and tokenizer.vocab_size != expected_vocab_size:
        raise DataError(
            f"tokenizer {file} has vocab size {tokenizer.vocab_size} but config.model.vocab_size "
            f"is {expected_vocab_size}; retrain the tokenizer or change the model config"
        )
    return tokenizer


def _training_lines(files: list[Path], doc_chars: int = 0, max_chars: int = 0) -> Iterator[str]:
    """Non-empty lines of every document; lines over 4 kB are cut at spaces into pieces.

    With `doc_chars` > 0 each document is cropped to its first `doc_chars` characters, and
    with `max_chars` > 0 reading stops once more than `max_chars` characters were read (the
    reference's tok_train: 10,000 and 2,000,000,000, spec 6.1).
    """
    read = 0
    for path in files:
        parquet = pq.ParquetFile(path)
        for rg in range(parquet.num_row_groups):
            texts, _ = shards.decode_documents(
                shards.read_raw(parquet, rg, path), f"{path}: row group {rg}", True
            )
            for text in texts:
                if max_chars and read > max_chars:
                    return
                text = text[:doc_chars] if doc_chars else text
                read += len(text)
                for line in text.split("\n"):
                    while len(line) > _MAX_LINE_BYTES:
                        cut = line.rfind(" ", 0, _MAX_LINE_BYTES)
                        cut = cut if cut > 0 else _MAX_LINE_BYTES
                        yield line[:cut]
                        line = line[cut:]
                    if line.strip():
                        yield line


def train_tokenizer(
    data_dir: Path,
    vocab_size: int,
    out_dir: Path,
    *,
    input_sentence_size: int = 300_000,
    num_threads: int = 2,
    seed: int = 0,
    doc_chars: int = 0,
    max_chars: int = 0,
) -> Path:
    """Trains a BPE model on the train shards of `data_dir`; writes the model and its config.

    Returns the model path. `vocab_size` counts every id (specials, <unk>, bytes, merges).
    `doc_chars` / `max_chars` (0: no limit) crop each document and bound the characters read,
    in file order (REFERENCE_DOC_CHARS / REFERENCE_MAX_CHARS are the reference's budget).
    """
    if vocab_size % 64:
        raise DataError(f"tokenizer vocab size {vocab_size} is not a multiple of 64")
    files = shards.split_files(Path(data_dir), "train")
    for path in files:
        shards.check_shard(path)
    options = dict(
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=0.9999,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        max_sentence_length=16384,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        num_threads=num_threads,
        bos_id=0,
        bos_piece=BOS,
        unk_id=len(SPECIALS),
        eos_id=-1,
        pad_id=-1,
        control_symbols=list(SPECIALS[1:]),
        random_seed=seed,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    spm.set_random_generator_seed(seed)
    with (out_dir / MODEL_FILE).open("wb") as model_writer:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_lines(files, doc_chars, max_chars),
            model_writer=model_writer,
            minloglevel=2,
            **{k: v for k, v in options.items() if k != "random_seed"},
        )
    record = dict(
        sentencepiece_version=spm.__version__,
        data_dir=str(data_dir),
        train_files=[p.name for p in files],
        doc_chars=doc_chars,
        max_chars=max_chars,
        train_seconds=round(time.time() - start, 1),
        options=options,
    )
    (out_dir / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    log.info(
        "trained %s (vocab %d) in %.0f s", out_dir / MODEL_FILE, vocab_size, time.time() - start
    )
    return out_dir / MODEL_FILE


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    from absl import flags

    flags.DEFINE_string("data_dir", None, "train: shard directory.", required=True)
    flags.DEFINE_integer("vocab_size", None, "train: vocabulary size.", required=True)
    flags.DEFINE_string("out", None, "train: output directory (default: DATA_DIR/tokenizer).")
    flags.DEFINE_integer("input_sentence_size", 300_000, "train: sentences sampled for training.")
    flags.DEFINE_integer("threads", 2, "train: training threads.")
    flags.DEFINE_integer(
        "doc_chars",
        0,
        f"train: crop each document to this many characters (0: whole; reference "
        f"{REFERENCE_DOC_CHARS}).",
    )
    flags.DEFINE_integer(
        "max_chars",
        0,
        f"train: stop reading after this many characters (0: all; reference "
        f"{REFERENCE_MAX_CHARS}).",
    )
    for name in ("data_dir", "vocab_size", "input_sentence_size"):
        flags.DEFINE_alias(name.replace("_", "-"), name)


def main(argv: list[str]) -> None:
    """`train` (the one command, checked by cli.run): a BPE tokenizer on a corpus's shards."""
    from absl import flags

    del argv
    args = flags.FLAGS
    cli.log_plainly()
    train_tokenizer(
        Path(args.data_dir),
        args.vocab_size,
        Path(args.out or Path(args.data_dir) / "tokenizer"),
        input_sentence_size=args.input_sentence_size,
        num_threads=args.threads,
        doc_chars=args.doc_chars,
        max_chars=args.max_chars,
    )


if __name__ == "__main__":
    define_flags()
    cli.run(main, commands=("train",))
