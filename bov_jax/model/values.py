"""The value path: how an attention layer forms its values.

The paper's variants are compositions of five choices, not separate flags:

  source    what feeds the target layers' values:
              residual  c_v(x), the layer's own projection of its input (the baseline)
              x0        c_v(rmsnorm(x0)), the layer's projection of the embedding stream
              v1        layer 0's values (layer 0 is then never a target)
              bank      E_l[ids], a per-layer (vocab, kv_dim) table: the Bank of Values
  combine   replace   v = s * source
            add       v = a * c_v(x) + b * source
            gated_add v = c_v(x) + 3 sigmoid(ve_gate(x[..., :12])) * source, per kv head
  scale     none (coefficients 1), fixed (the constant `fixed_coeff`), learned
            (gamma = 1 for replace; alpha = 1, beta = 0 for add)
  layers    which layers are targets (last_third, every_other, all, second_half,
            last_two_thirds); non-target layers always use c_v(x)
  bank_shared / bank_init   one table for every target / aligned or uniform init

A target layer whose values do not read c_v(x) (replace with source v1 or bank)
owns no value projection at all. Invalid combinations raise `ValuePathError`
naming the config keys involved.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SOURCES = ("residual", "x0", "v1", "bank")
COMBINES = ("replace", "add", "gated_add")
SCALES = ("none", "fixed", "learned")
LAYER_RULES = ("last_third", "every_other", "all", "second_half", "last_two_thirds")
BANK_INITS = ("aligned", "uniform")
GATE_CHANNELS = 12
KEY = "model.value_path"


class ValuePathError(ValueError):
    """An impossible value-path configuration."""


@dataclasses.dataclass(frozen=True)
class ValuePathSpec:
    source: str = "residual"
    combine: str = "replace"
    scale: str = "none"
    layers: str = "last_third"
    bank_shared: bool = False
    bank_init: str = "aligned"
    fixed_coeff: float = 0.5

    @classmethod
    def from_config(cls, cfg: Any) -> ValuePathSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg.keys()) - known)
        if unknown:
            raise ValuePathError(f"unknown keys {', '.join(f'{KEY}.{k}' for k in unknown)}")
        spec = cls(**{k: cfg[k] for k in cfg})
        spec.validate()
        return spec

    def validate(self) -> None:
        for name, allowed in (
            ("source", SOURCES),
            ("combine", COMBINES),
            ("scale", SCALES),
            ("layers", LAYER_RULES),
            ("bank_init", BANK_INITS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValuePathError(f"{KEY}.{name}={value!r}; expected one of {allowed}")
        if self.source == "residual" and self.combine != "replace":
            raise ValuePathError(
                f"{KEY}.combine={self.combine!r} with {KEY}.source='residual' would add c_v(x) "
                "to itself; use combine='replace' (optionally with scale) or another source"
            )
        if self.combine == "gated_add" and self.source != "bank":
            raise ValuePathError(
                f"{KEY}.combine='gated_add' needs {KEY}.source='bank' (got {self.source!r})"
            )
        if self.combine == "gated_add" and self.scale != "none":
            raise ValuePathError(
                f"{KEY}.combine='gated_add' has its own input-dependent gate; "
                f"{KEY}.scale must be 'none' (got {self.scale!r})"
            )
        if self.source != "bank" and (self.bank_shared or self.bank_init != "aligned"):
            raise ValuePathError(
                f"{KEY}.bank_shared / {KEY}.bank_init apply only to {KEY}.source='bank' "
                f"(got source={self.source!r}, bank_shared={self.bank_shared}, "
                f"bank_init={self.bank_init!r})"
            )
        if not self.fixed_coeff > 0:
            raise ValuePathError(f"{KEY}.fixed_coeff={self.fixed_coeff}; expected > 0")

    # -- derived structure ---------------------------------------------------------

    @property
    def is_baseline(self) -> bool:
        """True when every layer computes plain c_v(x)."""
        return self.source == "residual" and self.scale == "none"

    @property
    def uses_bank(self) -> bool:
        return self.source == "bank"

    @property
    def id_only(self) -> bool:
        """Target values depend on the token ids alone (no V cache is needed)."""
        return self.source == "bank" and self.combine == "replace"

    def target_layers(self, n_layer: int) -> tuple[int, ...]:
        """The target layers (spec 2.1); empty for the baseline."""
        if self.is_baseline:
            return ()
        rule = {
            "all": lambda i: True,
            "every_other": lambda i: i % 2 == (n_layer - 1) % 2,
            "second_half": lambda i: i >= n_layer // 2,
            "last_two_thirds": lambda i: i >= n_layer // 3,
            "last_third": lambda i: i >= (2 * n_layer) // 3,
        }[self.layers]
        skip_first = self.source == "v1"  # layer 0 produces V1
        return tuple(i for i in range(n_layer) if rule(i) and not (skip_first and i == 0))

    def owns_projection(self, is_target: bool) -> bool:
        """Whether a layer keeps its value projection c_v."""
        return not (is_target and self.combine == "replace" and self.source in ("v1", "bank"))

    def projection_calls(self, is_target: bool) -> int:
        """Matmuls by c_v per token: 2 when a target adds c_v(x) and c_v(x0n)."""
        if not self.owns_projection(is_target):
            return 0
        return 2 if is_target and self.source == "x0" and self.combine == "add" else 1

    def coefficient_names(self, is_target: bool) -> tuple[str, ...]:
        """Learned scalar parameters of a layer."""
        if not is_target or self.scale != "learned":
            return ()
        return ("gamma",) if self.combine == "replace" else ("alpha", "beta")
