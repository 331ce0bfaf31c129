"""The config schema: reference defaults (spec sections 1, 3 and 5) and validation.

Every experiment config (configs/*.py) starts from `default_config()` and changes only
what differs. Keys are grouped by the module that consumes them. `validate_config`
checks the whole tree before anything is compiled and names the offending key.
"""

import contextlib
import dataclasses
import difflib
import importlib.util
import inspect
import math
import re
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from bov_jax.data.config import default_data_config
from bov_jax.data.mqar import default_mqar_config
from bov_jax.errors import ConfigError

AUTO_DEVICE_ROWS = 0  # train.device_batch_size: bov_jax/train/device_rows.py decides
FSDP_GATHER_MODES = ("auto", "step", "layer")  # mesh.fsdp_gather (bov_jax/train/fsdp.py)
REMAT_MODES = ("auto", "none", "blocks")  # train.remat (bov_jax/train/fsdp.py)


def value_path_config(
    source: str = "residual",
    combine: str = "replace",
    scale: str = "none",
    layers: str = "last_third",
    bank_shared: bool = False,
    bank_init: str = "aligned",
    fixed_coeff: float = 0.5,
) -> ml_collections.ConfigDict:
    """The value-path composition (see bov_jax/model/values.py).

    The defaults describe the baseline: every layer uses its own c_v(x).
    `fixed_coeff` is the constant on both terms of combine=add with scale=fixed
    (0.5 in the paper) and the constant on the source for combine=replace.
    """
    return ml_collections.ConfigDict(
        dict(
            source=source,
            combine=combine,
            scale=scale,
            layers=layers,
            bank_shared=bank_shared,
            bank_init=bank_init,
            fixed_coeff=fixed_coeff,
        )
    )


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "base"
    c.seed = 42

    m = c.model = ml_collections.ConfigDict()
    m.depth = 12
    m.aspect_ratio = 64
    m.head_dim = 128
    # 0 derives the width from depth * aspect_ratio rounded up to head_dim;
    # a positive value overrides it (small test and CPU models).
    m.model_dim = 0
    m.vocab_size = 32768
    m.pad_vocab_to = 64
    m.seq_len = 2048
    m.window_pattern = "SSSL"
    m.short_window = 0  # 0: ceil(seq_len / 4) rounded up to 128 (512 at 2048)
    m.rope_base = 100000.0
    m.qk_scale = 1.2
    m.mlp_ratio = 4
    m.smear_channels = 24
    m.logit_softcap = 15.0
    # Tokens (rows x time) per device per chunk of the chunked lm_head + softcap +
    # cross-entropy: the fp32 logits exist one chunk at a time, (chunk, padded vocab) on each
    # device, never for the whole batch.
    m.loss_chunk_tokens = 1024
    m.param_dtype = "float32"
    # "auto": bfloat16 on accelerators, float32 on CPU; cuDNN attention on GPUs, the splash
    # (Pallas) kernel on TPUs, XLA on CPUs.
    m.compute_dtype = "auto"
    m.attention_impl = "auto"  # auto | xla | cudnn | splash
    # Storage dtype of wte and the value banks, and of their AdamW moments and update math
    # (spec 1.5): "auto" is bfloat16 on accelerators like the reference, float32 on CPU.
    m.table_dtype = "auto"  # auto | float32 | bfloat16
    m.value_path = value_path_config()

    o = c.optim = ml_collections.ConfigDict()
    o.embedding_lr = 0.3
    o.unembedding_lr = 0.008
    o.matrix_lr = 0.02
    o.scalar_lr = 0.5
    o.smear_lr = 0.2
    o.value_table_lr_mult = 0.5
    o.alpha_lr_mult = 0.01
    o.weight_decay = 0.28
    # The reference scales Muon's weight decay by sqrt(B / B_ref) * D_ref / D (spec 3.4), with
    # the d12 model as anchor; far from that size (tiny CPU models) the rule gives decays > 1.
    o.scale_weight_decay = True
    o.adam_eps = 1e-10
    o.embedding_betas = (0.8, 0.995)
    o.unembedding_betas = (0.8, 0.96)
    o.value_table_betas = (0.8, 0.995)
    o.smear_betas = (0.8, 0.95)
    o.alpha_betas = (0.8, 0.95)
    o.beta_betas = (0.96, 0.95)
    o.embedding_wd = 0.001
    o.unembedding_wd = 0.01
    o.value_table_wd = 0.01
    o.alpha_wd = 0.05
    o.muon_ns_steps = 5
    o.muon_beta2 = 0.9
    o.muon_momentum_start = 0.85
    o.muon_momentum = 0.97
    o.muon_momentum_end = 0.90
    o.muon_momentum_warmup_steps = 400
    o.warmup_steps = 40
    o.warmdown_ratio = 0.65
    o.final_lr_frac = 0.05
    o.reference_d_model = 768
    o.reference_batch_tokens = 2**19

    t = c.train = ml_collections.ConfigDict()
    # Horizon precedence (spec 3.4): num_steps > target_flops > target_tokens >
    # target_param_data_ratio (which, like the reference, also anchors the auto batch size).
    t.num_steps = -1
    t.target_flops = -1.0
    t.target_tokens = -1
    t.target_param_data_ratio = 10.5
    t.total_batch_tokens = -1  # -1: the auto batch-size rule
    t.device_batch_size = 32  # AUTO_DEVICE_ROWS (0): the compiled rows for the chip
    t.stop_after_steps = -1  # end this invocation early (scheduler chunks)
    # Independent data streams (0: one per process). The data order depends on this number
    # only, so fixing it lets a run resume on another process count.
    t.data_streams = 0
    t.log_every = 1
    t.eval_every = 250
    t.eval_tokens = 80 * 2**19
    t.sample_every = 2000
    t.sample_tokens = 32  # a greedy sample every sample_every steps and at the end; 0: none
    # CORE at the end of training into WORKDIR/evals/core_step<N>.json (bundle: BOV_EVAL_BUNDLE,
    # default ~/.cache/bov_jax/eval_bundle): 0 off, N > 0 at most N examples per task, -1 all.
    t.core_at_end = 0
    t.skip_nonfinite = False
    t.profile_start_step = -1
    t.profile_num_steps = 0
    t.dump_hlo = False
    # Recompute each block's forward in the backward instead of keeping its activations
    # (bov_jax/train/fsdp.py): "blocks", "none", or "auto" (blocks where the state, the
    # step's compute copy and the activations would not fit in the chip's memory; never on CPU).
    t.remat = "auto"
    # TEST ONLY (fault injection): the update of this step comes out non-finite (its new
    # parameters times NaN), to exercise the non-finite policy end to end. -1: off.
    t.fault_nonfinite_step = -1

    mesh = c.mesh = ml_collections.ConfigDict()
    mesh.data = -1  # -1: all devices not used by the other axes
    mesh.fsdp = 1
    mesh.tensor = 1
    # When an fsdp mesh gathers the weights and reduces the gradients (bov_jax/train/fsdp.py):
    # "step" (once per step), "layer" (per block and micro-batch, for models whose compute
    # copy does not fit) or "auto" (step where the state and the step's copy, accumulator and
    # gradients fit in 65% of the chip's memory: fsdp.STEP_SHARE_OF_HBM).
    mesh.fsdp_gather = "auto"

    ck = c.checkpoint = ml_collections.ConfigDict()
    ck.save_every = 0  # 0: only at the end
    ck.keep = 2
    ck.async_save = True
    ck.fallback = False  # resume from the previous checkpoint if the latest one is damaged
    # Start from step 0 in a workdir whose checkpoints were all moved aside as damaged (refused
    # otherwise); the earlier metrics.jsonl is kept beside.
    ck.start_over = False
    # A workdir or step directory to take the parameters from (fine-tuning; optimizer, step and
    # data start fresh). Used only while this workdir has no checkpoint of its own.
    ck.init_params_from = ""
    # Comma-separated config keys that may differ from the checkpoint's on purpose, e.g.
    # "train.num_steps" to extend a finished run (the schedule's tail then changes).
    ck.allow_changes = ""

    c.data = default_data_config()
    return c


