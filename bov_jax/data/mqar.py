"""MQAR, multi-query associative recall (Arora et al., "Zoology", arXiv 2312.04927), as a data
source of the trainer: `data.source = "mqar"`, its keys under `data.mqar`.

One example of seq_len tokens, N = num_pairs:

    k_1 v_1 k_2 v_2 ... k_N v_N | f f k_3 f f f k_1 f ... (query region)

Keys and values are distinct within an example, drawn from disjoint id ranges (keys, then values,
then fillers, from `first_id` on). The query region has (seq_len - 2N) // 2 slots at its even
offsets; each key is queried once, in a slot drawn without replacement with probability
proportional to (slot + 1)^(power_a - 1) (Zoology's power law: most queries come early). The
target at a query is its key's value; every other target is -1 (ignored by the loss), so loss
and accuracy count the answers only. Non-query positions hold random filler ids.

Splits are disjoint by construction: an example is held out ("val") iff the CRC-32 of its
key-value context is 0 mod VAL_MODULUS, and each split draws (by rejection) only its own
examples. Example i of a split is a pure function of (seed, split, i); the val split ignores the
run's seed, so every run is scored on the same held-out examples.
"""

import pickle
import zlib
from collections.abc import Iterator

import grain
import ml_collections
import numpy as np
import tiktoken

from bov_jax.errors import DataError

VAL_MODULUS = 16
_SPLIT_CODES = {"train": 1, "val": 2}
_VAL_SEED = 0
_TRAIN_EXAMPLES = 2**62  # the train split is, for any run, endless


def default_mqar_config() -> ml_collections.ConfigDict:
    """Defaults of `data.mqar` (used when data.source = "mqar")."""
    c = ml_collections.ConfigDict()
    c.num_pairs = 8  # key-value pairs stated, then queried, per example (4 num_pairs <= seq_len)
    c.first_id = 1  # keys start here; values and fillers follow
    c.key_ids = 96  # keys are [first_id, first_id + key_ids)
    c.value_ids = 96  # values are the next value_ids ids
    c.filler_ids = 63  # fillers of non-query positions are the next filler_ids ids
    c.power_a = 0.01  # query slots drawn with p(slot) ~ (slot + 1)^(power_a - 1)
    c.val_examples = 256  # size of the held-out split (it repeats)
    return c


def byte_tokenizer() -> bytes:
    """The pickled tiktoken Encoding of data/mqar/tokenizer.pkl: the 256 bytes as ids 0-255
    and <|bos|> as 256. MQAR runs load it (the trainer needs a tokenizer for BPB and logs);
    a small vocabulary keeps the unembedding from dominating a CPU model's FLOPs."""
    encoding = tiktoken.Encoding(
        name="mqar_bytes",
        pat_str=r".",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|bos|>": 256},
    )
    return pickle.dumps(encoding)


def validate_mqar_config(cfg: ml_collections.ConfigDict, vocab_size: int, seq_len: int) -> None:
    """Raises DataError naming the data.mqar key that cannot make examples for this model."""
    defaults = default_mqar_config()
    unknown = sorted(set(cfg.keys()) - set(defaults.keys()))
    if unknown:
        raise DataError(
            f"config key data.mqar.{unknown[0]} is unknown; keys are {sorted(defaults)}"
        )
    for key in ("first_id", "num_pairs", "key_ids", "value_ids", "filler_ids", "val_examples"):
        value, minimum = cfg[key], int(key != "first_id")
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise DataError(
                f"config key data.mqar.{key} must be an integer >= {minimum}, got {value!r}"
            )
    if not 0 < cfg.power_a <= 1:
        raise DataError(f"config key data.mqar.power_a must be in (0, 1], got {cfg.power_a!r}")
    end = cfg.first_id + cfg.key_ids + cfg.value_ids + cfg.filler_ids
    if end > vocab_size:
        raise DataError(
            f"config key data.mqar: ids up to {end} (first_id + key_ids + value_ids + filler_ids) "
            f"do not fit config.model.vocab_size={vocab_size}"
        )
    if cfg.num_pairs > min(cfg.key_ids, cfg.value_ids):
        raise DataError(
            f"config key data.mqar.num_pairs={cfg.num_pairs} exceeds the distinct keys or values "
            f"({cfg.key_ids}, {cfg.value_ids})"
        )
    if 4 * cfg.num_pairs > seq_len:
        raise DataError(
            f"config key data.mqar.num_pairs={cfg.num_pairs}: 4 x num_pairs must be <= the "
            f"sequence length {seq_len} (the context, then a query slot of two tokens per key)"
        )


