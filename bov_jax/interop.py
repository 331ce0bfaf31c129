"""Exchange parameters with the authors' PyTorch code as .npz files of state-dict tensors.

Name mapping (torch Linear weights are (out, in); Flax kernels are (in, out), so every
`*.weight` of a Linear is transposed; embedding tables are not):

  transformer.wte.weight                    (V, D)  <-> wte/embedding
  lm_head.weight                            (V, D)  <-> lm_head/kernel            (transposed)
  smear_gate.weight                         (1, 24) <-> smear_gate/kernel         (transposed)
  smear_lambda                              (1,)    <-> smear_lambda
  transformer.h.{i}.attn.c_{q,k}.weight             <-> blocks/{i}/attn/c_{q,k}/kernel
  transformer.h.{i}.attn.c_v.weight                 <-> blocks/{i}/attn/value/c_v/kernel
  transformer.h.{i}.attn.c_proj.weight              <-> blocks/{i}/attn/c_proj/kernel
  transformer.h.{i}.mlp.c_{fc,proj}.weight          <-> blocks/{i}/mlp/c_{fc,proj}/kernel
  transformer.h.{i}.attn.{gamma,alpha,beta}_v (1,)  <-> blocks/{i}/attn/value/{gamma,alpha,beta}
  transformer.h.{i}.attn.ve_gate.weight     (H, 12) <-> blocks/{i}/attn/value/ve_gate/kernel
  value_embeds.{i}.weight                   (V, K)  <-> blocks/{i}/attn/value/bank/embedding

The reference keeps a dead c_v in BoV/V1 target layers; import checks and drops it,
export writes zeros there so the authors' strict loader accepts the file. A shared
bank is stored once, under the first target layer's index. The variant-scalar and
value-table names follow the reference's attribute names; checkpoints with other
names can be renamed with `rename=` before import.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from bov_jax.model.gpt import GPT


def _mapping(model: GPT) -> Iterator[tuple[str, tuple, bool]]:
    """(reference name, our path as a key tuple, transposed?) for every parameter."""
    yield "transformer.wte.weight", ("wte", "embedding"), False
    yield "lm_head.weight", ("lm_head", "kernel"), True
    yield "smear_gate.weight", ("smear_gate", "kernel"), True
    yield "smear_lambda", ("smear_lambda",), False
    seen_banks = set()
    for i, block in enumerate(model.blocks):
        h = f"transformer.h.{i}"
        for name in ("c_q", "c_k", "c_proj"):
            yield f"{h}.attn.{name}.weight", ("blocks", i, "attn", name, "kernel"), True
        for name in ("c_fc", "c_proj"):
            yield f"{h}.mlp.{name}.weight", ("blocks", i, "mlp", name, "kernel"), True
        value = block.attn.value
        if hasattr(value, "c_v"):
            yield f"{h}.attn.c_v.weight", ("blocks", i, "attn", "value", "c_v", "kernel"), True
        for coef in ("gamma", "alpha", "beta"):
            if hasattr(value, coef):
                yield f"{h}.attn.{coef}_v", ("blocks", i, "attn", "value", coef), False
        if hasattr(value, "ve_gate"):
            path = ("blocks", i, "attn", "value", "ve_gate", "kernel")
            yield f"{h}.attn.ve_gate.weight", path, True
        if hasattr(value, "bank") and id(value.bank) not in seen_banks:
            seen_banks.add(id(value.bank))
            yield (
                f"value_embeds.{i}.weight",
                ("blocks", i, "attn", "value", "bank", "embedding"),
                False,
            )


def _dead_value_projections(model: GPT) -> list[str]:
    return [
        f"transformer.h.{i}.attn.c_v.weight"
        for i, block in enumerate(model.blocks)
        if not hasattr(block.attn.value, "c_v")
    ]


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def export_npz(model: GPT, path: str) -> None:
    """Write the model's parameters as reference-named tensors (atomic)."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    arrays = {}
    for name, ours, transposed in _mapping(model):
        value = np.asarray(_get(params, ours))
        arrays[name] = value.T if transposed else value
    spec = model.spec
    for name in _dead_value_projections(model):
        arrays[name] = np.zeros((spec.kv_dim, spec.d_model), np.float32)
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile(dir=directory, suffix=".npz", delete=False) as tmp:
        np.savez(tmp, **arrays)
    os.replace(tmp.name, path)


def import_npz(model: GPT, path: str, rename: dict[str, str] | None = None) -> None:
    """Load reference-named tensors into `model` in place.

    Raises ValueError naming the file and every missing, unexpected or mis-shaped tensor.
    """
    with np.load(path) as f:
        arrays = {(rename or {}).get(k, k): f[k] for k in f.files}
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    problems, used = [], set()
    for name, ours, transposed in _mapping(model):
        if name not in arrays:
            problems.append(f"missing {name}")
            continue
        used.add(name)
        value = arrays[name].T if transposed else arrays[name]
        current = _get(params, ours)
        if value.shape != current.shape:
            expected = current.shape[::-1] if transposed else current.shape
            problems.append(f"{name} has shape {arrays[name].shape}, expected {expected}")
            continue
        _set(params, ours, jnp.asarray(value, dtype=current.dtype))
    used.update(n for n in _dead_value_projections(model) if n in arrays)
    unexpected = sorted(set(arrays) - used)
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected)}")
    if problems:
        raise ValueError(f"{path}: does not match this model's config: " + "; ".join(problems))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