def key_paths(tree: ml_collections.ConfigDict, prefix: str = "") -> dict[str, object]:
    """{'train.num_steps': 200, ...}: every leaf of a config by its dotted path."""
    paths = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            paths.update(key_paths(value, path + "."))
        else:
            paths[path] = value
    return paths


ASSIGNMENT = re.compile(r"^\s*(\w+)\.(\w+) = [^#]*?(?:#\s*(.*))?$")
COMMENT = re.compile(r"^\s*#\s*(.*)$")


def _source_docs(function: object, sections: dict[str, str]) -> dict[str, str]:
    """{'train.num_steps': 'its comment'} from the `x.key = value  # comment` lines (or the
    comment lines just above) of a config function; `sections` maps variable -> key prefix."""
    docs, above = {}, []
    for line in inspect.getsource(function).splitlines():
        if comment := COMMENT.match(line):
            above.append(comment.group(1))
        elif (assign := ASSIGNMENT.match(line)) and assign.group(1) in sections:
            if doc := assign.group(3) or " ".join(above):
                docs[sections[assign.group(1)] + assign.group(2)] = doc
            above = []
        else:
            above = []
    return docs


# Docs of the keys whose assignment above carries no comment (shown by --show_config).
KEY_DOCS = {
    "name": "run name (logs only)",
    "seed": "initialisation and data-order seed",
    "model.depth": "transformer blocks",
    "model.aspect_ratio": "width per layer: model_dim = depth * aspect_ratio (rounded up)",
    "model.head_dim": "attention head width",
    "model.vocab_size": "tokenizer vocabulary (must match the tokenizer)",
    "model.pad_vocab_to": "embedding rows padded to a multiple of this",
    "model.seq_len": "tokens per training row",
    "model.window_pattern": "per-layer attention windows, S(hort)/L(ong), repeated",
    "model.rope_base": "rotary embedding base",
    "model.qk_scale": "scale of the normalised q.k logits",
    "model.mlp_ratio": "MLP hidden width / model width",
    "model.smear_channels": "channels of the smear gate's input",
    "model.logit_softcap": "logits = cap * tanh(logits / cap)",
    "model.param_dtype": "parameter and optimizer-state dtype",
    "model.value_path.source": "what feeds the target layers' values (see model/values.py)",
    "model.value_path.combine": "how the source meets c_v(x): replace, add, gated_add",
    "model.value_path.scale": "coefficients: none, fixed (fixed_coeff) or learned",
    "model.value_path.layers": "which layers are targets (last_third, every_other, ...)",
    "model.value_path.bank_shared": "one bank for every target layer",
    "model.value_path.bank_init": "bank init: aligned or uniform",
    "model.value_path.fixed_coeff": "the constant of scale=fixed",
    "optim.embedding_lr": "AdamW lr of wte (and, x value_table_lr_mult, of the banks)",
    "optim.unembedding_lr": "AdamW lr of lm_head",
    "optim.matrix_lr": "Muon lr of the blocks' 2-D kernels",
    "optim.scalar_lr": "AdamW lr of the beta/gamma coefficients (alpha: x alpha_lr_mult)",
    "optim.smear_lr": "AdamW lr of the smear gate and lambda",
    "optim.value_table_lr_mult": "bank lr = embedding_lr x this",
    "optim.alpha_lr_mult": "alpha lr = scalar_lr x this",
    "optim.weight_decay": "Muon's cautious weight decay",
    "optim.adam_eps": "AdamW epsilon",
    "optim.embedding_betas": "AdamW (beta1, beta2) of wte",
    "optim.unembedding_betas": "AdamW (beta1, beta2) of lm_head",
    "optim.value_table_betas": "AdamW (beta1, beta2) of the banks",
    "optim.smear_betas": "AdamW (beta1, beta2) of the smear",
    "optim.alpha_betas": "AdamW (beta1, beta2) of alpha",
    "optim.beta_betas": "AdamW (beta1, beta2) of beta/gamma",
    "optim.embedding_wd": "AdamW weight decay of wte",
    "optim.unembedding_wd": "AdamW weight decay of lm_head",
    "optim.value_table_wd": "AdamW weight decay of the banks",
    "optim.alpha_wd": "AdamW weight decay of alpha",
    "optim.muon_ns_steps": "Polar Express iterations",
    "optim.muon_beta2": "NorMuon second-moment EMA",
    "optim.muon_momentum_start": "Muon momentum at step 0",
    "optim.muon_momentum": "Muon momentum after the warmup",
    "optim.muon_momentum_end": "Muon momentum at the end of the warmdown",
    "optim.muon_momentum_warmup_steps": "steps from momentum_start to momentum",
    "optim.warmup_steps": "linear lr warmup steps",
    "optim.warmdown_ratio": "fraction of the run with the lr decaying to final_lr_frac",
    "optim.final_lr_frac": "lr multiplier at the last step",
    "optim.reference_d_model": "width the lrs are tuned for (lr x (d / this)^-0.5)",
    "optim.reference_batch_tokens": "batch the lrs are tuned for (lr x sqrt(B / this))",
    "train.target_flops": "horizon in FLOPs (-1: unset)",
    "train.target_tokens": "horizon in tokens (-1: unset)",
    "train.target_param_data_ratio": "horizon as tokens per scaling parameter",
    "train.device_batch_size": "rows per device per micro-batch (accumulation fills the rest; "
    "0: the compiled rows for the chip, bov_jax/train/device_rows.py)",
    "train.log_every": "steps between log lines",
    "train.eval_every": "steps between val BPB evaluations",
    "train.eval_tokens": "val tokens per evaluation",
    "train.sample_every": "steps between greedy samples in the log",
    "train.sample_tokens": "tokens per sample (0: no samples)",
    "train.core_at_end": "CORE examples per task at the end of training (0: off, -1: all)",
    "train.skip_nonfinite": "redraw a batch whose step is non-finite instead of stopping",
    "train.profile_start_step": "first step of a jax.profiler trace (-1: off)",
    "train.profile_num_steps": "steps traced",
    "train.dump_hlo": "write the compiled step's HLO to the workdir",
    "mesh.fsdp": "devices the parameters are sharded over (-1: the rest)",
    "mesh.tensor": "devices of tensor parallelism (-1: the rest)",
    "checkpoint.keep": "newest checkpoints kept",
    "checkpoint.async_save": "save in the background while training goes on",
}


