"""Where do values stop needing context? R^2 of per-layer activations against a token-id table.

For each layer l of a trained model, on val text, the activations a_t (values v_l, and as
references the keys c_k(x) before rotary and the residual stream entering the layer) are
compared with their mean per token id:

    R^2 = 1 - sum_t ||a_t - mean_{id(t)}||^2 / sum_t ||a_t - mean||^2

(pooled over the vector's components). R^2 = 1 means a (vocab, dim) table reproduces the
layer exactly, as a Bank of Values does in its target layers; R^2 near 0 means the layer's
values are mostly context. Both sums are taken in float64 in a second pass over the same
tokens (no cancellation), so a layer whose activations depend on the id alone gives exactly 1.

Activations are captured with `nnx.capture(..., method_outputs=nnx.Intermediate)`: one forward
of the trained model, no second model and no hooks in the model code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bov_jax.files import write_json_atomic
from bov_jax.model.gpt import GPT

KINDS = ("values", "keys", "residual")


def layer_activations(model: GPT, tokens: jax.Array) -> dict[str, list[jax.Array]]:
    """{kind: L arrays (B, T, dim)}: values v_l, keys c_k(x_l) (pre-rotary) and the residual
    stream x_l entering each layer, from one captured forward of `model`."""
    _, captured = nnx.capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)(tokens)
    blocks = captured["blocks"]
    n = len(model.blocks)
    stream = [captured["smear"][0], *(blocks[i]["__call__"][0][0] for i in range(n - 1))]
    return {
        "values": [blocks[i]["attn"]["value"]["__call__"][0] for i in range(n)],
        "keys": [blocks[i]["attn"]["c_k"]["__call__"][0] for i in range(n)],
        "residual": stream,
    }


def stacked_activations(graphdef: Any, params: Any):
    """A jitted tokens (B, T) -> {kind: (L, B, T, dim) float32} of the merged model."""

    @jax.jit
    def forward(p, tokens):
        acts = layer_activations(nnx.merge(graphdef, p), tokens)
        return {k: jnp.stack(v).astype(jnp.float32) for k, v in acts.items()}

    return lambda tokens: forward(params, tokens)


@dataclasses.dataclass
class TokenTableFit:
    """Two-pass R^2 of vectors (N, D) against their mean per token id, for L layers at once.

    Holds L x vocab x D float64 sums (vocab: the distinct ids measured, a few thousand for
    16K tokens; about 0.4 GB per kind at d12).

    Ids are indices into the distinct ids measured (0..vocab-1). Pass 1 (`add_sums`)
    accumulates per-id sums and counts; pass 2 (`add_squares`), over the same batches in any
    order, the within-id and total sums of squares around the means of pass 1.
    """

    vocab: int
    layers: int
    dim: int

    def __post_init__(self):
        self.sums = np.zeros((self.layers, self.vocab, self.dim))
        self.counts = np.zeros(self.vocab, np.int64)
        self.within = np.zeros(self.layers)
        self.total = np.zeros(self.layers)
        self.means: tuple[np.ndarray, np.ndarray] | None = None  # set by the first add_squares

    def add_sums(self, ids: np.ndarray, acts: np.ndarray) -> None:
        """ids (N,) int, acts (L, N, D)."""
        np.add.at(self.counts, ids, 1)
        for layer in range(self.layers):
            np.add.at(self.sums[layer], ids, np.asarray(acts[layer], np.float64))

    def add_squares(self, ids: np.ndarray, acts: np.ndarray) -> None:
        if self.means is None:  # (L, vocab, D) per-id means, (L, 1, D) overall means
            per_id = self.sums / np.maximum(self.counts, 1)[None, :, None]
            overall = self.sums.sum(axis=1, keepdims=True) / self.counts.sum()
            self.means = per_id, overall
        per_id, overall = self.means
        for layer in range(self.layers):
            a = np.asarray(acts[layer], np.float64)
            self.within[layer] += np.square(a - per_id[layer][ids]).sum()
            self.total[layer] += np.square(a - overall[layer]).sum()

    def r_squared(self) -> np.ndarray:
        """(L,) R^2 per layer (nan where the activations do not vary at all)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.total > 0, 1.0 - self.within / self.total, np.nan)