def held_out(context: np.ndarray) -> bool:
    """Whether a key-value context (2N,) belongs to the val split."""
    return zlib.crc32(np.asarray(context, np.int64).tobytes()) % VAL_MODULUS == 0


def query_slot_probs(num_slots: int, power_a: float) -> np.ndarray:
    """(num_slots,) float64: Zoology's power law over the query slots, normalised."""
    p = power_a * np.arange(1, num_slots + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


def make_example(
    cfg: ml_collections.ConfigDict, seq_len: int, split: str, seed: int, index: int
) -> dict[str, np.ndarray]:
    """Example `index` of `split`: {"inputs", "targets"} int32 (seq_len,), targets -1 except
    at the N query positions, where they hold the queried key's value."""
    n = cfg.num_pairs
    key0, value0 = cfg.first_id, cfg.first_id + cfg.key_ids
    filler0 = value0 + cfg.value_ids
    if split == "val":
        seed = _VAL_SEED
    rng = np.random.default_rng((seed, _SPLIT_CODES[split], index))
    while True:
        keys = key0 + rng.choice(cfg.key_ids, size=n, replace=False)
        values = value0 + rng.choice(cfg.value_ids, size=n, replace=False)
        context = np.stack([keys, values], axis=1).reshape(-1)
        if held_out(context) == (split == "val"):
            break
    num_slots = (seq_len - 2 * n) // 2
    slots = rng.choice(num_slots, size=n, replace=False, p=query_slot_probs(num_slots, cfg.power_a))
    inputs = filler0 + rng.integers(0, cfg.filler_ids, size=seq_len)
    inputs[: 2 * n] = context
    targets = np.full(seq_len, -1)
    where = 2 * n + 2 * slots
    inputs[where] = keys
    targets[where] = values
    return {"inputs": inputs.astype(np.int32), "targets": targets.astype(np.int32)}


class _Example:
    """grain map function: stream index -> example (picklable for worker processes)."""

    def __init__(self, cfg: ml_collections.ConfigDict, seq_len: int, split: str, seed: int):
        self._args = (cfg, seq_len, split, seed)

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        return make_example(*self._args, index)


def batch_iterator(
    cfg: ml_collections.ConfigDict,
    *,
    split: str,
    seq_len: int,
    batch_size: int,
    seed: int,
    process_index: int,
    process_count: int,
) -> grain.DatasetIterator:
    """This process's MQAR batches {"inputs", "targets"} int32 (batch_size, seq_len), endless
    (the val split repeats its `val_examples` in order), checkpointable like the corpus'."""
    if split not in _SPLIT_CODES:
        raise DataError(f"MQAR split {split!r}; expected one of {sorted(_SPLIT_CODES)}")
    if split == "val":
        indices = grain.MapDataset.range(cfg.val_examples).repeat(None)
    else:
        indices = grain.MapDataset.range(_TRAIN_EXAMPLES)
    ds = indices[process_index::process_count].map(_Example(cfg, seq_len, split, seed))
    return iter(ds.batch(batch_size, drop_remainder=True).to_iter_dataset())


def split_contexts(cfg: ml_collections.ConfigDict, split: str) -> Iterator[dict[str, np.ndarray]]:
    """The key-value contexts of a split's first `val_examples` examples (seed 0), as elements
    {"tokens": int32 (2 num_pairs,)}: what the pipeline's `split_documents` gives for a corpus
    (the train split has no end, and the rest of an example is filler)."""
    for index in range(cfg.val_examples):
        example = make_example(cfg, 4 * cfg.num_pairs, split, _VAL_SEED, index)
        yield {"tokens": example["inputs"][: 2 * cfg.num_pairs]}