def describe_keys(
    config: ml_collections.ConfigDict | None = None,
) -> list[tuple[str, object, str]]:
    """(key, value, one-line doc) of every key of `config` (default: the schema's defaults),
    the docs from the comments in this file, bov_jax/data/config.py and bov_jax/data/mqar.py."""
    sections = dict(c="", m="model.", o="optim.", t="train.", mesh="mesh.", ck="checkpoint.")
    docs = (
        KEY_DOCS
        | _source_docs(default_config, sections)
        | _source_docs(default_data_config, {"c": "data."})
        | _source_docs(default_mqar_config, {"c": "data.mqar."})
    )
    values = key_paths(default_config() if config is None else config)
    return [(key, value, docs.get(key, "")) for key, value in values.items()]


@dataclasses.dataclass(frozen=True)
class Range:
    """The allowed values of a numeric key: `low` <= value (< `low` if `open_low`),
    value <= `high` (< `high` if `open_high`), or the documented `sentinel`."""

    low: float
    high: float = math.inf
    open_low: bool = False
    open_high: bool = False
    sentinel: float | None = None
    sentinel_meaning: str = ""
    integer: bool = True

    def accepts(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.sentinel is not None and value == self.sentinel:
            return True
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):  # inf passes `<= inf`; NaN fails every comparison anyway
            return False
        above = value > self.low if self.open_low else value >= self.low
        below = value < self.high if self.open_high else value <= self.high
        return above and below  # False for NaN

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        low = f"{'>' if self.open_low else '>='} {self.low:g}"
        high = (
            "" if self.high == math.inf else f" and {'<' if self.open_high else '<='} {self.high:g}"
        )
        text = f"{kind} {low}{high}"
        if self.sentinel is not None:
            text = f"{self.sentinel:g} ({self.sentinel_meaning}) or {text}"
        return text


