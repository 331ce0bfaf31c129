"""Exchange parameters with the authors' PyTorch code: their checkpoints, or .npz files.

    python -m bov_jax.interop import --checkpoint_dir=DIR [--step=N] [--tokenizer=PATH] \
        [--data_dir=DIR] --workdir=OUT
    python -m bov_jax.interop export --workdir=RUN [--step=N] --out=DIR

`import` reads the authors' checkpoint directory (spec 9.2: model_{step:06d}.pt and
meta_{step:06d}.json, with the tokenizer beside them unless --tokenizer names it: tokenizer.pkl,
a pickled tiktoken Encoding as the authors write it, or tokenizer.model, a SentencePiece model)
without torch and without running anything its pickles name (bov_jax/interop/torch_format.py,
bov_jax/data/tiktoken_tokenizer.py). meta's model_type picks the preset (value path) and
model_config the sizes; OUT becomes a normal workdir (config.json, an Orbax checkpoint at
the same step with a fresh optimizer state, tokenizer/), so evals.bpb, evals.core and sample
run on it. It is built in a temporary directory renamed to OUT at the end: a failed import
leaves nothing. The tables keep the checkpoint's dtype (model.table_dtype). BPB uses
--data_dir's val split (default: the embedded corpus), encoded on the fly.
`export` writes the reverse: a .pt in the same format with every tensor in its trained dtype
(the authors' loader casts on load), its meta json (val_bpb as the run recorded it at that
step; user_config.bov_jax_model holds the run's whole model section, which `import` applies)
and the run's tokenizer, so export then import gives back the same weights bit for bit.

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

import dataclasses
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
from flax import nnx

from bov_jax import sharding
from bov_jax.accounting import training_plan
from bov_jax.config import config_from_record
from bov_jax.data.tiktoken_tokenizer import PICKLE_FILE
from bov_jax.data.tokenizer import MODEL_FILE, load_tokenizer
from bov_jax.errors import DataError, UserError
from bov_jax.files import atomic_directory, atomic_file, write_json_atomic
from bov_jax.interop.torch_format import read_state_dict, write_state_dict
from bov_jax.model.gpt import GPT
from bov_jax.model.spec import ModelSpec
from bov_jax.model.values import ValuePathSpec
from bov_jax.presets import PRESETS, config_for


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


def state_dict(model: GPT) -> dict[str, np.ndarray]:
    """The model's parameters as reference-named arrays (torch orientation, stored dtypes);
    dead value projections are zeros (fp32) so the authors' strict loader accepts them."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    arrays = {}
    for name, ours, transposed in _mapping(model):
        value = np.asarray(_get(params, ours))
        arrays[name] = value.T if transposed else value
    spec = model.spec
    for name in _dead_value_projections(model):
        arrays[name] = np.zeros((spec.kv_dim, spec.d_model), np.float32)
    return arrays


def load_state_dict(model: GPT, arrays: dict[str, np.ndarray], source: str) -> None:
    """Load reference-named arrays into `model` in place, cast to its parameters' dtypes.

    Raises ValueError naming `source` and every missing, unexpected or mis-shaped tensor.
    """
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
        raise ValueError(f"{source}: does not match this model's config: " + "; ".join(problems))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)


def export_npz(model: GPT, path: str) -> None:
    """Write the model's parameters as reference-named tensors (atomic)."""
    # .npz has no bf16: bf16 tables are written as the fp32 numbers they hold (exact).
    arrays = {
        name: value.astype(np.float32) if value.dtype == ml_dtypes.bfloat16 else value
        for name, value in state_dict(model).items()
    }
    with atomic_file(path) as out:
        np.savez(out, **arrays)


def import_npz(model: GPT, path: str, rename: dict[str, str] | None = None) -> None:
    """Load reference-named tensors from an .npz into `model` in place (see load_state_dict)."""
    with np.load(path) as f:
        arrays = {(rename or {}).get(k, k): f[k] for k in f.files}
    load_state_dict(model, arrays, path)


# ---------------------------------------------------------------------------------------------
# The authors' checkpoint directories (spec 9.2)

_MODEL_FILE = re.compile(r"model_(\d{6,})\.pt")
_MODEL_CONFIG_KEYS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_embd")


class _NoDataStreams:
    """An imported checkpoint has no data position."""

    count = 0
    iterators: dict = {}


def checkpoint_files(checkpoint_dir: Path, step: int | None) -> tuple[int, Path, Path]:
    """(step, model_*.pt, meta_*.json) of `step`, or of the latest step in the directory."""
    if not checkpoint_dir.is_dir():
        raise UserError(f"--checkpoint_dir={checkpoint_dir} is not a directory")
    if step is None:
        steps = [
            int(m[1]) for p in checkpoint_dir.iterdir() if (m := _MODEL_FILE.fullmatch(p.name))
        ]
        if not steps:
            raise UserError(f"{checkpoint_dir} holds no model_<step>.pt checkpoint")
        step = max(steps)
    model, meta = (
        checkpoint_dir / f"{kind}_{step:06d}{ext}"
        for kind, ext in (("model", ".pt"), ("meta", ".json"))
    )
    for path in (model, meta):
        if not path.is_file():
            raise UserError(f"{path} not found (step {step} of {checkpoint_dir})")
    return step, model, meta


