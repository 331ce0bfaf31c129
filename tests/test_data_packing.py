"""Best-fit packing against a plain re-implementation of spec 5.3, and on the embedded corpus."""

import numpy as np
import pytest

from bov_jax.data import pipeline
from bov_jax.data.config import default_data_config, tokenizer_path
from bov_jax.data.documents import split_unit
from bov_jax.data.packing import BestFitPacker, packing_stats
from bov_jax.data.tokenizer import load_tokenizer

BOS = 0


def reference_pack(batches, row_len, buffer_size, num_rows):
    """Spec 5.3 written the plain way: a Python list buffer scanned linearly.

    `batches` yields lists of documents (BOS first). Returns (rows, cropped tokens, tokens taken).
    """
    buffer, rows, cropped, taken = [], [], 0, 0
    while len(rows) < num_rows:
        row, pos = [], 0
        while pos < row_len:
            while len(buffer) < buffer_size:
                buffer.extend(next(batches))
            remaining = row_len - pos
            best, best_len = -1, 0
            for i, doc in enumerate(buffer):
                if len(doc) <= remaining and len(doc) > best_len:
                    best, best_len = i, len(doc)
            if best >= 0:
                doc = buffer.pop(best)
                row.extend(doc)
                pos += len(doc)
            else:
                shortest = min(range(len(buffer)), key=lambda i: len(buffer[i]))
                doc = buffer.pop(shortest)
                row.extend(doc[:remaining])
                cropped += len(doc) - remaining
                pos = row_len
            taken += len(doc)
        rows.append(row)
    return rows, cropped, taken


def random_batches(seed, batch, max_len):
    rng = np.random.default_rng(seed)
    while True:
        lengths = rng.integers(1, max_len, size=batch)
        yield [
            np.concatenate([[BOS], rng.integers(1, 100, size=n - 1)]).astype(np.int32)
            for n in lengths
        ]


def pack(batches, row_len, buffer_size, num_rows):
    packer = BestFitPacker(row_len, buffer_size)

    def refill():
        for i, doc in enumerate(next(batches)):
            packer.add(doc, i)

    return [packer.pack_row(refill) for _ in range(num_rows)], packer.stats


@pytest.mark.parametrize("row_len,buffer_size,max_len", [(65, 30, 200), (129, 50, 60), (33, 7, 34)])
def test_packer_matches_reference(row_len, buffer_size, max_len):
    rows, stats = pack(random_batches(1, 8, max_len), row_len, buffer_size, 300)
    ref_rows, ref_cropped, ref_taken = reference_pack(
        random_batches(1, 8, max_len), row_len, buffer_size, 300
    )
    assert [r.tolist() for r in rows] == ref_rows
    assert stats.cropped_tokens == ref_cropped and stats.document_tokens == ref_taken
    assert stats.crop_fraction <= ref_cropped / ref_taken


def test_rows_start_with_bos_and_hold_whole_documents_but_the_last():
    docs_seen = {}

    def batches():
        rng = np.random.default_rng(3)
        k = 0
        while True:
            out = []
            for n in rng.integers(1, 90, size=8):
                doc = np.concatenate([[BOS], np.arange(k * 1000 + 1, k * 1000 + n)]).astype(
                    np.int32
                )
                docs_seen[k] = doc  # token 1 of document k is k * 1000 + 1
                out.append(doc)
                k += 1
            yield out

    rows, stats = pack(batches(), 65, 20, 200)
    for row in rows:
        assert row.dtype == np.int32 and row.shape == (65,) and row[0] == BOS
        segments = np.split(row, np.flatnonzero(row == BOS)[1:])
        for seg in segments[:-1]:  # every segment but the last is a whole document
            assert len(seg) == 1 or np.array_equal(seg, docs_seen[int(seg[1]) // 1000])
        last = segments[-1]  # the last one is a document or its prefix (a crop)
        assert len(last) == 1 or np.array_equal(last, docs_seen[int(last[1]) // 1000][: len(last)])
    assert stats.rows == 200 and stats.cropped_documents <= 200


@pytest.mark.parametrize("seq_len", [512, 2048])
def test_crop_fraction_on_embedded_corpus(seq_len):
    """The pipeline on the embedded val split equals the reference on the same token stream."""
    cfg = default_data_config()
    cfg.use_cache = False
    tokenizer = load_tokenizer(tokenizer_path(cfg), num_threads=2)
    iterator = pipeline.make_batch_iterator(
        cfg, split="val", seq_len=seq_len, batch_size=4, seed=0, tokenizer=tokenizer
    )
    batches = [next(iterator) for _ in range(60)]
    stats = packing_stats(iterator)
    iterator.close()
    units, reader = pipeline.split_units(cfg, "val", tokenizer)
    elements = [split_unit(reader(u)) for u in units]

    def unit_stream():
        while True:
            yield from elements

    ref_rows, ref_cropped, ref_taken = reference_pack(
        unit_stream(), seq_len + 1, cfg.buffer_size, 240
    )
    rows = np.concatenate(
        [np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1) for b in batches]
    )
    assert rows.tolist() == ref_rows
    print(
        f"\nembedded val split, seq_len {seq_len}: crop fraction {stats.crop_fraction:.3f} "
        f"(reference {ref_cropped / ref_taken:.3f}) over {stats.rows} rows"
    )
    assert stats.crop_fraction <= ref_cropped / ref_taken
