"""KV-cache and bank memory of a config, measured from the cache arrays, next to Eq. 6.

The cache is the one `bov_jax.inference.decode` decodes with, built under `jax.eval_shape`
so that nothing is allocated even at a 1M-token context; the banks are read off an
abstract model (`nnx.eval_shape`). The paper's Eq. 6 predicts the memory BoV saves:

    ΔKV = (L/3) · d · (T − |V|)  elements

i.e. the V cache of the L/3 target layers (T · d each) minus their banks (|V| · d each).
Generalised here to n_t layers without a V cache, kv width K and a batch of B sequences:

    ΔKV = n_t · K · (B·T − |V|)

The measured counterpart is (V elements of the cache with a V cache in every layer) −
(V elements of the cache without V in the BoV layers) − (bank elements). It equals Eq. 6
exactly when every target has its own table. It differs when the table is shared
(one |V| · K table, not n_t of them), and the cache additionally holds the token-id
history B·T (int32), which Eq. 6 leaves out. Fig. 5(a) divides ΔKV by the whole K+V
cache 2·L·K·B·T, giving (1/6)(1 − |V|/T) for the d24 layout (n_t = L/3, B = 1).

`python -m bov_jax.inference.memory --config=configs/d24_bov.py [--batch --context --dtype]`
prints the report; `--write_docs` writes the 2K..1M tables to docs/kv_memory.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from bov_jax.inference import decode, layout
from bov_jax.model.gpt import GPT
from bov_jax.model.spec import DTYPES, ModelSpec

DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "kv_memory.md"
DOC_CONTEXTS = tuple(2**k for k in range(11, 21))  # 2K .. 1M
DOC_VOCABS = (32768, 151936)  # nanochat; Qwen3 (Fig. 5a)
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Held:
    """A count of array elements and the bytes they take."""

    elements: int = 0
    bytes: int = 0

    def __add__(self, other: Held) -> Held:
        return Held(self.elements + other.elements, self.bytes + other.bytes)

    def __sub__(self, other: Held) -> Held:
        return Held(self.elements - other.elements, self.bytes - other.bytes)


def held(arrays: Sequence[jax.ShapeDtypeStruct | None]) -> Held:
    """Elements and bytes of (abstract) arrays; None entries hold nothing."""
    present = [a for a in arrays if a is not None]
    return Held(
        sum(a.size for a in present), sum(a.size * jnp.dtype(a.dtype).itemsize for a in present)
    )


@dataclasses.dataclass(frozen=True)
class CacheSize:
    """What one decode cache holds, by component."""

    k: Held
    v: Held
    token_ids: Held
    other: Held  # the previous embedding (B, 1, D) and the position

    @property
    def total(self) -> Held:
        return self.k + self.v + self.token_ids + self.other


def cache_size(
    spec: ModelSpec,
    batch: int,
    context_len: int,
    dtype: jnp.dtype = jnp.bfloat16,
    eliminate_bank_v: bool = True,
) -> CacheSize:
    """Measure the cache `decode.init_cache` builds for batch x context_len (K/V in dtype)."""
    cache = jax.eval_shape(
        lambda: decode.init_cache(spec, batch, context_len, dtype, eliminate_bank_v)
    )
    return CacheSize(
        k=held(cache.k),
        v=held(cache.v),
        token_ids=held([cache.token_ids]),
        other=held([cache.prev_embedding, cache.pos]),
    )


def kv_cache_bytes(
    spec: ModelSpec,
    batch: int,
    context_len: int,
    dtype: jnp.dtype = jnp.bfloat16,
    eliminate_bank_v: bool = True,
) -> int:
    """Total bytes of the decode cache (K, V, token ids, previous embedding, position)."""
    return cache_size(spec, batch, context_len, dtype, eliminate_bank_v).total.bytes


def bank_size(spec: ModelSpec, dtype: jnp.dtype | None = None) -> Held:
    """The value banks of an abstract model (a shared table once), stored in dtype.

    dtype defaults to the model's table dtype (bf16 in the reference, model.table_dtype here).
    """
    model = nnx.eval_shape(lambda: GPT(spec))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    elements = sum(var.size for path, var in flat if "bank" in path)
    return Held(elements, elements * jnp.dtype(dtype or spec.table_dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class Eq6:
    """The paper's Eq. 6, generalised to n_t layers without V cache and a batch."""

    n_layers: int  # n_t: layers whose V the cache does not hold (the paper's L/3)
    elements: int  # n_t · K · (B·T − |V|)
    bytes: int  # elements × itemsize(dtype)
    fraction: float  # elements / (2·L·K·B·T), Fig. 5(a)
    per_token: int  # n_t · K: the elements each cached token saves (d ΔKV / d(B·T))