def preset_for(model_type: str, depth: int) -> str:
    """Our preset for the reference's --model-type (the one of that depth if there is one)."""
    names = [name for name, p in PRESETS.items() if p.reference == model_type]
    if not names:
        known = sorted({p.reference for p in PRESETS.values()})
        raise UserError(f"meta model_type={model_type!r} is unknown; known: {', '.join(known)}")
    return next((n for n in names if PRESETS[n].depth == depth), names[0])


def reference_model_type(config: ml_collections.ConfigDict) -> str:
    """The reference --model-type whose value path is this config's."""
    value_path = ValuePathSpec.from_config(config.model.value_path)
    for preset in PRESETS.values():
        if preset.value_path == value_path:
            return preset.reference
    raise UserError(
        f"model.value_path {dataclasses.asdict(value_path)} is none of the reference's model types"
    )


def config_from_meta(meta: dict, table_dtype: str, source: Path) -> ml_collections.ConfigDict:
    """Our config for the authors' meta json (model_type, model_config)."""
    model_cfg = meta.get("model_config")
    if not isinstance(model_cfg, dict) or "model_type" not in meta:
        raise UserError(f"{source}: expected the keys model_type and model_config")
    missing = [k for k in _MODEL_CONFIG_KEYS if k not in model_cfg]
    if missing:
        raise UserError(f"{source}: model_config lacks {', '.join(missing)}")
    n_embd, n_head = int(model_cfg["n_embd"]), int(model_cfg["n_head"])
    if int(model_cfg.get("n_kv_head", n_head)) != n_head:
        raise UserError(f"{source}: n_kv_head != n_head (GQA) is not supported")
    config = config_for(preset_for(meta["model_type"], int(model_cfg["n_layer"])))
    config.model.update(
        depth=int(model_cfg["n_layer"]),
        model_dim=n_embd,
        head_dim=n_embd // n_head,
        vocab_size=int(model_cfg["vocab_size"]),
        seq_len=int(model_cfg["sequence_len"]),
        window_pattern=str(model_cfg.get("window_pattern", config.model.window_pattern)),
        table_dtype=table_dtype,
    )
    return config


def meta_from_config(
    config: ml_collections.ConfigDict, step: int, val_bpb: float | None = None
) -> dict:
    """The authors' meta json (spec 9.2) for a model of this config; user_config carries the
    whole model section for `import` (keys the authors' model_config has no field for)."""
    spec = ModelSpec.from_config(config.model)
    window = config.model.window_pattern
    return dict(
        step=step,
        val_bpb=val_bpb,
        model_type=reference_model_type(config),
        model_config=dict(
            sequence_len=spec.seq_len,
            vocab_size=spec.vocab_size,
            n_layer=spec.n_layer,
            n_head=spec.n_head,
            n_kv_head=spec.n_head,
            n_embd=spec.d_model,
            window_pattern=window,
        ),
        user_config={
            "exported_from": "bov_jax",
            "name": config.name,
            "bov_jax_model": config.model.to_dict(),
        },
        max_seq_len=spec.seq_len,
    )


TOKENIZER_FORMATS = (
    f"{PICKLE_FILE} (a pickled tiktoken Encoding, the authors' format) or {MODEL_FILE} "
    "(a SentencePiece model, as bov_jax runs and their exports use)"
)
DEVICE_KEYS = ("compute_dtype", "attention_impl", "table_dtype")  # chosen here, not carried


def find_tokenizer(checkpoint_dir: Path, tokenizer: str | Path | None) -> Path:
    """--tokenizer, else the tokenizer.pkl or tokenizer.model beside the checkpoint."""
    if tokenizer:
        candidates = [Path(tokenizer)]
    else:
        candidates = [checkpoint_dir / PICKLE_FILE, checkpoint_dir / MODEL_FILE]
    found = next((path for path in candidates if path.is_file()), None)
    if found is None or found.suffix not in (".pkl", ".model"):
        where = candidates[0] if tokenizer else f"no tokenizer beside {checkpoint_dir}"
        raise UserError(
            f"{where}: import takes {TOKENIZER_FORMATS}; pass --tokenizer=PATH to one of those"
        )
    return found


