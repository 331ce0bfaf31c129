"""The reference's tokenizer (spec 6.1-6.2): a pickled tiktoken Encoding, `tokenizer.pkl`.

The pickle is read through `bov_jax.interop.safe_pickle` with one global allowed,
tiktoken.core.Encoding, mapped to a stand-in that only records the state the pickle sets
(name, split pattern, mergeable ranks, special tokens); the real Encoding is then built from
that checked state. Text is encoded with `encode_ordinary` (no special-token parsing, as the
reference's data loader), and `token_bytes` is the reference's table, quirk included: a token
that is a partial UTF-8 sequence decodes (errors="replace") to U+FFFD and counts 3 bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken

from bov_jax.errors import DataError
from bov_jax.interop.safe_pickle import restricted_loads

PICKLE_FILE = "tokenizer.pkl"
BOS = "<|bos|>"


class _EncodingState:
    """Stand-in for tiktoken.core.Encoding while unpickling: keeps the pickled state."""

    def __init__(self):
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


def encoding_from_pickle(data: bytes, source: str) -> tiktoken.Encoding:
    """The tiktoken Encoding pickled in `data`, rebuilt without running the pickle's code.

    Raises UnsafePickleError for any other global, DataError for a malformed state.
    """
    loaded = restricted_loads(data, source, {("tiktoken.core", "Encoding"): _EncodingState})
    state = loaded.state if isinstance(loaded, _EncodingState) else None
    fields = {"name": str, "pat_str": str, "mergeable_ranks": dict, "special_tokens": dict}
    if not isinstance(state, dict) or any(
        not isinstance(state.get(k), t) for k, t in fields.items()
    ):
        raise DataError(f"{source}: not a pickled tiktoken Encoding (fields {sorted(fields)})")
    ranks, specials = state["mergeable_ranks"], state["special_tokens"]
    if not all(isinstance(k, bytes) and isinstance(v, int) for k, v in ranks.items()) or not all(
        isinstance(k, str) and isinstance(v, int) for k, v in specials.items()
    ):
        raise DataError(f"{source}: mergeable ranks must map bytes to int, specials str to int")
    return tiktoken.Encoding(
        name=state["name"], pat_str=state["pat_str"], mergeable_ranks=ranks, special_tokens=specials
    )


class TiktokenTokenizer:
    """The reference tokenizer behind bov_jax's tokenizer interface (see data/tokenizer.py).

    Picklable: grain workers rebuild it from the file's bytes through the same safe loader.
    """

    def __init__(self, data: bytes, path: str, num_threads: int = 1):
        self._data = data
        self.path = path
        self.num_threads = num_threads
        self.encoding = encoding_from_pickle(data, path)
        if BOS not in self.encoding.special_tokens_set:
            raise DataError(f"tokenizer {path} has no {BOS} special token")

    def __getstate__(self) -> dict:
        return dict(data=self._data, path=self.path, num_threads=self.num_threads)

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["data"], state["path"], state["num_threads"])

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._data).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def bos_id(self) -> int:
        return self.encoding.encode_single_token(BOS)

    def special_id(self, name: str) -> int | None:
        """The id of special token `name` (e.g. "<|user_start|>"), None if it has none."""
        special = name in self.encoding.special_tokens_set
        return self.encoding.encode_single_token(name) if special else None

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without BOS (special-token strings are not parsed)."""
        return self.encoding.encode_ordinary_batch(texts, num_threads=self.num_threads)

    def encode_one(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the ids (invalid UTF-8 becomes U+FFFD, as the reference decodes)."""
        return self.encoding.decode([int(i) for i in ids])

    def token_bytes(self) -> np.ndarray:
        """int32 (vocab_size,): the reference's token_bytes (spec 6.2).

        len(utf8(decode([id]))), 0 where the decoded string is a special token's name; a
        partial UTF-8 token decodes to U+FFFD and counts 3 bytes, as in the reference.
        """
        specials = self.encoding.special_tokens_set
        out = np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            text = self.decode([i])
            out[i] = 0 if text in specials else len(text.encode("utf-8"))
        return out


def load_tiktoken(file: Path, num_threads: int = 1) -> TiktokenTokenizer:
    return TiktokenTokenizer(Path(file).read_bytes(), str(file), num_threads)
