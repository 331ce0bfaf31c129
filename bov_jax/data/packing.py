"""BOS-aligned best-fit packing (spec 5.3) and its grain IterDataset with exact checkpoints.

Each row of `row_len` (= seq_len + 1) tokens is filled from a buffer of at least `buffer_size`
documents (every one starting with BOS): take the longest buffered document that fits the
remaining space (earliest on ties); when none fits, take the shortest (earliest on ties), copy
its first `remaining` tokens and drop the rest. The buffer is topped up unit by unit whenever it
holds fewer than `buffer_size` documents. Rows therefore start with BOS and carry no padding.
"""

import bisect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass

import grain
import numpy as np

from bov_jax.data.documents import split_unit


@dataclass
class PackingStats:
    """Counters of a packed stream (all exact across checkpoint restores)."""

    rows: int = 0
    documents: int = 0  # documents taken out of the buffer into rows
    document_tokens: int = 0  # tokens of those documents before cropping
    cropped_documents: int = 0
    cropped_tokens: int = 0  # tokens dropped by crops
    skipped_documents: int = 0  # bad documents skipped by the reader (data.skip_bad_documents)

    @property
    def crop_fraction(self) -> float:
        """Fraction of the tokens taken out of the buffer that crops dropped."""
        return self.cropped_tokens / max(self.document_tokens, 1)


class BestFitPacker:
    """The packing buffer. Documents carry a key so that a checkpoint can name them."""

    def __init__(self, row_len: int, buffer_size: int):
        self.row_len = row_len
        self.buffer_size = buffer_size
        self.stats = PackingStats()
        self._docs: dict[int, tuple[np.ndarray, Hashable]] = {}  # arrival number -> (doc, key)
        self._by_length: list[tuple[int, int]] = []  # sorted (length, arrival number)
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, doc: np.ndarray, key: Hashable) -> None:
        """Appends a document (int32 (n,), BOS first) to the buffer."""
        self._docs[self._arrivals] = (doc, key)
        bisect.insort(self._by_length, (len(doc), self._arrivals))
        self._arrivals += 1

    def buffered_keys(self) -> list[Hashable]:
        """Keys of the buffered documents in buffer (arrival) order."""
        return [key for _, key in self._docs.values()]

    def _take(self, index: int) -> np.ndarray:
        _, arrival = self._by_length.pop(index)
        doc, _ = self._docs.pop(arrival)
        self.stats.documents += 1
        self.stats.document_tokens += len(doc)
        return doc

    def pack_row(self, refill: Callable[[], None]) -> np.ndarray:
        """Returns the next row, int32 (row_len,). `refill()` must add at least one document."""
        parts, pos = [], 0
        while pos < self.row_len:
            while len(self._docs) < self.buffer_size:
                refill()
            remaining = self.row_len - pos
            fits = bisect.bisect_right(self._by_length, (remaining, self._arrivals))
            if fits:
                longest = self._by_length[fits - 1][0]
                doc = self._take(bisect.bisect_left(self._by_length, (longest, -1)))
                parts.append(doc)
                pos += len(doc)
            else:
                doc = self._take(0)
                parts.append(doc[:remaining])
                self.stats.cropped_documents += 1
                self.stats.cropped_tokens += len(doc) - remaining
                pos = self.row_len
        self.stats.rows += 1
        return np.concatenate(parts)


DocumentsAt = Callable[[Sequence[int]], dict[int, list[np.ndarray]]]
StreamFrom = Callable[[int], grain.DatasetIterator]


class BestFitPackIterDataset(grain.IterDataset):
    """Packs a stream of unit elements (see documents.py) into rows of `row_len` tokens.

    `stream_from(p)` iterates the unit elements from stream position `p` on, each carrying its
    "position"; `documents_at` maps positions back to their documents. The state is the next
    position plus the buffered documents named by (position, index) and the counters, so it is
    small and does not depend on how the stream is read (threads, worker processes).
    """

    def __init__(
        self, stream_from: StreamFrom, documents_at: DocumentsAt, row_len: int, buffer_size: int
    ):
        super().__init__()
        self._stream_from = stream_from
        self._documents_at = documents_at
        self._row_len = row_len
        self._buffer_size = buffer_size

    def __iter__(self) -> "_BestFitPackIterator":
        return _BestFitPackIterator(
            self._stream_from, self._documents_at, self._row_len, self._buffer_size
        )

    def __str__(self) -> str:
        return f"BestFitPackIterDataset(row_len={self._row_len}, buffer_size={self._buffer_size})"


class _BestFitPackIterator(grain.DatasetIterator):
    def __init__(
        self, stream_from: StreamFrom, documents_at: DocumentsAt, row_len: int, buffer_size: int
    ):
        super().__init__()
        self._stream_from = stream_from
        self._documents_at = documents_at
        self._packer = BestFitPacker(row_len, buffer_size)
        self._next_position = 0
        self._stream: grain.DatasetIterator | None = None  # opened on first use

    def _refill(self) -> None:
        if self._stream is None:
            self._stream = self._stream_from(self._next_position)
        element = next(self._stream)
        if element["position"] != self._next_position:
            got, expected = element["position"], self._next_position
            raise RuntimeError(f"unit stream out of order: got {got}, expected {expected}")
        self._next_position += 1
        self._packer.stats.skipped_documents += element["skipped"]
        # Copy out of the worker's shared memory, which is then released at once.
        element = {**element, "tokens": np.array(element["tokens"], np.int32)}
        for i, doc in enumerate(split_unit(element)):
            self._packer.add(doc, (element["position"], i))

    def __next__(self) -> np.ndarray:
        self._assert_not_closed()
        return self._packer.pack_row(self._refill)

    def get_state(self) -> dict:
        return {
            "next_position": self._next_position,
            "buffer": [list(key) for key in self._packer.buffered_keys()],
            "stats": asdict(self._packer.stats),
        }

    def set_state(self, state: dict) -> None:
        packer = BestFitPacker(self._packer.row_len, self._packer.buffer_size)
        docs = self._documents_at(sorted({position for position, _ in state["buffer"]}))
        for position, index in state["buffer"]:
            packer.add(docs[position][index], (position, index))
        packer.stats = PackingStats(**state["stats"])
        self._packer = packer
        self._next_position = state["next_position"]
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        super().close()


def packing_stats(iterator: grain.DatasetIterator) -> PackingStats:
    """The packing counters of an iterator made by pipeline.make_batch_iterator."""
    return PackingStats(**iterator.get_state()["stats"])
