"""Model sizes derived from `config.model` (spec 1.1 and 1.3)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from bov_jax.model.values import ValuePathSpec

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
TABLE_DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("xla", "cudnn", "splash")
AUTO = "auto"


def resolve_auto(key: str, value: str, platform: str | None = None) -> str:
    """'auto' picks by platform: bf16 compute and bf16 tables (wte, value banks) with cuDNN
    attention on GPUs, bf16 and splash attention on TPUs, fp32 and XLA attention on CPUs.

    `key` is "compute_dtype", "table_dtype" or "attention_impl"; other values pass through.
    `platform` ("cpu", "gpu", "tpu") is that of the devices the model is compiled for
    (`bov_jax.sharding.platform(mesh)`), by default this host's backend.
    """
    if value != AUTO:
        return value
    backend = platform or jax.default_backend()
    if key in ("compute_dtype", "table_dtype"):
        return "float32" if backend == "cpu" else "bfloat16"
    return {"gpu": "cudnn", "tpu": "splash"}.get(backend, "xla")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Every size and choice the model needs, resolved once from the config."""

    n_layer: int
    d_model: int
    n_head: int
    head_dim: int
    vocab_size: int
    padded_vocab: int
    seq_len: int
    windows: tuple[int, ...]
    rope_base: float
    qk_scale: float
    mlp_ratio: int
    smear_channels: int
    logit_softcap: float
    param_dtype: Any
    compute_dtype: Any
    table_dtype: Any  # storage (and AdamW state) dtype of wte and the value banks
    attention_impl: str
    value_path: ValuePathSpec
    loss_chunk_tokens: int

    @property
    def kv_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def targets(self) -> tuple[int, ...]:
        return self.value_path.target_layers(self.n_layer)

    @property
    def init_bound(self) -> float:
        """Uniform bound s = sqrt(3/d): the std of N(0, 1/sqrt(d)) (spec 1.4)."""
        return math.sqrt(3.0) / math.sqrt(self.d_model)

    @classmethod
    def from_config(cls, m: Any, platform: str | None = None) -> ModelSpec:
        """Resolve `config.model` for `platform` ("cpu", "gpu", "tpu"; default: this host's
        backend), which decides the `auto` choices; raises ValueError naming the offending key.
        """
        for key in (
            "depth",
            "aspect_ratio",
            "head_dim",
            "vocab_size",
            "pad_vocab_to",
            "seq_len",
            "loss_chunk_tokens",
        ):
            if int(m[key]) <= 0:
                raise ValueError(f"model.{key}={m[key]}; expected a positive integer")
        if m.model_dim < 0 or m.model_dim % m.head_dim:
            raise ValueError(
                f"model.model_dim={m.model_dim}; expected 0 (derive from depth) or a positive "
                f"multiple of model.head_dim={m.head_dim}"
            )
        if m.param_dtype not in DTYPES:
            raise ValueError(
                f"model.param_dtype={m.param_dtype!r}; expected one of {tuple(DTYPES)}"
            )
        if m.compute_dtype not in (*DTYPES, AUTO):
            raise ValueError(
                f"model.compute_dtype={m.compute_dtype!r}; expected one of {(*DTYPES, AUTO)}"
            )
        if m.table_dtype not in (*TABLE_DTYPES, AUTO):
            raise ValueError(
                f"model.table_dtype={m.table_dtype!r}; expected one of {(*TABLE_DTYPES, AUTO)}"
            )
        if m.attention_impl not in (*ATTENTION_IMPLS, AUTO):
            raise ValueError(
                f"model.attention_impl={m.attention_impl!r}; expected one of "
                f"{(*ATTENTION_IMPLS, AUTO)}"
            )
        if m.attention_impl == "splash" and (platform or jax.default_backend()) == "gpu":
            raise ValueError(
                "model.attention_impl='splash' is the TPU (Pallas) kernel, interpreted off "
                "TPU; on GPUs use 'cudnn' or 'xla'"
            )
        if not m.window_pattern or set(m.window_pattern.upper()) - {"S", "L"}:
            raise ValueError(
                f"model.window_pattern={m.window_pattern!r}; expected a string of 'S' and 'L'"
            )
        if m.short_window < 0:
            raise ValueError(f"model.short_window={m.short_window}; expected 0 (derived) or > 0")
        if m.head_dim % 2:
            raise ValueError(f"model.head_dim={m.head_dim}; rotary needs an even head dim")
        d = m.model_dim or model_dim(m.depth, m.aspect_ratio, m.head_dim)
        if m.smear_channels > d:
            raise ValueError(f"model.smear_channels={m.smear_channels} exceeds model width {d}")
        return cls(
            n_layer=m.depth,
            d_model=d,
            n_head=d // m.head_dim,
            head_dim=m.head_dim,
            vocab_size=m.vocab_size,
            padded_vocab=-(-m.vocab_size // m.pad_vocab_to) * m.pad_vocab_to,
            seq_len=m.seq_len,
            windows=window_sizes(m.depth, m.window_pattern, m.seq_len, m.short_window),
            rope_base=float(m.rope_base),
            qk_scale=float(m.qk_scale),
            mlp_ratio=m.mlp_ratio,
            smear_channels=m.smear_channels,
            logit_softcap=float(m.logit_softcap),
            param_dtype=DTYPES[m.param_dtype],
            compute_dtype=DTYPES[resolve_auto("compute_dtype", m.compute_dtype, platform)],
            table_dtype=DTYPES[resolve_auto("table_dtype", m.table_dtype, platform)],
            attention_impl=resolve_auto("attention_impl", m.attention_impl, platform),
            value_path=ValuePathSpec.from_config(m.value_path),
            loss_chunk_tokens=m.loss_chunk_tokens,
        )


def model_dim(depth: int, aspect_ratio: int, head_dim: int) -> int:
    """depth * aspect_ratio rounded up to a multiple of head_dim (spec 1.1)."""
    return -(-depth * aspect_ratio // head_dim) * head_dim


def window_sizes(n_layer: int, pattern: str, seq_len: int, short: int = 0) -> tuple[int, ...]:
    """Left attention window per layer (spec 1.3); the last layer is always long.

    A query at i sees keys j with 0 <= i - j <= window. Long = seq_len;
    short = seq_len / 4 rounded up to a multiple of 128 (512 at 2048) unless
    `short` > 0 overrides it (small test models).
    """
    if not short:
        short = math.ceil(math.ceil(seq_len / 4) / 128) * 128
    short = min(short, seq_len)
    pattern = pattern.upper()
    sizes = [seq_len if pattern[i % len(pattern)] == "L" else short for i in range(n_layer)]
    sizes[-1] = seq_len
    return tuple(sizes)