def eq6(spec: ModelSpec, batch: int, context_len: int, dtype: jnp.dtype = jnp.bfloat16) -> Eq6:
    """Eq. 6's ΔKV for this config, with |V| = the bank rows (the padded vocab)."""
    n_t = layout.value_modes(spec).count(layout.BANK)
    tokens = batch * context_len
    elements = n_t * spec.kv_dim * (tokens - spec.padded_vocab)
    fraction = elements / (2 * spec.n_layer * spec.kv_dim * tokens)
    per_token = n_t * spec.kv_dim
    return Eq6(n_t, elements, elements * jnp.dtype(dtype).itemsize, fraction, per_token)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Cache with and without V-cache elimination, the banks, and Eq. 6's prediction."""

    batch: int
    context_len: int
    with_v: CacheSize  # eliminate_bank_v=False: a V cache in the BoV layers too
    without_v: CacheSize  # eliminate_bank_v=True: K and token ids only in the BoV layers
    bank: Held
    eq6: Eq6

    @property
    def saved(self) -> Held:
        """Cache memory V-cache elimination saves (V saved − token-id history)."""
        return self.with_v.total - self.without_v.total

    @property
    def eq6_measured(self) -> int:
        """Eq. 6's quantity from the arrays: V elements saved − bank elements."""
        return (self.with_v.v - self.without_v.v).elements - self.bank.elements

    @property
    def net_fraction(self) -> float:
        """(cache saved − bank bytes) / the K+V bytes of the full cache."""
        full = self.with_v.k + self.with_v.v
        return (self.saved.bytes - self.bank.bytes) / full.bytes


def memory_report(
    spec: ModelSpec,
    batch: int,
    context_len: int,
    dtype: jnp.dtype = jnp.bfloat16,
    bank: Held | None = None,
) -> MemoryReport:
    """The module doc's figures for one config, batch and context (K/V and banks in dtype).

    bank: a precomputed `bank_size(spec, dtype)`, to skip building the abstract model.
    """
    return MemoryReport(
        batch=batch,
        context_len=context_len,
        with_v=cache_size(spec, batch, context_len, dtype, eliminate_bank_v=False),
        without_v=cache_size(spec, batch, context_len, dtype, eliminate_bank_v=True),
        bank=bank or bank_size(spec, dtype),
        eq6=eq6(spec, batch, context_len, dtype),
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.3f}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _tokens(n: int) -> str:
    return f"{n // 2**20}M" if n >= 2**20 else f"{n // 2**10}K"