POSITIVE = Range(1)
NON_NEGATIVE = Range(0)
POSITIVE_REAL = Range(0, open_low=True, integer=False)
NON_NEGATIVE_REAL = Range(0, integer=False)
FRACTION = Range(0, 1, integer=False)
BETA = Range(0, 1, open_high=True, integer=False)
DERIVED = "derived from the other keys"

# Every numeric key outside config.data (validated by bov_jax.data.config). A sentinel is the
# one out-of-range value with a documented meaning; any other out-of-range value is refused.
RANGES: dict[str, Range] = {
    "seed": NON_NEGATIVE,
    "model.depth": POSITIVE,
    "model.aspect_ratio": POSITIVE,
    "model.head_dim": POSITIVE,
    "model.model_dim": Range(1, sentinel=0, sentinel_meaning="derive from depth"),
    "model.vocab_size": POSITIVE,
    "model.pad_vocab_to": POSITIVE,
    "model.seq_len": POSITIVE,
    "model.short_window": Range(1, sentinel=0, sentinel_meaning=DERIVED),
    "model.rope_base": POSITIVE_REAL,
    "model.qk_scale": POSITIVE_REAL,
    "model.mlp_ratio": POSITIVE,
    "model.smear_channels": POSITIVE,
    "model.logit_softcap": POSITIVE_REAL,
    "model.loss_chunk_tokens": POSITIVE,
    "model.value_path.fixed_coeff": Range(-math.inf, integer=False),
    "optim.embedding_lr": NON_NEGATIVE_REAL,
    "optim.unembedding_lr": NON_NEGATIVE_REAL,
    "optim.matrix_lr": NON_NEGATIVE_REAL,
    "optim.scalar_lr": NON_NEGATIVE_REAL,
    "optim.smear_lr": NON_NEGATIVE_REAL,
    "optim.value_table_lr_mult": NON_NEGATIVE_REAL,
    "optim.alpha_lr_mult": NON_NEGATIVE_REAL,
    "optim.weight_decay": NON_NEGATIVE_REAL,
    "optim.adam_eps": POSITIVE_REAL,
    "optim.embedding_wd": NON_NEGATIVE_REAL,
    "optim.unembedding_wd": NON_NEGATIVE_REAL,
    "optim.value_table_wd": NON_NEGATIVE_REAL,
    "optim.alpha_wd": NON_NEGATIVE_REAL,
    "optim.muon_ns_steps": POSITIVE,
    "optim.muon_beta2": BETA,
    "optim.muon_momentum_start": BETA,
    "optim.muon_momentum": BETA,
    "optim.muon_momentum_end": BETA,
    "optim.muon_momentum_warmup_steps": NON_NEGATIVE,
    "optim.warmup_steps": NON_NEGATIVE,
    "optim.warmdown_ratio": FRACTION,
    "optim.final_lr_frac": NON_NEGATIVE_REAL,
    "optim.reference_d_model": POSITIVE,
    "optim.reference_batch_tokens": POSITIVE,
    "train.num_steps": Range(1, sentinel=-1, sentinel_meaning="derive from the targets"),
    "train.target_flops": Range(
        0, open_low=True, integer=False, sentinel=-1, sentinel_meaning="unset"
    ),
    "train.target_tokens": Range(1, sentinel=-1, sentinel_meaning="unset"),
    "train.target_param_data_ratio": POSITIVE_REAL,
    "train.total_batch_tokens": Range(1, sentinel=-1, sentinel_meaning="the auto batch rule"),
    "train.device_batch_size": Range(
        1, sentinel=0, sentinel_meaning="auto: the compiled rows for the chip (docs/targets.md)"
    ),
    "train.stop_after_steps": Range(1, sentinel=-1, sentinel_meaning="off"),
    "train.data_streams": Range(1, sentinel=0, sentinel_meaning="one per process"),
    "train.log_every": POSITIVE,
    "train.eval_every": POSITIVE,
    "train.eval_tokens": POSITIVE,
    "train.sample_every": POSITIVE,
    "train.sample_tokens": Range(1, sentinel=0, sentinel_meaning="no samples"),
    "train.core_at_end": Range(0, sentinel=-1, sentinel_meaning="every example of every task"),
    "train.profile_start_step": Range(0, sentinel=-1, sentinel_meaning="off"),
    "train.profile_num_steps": NON_NEGATIVE,
    "train.fault_nonfinite_step": Range(0, sentinel=-1, sentinel_meaning="off"),
    "mesh.data": Range(1, sentinel=-1, sentinel_meaning="all remaining devices"),
    "mesh.fsdp": Range(1, sentinel=-1, sentinel_meaning="all remaining devices"),
    "mesh.tensor": Range(1, sentinel=-1, sentinel_meaning="all remaining devices"),
    "checkpoint.save_every": Range(1, sentinel=0, sentinel_meaning="only at the end"),
    "checkpoint.keep": POSITIVE,
}
BETA_PAIRS = tuple(
    f"optim.{name}_betas"
    for name in ("embedding", "unembedding", "value_table", "smear", "alpha", "beta")
)


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
    """Re-raise the ValueErrors of code that resolves config values as ConfigErrors."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from err


def check_keys(given: dict[str, object], known: dict[str, object]) -> None:
    """Raise ConfigError for unknown keys (with the closest known key) or missing ones."""
    parts = []
    for key in sorted(set(given) - set(known)):
        close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
        parts.append(
            f"unknown config key {key}" + (f" (did you mean {close[0]}?)" if close else "")
        )
    missing = sorted(set(known) - set(given))
    if missing:
        parts.append(f"missing config keys: {', '.join(missing)}")
    if parts:
        raise ConfigError("; ".join(parts))


def check_ranges(given: dict[str, object]) -> None:
    """Raise ConfigError naming the first numeric key outside its range (NaN included)."""
    for key, allowed in RANGES.items():
        if not allowed.accepts(given[key]):
            raise ConfigError(f"{key}={given[key]!r}; expected {allowed.describe()}")
    for key in BETA_PAIRS:
        value = given[key]
        if len(value) != 2 or not all(BETA.accepts(b) for b in value):
            raise ConfigError(f"{key}={value!r}; expected two numbers in [0, 1)")


def config_from_record(recorded: dict) -> ml_collections.ConfigDict:
    """The config of a run from its config.json: the schema's defaults with every recorded key
    set. Entries the schema lacks (the data fingerprint `data_files`) are left out, and keys
    added to the schema since the run was recorded keep their defaults."""

    def overlay(base: ml_collections.ConfigDict, values: dict) -> None:
        for key, value in values.items():
            if key not in base:
                continue
            if isinstance(value, dict):
                overlay(base[key], value)
            else:
                base[key] = tuple(value) if isinstance(value, list) else value

    config = default_config()
    overlay(config, recorded)
    return config


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Check a config against the schema before anything is compiled.

    Raises ConfigError naming every unknown or missing key, and any key whose value is
    out of range (the model keys through ModelSpec, the horizon through the plan).
    """
    from bov_jax.accounting import training_plan

    given = key_paths(config)
    check_keys(given, key_paths(default_config()))
    check_ranges(given)
    for key, choices in (("train.remat", REMAT_MODES), ("mesh.fsdp_gather", FSDP_GATHER_MODES)):
        if given[key] not in choices:
            raise ConfigError(f"{key}={given[key]!r}; expected one of " + ", ".join(choices))
    for key in config.checkpoint.allow_changes.split(","):
        if key.strip() and key.strip() not in given:
            close = difflib.get_close_matches(key.strip(), list(given), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"checkpoint.allow_changes names an unknown key {key.strip()}{hint}")
    with config_errors():
        training_plan(config)  # resolves the model spec, horizon and batch size