def config_of_export(config: ml_collections.ConfigDict, meta: dict) -> None:
    """A bov_jax export carries its run's model keys (user_config.bov_jax_model), including
    those the authors' meta has no field for: they are set on `config`, in place."""
    user = meta.get("user_config")
    carried = user.get("bov_jax_model") if isinstance(user, dict) else None
    if not isinstance(carried, dict):
        return
    recorded = json.loads(config.to_json_best_effort())
    recorded["model"].update({k: v for k, v in carried.items() if k not in DEVICE_KEYS})
    config.model = config_from_record(recorded).model


def import_checkpoint(
    checkpoint_dir: str | Path,
    workdir: str | Path,
    step: int | None = None,
    tokenizer: str | Path | None = None,
    data_dir: str | Path | None = None,
) -> int:
    """Turn the authors' checkpoint (or a bov_jax export) into a bov_jax workdir (see the
    module doc); its step. Everything is checked and written in a temporary directory that
    becomes `workdir` at the end, so a failed import leaves nothing."""
    from bov_jax.train.checkpoint import Checkpoints
    from bov_jax.train.state import create_train_state

    checkpoint_dir, workdir = Path(checkpoint_dir), Path(workdir).absolute()
    if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
        raise UserError(f"--workdir={workdir} exists and is not empty; import into a new one")
    step, model_file, meta_file = checkpoint_files(checkpoint_dir, step)
    tokenizer_file = find_tokenizer(checkpoint_dir, tokenizer)
    tensors = read_state_dict(model_file)
    wte = tensors.get("transformer.wte.weight")
    table_dtype = "bfloat16" if wte is not None and wte.dtype == ml_dtypes.bfloat16 else "float32"
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as err:
        raise UserError(f"{meta_file}: {err}") from err
    try:
        vocab = load_tokenizer(tokenizer_file).vocab_size
    except DataError as err:
        raise UserError(f"{err}; import takes {TOKENIZER_FORMATS}") from err
    config = config_from_meta(meta, table_dtype, meta_file)
    config_of_export(config, meta)
    if vocab != config.model.vocab_size:
        raise UserError(
            f"tokenizer {tokenizer_file} has {vocab} tokens but {meta_file} says vocab_size "
            f"{config.model.vocab_size}"
        )
    tokenizer_name = PICKLE_FILE if tokenizer_file.suffix == ".pkl" else MODEL_FILE
    config.data.tokenizer_dir = str(workdir / "tokenizer" / tokenizer_name)
    config.data.use_cache = False
    if data_dir:
        config.data.data_dir = str(Path(data_dir).absolute())
    config.mesh.update(data=1, fsdp=1, tensor=1)

    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    graphdef, state, _, _ = create_train_state(config, training_plan(config), mesh)
    model = nnx.merge(graphdef, state.params)
    try:
        load_state_dict(model, tensors, str(model_file))
    except ValueError as err:
        raise UserError(str(err)) from err
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    state = state._replace(step=jnp.asarray(step, jnp.int32), params=params)
    config_dict = json.loads(config.to_json_best_effort())
    with atomic_directory(workdir) as building:
        (building / "tokenizer").mkdir()
        shutil.copyfile(tokenizer_file, building / "tokenizer" / tokenizer_name)
        checkpoints = Checkpoints(building, keep=1, async_save=False)
        try:
            checkpoints.save(step, state, _NoDataStreams(), config_dict)
        finally:
            checkpoints.close()
        write_json_atomic(building / "config.json", config_dict)
    return step


def recorded_val_bpb(workdir: Path, step: int) -> float | None:
    """The val BPB the run recorded at `step` (metrics.jsonl), if it evaluated there."""
    from bov_jax.report.runs import read_metrics

    records, _ = read_metrics(workdir / "metrics.jsonl", [])
    return next((r["val_bpb"] for r in records if r["step"] == step), None)


def export_checkpoint(workdir: str | Path, out_dir: str | Path, step: int | None = None) -> Path:
    """Write a workdir's checkpoint as the authors' model_*.pt + meta_*.json; the .pt path."""
    from bov_jax.evals.loading import load_model_and_tokenizer
    from bov_jax.train.checkpoint import Checkpoints

    if step is None:
        checkpoints = Checkpoints(workdir, keep=10**6, async_save=False)
        try:
            step = checkpoints.latest_step()
        finally:
            checkpoints.close()
        if step is None:
            raise UserError(f"{workdir} holds no checkpoint")
    model, tokenizer, config = load_model_and_tokenizer(workdir, step)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_file = out_dir / f"model_{step:06d}.pt"
    write_state_dict(model_file, state_dict(model))
    meta = meta_from_config(config, step, recorded_val_bpb(Path(workdir), step))
    write_json_atomic(out_dir / f"meta_{step:06d}.json", meta)
    tokenizer_name = PICKLE_FILE if Path(tokenizer.path).suffix == ".pkl" else MODEL_FILE
    with atomic_file(out_dir / tokenizer_name) as out:
        out.write(Path(tokenizer.path).read_bytes())
    return model_file