TABLE_HEAD = (
    "| T | K+V cache, V in every layer | cache, no V in BoV layers | of which token ids (MiB) "
    "| banks "
    "| saved by the cache | Eq. 6 ΔKV (elements) | Eq. 6 | measured: V saved − banks "
    "| Eq. 6 fraction | measured net fraction |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def report_row(r: MemoryReport, itemsize: int) -> str:
    """One markdown row of a report (sizes in GiB; fractions of the full K+V cache)."""
    return (
        f"| {_tokens(r.context_len)} | {_gib(r.with_v.total.bytes)} "
        f"| {_gib(r.without_v.total.bytes)} | {_mib(r.without_v.token_ids.bytes)} "
        f"| {_gib(r.bank.bytes)} | {_gib(r.saved.bytes)} | {r.eq6.elements:,} "
        f"| {_gib(r.eq6.bytes)} | {_gib(r.eq6_measured * itemsize)} "
        f"| {100 * r.eq6.fraction:.2f}% | {100 * r.net_fraction:.2f}% |"
    )


def report_table(spec: ModelSpec, contexts: Sequence[int], batch: int, dtype: jnp.dtype) -> str:
    """A markdown table of `memory_report` over context lengths."""
    bank = bank_size(spec, dtype)
    itemsize = jnp.dtype(dtype).itemsize
    rows = [report_row(memory_report(spec, batch, t, dtype, bank), itemsize) for t in contexts]
    return "\n".join([TABLE_HEAD, *rows])


DOC_INTRO = """# KV-cache memory with and without V caches in the BoV layers

Generated by `python -m bov_jax.inference.memory --config={config} --write_docs`; do not
edit by hand.

## What is measured

`bov_jax.inference.decode.init_cache` is built under `jax.eval_shape` (nothing is allocated)
and every array of it is counted. The cache holds, per layer, K (B, T, H, hd) and, where
the values depend on the context, V (B, T, H, hd). A BoV layer (value source bank,
combine replace) has no V cache: the cache keeps the token-id history (B, T) int32 once,
and each decode step gathers V = gamma * E_l[ids] from the layer's bank, attends, and
drops it (paper section 4). Also held: the previous token's embedding (B, 1, d) for the
smear, and the position. The banks are counted from an abstract model (`nnx.eval_shape`),
a shared table once.

Layout: {layout}.
K, V and the banks in {dtype} (the reference stores its value tables in bf16, as this port
does on accelerators: model.table_dtype=auto; fp32 tables would double the bank column),
batch B = {batch},
|V| = the bank rows (the padded vocabulary).

## Eq. 6 and the measured figures

The paper's Eq. 6 counts elements: ΔKV = (L/3) · d · (T − |V|), the V cache of the L/3
BoV layers minus their banks, one |V| × d table per layer. Generalised to n_t layers
without a V cache, kv width K = H · hd and a batch of B sequences:
ΔKV = n_t · K · (B · T − |V|); the V-cache saving grows with the batch, the banks do not.

* "Eq. 6 ΔKV (elements)" is that formula; "Eq. 6" is it times the bytes per element.
* "measured: V saved − banks" is (V elements of the cache with a V cache in every layer)
  − (V elements of the cache without V in the BoV layers) − (bank elements), from the
  arrays. It equals Eq. 6 exactly when each BoV layer has its own table (as here); with a
  shared table (`bank_shared`) the banks are n_t times smaller than Eq. 6 assumes.
* "saved by the cache" is the difference of the two caches' totals: the V saved minus
  the token-id history (B · T int32), which Eq. 6 leaves out. The banks are parameters
  the BoV model holds whether or not it keeps V caches, so against the same model this
  is the real saving; against the baseline model, subtract the banks (and add back the
  n_t value projections, n_t · d · K elements, which Eq. 6 also ignores).
* "Eq. 6 fraction" is ΔKV / (2 · L · K · B · T), the quantity Fig. 5(a) plots:
  (n_t / 2L)(1 − |V| / (B · T)) = (1/6)(1 − |V|/T) for this layout at B = 1. It is a
  fraction of the whole K+V cache, not of the V cache (reference spec 10.16).
  "measured net fraction" is (saved by the cache − banks) / (K+V of the full cache); it
  differs from Eq. 6 only by the token-id history. At |V| = 32,768 the Eq. 6 fraction
  gives the paper's check values 8.33% (64K), 14.58% (256K) and 16.15% (1M, quoted as
  16.2% in the reference spec); at |V| = 151,936 it crosses zero near 152K.

Not modelled by either: every layer keeps all T slots (the sliding-window layers could
keep only window + 1 with a ring buffer, which would shrink both caches and change the
fractions; at d24 six of the eight BoV layers are short-window layers), the transient
V (B, T, K) one BoV layer materialises per step, and allocator or kernel workspace.
"""


def describe_layout(spec: ModelSpec) -> str:
    """A one-line description of the layers the cache is laid out for."""
    bov = [i for i, m in enumerate(layout.value_modes(spec)) if m == layout.BANK]
    layers = f"BoV layers {bov[0]}..{bov[-1]} (n_t = {len(bov)})" if bov else "no BoV layers"
    return f"L = {spec.n_layer}, d = K = {spec.kv_dim}, {layers}"


def vocab_spec(config, vocab: int) -> ModelSpec:
    """The spec of `config.model` with another vocabulary size."""
    model_config = config.model.copy_and_resolve_references()
    model_config.vocab_size = vocab
    return ModelSpec.from_config(model_config)


def write_docs(
    config, config_file: str, path: Path = DOCS_PATH, batch: int = 1, dtype: str = "bfloat16"
) -> None:
    """Write the 2K..1M tables of the config at each vocabulary of DOC_VOCABS to `path`."""
    specs = [vocab_spec(config, vocab) for vocab in DOC_VOCABS]
    sections = [
        f"## |V| = {spec.padded_vocab:,}\n\nSizes in GiB unless noted.\n\n"
        f"{report_table(spec, DOC_CONTEXTS, batch, DTYPES[dtype])}\n"
        for spec in specs
    ]
    intro = DOC_INTRO.format(
        config=config_file, layout=describe_layout(specs[0]), dtype=dtype, batch=batch
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([intro, *sections]))


def main(argv: Sequence[str]) -> None:
    from absl import flags
    from ml_collections import config_flags

    del argv
    f = flags.FLAGS
    if f.write_docs:
        config_file = config_flags.get_config_filename(f["config"])
        write_docs(f.config, config_file, batch=f.batch, dtype=f.dtype)
        print(f"wrote {DOCS_PATH}")
        return
    spec = ModelSpec.from_config(f.config.model)
    contexts = [int(c) for c in f.context]
    print(
        f"Sizes in GiB unless noted; T in tokens (K = 1024); batch {f.batch}, {f.dtype}; "
        f"|V| = {spec.padded_vocab:,} bank rows."
    )
    print(report_table(spec, contexts, f.batch, DTYPES[f.dtype]))
    print(
        "A negative saving is expected while B * T < |V|: each BoV layer's bank (|V| x K) is "
        "then larger than the V cache it replaces; the saving grows with T beyond |V|."
    )


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    from absl import flags

    from bov_jax.config import define_config_flag

    define_config_flag()
    flags.DEFINE_integer("batch", 1, "Sequences in the batch.")
    flags.DEFINE_list("context", ["2048", "65536", "1048576"], "Context lengths.")
    flags.DEFINE_enum("dtype", "bfloat16", list(DTYPES), "K/V and bank dtype.")
    flags.DEFINE_bool("write_docs", False, f"Write the tables to {DOCS_PATH}.")
    flags.DEFINE_alias("write-docs", "write_docs")


if __name__ == "__main__":
    from bov_jax import cli
    from bov_jax.config import check_config_arguments

    define_flags()
    cli.run(main, check_argv=check_config_arguments)