CONFIG_FLAG = "--config"


def define_config_flag() -> flags.FlagHolder:
    """The --config flag of the commands that take an experiment (main, prepare): a config
    file, optionally with a preset, and --config.<key>=<value> overrides. Pair it with
    `cli.run(main, check_argv=check_config_arguments)`."""
    return config_flags.DEFINE_config_file(
        "config",
        None,
        "Experiment config file, optionally with a preset: configs/quickstart.py or "
        "configs/ablations.py:<preset>. Override keys with --config.<key>=<value>; "
        "--show_config lists them.",
        lock_config=True,
    )


def config_key_paths() -> list[str]:
    """Every config key as a dotted path (train.num_steps, ...)."""
    return sorted(key_paths(default_config()))


def unknown_key_message(key: str, known: list[str], where: str) -> str:
    """'unknown config key train.num_step (where); did you mean train.num_steps?'"""
    message = f"unknown config key {key} ({where})"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:  # a typo in the last part only: compare the leaf names
        leaves = {k.rsplit(".", 1)[-1]: k for k in known}
        close = [leaves[m] for m in difflib.get_close_matches(key.rsplit(".", 1)[-1], leaves, 1)]
    if close:
        message += f"; did you mean {close[0]}?"
    return message + " (--show_config lists every key)"