def r_squared(ids: np.ndarray, acts: np.ndarray) -> float:
    """R^2 of vectors acts (N, D) against their mean per id (N,): one layer, in memory."""
    fit = TokenTableFit(int(ids.max()) + 1, 1, acts.shape[-1])
    fit.add_sums(ids, acts[None])
    fit.add_squares(ids, acts[None])
    return float(fit.r_squared()[0])


def token_table_r_squared(model: GPT, batches: Sequence[np.ndarray]) -> dict[str, list[float]]:
    """{kind: [R^2 per layer]} of a model over token batches (B, T) (each run twice)."""
    distinct = np.unique(np.concatenate([np.asarray(b).reshape(-1) for b in batches]))
    graphdef, params = nnx.split(model)
    forward = stacked_activations(graphdef, params)
    fits: dict[str, TokenTableFit] = {}
    for pass_index in range(2):
        for tokens in batches:
            acts = {k: np.asarray(v) for k, v in forward(tokens).items()}
            ids = np.searchsorted(distinct, np.asarray(tokens).reshape(-1))
            for kind in KINDS:
                a = acts[kind].reshape(acts[kind].shape[0], ids.size, -1)
                if kind not in fits:
                    fits[kind] = TokenTableFit(distinct.size, a.shape[0], a.shape[-1])
                if pass_index == 0:
                    fits[kind].add_sums(ids, a)
                else:
                    fits[kind].add_squares(ids, a)
    return {kind: [float(r) for r in fits[kind].r_squared()] for kind in KINDS}


def val_token_batches(config: Any, tokenizer: Any, tokens: int, rows: int) -> list[np.ndarray]:
    """About `tokens` val tokens as (rows, seq_len) int32 input batches (at least one)."""
    from bov_jax.data.pipeline import val_batches

    iterator = val_batches(config, tokenizer, rows)
    try:
        count = max(1, tokens // (rows * config.model.seq_len))
        return [next(iterator)["inputs"] for _ in range(count)]
    finally:
        iterator.close()


def values_figure(result: dict[str, Any], path: Path) -> Path:
    """R^2 per layer of values, keys and the residual stream; target layers shaded."""
    from bov_jax.report.figures import plt, save

    fig, ax = plt.subplots(figsize=(7, 4))
    layers = [row["layer"] for row in result["layers"]]
    for kind, style in zip(KINDS, ("o-", "s--", "^:")):
        ax.plot(layers, [row[kind] for row in result["layers"]], style, label=kind)
    for row in result["layers"]:
        if row["target"]:
            ax.axvspan(row["layer"] - 0.4, row["layer"] + 0.4, color="orange", alpha=0.15)
    ax.set_xlabel("layer (shaded: the value path's target layers)")
    ax.set_ylabel("R² against the mean per token id")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xticks(layers)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"{result['name']} step {result['step']}: {result['tokens']:,} val tokens")
    return save(fig, path)


def analyze_values(workdir: str | Path, tokens: int, rows: int, step: int | None) -> Path:
    """Measure a run's checkpoint; writes WORKDIR/analysis/values_step<N>.{json,png}."""
    from bov_jax.evals.loading import load_checkpoint

    step, model, tokenizer, config = load_checkpoint(workdir, step)
    batches = val_token_batches(config, tokenizer, tokens, rows)
    r2 = token_table_r_squared(model, batches)
    targets = set(model.spec.targets)
    result = {
        "name": config.name,
        "step": step,
        "tokens": sum(b.size for b in batches),
        "distinct_ids": int(len(np.unique(np.concatenate([b.reshape(-1) for b in batches])))),
        "value_path": config.model.value_path.to_dict(),
        "layers": [
            {"layer": i, "target": i in targets, **{k: r2[k][i] for k in KINDS}}
            for i in range(len(model.blocks))
        ],
    }
    out = Path(workdir) / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"values_step{step}.json"
    write_json_atomic(json_path, result)
    values_figure(result, out / f"values_step{step}.png")
    return json_path