SECTIONS = ("data", "model", "optim", "train", "mesh", "checkpoint")
EXPECTED_CONFIG = "an ml_collections.ConfigDict with the sections " + ", ".join(SECTIONS)
CONFIG_HINT = "hint: start from bov_jax.config.default_config() or bov_jax.presets.config_for()"
CAUSE_CHARS = 90  # an error line names the file and the cause in about 200 characters


def _cause(err: BaseException) -> str:
    """'ValueError: the first line of its message', cut to CAUSE_CHARS."""
    message = err.args[0] if isinstance(err, KeyError) and err.args else err  # not its repr
    lines = str(message).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 3] + "..."


def _line_in(err: BaseException, path: Path) -> str:
    """', line N': the last line of the config file `path` in err's traceback ('' if none)."""
    frames = traceback.extract_tb(err.__traceback__)
    lines = [f.lineno for f in frames if Path(f.filename).resolve() == path.resolve()]
    return f", line {lines[-1]}" if lines else ""


def load_python_file(path: str | Path, what: str) -> Any:
    """Import a user's Python file (a config or sweep file) as a module; a missing file, a
    syntax error or an exception while importing it (a missing module) is one ConfigError
    naming `what` and the file, and its line where there is one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path}: no such file")
    module_spec = importlib.util.spec_from_file_location(f"bov_jax_user_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as err:
        if err.filename and Path(err.filename).resolve() == path.resolve():
            raise ConfigError(f"{what} {path}, line {err.lineno}: syntax error: {err.msg}") from err
        raise ConfigError(f"{what} {path}{_line_in(err, path)}: {_cause(err)}") from err
    except Exception as err:  # a user's file: name it and the cause, in one line
        raise ConfigError(
            f"{what} {path}{_line_in(err, path)} failed to load: {_cause(err)}"
        ) from err
    return module


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """The config of `spec`, 'path.py' or 'path.py:preset': the file's get_config(preset).

    The one loader of every command that takes a config file (--config, the bench's --configs,
    the sweep's runs). Each way a file can be wrong is one ConfigError that names the file
    (and its line, where there is one) and what was expected: missing or unreadable, a syntax
    error, an exception while importing it (a missing module) or inside get_config, no
    get_config, and a result that is not a ConfigDict with the schema's sections. The
    original exception is chained (--debug shows its traceback). Returns the config locked
    (keys may change, none may be added), as ml_collections' --config flag does.
    """
    path_text, _, preset = spec.partition(":")
    path = Path(path_text)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found (--config={spec})")
    module = load_python_file(path, "config file")
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(
            f"config file {path} defines no get_config(); expected one returning {EXPECTED_CONFIG}"
            f"\n{CONFIG_HINT}"
        )
    call = f"get_config({preset!r})" if preset else "get_config()"
    try:
        config = get_config(preset) if preset else get_config()
    except ConfigError as err:  # ours (an unknown preset): its message is already one line
        raise ConfigError(f"config file {path}: {err}") from err
    except Exception as err:  # a user's function
        raise ConfigError(
            f"config file {path}{_line_in(err, path)}: {call} raised {_cause(err)}"
        ) from err
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(
            f"config file {path}: {call} returned {type(config).__name__}; expected "
            f"{EXPECTED_CONFIG}\n{CONFIG_HINT}"
        )
    missing = [
        name for name in SECTIONS if not isinstance(config.get(name), ml_collections.ConfigDict)
    ]
    if missing:
        raise ConfigError(
            f"config file {path}: {call} returned a ConfigDict without the section"
            f"{'s' if len(missing) > 1 else ''} {', '.join(missing)}\n{CONFIG_HINT}"
        )
    config.lock()
    return config


def config_file_arguments(argv: list[str]) -> list[str]:
    """The values of --config in `argv`, as --config=FILE or --config FILE."""
    values = []
    for i, arg in enumerate(argv):
        if arg.startswith(CONFIG_FLAG + "="):
            values.append(arg.partition("=")[2])
        elif arg == CONFIG_FLAG and i + 1 < len(argv):
            values.append(argv[i + 1])
    return values


def check_config_arguments(argv: list[str]) -> None:
    """Before absl loads the config: the file of --config loads to a config with every
    section (`load_config_file`), every --config.<key> is known."""
    for value in config_file_arguments(argv[1:]):
        load_config_file(value)
    known = None
    for arg in argv[1:]:
        name, _, value = arg.partition("=")
        if name.startswith(CONFIG_FLAG + "."):
            known = known if known is not None else config_key_paths()
            key = name[len(CONFIG_FLAG) + 1 :]
            if key not in known:
                raise ConfigError(unknown_key_message(key, known, arg))
